"""The paper's compact ViT over a 12 x 32 x 128 activation map (2,401,985 parameters).

Input (B, C, H, W) -> non-overlapping (4, 16) patches -> 8 x 8 = 64 tokens of
width 192 -> class token + factorized row/column positions -> 6 pre-norm
blocks -> final LayerNorm on the class token -> readout 192 -> 128 -> 1.

Parameter accounting for the default shape (`parameter_breakdown`):
patch projection 147,648; class token and positions 3,456; blocks 2,225,664;
final LayerNorm 384; readout 24,833. The final LayerNorm is the readout's LN
(384 + 24,704 + 129 would overshoot the stated total); the class token carries
its own learned position next to the 8 row and 8 column embeddings
(18 x 192 = 3,456).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from actmap.detectors.registry import register_detector

_INT32_SPAN = 2**32  # a dropout mask entry is 32 random bits


def dropout_mask(x: torch.Tensor, p: float) -> torch.Tensor:
    """Inverted-dropout multiplier for `x`: 1 / (1 - p) where an entry is kept, else 0.

    Each entry is kept with probability 1 - p, exact to 2^-32: 32 random bits
    per entry (one 64-bit draw of torch's generator per two entries) against
    a threshold. On the CPU torch's `bernoulli_` draws entry by entry (about
    10 ns each on this AMD CPU; MKL's generator on Intel ones), five times
    slower than this; the masks of one seed differ from `F.dropout`'s.
    """
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    n = x.numel()
    words = torch.empty((n + 1) // 2, dtype=torch.int64, device=x.device)
    bits = words.random_(-(2**63), None).view(torch.int32)[:n].view(x.shape)  # uniform int32
    threshold = round(p * _INT32_SPAN) - _INT32_SPAN // 2  # P(bits < threshold) = p
    return (bits >= threshold).to(x.dtype).mul_(1.0 / (1.0 - p))


def dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """`F.dropout`, with `dropout_mask` on the CPU (GPUs keep torch's fused kernel)."""
    if not training or p == 0.0:
        return x
    if x.device.type != "cpu" or p == 1.0:
        return F.dropout(x, p, training=True)
    return x * dropout_mask(x, p)


class Dropout(nn.Dropout):
    """`nn.Dropout` drawing its CPU masks with `dropout_mask`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(x, self.p, self.training)


def drop_path(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Stochastic depth: zero a residual branch for whole samples with probability p."""
    if p == 0.0 or not training:
        return x
    keep = 1.0 - p
    mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep)  # (B, 1, 1)
    return x * mask / keep


class DropPath(nn.Module):
    def __init__(self, p: float = 0.0) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return drop_path(x, self.p, self.training)


class Attention(nn.Module):
    """Multi-head self-attention; dropout acts on the attention weights."""

    def __init__(self, dim: int, heads: int, attn_drop: float) -> None:
        super().__init__()
        if dim % heads != 0:
            raise ValueError(f"dim={dim} is not divisible by heads={heads}")
        self.heads = heads
        self.attn_drop = attn_drop
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, D = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.heads, D // self.heads)  # (B, N, 3, h, d)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each (B, h, N, d)
        p = self.attn_drop if self.training else 0.0
        if q.device.type == "cpu" and (p > 0.0 or q.dtype == torch.bfloat16):
            # On the CPU the fused kernel takes no dropout (torch falls back to its
            # unfused reference path) and for 65 tokens in bf16 is 2.5 times slower
            # than two batched products: the same formula, with `dropout_mask`.
            weights = (q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)  # (B, h, N, N)
            out = dropout(weights.softmax(dim=-1), p, self.training) @ v  # (B, h, N, d)
        else:
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=p)  # (B, h, N, d)
        out = out.transpose(1, 2).reshape(B, N, D)  # (B, N, D)
        return self.proj(out)


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int, drop: float) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.drop = Dropout(drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc2(self.drop(F.gelu(self.fc1(x)))))


class Block(nn.Module):
    """Pre-norm transformer block with stochastic depth on both residual branches."""

    def __init__(
        self,
        dim: int,
        heads: int,
        mlp_ratio: int,
        attn_drop: float,
        mlp_drop: float,
        drop_path: float,
    ) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, attn_drop)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, mlp_ratio * dim, mlp_drop)
        self.drop_path = DropPath(drop_path)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop_path(self.attn(self.norm1(x)))
        return x + self.drop_path(self.mlp(self.norm2(x)))


@register_detector("vit")
class MapViT(nn.Module):
    """Compact ViT reading one activation map; `forward` returns one logit per map, (B,)."""

    # `predict_logits` on the CPU scores 64 maps per forward pass: their widest
    # activations (64 x 65 x 576, 4.8 MB in bf16) stay in cache, 1.4x faster than 256
    cpu_scoring_rows = 64

    def __init__(
        self,
        in_channels: int = 12,
        map_height: int = 32,  # depth segments (rows of the map)
        map_width: int = 128,  # pooled hidden coordinates (columns)
        patch: tuple[int, int] = (4, 16),  # (rows, columns) per patch; 32x128 -> 8x8 tokens
        dim: int = 192,
        depth: int = 6,
        heads: int = 6,
        mlp_ratio: int = 3,  # block MLP 192 -> 576 -> 192
        readout_hidden: int = 128,
        attn_drop: float = 0.1,
        mlp_drop: float = 0.3,
        readout_drop: float = 0.3,
        pos_drop: float = 0.15,
        drop_path_max: float = 0.05,  # stochastic depth grows linearly from 0 to this over blocks
    ) -> None:
        super().__init__()
        ph, pw = patch
        if map_height % ph or map_width % pw:
            raise ValueError(
                f"map shape ({map_height}, {map_width}) is not divisible by patch ({ph}, {pw})"
            )
        self.grid = (map_height // ph, map_width // pw)  # (rows, cols) of patch tokens
        self.patch_embed = nn.Conv2d(in_channels, dim, kernel_size=(ph, pw), stride=(ph, pw))
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.cls_pos = nn.Parameter(torch.zeros(1, 1, dim))
        self.row_embed = nn.Parameter(torch.zeros(self.grid[0], dim))
        self.col_embed = nn.Parameter(torch.zeros(self.grid[1], dim))
        self.pos_drop = Dropout(pos_drop)
        rates = torch.linspace(0.0, drop_path_max, depth).tolist() if depth > 1 else [0.0]
        self.blocks = nn.ModuleList(
            Block(dim, heads, mlp_ratio, attn_drop, mlp_drop, rate) for rate in rates
        )
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Sequential(
            nn.Linear(dim, readout_hidden),
            nn.GELU(),
            Dropout(readout_drop),
            nn.Linear(readout_hidden, 1),
        )
        self._init_weights()

    def _init_weights(self) -> None:
        w = self.patch_embed.weight
        nn.init.xavier_uniform_(w.view(w.shape[0], -1))  # as the linear map it is
        for p in (self.cls_token, self.cls_pos, self.row_embed, self.col_embed):
            nn.init.trunc_normal_(p, std=0.02)

    def positions(self) -> torch.Tensor:
        rows, cols = self.grid
        pos = self.row_embed[:, None, :] + self.col_embed[None, :, :]  # (rows, cols, D)
        return pos.reshape(rows * cols, -1)  # (N, D), row-major like the patch tokens

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) maps -> (B, D) normalized class-token features."""
        x = self.patch_embed(x)  # (B, D, rows, cols)
        x = x.flatten(2).transpose(1, 2) + self.positions()  # (B, N, D)
        cls = (self.cls_token + self.cls_pos).expand(x.shape[0], -1, -1)  # (B, 1, D)
        x = self.pos_drop(torch.cat([cls, x], dim=1))  # (B, 1 + N, D)
        for block in self.blocks:
            x = block(x)
        return self.norm(x[:, 0])  # (B, D)

    def forward_head(self, features: torch.Tensor) -> torch.Tensor:
        return self.head(features).squeeze(-1)  # (B,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))


_PARTS = {
    "patch_embed": ("patch_embed.",),
    "position": ("cls_token", "cls_pos", "row_embed", "col_embed"),
    "blocks": ("blocks.",),
    "norm": ("norm.",),
    "head": ("head.",),
}


def parameter_breakdown(model: MapViT) -> dict[str, int]:
    """Trainable parameters per part of the ViT, plus their `total`."""
    counts = dict.fromkeys(_PARTS, 0)
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        part = next((p for p, prefixes in _PARTS.items() if name.startswith(prefixes)), None)
        if part is None:
            raise ValueError(f"parameter {name!r} belongs to no known part of the ViT")
        counts[part] += param.numel()
    counts["total"] = sum(counts.values())
    return counts
