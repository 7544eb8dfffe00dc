"""The one frozen configuration of a run, and its command line: each flag is defined once, in the metadata of the
BenchConfig field it fills, and add_cli_args makes the argparse groups from those fields.

build.py turns the parsed flags into a BenchConfig (checks that need nothing but the flags); preflight.py checks it
against this machine and resolves the device and the paths. Every invalid value raises ConfigError with one readable
line; server.py turns it into exit status 2 before any process starts.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from serverbench.config.design_kinds import DEFAULT_DESIGN, DESIGNS
from serverbench.config.design_kinds import help_text as designs_help
from serverbench.config.door_options import DoorOptions
from serverbench.config.flags import add_flags, flag
from serverbench.config.inputs import InputSpec, image_input, parse_input, request_bytes
from serverbench.config.limits import (
    FAULT_STAGES,
    IDENTITY_MODEL,
    MAX_INSTANCES,
    MAX_REPEATS,
    MAX_SCHEDULED_REQUESTS,
    MAX_SECONDS,
    MAX_SEED,
    MAX_WORKERS,
    SEM_VALUE_MAX,
)
from serverbench.config.load_options import LoadOptions
from serverbench.config.perf_options import PerfOptions


@dataclass(frozen=True)
class RankInfo:
    """Where this process sits in the torchrun job (torchrun's environment variables)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int


@dataclass(frozen=True)
class BenchConfig(LoadOptions, PerfOptions, DoorOptions):
    # Fields of each group in the order of --help (LoadOptions and PerfOptions hold three groups). Reference flags,
    # same names and meanings.
    num_iters: int = flag(
        "ref",
        "measured requests, after the --warmup_iters warm-up requests (default 100)",
        default=100,
        type=int,
        at_least=1,
        at_most=MAX_SCHEDULED_REQUESTS,
        why="each request's timings are kept, and an open loop's schedule is drawn whole, up front",
    )
    batch_size: int = flag("ref", "images per request (default 32)", default=32, type=int, at_least=1)
    model_dir: str = flag(
        "ref",
        "folder searched for the torchvision checkpoint file of --model "
        "(e.g. resnet18-f37072fd.pth); random weights when absent (default .)",
        default=".",
    )  # absolute once preflight has run
    compile: bool = flag(
        "ref",
        "torch.compile the model; compiled and warmed up on one thread at the served shape before serving "
        "starts, one compiled copy per prediction thread (dynamo's guards are not safe to evaluate from two "
        "threads at once). Off by default: compiling takes minutes on a CPU",
        default=False,
        action=argparse.BooleanOptionalAction,
    )
    output_file: str = flag(
        "ref", "CSV file inside --results_dir that gets one row per run (default output.csv)", default="output.csv"
    )
    profile: bool = flag(
        "ref",
        "write a torch.profiler chrome trace of the backend's measured phase next to the CSV",
        default=False,
        action="store_true",
    )
    # Prediction threads: pipelined only; serial and threaded have exactly one.
    num_workers: int = flag(
        "ref",
        f"prediction threads, each on its own stream (pipelined design only; default 2, at most {MAX_WORKERS})",
        type=int,
        at_least=1,
        at_most=MAX_WORKERS,
        why="more prediction threads than any device serves at once",
    )
    # Additions.
    design: str = flag("run", designs_help(), default=DEFAULT_DESIGN.name, choices=DESIGNS)
    # As requested (auto, cpu, cuda, cuda:N) until preflight resolves it to "cpu" or "cuda:N".
    device: str = flag(
        "run", "auto (CUDA when available, else CPU), cpu, cuda or cuda:N (default auto)", default="auto"
    )
    model: str = flag(
        "run",
        "a torchvision classification model name, randomly initialised unless a checkpoint "
        f"is found; '{IDENTITY_MODEL}' (a per-sample sum: the cost of the server alone); "
        "package.module:factory, a callable returning an nn.Module (imported from the current folder or the "
        "installed packages, called with --model_kwargs); a torch.export program saved with torch.export.save "
        "(path.pt2: its inputs are read from it); or an AOTInductor package made by aoti_compile_and_package "
        "(path.pt2, served with AOTInductor; needs --input). A factory or a .pt2 RUNS THE CODE IT HOLDS (import, "
        "unpickling): use only files you trust (default resnet18)",
        default="resnet18",
    )
    # () until preflight: then the model's inputs (--input's, the program's, or the image of --image_size).
    inputs: tuple = flag(
        "run",
        "an input of the model, per sample (without the batch dimension): name:dtype:shape[:low-high], e.g. "
        "--input ids:int64:128:0-999 --input mask:int64:128:1-1; repeat for each input, in the order forward "
        "takes them. Integers are drawn within the inclusive range (default 0-1), floats uniformly within it "
        "(default standard normal). Default: a .pt2 program's own inputs, else one image:float32:3xSxS of "
        "--image_size",
        name="input",
        type=parse_input,
        action="append",
        metavar="SPEC",
    )
    model_kwargs: str | None = flag(
        "run",
        "a JSON object of keyword arguments for a package.module:factory --model, e.g. '{\"depth\": 4}'",
        metavar="JSON",
    )
    image_size: int = flag(
        "run", "height and width of the fake images (default 250)", default=250, type=int, at_least=1
    )
    seed: int = flag(
        "run",
        "seed of the fake images and the random weights (default 0)",
        default=0,
        type=int,
        at_least=0,
        at_most=MAX_SEED,
        why="seeds are 64-bit",
    )  # under torchrun: --seed + rank
    # As given until preflight: then an absolute path (also the one found in --model_dir), or None: random weights.
    checkpoint: str | None = flag(
        "run",
        "state-dict file for --model, loaded with mmap=True and weights_only=True; takes precedence over --model_dir",
    )
    results_dir: str = flag(
        "run", "folder of the CSV and traces (default results)", default="results"
    )  # absolute once preflight has run
    # Backend processes, each with its own model, reading one request transport (serverbench/launch/instances.py).
    instances: int = flag(
        "run",
        "backend processes, each with its own model (on a GPU, its own CUDA context on the "
        "same device, time-sliced unless NVIDIA MPS is running), all reading one request "
        "transport and answering one frontend, each with --design inside. The measured "
        "phase starts once every instance is ready; the row gets requests_per_instance, and "
        "the instances' ceilings, timed at once, summed. Not under torchrun (default 1, at "
        f"most {MAX_INSTANCES})",
        default=1,
        type=int,
        at_least=1,
        at_most=MAX_INSTANCES,
        why="each is a process with its own model",
    )
    # The name the row and the report give this configuration (e.g. pipelined_2w).
    experiment: str = flag(
        "out",
        "name of this configuration in the row and in reports (default: the design, with "
        "the worker count for pipelined and the instance count above one, e.g. pipelined_2w "
        "or serial_2inst)",
    )
    repeat: int = flag(
        "out",
        "repetition index, recorded in the row (default 0)",
        default=0,
        type=int,
        at_least=0,
        at_most=MAX_REPEATS - 1,
        why="it names the detail files",
    )
    # The runner's count of its runs of one cell: a later one replaces an earlier failed or interrupted row in reports.
    attempt: int = flag(
        "out",
        "which run of this configuration and repeat in its results folder this is, recorded in the row (default 1; "
        "the sweep's and the studies' runner gives 2 and up to a run again after a failure or an interrupt, whose row "
        "then stands for the earlier one's in their reports)",
        default=1,
        type=int,
        at_least=1,
        at_most=MAX_REPEATS,
        why="a lifetime's worth of runs again",
    )
    save_requests: bool = flag(
        "out",
        "also write one CSV line per request to <results_dir>/requests/ and the GPU "
        "samples to <results_dir>/gpu/; the row names both files",
        default=False,
        action="store_true",
    )
    trace: bool = flag(
        "out",
        "also write a per-request timeline (Chrome trace / Perfetto JSON: one lane per thread, "
        "one span per request per step) to <results_dir>/traces/",
        default=False,
        action="store_true",
    )
    # Also on when SAVE_TO_PYTORCH_BENCHMARK_FORMAT is set (preflight reads the environment, once).
    save_pytorch_benchmark: bool = flag(
        "out",
        "also write the row's headline metrics as PyTorch OSS benchmark database records "
        "(oss_ci_benchmark_v3, one per metric) to <output_file stem>.pytorch.json beside the CSV; also on when "
        "SAVE_TO_PYTORCH_BENCHMARK_FORMAT is set, as vLLM reads it",
        default=False,
        action="store_true",
    )
    nvtx: bool = flag(
        "out",
        "name each request's steps (formation, h2d, forward, d2h, respond: '<step> #<request id>'), the "
        "model's build and warm-up and the ceilings as NVTX ranges on the threads that run them, for Nsight "
        "Systems (nsys profile); no-ops on the CPU; nothing is pushed without it",
        default=False,
        action="store_true",
    )
    verify: bool = flag(
        "check",
        "compare every response with the answer computed serially (default stream, fully "
        "synchronised, same weights) for its batch: identical on the CPU (within 1e-4 in "
        "formed batches, --max_batch_size); on CUDA within 1e-3 (fp32), 1e-2 (default, tf32) "
        "or 5e-2 (bf16, fp16). Any mismatch makes the status wrong_output. The reference "
        "forwards add to the warm-up",
        default=False,
        action="store_true",
    )
    verbose: bool = flag(
        "tune",
        "let torch's own warnings and compile messages from the frontend and backend through "
        "(kept out of the terminal by default: they are about the environment, not the run)",
        default=False,
        action="store_true",
    )
    gpu_poll_ms: int = flag(
        "tune",
        "period of the NVML utilisation, memory and power sampler (default 100)",
        default=100,
        type=int,
        at_least=1,
    )
    request_pool_size: int = flag(
        "tune",
        "distinct batches pre-generated before timing; requests cycle through them, "
        "each written into the transport afresh (default 4)",
        default=4,
        type=int,
        at_least=1,
    )
    # Requests in transit occupy shared memory.
    max_queued_requests: int = flag(
        "tune",
        "capacity of the request queue; the sender blocks when it is full, and "
        "that wait counts in latency (default 16; with --max_batch_size, at least "
        "two full formed batches)",
        type=int,
        at_least=1,
        at_most=SEM_VALUE_MAX,
        why="the largest semaphore count",
    )
    # Requests (formed batches, with --max_batch_size) inside the backend at once: device memory.
    max_inflight: int = flag(
        "tune",
        "requests inside the backend at once, which bounds device memory (default 8)",
        default=8,
        type=int,
        at_least=1,
    )
    timeout_s: float = flag(
        "tune",
        "seconds without any response after the warm-up, while a request is in flight, before the run is declared "
        "hung (default 120)",
        default=120.0,
        type=float,
        at_most=MAX_SECONDS,
        why="7 days; a run that long is hung",
    )
    warmup_timeout_s: float = flag(
        "tune",
        "seconds allowed for the warm-up response, which includes model build and compile (default 1800)",
        default=1800.0,
        type=float,
        at_most=MAX_SECONDS,
        why="7 days; a run that long is hung",
    )
    dist_timeout_s: float = flag(
        "tune",
        "under torchrun: how long a rank waits for the others at the start barrier "
        "(after every rank's warm-up) and when the results are gathered; a rank that "
        "is gone or later than this fails the job instead of hanging it (default "
        "300)",
        default=300.0,
        type=float,
        at_most=MAX_SECONDS,
        why="7 days; a run that long is hung",
    )
    # Test-only: plants an exception at this stage on the first measured request, to prove that failures end the run
    # promptly and are reported; under torchrun resolved for this rank (--inject_fault_rank names one, or every rank).
    inject_fault: str | None = flag("tune", argparse.SUPPRESS, choices=FAULT_STAGES)
    inject_fault_rank: int | None = flag("tune", argparse.SUPPRESS, type=int)
    inject_delay_ms: float = flag("tune", argparse.SUPPRESS, default=0.0, type=float)  # test-only: a slow server
    # Not a flag: under torchrun this process's rank (its device and seed follow from it); else None.
    rank: RankInfo | None
    # Not a flag: which of the --generators frontends this config is for (generators.generator_config); 0 elsewhere.
    generator: int
    # Not a flag: --load trace's arrival times, read from --trace_file (this generator's share); () for other loads.
    trace_offsets_s: tuple[float, ...]

    @property
    def output_path(self) -> Path:
        return Path(self.results_dir) / self.output_file

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def verify_tolerance(self) -> float:
        """The CPU is deterministic at any precision; CUDA kernels may differ by stream and algorithm choice,
        by more where the arithmetic has fewer mantissa bits (TF32: 10, bf16: 7)."""
        return verify_tolerance(self.device, self.precision, self.batching)

    @property
    def model_inputs(self) -> tuple[InputSpec, ...]:
        """The model's inputs: as given or resolved by preflight, else the built-in models' image."""
        return self.inputs or (image_input(self.image_size),)

    @property
    def request_bytes(self) -> int:
        """Bytes of one request on the wire: every input's batch."""
        return request_bytes(self.model_inputs, self.batch_size, self.wire_dtype)

    @property
    def batching(self) -> bool:
        return self.max_batch_size is not None

    @property
    def formed_rows(self) -> int:
        """Images in the largest batch the model runs on: a request's, or the most whole requests that fit
        --max_batch_size."""
        if self.max_batch_size is None:
            return self.batch_size
        return (self.max_batch_size // self.batch_size) * self.batch_size


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """BenchConfig's flags, in field order, each in its group."""
    add_flags(parser, BenchConfig)


CPU_BATCHING_TOLERANCE = 1e-4  # a formed batch's rows may differ from the request's own answer in the last bits


def verify_tolerance(device: str, precision: str, batching: bool = False) -> float:
    """--verify's largest difference from the serial answer that still counts as right, relative to each float
    leaf's scale (serverbench/load/verify.py's allowed_error: times its root mean square, at least 1). On the CPU a
    request alone gives the same bits every time; in a formed batch (dynamic batching) the kernels block the work
    by the batch's size, and its rows differ from the request's own answer by rounding (2e-6 seen on resnet18),
    far below what a request answered with another's rows would show."""
    if not device.startswith("cuda"):
        return CPU_BATCHING_TOLERANCE if batching else 0.0
    return {"fp32": 1e-3, "default": 1e-2, "tf32": 1e-2}.get(precision, 5e-2)
