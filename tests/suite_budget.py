"""The suite's time budget, kept per test file: a pytest plugin (tests/conftest.py loads it).

The suite has 10 minutes of tests on the 2-core machine (docs/testing.md). Growth is seen when it happens, not
rounds later: each file's time (its tests' set-up, call and tear-down) is summed, printed at the end of the run
with its share of the budget, written to `results/suite/files.csv` (gitignored: results/suite/NOTES.md keeps the
measured runs' tables), and the run fails when one file takes more than FILE_SHARE of the budget, or of the run's
whole time on a machine slower than the budget's: split it, or make its runs ask more at once. A subset of the
suite is held to the same per-file bound.
"""

from __future__ import annotations

import csv
from collections import defaultdict
from pathlib import Path

import pytest

SUITE_BUDGET_S = 600.0  # the README's test command from a fresh clone, tests only, on the 2-core machine
FILE_SHARE = 0.2  # of the budget (120 s) or of a slower run's whole time, for any one file. The slowest took 10.9 %
# (87.8 s of 808 s) in CI at b55152a; a file that doubles against the others is what this should catch
FILES_CSV = Path(__file__).resolve().parent.parent / "results" / "suite" / "files.csv"


def file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def over_share(times_s: dict[str, float], budget_s: float, share: float) -> list[str]:
    """The files whose time passes their share, each as the line that says so, slowest first. The share is of the
    budget, or of the run's whole time where that is longer: a machine slower than the one the budget was set on
    makes every file slower alike, and only a file that grew against the others is what this should catch."""
    run_s = sum(times_s.values())
    basis = f"{budget_s:.0f} s" if run_s <= budget_s else f"this run's {run_s:.0f} s, over the {budget_s:.0f} s budget"
    limit_s = share * max(budget_s, run_s)
    return [
        f"{name} took {seconds:.1f} s, over its share of the suite's time ({share:.0%} of {basis} = {limit_s:.0f} s)"
        for name, seconds in sorted(times_s.items(), key=lambda item: -item[1])
        if seconds > limit_s
    ]


class SuiteBudget:
    """Sums each file's test time as the reports come, and holds the run to the budget at its end."""

    def __init__(self) -> None:
        self.times_s: dict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.times_s[file_of(report.nodeid)] += report.duration

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if not self.times_s:
            return
        FILES_CSV.parent.mkdir(parents=True, exist_ok=True)
        with open(FILES_CSV, "w", newline="") as out:
            writer = csv.writer(out)
            writer.writerow(["file", "seconds", "share_of_budget"])
            for name, seconds in self.slowest():
                writer.writerow([name, f"{seconds:.1f}", f"{seconds / SUITE_BUDGET_S:.3f}"])
        if over_share(self.times_s, SUITE_BUDGET_S, FILE_SHARE) and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.times_s:
            return
        total_s = sum(self.times_s.values())
        terminalreporter.section("time per test file")
        for name, seconds in self.slowest()[:15]:
            terminalreporter.write_line(f"{seconds:7.1f} s  {seconds / SUITE_BUDGET_S:6.1%}  {name}")
        terminalreporter.write_line(
            f"{total_s:7.1f} s  {total_s / SUITE_BUDGET_S:6.1%}  all ({len(self.times_s)} files)"
        )
        for line in over_share(self.times_s, SUITE_BUDGET_S, FILE_SHARE):
            terminalreporter.write_line(f"FAILED suite budget: {line}", red=True)

    def slowest(self) -> list[tuple[str, float]]:
        return sorted(self.times_s.items(), key=lambda item: -item[1])


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(SuiteBudget(), "suite_budget_times")
