"""What report.py reads: the files it refuses in one line, the reference's own CSV format, compile's spellings,
and figures no run writes (infinite ones, latency columns cut away), read without a warning or a traceback."""

from __future__ import annotations

import warnings
from pathlib import Path

import pandas as pd
import pytest

import report


@pytest.mark.parametrize(
    "name,content,expected",
    [
        (
            "header with spaces",
            "batch_size, compile, throughput\n1, False, 3.0\n",
            "header is not one this tool writes",
        ),
        ("empty", "", "empty"),
        ("no throughput", "batch_size,compile\n1,False\n", "no column throughput"),
        ("binary", bytes(range(256)) * 2, "not UTF-8 text"),
        ("unknown compile value", "batch_size,compile,throughput\n1,maybe,3.0\n", "neither true nor false"),
        ("another tool's CSV", "a,b\n1,2\n", "no column batch_size, compile, throughput"),
        ("a peak CSV", "experiment,batch_size,compile,peak_rate_rps,status\nserial,1,False,5.0,ok\n", "a peak CSV"),
    ],
)
@pytest.mark.parametrize("mode", ["report", "pytorch_benchmark"])
def test_a_file_that_is_not_a_results_csv_is_one_line_and_exit_2(
    tmp_path: Path, capsys, name: str, content, expected: str, mode: str
) -> None:
    """The report and the conversion into benchmark records refuse the same files, and make nothing."""
    path = tmp_path / "runs.csv"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    target = ["--plots_dir", str(tmp_path / "plots")] if mode == "report" else ["--pytorch_benchmark", str(tmp_path)]
    assert report.main([str(path), *target]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("report.py: error: ") and expected in err[0]
    assert [p.name for p in tmp_path.iterdir()] == ["runs.csv"]


def test_a_csv_in_the_references_own_format_is_summarised(tmp_path: Path) -> None:
    path = tmp_path / "output.csv"
    pd.DataFrame(
        {
            "batch_size": [32, 32],
            "compile": [False, False],
            "torch_load_time": [0.1, 0.1],
            "m_compile_time": [None, None],
            "warmup_latency": [5.0, 6.0],
            "average_latency": [4.0, 5.0],
            "max_latency": [9.0, 9.0],
            "min_latency": [1.0, 1.0],
            "throughput": [390.0, 400.0],
            "gpu_util": [38.0, 39.0],
        }
    ).to_csv(path, index=False)
    report.write_report(path, tmp_path, tmp_path / "plots", baseline="serial")
    table = (tmp_path / "output_32_false.md").read_text()
    assert "| original | 5.500 +/- 0.707 | 4.500 +/- 0.707 | n/a | 395.0 +/- 7.1 | 38.5 +/- 0.7 | 1.8 | 2/2 |" in table


def test_infinite_figures_and_missing_latency_columns_report_without_a_warning_or_a_traceback(tmp_path: Path) -> None:
    """A CSV of the required columns and two infinite throughputs gave six numpy warnings, then a KeyError."""
    path = tmp_path / "runs.csv"
    rows = [(1, "inf", "serial", 0), (1, "10.0", "serial", 1), (1, "12.0", "threaded", 0), (1, "inf", "threaded", 1)]
    path.write_text(
        "batch_size,compile,throughput,status,experiment,repeat\n"
        + "".join(f"{b},False,{t},ok,{e},{r}\n" for b, t, e, r in rows)
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        written = report.write_report(path, tmp_path, tmp_path / "plots", baseline="serial")
    summary = (tmp_path / "summary.md").read_text()
    assert "2 figure(s) of the CSV were infinite, which no run measures: read as missing." in summary
    assert [p.name for p in written if p.suffix == ".png"] == ["throughput_vs_batch_size.png"]  # no latency: no plot


def test_compile_is_read_in_its_usual_spellings(tmp_path: Path) -> None:
    path = tmp_path / "runs.csv"
    values = ["True", "false", "1", "0", "yes", "no", "on", "OFF"]
    pd.DataFrame({"batch_size": 1, "compile": values, "throughput": 1.0}).to_csv(path, index=False)
    assert report.load_runs(path)["compile"].tolist() == [True, False, True, False, True, False, True, False]


def test_a_run_again_replaces_the_failed_or_interrupted_row_of_its_own_cell_only() -> None:
    """The runner's own failure rows (no run_id) name no load without a load axis, while the server's rows of the
    same cell do (a fixed --load closed --concurrency 4): the crash that a run again mended stayed a failure, and a
    timed-out run's own interrupted row stood beside the runner's timeout row."""
    from serverbench.records.report_input import drop_superseded

    cell = {"experiment": "serial", "batch_size": 2, "compile": False, "repeat": 0}
    rows = pd.DataFrame(
        [
            {**cell, "status": "crashed", "attempt": 1},  # the runner's: the run died without its row
            {**cell, "run_id": "a", "concurrency": 4, "status": "interrupted", "attempt": 2},  # stopped at the timeout
            {**cell, "status": "sweep_timeout", "attempt": 2},  # the runner's row of that same attempt
            {**cell, "run_id": "b", "concurrency": 4, "status": "ok", "attempt": 3},
            # a load axis: each point a cell of its own, its runner rows naming it
            {**cell, "offered_rate_rps": 20.0, "status": "crashed", "attempt": 1},
            {**cell, "run_id": "c", "offered_rate_rps": 50.0, "status": "crashed", "attempt": 1},
            {**cell, "run_id": "d", "offered_rate_rps": 50.0, "status": "ok", "attempt": 2},
            # separate runs of one configuration (a hand-made CSV: attempt 1 each) all stand
            {**cell, "repeat": 1, "run_id": "e", "concurrency": 4, "status": "crashed", "attempt": 1},
            {**cell, "repeat": 1, "run_id": "f", "concurrency": 4, "status": "ok", "attempt": 1},
        ]
    )
    kept = drop_superseded(rows)
    assert list(zip(kept["repeat"], kept["status"], kept["offered_rate_rps"].fillna(0))) == [
        (0, "ok", 0),
        (0, "crashed", 20.0),
        (0, "ok", 50.0),
        (1, "crashed", 0),
        (1, "ok", 0),
    ]
