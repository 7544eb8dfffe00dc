"""A built BenchConfig checked against this machine before any process starts: the device, the model and its
checkpoint, memory, shared memory, open files, disk, and the results folder (made here).

Each refusal is a ConfigError of one line. torch and torchvision are imported only where a check needs them: the
server of the identity model on the CPU never imports them (seconds per run).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import sys
from pathlib import Path

from serverbench.backend.model_check import probe_forward, pt2_kind
from serverbench.config.build import default_ring_slots
from serverbench.config.design_kinds import design_kind
from serverbench.config.door_checks import TOKEN
from serverbench.config.door_options import (
    AUTH_TOKEN_ENV,
    DOOR_EXTRA,
    DOOR_PACKAGES,
    LOOPBACK_HOSTS,
    NETWORK_TRANSPORTS,
)
from serverbench.config.flags import ConfigError
from serverbench.config.inputs import model_source
from serverbench.config.limits import AOTI_CACHE_FOLDER, CUDAGRAPH_COMPILE_MODES, IDENTITY_MODEL, LOADGEN_MODULE
from serverbench.config.load_kind import Pacing
from serverbench.config.loads import load_kind
from serverbench.config.options import BenchConfig, RankInfo
from serverbench.config.paths import check_input_file, check_output_folder, check_path_names
from serverbench.config.transport_kinds import Hop, request_hop, transport_kind
from serverbench.load.loadgen import LOG_FOLDER
from serverbench.records.benchmark_db import wants_records
from serverbench.records.row import DETAIL_FOLDERS
from serverbench.system.net import listen
from serverbench.transport.channels import shm_need_bytes

TARGET_TIMEOUT_S = 10.0  # how long the --target server may take to describe its model


def preflight(cfg: BenchConfig, forwards_tried: set[tuple] | None = None) -> BenchConfig:
    """Checks a config from build_config against this machine, in the order a user meets the refusals (the model
    before the resources it needs, the folder made last); returns it with the device resolved ("cpu" or "cuda:N")
    and checkpoint, model_dir and results_dir absolute. Raises ConfigError. `forwards_tried`: a study's checks of
    many configurations of one model try the user model's forward (seconds in a child process) once for each
    forward_key, which is added to the set."""
    _check_core_installed(cfg.model)
    if load_kind(cfg.load).pacing is Pacing.DRIVER:  # MLPerf LoadGen drives it
        _check_loadgen_importable()
    if cfg.transport in NETWORK_TRANSPORTS:  # --transport http|grpc, --target, --serve_only
        feature = "--target" if cfg.target else "--serve_only" if cfg.serve_only else f"--transport {cfg.transport}"
        check_installed(feature, DOOR_EXTRA, DOOR_PACKAGES)
    if cfg.transport in NETWORK_TRANSPORTS:
        cfg = _resolve_token(cfg)
    _check_connections(cfg)
    if cfg.target is not None:
        return _preflight_target(cfg)
    if cfg.transport in NETWORK_TRANSPORTS:
        cfg = dataclasses.replace(cfg, port=_free_port(cfg.host, cfg.port))
    source = model_source(cfg.model)
    if source == "torchvision" and not _models().is_known_model(cfg.model):
        raise ConfigError(
            f"--model {cfg.model!r}: not a torchvision classification model, '{IDENTITY_MODEL}', "
            "package.module:factory nor a .pt2 file"
        )
    try:
        if source == "pt2":
            cfg = _probe().resolve_pt2(cfg)  # its inputs, before the resources they need are counted
            if cfg.ring_slots is None:  # the default, sized by the program's inputs
                per_batch = cfg.formed_rows // cfg.batch_size
                cfg = dataclasses.replace(cfg, ring_slots=default_ring_slots(cfg.request_bytes, per_batch))
    except ValueError as exc:
        raise ConfigError(_one_line(exc)) from None
    _check_resources(cfg)  # before a forward at that size is tried, even on the meta device
    try:
        if source == "torchvision":
            _models().check_image_size(cfg.model, cfg.image_size)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None

    device = _resolve_device(cfg.device) if cfg.rank is None else _rank_device(cfg.device, cfg.rank)
    _check_model_options(cfg, device)
    checkpoint = _resolve_checkpoint(cfg.model, cfg.checkpoint, cfg.model_dir)
    cfg = dataclasses.replace(cfg, device=device, checkpoint=checkpoint)
    try:
        if checkpoint is not None and source == "torchvision":
            _models().check_checkpoint(cfg.model, checkpoint)
        if cfg.aoti or (source == "pt2" and pt2_kind(cfg.model) == "aoti"):
            _probe().check_aoti(cfg)
        if source in ("factory", "pt2") and (forwards_tried is None or forward_key(cfg) not in forwards_tried):
            probe_forward(cfg)  # in a child process; a factory's checkpoint is loaded there too
            if forwards_tried is not None:
                forwards_tried.add(forward_key(cfg))
    except ValueError as exc:
        raise ConfigError(_one_line(exc)) from None
    results_dir = _check_results_dir(cfg.results_dir, cfg.output_file)
    return dataclasses.replace(
        cfg,
        save_pytorch_benchmark=wants_records(cfg.save_pytorch_benchmark, os.environ),
        results_dir=results_dir,
        model_dir=str(Path(cfg.model_dir).expanduser().resolve()),
    )


def forward_key(cfg: BenchConfig) -> tuple:
    """What the user model's forward check depends on (backend/probe.py: the model, its inputs, the rows tried, the
    wire dtype); not the design, the transport or the compile path, which it does not see."""
    return (
        cfg.model,
        cfg.model_kwargs,
        cfg.checkpoint,
        cfg.model_inputs,
        cfg.batch_size,
        cfg.formed_rows,
        cfg.wire_dtype,
        cfg.seed,
        cfg.device,
    )


def _preflight_target(cfg: BenchConfig) -> BenchConfig:
    """--target: the server is someone else's; what our frontend needs is its model's inputs (unless --input gives
    them) and the results folder. Nothing of ours runs a model, so the device is the frontend's CPU."""
    inputs = cfg.inputs
    if not inputs:
        try:
            metadata = _metadata().fetch_model_metadata(
                cfg.transport, cfg.host, cfg.port, cfg.model_name, TARGET_TIMEOUT_S, cfg.auth_token
            )
            inputs = _metadata().inputs_of(metadata)
        except ValueError as exc:
            raise ConfigError(f"--target {cfg.target}: {_one_line(exc)}") from None
    cfg = dataclasses.replace(cfg, device="cpu", inputs=inputs)
    # The request pool the metadata's shapes ask for, against this machine's memory ([-1, 100000, 100000] failed
    # at a 40 GB allocation, mid-run, with a traceback); before the results folder is made.
    _check_resources(cfg)
    return dataclasses.replace(cfg, results_dir=_check_results_dir(cfg.results_dir, cfg.output_file))


def _resolve_token(cfg: BenchConfig) -> BenchConfig:
    """--auth_token, else $SERVERBENCH_AUTH_TOKEN; a door beyond loopback without one is refused unless
    --open_to_anyone says so."""
    # The environment's token is for a door beyond this machine and for a --target: a loopback door of a bench tool
    # (which polls it without a token) is unaffected by one exported in the shell
    beyond = cfg.target is not None or cfg.host not in LOOPBACK_HOSTS
    token = cfg.auth_token or (os.environ.get(AUTH_TOKEN_ENV) if beyond else None) or None
    if token is not None and not TOKEN.fullmatch(token):
        raise ConfigError(f"${AUTH_TOKEN_ENV}: 8 to 256 of letters, digits and -._~+/= (a header value as it is)")
    if cfg.target is None and cfg.host not in LOOPBACK_HOSTS and token is None and not cfg.open_to_anyone:
        raise ConfigError(
            f"--host {cfg.host}: a door beyond this machine serves only requests that carry a token: give "
            f"--auth_token (or set ${AUTH_TOKEN_ENV}), or --open_to_anyone to let anything that reaches the port in"
        )
    return dataclasses.replace(cfg, auth_token=token)


def _free_port(host: str, port: int) -> int:
    """The door's port, proven free by binding it here (0: the one the OS picks); ConfigError when it is taken."""
    try:
        with listen(host, port) as sock:
            return sock.getsockname()[1]
    except OSError as exc:
        raise ConfigError(f"--host {host} --port {port}: cannot listen there ({exc.strerror or exc})") from None


def _one_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [type(exc).__name__])[0][:600]


def _probe():
    """probe.py, imported for a .pt2 model or --aoti only (it imports torch); a factory's check needs only
    model_check, which starts probe.py as a child."""
    from serverbench.backend import probe

    return probe


def _models():
    """models.py, imported when a real model needs it: it imports torch, which costs the server seconds per run."""
    from serverbench.backend import models

    return models


def _metadata():
    """metadata.py, imported for --target only: it needs the door extra's packages, which check_installed has
    found by then (a run over shm or queues never imports them)."""
    from serverbench.transport import metadata

    return metadata


def _first_missing(packages: dict[str, str]) -> str | None:
    """The first of `packages` (import name -> package) this Python cannot find, else None. Looked up without
    importing (find_spec): a run pays nothing for the check."""
    for module, package in packages.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a broken or blocked install is as good as none
            found = False
        if not found:
            return package
    return None


def check_installed(feature: str, extra: str, packages: dict[str, str]) -> None:
    """ConfigError in one line naming the first of `packages` (import name -> package) this Python cannot find,
    and the extra of pyproject.toml that installs it."""
    if (package := _first_missing(packages)) is not None:
        raise ConfigError(
            f"{feature} needs {package}, which is not installed: pip install -e '.[{extra}]' "
            "(./venv.sh installs it), or choose --transport shm or queue"
        )


# What every run's processes import (pyproject.toml's dependencies), import name -> package; torchvision for its
# models. The server's own process imports none of them before its children start.
CORE_PACKAGES = {"torch": "torch", "numpy": "numpy", "pandas": "pandas", "tqdm": "tqdm"}


def _check_core_installed(model: str) -> None:
    """ConfigError in one line when this Python lacks a package every run needs (a bare python3 in place of the
    project's environment): its processes would die one after another after starting."""
    needed = CORE_PACKAGES | ({"torchvision": "torchvision"} if model_source(model) == "torchvision" else {})
    if (package := _first_missing(needed)) is not None:
        raise ConfigError(
            f"this Python ({sys.executable}) has no {package}, which every run needs: run it with the project's "
            "environment (./venv.sh python server.py ...), or pip install -e ."
        )


def _check_loadgen_importable() -> None:
    """--load loadgen: the frontend drives the run with MLPerf LoadGen (the mlcommons-loadgen package), imported
    there only for this load; a machine without it is refused here, before anything is written."""
    try:
        importlib.import_module(LOADGEN_MODULE)
    except ImportError as exc:
        why = " ".join(str(exc).split())  # one line, whatever the loader said
        raise ConfigError(
            f"--load loadgen: MLPerf LoadGen cannot be imported ({why}); install mlcommons-loadgen "
            "(./venv.sh installs it) or choose another --load"
        ) from None


def _resolve_device(requested: str) -> str:
    """auto, cpu, cuda or cuda:N (build_config refused any other) as the device this machine gives."""
    if requested == "cpu":
        return "cpu"  # without importing torch: the server of a CPU run never needs it
    import torch

    from serverbench.device.layer import unusable_gpu_reason

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
    or the CPU. build_config refused --device cuda:N under torchrun."""
    if _resolve_device(requested) == "cpu":
        return "cpu"
    import torch

    count = torch.cuda.device_count()
    if count == 1:
        if rank.local_world_size > 1 and "CUDA_VISIBLE_DEVICES" not in os.environ:
            # One GPU on the node for several ranks: they would share it, and each would time the others' work.
            raise ConfigError(
                f"{rank.local_world_size} ranks on this node but it has one GPU: they would share it; "
                "start one rank per GPU (--nproc_per_node), or give each rank its own GPU with "
                "CUDA_VISIBLE_DEVICES"
            )
        return "cuda:0"
    if rank.local_rank < count:
        return f"cuda:{rank.local_rank}"
    raise ConfigError(
        f"rank {rank.rank} (LOCAL_RANK {rank.local_rank}): only {count} GPUs are visible to it; start "
        f"at most {count} ranks per node (--nproc_per_node), or give each rank one GPU "
        "(CUDA_VISIBLE_DEVICES)"
    )


def _check_model_options(cfg: BenchConfig, device: str) -> None:
    """The model options that depend on the device resolved."""
    if (
        device.startswith("cuda")
        and cfg.compile
        and cfg.compile_mode in CUDAGRAPH_COMPILE_MODES
        and not design_kind(cfg.design).one_thread
    ):
        # CUDA graph trees keep per-thread state: a graph captured on the compiling thread and replayed from
        # serving threads fails or corrupts (pytorch/pytorch#123177).
        raise ConfigError(
            f"--compile_mode {cfg.compile_mode} captures CUDA graphs, which are not safe across the "
            f"{cfg.design} design's threads; use --design serial, or --compile_mode "
            "max-autotune-no-cudagraphs"
        )
    if device.startswith("cuda") and cfg.planted_delay_us:
        raise ConfigError(
            "--planted_delay_us busy-waits the host after each forward; on a GPU the forward runs on meanwhile, so "
            "it plants no known slowdown: plant differences with --device cpu"
        )
    if device == "cpu" and cfg.precision == "tf32":
        raise ConfigError("--precision tf32: TF32 is a CUDA tensor-core format; use fp32 or bf16 on the CPU")


def _resolve_checkpoint(model: str, checkpoint: str | None, model_dir: str) -> str | None:
    """--checkpoint as an absolute path, else the torchvision checkpoint file found in --model_dir, else None.
    build_config refused a checkpoint for the identity model."""
    if checkpoint is not None:
        return str(check_input_file("--checkpoint", checkpoint).resolve())
    folder = Path(model_dir).expanduser()
    if not folder.is_dir():
        raise ConfigError(f"--model_dir {model_dir}: no such folder")
    if model_source(model) != "torchvision":
        return None  # only torchvision's published checkpoints have names to look for
    for name in _models().checkpoint_filenames(model):
        if (folder / name).is_file():
            return str((folder / name).resolve())
    return None


# The folders a run may make under --results_dir
RUN_FOLDERS = (*DETAIL_FOLDERS, LOG_FOLDER, AOTI_CACHE_FOLDER)


def _check_results_dir(results_dir: str, output_file: str) -> str:
    """The results folder exists (made if need be) and the row can be written there: checked before the run, so
    that a run's row is not lost at its end. build_config checked that output_file is a plain file name."""
    folder = check_output_folder("--results_dir", results_dir)
    path = folder / output_file
    if output_file in RUN_FOLDERS:
        raise ConfigError(
            f"--output_file {output_file}: a run may make the folder {path} for its detail files; choose another "
            f"name (e.g. {output_file}.csv)"
        )
    if path.is_dir():
        raise ConfigError(f"--output_file {output_file}: {path} is a folder, not a CSV file")
    if path.exists() and not path.is_file():  # a FIFO would block the row's write for ever, after the whole run
        raise ConfigError(f"--output_file {output_file}: {path} is not a regular file (a pipe, a device?)")
    if path.exists() and not os.access(path, os.W_OK):
        raise ConfigError(
            f"--output_file {output_file}: {path} is not writable (read-only?); choose another "
            "--output_file or make it writable"
        )
    try:  # the last check: a refused run leaves no folder behind
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--results_dir {results_dir}: cannot create it ({exc.strerror})") from exc
    return str(folder.resolve())


def _available_memory_bytes() -> int | None:
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


def _free_bytes(folder: str) -> int | None:
    try:
        stat = os.statvfs(folder)
    except OSError:
        return None
    return stat.f_bavail * stat.f_frsize


def _is_pseudo_filesystem(folder: str) -> bool:
    """A filesystem with no blocks at all (/proc, /sys): its "free space" is 0 and nothing can be written there."""
    try:
        return os.statvfs(folder).f_blocks == 0
    except OSError:
        return False


def _open_files_limit() -> int | None:
    import resource

    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else soft


def _check_connections(cfg: BenchConfig) -> None:
    """A transport with a connection per request in flight (http), under a load that fixes how many are out at once
    (a closed loop): those many open files in the frontend and in the door, within the limit on them."""
    at_once = load_kind(cfg.load).most_in_flight(cfg)
    limit = _open_files_limit()
    if not transport_kind(cfg.transport).connection_per_request or at_once is None or limit is None:
        return
    count, flag = at_once
    if BASE_OPEN_FILES + count > limit:
        raise ConfigError(
            f"--transport {cfg.transport} holds a connection per request in flight, and --load {cfg.load} has {count} "
            f"out at once ({flag}): about {BASE_OPEN_FILES + count} open files in the frontend and in the door, over "
            f"the limit of {limit} (ulimit -Hn, which the server takes whole); lower {flag}, or raise the limit"
        )


SHM_FOLDER = "/dev/shm"
BASE_OPEN_FILES = 256  # what the three processes, torch and the queues hold before any request
RESULTS_BYTES_PER_REQUEST = {"save_requests": 1024, "trace": 2048}  # detail files, generously


def _gib(n_bytes: float) -> str:
    return f"{n_bytes / 2**30:.2f} GiB" if n_bytes >= 2**28 else f"{n_bytes / 2**20:.1f} MiB"


def _check_resources(cfg: BenchConfig) -> None:
    """Memory, shared memory, open files and disk space the run needs, against what this machine has now:
    ConfigError with what is needed, what is there and what makes it fit, before any process starts."""
    one_request = cfg.request_bytes
    images = not cfg.inputs  # the built-in models' image, sized by --image_size
    request_size = f"--image_size {cfg.image_size}" if images else f"{_gib(one_request / cfg.batch_size)} a sample"
    size_flag = "--image_size" if images else "the --input shapes"
    pool_bytes = one_request * cfg.request_pool_size
    hop = request_hop(cfg)
    shm_bytes = shm_need_bytes(cfg)
    if hop is Hop.RING:
        shm_what, shm_flag = f"the ring (--ring_slots {cfg.ring_slots})", "--ring_slots"
    elif hop is Hop.NONE:  # the requests arrive in the backend's own process
        shm_what, shm_flag = "", ""
    else:
        in_transit = cfg.max_queued_requests + cfg.max_inflight
        shm_what = f"requests in transit (--max_queued_requests + --max_inflight = {in_transit})"
        shm_flag = "--max_queued_requests"
    available = _available_memory_bytes()
    if available is not None and pool_bytes + shm_bytes > available:
        raise ConfigError(
            f"--batch_size {cfg.batch_size} x {request_size}: the request pool"
            + (f" and {shm_what} need " if shm_what else " needs ")
            + f"{_gib(pool_bytes + shm_bytes)}, more than the {_gib(available)} of memory available now; lower "
            + (
                f"--batch_size, {size_flag}, --request_pool_size or {shm_flag}"
                if shm_flag
                else f"--batch_size, {size_flag} or --request_pool_size"
            )
        )
    shm_free = _free_bytes(SHM_FOLDER) if os.path.isdir(SHM_FOLDER) else None
    if shm_free is not None and shm_bytes > shm_free:
        raise ConfigError(
            f"{shm_what} need {_gib(shm_bytes)} of shared memory, and {SHM_FOLDER} has "
            f"{_gib(shm_free)} free; lower {shm_flag} or --batch_size, or enlarge {SHM_FOLDER} "
            "(docker run --shm-size)"
        )
    limit = _open_files_limit()
    files_needed = BASE_OPEN_FILES + (
        cfg.max_queued_requests + cfg.max_inflight if hop is Hop.QUEUE else 0
    )  # each queued request's segment travels as a file descriptor
    if limit is not None and files_needed > limit:
        raise ConfigError(
            f"--transport queue with --max_queued_requests {cfg.max_queued_requests}: about "
            f"{files_needed} open files are needed and the limit is {limit}; lower "
            "--max_queued_requests, or raise the limit (ulimit -n)"
        )
    results_bytes = 1 << 20  # the row, its lock, the summary
    results_bytes += sum(
        per_request * (cfg.num_iters + cfg.warmup_iters)
        for flag, per_request in RESULTS_BYTES_PER_REQUEST.items()
        if getattr(cfg, flag)
    )
    folder = check_path_names("--results_dir", cfg.results_dir)  # one too long cannot even be looked up
    while not folder.exists() and folder != folder.parent:  # the nearest folder that exists: where it will go
        folder = folder.parent
    if _is_pseudo_filesystem(str(folder)):
        raise ConfigError(
            f"--results_dir {cfg.results_dir}: {folder} is not on a disk (a kernel filesystem such as /proc or /sys); "
            "choose a folder on a disk"
        )
    disk_free = _free_bytes(str(folder))
    if disk_free is not None and results_bytes > disk_free:
        raise ConfigError(
            f"--results_dir {cfg.results_dir}: the results need about {_gib(results_bytes)} and the "
            f"disk has {_gib(disk_free)} free; free some space or choose another --results_dir"
        )
