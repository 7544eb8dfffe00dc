"""The results CSV, appended to safely under a lock by any number of runs, and each run's detail files (a line
per request, per formed batch, per GPU or load sample)."""

from __future__ import annotations

import csv
import dataclasses
import fcntl
import io
import logging
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from serverbench.schema.records import GpuSample, LoadSample, RequestRecord

log = logging.getLogger("csv_store")


def _format(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return "" if value != value else repr(value)  # NaN -> empty; repr keeps full precision
    return str(value)


def _csv_text(rows: Iterable[Sequence[str]], newline: str = "\n") -> str:
    buffer = io.StringIO()
    csv.writer(buffer, lineterminator=newline).writerows(rows)
    return buffer.getvalue()


class _FileLock:
    """An exclusive flock on a side file, acquired within timeout_s or failing clearly."""

    def __init__(self, path: Path, timeout_s: float) -> None:
        self.path = path
        self.timeout_s = timeout_s
        self._file = None

    def __enter__(self) -> _FileLock:
        self._file = open(self.path, "a")
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return self
            except BlockingIOError:
                if time.monotonic() > deadline:
                    self._file.close()
                    raise TimeoutError(f"could not lock {self.path} within {self.timeout_s} s") from None
                time.sleep(0.01)  # flock has no timeout of its own

    def __exit__(self, *exc_info) -> None:
        fcntl.flock(self._file, fcntl.LOCK_UN)
        self._file.close()


class UnsafeCsv(ValueError):
    """An existing file this tool cannot append to without risking its contents; the message says why."""


@dataclass(frozen=True)
class CsvFile:
    """What an existing results CSV holds, read without changing it."""

    header: list[str]
    rows: list[dict[str, str]]
    bom: bool  # starts with a UTF-8 byte-order mark (kept when the file is rewritten)
    newline: str  # the line ending it uses, for appended lines
    last_line_cut: bool = False  # no newline at its end: the last line was cut (a crash while writing it?)


def read_csv_safely(path: Path) -> CsvFile | None:
    """The file's header and rows, tolerating what is harmless (a byte-order mark, blank lines, CRLF); None when
    it is empty. UnsafeCsv when appending could misplace or lose a value: bytes that are not UTF-8 text, a header
    with empty, repeated or padded names, or a row with more fields than the header."""
    data = path.read_bytes()
    bom = data.startswith(b"\xef\xbb\xbf")
    try:
        text = data[3 if bom else 0 :].decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UnsafeCsv(f"not UTF-8 text (byte {exc.start})") from None
    if "\0" in text:
        raise UnsafeCsv("it holds NUL bytes (binary data)")
    lines = [fields for fields in csv.reader(io.StringIO(text, newline="")) if fields]  # blank lines: no fields
    if not lines:
        return None
    header, body = lines[0], lines[1:]
    if any(not name or name != name.strip() for name in header) or len(set(header)) != len(header):
        raise UnsafeCsv(f"its header is not one this tool writes: {','.join(header)[:80]!r}")
    for number, fields in enumerate(body, start=2):
        if len(fields) > len(header):
            raise UnsafeCsv(f"row {number} has {len(fields)} fields under a header of {len(header)}")
    rows = [dict(zip(header, fields)) for fields in body]
    newline = "\r\n" if "\r\n" in text.split("\n", 1)[0] + "\n" else "\n"
    return CsvFile(header, rows, bom, newline, last_line_cut=not text.endswith("\n"))


def append_row(path: Path, row: Mapping[str, object], lock_timeout_s: float = 60.0) -> Path:
    """Appends `row` to the CSV at `path` so that no value ever lands under the wrong header; returns the file the
    row went to.

    Under an exclusive lock (several runs may share one file): a new file gets header and row; a row whose
    columns the header already has is appended in the header's order with one write; a row with new columns
    makes the file be rewritten (atomically) with the union of columns, old rows keeping their values. A file
    that is not a CSV this tool can append to safely (read_csv_safely) is left exactly as it is: the row goes to
    a new file beside it, and a warning says so.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _FileLock(path.with_name(f".{path.name}.lock"), lock_timeout_s):
        try:
            found = read_csv_safely(path) if path.exists() else None  # before anything touches it
            if found is not None and not set(found.header) & set(row):  # notes, another tool's table: not ours
                raise UnsafeCsv(f"its header has none of a row's columns: {','.join(found.header)[:80]!r}")
        except UnsafeCsv as exc:
            side = _side_file(path)
            log.warning(
                "%s is not a CSV this tool can append to safely (%s): left as it is; the row goes to %s",
                path,
                exc,
                side,
            )
            return append_row(side, row, lock_timeout_s)
        _set_aside_cut_line(path)
        existing = read_csv_safely(path) if path.exists() else None
        if existing is None:
            _write_atomically(path, _csv_text([list(row), [_format(v) for v in row.values()]]))
        elif set(row) <= set(existing.header):
            with open(path, "a", encoding="utf-8", newline="") as f:
                writer = csv.writer(f, lineterminator=existing.newline)
                writer.writerow([_format(row.get(column)) for column in existing.header])
                f.flush()
                os.fsync(f.fileno())
        else:
            columns = existing.header + [column for column in row if column not in existing.header]
            lines = [columns] + [[old.get(c) or "" for c in columns] for old in existing.rows]
            lines.append([_format(row.get(c)) for c in columns])
            _write_atomically(path, ("\ufeff" if existing.bom else "") + _csv_text(lines, existing.newline))
            log.info("%s: header widened with %s", path, [c for c in columns if c not in existing.header])
    return path


def _side_file(path: Path) -> Path:
    """Where rows go when `path` cannot take them: <stem>.continued<suffix>, or a dated name when that one cannot
    either."""
    side = path.with_name(f"{path.stem}.continued{path.suffix}")
    try:
        if side.exists():
            read_csv_safely(side)
        return side
    except (UnsafeCsv, OSError):
        return path.with_name(f"{path.stem}.{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}{path.suffix}")


def _set_aside_cut_line(path: Path) -> None:
    """A file whose last line was cut by a crash (no final newline) has that line moved to a side file, never
    kept under the headers as if it were a row."""
    if not path.exists() or path.stat().st_size == 0:
        return
    with open(path, "rb+") as f:
        f.seek(-1, os.SEEK_END)
        if f.read(1) == b"\n":
            return
        f.seek(0)
        data = f.read()
        keep = data.rfind(b"\n") + 1  # 0 when even the header was cut
        side = path.with_name(f"{path.name}.partial-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}")
        side.write_bytes(data[keep:])
        f.truncate(keep)
        f.flush()
        os.fsync(f.fileno())
    log.warning("%s: its last line was cut (a crash while writing?); moved it to %s", path, side)


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# ------------------------------------------------------------------------------------- per-run detail files


def write_request_records(path: Path, records: Sequence[RequestRecord]) -> None:
    """One line per request (the warm-up included, flagged), for latency distributions and timelines."""
    import pandas as pd

    frame = pd.DataFrame([dataclasses.asdict(r) for r in records])
    if not frame.empty:
        frame["latency_s"] = (frame["received_ns"] - frame["sent_ns"]) / 1e9
    path.parent.mkdir(parents=True, exist_ok=True)
    frame.to_csv(path, index=False)


def write_formed_batches(path: Path, records: Sequence[RequestRecord]) -> None:
    """Dynamic batching: one line per forward (formed batch): when it was closed, its size, its padding and the
    requests it served, oldest first."""
    import pandas as pd

    frame = pd.DataFrame(
        [dataclasses.asdict(r) for r in records if r.batch_id is not None],
        columns=[f.name for f in dataclasses.fields(RequestRecord)],
    )
    batches = frame.groupby(["instance", "batch_id"], sort=True).agg(
        formed_ns=("formed_ns", "first"),
        formed_images=("formed_images", "first"),
        padded_images=("padded_images", "first"),
        warmup=("warmup", "any"),
        requests=("request_id", "count"),
        request_ids=("request_id", lambda ids: ";".join(str(i) for i in sorted(ids))),
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    batches.reset_index().to_csv(path, index=False)


def write_samples(path: Path, samples: Sequence[GpuSample | LoadSample], kind: type) -> None:
    """GPU or load samples of one run, one line each; the header is written even when there are none."""
    import pandas as pd

    path.parent.mkdir(parents=True, exist_ok=True)
    columns = [f.name for f in dataclasses.fields(kind)]
    pd.DataFrame([dataclasses.asdict(s) for s in samples], columns=columns).to_csv(path, index=False)
