"""Perplexity and mean token entropy, plus the baseline registry."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from actmap.baselines.greybox import (
    MeanTokenEntropy,
    Perplexity,
    answer_steps,
    log_perplexity,
    mean_token_entropy,
)
from actmap.baselines.registry import (
    BASELINES,
    baseline_class,
    create_baseline,
    list_baselines,
    time_per_answer,
)
from actmap.capture.records import Generation


def make_gen(logprobs, entropies, stopped=False, extras=None) -> Generation:
    t = len(logprobs)
    return Generation(
        prompt="q",
        answer="a" * t,
        token_ids=list(range(t)),
        logprobs=torch.tensor(logprobs, dtype=torch.float32),
        entropies=torch.tensor(entropies, dtype=torch.float32),
        trajectory=torch.zeros(2, t, 128),
        stopped=stopped,
        prompt_tokens=3,
        extras=extras or {},
    )


def test_perplexity_and_entropy_hand_computed():
    g1 = make_gen([math.log(0.5), math.log(0.25)], [1.0, 2.0])
    g2 = make_gen([math.log(0.8)], [0.5])
    ppl = Perplexity().score([g1, g2])
    # log-perplexity of g1 = -(ln .5 + ln .25) / 2 = 1.5 ln 2
    np.testing.assert_allclose(ppl.raw, [1.5 * math.log(2), -math.log(0.8)], rtol=1e-6)
    np.testing.assert_allclose(ppl.confidence, -ppl.raw)
    assert ppl.raw_name == "log_perplexity" and ppl.details["include_eos"] is False
    mte = MeanTokenEntropy().score([g1, g2])
    np.testing.assert_allclose(mte.raw, [1.5, 0.5], rtol=1e-6)
    np.testing.assert_allclose(mte.confidence, [-1.5, -0.5], rtol=1e-6)
    assert log_perplexity(np.array([-1.0, -3.0])) == pytest.approx(2.0)
    assert mean_token_entropy(np.array([1.0, 4.0])) == pytest.approx(2.5)


def test_include_eos_appends_the_stopping_step():
    g = make_gen(
        [math.log(0.5)],
        [1.0],
        stopped=True,
        extras={"eos_logprob": math.log(0.25), "eos_entropy": 3.0},
    )
    assert Perplexity().score([g]).raw[0] == pytest.approx(math.log(2))
    assert Perplexity(include_eos=True).score([g]).raw[0] == pytest.approx(1.5 * math.log(2))
    assert MeanTokenEntropy(include_eos=True).score([g]).raw[0] == pytest.approx(2.0)
    # not stopped on EOS: nothing to append
    g_cut = make_gen([math.log(0.5)], [1.0], stopped=False)
    assert Perplexity(include_eos=True).score([g_cut]).raw[0] == pytest.approx(math.log(2))


def test_empty_answer_uses_eos_step_or_fails_clearly():
    empty = make_gen(
        [], [], stopped=True, extras={"eos_logprob": math.log(0.5), "eos_entropy": 0.7}
    )
    assert Perplexity().score([empty]).raw[0] == pytest.approx(math.log(2))
    assert MeanTokenEntropy().score([empty]).raw[0] == pytest.approx(0.7)
    with pytest.raises(ValueError, match="empty answer"):
        Perplexity().score([make_gen([], [], stopped=True)])
    with pytest.raises(ValueError, match="eos_logprob"):
        Perplexity(include_eos=True).score([make_gen([-1.0], [1.0], stopped=True)])


def test_mismatched_lengths_are_rejected():
    g = make_gen([-1.0, -2.0], [1.0, 1.0])
    bad = Generation(**{**g.__dict__, "logprobs": torch.tensor([-1.0])})
    with pytest.raises(ValueError, match="logprobs"):
        answer_steps(bad, "logprobs")


def test_registry_lists_every_method_of_the_taxonomy():
    expected = {
        "perplexity",
        "mean_token_entropy",
        "p_true",
        "semantic_entropy",
        "eigenscore",
        "rauq",
        "tad",
        "actvit",
        "answer_length",
        "permuted_label",
    }
    assert list_baselines() == sorted(BASELINES) and set(BASELINES) == expected
    assert create_baseline("perplexity", include_eos=True).include_eos is True
    with pytest.raises(ValueError, match="unknown baseline"):
        create_baseline("no_such_method")


@pytest.mark.parametrize("name", sorted(BASELINES))
def test_every_registered_class_honours_the_contract(name):
    cls = baseline_class(name)
    assert cls.name == name
    assert isinstance(cls.supervised, bool) and isinstance(cls.requires, tuple)
    assert callable(getattr(cls, "fit", None)) and callable(getattr(cls, "score", None))


def test_time_per_answer_is_per_row():
    rows = [make_gen([-1.0, -2.0], [1.0, 1.0])] * 4
    seconds = time_per_answer(Perplexity(), rows, repeats=2)
    assert 0 < seconds < 1
    with pytest.raises(ValueError):
        time_per_answer(Perplexity(), [])


@pytest.fixture(scope="module")
def tiny_model_and_tokenizer(embedded_tokenizer):
    transformers = pytest.importorskip("transformers")
    tok = embedded_tokenizer
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation="eager",
    )
    model = transformers.LlamaForCausalLM(config).eval()
    return model, tok


def test_teacher_forced_logprobs_and_entropies_match_capture(tiny_model_and_tokenizer):
    import actmap.capture as capture
    from actmap.capture.records import CaptureConfig

    model, tok = tiny_model_and_tokenizer
    prompts = ["The capital of France is", "Two plus two equals four, so three plus three is"]
    gens = capture.generate_with_capture(
        model, tok, prompts, CaptureConfig(max_new_tokens=6, batch_size=2)
    )
    ppl = Perplexity().score(gens)
    mte = MeanTokenEntropy().score(gens)
    for i, (prompt, g) in enumerate(zip(prompts, gens, strict=False)):
        prompt_ids = tok(prompt, add_special_tokens=False)["input_ids"]
        assert len(prompt_ids) == g.prompt_tokens
        ids = torch.tensor([prompt_ids + list(g.token_ids)])
        with torch.no_grad():
            logits = model(ids).logits[0].float()  # (S, V)
        logp = torch.log_softmax(
            logits[len(prompt_ids) - 1 : -1], dim=-1
        )  # (T, V): row t predicts token t
        chosen = logp[torch.arange(g.n_tokens), torch.tensor(g.token_ids)]
        entropy = -(logp.exp() * logp).sum(-1)
        np.testing.assert_allclose(g.logprobs.numpy(), chosen.numpy(), atol=1e-4)
        np.testing.assert_allclose(g.entropies.numpy(), entropy.numpy(), atol=1e-4)
        assert ppl.raw[i] == pytest.approx(-chosen.double().mean().item(), abs=1e-4)
        assert mte.raw[i] == pytest.approx(entropy.double().mean().item(), abs=1e-4)


@pytest.mark.parametrize("name", sorted(BASELINES))
def test_every_registered_class_declares_its_inputs(name):
    from actmap.scoring.contract import INPUTS, row_input

    cls = baseline_class(name)
    if name == "permuted_label":  # reads what its inner scorer reads
        assert cls.requires == ()
        return
    assert set(cls.requires) <= set(INPUTS) and row_input(cls.requires) in INPUTS
    assert isinstance(cls.probability, bool) or isinstance(cls.probability, property)
