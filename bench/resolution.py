"""How small a difference can the A/B verdicts tell, and how often do they call one that is not there?

    python -m bench.resolution --out results/resolution

Per model (the identity at batch 1: the server's own cost; resnet18 at batch 32, 64x64), serial, on the CPU:

1. Calibration: CALIBRATION_RUNS runs of the plain configuration give the time per batch (batch size over
   throughput, their median).
2. Planted differences: configuration `a` is that plain one; `b<P>` is the same with a busy-wait after every forward
   of P % of that time per batch (`--planted_delay_us`), for P in --planted (0 1 2 5 10): each batch then takes P %
   longer, so b<P>'s throughput is 1/(1 + P/100) of a's. b0 is a itself, run again. --repeats rounds, each every
   configuration once in a shuffled order.
3. Trials: a trial is --pairs rounds drawn at random (--draws of them) and its pairs by round, as report.py
   --baseline, bench.compare and bench.commits pair their runs: per round, the baseline is a or b0 (the same
   configuration, drawn at random; at 0 % the other is B) and B is b<P>. The A/B method
   (serverbench/schema/ab.py) gives its verdict; the rates with a always the baseline are shown too. Per planted
   size: how often the verdict said "b slower" (detection) and, at 0 %, how often it called either faster (false
   positives); for each interval method the A/B module weighs, raw and with throughput divided by the machine's
   speed (the mean of machine_speed_before and _after).

Server flags after -- go to every run, after the model's own (e.g. -- --num_iters 500 for a short try).
Writes <out>/resolution.md (printed too), <out>/resolution.png and <out>/trials.csv; exit 1 when a run failed.
Run nothing else on the machine meanwhile: the rates are this machine's, at its quietest.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from bench.resolution_report import PLANTED_DEFAULT, REPEATS_SHOWN, write_report
from bench.study import Study, part_rows
from serverbench.config.flags import bounded
from serverbench.config.limits import AB_DEFAULT_REPEATS, MAX_REPEATS
from serverbench.launch.study import Cell, Experiment, interleaved

CALIBRATION_RUNS = 3
CALIBRATION = "calibration"
COMMON_FLAGS = ("--device", "cpu", "--design", "serial", "--no-ceiling")


@dataclass(frozen=True)
class ModelSetup:
    name: str
    batch_size: int
    flags: tuple[str, ...]  # every run's, besides COMMON_FLAGS and --batch_size


MODELS = (
    ModelSetup("identity", 1, ("--model", "identity", "--image_size", "64", "--num_iters", "20000")),
    ModelSetup("resnet18", 32, ("--model", "resnet18", "--image_size", "64", "--num_iters", "40")),
)


def experiment_name(planted_pct: float) -> str:
    return f"b{planted_pct:g}"


def planted_experiments(time_per_batch_s: float, planted_pct: Sequence[float]) -> dict[str, float]:
    """Each configuration's busy-wait per forward in us: a (none) and b<P> (P % of the time per batch)."""
    delays = {"a": 0.0}
    for pct in planted_pct:
        delays[experiment_name(pct)] = round(time_per_batch_s * pct / 100 * 1e6, 3)
    return delays


def chosen(args: argparse.Namespace) -> list[ModelSetup]:
    return [model for model in MODELS if model.name in args.models]


def calibration_cells(args: argparse.Namespace, rows: pd.DataFrame | None) -> list[Cell]:
    """Phase 1: CALIBRATION_RUNS runs of each model's plain configuration."""
    return [
        Cell(Experiment(f"{m.name}.{CALIBRATION}", (*COMMON_FLAGS, *m.flags)), m.batch_size, False, run)
        for m in chosen(args)
        for run in range(CALIBRATION_RUNS)
    ]


def time_per_batch_s(rows: pd.DataFrame | None, model: ModelSetup) -> float | None:
    """The plain configuration's time per batch (batch size over throughput, the median of the calibration runs);
    None until every calibration run is ok."""
    if rows is None:
        return None
    mine = rows[(rows["experiment"] == f"{model.name}.{CALIBRATION}") & (rows["status"] == "ok")]
    if len(mine) < CALIBRATION_RUNS or "throughput" not in mine:
        return None
    return statistics.median(model.batch_size / float(t) for t in mine["throughput"])


def planted_cells(args: argparse.Namespace, rows: pd.DataFrame | None, placeholder_s: float | None = None) -> list:
    """Phase 2: a and every b<P> once per round, the rounds interleaved; none for a model whose calibration did not
    complete. `placeholder_s`: a time per batch for the checks before any run."""
    cells: list[Cell] = []
    for model in chosen(args):
        found = placeholder_s or time_per_batch_s(rows, model)
        if found is None:
            continue
        one_round = [
            Cell(Experiment(f"{model.name}.{name}", (*COMMON_FLAGS, *model.flags, "--planted_delay_us", f"{delay:g}")),
                 model.batch_size, False, 0)
            for name, delay in planted_experiments(found, args.planted).items()
        ]  # fmt: skip
        cells += interleaved(one_round, args.repeats, args.seed)
    return cells


def checked_cells(args: argparse.Namespace, rows: pd.DataFrame | None) -> list[Cell]:
    """Both phases' runs as the checks before any see them: the planted ones at a placeholder delay."""
    return [*calibration_cells(args, rows), *planted_cells(args, rows, placeholder_s=1e-3)]


def preflight(args: argparse.Namespace) -> str | None:
    # A trial draws pairs of rounds: one round leaves nothing to draw
    return "--repeats: the rounds must be at least 2" if args.repeats < 2 else None


def report(args: argparse.Namespace, rows: pd.DataFrame, out: Path) -> list[str]:
    """The trials over each model's planted rounds (bench/resolution_report.py), and its table, targets and plot."""
    runs_by_model = {}
    for model in chosen(args):
        mine = part_rows(rows, model.name, "throughput", "device")
        if len(planted := mine[mine["experiment"] != CALIBRATION]):
            runs_by_model[model.name] = planted
    return write_report(runs_by_model, out, args.pairs, args.draws, args.seed)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", nargs="+", default=[m.name for m in MODELS], choices=[m.name for m in MODELS])
    parser.add_argument(
        "--pairs",
        type=bounded(int, 2, MAX_REPEATS),
        default=AB_DEFAULT_REPEATS,
        help=f"pairs in one trial: the A/B commands' default repeats (default {AB_DEFAULT_REPEATS}); the table "
        f"also shows {', '.join(map(str, REPEATS_SHOWN))}",
    )
    parser.add_argument(
        "--planted",
        type=bounded(float, 0, 1000),
        nargs="+",
        default=list(PLANTED_DEFAULT),
        help=f"planted slowdowns in %% of the time per batch (default {' '.join(f'{p:g}' for p in PLANTED_DEFAULT)})",
    )
    parser.add_argument(
        "--draws", type=bounded(int, 1, 1_000_000), default=2000, help="trials drawn per cell (default 2000)"
    )


STUDY = Study(
    "resolution",
    __doc__,
    (calibration_cells, planted_cells),
    report,
    add_arguments,
    repeats=16,
    given_last=True,
    checked_cells=checked_cells,
    preflight=preflight,
    free_flags=("pairs", "draws"),  # the report's own
)


main = STUDY.main


if __name__ == "__main__":
    sys.exit(main())
