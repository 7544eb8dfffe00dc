"""The one periodic sampler every sampler of the benchmark runs on (the GPU's, the load's, the machine noise's and
its stall canary): a daemon thread that calls a sample function every period until it is stopped.

Stopping is prompt (the thread waits on its stop event between samples, unless it asked for plain sleeps) and
bounded (the join has a timeout). The first exception a sample raises ends the sampling and is kept in `error`,
and logged, rather than lost with the thread. Use it with start/stop or as a context manager."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from types import TracebackType

from serverbench.system.process import one_line

log = logging.getLogger("sampler")

STOP_TIMEOUT_S = 5.0  # a sample in progress (an NVML call, a /proc read) ends well within this


class PeriodicSampler:
    """Calls `sample()` at once, then every `period_s` until `stop()`, on a daemon thread named `name`.

    `plain_sleep`: sleep with time.sleep between samples instead of a timed wait on the stop event: a bare nanosleep
    costs a third of a Condition's timed wait and wakes more punctually, which a canary measuring its own oversleep
    needs; the stop is then seen within one period."""

    def __init__(
        self,
        name: str,
        period_s: float,
        sample: Callable[[], None],
        plain_sleep: bool = False,
        stop_timeout_s: float = STOP_TIMEOUT_S,
    ) -> None:
        self.name = name
        self.period_s = period_s
        self.error: BaseException | None = None  # the exception that ended the sampling, if one did
        self._sample = sample
        self._plain_sleep = plain_sleep
        self._stop_timeout_s = stop_timeout_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    @property
    def started(self) -> bool:
        return self._thread.ident is not None

    def start(self) -> PeriodicSampler:
        self._thread.start()
        return self

    def stop(self) -> bool:
        """Stops the sampling and waits at most the stop timeout for the thread; True once it has ended (or never
        started), False when a sample still runs past the timeout (the daemon thread ends with the process)."""
        self._stop.set()
        if self.started:
            self._thread.join(timeout=self._stop_timeout_s)
            if self._thread.is_alive():
                log.warning("%s still sampling %.0f s after its stop", self.name, self._stop_timeout_s)
                return False
        return True

    def __enter__(self) -> PeriodicSampler:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def _pause(self) -> bool:
        """Waits one period; True once the sampler is to stop."""
        if self._plain_sleep:
            time.sleep(self.period_s)
            return self._stop.is_set()
        return self._stop.wait(self.period_s)

    def _run(self) -> None:
        try:
            while True:  # a first sample at once, even when stopped meanwhile: a short phase still has one
                self._sample()
                if self._pause():
                    return
        except BaseException as exc:  # noqa: BLE001 - kept for the owner: a sampler's failure never fails the run
            self.error = exc
            log.warning("%s stopped: %s", self.name, one_line(exc))
