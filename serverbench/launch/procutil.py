"""The server's side of its children: a child's report and exit, stopping processes and sessions, what they leave in
shared memory, and the process-wide tuning a child asks for (malloc, timer slack)."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from multiprocessing.connection import wait as wait_for
from multiprocessing.process import BaseProcess
from pathlib import Path

from serverbench.schema.messages import ENDED_AS_ASKED, BackendReport, FrontendReport
from serverbench.system.process import SHM_FOLDER, find_prctl, one_line
from serverbench.system.scratch import take_environment


def finish_child(report_conn, report: BackendReport | FrontendReport, channels: Iterable) -> None:
    """Sends the child's report to the server, flushes its queues and exits with the report's status."""
    for channel in channels:
        try:
            channel.flush(timeout_s=2.0)
        except Exception as exc:  # noqa: BLE001 - the report must still be sent
            logging.getLogger("procutil").error("could not flush %s: %s", type(channel).__name__, one_line(exc))
    with contextlib.suppress(OSError):
        report_conn.send(report)
        report_conn.close()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if report.status in ENDED_AS_ASKED else 1)


def stop_processes(processes: Sequence[BaseProcess], grace_s: float) -> list[str]:
    """Waits for every started process at once, up to grace_s in all (they were told to stop); then kills every
    one still running, all before waiting for any, and waits up to grace_s once more. Names of those killed. One
    deadline for all of them: 64 instances stop in one grace period, not in 64 one after the other."""
    started = [proc for proc in processes if proc.pid is not None]
    _wait_all(started, time.monotonic() + grace_s)
    killed = [proc for proc in started if proc.exitcode is None]
    for proc in killed:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
    _wait_all(killed, time.monotonic() + grace_s)
    return [proc.name for proc in killed]


def _wait_all(processes: Sequence[BaseProcess], deadline: float) -> None:
    """Until every one of `processes` has exited (and is reaped) or the deadline has passed."""
    running = [proc for proc in processes if proc.exitcode is None]
    while running and (left_s := deadline - time.monotonic()) > 0:
        wait_for([proc.sentinel for proc in running], timeout=left_s)
        running = [proc for proc in running if proc.exitcode is None]  # exitcode reaps what has exited


def process_status(pid: int) -> dict[str, str] | None:
    """/proc/PID/status as its fields (State, SigPnd, SigIgn, ...); None where it cannot be read (the process gone,
    not Linux)."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return None
    return {key: value.strip() for key, _, value in (line.partition(":") for line in lines)}


def signal_taken(pid: int, signum: int, timeout_s: float) -> bool:
    """Whether process `pid` took `signum` (no longer pending for it, /proc/PID/status) within timeout_s: its handler
    has begun, or it ignored the signal. False at the deadline, at once for a stopped process (SIGSTOP: it takes
    nothing until continued), and where /proc cannot say (the process gone, not Linux)."""
    bit = 1 << (signum - 1)  # the pending masks are hexadecimal bit sets, signal n at bit n - 1
    deadline = time.monotonic() + timeout_s
    while (status := process_status(pid)) is not None and not status.get("State", "").startswith(("T", "t")):
        if not any(int(status.get(mask, "0"), 16) & bit for mask in ("SigPnd", "ShdPnd")):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return False


def session_pids(session_id: int) -> list[int]:
    """The processes of a session (Linux /proc); [] where there is no /proc."""
    pids = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[3]) == session_id:  # after the command: state, ppid, pgrp, session
            pids.append(int(entry.name))
    return pids


def shm_mapped_by(pids: Iterable[int]) -> set[str]:
    """Names in SHM_FOLDER that these processes have mapped and that are still linked: the segments and named
    semaphores they made or opened, which nobody else will unlink once they (and their resource tracker) are
    killed. Read from /proc/PID/maps, so that no other run's entries are ever named."""
    names = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        for line in maps.splitlines():
            parts = line.split(maxsplit=5)  # address, perms, offset, device, inode, path
            path = parts[5] if len(parts) == 6 else ""
            if path.startswith(f"{SHM_FOLDER}/") and not path.endswith("(deleted)"):
                names.add(path[len(str(SHM_FOLDER)) + 1 :])
    return names


def unlink_shm(names: Iterable[str]) -> list[str]:
    """Unlinks those of `names` still in SHM_FOLDER; the ones unlinked."""
    removed = []
    for name in sorted(names):
        with contextlib.suppress(FileNotFoundError):
            (SHM_FOLDER / name).unlink()
            removed.append(name)
    return removed


def stop_session(proc: subprocess.Popen, signum: int, grace_s: float) -> list[str] | None:
    """Stops a child that leads its own session (a sweep's cell server) as an interrupt would: `signum` to it
    alone, so that it stops its own children, writes what it has, and its resource tracker unlinks its shared
    memory; waits up to grace_s, another Ctrl-C meanwhile included. None when it stopped; else it is killed with
    its whole session, and the /dev/shm entries its processes had mapped, which the killed tracker would have
    unlinked, are unlinked here: the names unlinked."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signum)
    deadline = time.monotonic() + grace_s
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            break
        except KeyboardInterrupt:
            continue  # pressed again: it is stopping already
    if proc.poll() is not None:
        return None
    left = shm_mapped_by(session_pids(proc.pid))
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace_s)
    return unlink_shm(left)


# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
INT_MAX = 2**31 - 1


def tune_malloc(libc_path: str | None = None) -> bool:
    """This process's glibc malloc: no allocation mapped on its own (M_MMAP_MAX 0) and freed heap memory kept
    (M_TRIM_THRESHOLD at its largest), so a forward's activations, allocated and freed every forward, reuse the
    same heap pages instead of being mapped, faulted in and unmapped each time. Measured on the 2-core CPU machine
    (resnet18, batch 32, 64x64, one intra-op thread, the ceiling measured four times in one process): 205 -> 225
    samples/s at one thread; at two, back-to-back measurements alternated between about 413 and 465 untuned, and
    stayed near 455 tuned. False where the C library has no mallopt (not glibc: macOS) or refuses."""
    try:
        libc = ctypes.CDLL(libc_path or ctypes.util.find_library("c"))
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, INT_MAX))


PR_SET_TIMERSLACK = 29  # linux/prctl.h
SENDER_TIMER_SLACK_NS = 1000


def tighten_timer_slack(slack_ns: int = SENDER_TIMER_SLACK_NS, libc_path: str | None = None) -> bool:
    """The calling thread's timer slack (Linux: how late the kernel may wake a sleeping thread, to batch wake-ups;
    50 us by default) set to `slack_ns`: the frontend's sender wakes on its schedule instead of up to 50 us after
    it, without spinning. Measured on the 2-core CPU machine with the sender's final plain sleep (identity, batch 1,
    Poisson 500 req/s, serial, 5 interleaved repeats, results/commits/NOTES.md): median sender lateness 0.084-0.089
    -> 0.028-0.030 ms. False where there is no prctl (not Linux) or it refuses."""
    prctl = find_prctl(libc_path)
    return prctl is not None and prctl(PR_SET_TIMERSLACK, ctypes.c_ulong(slack_ns), 0, 0, 0) == 0


def run_role(module: str, function: str, environment: dict[str, str], *args) -> None:
    """A child process's entry point: takes the `environment` the server chose for it (scratch.children_temp_folder),
    then imports its role's module (client, worker) in the child. The server refers to it by name, so that it never
    imports torch, which those modules need: seconds per run, before either child could start."""
    import importlib

    take_environment(environment)
    getattr(importlib.import_module(module), function)(*args)
