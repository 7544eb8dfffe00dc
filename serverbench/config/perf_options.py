"""The transport, model-side and dynamic-batching groups of BenchConfig's flags: what the server moves and how the
model runs."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from serverbench.config.flags import count_or_auto, flag
from serverbench.config.limits import (
    CEILING_S_DEFAULT,
    COMPILE_MODES,
    MAX_BATCH_IMAGES,
    MAX_INTRA_OP_THREADS,
    MAX_RING_SLOTS,
    MAX_SECONDS,
    PRECISIONS,
    WIRE_DTYPES,
)
from serverbench.config.transport_kinds import DEFAULT_TRANSPORT, TRANSPORTS
from serverbench.config.transport_kinds import help_text as transports_help


@dataclass(frozen=True)
class PerfOptions:
    transport: str = flag("perf", transports_help(), default=DEFAULT_TRANSPORT.name, choices=TRANSPORTS)
    ring_slots: int = flag(  # None only for a .pt2 program without --input, until preflight
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
    aoti: bool = flag(
        "perf",
        "serve the model through AOTInductor instead of eager or torch.compile: torch.export, then "
        "aoti_compile_and_package once before serving (the time in m_compile_time; the package cached under "
        "<results_dir>/aoti_cache by a hash of the exported program, inputs, precision, device and torch version, so "
        "a sweep compiles once), loaded with max(prediction threads, --max_inflight) runners. Needs a C++ compiler. "
        "Not with --compile",
        default=False,
        action="store_true",
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
    planted_delay_us: float = flag(
        "perf",
        "busy-wait this many microseconds on the prediction thread after each forward (a loop on the monotonic "
        "clock, not a sleep): a known slowdown, which bench.resolution plants to measure how small a difference "
        "the A/B verdicts can tell. Serial design on the CPU device only: the wait holds the GIL, and on a GPU "
        "the forward runs on while the host waits (default 0: none)",
        default=0.0,
        type=float,
        at_least=0,
        at_most=MAX_SECONDS * 1e6,
        why="7 days",
    )
