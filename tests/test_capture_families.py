"""Capture on a tiny random model of every decoder layout actmap knows (no download)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_capture import teacher_forced

from actmap.capture import CaptureConfig, find_decoder_layers, generate_plain, generate_with_capture

SMALL = dict(
    hidden_size=64, num_attention_heads=4, intermediate_size=128, max_position_embeddings=128
)


def _configs(vocab: int):
    import transformers as tf

    return {
        "llama": lambda: tf.LlamaConfig(
            vocab_size=vocab, num_hidden_layers=2, num_key_value_heads=2, **SMALL
        ),
        "mistral": lambda: tf.MistralConfig(
            vocab_size=vocab, num_hidden_layers=2, num_key_value_heads=2, **SMALL
        ),
        "qwen2": lambda: tf.Qwen2Config(
            vocab_size=vocab, num_hidden_layers=3, num_key_value_heads=2, **SMALL
        ),
        "qwen3": lambda: tf.Qwen3Config(
            vocab_size=vocab, num_hidden_layers=2, num_key_value_heads=2, head_dim=16, **SMALL
        ),
        "gemma3": lambda: tf.Gemma3TextConfig(
            vocab_size=vocab, num_hidden_layers=2, num_key_value_heads=2, head_dim=16, **SMALL
        ),
        "gpt2": lambda: tf.GPT2Config(
            vocab_size=vocab, n_layer=2, n_embd=64, n_head=4, n_positions=128
        ),
        "gpt_neox": lambda: tf.GPTNeoXConfig(vocab_size=vocab, num_hidden_layers=2, **SMALL),
    }


FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma3", "gpt2", "gpt_neox"]


def tiny_model(family: str, tokenizer):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = _configs(len(tokenizer))[family]()
    config.pad_token_id, config.eos_token_id = 0, 1
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("family", FAMILIES)
def test_every_known_layout_captures_all_layers_without_changing_tokens(family, word_tokenizer):
    model = tiny_model(family, word_tokenizer)
    config = model.config
    prompts = ["what is the capital of the river", "red blue"]
    settings = CaptureConfig(max_new_tokens=4, batch_size=2)
    plain = generate_plain(model, word_tokenizer, prompts, settings)
    records = generate_with_capture(model, word_tokenizer, prompts, settings)
    layers = len(find_decoder_layers(model))
    assert layers == getattr(config, "num_hidden_layers", getattr(config, "n_layer", None))
    width = max(r.prompt_tokens for r in records)
    for row, record in enumerate(records):
        assert record.trajectory.shape == (layers, record.n_tokens, 128)
        assert torch.isfinite(record.trajectory).all()
        assert record.token_ids == plain[row, width : width + record.n_tokens].tolist()
        # independent reference: block outputs of an unpadded teacher-forced pass
        p, hidden, _, _ = teacher_forced(model, word_tokenizer, record.prompt, record.token_ids)
        expected = F.adaptive_avg_pool1d(hidden[:, p - 1 : p - 1 + record.n_tokens], 128)
        torch.testing.assert_close(record.trajectory, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_shared_prefix_cache_works_for_every_layout(family, word_tokenizer):
    model = tiny_model(family, word_tokenizer)
    head = "what is the capital of the river and the city "
    prompts = [head + "red blue", head + "one two three four", head + "who"]
    plain = generate_with_capture(model, word_tokenizer, prompts, CaptureConfig(max_new_tokens=4))
    shared = generate_with_capture(
        model, word_tokenizer, prompts, CaptureConfig(max_new_tokens=4, share_prefix=4)
    )
    for a, b in zip(plain, shared, strict=True):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(a.trajectory, b.trajectory, atol=1e-4, rtol=1e-4)
