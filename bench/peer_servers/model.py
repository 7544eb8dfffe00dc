"""What every peer serves: server.py's own model (serverbench/backend/models.py: the identity's per-sample sum or a
torchvision classifier with seeded random weights), on the CPU, as a function of a numpy batch; and the flags every
peer server takes. Imported by the peers' environments, so it needs torch, torchvision and numpy only."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from serverbench.backend.models import build_model
from serverbench.config.inputs import IMAGE_INPUT

OUTPUT_NAME = "output"


@dataclass(frozen=True)
class ServedModel:
    """The model as a peer describes and runs it: one float32 image input [3, S, S] per row, one float32 output."""

    input_name: str
    input_shape: tuple[int, ...]  # per row, without the batch dimension
    output_shape: tuple[int, ...]  # per row
    forward: Callable[[np.ndarray], np.ndarray]  # [B, 3, S, S] float32 -> [B, *output_shape] float32


def served_model(name: str, image_size: int, seed: int) -> ServedModel:
    """The module built as server.py's backend builds it (eval mode, no gradients), its forward under inference
    mode, run once on zeros for its output shape (and so that the first timed request is not its first call)."""
    module = build_model(name, torch.device("cpu"), seed, None).module

    def forward(images: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            return module(torch.from_numpy(np.ascontiguousarray(images, dtype=np.float32))).numpy()

    input_shape = (3, image_size, image_size)
    output_shape = tuple(forward(np.zeros((1, *input_shape), dtype=np.float32)).shape[1:])
    return ServedModel(IMAGE_INPUT, input_shape, output_shape, forward)


def peer_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """The flags both peer servers take (bench.peers passes the same values to each)."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--model", default="identity", help="identity or a torchvision classifier name")
    parser.add_argument("--image_size", type=int, default=16)
    parser.add_argument("--model_name", default="model", help="the name clients address the model by")
    parser.add_argument("--http_port", type=int, required=True)
    parser.add_argument("--grpc_port", type=int, default=None, help="PyTriton only: its gRPC port")
    parser.add_argument("--max_batch_size", type=int, default=16, help="rows per formed batch (dynamic batching)")
    parser.add_argument("--max_queue_delay_ms", type=float, default=2.0, help="how long a batch waits to fill")
    parser.add_argument("--seed", type=int, default=0, help="the random weights' seed, as server.py's --seed")
    return parser
