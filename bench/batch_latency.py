"""Batch size against tail latency at a few offered rates: how large a request can your model take before its p99
leaves your SLO, at the traffic you expect.

    python -m bench.batch_latency --batch_sizes 1 8 32 --rates 5 10 20 -- --model resnet18 --image_size 64

Every (batch size, rate) is a Poisson run of server.py (--load poisson --rate R: R requests/s of that many
samples each), repeated in interleaved rounds. Writes <out>/runs.csv, <out>/batch_latency.md (p50, p99 and the
samples/s achieved per cell; the largest batch within --slo_ms per rate) and <out>/batch_latency.png (p99 against
batch size, a line per rate).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from bench.study import Study
from serverbench.config.flags import bounded
from serverbench.config.limits import MAX_BATCH_IMAGES, MAX_RATE_RPS
from serverbench.config.loads import POISSON
from serverbench.launch.study import Cell, Experiment, interleaved, load_points
from serverbench.records.markdown import table_head, table_row
from serverbench.records.plots import pyplot, save_figure


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--batch_sizes",
        type=bounded(int, 1, MAX_BATCH_IMAGES),
        nargs="+",
        default=[1, 8, 32],
        help="samples per request (default 1 8 32)",
    )
    parser.add_argument(
        "--rates",
        type=bounded(float, 0.01, MAX_RATE_RPS),
        nargs="+",
        default=[5.0, 10.0, 20.0],
        help="offered requests/s (default 5 10 20)",
    )
    parser.add_argument("--compile", action="store_true", help="torch.compile the model in every run")
    parser.add_argument("--slo_ms", type=bounded(float, 0.001, 3.6e6), default=100.0, help="p99 target (default 100)")


def cells(args: argparse.Namespace, rows: pd.DataFrame | None) -> list[Cell]:
    everything = Experiment("batch_latency", ())
    points = load_points(args.rates, [])  # each rate as the row will hold it (30.000000000000004 is 30)
    sizes = sorted(set(args.batch_sizes))
    round_cells = [Cell(everything, size, args.compile, 0, point) for size in sizes for point in points]
    return interleaved(round_cells, args.repeats, args.seed)


def report(args: argparse.Namespace, rows: pd.DataFrame, out: Path) -> list[str]:
    ok = rows[rows["status"] == "ok"]
    cell = ok.groupby(["offered_rate_rps", "batch_size"])
    figures = cell[["p50_latency_s", "p99_latency_s", "throughput"]].mean().mul([1e3, 1e3, 1]).reset_index()
    figures["runs"] = cell.size().to_numpy()
    lines = [
        "# Batch size against tail latency",
        "",
        *table_head("| rate (req/s) | batch size | ok runs | p50 ms | p99 ms | samples/s | within SLO |"),
    ]
    for _, row in figures.iterrows():
        within = "yes" if row["p99_latency_s"] <= args.slo_ms else "no"
        measured = [f"{row['p50_latency_s']:.2f}", f"{row['p99_latency_s']:.2f}", f"{row['throughput']:.1f}"]
        lines.append(
            table_row([f"{row['offered_rate_rps']:g}", int(row["batch_size"]), int(row["runs"]), *measured, within])
        )
    lines += ["", f"The largest batch whose mean p99 is within {args.slo_ms:g} ms:"]
    for rate, group in figures.groupby("offered_rate_rps"):
        within = group[group["p99_latency_s"] <= args.slo_ms]
        best = f"batch {int(within['batch_size'].max())}" if len(within) else "none of those measured"
        lines.append(f"- {rate:g} req/s: {best}")
    if failed := len(rows) - len(ok):
        lines += ["", f"{failed} run(s) failed: see the rows' status and error columns."]
    plot(figures, args.slo_ms, out / "batch_latency.png")
    return lines


def plot(figures: pd.DataFrame, slo_ms: float, path: Path) -> None:
    figure, axes = pyplot().subplots(figsize=(6, 4))
    for rate, group in figures.groupby("offered_rate_rps"):
        axes.plot(group["batch_size"], group["p99_latency_s"], marker="o", label=f"{rate:g} req/s")
    axes.axhline(slo_ms, color="grey", linestyle="--", label=f"SLO {slo_ms:g} ms")
    axes.set(xscale="log", xlabel="batch size (samples per request)", ylabel="p99 latency (ms)")
    axes.legend()
    save_figure(figure, path)


# --slo_ms: the report's alone, so a resume or a --report_only may change it
STUDY = Study(
    "batch_latency", __doc__, (cells,), report, add_arguments, repeats=2, load_axis=POISSON.name, free_flags=("slo_ms",)
)


main = STUDY.main


if __name__ == "__main__":
    raise SystemExit(main())
