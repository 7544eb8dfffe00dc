"""The Open Inference Protocol's gRPC side (Triton's inference.GRPCInferenceService) as pure functions on
tritonclient's generated messages: the servicer's parse of a ModelInferRequest and its answer, the metadata, config
and statistics answers (built from the same ModelSpec documents the HTTP door serves, via protobuf's json_format),
and the client's request and parse of an answer. Every check and message is oip.py's; nothing here opens a channel.

Tensors come as raw_input_contents (one bytes per input, in input order: what tritonclient and perf_analyzer send)
or typed in each input's contents (fp32_contents, ...); answers always go as raw_output_contents.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2, service_pb2

from serverbench.transport.oip import (
    InferRequest,
    InferResult,
    ModelSpec,
    ProtocolError,
    checked_outputs,
    complete_inputs,
    decode_buffer,
    decode_values,
    match_input,
    numpy_dtype,
    oip_datatype,
    refuse_unsupported,
    requested_outputs,
)
from serverbench.transport.oip_stats import ModelStats, stats_document

# The typed contents field each datatype's values belong in (FP16 and BF16 have none: raw only, as in Triton).
_TYPED_FIELDS = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
}
_INT64_MIN, _UINT64_MAX = -(2**63), 2**64 - 1
_Tensor = service_pb2.ModelInferRequest.InferInputTensor | service_pb2.ModelInferResponse.InferOutputTensor


def to_parameters(values: Mapping[str, object]) -> dict[str, service_pb2.InferParameter]:
    """InferParameters from plain values: bool, int (int64, or uint64 above its range), str, float."""
    parameters = {}
    for key, value in values.items():
        if isinstance(value, bool):  # before int: a bool is an int to Python
            parameter = service_pb2.InferParameter(bool_param=value)
        elif isinstance(value, int) and _INT64_MIN <= value < 2**63:
            parameter = service_pb2.InferParameter(int64_param=value)
        elif isinstance(value, int) and 0 <= value <= _UINT64_MAX:
            parameter = service_pb2.InferParameter(uint64_param=value)
        elif isinstance(value, str):
            parameter = service_pb2.InferParameter(string_param=value)
        elif isinstance(value, float):
            parameter = service_pb2.InferParameter(double_param=value)
        else:
            raise ValueError(f"parameter {key!r}: {value!r} is not a bool, a 64-bit int, a str or a float")
        parameters[key] = parameter
    return parameters


def from_parameters(parameters: Mapping[str, service_pb2.InferParameter]) -> dict:
    """Plain values from an InferParameter map (an unset parameter reads None)."""
    values = {}
    for key, parameter in parameters.items():
        choice = parameter.WhichOneof("parameter_choice")
        values[key] = getattr(parameter, choice) if choice else None
    return values


# --- server side ---


def parse_grpc_infer(request: service_pb2.ModelInferRequest, spec: ModelSpec) -> InferRequest:
    """A ModelInferRequest checked against `spec`, with the HTTP parser's checks and messages; binary_outputs is
    always True (gRPC answers are raw bytes)."""
    raw_contents = request.raw_input_contents
    if raw_contents and len(raw_contents) != len(request.inputs):
        raise ProtocolError(
            400,
            f"{len(raw_contents)} raw_input_contents for {len(request.inputs)} inputs: send one per input, in order",
        )
    arrays: list = [None] * len(spec.inputs)
    for position, tensor in enumerate(request.inputs):
        index = match_input(spec, tensor.name, tensor.datatype, list(tensor.shape), arrays)
        what = f"input {tensor.name!r}"
        refuse_unsupported(tensor.parameters, what)
        shape = spec.input_shape(index)
        if raw_contents:
            if tensor.HasField("contents"):
                raise ProtocolError(400, f"{what} has typed contents as well as raw_input_contents; send one")
            raw = raw_contents[position]
            source = f"raw_input_contents[{position}]"
            arrays[index] = decode_buffer(what, tensor.datatype, shape, raw, 0, len(raw), source)
        else:
            arrays[index] = decode_values(what, tensor.datatype, shape, _typed_values(what, tensor))
    for output in request.outputs:
        refuse_unsupported(output.parameters, f"output {output.name!r}")
    outputs = requested_outputs(spec, [output.name for output in request.outputs])
    return InferRequest(request.id, complete_inputs(spec, arrays), True, outputs, from_parameters(request.parameters))


def _typed_values(what: str, tensor: _Tensor) -> Sequence:
    """The values of a tensor sent typed, from the one contents field its datatype allows."""
    numpy_dtype(tensor.datatype)  # BYTES and unknown datatypes: refused as such, before any talk of fields
    field = _TYPED_FIELDS.get(tensor.datatype)
    filled = [descriptor.name for descriptor, _ in tensor.contents.ListFields()]
    if field is None:
        raise ProtocolError(400, f"{what}: {tensor.datatype} has no typed contents; send it in raw_input_contents")
    if any(name != field for name in filled):
        raise ProtocolError(400, f"{what}: {tensor.datatype} values belong in {field}, not {', '.join(filled)}")
    return getattr(tensor.contents, field)


def grpc_infer_response(
    spec: ModelSpec,
    request_id: str,
    outputs: Sequence[np.ndarray],
    requested: tuple[str, ...] | None = None,
    parameters: dict | None = None,
) -> service_pb2.ModelInferResponse:
    """The answer, outputs as raw_output_contents (one per output tensor, in the same order, as clients index them).
    `outputs` are in spec.outputs order, batch dimension first; `requested` None: all of them."""
    response = service_pb2.ModelInferResponse(
        model_name=spec.name, model_version=spec.version, id=request_id, parameters=to_parameters(parameters or {})
    )
    for tensor, array in checked_outputs(spec, outputs, requested):
        response.outputs.add(name=tensor.name, datatype=tensor.datatype, shape=array.shape)
        response.raw_output_contents.append(np.ascontiguousarray(array).tobytes())
    return response


def metadata_response(spec: ModelSpec) -> service_pb2.ModelMetadataResponse:
    return json_format.ParseDict(spec.metadata(), service_pb2.ModelMetadataResponse())


def config_response(spec: ModelSpec) -> service_pb2.ModelConfigResponse:
    """spec.config() as a ModelConfig, so that both protocols describe the model from one document."""
    return service_pb2.ModelConfigResponse(config=json_format.ParseDict(spec.config(), model_config_pb2.ModelConfig()))


def statistics_response(spec: ModelSpec, stats: ModelStats) -> service_pb2.ModelStatisticsResponse:
    return json_format.ParseDict(stats_document(spec, stats), service_pb2.ModelStatisticsResponse())


# --- client side: our load generator against any OIP gRPC server ---


def grpc_infer_request(
    model_name: str, request_id: str, named: Sequence[tuple[str, np.ndarray]], parameters: dict | None = None
) -> service_pb2.ModelInferRequest:
    """A request with every input in raw_input_contents and no outputs named (the server answers all of them)."""
    request = service_pb2.ModelInferRequest(
        model_name=model_name, id=request_id, parameters=to_parameters(parameters or {})
    )
    for name, array in named:
        request.inputs.add(name=name, datatype=oip_datatype(array.dtype.name), shape=array.shape)
        request.raw_input_contents.append(np.ascontiguousarray(array).tobytes())
    return request


def parse_grpc_result(response: service_pb2.ModelInferResponse) -> InferResult:
    """The answer's outputs (raw_output_contents, or typed contents from servers that answer so); ValueError in one
    line for a malformed one. BF16 outputs come back in the uint16 carrier."""
    raw_contents = response.raw_output_contents
    outputs = []
    try:
        if raw_contents and len(raw_contents) != len(response.outputs):
            raise ProtocolError(500, f"{len(raw_contents)} raw_output_contents for {len(response.outputs)} outputs")
        for position, tensor in enumerate(response.outputs):
            what, shape = f"output {tensor.name!r}", list(tensor.shape)
            if any(dim < 0 for dim in shape):
                raise ProtocolError(500, f"{what}: shape {shape} has a negative dimension")
            if raw_contents:
                raw = raw_contents[position]
                source = f"raw_output_contents[{position}]"
                array = decode_buffer(what, tensor.datatype, shape, raw, 0, len(raw), source)
            else:
                array = decode_values(what, tensor.datatype, shape, _typed_values(what, tensor))
            outputs.append((tensor.name, array))
    except ProtocolError as error:
        raise ValueError(f"malformed inference answer: {error.message}") from None
    return InferResult(response.id, tuple(outputs), from_parameters(response.parameters))
