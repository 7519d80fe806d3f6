"""sample_answers: per-row log-likelihoods and embeddings against a teacher-forced pass."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from actmap.baselines.sampling import (
    SamplingConfig,
    TopKTopP,
    _first_tensor,
    cut_answer,
    resolve_embedding_layer,
    sample_answers,
)

EOS_RANGE = range(
    1000, 3000
)  # ~4% of a random model's mass per step: rows end at different lengths


@pytest.fixture(scope="module")
def tokenizer(embedded_tokenizer):
    return embedded_tokenizer


@pytest.fixture(scope="module")
def model(tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = list(EOS_RANGE)
    return model


PROMPTS = ["hi", "a much longer prompt with several more tokens in it"]


def _processed_logp(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float
) -> torch.Tensor:
    """Sampling distribution written independently: temperature, keep top-k, smallest nucleus >= top_p."""
    scaled = logits.double() / temperature
    keep = torch.zeros_like(scaled, dtype=torch.bool)
    order = scaled.argsort(descending=True)[:top_k]
    probs = scaled[order].softmax(-1)
    mass = 0.0
    for idx, p in zip(order.tolist(), probs.tolist(), strict=False):
        keep[idx] = True
        mass += p
        if mass >= top_p:
            break
    return torch.where(keep, scaled, torch.tensor(float("-inf"), dtype=scaled.dtype)).log_softmax(
        -1
    )


def _teacher_forced(model, tokenizer, prompt, answer_ids):
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    ids = torch.tensor([prompt_ids + list(answer_ids)])
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    return len(prompt_ids), out.logits[0], out.hidden_states


@pytest.mark.parametrize("source", ["processed", "raw"])
def test_logprobs_and_embeddings_match_teacher_forcing(model, tokenizer, source):
    temperature, top_k, top_p = 0.7, 20, 0.8
    sets = sample_answers(
        model,
        tokenizer,
        PROMPTS,
        n_samples=4,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        max_new_tokens=8,
        stop_strings=("e",),
        seed=3,
        logprob_source=source,
        batch_size=2,
    )
    n_layers = model.config.num_hidden_layers
    assert [s.prompt for s in sets] == PROMPTS
    lengths = set()
    for s in sets:
        assert s.config.embedding_layer == n_layers // 2 - 1 and s.config.logprob_source == source
        assert s.embeddings.shape == (4, model.config.hidden_size)
        for text, ids, lp, mean, emb in zip(
            s.texts, s.token_ids, s.token_logprobs, s.mean_logprobs, s.embeddings, strict=False
        ):
            assert "e" not in text and not set(ids) & set(EOS_RANGE)
            lengths.add(len(ids))
            if not ids:
                continue
            P, logits, hidden = _teacher_forced(model, tokenizer, s.prompt, ids)
            for k, token in enumerate(ids):
                row = logits[P - 1 + k]
                ref = (
                    row.log_softmax(-1)
                    if source == "raw"
                    else _processed_logp(row, temperature, top_k, top_p)
                )
                assert lp[k].item() == pytest.approx(ref[token].item(), abs=1e-4)
            assert mean.item() == pytest.approx(lp.double().mean().item(), abs=1e-12)
            # hidden_states[L // 2] at the position that produced the last answer token
            torch.testing.assert_close(
                emb, hidden[n_layers // 2][0, P - 1 + len(ids) - 1], atol=1e-4, rtol=1e-4
            )
    assert len(lengths) > 1  # rows of one batch finished at different lengths


@contextmanager
def forward_shapes(model):
    """The (batch, positions) shape of every forward pass run inside the block."""
    shapes = []
    handle = model.model.embed_tokens.register_forward_pre_hook(
        lambda module, args: shapes.append(tuple(args[0].shape))
    )
    try:
        yield shapes
    finally:
        handle.remove()


def test_prompt_runs_once_per_batch_not_once_per_sample(model, tokenizer, vocabulary_projections):
    """The N rows of a prompt share one prompt pass: only one forward sees more than one
    position, at the batch's width B, and every other forward decodes one position for
    B * N rows. No pass projects more than its last position onto the vocabulary."""
    with forward_shapes(model) as shapes, vocabulary_projections(model) as projected:
        sample_answers(model, tokenizer, PROMPTS, n_samples=4, max_new_tokens=3, batch_size=2)
    width = len(tokenizer(PROMPTS[1], add_special_tokens=False)["input_ids"])
    assert shapes[0] == (2, width - 1)
    assert shapes[1:] and all(shape == (8, 1) for shape in shapes[1:])
    assert projected == [1] * len(shapes)


def test_one_token_prompt_runs_as_n_copies(model, tokenizer):
    """With nothing to share before the last token, the N rows run the prompt as N copies."""
    assert len(tokenizer("hi", add_special_tokens=False)["input_ids"]) == 1
    with forward_shapes(model) as shapes:
        (s,) = sample_answers(model, tokenizer, ["hi"], n_samples=3, max_new_tokens=2, seed=2)
    assert shapes[0] == (3, 1) and s.n_samples == 3


def test_shared_prompt_draws_what_n_prompt_copies_draw(model, tokenizer):
    """Under one seed, the shared prompt pass samples the tokens that ``generate`` with
    ``num_return_sequences`` (N prompt copies) samples: each answer is a prefix of its row."""
    prompt, n, steps, seed = PROMPTS[1], 5, 6, 11
    (s,) = sample_answers(
        model, tokenizer, [prompt], n_samples=n, max_new_tokens=steps, stop_strings=(), seed=seed
    )
    ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]])
    torch.manual_seed(seed)
    with torch.no_grad():
        reference = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=True,
            temperature=s.config.temperature,
            top_p=s.config.top_p,
            top_k=s.config.top_k,
            max_new_tokens=steps,
            num_return_sequences=n,
            pad_token_id=tokenizer.pad_token_id,
        )[:, ids.shape[1] :]
    for answer, row in zip(s.token_ids, reference.tolist(), strict=True):
        assert list(answer) == row[: len(answer)]
    assert any(len(answer) > 1 for answer in s.token_ids)


def test_empty_answer_keeps_one_likelihood_and_prompt_state(model, tokenizer):
    # every token of this vocabulary is cut by a stop string that matches any first character
    stops = tuple(chr(c) for c in range(32, 127))
    (s,) = sample_answers(
        model, tokenizer, ["hi"], n_samples=3, max_new_tokens=4, stop_strings=stops, seed=1
    )
    P, _, hidden = _teacher_forced(model, tokenizer, "hi", [])
    for ids, lp, emb in zip(s.token_ids, s.token_logprobs, s.embeddings, strict=False):
        if ids:
            continue
        assert lp.shape == (1,)
        torch.testing.assert_close(
            emb, hidden[model.config.num_hidden_layers // 2][0, P - 1], atol=1e-4, rtol=1e-4
        )
    assert any(not ids for ids in s.token_ids)


def test_cut_answer_rules(tokenizer):
    ids = tokenizer("Paris is big\nmore", add_special_tokens=False)["input_ids"]
    assert cut_answer(ids, tokenizer, ("\n",)) == (3, "Paris is big", True)
    assert cut_answer(ids, tokenizer, ()) == (len(ids), "Paris is big\nmore", False)
    # a token that carries answer text before the stop stays in: 'Paris' straddles "s i"
    assert cut_answer(ids, tokenizer, ("s i",)) == (1, "Pari", True)
    # the earliest of several stop strings wins
    assert cut_answer(ids, tokenizer, ("more", " is")) == (1, "Paris", True)
    empty = tokenizer("\nParis", add_special_tokens=False)["input_ids"]
    assert cut_answer(empty, tokenizer, ("\n",)) == (0, "", True)


def test_seed_reproducible_and_global_rng_untouched(model, tokenizer):
    state = torch.random.get_rng_state()
    a = sample_answers(model, tokenizer, PROMPTS[:1], n_samples=3, max_new_tokens=5, seed=7)
    assert torch.equal(torch.random.get_rng_state(), state)
    b = sample_answers(model, tokenizer, PROMPTS[:1], n_samples=3, max_new_tokens=5, seed=7)
    c = sample_answers(model, tokenizer, PROMPTS[:1], n_samples=3, max_new_tokens=5, seed=8)
    assert a[0].token_ids == b[0].token_ids
    assert a[0].token_ids != c[0].token_ids


def test_hook_removed_even_when_generation_fails(model, tokenizer, monkeypatch):
    block = model.model.layers[model.config.num_hidden_layers // 2 - 1]
    before = len(block._forward_hooks)
    sample_answers(model, tokenizer, PROMPTS[:1], n_samples=2, max_new_tokens=2)
    assert len(block._forward_hooks) == before

    def boom(*args, **kwargs):
        raise RuntimeError("generation failed")

    monkeypatch.setattr(model, "generate", boom)
    with pytest.raises(RuntimeError, match="generation failed"):
        sample_answers(model, tokenizer, PROMPTS[:1], n_samples=2, max_new_tokens=2)
    assert len(block._forward_hooks) == before


def test_embedding_layer_choice(model, tokenizer):
    assert resolve_embedding_layer(30, None) == 14  # hidden_states[15] of a 30-block model
    assert resolve_embedding_layer(32, None) == 15
    assert resolve_embedding_layer(1, None) == 0
    with pytest.raises(ValueError, match="embedding_layer=4"):
        resolve_embedding_layer(4, 4)
    (s,) = sample_answers(
        model,
        tokenizer,
        PROMPTS[:1],
        n_samples=2,
        max_new_tokens=3,
        embedding_layer=0,
        stop_strings=(),
    )
    P, _, hidden = _teacher_forced(model, tokenizer, s.prompt, s.token_ids[0])
    torch.testing.assert_close(
        s.embeddings[0], hidden[1][0, P - 1 + len(s.token_ids[0]) - 1], atol=1e-4, rtol=1e-4
    )


def test_block_output_as_tuple_or_tensor():
    t = torch.ones(2, 3, 4)
    assert _first_tensor(t) is t
    assert _first_tensor((t, None)) is t


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"n_samples": 0}, "n_samples"),
        ({"temperature": 0.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"logprob_source": "warped"}, "logprob_source"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"stop_strings": ("\n", "")}, "stop_strings"),
    ],
)
def test_bad_config_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingConfig(**kwargs)


def test_questions_must_align(model, tokenizer):
    with pytest.raises(ValueError, match="questions"):
        sample_answers(model, tokenizer, PROMPTS, questions=["only one"])
    sets = sample_answers(
        model, tokenizer, PROMPTS, n_samples=2, max_new_tokens=2, questions=["q1", "q2"]
    )
    assert [s.question for s in sets] == ["q1", "q2"]


@pytest.mark.parametrize(
    ("top_k", "top_p"), [(50, 0.9), (5, 0.5), (50, 1.0), (1, 0.9), (300, 0.99)]
)
def test_top_k_top_p_keeps_what_transformers_two_warpers_keep(top_k, top_p):
    """The reference: transformers' own top-k warper, then its top-p warper, on the same scores.
    Rows of distinct scores keep the same tokens; rows with ties (at the k-th score, or many
    equal scores) keep the same scores, whichever of the tied tokens each breaks the tie to."""
    from transformers import TopKLogitsWarper, TopPLogitsWarper

    scores = torch.randn(16, 1000, generator=torch.Generator().manual_seed(top_k)) * 3
    scores[0, :100] = scores[0].max() + 1  # 100 tokens tied above the rest
    scores[1] = scores[1].round()  # many ties everywhere
    reference = TopPLogitsWarper(top_p)(None, TopKLogitsWarper(top_k)(None, scores.clone()))
    fused = TopKTopP(top_k, top_p)(None, scores.clone())
    assert torch.equal(fused[2:], reference[2:])
    for ours, theirs in zip(fused[:2], reference[:2], strict=True):
        assert torch.equal(
            ours[ours.isfinite()].sort().values, theirs[theirs.isfinite()].sort().values
        )
    assert (fused.isfinite().sum(-1) <= max(top_k, 100)).all()
    if top_p < 1:  # the nucleus removes some of the top-k tokens in most rows
        assert (fused.isfinite().sum(-1)[2:] < top_k).any() or top_k == 1


def test_sampling_passes_top_k_and_top_p_as_one_processor(model, tokenizer, monkeypatch):
    """``generate`` sees neither of its own top-k / top-p warpers, only `TopKTopP`; with top-k
    off, transformers' top-p warper alone (it must sort the vocabulary anyway)."""
    seen = []
    real = model.generate

    def generate(**kwargs):
        seen.append(kwargs)
        return real(**kwargs)

    monkeypatch.setattr(model, "generate", generate)
    sample_answers(model, tokenizer, ["hi"], n_samples=2, max_new_tokens=2, seed=0)
    sample_answers(model, tokenizer, ["hi"], n_samples=2, max_new_tokens=2, seed=0, top_k=0)
    fused, plain = seen
    assert (fused["top_k"], fused["top_p"]) == (0, 1.0)
    (processor,) = fused["logits_processor"]
    assert isinstance(processor, TopKTopP) and (processor.top_k, processor.top_p) == (50, 0.9)
    assert (plain["top_k"], plain["top_p"]) == (0, 0.9) and "logits_processor" not in plain


def test_top_k_top_p_refuses_settings_it_cannot_run():
    with pytest.raises(ValueError, match="top_k >= 1"):
        TopKTopP(0, 0.9)
    with pytest.raises(ValueError, match="0 < top_p <= 1"):
        TopKTopP(50, 0.0)


def test_the_sampling_baselines_import_transformers_only_when_they_generate():
    """Importing EigenScore, Semantic Entropy or the sampler loads no transformers (the
    baselines' registry and the CLI stay light); `generate` imports it when it runs."""
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import sys; import actmap.baselines.sampling, actmap.baselines.eigenscore, "
        "actmap.baselines.semantic_entropy; sys.exit('transformers' in sys.modules)"
    )
    src = Path(__file__).resolve().parents[1] / "src"
    done = subprocess.run(
        [sys.executable, "-c", code], env={"PYTHONPATH": str(src), "PATH": ""}, capture_output=True
    )
    assert done.returncode == 0, done.stderr
