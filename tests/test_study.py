"""The study harness (bench/study.py on the runner serverbench/launch/study.py): a study written in one file runs
its cells interleaved, writes its rows with what produced them, reports, resumes without running a finished cell
again, and re-renders its report from the rows alone; a committed study's report re-rendered from its committed
runs.csv shows the figures it showed."""

from __future__ import annotations

import re
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from conftest import ROOT, run_command

from bench import batch_latency, your_model
from bench.study import build_parser, run_study
from serverbench.launch.study import (
    Cell,
    CellInterrupted,
    CellRefused,
    Experiment,
    FixtureFailed,
    LoadPoint,
    Runner,
    interleaved,
)

TINY = ["--", "--device", "cpu", "--model", "identity", "--image_size", "16", "--num_iters", "30", "--no-ceiling"]


def _study(out: Path, *more: str) -> tuple[int, str, str]:
    ran = run_command(
        # a rate the CSV writes as 50: its run was recorded as crashed and ran again on every resume
        [sys.executable, "-m", "bench.batch_latency", "--out", str(out), "--batch_sizes", "1", "4"]
        + ["--rates", "50.000000000000004"]
        + ["--repeats", "1", "--slo_ms", "1000", *more, *TINY],
        timeout_s=200,
    )
    return ran.returncode, ran.stdout, ran.stderr


@pytest.fixture(scope="module")
def ran(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    out = tmp_path_factory.mktemp("study") / "out"
    first = _study(out)
    rows_after_first = pd.read_csv(out / "runs.csv")
    again = _study(out)
    (out / "batch_latency.md").rename(out / "first.md")
    report_only = _study(out, "--report_only")
    return {"out": out, "first": first, "again": again, "report_only": report_only, "rows": rows_after_first}


def test_a_study_in_one_file_runs_its_cells_and_reports_with_its_provenance(ran) -> None:
    code, stdout, stderr = ran["first"]
    assert code == 0, stderr[-3000:]
    assert "bench.batch_latency: 2 runs (phase 1 of 1, 1 interleaved rounds)" in stdout and "0 already done" in stdout
    rows = ran["rows"]
    assert sorted(rows["batch_size"]) == [1, 4] and set(rows["status"]) == {"ok"}
    assert set(rows["load"]) == {"poisson"} and set(rows["offered_rate_rps"]) == {50.0}
    assert rows["commit"].notna().all() and rows["cpu_model"].notna().all()  # what produced each row
    report = (ran["out"] / "first.md").read_text()
    assert report.startswith("# Batch size against tail latency\n")
    assert "- command: `python -m bench.batch_latency --out" in report and "-- --device cpu --model identity" in report
    assert f"- commit: {rows['commit'].iloc[0]}" in report
    assert "| 50 | 1 | 1 |" in report and "| 50 | 4 | 1 |" in report and "- 50 req/s: batch 4" in report
    assert (ran["out"] / "batch_latency.png").stat().st_size > 0
    assert sorted(p.name for p in (ran["out"] / "logs").iterdir()) == [
        "batch_latency_bs1_nc_rate50_r0.log",
        "batch_latency_bs4_nc_rate50_r0.log",
    ]


def test_the_same_command_again_runs_nothing_and_reports_the_same(ran) -> None:
    code, stdout, stderr = ran["again"]
    assert code == 0, stderr[-3000:]
    assert "2 already done" in stdout and "[1/2]" not in stdout
    assert len(pd.read_csv(ran["out"] / "runs.csv")) == 2
    table = [line for line in stdout.splitlines() if line.startswith("| 50 ")]
    assert table and all(line in (ran["out"] / "first.md").read_text() for line in table)


def test_report_only_renders_from_the_rows_without_a_run(ran) -> None:
    code, stdout, stderr = ran["report_only"]
    assert code == 0, stderr[-3000:]
    # Its header names the command that ran the rows, then the one that rendered it
    measured = re.search(r"- command: `(python -m bench.batch_latency [^`]*)`", stdout)
    assert measured and "--report_only" not in measured.group(1) and "-- --device cpu" in measured.group(1)
    assert re.search(r"- this report: `python -m bench.batch_latency [^`]*--report_only", stdout)
    assert "runs (phase" not in stdout and "| 50 | 4 | 1 |" in stdout
    assert len(pd.read_csv(ran["out"] / "runs.csv")) == 2


def test_report_only_judges_against_the_slo_given_the_reports_own_flag(ran, tmp_path: Path, capsys) -> None:
    """--slo_ms is batch_latency's report's alone (free_flags): --report_only judges against the one given, where
    every other study flag is the measured one."""
    out = tmp_path / "out"
    shutil.copytree(ran["out"], out)
    assert batch_latency.main(["--out", str(out), "--report_only", "--slo_ms", "0.5"]) == 0
    text = (out / "batch_latency.md").read_text()
    assert "The largest batch whose mean p99 is within 0.5 ms:" in text and "| 1 |" in text, text
    capsys.readouterr()


def test_a_committed_studys_report_rerendered_from_its_rows_shows_its_figures(tmp_path: Path, capsys) -> None:
    """bench.your_model's committed rows (made before the harness) give the committed table and gains again."""
    shutil.copytree(ROOT / "results" / "your_model", tmp_path / "ym")
    assert your_model.main(["--report_only", "--out", str(tmp_path / "ym")]) == 0
    committed = (ROOT / "results" / "your_model" / "your_model.md").read_text()
    rerendered = (tmp_path / "ym" / "your_model.md").read_text()
    figures = committed[committed.index("| configuration") :]
    assert rerendered.endswith(figures.rstrip("\n") + "\n") and figures.count("\n| ") >= 6
    assert "- command: `python -m bench.your_model --report_only" in rerendered


def test_a_run_interrupted_then_run_again_by_the_resume_counts_once_as_its_later_row(tmp_path: Path, capsys) -> None:
    """The report said "1 run(s) failed" and exited 1 for an interrupted run that the resume had run again; and
    counted a failure that --retry_failed had mended."""
    common = {"batch_size": 1, "compile": False, "experiment": "batch_latency", "repeat": 0, "load": "poisson"}
    figures = {"offered_rate_rps": 50.0, "p50_latency_s": 0.001, "p99_latency_s": 0.002, "throughput": 50.0}
    rows = [{**common, **figures, "status": "interrupted"}, {**common, **figures, "status": "ok"}]
    (tmp_path / "out").mkdir()
    pd.DataFrame(rows).to_csv(tmp_path / "out" / "runs.csv", index=False)
    assert batch_latency.main(["--report_only", "--out", str(tmp_path / "out"), "--rates", "50"]) == 0
    said = capsys.readouterr().out
    assert "- rows: 1 (1 ok)" in said and "| 50 | 1 | 1 |" in said and "failed" not in said
    # A run that failed and that --retry_failed ran again with success (the runner's attempt 2): reported as its
    # later row alone, which the exit status judges. It was counted as a failure beside the ok row.
    rows = [
        {**common, **figures, "status": "crashed", "attempt": 1},
        {**common, **figures, "status": "ok", "attempt": 2},
    ]
    pd.DataFrame(rows).to_csv(tmp_path / "out" / "runs.csv", index=False)
    assert batch_latency.main(["--report_only", "--out", str(tmp_path / "out"), "--rates", "50"]) == 0
    said = capsys.readouterr().out
    assert "- rows: 1 (1 ok), 1 more that a later run of the same cell replaced;" in said
    assert "| 50 | 1 | 1 |" in said and "failed" not in said
    # Two separate runs of one configuration (a hand-made CSV: attempt 1 each): the failure stands in the report
    pd.DataFrame([{**row, "attempt": 1} for row in rows]).to_csv(tmp_path / "out" / "runs.csv", index=False)
    assert batch_latency.main(["--report_only", "--out", str(tmp_path / "out"), "--rates", "50"]) == 0
    said = capsys.readouterr().out
    assert "- rows: 2 (1 ok);" in said and "1 run(s) failed" in said


def test_your_models_poisson_rate_stays_the_one_its_rows_began_with() -> None:
    """A resume whose burst rows changed (a failed burst run retried) picked another rate and ran the phase again."""
    args = build_parser(your_model.STUDY).parse_args(["--repeats", "1"])
    burst = [{"load": "burst", "status": "ok", "experiment": name, "achieved_rate_rps": 100.0} for name in "ab"]
    fresh = your_model.poisson_phase(args, pd.DataFrame(burst))
    assert {cell.load_point.value for cell in fresh} == {50.0}
    begun = pd.DataFrame([*burst, {"load": "poisson", "status": "ok", "experiment": "a", "offered_rate_rps": 40.0}])
    assert {cell.load_point.value for cell in your_model.poisson_phase(args, begun)} == {40.0}


def test_batch_latency_compiles_every_run_when_asked() -> None:
    """--compile was defined and ignored: every cell ran eager (the cell's own --no-compile)."""
    parser = build_parser(batch_latency.STUDY)
    assert {cell.compile for cell in batch_latency.cells(parser.parse_args(["--compile"]), None)} == {True}
    assert {cell.compile for cell in batch_latency.cells(parser.parse_args([]), None)} == {False}


def test_a_ctrl_c_during_the_checks_before_the_runs_is_one_line_and_exit_130(tmp_path: Path, capsys) -> None:
    """The checks try a user model's forward in a child, which can take long: a Ctrl-C then was a traceback."""

    def interrupted_checks(args: object, rows: object) -> list[Cell]:
        raise KeyboardInterrupt

    study = replace(batch_latency.STUDY, checked_cells=interrupted_checks)
    assert run_study(study, ["--out", str(tmp_path / "o"), *TINY]) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"python -m bench.batch_latency: interrupted; the rows so far are in {tmp_path / 'o' / 'runs.csv'}"
        ": the same command resumes"
    ], err
    assert not (tmp_path / "o").exists()


def test_your_model_with_no_burst_row_reports_its_failures_and_runs_no_poisson_phase(tmp_path: Path, capsys) -> None:
    """Every burst run timed out or crashed: the runner's rows have the key, status and error only (no load
    column). The Poisson phase raised KeyError 'load', and so did the report (and its --report_only)."""
    args = build_parser(your_model.STUDY).parse_args(["--repeats", "1"])
    failed = {"status": "sweep_timeout", "error": "no result within 1 s", "batch_size": 4, "compile": False}
    rows = pd.DataFrame([{**failed, "experiment": name, "repeat": 0} for name in your_model.configurations()])
    assert your_model.poisson_phase(args, rows) == []
    assert "no burst run succeeded" in capsys.readouterr().out
    text = "\n".join(your_model.report(args, rows, tmp_path))
    assert "| serial_eager | ? |" in text and "| n/a | n/a | n/a |" in text and "serial = n/a" in text, text


def test_a_study_whose_first_phase_is_empty_but_a_later_ones_is_not_passes_the_checks(tmp_path: Path, monkeypatch):
    """bench.stability --suites identity: its first phase (another suite) has no cell, its second has five; the
    check that refuses flags giving no run at all must look at every phase."""
    from bench import stability, study

    monkeypatch.setattr(study, "run_and_report", lambda *args: 0)  # the checks only
    assert stability.main(["--suites", "identity", "--out", str(tmp_path / "o")]) == 0


def test_rounds_are_interleaved_reproducibly_and_each_holds_every_cell_once() -> None:
    cells = [Cell(Experiment(name, ()), 2, False, 0, LoadPoint("poisson", 5.0)) for name in "abcdef"]
    order = interleaved(cells, repeats=3, seed=7)
    assert [cell.repeat for cell in order] == [0] * 6 + [1] * 6 + [2] * 6
    assert all(sorted(c.experiment.name for c in order[r * 6 : r * 6 + 6]) == list("abcdef") for r in range(3))
    assert len({tuple(c.experiment.name for c in order[r * 6 : r * 6 + 6]) for r in range(3)}) > 1  # shuffled
    assert interleaved(cells, 3, seed=7) == order and interleaved(cells, 3, seed=8) != order


@pytest.mark.parametrize("study", [batch_latency, your_model], ids=lambda m: m.__name__)
def test_every_study_has_help_with_the_harness_flags(study, capsys) -> None:
    with pytest.raises(SystemExit) as ended:
        study.main(["--help"])
    assert ended.value.code == 0
    said = capsys.readouterr().out
    assert all(flag in said for flag in ("--out", "--repeats", "--seed", "--retry_failed", "--report_only"))


def test_what_a_run_or_its_fixture_raises_is_the_cells_row_not_a_traceback(tmp_path: Path) -> None:
    """A fixture that raises anything while starting fails its cells in one line (once for a shared key); a
    measure that raises records its error; the key columns are the cell's whatever the row says."""
    started: list[str] = []

    @contextmanager
    def fixture(cell: Cell, out: Path) -> Iterator[tuple[str, ...]]:
        started.append(cell.experiment.name)
        if cell.experiment.name == "port":
            raise OSError(98, "Address already in use")
        yield ()

    def measure(cell: Cell, runner: Runner, added: tuple[str, ...]) -> dict[str, object]:
        if cell.experiment.name == "divides":
            raise ZeroDivisionError("float division by zero")
        return {"status": "ok", "experiment": "another", "batch_size": 99}

    cells = [Cell(Experiment(name, (), measure), 1, False, r) for name in ("port", "divides", "fine") for r in (0, 1)]
    for key in (None, lambda cell: cell.experiment.name):
        out = tmp_path / ("held" if key else "each")
        started.clear()
        Runner("t", out, fixture=fixture, fixture_key=key).run(cells)
        rows = pd.read_csv(out / "runs.csv")
        assert list(zip(rows["experiment"], rows["status"])) == [
            *[("port", "error")] * 2,
            *[("divides", "error")] * 2,
            *[("fine", "ok")] * 2,
        ]
        assert set(rows["error"].dropna()) == {
            "OSError: [Errno 98] Address already in use",
            "ZeroDivisionError: float division by zero",
        }
        assert (rows["batch_size"] == 1).all()  # the cell's key, not the row's 99
        assert started.count("port") == (1 if key else 2)


def test_cells_that_share_a_fixture_key_share_one_fixture_and_rows_resume_on_both_load_axes(tmp_path: Path) -> None:
    """A study whose runs are not server.py's (an Experiment's measure) against a server kept up across them (one
    fixture per key, started for the first such cell, stopped when the key changes or the runs end; one that did not
    start fails its cells without starting again), on closed and Poisson points in one folder: each row holds the
    cell's key and what made it, and the same cells again run nothing."""
    events: list[str] = []

    @contextmanager
    def fixture(cell: Cell, out: Path) -> Iterator[tuple[str, ...]]:
        name = cell.experiment.name
        if name.startswith("broken"):
            events.append(f"refused {name}")
            raise FixtureFailed(f"{name} did not start")
        events.append(f"start {name}")
        yield ("--target", f"http://{name}")
        events.append(f"stop {name}")

    def measure(cell: Cell, runner: Runner, added: tuple[str, ...]) -> dict[str, object]:
        events.append(f"run {cell.experiment.name} {cell.load_point.label()} {added[-1]}")
        return {"status": "ok", "throughput_rps": np.float64(100.0)}  # a numpy scalar, written as its number

    def cells_of(name: str) -> list[Cell]:
        points = [LoadPoint("closed", 1), LoadPoint("closed", 4), LoadPoint("poisson", 12.5)]
        return [Cell(Experiment(name, (), measure), 1, False, 0, point) for point in points]

    cells = [*cells_of("a"), *cells_of("broken"), *cells_of("b")]
    runner = Runner("t", tmp_path, fixture=fixture, fixture_key=lambda cell: cell.experiment.name)
    failed = runner.run(cells, load_axis=("closed", "poisson"))
    assert [status for _, status in failed] == ["error"] * 3
    assert events == [
        "start a",
        *(f"run a {point} http://a" for point in ("concurrency=1", "concurrency=4", "rate=12.5 req/s")),
        "stop a",
        "refused broken",  # once for its three cells
        "start b",
        *(f"run b {point} http://b" for point in ("concurrency=1", "concurrency=4", "rate=12.5 req/s")),
        "stop b",
    ]
    rows = pd.read_csv(tmp_path / "runs.csv")
    assert list(rows["status"]) == ["ok"] * 3 + ["error"] * 3 + ["ok"] * 3
    assert set(rows.loc[rows["status"] == "error", "error"]) == {"broken did not start"}
    assert (rows.loc[rows["status"] == "ok", "throughput_rps"] == 100.0).all()
    assert rows["commit"].notna().all() and rows["cpu_model"].notna().all()
    events.clear()
    assert runner.run(cells, load_axis=("closed", "poisson")) == [] and events == []  # the failed ones stand
    assert [status for _, status in runner.run(cells, retry_failed=True, load_axis=("closed", "poisson"))] == [
        "error"
    ] * 3
    assert events == ["refused broken"]


# A stand-in for server.py in another checkout (a commit's worktree): what each case does, by its --experiment.
FAKE_SERVER = """
import sys, time
from pathlib import Path
from serverbench.records.csv_store import append_row
args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
case = args["--experiment"]
if case == "refused":
    print("server.py: error: --model nope: no such model", file=sys.stderr)
    sys.exit(2)
if case == "hangs":
    time.sleep(60)
if case == "interrupted":
    sys.exit(130)
row = {"run_id": f"{case}-{time.monotonic_ns()}", "experiment": case, "status": "ok", "error": None, "figure": 7}
append_row(Path(args["--results_dir"]) / args["--output_file"], row)  # as server.py appends its row
print("its last line")
"""


def test_a_measures_own_server_run_gives_its_row_or_says_why_it_has_none(tmp_path: Path) -> None:
    """Runner.server_row, as bench.commits (another checkout), serving's peak searches and the network study's
    generator use it: the row the run appended (an empty cell None, not NaN), found by its run_id even after a
    crash's cut line was set aside; a refusal raised with server.py's own line; a run past the timeout stopped and
    said so, with no row; an interrupted server stops the study."""
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    (checkout / "server.py").write_text(FAKE_SERVER)
    env = {"PYTHONPATH": str(ROOT)}  # the stand-in appends its row as server.py does
    runner = Runner("test", tmp_path / "out", timeout_s=2.0, stop_grace_s=2.0, stop_when_interrupted=True, env=env)
    runner.out_dir.mkdir()

    def run(case: str):
        cell = Cell(Experiment(case, ()), 1, False, 0)
        return runner.server_row(cell, ["--experiment", case], "side.csv", checkout=checkout)

    ended, row = run("writes")
    assert (ended.returncode, ended.timed_out, ended.said) == (0, False, "its last line")
    assert row is not None and row["run_id"].startswith("writes-")
    assert {k: row[k] for k in ("experiment", "status", "error", "figure")} == {
        "experiment": "writes",
        "status": "ok",
        "error": None,
        "figure": 7,
    }
    with open(runner.out_dir / "side.csv", "a") as side:  # a row cut by a crash: the next append sets it aside
        side.write("crashed-1,crashed,ok,,")
    ended, row = run("after_a_crash")
    assert row is not None and row["experiment"] == "after_a_crash"
    with pytest.raises(CellRefused, match="server.py refused its flags: server.py: error: --model nope"):
        run("refused")
    ended, row = run("hangs")
    assert ended.timed_out and row is None
    assert (runner.out_dir / "logs" / "hangs_bs1_nc_r0.log").read_text().splitlines()[0].endswith("side.csv")
    with pytest.raises(CellInterrupted):
        run("interrupted")


# A stand-in for server.py run by the runner itself (Runner.python runs it in server.py's place): a row as server.py
# appends it, failed on a cell's first attempt; on its second, "mends" writes an ok row and "dies" none.
RETRIED_SERVER = """
import sys, time
from pathlib import Path
from serverbench.records.csv_store import append_row
def given(flag):  # argv[1] is the server.py it stands in for
    return sys.argv[sys.argv.index(flag) + 1]
case, attempt = given("--experiment"), int(given("--attempt"))
if attempt > 1 and case == "dies":
    sys.exit(1)
row = {"run_id": f"{case}-{attempt}", "experiment": case, "batch_size": given("--batch_size"), "compile": False}
row |= {"repeat": given("--repeat"), "attempt": attempt, "status": "ok" if attempt > 1 else "error", "error": None}
append_row(Path(given("--results_dir")) / given("--output_file"), row)
"""


def test_a_run_again_is_the_cells_next_attempt_and_its_own_row_replaces_the_failed_one(tmp_path: Path) -> None:
    """--retry_failed's run of a failed cell: its row says attempt 2 and its log is its own; a run again that died
    without a row is recorded as crashed (the cell's status was read from the earlier row, and no row was written);
    the report's rows keep the later attempt alone."""
    from serverbench.records.report_input import drop_superseded

    (tmp_path / "fake_server.py").write_text(RETRIED_SERVER)
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nexec {sys.executable} {tmp_path / "fake_server.py"} "$@"\n')
    python.chmod(0o755)
    env = {"PYTHONPATH": str(ROOT)}
    runner = Runner("test", tmp_path / "out", timeout_s=30.0, python=str(python), env=env)
    cells = [Cell(Experiment(name, ()), 1, False, 0) for name in ("mends", "dies")]
    assert runner.run(cells) == [(cells[0], "error"), (cells[1], "error")]
    again = runner.run(cells, retry_failed=True)
    assert [(cell.experiment.name, status) for cell, status in again] == [("dies", "crashed")]
    rows = pd.read_csv(runner.out_dir / "runs.csv")
    assert list(zip(rows["experiment"], rows["attempt"], rows["status"])) == [
        ("mends", 1, "error"),
        ("dies", 1, "error"),
        ("mends", 2, "ok"),
        ("dies", 2, "crashed"),
    ]
    assert "_r0_a2.log" in rows["error"].iloc[3]
    logs = sorted(path.name for path in (runner.out_dir / "logs").iterdir())
    assert logs == ["dies_bs1_nc_r0.log", "dies_bs1_nc_r0_a2.log", "mends_bs1_nc_r0.log", "mends_bs1_nc_r0_a2.log"]
    kept = drop_superseded(rows)
    assert list(zip(kept["experiment"], kept["status"])) == [("mends", "ok"), ("dies", "crashed")]
