"""What the network front door costs, in one study: the same server behind shm (no door), HTTP with JSON tensors,
HTTP with binary tensors and gRPC, each door in its own process and inline, against a bare echo endpoint on the
door's own framework (bench/echo_server.py) driven by the same client, interleaved and repeated.

    python -m bench.frontdoor --out results/frontdoor
    python -m bench.frontdoor --out /tmp/fd --repeats 1 --models identity --transports shm http-binary --doors process

Cases (each a server.py run, closed loop, --device cpu --no-ceiling --port 0, a fixed request count):

- models: identity, one 16x16 image per request (the server's own cost; --identity_iters) and resnet18, 32 images
  of 64x64 per request (a real forward; --resnet_iters);
- designs: serial and pipelined with 2 workers; transports: shm, http-json (--no-binary_data), http-binary, grpc;
  the network ones with --door process and --door inline; --load closed at each --concurrency (1 and 16);
- anchors, with identity: an echo server per network transport (HTTP binary, HTTP JSON, gRPC) at each concurrency,
  with identity's request, driven by server.py --target: the least a Python server on that framework costs. The
  study runner starts the echo around each such run (its fixture) and stops it after.

On the study harness (bench/study.py): every repeat runs every case once, in an order shuffled per repeat (seeded),
so a drift of the machine spreads over all cases; the same command resumes. Every run's row goes to <out>/runs.csv
(a run that wrote none, or whose echo did not start, gets one saying so); <out>/frontdoor.md (printed) has, per
model, design and concurrency, each transport and door's requests/s (median of the repeats, min-max), p50 and p99
(medians), the door's added time per request (its p50 minus shm's), the anchors, and the ratios: the door over the
echo at batch 1, and resnet18's door over shm at batch 32. Exit status 1 when a run failed. Run nothing else on the
machine meanwhile.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from bench.echo_server import SERVED_PREFIX
from bench.launch import FLAG_CHECK_ADDRESS, start_served, stop_served
from bench.study import Study, run_study
from serverbench.config.flags import bounded
from serverbench.config.loads import CLOSED
from serverbench.config.transport_kinds import SHM
from serverbench.launch.session import Session
from serverbench.launch.study import Cell, Experiment, FixtureFailed, LoadPoint, interleaved
from serverbench.records.markdown import table_head

REPORT_MD = "frontdoor.md"

MODELS = {  # each model's flags and its batch (the runner gives every run its --batch_size)
    "identity": (("--model", "identity", "--image_size", "16"), 1),
    "resnet18": (("--model", "resnet18", "--image_size", "64"), 32),
}
DESIGNS = {"serial": ("--design", "serial"), "pipelined_2w": ("--design", "pipelined", "--num_workers", "2")}
TRANSPORTS = {
    "shm": ("--transport", "shm"),
    "http-json": ("--transport", "http", "--no-binary_data"),
    "http-binary": ("--transport", "http"),
    "grpc": ("--transport", "grpc"),
}
DOORS = ("process", "inline")
NO_DOOR = "none"  # shm's door
ECHO = "echo"  # the anchors' model and door
ECHO_SHAPE = "1,3,16,16"  # identity's request
ECHO_BINARY = {"http-json": ("http", ("--no-binary_data",)), "http-binary": ("http", ()), "grpc": ("grpc", ())}
ECHO_INPUT = "image:float32:3x16x16"  # what the echo's metadata names: given, so the checks contact no server
ECHO_START_S = 30.0  # the echo imports grpc, uvicorn and tritonclient's stubs: seconds on a busy machine
ECHO_STOP_S = 5.0


@dataclass(frozen=True)
class Case:
    model: str  # identity, resnet18 or echo
    design: str  # serial, pipelined_2w, or anchor for the echo
    transport: str  # shm, http-json, http-binary, grpc
    door: str  # process, inline, none (shm) or echo
    concurrency: int

    @property
    def label(self) -> str:
        """The run's --experiment, from which the report reads the case back."""
        return f"{self.model}.{self.design}.{self.transport}.{self.door}.c{self.concurrency}"

    @staticmethod
    def from_label(label: str) -> Case | None:
        parts = str(label).split(".")
        if len(parts) != 5 or not parts[4].startswith("c") or not parts[4][1:].isdigit():
            return None
        return Case(*parts[:4], int(parts[4][1:]))

    @property
    def batch_size(self) -> int:
        return MODELS[self.model][1] if self.model in MODELS else 1

    def experiment(self, args: argparse.Namespace) -> Experiment:
        """server.py's flags for this case, but those the runner gives every run (the load point, batch size,
        experiment and repeat). The echo's --target is a placeholder that its fixture's address replaces."""
        flags = ["--device", "cpu", "--no-ceiling", "--warmup_iters", str(args.warmup_iters)]
        flags += ["--num_iters", str(args.resnet_iters if self.model == "resnet18" else args.identity_iters)]
        if self.model == ECHO:
            scheme, binary = ECHO_BINARY[self.transport]
            flags += ["--target", f"{scheme}://{FLAG_CHECK_ADDRESS}", "--model", ECHO, "--input", ECHO_INPUT, *binary]
        else:
            flags += [*MODELS[self.model][0], *DESIGNS[self.design], *TRANSPORTS[self.transport]]
            flags += ["--door", self.door, "--port", "0"] if self.door != NO_DOOR else []
        return Experiment(self.label, tuple(flags))


def cases(args: argparse.Namespace) -> list[Case]:
    """The matrix the arguments ask for: every model x design x transport x door x concurrency, then the anchors
    (with identity: the echo of each network transport measured, at each concurrency)."""
    found = []
    for model in args.models:
        for design in args.designs:
            for transport in args.transports:
                for door in [NO_DOOR] if transport == SHM.name else args.doors:
                    found += [Case(model, design, transport, door, c) for c in args.concurrency]
    if "identity" in args.models:
        for transport in (t for t in args.transports if t != SHM.name):
            found += [Case(ECHO, "anchor", transport, ECHO, c) for c in args.concurrency]
    return found


def cells(args: argparse.Namespace, rows: pd.DataFrame | None) -> list[Cell]:
    """Every case once per repeat, in an order shuffled per repeat: drift hits all cases alike."""
    round_cells = [
        Cell(case.experiment(args), case.batch_size, False, 0, LoadPoint(CLOSED.name, case.concurrency))
        for case in cases(args)
    ]
    return interleaved(round_cells, args.repeats, args.seed)


class EchoFailed(FixtureFailed):
    """The echo server did not say it was serving."""


def echo_command(transport: str, shape: str = ECHO_SHAPE) -> list[str]:
    """bench.echo_server for `transport` (http-binary, http-json, grpc) on a free port, answering requests of
    `shape` (batch first, "1,3,16,16")."""
    scheme = ECHO_BINARY[transport][0]
    return [sys.executable, "-m", "bench.echo_server", "--transport", scheme, "--port", "0", "--shape", shape]


def echo_url(session: Session) -> str | None:
    """The echo's URL once its "echo serving on URL" line is in its log."""
    lines = session.log_text().splitlines()[1:]  # after the command line
    urls = [line.split()[-1] for line in lines if line.startswith(SERVED_PREFIX)]
    return urls[0] if urls else None


@contextmanager
def echo_server(transport: str, log_path: Path, shape: str = ECHO_SHAPE) -> Iterator[str]:
    """The echo (echo_command) through the one launcher, its output in `log_path`; yields its URL once it serves,
    and stops it after. EchoFailed with what it said when it did not serve in time."""
    session, problem = start_served(echo_command(transport, shape), log_path, echo_url, "the echo server", ECHO_START_S)
    if problem:
        raise EchoFailed(problem)
    try:
        yield echo_url(session)
    finally:
        stop_served(session, "the echo server", ECHO_STOP_S)


@contextmanager
def echo_fixture(cell: Cell, out: Path) -> Iterator[tuple[str, ...]]:
    """The runner's fixture: an anchor's run gets its echo, started around it, as its --target; others nothing."""
    case = Case.from_label(cell.experiment.name)
    if case is None or case.model != ECHO:
        yield ()
        return
    log = cell.log_path(out)
    with echo_server(case.transport, log.with_name(f"echo_{log.name}")) as url:
        yield ("--target", url)


# ------------------------------------------------------------------------------------------------ the report


@dataclass(frozen=True)
class Measured:
    """A case's repeats: ok ones' medians, and how many ran."""

    throughput_rps: float | None  # median of the ok repeats' achieved requests/s
    min_rps: float | None
    max_rps: float | None
    p50_ms: float | None  # median of the ok repeats' p50
    p99_ms: float | None
    ok: int
    runs: int


def summarise(runs: pd.DataFrame) -> dict[Case, Measured]:
    """Each case's repeats (a run that wrote no row has one the runner wrote, which says so)."""
    found: dict[Case, Measured] = {}
    for label in dict.fromkeys(runs["experiment"]):
        case = Case.from_label(label)
        if case is None:
            continue
        rows = runs[runs["experiment"] == label]
        ok = rows[rows["status"] == "ok"]
        rps = ok["achieved_rate_rps"].dropna() if len(ok) else pd.Series(dtype=float)
        found[case] = Measured(
            float(rps.median()) if len(rps) else None,
            float(rps.min()) if len(rps) else None,
            float(rps.max()) if len(rps) else None,
            float(ok["p50_latency_s"].median() * 1e3) if len(ok) else None,
            float(ok["p99_latency_s"].median() * 1e3) if len(ok) else None,
            len(ok),
            len(rows),
        )
    return found


def _num(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def _rps(got: Measured) -> str:
    if got.throughput_rps is None:
        return "n/a"
    digits = 0 if got.throughput_rps >= 100 else 1  # resnet18's tens of requests/s need their tenths
    return f"{got.throughput_rps:,.{digits}f} ({got.min_rps:,.{digits}f}-{got.max_rps:,.{digits}f})"


TABLE_HEAD = table_head(
    ["transport", "door", "requests/s, median (min-max)", "p50 ms", "p99 ms", "door's added p50 ms (vs shm)", "ok/runs"]
)


def case_tables(found: dict[Case, Measured]) -> list[str]:
    """Per model, design and concurrency: each transport and door; the anchors at the end."""
    lines: list[str] = []
    groups = sorted({(c.model, c.design, c.concurrency) for c in found if c.model != ECHO}, key=_group_order)
    for model, design, concurrency in groups:
        shm = found.get(Case(model, design, SHM.name, NO_DOOR, concurrency))
        flags, batch = MODELS[model]
        lines += [f"### {model} ({' '.join(flags)} --batch_size {batch}), {design}, concurrency {concurrency}", ""]
        lines += TABLE_HEAD
        members = [c for c in found if (c.model, c.design, c.concurrency) == (model, design, concurrency)]
        for case in sorted(members, key=_case_order):
            got = found[case]
            added = None
            if case.transport != SHM.name and shm is not None and None not in (got.p50_ms, shm.p50_ms):
                added = got.p50_ms - shm.p50_ms
            lines.append(
                f"| {case.transport} | {case.door} | {_rps(got)} | {_num(got.p50_ms)} | {_num(got.p99_ms)} | "
                f"{'-' if case.transport == 'shm' else _num(added, 3)} | {got.ok}/{got.runs} |"
            )
        lines.append("")
    anchors = sorted((c for c in found if c.model == ECHO), key=_case_order)
    if anchors:
        lines += [f"### Anchors: the echo server (`bench.echo_server`, a {ECHO_SHAPE} FP32 request), same client", ""]
        lines += table_head(["transport", "concurrency", "requests/s, median (min-max)", "p50 ms", "p99 ms", "ok/runs"])
        for case in anchors:
            got = found[case]
            lines.append(
                f"| {case.transport} | {case.concurrency} | {_rps(got)} | {_num(got.p50_ms)} | {_num(got.p99_ms)} | "
                f"{got.ok}/{got.runs} |"
            )
        lines.append("")
    return lines


def _group_order(group: tuple[str, str, int]) -> tuple:
    model, design, concurrency = group
    return (_index(MODELS, model), _index(DESIGNS, design), concurrency)


def _case_order(case: Case) -> tuple:
    return (case.concurrency, _index(TRANSPORTS, case.transport), _index((NO_DOOR, *DOORS, ECHO), case.door))


def _index(known: Sequence[str] | dict, name: str) -> int:
    names = list(known)
    return names.index(name) if name in names else len(names)


def best_door(found: dict[Case, Measured], model: str, design: str, transport: str, concurrency: int) -> tuple:
    """(the door placement with the higher median requests/s, its Measured, the other placements' text)."""
    measured = [(d, found[c]) for d in DOORS if (c := Case(model, design, transport, d, concurrency)) in found]
    measured = [(d, m) for d, m in measured if m.throughput_rps is not None]
    if not measured:
        return None, None, ""
    door, got = max(measured, key=lambda item: item[1].throughput_rps)
    return door, got, ", ".join(f"{d} {m.throughput_rps:,.0f}" for d, m in measured if d != door)


def echo_checks(found: dict[Case, Measured]) -> list[str]:
    """At batch 1 (identity): each network door (its better placement) over the echo of its transport."""
    lines = []
    groups = {(c.design, c.concurrency) for c in found if c.model == "identity"}
    for design, concurrency in sorted(groups, key=lambda g: (_index(DESIGNS, g[0]), g[1])):
        for transport in (t for t in TRANSPORTS if t != SHM.name):
            echo = found.get(Case(ECHO, "anchor", transport, ECHO, concurrency))
            door, got, others = best_door(found, "identity", design, transport, concurrency)
            if door is None or echo is None or not echo.throughput_rps:
                continue
            lines.append(
                f"- identity, {design}, concurrency {concurrency}, {transport}: the door "
                f"({f'{door}, the better placement; {others}' if others else f'{door}, the only placement measured'}) "
                f"{got.throughput_rps:,.0f} requests/s / the echo's "
                f"{echo.throughput_rps:,.0f} = **{got.throughput_rps / echo.throughput_rps:.2f}**"
            )
    return lines


def shm_checks(found: dict[Case, Measured]) -> list[str]:
    """At batch 32 (resnet18): each network door's throughput over shm's; 1 minus it is what the door costs."""
    lines = []
    doors = [c for c in found if c.model == "resnet18" and c.transport != SHM.name]
    for case in sorted(doors, key=lambda c: (_index(DESIGNS, c.design), _case_order(c))):
        shm = found.get(Case("resnet18", case.design, SHM.name, NO_DOOR, case.concurrency))
        got = found[case]
        if shm is None or not shm.throughput_rps or got.throughput_rps is None:
            continue
        ratio = got.throughput_rps / shm.throughput_rps
        lines.append(
            f"- resnet18, {case.design}, concurrency {case.concurrency}, {case.transport} {case.door}: "
            f"{got.throughput_rps:,.1f} / shm's {shm.throughput_rps:,.1f} requests/s = {ratio:.3f}: "
            f"the door costs **{(1 - ratio) * 100:.1f} %**"
        )
    return lines


def failures(runs: pd.DataFrame) -> list[str]:
    """Every run that did not end ok: its row's status and error."""
    return [
        f"- {row['experiment']} repeat {row['repeat']}: {row['status']}: {' '.join(str(row['error']).split())[:200]}"
        for _, row in runs[runs["status"] != "ok"].iterrows()
    ]


def report(args: argparse.Namespace, runs: pd.DataFrame, out: Path) -> list[str]:
    """frontdoor.md's lines from the study's rows."""
    found = summarise(runs)
    failed = failures(runs)
    return [
        "# What the front door costs",
        "- every run: server.py --device cpu --no-ceiling --load closed; requests/s is the achieved rate; "
        "p50 and p99 are medians over the ok repeats; the door's added p50 is its p50 minus shm's (same model, "
        "design and concurrency).",
        "- door against echo, what differs besides the door: our client asks our door for the backend's stamps (a "
        "small JSON parameter each way) and not the echo; identity answers 4 bytes (a per-sample sum), the echo "
        "the 3,072 it got; the echo's CPU time is in its runs' other_cpu_pct (another process to server.py).",
        "",
        *case_tables(found),
        "## The door against the echo (batch 1)",
        "",
        *(echo_checks(found) or ["- n/a: needs identity and the echo of a network transport"]),
        "",
        "## The door against shm (resnet18, batch 32)",
        "",
        *(shm_checks(found) or ["- n/a: needs resnet18 with shm and a network transport"]),
        "",
        f"## Runs that failed: {len(failed)}",
        "",
        *(failed or ["none"]),
    ]


# ------------------------------------------------------------------------------------------------ the command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--designs", nargs="+", choices=list(DESIGNS), default=list(DESIGNS))
    parser.add_argument("--transports", nargs="+", choices=list(TRANSPORTS), default=list(TRANSPORTS))
    parser.add_argument("--doors", nargs="+", choices=DOORS, default=list(DOORS))
    parser.add_argument(
        "--concurrency", nargs="+", type=bounded(int, 1, 1024), default=[1, 16], help="closed-loop concurrencies"
    )
    parser.add_argument(
        "--identity_iters",
        type=bounded(int, 1, 10**7),
        default=2000,
        help="measured requests of identity and echo runs (default 2000: about 1 s at 2,000 requests/s)",
    )
    parser.add_argument(
        "--resnet_iters",
        type=bounded(int, 1, 10**7),
        default=60,
        help="measured requests of resnet18 runs (default 60: 1-2 s of 32-image forwards on 2 cores)",
    )
    # Sent one at a time before the measured phase: the model, the ring and one connection are warm by then.
    parser.add_argument("--warmup_iters", type=bounded(int, 1, 10**6), default=10, help="(default 10)")


STUDY = Study(
    "frontdoor", __doc__, (cells,), report, add_arguments, repeats=3, load_axis=CLOSED.name, fixture=echo_fixture
)


def main(argv: Sequence[str] | None = None) -> int:
    return run_study(STUDY, argv)


if __name__ == "__main__":
    sys.exit(main())
