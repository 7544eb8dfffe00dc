"""The anchor for "the door is as thin as Python allows": a bare echo endpoint of the Open Inference Protocol on the
door's own framework, with no backend behind it, which our generator (server.py --target) drives as it drives the
door. What it costs per request is what the framework and the client cost; the door's cost above it is the door's.

    python -m bench.echo_server --transport http --port 8000           # until SIGINT or SIGTERM
    python -m bench.echo_server --transport grpc --port 0               # a free port, named on stderr
    python server.py --target http://127.0.0.1:8000 --model echo --input image:float32:3x16x16 --batch_size 1 \
        --load closed --concurrency 16 --num_iters 2000

HTTP: uvicorn with the door's settings (httptools, uvloop, lifespan off, no access log, no server or date header,
the door's own uvicorn.Server without signal handlers) and a bare ASGI handler of the door's shape (read the body,
answer). POST /v2/models/{model}/infer with Triton's binary tensor extension answers the tensor bytes it got as one
binary output under a JSON header made once at start from --datatype and --shape (only the
Inference-Header-Content-Length header is read; a tensor of another size is refused with 400); a JSON request (no
such header) is parsed and its inputs' `data` answered back as JSON outputs, the least a JSON server must do, so
that the HTTP-JSON door has an anchor of its own. GET /v2/models/{model} (metadata), /v2/health/live and /ready.

gRPC: grpc.aio with tritonclient's generated servicer (SO_REUSEPORT off, as the door): ModelInfer answers every
input's raw bytes as output0, output1, ... with the input's datatype and shape; ModelMetadata, ServerLive and
ServerReady; the rest UNIMPLEMENTED. One line, "echo serving on http://127.0.0.1:PORT" (grpc://...), goes to stderr
once it listens.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import signal
import sys
from collections.abc import Sequence

import grpc
import orjson
from tritonclient.grpc import service_pb2, service_pb2_grpc

from serverbench.config.flags import OneLineErrorParser, bounded
from serverbench.config.transport_kinds import HTTP
from serverbench.door.grpc_service import MAX_GRPC_MESSAGE_BYTES
from serverbench.door.http_app import BINARY_TYPE, HEADER_LENGTH, Receive, Send, send_answer
from serverbench.door.serving import CLOSE_GRACE_S, HttpServer, bind, loop_factory
from serverbench.transport.grpc_caller import grpc_target
from serverbench.transport.oip import OIP_DATATYPES, ModelSpec, TensorSpec, numpy_dtype
from serverbench.transport.oip_grpc import metadata_response

NOT_FOUND = orjson.dumps({"error": "no such endpoint"})
SERVED_PREFIX = "echo serving on"  # what bench.peers and the tests wait for on stderr


class EchoApp:
    """The ASGI echo: every answer's headers and the binary answer's JSON header made once, at start."""

    def __init__(self, model: str, input_name: str, datatype: str, shape: Sequence[int]) -> None:
        self.model = model
        self.infer_path = f"/v2/models/{model}/infer"
        self.metadata_paths = (f"/v2/models/{model}", f"/v2/models/{model}/versions/1")
        self.tensor_bytes = math.prod(shape) * numpy_dtype(datatype).itemsize
        output = {"name": "output0", "datatype": datatype, "shape": list(shape)}
        self.binary_header = orjson.dumps(
            {
                "id": "",
                "model_name": model,
                "model_version": "1",
                "outputs": [{**output, "parameters": {"binary_data_size": self.tensor_bytes}}],
            }
        )
        self.binary_headers = [
            (b"content-type", BINARY_TYPE),
            (b"content-length", str(len(self.binary_header) + self.tensor_bytes).encode()),
            (HEADER_LENGTH, str(len(self.binary_header)).encode()),
        ]
        self.metadata = orjson.dumps(echo_spec(model, input_name, datatype, shape).metadata())

    async def __call__(self, scope: dict, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return  # lifespan is off; websockets are not spoken here
        path, method = scope["path"], scope["method"]
        if path == self.infer_path and method == "POST":
            body = await _read_body(receive)
            if body is None:
                return  # the client left
            length = dict(scope["headers"]).get(HEADER_LENGTH)
            if length is None:
                await send_answer(send, *self._json_echo(body))
            elif len(body) - int(length) != self.tensor_bytes:
                await send_answer(send, 400, orjson.dumps({"error": f"expected {self.tensor_bytes} tensor bytes"}))
            else:
                await send({"type": "http.response.start", "status": 200, "headers": self.binary_headers})
                await send({"type": "http.response.body", "body": self.binary_header + body[int(length) :]})
        elif method == "GET" and path in self.metadata_paths:
            await send_answer(send, 200, self.metadata)
        elif method == "GET" and path in ("/v2/health/live", "/v2/health/ready"):
            await send_answer(send, 200, b"")
        else:
            await send_answer(send, 404, NOT_FOUND)

    def _json_echo(self, body: bytes) -> tuple[int, bytes]:
        """A JSON request's inputs answered back as outputs: parsed and dumped once, nothing checked but the shape
        of the document (the door's check of the values' count and kind is the door's cost)."""
        try:
            inputs = orjson.loads(body)["inputs"]
            outputs = [
                {"name": f"output{i}", "datatype": t["datatype"], "shape": t["shape"], "data": t["data"]}
                for i, t in enumerate(inputs)
            ]
        except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
            return 400, orjson.dumps({"error": f"not an inference request: {type(exc).__name__} {exc}"})
        return 200, orjson.dumps({"id": "", "model_name": self.model, "model_version": "1", "outputs": outputs})


async def _read_body(receive: Receive) -> bytes | None:
    """The whole body; None when the client disconnected first."""
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def echo_spec(model: str, input_name: str, datatype: str, shape: Sequence[int]) -> ModelSpec:
    """The echo as the door describes a model: its one input, answered back as output0, the batch dimension
    dynamic (-1 in the metadata)."""
    row = TensorSpec(input_name, datatype, tuple(shape[1:]))
    return ModelSpec(model, (row,), (TensorSpec("output0", datatype, row.shape),), shape[0], shape[0], platform="echo")


class EchoServicer(service_pb2_grpc.GRPCInferenceServiceServicer):
    """ModelInfer answers the raw input bytes back; the model's name is not checked (gRPC routes by method)."""

    def __init__(self, model: str, input_name: str, datatype: str, shape: Sequence[int]) -> None:
        self.metadata = metadata_response(echo_spec(model, input_name, datatype, shape))

    async def ModelInfer(
        self, request: service_pb2.ModelInferRequest, context: object
    ) -> service_pb2.ModelInferResponse:
        tensor = service_pb2.ModelInferResponse.InferOutputTensor
        return service_pb2.ModelInferResponse(
            model_name=request.model_name,
            id=request.id,
            outputs=[
                tensor(name=f"output{i}", datatype=t.datatype, shape=t.shape) for i, t in enumerate(request.inputs)
            ],
            raw_output_contents=list(request.raw_input_contents),
        )

    async def ModelMetadata(self, request: object, context: object) -> service_pb2.ModelMetadataResponse:
        return self.metadata

    async def ServerLive(self, request: object, context: object) -> service_pb2.ServerLiveResponse:
        return service_pb2.ServerLiveResponse(live=True)

    async def ServerReady(self, request: object, context: object) -> service_pb2.ServerReadyResponse:
        return service_pb2.ServerReadyResponse(ready=True)


async def serve_http(args: argparse.Namespace, stop: asyncio.Event) -> None:
    sock = bind(args.host, args.port)
    # the door's own uvicorn, settings and all: signals are this process's to handle
    server = HttpServer(EchoApp(args.model_name, args.input_name, args.datatype, args.shape), sock)
    await server.start()
    announce("http", sock.getsockname()[0], sock.getsockname()[1])
    await stop.wait()
    await server.close()


async def serve_grpc(args: argparse.Namespace, stop: asyncio.Event) -> None:
    options = [
        ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_BYTES),
        ("grpc.max_send_message_length", -1),
        ("grpc.so_reuseport", 0),  # as the door: a taken port fails instead of sharing its connections
    ]
    server = grpc.aio.server(options=options)
    servicer = EchoServicer(args.model_name, args.input_name, args.datatype, args.shape)
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server)
    try:
        port = server.add_insecure_port(grpc_target(args.host, args.port))
    except RuntimeError:  # grpc >= 1.5x raises where older ones returned 0
        port = 0
    if port == 0:
        raise OSError(f"cannot listen on {grpc_target(args.host, args.port)}")
    await server.start()
    announce("grpc", args.host, port)
    await stop.wait()
    await server.stop(CLOSE_GRACE_S)


def announce(scheme: str, host: str, port: int) -> None:
    print(f"{SERVED_PREFIX} {scheme}://{grpc_target(host, port)}", file=sys.stderr, flush=True)


def echo_url(log_text: str) -> str | None:
    """The echo's URL once its announcement (announce) is in its output, after its command line."""
    urls = [line.split()[-1] for line in log_text.splitlines()[1:] if line.startswith(SERVED_PREFIX)]
    return urls[0] if urls else None


def shape_flag(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected sizes separated by commas, e.g. 1,3,16,16") from None
    if not shape or any(size < 1 for size in shape):
        raise argparse.ArgumentTypeError(f"{text!r}: every size must be 1 or more")
    return shape


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog="python -m bench.echo_server", description=__doc__.split("\n\n")[0])
    parser.add_argument("--transport", choices=("http", "grpc"), default="http")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=bounded(int, 0, 65535), default=8000, help="0: a free one (default 8000)")
    parser.add_argument("--model_name", default="echo", help="the model served (default echo)")
    parser.add_argument("--input_name", default="image", help="the input the metadata names (default image)")
    parser.add_argument(
        "--datatype", choices=sorted(OIP_DATATYPES.values()), default="FP32", help="the tensor's (default FP32)"
    )
    parser.add_argument(
        "--shape", type=shape_flag, default=(1, 3, 16, 16), help="a request's tensor, batch first (default 1,3,16,16)"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    async def serve() -> None:
        stop = asyncio.Event()
        for signum in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(signum, stop.set)
        await (serve_http if args.transport == HTTP.name else serve_grpc)(args, stop)

    try:
        with asyncio.Runner(loop_factory=loop_factory(args.transport)) as runner:
            runner.run(serve())
    except OSError as exc:
        print(f"python -m bench.echo_server: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
