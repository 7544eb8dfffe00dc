"""Do our latency statistics agree with MLPerf LoadGen's on the same server? Our p99 against LoadGen's p99, from the
same requests, at three Poisson (LoadGen Server scenario) rates.

    python -m bench.loadgen_agreement --out results/loadgen_agreement

One burst run of the server (by default the identity model on the CPU; flags after `--` change it, e.g. `--
--model resnet18 --image_size 32 --design serial`) measures its capacity (its achieved requests/s); then one
`--load loadgen --scenario Server` run at each of `--fractions` of it (25, 50 and 75 % by default), of the median
capacity when there are several repeats. On the study harness: every run is a row of `<out>/runs.csv`, the same
command resumes; `<out>/loadgen_agreement.md` (also printed) has, per rate and repeat, our p99, LoadGen's, their
ratio and LoadGen's verdict, and the target: a ratio within 0.95-1.05 at half the capacity (the median over the
repeats). Exit status 1 when it is missed or a run failed. Take the figures on a quiet machine: other work moves
both p99s, and not always by the same amount.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from bench.study import Study
from serverbench.config.flags import bounded
from serverbench.config.limits import MAX_BATCH_IMAGES
from serverbench.launch.study import Cell, Experiment, interleaved
from serverbench.records.markdown import figure, table_head, table_row

AGREEMENT = (0.95, 1.05)  # our p99 / LoadGen's, at the middle fraction
# The server measured: identity (the server's own cost), one image of 16x16 per request, on the CPU.
SERVER_FLAGS = ("--device", "cpu", "--model", "identity", "--image_size", "16")
CAPACITY = "capacity"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--fractions",
        type=bounded(float, 0.01, 0.99),
        nargs=3,
        default=[0.25, 0.5, 0.75],
        help="of the capacity, each 0.01 to 0.99 (default 0.25 0.5 0.75)",
    )
    parser.add_argument(
        "--duration_s",
        type=bounded(float, 0.1, 3600.0),
        default=60.0,
        help="each LoadGen run's minimum duration, 0.1 to 3600 s (60)",
    )
    parser.add_argument(
        "--capacity_iters", type=bounded(int, 1, 1_000_000), default=2000, help="requests of the burst run (2000)"
    )
    parser.add_argument(
        "--batch_size", type=bounded(int, 1, MAX_BATCH_IMAGES), default=1, help="samples per request (1)"
    )


def experiment_name(fraction: float) -> str:
    return f"loadgen_{round(fraction * 100)}pct"


def capacity_cells(args: argparse.Namespace, rows: pd.DataFrame | None) -> list[Cell]:
    """The burst run, once per repeat."""
    burst = Experiment(CAPACITY, ("--num_iters", str(args.capacity_iters)))
    return interleaved([Cell(burst, args.batch_size, False, 0)], args.repeats, args.seed)


def capacity_rps(rows: pd.DataFrame | None) -> float | None:
    """The median achieved requests/s of the ok burst runs; None before one."""
    if rows is None:
        return None
    ok = rows[(rows["experiment"] == CAPACITY) & (rows["status"] == "ok")]["achieved_rate_rps"].dropna()
    return float(ok.median()) if len(ok) else None


def loadgen_cells(args: argparse.Namespace, rows: pd.DataFrame | None) -> list[Cell]:
    """A LoadGen Server run at each fraction of the capacity; none when no burst run was ok (the report says so).
    Before the first row (the checks before any run) at a rate of 1 request/s: only the flags are checked."""
    capacity = capacity_rps(rows) if rows is not None else 1.0
    if capacity is None:
        return []
    round_cells = []
    for fraction in args.fractions:
        flags = ("--load", "loadgen", "--scenario", "Server", "--rate", f"{capacity * fraction:.6g}")
        flags += ("--duration_s", f"{args.duration_s:g}", "--num_iters", "1")  # the duration decides
        round_cells.append(Cell(Experiment(experiment_name(fraction), flags), args.batch_size, False, 0))
    return interleaved(round_cells, args.repeats, args.seed)


def checked_cells(args: argparse.Namespace, rows: pd.DataFrame | None) -> list[Cell]:
    """Every run, as the checks before any run see them (the LoadGen runs at a placeholder rate)."""
    return [*capacity_cells(args, None), *loadgen_cells(args, None)]


def agreement_table(runs: pd.DataFrame, fractions: Sequence[float]) -> tuple[list[str], bool | None]:
    """The table from the rows, and whether the middle fraction's median ratio is within AGREEMENT (None: no ok
    run there)."""
    capacity = capacity_rps(runs)
    served = "?"
    bursts = runs[runs["experiment"] == CAPACITY]
    if not bursts.empty:  # what the flags after -- made of SERVER_FLAGS, as the row says
        row = bursts.iloc[-1]
        served = ", ".join(str(row[c]) for c in ("model", "design", "batch_size", "inputs") if pd.notna(row.get(c)))
    lines = [
        f"Capacity (burst; {served}): {figure(capacity)} requests/s.",
        "",
        *table_head(
            "| fraction | repeat | rate (req/s) | requests | our p99 (ms) | LoadGen p99 (ms) | ours / LoadGen's | "
            "LoadGen verdict | status |"
        ),
    ]
    middle = sorted(fractions)[len(fractions) // 2]
    middle_ratios: list[float] = []
    for fraction in fractions:
        rows = runs[runs["experiment"] == experiment_name(fraction)]
        if rows.empty:
            lines.append(table_row([f"{fraction:.0%}", *[""] * 7, "not run"]))
        for _, row in rows.iterrows():
            ratio = row.get("loadgen_p99_ratio")
            # A failed run has no verdict (whatever an older row recorded): LoadGen judged its unanswered samples.
            ok = row["status"] == "ok"
            verdict = {True: "VALID", False: "INVALID"}.get(row.get("loadgen_valid"), "") if ok else ""
            # The rate the run was given (a repeat a resume added ran at the capacity then, not now's); rows from
            # before the row held it: the fraction of the capacity now
            asked = row.get("offered_rate_rps")
            if pd.isna(asked):
                asked = None if capacity is None else capacity * fraction
            rate = f"{figure(asked, missing='?')} ({row['loadgen_scheduled_rps']:.1f} scheduled)"
            p99s = [f"{row['p99_latency_s'] * 1e3:.3f}", f"{row['loadgen_p99_latency_s'] * 1e3:.3f}", f"{ratio:.3f}"]
            lines.append(
                table_row([f"{fraction:.0%}", row["repeat"], rate, row["requests_sent"], *p99s, verdict, row["status"]])
            )
            if fraction == middle and ok and pd.notna(ratio):
                middle_ratios.append(float(ratio))
    met = AGREEMENT[0] <= float(pd.Series(middle_ratios).median()) <= AGREEMENT[1] if middle_ratios else None
    shown = f" (median {pd.Series(middle_ratios).median():.3f})" if middle_ratios else ""
    lines += [
        "",
        f"Target: at {middle:.0%} of the capacity our p99 is within {AGREEMENT[0]:g}-{AGREEMENT[1]:g} x LoadGen's"
        f"{shown}: " + {True: "met", False: "NOT met", None: "not measured"}[met],
    ]
    return lines, met


def report(args: argparse.Namespace, rows: pd.DataFrame, out: Path) -> list[str]:
    return ["# Our p99 against LoadGen's", "", *agreement_table(rows, args.fractions)[0]]


def target_met(args: argparse.Namespace, rows: pd.DataFrame) -> bool | None:
    return agreement_table(rows, args.fractions)[1]


STUDY = Study(
    "loadgen_agreement",
    __doc__,
    (capacity_cells, loadgen_cells),
    report,
    add_arguments,
    repeats=1,
    server_flags=SERVER_FLAGS,
    target_met=target_met,
    checked_cells=checked_cells,
)


main = STUDY.main


if __name__ == "__main__":
    raise SystemExit(main())
