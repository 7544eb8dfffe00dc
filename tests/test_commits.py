"""bench.commits: one server command at two commits, interleaved, each repeat's ratio."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import ROOT, TINY


def test_two_commits_run_interleaved_and_their_ratio_is_written(tmp_path: Path) -> None:
    out = tmp_path / "ab"
    command = [sys.executable, "-m", "bench.commits", "--base", "HEAD", "--head", "HEAD", "--repeats", "2"]
    command += ["--out", str(out), "--", *TINY, "--no-ceiling"]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = (out / "commits.md").read_text()
    assert text.count("\n| 0 |") == 1 and "\n| 1 |" in text and "median ratio" in text
    assert (
        len((out / "base.csv").read_text().splitlines()) == 3 and len((out / "head.csv").read_text().splitlines()) == 3
    )
    worktrees = subprocess.run(["git", "worktree", "list"], cwd=ROOT, capture_output=True, text=True).stdout
    assert "bench-commits-" not in worktrees  # the scratch checkouts are gone


def test_without_server_flags_it_refuses_in_one_line() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.commits", "--base", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2 and "server flags" in proc.stderr
