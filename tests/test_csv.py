"""Appending rows never puts a value under the wrong header, and concurrent runs never interleave lines."""

from __future__ import annotations

import multiprocessing as mp
import random
from pathlib import Path

import pandas as pd
import pytest
from conftest import read_rows

from serverbench.records.csv_store import append_row, read_csv_safely


def test_new_file_gets_header_and_row(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "out.csv"
    append_row(path, {"batch_size": 32, "compile": False, "throughput": 123.5, "gpu_util": None})
    assert read_rows(path) == [{"batch_size": "32", "compile": "False", "throughput": "123.5", "gpu_util": ""}]


def test_rows_with_fewer_or_reordered_columns_land_under_their_headers(tmp_path: Path) -> None:
    path = tmp_path / "out.csv"
    append_row(path, {"a": 1, "b": 2, "c": 3})
    append_row(path, {"c": 30, "a": 10})
    assert read_rows(path) == [{"a": "1", "b": "2", "c": "3"}, {"a": "10", "b": "", "c": "30"}]


def test_new_columns_widen_the_header_and_keep_old_values(tmp_path: Path) -> None:
    path = tmp_path / "out.csv"
    append_row(path, {"batch_size": 1, "throughput": 10.0})
    append_row(path, {"batch_size": 2, "m_compile_time": 7.5, "throughput": 20.0})
    append_row(path, {"batch_size": 3, "throughput": 30.0})
    rows = read_rows(path)
    assert list(rows[0]) == ["batch_size", "throughput", "m_compile_time"]
    assert [(r["batch_size"], r["throughput"], r["m_compile_time"]) for r in rows] == [
        ("1", "10.0", ""),
        ("2", "20.0", "7.5"),
        ("3", "30.0", ""),
    ]


def test_values_with_commas_quotes_and_newlines_survive(tmp_path: Path) -> None:
    path = tmp_path / "out.csv"
    error = 'RuntimeError: bad "thing", then\nmore'
    append_row(path, {"status": "error", "error": error})
    assert read_rows(path) == [{"status": "error", "error": error}]


def _append_many(path: str, writer: int, count: int) -> None:
    for i in range(count):
        # Writers disagree on columns, so some appends rewrite the whole file while others append.
        row = {"writer": writer, "i": i, "payload": "x" * 2000}
        if writer % 2:
            row[f"extra_{i % 3}"] = i
        append_row(Path(path), row)


def test_concurrent_appends_from_several_processes_keep_every_row(tmp_path: Path) -> None:
    path = tmp_path / "shared.csv"
    # Forked: the writers start at once, each with the modules already imported (spawned, each would import this
    # module, torch with it, for seconds: the writers' appends would overlap less, and cost the suite seconds).
    ctx = mp.get_context("fork")
    writers = [ctx.Process(target=_append_many, args=(str(path), w, 25)) for w in range(4)]
    for p in writers:
        p.start()
    for p in writers:
        p.join(timeout=120)
        assert p.exitcode == 0
    rows = read_rows(path)
    assert len(rows) == 100
    assert sorted((int(r["writer"]), int(r["i"])) for r in rows) == [(w, i) for w in range(4) for i in range(25)]
    assert all(r["payload"] == "x" * 2000 for r in rows)
    for r in rows:  # an extra column holds a value only in the rows that wrote it, and that value is right
        for k in range(3):
            value = r.get(f"extra_{k}", "")
            if value:
                assert int(r["writer"]) % 2 == 1 and int(value) == int(r["i"]) and int(r["i"]) % 3 == k


def test_a_line_cut_by_a_crash_is_set_aside_not_kept(tmp_path: Path) -> None:
    path = tmp_path / "out.csv"
    append_row(path, {"a": 1, "b": 2})
    with open(path, "a") as f:
        f.write("3,4")  # a row cut before its newline
    append_row(path, {"a": 5, "b": 6})
    assert read_rows(path) == [{"a": "1", "b": "2"}, {"a": "5", "b": "6"}]
    [side] = tmp_path.glob("out.csv.partial-*")
    assert side.read_text() == "3,4"


# ------------------------------------------------------------------ existing files: never damaged (issue 16)


def _append_to(path: Path, content: bytes, row: dict) -> Path:
    path.write_bytes(content)
    return append_row(path, row)


def test_harmless_oddities_are_tolerated_and_every_value_stays_under_its_header(tmp_path: Path) -> None:
    cases = {
        "leading blank line": b"\nbatch_size,x\n1,2\n",
        "blank lines between rows": b"batch_size,x\n\n1,2\n\n",
        "byte-order mark": b"\xef\xbb\xbfbatch_size,x\n1,2\n",
        "CRLF": b"batch_size,x\r\n1,2\r\n",
    }
    for name, content in cases.items():
        path = tmp_path / f"{name.replace(' ', '_')}.csv"
        assert _append_to(path, content, {"batch_size": 3, "x": 4}) == path, name
        rows = [{"batch_size": "1", "x": "2"}, {"batch_size": "3", "x": "4"}]
        assert read_csv_safely(path).rows == rows, name
        assert pd.read_csv(path, dtype=str).to_dict("records") == rows, name  # what report.py reads
    assert (tmp_path / "CRLF.csv").read_bytes().endswith(b"1,2\r\n3,4\r\n")  # appended in the file's own endings
    assert (tmp_path / "byte-order_mark.csv").read_bytes().startswith(b"\xef\xbb\xbf")


def test_a_byte_order_mark_survives_a_widened_header(tmp_path: Path) -> None:
    path = tmp_path / "out.csv"
    _append_to(path, b"\xef\xbb\xbfbatch_size,x\n1,2\n", {"batch_size": 3, "x": 4, "new": 5})
    assert path.read_bytes().startswith(b"\xef\xbb\xbfbatch_size,x,new\n")
    with open(path, newline="", encoding="utf-8-sig") as f:
        import csv

        assert next(csv.DictReader(f)) == {"batch_size": "1", "x": "2", "new": ""}


def test_a_widened_crlf_file_keeps_its_line_endings(tmp_path: Path) -> None:
    path = tmp_path / "out.csv"
    _append_to(path, b"batch_size,x\r\n1,2\r\n", {"batch_size": 3, "x": 4, "new": 5})
    assert path.read_bytes() == b"batch_size,x,new\r\n1,2,\r\n3,4,5\r\n"


@pytest.mark.parametrize(
    "name,content,reason",
    [
        ("random bytes", bytes(random.Random(0).randrange(256) for _ in range(300)), "not UTF-8 text"),
        ("binary with NULs", b"a,b\n1,\x00\x00\n", "NUL bytes"),
        ("header with spaces", b"batch_size, compile\n1, False\n", "header is not one this tool writes"),
        ("row wider than its header", b"a,b\n1,2,3\n", "row 2 has 3 fields under a header of 2"),
        ("repeated header names", b"a,a\n1,2\n", "header is not one this tool writes"),
        ("notes, not a table", b"My lab notes\nrun 1 was slow\n", "its header has none of a row's columns"),
    ],
)
def test_a_file_that_is_not_a_safe_csv_is_left_exactly_as_it_is(
    tmp_path: Path, caplog, name: str, content: bytes, reason: str
) -> None:
    path = tmp_path / "out.csv"
    written = _append_to(path, content, {"a": 7, "b": 8})
    assert path.read_bytes() == content  # never rewritten or cut
    assert written == tmp_path / "out.continued.csv" and read_rows(written) == [{"a": "7", "b": "8"}]
    assert reason in caplog.text and "left as it is" in caplog.text
    assert append_row(path, {"a": 9, "b": 10}) == written  # later rows join the same side file
    assert [r["a"] for r in read_rows(written)] == ["7", "9"] and path.read_bytes() == content
    assert not list(tmp_path.glob("out.csv.partial-*"))


def test_a_row_that_cannot_be_written_at_the_end_is_kept_in_a_side_file(tmp_path: Path) -> None:
    import server

    blocker = tmp_path / "gone"
    blocker.write_text("a file where the results folder was")
    written, problem = server.save_row(blocker / "out.csv", {"a": 1}, "run42")
    assert problem is not None and written is not None and written.name == "out.unwritten-run42.csv"
    assert read_rows(written) == [{"a": "1"}]
    written.unlink()
