"""The docs cannot drift from the code: every CSV column a row can have and every server.py flag has an entry in
docs/, and docs/ names none that no longer exists; README.md stays a front door (at most 250 lines, every module
path it names exists, every tool its commands run answers --help); no markdown file points outside the checkout.

Sources of truth: the declarations in `serverbench.schema.columns` (COLUMNS) for the columns, with their units and
meanings, `server.build_parser()` for the flags. The docs side is read from markdown tables: a name is the
backticked text in the first cell of a table row, in the tables whose first header cell names what they list
("column" in docs/columns.md; "flag" and "test-only flag" in docs/flags.md). Other tables on those pages (status
values, peak.csv fields) are not read.

The declarations are checked here too: everything else that names columns (ROW_COLUMNS, the blocks producers fill,
report.py's pooling keys, the benchmark database's metrics) derives from them, and each producer returns only the
columns declared as its own.

Hidden flags (help=argparse.SUPPRESS, the test-only fault injection) are required too, in the "test-only flag"
table, and only there. A `--x`/`--no-x` pair (BooleanOptionalAction) is documented once, by its `--x` form.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import re
import shlex
from pathlib import Path

import pytest
from conftest import TINY, make_config

from bench.study import build_parser
from serverbench.load import loadgen, noise, windows
from serverbench.records import benchmark_db, instances, report_input, row, summary
from serverbench.schema import columns
from serverbench.schema.columns import COLUMNS, ROW_COLUMNS, Column, Group, Use
from serverbench.schema.messages import BackendReady, BackendReport, FrontendReport, RunResult
from serverbench.schema.records import LoadGenResult, NoiseStats, Window
from tests.helpers import timed_record

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"
MAX_README_LINES = 250
# What may follow a declared meaning in docs/columns.md's cell: the page's further detail, after a clause break.
MEANING_GOES_ON = ("; ", ". ", ", ", ": ", " (")

# A reference that leads outside the checkout: a design note that is not in it, a sibling folder, an issue number.
FORBIDDEN = {
    "DESIGN.md": re.compile(r"DESIGN\.md"),
    "../shared": re.compile(r"\.\./shared"),
    "an issue number": re.compile(r"\bissues?[ -]?#?\d{1,2}\b", re.IGNORECASE),
}


def markdown_files() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md")), *sorted((ROOT / "results").glob("**/NOTES.md"))]


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def table_rows(text: str, header: str) -> list[list[str]]:
    """The cells of each row of the tables whose first header cell is `header`."""
    rows: list[list[str]] = []
    lines = text.splitlines()
    current = None  # first header cell of the table being read, None outside tables
    for i, line in enumerate(lines):
        if not line.lstrip().startswith("|"):
            current = None
            continue
        if i + 1 < len(lines) and re.fullmatch(r"\s*\|(\s*:?-{3,}:?\s*\|)+\s*", lines[i + 1]):
            current = _cells(line)[0].lower()  # a header row: the next line is the separator
            continue
        if re.fullmatch(r"\s*\|(\s*:?-{3,}:?\s*\|)+\s*", line) or current != header:
            continue
        rows.append(_cells(line))
    return rows


def table_names(text: str, header: str) -> list[str]:
    """Backticked names in the first cell of each row of the tables whose first header cell is `header`."""
    return [name for row in table_rows(text, header) for name in re.findall(r"`([^`]+)`", row[0])]


def parser_flags() -> tuple[set[str], set[str]]:
    """(public flags, hidden test-only flags) of server.py, each option by its `--` spelling."""
    import server

    public: set[str] = set()
    hidden: set[str] = set()
    for action in server.build_parser()._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        if isinstance(action, argparse.BooleanOptionalAction):
            options = [action.option_strings[0]]  # --x, not --no-x
        else:
            options = [option for option in action.option_strings if option.startswith("--")]
        (hidden if action.help == argparse.SUPPRESS else public).update(options)
    return public, hidden


def drift(kind: str, in_code: set[str], documented: list[str], where: str) -> str:
    """An empty string when the two agree, else what is missing from the docs and what the docs name in excess."""
    problems = []
    missing = sorted(in_code - set(documented))
    extra = sorted(set(documented) - in_code)
    repeated = sorted({name for name in documented if documented.count(name) > 1})
    if missing:
        problems.append(f"{kind} without an entry in {where}: {', '.join(missing)}")
    if extra:
        problems.append(f"{where} names {kind} that do not exist: {', '.join(extra)}")
    if repeated:
        problems.append(f"{where} lists {kind} more than once: {', '.join(repeated)}")
    return "; ".join(problems)


def documented_rows() -> dict[str, list[str]]:
    """docs/columns.md's column tables: each row's cells by the column it names (one name per row)."""
    rows = table_rows((DOCS / "columns.md").read_text(encoding="utf-8"), "column")
    named = {}
    for cells in rows:
        found = re.findall(r"`([^`]+)`", cells[0])
        assert len(found) == 1, f"docs/columns.md: a column row names one column, not {found}: {cells}"
        named[found[0]] = cells
    return named


def shows_meaning(cell: str, meaning: str) -> bool:
    """The page's meaning is the declared one, or it, a clause break and the page's further detail."""
    return cell == meaning or any(cell.startswith(meaning + sep) for sep in MEANING_GOES_ON)


def test_docs_list_exactly_the_declared_columns_with_their_units_and_meanings() -> None:
    assert COLUMNS, "no column is declared"
    documented = table_names((DOCS / "columns.md").read_text(encoding="utf-8"), "column")
    problems = [drift("columns", set(ROW_COLUMNS), documented, "docs/columns.md")]
    rows = documented_rows()
    for column in COLUMNS:
        cells = rows.get(column.name)
        if cells is None:
            problems.append(f"add to docs/columns.md: | `{column.name}` | {column.unit} | {column.meaning} |")
            continue
        if len(cells) != 3:
            problems.append(f"{column.name}: docs/columns.md's row has {len(cells)} cells, not name, unit, meaning")
            continue
        if cells[1] != column.unit:
            problems.append(f"{column.name}: unit {cells[1]!r} in docs/columns.md, {column.unit!r} declared")
        if not shows_meaning(cells[2], column.meaning):
            problems.append(
                f"{column.name}: docs/columns.md's meaning does not begin with the declared one, "
                f"{column.meaning!r} (then {' or '.join(repr(sep) for sep in MEANING_GOES_ON)} and more)"
            )
    problem = "; ".join(p for p in problems if p)
    assert not problem, problem


def test_the_meaning_check_takes_detail_after_a_clause_break_only() -> None:
    assert shows_meaning("the forward alone", "the forward alone")
    assert shows_meaning("the H2D copy alone (CUDA events on a GPU)", "the H2D copy alone")
    assert shows_meaning("`--concurrency`; closed loop", "`--concurrency`")
    assert not shows_meaning("the H2D copy alone", "the H2D copy")  # a cut mid-sentence
    assert not shows_meaning("the forward", "the forward alone")
    assert not shows_meaning("the forward alonely", "the forward alone")


def test_the_declarations_are_sound() -> None:
    """Unique names; each block in one piece, blocks in Group's order; each producer a function that exists; the
    benchmark database's metrics ranked 1 to n; every unit given; each meaning one line."""
    assert len(set(ROW_COLUMNS)) == len(ROW_COLUMNS)
    blocks = [group for i, group in enumerate(c.group for c in COLUMNS) if i == 0 or COLUMNS[i - 1].group is not group]
    assert blocks == list(Group), blocks
    for path in {path for c in COLUMNS for path in (c.producer, *c.also_by)}:
        module, _, name = path.rpartition(".")
        assert callable(getattr(importlib.import_module(module), name, None)), f"{path}: no such function"
    ranks = sorted(c.metric_rank for c in COLUMNS if c.metric_rank is not None)
    assert ranks == list(range(1, len(ranks) + 1)), ranks
    for column in COLUMNS:
        assert column.unit and column.meaning and "\n" not in column.meaning and "|" not in column.meaning, column


def test_everything_that_names_columns_derives_from_the_declarations(monkeypatch: pytest.MonkeyPatch) -> None:
    """A column planted in the declarations shows up in the row's order, its block, every reader's list and the
    benchmark database's metrics; and each module's list is the derivation of the declarations."""
    rank = len(benchmark_db.METRICS) + 1
    planted = Column("planted_ms", "ms", "planted", COLUMNS[0].producer, Group.SUMMARY, (), tuple(Use), rank)
    declared = (*COLUMNS, planted)
    assert columns.names(declared) == (*ROW_COLUMNS, "planted_ms")
    for group in Group:
        assert ("planted_ms" in columns.group_names(declared, group)) is (group is Group.SUMMARY)
    for use in Use:
        assert columns.used_by(declared, use)[-1] == "planted_ms"
    assert list(benchmark_db.metric_units(declared).items())[-1] == ("planted_ms", "ms")
    # The modules' lists are those derivations of COLUMNS (a list spelled out again would not follow a new column).
    assert row.ROW_COLUMNS is columns.ROW_COLUMNS == columns.names(COLUMNS)
    derived = [
        (summary.REFERENCE_COLUMNS, Group.REFERENCE),
        (columns.REFERENCE_COLUMNS, Group.REFERENCE),
        (columns.CEILING_COLUMNS, Group.CEILING),
        (columns.WINDOW_COLUMNS, Group.WINDOWS),
        (noise.NOISE_COLUMNS, Group.NOISE),
        (loadgen.LOADGEN_COLUMNS, Group.LOADGEN),
        (columns.DETAIL_FILE_COLUMNS, Group.DETAIL_FILES),
        (columns.PEAK_SEARCH_COLUMNS, Group.PEAK_SEARCH),
        (row.JOB_COLUMNS, Group.JOB),
    ]
    for names, group in derived:
        assert names == columns.group_names(COLUMNS, group), group
    assert report_input.CONFIG_COLUMNS == columns.used_by(COLUMNS, Use.CONFIG)
    assert report_input.CELL_KEY_COLUMNS == columns.used_by(COLUMNS, Use.CELL)
    assert benchmark_db.CONFIGURATION == columns.used_by(COLUMNS, Use.DB_CONFIG)
    assert benchmark_db.MODEL_DETAILS == columns.used_by(COLUMNS, Use.DB_MODEL)
    assert benchmark_db.METRICS == benchmark_db.metric_units(COLUMNS)
    # The records follow METRICS: the planted metric gets a record, with its declared unit, after the others.
    monkeypatch.setattr(benchmark_db, "METRICS", benchmark_db.metric_units(declared))
    records = benchmark_db.records_from_row({"throughput": 10.0, "planted_ms": 2.5, "model": "identity"})
    assert [(r["metric"]["name"], r["metric"]["extra_info"]["unit"]) for r in records] == [
        ("throughput", "samples/s"),
        ("planted_ms", "ms"),
    ]


# Producers the row's builders call; the others fill their columns where a row is written.
WRITTEN_WITH_THE_ROW = {
    "serverbench.records.row.make_run_id",
    "serverbench.launch.peak.find_peak",
    "serverbench.launch.job.write_job_rows",
}


def test_each_producer_returns_only_and_all_the_columns_declared_as_its_own(tmp_path: Path) -> None:
    ms = 1_000_000
    records = [timed_record(0, (0, ms, 2 * ms, 3 * ms, 4 * ms, 5 * ms), warmup=True)]
    records += [timed_record(i, tuple(10 * i * ms + k * ms for k in range(6)), batch_size=2) for i in range(1, 8)]
    ready = BackendReady(
        device="cpu",
        device_name="cpu",
        device_uuid=None,
        timing_source="host_clock",
        model_build_s=1.0,
        torch_load_time_s=0.5,
        compile_time_s=None,
        torch_version="2",
        cuda_version=None,
    )
    report = FrontendReport(
        records=records,
        requests_sent=7,
        backend_ready=ready,
        instances_ready=[ready, dataclasses.replace(ready, model_build_s=2.0, instance=1)],
        loadgen=LoadGenResult("Server", str(tmp_path / "no-logs"), {"result_validity": "VALID"}),
    )
    backend = BackendReport(ceiling_before={1: [100.0, 110.0]}, ceiling_after={1: [105.0]})
    result = RunResult(status="ok", frontend=report, backend=backend, mps=False)
    cfg = make_config([*TINY, "--results_dir", str(tmp_path)])
    returned = {
        "serverbench.records.row.run_columns": row.run_columns(cfg, result),
        "serverbench.records.summary.summary_columns": summary.summary_columns(summary.summarize(records, 7)),
        "serverbench.records.row.ceiling_columns": row.ceiling_columns(cfg, backend, 90.0),
        "serverbench.load.windows.window_columns": windows.window_columns([Window(0, 10 * ms, 3, 6, 0.005)], True),
        "serverbench.load.noise.noise_columns": noise.noise_columns(NoiseStats(), None, 0.01, 0.02),
        "serverbench.records.row.environment_columns": row.environment_columns(result),
        "serverbench.records.instances.instance_columns": instances.instance_columns(
            2, records, None, report.instances_ready
        ),
        "serverbench.load.loadgen.loadgen_columns": loadgen.loadgen_columns(report.loadgen, 0.01),
        "serverbench.records.row.write_detail_files": row.write_detail_files(cfg, result, "run0"),
        "serverbench.records.row.door_columns": row.door_columns(cfg, result),
    }
    assert {c.producer for c in COLUMNS} == set(returned) | WRITTEN_WITH_THE_ROW, "a producer this test does not call"
    for path, values in returned.items():
        own = {c.name for c in COLUMNS if c.producer == path}
        allowed = own | {c.name for c in COLUMNS if path in c.also_by}
        assert set(values) <= allowed, f"{path} returns columns declared as another's: {sorted(set(values) - allowed)}"
        assert own <= set(values), f"{path} does not return its own columns {sorted(own - set(values))}"


def test_every_server_flag_is_documented_and_every_documented_flag_exists() -> None:
    public, hidden = parser_flags()
    text = (DOCS / "flags.md").read_text(encoding="utf-8")
    problems = [
        drift("flags", public, table_names(text, "flag"), "docs/flags.md"),
        drift("test-only flags", hidden, table_names(text, "test-only flag"), "docs/flags.md (test-only section)"),
    ]
    problem = "; ".join(p for p in problems if p)
    assert not problem, problem


def test_the_table_reader_reads_only_the_named_tables() -> None:
    """The checker itself: names come from the first cell of the named tables only, separators and other tables
    skipped, a table ending at the first line that is not a row."""
    text = "\n".join(
        [
            "| column | unit | meaning |",
            "| --- | --- | --- |",
            "| `a` | s | `not_a_name` in another cell |",
            "| `b`, `c` | - | two names in one cell |",
            "",
            "| status | exit | meaning |",
            "| --- | --- | --- |",
            "| `ok` | 0 | not a column |",
            "text between tables",
            "| column | unit |",
            "|:---|---:|",
            "| `d` | ms |",
        ]
    )
    assert table_names(text, "column") == ["a", "b", "c", "d"]
    assert table_names(text, "status") == ["ok"]
    message = drift("columns", {"a", "x"}, ["a", "b", "b"], "here")
    assert "without an entry in here: x" in message
    assert "names columns that do not exist: b" in message
    assert "more than once: b" in message


def test_boolean_flags_are_read_by_their_positive_form() -> None:
    public, hidden = parser_flags()
    assert "--compile" in public and "--no-compile" not in public
    assert "--help" not in public and "--batch_size" in public
    assert hidden, "the parser has no hidden test-only flags any more: drop the test-only section of docs/flags.md"
    assert not hidden & public


def test_readme_is_a_front_door() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines; at most {MAX_README_LINES}"


def readme_commands() -> list[str]:
    """The tools the README's commands run: each `python -m bench.NAME` and each `python NAME.py` (server, sweep,
    report), once."""
    text = README.read_text(encoding="utf-8")
    modules = re.findall(r"python -m (bench\.[a-z_]+)", text) + re.findall(r"python ([a-z_]+)\.py", text)
    return sorted(set(modules) | {"sweep"})  # ./sweep.sh runs sweep.py


@pytest.mark.parametrize("module", readme_commands())
def test_every_tool_the_readme_runs_answers_help(module: str, capsys: pytest.CaptureFixture) -> None:
    """Its --help, as the README's reader would first ask it: a usage line and exit 0 (in this process: the module
    imports and its parser builds)."""
    with pytest.raises(SystemExit) as ended:
        importlib.import_module(module).main(["--help"])
    assert ended.value.code == 0
    assert capsys.readouterr().out.startswith("usage: ")


def bench_command_lines() -> list[tuple[str, list[str]]]:
    """Each `python -m bench.NAME FLAGS` (or python3's) the README and docs/ give, as (module, its own flags): the
    line up to a comment, a continuation or the end of its code span, the flags after -- (the server's) left out; a
    tool only named (no flags) is --help's test."""
    found: set[tuple[str, tuple[str, ...]]] = set()
    for path in (README, *sorted(DOCS.glob("*.md"))):
        for line in re.findall(r"python3? -m (bench\.[a-z_]+\b[^`#\\\n]*)", path.read_text(encoding="utf-8")):
            module, *argv = shlex.split(line)
            found.add((module, tuple(argv[: argv.index("--")] if "--" in argv else argv)))
    return [(module, list(argv)) for module, argv in sorted(found) if argv]


@pytest.mark.parametrize("module,argv", bench_command_lines(), ids=lambda v: v if isinstance(v, str) else " ".join(v))
def test_every_bench_command_the_docs_give_takes_its_flags(module: str, argv: list[str]) -> None:
    """A command a reader copies from the README or docs/ is one its tool takes today: every flag it names is the
    tool's own, with a value it accepts (its parser only: nothing runs)."""
    tool = importlib.import_module(module)
    if hasattr(tool, "STUDY"):
        parser = build_parser(tool.STUDY)
    elif hasattr(tool, "build_parser"):
        parser = tool.build_parser()
    else:
        parser = tool._parser() if hasattr(tool, "_parser") else None
    if parser is None:  # a child the plan runs (bench.gpu_probe), not a command of the reader's
        return
    parser.parse_args(argv)  # a flag the tool does not take: its one-line error and exit 2 fail the test


def test_every_module_path_the_readme_names_exists() -> None:
    named = set(re.findall(r"`((?:[\w.-]+/)*[\w-]+\.py)`", README.read_text(encoding="utf-8")))
    missing = sorted(path for path in named if not (ROOT / path).is_file())
    assert not missing, f"README.md names files that do not exist: {', '.join(missing)}"


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_markdown_stays_inside_the_checkout(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    found = [
        f"line {text.count(chr(10), 0, m.start()) + 1}: {what} ({m.group(0)!r})"
        for what, pattern in FORBIDDEN.items()
        for m in pattern.finditer(text)
    ]
    for m in re.finditer(r"\]\(([^)\s]+)\)", text):  # relative links resolve to a file or folder in the checkout
        target = m.group(1)
        if "://" in target or target.startswith(("#", "mailto:")):
            continue
        resolved = (path.parent / target.split("#")[0]).resolve()
        if not resolved.is_relative_to(ROOT) or not resolved.exists():
            found.append(f"line {text.count(chr(10), 0, m.start()) + 1}: link to {target}, not in the checkout")
    assert not found, f"{path.relative_to(ROOT)}: " + "; ".join(found)


def test_the_forbidden_patterns_catch_what_they_are_for() -> None:
    def caught(text: str) -> bool:
        return any(pattern.search(text) for pattern in FORBIDDEN.values())

    assert caught("see DESIGN.md") and caught("../shared/notes") and caught("what issue 15 asks")
    assert caught("the issue-14 benchmark") and caught("Issue #7")
    assert not caught("https://github.com/pytorch/pytorch/issues/123177") and not caught("no issue here")
