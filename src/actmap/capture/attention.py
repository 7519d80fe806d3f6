"""Eager attention for grouped-query models without copying the key/value cache.

Capturing attention weights (RAUQ and TAD read them) needs transformers' eager attention, the
only implementation that returns them. For a grouped-query model (several query heads per
key/value head) eager attention first repeats every key and value head to the query heads'
count (``repeat_kv``): at each generated token it copies the whole cache. On a long prompt
that copy is most of a step (SmolLM2 on CNN/DailyMail articles: 55% of capture time).

`grouped_eager_attention` computes the same weights and output by laying the query heads that
share a key/value head side by side, one matmul per key/value head, so the cache is read once
and never copied. It is registered with transformers as ``"actmap_eager"`` (with the eager
mask) and used for the families whose eager attention it reproduces (`GROUPED_FAMILIES`,
tested against eager); any other module, or a call with attention sinks, goes to the model's
own eager function unchanged.

Inside `prompt_pass_without_weights` (capture while generating: the prompt pass's weights are
never read) a multi-token float32 pass runs PyTorch's fused attention instead and returns no
weights (the same to float rounding). In bfloat16 or float16 the grouped attention gives eager
attention's results to the bit and the fused kernel would not: it rounds differently, enough
to change some greedy answers, so half precision keeps the eager prompt pass.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
from torch import nn

NAME = "actmap_eager"
# model_type of the families whose eager attention is: scaled QK^T (optional logit soft-cap),
# additive mask, float32 softmax, weights @ V; tested against eager in tests/test_attention.py
GROUPED_FAMILIES = frozenset({"llama", "qwen2", "gemma3_text", "gemma3"})


# False while generating with capture: the prompt pass's weights are never read (the capture
# hooks start at the first generated token), so that pass runs fused attention instead
_PROMPT_WEIGHTS: ContextVar[bool] = ContextVar("actmap_prompt_weights", default=True)


@contextmanager
def prompt_pass_without_weights() -> Iterator[None]:
    """Inside this block a multi-token float32 pass (the prompt) returns no attention weights
    and runs PyTorch's fused attention on the same inputs and mask; other passes are unchanged."""
    token = _PROMPT_WEIGHTS.set(False)
    try:
        yield
    finally:
        _PROMPT_WEIGHTS.reset(token)


def _own_eager(module: nn.Module):
    return sys.modules[type(module).__module__].eager_attention_forward


def grouped_eager_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(output (B, Q, H, D), weights (B, H, Q, K)) as the family's eager attention gives."""
    groups = getattr(module, "num_key_value_groups", 1)
    family = getattr(getattr(module, "config", None), "model_type", None)
    if (
        groups == 1
        or family not in GROUPED_FAMILIES
        or module.training
        or kwargs.get("s_aux") is not None
        or kwargs.get("sinks") is not None
    ):
        own = dict(kwargs, dropout=dropout, scaling=scaling)
        if softcap is not None:
            own["softcap"] = softcap
        return _own_eager(module)(module, query, key, value, attention_mask, **own)
    if scaling is None:
        scaling = module.head_dim**-0.5
    # float32 only: in half precision eager attention rounds the weights before weighting the
    # values, and the fused kernel does not; a fused prompt pass would change the answers
    fused = query.dtype == torch.float32 and softcap is None
    if fused and query.shape[2] > 1 and not _PROMPT_WEIGHTS.get():
        output = nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=True
        )
        return output.transpose(1, 2).contiguous(), None
    batch, heads, q_len, dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    # query head h uses key/value head h // groups (repeat_kv's order): stack each group's
    # queries along the query axis, (B, KV, G * Q, D)
    stacked = query.reshape(batch, kv_heads, groups * q_len, dim)
    weights = torch.matmul(stacked, key.transpose(2, 3)) * scaling
    weights = weights.view(batch, heads, q_len, kv_len)
    if softcap is not None:
        weights = torch.tanh(weights / softcap) * softcap
    if attention_mask is not None:
        weights = weights + attention_mask
    weights = nn.functional.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    output = torch.matmul(weights.view(batch, kv_heads, groups * q_len, kv_len), value)
    output = output.view(batch, heads, q_len, dim).transpose(1, 2).contiguous()
    return output, weights


def register() -> str:
    """Register the grouped eager attention (and the eager mask it reads) with transformers
    under `NAME`; idempotent. Returns the name to give ``set_attn_implementation``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask

    AttentionInterface.register(NAME, grouped_eager_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, eager_mask)
    return NAME


def weights_implementation(model: nn.Module) -> str:
    """The attention implementation that returns weights for this model: the grouped eager
    attention for a grouped-query model of a family it reproduces, plain eager otherwise."""
    config = getattr(model.config, "text_config", model.config)
    heads = getattr(config, "num_attention_heads", 0)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if getattr(config, "model_type", None) in GROUPED_FAMILIES and heads > kv_heads:
        return register()
    return "eager"
