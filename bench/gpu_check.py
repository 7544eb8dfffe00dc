"""The first run on a GPU machine, in two commands that each end within a budget (default 280 s), each check with a
clear pass or FAIL, or why it did not run.

    python3 -m bench.gpu_check --part 1 --budget_s 280 --out $OUT/gpu1
    python3 -m bench.gpu_check --part 2 --budget_s 280 --out $OUT/gpu2
    python -m bench.gpu_check --part 1 --dry_run --out /tmp/gpu_dry   # the same plan on the CPU, tiny sizes

Each part first probes the machine in a child process (torch, CUDA, driver, NVML's compute mode and PCIe link, the
C compiler and Python.h torch.compile needs, the CUDA toolkit AOTInductor needs, /dev/shm) and refuses, with the
reason, the checks that cannot run there. Part 1: the cuda-marked tests; --verify on the three designs over shm and
queue; the planted race; H2D bandwidth against the link; copies overlapping forwards; the reference-like server
against the fastest at batch 256; GPU utilisation while serving. Part 2: --compile with 2 workers and serial
reduce-overhead; the example model eager, batched and through AOTInductor; --instances 2; the HTTP door beside shm;
a short reference table. The checks run in the order of their value, each within the time left; those that only
check correctness run side by side, the timed ones alone. What the budget did not reach is listed as "not run
(budget)". --out gets summary.md and checks.json, rewritten after each check, and one bundle of the rows and logs
(partN.tar.gz). The parent never touches CUDA: the probe, the bandwidth measurement and the servers are children.
Without a usable GPU (and without --dry_run) it exits 2 with one line.
"""

from __future__ import annotations

import io
import json
import re
import shutil
import sys
import tarfile
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import asdict, replace
from pathlib import Path

from bench.gpu_checks import CHECK_NAMES, CHECKS, CheckSpec
from bench.gpu_probe import EXCLUSIVE_PROCESS, ROOT, run_child
from bench.gpu_runs import BUDGET, FAIL, INFO, Check, Context, Plan, Runner
from bench.study import tool_command
from serverbench.config.flags import ConfigError, OneLineErrorParser, bounded
from serverbench.config.paths import check_output_folder
from serverbench.launch.study import interruptible
from serverbench.records.markdown import table_head, table_row

DEFAULT_BUDGET_S = 280.0  # under 5 minutes with the interpreter's start and the bundle
GPU_PLAN = Plan()  # a GPU's sizes: Plan's defaults
# The same checks on the CPU, as small as they go: the identity model wherever the run only has to go through,
# resnet18 where its slow forward is what lets the planted race show. Timings mean nothing here, so the timed
# checks run beside the others.
DRY_PLAN = replace(
    GPU_PLAN,
    device="cpu",
    model="identity",
    image_size=32,
    batch_size=2,
    num_iters=6,
    ceiling_s=0.05,
    timed_min_s=0.0,
    race_image_size=32,
    race_repeats=1,
    race_num_iters=10,
    compile_model="identity",
    compare_model="identity",
    compare_batch_size=4,
    compare_num_iters=6,
    bandwidth_mib=4,
    example_tokens=8,
    example_depth=1,
    door_batch_sizes=(2,),
    door_num_iters=6,
    table_batch_sizes=(2,),
    table_num_iters=6,
    table_experiments=("serial", "pipelined_2w"),
    compile_cases=("pipelined_2w",),  # reduce-overhead captures CUDA graphs: nothing of it runs on the CPU
    example_cases=("batching",),  # eager, its batches formed: the eager case's path and more
    verify_every_pair=False,
    server_slots=3,
    concurrent_checks=3,
    timed_alone=False,
    pytest_workers=1,
    time_scale=0.1,
    stop_grace_s=5.0,
    min_run_s=3.0,
    end_margin_s=2.0,
)
# Left out of the bundle: compiled packages and caches (large, rebuilt by any run), the door's installed wheels.
BUNDLE_SKIP = {"aoti_cache", "door_site", "__pycache__"}
# The per-request records, the load and the GPU samples of each run: bundled after everything else, up to this
# much before compression (CSV compresses several times).
DETAIL_FOLDERS = {"requests", "load", "gpu"}
DETAIL_LIMIT_BYTES = 48 * 2**20


class Results:
    """checks.json, summary.md and the bundle of the runs under --out, rewritten after each check, so that a run
    stopped from outside still leaves what it had."""

    def __init__(self, out: Path, work: Path, label: str, kept: dict[str, dict], header: dict[str, str]) -> None:
        self.out, self.work, self.label = out, work, label
        self.checks = kept
        self.header = header
        self.facts: dict[str, str] = {}
        self.lock = threading.Lock()

    def record(self, key: str, check: Check) -> None:
        with self.lock:
            self.checks[key] = asdict(check)
            self.write()

    def write(self, final: str = "") -> None:
        order = ["probe", *CHECK_NAMES]
        self.checks = dict(sorted(self.checks.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else 99))
        (self.out / "checks.json").write_text(json.dumps(self.checks, indent=1) + "\n")
        (self.out / "summary.md").write_text(self.summary(final))
        self.bundle()

    def summary(self, final: str) -> str:
        lines = [f"# GPU check, {self.label}", ""]
        lines += [f"- {key}: {value}" for key, value in self.header.items()]
        lines += [f"- {final}" if final else "- still running (or stopped from outside)", ""]
        lines += ["## Environment", "", *table_head(["", ""])]
        lines += [table_row([key, value]) for key, value in self.facts.items()]
        lines += ["", "## Checks", "", *table_head(["check", "result", "detail", "s", "where"])]
        for c in self.checks.values():
            cells = [c["name"], f"**{c['status']}**", c.get("detail", ""), f"{c.get('seconds', 0):.0f}", c["where"]]
            lines.append(table_row(cells))
        failed = [c["name"] for c in self.checks.values() if c["status"] == FAIL]
        lines += [
            "",
            f"{'FAILED: ' + ', '.join(failed) if failed else 'No check failed.'} What each check means: docs/gpu.md.",
        ]
        for c in self.checks.values():
            if c.get("table"):
                lines += ["", f"## {c['name']}", "", c["table"].rstrip()]
        return "\n".join(lines) + "\n"

    def bundle(self) -> None:
        """The work folder as <label>.tar.gz: the rows and logs first, then the per-request records while the
        bundle stays small (what comes back from a lent machine is at most 16 MiB a file); files still growing are
        cut at the size they had."""
        path = self.out / f"{self.label}.tar.gz"
        partial = path.with_name(path.name + ".partial")
        files = [f for f in sorted(self.work.rglob("*")) if not BUNDLE_SKIP & set(f.relative_to(self.work).parts)]
        details = [f for f in files if DETAIL_FOLDERS & set(f.relative_to(self.work).parts)]
        total_bytes = 0
        with tarfile.open(partial, "w:gz") as tar:
            for file in [f for f in files if f not in details] + details:
                try:
                    data = file.read_bytes()
                    mtime = int(file.stat().st_mtime)
                except OSError:  # a folder, or a file removed meanwhile
                    continue
                total_bytes += len(data)
                if file in details and total_bytes > DETAIL_LIMIT_BYTES:
                    continue
                info = tarfile.TarInfo(str(Path(self.label) / file.relative_to(self.work)))
                info.size, info.mtime = len(data), mtime
                tar.addfile(info, io.BytesIO(data))
        partial.replace(path)


def plan_for(part: int, only: Sequence[str] | None) -> list[CheckSpec]:
    if only:
        return [spec for spec in CHECKS if spec.name in only]
    return [spec for spec in CHECKS if spec.part == part]


def run_checks(specs: Sequence[CheckSpec], ctx: Context, end: float, results: Results) -> None:
    """Each check in order, refused or given the time left (at most its cap); those that only check correctness
    start side by side (the plan's concurrent_checks), a timed one waits for them and runs alone."""
    plan = ctx.plan
    running: list[Future] = []
    with ThreadPoolExecutor(max_workers=plan.concurrent_checks) as pool:
        for spec in specs:
            waits = (spec.timed and plan.timed_alone) or spec.after_all
            if waits:
                wait(running)
                running = []
            if waits or plan.concurrent_checks == 1:
                run_one(spec, ctx, end, results)
            else:
                running.append(pool.submit(run_one, spec, ctx, end, results))
        wait(running)


def run_one(spec: CheckSpec, ctx: Context, end: float, results: Results) -> None:
    """The check, refused, or not started for want of time, or run until the budget's end or its cap, whichever
    comes first from the moment it starts."""
    refusal = spec.refused(ctx)
    started = time.monotonic()
    least_s = spec.min_s * ctx.plan.time_scale
    if refusal:
        check = Check(spec.name, "refused", refusal)
    elif end - started < max(least_s, 1.0):
        check = Check(spec.name, BUDGET, f"{max(0.0, end - started):.0f} s left, it needs at least {least_s:.0f} s")
    else:
        deadline = min(end, started + spec.cap_s)
        print(f"{spec.name}: started, {deadline - started:.0f} s at most", flush=True)
        try:
            check = spec.run(ctx, deadline)
        except Exception as exc:  # noqa: BLE001 - a check that breaks is a failed check; the others still run
            check = Check(spec.name, FAIL, f"the check itself failed: {type(exc).__name__}: {exc}"[:300])
    check.name, check.seconds = spec.name, time.monotonic() - started
    results.record(spec.name, check)
    print(f"{spec.name}: {check.status}: {check.detail} ({check.seconds:.0f} s)", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    started = time.monotonic()
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        out = None if args.out is None else check_output_folder("--out", args.out).resolve()
    except ConfigError as exc:
        parser.error(str(exc))
    kept = {} if out is None else _kept_checks(parser, out / "checks.json", bool(args.only))
    plan = GPU_PLAN if not args.dry_run else DRY_PLAN
    end = started + args.budget_s - plan.end_margin_s

    # The probe, in a child: the only way this process learns about CUDA.
    probe_started = time.monotonic()
    facts, why = run_child(["probe", "--device", plan.device], min(120.0, end - time.monotonic()))
    if facts is None:
        print(f"gpu_check: the probe of this machine failed ({why})", file=sys.stderr)
        return 2
    cuda = bool(facts.get("cuda"))
    if not args.dry_run and not cuda:
        reason = facts.get("unusable_reason") or "no CUDA GPU is visible to torch on this machine"
        print(f"gpu_check: {reason}; --dry_run runs the plan on the CPU", file=sys.stderr)
        return 2
    if out is None:
        name = "dry_run" if args.dry_run else re.sub(r"[^a-z0-9]+", "_", str(facts.get("gpu_name", "gpu")).lower())
        out = (ROOT / "results" / f"gpu_{name.strip('_')}").resolve()
        kept = _kept_checks(parser, out / "checks.json", bool(args.only))
    probe_detail = "; ".join(f"{k} {v}" for k, v in facts.get("facts", {}).items() if k in PROBE_SHOWN)
    if (other := _other_machine(kept, probe_detail)) is not None:
        print(
            f"gpu_check: {out / 'checks.json'} holds another machine's checks ({other}); give another --out or move "
            "it away",
            file=sys.stderr,
        )
        return 2
    if facts.get("compute_mode") == EXCLUSIVE_PROCESS:  # one CUDA context at a time: one server at a time
        plan = replace(plan, server_slots=1, concurrent_checks=1)
    out.mkdir(parents=True, exist_ok=True)

    specs = plan_for(args.part, args.only)
    label = "only" if args.only else f"part{args.part}"
    command = tool_command("gpu_check", argv if argv is not None else sys.argv[1:], ())
    header = {
        "command": f"`{command}`",
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "plan": f"{'dry run on the CPU, tiny sizes' if args.dry_run else 'GPU'}; {', '.join(s.name for s in specs)}",
        "budget": f"{args.budget_s:g} s",
    }

    # Ctrl-C, or SIGTERM from whatever bounds the lease, is one line and exit 130, even in a background run that
    # started with SIGINT ignored; what each finished check recorded stays in summary.md, checks.json and the bundle
    def checks() -> int:
        work = Path(tempfile.mkdtemp(prefix=f"gpu_check_{label}_"))
        results = Results(out, work, label, kept, header)
        results.facts = facts.get("facts", {})
        try:
            probe = Check("probe", INFO, probe_detail, "summary.md: Environment")
            probe.seconds = time.monotonic() - probe_started
            results.record("probe", probe)
            print("probe:\n" + "\n".join(f"  {key}: {value}" for key, value in results.facts.items()), flush=True)
            ctx = Context(plan, facts, work, Runner(plan), cuda)
            run_checks(specs, ctx, end, results)
            ran = {key: c for key, c in results.checks.items() if key in {s.name for s in specs}}
            counts = dict(sorted(Counter(c["status"] for c in ran.values()).items()))
            took_s = time.monotonic() - started
            final = (
                f"gpu_check {label}: {len(ran)} checks in {took_s:.1f} s of a {args.budget_s:g} s budget ("
                + ", ".join(f"{n} {status}" for status, n in counts.items())
                + ")"
            )
            with results.lock:
                results.write(final)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        print(f"summary: {out / 'summary.md'}; rows and logs: {out / (label + '.tar.gz')}")
        print(final, flush=True)
        return 1 if any(c["status"] == FAIL for c in ran.values()) else 0

    return interruptible("gpu_check", checks, f"; the checks done so far are in {out / 'summary.md'}")


def _parser() -> OneLineErrorParser:
    parser = OneLineErrorParser(prog="python -m bench.gpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--part",
        type=int,
        choices=(1, 2),
        default=1,
        help="1: probe, cuda tests, verify, race, bandwidth, overlap, compare, GPU utilisation; 2: probe, compile, "
        "the example model, AOTInductor, instances, the HTTP door, the reference table (default 1)",
    )
    parser.add_argument(
        "--budget_s",
        type=bounded(float, 5.0, 86400.0),
        default=DEFAULT_BUDGET_S,
        help=f"seconds the whole part may take, probe and bundle included; every run's timeout comes from what is "
        f"left (default {DEFAULT_BUDGET_S:g})",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="folder of summary.md, checks.json and partN.tar.gz (default results/gpu_<GPU name>, or "
        "results/gpu_dry_run)",
    )
    parser.add_argument(
        "--dry_run",
        action="store_true",
        help="the same plan on the CPU with tiny sizes: checks the script itself",
    )
    parser.add_argument(
        "--only",
        nargs="+",
        choices=CHECK_NAMES,
        default=None,
        help="run these checks only (of either part), merged into the checks.json --out already holds",
    )
    return parser


PROBE_SHOWN = ("GPUs visible", "NVIDIA driver", "torch", "compute mode", "/dev/shm", "C compiler", "CUDA toolkit")
# What makes two runs' checks one machine's, so that --out merges them: a dry run, another GPU, driver or torch does not
MACHINE_SHOWN = ("GPUs visible", "NVIDIA driver", "torch")


def _machine(probe_detail: str) -> set[str]:
    return {part for part in probe_detail.split("; ") if part.startswith(MACHINE_SHOWN)}


def _other_machine(kept: dict[str, dict], probe_detail: str) -> str | None:
    """The machine the kept checks were made on, when it is not this one (its probe says so); else None."""
    if "probe" not in kept:
        return None
    kept_machine = _machine(kept["probe"].get("detail", ""))
    return None if kept_machine == _machine(probe_detail) else "; ".join(sorted(kept_machine)) or "no GPU"


def _kept_checks(parser: OneLineErrorParser, path: Path, only: bool) -> dict[str, dict]:
    """What --out's checks.json holds from earlier runs (the other part's, or the checks --only does not run);
    it must be what this tool wrote."""
    if not path.exists():
        return {}
    try:
        kept = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        parser.error(f"{'--only: ' if only else ''}{path} cannot be merged into ({type(exc).__name__}); move it away")
    if not isinstance(kept, dict) or not all(isinstance(v, dict) and "status" in v for v in kept.values()):
        parser.error(f"{path} is not a checks file of bench.gpu_check; move it away")
    return kept


if __name__ == "__main__":
    sys.exit(main())
