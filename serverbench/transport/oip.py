"""The Open Inference Protocol (KServe v2, in Triton's dialect) as pure functions, HTTP side; oip_grpc.py holds the
gRPC side and reuses the checks here.

What it holds: the datatype table (OIP_DATATYPES), the model as the door describes it (ModelSpec: metadata, Triton
model config, per-request input shapes), the statistics it reports (ModelStats, stats_document), the server's
parse of an HTTP infer request (JSON and Triton's binary tensor extension) and render of its answer, and the client's
render of a request and parse of an answer (our load generator talking to any OIP server). No sockets, no asyncio, no
torch: the door (the ASGI app, the gRPC servicer) calls these and maps a ProtocolError to its status.

Binary tensors are little-endian and row-major, as on every host we run on; BF16, which numpy lacks, travels as its
raw 2-byte elements in a uint16 array (torch: tensor.view(torch.uint16) and back).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

TIMINGS_PARAMETER = "serverbench_timings"  # ours: a client asks our door for the backend's stamps in the answer
HEADER_LENGTH = "Inference-Header-Content-Length"  # Triton's binary extension: the JSON's length, tensors follow

_GRPC_CODE = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    404: "NOT_FOUND",
    413: "RESOURCE_EXHAUSTED",
    500: "INTERNAL",
    501: "UNIMPLEMENTED",
    503: "UNAVAILABLE",
}


class ProtocolError(Exception):
    """A request the door answers with an error instead of serving: HTTP status and the matching gRPC code."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(status, message)  # both in args, so the error pickles and rebuilds
        self.status = status
        self.message = message

    def __str__(self) -> str:
        return self.message

    @property
    def grpc_code(self) -> str:
        """The name of the grpc.StatusCode member (a string, so this module never imports grpc)."""
        return _GRPC_CODE.get(self.status, "INVALID_ARGUMENT" if 400 <= self.status < 500 else "INTERNAL")


# numpy dtype name -> OIP datatype: the one table; the reverse lookups and the model-config names derive from it.
# "bfloat16" is ml_dtypes' name (what tritonclient uses); on our side BF16 data sits in a uint16 carrier.
OIP_DATATYPES: dict[str, str] = {
    "bool": "BOOL",
    "uint8": "UINT8",
    "uint16": "UINT16",
    "uint32": "UINT32",
    "uint64": "UINT64",
    "int8": "INT8",
    "int16": "INT16",
    "int32": "INT32",
    "int64": "INT64",
    "float16": "FP16",
    "float32": "FP32",
    "float64": "FP64",
    "bfloat16": "BF16",
}
_NUMPY_NAMES = {datatype: name for name, datatype in OIP_DATATYPES.items()}
_BF16_CARRIER = np.dtype(np.uint16)  # numpy has no bfloat16: its 2-byte elements ride as uint16, bit for bit
BF16_MAX = (2 - 2**-7) * 2.0**127  # bfloat16's largest finite value, 0x7F7F (float32's is larger)
_FLOAT_TYPES = ("FP16", "FP32", "FP64", "BF16")
# What JSON values each kind of datatype takes: a float takes any number; an integer never a fraction (no silent
# truncation); BOOL only true/false, as Triton's own JSON parser insists.
_ACCEPTED_KINDS = {"f": "iuf", "i": "iu", "u": "iu", "b": "b"}
_UNSUPPORTED = {"shared_memory_region": "shared memory", "classification": "classification"}
_KIND_WORDS = {"b": "booleans", "i": "integers", "u": "integers", "f": "fractional numbers", "U": "strings"}


def numpy_dtype(datatype: str) -> np.dtype:
    """The numpy dtype an OIP datatype's elements are read into (BF16: the uint16 carrier); 400 for BYTES/unknown."""
    if datatype == "BF16":
        return _BF16_CARRIER
    name = _NUMPY_NAMES.get(datatype)
    if name is None:
        known = ", ".join(_NUMPY_NAMES)
        raise ProtocolError(400, f"datatype {datatype!r} is not supported (one of {known}; BYTES is not)")
    return np.dtype(name)


def oip_datatype(dtype_name: str) -> str:
    """The OIP datatype of a numpy dtype name: "float32" -> "FP32", "bfloat16" -> "BF16"."""
    datatype = OIP_DATATYPES.get(dtype_name)
    if datatype is None:
        raise ProtocolError(400, f"numpy dtype {dtype_name!r} has no OIP datatype (one of {', '.join(OIP_DATATYPES)})")
    return datatype


@dataclass(frozen=True)
class TensorSpec:
    name: str
    datatype: str  # OIP datatype, e.g. "FP32"
    shape: tuple[int, ...]  # per request row: without the batch dimension


@dataclass(frozen=True)
class ModelSpec:
    """The model as the door describes it, one object for both protocols."""

    name: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    batch_size: int  # rows every request must carry (the server's slots are sized for it)
    max_batch_size: int  # the config's max_batch_size (> 0: the batch dimension is dynamic)
    queue_delay_us: int | None = None  # dynamic batching's max_queue_delay_microseconds; None: off
    version: str = "1"
    platform: str = "pytorch"

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.max_batch_size < 0:
            raise ValueError(f"batch_size {self.batch_size} must be >= 1, max_batch_size {self.max_batch_size} >= 0")
        if 0 < self.max_batch_size < self.batch_size:
            # perf_analyzer refuses a -b above max_batch_size, so it could never send the rows we require
            raise ValueError(f"max_batch_size {self.max_batch_size} is below the batch_size {self.batch_size}")
        if not self.version.isdigit():  # perf_analyzer parses the statistics' version with std::stoll
            raise ValueError(f"version {self.version!r} is not a whole number")
        if self.queue_delay_us is not None and self.queue_delay_us < 0:
            raise ValueError(f"queue_delay_us {self.queue_delay_us} is negative")
        for kind, tensors in (("input", self.inputs), ("output", self.outputs)):
            names = [tensor.name for tensor in tensors]
            if len(set(names)) != len(names):
                raise ValueError(f"model {self.name!r}: {kind} names repeat: {names}")
            for tensor in tensors:
                if tensor.datatype not in _NUMPY_NAMES:  # BYTES included
                    raise ValueError(f"{kind} {tensor.name!r}: datatype {tensor.datatype!r} is not supported")
                if any(not isinstance(dim, int) or dim < 0 for dim in tensor.shape):
                    raise ValueError(f"{kind} {tensor.name!r}: shape {tensor.shape} is not whole numbers >= 0")

    def input_shape(self, index: int) -> tuple[int, ...]:
        """The shape a request's input `index` must have: (batch_size, *shape)."""
        return (self.batch_size, *self.inputs[index].shape)

    def _metadata_tensor(self, tensor: TensorSpec) -> dict:
        # The batch dimension is -1 when dynamic: perf_analyzer skips the first dim exactly when max_batch_size > 0
        batch = -1 if self.max_batch_size > 0 else self.batch_size
        return {"name": tensor.name, "datatype": tensor.datatype, "shape": [batch, *tensor.shape]}

    def _config_tensor(self, tensor: TensorSpec) -> dict:
        # Triton's config leaves the batch dimension out exactly when max_batch_size > 0
        dims = list(tensor.shape) if self.max_batch_size > 0 else [self.batch_size, *tensor.shape]
        return {"name": tensor.name, "data_type": f"TYPE_{tensor.datatype}", "dims": dims}

    def metadata(self) -> dict:
        """GET /v2/models/{name}: the model metadata document."""
        return {
            "name": self.name,
            "versions": [self.version],
            "platform": self.platform,
            "inputs": [self._metadata_tensor(tensor) for tensor in self.inputs],
            "outputs": [self._metadata_tensor(tensor) for tensor in self.outputs],
        }

    def config(self) -> dict:
        """GET /v2/models/{name}/config: Triton's model config (also the gRPC ModelConfig, via json_format)."""
        config: dict[str, Any] = {
            "name": self.name,
            "platform": self.platform,
            "max_batch_size": self.max_batch_size,
            "input": [self._config_tensor(tensor) for tensor in self.inputs],
            "output": [self._config_tensor(tensor) for tensor in self.outputs],
        }
        if self.queue_delay_us is not None:
            # perf_analyzer reads the key's mere presence as "dynamic batching on", so it is left out when off
            config["dynamic_batching"] = {"max_queue_delay_microseconds": self.queue_delay_us}
        return config


@dataclass(frozen=True)
class InferRequest:
    id: str
    # One per spec input in spec.inputs order (whatever order the client sent), shape spec.input_shape(i), dtype
    # exactly the spec's. Binary tensors are zero-copy views on the request's bytes: read-only, possibly unaligned.
    arrays: tuple[np.ndarray, ...]
    binary_outputs: bool  # answer in binary (request-level binary_data_output, or every requested output asks it)
    outputs: tuple[str, ...] | None  # requested output names; None: all
    parameters: dict  # request-level parameters as given


# --- checks shared by the HTTP and gRPC parsers (oip_grpc.py calls these; one copy of every message) ---


def match_input(spec: ModelSpec, name: object, datatype: object, shape: object, arrays: list) -> int:
    """The index of the spec input a client's tensor fills, once its name (known, not sent twice), datatype and
    shape are right; `arrays` holds what earlier tensors filled (None where nothing yet)."""
    names = [tensor.name for tensor in spec.inputs]
    if not isinstance(name, str) or name not in names:
        raise ProtocolError(400, f"unknown input {name!r}: model {spec.name!r} takes {names}")
    index = names.index(name)
    if arrays[index] is not None:
        raise ProtocolError(400, f"input {name!r} is sent twice")
    wanted = spec.inputs[index].datatype
    if datatype != wanted:
        raise ProtocolError(400, f"input {name!r} is {datatype}, but model {spec.name!r} takes {wanted}")
    expected = list(spec.input_shape(index))
    if not isinstance(shape, Sequence) or any(type(dim) is not int for dim in shape):
        raise ProtocolError(400, f"input {name!r}: shape {shape!r} is not a list of whole numbers")
    if list(shape) != expected:
        raise ProtocolError(
            400,
            f"input {name!r} has shape {list(shape)}, expected {expected}: every request carries exactly "
            f"{spec.batch_size} rows (the batch dimension), the batch size the server was started with",
        )
    return index


def refuse_unsupported(parameters: Mapping, what: str) -> None:
    """Tensor parameters asking for an extension this door lacks (shared memory, classification)."""
    for key, feature in _UNSUPPORTED.items():
        if key in parameters:
            raise ProtocolError(400, f"{what}: {feature} is not supported ({key!r} given); send the data itself")


def decode_buffer(
    what: str, datatype: str, shape: Sequence[int], buffer: Any, offset_bytes: int, size_bytes: object, source: str
) -> np.ndarray:
    """The tensor in `buffer` at offset_bytes, zero copy (np.frombuffer: read-only, and unaligned whenever the
    offset is); `size_bytes` is what the sender says it is (`source` names where it said so)."""
    dtype = numpy_dtype(datatype)
    count = math.prod(shape)
    expected_bytes = count * dtype.itemsize
    if type(size_bytes) is not int or size_bytes != expected_bytes:
        raise ProtocolError(
            400, f"{what}: {source} is {size_bytes!r} bytes, but {datatype} {list(shape)} is {expected_bytes} bytes"
        )
    remaining_bytes = len(buffer) - offset_bytes
    if remaining_bytes < expected_bytes:
        raise ProtocolError(
            400, f"{what}: its {expected_bytes} bytes of binary data run past the end ({remaining_bytes} remain)"
        )
    return np.frombuffer(buffer, dtype=dtype, count=count, offset=offset_bytes).reshape(shape)


def decode_values(what: str, datatype: str, shape: Sequence[int], values: Any) -> np.ndarray:
    """The tensor from a list of values (JSON data, flat or nested row-major; gRPC typed contents)."""
    dtype = numpy_dtype(datatype)
    if values is None:
        raise ProtocolError(400, f"{what} has no data")
    try:
        raw = np.asarray(values)
    except (ValueError, TypeError):
        raise ProtocolError(400, f"{what}: data is not a list of numbers (ragged nested lists?)") from None
    count = math.prod(shape)
    if raw.size != count:
        raise ProtocolError(400, f"{what}: data holds {raw.size} values, but shape {list(shape)} needs {count}")
    target_kind = "f" if datatype in _FLOAT_TYPES else dtype.kind
    if target_kind in "iu" and raw.size:
        _check_whole_numbers(what, datatype, dtype, raw, values)
    if raw.size and raw.dtype.kind not in _ACCEPTED_KINDS[target_kind]:
        got = _KIND_WORDS.get(raw.dtype.kind, "non-numeric values (null, objects or mixed types)")
        raise ProtocolError(400, f"{what}: {datatype} data must be {_KIND_WORDS[target_kind]}, got {got}")
    if target_kind == "f" and raw.size:
        _check_float_range(what, datatype, BF16_MAX if datatype == "BF16" else float(np.finfo(dtype).max), raw)
    if datatype == "BF16":
        return _bf16_from_floats(raw.astype(np.float32)).reshape(shape)
    if target_kind in "iu" and raw.size:
        info = np.iinfo(dtype)
        if raw.min() < info.min or raw.max() > info.max:
            raise ProtocolError(400, f"{what}: data holds values outside {datatype}'s range {info.min}..{info.max}")
    return raw.astype(dtype, copy=False).reshape(shape)


def _check_whole_numbers(what: str, datatype: str, dtype: np.dtype, raw: np.ndarray, values: Any) -> None:
    """An integer tensor's JSON values: no booleans among the integers (numpy would read true as 1, as it refuses
    them all-boolean), and whole numbers beyond the type's range named so (mixed with negatives numpy reads
    2**63 as a float, which read as a fraction)."""
    if raw.dtype.kind not in "iufO":
        return
    flat = np.asarray(values, dtype=object).ravel()
    if raw.dtype.kind in "iu" and not any(type(value) is bool for value in flat):
        return
    if any(type(value) is bool for value in flat):
        raise ProtocolError(400, f"{what}: {datatype} data must be integers, got booleans among them")
    if all(type(value) is int for value in flat):
        info = np.iinfo(dtype)
        raise ProtocolError(400, f"{what}: data holds values outside {datatype}'s range {info.min}..{info.max}")


def complete_inputs(spec: ModelSpec, arrays: list) -> tuple[np.ndarray, ...]:
    """The filled arrays, once every spec input has one."""
    missing = [tensor.name for tensor, array in zip(spec.inputs, arrays) if array is None]
    if missing:
        raise ProtocolError(400, f"missing input(s) {missing}: model {spec.name!r} takes {_names(spec.inputs)}")
    return tuple(arrays)


def requested_outputs(spec: ModelSpec, names: Sequence[object]) -> tuple[str, ...] | None:
    """The requested output names, checked; None (all of them) when the request names none."""
    known = _names(spec.outputs)
    for name in names:
        if name not in known:
            raise ProtocolError(400, f"unknown requested output {name!r}: model {spec.name!r} has {known}")
    if len(set(names)) != len(names):
        raise ProtocolError(400, f"an output is requested twice: {list(names)}")
    return tuple(str(name) for name in names) if names else None


def checked_outputs(
    spec: ModelSpec, outputs: Sequence[np.ndarray], requested: tuple[str, ...] | None
) -> list[tuple[TensorSpec, np.ndarray]]:
    """The (spec, array) pairs to answer with, in the requested order; a 500 when the model's arrays do not match
    what the door advertises (a server bug, not the client's)."""
    if len(outputs) != len(spec.outputs):
        message = f"the model returned {len(outputs)} outputs, model {spec.name!r} lists {len(spec.outputs)}"
        raise ProtocolError(500, message)
    by_name = {tensor.name: (tensor, array) for tensor, array in zip(spec.outputs, outputs)}
    unknown = [name for name in requested or () if name not in by_name]
    if unknown:
        raise ProtocolError(500, f"outputs {unknown} are requested but model {spec.name!r} has {_names(spec.outputs)}")
    chosen = [by_name[name] for name in (requested if requested is not None else by_name)]
    for tensor, array in chosen:
        if array.dtype != numpy_dtype(tensor.datatype) and OIP_DATATYPES.get(array.dtype.name) != tensor.datatype:
            raise ProtocolError(500, f"output {tensor.name!r} is {array.dtype.name}, the model says {tensor.datatype}")
    return chosen


def _check_float_range(what: str, datatype: str, limit: float, raw: np.ndarray) -> None:
    """A finite value beyond the datatype's largest (70000 as FP16) is refused, as an integer out of range is: cast,
    it would become infinity, silently. NaN and infinities pass (as JSON cannot carry them, over gRPC only)."""
    values = raw.astype(np.float64, copy=False) if raw.dtype.kind in "iub" else raw
    with np.errstate(invalid="ignore"):
        outside = np.isfinite(values) & (np.abs(values) > limit)
    if outside.any():
        raise ProtocolError(400, f"{what}: data holds values outside {datatype}'s finite range +-{limit:.6g}")


def _names(tensors: Sequence[TensorSpec]) -> list[str]:
    return [tensor.name for tensor in tensors]


# --- BF16 <-> floats, for JSON (where values are numbers, never the carrier's integers) ---


def _bf16_from_floats(values: np.ndarray) -> np.ndarray:
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))  # round to nearest, ties to even
    return np.where(np.isnan(values), np.uint16(0x7FC0), (rounded >> np.uint32(16)).astype(np.uint16))


def _json_values(array: np.ndarray, datatype: str) -> np.ndarray:
    """The flat array orjson writes as a tensor's JSON "data" (flat is row-major, as the protocol allows)."""
    if datatype == "BF16":
        if array.dtype == _BF16_CARRIER:
            array = (array.astype(np.uint32) << np.uint32(16)).view(np.float32)
        else:
            array = array.astype(np.float32)  # an ml_dtypes bfloat16 array
    return np.ascontiguousarray(array).reshape(-1)  # orjson writes only C-contiguous native arrays


def _raw_bytes(array: np.ndarray) -> np.ndarray:
    """The array's bytes as a flat uint8 view (no copy when it is contiguous), for bytes.join."""
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8)


def _dumps(document: dict) -> bytes:
    return orjson.dumps(document, option=orjson.OPT_SERIALIZE_NUMPY)


# --- HTTP, server side ---


def _load_header(body: bytes, header_length: int | None, what: str) -> tuple[dict, int]:
    """The JSON object that opens the body, and where it ends (the binary tensors start there)."""
    json_end = len(body) if header_length is None else header_length
    if not 0 <= json_end <= len(body):
        raise ProtocolError(400, f"{HEADER_LENGTH} {header_length} is outside the {len(body)}-byte body")
    try:
        header = orjson.loads(memoryview(body)[:json_end])
    except orjson.JSONDecodeError as error:
        hint = f" (binary tensors after the JSON need an {HEADER_LENGTH} header)" if header_length is None else ""
        raise ProtocolError(400, f"{what} does not parse: {error}{hint}") from None
    if not isinstance(header, dict):
        raise ProtocolError(400, f"{what} is a {type(header).__name__}, not an object")
    return header, json_end


def _object(value: object, what: str) -> dict:
    """An optional JSON object: {} when absent."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ProtocolError(400, f"{what} is not a JSON object")
    return value


def parse_http_infer(body: bytes, header_length: int | None, spec: ModelSpec) -> InferRequest:
    """A POST /v2/models/{name}/infer body (header_length: the Inference-Header-Content-Length value, None when
    absent), checked against `spec`; ProtocolError(400) naming the first problem in one line."""
    header, json_end = _load_header(body, header_length, "the request's JSON")
    request_id = header.get("id", "")
    if not isinstance(request_id, str):
        raise ProtocolError(400, f"the request id {request_id!r} is not a string")
    entries = header.get("inputs")
    if not isinstance(entries, list):
        raise ProtocolError(400, 'the request has no "inputs" list')
    arrays: list = [None] * len(spec.inputs)
    offset_bytes = json_end
    for entry in entries:
        if not isinstance(entry, dict):
            raise ProtocolError(400, f"an input is a {type(entry).__name__}, not an object")
        index = match_input(spec, entry.get("name"), entry.get("datatype"), entry.get("shape"), arrays)
        tensor = spec.inputs[index]
        what = f"input {tensor.name!r}"
        parameters = _object(entry.get("parameters"), f"{what}'s parameters")
        refuse_unsupported(parameters, what)
        shape = spec.input_shape(index)
        if "binary_data_size" in parameters:
            if "data" in entry:
                raise ProtocolError(400, f"{what} carries both JSON data and binary_data_size")
            size_bytes = parameters["binary_data_size"]
            if header_length is None:
                raise ProtocolError(400, f"{what} has binary_data_size but the request has no {HEADER_LENGTH}")
            arrays[index] = decode_buffer(
                what, tensor.datatype, shape, body, offset_bytes, size_bytes, "binary_data_size"
            )
            offset_bytes += size_bytes
        elif "data" in entry:
            arrays[index] = decode_values(what, tensor.datatype, shape, entry["data"])
        else:
            raise ProtocolError(400, f'{what} has neither "data" nor a binary_data_size')
    if offset_bytes != len(body):
        raise ProtocolError(400, f"{len(body) - offset_bytes} bytes follow the last binary input's data")
    parameters = _object(header.get("parameters"), "the request's parameters")
    outputs, binary = _http_outputs(spec, header.get("outputs"), parameters.get("binary_data_output") is True)
    return InferRequest(request_id, complete_inputs(spec, arrays), binary, outputs, parameters)


def _http_outputs(spec: ModelSpec, entries: object, binary_default: bool) -> tuple[tuple[str, ...] | None, bool]:
    """The requested outputs and whether to answer in binary: each output's binary_data overrides the request's
    binary_data_output; outputs that disagree (rare) are all answered in JSON, which every client reads."""
    if entries is None:
        return None, binary_default
    if not isinstance(entries, list):
        raise ProtocolError(400, 'the request\'s "outputs" is not a list')
    names, binary = [], True
    for entry in entries:
        if not isinstance(entry, dict):
            raise ProtocolError(400, f"a requested output is a {type(entry).__name__}, not an object")
        parameters = _object(entry.get("parameters"), f"output {entry.get('name')!r}'s parameters")
        refuse_unsupported(parameters, f"output {entry.get('name')!r}")
        names.append(entry.get("name"))
        binary = binary and parameters.get("binary_data", binary_default) is True
    requested = requested_outputs(spec, names)
    return requested, binary if requested else binary_default


def render_http_infer(
    spec: ModelSpec,
    request_id: str,
    outputs: Sequence[np.ndarray],
    binary: bool,
    requested: tuple[str, ...] | None = None,
    parameters: dict | None = None,
) -> tuple[bytes, int | None]:
    """The answer's body and its Inference-Header-Content-Length (None when the body is pure JSON). `outputs` are in
    spec.outputs order, batch dimension first; `requested` None: all of them."""
    entries, buffers = [], []
    for tensor, array in checked_outputs(spec, outputs, requested):
        entry: dict[str, Any] = {"name": tensor.name, "datatype": tensor.datatype, "shape": list(array.shape)}
        if binary:
            raw = _raw_bytes(array)
            entry["parameters"] = {"binary_data_size": raw.nbytes}
            buffers.append(raw)
        else:
            # No "parameters" at all on a JSON output: Triton's C++ client (perf_analyzer's) reads any output
            # parameters object as binary and fails on the missing binary_data_size.
            entry["data"] = _json_values(array, tensor.datatype)
        entries.append(entry)
    # "id" always, even empty: perf_analyzer's async mode matches answers to requests by it
    document: dict[str, Any] = {"model_name": spec.name, "model_version": spec.version, "id": request_id}
    if parameters:
        document["parameters"] = parameters
    document["outputs"] = entries
    return _body(document, buffers, binary)


def error_body(message: str) -> bytes:
    """The JSON body of an error answer: {"error": message}."""
    return orjson.dumps({"error": message})


# --- HTTP, client side: our load generator against any OIP server ---


def render_http_request(
    request_id: str,
    named: Sequence[tuple[str, np.ndarray]],
    binary: bool,
    binary_outputs: bool,
    parameters: dict | None = None,
) -> tuple[bytes, int | None]:
    """An infer request's body and its Inference-Header-Content-Length (None when pure JSON): inputs as binary
    tensors or JSON data; no "outputs", so the server answers all of them, in binary when `binary_outputs`."""
    entries, buffers = [], []
    for name, array in named:
        datatype = oip_datatype(array.dtype.name)
        entry: dict[str, Any] = {"name": name, "shape": list(array.shape), "datatype": datatype}
        if binary:
            raw = _raw_bytes(array)
            entry["parameters"] = {"binary_data_size": raw.nbytes}
            buffers.append(raw)
        else:
            entry["data"] = _json_values(array, datatype)
        entries.append(entry)
    document: dict[str, Any] = {"id": request_id} if request_id else {}
    request_parameters = dict(parameters or {})
    if binary_outputs:
        request_parameters["binary_data_output"] = True
    if request_parameters:
        document["parameters"] = request_parameters
    document["inputs"] = entries
    return _body(document, buffers, binary)


def _body(document: dict, buffers: list, binary: bool) -> tuple[bytes, int | None]:
    """A message's body: its JSON header, then (binary) the tensors' bytes; and the header's length (None: JSON)."""
    header = _dumps(document)
    if not binary:
        return header, None
    return b"".join([header, *buffers]), len(header)


@dataclass(frozen=True)
class InferResult:
    id: str
    outputs: tuple[tuple[str, np.ndarray], ...]  # in the server's order; binary ones are read-only views
    parameters: dict


def parse_http_result(body: bytes, header_length: int | None) -> InferResult:
    """An infer answer (JSON or binary outputs); ValueError in one line for a malformed one."""
    try:
        return _parse_http_result(body, header_length)
    except ProtocolError as error:
        raise ValueError(f"malformed inference answer: {error.message}") from None


def _parse_http_result(body: bytes, header_length: int | None) -> InferResult:
    header, json_end = _load_header(body, header_length, "the answer's JSON")
    if "error" in header and "outputs" not in header:
        raise ProtocolError(500, f"the server answered an error: {header['error']}")
    entries = header.get("outputs")
    if not isinstance(entries, list):
        raise ProtocolError(500, 'no "outputs" list')
    outputs, offset_bytes = [], json_end
    for entry in entries:
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise ProtocolError(500, f"an output is not an object with a name: {entry!r}")
        what, datatype, shape = f"output {entry['name']!r}", entry.get("datatype"), entry.get("shape")
        if not isinstance(shape, list) or any(type(dim) is not int or dim < 0 for dim in shape):
            raise ProtocolError(500, f"{what}: shape {shape!r} is not a list of whole numbers")
        parameters = _object(entry.get("parameters"), f"{what}'s parameters")
        if "binary_data_size" in parameters:
            size_bytes = parameters["binary_data_size"]
            array = decode_buffer(what, datatype, shape, body, offset_bytes, size_bytes, "binary_data_size")
            offset_bytes += size_bytes
        else:
            array = decode_values(what, datatype, shape, _json_floats(datatype, entry.get("data")))
        outputs.append((entry["name"], array))
    parameters = _object(header.get("parameters"), "the answer's parameters")
    return InferResult(str(header.get("id", "")), tuple(outputs), parameters)


def _json_floats(datatype: str, values: Any) -> Any:
    """A float output's JSON data with null read back as NaN: JSON has no NaN or infinity, so a server writes them
    as null (orjson, the door's encoder, does); an answer holding them is still an answer. Inputs keep refusing
    null (decode_values): a request must say what it means."""
    if datatype not in _FLOAT_TYPES or not isinstance(values, list):
        return values
    flat = np.asarray(values, dtype=object)
    if not any(value is None for value in flat.ravel()):
        return values
    return np.where(flat == None, np.nan, flat).astype(np.float64).tolist()  # noqa: E711 - elementwise, not identity
