"""The choices and bounds of the configuration's flags: shared by the option modules, the checks in build.py and
preflight.py, and the tools that list a flag's choices."""

from __future__ import annotations

from _multiprocessing import SemLock

SCENARIOS = ("SingleStream", "MultiStream", "Server", "Offline")  # --load loadgen: MLPerf LoadGen's scenarios
LOADGEN_MODULE = "mlperf_loadgen"  # MLPerf LoadGen's Python module (package mlcommons-loadgen)
AOTI_CACHE_FOLDER = "aoti_cache"  # under --results_dir: --aoti's packages, by a hash of what was compiled
LOADGEN_RATE_SCENARIOS = ("Server", "Offline")  # --rate is their target (Server) or expected (Offline) QPS
LOADGEN_SAMPLES_PER_QUERY = 8  # LoadGen's own MultiStream default, when --concurrency is not given
DOORS = ("process", "inline")  # where the network front door runs
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


POLL_S = 0.1  # how often every blocked wait (transport, backend, LoadGen's driver) looks at its stop condition
MAX_CEILING_S = 600.0  # per concurrency and phase: ten minutes of forwards time any model well
MAX_INTRA_OP_THREADS = 4096  # a bound, so that a typo cannot ask torch for millions of threads
MAX_WINDOWS = 10_000
WINDOW_DEFAULTS = {"window_s": 1.0, "window_requests": 30, "max_windows": 12}  # apply with --stability_pct only
MAX_SECONDS = 7 * 24 * 3600.0  # timeouts and durations: longer than any run, short enough for every clock API
MAX_RATE_RPS = 1e6
# A trace's arrivals (they travel in the config to each frontend) or a Poisson schedule (drawn whole, up front)
MAX_SCHEDULED_REQUESTS = 10_000_000
MIN_RATE_RPS = 1.0 / MAX_SECONDS  # a request every 7 days: longer gaps overflow the clocks' arithmetic
MIN_BURSTINESS, MAX_BURSTINESS = 1e-3, 1e3  # gamma shapes whose gaps stay finite and non-zero
MAX_SEED = 2**63 - 1 - 4096  # a 64-bit seed, with room for --seed + RANK
SEM_VALUE_MAX = SemLock.SEM_VALUE_MAX  # the largest count a semaphore (a multiprocessing queue's bound) holds here
MAX_BATCH_IMAGES = 1 << 16
MAX_QUEUE_DELAY_MS = 60_000.0
MAX_REPEATS = 10_000  # runs of one configuration (sweeps, bench tools) and --repeat's index: a lifetime's worth
# bench.commits' runs of each side (sweep.py's default too), and the pairs of a bench.resolution trial: on the 2-core VM
# 10 pairs detected a planted 5 % in 83 % of trials for resnet18, 7 pairs in 62 % (results/resolution)
AB_DEFAULT_REPEATS = 10
MAX_BODY_MB = 16384.0  # the door reads a request body whole
MAX_RING_SLOTS = 8192  # x 100 bytes per header: within Linux's default largest pipe (1 MiB)


CEILING_S_DEFAULT = 1.0  # seconds of forwards per concurrency and phase
IDENTITY_MODEL = "identity"  # --model: a per-sample sum instead of a network, the server's own cost
MAX_INSTANCES = 64  # each is a process with its own model (and CUDA context, several hundred MiB on a GPU)
MAX_WORKERS = 1024  # prediction threads, each with its own model copy or compiled callable: beyond any device's use
MAX_GENERATORS = 64  # each is a frontend process, a client of the door of its own
INSTANCE_EXIT_STATUS = 3  # test-only --inject_fault instance_exit: the status the instance leaves with
STABLE_WINDOWS = 3  # windows judged together, and reported together
