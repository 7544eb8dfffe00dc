"""Where does `--aoti` crash on a GPU? Each step in its own process with faulthandler on; one line and the tail of
its output per step. The first GPU run (results/gpu_nvidia-h200/NOTES.md) saw the backend die with SIGSEGV in
torch's AOTIModelPackageLoader constructor; these steps split what the backend does there into its parts.

    python3 tools/aoti_diag.py                  # on the GPU machine, alone: about 2 minutes
    DIAG_DEVICE=cpu python3 tools/aoti_diag.py  # the same steps on the CPU (all pass there)

The package is the example encoder's (examples/tiny_encoder.py, depth 2, 32 x 64 tokens), compiled once.
"""

from __future__ import annotations

import faulthandler
import os
import subprocess
import sys
import threading
import time

DEVICE = os.environ.get("DIAG_DEVICE", "cuda")
PACKAGE = f"/tmp/aoti_diag/package_{DEVICE}.pt2"
DEVICE_INDEX = 0 if DEVICE == "cuda" else -1
STEPS = (
    "compile",  # export and aoti_compile_and_package, in a process of its own
    "call_1runner",  # torch's own loader and call: one runner
    "boxed_8runners",  # load_package(num_runners=8) as the backend asks, its boxed_run
    "ours_8runners",  # serverbench's load_aoti, as the backend calls it
    "ours_2threads_streams",  # two threads, each on a stream of its own, 20 calls each
    "compile_then_load_here",  # compile and load in one process, as the backend does
)
STEP_TIMEOUT_S = 150


def example_inputs():
    import torch

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 1000, (32, 64), generator=generator).to(DEVICE)
    return ids, torch.ones(32, 64, dtype=torch.int64).to(DEVICE)


def compile_package(target: str):
    import torch

    from examples.tiny_encoder import make_model

    with torch.no_grad():
        program = torch.export.export(make_model(depth=2).to(DEVICE).eval(), example_inputs())
    os.makedirs(os.path.dirname(target), exist_ok=True)
    torch._inductor.aoti_compile_and_package(program, package_path=target)


def run_step(name: str) -> object:
    import torch

    from serverbench.backend.sources import load_aoti

    ids, mask = example_inputs()
    if name == "compile":
        compile_package(PACKAGE)
        return "compiled"
    if name == "call_1runner":
        return torch._inductor.aoti_load_package(PACKAGE)(ids, mask)
    if name == "boxed_8runners":
        from torch._inductor import package

        return package.load_package(PACKAGE, num_runners=8, device_index=DEVICE_INDEX).loader.boxed_run([ids, mask])
    if name == "ours_8runners":
        with torch.inference_mode():
            return load_aoti(PACKAGE, 8, DEVICE_INDEX).run(ids, mask)
    if name == "ours_2threads_streams":
        model, errors = load_aoti(PACKAGE, 8, DEVICE_INDEX), []

        def calls() -> None:
            try:
                stream = torch.cuda.Stream() if DEVICE == "cuda" else None
                with torch.inference_mode(), torch.cuda.stream(stream) if stream else torch.inference_mode():
                    for _ in range(20):
                        model.run(ids, mask)
                if stream is not None:
                    stream.synchronize()
            except Exception as exc:  # noqa: BLE001 - reported as the step's result
                errors.append(repr(exc))

        threads = [threading.Thread(target=calls) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(STEP_TIMEOUT_S / 2)
        return errors or "two threads, 20 calls each"
    if name == "compile_then_load_here":
        compile_package(PACKAGE + ".here.pt2")
        print("compiled; loading in the same process", flush=True)
        with torch.inference_mode():
            return load_aoti(PACKAGE + ".here.pt2", 8, DEVICE_INDEX).run(ids, mask)
    raise ValueError(f"unknown step {name}")


def main() -> int:
    if len(sys.argv) > 1:  # one step, in this child process
        faulthandler.enable(all_threads=True)
        sys.path.insert(0, os.getcwd())
        out = run_step(sys.argv[1])
        if DEVICE == "cuda":
            import torch

            torch.cuda.synchronize()
        print("result:", type(out).__name__, str(out)[:100].replace("\n", " "), flush=True)
        return 0
    for name in STEPS:
        start_s = time.monotonic()
        try:
            child = subprocess.run(
                [sys.executable, __file__, name], capture_output=True, text=True, timeout=STEP_TIMEOUT_S
            )
            lines = [line for line in (child.stdout + child.stderr).splitlines() if not line.startswith("W1")]
            print(f"== {name}: exit {child.returncode} in {time.monotonic() - start_s:.1f} s", flush=True)
            print("\n".join(lines[-25:]), flush=True)
        except subprocess.TimeoutExpired:
            print(f"== {name}: still running after {STEP_TIMEOUT_S} s, stopped", flush=True)
        if name == "compile" and not os.path.exists(PACKAGE):
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
