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
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from bench.launch import interruptible, run_server
from serverbench.config.flags import OneLineErrorParser, bounded
from serverbench.config.loads import BURST, POISSON
from serverbench.config.paths import parse_bench_args
from serverbench.records.markdown import table_head
from serverbench.schema.stats import cv_pct

ROOT = Path(__file__).resolve().parent.parent
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
PATHS = {"eager": (), "inductor": ("--compile",), "aoti": ("--aoti",)}
MAX_REPEATS = 100
MAX_COUNT = 100_000  # sequences per request, requests per run


def configurations() -> dict[str, tuple[str, ...]]:
    return {
        f"{design}_{path}": (*d_flags, *p_flags)
        for design, d_flags in DESIGNS.items()
        for path, p_flags in PATHS.items()
    }


def measure(out: Path, repeats: int, batch_size: int, num_iters: int, rate_fraction: float) -> None:
    """Burst rounds first (the Poisson rate follows from them), then Poisson rounds; the rows replace <out>'s."""
    (out / "runs.csv").unlink(missing_ok=True)
    common = (*MODEL_FLAGS, "--batch_size", str(batch_size), "--num_iters", str(num_iters))
    configs = configurations()
    for repeat in range(repeats):
        for name, flags in configs.items():
            burst = [*common, *flags, "--load", "burst", "--experiment", name, "--repeat", str(repeat)]
            run_server(burst, out, "runs.csv", echo=True)
    runs = pd.read_csv(out / "runs.csv")
    burst = runs[runs["status"] == "ok"].groupby("experiment")["achieved_rate_rps"].mean()
    if burst.empty:
        raise SystemExit("no burst run succeeded: see the rows' error column")
    rate = round(rate_fraction * float(burst.min()), 1)
    for repeat in range(repeats):
        for name, flags in configs.items():
            load = ("--load", "poisson", "--rate", str(rate))
            poisson = [*common, *flags, *load, "--experiment", name, "--repeat", str(repeat)]
            run_server(poisson, out, "runs.csv", echo=True)


def table(runs: pd.DataFrame) -> list[str]:
    lines = [
        *table_head(
            "| configuration | compile path | runners | intra-op threads | burst requests/s, each repeat | "
            "mean | CV | Poisson rate | p50 ms | p99 ms | compile s | failed |"
        ),
    ]
    for name in configurations():
        group = runs[runs["experiment"] == name]
        ok = group[group["status"] == "ok"]
        burst = ok[ok["load"] == BURST.name]["achieved_rate_rps"].dropna().tolist()
        poisson = ok[ok["load"] == POISSON.name]
        cv = cv_pct(burst)
        runners = ok["aoti_runners"].dropna()
        lines.append(
            f"| {name} | {ok['compile_path'].iloc[0] if len(ok) else '?'} | "
            f"{int(runners.iloc[0]) if len(runners) else ''} | {_threads(ok)} | "
            f"{', '.join(f'{v:,.0f}' for v in burst)} | "
            f"{statistics.mean(burst) if burst else float('nan'):,.0f} | {'n/a' if cv is None else f'{cv:.1f} %'} | "
            f"{poisson['offered_rate_rps'].mean():g} | {poisson['p50_latency_s'].mean() * 1e3:.2f} | "
            f"{poisson['p99_latency_s'].mean() * 1e3:.2f} | {_seconds(ok['m_compile_time'])} | "
            f"{len(group) - len(ok)} |"
        )
    return lines


def _threads(rows: pd.DataFrame) -> str:
    return ", ".join(str(int(t)) for t in sorted(rows["intra_op_threads"].dropna().unique()))


def _seconds(values: pd.Series) -> str:
    """The mean of what was measured, or nothing (eager runs compile nothing)."""
    measured = values.dropna()
    return f"{measured.mean():.1f}" if len(measured) else ""


def pipelining_gain(runs: pd.DataFrame) -> list[str]:
    """What two prediction threads give over one, per compile path, from the burst rows: the GIL's share."""
    ok = runs[(runs["status"] == "ok") & (runs["load"] == BURST.name)]
    lines = []
    for path in PATHS:
        serial = ok[ok["experiment"] == f"serial_{path}"]["achieved_rate_rps"].mean()
        pipelined = ok[ok["experiment"] == f"pipelined_2w_{path}"]["achieved_rate_rps"].mean()
        lines.append(f"- {path}: pipelined_2w / serial = {pipelined / serial:.2f}")
    return lines


def plot(runs: pd.DataFrame, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = runs[runs["status"] == "ok"]
    names = list(configurations())
    burst = [ok[(ok["experiment"] == n) & (ok["load"] == BURST.name)]["achieved_rate_rps"].mean() for n in names]
    p99 = [ok[(ok["experiment"] == n) & (ok["load"] == POISSON.name)]["p99_latency_s"].mean() * 1e3 for n in names]
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.barh(names, burst)
    left.set_xlabel("burst throughput (requests/s)")
    right.barh(names, p99)
    right.set_xlabel("Poisson p99 latency (ms)")
    figure.suptitle("tiny encoder (ids + mask -> dict), 2-core CPU")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def build_parser() -> OneLineErrorParser:
    parser = OneLineErrorParser(
        prog="python -m bench.your_model", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "your_model")
    parser.add_argument(
        "--repeats", type=bounded(int, 1, MAX_REPEATS), default=2, help=f"interleaved rounds, 1 to {MAX_REPEATS}"
    )
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
    parser.add_argument("--report_only", action="store_true", help="rewrite the report from <out>/runs.csv")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parse_bench_args(parser, argv, "bench.your_model", "runs.csv")  # --out checked before any run
    kept = f"; the rows so far are in {args.out / 'runs.csv'}"
    return interruptible(parser.prog, lambda: measure_and_report(args, argv), kept)


def measure_and_report(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    if not args.report_only:
        args.out.mkdir(parents=True, exist_ok=True)
        measure(args.out, args.repeats, args.batch_size, args.num_iters, args.rate_fraction)
    runs = pd.read_csv(args.out / "runs.csv")
    plot(runs, args.out / "your_model.png")
    lines = [
        "# The example model under the designs and compile paths",
        "",
        f"`python -m bench.your_model {shlex.join(argv if argv is not None else sys.argv[1:])}`, common flags "
        f"`{shlex.join(MODEL_FLAGS)}`, batch {args.batch_size}, {args.num_iters} requests per run.",
        "",
        *table(runs),
        "",
        "Two prediction threads over one (burst):",
        *pipelining_gain(runs),
        "",
    ]
    (args.out / "your_model.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
