"""Building the served model: a torchvision classifier by name (random weights or a local checkpoint), or identity.

Nothing is ever downloaded: weights come from a file on disk or from the seeded random initialisation.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from serverbench.backend.sources import build_factory_model, program_module
from serverbench.config.limits import IDENTITY_MODEL


class IdentityModel(nn.Module):
    """A per-sample sum: reads every input byte, returns [B, 1, 1, 1]; measures the server without a model. One op,
    casting as it reads and keeping its dimensions: at one image per request this forward is part of the server's
    own cost, and in the pipelined design every torch op lets another serving thread take the GIL (a thread switch
    each). On torch 2.15 this took 3.8-4.0 us on a 1x3x16x16 request, a flatten then a sum 5.7 us."""

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return images.sum((1, 2, 3), keepdim=True, dtype=torch.float32)


def classification_models() -> list[str]:
    import torchvision

    return sorted(torchvision.models.list_models(module=torchvision.models))


def is_known_model(name: str) -> bool:
    return name == IDENTITY_MODEL or name in classification_models()


def checkpoint_filenames(name: str) -> list[str]:
    """File names torchvision gives the published checkpoints of `name` (e.g. resnet18-f37072fd.pth)."""
    if name == IDENTITY_MODEL:
        return []
    import torchvision

    try:
        weights_enum = torchvision.models.get_model_weights(name)
    except (ValueError, KeyError):
        return []
    return [Path(weights.url).name for weights in weights_enum]


PROBE_SIZES = (32, 64, 75, 96, 128, 160, 224, 256, 299, 384, 512)  # image sizes tried to say which a model takes


def check_image_size(name: str, image_size: int) -> None:
    """Raises ValueError (one line, with the sizes that work among PROBE_SIZES) unless `name` runs a forward at
    image_size x image_size. On the meta device: no weights, no arithmetic, tens of milliseconds, so a size the
    model cannot take is refused before any process starts rather than at the first forward."""
    if name == IDENTITY_MODEL:
        return
    import warnings

    import torchvision

    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")  # construction-time notices (inception_v3's init weights)
        module = torchvision.models.get_model(name, weights=None).eval()

    def fails(size: int) -> str | None:
        try:
            with torch.inference_mode():
                module(torch.empty(1, 3, size, size, device="meta"))
        except Exception as exc:  # noqa: BLE001 - any failure means the model cannot take this size
            return (str(exc).splitlines() or [type(exc).__name__])[0][:160]
        return None

    problem = fails(image_size)
    if problem is None:
        return
    works = [size for size in PROBE_SIZES if fails(size) is None]
    if not works:
        takes = f"none of {', '.join(map(str, PROBE_SIZES))} works either"
    elif works == list(PROBE_SIZES[PROBE_SIZES.index(works[0]) :]):
        takes = f"it takes {works[0]}x{works[0]} or larger (of the sizes tried)"
    else:
        takes = f"of the sizes tried it takes {', '.join(f'{s}x{s}' for s in works)}"
    raise ValueError(
        f"--model {name} cannot take {image_size}x{image_size} images ({problem}); {takes}: set --image_size"
    )


@dataclass(frozen=True)
class BuiltModel:
    module: nn.Module
    build_s: float  # construction (and checkpoint load), moved to the device
    torch_load_time_s: float | None  # torch.load of the checkpoint alone; None with random weights


def load_fitting_state_dict(module: nn.Module, name: str, checkpoint: str) -> tuple[dict, float]:
    """The checkpoint's state dict (torch.load with mmap and weights_only=True) once it is sure to fit `module`
    exactly, and the torch.load time; ValueError in one line otherwise."""
    _check_is_torch_file(checkpoint)
    start_ns = time.perf_counter_ns()
    try:
        state_dict = torch.load(checkpoint, map_location="cpu", mmap=True, weights_only=True)
    except Exception as exc:  # corrupt file, pickle that weights_only refuses, ...
        raise ValueError(f"cannot load checkpoint {checkpoint}: {type(exc).__name__}: {exc}") from exc
    load_s = (time.perf_counter_ns() - start_ns) / 1e9
    if not isinstance(state_dict, dict):
        raise ValueError(f"checkpoint {checkpoint} holds a {type(state_dict).__name__}, not a state dict")
    mismatch = state_dict_mismatch(module, state_dict)
    if mismatch:
        raise ValueError(f"checkpoint {checkpoint} does not fit model {name}: {mismatch}")
    return state_dict, load_s


def load_checkpoint_into(name: str, checkpoint: str) -> tuple[nn.Module, float]:
    """Builds `name` on the meta device and assigns the checkpoint's tensors (mmap: no copy until used)."""
    import torchvision

    with torch.device("meta"):
        module = torchvision.models.get_model(name, weights=None)
    state_dict, load_s = load_fitting_state_dict(module, name, checkpoint)
    try:
        module.load_state_dict(state_dict, strict=True, assign=True)
    except RuntimeError as exc:
        raise ValueError(f"checkpoint {checkpoint} does not fit model {name}: {exc}") from exc
    leftover = [n for n, t in list(module.named_parameters()) + list(module.named_buffers()) if t.is_meta]
    if leftover:
        raise ValueError(f"checkpoint {checkpoint} leaves {len(leftover)} tensors of {name} unset, e.g. {leftover[0]}")
    return module, load_s


def _check_is_torch_file(checkpoint: str) -> None:
    """torch.save writes a zip archive (or, before torch 1.6, a pickle): anything else is named for what it is
    rather than left to torch.load's message about _use_new_zipfile_serialization."""
    import zipfile

    path = Path(checkpoint)
    size = path.stat().st_size
    if size == 0:
        raise ValueError(f"checkpoint {checkpoint} is empty (0 bytes)")
    with open(path, "rb") as f:
        head = f.read(16)
    if not zipfile.is_zipfile(path) and not head.startswith(b"\x80"):  # pickle protocol 2+ starts with 0x80
        kind = "a text file" if all(32 <= b < 127 or b in b"\t\r\n" for b in head) else "not a torch.save file"
        raise ValueError(
            f"checkpoint {checkpoint} is {kind} ({size} bytes, starts with {head[:12]!r}), not a torch.save state dict"
        )


def state_dict_mismatch(module: nn.Module, state_dict: dict, shown: int = 3) -> str:
    """What keeps `state_dict` from loading into `module`, in one line (the first few of each kind), or ''."""
    expected = module.state_dict(keep_vars=True)  # shapes only: the module lives on the meta device
    missing = [k for k in expected if k not in state_dict]
    unexpected = [k for k in state_dict if k not in expected]
    shapes = [
        f"{k} {list(state_dict[k].shape)} in the file, {list(expected[k].shape)} in the model"
        for k in expected
        if k in state_dict
        and hasattr(state_dict[k], "shape")
        and tuple(state_dict[k].shape) != tuple(expected[k].shape)
    ]
    parts = []
    for what, items in (("missing", missing), ("unexpected", unexpected), ("with another shape", shapes)):
        if items:
            more = "; ..." if len(items) > shown else ""
            parts.append(f"{len(items)} key(s) {what} ({'; '.join(items[:shown])}{more})")
    return ", ".join(parts)


def check_checkpoint(name: str, checkpoint: str) -> None:
    """Raises ValueError unless `checkpoint` loads with weights_only=True and fits `name` exactly; cheap (mmap,
    a meta-device model), so bad files are refused before any process starts."""
    load_checkpoint_into(name, checkpoint)


def load_state_dict_file(module: nn.Module, name: str, checkpoint: str) -> float:
    """A state-dict --checkpoint into a module already built (a factory's): weights_only=True, every key exact.
    Returns the torch.load time."""
    state_dict, load_s = load_fitting_state_dict(module, name, checkpoint)
    module.load_state_dict(state_dict, strict=True)
    return load_s


def check_no_meta_tensors(module: nn.Module, name: str, device: torch.device) -> None:
    """ValueError in one line naming a parameter or buffer on the meta device: it has a shape and no data, so
    module.to(device) cannot copy it (torch's NotImplementedError, a traceback of its own)."""
    tensors = [("parameter", n, t) for n, t in module.named_parameters()]
    tensors += [("buffer", n, t) for n, t in module.named_buffers()]
    meta = [(kind, tensor_name) for kind, tensor_name, tensor in tensors if tensor is not None and tensor.is_meta]
    if not meta:
        return
    kind, tensor_name = meta[0]
    more = f" (and {len(meta) - 1} more tensor(s) there)" if len(meta) > 1 else ""
    raise ValueError(
        f"--model {name}: {kind} {tensor_name} is on the meta device (a shape without data){more}, so the model "
        f"cannot be moved to {device}: give it real tensors (e.g. module.to_empty(device=...), then load its weights)"
    )


def build_model(
    name: str, device: torch.device, seed: int, checkpoint: str | None, model_kwargs: str | None = None
) -> BuiltModel:
    """Returns the model in eval mode on `device`, without gradients: identity, a torchvision classifier, a
    factory's module or an exported program's (an AOTInductor package is loaded by prepare.py instead)."""
    start_ns = time.perf_counter_ns()
    torch_load_time_s: float | None = None
    if name == IDENTITY_MODEL:
        module: nn.Module = IdentityModel()
    elif ":" in name:
        torch.manual_seed(seed)  # a factory that initialises randomly gets the same weights in every process
        module = build_factory_model(name, model_kwargs)
        if checkpoint is not None:
            torch_load_time_s = load_state_dict_file(module, name, checkpoint)
    elif name.endswith(".pt2"):
        module = program_module(name, device)  # an exported module has no train/eval switch: exported as it is
    elif checkpoint is not None:
        module, torch_load_time_s = load_checkpoint_into(name, checkpoint)
    else:
        import torchvision

        torch.manual_seed(seed)  # weights do not change speed, but runs stay reproducible
        module = torchvision.models.get_model(name, weights=None)
    check_no_meta_tensors(module, name, device)
    module = module.to(device)
    if not name.endswith(".pt2"):
        module = module.eval()
    module = module.requires_grad_(False)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return BuiltModel(module, (time.perf_counter_ns() - start_ns) / 1e9, torch_load_time_s)
