"""bench.commits: one server command at two commits, interleaved, each repeat's figures and the A/B verdict."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, TINY

from bench import commits


def test_two_commits_run_interleaved_and_their_ratio_is_written(tmp_path: Path) -> None:
    out = tmp_path / "ab"
    command = [sys.executable, "-m", "bench.commits", "--base", "HEAD", "--head", "HEAD", "--repeats", "2"]
    command += ["--out", str(out), "--", *TINY, "--no-ceiling"]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = (out / "commits.md").read_text()
    assert text.count("\n| 0 |") == 1 and "\n| 1 |" in text
    # the same commit twice: whichever way the 2 pairs fell, the verdict is the A/B method's, in words
    verdict = text.strip().splitlines()[-1]
    assert re.fullmatch(
        r"(cannot tell HEAD \(\w{12}\) and HEAD \(\w{12}\) apart at this noise|HEAD \(\w{12}\) is \d+\.\d % "
        r"(slower|faster) than HEAD \(\w{12}\)) \(achieved_rate_rps "
        r"HEAD \(\w{12}\)/HEAD \(\w{12}\) \d+\.\d{3}, "
        r"95 % interval \d+\.\d{3} to \d+\.\d{3}, 2 pairs\).*",
        verdict,
    ), verdict
    assert (
        len((out / "base.csv").read_text().splitlines()) == 3 and len((out / "head.csv").read_text().splitlines()) == 3
    )
    worktrees = subprocess.run(["git", "worktree", "list"], cwd=ROOT, capture_output=True, text=True, timeout=60).stdout
    assert "bench-commits-" not in worktrees  # the scratch checkouts are gone


def test_a_failed_run_is_shown_as_failed_and_the_exit_status_is_1(tmp_path: Path) -> None:
    """A run without its figure (here each fails in its forward) is a row of the table without a ratio."""
    command = [sys.executable, "-m", "bench.commits", "--base", "HEAD", "--repeats", "1", "--out", str(tmp_path)]
    command += ["--", *TINY, "--no-ceiling", "--inject_fault", "predict"]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    text = (tmp_path / "commits.md").read_text()
    assert "\n| 0 | failed | failed |" in text and "no verdict" in text and "failed: repeat 0 base" in text


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
    "negative timeout": ([*ARGS, "--timeout_s", "-1", *OUT, *FLAGS], "--timeout_s: -1"),
    "no such column": ([*ARGS, "--column", "nosuchcol", *OUT, *FLAGS], "--column nosuchcol: not a column"),
    "a text column": ([*ARGS, "--column", "model", *OUT, *FLAGS], "--column model: text, not a figure"),
    "a column with no better side": (
        [*ARGS, "--column", "padding_pct", *OUT, *FLAGS],
        "--column padding_pct: %, neither a rate nor a time",
    ),
    "no server flags": ([*ARGS, *OUT], "give the server.py flags after --"),
    "bad server flags": ([*ARGS, *OUT, *FLAGS, "--batch_size", "0"], "--batch_size 0: must be at least 1"),
    "unknown server flag": ([*ARGS, *OUT, *FLAGS, "--no_such_flag"], "--no_such_flag"),
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
