"""Preflight's checks of the user's own model that need torch, and the child process that builds it and runs its
first forward (this module run as a script; backend/model_check.py starts it and reads its words): a .pt2's inputs
read from the program, what --aoti and a package need here, and one forward of a tiny batch of generated inputs, so
that a model that cannot take them, or whose output the server cannot split per request, is refused in one line
naming the input and the error. Each refusal is a ValueError. Its checks take the whole config: they are checks of
the config itself."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from serverbench.backend.model_check import (
    BUILD,
    FORWARD,
    PROBE_ERROR,
    PROBE_OK,
    STAGE,
    cpu_package,
    failure_lead,
    forward_lead,
    pt2_kind,
)
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
)
from serverbench.config.inputs import InputSpec
from serverbench.config.options import BenchConfig
from serverbench.transport.pool import make_input, new_generator
from serverbench.transport.tensors import as_tensor


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
        compiled_for = "cpu" if cpu_package(cfg.model) else "cuda"
        if compiled_for != ("cuda" if cfg.is_cuda else "cpu"):
            raise ValueError(
                f"--model {cfg.model}: an AOTInductor package compiled for {compiled_for}, and this run's device is "
                f"{cfg.device}; package it for this device"
            )


def forward_problem(model: Callable[..., object], specs: tuple[InputSpec, ...], rows: int, seed: int) -> str | None:
    """Why one forward of `rows` samples of generated inputs fails or gives an output the server cannot split, or
    None."""
    generator = new_generator(seed)
    inputs = tuple(as_tensor(make_input(spec, rows, "float32", generator), spec.dtype) for spec in specs)
    try:
        with torch.inference_mode():
            output = model(*inputs)
    except Exception as exc:  # noqa: BLE001 - the user's forward may raise anything
        return f"{forward_lead(specs, rows)}: {type(exc).__name__}: {_line(exc)}"
    return check_output(output, rows)


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
        lead = failure_lead(spec["model"], specs, spec["rows"], stage)
        said = _line(exc)
        problem = f"--model {spec['model']}: {lead}: {type(exc).__name__}{': ' + said if said else ''}"
    words.write(f"{PROBE_OK}\n" if problem is None else f"{PROBE_ERROR}{problem}\n")
    words.flush()
    sys.stderr.flush()
    # os._exit: a thread the model's code started must not keep the child (and the server's check) waiting.
    os._exit(0 if problem is None else 1)


def _line(exc: BaseException, limit: int = 300) -> str:
    return (str(exc).splitlines() or [""])[0][:limit]


if __name__ == "__main__":
    _child_main()
