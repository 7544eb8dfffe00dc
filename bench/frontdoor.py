"""What the network front door costs, in one run: the same server behind shm (no door), HTTP with JSON tensors,
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
  with identity's request, driven by server.py --target: the least a Python server on that framework costs.

Every repeat runs every case once, in an order shuffled per repeat (seeded), so a drift of the machine spreads over
all cases. Every run's row goes to <out>/runs.csv (the attempts, with their exit status, to <out>/attempts.csv, so a
run that wrote no row is still reported); <out>/frontdoor.md (printed) has, per model, design and concurrency, each
transport and door's requests/s (median of the repeats, min-max), p50 and p99 (medians), the door's added time per
request (its p50 minus shm's), the anchors, and the ratios: the door over the echo at batch 1, and resnet18's door over
shm at batch 32. Exit status 1 when a run failed. `--report_only` writes the report again from the rows. Run nothing
else on the machine meanwhile.
"""

from __future__ import annotations

import argparse
import csv
import json
import shlex
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from bench.echo_server import SERVED_PREFIX
from bench.launch import check_server_flags, interruptible, run_meta, run_server, start_served, stop_served
from serverbench.config.flags import ConfigError, OneLineErrorParser, bounded
from serverbench.config.limits import MAX_REPEATS, MAX_SECONDS
from serverbench.config.loads import CLOSED
from serverbench.config.paths import parse_bench_args
from serverbench.config.transport_kinds import SHM
from serverbench.launch.session import Session
from serverbench.records.markdown import table_head
from serverbench.schema.ab import shuffled
from sweep import RUNS_CSV

ROOT = Path(__file__).resolve().parent.parent
ATTEMPTS_CSV = "attempts.csv"
MEASURED_JSON = "measured.json"  # the measurement's command, date, commit and machine, for --report_only
REPORT_MD = "frontdoor.md"

MODELS = {
    "identity": ("--model", "identity", "--image_size", "16", "--batch_size", "1"),
    "resnet18": ("--model", "resnet18", "--image_size", "64", "--batch_size", "32"),
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

    def server_flags(self, args: argparse.Namespace, repeat: int, target: str | None = None) -> list[str]:
        """server.py's flags for this case (the echo's: with the URL it listens on)."""
        common = ["--device", "cpu", "--no-ceiling", "--warmup_iters", str(args.warmup_iters)]
        common += ["--load", CLOSED.name, "--concurrency", str(self.concurrency)]
        common += ["--experiment", self.label, "--repeat", str(repeat)]
        iters = args.resnet_iters if self.model == "resnet18" else args.identity_iters
        if self.model == ECHO:  # the inputs come from the echo's metadata (identity's image)
            scheme, binary = ECHO_BINARY[self.transport]
            # Before any run the flags are only checked (nothing is contacted): any address stands for the echo's.
            url = target or f"{scheme}://127.0.0.1:1"
            return [*common, "--target", url, "--model", ECHO, *binary, "--batch_size", "1", "--num_iters", str(iters)]
        flags = [*common, *MODELS[self.model], *DESIGNS[self.design], *TRANSPORTS[self.transport]]
        if self.door != NO_DOOR:
            flags += ["--door", self.door, "--port", "0"]
        return [*flags, "--num_iters", str(iters)]


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


def interleaved(found: Sequence[Case], repeats: int, seed: int) -> list[tuple[int, Case]]:
    """Every case once per repeat, in an order shuffled per repeat: drift hits all cases alike."""
    order = []
    for repeat in range(repeats):
        order += [(repeat, case) for case in shuffled(found, seed, repeat)]
    return order


# ------------------------------------------------------------------------------------------------ running


class EchoFailed(Exception):
    """The echo server did not say it was serving."""


@contextmanager
def echo_server(transport: str, log_path: Path, shape: str = ECHO_SHAPE) -> Iterator[str]:
    """bench.echo_server for `transport` (http-binary, http-json, grpc) on a free port, answering requests of
    `shape` (batch first, "1,3,16,16"), through the one launcher, its output in `log_path`; yields its URL once its
    "echo serving on URL" line is there, and stops it after. EchoFailed with what it said when no such line came
    in time."""
    scheme = ECHO_BINARY[transport][0]
    command = [sys.executable, "-m", "bench.echo_server", "--transport", scheme, "--port", "0", "--shape", shape]
    urls: list[str] = []

    def serving(session: Session) -> bool:
        lines = session.log_text().splitlines()[1:]  # after the command line
        urls.extend(line.split()[-1] for line in lines if line.startswith(SERVED_PREFIX))
        return bool(urls)

    session, problem = start_served(command, log_path, serving, "the echo server", ECHO_START_S)
    if problem:
        raise EchoFailed(problem)
    try:
        yield urls[0]
    finally:
        stop_served(session, "the echo server", ECHO_STOP_S)


def record_attempt(out: Path, case: Case, repeat: int, returncode: int | None, note: str) -> None:
    """Every run tried, with its exit status: a run that wrote no row is reported from here."""
    path = out / ATTEMPTS_CSV
    new = not path.exists()
    with open(path, "a", newline="") as f:
        writer = csv.writer(f)
        if new:
            writer.writerow(["experiment", "repeat", "returncode", "note"])
        writer.writerow([case.label, repeat, "" if returncode is None else returncode, note])


def run_case(args: argparse.Namespace, case: Case, repeat: int) -> str:
    """One run of the case (the echo's started and stopped around it); its status as the row says, or why no row."""
    try:
        if case.model == ECHO:
            with echo_server(case.transport, args.out / "logs" / f"echo_{case.label}_r{repeat}.log") as url:
                ran = run_server(case.server_flags(args, repeat, url), args.out, RUNS_CSV, timeout_s=args.run_timeout_s)
        else:
            ran = run_server(case.server_flags(args, repeat), args.out, RUNS_CSV, timeout_s=args.run_timeout_s)
    except EchoFailed as exc:
        record_attempt(args.out, case, repeat, None, str(exc))
        return "failed: no echo server"
    rows = ran.rows()
    mine = rows[(rows["experiment"] == case.label) & (rows["repeat"] == repeat)] if len(rows) else rows
    note = "timed out" if ran.timed_out else ""
    record_attempt(args.out, case, repeat, ran.returncode, note)
    return str(mine["status"].iloc[-1]) if len(mine) else f"failed: exit {ran.returncode}, no row"


def measure(args: argparse.Namespace, command: str) -> None:
    """Every case's repeats, interleaved; the folder's earlier rows replaced (server.py appends)."""
    found = cases(args)
    args.out.mkdir(parents=True, exist_ok=True)
    for old in (RUNS_CSV, ATTEMPTS_CSV, REPORT_MD):
        (args.out / old).unlink(missing_ok=True)
    order = interleaved(found, args.repeats, args.seed)
    measured = run_meta(command) | {"repeats": args.repeats, "seed": args.seed, "runs": len(order)}
    write_measured(args.out, measured)
    print(f"frontdoor: {len(order)} runs ({len(found)} cases x {args.repeats} repeats) into {args.out}", flush=True)
    started_s = time.monotonic()
    for index, (repeat, case) in enumerate(order, start=1):
        print(f"[{index}/{len(order)}] {case.label} r{repeat} ...", flush=True)
        run_start_s = time.monotonic()
        status = run_case(args, case, repeat)
        print(f"[{index}/{len(order)}] {case.label} r{repeat}: {status} in {time.monotonic() - run_start_s:.1f} s")
    write_measured(args.out, {**measured, "elapsed_s": round(time.monotonic() - started_s)})


def write_measured(out: Path, measured: dict) -> None:
    (out / MEASURED_JSON).write_text(json.dumps(measured, indent=1) + "\n")


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


def summarise(runs: pd.DataFrame, attempts: pd.DataFrame) -> dict[Case, Measured]:
    """Each case's repeats; a run with no row (from the attempts) counts as a failed run."""
    found: dict[Case, Measured] = {}
    labels = list(dict.fromkeys([*runs.get("experiment", []), *attempts.get("experiment", [])]))
    for label in labels:
        case = Case.from_label(label)
        if case is None:
            continue
        rows = runs[runs["experiment"] == label] if len(runs) else runs
        ok = rows[rows["status"] == "ok"] if len(rows) else rows
        tried = attempts[attempts["experiment"] == label]["repeat"] if len(attempts) else pd.Series(dtype=int)
        rowless = len(set(tried) - set(rows["repeat"] if len(rows) else []))
        rps = ok["achieved_rate_rps"].dropna() if len(ok) else pd.Series(dtype=float)
        found[case] = Measured(
            float(rps.median()) if len(rps) else None,
            float(rps.min()) if len(rps) else None,
            float(rps.max()) if len(rps) else None,
            float(ok["p50_latency_s"].median() * 1e3) if len(ok) else None,
            float(ok["p99_latency_s"].median() * 1e3) if len(ok) else None,
            len(ok),
            len(rows) + rowless,
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
        lines += [f"### {model} ({' '.join(MODELS.get(model, ()))}), {design}, concurrency {concurrency}", ""]
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


def failures(runs: pd.DataFrame, attempts: pd.DataFrame) -> list[str]:
    """Every run that did not end ok: its row's status and error (and the attempt's note: a timeout), or the attempt
    that left no row."""
    notes = {}
    for _, attempt in attempts.iterrows() if len(attempts) else ():
        code = "none" if pd.isna(attempt["returncode"]) else int(attempt["returncode"])
        note = "" if pd.isna(attempt["note"]) else str(attempt["note"])
        notes[(attempt["experiment"], attempt["repeat"])] = (code, note)
    lines = []
    if len(runs):
        for _, row in runs[runs["status"] != "ok"].iterrows():
            error = " ".join(str(row.get("error", "")).split())[:200]
            note = notes.get((row["experiment"], row["repeat"]), (None, ""))[1]
            lines.append(
                f"- {row['experiment']} repeat {row['repeat']}: {row['status']}: {error}{f' ({note})' * bool(note)}"
            )
    have = set(zip(runs["experiment"], runs["repeat"])) if len(runs) else set()
    for (label, repeat), (code, note) in notes.items():
        if (label, repeat) not in have:
            lines.append(f"- {label} repeat {repeat}: no row (exit {code}){f': {note}' * bool(note)}")
    return lines


def report(out: Path) -> tuple[str, int]:
    """frontdoor.md's text from the folder's rows, and how many runs failed."""
    from report import load_runs

    runs = load_runs(out / RUNS_CSV) if (out / RUNS_CSV).exists() else pd.DataFrame()
    attempts = pd.read_csv(out / ATTEMPTS_CSV) if (out / ATTEMPTS_CSV).exists() else pd.DataFrame()
    measured = json.loads((out / MEASURED_JSON).read_text()) if (out / MEASURED_JSON).exists() else {}
    found = summarise(runs, attempts)
    failed = failures(runs, attempts)
    # The cores apart since run_meta; a measurement before it named them in its machine
    cores = f", {measured['cores']} usable CPU cores" if "cores" in measured else ""
    lines = [
        "# What the front door costs",
        "",
        f"- command: `{measured.get('command', 'unknown')}`",
        f"- date: {measured.get('date', 'unknown')}; commit {measured.get('commit', 'unknown')}; "
        f"machine: {measured.get('machine', 'unknown')}{cores}; {measured.get('runs', '?')} runs in "
        f"{measured.get('elapsed_s', '?')} s, repeats: {measured.get('repeats', '?')}, interleaved (seed "
        f"{measured.get('seed', '?')})",
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
        "",
    ]
    return "\n".join(lines), len(failed)


# ------------------------------------------------------------------------------------------------ the command


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog="python -m bench.frontdoor", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "frontdoor")
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--designs", nargs="+", choices=list(DESIGNS), default=list(DESIGNS))
    parser.add_argument("--transports", nargs="+", choices=list(TRANSPORTS), default=list(TRANSPORTS))
    parser.add_argument("--doors", nargs="+", choices=DOORS, default=list(DOORS))
    parser.add_argument(
        "--concurrency", nargs="+", type=bounded(int, 1, 1024), default=[1, 16], help="closed-loop concurrencies"
    )
    parser.add_argument(
        "--repeats", type=bounded(int, 1, MAX_REPEATS), default=3, help=f"1 to {MAX_REPEATS} (default 3)"
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
    parser.add_argument("--seed", type=int, default=0, help="seed of the run order (default 0)")
    parser.add_argument(
        "--run_timeout_s",
        type=bounded(float, 1.0, MAX_SECONDS),
        default=600.0,
        help="seconds a run may take before it is stopped and reported (default 600)",
    )
    parser.add_argument("--report_only", action="store_true", help="write the report again from the rows in --out")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parse_bench_args(parser, argv, "bench.frontdoor", RUNS_CSV)  # --out checked before any run
    args.out = args.out.resolve()
    if not args.report_only:
        try:  # every run's flags as server.py takes them, before the first run
            check_server_flags(case.server_flags(args, 0) for case in cases(args))
        except ConfigError as exc:
            parser.error(str(exc))
    command = shlex.join(["python", "-m", "bench.frontdoor", *(sys.argv[1:] if argv is None else argv)])
    return interruptible(parser.prog, lambda: measure_and_report(args, command), f"; the rows so far are in {args.out}")


def measure_and_report(args: argparse.Namespace, command: str) -> int:
    if not args.report_only:
        measure(args, command)
    text, failed = report(args.out)
    (args.out / REPORT_MD).write_text(text)
    print(text)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
