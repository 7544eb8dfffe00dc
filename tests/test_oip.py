"""The Open Inference Protocol functions (serverbench/transport/oip.py, oip_grpc.py): our own client and server sides
round-trip every supported dtype; the real tritonclient (HTTP and gRPC) reads what the door answers and the door reads
what tritonclient sends; every bad request gets a 400 naming its problem; and the model config, metadata and
statistics documents carry the fields perf_analyzer reads, in the shapes it reads them."""

from __future__ import annotations

import importlib.util
import pickle
import warnings
from pathlib import Path
from types import ModuleType

import ml_dtypes
import numpy as np
import orjson
import pytest
import tritonclient
import tritonclient.grpc as grpcclient
from google.protobuf import json_format
from tritonclient.grpc import _utils as grpc_utils
from tritonclient.grpc import service_pb2

from serverbench.transport.metadata import metadata_inputs
from serverbench.transport.oip import (
    ModelSpec,
    ProtocolError,
    TensorSpec,
    decode_values,
    error_body,
    numpy_dtype,
    oip_datatype,
    parse_http_infer,
    parse_http_result,
    render_http_infer,
    render_http_request,
)
from serverbench.transport.oip_grpc import (
    config_response,
    from_parameters,
    grpc_infer_request,
    grpc_infer_response,
    metadata_response,
    parse_grpc_infer,
    parse_grpc_result,
    statistics_response,
    to_parameters,
)
from serverbench.transport.oip_stats import Durations, ModelStats, stats_document


def _triton_http(part: str) -> ModuleType:
    """One of tritonclient.http's pure modules, loaded from its file: the package's __init__ needs gevent (the
    [http] extra), which this project does not install, but the request encoder and answer decoder need only
    numpy and rapidjson. They are the code InferenceServerClient.generate_request_body / parse_response_body run."""
    path = Path(tritonclient.__file__).parent / "http" / f"_{part}.py"
    spec = importlib.util.spec_from_file_location(f"tritonclient_http_{part}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


HttpInferInput = _triton_http("infer_input").InferInput
HttpRequestedOutput = _triton_http("requested_output").InferRequestedOutput
HttpInferResult = _triton_http("infer_result").InferResult
_http_utils = _triton_http("utils")


def _triton_http_body(inputs: list, outputs: list | None = None, request_id: str = "", parameters: dict | None = None):
    """tritonclient's HTTP request body and its Inference-Header-Content-Length (None: pure JSON)."""
    return _http_utils._get_inference_request(
        inputs=inputs,
        request_id=request_id,
        outputs=outputs,
        sequence_id=0,
        sequence_start=False,
        sequence_end=False,
        priority=0,
        timeout=None,
        custom_parameters=parameters,
    )


BATCH = 2
INPUTS = (
    TensorSpec("image", "UINT8", (3, 4)),
    TensorSpec("ids", "INT64", (5,)),
    TensorSpec("mask", "BOOL", (5,)),
    TensorSpec("scale", "FP16", (2,)),
)
OUTPUTS = (
    TensorSpec("logits", "FP32", (6,)),
    TensorSpec("tokens", "INT64", (3,)),
    TensorSpec("flag", "BOOL", ()),
    TensorSpec("half", "FP16", (2,)),
    TensorSpec("brain", "BF16", (2,)),
)
SPEC = ModelSpec("toy", INPUTS, OUTPUTS, batch_size=BATCH, max_batch_size=8, queue_delay_us=250)


def _arrays(tensors: tuple[TensorSpec, ...], seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    arrays = []
    for tensor in tensors:
        shape, dtype = (BATCH, *tensor.shape), numpy_dtype(tensor.datatype)
        if tensor.datatype == "BF16":  # exact bfloat16 values, in the uint16 carrier
            values = rng.standard_normal(shape).astype(ml_dtypes.bfloat16)
            arrays.append(values.view(np.uint16))
        elif dtype.kind == "f":
            arrays.append(rng.standard_normal(shape).astype(dtype))
        elif dtype.kind == "b":
            arrays.append(rng.integers(0, 2, shape).astype(bool))
        else:
            arrays.append(rng.integers(0, 200, shape).astype(dtype))
    return arrays


def _assert_same(got: list[np.ndarray] | tuple[np.ndarray, ...], want: list[np.ndarray]) -> None:
    assert len(got) == len(want)
    for got_array, want_array in zip(got, want):
        assert got_array.dtype == want_array.dtype
        np.testing.assert_array_equal(got_array, want_array)


# --- round trips: our client, our server, our client again ---


@pytest.mark.parametrize("binary_in", [True, False])
@pytest.mark.parametrize("binary_out", [True, False])
def test_http_round_trip(binary_in: bool, binary_out: bool) -> None:
    inputs, outputs = _arrays(INPUTS), _arrays(OUTPUTS, seed=1)
    named = [(tensor.name, array) for tensor, array in zip(INPUTS, inputs)]
    body, header_length = render_http_request("req-7", named[::-1], binary_in, binary_out, {"tag": "x"})
    assert (header_length is not None) == binary_in
    request = parse_http_infer(body, header_length, SPEC)
    assert (request.id, request.binary_outputs, request.outputs) == ("req-7", binary_out, None)
    assert request.parameters["tag"] == "x"
    _assert_same(request.arrays, inputs)  # spec order, though the client sent them reversed
    answer, answer_length = render_http_infer(SPEC, request.id, outputs, request.binary_outputs)
    assert (answer_length is not None) == binary_out
    result = parse_http_result(answer, answer_length)
    assert result.id == "req-7"
    assert [name for name, _ in result.outputs] == [tensor.name for tensor in OUTPUTS]
    _assert_same([array for _, array in result.outputs], outputs)


def test_binary_inputs_are_zero_copy_views_of_the_body() -> None:
    named = [(tensor.name, array) for tensor, array in zip(INPUTS, _arrays(INPUTS))]
    body, header_length = render_http_request("", named, True, True)
    request = parse_http_infer(body, header_length, SPEC)
    whole = np.frombuffer(body, np.uint8)
    assert all(np.shares_memory(array, whole) and not array.flags.writeable for array in request.arrays)


def test_grpc_round_trip_through_the_wire() -> None:
    inputs, outputs = _arrays(INPUTS), _arrays(OUTPUTS, seed=1)
    named = [(tensor.name, array) for tensor, array in zip(INPUTS, inputs)]
    sent = grpc_infer_request("toy", "r1", named[::-1], {"priority": 3, "fast": True})
    request = parse_grpc_infer(service_pb2.ModelInferRequest.FromString(sent.SerializeToString()), SPEC)
    assert (request.id, request.outputs, request.parameters) == ("r1", None, {"priority": 3, "fast": True})
    _assert_same(request.arrays, inputs)
    answer = grpc_infer_response(SPEC, request.id, outputs, parameters={"note": "ok"})
    result = parse_grpc_result(service_pb2.ModelInferResponse.FromString(answer.SerializeToString()))
    assert (result.id, result.parameters) == ("r1", {"note": "ok"})
    _assert_same([array for _, array in result.outputs], outputs)


def test_bf16_travels_as_floats_in_json_and_bits_in_binary() -> None:
    spec = ModelSpec("b", (TensorSpec("x", "BF16", (3,)),), (TensorSpec("y", "BF16", (3,)),), 2, 2)
    values = np.array([[1.5, -2.0, 0.1], [3.0, 1e-3, -7.25]], dtype=ml_dtypes.bfloat16)
    for binary in (True, False):
        body, header_length = render_http_request("", [("x", values)], binary, binary)
        if not binary:
            assert orjson.loads(body)["inputs"][0]["data"][:2] == [1.5, -2.0]  # numbers, not the carrier's integers
        request = parse_http_infer(body, header_length, spec)
        np.testing.assert_array_equal(request.arrays[0], values.view(np.uint16))
        answer, answer_length = render_http_infer(spec, "", request.arrays, binary)
        np.testing.assert_array_equal(parse_http_result(answer, answer_length).outputs[0][1], values.view(np.uint16))


# --- interoperability with the real client (tritonclient 2.x), which is what perf_analyzer's client mirrors ---


def _triton_http_inputs(arrays: list[np.ndarray], binary: bool) -> list:
    inputs = []
    for tensor, array in zip(INPUTS, arrays):
        infer_input = HttpInferInput(tensor.name, list(array.shape), tensor.datatype)
        inputs.append(infer_input.set_data_from_numpy(array, binary_data=binary))
    return inputs


@pytest.mark.parametrize("binary", [True, False])
@pytest.mark.parametrize("ask_outputs", [True, False])
def test_tritonclient_http_request_is_read(binary: bool, ask_outputs: bool) -> None:
    arrays = _arrays(INPUTS)
    inputs = _triton_http_inputs(arrays, binary)[::-1]
    outputs = [HttpRequestedOutput(name, binary_data=binary) for name in ("tokens", "flag")]
    body, json_size = _triton_http_body(
        inputs, outputs=outputs if ask_outputs else None, request_id="abc", parameters={"user_key": 4}
    )
    request = parse_http_infer(body, json_size, SPEC)
    _assert_same(request.arrays, arrays)
    assert (request.id, request.parameters["user_key"]) == ("abc", 4)
    # tritonclient asks every output in binary when it names none (binary_data_output)
    assert request.outputs == (("tokens", "flag") if ask_outputs else None)
    assert request.binary_outputs == (binary if ask_outputs else True)


def test_tritonclient_http_bf16_input_is_read() -> None:
    spec = ModelSpec("b", (TensorSpec("x", "BF16", (3,)),), (TensorSpec("y", "FP32", (1,)),), 2, 4)
    values = np.arange(6, dtype=np.float32).reshape(2, 3).astype(ml_dtypes.bfloat16)
    infer_input = HttpInferInput("x", [2, 3], "BF16").set_data_from_numpy(values, binary_data=True)
    body, json_size = _triton_http_body([infer_input])
    np.testing.assert_array_equal(parse_http_infer(body, json_size, spec).arrays[0], values.view(np.uint16))


@pytest.mark.parametrize("binary", [True, False])
def test_tritonclient_http_reads_our_answer(binary: bool) -> None:
    outputs = _arrays(OUTPUTS, seed=3)
    body, header_length = render_http_infer(SPEC, "id-1", outputs, binary)
    result = HttpInferResult.from_response_body(body, header_length=header_length)
    for tensor, want in zip(OUTPUTS, outputs):
        got = result.as_numpy(tensor.name)
        if tensor.datatype == "BF16":  # tritonclient reads BF16 as ml_dtypes.bfloat16: same bits
            got = got.view(np.uint16)
        np.testing.assert_array_equal(got, want)
    document = result.get_response()
    assert (document["model_name"], document["model_version"], document["id"]) == ("toy", "1", "id-1")
    # Triton's C++ client (perf_analyzer's) takes any output "parameters" for binary: JSON outputs carry none
    assert all(("parameters" in output) == binary for output in document["outputs"])


def test_requested_outputs_only_are_answered() -> None:
    outputs = _arrays(OUTPUTS)
    asked = [HttpRequestedOutput("half"), HttpRequestedOutput("logits")]
    inputs = _triton_http_inputs(_arrays(INPUTS), True)
    body, json_size = _triton_http_body(inputs, outputs=asked)
    request = parse_http_infer(body, json_size, SPEC)
    answer, answer_length = render_http_infer(SPEC, request.id, outputs, request.binary_outputs, request.outputs)
    result = HttpInferResult.from_response_body(answer, header_length=answer_length)
    assert [output["name"] for output in result.get_response()["outputs"]] == ["half", "logits"]
    np.testing.assert_array_equal(result.as_numpy("half"), outputs[3])


def test_tritonclient_grpc_request_and_answer() -> None:
    arrays, outputs = _arrays(INPUTS), _arrays(OUTPUTS, seed=5)
    inputs = []
    for tensor, array in zip(INPUTS, arrays):
        inputs.append(grpcclient.InferInput(tensor.name, list(array.shape), tensor.datatype).set_data_from_numpy(array))
    sent = grpc_utils._get_inference_request(
        model_name="toy",
        inputs=inputs[::-1],
        model_version="",
        request_id="g1",
        outputs=[grpcclient.InferRequestedOutput("tokens")],
        sequence_id=0,
        sequence_start=False,
        sequence_end=False,
        priority=0,
        timeout=None,
        parameters={"k": "v", "n": 2, "x": 0.5},
    )
    request = parse_grpc_infer(service_pb2.ModelInferRequest.FromString(sent.SerializeToString()), SPEC)
    _assert_same(request.arrays, arrays)
    assert (request.id, request.outputs, request.parameters) == ("g1", ("tokens",), {"k": "v", "n": 2, "x": 0.5})
    answer = grpc_infer_response(SPEC, "g1", outputs)
    result = grpcclient.InferResult(service_pb2.ModelInferResponse.FromString(answer.SerializeToString()))
    for tensor, want in zip(OUTPUTS, outputs):
        got = result.as_numpy(tensor.name)
        np.testing.assert_array_equal(got.view(np.uint16) if tensor.datatype == "BF16" else got, want)
    assert grpc_infer_response(SPEC, "g1", outputs, requested=("tokens",)).outputs[0].name == "tokens"


def test_grpc_typed_contents_are_read() -> None:
    spec = ModelSpec("t", (TensorSpec("a", "FP32", (2,)), TensorSpec("b", "INT8", (1,))), OUTPUTS[:1], 1, 0)
    request = service_pb2.ModelInferRequest(model_name="t")
    request.inputs.add(name="b", datatype="INT8", shape=[1, 1]).contents.int_contents.extend([-5])
    request.inputs.add(name="a", datatype="FP32", shape=[1, 2]).contents.fp32_contents.extend([0.5, 2.0])
    parsed = parse_grpc_infer(request, spec)
    _assert_same(parsed.arrays, [np.array([[0.5, 2.0]], np.float32), np.array([[-5]], np.int8)])


# --- bad requests: a 400 naming the problem, in one line ---


def _request(**changes: object) -> tuple[dict, list[bytes]]:
    """A valid request header, binary image and JSON rest, with `changes` applied to the inputs by name."""
    arrays = _arrays(INPUTS)
    entries = [{"name": "image", "shape": [BATCH, 3, 4], "datatype": "UINT8", "parameters": {"binary_data_size": 24}}]
    for tensor, array in zip(INPUTS[1:], arrays[1:]):
        entries.append({"name": tensor.name, "shape": list(array.shape), "datatype": tensor.datatype})
        entries[-1]["data"] = array.reshape(-1).tolist()
    for entry in entries:
        entry.update(changes.get(entry["name"], {}))  # type: ignore[arg-type]
    return {"id": "x", "inputs": entries}, [arrays[0].tobytes()]


def _body(header: dict, tail: list[bytes]) -> tuple[bytes, int]:
    head = orjson.dumps(header)
    return head + b"".join(tail), len(head)


def _bad(**changes: object) -> tuple[bytes, int]:
    return _body(*_request(**changes))


def _drop(name: str) -> tuple[bytes, int]:
    header, tail = _request()
    header["inputs"] = [entry for entry in header["inputs"] if entry["name"] != name]
    return _body(header, tail)


def _extra(entry: dict | None = None, outputs: list | None = None, tail: bytes = b"") -> tuple[bytes, int]:
    header, buffers = _request()
    if entry is not None:
        header["inputs"].append(entry)
    if outputs is not None:
        header["outputs"] = outputs
    return _body(header, [*buffers, tail])


GOOD_BODY, GOOD_LENGTH = _body(*_request())
BAD_REQUESTS = {
    "malformed JSON": ((b'{"inputs": [', None), "does not parse"),
    "JSON not an object": ((b"[1, 2]", None), "not an object"),
    "header length beyond body": ((GOOD_BODY, len(GOOD_BODY) + 1), "outside the"),
    "header length negative": ((GOOD_BODY, -1), "outside the"),
    "unknown input": (_bad(ids={"name": "idz"}), "unknown input 'idz'"),
    "duplicated input": (
        _extra(entry={"name": "mask", "shape": [2, 5], "datatype": "BOOL", "data": [True] * 10}),
        "input 'mask' is sent twice",
    ),
    "missing input": (_drop("mask"), "missing input(s) ['mask']"),
    "wrong datatype": (_bad(ids={"datatype": "INT32"}), "input 'ids' is INT32, but model 'toy' takes INT64"),
    "BYTES datatype": (_bad(ids={"datatype": "BYTES"}), "input 'ids' is BYTES"),
    "wrong batch": (_bad(ids={"shape": [3, 5]}), "has shape [3, 5], expected [2, 5]: every request carries exactly 2"),
    "wrong row shape": (_bad(ids={"shape": [2, 4]}), "has shape [2, 4], expected [2, 5]"),
    "shape not numbers": (_bad(ids={"shape": "2x5"}), "is not a list of whole numbers"),
    "binary size disagrees with shape": (
        _bad(image={"parameters": {"binary_data_size": 25}}),
        "binary_data_size is 25 bytes, but UINT8 [2, 3, 4] is 24 bytes",
    ),
    "binary body too short": ((GOOD_BODY[:-3], GOOD_LENGTH), "run past the end (21 remain)"),
    "binary body too long": (_extra(tail=b"zz"), "2 bytes follow the last binary input"),
    "binary without header length": ((_bad()[0], None), "need an Inference-Header-Content-Length header"),
    "binary size but no binary": ((_bad()[0][: _bad()[1]], None), "but the request has no Inference-Header"),
    "binary and JSON data both": (_bad(image={"data": [0] * 24}), "both JSON data and binary_data_size"),
    "no data at all": (_bad(ids={"data": None}), "input 'ids' has no data"),
    "JSON wrong count": (_bad(ids={"data": list(range(9))}), "data holds 9 values, but shape [2, 5] needs 10"),
    "JSON strings": (_bad(ids={"data": ["1"] * 10}), "INT64 data must be integers, got strings"),
    "JSON nulls": (_bad(scale={"data": [None] * 4}), "got non-numeric values"),
    "JSON fractions for integers": (_bad(ids={"data": [0.5] * 10}), "must be integers, got fractional numbers"),
    "JSON numbers for BOOL": (_bad(mask={"data": [1] * 10}), "BOOL data must be booleans, got integers"),
    "JSON ragged": (_bad(ids={"data": [[1, 2, 3, 4, 5], [1]]}), "ragged"),
    "JSON out of range": (_bad(ids={"datatype": "INT64", "data": [2**63] * 10}), "outside INT64's range"),
    # mixed with a negative numpy reads 2**63 as a float: it was refused as "fractional numbers"
    "JSON out of range beside negatives": (
        _bad(ids={"datatype": "INT64", "data": [2**63] + [-1] * 9}),
        "outside INT64's range",
    ),
    # numpy reads true among integers as 1, as it refuses all-boolean data: it was accepted
    "JSON booleans among integers": (_bad(ids={"data": [True] + [0] * 9}), "must be integers, got booleans among"),
    # a value the datatype cannot hold became infinity, with numpy's RuntimeWarning on the door's stderr
    "JSON beyond FP16's range": (_bad(scale={"data": [70000.0, 1, 2, 3]}), "outside FP16's finite range +-65504"),
    "unknown requested output": (_extra(outputs=[{"name": "nope"}]), "unknown requested output 'nope'"),
    "shared memory": (_bad(ids={"parameters": {"shared_memory_region": "r"}}), "shared memory is not supported"),
    "classification": (_extra(outputs=[{"name": "flag", "parameters": {"classification": 3}}]), "classification"),
    "inputs missing": ((b'{"id": "a"}', None), 'no "inputs" list'),
    "id not a string": ((b'{"id": 5, "inputs": []}', None), "the request id 5 is not a string"),
}


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=list(BAD_REQUESTS))
def test_bad_http_request_is_a_400_naming_it(case: str) -> None:
    (body, header_length), phrase = BAD_REQUESTS[case]
    with pytest.raises(ProtocolError) as caught:
        parse_http_infer(body, header_length, SPEC)
    assert caught.value.status == 400 and caught.value.grpc_code == "INVALID_ARGUMENT"
    assert phrase in caught.value.message and "\n" not in caught.value.message


def test_floats_beyond_a_datatype_are_refused_without_a_warning_and_nan_passes() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy's "overflow encountered in cast" printed on the door's stderr
        # 3.4e38 is within float32 and beyond bfloat16's 3.39e38: it was cast to +inf
        cases = (("BF16", [3.4e38, 1.0]), ("BF16", [1e39, 1.0]), ("FP32", [-1e39, 1.0]), ("FP16", [65520.0, 0.0]))
        for datatype, values in cases:
            with pytest.raises(ProtocolError, match=f"outside {datatype}'s finite range"):
                decode_values("input 'x'", datatype, [2], values)
        kept = decode_values("input 'x'", "FP16", [3], [65504.0, float("nan"), float("-inf")])
    assert kept[0] == 65504 and np.isnan(kept[1]) and np.isneginf(kept[2])


def test_the_good_request_of_the_table_is_served() -> None:
    assert parse_http_infer(GOOD_BODY, GOOD_LENGTH, SPEC).id == "x"  # so each bad case fails for its own change


def _grpc_request(raw: list[bytes] | None = None, shape: list[int] | None = None, **fields: str):
    """A valid gRPC request with input 'ids' changed by `shape` and `fields`, or other raw_input_contents."""
    named = [(tensor.name, array) for tensor, array in zip(INPUTS, _arrays(INPUTS))]
    request = grpc_infer_request("toy", "", named)
    ids = request.inputs[1]
    if shape is not None:
        del ids.shape[:]
        ids.shape.extend(shape)
    for key, value in fields.items():
        setattr(ids, key, value)
    if raw is not None:
        del request.raw_input_contents[:]
        request.raw_input_contents.extend(raw)
    return request


BAD_GRPC = {
    "wrong batch": (_grpc_request(shape=[3, 5]), "has shape [3, 5], expected [2, 5]: every request carries exactly 2"),
    "wrong datatype": (_grpc_request(datatype="INT32"), "input 'ids' is INT32, but model 'toy' takes INT64"),
    "unknown input": (_grpc_request(name="idz"), "unknown input 'idz'"),
    "raw count": (_grpc_request(raw=[b"\0" * 24]), "1 raw_input_contents for 4 inputs"),
    "raw size": (
        _grpc_request(raw=[b"\0" * 24, b"\0" * 79, b"\0" * 10, b"\0" * 8]),
        "raw_input_contents[1] is 79 bytes, but INT64 [2, 5] is 80 bytes",
    ),
}


@pytest.mark.parametrize("case", BAD_GRPC, ids=list(BAD_GRPC))
def test_bad_grpc_request_gets_the_http_message(case: str) -> None:
    request, phrase = BAD_GRPC[case]
    with pytest.raises(ProtocolError) as caught:
        parse_grpc_infer(request, SPEC)
    assert caught.value.status == 400 and phrase in caught.value.message


def test_bad_grpc_typed_contents() -> None:
    spec = ModelSpec("t", (TensorSpec("a", "FP32", (2,)), TensorSpec("h", "FP16", (1,))), OUTPUTS[:1], 1, 0)
    request = service_pb2.ModelInferRequest()
    request.inputs.add(name="a", datatype="FP32", shape=[1, 2]).contents.int_contents.extend([1, 2])
    with pytest.raises(ProtocolError, match="FP32 values belong in fp32_contents, not int_contents"):
        parse_grpc_infer(request, spec)
    request.inputs[0].contents.Clear()
    request.inputs[0].contents.fp32_contents.extend([1, 2])
    request.inputs.add(name="h", datatype="FP16", shape=[1, 1]).contents.fp32_contents.extend([1])
    with pytest.raises(ProtocolError, match="FP16 has no typed contents; send it in raw_input_contents"):
        parse_grpc_infer(request, spec)


def test_server_side_mistakes_are_500s_and_codes_map() -> None:
    outputs = _arrays(OUTPUTS)
    outputs[0] = outputs[0].astype(np.float64)
    with pytest.raises(ProtocolError, match="output 'logits' is float64, the model says FP32") as caught:
        render_http_infer(SPEC, "", outputs, True)
    assert caught.value.grpc_code == "INTERNAL"
    with pytest.raises(ProtocolError, match="returned 1 outputs"):
        grpc_infer_response(SPEC, "", outputs[:1])
    codes = {status: ProtocolError(status, "m").grpc_code for status in (400, 404, 413, 503)}
    assert codes == {400: "INVALID_ARGUMENT", 404: "NOT_FOUND", 413: "RESOURCE_EXHAUSTED", 503: "UNAVAILABLE"}
    error = pickle.loads(pickle.dumps(ProtocolError(413, "too big")))
    assert (error.status, str(error)) == (413, "too big")
    assert orjson.loads(error_body('say "no"')) == {"error": 'say "no"'}


def test_datatypes() -> None:
    assert oip_datatype("float32") == "FP32" and oip_datatype("bfloat16") == "BF16" and oip_datatype("bool") == "BOOL"
    assert numpy_dtype("FP16") == np.float16 and numpy_dtype("BF16") == np.uint16
    for bad in ("BYTES", "FP8"):
        with pytest.raises(ProtocolError, match="BYTES is not") as caught:
            numpy_dtype(bad)
        assert caught.value.status == 400
    with pytest.raises(ValueError, match="datatype 'BYTES' is not supported"):
        ModelSpec("m", (TensorSpec("s", "BYTES", (1,)),), OUTPUTS, 1, 1)
    with pytest.raises(ValueError, match="max_batch_size 2 is below the batch_size 4"):
        ModelSpec("m", INPUTS, OUTPUTS, 4, 2)
    with pytest.raises(ValueError, match="version 'v1' is not a whole number"):
        ModelSpec("m", INPUTS, OUTPUTS, 1, 1, version="v1")


def test_malformed_answers_are_value_errors() -> None:
    with pytest.raises(ValueError, match="the server answered an error: boom"):
        parse_http_result(error_body("boom"), None)
    body, header_length = render_http_infer(SPEC, "", _arrays(OUTPUTS), True)
    with pytest.raises(ValueError, match="run past the end"):
        parse_http_result(body[:-1], header_length)
    with pytest.raises(ValueError, match="does not parse"):
        parse_http_result(b"{", None)
    answer = grpc_infer_response(SPEC, "", _arrays(OUTPUTS))
    del answer.raw_output_contents[-1]
    with pytest.raises(ValueError, match="4 raw_output_contents for 5 outputs"):
        parse_grpc_result(answer)


def test_parameters_keep_their_types() -> None:
    values = {"flag": True, "n": -3, "big": 2**64 - 1, "s": "x", "f": 0.25}
    parameters = to_parameters(values)
    assert parameters["flag"].WhichOneof("parameter_choice") == "bool_param"  # not int64: bool is checked first
    assert parameters["big"].WhichOneof("parameter_choice") == "uint64_param"
    assert from_parameters(parameters) == values
    with pytest.raises(ValueError, match="parameter 'l'"):
        to_parameters({"l": [1]})


# --- the documents perf_analyzer reads before it sends a request ---


def test_config_has_what_perf_analyzer_reads() -> None:
    config = orjson.loads(orjson.dumps(SPEC.config()))
    assert config["max_batch_size"] == 8 and config["name"] == "toy"
    assert config["input"][0] == {"name": "image", "data_type": "TYPE_UINT8", "dims": [3, 4]}  # no batch dim
    assert config["output"][2]["dims"] == [] and config["output"][4]["data_type"] == "TYPE_BF16"
    assert config["dynamic_batching"] == {"max_queue_delay_microseconds": 250}
    off = ModelSpec("toy", INPUTS, OUTPUTS, batch_size=BATCH, max_batch_size=0)
    assert "dynamic_batching" not in off.config()  # perf_analyzer takes the key's presence for "on"
    assert off.config()["input"][1]["dims"] == [BATCH, 5]  # no dynamic batch: the batch is part of the dims
    grpc_config = config_response(SPEC).config
    assert json_format.MessageToDict(grpc_config, preserving_proto_field_name=True)["input"][1]["dims"] == ["5"]
    assert grpc_config.dynamic_batching.max_queue_delay_microseconds == 250 and grpc_config.max_batch_size == 8
    assert not config_response(off).config.HasField("dynamic_batching")


def test_metadata_has_what_perf_analyzer_reads() -> None:
    metadata = SPEC.metadata()
    assert (metadata["name"], metadata["versions"], metadata["platform"]) == ("toy", ["1"], "pytorch")
    assert metadata["inputs"][1] == {"name": "ids", "datatype": "INT64", "shape": [-1, 5]}
    assert metadata["outputs"][2] == {"name": "flag", "datatype": "BOOL", "shape": [-1]}
    fixed = ModelSpec("toy", INPUTS, OUTPUTS, batch_size=BATCH, max_batch_size=0)
    assert fixed.metadata()["inputs"][1]["shape"] == [BATCH, 5]
    assert metadata_inputs(orjson.loads(orjson.dumps(metadata))) == INPUTS  # what --target reads back
    assert metadata_inputs(fixed.metadata())[1].shape == (BATCH, 5)
    with pytest.raises(ValueError, match="malformed"):
        metadata_inputs({"inputs": [{"name": "a"}]})
    grpc_metadata = metadata_response(SPEC)
    assert list(grpc_metadata.inputs[1].shape) == [-1, 5] and list(grpc_metadata.versions) == ["1"]


def test_statistics_have_what_perf_analyzer_reads() -> None:
    stats = ModelStats(inference_count=10, execution_count=3, last_inference_ms=1_700_000_000_000)
    stats.add("success", 5_000, count=5)
    stats.add("success", 1_000)
    stats.add("compute_infer", 700, count=3)
    assert stats.success == Durations(6, 6_000)
    with pytest.raises(ValueError, match="'inference_count' is not a duration"):
        stats.add("inference_count", 1)
    document = orjson.loads(orjson.dumps(stats_document(SPEC, stats)))
    model = document["model_stats"][0]
    assert (model["name"], model["version"], model["inference_count"], model["execution_count"]) == ("toy", "1", 10, 3)
    inference = model["inference_stats"]
    wanted = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output", "cache_hit", "cache_miss")
    assert set(inference) == set(wanted)  # perf_analyzer reads every one of these, cache ones included
    assert all(
        type(inference[key][part]) is int and inference[key][part] >= 0 for key in wanted for part in ("count", "ns")
    )
    assert inference["compute_infer"] == {"count": 3, "ns": 700} and model["batch_stats"] == []
    grpc_stats = statistics_response(SPEC, stats).model_stats[0]
    assert grpc_stats.inference_stats.success.ns == 6_000 and grpc_stats.last_inference == 1_700_000_000_000


def test_a_json_answer_s_null_floats_read_back_as_nan() -> None:
    """JSON has no NaN or infinity: the door's encoder writes them as null, and our client reads a float output's
    null as NaN instead of refusing the whole answer (a model returning NaN failed the run over --no-binary_data)."""
    answer = orjson.dumps(
        {"id": "a", "outputs": [{"name": "y", "datatype": "FP32", "shape": [1, 3], "data": [1.0, None, None]}]}
    )
    ((name, values),) = parse_http_result(answer, None).outputs
    assert name == "y" and values[0, 0] == 1.0 and np.isnan(values[0, 1:]).all()
    ints = orjson.dumps({"outputs": [{"name": "n", "datatype": "INT64", "shape": [1, 2], "data": [1, None]}]})
    with pytest.raises(ValueError, match="INT64 data must be integers"):  # an integer has no NaN: still refused
        parse_http_result(ints, None)
