"""Summaries and plots of a results CSV: the reference's per-(batch size, compile) tables, a combined summary
with each experiment against a baseline (runs paired by repeat, the ratio's 95 % interval and a verdict in words:
serverbench/schema/ab.py, as bench.compare and bench.commits), and PNG plots.

    python report.py results/sweep_cpu/runs.csv --baseline serial

Writes output_{batch_size}_{compile}.md and summary.md next to the CSV (or in --out_dir), plots in --plots_dir.
Runs on any CSV that server.py wrote; rows whose status is not ok are listed, never averaged; a last line cut by a
crash (no newline at its end) is left out, with a warning.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from serverbench.config.design_kinds import BASELINE_DESIGN, DESIGN_KINDS, DESIGNS, experiment_label, is_design_label
from serverbench.config.flags import ConfigError, OneLineErrorParser
from serverbench.config.paths import check_output_folder, check_path_names
from serverbench.records.benchmark_db import check_records_file, json_path, write_records
from serverbench.records.comparison import compare_rows
from serverbench.records.markdown import figure, table_head
from serverbench.records.plots import LOAD_AXES, load_point_label, write_plots
from serverbench.records.report_input import (
    TRUE_TEXT,
    ReportError,
    RunCsv,
    drop_superseded,
    other_kind,
    pooled_configurations,
    read_run_csv,
)
from serverbench.schema.stats import cv_pct


def load_runs(path: Path) -> pd.DataFrame:
    """A results CSV as server.py wrote it; under torchrun each job counts once, by its job row (its rank rows
    are parts of it). ReportError when it is not one (report_input.read_run_csv); a last line cut by a crash is
    left out (main says so)."""
    found = read_run_csv(path)
    runs = pd.read_csv(path, nrows=len(found.rows) if found.cut_line_left_out else None)
    if "throughput" not in runs.columns:
        runs["throughput"] = np.nan
    if "scope" in runs.columns:
        runs = runs[runs["scope"] != "rank"].reset_index(drop=True)
    if "design" not in runs.columns:  # the reference's own CSV: one experiment per file
        runs["design"] = REFERENCE_DESIGN
    if "num_workers" not in runs.columns:
        runs["num_workers"] = 1
    # Rows from plain runs (or a cell left empty by hand): named as server.py would name them
    named = [
        experiment_label(design, int(workers)) if design in DESIGNS else str(design)
        for design, workers in zip(runs["design"], runs["num_workers"].fillna(1))
    ]
    given = runs["experiment"] if "experiment" in runs.columns else pd.Series(np.nan, index=runs.index)
    runs["experiment"] = [str(name) if name == name else fallback for name, fallback in zip(given, named)]
    runs["compile"] = runs["compile"].astype(str).str.strip().str.lower().isin(TRUE_TEXT)  # each true or false
    if "status" not in runs.columns:
        runs["status"] = "ok"
    numbers = runs.select_dtypes("number")
    if (infinite := np.isinf(numbers)).to_numpy().any():  # no run measures infinity: a figure to leave out
        runs[numbers.columns] = numbers.mask(infinite)
        runs.attrs["infinite_figures"] = int(infinite.to_numpy().sum())
    return runs


def mean_std(values: pd.Series | None, digits: int) -> str:
    if values is None:
        return "n/a"
    values = values.dropna()
    if values.empty:
        return "n/a"
    std = values.std(ddof=1) if len(values) > 1 else 0.0
    return f"{values.mean():.{digits}f} +/- {std:.{digits}f}"


def experiment_order(runs: pd.DataFrame, baseline: str | None) -> list[str]:
    """The baseline, then serial, threaded, pipelined by worker count, then other experiments by name."""
    design_rank = {REFERENCE_DESIGN: 0, **{kind.name: rank for rank, kind in enumerate(DESIGN_KINDS, start=1)}}
    first = runs.drop_duplicates("experiment").set_index("experiment")

    def key(name: str) -> tuple:
        design = first.at[name, "design"] if "design" in first.columns else None
        workers = first.at[name, "num_workers"] if "num_workers" in first.columns else 0
        custom = name != REFERENCE_DESIGN and not is_design_label(name)
        return (name != baseline, custom, design_rank.get(design, 9), workers if workers == workers else 0, name)

    return sorted(first.index, key=key)


REPEAT_SPREAD_LIMIT_PCT = 10.0  # repeats of one experiment further apart than this cannot tell designs apart
RUN_SPREAD_COLUMNS = (("window_throughput_cv_pct", "window CV (%)"), ("ceiling_spread_pct", "ceiling spread (%)"))
EFFICIENCY_INTERVAL_COLUMNS = ("efficiency_low", "efficiency_high")  # absent from CSVs written before them


def efficiency_cell(ok: pd.DataFrame) -> str:
    """Efficiency's mean +/- std over ok repeats, then its interval where the rows have one: each end's mean over
    the repeats that have efficiency and both ends, e.g. `0.970 +/- 0.010 (0.910-1.040)`. Rows without the
    interval (older CSVs, a torchrun job) give the bare mean +/- std."""
    cell = mean_std(ok.get("efficiency"), 3)
    if any(column not in ok.columns for column in EFFICIENCY_INTERVAL_COLUMNS):
        return cell
    both = ok.dropna(subset=["efficiency", *EFFICIENCY_INTERVAL_COLUMNS])
    if both.empty:
        return cell
    return f"{cell} ({both['efficiency_low'].mean():.3f}-{both['efficiency_high'].mean():.3f})"


def repeat_spread_pct(ok: pd.DataFrame) -> float | None:
    """Throughput's coefficient of variation over an experiment's ok repeats, in %."""
    values = ok["throughput"].dropna() if "throughput" in ok.columns else []
    return cv_pct(list(values))


REFERENCE_DESIGN = "original"  # the design column given to the reference's own CSV rows


def load_axis_column(runs: pd.DataFrame) -> str | None:
    """offered_rate_rps or concurrency when some experiment's rows carry more than one value of it (a sweep over
    offered load); None for rows at one load point each."""
    for column in LOAD_AXES:
        if column in runs.columns and runs.groupby(["experiment", "batch_size", "compile"])[column].nunique().max() > 1:
            return column
    return None


def _listed(load_column: str | None) -> list[str]:
    """The load axis as extra group-by columns: a cell's repeats are the runs at one load point."""
    return [load_column] if load_column else []


def _point_text(load_column: str | None, keys: tuple) -> str:
    """', offered 20 req/s' for a group whose last key is its load point; '' without one (or at none: NaN)."""
    if load_column is None or keys[-1] != keys[-1]:
        return ""
    return f", {load_point_label(load_column, keys[-1])}"


def noisy(runs: pd.DataFrame) -> pd.Series:
    """The ok runs whose own row says the machine may have made their numbers (its `noise_warning`)."""
    if "noise_warning" not in runs:
        return pd.Series(False, index=runs.index)
    words = runs["noise_warning"]  # float NaN throughout when no run warned: no fillna("") on floats (pandas 4)
    warned = words.notna() & (words.astype(str).str.strip() != "")
    return warned & (runs["status"] == "ok")


def cell_table(runs: pd.DataFrame, order: Sequence[str]) -> str:
    """The reference's table for one (batch size, compile): one row per experiment, mean +/- std over repeats,
    then the spread: each run's own (its windows' throughput CV, its ceiling's) and the repeats'."""
    has_efficiency = "efficiency" in runs.columns and runs["efficiency"].notna().any()
    spreads = [
        (column, title) for column, title in RUN_SPREAD_COLUMNS if column in runs.columns and runs[column].notna().any()
    ]
    header = (
        [
            "experiment",
            "warmup_latency (s)",
            "average_latency (s)",
            "p99 latency (s)",
            "throughput (samples/s)",
            "gpu_util (%)",
        ]
        + (["efficiency"] if has_efficiency else [])
        + [title for _, title in spreads]
        + ["repeats CV (%)", "runs ok"]
    )
    lines = table_head(header)
    for name in order:
        group = runs[runs["experiment"] == name]
        if group.empty:
            continue
        ok = group[group["status"] == "ok"]
        cells = [
            name,
            mean_std(ok.get("warmup_latency"), 3),
            mean_std(ok.get("average_latency"), 3),
            mean_std(ok.get("p99_latency_s"), 3),
            mean_std(ok.get("throughput"), 1),
            mean_std(ok.get("gpu_util"), 1),
        ]
        if has_efficiency:
            cells.append(efficiency_cell(ok))
        cells += [mean_std(ok.get(column), 1) for column, _ in spreads]
        spread = repeat_spread_pct(ok)
        cells.append(
            "n/a"
            if spread is None
            else f"{spread:.1f}" + (f" (over {REPEAT_SPREAD_LIMIT_PCT:g})" if spread > REPEAT_SPREAD_LIMIT_PCT else "")
        )
        spoiled = int(noisy(ok).sum())
        cells.append(f"{len(ok)}/{len(group)}" + (f", {spoiled} noisy" if spoiled else ""))
        lines.append("| " + " | ".join(cells) + " |")
    legend = (
        f"repeats CV: the spread of throughput over the cell's ok repeats (std / mean); over "
        f"{REPEAT_SPREAD_LIMIT_PCT:g} % they cannot tell designs apart. runs ok: ok of all, and how many of them "
        "carry a noise warning (noisy)."
    )
    return "\n".join(lines) + "\n\n" + legend + "\n"


def spread_warnings(runs: pd.DataFrame, load_column: str | None = None) -> list[str]:
    """One line per (experiment, batch size, compile[, load point]) whose ok repeats' throughput spreads by more
    than REPEAT_SPREAD_LIMIT_PCT: those numbers cannot tell two designs apart."""
    warnings = []
    ok = runs[runs["status"] == "ok"]
    for keys, group in ok.groupby(
        ["experiment", "batch_size", "compile", *_listed(load_column)], sort=True, dropna=False
    ):
        name, batch_size, compiled = keys[:3]
        spread = repeat_spread_pct(group)
        if spread is not None and spread > REPEAT_SPREAD_LIMIT_PCT:
            where = f"batch {batch_size}, compile {'on' if compiled else 'off'}{_point_text(load_column, keys)}"
            warnings.append(
                f"{name} at {where}: throughput "
                f"spreads by {spread:.1f} % (CV) over {len(group)} repeats, more than "
                f"{REPEAT_SPREAD_LIMIT_PCT:g} %: too noisy to tell designs apart (more repeats, "
                "--stability_pct, or a quieter machine)"
            )
    return warnings


def comparison_table(runs: pd.DataFrame, order: Sequence[str], baseline: str) -> str:
    """Each experiment against the baseline, runs paired by their repeat (a sweep runs every cell once per round):
    the ratio with its 95 % interval in the table, then each throughput verdict in words (serverbench/schema/ab.py)."""
    base = runs[runs["experiment"] == baseline]
    lines = [
        *table_head(["experiment", f"throughput vs {baseline} [95% CI]", f"p99 latency vs {baseline} [95% CI]"]),
    ]
    verdicts = []
    for name in order:
        if name == baseline:
            continue
        group = runs[runs["experiment"] == name]
        cells = [name]
        for column in ("throughput", "p99_latency_s"):
            found = compare_rows(base, group, column, baseline, name) if column in runs.columns else None
            cells.append("n/a (needs 2+ rounds with both ok)" if found is None else found.short)
            if found is not None and column == "throughput":
                verdicts.append(f"- {found.text}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join([*lines, "", *verdicts]) + "\n"


@dataclass(frozen=True)
class SloCapacity:
    """How far up the load axis an experiment's p99 latency meets the SLO."""

    highest: float | None  # the highest load point where it, and every lower one, met the SLO; None: not the lowest
    p99_ms: float | None  # at `highest`: the worst ok repeat's p99
    throughput: float | None  # at `highest`: mean achieved samples/s over the ok repeats
    achieved_rate_rps: float | None  # at `highest`: mean achieved requests/s
    first_over: float | None  # the lowest load point that did not meet it; None: every point met it


def slo_capacity(group: pd.DataFrame, load_column: str, slo_ms: float) -> SloCapacity:
    """One experiment's rows at one (batch size, compile, SLO). A load point meets the SLO when the p99 of every
    ok repeat is within it: p99 is a promise about the tail, and a mean over repeats would let a repeat over it
    pass. Failed runs are not judged (the report lists them); a point without an ok run counts as over. The points
    are walked upwards and the walk stops at the first over the SLO, so a higher point that passes again by chance
    is not named (--find_peak's bisection assumes the same order)."""
    ok = group[(group["status"] == "ok") & group[load_column].notna()]
    passing: pd.DataFrame | None = None
    for value in sorted(group[load_column].dropna().unique()):
        at_point = ok[ok[load_column] == value]
        p99_ms = at_point["p99_latency_s"] * 1e3
        if at_point.empty or p99_ms.isna().any() or (p99_ms > slo_ms).any():
            first_over = float(value)
            break
        passing = at_point
    else:
        first_over = None
    if passing is None:
        return SloCapacity(None, None, None, None, first_over)
    rate = passing["achieved_rate_rps"].mean() if "achieved_rate_rps" in passing.columns else None
    return SloCapacity(
        float(passing[load_column].iloc[0]),
        float(passing["p99_latency_s"].max() * 1e3),
        float(passing["throughput"].mean()),
        None if rate is None or rate != rate else float(rate),
        first_over,
    )


def slo_capacity_table(runs: pd.DataFrame, order: Sequence[str], load_column: str) -> str | None:
    """The summary's "Highest rate within the SLO": one line per (experiment, batch size, compile, SLO); None
    when no row has an SLO."""
    if "slo_ms" not in runs.columns or "p99_latency_s" not in runs.columns:
        return None
    judged = runs[runs["slo_ms"].notna() & runs[load_column].notna() & (runs["status"] != "interrupted")]
    if judged.empty:
        return None
    name, unit = LOAD_AXES[load_column]
    header = [
        "experiment",
        "batch size",
        "compile",
        "SLO (ms)",
        f"highest {name} within it ({unit})",
        "worst p99 there (ms)",
        "achieved there (samples/s)",
        "achieved there (req/s)",
        f"lowest {name} over it ({unit})",
    ]
    lines = table_head(header)
    rank = {experiment: index for index, experiment in enumerate(order)}
    groups = judged.groupby(["batch_size", "compile", "slo_ms", "experiment"], sort=True)
    for (batch_size, compiled, slo_ms, experiment), group in sorted(
        groups, key=lambda item: (*item[0][:3], rank.get(item[0][3], len(rank)))
    ):
        found = slo_capacity(group, load_column, float(slo_ms))
        cells = [
            experiment,
            str(batch_size),
            "on" if compiled else "off",
            f"{slo_ms:g}",
            "none" if found.highest is None else f"{found.highest:g}",
            figure(found.p99_ms, ".1f", missing="-"),
            figure(found.throughput, ".1f", missing="-"),
            figure(found.achieved_rate_rps, ".2f", missing="-"),
            "-" if found.first_over is None else f"{found.first_over:g}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------- main


def report_runs(
    csv_path: Path, baseline: str | None = None, detail_batch_size: int | None = None, quiet_only: bool = False
) -> pd.DataFrame:
    """The rows a report is made of: those of a run CSV, less the failed or interrupted ones a later run replaced
    (drop_superseded); ReportError when they pool different configurations, when a --baseline or --detail_batch_size
    given is not in them, or when --quiet_only would leave no ok run (each a noise warning's, as on a busy VM)."""
    runs = drop_superseded(load_runs(csv_path))
    if runs.empty:  # a header alone (every row removed): nothing to plot or tabulate
        raise ReportError(f"{csv_path}: holds no rows; measure first")
    if (problem := pooled_configurations(runs, load_axis_column(runs))) is not None:
        raise ReportError(f"{csv_path}: {problem}")
    names = sorted(runs["experiment"].astype(str).unique())
    if baseline is not None and baseline not in names:
        raise ReportError(f"--baseline {baseline}: no such experiment in {csv_path}; it has {', '.join(names[:8])}")
    sizes = sorted(runs.loc[runs["status"] == "ok", "batch_size"].unique())
    if detail_batch_size is not None and detail_batch_size not in sizes:
        shown = ", ".join(str(int(size)) for size in sizes) or "none"
        raise ReportError(f"--detail_batch_size {detail_batch_size}: no ok run at that batch size (there: {shown})")
    if quiet_only and not (runs["status"] == "ok")[~noisy(runs)].any():
        raise ReportError(
            f"--quiet_only: every ok run of {csv_path} carries a noise warning; nothing is left to report"
        )
    return runs


def write_report(
    csv_path: Path,
    out_dir: Path,
    plots_dir: Path,
    baseline: str | None,
    detail_batch_size: int | None = None,
    quiet_only: bool = False,
) -> list[Path]:
    """The tables, summary and plots; `baseline` (None: serial) compared with where the rows have it (report.py's
    command line refuses one they do not have, before this). `quiet_only`: the runs whose rows carry a noise warning
    are left out of every figure, verdict and plot."""
    runs = report_runs(csv_path, detail_batch_size=detail_batch_size, quiet_only=quiet_only)
    spoiled = noisy(runs)
    baseline = baseline or BASELINE_DESIGN.name
    out_dir.mkdir(parents=True, exist_ok=True)
    plots_dir.mkdir(parents=True, exist_ok=True)
    order = experiment_order(runs, baseline)
    summary = [
        f"# Summary of {csv_path.name}",
        "",
        f"{len(runs)} runs, {int((runs['status'] == 'ok').sum())} ok; mean +/- std over the ok repeats of "
        "each cell. Latencies in seconds, throughput in samples/s, GPU utilisation in percent.",
        "",
        *_noisy_runs_lines(int(spoiled.sum()), int((runs["status"] == "ok").sum()), quiet_only),
    ]
    if infinite := runs.attrs.get("infinite_figures"):
        summary += [f"{infinite} figure(s) of the CSV were infinite, which no run measures: read as missing.", ""]
    if quiet_only:
        runs = runs[~spoiled]
    load_column = load_axis_column(runs)
    written, cell_sections = _write_cell_tables(runs, order, baseline, load_column, out_dir)
    summary += cell_sections + _capacity_section(runs, order, load_column)
    summary += _noise_section(runs, load_column) + _failed_section(runs, load_column)
    plots, gpu_note = write_plots(runs, order, csv_path, plots_dir, detail_batch_size, load_column)
    summary += gpu_note
    summary += ["## Plots", ""] + [f"![{p.stem}]({os.path.relpath(p, out_dir)})" for p in plots] + [""]
    (out_dir / "summary.md").write_text("\n".join(summary))
    return written + [out_dir / "summary.md"] + plots


def _noisy_runs_lines(spoiled: int, ok: int, quiet_only: bool) -> list[str]:
    """How many runs the machine spoiled (their rows' noise warning), and whether they are in the figures."""
    if not spoiled:
        return []
    if quiet_only:
        return [
            f"**{spoiled} of the {ok} ok runs were left out (--quiet_only)**: their rows say the machine may have "
            "made their numbers (`noise_warning`). Every table, verdict and plot below is of the quiet runs.",
            "",
        ]
    return [
        f"**{spoiled} of the {ok} ok runs carry a noise warning** (their rows' `noise_warning`: the machine may "
        'have made their numbers); they are in the figures below, counted per cell as "noisy". '
        "`report.py --quiet_only` leaves them out.",
        "",
    ]


def _write_cell_tables(
    runs: pd.DataFrame, order: list[str], baseline: str, load_column: str | None, out_dir: Path
) -> tuple[list[Path], list[str]]:
    """One table per cell (batch size, compile and, with a load axis, load point) written to its own file; the files,
    and the summary's sections of them, each with its comparison against the baseline where the cell has it."""
    written: list[Path] = []
    summary: list[str] = []
    # With a load axis a cell is one load point: a mean over rates is no figure, and their spread no noise.
    for keys, cell in runs.groupby(["batch_size", "compile", *_listed(load_column)], sort=True, dropna=False):
        batch_size, compiled = keys[:2]
        point = _point_text(load_column, keys)
        table = cell_table(cell, order)
        tag = f"_{'rate' if load_column == 'offered_rate_rps' else 'conc'}{keys[-1]:g}" if point else ""
        name = f"output_{batch_size}_{str(compiled).lower()}{tag}.md"
        (out_dir / name).write_text(table)
        written.append(out_dir / name)
        summary += [f"## batch size {batch_size}, compile {'on' if compiled else 'off'}{point}", "", table]
        if (cell["experiment"] == baseline).any() and cell["experiment"].nunique() > 1:
            summary += [comparison_table(cell, order, baseline)]
    return written, summary


def _capacity_section(runs: pd.DataFrame, order: list[str], load_column: str | None) -> list[str]:
    """With a load axis: each experiment's highest load point within the SLO."""
    capacity = slo_capacity_table(runs, order, load_column) if load_column else None
    if not capacity:
        return []
    name = LOAD_AXES[load_column][0]
    return [
        f"## Highest {name} within the SLO",
        "",
        f"The highest {name} at which the p99 latency of every ok repeat met the SLO, and that of every "
        f"lower {name} too (none: not even the lowest); achieved throughput there is the mean over its "
        f"repeats. A {name} without an ok run counts as over.",
        "",
        capacity,
    ]


def _noise_section(runs: pd.DataFrame, load_column: str | None) -> list[str]:
    """The experiments whose repeats spread too far, also warned of on stderr."""
    warnings = spread_warnings(runs, load_column)
    for line in warnings:
        print(f"report.py: warning: {line}", file=sys.stderr)
    if not warnings:
        return []
    return ["## Noisy experiments", ""] + [f"- {line}" for line in warnings] + [""]


def _failed_section(runs: pd.DataFrame, load_column: str | None) -> list[str]:
    """A table of the runs whose status is not ok, with their error."""
    failed = runs[runs["status"] != "ok"]
    if failed.empty:
        return []
    point_title = [f"{LOAD_AXES[load_column][0]} ({LOAD_AXES[load_column][1]})"] if load_column else []
    header = ["experiment", "batch size", "compile", *point_title, "repeat", "status", "error"]
    lines = ["## Runs that did not complete", "", *table_head(header)]
    for _, row in failed.iterrows():
        error = str(row.get("error", "")).replace("|", "/")[:160]
        point = [f"{row[load_column]:g}" if row[load_column] == row[load_column] else ""] if load_column else []
        cells = [row["experiment"], row["batch_size"], row["compile"], *point, row.get("repeat", ""), row["status"]]
        lines.append("| " + " | ".join(str(v) for v in [*cells, error]) + " |")
    lines.append("")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = OneLineErrorParser(prog="report.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("csv", type=Path, help="a results CSV written by server.py (e.g. a sweep's runs.csv)")
    parser.add_argument(
        "--out_dir", type=Path, default=None, help="where the markdown goes (default: the CSV's folder)"
    )
    parser.add_argument(
        "--plots_dir", type=Path, default=None, help="where the PNGs go (default: plots/<name of the CSV's folder>)"
    )
    parser.add_argument("--baseline", default=None, help="experiment the others are compared with (default serial)")
    parser.add_argument(
        "--detail_batch_size",
        type=int,
        default=None,
        help="batch size of the latency CDF and the stage breakdown (default: the largest)",
    )
    parser.add_argument(
        "--quiet_only",
        action="store_true",
        help="leave out the runs whose rows carry a noise warning (the machine may have made their numbers): every "
        "table, verdict and plot is then of the quiet runs",
    )
    parser.add_argument(
        "--pytorch_benchmark",
        type=Path,
        default=None,
        metavar="DIR",
        help="instead of the report: convert the CSV's rows into PyTorch OSS benchmark database records, "
        "DIR/<CSV stem>.pytorch.json",
    )
    args = parser.parse_args(argv)
    try:  # every argument before any folder is made
        source = check_arguments(args)
    except (ReportError, ConfigError) as exc:
        print(f"report.py: error: {exc}", file=sys.stderr)
        return 2
    if (warning := source.cut_line_warning(args.csv)) is not None:
        print(f"report.py: warning: {warning}", file=sys.stderr)
    if args.pytorch_benchmark is not None:
        return write_benchmark_records(args.csv, source, args.pytorch_benchmark)
    plots_dir = args.plots_dir or default_plots_dir(args.csv)
    for path in write_report(
        args.csv, args.out_dir or args.csv.parent, plots_dir, args.baseline, args.detail_batch_size, args.quiet_only
    ):
        print(path)
    return 0


def check_arguments(args: argparse.Namespace) -> RunCsv:
    """The CSV as a results CSV, and the output folders (and a records file already there) as ones this command
    may write; ReportError or ConfigError, before anything is made."""
    check_path_names("the CSV", str(args.csv), "a file")  # a name too long for the system to look up at all
    if (kind := other_kind(args.csv, None)) is not None or not args.csv.exists():
        raise ReportError(kind or f"{args.csv}: no such file")
    if args.pytorch_benchmark is not None:  # conversion only: rows of several configurations are fine
        check_output_folder("--pytorch_benchmark", args.pytorch_benchmark)
        source = read_run_csv(args.csv)
        target = json_path(args.pytorch_benchmark / args.csv.name)
        try:  # replaced when it holds records (of an earlier conversion); anything else is not this tool's
            check_records_file(target)
        except ValueError as exc:
            raise ReportError(str(exc)) from None
        except OSError as exc:
            raise ReportError(f"{target}: cannot read it ({exc.strerror})") from None
        return source
    for flag, folder in (("--out_dir", args.out_dir), ("--plots_dir", args.plots_dir)):
        check_output_folder(flag, folder or args.csv.parent)
    report_runs(args.csv, args.baseline, args.detail_batch_size, args.quiet_only)
    return read_run_csv(args.csv)


def write_benchmark_records(csv_path: Path, source: RunCsv, out_dir: Path) -> int:
    """--pytorch_benchmark: serverbench.records.benchmark_db's records of every row, so old results upload too."""
    path = json_path(out_dir / csv_path.name)
    try:
        count = write_records(path, source.rows)
    except OSError as exc:
        print(f"report.py: error: {path}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    print(f"{count} records (one per headline metric of each row) in {path}")
    return 0


PLOTS_SOURCE = ".source"  # in a default plots folder: the CSV whose plots it holds


def default_plots_dir(csv_path: Path, checkout: Path | None = None) -> Path:
    """plots/<name of the CSV's folder> in the checkout, unless that folder holds another CSV's plots: then
    plots/<name>-<hash of the CSV's path>, so that two reports never overwrite each other's plots. The folder
    remembers its CSV (PLOTS_SOURCE)."""
    import hashlib

    root = checkout or Path(__file__).resolve().parent
    resolved = csv_path.resolve()
    # Relative to the checkout when inside it, so that another clone's report finds its own plots folder.
    source = str(resolved.relative_to(root)) if resolved.is_relative_to(root) else str(resolved)
    plots = root / "plots"
    folder = plots / csv_path.resolve().parent.name
    marker = folder / PLOTS_SOURCE
    if marker.exists() and marker.read_text().strip() != source:
        folder = plots / f"{folder.name}-{hashlib.sha1(source.encode()).hexdigest()[:8]}"
        print(
            f"report.py: plots/{csv_path.resolve().parent.name} holds another CSV's plots; these go to {folder}",
            file=sys.stderr,
        )
    folder.mkdir(parents=True, exist_ok=True)
    (folder / PLOTS_SOURCE).write_text(source + "\n")
    return folder


if __name__ == "__main__":
    sys.exit(main())
