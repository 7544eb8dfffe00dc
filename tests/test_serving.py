"""bench.serving's verdicts from hand-made rows: a target missed is a failing exit, whatever type pandas gives."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from bench import serving


def _peaks(folder: Path, serial: tuple[float | None, ...], pipelined: tuple[float | None, ...]) -> None:
    """peak.csv as the batching part leaves it: (unbatched, batched) peaks of each repeat in turn."""
    rows = []
    for name, peaks in (("serial", serial), ("pipelined_2w", pipelined)):
        for repeat in range(len(peaks) // 2):
            alone, batched = peaks[2 * repeat : 2 * repeat + 2]
            for label, peak in ((name, alone), (f"{name}_batched", batched)):
                rows.append(
                    {
                        "experiment": label,
                        "repeat": repeat,
                        "offline_rate_rps": 300.0,
                        "peak_rate_rps": peak,
                        "peak_p99_latency_s": None if peak is None else 0.09,
                        "over_slo_rate_rps": 10.0 if peak is None else peak * 1.1,
                    }
                )
    (folder / "batching").mkdir(parents=True)
    pd.DataFrame(rows).to_csv(folder / "batching" / "peak.csv", index=False)


def test_a_batching_gain_under_3x_fails_the_run_and_says_so(tmp_path: Path) -> None:
    _peaks(tmp_path, serial=(50.0, 140.0), pipelined=(44.7, 133.3))  # 2.80x and 2.98x
    assert serving.main(["--out", str(tmp_path), "--parts", "batching", "--report_only"]) == 1
    report = (tmp_path / "batching.md").read_text()
    assert (
        "- NOT met: batching serial: median peak 140.0 vs 50.0 req/s, 2.80x (each repeat: 2.80x) "
        "(target >= 3x)" in report
    )
    # The target is serial's; the pipelined design's gain is shown beside it, whatever it is.
    assert "- shown: batching pipelined_2w: median peak 133.3 vs 44.7 req/s, 2.98x" in report


def test_batching_gains_of_3x_or_more_pass(tmp_path: Path) -> None:
    _peaks(tmp_path, serial=(50.0, 150.0), pipelined=(40.0, 60.0))
    assert serving.main(["--out", str(tmp_path), "--parts", "batching", "--report_only"]) == 0
    assert "NOT met" not in (tmp_path / "serving.md").read_text()


def test_the_batching_verdict_is_the_ratio_of_the_repeats_medians(tmp_path: Path) -> None:
    # Three repeats of serial: peaks 50, 40, 60 alone and 160, 100, 200 batched; medians 50 and 160: 3.2x.
    _peaks(tmp_path, serial=(50.0, 160.0, 40.0, 100.0, 60.0, 200.0), pipelined=(40.0, 60.0))
    assert serving.main(["--out", str(tmp_path), "--parts", "batching", "--report_only"]) == 0
    report = (tmp_path / "batching.md").read_text()
    assert "| serial | 300.0, 300.0, 300.0 | 50.0, 40.0, 60.0 | 50.0 |" in report
    assert "median peak 160.0 vs 50.0 req/s, 3.20x (each repeat: 3.20x, 2.50x, 3.33x)" in report


def test_a_search_that_never_met_the_slo_counts_as_no_peak_not_as_a_repeat_left_out(tmp_path: Path) -> None:
    # Batched searches of two repeats found no rate within the SLO: the median is 0, not the third's 300.
    _peaks(tmp_path, serial=(50.0, None, 50.0, None, 50.0, 300.0), pipelined=(40.0, 60.0))
    assert serving.main(["--out", str(tmp_path), "--parts", "batching", "--report_only"]) == 1
    report = (tmp_path / "batching.md").read_text()
    assert "| serial_batched | 300.0, 300.0, 300.0 | none, none, 300.0 | 0.0 |" in report
    assert (
        "- NOT met: batching serial: median peak 0.0 vs 50.0 req/s, 0.00x (each repeat: 0.00x, 0.00x, 6.00x)" in report
    )


def test_without_peak_searches_the_batching_part_says_so_and_fails(tmp_path: Path) -> None:
    assert serving.main(["--out", str(tmp_path), "--parts", "batching", "--report_only"]) == 1
    assert "- NOT met: batching: nothing measured" in (tmp_path / "batching.md").read_text()
