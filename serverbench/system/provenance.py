"""What produced a row, besides the run's configuration: the checkout's commit and whether its code differed from
it, and the CPU's model. Read once by the server as a run starts (the code that runs is the code of that moment),
bounded in time: a checkout without git, or a git that hangs, leaves the figure empty, never the run waiting."""

from __future__ import annotations

import platform
import subprocess
from dataclasses import dataclass
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[2]  # the folder holding server.py and serverbench/
GIT_TIMEOUT_S = 5.0
# The code a run executes: a difference in these files makes the tree "dirty"; results and notes do not.
CODE_PATHSPEC = ("*.py", "*.sh", "pyproject.toml")


@dataclass(frozen=True)
class Provenance:
    commit: str | None  # the checkout's HEAD; None outside a git checkout
    code_dirty: bool | None  # a code file differs from the commit (edited, or new and untracked)
    cpu_model: str


def _git(*args: str) -> str | None:
    try:
        found = subprocess.run(
            ["git", "-C", str(CHECKOUT), *args], capture_output=True, text=True, timeout=GIT_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return found.stdout if found.returncode == 0 else None


def cpu_model() -> str:
    """The CPU's model name as /proc/cpuinfo gives it (Linux), else what the platform says."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def read_provenance() -> Provenance:
    head = _git("rev-parse", "HEAD")
    commit = head.strip() if head else None
    changes = _git("status", "--porcelain", "--", *CODE_PATHSPEC) if commit else None
    return Provenance(commit, None if changes is None else bool(changes.strip()), cpu_model())
