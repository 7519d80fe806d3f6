"""Lookback attention: the weights RAUQ and TAD read, without eager attention.

RAUQ and TAD read, at each generated token, the attention of its query to the K previous
answer tokens' keys. Eager attention materialises every weight of every query to every key;
at a decode step that is cheap to compute but eager attention itself is slower than the fused
kernel (and on a GPU it is the path that costs +27-43%). Here the step's output comes from
PyTorch's fused attention (transformers' SDPA path, as map-only capture runs) and the K
weights are computed beside it, exactly:

    z_j = scale * q . k_j  (+ soft-cap, + mask)   for every key j of the newest query
    w_j = exp(z_j - logsumexp_j z_j)               kept for the K newest keys only

one (H, kv) dot product per step and layer, the normaliser over all keys exact (a float32
log-sum-exp), nothing of size (Q, kv) for a multi-token pass. In float32 a decode step
computes its output from those same logits (softmax, then weights @ V per key/value head)
instead of calling the fused kernel as well: the logits are computed once, as eager attention
does; the prompt pass stays fused. It is registered with
transformers as ``"actmap_lookback"`` (with SDPA's mask) and switched on for the block of
`lookback_attention`; a family it does not reproduce (`LOOKBACK_FAMILIES`, tested against
eager) keeps eager attention. Weights equal eager attention's to float rounding (float32:
1e-6); in half precision eager rounds its logits to the model dtype before the softmax and
this route does not, so they agree to that dtype's rounding.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
from torch import nn

NAME = "actmap_lookback"
# model_type of the families whose attention calls transformers' attention interface with
# post-RoPE queries and the cache's keys, scaled dot product, additive/boolean mask, softmax
# over keys; tested against eager in tests/test_lookback.py
LOOKBACK_FAMILIES = frozenset(
    {"llama", "mistral", "qwen2", "qwen3", "gemma3_text", "gemma3", "gemma2"}
)

_KEYS: ContextVar[int] = ContextVar("actmap_lookback_keys", default=0)
# float32 decode steps take their output from the lookback logits (`float32_decode_step`);
# False: the fused kernel's output plus the log-sum-exp weights, as half precision always does
OWN_FLOAT32_DECODE = True


def newest_logits(
    query: torch.Tensor,
    key: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """(B, H, 1, kv) float32 attention logits of the newest query to every key, masked.

    query (B, H, Q, d) post-RoPE; key (B, KV, kv, d) with H = KV * G (query head h reads key
    head h // G, repeat_kv's order); attention_mask (B, 1|H, Q, kv) boolean (True = attend)
    or additive float, or None.
    """
    batch, heads, _, dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    q = query[:, :, -1:].float().reshape(batch, kv_heads, heads // kv_heads, dim)  # (B, KV, G, d)
    logits = torch.matmul(q, key.float().transpose(2, 3)).reshape(batch, heads, 1, kv_len)
    logits = logits * scaling  # (B, H, 1, kv)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    if attention_mask is not None:
        mask = attention_mask[:, :, -1:, -kv_len:]
        if mask.dtype == torch.bool:
            logits = logits.masked_fill(~mask, float("-inf"))
        else:
            logits = logits + mask.float()
    return logits


def lookback_weights(
    query: torch.Tensor,
    key: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    keys: int,
    softcap: float | None = None,
) -> torch.Tensor:
    """(B, H, 1, K') weights of the newest query to the K' = min(keys, kv) newest keys:
    exp(logit - logsumexp over every key), shapes as `newest_logits`."""
    logits = newest_logits(query, key, attention_mask, scaling, softcap)
    take = min(keys, logits.shape[-1])
    return torch.exp(logits[..., -take:] - torch.logsumexp(logits, dim=-1, keepdim=True))


def float32_decode_step(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    keys: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A float32 decode step (one query): softmax of `newest_logits`, output = weights @ V per
    key/value head (no key copy); the K' newest weights. One logits product per step, as
    eager attention computes it."""
    batch, heads, _, dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    weights = torch.softmax(newest_logits(query, key, attention_mask, scaling), dim=-1)
    grouped = weights.view(batch, kv_heads, heads // kv_heads, kv_len)  # (B, KV, G, kv)
    output = torch.matmul(grouped, value).view(batch, heads, 1, dim).transpose(1, 2)
    return output.contiguous(), weights[..., -min(keys, kv_len) :]


def lookback_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(output (B, Q, H, d) from SDPA, lookback weights (B, H, 1, K') or None for Q > 1)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if scaling is None:
        scaling = module.head_dim**-0.5
    if softcap is not None or kwargs.get("sinks") is not None or kwargs.get("s_aux") is not None:
        import sys

        own = sys.modules[type(module).__module__].eager_attention_forward
        extra = {"softcap": softcap} if softcap is not None else {}
        output, weights = own(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
            **extra, **kwargs,
        )  # fmt: skip
        return output, weights
    keys = _KEYS.get()
    own = OWN_FLOAT32_DECODE and query.dtype == torch.float32 and not module.training
    if query.shape[2] == 1 and keys and own:
        return float32_decode_step(query, key, value, attention_mask, scaling, keys)
    output, _ = sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
    )
    if query.shape[2] > 1 or keys == 0:  # the prompt pass: no generated key to read
        return output, None
    return output, lookback_weights(query, key, attention_mask, scaling, keys)  # float32


def register() -> str:
    """Register the lookback attention (with SDPA's mask) under `NAME`; idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(NAME, lookback_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)
    return NAME


def supports_lookback(model: nn.Module) -> bool:
    config = getattr(model.config, "text_config", model.config)
    return getattr(config, "model_type", None) in LOOKBACK_FAMILIES


@contextmanager
def lookback_attention(model: nn.Module, keys: int) -> Iterator[None]:
    """Inside the block the model runs SDPA attention and each decode step's attention modules
    return the weights to the ``keys`` newest keys; the implementation is restored after."""
    current = getattr(model.config, "_attn_implementation", None)
    model.set_attn_implementation(register())
    token = _KEYS.set(keys)
    try:
        yield
    finally:
        _KEYS.reset(token)
        model.set_attn_implementation(current)
