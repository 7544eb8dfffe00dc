"""A model that is not an image classifier, under the server designs and the three compile paths, side by side.

    python -m bench.your_model --out results/your_model

The example's tiny transformer encoder (examples/tiny_encoder.py: token ids and a mask in, a dict of two tensors
out), built by its factory, served serial and pipelined (2 prediction threads), each eager, torch.compile'd
(--compile) and through AOTInductor (--aoti, one runner per prediction thread), under a burst (how fast) and a
Poisson load at --rate_fraction of the slowest configuration's burst throughput (what latency at one traffic).
Repeats are interleaved: each round runs every configuration once, so a drift of the machine spreads over all.

Writes <out>/runs.csv (the rows), <out>/your_model.md (the table, printed) and <out>/your_model.png (burst
throughput and Poisson p99 per configuration). Run nothing else on the machine meanwhile.
"""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

import pandas as pd

from bench.study import Study, repeat_cells, with_columns
from serverbench.config.flags import bounded
from serverbench.config.loads import BURST, POISSON
from serverbench.launch.study import Cell, Experiment, LoadPoint, interleaved
from serverbench.records.markdown import figure, table_head, table_row
from serverbench.records.plots import pyplot, save_figure

MODEL_FLAGS = (
    "--device",
    "cpu",
    "--model",
    "examples.tiny_encoder:make_model",
    "--model_kwargs",
    '{"depth": 2}',
    "--input",
    "ids:int64:64:0-999",
    "--input",
    "mask:int64:64:1-1",
    "--no-ceiling",
)
DESIGNS = {"serial": ("--design", "serial"), "pipelined_2w": ("--design", "pipelined", "--num_workers", "2")}
PATHS = {"eager": (False, ()), "inductor": (True, ()), "aoti": (False, ("--aoti",))}
MAX_COUNT = 100_000  # sequences per request, requests per run


def configurations() -> dict[str, tuple[bool, tuple[str, ...]]]:
    """Each configuration's name, whether --compile (the study runner's compile axis) and its other flags."""
    return {
        f"{design}_{path}": (compiled, (*d_flags, *p_flags))
        for design, d_flags in DESIGNS.items()
        for path, (compiled, p_flags) in PATHS.items()
    }


def _cells(args: argparse.Namespace, load: tuple[str, ...], point: LoadPoint | None) -> list[Cell]:
    round_cells = [
        Cell(Experiment(name, (*flags, *load, "--num_iters", str(args.num_iters))), args.batch_size, compiled, 0, point)
        for name, (compiled, flags) in configurations().items()
    ]
    return interleaved(round_cells, args.repeats, args.seed)


def burst_phase(args: argparse.Namespace, rows: pd.DataFrame | None) -> list[Cell]:
    """How fast: every configuration under a burst."""
    return _cells(args, ("--load", BURST.name), None)


def poisson_phase(args: argparse.Namespace, rows: pd.DataFrame | None) -> list[Cell]:
    """What latency at one traffic: a Poisson load at --rate_fraction of the slowest configuration's burst
    throughput (so that every configuration can carry it). Once a Poisson run has a row, its rate is the phase's:
    a resume whose burst rows changed meanwhile (--retry_failed) would otherwise pick another rate, run the phase
    again and pool two rates in one table."""
    rows = with_columns(rows if rows is not None else pd.DataFrame({"status": []}), *FIGURES)  # failures' rows too
    begun = rows[rows["load"] == POISSON.name]["offered_rate_rps"].dropna()
    if len(begun):
        return _cells(args, (), LoadPoint(POISSON.name, float(begun.iloc[0])))
    ok = rows[(rows["status"] == "ok") & (rows["load"] == BURST.name)]
    if ok.empty:  # no rate to offer (before any run: none yet): the report says what failed, and exit 1
        if len(rows):
            print("bench.your_model: no burst run succeeded, so no Poisson run: see the rows' error column", flush=True)
        return []
    rate = round(args.rate_fraction * float(ok.groupby("experiment")["achieved_rate_rps"].mean().min()), 1)
    return _cells(args, (), LoadPoint(POISSON.name, rate))


# What the report reads of a row: a runner's row for a run that wrote none (a timeout, a crash) has none of them
FIGURES = ("load", "offered_rate_rps", "achieved_rate_rps", "p50_latency_s", "p99_latency_s", "aoti_runners")
FIGURES += ("compile_path", "intra_op_threads", "m_compile_time")


def table(runs: pd.DataFrame) -> list[str]:
    lines = table_head(
        "| configuration | compile path | runners | intra-op threads | burst requests/s, each repeat | "
        "mean | CV | Poisson rate | p50 ms | p99 ms | compile s | failed |"
    )
    for name in configurations():
        group = runs[runs["experiment"] == name]
        ok = group[group["status"] == "ok"]
        burst = ok[ok["load"] == BURST.name]["achieved_rate_rps"].dropna().tolist()
        poisson = ok[ok["load"] == POISSON.name]
        runners = ok["aoti_runners"].dropna()
        how = [name, ok["compile_path"].iloc[0] if len(ok) else "?", int(runners.iloc[0]) if len(runners) else ""]
        bursts = repeat_cells(burst, ",.0f")
        means = [figure(poisson["offered_rate_rps"].mean(), "g"), figure(poisson["p50_latency_s"].mean(), ".2f", 1e3)]
        means.append(figure(poisson["p99_latency_s"].mean(), ".2f", 1e3))
        means.append(figure(ok["m_compile_time"].mean(), missing=""))  # the compile's mean; eager: nothing
        lines.append(table_row([*how, _threads(ok), *bursts, *means, len(group) - len(ok)]))
    return lines


def _threads(rows: pd.DataFrame) -> str:
    return ", ".join(str(int(t)) for t in sorted(rows["intra_op_threads"].dropna().unique()))


def pipelining_gain(runs: pd.DataFrame) -> list[str]:
    """What two prediction threads give over one, per compile path, from the burst rows: the GIL's share."""
    ok = runs[(runs["status"] == "ok") & (runs["load"] == BURST.name)]
    lines = []
    for path in PATHS:
        serial = ok[ok["experiment"] == f"serial_{path}"]["achieved_rate_rps"].mean()
        pipelined = ok[ok["experiment"] == f"pipelined_2w_{path}"]["achieved_rate_rps"].mean()
        lines.append(f"- {path}: pipelined_2w / serial = {figure(pipelined / serial, '.2f')}")
    return lines


def plot(runs: pd.DataFrame, path: Path) -> None:
    ok = runs[runs["status"] == "ok"]
    names = list(configurations())
    burst = [ok[(ok["experiment"] == n) & (ok["load"] == BURST.name)]["achieved_rate_rps"].mean() for n in names]
    p99 = [ok[(ok["experiment"] == n) & (ok["load"] == POISSON.name)]["p99_latency_s"].mean() * 1e3 for n in names]
    figure, (left, right) = pyplot().subplots(1, 2, figsize=(11, 4))
    left.barh(names, burst)
    left.set_xlabel("burst throughput (requests/s)")
    right.barh(names, p99)
    right.set_xlabel("Poisson p99 latency (ms)")
    figure.suptitle("tiny encoder (ids + mask -> dict), 2-core CPU")
    save_figure(figure, path)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--batch_size", type=bounded(int, 1, MAX_COUNT), default=4, help="sequences per request (default 4)"
    )
    parser.add_argument("--num_iters", type=bounded(int, 1, MAX_COUNT), default=300, help="requests per run (300)")
    parser.add_argument(
        "--rate_fraction",
        type=bounded(float, 0.01, 0.99),
        default=0.5,
        help="the Poisson rate, as a fraction of the slowest configuration's burst throughput (default 0.5)",
    )


def report(args: argparse.Namespace, runs: pd.DataFrame, out: Path) -> list[str]:
    runs = with_columns(runs, *FIGURES)
    plot(runs, out / "your_model.png")
    return [
        "# The example model under the designs and compile paths",
        "",
        f"Common flags `{shlex.join(MODEL_FLAGS)}`, batch {args.batch_size}, {args.num_iters} requests per run.",
        "",
        *table(runs),
        "",
        "Two prediction threads over one (burst):",
        *pipelining_gain(runs),
    ]


STUDY = Study(
    "your_model",
    __doc__,
    (burst_phase, poisson_phase),
    report,
    add_arguments,
    load_axis=POISSON.name,
    server_flags=MODEL_FLAGS,
)


main = STUDY.main


if __name__ == "__main__":
    raise SystemExit(main())
