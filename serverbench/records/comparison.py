"""Rows of two configurations made in turn, paired by their round and put to the one A/B method
(serverbench.schema.ab): what report.py --baseline, bench.compare and bench.commits each print."""

from __future__ import annotations

import pandas as pd

from serverbench.schema.ab import NORMALISE_BY_MACHINE_SPEED, Comparison, compare_ab

SPEED_COLUMNS = ("machine_speed_before", "machine_speed_after")
LOWER_IS_BETTER_SUFFIXES = ("_latency_s", "_ms", "_s")  # latencies and times; every other figure is a rate


def higher_is_better(column: str) -> bool:
    """A rate (throughput, achieved_rate_rps, efficiency) is better higher; a latency or time, lower."""
    return not column.endswith(LOWER_IS_BETTER_SUFFIXES)


def figures_by_round(rows: pd.DataFrame, column: str, normalise: bool = NORMALISE_BY_MACHINE_SPEED) -> pd.Series:
    """The ok rows' `column` indexed by their round (`repeat`; rows without one: their order), divided by the
    machine's speed (a latency: multiplied) when `normalise`, for the rows of the CPU device that have it: a slower
    machine gives a lower rate and a longer latency alike. The probe times the host's cores, which is what a CPU
    row's throughput follows (bench.resolution measured that it narrows the spread there); a GPU row's does not,
    and stays as it is."""
    ok = rows[rows["status"] == "ok"] if "status" in rows else rows
    values = pd.to_numeric(ok[column], errors="coerce") if column in ok else pd.Series(float("nan"), ok.index)
    if normalise and all(name in ok for name in SPEED_COLUMNS) and "device" in ok:
        speed = ok[list(SPEED_COLUMNS)].apply(pd.to_numeric, errors="coerce").mean(axis=1)
        on_cpu = ok["device"].astype(str) == "cpu"
        speed = speed.where(on_cpu, 1.0)
        values = values / speed if higher_is_better(column) else values * speed
    rounds = ok["repeat"].to_numpy() if "repeat" in ok else range(len(ok))
    figures = pd.Series(values.to_numpy(), index=rounds).dropna()
    return figures[~figures.index.duplicated(keep="first")]


def speed_known(rows: pd.DataFrame) -> bool:
    """Every ok row is of the CPU device and has both speed probes (rows of an older server.py have none)."""
    ok = rows[rows["status"] == "ok"] if "status" in rows else rows
    if ok.empty or "device" not in ok or not all(name in ok for name in SPEED_COLUMNS):
        return False
    speeds = ok[list(SPEED_COLUMNS)].apply(pd.to_numeric, errors="coerce")
    return bool((ok["device"].astype(str) == "cpu").all() and speeds.notna().all().all())


def compare_rows(
    base: pd.DataFrame, other: pd.DataFrame, column: str, base_name: str, other_name: str
) -> Comparison | None:
    """`other` against `base` on `column`, over the rounds both ran ok; None with fewer than 2 such rounds. Both
    sides are divided by the machine's speed, or neither: where either lacks it, both stay raw (and the verdict's
    column says which)."""
    normalise = NORMALISE_BY_MACHINE_SPEED and speed_known(base) and speed_known(other)
    a = figures_by_round(base, column, normalise)
    b = figures_by_round(other, column, normalise)
    rounds = a.index.intersection(b.index)
    return compare_ab(
        a.loc[rounds].to_numpy(),
        b.loc[rounds].to_numpy(),
        higher_is_better(column),
        base_name,
        other_name,
        f"{column} per machine speed" if normalise else column,
    )
