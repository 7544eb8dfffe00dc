"""The designs real servers use, measured: the server's own cost per request, dynamic batching against none at a
latency target, model instances in processes against threads, and the latency-throughput curve of them all.

    python -m bench.serving --out results/serving
    python -m bench.serving --out /tmp/serving --parts overhead --repeats 2

Four parts (`--parts`), each a phase of the study harness (bench/study.py): its runs interleaved in rounds shuffled
by the seed, resumable, every row in <out>/runs.csv (its experiment named `<part>.<design>`):

- overhead: the identity model, one 16x16 image per request, shm, burst, 2000 requests: requests per second of
  serial, threaded and pipelined (2 workers); targets serial >= 8,000 and pipelined >= 5,000;
- batching: resnet18 at 64x64, one image per request, `--find_peak --slo_ms 100` (Poisson arrivals, bisection):
  the peak rate without batching and with `--max_batch_size 16 --max_queue_delay_ms 5`, for serial and
  pipelined, the model on every core (shared among the forwards a design runs at once); each search's result (its
  peak.csv line) is its row, its steps' rows in peak_runs.csv; and, first, the model's own forward time at each
  formed size (forward_ms.csv); target: serial at least 3x;
- instances: resnet18 at 64x64, 8 images per request, burst: `--instances 2` (serial inside) against `pipelined
  --num_workers 2`;
- curve: those designs at each offered rate (`--rates`, `--curve_repeats` rounds), the model on every core as in
  batching: each design's highest rate within the SLO, and p50 and p99 against achieved throughput
  (latency_throughput.png).

<out>/serving.md (printed) has every part measured so far in the folder, with its targets; exit status 1 when a
run failed or a target was missed. Run nothing else on the machine meanwhile.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from bench.study import Study, Verdict, part_rows, repeat_cells
from report import slo_capacity_table
from serverbench.config.design_kinds import DEFAULT_DESIGN, design_kind
from serverbench.config.flags import bounded
from serverbench.config.limits import MAX_RATE_RPS, MAX_REPEATS
from serverbench.config.loads import POISSON
from serverbench.launch.instances import usable_cpus
from serverbench.launch.study import Cell, Experiment, LoadPoint, Runner, interleaved
from serverbench.launch.study_checks import given_flags
from serverbench.records.markdown import table_head, table_row
from serverbench.records.plots import plot_latency_throughput

PARTS = ("overhead", "batching", "instances", "curve")
OVERHEAD_FLAGS = (
    *("--device", "cpu", "--model", "identity", "--image_size", "16", "--num_iters", "2000"),
    *("--transport", "shm", "--load", "burst", "--no-ceiling"),
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
FORWARDS = "batching.forwards"  # the model alone, timed in the study's own process
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
PLOT_PNG = "latency_throughput.png"
# A search's row: its peak.csv line's figures (column there)
SEARCH_COLUMNS = {
    "search": "status",  # ok, or slo_not_met: no rate tried kept the p99 within the SLO
    "offline_rps": "offline_rate_rps",
    "peak_rps": "peak_rate_rps",
    "peak_p99_s": "peak_p99_latency_s",
    "over_slo_rps": "over_slo_rate_rps",
    "intra_op_threads": "intra_op_threads",
}


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


def with_threads(flags: Sequence[str]) -> tuple[str, ...]:
    return (*flags, "--intra_op_threads", str(model_threads(flags)))


# ------------------------------------------------------------------------------------------------ the runs


def part_cells(
    args: argparse.Namespace,
    part: str,
    experiments: dict[str, Sequence[str]],
    batch_size: int,
    points: Sequence[LoadPoint | None] = (None,),
    repeats: int | None = None,
) -> list[Cell]:
    """A part's runs (none unless --parts names it), its rounds interleaved."""
    if part not in args.parts:
        return []
    one_round = [
        Cell(Experiment(f"{part}.{name}", tuple(flags)), batch_size, False, 0, point)
        for name, flags in experiments.items()
        for point in points
    ]
    return interleaved(one_round, repeats or args.repeats, args.seed)


def overhead_cells(args: argparse.Namespace, rows: pd.DataFrame | None) -> list[Cell]:
    return part_cells(args, "overhead", {n: (*OVERHEAD_FLAGS, *f) for n, f in OVERHEAD_DESIGNS.items()}, 1)


def batching_cells(args: argparse.Namespace, rows: pd.DataFrame | None) -> list[Cell]:
    """The model alone first, then every design's peak search without and with batching."""
    common = (*RESNET_FLAGS, "--find_peak", "--slo_ms", f"{SLO_MS:g}", "--num_iters", str(PEAK_ITERS))
    searches: dict[str, Sequence[str]] = {}
    for name, flags in PEAK_DESIGNS.items():
        searches[name] = with_threads((*common, *flags))
        searches[f"{name}_batched"] = (*searches[name], *BATCHING)
    cells = [
        Cell(Experiment(c.experiment.name, c.experiment.flags, search), c.batch_size, c.compile, c.repeat)
        for c in part_cells(args, "batching", searches, 1)
    ]
    forwards = [Cell(Experiment(FORWARDS, (), time_forwards), 1, False, 0)] if "batching" in args.parts else []
    return forwards + cells


def instances_cells(args: argparse.Namespace, rows: pd.DataFrame | None) -> list[Cell]:
    common = (*RESNET_FLAGS, "--num_iters", "100")
    return part_cells(args, "instances", {n: (*common, *f) for n, f in INSTANCE_DESIGNS.items()}, 8)


def curve_cells(args: argparse.Namespace, rows: pd.DataFrame | None) -> list[Cell]:
    common = (*RESNET_FLAGS, "--num_iters", "200", "--slo_ms", f"{SLO_MS:g}")
    experiments = {name: with_threads((*common, *flags)) for name, flags in CURVE_EXPERIMENTS.items()}
    points = [LoadPoint(POISSON.name, rate) for rate in sorted(set(args.rates))]
    return part_cells(args, "curve", experiments, 1, points, args.curve_repeats)


def search(cell: Cell, runner: Runner, added: tuple[str, ...]) -> dict[str, object]:
    """One --find_peak search: its steps' rows to peak_runs.csv, its result (the line it appends to peak.csv) as
    the cell's row; a search that no rate passed is a result (no peak), not a failure."""
    ran, found = runner.server_row(cell, runner.cell_flags(cell, added), "peak_runs.csv", "peak.csv")
    if found is None or ran.returncode != 0:
        return {"status": "crashed" if ran.returncode else "error", "error": f"exit {ran.returncode}: {ran.said}"}
    # Under names of their own: a row with peak.csv's columns reads as a peak CSV, not as the study's runs
    return {"status": "ok", **{name: found.get(column) for name, column in SEARCH_COLUMNS.items()}}


def time_forwards(cell: Cell, runner: Runner, added: tuple[str, ...], loops: int = 15) -> dict[str, object]:
    """The model alone at each formed-batch size and thread count the searches use (median and best of `loops`
    forwards, after 3 untimed): what the peak search's designs have to work with, to forward_ms.csv."""
    import torch  # the study's own process needs torch only here: its --help and report start without it

    from serverbench.backend.models import build_model

    model = build_model("resnet18", torch.device("cpu"), seed=0, checkpoint=None).module
    inputs = torch.randn(max(FORWARD_SIZES), 3, 64, 64)
    rows = []
    with torch.inference_mode():
        for count in sorted({model_threads(flags) for flags in PEAK_DESIGNS.values()}):
            torch.set_num_threads(count)
            for size in FORWARD_SIZES:
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
    pd.DataFrame(rows).to_csv(runner.out_dir / "forward_ms.csv", index=False)
    return {"status": "ok"}


# ------------------------------------------------------------------------------------------------ the report


def spread_table(runs: pd.DataFrame, column: str, unit: str) -> list[str]:
    lines = table_head(["experiment", f"each repeat ({unit})", "mean", "CV", "p99 latency (ms), mean", "failed"])
    for name, group in runs.groupby("experiment", sort=False):
        ok = group[group["status"] == "ok"]
        spread = repeat_cells(list(ok[column].dropna()), ",.0f")
        lines.append(table_row([name, *spread, f"{ok['p99_latency_s'].mean() * 1e3:.1f}", len(group) - len(ok)]))
    return lines


def mean_ok(runs: pd.DataFrame, name: str, column: str) -> float | None:
    ok = runs[(runs["experiment"] == name) & (runs["status"] == "ok")][column].dropna()
    return float(ok.mean()) if len(ok) else None


def overhead_part(runs: pd.DataFrame, out: Path) -> tuple[list[str], list[Verdict]]:
    lines = [f"## The server's own cost: `{shlex.join(OVERHEAD_FLAGS)}` (batch 1)", ""]
    lines += [*spread_table(runs, "achieved_rate_rps", "requests/s"), ""]
    verdicts = []
    for name, target in OVERHEAD_TARGETS_RPS.items():
        got = mean_ok(runs, name, "achieved_rate_rps")
        shown = "n/a" if got is None else f"{got:,.0f}"
        verdicts.append(
            Verdict(f"overhead {name}: {shown} requests/s (target >= {target:,.0f})", got is not None and got >= target)
        )
    return lines, verdicts


def forward_table(path: Path) -> list[str]:
    times = pd.read_csv(path)
    counts = sorted(times["threads"].unique())
    lines = [
        "The model alone (median of 15 forwards, in the study's own process), ms per forward and per image:",
        "",
        *table_head(["images", *(f"{c} thread{'s' if c > 1 else ''}" for c in counts)]),
    ]
    for size, group in times.groupby("batch"):
        cells = []
        for count in counts:
            ms = group[group["threads"] == count]["median_ms"]
            cells.append(f"{ms.iloc[0]:.1f} ({ms.iloc[0] / size:.1f})" if len(ms) else "n/a")
        lines.append(table_row([size, *cells]))
    return lines + [""]


def batching_verdicts(peaks: pd.DataFrame, medians: dict[str, float]) -> list[Verdict]:
    """Each design's median peak with batching over without it, and every repeat's; the target design's verdict."""
    verdicts = []
    # One search per experiment and repeat (pivot refuses duplicates rather than averaging them).
    by_repeat = peaks.pivot(index="repeat", columns="experiment", values="peak_rps").fillna(0.0)
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


def batching_part(runs: pd.DataFrame, out: Path) -> tuple[list[str], list[Verdict]]:
    peaks = runs[(runs["experiment"] != FORWARDS.split(".", 1)[1]) & (runs["status"] == "ok")]
    if "peak_rps" not in peaks or peaks.empty:
        return ["## Dynamic batching at a latency target", "", "No peak search ended with its result.", ""], [
            Verdict("batching: nothing measured", False)
        ]
    threads = peaks.groupby("experiment")["intra_op_threads"].first() if "intra_op_threads" in peaks else {}
    lines = [
        f"## Dynamic batching at a latency target: `{shlex.join(RESNET_FLAGS)} --batch_size 1 --find_peak --slo_ms "
        f"{SLO_MS:g} --num_iters {PEAK_ITERS}`, with and without `{shlex.join(BATCHING)}`, the model on every core "
        f"(`--intra_op_threads`: {', '.join(f'{n} {int(t)}' for n, t in dict(threads).items() if t == t)})",
        "",
        *table_head(
            "| experiment | offline (burst) req/s | peak req/s with p99 <= SLO, each repeat | median | "
            "its p99s (ms) | lowest rates over |"
        ),
    ]
    medians: dict[str, float] = {}
    for name, group in peaks.groupby("experiment", sort=False):
        # A search whose every rate missed the SLO has no peak: it counts as 0, not as a repeat left out.
        medians[name] = float(group["peak_rps"].fillna(0.0).median())
        searched = [", ".join("none" if pd.isna(v) else f"{v:.1f}" for v in group["peak_rps"]), f"{medians[name]:.1f}"]
        p99s = ", ".join("n/a" if pd.isna(v) else f"{v * 1e3:.1f}" for v in group["peak_p99_s"])
        over = ", ".join("n/a" if pd.isna(v) else f"{v:.1f}" for v in group["over_slo_rps"])
        lines.append(table_row([name, ", ".join(f"{v:.1f}" for v in group["offline_rps"]), *searched, p99s, over]))
    lines.append("")
    if (out / "forward_ms.csv").exists():
        lines += forward_table(out / "forward_ms.csv")
    return lines, batching_verdicts(peaks, medians)


def instances_part(runs: pd.DataFrame, out: Path) -> tuple[list[str], list[Verdict]]:
    lines = [f"## Instances in processes against threads: `{shlex.join(RESNET_FLAGS)} --batch_size 8`", ""]
    lines += [*spread_table(runs, "throughput", "samples/s"), ""]
    got = [mean_ok(runs, name, "throughput") for name in INSTANCE_DESIGNS]
    shown = ", ".join(f"{n} {'n/a' if g is None else f'{g:.1f}'}" for n, g in zip(INSTANCE_DESIGNS, got))
    return lines, [Verdict(f"instances: mean samples/s {shown}", None)]


def curve_part(runs: pd.DataFrame, out: Path) -> tuple[list[str], list[Verdict]]:
    order = [name for name in CURVE_EXPERIMENTS if name in set(runs["experiment"])]
    axis = ("offered rate", "req/s")
    drawn = plot_latency_throughput(runs, order, POISSON.sweep_axis.column, axis, "resnet18 64x64", out / PLOT_PNG)
    failed = int((runs["status"] != "ok").sum())
    lines = [f"## The latency-throughput curve: `{shlex.join(RESNET_FLAGS)} --batch_size 1 --slo_ms {SLO_MS:g}`", ""]
    lines += [slo_capacity_table(runs, order, POISSON.sweep_axis.column) or "No run had an SLO.", ""]
    lines += [f"![latency against throughput]({PLOT_PNG})", ""] if drawn else []
    return lines, [Verdict(f"curve: {len(runs)} runs, {failed} failed", failed == 0)]


PART_REPORTS = {"overhead": overhead_part, "batching": batching_part, "instances": instances_part, "curve": curve_part}


def parts(rows: pd.DataFrame, out: Path) -> list[tuple[list[str], list[Verdict]]]:
    """Every part with rows in the folder, in order: its lines and its verdicts."""
    found = []
    for part, part_report in PART_REPORTS.items():
        mine = part_rows(rows, part, "achieved_rate_rps", "throughput", "p50_latency_s", "p99_latency_s")
        if len(mine):
            found.append(part_report(mine, out))
    return found


def report(args: argparse.Namespace, rows: pd.DataFrame, out: Path) -> list[str]:
    lines = ["# Serving designs on this machine", ""]
    for part_lines, verdicts in parts(rows, out):
        lines += [*part_lines, "Targets:", "", *(v.line() for v in verdicts), ""]
    return lines


def targets_met(args: argparse.Namespace, rows: pd.DataFrame) -> bool:
    return all(v.met is not False for _, verdicts in parts(rows, args.out) for v in verdicts)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
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
        help=f"rounds of the curve, 1 to {MAX_REPEATS} (default 1; --repeats is the other parts')",
    )


LOAD_FLAGS = ("--load", "--rate", "--concurrency", "--find_peak")  # each part's own, never the user's


def preflight(args: argparse.Namespace) -> str | None:
    """The load is each part's own: one given after -- would make rows its cells never match on resume."""
    given = sorted(given_flags(args.server_flags) & set(LOAD_FLAGS))  # --conc is --concurrency
    return f"{', '.join(given)}: each part sets its own load; leave it out of the flags after --" if given else None


def checked_cells(args: argparse.Namespace, rows: pd.DataFrame | None) -> list[Cell]:
    """Every part's server.py runs, checked before any runs (the model alone is not one)."""
    phases = (overhead_cells, batching_cells, instances_cells, curve_cells)
    return [cell for phase in phases for cell in phase(args, rows) if cell.experiment.name != FORWARDS]


STUDY = Study(
    "serving",
    __doc__,
    (overhead_cells, batching_cells, instances_cells, curve_cells),
    report,
    add_arguments,
    repeats=3,
    load_axis=POISSON.name,
    target_met=targets_met,
    checked_cells=checked_cells,
    preflight=preflight,
    free_flags=("curve_repeats",),  # more rounds of the curve, as --repeats
)


main = STUDY.main


if __name__ == "__main__":
    sys.exit(main())
