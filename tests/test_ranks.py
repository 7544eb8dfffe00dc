"""Under torchrun: one frontend/backend pair per rank, rows gathered on rank 0, failures that end the job.

The merging is checked in-process on hand-made records; the job itself with torchrun's own launcher, two CPU
ranks and tiny images."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from conftest import TINY, ServerRun, live_processes_in_session, make_config, run_server, torchrun

from serverbench.launch.frontends import merged_report, shifted
from serverbench.launch.ranks import (
    RankInfo,
    RankOutcome,
    clock_offsets_ns,
    job_status,
    rank_from_env,
    slowest_rank,
)
from serverbench.records.summary import summarize
from serverbench.schema.messages import FrontendReport, RunResult
from serverbench.schema.records import RequestRecord
from tests.helpers import spread_record

TORCHRUN_ENV = {
    "RANK": "1",
    "WORLD_SIZE": "2",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29500",
}


def record(request_id: int, sent_ns: int, received_ns: int, warmup: bool = False) -> RequestRecord:
    return spread_record(request_id, sent_ns, received_ns, warmup=warmup, batch_size=4, copy_ms=(0.1, 0.2, 0.1))


def outcome(
    rank: int,
    status: str,
    records: list[RequestRecord],
    clock: str = "boot-a",
    barrier_ns: int = 0,
    throughput: float | None = None,
    error: str = "",
) -> RankOutcome:
    report = FrontendReport(records=records, requests_sent=sum(not r.warmup for r in records))
    return RankOutcome(
        RankInfo(rank, 2, rank, 2),
        {"throughput": throughput},
        RunResult(status=status, error=error, frontend=report),
        clock,
        barrier_ns,
    )


def test_rank_comes_from_torchruns_environment_only() -> None:
    assert rank_from_env(TORCHRUN_ENV) == RankInfo(rank=1, world_size=2, local_rank=1, local_world_size=2)
    assert rank_from_env({}) is None
    assert rank_from_env({k: v for k, v in TORCHRUN_ENV.items() if k != "MASTER_PORT"}) is None


def test_each_rank_gets_its_own_seed_and_device_and_conflicting_flags_are_refused(tmp_path: Path) -> None:
    from serverbench.config.flags import ConfigError

    def config(argv: list[str], rank: RankInfo):
        return make_config([*argv, "--results_dir", str(tmp_path)], rank)

    rank1 = RankInfo(1, 2, 1, 2)
    cfg = config(["--device", "cpu", "--seed", "7", "--inject_fault", "predict", "--inject_fault_rank", "0"], rank1)
    assert (cfg.device, cfg.seed, cfg.rank, cfg.inject_fault) == ("cpu", 8, rank1, None)
    assert (
        config(["--device", "cpu", "--inject_fault", "predict", "--inject_fault_rank", "1"], rank1).inject_fault
        == "predict"
    )
    with pytest.raises(ConfigError, match="cuda:LOCAL_RANK"):
        config(["--device", "cuda:0"], rank1)
    with pytest.raises(ConfigError, match="torchrun"):
        config(["--device", "cpu", "--find_peak", "--slo_ms", "100"], rank1)
    with pytest.raises(ConfigError, match="--stability_pct under torchrun"):
        config(["--device", "cpu", "--stability_pct", "5"], rank1)
    with pytest.raises(ConfigError, match="dist_timeout_s"):
        config(["--device", "cpu", "--dist_timeout_s", "0"], rank1)


def test_the_job_figures_are_those_of_every_rank_s_records_on_one_clock() -> None:
    ms = 1_000_000
    rank0 = [record(0, 0, 50 * ms, warmup=True), record(1, 100 * ms, 140 * ms), record(2, 110 * ms, 190 * ms)]
    rank1 = [record(0, 0, 60 * ms, warmup=True), record(1, 105 * ms, 150 * ms), record(2, 120 * ms, 230 * ms)]
    # Same machine: one clock, nothing moved. The job's window runs from the first send to the last answer.
    same = [outcome(0, "ok", rank0), outcome(1, "ok", rank1)]
    offsets = clock_offsets_ns(same)
    assert offsets == [0, 0]
    job = summarize(merged_report([o.result.frontend for o in same], offsets).records, requests_sent=4)
    assert job.throughput_samples_per_s == pytest.approx(4 * 4 / 0.130)
    assert job.latency.max_s == pytest.approx(0.110) and job.responses_received == 4

    # Another machine: its clock is unrelated, so it is aligned on the start barrier's release.
    other = [
        outcome(0, "ok", rank0, barrier_ns=90 * ms),
        outcome(1, "ok", rank1, clock="boot-b", barrier_ns=5_090 * ms),
    ]
    offsets = clock_offsets_ns(other)
    assert offsets == [0, -5_000 * ms]
    moved = shifted(record(1, 5_105 * ms, 5_150 * ms), offsets[1])
    assert (moved.sent_ns, moved.received_ns, moved.latency_s) == (105 * ms, 150 * ms, pytest.approx(0.045))


def test_the_job_fails_with_the_rank_that_failed_and_names_the_slowest() -> None:
    outcomes = [
        outcome(0, "aborted", [], throughput=None, error="stopped because another rank failed"),
        outcome(1, "error", [], throughput=None, error="InjectedFault: boom"),
    ]
    status, error = job_status(outcomes)
    assert status == "error" and error.startswith("rank 1: InjectedFault: boom")
    assert job_status([outcome(0, "ok", []), outcome(1, "ok", [])]) == ("ok", "")
    assert slowest_rank([outcome(0, "ok", [], throughput=900.0), outcome(1, "ok", [], throughput=450.0)]) == (1, 450.0)


JOB_LIMIT_S = 200  # a job of two CPU ranks: about 7 torch imports on 2 cores, well under a minute here


def run_job(args: list[str], results_dir: Path, nproc_per_node: int = 2) -> ServerRun:
    """The job under torchrun to its end within JOB_LIMIT_S (below pytest's 300 s), nothing left running."""
    run = run_server(args, results_dir, timeout_s=JOB_LIMIT_S, launcher=torchrun(nproc_per_node))
    assert not live_processes_in_session(run.session_id), "processes left behind"
    return run


def test_torchrun_writes_a_row_per_rank_and_a_job_row_whose_throughput_the_records_give(tmp_path: Path) -> None:
    run = run_job([*TINY, "--model", "identity", "--save_requests", "--save_pytorch_benchmark"], tmp_path)
    assert run.returncode == 0, run.stderr[-4000:]
    rows = run.rows
    # The benchmark records of every row, the job's included, told apart by their scope and rank.
    records = json.loads((tmp_path / "out.pytorch.json").read_text())
    throughput = {
        (r["benchmark"]["extra_info"]["scope"], r["benchmark"]["extra_info"]["rank"]): r["metric"]["benchmark_values"]
        for r in records
        if r["metric"]["name"] == "throughput"
    }
    assert throughput == {(row["scope"], row["rank"]): [float(row["throughput"])] for row in rows}
    assert [(r["scope"], r["rank"]) for r in rows] == [("rank", "0"), ("rank", "1"), ("job", "")]
    ranks, job = rows[:2], rows[2]
    assert all(r["status"] == "ok" for r in rows)
    assert [r["seed"] for r in ranks] == ["0", "1"] and job["world_size"] == "2" and job["nodes"] == "1"
    per_rank = [pd.read_csv(tmp_path / r["requests_file"]) for r in ranks]
    records = pd.concat(per_rank)
    measured = records[~records["warmup"]]
    assert len(measured) == 2 * 6 and int(job["responses_received"]) == 12
    window_s = (measured["received_ns"].max() - measured["sent_ns"].min()) / 1e9
    assert float(job["throughput"]) == pytest.approx(measured["batch_size"].sum() / window_s, rel=1e-9)
    latency_s = (measured["received_ns"] - measured["sent_ns"]) / 1e9
    assert float(job["p99_latency_s"]) == pytest.approx(latency_s.quantile(0.99), rel=1e-9)
    slowest = min(ranks, key=lambda r: float(r["throughput"]))
    assert job["slowest_rank"] == slowest["rank"]
    # Both measured windows start after both warm-ups: the start barrier.
    warm_ends = [r[r["warmup"]]["received_ns"].max() for r in per_rank]
    first_sends = [r[~r["warmup"]]["sent_ns"].min() for r in per_rank]
    assert min(first_sends) > max(warm_ends)


def test_a_rank_that_fails_ends_the_job_promptly_with_its_error(tmp_path: Path) -> None:
    """Rank 1 fails as its backend starts; rank 0 learns of it and stops, rather than waiting out
    --dist_timeout_s, which is set longer than the job may take (JOB_LIMIT_S): a job that waited cannot pass."""
    run = run_job(
        [
            *TINY,
            "--model",
            "identity",
            "--inject_fault",
            "backend_start",
            "--inject_fault_rank",
            "1",
            "--dist_timeout_s",
            str(JOB_LIMIT_S + 60),
        ],
        tmp_path,
    )
    assert run.returncode != 0
    rows = {(r["scope"], r["rank"]): r for r in run.rows}
    assert rows[("rank", "1")]["status"] == "error"
    assert rows[("rank", "0")]["status"] == "aborted" and "rank 1" in rows[("rank", "0")]["error"]
    job = rows[("job", "")]
    assert job["status"] == "error" and job["error"].startswith("rank 1: InjectedFault")
    assert "rank 1 (error): InjectedFault" in run.stderr  # torchrun's own summary names the rank


GPU_PHASE_S = 3.0  # 40 requests of resnet18 at batch 8 last milliseconds on an H100: a throughput of a few
# milliseconds is mostly its first and last request's timing; seconds of a closed loop hold still


@pytest.mark.cuda
def test_one_rank_on_a_gpu_gives_the_rows_of_a_plain_run(tmp_path: Path) -> None:
    args = ["--device", "cuda", "--image_size", "64", "--batch_size", "8", "--model", "resnet18"]
    args += ["--load", "closed", "--concurrency", "4", "--num_iters", "40", "--duration_s", str(GPU_PHASE_S)]
    plain = run_server(args, tmp_path / "plain")
    job = run_job(args, tmp_path / "job", nproc_per_node=1)
    assert plain.returncode == 0 and job.returncode == 0, plain.stderr[-3000:] + job.stderr[-3000:]
    rank, job_row = job.rows
    assert rank["device"] == plain.row["device"] == "cuda:0" and rank["seed"] == plain.row["seed"]
    assert rank["responses_received"] == job_row["responses_received"]
    assert int(plain.row["responses_received"]) >= 40 and int(rank["responses_received"]) >= 40
    assert float(job_row["throughput"]) == pytest.approx(float(rank["throughput"]), rel=1e-9)
    # Both measured phases lasted seconds (the count alone would end in milliseconds): throughputs to compare.
    # (The phase sends for GPU_PHASE_S from its start; its first send may come a little after that start.)
    assert min(float(rank["duration_s"]), float(plain.row["duration_s"])) >= 0.9 * GPU_PHASE_S
    assert float(rank["throughput"]) == pytest.approx(float(plain.row["throughput"]), rel=0.25)
