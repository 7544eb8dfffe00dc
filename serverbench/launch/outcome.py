"""What one run of the server process comes to, whoever runs it (a plain run, a torchrun rank, a peak search's
step): its result, the exit statuses, the interrupt that stops it, and the call they all make."""

from __future__ import annotations

from collections.abc import Callable

from serverbench.config.options import BenchConfig
from serverbench.schema.messages import RunResult

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130

StartBarrier = Callable[[bool, str], str | None]  # (this rank ok, its error) -> None, or why to stop


class Interrupted(Exception):
    """SIGINT or SIGTERM reached the server."""


# The two calls a run is made with; server.py implements them, the package takes them as arguments.
# run_benchmark(cfg, start_barrier): both processes of one run, started together with the other ranks' when given.
RunBenchmark = Callable[[BenchConfig, StartBarrier | None], RunResult]
# run_once(cfg, extra_columns): one run with its row (appended, with the extra columns), detail files and summary.
RunOnce = Callable[[BenchConfig, dict | None], tuple[RunResult, dict[str, object]]]


def crash_if_asked(cfg: BenchConfig) -> None:
    """Test-only (--inject_fault server): the server process itself raises, as a crashing rank would."""
    if cfg.inject_fault == "server":
        raise RuntimeError("injected fault in the server process")
