"""Everything a first run on a GPU machine must check, in one command, each check with a clear pass or fail.

    ./venv.sh python -m bench.gpu_check --out results/gpu_h200
    python3 -m bench.gpu_check --out results/gpu_h200       # where torch is preinstalled and nothing installs
    python -m bench.gpu_check --dry_run --out /tmp/gpu_dry  # the same plan on the CPU, tiny sizes

Checks, in order: the environment; the cuda-marked tests (none skipped); --verify on every design x transport x wire
dtype, and bf16; the planted early_reuse race caught on every repeat; H2D bandwidth from pageable, pinned and
registered memory against the bus; whether copies overlap forwards; --compile with 2 and 4 workers and serial
reduce-overhead; the example model (several inputs, dict outputs) eager, with dynamic batching and through
AOTInductor, every leaf verified; the host CPU load of the backend with blocking and spinning waits; one --nvtx run
and, where nsys is on PATH, an `nsys profile` of it whose NVTX summary must name the steps; the performance
comparison and a short version of the reference's sweep, with their plots. Every server run is a row under --out; the
results go to --out/summary.md and --out/checks.json. `--only NAME...` runs some checks and merges them into what
--out holds.
Without a usable GPU (and without --dry_run) it exits 2 at once with one line.
"""

from __future__ import annotations

import json
import os
import platform
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from bench.gpu_checks import CHECK_NAMES, FAIL, PCIE_LANE_GB_S, ROOT, Check, Plan, plan_of_checks
from serverbench.config.flags import ConfigError, OneLineErrorParser
from serverbench.config.paths import check_output_folder

GPU_PLAN = Plan(
    device="cuda",
    model="resnet18",
    image_size=224,
    batch_size=32,
    num_iters=100,
    race_model="resnet18",
    race_repeats=5,
    race_num_iters=50,
    compile_model="resnet18",
    compare_batch_size=256,
    compare_models=("identity", "resnet18"),
    compare_precisions=("fp32", "bf16"),
    compare_num_iters=("identity=200", "resnet18=100"),
    compare_repeats=3,
    sweep_batch_sizes=(1, 32, 256),
    sweep_designs=("serial", "threaded", "pipelined"),
    sweep_workers=(2, 4),
    sweep_repeats=3,
    sweep_num_iters=50,
    bandwidth_mib=256,
    cell_timeout_s=900.0,
    jobs=1,
    ceiling_s=1.0,
)
# The same checks on the CPU, as small as they go: the identity model wherever the run only has to go through,
# resnet18 where its slow forward is what lets the planted race show.
DRY_PLAN = Plan(
    device="cpu",
    model="identity",
    image_size=32,
    batch_size=2,
    num_iters=6,
    race_model="resnet18",
    race_repeats=1,
    race_num_iters=20,
    compile_model="identity",
    compare_batch_size=2,
    compare_models=("identity",),
    compare_precisions=("fp32",),
    compare_num_iters=("identity=6",),
    compare_repeats=1,
    sweep_batch_sizes=(2,),
    sweep_designs=("serial", "pipelined"),
    sweep_workers=(2,),
    sweep_repeats=1,
    sweep_num_iters=4,
    bandwidth_mib=16,
    cell_timeout_s=300.0,
    jobs=2,
    ceiling_s=0.05,
    verify_transports=("shm",),
    verify_wires=("uint8",),
    verify_every_design=False,
    example_tokens=8,
    example_depth=1,
)


def environment(plan: Plan) -> dict[str, str]:
    """What the machine has: GPU, driver, CUDA, torch, torchvision, NVML, MIG mode, the PCIe link."""
    import torch

    from serverbench.device.layer import make_device_layer, nvidia_driver_version
    from serverbench.records.row import package_version

    facts: dict[str, str] = {
        "host": platform.node(),
        "CPU cores": str(os.cpu_count()),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchvision": str(package_version("torchvision")),
        "torch built for CUDA": str(torch.version.cuda),
        "NVIDIA driver": str(nvidia_driver_version()),
        "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "(not set)"),
    }
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        facts["GPUs visible"] = f"{count}: " + ", ".join(torch.cuda.get_device_name(i) for i in range(count))
        facts["cuDNN"] = str(torch.backends.cudnn.version())
        facts.update(nvml_facts(make_device_layer("cuda:0").info().uuid))
    else:
        facts["GPUs visible"] = "0"
    return facts


def nvml_facts(uuid: str | None) -> dict[str, str]:
    """NVML's view of the device torch calls cuda:0: version, MIG mode, PCIe link (of the whole GPU for a MIG
    instance)."""
    from serverbench.device.layer import nvml_uuid_candidates

    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001 - reported as a fact, not a crash
        return {"NVML": f"unavailable ({exc})"}
    facts: dict[str, str] = {}
    try:
        facts["NVML"] = str(pynvml.nvmlSystemGetNVMLVersion())
        handle = None
        for candidate in nvml_uuid_candidates(uuid or ""):
            try:
                handle = pynvml.nvmlDeviceGetHandleByUUID(candidate)
                facts["NVML device"] = candidate
                break
            except pynvml.NVMLError:
                continue
        if handle is None:
            facts["NVML device"] = f"not found for torch's UUID {uuid}"
            return facts
        try:
            parent = pynvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(handle)
            facts["cuda:0 is"] = "a MIG instance"
        except pynvml.NVMLError:
            parent = handle
            facts["cuda:0 is"] = "a whole GPU"
        try:
            current, _pending = pynvml.nvmlDeviceGetMigMode(parent)
            facts["MIG mode"] = "enabled" if current == pynvml.NVML_DEVICE_MIG_ENABLE else "disabled"
        except pynvml.NVMLError as exc:
            facts["MIG mode"] = f"n/a ({exc})"
        try:
            generation = pynvml.nvmlDeviceGetMaxPcieLinkGeneration(parent)
            width = pynvml.nvmlDeviceGetMaxPcieLinkWidth(parent)
            facts["PCIe link (max)"] = f"Gen{generation} x{width}"
            if generation in PCIE_LANE_GB_S:
                facts["PCIe GB/s (one direction)"] = f"{PCIE_LANE_GB_S[generation] * width:.1f}"
        except pynvml.NVMLError as exc:
            facts["PCIe link (max)"] = f"n/a ({exc})"
    except pynvml.NVMLError as exc:
        facts["NVML error"] = str(exc)
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass
    return facts


# ------------------------------------------------------------------------------------------ the checks


def write_summary(out: Path, facts: dict[str, str], checks: dict[str, dict], dry_run: bool, command: str) -> Path:
    lines = [
        f"# GPU check{' (dry run on the CPU: tiny sizes, CUDA-only checks not run)' if dry_run else ''}",
        "",
        f"- command: `{command}`",
        f"- date: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}",
        "",
        "## Environment",
        "",
        "| | |",
        "| --- | --- |",
    ]
    lines += [f"| {key} | {value} |" for key, value in facts.items()]
    lines += ["", "## Checks", "", "| check | result | detail | where |", "| --- | --- | --- | --- |"]
    for name in CHECK_NAMES:
        if name in checks:
            c = checks[name]
            lines.append(f"| {c['name']} | **{c['status']}** | {c['detail'].replace('|', '/')} | {c['where']} |")
    failed = [c["name"] for c in checks.values() if c["status"] == FAIL]
    lines += [
        "",
        f"{'FAILED: ' + ', '.join(failed) if failed else 'No check failed.'} "
        "What each check means and what to do when one fails: docs/gpu.md.",
        "",
    ]
    path = out / "summary.md"
    path.write_text("\n".join(lines))
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = OneLineErrorParser(prog="python -m bench.gpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="folder of the summary, rows, logs and plots (default results/gpu_<GPU name>, or results/gpu_dry_run)",
    )
    parser.add_argument(
        "--dry_run",
        action="store_true",
        help="the same plan on the CPU with tiny sizes (CUDA-only checks listed as not run): checks the script itself",
    )
    parser.add_argument(
        "--only",
        nargs="+",
        choices=CHECK_NAMES,
        default=None,
        help="run these checks only, merged into the results --out already holds",
    )
    args = parser.parse_args(argv)
    import torch

    from serverbench.device.layer import unusable_gpu_reason

    cuda = torch.cuda.is_available() and not args.dry_run
    if not args.dry_run and not cuda:
        reason = unusable_gpu_reason() or "no CUDA GPU is visible to torch on this machine"
        print(f"gpu_check: {reason}; --dry_run runs the plan on the CPU", file=sys.stderr)
        return 2
    plan = DRY_PLAN if args.dry_run else GPU_PLAN
    if args.out is None:
        name = "dry_run" if args.dry_run else re.sub(r"[^a-z0-9]+", "_", torch.cuda.get_device_name(0).lower())
        args.out = ROOT / "results" / f"gpu_{name.strip('_')}"
    try:
        out = check_output_folder("--out", args.out).resolve()
    except ConfigError as exc:
        parser.error(str(exc))
    results_path = out / "checks.json"
    results: dict[str, dict] = {}
    if args.only and results_path.exists():  # merged into: it must be what an earlier run wrote
        try:
            results = json.loads(results_path.read_text())
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            parser.error(f"--only: {results_path} cannot be merged into ({type(exc).__name__}); move it away")
        if not isinstance(results, dict) or not all(isinstance(v, dict) for v in results.values()):
            parser.error(f"--only: {results_path} is not a checks file of bench.gpu_check; move it away")
    out.mkdir(parents=True, exist_ok=True)
    command = "python -m bench.gpu_check " + " ".join(argv if argv is not None else sys.argv[1:])

    facts = environment(plan)
    print("environment:\n" + "\n".join(f"  {key}: {value}" for key, value in facts.items()), flush=True)
    (out / "environment.json").write_text(json.dumps(facts, indent=1) + "\n")
    for name, run_check in plan_of_checks(out, plan, cuda, facts).items():
        if args.only and name not in args.only:
            continue
        print(f"{name}:", flush=True)
        started = time.monotonic()
        try:
            check = run_check()
        except Exception as exc:  # noqa: BLE001 - a check that breaks is a failed check; the others still run
            check = Check(name, FAIL, f"the check itself failed: {type(exc).__name__}: {exc}"[:300])
        results[name] = asdict(check)
        results_path.write_text(json.dumps(results, indent=1) + "\n")
        print(f"  -> {check.status}: {check.detail} ({time.monotonic() - started:.0f} s)", flush=True)
    summary = write_summary(out, facts, results, args.dry_run, command)
    print(f"summary: {summary}")
    return 1 if any(c["status"] == FAIL for c in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
