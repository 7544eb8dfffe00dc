"""The network study: the same model served by our server behind its door (every design, with and without dynamic
batching, the door in a process of its own or inline, over HTTP with binary or JSON tensors and over gRPC), by the
same server without a door (shm: its client inside server.py), by Triton through PyTriton (its dynamic batcher at
the same rows and delay) and by KServe's Python model server, beside a bare echo endpoint on the door's framework
(bench/echo_server.py), driven by perf_analyzer and by our own generator (server.py --target) under the same loads
on the same machine, interleaved, in one study.

    tools/peers.sh && tools/perf_analyzer.sh          # once: the peers' environments, perf_analyzer's binary
    python -m bench.peers --out results/peers
    python -m bench.peers --out results/door --models identity --peers echo shm ours --designs serial pipelined \
        --batching off --placements process inline --wires binary json --protocols http grpc --clients ours \
        --concurrency 1 16 --rate_fractions --repeats 3           # what the door costs, against the echo and shm
    python -m bench.peers --out results/peers --report_only   # the report again, from <out>/runs.csv

A run is a cell of the study harness (bench/study.py): one client against one served peer at one load (shm: one
server.py run), the peer started on free loopback ports for the first of its runs and kept up for the rest of them
(the runner's fixture, one per model, peer, repeat and phase). Phase 1, closed loops at each `--concurrency`: the
echo with our generator (its capacity, same request, nothing behind it), then every peer with each client that can
drive it, in an order shuffled per repeat. Phase 2, Poisson: the echo at twice its highest closed-loop rate, every
peer at `--rate_fractions` of the highest rate our generator saw on it in phase 1 of the same repeat. A request is
`--batch_size` images (1; more only for echo, shm and ours without batching). Resumable; each run a row of
<out>/runs.csv (our generator's own rows in ours.csv, each served peer's in served.csv or servers.csv,
perf_analyzer's CSVs in perf_analyzer/, every output in logs/). The door's statistics (ours and Triton's) are read
around every run.

<out>/peers.md (printed) and latency_throughput.png are made by bench/peers_report.py. Exit status 1 when a run or a
served peer failed, 2 when a peer's environment or perf_analyzer is missing (before anything starts). Run nothing
else on the machine meanwhile: the clients share its cores with the servers.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import math
import os
import shlex
import socket
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace
from pathlib import Path

import pandas as pd

from bench import peers_report
from bench import perf_analyzer as pa
from bench.door_stats import door_delta, door_statistics
from bench.echo_server import echo_url
from bench.peer_servers import PEER_HOST
from bench.peers_report import OURS_CSV, SERVED_CSV, SERVERS_CSV, target_met
from bench.study import Study, run_study
from serverbench.config.design_kinds import DESIGNS
from serverbench.config.flags import ConfigError, bounded
from serverbench.config.inputs import IMAGE_INPUT
from serverbench.config.limits import DOORS
from serverbench.config.loads import CLOSED, POISSON
from serverbench.config.transport_kinds import GRPC, HTTP
from serverbench.launch.session import Session
from serverbench.launch.study import Cell, CellRefused, Experiment, FixtureFailed, LoadPoint, Runner, read_rows
from serverbench.launch.study_checks import study_args
from serverbench.records.csv_store import append_row
from serverbench.schema.ab import shuffled

ROOT = Path(__file__).resolve().parent.parent
# echo: our generator's capacity, beside the others; shm: ours without a door, the client inside server.py
PEER_KINDS = ("echo", "shm", "ours", "pytriton", "kserve")
SHM = "shm"
WIRES = ("binary", "json")  # how our generator sends an HTTP request's tensors
CLIENTS = ("ours", "perf_analyzer")
CLIENT_TAGS = {"ours": "ours", "perf_analyzer": "pa"}  # in the experiment's name
MODEL_SIZES = {"identity": 16, "resnet18": 64}  # image size per model
PEER_ENVS = ROOT / ".tools" / "peers"
SETUP = "tools/peers.sh"
READY_TIMEOUT_S = 180.0  # a peer's start: Triton copies itself into a workspace and starts a stub per model
PA_WINDOW_REQUESTS = 150  # a Poisson window's requests at least
# perf_analyzer's synchronous sending threads at a request rate: one per request in flight, so rate x latency of
# them and more while the server queues; from this peer's closed-loop p99, doubled, within these bounds.
PA_THREADS = (16, 128)
SERVING_LINE = "serving on "  # server.py --serve_only: "serving on http://HOST:PORT until ..."


@dataclass(frozen=True)
class Peer:
    """One server under test: ours in a design with or without dynamic batching, its door in a process of its own or
    inline, PyTriton, KServe, or the echo, over HTTP (binary or JSON tensors) or gRPC; or ours without a door (shm)."""

    kind: str
    design: str = ""  # ours and shm
    batching: bool = False
    protocol: str = HTTP.name  # shm: "" (its own ring)
    placement: str = DOORS[0]  # ours: where its door runs
    wire: str = WIRES[0]  # over HTTP: our generator's tensors

    def tags(self, batch: str) -> list[str]:
        return [
            self.design,
            batch if self.batching and self.kind in ("ours", SHM) else "",
            "inline" if self.placement != DOORS[0] else "",
            "json" if self.wire != WIRES[0] else "",
            "" if self.protocol in (HTTP.name, "") else self.protocol,
        ]

    @property
    def slug(self) -> str:  # in experiment and file names: ours-serial-batch-inline-grpc
        return "-".join(part for part in [self.kind, *self.tags("batch")] if part)

    @property
    def label(self) -> str:  # in the report: ours serial +batch grpc
        return " ".join(part for part in [self.kind, *self.tags("+batch")] if part)

    @staticmethod
    def from_slug(slug: str) -> Peer:
        kind, *rest = slug.split("-")
        protocol = GRPC.name if GRPC.name in rest else "" if kind == SHM else HTTP.name
        design = next((part for part in rest if part in DESIGNS), "")
        placement, wire = DOORS["inline" in rest], WIRES["json" in rest]
        return Peer(kind, design, kind == "pytriton" or "batch" in rest, protocol, placement, wire)

    @property
    def clients(self) -> tuple[str, ...]:
        """perf_analyzer reads the model's Triton /config, which KServe and the echo do not serve; it sends binary
        tensors; and it cannot drive a server without a door."""
        return ("ours",) if self.kind in ("kserve", "echo", SHM) or self.wire != WIRES[0] else CLIENTS

    @property
    def has_statistics(self) -> bool:  # Triton's statistics extension: our door and Triton
        return self.kind in ("ours", "pytriton")


def experiment_name(model: str, peer: Peer, client: str) -> str:
    return f"{model}_{peer.slug}_{CLIENT_TAGS[client]}"


def parse_experiment(name: str) -> tuple[str, Peer, str]:
    """(model, peer, client) of a run's experiment name."""
    model, slug, tag = name.split("_")
    return model, Peer.from_slug(slug), {tag: client for client, tag in CLIENT_TAGS.items()}[tag]


def peers_under_test(args: argparse.Namespace) -> list[Peer]:
    found: list[Peer] = []
    batching = [value == "on" for value in dict.fromkeys(args.batching)]
    designs, placements = dict.fromkeys(args.designs), dict.fromkeys(args.placements)
    for protocol in dict.fromkeys(args.protocols):
        if "ours" in args.peers:
            axes = itertools.product(designs, batching, placements, wires(args, protocol))
            found += [Peer("ours", d, b, protocol, p, w) for d, b, p, w in axes]
        found += [Peer("pytriton", batching=True, protocol=protocol)] if "pytriton" in args.peers else []
        if "kserve" in args.peers and protocol == HTTP.name:  # its Python server answers HTTP here
            found.append(Peer("kserve", protocol=protocol))
    return found + ([Peer(SHM, d, b, "") for d in designs for b in batching] if SHM in args.peers else [])


def wires(args: argparse.Namespace, protocol: str) -> list[str]:
    return list(dict.fromkeys(args.wires)) if protocol == HTTP.name else [WIRES[0]]


def echoes(args: argparse.Namespace) -> list[Peer]:
    """The bare echo per protocol (and HTTP's wire): our generator's capacity there (without it, every figure of
    ours counts as generator-bound) and what a Python server on the door's framework costs at the least."""
    if "echo" not in args.peers:
        return []
    return [Peer("echo", protocol=p, wire=w) for p in dict.fromkeys(args.protocols) for w in wires(args, p)]


def our_flags(args: argparse.Namespace, model: str, peer: Peer, load: str) -> tuple[str, ...]:
    """server.py --target's flags (the runner adds the load point, the batch, the experiment and the repeat; the
    fixture the --target); for shm, the whole server's, its frontend inside."""
    generators = args.closed_generators if load == CLOSED.name else args.generators
    served, size = "echo" if peer.kind == "echo" else model, MODEL_SIZES[model]
    flags = ["--device", "cpu", "--num_iters", "100", "--duration_s", f"{args.duration_s:g}"]
    flags += ["--warmup_iters", str(args.warmup_iters)]
    if peer.kind == SHM:  # one frontend process: the shm ring has one producer
        return (*flags, "--model", model, "--image_size", str(size), "--transport", SHM, *design_flags(args, peer))
    # --input as the peer's metadata says it: the checks before any run then contact nothing
    flags += ["--model", served, "--model_name", served, "--input", f"{IMAGE_INPUT}:float32:3x{size}x{size}"]
    flags += ["--generators", str(generators)]
    return (*flags, *([f"--{'' if peer.wire == WIRES[0] else 'no-'}binary_data"] if peer.protocol == HTTP.name else []))


def design_flags(args: argparse.Namespace, peer: Peer) -> list[str]:
    """Our server's design and dynamic batching."""
    flags = ["--design", peer.design or DESIGNS[0]]
    if peer.batching:
        flags += ["--max_batch_size", str(args.max_batch_size), "--max_queue_delay_ms", f"{args.max_queue_delay_ms:g}"]
    return flags


def cell_of(args: argparse.Namespace, model: str, peer: Peer, client: str, point: LoadPoint, repeat: int) -> Cell:
    flags = our_flags(args, model, peer, point.load) if client == "ours" else ()
    measure = measure_ours if client == "ours" else measure_pa
    return Cell(Experiment(experiment_name(model, peer, client), flags, measure), args.batch_size, False, repeat, point)


def server_cells(args: argparse.Namespace, model: str, peer: Peer, points: Sequence[LoadPoint], repeat: int) -> list:
    """One peer's runs of a phase: each client at each point, in an order shuffled by the seed."""
    clients = [c for c in peer.clients if c in args.clients]
    cells = [cell_of(args, model, peer, client, point, repeat) for point in points for client in clients]
    return shuffled(cells, args.seed, model, peer.slug, repeat, points[0].load) if cells else []


def phase_cells(args: argparse.Namespace, points_of: Callable[[str, Peer, int], list[LoadPoint]]) -> list[Cell]:
    """A phase's runs: per repeat and model, the echo (per protocol and wire), then every peer in a shuffled order,
    each at its points."""
    order: list[Cell] = []
    for repeat in range(args.repeats):
        for model in dict.fromkeys(args.models):
            for peer in [*echoes(args), *shuffled(peers_under_test(args), args.seed, model, repeat)]:
                order += server_cells(args, model, peer, points_of(model, peer, repeat), repeat)
    return order


def closed_cells(args: argparse.Namespace, rows: pd.DataFrame | None) -> list[Cell]:
    """Phase 1: closed loops at each concurrency."""
    points = [LoadPoint(CLOSED.name, c) for c in dict.fromkeys(args.concurrency)]
    return phase_cells(args, lambda model, peer, repeat: points)


def poisson_cells(args: argparse.Namespace, rows: pd.DataFrame | None) -> list[Cell]:
    """Phase 2: the echo at twice its highest closed-loop rate, every peer at fractions of the highest rate our
    generator saw on it in phase 1 (none for a peer it saw nothing on; none at all without --rate_fractions)."""
    fractions = list(dict.fromkeys(args.rate_fractions))

    def points(model: str, peer: Peer, repeat: int) -> list[LoadPoint]:
        return poisson_points(rows, model, peer, repeat, [2.0] if peer.kind == "echo" else fractions)

    return phase_cells(args, points) if fractions else []


def poisson_points(
    rows: pd.DataFrame | None, model: str, peer: Peer, repeat: int, fractions: Sequence[float]
) -> list[LoadPoint]:
    """The peer's Poisson rates in a repeat: those its Poisson rows were asked at, once there are as many as
    fractions (a closed-loop run that --retry_failed made ok later may raise the peak, and the points must not
    move under the rows already made); else fractions of its closed-loop peak. None before that peak."""
    if rows is not None and "offered_rate_rps" in rows:
        names = [experiment_name(model, peer, client) for client in CLIENTS]
        mine = rows[rows["experiment"].isin(names) & (rows["repeat"] == repeat) & (rows["load"] == POISSON.name)]
        asked = sorted(set(mine["offered_rate_rps"].dropna().astype(float)))
        if len(asked) == len(fractions):
            return [LoadPoint(POISSON.name, rate) for rate in asked]
    if (peak := closed_peak_rps(rows, model, peer, repeat)) is None:
        return []
    rates = [round(fraction * peak, 1) for fraction in fractions]
    return list(dict.fromkeys(LoadPoint(POISSON.name, rate) for rate in rates if rate > 0))


def closed_runs(rows: pd.DataFrame | None, model: str, peer: Peer, repeat: int) -> pd.DataFrame:
    """Our generator's ok closed-loop runs on the peer in that repeat."""
    if rows is None or "throughput_rps" not in rows:
        return pd.DataFrame(columns=["throughput_rps", "p99_latency_s"])
    name = experiment_name(model, peer, "ours")
    mine = (rows["experiment"] == name) & (rows["repeat"] == repeat) & (rows["load"] == CLOSED.name)
    return rows[mine & (rows["status"] == "ok")]


def closed_peak_rps(rows: pd.DataFrame | None, model: str, peer: Peer, repeat: int) -> float | None:
    found = closed_runs(rows, model, peer, repeat)["throughput_rps"].dropna()
    return float(found.max()) if len(found) else None


def checked_cells(args: argparse.Namespace, rows: pd.DataFrame | None) -> list[Cell]:
    """Our generator's runs as the checks before any run see them: each model, against a placeholder address."""
    points = [LoadPoint(CLOSED.name, args.concurrency[0]), LoadPoint(POISSON.name, 1.0)]
    found = [Peer("ours", DESIGNS[0], wire=wire) for wire in wires(args, HTTP.name)]
    found += [peer for peer in peers_under_test(args) if peer.kind == SHM]
    cells = [cell_of(args, m, peer, "ours", p, 0) for m in args.models for p in points for peer in found]
    return [cell if SHM in cell.experiment.name else replace_target(cell) for cell in cells]


def replace_target(cell: Cell) -> Cell:
    flags = (*cell.experiment.flags, "--target", "http://127.0.0.1:1")  # no server has its port before the runs
    return replace(cell, experiment=replace(cell.experiment, flags=flags))


# ------------------------------------------------------------------------------------------- the served peers


def peer_python(kind: str) -> Path:
    """The interpreter of a peer's environment; ConfigError saying to run tools/peers.sh when it was not made."""
    python = PEER_ENVS / kind / "bin" / "python"
    if not (PEER_ENVS / kind / ".stamp").is_file() or not python.exists():
        raise ConfigError(f"{kind}'s environment is not made: run {SETUP} {kind} first (once; minutes)")
    return python


def free_ports(count: int) -> list[int]:
    """`count` distinct free loopback ports (all held while the next is picked, so that none repeats); a peer that
    loses one to another process in the moment before it binds fails to start and says so."""
    sockets = [socket.create_server((PEER_HOST, 0)) for _ in range(count)]
    try:
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def served_flags(args: argparse.Namespace, model: str, peer: Peer, experiment: str) -> list[str]:
    """server.py --serve_only's flags for one of our peers, on a free port it names in its log."""
    return [
        *("--serve_only", "--transport", peer.protocol, "--door", peer.placement, "--host", PEER_HOST, "--port", "0"),
        *("--model", model, "--model_name", model, "--image_size", str(MODEL_SIZES[model])),
        *("--batch_size", str(args.batch_size), "--device", "cpu", "--experiment", experiment),
        *design_flags(args, peer),
    ]


def peer_command(args: argparse.Namespace, model: str, peer: Peer, http_port: int, grpc_port: int) -> list[str]:
    """bench.peer_servers' command for PyTriton and KServe: the same model, batch and delay as ours."""
    flags = [
        *("--model", model, "--model_name", model, "--image_size", str(MODEL_SIZES[model])),
        *("--http_port", str(http_port), "--max_batch_size", str(args.max_batch_size)),
        *("--max_queue_delay_ms", f"{args.max_queue_delay_ms:g}"),
        *(["--grpc_port", str(grpc_port)] if peer.kind == "pytriton" else []),
    ]
    return [str(peer_python(peer.kind)), "-m", f"bench.peer_servers.{peer.kind}_server", *flags]


def model_ready(url: str, model: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/v2/models/{model}/ready", timeout=2.0) as answer:
            return answer.status == 200
    except (urllib.error.URLError, OSError):  # not listening yet, or 503 while its model loads
        return False


def _serving_url(session: Session) -> str | None:
    """Our --serve_only server's URL, once it says it serves and its backend is ready."""
    text = session.log_text()
    if "ready on" not in text:
        return None
    found = [line.split(SERVING_LINE, 1)[1].split()[0] for line in text.splitlines() if SERVING_LINE in line]
    return found[-1] if found else None


def serving(args: argparse.Namespace, model: str, peer: Peer, name: str, out: Path) -> tuple[list[str], Ready]:
    """The peer's command, and what says it is ready: its URL for our generator (None until then)."""
    if peer.kind == "echo":
        shape = f"{args.batch_size},3,{MODEL_SIZES[model]},{MODEL_SIZES[model]}"
        flags = ["--transport", peer.protocol, "--port", "0", "--shape", shape]
        return [sys.executable, "-m", "bench.echo_server", *flags], lambda session: echo_url(session.log_text())
    if peer.kind == "ours":
        where = ("--results_dir", str(out), "--output_file", SERVED_CSV)
        return [sys.executable, str(ROOT / "server.py"), *served_flags(args, model, peer, name), *where], _serving_url
    http_port, grpc_port = free_ports(2)
    url = f"{peer.protocol}://{PEER_HOST}:{grpc_port if peer.protocol == GRPC.name else http_port}"
    ready = f"http://{PEER_HOST}:{http_port}"
    return peer_command(args, model, peer, http_port, grpc_port), lambda _: url if model_ready(ready, model) else None


# What says a served peer is ready, given its session: its URL, or None while it is not
Ready = Callable[[Session], "str | None"]


@contextmanager
def served_peer(cell: Cell, out: Path) -> Iterator[tuple[str, ...]]:
    """The runner's fixture: the cell's peer started for the first of its runs (the runner keeps it up for the
    rest: fixture_key), yielding `--target URL`; stopped after; a line in servers.csv says how it went. Nothing
    for shm: its server is the run."""
    model, peer, _ = parse_experiment(cell.experiment.name)
    if peer.kind == SHM:
        yield ()
        return
    name = f"served_{model}_{peer.slug}_{cell.load_point.load}_r{cell.repeat}"
    log_path = out / "logs" / f"{name}.log"
    command, url_of = serving(study_args(out), model, peer, name, out)
    urls: list[str] = []

    def ready(session: Session) -> bool:
        urls.extend(url for url in [url_of(session)] if url)
        return bool(urls)

    print(f"$ {shlex.join(command)}", flush=True)
    session, problem = Session.serving(command, log_path, ROOT, ready, peer.label, READY_TIMEOUT_S)
    line = {"server": name, "model": model, "peer": peer.label, "repeat": cell.repeat, "log": f"logs/{log_path.name}"}
    if problem:
        append_row(out / SERVERS_CSV, {**line, "status": "error", "error": problem})
        raise FixtureFailed(problem)
    try:
        yield ("--target", urls[0])
    finally:
        error = session.stop_served(peer.label)
        append_row(out / SERVERS_CSV, {**line, "status": "error" if error else "ok", "error": error})


def fixture_key(cell: Cell) -> tuple:
    """One served peer per model, peer, repeat and phase (its load)."""
    model, peer, _ = parse_experiment(cell.experiment.name)
    return (model, peer.slug, cell.repeat, cell.load_point.load)


# ------------------------------------------------------------------------------------------------- the runs


def _address(added: tuple[str, ...]) -> str:
    """host:port of the --target the fixture added."""
    return added[added.index("--target") + 1].split("://", 1)[1]


def around_door(model: str, peer: Peer, added: tuple[str, ...], run: Callable[[], dict]) -> dict[str, object]:
    """`run()`'s row with the door's statistics during it; a run the door answered with errors fails."""
    read = functools.partial(door_statistics, peer.protocol, _address(added), model)
    before = read() if peer.has_statistics else None
    row = run() | door_delta(before, read() if peer.has_statistics else None)  # the run first, then the counts
    if row["status"] == "ok" and row.get("door_failed"):  # an error answer a client did not count
        row |= {"status": "error", "error": f"the door answered {row['door_failed']} requests with an error"}
    stamp = PEER_ENVS / peer.kind / ".stamp"
    return {**row, "peer_environment": stamp.read_text().strip() if stamp.is_file() else ""}


def measure_ours(cell: Cell, runner: Runner, added: tuple[str, ...]) -> dict[str, object]:
    """Our generator's run (server.py --target, or shm's whole server, as the runner runs it): its row to ours.csv,
    its figures here. A target it refused (exit 2: a model or shape the peer does not serve) fails its cell only."""

    def run() -> dict[str, object]:
        start_s = time.monotonic()
        try:
            ran, row = runner.server_row(cell, runner.cell_flags(cell, added), OURS_CSV)
        except CellRefused as exc:
            return {"status": "error", "error": str(exc), "wall_s": time.monotonic() - start_s}
        found: dict[str, object] = {"wall_s": time.monotonic() - start_s}
        if row is None:
            why = "timed out" if ran.timed_out else f"exit {ran.returncode}"
            return {"status": "error", "error": f"server.py --target {why}, no row: {ran.said}", **found}
        ok = ran.returncode == 0 and row["status"] == "ok"
        why = row.get("error") or ""
        found |= {name: row.get(name) for name in ("p50_latency_s", "p99_latency_s")}
        found |= {"throughput_rps": row.get("achieved_rate_rps"), "requests": row.get("responses_received")}
        error = "" if ok else f"{row['status']}: {why} (exit {ran.returncode})"
        return {"status": "ok" if ok else "error", "error": error, **found, "detail": str(row.get("run_id", ""))}

    model, peer, _ = parse_experiment(cell.experiment.name)
    return run() if peer.kind == SHM else around_door(model, peer, added, run)


def measure_pa(cell: Cell, runner: Runner, added: tuple[str, ...]) -> dict[str, object]:
    """One perf_analyzer run: a closed loop at the cell's concurrency, or Poisson at its rate with sending threads
    for twice rate x the peer's closed-loop p99 in flight; its CSV and output in perf_analyzer/."""
    out, point = runner.out_dir, cell.load_point
    model, peer, _ = parse_experiment(cell.experiment.name)
    args = study_args(out)
    label = cell.log_path(out).stem
    (out / "perf_analyzer").mkdir(exist_ok=True)
    files = {"csv_file": out / "perf_analyzer" / f"{label}.csv", "profile_export_file": out / "pa.json"}
    if point.load == CLOSED.name:
        load: dict[str, object] = {"concurrency": int(point.value)}
        window_ms = args.pa_window_ms
    else:
        p99_s = closed_runs(read_rows(out / "runs.csv"), model, peer, cell.repeat)["p99_latency_s"].max()
        threads = math.ceil(2 * point.value * (0.0 if pd.isna(p99_s) else p99_s))
        load = {"request_rate": point.value, "max_threads": min(PA_THREADS[1], max(PA_THREADS[0], threads))}
        # at a low rate, windows of at least PA_WINDOW_REQUESTS: means of a few dozen requests never agree
        window_ms = max(args.pa_window_ms, PA_WINDOW_REQUESTS / point.value * 1e3)
    os.environ.setdefault(pa.GRPC_SHARE_ENV, str(max(args.concurrency) + 1))  # one channel, as our generator
    run = pa.PerfAnalyzerRun(
        model,
        _address(added),
        protocol=peer.protocol,
        measurement_interval_ms=round(window_ms),
        max_trials=args.pa_max_trials,
        stability_percentage=args.pa_stability_pct,
        timeout_s=runner.timeout_s,  # --cell_timeout_s, as every run's
        batch_size=cell.batch_size,
        **load,
        **files,
    )

    def measured() -> dict[str, object]:
        result = pa.run_perf_analyzer(run)
        text = f"$ {shlex.join(result.command)}\n{result.stdout}"
        (out / "perf_analyzer" / f"{label}.log").write_text(text, encoding="utf-8")
        run.profile_export_file.unlink(missing_ok=True)  # every request's timestamps: MBs, not read here
        found = {name: getattr(result, name) for name in pa.LATENCY_COLUMNS_US}
        return {
            "status": "ok" if result.ok else "error",
            "error": result.error,
            # its inferences/s: requests x batch; none from a failed run, whose error is the row's
            "throughput_rps": None if result.throughput_per_s is None else result.throughput_per_s / cell.batch_size,
            **found,
            "wall_s": result.wall_s,
            "pa_delayed_pct": result.delayed_pct,
            "pa_version": pa.perf_analyzer_version(),
            "detail": str(run.csv_file.relative_to(out)),
            "grpc_channel_share": os.environ[pa.GRPC_SHARE_ENV] if peer.protocol == GRPC.name else "",
        }

    return around_door(model, peer, added, measured)


# ------------------------------------------------------------------------------------------- the report


def described(rows: pd.DataFrame) -> pd.DataFrame:
    """The study's rows with what each run was, from its experiment's name (model, peer, client), whether it was
    ok, and a Poisson run's rate as a fraction of the highest closed-loop rate our generator saw on its peer."""
    parsed = [parse_experiment(name) for name in rows["experiment"]]
    runs = rows.assign(
        batch_size=rows["batch_size"] if "batch_size" in rows else 1,
        model=[model for model, _, _ in parsed],
        peer=[peer.label for _, peer, _ in parsed],
        client=[client for _, _, client in parsed],
        ok=rows["status"] == "ok",
        # what each peer is, a column per field of Peer: kind, design, batching, protocol, placement, wire
        **{name: [getattr(peer, name) for _, peer, _ in parsed] for name in (f.name for f in fields(Peer))},
    )
    for name in ("offered_rate_rps", "concurrency", "throughput_rps", "p50_latency_s", "p99_latency_s", "error"):
        runs[name] = runs[name] if name in runs else None
    runs["rate_rps"] = runs["offered_rate_rps"]
    closed = peers_report.ok_runs(runs[(runs["load"] == CLOSED.name) & (runs["client"] == "ours")])
    peaks = closed.groupby(["model", "peer", "repeat"])["throughput_rps"].max()
    keys = list(zip(runs["model"], runs["peer"], runs["repeat"]))
    peak = pd.Series([peaks.get(key) for key in keys], index=runs.index, dtype=float)
    runs["rate_fraction"] = (runs["rate_rps"].astype(float) / peak).round(2).where(runs["load"] == POISSON.name)
    return runs


def report(args: argparse.Namespace, rows: pd.DataFrame, out: Path) -> list[str]:
    return peers_report.report(args, described(rows), out)


# ------------------------------------------------------------------------------------------- the command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--models", nargs="+", choices=tuple(MODEL_SIZES), default=list(MODEL_SIZES))
    add("--peers", nargs="+", choices=PEER_KINDS, default=list(PEER_KINDS), help="(all; echo: the capacity)")
    add("--designs", nargs="+", choices=DESIGNS, default=list(DESIGNS), help="ours: its designs (all)")
    add("--batching", nargs="+", choices=("off", "on"), default=["off", "on"], help="ours: dynamic batching (both)")
    add("--protocols", nargs="+", choices=(HTTP.name, GRPC.name), default=[HTTP.name], help="(http; KServe: http)")
    add("--placements", nargs="+", choices=DOORS, default=[DOORS[0]], help="ours: where its door runs (process)")
    add("--wires", nargs="+", choices=WIRES, default=[WIRES[0]], help="HTTP: our generator's tensors (binary)")
    add("--batch_size", type=bounded(int, 1, 1024), default=1, help="images per request (1; more: no batching)")
    add("--clients", nargs="+", choices=CLIENTS, default=list(CLIENTS))
    add("--concurrency", type=bounded(int, 1, 256), nargs="+", default=[1, 4, 16], help="closed loop (1 4 16)")
    add(
        "--rate_fractions",
        type=bounded(float, 0.01, 2.0),
        nargs="*",
        default=[0.3, 0.6, 0.9],
        help="Poisson, of each peer's closed-loop peak (0.3 0.6 0.9; none: closed loops only)",
    )
    add("--duration_s", type=bounded(float, 0.5, 600.0), default=3.0, help="our generator's measured phase (3)")
    add("--warmup_iters", type=bounded(int, 1, 10**5), default=20, help="our generator's warm-up requests (20)")
    add("--generators", type=bounded(int, 1, 64), default=2, help="our generator's processes, Poisson (2)")
    add("--closed_generators", type=bounded(int, 1, 64), default=1, help="... and closed loop (1)")
    add("--max_batch_size", type=bounded(int, 1, 1024), default=16, help="dynamic batching's rows (16)")
    add("--max_queue_delay_ms", type=bounded(float, 0.0, 1000.0), default=2.0, help="its delay (2)")
    add("--pa_window_ms", type=bounded(int, 200, 60_000), default=1500, help="perf_analyzer's window (1500)")
    add("--pa_max_trials", type=bounded(int, 3, 100), default=8, help="perf_analyzer's windows at most (8)")
    add("--pa_stability_pct", type=bounded(float, 0.1, 1e4), default=10.0, help="perf_analyzer's -s (10)")


def preflight(args: argparse.Namespace) -> str | None:
    """Before any run: the request size and the peers' environments; why not, else None."""
    if args.report_only:
        return None
    if args.batch_size > 1 and ({"pytriton", "kserve"} & set(args.peers) or "on" in args.batching):
        return f"--batch_size {args.batch_size} needs --batching off and no pytriton or kserve: theirs is at 1 image"
    if args.rate_fractions and "ours" not in args.clients:  # its Poisson phase was silently empty
        return "--rate_fractions: they are fractions of our generator's closed-loop peak: add ours to --clients"
    try:
        for kind in args.peers:
            if kind in ("pytriton", "kserve"):
                peer_python(kind)
    except ConfigError as exc:
        return str(exc)
    return None


STUDY = Study(
    "peers",
    __doc__,
    (closed_cells, poisson_cells),
    report,
    add_arguments,
    repeats=1,
    load_axis=(CLOSED.name, POISSON.name),
    fixture=served_peer,
    fixture_key=fixture_key,
    target_met=target_met,
    checked_cells=checked_cells,
    preflight=preflight,
    prepare=lambda args: pa.bring_problem() if "perf_analyzer" in args.clients else None,  # after every check
)


def main(argv: Sequence[str] | None = None) -> int:
    return run_study(STUDY, argv)


if __name__ == "__main__":
    sys.exit(main())
