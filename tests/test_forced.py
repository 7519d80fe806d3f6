"""Teacher-forced capture of existing answers equals capture during generation."""

from __future__ import annotations

import pytest
import torch
from test_capture_families import FAMILIES, tiny_model

from actmap.capture import CaptureConfig, capture_answers, generate_with_capture
from actmap.maps import build_map

PROMPTS = ["what is the capital of the river", "red blue", "how many days are in two weeks"]


def assert_same_capture(generated, forced, atol=1e-4):
    for g, f in zip(generated, forced, strict=True):
        assert f.token_ids == g.token_ids
        assert f.prompt_tokens == g.prompt_tokens
        torch.testing.assert_close(f.trajectory, g.trajectory, atol=atol, rtol=atol)
        torch.testing.assert_close(f.logprobs, g.logprobs, atol=atol, rtol=atol)
        torch.testing.assert_close(f.entropies, g.entropies, atol=atol, rtol=atol)
        if g.n_tokens:
            f_map, g_map = build_map(f.trajectory), build_map(g.trajectory)
            torch.testing.assert_close(f_map, g_map, atol=atol * 10, rtol=atol * 10)
        if g.stopped:  # the end token's statistics are the state after the last answer token
            assert f.extras["eos_logprob"] == pytest.approx(g.extras["eos_logprob"], abs=atol)


@pytest.mark.parametrize("family", FAMILIES)
def test_forced_capture_equals_generation_capture_on_every_layout(family, word_tokenizer):
    model = tiny_model(family, word_tokenizer)
    config = CaptureConfig(max_new_tokens=5, batch_size=3)
    generated = generate_with_capture(model, word_tokenizer, PROMPTS, config)
    forced = capture_answers(
        model, word_tokenizer, PROMPTS, [g.token_ids for g in generated], config
    )
    assert_same_capture(generated, forced)


def test_forced_capture_keeps_attention_and_dense_as_generation(tiny_llama, word_tokenizer):
    config = CaptureConfig(max_new_tokens=6, batch_size=2, attention_keys=3, keep_dense=True)
    generated = generate_with_capture(tiny_llama, word_tokenizer, PROMPTS, config)
    # one batch of three (different padding than generation's batches of two)
    forced = capture_answers(
        tiny_llama,
        word_tokenizer,
        PROMPTS,
        [g.token_ids for g in generated],
        CaptureConfig(batch_size=3, attention_keys=3, keep_dense=True),
    )
    assert_same_capture(generated, forced)
    for g, f in zip(generated, forced, strict=True):
        torch.testing.assert_close(f.attention, g.attention, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(f.dense.float(), g.dense.float(), atol=2e-3, rtol=1e-3)


def test_forced_capture_of_answer_text_tokenizes_it_on_its_own(tiny_llama, word_tokenizer):
    forced = capture_answers(tiny_llama, word_tokenizer, PROMPTS[:2], ["paris rome", "yes"])
    assert [f.token_ids for f in forced] == [
        word_tokenizer("paris rome", add_special_tokens=False)["input_ids"],
        word_tokenizer("yes", add_special_tokens=False)["input_ids"],
    ]
    assert [f.answer for f in forced] == ["paris rome", "yes"]
    assert all(f.stopped and "eos_logprob" in f.extras for f in forced)


@pytest.mark.real_model
def test_forced_capture_equals_generation_capture_on_smollm2(smollm2):
    from actmap.data.prompts import render_chat

    model, tokenizer, _ = smollm2
    questions = ["What is 7 + 5?", "Name the capital of France.", "What is 12 times 3?"]
    prompts = [render_chat(tokenizer, [{"role": "user", "content": q}]) for q in questions]
    config = CaptureConfig(max_new_tokens=12, batch_size=3)
    generated = generate_with_capture(model, tokenizer, prompts, config)
    assert all(g.n_tokens > 0 for g in generated)
    forced = capture_answers(model, tokenizer, prompts, [g.token_ids for g in generated], config)
    assert_same_capture(generated, forced, atol=2e-3)
    # the answer text alone (as a server log gives it) tokenizes back to the same tokens
    from_text = capture_answers(model, tokenizer, prompts, [g.answer for g in generated], config)
    assert [f.token_ids for f in from_text] == [g.token_ids for g in generated]


def test_map_only_forced_capture_keeps_the_trajectories_and_no_step_statistics(
    tiny_llama, word_tokenizer
):
    generated = generate_with_capture(
        tiny_llama, word_tokenizer, PROMPTS, CaptureConfig(max_new_tokens=5)
    )
    forced = capture_answers(
        tiny_llama,
        word_tokenizer,
        PROMPTS,
        [g.token_ids for g in generated],
        CaptureConfig(greybox=False),
    )
    for g, f in zip(generated, forced, strict=True):
        assert f.token_ids == g.token_ids and f.logprobs is None and f.entropies is None
        torch.testing.assert_close(f.trajectory, g.trajectory, atol=1e-4, rtol=1e-4)
