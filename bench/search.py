"""Which server should you build for your model under your SLO: a search of the server designs, on your model,
within a time budget, that names the configuration to build as a server.py command line.

    python -m bench.search --slo_ms 100 --budget_min 20 -- --model resnet18 --image_size 64 --device cpu
    python -m bench.search --objective throughput --concurrency 8 --designs serial pipelined -- --model my.py:make

Objectives: `peak_rate` (default), the highest Poisson rate whose p99 stays within --slo_ms (each measurement a
server.py --find_peak); `throughput`, samples/s of a closed loop at --concurrency; `p99`, the p99 latency at a
Poisson --rate (lower is better). The space: --designs, --workers (pipelined), --max_batch_sizes (0: no dynamic
batching) with --queue_delays_ms, --instances, --transports, --wire_dtypes, --precisions, --compile_paths and
--batch_sizes (samples per request); the first value of each is where the search starts. From there it weighs one
dimension at a time: the leader against its one-step neighbours on that dimension, in interleaved rounds, a
contender dropped as soon as the A/B method shows it worse and the leader moved when one is shown better; the
undecided get more rounds, up to --max_rounds (then they tie with the leader, which stays). Every run is a row of
<out>/runs.csv; the same command again resumes (it replays the decisions from the rows and runs what is left).

<out>/search.md (printed): the recommended configuration as a server.py command line, the ranked table of what was
measured (the objective with its spread and its A/B verdict against the leader, p50/p99, efficiency, where the time
goes), each step's verdicts, ties said plainly, what the remaining budget would have weighed next; and
<out>/search_pareto.png, throughput against p99 of every configuration measured, the front marked. Flags after --
go to every run: the model (a factory, a .pt2, an AOTInductor package, --input), the device, the run's length.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from bench.design_space import (
    Config,
    Dimension,
    Objective,
    SearchResult,
    SearchSettings,
    Space,
    median_value,
    quick_search,
)
from bench.study import (
    add_run_arguments,
    measured_by,
    provenance,
    rows_problem,
    runs_problem,
    study_runner,
    tool_command,
)
from serverbench.config.flags import OneLineErrorParser, bounded
from serverbench.config.limits import MAX_BATCH_IMAGES, MAX_RATE_RPS
from serverbench.config.paths import parse_bench_args
from serverbench.launch.study import RUNS_CSV, Cell, Experiment, Runner, csv_records, interruptible, read_rows
from serverbench.launch.study_checks import args_problem, given_flags, given_tool_flags, measured_args, record_args
from serverbench.records.markdown import figure, table_head, table_row
from serverbench.records.plots import pyplot, save_figure
from serverbench.records.report_input import drop_superseded
from serverbench.schema.ab import compare_ab
from sweep import split_server_flags

PROG = "python -m bench.search"
REPORT_MD, PLOT_PNG, SPENT_JSON, PEAK_CSV = "search.md", "search_pareto.png", "spent.json", "peak.csv"
OBJECTIVES = {
    "peak_rate": Objective("peak_rate", True, "req/s"),
    "throughput": Objective("throughput", True, "samples/s"),
    "p99": Objective("p99", False, "ms"),
}
MIN_BUDGET_MIN = 0.5  # less holds no measurement of any model
STAGES = ("mean_request_queue_ms", "mean_h2d_ms", "mean_predict_ms", "mean_d2h_ms")


def add_space_arguments(parser: argparse.ArgumentParser) -> None:
    space = parser.add_argument_group("the space (the first value of each is where the search starts)")
    space.add_argument(
        "--designs", nargs="+", choices=("pipelined", "serial", "threaded"), default=["pipelined", "serial", "threaded"]
    )
    space.add_argument("--workers", nargs="+", type=bounded(int, 1, 64), default=[2, 1, 4], help="(2 1 4)")
    space.add_argument(
        "--max_batch_sizes", nargs="+", type=bounded(int, 0, MAX_BATCH_IMAGES), default=[0, 8, 32], help="(0 8 32)"
    )
    space.add_argument("--queue_delays_ms", nargs="+", type=bounded(float, 0.0, 1000.0), default=[2.0], help="(2)")
    space.add_argument("--instances", nargs="+", type=bounded(int, 1, 64), default=[1, 2], help="(1 2)")
    space.add_argument("--transports", nargs="+", choices=("shm", "queue"), default=["shm"], help="(shm)")
    space.add_argument("--wire_dtypes", nargs="+", choices=("float32", "uint8"), default=["float32"])
    space.add_argument(
        "--precisions", nargs="+", choices=("default", "fp32", "tf32", "bf16", "fp16"), default=["default"]
    )
    space.add_argument("--compile_paths", nargs="+", choices=("eager", "compile", "aoti"), default=["eager"])
    space.add_argument(
        "--batch_sizes", nargs="+", type=bounded(int, 1, MAX_BATCH_IMAGES), default=[1], help="samples per request (1)"
    )


def build_parser() -> OneLineErrorParser:
    parser = OneLineErrorParser(
        prog=PROG,
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Flags after -- go to every server.py run.",
    )
    goal = parser.add_argument_group("what to optimise")
    goal.add_argument("--objective", choices=tuple(OBJECTIVES), default="peak_rate", help="(peak_rate)")
    goal.add_argument("--slo_ms", type=bounded(float, 0.001, 3.6e6), default=100.0, help="peak_rate's p99 (100)")
    goal.add_argument("--concurrency", type=bounded(int, 1, 4096), default=4, help="throughput's closed loop (4)")
    goal.add_argument("--rate", type=bounded(float, 0.01, MAX_RATE_RPS), default=10.0, help="p99's requests/s (10)")
    goal.add_argument(
        "--budget_min",
        type=bounded(float, MIN_BUDGET_MIN, 7 * 24 * 60),
        default=20.0,
        help=f"minutes of runs the search may spend, at least {MIN_BUDGET_MIN:g} (20)",
    )
    add_space_arguments(parser)
    runs = add_run_arguments(parser, "search", timeout_s=1800.0)
    runs.add_argument("--min_rounds", type=bounded(int, 2, 20), default=2, help="rounds before a verdict (2)")
    runs.add_argument("--max_rounds", type=bounded(int, 2, 50), default=4, help="then an undecided one ties (4)")
    runs.add_argument("--passes", type=bounded(int, 1, 10), default=2, help="over the dimensions while moving (2)")
    runs.add_argument(
        "--check_against",
        type=Path,
        help="a sweep.py folder of the same space's full grid (its experiments named as the search's): the report "
        "adds the pick against the grid's best, by the A/B method over the grid's repeats",
    )
    return parser


def space_of(args: argparse.Namespace) -> Space:
    def values(items: Sequence[object]) -> tuple[str, ...]:
        return tuple(dict.fromkeys(f"{v:g}" if isinstance(v, float) else str(v) for v in items))

    def dim(name: str, flag: str, given: Sequence[object], ordered: bool = True, off: str | None = None) -> Dimension:
        found = values(given)
        return Dimension(name, flag, found if not ordered else _sorted(found), found[0], ordered, off)

    return Space(
        (
            dim("design", "--design", args.designs, ordered=False),
            dim("num_workers", "--num_workers", args.workers),
            dim("max_batch_size", "--max_batch_size", args.max_batch_sizes, off="0"),
            dim("max_queue_delay_ms", "--max_queue_delay_ms", args.queue_delays_ms),
            dim("instances", "--instances", args.instances),
            dim("transport", "--transport", args.transports, ordered=False),
            dim("wire_dtype", "--wire_dtype", args.wire_dtypes, ordered=False),
            dim("precision", "--precision", args.precisions, ordered=False),
            dim("compile_path", "", args.compile_paths, ordered=False),  # the Cell's compile, or --aoti
            dim("batch_size", "", args.batch_sizes),  # the Cell's batch size
        )
    )


def _sorted(values: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(sorted(values, key=float))


def objective_flags(args: argparse.Namespace) -> tuple[str, ...]:
    """What every run is asked, by the objective: the same in every run (and checked again on a resume)."""
    if args.objective == "peak_rate":
        return ("--find_peak", "--slo_ms", f"{args.slo_ms:g}")
    if args.objective == "throughput":
        return ("--load", "closed", "--concurrency", str(args.concurrency))
    return ("--load", "poisson", "--rate", f"{args.rate:g}")


def cell_of(space: Space, config: Config, round_id: int) -> Cell:
    values = dict(config)
    flags = space.flags(config) + (("--aoti",) if values["compile_path"] == "aoti" else ())
    return Cell(
        Experiment(space.label(config), flags),
        int(values["batch_size"]),
        values["compile_path"] == "compile",
        round_id,
    )


# ------------------------------------------------------------------------------------------------ measuring


class Measurements:
    """The objective of each cell, from its rows: run by the runner when it has none yet (a resume replays what is
    there), its seconds kept in <out>/spent.json so that a replayed search spends its budget as the first did."""

    def __init__(self, runner: Runner | None, space: Space, objective: Objective, out: Path) -> None:
        self.runner, self.space, self.objective, self.out = runner, space, objective, out
        self.spent: dict[str, float] = json.loads((out / SPENT_JSON).read_text()) if (out / SPENT_JSON).exists() else {}

    def __call__(self, round_id: int, configs: list[Config]) -> dict[Config, tuple[float | None, float]]:
        cells = {config: cell_of(self.space, config, round_id) for config in configs}
        for cell in cells.values():
            key = f"{cell.experiment.name}@{round_id}"
            if key not in self.spent and self.runner is not None:  # --report_only: what was not measured stays so
                started = time.monotonic()
                self.runner.run([cell], what=f"round {round_id}: {cell.experiment.name}")
                self.spent[key] = round(time.monotonic() - started, 3)
                (self.out / SPENT_JSON).write_text(json.dumps(self.spent, indent=1) + "\n")
        values = objective_values(self.out, self.objective)  # the rows read once a round, not once a cell
        return {
            config: (values.get(cell.experiment.name, {}).get(round_id), self.spent[key])
            for config, cell in cells.items()
            if (key := f"{cell.experiment.name}@{round_id}") in self.spent
        }


def objective_values(folder: Path, objective: Objective) -> dict[str, dict[int, float | None]]:
    """The objective per experiment and repeat of a folder's runs (a search's or a sweep's full grid), each from
    its last row: peak.csv's rate for peak_rate (0 where no rate met the SLO: worse than any that did), else
    runs.csv's figure, None where that run did not end ok."""
    found: dict[str, dict[int, float | None]] = {}
    if objective.name == "peak_rate":
        for peak in csv_records(folder / PEAK_CSV):
            rate = peak.get("peak_rate_rps")
            found.setdefault(str(peak["experiment"]), {})[int(peak["repeat"])] = 0.0 if rate is None else float(rate)
        return found
    rows = read_rows(folder / RUNS_CSV)
    column = "throughput" if objective.name == "throughput" else "p99_latency_s"
    scale = 1e3 if objective.name == "p99" else 1.0
    for _, row in (rows if rows is not None else pd.DataFrame()).iterrows():
        value = float(row[column]) * scale if row["status"] == "ok" else None
        found.setdefault(str(row["experiment"]), {})[int(row["repeat"])] = value
    return found


def check_lines(folder: Path, pick: str, objective: Objective) -> list[str]:
    """The search's pick against the full grid's best cell, on the grid's own runs (paired by its repeats)."""
    values = objective_values(folder, objective)
    ran = {name: {r: v for r, v in by_repeat.items() if v is not None} for name, by_repeat in values.items()}
    measured = {name: v for name, v in ran.items() if v}
    if pick not in measured:
        return [f"- the grid in {folder} has no run of `{pick}`: nothing to check against"]
    sign = 1 if objective.higher_is_better else -1
    best = max(measured, key=lambda name: sign * median_value(measured[name]))
    lines = [
        f"- the grid's best: `{best}`, {figure(median_value(measured[best]), ',.1f')} {objective.unit} (median of "
        f"{len(measured[best])}); the pick there: {figure(median_value(measured[pick]), ',.1f')} {objective.unit}; "
        f"{len(measured)} configurations measured",
    ]
    if best == pick:
        return [*lines, "- the pick **is** the grid's best"]
    rounds = sorted(set(measured[best]) & set(measured[pick]))
    comparison = compare_ab(
        [measured[best][r] for r in rounds],
        [measured[pick][r] for r in rounds],
        objective.higher_is_better,
        best,
        pick,
        objective.name,
    )
    if comparison is None:
        return [*lines, "- fewer than two paired repeats: no A/B verdict"]
    within = comparison.low <= 1 <= comparison.high
    words = "within the A/B interval of the best" if within else "outside the A/B interval: worse than the best"
    return [*lines, f"- the pick is {words}: {comparison.text}"]


# ------------------------------------------------------------------------------------------------ the answer


def command_line(space: Space, config: Config, server_flags: Sequence[str]) -> str:
    cell = cell_of(space, config, 0)
    flags = [*server_flags, *cell.experiment.flags, "--batch_size", str(cell.batch_size)]
    flags += ["--compile"] if cell.compile else []
    return shlex.join(["python", "server.py", *flags])


def verdict_against_leader(result: SearchResult, config: Config) -> str:
    """The A/B verdict of the configuration against the leader it was weighed against, where it was."""
    if config == result.leader:
        return "**the recommendation**"
    if any(config == waiting for _, waiting in result.next_up):
        return "undecided: the budget ended its step"
    for step in result.steps:
        for verdicts in (step.dropped, step.better, step.unresolved):
            if config in verdicts:
                comparison = verdicts[config]
                against = "the leader then" if step.leader != result.leader else "the recommendation"
                return "no pair" if comparison is None else f"{comparison.short} (against {against})"
    return "not weighed"


def figures(rows: pd.DataFrame | None, peaks: list[dict], name: str) -> dict[str, float | None]:
    """p50, p99 (ms), throughput and efficiency (medians of the ok runs), and where the time goes."""
    found: dict[str, float | None] = {}
    if rows is not None:
        ok = rows[(rows["experiment"] == name) & (rows["status"] == "ok")]
        if "peak_search_step" in ok:  # a peak search: the steps at a Poisson rate, not the burst that began it
            ok = ok[ok["peak_search_step"].astype(str) != "offline"]
        for column in ("p50_latency_s", "p99_latency_s", "throughput", "efficiency", *STAGES):
            values = ok[column].dropna().astype(float) if column in ok else pd.Series(dtype=float)
            found[column] = float(values.median()) if len(values) else None
    mine = [p for p in peaks if p.get("experiment") == name and p.get("peak_p99_latency_s") is not None]
    if mine:  # the peak's own p99 and throughput are what the objective measured
        found["p99_latency_s"] = float(pd.Series([float(p["peak_p99_latency_s"]) for p in mine]).median())
        found["throughput"] = float(pd.Series([float(p["peak_throughput"]) for p in mine]).median())
    return found


def ranked_table(result: SearchResult, space: Space, objective: Objective, rows, peaks) -> list[str]:
    lines = table_head(
        [
            "rank",
            "configuration",
            f"{objective.name} ({objective.unit}), median (min-max)",
            "runs",
            "against the leader (A/B)",
            "p50 ms",
            "p99 ms",
            "samples/s",
            "efficiency",
            "queue / h2d / predict / d2h ms",
        ]
    )
    measured = [c for c in result.values if result.values[c]]
    sign = 1 if objective.higher_is_better else -1
    ranked = sorted(measured, key=lambda c: (c != result.leader, -sign * (median_value(result.values[c]) or 0)))
    for rank, config in enumerate(ranked, start=1):
        got = list(result.values[config].values())
        name = space.label(config)
        seen = figures(rows, peaks, name)
        stages = " / ".join(figure(seen.get(column), ",.2f") for column in STAGES)
        low, high = figure(min(got), ",.1f"), figure(max(got), ",.1f")
        value = f"{figure(median_value(result.values[config]), ',.1f')} ({low}-{high})"
        latencies = [figure(seen.get(name), ",.2f", 1e3) for name in ("p50_latency_s", "p99_latency_s")]
        shown = [*latencies, figure(seen.get("throughput"), ",.1f"), figure(seen.get("efficiency"), ",.3f"), stages]
        lines.append(table_row([rank, f"`{name}`", value, len(got), verdict_against_leader(result, config), *shown]))
    return lines


def step_lines(result: SearchResult, space: Space) -> list[str]:
    lines = [
        "Round 0 surveyed the start and each of its one-step neighbours once; the dimensions were then weighed in "
        f"the order of their best neighbour's gain there: {', '.join(result.order)}.",
        "",
    ]
    for number, step in enumerate(result.steps, start=1):
        head = f"{number}. {step.dimension} at `{space.label(step.leader)}`, rounds {len(step.rounds)}"
        lines.append(head + (f": moved to `{space.label(step.moved_to)}`" if step.moved_to else ": the leader stays"))
        for config, comparison in [*step.better.items(), *step.dropped.items(), *step.unresolved.items()]:
            text = "every run failed or no pair" if comparison is None else comparison.text
            lines.append(f"   - `{space.label(config)}`: {text}")
    return lines


def ties(result: SearchResult, space: Space) -> list[str]:
    """The configurations that the search could not tell from the leader where they last met."""
    tied = [c for s in result.steps if s.leader == result.leader for c in s.unresolved]
    if not tied:
        return []
    names = ", ".join(f"`{space.label(c)}`" for c in tied)
    return [
        f"- Cannot be told apart from the recommendation at this noise after the last step's rounds: {names}. "
        "Either serves as well as far as these runs can say; more rounds (--max_rounds) would decide."
    ]


def pareto_plot(result: SearchResult, space: Space, rows, peaks, path: Path) -> list[str]:
    """Throughput against p99 of every configuration measured (medians), the front (no other both faster and
    quicker) marked; the names on the front."""
    points = []
    for config in result.values:
        seen = figures(rows, peaks, space.label(config))
        if seen.get("throughput") is not None and seen.get("p99_latency_s") is not None:
            points.append((space.label(config), seen["throughput"], seen["p99_latency_s"] * 1e3))
    front = [p for p in points if not any(q[1] >= p[1] and q[2] <= p[2] and q != p for q in points)]
    if not points:
        return []
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.scatter([p[1] for p in points], [p[2] for p in points], color="0.6", label="measured")
    ordered = sorted(front, key=lambda p: p[1])
    ax.plot([p[1] for p in ordered], [p[2] for p in ordered], "o-", color="C0", label="front")
    for name, x, y in ordered:
        ax.annotate(name, (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("throughput (samples/s)")
    ax.set_ylabel("p99 latency (ms)")
    ax.legend()
    save_figure(fig, path)
    return [f"- `{name}`: {x:,.1f} samples/s at p99 {y:.2f} ms" for name, x, y in ordered]


def report(
    result: SearchResult, space: Space, objective: Objective, args: argparse.Namespace, server_flags, command: str
) -> tuple[str, int]:
    out: Path = args.out
    rows = read_rows(out / RUNS_CSV)
    peaks = csv_records(out / PEAK_CSV)
    grid = len(space.grid())
    measured = [c for c in result.values if result.values[c]]
    leader_value = median_value(result.values.get(result.leader, {}))
    goal = {
        "peak_rate": f"the highest Poisson rate with p99 within {args.slo_ms:g} ms",
        "throughput": f"samples/s of a closed loop at concurrency {args.concurrency}",
        "p99": f"the lowest p99 at {args.rate:g} requests/s",
    }[objective.name]
    lines = [f"# Which server to build: {goal}", ""]
    ran_by = measured_by(out)
    if rows is not None:
        kept = drop_superseded(rows)  # a cell a resume ran again counts once
        lines += provenance(command, kept, ran_by, len(rows) - len(kept))
    else:
        lines += [f"- command: `{ran_by or command}`"]
    lines += [
        f"- the space: {grid} configurations; measured {len(measured)} ({len(measured) / grid:.0%}) in "
        f"{result.rounds_run} rounds, {result.spent_s / 60:.1f} of {args.budget_min:g} minutes; ended: "
        f"{result.stopped}",
        "",
        "## The answer",
        "",
    ]
    exit_status = 0
    if leader_value is None:
        lines += ["No configuration was measured: nothing to recommend (see the runs' logs in logs/).", ""]
        exit_status = 1
    elif objective.name == "peak_rate" and leader_value <= 0:
        lines += [
            f"No configuration measured kept p99 within {args.slo_ms:g} ms at any rate its peak search tried: this "
            "model cannot meet the SLO in this space on this machine. What was measured is below.",
            "",
        ]
        exit_status = 1
    else:
        lines += [
            f"Build `{space.label(result.leader)}`: {objective.name} {figure(leader_value, ',.1f')} {objective.unit} "
            "(median of its runs).",
            "",
            f"    {command_line(space, result.leader, server_flags)}",
            "",
            *ties(result, space),
            "",
        ]
    lines += ["## What was measured", "", *ranked_table(result, space, objective, rows, peaks), ""]
    front = pareto_plot(result, space, rows, peaks, out / PLOT_PNG)
    if front:
        lines += [f"## Throughput against p99 ({PLOT_PNG}): the front", "", *front, ""]
    if args.check_against is not None and leader_value is not None:
        lines += [f"## Against the full grid ({args.check_against})", ""]
        lines += [*check_lines(args.check_against, space.label(result.leader), objective), ""]
    lines += ["## How the search went", "", *step_lines(result, space), ""]
    if result.next_up:
        lines += ["## What the remaining budget would have weighed next", ""]
        lines += [f"- {name}: `{space.label(config)}`" for name, config in result.next_up]
        lines.append("")
    return "\n".join(lines), exit_status


# ------------------------------------------------------------------------------------------------ the command


# How long and how the search may go on, and what its report checks against: a resume may change them, and a
# --report_only's replay takes them as given (the space, the objective and the server flags are the runs')
FREE_FLAGS = ("budget_min", "min_rounds", "max_rounds", "passes", "check_against")


def main(argv: Sequence[str] | None = None) -> int:
    argv, server_flags = split_server_flags(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parse_bench_args(parser, argv, "bench.search", RUNS_CSV)  # --out checked before any run
    given = given_tool_flags(parser, argv, args)
    args.server_flags = list(server_flags)
    command = tool_command("search", argv, server_flags)
    kept = f"; what was measured is in {args.out / RUNS_CSV}: the same command resumes"

    def work() -> int:  # the checks (a model's forward tried in a child), the runs, the report: a Ctrl-C is one line
        if (problem := args_problem(parser, FREE_FLAGS, args, given)) is not None:
            parser.error(problem)
        if args.report_only and (problem := rows_problem(args.out / RUNS_CSV)) is not None:
            parser.error(problem)  # an empty or header-only runs.csv reported a search that never ran
        measured = measured_args(args, args.out, given, FREE_FLAGS)  # --report_only: as the runs were made
        if measured.min_rounds > measured.max_rounds:
            parser.error(f"--min_rounds {measured.min_rounds} is more than --max_rounds {measured.max_rounds}")
        if (problem := grid_problem(measured.check_against)) is not None:
            parser.error(problem)
        try:
            space = space_of(measured)
        except ValueError as exc:
            parser.error(str(exc))
        if len(space.grid()) < 2:  # e.g. --designs serial with workers: a value serial does not read is no choice
            parser.error(
                f"the space holds one configuration ({space.label(space.start())}): nothing to choose between; widen "
                "a dimension, or run it with server.py"
            )
        asked = objective_flags(measured)
        flags = (*measured.server_flags, *asked)
        if taken := sorted(given_flags(measured.server_flags) & given_flags(asked)):
            parser.error(
                f"{', '.join(taken)} after --: --objective {measured.objective} sets it in every run "
                f"({' '.join(asked)}), so the value given would be overridden; leave it out"
            )
        cells = [cell_of(space, config, 0) for config in space.grid()]  # every configuration, before the first run
        if not args.report_only and (problem := runs_problem(args.out, cells, flags)) is not None:
            parser.error(problem)
        return search_and_report(measured, space, measured.server_flags, flags, command)

    return interruptible(PROG, work, kept)


def grid_problem(folder: Path | None) -> str | None:
    """--check_against: a folder of a sweep's rows (runs.csv, or a peak search's peak.csv), else why not."""
    if folder is None or (folder / RUNS_CSV).is_file() or (folder / PEAK_CSV).is_file():
        return None
    return (
        f"--check_against {folder}: no {RUNS_CSV} or {PEAK_CSV} there: give the folder of a sweep.py run of the space"
    )


def search_and_report(
    args: argparse.Namespace, space: Space, server_flags: Sequence[str], flags: tuple[str, ...], command: str
) -> int:
    out: Path = args.out.resolve()
    args.out = out
    objective = OBJECTIVES[args.objective]
    runner = None
    if not args.report_only:
        runner = study_runner("bench.search", out, flags, args.cell_timeout_s, command)
        if runner is None:
            return 2
        record_args(out, args)
    settings = SearchSettings(args.budget_min * 60, args.seed, args.min_rounds, args.max_rounds, args.passes)
    say = (lambda line: print(line, flush=True)) if runner is not None else (lambda line: None)
    try:
        result = quick_search(space, objective, Measurements(runner, space, objective, out), settings, say)
    finally:
        if runner is not None:
            runner.release()
    text, status = report(result, space, objective, args, server_flags, command)
    (out / REPORT_MD).write_text(text + "\n")
    print(text)
    return status


if __name__ == "__main__":
    sys.exit(main())
