"""A small model that is not an image classifier, to copy when bringing your own: a transformer encoder over token
ids and an attention mask that returns a dict of two tensors (a pooled embedding per sequence and per-token logits).

    python server.py --model examples.tiny_encoder:make_model --model_kwargs '{"depth": 2}' \
        --input ids:int64:64:0-999 --input mask:int64:64:1-1

The factory is imported from the current directory (run the command from the checkout's root) and called with
--model_kwargs as keyword arguments; it must return an nn.Module. Its forward takes the inputs in --input order.
"""

from __future__ import annotations

import torch
from torch import nn


class TinyEncoder(nn.Module):
    """Token and position embeddings, `depth` pre-norm encoder layers, a masked mean over the tokens."""

    def __init__(self, vocab: int = 1000, width: int = 64, heads: int = 4, depth: int = 2, max_tokens: int = 512):
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(max_tokens, width)
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
        # The nested-tensor fast path is an inference shortcut that torch.export cannot trace: off, same arithmetic.
        self.encoder = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.tokens(ids) + self.positions(positions)
        # mask: 1 for a real token, 0 for padding; the encoder's key-padding mask is True where to ignore.
        x = self.encoder(x, src_key_padding_mask=mask == 0)
        weights = mask.unsqueeze(-1).to(x.dtype)
        pooled = (x * weights).sum(1) / weights.sum(1).clamp_min(1.0)
        return {"pooled": pooled, "logits": self.head(x)}


def make_model(vocab: int = 1000, width: int = 64, heads: int = 4, depth: int = 2) -> nn.Module:
    torch.manual_seed(0)  # the same weights in every process: --verify compares the backend with itself
    return TinyEncoder(vocab=vocab, width=width, heads=heads, depth=depth)
