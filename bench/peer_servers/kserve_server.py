"""KServe's Python model server (FastAPI under uvicorn, Open Inference Protocol v2 REST with the binary tensor
extension) serving server.py's model, one request per forward (it has no dynamic batcher of its own), until SIGINT
or SIGTERM. Run by the interpreter of .tools/peers/kserve (tools/peers.sh):

    .tools/peers/kserve/bin/python -m bench.peer_servers.kserve_server --model identity --http_port 8080

KServe 0.21 binds its REST server to 0.0.0.0 in code; here it is bound to 127.0.0.1 (a local benchmark). Its gRPC
server is off (bench.peers drives REST), and so is its per-request latency logging."""

from __future__ import annotations

import sys
from collections.abc import Sequence

import kserve
import kserve.model_server
from kserve.protocol.infer_type import InferOutput, InferRequest, InferResponse
from kserve.protocol.rest.server import RESTServer

from bench.peer_servers import PEER_HOST
from bench.peer_servers.model import OUTPUT_NAME, ServedModel, peer_parser, served_model


class LoopbackRESTServer(RESTServer):
    """KServe's REST server bound to loopback: its uvicorn config is made with host 0.0.0.0 and read only when the
    server starts, so the host is changed in between."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.config.host = PEER_HOST


class PeerModel(kserve.Model):
    def __init__(self, name: str, model: ServedModel) -> None:
        super().__init__(name)
        self.model = model
        self.ready = True

    def get_input_types(self) -> list[dict]:
        return [{"name": self.model.input_name, "datatype": "FP32", "shape": [-1, *self.model.input_shape]}]

    def get_output_types(self) -> list[dict]:
        return [{"name": OUTPUT_NAME, "datatype": "FP32", "shape": [-1, *self.model.output_shape]}]

    def predict(self, payload: InferRequest, headers: dict[str, str] | None = None) -> InferResponse:
        binary = payload.use_binary_outputs
        answer = self.model.forward(payload.inputs[0].as_numpy())
        output = InferOutput(name=OUTPUT_NAME, shape=list(answer.shape), datatype="FP32")
        output.set_data_from_numpy(answer, binary_data=binary)
        return InferResponse(
            model_name=self.name,
            infer_outputs=[output],
            response_id=payload.id,
            use_binary_outputs=binary,
        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = peer_parser("bench.peer_servers.kserve_server", "server.py's model in KServe's Python model server")
    args = parser.parse_args(argv)
    model = served_model(args.model, args.image_size, args.seed)
    kserve.model_server.RESTServer = LoopbackRESTServer  # the one name ModelServer.start makes its server by
    # A grace period well inside bench.peers' 30 s wait for a stopped peer (KServe's own default is 30 s).
    server = kserve.ModelServer(
        http_port=args.http_port, enable_grpc=False, enable_latency_logging=False, workers=1, grace_period=5
    )
    print(f"kserve serving {args.model_name} on http://{PEER_HOST}:{args.http_port}", flush=True)
    server.start([PeerModel(args.model_name, model)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
