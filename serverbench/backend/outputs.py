"""A model's output of any structure (a tensor, a tuple or list, a dict, nested) as the flat list of tensors the
D2H step copies and a response carries: torch's pytree flattening, the leaves in its order (a dict's in key
order)."""

from __future__ import annotations

import threading

import torch
from torch.utils import _pytree as pytree

WIDENED = (torch.float16, torch.bfloat16)  # 16-bit floats travel as float32 (bf16 has no numpy dtype)


def output_leaves(output: object) -> tuple[torch.Tensor, ...]:
    """The output's tensors; a lone tensor without pytree's cost (microseconds a request at one image each).
    16-bit floats become float32 (the response carries numpy arrays, and numpy has no bf16); float64, integer and
    bool leaves stay as they are (float64 narrowed to float32 lost its range and digits). TypeError for a leaf that
    is not a tensor."""
    if type(output) is torch.Tensor:  # the common case, in as few calls as it takes
        return (output.float(),) if output.dtype in WIDENED else (output,)
    return _tensor_leaves(pytree.tree_leaves(output))


def _tensor_leaves(leaves: list[object]) -> tuple[torch.Tensor, ...]:
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(f"the model's output holds a {type(leaf).__name__}; every leaf must be a tensor")
    return tuple(leaf.float() if leaf.dtype in WIDENED else leaf for leaf in leaves)


class OutputCheck:
    """Every served forward's output against what the server splits it by: each leaf's first dimension the forward's
    rows, and the structure (a dict's keys, a sequence's length, the nesting) the first forward's. The probe before
    the run checked one forward; a model may change later (rows dropped or added, a key renamed), and the frontend
    sees only each request's rows of the leaves, by position: extra rows or a renamed key would pass unseen."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # the prediction threads check at once; the first forward's structure is set once
        self._first: pytree.TreeSpec | None = None  # None: a lone tensor, or no forward yet (_described empty)
        self._described: list[str] = []
        self._lone = False  # the first forward's output was a lone tensor

    def leaves(self, output: object, rows: int) -> tuple[torch.Tensor, ...]:
        """The output's leaves (output_leaves); ValueError naming the leaf and what changed."""
        # The common case first, in as few calls as it takes (it runs once a forward): a lone tensor as the first
        # forward's was, with the forward's rows.
        if self._lone and type(output) is torch.Tensor and output.dim() and output.shape[0] == rows:
            return output_leaves(output)
        if type(output) is torch.Tensor:
            leaves, structure = output_leaves(output), None
        else:
            flat, structure = pytree.tree_flatten(output)
            leaves = _tensor_leaves(flat)
        if not self._described:
            with self._lock:
                if not self._described:
                    self._first, self._described = structure, describe_leaves(output)
                    self._lone = structure is None
        if structure != self._first:
            raise ValueError(
                f"the model's output changed its structure mid-run: first {', '.join(self._described)}; now "
                f"{', '.join(describe_leaves(output))}"
            )
        index = leaf_without_rows(leaves, rows)
        if index is not None:
            described = describe_leaves(output)[index]
            raise ValueError(
                f"the model's output changed its batch dimension mid-run: {described} from a forward of {rows} "
                "rows; the server splits every leaf along its first dimension, one response per request"
            )
        return leaves


def describe_leaves(output: object) -> list[str]:
    """Each leaf's path in the structure and its shape, e.g. ["['pooled'] 2x64", "['logits'] 2x16x1000"]."""
    paths, _ = pytree.tree_flatten_with_path(output)
    return [
        f"{pytree.keystr(path) or 'output'} {'x'.join(map(str, getattr(leaf, 'shape', ()))) or type(leaf).__name__}"
        for path, leaf in paths
    ]


def check_output(output: object, rows: int) -> str | None:
    """Why the server cannot split this output into one response per request, or None: every leaf a tensor whose
    first dimension is the batch's `rows`."""
    try:
        leaves = output_leaves(output)
    except TypeError as exc:
        return str(exc)
    if not leaves:
        return "the model's output holds no tensor"
    index = leaf_without_rows(leaves, rows)
    if index is None:
        return None
    return (
        f"output leaf {describe_leaves(output)[index]} has no batch dimension of {rows} first; the server splits "
        "every leaf along its first dimension, one response per request"
    )


def leaf_without_rows(leaves: tuple[torch.Tensor, ...], rows: int) -> int | None:
    """The index of the first leaf whose first dimension is not `rows` (or that has none), else None."""
    return next((i for i, leaf in enumerate(leaves) if leaf.dim() == 0 or leaf.shape[0] != rows), None)
