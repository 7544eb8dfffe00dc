"""The one A/B method: is B slower or faster than A, from runs made in turn (A B A B ...), and how sure.

The runs pair by the order they were made in (repeat i of A with repeat i of B), so that a drift of the machine
between invocations, which moves both runs of a pair alike, drops out of each pair's ratio B/A. The interval is on
the geometric mean of those ratios; the verdict says slower or faster only when the whole 95 % interval is on one
side of 1, and otherwise how many repeats would resolve a difference of the size seen.

Which interval: bench.resolution plants known slowdowns (0 to 10 %) and counts how often each method calls them, on
this machine (results/resolution), with the alternatives it weighs (its own module); `DEFAULT_METHOD` is the one
chosen from its figures (docs/methodology.md). Every A/B command (report.py --baseline, bench.compare, bench.commits)
prints `Comparison.text`.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats as scipy_stats

CONFIDENCE = 0.95
POWER = 0.80  # "about N repeats would resolve": the repeats that detect that difference 80 % of the time
MIN_RESOLVE_PCT = 1.0  # the smallest difference the advice is given for
MAX_ADVISED_REPEATS = 10_000


def shuffled(items: Iterable, seed: int, *key: object) -> list:
    """`items` in an order drawn from the seed and the round's key (its repeat; or names and a repeat): runs taken
    so, round after round, meet the machine's drift alike, which the interleaved pairs of the A/B method need. The
    same seed and key give the same order (a lone int key keeps the orders sweeps and studies have always had)."""
    order = list(items)
    if len(key) == 1 and isinstance(key[0], int):
        rng = random.Random(seed * 1_000_003 + key[0])
    else:
        rng = random.Random(":".join(map(str, (seed, *key))))
    rng.shuffle(order)
    return order


@dataclass(frozen=True)
class Interval:
    centre: float  # the mean log ratio ln(B/A)
    low: float  # the interval's ends, on the log ratio; -inf/inf where the pairs are too few for this method
    high: float


def t_interval(log_ratios: np.ndarray) -> Interval:
    """Student's t on the pairs' log ratios: exact for normal log ratios, fine from 2 pairs."""
    n = len(log_ratios)
    mean = float(log_ratios.mean())
    half = float(scipy_stats.t.ppf(0.5 + CONFIDENCE / 2, n - 1)) * float(log_ratios.std(ddof=1)) / math.sqrt(n)
    return Interval(mean, mean - half, mean + half)


@dataclass(frozen=True)
class IntervalMethod:
    """A way to put a 95 % interval on the pairs' mean log ratio, by its name."""

    name: str
    interval: Callable[[np.ndarray], Interval]


# Student's t, chosen from bench.resolution's figures (docs/methodology.md); the alternatives it weighed are the
# study's own (bench/resolution_report.py).
DEFAULT_METHOD = IntervalMethod("t", t_interval)
# Whether the A/B commands divide each run's throughput by its machine speed first (the mean of machine_speed_before and
# _after; CPU rows only): in bench.resolution's 32 rounds it narrowed the pairs' spread (sd of ln(b0/a): resnet18 8.4
# -> 6.6 %, identity 25.3 -> 23.2 %; docs/methodology.md).
NORMALISE_BY_MACHINE_SPEED = True


def repeats_to_resolve(log_ratio_sd: float, difference_pct: float, higher_is_better: bool = True) -> int | None:
    """The pairs that detect B `difference_pct` % worse 80 % of the time at 95 % confidence, for pairs whose log
    ratios spread by `log_ratio_sd` (the paired t test's power, in its usual normal-quantile form with t's
    quantiles). Worse by d % is a ratio of 1 - d/100 for a rate, 1 + d/100 for a latency. None where even
    MAX_ADVISED_REPEATS would not, or the spread is unknown."""
    if not 0 < difference_pct < 100:
        return None
    effect = -math.log1p(-difference_pct / 100) if higher_is_better else math.log1p(difference_pct / 100)
    return pairs_for_effect(log_ratio_sd, effect)


def pairs_for_effect(log_ratio_sd: float, effect: float) -> int | None:
    """The pairs that detect a log ratio of `effect` (either way) 80 % of the time at 95 % confidence; None where
    even MAX_ADVISED_REPEATS would not, or the spread is unknown."""
    if not effect > 0:
        return None
    if log_ratio_sd == 0:
        return 2
    if not (log_ratio_sd > 0 and math.isfinite(log_ratio_sd)):
        return None
    normal = (scipy_stats.norm.ppf(0.5 + CONFIDENCE / 2) + scipy_stats.norm.ppf(POWER)) * log_ratio_sd / effect
    if normal**2 > MAX_ADVISED_REPEATS:  # t's quantiles only add to the normal's
        return None
    for n in range(max(2, math.floor(normal**2)), MAX_ADVISED_REPEATS + 1):
        quantiles = scipy_stats.t.ppf(0.5 + CONFIDENCE / 2, n - 1) + scipy_stats.t.ppf(POWER, n - 1)
        if n >= (quantiles * log_ratio_sd / effect) ** 2:
            return n
    return None


@dataclass(frozen=True)
class Comparison:
    """B against A on one column, over `pairs` pairs of runs."""

    a: str
    b: str
    column: str
    higher_is_better: bool
    pairs: int
    ratio: float  # geometric mean of B/A
    low: float  # the 95 % interval on that ratio
    high: float
    log_ratio_sd: float
    method: str

    @property
    def verdict(self) -> str:
        """ "slower", "faster" or "cannot tell": slower means B is worse on this column."""
        if self.low > 1:
            return "faster" if self.higher_is_better else "slower"
        if self.high < 1:
            return "slower" if self.higher_is_better else "faster"
        return "cannot tell"

    @property
    def difference_pct(self) -> float:
        """How much worse B is, in % of A's figure (negative: better)."""
        return (1 - self.ratio) * 100 if self.higher_is_better else (self.ratio - 1) * 100

    def _interval_text(self) -> str:
        ends = (
            "unbounded with so few pairs"
            if math.isinf(self.low) or math.isinf(self.high)
            else (f"95 % interval {self.low:.3f} to {self.high:.3f}")
        )
        return f"{self.column} {self.b}/{self.a} {self.ratio:.3f}, {ends}, {self.pairs} pairs"

    @property
    def short(self) -> str:
        """For a table cell: the ratio, its interval and the verdict in a few words."""
        if self.identical:
            return f"{self.ratio:.3f} [{self.low:.3f}, {self.high:.3f}]: the same in every pair"
        if self.verdict == "cannot tell":
            needed = self.repeats_needed
            advice = f"~{needed} repeats for {self.resolve_pct:.1f} %" if needed else "too noisy to advise"
            return f"{self.ratio:.3f} [{self.low:.3f}, {self.high:.3f}]: cannot tell apart ({advice})"
        return f"{self.ratio:.3f} [{self.low:.3f}, {self.high:.3f}]: {abs(self.difference_pct):.1f} % {self.verdict}"

    @property
    def resolve_pct(self) -> float:
        """The difference the advice is for: the one seen, and at least MIN_RESOLVE_PCT."""
        return max(abs(self.difference_pct), MIN_RESOLVE_PCT)

    @property
    def repeats_needed(self) -> int | None:
        """For the difference seen, as the log of the ratio seen (a rate 3.9x another's is a 290 % difference,
        which 'worse by d %' cannot say past 100 %), and at least MIN_RESOLVE_PCT's."""
        smallest = -math.log1p(-MIN_RESOLVE_PCT / 100) if self.higher_is_better else math.log1p(MIN_RESOLVE_PCT / 100)
        seen = abs(math.log(self.ratio)) if self.ratio > 0 and math.isfinite(self.ratio) else 0.0
        return pairs_for_effect(self.log_ratio_sd, max(seen, smallest))

    @property
    def identical(self) -> bool:
        """Every pair gave B the same figure as A: nothing to resolve, whatever the count of pairs."""
        return self.log_ratio_sd == 0 and self.ratio == 1

    @property
    def text(self) -> str:
        """The verdict in words, never a ratio without its interval."""
        if self.identical:
            return f"{self.b} and {self.a} gave the same {self.column} in each of {self.pairs} pairs: no difference"
        if self.verdict == "cannot tell":
            needed = self.repeats_needed
            advice = (
                f"about {needed} repeats would resolve a {self.resolve_pct:.1f} % difference"
                if needed
                else f"more than {MAX_ADVISED_REPEATS} repeats would be needed to resolve {self.resolve_pct:.1f} %"
            )
            return f"cannot tell {self.b} and {self.a} apart at this noise ({self._interval_text()}): {advice}"
        return f"{self.b} is {abs(self.difference_pct):.1f} % {self.verdict} than {self.a} ({self._interval_text()})"


def paired_log_ratios(a: Sequence[float], b: Sequence[float]) -> np.ndarray:
    """ln(b_i / a_i) for the pairs where both runs have a positive figure; a[i] and b[i] ran in the same round."""
    a_arr = np.asarray(a, dtype=float)
    b_arr = np.asarray(b, dtype=float)
    keep = np.isfinite(a_arr) & np.isfinite(b_arr) & (a_arr > 0) & (b_arr > 0)
    return np.log(b_arr[keep] / a_arr[keep])


def compare_ab(
    a: Sequence[float],
    b: Sequence[float],
    higher_is_better: bool,
    a_name: str = "A",
    b_name: str = "B",
    column: str = "throughput",
    method: IntervalMethod = DEFAULT_METHOD,
) -> Comparison | None:
    """B against A, pairing a[i] with b[i] (runs made in the same round, in turn); None with fewer than 2 pairs."""
    log_ratios = paired_log_ratios(a, b)
    if len(log_ratios) < 2:
        return None
    interval = method.interval(log_ratios)
    return Comparison(
        a_name,
        b_name,
        column,
        higher_is_better,
        len(log_ratios),
        math.exp(interval.centre),
        math.exp(interval.low),
        math.exp(interval.high),
        float(log_ratios.std(ddof=1)),
        method.name,
    )
