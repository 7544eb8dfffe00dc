"""Do our latency statistics agree with MLPerf LoadGen's on the same server? Our p99 against LoadGen's p99, from the
same requests, at three Poisson (LoadGen Server scenario) rates.

    python -m bench.loadgen_agreement --out results/loadgen_agreement

One burst run of the server (by default the identity model on the CPU; flags after `--` change it, e.g. `--
--model resnet18 --image_size 32 --design serial`) measures its capacity (its achieved requests/s); then one
`--load loadgen --scenario Server` run at each of `--fractions` of it (25, 50 and 75 % by default). Every run is a
row of `<out>/runs.csv`; `<out>/agreement.md` (also printed) has, per rate, our p99, LoadGen's, their ratio and
LoadGen's verdict, and the target: a ratio within 0.95-1.05 at half the capacity. Exit status 1 when it is missed.
Take the figures on a quiet machine: other work moves both p99s, and not always by the same amount.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from bench.launch import check_server_flags, interruptible, run_server
from serverbench.config.flags import ConfigError, OneLineErrorParser, bounded
from serverbench.config.paths import parse_bench_args
from serverbench.records.markdown import table_head

ROOT = Path(__file__).resolve().parent.parent
RUNS_CSV = "runs.csv"
AGREEMENT = (0.95, 1.05)  # our p99 / LoadGen's, at the middle fraction
# The server measured: identity (the server's own cost), one image of 16x16 per request, on the CPU.
SERVER_FLAGS = ("--device", "cpu", "--model", "identity", "--image_size", "16", "--batch_size", "1")


def capacity_flags(capacity_iters: int, extra: Sequence[str]) -> list[str]:
    """The burst run's server flags."""
    return [*SERVER_FLAGS, *extra, "--num_iters", str(capacity_iters), "--experiment", "capacity"]


def loadgen_flags(rate_rps: float, fraction: float, duration_s: float, extra: Sequence[str]) -> list[str]:
    """A LoadGen Server run's server flags, at `rate_rps` (`fraction` of the capacity)."""
    return [
        *SERVER_FLAGS,
        *extra,
        "--load",
        "loadgen",
        "--scenario",
        "Server",
        "--rate",
        f"{rate_rps:.6g}",
        "--duration_s",
        f"{duration_s:g}",
        "--num_iters",
        "1",  # the duration decides
        "--experiment",
        f"loadgen_{round(fraction * 100)}pct",
    ]


def measure(
    out: Path, fractions: Sequence[float], capacity_iters: int, duration_s: float, extra: Sequence[str]
) -> None:
    """The burst run, then a LoadGen Server run at each fraction of the rate it reached. Replaces the folder's
    rows: the table is of one measurement."""
    (out / RUNS_CSV).unlink(missing_ok=True)
    capacity = run_server(capacity_flags(capacity_iters, extra), out, RUNS_CSV, echo=True).rows()
    if capacity.empty or capacity["status"].iloc[-1] != "ok":
        raise SystemExit("bench.loadgen_agreement: the burst run failed; nothing to measure against")
    capacity_rps = float(capacity["achieved_rate_rps"].iloc[-1])
    for fraction in fractions:
        run_server(loadgen_flags(capacity_rps * fraction, fraction, duration_s, extra), out, RUNS_CSV, echo=True)


def agreement_table(runs: pd.DataFrame, fractions: Sequence[float]) -> tuple[list[str], bool | None]:
    """The table from the rows, and whether the middle fraction's ratio is within AGREEMENT (None: no such row)."""
    capacity = runs[runs["experiment"] == "capacity"]
    capacity_rps = float(capacity["achieved_rate_rps"].iloc[-1]) if not capacity.empty else float("nan")
    served = "?"
    if not capacity.empty:  # what the flags after -- made of SERVER_FLAGS, as the row says
        row = capacity.iloc[-1]
        served = ", ".join(str(row[c]) for c in ("model", "design", "batch_size", "inputs") if pd.notna(row.get(c)))
    lines = [
        f"Capacity (burst; {served}): {capacity_rps:.1f} requests/s.",
        "",
        *table_head(
            "| fraction | rate (req/s) | requests | our p99 (ms) | LoadGen p99 (ms) | ours / LoadGen's | "
            "LoadGen verdict | status |"
        ),
    ]
    middle = sorted(fractions)[len(fractions) // 2]
    met: bool | None = None
    for fraction in fractions:
        rows = runs[runs["experiment"] == f"loadgen_{round(fraction * 100)}pct"]
        if rows.empty:
            lines.append(f"| {fraction:.0%} | | | | | | | not run |")
            continue
        row = rows.iloc[-1]
        ratio = row.get("loadgen_p99_ratio")
        # A failed run has no verdict (whatever an older row recorded): LoadGen judged its unanswered samples.
        verdict = {True: "VALID", False: "INVALID"}.get(row.get("loadgen_valid"), "") if row["status"] == "ok" else ""
        lines.append(
            f"| {fraction:.0%} | {capacity_rps * fraction:.1f} ({row['loadgen_scheduled_rps']:.1f} scheduled) | "
            f"{row['requests_sent']} | "
            f"{row['p99_latency_s'] * 1e3:.3f} | {row['loadgen_p99_latency_s'] * 1e3:.3f} | "
            f"{ratio:.3f} | {verdict} | {row['status']} |"
        )
        if fraction == middle:
            met = pd.notna(ratio) and AGREEMENT[0] <= float(ratio) <= AGREEMENT[1]
    lines += [
        "",
        f"Target: at {middle:.0%} of the capacity our p99 is within {AGREEMENT[0]:g}-{AGREEMENT[1]:g} x LoadGen's: "
        + {True: "met", False: "NOT met", None: "not measured"}[met],
        "",
    ]
    return lines, met


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog="python -m bench.loadgen_agreement", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "loadgen_agreement")
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
    parser.add_argument("--report_only", action="store_true", help="write the table from the rows in --out")
    parser.add_argument("server_flags", nargs="*", help="after --: more server.py flags for every run")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    # --out checked before any run: with --report_only, it must hold the rows
    args = parse_bench_args(parser, argv, "bench.loadgen_agreement", RUNS_CSV)
    try:  # the flags after -- as server.py takes them (the rate is known only after the burst run)
        check_server_flags(
            [capacity_flags(args.capacity_iters, args.server_flags)]
            + [loadgen_flags(1.0, fraction, args.duration_s, args.server_flags) for fraction in args.fractions]
        )
    except ConfigError as exc:
        parser.error(str(exc))
    kept = f"; the rows so far are in {args.out / RUNS_CSV}"
    return interruptible(parser.prog, lambda: measure_and_report(args, argv), kept)


def measure_and_report(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        measure(args.out, args.fractions, args.capacity_iters, args.duration_s, args.server_flags)
    lines, met = agreement_table(pd.read_csv(args.out / RUNS_CSV), args.fractions)
    command = shlex.join(["python", "-m", "bench.loadgen_agreement", *(sys.argv[1:] if argv is None else argv)])
    text = "\n".join(["# Our p99 against LoadGen's", "", f"`{command}`", "", *lines])
    (args.out / "agreement.md").write_text(text)
    print(text)
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
