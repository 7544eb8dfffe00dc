"""What the machine did to the run, and how punctual the load generator was: the figures that tell a slow server
from a busy host.

- Steal (`/proc/stat`): time the hypervisor gave this VM's CPUs to someone else, as a share of all CPU time.
- Run-queue wait (`/proc/<pid>/task/<tid>/schedstat`, its second field): time each thread of a process was ready
  to run and had no core, summed over the process's threads, as a share of the measured phase. Involuntary context
  switches (`nonvoluntary_ctxt_switches` in each thread's status): how often a thread was taken off a core.
- Other processes' CPU: the machine's busy CPU time (`/proc/stat`) less the benchmark's own (its processes' user and
  system time in `/proc/<pid>/stat`, which keeps the time of threads that have ended), as a share of all CPU time.
  It tells the two causes of run-queue wait apart: another process on the cores (noise), or the benchmark's own
  threads outnumbering them (a cost of the design here).
- The longest stall: the largest oversleep of a canary thread in the frontend that sleeps a few milliseconds at a
  time; whatever keeps a ready thread of the benchmark from running (a hog, steal, the frontend's own GIL) shows.
- Sender lateness: when a request's sending began minus when the load wanted it sent (its slot in the Poisson
  schedule; under a closed loop, the response that freed its place). A late sender's delay counts in the latency
  it reports.

Linux only: elsewhere the figures are empty and `noise_note` says why. Every reading is of text, so the parsing is
tested on hand-made /proc text.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from serverbench.schema.columns import NOISE_COLUMNS as NOISE_COLUMNS  # re-exported: launch/job.py reads it here
from serverbench.schema.records import NoiseStats, RequestRecord
from serverbench.system.sampler import PeriodicSampler

PROC = Path("/proc")
STALL_CANARY_PERIOD_S = 0.01  # 100 wake-ups a second: any stall over 10 ms shows in full, at 0.1 % of a core
# Above these the machine, not the server, may have made the numbers (docs/methodology.md, "Machine noise").
STEAL_WARN_PCT = 2.0
RUNQUEUE_WAIT_WARN_PCT = 2.0
# The run-queue wait is the machine's when other processes took this much of the CPU: an idle machine's daemons and
# a test runner waiting on the server come to a few %; a process competing for the cores, to tens of %.
OTHER_CPU_WARN_PCT = 5.0
# /proc/stat counts in ticks (10 ms): below this many CPU-ticks in the phase (1 s of one CPU) a share is off by
# more than a percent, so steal and other processes' CPU are reported but warn nothing.
MIN_SHARE_TICKS = 100
LATE_SENDER_WARN_FRACTION = 0.10  # p99 lateness against p50 latency
# A stall counts (in a row's warning, or to make a window noisy) when longer than the p99 latency and than this:
# on a quiet 2-core VM the frontend's own GIL hand-offs and scheduling stalled the canary by 2.5-14.5 ms.
STALL_FLOOR_MS = 20.0


@dataclass(frozen=True)
class CpuTimes:
    """The first line of /proc/stat, in clock ticks: all CPUs together."""

    steal: int
    idle: int  # idle and iowait
    total: int


def parse_cpu_times(stat_text: str) -> CpuTimes | None:
    """`cpu  user nice system idle iowait irq softirq steal guest guest_nice`; guest time is already inside user
    and nice, so the total is the first eight fields."""
    for line in stat_text.splitlines():
        fields = line.split()
        if fields and fields[0] == "cpu":
            try:
                ticks = [int(value) for value in fields[1:9]]
            except ValueError:
                return None
            if len(ticks) < 8:
                return None
            return CpuTimes(steal=ticks[7], idle=ticks[3] + ticks[4], total=sum(ticks))
    return None


def parse_process_ticks(stat_text: str) -> int | None:
    """/proc/<pid>/stat: utime + stime (fields 14 and 15), in clock ticks; the name in parentheses may hold spaces."""
    fields = stat_text.rpartition(")")[2].split()
    try:
        return int(fields[11]) + int(fields[12])
    except (IndexError, ValueError):
        return None


def parse_schedstat_ns(schedstat_text: str) -> tuple[int, int] | None:
    """`run_ns wait_ns timeslices`: the time the thread ran, and the time it waited on a run queue."""
    fields = schedstat_text.split()
    try:
        return int(fields[0]), int(fields[1])
    except (IndexError, ValueError):
        return None


def parse_involuntary_switches(status_text: str) -> int | None:
    for line in status_text.splitlines():
        if line.startswith("nonvoluntary_ctxt_switches:"):
            try:
                return int(line.split(":", 1)[1])
            except ValueError:
                return None
    return None


@dataclass(frozen=True)
class ThreadCounters:
    run_ns: int
    wait_ns: int
    involuntary: int


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="ascii", errors="replace")
    except OSError:  # the thread or process ended between the listing and the read, or no /proc here
        return None


def read_threads(pid: int, proc: Path = PROC) -> dict[int, ThreadCounters]:
    """Each live thread's counters; {} when the process is gone or there is no /proc."""
    threads: dict[int, ThreadCounters] = {}
    try:
        tids = [int(entry.name) for entry in (proc / str(pid) / "task").iterdir() if entry.name.isdigit()]
    except OSError:
        return threads
    for tid in tids:
        task = proc / str(pid) / "task" / str(tid)
        sched_text, status_text = _read(task / "schedstat"), _read(task / "status")
        times_ns = parse_schedstat_ns(sched_text) if sched_text is not None else None
        involuntary = parse_involuntary_switches(status_text) if status_text is not None else None
        if times_ns is not None and involuntary is not None:
            threads[tid] = ThreadCounters(*times_ns, involuntary)
    return threads


@dataclass(frozen=True)
class NoiseSnapshot:
    """The counters at one moment: the whole machine's CPU times and each role's processes' threads."""

    at_ns: int
    cpu: CpuTimes | None
    threads: Mapping[str, Mapping[tuple[int, int], ThreadCounters]]  # role -> (pid, tid) -> counters
    process_ticks: int | None = None  # user + system time of every process named, in ticks


def take_snapshot(pids_by_role: Mapping[str, Sequence[int]], proc: Path = PROC) -> NoiseSnapshot:
    cpu = _read_cpu_times(proc)  # first, as at every snapshot: the threads' counters follow within a millisecond
    threads = {
        role: {(pid, tid): counters for pid in pids for tid, counters in read_threads(pid, proc).items()}
        for role, pids in pids_by_role.items()
    }
    return NoiseSnapshot(time.perf_counter_ns(), cpu, threads, _own_ticks(pids_by_role, proc))


def _read_cpu_times(proc: Path) -> CpuTimes | None:
    stat_text = _read(proc / "stat")
    return parse_cpu_times(stat_text) if stat_text is not None else None


def _own_ticks(pids_by_role: Mapping[str, Sequence[int]], proc: Path) -> int | None:
    """User + system ticks of every process named; None when one of them cannot be read."""
    ticks = []
    for pid in (pid for pids in pids_by_role.values() for pid in pids):
        text = _read(proc / str(pid) / "stat")
        ticks.append(parse_process_ticks(text) if text is not None else None)
    return None if not ticks or None in ticks else sum(ticks)


def cpu_shares(
    start: CpuTimes | None, end: CpuTimes | None, own_start: int | None, own_end: int | None
) -> tuple[float | None, float | None, int]:
    """(steal %, other processes' CPU %, CPU ticks in between) from two readings of /proc/stat and of the
    benchmark's own ticks; None where a reading is missing. Ticks are coarse (10 ms): over a short span the other
    processes' share is noisy, and never below 0."""
    if start is None or end is None or end.total <= start.total:
        return None, None, 0
    total = end.total - start.total
    steal = end.steal - start.steal
    other_pct = None
    if own_start is not None and own_end is not None:
        busy = total - (end.idle - start.idle) - steal
        other_pct = max(0.0, 100.0 * (busy - (own_end - own_start)) / total)
    return 100.0 * steal / total, other_pct, total


def merged(later: NoiseSnapshot, seen: Mapping[str, Mapping[tuple[int, int], ThreadCounters]]) -> NoiseSnapshot:
    """`later` with the threads it no longer sees at their last sampled counters: a thread that ended before the
    phase did (the sender, once everything is sent) keeps what it waited until its last sample."""
    threads = {role: {**seen.get(role, {}), **current} for role, current in later.threads.items()}
    return NoiseSnapshot(later.at_ns, later.cpu, threads, later.process_ticks)


SHORT_PHASE = "too short to judge the machine's noise"  # how a row's noise_note begins when it was


def short_phase_note(ticks: int) -> str:
    """Why a phase of `ticks` CPU ticks (all CPUs') tells nothing of the other processes' share, and how long a
    phase on this machine would: its figures, efficiency included, are then unjudged, not clean."""
    per_s = os.sysconf("SC_CLK_TCK") * (os.cpu_count() or 1)
    return (
        f"{SHORT_PHASE}: a phase of {ticks} CPU ticks, under the {MIN_SHARE_TICKS} that steal and other processes' "
        f"shares need (about {MIN_SHARE_TICKS / per_s:.1g} s here); run longer (--duration_s) before trusting "
        "these figures"
    )


def noise_between(start: NoiseSnapshot, end: NoiseSnapshot, max_stall_ms: float | None) -> NoiseStats:
    """The counters' growth from start to end. A thread that began in between counts from zero; one that ended in
    between is not seen at the end, and its share is lost (the measured phase keeps its threads, so none do)."""
    span_ns = end.at_ns - start.at_ns
    notes = []
    steal_pct, other_pct, total = cpu_shares(start.cpu, end.cpu, start.process_ticks, end.process_ticks)
    if steal_pct is None:
        notes.append("no /proc/stat")
    elif total < MIN_SHARE_TICKS:
        notes.append(short_phase_note(total))
    wait_pct: dict[str, float] = {}
    switches: dict[str, int] = {}
    for role, threads in end.threads.items():
        if not threads:
            notes.append(f"no /proc/<pid>/task for the {role}")
            continue
        before = start.threads.get(role, {})
        zero = ThreadCounters(0, 0, 0)
        waited_ns = sum(counters.wait_ns - before.get(key, zero).wait_ns for key, counters in threads.items())
        switches[role] = sum(c.involuntary - before.get(key, zero).involuntary for key, c in threads.items())
        if span_ns > 0:
            wait_pct[role] = 100.0 * waited_ns / span_ns
    reliable = steal_pct is not None and total >= MIN_SHARE_TICKS
    return NoiseStats(steal_pct, other_pct, reliable, wait_pct, switches, max_stall_ms, "; ".join(notes))


class StallCanary:
    """A thread (a PeriodicSampler) that sleeps STALL_CANARY_PERIOD_S at a time (plain sleeps: a bare nanosleep
    costs a third of a Condition's timed wait) and keeps its largest oversleep: how long a ready thread of the
    frontend waited for a core (or for the GIL) at worst."""

    def __init__(self, period_s: float = STALL_CANARY_PERIOD_S) -> None:
        self.period_s = period_s
        self.max_oversleep_ns = 0
        self._window_max_ns = 0  # since the last window closed (read and reset by take_window_max_ns)
        self._window_lock = threading.Lock()  # the canary raises it, the receiver takes it: neither loses a stall
        self._slept_from_ns: int | None = None  # when the sleep now under way began
        self._periodic = PeriodicSampler("stall-canary", period_s, self._wake, plain_sleep=True)

    def start(self) -> StallCanary:
        self._periodic.start()
        return self

    def _wake(self) -> None:
        """One wake-up: by how much the sleep that just ended overran its period."""
        if self._slept_from_ns is not None:
            oversleep_ns = time.perf_counter_ns() - self._slept_from_ns - round(self.period_s * 1e9)
            self.max_oversleep_ns = max(self.max_oversleep_ns, oversleep_ns)
            with self._window_lock:
                self._window_max_ns = max(self._window_max_ns, oversleep_ns)
        self._slept_from_ns = time.perf_counter_ns()  # last: the bookkeeping above is not part of the next sleep

    def take_window_max_ns(self) -> int:
        """The longest oversleep since the last call, and a fresh start for the next window."""
        with self._window_lock:
            taken, self._window_max_ns = self._window_max_ns, 0
        return taken

    def stop(self) -> float | None:
        """The longest stall in ms (0.0 when the canary never completed a period); None when it never started."""
        self._periodic.stop()
        return self.max_oversleep_ns / 1e6 if self._periodic.started else None


def server_children(pid: int, proc: Path = PROC) -> list[int]:
    """The child processes of `pid` (/proc/<pid>/task/<tid>/children of each of its threads); [] where unknown."""
    children: list[int] = []
    try:
        tasks = list((proc / str(pid) / "task").iterdir())
    except OSError:
        return children
    for task in tasks:
        text = _read(task / "children")
        children += [int(field) for field in (text or "").split() if field.isdigit()]
    return children


SAMPLE_EVERY_S = 0.2  # threads' counters between the start and the end, for the threads that end before the phase


class NoiseMeter:
    """The measured phase's noise, from the frontend: a snapshot and the canary at its start, the threads' counters
    every SAMPLE_EVERY_S (on a PeriodicSampler of its own), a snapshot at its end. Backend processes are named by
    pid (their BackendReady carries it)."""

    def __init__(self, proc: Path = PROC) -> None:
        self.proc = proc
        self.linux = (proc / "stat").exists()
        self._start: NoiseSnapshot | None = None
        self._pids: dict[str, list[int]] = {}
        self._canary: StallCanary | None = None
        self._seen: dict[str, dict[tuple[int, int], ThreadCounters]] = {}
        self._seen_lock = threading.Lock()  # the sampler adds to it, stop() merges it
        self._periodic = PeriodicSampler("noise-sampler", SAMPLE_EVERY_S, self.sample)
        self._window_mark: tuple[CpuTimes | None, int | None] | None = None  # machine and own CPU at the last window

    def start(self, backend_pids: Sequence[int]) -> None:
        # The server (this process's parent) and its other children (multiprocessing's resource tracker) are the
        # benchmark's too: their CPU time is not another process's.
        server = os.getppid()
        others = [pid for pid in server_children(server, self.proc) if pid != os.getpid() and pid not in backend_pids]
        self._pids = {"frontend": [os.getpid()], "backend": list(backend_pids), "server": [server, *others]}
        self._canary = StallCanary().start()
        if self.linux:
            self._start = take_snapshot(self._pids, self.proc)
            self._periodic.start()

    def window_noise(self, p99_latency_s: float) -> str:
        """Why the machine made the window that just closed (since the last call, or since the phase began): steal
        or other processes' CPU above their thresholds, or a stall longer than the window's p99; "" when clean."""
        if self._canary is None:
            return ""
        stall_ms = self._canary.take_window_max_ns() / 1e6
        reasons = []
        if stall_counts(stall_ms, p99_latency_s):
            reasons.append(f"a {stall_ms:.1f} ms stall")
        if self.linux and self._start is not None:
            cpu, own = _read_cpu_times(self.proc), _own_ticks(self._pids, self.proc)
            before_cpu, before_own = self._window_mark or (self._start.cpu, self._start.process_ticks)
            self._window_mark = (cpu, own)
            steal_pct, other_pct, total = cpu_shares(before_cpu, cpu, before_own, own)
            if steal_pct is not None and total >= MIN_SHARE_TICKS:
                if steal_pct > STEAL_WARN_PCT:
                    reasons.append(f"steal {steal_pct:.1f} %")
                if other_pct is not None and other_pct > OTHER_CPU_WARN_PCT:
                    reasons.append(f"other processes {other_pct:.0f} % of the CPU")
        return ", ".join(reasons)

    def sample(self) -> None:
        """Keeps every thread's latest counters (the sampler's call, every SAMPLE_EVERY_S)."""
        if self._start is None:
            return
        snapshot = take_snapshot(self._pids, self.proc)
        with self._seen_lock:
            for role, threads in snapshot.threads.items():
                self._seen.setdefault(role, {}).update(threads)

    def stop(self) -> NoiseStats | None:
        """None when the measured phase never started."""
        if self._canary is None:
            return None
        max_stall_ms = self._canary.stop()
        self._periodic.stop()
        if self._start is None:
            return NoiseStats(max_stall_ms=max_stall_ms, note="no /proc on this system: steal and run-queue wait n/a")
        end_snapshot = take_snapshot(self._pids, self.proc)
        with self._seen_lock:
            end = merged(end_snapshot, self._seen)
        return noise_between(self._start, end, max_stall_ms)


def merged_noise(stats: Sequence[NoiseStats | None]) -> NoiseStats | None:
    """The machine's noise over several load generators' measured phases (--generators): the worst each figure was
    in any of them, so that a warning any generator would give still shows. Each generator counted the others as
    the benchmark's own processes (the server's children), not as other processes. None when none measured."""
    measured = [one for one in stats if one is not None]
    if len(measured) <= 1:
        return measured[0] if measured else None

    def worst(values: Sequence[float | None]) -> float | None:
        known = [value for value in values if value is not None]
        return max(known) if known else None

    def worst_by_role(maps: Sequence[Mapping[str, float]]) -> dict[str, float]:
        return {role: max(m[role] for m in maps if role in m) for role in {role for m in maps for role in m}}

    return NoiseStats(
        cpu_steal_pct=worst([one.cpu_steal_pct for one in measured]),
        other_cpu_pct=worst([one.other_cpu_pct for one in measured]),
        shares_reliable=all(one.shares_reliable for one in measured),
        runqueue_wait_pct=worst_by_role([one.runqueue_wait_pct for one in measured]),
        involuntary_switches=worst_by_role([one.involuntary_switches for one in measured]),
        max_stall_ms=worst([one.max_stall_ms for one in measured]),
        note="; ".join(dict.fromkeys(one.note for one in measured if one.note)),
    )


@dataclass(frozen=True)
class Lateness:
    p50_ms: float
    p99_ms: float
    max_ms: float


def sender_lateness(records: Sequence[RequestRecord]) -> Lateness | None:
    """When sending began minus when the load wanted the request sent, over the measured requests that had a due
    time (Poisson and closed loops; a burst has none). Early is 0: the sender never sends before its time."""
    late_ns = [
        max(0, r.send_start_ns - r.due_ns)
        for r in records
        if not r.warmup and r.due_ns is not None and r.send_start_ns is not None
    ]
    if not late_ns:
        return None
    p50, p99 = np.percentile(np.asarray(late_ns, dtype=np.float64), [50, 99]) / 1e6
    return Lateness(float(p50), float(p99), max(late_ns) / 1e6)


def stall_counts(stall_ms: float, p99_latency_s: float) -> bool:
    """A stall long enough to be a request at the tail by itself, and longer than a quiet machine's own."""
    return stall_ms > max(p99_latency_s * 1e3, STALL_FLOOR_MS)


def noise_warnings(
    noise: NoiseStats | None, lateness: Lateness | None, p50_latency_s: float | None, p99_latency_s: float | None
) -> list[str]:
    """What in the machine's figures is large enough to change the result; each a short clause."""
    warnings = []
    if noise is not None:
        shares = noise.shares_reliable
        if shares and noise.cpu_steal_pct is not None and noise.cpu_steal_pct > STEAL_WARN_PCT:
            warnings.append(f"the host took {noise.cpu_steal_pct:.1f} % of the CPUs (steal)")
        # Waiting for a core is the machine's doing when other processes or the host had the cores; with the cores
        # to themselves, the benchmark's threads wait only for each other: a cost of the design (see its note).
        crowded = shares and (
            (noise.other_cpu_pct or 0.0) > OTHER_CPU_WARN_PCT or (noise.cpu_steal_pct or 0.0) > STEAL_WARN_PCT
        )
        for role, pct in sorted(noise.runqueue_wait_pct.items()):
            if pct > RUNQUEUE_WAIT_WARN_PCT and crowded and role != "server":
                warnings.append(
                    f"the {role}'s threads waited {pct:.1f} % of the phase for a core while other processes "
                    f"used {noise.other_cpu_pct or 0.0:.1f} % of the CPU"
                )
        if (
            noise.max_stall_ms is not None
            and p99_latency_s is not None
            and stall_counts(noise.max_stall_ms, p99_latency_s)
        ):
            warnings.append(f"a {noise.max_stall_ms:.1f} ms stall, longer than the p99 latency")
    if lateness is not None and p50_latency_s is not None and p50_latency_s > 0:
        if lateness.p99_ms > LATE_SENDER_WARN_FRACTION * p50_latency_s * 1e3:
            warnings.append(f"the sender was late by {lateness.p99_ms:.2f} ms at p99, a visible part of the latency")
    return warnings


def _rounded(value: float | None, digits: int = 3) -> float | None:
    return None if value is None or math.isnan(value) else round(value, digits)


def noise_columns(
    noise: NoiseStats | None, lateness: Lateness | None, p50_latency_s: float | None, p99_latency_s: float | None
) -> dict[str, object]:
    """The row's noise columns (NOISE_COLUMNS); empty figures where nothing was measured."""
    stats = noise or NoiseStats(note="the measured phase did not start")
    return {
        "cpu_steal_pct": _rounded(stats.cpu_steal_pct),
        "other_cpu_pct": _rounded(stats.other_cpu_pct),
        "runqueue_wait_pct_backend": _rounded(stats.runqueue_wait_pct.get("backend")),
        "runqueue_wait_pct_frontend": _rounded(stats.runqueue_wait_pct.get("frontend")),
        "involuntary_switches_backend": stats.involuntary_switches.get("backend"),
        "involuntary_switches_frontend": stats.involuntary_switches.get("frontend"),
        "max_stall_ms": _rounded(stats.max_stall_ms),
        "sender_late_p50_ms": _rounded(lateness.p50_ms if lateness else None, 4),
        "sender_late_p99_ms": _rounded(lateness.p99_ms if lateness else None, 4),
        "sender_late_max_ms": _rounded(lateness.max_ms if lateness else None, 4),
        "noise_warning": "; ".join(noise_warnings(noise, lateness, p50_latency_s, p99_latency_s)),
        "noise_note": stats.note,
    }
