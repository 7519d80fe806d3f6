"""The grouped eager attention gives transformers' eager weights and outputs, without the copy."""

from __future__ import annotations

import pytest
import torch

from actmap.capture.attention import GROUPED_FAMILIES, NAME, register, weights_implementation
from actmap.capture.generate import _eager_attention


def _tiny(family: str, kv_heads: int = 2):
    """A randomly initialised grouped-query model of the family: 4 query heads."""
    import transformers as tf

    common = dict(
        vocab_size=61,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=128,
        pad_token_id=0,
    )
    torch.manual_seed(3)
    if family == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(**common)).eval()
    if family == "qwen2":
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(**common)).eval()
    # Gemma-3: a sliding-window layer (window 5) and a full one, logits soft-capped
    config = tf.Gemma3TextConfig(
        **common,
        head_dim=16,
        sliding_window=5,
        layer_types=["sliding_attention", "full_attention"],
        attn_logit_softcapping=4.0,
    )
    return tf.Gemma3ForCausalLM(config).eval()


def _batch():
    torch.manual_seed(5)
    ids = torch.randint(3, 61, (3, 11))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding, as capture pads
    mask[2, :1] = 0
    return ids, mask


def _run(model, implementation: str, ids, mask):
    model.set_attn_implementation(implementation)
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=mask, output_attentions=True)
        steps = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=4,
            do_sample=False,
            output_attentions=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    return full, steps


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
def test_grouped_attention_matches_eager_in_a_pass_and_in_cached_generation(family):
    model = _tiny(family)
    assert model.config.model_type in GROUPED_FAMILIES
    ids, mask = _batch()
    eager_full, eager_gen = _run(model, "eager", ids, mask)
    ours_full, ours_gen = _run(model, register(), ids, mask)
    torch.testing.assert_close(ours_full.logits, eager_full.logits, atol=1e-5, rtol=1e-5)
    for ours, eager in zip(ours_full.attentions, eager_full.attentions, strict=True):
        assert ours.shape == eager.shape == (3, 4, 11, 11)
        torch.testing.assert_close(ours, eager, atol=1e-6, rtol=1e-5)
    assert torch.equal(ours_gen.sequences, eager_gen.sequences)
    # each decode step: one query over the prompt and the tokens so far, per layer
    for step_ours, step_eager in zip(ours_gen.attentions, eager_gen.attentions, strict=True):
        for ours, eager in zip(step_ours, step_eager, strict=True):
            torch.testing.assert_close(ours, eager, atol=1e-6, rtol=1e-5)


def test_capture_switches_to_the_grouped_attention_and_back():
    model = _tiny("llama")
    model.set_attn_implementation("sdpa")
    with _eager_attention(model, needed=True):
        assert model.config._attn_implementation == NAME
    assert model.config._attn_implementation == "sdpa"
    with _eager_attention(model, needed=False):
        assert model.config._attn_implementation == "sdpa"


def test_models_it_does_not_reproduce_keep_plain_eager():
    """One key/value head per query head (nothing to save), or a family whose eager attention
    it was not checked against (GPT-2's), stays on transformers' eager attention."""
    import transformers as tf

    assert weights_implementation(_tiny("llama", kv_heads=4)) == "eager"
    gpt2 = tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=50))
    assert weights_implementation(gpt2) == "eager"
    assert weights_implementation(_tiny("qwen2")) == NAME


def test_a_module_it_does_not_reproduce_goes_to_its_own_eager_function():
    """Called on a module outside the families (or with one key/value head per query head),
    the function hands the call to the module's own eager attention: identical results."""
    from transformers.models.llama.modeling_llama import eager_attention_forward

    from actmap.capture.attention import grouped_eager_attention

    model = _tiny("llama", kv_heads=4)
    module = model.model.layers[0].self_attn
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 6, 16) for _ in range(3))
    ours = grouped_eager_attention(module, q, k, v, None, scaling=0.25)
    eager = eager_attention_forward(module, q, k, v, None, scaling=0.25)
    assert torch.equal(ours[0], eager[0]) and torch.equal(ours[1], eager[1])


def test_capture_with_a_fused_prompt_pass_matches_eager_capture(tiny_llama, word_tokenizer):
    """`generate_batch` runs the prompt through fused attention (its weights are never read)
    and every generated token through the grouped eager attention: the same tokens, states and
    attention weights as a capture on transformers' eager attention throughout."""
    from unittest import mock

    from actmap.capture import attention
    from actmap.capture.generate import generate_batch
    from actmap.capture.records import CaptureConfig

    prompts = [
        "how many days in two weeks and how many hours in one day",
        "which river and which city",
        "who wrote the answer to the question in the capital city of rome",
    ]
    config = CaptureConfig(max_new_tokens=6, attention_keys=4, keep_dense=True)
    calls = []
    fused = torch.nn.functional.scaled_dot_product_attention

    def counted(*args, **kwargs):
        calls.append(args[0].shape[2])  # query length
        return fused(*args, **kwargs)

    with mock.patch.object(torch.nn.functional, "scaled_dot_product_attention", counted):
        ours = generate_batch(tiny_llama, word_tokenizer, prompts, config)
    with mock.patch.object(attention, "GROUPED_FAMILIES", frozenset()):
        eager = generate_batch(tiny_llama, word_tokenizer, prompts, config)
    assert calls and all(q > 1 for q in calls)  # the prompt pass only, once per layer
    assert len(calls) == tiny_llama.config.num_hidden_layers
    for a, b in zip(ours, eager, strict=True):
        assert a.token_ids == b.token_ids and a.n_tokens > 1
        torch.testing.assert_close(a.trajectory, b.trajectory, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a.attention, b.attention, atol=1e-6, rtol=1e-5)
        assert a.attention[1:].abs().sum() > 0


def test_half_precision_capture_is_eager_capture_to_the_bit(word_tokenizer):
    """In bfloat16 the grouped attention reproduces eager attention exactly, and the prompt pass
    stays eager (a fused kernel rounds differently and can change greedy answers)."""
    from unittest import mock

    from conftest import make_tiny_llama

    from actmap.capture import attention
    from actmap.capture.generate import generate_batch
    from actmap.capture.records import CaptureConfig

    model = make_tiny_llama(len(word_tokenizer), seed=4).to(torch.bfloat16)
    prompts = ["how many hours in one day and in two days", "who wrote the question"]
    config = CaptureConfig(max_new_tokens=5, attention_keys=3)
    fused = mock.Mock(side_effect=torch.nn.functional.scaled_dot_product_attention)
    with mock.patch.object(torch.nn.functional, "scaled_dot_product_attention", fused):
        ours = generate_batch(model, word_tokenizer, prompts, config)
    with mock.patch.object(attention, "GROUPED_FAMILIES", frozenset()):
        eager = generate_batch(model, word_tokenizer, prompts, config)
    assert fused.call_count == 0
    for a, b in zip(ours, eager, strict=True):
        assert a.token_ids == b.token_ids
        assert torch.equal(a.trajectory, b.trajectory) and torch.equal(a.attention, b.attention)
