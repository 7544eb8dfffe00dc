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


@dataclass(frozen=True)
class Ratio:
    ratio: float
    low: float
    high: float
    verdict: str


def bootstrap_ratio(
    values: Sequence[float], baseline: Sequence[float], higher_is_better: bool, resamples: int = 2000, seed: int = 0
) -> Ratio | None:
    """mean(values) / mean(baseline) with a 95 % percentile-bootstrap interval, resampling each side's repeats;
    the verdict says better or worse only when the whole interval is on one side of 1."""
    a = np.asarray(values, dtype=float)
    b = np.asarray(baseline, dtype=float)
    a, b = a[~np.isnan(a)], b[~np.isnan(b)]
    if len(a) < 2 or len(b) < 2 or b.mean() == 0:
        return None
    rng = np.random.default_rng(seed)
    means_a = rng.choice(a, size=(resamples, len(a)), replace=True).mean(axis=1)
    means_b = rng.choice(b, size=(resamples, len(b)), replace=True).mean(axis=1)
    ratios = means_a / np.where(means_b == 0, np.nan, means_b)
    low, high = np.nanpercentile(ratios, [2.5, 97.5])
    if low > 1:
        verdict = "better" if higher_is_better else "worse"
    elif high < 1:
        verdict = "worse" if higher_is_better else "better"
    else:
        verdict = "no difference the runs can show"
    return Ratio(float(a.mean() / b.mean()), float(low), float(high), verdict)
