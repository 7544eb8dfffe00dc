"""Arrival schedules for the open-loop load: drawn up front from a seed, so a run can be repeated exactly."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np


def arrival_offsets_s(
    rate_rps: float, burstiness: float, seed: int | Sequence[int], count: int = 0, chunk: int = 1024
) -> Iterator[float]:
    """Intended send times, in seconds after the measured phase begins: 0, then gamma-distributed gaps of mean
    1/rate_rps. burstiness is the gamma shape (1.0: exponential gaps, a Poisson process; below 1 burstier,
    above 1 more regular); the gaps' coefficient of variation is 1/sqrt(burstiness).

    The first `count` gaps are scaled so that they add up to exactly count/rate_rps: a run of `count` requests
    is offered exactly the rate asked for, not a sample of it (300 Poisson gaps alone vary by ~6 %). For
    Poisson arrivals that is the process conditioned on its count, so the pattern keeps its shape. Any requests
    after those follow unscaled gaps. `seed`: an int, or several (numpy's SeedSequence), one stream for each."""
    rng = np.random.default_rng(seed)
    scale = 1.0 / (rate_rps * burstiness)
    t_s = 0.0
    if count > 0:
        gaps = rng.gamma(shape=burstiness, scale=scale, size=count)
        if not gaps.sum() > 0:  # a shape far below 1 (--burstiness 0.001) underflows every draw to 0
            gaps = _shares_in_log_space(rng, burstiness, count)
        gaps *= (count / rate_rps) / gaps.sum()
        for gap_s in gaps:
            yield t_s
            t_s += float(gap_s)
    while True:
        for gap_s in rng.gamma(shape=burstiness, scale=scale, size=chunk):
            yield t_s
            t_s += float(gap_s)


def _shares_in_log_space(rng: np.random.Generator, shape: float, count: int) -> np.ndarray:
    """`count` gamma(shape) draws divided by their sum, drawn in log space: gamma(k) is gamma(k + 1) x U^(1/k), whose
    logarithm stays finite where the draw itself is below the smallest float."""
    log_draws = np.log(rng.gamma(shape=shape + 1.0, size=count)) + np.log1p(-rng.random(count)) / shape
    return np.exp(log_draws - np.logaddexp.reduce(log_draws))
