"""The load group of BenchConfig's flags: what traffic the frontend sends, for how long, and when the measured phase
is stable enough to stop."""

from __future__ import annotations

from dataclasses import dataclass

from serverbench.config.flags import flag
from serverbench.config.limits import (
    MAX_GENERATORS,
    MAX_RATE_RPS,
    MAX_SECONDS,
    MAX_WINDOWS,
    SCENARIOS,
    STABLE_WINDOWS,
    WINDOW_DEFAULTS,
)
from serverbench.config.loads import DEFAULT_LOAD, LOADS, help_text


@dataclass(frozen=True)
class LoadOptions:
    # Each load shape's class says what it is (serverbench/config/loads.py)
    load: str = flag("load", help_text(), default=DEFAULT_LOAD.name, choices=LOADS)
    # --load loadgen: which MLPerf LoadGen scenario drives the transport (serverbench.load.loadgen)
    scenario: str | None = flag(
        "load",
        "with --load loadgen: LoadGen's scenario. Server: Poisson arrivals at --rate (its target QPS; "
        "--slo_ms its target latency); Offline: every sample at once (--rate its expected QPS); SingleStream: "
        "one at a time; MultiStream: --concurrency samples per query (default 8). --num_iters and "
        "--duration_s are its minimum query count and duration",
        choices=SCENARIOS,
    )
    concurrency: int | None = flag(
        "load",
        "closed loop: requests outstanding at once; with --load loadgen --scenario MultiStream: samples per query",
        type=int,
        at_least=1,
    )
    rate_rps: float | None = flag(
        "load",
        "poisson: offered requests per second; the schedule is drawn up front from --seed. With --load "
        "loadgen: the Server scenario's target QPS, or the Offline scenario's expected QPS",
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
    trace_file: str | None = flag(
        "load",
        "with --load trace: the arrival times to replay, one per request, in seconds from the start of the measured "
        'phase (CSV: the first field of each line; *.jsonl: a number or {"time_s": ...} per line)',
        metavar="F",
    )
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
    # Frontend processes sharing the load (serverbench/config/generators.py): one is the reference's.
    generators: int = flag(
        "load",
        "load-generator processes, each a full client of --transport http|grpc or --target with its share of the "
        "load: closed: --concurrency split as evenly as possible; poisson: --rate/N each, on its own schedule (the "
        "superposition is Poisson at --rate); burst: --num_iters split. Each warms up, then all start the measured "
        "phase together; the row holds their records merged. For when one Python process cannot keep up with the "
        f"server (default 1, at most {MAX_GENERATORS})",
        default=1,
        type=int,
        at_least=1,
        at_most=MAX_GENERATORS,
        why="each is a process",
    )
    load_poll_ms: int = flag(
        "load",
        "period of the sampler of requests in flight and request-queue depth (default 50)",
        default=50,
        type=int,
        at_least=1,
    )
