"""The run's summary on the terminal, from its row."""

from __future__ import annotations

import os
from functools import partial

from serverbench.config.design_kinds import design_kind
from serverbench.config.door_options import LOOPBACK_HOSTS
from serverbench.config.inputs import is_image_input
from serverbench.config.limits import STABLE_WINDOWS
from serverbench.config.loads import load_kind
from serverbench.config.options import BenchConfig
from serverbench.load.noise import OTHER_CPU_WARN_PCT, RUNQUEUE_WAIT_WARN_PCT, SHORT_PHASE
from serverbench.records.summary import efficiency_verdict

LITTLES_LAW_TOLERANCE = 0.10  # further off than this, the records or the sampler miss something


def _fmt(value: object, fmt: str, scale: float = 1.0) -> str:
    return "n/a" if value is None else format(float(value) * scale, fmt)


def _graph_breaks(breaks: object, workers: int) -> str:
    """torch.compile's graph breaks, and what they cost several prediction threads (serverbench.backend.compiled)."""
    if not breaks:
        return ""
    return f", {breaks} graph break(s)" + (": forwards one at a time" if workers > 1 else "")


def _num(row: dict[str, object], key: str, scale: float = 1.0, fmt: str = ".3f") -> str:
    return _fmt(row.get(key), fmt, scale)


def _count(row: dict[str, object], key: str) -> str:
    """A count as the row has it; "?" where it is unknown (a process that died with it), never "None"."""
    value = row.get(key)
    return "?" if value is None else str(value)


def format_summary(cfg: BenchConfig, row: dict[str, object]) -> str:
    lines = _run_lines(cfg, row) + _verify_lines(cfg, row) + _design_lines(cfg, row) + _loadgen_lines(row)
    lines += _window_lines(cfg, row)
    lines += _ceiling_lines(cfg, row) + _load_lines(cfg, row) + noise_lines(row) + _oversubscribed(cfg, row)
    lines += _door_lines(cfg, row)
    if row.get("timestamp_order_violations"):
        lines.append(
            f"  WARNING       {row['timestamp_order_violations']} request(s) have stamps out of order "
            "(sent <= taken <= h2d <= forward <= d2h <= received): the stage times of this run are suspect"
        )
    if cfg.slo_ms is not None:
        num = partial(_num, row)
        lines.append(
            f"  SLO {cfg.slo_ms:g} ms   {num('slo_attainment', 100, '.1f')} % within, goodput "
            f"{num('goodput_samples_per_s', fmt='.1f')} samples/s, p99 met: {row.get('slo_p99_met')}"
        )
    return "\n".join(lines)


def _door_lines(cfg: BenchConfig, row: dict[str, object]) -> list[str]:
    """The network door's counts, and the warning that it let anyone in when it listened beyond loopback."""
    if row.get("door") is None and row.get("target") is None:
        return []
    if row.get("target"):
        return [
            f"  target        {row['target']} ({cfg.transport}): not our backend, so the stage, ceiling and "
            "efficiency figures stay empty"
        ]
    lines = [
        f"  door          {cfg.transport}, {row['door']} door on {row.get('door_address') or '(no address)'}: "
        f"{_count(row, 'door_answered')} answered, {_count(row, 'door_errors')} error answers "
        f"({row.get('door_error_statuses') or 'none'}), {_count(row, 'door_disconnects')} disconnects"
    ]
    if (others := _answered_for_others(cfg, row)) > 0:
        lines.append(
            f"  WARNING       the door answered {others} request(s) that no generator of this run sent: another "
            "client used it meanwhile, and shared the server with this run's load"
        )
    if cfg.host not in LOOPBACK_HOSTS and cfg.auth_token is None:
        lines.append(
            f"  WARNING       the door listened on {cfg.host}, beyond this machine, with no authentication or TLS: "
            "anything that reached the port could send requests"
        )
    elif cfg.host not in LOOPBACK_HOSTS:
        lines.append(
            f"  note          the door listened on {cfg.host} with a token but no TLS: the token and the tensors "
            "crossed the network unencrypted"
        )
    return lines


def _answered_for_others(cfg: BenchConfig, row: dict[str, object]) -> int:
    """What the door answered beyond this run's own requests (each generator's warm-ups and its measured requests
    answered), in a run whose generators ran to their end; 0 when that cannot be told (--serve_only, a failure)."""
    answered, ours = row.get("door_answered"), row.get("responses_received")
    if cfg.serve_only or row.get("status") != "ok" or answered is None or ours is None:
        return 0
    return int(answered) - int(ours) - cfg.warmup_iters * cfg.generators


def _oversubscribed(cfg: BenchConfig, row: dict[str, object], cores: int | None = None) -> list[str]:
    """A design whose threads at once exceed the cores other processes left free runs oversubscribed: its figures
    carry the machine's load more than a design of fewer threads does, which reads as a design difference."""
    threads, other_pct = row.get("intra_op_threads"), row.get("other_cpu_pct")
    if cfg.is_cuda or threads is None or other_pct is None or other_pct <= OTHER_CPU_WARN_PCT or _short_phase(row):
        return []
    cores = cores or os.cpu_count() or 1
    forwards = design_kind(cfg.design).forwards_at_once(cfg.num_workers) * cfg.instances
    free = cores * (1 - other_pct / 100)
    if int(threads) * forwards <= free:
        return []
    return [
        f"  WARNING       oversubscribed: {int(threads)} intra-op thread(s) x {forwards} forward(s) at once want "
        f"{int(threads) * forwards} cores, and other processes left about {free:.1f} of {cores} free: this design "
        "pays for the machine's load more than one of fewer threads would (--intra_op_threads)"
    ]


def _wire(cfg: BenchConfig) -> str:
    """What the requests' tensors travel as: --wire_dtype applies to an image input only; other inputs travel in
    their own dtypes."""
    if any(is_image_input(spec) for spec in cfg.model_inputs):
        return cfg.wire_dtype + (" image, other inputs in their own dtypes" if len(cfg.model_inputs) > 1 else "")
    return "inputs in their own dtypes"


def _run_lines(cfg: BenchConfig, row: dict[str, object]) -> list[str]:
    """What ran, how it ended, and its figures: warm-up, latency, each stage's time, throughput."""
    num = partial(_num, row)
    # The built-in models' image as HxW, any other inputs as name:dtype:shape.
    shapes = f"{cfg.image_size}x{cfg.image_size}" if not cfg.inputs else str(row.get("inputs"))
    return [
        f"{cfg.experiment} | {cfg.model} {shapes} | batch {cfg.batch_size} | "
        f"{cfg.num_workers} worker(s) | {row.get('compile_path') or 'eager'} | {cfg.transport} "
        f"{_wire(cfg)} {cfg.precision}{' channels_last' if cfg.channels_last else ''} | "
        f"{cfg.device}" + (f" ({row['device_name']})" if row.get("device_name") else ""),
        f"  status        {row['status']}" + (f": {row['error']}" if row.get("error") else ""),
        f"  requests      {_count(row, 'responses_received')}/{_count(row, 'requests_sent')} answered, "
        f"{_count(row, 'responses_missing')} missing, {_count(row, 'responses_duplicated')} duplicated",
        f"  warm-up       {num('warmup_latency')} s to the first answer   (model build "
        f"{num('model_build_s', fmt='.2f')} s, begun before that request was sent"
        + (f", compile {num('m_compile_time', fmt='.2f')} s" if row.get("m_compile_time") is not None else "")
        + _graph_breaks(row.get("compile_graph_breaks"), cfg.num_workers)
        + ")",
        f"  latency       mean {num('average_latency', 1e3, '.1f')} ms  p50 {num('p50_latency_s', 1e3, '.1f')}  "
        f"p99 {num('p99_latency_s', 1e3, '.1f')}  max {num('max_latency', 1e3, '.1f')} ms",
        f"  stages (ms)   queue {num('mean_request_queue_ms', fmt='.1f')}  "
        + (f"batch {num('mean_batch_wait_ms', fmt='.1f')}  " if cfg.batching else "")
        + f"h2d {num('mean_h2d_ms', fmt='.1f')}  "
        f"predict {num('mean_predict_ms', fmt='.1f')}  d2h {num('mean_d2h_ms', fmt='.1f')}  "
        f"return {num('mean_response_queue_ms', fmt='.1f')}",
        f"  throughput    {num('throughput', fmt='.1f')} samples/s"
        + (f"   GPU util {num('gpu_util', fmt='.1f')} %" if row.get("gpu_util") is not None else ""),
    ]


def _verify_lines(cfg: BenchConfig, row: dict[str, object]) -> list[str]:
    """--verify's verdict, passed or not: a check that passes silently reads as one that never ran."""
    if not cfg.verify:
        return []
    wrong, largest = row.get("wrong_outputs"), _num(row, "max_abs_error", fmt=".3g")
    if wrong is None:
        return ["  verify        no verdict: the run ended before its answers were compared"]
    if wrong == 0:
        within = "equal to" if not row.get("verify_tolerance") else f"within {row['verify_tolerance']:g} x its scale of"
        return [f"  verify        passed: every answer {within} the serial one (largest difference {largest})"]
    return [f"  verify        FAILED: {wrong} answer(s) differ from the serial one (largest difference {largest})"]


def _design_lines(cfg: BenchConfig, row: dict[str, object]) -> list[str]:
    """Dynamic batching's formed batches, and the instances' share of the requests."""
    num = partial(_num, row)
    lines = []
    if cfg.batching:
        lines.append(
            f"  batching      up to {cfg.max_batch_size} images, delay {cfg.max_queue_delay_ms:g} ms: formed "
            f"{num('mean_formed_batch', fmt='.1f')} images on average (p50 {num('p50_formed_batch', fmt='g')})"
            f", padding {num('padding_pct', fmt='.1f')} %, wait in the batcher "
            f"{num('mean_batch_wait_ms', fmt='.2f')} ms"
        )
    if cfg.instances > 1:
        mps = {True: ", MPS on", False: ", MPS off: the instances time-slice the GPU", None: ""}[row.get("mps")]
        lines.append(
            f"  instances     {cfg.instances} processes; measured requests each served: "
            f"{row.get('requests_per_instance')}{mps}"
        )
    return lines


def _loadgen_lines(row: dict[str, object]) -> list[str]:
    """--load loadgen: LoadGen's verdict and latencies beside ours."""
    if not row.get("loadgen_scenario"):
        return []
    num = partial(_num, row)
    valid = {True: "VALID", False: "INVALID", None: "no verdict"}[row.get("loadgen_valid")]
    lines = [
        f"  loadgen       {row['loadgen_scenario']}: {valid}"
        + (f" ({row['loadgen_invalid_reason']})" if row.get("loadgen_invalid_reason") else "")
        + f"; its p50 {num('loadgen_p50_latency_s', 1e3, '.1f')}  p99 {num('loadgen_p99_latency_s', 1e3, '.1f')} ms"
        f", ours/its p99 {num('loadgen_p99_ratio')}"
    ]
    if row.get("loadgen_note"):
        lines.append(f"  WARNING       {row['loadgen_note']}")
    return lines


def _window_lines(cfg: BenchConfig, row: dict[str, object]) -> list[str]:
    """--stability_pct: the windows run and whether the last ones held still."""
    if row.get("stable") is None:
        return []
    verdict = "stable" if row["stable"] else f"NOT stable within {cfg.stability_pct:g} % (--max_windows)"
    lines = [
        f"  windows       {row['windows']}, {verdict}; the last {STABLE_WINDOWS} reported "
        f"({row['reported_requests']} requests): throughput spread (CV) "
        f"{_num(row, 'window_throughput_cv_pct', fmt='.1f')} %"
        + (f"; {row['noisy_windows']} noisy, not counted" if row.get("noisy_windows") else "")
    ]
    if row.get("stability_note"):
        lines.append(f"  unstable      {row['stability_note']}")
    return lines


def _short_phase(row: dict[str, object]) -> bool:
    return SHORT_PHASE in str(row.get("noise_note") or "")


def _ceiling_lines(cfg: BenchConfig, row: dict[str, object]) -> list[str]:
    """The model alone (a torchrun job's ranks summed, or the instances timed at once), and the efficiency with its
    interval (the ceiling's slowest to fastest loop) and how to read it."""
    if row.get("ceiling_throughput") is None:
        return []
    num = partial(_num, row)
    interval = row.get("efficiency_low") is not None and row.get("efficiency_high") is not None
    verdict = efficiency_verdict(row.get("efficiency_low"), row.get("efficiency_high"))
    fit = (
        f"efficiency {num('efficiency', fmt='.3f')}"
        + (f" ({num('efficiency_low', fmt='.3f')}-{num('efficiency_high', fmt='.3f')})" if interval else "")
        + (f", {verdict}" if verdict else "")
        + (", unjudged: the phase was too short to see the machine's noise" if _short_phase(row) else "")
        if row.get("efficiency") is not None
        else f"utilisation {num('utilisation', fmt='.3f')}"
    )
    ceiling = f"  ceiling       {num('ceiling_throughput', fmt='.1f')} samples/s"
    if row.get("ceiling_concurrency") is None:  # a torchrun job: the sum of its ranks' ceilings
        return [f"{ceiling} (the ranks' models alone, summed)   {fit}"]
    spread = f"{ceiling} +- {num('ceiling_spread_pct', fmt='.1f')} %"
    before_after = (
        f"before {num('ceiling_before_throughput', fmt='.1f')}, after {num('ceiling_after_throughput', fmt='.1f')}"
    )
    if cfg.instances > 1:  # timed by every instance at once, summed
        return [
            f"{spread} (the {cfg.instances} instances' models alone, timed at once and summed, "
            f"{row['ceiling_concurrency']} at once in each; {before_after})   {fit}"
        ]
    return [f"{spread} (the model alone, {row['ceiling_concurrency']} at once; {before_after})   {fit}"]


def _load_lines(cfg: BenchConfig, row: dict[str, object]) -> list[str]:
    """The load offered and achieved (not for a burst), and Little's law as a check of the records."""
    lines = []
    offered = load_kind(cfg.load).offered(cfg)
    if offered is not None:
        inflight = f", in flight max {row['inflight_max']}" if row.get("inflight_max") is not None else ""
        lines.append(
            f"  load          {cfg.load}: {offered}achieved {_num(row, 'achieved_rate_rps', fmt='.2f')} req/s{inflight}"
        )
    ratio = row.get("littles_law_ratio")
    if ratio is not None:
        sound = abs(ratio - 1) <= LITTLES_LAW_TOLERANCE
        lines.append(
            f"  Little's law  in flight / (rate x latency) = {ratio:.3f}"
            + (
                ""
                if sound
                else f"   WARNING: off by more than {LITTLES_LAW_TOLERANCE:.0%}: the records miss part of "
                "some requests' lives (or the load sampler missed requests)"
            )
        )
    return lines


def noise_lines(row: dict[str, object]) -> list[str]:
    """'machine noise: ...' and, when the machine's share is large enough to change the result, a warning."""
    figures = []
    if row.get("cpu_steal_pct") is not None:
        figures.append(f"steal {_fmt(row['cpu_steal_pct'], '.1f')} %")
    if row.get("other_cpu_pct") is not None:
        figures.append(f"other processes {_fmt(row['other_cpu_pct'], '.1f')} % of the CPU")
    waits = [
        f"{role} {_fmt(row[f'runqueue_wait_pct_{role}'], '.1f')} %"
        for role in ("backend", "frontend")
        if row.get(f"runqueue_wait_pct_{role}") is not None
    ]
    if waits:
        figures.append("run-queue wait " + ", ".join(waits))
    if row.get("max_stall_ms") is not None:
        figures.append(f"longest stall {_fmt(row['max_stall_ms'], '.1f')} ms")
    if row.get("sender_late_p99_ms") is not None:
        figures.append(
            f"sender late p50 {_fmt(row['sender_late_p50_ms'], '.2f')} / p99 {_fmt(row['sender_late_p99_ms'], '.2f')}"
            f" / max {_fmt(row['sender_late_max_ms'], '.2f')} ms"
        )
    if not figures and not row.get("noise_note"):
        return []
    note = f" ({row['noise_note']})" if row.get("noise_note") else ""
    lines = [f"  machine noise: {'; '.join(figures) or 'n/a'}{note}"]
    if row.get("noise_warning"):
        lines.append(f"  WARNING       the machine may have made these numbers: {row['noise_warning']}")
    # Only where the machine's shares were measured and quiet: otherwise the wait's cause is unknown.
    quiet = row.get("other_cpu_pct") is not None and row["other_cpu_pct"] <= OTHER_CPU_WARN_PCT
    quiet = quiet and not _short_phase(row)
    own = [
        role
        for role in ("backend", "frontend")
        if quiet
        and (row.get(f"runqueue_wait_pct_{role}") or 0.0) > RUNQUEUE_WAIT_WARN_PCT
        and f"the {role}'s threads waited" not in str(row.get("noise_warning") or "")
    ]
    if own:
        lines.append(
            f"  note          the {' and '.join(own)}'s threads waited for a core while no other process was "
            "measured busy: this design's threads outnumber the cores, a cost of the design here, not noise"
        )
    return lines


def format_rank_line(rank: int, row: dict[str, object]) -> str:
    """One rank of a torchrun job, under the job's summary."""
    return (
        f"  rank {rank:<4}  {row.get('device')} ({row.get('device_name')}) on {row.get('host')}: "
        f"{row.get('status')}, throughput {_fmt(row.get('throughput'), '.1f')} samples/s, "
        f"p50 {_fmt(row.get('p50_latency_s'), '.1f', 1e3)} ms, p99 {_fmt(row.get('p99_latency_s'), '.1f', 1e3)} ms"
    )
