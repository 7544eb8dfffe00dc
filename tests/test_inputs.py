"""--input as documented (docs/your-model.md): specs parsed or refused with what is wrong, values drawn from each
input's whole inclusive range, and several inputs of different dtypes carried intact by both transports."""

from __future__ import annotations

import argparse
import multiprocessing as mp
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ROOT, make_config

from serverbench.config.inputs import InputSpec, parse_input
from serverbench.transport.channels import RequestChannel, ShmRequestChannel, make_request_channel
from serverbench.transport.pool import bfloat16_words, make_input, make_request_pool, new_generator, pool_spec
from serverbench.transport.tensors import as_tensor, as_tensors

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
    generator = new_generator(0)
    values = make_input(parse_input("ids:int64:50:3-5"), 20, "float32", generator)
    assert values.dtype == np.int64 and values.shape == (20, 50)
    assert set(np.unique(values).tolist()) == {3, 4, 5}
    top = make_input(parse_input("b:int8:50:120-127"), 20, "float32", generator)
    assert top.dtype == np.int8 and set(np.unique(top).tolist()) == set(range(120, 128))
    ones = make_input(parse_input("mask:int64:8:1-1"), 4, "float32", generator)
    assert bool((ones == 1).all())
    whole = make_input(parse_input("a:int64:64:-9223372036854775808-9223372036854775807"), 8, "float32", generator)
    assert whole.dtype == np.int64 and int(whole.min()) < -(2**61) and int(whole.max()) > 2**61  # int64's range
    odd = make_input(parse_input("odd:int64:50:9007199254740993-9007199254740995"), 20, "float32", generator)
    assert set(np.unique(odd).tolist()) == {2**53 + 1, 2**53 + 2, 2**53 + 3}
    floats = make_input(parse_input("x:float16:100:-0.5-0.5"), 10, "float32", generator)
    assert floats.dtype == np.float16 and -0.5 <= float(floats.min()) and float(floats.max()) <= 0.5
    assert float(floats.max() - floats.min()) > 0.5  # drawn over the range, not a constant
    flags = make_input(parse_input("m:bool:64"), 8, "float32", generator)
    assert flags.dtype == np.bool_ and set(np.unique(flags).tolist()) == {False, True}


def test_bfloat16_inputs_travel_as_the_words_torch_rounds_them_to() -> None:
    """numpy has no bfloat16: the pool carries its 16-bit words, rounded to nearest even as torch's cast rounds,
    and the backend views them as bfloat16."""
    values = make_input(parse_input("x:bfloat16:4096"), 4, "float32", new_generator(1))
    assert values.dtype == np.uint16 and values.shape == (4, 4096)
    drawn = new_generator(1).standard_normal((4, 4096), dtype=np.float32)
    tensor = as_tensor(values, "bfloat16")
    assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, torch.from_numpy(drawn).to(torch.bfloat16))
    ties = np.array([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 3.0e38], dtype=np.float32)  # halfway: to even
    assert torch.equal(as_tensor(bfloat16_words(ties), "bfloat16"), torch.from_numpy(ties).to(torch.bfloat16))


def test_the_frontend_never_imports_torch() -> None:
    """The load generator sends the numpy pool: torch's import (a second or two of every run's start) stays in the
    backend, and in the frontend of the queue transport alone, whose reference design sends tensors. Before
    network_frontend.py, the network frontend's module held the inline door's backend too, and imported torch."""
    roles = "client, network_frontend, server"  # our frontend over shm and queues, and over the network
    probe = f"import sys; sys.argv = ['x']; import {roles}; print(sorted(m for m in sys.modules if m == 'torch'))"
    run = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "[]", run.stdout + run.stderr


# ------------------------------------------------------------------------------------------------ transports


def _two_inputs_config(tmp_path: Path, **changes):
    """A config whose model takes an int64 input of 3, a float16 input of 5 and a bfloat16 input of 7 per sample
    (odd byte counts: each input starts on its own 64-byte boundary)."""
    cfg = make_config(["--device", "cpu", "--model", "identity", "--batch_size", "2", "--results_dir", str(tmp_path)])
    inputs = (
        InputSpec("ids", "int64", (3,), -(2**62), 2**62),
        InputSpec("scores", "float16", (5,)),
        InputSpec("weights", "bfloat16", (7,)),
    )
    return replace(cfg, inputs=inputs, **changes)


DTYPES_SENT = [torch.int64, torch.float16, torch.bfloat16]


def _requests(cfg, count: int) -> list[tuple[np.ndarray, ...]]:
    """The run's pool as the frontend makes it (numpy, bfloat16 as its words)."""
    return make_request_pool(replace(pool_spec(cfg), pool_size=count))


def _sent(cfg, arrays: tuple[np.ndarray, ...]) -> tuple[torch.Tensor, ...]:
    return as_tensors(arrays, tuple(spec.dtype for spec in cfg.model_inputs))


def test_the_shm_ring_carries_several_inputs_of_different_dtypes_intact(tmp_path: Path) -> None:
    cfg = _two_inputs_config(tmp_path, ring_slots=2)
    channel = ShmRequestChannel(mp.get_context("spawn"), cfg)
    requests = _requests(cfg, 6)
    received = []

    def send() -> None:
        for i, inputs in enumerate(channel.carried(requests)):
            channel.send(i, inputs, time.perf_counter_ns(), lambda: False)
        channel.send_end(lambda: False)

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    try:
        while (request := channel.receive(timeout_s=10)) is not None:
            assert [t.dtype for t in request.inputs] == DTYPES_SENT
            sent = _sent(cfg, requests[request.request_id])
            assert all(torch.equal(got, want) for got, want in zip(request.inputs, sent))
            received.append(request.request_id)
            channel.release(request.slot)
        sender.join(timeout=10)
    finally:
        channel.close()
    assert received == list(range(6))  # six requests through two slots, each whole
    assert cfg.request_bytes == 2 * (3 * 8 + 5 * 2 + 7 * 2)


def test_the_queue_transport_carries_several_inputs_of_different_dtypes_intact(tmp_path: Path) -> None:
    cfg = _two_inputs_config(tmp_path, transport="queue")
    channel = make_request_channel(mp.get_context("spawn"), cfg)
    assert isinstance(channel, RequestChannel)
    (arrays,) = _requests(cfg, 1)
    (inputs,) = channel.carried([arrays])  # the reference's tensors, made once
    channel.send(4, inputs, 9, lambda: False)
    request = channel.receive(timeout_s=10)
    assert (request.request_id, request.sent_ns) == (4, 9)
    assert [t.dtype for t in request.inputs] == DTYPES_SENT
    assert all(torch.equal(got, sent) for got, sent in zip(request.inputs, _sent(cfg, arrays)))


def test_the_run_header_names_the_wire_dtype_only_for_an_image_input(tmp_path: Path) -> None:
    """--wire_dtype applies to the built-in models' image: a run of other inputs does not claim 'float32'."""
    from serverbench.records.console import format_summary

    row = {"status": "ok", "responses_received": 1, "requests_sent": 1, "responses_missing": 0}
    row |= {"responses_duplicated": 0}
    tokens = format_summary(_two_inputs_config(tmp_path), row).splitlines()[0]
    assert "| shm inputs in their own dtypes default |" in tokens and "float32" not in tokens
    image = make_config(["--device", "cpu", "--wire_dtype", "uint8", "--results_dir", str(tmp_path)])
    assert "| shm uint8 default |" in format_summary(image, row).splitlines()[0]
