"""The request pool: distinct fake requests, one tensor per model input, made before any clock starts so that making
data never counts as latency. Deterministic from the seed: the backend rebuilds the same pool to compute --verify's
reference answers and the example its compile warm-up and ceiling run on."""

from __future__ import annotations

import torch

from serverbench.config.inputs import InputSpec, is_image_input, wire_dtype_of

TORCH_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}


def torch_dtype(name: str) -> torch.dtype:
    return TORCH_DTYPES[name]


def make_input(spec: InputSpec, rows: int, wire_dtype: str, generator: torch.Generator) -> torch.Tensor:
    """One input's batch of `rows` samples, in the dtype it crosses the wire in. Images: normalised floats
    (standard normal, as the reference sends) or, with --wire_dtype uint8, raw pixels; integers uniform within
    their inclusive range (an embedding never reads out of bounds); floats uniform within theirs, else normal."""
    shape = (rows, *spec.shape)
    dtype = torch_dtype(wire_dtype_of(spec, wire_dtype))
    value_range = spec.value_range
    if dtype == torch.uint8 and is_image_input(spec):
        return torch.randint(0, 256, shape, generator=generator, dtype=torch.uint8)
    if value_range is None:
        return torch.randn(shape, generator=generator).to(dtype)
    low, high = value_range
    if dtype.is_floating_point:
        return (torch.rand(shape, generator=generator, dtype=torch.float64) * (high - low) + low).to(dtype)
    high_exclusive = min(int(high) + 1, torch.iinfo(torch.int64).max)  # int64's top: as near as randint can go
    values = torch.randint(int(low), high_exclusive, shape, generator=generator, dtype=torch.int64)
    return values.to(dtype)


def make_request_pool(cfg) -> list[tuple[torch.Tensor, ...]]:
    """--request_pool_size requests of --batch_size samples, each a tuple with one tensor per model input."""
    generator = torch.Generator().manual_seed(cfg.seed)
    return [
        tuple(make_input(spec, cfg.batch_size, cfg.wire_dtype, generator) for spec in cfg.model_inputs)
        for _ in range(cfg.request_pool_size)
    ]
