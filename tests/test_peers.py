"""The peers a user compares against: tools/peers.sh makes Triton-through-PyTriton's environment (as CI does, with the
same script; a machine where it cannot be made fails here with the script's reason, it is never skipped), once per
machine in a cache that another checkout reaches through a symlink without installing anything; PyTriton serves the
identity on loopback and our generator (server.py --target) drives it for a few seconds into an ok row; the
script's and bench.peers' refusals are one line before anything starts; and bench.peers' report reads a known
runs.csv into the right generator-bound marks, target verdicts, agreement counts and failures."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pandas as pd
import pytest
from conftest import ROOT

from bench import peers, peers_report
from bench import perf_analyzer as pa

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


@pytest.mark.timeout(SETUP_TIMEOUT_S + 120)  # the suite's 300 s is per test; the first set-up may take minutes
def test_pytriton_serves_identity_to_our_generator(tmp_path: Path) -> None:
    ensure_pytriton()
    args = peers.build_parser().parse_args(["--out", str(tmp_path), "--models", "identity", "--duration_s", "2"])
    settings = peers.settings_of(args)
    (tmp_path / peers.LOGS_DIR).mkdir()
    workspaces = set(Path(tempfile.gettempdir()).glob("pytriton-*"))
    running = peers.start_peer(settings, peers.Peer("pytriton", batching=True), "identity", tmp_path, "pytriton")
    assert not isinstance(running, str), running
    try:
        with open(running.log_path, encoding="utf-8") as log:
            assert "tritonserver" in log.read()  # Triton's own server answers, not a stand-in
        found = peers.run_ours(settings, running.url, "identity", "closed", 2, 0, "ours_c2", tmp_path)
    finally:
        stopped = peers.stop_peer(running)
    assert found["ok"], found["error"]
    assert stopped == ""
    with pytest.raises(ProcessLookupError):  # tritonserver and the stub went with it
        os.killpg(running.session.pid, 0)
    assert set(Path(tempfile.gettempdir()).glob("pytriton-*")) <= workspaces  # its workspace removed as it ended
    row = pd.read_csv(tmp_path / peers.OURS_CSV).iloc[-1]
    assert row["status"] == "ok" and row["target"] == running.url
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
        err.strip() == "python -m bench.peers: kserve's environment is not made: run tools/peers.sh kserve first "
        "(once; minutes)"
    )
    assert not out.exists()


def _line(model: str, peer: str, client: str, load: str, level: float, rps: float, p99_s: float, **extra) -> dict:
    kind = peer.split()[0] if peer != "echo" else "echo"
    line = {"model": model, "repeat": 0, "peer": peer, "kind": kind, "design": "", "batching": "+batch" in peer}
    line |= {"load": load, "client": client, "ok": True, "error": "", "throughput_rps": rps}
    line |= {"p50_latency_s": None if p99_s is None else p99_s / 2, "p99_latency_s": p99_s}
    line |= {"concurrency": level if load == "closed" else None, "rate_rps": level if load == "poisson" else None}
    return {**line, **extra}


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
        _line("identity", "pytriton", "server", c, 4, None, None, ok=False, error="pytriton exit 3: boom"),
        _line("resnet18", "echo", "ours", c, 4, 3000, 0.002),
        _line("resnet18", "ours serial +batch", "ours", p, 300, 300, 0.080),
        _line("resnet18", "ours serial +batch", "ours", p, 400, 390, 0.300),
        _line("resnet18", "pytriton", "ours", p, 320, 320, 0.090),
        _line("resnet18", "kserve", "ours", c, 4, 100, 0.050),
    ]


def test_report_reads_known_runs(tmp_path: Path) -> None:
    pd.DataFrame(known_runs(), columns=peers.FIELDS).to_csv(tmp_path / peers.RUNS_CSV, index=False)
    settings = {"models": ["identity", "resnet18"]}
    meta = {"command": "python -m bench.peers", "commit": "abc", "date": "today", "cores": 2, "settings": settings}
    (tmp_path / peers.META_JSON).write_text(json.dumps({**meta, "perf_analyzer": "2.40.0"}))
    text, failed = peers_report.build_report(tmp_path)
    assert failed  # the PyTriton server's failed stop
    assert "fastest of ours, ours serial, 2,500 req/s" in text and "**met**" in text
    assert "| ours serial | closed c4 | 2,500 (generator-bound) |" in text
    assert "| ours threaded | closed c4 | 1,500 | 2.00 | 4.00 | 4,000 | 1,520 |" in text
    assert "best of ours, ours serial +batch, 300; PyTriton 320; KServe (no batcher) 100 (ours/PyTriton 0.94)" in text
    assert "Target: at least PyTriton's: **not met**" in text
    assert "| ours threaded | poisson 3,000/s | 2,900 (generator-bound) | 100.00 | 200.00 | 5,000 | 3,000 |" in text
    assert "1 of 2 agree within 10 % on both req/s and p99 (1 generator-bound left out)" in text
    assert "  - identity: 1 of 2 agree; ours/perf_analyzer p99 median 0.86" in text
    assert "- identity r0 pytriton: pytriton exit 3: boom" in text
    assert (tmp_path / peers_report.PLOT_PNG).stat().st_size > 10_000


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
        _line("identity", "pytriton", "ours", p, 1000, 1000, 0.002, detail="late", rate_fraction=0.3),
        _line("identity", "pytriton", "perf_analyzer", p, 1000, 1000, 0.002, rate_fraction=0.3, pa_delayed_pct=20.0),
        _line("identity", "kserve", "ours", p, 500, 500, 0.004, detail="on_time", rate_fraction=0.3),
        _line("identity", "kserve", "perf_analyzer", p, 500, 500, 0.004, rate_fraction=0.3, pa_delayed_pct=0.0),
    ]
    pd.DataFrame(lines, columns=peers.FIELDS).to_csv(tmp_path / peers.RUNS_CSV, index=False)
    ours = {"run_id": ["late", "on_time"], "sender_late_p99_ms": [2.0, 0.01]}
    pd.DataFrame(ours).to_csv(tmp_path / peers.OURS_CSV, index=False)
    meta = {"command": "c", "commit": "abc", "date": "d", "cores": 2, "settings": {"models": ["identity"]}}
    (tmp_path / peers.META_JSON).write_text(json.dumps({**meta, "perf_analyzer": "2.40.0"}))
    text, failed = peers_report.build_report(tmp_path)
    assert not failed
    assert (
        "| pytriton | poisson 30% (1,000/s) | 1,000 (sender late) | 1.00 | 2.00 | 9,000 | 1,000 (late 20 %) |" in text
    )
    assert "| kserve | poisson 30% (500/s) | 500 | 2.00 | 4.00 | 9,000 | 500 |" in text
    assert "2 of 2 agree within 10 %" in text and "perf_analyzer's requests delayed at most 1 %): 1 of 1 agree" in text
