"""The designs real servers use, measured: the server's own cost per request, dynamic batching against none at a
latency target, model instances in processes against threads, and the latency-throughput curve of them all.

    python -m bench.serving --out results/serving

Four parts (`--parts`), each a set of server.py runs (or a sweep) whose rows stay under <out>:

- overhead: the identity model, one 16x16 image per request, shm, burst, 2000 requests: requests per second of
  serial, threaded and pipelined (2 workers), interleaved repeats; targets serial >= 8,000 and pipelined >= 5,000;
- batching: resnet18 at 64x64, one image per request, `--find_peak --slo_ms 100` (Poisson arrivals, bisection):
  the peak rate without batching and with `--max_batch_size 16 --max_queue_delay_ms 5`, for serial and
  pipelined, interleaved repeats, the model on every core (shared among the forwards a design runs at once), and
  the model's own forward time at each formed size; target: serial at least 3x;
- instances: resnet18 at 64x64, 8 images per request, burst: `--instances 2` (serial inside) against `pipelined
  --num_workers 2`, interleaved repeats;
- curve: a sweep over offered rates of those designs (`sweep.py --rates`), the model on every core as in
  batching, whose report draws p50 and p99 against achieved throughput with the SLO, and names each design's
  highest rate within it.

Writes `<out>/<part>.md` for each part run, with the command, and `<out>/serving.md` (printed) with every part
measured so far in that folder. A part measured again replaces its rows (`--report_only` rewrites its report from
them). Run nothing else on the machine meanwhile: two processes share its
cores with whatever else runs.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from bench.launch import interruptible, run_server, run_sweep
from serverbench.config.design_kinds import DEFAULT_DESIGN, design_kind
from serverbench.config.flags import OneLineErrorParser, bounded
from serverbench.config.limits import MAX_RATE_RPS, MAX_REPEATS
from serverbench.config.paths import parse_bench_args
from serverbench.launch.instances import usable_cpus
from serverbench.records.markdown import table_head
from serverbench.schema.stats import cv_pct
from sweep import RUNS_CSV

ROOT = Path(__file__).resolve().parent.parent

PARTS = ("overhead", "batching", "instances", "curve")
OVERHEAD_FLAGS = (
    "--device",
    "cpu",
    "--model",
    "identity",
    "--image_size",
    "16",
    "--batch_size",
    "1",
    "--num_iters",
    "2000",
    "--transport",
    "shm",
    "--load",
    "burst",
    "--no-ceiling",
)
OVERHEAD_DESIGNS = {
    "serial": ("--design", "serial"),
    "threaded": ("--design", "threaded"),
    "pipelined_2w": ("--design", "pipelined", "--num_workers", "2"),
}
OVERHEAD_TARGETS_RPS = {"serial": 8000.0, "pipelined_2w": 5000.0}
RESNET_FLAGS = ("--device", "cpu", "--model", "resnet18", "--image_size", "64")
BATCHING = ("--max_batch_size", "16", "--max_queue_delay_ms", "5")
SLO_MS = 100.0
PEAK_DESIGNS = {"serial": ("--design", "serial"), "pipelined_2w": ("--design", "pipelined", "--num_workers", "2")}
BATCHING_TARGET = "serial"  # the design the 3x target is checked on (the others are shown)
PEAK_ITERS = 400  # requests per search step: the p99 is then the fourth-worst, not the second-worst of 200
FORWARD_SIZES = (1, 2, 4, 8, 16)
INSTANCE_DESIGNS = {
    "instances_2": ("--design", "serial", "--instances", "2"),
    "pipelined_2w": ("--design", "pipelined", "--num_workers", "2"),
}
CURVE_EXPERIMENTS = {
    "serial": ("--design", "serial"),
    "pipelined_2w": ("--design", "pipelined", "--num_workers", "2"),
    "serial_batched": ("--design", "serial", *BATCHING),
    "pipelined_2w_batched": ("--design", "pipelined", "--num_workers", "2", *BATCHING),
    "instances_2": ("--design", "serial", "--instances", "2"),
}


@dataclass(frozen=True)
class Verdict:
    text: str
    met: bool | None  # None: measured and shown, no target


def interleaved(
    designs: dict[str, tuple[str, ...]], common: Sequence[str], out: Path, repeats: int, run: bool
) -> pd.DataFrame:
    """Each repeat round runs every design once, so a drift of the machine spreads over all of them. A measurement
    replaces the folder's rows: server.py appends, and the tables are of one measurement."""
    if run:
        (out / "runs.csv").unlink(missing_ok=True)
    for repeat in range(repeats if run else 0):
        for name, flags in designs.items():
            run_server([*common, *flags, "--experiment", name, "--repeat", str(repeat)], out, "runs.csv", echo=True)
    return pd.read_csv(out / "runs.csv")


def spread_table(runs: pd.DataFrame, column: str, unit: str, scale: float = 1.0) -> list[str]:
    lines = [
        *table_head(["experiment", f"each repeat ({unit})", "mean", "CV", "p99 latency (ms), mean", "failed"]),
    ]
    for name, group in runs.groupby("experiment", sort=False):
        ok = group[group["status"] == "ok"]
        values = [v * scale for v in ok[column].dropna()]
        cv = cv_pct(values)
        lines.append(
            f"| {name} | {', '.join(f'{v:,.0f}' for v in values)} | "
            f"{(sum(values) / len(values)) if values else float('nan'):,.0f} | "
            f"{'n/a' if cv is None else f'{cv:.1f} %'} | {ok['p99_latency_s'].mean() * 1e3:.1f} | "
            f"{len(group) - len(ok)} |"
        )
    return lines


def mean_ok(runs: pd.DataFrame, name: str, column: str) -> float | None:
    ok = runs[(runs["experiment"] == name) & (runs["status"] == "ok")][column].dropna()
    return float(ok.mean()) if len(ok) else None


def part_overhead(out: Path, repeats: int, run: bool) -> tuple[list[str], list[Verdict]]:
    runs = interleaved(OVERHEAD_DESIGNS, OVERHEAD_FLAGS, out / "overhead", repeats, run)
    lines = [
        f"## The server's own cost: `{shlex.join(OVERHEAD_FLAGS)}`",
        "",
        *spread_table(runs, "achieved_rate_rps", "requests/s"),
        "",
    ]
    verdicts = []
    for name, target in OVERHEAD_TARGETS_RPS.items():
        got = mean_ok(runs, name, "achieved_rate_rps")
        verdicts.append(
            Verdict(
                f"overhead {name}: {'n/a' if got is None else f'{got:,.0f}'} requests/s (target >= {target:,.0f})",
                got is not None and got >= target,
            )
        )
    return lines, verdicts


def forwards_at_once(flags: Sequence[str]) -> int:
    """The forwards an experiment's server flags run together: pipelined's prediction workers, times instances."""
    given = dict(zip(flags, flags[1:]))
    design = design_kind(given.get("--design", DEFAULT_DESIGN.name))
    workers = design.forwards_at_once(int(given.get("--num_workers", design.default_workers)))
    return workers * int(given.get("--instances", 1))


def model_threads(flags: Sequence[str]) -> int:
    """Intra-op threads for the batching and curve parts: every core this process may use, shared among the
    forwards an experiment with these server flags runs at once: the server's own default since 2026-11-24
    (docs/methodology.md) where every listed CPU is a physical core (the default caps at torch's own count, the
    physical cores; this does not), given explicitly so that these parts measure the same thing at older commits,
    whose default left one core to the host's threads and hid what a formed batch's forward gains from them."""
    return max(1, len(usable_cpus()) // forwards_at_once(flags))


def time_forwards(threads: Sequence[int], sizes: Sequence[int], path: Path, loops: int = 15) -> None:
    """The model alone at each formed-batch size and thread count (median and best of `loops` forwards, after 3
    untimed): what the peak search's designs have to work with, written to `path`."""
    import torch

    from serverbench.backend.models import build_model

    model = build_model("resnet18", torch.device("cpu"), seed=0, checkpoint=None).module
    inputs = torch.randn(max(sizes), 3, 64, 64)
    rows = []
    with torch.inference_mode():
        for count in threads:
            torch.set_num_threads(count)
            for size in sizes:
                batch = inputs[:size].contiguous()
                for _ in range(3):
                    model(batch)
                times_ms = []
                for _ in range(loops):
                    start_ns = time.perf_counter_ns()
                    model(batch)
                    times_ms.append((time.perf_counter_ns() - start_ns) / 1e6)
                rows.append(
                    {"threads": count, "batch": size, "median_ms": statistics.median(times_ms), "min_ms": min(times_ms)}
                )
    pd.DataFrame(rows).to_csv(path, index=False)


def forward_table(path: Path) -> list[str]:
    times = pd.read_csv(path)
    counts = sorted(times["threads"].unique())
    lines = [
        "The model alone (`time_forwards`: median of 15 forwards, in the bench's own process), ms per forward "
        "and per image:",
        "",
        *table_head(["images", *(f"{c} thread{'s' if c > 1 else ''}" for c in counts)]),
    ]
    for size, group in times.groupby("batch"):
        cells = []
        for count in counts:
            ms = group[group["threads"] == count]["median_ms"]
            cells.append(f"{ms.iloc[0]:.1f} ({ms.iloc[0] / size:.1f})" if len(ms) else "n/a")
        lines.append(f"| {size} | " + " | ".join(cells) + " |")
    return lines + [""]


def ran_with_threads(peaks: pd.DataFrame, name: str) -> int:
    """The intra-op threads an experiment's searches ran with, as its rows say; this machine's rule for rows that
    predate the column."""
    recorded = (
        peaks.loc[peaks["experiment"] == name, "intra_op_threads"].dropna()
        if "intra_op_threads" in peaks
        else pd.Series(dtype=float)
    )
    return int(recorded.iloc[0]) if len(recorded) else model_threads(PEAK_DESIGNS[name])


def batching_verdicts(peaks: pd.DataFrame, medians: dict[str, float]) -> list[Verdict]:
    """Each design's median peak with batching over without it, and every repeat's; the target design's verdict."""
    verdicts = []
    # One search per experiment and repeat (pivot refuses duplicates rather than averaging them).
    by_repeat = peaks.pivot(index="repeat", columns="experiment", values="peak_rate_rps").fillna(0.0)
    for name in PEAK_DESIGNS:
        alone, batched = medians.get(name), medians.get(f"{name}_batched")
        ratio = batched / alone if alone and batched is not None else None
        each = [
            row[f"{name}_batched"] / row[name]
            for _, row in by_repeat.iterrows()
            if name in row and f"{name}_batched" in row and row[name] > 0
        ]
        shown = " vs ".join("n/a" if peak is None else f"{peak:.1f}" for peak in (batched, alone))
        text = (
            f"batching {name}: median peak {shown} req/s, {'n/a' if ratio is None else f'{ratio:.2f}x'} "
            f"(each repeat: {', '.join(f'{r:.2f}x' for r in each) or 'n/a'})"
        )
        if name == BATCHING_TARGET:
            verdicts.append(Verdict(f"{text} (target >= 3x)", ratio is not None and bool(ratio >= 3)))
        else:
            verdicts.append(Verdict(text, None))
    return verdicts


def part_batching(out: Path, repeats: int, run: bool) -> tuple[list[str], list[Verdict]]:
    folder = out / "batching"
    common = [
        *RESNET_FLAGS,
        "--batch_size",
        "1",
        "--find_peak",
        "--slo_ms",
        f"{SLO_MS:g}",
        "--num_iters",
        str(PEAK_ITERS),
    ]
    searches_failed = 0
    if run:
        folder.mkdir(parents=True, exist_ok=True)
        for old in ("peak.csv", "runs.csv"):  # peak.csv is appended to: the verdict is of this measurement only
            (folder / old).unlink(missing_ok=True)
        time_forwards(
            sorted({model_threads(flags) for flags in PEAK_DESIGNS.values()}), FORWARD_SIZES, folder / "forward_ms.csv"
        )
    for repeat in range(repeats if run else 0):
        for name, flags in PEAK_DESIGNS.items():
            for batched in (False, True):
                label = f"{name}_batched" if batched else name
                ran = run_server(
                    [
                        *common,
                        *flags,
                        "--intra_op_threads",
                        str(model_threads(flags)),
                        *(BATCHING if batched else ()),
                        "--experiment",
                        label,
                        "--repeat",
                        str(repeat),
                    ],
                    folder,
                    "runs.csv",
                    echo=True,
                )
                searches_failed += ran.returncode != 0
    if not (folder / "peak.csv").exists():
        return [f"No peak searches in {folder}: run the part without --report_only.", ""], [
            Verdict("batching: nothing measured", False)
        ]
    peaks = pd.read_csv(folder / "peak.csv")
    if "repeat" not in peaks:
        peaks["repeat"] = 0
    threads = {name: ran_with_threads(peaks, name) for name in PEAK_DESIGNS}
    lines = [
        f"## Dynamic batching at a latency target: `{shlex.join(common)}`, with and without "
        f"`{shlex.join(BATCHING)}`, the model on every core "
        f"(`--intra_op_threads`: {', '.join(f'{n} {t}' for n, t in threads.items())})",
        "",
        *table_head(
            "| experiment | offline (burst) req/s | peak req/s with p99 <= SLO, each repeat | median | "
            "its p99s (ms) | lowest rates over |"
        ),
    ]
    medians: dict[str, float] = {}
    for name, group in peaks.groupby("experiment", sort=False):
        # A search whose every rate missed the SLO has no peak: it counts as 0, not as a repeat left out.
        medians[name] = float(group["peak_rate_rps"].fillna(0.0).median())
        lines.append(
            f"| {name} | {', '.join(f'{v:.1f}' for v in group['offline_rate_rps'])} | "
            f"{', '.join('none' if pd.isna(v) else f'{v:.1f}' for v in group['peak_rate_rps'])} | "
            f"{medians[name]:.1f} | "
            f"{', '.join('n/a' if pd.isna(v) else f'{v * 1e3:.1f}' for v in group['peak_p99_latency_s'])} | "
            f"{', '.join('n/a' if pd.isna(v) else f'{v:.1f}' for v in group['over_slo_rate_rps'])} |"
        )
    lines.append("")
    if (folder / "forward_ms.csv").exists():
        lines += forward_table(folder / "forward_ms.csv")
    verdicts = batching_verdicts(peaks, medians)
    if searches_failed:
        verdicts.append(Verdict(f"batching: {searches_failed} peak searches exited non-zero", False))
    return lines, verdicts


def part_instances(out: Path, repeats: int, run: bool) -> tuple[list[str], list[Verdict]]:
    common = [*RESNET_FLAGS, "--batch_size", "8", "--num_iters", "100"]
    runs = interleaved(INSTANCE_DESIGNS, common, out / "instances", repeats, run)
    lines = [
        f"## Instances in processes against threads: `{shlex.join(common)}`",
        "",
        *spread_table(runs, "throughput", "samples/s"),
        "",
    ]
    names = list(INSTANCE_DESIGNS)
    got = [mean_ok(runs, name, "throughput") for name in names]
    shown = ", ".join(f"{n} {'n/a' if g is None else f'{g:.1f}'}" for n, g in zip(names, got))
    return lines, [Verdict(f"instances: mean samples/s {shown}", None)]


def part_curve(out: Path, repeats: int, rates: Sequence[float], run: bool) -> tuple[list[str], list[Verdict]]:
    command = [
        sys.executable,
        str(ROOT / "sweep.py"),
        "--out",
        str(out / "curve"),
        "--plots_dir",
        str(out / "plots"),
        "--compile",
        "false",
        "--batch_sizes",
        "1",
        "--designs",
        "--repeats",
        str(repeats),
        "--rates",
        *(f"{r:g}" for r in rates),
    ]
    for name, flags in CURVE_EXPERIMENTS.items():
        threads = ("--intra_op_threads", str(model_threads(flags)))
        command += ["--experiment", f"{name}={shlex.join([*flags, *threads])}"]
    command += ["--", *RESNET_FLAGS, "--num_iters", "200", "--slo_ms", f"{SLO_MS:g}"]
    if run:
        shutil.rmtree(out / "curve", ignore_errors=True)  # measured again: every cell runs, none is resumed
        print(f"$ {shlex.join(command)}", flush=True)
    # --report_only: the sweep resumes, finds every cell done and writes its report again.
    code = run_sweep(command)
    summary = out / "curve" / "summary.md"
    lines = [
        f"## The latency-throughput curve: `{shlex.join(command[1:])}`",
        "",
        f"Sweep exit status {code}; its report: `{summary.relative_to(out)}`, plots in `plots/`.",
        "",
    ]
    if summary.exists():
        text = summary.read_text()
        start = text.find("## Highest rate within the SLO")
        if start >= 0:
            end = text.find("\n## ", start + 3)
            lines += [text[start + 1 : end if end >= 0 else None].strip(), ""]
    rows = pd.read_csv(out / "curve" / RUNS_CSV) if (out / "curve" / RUNS_CSV).exists() else pd.DataFrame()
    failed = int((rows["status"] != "ok").sum()) if len(rows) else 0
    return lines, [Verdict(f"curve: {len(rows)} runs, {failed} failed", failed == 0 and code == 0)]


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog="python -m bench.serving", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "serving")
    parser.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    parser.add_argument(
        "--repeats",
        type=bounded(int, 1, MAX_REPEATS),
        default=3,
        help=f"interleaved runs of each design, 1 to {MAX_REPEATS} (default 3)",
    )
    parser.add_argument(
        "--rates",
        type=bounded(float, 1e-3, MAX_RATE_RPS),
        nargs="+",
        default=[25, 50, 100, 200, 400],
        help=f"offered rates of the curve, requests/s, 0.001 to {MAX_RATE_RPS:g} (default 25 50 100 200 400)",
    )
    parser.add_argument(
        "--curve_repeats",
        type=bounded(int, 1, MAX_REPEATS),
        default=1,
        help=f"runs of each curve point, 1 to {MAX_REPEATS} (default 1)",
    )
    parser.add_argument("--report_only", action="store_true", help="write the parts' reports from the rows in --out")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parse_bench_args(parser, argv, "bench.serving")  # --out checked before any run
    return interruptible(parser.prog, lambda: measure_and_report(args, argv), f"; the rows so far are in {args.out}")


def measure_and_report(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    args.out.mkdir(parents=True, exist_ok=True)
    report = [
        "# Serving designs on this machine",
        "",
        f"`python -m bench.serving {shlex.join(sys.argv[1:] if argv is None else list(argv))}`",
        "",
    ]
    marks = {True: "met", False: "NOT met", None: "shown"}
    failed = False
    for part in args.parts:
        if part == "overhead":
            lines, found = part_overhead(args.out, args.repeats, not args.report_only)
        elif part == "batching":
            lines, found = part_batching(args.out, args.repeats, not args.report_only)
        elif part == "instances":
            lines, found = part_instances(args.out, args.repeats, not args.report_only)
        else:
            lines, found = part_curve(args.out, args.curve_repeats, args.rates, not args.report_only)
        failed |= any(v.met is not None and not v.met for v in found)  # met may be a numpy bool
        # Each part's own file, with the command that measured it: a part run again replaces only its own, and
        # --report_only keeps the measuring command.
        path = args.out / f"{part}.md"
        header = path.read_text().splitlines()[:2] if args.report_only and path.exists() else report[2:4]
        path.write_text(
            "\n".join([*header, *lines, "Targets:", "", *(f"- {marks[v.met]}: {v.text}" for v in found), ""])
        )
    summary = ["# Serving designs on this machine", ""]
    for part in PARTS:  # every part measured so far, in order
        if (args.out / f"{part}.md").exists():
            summary += [(args.out / f"{part}.md").read_text()]
    (args.out / "serving.md").write_text("\n".join(summary))
    print("\n".join(summary))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
