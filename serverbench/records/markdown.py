"""Markdown tables, written one way for every report (report.py's summary, the bench studies' reports): a header, its
rule, a line per row; a cell's "|" escaped and its line breaks flattened, so that no value can break a table."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence


def table_cell(value: object) -> str:
    return " ".join(str(value).split("\n")).replace("|", "\\|")


def table_row(cells: Iterable[object]) -> str:
    return "| " + " | ".join(table_cell(cell) for cell in cells) + " |"


def table_head(header: Sequence[object] | str, right: int = 0) -> list[str]:
    """The header line and its rule; `header` the cells, or the header line as markdown ("| a | b |"); the last
    `right` columns aligned right (numbers)."""
    cells = header.strip().strip("|").split(" | ") if isinstance(header, str) else header
    rule = "|" + " --- |" * (len(cells) - right) + " ---: |" * right
    return [table_row(cell.strip() if isinstance(cell, str) else cell for cell in cells), rule]


def table(header: Sequence[object] | str, rows: Iterable[Iterable[object]]) -> list[str]:
    return [*table_head(header), *(table_row(row) for row in rows)]


def figure(value: object, fmt: str = ".1f", scale: float = 1.0, missing: str = "n/a", unit: str = "") -> str:
    """A number as a report shows it: `value` x `scale` in `fmt`, then `unit`; `missing` where there is none (None,
    NaN, infinite), so that no table says "nan"."""
    if value is None or not math.isfinite(number := float(value)):  # type: ignore[arg-type]
        return missing
    return format(number * scale, fmt) + unit
