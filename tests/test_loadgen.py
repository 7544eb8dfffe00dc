"""--load loadgen: MLPerf LoadGen drives the transport; its verdict and latencies land in the row beside ours, a
failed run never leaves LoadGen waiting, and bad input is one line with exit 2."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest
from conftest import TINY, ServerRun, live_processes_in_session, new_shm_entries, run_server, shm_entries

import server
from bench import loadgen_agreement
from serverbench.load import loadgen
from serverbench.load.loadgen import LoadGenDriver, loadgen_columns, loadgen_settings, parse_detail_log
from serverbench.schema.records import LoadGenResult
from tests.helpers import Background, start_first

# A LoadGen test kept short: --num_iters is its minimum query count, --duration_s 0 its minimum duration.
FEW = ["--num_iters", "24", "--duration_s", "0"]


def lg_config(**values) -> SimpleNamespace:
    base = dict(scenario="Server", duration_s=0.0, num_iters=24, rate_rps=50.0, slo_ms=None, concurrency=None)
    return SimpleNamespace(**{**base, **values})


# ------------------------------------------------------------------------ flags onto LoadGen's settings


def test_flags_map_onto_loadgen_settings() -> None:
    server_settings = loadgen_settings(lg_config(slo_ms=25.0, duration_s=1.5))
    assert server_settings == {
        "scenario": "Server",
        "mode": "PerformanceOnly",
        "min_duration_ms": 1500,
        "min_query_count": 24,
        "server_target_qps": 50.0,
        "server_target_latency_ns": 25_000_000,
    }
    assert loadgen_settings(lg_config(scenario="Offline", rate_rps=300.0))["offline_expected_qps"] == 300.0
    assert "offline_expected_qps" not in loadgen_settings(lg_config(scenario="Offline", rate_rps=None))
    assert loadgen_settings(lg_config(scenario="MultiStream", concurrency=3))["multi_stream_samples_per_query"] == 3
    single = loadgen_settings(lg_config(scenario="SingleStream", rate_rps=None))
    assert set(single) == {"scenario", "mode", "min_duration_ms", "min_query_count"}  # the rest: LoadGen's defaults


DETAIL_LOG = """:::MLLOG {"key": "loadgen_version", "value": "6.0.17", "time_ms": 0.0}
:::MLLOG {"key": "result_validity", "value": "INVALID", "time_ms": 1.0}
:::MLLOG {"key": "result_min_duration_met", "value": true, "time_ms": 1.0}
:::MLLOG {"key": "result_perf_constraints_met", "value": false, "time_ms": 1.0}
:::MLLOG {"key": "result_invalid_reason", "value": "Reduce target QPS to improve latency. ", "time_ms": 1.0}
:::MLLOG {"key": "early_stopping_met", "value": true, "time_ms": 1.0}
:::MLLOG {"key": "result_query_count", "value": 240, "time_ms": 1.0}
:::MLLOG {"key": "result_scheduled_samples_per_sec", "value": 49.8, "time_ms": 1.0}
:::MLLOG {"key": "result_completed_samples_per_sec", "value": 49.7, "time_ms": 1.0}
:::MLLOG {"key": "result_mean_latency_ns", "value": 3000000, "time_ms": 1.0}
:::MLLOG {"key": "result_50.00_percentile_latency_ns", "value": 2000000, "time_ms": 1.0}
:::MLLOG {"key": "result_90.00_percentile_latency_ns", "value": 5000000, "time_ms": 1.0}
:::MLLOG {"key": "result_99.00_percentile_latency_ns", "value": 10000000, "time_ms": 1.0}
not a log line
:::MLLOG {broken json
"""


def test_the_detail_log_gives_the_verdict_rates_and_percentiles_in_seconds() -> None:
    results = parse_detail_log(DETAIL_LOG)
    assert "loadgen_version" not in results
    columns = loadgen_columns(LoadGenResult("Server", "/x", results), our_p99_s=0.0101)
    assert columns["loadgen_valid"] is False
    assert columns["loadgen_invalid_reason"] == "latency target not met; Reduce target QPS to improve latency."
    assert columns["loadgen_scheduled_rps"] == 49.8 and columns["loadgen_completed_rps"] == 49.7
    assert columns["loadgen_p50_latency_s"] == pytest.approx(0.002)
    assert columns["loadgen_p99_latency_s"] == pytest.approx(0.010)
    assert columns["loadgen_p99_ratio"] == pytest.approx(1.01)
    assert columns["loadgen_note"] is None  # within 0.95-1.05: nothing to warn about
    assert set(columns) == set(loadgen.LOADGEN_COLUMNS)


@pytest.mark.parametrize("our_p99_s,warned", [(0.0094, True), (0.0096, False), (0.0104, False), (0.0106, True)])
def test_p99s_that_disagree_by_more_than_5_percent_are_a_warning(our_p99_s: float, warned: bool) -> None:
    columns = loadgen_columns(LoadGenResult("Server", "/x", parse_detail_log(DETAIL_LOG)), our_p99_s)
    assert bool(columns["loadgen_note"]) is warned
    if warned:
        assert "outside 0.95-1.05" in columns["loadgen_note"]


def test_unanswered_samples_void_the_verdict_and_the_ratio_and_say_why() -> None:
    valid = DETAIL_LOG.replace('"INVALID"', '"VALID"')
    result = LoadGenResult("Server", "/x", parse_detail_log(valid), unanswered=7)
    columns = loadgen_columns(result, our_p99_s=0.010)
    assert columns["loadgen_valid"] is None and columns["loadgen_invalid_reason"] is None
    assert columns["loadgen_p99_ratio"] is None
    assert columns["loadgen_unanswered"] == 7
    assert columns["loadgen_note"].startswith("no verdict: ")
    assert "7 sample(s) LoadGen issued were completed without an answer" in columns["loadgen_note"]
    assert loadgen_columns(None, 0.01) == dict.fromkeys(loadgen.LOADGEN_COLUMNS)  # every other load


@pytest.mark.parametrize(
    "status,error",
    [("interrupted", ""), ("wrong_output", ""), ("ok", "the run failed or was stopped during LoadGen's test")],
)
def test_a_failed_run_has_no_verdict_even_with_every_sample_answered(status: str, error: str) -> None:
    """LoadGen said VALID, and no sample went unanswered: the run failed after its last answer, or was stopped
    between two samples."""
    result = LoadGenResult("Server", "/x", parse_detail_log(DETAIL_LOG.replace('"INVALID"', '"VALID"')), error=error)
    columns = loadgen_columns(result, our_p99_s=0.010, run_status=status)
    assert columns["loadgen_valid"] is None and columns["loadgen_p99_ratio"] is None
    note = columns["loadgen_note"]
    assert note.startswith("no verdict: ") and (error or f"the run ended {status}") in note, note
    # The same result from a run that went well: LoadGen's verdict stands (a test cut short never does).
    assert loadgen_columns(result, 0.010, "ok")["loadgen_valid"] is (None if error else True)


# ------------------------------------------------------------------------ the driver with a fake server


def _driver(tmp_path: Path, answer, should_stop=lambda: False, **values) -> tuple[LoadGenDriver, list]:
    sent: list[tuple[int, object, int]] = []
    holder: list[LoadGenDriver] = []

    def send(request_id: int, payload: object, issued_ns: int) -> None:
        sent.append((request_id, payload, issued_ns))
        if answer(len(sent)):  # a server that answers on another thread, as the receiver does
            threading.Thread(target=holder[0].complete, args=(request_id,)).start()

    cfg = lg_config(**{"rate_rps": 400.0, "num_iters": 40, **values})
    driver = LoadGenDriver(cfg, ["a", "b", "c"], send, 5, should_stop, tmp_path / "lg")
    holder.append(driver)
    return driver, sent


def test_each_issued_sample_is_one_request_with_the_next_id_and_a_pool_entry(tmp_path: Path) -> None:
    driver, sent = _driver(tmp_path, answer=lambda n: True)
    result = driver.run()
    assert [request_id for request_id, _, _ in sent] == list(range(5, 5 + len(sent)))
    assert len(sent) >= 40 and {payload for _, payload, _ in sent} <= {"a", "b", "c"}
    assert result.error == "" and result.unanswered == 0
    assert result.results["result_query_count"] == len(sent)
    assert (tmp_path / "lg" / "mlperf_log_detail.txt").is_file()


def test_a_failing_run_completes_every_outstanding_sample_so_loadgen_never_hangs(tmp_path: Path) -> None:
    """The server stops answering after 10 requests and the run fails: LoadGen's test still ends, at once."""
    failed = threading.Event()
    driver, sent = _driver(tmp_path, answer=lambda n: n <= 10, should_stop=failed.is_set, scenario="Offline")
    threading.Timer(0.5, failed.set).start()
    start_s = time.monotonic()
    result = driver.run()
    assert time.monotonic() - start_s < 0.5 + loadgen.AFTER_STOP_WAIT_S
    assert result.unanswered == len(sent) - 10 > 0
    assert result.results.get("result_validity") is not None  # the test ended and wrote its verdict


# ------------------------------------------------------------------------ bench.loadgen_agreement


def test_the_agreement_benchmark_runs_end_to_end_at_tiny_settings(tmp_path: Path) -> None:
    """Only that the command works on the study harness (a burst run, then three LoadGen runs at fractions of what it
    reached, then the table) and resumes running nothing: no timing is judged."""
    argv = ["--out", str(tmp_path), "--duration_s", "0.2", "--capacity_iters", "30", "--", "--ceiling_s", "0.05"]
    code = loadgen_agreement.main(argv)
    runs = pd.read_csv(tmp_path / "runs.csv")
    assert list(runs["experiment"])[0] == "capacity"
    assert sorted(runs["experiment"][1:]) == ["loadgen_25pct", "loadgen_50pct", "loadgen_75pct"]
    assert (runs["status"] == "ok").all()
    capacity = float(runs["achieved_rate_rps"].iloc[0])
    command = (tmp_path / "logs" / "loadgen_50pct_bs1_nc_r0.log").read_text().splitlines()[0].split()
    assert float(command[command.index("--rate") + 1]) == pytest.approx(capacity / 2, rel=1e-5)
    table = (tmp_path / "loadgen_agreement.md").read_text()
    assert table.count("| VALID |") + table.count("| INVALID |") == 3
    assert code == (0 if "x LoadGen's (median " in table and ": met" in table else 1)
    assert loadgen_agreement.main(argv) == code and len(pd.read_csv(tmp_path / "runs.csv")) == 4


def test_the_agreement_verdict_is_the_middle_rates_ratio(tmp_path: Path) -> None:
    key = {"repeat": 0, "batch_size": 1, "compile": False}  # the study harness's key of a run
    rows = [
        {"experiment": "capacity", "achieved_rate_rps": 100.0, "status": "ok", **key},
        *(
            {
                **key,
                "experiment": f"loadgen_{pct}pct",
                "status": "ok",
                "requests_sent": 50,
                "p99_latency_s": 0.001 * ratio,
                "loadgen_p99_latency_s": 0.001,
                "loadgen_p99_ratio": ratio,
                "loadgen_scheduled_rps": pct,
                "loadgen_valid": True,
            }
            for pct, ratio in ((25, 0.5), (50, 1.04), (75, 2.0))
        ),
    ]
    pd.DataFrame(rows).to_csv(tmp_path / "runs.csv", index=False)
    assert loadgen_agreement.main(["--out", str(tmp_path), "--report_only"]) == 0
    rows[2]["loadgen_p99_ratio"] = 1.06
    pd.DataFrame(rows).to_csv(tmp_path / "runs.csv", index=False)
    assert loadgen_agreement.main(["--out", str(tmp_path), "--report_only"]) == 1
    assert "NOT met" in (tmp_path / "loadgen_agreement.md").read_text()
    # A failed run shows no verdict, though its row (from before failed runs had none) says VALID.
    rows[3]["status"] = "interrupted"
    pd.DataFrame(rows).to_csv(tmp_path / "runs.csv", index=False)
    loadgen_agreement.main(["--out", str(tmp_path), "--report_only"])
    table = (tmp_path / "loadgen_agreement.md").read_text()
    assert table.count("| VALID |") == 2 and "| 75% |" in table and "|  | interrupted |" in table
    # A repeat a resume added ran at the capacity then: its row's rate is shown, not a fraction of today's capacity
    rows.append({**rows[2], "repeat": 1, "offered_rate_rps": 61.0, "loadgen_scheduled_rps": 60.5})
    rows.append({**rows[0], "repeat": 1, "achieved_rate_rps": 140.0})  # the median capacity is now 120
    pd.DataFrame(rows).to_csv(tmp_path / "runs.csv", index=False)
    loadgen_agreement.main(["--out", str(tmp_path), "--report_only"])
    table = (tmp_path / "loadgen_agreement.md").read_text()
    assert "| 50% | 1 | 61.0 (60.5 scheduled) |" in table and "| 50% | 0 | 60.0 (50.0 scheduled) |" in table, table


# ------------------------------------------------------------------------ whole runs on the CPU

OK_RUNS = {
    "Server": [*TINY, *FEW, "--batch_size", "1", "--load", "loadgen", "--scenario", "Server", "--rate", "60"],
    "Offline": [*TINY, *FEW, "--model", "resnet18", "--load", "loadgen", "--scenario", "Offline"],
    "SingleStream": [*TINY, *FEW, "--batch_size", "1", "--load", "loadgen", "--scenario", "SingleStream"],
    "MultiStream": [*TINY, *FEW, "--batch_size", "1", "--load", "loadgen", "--scenario", "MultiStream"]
    + ["--concurrency", "3"],
}


class OkRuns:
    """The runs that end well, one after another in the background from the module's start (the agreement
    benchmark runs meanwhile; the failing runs, which count the shared memory left, come after them): each case's
    run and its results folder."""

    def __init__(self, folder: Path) -> None:
        self._runs = Background("loadgen-runs")
        self._ran = {case: (self._runs.submit(argv, folder / case), folder / case) for case, argv in OK_RUNS.items()}

    def __getitem__(self, case: str) -> tuple[ServerRun, Path]:
        ran, results = self._ran[case]
        return ran.result(timeout=280), results  # below pytest's 300 s

    def stop(self) -> None:
        self._runs.stop()


@pytest.fixture(scope="module")
def ok_runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OkRuns]:
    runs = OkRuns(tmp_path_factory.mktemp("ok"))
    yield runs
    runs.stop()


@pytest.fixture(scope="module", autouse=True)
def _ok_runs_start_first(request: pytest.FixtureRequest) -> None:
    start_first(request, ("ok_runs",))


def test_a_server_scenario_run_puts_loadgen_beside_our_statistics(ok_runs: OkRuns) -> None:
    run, results = ok_runs["Server"]
    assert run.returncode == 0, run.stderr
    row = run.row
    assert row["status"] == "ok" and row["load"] == "loadgen" and row["loadgen_scenario"] == "Server"
    assert row["loadgen_valid"] in ("True", "False")
    assert int(row["requests_sent"]) == int(row["responses_received"]) == int(row["loadgen_queries"]) >= 24
    assert float(row["loadgen_scheduled_rps"]) == pytest.approx(60, rel=0.5)
    assert float(row["offered_rate_rps"]) == 60  # what it was asked, beside what LoadGen scheduled
    ratio = float(row["p99_latency_s"]) / float(row["loadgen_p99_latency_s"])
    assert float(row["loadgen_p99_ratio"]) == pytest.approx(ratio)
    assert row["loadgen_unanswered"] == "0" and float(row["loadgen_completed_rps"]) > 0
    assert row["loadgen_log_dir"] == f"loadgen/{row['run_id']}"
    assert (results / row["loadgen_log_dir"] / "mlperf_log_summary.txt").is_file()
    assert "loadgen       Server:" in run.stdout
    assert not live_processes_in_session(run.session_id)


def test_an_offline_run_of_resnet18(ok_runs: OkRuns) -> None:
    run, _ = ok_runs["Offline"]
    assert run.returncode == 0, run.stderr
    row = run.row
    assert row["status"] == "ok" and row["loadgen_scenario"] == "Offline" and row["loadgen_valid"] in ("True", "False")
    assert int(row["requests_sent"]) == int(row["responses_received"]) >= 24  # one query of every sample
    assert row["loadgen_queries"] == "1"
    assert float(row["loadgen_completed_rps"]) > 0 and float(row["loadgen_p99_ratio"]) > 0


@pytest.mark.parametrize("scenario,samples_per_query", [("SingleStream", 1), ("MultiStream", 3)])
def test_the_stream_scenarios_run_end_to_end_with_a_verdict_and_rates(
    ok_runs: OkRuns, scenario: str, samples_per_query: int
) -> None:
    """One query at a time, of one sample (SingleStream) or of --concurrency samples (MultiStream): every sample one
    request, LoadGen's verdict and its completed rate in the row."""
    run, _ = ok_runs[scenario]
    assert run.returncode == 0, run.stderr
    row = run.row
    assert row["status"] == "ok" and row["loadgen_scenario"] == scenario
    assert row["loadgen_valid"] in ("True", "False") and row["loadgen_unanswered"] == "0"
    queries = int(row["loadgen_queries"])
    assert queries >= 24 and int(row["requests_sent"]) == int(row["responses_received"]) == queries * samples_per_query
    # One query at a time: no more samples a second than a query's mean latency allows, with LoadGen's overhead.
    mean_s = float(row["loadgen_mean_latency_s"])
    assert 0 < float(row["loadgen_completed_rps"]) <= samples_per_query / mean_s * 1.01
    assert float(row["loadgen_p99_ratio"]) > 0
    assert f"loadgen       {scenario}:" in run.stdout


# The backend fails on the first measured request, as --inject_fault plants it (the identity model: no torch import
# in the server to probe a factory): predict raises; hang never returns, deaf to every stop signal. LoadGen's schedule
# is far from over then, so the samples it issued are completed unanswered.
FAILING = [*TINY, "--batch_size", "1", "--warmup_iters", "1", "--load", "loadgen"]


FAILED_CASES = {
    "SingleStream-raise": ("SingleStream", "predict", "error", ["--num_iters", "100", "--duration_s", "0"]),
    # --timeout_s 1: the hang is all there is to call a timeout, whichever request it falls on.
    "SingleStream-hang": (
        "SingleStream",
        "hang",
        "timeout",
        ["--num_iters", "100", "--duration_s", "0", "--timeout_s", "1"],
    ),
    "MultiStream-raise": ("MultiStream", "predict", "error", ["--num_iters", "100", "--duration_s", "0"]),
    "Offline-raise": ("Offline", "predict", "error", ["--num_iters", "100", "--duration_s", "0"]),
    # A schedule of 90 s: the run must end long before it.
    "Server-raise": ("Server", "predict", "error", ["--rate", "20", "--duration_s", "90"]),
}


@dataclass(frozen=True)
class FailedRuns:
    runs: dict[str, tuple[ServerRun, float]]  # case -> (its run, its seconds)
    leaked_shm: set[str]  # shared memory that any of them left


@pytest.fixture(scope="module")
def failed_runs(tmp_path_factory: pytest.TempPathFactory) -> FailedRuns:
    """Every failing case's run, two at a time (each mostly waits: on its failure's stop, on LoadGen's test): the
    shared memory any of them left is whatever is new once all have ended."""
    folder = tmp_path_factory.mktemp("failed")
    before = shm_entries()

    def run(case: str) -> tuple[ServerRun, float]:
        scenario, fault, _, load = FAILED_CASES[case]
        start_s = time.monotonic()
        argv = [*FAILING, "--scenario", scenario, *load, "--inject_fault", fault]
        ran = run_server(argv, folder / case, timeout_s=120)
        return ran, time.monotonic() - start_s

    with ThreadPoolExecutor(2, thread_name_prefix="failed-runs") as pool:
        runs = dict(zip(FAILED_CASES, pool.map(run, FAILED_CASES)))
    return FailedRuns(runs, new_shm_entries(before))


@pytest.mark.parametrize("case", list(FAILED_CASES))
def test_a_failed_run_records_no_loadgen_verdict_and_says_why(failed_runs: FailedRuns, case: str) -> None:
    """The backend fails at the first measured request: the samples LoadGen issued are completed unanswered (and a
    test scheduled for 90 s ends long before), and whatever LoadGen concluded from that, the row holds no verdict
    and says why."""
    scenario, fault, status, load = FAILED_CASES[case]
    run, took_s = failed_runs.runs[case]
    if "90" in load:
        assert took_s < 45
    assert run.returncode == 1, run.stderr[-3000:]
    row = run.row
    assert row["status"] == status, row["error"]
    if fault == "predict":
        assert "injected fault in the predict step" in row["error"]
    assert int(row["loadgen_unanswered"]) > 0
    assert row["loadgen_valid"] == "" and row["loadgen_invalid_reason"] == "" and row["loadgen_p99_ratio"] == ""
    assert row["loadgen_note"].startswith("no verdict: ") and "completed without an answer" in row["loadgen_note"]
    assert "loadgen       " + scenario + ": no verdict" in run.stdout
    assert not failed_runs.leaked_shm
    assert not live_processes_in_session(run.session_id)


# ------------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "argv,expected",
    [
        (["--scenario", "Server"], "--scenario applies to --load loadgen only (this run is --load burst)"),
        (["--load", "loadgen"], "--load loadgen needs --scenario"),
        (["--load", "loadgen", "--scenario", "Server"], "--scenario Server needs --rate R"),
        (["--load", "loadgen", "--scenario", "SingleStream", "--rate", "5"], "--rate applies to --load poisson only"),
        (["--load", "loadgen", "--scenario", "Offline", "--concurrency", "2"], "--concurrency applies to"),
        (["--load", "loadgen", "--scenario", "Offline", "--stability_pct", "5"], "LoadGen decides when its test"),
        (["--load", "loadgen", "--scenario", "Offline", "--find_peak", "--slo_ms", "5"], "drop --load loadgen"),
        # LoadGen lays out every sample before the first goes: gigabytes, with nothing in flight a timeout watches
        (
            ["--load", "loadgen", "--scenario", "MultiStream", "--concurrency", "100000000"],
            "--scenario MultiStream: 1e+10 samples to issue (--concurrency (samples per query) x --num_iters",
        ),
        (
            ["--load", "loadgen", "--scenario", "Server", "--rate", "1000000", "--duration_s", "600"],
            "--scenario Server: 6e+08 samples to issue (--rate x --duration_s), more than 10,000,000",
        ),
    ],
)
def test_bad_loadgen_input_is_one_line_exit_2_and_nothing_written(
    argv: list[str], expected: str, tmp_path: Path, capsys
) -> None:
    results = tmp_path / "results"
    assert server.main(["--device", "cpu", "--model", "identity", "--results_dir", str(results), *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and expected in err, err
    assert not results.exists()


def test_loadgen_not_importable_is_refused_before_anything_is_written(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "mlperf_loadgen", None)  # import now raises ImportError
    results = tmp_path / "results"
    argv = ["--device", "cpu", "--model", "identity", "--results_dir", str(results), "--load", "loadgen"]
    assert server.main([*argv, "--scenario", "Offline"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--load loadgen: MLPerf LoadGen cannot be imported" in err, err
    assert not results.exists()
