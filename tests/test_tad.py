"""TAD v2: features, recurrence, stacking folds, and learning a planted signal."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.linear_model import Ridge
from sklearn.metrics import roc_auc_score

from actmap.capture.records import Generation
from actmap.signals.tad import (
    TAD,
    TadSequence,
    aggregate,
    design_matrix,
    oracle_q,
    stacked_q,
    tad_features,
    tad_recurrence,
    tad_sequence,
)


def make_gen(p, attention) -> Generation:
    t = len(p)
    return Generation(
        prompt="q",
        answer="x" * t,
        token_ids=list(range(t)),
        logprobs=torch.log(torch.tensor(p, dtype=torch.float64)).float(),
        entropies=torch.zeros(t),
        trajectory=torch.zeros(1, t, 128),
        stopped=False,
        prompt_tokens=2,
        attention=torch.as_tensor(attention, dtype=torch.float32),
    )


def naive_features(gen: Generation, q, k_prev):
    """The feature vector of BASELINES Part A.2, written as the plain loop over tokens and k."""
    p = np.exp(gen.logprobs.double().numpy())
    rows = []
    for t in range(1, gen.n_tokens):
        row = [p[t]]
        for k in range(1, k_prev + 1):
            n_heads = gen.attention.shape[1] * gen.attention.shape[2]
            if t - k < 0:
                row += [0.0] * (n_heads + 3)
            else:
                row += gen.attention[t, :, :, k - 1].reshape(-1).tolist()
                row += [p[t - k], q[t - k], p[t] * q[t - k]]
        rows.append(row)
    return np.array(rows)


def random_gen(rng, t, n_layers=2, n_heads=2, k=3, label=None):
    att = rng.uniform(0, 0.5, size=(t, n_layers, n_heads, k))
    for row in range(t):
        att[row, :, :, row:] = 0.0  # capture zero-fills keys before the first answer token
    if label is not None:
        att[1:, 0, 1, 0] = np.clip(rng.normal(0.55 if label else 0.25, 0.08, size=t - 1), 0, 1)
    return make_gen(rng.uniform(0.2, 1.0, size=t).tolist(), att)


def test_features_match_naive_loop_with_zero_fill():
    rng = np.random.default_rng(0)
    gen = random_gen(rng, t=4, n_layers=2, n_heads=2, k=3)
    gen.attention[1, :, :, 1:] = 7.0  # garbage beyond the existing keys must not leak into features
    seq = tad_sequence(gen, n_previous=3)
    q = np.array([0.3, 0.6, 0.2, 0.9])
    x = tad_features(seq.p, q, seq.attention)
    assert x.shape == (3, 1 + 3 * (4 + 3)) and x.dtype == np.float32
    gen_clean = random_gen(np.random.default_rng(0), t=4, n_layers=2, n_heads=2, k=3)
    np.testing.assert_allclose(x, naive_features(gen_clean, q, 3), rtol=1e-6, atol=1e-7)
    # token t = 1 (i = 2): blocks k = 2, 3 are all zeros; token t = 2: block 3 is zeros
    width = 4 + 3
    assert np.all(x[0, 1 + width :] == 0) and np.any(x[0, 1 : 1 + width] != 0)
    assert np.all(x[1, 1 + 2 * width :] == 0)


def test_fewer_captured_keys_than_k_is_an_error():
    gen = random_gen(np.random.default_rng(0), t=3, k=2)
    with pytest.raises(ValueError, match="n_previous"):
        tad_sequence(gen, n_previous=3)


def test_recurrence_matches_step_by_step_ridge_predict():
    rng = np.random.default_rng(1)
    gens = [random_gen(rng, t=int(rng.integers(2, 7))) for _ in range(12)]
    seqs = [tad_sequence(g, 3) for g in gens]
    y = rng.integers(0, 2, size=12).astype(float)
    x, target, _ = design_matrix(seqs, oracle_q(seqs, y), y)
    model = Ridge(alpha=0.1).fit(x, target)
    model.coef_ = model.coef_ * 5  # push predictions out of [0, 1] so the clip matters
    for gen, seq in zip(gens, seqs, strict=False):
        q = [seq.p[0]]
        for t in range(1, gen.n_tokens):
            row = naive_features(gen, q + [0.0] * (gen.n_tokens - t), 3)[t - 1]
            q.append(float(np.clip(model.predict(row[None])[0], 0, 1)))
        np.testing.assert_allclose(
            tad_recurrence(seq, model.coef_, float(model.intercept_)), q, atol=1e-5
        )


def test_aggregations():
    q = np.array([0.5, 1.0, 0.0])
    assert aggregate(q, "mean") == pytest.approx(0.5)
    assert aggregate(q, "sum_log") == pytest.approx(
        np.log(0.5 + 1e-5) + np.log(1 + 1e-5) + np.log(1e-5)
    )
    with pytest.raises(ValueError):
        aggregate(q, "median")


def test_stacking_folds_are_disjoint_by_sequence_and_out_of_fold():
    rng = np.random.default_rng(2)
    gens = [random_gen(rng, t=int(rng.integers(1, 6))) for _ in range(17)]
    seqs = [tad_sequence(g, 3) for g in gens]
    y = (np.arange(17) % 2).astype(float)
    qs, folds = stacked_q(seqs, y, alpha=0.01)
    held = np.concatenate([h for _, h in folds])
    assert sorted(held.tolist()) == list(range(17))  # each sequence held out exactly once
    for fit_idx, held_idx in folds:
        assert not set(fit_idx) & set(held_idx)
        # a Ridge fit on the fold's own sequences, with oracle features, reproduces the held-out q
        x, target, _ = design_matrix(
            [seqs[j] for j in fit_idx], oracle_q([seqs[j] for j in fit_idx], y[fit_idx]), y[fit_idx]
        )
        model = Ridge(alpha=0.01).fit(x, target)
        for j in held_idx:
            np.testing.assert_allclose(
                qs[j], tad_recurrence(seqs[j], model.coef_, float(model.intercept_)), atol=1e-6
            )
    with pytest.raises(ValueError, match="at least 5"):
        stacked_q(seqs[:4], y[:4], alpha=0.01)


def test_learns_a_signal_planted_in_the_attention():
    rng = np.random.default_rng(3)

    def split(n):
        labels = np.array([i % 2 for i in range(n)])
        gens = [random_gen(rng, t=int(rng.integers(3, 9)), label=lab) for lab in labels]
        return gens, labels

    train, y_train = split(160)
    val, y_val = split(60)
    test, y_test = split(120)
    tad = TAD(n_previous=3).fit(train, y_train, val, y_val)
    result = tad.score(test)
    assert roc_auc_score(y_test, result.confidence) > 0.9
    np.testing.assert_allclose(result.raw, -result.confidence)
    assert tad.aggregation_ in ("mean", "sum_log") and tad.alpha_ in (
        10.0,
        1.0,
        0.1,
        0.01,
        1e-3,
        1e-4,
    )
    assert len(tad.val_auroc_) == 12
    assert result.details["n_previous"] == 3 and result.details["selection"] == "validation AUROC"
    assert np.all((tad.token_confidences(test[0]) >= 0) & (tad.token_confidences(test[0]) <= 1))


def test_fixed_settings_need_no_validation_rows_and_bad_input_fails():
    rng = np.random.default_rng(4)
    gens = [random_gen(rng, t=4, label=i % 2) for i in range(10)]
    y = np.arange(10) % 2
    with pytest.raises(ValueError, match="validation"):
        TAD(n_previous=3).fit(gens, y)
    tad = TAD(n_previous=3, alpha=1.0, aggregation="mean").fit(gens, y)
    assert tad.score(gens).confidence.shape == (10,)
    other = random_gen(rng, t=4, n_layers=3, n_heads=2, k=3)
    with pytest.raises(ValueError, match="dimension"):
        tad.score([other])
    with pytest.raises(RuntimeError, match="before fit"):
        TAD().score(gens)


def test_tad_sequence_shapes():
    gen = random_gen(np.random.default_rng(5), t=5, n_layers=2, n_heads=3, k=4)
    seq = tad_sequence(gen, 2)
    assert isinstance(seq, TadSequence) and seq.attention.shape == (5, 2, 6)
    np.testing.assert_allclose(seq.attention[3, 1], gen.attention[3, :, :, 1].reshape(-1).numpy())


def test_empty_answer_gets_its_eos_probability():
    rng = np.random.default_rng(6)
    gens = [random_gen(rng, t=4, label=i % 2) for i in range(10)]
    tad = TAD(n_previous=3, alpha=1.0, aggregation="mean").fit(gens, np.arange(10) % 2)
    empty = Generation(
        prompt="q",
        answer="",
        token_ids=[],
        logprobs=torch.zeros(0),
        entropies=torch.zeros(0),
        trajectory=torch.zeros(1, 0, 128),
        stopped=True,
        prompt_tokens=2,
        attention=torch.zeros(0, 2, 2, 3),
        extras={"eos_logprob": float(np.log(0.3)), "eos_entropy": 1.0},
    )
    assert tad.score([empty]).confidence[0] == pytest.approx(0.3, rel=1e-6)


def test_ill_conditioned_solves_are_counted_once_not_printed_per_solve(caplog):
    import logging
    import warnings

    from scipy.linalg import LinAlgWarning

    from actmap.signals.tad import ALPHA_GRID, ill_conditioned_solves_logged

    rng = np.random.default_rng(0)
    labels = np.array([i % 2 for i in range(60)])
    gens = []
    for label in labels:
        gen = random_gen(rng, 20, n_layers=2, n_heads=2, k=3, label=label)
        gen.attention[:, :, 1] = gen.attention[:, :, 0]  # two heads alike: equal columns
        gens.append(gen)
    seqs = [tad_sequence(g, 3) for g in gens]
    x, y, _ = design_matrix(seqs, oracle_q(seqs, labels.astype(float)), labels.astype(float))
    with pytest.warns(LinAlgWarning):  # the raw solve at the grid's smallest alpha warns
        Ridge(alpha=ALPHA_GRID[-1]).fit(x, y)
    with warnings.catch_warnings(record=True) as seen, caplog.at_level(logging.INFO):
        warnings.simplefilter("always")
        TAD(n_previous=3).fit(gens, labels, gens[:20], labels[:20])
    assert not [w for w in seen if issubclass(w.category, LinAlgWarning)]
    counted = [r.message for r in caplog.records if "ill-conditioned Ridge solves" in r.message]
    assert len(counted) == 1 and counted[0].startswith("TAD fit: ")
    # any other warning raised inside passes through unchanged
    with pytest.warns(UserWarning, match="kept"), ill_conditioned_solves_logged("x"):
        warnings.warn("kept", UserWarning, stacklevel=1)
