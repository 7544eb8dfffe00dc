"""The report's numbers against a hand-made CSV; the sweep's cell order; the timeline's structure."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pandas as pd
import pytest

import report
import sweep
from serverbench.records import markdown
from serverbench.records.timeline import build_timeline
from serverbench.schema.records import RequestRecord
from tests.helpers import timed_record


def _row(experiment: str, repeat: int, throughput: float, p99: float, status: str = "ok", **extra) -> dict:
    return {
        "batch_size": 32,
        "compile": False,
        "warmup_latency": 2.0 + repeat,
        "average_latency": 0.25,
        "max_latency": 0.5,
        "min_latency": 0.1,
        "throughput": throughput,
        "gpu_util": None,
        "p99_latency_s": p99,
        "status": status,
        "error": "" if status == "ok" else "OutOfMemoryError: boom",
        "experiment": experiment,
        "repeat": repeat,
        "mean_request_queue_ms": 1.0,
        "mean_h2d_ms": 2.0,
        "mean_predict_ms": 3.0,
        "mean_d2h_ms": 4.0,
        "mean_response_queue_ms": 5.0,
        **extra,
    }


@pytest.fixture()
def hand_made(tmp_path: Path) -> Path:
    rows = [_row("serial", r, t, 0.5) for r, t in enumerate([100.0, 110.0, 120.0])]
    rows += [_row("pipelined_2w", r, t, 0.25) for r, t in enumerate([200.0, 220.0, 240.0])]
    rows += [_row("threaded", r, t, p) for r, (t, p) in enumerate([(120.0, 0.6), (100.0, 0.4), (110.0, 0.5)])]
    rows.append(_row("pipelined_2w", 3, 1e9, 9.9, status="oom"))  # failed: listed, never averaged
    path = tmp_path / "runs.csv"
    pd.DataFrame(rows).to_csv(path, index=False)
    return path


def test_tables_have_mean_and_std_over_ok_repeats(hand_made: Path, tmp_path: Path) -> None:
    report.write_report(hand_made, tmp_path, tmp_path / "plots", baseline="serial")
    table = (tmp_path / "output_32_false.md").read_text().splitlines()
    assert table[0].startswith("| experiment | warmup_latency (s) | average_latency (s)")
    serial = next(line for line in table if line.startswith("| serial "))
    pipelined = next(line for line in table if line.startswith("| pipelined_2w "))
    assert "110.0 +/- 10.0" in serial and "3.000 +/- 1.000" in serial and "| 3/3 |" in serial
    assert "220.0 +/- 20.0" in pipelined and "| 3/4 |" in pipelined  # the oom run is not averaged
    assert "n/a" in serial  # no GPU utilisation in these rows


def test_ratios_and_verdicts_against_the_baseline(hand_made: Path, tmp_path: Path) -> None:
    report.write_report(hand_made, tmp_path, tmp_path / "plots", baseline="serial")
    summary = (tmp_path / "summary.md").read_text()
    # pipelined_2w ran each round at exactly twice serial's throughput and half its p99: no spread, no doubt
    pipelined = next(line for line in summary.splitlines() if line.startswith("| pipelined_2w | 2.000 [2.000, 2.000]"))
    assert "100.0 % faster" in pipelined and "0.500 [0.500, 0.500]: 50.0 % faster" in pipelined
    threaded = next(line for line in summary.splitlines() if line.startswith("| threaded |") and "]: " in line)
    assert threaded.count("cannot tell apart") == 2  # ratios 1.2, 0.91, 0.92 by round
    verdicts = [line for line in summary.splitlines() if line.startswith("- ") and " than serial " in line]
    assert "- pipelined_2w is 100.0 % faster than serial (throughput pipelined_2w/serial 2.000, 95 % interval" in (
        "\n".join(verdicts)
    )
    assert any(
        line.startswith("- cannot tell threaded and serial apart at this noise") for line in summary.splitlines()
    )
    assert "| pipelined_2w | 32 | False | 3 | oom |" in summary


def test_the_comparison_pairs_runs_by_repeat_not_by_row_order(tmp_path: Path) -> None:
    """Rows written out of round order (a resumed sweep) still pair round with round: b is 10 % slower in each."""
    rows = [_row("a", r, t, 0.5) for r, t in enumerate([100.0, 150.0, 120.0])]
    rows += [_row("b", r, t * 0.9, 0.5) for r, t in reversed(list(enumerate([100.0, 150.0, 120.0])))]
    path = tmp_path / "runs.csv"
    pd.DataFrame(rows).to_csv(path, index=False)
    report.write_report(path, tmp_path, tmp_path / "plots", baseline="a")
    summary = (tmp_path / "summary.md").read_text()
    assert "- b is 10.0 % slower than a (throughput b/a 0.900, 95 % interval 0.900 to 0.900, 3 pairs)" in summary


def test_plots_are_written(hand_made: Path, tmp_path: Path) -> None:
    runs = pd.read_csv(hand_made)
    (tmp_path / "gpu").mkdir()
    pd.DataFrame(
        {
            "t_ns": [0, 10**8, 2 * 10**8],
            "util_pct": [10.0, 90.0, 95.0],
            "mem_used_mib": [1e3, 2e3, 2e3],
            "power_w": [100.0, 300.0, 310.0],
        }
    ).to_csv(tmp_path / "gpu" / "run.csv", index=False)
    runs["gpu_samples"] = 0
    runs.loc[0, ["gpu_samples", "gpu_samples_file"]] = [3, "gpu/run.csv"]
    runs.to_csv(hand_made, index=False)
    written = report.write_report(hand_made, tmp_path, tmp_path / "plots", baseline="serial")
    pngs = {p.name for p in written if p.suffix == ".png"}
    assert {
        "throughput_vs_batch_size.png",
        "avg_latency_vs_batch_size.png",
        "stage_breakdown_bs32.png",
        "gpu_over_time.png",
    } <= pngs
    for name in pngs:
        assert (tmp_path / "plots" / name).stat().st_size > 10_000
    (tmp_path / "gpu" / "run.csv").unlink()  # the CSV away from its samples (copied out of a bundle): no crash
    written = report.write_report(hand_made, tmp_path, tmp_path / "plots2", baseline="serial")
    assert "gpu_over_time.png" not in {p.name for p in written}


def test_report_command_line(hand_made: Path, tmp_path: Path, capsys) -> None:
    assert report.main([str(hand_made), "--plots_dir", str(tmp_path / "p")]) == 0
    assert "summary.md" in capsys.readouterr().out
    assert report.main([str(tmp_path / "missing.csv")]) == 2


def test_an_empty_experiment_cell_is_named_as_server_py_names_its_design(tmp_path: Path) -> None:
    """A row whose experiment cell was emptied by hand (or by a spreadsheet) is reported, not a TypeError."""
    rows = [_row("serial", r, 100.0 + r, 0.5, design="serial", num_workers=1) for r in range(2)]
    rows += [_row("", r, 200.0 + r, 0.25, design="pipelined", num_workers=2) for r in range(2)]
    path = tmp_path / "runs.csv"
    pd.DataFrame(rows).to_csv(path, index=False)
    assert report.main([str(path), "--out_dir", str(tmp_path / "out"), "--plots_dir", str(tmp_path / "p")]) == 0
    table = (tmp_path / "out" / "output_32_false.md").read_text()
    assert "| pipelined_2w " in table and "| 2/2 |" in table and "| nan " not in table


def test_cells_are_interleaved_and_shuffled_reproducibly() -> None:
    experiments = sweep.experiments_from(["serial", "pipelined"], [1, 2], ["deep=--max_inflight 32"])
    assert [e.name for e in experiments] == ["serial", "pipelined_1w", "pipelined_2w", "deep"]
    assert experiments[3].flags == ("--max_inflight", "32")
    cells = sweep.plan(experiments, [1, 32], [True, False], repeats=3, seed=5)
    per_round = len(experiments) * 2 * 2
    rounds = [cells[i * per_round : (i + 1) * per_round] for i in range(3)]
    for r, round_cells in enumerate(rounds):  # every round visits every cell once, its repeat index all r
        assert {c.key[:3] for c in round_cells} == {c.key[:3] for c in rounds[0]}
        assert {c.repeat for c in round_cells} == {r}
    assert [c.key[:3] for c in rounds[0]] != [c.key[:3] for c in rounds[1]]  # shuffled per round
    assert cells == sweep.plan(experiments, [1, 32], [True, False], repeats=3, seed=5)
    assert cells != sweep.plan(experiments, [1, 32], [True, False], repeats=3, seed=6)
    with pytest.raises(ValueError):
        sweep.experiments_from(["serial"], [1], ["no_equals_sign"])
    # Only custom experiments (`--designs` with no value): each with its own flags, a design among them.
    only = sweep.experiments_from([], [1], ["serial=--design serial --intra_op_threads 2"])
    assert [(e.name, e.flags) for e in only] == [("serial", ("--design", "serial", "--intra_op_threads", "2"))]
    with pytest.raises(ValueError, match="nothing to sweep"):
        sweep.experiments_from([], [1], [])


def _record(request_id: int, worker: int) -> RequestRecord:
    base = 1_000_000 * request_id
    return timed_record(
        request_id,
        (base, base + 100, base + 300, base + 600, base + 700, base + 900),
        warmup=request_id == 0,
        batch_size=4,
        copy_ms=(0.1, 0.2, 0.05),
        worker=worker,
        send_done_ns=base + 50,
        h2d_start_ns=base + 200,
        forward_start_ns=base + 400,
        d2h_start_ns=base + 650,
        h2d_thread="h2d",
        predict_thread=f"predict-{worker}",
        d2h_thread="d2h",
    )


def test_timeline_has_a_lane_per_thread_and_a_span_per_step() -> None:
    trace = json.loads(json.dumps(build_timeline([_record(i, i % 2) for i in range(4)])))
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert names == {"sender", "receiver", "h2d", "predict-0", "predict-1", "d2h"}
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == 4 * 4  # send, h2d, forward, d2h per request
    forward_1 = next(e for e in spans if e["name"] == "forward #1")
    assert forward_1["ts"] == pytest.approx((1_000_000 + 400) / 1e3) and forward_1["dur"] == pytest.approx(0.2)
    waits = [e for e in trace["traceEvents"] if e["ph"] in ("b", "e")]
    assert len(waits) == 4 * 2 * 2  # request and response queue per request, begin and end


def test_the_tables_show_each_runs_spread_and_flag_noisy_repeats(tmp_path: Path, capsys) -> None:
    rows = [
        dict(_row("serial", r, t, 0.5), window_throughput_cv_pct=cv, ceiling_spread_pct=2.0)
        for r, (t, cv) in enumerate([(100.0, 1.0), (102.0, 3.0), (98.0, 2.0)])
    ]
    rows += [
        dict(_row("pipelined_2w", r, t, 0.3), window_throughput_cv_pct=1.0, ceiling_spread_pct=2.0)
        for r, t in enumerate([100.0, 130.0, 80.0])
    ]  # CV 24.4 %
    path = tmp_path / "runs.csv"
    pd.DataFrame(rows).to_csv(path, index=False)
    report.write_report(path, tmp_path, tmp_path / "plots", baseline="serial")
    table = (tmp_path / "output_32_false.md").read_text()
    assert "| window CV (%) | ceiling spread (%) | repeats CV (%) |" in table
    serial = next(line for line in table.splitlines() if line.startswith("| serial "))
    assert serial.endswith("| 2.0 +/- 1.0 | 2.0 +/- 0.0 | 2.0 | 3/3 |")
    pipelined = next(line for line in table.splitlines() if line.startswith("| pipelined_2w "))
    assert "| 24.4 (over 10) | 3/3 |" in pipelined
    summary = (tmp_path / "summary.md").read_text()
    assert (
        "## Noisy experiments" in summary
        and "pipelined_2w at batch 32, compile off: throughput spreads by 24.4 %" in summary
        and "serial at batch" not in summary.split("## Noisy experiments")[1]
    )
    assert "pipelined_2w at batch 32" in capsys.readouterr().err


def test_efficiency_shows_its_interval_where_the_rows_have_one_and_old_csvs_still_report(tmp_path: Path) -> None:
    def table(rows: list[dict], name: str) -> str:
        path = tmp_path / f"{name}.csv"
        pd.DataFrame(rows).to_csv(path, index=False)
        report.write_report(path, tmp_path / name, tmp_path / name / "plots", baseline="serial")
        text = (tmp_path / name / "output_32_false.md").read_text()
        return next(line for line in text.splitlines() if line.startswith("| serial "))

    ends = [(0.96, 0.90, 1.02), (0.98, 0.92, 1.06)]
    new = [
        _row("serial", r, 100.0, 0.5, efficiency=e, efficiency_low=lo, efficiency_high=hi)
        for r, (e, lo, hi) in enumerate(ends)
    ]
    assert "| 0.970 +/- 0.014 (0.910-1.040) |" in table(new, "new")  # each end's mean over the repeats
    # A CSV written before the interval columns: the bare mean +/- std, as before.
    old = [_row("serial", r, 100.0, 0.5, efficiency=e) for r, (e, _, _) in enumerate(ends)]
    assert "| 0.970 +/- 0.014 |" in table(old, "old")
    # Old and new rows in one file (the header widened): the interval is of the rows that have one.
    mixed = [old[0], new[1]]
    assert "| 0.970 +/- 0.014 (0.920-1.060) |" in table(mixed, "mixed")
    # The columns present but empty (no ceiling): no interval.
    empty = [dict(r, efficiency_low=None, efficiency_high=None) for r in old]
    assert "| 0.970 +/- 0.014 |" in table(empty, "empty")


def test_a_torchrun_job_counts_once_by_its_job_row(tmp_path: Path) -> None:
    rows = [
        _row("serial", 0, 100.0, 0.5),
        _row("pipelined_2w", 0, 90.0, 0.3, scope="rank", rank=0),
        _row("pipelined_2w", 0, 110.0, 0.3, scope="rank", rank=1),
        _row("pipelined_2w", 0, 195.0, 0.3, scope="job"),
    ]
    path = tmp_path / "runs.csv"
    pd.DataFrame(rows).to_csv(path, index=False)
    runs = report.load_runs(path)
    assert sorted(zip(runs["experiment"], runs["throughput"])) == [("pipelined_2w", 195.0), ("serial", 100.0)]


# ------------------------------------------------------------------ inputs a report must refuse or read (issue 16)


@pytest.mark.parametrize("mode", ["report", "pytorch_benchmark"])
def test_a_last_line_cut_by_a_crash_is_left_out_with_a_warning(tmp_path: Path, capsys, mode: str) -> None:
    """server.py's next append would set a line without its newline aside (csv_store): the report and the conversion
    say so and leave it out rather than read a cut number as a figure."""
    path = tmp_path / "runs.csv"
    pd.DataFrame([_row("serial", 0, 100.0, 0.5), _row("serial", 1, 110.0, 0.5)]).to_csv(path, index=False)
    whole = path.read_text()
    path.write_text(whole + whole.splitlines()[-1].replace("110.0", "3")[:-2])  # a third row, cut mid-line
    target = ["--plots_dir", str(tmp_path / "p")] if mode == "report" else ["--pytorch_benchmark", str(tmp_path)]
    assert report.main([str(path), *target]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "last line" in err[0] and "left out" in err[0] and str(path) in err[0], err
    if mode == "report":
        assert "| 2/2 |" in (tmp_path / "output_32_false.md").read_text()
    else:
        records = json.loads((tmp_path / "runs.pytorch.json").read_text())
        throughputs = [r["metric"]["benchmark_values"][0] for r in records if r["metric"]["name"] == "throughput"]
        assert throughputs == [100.0, 110.0]
    assert path.read_text().startswith(whole) and not path.read_text().endswith("\n")  # read, never changed


def test_reference_rows_with_gpu_util_are_not_said_to_have_no_gpu_samples(tmp_path: Path) -> None:
    path = tmp_path / "output_32_false.csv"
    pd.DataFrame(
        [
            {
                "batch_size": 32,
                "compile": False,
                "warmup_latency": 5.0,
                "average_latency": 4.0,
                "max_latency": 6.0,
                "min_latency": 2.0,
                "throughput": 390.0,
                "gpu_util": 38.0,
            }
        ]
    ).to_csv(path, index=False)
    report.write_report(path, tmp_path, tmp_path / "plots", baseline="original")
    summary = (tmp_path / "summary.md").read_text()
    assert "No GPU samples" not in summary and "The rows have GPU utilisation (`gpu_util`)" in summary


def test_two_reports_never_share_a_default_plots_folder(tmp_path: Path, hand_made: Path) -> None:
    checkout = tmp_path / "checkout"
    first = tmp_path / "a" / "sweep" / "runs.csv"
    second = tmp_path / "b" / "sweep" / "runs.csv"
    for path in (first, second):
        path.parent.mkdir(parents=True)
        path.write_bytes(hand_made.read_bytes())
    plots_first = report.default_plots_dir(first, checkout)
    plots_second = report.default_plots_dir(second, checkout)
    assert plots_first == checkout / "plots" / "sweep" and plots_second.name.startswith("sweep-")
    assert report.default_plots_dir(first, checkout) == plots_first  # the same CSV keeps its folder
    inside = checkout / "results" / "sweep" / "runs.csv"  # a CSV in the checkout is named relative to it
    inside.parent.mkdir(parents=True)
    inside.write_bytes(hand_made.read_bytes())
    plots_inside = report.default_plots_dir(inside, checkout)
    assert (plots_inside / ".source").read_text().strip() == "results/sweep/runs.csv"


def test_a_sweep_whose_every_cell_failed_still_gets_its_report(tmp_path: Path) -> None:
    path = tmp_path / "runs.csv"
    pd.DataFrame(
        [
            {
                "batch_size": 2,
                "compile": False,
                "status": "crashed",
                "error": "exit status 1",
                "experiment": "serial",
                "repeat": r,
            }
            for r in range(2)
        ]
    ).to_csv(path, index=False)
    report.write_report(path, tmp_path, tmp_path / "plots", baseline="serial")
    summary = (tmp_path / "summary.md").read_text()
    assert "Runs that did not complete" in summary and "crashed" in summary


# ------------------------------------------------------------------ the latency-throughput curve (issue 15)

RATES_RPS = (10.0, 20.0, 40.0)
P99_MS = {  # per experiment, per rate: the two repeats' p99 latencies against an SLO of 100 ms
    "serial": ([50, 60], [80, 110], [300, 400]),  # the mean at 20 (95 ms) is within, one repeat is not: 10
    "pipelined_2w": ([20, 22], [30, 35], [60, 70]),  # within at every rate: 40, nothing over
    "threaded": ([150, 160], [90, 95], [500, 600]),  # over at the lowest; within at 20 by chance: none
}


def _curve_rows(batch_size: int = 32) -> list[dict]:
    rows = []
    for name, per_rate in P99_MS.items():
        for rate_rps, p99s in zip(RATES_RPS, per_rate):
            for repeat, p99_ms in enumerate(p99s):
                rows.append(
                    _row(
                        name,
                        repeat,
                        rate_rps * batch_size * 0.99,
                        p99_ms / 1e3,
                        batch_size=batch_size,
                        p50_latency_s=p99_ms / 3e3,
                        load="poisson",
                        offered_rate_rps=rate_rps,
                        achieved_rate_rps=rate_rps * 0.99,
                        slo_ms=100.0,
                    )
                )
    # A failed run is listed, not judged: pipelined_2w still meets the SLO at 40 req/s.
    rows.append(
        _row(
            "pipelined_2w",
            2,
            None,
            None,
            status="oom",
            batch_size=batch_size,
            load="poisson",
            offered_rate_rps=40.0,
            slo_ms=100.0,
        )
    )
    return rows


def test_the_curve_highest_rate_within_the_slo_and_a_table_per_rate_from_a_hand_made_csv(tmp_path: Path) -> None:
    path = tmp_path / "runs.csv"
    pd.DataFrame(_curve_rows()).to_csv(path, index=False)
    written = report.write_report(path, tmp_path, tmp_path / "plots", baseline="serial")
    curve = tmp_path / "plots" / "latency_throughput.png"
    assert curve in written and curve.stat().st_size > 10_000
    section = (tmp_path / "summary.md").read_text().split("## Highest rate within the SLO\n", 1)[1].split("\n## ")[0]
    lines = {line.split(" | ")[0].lstrip("| "): line for line in section.splitlines() if line.startswith("| ")}
    # experiment | batch | compile | SLO | highest | worst p99 there | samples/s there | req/s there | lowest over
    assert lines["serial"] == "| serial | 32 | off | 100 | 10 | 60.0 | 316.8 | 9.90 | 20 |"
    assert lines["pipelined_2w"] == "| pipelined_2w | 32 | off | 100 | 40 | 70.0 | 1267.2 | 39.60 | - |"
    assert lines["threaded"] == "| threaded | 32 | off | 100 | none | - | - | - | 10 |"
    # Each reference table is one load point: a mean over rates is no figure, and their spread no noise.
    serial = next(
        line
        for line in (tmp_path / "output_32_false_rate20.md").read_text().splitlines()
        if line.startswith("| serial ")
    )
    assert "| 633.6 +/- 0.0 |" in serial and "| 0.095 +/- 0.021 |" in serial  # 20 req/s only, not all rates
    summary = (tmp_path / "summary.md").read_text()
    assert "## batch size 32, compile off, offered 40 req/s" in summary
    assert "## Noisy experiments" not in summary  # the rates' throughputs differ; no rate's repeats do
    assert "| pipelined_2w | 32 | False | 40 | 2 | oom |" in summary


def test_one_curve_per_batch_size_and_none_without_a_load_axis(tmp_path: Path, hand_made: Path) -> None:
    path = tmp_path / "curve" / "runs.csv"
    path.parent.mkdir()
    rows = [r for r in _curve_rows(32) + _curve_rows(64) if r["experiment"] == "serial"]
    pd.DataFrame(rows).to_csv(path, index=False)
    written = {p.name for p in report.write_report(path, path.parent, tmp_path / "plots", baseline="serial")}
    assert {"latency_throughput_bs32_false.png", "latency_throughput_bs64_false.png"} <= written
    written = {p.name for p in report.write_report(hand_made, tmp_path, tmp_path / "plain", baseline="serial")}
    assert not any(name.startswith("latency_throughput") for name in written)  # one load point per experiment
    assert "within the SLO" not in (tmp_path / "summary.md").read_text()


def test_a_closed_loop_axis_is_read_from_the_concurrency_column() -> None:
    runs = pd.DataFrame(_curve_rows()).rename(columns={"offered_rate_rps": "concurrency"})
    assert report.load_axis_column(runs) == "concurrency"
    found = report.slo_capacity(runs[runs["experiment"] == "serial"], "concurrency", slo_ms=100.0)
    assert (found.highest, found.first_over) == (10.0, 20.0)


def test_the_stage_breakdown_shows_the_batchers_wait_and_reads_rows_from_before_it(tmp_path: Path, monkeypatch) -> None:
    import matplotlib.axes

    from serverbench.records.plots import plot_stage_breakdown

    labels: list[str] = []
    real_barh = matplotlib.axes.Axes.barh
    monkeypatch.setattr(
        matplotlib.axes.Axes, "barh", lambda self, *a, **k: labels.append(k.get("label")) or real_barh(self, *a, **k)
    )
    stages = {
        "mean_request_queue_ms": 1.0,
        "mean_h2d_ms": 1.0,
        "mean_predict_ms": 5.0,
        "mean_d2h_ms": 1.0,
        "mean_response_queue_ms": 1.0,
    }
    row = {"status": "ok", "batch_size": 1, "compile": False, "experiment": "serial", **stages}
    old = pd.DataFrame([row])  # a CSV written before dynamic batching: no batcher column
    assert plot_stage_breakdown(old, ["serial"], 1, False, tmp_path / "old.png")
    new = pd.DataFrame([{**row, "experiment": "serial_batched", "mean_batch_wait_ms": 2.5}])
    assert plot_stage_breakdown(new, ["serial_batched"], 1, False, tmp_path / "new.png")
    assert labels.count("batcher") == 2 and (tmp_path / "new.png").exists()


def test_rows_of_one_experiment_run_with_different_flags_are_refused_not_pooled(tmp_path: Path, capsys) -> None:
    """identity, resnet18 and a Poisson run, all 'serial' at one batch: their mean would be no figure of anything
    (it read 3549.4 +/- 5923.8 with verdicts)."""
    rows = [
        _row("serial", 0, 7000.0, 0.01, model="identity", load="burst"),
        _row("serial", 1, 100.0, 0.5, model="resnet18", load="burst"),
        _row("serial", 2, 50.0, 0.2, model="identity", load="poisson", offered_rate_rps=50.0),
    ]
    path = tmp_path / "runs.csv"
    pd.DataFrame(rows).to_csv(path, index=False)
    assert report.main([str(path), "--plots_dir", str(tmp_path / "plots")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model identity/resnet18" in err[0] and "load burst/poisson" in err[0], err
    assert not (tmp_path / "summary.md").exists() and not (tmp_path / "plots").exists()


def test_an_interrupted_row_that_a_later_run_replaced_is_not_counted(tmp_path: Path) -> None:
    """Ctrl-C a 2-repeat sweep in its second repeat and run it again: both repeats completed, '2/2', not '2/3'."""
    rows = [_row("serial", 0, 100.0, 0.5), _row("serial", 1, 0.0, 0.5, status="interrupted")]
    rows += [_row("serial", 1, 110.0, 0.5)]
    path = tmp_path / "runs.csv"
    pd.DataFrame(rows).to_csv(path, index=False)
    report.write_report(path, tmp_path, tmp_path / "plots", baseline=None)
    table = (tmp_path / "output_32_false.md").read_text()
    assert "| 2/2 |" in table
    assert "interrupted" not in (tmp_path / "summary.md").read_text()


def test_a_table_cell_cannot_break_its_table() -> None:
    """One table writer for every report: an error text with '|' or a line break stays in its cell."""
    from serverbench.records.markdown import table

    lines = table(["run", "error"], [["a", "exit 1 | BrokenPipe\nline two"], ["b", ""]])
    assert lines == ["| run | error |", "| --- | --- |", "| a | exit 1 \\| BrokenPipe line two |", "| b |  |"]


def test_runs_the_machine_spoiled_are_counted_per_cell_and_left_out_with_quiet_only(tmp_path: Path, capsys) -> None:
    """A run whose row carries a noise warning is counted as noisy in its cell; --quiet_only leaves it out of every
    figure and verdict, and the summary says how many and why."""
    warned = "other processes used 45.0 % of the CPU"
    rows = [
        _row("serial", r, t, 0.5, noise_warning=w) for r, (t, w) in enumerate([(100, ""), (300, warned), (110, "")])
    ]
    rows += [_row("pipelined_2w", r, t, 0.3, noise_warning="") for r, t in enumerate([200.0, 210.0, 220.0])]
    path = tmp_path / "runs.csv"
    pd.DataFrame(rows).to_csv(path, index=False)
    report.write_report(path, tmp_path / "all", tmp_path / "plots", baseline="serial")
    serial = next(x for x in (tmp_path / "all" / "output_32_false.md").read_text().splitlines() if "| serial " in x)
    assert "170.0 +/- 112.7" in serial and serial.endswith("| 3/3, 1 noisy |")
    assert (
        "repeats CV: the spread of throughput over the cell's ok repeats"
        in (tmp_path / "all" / "output_32_false.md").read_text()
    )
    summary = (tmp_path / "all" / "summary.md").read_text()
    assert "**1 of the 6 ok runs carry a noise warning**" in summary and "--quiet_only" in summary

    assert (
        report.main(
            [str(path), "--out_dir", str(tmp_path / "quiet"), "--plots_dir", str(tmp_path / "p"), "--quiet_only"]
        )
        == 0
    )
    serial = next(x for x in (tmp_path / "quiet" / "output_32_false.md").read_text().splitlines() if "| serial " in x)
    assert "105.0 +/- 7.1" in serial and serial.endswith("| 2/2 |")
    summary = (tmp_path / "quiet" / "summary.md").read_text()
    assert "**1 of the 6 ok runs were left out (--quiet_only)**" in summary
    assert "pipelined_2w is" in summary  # the verdict against serial, on the two quiet rounds it shares

    # Every ok run warned (a busy 2-core VM): one line and exit 2, nothing made, where an IndexError was
    pd.DataFrame(rows).assign(noise_warning=warned).to_csv(path, index=False)
    capsys.readouterr()
    quiet = ["--out_dir", str(tmp_path / "none"), "--plots_dir", str(tmp_path / "none_p"), "--quiet_only"]
    assert report.main([str(path), *quiet]) == 2
    assert "--quiet_only: every ok run of" in capsys.readouterr().err
    assert not (tmp_path / "none").exists() and not (tmp_path / "none_p").exists()


def test_a_rate_sweeps_batch_size_plots_are_per_rate_and_every_title_says_what_ran(tmp_path: Path) -> None:
    """Rates are not pooled into one batch-size plot (one error bar over three rates is no figure); each plot's title
    names the model, its input size, the device and the load."""
    from serverbench.records.plots import plot_context

    config = dict(model="identity", image_size=16, device="cpu", load="poisson")
    rows = [
        _row(name, r, rate * factor, 0.01 * rate, offered_rate_rps=rate, **config)
        for rate in (10.0, 20.0)
        for name, factor in (("serial", 1.0), ("pipelined_2w", 1.1))
        for r in range(2)
    ]
    path = tmp_path / "runs.csv"
    pd.DataFrame(rows).to_csv(path, index=False)
    written = {p.name for p in report.write_report(path, tmp_path, tmp_path / "plots", baseline="serial")}
    for rate in ("rate10", "rate20"):
        assert {f"throughput_vs_batch_size_{rate}.png", f"avg_latency_vs_batch_size_{rate}.png"} <= written
    assert "throughput_vs_batch_size.png" not in written  # nothing pooled over rates
    assert plot_context(pd.read_csv(path)) == "identity 16x16, cpu, poisson"


def test_the_latency_throughput_curve_of_a_wide_fragmented_frame_prints_no_pandas_warning(tmp_path: Path) -> None:
    """A rate sweep's report printed pandas' PerformanceWarning: a column added to its frame of the rows' hundreds."""
    from serverbench.records.plots import plot_latency_throughput

    frame = pd.DataFrame({"experiment": ["a"] * 4, "status": ["ok"] * 4, "offered_rate_rps": [1.0, 1.0, 2.0, 2.0]})
    frame = frame.assign(throughput=[1.0, 1.1, 2.0, 2.1], p50_latency_s=0.1, p99_latency_s=0.2)
    with warnings.catch_warnings():  # pandas says so of the building too; the plot's is the one tested
        warnings.simplefilter("ignore", pd.errors.PerformanceWarning)
        for index in range(150):  # as the report's columns come: one at a time
            frame[f"column_{index}"] = float(index)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert plot_latency_throughput(frame, ["a"], "offered_rate_rps", ("rate", "req/s"), "t", tmp_path / "c.png")


def test_a_table_escapes_what_would_break_it_and_aligns_its_figures_right() -> None:
    """Every report's tables are written by records/markdown.py: a cell's '|' and line breaks cannot add columns."""
    head, rule, row = markdown.table(["what", "ms"], [["a | b\nc", 1.5]])
    assert head == "| what | ms |" and rule == "| --- | --- |" and row == "| a \\| b c | 1.5 |"
    assert markdown.table_head(["peer", "req/s", "p99 ms"], right=2)[1] == "| --- | ---: | ---: |"


def test_a_quiet_csv_is_read_without_a_pandas_warning() -> None:
    """No run warned: pandas reads noise_warning as float NaN throughout, and fillna("") on it warns (pandas 3.1:
    an error in pandas 4) on every report."""
    quiet = pd.DataFrame({"noise_warning": [float("nan")] * 2, "status": ["ok", "error"]})  # float64, as read
    warned = pd.DataFrame({"noise_warning": [float("nan"), " ", "busy"], "status": ["ok", "ok", "ok"]})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert report.noisy(quiet).tolist() == [False, False]
        assert report.noisy(warned).tolist() == [False, False, True]
