"""Model instances in processes (`--instances N`): N backend processes, each with its own model (on a GPU, its own
CUDA context on the same device), all reading one request transport and answering one frontend, each serving with
the chosen design inside.

    frontend --requests--+--> backend instance 0 --+--responses--> frontend
                         +--> backend instance 1 --+
                         +--> ...                --+

What is particular to several instances lives here:
- which process is which (`Instance`, `backend_roles`), and the barrier behind which the instances time their
  ceilings together, so that the sum of their ceilings is what N models running at once do;
- one backend report for the run from the instances' reports (`combine_backend_reports`): the first failure
  names its instance, the ceilings and CPU figures add up;
- whether MPS took the contexts, detected as CUDA itself does it (the row's instance columns are
  serverbench/records/instances.py).

With one instance (the default) nothing here changes what a run does: no barrier, the one report as it is.
"""

from __future__ import annotations

import os
import socket
import stat
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from serverbench.schema.messages import BackendReport, ChildReport, combined_status

if TYPE_CHECKING:  # for annotations only
    pass

BARRIER_POLL_S = 0.1  # how often an instance waiting at the barrier looks at the run's stop condition
HEARTBEAT_S = 0.1  # how often a backend's heartbeat thread writes its sign of life
DEFAULT_MPS_PIPE_DIRECTORY = "/tmp/nvidia-mps"  # where CUDA looks for the MPS control daemon without the variable
MPS_CONNECT_TIMEOUT_S = 1.0


def backend_roles(count: int) -> list[str]:
    """The backend processes' names, as statuses and errors give them: 'backend' alone (as before instances
    existed), else 'backend instance 0', 'backend instance 1', ..."""
    return ["backend"] if count == 1 else [f"backend instance {i}" for i in range(count)]


def role_kind(role: str) -> str:
    """'frontend', 'door' or 'backend': what a status such as backend_died names, whichever instance (or load
    generator, 'frontend 1') it was."""
    if role.startswith("frontend"):
        return "frontend"
    return role if role == "door" else "backend"


@dataclass(frozen=True)
class Instance:
    """Which backend process this is, and the barrier every instance passes before each timed ceiling loop."""

    index: int = 0
    count: int = 1
    barrier: Any = None  # a multiprocessing Barrier shared by the instances; None with one instance
    heartbeat: Any = None  # this process's channels.Heartbeat, read by the server; None: nobody watches

    @property
    def role(self) -> str:
        return backend_roles(self.count)[self.index]

    def keep_beating(self) -> None:
        """A daemon thread beats the heartbeat every HEARTBEAT_S until the process exits: a process frozen as a
        whole (SIGSTOP, a debugger) stops beating, and the server's deadline on it fires, where a frozen instance
        could otherwise keep the run waiting for its report forever."""
        heartbeat = self.heartbeat
        if heartbeat is None:
            return

        def beat() -> None:
            while True:
                heartbeat.beat()
                time.sleep(HEARTBEAT_S)

        heartbeat.beat()
        threading.Thread(target=beat, name="heartbeat", daemon=True).start()

    def wait_together(self, should_stop: Callable[[], bool], timeout_s: float) -> bool:
        """Waits until every instance got here: True then; False when the run is stopping (another instance failed
        or died: the server stops the run, this process sees it within BARRIER_POLL_S). TimeoutError when the others
        do not come within timeout_s. Without a barrier (one instance): True at once."""
        if self.barrier is None:
            return True
        done = threading.Event()

        def abort_when_stopping() -> None:
            # A barrier's wait cannot also watch a flag: break it for every instance once the run is stopping, so
            # that none waits for a process that is gone.
            while not done.wait(BARRIER_POLL_S):
                if should_stop():
                    self.barrier.abort()
                    return

        watcher = threading.Thread(target=abort_when_stopping, name="barrier-watch", daemon=True)
        watcher.start()
        try:
            self.barrier.wait(timeout_s)
            return True
        except threading.BrokenBarrierError:
            if should_stop():
                return False
            raise TimeoutError(
                f"{self.role}: the other instances did not reach the ceiling's start within {timeout_s:g} s"
            ) from None
        finally:
            done.set()
            watcher.join(timeout=2 * BARRIER_POLL_S)


def usable_cpus() -> list[int]:
    """The CPUs this process may run on (inherited from the server, so every child sees the same list)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux: no affinity to read or set
        return list(range(os.cpu_count() or 1))


def cpu_split(cpus: Sequence[int]) -> tuple[list[int], list[int]]:
    """(the frontend's CPUs, the backends' CPUs) of a run on the CPU device with --cpu_split. The frontend stands in
    for clients on other machines: it gets one core of its own and the model the rest, so that its sends and
    receives never preempt a forward's intra-op threads. Those threads meet at every parallel region, so a forward
    with one of them descheduled stalls, and which forwards it hits varies from run to run. With one CPU both share
    it. (Off by default: on this project's 2-core VM the measurements for and against disagreed;
    docs/methodology.md.)"""
    cpus = sorted(cpus)
    if len(cpus) < 2:
        return cpus, cpus
    return cpus[:1], cpus[1:]


def cpu_threads_per_instance(
    count: int, cpus: Sequence[int], forwards: int = 1, default_threads: int | None = None
) -> int:
    """Intra-op threads for each forward of each of `count` instances serving on `cpus`: the cores shared out among
    every forward that runs at once (`forwards` per instance: pipelined's prediction workers), so that the
    model's OpenMP threads never outnumber the cores: threads that spin waiting for each other on a shared core
    slow every forward down. `default_threads`: torch's own count, which is the physical cores (on SMT machines
    half the CPUs listed): never more than that. The frontend and the server's threads share the cores with the
    model (--cpu_split gives the frontend one of its own instead): measured on 2 cores, leaving them a core cost a
    forward-bound serial run 40 % of its throughput for no steadier numbers (docs/methodology.md)."""
    cores = len(cpus) if default_threads is None else min(len(cpus), default_threads)
    return max(1, cores // (count * max(1, forwards)))


THREAD_COUNT_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")  # torch's own count follows them


def intra_op_threads(
    requested: int | None,
    count: int,
    cpus: Sequence[int] | None,
    forwards: int,
    default_threads: int,
    env: Mapping[str, str],
) -> int | None:
    """The intra-op thread count each backend sets, or None to keep torch's own (`default_threads`). `requested`:
    --intra_op_threads (None: auto). Auto on a GPU, or where the user set OMP_NUM_THREADS or MKL_NUM_THREADS (as
    torchrun does, to 1, when it starts several processes), keeps torch's own; on the CPU device (`cpus`: the
    backends' CPUs) it is cpu_threads_per_instance's share."""
    if requested is not None:
        return requested
    if cpus is None or any(name in env for name in THREAD_COUNT_VARIABLES):
        return None
    return cpu_threads_per_instance(count, cpus, forwards, default_threads=default_threads)


def pin_to_cpus(cpus: Sequence[int]) -> None:
    """Runs this process on `cpus` only (Linux); elsewhere as it is."""
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cpus)


# ------------------------------------------------------------------------------------------ reports


def sum_ceiling_loops(phases: Sequence[Mapping[int, Sequence[float]] | None]) -> dict[int, list[float]] | None:
    """The instances' ceiling loops added up, loop by loop at each concurrency: loop k of every instance started
    behind the same barrier, so their sum is the samples/s of N models running at once. None when an instance has
    none (it failed, or --no-ceiling)."""
    if not phases or any(not phase for phase in phases):
        return None
    concurrencies = set.intersection(*(set(phase) for phase in phases))
    return {c: [sum(loops) for loops in zip(*(phase[c] for phase in phases))] for c in sorted(concurrencies)}


def combine_backend_reports(reports: Mapping[str, ChildReport], roles: Sequence[str]) -> dict[str, ChildReport]:
    """The frontend's report and one backend report for the run, from the instances' reports (keyed by role, in
    the order they arrived). One instance: its report as it is. Several: first_failure among the instances (the
    first that died, else the first that failed) gives the status, its error prefixed with its role and its
    traceback; the ceilings are summed loop by loop (sum_ceiling_loops), backend_cpu_cores summed (cores busy in
    all backends together), profile traces listed; `ceiling_before_ns_by_instance` keeps each instance's ceiling
    span for the warm-up latency of the request it served."""
    combined = {role: report for role, report in reports.items() if role not in roles}
    if len(roles) == 1:
        if roles[0] in reports:
            combined["backend"] = reports[roles[0]]
        return combined
    present = [(roles.index(role), role, report) for role, report in reports.items() if role in roles]
    if not present:
        return combined
    merged = BackendReport()
    missing = [role for role in roles if role not in reports]
    merged.status, merged.error, merged.traceback = combined_status([(r, report) for _, r, report in present], missing)
    in_order = [report for _, _, report in sorted(present, key=lambda entry: entry[0])]
    complete = not missing
    if complete:
        merged.ceiling_before = sum_ceiling_loops([report.ceiling_before for report in in_order])
        merged.ceiling_after = sum_ceiling_loops([report.ceiling_after for report in in_order])
    cores = [report.backend_cpu_cores for report in in_order]
    merged.backend_cpu_cores = sum(cores) if complete and None not in cores else None
    merged.backend_cpus, merged.intra_op_threads = in_order[0].backend_cpus, in_order[0].intra_op_threads  # alike
    for name in ("machine_speed_before", "machine_speed_after"):  # one machine: the instances' mean
        speeds = [getattr(report, name) for report in in_order if getattr(report, name) is not None]
        setattr(merged, name, sum(speeds) / len(speeds) if speeds else None)
    merged.profile_trace = ";".join(report.profile_trace for report in in_order if report.profile_trace)
    merged.ceiling_before_ns_by_instance = {
        index: report.ceiling_before_ns for index, _, report in present if report.ceiling_before_ns is not None
    }
    combined["backend"] = merged
    return combined


# ---------------------------------------------------------------------------------------------- MPS


def mps_pipe_directory(environ: Mapping[str, str] = os.environ) -> Path:
    return Path(environ.get("CUDA_MPS_PIPE_DIRECTORY") or DEFAULT_MPS_PIPE_DIRECTORY)


def mps_in_use(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether CUDA contexts made by this process's children go through an MPS server. At its initialisation the
    CUDA driver connects to the control daemon's socket `control` in CUDA_MPS_PIPE_DIRECTORY (default
    /tmp/nvidia-mps) and runs without MPS when that fails; this makes the same connection and closes it at once,
    sending nothing. A socket file left by a daemon that was killed refuses the connection: not in use."""
    control = mps_pipe_directory(environ) / "control"
    try:
        if not stat.S_ISSOCK(control.stat().st_mode):
            return False
    except OSError:
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as probe:
        probe.settimeout(MPS_CONNECT_TIMEOUT_S)
        try:
            probe.connect(str(control))
        except OSError:
            return False
    return True
