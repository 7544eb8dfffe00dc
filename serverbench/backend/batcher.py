"""Dynamic batching, as Triton's dynamic batcher (max_batch_size, max_queue_delay_microseconds) and TorchServe's
batch_size / max_batch_delay: requests taken off the transport are gathered into one formed batch of at most
`max_images` images, which goes as soon as it is full, or once `max_delay_s` has passed since its oldest request
arrived, with whatever has arrived by then. Arrived means sent to the server (as Triton counts the delay from a
request's entry into the scheduler's queue), not taken off the transport: a request that already waited behind a
forward for longer than the delay closes its batch at once with what is waiting, instead of idling the model for
another delay. A delay of 0 batches only what is already waiting: no request ever waits for another, and a
backlog is served in full batches.

With torch.compile the formed batch is padded up to the next of a few sizes compiled at warm-up (powers of two,
and the largest batch), so that no formed size compiles while serving; the padding is counted.

Pure logic on an injected clock and an injected `take`: the backend gives it the transport and perf_counter,
the tests a fake of each.
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

from serverbench.config.limits import POLL_S
from serverbench.config.options import BenchConfig

Member = TypeVar("Member")


@dataclass(frozen=True)
class BatchRule:
    request_images: int  # images in one request (--batch_size)
    max_images: int  # images in one formed batch at most (--max_batch_size)
    max_delay_s: float  # a formed batch waits at most this long after its first request arrived

    @property
    def max_requests(self) -> int:
        """Requests that fit a formed batch whole (a request is never split across batches)."""
        return max(1, self.max_images // self.request_images)


def batch_rule(cfg: BenchConfig) -> BatchRule | None:
    """The rule of --batch_size, --max_batch_size and --max_queue_delay_ms; None without dynamic batching."""
    if cfg.max_batch_size is None:
        return None
    return BatchRule(cfg.batch_size, cfg.max_batch_size, cfg.max_queue_delay_ms / 1e3)


def padded_sizes(request_images: int, max_images: int) -> list[int]:
    """The batch sizes compiled at warm-up: the powers of two from the request's size up, and the largest formed
    batch (the most whole requests that fit max_images)."""
    largest = (max_images // request_images) * request_images
    sizes = {largest}
    size = 1
    while size < largest:
        if size >= request_images:
            sizes.add(size)
        size *= 2
    return sorted(sizes)


def padded_size(images: int, sizes: list[int]) -> int:
    """The smallest compiled size that holds `images`."""
    for size in sizes:
        if size >= images:
            return size
    raise ValueError(f"a formed batch of {images} images is larger than every compiled size {sizes}")


class Batcher(Generic[Member]):
    """Iterates over formed batches (lists of members, oldest first) until the transport's end marker.

    `take(timeout_s)` returns the next member, None at the end marker, or raises queue.Empty after timeout_s;
    `check()` raises when the run is stopping (every wait is at most POLL_S between checks); `clock_s()` is a
    monotonic clock in seconds, and `arrived_s(member)` the time on it that the member was sent.
    `wait_for_room()` returns once a forward can take the next batch (a model instance is free, as Triton's
    scheduler waits for one): requests that arrive meanwhile wait in the transport and join that batch, instead
    of going in small batches that queue behind busy workers."""

    def __init__(
        self,
        rule: BatchRule,
        take: Callable[[float], Member | None],
        check: Callable[[], None],
        clock_s: Callable[[], float],
        arrived_s: Callable[[Member], float],
        wait_for_room: Callable[[], None] = lambda: None,
    ) -> None:
        self.rule = rule
        self._take = take
        self._check = check
        self._clock_s = clock_s
        self._arrived_s = arrived_s
        self._wait_for_room = wait_for_room
        self._ended = False

    def _first(self) -> Member | None:
        """The next member, waiting as long as it takes (in POLL_S steps that look at the stop condition)."""
        while True:
            self._check()
            try:
                return self._take(POLL_S)
            except queue.Empty:
                continue

    def __iter__(self) -> Iterator[list[Member]]:
        while not self._ended:
            self._wait_for_room()
            first = self._first()
            if first is None:
                return
            members = [first]
            # From the oldest request's arrival, never later than a delay from now (a sender's clock ahead).
            deadline_s = min(self._arrived_s(first), self._clock_s()) + self.rule.max_delay_s
            while len(members) < self.rule.max_requests:
                remaining_s = deadline_s - self._clock_s()
                try:
                    # Past the deadline, a zero timeout still takes what has already arrived.
                    member = self._take(min(max(remaining_s, 0.0), POLL_S))
                except queue.Empty:
                    if remaining_s <= 0:
                        break
                    self._check()
                    continue
                if member is None:  # the end marker: serve what was gathered, then stop
                    self._ended = True
                    break
                members.append(member)
            yield members
