"""Preflight's look at the user's own model, before any process starts: a .pt2 told apart (exported program or
AOTInductor package) and its inputs read, and one forward of a tiny batch of generated inputs, so that a model that
cannot take them, or whose output the server cannot split per request, is refused in one line naming the input
and the error. Each refusal is a ValueError. Its checks take the whole config: they are checks of the config itself.

The model is built and its forward run in a child process (this module run as a script), bounded by
--warmup_timeout_s: the user's code may exit, abort, hang or raise anything, and none of it may reach the server."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from serverbench.backend.models import build_model
from serverbench.backend.outputs import check_output
from serverbench.backend.sources import (
    aoti_problem,
    check_inputs_match,
    check_program_batch,
    cuda_headers_problem,
    load_aoti,
    load_program,
    program_inputs,
    pt2_kind,
)
from serverbench.config.inputs import InputSpec, is_image_input
from serverbench.config.options import BenchConfig
from serverbench.system.process import end_with_parent
from serverbench.system.scratch import children_temp_folder
from serverbench.transport.pool import make_input, new_generator
from serverbench.transport.tensors import as_tensor

PROBE_ROWS = 2  # samples in the probe's batch: enough to see a batch dimension, cheap for any model


def resolve_pt2(cfg: BenchConfig) -> BenchConfig:
    """A .pt2 --model: its absolute path, and its inputs (a program's own, with --input's ranges where given; a
    package's from --input, which it needs). Checks what a .pt2 cannot do."""
    path = str(Path(cfg.model).expanduser().resolve())
    kind = pt2_kind(path)
    if cfg.precision in ("bf16", "fp16") or cfg.channels_last:
        flag = f"--precision {cfg.precision}" if cfg.precision in ("bf16", "fp16") else "--channels_last"
        raise ValueError(f"{flag}: a .pt2 --model's dtypes and layout were fixed when it was exported; export it so")
    if kind == "aoti":
        if cfg.compile or cfg.aoti:
            flag = "--compile" if cfg.compile else "--aoti"
            raise ValueError(f"{flag}: --model {cfg.model} is an AOTInductor package, compiled already")
        if not cfg.inputs:
            raise ValueError(
                f"--model {cfg.model} is an AOTInductor package, which does not say what its inputs are: describe "
                "them with --input name:dtype:shape[:low-high] (or serve the exported program it was made from)"
            )
        return dataclasses.replace(cfg, model=path)
    found = program_inputs(load_program(path), cfg.model)
    check_program_batch(found, cfg.model, cfg.batch_size, cfg.formed_rows)
    if cfg.inputs:
        check_inputs_match(cfg.inputs, found.specs, cfg.model)
    return dataclasses.replace(cfg, model=path, inputs=cfg.inputs or found.specs)


def _cpu_package(path: str) -> bool:
    """Whether the package's metadata names the CPU, read from the archive without loading any code."""
    import zipfile

    with zipfile.ZipFile(path) as archive:
        for name in archive.namelist():
            if name.endswith("_metadata.json") and "/data/aotinductor/" in name:
                try:
                    return json.loads(archive.read(name)).get("AOTI_DEVICE_KEY", "cpu") == "cpu"
                except ValueError:
                    continue
    return True


def check_aoti(cfg: BenchConfig) -> None:
    """--aoti or an AOTInductor package: what it needs on this machine and device."""
    problem = aoti_problem()
    if problem is not None:
        raise ValueError(f"{'--aoti' if cfg.aoti else '--model ' + cfg.model}: {problem}")
    if cfg.is_cuda and cfg.aoti:
        problem = cuda_headers_problem()
        if problem is not None:
            raise ValueError(f"--aoti on {cfg.device}: {problem}")
    if cfg.model.endswith(".pt2") and pt2_kind(cfg.model) == "aoti":
        compiled_for = "cpu" if _cpu_package(cfg.model) else "cuda"
        if compiled_for != ("cuda" if cfg.is_cuda else "cpu"):
            raise ValueError(
                f"--model {cfg.model}: an AOTInductor package compiled for {compiled_for}, and this run's device is "
                f"{cfg.device}; package it for this device"
            )


def probe_forward(cfg: BenchConfig) -> None:
    """One forward of PROBE_ROWS samples (the static batch of a program exported with one) of generated inputs on
    the CPU, for a factory, an exported program or a CPU AOTInductor package, in a child process: ValueError naming
    what failed."""
    if cfg.wire_dtype == "uint8" and not (len(cfg.model_inputs) == 1 and is_image_input(cfg.model_inputs[0])):
        raise ValueError(
            "--wire_dtype uint8 sends raw pixels of one float32 [3, H, W] image input; this model's inputs are "
            f"{', '.join(spec.describe() for spec in cfg.model_inputs)}: use --wire_dtype float32"
        )
    if cfg.model.endswith(".pt2") and pt2_kind(cfg.model) == "aoti":
        if _cpu_package(cfg.model):  # a GPU package runs on the GPU only: its first forward is the check
            # A static batch takes only its own size; with dynamic batching the package must take a full batch too.
            for rows in sorted({cfg.batch_size, cfg.formed_rows}):
                probe_in_child(cfg, rows, package=True)
        return
    rows = min(cfg.batch_size, PROBE_ROWS)
    if cfg.model.endswith(".pt2"):
        rows = cfg.batch_size  # a static batch takes only its own size; a dynamic one took it in resolve_pt2
    probe_in_child(cfg, rows, package=False)


def forward_problem(model: Callable[..., object], specs: tuple[InputSpec, ...], rows: int, seed: int) -> str | None:
    """Why one forward of `rows` samples of generated inputs fails or gives an output the server cannot split, or
    None."""
    generator = new_generator(seed)
    inputs = tuple(as_tensor(make_input(spec, rows, "float32", generator), spec.dtype) for spec in specs)
    try:
        with torch.inference_mode():
            output = model(*inputs)
    except Exception as exc:  # noqa: BLE001 - the user's forward may raise anything
        return f"{_forward_lead(specs, rows)}: {type(exc).__name__}: {_line(exc)}"
    return check_output(output, rows)


# The child's words to the parent, one per line on the child's stdout (the model's own prints go to its stderr).
STAGE = "probe-stage: "  # what it starts now: BUILD or FORWARD
BUILD, FORWARD = "build", "forward"
PROBE_ERROR = "probe-error: "  # the refusal, when Python saw the failure
PROBE_OK = "probe-ok"
STOP_WAIT_S = 5.0  # for the output of a child killed at its time limit
PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # the folder holding serverbench/


def probe_in_child(cfg: BenchConfig, rows: int, package: bool) -> None:
    """The model built (a factory imported and called, a program or package loaded) and its first forward of `rows`
    samples, in a child process, so that nothing the user's code does reaches the server: an exit, a signal, an
    abort (an AOTInductor kernel's failure is a C++ exception nothing catches), a KeyboardInterrupt, a hang. The
    child runs in its own session, killed with everything it started on any way out of here (an interrupt too), and
    with the server if that dies (PDEATHSIG). ValueError of one line naming the stage and what happened."""
    inputs = [[s.name, s.dtype, list(s.shape), s.low, s.high] for s in cfg.model_inputs]
    spec = {"model": cfg.model, "package": package, "checkpoint": cfg.checkpoint, "kwargs": cfg.model_kwargs}
    # The server's import path, as multiprocessing gives the backend's (server.py's folder first): the probe imports
    # the model from where the backend will.
    spec.update(inputs=inputs, rows=rows, seed=cfg.seed, sys_path=sys.path)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (PACKAGE_ROOT, env.get("PYTHONPATH"))))  # this module's, anywhere
    if package:  # the runtime checks the inputs' shapes only when asked; one thread: a kernel's failure on several
        env.update(AOTI_RUNTIME_CHECK_INPUTS="1", OMP_NUM_THREADS="1")  # OpenMP threads aborts before any says what
    # The limit is --warmup_timeout_s: the backend has that long for the same work (torch's import, the build, the
    # first forward) before its warm-up answer, so a model the check gives up on could not have warmed up either.
    limit_s = cfg.warmup_timeout_s
    with children_temp_folder() as temp_environment:  # a package it loads is extracted there, and goes with it
        env.update(temp_environment)
        said, told, returncode, timed_out = _run_probe(env, json.dumps(spec), limit_s)
    lines = said.splitlines()
    errors = [line[len(PROBE_ERROR) :] for line in lines if line.startswith(PROBE_ERROR)]
    if errors:
        raise ValueError(errors[-1])
    if PROBE_OK in lines and returncode == 0:
        return
    stages = [line[len(STAGE) :] for line in lines if line.startswith(STAGE)]
    stage = stages[-1] if stages else None
    if timed_out:
        raise ValueError(
            f"--model {cfg.model}: {_doing(cfg.model, cfg.model_inputs, rows, stage)} did not finish within "
            f"--warmup_timeout_s {limit_s:g} s (the time its warm-up has); make it faster or raise --warmup_timeout_s"
        )
    how = f"signal {-returncode}" if returncode < 0 else f"exit {returncode}"
    lead = _failed(cfg.model, cfg.model_inputs, rows, stage)
    raise ValueError(f"--model {cfg.model}: {lead}: the process ended ({how}): {_last_words(told)[:300]}")


def _run_probe(env: dict[str, str], spec: str, limit_s: float) -> tuple[str, str, int, bool]:
    """The probe child run to its end or limit_s with `spec` on its stdin: its stdout, its stderr, its exit status
    and whether it ran out of time. Its session is killed on every way out (an interrupt too)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "serverbench.backend.probe"],
        stdin=subprocess.PIPE,  # the spec: any size (--model_kwargs may be long), unlike an argument
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        errors="replace",  # the model's output may be any bytes
        env=env,
        start_new_session=True,  # a Ctrl-C is the server's to act on; and the group is killed whole
        preexec_fn=end_with_parent(signal.SIGKILL),
    )
    timed_out = False
    try:
        try:
            said, told = proc.communicate(spec, timeout=limit_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_session(proc)
            said, told = _output_after_kill(proc)
    finally:
        _kill_session(proc)  # whatever the model's code started, and the child itself when interrupted
    return said, told, proc.returncode, timed_out


def _kill_session(proc: subprocess.Popen) -> None:
    """The child's session killed (the child leads it) and the child reaped."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=STOP_WAIT_S)


def _output_after_kill(proc: subprocess.Popen) -> tuple[str, str]:
    """What the killed child wrote, unless something it started outside its session still holds the pipes."""
    try:
        return proc.communicate(timeout=STOP_WAIT_S)
    except subprocess.TimeoutExpired:
        return "", ""


def _doing(model: str, specs: tuple[InputSpec, ...], rows: int, stage: str | None) -> str:
    """What the child was doing at `stage` (None: before the model, still importing torch)."""
    if stage == FORWARD:
        return f"its first forward ({_described(specs, rows)})"
    if stage == BUILD and ":" in model and not model.endswith(".pt2"):
        module, _, factory = model.rpartition(":")
        return f"building it (importing {module}, calling {factory})"
    if stage == BUILD:
        return "loading it"
    return "starting the process that checks it (importing torch)"


def _failed(model: str, specs: tuple[InputSpec, ...], rows: int, stage: str | None) -> str:
    """A failure's lead: what failed, the forward's in the words of forward_problem."""
    return _forward_lead(specs, rows) if stage == FORWARD else _doing(model, specs, rows, stage)


def _last_words(stderr: str) -> str:
    """The most telling line of a child that died: a C++ exception's what(), a Python error, else the last line."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    native = [line.partition("what():")[2].strip() for line in lines if "what():" in line]
    said = [line for line in lines if "Error" in line and not line.startswith(("W", "File"))]
    return (native or said or ["no message"])[0]


def _child_main() -> None:
    """python -m serverbench.backend.probe, the spec on stdin: the model built and one forward (see probe_in_child).
    Its stages, and a failure Python sees, are lines on stdout; the model's own prints go to stderr."""
    words = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1, encoding="utf-8")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    spec = json.loads(sys.stdin.read())
    sys.path[:] = spec["sys_path"]
    specs = tuple(InputSpec(name, dtype, tuple(shape), low, high) for name, dtype, shape, low, high in spec["inputs"])
    stage = BUILD
    try:
        words.write(f"{STAGE}{BUILD}\n")
        if spec["package"]:
            model = load_aoti(spec["model"], runners=1, device_index=-1).run
        else:
            cpu = torch.device("cpu")
            model = build_model(spec["model"], cpu, spec["seed"], spec["checkpoint"], spec["kwargs"]).module
        stage = FORWARD
        words.write(f"{STAGE}{FORWARD}\n")
        problem = forward_problem(model, specs, spec["rows"], spec["seed"])
        problem = None if problem is None else f"--model {spec['model']}: {problem}"
    except ValueError as exc:  # a refusal of ours, one line naming the flag
        problem = _line(exc, 600)
    except BaseException as exc:  # noqa: BLE001 - the user's code may raise anything, SystemExit and Ctrl-C too
        lead = _failed(spec["model"], specs, spec["rows"], stage)
        said = _line(exc)
        problem = f"--model {spec['model']}: {lead}: {type(exc).__name__}{': ' + said if said else ''}"
    words.write(f"{PROBE_OK}\n" if problem is None else f"{PROBE_ERROR}{problem}\n")
    words.flush()
    sys.stderr.flush()
    # os._exit: a thread the model's code started must not keep the child (and the server's check) waiting.
    os._exit(0 if problem is None else 1)


def _line(exc: BaseException, limit: int = 300) -> str:
    return (str(exc).splitlines() or [""])[0][:limit]


def _forward_lead(specs: tuple[InputSpec, ...], rows: int) -> str:
    return f"its forward fails on the generated inputs ({_described(specs, rows)})"


def _described(specs: tuple[InputSpec, ...], rows: int) -> str:
    return ", ".join(f"{spec.name} {spec.dtype} [{rows}, {', '.join(map(str, spec.shape))}]" for spec in specs)


if __name__ == "__main__":
    _child_main()
