"""How small a difference can the A/B verdicts tell, and how often do they call one that is not there?

    python -m bench.resolution --out results/resolution

Per model (the identity at batch 1: the server's own cost; resnet18 at batch 32, 64x64), serial, on the CPU:

1. Calibration: CALIBRATION_RUNS runs of the plain configuration give the time per batch (batch size over
   throughput, their median).
2. Planted differences: configuration `a` is that plain one; `b<P>` is the same with a busy-wait after every forward
   of P % of that time per batch (`--planted_delay_us`), for P in --planted (0 1 2 5 10): each batch then takes P %
   longer, so b<P>'s throughput is 1/(1 + P/100) of a's. b0 is a itself, run again. sweep.py runs --rounds rounds,
   each every configuration once in a shuffled order (its rows in <out>/<model>/runs.csv; a run stopped half-way
   resumes where it was).
3. Trials: a trial is --repeats rounds drawn at random (--draws of them) and its pairs by round, as report.py
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
import json
import shlex
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from bench.launch import check_server_flags, interruptible, run_server, run_sweep
from bench.resolution_report import PLANTED_DEFAULT, REPEATS_SHOWN, write_report
from report import load_runs
from serverbench.config.flags import ConfigError, OneLineErrorParser, bounded
from serverbench.config.limits import AB_DEFAULT_REPEATS, MAX_REPEATS
from serverbench.config.paths import parse_bench_args
from sweep import RUNS_CSV, split_server_flags

ROOT = Path(__file__).resolve().parent.parent
PROG = "python -m bench.resolution"
CALIBRATION_RUNS = 3
CALIBRATION_JSON = "calibration.json"
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


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "resolution")
    parser.add_argument("--models", nargs="+", default=[m.name for m in MODELS], choices=[m.name for m in MODELS])
    parser.add_argument(
        "--rounds",
        type=bounded(int, 2, MAX_REPEATS),
        default=16,
        help="rounds of runs, each every configuration once (default 16)",
    )
    parser.add_argument(
        "--repeats",
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
    parser.add_argument("--seed", type=int, default=0, help="seed of the run order and the draws (default 0)")
    parser.add_argument("--report_only", action="store_true", help="evaluate the rows already in --out")
    return parser


def experiment_name(planted_pct: float) -> str:
    return f"b{planted_pct:g}"


def planted_experiments(time_per_batch_s: float, planted_pct: Sequence[float]) -> dict[str, float]:
    """Each configuration's busy-wait per forward in us: a (none) and b<P> (P % of the time per batch)."""
    delays = {"a": 0.0}
    for pct in planted_pct:
        delays[experiment_name(pct)] = round(time_per_batch_s * pct / 100 * 1e6, 3)
    return delays


def server_flags(model: ModelSetup, extra: Sequence[str]) -> list[str]:
    """Every run's flags but the batch size (sweep.py's axis); `extra` (after --) last, so that it wins."""
    return [*COMMON_FLAGS, *model.flags, *extra]


def calibrate(model: ModelSetup, folder: Path, extra: Sequence[str]) -> float:
    """The plain configuration's time per batch in s (median of CALIBRATION_RUNS runs), kept in calibration.json
    so that a resumed measurement plants the same delays."""
    path = folder / CALIBRATION_JSON
    if path.exists():
        return float(json.loads(path.read_text())["time_per_batch_s"])
    folder.mkdir(parents=True, exist_ok=True)
    times_s = []
    for run in range(CALIBRATION_RUNS):
        flags = [*server_flags(model, extra), "--batch_size", str(model.batch_size)]
        ran = run_server(flags, folder, "calibration.csv", capture_output=True)
        rows = pd.read_csv(ran.output_path) if ran.output_path.exists() else pd.DataFrame()
        if ran.returncode != 0 or rows.empty or rows.iloc[-1].get("status") != "ok":
            raise CalibrationError(f"{model.name}: calibration run {run} failed (exit {ran.returncode})")
        times_s.append(model.batch_size / float(rows.iloc[-1]["throughput"]))
    time_per_batch_s = statistics.median(times_s)
    path.write_text(json.dumps({"time_per_batch_s": time_per_batch_s, "runs_s": times_s}, indent=1) + "\n")
    return time_per_batch_s


class CalibrationError(RuntimeError):
    pass


def sweep_command(
    model: ModelSetup, folder: Path, delays_us: dict[str, float], args: argparse.Namespace, extra: Sequence[str]
) -> list[str]:
    experiments = [f"{name}=--planted_delay_us {delay:g}" for name, delay in delays_us.items()]
    return [
        sys.executable,
        str(ROOT / "sweep.py"),
        "--out",
        str(folder),
        "--plots_dir",
        str(folder / "plots"),
        "--designs",
        "--compile",
        "false",
        "--batch_sizes",
        str(model.batch_size),
        "--repeats",
        str(args.rounds),
        "--seed",
        str(args.seed),
        "--baseline",
        "a",
        *(item for spec in experiments for item in ("--experiment", spec)),
        "--",
        *server_flags(model, extra),
    ]


def measure(args: argparse.Namespace, extra: Sequence[str]) -> int:
    failed = 0
    for model in (m for m in MODELS if m.name in args.models):
        folder = args.out / model.name
        if args.report_only:
            continue
        time_per_batch_s = calibrate(model, folder, extra)
        delays_us = planted_experiments(time_per_batch_s, args.planted)
        command = sweep_command(model, folder, delays_us, args, extra)
        print(f"$ {shlex.join(command)}", flush=True)
        failed += run_sweep(command) != 0
    return failed


def measure_and_report(args: argparse.Namespace, argv: Sequence[str], extra: Sequence[str]) -> int:
    try:
        failed = measure(args, extra)
    except CalibrationError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    runs = {}
    for model in (m for m in MODELS if m.name in args.models):
        path = args.out / model.name / RUNS_CSV
        if path.exists():
            runs[model.name] = load_runs(path)
    command = f"{PROG} {shlex.join([*argv, *(['--', *extra] if extra else [])])}"
    lines = write_report(runs, args.out, args.repeats, args.draws, args.seed, command)
    print("\n".join(lines))
    return 1 if failed or not runs else 0


def main(argv: Sequence[str] | None = None) -> int:
    argv, extra = split_server_flags(sys.argv[1:] if argv is None else argv)  # after "--": every run's flags
    parser = build_parser()
    args = parse_bench_args(parser, argv, "bench.resolution")
    chosen = [m for m in MODELS if m.name in args.models]
    try:  # as the sweep will run them: a planted delay beside the flags after --, before any calibration
        planted = ["--planted_delay_us", "1"]
        check_server_flags([[*server_flags(m, extra), "--batch_size", str(m.batch_size), *planted] for m in chosen])
    except ConfigError as exc:
        parser.error(str(exc))
    if args.report_only and not any((args.out / m.name / RUNS_CSV).exists() for m in chosen):
        parser.error(f"--report_only: {args.out} holds no runs ({', '.join(m.name + '/' + RUNS_CSV for m in chosen)})")
    kept = f"; the rows so far are in {args.out} (the sweeps resume when run again)"
    return interruptible(PROG, lambda: measure_and_report(args, argv, extra), kept)


if __name__ == "__main__":
    sys.exit(main())
