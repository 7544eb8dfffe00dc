"""python -m bench.peers at our own door (what bench.peer_client and bench.frontdoor were): perf_analyzer and our
generator against one `server.py --serve_only` per protocol, for real on a tiny scale (one repeat, concurrency 2,
closed loops), both protocols with zero errors, each served door kept up across its runs and started once, the
door's statistics around every run, and --report_only rendering the same report again; the door inline with JSON
tensors against the echo and against the same server over shm, and what the report makes of it; a perf_analyzer
that cannot be brought is exit status 2 before anything starts; a served peer that does not start fails its runs
(started once, said once), not the study; failures and missed targets are in the report and the exit status. A
machine where perf_analyzer cannot be brought fails the real run with tools/perf_analyzer.sh's reason: it is never
skipped.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import pytest
from conftest import ROOT, communicate_or_fail, kill_session, outlive_the_test, pids_running, start_session

from bench import peers
from bench.perf_analyzer import THROUGHPUT_COLUMN, PerfAnalyzerMissing, ensure_perf_analyzer, parse_csv
from tests.helpers import start_first

TOOL_TIMEOUT_S = 200  # about 25 s on 2 idle cores; a busy machine stretches every run
# Stability within 1000 %: the machine's noise must not fail a test of the plumbing.
TINY = [
    *("--models", "identity", "--peers", "ours", "--designs", "serial", "--batching", "off"),
    *("--protocols", "http", "grpc", "--concurrency", "2", "--rate_fractions", "--repeats", "1"),
    *("--duration_s", "1", "--pa_window_ms", "500", "--pa_max_trials", "3", "--pa_stability_pct", "1000"),
]


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    ensure_perf_analyzer()  # PerfAnalyzerMissing fails the test with the script's reason
    out = tmp_path_factory.mktemp("peers") / "door"
    proc = start_session([sys.executable, "-m", "bench.peers", "--out", str(out), *TINY], ROOT, None)
    stdout, stderr = communicate_or_fail(proc, TOOL_TIMEOUT_S, "bench.peers")
    assert proc.returncode == 0, f"{stdout[-4000:]}\n{stderr[-3000:]}"
    assert pids_running(str(out)) == []  # both servers stopped, no client left
    return out, stdout


def test_perf_analyzer_and_ours_measure_one_door_per_protocol(measured: tuple[Path, str]) -> None:
    out, stdout = measured
    runs = pd.read_csv(out / "runs.csv")
    # No echo (its runs are the door-against-echo test's and the report's, on known rows): the doors and both clients
    assert sorted(runs["experiment"]) == sorted(
        f"identity_ours-serial{p}_{c}" for p in ("", "-grpc") for c in ("ours", "pa")
    )
    assert (runs["status"] == "ok").all(), runs[["experiment", "error"]].to_string()
    assert (runs["throughput_rps"] > 0).all() and (runs["p99_latency_s"] > 0).all()
    assert runs["commit"].notna().all() and runs["cpu_model"].notna().all()  # what made each row
    door = runs[runs["experiment"].str.contains("ours-serial")]
    assert (door["door_failed"] == 0).all() and (door["door_requests"] > 0).all()
    for protocol in ("", "-grpc"):
        label = f"identity_ours-serial{protocol}_pa_bs1_nc_conc2_r0"
        assert parse_csv(out / "perf_analyzer" / f"{label}.csv")[THROUGHPUT_COLUMN] > 0
        log = (out / "perf_analyzer" / f"{label}.log").read_text()
        assert "Using synchronous calls for inference" in log and "error" not in log.lower()
    assert runs.loc[runs["experiment"] == "identity_ours-serial-grpc_pa", "grpc_channel_share"].iloc[0] == 3

    ours = pd.read_csv(out / "ours.csv")
    assert len(ours) == 2 and (ours["status"] == "ok").all() and (ours["concurrency"] == 2).all()
    served = pd.read_csv(out / "served.csv")  # each door started once for both clients' runs
    assert sorted(served["experiment"]) == [
        "served_identity_ours-serial-grpc_closed_r0",
        "served_identity_ours-serial_closed_r0",
    ]
    assert (served["status"] == "ok").all() and (served["door_errors"] == 0).all()
    servers = pd.read_csv(out / "servers.csv")
    assert len(servers) == 2 and (servers["status"] == "ok").all()

    report = (out / "peers.md").read_text()
    assert report.strip() in stdout
    assert "| ours serial | closed c2 |" in report and "| ours serial grpc | closed c2 |" in report
    assert "| identity | ours serial grpc | closed c2 | perf_analyzer |" in report  # the door's own time
    assert "## Failures\n\nNone." in report and "- rows: 4 (4 ok)" in report


def test_report_only_renders_the_same_report(measured: tuple[Path, str], tmp_path: Path, capsys) -> None:
    out = tmp_path / "again"
    shutil.copytree(measured[0], out)
    before = (out / "peers.md").read_text()
    assert peers.main(["--out", str(out), "--report_only"]) == 0, capsys.readouterr().err[-3000:]
    again = (out / "peers.md").read_text()
    assert again[again.index("## Targets") :] == before[before.index("## Targets") :]
    assert f"- command: `{(out / 'command.txt').read_text().strip()}`" in again  # the measuring command named


DOOR_TINY = [
    *("--models", "identity", "--peers", "echo", "shm", "ours", "--designs", "serial", "--batching", "off"),
    *("--placements", "inline", "--wires", "json", "--clients", "ours", "--concurrency", "2"),
    *("--rate_fractions", "--repeats", "1", "--duration_s", "1"),
]


@pytest.fixture(scope="module")
def door_inline(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[subprocess.Popen, Path]]:
    """The DOOR_TINY study, started at the module's start: it goes on beside the perf_analyzer study (each mostly
    waits on its servers' start and its 1 s runs; neither judges a time)."""
    out = tmp_path_factory.mktemp("inline") / "door"
    proc = start_session([sys.executable, "-m", "bench.peers", "--out", str(out), *DOOR_TINY], ROOT, None)
    outlive_the_test(proc.pid)
    yield proc, out
    if proc.poll() is None:
        kill_session(proc.pid)
        proc.communicate(timeout=30)


@pytest.fixture(scope="module", autouse=True)
def _door_inline_starts_first(request: pytest.FixtureRequest) -> None:
    start_first(request, ("door_inline",))


def test_the_door_inline_with_json_against_the_echo_and_shm(door_inline: tuple[subprocess.Popen, Path]) -> None:
    """What bench.frontdoor measured: the door's figures beside the echo's (same client, protocol and wire) and the
    same server's without a door (shm: its client inside), and the report's ratios from those rows."""
    proc, out = door_inline
    stdout, stderr = communicate_or_fail(proc, TOOL_TIMEOUT_S, "bench.peers")
    assert proc.returncode == 0, f"{stdout[-4000:]}\n{stderr[-3000:]}"
    assert pids_running(str(out)) == []
    started = [log.read_text().splitlines()[0] for log in (out / "logs").glob("*.log")]  # each command as it ran
    started = [line for line in started if "server.py" in line]
    assert len(started) == 4 and all(line.count("--results_dir") == 1 for line in started)  # door, 2 clients, shm
    runs = pd.read_csv(out / "runs.csv").set_index("experiment")
    assert sorted(runs.index) == [
        "identity_echo-json_ours",
        "identity_ours-serial-inline-json_ours",
        "identity_shm-serial_ours",
    ]
    assert (runs["status"] == "ok").all(), runs["error"].to_string()
    rps = runs["throughput_rps"]
    assert (rps > 0).all() and runs.loc["identity_ours-serial-inline-json_ours", "door_failed"] == 0
    served = pd.read_csv(out / "served.csv")  # the served door's own row: inline, as asked
    assert list(served["door"]) == ["inline"] and list(served["status"]) == ["ok"]
    door, echo, shm = (rps[f"identity_{slug}_ours"] for slug in ("ours-serial-inline-json", "echo-json", "shm-serial"))
    p50_ms = runs["p50_latency_s"] * 1e3
    added_ms = p50_ms["identity_ours-serial-inline-json_ours"] - p50_ms["identity_shm-serial_ours"]
    report = (out / "peers.md").read_text()
    assert (
        f"| identity, 1 image | ours serial inline json | c2 | {door:,.0f} | {door / echo:.2f} | {door / shm:.3f} | "
        f"{(1 - door / shm) * 100:.1f} % | {added_ms:.3f} |"
    ) in report
    assert "| shm serial | closed c2 |" in report and "## Failures\n\nNone." in report
    args = argparse.Namespace(**{**vars(peers.study_args(out)), "batch_size": 1})
    assert "--no-binary_data" in peers.our_flags(args, "identity", peers.Peer("ours", "serial", wire="json"), "closed")


def test_perf_analyzer_missing_is_exit_2_before_anything_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    def missing() -> Path:
        raise PerfAnalyzerMissing("tools/perf_analyzer.sh: cannot download tritonclient 2.40.0: no network")

    monkeypatch.setattr(peers.pa, "ensure_perf_analyzer", missing)
    out = tmp_path / "peer"
    assert peers.main(["--out", str(out), "--peers", "ours"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot download tritonclient 2.40.0: no network" in err
    assert not out.exists()


def test_a_refused_flag_is_exit_2_before_perf_analyzer_is_brought(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """Bad input writes nothing: perf_analyzer's download (into .tools/) waits until every flag has passed."""
    brought: list[str] = []
    monkeypatch.setattr(peers.pa, "ensure_perf_analyzer", lambda: brought.append("brought"))
    out = tmp_path / "peer"
    with pytest.raises(SystemExit) as exited:
        peers.main(["--out", str(out), "--peers", "ours", "--", "--num_iters", "0"])
    assert exited.value.code == 2
    assert "--num_iters" in capsys.readouterr().err and brought == [] and not out.exists()


def test_a_peer_that_does_not_start_fails_its_runs_once_not_the_study(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """server.py refuses the served door's flags: each of its runs says why, the door was tried once, and the exit
    status is 1."""
    served_flags = peers.served_flags
    monkeypatch.setattr(peers, "served_flags", lambda *given: [*served_flags(*given), "--batch_size", "0"])
    out = tmp_path / "out"
    argv = ["--out", str(out), *TINY[:8], "--peers", "ours", "--clients", "ours", "--concurrency", "1", "2"]
    assert peers.main([*argv, "--rate_fractions", "--repeats", "1"]) == 1, capsys.readouterr().err[-3000:]
    runs = pd.read_csv(out / "runs.csv").set_index(["experiment", "concurrency"])
    assert runs["status"].to_dict() == {
        ("identity_ours-serial_ours", 1): "error",
        ("identity_ours-serial_ours", 2): "error",
    }
    assert runs["error"].str.contains("--batch_size").all()
    servers = pd.read_csv(out / "servers.csv")
    assert list(servers["status"]) == ["error"] and "--batch_size" in servers["error"].iloc[0]
    report = (out / "peers.md").read_text()
    assert "- identity r0 ours serial (served, logs/served_identity_ours-serial_closed_r0.log): " in report


def test_failures_and_missed_targets_are_reported(tmp_path: Path) -> None:
    figures = {"throughput_rps": 1000.0, "p50_latency_s": 0.001, "repeat": 0, "load": "closed", "error": ""}
    failure = "Thread [0] had error: failed to connect (exit status 99)"
    rows = pd.DataFrame(
        [
            {"experiment": "identity_echo_ours", "concurrency": 1, "status": "ok", **figures, "p99_latency_s": 0.001},
            {"experiment": "identity_echo_ours", "concurrency": 4, "status": "ok", **figures, "p99_latency_s": 0.001},
            {
                "experiment": "identity_ours-serial_pa",
                "concurrency": 1,
                "status": "ok",
                **figures,
                "p99_latency_s": 0.002,
            },
            {
                "experiment": "identity_ours-serial_ours",
                "concurrency": 1,
                "status": "ok",
                **figures,
                "p99_latency_s": 0.003,
            },
            {"experiment": "identity_ours-serial_pa", "concurrency": 4, **figures, "status": "error", "error": failure},
            {
                "experiment": "identity_ours-serial_ours",
                "concurrency": 4,
                "status": "ok",
                **figures,
                "p99_latency_s": 0.002,
            },
        ]
    )
    args = argparse.Namespace(models=["identity"], max_batch_size=16, max_queue_delay_ms=2.0, out=tmp_path)
    text = "\n".join(peers.report(args, rows, tmp_path))
    assert f"- identity r0 ours serial closed c4 perf_analyzer: {failure}" in text
    assert "- our door over HTTP at concurrency 1 and 4: our p99 / perf_analyzer's 1.50 over 1 design(s)" in text
    assert "within 0.9-1.1: 0 of 1. Target: all: **not met**" in text
    assert peers.target_met(args, rows)  # no served peer failed: the runs' statuses decide the exit status


@pytest.mark.parametrize(
    ("folder", "figure"),
    [
        ("peer_client", "our door over HTTP at concurrency 1 and 4: our p99 / perf_analyzer's 1.28 (1.16-1.39)"),
        ("door", "| identity, 1 image | ours serial inline | c1 | 2,322 | 0.50 | 0.297 | 70.3 % | 0.252 |"),
    ],
)
def test_the_committed_door_studies_re_render_their_figures(
    folder: str, figure: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A committed network study's report again from its rows alone: the same tables, targets and failures."""
    shutil.copytree(ROOT / "results" / folder, tmp_path / folder)
    assert peers.main(["--out", str(tmp_path / folder), "--report_only"]) == 0  # every run and peer ok
    committed = (ROOT / "results" / folder / "peers.md").read_text()
    again = (tmp_path / folder / "peers.md").read_text()
    assert again[again.index("## Targets") :] == committed[committed.index("## Targets") :]
    assert figure in again
