"""A model's output of any structure (a tensor, a tuple or list, a dict, nested) as the flat list of tensors the
D2H step copies and a response carries: torch's pytree flattening, the leaves in its order (a dict's in key
order)."""

from __future__ import annotations

import torch
from torch.utils import _pytree as pytree


def output_leaves(output: object) -> tuple[torch.Tensor, ...]:
    """The output's tensors; a lone tensor without pytree's cost (microseconds a request at one image each).
    Non-float32 floats become float32 (bf16 has no numpy dtype; the response carries numpy arrays); integer and
    bool leaves stay as they are. TypeError for a leaf that is not a tensor."""
    if type(output) is torch.Tensor:  # the common case, in as few calls as it takes
        if output.dtype is torch.float32 or not output.is_floating_point():
            return (output,)
        return (output.float(),)
    leaves = tuple(pytree.tree_leaves(output))
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(f"the model's output holds a {type(leaf).__name__}; every leaf must be a tensor")
    return tuple(leaf.float() if leaf.is_floating_point() and leaf.dtype != torch.float32 else leaf for leaf in leaves)


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
    for leaf, described in zip(leaves, describe_leaves(output)):
        if leaf.dim() == 0 or leaf.shape[0] != rows:
            return (
                f"output leaf {described} has no batch dimension of {rows} first; the server splits every leaf "
                "along its first dimension, one response per request"
            )
    return None
