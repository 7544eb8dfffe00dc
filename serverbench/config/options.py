"""The one frozen configuration of a run, and its command line: each flag is defined once, in the metadata of the
BenchConfig field it fills, and add_cli_args makes the argparse groups from those fields.

build.py turns the parsed flags into a BenchConfig (checks that need nothing but the flags); preflight.py checks it
against this machine and resolves the device and the paths. Every invalid value raises ConfigError with one readable
line; server.py turns it into exit status 2 before any process starts.
"""

from __future__ import annotations

import argparse
import dataclasses
from _multiprocessing import SemLock
from dataclasses import dataclass
from pathlib import Path

from serverbench.config.flags import add_flags, count_or_auto, flag
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
FAULT_STAGES = (
    "frontend",
    "backend_start",
    "h2d",
    "predict",
    "d2h",
    "hang",
    "oom",
    "oom_build",
    "early_reuse",
    "server",
    "sticky_cuda",
    "instance_exit",
)
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
MAX_BATCH_IMAGES = 1 << 16
MAX_QUEUE_DELAY_MS = 60_000.0
MAX_RING_SLOTS = 8192  # x 100 bytes per header: within Linux's default largest pipe (1 MiB)


CEILING_S_DEFAULT = 1.0  # seconds of forwards per concurrency and phase
IDENTITY_MODEL = "identity"  # --model: a per-sample sum instead of a network, the server's own cost


@dataclass(frozen=True)
class BenchConfig:
    # Fields in the order of --help. Reference flags, same names and meanings.
    num_iters: int = flag(
        "ref",
        "measured requests, after the --warmup_iters warm-up requests (default 100)",
        default=100,
        type=int,
        at_least=1,
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
        "torch.compile the model; compiled and warmed up once on one thread at the served "
        "shape before serving starts. Off by default: compiling takes minutes on a CPU",
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
        "ref", "prediction threads, each on its own stream (pipelined design only; default 2)", type=int, at_least=1
    )
    # Additions.
    design: str = flag(
        "run",
        "serial: one loop does get, H2D, forward, D2H, put; threaded: a one-worker thread pool "
        "runs H2D, forward and respond while the loop keeps polling; pipelined: an H2D thread, "
        "--num_workers prediction threads and a D2H thread, each on its own stream "
        "(default pipelined)",
        default="pipelined",
        choices=DESIGNS,
    )
    # As requested (auto, cpu, cuda, cuda:N) until preflight resolves it to "cpu" or "cuda:N".
    device: str = flag(
        "run", "auto (CUDA when available, else CPU), cpu, cuda or cuda:N (default auto)", default="auto"
    )
    model: str = flag(
        "run",
        "a torchvision classification model name, randomly initialised unless a checkpoint "
        f"is found; or '{IDENTITY_MODEL}' (a per-sample sum: the cost of the server alone) "
        "(default resnet18)",
        default="resnet18",
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
    repeat: int = flag("out", "repetition index, recorded in the row (default 0)", default=0, type=int, at_least=0)
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

    # burst (all at once), closed (at most `concurrency` outstanding), poisson (open loop at `rate_rps`)
    load: str = flag(
        "load",
        "burst: all requests at once after the warm-up; closed: at most --concurrency "
        "outstanding, a new one sent as each response arrives; poisson: open loop at --rate, "
        "latency measured from each request's intended send time (default burst)",
        default="burst",
        choices=LOADS,
    )
    concurrency: int | None = flag("load", "closed loop: requests outstanding at once", type=int, at_least=1)
    rate_rps: float | None = flag(
        "load",
        "poisson: offered requests per second; the schedule is drawn up front from --seed",
        name="rate",
        type=float,
        at_most=MAX_RATE_RPS,
        why="a request every microsecond",
    )
    burstiness: float = flag(
        "load",
        "poisson: gamma shape of the gaps between requests; 1.0 is Poisson, below 1 "
        "burstier, above 1 more regular (default 1.0)",
        default=1.0,
        type=float,
    )
    # 0: no minimum
    duration_s: float = flag(
        "load",
        "the measured phase ends once it has lasted this long and --num_iters requests "
        "were sent, whichever comes later (default 0: the count alone)",
        default=0.0,
        type=float,
        at_most=MAX_SECONDS,
        why="7 days",
    )
    warmup_iters: int = flag(
        "load",
        "warm-up requests, sent one at a time and excluded from every statistic; the "
        "first one's latency is warmup_latency (default 1)",
        default=1,
        type=int,
        at_least=1,
    )
    slo_ms: float | None = flag(
        "load",
        "latency target: the row gets the fraction of requests within it, the "
        "goodput (samples/s within it) and whether p99 met it",
        type=float,
    )
    find_peak: bool = flag(
        "load",
        "search (bisection, --peak_steps Poisson runs after one burst run) for the highest "
        "rate whose p99 latency stays within --slo_ms; each run is a row, the result goes "
        "to peak.csv",
        default=False,
        action="store_true",
    )
    peak_steps: int = flag("load", "bisection steps of --find_peak (default 6)", default=6, type=int, at_least=1)
    # None: off; else the measured phase goes on until its last 3 windows agree
    stability_pct: float | None = flag(
        "load",
        "stability windows (perf_analyzer's): the measured phase is cut into windows and goes on until the "
        "last 3 windows' throughputs and p99 latencies are each within this %% of their mean, or "
        "--max_windows; the row reports those 3 windows (windows, stable, window_throughput_cv_pct). "
        "Replaces --num_iters and --duration_s (default off: the reference's fixed count)",
        type=float,
    )
    window_s: float = flag(
        "load",
        "with --stability_pct: a window lasts at least this many seconds (default 1.0)",
        default=WINDOW_DEFAULTS["window_s"],
        type=float,
        at_most=MAX_SECONDS,
        why="7 days",
    )
    window_requests: int = flag(
        "load",
        "with --stability_pct: and holds at least this many responses, so that its "
        "p99 is not just its maximum (default 30)",
        default=WINDOW_DEFAULTS["window_requests"],
        type=int,
        at_least=1,
    )
    max_windows: int = flag(
        "load",
        "with --stability_pct: end the measured phase after this many windows even if it "
        "is not stable; the row says stable=False (default 12)",
        default=WINDOW_DEFAULTS["max_windows"],
        type=int,
        at_least=STABLE_WINDOWS,
        at_most=MAX_WINDOWS,
        why="a run that never settles is not going to",
    )
    load_poll_ms: int = flag(
        "load",
        "period of the sampler of requests in flight and request-queue depth (default 50)",
        default=50,
        type=int,
        at_least=1,
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

    transport: str = flag(
        "perf",
        "shm: a ring of --ring_slots shared-memory slots made once before the processes "
        "start (page-locked once on CUDA); each request is written into a free slot and "
        "only a small header crosses the queue; the slot is handed back once its bytes are "
        "on the device. queue: the reference's tensors through multiprocessing queues, a "
        "fresh shared-memory segment per request, pinned again on arrival (default shm)",
        default="shm",
        choices=TRANSPORTS,
    )
    ring_slots: int = flag(
        "perf",
        "shm: slots in the ring; the sender waits for a free one, and that wait counts in "
        "latency (default: as many as fit 64 MiB, 4 to 64; with --max_batch_size, at least "
        "two full formed batches)",
        type=int,
        at_least=1,
        at_most=MAX_RING_SLOTS,
        why="every slot's header must fit one pipe's buffer",
    )
    wire_dtype: str = flag(
        "perf",
        "float32: normalised images, as the reference; uint8: raw pixels, a quarter of the "
        "bytes, converted and normalised on the device inside the timed H2D step (default "
        "float32)",
        default="float32",
        choices=WIRE_DTYPES,
    )
    precision: str = flag(
        "perf",
        "default: float32 with PyTorch's own TF32 flags left as they are (cuDNN "
        "convolutions in TF32, matmuls in IEEE float32), as the reference ran; fp32: strict "
        "IEEE float32 (TF32 off everywhere); tf32: TF32 matmuls and convolutions; bf16 or "
        "fp16: model and input cast, outputs returned as float32. The row records the "
        "effective flags (default default)",
        default="default",
        choices=PRECISIONS,
    )
    channels_last: bool = flag(
        "perf", "model weights and inputs in channels-last (NHWC) memory layout", default=False, action="store_true"
    )
    compile_mode: str = flag(
        "perf",
        "torch.compile mode with --compile. max-autotune and reduce-overhead capture "
        "CUDA graphs, which are not safe across threads: on CUDA they need --design "
        "serial (the model then runs on the thread that compiled it) (default: default)",
        default="default",
        choices=COMPILE_MODES,
    )
    # Follows --compile unless given.
    compile_decode: bool = flag(
        "perf",
        "torch.compile the decoding of wire bytes into model input (uint8 conversion "
        "and normalisation, cast, layout) into one fused pass; on a CPU eager "
        "decoding takes three passes. Compiled once before serving, like the model "
        "(default: as --compile)",
        action=argparse.BooleanOptionalAction,
    )
    ceiling: bool = flag(
        "perf",
        "also time the model alone on inputs already on the device, same batch, precision "
        "and layout, at the design's concurrency (serial, threaded: one forward at a time; "
        "pipelined: 1 to --num_workers threads, each on its own stream, the best), before "
        "and after serving: the row gets ceiling_throughput (the faster phase), "
        "ceiling_concurrency, ceiling_spread_pct and, for burst and closed loads, efficiency "
        "= throughput / ceiling_throughput (default on)",
        default=True,
        action=argparse.BooleanOptionalAction,
    )
    tune_malloc: bool = flag(
        "perf",
        "the backend's glibc malloc serves every allocation from its heap and keeps what "
        "is freed (mallopt M_MMAP_MAX 0, M_TRIM_THRESHOLD at its largest), as PyTorch's "
        "CPU tuning guide suggests jemalloc or tcmalloc for: otherwise a forward's large "
        "activations are mapped and unmapped, page faults each time, at a cost that "
        "changes from one process to the next. The row's malloc_tuned says whether it "
        "took (glibc only) (default on)",
        default=True,
        action=argparse.BooleanOptionalAction,
    )
    ceiling_s: float = flag(
        "perf",
        "seconds of forwards the ceiling times at each concurrency, before serving and "
        "again after, in 5 loops of at least 3 forwards per thread (default 1.0)",
        default=CEILING_S_DEFAULT,
        type=float,
    )

    # None: every request is its own forward.
    max_batch_size: int | None = flag(
        "batch",
        "images in one formed batch at most (more than --batch_size, the images per request); whole requests "
        "only. With --compile, formed batches are padded to sizes compiled at warm-up (powers of two up to "
        "this). Default: off, every request is its own forward",
        type=int,
        at_most=MAX_BATCH_IMAGES,
        why="images in one forward",
    )
    max_queue_delay_ms: float = flag(
        "batch",
        "with --max_batch_size: a formed batch goes once this long has passed "
        "since its oldest request arrived, full or not (default 0: only what "
        "is already waiting is batched, no request waits for another)",
        type=float,
    )

    spin_wait: bool = flag(
        "perf",
        "CUDA: the H2D and D2H threads busy-wait for their copies (events without "
        "blocking sync, a CPU core each), as the reference's events did; by default they "
        "sleep until the GPU signals. For comparison; no effect on the CPU",
        default=False,
        action="store_true",
    )
    cpu_split: bool = flag(
        "perf",
        "CPU device: the frontend (the clients' stand-in) runs on one core of its own and "
        "the model on the others, with that many intra-op threads, so that sending and "
        "receiving never stall a forward's threads (with one CPU they share it). Default "
        "off: every process on every core, the model with --intra_op_threads of them. No "
        "effect on a GPU",
        default=False,
        action=argparse.BooleanOptionalAction,
    )
    # None: auto, the backend decides (CPU: the cores shared among the forwards that run at once).
    intra_op_threads: int | None = flag(
        "perf",
        "torch's intra-op threads in each backend. auto (the default): on the CPU device, torch's own count "
        "(the physical cores; with --cpu_split, those left once the frontend has its own) shared out among the "
        "forwards that run at once (--instances x pipelined's --num_workers), at least 1; on a GPU, or where "
        "OMP_NUM_THREADS or MKL_NUM_THREADS is set, torch's own count",
        type=count_or_auto,
        metavar="N|auto",
        at_least=1,
        at_most=MAX_INTRA_OP_THREADS,
        why="more threads than any machine has",
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
        "seconds without any response after the warm-up before the run is declared hung (default 120)",
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


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """BenchConfig's flags, in field order, each in its group."""
    add_flags(parser, BenchConfig)


def request_bytes(batch_size: int, image_size: int, wire_dtype: str) -> int:
    """Bytes of one request's batch on the wire."""
    return batch_size * 3 * image_size**2 * (1 if wire_dtype == "uint8" else 4)


CPU_BATCHING_TOLERANCE = 1e-4  # a formed batch's rows may differ from the request's own answer in the last bits


def verify_tolerance(device: str, precision: str, batching: bool = False) -> float:
    """--verify's largest absolute difference from the serial answer that still counts as right. On the CPU a
    request alone gives the same bits every time; in a formed batch (dynamic batching) the kernels block the work
    by the batch's size, and its rows differ from the request's own answer by rounding (2e-6 seen on resnet18),
    far below what a request answered with another's rows would show."""
    if not device.startswith("cuda"):
        return CPU_BATCHING_TOLERANCE if batching else 0.0
    return {"fp32": 1e-3, "default": 1e-2, "tf32": 1e-2}.get(precision, 5e-2)
