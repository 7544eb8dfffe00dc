"""The server designs a search moves through, and how it moves: one dimension at a time toward better, each move
decided by the A/B method on interleaved rounds, a contender dropped as soon as it is shown worse than the leader.

A configuration is one value per dimension (design, prediction workers, dynamic batching, instances, transport,
wire dtype, precision, compile path, batch size). Values that a design does not read (workers outside
`pipelined`, the queue delay without batching) collapse to one, so that no configuration is measured twice under
two names. The search is a pure function of what it measured and the seed: run again on the same measurements it
makes the same decisions, which is how an interrupted search resumes.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from serverbench.records.markdown import figure
from serverbench.schema.ab import Comparison, compare_ab, shuffled

NOT_READ = "-"  # the value of a dimension that a configuration's design does not read
# A dimension's prefix in a configuration's label (none where the value names itself: serial, shm, bf16, aoti)
SHORT = {"num_workers": "w", "max_batch_size": "mb", "max_queue_delay_ms": "qd", "instances": "i", "batch_size": "bs"}


@dataclass(frozen=True)
class Dimension:
    """One axis of the space: its server.py flag, its values in order (a move goes to the next or the previous
    one; `ordered` False: to any other), and the value a search starts from."""

    name: str
    flag: str
    values: tuple[str, ...]
    start: str
    ordered: bool = True
    off: str | None = None  # the value that means "the flag not given" (no dynamic batching: 0)

    def neighbours(self, value: str) -> list[str]:
        if value not in self.values:
            return []
        if not self.ordered:
            return [v for v in self.values if v != value]
        at = self.values.index(value)
        return [self.values[i] for i in (at - 1, at + 1) if 0 <= i < len(self.values)]


Config = tuple[tuple[str, str], ...]  # (dimension, value) in the space's order


@dataclass(frozen=True)
class Space:
    dimensions: tuple[Dimension, ...]

    def __post_init__(self) -> None:
        names = [d.name for d in self.dimensions]
        if len(set(names)) != len(names):
            raise ValueError(f"a dimension given twice: {names}")
        for dim in self.dimensions:
            if not dim.values:
                raise ValueError(f"--{dim.name}: no value to try")
            if dim.start not in dim.values:
                raise ValueError(f"--{dim.name}: the search starts from {dim.start}, which is not among its values")

    def dimension(self, name: str) -> Dimension:
        return next(d for d in self.dimensions if d.name == name)

    def start(self) -> Config:
        return self.canonical({d.name: d.start for d in self.dimensions})

    def canonical(self, values: dict[str, str]) -> Config:
        """The configuration with the values its design does not read set to NOT_READ, and those it reads again
        (workers once the design is pipelined) back at their start."""
        values = dict(values)
        unread = set()
        if values.get("design", "pipelined") != "pipelined":
            unread.add("num_workers")
        if values.get("max_batch_size", "0") == "0":
            unread.add("max_queue_delay_ms")
        for dim in self.dimensions:
            if dim.name in unread:
                values[dim.name] = NOT_READ
            elif values[dim.name] == NOT_READ:
                values[dim.name] = dim.start
        return tuple((d.name, values[d.name]) for d in self.dimensions)

    def moves(self, config: Config, name: str) -> list[Config]:
        """The configurations one step from `config` along dimension `name` (none where its design does not read
        it). A dimension that comes back to life (workers once the design is pipelined) starts from its start."""
        values = dict(config)
        dim = self.dimension(name)
        if values[name] == NOT_READ:
            return []
        found = []
        for value in dim.neighbours(values[name]):
            moved = self.canonical({**values, name: value})
            if moved != config and moved not in found:
                found.append(moved)
        return found

    def grid(self) -> list[Config]:
        """Every distinct configuration of the space (what a full grid would measure)."""
        found: dict[Config, None] = {}
        for combo in itertools.product(*(d.values for d in self.dimensions)):
            found[self.canonical(dict(zip((d.name for d in self.dimensions), combo)))] = None
        return list(found)

    def label(self, config: Config) -> str:
        """Its name in rows, file names and tables: every value it reads, each after its dimension's short name."""
        return "_".join(f"{SHORT.get(name, '')}{value}" for name, value in config if value != NOT_READ)

    def flags(self, config: Config) -> tuple[str, ...]:
        """server.py's flags for the configuration (batch size and compile path left to the caller's Cell)."""
        flags: list[str] = []
        for name, value in config:
            dim = self.dimension(name)
            if value in (NOT_READ, dim.off) or not dim.flag:
                continue
            flags += [dim.flag, value]
        return tuple(flags)


# ------------------------------------------------------------------------------------------------ the search


@dataclass(frozen=True)
class Objective:
    name: str  # peak_rate, throughput, p99
    higher_is_better: bool
    unit: str


@dataclass
class Step:
    """One dimension weighed at one leader: who took part, what was measured in each round, and the verdicts."""

    dimension: str
    leader: Config
    contenders: list[Config]
    rounds: list[int] = field(default_factory=list)
    dropped: dict[Config, Comparison] = field(default_factory=dict)  # shown worse than the leader
    better: dict[Config, Comparison] = field(default_factory=dict)  # shown better
    unresolved: dict[Config, Comparison | None] = field(default_factory=dict)  # at the last round, neither
    moved_to: Config | None = None


@dataclass
class SearchResult:
    leader: Config
    steps: list[Step]
    values: dict[Config, dict[int, float]]  # each configuration's objective, by round
    spent_s: float
    stopped: str  # why the search ended: "converged", "budget", ...
    next_up: list[tuple[str, Config]]  # what the remaining budget would have weighed next: (dimension, config)
    rounds_run: int
    order: list[str]  # the dimensions in the order weighed: by their best neighbour's gain in the survey


# measure(round, configs) -> {config: (objective value or None when the run failed, seconds it took)}
Measure = Callable[[int, list[Config]], dict[Config, tuple[float | None, float]]]


@dataclass(frozen=True)
class SearchSettings:
    budget_s: float
    seed: int = 0
    min_rounds: int = 2  # the A/B method needs two pairs at least
    max_rounds: int = 5  # then a contender not told apart from the leader is a tie, and the leader stays
    passes: int = 2  # times every dimension is weighed, while the previous pass moved


def quick_search(
    space: Space,
    objective: Objective,
    measure: Measure,
    settings: SearchSettings,
    say: Callable[[str], None] = lambda line: None,
) -> SearchResult:
    """Model Analyzer's quick search with the A/B method: first a survey, one run of the start and of each of its
    one-step neighbours (the dimensions are then weighed in the order of their best neighbour's gain there, so that
    the lever that matters most is weighed before the budget runs out); then each dimension in turn weighs the leader
    against its one-step neighbours on that dimension, in interleaved rounds (each round runs all of them once, in
    an order shuffled by the seed and the round); after `min_rounds` a contender shown worse is dropped and one
    shown better wins (the best of the winners); the rounds go on for the undecided, up to `max_rounds`. A win moves
    the leader and weighs the same dimension again from there (an ordered one keeps climbing); a pass with no move,
    `passes` passes, or the budget, end the search. A round is run only when the budget still holds it at the
    seconds a measurement has taken so far. `say` gets a line after each round: the leader, its figure, the time
    spent and left."""
    leader = space.start()
    values: dict[Config, dict[int, float]] = {}
    steps: list[Step] = []
    spent_s, runs, round_id = 0.0, 0, 0
    stopped = "converged"
    next_up: list[tuple[str, Config]] = []

    def affordable(count: int) -> bool:
        per_run_s = spent_s / runs if runs else 0.0
        return spent_s + per_run_s * count <= settings.budget_s

    def run_round(configs: list[Config]) -> None:
        nonlocal spent_s, runs, round_id
        order = shuffled(configs, settings.seed, "search", round_id)
        for config, (value, seconds) in measure(round_id, order).items():
            spent_s += seconds
            runs += 1
            if value is not None and math.isfinite(value):
                values.setdefault(config, {})[round_id] = value
        best = median_value(values.get(leader, {}))
        shown = figure(best, ",.4g", unit=f" {objective.unit}")
        say(f"search: round {round_id} done; leader {space.label(leader)} at {shown}; {_minutes(spent_s, settings)}")
        round_id += 1

    start, survey_round = leader, round_id
    dims = [d.name for d in space.dimensions if len(d.values) > 1]
    surveyed = [c for d in dims for c in space.moves(leader, d)]
    if surveyed and affordable(len(surveyed) + 1):
        run_round([leader, *surveyed])  # one run of every neighbour: the dimension that matters most goes first
        dims = _by_gain(dims, space, leader, values, survey_round, objective)
    for _ in range(settings.passes):
        moved_in_pass = False
        queue = list(dims)
        while queue:
            name = queue.pop(0)
            contenders = [c for c in space.moves(leader, name) if not _decided(steps, leader, c)]
            if not contenders:
                continue
            step = Step(name, leader, contenders)
            steps.append(step)
            if leader == start and round_id > survey_round:
                step.rounds.append(survey_round)  # its contenders and this leader ran in the survey: a pair each
            alive = list(contenders)
            while alive:
                if not affordable(len(alive) + 1):
                    stopped = "budget"
                    next_up = [(name, c) for c in alive] + [(d, c) for d in queue for c in space.moves(leader, d)]
                    break
                step.rounds.append(round_id)
                run_round([leader, *alive])
                if len(step.rounds) >= settings.min_rounds:
                    alive = _sort_out(step, alive, values, objective, space, settings.max_rounds)
            if stopped == "budget":
                break
            if step.better:
                best = max(step.better, key=lambda c: step.better[c].ratio ** (1 if objective.higher_is_better else -1))
                step.moved_to = leader = best
                moved_in_pass = True
                queue.insert(0, name)  # from the new leader, the same dimension again (an ordered one climbs on)
        if stopped == "budget" or not moved_in_pass:
            break
    return SearchResult(leader, steps, values, spent_s, stopped, next_up, round_id, dims)


def _decided(steps: list[Step], leader: Config, config: Config) -> bool:
    """Whether an earlier step ranked the two already (either the leader then): no rounds spent on them again."""
    for step in steps:
        if step.leader == leader and (config in step.dropped or config in step.better):
            return True
        if step.leader == config and (leader in step.dropped or leader in step.better):
            return True
    return False


def _minutes(spent_s: float, settings: SearchSettings) -> str:
    return f"{spent_s / 60:.1f} of {settings.budget_s / 60:g} min spent"


def _by_gain(
    dims: list[str],
    space: Space,
    leader: Config,
    values: dict[Config, dict[int, float]],
    survey_round: int,
    objective: Objective,
) -> list[str]:
    """The dimensions by the gain of their best neighbour over the leader in the survey's round (a dimension with
    no figure there last); ties keep the space's order."""
    base = values.get(leader, {}).get(survey_round)

    def gain(name: str) -> float:
        figures = [values.get(c, {}).get(survey_round) for c in space.moves(leader, name)]
        figures = [f for f in figures if f is not None and f > 0]
        if not figures or base is None or base <= 0:
            return -math.inf
        ratios = [f / base if objective.higher_is_better else base / f for f in figures]
        return max(ratios)

    return sorted(dims, key=gain, reverse=True)


def _sort_out(
    step: Step,
    alive: list[Config],
    values: dict[Config, dict[int, float]],
    objective: Objective,
    space: Space,
    max_rounds: int,
) -> list[Config]:
    """The step's verdicts after its latest round: contenders shown better or worse leave; once one is better, or
    at `max_rounds`, the rest are unresolved (ties with the leader). The contenders still in play."""
    for config in list(alive):
        verdict = _weigh(values, step.leader, config, step.rounds, objective, space)
        if verdict is not None and verdict.verdict == "faster":  # better on the objective, whichever way it counts
            step.better[config] = verdict
            alive.remove(config)
        elif verdict is not None and verdict.verdict == "slower":
            step.dropped[config] = verdict
            alive.remove(config)
    if step.better or len(step.rounds) >= max_rounds:
        for config in alive:
            step.unresolved[config] = _weigh(values, step.leader, config, step.rounds, objective, space)
        return []
    return alive


def _weigh(
    values: dict[Config, dict[int, float]],
    leader: Config,
    config: Config,
    rounds: Sequence[int],
    objective: Objective,
    space: Space,
) -> Comparison | None:
    """The contender against the leader over the step's rounds (a round where either failed counts as no pair; a
    contender whose every run failed is worse than a leader that ran)."""
    mine, theirs = values.get(config, {}), values.get(leader, {})
    paired = [r for r in rounds if r in mine and r in theirs]
    if not mine and len([r for r in rounds if r in theirs]) >= 2:  # it failed where the leader ran: worse
        worst = 0.0 if objective.higher_is_better else math.inf
        return Comparison(
            "leader", "contender", objective.name, objective.higher_is_better, 0, worst, worst, worst, 0.0, "-"
        )
    if len(paired) < 2:
        return None
    a, b = [theirs[r] for r in paired], [mine[r] for r in paired]
    return compare_ab(a, b, objective.higher_is_better, space.label(leader), space.label(config), objective.name)


def median_value(values: dict[int, float]) -> float | None:
    return float(np.median(list(values.values()))) if values else None
