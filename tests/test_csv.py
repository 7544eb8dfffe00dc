"""Appending rows never puts a value under the wrong header, and concurrent runs never interleave lines."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

from conftest import read_rows
from metrics import append_row


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
        ("1", "10.0", ""), ("2", "20.0", "7.5"), ("3", "30.0", "")]


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
            row["extra_%d" % (i % 3)] = i
        append_row(Path(path), row)


def test_concurrent_appends_from_several_processes_keep_every_row(tmp_path: Path) -> None:
    path = tmp_path / "shared.csv"
    ctx = mp.get_context("spawn")
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
