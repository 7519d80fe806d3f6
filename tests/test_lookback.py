"""Lookback attention weights (`actmap.capture.lookback`) against eager attention.

The same tokens are generated with capture twice: eager attention (the reference: its
weights are transformers' own softmax over every key) and the lookback route (fused
attention output, K weights from an exact log-sum-exp). Tolerance: float32, atol 1e-6.
"""

from __future__ import annotations

import pytest
import torch
from test_capture_families import tiny_model

from actmap.capture import CaptureConfig, generate_with_capture
from actmap.capture.lookback import lookback_weights

PROMPTS = ["what is the capital of the river", "red blue", "one two three four five six"]


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "gemma3"])
@pytest.mark.parametrize("share_prefix", [0, 2])
@pytest.mark.parametrize("own_decode", [True, False])  # False: the fused kernel + log-sum-exp
def test_lookback_weights_equal_eager_attention(
    family, share_prefix, own_decode, word_tokenizer, monkeypatch
):
    monkeypatch.setattr("actmap.capture.lookback.OWN_FLOAT32_DECODE", own_decode)
    model = tiny_model(family, word_tokenizer)
    head = "the capital of the river "
    prompts = [head + p for p in PROMPTS] if share_prefix else PROMPTS
    base = CaptureConfig(max_new_tokens=7, batch_size=3, attention_keys=4)
    eager = generate_with_capture(model, word_tokenizer, prompts, base)
    cheap = generate_with_capture(
        model,
        word_tokenizer,
        prompts,
        CaptureConfig(**{**base.__dict__, "lookback_attention": True}),
    )
    assert model.config._attn_implementation != "actmap_lookback"  # restored after
    for e, c in zip(eager, cheap, strict=True):
        assert c.token_ids == e.token_ids
        assert c.attention.shape == e.attention.shape
        assert c.attention[1:].abs().sum() > 0  # generated keys exist from step 1
        torch.testing.assert_close(c.attention, e.attention, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(c.trajectory, e.trajectory, atol=1e-4, rtol=1e-4)


def test_lookback_weights_by_hand():
    torch.manual_seed(0)
    q, k = torch.randn(2, 4, 3, 8), torch.randn(2, 2, 6, 8)  # 4 query heads on 2 kv heads
    mask = torch.ones(2, 1, 3, 6, dtype=torch.bool)
    mask[1, :, :, :2] = False  # row 1 is left-padded by two keys
    got = lookback_weights(q, k, mask, 0.5, keys=3)
    # naive reference: repeat the kv heads, softmax of the last query over its unmasked keys
    full = torch.einsum("bhd,bhkd->bhk", q[:, :, -1], k.repeat_interleave(2, dim=1)) * 0.5
    full = full.masked_fill(~mask[:, :, -1], float("-inf")).softmax(-1)
    torch.testing.assert_close(got[:, :, 0], full[..., -3:])
    additive = torch.where(mask, 0.0, torch.finfo(torch.float32).min)
    torch.testing.assert_close(lookback_weights(q, k, additive, 0.5, keys=3), got)
