"""A model's inputs, described once: `--input name:dtype:shape[:low-high]` parsed into an InputSpec, the default
image input of the built-in models, and the bytes a request of them takes on the wire.

Pure: no torch (the configuration is built without it); dtypes are names, and the frontend and backend turn them
into torch dtypes where they make tensors.
"""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import dataclass
from typing import NamedTuple

from serverbench.config.limits import IDENTITY_MODEL


class Dtype(NamedTuple):
    """What the configuration needs to know of an element type, without torch."""

    nbytes: int  # bytes per element
    is_float: bool
    smallest: float | None  # the smallest and largest value it holds; None: a float, any finite range
    largest: float | None


# Every dtype an input may have, by name: the one table of them. Each name is torch's own (torch.<name>), so the
# torch side derives its table as {name: getattr(torch, name) for name in DTYPES}.
DTYPES: dict[str, Dtype] = {
    "float32": Dtype(4, True, None, None),
    "float16": Dtype(2, True, -65504.0, 65504.0),
    "bfloat16": Dtype(2, True, None, None),
    "float64": Dtype(8, True, None, None),
    "int64": Dtype(8, False, -(2**63), 2**63 - 1),
    "int32": Dtype(4, False, -(2**31), 2**31 - 1),
    "int16": Dtype(2, False, -(2**15), 2**15 - 1),
    "int8": Dtype(1, False, -128, 127),
    "uint8": Dtype(1, False, 0, 255),
    "bool": Dtype(1, False, 0, 1),
}
IMAGE_INPUT = "image"  # the built-in models' one input: [3, H, W] float32 images
MAX_INPUTS = 64
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_NUMBER = r"-?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?"
_RANGE = re.compile(rf"({_NUMBER})-({_NUMBER})\Z")
INPUT_FORMAT = "name:dtype:shape[:low-high], e.g. ids:int64:128:0-999 or image:float32:3x224x224"


@dataclass(frozen=True)
class InputSpec:
    """One input of the model, per sample (the batch dimension is not part of `shape`). Values are drawn uniformly
    from [low, high] (inclusive for integers); a float input without a range is standard normal."""

    name: str
    dtype: str  # a key of DTYPES
    shape: tuple[int, ...]
    low: float | None = None
    high: float | None = None

    @property
    def is_float(self) -> bool:
        return DTYPES[self.dtype].is_float

    @property
    def value_range(self) -> tuple[float, float] | None:
        """Where values are drawn from: the given range; for integers without one [0, 1] (an index every
        embedding of two or more rows has); None: standard normal floats."""
        if self.low is not None and self.high is not None:
            return (self.low, self.high)
        return None if self.is_float else (0, 1)

    def sample_bytes(self, wire_dtype: str | None = None) -> int:
        """Bytes of one sample of this input on the wire (in `wire_dtype` when given: uint8 images)."""
        return DTYPES[wire_dtype or self.dtype].nbytes * math.prod(self.shape)

    def describe(self) -> str:
        shape = "x".join(map(str, self.shape))
        rng = "" if self.low is None else f":{_number(self.low)}-{_number(self.high)}"
        return f"{self.name}:{self.dtype}:{shape}{rng}"


def _number(value: float | None) -> str:
    return f"{value:g}" if value is not None and not float(value).is_integer() else str(int(value or 0))


def image_input(image_size: int) -> InputSpec:
    """The built-in models' input: one normalised float32 image per sample."""
    return InputSpec(IMAGE_INPUT, "float32", (3, image_size, image_size))


def is_image_input(spec: InputSpec) -> bool:
    """A float32 [3, H, W] input: what --wire_dtype uint8 (raw pixels, normalised on the device) and
    --channels_last apply to."""
    return spec.dtype == "float32" and len(spec.shape) == 3 and spec.shape[0] == 3


def numpy_carrier(dtype: str) -> str:
    """The numpy dtype that carries a dtype's bytes (numpy has no bfloat16: its 2-byte words ride as uint16)."""
    return "uint16" if dtype == "bfloat16" else dtype


def wire_dtype_of(spec: InputSpec, wire_dtype: str) -> str:
    """The dtype an input crosses the transport in: --wire_dtype for the image input (uint8: raw pixels), its own
    dtype otherwise."""
    return wire_dtype if is_image_input(spec) else spec.dtype


def padding_value(spec: InputSpec, wire_dtype: str) -> float:
    """What the padding rows of a formed batch hold on the wire: 0, or the low end of the input's range when the
    range leaves 0 out (a position from 1, a mask of ones), so that the model never reads a value no request could
    send: an index stays in bounds, a mask is never all zeros. Raw uint8 pixels pad with 0."""
    value_range = spec.value_range
    if wire_dtype_of(spec, wire_dtype) != spec.dtype or value_range is None:
        return 0
    low, high = value_range
    return 0 if low <= 0 <= high else low


def parse_input(text: str) -> InputSpec:
    """argparse type of --input; raises argparse.ArgumentTypeError with what is wrong and what would work."""
    parts = text.split(":")
    if len(parts) not in (3, 4):
        raise argparse.ArgumentTypeError(f"{text!r} is not {INPUT_FORMAT}")
    name, dtype, shape_text = parts[:3]
    if not _NAME.match(name):
        raise argparse.ArgumentTypeError(f"input name {name!r} is not a Python identifier (letters, digits, _)")
    if dtype not in DTYPES:
        raise argparse.ArgumentTypeError(f"input {name}: unknown dtype {dtype!r}; one of {', '.join(DTYPES)}")
    try:
        shape = tuple(int(dim) for dim in shape_text.split("x")) if shape_text else ()
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"input {name}: shape {shape_text!r} is not whole numbers joined by x (e.g. 128 or 3x224x224)"
        ) from None
    if any(dim <= 0 for dim in shape):
        raise argparse.ArgumentTypeError(f"input {name}: every dimension of {shape_text!r} must be at least 1")
    low = high = None
    if len(parts) == 4:
        match = _RANGE.match(parts[3])
        if match is None:
            raise argparse.ArgumentTypeError(f"input {name}: range {parts[3]!r} is not low-high (e.g. 0-999)")
        low_text, high_text = match.groups()
        low, high = float(low_text), float(high_text)
        if not DTYPES[dtype].is_float and math.isfinite(low) and math.isfinite(high):
            if not (low.is_integer() and high.is_integer()):
                raise argparse.ArgumentTypeError(
                    f"input {name}: an {dtype} range takes whole numbers, not {parts[3]!r}"
                )
            low, high = _exact_int(low_text, low), _exact_int(high_text, high)
        if not (math.isfinite(low) and math.isfinite(high)) or low > high:
            raise argparse.ArgumentTypeError(f"input {name}: range {parts[3]!r} must have finite low <= high")
        smallest, largest = DTYPES[dtype].smallest, DTYPES[dtype].largest
        if smallest is not None and (low < smallest or high > largest):
            raise argparse.ArgumentTypeError(
                f"input {name}: range {parts[3]!r} is outside what {dtype} holds ({_number(smallest)} to "
                f"{_number(largest)})"
            )
    return InputSpec(name, dtype, shape, low, high)


def _exact_int(text: str, value: float) -> int:
    """A whole-number bound as written: a float keeps 53 bits, so int64's top, 2**63-1, would round up past it
    and 2**53+1 down. Written in digits (at most 40: every integer dtype's range fits), it is read as an int."""
    return int(text) if re.fullmatch(r"-?\d{1,40}", text) else int(value)


def check_inputs(specs: tuple[InputSpec, ...]) -> str | None:
    """What is wrong with a list of inputs taken together, or None."""
    if len(specs) > MAX_INPUTS:
        return f"{len(specs)} --input flags: at most {MAX_INPUTS}"
    names = [spec.name for spec in specs]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        return f"--input names must differ: {', '.join(repeated)} given more than once"
    return None


def request_bytes(specs: tuple[InputSpec, ...], batch_size: int, wire_dtype: str) -> int:
    """Bytes of one request on the wire: every input's batch, the image in `wire_dtype`."""
    return batch_size * sum(spec.sample_bytes(wire_dtype_of(spec, wire_dtype)) for spec in specs)


def model_source(model: str) -> str:
    """What kind of --model this is, from its name alone: identity, torchvision (a name), factory
    (package.module:factory) or pt2 (a file: an exported program or an AOTInductor package, told apart by
    preflight)."""
    if model == IDENTITY_MODEL:
        return "identity"
    if ":" in model:
        return "factory"
    if model.endswith(".pt2"):
        return "pt2"
    return "torchvision"
