"""Capture against an independent reference: a teacher-forced forward pass over prompt + answer."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from actmap.capture import (
    CaptureConfig,
    UnknownModelLayout,
    find_decoder_layers,
    generate_plain,
    generate_with_capture,
)

PROMPTS = [
    "what is the capital of the river",
    "who wrote",
    "how many minutes in two hours and three days of the week",
    "red blue",
]


def teacher_forced(model, tokenizer, prompt: str, answer_ids: list[int], attentions: bool = False):
    """Per-layer block outputs, log-softmax and attentions of one unpadded forward over [prompt; answer]."""
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    ids = torch.tensor([prompt_ids + answer_ids])
    layers = find_decoder_layers(model)
    outputs: list[torch.Tensor] = []
    handles = [
        layer.register_forward_hook(
            lambda m, a, o: outputs.append(o if isinstance(o, torch.Tensor) else o[0])
        )
        for layer in layers
    ]
    try:
        with torch.no_grad():
            result = model(ids, output_attentions=attentions)
    finally:
        for h in handles:
            h.remove()
    hidden = torch.stack([o[0] for o in outputs])  # (L, P + T, D)
    logp = F.log_softmax(result.logits[0].float(), -1)  # (P + T, V)
    return len(prompt_ids), hidden, logp, result.attentions


def test_tokens_identical_with_and_without_capture(tiny_llama, word_tokenizer):
    config = CaptureConfig(max_new_tokens=12, batch_size=4)
    plain = generate_plain(tiny_llama, word_tokenizer, PROMPTS, config)
    captured = generate_with_capture(tiny_llama, word_tokenizer, PROMPTS, config)
    prompt_len = plain.shape[1] - config.max_new_tokens
    for row, record in enumerate(captured):
        assert record.token_ids == plain[row, prompt_len : prompt_len + record.n_tokens].tolist()
        assert record.n_tokens == config.max_new_tokens  # random model never emits <eos> here


def test_trajectory_logprobs_entropies_match_teacher_forcing(tiny_llama, word_tokenizer):
    config = CaptureConfig(max_new_tokens=7, batch_size=4)
    records = generate_with_capture(tiny_llama, word_tokenizer, PROMPTS, config)
    for record in records:
        p, hidden, logp, _ = teacher_forced(
            tiny_llama, word_tokenizer, record.prompt, record.token_ids
        )
        T = record.n_tokens
        positions = torch.arange(p - 1, p - 1 + T)  # row t <- the state that produced token t
        expected = F.adaptive_avg_pool1d(hidden[:, positions, :], 128)  # (L, T, 128)
        assert record.trajectory.shape == (len(find_decoder_layers(tiny_llama)), T, 128)
        torch.testing.assert_close(record.trajectory, expected, atol=1e-4, rtol=1e-4)
        chosen = logp[positions, torch.tensor(record.token_ids)]
        torch.testing.assert_close(record.logprobs, chosen, atol=1e-4, rtol=1e-4)
        entropy = -(logp[positions].exp() * logp[positions]).sum(-1)
        torch.testing.assert_close(record.entropies, entropy, atol=1e-4, rtol=1e-4)
        assert record.prompt_tokens == p


def test_map_only_capture_computes_nothing_over_the_vocabulary(tiny_llama, word_tokenizer):
    # same tokens and trajectories as the full capture; no log-softmax runs at any step
    full = generate_with_capture(
        tiny_llama, word_tokenizer, PROMPTS, CaptureConfig(max_new_tokens=6)
    )
    calls = []
    original = torch.log_softmax

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    torch.log_softmax = counting
    try:
        config = CaptureConfig(max_new_tokens=6, greybox=False)
        plain = generate_plain(tiny_llama, word_tokenizer, PROMPTS, config)
        assert calls == []  # generate itself (greedy) takes no log-softmax either
        maps_only = generate_with_capture(tiny_llama, word_tokenizer, PROMPTS, config)
    finally:
        torch.log_softmax = original
    assert calls == []
    start = plain.shape[1] - config.max_new_tokens
    for row, (record, ref) in enumerate(zip(maps_only, full, strict=True)):
        assert record.token_ids == ref.token_ids
        assert record.token_ids == plain[row, start : start + record.n_tokens].tolist()
        torch.testing.assert_close(record.trajectory, ref.trajectory, atol=0, rtol=0)
        assert record.logprobs is None and record.entropies is None and record.extras == {}
        assert ref.logprobs is not None and ref.logprobs.shape == (ref.n_tokens,)


def test_stop_token_is_not_part_of_the_answer(tiny_llama, word_tokenizer):
    config = CaptureConfig(max_new_tokens=10, batch_size=4)
    plain = generate_plain(tiny_llama, word_tokenizer, PROMPTS[:1], config)
    generated = plain[0, -config.max_new_tokens :].tolist()
    stop = generated[3]  # declare the 4th generated token a stop token
    first = generated.index(stop)
    original = tiny_llama.generation_config.eos_token_id
    tiny_llama.generation_config.eos_token_id = stop
    try:
        (record,) = generate_with_capture(tiny_llama, word_tokenizer, PROMPTS[:1], config)
    finally:
        tiny_llama.generation_config.eos_token_id = original
    assert record.stopped
    assert record.token_ids == generated[:first]
    assert record.trajectory.shape[1] == record.logprobs.shape[0] == first
    p, _, logp, _ = teacher_forced(
        tiny_llama, word_tokenizer, record.prompt, generated[: first + 1]
    )
    assert record.extras["eos_logprob"] == pytest.approx(float(logp[p - 1 + first, stop]), abs=1e-4)


def test_stop_string_ends_the_answer_like_a_stop_token(tiny_llama, word_tokenizer):
    config = CaptureConfig(max_new_tokens=10, batch_size=4)
    plain = generate_plain(tiny_llama, word_tokenizer, PROMPTS, config)
    full = generate_with_capture(tiny_llama, word_tokenizer, PROMPTS, config)
    generated = plain[0, -config.max_new_tokens :].tolist()
    stop = " " + word_tokenizer.decode([generated[4]])  # a word boundary, then the 5th word
    stopped_config = CaptureConfig(max_new_tokens=10, batch_size=4, stop_strings=(stop,))
    records = generate_with_capture(tiny_llama, word_tokenizer, PROMPTS, stopped_config)
    for record, reference in zip(records, full, strict=True):
        text = word_tokenizer.decode(reference.token_ids)
        cut = text.find(stop)
        # independent reference: the words before the stop string are the kept tokens
        k = len(text[:cut].split()) if cut >= 0 else reference.n_tokens
        assert record.token_ids == reference.token_ids[:k]
        assert record.answer == (text[:cut] if cut >= 0 else text)
        assert record.stopped == (cut >= 0)
        torch.testing.assert_close(record.trajectory, reference.trajectory[:, :k])
        torch.testing.assert_close(record.logprobs, reference.logprobs[:k])
        if cut >= 0:  # the stop string's first token plays the end-of-sequence token's part
            assert record.extras["eos_logprob"] == pytest.approx(float(reference.logprobs[k]))
    assert records[0].stopped and records[0].n_tokens <= 4  # the stop branch above ran
    # the stop ends generation: one prompt alone stops right after its stop string
    (alone,) = generate_plain(tiny_llama, word_tokenizer, PROMPTS[:1], stopped_config)[:, None]
    prompt_len = len(word_tokenizer(PROMPTS[0], add_special_tokens=False)["input_ids"])
    assert alone.shape[1] - prompt_len == records[0].n_tokens + 1


def test_stop_position_skips_leading_whitespace():
    from actmap.capture.stopping import stop_position

    assert stop_position("\n\nParis\nQuestion", ("\n",)) == 0
    assert stop_position("\n\nParis\nQuestion", ("\n",), skip_leading_whitespace=True) == 7
    assert stop_position(" Paris Question:", ("\n", "Question:"), True) == 7
    assert stop_position("  \n ", ("\n",), True) is None  # only whitespace: not yet an answer
    with pytest.raises(ValueError, match="stop_strings"):
        CaptureConfig(stop_strings=("",))


def test_shared_prefix_runs_once_and_changes_nothing(
    tiny_llama, word_tokenizer, vocabulary_projections
):
    from actmap.capture.generate import shared_prefix_length, tokenize_prompts

    head = "what is the capital of the river and the city of paris what is "
    prompts = [head + q for q in ("red blue", "one", "how many minutes in two hours", "who")]
    config = CaptureConfig(max_new_tokens=8, batch_size=4, attention_keys=3)
    encoded = tokenize_prompts(word_tokenizer, prompts, config, "cpu")
    n_head = len(word_tokenizer(head.strip(), add_special_tokens=False)["input_ids"])
    assert shared_prefix_length(encoded) == n_head  # the word tokenizer splits at spaces
    reference = generate_with_capture(tiny_llama, word_tokenizer, prompts, config)
    fed = []  # tokens per forward call: the prefix once, then the batch without it
    handle = tiny_llama.register_forward_pre_hook(
        lambda m, args, kwargs: fed.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    try:
        shared = CaptureConfig(max_new_tokens=8, batch_size=4, attention_keys=3, share_prefix=4)
        with (
            warnings.catch_warnings(record=True) as seen,
            vocabulary_projections(tiny_llama) as projected,
        ):
            warnings.simplefilter("always")
            records = generate_with_capture(tiny_llama, word_tokenizer, prompts, shared)
    finally:
        handle.remove()
    assert projected[0] == 1  # the prefix pass keeps no logits but its last position's
    # the cache goes in under the keyword this transformers release takes (no deprecation)
    assert not [w for w in seen if "past_key_values" in str(w.message)]
    assert fed[0] == (1, n_head) and fed[1][1] == max(r.prompt_tokens for r in records) - n_head
    for record, ref in zip(records, reference, strict=True):
        assert record.token_ids == ref.token_ids and record.prompt_tokens == ref.prompt_tokens
        torch.testing.assert_close(record.trajectory, ref.trajectory, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(record.logprobs, ref.logprobs, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(record.attention, ref.attention, atol=1e-5, rtol=1e-5)
    # no prefix long enough: the ordinary path
    short = CaptureConfig(max_new_tokens=8, batch_size=4, share_prefix=n_head + 1)
    fed.clear()
    generate_plain(tiny_llama, word_tokenizer, prompts, short)
    with pytest.raises(ValueError, match="share_prefix"):
        CaptureConfig(share_prefix=-1)


def test_attention_entries_match_teacher_forced_eager_attention(word_tokenizer):
    from conftest import make_tiny_llama

    model = make_tiny_llama(len(word_tokenizer), attn_implementation="eager")
    keys = 3
    config = CaptureConfig(max_new_tokens=6, batch_size=4, attention_keys=keys)
    records = generate_with_capture(model, word_tokenizer, PROMPTS, config)
    for record in records:
        p, _, _, attentions = teacher_forced(
            model, word_tokenizer, record.prompt, record.token_ids, True
        )
        A = torch.stack([a[0] for a in attentions])  # (L, H, S, S)
        assert record.attention.shape == (record.n_tokens, A.shape[0], A.shape[1], keys)
        for t in range(record.n_tokens):
            for k in range(1, keys + 1):
                got = record.attention[t, :, :, k - 1]
                if t - k < 0:
                    assert torch.all(got == 0)
                else:  # query = token t-1 at position p-1+t; key = generated token t-k at p+t-k
                    torch.testing.assert_close(
                        got, A[:, :, p - 1 + t, p + t - k], atol=1e-5, rtol=1e-4
                    )


def test_dense_states_are_the_unpooled_block_outputs(tiny_llama, word_tokenizer):
    config = CaptureConfig(max_new_tokens=5, batch_size=4, keep_dense=True, dense_max_tokens=3)
    records = generate_with_capture(tiny_llama, word_tokenizer, PROMPTS, config)
    for record in records:
        p, hidden, _, _ = teacher_forced(
            tiny_llama, word_tokenizer, record.prompt, record.token_ids
        )
        assert record.dense.shape == (hidden.shape[0], 3, hidden.shape[-1])
        assert record.dense.dtype == torch.float16
        torch.testing.assert_close(
            record.dense.float(), hidden[:, p - 1 : p + 2], atol=2e-3, rtol=2e-3
        )


def test_hooks_are_removed_when_generation_raises(tiny_llama, word_tokenizer):
    layers = find_decoder_layers(tiny_llama)
    calls = {"n": 0}

    def explode(module, args, output):
        calls["n"] += 1
        if calls["n"] == 3:  # the third decoding step
            raise RuntimeError("boom")

    handle = layers[1].register_forward_hook(explode)
    try:
        with pytest.raises(RuntimeError, match="boom"):
            generate_with_capture(
                tiny_llama, word_tokenizer, PROMPTS, CaptureConfig(max_new_tokens=4)
            )
    finally:
        handle.remove()
    modules = list(tiny_llama.modules())
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in modules)


def test_unknown_layout_names_the_model_class():
    class Mystery(nn.Module):
        def __init__(self):
            super().__init__()
            self.stack = nn.ModuleList([nn.Linear(2, 2)])

    with pytest.raises(UnknownModelLayout, match="Mystery.*layers_path"):
        find_decoder_layers(Mystery())
    assert len(find_decoder_layers(Mystery(), layers_path="stack")) == 1
    with pytest.raises(UnknownModelLayout, match="nowhere"):
        find_decoder_layers(Mystery(), layers_path="nowhere")


def test_bad_prompts_and_long_prompts(tiny_llama, word_tokenizer):
    with pytest.raises(ValueError, match="no prompts"):
        generate_with_capture(tiny_llama, word_tokenizer, [], CaptureConfig())
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generate_with_capture(tiny_llama, word_tokenizer, ["red", ""], CaptureConfig())
    long_prompt = " ".join(["red blue green"] * 40)  # 120 tokens
    config = CaptureConfig(max_new_tokens=4, max_context=24)
    (record,) = generate_with_capture(tiny_llama, word_tokenizer, [long_prompt], config)
    assert record.prompt_tokens == 20  # kept the last max_context - max_new_tokens tokens


@pytest.mark.real_model
def test_real_smollm2_capture_is_exact_and_free_of_side_effects(smollm2):
    model, tokenizer, _ = smollm2
    messages = [[{"role": "user", "content": q}] for q in ("What is 2 + 3?", "Name a color.")]
    prompts = [
        tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True)
        for m in messages
    ]
    config = CaptureConfig(max_new_tokens=8, batch_size=2)
    plain = generate_plain(model, tokenizer, prompts, config)
    records = generate_with_capture(model, tokenizer, prompts, config)
    prompt_len = max(r.prompt_tokens for r in records)
    for row, record in enumerate(records):
        assert record.trajectory.shape == (30, record.n_tokens, 128)
        assert torch.isfinite(record.trajectory).all()
        assert record.token_ids == plain[row, prompt_len : prompt_len + record.n_tokens].tolist()


def test_real_smollm2_few_shot_answer_stops_at_the_newline(smollm2):
    model, tokenizer, _ = smollm2
    prompt = (
        "Answer the question.\n\nQuestion: What is the capital of France?\nAnswer: Paris\n\n"
        "Question: What is the capital of Italy?\nAnswer: Rome\n\n"
        "Question: What is the capital of Germany?\nAnswer:"
    )
    free = generate_with_capture(model, tokenizer, [prompt], CaptureConfig(max_new_tokens=16))[0]
    assert "\n" in free.answer  # without a stop string the model runs on past its answer
    config = CaptureConfig(max_new_tokens=16, stop_strings=("\n",))
    (record,) = generate_with_capture(model, tokenizer, [prompt], config)
    assert record.answer == free.answer.split("\n", 1)[0]
    assert record.stopped and "\n" not in tokenizer.decode(record.token_ids)
    torch.testing.assert_close(record.trajectory, free.trajectory[:, : record.n_tokens])
