"""bench.commits: one server command at two commits, interleaved, each repeat's figures and the A/B verdict."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pytest
from conftest import ROOT, TINY, communicate_or_fail, start_session

from bench import commits


@dataclass(frozen=True)
class Invocation:
    out: Path  # its --out
    scratch: Path  # its TMPDIR: where its scratch worktrees are made
    returncode: int
    stderr: str


@pytest.fixture(scope="module")
def invocations(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Invocation]:
    """bench.commits twice, at once (each one's git checkouts and process start-ups fill the other's waits), both
    ended before this returns: "ok", HEAD against itself, 2 interleaved repeats of a tiny run; "failed", 1 repeat
    whose runs fail. Here each failing run's server process raises before it starts its own (exit 1, a traceback of
    its own, no row): a second each, where a run that fails in its forward first starts both processes (their
    torch imports: most of a run)."""
    flags = {"ok": ["--head", "HEAD", "--repeats", "2"], "failed": ["--repeats", "1"]}
    server_flags = {"ok": [*TINY, "--no-ceiling"], "failed": [*TINY, "--no-ceiling", "--inject_fault", "server"]}
    folders = {name: tmp_path_factory.mktemp(name) for name in flags}
    procs = {}
    for name, folder in folders.items():
        (folder / "tmp").mkdir()
        command = [sys.executable, "-m", "bench.commits", "--base", "HEAD", *flags[name], "--out", str(folder / "o")]
        procs[name] = start_session([*command, "--", *server_flags[name]], ROOT, {"TMPDIR": str(folder / "tmp")})
    found, deadline = {}, time.monotonic() + 240  # both within pytest's 300 s
    for name, proc in procs.items():
        _, stderr = communicate_or_fail(proc, max(1.0, deadline - time.monotonic()), f"bench.commits ({name})")
        found[name] = Invocation(folders[name] / "o", folders[name] / "tmp", proc.returncode, stderr)
    return found


def test_two_commits_run_interleaved_and_their_ratio_is_written(invocations: dict[str, Invocation]) -> None:
    done = invocations["ok"]
    out, scratch = done.out, done.scratch
    assert done.returncode == 0, done.stderr[-3000:]
    text = (out / "commits.md").read_text()
    assert text.count("\n| 0 |") == 1 and "\n| 1 |" in text
    # the same commit twice: whichever way the 2 pairs fell, the verdict is the A/B method's, in words
    verdict = text.strip().splitlines()[-1]
    assert re.fullmatch(
        r"(cannot tell HEAD \(\w{12}\) and HEAD \(\w{12}\) apart at this noise|HEAD \(\w{12}\) is \d+\.\d % "
        r"(slower|faster) than HEAD \(\w{12}\)) \(throughput per machine speed \(each run's over its speed probe\) "
        r"HEAD \(\w{12}\)/HEAD \(\w{12}\) \d+\.\d{3}, "
        r"95 % interval \d+\.\d{3} to \d+\.\d{3}, 2 pairs\).*",
        verdict,
    ), verdict
    assert (
        len((out / "base.csv").read_text().splitlines()) == 3 and len((out / "head.csv").read_text().splitlines()) == 3
    )
    # The scratch checkouts are gone, from the repository and the disk (this run's only: others may be running).
    assert [line for line in _worktrees().splitlines() if line.startswith(str(scratch))] == []
    assert list(scratch.glob("bench-commits-*")) == []


def test_report_only_reports_the_commits_its_rows_ran_after_the_names_have_moved(
    invocations: dict[str, Invocation], tmp_path: Path, capsys
) -> None:
    """--base HEAD measured at one commit and re-rendered after HEAD moved: the rows' commits, not the new HEAD's
    (which has no rows: every repeat showed failed, and no verdict)."""
    out = tmp_path / "o"
    shutil.copytree(invocations["ok"].out, out)
    rows = pd.read_csv(out / "runs.csv")
    moved = "0" * 40  # the commit the rows ran, as if HEAD had moved on since
    rows["experiment"] = rows["experiment"].str.replace(r"-\w{40}$", f"-{moved}", regex=True)
    rows.to_csv(out / "runs.csv", index=False)
    assert commits.main(["--base", "HEAD", "--out", str(out), "--report_only"]) == 0
    text = (out / "commits.md").read_text()
    assert f"HEAD ({moved[:12]}) against HEAD ({moved[:12]})" in text and "failed" not in text, text
    capsys.readouterr()


def test_a_failed_run_is_shown_as_failed_and_the_exit_status_is_1(
    invocations: dict[str, Invocation], tmp_path: Path
) -> None:
    """A run without its figure is a row of the table without a ratio (the "failed" invocation); a row that says
    a run failed is no figure either (figured, on rows as server.py writes them)."""
    done = invocations["failed"]
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    text = (done.out / "commits.md").read_text()
    assert "\n| 0 | failed | failed |" in text and "no verdict" in text and "failed: repeat 0 base" in text

    rows = pd.DataFrame(
        {"status": ["ok", "error", "ok"], "repeat": [0, 1, 2], "achieved_rate_rps": [100.0, 50.0, None]}
    )
    assert commits.figured(rows, "achieved_rate_rps") == {0: 100.0}  # a failed run's figure, or none, is no figure


# -------------------------------------------------- bad arguments (issue 39; Ctrl-C and SIGTERM: test_bench_interrupts)

ARGS = ["--base", "HEAD", "--repeats", "1"]
FLAGS = ["--", "--device", "cpu", "--model", "identity", "--image_size", "16", "--num_iters", "2", "--no-ceiling"]
OUT = ["--out", "{tmp}/o"]
BAD = {  # argv -> the fragment of the one line: each refused before any worktree or server run, nothing written
    "no such commit": (
        ["--base", "0123456789abcdef", "--repeats", "1", *OUT, *FLAGS],
        "--base 0123456789abcdef: no such commit",
    ),
    "no such head": ([*ARGS, "--head", "no-such-branch", *OUT, *FLAGS], "--head no-such-branch: no such commit"),
    "out a file": ([*ARGS, "--out", "{tmp}/afile", *FLAGS], "--out {tmp}/afile: a file, not a folder"),
    "out a file, no --": ([*ARGS, "--out", "{tmp}/afile"], "--out {tmp}/afile: a file, not a folder"),
    "out under /proc": ([*ARGS, "--out", "/proc/x", *FLAGS], "kernel filesystem"),
    "repeats too many": (["--base", "HEAD", "--repeats", "1000000000", *OUT, *FLAGS], "between 1 and 10000"),
    "repeats 0": (["--base", "HEAD", "--repeats", "0", *OUT, *FLAGS], "between 1 and 10000"),
    "negative timeout": ([*ARGS, "--cell_timeout_s", "-1", *OUT, *FLAGS], "--cell_timeout_s: -1"),
    "no such column": ([*ARGS, "--column", "nosuchcol", *OUT, *FLAGS], "--column nosuchcol: not a column"),
    "a text column": ([*ARGS, "--column", "model", *OUT, *FLAGS], "--column model: text, not a figure"),
    "a column with no better side": (
        [*ARGS, "--column", "padding_pct", *OUT, *FLAGS],
        "--column padding_pct: %, neither a rate nor a time",
    ),
    "no server flags": ([*ARGS, *OUT], "give the server.py flags after --"),
    "bad server flags": ([*ARGS, *OUT, *FLAGS, "--batch_size", "0"], "--batch_size 0: must be at least 1"),
    "unknown server flag": ([*ARGS, *OUT, *FLAGS, "--no_such_flag"], "--no_such_flag"),
    # each run served until its timeout (600 s), then was reported "exit 0, timed out"
    "a run that never ends": (
        [*ARGS, *OUT, *FLAGS, "--transport", "http", "--serve_only"],
        "--serve_only serves until it is stopped",
    ),
}


def _worktrees() -> str:
    return subprocess.run(["git", "worktree", "list"], cwd=ROOT, capture_output=True, text=True, timeout=60).stdout


@pytest.mark.parametrize("argv,expected", BAD.values(), ids=BAD.keys())
def test_bad_arguments_are_one_line_and_exit_2_before_any_run(
    tmp_path: Path, capsys, argv: list[str], expected: str
) -> None:
    (tmp_path / "afile").write_text("not a folder\n")
    before, trees = set(tmp_path.rglob("*")), _worktrees()
    try:
        status = commits.main([arg.replace("{tmp}", str(tmp_path)) for arg in argv])
    except SystemExit as exc:  # argparse's refusal
        status = exc.code
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2, err
    assert len(err) == 1 and err[0].startswith("python -m bench.commits: error: "), err
    assert expected.replace("{tmp}", str(tmp_path)) in err[0], err
    assert set(tmp_path.rglob("*")) == before and _worktrees() == trees
