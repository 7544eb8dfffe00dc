"""--load trace (serverbench/config/trace_load.py): a file of arrival times replayed as an open loop, each request
sent at its time and its latency counted from it; every bad file refused in one line before anything starts."""

from __future__ import annotations

import os
from pathlib import Path

import pandas as pd
import pytest
from conftest import TINY, make_config, run_server

from serverbench.config.flags import ConfigError
from serverbench.config.generators import generator_config
from serverbench.config.trace_load import read_trace
from tests.helpers import exit_code

IDENTITY = [*TINY, "--model", "identity", "--image_size", "16", "--batch_size", "1", "--no-ceiling"]


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "name, text, times",
    [
        ("plain.csv", "0\n0.5\n0.5\n2\n", (0.0, 0.5, 0.5, 2.0)),
        ("header.csv", "time_s,user\n# a comment\n0.1,7\n\n0.2,8\n", (0.1, 0.2)),
        ("lines.jsonl", '{"time_s": 0, "user": 1}\n0.25\n{"time_s": 1e-3}\n', None),
        ("objects.jsonl", '{"time_s": 0}\n{"time_s": 0.001, "x": [1]}\n', (0.0, 0.001)),
        # docs/field-formats.md's example as it is printed, and a spreadsheet's export (a byte-order mark, CRLF)
        ("annotated.csv", "time_s  # a header\n0.000\n0.012\n0.012  # two at once\n0.250\n", (0.0, 0.012, 0.012, 0.25)),
        ("excel.csv", "\ufefftime_s\r\n0.5\r\n1\r\n", (0.5, 1.0)),
    ],
)
def test_a_trace_is_read_as_documented(tmp_path: Path, name: str, text: str, times) -> None:
    path = write(tmp_path, name, text)
    if times is None:  # 0.25 then 0.001: decreasing
        with pytest.raises(ConfigError, match="line 3: 0.001 s comes before the arrival above it"):
            read_trace(str(path))
    else:
        assert read_trace(str(path)) == times


@pytest.mark.parametrize(
    "name, text, fragment",
    [
        (None, "", "no such file"),
        ("folder", None, "a folder, not a file"),  # it said "no such file", as it did for a pipe
        ("pipe", None, "not a regular file (a pipe, a device?)"),
        ("empty.csv", "", "no arrival times in it"),
        ("header_only.csv", "time_s\n", "no arrival times in it"),
        ("unsorted.csv", "0\n2\n1\n", "line 3: 1 s comes before the arrival above it (2 s)"),
        ("negative.csv", "-0.5\n1\n", "line 1: -0.5 s is negative"),
        ("far.csv", "0\n1e300\n", "line 2: 1e+300 s is past the longest run"),
        ("words.csv", "0\n1\nsoon\n", "line 3: 'soon' is not a number of seconds"),
        ("nan.csv", "0\nnan\n", "line 2: 'nan' is not a finite number of seconds"),
        ("inf.jsonl", "0\n1e999\n", "line 2: inf is not a finite number of seconds"),
        ("bad.jsonl", "0\n{oops\n", "line 2: not JSON"),
        ("key.jsonl", '{"t": 1}\n', "line 1: an object without time_s"),
        ("bool.jsonl", "true\n", "line 1: True is not a number of seconds"),
        ("null.jsonl", '0\n{"time_s": null}\n', "line 2: null is not a number of seconds"),  # not a header, skipped
        (
            "huge.jsonl",
            "0\n1" + "0" * 400 + "\n",
            "0000 is not a finite number of seconds",
        ),  # float() overflows: no traceback
    ],
)
def test_a_bad_trace_is_one_line_and_exit_2_and_nothing_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture, name: str | None, text: str, fragment: str
) -> None:
    path = tmp_path / (name or "missing.csv")
    if name == "folder":
        path.mkdir()
    elif name == "pipe":
        os.mkfifo(path)  # a read would wait for a writer
    elif name is not None:
        write(tmp_path, name, text)
    out = tmp_path / "results"
    assert exit_code([*IDENTITY, "--load", "trace", "--trace_file", str(path), "--results_dir", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and fragment in err[0], err
    assert not out.exists()


@pytest.mark.parametrize(
    "flags, fragment",
    [
        (["--load", "trace"], "--load trace needs --trace_file F"),
        (["--trace_file", "t.csv"], "--trace_file applies to --load trace only (this run is --load burst)"),
        (["--load", "trace", "--trace_file", "t.csv", "--duration_s", "5"], "--duration_s with --load trace"),
        (["--load", "trace", "--trace_file", "t.csv", "--stability_pct", "5"], "--stability_pct with --load trace"),
        (["--load", "trace", "--trace_file", "t.csv", "--rate", "5"], "--rate applies to --load poisson only"),
    ],
)
def test_the_trace_flags_apply_to_the_trace_alone(tmp_path: Path, flags: list[str], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        make_config([*IDENTITY, *flags, "--results_dir", str(tmp_path)])


def test_generators_share_the_arrivals_in_turn(tmp_path: Path) -> None:
    trace = write(tmp_path, "t.csv", "\n".join(str(t / 10) for t in range(7)) + "\n")
    flags = [*IDENTITY, "--transport", "http", "--load", "trace", "--trace_file", str(trace)]
    cfg = make_config([*flags, "--generators", "3", "--results_dir", str(tmp_path / "r")])
    assert cfg.num_iters == 7
    shares = [generator_config(cfg, index) for index in range(3)]
    assert [share.trace_offsets_s for share in shares] == [(0.0, 0.3, 0.6), (0.1, 0.4), (0.2, 0.5)]
    assert [share.num_iters for share in shares] == [3, 2, 2]
    with pytest.raises(ConfigError, match="--generators 8 with a trace of 7 arrival"):
        make_config([*flags, "--generators", "8", "--results_dir", str(tmp_path / "r")])


def test_a_replayed_trace_sends_at_its_times_and_counts_latency_from_them(tmp_path: Path) -> None:
    """Three arrivals at once, then two more after the backlog has drained, against a serial server that takes at
    least 30 ms a request: the three queue (latency from their common intended time grows by about 30 ms each),
    the later ones do not."""
    times_s = [0.0, 0.0, 0.0, 0.35, 0.45, 0.6]
    trace = write(tmp_path, "arrivals.csv", "time_s\n" + "\n".join(map(str, times_s)) + "\n")
    args = [*IDENTITY, "--design", "serial", "--inject_delay_ms", "30", "--ring_slots", "16", "--save_requests"]
    run = run_server([*args, "--load", "trace", "--trace_file", str(trace)], tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    row = run.row
    assert row["status"] == "ok" and row["load"] == "trace" and row["requests_sent"] == "6"
    assert row["trace_name"] == "arrivals.csv" and row["trace_requests"] == "6"
    assert float(row["trace_span_s"]) == 0.6 and float(row["offered_rate_rps"]) == pytest.approx(5 / 0.6)
    assert "load          trace: arrivals.csv, offered 8.333, achieved" in run.stdout
    requests = pd.read_csv(tmp_path / row["requests_file"]).query("not warmup").sort_values("request_id")
    intended_s = (requests["sent_ns"] - requests["sent_ns"].iloc[0]).to_numpy() / 1e9
    assert intended_s == pytest.approx(times_s, abs=1e-6)  # each counted from its time in the trace
    late_s = (requests["send_start_ns"] - requests["sent_ns"]).to_numpy() / 1e9
    assert (late_s >= 0).all() and (late_s < 0.05).all(), late_s  # and sent then
    latency_s = requests["latency_s"].to_numpy()
    assert latency_s[1] >= latency_s[0] + 0.025 and latency_s[2] >= latency_s[1] + 0.025  # the three queued
    assert latency_s[2] >= 0.085
    assert max(latency_s[3:]) < latency_s[2]  # the later ones found the backlog gone


def test_a_gap_longer_than_timeout_s_with_nothing_in_flight_is_no_hang(tmp_path: Path) -> None:
    """--timeout_s bounds the wait for an answer the backend owes: a gap in the arrivals owes nothing."""
    trace = write(tmp_path, "gap.csv", "0\n2.5\n")
    run = run_server([*IDENTITY, "--load", "trace", "--trace_file", str(trace), "--timeout_s", "1"], tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.row["status"] == "ok" and run.row["responses_received"] == "2"
