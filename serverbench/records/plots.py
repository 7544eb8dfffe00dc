"""The report's PNG plots of a results CSV's runs: which plots a report draws (`write_plots`), and each one."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from serverbench.config.loads import SWEEP_LOADS, sweep_kind

STAGE_COLUMNS = {
    "mean_request_queue_ms": "request queue",
    "mean_batch_wait_ms": "batcher",
    "mean_h2d_ms": "H2D",
    "mean_predict_ms": "forward",
    "mean_d2h_ms": "D2H",
    "mean_response_queue_ms": "return",
}
OPTIONAL_STAGE_COLUMNS = ("mean_batch_wait_ms",)  # rows from before dynamic batching have no batcher: 0
# The load axes of a sweep, as the loads declare them: row column -> (how a point is named, its unit).
LOAD_AXES = {kind.sweep_axis.column: (kind.sweep_axis.name, kind.sweep_axis.unit) for kind in SWEEP_LOADS}


def load_point_label(column: str, value: float) -> str:
    """offered 20 req/s, concurrency 4."""
    return f"offered {value:g} req/s" if column == "offered_rate_rps" else f"concurrency {value:g}"


def pyplot():
    """matplotlib's pyplot drawing to files (Agg), never to a display."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _finish(ax, xlabel: str, ylabel: str, title: str) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)


def save_figure(fig, path: Path) -> None:
    """The figure laid out, written to `path`, and closed."""
    plt = pyplot()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_against_batch_size(
    runs: pd.DataFrame, order: Sequence[str], column: str, ylabel: str, title: str, path: Path
) -> None:
    """One line per experiment with std error bars, one panel per compile value (the reference's two plots)."""
    plt = pyplot()
    ok = runs[runs["status"] == "ok"]
    compiles = sorted(ok["compile"].dropna().unique())
    fig, axes = plt.subplots(1, max(1, len(compiles)), figsize=(6.5 * max(1, len(compiles)), 4.5), squeeze=False)
    for ax, compiled in zip(axes[0], compiles):
        cell = ok[ok["compile"] == compiled]
        for name in order:
            stats = cell[cell["experiment"] == name].groupby("batch_size")[column].agg(["mean", "std"]).fillna(0)
            if stats.empty:
                continue
            ax.errorbar(stats.index, stats["mean"], yerr=stats["std"], marker="o", capsize=3, label=name)
        ax.set_xscale("log", base=2)
        ticks = sorted(cell["batch_size"].unique())
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.minorticks_off()
        _finish(ax, "batch size (images per request)", ylabel, f"{title}, compile {'on' if compiled else 'off'}")
    save_figure(fig, path)


def plot_latency_cdf(
    runs: pd.DataFrame, order: Sequence[str], batch_size: int, compiled: bool, root: Path, path: Path, where: str = ""
) -> bool:
    """Distribution of per-request latency per experiment, pooled over its runs; needs --save_requests files."""
    plt = pyplot()
    cell = runs[(runs["status"] == "ok") & (runs["batch_size"] == batch_size) & (runs["compile"] == compiled)]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    drawn = False
    for name in order:
        files = cell.loc[cell["experiment"] == name, "requests_file"].dropna() if "requests_file" in cell else []
        latencies = [pd.read_csv(root / f).query("not warmup")["latency_s"] for f in files if (root / f).exists()]
        if not latencies:
            continue
        values = np.sort(pd.concat(latencies).to_numpy()) * 1e3
        ax.step(values, np.arange(1, len(values) + 1) / len(values), where="post", label=f"{name} ({len(values)} req)")
        drawn = True
    if drawn:
        ax.set_xscale("log")
        _finish(
            ax,
            "latency (ms, log scale)",
            "fraction of requests",
            f"Latency distribution, batch {batch_size}, compile {'on' if compiled else 'off'}{where}",
        )
        save_figure(fig, path)
    else:
        plt.close(fig)
    return drawn


def plot_stage_breakdown(
    runs: pd.DataFrame, order: Sequence[str], batch_size: int, compiled: bool, path: Path, where: str = ""
) -> bool:
    """Where a request's time goes, per experiment: stacked mean spans that add up to the mean latency."""
    plt = pyplot()
    cell = runs[(runs["status"] == "ok") & (runs["batch_size"] == batch_size) & (runs["compile"] == compiled)]
    names = [n for n in order if (cell["experiment"] == n).any()]
    cell = cell.assign(**{c: 0.0 for c in OPTIONAL_STAGE_COLUMNS if c not in cell.columns})
    if not names or not set(STAGE_COLUMNS) <= set(cell.columns):
        return False
    means = cell.groupby("experiment")[list(STAGE_COLUMNS)].mean().loc[names]
    fig, ax = plt.subplots(figsize=(8, 0.6 * len(names) + 2))
    left = np.zeros(len(names))
    for column, label in STAGE_COLUMNS.items():
        ax.barh(names, means[column], left=left, label=label)
        left += means[column].to_numpy()
    ax.set_xlabel("mean time per request (ms)")
    ax.set_title(f"Where a request's time goes, batch {batch_size}, compile {'on' if compiled else 'off'}{where}")
    ax.invert_yaxis()
    ax.legend(fontsize=8, ncol=5, loc="upper center", bbox_to_anchor=(0.5, -0.25))
    save_figure(fig, path)
    return True


def plot_latency_throughput(
    cell: pd.DataFrame, order: Sequence[str], load_column: str, axis: tuple[str, str], title: str, path: Path
) -> bool:
    """The latency-throughput curve that Triton's Model Analyzer and vLLM's benchmark draw: per experiment, p99
    (solid) and p50 (dashed) latency against achieved throughput, a point per load point (mean over the ok repeats,
    std error bars both ways) labelled with its offered load (`axis`: its name and unit); the SLO as a horizontal
    line where the rows have one."""
    ok = cell[(cell["status"] == "ok") & cell[load_column].notna()]
    if ok.empty or not {"p50_latency_s", "p99_latency_s"} <= set(ok.columns):
        return False
    # Only the columns drawn: a new column on a row frame of hundreds printed pandas' PerformanceWarning
    ok = ok[
        [
            "experiment",
            load_column,
            "throughput",
            "p50_latency_s",
            "p99_latency_s",
            *(["slo_ms"] if "slo_ms" in ok else []),
        ]
    ]
    ok = ok.assign(p50_ms=ok["p50_latency_s"] * 1e3, p99_ms=ok["p99_latency_s"] * 1e3)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    names = [n for n in order if (ok["experiment"] == n).any()]
    for index, name in enumerate(names):
        stats = (
            ok[ok["experiment"] == name]
            .groupby(load_column)[["throughput", "p50_ms", "p99_ms"]]
            .agg(["mean", "std"])
            .fillna(0)
        )  # one repeat: no spread to draw
        x, x_err = stats[("throughput", "mean")], stats[("throughput", "std")]
        for percentile, style in (("p99", "-"), ("p50", "--")):
            ax.errorbar(
                x,
                stats[(f"{percentile}_ms", "mean")],
                xerr=x_err,
                yerr=stats[(f"{percentile}_ms", "std")],
                color=f"C{index}",
                linestyle=style,
                marker="o",
                markersize=4,
                capsize=3,
                label=f"{name} {percentile}",
            )
        for value, x_point, y_point in zip(stats.index, x, stats[("p99_ms", "mean")]):
            ax.annotate(
                f"{value:g}",
                (x_point, y_point),
                textcoords="offset points",
                xytext=(4, 4),
                fontsize=7,
                color=f"C{index}",
            )
    for slo_ms in sorted(ok["slo_ms"].dropna().unique()) if "slo_ms" in ok.columns else []:
        ax.axhline(slo_ms, color="black", linestyle=":", linewidth=1.2, label=f"SLO {slo_ms:g} ms")
    ax.set_yscale("log")  # latency grows by orders of magnitude past saturation
    name, unit = axis
    _finish(
        ax,
        "achieved throughput (samples/s)",
        "latency (ms, log scale)",
        f"{title}\np99 solid, p50 dashed; points labelled with the offered {name} ({unit})",
    )
    save_figure(fig, path)
    return True


def plot_gpu_over_time(runs: pd.DataFrame, root: Path, path: Path) -> str | None:
    """GPU utilisation and memory over time for one run: the ok run with the most GPU samples."""
    if "gpu_samples_file" not in runs.columns or "gpu_samples" not in runs.columns:
        return None
    candidates = runs[(runs["status"] == "ok") & (runs["gpu_samples"].fillna(0) > 0)]
    # A CSV copied away from its folder (a bundle's runs.csv alone) has no samples beside it: no plot, no crash.
    candidates = candidates[[(root / str(name)).is_file() for name in candidates["gpu_samples_file"]]]
    if candidates.empty:
        return None
    run = candidates.sort_values("gpu_samples").iloc[-1]
    samples = pd.read_csv(root / run["gpu_samples_file"])
    plt = pyplot()
    t_s = (samples["t_ns"] - samples["t_ns"].min()) / 1e9
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(t_s, samples["util_pct"], label="utilisation (%)")
    ax.set_xlabel("time since the measured phase began (s)")
    ax.set_ylabel("GPU utilisation (%)")
    ax.set_ylim(0, 105)
    twin = ax.twinx()
    twin.plot(t_s, samples["mem_used_mib"] / 1024, color="tab:orange", label="memory used (GiB)")
    twin.set_ylabel("GPU memory used (GiB)")
    label = f"{run['experiment']}, batch {run['batch_size']}, compile {'on' if run['compile'] else 'off'}"
    ax.set_title(f"GPU over time: {label}")
    save_figure(fig, path)
    return label


def plot_context(runs: pd.DataFrame) -> str:
    """What every plot's title says of the runs: the model, its input size, the device and the load (one
    configuration per report: report_runs refuses a CSV that pools several)."""
    first = runs.iloc[0]
    size = first.get("image_size")
    parts = [
        str(first.get("model", "")) + (f" {int(size)}x{int(size)}" if pd.notna(size) and str(size) != "" else ""),
        str(first.get("device", "")),
        str(first.get("load", "")),
    ]
    return ", ".join(part for part in parts if part and part != "nan")


def write_plots(
    runs: pd.DataFrame,
    order: list[str],
    csv_path: Path,
    plots_dir: Path,
    detail_batch_size: int | None,
    load_column: str | None,
) -> tuple[list[Path], list[str]]:
    """Throughput and latency against batch size; the latency CDF and the stage breakdown at one batch size (by
    default the largest with an ok run); with a load axis, latency against throughput per batch size and compile;
    GPU utilisation over time. The plots written, and the summary's note of why there is no GPU plot."""
    plots = []
    ok = runs[runs["status"] == "ok"]
    context = plot_context(runs)
    # With a load axis, each load point's figures apart: a mean over rates is no figure.
    points = sorted(ok[load_column].dropna().unique()) if load_column else [None]
    for point in points:
        at_point = runs if point is None else runs[runs[load_column] == point]
        tag = "" if point is None else f"_{sweep_kind(load_column).sweep_axis.tag}{point:g}"
        where = f" ({context}" + ("" if point is None else f", {load_point_label(load_column, point)}") + ")"
        for column, ylabel, title, stem in (
            ("throughput", "throughput (samples/s)", "Throughput", "throughput"),
            ("average_latency", "average latency (s)", "Average latency", "avg_latency"),
        ):
            if column not in at_point.columns:  # a CSV of the reference's, or one cut by hand: no such figure
                continue
            path = plots_dir / f"{stem}_vs_batch_size{tag}.png"
            plot_against_batch_size(at_point, order, column, ylabel, title + where, path)
            plots.append(path)
        ok_here = at_point[at_point["status"] == "ok"]
        if ok_here.empty:
            continue
        batch_size = detail_batch_size if detail_batch_size is not None else int(ok_here["batch_size"].max())
        at_size = ok_here["batch_size"] == batch_size
        compiled = bool(ok_here.loc[at_size, "compile"].min()) if at_size.any() else False
        cdf = plots_dir / f"latency_cdf_bs{batch_size}{tag}.png"
        if plot_latency_cdf(at_point, order, batch_size, compiled, csv_path.parent, cdf, where):
            plots.append(cdf)
        stages = plots_dir / f"stage_breakdown_bs{batch_size}{tag}.png"
        if plot_stage_breakdown(at_point, order, batch_size, compiled, stages, where):
            plots.append(stages)
    if load_column:
        curve_cells = list(ok[ok[load_column].notna()].groupby(["batch_size", "compile"], sort=True))
        for (batch_size, compiled), cell in curve_cells:
            stem = "latency_throughput" + ("" if len(curve_cells) == 1 else f"_bs{batch_size}_{str(compiled).lower()}")
            path = plots_dir / f"{stem}.png"
            title = f"Latency against throughput, batch {batch_size}, compile {'on' if compiled else 'off'} ({context})"
            if plot_latency_throughput(cell, order, load_column, LOAD_AXES[load_column], title, path):
                plots.append(path)
    gpu_path = plots_dir / "gpu_over_time.png"
    if plot_gpu_over_time(runs, csv_path.parent, gpu_path):
        return [*plots, gpu_path], []
    if "gpu_util" in runs.columns and runs["gpu_util"].notna().any():
        note = "The rows have GPU utilisation (`gpu_util`) but no per-sample files (`--save_requests`): no "
        return plots, [note + "GPU-over-time plot.", ""]
    return plots, ["No GPU samples in these runs (CPU runs, or NVML unavailable): no GPU-over-time plot.", ""]
