"""What report.py was given, and which of its rows may be pooled: a run CSV, or which other file of this project it
is; rows of one experiment that were run with different configurations; interrupted rows a later run replaced."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from serverbench.records.csv_store import UnsafeCsv, read_csv_safely
from serverbench.schema.columns import COLUMNS, Use, used_by

# The flags that make two runs different configurations: rows of one experiment, batch size and compile value
# (and load point, on a sweep's load axis) must agree on each, or their mean is no figure of anything.
CONFIG_COLUMNS = used_by(COLUMNS, Use.CONFIG)
# A sweep's cell: experiment, batch size, compile, repeat and load point; a later row of a cell replaces its
# interrupted one.
CELL_KEY_COLUMNS = used_by(COLUMNS, Use.CELL)


class ReportError(ValueError):
    """The file is not a results CSV report.py can read; the message is one line."""


REQUIRED_COLUMNS = ("batch_size", "compile")
# The columns whose values are numbers (or empty): a report averages them
NOT_NUMBERS = {"text", "bool", "path", "JSON", "CPU ids", "UTC ISO time"}
NUMERIC_COLUMNS = frozenset(column.name for column in COLUMNS if column.unit not in NOT_NUMBERS)
TRUE_TEXT = {"true", "1", "yes", "on", "1.0"}
FALSE_TEXT = {"false", "0", "no", "off", "0.0"}


@dataclass(frozen=True)
class RunCsv:
    """A results CSV's header and rows, as text, less a last line cut by a crash."""

    header: list[str]
    rows: list[dict[str, str]]
    cut_line_left_out: bool  # its last line had no newline: a crash while writing it, so that row is not read

    def cut_line_warning(self, path: Path) -> str | None:
        """What the report says of a left-out line (None when none was)."""
        if not self.cut_line_left_out:
            return None
        return f"{path}: its last line has no newline at its end (cut by a crash while writing?): that row is left out"


def read_run_csv(path: Path) -> RunCsv:
    """The file as a results CSV server.py wrote (the report's and the conversion's one check of it); ReportError
    when it is not one: unreadable, empty, binary, another file of this project, a header this tool does not
    write, a required column missing, a compile value that is neither true nor false. A last line without its
    newline is left out, as the CSV store's next append would set it aside."""
    try:
        found = read_csv_safely(path)
    except UnsafeCsv as exc:
        raise ReportError(f"{path}: not a results CSV: {exc}") from None
    except OSError as exc:
        raise ReportError(f"{path}: cannot read it ({exc.strerror})") from None
    if found is None:
        raise ReportError(f"{path}: empty")
    if (kind := other_kind(path, found.header)) is not None:
        raise ReportError(kind)
    # A sweep whose every cell failed has status rows without throughput; any other file needs it.
    wanted = REQUIRED_COLUMNS + (() if "status" in found.header else ("throughput",))
    if missing := [column for column in wanted if column not in found.header]:
        raise ReportError(f"{path}: not a results CSV: no column {', '.join(missing)}")
    cut = found.last_line_cut and bool(found.rows)
    rows = found.rows[:-1] if cut else found.rows
    if problem := _row_problem(rows, len(found.header)):
        raise ReportError(f"{path}: {problem}")
    compile_text = {row.get("compile", "").strip().lower() for row in rows}
    if unknown := sorted(compile_text - TRUE_TEXT - FALSE_TEXT):
        raise ReportError(f"{path}: compile values {unknown[:3]} are neither true nor false")
    return RunCsv(found.header, rows, cut)


def _row_problem(rows: Sequence[dict[str, str]], width: int) -> str | None:
    """The first row with fewer fields than the header (cut short, yet ended by a newline: edited by hand?) or a
    figure that is not a number, else None: either would be averaged as missing, or fail the averaging."""
    for number, row in enumerate(rows, start=2):
        if len(row) < width:
            return f"row {number} has {len(row)} fields under a header of {width} (cut short?)"
        for column in NUMERIC_COLUMNS.intersection(row):
            try:  # a list of figures (each window's, each instance's) is written ';'-separated
                [float(part or 0) for part in row[column].split(";")]
            except ValueError:
                return f"row {number}: {column} {row[column][:40]!r} is not a number"
    return None


def other_kind(path: Path, header: Sequence[str] | None) -> str | None:
    """What `path` is when it is not a run CSV this report reads (None when it may be one): a sweep's folder, a
    peak CSV, a detail file. `header`: the CSV's column names, None when it was not read as a CSV."""
    if path.is_dir():
        runs = path / "runs.csv"
        hint = f"report its rows: report.py {runs}" if runs.is_file() else "give a run CSV (a sweep's runs.csv)"
        return f"{path} is a folder; {hint}"
    columns = set(header or ())
    if "peak_rate_rps" in columns:
        return (
            f"{path} is a peak CSV (--find_peak's answer, one line per search), not a run CSV; read it as it is, "
            "or report the runs of the search (the --output_file CSV beside it)"
        )
    if "request_id" in columns:
        return f"{path} is a per-request detail file (--save_requests), not a run CSV; give the CSV its row is in"
    if {"utilisation", "power_w"} & columns and "throughput" not in columns:
        return f"{path} is a GPU or load sample file (--save_requests), not a run CSV; give the CSV its row is in"
    return None


def drop_superseded(runs: pd.DataFrame) -> pd.DataFrame:
    """Without the rows that a later run of the same cell (experiment, batch size, compile, repeat and load point)
    replaced: an interrupted row followed by any, and a failed one followed by a later `attempt` of the runner's (a
    resume's or --retry_failed's run again). Counting both would make a cell of 2 repeats read '2/3 ok' and a
    failure that its run again mended a failure still. Rows of separate runs (a hand-made CSV's, attempt 1 each) all
    stand. The runner's own rows (a crash, a timeout: no run_id) name a load only on a load axis: a load column
    they leave empty matches any."""
    if "status" not in runs.columns:
        return runs
    runs = runs.reset_index(drop=True)
    base = [column for column in ("experiment", "batch_size", "compile", "repeat") if column in runs.columns]
    loads = [column for column in CELL_KEY_COLUMNS if column in runs.columns and column not in base]
    attempt = pd.to_numeric(runs.get("attempt", pd.Series(1, index=runs.index)), errors="coerce").fillna(1)
    runners = runs["run_id"].isna() if "run_id" in runs.columns else pd.Series(False, index=runs.index)

    def same_point(i: int, j: int) -> bool:
        pairs = ((runs.at[i, column], runs.at[j, column]) for column in loads)
        return all(
            a == b or (pd.isna(a) and (runners[i] or pd.isna(b))) or (pd.isna(b) and runners[j]) for a, b in pairs
        )

    superseded = set()
    for _, group in runs.groupby(base, dropna=False, sort=False) if base else ():
        for i in group.index[group["status"] != "ok"]:
            later = [j for j in group.index if j > i and same_point(i, j)]
            if any(runs.at[i, "status"] == "interrupted" or attempt[j] > attempt[i] for j in later):
                superseded.add(i)
    return runs.drop(index=sorted(superseded)).reset_index(drop=True)


def pooled_configurations(runs: pd.DataFrame, load_column: str | None) -> str | None:
    """Why these rows cannot be reported together, or None: the first experiment (at one batch size, compile value
    and load point) whose rows differ in a flag of CONFIG_COLUMNS, with those flags and their values. Unknown
    values (rows a sweep wrote for a cell that never ran) differ from nothing."""
    present = [c for c in CONFIG_COLUMNS if c in runs.columns and c != load_column]
    by = ["experiment", "batch_size", "compile", *([load_column] if load_column else [])]
    for keys, group in runs.groupby(by, sort=True, dropna=False):
        differing = [c for c in present if group[c].dropna().astype(str).nunique() > 1]
        if differing:
            shown = ", ".join(
                f"{c} {'/'.join(sorted(group[c].dropna().astype(str).unique())[:3])}" for c in differing[:4]
            )
            return (
                f"experiment {keys[0]} at batch {keys[1]}, compile {'on' if keys[2] else 'off'} pools runs of "
                f"different configurations ({shown}); give each configuration its own --experiment name, or "
                "report them from separate CSVs"
            )
    return None
