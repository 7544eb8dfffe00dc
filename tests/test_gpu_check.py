"""bench.gpu_check: without a GPU it refuses in one line; --dry_run runs its whole plan on the CPU and writes the
summary, the rows behind every check and the plots."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
from conftest import run_command


def _gpu_check(*args: str, timeout_s: float = 240) -> subprocess.CompletedProcess:
    """bench.gpu_check to its end, in a session of its own killed at the test's end; the whole dry run took 64 s
    on the 2-core VM, so 240 s holds a machine twice as slow and stays below pytest's 300 s."""
    return run_command([sys.executable, "-m", "bench.gpu_check", *args], timeout_s=timeout_s)


def test_without_a_gpu_it_exits_2_at_once_with_one_line(tmp_path: Path) -> None:
    run = _gpu_check("--out", str(tmp_path / "gpu"), timeout_s=120)
    assert run.returncode == 2, run.stdout + run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_check: ") and "--dry_run" in lines[0]
    assert not (tmp_path / "gpu").exists()


def test_the_dry_run_runs_every_check_and_writes_the_summary(tmp_path: Path) -> None:
    out = tmp_path / "gpu_dry"
    run = _gpu_check("--dry_run", "--out", str(out))
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    checks = json.loads((out / "checks.json").read_text())
    assert list(checks) == [
        "cuda_tests",
        "verify",
        "race",
        "bandwidth",
        "overlap",
        "compile",
        "your_model",
        "cpu_load",
        "nvtx",
        "compare",
        "sweep",
    ]
    statuses = {name: c["status"] for name, c in checks.items()}
    assert statuses == {
        "cuda_tests": "not run",
        "verify": "pass",
        "race": "pass",
        "bandwidth": "not run",
        "overlap": "info",
        "compile": "pass",
        "your_model": "pass",
        "cpu_load": "info",
        "nvtx": "info",
        "compare": "pass",
        "sweep": "pass",
    }

    # Each data path was verified against the serial answers, on one design each: uint8 requests, bf16, dynamic
    # batching (the GPU plan: every path on every design, also float32 requests and the queue transport, which
    # test_verify covers on the CPU).
    verify = pd.read_csv(out / "verify" / "runs.csv")
    assert len(verify) == 3 and set(verify["status"]) == {"ok"} and verify["wrong_outputs"].eq(0).all()
    assert verify["max_abs_error"].le(1e-4).all()  # the CPU is deterministic, formed batches to rounding
    assert set(zip(verify["design"], verify["precision"], verify["max_batch_size"].fillna(0))) == {
        ("serial", "default", 0),
        ("threaded", "bf16", 0),
        ("pipelined", "default", 8),
    }
    race = pd.read_csv(out / "race" / "runs.csv")  # the planted buffer race, caught by --verify each time
    assert set(race["status"]) == {"wrong_output"} and len(race) == 1 and race["wrong_outputs"].gt(0).all()
    assert race["error"].str.contains("differ from the serial reference").all()
    assert race["responses_received"].eq(20).all()  # it ran to the end: only its answers were wrong
    # The example model (two int64 inputs, a dict of two outputs), eager and AOTInductor, every leaf verified.
    your_model = pd.read_csv(out / "your_model" / "runs.csv")
    assert len(your_model) == 5 and set(your_model["status"]) == {"ok"} and your_model["wrong_outputs"].eq(0).all()
    assert sorted(your_model["compile_path"]) == ["aoti", "aoti", "eager", "eager", "eager"]
    assert sorted(your_model["aoti_runners"].dropna()) == [8, 8]  # one per request held (--max_inflight 8)
    cpu_load = pd.read_csv(out / "cpu_load" / "runs.csv")
    assert list(cpu_load["spin_wait"]) == [False, True] and cpu_load["backend_cpu_cores"].gt(0).all()

    summary = (out / "summary.md").read_text()
    assert "dry run on the CPU" in summary and "| cuda tests | **not run** | needs a GPU |" in summary
    assert "| verify every data path | **pass** | 3/3 runs gave the serial answers" in summary
    assert (out / "compare" / "compare.md").exists() and (out / "sweep" / "summary.md").exists()
    assert {p.name for p in (out / "plots" / "sweep").glob("*.png")} >= {"throughput_vs_batch_size.png"}
    assert list((out / "plots" / "compare").glob("*.png"))


def test_only_runs_the_named_checks_and_keeps_the_others_results(tmp_path: Path) -> None:
    out = tmp_path / "gpu_dry"
    out.mkdir()
    earlier = {"verify": {"name": "verify every data path", "status": "pass", "detail": "15/15", "where": ""}}
    (out / "checks.json").write_text(json.dumps(earlier))
    run = _gpu_check("--dry_run", "--out", str(out), "--only", "cuda_tests", "bandwidth")
    assert run.returncode == 0, run.stderr[-3000:]
    checks = json.loads((out / "checks.json").read_text())
    assert set(checks) == {"verify", "cuda_tests", "bandwidth"} and checks["verify"]["detail"] == "15/15"
    assert not (out / "race").exists()


def test_the_nvtx_check_runs_one_nvtx_run_and_on_the_cpu_no_profile(tmp_path: Path) -> None:
    out = tmp_path / "gpu_dry"
    run = _gpu_check("--dry_run", "--out", str(out), "--only", "nvtx")
    assert run.returncode == 0, run.stderr[-3000:]
    check = json.loads((out / "checks.json").read_text())["nvtx"]
    assert check["status"] == "info" and "no nsys profile (the CPU's ranges are no-ops)" in check["detail"]
    assert (out / "nvtx" / "runs.csv").exists() and not (out / "nvtx" / "profile.nsys-rep").exists()
