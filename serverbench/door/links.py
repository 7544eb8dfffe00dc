"""The door's way into the backend from its own process (--door process): RingLink writes each request into the shm
ring (the ring our own frontend writes over shm), and the event loop watches its free-slot pipe (add_reader), so it
never blocks on it; the answers come back through serverbench/transport/responses.py's LoopReader. No torch here:
the door's process never imports it. The inline door's links are in serverbench/door/inline.py."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import numpy as np

from serverbench.transport.channels import ShmRequestChannel, StopRequested


class RingLink:
    """--door process: the door writes the ring as our frontend would, and learns from the free-slot pipe's
    descriptor when slots come back."""

    def __init__(self, ring: ShmRequestChannel, loop: asyncio.AbstractEventLoop) -> None:
        self.ring = ring
        self.room = asyncio.Event()
        self._loop = loop
        loop.add_reader(ring.free_fileno(), self._slots_back)

    def _slots_back(self) -> None:
        if self.ring.take_free_slots():
            self.room.set()

    def submit(self, request_id: int, arrays: Sequence[np.ndarray], sent_ns: int) -> bool:
        return self.ring.try_send_arrays(request_id, arrays, sent_ns)

    def finish(self, instances: int) -> None:
        """An end marker per backend instance: the designs return once they have answered what came before."""
        self._loop.remove_reader(self.ring.free_fileno())
        self.room.set()  # requests waiting for a slot wake now and are answered 503, not at their timeout
        try:
            for _ in range(instances):
                self.ring.send_end(lambda: True)  # a header's room is always there: never waits past one poll
        except StopRequested:
            pass  # the header pipe is full of requests the backend is not taking: the server's stop ends it
