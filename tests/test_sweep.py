"""A mini sweep on the CPU through sweep.sh: tables and plots, resume, and a failing cell that does not stop it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd

from conftest import ROOT, TINY, run_server

SERVER_FLAGS = ["--", "--device", "cpu", "--model", "identity", "--image_size", "16", "--num_iters", "4"]


def _sweep(out: Path, plots: Path, env: dict[str, str], *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(["./sweep.sh", "--plots_dir", str(plots), *extra, *SERVER_FLAGS], cwd=ROOT,
                          env={**os.environ, "PYTHON": sys.executable, "OUT": str(out), **env},
                          capture_output=True, text=True, timeout=400)


def test_mini_sweep_writes_tables_and_plots_then_resumes_without_rerunning(tmp_path: Path) -> None:
    out, plots = tmp_path / "sweep", tmp_path / "plots"
    # One repeat per cell keeps it short; the failing-cell test below runs two.
    env = {"BATCH_SIZES": "2 4", "COMPILE": "false", "DESIGNS": "serial pipelined", "WORKERS": "2", "REPEATS": "1"}
    first = _sweep(out, plots, env)
    assert first.returncode == 0, first.stdout + first.stderr
    runs = pd.read_csv(out / "runs.csv")
    assert len(runs) == 4 and set(runs["status"]) == {"ok"}
    assert sorted(runs.groupby(["experiment", "batch_size"]).size().tolist()) == [1, 1, 1, 1]
    assert "[4/4]" in first.stdout and "left ~" in first.stdout
    for name in ("output_2_false.md", "output_4_false.md", "summary.md"):
        assert (out / name).exists()
    assert "| serial |" in (out / "output_4_false.md").read_text()
    assert "pipelined_2w" in (out / "summary.md").read_text()
    assert {p.name for p in plots.glob("*.png")} >= {"throughput_vs_batch_size.png", "avg_latency_vs_batch_size.png",
                                                     "latency_cdf_bs4.png", "stage_breakdown_bs4.png"}
    assert all((out / f).exists() for f in runs["requests_file"])  # the CDF's per-request lines

    again = _sweep(out, plots, env)
    assert again.returncode == 0, again.stderr
    assert "4 already done" in again.stdout and "[" not in again.stdout.split("already done", 1)[1].split("sweep:")[0]
    assert len(pd.read_csv(out / "runs.csv")) == 4  # nothing ran again


def test_a_failing_cell_is_recorded_and_the_sweep_finishes(tmp_path: Path) -> None:
    out, plots = tmp_path / "sweep", tmp_path / "plots"
    env = {"BATCH_SIZES": "2", "COMPILE": "false", "DESIGNS": "serial", "REPEATS": "2"}
    run = _sweep(out, plots, env, "--experiment", "broken=--design pipelined --inject_fault predict")
    assert run.returncode == 1
    runs = pd.read_csv(out / "runs.csv")
    assert sorted(zip(runs["experiment"], runs["status"])) == [("broken", "error")] * 2 + [("serial", "ok")] * 2
    assert "2 cell(s) did not complete" in run.stdout and "broken bs=2" in run.stdout
    summary = (out / "summary.md").read_text()
    assert "Runs that did not complete" in summary and "injected fault" in summary


def test_trace_writes_a_timeline_with_a_lane_per_thread(tmp_path: Path) -> None:
    run = run_server([*TINY, "--model", "identity", "--num_workers", "2", "--trace"], tmp_path)
    assert run.returncode == 0, run.stderr
    trace = json.loads((tmp_path / run.row["timeline_trace"]).read_text())
    lanes = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert {"sender", "receiver", "h2d", "d2h", "predict-0"} <= lanes
    forwards = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["name"].startswith("forward")]
    assert len(forwards) == 6 + 1  # every measured request and the warm-up
