"""The backend's reusable buffers, and the conversion of a request's wire bytes into the model's input.

In steady state nothing is allocated per request: each request inside the backend holds one `BufferSet` (the
device copy of its wire bytes, the decoded model input, the page-locked host buffer of its output) taken from a
`BufferPool` of at most `max_inflight` sets, and gives it back only after its D2H copy has completed on the host,
which is after every stream that touched those buffers has finished with them (never early). The model's own
output comes from the caching allocator, which reuses its blocks without a device allocation.

`decode` is the part of the H2D step that turns wire bytes into model inputs on the device: uint8 pixels are
converted and normalised there (a quarter of the bytes cross the wire and the PCIe bus), float32 inputs are cast to
the model's precision and the image to its memory layout. Anything else is used as it arrived.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

import torch

from serverbench.config.inputs import is_image_input, padding_value, wire_dtype_of
from serverbench.config.limits import POLL_S
from serverbench.config.options import BenchConfig
from serverbench.transport.tensors import torch_dtype

# ImageNet statistics: uint8 pixels become the normalised float input torchvision's classifiers expect.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

MODEL_DTYPES = {
    "default": torch.float32,
    "fp32": torch.float32,
    "tf32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


def model_dtype(precision: str) -> torch.dtype:
    return MODEL_DTYPES[precision]


class BufferSet:
    """One request's (or formed batch's) device input buffers, one per model input, and its host output buffers, one
    per output leaf, for up to `rows` samples: a formed batch of fewer uses the first rows of each."""

    # The whole config: the layout is five of its flags and the derived model_inputs, as every caller holds them.
    def __init__(self, cfg: BenchConfig, device: torch.device, pin_host: bool, rows: int | None = None) -> None:
        self.rows = cfg.batch_size if rows is None else rows
        specs = cfg.model_inputs
        dtype = model_dtype(cfg.precision)
        self.wires: list[torch.Tensor] = []  # H2D copy targets
        self.normalised: list[torch.Tensor | None] = []
        self.model_inputs: list[torch.Tensor | None] = []
        for spec in specs:
            shape = (self.rows, *spec.shape)
            image = is_image_input(spec)
            wire = torch.empty(shape, dtype=torch_dtype(wire_dtype_of(spec, cfg.wire_dtype)), device=device)
            if rows is not None:
                # Rows past a formed batch's requests are padding the model reads: defined values within the input's
                # range, never garbage.
                wire.fill_(padding_value(spec, cfg.wire_dtype))
            self.wires.append(wire)
            # uint8 is normalised in float32 before any cast, so a 16-bit model sees the same rounding as a cast
            # input.
            uint8 = image and cfg.wire_dtype == "uint8"
            self.normalised.append(torch.empty(shape, device=device) if uint8 else None)
            cast = spec.is_float and dtype != torch.float32 and torch_dtype(spec.dtype) == torch.float32
            layout = torch.channels_last if cfg.channels_last and image else torch.contiguous_format
            needs_buffer = cast or layout is torch.channels_last
            self.model_inputs.append(
                torch.empty(
                    shape, dtype=dtype if cast else torch_dtype(spec.dtype), device=device, memory_format=layout
                )
                if needs_buffer
                else None
            )
        # Per input: decoding writes into a buffer of this set (normalised or model_input), not returning the wire.
        self.decode_copies = [n is not None or m is not None for n, m in zip(self.normalised, self.model_inputs)]
        self.any_decode_copies = any(self.decode_copies)
        self.host_outputs: list[torch.Tensor | None] = []  # made at the first D2H, once the output is known
        self._pin_host = pin_host
        self.events: dict = {}  # the timing events of the request holding the set (the backend makes them)

    def host_output_for(self, leaf: int, output: torch.Tensor) -> torch.Tensor:
        """The page-locked host buffer for output leaf `leaf`'s D2H copy: made once for the set's rows, then reused
        (a view of its first rows for a smaller formed batch)."""
        while len(self.host_outputs) <= leaf:
            self.host_outputs.append(None)
        held = self.host_outputs[leaf]
        if (
            held is None
            or held.shape[1:] != output.shape[1:]
            or held.dtype != output.dtype
            or held.shape[0] < output.shape[0]
        ):
            rows = max(self.rows, output.shape[0])
            held = torch.empty((rows, *output.shape[1:]), dtype=output.dtype, pin_memory=self._pin_host)
            self.host_outputs[leaf] = held
        return held[: output.shape[0]]


class Decoder:
    """Wire bytes on the device -> the model's inputs, on the current stream, in the set's own buffers."""

    # The whole config, though only --wire_dtype is read: built beside BufferSet, from what builds those.
    def __init__(self, cfg: BenchConfig, device: torch.device) -> None:
        self.uint8 = cfg.wire_dtype == "uint8"
        # (x / 255 - mean) / std == (x - 255 mean) * (1 / (255 std))
        self.offset = torch.tensor([255 * m for m in IMAGENET_MEAN], device=device).view(1, 3, 1, 1)
        self.inv_scale = torch.tensor([1 / (255 * s) for s in IMAGENET_STD], device=device).view(1, 3, 1, 1)
        self._normalise = _normalise

    def compile(self) -> None:
        """With --compile_decode (which follows --compile): one fused pass instead of three (on a CPU that is most
        of the uint8 step's cost). Called once, on the thread that compiles the model, before any serving thread
        exists."""
        self._normalise = torch.compile(_normalise, dynamic=False)

    def __call__(self, buffers: BufferSet, wires: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """`wires`: the request's inputs as DeviceLayer.stage_wire left them (the set's wire buffers, or on the CPU
        the request's own tensors)."""
        if not buffers.any_decode_copies:
            return tuple(wires)  # every input as it arrived: float32 at fp32 in the default layout, or integers
        # Always in inference mode: the same global state wherever it is called from, so the compiled
        # version never meets a guard it was not compiled for (a recompile in a serving thread is an error).
        with torch.inference_mode():
            return tuple(self._decode_one(buffers, i, wire) for i, wire in enumerate(wires))

    def _decode_one(self, buffers: BufferSet, index: int, wire: torch.Tensor) -> torch.Tensor:
        rows = wire.shape[0]  # a formed batch may use only the first rows of the set
        x = wire
        normalised = buffers.normalised[index]
        if normalised is not None:
            x = self._normalise(x, self.offset, self.inv_scale, normalised[:rows])
        model_input = buffers.model_inputs[index]
        if model_input is not None:
            x = model_input[:rows].copy_(x)  # cast and/or change layout
        return x


def _normalise(pixels: torch.Tensor, offset: torch.Tensor, inv_scale: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    return out.copy_(pixels).sub_(offset).mul_(inv_scale)


class BufferPool:
    """At most `capacity` buffer sets, made on first need and reused; `take` waits at most timeout_s."""

    def __init__(self, capacity: int, make, timeout_s: float) -> None:
        self._free: queue.SimpleQueue = queue.SimpleQueue()  # C: the cheapest hand-back between threads
        self._capacity = capacity
        self._made = 0
        self._lock = threading.Lock()
        self._make = make
        self._timeout_s = timeout_s

    @property
    def made(self) -> int:
        return self._made

    def take(self, should_stop: Callable[[], bool] = lambda: False) -> BufferSet | None:
        """A free set, a new one while fewer than `capacity` exist, or the next one given back; None as soon as
        `should_stop()` says the run is ending; TimeoutError after timeout_s."""
        try:
            return self._free.get_nowait()
        except queue.Empty:
            pass
        with self._lock:
            if self._made < self._capacity:
                self._made += 1
                return self._make()
        deadline = time.monotonic() + self._timeout_s
        while time.monotonic() < deadline:  # every set is in use: one comes back when a request finishes
            try:
                return self._free.get(timeout=min(POLL_S, self._timeout_s))
            except queue.Empty:
                if should_stop():
                    return None
        raise TimeoutError(
            f"no free buffer set within {self._timeout_s:g} s: all {self._capacity} are held "
            "by requests that never finished"
        )

    def give_back(self, buffers: BufferSet) -> None:
        self._free.put(buffers)
