"""Every column a server.py row can carry, declared once, in the order a results file's header has them: its name,
unit, one-line meaning, the function that fills it and the block of the row it sits in.

Everything else that names columns derives from COLUMNS: the row's order (ROW_COLUMNS), the blocks producers fill
(REFERENCE_COLUMNS ... JOB_COLUMNS), report.py's pooling keys (records/report_input.py) and the benchmark
database's metrics and configuration (records/benchmark_db.py). docs/columns.md is checked against it by
tests/test_docs.py. Users' CSVs depend on the names and their order: add a column, never rename or move one.

A producer returns the columns it is the producer of (and those naming it in `also_by`); the functions that
assemble a row (records/row.py build_row, server.run_once, launch/job.py write_job_rows for a job's row) put the
producers' columns together and may empty or replace a value, as a job row its pooled figures.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial


class Group(enum.Enum):
    """The block of the row a column sits in; blocks follow one another in this order."""

    REFERENCE = "the reference's columns, in its order, names and units"
    SUMMARY = "the rest of the records' summary"
    CEILING = "the model alone, and the efficiency against it"
    WINDOWS = "stability windows"
    NOISE = "the machine's share and the load generator's punctuality"
    RUN = "the run's outcome and configuration"
    ENVIRONMENT = "the environment"
    INSTANCES = "backend instances"
    LOADGEN = "--load loadgen: LoadGen's verdict and figures"
    RUN_ID = "the run's id, added when the row is written"
    DETAIL_FILES = "the run's detail files, relative to the results folder; empty when not written"
    PEAK_SEARCH = "--find_peak's runs only"
    JOB = "torchrun rows only: scope is rank (one rank's run) or job (all ranks together)"
    DOOR = "`--transport http|grpc`: the network front door, and `--target`"


class Use(enum.Enum):
    """What reads a column besides the CSV's user."""

    CONFIG = "report.py: a flag that makes a configuration; rows of one experiment must agree on it to be pooled"
    CELL = "report.py: part of a sweep cell's key; a later row of the cell replaces an interrupted one"
    DB_CONFIG = "the benchmark database: the configuration (benchmark.extra_info)"
    DB_MODEL = "the benchmark database: the model's details (model.extra_info)"


@dataclass(frozen=True)
class Column:
    name: str
    unit: str  # as docs/columns.md gives it: s, ms, samples/s, %, count, ...; text, bool, path for what is no figure
    meaning: str  # one line, markdown; docs/columns.md shows it, and may go on after it
    producer: str  # the function that fills it, by its dotted path
    group: Group
    also_by: tuple[str, ...] = ()  # other producers that also return it, filling or overriding it in some rows
    uses: tuple[Use, ...] = ()
    metric_rank: int | None = None  # a headline metric of the benchmark database, its records in this order (1 first)


# The producers, by their dotted paths (tests/test_docs.py imports each).
_RUN = "serverbench.records.row.run_columns"
_SUMMARY = "serverbench.records.summary.summary_columns"
_CEILING = "serverbench.records.row.ceiling_columns"
_WINDOWS = "serverbench.load.windows.window_columns"
_NOISE = "serverbench.load.noise.noise_columns"
_ENVIRONMENT = "serverbench.records.row.environment_columns"
_INSTANCES = "serverbench.records.instances.instance_columns"
_LOADGEN = "serverbench.load.loadgen.loadgen_columns"
_RUN_ID = "serverbench.records.row.make_run_id"
_DETAIL_FILES = "serverbench.records.row.write_detail_files"
_PEAK_SEARCH = "serverbench.launch.peak.find_peak"
_JOB = "serverbench.launch.job.write_job_rows"
_DOOR = "serverbench.records.row.door_columns"

# One constructor per block and producer, so that a declaration says only what is its own.
_reference_run = partial(Column, producer=_RUN, group=Group.REFERENCE)
_reference_summary = partial(Column, producer=_SUMMARY, group=Group.REFERENCE)
_summary = partial(Column, producer=_SUMMARY, group=Group.SUMMARY)
_ceiling = partial(Column, producer=_CEILING, group=Group.CEILING)
_windows = partial(Column, producer=_WINDOWS, group=Group.WINDOWS)
_noise = partial(Column, producer=_NOISE, group=Group.NOISE)
_run = partial(Column, producer=_RUN, group=Group.RUN)
_environment = partial(Column, producer=_ENVIRONMENT, group=Group.ENVIRONMENT)
_instances = partial(Column, producer=_INSTANCES, group=Group.INSTANCES)
_loadgen = partial(Column, producer=_LOADGEN, group=Group.LOADGEN)
_loadgen_log = partial(Column, producer=_DETAIL_FILES, group=Group.LOADGEN)  # moved into place with the detail files
_run_id = partial(Column, producer=_RUN_ID, group=Group.RUN_ID)
_detail_file = partial(Column, producer=_DETAIL_FILES, group=Group.DETAIL_FILES)
_peak_search = partial(Column, producer=_PEAK_SEARCH, group=Group.PEAK_SEARCH)
_job = partial(Column, producer=_JOB, group=Group.JOB)
_door = partial(Column, producer=_DOOR, group=Group.DOOR)

# Every column, in row order. A plain run's row has all but the peak-search and torchrun columns; a torchrun job's
# row has no detail-file columns.
COLUMNS: tuple[Column, ...] = (
    _reference_run("batch_size", "images", "images per request (`--batch_size`)", uses=(Use.CELL, Use.DB_CONFIG)),
    _reference_run("compile", "bool", "`--compile`", uses=(Use.CELL,)),
    _reference_run(
        "torch_load_time", "s", "`torch.load` of the checkpoint; empty with random weights", also_by=(_INSTANCES,)
    ),
    _reference_run("m_compile_time", "s", "compile plus the first run at the served shape", also_by=(_INSTANCES,)),
    _reference_summary(
        "warmup_latency", "s", "latency of the first warm-up request; includes model build and compile", metric_rank=5
    ),
    _reference_summary(
        "average_latency", "s", "mean latency over the measured requests (warm-up excluded)", metric_rank=4
    ),
    _reference_summary("max_latency", "s", "largest latency over the measured requests"),
    _reference_summary("min_latency", "s", "smallest latency over the measured requests"),
    _reference_summary(
        "throughput", "samples/s", "`num_iters * batch_size / (last response - first send)`", metric_rank=1
    ),
    _reference_summary("gpu_util", "%", "mean NVML utilisation during the measured phase", metric_rank=8),
    _summary("p50_latency_s", "s", "median latency of the measured requests", metric_rank=2),
    _summary("p90_latency_s", "s", "90th percentile latency"),
    _summary("p95_latency_s", "s", "95th percentile latency"),
    _summary("p99_latency_s", "s", "99th percentile latency", metric_rank=3),
    _summary("std_latency_s", "s", "standard deviation of the latency"),
    _summary("duration_s", "s", "first measured send to last measured response"),
    _summary("mean_request_queue_ms", "ms", "sent -> taken by the backend"),
    _summary(
        "mean_batch_wait_ms", "ms", "taken -> its formed batch closed by the batcher; 0 without `--max_batch_size`"
    ),
    _summary("mean_h2d_ms", "ms", "-> input on the device (includes decoding of the wire bytes)"),
    _summary("mean_predict_ms", "ms", "-> forward done"),
    _summary("mean_d2h_ms", "ms", "-> output on the host"),
    _summary("mean_response_queue_ms", "ms", "-> received by the frontend"),
    _summary("mean_h2d_copy_ms", "ms", "the H2D copy alone"),
    _summary("mean_forward_ms", "ms", "the forward alone"),
    _summary("mean_d2h_copy_ms", "ms", "the D2H copy alone"),
    _summary("requests_sent", "requests", "measured requests sent"),
    _summary("responses_received", "requests", "measured responses received"),
    _summary("responses_missing", "requests", "sent and never answered (a partial run)"),
    _summary("responses_duplicated", "requests", "answered more than once"),
    _summary("gpu_mem_used_max_mib", "MiB", "largest NVML memory used during the measured phase"),
    _summary("gpu_power_mean_w", "W", "mean NVML power draw"),
    _summary("gpu_samples", "count", "NVML samples taken (`--gpu_poll_ms` apart)"),
    _summary("achieved_rate_rps", "requests/s", "answered requests per second of the measured phase"),
    _summary("slo_attainment", "fraction", "requests answered within `slo_ms`"),
    _summary(
        "goodput_samples_per_s",
        "samples/s",
        "samples answered within `slo_ms`, per second of the measured phase",
        metric_rank=10,
    ),
    _summary("slo_p99_met", "bool", "p99 latency <= `slo_ms`"),
    _summary(
        "inflight_max",
        "requests",
        "most measured requests sent and not yet answered at once: exact from the records (each from its send's start "
        "to its answer), or the load sampler's where it saw more (requests never answered)",
    ),
    _summary("inflight_mean", "requests", "mean of the load sampler's count of the same (every --load_poll_ms)"),
    _summary("request_queue_depth_max", "requests", "deepest request queue seen by the load sampler"),
    _summary("timestamp_order_violations", "count", "records whose stamps are out of causal order"),
    _summary("copy_overlap", "fraction", "fraction of forward time during which another request's H2D or D2H copy ran"),
    _summary("reported_requests", "requests", "the requests the statistics are of"),
    _summary(
        "utilisation", "fraction", "fraction of the measured time with a forward running; every load", metric_rank=7
    ),
    _summary("littles_law_ratio", "ratio", "mean in flight / (achieved rate x mean latency)"),
    _summary("mean_formed_batch", "images", "mean images per forward (a request's batch size without batching)"),
    _summary("p50_formed_batch", "images", "median images per forward"),
    _summary("padding_pct", "%", "padded images over all images the forwards ran on (compiled sizes)"),
    _ceiling(
        "ceiling_throughput",
        "samples/s",
        "the model alone on inputs already on the device, at the design's concurrency",
        metric_rank=9,
    ),
    _ceiling("ceiling_batch_ms", "ms", "batch (or largest formed batch) / ceiling: one forward at the ceiling's rate"),
    _ceiling("ceiling_concurrency", "forwards", "the concurrency that gave the ceiling"),
    _ceiling("ceiling_spread_pct", "%", "CV of both phases' loops together: how much the machine moved"),
    _ceiling("ceiling_before_throughput", "samples/s", "median of the loops timed before serving"),
    _ceiling("ceiling_after_throughput", "samples/s", "median of the loops timed after serving"),
    _ceiling("efficiency", "ratio", "`throughput / ceiling_throughput`; burst and closed loads only", metric_rank=6),
    _ceiling("efficiency_low", "ratio", "`throughput` / the fastest timed loop of the ceiling"),
    _ceiling("efficiency_high", "ratio", "`throughput` / the slowest such loop: the high end"),
    _ceiling(
        "efficiency_note",
        "text",
        "how to read `efficiency`: `at the ceiling within noise`, or, when even `efficiency_low` is above 1, that the "
        "model-alone timing was slowed and the figure is no result; empty below the ceiling",
    ),
    _windows("windows", "count", "windows the measured phase was cut into"),
    _windows("stable", "bool", "the last 3 windows agreed within `stability_pct`"),
    _windows("window_throughput_cv_pct", "%", "CV of the last 3 windows' throughputs"),
    _windows("window_throughputs", "samples/s", "every window's throughput, `;`-separated, the first included"),
    _windows("noisy_windows", "count", "windows the machine made"),
    _windows("stability_note", "text", "why a windowed phase ended unstable"),
    _noise("cpu_steal_pct", "%", "CPU time the hypervisor gave to someone else (`/proc/stat` steal), of all CPU time"),
    _noise("other_cpu_pct", "%", "CPU time of processes other than the benchmark's"),
    _noise("runqueue_wait_pct_backend", "%", "time the backends' threads were ready to run and had no core"),
    _noise("runqueue_wait_pct_frontend", "%", "the same for the frontend's threads"),
    _noise(
        "involuntary_switches_backend",
        "count",
        "times a backend thread was taken off a core (`nonvoluntary_ctxt_switches`)",
    ),
    _noise("involuntary_switches_frontend", "count", "the same for the frontend"),
    _noise(
        "max_stall_ms", "ms", "the longest oversleep of a canary thread in the frontend that sleeps 10 ms at a time"
    ),
    _noise("sender_late_p50_ms", "ms", "median of send start minus the time the load wanted the request sent"),
    _noise("sender_late_p99_ms", "ms", "99th percentile of the same"),
    _noise("sender_late_max_ms", "ms", "the largest"),
    _noise("noise_warning", "text", "what in these figures is large enough to change the result"),
    _noise("noise_note", "text", "why a figure is empty or coarse"),
    _run("status", "text", 'how the run ended; see "Status values" below', uses=(Use.DB_CONFIG,)),
    _run("error", "text", "the exception or reason when `status` is not `ok`"),
    _run(
        "experiment",
        "text",
        "`--experiment` (default: the design, e.g. `pipelined_2w`, `serial_2inst`)",
        uses=(Use.CELL, Use.DB_CONFIG),
    ),
    _run("repeat", "index", "`--repeat`", uses=(Use.CELL, Use.DB_CONFIG)),
    _run(
        "attempt",
        "count",
        "`--attempt`: the runner's run of this cell in its folder, 1 the first; a later one (a resume's or "
        "`--retry_failed`'s) replaces an earlier failed or interrupted row in reports",
    ),
    _run(
        "load",
        "text",
        "`burst`, `closed`, `poisson`, `loadgen` or `trace` (`--load`)",
        uses=(Use.CONFIG, Use.DB_CONFIG),
    ),
    _run("concurrency", "requests", "`--concurrency` (closed loop)", uses=(Use.CONFIG, Use.CELL, Use.DB_CONFIG)),
    _run(
        "offered_rate_rps",
        "requests/s",
        "`--rate` (poisson; `--load loadgen`: LoadGen's target queries per second); `--load trace`: the trace's "
        "arrivals per second over its span",
        uses=(Use.CONFIG, Use.CELL, Use.DB_CONFIG),
    ),
    _run("burstiness", "gamma shape", "`--burstiness` (poisson only; 1 is Poisson)", uses=(Use.CONFIG,)),
    _run("trace_name", "text", "`--load trace`: the file name of `--trace_file`", uses=(Use.CONFIG,)),
    _run("trace_requests", "count", "`--load trace`: its arrivals (the measured requests)", uses=(Use.CONFIG,)),
    _run("trace_span_s", "s", "`--load trace`: its last arrival's time less its first's", uses=(Use.CONFIG,)),
    _run("min_duration_s", "s", "`--duration_s`; empty with `--stability_pct`"),
    _run("warmup_iters", "requests", "`--warmup_iters`"),
    _run("slo_ms", "ms", "`--slo_ms`", uses=(Use.DB_CONFIG,)),
    _run("design", "text", "`serial`, `threaded` or `pipelined`", uses=(Use.CONFIG, Use.DB_CONFIG)),
    _run(
        "transport",
        "text",
        "`shm` or `queue`; `http` or `grpc`: the requests came over the network front door",
        uses=(Use.CONFIG, Use.DB_CONFIG),
    ),
    _run("ring_slots", "slots", "shm ring size (also behind a door in its own process); empty otherwise"),
    _run("wire_dtype", "text", "`float32` or `uint8`", uses=(Use.CONFIG, Use.DB_CONFIG)),
    _run("precision", "text", "`--precision`", uses=(Use.CONFIG,)),
    _run("cudnn_allow_tf32", "bool", "cuDNN's TF32 flag as in effect in the backend", uses=(Use.DB_CONFIG,)),
    _run(
        "matmul_precision", "text", "torch's float32 matmul precision in effect in the backend", uses=(Use.DB_CONFIG,)
    ),
    _run("channels_last", "bool", "`--channels_last`", uses=(Use.CONFIG, Use.DB_CONFIG)),
    _run("compile_mode", "text", "`--compile_mode`; empty without `--compile`", uses=(Use.CONFIG,)),
    _run("compile_decode", "bool", "the wire decoding compiled into one pass", uses=(Use.DB_MODEL,)),
    _run(
        "compile_path",
        "text",
        "what served the model: `eager`, `inductor` (`--compile`) or `aoti`",
        uses=(Use.CONFIG, Use.DB_CONFIG),
    ),
    _run("aoti_runners", "runners", "AOTInductor: model runners loaded", uses=(Use.DB_MODEL,)),
    _run("aoti_compiled_now", "bool", "`--aoti`: the package was compiled in this run (False: the cached one served)"),
    _run(
        "compile_graph_breaks",
        "count",
        "`--compile`: graph breaks dynamo met compiling one prediction thread's copy of the model at every warmed size",
    ),
    _run("device", "text", "the device served on", uses=(Use.CONFIG, Use.DB_CONFIG)),
    _run("model", "text", "`--model` (a `.pt2` as its absolute path)", uses=(Use.CONFIG,)),
    _run(
        "model_kwargs", "JSON", "`--model_kwargs` of a factory model; empty otherwise", uses=(Use.CONFIG, Use.DB_MODEL)
    ),
    _run(
        "image_size",
        "pixels",
        "height and width of the images; empty for a model without an image input",
        uses=(Use.CONFIG, Use.DB_CONFIG, Use.DB_MODEL),
    ),
    _run(
        "inputs",
        "text",
        "the model's inputs as served, space-separated `name:dtype:shape[:low-high]`",
        uses=(Use.CONFIG, Use.DB_CONFIG, Use.DB_MODEL),
    ),
    _run(
        "request_bytes", "bytes", "one request's inputs on the wire (every input's batch; the image in `--wire_dtype`)"
    ),
    _run("response_bytes", "bytes", "one response's output leaves, all of them (float leaves as float32)"),
    _run("num_workers", "threads", "prediction threads (pipelined; 1 otherwise)", uses=(Use.CONFIG, Use.DB_CONFIG)),
    _run("num_iters", "requests", "`--num_iters`; empty with `--stability_pct`"),
    _run("stability_pct", "%", "`--stability_pct`; empty: the fixed count", uses=(Use.CONFIG,)),
    _run(
        "responses_unexpected",
        "responses",
        "responses whose id matches no request sent (a response of the wrong shape fails the run)",
    ),
    _run("verify", "bool", "`--verify`"),
    _run(
        "wrong_outputs",
        "responses",
        "responses, the warm-up ones included, that differ from the serial answer by more than the tolerance",
    ),
    _run("max_abs_error", "output units", "largest absolute difference from the serial answer"),
    _run("verify_tolerance", "x scale", "the tolerance used"),
    _run("checkpoint", "path", "`--checkpoint`, or empty for random weights", uses=(Use.DB_MODEL,)),
    _run("seed", "integer", "`--seed`"),
    _run("max_inflight", "requests", "`--max_inflight` (formed batches with dynamic batching)", uses=(Use.CONFIG,)),
    _run("max_batch_size", "images", "`--max_batch_size`; empty: no batcher", uses=(Use.CONFIG, Use.DB_CONFIG)),
    _run(
        "max_queue_delay_ms",
        "ms",
        "`--max_queue_delay_ms` (with `--max_batch_size` only)",
        uses=(Use.CONFIG, Use.DB_CONFIG),
    ),
    _run("spin_wait", "bool", "`--spin_wait`"),
    _run("cpu_split", "bool", "`--cpu_split`; empty on a GPU", uses=(Use.CONFIG,)),
    _run("backend_cpus", "CPU ids", "CPUs the backend ran on, `;`-separated (CPU device only)"),
    _run("intra_op_threads", "threads", "torch's intra-op threads in each backend"),
    _run(
        "machine_speed_before",
        "rounds/s",
        "the machine's speed just before the measured phase, on the backend's cores: one fixed matmul and one "
        "fixed memory copy per round, at their best times (serverbench/system/speed.py; the instances' mean)",
    ),
    _run("machine_speed_after", "rounds/s", "the same just after the measured phase; empty when the run failed"),
    _run(
        "planted_delay_us",
        "us",
        "`--planted_delay_us`: the busy-wait after each forward; empty for none",
        uses=(Use.CONFIG, Use.DB_CONFIG),
    ),
    _run("malloc_tuned", "bool", "`--tune_malloc` took in the backend (False where the C library is not glibc)"),
    _run("backend_cpu_cores", "cores", "CPU seconds of every backend thread per second of serving"),
    _run("gpu_util_note", "text", "why `gpu_util` is empty when a GPU was sampled"),
    _run("profile_trace", "path", "`--profile`'s torch.profiler trace (one per instance, `;`-separated)"),
    _environment("device_name", "text", "the CPU or GPU model name"),
    _environment(
        "timing_source", "text", "`cuda_events` or `host_clock`: the clock of the `*_copy_ms` and `forward_ms` figures"
    ),
    _environment(
        "model_build_s",
        "s",
        "building the model in the backend (the slowest instance's or rank's)",
        also_by=(_INSTANCES,),
    ),
    _environment("timestamp", "UTC ISO time", "when the row was built", uses=(Use.DB_CONFIG,)),
    _environment("host", "text", "host name (the ranks' host names on a job row)"),
    _environment("python_version", "text", "Python version"),
    _environment("torch_version", "text", "torch version as the backend's torch reports it"),
    _environment("torchvision_version", "text", "torchvision package version"),
    _environment("cuda_version", "text", "torch's CUDA version; empty on a CPU build"),
    _environment("commit", "text", "the benchmark checkout's git commit as the run started; empty outside git"),
    _environment(
        "code_dirty",
        "bool",
        "a code file of the checkout (`*.py`, `*.sh`, pyproject.toml) differed from `commit`: the code that ran is "
        "not that commit's alone",
    ),
    _environment("cpu_model", "text", "the CPU's model name (a GPU run's `device_name` is the GPU's)"),
    _instances("instances", "processes", "`--instances`", uses=(Use.CONFIG, Use.DB_CONFIG)),
    _instances(
        "requests_per_instance", "requests", "measured requests each instance answered, `;`-separated (e.g. `52;48`)"
    ),
    _instances("mps", "bool", "the NVIDIA MPS control daemon was in use; empty on the CPU"),
    _loadgen(
        "loadgen_scenario",
        "text",
        "`SingleStream`, `MultiStream`, `Server` or `Offline` (`--scenario`)",
        uses=(Use.CONFIG, Use.DB_CONFIG),
    ),
    _loadgen(
        "loadgen_valid",
        "bool",
        "LoadGen's verdict: True for VALID, False for INVALID",
    ),
    _loadgen("loadgen_invalid_reason", "text", "with INVALID: each of its checks that failed"),
    _loadgen("loadgen_early_stopping_met", "bool", "whether LoadGen's early-stopping estimate was reached"),
    _loadgen("loadgen_queries", "count", "queries LoadGen issued"),
    _loadgen("loadgen_scheduled_rps", "requests/s", "`Server`: the rate LoadGen's schedule offered"),
    _loadgen("loadgen_completed_rps", "requests/s", "completed samples per second as LoadGen counts them"),
    _loadgen("loadgen_mean_latency_s", "s", "LoadGen's mean sample latency"),
    _loadgen("loadgen_p50_latency_s", "s", "LoadGen's median sample latency"),
    _loadgen("loadgen_p90_latency_s", "s", "LoadGen's 90th percentile"),
    _loadgen("loadgen_p99_latency_s", "s", "LoadGen's 99th percentile"),
    _loadgen("loadgen_p99_ratio", "ratio", "`p99_latency_s / loadgen_p99_latency_s`", metric_rank=11),
    _loadgen("loadgen_unanswered", "count", "samples completed without an answer because the run failed"),
    _loadgen("loadgen_note", "text", "why the two sets of figures should not be read together"),
    _loadgen_log(
        "loadgen_log_dir", "path", "`loadgen/<run_id>`: LoadGen's logs (summary, detail)", also_by=(_LOADGEN,)
    ),
    _run_id(
        "run_id",
        "text",
        "`<start time>_<experiment>_bs<batch>_r<repeat>_<pid>`; names the detail files",
        uses=(Use.DB_CONFIG,),
    ),
    _detail_file("requests_file", "path", "`--save_requests`: `requests/<run_id>.csv`, one line per request"),
    _detail_file("gpu_samples_file", "path", "`--save_requests`: `gpu/<run_id>.csv`, the NVML samples"),
    _detail_file(
        "load_samples_file", "path", "`--save_requests`: `load/<run_id>.csv`, in-flight count and queue depth over time"
    ),
    _detail_file(
        "batches_file",
        "path",
        "`--save_requests` with `--max_batch_size`: `batches/<run_id>.csv`, one line per forward",
    ),
    _detail_file("timeline_trace", "path", "`--trace`: `traces/<run_id>_timeline.json`, Chrome trace / Perfetto"),
    _detail_file(
        "traceback_file", "path", "a run that failed with an exception: `tracebacks/<run_id>.txt`, its traceback"
    ),
    _peak_search(
        "peak_search_step",
        "text",
        "`--find_peak` runs only: `offline` for the burst run, then the bisection step number",
    ),
    _job("scope", "text", "`rank` or `job`", uses=(Use.DB_CONFIG,)),
    _job("rank", "index", "the rank (empty on the job row)", uses=(Use.DB_CONFIG,)),
    _job("local_rank", "index", "the rank on its node (empty on the job row)"),
    _job("world_size", "ranks", "ranks in the job", uses=(Use.DB_CONFIG,)),
    _job("ranks_reported", "ranks", "ranks whose results reached rank 0"),
    _job("ranks_ok", "ranks", "ranks whose run was `ok`"),
    _job("nodes", "count", "machines in the job (distinct monotonic clocks)"),
    _job("clock_alignment", "text", "`shared clock` (one machine) or `start barrier`"),
    _job("slowest_rank", "index", "the rank with the lowest throughput"),
    _job("slowest_rank_throughput", "samples/s", "that rank's throughput"),
    _door(
        "door",
        "text",
        "`process` (the door in a process of its own) or `inline` (inside the backend); empty without a door",
        uses=(Use.CONFIG, Use.DB_CONFIG),
    ),
    _door("door_address", "text", "`host:port` the door listened on"),
    _door("target", "text", "`--target`: the URL of the server driven (someone else's: stage columns stay empty)"),
    _door(
        "door_answered",
        "requests",
        "inference requests the door answered with outputs, warm-up included (empty: it died unreported)",
    ),
    _door("door_errors", "requests", "requests the door answered with an error (malformed, unknown model, too large)"),
    _door("door_error_statuses", "text", "those errors by HTTP status (gRPC's mapped), e.g. `400:2;413:1`"),
    _door("door_disconnects", "requests", "clients that went away before their request was read whole"),
    _door(
        "generators",
        "processes",
        "`--generators`: our load-generator processes, their records merged into this row; empty with `--serve_only`",
        uses=(Use.DB_CONFIG,),
    ),
)


def names(columns: Sequence[Column]) -> tuple[str, ...]:
    """The columns' names, in their order."""
    return tuple(column.name for column in columns)


def group_names(columns: Sequence[Column], group: Group) -> tuple[str, ...]:
    """The names of one block of the row, in row order."""
    return tuple(column.name for column in columns if column.group is group)


def used_by(columns: Sequence[Column], use: Use) -> tuple[str, ...]:
    """The names of the columns that `use` reads, in row order."""
    return tuple(column.name for column in columns if use in column.uses)


ROW_COLUMNS = names(COLUMNS)
REFERENCE_COLUMNS = group_names(COLUMNS, Group.REFERENCE)  # scripts written for the reference read these
CEILING_COLUMNS = group_names(COLUMNS, Group.CEILING)
WINDOW_COLUMNS = group_names(COLUMNS, Group.WINDOWS)
NOISE_COLUMNS = group_names(COLUMNS, Group.NOISE)
LOADGEN_COLUMNS = group_names(COLUMNS, Group.LOADGEN)  # empty for every other load
DETAIL_FILE_COLUMNS = group_names(COLUMNS, Group.DETAIL_FILES)
PEAK_SEARCH_COLUMNS = group_names(COLUMNS, Group.PEAK_SEARCH)
JOB_COLUMNS = group_names(COLUMNS, Group.JOB)
DOOR_COLUMNS = group_names(COLUMNS, Group.DOOR)
