"""Preflight's look at the user's own model, before any process starts: a .pt2 told apart (exported program or
AOTInductor package) and its inputs read, and one forward of a tiny batch of generated inputs, so that a model that
cannot take them, or whose output the server cannot split per request, is refused in one line naming the input
and the error. Each refusal is a ValueError."""

from __future__ import annotations

import dataclasses
import json
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
from serverbench.load.pool import make_input

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
    aoti_package = cfg.model.endswith(".pt2") and pt2_kind(cfg.model) == "aoti"
    if aoti_package and not _cpu_package(cfg.model):
        return  # a GPU package runs on the GPU only: its first forward in the backend is the check
    rows = min(cfg.batch_size, PROBE_ROWS)
    if cfg.model.endswith(".pt2") and not aoti_package:
        rows = cfg.batch_size  # a static batch takes only its own size; a dynamic one took it in resolve_pt2
    generator = torch.Generator().manual_seed(cfg.seed)
    inputs = tuple(make_input(spec, rows, "float32", generator) for spec in cfg.model_inputs)
    if aoti_package:
        model = load_aoti(cfg.model, runners=1, device_index=-1).run
    else:
        model = build_model(cfg.model, torch.device("cpu"), cfg.seed, cfg.checkpoint, cfg.model_kwargs).module
    try:
        with torch.inference_mode():
            output = model(*inputs)
    except Exception as exc:  # noqa: BLE001 - the user's forward may raise anything
        raise ValueError(
            f"--model {cfg.model}: its forward fails on the generated inputs ({_described(cfg.model_inputs, rows)}): "
            f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:300]}"
        ) from None
    problem = check_output(output, rows)
    if problem is not None:
        raise ValueError(f"--model {cfg.model}: {problem}")


def _described(specs: tuple[InputSpec, ...], rows: int) -> str:
    return ", ".join(f"{spec.name} {spec.dtype} [{rows}, {', '.join(map(str, spec.shape))}]" for spec in specs)
