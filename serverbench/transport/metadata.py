"""What an Open Inference Protocol server says of a model, asked once before the run (--target): its inputs, which
our load generator then sends. Blocking calls with a timeout: preflight runs before any process starts. No torch."""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request

import grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc

from serverbench.config.inputs import InputSpec
from serverbench.config.transport_kinds import HTTP
from serverbench.system.net import host_port
from serverbench.transport.caller import auth_headers
from serverbench.transport.oip import OIP_DATATYPES, TensorSpec

DATATYPE_NAMES = {datatype: name for name, datatype in OIP_DATATYPES.items()}  # FP32 -> float32


def fetch_model_metadata(
    transport: str, host: str, port: int, model: str, timeout_s: float, token: str | None = None
) -> dict:
    """The model's metadata as the HTTP API gives it (name, inputs, outputs), asked with the token where there is
    one (auth_headers); raises ValueError in one line."""
    where = f"{transport}://{host_port(host, port)}"
    headers = auth_headers(token)
    if transport == HTTP.name:
        url = f"http://{host_port(host, port)}/v2/models/{model}"
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout_s) as answer:
                return json.loads(answer.read())
        except urllib.error.HTTPError as exc:
            raise ValueError(f"{where} answered {exc.code} for model {model!r}: {exc.read()[:200]!r}") from None
        except (urllib.error.URLError, OSError, json.JSONDecodeError, http.client.HTTPException, ValueError) as exc:
            # HTTPException: not HTTP at all (a gRPC port), or an address http.client refuses ("127.0.0.1 :8000")
            raise ValueError(f"cannot read model {model!r}'s metadata from {where}: {_line(exc)}") from None
    with grpc.insecure_channel(host_port(host, port)) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        try:
            request = service_pb2.ModelMetadataRequest(name=model)
            answer = stub.ModelMetadata(request, timeout=timeout_s, metadata=tuple(headers.items()))
        except grpc.RpcError as exc:
            raise ValueError(f"{where} answered {exc.code().name} for model {model!r}: {exc.details()}") from None
    tensors = lambda items: [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)} for t in items]  # noqa: E731
    return {"name": answer.name, "inputs": tensors(answer.inputs), "outputs": tensors(answer.outputs)}


def _line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [type(exc).__name__])[0][:300] or type(exc).__name__


def inputs_of(metadata: dict) -> tuple[InputSpec, ...]:
    """The model's inputs as our pool makes them (per request row; integers drawn from 0-1 unless --input says)."""
    specs = []
    for tensor in metadata_inputs(metadata):
        name = DATATYPE_NAMES.get(tensor.datatype)
        if name is None:
            raise ValueError(f"input {tensor.name!r} is {tensor.datatype}: our load generator sends fixed-size tensors")
        if any(size < 0 for size in tensor.shape):
            raise ValueError(
                f"input {tensor.name!r} has a variable dimension ({list(tensor.shape)}): give its shape with --input"
            )
        specs.append(InputSpec(tensor.name, name, tuple(tensor.shape)))
    return tuple(specs)


def metadata_inputs(metadata: dict) -> tuple[TensorSpec, ...]:
    """The inputs a server's model metadata lists (for --target), per row: a leading -1 batch dimension dropped."""
    try:
        specs = []
        for entry in metadata["inputs"]:
            dims = entry["shape"]
            if not isinstance(dims, list) or any(type(dim) is not int or dim < -1 for dim in dims):
                raise ValueError(f"input {entry.get('name')!r}'s shape {str(dims)[:80]} is not a list of whole numbers")
            shape = list(dims)
            if shape and shape[0] == -1:
                shape = shape[1:]
            specs.append(TensorSpec(str(entry["name"]), str(entry["datatype"]), tuple(shape)))
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"the model metadata's inputs are malformed ({type(error).__name__}: {error})") from None
    return tuple(specs)
