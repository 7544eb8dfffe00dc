"""Small statistics shared by the load side (stability windows) and the records (summary, comparisons)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class LatencyStats:
    mean_s: float
    std_s: float
    min_s: float
    max_s: float
    p50_s: float
    p90_s: float
    p95_s: float
    p99_s: float

    @classmethod
    def from_values(cls, values_s: Sequence[float]) -> LatencyStats:
        arr = np.asarray(values_s, dtype=np.float64)
        p50, p90, p95, p99 = np.percentile(arr, [50, 90, 95, 99])
        return cls(
            float(arr.mean()),
            float(arr.std(ddof=1)) if arr.size > 1 else 0.0,
            float(arr.min()),
            float(arr.max()),
            float(p50),
            float(p90),
            float(p95),
            float(p99),
        )


def cv_pct(values: Sequence[float]) -> float | None:
    """Coefficient of variation in % (sample standard deviation over mean); None for fewer than 2 values."""
    if len(values) < 2:
        return None
    mean = float(np.mean(values))
    return float(np.std(values, ddof=1)) / mean * 100 if mean > 0 else None
