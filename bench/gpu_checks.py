"""The checks of bench.gpu_check, one function each: what it runs, and its verdict as a Check; and CHECKS, every
check in the order of its value with its part, its time and what refuses it. The plan, the order, the budget and the
summary are in bench/gpu_check.py; the probe and its refusals in bench/gpu_probe.py; the runs and verdicts in
bench/gpu_runs.py. Nothing here touches CUDA: the probe, the H2D measurement, the servers and pytest are children."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.gpu_probe import EXCLUSIVE_PROCESS, NO_ANSWER, ROOT, aoti_refusal, compile_refusal, run_child, shm_refusal
from bench.gpu_runs import (
    BUDGET,
    FAIL,
    INFO,
    NOT_RUN,
    PARTIAL,
    PASS,
    REFUSED,
    Check,
    Context,
    Plan,
    RunResult,
    RunSpec,
    number,
    run_tool,
    speed_table,
    verdict,
)
from serverbench.launch.study import RUNS_CSV, csv_records
from serverbench.records.markdown import figure
from serverbench.schema.ab import shuffled
from serverbench.system.process import last_line, line_of
from sweep import experiments_from

WHEELS = ROOT / "wheels"  # the door's wheels, downloaded by tools/gpu_wheels.sh, carried to the GPU machine
# The designs as sweep.py names them: verify's three, the reference table's four
DESIGNS = {e.name: e.flags for e in experiments_from(("serial", "threaded", "pipelined"), (2,), ())}
TABLE_EXPERIMENTS = {e.name: e.flags for e in experiments_from(("serial", "threaded", "pipelined"), (2, 4), ())}
# A test marked cuda: the decorator, or a module's pytestmark.
CUDA_MARKER = re.compile(r"^\s*(@pytest\.mark\.cuda\b|pytestmark\s*=.*\bpytest\.mark\.cuda\b)", re.MULTILINE)


# ------------------------------------------------------------------------------------------ part 1


def cuda_test_modules(tests: Path = ROOT / "tests") -> list[Path]:
    """The test modules that hold cuda-marked tests: found by their marker, not listed by hand."""
    return sorted(p for p in tests.glob("test_*.py") if CUDA_MARKER.search(p.read_text(errors="replace")))


def check_cuda_tests(ctx: Context, deadline: float) -> Check:
    """`pytest -m cuda` on the modules that hold cuda-marked tests, several at once where pytest-xdist is there;
    on the GPU none may be skipped. Stopped at the deadline, it reports the tests that finished."""
    name = "cuda tests"
    if not ctx.facts.get("has", {}).get("pytest"):
        return Check(name, REFUSED, "pytest is not installed for this python")
    modules = cuda_test_modules()
    folder = ctx.work / "cuda_tests"
    folder.mkdir(parents=True, exist_ok=True)
    xml, log = folder / "junit.xml", folder / "pytest.log"
    timeout_s = deadline - time.monotonic() - ctx.plan.stop_grace_s
    has = ctx.facts.get("has", {})
    workers = ctx.plan.pytest_workers if has.get("xdist") else 1
    # Without the suite's per-file time budget: it would fail a run whose tests all passed, and write into tests'
    # results folder.
    cmd = [sys.executable, "-m", "pytest", "-m", "cuda", "-v", "-p", "no:cacheprovider", "-p", "no:suite_budget"]
    cmd += [f"--junitxml={xml}"]
    cmd += [f"--timeout={max(10, min(300, int(timeout_s)))}"] if has.get("pytest_timeout") else []
    cmd += ["-n", str(workers)] if workers > 1 else []
    cmd += [str(p.relative_to(ROOT)) for p in modules]
    returncode, stopped = run_tool(cmd, log, timeout_s, ctx.plan.stop_grace_s)
    counts = _junit_counts(xml) if xml.exists() else _log_counts(log)
    where = "cuda_tests/pytest.log"
    detail = (
        f"{counts['tests']} cuda tests in {len(modules)} modules ({', '.join(p.stem for p in modules)}): "
        f"{counts['failures']} failed, {counts['errors']} errors, {counts['skipped']} skipped"
    )
    if stopped:
        return Check(name, PARTIAL if counts["tests"] else BUDGET, detail + "; stopped by the budget", where)
    if not ctx.cuda and returncode == 0 and counts["tests"] > 0:
        return Check(name, INFO, detail + " (no GPU: skipped; on the GPU none may be)", where)
    clean = counts["failures"] == counts["errors"] == counts["skipped"] == 0
    ok = returncode in (0, 1) and counts["tests"] > 0 and clean  # 1: failures, counted above
    return Check(name, PASS if ok else FAIL, detail + ("" if ok else f"; pytest exit {returncode}"), where)


def _junit_counts(xml: Path) -> dict[str, int]:
    counts = dict.fromkeys(("tests", "failures", "errors", "skipped"), 0)
    root = ElementTree.parse(xml).getroot()
    for suite in [root] if root.tag == "testsuite" else list(root):
        for key in counts:
            counts[key] += int(suite.get(key, 0))
    return counts


def _log_counts(log: Path) -> dict[str, int]:
    """From pytest -v's lines, when it was stopped before writing its XML."""
    text = log.read_text(errors="replace") if log.exists() else ""
    found = {key: len(re.findall(rf"\b{word}\b", text)) for key, word in _LOG_WORDS.items()}
    return {"tests": sum(found.values()), **found}


_LOG_WORDS = {"passed": "PASSED", "failures": "FAILED", "errors": "ERROR", "skipped": "SKIPPED"}


def verify_specs(plan: Plan) -> list[RunSpec]:
    """--verify on every design over shm and queue (the dry run: each design over one, in turn)."""
    specs = []
    for index, (design, flags) in enumerate(DESIGNS.items()):
        transports = ("shm", "queue") if plan.verify_every_pair else (("shm", "queue")[index % 2],)
        for transport in transports:
            specs.append(
                RunSpec(f"{design}_{transport}", (*flags, "--transport", transport, "--verify"), plan.batch_size)
            )
    return specs


def check_verify(ctx: Context, deadline: float) -> Check:
    """Every response equals the serial answer within tolerance, on every design and transport."""
    results = ctx.runner.run_all(ctx.work / "verify", verify_specs(ctx.plan), deadline, timed=False, ceiling=False)
    worst = max((number(r.row, "max_abs_error") or 0.0 for r in results), default=0.0)

    def good(r: RunResult) -> bool:
        return r.status == "ok" and number(r.row, "wrong_outputs") == 0

    check = verdict("verify every design and transport", results, good, "runs gave the serial answers", "verify/")
    check.detail += f" (largest difference {worst:.3g})"
    return check


def race_specs(plan: Plan) -> list[RunSpec]:
    """The planted early-reuse bug (one input buffer for every request), on a model slow enough to show it."""
    flags = ("--model", plan.race_model, "--image_size", str(plan.race_image_size))
    flags += ("--num_iters", str(plan.race_num_iters), "--design", "pipelined")
    flags += ("--num_workers", "2", "--verify", "--inject_fault", "early_reuse")
    return [RunSpec("early_reuse", flags, plan.batch_size, repeat=r) for r in range(plan.race_repeats)]


def check_race(ctx: Context, deadline: float) -> Check:
    """--verify must catch the planted race every time."""
    results = ctx.runner.run_all(ctx.work / "race", race_specs(ctx.plan), deadline, timed=False, ceiling=False)
    caught = "repeats caught it (wrong_output)"
    return verdict("planted race caught", results, lambda r: r.status == "wrong_output", caught, "race/")


def check_bandwidth(ctx: Context, deadline: float) -> Check:
    """H2D copies from pinned and registered memory against the PCIe link NVML reports."""
    name = "H2D bandwidth"
    folder = ctx.work / "bandwidth"
    folder.mkdir(parents=True, exist_ok=True)
    device = "cuda:0" if ctx.cuda else "cpu"
    timeout_s = deadline - time.monotonic()
    found, why = run_child(
        ["h2d", "--device", device, "--mib", str(ctx.plan.bandwidth_mib)], timeout_s, folder / "h2d.log"
    )
    if found is None and why.startswith(NO_ANSWER):  # the budget's end, not the copies
        return Check(name, BUDGET, f"stopped by the budget: {why}", "bandwidth/h2d.log")
    if found is None:
        return Check(name, FAIL, f"the measurement failed: {why}", "bandwidth/h2d.log")
    (folder / "h2d.json").write_text(json.dumps(found, indent=1) + "\n")
    detail = ", ".join(f"{kind} {gb_s:.1f} GB/s" for kind, gb_s in found.items())
    if not ctx.cuda:
        return Check(name, INFO, detail + f" ({ctx.plan.bandwidth_mib} MiB, a host copy: no GPU)", "bandwidth/h2d.json")
    problems = []
    if found["registered"] < 0.8 * found["pinned"]:
        problems.append("registered memory copies at under 80 % of pinned: the ring would not be page-locked")
    bus = ctx.facts.get("pcie_gb_s")
    if bus:
        detail += (
            f"; bus {ctx.facts['facts'].get('PCIe link (max)')} = {bus:.1f} GB/s, pinned at {found['pinned'] / bus:.0%}"
        )
        if found["pinned"] < 0.5 * bus:
            problems.append(
                "pinned copies reach under half of the bus (a link trained below its maximum, or a shared slot)"
            )
    else:
        detail += "; bus figure unknown (NVML)"
    return Check(name, FAIL if problems else PASS, "; ".join([detail, *problems]), "bandwidth/h2d.json")


def overlap_specs(plan: Plan) -> list[RunSpec]:
    return [RunSpec("pipelined_2w", ("--design", "pipelined", "--num_workers", "2"), plan.batch_size)]


def check_overlap(ctx: Context, deadline: float) -> Check:
    """From a pipelined run's records: the fraction of forward time during which another request's copy ran."""
    name = "copies overlap forwards"
    (result,) = ctx.runner.run_all(ctx.work / "overlap", overlap_specs(ctx.plan), deadline, timed=True, ceiling=True)
    overlap = number(result.row, "copy_overlap")
    if result.status != "ok" or overlap is None:
        return verdict(name, [result], lambda r: False, "runs ok", "overlap/")
    detail = f"{overlap:.0%} of forward time had another request's H2D or D2H copy running"
    table = speed_table([result])
    if not ctx.cuda:
        return Check(name, INFO, detail + " (CPU stand-ins: copies are host work)", "overlap/", table)
    ok = overlap > 0
    return Check(name, PASS if ok else FAIL, detail + ("" if ok else ": the copies serialise"), "overlap/", table)


def compare_specs(plan: Plan) -> list[RunSpec]:
    """bench.compare's reference-like configuration and its fastest (pipelined, 2 workers, shm; eager: compiling
    is part 2's) at float32 and uint8 on the wire, at the plan's precision; one run each, in a shuffled order."""
    from bench.compare import FASTEST, configs

    found = configs([plan.compare_model], [plan.compare_precision], FASTEST["cuda"], {plan.compare_model: False})
    iters = ("--num_iters", str(plan.compare_num_iters))
    return [RunSpec(config.name, (*config.flags, *iters), plan.compare_batch_size) for config in shuffled(found, 0, 0)]


def check_compare(ctx: Context, deadline: float) -> Check:
    """The reference-like server against the fastest configuration, at a large batch, one run each."""
    results = ctx.runner.run_all(ctx.work / "compare", compare_specs(ctx.plan), deadline, timed=True, ceiling=True)
    check = verdict("reference-like vs fastest", results, lambda r: r.status == "ok", "runs ok", "compare/")
    check.table = speed_table(results, baseline="reference_like")
    base = next((r for r in results if r.spec.name == "reference_like" and r.status == "ok"), None)
    for r in results:
        if base is not None and r is not base and r.status == "ok":
            ratio = (number(r.row, "throughput") or 0) / (number(base.row, "throughput") or float("inf"))
            check.detail += f"; {r.spec.name} {ratio:.2f}x"
    return check


def check_gpu_util(ctx: Context, deadline: float) -> Check:
    """NVML's utilisation during serving, read from the rows of the timed runs (overlap, compare)."""
    name = "GPU utilisation while serving"
    rows = [row for folder in ("overlap", "compare") for row in csv_records(ctx.work / folder / RUNS_CSV)]
    rows = [row for row in rows if row.get("status") == "ok"]
    if not rows:
        return Check(name, NOT_RUN, "no serving run to read (overlap and compare ran none to the end)")
    samples = [(row["experiment"], number(row, "gpu_util"), number(row, "gpu_samples")) for row in rows]
    detail = ", ".join(
        f"{name_} {figure(util, missing='-')} % ({figure(count, '.0f', missing='-')} samples)"
        for name_, util, count in samples
    )
    if not ctx.cuda:
        return Check(name, INFO, "no GPU to sample: " + detail, "overlap/ compare/")
    notes = {str(row.get("gpu_util_note")) for row in rows if row.get("gpu_util_note")}
    if any(util is not None and util > 0 and (count or 0) > 0 for _, util, count in samples):
        return Check(name, PASS, detail, "overlap/ compare/")
    if notes:  # a MIG instance: NVML gives no utilisation, by design
        return Check(name, INFO, detail + "; " + "; ".join(sorted(notes)), "overlap/ compare/")
    return Check(name, FAIL, detail + ": NVML sampled no utilisation while serving", "overlap/ compare/")


# ------------------------------------------------------------------------------------------ part 2


COMPILE_CASES = {
    "pipelined_2w": ("--design", "pipelined", "--num_workers", "2"),  # a compiled copy per thread
    "serial_reduce_overhead": ("--design", "serial", "--compile_mode", "reduce-overhead"),  # CUDA graphs
}


def compile_specs(plan: Plan) -> list[RunSpec]:
    model = ("--model", plan.compile_model)
    return [RunSpec(name, (*COMPILE_CASES[name], *model), plan.batch_size, True) for name in plan.compile_cases]


def check_compile(ctx: Context, deadline: float) -> Check:
    """torch.compile served from 2 threads, and CUDA graphs (reduce-overhead) on the serial design: no error, no
    recompile while serving."""
    results = ctx.runner.run_all(ctx.work / "compile", compile_specs(ctx.plan), deadline, timed=False, ceiling=False)

    def good(r: RunResult) -> bool:
        recompiled = r.log.exists() and re.search(r"recompil", r.log.read_text(errors="replace"), re.IGNORECASE)
        if recompiled:
            r.row = {**r.row, "error": f"recompiled while serving; {r.row.get('error') or ''}"}
        return r.status == "ok" and not recompiled

    what = f"compiled runs served without a recompile ({ctx.plan.compile_model})"
    return verdict("compile across threads", results, good, what, "compile/")


def example_specs(plan: Plan, cases: Sequence[str]) -> list[RunSpec]:
    """The example encoder (examples/tiny_encoder.py: int64 ids and mask in, a dict of two tensors out), pipelined
    with 2 workers, every output leaf verified: eager, with dynamic batching, or through AOTInductor."""
    example = (
        "--model",
        "examples.tiny_encoder:make_model",
        "--model_kwargs",
        f'{{"depth": {plan.example_depth}}}',
        "--input",
        f"ids:int64:{plan.example_tokens}:0-999",
        "--input",
        f"mask:int64:{plan.example_tokens}:1-1",
        "--verify",
        *("--design", "pipelined", "--num_workers", "2"),
    )
    extra = {"eager": (), "batching": ("--max_batch_size", str(4 * plan.batch_size)), "aoti": ("--aoti",)}
    return [RunSpec(f"pipelined_2w_{case}", (*example, *extra[case]), plan.batch_size) for case in cases]


def _example_check(ctx: Context, deadline: float, name: str, cases: Sequence[str], path: str) -> Check:
    specs = example_specs(ctx.plan, cases)
    results = ctx.runner.run_all(ctx.work / "your_model", specs, deadline, timed=False, ceiling=False)

    def good(r: RunResult) -> bool:
        return r.status == "ok" and number(r.row, "wrong_outputs") == 0 and r.row.get("compile_path") == path

    return verdict(name, results, good, f"runs answered right, every leaf (compile_path {path})", "your_model/")


def check_your_model(ctx: Context, deadline: float) -> Check:
    """The example model served eager, and with dynamic batching."""
    return _example_check(ctx, deadline, "your model: several inputs, dict outputs", ctx.plan.example_cases, "eager")


def check_aoti(ctx: Context, deadline: float) -> Check:
    """The example model through AOTInductor: compiled once, a runner per request held, on each thread's stream."""
    return _example_check(ctx, deadline, "your model through AOTInductor", ("aoti",), "aoti")


def instances_specs(plan: Plan) -> list[RunSpec]:
    flags = ("--instances", "2", "--design", "pipelined", "--num_workers", "2", "--verify")
    return [RunSpec("pipelined_2w_2inst", flags, plan.batch_size)]


def check_instances(ctx: Context, deadline: float) -> Check:
    """Two backend processes, each with its own model (and CUDA context), reading one transport."""
    specs = instances_specs(ctx.plan)
    results = ctx.runner.run_all(ctx.work / "instances", specs, deadline, timed=False, ceiling=False)

    def good(r: RunResult) -> bool:
        shares = [int(n) for n in str(r.row.get("requests_per_instance") or "").split(";") if n.strip().isdigit()]
        return r.status == "ok" and number(r.row, "wrong_outputs") == 0 and len(shares) == 2

    check = verdict("two instances", results, good, "runs ok, two instances reported, every answer right", "instances/")
    shares = [f" (requests per instance {r.row.get('requests_per_instance')})" for r in results if not r.cut]
    check.detail += "".join(shares)
    return check


DOOR_TIMEOUT = "pip install from wheels/ ran out of the check's time"


def door_environment(ctx: Context, deadline: float) -> tuple[dict[str, str] | None, str]:
    """The door's packages for the server runs: already importable here; else installed from the carried wheels/
    into a folder of the run, put on PYTHONPATH (pip without the network, or the wheels unzipped where pip is
    absent); else none. (environment to add, how; None and why when they cannot be had here)."""
    missing = ctx.facts.get("door_missing", [])
    if not missing:
        return {}, "the door's packages are importable here"
    lacking = f"missing: {', '.join(missing)}"
    if not WHEELS.is_dir() or not list(WHEELS.glob("*.whl")):
        return None, f"wheels not carried ({lacking}; tools/gpu_wheels.sh makes wheels/)"
    target = ctx.work / "door_site"
    # Only what this python lacks: a carried wheel must not shadow a package the machine has (typing_extensions).
    wheels = [wheel for wheel in sorted(WHEELS.glob("*.whl")) if not installed(wheel.name.split("-")[0])]
    if not wheels:  # every carried wheel's package is installed, yet the door's do not import
        how = "no carried wheel is of a package this python lacks"
    elif ctx.facts.get("has", {}).get("pip"):
        cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--target", str(target)]
        timeout_s = max(1.0, deadline - time.monotonic())
        try:
            proc = subprocess.run(
                [*cmd, *map(str, wheels)], cwd=ROOT, capture_output=True, text=True, timeout=timeout_s
            )
        except subprocess.TimeoutExpired:
            return None, f"{DOOR_TIMEOUT} ({timeout_s:.0f} s; {lacking})"
        if proc.returncode != 0:
            tail = last_line(proc.stderr) or "no output"
            return None, f"pip install from wheels/ failed ({lacking}): {line_of(tail, limit=200)}"
        how = f"{len(wheels)} wheels installed with pip --no-index into the run's folder"
    else:  # a wheel is a zip of what goes into site-packages
        for wheel in wheels:
            with zipfile.ZipFile(wheel) as archive:
                archive.extractall(target)
        how = f"pip is absent: {len(wheels)} wheels unzipped into the run's folder"
    env = {"PYTHONPATH": os.pathsep.join([str(target), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    probe_cmd = [sys.executable, "-c", "import " + ", ".join(missing)]
    proc = subprocess.run(probe_cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, **env}, timeout=60)
    if proc.returncode != 0:
        tail = last_line(proc.stderr) or "no output"
        return None, f"{how}, and still unimportable ({lacking}): {line_of(tail, limit=200)}"
    return env, how


def installed(distribution: str) -> bool:
    try:
        importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def door_specs(plan: Plan) -> list[RunSpec]:
    """shm, then the HTTP door, at each batch size."""
    flags = ("--num_iters", str(plan.door_num_iters), "--design", "pipelined", "--num_workers", "2")
    specs = []
    for batch in plan.door_batch_sizes:
        specs.append(RunSpec(f"shm_bs{batch}", (*flags, "--transport", "shm"), batch))
        specs.append(RunSpec(f"http_bs{batch}", (*flags, "--transport", "http", "--port", "0"), batch))
    return specs


def check_door(ctx: Context, deadline: float) -> Check:
    """The HTTP door (Open Inference Protocol) beside the shm transport, at batch 1 and at the plan's batch."""
    name = "HTTP door beside shm"
    env, how = door_environment(ctx, deadline)
    if env is None:  # the machine lacks the door's packages and they cannot be had: refused, as the probe refuses
        return Check(name, BUDGET if how.startswith(DOOR_TIMEOUT) else REFUSED, how)
    results = ctx.runner.run_all(ctx.work / "door", door_specs(ctx.plan), deadline, timed=True, ceiling=True, env=env)
    check = verdict(name, results, lambda r: r.status == "ok", "runs ok", "door/")
    check.detail += f"; {how}"
    check.table = speed_table(results)
    return check


def table_specs(plan: Plan) -> list[RunSpec]:
    """The experiments at each batch size, one repeat, each batch size's runs in a shuffled order (the smaller
    batch first: a table cut by the budget keeps whole rows)."""
    specs = []
    for batch in plan.table_batch_sizes:
        iters = ("--num_iters", str(plan.table_num_iters))
        group = [RunSpec(name, (*TABLE_EXPERIMENTS[name], *iters), batch) for name in plan.table_experiments]
        specs += shuffled(group, batch)
    return specs


def check_table(ctx: Context, deadline: float) -> Check:
    """The reference's table, short."""
    results = ctx.runner.run_all(ctx.work / "table", table_specs(ctx.plan), deadline, timed=True, ceiling=True)
    check = verdict("reference table", results, lambda r: r.status == "ok", "runs ok", "table/")
    order = list(TABLE_EXPERIMENTS)
    check.table = speed_table(sorted(results, key=lambda r: (r.spec.batch_size, order.index(r.spec.name))))
    return check


# ------------------------------------------------------------------------------------------ the plan


def full_flags(plan: Plan, spec: RunSpec, ceiling: bool) -> list[str]:
    """server.py's flags of a run as the runner gives them (but where its row goes, and the budget's limits)."""
    return [*plan.server_flags(ceiling), *spec.cell().server_args([], None)]


@dataclass(frozen=True)
class CheckSpec:
    """A check of a part: its function, whether it is timed (runs alone, with the model's ceiling), the least time
    (s on a GPU) worth starting it with, the most it may take, its server runs (for the refusals and the flags'
    check), what else refuses it on this machine, and whether it waits for every check before it."""

    name: str
    part: int
    run: Callable[[Context, float], Check]
    timed: bool
    min_s: float
    cap_s: float
    specs: Callable[[Plan], list[RunSpec]] | None = None
    refusal: Callable[[Context], str | None] | None = None
    after_all: bool = False  # starts once every check before it has ended (it reads their runs)

    def server_commands(self, plan: Plan) -> list[list[str]]:
        return [full_flags(plan, spec, self.timed) for spec in (self.specs(plan) if self.specs else [])]

    def refused(self, ctx: Context) -> str | None:
        """Why this machine cannot run it (its own refusal, then /dev/shm for its server runs), or None."""
        return (self.refusal(ctx) if self.refusal else None) or shm_refusal(ctx.facts, self.server_commands(ctx.plan))


def _exclusive(what: str) -> Callable[[Context], str | None]:
    def refusal(ctx: Context) -> str | None:
        if ctx.facts.get("compute_mode") == EXCLUSIVE_PROCESS:
            return f"the GPU is in exclusive-process compute mode: {what}"
        return None

    return refusal


def _bandwidth_refusal(ctx: Context) -> str | None:
    free = ctx.facts.get("shm_free_bytes")
    need = ctx.plan.bandwidth_mib * 2**20
    if ctx.cuda and free is not None and need > free:
        return (
            f"needs {ctx.plan.bandwidth_mib} MiB of /dev/shm (registered as the ring is) and it has "
            f"{free / 2**20:.0f} MiB free"
        )
    return None


def _compile_refusal(ctx: Context) -> str | None:
    return compile_refusal(ctx.facts)


def _aoti_refusal(ctx: Context) -> str | None:
    return aoti_refusal(ctx.facts, ctx.cuda)


def _your_model_specs(plan: Plan) -> list[RunSpec]:
    return example_specs(plan, plan.example_cases)


def _aoti_specs(plan: Plan) -> list[RunSpec]:
    return example_specs(plan, ("aoti",))


_CUDA_TESTS_EXCLUSIVE = "pytest holds a CUDA context while its tests start servers that need their own"
_INSTANCES_EXCLUSIVE = "two backends need a CUDA context each"
# In the order of their value: what a later check or every number depends on first. (name, part, function,
# timed, least seconds worth starting with on a GPU, cap in seconds, server runs, refusal)
CHECKS = (
    CheckSpec("cuda_tests", 1, check_cuda_tests, False, 60, 150, refusal=_exclusive(_CUDA_TESTS_EXCLUSIVE)),
    CheckSpec("verify", 1, check_verify, False, 40, 150, verify_specs),
    CheckSpec("race", 1, check_race, False, 30, 90, race_specs),
    CheckSpec("bandwidth", 1, check_bandwidth, True, 15, 60, refusal=_bandwidth_refusal),
    CheckSpec("overlap", 1, check_overlap, True, 25, 60, overlap_specs),
    CheckSpec("compare", 1, check_compare, True, 60, 150, compare_specs),
    CheckSpec("gpu_util", 1, check_gpu_util, True, 0, 10, after_all=True),
    CheckSpec("compile", 2, check_compile, False, 60, 180, compile_specs, _compile_refusal),
    CheckSpec("aoti", 2, check_aoti, False, 60, 180, _aoti_specs, _aoti_refusal),
    CheckSpec("your_model", 2, check_your_model, False, 30, 120, _your_model_specs),
    CheckSpec("instances", 2, check_instances, False, 30, 90, instances_specs, _exclusive(_INSTANCES_EXCLUSIVE)),
    CheckSpec("door", 2, check_door, True, 40, 120, door_specs),
    CheckSpec("table", 2, check_table, True, 40, 300, table_specs),
)
CHECK_NAMES = tuple(spec.name for spec in CHECKS)
