"""bench.serving's verdicts from hand-made rows: a target missed is a failing exit, whatever type pandas gives."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from bench import serving
from bench.study import build_parser


def _peaks(folder: Path, serial: tuple[float | None, ...], pipelined: tuple[float | None, ...]) -> None:
    """runs.csv as the batching part leaves it: a row per search, (unbatched, batched) peaks of each repeat."""
    rows = []
    for name, peaks in (("serial", serial), ("pipelined_2w", pipelined)):
        for repeat in range(len(peaks) // 2):
            alone, batched = peaks[2 * repeat : 2 * repeat + 2]
            for label, peak in ((name, alone), (f"{name}_batched", batched)):
                rows.append(
                    {
                        "experiment": f"batching.{label}",
                        "batch_size": 1,
                        "compile": False,
                        "repeat": repeat,
                        "status": "ok",
                        "offline_rps": 300.0,
                        "peak_rps": peak,
                        "peak_p99_s": None if peak is None else 0.09,
                        "over_slo_rps": 10.0 if peak is None else peak * 1.1,
                        "search": "slo_not_met" if peak is None else "ok",
                    }
                )
    folder.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_csv(folder / "runs.csv", index=False)


def _report(folder: Path) -> tuple[int, str]:
    status = serving.main(["--out", str(folder), "--parts", "batching", "--report_only"])
    return status, (folder / "serving.md").read_text()


def test_a_batching_gain_under_3x_fails_the_run_and_says_so(tmp_path: Path) -> None:
    _peaks(tmp_path, serial=(50.0, 140.0), pipelined=(44.7, 133.3))  # 2.80x and 2.98x
    status, report = _report(tmp_path)
    assert status == 1
    assert (
        "- NOT met: batching serial: median peak 140.0 vs 50.0 req/s, 2.80x (each repeat: 2.80x) "
        "(target >= 3x)" in report
    )
    # The target is serial's; the pipelined design's gain is shown beside it, whatever it is.
    assert "- shown: batching pipelined_2w: median peak 133.3 vs 44.7 req/s, 2.98x" in report


def test_batching_gains_of_3x_or_more_pass(tmp_path: Path) -> None:
    _peaks(tmp_path, serial=(50.0, 150.0), pipelined=(40.0, 60.0))
    status, report = _report(tmp_path)
    assert status == 0 and "NOT met" not in report


def test_the_batching_verdict_is_the_ratio_of_the_repeats_medians(tmp_path: Path) -> None:
    # Three repeats of serial: peaks 50, 40, 60 alone and 160, 100, 200 batched; medians 50 and 160: 3.2x.
    _peaks(tmp_path, serial=(50.0, 160.0, 40.0, 100.0, 60.0, 200.0), pipelined=(40.0, 60.0))
    status, report = _report(tmp_path)
    assert status == 0
    assert "| serial | 300.0, 300.0, 300.0 | 50.0, 40.0, 60.0 | 50.0 |" in report
    assert "median peak 160.0 vs 50.0 req/s, 3.20x (each repeat: 3.20x, 2.50x, 3.33x)" in report


def test_a_search_that_never_met_the_slo_counts_as_no_peak_not_as_a_repeat_left_out(tmp_path: Path) -> None:
    # Batched searches of two repeats found no rate within the SLO: the median is 0, not the third's 300.
    _peaks(tmp_path, serial=(50.0, None, 50.0, None, 50.0, 300.0), pipelined=(40.0, 60.0))
    status, report = _report(tmp_path)
    assert status == 1
    assert "| serial_batched | 300.0, 300.0, 300.0 | none, none, 300.0 | 0.0 |" in report
    assert (
        "- NOT met: batching serial: median peak 0.0 vs 50.0 req/s, 0.00x (each repeat: 0.00x, 0.00x, 6.00x)" in report
    )


def test_searches_that_all_failed_leave_the_batching_part_unmeasured_and_failing(tmp_path: Path) -> None:
    failed = {"batch_size": 1, "compile": False, "status": "crashed", "error": "exit 1: boom"}
    rows = [{"experiment": f"batching.{name}", "repeat": 0, **failed} for name in ("serial", "serial_batched")]
    pd.DataFrame(rows).to_csv(tmp_path / "runs.csv", index=False)
    status, report = _report(tmp_path)
    assert status == 1 and "- NOT met: batching: nothing measured" in report


def test_each_part_is_a_phase_of_interleaved_runs_with_the_model_alone_first(tmp_path: Path) -> None:
    """The cells the study runs: only the parts asked for; batching's forward timing first, once."""
    args = build_parser(serving.STUDY).parse_args(["--parts", "batching", "instances", "--repeats", "2"])
    cells = [cell for phase in serving.STUDY.phases for cell in phase(args, None)]
    names = [cell.experiment.name for cell in cells]
    assert names[0] == serving.FORWARDS and names.count(serving.FORWARDS) == 1
    assert sorted(set(names) - {serving.FORWARDS}) == [
        "batching.pipelined_2w",
        "batching.pipelined_2w_batched",
        "batching.serial",
        "batching.serial_batched",
        "instances.instances_2",
        "instances.pipelined_2w",
    ]
    assert len(cells) == 1 + 2 * 4 + 2 * 2 and all(
        c.batch_size == 8 for c in cells if c.experiment.name.startswith("instances.")
    )
    assert all(c.experiment.measure is not None for c in cells if c.experiment.name.startswith("batching."))
