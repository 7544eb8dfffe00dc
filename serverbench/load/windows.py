"""Stability windows: a measured phase that goes on until its numbers hold still (perf_analyzer's measurement
interval and stability percentage).

With `--stability_pct P` the measured phase is cut into windows of answered requests. A window closes at the
first response that makes it at least `--window_s` long and at least `--window_requests` responses big (p99 of
a handful of requests is only their maximum). After each window: when the last `STABLE_WINDOWS` windows'
throughputs and p99 latencies are each within P % of their own mean, the phase is stable and sending stops;
after `--max_windows` windows it stops anyway, flagged `stable=False`. The row then reports the last
`STABLE_WINDOWS` windows together. A window in which the machine was noisy (the host stole CPU time, other processes
took the cores, or the benchmark stalled longer than the window's p99: serverbench.load.noise) does not count: the
windows judged must be clean, and a phase that never had STABLE_WINDOWS clean windows in a row ends unstable with
the reason.

Pure logic on (received time, latency, samples) triples: the frontend feeds it, the tests feed it by hand.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from serverbench.config.limits import STABLE_WINDOWS
from serverbench.schema.records import Window
from serverbench.schema.stats import cv_pct


@dataclass(frozen=True)
class WindowRule:
    stability_pct: float  # the last windows' throughputs and p99s each within this % of their mean
    window_s: float  # a window lasts at least this long
    window_requests: int  # and holds at least this many responses
    max_windows: int  # then the phase ends unstable


def spread_pct(values: Sequence[float]) -> float:
    """The largest distance from the mean, in % of the mean: the stability test (perf_analyzer's)."""
    mean = float(np.mean(values))
    if mean <= 0:
        return float("inf")
    return float(np.max(np.abs(np.asarray(values, dtype=np.float64) - mean))) / mean * 100


def is_stable(windows: Sequence[Window], stability_pct: float) -> bool:
    """The last STABLE_WINDOWS windows are clean, and their throughputs and p99 latencies are each within
    stability_pct % of their mean."""
    if len(windows) < STABLE_WINDOWS:
        return False
    last = windows[-STABLE_WINDOWS:]
    if any(window.noise for window in last):
        return False
    return (
        spread_pct([w.throughput for w in last]) <= stability_pct
        and spread_pct([w.p99_latency_s for w in last]) <= stability_pct
    )


@dataclass
class WindowTracker:
    """Cuts the measured phase's responses into windows and says when to stop. Responses are fed in the order
    they arrive; `stop` is None while the phase goes on, then "stable" or "max_windows"."""

    rule: WindowRule
    start_ns: int  # when the measured phase began sending
    # Called as each window closes with its p99 latency: why the machine made its numbers, or "" (no noise).
    noise_of: Callable[[float], str] = lambda p99_latency_s: ""
    windows: list[Window] = field(default_factory=list)
    stop: str | None = None
    _latencies_s: list[float] = field(default_factory=list)
    _samples: int = 0

    def add(self, received_ns: int, latency_s: float, samples: int) -> Window | None:
        """One measured response; returns the window it closed, if it closed one. Responses after the stop
        verdict (those still in flight) belong to no window."""
        if self.stop is not None:
            return None
        self._latencies_s.append(latency_s)
        self._samples += samples
        window_start_ns = self.windows[-1].end_ns if self.windows else self.start_ns
        if (received_ns - window_start_ns) / 1e9 < self.rule.window_s or len(
            self._latencies_s
        ) < self.rule.window_requests:
            return None
        p99_latency_s = float(np.percentile(self._latencies_s, 99))
        window = Window(
            window_start_ns,
            received_ns,
            len(self._latencies_s),
            self._samples,
            p99_latency_s,
            self.noise_of(p99_latency_s),
        )
        self.windows.append(window)
        self._latencies_s, self._samples = [], 0
        if is_stable(self.windows, self.rule.stability_pct):
            self.stop = "stable"
        elif len(self.windows) >= self.rule.max_windows:
            self.stop = "max_windows"
        return window

    @property
    def stable(self) -> bool:
        return self.stop == "stable"


def reported_span_ns(windows: Sequence[Window]) -> tuple[int, int] | None:
    """(start, end] of the windows the row reports: the last STABLE_WINDOWS, or all there are."""
    if not windows:
        return None
    last = windows[-STABLE_WINDOWS:]
    return last[0].start_ns, last[-1].end_ns


def stability_note(windows: Sequence[Window], stable: bool | None, stability_pct: float | None) -> str:
    """Why a windowed phase ended unstable: the machine, when its noise left no STABLE_WINDOWS clean windows in a
    row to judge; else the server, whose clean windows never agreed. "" when stable or without windows."""
    if stable is not False:
        return ""
    noisy = [w for w in windows if w.noise]
    clean_run = longest = 0
    for window in windows:
        clean_run = 0 if window.noise else clean_run + 1
        longest = max(longest, clean_run)
    if noisy and longest < STABLE_WINDOWS:
        reasons = sorted({w.noise for w in noisy})
        return (
            f"the machine: {len(noisy)} of {len(windows)} windows noisy, never {STABLE_WINDOWS} clean ones in a row "
            "(" + "; ".join(reasons[:3]) + ")"
        )
    within = f" within {stability_pct:g} %" if stability_pct is not None else ""
    skipped = f" ({len(noisy)} noisy windows not counted)" if noisy else ""
    return f"the last {STABLE_WINDOWS} windows never agreed{within}{skipped}"


def window_columns(
    windows: Sequence[Window], stable: bool | None, stability_pct: float | None = None
) -> dict[str, object]:
    """The row's window columns; every window's throughput is kept so the start of the phase stays visible."""
    if stable is None:
        return {
            "windows": None,
            "stable": None,
            "window_throughput_cv_pct": None,
            "window_throughputs": "",
            "noisy_windows": None,
            "stability_note": "",
        }
    last = windows[-STABLE_WINDOWS:]
    return {
        "windows": len(windows),
        "stable": stable,
        "window_throughput_cv_pct": cv_pct([w.throughput for w in last]),
        "window_throughputs": ";".join(f"{w.throughput:.6g}" for w in windows),
        "noisy_windows": sum(1 for w in windows if w.noise),
        "stability_note": stability_note(windows, stable, stability_pct),
    }
