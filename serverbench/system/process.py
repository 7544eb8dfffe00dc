"""What every process of the benchmark needs from the operating system, below every other layer: a child's set-up
(signals, logging, its parent's pid), the one-line form of an error, flushing a queue without hanging on a dead
reader, where POSIX shared memory lives, and prctl (Linux) for a child that must end with its parent."""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import logging
import os
import resource
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path

_parent_pid: list[int] = []  # set once per child process by setup_child

STACK_DUMP_SIGNAL = signal.SIGUSR1  # the server sends it to a child it is about to stop for being stuck

PROGRESS_SIGNAL = signal.SIGUSR2  # likewise: the backend logs how far each step got and its queues' depths

# What a child starts with ignored (the server ignores them while it starts its children, and an ignored signal stays
# ignored across exec): SIGINT and SIGTERM for good, since only the server decides what an interrupt does (a process
# manager's stop, `timeout` or `kill -TERM -- -PGID` sends SIGTERM to the whole group; the server then stops its
# children itself and keeps what they measured); the two signals above
# until the child installs their handlers (setup_child the stack dump's, the backend its progress one once its steps
# exist). The server sends them to a child that has not answered in time, which may still be importing torch or the
# user's model: with no handler yet, either would kill it, and the run would read as a death, not as the timeout it
# is. Ignoring them, rather than not sending them to a child not yet ready, keeps the stack dump for the child
# stuck in its start-up, which is when it tells most.
# SIGHUP likewise: a terminal's hang-up reaches its whole foreground group, and the server stops the run for it.
RUN_STOPPERS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
IGNORED_AT_START = (*RUN_STOPPERS, STACK_DUMP_SIGNAL, PROGRESS_SIGNAL)


# torch's messages about the environment rather than the run, kept out of the terminal unless --verbose: inductor
# imports cpp_extension, which says so when it finds a CUDA toolkit but no GPU (a print in older torch, a logger
# warning in newer).
QUIET_LOGGERS = ("torch.utils.cpp_extension",)
QUIET_LINES = ("No CUDA runtime is found",)


class DropLines:
    """A text stream that drops the lines starting with one of `prefixes` and passes everything else on."""

    def __init__(self, stream, prefixes: tuple[str, ...]) -> None:
        self._stream = stream
        self._prefixes = prefixes
        self._dropping = False  # print() writes the text and its end separately: drop the end too

    def write(self, text: str) -> int:
        if text.startswith(self._prefixes):
            self._dropping = True
            return len(text)
        if self._dropping and text == "\n":
            self._dropping = False
            return len(text)
        self._dropping = False
        return self._stream.write(text)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def setup_child(role: str, verbose: bool = False) -> None:
    # Ctrl-C, a stop's SIGTERM and a terminal's SIGHUP reach the whole process group; only the server decides what
    # to do with them.
    for signum in RUN_STOPPERS:
        signal.signal(signum, signal.SIG_IGN)
    faulthandler.register(STACK_DUMP_SIGNAL, file=sys.stderr, all_threads=True)
    # A crash in native code (a segfault in a compiled model's library) leaves every thread's Python stack in the log.
    faulthandler.enable(file=sys.stderr, all_threads=True)
    _parent_pid[:] = [os.getppid()]
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format=f"%(asctime)s {role}[%(process)d] %(levelname)s %(message)s"
    )
    # tqdm's default lock holds a multiprocessing semaphore (inductor draws a progress bar while compiling); a child
    # leaves with os._exit, which never unlinks it, and the resource tracker then warns of a leaked semaphore. Bars
    # here are drawn by one process's threads: a thread lock is all they need.
    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())
    if not verbose:
        quiet_environment_messages()


def quiet_environment_messages() -> None:
    """Keeps torch's messages about the environment (QUIET_LOGGERS, QUIET_LINES) out of this process's stderr."""
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    sys.stderr = DropLines(sys.stderr, QUIET_LINES)


def parent_gone() -> bool:
    """True once the server that started this process has died (the child is then re-parented)."""
    return bool(_parent_pid) and os.getppid() != _parent_pid[0]


def raise_open_files_limit() -> tuple[int, int]:
    """This process's soft limit on open files raised to its hard one, which the children it starts inherit: an
    HTTP load holds a connection per request in flight, often more than the usual soft 1024, and nothing is gained
    by stopping short of what the machine allows. The limits after it (RLIM_INFINITY as -1)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):  # an unlimited hard limit is above the kernel's nr_open
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def one_line(exc: BaseException, limit: int = 500) -> str:
    """An error as its type and message on one line, at most `limit` characters."""
    return line_of(f"{type(exc).__name__}: {exc}", limit)


def line_of(text: str, limit: int = 500) -> str:
    """Text (a command's output, a row's error) on one line, at most `limit` characters."""
    text = text.replace("\r", " ").replace("\n", " ").strip()
    return text if len(text) <= limit else text[: limit - 3] + "..."


def last_line(text: str) -> str:
    """The last line of a command's output that says something (its one-line refusal or failure), or ""."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def flush_queue(mp_queue, timeout_s: float) -> None:
    """Waits up to timeout_s for what this process put on `mp_queue` to reach the pipe, then lets the
    process exit regardless (a reader that died must not keep us alive)."""
    mp_queue.close()
    flusher = threading.Thread(target=mp_queue.join_thread, daemon=True)
    flusher.start()
    flusher.join(timeout_s)
    mp_queue.cancel_join_thread()


SHM_FOLDER = Path("/dev/shm")  # POSIX shared memory and named semaphores (sem.NAME), as files (Linux)


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def find_prctl(libc_path: str | None = None) -> Callable[..., int] | None:
    """The C library's prctl, or None where there is none (not Linux) or the library does not load. `libc_path`
    None: the C library this process has loaded already, so nothing is searched for on disk."""
    try:
        prctl = ctypes.CDLL(libc_path, use_errno=True).prctl
    except (OSError, AttributeError, TypeError):
        return None
    prctl.restype = ctypes.c_int
    return prctl


def end_with_parent(signum: int = signal.SIGTERM) -> Callable[[], None]:
    """A preexec_fn for subprocess.Popen: the child gets `signum` when what started it dies, even by SIGKILL (Linux;
    elsewhere it does nothing), so that no benchmark outlives what started it and runs beside the next one. What
    started it is the thread (prctl(2)'s "parent"): a thread that starts a command must outlive it. prctl is found
    here, in the parent, not in the forked child: a child of a threaded parent must not import or load a library
    between fork and exec (a lock another thread held at the fork stays held)."""
    prctl = find_prctl()

    def set_death_signal() -> None:
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, signum)

    return set_death_signal
