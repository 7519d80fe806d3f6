"""RAUQ: layer range, head choice, the recurrence, and the attention indexing of the capture."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from actmap.capture.records import Generation
from actmap.signals.rauq import (
    RAUQ,
    default_alpha,
    rauq_layers,
    rauq_recurrence,
    rauq_uncertainty,
)


def make_gen(p, attention, entropies=None, extras=None) -> Generation:
    t = len(p)
    return Generation(
        prompt="q",
        answer="x" * t,
        token_ids=list(range(t)),
        logprobs=torch.log(torch.tensor(p, dtype=torch.float64)).float(),
        entropies=torch.tensor(
            entropies if entropies is not None else [0.0] * t, dtype=torch.float32
        ),
        trajectory=torch.zeros(1, t, 128),
        stopped=False,
        prompt_tokens=2,
        attention=None if attention is None else torch.as_tensor(attention, dtype=torch.float32),
        extras=extras or {},
    )


def test_layer_range_matches_lm_polygraph():
    assert rauq_layers(32) == list(range(10, 23))
    assert rauq_layers(28) == list(range(9, 20))
    assert rauq_layers(30) == list(range(10, 21))
    assert rauq_layers(6) == [2, 3, 4]
    assert rauq_layers(1) == [0]
    assert default_alpha(True, False) == 0.5 and default_alpha(False, False) == 0.2
    assert default_alpha(True, True) == 0.9 and default_alpha(False, True) == 0.8


def test_recurrence_three_tokens_by_hand():
    p = np.array([0.9, 0.5, 0.8])
    a = np.array([0.0, 0.6, 0.3])  # a[0] is never read
    c = rauq_recurrence(p, a, alpha=0.5)
    # c1 = .5*.5 + .5*.6*.9 = .52 ; c2 = .5*.8 + .5*.3*.52 = .478
    np.testing.assert_allclose(c, [0.9, 0.52, 0.478], rtol=1e-12)
    u, _per_layer, heads = rauq_uncertainty(p, a.reshape(3, 1, 1), alpha=0.5)
    expected = -(math.log(0.9) + math.log(0.52) + math.log(0.478)) / 3  # 0.49914...
    assert u == pytest.approx(expected, rel=1e-12)
    assert u == pytest.approx(0.4991447, abs=1e-6)
    assert heads.tolist() == [0]


# the same three tokens at lm-polygraph's base-model defaults (alpha .2; .8 for entropy), where
# alpha and 1 - alpha give different numbers (at .5 a swap would not show):
#   alpha .2: c1 = .2*.5 + .8*.6*.9 = .532   c2 = .2*.8 + .8*.3*.532 = .28768
#   alpha .8: c1 = .8*.5 + .2*.6*.9 = .508   c2 = .8*.8 + .2*.3*.508 = .67048
@pytest.mark.parametrize(
    "alpha, c1, c2, u",
    [(0.2, 0.532, 0.28768, 0.6607929443), (0.8, 0.508, 0.67048, 0.3941319174)],
)
def test_recurrence_by_hand_at_non_neutral_alpha(alpha, c1, c2, u):
    p = np.array([0.9, 0.5, 0.8])
    a = np.array([0.0, 0.6, 0.3])
    np.testing.assert_allclose(rauq_recurrence(p, a, alpha), [0.9, c1, c2], rtol=1e-12)
    expected = -(math.log(0.9) + math.log(c1) + math.log(c2)) / 3
    assert expected == pytest.approx(u, abs=1e-9)
    assert rauq_uncertainty(p, a.reshape(3, 1, 1), alpha)[0] == pytest.approx(expected, rel=1e-12)
    # through the scorer at a base model's defaults: alpha .2 on token probabilities, and
    # .8 for the entropy variant (entropies log V - p, so that log V - H_t is p again)
    att = np.zeros((3, 1, 1, 1))
    att[:, 0, 0, 0] = a
    entropic = alpha == 0.8
    gen = make_gen(p.tolist(), att, entropies=(math.log(100) - p).tolist())
    result = RAUQ(instruct=False, use_entropy=entropic, vocab_size=100).score([gen])
    assert result.details["alpha"] == alpha
    assert result.confidence[0] == pytest.approx(-expected, rel=1e-6)


def test_single_token_answer_is_minus_log_p():
    u, _per_layer, heads = rauq_uncertainty(np.array([0.25]), np.zeros((1, 3, 2)), alpha=0.5)
    assert u == pytest.approx(math.log(4))
    assert heads.tolist() == [-1, -1, -1]


def test_head_and_layer_selection_on_synthetic_attention():
    # L = 6 -> middle layers 2, 3, 4; H = 3; T = 4; K = 2
    p = [0.9, 0.6, 0.7, 0.5]
    att = np.zeros((4, 6, 3, 2))
    rng = np.random.default_rng(0)
    att[1:, :, :, 0] = rng.uniform(0.05, 0.3, size=(3, 6, 3))
    att[1:, 2, 1, 0] = [0.9, 0.8, 0.85]  # layer 2 -> head 1
    att[1:, 3, 2, 0] = [0.7, 0.75, 0.6]  # layer 3 -> head 2
    att[1:, 4, 0, 0] = [0.5, 0.4, 0.45]  # layer 4 -> head 0
    att[0, 2:5, 0, 0] = 50.0  # the prefill row must not vote for a head
    att[1:, 0, 0, 0] = 0.0  # layer 0 is outside the middle third: the lowest u there must not count
    att[1:, 2, 0, 1] = 0.99  # k = 2 is not RAUQ's column
    gen = make_gen(p, att)
    result = RAUQ(alpha=0.5).score([gen])

    def naive_u(a):
        c = [p[0]]
        for t in range(1, 4):
            c.append(0.5 * p[t] + 0.5 * a[t] * c[-1])
        return -np.mean(np.log(c))

    expected = max(naive_u(att[:, 2, 1, 0]), naive_u(att[:, 3, 2, 0]), naive_u(att[:, 4, 0, 0]))
    assert result.raw[0] == pytest.approx(expected, rel=1e-6)
    assert result.confidence[0] == pytest.approx(-expected, rel=1e-6)
    _, _, heads = rauq_uncertainty(np.array(p), att[..., 0][:, [2, 3, 4]], 0.5)
    assert heads.tolist() == [1, 2, 0]
    assert result.details["alpha"] == 0.5 and result.details["layer_aggregation"] == "max"


def test_entropy_variant_replaces_p_with_log_v_minus_h():
    att = np.zeros((3, 3, 1, 1))
    att[1:, :, 0, 0] = 0.5
    ent = [1.0, 2.0, 0.5]
    vocab = 100
    gen = make_gen([0.5, 0.5, 0.5], att, entropies=ent)
    raw = RAUQ(use_entropy=True, vocab_size=vocab).score([gen]).raw[0]
    x = math.log(vocab) - np.array(ent)
    c = rauq_recurrence(x, np.array([0.0, 0.5, 0.5]), alpha=0.9)
    assert raw == pytest.approx(-np.mean(np.log(c)))
    with pytest.raises(ValueError, match="vocab_size"):
        RAUQ(use_entropy=True).score([gen])


def test_missing_attention_is_a_clear_error():
    with pytest.raises(ValueError, match="attention"):
        RAUQ().score([make_gen([0.5, 0.5], None)])
    with pytest.raises(ValueError, match="attention"):
        RAUQ().score([make_gen([0.5, 0.5], np.zeros((3, 2, 2, 1)))])


def test_capture_indexing_matches_teacher_forced_attention():
    """Generation.attention[t, l, h, k-1] == A_l[h, P+t-1, P+t-k] of a teacher-forced pass.

    k = 1 is the diagonal: the query at token t-1 attending to its own key.
    """
    import actmap.capture as capture

    transformers = pytest.importorskip("transformers")
    from actmap.capture.records import CaptureConfig

    class ByteTokenizer:
        """Characters -> ids 3.. ; pad 0; no special tokens added; no chat template."""

        pad_token_id, eos_token_id, pad_token, eos_token = 0, 1, "<pad>", "<eos>"
        chat_template = None

        def __call__(
            self, texts, return_tensors=None, padding=False, truncation=False, max_length=None, **_
        ):
            rows = [[3 + (ord(ch) % 120) for ch in s] for s in texts]
            width = max(len(r) for r in rows)
            ids = [[0] * (width - len(r)) + r for r in rows]  # left padding
            mask = [[0] * (width - len(r)) + [1] * len(r) for r in rows]
            return {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask)}

        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(i) for i in ids)

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation="eager",
    )
    model = transformers.LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = 1
    tok = ByteTokenizer()
    prompts = ["hello world", "abc"]  # different lengths: the second row is left-padded
    gens = capture.generate_with_capture(
        model, tok, prompts, CaptureConfig(max_new_tokens=6, attention_keys=3, batch_size=2)
    )
    for prompt, g in zip(prompts, gens, strict=False):
        prompt_ids = tok([prompt])["input_ids"][0].tolist()
        n_p = len(prompt_ids)
        assert g.attention is not None and g.attention.shape == (g.n_tokens, 3, 4, 3)
        assert g.n_tokens >= 3
        ids = torch.tensor([prompt_ids + list(g.token_ids)])
        with torch.no_grad():
            out = model(ids, output_attentions=True)
        att = torch.stack([a[0] for a in out.attentions])  # (L, H, S, S)
        for t in range(g.n_tokens):
            for k in range(1, 4):
                got = g.attention[t, :, :, k - 1]  # (L, H)
                if t - k < 0:
                    assert torch.all(got == 0), (t, k)
                else:
                    want = att[:, :, n_p + t - 1, n_p + t - k]
                    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
        # RAUQ on the capture equals RAUQ on the teacher-forced diagonal
        diag = att.diagonal(dim1=2, dim2=3)[
            :, :, n_p - 1 : n_p - 1 + g.n_tokens
        ]  # (L, H, T) = A[P+t-1, P+t-1]
        prev = diag.permute(2, 0, 1).numpy()  # (T, L, H), row 0 unused
        u_tf, _, _ = rauq_uncertainty(
            np.exp(g.logprobs.double().numpy()), prev[:, [1, 2]], alpha=0.5
        )
        assert RAUQ().score([g]).raw[0] == pytest.approx(u_tf, rel=1e-4)


def test_empty_answer_is_scored_by_its_eos_step():
    gen = Generation(
        prompt="q",
        answer="",
        token_ids=[],
        logprobs=torch.zeros(0),
        entropies=torch.zeros(0),
        trajectory=torch.zeros(1, 0, 128),
        stopped=True,
        prompt_tokens=2,
        attention=torch.zeros(0, 3, 2, 1),
        extras={"eos_logprob": math.log(0.2), "eos_entropy": 1.0},
    )
    assert RAUQ().score([gen]).raw[0] == pytest.approx(-math.log(0.2), rel=1e-6)
