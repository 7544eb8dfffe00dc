"""A mini sweep on the CPU through sweep.sh: tables and plots, resume, and a failing cell that does not stop it."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pytest
from conftest import (
    ROOT,
    communicate_or_fail,
    kill_session,
    new_shm_entries,
    outlive_the_test,
    pids_running,
    run_command,
    shm_entries,
    start_session,
)

from serverbench.launch import study
from serverbench.system import process

SERVER_FLAGS = ["--", "--device", "cpu", "--model", "identity", "--image_size", "16", "--num_iters", "4"]
SERVER_FLAGS += ["--no-ceiling"]  # the ceiling (1 s per concurrency, before and after) is not what a sweep is about
BROKEN = "broken=--design pipelined --inject_fault predict"


def _sweep(out: Path, plots: Path, env: dict[str, str], *extra: str) -> subprocess.CompletedProcess:
    """sweep.sh to its end within 130 s (two of them fit in pytest's 300 s: this bound is the one that fires);
    every run traced."""
    cmd = ["./sweep.sh", "--plots_dir", str(plots), *extra, *SERVER_FLAGS, "--trace"]
    return run_command(cmd, timeout_s=130, env={"PYTHON": sys.executable, "OUT": str(out), **env})


@dataclass(frozen=True)
class TimedOutSweep:
    out: Path
    proc: subprocess.Popen
    shm_before: set[str]  # /dev/shm's entries before it started


@pytest.fixture(scope="module")
def timed_out_sweep(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TimedOutSweep]:
    """A sweep of one long cell (two backend instances, 5 requests/s) that its 5 s cell timeout stops, started in
    the background: the mini sweep's runs fill its wait (the test of the timeout comes right after them, so that
    /dev/shm is looked at before any other run)."""
    folder = tmp_path_factory.mktemp("timeout")
    out = folder / "sweep"
    shm_before = shm_entries()
    args = ["--out", str(out), "--plots_dir", str(folder / "plots"), "--batch_sizes", "1", "--compile", "false"]
    args += ["--designs", "serial", "--repeats", "1", "--cell_timeout_s", "5", "--", "--device", "cpu", "--model"]
    args += ["identity", "--image_size", "16", "--no-ceiling", "--load", "poisson", "--rate", "5", "--num_iters"]
    args += ["1000", "--instances", "2"]
    proc = start_session([sys.executable, "sweep.py", *args], ROOT, None)
    outlive_the_test(proc.pid)  # it ends at its test, or here
    try:
        yield TimedOutSweep(out, proc, shm_before)
    finally:
        if proc.poll() is None:
            kill_session(proc.pid)
        proc.communicate()


@dataclass(frozen=True)
class Swept:
    out: Path
    plots: Path
    first: subprocess.CompletedProcess
    again: subprocess.CompletedProcess  # the same command once more: a resume with nothing left to do


@pytest.fixture(scope="module")
def swept(tmp_path_factory: pytest.TempPathFactory, timed_out_sweep: TimedOutSweep) -> Swept:
    """One mini sweep through sweep.sh, then the same command again: serial, pipelined_2w and an experiment whose
    forward fails (run between the two: the sweep goes on past it), one repeat each, every run traced. Its
    tables, plots, rows, failure report and traces, and the resume's. The cell-timeout sweep (its 5 s wait) was
    started first and runs meanwhile."""
    out, plots = tmp_path_factory.mktemp("sweep") / "sweep", tmp_path_factory.mktemp("plots")
    env = {"BATCH_SIZES": "2", "COMPILE": "false", "DESIGNS": "serial pipelined", "WORKERS": "2", "REPEATS": "1"}
    first = _sweep(out, plots, env, "--experiment", BROKEN)
    again = _sweep(out, plots, env, "--experiment", BROKEN)
    return Swept(out, plots, first, again)


def test_mini_sweep_writes_tables_and_plots_then_resumes_without_rerunning(swept: Swept) -> None:
    out, plots, first, again = swept.out, swept.plots, swept.first, swept.again
    assert first.returncode == 1, first.stdout + first.stderr  # its one failing cell's (the next test's)
    runs = pd.read_csv(out / "runs.csv")
    assert len(runs) == 3 and set(runs[runs["experiment"] != "broken"]["status"]) == {"ok"}
    assert sorted(runs.groupby(["experiment", "batch_size"]).size().tolist()) == [1, 1, 1]
    assert "[3/3]" in first.stdout and "left ~" in first.stdout
    for name in ("output_2_false.md", "summary.md"):
        assert (out / name).exists()
    assert "| serial |" in (out / "output_2_false.md").read_text()
    assert "pipelined_2w" in (out / "summary.md").read_text()
    assert {p.name for p in plots.glob("*.png")} >= {
        "throughput_vs_batch_size.png",
        "avg_latency_vs_batch_size.png",
        "latency_cdf_bs2.png",
        "stage_breakdown_bs2.png",
    }
    assert all((out / f).exists() for f in runs["requests_file"])  # the CDF's per-request lines

    assert again.returncode == 0, again.stderr  # nothing failed in this invocation (the failed cell is done)
    assert "3 already done" in again.stdout and "[" not in again.stdout.split("already done", 1)[1].split("sweep:")[0]
    assert len(pd.read_csv(out / "runs.csv")) == 3  # nothing ran again


def test_a_failing_cell_is_recorded_and_the_sweep_finishes(swept: Swept) -> None:
    run = swept.first
    assert run.returncode == 1
    runs = pd.read_csv(swept.out / "runs.csv")
    assert sorted(zip(runs["experiment"], runs["status"])) == [
        ("broken", "error"),
        ("pipelined_2w", "ok"),
        ("serial", "ok"),
    ]
    assert "1 cell(s) did not complete" in run.stdout and "broken bs=2" in run.stdout
    summary = (swept.out / "summary.md").read_text()
    assert "Runs that did not complete" in summary and "injected fault" in summary


def test_trace_writes_a_timeline_with_a_lane_per_thread(swept: Swept) -> None:
    """The pipelined cell's run (2 prediction threads), traced."""
    row = pd.read_csv(swept.out / "runs.csv").set_index("experiment").loc["pipelined_2w"]
    assert row["status"] == "ok" and int(row["num_workers"]) == 2
    trace = json.loads((swept.out / row["timeline_trace"]).read_text())
    lanes = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert {"sender", "receiver", "h2d", "d2h"} <= lanes
    # A lane per prediction thread that ran a forward: with few requests one of the two may have taken them all.
    assert {lane for lane in lanes if lane.startswith("predict-")} & {"predict-0", "predict-1"}
    forwards = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["name"].startswith("forward")]
    assert len(forwards) == int(row["num_iters"]) + int(row["warmup_iters"])  # every measured request and the warm-up


def test_a_cell_timeout_stops_the_server_as_an_interrupt_and_leaves_no_shared_memory(
    timed_out_sweep: TimedOutSweep,
) -> None:
    """The cell's server gets SIGTERM, not its whole group SIGKILL (which killed the resource tracker with it and
    left the ring and the run's semaphores in /dev/shm): it stops its children and writes its partial row."""
    out = timed_out_sweep.out
    _, stderr = communicate_or_fail(timed_out_sweep.proc, 120, "sweep.py")
    assert timed_out_sweep.proc.returncode == 1 and "Traceback" not in stderr, stderr
    statuses = pd.read_csv(out / "runs.csv")["status"].tolist()
    assert statuses == ["interrupted", "sweep_timeout"]  # the server's partial row, then the sweep's verdict
    assert _server_pids(out) == []
    assert new_shm_entries(timed_out_sweep.shm_before) == set()


# ------------------------------------------------------------------ usage errors, resume, lock, signals (issue 16)


@pytest.mark.parametrize(
    "argv,expected",
    [
        (["--cell_timeout_s", "0"], "--cell_timeout_s 0: must be a positive number of seconds"),
        (["--cell_timeout_s", "-1"], "--cell_timeout_s -1: must be a positive number of seconds"),
        (["--designs", "bogus"], "argument --designs: invalid choice: 'bogus'"),
        (
            ["--designs", "serial", "--experiment", "odd=--transport pigeon"],
            "experiment odd (batch 2): server.py would refuse: argument --transport: invalid choice: 'pigeon'",
        ),
        (["--designs", "serial", "--experiment", "slow=--timeout_s inf"], "--timeout_s inf: must be at most"),
        (["--designs", "serial", "--rates", "5", "--concurrency", "2"], "two load axes; a sweep takes one"),
        (["--designs", "serial", "--rates", "5", "-1"], "(batch 2, rate=-1 req/s): server.py would refuse: --rate -1"),
    ],
)
def test_usage_errors_end_the_sweep_in_one_line_before_anything_runs(
    tmp_path: Path, capsys, argv: list[str], expected: str
) -> None:
    import sweep

    out = tmp_path / "sweep"
    with pytest.raises(SystemExit) if "bogus" in argv else contextlib.nullcontext():
        assert sweep.main(["--out", str(out), "--batch_sizes", "2", "--compile", "false", *argv, *SERVER_FLAGS]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0], err
    assert not out.exists()


def test_a_resumed_sweep_runs_interrupted_cells_again_and_skips_finished_ones(tmp_path: Path) -> None:
    from serverbench.records.csv_store import append_row

    runs_csv = tmp_path / "runs.csv"
    for repeat, status in enumerate(["ok", "interrupted", "error"]):
        append_row(
            runs_csv, {"batch_size": 2, "compile": False, "status": status, "experiment": "serial", "repeat": repeat}
        )
    assert study.completed_keys(runs_csv, retry_failed=False) == {
        ("serial", 2, False, None, 0),
        ("serial", 2, False, None, 2),
    }
    assert study.completed_keys(runs_csv, retry_failed=True) == {("serial", 2, False, None, 0)}
    # A crash cut the last row: before its key (a NaN repeat, once a traceback) or after it (once counted done)
    whole = runs_csv.read_text()
    for cut in ("2,False,ok,ser", "2,False,ok,serial,3"):
        runs_csv.write_text(whole + cut)
        assert study.completed_keys(runs_csv, retry_failed=True) == {("serial", 2, False, None, 0)}, cut


def test_a_load_axis_adds_its_flags_to_each_cell_and_its_point_to_the_key_and_log_name(tmp_path: Path) -> None:
    import sweep

    serial = sweep.experiments_from(["serial"], [1], [])
    points = sweep.load_points([20, 0.1, 20], [])  # ascending, once each
    assert [p.value for p in points] == [0.1, 20.0]
    cells = sweep.plan(serial, [2], [False], repeats=2, seed=0, points=points)
    assert {c.key for c in cells if c.repeat == 0} == {("serial", 2, False, p, 0) for p in points}
    fast = next(c for c in cells if c.load_point.value == 20 and c.repeat == 1)
    args = fast.server_args(["--load", "burst"], tmp_path)
    assert args[args.index("--load", 2) :][:4] == ["--load", "poisson", "--rate", "20"]  # the axis wins
    assert fast.log_path(tmp_path).name == "serial_bs2_nc_rate20_r1.log"
    assert "rate=20 req/s" in fast.label()
    closed = sweep.plan(serial, [2], [False], 1, 0, sweep.load_points([], [4]))[0]
    assert closed.server_args([], tmp_path)[2:6] == ["--load", "closed", "--concurrency", "4"]
    assert closed.log_path(tmp_path).name == "serial_bs2_nc_conc4_r0.log"
    assert sweep.plan(serial, [2], [False], 1, 0) == sweep.plan(serial, [2], [False], 1, 0, [None])  # no axis
    with pytest.raises(ValueError, match="two load axes"):
        sweep.load_points([5.0], [2])


def test_a_resumed_rate_sweep_finds_each_rows_load_point(tmp_path: Path) -> None:
    import sweep
    from serverbench.records.csv_store import append_row

    runs_csv = tmp_path / "runs.csv"
    append_row(runs_csv, {"batch_size": 2, "compile": False, "status": "ok", "experiment": "serial", "repeat": 0})
    for rate_rps in (0.1, 20.0):  # as server.py writes them: cfg.rate_rps
        append_row(
            runs_csv,
            {
                "batch_size": 2,
                "compile": False,
                "status": "ok",
                "experiment": "serial",
                "repeat": 0,
                "load": "poisson",
                "offered_rate_rps": rate_rps,
                "concurrency": None,
            },
        )
    slow, fast = sweep.load_points([0.1, 20], [])
    assert study.completed_keys(runs_csv, retry_failed=False, load_axis="poisson") == {
        ("serial", 2, False, None, 0),  # the row from before the axis: no cell of this sweep has its key
        ("serial", 2, False, slow, 0),
        ("serial", 2, False, fast, 0),
    }
    assert study.completed_keys(runs_csv, retry_failed=False) == {("serial", 2, False, None, 0)}  # no axis: as before
    assert study.completed_keys(runs_csv, retry_failed=False, load_axis="closed") == {("serial", 2, False, None, 0)}
    # A cell that dies before its row gets one from the sweep, with its load point, and is found by it.
    crashed = study.Cell(study.Experiment("serial", ()), 2, False, 1, fast)
    study.record_failure(crashed, tmp_path, "crashed", "exit status 1")
    assert study.row_of(crashed, tmp_path)["status"] == "crashed"
    assert study.row_of(study.Cell(crashed.experiment, 2, False, 1, slow), tmp_path) is None


@pytest.mark.parametrize(
    "changed,expected",
    [
        # the same name, other flags: its rows, made with the old ones, counted as done
        (
            ["--experiment", "x=--design threaded", "--rates", "50"],
            "made with --experiment x=--design serial; this command gives --experiment x=--design threaded: give",
        ),
        # no load axis: the rows at 50 req/s counted as done for cells at the server flags' load
        ([], "made with --rates 50.0; this command gives no --rates: give the same to resume, or another --out"),
    ],
)
def test_a_resume_with_another_experiment_or_load_axis_is_refused(
    tmp_path: Path, capsys, changed: list[str], expected: str
) -> None:
    import sweep
    from serverbench.launch.study_checks import record_args

    out = tmp_path / "sweep"
    common = ["--out", str(out), "--batch_sizes", "2", "--compile", "false", "--designs"]
    made = sweep.build_parser().parse_args([*common, "--experiment", "x=--design serial", "--rates", "50"])
    out.mkdir()
    record_args(out, argparse.Namespace(**vars(made), server_flags=SERVER_FLAGS[1:]))
    before = sorted(out.iterdir())
    assert sweep.main([*common, *(changed or ["--experiment", "x=--design serial"]), *SERVER_FLAGS]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0], err
    assert sorted(out.iterdir()) == before


def test_two_sweeps_never_run_on_one_folder(tmp_path: Path, capsys) -> None:
    import sweep

    out = tmp_path / "sweep"
    out.mkdir()
    held = sweep.lock_out_dir(out)
    try:
        assert (
            sweep.main(
                ["--out", str(out), "--batch_sizes", "2", "--compile", "false", "--designs", "serial", *SERVER_FLAGS]
            )
            == 2
        )
        err = capsys.readouterr().err.strip()
        assert f"another sweep (pid {os.getpid()}) is running on {out}" in err
        assert not (out / "runs.csv").exists()
    finally:
        os.close(held)


def _start_long_sweep(out: Path, ignore_sigint: bool) -> subprocess.Popen:
    """A sweep of one long cell (5 requests/s for minutes: it waits rather than spins beside other runs), started
    as a script's `cmd &` would (SIGINT ignored) when asked."""

    def preexec() -> None:
        os.setsid()
        if ignore_sigint:
            signal.signal(signal.SIGINT, signal.SIG_IGN)

    args = ["--out", str(out), "--plots_dir", str(out / "plots"), "--batch_sizes", "2", "--compile", "false"]
    args += ["--designs", "serial", "--repeats", "1", "--", "--device", "cpu", "--model", "identity"]
    args += ["--image_size", "16", "--no-ceiling", "--load", "poisson", "--rate", "5", "--num_iters", "1000"]
    return subprocess.Popen(
        [sys.executable, "sweep.py", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=preexec,
    )


def _wait_for_measured_phase(out: Path) -> None:
    """Returns once the sweep's server is in its measured phase."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        logs = list((out / "logs").glob("*.log")) if (out / "logs").exists() else []
        if logs and "warm-up response" in logs[0].read_text():
            return
        time.sleep(0.2)
    raise AssertionError("the sweep's server did not reach its measured phase")


def _server_pids(out: Path) -> list[int]:
    """The sweep's servers (their results folder is in `out`) still running."""
    return pids_running("server.py", str(out))


@pytest.fixture(scope="module")
def long_sweeps(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tuple[Path, subprocess.Popen]]]:
    """Two sweeps of one long cell, started together so that their start-ups overlap: "ctrl_c" as a script's
    `cmd &` starts it, "killed" as is. Each test stops its own; whatever is left is killed here."""
    sweeps: dict[str, tuple[Path, subprocess.Popen]] = {}
    try:
        for name in ("ctrl_c", "killed"):
            out = tmp_path_factory.mktemp(name) / "sweep"
            sweeps[name] = (out, _start_long_sweep(out, ignore_sigint=name == "ctrl_c"))
        yield sweeps
    finally:
        for out, proc in sweeps.values():
            for session in (proc.pid, *_server_pids(out)):  # the servers lead sessions of their own
                if session == proc.pid and proc.poll() is not None:
                    continue
                kill_session(session)
            proc.communicate()


def test_ctrl_c_stops_a_sweep_started_in_the_background_and_keeps_the_cells_partial_row(
    long_sweeps: dict[str, tuple[Path, subprocess.Popen]],
) -> None:
    out, proc = long_sweeps["ctrl_c"]
    _wait_for_measured_phase(out)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 130 and stderr.strip().splitlines()[-1] == (
        "sweep.py: interrupted; re-run the same command to resume"
    ), stderr[-3000:]
    assert pd.read_csv(out / "runs.csv")["status"].tolist() == ["interrupted"]
    assert _server_pids(out) == []


def test_the_cells_server_ends_with_a_killed_sweep(long_sweeps: dict[str, tuple[Path, subprocess.Popen]]) -> None:
    out, proc = long_sweeps["killed"]
    _wait_for_measured_phase(out)
    assert _server_pids(out)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=30)
    deadline = time.monotonic() + 15
    while _server_pids(out) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _server_pids(out) == [], "the server outlived its sweep"
    assert pd.read_csv(out / "runs.csv")["status"].tolist() == ["interrupted"]


def _map_and_sleep(path: str) -> None:
    import mmap
    import time

    with open(path, "r+b") as f:
        mapped = mmap.mmap(f.fileno(), 4096)
    time.sleep(60)
    mapped.close()


def test_what_a_killed_cell_had_mapped_in_dev_shm_is_found_and_only_that(tmp_path: Path) -> None:
    """A server that does not stop within the grace is killed with its session; the segments and semaphores its
    processes had mapped are unlinked by the sweep, and nothing else in /dev/shm is named."""
    import multiprocessing as mp
    import signal
    import time

    from serverbench.launch import procutil

    mine, other = process.SHM_FOLDER / f"psm_test_{os.getpid()}", process.SHM_FOLDER / f"psm_other_{os.getpid()}"
    for path in (mine, other):
        path.write_bytes(b"\0" * 4096)
    child = mp.get_context("fork").Process(target=_map_and_sleep, args=(str(mine),))
    child.start()
    try:
        for _ in range(50):  # until the child has mapped it
            if mine.name in procutil.shm_mapped_by([child.pid]):
                break
            time.sleep(0.1)
        found = procutil.shm_mapped_by([child.pid])
        assert mine.name in found and other.name not in found
        os.kill(child.pid, signal.SIGKILL)
        child.join(5)
        assert procutil.unlink_shm(found) == sorted(found) and not mine.exists() and other.exists()
    finally:
        child.kill()
        for path in (mine, other):
            path.unlink(missing_ok=True)
