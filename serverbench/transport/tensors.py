"""The torch side of the wire: each input dtype's torch dtype, and a request's arrays (the pool's, numpy) as the
tensors the backend computes on. Imported by the backend and the queue transport only: the frontend of the other
transports never imports torch."""

from __future__ import annotations

import numpy as np
import torch

from serverbench.config.inputs import DTYPES
from serverbench.transport.pool import PoolSpec, make_request_pool

TORCH_DTYPES = {name: getattr(torch, name) for name in DTYPES}  # each input dtype's name is torch's own


def torch_dtype(name: str) -> torch.dtype:
    return TORCH_DTYPES[name]


def as_tensor(array: np.ndarray, wire_dtype: str) -> torch.Tensor:
    """The array as a tensor of its wire dtype, sharing its memory (bfloat16: its uint16 words viewed so)."""
    tensor = torch.from_numpy(array)
    return tensor.view(torch.bfloat16) if wire_dtype == "bfloat16" else tensor


def as_tensors(arrays: tuple[np.ndarray, ...], wire_dtypes: tuple[str, ...]) -> tuple[torch.Tensor, ...]:
    return tuple(as_tensor(array, dtype) for array, dtype in zip(arrays, wire_dtypes))


def pool_tensors(spec: PoolSpec) -> list[tuple[torch.Tensor, ...]]:
    """The request pool (transport/pool.py) as tensors: what the frontend sends, as the backend computes on it."""
    dtypes = tuple(wire.wire_dtype for wire in spec.inputs)
    return [as_tensors(arrays, dtypes) for arrays in make_request_pool(spec)]
