"""The peers a user compares against: tools/peers.sh makes Triton-through-PyTriton's environment (as CI does, with the
same script; a machine where it cannot be made fails here with the script's reason, it is never skipped), once per
machine in a cache that another checkout reaches through a symlink without installing anything; bench.peers serves
the identity through PyTriton on loopback and our generator (server.py --target) drives it for a few seconds into ok
rows, Triton and its stub gone and its workspace removed after; the script's and bench.peers' refusals are one line
before anything starts; and bench.peers' report reads known rows into the right generator-bound marks, target
verdicts, agreement counts and failures."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import pytest
from conftest import ROOT, pids_running, run_command

from bench import peers
from bench import perf_analyzer as pa
from bench.study import build_parser
from serverbench.launch.study import LoadPoint, Runner

SETUP_TIMEOUT_S = 1500  # the first time: a venv, PyTriton and torch with its CUDA libraries from the package index
SETUP = ROOT / "tools" / "peers.sh"


def run_setup(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(SETUP), *args], cwd=ROOT, capture_output=True, text=True, timeout=SETUP_TIMEOUT_S, env=env
    )


def ensure_pytriton() -> None:
    made = run_setup("pytriton")
    if made.returncode != 0:
        pytest.fail(f"tools/peers.sh pytriton could not make PyTriton's environment: {made.stderr.strip()}")
    assert (ROOT / ".tools" / "peers" / "pytriton").is_symlink()  # to the machine's cache, not made in the checkout


@pytest.mark.timeout(SETUP_TIMEOUT_S + 200)  # the suite's 300 s is per test; the first set-up may take minutes
def test_pytriton_serves_identity_to_our_generator(tmp_path: Path) -> None:
    ensure_pytriton()
    workspaces = set(Path(tempfile.gettempdir()).glob("pytriton-*"))
    out = tmp_path / "out"
    argv = ["--out", str(out), "--models", "identity", "--peers", "pytriton", "--clients", "ours"]  # no echo
    argv += ["--concurrency", "2", "--rate_fractions", "--duration_s", "2"]
    ran = run_command([sys.executable, "-m", "bench.peers", *argv], timeout_s=240)
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    assert pids_running(str(out)) == []  # tritonserver and the stub went with it
    assert set(Path(tempfile.gettempdir()).glob("pytriton-*")) <= workspaces  # its workspace removed as it ended
    log = (out / "logs" / "served_identity_pytriton_closed_r0.log").read_text()
    assert "tritonserver" in log  # Triton's own server answered, not a stand-in
    runs = pd.read_csv(out / "runs.csv").set_index("experiment")
    assert (runs["status"] == "ok").all() and list(runs.index) == ["identity_pytriton_ours"]
    assert runs.loc["identity_pytriton_ours", "door_requests"] >= 100  # Triton's statistics, read around the run
    assert "nvidia-pytriton==" in runs.loc["identity_pytriton_ours", "peer_environment"]  # what served it
    row = pd.read_csv(out / "ours.csv").set_index("experiment").loc["identity_pytriton_ours"]
    assert row["status"] == "ok" and row["target"].startswith("http://127.0.0.1:")
    assert row["responses_received"] == row["requests_sent"] >= 100
    assert row["duration_s"] >= 2.0  # --duration_s 2: the measured phase lasted at least that
    assert 0 < row["p50_latency_s"] <= row["p99_latency_s"] < 1.0
    assert pd.isna(row["mean_predict_ms"])  # someone else's server: no stage figures of ours


def links(folder: Path) -> dict[str, str]:
    """What a folder holds: each name with its symlink's target ("" for a file or folder)."""
    return {p.name: os.readlink(p) if p.is_symlink() else "" for p in folder.glob("*")} if folder.exists() else {}


@pytest.mark.parametrize(
    "args, env, status, said",
    [
        (["bogus"], {}, 2, "unknown argument 'bogus'"),
        (["--python"], {}, 2, "--python needs an interpreter"),
        (["--python=", "pytriton"], {}, 2, "--python= needs an interpreter"),  # was ignored: the default taken
        (["--python", "/nonexistent/python3.12", "pytriton"], {}, 1, "does not start"),
        (["pytriton"], {"PYTRITON_PYTHON": "python3.11"}, 1, "needs Python 3.12 or 3.13"),
        (["kserve"], {"KSERVE_PYTHON": "/nonexistent/python3"}, 1, "does not start"),
    ],
)
def test_setup_refuses_in_one_line(
    args: list[str], env: dict[str, str], status: int, said: str, tmp_path: Path
) -> None:
    before = links(ROOT / ".tools" / "peers")
    cache = tmp_path / "cache"
    made = run_setup(*args, env={**os.environ, **env, "SERVERBENCH_TOOLS": str(cache)})
    assert made.returncode == status
    assert made.stderr.count("\n") == 1 and made.stderr.startswith("tools/peers.sh: ") and said in made.stderr
    assert links(ROOT / ".tools" / "peers") == before  # nothing made, removed or relinked in the checkout
    assert not cache.exists()  # nor in the cache


FAKE_PYTHON = """#!/bin/sh
# Stands in for a Python 3.12 with a shared libpython: answers tools/peers.sh's two questions, runs nothing else.
case "$2" in
    *sysconfig*) echo /bin/sh ;;
    *version_info*) echo 3.12 ;;
    *) echo "fake python cannot run $*" >&2; exit 1 ;;
esac
"""


def script_value(script: Path, name: str) -> str:
    """A variable's value as the script sets it (its own assignment lines, evaluated by sh)."""
    lines = "\n".join(line for line in script.read_text().splitlines() if line.startswith(f"{name}="))
    return subprocess.run(["sh", "-c", f'{lines}\nprintf "%s" "${name}"'], capture_output=True, text=True).stdout


def cache_key(stamp_text: str) -> str:
    """The scripts' key for a stamp: cksum of its line."""
    return subprocess.run(["cksum"], input=stamp_text + "\n", capture_output=True, text=True).stdout.split()[0]


def tree(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_mtime_ns, p.stat().st_ino) for p in folder.rglob("*")}


@pytest.mark.parametrize("before", ["none", "stale symlink", "folder of its own", "half-made in the cache"])
def test_a_second_checkout_takes_the_cache_through_a_symlink(tmp_path: Path, before: str) -> None:
    """Another checkout with the machine's cache (here a fake, stamped environment) only links to it: no venv, no pip
    (the fake interpreter can run neither, and no index answers), in well under a second. A stale link or a folder of
    the checkout's own is replaced; an unstamped (half-made) environment in the cache is never taken."""
    checkout, cache = tmp_path / "checkout", tmp_path / "cache"
    (checkout / "tools").mkdir(parents=True)
    script = Path(shutil.copy(SETUP, checkout / "tools" / SETUP.name))
    python = tmp_path / "python3.12"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    stamp_text = f"{script_value(script, 'PYTRITON_PINS')} @ {python} 3.12"
    env_dir = cache / "peers" / f"pytriton-{cache_key(stamp_text)}"
    (env_dir / "bin").mkdir(parents=True)
    shutil.copy(python, env_dir / "bin" / "python")
    if before != "half-made in the cache":
        (env_dir / ".stamp").write_text(stamp_text + "\n")
    link = checkout / ".tools" / "peers" / "pytriton"
    link.parent.mkdir(parents=True)
    if before == "stale symlink":
        link.symlink_to(cache / "peers" / "pytriton-0")
    elif before == "folder of its own":
        (link / "bin").mkdir(parents=True)
    cached = tree(cache)
    env = {**os.environ, "SERVERBENCH_TOOLS": str(cache), "PIP_INDEX_URL": "http://127.0.0.1:9/simple"}
    argv = ["sh", str(script), "--python", str(python), "pytriton"]
    start_s = time.monotonic()
    made = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60, cwd="/")
    elapsed_s = time.monotonic() - start_s
    if before == "half-made in the cache":
        assert made.returncode == 1 and made.stderr.count("\n") == 1
        assert f"cannot make {env_dir} with {python}: fake python cannot run -m venv" in made.stderr
        assert not link.exists()
        return
    assert made.returncode == 0 and made.stderr == "", made.stderr
    assert "installing" not in made.stdout
    assert f"pytriton ready: .tools/peers/pytriton/bin/python ({stamp_text}; in {env_dir})" in made.stdout
    assert link.is_symlink() and os.readlink(link) == str(env_dir)
    assert (link / "bin" / "python").is_file()
    assert tree(cache) == cached  # the cache as it was: nothing installed, rewritten or locked
    assert elapsed_s < 2.0, f"linking to the cache took {elapsed_s:.2f} s"


def test_bench_peers_needs_the_environments_first(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(peers, "PEER_ENVS", tmp_path / "none")
    out = tmp_path / "out"
    assert peers.main(["--out", str(out), "--peers", "ours", "kserve", "--clients", "ours"]) == 2
    err = capsys.readouterr().err
    assert (
        err.strip() == "python -m bench.peers: error: kserve's environment is not made: run tools/peers.sh kserve "
        "first (once; minutes)"
    )
    assert not out.exists()


SLUGS = {"echo": "echo", "ours threaded": "ours-threaded", "ours serial": "ours-serial", "pytriton": "pytriton"}
SLUGS |= {"ours serial +batch": "ours-serial-batch", "kserve": "kserve"}
TAGS = {"ours": "ours", "perf_analyzer": "pa"}


def _line(model: str, peer: str, client: str, load: str, level: float, rps: float, p99_s: float, **extra) -> dict:
    """A row as the study writes it: the experiment names the model, the peer and the client."""
    line = {"experiment": f"{model}_{SLUGS[peer]}_{TAGS[client]}", "repeat": 0, "load": load, "status": "ok"}
    line |= {"error": "", "throughput_rps": rps, "p50_latency_s": p99_s / 2, "p99_latency_s": p99_s}
    line |= {"concurrency": level if load == "closed" else None}
    return {**line, "offered_rate_rps": level if load == "poisson" else None, **extra}


def report_of(lines: list[dict], out: Path, models: list[str]) -> str:
    args = argparse.Namespace(models=models, max_batch_size=16, max_queue_delay_ms=2.0, out=out)
    return "\n".join(peers.report(args, pd.DataFrame(lines), out))


def known_runs() -> list[dict]:
    """Capacity 4,000 req/s at c4 and 5,000 on a Poisson schedule (Poisson at 3,000 is generator-bound); identity at c4:
    ours threaded 1,500 at 4 ms against PyTriton 700 at 9 ms (target met); ours serial 2,500 (above half the
    capacity: generator-bound); perf_analyzer within 10 % of ours on PyTriton, 30 % off on ours threaded; resnet18:
    ours +batch peaks at 300 within 100 ms, PyTriton at 320 (not met)."""
    c, p = "closed", "poisson"
    return [
        _line("identity", "echo", "ours", c, 4, 4000, 0.002),
        _line("identity", "ours threaded", "ours", c, 4, 1500, 0.004),
        _line("identity", "ours threaded", "perf_analyzer", c, 4, 1520, 0.0052),
        _line("identity", "ours serial", "ours", c, 4, 2500, 0.003),
        _line("identity", "echo", "ours", p, 10000, 5000, 0.9),  # asked 10,000 on a schedule, sent 5,000
        _line("identity", "ours threaded", "ours", p, 3000, 2900, 0.2),  # asked above half of 5,000
        _line("identity", "ours threaded", "perf_analyzer", p, 3000, 3000, 0.002),
        _line("identity", "pytriton", "ours", c, 4, 700, 0.009),
        _line("identity", "pytriton", "perf_analyzer", c, 4, 720, 0.0095),
        _line("resnet18", "echo", "ours", c, 4, 3000, 0.002),
        _line("resnet18", "ours serial +batch", "ours", p, 300, 300, 0.080),
        _line("resnet18", "ours serial +batch", "ours", p, 400, 390, 0.300),
        _line("resnet18", "pytriton", "ours", p, 320, 320, 0.090),
        _line("resnet18", "kserve", "ours", c, 4, 100, 0.050),
    ]


def test_report_reads_known_runs(tmp_path: Path) -> None:
    server = {"server": "served_identity_pytriton_closed_r0", "model": "identity", "peer": "pytriton", "repeat": 0}
    server |= {
        "log": "logs/served_identity_pytriton_closed_r0.log",
        "status": "error",
        "error": "pytriton exit 3: boom",
    }
    pd.DataFrame([server]).to_csv(tmp_path / "servers.csv", index=False)
    text = report_of(known_runs(), tmp_path, ["identity", "resnet18"])
    assert not peers.target_met(argparse.Namespace(out=tmp_path), pd.DataFrame())  # the PyTriton server's failed stop
    assert "fastest of ours, ours serial, 2,500 req/s" in text and "**met**" in text
    assert "| ours serial | closed c4 | 2,500 (generator-bound) |" in text
    assert "| ours threaded | closed c4 | 1,500 | 2.00 | 4.00 | 4,000 | 1,520 |" in text
    assert "best of ours, ours serial +batch, 300; PyTriton 320; KServe (no batcher) 100 (ours/PyTriton 0.94)" in text
    assert "Target: at least PyTriton's: **not met**" in text
    assert (
        "| ours threaded | poisson 200% (3,000/s) | 2,900 (generator-bound) | 100.00 | 200.00 | 5,000 | 3,000 |" in text
    )
    assert "1 of 2 agree within 10 % on both req/s and p99 (1 generator-bound left out)" in text
    assert "  - identity: 1 of 2 agree; ours/perf_analyzer p99 median 0.86" in text
    assert "- identity r0 pytriton (served, logs/served_identity_pytriton_closed_r0.log): pytriton exit 3: boom" in text
    assert (tmp_path / "latency_throughput.png").stat().st_size > 10_000


def test_perf_analyzer_at_a_poisson_rate_and_its_late_share(tmp_path: Path) -> None:
    run = pa.PerfAnalyzerRun(
        "m", "127.0.0.1:1", tmp_path / "a.csv", tmp_path / "a.json", request_rate=250.5, max_threads=40
    )
    argv = run.command(Path("perf_analyzer"))
    rate = argv.index("--request-rate-range")
    assert argv[rate + 1] == "250.5:250.5" and "--concurrency-range" not in argv
    assert argv[argv.index("--request-distribution") + 1] == "poisson"
    assert argv[argv.index("--max-threads") + 1] == "40"
    warned = "  [WARNING] Perf Analyzer was not able to keep up with the desired request rate. 19.62% of the requests"
    assert pa.delayed_pct(f"Pass [1]\n{warned} were delayed. \nThroughput: 1") == 19.62
    assert pa.delayed_pct("Throughput: 4740.42 infer/sec") == 0.0
    with pytest.raises(ValueError):
        pa.PerfAnalyzerRun("m", "127.0.0.1:1", tmp_path / "a.csv", tmp_path / "a.json", request_rate=0.0)


def test_report_marks_late_senders_on_both_sides(tmp_path: Path) -> None:
    """Our sender late by 2 ms at p99 against a 1 ms p50 (above 10 %), perf_analyzer's requests 20 % delayed: both
    marked, and the pair left out of the count where both kept their schedule; on time, the pair counts."""
    p = "poisson"
    lines = [
        _line("identity", "echo", "ours", "closed", 4, 9000, 0.001),
        _line("identity", "echo", "ours", p, 20000, 9000, 0.5),
        _line("identity", "pytriton", "ours", "closed", 4, 3333.3, 0.002),
        _line("identity", "pytriton", "ours", p, 1000, 1000, 0.002, detail="late"),
        _line("identity", "pytriton", "perf_analyzer", p, 1000, 1000, 0.002, pa_delayed_pct=20.0),
        _line("identity", "kserve", "ours", "closed", 4, 1666.7, 0.004),
        _line("identity", "kserve", "ours", p, 500, 500, 0.004, detail="on_time"),
        _line("identity", "kserve", "perf_analyzer", p, 500, 500, 0.004, pa_delayed_pct=0.0),
    ]
    ours = {"run_id": ["late", "on_time"], "sender_late_p99_ms": [2.0, 0.01]}
    pd.DataFrame(ours).to_csv(tmp_path / "ours.csv", index=False)
    text = report_of(lines, tmp_path, ["identity"])
    assert (
        "| pytriton | poisson 30% (1,000/s) | 1,000 (sender late) | 1.00 | 2.00 | 9,000 | 1,000 (late 20 %) |" in text
    )
    assert "| kserve | poisson 30% (500/s) | 500 | 2.00 | 4.00 | 9,000 | 500 |" in text
    assert "2 of 2 agree within 10 % on both req/s and p99" in text
    assert "perf_analyzer's requests delayed at most 1 %): 1 of 1 agree" in text


def test_the_poisson_points_stay_where_their_rows_were_made(tmp_path: Path) -> None:
    """Phase 2's rates come from phase 1's peak; once Poisson rows exist, a higher peak found later (a failed
    closed-loop run that --retry_failed made ok) does not move them, so those rows keep counting."""
    args = build_parser(peers.STUDY).parse_args(
        ["--models", "identity", "--peers", "kserve", "--rate_fractions", "0.5"]
    )
    closed = _line("identity", "kserve", "ours", "closed", 4, 1000.0, 0.01) | {"batch_size": 1, "compile": False}
    rows = pd.DataFrame([closed])
    [first] = peers.poisson_cells(args, rows)
    assert first.load_point.value == 500.0
    made = _line("identity", "kserve", "ours", "poisson", 500.0, 490.0, 0.02) | {"batch_size": 1, "compile": False}
    retried = closed | {"concurrency": 16, "throughput_rps": 1600.0}
    [again] = peers.poisson_cells(args, pd.DataFrame([closed, made, retried]))
    assert again.key == first.key  # not 800 req/s: the row at 500 still counts for its cell


def test_perf_analyzer_at_several_images_per_request_is_counted_in_requests(tmp_path: Path, monkeypatch) -> None:
    """perf_analyzer counts inferences (requests x batch): a row's throughput_rps is requests/s, as our generator's."""
    args = build_parser(peers.STUDY).parse_args(["--out", str(tmp_path), "--batch_size", "32", "--batching", "off"])
    (tmp_path / "study_args.json").write_text(
        json.dumps({k: str(v) if k == "out" else v for k, v in vars(args).items()})
    )
    seen: list[pa.PerfAnalyzerRun] = []

    def measured(run: pa.PerfAnalyzerRun) -> pa.PerfAnalyzerResult:
        seen.append(run)
        figures = dict.fromkeys(f.name for f in dataclasses.fields(pa.PerfAnalyzerResult))
        return pa.PerfAnalyzerResult(
            **{**figures, "ok": True, "error": "", "throughput_per_s": 640.0, "stdout": "", "command": ("pa",)}
        )

    monkeypatch.setenv(pa.GRPC_SHARE_ENV, "5")  # measure_pa sets it when unset: not for the tests after this one
    monkeypatch.setattr(pa, "run_perf_analyzer", measured)
    monkeypatch.setattr(pa, "perf_analyzer_version", lambda: "test")
    monkeypatch.setattr(peers, "door_statistics", lambda *_: None)
    cell = peers.cell_of(args, "identity", peers.Peer("ours", "serial"), "perf_analyzer", LoadPoint("closed", 2), 0)
    runner = Runner("test", tmp_path, timeout_s=42.0)
    row = cell.experiment.measure(cell, runner, ("--target", "http://127.0.0.1:1"))
    assert seen[0].batch_size == 32 and row["throughput_rps"] == 20.0
    assert seen[0].timeout_s == 42.0  # --cell_timeout_s, as every run's (it was a fixed 300 s)

    def failed(run: pa.PerfAnalyzerRun) -> pa.PerfAnalyzerResult:  # no figure: its row said TypeError instead
        figures = dict.fromkeys(f.name for f in dataclasses.fields(pa.PerfAnalyzerResult))
        why = "Failed to obtain stable measurement within 3 measurement windows"
        return pa.PerfAnalyzerResult(**{**figures, "ok": False, "error": why, "stdout": "", "command": ("pa",)})

    monkeypatch.setattr(pa, "run_perf_analyzer", failed)
    row = cell.experiment.measure(cell, runner, ("--target", "http://127.0.0.1:1"))
    assert row["status"] == "error" and row["error"].startswith("Failed to obtain stable") and not row["throughput_rps"]


@pytest.mark.parametrize(
    "argv,said",
    [
        # its Poisson phase comes from our generator's closed-loop peak: it was silently empty, exit 0
        (["--peers", "ours", "--clients", "perf_analyzer", "--rate_fractions", "0.5"], "add ours to --clients"),
        # perf_analyzer drives neither: the folder was written with no row, then refused to the corrected command
        (["--peers", "shm", "echo", "--clients", "perf_analyzer", "--rate_fractions"], "give no run to make"),
    ],
)
def test_flags_that_would_measure_nothing_are_exit_2_with_nothing_written(
    tmp_path: Path, capsys, argv: list[str], said: str
) -> None:
    out = tmp_path / "out"
    try:
        status = peers.main(["--out", str(out), *argv])
    except SystemExit as exc:  # the parser's refusal
        status = exc.code
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1 and said in err and not out.exists(), err


def test_several_images_per_request_need_batching_off_and_our_peers_only(tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    assert peers.main(["--out", str(out), "--batch_size", "32", "--peers", "echo", "shm", "ours"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--batch_size 32 needs --batching off" in err and not out.exists()
    assert peers.main(["--out", str(out), "--batch_size", "32", "--batching", "off", "--peers", "kserve"]) == 2
    assert "no pytriton or kserve" in capsys.readouterr().err and not out.exists()
