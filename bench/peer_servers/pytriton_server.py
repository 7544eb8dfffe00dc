"""Triton Inference Server through PyTriton, serving server.py's model behind Triton's C++ HTTP and gRPC front end and
its dynamic batcher (max batch and delay as given), on 127.0.0.1, until SIGINT or SIGTERM. Run by the interpreter of
.tools/peers/pytriton (tools/peers.sh):

    .tools/peers/pytriton/bin/python -m bench.peer_servers.pytriton_server --model identity --http_port 8000 \\
        --grpc_port 8001

The statistics endpoint is left open (PyTriton restricts it behind a token by default): perf_analyzer reads it, as
it reads our door's. Triton's metrics port is off."""

from __future__ import annotations

import os
import signal
import sys
import sysconfig
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from pytriton.decorators import batch
from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
from pytriton.triton import Triton, TritonConfig, TritonSecurityConfig

from bench.peer_servers import PEER_HOST
from bench.peer_servers.model import OUTPUT_NAME, peer_parser, served_model


def stub_library_path() -> str:
    """LD_LIBRARY_PATH with this interpreter's LIBDIR first: Triton's Python-backend stub, a separate executable,
    links libpython3.X.so, which a pyenv or venv interpreter finds by its own rpath and the stub does not."""
    existing = os.environ.get("LD_LIBRARY_PATH")
    return os.pathsep.join([sysconfig.get_config_var("LIBDIR"), *([existing] if existing else [])])


def main(argv: Sequence[str] | None = None) -> int:
    parser = peer_parser("bench.peer_servers.pytriton_server", "server.py's model in Triton through PyTriton")
    args = parser.parse_args(argv)
    if args.grpc_port is None:
        parser.error("--grpc_port is required (Triton listens on both)")
    # PyTriton's serve() ends on KeyboardInterrupt only; SIGTERM (how bench.peers stops a peer) would kill this
    # process before Triton is stopped and its workspace removed.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    # Set before Triton starts: tritonserver and the stubs it starts inherit it.
    os.environ["LD_LIBRARY_PATH"] = stub_library_path()
    model = served_model(args.model, args.image_size, args.seed)

    @batch
    def infer(**inputs: np.ndarray) -> dict[str, np.ndarray]:
        return {OUTPUT_NAME: model.forward(inputs[model.input_name])}

    config = TritonConfig(
        http_address=PEER_HOST,
        http_port=args.http_port,
        grpc_address=PEER_HOST,
        grpc_port=args.grpc_port,
        allow_metrics=False,
    )
    batcher = DynamicBatcher(max_queue_delay_microseconds=round(args.max_queue_delay_ms * 1000))
    security = TritonSecurityConfig(restricted_endpoints=[])
    # A workspace of its own (Triton's model store and a copy of tritonserver), removed as the server ends; PyTriton
    # makes the folder itself and refuses one that exists.
    with (
        tempfile.TemporaryDirectory(prefix="pytriton-") as parent,
        Triton(config=config, workspace=Path(parent) / "workspace", security_config=security) as triton,
    ):
        triton.bind(
            model_name=args.model_name,
            infer_func=infer,
            inputs=[Tensor(name=model.input_name, dtype=np.float32, shape=model.input_shape)],
            outputs=[Tensor(name=OUTPUT_NAME, dtype=np.float32, shape=model.output_shape)],
            config=ModelConfig(max_batch_size=args.max_batch_size, batcher=batcher),
            strict=True,
        )
        print(f"pytriton serving {args.model_name} on http://{PEER_HOST}:{args.http_port}", flush=True)
        triton.serve()  # returns on SIGINT or SIGTERM; leaving the block stops tritonserver
    return 0


if __name__ == "__main__":
    sys.exit(main())
