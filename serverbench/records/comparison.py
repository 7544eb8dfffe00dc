"""Rows of two configurations made in turn, paired by their round and put to the one A/B method
(serverbench.schema.ab): what report.py --baseline, bench.compare and bench.commits each print."""

from __future__ import annotations

import numpy as np
import pandas as pd

from serverbench.schema.ab import NORMALISE_BY_MACHINE_SPEED, Comparison, compare_ab
from serverbench.schema.columns import COLUMNS

SPEED_COLUMNS = ("machine_speed_before", "machine_speed_after")
HIGHER_UNITS = ("samples/s", "requests/s")  # rates: more is better
LOWER_UNITS = ("s", "ms", "us")  # latencies and times: less is better
HIGHER_RATIOS = ("efficiency", "slo_attainment")  # shares of a best case
# What the machine-speed division was measured to help (bench.resolution): throughput. An offered rate's achieved
# rate, an efficiency (already relative to the model alone) or a queueing latency do not follow the machine's speed.
NORMALISED_COLUMNS = ("throughput",)
# The probe runs beside whatever else the configuration runs at that moment: with other instances, or with the
# frontend on its own core or not, it reads another machine. Only rows alike in these are divided.
PROBE_CONDITIONS = ("instances", "cpu_split")


def better_when_higher(column: str) -> bool | None:
    """True for a rate or a share of the best case, False for a latency or time; None for a figure with no better
    side (a count, a %, a size), which no verdict of slower or faster fits."""
    unit = next((c.unit for c in COLUMNS if c.name == column), None)
    if unit in HIGHER_UNITS or column in HIGHER_RATIOS:
        return True
    if unit in LOWER_UNITS:
        return False
    return None


def _rounds(ok: pd.DataFrame) -> list:
    """Each ok row's round: its `repeat`; by the rows' order where there is none or every row has the same one
    (plain server.py runs all write repeat 0), so that such rows still pair one to one."""
    if "repeat" in ok and not ok["repeat"].isna().any() and (ok["repeat"].nunique() > 1 or len(ok) == 1):
        return list(ok["repeat"])
    return list(range(len(ok)))


def figures_by_round(rows: pd.DataFrame, column: str, normalise: bool = NORMALISE_BY_MACHINE_SPEED) -> pd.Series:
    """The ok rows' `column` by round, divided by the machine's speed (the mean of the probes before and after)
    when `normalise` and the column is one the division was measured to help, for the rows of the CPU device that
    have it: the probe times the host's cores, which a CPU row's throughput follows; a GPU row's does not."""
    ok = rows[rows["status"] == "ok"] if "status" in rows else rows
    values = pd.to_numeric(ok[column], errors="coerce") if column in ok else pd.Series(float("nan"), ok.index)
    if normalise and column in NORMALISED_COLUMNS and all(name in ok for name in SPEED_COLUMNS) and "device" in ok:
        speed = ok[list(SPEED_COLUMNS)].apply(pd.to_numeric, errors="coerce").mean(axis=1)
        values = values / speed.where(ok["device"].astype(str) == "cpu", 1.0)
    by_round = pd.Series(values.to_numpy(), index=_rounds(ok)).dropna()
    # A round run twice (a rerun of one repeat) counts once, by its last run: pairing by row order instead put rows
    # of different rounds side by side without a word.
    return by_round[~by_round.index.duplicated(keep="last")]


def speed_known(rows: pd.DataFrame) -> bool:
    """Every ok row is of the CPU device and has both speed probes, each a positive finite figure (rows of an older
    server.py have none)."""
    ok = rows[rows["status"] == "ok"] if "status" in rows else rows
    if ok.empty or "device" not in ok or not all(name in ok for name in SPEED_COLUMNS):
        return False
    speeds = ok[list(SPEED_COLUMNS)].apply(pd.to_numeric, errors="coerce")
    # A probe of 0, below 0 or infinite is no speed: dividing by it would drop or invert every round.
    measured = speeds.notna().all().all() and bool(((speeds > 0) & np.isfinite(speeds)).all().all())
    return bool((ok["device"].astype(str) == "cpu").all() and measured)


def probed_alike(base: pd.DataFrame, other: pd.DataFrame) -> bool:
    """Both sides' probes ran under the same conditions (PROBE_CONDITIONS), as far as the rows say."""
    for name in PROBE_CONDITIONS:
        values = {str(v) for frame in (base, other) if name in frame for v in frame[name].unique()}
        if len(values) > 1:
            return False
    return True


def compare_rows(
    base: pd.DataFrame, other: pd.DataFrame, column: str, base_name: str, other_name: str
) -> Comparison | None:
    """`other` against `base` on `column`, over the rounds both ran ok; None with fewer than 2 such rounds.
    Throughput is divided by the machine's speed on both sides or on neither: where either side lacks the probe
    or the two were probed under other conditions, both stay raw (the verdict's column says which). ValueError for
    a column with no better side."""
    higher = better_when_higher(column)
    if higher is None:
        raise ValueError(f"{column}: neither a rate nor a time, so neither side is slower")
    normalise = (
        NORMALISE_BY_MACHINE_SPEED
        and column in NORMALISED_COLUMNS
        and speed_known(base)
        and speed_known(other)
        and probed_alike(base, other)
    )
    a = figures_by_round(base, column, normalise)
    b = figures_by_round(other, column, normalise)
    rounds = a.index.intersection(b.index)
    # Said where printed: each run's figure divided by its own machine-speed probe, so the VM's drift cancels.
    label = f"{column} per machine speed (each run's over its speed probe)" if normalise else column
    return compare_ab(a.loc[rounds].to_numpy(), b.loc[rounds].to_numpy(), higher, base_name, other_name, label)
