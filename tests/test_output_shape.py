"""A model whose output changes mid-run (its batch dimension shrinks or grows, a dict's key changes) ends the run at
once with an error that says what changed: never a silent drop that waits out --timeout_s, never extra rows cut
off or leaves matched by position alone."""

from __future__ import annotations

import subprocess
import textwrap
import threading
import time
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import (
    ServerRun,
    kill_session,
    live_processes_in_session,
    new_shm_entries,
    read_rows,
    shm_entries,
    start_server,
)

from serverbench.load.receiver import Receiver
from serverbench.load.state import FrontendState, SendTimes
from serverbench.schema.messages import Response

# A factory imported by the server from its current folder: right until its `at`-th forward, then changed as `how`
# says. The probe before the run builds its own copy and calls it once.
CHANGING = """
import torch
from torch import nn


class Changing(nn.Module):
    def __init__(self, how: str, at: int):
        super().__init__()
        self.how, self.at, self.calls = how, at, 0

    def forward(self, x):
        self.calls += 1
        late = self.calls >= self.at
        if self.how == "shrink" and late:
            return x[:1]
        if self.how == "grow" and late:
            return torch.cat([x, x[:1]])
        if self.how == "key":  # every other forward under another key: the leaves alike, by position
            return {("a" if self.calls % 2 else "b"): x * 1.0}
        return x * 1.0


def changing(how: str, at: int = 3):
    return Changing(how, at)
"""

# The no-progress timeout a dropped response would wait out: the runs must end long before it. The four runs go at
# once (the start's imports use both cores, and each run's own serial start leaves one idle), so each takes longer
# than alone; the bound is far above that and far below what waiting it out would take.
TIMEOUT_S = 60
QUICK = ["--device", "cpu", "--batch_size", "2", "--num_iters", "20", "--warmup_iters", "1", "--no-ceiling"]
QUICK += ["--input", "x:float32:4", "--timeout_s", str(TIMEOUT_S), "--warmup_timeout_s", "60"]

CASES = [
    # (id, --model_kwargs, more flags, what the error names)
    ("shrinks", '{"how": "shrink"}', [], "1x4"),
    ("shrinks-batched", '{"how": "shrink"}', ["--max_batch_size", "4", "--max_queue_delay_ms", "5"], "x4"),
    ("grows-verified", '{"how": "grow"}', ["--verify"], "3x4"),
    ("key-changes-verified", '{"how": "key"}', ["--verify"], "'b'"),
]


@dataclass
class TimedRun:
    run: ServerRun
    elapsed_s: float  # from the start of the runs to this one's exit
    shm_left: set[str]  # /dev/shm entries left by any of the runs, once every one had ended


@pytest.fixture(scope="module")
def changed_runs(tmp_path_factory) -> dict[str, TimedRun]:
    """Each case's run, all started at once from a folder holding the factory: how each ended, when, and what the
    runs left in /dev/shm."""
    folder = tmp_path_factory.mktemp("changing")
    (folder / "changing.py").write_text(textwrap.dedent(CHANGING))
    before = shm_entries()
    started_s = time.monotonic()
    procs = {}
    for case, kwargs, extra, _ in CASES:
        args = [*QUICK, "--model", "changing:changing", "--model_kwargs", kwargs, *extra]
        procs[case] = start_server(args, folder / case, output_file="output.csv", cwd=folder)
    ended: dict[str, tuple[str, str, float]] = {}

    def wait(case: str) -> None:
        try:
            stdout, stderr = procs[case].communicate(timeout=TIMEOUT_S * 3)
        except subprocess.TimeoutExpired:  # its elapsed time fails its test, with the output's tail
            kill_session(procs[case].pid)
            stdout, stderr = procs[case].communicate(timeout=30)
        ended[case] = (stdout, stderr, time.monotonic() - started_s)

    threads = [threading.Thread(target=wait, args=(case,)) for case in procs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    left = new_shm_entries(before)
    runs = {}
    for case, proc in procs.items():
        stdout, stderr, elapsed_s = ended[case]
        rows = read_rows(folder / case / "output.csv")
        runs[case] = TimedRun(ServerRun(proc.returncode, stdout, stderr, rows, proc.pid), elapsed_s, left)
    return runs


@pytest.mark.parametrize("case,named", [(c[0], c[3]) for c in CASES], ids=[c[0] for c in CASES])
def test_an_output_that_changes_mid_run_is_an_error_at_once(
    changed_runs: dict[str, TimedRun], case: str, named: str
) -> None:
    run, elapsed_s = changed_runs[case].run, changed_runs[case].elapsed_s
    assert run.returncode != 0, run.stderr[-3000:]
    row = run.row
    assert row["status"] == "error", (row["status"], row["error"])
    assert named in row["error"], row["error"]
    assert int(row["responses_received"]) < 20
    # At once: the start (a factory's probe, two processes importing torch) takes seconds; the timeout is not spent.
    assert elapsed_s < TIMEOUT_S, elapsed_s
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    assert not changed_runs[case].shm_left
    assert not live_processes_in_session(run.session_id)


def test_the_receiver_fails_the_run_on_a_response_of_the_wrong_shape_and_names_it() -> None:
    """The frontend's own check, whatever the backend let through: any leaf without the request's rows first."""
    state = FrontendState(threading.Event(), concurrency=1)
    receiver = Receiver(
        SimpleNamespace(batch_size=2, warmup_iters=1, generator=0), state, responses=None, verifier=None
    )
    state.sends[5] = SendTimes(sent_ns=1, start_ns=1)
    # Never read: both responses are turned away before their timings are.
    receiver._on_response(Response(9, (np.zeros((2, 4)),), timings=None), received_ns=2)  # an id never sent
    assert (state.report.status, state.report.responses_unexpected) == ("ok", 1)
    receiver._on_response(Response(5, (np.zeros((2, 4)), np.zeros((1, 3))), timings=None), received_ns=2)
    report = state.report
    assert report.status == "error" and state.finished.is_set() and not report.records
    assert "request 5" in report.error and "leaf 1 (of 2" in report.error and "1x3" in report.error
    assert "batch of 2" in report.error and report.responses_unexpected == 1
