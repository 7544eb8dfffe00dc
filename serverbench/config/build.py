"""The parsed command line made into a BenchConfig: every check that needs nothing but the flags, and the values that
follow from them (batching bounds, worker count, experiment name, ring size...).

A pure function: no torch, no file system, no probe of this machine (preflight.py does those), so that a sweep or a
test can check flags cheaply and a bad flag leaves nothing behind.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Sequence
from pathlib import PurePath
from typing import Any

from serverbench.config.design_kinds import DESIGN_KINDS, design_kind, experiment_label
from serverbench.config.door_checks import resolve_door
from serverbench.config.door_options import LOOPBACK_HOSTS
from serverbench.config.flags import ConfigError, RaisingParser, flag_of
from serverbench.config.generators import check_generators
from serverbench.config.inputs import check_inputs, image_input, is_image_input, model_source, request_bytes
from serverbench.config.limits import (
    CEILING_S_DEFAULT,
    IDENTITY_MODEL,
    MAX_BURSTINESS,
    MAX_CEILING_S,
    MAX_QUEUE_DELAY_MS,
    MAX_RING_SLOTS,
    MIN_BURSTINESS,
    MIN_RATE_RPS,
    WINDOW_DEFAULTS,
)
from serverbench.config.load_kind import Pacing
from serverbench.config.loads import check_load_flags, load_kind, resolve_load
from serverbench.config.options import BenchConfig, RankInfo, add_cli_args
from serverbench.config.paths import MAX_EXPERIMENT_CHARS, MAX_OUTPUT_FILE_BYTES, check_file_name
from serverbench.config.transport_kinds import transport_kind

DEFAULT_RING_SLOTS = 4  # at least; small requests get more, up to RING_DEFAULT_BYTES of ring
MAX_DEFAULT_RING_SLOTS = 64
RING_DEFAULT_BYTES = 64 << 20
DEFAULT_MAX_QUEUED_REQUESTS = 16


def build_config(args: argparse.Namespace, rank: RankInfo | None = None) -> BenchConfig:
    """Validates the flags and resolves what follows from them; raises ConfigError. Under torchrun, `rank` gives this
    rank's seed (--seed + rank) and, in preflight, its device. The device, the checkpoint and the paths stay as given
    until preflight resolves them."""
    # Flags that mean nothing here first, then values refused in words of their own, then the per-flag bounds of
    # the fields' metadata: a flag given alone is refused as it always was, NaN included.
    _check_applies(args)
    _check_values(args)
    check_bounds(args)
    resolved: dict[str, Any] = dict(vars(args))
    resolved.update(_resolve_batching(args))
    _check_rank(args, rank)
    resolved["num_workers"] = _resolve_num_workers(args)
    resolved["trace_offsets_s"] = ()
    resolved.update(_check_load(args))
    if rank is not None and args.stability_pct is not None:
        raise ConfigError(
            "--stability_pct under torchrun: each rank would end its measured phase on its own "
            "windows, and their rows would not cover the same time; use --num_iters or --duration_s"
        )
    resolved["experiment"] = _experiment(args, resolved["num_workers"])
    if args.compile_mode != "default" and not args.compile:
        raise ConfigError(f"--compile_mode {args.compile_mode}: applies with --compile only")
    if args.checkpoint is not None and args.model == IDENTITY_MODEL:
        raise ConfigError(f"--checkpoint: the {IDENTITY_MODEL} model has no weights to load")
    resolved["inputs"] = _check_model_source(args)
    resolved.update(resolve_door(args, rank))
    check_generators(args, rank)
    resolved.update(
        compile_decode=args.compile if args.compile_decode is None else args.compile_decode,
        seed=args.seed + (rank.rank if rank else 0),  # each rank its own images
        # Test-only: under torchrun the fault may be planted on one rank alone.
        inject_fault=args.inject_fault if args.inject_fault_rank in (None, rank.rank if rank else 0) else None,
        rank=rank,
        generator=0,  # the server's view; each frontend gets its own (generators.generator_config)
    )
    return BenchConfig(**{field.name: resolved[field.name] for field in dataclasses.fields(BenchConfig)})


def server_parser() -> RaisingParser:
    """server.py's parser (server.build_parser is this, with a one-line error that exits): ConfigError for a
    refusal, so that a tool checks the server flags of its runs as server.py takes them, before any run."""
    parser = RaisingParser(prog="server.py")
    add_cli_args(parser)
    return parser


def parse_server_flags(flags: Sequence[str]) -> BenchConfig:
    """A server.py command line's flags as its parser and build_config take them; ConfigError for a refusal."""
    return build_config(server_parser().parse_args(list(flags)))


def _check_model_source(args: argparse.Namespace) -> tuple:
    """The flags that describe the model and its inputs, taken together; returns --input's specs."""
    source = model_source(args.model)
    inputs = tuple(args.inputs or ())
    problem = check_inputs(inputs)
    if problem:
        raise ConfigError(problem)
    if inputs and source in ("identity", "torchvision") and args.target is None:  # --target: the server's model
        raise ConfigError(
            f"--input: the built-in model {args.model} takes the image of --image_size; --input describes the inputs "
            "of a package.module:factory or .pt2 --model"
        )
    if source == "factory":
        module_name, _, factory = args.model.rpartition(":")
        if not module_name or not factory.isidentifier() or not all(p.isidentifier() for p in module_name.split(".")):
            raise ConfigError(f"--model {args.model!r}: expected package.module:factory (dotted module, then a name)")
    if args.model_kwargs is not None:
        if source != "factory":
            raise ConfigError("--model_kwargs applies to a package.module:factory --model only")
        kwargs = _model_kwargs(args.model_kwargs)
        if not isinstance(kwargs, dict):
            raise ConfigError(
                f"--model_kwargs {_shown(args.model_kwargs)}: expected a JSON object, e.g. '{{\"depth\": 4}}'"
            )
    if args.checkpoint is not None and source not in ("torchvision", "factory"):
        raise ConfigError("--checkpoint: a .pt2 --model holds its own weights; --checkpoint applies to the others")
    if args.aoti and args.compile:
        raise ConfigError("--aoti and --compile are two compile paths: give one (AOTInductor, or torch.compile)")
    if args.wire_dtype == "uint8" and inputs and not (len(inputs) == 1 and is_image_input(inputs[0])):
        raise ConfigError(
            "--wire_dtype uint8 sends raw pixels of one float32 [3, H, W] image input; these inputs are not that: "
            "use --wire_dtype float32"
        )
    return inputs


def _model_kwargs(text: str) -> object:
    """--model_kwargs read as JSON; ConfigError for whatever json.loads cannot read, which includes valid JSON past
    Python's own limits (an array nested deeper than its recursion limit, an integer of more digits than
    sys.get_int_max_str_digits)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--model_kwargs {_shown(text)}: not JSON ({exc})") from None
    except RecursionError:
        raise ConfigError(f"--model_kwargs {_shown(text)}: nested too deeply for Python's JSON reader") from None
    except (ValueError, MemoryError) as exc:
        reason = (str(exc).splitlines() or [""])[0][:200]
        raise ConfigError(
            f"--model_kwargs {_shown(text)}: cannot be read as JSON ({type(exc).__name__}: {reason})"
        ) from None


def _shown(text: str, limit_chars: int = 60) -> str:
    """A flag's value in a one-line message: quoted, and cut to its first `limit_chars` with its length when
    longer."""
    if len(text) <= limit_chars:
        return repr(text)
    return f"{text[:limit_chars] + '...'!r} ({len(text)} characters)"


def _check_applies(args: argparse.Namespace) -> None:
    """Flags given where they apply to nothing: refused before their values are judged."""
    check_load_flags(args)
    if args.stability_pct is None:
        for name, default in WINDOW_DEFAULTS.items():
            if getattr(args, name) != default:
                raise ConfigError(f"--{name} applies with --stability_pct only")
    if args.max_batch_size is None and args.max_queue_delay_ms is not None:
        raise ConfigError("--max_queue_delay_ms applies with --max_batch_size only")
    if args.planted_delay_us and not design_kind(args.design).one_thread:
        # A Python loop holds the GIL while it waits, which a forward's compute does not: with other Python threads
        # serving beside it, the wait would slow them too, and plant more than it says.
        raise ConfigError(
            f"--planted_delay_us applies to --design serial only (this run is --design {args.design}): its wait "
            "holds the GIL, which more compute would not"
        )


def _check_values(args: argparse.Namespace) -> None:
    """Single flags refused in words of their own rather than the bounds' "at least"/"at most". Before the bounds:
    NaN fails every comparison, and gets these words (e.g. "must be positive") rather than "must be at most"."""
    if args.device not in ("auto", "cpu", "cuda") and not args.device.startswith("cuda:"):
        raise ConfigError(f"--device {args.device!r}: expected auto, cpu, cuda or cuda:N")
    if not args.timeout_s > 0 or not args.warmup_timeout_s > 0 or not args.dist_timeout_s > 0:
        raise ConfigError("--timeout_s, --warmup_timeout_s and --dist_timeout_s must be positive")
    if not args.results_dir:
        raise ConfigError("--results_dir '': give a folder (the default is results)")
    name = args.output_file
    if not name or PurePath(name).name != name or name in (".", ".."):
        raise ConfigError(f"--output_file {name!r}: expected a plain file name inside --results_dir")
    check_file_name("--output_file", name, MAX_OUTPUT_FILE_BYTES)
    if not args.duration_s >= 0:
        raise ConfigError(f"--duration_s {args.duration_s}: must not be negative (a number of seconds)")
    if not args.inject_delay_ms >= 0:
        delay_ms = args.inject_delay_ms
        raise ConfigError(f"--inject_delay_ms {delay_ms:g}: must not be negative (a number of milliseconds)")
    if args.rate_rps is not None and not args.rate_rps > 0:
        raise ConfigError(f"--rate {args.rate_rps:g}: must be positive")
    if args.rate_rps is not None and args.rate_rps < MIN_RATE_RPS:  # its gaps would overflow the clocks
        raise ConfigError(f"--rate {args.rate_rps:g}: must be at least {MIN_RATE_RPS:g} (a request every 7 days)")
    if not MIN_BURSTINESS <= args.burstiness <= MAX_BURSTINESS:  # 1.0 unless poisson (checked above)
        raise ConfigError(
            f"--burstiness {args.burstiness:g}: must be between {MIN_BURSTINESS:g} (very bursty) "
            f"and {MAX_BURSTINESS:g} (nearly regular)"
        )
    if args.stability_pct is not None and not 0 < args.stability_pct <= 100:
        raise ConfigError(f"--stability_pct {args.stability_pct:g}: must be above 0 and at most 100 (a percentage)")
    if not args.window_s > 0:  # its default unless --stability_pct (checked above)
        raise ConfigError(f"--window_s {args.window_s:g}: must be positive")
    if args.max_queue_delay_ms is not None and not 0 <= args.max_queue_delay_ms <= MAX_QUEUE_DELAY_MS:
        raise ConfigError(
            f"--max_queue_delay_ms {args.max_queue_delay_ms:g}: must be between 0 and {MAX_QUEUE_DELAY_MS:g}"
        )
    if not 0 < args.ceiling_s <= MAX_CEILING_S:
        raise ConfigError(f"--ceiling_s {args.ceiling_s:g}: must be positive and at most {MAX_CEILING_S:g}")

    if args.slo_ms is not None and not args.slo_ms > 0:
        raise ConfigError(f"--slo_ms {args.slo_ms}: must be positive")


def check_bounds(args: argparse.Namespace) -> None:
    """The at-least and at-most bounds of every flag given a value, from its field's metadata, in field order."""
    for field in dataclasses.fields(BenchConfig):
        spec = flag_of(field)
        value = getattr(args, field.name, None)
        if spec is None or value is None:
            continue
        name = spec.flag_name(field.name)
        if spec.at_least is not None and not value >= spec.at_least:  # NaN fails too
            raise ConfigError(f"--{name} {value}: must be at least {spec.at_least}")
        # Finite and bounded: an inf or a huge value passes every lower bound, then overflows a timestamp, a
        # semaphore or a seed in the middle of the run.
        if spec.at_most is not None and not value <= spec.at_most:
            shown = (f"{value:g}", f"{spec.at_most:g}") if isinstance(value, float) else (str(value), str(spec.at_most))
            raise ConfigError(f"--{name} {shown[0]}: must be at most {shown[1]} ({spec.why})")


def default_ring_slots(one_request_bytes: int, requests_per_batch: int) -> int:
    """As many slots as fit RING_DEFAULT_BYTES, between 4 and 64: a few large requests fill a ring of 4, while
    one-image requests get room for the frontend to write ahead instead of waiting for each slot to come back; and
    at least two full formed batches."""
    fit = max(DEFAULT_RING_SLOTS, min(MAX_DEFAULT_RING_SLOTS, RING_DEFAULT_BYTES // max(one_request_bytes, 1)))
    return max(fit, 2 * requests_per_batch)


def _resolve_batching(args: argparse.Namespace) -> dict[str, Any]:
    """Checks the dynamic-batching flags and resolves the transport bounds that depend on them: a formed batch
    gathers up to max_batch_size // batch_size requests, and the ring (or the request queue) must hold two such
    batches, one being formed while the previous one's requests are still on their way to the device."""
    delay_ms = 0.0 if args.max_queue_delay_ms is None else args.max_queue_delay_ms + 0.0  # -0.0 becomes 0.0
    resolved: dict[str, Any] = {"max_queue_delay_ms": delay_ms}
    per_batch = 1
    if args.max_batch_size is not None:
        if not args.max_batch_size > args.batch_size:
            raise ConfigError(
                f"--max_batch_size {args.max_batch_size}: must be more than --batch_size "
                f"{args.batch_size} (the images of one request), or there is nothing to batch"
            )
        per_batch = args.max_batch_size // args.batch_size
        if per_batch < 2:  # whole requests only: one request per formed batch is no batching at all
            raise ConfigError(
                f"--max_batch_size {args.max_batch_size}: holds only one request of --batch_size {args.batch_size} "
                f"(whole requests are batched), so nothing would ever be batched; give at least "
                f"{2 * args.batch_size}"
            )
        if args.max_queue_delay_ms is not None and args.max_queue_delay_ms >= args.timeout_s * 1e3:
            raise ConfigError(
                f"--max_queue_delay_ms {args.max_queue_delay_ms:g}: a formed batch would wait longer than "
                f"--timeout_s {args.timeout_s:g} s declares the run hung; give a delay below it"
            )
        if 2 * per_batch > MAX_RING_SLOTS:
            raise ConfigError(
                f"--max_batch_size {args.max_batch_size}: a formed batch of {per_batch} requests of "
                f"{args.batch_size} image(s); at most {MAX_RING_SLOTS // 2} requests can be batched"
            )
    ring = transport_kind(args.transport).through_ring  # else queued: --max_queued_requests bounds them
    if args.ring_slots is None:
        if model_source(args.model) == "pt2" and not args.inputs:
            resolved["ring_slots"] = None  # the program's inputs size it: preflight reads them, then resolves it
        else:
            inputs = tuple(args.inputs or (image_input(args.image_size),))
            resolved["ring_slots"] = default_ring_slots(
                request_bytes(inputs, args.batch_size, args.wire_dtype), per_batch
            )
    elif args.max_batch_size is not None and ring and args.ring_slots < per_batch:
        raise ConfigError(
            f"--ring_slots {args.ring_slots}: a formed batch of --max_batch_size {args.max_batch_size} "
            f"gathers {per_batch} requests, each holding a slot; give at least {per_batch} "
            f"(default {2 * per_batch})"
        )
    if args.max_queued_requests is None:
        resolved["max_queued_requests"] = max(DEFAULT_MAX_QUEUED_REQUESTS, 2 * per_batch)
    elif args.max_batch_size is not None and not ring and args.max_queued_requests < per_batch:
        raise ConfigError(
            f"--max_queued_requests {args.max_queued_requests}: a formed batch of --max_batch_size "
            f"{args.max_batch_size} gathers {per_batch} requests from the queue; give at least "
            f"{per_batch} (default {2 * per_batch})"
        )
    return resolved


def _check_rank(args: argparse.Namespace, rank: RankInfo | None) -> None:
    """What a rank of a torchrun job cannot do, and what --instances needs."""
    if rank is not None and args.device.startswith("cuda:"):
        raise ConfigError(
            f"--device {args.device}: under torchrun each rank uses cuda:LOCAL_RANK; "
            "pass --device cuda (or auto, or cpu)"
        )
    if rank is not None and args.instances != 1:
        raise ConfigError(
            f"--instances {args.instances} under torchrun: each rank already runs its own backend on "
            "its own GPU, and the job's rows sum and merge per rank; run --instances without torchrun"
        )
    if args.inject_fault == "instance_exit" and args.instances < 2:
        raise ConfigError("--inject_fault instance_exit makes backend instance 1 exit: needs --instances 2 or more")
    refusal = load_kind(args.load).torchrun_refusal()
    if rank is not None and refusal is not None:
        raise ConfigError(refusal)
    if rank is not None and args.find_peak:
        raise ConfigError(
            "--find_peak under torchrun: each rank would search its own rates; search on one GPU, "
            "then run the job at the rate found (--load poisson --rate R)"
        )


def _resolve_num_workers(args: argparse.Namespace) -> int:
    design = design_kind(args.design)
    if args.num_workers is None:
        return design.default_workers
    if not design.many_workers and args.num_workers != 1:
        raise ConfigError(
            f"--num_workers {args.num_workers}: the {args.design} design has exactly one "
            f"prediction worker; use --design {' or '.join(k.name for k in DESIGN_KINDS if k.many_workers)} for several"
        )
    return args.num_workers


def _check_load(args: argparse.Namespace) -> dict[str, Any]:
    """What --find_peak searches itself, then what the load needs (its kind's checks); returns the fields its flags
    resolve to."""
    if args.find_peak and (args.rate_rps is not None or load_kind(args.load).pacing is Pacing.PLACES):
        raise ConfigError(
            "--find_peak searches the rate itself with Poisson runs: drop "
            + ("--rate" if args.rate_rps is not None else f"--load {args.load}")
        )
    if args.find_peak and args.slo_ms is None:
        raise ConfigError("--find_peak needs --slo_ms, the p99 target the peak rate must meet")
    return resolve_load(args)


def config_warnings(args: argparse.Namespace) -> list[str]:
    """Flags that mean nothing in this combination but harm nothing: said once, and the run goes on (scripts that
    pass a fixed set of flags keep working)."""
    warnings = []
    if args.ceiling is False and args.ceiling_s != CEILING_S_DEFAULT:
        warnings.append(f"--ceiling_s {args.ceiling_s:g} has no effect with --no-ceiling: no ceiling is timed")
    per_batch = args.max_batch_size // args.batch_size if args.max_batch_size is not None else 1
    closed = load_kind(args.load).pacing is Pacing.PLACES
    if per_batch > 1 and closed and args.concurrency is not None and args.concurrency < per_batch:
        delay_ms = args.max_queue_delay_ms or 0.0
        warnings.append(
            f"--load closed --concurrency {args.concurrency} keeps at most {args.concurrency} request(s) "
            f"outstanding: a formed batch of --max_batch_size {args.max_batch_size} ({per_batch} requests) never "
            f"fills, so every batch waits out --max_queue_delay_ms {delay_ms:g}; give --concurrency {per_batch} "
            "or more"
        )
    beyond = transport_kind(args.transport).network and args.target is None and args.host not in LOOPBACK_HOSTS
    if beyond and args.open_to_anyone:
        # Said as the door starts, not only in the summary after it stopped (a --serve_only door runs for hours).
        warnings.append(
            f"--host {args.host} --open_to_anyone: the door listens beyond this machine, with no authentication or "
            "TLS: anything that reaches the port can send it requests"
        )
    ring = transport_kind(args.transport).through_ring
    if per_batch > 1 and ring and args.ring_slots is not None and args.ring_slots < 2 * per_batch:
        warnings.append(
            f"--ring_slots {args.ring_slots} holds at most one formed batch of {per_batch} requests: the next "
            f"cannot start forming until that one is on the device; give --ring_slots {2 * per_batch} (the default)"
        )
    return warnings


def _experiment(args: argparse.Namespace, num_workers: int) -> str:
    design = experiment_label(args.design, num_workers)
    experiment = args.experiment or ("target" if args.target is not None else design)  # --target: not our design
    if args.experiment is None and args.instances > 1:  # a report must not pool them with one-instance runs
        experiment += f"_{args.instances}inst"
    check_file_name("--experiment", experiment, MAX_EXPERIMENT_CHARS)
    if not experiment.replace("_", "").replace("-", "").replace(".", "").isalnum() or not experiment.isascii():
        # It names files (detail files, traces) and report groups: ASCII, so that every filesystem and tool takes it.
        raise ConfigError(f"--experiment {experiment!r}: use ASCII letters, digits, '_', '-' and '.' only")
    return experiment
