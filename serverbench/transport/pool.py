"""The request pool: distinct fake requests, one tensor per model input, made before any clock starts so that making
data never counts as latency. Deterministic from the seed: the backend rebuilds the same pool to compute --verify's
reference answers and the example its compile warm-up and ceiling run on."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from serverbench.config.inputs import DTYPES, InputSpec, is_image_input, wire_dtype_of
from serverbench.config.options import BenchConfig

TORCH_DTYPES = {name: getattr(torch, name) for name in DTYPES}  # each input dtype's name is torch's own


def torch_dtype(name: str) -> torch.dtype:
    return TORCH_DTYPES[name]


@dataclass(frozen=True)
class WireInput:
    """One model input as it crosses the transport: its spec and the dtype it travels in (--wire_dtype for the
    image input, its own dtype otherwise), decided once for the run."""

    spec: InputSpec
    wire_dtype: str

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.wire_dtype)


def wire_layout(specs: Sequence[InputSpec], wire_dtype: str) -> tuple[WireInput, ...]:
    """Each input's wire dtype under `--wire_dtype`, in the model's input order: what the pool makes and the
    transport carries."""
    return tuple(WireInput(spec, wire_dtype_of(spec, wire_dtype)) for spec in specs)


@dataclass(frozen=True)
class PoolSpec:
    """What the request pool is made from: all it reads of the run's configuration."""

    seed: int
    batch_size: int  # samples per request
    inputs: tuple[WireInput, ...]
    pool_size: int  # distinct requests (--request_pool_size)


def pool_spec(cfg: BenchConfig) -> PoolSpec:
    return PoolSpec(cfg.seed, cfg.batch_size, wire_layout(cfg.model_inputs, cfg.wire_dtype), cfg.request_pool_size)


def make_input(spec: InputSpec, rows: int, wire_dtype: str, generator: torch.Generator) -> torch.Tensor:
    """One input's batch of `rows` samples under `--wire_dtype` (see make_wire_input)."""
    return make_wire_input(WireInput(spec, wire_dtype_of(spec, wire_dtype)), rows, generator)


def make_wire_input(wire: WireInput, rows: int, generator: torch.Generator) -> torch.Tensor:
    """One input's batch of `rows` samples, in the dtype it crosses the wire in. Images: normalised floats
    (standard normal, as the reference sends) or, with --wire_dtype uint8, raw pixels; integers uniform within
    their inclusive range (an embedding never reads out of bounds); floats uniform within theirs, else normal."""
    spec = wire.spec
    shape = (rows, *spec.shape)
    dtype = wire.torch_dtype
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


def make_request_pool(spec: PoolSpec) -> list[tuple[torch.Tensor, ...]]:
    """`pool_size` requests of `batch_size` samples, each a tuple with one tensor per model input."""
    generator = torch.Generator().manual_seed(spec.seed)
    return [
        tuple(make_wire_input(wire, spec.batch_size, generator) for wire in spec.inputs) for _ in range(spec.pool_size)
    ]
