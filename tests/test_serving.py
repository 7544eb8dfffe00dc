"""bench.serving's verdicts from hand-made rows: a target missed is a failing exit, whatever type pandas gives."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from bench import serving


def _peaks(folder: Path, serial: tuple[float, float], pipelined: tuple[float, float]) -> None:
    rows = []
    for name, (alone, batched) in (("serial", serial), ("pipelined_2w", pipelined)):
        for label, peak in ((name, alone), (f"{name}_batched", batched)):
            rows.append({"experiment": label, "offline_rate_rps": peak * 1.5, "peak_rate_rps": peak,
                         "peak_p99_latency_s": 0.09, "over_slo_rate_rps": peak * 1.1})
    (folder / "batching").mkdir(parents=True)
    pd.DataFrame(rows).to_csv(folder / "batching" / "peak.csv", index=False)


def test_a_batching_gain_under_3x_fails_the_run_and_says_so(tmp_path: Path) -> None:
    _peaks(tmp_path, serial=(50.0, 154.5), pipelined=(44.7, 133.3))  # 3.09x and 2.98x
    assert serving.main(["--out", str(tmp_path), "--parts", "batching", "--report_only"]) == 1
    report = (tmp_path / "batching.md").read_text()
    assert "- met: batching serial: peak 154.5 vs 50.0 req/s, 3.09x" in report
    assert "- NOT met: batching pipelined_2w: peak 133.3 vs 44.7 req/s, 2.98x" in report


def test_batching_gains_of_3x_or_more_pass(tmp_path: Path) -> None:
    _peaks(tmp_path, serial=(50.0, 150.0), pipelined=(40.0, 160.0))
    assert serving.main(["--out", str(tmp_path), "--parts", "batching", "--report_only"]) == 0
    assert "NOT met" not in (tmp_path / "serving.md").read_text()
