"""One benchmark per rank under torchrun, gathered into one job: the rank's identity, its gloo collectives (each
bounded by --dist_timeout_s), and the pure merging of every rank's records into the job's figures.

    torchrun --standalone --nproc_per_node=8 server.py --batch_size 256

Each rank runs its own frontend/backend pair on its own device (cuda:LOCAL_RANK, or the CPU) with seed + rank.
Every rank calls the same collectives in the same order, whatever happened to it:
    1. start barrier: after its warm-up, or at once when its run failed before that; carries (ok, error),
       so a rank that failed makes the others stop instead of waiting;
    2. gather: every rank's row and records to rank 0, which alone writes the results;
    3. finish: a barrier once rank 0 has written the rows; then each rank exits with its own run's status
       (non-zero where the run failed or was stopped because another rank failed), and torchrun's exit status
       is the job's. The rank whose failure stopped the job also writes it to torchrun's error file, so the
       launcher's summary names it as the root cause.
torch.distributed is imported only here and only under torchrun: a plain run does not pay for it.
"""

from __future__ import annotations

import datetime
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from serverbench.config.options import RankInfo
from serverbench.schema.messages import first_failure

BARRIER_MARGIN_S = 10.0  # beyond the collective's own timeout, before a collective thread is given up on


def rank_from_env(environ: Mapping[str, str] = os.environ) -> RankInfo | None:
    """This process's place in a torchrun job, or None when it was not started by torchrun (a plain run)."""
    needed = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    if not all(name in environ for name in needed):
        return None
    local_world_size = int(environ.get("LOCAL_WORLD_SIZE", environ["WORLD_SIZE"]))
    return RankInfo(int(environ["RANK"]), int(environ["WORLD_SIZE"]), int(environ["LOCAL_RANK"]), local_world_size)


def clock_domain() -> str:
    """Processes with the same kernel boot id read the same CLOCK_MONOTONIC (time.perf_counter_ns on Linux)."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


class JobError(RuntimeError):
    """A collective failed: another rank died, or did not arrive within --dist_timeout_s."""


class RankFailed(RuntimeError):
    """This rank's run failed: what torchrun's failure summary shows for it."""


@dataclass
class RankOutcome:
    """What one rank sends to rank 0 after its run."""

    rank: RankInfo
    row: dict  # the rank's CSV row, built where the run happened (its host, device and versions)
    result: Any  # serverbench.launch.outcome.RunResult, without the --verify reference answers
    clock: str  # clock_domain()
    barrier_ns: int | None  # this rank's clock when the start barrier released it; None if it never did


class Job:
    """This rank's membership of the job: a gloo process group (so CPU-only machines work too) whose
    collectives each fail within timeout_s instead of waiting for a rank that is gone."""

    def __init__(self, rank: RankInfo, timeout_s: float) -> None:
        import torch.distributed as dist

        self.rank = rank
        self.timeout_s = timeout_s
        self.barrier_ns: int | None = None
        self.broken = False
        self._dist = dist
        # init_process_group reads RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT, which torchrun sets.
        self._call(
            "joining the job", lambda: dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
        )
        self._open = True

    def _call(self, what: str, collective: Callable[[], Any]) -> Any:
        """Runs a collective on a helper thread while this thread waits in short joins, so SIGINT and
        SIGTERM still reach the server at once; gloo's own timeout bounds the collective."""
        if self.broken:  # after a failed collective the group is in an unknown state: no further ones
            raise JobError(f"rank {self.rank.rank}: {what}: skipped, an earlier collective of this job failed")
        outcome: dict[str, Any] = {}

        def target() -> None:
            try:
                outcome["value"] = collective()
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                outcome["error"] = exc

        thread = threading.Thread(target=target, name=f"collective: {what}", daemon=True)
        thread.start()
        deadline = time.monotonic() + self.timeout_s + BARRIER_MARGIN_S
        while thread.is_alive():
            thread.join(0.2)
            if thread.is_alive() and time.monotonic() > deadline:
                self.broken = True
                raise JobError(f"rank {self.rank.rank}: {what}: no answer within {self.timeout_s:g} s")
        if "error" in outcome:
            self.broken = True
            first_line = str(outcome["error"]).strip().splitlines()[0] if str(outcome["error"]).strip() else ""
            raise JobError(
                f"rank {self.rank.rank}: {what} failed (another rank failed, or did not arrive within "
                f"--dist_timeout_s {self.timeout_s:g}): {type(outcome['error']).__name__}: "
                f"{first_line[:300]}"
            ) from outcome["error"]
        return outcome.get("value")

    def start_barrier(self, ok: bool, error: str = "") -> str | None:
        """Waits for every rank's warm-up (or failure). Returns None when all are ready, else why to stop: another
        rank failed, or the barrier itself did (a rank gone or too late)."""
        arrivals: list = [None] * self.rank.world_size

        def barrier() -> int:
            self._dist.all_gather_object(arrivals, (ok, error))
            return time.perf_counter_ns()  # stamped on the releasing thread: the clocks' common moment

        try:
            self.barrier_ns = self._call("start barrier", barrier)
        except JobError as exc:
            return str(exc)
        failed = [
            f"rank {r}: {err}" for r, (rank_ok, err) in enumerate(arrivals) if not rank_ok and r != self.rank.rank
        ]
        return (
            f"stopped because another rank failed before the measured phase ({'; '.join(failed)})" if failed else None
        )

    def gather(self, outcome: RankOutcome) -> list[RankOutcome] | None:
        """Every rank's outcome on rank 0 (in rank order); None on the other ranks."""
        everything: list | None = [None] * self.rank.world_size if self.rank.rank == 0 else None
        self._call("gathering the results", lambda: self._dist.gather_object(outcome, everything, dst=0))
        return everything

    def finish(self) -> None:
        """Waits until every rank is here, after rank 0 wrote the rows: no rank exits earlier, since torchrun
        stops the whole job as soon as one rank exits non-zero."""
        self._call("waiting for rank 0 to write the rows", self._dist.barrier)

    def close(self) -> None:
        if self._open:
            self._open = False
            self._dist.destroy_process_group()


# ------------------------------------------------------------------------------ merging the ranks' records


def clock_offsets_ns(outcomes: Sequence[RankOutcome]) -> list[int]:
    """What to add to each rank's timestamps to put them on rank 0's clock. Ranks that share rank 0's clock
    (same kernel boot) need nothing; on another machine the clocks are unrelated, so they are aligned on the
    moment the start barrier released each rank (exact to the barrier's release skew)."""
    first = outcomes[0]
    offsets = []
    for outcome in outcomes:
        if outcome.clock == first.clock or outcome.barrier_ns is None or first.barrier_ns is None:
            offsets.append(0)
        else:
            offsets.append(first.barrier_ns - outcome.barrier_ns)
    return offsets


def job_status(outcomes: Sequence[RankOutcome]) -> tuple[str, str]:
    """The job's status: ok when every rank is; else the status and error of the rank whose failure the others
    follow (first_failure over the ranks in rank order: a death first, ranks that were only stopped because of
    another, 'aborted', last)."""
    in_order = sorted(outcomes, key=lambda o: o.rank.rank)
    failed = [o for o in in_order if o.result.status != "ok"]
    if not failed:
        return "ok", ""
    cause = first_failure(o.result for o in in_order) or failed[0].result  # a rank that only stopped: still not ok
    first = next(o for o in in_order if o.result is cause)
    others = f" ({len(failed) - 1} other rank(s) failed too)" if len(failed) > 1 else ""
    return first.result.status, f"rank {first.rank.rank}: {first.result.error}{others}"


def tell_torchrun(message: str) -> None:
    """Writes `message` to this rank's torchrun error file (TORCHELASTIC_ERROR_FILE), which the launcher's
    failure summary shows; the run's failure stays a recorded status and an exit code, not a traceback."""
    from torch.distributed.elastic.multiprocessing.errors import get_error_handler

    try:
        raise RankFailed(message)
    except RankFailed as exc:
        get_error_handler().record_exception(exc)


def slowest_rank(outcomes: Sequence[RankOutcome]) -> tuple[int | None, float | None]:
    """The rank with the lowest throughput, and that throughput; (None, None) when no rank measured any."""
    measured = [(o.row.get("throughput"), o.rank.rank) for o in outcomes if o.row.get("throughput") is not None]
    if not measured:
        return None, None
    throughput, rank = min(measured)
    return rank, throughput
