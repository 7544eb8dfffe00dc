"""The performance comparison in one command: the reference-like server against the fastest configuration this
project offers, interleaved and repeated, each run with its model-alone ceiling, next to the host memory copy
bandwidth measured in the same invocation.

    ./venv.sh python -m bench.compare                                   # the CPU targets: batch 64, 250x250
    ./venv.sh python -m bench.compare --batch_size 256 --precisions fp32 bf16 --out results/h200/compare

A study on the harness (bench/study.py): the copy bandwidth first (in the study's own process), then every
configuration once per round, the rounds interleaved; each run's row in <out>/runs.csv (logs in <out>/logs); the
same command resumes; the table is printed and written to <out>/compare.md. Exit status 1 when a run failed.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import pandas as pd
import torch

from bench.study import Study, Verdict, with_columns
from serverbench.backend.models import is_known_model
from serverbench.config.flags import ConfigError, bounded, device_name
from serverbench.config.limits import MAX_BATCH_IMAGES, PRECISIONS
from serverbench.device.layer import unusable_gpu_reason
from serverbench.launch.study import Cell, Experiment, Runner, interleaved
from serverbench.launch.study_checks import study_args
from serverbench.records.comparison import compare_rows
from serverbench.records.markdown import table_head, table_row
from serverbench.records.summary import ABOVE_CEILING

# The reference's design and data path: one loop, a fresh shared-memory segment per request, float32 on the wire.
REFERENCE_LIKE = ("--design", "serial", "--transport", "queue", "--wire_dtype", "float32")
# The fastest the project offers, by device and wire dtype, as measured (runs of server.py at batch 64, 250x250,
# identity, on 2 CPU cores). float32 on the CPU: the threaded design; the pipelined design's extra threads compete
# for the same cores that do the copies. uint8 on the CPU: the serial design with the decoding compiled (one fused
# pass reading the ring slot in place instead of three) and the model eager: 9.5-14.0k samples/s against
# 8.9-9.6k threaded, and 7.7-9.3k with the model compiled too (inductor's mean is slower than eager's there).
# On a GPU the copies run on copy engines and the pipelined design overlaps them with the forward.
FASTEST = {
    "cpu": {
        "float32": ("--design", "threaded", "--transport", "shm"),
        "uint8": ("--design", "serial", "--transport", "shm", "--compile_decode"),
    },
    "cuda": dict.fromkeys(("float32", "uint8"), ("--design", "pipelined", "--num_workers", "2", "--transport", "shm")),
}
# --compile (the model) by device and model; a model not named is compiled. On the CPU inductor makes the identity
# model's mean slower (6.3-7.2k against 7.7-7.9k samples/s at batch 64), while resnet18 runs twice as fast
# compiled (54.0 against 26.7 samples/s, in an earlier comparison on this machine).
COMPILE = {"cpu": {"identity": False}, "cuda": {}}
# The targets (performance issue), checked on what this invocation measured.
TARGET_FLOAT32_RATIO = 5.0
TARGET_UINT8_RATIO = 10.0
TARGET_COPY_SHARE = 0.5
TARGET_EFFICIENCY = {"cpu": 0.9, "cuda": 0.8}


@dataclass(frozen=True)
class Config:
    model: str
    name: str  # reference_like, fastest_float32_fp32, ...
    flags: tuple[str, ...]
    compile: bool

    @property
    def experiment(self) -> str:
        return f"{self.model}.{self.name}"


def configs(
    models: Sequence[str],
    precisions: Sequence[str],
    fastest: dict[str, Sequence[str]],
    compile_by_model: dict[str, bool],
    compile_default: bool = True,
) -> list[Config]:
    """The reference-like configuration and the fastest one per wire dtype and precision, for each model; the
    fastest ones compile the model as `compile_by_model` says (else `compile_default`)."""
    found: list[Config] = []
    for model in models:
        found.append(Config(model, "reference_like", (*REFERENCE_LIKE, "--model", model), False))
        for precision in precisions:
            for wire in ("float32", "uint8"):
                found.append(
                    Config(
                        model,
                        f"fastest_{wire}_{precision}",
                        (*fastest[wire], "--wire_dtype", wire, "--precision", precision, "--model", model),
                        compile_by_model.get(model, compile_default),
                    )
                )
    return found


@dataclass(frozen=True)
class CopyBandwidth:
    request_bytes: int
    two_copies_s: float  # median time to copy one request's bytes twice (A -> B -> C), preallocated
    threads: int

    @property
    def gb_per_s(self) -> float:
        return 2 * self.request_bytes / self.two_copies_s / 1e9

    def samples_per_s(self, batch_size: int) -> float:
        """What a transport that copies every request twice could reach at most on this machine."""
        return batch_size / self.two_copies_s


def measure_copy_bandwidth(request_bytes: int, repeats: int = 30) -> CopyBandwidth:
    """One process copying a request's bytes twice between preallocated buffers (torch's copy, its default
    intra-op threads): the memory bandwidth a transport's two copies per request are read against."""
    src = torch.randn(request_bytes // 4)
    middle, dst = torch.empty_like(src), torch.empty_like(src)
    times_s = []
    for i in range(repeats + 3):
        start_ns = time.perf_counter_ns()
        middle.copy_(src)
        dst.copy_(middle)
        if i >= 3:  # the first ones fault the pages in
            times_s.append((time.perf_counter_ns() - start_ns) / 1e9)
    return CopyBandwidth(request_bytes, statistics.median(times_s), torch.get_num_threads())


def _mean_std(values, scale: float = 1.0, digits: int = 1) -> str:
    values = [v * scale for v in values]
    if not values:
        return "n/a"
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.mean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def summarise(
    runs, found: Sequence[Config], bandwidth: CopyBandwidth, batch_size: int, device_kind: str
) -> tuple[str, list[str]]:
    """The markdown table and the target checks."""
    ok = runs[runs["status"] == "ok"]
    lines = table_head(
        "| model | configuration | ok runs | throughput (samples/s) | p50 latency (ms) | p99 latency (ms) | "
        "efficiency | throughput vs reference_like [95% CI] |"
    )
    checks: list[str] = []
    verdicts: list[str] = []
    for config in found:
        group = ok[ok["experiment"] == config.experiment]
        all_runs = runs[runs["experiment"] == config.experiment]
        base_name = f"{config.model}.reference_like"
        base = ok[ok["experiment"] == base_name]
        ratio_text = "1 (baseline)" if config.name == "reference_like" else "n/a (needs 2+ rounds with both ok)"
        ratio = None
        if config.name != "reference_like":
            ratio = compare_rows(base, group, "throughput", base_name, config.experiment)
            if ratio is not None:
                ratio_text = ratio.short
                verdicts.append(f"- {ratio.text}")
        efficiency = group["efficiency"].dropna() if "efficiency" in group else []
        latencies = [_mean_std(group["p50_latency_s"], 1e3), _mean_std(group["p99_latency_s"], 1e3)]
        figures = [_mean_std(group["throughput"]), *latencies, _mean_std(efficiency, digits=3), ratio_text]
        lines.append(table_row([config.model, config.name, f"{len(group)}/{len(all_runs)}", *figures]))
        if config.name == "reference_like" or group.empty:
            continue
        mean_throughput = float(group["throughput"].mean())
        ratio_value = (
            ratio.ratio
            if ratio is not None
            else (mean_throughput / float(base["throughput"].mean()) if not base.empty else float("nan"))
        )
        if config.model == "identity" and config.name.startswith("fastest_float32"):
            share = mean_throughput / bandwidth.samples_per_s(batch_size)
            checks.append(
                _check(
                    f"identity {config.name}: {ratio_value:.2f}x the reference-like throughput",
                    ratio_value >= TARGET_FLOAT32_RATIO,
                    f">= {TARGET_FLOAT32_RATIO:g}x",
                )
            )
            checks.append(
                _check(
                    f"identity {config.name}: {mean_throughput:.0f} samples/s = {share:.0%} of the "
                    f"two-copy ceiling ({bandwidth.samples_per_s(batch_size):.0f} samples/s)",
                    share >= TARGET_COPY_SHARE,
                    f">= {TARGET_COPY_SHARE:.0%}",
                )
            )
        elif config.model == "identity" and config.name.startswith("fastest_uint8"):
            checks.append(
                _check(
                    f"identity {config.name}: {ratio_value:.2f}x the reference-like float32 throughput",
                    ratio_value >= TARGET_UINT8_RATIO,
                    f">= {TARGET_UINT8_RATIO:g}x",
                )
            )
        elif config.model != "identity" and len(efficiency):
            target = TARGET_EFFICIENCY[device_kind]
            what = f"{config.model} {config.name}: efficiency {float(efficiency.mean()):.3f}"
            low = group["efficiency_low"].dropna() if "efficiency_low" in group else []
            if len(low) and (low > 1.0).any():  # a slowed ceiling: the figure is no efficiency, met or not
                above = int((low > 1.0).sum())
                checks.append(f"- not judged: {what}: {above} of {len(low)} runs {ABOVE_CEILING}")
            else:
                checks.append(_check(what, float(efficiency.mean()) >= target, f">= {target:g}"))
    return "\n".join([*lines, "", *verdicts]) + "\n", checks


def _check(what: str, met: bool, target: str) -> str:
    return Verdict(f"{what} (target {target})", met).line()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", nargs="+", default=["identity", "resnet18"])
    parser.add_argument(
        "--batch_size",
        type=bounded(int, 1, MAX_BATCH_IMAGES),
        default=64,
        help=f"images per request, 1 to {MAX_BATCH_IMAGES} (default 64)",
    )
    parser.add_argument("--image_size", type=bounded(int, 1, 4096), default=250, help="1 to 4096 (default 250)")
    # identity: 200 requests, so that the fastest configurations measure for about a second; with 60 their
    # measured phase lasted ~0.3 s at ~12k samples/s and one scheduling hiccup moved a run by a quarter.
    parser.add_argument(
        "--num_iters",
        nargs="+",
        default=["identity=200", "resnet18=24"],
        metavar="MODEL=N",
        help="measured requests per run, by model (default identity=200 resnet18=24; others 24)",
    )
    parser.add_argument(
        "--precisions",
        nargs="+",
        default=["fp32"],
        choices=PRECISIONS,
        help="precisions of the fastest configuration (the reference-like one runs at the default: "
        "PyTorch's own TF32 flags, as the reference did)",
    )
    parser.add_argument(
        "--fastest",
        default=None,
        help="server flags of the fastest configuration, for both wire dtypes "
        "(default: by device and wire dtype, see FASTEST)",
    )
    parser.add_argument("--device", type=device_name, default="auto", help="auto, cpu or cuda[:N] (default auto)")


@dataclass(frozen=True)
class Plan:
    """What the arguments come to."""

    device: str
    device_kind: str
    iters: dict[str, int]  # measured requests per run, by model
    fastest: dict[str, tuple[str, ...]]  # wire dtype -> the fastest configuration's flags
    compile_by_model: dict[str, bool]
    compile_default: bool
    found: list[Config]


def plan(args: argparse.Namespace) -> Plan:
    """The comparison's plan; ConfigError for a --num_iters that is not MODEL=N."""
    device = ("cuda:0" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    device_kind = "cuda" if device.startswith("cuda") else "cpu"
    iters = {}
    for spec in args.num_iters:
        model, _, count = spec.partition("=")
        if not count.isdigit() or int(count) < 1:
            raise ConfigError(f"--num_iters {spec!r}: expected MODEL=N")
        iters[model] = int(count)
    fastest = dict(FASTEST[device_kind])
    compile_by_model, compile_default = dict(COMPILE[device_kind]), True
    if args.fastest:  # the same flags for both wire dtypes
        try:
            flags = shlex.split(args.fastest)
        except ValueError as exc:  # an unclosed quote
            raise ConfigError(f"--fastest {args.fastest!r}: {exc}") from None
        if "--compile" in flags or "--no-compile" in flags:  # the cell carries compile on or off
            compile_by_model, compile_default = {}, "--compile" in flags
            flags = [f for f in flags if f not in ("--compile", "--no-compile")]
        fastest = dict.fromkeys(fastest, tuple(flags))
    found = configs(args.models, args.precisions, fastest, compile_by_model, compile_default)
    return Plan(device, device_kind, iters, fastest, compile_by_model, compile_default, found)


def preflight(args: argparse.Namespace) -> str | None:
    """The models, --num_iters and a GPU asked for that cannot be used: the one line, before any run."""
    if unknown := [model for model in args.models if not is_known_model(model)]:
        return f"--models {' '.join(unknown)}: not a torchvision classification model nor identity"
    try:
        plan(args)
    except ConfigError as exc:
        return str(exc)
    if not args.report_only and args.device != "cpu" and (reason := unusable_gpu_reason()) is not None:
        return reason  # no CPU numbers without a word
    return None


BANDWIDTH = "copy_bandwidth"  # the host memory copy, measured in the study's own process before the runs


def configuration_cells(args: argparse.Namespace, rows: pd.DataFrame | None) -> list[Cell]:
    """Every configuration once per round, the rounds interleaved (the study runner's order)."""
    found = plan(args)
    common = ("--device", found.device, "--image_size", str(args.image_size))
    iters = {c.model: ("--num_iters", str(found.iters.get(c.model, 24))) for c in found.found}
    round_cells = [
        Cell(Experiment(c.experiment, (*common, *c.flags, *iters[c.model])), args.batch_size, c.compile, 0)
        for c in found.found
    ]
    return interleaved(round_cells, args.repeats, args.seed)


def cells(args: argparse.Namespace, rows: pd.DataFrame | None) -> list[Cell]:
    """The copy bandwidth, then the configurations."""
    return [Cell(Experiment(BANDWIDTH, (), copy_bandwidth), args.batch_size, False, 0)] + configuration_cells(
        args, rows
    )


def copy_bandwidth(cell: Cell, runner: Runner, added: tuple[str, ...]) -> dict[str, object]:
    """The bandwidth's row: a float32 request of the comparison's size copied twice (measure_copy_bandwidth)."""
    args = study_args(runner.out_dir)
    bandwidth = measure_copy_bandwidth(cell.batch_size * 3 * args.image_size**2 * 4)
    print(
        f"host memory copy: {bandwidth.gb_per_s:.2f} GB/s ({bandwidth.threads} threads); copying one float32 "
        f"request ({bandwidth.request_bytes / 2**20:.1f} MiB) twice takes {bandwidth.two_copies_s * 1e3:.2f} ms",
        end=" ",
        flush=True,
    )
    return {"status": "ok", **asdict(bandwidth), "device": plan(args).device}


def report(args: argparse.Namespace, rows: pd.DataFrame, out: Path) -> list[str]:
    """compare.md: the configurations' table, the A/B verdicts and the targets, beside the copy ceiling."""
    measured = rows[rows["experiment"] == BANDWIDTH]
    if measured.empty:
        return ["# Performance comparison", "", "The copy bandwidth was not measured: run the comparison."]
    row = measured.iloc[-1]
    bandwidth = CopyBandwidth(int(row["request_bytes"]), float(row["two_copies_s"]), int(row["threads"]))
    found = plan(argparse.Namespace(**{**vars(args), "device": str(row["device"])}))  # the device it ran on
    runs = with_columns(rows[rows["experiment"] != BANDWIDTH], "throughput", "p50_latency_s", "p99_latency_s")
    table, checks = summarise(runs, found.found, bandwidth, args.batch_size, found.device_kind)
    fastest = "; ".join(f"{wire}: `{shlex.join(flags)}`" for wire, flags in found.fastest.items())
    where = (
        " (given by --fastest)"
        if args.fastest
        else f" (fixed: bench/compare.py's FASTEST for {found.device_kind}, chosen from identity runs at batch 64, "
        "not searched for these models: another design may be faster for yours; a sweep over the designs, or "
        "--fastest, tells)"
    )
    compiled = ", ".join(
        f"{m} {'yes' if found.compile_by_model.get(m, found.compile_default) else 'no'}" for m in args.models
    )
    return [
        f"# Performance comparison: batch {args.batch_size}, {args.image_size}x{args.image_size}, "
        f"{args.repeats} interleaved repeats",
        "",
        f"- device: {found.device}; torch {torch.__version__}",
        f"- reference-like: `{shlex.join(REFERENCE_LIKE)}`; fastest: {fastest}{where}; model compiled: {compiled}",
        f"- host memory copy (one process, preallocated buffers, {bandwidth.threads} threads): "
        f"{bandwidth.gb_per_s:.2f} GB/s; a request's float32 bytes copied twice in "
        f"{bandwidth.two_copies_s * 1e3:.2f} ms = at most {bandwidth.samples_per_s(args.batch_size):.0f} samples/s",
        "- efficiency = throughput / ceiling_throughput, the model alone on inputs already on the device",
        "",
        table,
        *checks,
    ]


STUDY = Study(
    "compare",
    __doc__,
    (cells,),
    report,
    add_arguments,
    repeats=3,
    checked_cells=configuration_cells,
    preflight=preflight,
)


main = STUDY.main


if __name__ == "__main__":
    sys.exit(main())
