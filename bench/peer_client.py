"""A client nobody here wrote against our own on the same server: Triton's perf_analyzer and our load generator take
turns at one `server.py --serve_only` door per protocol, so that our p99 and throughput can be read against a peer's.

    python -m bench.peer_client --out results/peer_client
    python -m bench.peer_client --out results/peer_client --report_only      # the report again, from <out>

Per protocol (`--protocols http grpc`) one server (identity, 16x16, one image per request, `--design serial`, a free
port), up for all of that protocol's runs, then stopped with SIGTERM: its row, from the door's own records, goes to
<out>/served.csv. Against it, at each `--concurrency` (1 4 16), in an order shuffled per repeat (`--repeats 3`):
perf_analyzer (synchronous, count windows of `--pa_requests`, binary tensors; its CSV, profile export and output in
<out>/perf_analyzer/) and our generator (`server.py --target URL --load closed`; rows in <out>/ours.csv). The door's
statistics, read around every run, give both clients' server-side breakdown. Each run is a line of <out>/runs.csv.

<out>/peer_client.md (printed): per protocol and concurrency both clients' requests/s, p50 and p99 (medians over
repeats, min-max), ours over perf_analyzer's, the target (p99 ratio within 0.9-1.1 at concurrency 1 and 4), every
failure, what each side's latency includes. Exit status 1 when a run failed (perf_analyzer must finish with zero
errors) or a target was missed; 2 when perf_analyzer cannot be brought, before anything starts. Run nothing else on
the machine meanwhile: both clients share its cores with the server.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import pandas as pd
from tritonclient.grpc import service_pb2, service_pb2_grpc

from bench import perf_analyzer as pa
from bench.launch import (
    FLAG_CHECK_ADDRESS,
    check_server_flags,
    interruptible,
    run_meta,
    run_target,
    server_command,
    start_served,
    stop_served,
)
from serverbench.config.design_kinds import DESIGNS
from serverbench.config.flags import ConfigError, OneLineErrorParser, bounded
from serverbench.config.limits import MAX_BATCH_IMAGES, MAX_REPEATS
from serverbench.config.paths import parse_bench_args
from serverbench.config.transport_kinds import HTTP
from serverbench.launch.session import Session
from serverbench.records.markdown import table_head
from serverbench.schema.ab import shuffled
from serverbench.system.process import one_line

ROOT = Path(__file__).resolve().parent.parent
PROG = "python -m bench.peer_client"
RUNS_CSV, OURS_CSV, SERVED_CSV, META_JSON = "runs.csv", "ours.csv", "served.csv", "meta.json"
REPORT_MD, PA_DIR, LOGS_DIR = "peer_client.md", "perf_analyzer", "logs"
PROTOCOLS = ("http", "grpc")
TOOLS = ("perf_analyzer", "ours")
TARGET_RATIO = (0.9, 1.1)  # our p99 / perf_analyzer's
TARGET_CONCURRENCIES = (1, 4)
READY_TIMEOUT_S = 120.0  # the server's start: the door listening and the backend's model built
OURS_TIMEOUT_S = 900.0  # a backstop: server.py ends a stuck run itself (--timeout_s)
PA_TIMEOUT_S = 600.0  # at most --pa_max_trials windows, each about a second at these rates
STATS_TIMEOUT_S = 10.0
SERVING_LINE = re.compile(r"serving on \w+://(\S+):(\d+) until")
# tritonclient's gRPC client shares a channel (one HTTP/2 connection) among this many clients, 6 by default: at
# concurrency 16 perf_analyzer's 16 workers and its statistics client would use 3 connections. Our generator sends
# every request in flight on one channel, so perf_analyzer is asked to do the same (unless the variable is set).
GRPC_SHARE_ENV = "TRITON_CLIENT_GRPC_CHANNEL_MAX_SHARE_COUNT"
DOOR_STAGES = ("success", "queue", "compute_input", "compute_infer", "compute_output")
PA_EXTRAS = tuple(name for name in pa.LATENCY_COLUMNS_US if not name.startswith("p"))  # client send ... compute output
FIELDS = (
    *("protocol", "concurrency", "repeat", "order", "tool", "ok", "error"),
    *("throughput_rps", "p50_latency_s", "p99_latency_s", "requests", "wall_s", "export_p99_latency_s"),
    *PA_EXTRAS,
    *("door_requests", "door_failed", *(f"door_{stage}_s" for stage in DOOR_STAGES)),
    "detail",
)

NOTES = """## What the figures include

- perf_analyzer's p50/p99 (its CSV's) are client-side, per request: from just before its client library's blocking
  Infer call (which builds the request: JSON header and tensor copied into the HTTP body, or the gRPC message) until
  it returns with the whole answer received and parsed; its default synchronous mode: a thread and a client per
  concurrent request; over the requests of its last three count windows (the stable ones), as its profile export
  lists them. A window lasts at least a second (it checks the count once a second): `--pa_requests {pa_requests}`
  is a floor. runs.csv's `export_p99_latency_s` is the nearest-rank p99 of that export's requests (last response
  minus start); perf_analyzer's own p99 is not exactly that figure at higher concurrency.
- Ours (ours.csv) count from the moment our sender thread begins a request (encoding included) until our network
  thread has its answer read whole and parsed: one hand-off between Python threads (sender to the event loop) that
  perf_analyzer's blocking calls do not have, on the cores the server uses too; `--our_iters {our_iters}` requests
  after one warm-up; req/s is `achieved_rate_rps` (answered over first send to last answer). HTTP: a keep-alive
  connection per request in flight, as perf_analyzer; gRPC: grpc.aio, one channel for all requests.
- gRPC: perf_analyzer ran with `{share}` (clients per channel; its default, 6, gives ceil((concurrency + 1) / 6)
  connections, its statistics client included), so that its requests share one HTTP/2 connection as ours do.
- Server side: the door's statistics read before and after every run of either client, per request: `door whole`
  is its time from a request's arrival to its answer written (Triton's `success`); queue: arrival to the formed
  batch; compute input, infer, output: H2D, predict, D2H; our warm-up request included. perf_analyzer's own
  columns are the same counters over its windows; its network+server is its wait minus the server's queue and
  compute. A server's row is the door's records of both clients' runs.
"""


@dataclass(frozen=True)
class Settings:
    """What a measurement was asked, kept in <out>/meta.json so that --report_only reads it back."""

    protocols: tuple[str, ...]
    concurrency: tuple[int, ...]
    repeats: int
    seed: int
    pa_requests: int
    pa_stability_pct: float
    pa_max_trials: int
    our_iters: int
    model: str
    image_size: int
    batch_size: int
    design: str

    def served_flags(self, protocol: str) -> list[str]:
        return [
            *("--serve_only", "--transport", protocol, "--port", "0", "--model", self.model),
            *("--image_size", str(self.image_size), "--batch_size", str(self.batch_size), "--design", self.design),
            *("--device", "cpu", "--experiment", f"served_{protocol}"),
        ]

    def our_flags(self, protocol: str, address: str, concurrency: int, repeat: int) -> list[str]:
        return [
            *("--target", f"{protocol}://{address}", "--model", self.model, "--image_size", str(self.image_size)),
            *("--batch_size", str(self.batch_size), "--load", "closed", "--concurrency", str(concurrency)),
            *("--num_iters", str(self.our_iters), "--device", "cpu", "--experiment", f"{protocol}_c{concurrency}"),
            *("--repeat", str(repeat), *(["--binary_data"] if protocol == HTTP.name else [])),
        ]


@dataclass
class Served:
    protocol: str
    session: Session
    address: str  # host:port

    @property
    def log_path(self) -> Path:
        return self.session.log_path


class ServerRefused(Exception):
    """server.py refused what it was given, in one line and exit 2, before it served (a model it cannot build, a
    port taken): the tool stops with that line instead of reporting every run as failed."""


def start_door(settings: Settings, protocol: str, out: Path) -> Served | str:
    """server.py --serve_only through the one launcher, its output in a log file, once its door listens and its model
    is built; the one line saying why when it does not within READY_TIMEOUT_S."""
    command = server_command(settings.served_flags(protocol), out, SERVED_CSV)
    found: list[str] = []

    def serving(session: Session) -> bool:
        text = session.log_text()
        match = SERVING_LINE.search(text)
        if match and "ready on" in text:
            found.append(f"{match.group(1)}:{match.group(2)}")
        return bool(found)

    log_path = out / LOGS_DIR / f"served_{protocol}.log"
    session, problem = start_served(command, log_path, serving, "server.py --serve_only", READY_TIMEOUT_S)
    if problem and session.poll() == 2:  # refused before anything started: every run would be refused alike
        raise ServerRefused(last_line(session.log_text()))
    return problem or Served(protocol, session, found[0])


def stop_door(served: Served, out: Path) -> dict[str, object]:
    """The server stopped as stop_served does; its line of runs.csv, which its row must say is ok."""
    error = stop_served(served.session, "server.py --serve_only")
    rows = _read_csv(out / SERVED_CSV)
    rows = rows[rows["experiment"] == f"served_{served.protocol}"] if len(rows) else rows
    if not error and (rows.empty or rows["status"].iloc[-1] != "ok"):
        error = "server.py --serve_only wrote no ok row" + (f": {rows['error'].iloc[-1]}" if len(rows) else "")
    return {"tool": "server", "ok": not error, "error": error, "detail": str(served.log_path.relative_to(out))}


def door_statistics(served: Served, model: str) -> dict[str, tuple[int, int]] | None:
    """The door's cumulative statistics (Triton's): {stage: (count, ns)} for success, fail, queue, compute_*; None
    when they cannot be read (a side figure: its absence is said, the run goes on)."""
    try:
        return _door_statistics(served.protocol, served.address, model)
    except Exception as exc:  # noqa: BLE001 - whatever the client library raises
        print(f"{PROG}: the door's statistics could not be read: {one_line(exc)}", file=sys.stderr, flush=True)
        return None


def _door_statistics(protocol: str, address: str, model: str) -> dict[str, tuple[int, int]]:
    names = (*DOOR_STAGES, "fail")
    if protocol == HTTP.name:
        url = f"http://{address}/v2/models/{model}/stats"
        with urllib.request.urlopen(url, timeout=STATS_TIMEOUT_S) as answer:
            stats = json.loads(answer.read())["model_stats"][0]["inference_stats"]
        return {name: (int(stats[name]["count"]), int(stats[name]["ns"])) for name in names}
    with grpc.insecure_channel(address) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        reply = stub.ModelStatistics(service_pb2.ModelStatisticsRequest(name=model), timeout=STATS_TIMEOUT_S)
    stats = reply.model_stats[0].inference_stats
    return {name: (getattr(stats, name).count, getattr(stats, name).ns) for name in names}


def door_delta(before: dict[str, tuple[int, int]] | None, after: dict[str, tuple[int, int]] | None) -> dict:
    """What the door counted during one run: its requests, failures and mean seconds per request of each stage."""
    if before is None or after is None:
        return {}
    delta = {name: (after[name][0] - before[name][0], after[name][1] - before[name][1]) for name in after}
    found: dict[str, object] = {"door_requests": delta["success"][0], "door_failed": delta["fail"][0]}
    for stage in DOOR_STAGES:
        count, ns = delta[stage]
        found[f"door_{stage}_s"] = ns / count / 1e9 if count else None
    return found


def run_pa(settings: Settings, served: Served, concurrency: int, label: str, out: Path) -> dict[str, object]:
    """One perf_analyzer run and its line of runs.csv; its output next to its CSV and profile export."""
    options = {"concurrency": concurrency, "batch_size": settings.batch_size, "max_trials": settings.pa_max_trials}
    options |= {"measurement_request_count": settings.pa_requests, "stability_percentage": settings.pa_stability_pct}
    files = {"csv_file": out / PA_DIR / f"{label}.csv", "profile_export_file": out / PA_DIR / f"{label}.json"}
    run = pa.PerfAnalyzerRun(
        settings.model, served.address, protocol=served.protocol, timeout_s=PA_TIMEOUT_S, **files, **options
    )
    result = pa.run_perf_analyzer(run)
    (out / PA_DIR / f"{label}.log").write_text(f"$ {shlex.join(result.command)}\n{result.stdout}", encoding="utf-8")
    latencies_s = export_latencies_s(run.profile_export_file) if result.ok else []
    found = {name: getattr(result, name) for name in ("ok", "error", "p50_latency_s", "p99_latency_s", "wall_s")}
    found |= {name: getattr(result, name) for name in PA_EXTRAS}
    found["throughput_rps"] = None if result.throughput_per_s is None else result.throughput_per_s / settings.batch_size
    found |= {"requests": len(latencies_s) or None, "export_p99_latency_s": nearest_rank(latencies_s, 99.0)}
    return {**found, "detail": str(run.csv_file.relative_to(out))}


def export_latencies_s(path: Path) -> list[float]:
    """Every request of perf_analyzer's profile export (its stable windows): its last response minus its start."""
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    return [
        (request["response_timestamps"][-1] - request["timestamp"]) / 1e9
        for experiment in document.get("experiments", [])
        for request in experiment.get("requests", [])
        if request.get("response_timestamps")
    ]


def nearest_rank(values: Sequence[float], pct: float) -> float | None:
    """The pct-th percentile by nearest rank (no interpolation)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * pct / 100))] if ordered else None


def run_ours(
    settings: Settings, served: Served, concurrency: int, repeat: int, label: str, out: Path
) -> dict[str, object]:
    """One run of our generator against the door and its line of runs.csv; its row goes to ours.csv."""
    flags = settings.our_flags(served.protocol, served.address, concurrency, repeat)
    return run_target(flags, out, OURS_CSV, out / LOGS_DIR / f"ours_{label}.log", OURS_TIMEOUT_S)


def run_order(settings: Settings, protocol: str, repeat: int) -> list[tuple[str, int]]:
    """Both clients at every concurrency once, shuffled by the seed, the protocol and the repeat: a drift of the
    machine falls on both alike."""
    return shuffled(
        [(tool, concurrency) for concurrency in settings.concurrency for tool in TOOLS], settings.seed, protocol, repeat
    )


def measure_protocol(settings: Settings, protocol: str, out: Path) -> None:
    """One server for the protocol, every run against it, then the server stopped; a line of runs.csv each."""
    served = start_door(settings, protocol, out)
    if isinstance(served, str):
        append_run(out, {"protocol": protocol, "tool": "server", "ok": False, "error": served})
        return
    order = 0
    try:
        for repeat in range(settings.repeats):
            for tool, concurrency in run_order(settings, protocol, repeat):
                order += 1
                where = {"protocol": protocol, "concurrency": concurrency, "repeat": repeat, "order": order}
                if served.session.poll() is not None:
                    why = f"server.py --serve_only had ended (exit {served.session.poll()}); see {served.log_path}"
                    append_run(out, {**where, "tool": tool, "ok": False, "error": why})
                    return
                label = f"{protocol}_c{concurrency}_r{repeat}"
                print(f"[{protocol} {order}] {tool} at concurrency {concurrency}, repeat {repeat}", flush=True)
                before = door_statistics(served, settings.model)
                if tool == "perf_analyzer":
                    found = run_pa(settings, served, concurrency, label, out)
                else:
                    found = run_ours(settings, served, concurrency, repeat, label, out)
                found.update(door_delta(before, door_statistics(served, settings.model)))
                if found["ok"] and found.get("door_failed"):  # an error answer a client did not count
                    found.update(ok=False, error=f"the door answered {found['door_failed']} requests with an error")
                append_run(out, {**where, "tool": tool, **found})
    finally:
        append_run(out, {"protocol": protocol, "order": order + 1, **stop_door(served, out)})


def append_run(out: Path, line: dict[str, object], fields: Sequence[str] = FIELDS) -> None:
    """A line of runs.csv (columns `fields`), written at once: an interrupted measurement keeps the runs it made."""
    path = out / RUNS_CSV
    new = not path.exists()
    with open(path, "a", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="raise")
        if new:
            writer.writeheader()
        writer.writerow({name: ("" if value is None else value) for name, value in line.items()})


def _read_csv(path: Path) -> pd.DataFrame:
    return pd.read_csv(path) if path.exists() else pd.DataFrame()


def last_line(text: str) -> str:
    return pa.last_line(text) or "no output"


def spread(values: Sequence[float], scale: float = 1.0, digits: int = 0) -> str:
    """Median (min-max), or the one value, or n/a."""
    shown = [v * scale for v in values]
    if not shown:
        return "n/a"
    median = f"{statistics.median(shown):,.{digits}f}"
    return median if len(shown) == 1 else f"{median} ({min(shown):,.{digits}f}-{max(shown):,.{digits}f})"


def _ok_values(group: pd.DataFrame, tool: str, column: str) -> pd.Series:
    """The ok runs' values of a column, by repeat."""
    found = group[(group["tool"] == tool) & group["ok"]]
    return found.set_index("repeat")[column].dropna().astype(float)


def ratio(group: pd.DataFrame, column: str) -> tuple[str, float | None]:
    """Ours over perf_analyzer's, of the medians over repeats, with the range of the repeats' own ratios."""
    ours, theirs = _ok_values(group, "ours", column), _ok_values(group, "perf_analyzer", column)
    if ours.empty or theirs.empty or theirs.median() <= 0:
        return "n/a", None
    each = [ours[r] / theirs[r] for r in ours.index.intersection(theirs.index) if theirs[r] > 0]
    value = float(ours.median() / theirs.median())
    return f"{value:.2f}" + (f" ({min(each):.2f}-{max(each):.2f})" if len(each) > 1 else ""), value


def summary_table(runs: pd.DataFrame, protocol: str) -> tuple[list[str], list[tuple[str, bool]]]:
    """Per concurrency: both clients' requests/s, p50 and p99, the ratios, and the p99 target where it applies."""
    lines = [
        *table_head(
            "| concurrency | ok runs (PA / ours) | PA req/s | ours req/s | ours / PA req/s | PA p50 ms | "
            "ours p50 ms | PA p99 ms | ours p99 ms | ours / PA p99 | p99 target (0.9-1.1) |"
        ),
    ]
    verdicts = []
    for concurrency, group in runs.groupby("concurrency", sort=True):
        concurrency = int(concurrency)
        counts = [f"{len(_ok_values(group, tool, 'p99_latency_s'))}/{(group['tool'] == tool).sum()}" for tool in TOOLS]
        cells = [spread(list(_ok_values(group, tool, "throughput_rps"))) for tool in TOOLS]
        cells.append(ratio(group, "throughput_rps")[0])
        for column in ("p50_latency_s", "p99_latency_s"):
            cells += [spread(list(_ok_values(group, tool, column)), 1e3, 3) for tool in TOOLS]
        p99_text, p99_ratio = ratio(group, "p99_latency_s")
        verdict = "(shown)"
        if concurrency in TARGET_CONCURRENCIES:
            met = p99_ratio is not None and TARGET_RATIO[0] <= p99_ratio <= TARGET_RATIO[1]
            verdict = "met" if met else "NOT met"
            verdicts.append((f"{protocol} concurrency {concurrency}: our p99 / perf_analyzer's {p99_text}", met))
        lines.append(f"| {concurrency} | {' / '.join(counts)} | " + " | ".join([*cells, p99_text, verdict]) + " |")
    return lines, verdicts


def _us(frame: pd.DataFrame, column: str) -> str:
    """A column of seconds as microseconds: median (min-max) over the frame's rows."""
    return spread(list(frame[column].dropna().astype(float)), 1e6, 0) if column in frame else "n/a"


def breakdown_table(runs: pd.DataFrame) -> list[str]:
    """The door's statistics during each client's runs (µs per request, medians over repeats), and perf_analyzer's
    own view of the same counters over its windows, with its client-side split."""
    lines = [
        *table_head(
            "| concurrency | client | door requests per run | door whole | queue | compute input | "
            "compute infer | compute output | PA's columns: queue / input / infer / output | "
            "PA: client send / network+server / client recv |"
        ),
    ]
    for (concurrency, tool), group in runs.groupby(["concurrency", "tool"], sort=True):
        ok = group[group["ok"]]
        own = extra = ""
        if tool == "perf_analyzer":
            own = " / ".join(_us(ok, f"server_{stage}_s") for stage in ("queue", *DOOR_STAGES[2:]))
            extra = " / ".join(_us(ok, name) for name in ("client_send_s", "network_server_s", "client_recv_s"))
        stages = " | ".join(_us(ok, f"door_{stage}_s") for stage in DOOR_STAGES)
        requests = spread(list(ok["door_requests"].dropna().astype(float)))
        lines.append(f"| {int(concurrency)} | {tool} | {requests} | {stages} | {own} | {extra} |")
    return lines


def _ms(row: pd.Series, column: str, scale: float = 1.0) -> str:
    value = row.get(column)
    return "n/a" if value is None or pd.isna(value) else f"{float(value) * scale:.3f}"


def served_table(served: pd.DataFrame) -> list[str]:
    """Each server's own row: the door's records of every request it answered, both clients' together."""
    lines = [
        *table_head(
            "| server | status | requests (after warm-up) | door p50 ms | door p99 ms | queue ms | h2d ms | "
            "predict ms | d2h ms | back to the door ms | answered | error answers | disconnects |"
        ),
    ]
    for _, row in served.iterrows():
        stages = " | ".join(
            _ms(row, f"mean_{name}_ms") for name in ("request_queue", "h2d", "predict", "d2h", "response_queue")
        )
        counts = " | ".join(str(row.get(name, "")) for name in ("door_answered", "door_errors", "door_disconnects"))
        lines.append(
            f"| {row['experiment']} | {row['status']} | {row.get('requests_sent', '')} | "
            f"{_ms(row, 'p50_latency_s', 1e3)} | {_ms(row, 'p99_latency_s', 1e3)} | {stages} | {counts} |"
        )
    return lines


def notes(meta: dict) -> str:
    """What each side's figures include."""
    settings = meta["settings"]
    return NOTES.format(share=f"{GRPC_SHARE_ENV}={meta['grpc_channel_share']}", **settings)


def header(meta: dict, served: pd.DataFrame) -> list[str]:
    settings = meta["settings"]
    cpu = ", ".join(sorted(set(served["device_name"].dropna().astype(str)))) if "device_name" in served else ""
    server = shlex.join(Settings(**settings).served_flags("http")[:-2]).replace("http", "http|grpc")
    return [
        "# perf_analyzer and our generator against the same door",
        "",
        f"- command: `{meta['command']}`",
        f"- date: {meta['date']}; commit: {meta['commit']}",
        f"- machine: {cpu or 'CPU model unknown'}; {meta['cores']} usable CPU cores ({meta['cpus_online']} online)",
        f"- server: `server.py {server}`, one per protocol, up for all of its runs",
        f"- perf_analyzer: {meta['perf_analyzer']}, synchronous (its default), count windows of at least "
        f"{settings['pa_requests']} requests, stable within {settings['pa_stability_pct']:g} % on throughput and "
        f"mean latency over 3 windows, at most {settings['pa_max_trials']} windows; ours: `server.py --target URL "
        f"--load closed --num_iters {settings['our_iters']}`, binary tensors over HTTP",
        f"- {settings['repeats']} repeat(s), each in its own shuffled order (seed {settings['seed']}); figures are "
        "medians over the ok repeats (min-max); ratios are of the medians (the repeats' own ratios' range)",
        "",
    ]


def build_report(out: Path) -> tuple[str, bool]:
    """The report from <out>'s files, and whether anything failed or missed its target."""
    meta = json.loads((out / META_JSON).read_text(encoding="utf-8"))
    runs = _read_csv(out / RUNS_CSV)
    runs["ok"] = runs["ok"].astype(str) == "True"
    served = _read_csv(out / SERVED_CSV)
    lines = header(meta, served)
    verdicts: list[tuple[str, bool]] = []
    measured = runs[runs["tool"].isin(TOOLS)]
    for protocol in meta["settings"]["protocols"]:
        group = measured[measured["protocol"] == protocol]
        lines += [f"## {protocol.upper()}", ""]
        if group.empty:
            lines += ["Nothing measured (see Failures).", ""]
            continue
        table, found = summary_table(group, protocol)
        verdicts += found
        lines += [*table, "", "Server side, µs per request:", "", *breakdown_table(group), ""]
    lines += ["## The servers' own rows (`served.csv`)", ""]
    lines += [*(served_table(served) if len(served) else ["No server row."]), ""]
    failed = runs[~runs["ok"]]
    lines += ["## Failures", "", *(failure_lines(failed) or ["- none"]), "", "## Targets", ""]
    marks = {True: "met", False: "NOT met"}
    lines += [f"- {marks[met]}: {text} (target 0.9-1.1)" for text, met in verdicts]
    lines += [] if verdicts else ["- none measured (they are at concurrency 1 and 4)"]
    return "\n".join([*lines, "", notes(meta)]), bool(len(failed)) or not all(met for _, met in verdicts)


def failure_lines(failed: pd.DataFrame) -> list[str]:
    lines = []
    for _, row in failed.iterrows():
        where = "" if pd.isna(row["concurrency"]) else f" concurrency {int(row['concurrency'])}"
        where += "" if pd.isna(row["repeat"]) else f" repeat {int(row['repeat'])}"
        lines.append(f"- {row['protocol']}{where}, {row['tool']}: {row['error']}")
    return lines


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog=PROG, description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--out", type=Path, default=ROOT / "results" / "peer_client")
    add("--protocols", nargs="+", choices=PROTOCOLS, default=list(PROTOCOLS))
    add("--concurrency", type=bounded(int, 1, 1024), nargs="+", default=[1, 4, 16], help="1 to 1024 (1 4 16)")
    add("--repeats", type=bounded(int, 1, MAX_REPEATS), default=3, help="rounds, each in a shuffled order (3)")
    add("--seed", type=bounded(int, 0, 2**31), default=0, help="of the shuffled order (0)")
    add("--pa_requests", type=bounded(int, 1, 10**7), default=2000, help="perf_analyzer's requests per window (2000)")
    add("--pa_stability_pct", type=bounded(float, 0.1, 1e4), default=10.0, help="perf_analyzer's -s (10)")
    add("--pa_max_trials", type=bounded(int, 3, 1000), default=10, help="perf_analyzer's windows at most (10)")
    add("--our_iters", type=bounded(int, 1, 10**7), default=6000, help="our measured requests per run (6000)")
    add("--model", default="identity", help="served under this name too (identity)")
    add("--image_size", type=bounded(int, 1, 4096), default=16, help="1 to 4096 (16)")
    add("--batch_size", type=bounded(int, 1, MAX_BATCH_IMAGES), default=1, help="images per request (1)")
    add("--design", choices=DESIGNS, default="serial")
    add("--report_only", action="store_true", help="write the report from what is in --out")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parse_bench_args(parser, argv, "bench.peer_client", META_JSON)  # --out checked before any run
    given = list(sys.argv[1:] if argv is None else argv)
    if args.report_only:
        return report(args.out)
    given_settings = {name: getattr(args, name) for name in Settings.__dataclass_fields__}
    given_settings |= {"protocols": tuple(args.protocols), "concurrency": tuple(dict.fromkeys(args.concurrency))}
    settings = Settings(**given_settings)
    try:
        check_server_flags([settings.served_flags(p) for p in PROTOCOLS], serves=True)
        check_server_flags([settings.our_flags(p, FLAG_CHECK_ADDRESS, 1, 0) for p in PROTOCOLS])
    except ConfigError as exc:
        parser.error(str(exc))
    try:
        binary = pa.ensure_perf_analyzer()
    except pa.PerfAnalyzerMissing as exc:
        print(f"{PROG}: perf_analyzer cannot be brought: {exc}", file=sys.stderr)
        return 2
    kept = f"; the runs so far are in {args.out / RUNS_CSV}"
    return interruptible(PROG, lambda: measure(settings, args.out, binary, given), kept)


def measure(settings: Settings, out: Path, binary: Path, given: Sequence[str]) -> int:
    """Every protocol's runs into a cleared <out>, then the report."""
    out.mkdir(parents=True, exist_ok=True)
    (out / PA_DIR).mkdir(exist_ok=True)
    (out / LOGS_DIR).mkdir(exist_ok=True)
    earlier = [*(out / PA_DIR).iterdir(), *(out / LOGS_DIR).iterdir()]
    for old in [*(out / name for name in (RUNS_CSV, OURS_CSV, SERVED_CSV, META_JSON, REPORT_MD)), *earlier]:
        old.unlink(missing_ok=True)  # the report is of this measurement only
    os.environ.setdefault(GRPC_SHARE_ENV, str(max(settings.concurrency) + 1))  # perf_analyzer's env copies ours
    meta = run_meta(shlex.join(["python", "-m", "bench.peer_client", *given]))
    meta["perf_analyzer"] = perf_analyzer_version(binary)
    meta |= {"grpc_channel_share": os.environ[GRPC_SHARE_ENV], "settings": settings.__dict__}
    (out / META_JSON).write_text(json.dumps(meta, indent=1), encoding="utf-8")
    try:
        for protocol in settings.protocols:
            measure_protocol(settings, protocol, out)
    except ServerRefused as exc:
        print(f"{PROG}: error: the server refused to start: {exc}", file=sys.stderr)
        return 2
    return report(out)


def report(out: Path) -> int:
    text, failed = build_report(out)
    (out / REPORT_MD).write_text(text, encoding="utf-8")
    print(text)
    return 1 if failed else 0


def perf_analyzer_version(binary: Path) -> str:
    """Its own line (ensure_perf_analyzer has just seen it start)."""
    found = subprocess.run([binary, "--version"], env=pa.perf_analyzer_env(), capture_output=True, timeout=30)
    return last_line((found.stdout + found.stderr).decode(errors="replace"))


if __name__ == "__main__":
    sys.exit(main())
