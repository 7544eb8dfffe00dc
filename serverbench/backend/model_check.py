"""The server's side of preflight's look at the user's own model: what a .pt2 file is, read from its archive, and
the model built and its first forward run in a child process (backend/probe.py run as a script), whose words it
turns into one line. Nothing here imports torch: the server starts its run's processes without paying for that
import (seconds) on top of the child's.

The child's run is bounded by --warmup_timeout_s: the user's code may exit, abort, hang or raise anything, and none
of it may reach the server."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import zipfile
from pathlib import Path

from serverbench.config.inputs import InputSpec, is_image_input
from serverbench.config.options import BenchConfig
from serverbench.config.paths import check_input_file
from serverbench.system.process import end_with_parent
from serverbench.system.scratch import children_temp_folder

AOTI_MARKER = "/data/aotinductor/"  # every file of an AOTInductor package lives under <archive>/data/aotinductor/
PROBE_ROWS = 2  # samples in the probe's batch: enough to see a batch dimension, cheap for any model
# The child's words to the parent, one per line on the child's stdout (the model's own prints go to its stderr).
STAGE = "probe-stage: "  # what it starts now: BUILD or FORWARD
BUILD, FORWARD = "build", "forward"
PROBE_ERROR = "probe-error: "  # the refusal, when Python saw the failure
PROBE_OK = "probe-ok"
STOP_WAIT_S = 5.0  # for the output of a child killed at its time limit
PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # the folder holding serverbench/


def pt2_kind(path: str) -> str:
    """'aoti' for an AOTInductor package, 'program' for a torch.export.save archive; ValueError for anything else."""
    file = check_input_file("--model", path)  # a ConfigError, a ValueError
    if not zipfile.is_zipfile(file):
        raise ValueError(f"--model {path}: not a .pt2 archive (torch.export.save or aoti_compile_and_package)")
    with zipfile.ZipFile(file) as archive:
        names = archive.namelist()
    return "aoti" if any(AOTI_MARKER in name for name in names) else "program"


def cpu_package(path: str) -> bool:
    """Whether the package's metadata names the CPU, read from the archive without loading any code."""
    with zipfile.ZipFile(path) as archive:
        for name in archive.namelist():
            if name.endswith("_metadata.json") and AOTI_MARKER in name:
                try:
                    return json.loads(archive.read(name)).get("AOTI_DEVICE_KEY", "cpu") == "cpu"
                except ValueError:
                    continue
    return True


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
        if cpu_package(cfg.model):  # a GPU package runs on the GPU only: its first forward is the check
            # A static batch takes only its own size; with dynamic batching the package must take a full batch too.
            for rows in sorted({cfg.batch_size, cfg.formed_rows}):
                probe_in_child(cfg, rows, package=True)
        return
    rows = min(cfg.batch_size, PROBE_ROWS)
    if cfg.model.endswith(".pt2"):
        rows = cfg.batch_size  # a static batch takes only its own size; a dynamic one took it in resolve_pt2
    probe_in_child(cfg, rows, package=False)


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
    lead = failure_lead(cfg.model, cfg.model_inputs, rows, stage)
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


def failure_lead(model: str, specs: tuple[InputSpec, ...], rows: int, stage: str | None) -> str:
    """A failure's lead: what failed, the forward's in the words of probe.forward_problem."""
    return forward_lead(specs, rows) if stage == FORWARD else _doing(model, specs, rows, stage)


def _last_words(stderr: str) -> str:
    """The most telling line of a child that died: a C++ exception's what(), a Python error, else the last line."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    native = [line.partition("what():")[2].strip() for line in lines if "what():" in line]
    said = [line for line in lines if "Error" in line and not line.startswith(("W", "File"))]
    return (native or said or ["no message"])[0]


def forward_lead(specs: tuple[InputSpec, ...], rows: int) -> str:
    return f"its forward fails on the generated inputs ({_described(specs, rows)})"


def _described(specs: tuple[InputSpec, ...], rows: int) -> str:
    return ", ".join(f"{spec.name} {spec.dtype} [{rows}, {', '.join(map(str, spec.shape))}]" for spec in specs)
