"""--instances N: several backend processes, each with its own model, serving one request transport and one
frontend. End to end on the CPU (two instances; one that dies mid-run), and in-process: the reports merged into
one, the ceilings summed, the barrier that times them together, and MPS detected as CUDA itself does."""

from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest
from conftest import TINY, live_processes_in_session, make_config, new_shm_entries, run_server, shm_entries

from serverbench.launch.instances import Instance, combine_backend_reports, mps_in_use, sum_ceiling_loops
from serverbench.records.instances import requests_per_instance, warmup_busy_ns
from serverbench.schema.messages import BackendReport, FrontendReport
from serverbench.schema.records import RequestRecord
from tests.helpers import spread_record


def test_two_instances_serve_one_frontend_end_to_end(tmp_path: Path) -> None:
    shm_before = shm_entries()
    # Serial, and a real network: an instance takes one request at a time and holds it for a forward of
    # milliseconds, so the other surely gets some of the 20 (with the identity model's microseconds, one instance
    # may take the next header before the other has woken up).
    run = run_server(
        [
            *TINY,
            "--model",
            "resnet18",
            "--num_iters",
            "20",
            "--design",
            "serial",
            "--instances",
            "2",
            "--verify",
            "--save_requests",
            "--trace",
        ],
        tmp_path,
    )
    assert run.returncode == 0, run.stderr
    row = run.row
    assert row["status"] == "ok" and row["wrong_outputs"] == "0"  # every response is its batch's answer
    assert int(row["responses_received"]) == 20 and row["experiment"] == "serial_2inst"
    assert row["instances"] == "2" and row["mps"] == ""  # no GPU: MPS does not apply
    served = [int(n) for n in row["requests_per_instance"].split(";")]
    assert len(served) == 2 and sum(served) == 20 and min(served) > 0
    # Each record says which instance served it; the row's counts are the records'.
    records = pd.read_csv(tmp_path / row["requests_file"])
    measured = records[~records["warmup"]]
    assert measured["instance"].value_counts().sort_index().tolist() == served
    # The ceiling: both instances timed at once, summed; the row's efficiency is read against that sum.
    assert float(row["ceiling_throughput"]) > 0 and float(row["backend_cpu_cores"]) > 0
    assert float(row["efficiency"]) == pytest.approx(float(row["throughput"]) / float(row["ceiling_throughput"]))
    assert "instances     2 processes; measured requests each served: " + row["requests_per_instance"] in run.stdout
    trace = json.loads((tmp_path / row["timeline_trace"]).read_text())
    processes = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert processes == {"frontend", "backend instance 0", "backend instance 1"}
    assert live_processes_in_session(run.session_id) == []
    assert new_shm_entries(shm_before) == set()


def test_an_instance_that_dies_mid_run_ends_the_run(tmp_path: Path) -> None:
    shm_before = shm_entries()
    # The queue transport here (the shm ring in the test above); 5 ms forwards keep instance 0 from taking every
    # request before instance 1 takes its first measured one and exits. An intra-op thread count as the user told
    # it (3: not what auto gives two instances of two workers on most machines) reaches the row of the survivor.
    start = time.monotonic()
    run = run_server(
        [
            *TINY,
            "--model",
            "identity",
            "--num_iters",
            "200",
            "--instances",
            "2",
            "--transport",
            "queue",
            "--inject_delay_ms",
            "5",
            "--inject_fault",
            "instance_exit",
            "--intra_op_threads",
            "3",
        ],
        tmp_path,
    )
    elapsed_s = time.monotonic() - start
    assert run.returncode == 1
    row = run.row
    assert row["status"] == "backend_died"
    assert row["error"] == "the backend instance 1 process died (exit status 3)"
    assert int(row["responses_missing"]) >= 1  # the request it took dies with it
    assert "run failed (backend_died): the backend instance 1 process died" in run.stderr
    assert elapsed_s < 90  # start-up of three processes on 2 cores, then seconds
    exit_line = [line for line in run.stderr.splitlines() if "exits now" in line][-1]
    assert "backend1[" in exit_line  # the fault fired in instance 1
    assert row["intra_op_threads"] == "3"
    assert live_processes_in_session(run.session_id) == []
    assert new_shm_entries(shm_before) == set()


def test_instances_are_refused_where_they_mean_nothing(tmp_path: Path) -> None:
    from serverbench.config.flags import ConfigError
    from serverbench.config.options import RankInfo

    def config(*argv: str, rank=None):
        return make_config(["--device", "cpu", "--results_dir", str(tmp_path), *argv], rank)

    assert config().instances == 1 and config().experiment == "pipelined_2w"  # one instance: as before
    assert config("--instances", "3", "--design", "serial").experiment == "serial_3inst"
    assert config("--instances", "3", "--experiment", "mine").experiment == "mine"
    for argv, message in [
        (("--instances", "0"), "--instances 0: must be at least 1"),
        (("--instances", "65"), "--instances 65: must be at most 64"),
        (("--inject_fault", "instance_exit"), "needs --instances 2 or more"),
    ]:
        with pytest.raises(ConfigError, match=message):
            config(*argv)
    with pytest.raises(ConfigError, match="--instances 2 under torchrun"):
        config("--instances", "2", rank=RankInfo(0, 2, 0, 2))


def _record(request_id: int, instance: int, warmup: bool = False) -> RequestRecord:
    t = 1000 * (request_id + 1)
    return spread_record(request_id, t, t + 5, warmup=warmup, batch_size=2, instance=instance)


ROLES = ["backend instance 0", "backend instance 1"]


def _ok(cores: float, before: dict, after: dict, busy_ns: tuple[int, int]) -> BackendReport:
    return BackendReport(backend_cpu_cores=cores, ceiling_before=before, ceiling_after=after, ceiling_before_ns=busy_ns)


def test_the_instances_reports_make_one_whose_ceiling_is_their_sum() -> None:
    frontend = FrontendReport()
    reports = {
        "frontend": frontend,
        ROLES[1]: _ok(0.5, {1: [10.0, 12.0]}, {1: [11.0]}, (100, 200)),
        ROLES[0]: _ok(0.75, {1: [20.0, 22.0], 2: [30.0, 31.0]}, {1: [21.0]}, (110, 190)),
    }
    combined = combine_backend_reports(reports, ROLES)
    assert combined["frontend"] is frontend and set(combined) == {"frontend", "backend"}
    backend = combined["backend"]
    assert backend.status == "ok" and backend.backend_cpu_cores == pytest.approx(1.25)
    # Loop k of each instance ran at the same time: summed loop by loop, at the concurrencies both timed.
    assert backend.ceiling_before == {1: [30.0, 34.0]} and backend.ceiling_after == {1: [32.0]}
    # The first warm-up request's wait for the ceiling is that of the instance that answered it.
    records = [_record(0, 1, warmup=True), _record(1, 0), _record(2, 1), _record(3, 1)]
    assert warmup_busy_ns(backend, records) == (100, 200)
    assert requests_per_instance(records, 2) == "1;2"  # measured only; the warm-up is not counted
    # One instance: its report as it is, as before instances existed.
    single = _ok(0.5, {1: [1.0]}, {}, (1, 2))
    assert combine_backend_reports({"backend": single}, ["backend"])["backend"] is single
    assert warmup_busy_ns(single, records) == (1, 2)


def test_the_first_instance_to_die_or_fail_gives_the_run_its_status() -> None:
    stopped = BackendReport(status="stopped")
    failed = BackendReport(status="oom", error="OutOfMemoryError: no room", traceback="Traceback...")
    died = BackendReport(
        role=ROLES[1], status="backend_died", error="the backend instance 1 process died (killed by SIGKILL)"
    )
    backend = combine_backend_reports({ROLES[0]: failed, ROLES[1]: stopped}, ROLES)["backend"]
    assert backend.status == "oom" and backend.error == "backend instance 0: OutOfMemoryError: no room"
    assert backend.traceback == "Traceback..." and backend.ceiling_before is None
    # A death is the cause of what the others then report, whichever arrived first.
    backend = combine_backend_reports({ROLES[0]: failed, ROLES[1]: died}, ROLES)["backend"]
    assert (backend.status, backend.error) == ("backend_died", died.error)
    assert combine_backend_reports({ROLES[0]: stopped, ROLES[1]: stopped}, ROLES)["backend"].status == "stopped"
    backend = combine_backend_reports({ROLES[0]: _ok(1.0, {}, {}, (0, 1))}, ROLES)["backend"]
    assert (backend.status, backend.error) == ("error", "no report from backend instance 1")
    assert "backend" not in combine_backend_reports({"frontend": FrontendReport()}, ROLES)


def test_the_ceiling_sum_needs_every_instance() -> None:
    assert sum_ceiling_loops([{1: [1.0, 2.0]}, {1: [3.0, 4.0]}, {1: [5.0, 6.0]}]) == {1: [9.0, 12.0]}
    assert sum_ceiling_loops([{1: [1.0]}, None]) is None and sum_ceiling_loops([{1: [1.0]}, {}]) is None


def test_instances_pass_the_barrier_together_and_leave_it_when_the_run_stops() -> None:
    assert Instance().wait_together(lambda: False, timeout_s=0.1)  # one instance: nothing to wait for
    barrier = threading.Barrier(2)
    passed: list[bool] = []
    other = threading.Thread(target=lambda: passed.append(Instance(1, 2, barrier).wait_together(lambda: False, 10)))
    other.start()
    assert Instance(0, 2, barrier).wait_together(lambda: False, 10)
    other.join(timeout=10)
    assert passed == [True]
    # The other instance is gone and the run is stopping: the wait ends within a poll, not at its timeout.
    stopping = threading.Event()
    threading.Timer(0.2, stopping.set).start()
    start = time.monotonic()
    assert not Instance(0, 2, threading.Barrier(2)).wait_together(stopping.is_set, timeout_s=30)
    assert time.monotonic() - start < 2
    with pytest.raises(TimeoutError, match="backend instance 0: the other instances did not reach"):
        Instance(0, 2, threading.Barrier(2)).wait_together(lambda: False, timeout_s=0.2)


def test_mps_is_in_use_only_when_its_control_daemon_answers(monkeypatch) -> None:
    with tempfile.TemporaryDirectory(prefix="mps") as folder:  # short: a UNIX socket path has ~100 bytes
        environ = {"CUDA_MPS_PIPE_DIRECTORY": folder}
        assert not mps_in_use(environ)  # no daemon ever ran here
        control = os.path.join(folder, "control")
        daemon = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)  # what nvidia-cuda-mps-control listens on
        daemon.bind(control)
        daemon.listen(1)
        try:
            assert mps_in_use(environ)
            assert not mps_in_use({"CUDA_MPS_PIPE_DIRECTORY": folder + "-elsewhere"})
        finally:
            daemon.close()
        assert os.path.exists(control) and not mps_in_use(environ)  # a socket left by a daemon that died
        # Without the variable CUDA looks in /tmp/nvidia-mps, and so does the detection.
        monkeypatch.setattr("serverbench.launch.instances.DEFAULT_MPS_PIPE_DIRECTORY", folder)
        daemon = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        os.unlink(control)
        daemon.bind(control)
        daemon.listen(1)
        try:
            assert mps_in_use({})
        finally:
            daemon.close()


def test_the_timeline_gives_each_instance_its_own_process() -> None:
    from serverbench.records.timeline import build_timeline

    records = [
        replace(r, h2d_start_ns=r.taken_ns, h2d_thread="h2d", predict_thread="predict-0", d2h_thread="d2h")
        for r in (_record(i, i % 2) for i in range(4))
    ]
    trace = build_timeline(records)
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names == {1: "frontend", 2: "backend instance 0", 3: "backend instance 1"}
    lanes = {(e["pid"], e["args"]["name"]) for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert {(2, "h2d"), (3, "h2d")} <= lanes  # the same thread names, apart
    one = build_timeline([replace(r, instance=0) for r in records])
    assert {e["args"]["name"] for e in one["traceEvents"] if e["name"] == "process_name"} == {"frontend", "backend"}


def test_the_cpu_split_gives_the_frontend_one_core_and_the_model_the_rest() -> None:
    from serverbench.launch.instances import cpu_split, cpu_threads_per_instance

    assert cpu_split([3, 1, 2, 0]) == ([0], [1, 2, 3])
    assert cpu_split([5, 7]) == ([5], [7])  # the 2-core machine: a core each
    assert cpu_split([4]) == ([4], [4])  # one CPU: nothing to split, both share it
    backend = cpu_split(range(8))[1]
    assert cpu_threads_per_instance(1, backend) == 7 and cpu_threads_per_instance(2, backend) == 3
    assert cpu_threads_per_instance(1, backend, forwards=2) == 3
    assert cpu_threads_per_instance(4, [1]) == 1  # never fewer than one thread


def test_the_model_gets_the_cores_shared_among_the_forwards_that_run_at_once() -> None:
    from functools import partial

    from serverbench.launch.instances import intra_op_threads

    two, eight = [0, 1], list(range(8))
    auto = partial(intra_op_threads, None, env={})
    # Auto on the CPU device: every core for one forward at a time (serial, threaded).
    assert auto(1, two, forwards=1, default_threads=2) == 2
    assert auto(1, eight, forwards=1, default_threads=8) == 8
    # Shared out among the forwards at once: pipelined's workers, times the instances.
    assert auto(1, two, forwards=2, default_threads=2) == 1
    assert auto(1, eight, forwards=2, default_threads=8) == 4
    assert auto(2, eight, forwards=2, default_threads=8) == 2
    assert auto(4, two, forwards=2, default_threads=2) == 1  # never fewer than one
    # SMT: 8 CPUs listed, torch's own count is the 4 physical cores: never more threads than those.
    assert auto(1, eight, forwards=1, default_threads=4) == 4
    # --cpu_split has given the frontend a core of its own: `cpus` are the model's already.
    assert intra_op_threads(None, 1, eight[1:], 1, default_threads=8, env={}) == 7
    # A GPU, or the user's thread variables: torch's own count; an explicit count wins everywhere.
    assert auto(1, None, forwards=1, default_threads=8) is None
    for variable in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        assert intra_op_threads(None, 1, eight, 1, 8, env={variable: "2"}) is None
    assert intra_op_threads(5, 2, eight, 1, 8, env={"OMP_NUM_THREADS": "2"}) == 5
    assert intra_op_threads(5, 1, None, 1, 8, env={}) == 5


def test_a_cpu_run_pins_each_process_to_its_part_and_the_row_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    for variable in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.delenv(variable, raising=False)  # the user's own count would be kept

    if not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two CPUs and Linux's affinity calls")
    # torch's own count, as a child with these variables removed sees it (this process's may have been set
    # otherwise): asked now, read after the runs, so that its import overlaps them.
    torch_own = subprocess.Popen(
        [sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
        stdout=subprocess.PIPE, text=True, env=os.environ.copy(),
    )  # fmt: skip
    try:
        # --no-tune_malloc here, --intra_op_threads N in test_an_instance_that_dies_mid_run_ends_the_run: each
        # shows that what the user told reaches the row, without a run of its own.
        run = run_server([*TINY, "--design", "serial", "--cpu_split", "--no-tune_malloc"], tmp_path)
        off = run_server([*TINY, "--design", "serial", "--no-cpu_split"], tmp_path / "off")
        torch_threads = int(torch_own.communicate(timeout=120)[0].strip())
    finally:
        torch_own.kill()
    assert run.returncode == 0, run.stderr
    cpus = sorted(os.sched_getaffinity(0))
    assert run.row["cpu_split"] == "True"
    assert run.row["backend_cpus"] == ";".join(map(str, cpus[1:]))  # the frontend keeps the first for itself
    assert run.row["intra_op_threads"] == str(len(cpus) - 1)
    assert off.returncode == 0 and off.row["cpu_split"] == "False"
    assert off.row["backend_cpus"] == ";".join(map(str, cpus))  # no pinning
    # Every core for serial's one forward at a time (torch's own count, the physical cores, at most).
    assert off.row["intra_op_threads"] == str(min(len(cpus), torch_threads))
    glibc = platform.libc_ver()[0] == "glibc"
    assert off.row["malloc_tuned"] == str(glibc) and run.row["malloc_tuned"] == "False"  # on unless told not


def test_malloc_is_tuned_where_glibc_has_mallopt_and_refused_without_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import ctypes

    from serverbench.launch.procutil import tune_malloc

    assert tune_malloc("/no/such/libc.so") is False  # no C library to load
    if platform.libc_ver()[0] == "glibc":
        assert tune_malloc() is True
    monkeypatch.setattr(ctypes, "CDLL", lambda path: object())  # a C library without mallopt (macOS's has none)
    assert tune_malloc() is False


def _sleep_ignoring_sigterm(seconds: float) -> None:
    import signal
    import time

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(seconds)


def test_stopping_many_children_takes_one_grace_period_not_one_each() -> None:
    """The server's teardown (procutil.stop_processes): every child waited for at once, then every one left killed
    together; 12 children that never leave by themselves are gone within one grace period and the kill."""
    import multiprocessing as mp
    import time

    from serverbench.launch.procutil import stop_processes

    ctx = mp.get_context("fork")  # a sleeping stand-in: nothing to import
    children = [ctx.Process(target=_sleep_ignoring_sigterm, args=(60,), name=f"child {i}") for i in range(12)]
    for child in children:
        child.start()
    start = time.monotonic()
    killed = stop_processes(children, grace_s=0.5)
    elapsed_s = time.monotonic() - start
    assert sorted(killed) == sorted(child.name for child in children)
    assert all(child.exitcode is not None for child in children)
    assert elapsed_s < 0.5 + 2.0  # one grace for all, not 12 x 0.5 s
