"""The docs cannot drift from the code: every CSV column a row can have and every server.py flag has an entry in
docs/, and docs/ names none that no longer exists; README.md stays a front door (at most 250 lines, every module
path it names exists); no markdown file points outside the checkout.

Sources of truth: `serverbench.records.row.ROW_COLUMNS` for the columns, `server.build_parser()` for the flags.
The docs side is read from markdown tables: a name is the backticked text in the first cell of a table row, in
the tables whose first header cell names what they list ("column" in docs/columns.md; "flag" and "test-only flag"
in docs/flags.md). Other tables on those pages (status values, peak.csv fields) are not read.

Hidden flags (help=argparse.SUPPRESS, the test-only fault injection) are required too, in the "test-only flag"
table, and only there. A `--x`/`--no-x` pair (BooleanOptionalAction) is documented once, by its `--x` form.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"
MAX_README_LINES = 250

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


def table_names(text: str, header: str) -> list[str]:
    """Backticked names in the first cell of each row of the tables whose first header cell is `header`."""
    names: list[str] = []
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
        names += re.findall(r"`([^`]+)`", _cells(line)[0])
    return names


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


def test_every_row_column_is_documented_and_every_documented_column_exists() -> None:
    from serverbench.records.row import ROW_COLUMNS

    assert ROW_COLUMNS, "ROW_COLUMNS is empty"
    documented = table_names((DOCS / "columns.md").read_text(encoding="utf-8"), "column")
    problem = drift("columns", set(ROW_COLUMNS), documented, "docs/columns.md")
    assert not problem, problem


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
