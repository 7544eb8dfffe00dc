"""The checks of bench.gpu_check, one function each: what it runs, and its verdict as a Check (pass, FAIL, info or
not run). The plan (GPU or --dry_run sizes) and the summary are in bench/gpu_check.py."""

import json
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

from bench.launch import server_command
from serverbench.system.process import one_line
from sweep import RUNS_CSV, Cell, Experiment, run_cell

ROOT = Path(__file__).resolve().parent.parent

PASS, FAIL, INFO, NOT_RUN = "pass", "FAIL", "info", "not run"
# Usable bandwidth of one PCIe lane by generation, GB/s, after line encoding.
PCIE_LANE_GB_S = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}
DESIGNS = (("serial", ()), ("threaded", ()), ("pipelined", ("--num_workers", "2")))


@dataclass(frozen=True)
class Plan:
    """The sizes of every check: a GPU's, or tiny ones on the CPU for --dry_run."""

    device: str
    model: str  # the verify, overlap, CPU-load and sweep runs
    image_size: int
    batch_size: int
    num_iters: int
    race_model: str
    race_repeats: int
    race_num_iters: int
    compile_model: str
    compare_batch_size: int
    compare_models: tuple[str, ...]
    compare_precisions: tuple[str, ...]
    compare_num_iters: tuple[str, ...]  # MODEL=N for bench.compare
    compare_repeats: int
    sweep_batch_sizes: tuple[int, ...]
    sweep_designs: tuple[str, ...]
    sweep_workers: tuple[int, ...]
    sweep_repeats: int
    sweep_num_iters: int
    bandwidth_mib: int
    cell_timeout_s: float
    jobs: int  # server runs at once in the checks of correctness (verify, race, compile); timed ones run alone
    ceiling_s: float  # --ceiling_s of every run: the model alone, at each concurrency, before and after serving
    verify_transports: tuple[str, ...] = ("shm", "queue")  # the dry run keeps one: test_verify covers queue
    verify_wires: tuple[str, ...] = ("float32", "uint8")  # the dry run keeps one: test_verify covers float32
    verify_every_design: bool = True  # every path on every design; the dry run: each path on one design
    example_tokens: int = 64  # the your_model check's sequences (the dry run: shorter, one layer: a faster compile)
    example_depth: int = 2

    def server_flags(self) -> list[str]:
        return [
            "--device",
            self.device,
            "--model",
            self.model,
            "--image_size",
            str(self.image_size),
            "--num_iters",
            str(self.num_iters),
            "--ceiling_s",
            str(self.ceiling_s),
        ]


@dataclass
class Check:
    name: str
    status: str  # pass, FAIL, info (measured, no verdict on this device), not run
    detail: str  # one line: what was measured, or why it failed
    where: str = ""  # the rows, logs or files behind it, relative to --out


class Runs:
    """server.py runs of this check, as sweep cells: one row each in <out>/<folder>/runs.csv, logs beside it."""

    def __init__(self, out: Path, folder: str, plan: Plan) -> None:
        self.dir = out / folder
        self.dir.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self.plan = plan

    def run(self, name: str, flags: Sequence[str], repeat: int = 0, compile: bool = False) -> dict:
        """One run; its row (status 'crashed' or 'sweep_timeout' when it wrote none)."""
        return self.run_all([(name, flags, repeat)], compile=compile)[0]

    def run_all(
        self, specs: Sequence[tuple[str, Sequence[str], int]], compile: bool = False, jobs: int = 1
    ) -> list[dict]:
        """Runs (name, flags, repeat) each, `jobs` at a time; their rows, in the order given."""
        import report

        cells = [
            Cell(Experiment(name, tuple(flags)), self.plan.batch_size, compile, repeat) for name, flags, repeat in specs
        ]

        def run_one(cell: Cell) -> None:
            status = run_cell(cell, self.dir, self.plan.server_flags(), self.plan.cell_timeout_s, sys.executable)
            print(f"  {cell.label()}: {status}", flush=True)

        with ThreadPoolExecutor(max_workers=jobs) as pool:
            list(pool.map(run_one, cells))
        runs = report.load_runs(self.dir / RUNS_CSV)
        rows = []
        for name, _flags, repeat in specs:
            match = runs[(runs["experiment"] == name) & (runs["repeat"] == repeat)]
            rows.append(match.iloc[-1].to_dict())
        return rows

    def log(self, name: str, compile: bool = False, repeat: int = 0) -> Path:
        return Cell(Experiment(name, ()), self.plan.batch_size, compile, repeat).log_path(self.dir)


def _number(row: dict, column: str) -> float | None:
    value = row.get(column)
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return None if number != number else number


def _problem(row: dict) -> str:
    return f"{row['experiment']}: {row.get('status')} {str(row.get('error') or '')[:160]}".strip()


# ------------------------------------------------------------------------------------------ the environment


def check_cuda_tests(out: Path, plan: Plan, cuda: bool) -> Check:
    if not cuda:
        return Check("cuda tests", NOT_RUN, "needs a GPU")
    xml = out / "cuda_tests.xml"
    log = out / "cuda_tests.log"
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-m",
        "cuda",
        "-q",
        "-p",
        "no:cacheprovider",
        f"--junitxml={xml}",
        str(ROOT / "tests"),
    ]
    with open(log, "w") as f:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=3600)
    if not xml.exists():
        tail = log.read_text().strip().splitlines()[-1:] or ["no output"]
        return Check("cuda tests", FAIL, f"pytest did not run (exit {proc.returncode}): {tail[0][:200]}", log.name)
    counts = {key: 0 for key in ("tests", "failures", "errors", "skipped")}
    root = ElementTree.parse(xml).getroot()
    for suite in [root] if root.tag == "testsuite" else list(root):
        for key in counts:
            counts[key] += int(suite.get(key, 0))
    ok = proc.returncode == 0 and counts["tests"] > 0 and counts["skipped"] == 0
    detail = (
        f"{counts['tests']} cuda tests: {counts['failures']} failed, {counts['errors']} errors, "
        f"{counts['skipped']} skipped"
    )
    return Check("cuda tests", PASS if ok else FAIL, detail, log.name)


def check_verify(out: Path, plan: Plan) -> Check:
    """Every design x transport x wire dtype, and bf16 and dynamic batching on each design, answer as the serial
    reference."""
    specs = []
    batching = ["--max_batch_size", str(4 * plan.batch_size), "--max_queue_delay_ms", "2"]
    for index, (design, extra) in enumerate(DESIGNS):
        design_specs = []
        for transport in plan.verify_transports:
            for wire in plan.verify_wires:
                flags = ["--design", design, *extra, "--transport", transport, "--wire_dtype", wire, "--verify"]
                design_specs.append((f"{design}_{transport}_{wire}", flags, 0))
        design_specs.append(
            (
                f"{design}_shm_uint8_bf16",
                ["--design", design, *extra, "--wire_dtype", "uint8", "--precision", "bf16", "--verify"],
                0,
            )
        )
        # Dynamic batching: each request's rows of a formed batch, gathered on the device and split back.
        design_specs.append(
            (
                f"{design}_shm_uint8_batched",
                ["--design", design, *extra, "--wire_dtype", "uint8", *batching, "--verify"],
                0,
            )
        )
        # The dry run goes through each path once, on one design each (test_verify covers the rest on the CPU).
        specs += design_specs if plan.verify_every_design else design_specs[index % len(design_specs) :][:1]
    rows = Runs(out, "verify", plan).run_all(specs, jobs=plan.jobs)
    bad = [row for row in rows if row.get("status") != "ok" or _number(row, "wrong_outputs") != 0]
    worst = max((_number(r, "max_abs_error") or 0.0 for r in rows), default=0.0)
    detail = f"{len(rows) - len(bad)}/{len(rows)} runs gave the serial answers (largest difference {worst:.3g})"
    if bad:
        detail += "; " + "; ".join(_problem(r) for r in bad[:3])
    return Check("verify every data path", FAIL if bad else PASS, detail, "verify/runs.csv")


def check_race(out: Path, plan: Plan) -> Check:
    """The planted early-reuse bug (one input buffer for every request) must be caught by --verify every time."""
    runs = Runs(out, "race", replace(plan, model=plan.race_model, num_iters=plan.race_num_iters))
    flags = ["--design", "pipelined", "--num_workers", "2", "--verify", "--inject_fault", "early_reuse"]
    rows = runs.run_all([("early_reuse", flags, r) for r in range(plan.race_repeats)], jobs=plan.jobs)
    caught = [r for r in rows if r.get("status") == "wrong_output"]
    detail = f"caught in {len(caught)} of {len(rows)} repeats"
    missed = [r for r in rows if r.get("status") != "wrong_output"]
    if missed:
        detail += "; not caught: " + "; ".join(_problem(r) for r in missed[:3])
    return Check("planted race caught", PASS if not missed else FAIL, detail, "race/runs.csv")


def measure_h2d(device: str, nbytes: int, iters: int = 10) -> dict[str, float]:
    """GB/s of host-to-device copies of `nbytes` from pageable memory, pinned memory (cudaHostAlloc) and memory
    registered in place (cudaHostRegister, as the ring is), timed with CUDA events."""
    import torch

    from serverbench.device.layer import make_device_layer

    layer = make_device_layer(device)
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    try:  # shared memory, as the ring is: /dev/shm must hold it (Docker's default is 64 MiB)
        registered = torch.ones(nbytes, dtype=torch.uint8).share_memory_()
    except RuntimeError as exc:
        raise RuntimeError(
            f"cannot place {nbytes / 2**20:.0f} MiB in /dev/shm, as the ring needs: "
            f"{one_line(exc, limit=200)}; enlarge it (docker run --shm-size=2g)"
        ) from None
    sources = {
        "pageable": torch.ones(nbytes, dtype=torch.uint8),
        "pinned": torch.ones(nbytes, dtype=torch.uint8).pin_memory(),
        "registered": registered,
    }
    layer.register_host(sources["registered"])
    found = {}
    try:
        for name, source in sources.items():
            target.copy_(source, non_blocking=True)  # warm: first-touch, driver staging buffers
            layer.synchronize()
            start, end = layer.new_event(), layer.new_event(host_waits=True)
            start.record()
            for _ in range(iters):
                target.copy_(source, non_blocking=True)
            end.record()
            end.synchronize()
            found[name] = nbytes * iters / (start.elapsed_time(end) / 1e3) / 1e9
    finally:
        layer.synchronize()
        layer.unregister_host(sources["registered"])
        del target, sources, registered
        torch.cuda.empty_cache()  # the timed runs after this one start with the device's memory as they found it
    return found


def check_bandwidth(out: Path, plan: Plan, cuda: bool, facts: dict[str, str]) -> Check:
    if not cuda:
        return Check("H2D bandwidth", NOT_RUN, "needs a GPU")
    found = measure_h2d("cuda:0", plan.bandwidth_mib * 2**20)
    (out / "h2d_bandwidth.json").write_text(json.dumps(found, indent=1) + "\n")
    bus = float(facts["PCIe GB/s (one direction)"]) if "PCIe GB/s (one direction)" in facts else None
    detail = ", ".join(f"{name} {gb_s:.1f} GB/s" for name, gb_s in found.items())
    problems = []
    if found["registered"] < 0.8 * found["pinned"]:
        problems.append("registered memory copies at under 80 % of pinned: the ring would not be page-locked")
    if bus is not None:
        detail += f"; bus {facts['PCIe link (max)']} = {bus:.1f} GB/s, pinned at {found['pinned'] / bus:.0%}"
        if found["pinned"] < 0.5 * bus:
            problems.append(
                "pinned copies reach under half of the bus (a slower link than NVML reports, or a "
                "GPU in a slot it shares)"
            )
    else:
        detail += "; bus figure unknown (NVML)"
    return Check(
        "H2D bandwidth",
        FAIL if problems else PASS,
        detail + ("; " + "; ".join(problems) if problems else ""),
        "h2d_bandwidth.json",
    )


def check_overlap(out: Path, plan: Plan, cuda: bool) -> Check:
    """From a pipelined run's records: the fraction of forward time during which another request's copy ran."""
    row = Runs(out, "overlap", plan).run("pipelined_2w", ["--design", "pipelined", "--num_workers", "2"])
    overlap = _number(row, "copy_overlap")
    if row.get("status") != "ok" or overlap is None:
        return Check("copies overlap forwards", FAIL, _problem(row), "overlap/runs.csv")
    detail = f"{overlap:.0%} of forward time had another request's H2D or D2H copy running"
    if not cuda:
        return Check(
            "copies overlap forwards", INFO, detail + " (CPU stand-ins: copies are host work)", "overlap/runs.csv"
        )
    return Check(
        "copies overlap forwards",
        PASS if overlap > 0 else FAIL,
        detail + ("" if overlap > 0 else ": the copies serialise with the forwards"),
        "overlap/runs.csv",
    )


def check_compile(out: Path, plan: Plan) -> Check:
    """torch.compile served from 2 and 4 threads, and CUDA graphs (reduce-overhead) on the serial design."""
    runs = Runs(out, "compile", plan)
    model = ["--model", plan.compile_model]
    cases = {
        "pipelined_2w": ["--design", "pipelined", "--num_workers", "2", *model],
        "pipelined_4w": ["--design", "pipelined", "--num_workers", "4", *model],
        "serial_reduce_overhead": ["--design", "serial", "--compile_mode", "reduce-overhead", *model],
    }
    problems = []
    rows = runs.run_all([(name, flags, 0) for name, flags in cases.items()], compile=True, jobs=plan.jobs)
    for name, row in zip(cases, rows):
        log = runs.log(name, compile=True)
        recompiled = log.exists() and re.search(r"recompil", log.read_text(errors="replace"), re.IGNORECASE)
        if row.get("status") != "ok" or recompiled:
            problems.append(_problem(row) + (" (recompiled while serving)" if recompiled else ""))
    detail = (
        f"{len(cases) - len(problems)}/{len(cases)} compiled runs served without a recompile ({plan.compile_model})"
    )
    return Check(
        "compile across threads",
        FAIL if problems else PASS,
        detail + ("; " + "; ".join(problems) if problems else ""),
        "compile/runs.csv",
    )


def example_model(tokens: int, depth: int) -> tuple[str, ...]:
    """The example encoder's flags: `tokens` per sequence, `depth` layers, every output leaf verified."""
    return (
        "--model",
        "examples.tiny_encoder:make_model",
        "--model_kwargs",
        f'{{"depth": {depth}}}',
        "--input",
        f"ids:int64:{tokens}:0-999",
        "--input",
        f"mask:int64:{tokens}:1-1",
        "--verify",
    )


def check_your_model(out: Path, plan: Plan) -> Check:
    """The example model (token ids and a mask in, a dict of two tensors out) served eager on every design, with
    dynamic batching, and through AOTInductor (--aoti: a runner per request held, on the calling thread's stream),
    every output leaf verified against the serial answer."""
    runs = Runs(out, "your_model", plan)
    pipelined = ("--design", "pipelined", "--num_workers", "2")
    example = example_model(plan.example_tokens, plan.example_depth)
    cases = {
        "serial_eager": ["--design", "serial", *example],
        "pipelined_2w_eager": [*pipelined, *example],
        "pipelined_2w_batching": [*pipelined, *example, "--max_batch_size", str(4 * plan.batch_size)],
        "serial_aoti": ["--design", "serial", *example, "--aoti"],
        "pipelined_2w_aoti": [*pipelined, *example, "--aoti"],
    }
    rows = runs.run_all([(name, flags, 0) for name, flags in cases.items()], jobs=plan.jobs)
    problems = []
    for name, row in zip(cases, rows):
        wrong = _number(row, "wrong_outputs")
        expected_path = "aoti" if name.endswith("aoti") else "eager"
        if row.get("status") != "ok" or wrong != 0 or row.get("compile_path") != expected_path:
            problems.append(_problem(row) + f" (wrong outputs {wrong}, compile_path {row.get('compile_path')})")
    detail = f"{len(cases) - len(problems)}/{len(cases)} runs of the example model answered right (eager and AOTI)"
    return Check(
        "your model: several inputs, dict outputs, AOTI",
        FAIL if problems else PASS,
        detail + ("; " + "; ".join(problems) if problems else ""),
        "your_model/runs.csv",
    )


def check_cpu_load(out: Path, plan: Plan, cuda: bool) -> Check:
    """CPU cores the backend keeps busy while serving, with blocking-sync events and with --spin_wait."""
    runs = Runs(out, "cpu_load", plan)
    flags = ["--design", "pipelined", "--num_workers", "2"]
    blocking = runs.run("blocking_wait", flags)
    spinning = runs.run("spin_wait", [*flags, "--spin_wait"])
    cores = _number(blocking, "backend_cpu_cores"), _number(spinning, "backend_cpu_cores")
    if None in cores:
        return Check(
            "backend CPU load", FAIL, "; ".join(_problem(r) for r in (blocking, spinning)), "cpu_load/runs.csv"
        )
    detail = f"backend busy {cores[0]:.2f} cores with blocking waits, {cores[1]:.2f} with --spin_wait"
    if not cuda:
        return Check("backend CPU load", INFO, detail + " (no spinning on the CPU)", "cpu_load/runs.csv")
    return Check(
        "backend CPU load",
        PASS if cores[0] < cores[1] else FAIL,
        detail + ("" if cores[0] < cores[1] else ": blocking sync saved nothing"),
        "cpu_load/runs.csv",
    )


NSYS_REPORT = "nvtx/profile"  # under --out: nsys adds .nsys-rep


def check_nvtx(out: Path, plan: Plan, cuda: bool) -> Check:
    """One --nvtx run; and, where nsys is on PATH (on a GPU), the same run under `nsys profile`, whose NVTX summary
    must name the steps' ranges."""
    flags = ["--design", "pipelined", "--num_workers", "2", "--nvtx"]
    row = Runs(out, "nvtx", plan).run("pipelined_2w_nvtx", flags)
    if row.get("status") != "ok":
        return Check("nvtx ranges", FAIL, _problem(row), "nvtx/runs.csv")
    nsys = shutil.which("nsys")
    if not cuda or nsys is None:
        why = "the CPU's ranges are no-ops" if not cuda else "nsys is not on PATH"
        return Check("nvtx ranges", INFO, f"the --nvtx run served every request; no nsys profile ({why})", "nvtx")
    report = out / NSYS_REPORT
    server_flags = [*plan.server_flags(), *flags, "--batch_size", str(plan.batch_size)]
    server = server_command(server_flags, out / "nvtx", "nsys_runs.csv")
    profile = [nsys, "profile", "--trace=cuda,nvtx,osrt", "--force-overwrite=true", "-o", str(report), *server]
    code, log = _run_tool(out, "nvtx_nsys_profile", profile)
    rep = report.with_suffix(".nsys-rep")
    if code != 0 or not rep.exists():
        return Check("nvtx ranges", FAIL, f"nsys profile exited {code}; see the log", log.name)
    code, stats_log = _run_tool(out, "nvtx_nsys_stats", [nsys, "stats", "--report", "nvtx_sum", str(rep)])
    named = [
        step for step in ("h2d #", "forward #", "d2h #", "respond #") if step in stats_log.read_text(errors="replace")
    ]
    detail = f"nsys profile: {rep.relative_to(out)}; NVTX summary names {len(named)}/4 steps ({', '.join(named)})"
    return Check("nvtx ranges", PASS if code == 0 and len(named) == 4 else FAIL, detail, stats_log.name)


def _run_tool(out: Path, name: str, cmd: list[str]) -> tuple[int, Path]:
    log = out / f"{name}.log"
    print(f"  {' '.join(cmd[1:])} ...", end=" ", flush=True)
    with open(log, "w") as f:
        returncode = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT).returncode
    print(f"exit {returncode}", flush=True)
    return returncode, log


def check_compare(out: Path, plan: Plan) -> Check:
    """bench.compare (at fp32 and bf16 on a GPU), and its plots."""
    import report

    folder = out / "compare"
    returncode, log = _run_tool(
        out,
        "compare",
        [
            sys.executable,
            "-m",
            "bench.compare",
            "--batch_size",
            str(plan.compare_batch_size),
            "--precisions",
            *plan.compare_precisions,
            "--models",
            *plan.compare_models,
            "--num_iters",
            *plan.compare_num_iters,
            "--repeats",
            str(plan.compare_repeats),
            "--device",
            plan.device,
            "--out",
            str(folder),
            "--",
            "--image_size",
            str(plan.image_size),
            "--ceiling_s",
            str(plan.ceiling_s),
        ],
    )
    if not (folder / RUNS_CSV).exists():
        return Check("performance comparison", FAIL, f"bench.compare wrote no rows (exit {returncode})", log.name)
    baseline = f"{plan.compare_models[0]}.reference_like"
    report.write_report(folder / RUNS_CSV, folder, out / "plots" / "compare", baseline)
    runs = report.load_runs(folder / RUNS_CSV)
    ok = int((runs["status"] == "ok").sum())
    detail = f"{ok}/{len(runs)} runs ok; table in compare/compare.md, plots in plots/compare"
    return Check("performance comparison", PASS if returncode == 0 else FAIL, detail, "compare/compare.md")


def check_sweep(out: Path, plan: Plan) -> Check:
    """A short version of the reference's sweep table: every design, a few batch sizes, compile off."""
    import report

    folder = out / "sweep"
    returncode, log = _run_tool(
        out,
        "sweep",
        [
            sys.executable,
            str(ROOT / "sweep.py"),
            "--out",
            str(folder),
            "--plots_dir",
            str(out / "plots" / "sweep"),
            "--batch_sizes",
            *map(str, plan.sweep_batch_sizes),
            "--compile",
            "false",
            "--designs",
            *plan.sweep_designs,
            "--workers",
            *map(str, plan.sweep_workers),
            "--repeats",
            str(plan.sweep_repeats),
            "--",
            "--device",
            plan.device,
            "--model",
            plan.model,
            "--image_size",
            str(plan.image_size),
            "--num_iters",
            str(plan.sweep_num_iters),
            "--ceiling_s",
            str(plan.ceiling_s),
        ],
    )
    if not (folder / RUNS_CSV).exists():
        return Check("reference sweep", FAIL, f"sweep.py wrote no rows (exit {returncode})", log.name)
    runs = report.load_runs(folder / RUNS_CSV)
    ok = int((runs["status"] == "ok").sum())
    detail = f"{ok}/{len(runs)} runs ok; tables in sweep/summary.md, plots in plots/sweep"
    return Check("reference sweep", PASS if returncode == 0 and ok == len(runs) else FAIL, detail, "sweep/summary.md")


# ------------------------------------------------------------------------------------------ the run


def plan_of_checks(out: Path, plan: Plan, cuda: bool, facts: dict[str, str]) -> dict[str, Callable[[], Check]]:
    return {
        "cuda_tests": lambda: check_cuda_tests(out, plan, cuda),
        "verify": lambda: check_verify(out, plan),
        "race": lambda: check_race(out, plan),
        "bandwidth": lambda: check_bandwidth(out, plan, cuda, facts),
        "overlap": lambda: check_overlap(out, plan, cuda),
        "compile": lambda: check_compile(out, plan),
        "your_model": lambda: check_your_model(out, plan),
        "cpu_load": lambda: check_cpu_load(out, plan, cuda),
        "nvtx": lambda: check_nvtx(out, plan, cuda),
        "compare": lambda: check_compare(out, plan),
        "sweep": lambda: check_sweep(out, plan),
    }


CHECK_NAMES = (
    "cuda_tests",
    "verify",
    "race",
    "bandwidth",
    "overlap",
    "compile",
    "your_model",
    "cpu_load",
    "nvtx",
    "compare",
    "sweep",
)
