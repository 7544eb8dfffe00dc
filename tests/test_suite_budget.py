"""The per-file budget check (tests/suite_budget.py) fails a run whose file passes its share, and only then."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from conftest import ROOT
from suite_budget import over_share

SLOW_FILE = """
import time

def test_slow():
    time.sleep(0.6)

def test_quick():
    pass
"""


def test_a_file_over_its_share_is_named_with_its_time_and_share() -> None:
    times_s = {"tests/test_a.py": 80.0, "tests/test_b.py": 71.9, "tests/test_c.py": 95.0}
    assert over_share(times_s, 600.0, 0.12) == [
        "tests/test_c.py took 95.0 s, over its share of the suite's time (12% of 600 s = 72 s)",
        "tests/test_a.py took 80.0 s, over its share of the suite's time (12% of 600 s = 72 s)",
    ]
    assert over_share({"tests/test_b.py": 71.9}, 600.0, 0.12) == []


def test_on_a_slower_machine_the_share_is_of_the_runs_time_so_only_a_file_that_grew_fails() -> None:
    """Every file twice as slow (a machine of the CI's kind can be): none fails that passed; one that doubled
    against the others still does."""
    times_s = {"tests/test_a.py": 70.0, "tests/test_b.py": 60.0, **{f"tests/test_{i}.py": 47.0 for i in range(10)}}
    assert over_share(times_s, 600.0, 0.12) == []  # 70 s < 72 s
    twice = {name: 2 * seconds for name, seconds in times_s.items()}
    assert over_share(twice, 600.0, 0.12) == []
    grown = twice | {"tests/test_b.py": 240.0}
    assert over_share(grown, 600.0, 0.12) == [
        "tests/test_b.py took 240.0 s, over its share of the suite's time (12% of this run's 1320 s, over the "
        "600 s budget = 158 s)"
    ]


def run_with_budget(tmp_path: Path, budget_s: float) -> subprocess.CompletedProcess:
    """pytest on a folder of one slow test file, with the plugin and the given budget (a share of 10 %)."""
    (tmp_path / "test_slow.py").write_text(SLOW_FILE)
    (tmp_path / "conftest.py").write_text(
        f"import sys\nsys.path.insert(0, {str(ROOT / 'tests')!r})\nimport suite_budget\n"
        f"suite_budget.SUITE_BUDGET_S = {budget_s}\nsuite_budget.FILE_SHARE = 0.1\n"
        f"suite_budget.FILES_CSV = suite_budget.Path({str(tmp_path)!r}) / 'files.csv'\n"
        "pytest_plugins = ('suite_budget',)\n"
    )
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-c", "/dev/null", str(tmp_path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_run_fails_when_a_file_passes_its_share_and_passes_within_it(tmp_path: Path) -> None:
    over = run_with_budget(tmp_path, 4.0)  # a share of 0.4 s, against the file's 0.6 s
    assert over.returncode == 1, over.stdout[-2000:]
    assert "2 passed" in over.stdout
    assert re.search(r"FAILED suite budget: test_slow.py took \d\.\d s, over its share", over.stdout), over.stdout
    lines = (tmp_path / "files.csv").read_text().splitlines()
    assert lines[0] == "file,seconds,share_of_budget" and lines[1].startswith("test_slow.py,0.6")
    within = run_with_budget(tmp_path, 600.0)
    assert within.returncode == 0, within.stdout[-2000:]
    assert "time per test file" in within.stdout and "FAILED suite budget" not in within.stdout
