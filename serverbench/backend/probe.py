"""Preflight's look at the user's own model, before any process starts: a .pt2 told apart (exported program or
AOTInductor package) and its inputs read, and one forward of a tiny batch of generated inputs, so that a model that
cannot take them, or whose output the server cannot split per request, is refused in one line naming the input
and the error. Each refusal is a ValueError. Its checks take the whole config: they are checks of the config itself."""

from __future__ import annotations

import dataclasses
import json
import os
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
from serverbench.config.inputs import InputSpec, is_image_input, parse_input
from serverbench.config.options import BenchConfig
from serverbench.transport.pool import make_input

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
    the CPU, for a factory, an exported program or a CPU AOTInductor package: ValueError naming what failed."""
    if cfg.wire_dtype == "uint8" and not (len(cfg.model_inputs) == 1 and is_image_input(cfg.model_inputs[0])):
        raise ValueError(
            "--wire_dtype uint8 sends raw pixels of one float32 [3, H, W] image input; this model's inputs are "
            f"{', '.join(spec.describe() for spec in cfg.model_inputs)}: use --wire_dtype float32"
        )
    if cfg.model.endswith(".pt2") and pt2_kind(cfg.model) == "aoti":
        if _cpu_package(cfg.model):  # a GPU package runs on the GPU only: its first forward is the check
            # A static batch takes only its own size; with dynamic batching the package must take a full batch too.
            for rows in sorted({cfg.batch_size, cfg.formed_rows}):
                _probe_package_in_child(cfg, rows)
        return
    rows = min(cfg.batch_size, PROBE_ROWS)
    if cfg.model.endswith(".pt2"):
        rows = cfg.batch_size  # a static batch takes only its own size; a dynamic one took it in resolve_pt2
    model = build_model(cfg.model, torch.device("cpu"), cfg.seed, cfg.checkpoint, cfg.model_kwargs).module
    problem = forward_problem(model, cfg.model_inputs, rows, cfg.seed)
    if problem is not None:
        raise ValueError(f"--model {cfg.model}: {problem}")


def forward_problem(model: Callable[..., object], specs: tuple[InputSpec, ...], rows: int, seed: int) -> str | None:
    """Why one forward of `rows` samples of generated inputs fails or gives an output the server cannot split, or
    None."""
    generator = torch.Generator().manual_seed(seed)
    inputs = tuple(make_input(spec, rows, "float32", generator) for spec in specs)
    try:
        with torch.inference_mode():
            output = model(*inputs)
    except Exception as exc:  # noqa: BLE001 - the user's forward may raise anything
        return (
            f"its forward fails on the generated inputs ({_described(specs, rows)}): "
            f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:300]}"
        )
    return check_output(output, rows)


PROBE_TIMEOUT_S = 300.0
PROBE_ERROR = "probe-error: "  # the child's one line, on stderr, when Python saw the failure


def _probe_package_in_child(cfg: BenchConfig, rows: int) -> None:
    """An AOTInductor package's forward, in a child process: compiled code that fails may abort its process (an
    index out of bounds inside a kernel is a C++ exception nothing catches), and the runtime checks the inputs'
    shapes only when AOTI_RUNTIME_CHECK_INPUTS is set."""
    spec = json.dumps(
        {"path": cfg.model, "inputs": [s.describe() for s in cfg.model_inputs], "rows": rows, "seed": cfg.seed}
    )
    # One thread: a kernel's failure on several OpenMP threads at once aborts before any says what it was.
    env = {**os.environ, "AOTI_RUNTIME_CHECK_INPUTS": "1", "OMP_NUM_THREADS": "1"}
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "serverbench.backend.probe", spec],
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
            env=env,
        )
    except subprocess.TimeoutExpired:
        raise ValueError(
            f"--model {cfg.model}: one forward of {rows} samples took over {PROBE_TIMEOUT_S:g} s"
        ) from None
    if proc.returncode == 0:
        return
    lines = [line.strip() for line in proc.stderr.splitlines() if line.strip()]
    ours = [line[len(PROBE_ERROR) :] for line in lines if line.startswith(PROBE_ERROR)]
    native = [line.partition("what():")[2].strip() for line in lines if "what():" in line]
    said = [line for line in lines if "Error" in line and not line.startswith(("W", "File"))]
    if ours:
        reason = ours[-1]
    else:
        how = f"signal {-proc.returncode}" if proc.returncode < 0 else f"exit {proc.returncode}"
        detail = (native or said or ["no message"])[0]
        reason = (
            f"its forward fails on the generated inputs ({_described(cfg.model_inputs, rows)}): the process ended "
            f"({how}): {detail[:300]}"
        )
    raise ValueError(f"--model {cfg.model}: {reason}")


def _child_main(spec_json: str) -> int:
    """python -m serverbench.backend.probe SPEC: one forward of a CPU AOTInductor package (see
    _probe_package_in_child); a failure Python sees is one PROBE_ERROR line on stderr and exit 1."""
    spec = json.loads(spec_json)
    try:
        model = load_aoti(spec["path"], runners=1, device_index=-1).run
        problem = forward_problem(model, tuple(parse_input(t) for t in spec["inputs"]), spec["rows"], spec["seed"])
    except Exception as exc:  # noqa: BLE001 - reported as the refusal's reason
        problem = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:300]}"
    if problem is None:
        return 0
    print(PROBE_ERROR + problem, file=sys.stderr)
    return 1


def _described(specs: tuple[InputSpec, ...], rows: int) -> str:
    return ", ".join(f"{spec.name} {spec.dtype} [{rows}, {', '.join(map(str, spec.shape))}]" for spec in specs)


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1]))
