"""The machine's probe for bench.gpu_check, and the other child that touches CUDA (the H2D measurement): `python -m
bench.gpu_probe probe|h2d` prints one JSON object. Also what the probe's facts refuse (/dev/shm, torch.compile's C
compiler, AOTInductor's toolkit).

Whatever touches CUDA runs in a child process (this module's, the servers, pytest): the parent holds no CUDA context
while the servers run, so a GPU in exclusive-process compute mode still takes them. Only the functions named in
CHILD_FUNCTIONS may touch CUDA (tests/test_gpu_check.py checks it)."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Sequence
from pathlib import Path

from serverbench.system.process import last_line, line_of, one_line

ROOT = Path(__file__).resolve().parent.parent
# Usable bandwidth of one PCIe lane by generation, GB/s, after line encoding.
PCIE_LANE_GB_S = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}
# The functions that run in a child process and may touch CUDA; nothing else in the parent may.
CHILD_FUNCTIONS = ("probe", "nvml_facts", "measure_h2d", "child_main")
EXCLUSIVE_PROCESS = "exclusive process"
# The pytest plugins the cuda tests use where pytest loads them (--timeout, -n).
PYTEST_PLUGINS = ("pytest_timeout", "xdist")


def probe(device: str) -> dict:
    """What the later checks need, from a child process (it may touch CUDA): torch and CUDA, the driver, NVML's
    view (compute mode, PCIe link), the compilers and headers torch.compile and AOTInductor need, /dev/shm,
    pytest, pytest-xdist, pip and the door's packages."""
    import platform

    import torch

    from serverbench.backend.sources import aoti_problem
    from serverbench.config.door_options import DOOR_PACKAGES
    from serverbench.device.layer import make_device_layer, nvidia_driver_version, unusable_gpu_reason
    from serverbench.records.row import package_version

    found: dict = {"facts": {}}
    facts = found["facts"]
    facts |= {
        "host": platform.node(),
        "CPU cores": str(os.cpu_count()),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchvision": str(package_version("torchvision")),
        "torch built for CUDA": str(torch.version.cuda),
        "NVIDIA driver": str(nvidia_driver_version()),
        "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "(not set)"),
    }
    cuda = device.startswith("cuda") and torch.cuda.is_available()
    found["cuda"] = cuda
    found["unusable_reason"] = None if cuda or not device.startswith("cuda") else unusable_gpu_reason()
    if cuda:
        count = torch.cuda.device_count()
        facts["GPUs visible"] = f"{count}: " + ", ".join(torch.cuda.get_device_name(i) for i in range(count))
        found["gpu_name"] = torch.cuda.get_device_name(0)
        facts["cuDNN"] = str(torch.backends.cudnn.version())
        found |= nvml_facts(make_device_layer("cuda:0").info().uuid)
        facts |= found.pop("nvml")
    # torch.compile: Triton (GPU) and inductor's C++ (CPU) build modules with a C compiler and Python's headers.
    compiler = shutil.which(os.environ.get("CC") or "gcc") or shutil.which("cc")
    python_h = Path(sysconfig.get_paths()["include"]) / "Python.h"
    found["cc"] = compiler
    found["python_h"] = str(python_h) if python_h.is_file() else None
    facts["C compiler"] = compiler or "none on PATH"
    facts["Python.h"] = found["python_h"] or f"missing ({python_h})"
    found["aoti_problem"] = aoti_problem()
    if device.startswith("cuda"):
        from torch.utils.cpp_extension import CUDA_HOME

        from serverbench.backend.sources import cuda_headers_problem

        nvcc = shutil.which("nvcc") or (
            str(Path(CUDA_HOME) / "bin" / "nvcc") if CUDA_HOME and (Path(CUDA_HOME) / "bin" / "nvcc").exists() else None
        )
        found["cuda_headers_problem"] = cuda_headers_problem()
        facts["CUDA toolkit"] = f"CUDA_HOME={CUDA_HOME}, nvcc {nvcc or 'none'}"
    try:
        shm = os.statvfs("/dev/shm")
        found["shm_free_bytes"] = shm.f_bavail * shm.f_frsize
        facts["/dev/shm"] = f"{shm.f_blocks * shm.f_frsize / 2**30:.2f} GiB, {found['shm_free_bytes'] / 2**30:.2f} free"
    except OSError as exc:
        found["shm_free_bytes"] = None
        facts["/dev/shm"] = f"n/a ({exc.strerror})"
    tools = ("pytest", "pytest_timeout", "xdist", "pip")
    # A pytest plugin counts where pytest will load it: through its entry point, not merely importable.
    plugins = {ep.value.split(":")[0].split(".")[0] for ep in importlib.metadata.entry_points(group="pytest11")}
    found["has"] = {
        name: importlib.util.find_spec(name) is not None and (name not in PYTEST_PLUGINS or name in plugins)
        for name in tools
    }
    found["door_missing"] = [name for name in DOOR_PACKAGES if importlib.util.find_spec(name) is None]
    facts["pytest / pytest-timeout / xdist / pip"] = " / ".join("yes" if found["has"][n] else "no" for n in tools)
    facts["door packages missing"] = ", ".join(found["door_missing"]) or "none"
    return found


def nvml_facts(uuid: str | None) -> dict:
    """NVML's view of the device torch calls cuda:0: version, compute mode, MIG mode, PCIe link (of the whole GPU
    for a MIG instance). {"nvml": facts to show, "compute_mode", "pcie_gb_s"}."""
    from serverbench.device.gpu_sampler import nvml_uuid_candidates

    facts: dict[str, str] = {}
    found: dict = {"nvml": facts, "compute_mode": None, "pcie_gb_s": None}
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001 - reported as a fact, not a crash
        facts["NVML"] = f"unavailable ({exc})"
        return found
    try:
        facts["NVML"] = str(pynvml.nvmlSystemGetNVMLVersion())
        handle = None
        for candidate in nvml_uuid_candidates(uuid or ""):
            try:
                handle = pynvml.nvmlDeviceGetHandleByUUID(candidate)
                break
            except pynvml.NVMLError:
                continue
        if handle is None:
            facts["NVML device"] = f"not found for torch's UUID {uuid}"
            return found
        try:
            parent = pynvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(handle)
            facts["cuda:0 is"] = "a MIG instance"
        except pynvml.NVMLError:
            parent = handle
            facts["cuda:0 is"] = "a whole GPU"
        try:
            modes = {0: "default", 1: "exclusive thread", 2: "prohibited", 3: EXCLUSIVE_PROCESS}
            found["compute_mode"] = modes.get(pynvml.nvmlDeviceGetComputeMode(parent), "unknown")
            facts["compute mode"] = found["compute_mode"]
        except pynvml.NVMLError as exc:
            facts["compute mode"] = f"n/a ({exc})"
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
                found["pcie_gb_s"] = PCIE_LANE_GB_S[generation] * width
                facts["PCIe GB/s (one direction)"] = f"{found['pcie_gb_s']:.1f}"
            # An idle GPU trains its link down to save power: the current link is a fact, the maximum the bar.
            now_gen = pynvml.nvmlDeviceGetCurrPcieLinkGeneration(parent)
            facts["PCIe link (now, idle)"] = f"Gen{now_gen} x{pynvml.nvmlDeviceGetCurrPcieLinkWidth(parent)}"
        except pynvml.NVMLError as exc:
            facts["PCIe link (max)"] = f"n/a ({exc})"
    except pynvml.NVMLError as exc:
        facts["NVML error"] = str(exc)
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass
    return found


def measure_h2d(device: str, nbytes: int, iters: int = 10) -> dict[str, float]:
    """GB/s of host-to-device copies of `nbytes` from pageable memory, pinned memory (cudaHostAlloc) and memory
    registered in place (cudaHostRegister, as the ring is), timed with the device layer's events. On the CPU
    (the dry run): pageable only, the copy a host memcpy."""
    import torch

    from serverbench.device.layer import make_device_layer

    layer = make_device_layer(device)
    cuda = device.startswith("cuda")
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    sources = {"pageable": torch.ones(nbytes, dtype=torch.uint8)}
    if cuda:
        try:  # shared memory, as the ring is: /dev/shm must hold it (Docker's default is 64 MiB)
            sources["registered"] = torch.ones(nbytes, dtype=torch.uint8).share_memory_()
        except RuntimeError as exc:
            raise RuntimeError(
                f"cannot place {nbytes / 2**20:.0f} MiB in /dev/shm, as the ring needs: "
                f"{one_line(exc, limit=200)}; enlarge it (docker run --shm-size=2g)"
            ) from None
        sources["pinned"] = torch.ones(nbytes, dtype=torch.uint8).pin_memory()
        layer.register_host(sources["registered"])
    found = {}
    try:
        for name in ("pageable", "pinned", "registered"):
            if name not in sources:
                continue
            target.copy_(sources[name], non_blocking=True)  # warm: first-touch, driver staging buffers
            layer.synchronize()
            start, end = layer.new_event(), layer.new_event(host_waits=True)
            start.record()
            for _ in range(iters):
                target.copy_(sources[name], non_blocking=True)
            end.record()
            end.synchronize()
            found[name] = nbytes * iters / (start.elapsed_time(end) / 1e3) / 1e9
    finally:
        layer.synchronize()
        if cuda:
            layer.unregister_host(sources["registered"])
    return found


def child_main(argv: Sequence[str]) -> int:
    """`python -m bench.gpu_probe probe --device D` or `h2d --device D --mib N`: one JSON object on stdout."""
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_probe")
    parser.add_argument("what", choices=("probe", "h2d"))
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--mib", type=int, default=256)
    args = parser.parse_args(argv)
    found = probe(args.device) if args.what == "probe" else measure_h2d(args.device, args.mib * 2**20)
    print(json.dumps(found))
    return 0


NO_ANSWER = "no answer within"


def run_child(args: Sequence[str], timeout_s: float, log: Path | None = None) -> tuple[dict | None, str]:
    """A child of this module (probe, h2d) within timeout_s: (its JSON, "") or (None, why not)."""
    cmd = [sys.executable, "-m", "bench.gpu_probe", *args]
    try:
        proc = subprocess.run(
            cmd, cwd=ROOT, capture_output=True, text=True, timeout=max(1.0, timeout_s), start_new_session=True
        )
    except subprocess.TimeoutExpired:
        return None, f"{NO_ANSWER} {timeout_s:.0f} s"
    if log is not None:
        log.write_text(proc.stdout + proc.stderr)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = last_line(proc.stderr) or "no output"
        return None, f"exit {proc.returncode}: {line_of(tail, limit=300)}"
    return json.loads(lines[-1]), ""


# ------------------------------------------------------------------------------------------ what a check needs


@functools.cache
def shm_need_bytes(flags: tuple[str, ...]) -> int:
    """/dev/shm a server run with these flags needs, as its preflight counts it: the ring (shm, a door in its own
    process), or every request in transit as a fresh segment (queue)."""
    from serverbench.config.build import parse_server_flags
    from serverbench.transport.channels import shm_need_bytes as needed

    cfg = parse_server_flags(flags)
    return needed(cfg if cfg.ring_slots is not None else dataclasses.replace(cfg, ring_slots=4))  # as before preflight


def shm_refusal(facts: dict, flag_sets: Sequence[Sequence[str]]) -> str | None:
    """Why these runs cannot start here for want of /dev/shm, or None."""
    free = facts.get("shm_free_bytes")
    if free is None or not flag_sets:
        return None
    need = max(shm_need_bytes(tuple(flags)) for flags in flag_sets)
    if need <= free:
        return None
    return (
        f"needs {need / 2**20:.0f} MiB of /dev/shm and it has {free / 2**20:.0f} MiB free: enlarge it "
        "(docker run --shm-size=8g) or run on the host"
    )


def compile_refusal(facts: dict) -> str | None:
    """torch.compile builds modules with a C compiler against Python's headers (Triton's launcher on a GPU,
    inductor's C++ on the CPU)."""
    if not facts.get("cc"):
        return "no C compiler (gcc or cc) on PATH: torch.compile's Triton and inductor build C modules with one"
    if not facts.get("python_h"):
        return "Python.h is missing (python3-dev): torch.compile builds C modules against Python's headers"
    return None


def aoti_refusal(facts: dict, cuda: bool) -> str | None:
    """AOTInductor: a C++ compiler, and on a GPU the CUDA toolkit's headers (CUDA_HOME)."""
    return facts.get("aoti_problem") or compile_refusal(facts) or (facts.get("cuda_headers_problem") if cuda else None)


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1:]))
