"""A model whose cost per forward is set, so that the best server for it is known before any run: each forward
waits `fixed_ms + per_row_sq_ms x rows^2` (a sleep: the core stays free, as a GPU kernel leaves the CPU free) and
returns each row's sum. Rows per forward then pay most at about sqrt(fixed_ms / per_row_sq_ms) (8 by default):
dynamic batching wins up to there and loses past it, and more prediction threads win while requests are waiting.
What bench.search is checked on (docs/search.md):

    python -m bench.search --objective throughput --concurrency 16 -- --model examples.planted_cost:make \
        --input x:float32:4 --device cpu
"""

from __future__ import annotations

import time

import torch
from torch import nn


class PlantedCost(nn.Module):
    def __init__(self, fixed_ms: float, per_row_sq_ms: float) -> None:
        super().__init__()
        self.fixed_s = fixed_ms / 1e3
        self.per_row_sq_s = per_row_sq_ms / 1e3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        time.sleep(self.fixed_s + self.per_row_sq_s * rows * rows)
        return x.sum(dim=1)


def make(fixed_ms: float = 32.0, per_row_sq_ms: float = 0.5) -> nn.Module:
    return PlantedCost(fixed_ms, per_row_sq_ms)
