"""bench.resolution's analysis: trials drawn from the rounds of planted-difference runs, the verdict of each, and
the rates, table, targets and plot (see bench/resolution.py)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from bench.study import Verdict
from serverbench.records.comparison import SPEED_COLUMNS, figures_by_round
from serverbench.records.markdown import figure, table_head, table_row
from serverbench.records.plots import pyplot, save_figure
from serverbench.schema.ab import (
    CONFIDENCE,
    DEFAULT_METHOD,
    NORMALISE_BY_MACHINE_SPEED,
    Interval,
    IntervalMethod,
    compare_ab,
    paired_log_ratios,
    repeats_to_resolve,
)
from serverbench.schema.stats import cv_pct

PLANTED_DEFAULT = (0.0, 1.0, 2.0, 5.0, 10.0)
REPEATS_SHOWN = (3, 5, 7, 10)  # bench.compare's default, a middle, bench.commits', sweep.py's
TRIALS_CSV = "trials.csv"
PLOT = "resolution.png"
REPORT_MD = "resolution.md"
# The targets (the issue's): at 0 % a call in at most 5 % of trials; at 5 % detection in at least 80 %.
FALSE_POSITIVE_TARGET = 0.05
DETECTION_TARGET = 0.80
DETECTION_TARGET_PCT = 5.0


BOOTSTRAP_RESAMPLES = 4000


def _bootstrap_interval(log_ratios: np.ndarray) -> Interval:
    """Percentile bootstrap of the mean log ratio, resampling whole pairs (seeded: the same runs, the same answer)."""
    rng = np.random.default_rng(0)
    means = rng.choice(log_ratios, size=(BOOTSTRAP_RESAMPLES, len(log_ratios)), replace=True).mean(axis=1)
    low, high = np.percentile(means, [50 * (1 - CONFIDENCE), 50 * (1 + CONFIDENCE)])
    return Interval(float(log_ratios.mean()), float(low), float(high))


def _signed_rank_counts(n: int) -> np.ndarray:
    """How many of the 2**n sign patterns of ranks 1..n give each signed-rank sum W+ = 0..n(n+1)/2."""
    counts = np.zeros(n * (n + 1) // 2 + 1)
    counts[0] = 1
    for rank in range(1, n + 1):
        counts[rank:] = counts[rank:] + counts[:-rank].copy()
    return counts


def _signed_rank_interval(log_ratios: np.ndarray) -> Interval:
    """Hodges-Lehmann: the median of the Walsh averages, with the exact Wilcoxon signed-rank interval (needs 6
    pairs for 95 %: with fewer, no sign pattern is rare enough and the interval is unbounded)."""
    n = len(log_ratios)
    i, j = np.triu_indices(n)
    walsh = np.sort((log_ratios[i] + log_ratios[j]) / 2)
    centre = float(np.median(walsh))
    cumulative = np.cumsum(_signed_rank_counts(n)) / 2.0**n
    # k: the sum of ranks at or below which at most (1 - confidence) / 2 of the sign patterns fall
    k = int(np.searchsorted(cumulative, (1 - CONFIDENCE) / 2, side="right"))
    if k == 0:
        return Interval(centre, -math.inf, math.inf)
    return Interval(centre, float(walsh[k - 1]), float(walsh[len(walsh) - k]))


# The interval methods this study weighs against each other: the A/B commands' own (Student's t) and two
# alternatives that only this study uses.
INTERVAL_METHODS: dict[str, IntervalMethod] = {
    method.name: method
    for method in (
        DEFAULT_METHOD,
        IntervalMethod("bootstrap", _bootstrap_interval),
        IntervalMethod("signed_rank", _signed_rank_interval),
    )
}
DEFAULT = DEFAULT_METHOD.name


def planted_of(name: str) -> float | None:
    """b<P>'s P; None for a."""
    return float(name[1:]) if name.startswith("b") else None


def rounds_table(runs: pd.DataFrame, normalised: bool) -> pd.DataFrame:
    """Throughput by round (index: repeat) and configuration (columns), ok runs only; divided by the machine's
    speed (the mean of the probes before and after) when `normalised`."""
    return pd.DataFrame(
        {
            name: figures_by_round(group, "throughput", normalise=normalised)
            for name, group in runs.groupby("experiment", sort=True)
        }
    )


@dataclass(frozen=True)
class Rates:
    slower: float  # share of trials that said b slower
    faster: float
    trials: int

    @property
    def called(self) -> float:
        return self.slower + self.faster


UNPLANTED = ("a", "b0")  # the same configuration twice: either is the baseline of a round


def trial_rates(
    table: pd.DataFrame,
    planted: str,
    repeats: int,
    draws: int,
    method: str,
    rng: np.random.Generator,
    either_baseline: bool = True,
) -> Rates | None:
    """`draws` trials of `repeats` rounds drawn without replacement among those where a, b0 and b<P> all ran ok.

    a and b0 are one configuration run twice per round, so either may be a round's baseline: each trial takes one
    of them at random per round (and at 0 % the other as B). A trial then never hangs on which of two identical
    runs happened to be faster in this handful of rounds (16 rounds here left a 2.7 % gap between a and b0 by
    chance, which drawing from them alone would have counted as a difference in most trials). `either_baseline`
    False: a is always the baseline, as a user's runs would be; the report shows both."""
    columns = [c for c in (*UNPLANTED, planted) if c in table]
    pairs = table[list(dict.fromkeys(columns))].dropna()
    if planted not in table or "a" not in table or len(pairs) < max(repeats, 2):
        return None
    unplanted = pairs[[c for c in UNPLANTED if c in pairs]].to_numpy()
    b_planted = pairs[planted].to_numpy()
    slower = faster = 0
    for _ in range(draws):
        chosen = rng.choice(len(pairs), size=repeats, replace=False)
        # which unplanted run is each round's baseline
        side = rng.integers(0, unplanted.shape[1] if either_baseline else 1, size=repeats)
        a = unplanted[chosen, side]
        b = unplanted[chosen, unplanted.shape[1] - 1 - side] if planted in UNPLANTED else b_planted[chosen]
        verdict = compare_ab(a, b, higher_is_better=True, method=INTERVAL_METHODS[method])
        slower += verdict is not None and verdict.verdict == "slower"
        faster += verdict is not None and verdict.verdict == "faster"
    return Rates(slower / draws, faster / draws, draws)


def model_trials(runs: pd.DataFrame, model: str, repeats_list: Sequence[int], draws: int, seed: int) -> pd.DataFrame:
    """Every (normalisation, method, planted size, repeats) cell's rates, as rows."""
    rows = []
    for normalised in (False, True):
        if normalised and not all(c in runs for c in SPEED_COLUMNS):
            continue
        table = rounds_table(runs, normalised)
        planted_names = sorted((c for c in table.columns if planted_of(c) is not None), key=planted_of)
        for method in INTERVAL_METHODS:
            for name in planted_names:
                for repeats in repeats_list:
                    rng = np.random.default_rng([seed, repeats, int(planted_of(name) * 1000), normalised])
                    rates = trial_rates(table, name, repeats, draws, method, rng)
                    if rates is None:
                        continue
                    fixed = (
                        trial_rates(table, name, repeats, draws, method, rng, either_baseline=False)
                        if method == DEFAULT
                        else None
                    )
                    rows.append(
                        {
                            "model": model,
                            "normalised": normalised,
                            "method": method,
                            "planted_pct": planted_of(name),
                            "repeats": repeats,
                            "trials": rates.trials,
                            "rounds": int(table[["a", name]].dropna().shape[0]),
                            "detected": rates.slower,
                            "wrong_way": rates.faster,
                            "called": rates.called,
                            "rate": rates.called if planted_of(name) == 0 else rates.slower,  # what the report shows
                            "detected_a_baseline": fixed.slower if fixed else float("nan"),
                            "called_a_baseline": fixed.called if fixed else float("nan"),
                        }
                    )
    return pd.DataFrame(rows)


def seen_effects(runs: pd.DataFrame) -> list[str]:
    """Per planted size: the pairs' geometric-mean throughput ratio over every round, against the planted one."""
    table = rounds_table(runs, normalised=False)
    lines = table_head(["planted", "expected b/a", "seen b/a (all rounds)", "seen b/b0", "pairs"])

    def seen(name: str, base: str) -> float:
        pairs = table[[base, name]].dropna() if base in table and base != name else pd.DataFrame()
        log_ratios = paired_log_ratios(pairs[base], pairs[name]) if len(pairs) else np.array([])
        return float(np.exp(log_ratios.mean())) if len(log_ratios) else float("nan")

    for name in sorted((c for c in table.columns if planted_of(c) is not None), key=planted_of):
        pairs = int(table[["a", name]].dropna().shape[0])
        expected = 1 / (1 + planted_of(name) / 100)
        figures = [f"{expected:.3f}", f"{seen(name, 'a'):.3f}", f"{seen(name, 'b0'):.3f}", pairs]
        lines.append(table_row([f"{planted_of(name):g} %", *figures]))
    return lines


FIVE = 5  # the and bench.stability's invocations per CV


def spread(runs: pd.DataFrame, normalised: bool) -> dict[str, float | None]:
    """a's CV over all its invocations and over each 5 consecutive rounds (median and largest), and the sd of
    ln(b0/a) over the rounds: the pairs' own spread, which sets the repeats a difference needs."""
    table = rounds_table(runs, normalised)
    a = table["a"].dropna() if "a" in table else pd.Series(dtype=float)
    groups = [cv_pct(list(a.iloc[start : start + FIVE])) for start in range(0, len(a) - FIVE + 1, FIVE)]
    groups = [g for g in groups if g is not None]
    pairs = table[["a", "b0"]].dropna() if "b0" in table and "a" in table else pd.DataFrame()
    sd = float(paired_log_ratios(pairs["a"], pairs["b0"]).std(ddof=1)) * 100 if len(pairs) > 2 else None
    return {
        "cv": cv_pct(list(a)),
        "cv5_median": float(np.median(groups)) if groups else None,
        "cv5_max": max(groups) if groups else None,
        "pair_sd": sd,
    }


def spread_lines(runs: pd.DataFrame) -> list[str]:
    """The spreads raw and divided by the machine's speed, and the repeats 1, 2 and 5 % need at the chosen one."""
    has_speed = all(c in runs for c in SPEED_COLUMNS)
    spreads = {normalised: spread(runs, normalised) for normalised in ((False, True) if has_speed else (False,))}
    ok = runs[runs["status"] == "ok"]
    speeds = ok[list(SPEED_COLUMNS)].astype(float).mean(axis=1).dropna() if has_speed else pd.Series(dtype=float)

    lines = table_head(
        ["throughput", "CV of a (all)", "CV of a, 5 consecutive rounds (median, largest)", "sd of ln(b0/a)"]
    )
    for normalised, found in spreads.items():
        five = f"{figure(found['cv5_median'], unit=' %')}, {figure(found['cv5_max'], unit=' %')}"
        lines.append(
            table_row(
                [
                    "/ machine speed" if normalised else "raw",
                    figure(found["cv"], unit=" %"),
                    five,
                    figure(found["pair_sd"], unit=" %"),
                ]
            )
        )
    chosen = spreads.get(NORMALISE_BY_MACHINE_SPEED, spreads[False])["pair_sd"]
    needed = {pct: repeats_to_resolve(chosen / 100, pct) if chosen else None for pct in (1.0, 2.0, 5.0)}
    lines += [
        "",
        f"The machine's speed itself: CV {figure(cv_pct(list(speeds)), unit=' %')} over the runs. By the paired t "
        "test's power at the chosen spread: "
        + ", ".join(f"{pct:g} % needs about {n if n else 'n/a'} pairs" for pct, n in needed.items()),
    ]
    return lines


def detection_table(trials: pd.DataFrame, normalised: bool, method: str) -> list[str]:
    """Rows: planted size; columns: repeats; cells: share of trials that said b slower (at 0 %: that called
    anything)."""
    cell = trials[(trials["normalised"] == normalised) & (trials["method"] == method)]
    repeats = sorted(cell["repeats"].unique())
    lines = table_head(["planted", *(f"{r} repeats" for r in repeats)])
    for planted, group in cell.groupby("planted_pct"):
        by_repeats = group.set_index("repeats")
        what = "called (false positive)" if planted == 0 else "detected"
        cells = [figure(by_repeats["rate"].get(r), ".0f", 100, unit=" %") for r in repeats]
        lines.append(table_row([f"{planted:g} % {what}", *cells]))
    return lines


def method_table(trials: pd.DataFrame, repeats: int) -> list[str]:
    """Each interval method, raw and normalised: false positives at 0 % and detection at each planted size."""
    cell = trials[trials["repeats"] == repeats]
    sizes = sorted(cell["planted_pct"].unique())
    lines = table_head(["method", "throughput", *(f"{p:g} %" for p in sizes)])
    for (method, normalised), group in cell.groupby(["method", "normalised"]):
        by_size = group.set_index("planted_pct")
        cells = [figure(by_size["rate"].get(p), ".0f", 100, unit=" %") for p in sizes]
        lines.append(table_row([method, "/ machine speed" if normalised else "raw", *cells]))
    return lines


def smallest_detected(trials: pd.DataFrame, repeats: int, normalised: bool, method: str) -> float | None:
    cell = trials[
        (trials["repeats"] == repeats)
        & (trials["normalised"] == normalised)
        & (trials["method"] == method)
        & (trials["planted_pct"] > 0)
        & (trials["detected"] >= DETECTION_TARGET)
    ]
    return None if cell.empty else float(cell["planted_pct"].min())


def model_section(
    model: str, runs: pd.DataFrame, trials: pd.DataFrame, repeats: int, normalise: bool
) -> tuple[list[str], list[tuple[str, bool]]]:
    """One model's tables and its targets (text, met)."""
    spread = spread_lines(runs)
    failed = int((runs["status"] != "ok").sum())
    lines = [
        f"## {model}",
        "",
        f"{runs['repeat'].nunique()} rounds, {len(runs)} runs ({failed} failed). Throughput of b<P> against a:",
        "",
        *seen_effects(runs),
        "",
        "Spread over the invocations:",
        "",
        *spread,
        "",
        f"Detection by repeats ({DEFAULT} interval, throughput {'/ machine speed' if normalise else 'raw'}):",
        "",
        *detection_table(trials, normalise, DEFAULT),
        "",
        f"Every interval method at {repeats} repeats (0 %: trials that called a difference; else: that said b slower):",
        "",
        *method_table(trials, repeats),
        "",
    ]
    cell = trials[
        (trials["repeats"] == repeats) & (trials["normalised"] == normalise) & (trials["method"] == DEFAULT)
    ].set_index("planted_pct")
    targets = []
    if 0.0 in cell.index:
        called = float(cell.loc[0.0, "called"])
        targets.append((f"{model}: at 0 % a difference called in {called * 100:.1f} % of trials (target <= 5 %)",
                        called <= FALSE_POSITIVE_TARGET))  # fmt: skip
    if DETECTION_TARGET_PCT in cell.index:
        detected = float(cell.loc[DETECTION_TARGET_PCT, "detected"])
        targets.append(
            (
                f"{model}: 5 % planted detected in {detected * 100:.1f} % of trials at {repeats} repeats "
                "(target >= 80 %)",
                detected >= DETECTION_TARGET,
            )
        )
    if 0.0 in cell.index and DETECTION_TARGET_PCT in cell.index:
        lines += [
            f"With `a` always the baseline (no draw between the two unplanted runs), at {repeats} repeats: 0 % called "
            f"in {cell.loc[0.0, 'called_a_baseline'] * 100:.1f} % of trials, 5 % detected in "
            f"{cell.loc[DETECTION_TARGET_PCT, 'detected_a_baseline'] * 100:.1f} %.",
            "",
        ]
    smallest = smallest_detected(trials, repeats, normalise, DEFAULT)
    lines.append(
        f"Smallest planted difference detected in 80 % of trials at {repeats} repeats: "
        + (f"{smallest:g} %" if smallest is not None else "none of those planted")
        + "."
    )
    return lines, targets


def plot(trials: pd.DataFrame, repeats: int, normalise: bool, path: Path) -> None:
    fig, ax = pyplot().subplots(figsize=(6.4, 4.2))
    cell = trials[(trials["repeats"] == repeats) & (trials["normalised"] == normalise) & (trials["method"] == DEFAULT)]
    for model, group in cell.groupby("model"):
        group = group.sort_values("planted_pct")
        ax.plot(group["planted_pct"], group["rate"] * 100, marker="o", label=f"{model}")
    ax.axhline(DETECTION_TARGET * 100, color="grey", linestyle="--", linewidth=0.8, label="80 % detection")
    ax.axhline(FALSE_POSITIVE_TARGET * 100, color="grey", linestyle=":", linewidth=0.8, label="5 % false positives")
    ax.set_xlabel("planted slowdown (% of the time per batch)")
    ax.set_ylabel("% of trials (at 0 %: any call; else: 'b slower')")
    ax.set_title(f"A/B verdicts at {repeats} repeats ({DEFAULT} interval)")
    ax.set_ylim(-2, 102)
    ax.legend(loc="lower right")
    save_figure(fig, path)


def write_report(runs_by_model: dict[str, pd.DataFrame], out: Path, repeats: int, draws: int, seed: int) -> list[str]:
    """trials.csv and resolution.png in `out`; returns the report's lines (resolution.md's), its title first."""
    repeats_list = sorted({*REPEATS_SHOWN, repeats})
    trials = pd.concat(
        [model_trials(runs, model, repeats_list, draws, seed) for model, runs in runs_by_model.items()],
        ignore_index=True,
    ) if runs_by_model else pd.DataFrame()  # fmt: skip
    lines = [
        "# Resolution: how small a planted difference the A/B verdicts tell, and how often they call one not there",
        "",
        f"Trials: {repeats} rounds drawn at random ({draws} draws per cell) among those run; the verdict is "
        f"serverbench/schema/ab.py's ({DEFAULT} interval, 95 %), throughput "
        f"{'divided by the machine speed' if NORMALISE_BY_MACHINE_SPEED else 'raw'}.",
        "",
    ]
    targets: list[tuple[str, bool]] = []
    for model, runs in runs_by_model.items():
        section, model_targets = model_section(
            model, runs, trials[trials["model"] == model], repeats, NORMALISE_BY_MACHINE_SPEED
        )
        lines += [*section, ""]
        targets += model_targets
    lines += ["## Targets", "", *(Verdict(text, met).line() for text, met in targets), ""]
    out.mkdir(parents=True, exist_ok=True)
    if not trials.empty:
        trials.to_csv(out / TRIALS_CSV, index=False)
        plot(trials, repeats, NORMALISE_BY_MACHINE_SPEED, out / PLOT)
    return lines
