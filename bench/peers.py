"""Side by side with what users would pick instead: the same model served by our server behind its HTTP door (every
design, with and without dynamic batching), by Triton through PyTriton (its dynamic batcher set to the same max batch
and delay) and by KServe's Python model server, under the same load on the same machine, driven by perf_analyzer
(where the peer offers what it needs: KServe has no Triton /config) and by our own generator (server.py --target),
interleaved, in one run.

    tools/peers.sh                                    # once: the peers' own environments under .tools/peers/
    python -m bench.peers --out results/peers
    python -m bench.peers --out results/peers --report_only        # the report again, from <out>

Per model (`--models identity resnet18`: identity at 16x16, the server's own cost; resnet18 at 64x64), first our
generator's capacity against a bare echo endpoint (bench.echo_server, same request size) at every `--concurrency`.
Then, per repeat, every peer in an order shuffled by the seed: the peer is started on free loopback ports, its model
is ready, then closed-loop runs at concurrency 1, 4 and 16 by both clients in a shuffled order, then Poisson runs at
`--rate_fractions` of the highest rate our generator saw on that peer in its closed-loop runs (a latency-throughput
curve of its own), again both clients shuffled; the peer is stopped. One request is one image (batch 1). Each run is
a line of <out>/runs.csv (our rows in <out>/ours.csv, perf_analyzer's CSVs in <out>/perf_analyzer/, the servers'
and runs' output in <out>/logs/).

Our generator runs in `--generators N` processes (server.py's flag; default 2) for the Poisson runs, where one
Python process cannot keep a schedule of several thousand requests/s, and `--closed_generators N` (default 1) for the
closed loops (concurrency 1 stays one). Its capacity is measured both ways against the echo: closed at every
concurrency, and Poisson at twice the closed-loop capacity at the highest concurrency (the rate it achieves when
overloaded is the most it can send on a schedule).

<out>/peers.md (printed) and <out>/latency_throughput.png are made by bench/peers_report.py. Exit status 1 when a
run failed, 2 when a peer's environment or perf_analyzer is missing (before anything starts). Run nothing else on
the machine meanwhile: the clients share its cores with the servers.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import shlex
import socket
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from bench import perf_analyzer as pa
from bench.frontdoor import echo_server
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
from bench.peer_client import append_run, perf_analyzer_version
from bench.peer_servers import PEER_HOST
from bench.peers_report import META_JSON, OURS_CSV, RUNS_CSV, report
from serverbench.config.design_kinds import DESIGNS
from serverbench.config.flags import ConfigError, OneLineErrorParser, bounded
from serverbench.config.limits import MAX_REPEATS
from serverbench.config.loads import CLOSED, POISSON
from serverbench.config.paths import parse_bench_args
from serverbench.launch.session import Session
from serverbench.schema.ab import shuffled

ROOT = Path(__file__).resolve().parent.parent
PROG = "python -m bench.peers"
SERVED_CSV = "served.csv"
PA_DIR, LOGS_DIR = "perf_analyzer", "logs"
PEER_KINDS = ("ours", "pytriton", "kserve")
CLIENTS = ("ours", "perf_analyzer")
FIELDS = (
    *("model", "repeat", "peer", "kind", "design", "batching", "load", "concurrency", "rate_rps", "client"),
    *("ok", "error", "throughput_rps", "p50_latency_s", "p99_latency_s", "requests", "wall_s", "detail"),
    *("rate_fraction", "pa_delayed_pct"),
)
MODEL_SIZES = {"identity": 16, "resnet18": 64}  # image size per model
PEER_ENVS = ROOT / ".tools" / "peers"
SETUP = "tools/peers.sh"
READY_TIMEOUT_S = 180.0  # a peer's start: Triton copies itself into a workspace and starts a stub per model
RUN_TIMEOUT_S = 600.0  # a backstop: server.py ends a stuck run itself (--timeout_s)
PA_TIMEOUT_S = 300.0
PA_WINDOW_REQUESTS = 150  # a Poisson window's requests at least
# perf_analyzer's synchronous sending threads at a request rate: one per request in flight, so rate x latency of
# them and more while the server queues; from this peer's closed-loop p99, doubled, within these bounds.
PA_THREADS = (16, 128)


@dataclass(frozen=True)
class Peer:
    """One server under test: ours in one design with or without dynamic batching, PyTriton, or KServe."""

    kind: str
    design: str = ""  # ours only
    batching: bool = False

    @property
    def label(self) -> str:
        if self.kind != "ours":
            return self.kind
        return f"ours {self.design}" + (" +batch" if self.batching else "")

    @property
    def clients(self) -> tuple[str, ...]:
        """perf_analyzer reads the model's Triton /config, which KServe does not serve."""
        return ("ours",) if self.kind == "kserve" else CLIENTS


@dataclass(frozen=True)
class Settings:
    """What a measurement was asked, kept in <out>/meta.json so that --report_only reads it back."""

    models: tuple[str, ...]
    peers: tuple[str, ...]
    clients: tuple[str, ...]
    concurrency: tuple[int, ...]
    rate_fractions: tuple[float, ...]
    repeats: int
    seed: int
    duration_s: float
    warmup_iters: int
    generators: int
    closed_generators: int
    max_batch_size: int
    max_queue_delay_ms: float
    pa_window_ms: int
    pa_max_trials: int
    pa_stability_pct: float

    def peers_under_test(self) -> list[Peer]:
        found: list[Peer] = []
        for kind in self.peers:
            if kind == "ours":
                found += [Peer("ours", design, batching) for design in DESIGNS for batching in (False, True)]
            else:
                found.append(Peer(kind, batching=True))
        return found

    def served_flags(self, peer: Peer, model: str, port: int, experiment: str) -> list[str]:
        """server.py --serve_only's flags for one of our peers."""
        flags = [
            *("--serve_only", "--transport", "http", "--host", PEER_HOST, "--port", str(port)),
            *("--model", model, "--model_name", model, "--image_size", str(MODEL_SIZES[model])),
            *("--batch_size", "1", "--design", peer.design, "--device", "cpu", "--experiment", experiment),
        ]
        if peer.batching:
            flags += ["--max_batch_size", str(self.max_batch_size)]
            flags += ["--max_queue_delay_ms", f"{self.max_queue_delay_ms:g}"]
        return flags

    def peer_flags(self, model: str, http_port: int, grpc_port: int, kind: str) -> list[str]:
        """bench.peer_servers' flags for PyTriton and KServe: the same model, batch and delay as ours."""
        flags = [
            *("--model", model, "--model_name", model, "--image_size", str(MODEL_SIZES[model])),
            *("--http_port", str(http_port), "--max_batch_size", str(self.max_batch_size)),
            *("--max_queue_delay_ms", f"{self.max_queue_delay_ms:g}"),
        ]
        return [*flags, "--grpc_port", str(grpc_port)] if kind == "pytriton" else flags

    def our_flags(self, url: str, model: str, load: str, level: float, experiment: str, repeat: int) -> list[str]:
        """server.py --target's flags: `level` is the concurrency (closed) or the rate in requests/s (poisson)."""
        flags = [
            *("--target", url, "--model", model, "--model_name", model, "--batch_size", "1", "--binary_data"),
            *("--device", "cpu", "--num_iters", "100", "--duration_s", f"{self.duration_s:g}"),
            *("--warmup_iters", str(self.warmup_iters), "--experiment", experiment, "--repeat", str(repeat)),
        ]
        if load == CLOSED.name:
            # Each generator process keeps at least one request in flight: concurrency 1 is one generator.
            generators = min(self.closed_generators, int(level))
            return [*flags, "--generators", str(generators), "--load", CLOSED.name, "--concurrency", str(int(level))]
        return [*flags, "--generators", str(self.generators), "--load", POISSON.name, "--rate", f"{level:.6g}"]


def peer_python(kind: str) -> Path:
    """The interpreter of a peer's environment; ConfigError saying to run tools/peers.sh when it was not made."""
    python = PEER_ENVS / kind / "bin" / "python"
    if not (PEER_ENVS / kind / ".stamp").is_file() or not python.exists():
        raise ConfigError(f"{kind}'s environment is not made: run {SETUP} {kind} first (once; minutes)")
    return python


def free_ports(count: int) -> list[int]:
    """`count` distinct free loopback ports (all held while the next is picked, so that none repeats); a peer that
    loses one to another process in the moment before it binds fails to start and says so."""
    with contextlib.ExitStack() as held:
        socks = [held.enter_context(socket.create_server((PEER_HOST, 0))) for _ in range(count)]
        return [sock.getsockname()[1] for sock in socks]


@dataclass
class Running:
    """A peer serving on loopback: its process (leading a session of its own) and where it listens."""

    peer: Peer
    model: str
    session: Session
    url: str  # http://127.0.0.1:PORT
    address: str  # 127.0.0.1:PORT, as perf_analyzer takes it
    experiment: str

    @property
    def log_path(self) -> Path:
        return self.session.log_path


def peer_command(settings: Settings, peer: Peer, model: str, out: Path, experiment: str) -> tuple[list[str], int]:
    port, grpc_port = free_ports(2)
    if peer.kind == "ours":
        return server_command(settings.served_flags(peer, model, port, experiment), out, SERVED_CSV), port
    module = f"bench.peer_servers.{peer.kind}_server"
    flags = settings.peer_flags(model, port, grpc_port, peer.kind)
    return [str(peer_python(peer.kind)), "-m", module, *flags], port


def start_peer(settings: Settings, peer: Peer, model: str, out: Path, experiment: str) -> Running | str:
    """The peer through the one launcher, its output in a log file, once its model answers ready; the one line
    saying why when it does not within READY_TIMEOUT_S."""
    command, port = peer_command(settings, peer, model, out, experiment)
    url = f"http://{PEER_HOST}:{port}"
    ready = lambda _: model_ready(url, model)  # noqa: E731 - the launcher's readiness check
    session, problem = start_served(command, out / LOGS_DIR / f"{experiment}.log", ready, peer.label, READY_TIMEOUT_S)
    return problem or Running(peer, model, session, url, f"{PEER_HOST}:{port}", experiment)


def model_ready(url: str, model: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/v2/models/{model}/ready", timeout=2.0) as answer:
            return answer.status == 200
    except (urllib.error.URLError, OSError):  # not listening yet, or 503 while its model loads
        return False


def stop_peer(running: Running) -> str:
    """SIGTERM to the peer alone (stop_served); "" or the one line saying what went wrong."""
    return stop_served(running.session, running.peer.label)


def run_pa(
    settings: Settings, running: Running, load: str, level: float, label: str, out: Path, latency_s: float
) -> dict[str, object]:
    """One perf_analyzer run (closed loop at `level` in flight, or Poisson at `level` requests/s, with threads for
    `level` x `latency_s` x 2 requests in flight) against the peer."""
    files = {"csv_file": out / PA_DIR / f"{label}.csv", "profile_export_file": out / PA_DIR / f"{label}.json"}
    threads = min(PA_THREADS[1], max(PA_THREADS[0], math.ceil(2 * level * latency_s)))
    load_options = (
        {"concurrency": int(level)} if load == CLOSED.name else {"request_rate": level, "max_threads": threads}
    )
    # Poisson at a low rate: windows of at least PA_WINDOW_REQUESTS requests, or three windows of a few dozen
    # requests' means never agree within 10 %.
    window_ms = (
        settings.pa_window_ms if load == CLOSED.name else max(settings.pa_window_ms, PA_WINDOW_REQUESTS / level * 1e3)
    )
    run = pa.PerfAnalyzerRun(
        running.model,
        running.address,
        measurement_interval_ms=round(window_ms),
        max_trials=settings.pa_max_trials,
        stability_percentage=settings.pa_stability_pct,
        timeout_s=PA_TIMEOUT_S,
        **load_options,
        **files,
    )
    result = pa.run_perf_analyzer(run)
    (out / PA_DIR / f"{label}.log").write_text(f"$ {shlex.join(result.command)}\n{result.stdout}", encoding="utf-8")
    run.profile_export_file.unlink(missing_ok=True)  # every request's timestamps: MBs, not read here
    found = {name: getattr(result, name) for name in ("ok", "error", "p50_latency_s", "p99_latency_s", "wall_s")}
    found["pa_delayed_pct"] = result.delayed_pct
    return {**found, "throughput_rps": result.throughput_per_s, "detail": str(run.csv_file.relative_to(out))}


def run_ours(
    settings: Settings, url: str, model: str, load: str, level: float, repeat: int, label: str, out: Path
) -> dict[str, object]:
    """One run of our generator (server.py --target) and its line of runs.csv; its row goes to ours.csv."""
    flags = settings.our_flags(url, model, load, level, label, repeat)
    return run_target(flags, out, OURS_CSV, out / LOGS_DIR / f"{label}.log", RUN_TIMEOUT_S)


def run_one(
    settings: Settings,
    running: Running,
    client: str,
    load: str,
    level: float,
    repeat: int,
    out: Path,
    latency_s: float = 0.0,
) -> dict[str, object]:
    """One client's run at one load, as a line of runs.csv; `latency_s`: the peer's closed-loop p99, which sizes
    perf_analyzer's sending threads at a request rate."""
    peer = running.peer
    name = f"{running.model}_{peer.label.replace(' ', '_').replace('+', '')}_{load}{level:g}_{client}_r{repeat}"
    if client == "ours":
        found = run_ours(settings, running.url, running.model, load, level, repeat, name, out)
    else:
        found = run_pa(settings, running, load, level, name, out, latency_s)
    line = {"model": running.model, "repeat": repeat, "peer": peer.label, "kind": peer.kind}
    line |= {"design": peer.design, "batching": peer.batching, "load": load, "client": client}
    line |= {
        "concurrency": int(level) if load == CLOSED.name else None,
        "rate_rps": level if load == POISSON.name else None,
    }
    return {**line, **found}


def record(out: Path, line: dict[str, object]) -> None:
    append_run(out, line, FIELDS)


def measure_peer(settings: Settings, peer: Peer, model: str, repeat: int, out: Path) -> None:
    """The peer started, its closed-loop runs, then its Poisson curve at fractions of the rate our generator saw,
    each set with both clients in a shuffled order; the peer stopped."""
    experiment = f"served_{model}_{peer.label.replace(' ', '_').replace('+', '')}_r{repeat}"
    running = start_peer(settings, peer, model, out, experiment)
    base = {"model": model, "repeat": repeat, "peer": peer.label, "kind": peer.kind, "client": "server"}
    if isinstance(running, str):
        record(out, {**base, "ok": False, "error": running})
        return
    clients = [c for c in peer.clients if c in settings.clients]
    seen_rps: list[float] = []
    seen_p99_s: list[float] = []
    try:
        closed = [(client, c) for c in settings.concurrency for client in clients]
        for client, concurrency in shuffled(closed, settings.seed, model, peer.label, repeat, CLOSED.name):
            line = run_one(settings, running, client, "closed", concurrency, repeat, out)
            record(out, line)
            if client == "ours" and line["ok"] and line.get("throughput_rps"):
                seen_rps.append(float(line["throughput_rps"]))
                seen_p99_s.append(float(line["p99_latency_s"]))
        if seen_rps:
            curve = [(client, f) for f in settings.rate_fractions for client in clients]
            for client, fraction in shuffled(curve, settings.seed, model, peer.label, repeat, POISSON.name):
                rate = round(fraction * max(seen_rps), 1)
                line = run_one(settings, running, client, "poisson", rate, repeat, out, max(seen_p99_s))
                record(out, {**line, "rate_fraction": fraction})
    finally:
        error = stop_peer(running)
    record(out, {**base, "ok": not error, "error": error, "detail": str(running.log_path.relative_to(out))})


def measure_capacity(settings: Settings, model: str, repeat: int, out: Path) -> None:
    """Our generator against the bare echo endpoint (same request size, nothing behind it): closed at every
    concurrency, then Poisson at twice the highest closed-loop rate, where what it achieves is the most it can send
    on a schedule. A peer's figure above half of the capacity is marked generator-bound in the report."""
    size = MODEL_SIZES[model]
    line = {"model": model, "repeat": repeat, "peer": "echo", "kind": "echo", "client": "ours"}
    closed_rps: list[float] = []
    with echo_server("http-binary", out / LOGS_DIR / f"echo_{model}_r{repeat}.log", f"1,3,{size},{size}") as url:
        for concurrency in settings.concurrency:
            name = f"{model}_echo_closed{concurrency}_ours_r{repeat}"
            found = run_ours(settings, url, "echo", "closed", concurrency, repeat, name, out)
            record(out, {**line, "load": "closed", "concurrency": concurrency, **found})
            if found["ok"] and found.get("throughput_rps"):
                closed_rps.append(float(found["throughput_rps"]))
        if closed_rps:
            rate = round(2 * max(closed_rps), 1)
            found = run_ours(
                settings, url, "echo", "poisson", rate, repeat, f"{model}_echo_poisson_ours_r{repeat}", out
            )
            record(out, {**line, "load": "poisson", "rate_rps": rate, **found})


def measure(settings: Settings, out: Path, given: Sequence[str], binary: Path | None) -> int:
    """Every model's runs into a cleared <out>, then the report."""
    for folder in (out, out / PA_DIR, out / LOGS_DIR):
        folder.mkdir(parents=True, exist_ok=True)
    earlier = [*(out / PA_DIR).iterdir(), *(out / LOGS_DIR).iterdir()]
    for old in [*(out / name for name in (RUNS_CSV, OURS_CSV, SERVED_CSV, META_JSON)), *earlier]:
        old.unlink(missing_ok=True)  # the report is of this measurement only
    meta = run_meta(shlex.join(["python", "-m", "bench.peers", *given]))
    meta |= {"settings": asdict(settings), "environments": environments(settings)}
    meta["perf_analyzer"] = perf_analyzer_version(binary) if binary is not None else "not used"
    (out / META_JSON).write_text(json.dumps(meta, indent=1), encoding="utf-8")
    peers = settings.peers_under_test()
    for model in settings.models:
        for repeat in range(settings.repeats):
            measure_capacity(settings, model, repeat, out)
            for peer in shuffled(list(peers), settings.seed, model, repeat):
                measure_peer(settings, peer, model, repeat, out)
    return report(out)


def environments(settings: Settings) -> dict[str, str]:
    """Each peer environment's stamp: what tools/peers.sh installed, under which interpreter."""
    return {
        kind: (PEER_ENVS / kind / ".stamp").read_text(encoding="utf-8").strip()
        for kind in settings.peers
        if kind != "ours"
    }


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog=PROG, description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--out", type=Path, default=ROOT / "results" / "peers")
    add("--models", nargs="+", choices=tuple(MODEL_SIZES), default=list(MODEL_SIZES))
    add("--peers", nargs="+", choices=PEER_KINDS, default=list(PEER_KINDS))
    add("--clients", nargs="+", choices=CLIENTS, default=list(CLIENTS))
    add("--concurrency", type=bounded(int, 1, 256), nargs="+", default=[1, 4, 16], help="closed loop (1 4 16)")
    add("--rate_fractions", type=bounded(float, 0.01, 2.0), nargs="+", default=[0.3, 0.6, 0.9])
    add("--repeats", type=bounded(int, 1, MAX_REPEATS), default=1, help="rounds, each in a shuffled order (1)")
    add("--seed", type=bounded(int, 0, 2**31), default=0, help="of the shuffled orders (0)")
    add("--duration_s", type=bounded(float, 0.5, 600.0), default=3.0, help="our generator's measured phase (3)")
    add("--warmup_iters", type=bounded(int, 1, 10**5), default=20, help="our generator's warm-up requests (20)")
    add("--generators", type=bounded(int, 1, 64), default=2, help="our generator's processes, Poisson (2)")
    add("--closed_generators", type=bounded(int, 1, 64), default=1, help="... and closed loop (1)")
    add("--max_batch_size", type=bounded(int, 1, 1024), default=16, help="dynamic batching's rows (16)")
    add("--max_queue_delay_ms", type=bounded(float, 0.0, 1000.0), default=2.0, help="its delay (2)")
    add("--pa_window_ms", type=bounded(int, 200, 60_000), default=1500, help="perf_analyzer's window (1500)")
    add("--pa_max_trials", type=bounded(int, 3, 100), default=8, help="perf_analyzer's windows at most (8)")
    add("--pa_stability_pct", type=bounded(float, 0.1, 1e4), default=10.0, help="perf_analyzer's -s (10)")
    add("--report_only", action="store_true", help="write the report from what is in --out")
    return parser


def settings_of(args: argparse.Namespace) -> Settings:
    given = {name: getattr(args, name) for name in Settings.__dataclass_fields__}
    for name in ("models", "peers", "clients", "concurrency", "rate_fractions"):
        given[name] = tuple(dict.fromkeys(given[name]))
    return Settings(**given)


def preflight(settings: Settings) -> Path | None:
    """Before anything starts: our runs' flags (as server.py checks them), the peers' environments, perf_analyzer.
    ConfigError (exit 2) for the first that is missing; perf_analyzer's path, or None when it is not used."""
    peers = settings.peers_under_test()
    if "ours" in settings.peers:
        check_server_flags(
            [settings.served_flags(p, m, 1, "check") for p in peers[:2] for m in settings.models], serves=True
        )
    levels = [(CLOSED.name, c) for c in settings.concurrency] + [(POISSON.name, 1.0)]
    check_server_flags(
        [
            settings.our_flags(f"http://{FLAG_CHECK_ADDRESS}", m, load, level, "check", 0)
            for m in settings.models
            for load, level in levels
        ]
    )
    for kind in settings.peers:
        if kind != "ours":
            peer_python(kind)
    if "perf_analyzer" not in settings.clients:
        return None
    try:
        return pa.ensure_perf_analyzer()
    except pa.PerfAnalyzerMissing as exc:
        raise ConfigError(f"perf_analyzer cannot be brought: {exc}") from None


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parse_bench_args(parser, argv, "bench.peers", META_JSON)  # --out checked before any run
    if args.report_only:
        return report(args.out)
    settings = settings_of(args)
    try:
        binary = preflight(settings)
    except ConfigError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    given = list(sys.argv[1:] if argv is None else argv)
    kept = f"; the runs so far are in {args.out / RUNS_CSV}"
    return interruptible(PROG, lambda: measure(settings, args.out, given, binary), kept)


if __name__ == "__main__":
    sys.exit(main())
