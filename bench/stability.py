"""Do the numbers hold still? The same commands run again and again, interleaved, and the spread of what they print.

    python -m bench.stability --out results/stability
    python -m bench.stability --suites identity --repeats 2 --out /tmp/st -- --image_size 16   # a short try

A study on the harness (bench/study.py), a phase per suite: every repeat round runs each of the suite's commands
once, in a shuffled order, so a drift of the machine spreads over all of them; each run with stability windows
(`--stability_pct 5`); flags after -- come after a suite's own and override them; the same command resumes:

- resnet18, batch 32, 64x64, `serial` and `pipelined --num_workers 2`: throughput CV over the invocations at most
  3 %, and every row's efficiency between 0.8 and 1.05;
- identity, batch 64, 250x250 (the server's own cost, no model): throughput CV at most 5 %.

Writes `<out>/stability.md` (and prints it): each invocation's throughput, efficiency, windows and verdict, the
CV over the invocations against its target, the CV of throughput divided by each run's machine speed
(machine_speed_before/_after: how much of the spread the speed probe accounts for), and the CV of the ceiling (the
model alone, timed in the same invocations): how much this machine itself moved over the same minutes, the floor
under any server's spread. Beside them, each invocation's machine noise (steal, other processes' CPU, run-queue
wait, the longest stall, noisy windows) and whether the machine was quiet, and the check that no row shows an
efficiency above 1.05 whose interval does not hold 1 (a bare 1.13 is noise or a wrong ceiling; "within noise" is
said only when the interval holds 1).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from bench.study import Phase, Study, Verdict, part_rows, repeat_cells
from serverbench.config.flags import bounded
from serverbench.launch.study import Cell, Experiment, interleaved
from serverbench.records.comparison import SPEED_COLUMNS, figures_by_round
from serverbench.records.markdown import figure, table_head, table_row
from serverbench.records.summary import WITHIN_NOISE, efficiency_verdict
from serverbench.schema.stats import cv_pct


@dataclass(frozen=True)
class Suite:
    name: str
    designs: dict[str, tuple[str, ...]]  # experiment name -> its design's flags
    batch_size: int
    server_flags: tuple[str, ...]  # every run's
    cv_target_pct: float  # throughput CV over the invocations, at most
    efficiency_range: tuple[float, float] | None  # every row's efficiency within, where the model is real


PIPELINED_2W = ("--design", "pipelined", "--num_workers", "2")
SUITES = (
    Suite(
        "resnet18",
        {"serial": ("--design", "serial"), "pipelined_2w": PIPELINED_2W},
        32,
        ("--model", "resnet18", "--image_size", "64"),
        3.0,
        (0.8, 1.05),
    ),
    Suite("identity", {"pipelined_2w": PIPELINED_2W}, 64, ("--model", "identity", "--image_size", "250"), 5.0, None),
)


def evaluate(runs: pd.DataFrame, suite: Suite) -> tuple[list[str], list[Verdict]]:
    """The suite's table (one line per experiment) and its verdicts against the targets, from its rows."""
    lines = table_head(
        "| experiment | throughput of each invocation (samples/s) | mean | CV | "
        "CV of throughput / machine speed | efficiency (min-max) | windows | stable | ceiling CV |"
    )
    verdicts: list[Verdict] = []
    for name, group in runs.groupby("experiment", sort=True):
        group = group.sort_values("repeat")
        ok = group[group["status"] == "ok"]
        throughputs = list(ok["throughput"].dropna())
        cv = cv_pct(throughputs)
        efficiency = ok["efficiency"].dropna() if "efficiency" in ok else pd.Series(dtype=float)
        normalised = figures_by_round(ok, "throughput", normalise=True) if all(c in ok for c in SPEED_COLUMNS) else []
        normalised_cv = cv_pct(list(normalised))
        ceiling_cv = cv_pct(list(ok["ceiling_throughput"].dropna())) if "ceiling_throughput" in ok else None
        stable = f"{int((ok['stable'].astype(str) == 'True').sum())}/{len(ok)}" if "stable" in ok else "n/a"
        efficiencies = f"{efficiency.min():.3f}-{efficiency.max():.3f}" if len(efficiency) else "n/a"
        windows = ", ".join(str(int(w)) for w in ok["windows"].dropna()) if "windows" in ok else "n/a"
        cvs = [figure(v, unit=" %") for v in (normalised_cv, ceiling_cv)]
        repeats = repeat_cells(throughputs, ".1f")  # each invocation's, their mean, their CV
        lines.append(table_row([name, *repeats, cvs[0], efficiencies, windows, stable, cvs[1]]))
        if len(ok) < len(group):
            verdicts.append(Verdict(f"{name}: {len(group) - len(ok)} of {len(group)} runs failed", False))
        verdicts.append(
            Verdict(
                f"{name}: throughput CV over {len(throughputs)} invocations "
                f"{'n/a' if cv is None else f'{cv:.1f} %'} (target <= {suite.cv_target_pct:g} %)",
                cv is not None and cv <= suite.cv_target_pct,
            )
        )
        if suite.efficiency_range is not None:
            low, high = suite.efficiency_range
            inside = bool(len(efficiency)) and bool(((efficiency >= low) & (efficiency <= high)).all())
            verdicts.append(
                Verdict(
                    f"{name}: efficiency {efficiency.min():.3f} to {efficiency.max():.3f} "
                    f"(target: every row in [{low:g}, {high:g}])"
                    if len(efficiency)
                    else f"{name}: no efficiency",
                    inside,
                )
            )
    lines += ["", *noise_table(runs)]
    verdicts += efficiency_verdicts(runs)
    return lines, verdicts


def quiet(row: pd.Series) -> bool:
    """The machine kept out of this invocation: no noise warning and no noisy window."""
    warning = row.get("noise_warning")
    noisy = row.get("noisy_windows")
    return (warning is None or pd.isna(warning) or not str(warning)) and (noisy is None or pd.isna(noisy) or not noisy)


def noise_table(runs: pd.DataFrame) -> list[str]:
    """Each invocation's efficiency with its interval and what the machine did meanwhile."""
    lines = table_head(
        "| experiment | repeat | throughput | efficiency (interval) | steal % | other CPU % | "
        "run-queue wait % (backend, frontend) | longest stall ms | noisy windows | quiet |"
    )
    for _, row in runs.sort_values(["experiment", "repeat"]).iterrows():
        interval = (
            f" ({figure(row.get('efficiency_low'), '.3f')}-{figure(row.get('efficiency_high'), '.3f')})"
            if "efficiency_low" in row and not pd.isna(row.get("efficiency_low"))
            else ""
        )
        verdict = "yes" if quiet(row) else f"no: {row.get('noise_warning') or 'noisy windows'}"
        waits = f"{figure(row.get('runqueue_wait_pct_backend'))}, {figure(row.get('runqueue_wait_pct_frontend'))}"
        cpu = [figure(row.get("cpu_steal_pct")), figure(row.get("other_cpu_pct")), waits]
        figures = [figure(row.get("throughput")), figure(row.get("efficiency"), ".3f") + interval, *cpu]
        stalls = [figure(row.get("max_stall_ms")), figure(row.get("noisy_windows"), ".0f")]
        lines.append(table_row([row["experiment"], int(row["repeat"]), *figures, *stalls, verdict]))
    return lines


def efficiency_verdicts(runs: pd.DataFrame) -> list[Verdict]:
    """No row shows an efficiency above 1.05 unless its interval holds 1 (the summary then says "within noise")."""
    if "efficiency" not in runs or "efficiency_low" not in runs:
        return []
    high = runs[runs["efficiency"] > 1.05]
    within = [
        efficiency_verdict(None if pd.isna(low) else low, None if pd.isna(up) else up) == WITHIN_NOISE
        for low, up in zip(high["efficiency_low"], high.get("efficiency_high", pd.Series(float("nan"), high.index)))
    ]  # the summary's own rule (metrics.efficiency_verdict)
    bare = high[[not w for w in within]]
    return [
        Verdict(
            f"efficiency above 1.05 in {len(high)} row(s), every one 'within noise'"
            if bare.empty
            else f"{len(bare)} row(s) with efficiency above 1.05 whose interval does not hold 1",
            bare.empty,
        )
    ]


def suite_phase(suite: Suite) -> Phase:
    def cells(args: argparse.Namespace, rows: pd.DataFrame | None) -> list[Cell]:
        """The suite's commands once per round (none unless --suites names it), the rounds interleaved."""
        if suite.name not in args.suites:
            return []
        common = ("--device", "cpu", *suite.server_flags, "--stability_pct", f"{args.stability_pct:g}")
        one_round = [
            Cell(Experiment(f"{suite.name}.{name}", (*common, *flags)), suite.batch_size, False, 0)
            for name, flags in suite.designs.items()
        ]
        return interleaved(one_round, args.repeats, args.seed)

    return cells


def report(args: argparse.Namespace, rows: pd.DataFrame, out: Path) -> list[str]:
    """stability.md: each suite measured so far, its table and the noise beside it, then every target."""
    lines = [f"# Stability: the same commands, {args.repeats} invocations each, interleaved", ""]
    verdicts: list[Verdict] = []
    for suite in SUITES:
        mine = part_rows(rows, suite.name, "throughput", "p99_latency_s")
        if mine.empty:
            continue
        table, found = evaluate(mine, suite)
        given = f" then `{shlex.join(args.server_flags)}`" if args.server_flags else ""
        lines += [
            f"## {suite.name}: `{shlex.join(suite.server_flags)} --stability_pct {args.stability_pct:g}`{given}",
            "",
        ]
        lines += [*table, ""]
        verdicts += found
    return [*lines, "## Targets", "", *(v.line() for v in verdicts)]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--stability_pct",
        type=bounded(float, 0.01, 100.0),
        default=5.0,
        help="every run's --stability_pct, 0.01 to 100 (default 5)",
    )
    parser.add_argument("--suites", nargs="+", default=[s.name for s in SUITES], choices=[s.name for s in SUITES])


PHASES = tuple(suite_phase(suite) for suite in SUITES)
STUDY = Study(
    "stability",
    __doc__,
    PHASES,
    report,
    add_arguments,
    repeats=5,
    given_last=True,
    checked_cells=lambda args, rows: [cell for phase in PHASES for cell in phase(args, rows)],
)


main = STUDY.main


if __name__ == "__main__":
    sys.exit(main())
