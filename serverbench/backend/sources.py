"""The user's own model: a package.module:factory callable, a torch.export program (.pt2), or an AOTInductor package
(.pt2), and the AOTInductor compile path (--aoti) with its package cache.

Loading any of them runs the user's code (an import, or unpickling in torch.export.load): --help and the README say
so. Every refusal is a ValueError of one line, which preflight turns into exit status 2.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib
import inspect
import json
import logging
import os
import reprlib
import shutil
import sys
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from serverbench.backend.model_check import AOTI_MARKER
from serverbench.config.inputs import InputSpec
from serverbench.transport.tensors import TORCH_DTYPES

log = logging.getLogger("backend")
DTYPE_NAMES = {dtype: name for name, dtype in TORCH_DTYPES.items()}  # an exported input's dtype as --input names it


def build_factory_model(spec: str, kwargs_json: str | None) -> nn.Module:
    """Imports package.module (the current folder first, as `python -m` would, then the installed packages) and
    calls its factory with --model_kwargs; the result must be an nn.Module."""
    module_name, _, factory_name = spec.rpartition(":")
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)  # `python server.py` puts the script's folder first, not the current one
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - the user's import may raise anything
        raise ValueError(f"--model {spec}: cannot import {module_name} ({type(exc).__name__}: {_line(exc)})") from None
    factory = getattr(module, factory_name, None)
    if factory is None:
        raise ValueError(f"--model {spec}: {module_name} has no attribute {factory_name}")
    if not callable(factory):
        raise ValueError(f"--model {spec}: {factory_name} is a {type(factory).__name__}, not callable")
    kwargs = json.loads(kwargs_json) if kwargs_json else {}
    try:
        model = factory(**kwargs)
    except Exception as exc:  # noqa: BLE001
        raise ValueError(
            f"--model {spec}: {factory_name}(**{reprlib.repr(kwargs)}) raised {type(exc).__name__}: {_line(exc)}"
        ) from None
    if not isinstance(model, nn.Module):
        raise ValueError(f"--model {spec}: {factory_name} returned a {type(model).__name__}, not an nn.Module")
    return model


def _line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [""])[0][:300]


@dataclass(frozen=True)
class ProgramInputs:
    """The user inputs of an exported program, as the frontend generates them, and its batch dimension."""

    specs: tuple[InputSpec, ...]
    dynamic_batch: bool  # every input's first dimension is one symbol
    batch_range: tuple[int, int | None]  # the sizes that symbol may take (max None: unbounded)
    static_batch: int | None  # the batch the program was exported at, when fixed


class _Captured(logging.Handler):
    """What torch.export.load logs (a traceback, then a RuntimeError that only says "check the warnings above"):
    kept from the terminal, and its last line made the refusal's reason."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:
            text += f"\n{type(record.exc_info[1]).__name__}: {record.exc_info[1]}"
        self.lines.extend(line.strip() for line in text.splitlines() if line.strip())


def program_module(path: str, device: torch.device) -> nn.Module:
    """An exported program's module on `device`: torch.export writes the device it was traced on into the graph
    (an arange's device=, tensor metadata asserts), so the program is moved, not only its weights."""
    from torch.export.passes import move_to_device_pass

    return move_to_device_pass(load_program(path), device).module()


def load_program(path: str) -> torch.export.ExportedProgram:
    logger = logging.getLogger("torch.export")
    captured = _Captured()
    handlers, propagate = logger.handlers, logger.propagate
    logger.handlers, logger.propagate = [captured], False  # torch's own handler would print the traceback
    try:
        return torch.export.load(path)
    except Exception as exc:  # noqa: BLE001
        reason = captured.lines[-1] if captured.lines else f"{type(exc).__name__}: {_line(exc)}"
        raise ValueError(f"--model {path}: not a torch.export program ({reason[:300]})") from None
    finally:
        logger.handlers, logger.propagate = handlers, propagate


def program_inputs(program: torch.export.ExportedProgram, path: str) -> ProgramInputs:
    """The user-input placeholders' shapes and dtypes (their meta["val"]), the batch dimension taken off."""
    user_inputs = set(program.graph_signature.user_inputs)
    specs: list[InputSpec] = []
    batch_dims: list[Any] = []
    for node in program.graph.nodes:
        if node.op != "placeholder" or node.name not in user_inputs:
            continue
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"--model {path}: input {node.name} is a {type(value).__name__}, not a tensor")
        if value.dim() == 0:
            raise ValueError(f"--model {path}: input {node.name} is a scalar; every input needs a batch dimension")
        rest = []
        for dim in value.shape[1:]:
            if not isinstance(dim, int):
                raise ValueError(
                    f"--model {path}: input {node.name} has a dynamic dimension other than the batch ({dim}); "
                    "export it with every other dimension static"
                )
            rest.append(dim)
        if value.dtype not in DTYPE_NAMES:
            raise ValueError(f"--model {path}: input {node.name} is {value.dtype}, which the frontend cannot generate")
        specs.append(InputSpec(node.name, DTYPE_NAMES[value.dtype], tuple(rest)))
        batch_dims.append(value.shape[0])
    if not specs:
        raise ValueError(f"--model {path}: the program takes no tensor inputs")
    symbolic = [dim for dim in batch_dims if not isinstance(dim, int)]
    if symbolic:
        if len(symbolic) != len(batch_dims) or len({str(dim) for dim in symbolic}) != 1:
            raise ValueError(f"--model {path}: its inputs' batch dimensions differ ({', '.join(map(str, batch_dims))})")
        constraint = program.range_constraints.get(symbolic[0].node.expr)
        low = int(constraint.lower) if constraint is not None else 1
        upper = constraint.upper if constraint is not None else None
        high = None if upper is None or not upper.is_finite else int(upper)
        return ProgramInputs(tuple(specs), True, (low, high), None)
    if len(set(batch_dims)) != 1:
        raise ValueError(f"--model {path}: its inputs' batch dimensions differ ({', '.join(map(str, batch_dims))})")
    return ProgramInputs(tuple(specs), False, (batch_dims[0], batch_dims[0]), batch_dims[0])


def check_program_batch(found: ProgramInputs, path: str, batch_size: int, largest_rows: int) -> None:
    """A static batch must be --batch_size (and nothing batches requests into more rows); a dynamic one must allow
    every size the server runs (the request's, up to a full formed batch)."""
    if found.static_batch is not None:
        if found.static_batch != batch_size or largest_rows != batch_size:
            more = " and --max_batch_size cannot form larger batches" if largest_rows != batch_size else ""
            raise ValueError(
                f"--model {path}: exported with a static batch of {found.static_batch}; serve it with --batch_size "
                f"{found.static_batch}{more}, or export it with a dynamic batch dimension (torch.export.Dim)"
            )
        return
    low, high = found.batch_range
    if batch_size < low or (high is not None and largest_rows > high):
        raise ValueError(
            f"--model {path}: its batch dimension takes {low} to {high if high is not None else 'any'}; "
            f"this run needs {batch_size} to {largest_rows}"
        )


def check_inputs_match(given: tuple[InputSpec, ...], found: tuple[InputSpec, ...], path: str) -> None:
    """--input, when given with a program, must describe the program's own inputs (it may add value ranges)."""
    if len(given) != len(found):
        raise ValueError(f"--model {path}: takes {len(found)} input(s) ({_names(found)}), --input gives {len(given)}")
    for mine, theirs in zip(given, found):
        if (mine.dtype, mine.shape) != (theirs.dtype, theirs.shape):
            raise ValueError(
                f"--input {mine.describe()}: the program's input {theirs.name} is {theirs.dtype} "
                f"{'x'.join(map(str, theirs.shape)) or 'scalar'} per sample"
            )


def _names(specs: tuple[InputSpec, ...]) -> str:
    return ", ".join(f"{spec.name} {spec.dtype} {'x'.join(map(str, spec.shape))}" for spec in specs)


def aoti_problem() -> str | None:
    """Why AOTInductor cannot compile here, or None: the API missing from this torch, or no C++ compiler."""
    # By version, not by importing torch._inductor: that import logs about the CUDA toolkit on a machine without
    # a GPU, a line the refusal would not be alone on.
    if torch.torch_version.TorchVersion(torch.__version__) < (2, 6):
        return f"torch {torch.__version__} has no torch._inductor.aoti_compile_and_package (2.6 or newer has)"
    compiler = os.environ.get("CXX") or "c++"
    if shutil.which(compiler) is None and shutil.which("g++") is None and shutil.which("clang++") is None:
        return "no C++ compiler on PATH (c++, g++ or clang++; or name one in CXX): AOTInductor compiles C++"
    return None


def cuda_headers_problem() -> str | None:
    """For a GPU build: AOTInductor compiles against the CUDA toolkit's headers (cuda_runtime.h)."""
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME is None or not (Path(CUDA_HOME) / "include" / "cuda_runtime.h").is_file():
        return (
            f"the CUDA toolkit's headers are missing (CUDA_HOME={CUDA_HOME}): AOTInductor compiles against "
            "cuda_runtime.h for a GPU; install the toolkit or set CUDA_HOME"
        )
    return None


@dataclass
class AotiModel:
    """An AOTInductor package loaded for serving: its call, and the model instances (`runners`) it holds, sharing
    one set of weights (where the API lets runners be asked for; else 1)."""

    run: Callable[..., Any]
    runners: int


def load_aoti(path: str, runners: int, device_index: int) -> AotiModel:
    """Loads a package with `runners` model instances where load_package takes num_runners. Its call parses the
    package's input and output specs once here, not per call as AOTICompiledModel.__call__ does (two JSON tree
    specs per forward): the way a tuned server calls it."""
    from torch._inductor import package as aoti_package

    options: dict[str, Any] = {}
    if "num_runners" in inspect.signature(aoti_package.load_package).parameters:
        options["num_runners"] = runners
    else:
        runners = 1
    try:
        loaded = aoti_package.load_package(path, device_index=device_index, **options)
    except Exception as exc:  # noqa: BLE001
        raise ValueError(f"AOTInductor package {path}: cannot load ({type(exc).__name__}: {_line(exc)})") from None
    loader = loaded.loader
    out_spec = pytree.treespec_loads(loader.get_call_spec()[1])

    def run(*inputs: torch.Tensor) -> Any:
        return pytree.tree_unflatten(loader.boxed_run(list(inputs)), out_spec)  # boxed_run empties its list

    return AotiModel(run, runners)


def program_digest(program: torch.export.ExportedProgram, describe: str) -> str:
    """A hash of what the compiled code depends on: the exported graph's code (the model's forward as traced),
    every parameter, buffer and constant's bytes, and `describe` (the example's shapes, dtypes and strides, the
    precision, the device and torch's version)."""
    digest = hashlib.sha256(describe.encode())
    digest.update(program.graph_module.code.encode())
    digest.update(str(program.graph_signature).encode())
    tensors = {**program.state_dict, **{f"constant {k}": v for k, v in program.constants.items()}}
    for name, tensor in sorted(tensors.items(), key=lambda item: item[0]):
        digest.update(name.encode())
        if isinstance(tensor, torch.Tensor):
            digest.update(str((tuple(tensor.shape), tensor.dtype)).encode())
            # reshape(-1): a 0-dim tensor (BatchNorm's num_batches_tracked) cannot be viewed as bytes of another size
            digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        else:  # a script object or other constant: its repr
            digest.update(repr(tensor).encode())
    return digest.hexdigest()[:24]


def package_damage(package: Path) -> str | None:
    """What is wrong with a cached package's archive, or None: not a zip (cut short, its directory at the end is
    gone), a file whose bytes fail their CRC, or no AOTInductor files in it. The whole archive is read (tens of
    milliseconds for a model's package): a package that fails any of this fails every run it is served to."""
    try:
        with zipfile.ZipFile(package) as archive:
            bad = archive.testzip()  # every member read and checked against its CRC
            names = archive.namelist()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:
        return f"not a whole zip archive: {type(exc).__name__}: {_line(exc)}"
    if bad is not None:
        return f"{bad} fails its CRC check"
    if not any(AOTI_MARKER in name for name in names):
        return "it holds no AOTInductor files"
    return None


def compile_aoti(
    module: nn.Module,
    example: tuple[torch.Tensor, ...],
    batch_range: tuple[int, int] | None,
    cache_dir: Path,
    describe: str,
    timeout_s: float,
) -> tuple[str, bool]:
    """torch.export, then aoti_compile_and_package unless cache_dir already holds the package of the same program
    (program_digest), whole (package_damage: a damaged one is compiled again, and the log says so): returns the
    package's path and whether it was compiled now. A dynamic batch dimension when `batch_range` is given (dynamic
    batching serves several sizes), else every shape static. Several processes (--instances, a sweep) compile one
    package: a file lock makes the others wait for it, at most timeout_s."""
    dynamic_shapes = None
    if batch_range is not None:
        batch = torch.export.Dim("batch", min=batch_range[0], max=batch_range[1])
        dynamic_shapes = tuple({0: batch} for _ in example)
    with torch.no_grad():
        program = torch.export.export(module, example, dynamic_shapes=dynamic_shapes)
    shapes = [(tuple(t.shape), str(t.dtype), t.stride()) for t in example]
    key = program_digest(program, f"{describe}|{shapes}|batch {batch_range}|torch {torch.__version__}")
    cache_dir.mkdir(parents=True, exist_ok=True)
    package = cache_dir / f"{key}.pt2"
    with open(cache_dir / f"{key}.lock", "w") as lock_file:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"another process held the AOTInductor cache lock of {package} for {timeout_s:g} s"
                    ) from None
                time.sleep(0.2)
        if package.is_file():
            damage = package_damage(package)
            if damage is None:
                return str(package), False
            log.warning("AOTInductor cache: %s is damaged (%s): compiling it again", package, damage)
            package.unlink()
        partial = cache_dir / f"{key}.partial.pt2"  # renamed when complete: a killed compile leaves no package
        torch._inductor.aoti_compile_and_package(program, package_path=str(partial))
        os.replace(partial, package)
        return str(package), True
