"""The reference's own client still drives this server: runner.sh's command lines (`python -W ignore server.py
--batch_size B --output_file output_B_C.csv --compile|--no-compile`, rows appended under ./results) and
process_metrics.py's reading of them (the mean and standard deviation of warmup_latency, average_latency,
throughput and gpu_util per file). Tiny flags are appended so that it runs in seconds on the CPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pandas as pd
from conftest import ROOT

TINY_TAIL = ["--device", "cpu", "--model", "identity", "--image_size", "16", "--num_iters", "8", "--no-ceiling"]
PROCESS_METRICS = ["warmup_latency", "average_latency", "throughput", "gpu_util"]


def runner_command(batch_size: int, compile_: bool) -> list[str]:
    """One line of runner.sh, as it spells it, then the tiny flags."""
    output_file = f"output_{batch_size}_{str(compile_).lower()}.csv"
    compile_flag = "--compile" if compile_ else "--no-compile"
    return [sys.executable, "-W", "ignore", str(ROOT / "server.py"), "--batch_size", str(batch_size)] + [
        "--output_file",
        output_file,
        compile_flag,
        *TINY_TAIL,
    ]


def test_runner_sh_lines_and_process_metrics_columns_still_work(tmp_path: Path) -> None:
    runs = [(1, False), (1, False), (4, True)]
    for batch_size, compile_ in runs:
        proc = subprocess.run(
            runner_command(batch_size, compile_), cwd=tmp_path, capture_output=True, text=True, timeout=240
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
    for batch_size, compile_ in set(runs):
        # process_metrics.py: pd.read_csv("./results/" + file), then mean and std of its four columns.
        frame = pd.read_csv(tmp_path / "results" / f"output_{batch_size}_{str(compile_).lower()}.csv")
        assert len(frame) == runs.count((batch_size, compile_))
        assert (frame["batch_size"] == batch_size).all() and (frame["compile"] == compile_).all()
        means = {metric: frame[metric].mean() for metric in PROCESS_METRICS}
        assert means["warmup_latency"] > 0 and means["average_latency"] > 0 and means["throughput"] > 0
        assert frame["average_latency"].between(frame["min_latency"], frame["max_latency"]).all()
        if len(frame) > 1:
            assert frame["throughput"].std() >= 0  # two rows: process_metrics' "+/-" has a value
