"""--load trace: replay the arrival times of a file, as an open loop from their intended times.

The file holds one arrival per request, in seconds from the start of the measured phase, in order:

- CSV or plain text (any name but *.jsonl): the first field of each line; a first line whose first field is not a
  number is a header (e.g. `time_s,user`), and `#` starts a comment line;
- JSONL (*.jsonl): one number, or one object with `time_s`, per line.

The trace's arrivals are the measured requests (--num_iters does not apply), each sent at its time and its latency
counted from that time, as a Poisson run's are; with --generators N, generator g sends arrivals g, g+N, g+2N, ...
The row says the trace's file name, its requests, its span and its mean rate (offered_rate_rps). The file is read
and checked while the flags are: a missing, empty, unsorted, negative or non-numeric one is one line and exit 2.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from serverbench.config.flags import ConfigError
from serverbench.config.limits import MAX_SCHEDULED_REQUESTS, MAX_SECONDS
from serverbench.config.load_kind import LoadKind, LoadSettings, Pacing
from serverbench.config.paths import check_input_file


def read_trace(path: str) -> tuple[float, ...]:
    """The arrival times of a trace file, checked: every one a finite number of seconds, none negative, none
    before the one above it, at least one. Raises ConfigError naming the file and the line."""
    where = f"--trace_file {path}"
    file = check_input_file("--trace_file", path)
    try:
        text = file.read_text(encoding="utf-8-sig")  # a spreadsheet's "CSV UTF-8" starts with a byte-order mark
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{where}: cannot be read ({type(exc).__name__}: {exc})") from None
    jsonl = file.suffix == ".jsonl"
    times: list[float] = []
    first = True  # the first line that is not blank or a comment may be a CSV header
    for number, line in enumerate(text.splitlines(), start=1):
        line = (line if jsonl else line.split("#", 1)[0]).strip()  # a CSV line's comment, whole or after its time
        if not line or line.startswith("#"):
            continue
        field = _field(line, jsonl, f"{where}, line {number}", header_allowed=first)
        first = False
        if field is HEADER:
            continue
        time_s = _seconds(field, f"{where}, line {number}")
        if times and time_s < times[-1]:
            raise ConfigError(
                f"{where}, line {number}: {time_s:g} s comes before the arrival above it ({times[-1]:g} s): "
                "the times must not decrease"
            )
        times.append(time_s)
        if len(times) > MAX_SCHEDULED_REQUESTS:
            raise ConfigError(f"{where}: more than {MAX_SCHEDULED_REQUESTS:,} arrivals; replay a part of it")
    if not times:
        raise ConfigError(f"{where}: no arrival times in it (one per line, seconds from the start)")
    return tuple(times)


HEADER = object()  # what _field gives for a CSV header line; JSON's null is a value, refused as a time


def _field(line: str, jsonl: bool, where: str, header_allowed: bool) -> object:
    """A line's time field as written; HEADER for a CSV header line (the first line, naming its columns)."""
    if jsonl:
        try:
            item = json.loads(line)
        except ValueError:
            raise ConfigError(f"{where}: not JSON ({line[:40]!r})") from None
        if isinstance(item, dict):
            if "time_s" not in item:
                raise ConfigError(f"{where}: an object without time_s")
            return item["time_s"]
        return item
    head = line.split(",", 1)[0].strip()
    try:
        float(head)
    except ValueError:
        return HEADER if header_allowed and head.isidentifier() else head  # else refused as a number
    return head


def _seconds(field: object, where: str) -> float:
    shown = "null" if field is None else repr(field)[:60]  # as the file says it
    if isinstance(field, bool) or not isinstance(field, (int, float, str)):
        raise ConfigError(f"{where}: {shown} is not a number of seconds")
    try:
        time_s = float(field)
    except ValueError:
        raise ConfigError(f"{where}: {shown} is not a number of seconds") from None
    except OverflowError:  # a JSON integer of hundreds of digits
        raise ConfigError(f"{where}: {shown} is not a finite number of seconds") from None
    if not math.isfinite(time_s):
        raise ConfigError(f"{where}: {shown} is not a finite number of seconds")
    if time_s < 0:
        raise ConfigError(f"{where}: {time_s:g} s is negative: times count from the start of the measured phase")
    if time_s > MAX_SECONDS:  # a send time the clocks' arithmetic overflows on (1e300 s): no run lasts that long
        raise ConfigError(f"{where}: {time_s:g} s is past the longest run, {MAX_SECONDS:g} s (7 days)")
    return time_s


class TraceReplay(LoadKind):
    name = "trace"
    help = "trace: the arrival times of --trace_file (CSV or JSONL, seconds from the start), as an open loop"
    owns = {"trace_file": ("--trace_file", None)}
    pacing = Pacing.SCHEDULE
    littles_law = True
    row_columns = ("offered_rate_rps", "trace_name", "trace_requests", "trace_span_s")

    def check(self, args: argparse.Namespace) -> None:
        if args.trace_file is None:
            raise ConfigError("--load trace needs --trace_file F (arrival times, seconds from the start)")
        if args.duration_s > 0:
            raise ConfigError("--duration_s with --load trace: the trace's arrivals decide how long it runs")
        if args.stability_pct is not None:
            raise ConfigError("--stability_pct with --load trace: the trace's arrivals decide when it ends")
        if args.find_peak:
            raise ConfigError("--find_peak searches with its own Poisson runs: drop --load trace")

    def resolve(self, args: argparse.Namespace) -> dict[str, Any]:
        offsets_s = read_trace(args.trace_file)
        if args.generators > len(offsets_s):
            raise ConfigError(
                f"--generators {args.generators} with a trace of {len(offsets_s)} arrival(s): each generator needs "
                "at least one"
            )
        return {"trace_offsets_s": offsets_s, "num_iters": len(offsets_s)}

    def generator_changes(self, settings: LoadSettings, index: int, count: int) -> dict[str, Any]:
        mine = settings.trace_offsets_s[index::count]
        return {"trace_offsets_s": mine, "num_iters": len(mine)}

    def offsets_s(self, settings: LoadSettings) -> Iterator[float]:
        return iter(settings.trace_offsets_s)

    def offered(self, settings: LoadSettings) -> str:
        rate_rps = _mean_rate_rps(settings.trace_offsets_s)
        return f"{Path(settings.trace_file).name}, offered {rate_rps:.4g}, " if rate_rps else ""

    def row_facts(self, settings: LoadSettings) -> dict[str, object]:
        offsets_s = settings.trace_offsets_s
        return {
            "offered_rate_rps": _mean_rate_rps(offsets_s),
            "trace_name": Path(settings.trace_file).name,
            "trace_requests": len(offsets_s),
            "trace_span_s": offsets_s[-1] - offsets_s[0],
        }


def _mean_rate_rps(offsets_s: tuple[float, ...]) -> float | None:
    """Arrivals per second over the trace's span (None for one arrival, or all at one time)."""
    span_s = offsets_s[-1] - offsets_s[0] if offsets_s else 0.0
    return (len(offsets_s) - 1) / span_s if span_s > 0 else None
