"""The user's own model (docs/your-model.md): every form of --model served end to end on the CPU, several inputs through
dynamic batching and both transports, outputs of any structure verified leaf by leaf, --input parsed and drawn as
documented, and every bad source or input refused in one line before anything is written."""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import re
import subprocess
import sys
import textwrap
import threading
import time
import zipfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ROOT, make_config

import server
from serverbench.config.inputs import InputSpec, parse_input
from serverbench.load.verify import leaf_errors
from serverbench.transport.channels import RequestChannel, ShmRequestChannel, make_request_channel
from serverbench.transport.pool import make_input
from tests.helpers import QUICK, exit_code, ok_row, serve

# Small and quick: a few requests, no ceiling (it would time each model again).
ENCODER = ["--model", "examples.tiny_encoder:make_model", "--model_kwargs", '{"depth": 1}']
TOKENS = ["--input", "ids:int64:8:0-999", "--input", "mask:int64:8:1-1"]
TOKENS_SERVED = "ids:int64:8:0-999 mask:int64:8:1-1"


def encoder_request_bytes(batch: int) -> int:
    return batch * 2 * 8 * 8  # ids and mask, 8 int64 tokens each


def encoder_response_bytes(batch: int) -> int:
    return batch * (64 + 8 * 1000) * 4  # pooled [B, 64] and logits [B, 8, 1000], float32


# Factories for the tests, imported by the server from its current folder (the tests run it there).
FACTORIES = '''
import torch
from torch import nn

NOT_CALLABLE = 3


class Nested(nn.Module):
    """A dict holding a tuple: leaves a (float32), b[0] (int64), b[1] (float16, returned as float32)."""

    def __init__(self, drift: bool = False):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(3.0))
        self.drift = drift
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        index = x.argmax(1)
        if self.drift:  # a different integer answer at every forward: the reference and the served ones differ
            index = index + self.calls
        return {"b": (index, (x[:, :3] * self.scale).half()), "a": torch.tanh(x)}


def nested(drift: bool = False):
    return Nested(drift)


class Sum(nn.Module):
    def forward(self, x):
        return x.sum()


def scalar():
    return Sum()


class WithInt(nn.Module):
    def forward(self, x):
        return (x, 3)


def not_a_tensor():
    return WithInt()


def raises(width: int = 4):
    raise RuntimeError(f"width {width} is too narrow")


def not_a_module():
    return lambda x: x


class FailsOnThirdCall(nn.Module):
    calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 3:
            raise RuntimeError("the third forward fails")
        return x * 2

'''


@pytest.fixture(scope="module")
def factories(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("factories")
    (folder / "factories.py").write_text(textwrap.dedent(FACTORIES))
    (folder / "broken_import.py").write_text("import no_such_module_for_this_test\n")
    return folder


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict[str, Path]:
    """The tiny encoder exported (dynamic batch 1 to 16) and packaged by AOTInductor, once; a static-batch program;
    and two .pt2 files that are neither."""
    folder = tmp_path_factory.mktemp("exported")
    proc = subprocess.run(
        [sys.executable, "-m", "examples.export_tiny_encoder", "--out", str(folder)]
        + ["--tokens", "8", "--depth", "1", "--max_batch", "16"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    static = folder / "static.pt2"
    torch.export.save(torch.export.export(torch.nn.Linear(4, 2), (torch.randn(2, 4),)), static)
    garbage = folder / "garbage.pt2"
    garbage.write_bytes(b"not a zip archive at all\n")
    not_program = folder / "not_program.pt2"
    with zipfile.ZipFile(not_program, "w") as archive:
        archive.writestr("notes/readme.txt", "a zip, but no program in it")
    return {
        "program": folder / "tiny_encoder.pt2",
        "package": folder / "tiny_encoder_aoti.pt2",
        "static": static,
        "garbage": garbage,
        "not_program": not_program,
    }


# ------------------------------------------------------------------------------------------------ each --model form


def test_a_factory_is_served_with_its_kwargs_and_every_input_through_dynamic_batching(tmp_path: Path) -> None:
    args = [*QUICK, *ENCODER, *TOKENS, "--verify", "--design", "pipelined", "--max_batch_size", "8"]
    row = ok_row(serve([*args, "--max_queue_delay_ms", "20"], tmp_path))
    assert (row["model"], row["model_kwargs"], row["compile_path"]) == (ENCODER[1], '{"depth": 1}', "eager")
    assert row["aoti_runners"] == row["aoti_compiled_now"] == ""  # not AOTInductor: empty, not 0 or False
    assert row["inputs"] == TOKENS_SERVED
    # Requests of 2 were batched together (both inputs concatenated), and every response held its own rows of both
    # output leaves, right (the tolerance is 1e-4 with dynamic batching).
    assert row["max_batch_size"] == "8" and float(row["mean_formed_batch"]) > 2
    assert int(row["request_bytes"]) == encoder_request_bytes(2)
    assert int(row["response_bytes"]) == encoder_response_bytes(2)


def test_an_exported_program_is_served_with_the_inputs_read_from_it(tmp_path: Path, exported) -> None:
    row = ok_row(serve([*QUICK, "--model", str(exported["program"]), "--batch_size", "3", "--verify"], tmp_path))
    assert row["compile_path"] == "eager" and row["model_kwargs"] == "" and row["aoti_runners"] == ""
    assert row["inputs"] == "ids:int64:8 mask:int64:8"  # names, dtypes and shapes from the program itself
    assert int(row["request_bytes"]) == encoder_request_bytes(3)
    assert int(row["response_bytes"]) == encoder_response_bytes(3)


def test_an_aoti_package_is_served_with_a_runner_per_request_held(tmp_path: Path, exported) -> None:
    args = [*QUICK, "--model", str(exported["package"]), *TOKENS, "--verify", "--design", "pipelined"]
    row = ok_row(serve([*args, "--num_workers", "2", "--max_inflight", "2"], tmp_path))
    assert (row["compile_path"], row["aoti_runners"], row["num_workers"]) == ("aoti", "2", "2")
    assert row["aoti_compiled_now"] == ""  # compiled by whoever packaged it, not by this run
    assert row["inputs"] == TOKENS_SERVED
    assert int(row["request_bytes"]) == encoder_request_bytes(2)
    assert int(row["response_bytes"]) == encoder_response_bytes(2)
    assert not (tmp_path / "aoti_cache").exists()


def test_aoti_compiles_once_per_model_and_serves_every_design_from_the_cache(tmp_path: Path) -> None:
    """One results folder, so one cache: the factory compiled at the first run and loaded at the second (another
    design, another number of runners); identity, another model, compiled anew. Runners: one per request the
    backend may hold (--max_inflight), at least one per prediction thread."""
    aoti = [*QUICK, "--aoti", "--verify"]
    first = ok_row(serve([*aoti, *ENCODER, *TOKENS, "--design", "serial", "--max_inflight", "1"], tmp_path))
    assert (first["compile_path"], first["aoti_runners"], first["aoti_compiled_now"]) == ("aoti", "1", "True")
    assert first["inputs"] == TOKENS_SERVED and int(first["response_bytes"]) == encoder_response_bytes(2)
    packages = sorted((tmp_path / "aoti_cache").glob("*.pt2"))
    assert len(packages) == 1

    again = [*aoti, *ENCODER, *TOKENS, "--design", "pipelined", "--num_workers", "2", "--max_inflight", "1"]
    second = ok_row(serve(again, tmp_path), rows=2)
    assert (second["compile_path"], second["aoti_runners"], second["aoti_compiled_now"]) == ("aoti", "2", "False")
    assert float(second["m_compile_time"]) < float(first["m_compile_time"])
    assert sorted((tmp_path / "aoti_cache").glob("*.pt2")) == packages  # that package, not another

    other = ok_row(serve([*aoti, "--model", "identity", "--num_workers", "3"], tmp_path), rows=3)
    assert (other["compile_path"], other["aoti_runners"], other["aoti_compiled_now"]) == ("aoti", "8", "True")
    assert other["inputs"] == "image:float32:3x8x8"
    assert (int(other["request_bytes"]), int(other["response_bytes"])) == (2 * 3 * 8 * 8 * 4, 2 * 4)
    assert len(list((tmp_path / "aoti_cache").glob("*.pt2"))) == 2


def test_a_damaged_cached_aoti_package_is_compiled_again_and_the_log_says_so(tmp_path: Path, monkeypatch, caplog):
    """A package cut short in the cache (a full disk, a copy stopped half-way) is not served from it for ever. The
    compiler is a stand-in writing a small package (a real one passes the check: the test above)."""
    import torch._inductor

    from serverbench.backend.sources import compile_aoti

    def fake_compile(program, package_path: str) -> None:
        with zipfile.ZipFile(package_path, "w") as archive:
            archive.writestr("model/data/aotinductor/model/model.wrapper.so", bytes(range(256)) * 64)

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", fake_compile)
    args = (torch.nn.Linear(4, 2), (torch.randn(2, 4),), None, tmp_path, "a linear layer", 10)
    package, now = compile_aoti(*args)
    assert now and compile_aoti(*args) == (package, False)  # whole: served from the cache
    whole = Path(package).read_bytes()
    Path(package).write_bytes(whole[: len(whole) // 2])
    with caplog.at_level(logging.WARNING, logger="backend"):
        assert compile_aoti(*args) == (package, True)
    assert f"{package} is damaged" in caplog.text and "compiling it again" in caplog.text
    assert Path(package).read_bytes() == whole and compile_aoti(*args) == (package, False)


# ------------------------------------------------------------------------------------------------ outputs and --verify


def test_nested_outputs_travel_whole_and_every_leaf_is_verified(tmp_path: Path, factories: Path) -> None:
    args = [*QUICK, "--model", "factories:nested", "--input", "x:float32:4", "--verify", "--num_workers", "2"]
    row = ok_row(serve(args, tmp_path / "good", cwd=factories))
    assert (row["inputs"], row["compile_path"], row["model_kwargs"]) == ("x:float32:4", "eager", "")
    # a [B, 4] float32, b[0] [B] int64 (kept an integer), b[1] [B, 3] float16 (returned as float32)
    assert int(row["response_bytes"]) == 2 * (4 * 4 + 8 + 3 * 4)
    assert row["max_abs_error"] == "0.0"

    # The same model with an integer leaf that drifts at every forward: the served answers differ from the
    # reference in that leaf alone (the last in pytree order), and --verify says so.
    drift = serve([*args, "--model_kwargs", '{"drift": true}'], tmp_path / "drift", cwd=factories)
    row = drift.row
    assert row["status"] == "wrong_output", row["error"]
    # every measured response (and the warm-up's, which is verified too)
    assert int(row["wrong_outputs"]) in (10, 11) and float(row["max_abs_error"]) >= 1


LOG_LINE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ [\w ]+\[\d+\] [A-Z]+ ")  # a process's log line


def test_a_model_error_while_serving_is_one_line_on_stderr_and_its_traceback_in_the_file_the_row_names(
    tmp_path: Path, factories: Path
) -> None:
    """The forward raises at its third call (the first measured request): stderr says so in one line besides the
    log lines, without a traceback, which is kept in the file the row names."""
    args = [*QUICK, "--model", "factories:FailsOnThirdCall", "--input", "x:float32:4", "--design", "serial"]
    run = serve(args, tmp_path, cwd=factories, timeout_s=120)
    assert run.returncode == 1, run.stderr[-3000:]
    row = run.row
    assert (row["status"], row["error"]) == ("error", "RuntimeError: the third forward fails")
    assert "Traceback" not in run.stderr + run.stdout
    traceback_file = tmp_path / row["traceback_file"]
    said = [line for line in run.stderr.splitlines() if not LOG_LINE.match(line)]
    assert said == [
        f"server.py: run failed (error): RuntimeError: the third forward fails (traceback: {traceback_file})"
    ]
    kept = traceback_file.read_text()
    assert kept.startswith("Traceback (most recent call last):") and 'raise RuntimeError("the third forward' in kept


def test_leaf_errors_compare_floats_within_tolerance_and_everything_else_exactly() -> None:
    floats = np.array([[0.5, -1.0], [2.0, 3.0]], dtype=np.float32)
    ints = np.array([7, 3], dtype=np.int64)
    expected = (floats, ints)
    assert leaf_errors((floats.copy(), ints.copy()), expected, 0.0) == (0.0, False)

    near = floats + np.float32(1e-3)
    error, wrong = leaf_errors((near, ints.copy()), expected, 1e-2)
    assert not wrong and error == pytest.approx(1e-3, rel=1e-3)  # within the tolerance
    assert leaf_errors((near, ints.copy()), expected, 1e-4)[1]  # beyond it

    off_by_one = ints.copy()
    off_by_one[1] += 1
    error, wrong = leaf_errors((floats.copy(), off_by_one), expected, 10.0)
    assert wrong and error == 1.0  # an integer leaf is exact, whatever the float tolerance

    assert leaf_errors((floats.copy(), ints[:1].copy()), expected, 10.0) == (float("inf"), True)  # another shape
    assert leaf_errors((floats.copy(),), expected, 10.0) == (float("inf"), True)  # a leaf missing
    with_nan = floats.copy()
    with_nan[0, 1] = np.nan
    assert leaf_errors((with_nan, ints.copy()), expected, 10.0)[1]  # NaN is never within any tolerance
    mask = np.array([True, False])
    assert leaf_errors((~mask,), (mask,), 10.0)[1]  # bool leaves exactly too


# ------------------------------------------------------------------------------------------------ --input


@pytest.mark.parametrize(
    "text,expected",
    [
        ("ids:int64:128:0-30521", InputSpec("ids", "int64", (128,), 0, 30521)),
        ("image:float32:3x224x224", InputSpec("image", "float32", (3, 224, 224))),
        ("mask:int64:8:1-1", InputSpec("mask", "int64", (8,), 1, 1)),
        ("x_2:float16:4x5:-0.5-0.5", InputSpec("x_2", "float16", (4, 5), -0.5, 0.5)),
        ("b:int8:3:-128-127", InputSpec("b", "int8", (3,), -128, 127)),  # the dtype's whole range, inclusive
        ("flag:bool:6", InputSpec("flag", "bool", (6,))),
        # int64's whole range, read as integers: a float would round 2**63-1 up past it, and 2**53+1 down
        ("big:int64:2:0-9223372036854775807", InputSpec("big", "int64", (2,), 0, 2**63 - 1)),
        ("all:int64:2:-9223372036854775808-9223372036854775807", InputSpec("all", "int64", (2,), -(2**63), 2**63 - 1)),
        ("odd:int64:2:9007199254740993-9007199254740995", InputSpec("odd", "int64", (2,), 2**53 + 1, 2**53 + 3)),
    ],
)
def test_good_input_specs_parse(text: str, expected: InputSpec) -> None:
    spec = parse_input(text)
    assert spec == expected
    assert spec.describe() == text
    assert parse_input(spec.describe()) == spec


def test_an_input_without_a_range_draws_from_its_default() -> None:
    assert parse_input("ids:int64:8").value_range == (0, 1)  # integers: 0-1, an index every embedding has
    assert parse_input("x:float32:8").value_range is None  # floats: standard normal
    assert parse_input("ids:int64:8").sample_bytes() == 64 and parse_input("x:float16:3x5").sample_bytes() == 30


@pytest.mark.parametrize(
    "text,fragment",
    [
        ("ids:int64", "is not name:dtype:shape[:low-high]"),
        ("ids:int64:8:0-9:more", "is not name:dtype:shape[:low-high]"),
        ("ids:int64:8x", "is not whole numbers joined by x"),
        ("ids:int64:eight", "is not whole numbers joined by x"),
        ("ids:int64:8x0", "every dimension of '8x0' must be at least 1"),
        ("ids:int64:-4", "every dimension of '-4' must be at least 1"),
        ("ids:int128:8", "unknown dtype 'int128'"),
        ("ids:int8:4:0-300", "outside what int8 holds (-128 to 127)"),
        ("ids:int64:4:0-9223372036854775808", "outside what int64 holds (-9223372036854775808 to 9223372036854775807)"),
        ("ids:uint8:4:-1-3", "outside what uint8 holds (0 to 255)"),
        ("ids:int64:4:5-3", "must have finite low <= high"),
        ("ids:int64:4:0.5-3", "an int64 range takes whole numbers"),
        ("ids:int64:4:zero-3", "is not low-high"),
        ("2ids:int64:4", "is not a Python identifier"),
        ("my-ids:int64:4", "is not a Python identifier"),
        (":int64:4", "is not a Python identifier"),
    ],
)
def test_bad_input_specs_are_refused_with_what_is_wrong(text: str, fragment: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError) as caught:
        parse_input(text)
    assert fragment in str(caught.value)


def test_integers_are_drawn_from_the_whole_inclusive_range() -> None:
    generator = torch.Generator().manual_seed(0)
    values = make_input(parse_input("ids:int64:50:3-5"), 20, "float32", generator)
    assert values.dtype == torch.int64 and values.shape == (20, 50)
    assert set(values.unique().tolist()) == {3, 4, 5}
    top = make_input(parse_input("b:int8:50:120-127"), 20, "float32", generator)
    assert top.dtype == torch.int8 and set(top.unique().tolist()) == set(range(120, 128))
    ones = make_input(parse_input("mask:int64:8:1-1"), 4, "float32", generator)
    assert bool((ones == 1).all())
    whole = make_input(parse_input("a:int64:64:-9223372036854775808-9223372036854775807"), 8, "float32", generator)
    assert whole.dtype == torch.int64 and int(whole.min()) < -(2**61) and int(whole.max()) > 2**61  # int64's range
    odd = make_input(parse_input("odd:int64:50:9007199254740993-9007199254740995"), 20, "float32", generator)
    assert set(odd.unique().tolist()) == {2**53 + 1, 2**53 + 2, 2**53 + 3}
    floats = make_input(parse_input("x:float16:100:-0.5-0.5"), 10, "float32", generator)
    assert floats.dtype == torch.float16 and -0.5 <= float(floats.min()) and float(floats.max()) <= 0.5
    assert float(floats.max() - floats.min()) > 0.5  # drawn over the range, not a constant


# ------------------------------------------------------------------------------------------------ transports


def _two_inputs_config(tmp_path: Path, **changes):
    """A config whose model takes an int64 input of 3 and a float16 input of 5 per sample (odd byte counts: the
    second input starts on its own 64-byte boundary)."""
    cfg = make_config(["--device", "cpu", "--model", "identity", "--batch_size", "2", "--results_dir", str(tmp_path)])
    inputs = (InputSpec("ids", "int64", (3,), 0, 9), InputSpec("scores", "float16", (5,)))
    return replace(cfg, inputs=inputs, **changes)


def _requests(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        (
            torch.randint(-(2**62), 2**62, (2, 3), generator=generator, dtype=torch.int64),
            torch.randn(2, 5, generator=generator).half(),
        )
        for _ in range(count)
    ]


def test_the_shm_ring_carries_several_inputs_of_different_dtypes_intact(tmp_path: Path) -> None:
    cfg = _two_inputs_config(tmp_path, ring_slots=2)
    channel = ShmRequestChannel(mp.get_context("spawn"), cfg)
    requests = _requests(6)
    received = []

    def send() -> None:
        for i, inputs in enumerate(requests):
            channel.send(i, inputs, time.perf_counter_ns(), lambda: False)
        channel.send_end(lambda: False)

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    try:
        while (request := channel.receive(timeout_s=10)) is not None:
            ids, scores = request.inputs
            sent_ids, sent_scores = requests[request.request_id]
            assert (ids.dtype, scores.dtype) == (torch.int64, torch.float16)
            assert torch.equal(ids, sent_ids) and torch.equal(scores, sent_scores)
            received.append(request.request_id)
            channel.release(request.slot)
        sender.join(timeout=10)
    finally:
        channel.close()
    assert received == list(range(6))  # six requests through two slots, each whole
    assert cfg.request_bytes == 2 * (3 * 8 + 5 * 2)


def test_the_queue_transport_carries_several_inputs_of_different_dtypes_intact(tmp_path: Path) -> None:
    cfg = _two_inputs_config(tmp_path, transport="queue")
    channel = make_request_channel(mp.get_context("spawn"), cfg)
    assert isinstance(channel, RequestChannel)
    (inputs,) = _requests(1)
    channel.send(4, inputs, 9, lambda: False)
    request = channel.receive(timeout_s=10)
    assert (request.request_id, request.sent_ns) == (4, 9)
    assert [t.dtype for t in request.inputs] == [torch.int64, torch.float16]
    assert all(torch.equal(got, sent) for got, sent in zip(request.inputs, inputs))


# ------------------------------------------------------------------------------------------------ refused up front

TOKENS_NO_RANGE = ["--input", "ids:int64:8", "--input", "mask:int64:8"]
PROCESS = "process"  # the case runs server.py as a process: what it does can take the process down, or print
# more than Python's stderr (the AOTInductor runtime's C++, torch's import-time warnings)
BAD_USER_MODELS = [
    (["--model", "broken_import:make"], "cannot import broken_import (ModuleNotFoundError"),
    (["--model", "broken_import:make"], "cannot import broken_import (ModuleNotFoundError", PROCESS),
    (["--model", "factories:missing"], "--model factories:missing: factories has no attribute missing"),
    (["--model", "factories:NOT_CALLABLE"], "NOT_CALLABLE is a int, not callable"),
    (["--model", "factories:raises", "--model_kwargs", '{"width": 3}'], "raised RuntimeError: width 3 is too narrow"),
    (["--model", "factories:raises", "--model_kwargs", '{"depth": 3}'], "raised TypeError"),
    (["--model", "factories:not_a_module"], "not_a_module returned a function, not an nn.Module"),
    (["--model", "factories:", "--input", "x:float32:4"], "expected package.module:factory"),
    (["--model", "factories:nested", "--model_kwargs", "{drift: 1}"], "not JSON"),
    (["--model", "factories:nested", "--model_kwargs", "[1, 2]"], "expected a JSON object"),
    (["--model", "identity", "--model_kwargs", "{}"], "--model_kwargs applies to a package.module:factory --model"),
    (["--model", "{program}", "--model_kwargs", "{}"], "--model_kwargs applies to a package.module:factory --model"),
    (["--model", "{garbage}"], "not a .pt2 archive"),
    pytest.param(
        ["--model", "{not_program}"],
        "not a torch.export program (RuntimeError: ",  # the cause, not "see the warnings above"
        "in",
        id="--model {not_program}",
    ),
    (["--model", "{missing}"], "no such file"),
    (
        ["--model", "{program}", "--input", "ids:int32:8", "--input", "mask:int64:8"],
        "--input ids:int32:8: the program's input ids is int64 8 per sample",
    ),
    (
        ["--model", "{program}", "--input", "ids:int64:9", "--input", "mask:int64:8"],
        "--input ids:int64:9: the program's input ids is int64 8 per sample",
    ),
    (["--model", "{program}", "--input", "ids:int64:8"], "takes 2 input(s) (ids int64 8, mask int64 8), --input gives"),
    (["--model", "{program}", "--max_batch_size", "32"], "its batch dimension takes 1 to 16; this run needs 2 to 32"),
    (["--model", "{static}", "--batch_size", "3"], "exported with a static batch of 2; serve it with --batch_size 2"),
    (["--model", "{static}", "--max_batch_size", "4"], "--max_batch_size cannot form larger batches"),
    (["--model", "{program}", "--precision", "bf16"], "--precision bf16: a .pt2 --model's dtypes and layout"),
    (["--model", "{program}", "--channels_last"], "--channels_last: a .pt2 --model's dtypes and layout were fixed"),
    (["--model", "{program}", "--checkpoint", "{static}"], "a .pt2 --model holds its own weights"),
    (["--model", "{package}"], "is an AOTInductor package, which does not say what its inputs are"),
    (["--model", "{package}"], "is an AOTInductor package, which does not say what its inputs are", PROCESS),
    (["--model", "{package}", *TOKENS_NO_RANGE, "--compile"], "--compile: --model {package} is an AOTInductor package"),
    (["--model", "{package}", *TOKENS_NO_RANGE, "--aoti"], "--aoti: --model {package} is an AOTInductor package"),
    (["--model", "identity", "--aoti", "--compile"], "--aoti and --compile are two compile paths"),
    (["--model", "identity", "--input", "x:float32:4"], "the built-in model identity takes the image of --image_size"),
    (["--model", "resnet18", "--input", "x:float32:4"], "the built-in model resnet18 takes the image of --image_size"),
    ([*ENCODER, *TOKENS, "--wire_dtype", "uint8"], "--wire_dtype uint8 sends raw pixels of one float32 [3, H, W]"),
    (["--model", "{program}", "--wire_dtype", "uint8"], "this model's inputs are ids:int64:8, mask:int64:8"),
    ([*ENCODER, "--input", "x:float32:4", "--input", "x:float32:4"], "--input names must differ: x given more"),
    ([*ENCODER, "--input", "ids:int8:4:0-300"], "outside what int8 holds"),
    (
        [*ENCODER, "--input", "ids:int64:8:0-999"],
        "its forward fails on the generated inputs (ids int64 [2, 8]): TypeError",
    ),
    (
        [*ENCODER, "--input", "ids:int64:8:0-5000", "--input", "mask:int64:8:1-1"],
        "its forward fails on the generated inputs (ids int64 [2, 8], mask int64 [2, 8]): IndexError",
    ),
    (["--model", "factories:scalar", "--input", "x:float32:4"], "has no batch dimension of 2 first"),
    (["--model", "factories:not_a_tensor", "--input", "x:float32:4"], "holds a int; every leaf must be a tensor"),
    # An AOTInductor package whose --input does not fit it: its forward is tried in a real process.
    pytest.param(
        ["--model", "{package}", "--input", "ids:int64:8"],
        "its forward fails on the generated inputs (ids int64 [2, 8]): RuntimeError",
        PROCESS,
        id="package with one input of two",
    ),
    pytest.param(
        ["--model", "{package}", "--input", "ids:int64:8:0-5000", "--input", "mask:int64:8:1-1"],
        "its forward fails on the generated inputs (ids int64 [2, 8], mask int64 [2, 8]): the process ended "
        "(signal 6): index out of bounds",
        PROCESS,
        id="package with token ids beyond its vocabulary",
    ),
    pytest.param(
        ["--model", "{package}", "--input", "ids:int64:9", "--input", "mask:int64:9"],
        "unmatched dim value at 1, expected: 8, but got: 9",
        PROCESS,
        id="package with inputs of another shape",
    ),
]


def _bad_cases() -> list:
    cases = []
    for case in BAD_USER_MODELS:
        if not hasattr(case, "marks"):  # a plain tuple, not a pytest.param already
            argv, fragment, *how = case
            how = how[0] if how else "in"
            case = pytest.param(argv, fragment, how, id=" ".join(argv) + (" (process)" if how == PROCESS else ""))
        cases.append(case)
    return cases


@pytest.mark.parametrize("argv,fragment,how", _bad_cases())
def test_a_bad_model_source_or_input_is_one_line_and_exit_2(
    argv: list[str],
    fragment: str,
    how: str,
    tmp_path: Path,
    factories: Path,
    exported: dict[str, Path],
    capfd,
    monkeypatch,
) -> None:
    """Refused before any process starts: exit status 2, one line naming what is wrong, nothing written. Most cases
    run server.main in this process (a subprocess each would cost seconds of torch import); those marked PROCESS
    run server.py as a user does."""
    paths = {name: str(path) for name, path in exported.items()}
    paths["missing"] = str(tmp_path / "missing.pt2")
    argv = [paths[arg[1:-1]] if re.fullmatch(r"\{\w+\}", arg) else arg for arg in argv]
    results = tmp_path / "results"
    # A refusal that does not come would run a short benchmark, not the default 100 requests and the ceiling.
    argv = ["--device", "cpu", "--image_size", "8", "--batch_size", "2", *argv]
    argv += ["--num_iters", "2", "--warmup_iters", "1", "--no-ceiling"]
    if how == PROCESS:
        run = serve(argv, results, cwd=factories, timeout_s=120)
        returncode, stderr, stdout = run.returncode, run.stderr, run.stdout
    else:
        started = []
        monkeypatch.setattr(server, "run_benchmark", lambda cfg: started.append(cfg))
        monkeypatch.chdir(factories)  # a factory is imported from the current folder
        monkeypatch.setattr(sys, "path", list(sys.path))  # which the import puts first
        try:
            returncode = exit_code([*argv, "--results_dir", str(results)])
        finally:
            for name in ("factories", "broken_import"):
                sys.modules.pop(name, None)
        stdout, stderr = capfd.readouterr()
        assert started == []
    assert returncode == 2, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if "server[" not in line]
    assert len(lines) == 1, lines
    assert lines[0].startswith("server.py: error: ")
    assert re.sub(r"\{(\w+)\}", lambda m: paths[m.group(1)], fragment) in lines[0]
    assert not results.exists()  # nothing written: no results folder, no CSV, no AOTInductor cache
    assert stdout == ""
