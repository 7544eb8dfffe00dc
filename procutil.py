"""What the frontend and backend processes share about being a child of server.py: start, report, exit."""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import signal
import sys
import threading
from typing import Iterable

_parent_pid: list[int] = []  # set once per child process by setup_child


STACK_DUMP_SIGNAL = signal.SIGUSR1  # the server sends it to a child it is about to stop for being stuck
PROGRESS_SIGNAL = signal.SIGUSR2  # likewise: the backend logs how far each step got and its queues' depths


def setup_child(role: str) -> None:
    # Ctrl-C reaches the whole process group; only the server decides what to do with it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    faulthandler.register(STACK_DUMP_SIGNAL, file=sys.stderr, all_threads=True)
    _parent_pid[:] = [os.getppid()]
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s {role}[%(process)d] %(levelname)s %(message)s")


def parent_gone() -> bool:
    """True once the server that started this process has died (the child is then re-parented)."""
    return bool(_parent_pid) and os.getppid() != _parent_pid[0]


def one_line(exc: BaseException, limit: int = 500) -> str:
    text = f"{type(exc).__name__}: {exc}".replace("\r", " ").replace("\n", " ").strip()
    return text if len(text) <= limit else text[: limit - 3] + "..."


def flush_queue(mp_queue, timeout_s: float) -> None:
    """Waits up to timeout_s for what this process put on `mp_queue` to reach the pipe, then lets the
    process exit regardless (a reader that died must not keep us alive)."""
    mp_queue.close()
    flusher = threading.Thread(target=mp_queue.join_thread, daemon=True)
    flusher.start()
    flusher.join(timeout_s)
    mp_queue.cancel_join_thread()


def finish_child(report_conn, report: dict, channels: Iterable) -> None:
    """Sends the child's report to the server, flushes its queues and exits with the report's status."""
    for channel in channels:
        channel.flush(timeout_s=2.0)
    with contextlib.suppress(OSError):
        report_conn.send(report)
        report_conn.close()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if report.get("status") in ("ok", "stopped") else 1)
