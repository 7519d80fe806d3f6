"""The ViT's training path before issue 16's third pass, for benchmarks to time beside.

Inside `previous_training()` the ViT draws its dropout masks with torch's
`F.dropout` (its CPU `bernoulli_`) and its attention runs through
`scaled_dot_product_attention` with `dropout_p` in training (on the CPU the
fused kernel takes no dropout, so torch falls back to its unfused reference).
`torch_masks()` switches the masks alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

import actmap.detectors.vit as vit


def _torch_dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    return F.dropout(x, p, training=True) if training and p > 0.0 else x


def _previous_attention(self: vit.Attention, x: torch.Tensor) -> torch.Tensor:
    B, N, D = x.shape
    qkv = self.qkv(x).reshape(B, N, 3, self.heads, D // self.heads)  # (B, N, 3, h, d)
    q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each (B, h, N, d)
    if not self.training and q.device.type == "cpu" and q.dtype == torch.bfloat16:
        weights = (q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)  # (B, h, N, N)
        out = weights.softmax(dim=-1) @ v  # (B, h, N, d)
    else:
        p = self.attn_drop if self.training else 0.0
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=p)  # (B, h, N, d)
    return self.proj(out.transpose(1, 2).reshape(B, N, D))


@contextlib.contextmanager
def torch_masks() -> Iterator[None]:
    """The ViT's dropout through `F.dropout` (torch's masks) inside the block."""
    fast = vit.dropout
    vit.dropout = _torch_dropout
    try:
        yield
    finally:
        vit.dropout = fast


@contextlib.contextmanager
def previous_training() -> Iterator[None]:
    """torch's masks and the fused-kernel attention in training, inside the block."""
    forward = vit.Attention.forward
    vit.Attention.forward = _previous_attention
    try:
        with torch_masks():
            yield
    finally:
        vit.Attention.forward = forward
