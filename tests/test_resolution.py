"""bench.resolution: its rates on rows the test makes with a known planted answer, and a short run end to end."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from conftest import ROOT, communicate_or_fail, kill_session, outlive_the_test, start_session

from bench import resolution
from bench.resolution import planted_experiments
from bench.resolution_report import REPORT_MD, TRIALS_CSV, write_report


def planted_rows(rounds: int, planted_pct: list[float], pair_sd: float, seed: int = 0) -> pd.DataFrame:
    """Rows as sweep.py writes them: per round a and every b<P>, all moved by the round's drift (8 %), each with
    noise of its own (`pair_sd`), b<P> taking P % longer per sample; the machine speed follows the drift."""
    rng = np.random.default_rng(seed)
    rows = []
    for repeat in range(rounds):
        drift = float(np.exp(rng.normal(0, 0.08)))
        for name, pct in [("a", 0.0)] + [(f"b{p:g}", p) for p in planted_pct]:
            throughput = 1000 * drift * float(np.exp(rng.normal(0, pair_sd))) / (1 + pct / 100)
            rows.append(
                {
                    "experiment": name,
                    "repeat": repeat,
                    "status": "ok",
                    "device": "cpu",
                    "throughput": throughput,
                    "machine_speed_before": 3000 * drift,
                    "machine_speed_after": 3000 * drift,
                }
            )
    return pd.DataFrame(rows)


def test_rates_on_a_known_planted_answer(tmp_path: Path) -> None:
    """Pair noise 1 %: 0 % is rarely called, 5 % almost always seen, 1 % seldom with 7 pairs; the table says so."""
    runs = planted_rows(16, [0, 1, 5, 20], pair_sd=0.01)
    lines = write_report({"identity": runs}, tmp_path, repeats=7, draws=300, seed=0)
    trials = pd.read_csv(tmp_path / TRIALS_CSV)
    cell = trials[(trials["method"] == "t") & (~trials["normalised"]) & (trials["repeats"] == 7)]
    rate = cell.set_index("planted_pct")
    assert rate.loc[0.0, "called"] <= 0.10
    assert rate.loc[5.0, "detected"] >= 0.95 and rate.loc[20.0, "detected"] == 1.0
    assert rate.loc[1.0, "detected"] < rate.loc[5.0, "detected"]
    assert (cell["wrong_way"] <= 0.05).all()
    text = "\n".join(lines)
    assert "| 20 % | 0.833 |" in text  # the expected b/a of a 20 % slower batch, beside the seen one
    assert "- met: identity: at 0 % a difference called in" in text
    assert "- met: identity: 5 % planted detected in" in text
    assert (tmp_path / "resolution.png").stat().st_size > 0


def test_a_noisy_machine_misses_five_percent_and_the_target_says_not_met(tmp_path: Path) -> None:
    runs = planted_rows(16, [0, 5], pair_sd=0.08, seed=1)
    # 150 draws: 5 % is detected in 30-41 % of trials at seeds 0-3, far from the 80 % target
    lines = write_report({"resnet18": runs}, tmp_path, repeats=7, draws=150, seed=0)
    assert any(line.startswith("- NOT met: resnet18: 5 % planted detected in") for line in lines)
    assert "Smallest planted difference detected in 80 % of trials at 7 repeats: none of those planted." in lines


def test_dividing_by_the_machine_speed_removes_a_drift_it_follows(tmp_path: Path) -> None:
    runs = planted_rows(16, [0, 5], pair_sd=0.0)
    lines = write_report({"identity": runs}, tmp_path, repeats=7, draws=50, seed=0)
    assert "| / machine speed | 0.0 % | 0.0 %, 0.0 % | 0.0 % |" in lines  # the drift was all the machine's
    raw = next(line for line in lines if line.startswith("| raw |"))
    assert not raw.startswith("| raw | 0.0 %")


def test_planted_delays_are_shares_of_the_time_per_batch() -> None:
    assert planted_experiments(0.002, [0, 5, 10]) == {"a": 0.0, "b0": 0.0, "b5": 100.0, "b10": 200.0}


@dataclass(frozen=True)
class ShortRun:
    out: Path
    proc: subprocess.Popen


@pytest.fixture(scope="module", autouse=True)
def short_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ShortRun]:
    """The short run end to end, started in the background before the module's first test: the tests on made rows
    (in this process, on one core) run while it waits for its servers; its own test waits for it."""
    out = tmp_path_factory.mktemp("resolution") / "res"
    command = [sys.executable, "-m", "bench.resolution", "--out", str(out), "--models", "identity", "--repeats", "2"]
    command += ["--pairs", "2", "--draws", "20", "--planted", "0", "300", "--", "--num_iters", "300"]
    command += ["--image_size", "16"]
    proc = start_session(command, ROOT, None)
    outlive_the_test(proc.pid)  # it ends at its test, or here
    try:
        yield ShortRun(out, proc)
    finally:
        if proc.poll() is None:
            kill_session(proc.pid)
        proc.communicate()


def test_a_short_run_end_to_end(short_run: ShortRun) -> None:
    """Calibration, then the interleaved rounds on the study harness, and the report over them; the planted
    busy-wait of 3 times the time per batch shows in the rows and in the verdicts."""
    out = short_run.out
    stdout, stderr = communicate_or_fail(short_run.proc, 280, "bench.resolution")  # below pytest's 300 s
    assert short_run.proc.returncode == 0, stderr[-3000:]
    rows = pd.read_csv(out / "runs.csv")
    assert (rows["status"] == "ok").all() and (rows["experiment"] == "identity.calibration").sum() == 3
    runs = rows[rows["experiment"] != "identity.calibration"].assign(experiment=lambda r: r["experiment"].str[9:])
    assert sorted(runs["experiment"].unique()) == ["a", "b0", "b300"]
    assert runs["machine_speed_before"].gt(0).all() and runs["machine_speed_after"].gt(0).all()
    delays = runs.groupby("experiment")["planted_delay_us"].first()
    assert pd.isna(delays["a"]) and pd.isna(delays["b0"]) and delays["b300"] > 0
    means = runs.groupby("experiment")["throughput"].mean()
    assert means["b300"] < 0.7 * means["a"]
    assert (out / REPORT_MD).exists() and (out / TRIALS_CSV).exists()
    assert "| 300 % | 0.250 |" in stdout


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--repeats", "1"], "--repeats: the rounds must be at least 2"),
        (["--planted", "-5"], "--planted: -5: must be between 0 and 1000"),
        (["--", "--num_iters", "0"], "--num_iters 0: must be at least 1"),
    ],
)
def test_bad_arguments_are_one_line_and_exit_2_before_any_run(
    tmp_path: Path, capsys: pytest.CaptureFixture, argv: list, fragment: str
) -> None:
    out = tmp_path / "o"
    try:  # the parser's one line (it exits), or the study's own check's (returned), as the command prints it
        status = resolution.main(["--out", str(out), *argv])
    except SystemExit as refused:
        status = refused.code
    err = capsys.readouterr().err
    assert status == 2 and fragment in err and len(err.strip().splitlines()) == 1
    assert not out.exists()
