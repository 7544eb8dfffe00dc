"""The request pool: distinct fake requests, one array per model input, made before any clock starts so that making
data never counts as latency. Deterministic from the seed: the backend rebuilds the same pool to compute --verify's
reference answers and the example its compile warm-up and ceiling run on.

numpy, not torch: the frontend, which sends the pool, never imports torch (a second of start-up per run, and the
load generator's memory). Each array is in its wire dtype's numpy carrier (bfloat16 as its uint16 words, which
numpy lacks); transport/tensors.py turns it into the tensor the backend computes on."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from serverbench.config.inputs import InputSpec, is_image_input, numpy_carrier, wire_dtype_of
from serverbench.config.options import BenchConfig

Inputs = tuple[np.ndarray, ...]  # one request: an array per model input, [batch, ...], in its wire dtype's carrier


@dataclass(frozen=True)
class WireInput:
    """One model input as it crosses the transport: its spec and the dtype it travels in (--wire_dtype for the
    image input, its own dtype otherwise), decided once for the run."""

    spec: InputSpec
    wire_dtype: str


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


def new_generator(seed: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(seed))


def bfloat16_words(values: np.ndarray) -> np.ndarray:
    """float32 values as bfloat16's 16-bit words, rounded to nearest even (as torch's cast rounds)."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    return (rounded >> np.uint32(16)).astype(np.uint16)


def _as_wire(values: np.ndarray, wire_dtype: str) -> np.ndarray:
    if wire_dtype == "bfloat16":
        return bfloat16_words(values)
    return values.astype(numpy_carrier(wire_dtype))


def make_input(spec: InputSpec, rows: int, wire_dtype: str, generator: np.random.Generator) -> np.ndarray:
    """One input's batch of `rows` samples under `--wire_dtype` (see make_wire_input)."""
    return make_wire_input(WireInput(spec, wire_dtype_of(spec, wire_dtype)), rows, generator)


def make_wire_input(wire: WireInput, rows: int, generator: np.random.Generator) -> np.ndarray:
    """One input's batch of `rows` samples, in the dtype it crosses the wire in. Images: normalised floats
    (standard normal, as the reference sends) or, with --wire_dtype uint8, raw pixels; integers uniform within
    their inclusive range (an embedding never reads out of bounds); floats uniform within theirs, else normal."""
    spec = wire.spec
    shape = (rows, *spec.shape)
    value_range = spec.value_range
    if wire.wire_dtype == "uint8" and is_image_input(spec):
        return generator.integers(0, 256, shape, dtype=np.uint8)
    if value_range is None:
        return _as_wire(generator.standard_normal(shape, dtype=np.float32), wire.wire_dtype)
    low, high = value_range
    if spec.is_float:
        return _as_wire(generator.random(shape) * (high - low) + low, wire.wire_dtype)
    values = generator.integers(int(low), int(high), shape, dtype=np.int64, endpoint=True)
    return values.astype(numpy_carrier(wire.wire_dtype))


def make_request_pool(spec: PoolSpec) -> list[Inputs]:
    """`pool_size` requests of `batch_size` samples, each a tuple with one array per model input."""
    generator = new_generator(spec.seed)
    return [
        tuple(make_wire_input(wire, spec.batch_size, generator) for wire in spec.inputs) for _ in range(spec.pool_size)
    ]
