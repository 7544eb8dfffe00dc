"""bench.search: on a planted space whose best configuration is known, the search names it in at least 9 of 10
seeds while measuring at most a third of the full grid; a budget ends it with what it would have weighed next; a
search run again on its own measurements makes the same decisions (its resume); and one tiny search end to end:
its report, its command line, a resume that runs nothing, --report_only."""

from __future__ import annotations

import math
import random
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

from bench import search
from bench.design_space import Config, Dimension, Objective, SearchResult, SearchSettings, Space, quick_search

THROUGHPUT = Objective("throughput", True, "samples/s")
P99 = Objective("p99", False, "ms")


def planted_space() -> Space:
    """designs x workers (pipelined) x dynamic batching x instances: 50 distinct configurations."""
    return Space(
        (
            Dimension("design", "--design", ("pipelined", "serial", "threaded"), "pipelined", ordered=False),
            Dimension("num_workers", "--num_workers", ("1", "2", "4"), "2"),
            Dimension("max_batch_size", "--max_batch_size", ("0", "4", "8", "16", "32"), "0", off="0"),
            Dimension("instances", "--instances", ("1", "2"), "1"),
        )
    )


# The planted cost: batching at 8 and four workers win, by 15 % over the next best (above what the A/B method
# resolves in a few rounds at 3 % noise); every other setting costs something.
BATCHING = {"0": 1.0, "4": 1.35, "8": 1.6, "16": 1.45, "32": 1.3}
WORKERS = {"1": 0.85, "2": 1.0, "4": 1.15, "-": 1.0}
DESIGN = {"pipelined": 1.0, "serial": 0.8, "threaded": 0.9}
INSTANCES = {"1": 1.0, "2": 0.9}
BEST = (("design", "pipelined"), ("num_workers", "4"), ("max_batch_size", "8"), ("instances", "1"))


def space_config(**values: str) -> Config:
    """The planted space's start with `values` changed."""
    space = planted_space()
    return space.canonical({**dict(space.start()), **values})


def planted(config: Config) -> float:
    values = dict(config)
    return (
        100.0
        * BATCHING[values["max_batch_size"]]
        * WORKERS[values["num_workers"]]
        * DESIGN[values["design"]]
        * INSTANCES[values["instances"]]
    )


class Simulated:
    """Each run's figure: the planted one, times the round's drift (shared by every run of the round, as a machine
    drifts) and its own noise; every run takes `seconds`."""

    def __init__(self, seed: int, noise: float = 0.03, drift: float = 0.05, seconds: float = 10.0) -> None:
        self.rng = random.Random(seed)
        self.noise, self.drift, self.seconds = noise, drift, seconds
        self.calls: list[tuple[int, Config]] = []

    def __call__(self, round_id: int, configs: list[Config]) -> dict[Config, tuple[float | None, float]]:
        drift = math.exp(self.rng.gauss(0, self.drift))
        found = {}
        for config in configs:
            self.calls.append((round_id, config))
            found[config] = (planted(config) * drift * math.exp(self.rng.gauss(0, self.noise)), self.seconds)
        return found


def test_the_planted_best_is_named_in_9_of_10_seeds_measuring_at_most_a_third_of_the_grid() -> None:
    space = planted_space()
    grid = space.grid()
    assert len(grid) == 50 and max(grid, key=planted) == BEST
    named, fractions = 0, []
    for seed in range(10):
        measure = Simulated(seed)
        result = quick_search(space, THROUGHPUT, measure, SearchSettings(budget_s=1e9, seed=seed))
        named += result.leader == BEST
        measured = {config for _, config in measure.calls}
        fractions.append(len(measured) / len(grid))
        assert result.stopped == "converged"
    assert named >= 9, named
    assert max(fractions) <= 1 / 3, fractions


def test_a_budget_ends_the_search_with_what_it_would_have_weighed_next() -> None:
    """Ten runs of 10 s in a budget of 100 s: the survey (the start and its 6 neighbours) puts dynamic batching,
    the largest gain, first; its step's second pair cannot decide yet (two pairs rarely do), and the third round
    would pass the budget: the search stops before it, the start still the leader, and says what it would have
    weighed: batching first."""
    measure = Simulated(0)
    result = quick_search(planted_space(), THROUGHPUT, measure, SearchSettings(budget_s=100.0))
    assert result.stopped == "budget" and result.spent_s <= 100.0 and len(measure.calls) <= 10
    assert result.order[0] == "max_batch_size" and result.steps[0].dimension == "max_batch_size"
    assert result.leader == planted_space().start() and result.leader in result.values
    assert result.next_up[0] == ("max_batch_size", space_config(max_batch_size="4"))


def test_a_lower_is_better_objective_moves_toward_lower_figures() -> None:
    """p99: the planted figures inverted (a faster configuration answers sooner)."""

    def measure(round_id: int, configs: list[Config]) -> dict[Config, tuple[float | None, float]]:
        rng = random.Random(round_id)
        return {c: (1000.0 / planted(c) * math.exp(rng.gauss(0, 0.03)), 1.0) for c in configs}

    result = quick_search(planted_space(), P99, measure, SearchSettings(budget_s=1e9))
    assert result.leader == BEST


def test_a_failed_contender_is_dropped_and_a_search_replayed_on_its_measurements_decides_the_same() -> None:
    """Threaded never runs (its runs fail): dropped as worse, never the leader. The same search again, given what
    the first measured (a resume), makes the same moves and asks for nothing else."""
    first = Simulated(3)
    recorded: dict[tuple[int, Config], tuple[float | None, float]] = {}

    def failing(round_id: int, configs: list[Config]) -> dict[Config, tuple[float | None, float]]:
        found = first(round_id, configs)
        found = {c: ((None, s) if dict(c)["design"] == "threaded" else (v, s)) for c, (v, s) in found.items()}
        recorded.update({(round_id, c): found[c] for c in configs})
        return found

    settings = SearchSettings(budget_s=1e9, seed=3)
    result = quick_search(planted_space(), THROUGHPUT, failing, settings)
    threaded = [c for step in result.steps for c in step.dropped if dict(c)["design"] == "threaded"]
    assert threaded and dict(result.leader)["design"] != "threaded"

    asked: list[tuple[int, Config]] = []

    def replay(round_id: int, configs: list[Config]) -> dict[Config, tuple[float | None, float]]:
        asked.extend((round_id, c) for c in configs)
        return {c: recorded[(round_id, c)] for c in configs}

    again = quick_search(planted_space(), THROUGHPUT, replay, settings)
    assert again.leader == result.leader and again.rounds_run == result.rounds_run
    assert set(asked) == set(recorded)


def test_the_space_collapses_what_a_design_does_not_read() -> None:
    space = planted_space()
    serial = space.canonical({"design": "serial", "num_workers": "4", "max_batch_size": "0", "instances": "1"})
    assert dict(serial)["num_workers"] == "-" and space.flags(serial) == ("--design", "serial", "--instances", "1")
    assert space.moves(serial, "num_workers") == []
    # from serial, pipelined comes back with workers at their start
    pipelined = space.moves(serial, "design")[0]
    assert dict(pipelined)["num_workers"] == "2" and space.label(pipelined) == "pipelined_w2_mb0_i1"
    with pytest.raises(ValueError, match="not among its values"):
        Space((Dimension("instances", "--instances", ("1", "2"), "3"),))


def test_a_tiny_search_end_to_end_then_resumes_running_nothing(tmp_path: Path) -> None:
    """Two designs on the identity model, two rounds each step: the answer, its server.py command line, the table,
    the Pareto plot; the same command again runs nothing and gives the same answer; --report_only too."""
    out = tmp_path / "search"
    command = [sys.executable, "-m", "bench.search", "--objective", "throughput", "--concurrency", "2"]
    command += ["--designs", "pipelined", "serial", "--workers", "2", "--max_batch_sizes", "0", "--instances", "1"]
    command += ["--max_rounds", "2", "--budget_min", "5", "--out", str(out), "--"]
    command += ["--device", "cpu", "--model", "identity", "--image_size", "8", "--num_iters", "20", "--no-ceiling"]
    first = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    report = (out / "search.md").read_text()
    assert "## The answer" in report and "python server.py --device cpu --model identity" in report
    assert "| 1 | `" in report and "| 2 | `" in report and (out / "search_pareto.png").stat().st_size > 0
    assert "search: round 0 done; leader pipelined_w2_mb0_i1_shm_float32_default_eager_bs1" in first.stdout
    rows_before = (out / "runs.csv").read_text()
    assert rows_before.count("\n") - 1 == 4  # two configurations, two rounds

    again = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert again.returncode == 0, again.stderr[-3000:]
    assert (out / "runs.csv").read_text() == rows_before  # nothing ran again
    answer = [line for line in report.splitlines() if line.startswith("Build ")]
    assert answer and answer[0] in again.stdout

    only = subprocess.run(
        [*command[: command.index("--")], "--report_only"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert only.returncode == 0 and answer[0] in only.stdout, only.stderr[-3000:]
    # ... with the runs' own server flags in the command line it recommends, though none were given after --
    assert "python server.py --device cpu --model identity --image_size 8" in only.stdout
    # ... and refusing an objective the runs were not made under (it reported a p99 pick from throughput runs)
    refused = subprocess.run(
        [*command[: command.index("--")], "--report_only", "--objective", "p99", "--rate", "50"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr[-3000:]
    assert (
        "--objective p99, --rate 50.0: the runs in" in refused.stderr and "were made with --objective" in refused.stderr
    )


def test_the_pick_is_checked_against_a_full_grid_by_the_grids_own_repeats(tmp_path: Path) -> None:
    """A sweep.py folder's peak.csv: the pick within the best's interval (noisy pairs), then outside it (a pick
    clearly worse in every repeat), and the pick that is the best."""
    peaks = tmp_path / "peak.csv"
    rows = ["experiment,repeat,peak_rate_rps"]
    rows += [f"best,{r},{v}" for r, v in enumerate((100.0, 104.0, 98.0))]
    rows += [f"close,{r},{v}" for r, v in enumerate((101.0, 97.0, 99.0))]
    rows += [f"worse,{r},{v}" for r, v in enumerate((80.0, 83.0, 79.0))]
    rows += ["never_met,0,", "never_met,1,", "never_met,2,"]
    peaks.write_text("\n".join(rows) + "\n")
    peak_rate = Objective("peak_rate", True, "req/s")
    close = "\n".join(search.check_lines(tmp_path, "close", peak_rate))
    assert "the grid's best: `best`" in close and "within the A/B interval of the best" in close
    worse = "\n".join(search.check_lines(tmp_path, "worse", peak_rate))
    assert "outside the A/B interval: worse than the best" in worse
    assert "**is** the grid's best" in "\n".join(search.check_lines(tmp_path, "best", peak_rate))
    assert "has no run of `absent`" in search.check_lines(tmp_path, "absent", peak_rate)[0]


def test_a_model_that_meets_its_slo_at_no_rate_is_said_so_and_exits_1(tmp_path: Path) -> None:
    """Every peak search found no rate within the SLO (its figure 0): no recommendation, the reason in words, exit
    1, and the table of what was measured."""
    space = planted_space()
    start = space.start()
    other = space.moves(start, "max_batch_size")[0]
    result = SearchResult(start, [], {start: {0: 0.0, 1: 0.0}, other: {0: 0.0}}, 30.0, "converged", [], 2, [])
    args = search.build_parser().parse_args(["--slo_ms", "5", "--out", str(tmp_path)])
    text, status = search.report(result, space, search.OBJECTIVES["peak_rate"], args, [], "python -m bench.search")
    assert status == 1
    assert "No configuration measured kept p99 within 5 ms at any rate its peak search tried" in text
    assert "Build `" not in text and "## What was measured" in text
