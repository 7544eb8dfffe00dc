"""The request transports in-process: the shm ring never hands the backend a slot that is being overwritten, every
request is written afresh, and the queue transport carries the same bytes; the backend's buffer pool stops
allocating once it holds max_inflight sets."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import make_config

from serverbench.transport.channels import RequestChannel, ShmRequestChannel, make_request_channel


def _cfg(tmp_path: Path, *argv: str):
    base = ["--device", "cpu", "--image_size", "8", "--batch_size", "2", "--results_dir", str(tmp_path)]
    return make_config([*base, *argv])


def _image_shape(cfg) -> tuple[int, ...]:
    return (cfg.batch_size, *cfg.model_inputs[0].shape)


def _batches(cfg, count: int) -> list[tuple[np.ndarray, ...]]:
    # Request i is all i: easy to tell apart. numpy, as the frontend's pool.
    return [(np.full(_image_shape(cfg), float(i), dtype=np.float32),) for i in range(count)]


def _send_all(channel, batches: list[tuple[np.ndarray, ...]], stop: threading.Event) -> threading.Thread:
    def send() -> None:
        for i, batch in enumerate(batches):
            channel.send(i, batch, time.perf_counter_ns(), stop.is_set)
        channel.send_end(stop.is_set)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


def _consume(channel, delay_s: float, release_first: bool) -> tuple[list[int], list[int], int]:
    """Receives every request, reading its bytes only after delay_s (a slow H2D step); returns the ids received,
    the ids whose bytes were no longer theirs when read, and the most slots held at once."""
    received, corrupted = [], []
    while (request := channel.receive(timeout_s=10)) is not None:
        if release_first:  # the bug the ring must not have: the slot goes back before its bytes were read
            channel.release(request.slot)
        time.sleep(delay_s)
        if not torch.all(request.inputs[0] == float(request.request_id)):
            corrupted.append(request.request_id)
        received.append(request.request_id)
        if not release_first:
            channel.release(request.slot)
    return received, corrupted, len(received)


def _through_a_two_slot_ring(tmp_path: Path, release_first: bool) -> tuple[ShmRequestChannel, list, list]:
    cfg = _cfg(tmp_path, "--ring_slots", "2")
    channel = ShmRequestChannel(mp.get_context("spawn"), cfg)
    stop = threading.Event()
    sender = _send_all(channel, _batches(cfg, 12), stop)
    received, corrupted, _ = _consume(channel, delay_s=0.02, release_first=release_first)
    sender.join(timeout=10)
    stop.set()
    return channel, received, corrupted


def test_a_slow_consumer_never_reads_a_slot_that_is_being_overwritten(tmp_path: Path) -> None:
    channel, received, corrupted = _through_a_two_slot_ring(tmp_path, release_first=False)
    assert received == list(range(12)) and corrupted == []
    assert channel.slot_count == 2  # 12 requests went through 2 slots: each was written afresh


def test_the_slow_consumer_check_catches_a_slot_released_too_early(tmp_path: Path) -> None:
    """The same check as above fails when the slot goes back before its bytes are read: it can see the bug."""
    _, received, corrupted = _through_a_two_slot_ring(tmp_path, release_first=True)
    assert received == list(range(12)) and corrupted


def test_the_sender_waits_for_a_free_slot_and_gives_up_when_stopped(tmp_path: Path) -> None:
    from serverbench.transport.channels import StopRequested

    cfg = _cfg(tmp_path, "--ring_slots", "1")
    channel = ShmRequestChannel(mp.get_context("spawn"), cfg)
    batch = _batches(cfg, 1)[0]
    channel.send(0, batch, 0, lambda: False)  # takes the only slot
    start = time.monotonic()
    with pytest.raises(StopRequested):
        channel.send(1, batch, 0, lambda: time.monotonic() - start > 0.3)  # no slot comes back
    assert 0.25 < time.monotonic() - start < 3


def test_the_queue_transport_carries_the_same_requests(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "--transport", "queue", "--wire_dtype", "uint8")
    channel = make_request_channel(mp.get_context("spawn"), cfg)
    assert isinstance(channel, RequestChannel)
    pixels = np.random.default_rng(0).integers(0, 256, _image_shape(cfg), dtype=np.uint8)
    (carried,) = channel.carried([(pixels,)])  # the reference's tensor
    channel.send(3, carried, 7, lambda: False)
    request = channel.receive(timeout_s=10)
    assert (request.request_id, request.sent_ns, request.slot) == (3, 7, None)
    assert request.inputs[0].dtype == torch.uint8 and torch.equal(request.inputs[0], torch.from_numpy(pixels))


def test_uint8_decoding_normalises_like_torchvision(tmp_path: Path) -> None:
    from serverbench.backend.buffers import IMAGENET_MEAN, IMAGENET_STD, BufferSet, Decoder

    cfg = _cfg(tmp_path, "--wire_dtype", "uint8", "--channels_last", "--precision", "bf16")
    buffers = BufferSet(cfg, torch.device("cpu"), pin_host=False)
    pixels = torch.randint(0, 256, _image_shape(cfg), dtype=torch.uint8)
    (decoded,) = Decoder(cfg, torch.device("cpu"))(buffers, [pixels])  # on the CPU it reads the request in place
    mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    expected = (pixels.float() / 255 - mean) / std
    assert decoded.dtype == torch.bfloat16 and decoded.is_contiguous(memory_format=torch.channels_last)
    assert torch.allclose(decoded.float(), expected, atol=2e-2)  # bf16 keeps ~3 significant digits
    assert decoded.data_ptr() == buffers.model_inputs[0].data_ptr()  # written into the set's own buffer
    pixels.zero_()  # the request's memory is free again once decoded: the input does not depend on it
    assert torch.allclose(decoded.float(), expected, atol=2e-2)


def test_the_buffer_pool_stops_allocating_at_max_inflight(tmp_path: Path) -> None:
    from serverbench.backend.buffers import BufferPool

    made = []
    pool = BufferPool(2, lambda: made.append(object()) or made[-1], timeout_s=0.2)
    first, second = pool.take(), pool.take()
    with pytest.raises(TimeoutError, match="no free buffer set"):
        pool.take()  # both held: waits, then fails clearly instead of allocating a third
    pool.give_back(first)
    assert pool.take() is first and pool.made == 2 and len(made) == 2
    pool.give_back(second)


@pytest.mark.cuda
def test_the_ring_is_page_locked_once_on_cuda(tmp_path: Path) -> None:
    from serverbench.device.layer import make_device_layer

    cfg = replace(_cfg(tmp_path), device="cuda:0")
    channel = ShmRequestChannel(mp.get_context("spawn"), cfg)
    assert not channel.ring.is_pinned()
    channel.page_lock(make_device_layer("cuda:0"))
    assert channel.ring.is_pinned() and channel.ring[-64:].is_pinned()  # the last slot's bytes too
    channel.page_unlock()
    assert not channel.ring.is_pinned()


def _drain_pipe(channel, count: int, out) -> None:
    for _ in range(count):
        out.put(channel.get(5.0))


def test_the_pipe_channel_is_bounded_times_out_and_serves_several_processes() -> None:
    import queue
    import struct

    from serverbench.transport.channels import SlotHeader
    from serverbench.transport.pipes import PipeChannel

    ctx = mp.get_context("spawn")
    channel = PipeChannel(ctx, capacity=3, fields=3)
    with pytest.raises(queue.Empty):
        channel.get(0.05)  # nothing there: a timeout, not a hang
    for i in range(3):
        channel.put(SlotHeader(i, i, 2**62 + i), timeout=0.1)
    assert channel.depth() == 3
    with pytest.raises(queue.Full):
        channel.put(SlotHeader(9, 9, 9), timeout=0.05)  # capacity reached: the writer waits, then gives up
    assert [channel.get(0.1) for _ in range(3)] == [(i, i, 2**62 + i) for i in range(3)]
    assert channel.depth() == 0
    with pytest.raises(struct.error):
        channel.put((1, 2), timeout=0.1)  # not a record of this channel: refused before anything is written
    with pytest.raises(struct.error):
        channel.put((2**64, 0, 0), timeout=0.1)
    assert channel.depth() == 0

    # Two reader processes share one channel; every message reaches exactly one of them.
    results = ctx.Queue()
    readers = [ctx.Process(target=_drain_pipe, args=(channel, 50, results)) for _ in range(2)]
    for reader in readers:
        reader.start()
    for i in range(100):  # the first puts past capacity wait for the spawned readers to start (torch's import)
        channel.put((i, 0, -i), timeout=60.0)
    got = sorted(results.get(timeout=60) for _ in range(100))
    for reader in readers:
        reader.join(timeout=10)
    assert got == [(i, 0, -i) for i in range(100)]


def test_a_ring_of_many_slots_gets_a_pipe_that_holds_every_header(tmp_path: Path) -> None:
    channel = make_request_channel(mp.get_context("spawn"), _cfg(tmp_path, "--ring_slots", "4000"))
    for slot in range(4000):  # every slot written before the backend reads one: no write may block
        channel.send(slot, torch.zeros(2, 3, 8, 8), 0, lambda: False)
    assert channel.depth() == 4000


def test_a_response_to_a_frontend_that_is_gone_fails_at_once_and_a_closed_channel_says_so() -> None:
    import queue

    from serverbench.transport.responses import ResponseChannel

    backend_side = ResponseChannel(mp.get_context("spawn"), lock_timeout_s=1.0)
    backend_side.keep_writing_end()  # this process writes; the reading end, in no other process: the frontend is gone
    started = time.monotonic()
    big = torch.zeros(1 << 20).numpy()  # more than a pipe holds: a write to a live reader would wait
    with pytest.raises(BrokenPipeError):
        backend_side.send(big)
    assert time.monotonic() - started < 1.0

    frontend_side = ResponseChannel(mp.get_context("spawn"))
    with pytest.raises(queue.Empty):
        frontend_side.receive(0.05)
    frontend_side.send("ready")
    assert frontend_side.receive(1.0) == "ready"
    frontend_side.keep_reading_end()  # no backend left to write
    with pytest.raises(ConnectionError, match="every backend process has gone"):
        frontend_side.receive(1.0)


def test_an_instance_frozen_mid_answer_holds_up_no_other_instances_answers() -> None:
    """Two backend instances answer on one channel; the second is frozen (SIGSTOP) half-way through an answer larger
    than a pipe holds. The first's answers still arrive at once, and once the second goes on, its answer arrives
    whole. (With one pipe shared under a lock across processes, the frozen holder kept the lock: the first's
    answers stopped, and a kill would have stopped them for good.)"""
    import os
    import select
    import signal

    from serverbench.transport.responses import ResponseChannel

    channel = ResponseChannel(mp.get_context("spawn"), lock_timeout_s=2.0, writers=2)
    big = np.arange(1 << 20, dtype=np.int64)  # 8 MiB: its write waits for the reader once the pipe is full

    def second_instance() -> None:
        channel.keep_writing_end(1)
        channel.send(big)
        os._exit(0)

    child = mp.get_context("fork").Process(target=second_instance)
    child.start()
    try:
        poller = select.poll()
        poller.register(channel.reading_filenos()[1], select.POLLIN)
        assert poller.poll(30_000), "the second instance wrote nothing within 30 s"
        os.kill(child.pid, signal.SIGSTOP)  # in the middle of its answer: the pipe holds only a part of it
        channel.send("the first instance's answer")  # this process writes the first instance's pipe
        started = time.monotonic()
        assert channel.receive(1.0) == "the first instance's answer"
        assert time.monotonic() - started < 1.0
        os.kill(child.pid, signal.SIGCONT)
        assert np.array_equal(channel.receive(10.0), big)
        child.join(timeout=10)
        assert child.exitcode == 0
    finally:
        if child.is_alive():
            os.kill(child.pid, signal.SIGKILL)
            os.kill(child.pid, signal.SIGCONT)
            child.join(timeout=10)


def test_an_answer_cut_short_closes_its_pipe_instead_of_leaving_it_out_of_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """A signal's handler that raises in the middle of a write leaves part of a message in the pipe: the writer
    closes its end, so the reader drops the part at the pipe's end, never reads the rest as a length."""
    import os

    from serverbench.transport import pipes
    from serverbench.transport.responses import ResponseChannel

    channel = ResponseChannel(mp.get_context("spawn"), lock_timeout_s=1.0)
    channel.send("whole")
    real_writev = os.writev
    calls = []

    def cut_short(fd: int, buffers: list) -> int:
        calls.append(fd)
        if len(calls) == 1:
            return real_writev(fd, [buffers[0], bytes(buffers[1][:10])])  # the header and 10 bytes of the body
        raise KeyboardInterrupt  # what a handler raises while the write waits for its rest

    monkeypatch.setattr(pipes.os, "writev", cut_short)
    with pytest.raises(KeyboardInterrupt):
        channel.send(np.zeros(1000))
    monkeypatch.setattr(pipes.os, "writev", real_writev)
    assert channel.receive(1.0) == "whole"
    with pytest.raises(ConnectionError, match="every backend process has gone"):
        channel.receive(1.0)  # the part dropped with its pipe: this process held the only writing end


def test_an_answer_to_a_reader_that_stopped_reading_gives_up_after_its_timeout() -> None:
    """The reader is alive but reads nothing: a write larger than the pipe holds waits for room up to the channel's
    timeout, then fails, and the part it wrote goes with the pipe (its writing end closed)."""
    from serverbench.transport.responses import ResponseChannel

    channel = ResponseChannel(mp.get_context("spawn"), lock_timeout_s=0.5)
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="the reader took no answer for 0.5 s"):
        channel.send(np.zeros(1 << 20))  # 8 MiB
    assert 0.5 <= time.monotonic() - started < 3.0
    with pytest.raises(ConnectionError):
        channel.receive(1.0)  # the part dropped at the pipe's end: this process held its only writing end


def test_slots_go_back_in_groups_and_all_of_them_before_the_backend_waits(tmp_path: Path) -> None:
    """A free slot number wakes the frontend's waiting sender: the backend writes them back a quarter of the ring at
    a time, but never keeps one while it waits for a request, nor past the end of the requests."""
    cfg = _cfg(tmp_path, "--ring_slots", "8")  # groups of 2
    channel = ShmRequestChannel(mp.get_context("spawn"), cfg)
    batches = _batches(cfg, 3)
    for i, batch in enumerate(batches):
        channel.send(i, batch, 0, lambda: False)
    free_after_each = []
    for _ in batches:
        channel.release(channel.receive(timeout_s=1.0).slot)
        free_after_each.append(channel._free.depth())
    assert free_after_each == [0, 2, 2]  # the third waits for its group, while nothing makes the backend wait
    import queue

    with pytest.raises(queue.Empty):
        channel.receive(timeout_s=0.05)  # nothing more: the held slot goes back before the wait
    assert channel._free.depth() == 3

    channel.send(3, batches[0], 0, lambda: False)
    channel.send_end(lambda: False)
    channel.release(channel.receive(timeout_s=1.0).slot)
    assert channel._free.depth() == 3  # held, with the end marker already read ahead
    assert channel.receive(timeout_s=1.0) is None
    assert channel._free.depth() == 4  # the end of the requests hands back what was held


def test_one_backend_reads_every_waiting_header_at_once_and_instances_take_one_each(tmp_path: Path) -> None:
    for instances, left_for_the_others in ((1, 0), (2, 4)):
        cfg = _cfg(tmp_path, "--ring_slots", "8", "--instances", str(instances))
        channel = ShmRequestChannel(mp.get_context("spawn"), cfg)
        for i, batch in enumerate(_batches(cfg, 5)):
            channel.send(i, batch, 0, lambda: False)
        assert channel.receive(timeout_s=1.0).request_id == 0
        assert channel._headers.depth() == left_for_the_others  # still in the pipe, for any instance to take
        assert channel.depth() == 4  # either way, four requests wait: the queue depth the rows report
        assert [channel.receive(timeout_s=1.0).request_id for _ in range(4)] == [1, 2, 3, 4]


def test_the_pipe_channel_writes_and_reads_many_records_at_once_and_whole() -> None:
    import queue
    import select

    from serverbench.transport.pipes import PipeChannel

    channel = PipeChannel(mp.get_context("spawn"), capacity=1000, fields=1)
    records = [(i,) for i in range(1000)]
    assert 1000 * 8 > select.PIPE_BUF  # more than one atomic write
    channel.put_many(records, timeout=1.0)
    assert channel.depth() == 1000
    got = channel.get_many(1.0, most=600)
    assert got == records[:600] and channel.depth() == 400
    assert channel.get_many(1.0, most=1000) == records[600:] and channel.depth() == 0
    with pytest.raises(queue.Empty):
        channel.get_many(0.05, most=10)

    small = PipeChannel(mp.get_context("spawn"), capacity=3, fields=1)
    with pytest.raises(queue.Full):
        small.put_many([(i,) for i in range(5)], timeout=0.05)
    assert small.depth() == 0  # nothing written, and no room kept: all three records still fit
    small.put_many([(7,), (8,), (9,)], timeout=0.05)
    assert small.get_many(1.0, most=3) == [(7,), (8,), (9,)]


def test_a_reader_waiting_on_an_empty_pipe_gets_the_record_written_meanwhile() -> None:
    from serverbench.transport.pipes import PipeChannel

    channel = PipeChannel(mp.get_context("spawn"), capacity=2, fields=2)
    writer = threading.Timer(0.1, lambda: channel.put((5, -5), timeout=1.0))
    writer.start()
    started = time.monotonic()
    assert channel.get(5.0) == (5, -5)
    assert time.monotonic() - started < 2.0
    writer.join(timeout=5)


def test_responses_from_several_writers_arrive_whole_small_and_large() -> None:
    """From several threads of one instance at once, small responses and large ones (written in pieces as the
    reader empties the pipe) all arrive intact: none lands between another's pieces."""
    import numpy as np

    from serverbench.transport.responses import ResponseChannel

    channel = ResponseChannel(mp.get_context("spawn"), lock_timeout_s=10.0)
    per_writer = 150

    def write(writer: int, elements: int) -> None:
        for i in range(per_writer):
            channel.send(np.full(elements, writer * 1000 + i, dtype=np.int64))

    sizes = (1, 1, 1, 4096)  # 8 bytes, and 32 KiB: more than PIPE_BUF
    writers = [threading.Thread(target=write, args=(w, n)) for w, n in enumerate(sizes)]
    for thread in writers:
        thread.start()
    seen: dict[int, list[int]] = {w: [] for w in range(len(sizes))}
    for _ in range(per_writer * len(sizes)):
        message = channel.receive(10.0)
        value = int(message[0])
        assert (message == value).all() and message.size == sizes[value // 1000]
        seen[value // 1000].append(value % 1000)
    for thread in writers:
        thread.join(timeout=10)
    assert all(values == list(range(per_writer)) for values in seen.values())


def test_a_full_ring_of_free_slots_fits_its_pipe_however_the_writes_fell() -> None:
    """A pipe holds whole pages, and a full-page write never shares one: small and full-page writes in turn leave
    pages half empty. Every record the channel admits must still fit, or a release would block the backend."""
    from serverbench.transport.pipes import PipeChannel

    capacity = 8192
    channel = PipeChannel(mp.get_context("spawn"), capacity=capacity, fields=1)
    written = []

    def write() -> None:
        pairs = capacity // 513  # a one-record write, then a full page's (512 records of 8 bytes)
        sizes = [1, 512] * pairs + [capacity - 513 * pairs]
        for size in sizes:
            records = [(len(written) + i,) for i in range(size)]
            channel.put_many(records, timeout=1.0)
            written.extend(records)

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    writer.join(timeout=20)
    assert not writer.is_alive(), f"a write blocked after {len(written)} of {capacity} records"
    assert len(written) == capacity and channel.depth() == capacity
    got = []
    while len(got) < capacity:
        got += channel.get_many(1.0, most=capacity)
    assert got == written


def test_a_slot_released_by_another_thread_while_the_reader_waits_goes_back_at_once(tmp_path: Path) -> None:
    """The threaded design: the H2D step releases on a pool thread while the reading thread waits for a header.
    Several instances each holding part of a group could otherwise keep the frontend from every slot."""
    import queue

    cfg = _cfg(tmp_path, "--ring_slots", "8")  # groups of 2
    channel = ShmRequestChannel(mp.get_context("spawn"), cfg)
    channel.send(0, _batches(cfg, 1)[0], 0, lambda: False)
    slot = channel.receive(timeout_s=1.0).slot
    releaser = threading.Timer(0.1, channel.release, args=(slot,))
    releaser.start()
    with pytest.raises(queue.Empty):
        channel.receive(timeout_s=2.0)  # the release, 0.1 s in, lands during this wait
    releaser.join(timeout=5)
    assert channel._free.depth() == 1  # written when released, not held for its group
