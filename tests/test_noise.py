"""The machine's share in a run, read from hand-made /proc text, and the thresholds on hand-made figures."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import TINY, make_config, read_log_until, read_rows, register_session, start_server

from serverbench.load.noise import (
    CpuTimes,
    Lateness,
    NoiseMeter,
    noise_between,
    noise_columns,
    noise_warnings,
    parse_cpu_times,
    parse_involuntary_switches,
    parse_process_ticks,
    parse_schedstat_ns,
    sender_lateness,
    short_phase_note,
    take_snapshot,
)
from serverbench.records.console import _ceiling_lines, _oversubscribed, noise_lines
from serverbench.schema.records import NoiseStats, RequestRecord
from tests.helpers import timed_record

STAT = "cpu  {user} 0 {system} {idle} {iowait} 0 0 {steal} 0 0\ncpu0 1 2 3 4 5 6 7 8 9 10\nintr 1 2\n"


def write_proc(root: Path, stat: dict[str, int], threads: dict[int, dict[int, tuple[int, int, int]]]) -> None:
    """A /proc with a stat file and, for each pid, threads with (run_ns, wait_ns, involuntary switches); the
    process's user + system ticks (10 ms each) are its threads' run time, half each."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "stat").write_text(STAT.format(**stat))
    for pid, tasks in threads.items():
        ticks = sum(run_ns for run_ns, _, _ in tasks.values()) // 10_000_000
        (root / str(pid)).mkdir(parents=True, exist_ok=True)
        (root / str(pid) / "stat").write_text(
            f"{pid} (a name) S 1 2 3 4 5 6 7 8 9 10 {ticks - ticks // 2} {ticks // 2} 0 0\n"
        )
        for tid, (run_ns, wait_ns, involuntary) in tasks.items():
            task = root / str(pid) / "task" / str(tid)
            task.mkdir(parents=True, exist_ok=True)
            (task / "schedstat").write_text(f"{run_ns} {wait_ns} 42\n")
            (task / "status").write_text(
                f"Name:\tx\nvoluntary_ctxt_switches:\t9\nnonvoluntary_ctxt_switches:\t{involuntary}\n"
            )


def test_the_counters_parse_from_proc_text() -> None:
    assert parse_cpu_times(STAT.format(user=10, system=5, idle=80, iowait=3, steal=2)) == CpuTimes(2, 83, 100)
    assert parse_cpu_times("intr 1\n") is None and parse_cpu_times("cpu  1 2 x\n") is None
    assert parse_schedstat_ns("123 456 7\n") == (123, 456) and parse_schedstat_ns("") is None
    assert parse_involuntary_switches("nonvoluntary_ctxt_switches:\t17\n") == 17
    assert parse_involuntary_switches("Name: x\n") is None
    assert parse_process_ticks("42 (a (b) c) S 1 2 3 4 5 6 7 8 9 10 70 30 0 0\n") == 100


def test_steal_other_processes_and_run_queue_wait_over_a_phase(tmp_path: Path) -> None:
    start_root, end_root = tmp_path / "start", tmp_path / "end"
    # 2 CPUs for 1 s at 100 ticks/s: 200 ticks. Between the snapshots: 10 ticks stolen, 90 idle, so 100 busy ticks
    # (1 s of CPU); the benchmark's threads ran 0.4 s of it: other processes had 0.6 s, 30 % of all CPU time.
    write_proc(start_root, dict(user=0, system=0, idle=0, iowait=0, steal=0), {7: {7: (0, 0, 0)}, 8: {8: (0, 0, 0)}})
    write_proc(
        end_root,
        dict(user=80, system=20, idle=80, iowait=10, steal=10),
        {7: {7: (300_000_000, 50_000_000, 5), 9: (0, 10_000_000, 1)}, 8: {8: (100_000_000, 0, 0)}},
    )
    roles = {"backend": [7], "frontend": [8]}
    start, end = take_snapshot(roles, start_root), take_snapshot(roles, end_root)
    end = dataclasses.replace(end, at_ns=start.at_ns + 1_000_000_000)  # a phase of exactly 1 s
    stats = noise_between(start, end, max_stall_ms=3.0)
    assert stats.cpu_steal_pct == pytest.approx(5.0)
    assert stats.other_cpu_pct == pytest.approx(30.0)
    assert stats.shares_reliable
    # Thread 9 began during the phase: it counts from zero. 60 ms of waiting in a 1 s phase.
    assert stats.runqueue_wait_pct == {"backend": pytest.approx(6.0), "frontend": 0.0}
    assert stats.involuntary_switches == {"backend": 6, "frontend": 0}
    warnings = noise_warnings(stats, None, None, p99_latency_s=0.002)
    assert any("steal" in w for w in warnings) and any("backend's threads waited 6.0 %" in w for w in warnings)
    # A 3 ms stall is longer than this p99 but no longer than a quiet machine's own: not warned; 30 ms is.
    assert not any("stall" in w for w in warnings)
    long_stall = dataclasses.replace(stats, max_stall_ms=30.0)
    assert any("30.0 ms stall" in w for w in noise_warnings(long_stall, None, None, p99_latency_s=0.002))
    assert not any("stall" in w for w in noise_warnings(long_stall, None, None, p99_latency_s=0.05))


def test_run_queue_wait_alone_is_the_designs_cost_not_noise() -> None:
    """With the cores to itself, the benchmark's threads wait only for each other: a note, not a warning."""
    own = NoiseStats(0.0, 0.5, True, {"backend": 40.0, "frontend": 0.1}, {"backend": 100}, 0.2)
    assert noise_warnings(own, None, 0.001, 0.002) == []
    row = noise_columns(own, None, 0.001, 0.002)
    lines = noise_lines(row)
    assert "WARNING" not in "\n".join(lines) and "outnumber the cores" in lines[-1]
    crowded = NoiseStats(0.0, 45.0, True, {"backend": 40.0}, {}, 0.2)
    assert noise_warnings(crowded, None, 0.001, 0.002) == [
        "the backend's threads waited 40.0 % of the phase for a core while other processes used 45.0 % of the CPU"
    ]
    # A phase too short for /proc/stat's ticks: the shares are shown and warn nothing, and the console says that
    # every figure of the run, efficiency included, is unjudged rather than clean.
    short = NoiseStats(30.0, 45.0, False, {"backend": 40.0}, {}, 0.2, short_phase_note(2))
    assert noise_warnings(short, None, 0.001, 0.002) == []
    row = noise_columns(short, None, 0.001, 0.002)
    assert "too short to judge the machine's noise: a phase of 2 CPU ticks" in noise_lines(row)[0]
    assert "run longer (--duration_s)" in noise_lines(row)[0]
    ceiling = {"ceiling_throughput": 100.0, "ceiling_concurrency": 1, "efficiency": 0.5, "efficiency_low": 0.49}
    ceiling |= {"efficiency_high": 0.51, "ceiling_spread_pct": 1.0}
    ceiling |= {"ceiling_before_throughput": 100.0, "ceiling_after_throughput": 99.0}
    cfg = make_config(["--device", "cpu"])
    assert "unjudged" in " ".join(_ceiling_lines(cfg, {**ceiling, **row}))
    assert "unjudged" not in " ".join(_ceiling_lines(cfg, {**ceiling, **noise_columns(own, None, 0.001, 0.002)}))


def test_a_design_whose_threads_exceed_the_cores_others_left_is_called_oversubscribed() -> None:
    """Threads x forwards at once against the cores other processes left free: named, whichever design it is."""
    busy = {"intra_op_threads": 2, "other_cpu_pct": 45.0, "noise_note": ""}
    serial = make_config(["--device", "cpu", "--design", "serial"])
    [line] = _oversubscribed(serial, busy, cores=2)
    assert "oversubscribed: 2 intra-op thread(s) x 1 forward(s) at once want 2 cores" in line
    assert "about 1.1 of 2 free" in line
    pipelined = make_config(["--device", "cpu", "--design", "pipelined", "--num_workers", "2"])
    assert "1 intra-op thread(s) x 2 forward(s)" in _oversubscribed(pipelined, {**busy, "intra_op_threads": 1}, 2)[0]
    assert _oversubscribed(serial, {**busy, "other_cpu_pct": 2.0}, cores=2) == []  # a quiet machine: the design's own
    assert _oversubscribed(serial, busy, cores=8) == []  # enough cores left
    assert _oversubscribed(serial, {**busy, "noise_note": short_phase_note(3)}, cores=2) == []  # unjudged


def _record(request_id: int, due_ns: int | None, start_ns: int, warmup: bool = False) -> RequestRecord:
    return timed_record(request_id, (start_ns,) * 6, warmup=warmup, send_start_ns=start_ns, due_ns=due_ns)


def test_sender_lateness_and_its_warning() -> None:
    records = [_record(i, 1_000_000 * i, 1_000_000 * i + 100_000 * (i % 2)) for i in range(1, 101)]
    records += [_record(0, 0, 50_000_000, warmup=True), _record(200, None, 5)]  # warm-up and burst: not counted
    lateness = sender_lateness(records)
    assert lateness.max_ms == pytest.approx(0.1) and lateness.p99_ms == pytest.approx(0.1)
    assert lateness.p50_ms == pytest.approx(0.05)
    assert sender_lateness([_record(1, None, 5)]) is None
    # 0.1 ms late at p99 is a tenth of a 1 ms latency: warned above that, not below.
    assert noise_warnings(None, lateness, 0.0009, None) and not noise_warnings(None, lateness, 0.0011, None)
    assert noise_warnings(None, Lateness(0.0, 0.0, 0.0), 0.001, None) == []


def test_without_proc_the_figures_are_empty_with_a_note(tmp_path: Path) -> None:
    meter = NoiseMeter(proc=tmp_path / "no-proc")
    assert meter.stop() is None  # the measured phase never started
    meter.start([os.getpid()])
    stats = meter.stop()
    assert stats.cpu_steal_pct is None and stats.runqueue_wait_pct == {} and "no /proc" in stats.note
    assert stats.max_stall_ms is not None and stats.max_stall_ms >= 0
    row = noise_columns(stats, None, None, None)
    assert row["cpu_steal_pct"] is None and row["noise_warning"] == "" and "no /proc" in row["noise_note"]


HOG = "import time\nend = time.monotonic() + 120\nwhile time.monotonic() < end:\n    pass\n"
# One request at a time through one forward thread of resnet18 (about 10 ms of one core each): the backend's thread
# is busy most of the phase, so a process beside it on its core takes its turns (a model that sleeps in between,
# as the identity model nearly does, wins the core back at each wake-up and waits little).
# A forward that holds its core for 20 ms, as compute does (a model to build would only add its seconds)
ON_ONE_CORE = [*TINY, "--model", "identity", "--planted_delay_us", "20000", "--design", "serial", "--no-ceiling"]
ON_ONE_CORE += ["--duration_s", "1.5", "--load", "closed", "--concurrency", "1", "--intra_op_threads", "1"]
ON_ONE_CORE += ["--warmup_iters", "10"]  # the hogs start at the first warm-up answer: spinning before the phase


@contextlib.contextmanager
def on_cpus(cpus: set[int]):
    """This process on `cpus` for the block: what it starts meanwhile inherits them (as every process and thread
    that process starts does)."""
    own = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, own)


def idlest_cpu(cpus: list[int], over_s: float = 0.5) -> int:
    """The CPU of `cpus` that was idle the most over the next over_s (/proc/stat's cpuN lines): the one a process
    spinning elsewhere (CI's condition) is not on."""

    def idle_and_total() -> dict[int, tuple[int, int]]:
        ticks = {}
        for line in Path("/proc/stat").read_text().splitlines():
            name, *values = line.split()
            if name.startswith("cpu") and name[3:].isdigit():
                counts = [int(v) for v in values[:8]]
                ticks[int(name[3:])] = (counts[3] + counts[4], sum(counts))
        return ticks

    before = idle_and_total()
    time.sleep(over_s)
    after = idle_and_total()
    return max(cpus, key=lambda cpu: (after[cpu][0] - before[cpu][0]) / max(1, after[cpu][1] - before[cpu][1]))


def start_hogs(cpus: list[int]) -> list[subprocess.Popen]:
    """A process spinning on each of `cpus` (a CPU twice, two of them), each in a session of its own: with
    autogroup scheduling (sched_autogroup_enabled) a core is shared between sessions, so hogs in one session
    would take one share between them, however many they are."""
    hogs = []
    for cpu in cpus:
        with on_cpus({cpu}):
            hogs.append(subprocess.Popen([sys.executable, "-c", HOG], start_new_session=True))
        register_session(hogs[-1].pid)
    return hogs


@pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or not Path("/proc/stat").exists(),
    reason="needs Linux's /proc and sched_setaffinity, to put the run and the hogs on one core",
)
def test_cpu_hogs_on_the_runs_core_are_named_against_the_run_alone_there(tmp_path: Path) -> None:
    """The run pinned to one core (the idlest), once alone there and once with two busy processes pinned to the
    same core and one on every other core, started here: the contrast is made, whatever else the machine runs.
    Beside the hogs the backend's run-queue wait rises far above its own, other processes' CPU holds the hogs'
    share, and the summary warns."""
    usable = sorted(os.sched_getaffinity(0))
    all_cpus = sum(1 for line in Path("/proc/stat").read_text().splitlines() if re.match(r"cpu\d+ ", line))
    core = idlest_cpu(usable)
    with on_cpus({core}):  # the server and its children on `core`; this process back on its own to wait
        quiet = start_server(ON_ONE_CORE, tmp_path / "quiet")
    _, quiet_stderr = quiet.communicate(timeout=120)
    with on_cpus({core}):
        loaded = start_server(ON_ONE_CORE, tmp_path / "loaded")
    read_log_until(loaded, lambda text: "warm-up response" in text, limit_s=120)
    hogs = start_hogs([core, core, *(cpu for cpu in usable if cpu != core)])
    try:
        loaded_stdout, loaded_stderr = loaded.communicate(timeout=120)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait(timeout=10)
    assert quiet.returncode == 0 and loaded.returncode == 0, quiet_stderr[-2000:] + loaded_stderr[-2000:]
    [quiet_row] = read_rows(tmp_path / "quiet" / "out.csv")
    [loaded_row] = read_rows(tmp_path / "loaded" / "out.csv")
    # Two hogs on its core leave the forward's thread a third of it while it runs: it waited 74 to 75 % of the
    # phase for the core, against 1 to 2 % alone there (its own frontend on the same core; three runs each, the
    # planted 20 ms forward). With resnet18's forward: 72 to 73 % against 7 %, and 36 % when another process came
    # onto that core too.
    quiet_wait_pct = float(quiet_row["runqueue_wait_pct_backend"])
    loaded_wait_pct = float(loaded_row["runqueue_wait_pct_backend"])
    assert loaded_wait_pct > 40 and loaded_wait_pct > quiet_wait_pct + 20, (quiet_wait_pct, loaded_wait_pct)
    # The hogs held every other usable core and at least half of the run's: other processes' CPU, of all CPUs.
    hogs_pct = 100 * (len(usable) - 0.5) / all_cpus
    assert float(loaded_row["other_cpu_pct"]) > 0.9 * hogs_pct, (loaded_row["other_cpu_pct"], hogs_pct)
    assert "backend's threads waited" in loaded_row["noise_warning"]
    assert "the machine may have made these numbers" in loaded_stdout


def test_a_window_is_noisy_when_the_host_stole_or_others_took_the_cpu(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    me, parent = os.getpid(), os.getppid()  # the frontend, and the server it counts as the benchmark's too
    write_proc(
        proc, dict(user=0, system=0, idle=0, iowait=0, steal=0), {me: {me: (0, 0, 0)}, parent: {parent: (0, 0, 0)}}
    )
    meter = NoiseMeter(proc=proc)
    meter.start([])
    # 200 ticks: 20 stolen, 80 idle, 100 busy of which the benchmark ran 0.3 s (30 ticks): others 35 %.
    write_proc(
        proc,
        dict(user=90, system=10, idle=70, iowait=10, steal=20),
        {me: {me: (300_000_000, 0, 0)}, parent: {parent: (0, 0, 0)}},
    )
    reason = meter.window_noise(p99_latency_s=10.0)
    assert reason == "steal 10.0 %, other processes 35 % of the CPU"
    # The next window: nothing more happened but 200 idle ticks: clean.
    write_proc(
        proc,
        dict(user=90, system=10, idle=270, iowait=10, steal=20),
        {me: {me: (300_000_000, 0, 0)}, parent: {parent: (0, 0, 0)}},
    )
    assert meter.window_noise(p99_latency_s=10.0) == ""
    meter.stop()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")
def test_the_senders_timer_slack_is_tightened_on_its_own_thread_only() -> None:
    import ctypes
    import threading

    from serverbench.launch.procutil import SENDER_TIMER_SLACK_NS, tighten_timer_slack

    get_slack = ctypes.CDLL(None).prctl  # PR_GET_TIMERSLACK is 30
    seen: dict[str, int] = {}

    def sender() -> None:
        seen["ok"] = tighten_timer_slack()
        seen["slack"] = get_slack(30, 0, 0, 0, 0)

    thread = threading.Thread(target=sender)
    thread.start()
    thread.join(timeout=10)
    assert seen == {"ok": True, "slack": SENDER_TIMER_SLACK_NS}
    assert get_slack(30, 0, 0, 0, 0) != SENDER_TIMER_SLACK_NS  # this thread keeps the default (50 us)
    assert tighten_timer_slack(libc_path="/no/such/libc.so") is False
