"""--verify compares every response with a serial, synchronised reference answer; a planted synchronisation bug
(one device buffer reused while a forward may still read it) is caught, and would pass unnoticed without it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import TINY, run_server

from serverbench.load.verify import leaf_errors

# The tiny CNN a factory --model builds (imported from the server's working folder): a convolution, so that
# channels-last and bf16 take a CNN's kernels, and its float32 [3, H, W] input takes --wire_dtype uint8.
TINY_CNN = """from torch import nn


def make_model() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))
"""
VERIFIED = [*TINY, "--model", "tiny_cnn:make_model", "--num_iters", "20", "--verify"]


# The data paths here on the pipelined design (its threads and streams are where reuse can go wrong); each path on
# one design in bench.gpu_check --dry_run's verify check (tests/test_gpu_check.py), where the planted race is
# caught too; every design serves each request its own rows of a formed batch in tests/test_batcher.py; the compiled
# uint8 decoding in tests/test_e2e.py's compile test, which runs with --verify.
# Two runs hold every transport, wire dtype and precision case (the transport is read before the wire is decoded
# and the precision applied in the forward: the flags do not interfere), as the GPU runs below pair them. A model's
# forward time is not what shows a reuse: the planted one is caught on the CPU with the identity model too.
DATA_PATHS = [
    ("queue-bf16-channels-last", ["--transport", "queue", "--precision", "bf16", "--channels_last"]),
    ("shm-uint8-one-slot-slow-consumer", ["--ring_slots", "1", "--inject_delay_ms", "5", "--wire_dtype", "uint8"]),
]


@pytest.mark.parametrize("extra", [e for _, e in DATA_PATHS], ids=[n for n, _ in DATA_PATHS])
def test_every_transport_wire_dtype_and_precision_gives_the_serial_answers(tmp_path: Path, extra: list[str]) -> None:
    """Transports and buffer pools reuse memory; any early reuse would show as a wrong answer here."""
    (tmp_path / "tiny_cnn.py").write_text(TINY_CNN)
    args = [*VERIFIED, "--design", "pipelined", "--num_workers", "2", "--max_inflight", "3", *extra]
    run = run_server(args, tmp_path, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    row = run.row
    assert (row["status"], row["wrong_outputs"]) == ("ok", "0")
    assert float(row["max_abs_error"]) == 0.0  # the CPU is deterministic at every precision
    assert "  verify        passed: every answer equal to the serial one" in run.stdout  # and says so
    flags = dict(zip(extra[::2], extra[1::2]))
    assert row["transport"] == flags.get("--transport", "shm")
    assert row["wire_dtype"] == flags.get("--wire_dtype", "float32")
    assert row["precision"] == flags.get("--precision", "default")
    assert row["channels_last"] == str("--channels_last" in extra)


def test_without_verify_the_same_bug_goes_unnoticed(tmp_path: Path) -> None:
    # The identity model: the planted bug shows on the CPU with it too (under --verify, wrong outputs).
    run = run_server(
        [*TINY, "--num_iters", "20", "--design", "pipelined", "--inject_fault", "early_reuse"],
        tmp_path,
    )
    assert run.returncode == 0 and run.row["status"] == "ok"  # why --verify exists
    assert run.row["wrong_outputs"] == ""


def test_a_leaf_of_another_dtype_is_wrong_even_with_the_same_values() -> None:
    """Only the leaves cross the pipe: an index leaf that became a float of the same value is a changed output."""
    indices = np.array([7, 3], dtype=np.int64)
    assert leaf_errors((indices.copy(),), (indices,), 0.0) == (0.0, False)
    assert leaf_errors((indices.astype(np.float32),), (indices,), 10.0) == (float("inf"), True)
    assert leaf_errors((indices.astype(np.int32),), (indices,), 10.0) == (float("inf"), True)


# resnet18, 64x64, batch 32, pipelined with 2 workers, --verify: the GPU runs of this file.
CUDA_PIPELINED_VERIFY = ["--device", "cuda", "--model", "resnet18", "--image_size", "64", "--batch_size", "32"]
CUDA_PIPELINED_VERIFY += ["--num_iters", "40", "--design", "pipelined", "--num_workers", "2", "--verify"]


@pytest.mark.cuda
@pytest.mark.parametrize("fault", [None, "early_reuse"])
def test_verify_on_cuda(tmp_path: Path, fault) -> None:
    args = CUDA_PIPELINED_VERIFY
    run = run_server(args + (["--inject_fault", fault] if fault else []), tmp_path)
    if fault is None:
        assert run.returncode == 0 and run.row["status"] == "ok", run.stderr
        assert float(run.row["max_abs_error"]) <= 1e-3
        assert run.row["transport"] == "shm"  # the ring, page-locked with cudaHostRegister
    else:
        assert run.row["status"] == "wrong_output" and int(run.row["wrong_outputs"]) > 0


@pytest.mark.cuda
@pytest.mark.parametrize(
    "extra",
    [
        ["--wire_dtype", "uint8", "--precision", "bf16"],
        ["--transport", "queue", "--channels_last", "--precision", "tf32"],
    ],
)
def test_data_paths_on_cuda_stay_within_tolerance(tmp_path: Path, extra: list[str]) -> None:
    args = [*CUDA_PIPELINED_VERIFY, *extra]
    run = run_server(args, tmp_path)
    assert run.returncode == 0 and run.row["status"] == "ok", run.stderr
    # within the tolerance relative to each leaf's scale: no response counted wrong
    assert run.row["wrong_outputs"] == "0" and float(run.row["max_abs_error"]) < float("inf")
