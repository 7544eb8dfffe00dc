"""Model preparation in the backend, before any serving thread exists: the precision flags, the model built, cast,
laid out and compiled (warmed up at every size it will run at), the decoder, the example input the ceiling runs
on, and --verify's reference answers."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

import torch
from torch import nn

from serverbench.backend.batcher import padded_size, padded_sizes
from serverbench.backend.buffers import BufferSet, Decoder, model_dtype
from serverbench.backend.models import build_model
from serverbench.config.options import BenchConfig
from serverbench.device.layer import DeviceLayer
from serverbench.load.schedules import make_request_pool
from serverbench.messages import BackendReady


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


def decoded_on_device(cfg: BenchConfig, layer: DeviceLayer, decode: Decoder, batch: torch.Tensor) -> torch.Tensor:
    """`batch` on the device and decoded as a request would be, in fresh buffers made outside inference mode like
    the serving pool's (a compiled decoder guards on that): the model's input at the served shape, dtype, layout.
    With dynamic batching the buffers have the pool's rows too, and `batch` fills the first of them."""
    buffers = BufferSet(cfg, layer.device, pin_host=False, rows=cfg.formed_rows if cfg.batching else None)
    wire = buffers.wire[: batch.shape[0]]
    # With batching, serving always decodes a view of the wire buffer (gather_wire): so does this, for the guards.
    return decode(buffers, layer.stage_wire(wire, batch, buffers.decode_copies and not cfg.batching))


def compiled_sizes(cfg: BenchConfig) -> list[int] | None:
    """With dynamic batching and anything compiled (model or decoding): the formed-batch sizes compiled at warm-up,
    to which every formed batch is padded. None: each forward runs at its own size."""
    if not cfg.batching or not (cfg.compile or cfg.compile_decode):
        return None
    return padded_sizes(cfg.batch_size, cfg.max_batch_size)


MAX_EAGER_WARMUP_SIZES = 64


def warmup_sizes(cfg: BenchConfig, compiled: list[int] | None, example_rows: int) -> list[int]:
    """The batch sizes the model runs at before serving. Compiled: every size compiled. Dynamic batching without
    compile: every size a formed batch can take (whole requests), so that no formed size meets its first forward
    (a CPU library's kernel choice, cuDNN's algorithm search) while serving, as the warm-up request's size alone
    would; beyond MAX_EAGER_WARMUP_SIZES sizes, the powers of two among them. With several --instances, the
    request's size: only one instance serves the warm-up request, and no instance's first forward may land in the
    measured phase. Otherwise none: the warm-up request is the first forward, as in the reference."""
    if compiled is not None:
        return compiled
    if cfg.batching:
        sizes = list(range(cfg.batch_size, cfg.formed_rows + 1, cfg.batch_size))
        return sizes if len(sizes) <= MAX_EAGER_WARMUP_SIZES else padded_sizes(cfg.batch_size, cfg.max_batch_size)
    return [example_rows] if cfg.compile or cfg.instances > 1 else []


def example_input(cfg: BenchConfig, layer: DeviceLayer, decode: Decoder, rows: int | None = None) -> torch.Tensor:
    """The first pool batch as model input (for compile's warm-up and the ceiling), its images repeated to `rows`
    (default: the largest batch the model runs on, a request's or a full formed batch)."""
    batch = make_request_pool(replace(cfg, request_pool_size=1))[0]
    rows = cfg.formed_rows if rows is None else rows
    if rows != batch.shape[0]:
        batch = batch.repeat(math.ceil(rows / batch.shape[0]), 1, 1, 1)[:rows]
    return decoded_on_device(cfg, layer, decode, batch)


def allow_recompiles(count: int) -> None:
    """Dynamo compiles a function at most recompile_limit times (8 by default) before it falls back to eager: the
    formed-batch sizes compiled at warm-up must all fit (older torch names the limit cache_size_limit)."""
    import torch._dynamo.config as dynamo_config

    name = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
    setattr(dynamo_config, name, max(getattr(dynamo_config, name), count + 1))


@dataclass
class PreparedModel:
    model: nn.Module  # cast, laid out and compiled as asked
    decode: Decoder  # wire bytes -> model input (compiled with --compile_decode, which follows --compile)
    example: torch.Tensor  # the first pool batch as model input, on the device: what the ceiling runs on
    ready: BackendReady


def prepare_model(cfg: BenchConfig, layer: DeviceLayer) -> PreparedModel:
    if cfg.inject_fault == "oom_build":
        raise torch.OutOfMemoryError("injected: out of memory while building the model")
    precision_flags = set_precision_flags(cfg.precision)
    built = build_model(cfg.model, layer.device, cfg.seed, cfg.checkpoint)
    model = built.module.to(
        dtype=model_dtype(cfg.precision),
        memory_format=torch.channels_last if cfg.channels_last else torch.preserve_format,
    )
    decode = Decoder(cfg, layer.device)
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
    if cfg.compile:
        model = torch.compile(model, dynamic=False, mode=None if cfg.compile_mode == "default" else cfg.compile_mode)
    # Compiled at the served shape now, not in a serving thread; with dynamic batching run at every size a formed
    # batch can take (padded to, when compiled).
    for rows in warmup_sizes(cfg, sizes, example.shape[0]):
        # The input is made outside inference mode, as the serving threads make theirs (compile guards on it).
        model_input = example if rows == example.shape[0] else example_input(cfg, layer, decode, rows)
        with torch.inference_mode():
            model(model_input)
    layer.synchronize()  # the example's buffers are freed on the default stream; the pool may get their blocks
    if cfg.compile or cfg.compile_decode:
        compile_time_s = (time.perf_counter_ns() - start_ns) / 1e9
        if hasattr(torch.compiler, "set_stance"):  # torch >= 2.6: a recompile in a serving thread is an error
            torch.compiler.set_stance("fail_on_recompile")
    info = layer.info()
    reference = reference_outputs(cfg, layer, model, decode) if cfg.verify else None
    ready = BackendReady(
        device=info.device,
        device_name=info.name,
        device_uuid=info.uuid,
        timing_source=info.timing_source,
        model_build_s=built.build_s,
        torch_load_time_s=built.torch_load_time_s,
        compile_time_s=compile_time_s,
        torch_version=str(torch.__version__),
        cuda_version=torch.version.cuda,
        reference_outputs=reference,
        **precision_flags,
    )
    return PreparedModel(model, decode, example, ready)


def reference_outputs(cfg: BenchConfig, layer: DeviceLayer, model: nn.Module, decode: Decoder) -> list:
    """--verify's answers: each pool batch through the same model and decoding, one at a time on the default
    stream, fully synchronised: no thread, no stream, no buffer reuse that could go wrong."""
    answers = []
    sizes = compiled_sizes(cfg)
    for batch in make_request_pool(cfg):
        rows = batch.shape[0]
        if sizes is not None:  # only the compiled sizes may run: padded as a lone request is when served
            padded = padded_size(rows, sizes)
            batch = torch.cat([batch, torch.zeros((padded - rows, *batch.shape[1:]), dtype=batch.dtype)])
        model_input = decoded_on_device(cfg, layer, decode, batch)
        with torch.inference_mode():
            output = model(model_input)[:rows]
        layer.synchronize()
        answers.append(output.float().cpu().numpy())
    return answers
