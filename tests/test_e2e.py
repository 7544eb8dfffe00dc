"""server.py as a user runs it: a subprocess on the CPU, small images, one row per run."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial
from importlib import metadata
from pathlib import Path

import pytest
import torch
import torchvision
from conftest import ROOT, TINY, ServerRun, live_processes_in_session, make_config, run_command, run_server

from serverbench.records.row import build_row, write_detail_files
from serverbench.records.summary import REFERENCE_COLUMNS
from serverbench.schema.columns import JOB_COLUMNS, PEAK_SEARCH_COLUMNS, ROW_COLUMNS
from serverbench.schema.messages import RunResult
from serverbench.schema.records import STAGES
from serverbench.schema.stats import cv_pct
from tests.helpers import Background, start_first


def _check_complete_row(row: dict[str, str], num_iters: int, batch_size: int) -> None:
    assert row["status"] == "ok", row["error"]
    assert int(row["requests_sent"]) == int(row["responses_received"]) == num_iters
    assert int(row["responses_missing"]) == int(row["responses_duplicated"]) == 0
    warmup, avg, lo, hi = (float(row[k]) for k in ("warmup_latency", "average_latency", "min_latency", "max_latency"))
    assert 0 < lo <= avg <= hi < 60  # seconds
    assert lo <= float(row["p50_latency_s"]) <= float(row["p99_latency_s"]) <= hi
    assert warmup > 0
    # The fixed formula, from the row's own numbers.
    assert float(row["throughput"]) == pytest.approx(num_iters * batch_size / float(row["duration_s"]), rel=1e-6)
    stages_ms = sum(float(row[f"mean_{s}_ms"]) for s in STAGES)
    assert stages_ms == pytest.approx(avg * 1e3, rel=1e-3)


# The tiny CNN a factory --model builds (imported from the server's working folder): a convolution and a classifier,
# so that a compile, uint8 decoding and --verify go through a CNN's whole path at a fraction of resnet18's cost. Its
# build takes 1.5 s, as a real network's does (resnet18's: one to several seconds): the first warm-up request, sent
# as the frontend comes up, then waits in the ring before the compile begins. A build of no time at all left that
# request's sending and the compile's start within a tenth of a second of each other, either way round, on a busy
# machine: the warm-up latency then came out shorter than the compile in 2 runs of 3.
TINY_CNN = """import time

from torch import nn


def make_model() -> nn.Module:
    time.sleep(1.5)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))
"""
WEIGHTS_FILE = "resnet18-f37072fd.pth"  # the file name torchvision gives resnet18's weights: --model_dir finds it


@dataclass(frozen=True)
class Finished:
    """A server.py run that has ended, and the processes of its session still running right after it (read then:
    the test that made the run kills its session at its end, and a later test reading the run would see none)."""

    run: ServerRun
    left_running: list[str]
    results_dir: Path


# id: (design, model, prediction workers, more flags). A real network once, serial, as a user's first run, its
# weights loaded from --model_dir (the checkpoint test reads that row too); the identity model for the other
# designs, whose threads and hand-offs are the same with any model. The 3-worker run also profiles and saves its
# requests, flags that change no figure the design test reads: the profile and row-columns tests read its row.
DESIGNS = {
    "serial": ("serial", "resnet18", 1, []),
    "threaded": ("threaded", "identity", 1, []),
    "pipelined-1w": ("pipelined", "identity", 1, []),
    "pipelined-3w": ("pipelined", "identity", 3, ["--profile", "--save_requests"]),
}


class DesignRuns:
    """Each design's run, each into a results folder of its own (its row alone under its own header), started one
    after another in the background at the module's start (the compile test runs meanwhile) and read by every test
    that asks for it."""

    def __init__(self, root: Path) -> None:
        self.weights = root / "weights"
        self.weights.mkdir()
        torch.save(torchvision.models.resnet18(weights=None).state_dict(), self.weights / WEIGHTS_FILE)
        self._runs = Background("designs")
        self._finished: dict[str, Future] = {}
        for name, (design, model, workers, extra) in DESIGNS.items():
            args = [*TINY, "--model", model, "--design", design, *extra]
            args += ["--num_workers", str(workers)] if design == "pipelined" else []
            args += ["--model_dir", str(self.weights)] if model == "resnet18" else []
            results_dir = root / name
            self._finished[name] = self._runs.submit(args, results_dir, after=partial(_finished, results_dir))

    def __getitem__(self, name: str) -> Finished:
        return self._finished[name].result(timeout=280)  # below pytest's 300 s

    def stop(self) -> None:
        self._runs.stop()


def _finished(results_dir: Path, run: ServerRun) -> Finished:
    return Finished(run, live_processes_in_session(run.session_id), results_dir)


@pytest.fixture(scope="module")
def design_runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DesignRuns]:
    """One run per design (DESIGNS): the design tests read each, the checkpoint test the serial one, the profile and
    row-columns tests the 3-worker one."""
    runs = DesignRuns(tmp_path_factory.mktemp("designs"))
    yield runs
    runs.stop()


@pytest.fixture(scope="module", autouse=True)
def _design_runs_start_first(request: pytest.FixtureRequest) -> None:
    start_first(request, ("design_runs",))


def test_compile_with_two_workers_verified_and_quiet(tmp_path: Path, monkeypatch) -> None:
    # First in the file: the design runs go on in the background meanwhile.
    # A CUDA toolkit but no GPU: torch's cpp_extension says so when inductor imports it, as it does here alone; the
    # run must not pass that chatter on, nor leave a semaphore behind.
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    alone = run_command([sys.executable, "-c", "import torch.utils.cpp_extension"], timeout_s=60)
    assert "No CUDA runtime is found" in alone.stderr
    # uint8 on the wire (a factory's float32 [3, H, W] input takes it): the decoding is compiled with the model, and
    # both are called from the serving threads; --verify compares every response with the serial answer (the
    # compiled decoding's data path). A CNN's compile, not resnet18's: the path is the same, the compile far shorter.
    (tmp_path / "tiny_cnn.py").write_text(TINY_CNN)
    args = [*TINY, "--model", "tiny_cnn:make_model", "--compile", "--num_workers", "2", "--wire_dtype", "uint8"]
    # with the 60 s above, below pytest's 300 s: this bound is the one that fires
    run = run_server([*args, "--verify"], tmp_path, timeout_s=220, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert "leaked semaphore" not in run.stderr and "No CUDA runtime is found" not in run.stderr
    row = run.row
    _check_complete_row(row, num_iters=6, batch_size=2)
    assert row["compile"] == "True" and row["compile_mode"] == "default"
    assert (row["wire_dtype"], row["verify"], row["wrong_outputs"]) == ("uint8", "True", "0")
    # The real compile-and-first-run time, not the lazy torch.compile() call (microseconds), and inside the warm-up
    # latency; a warm inductor cache on a fast machine can bring it under a second.
    assert 0.05 < float(row["m_compile_time"]) < float(row["warmup_latency"])


@pytest.mark.parametrize("name", DESIGNS)
def test_each_design_runs_end_to_end_on_the_cpu(design_runs: DesignRuns, name: str) -> None:
    design, model, workers, _ = DESIGNS[name]
    finished = design_runs[name]
    run = finished.run
    assert run.returncode == 0, run.stderr
    row = run.row
    assert list(row)[: len(REFERENCE_COLUMNS)] == list(REFERENCE_COLUMNS)
    _check_complete_row(row, num_iters=6, batch_size=2)
    assert (row["design"], row["device"], row["model"], row["image_size"]) == (design, "cpu", model, "32")
    assert row["compile"] == "False" and row["m_compile_time"] == ""
    # Loaded only when a checkpoint is (resnet18's from --model_dir; the checkpoint test reads its figures).
    assert (row["torch_load_time"] == "") == (model == "identity")
    assert row["gpu_util"] == ""  # no GPU: empty, not zero
    assert row["torch_version"] == torch.__version__ and row["torchvision_version"] == metadata.version("torchvision")
    # What produced it: this checkout's commit (and whether its code differed), the CPU's model.
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
    assert row["commit"] == head.stdout.strip() and row["code_dirty"] in ("True", "False")
    assert row["cpu_model"] and row["cpu_model"] == row["device_name"]  # a CPU run: the device is that CPU
    assert "throughput" in run.stdout and "samples/s" in run.stdout
    assert "GPU util" not in run.stdout and "compile n/a" not in run.stdout  # nothing to say: not said
    # The model alone, timed in the same backend after serving: the efficiency column is read against it.
    ceiling = float(row["ceiling_throughput"])
    assert ceiling == pytest.approx(2 / (float(row["ceiling_batch_ms"]) / 1e3), rel=1e-6)
    assert float(row["efficiency"]) == pytest.approx(float(row["throughput"]) / ceiling, rel=1e-6)
    # Its interval (the ceiling's slowest to fastest loop) holds it.
    assert float(row["efficiency_low"]) <= float(row["efficiency"]) <= float(row["efficiency_high"])
    # At the design's own concurrency: one forward at a time, or 1 to num_workers threads for pipelined.
    assert 1 <= int(row["ceiling_concurrency"]) <= workers and float(row["ceiling_spread_pct"]) >= 0
    assert float(row["ceiling_before_throughput"]) > 0 and float(row["ceiling_after_throughput"]) > 0
    assert 0 < float(row["utilisation"]) <= 1
    assert row["littles_law_ratio"] == "" and row["windows"] == row["stable"] == ""  # burst, fixed count
    assert (row["transport"], row["wire_dtype"], row["precision"]) == ("shm", "float32", "default")
    # One backend process: it served every measured request, and MPS does not apply on the CPU.
    assert (row["instances"], row["requests_per_instance"], row["mps"]) == ("1", "6", "")
    assert finished.left_running == []


@dataclass(frozen=True)
class WindowRuns:
    stable: ServerRun  # a rule that three windows meet: the phase ends there
    never: ServerRun  # a rule nothing meets: the phase ends at --max_windows


@pytest.fixture(scope="module")
def window_runs(tmp_path_factory: pytest.TempPathFactory) -> WindowRuns:
    """Two runs with stability windows, their rows appended to one file: the stability test reads both, and the
    second, another design and batch size without the ceiling, is the accumulation test's second row."""
    results_dir = tmp_path_factory.mktemp("windows")
    windows = ["--stability_pct", "100", "--window_s", "0.05", "--window_requests", "5", "--max_windows", "12"]
    # 20 ms forwards: a window's p99 is then the steady queue behind the ring, which a scheduler hiccup of a
    # busy 2-core machine cannot double (an identity forward's p99 of a few ms can). Three windows when nothing
    # disturbs the run; one stall can spoil the judgement of three windows in a row (a window it made noisy does
    # not count, one it slowed is off the others' mean), so it ends by the 5th; never at --max_windows.
    stable = run_server([*TINY, "--design", "serial", "--inject_delay_ms", "20", *windows], results_dir)
    never = ["--stability_pct", "1e-9", "--window_s", "0.05", "--window_requests", "5", "--max_windows", "4"]
    # The default design (pipelined), 3 a request, --no-ceiling: the flags the accumulation test tells rows by.
    return WindowRuns(stable, run_server([*TINY, "--batch_size", "3", "--no-ceiling", *never], results_dir))


def test_rows_accumulate_in_one_file(window_runs: WindowRuns) -> None:
    assert window_runs.stable.returncode == 0 and window_runs.never.returncode == 0, window_runs.never.stderr
    rows = window_runs.never.rows
    assert [(r["design"], r["batch_size"]) for r in rows] == [("serial", "2"), ("pipelined", "3")]
    last = rows[-1]  # --no-ceiling: not measured, not zero
    assert last["ceiling_throughput"] == last["efficiency"] == last["efficiency_low"] == last["efficiency_high"] == ""


def test_row_columns_name_every_column_of_a_row_in_row_order(design_runs: DesignRuns, tmp_path: Path) -> None:
    """ROW_COLUMNS, the declared columns (serverbench/schema/columns.py) that the documentation is checked against,
    cannot drift from the rows a run writes: no undeclared column, the declared order."""
    assert len(set(ROW_COLUMNS)) == len(ROW_COLUMNS)
    run = design_runs["pipelined-3w"].run  # with --save_requests; its row alone in its file, under its own header
    assert run.returncode == 0, run.stderr
    row = run.row
    assert set(row) <= set(ROW_COLUMNS), sorted(set(row) - set(ROW_COLUMNS))
    assert list(row) == [column for column in ROW_COLUMNS if column in row]
    # A plain run carries every column but those of torchrun's rows and of the peak search's runs.
    assert set(ROW_COLUMNS) - set(row) == {*JOB_COLUMNS, *PEAK_SEARCH_COLUMNS}
    # A run that ended before either process reported: its row too.
    cfg = make_config([*TINY, "--results_dir", str(tmp_path / "failed")])
    failed = RunResult(status="error", error="no report from frontend, backend")
    assert set(build_row(cfg, failed)) <= set(ROW_COLUMNS)
    assert set(write_detail_files(cfg, failed, "run0")) <= set(ROW_COLUMNS)


def test_checkpoint_is_loaded_from_path_and_from_model_dir(design_runs: DesignRuns, tmp_path: Path) -> None:
    # The serial design's run served resnet18 from --model_dir, which finds the file by torchvision's name for it.
    run = design_runs["serial"].run
    weights = design_runs.weights / WEIGHTS_FILE
    assert run.returncode == 0, run.stderr
    assert run.row["checkpoint"] == str(weights)
    assert float(run.row["torch_load_time"]) >= 0
    _check_complete_row(run.row, num_iters=6, batch_size=2)
    # --checkpoint names the same file that --model_dir finds (it loads only by path).
    explicit = make_config([*TINY, "--model", "resnet18", "--checkpoint", str(weights), "--results_dir", str(tmp_path)])
    assert explicit.checkpoint == str(weights)


def test_profile_writes_a_chrome_trace_of_the_backend_threads(design_runs: DesignRuns) -> None:
    finished = design_runs["pipelined-3w"]
    run = finished.run
    assert run.returncode == 0, run.stderr
    assert "gpuGetDeviceCount" not in run.stderr and "USDT" not in run.stderr  # kineto's GPU probe on a CPU
    trace_path = Path(run.row["profile_trace"])
    assert trace_path.parent == finished.results_dir and trace_path.exists()
    trace = json.loads(trace_path.read_text())
    names = {event.get("name", "") for event in trace["traceEvents"]}
    assert any("sum" in n for n in names)  # the identity model's forward ran under the profiler
    threads = {event.get("tid") for event in trace["traceEvents"] if event.get("ph") == "X"}
    assert len(threads) >= 2  # H2D, prediction and D2H threads, not only the main one


@pytest.mark.cuda
@pytest.mark.parametrize("design", ["serial", "threaded", "pipelined"])
def test_each_design_on_cuda(tmp_path: Path, design: str) -> None:
    run = run_server(
        # 1.5 s at least: NVML's utilisation covers 1/6 s to 1 s, and only windows wholly in the phase count
        [*"--device cuda --image_size 64 --batch_size 8 --num_iters 20 --duration_s 1.5".split(), "--design", design],
        tmp_path,
    )
    assert run.returncode == 0, run.stderr
    assert int(run.row["requests_sent"]) >= 20  # as many as 1.5 s took, 20 at least
    _check_complete_row(run.row, num_iters=int(run.row["requests_sent"]), batch_size=8)
    assert run.row["timing_source"] == "cuda_events"
    assert float(run.row["mean_forward_ms"]) > 0
    assert int(run.row["gpu_samples"]) > 0 and float(run.row["gpu_util"]) >= 0


def test_stability_windows_end_the_measured_phase_and_the_row_reports_the_last_three(window_runs: WindowRuns) -> None:
    run = window_runs.stable
    assert run.returncode == 0, run.stderr
    row = run.row
    assert row["status"] == "ok" and row["stable"] == "True"
    assert 3 <= int(row["windows"]) <= 5, (row["windows"], row["noisy_windows"], row["window_throughputs"])
    throughputs = [float(t) for t in row["window_throughputs"].split(";")]
    assert len(throughputs) == int(row["windows"])
    # The row's figures are the last three windows': their spread, and at least their 3 x 5 requests.
    assert float(row["window_throughput_cv_pct"]) == pytest.approx(cv_pct(throughputs[-3:]), rel=1e-3, abs=1e-3)
    assert int(row["requests_sent"]) == int(row["responses_received"]) >= int(row["reported_requests"]) >= 15
    assert f"windows       {row['windows']}, stable" in run.stdout
    # A rule nothing meets: the phase ends at --max_windows, and the row says so; it is not an error.
    run = window_runs.never
    assert run.returncode == 0, run.stderr
    row = run.rows[-1]
    assert row["status"] == "ok" and row["stable"] == "False" and int(row["windows"]) == 4
    assert "NOT stable" in run.stdout


def _commit_and_dirty(provenance) -> tuple[str | None, bool | None]:
    found = provenance.read_provenance()
    return found.commit, found.code_dirty


def test_a_checkout_is_dirty_when_its_code_differs_from_its_commit_not_when_its_results_do(
    tmp_path: Path, monkeypatch
) -> None:
    """The row's `code_dirty`: an edited or new code file makes the code that ran not the commit's; rows appended to
    a tracked results file do not. Outside git both provenance columns stay empty."""
    from serverbench.system import provenance

    monkeypatch.setattr(provenance, "CHECKOUT", tmp_path)
    assert _commit_and_dirty(provenance) == (None, None)  # not a git checkout
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (tmp_path / "server.py").write_text("x = 1\n")
    (tmp_path / "runs.csv").write_text("a\n")
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "c"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    assert _commit_and_dirty(provenance) == (head, False)
    (tmp_path / "runs.csv").write_text("a\n1\n")
    assert _commit_and_dirty(provenance) == (head, False)  # results are not code
    (tmp_path / "new_module.py").write_text("")
    assert _commit_and_dirty(provenance) == (head, True)  # new code, not yet committed
    (tmp_path / "new_module.py").unlink()
    (tmp_path / "server.py").write_text("x = 2\n")
    assert _commit_and_dirty(provenance) == (head, True)
