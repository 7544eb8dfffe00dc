"""The one frozen configuration of a run: built once from the command line, validated here, passed explicitly.

Every invalid value raises ConfigError with one readable line; server.py turns it into exit status 2
before any process starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from _multiprocessing import SemLock
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from serverbench.launch.instances import MAX_INSTANCES
from serverbench.launch.ranks import RankInfo
from serverbench.load.windows import STABLE_WINDOWS

DESIGNS = ("serial", "threaded", "pipelined")
LOADS = ("burst", "closed", "poisson")
TRANSPORTS = ("shm", "queue")
WIRE_DTYPES = ("float32", "uint8")
PRECISIONS = ("default", "fp32", "tf32", "bf16", "fp16")
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs", "max-autotune", "reduce-overhead")
CUDAGRAPH_COMPILE_MODES = ("max-autotune", "reduce-overhead")  # these capture CUDA graphs on the GPU
FAULT_STAGES = ("frontend", "backend_start", "h2d", "predict", "d2h", "hang", "oom", "oom_build", "early_reuse",
                "server", "sticky_cuda", "instance_exit")
# hang: a stuck predictor; oom: the first measured forward runs out of memory; oom_build: the model build does;
# early_reuse: a planted synchronisation bug (every request copied into one shared device buffer, reused while a
# forward may read it); server: the server process itself raises before starting its children (under torchrun:
# once it has joined the job), as a crashing rank would; sticky_cuda: the first measured forward fails as after an
# illegal memory access, and so does every step of the backend's teardown; instance_exit: backend instance 1 leaves
# with os._exit on the first measured request it takes, as a crashing process would (--instances 2 or more)


MAX_CEILING_S = 600.0  # per concurrency and phase: ten minutes of forwards time any model well
MAX_INTRA_OP_THREADS = 4096  # a bound, so that a typo cannot ask torch for millions of threads
MAX_WINDOWS = 10_000
WINDOW_DEFAULTS = {"window_s": 1.0, "window_requests": 30, "max_windows": 12}  # apply with --stability_pct only
MAX_SECONDS = 7 * 24 * 3600.0  # timeouts and durations: longer than any run, short enough for every clock API
MAX_RATE_RPS = 1e6
MIN_BURSTINESS, MAX_BURSTINESS = 1e-3, 1e3  # gamma shapes whose gaps stay finite and non-zero
MAX_SEED = 2**63 - 1 - 4096  # a 64-bit seed, with room for --seed + RANK
SEM_VALUE_MAX = SemLock.SEM_VALUE_MAX  # the largest count a semaphore (a multiprocessing queue's bound) holds here


IDENTITY_MODEL = "identity"  # --model: a per-sample sum instead of a network, the server's own cost


class ConfigError(ValueError):
    """An invalid flag value or combination; the message is one line for the user."""


@dataclass(frozen=True)
class BenchConfig:
    # Reference flags, same names and meanings.
    num_iters: int
    batch_size: int
    model_dir: str
    compile: bool
    output_file: str
    profile: bool
    num_workers: int  # prediction threads: pipelined only; serial and threaded have exactly one
    # Additions.
    device: str  # resolved: "cpu" or "cuda:N"
    design: str
    model: str
    image_size: int
    seed: int
    checkpoint: Optional[str]  # absolute path, or None for random weights
    results_dir: str  # absolute path
    gpu_poll_ms: int
    request_pool_size: int  # distinct pre-generated batches the frontend cycles through
    max_queued_requests: int  # bound of the request queue (requests in transit occupy shared memory)
    max_inflight: int  # requests (formed batches, with --max_batch_size) inside the backend at once: device memory
    timeout_s: float  # no progress for this long after the warm-up: the run is declared hung
    warmup_timeout_s: float  # the warm-up includes model build and compile
    experiment: str  # the name the row and the report give this configuration (e.g. pipelined_2w)
    repeat: int  # which repetition of its sweep cell this run is
    save_requests: bool  # also write one line per request and the GPU samples (for CDFs and time plots)
    trace: bool  # also write a per-request timeline (Chrome trace / Perfetto JSON)
    load: str  # burst (all at once), closed (at most `concurrency` outstanding), poisson (open loop at `rate_rps`)
    concurrency: Optional[int]  # closed loop: requests outstanding at once
    rate_rps: Optional[float]  # poisson: offered requests per second
    burstiness: float  # poisson: shape of the gamma-distributed gaps; 1.0 is Poisson, lower is burstier
    duration_s: float  # the measured phase lasts at least this long (and at least num_iters requests); 0: no minimum
    warmup_iters: int  # requests sent one at a time before the measured phase, excluded from every statistic
    slo_ms: Optional[float]  # latency target: attainment, goodput and whether p99 met it
    find_peak: bool  # search the highest Poisson rate whose p99 stays within slo_ms
    peak_steps: int  # bisection steps of that search
    load_poll_ms: int  # period of the in-flight and queue-depth sampler
    verify: bool  # compare every response with a serial, synchronised reference answer for its batch
    transport: str  # shm: a ring of preallocated shared-memory slots; queue: the reference's tensors via mp queues
    ring_slots: int  # shm: slots in the ring (requests written and not yet on the device)
    wire_dtype: str  # float32 (the reference) or uint8 (converted and normalised on the device)
    precision: str  # default (PyTorch's TF32 flags as they are), fp32 (strict IEEE), tf32, bf16 or fp16
    channels_last: bool  # model and input in NHWC memory layout
    compile_mode: str  # torch.compile mode when compile is on
    compile_decode: bool  # torch.compile the wire decoding (uint8 normalisation, cast, layout); follows compile
    spin_wait: bool  # host waits on CUDA events busy-poll (events made without blocking sync), for comparison
    cpu_split: bool  # CPU device: the frontend on one core of its own, the backends on the others
    intra_op_threads: Optional[int]  # each backend's torch intra-op threads; None: auto (CPU: all cores but one)
    verbose: bool  # the children's torch warnings and compile chatter reach the terminal
    ceiling: bool  # also time the model alone on inputs already on the device: ceiling_throughput, efficiency
    tune_malloc: bool  # the backend's glibc malloc keeps freed memory for reuse instead of mapping it per forward
    ceiling_s: float  # seconds of the ceiling's forwards per concurrency, before serving and again after
    stability_pct: Optional[float]  # windows: the measured phase goes on until its last 3 windows agree; None: off
    window_s: float  # a stability window lasts at least this long
    window_requests: int  # and holds at least this many responses
    max_windows: int  # the measured phase ends after this many windows, stable or not
    rank: Optional[RankInfo]  # under torchrun: this process's rank (its device and seed follow from it); else None
    dist_timeout_s: float  # under torchrun: how long a rank waits for the others at each collective
    max_batch_size: Optional[int]  # dynamic batching: images in one formed batch at most; None: every request alone
    max_queue_delay_ms: float  # dynamic batching: a formed batch waits at most this long after its first request
    inject_delay_ms: float  # test-only: every forward takes this much longer (a slow server)
    inject_fault: Optional[str]  # test-only: raise at this stage on the first measured request (under torchrun:
    # on the rank --inject_fault_rank names, or on every rank)
    instances: int = 1  # backend processes, each with its own model, reading one request transport (instances.py)

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
    def request_bytes(self) -> int:
        """Bytes of one request's batch on the wire."""
        return request_bytes(self.batch_size, self.image_size, self.wire_dtype)

    @property
    def input_shape(self) -> tuple[int, int, int, int]:
        return (self.batch_size, 3, self.image_size, self.image_size)

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

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr (and exit status 2), like every other invalid value."""

    def error(self, message: str) -> None:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


class RaisingParser(argparse.ArgumentParser):
    """argparse that raises ConfigError for a usage error instead of printing and exiting: for checking another
    program's flags (a sweep's cells) without running it."""

    def error(self, message: str) -> None:
        raise ConfigError(message)


def request_bytes(batch_size: int, image_size: int, wire_dtype: str) -> int:
    """Bytes of one request's batch on the wire."""
    return batch_size * 3 * image_size ** 2 * (1 if wire_dtype == "uint8" else 4)


CPU_BATCHING_TOLERANCE = 1e-4  # a formed batch's rows may differ from the request's own answer in the last bits


def verify_tolerance(device: str, precision: str, batching: bool = False) -> float:
    """--verify's largest absolute difference from the serial answer that still counts as right. On the CPU a
    request alone gives the same bits every time; in a formed batch (dynamic batching) the kernels block the work
    by the batch's size, and its rows differ from the request's own answer by rounding (2e-6 seen on resnet18),
    far below what a request answered with another's rows would show."""
    if not device.startswith("cuda"):
        return CPU_BATCHING_TOLERANCE if batching else 0.0
    return {"fp32": 1e-3, "default": 1e-2, "tf32": 1e-2}.get(precision, 5e-2)


def _count_or_auto(value: str) -> Optional[int]:
    """--intra_op_threads: a count, or auto (None)."""
    if value == "auto":
        return None
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a whole number of threads, or auto; not {value!r}") from None


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    ref = parser.add_argument_group("reference flags (pytorch/pytorch benchmarks/inference)")
    ref.add_argument("--num_iters", type=int, default=100,
                     help="measured requests, after the --warmup_iters warm-up requests (default 100)")
    ref.add_argument("--batch_size", type=int, default=32, help="images per request (default 32)")
    ref.add_argument("--model_dir", default=".",
                     help="folder searched for the torchvision checkpoint file of --model "
                          "(e.g. resnet18-f37072fd.pth); random weights when absent (default .)")
    ref.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False,
                     help="torch.compile the model; compiled and warmed up once on one thread at the served "
                          "shape before serving starts. Off by default: compiling takes minutes on a CPU")
    ref.add_argument("--output_file", default="output.csv",
                     help="CSV file inside --results_dir that gets one row per run (default output.csv)")
    ref.add_argument("--profile", action="store_true",
                     help="write a torch.profiler chrome trace of the backend's measured phase next to the CSV")
    ref.add_argument("--num_workers", type=int, default=None,
                     help="prediction threads, each on its own stream (pipelined design only; default 2)")

    run = parser.add_argument_group("what to run")
    run.add_argument("--design", default="pipelined", choices=DESIGNS,
                     help="serial: one loop does get, H2D, forward, D2H, put; threaded: a one-worker thread pool "
                          "runs H2D, forward and respond while the loop keeps polling; pipelined: an H2D thread, "
                          "--num_workers prediction threads and a D2H thread, each on its own stream "
                          "(default pipelined)")
    run.add_argument("--device", default="auto",
                     help="auto (CUDA when available, else CPU), cpu, cuda or cuda:N (default auto)")
    run.add_argument("--model", default="resnet18",
                     help="a torchvision classification model name, randomly initialised unless a checkpoint "
                          f"is found; or '{IDENTITY_MODEL}' (a per-sample sum: the cost of the server alone) "
                          "(default resnet18)")
    run.add_argument("--image_size", type=int, default=250, help="height and width of the fake images (default 250)")
    run.add_argument("--seed", type=int, default=0, help="seed of the fake images and the random weights (default 0)")
    run.add_argument("--checkpoint", default=None,
                     help="state-dict file for --model, loaded with mmap=True and weights_only=True; "
                          "takes precedence over --model_dir")
    run.add_argument("--results_dir", default="results", help="folder of the CSV and traces (default results)")
    run.add_argument("--instances", type=int, default=1,
                     help="backend processes, each with its own model (on a GPU, its own CUDA context on the same "
                          "device, time-sliced unless NVIDIA MPS is running), all reading one request transport and "
                          "answering one frontend, each with --design inside. The measured phase starts once every "
                          "instance is ready; the row gets requests_per_instance, and the instances' ceilings, timed "
                          f"at once, summed. Not under torchrun (default 1, at most {MAX_INSTANCES})")

    out = parser.add_argument_group("labels and detail outputs")
    out.add_argument("--experiment", default=None,
                     help="name of this configuration in the row and in reports (default: the design, with "
                          "the worker count for pipelined and the instance count above one, e.g. pipelined_2w or "
                          "serial_2inst)")
    out.add_argument("--repeat", type=int, default=0, help="repetition index, recorded in the row (default 0)")
    out.add_argument("--save_requests", action="store_true",
                     help="also write one CSV line per request to <results_dir>/requests/ and the GPU samples "
                          "to <results_dir>/gpu/; the row names both files")
    out.add_argument("--trace", action="store_true",
                     help="also write a per-request timeline (Chrome trace / Perfetto JSON: one lane per thread, "
                          "one span per request per step) to <results_dir>/traces/")

    load = parser.add_argument_group(
        "load", "burst answers 'how fast can it go' (the reference: every request at once); closed and poisson "
                "answer 'what latency at this traffic'")
    load.add_argument("--load", default="burst", choices=LOADS,
                      help="burst: all requests at once after the warm-up; closed: at most --concurrency "
                           "outstanding, a new one sent as each response arrives; poisson: open loop at --rate, "
                           "latency measured from each request's intended send time (default burst)")
    load.add_argument("--concurrency", type=int, default=None, help="closed loop: requests outstanding at once")
    load.add_argument("--rate", type=float, default=None, dest="rate_rps",
                      help="poisson: offered requests per second; the schedule is drawn up front from --seed")
    load.add_argument("--burstiness", type=float, default=1.0,
                      help="poisson: gamma shape of the gaps between requests; 1.0 is Poisson, below 1 burstier, "
                           "above 1 more regular (default 1.0)")
    load.add_argument("--duration_s", type=float, default=0.0,
                      help="the measured phase ends once it has lasted this long and --num_iters requests were "
                           "sent, whichever comes later (default 0: the count alone)")
    load.add_argument("--warmup_iters", type=int, default=1,
                      help="warm-up requests, sent one at a time and excluded from every statistic; the first one's "
                           "latency is warmup_latency (default 1)")
    load.add_argument("--slo_ms", type=float, default=None,
                      help="latency target: the row gets the fraction of requests within it, the goodput "
                           "(samples/s within it) and whether p99 met it")
    load.add_argument("--find_peak", action="store_true",
                      help="search (bisection, --peak_steps Poisson runs after one burst run) for the highest rate "
                           "whose p99 latency stays within --slo_ms; each run is a row, the result goes to peak.csv")
    load.add_argument("--peak_steps", type=int, default=6, help="bisection steps of --find_peak (default 6)")
    load.add_argument("--stability_pct", type=float, default=None,
                      help="stability windows (perf_analyzer's): the measured phase is cut into windows and goes on "
                           "until the last 3 windows' throughputs and p99 latencies are each within this %% of "
                           "their mean, or --max_windows; the row reports those 3 windows (windows, stable, "
                           "window_throughput_cv_pct). Replaces --num_iters and --duration_s (default off: the "
                           "reference's fixed count)")
    load.add_argument("--window_s", type=float, default=WINDOW_DEFAULTS["window_s"],
                      help="with --stability_pct: a window lasts at least this many seconds (default 1.0)")
    load.add_argument("--window_requests", type=int, default=WINDOW_DEFAULTS["window_requests"],
                      help="with --stability_pct: and holds at least this many responses, so that its p99 is "
                           "not just its maximum (default 30)")
    load.add_argument("--max_windows", type=int, default=WINDOW_DEFAULTS["max_windows"],
                      help="with --stability_pct: end the measured phase after this many windows even if it is not "
                           "stable; the row says stable=False (default 12)")
    load.add_argument("--load_poll_ms", type=int, default=50,
                      help="period of the sampler of requests in flight and request-queue depth (default 50)")

    check = parser.add_argument_group("correctness")
    check.add_argument("--verify", action="store_true",
                       help="compare every response with the answer computed serially (default stream, fully "
                            "synchronised, same weights) for its batch: identical on the CPU (within 1e-4 in formed "
                            "batches, --max_batch_size); on CUDA within 1e-3 "
                            "(fp32), 1e-2 (default, tf32) or 5e-2 (bf16, fp16). Any mismatch makes the status "
                            "wrong_output. The reference forwards add to the warm-up")

    perf = parser.add_argument_group(
        "transport and model-side options", "what the server moves and how the model runs; the reference's way is "
        "--transport queue --wire_dtype float32 --precision default")
    perf.add_argument("--transport", default="shm", choices=TRANSPORTS,
                      help="shm: a ring of --ring_slots shared-memory slots made once before the processes start "
                           "(page-locked once on CUDA); each request is written into a free slot and only a small "
                           "header crosses the queue; the slot is handed back once its bytes are on the device. "
                           "queue: the reference's tensors through multiprocessing queues, a fresh shared-memory "
                           "segment per request, pinned again on arrival (default shm)")
    perf.add_argument("--ring_slots", type=int, default=None,
                      help="shm: slots in the ring; the sender waits for a free one, and that wait counts in "
                           "latency (default: as many as fit 64 MiB, 4 to 64; with --max_batch_size, at least two "
                           "full formed batches)")
    perf.add_argument("--wire_dtype", default="float32", choices=WIRE_DTYPES,
                      help="float32: normalised images, as the reference; uint8: raw pixels, a quarter of the bytes, "
                           "converted and normalised on the device inside the timed H2D step (default float32)")
    perf.add_argument("--precision", default="default", choices=PRECISIONS,
                      help="default: float32 with PyTorch's own TF32 flags left as they are (cuDNN convolutions in "
                           "TF32, matmuls in IEEE float32), as the reference ran; fp32: strict IEEE float32 (TF32 "
                           "off everywhere); tf32: TF32 matmuls and convolutions; bf16 or fp16: model and input "
                           "cast, outputs returned as float32. The row records the effective flags (default default)")
    perf.add_argument("--channels_last", action="store_true",
                      help="model weights and inputs in channels-last (NHWC) memory layout")
    perf.add_argument("--compile_mode", default="default", choices=COMPILE_MODES,
                      help="torch.compile mode with --compile. max-autotune and reduce-overhead capture CUDA graphs, "
                           "which are not safe across threads: on CUDA they need --design serial (the model then runs "
                           "on the thread that compiled it) (default: default)")
    perf.add_argument("--compile_decode", action=argparse.BooleanOptionalAction, default=None,
                      help="torch.compile the decoding of wire bytes into model input (uint8 conversion and "
                           "normalisation, cast, layout) into one fused pass; on a CPU eager decoding takes three "
                           "passes. Compiled once before serving, like the model (default: as --compile)")
    perf.add_argument("--ceiling", action=argparse.BooleanOptionalAction, default=True,
                      help="also time the model alone on inputs already on the device, same batch, precision and "
                           "layout, at the design's concurrency (serial, threaded: one forward at a time; "
                           "pipelined: 1 to --num_workers threads, each on its own stream, the best), before and "
                           "after serving: the row gets ceiling_throughput (the faster phase), ceiling_concurrency, "
                           "ceiling_spread_pct "
                           "and, for burst and closed loads, efficiency = throughput / ceiling_throughput "
                           "(default on)")
    perf.add_argument("--tune_malloc", action=argparse.BooleanOptionalAction, default=True,
                      help="the backend's glibc malloc serves every allocation from its heap and keeps what is "
                           "freed (mallopt M_MMAP_MAX 0, M_TRIM_THRESHOLD at its largest), as PyTorch's CPU tuning "
                           "guide suggests jemalloc or tcmalloc for: otherwise a forward's large activations are "
                           "mapped and unmapped, page faults each time, at a cost that changes from one process to "
                           "the next. The row's malloc_tuned says whether it took (glibc only) (default on)")
    perf.add_argument("--ceiling_s", type=float, default=1.0,
                      help="seconds of forwards the ceiling times at each concurrency, before serving and again "
                           "after, in 5 loops of at least 3 forwards per thread (default 1.0)")

    batch = parser.add_argument_group(
        "dynamic batching", "Triton's dynamic batcher, TorchServe's batch_size and max_batch_delay: the backend "
        "gathers requests into one forward, in every design")
    batch.add_argument("--max_batch_size", type=int, default=None,
                       help="images in one formed batch at most (more than --batch_size, the images per request); "
                            "whole requests only. With --compile, formed batches are padded to sizes compiled at "
                            "warm-up (powers of two up to this). Default: off, every request is its own forward")
    batch.add_argument("--max_queue_delay_ms", type=float, default=None,
                       help="with --max_batch_size: a formed batch goes once this long has passed since its oldest "
                            "request arrived, full or not (default 0: only what is already waiting is batched, "
                            "no request waits for another)")

    perf.add_argument("--spin_wait", action="store_true",
                      help="CUDA: the H2D and D2H threads busy-wait for their copies (events without blocking sync, "
                           "a CPU core each), as the reference's events did; by default they sleep until the GPU "
                           "signals. For comparison; no effect on the CPU")

    perf.add_argument("--cpu_split", action=argparse.BooleanOptionalAction, default=False,
                      help="CPU device: the frontend (the clients' stand-in) runs on one core of its own and the "
                           "model on the others, with that many intra-op threads, so that sending and receiving "
                           "never stall a forward's threads (with one CPU they share it). Default off: every "
                           "process on every core, the model with --intra_op_threads of them. No effect on a GPU")

    perf.add_argument("--intra_op_threads", type=_count_or_auto, default=None, metavar="N|auto",
                      help="torch's intra-op threads in each backend. auto (the default): on the CPU device, "
                           "torch's own count (the physical cores) less one core left to the frontend and the "
                           "server's threads (none left with --cpu_split, which gives the frontend a core of its "
                           "own), shared out among --instances, at least 1; on a GPU, or where OMP_NUM_THREADS or "
                           "MKL_NUM_THREADS is set, torch's own count")

    tune = parser.add_argument_group("measurement and limits")
    tune.add_argument("--verbose", action="store_true",
                      help="let torch's own warnings and compile messages from the frontend and backend through "
                           "(kept out of the terminal by default: they are about the environment, not the run)")
    tune.add_argument("--gpu_poll_ms", type=int, default=100,
                      help="period of the NVML utilisation, memory and power sampler (default 100)")
    tune.add_argument("--request_pool_size", type=int, default=4,
                      help="distinct batches pre-generated before timing; requests cycle through them, each "
                           "written into the transport afresh (default 4)")
    tune.add_argument("--max_queued_requests", type=int, default=None,
                      help="capacity of the request queue; the sender blocks when it is full, and that wait "
                           "counts in latency (default 16; with --max_batch_size, at least two full formed batches)")
    tune.add_argument("--max_inflight", type=int, default=8,
                      help="requests inside the backend at once, which bounds device memory (default 8)")
    tune.add_argument("--timeout_s", type=float, default=120.0,
                      help="seconds without any response after the warm-up before the run is declared hung "
                           "(default 120)")
    tune.add_argument("--warmup_timeout_s", type=float, default=1800.0,
                      help="seconds allowed for the warm-up response, which includes model build and compile "
                           "(default 1800)")
    # Test-only: plants an exception to prove that failures end the run promptly and are reported.
    tune.add_argument("--dist_timeout_s", type=float, default=300.0,
                      help="under torchrun: how long a rank waits for the others at the start barrier (after every "
                           "rank's warm-up) and when the results are gathered; a rank that is gone or later than "
                           "this fails the job instead of hanging it (default 300)")
    tune.add_argument("--inject_fault", default=None, choices=FAULT_STAGES, help=argparse.SUPPRESS)
    tune.add_argument("--inject_fault_rank", type=int, default=None, help=argparse.SUPPRESS)
    tune.add_argument("--inject_delay_ms", type=float, default=0.0, help=argparse.SUPPRESS)  # test-only: slow server


def _models():
    """models.py, imported when a flag needs it: it imports torch, which costs the server seconds per run."""
    from serverbench.backend import models

    return models


def _resolve_device(requested: str) -> str:
    if requested == "cpu":
        return "cpu"  # without importing torch: the server of a CPU run never needs it
    import torch

    from serverbench.device.layer import unusable_gpu_reason

    if requested != "auto" and requested != "cuda" and not requested.startswith("cuda:"):
        raise ConfigError(f"--device {requested!r}: expected auto, cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        # A GPU torch cannot use must not turn into CPU numbers without a word.
        reason = unusable_gpu_reason()
        if reason is not None:
            raise ConfigError(f"--device {requested}: {reason}")
        if requested == "auto":
            return "cpu"
        raise ConfigError(f"--device {requested}: no CUDA GPU is available on this machine")
    index_text = requested.partition(":")[2] or "0"
    if not index_text.isdigit():
        raise ConfigError(f"--device {requested}: expected cuda:N with N a GPU index")
    index = int(index_text)
    count = torch.cuda.device_count()
    if index >= count:
        raise ConfigError(f"--device {requested}: only {count} CUDA device(s) visible")
    return f"cuda:{index}"


def _rank_device(requested: str, rank: RankInfo) -> str:
    """Under torchrun each rank serves from its own device: cuda:LOCAL_RANK when the rank sees all the node's
    GPUs, cuda:0 when it sees exactly one (SLURM and Kubernetes give each rank its own CUDA_VISIBLE_DEVICES);
    or the CPU."""
    import torch

    if requested.startswith("cuda:"):
        raise ConfigError(f"--device {requested}: under torchrun each rank uses cuda:LOCAL_RANK; "
                          "pass --device cuda (or auto, or cpu)")
    if _resolve_device(requested) == "cpu":
        return "cpu"
    count = torch.cuda.device_count()
    if count == 1:
        if rank.local_world_size > 1 and "CUDA_VISIBLE_DEVICES" not in os.environ:
            # One GPU on the node for several ranks: they would share it, and each would time the others' work.
            raise ConfigError(f"{rank.local_world_size} ranks on this node but it has one GPU: they would share it; "
                              "start one rank per GPU (--nproc_per_node), or give each rank its own GPU with "
                              "CUDA_VISIBLE_DEVICES")
        return "cuda:0"
    if rank.local_rank < count:
        return f"cuda:{rank.local_rank}"
    raise ConfigError(f"rank {rank.rank} (LOCAL_RANK {rank.local_rank}): only {count} GPUs are visible to it; start "
                      f"at most {count} ranks per node (--nproc_per_node), or give each rank one GPU "
                      "(CUDA_VISIBLE_DEVICES)")


def _resolve_checkpoint(model: str, checkpoint: Optional[str], model_dir: str) -> Optional[str]:
    if checkpoint is not None:
        if model == IDENTITY_MODEL:
            raise ConfigError(f"--checkpoint: the {IDENTITY_MODEL} model has no weights to load")
        path = Path(checkpoint).expanduser()
        if not path.is_file():
            raise ConfigError(f"--checkpoint {checkpoint}: no such file")
        return str(path.resolve())
    folder = Path(model_dir).expanduser()
    if not folder.is_dir():
        raise ConfigError(f"--model_dir {model_dir}: no such folder")
    if model == IDENTITY_MODEL:
        return None
    for name in _models().checkpoint_filenames(model):
        if (folder / name).is_file():
            return str((folder / name).resolve())
    return None


def _check_results_dir(results_dir: str, output_file: str) -> tuple[str, str]:
    """The results folder exists (made if need be) and the row can be written there: checked before the run, so
    that a run's row is not lost at its end."""
    if not output_file or Path(output_file).name != output_file or output_file in (".", ".."):
        raise ConfigError(f"--output_file {output_file!r}: expected a plain file name inside --results_dir")
    folder = Path(results_dir).expanduser().resolve()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--results_dir {results_dir}: cannot create it ({exc.strerror})") from exc
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(f"--results_dir {results_dir}: not writable")
    path = folder / output_file
    if path.is_dir():
        raise ConfigError(f"--output_file {output_file}: {path} is a folder, not a CSV file")
    if path.exists() and not os.access(path, os.W_OK):
        raise ConfigError(f"--output_file {output_file}: {path} is not writable (read-only?); choose another "
                          "--output_file or make it writable")
    return str(folder), output_file


def _check_model_options(args: argparse.Namespace, device: str) -> None:
    if args.compile_mode != "default" and not args.compile:
        raise ConfigError(f"--compile_mode {args.compile_mode}: applies with --compile only")
    if device.startswith("cuda") and args.compile and args.compile_mode in CUDAGRAPH_COMPILE_MODES \
            and args.design != "serial":
        # CUDA graph trees keep per-thread state: a graph captured on the compiling thread and replayed from
        # serving threads fails or corrupts (pytorch/pytorch#123177).
        raise ConfigError(f"--compile_mode {args.compile_mode} captures CUDA graphs, which are not safe across the "
                          f"{args.design} design's threads; use --design serial, or --compile_mode "
                          "max-autotune-no-cudagraphs")
    if device == "cpu" and args.precision == "tf32":
        raise ConfigError("--precision tf32: TF32 is a CUDA tensor-core format; use fp32 or bf16 on the CPU")


def _available_memory_bytes() -> Optional[int]:
    """Memory the kernel can give without swapping (MemAvailable), else all of RAM; None where neither is known."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _free_bytes(folder: str) -> Optional[int]:
    try:
        stat = os.statvfs(folder)
    except OSError:
        return None
    return stat.f_bavail * stat.f_frsize


def _open_files_limit() -> Optional[int]:
    import resource

    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else soft


SHM_FOLDER = "/dev/shm"
BASE_OPEN_FILES = 256  # what the three processes, torch and the queues hold before any request
RESULTS_BYTES_PER_REQUEST = {"save_requests": 1024, "trace": 2048}  # detail files, generously


def _gib(n_bytes: float) -> str:
    return f"{n_bytes / 2**30:.2f} GiB" if n_bytes >= 2**28 else f"{n_bytes / 2**20:.1f} MiB"


def _check_resources(args: argparse.Namespace) -> None:
    """Memory, shared memory, open files and disk space the run needs, against what this machine has now:
    ConfigError with what is needed, what is there and what makes it fit, before any process starts."""
    one_request = request_bytes(args.batch_size, args.image_size, args.wire_dtype)
    pool_bytes = one_request * args.request_pool_size
    if args.transport == "shm":
        shm_bytes, shm_what = one_request * args.ring_slots, f"the ring (--ring_slots {args.ring_slots})"
        shm_flag = "--ring_slots"
    else:  # every request in transit is a fresh segment: those queued and those the backend holds
        in_transit = args.max_queued_requests + args.max_inflight
        shm_bytes = one_request * in_transit
        shm_what = f"requests in transit (--max_queued_requests + --max_inflight = {in_transit})"
        shm_flag = "--max_queued_requests"
    available = _available_memory_bytes()
    if available is not None and pool_bytes + shm_bytes > available:
        raise ConfigError(f"--batch_size {args.batch_size} x --image_size {args.image_size}: the request pool and "
                          f"{shm_what} need {_gib(pool_bytes + shm_bytes)}, more than the {_gib(available)} of memory "
                          f"available now; lower --batch_size, --image_size, --request_pool_size or {shm_flag}")
    shm_free = _free_bytes(SHM_FOLDER) if os.path.isdir(SHM_FOLDER) else None
    if shm_free is not None and shm_bytes > shm_free:
        raise ConfigError(f"{shm_what} need {_gib(shm_bytes)} of shared memory, and {SHM_FOLDER} has "
                          f"{_gib(shm_free)} free; lower {shm_flag} or --batch_size, or enlarge {SHM_FOLDER} "
                          "(docker run --shm-size)")
    limit = _open_files_limit()
    files_needed = BASE_OPEN_FILES + (args.max_queued_requests + args.max_inflight if args.transport == "queue"
                                      else 0)  # each queued request's segment travels as a file descriptor
    if limit is not None and files_needed > limit:
        raise ConfigError(f"--transport queue with --max_queued_requests {args.max_queued_requests}: about "
                          f"{files_needed} open files are needed and the limit is {limit}; lower "
                          "--max_queued_requests, or raise the limit (ulimit -n)")
    results_bytes = 1 << 20  # the row, its lock, the summary
    results_bytes += sum(per_request * (args.num_iters + args.warmup_iters)
                         for flag, per_request in RESULTS_BYTES_PER_REQUEST.items() if getattr(args, flag))
    folder = Path(args.results_dir).expanduser()
    while not folder.exists() and folder != folder.parent:  # the nearest folder that exists: where it will go
        folder = folder.parent
    disk_free = _free_bytes(str(folder))
    if disk_free is not None and results_bytes > disk_free:
        raise ConfigError(f"--results_dir {args.results_dir}: the results need about {_gib(results_bytes)} and the "
                          f"disk has {_gib(disk_free)} free; free some space or choose another --results_dir")


def _check_windows(args: argparse.Namespace, rank: Optional[RankInfo], at_least, at_most) -> None:
    if args.stability_pct is None:
        for flag, default in WINDOW_DEFAULTS.items():
            if getattr(args, flag) != default:
                raise ConfigError(f"--{flag} applies with --stability_pct only")
        return
    if not 0 < args.stability_pct <= 100:
        raise ConfigError(f"--stability_pct {args.stability_pct:g}: must be above 0 and at most 100 (a percentage)")
    if not args.window_s > 0:
        raise ConfigError(f"--window_s {args.window_s:g}: must be positive")
    at_most("window_s", args.window_s, MAX_SECONDS, "7 days")
    at_least("window_requests", args.window_requests, 1)
    at_least("max_windows", args.max_windows, STABLE_WINDOWS)
    at_most("max_windows", args.max_windows, MAX_WINDOWS, "a run that never settles is not going to")
    if rank is not None:
        raise ConfigError("--stability_pct under torchrun: each rank would end its measured phase on its own "
                          "windows, and their rows would not cover the same time; use --num_iters or --duration_s")


MAX_BATCH_IMAGES = 1 << 16
MAX_QUEUE_DELAY_MS = 60_000.0
DEFAULT_RING_SLOTS = 4  # at least; small requests get more, up to RING_DEFAULT_BYTES of ring
MAX_DEFAULT_RING_SLOTS = 64
RING_DEFAULT_BYTES = 64 << 20
MAX_RING_SLOTS = 8192  # x 100 bytes per header: within Linux's default largest pipe (1 MiB)
DEFAULT_MAX_QUEUED_REQUESTS = 16


def default_ring_slots(args: argparse.Namespace) -> int:
    """As many slots as fit RING_DEFAULT_BYTES, between 4 and 64: a few large requests fill a ring of 4, while
    one-image requests get room for the frontend to write ahead instead of waiting for each slot to come back."""
    one_request = request_bytes(args.batch_size, args.image_size, args.wire_dtype)
    return max(DEFAULT_RING_SLOTS, min(MAX_DEFAULT_RING_SLOTS, RING_DEFAULT_BYTES // max(one_request, 1)))


def _resolve_batching(args: argparse.Namespace, at_most) -> argparse.Namespace:
    """Checks the dynamic-batching flags and resolves the transport bounds that depend on them: a formed batch
    gathers up to max_batch_size // batch_size requests, and the ring (or the request queue) must hold two such
    batches, one being formed while the previous one's requests are still on their way to the device."""
    resolved = argparse.Namespace(**vars(args))
    per_batch = 1
    if args.max_batch_size is not None:
        if not args.max_batch_size > args.batch_size:
            raise ConfigError(f"--max_batch_size {args.max_batch_size}: must be more than --batch_size "
                              f"{args.batch_size} (the images of one request), or there is nothing to batch")
        at_most("max_batch_size", args.max_batch_size, MAX_BATCH_IMAGES, "images in one forward")
        delay_ms = 0.0 if args.max_queue_delay_ms is None else args.max_queue_delay_ms
        if not 0 <= delay_ms <= MAX_QUEUE_DELAY_MS:
            raise ConfigError(f"--max_queue_delay_ms {delay_ms:g}: must be between 0 and {MAX_QUEUE_DELAY_MS:g}")
        resolved.max_queue_delay_ms = delay_ms
        per_batch = args.max_batch_size // args.batch_size
        if 2 * per_batch > MAX_RING_SLOTS:
            raise ConfigError(f"--max_batch_size {args.max_batch_size}: a formed batch of {per_batch} requests of "
                              f"{args.batch_size} image(s); at most {MAX_RING_SLOTS // 2} requests can be batched")
    elif args.max_queue_delay_ms is not None:
        raise ConfigError("--max_queue_delay_ms applies with --max_batch_size only")
    else:
        resolved.max_queue_delay_ms = 0.0
    if args.ring_slots is None:
        resolved.ring_slots = max(default_ring_slots(args), 2 * per_batch)
    elif args.max_batch_size is not None and args.transport == "shm" and args.ring_slots < per_batch:
        raise ConfigError(f"--ring_slots {args.ring_slots}: a formed batch of --max_batch_size {args.max_batch_size} "
                          f"gathers {per_batch} requests, each holding a slot; give at least {per_batch} "
                          f"(default {2 * per_batch})")
    if args.max_queued_requests is None:
        resolved.max_queued_requests = max(DEFAULT_MAX_QUEUED_REQUESTS, 2 * per_batch)
    elif args.max_batch_size is not None and args.transport == "queue" and args.max_queued_requests < per_batch:
        raise ConfigError(f"--max_queued_requests {args.max_queued_requests}: a formed batch of --max_batch_size "
                          f"{args.max_batch_size} gathers {per_batch} requests from the queue; give at least "
                          f"{per_batch} (default {2 * per_batch})")
    return resolved


def build_config(args: argparse.Namespace, rank: Optional[RankInfo] = None) -> BenchConfig:
    """Validates every flag and resolves device, checkpoint and paths; raises ConfigError. Under torchrun,
    `rank` gives this rank's device (cuda:LOCAL_RANK or the CPU) and seed (--seed + rank)."""
    def at_least(name: str, value: float, low: float) -> None:
        if not value >= low:  # NaN fails too
            raise ConfigError(f"--{name} {value}: must be at least {low}")

    def at_most(name: str, value: float, high: float, why: str) -> None:
        # Finite and bounded: an inf or a huge value passes every comparison above, then overflows a timestamp,
        # a semaphore or a seed in the middle of the run.
        if not value <= high:
            shown = (f"{value:g}", f"{high:g}") if isinstance(value, float) else (str(value), str(high))
            raise ConfigError(f"--{name} {shown[0]}: must be at most {shown[1]} ({why})")

    at_least("num_iters", args.num_iters, 1)
    at_least("batch_size", args.batch_size, 1)
    args = _resolve_batching(args, at_most)
    at_least("image_size", args.image_size, 1)
    at_least("gpu_poll_ms", args.gpu_poll_ms, 1)
    at_least("request_pool_size", args.request_pool_size, 1)
    at_least("max_queued_requests", args.max_queued_requests, 1)
    at_most("max_queued_requests", args.max_queued_requests, SEM_VALUE_MAX, "the largest semaphore count")
    at_least("seed", args.seed, 0)
    at_most("seed", args.seed, MAX_SEED, "seeds are 64-bit")
    at_least("max_inflight", args.max_inflight, 1)
    at_least("ring_slots", args.ring_slots, 1)
    at_most("ring_slots", args.ring_slots, MAX_RING_SLOTS, "every slot's header must fit one pipe's buffer")
    if not args.timeout_s > 0 or not args.warmup_timeout_s > 0 or not args.dist_timeout_s > 0:
        raise ConfigError("--timeout_s, --warmup_timeout_s and --dist_timeout_s must be positive")
    for name in ("timeout_s", "warmup_timeout_s", "dist_timeout_s"):
        at_most(name, getattr(args, name), MAX_SECONDS, "7 days; a run that long is hung")
    if not args.results_dir:
        raise ConfigError("--results_dir '': give a folder (the default is results)")
    at_least("instances", args.instances, 1)
    at_most("instances", args.instances, MAX_INSTANCES, "each is a process with its own model")
    if rank is not None and args.instances != 1:
        raise ConfigError(f"--instances {args.instances} under torchrun: each rank already runs its own backend on "
                          "its own GPU, and the job's rows sum and merge per rank; run --instances without torchrun")
    if args.inject_fault == "instance_exit" and args.instances < 2:
        raise ConfigError("--inject_fault instance_exit makes backend instance 1 exit: needs --instances 2 or more")
    if rank is not None and args.find_peak:
        raise ConfigError("--find_peak under torchrun: each rank would search its own rates; search on one GPU, "
                          "then run the job at the rate found (--load poisson --rate R)")

    if args.num_workers is None:
        num_workers = 2 if args.design == "pipelined" else 1
    else:
        num_workers = args.num_workers
        at_least("num_workers", num_workers, 1)
        if args.design != "pipelined" and num_workers != 1:
            raise ConfigError(f"--num_workers {num_workers}: the {args.design} design has exactly one "
                              "prediction worker; use --design pipelined for several")

    at_least("repeat", args.repeat, 0)
    at_least("warmup_iters", args.warmup_iters, 1)
    at_least("peak_steps", args.peak_steps, 1)
    at_least("load_poll_ms", args.load_poll_ms, 1)
    if not args.duration_s >= 0 or not args.inject_delay_ms >= 0:
        raise ConfigError(f"--duration_s {args.duration_s}: must not be negative (a number of seconds)")
    at_most("duration_s", args.duration_s, MAX_SECONDS, "7 days")
    if args.load == "closed":
        if args.concurrency is None:
            raise ConfigError("--load closed needs --concurrency N")
        at_least("concurrency", args.concurrency, 1)
    elif args.concurrency is not None:
        raise ConfigError("--concurrency applies to --load closed only")
    if args.load == "poisson" or args.find_peak:
        if args.rate_rps is None and not args.find_peak:
            raise ConfigError("--load poisson needs --rate R (requests per second)")
        if args.rate_rps is not None and not args.rate_rps > 0:
            raise ConfigError(f"--rate {args.rate_rps:g}: must be positive")
        if args.rate_rps is not None:
            at_most("rate", args.rate_rps, MAX_RATE_RPS, "a request every microsecond")
        if not MIN_BURSTINESS <= args.burstiness <= MAX_BURSTINESS:
            raise ConfigError(f"--burstiness {args.burstiness:g}: must be between {MIN_BURSTINESS:g} (very bursty) "
                              f"and {MAX_BURSTINESS:g} (nearly regular)")
    elif args.rate_rps is not None:
        raise ConfigError("--rate applies to --load poisson only")
    elif args.burstiness != 1.0:
        raise ConfigError(f"--burstiness applies to --load poisson only (this run is --load {args.load})")
    if args.find_peak and (args.rate_rps is not None or args.load == "closed"):
        raise ConfigError("--find_peak searches the rate itself with Poisson runs: drop "
                          + ("--rate" if args.rate_rps is not None else "--load closed"))
    if args.find_peak and args.slo_ms is None:
        raise ConfigError("--find_peak needs --slo_ms, the p99 target the peak rate must meet")
    _check_windows(args, rank, at_least, at_most)
    if args.intra_op_threads is not None:
        at_least("intra_op_threads", args.intra_op_threads, 1)
        at_most("intra_op_threads", args.intra_op_threads, MAX_INTRA_OP_THREADS, "more threads than any machine has")
    if not 0 < args.ceiling_s <= MAX_CEILING_S:
        raise ConfigError(f"--ceiling_s {args.ceiling_s:g}: must be positive and at most {MAX_CEILING_S:g}")
    if args.slo_ms is not None and not args.slo_ms > 0:
        raise ConfigError(f"--slo_ms {args.slo_ms}: must be positive")
    experiment = args.experiment or (f"pipelined_{num_workers}w" if args.design == "pipelined" else args.design)
    if args.experiment is None and args.instances > 1:  # a report must not pool them with one-instance runs
        experiment += f"_{args.instances}inst"
    if not experiment.replace("_", "").replace("-", "").replace(".", "").isalnum():
        raise ConfigError(f"--experiment {experiment!r}: use letters, digits, '_', '-' and '.' only")

    # torch and torchvision only for a real model: a server of the identity model on the CPU never imports them.
    real_model = args.model != IDENTITY_MODEL
    if real_model and not _models().is_known_model(args.model):
        raise ConfigError(f"--model {args.model!r}: not a torchvision classification model nor '{IDENTITY_MODEL}'")
    _check_resources(args)  # before a forward at that size is tried, even on the meta device
    try:
        if real_model:
            _models().check_image_size(args.model, args.image_size)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None

    device = _resolve_device(args.device) if rank is None else _rank_device(args.device, rank)
    _check_model_options(args, device)
    checkpoint = _resolve_checkpoint(args.model, args.checkpoint, args.model_dir)
    if checkpoint is not None:
        try:
            _models().check_checkpoint(args.model, checkpoint)
        except ValueError as exc:
            raise ConfigError(str(exc).splitlines()[0][:600]) from None
    results_dir, output_file = _check_results_dir(args.results_dir, args.output_file)

    return BenchConfig(
        num_iters=args.num_iters,
        batch_size=args.batch_size,
        model_dir=str(Path(args.model_dir).expanduser().resolve()),
        compile=args.compile,
        output_file=output_file,
        profile=args.profile,
        num_workers=num_workers,
        device=device,
        design=args.design,
        model=args.model,
        image_size=args.image_size,
        seed=args.seed + (rank.rank if rank else 0),  # each rank its own images
        checkpoint=checkpoint,
        results_dir=results_dir,
        gpu_poll_ms=args.gpu_poll_ms,
        request_pool_size=args.request_pool_size,
        max_queued_requests=args.max_queued_requests,
        max_inflight=args.max_inflight,
        timeout_s=args.timeout_s,
        warmup_timeout_s=args.warmup_timeout_s,
        experiment=experiment,
        repeat=args.repeat,
        save_requests=args.save_requests,
        trace=args.trace,
        load=args.load,
        concurrency=args.concurrency,
        rate_rps=args.rate_rps,
        burstiness=args.burstiness,
        duration_s=args.duration_s,
        warmup_iters=args.warmup_iters,
        slo_ms=args.slo_ms,
        find_peak=args.find_peak,
        peak_steps=args.peak_steps,
        load_poll_ms=args.load_poll_ms,
        verify=args.verify,
        transport=args.transport,
        ring_slots=args.ring_slots,
        wire_dtype=args.wire_dtype,
        precision=args.precision,
        channels_last=args.channels_last,
        compile_mode=args.compile_mode,
        compile_decode=args.compile if args.compile_decode is None else args.compile_decode,
        spin_wait=args.spin_wait,
        cpu_split=args.cpu_split,
        intra_op_threads=args.intra_op_threads,
        verbose=args.verbose,
        ceiling=args.ceiling,
        tune_malloc=args.tune_malloc,
        ceiling_s=args.ceiling_s,
        stability_pct=args.stability_pct,
        window_s=args.window_s,
        window_requests=args.window_requests,
        max_windows=args.max_windows,
        max_batch_size=args.max_batch_size,
        max_queue_delay_ms=args.max_queue_delay_ms,
        inject_delay_ms=args.inject_delay_ms,
        rank=rank,
        dist_timeout_s=args.dist_timeout_s,
        # Test-only: under torchrun the fault may be planted on one rank alone.
        inject_fault=args.inject_fault if args.inject_fault_rank in (None, rank.rank if rank else 0) else None,
        instances=args.instances,
    )
