"""Model preparation in the backend, before any serving thread exists: the precision flags, the model built, cast,
laid out and compiled (warmed up at every size it will run at), the decoder, the example input the ceiling runs
on, and --verify's reference answers.

Its functions take the whole config: preparation is where the model-side flags are spent, a few in each."""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from torch import nn

from serverbench.backend.batcher import padded_size, padded_sizes
from serverbench.backend.buffers import BufferSet, Decoder, model_dtype
from serverbench.backend.compiled import ForwardModels, compile_per_thread, graph_break_count, one_at_a_time
from serverbench.backend.model_check import pt2_kind
from serverbench.backend.models import build_model
from serverbench.backend.outputs import output_leaves
from serverbench.backend.sources import AotiModel, compile_aoti, load_aoti
from serverbench.config.inputs import padding_value
from serverbench.config.limits import AOTI_CACHE_FOLDER
from serverbench.config.options import BenchConfig
from serverbench.config.transport_kinds import transport_kind
from serverbench.device.layer import DeviceLayer
from serverbench.schema.messages import BackendReady
from serverbench.transport.pool import pool_spec
from serverbench.transport.tensors import pool_tensors

log = logging.getLogger("backend")


def set_precision_flags(precision: str) -> dict[str, object]:
    """Process-wide TF32 flags: `default` leaves PyTorch's own (cuDNN convolutions in TF32, matmuls in IEEE
    float32: what the reference ran); tf32 turns both on; fp32, bf16 and fp16 turn both off (strict IEEE for
    whatever runs in float32). Returns the flags in effect."""
    if precision != "default":
        tf32 = precision == "tf32"
        torch.set_float32_matmul_precision("high" if tf32 else "highest")
        torch.backends.cudnn.allow_tf32 = tf32
    return {
        "cudnn_allow_tf32": bool(torch.backends.cudnn.allow_tf32),
        "matmul_precision": torch.get_float32_matmul_precision(),
    }


def decoded_on_device(
    cfg: BenchConfig, layer: DeviceLayer, decode: Decoder, inputs: tuple[torch.Tensor, ...]
) -> tuple[torch.Tensor, ...]:
    """`inputs` on the device and decoded as a request's would be, in fresh buffers made outside inference mode like
    the serving pool's (a compiled decoder guards on that): the model's inputs at the served shape, dtype, layout.
    With dynamic batching the buffers have the pool's rows too, and `inputs` fill the first of them."""
    buffers = BufferSet(cfg, layer.device, pin_host=False, rows=cfg.formed_rows if cfg.batching else None)
    rows = inputs[0].shape[0]
    # With batching, serving always decodes views of the wire buffers (gather_wire): so does this, for the guards.
    wires = [
        layer.stage_wire(wire[:rows], tensor, copies and not cfg.batching)
        for wire, tensor, copies in zip(buffers.wires, inputs, buffers.decode_copies)
    ]
    return decode(buffers, wires)


def compiled_sizes(cfg: BenchConfig) -> list[int] | None:
    """With dynamic batching and anything compiled (model or decoding): the formed-batch sizes compiled at warm-up,
    to which every formed batch is padded. None: each forward runs at its own size."""
    if not cfg.batching or not (cfg.compile or cfg.compile_decode):
        return None
    return padded_sizes(cfg.batch_size, cfg.max_batch_size)


MAX_EAGER_WARMUP_SIZES = 64


def warmup_sizes(cfg: BenchConfig, compiled: list[int] | None, example_rows: int, aoti: bool = False) -> list[int]:
    """The batch sizes the model runs at before serving. Compiled: every size compiled. Dynamic batching without
    compile: every size a formed batch can take (whole requests), so that no formed size meets its first forward
    (a CPU library's kernel choice, cuDNN's algorithm search) while serving, as the warm-up request's size alone
    would; beyond MAX_EAGER_WARMUP_SIZES sizes, the powers of two among them. With several --instances, the
    request's size: only one instance serves the warm-up request, and no instance's first forward may land in the
    measured phase. Served by AOTInductor: the request's size too (its first run loads kernels and folds constants,
    which belongs to m_compile_time). Otherwise none: the warm-up request is the first forward, as in the
    reference."""
    if compiled is not None:
        return compiled
    if cfg.batching:
        sizes = list(range(cfg.batch_size, cfg.formed_rows + 1, cfg.batch_size))
        return sizes if len(sizes) <= MAX_EAGER_WARMUP_SIZES else padded_sizes(cfg.batch_size, cfg.max_batch_size)
    return [example_rows] if cfg.compile or aoti or cfg.instances > 1 else []


def example_input(
    cfg: BenchConfig, layer: DeviceLayer, decode: Decoder, rows: int | None = None
) -> tuple[torch.Tensor, ...]:
    """The first pool request as model inputs (for compile's warm-up and the ceiling), its samples repeated to
    `rows` (default: the largest batch the model runs on, a request's or a full formed batch)."""
    inputs = pool_tensors(replace(pool_spec(cfg), pool_size=1))[0]
    rows = cfg.formed_rows if rows is None else rows
    if rows != inputs[0].shape[0]:
        repeats = math.ceil(rows / inputs[0].shape[0])
        inputs = tuple(t.repeat(repeats, *([1] * (t.dim() - 1)))[:rows] for t in inputs)
    return decoded_on_device(cfg, layer, decode, inputs)


def allow_recompiles(count: int) -> None:
    """Dynamo compiles a function at most recompile_limit times (8 by default) before it falls back to eager: the
    formed-batch sizes compiled at warm-up must all fit (older torch names the limit cache_size_limit)."""
    import torch._dynamo.config as dynamo_config

    name = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
    setattr(dynamo_config, name, max(getattr(dynamo_config, name), count + 1))


@dataclass
class PreparedModel:
    # Cast, laid out and compiled as asked (an nn.Module, AOTInductor's runner, or a torch.compile copy per forward
    # thread).
    models: ForwardModels
    decode: Decoder  # wire bytes -> model inputs (compiled with --compile_decode, which follows --compile)
    example: tuple[torch.Tensor, ...]  # the first pool request as model inputs, on the device: the ceiling's
    ready: BackendReady


def aoti_cache_dir(results_dir: str) -> Path:
    return Path(results_dir) / AOTI_CACHE_FOLDER


def compile_package(
    cfg: BenchConfig, layer: DeviceLayer, model: nn.Module, example: tuple[torch.Tensor, ...]
) -> tuple[str, bool]:
    """--aoti: the model exported at the served inputs and compiled into an AOTInductor package (or the cached
    package of the same program, inputs, precision, device and torch): its path, and whether it was compiled now.
    With dynamic batching the batch dimension is dynamic, from one row to a full formed batch."""
    describe = "|".join(
        [
            cfg.model,
            cfg.model_kwargs or "",
            " ".join(spec.describe() for spec in cfg.model_inputs),
            cfg.wire_dtype,
            cfg.precision,
            str(cfg.channels_last),
            layer.device.type,
            layer.info().name,  # the GPU (or CPU) model: a package holds code compiled for its architecture
        ]
    )
    batch_range = (1, cfg.formed_rows) if cfg.batching else None
    return compile_aoti(model, example, batch_range, aoti_cache_dir(cfg.results_dir), describe, cfg.warmup_timeout_s)


def aoti_runners(forward_threads: int, max_inflight: int) -> int:
    """AOTInductor runners to load: one per request the backend may hold at once (--max_inflight), at least one
    per prediction thread. A runner stays busy until its work on the device has ended, not when its call returns,
    and a call that finds every runner busy waits for one holding the GIL, which stops every serving thread; the
    runners share one set of weights, so more cost little."""
    return max(forward_threads, max_inflight)


def device_index(device: torch.device) -> int:
    """load_package's device_index: the GPU's index, -1 on the CPU."""
    return -1 if device.index is None else device.index


def warm_up(
    cfg: BenchConfig,
    layer: DeviceLayer,
    decode: Decoder,
    models: ForwardModels,
    example: tuple[torch.Tensor, ...],
    sizes: list[int] | None,
    aoti: bool,
) -> tuple[ForwardModels, int]:
    """Every copy run at the served shape now, not in a serving thread (so compiled now); with dynamic batching at
    every size a formed batch can take (padded to, when compiled). Returns the copies to serve with (one at a time
    where a compiled model has graph breaks) and the graph breaks met compiling the first copy at every size."""
    graph_breaks = 0
    for rows in warmup_sizes(cfg, sizes, example[0].shape[0], aoti=aoti):
        # The input is made outside inference mode, as the serving threads make theirs (compile guards on it).
        model_input = example if rows == example[0].shape[0] else example_input(cfg, layer, decode, rows)
        with torch.inference_mode():
            for index, copy in enumerate(models.copies):
                breaks_before = graph_break_count() if cfg.compile and index == 0 else 0
                copy(*model_input)
                if cfg.compile and index == 0:
                    graph_breaks += graph_break_count() - breaks_before
    if graph_breaks and len(models.copies) > 1:
        # The frames after a break are shared by every copy, guards included (serverbench.backend.compiled).
        log.warning(
            "the compiled model has %d graph break(s): its %d prediction threads run their forwards one at a time",
            graph_breaks,
            len(models.copies),
        )
        models = one_at_a_time(models, cfg.timeout_s)
    return models, graph_breaks


def describe_outputs(
    model: Callable[..., object], example: tuple[torch.Tensor, ...]
) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """Each output leaf of the model (pytree order) as (dtype name, shape of one row), from one forward."""
    with torch.inference_mode():
        leaves = output_leaves(model(*example))
    return tuple((str(leaf.dtype).removeprefix("torch."), tuple(leaf.shape[1:])) for leaf in leaves)


def prepare_model(cfg: BenchConfig, layer: DeviceLayer, forward_threads: int) -> PreparedModel:
    """The model ready to serve (built, cast, compiled, warmed up); `forward_threads`: the threads that will run its
    forwards at once (the design's prediction threads, the ceiling's as many). The whole config: preparation reads
    most of the model-side flags."""
    if cfg.inject_fault == "oom_build":
        raise torch.OutOfMemoryError("injected: out of memory while building the model")
    precision_flags = set_precision_flags(cfg.precision)
    decode = Decoder(cfg, layer.device)
    aoti_package = cfg.model.endswith(".pt2") and pt2_kind(cfg.model) == "aoti"
    start_ns = time.perf_counter_ns()
    aoti: AotiModel | None = None
    aoti_compiled_now: bool | None = None
    if aoti_package:  # served as it is: built by whoever packaged it
        # The runtime checks every input's shape and dtype against the package's (a cheap check per call): a
        # package given inputs it was not compiled for fails in words instead of reading out of bounds.
        os.environ["AOTI_RUNTIME_CHECK_INPUTS"] = "1"
        aoti = load_aoti(cfg.model, aoti_runners(forward_threads, cfg.max_inflight), device_index(layer.device))
        model: Callable[..., object] = aoti.run
        build_s, torch_load_time_s = (time.perf_counter_ns() - start_ns) / 1e9, None
    else:
        built = build_model(cfg.model, layer.device, cfg.seed, cfg.checkpoint, cfg.model_kwargs)
        model = built.module.to(
            dtype=model_dtype(cfg.precision),
            memory_format=torch.channels_last if cfg.channels_last else torch.preserve_format,
        )
        build_s, torch_load_time_s = built.build_s, built.torch_load_time_s
    compile_time_s: float | None = None
    start_ns = time.perf_counter_ns()
    # torch.compile is not thread-safe: compile and run once here, on one thread, at the served shape, dtype and
    # layout, before any serving thread exists. Serving threads then only hit the compiled cache.
    sizes = compiled_sizes(cfg)
    if sizes is not None:
        allow_recompiles(len(sizes))
    if cfg.compile_decode:
        decode.compile()  # compiled at its first call, just below
    example = example_input(cfg, layer, decode)
    if cfg.aoti:
        package, aoti_compiled_now = compile_package(cfg, layer, model, example)
        model = built = None  # the eager module goes before the package loads: no weights held twice on the device
        layer.synchronize()
        aoti = load_aoti(package, aoti_runners(forward_threads, cfg.max_inflight), device_index(layer.device))
        models = ForwardModels.of(aoti.run)
    elif cfg.compile:
        # One compiled copy per thread that runs forwards (the prediction threads, the ceiling's as many): dynamo's
        # guards are not safe to evaluate from two threads at once (serverbench.backend.compiled).
        mode = None if cfg.compile_mode == "default" else cfg.compile_mode
        models = compile_per_thread(model, forward_threads, mode)
    else:
        models = ForwardModels.of(model)
    models, graph_breaks = warm_up(cfg, layer, decode, models, example, sizes, aoti is not None)
    layer.synchronize()  # the example's buffers are freed on the default stream; the pool may get their blocks
    if cfg.compile or cfg.compile_decode or cfg.aoti:
        compile_time_s = (time.perf_counter_ns() - start_ns) / 1e9
        if (cfg.compile or cfg.compile_decode) and hasattr(torch.compiler, "set_stance"):
            torch.compiler.set_stance("fail_on_recompile")  # torch >= 2.6: a recompile while serving is an error
    info = layer.info()
    # The door describes the model's outputs before any request: one forward of the example tells them.
    described = describe_outputs(models.for_thread(0), example) if transport_kind(cfg.transport).network else ()
    reference = reference_outputs(cfg, layer, models.for_thread(0), decode) if cfg.verify else None
    ready = BackendReady(
        device=info.device,
        device_name=info.name,
        device_uuid=info.uuid,
        timing_source=info.timing_source,
        model_build_s=build_s,
        torch_load_time_s=torch_load_time_s,
        compile_time_s=compile_time_s,
        torch_version=str(torch.__version__),
        cuda_version=torch.version.cuda,
        reference_outputs=reference,
        compile_path="aoti" if aoti is not None else "inductor" if cfg.compile else "eager",
        aoti_runners=aoti.runners if aoti is not None else None,
        aoti_compiled_now=aoti_compiled_now,
        compile_graph_breaks=graph_breaks if cfg.compile else None,
        output_leaves=described,
        **precision_flags,
    )
    return PreparedModel(models, decode, example, ready)


def reference_outputs(
    cfg: BenchConfig, layer: DeviceLayer, model: Callable[..., object], decode: Decoder
) -> list[tuple[np.ndarray, ...]]:
    """--verify's answers: each pool request through the same model and decoding, one at a time on the default
    stream, fully synchronised: no thread, no stream, no buffer reuse that could go wrong."""
    answers = []
    sizes = compiled_sizes(cfg)
    for inputs in pool_tensors(pool_spec(cfg)):
        rows = inputs[0].shape[0]
        if sizes is not None:  # only the compiled sizes may run: padded as a lone request is when served
            padded = padded_size(rows, sizes)
            inputs = tuple(
                torch.cat(
                    [t, torch.full((padded - rows, *t.shape[1:]), padding_value(spec, cfg.wire_dtype), dtype=t.dtype)]
                )
                for t, spec in zip(inputs, cfg.model_inputs)
            )
        model_input = decoded_on_device(cfg, layer, decode, inputs)
        with torch.inference_mode():
            leaves = output_leaves(model(*model_input))
        layer.synchronize()
        answers.append(tuple(leaf[:rows].cpu().numpy() for leaf in leaves))
    return answers
