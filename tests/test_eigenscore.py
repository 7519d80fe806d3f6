"""EigenScore against an SVD computation written differently, and its closed forms."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from actmap.baselines.eigenscore import EigenScore, eigenscore
from actmap.baselines.sampling import SampleSet, SamplingConfig


def reference_svd(z: np.ndarray, alpha: float) -> float:
    """Centre with the explicit J_d matrix; eigenvalues of Zc Zc^T are squared singular values."""
    k, d = z.shape
    centred = z @ (np.eye(d) - np.ones((d, d)) / d)
    s = np.linalg.svd(centred, compute_uv=False)
    eig = np.zeros(k)
    eig[: s.size] = s**2  # K > d leaves K - d zero eigenvalues
    return float(np.mean(np.log(eig + alpha)))


@pytest.mark.parametrize("k, d", [(10, 64), (10, 5), (2, 3)])
def test_matches_svd_reference(k, d):
    rng = np.random.default_rng(k * 100 + d)
    z = rng.normal(size=(k, d)) * rng.uniform(0.1, 3.0, size=(k, 1)) + rng.normal(size=(k, 1))
    assert eigenscore(z) == pytest.approx(reference_svd(z, 1e-3), rel=1e-10)
    assert eigenscore(z, alpha=0.5) == pytest.approx(reference_svd(z, 0.5), rel=1e-10)


def test_d_minus_1_scale_is_the_official_torch_cov():
    rng = np.random.default_rng(0)
    z = rng.normal(size=(6, 40))
    # np.cov, like torch.cov, takes rows as variables: (K, K) with 1 / (d - 1)
    expected = np.mean(np.log(np.linalg.eigvals(np.cov(z) + 1e-3 * np.eye(6)).real))
    assert eigenscore(z, cov_scale="d_minus_1") == pytest.approx(expected, rel=1e-10)
    assert eigenscore(z, cov_scale="d_minus_1") != pytest.approx(eigenscore(z))


def test_identical_answers_closed_form():
    # Sigma = ||c||^2 1 1^T: one eigenvalue K ||c||^2, K - 1 zeros, so
    # E = ((K - 1) ln a + ln(K ||c||^2 + a)) / K, i.e. ((K - 1) / K) ln a plus a 1/K term
    k, alpha = 10, 1e-3
    v = np.random.default_rng(1).normal(size=32) * 5
    c2 = float(((v - v.mean()) ** 2).sum())
    score = eigenscore(np.tile(v, (k, 1)), alpha)
    assert score == pytest.approx(
        ((k - 1) * math.log(alpha) + math.log(k * c2 + alpha)) / k, rel=1e-9
    )
    assert score - (k - 1) / k * math.log(alpha) == pytest.approx(
        math.log(k * c2 + alpha) / k, rel=1e-6
    )
    # embeddings constant over their own features centre to zero: every eigenvalue is alpha
    assert eigenscore(np.ones((k, 32)) * np.arange(k)[:, None], alpha) == pytest.approx(
        math.log(alpha)
    )


def test_per_embedding_centring_and_ordering():
    rng = np.random.default_rng(2)
    z = rng.normal(size=(5, 16))
    shifted = z + rng.normal(size=(5, 1)) * 10  # a per-answer offset is removed by J_d
    assert eigenscore(shifted) == pytest.approx(eigenscore(z), rel=1e-10)
    base = rng.normal(size=16)
    close = base + 0.01 * rng.normal(size=(5, 16))
    assert eigenscore(close) < eigenscore(z)  # agreeing answers score lower (more confident)


def test_torch_input_any_dtype():
    z = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    assert eigenscore(z) == pytest.approx(reference_svd(z.double().numpy(), 1e-3), rel=1e-10)
    bf16 = z.to(torch.bfloat16)
    assert eigenscore(bf16) == pytest.approx(reference_svd(bf16.double().numpy(), 1e-3), rel=1e-10)


@pytest.mark.parametrize(
    "z, kwargs, match",
    [
        (np.ones((1, 4)), {}, "K >= 2"),
        (np.ones(4), {}, "shape"),
        (np.array([[0.0, np.nan], [1.0, 2.0]]), {}, "NaN"),
        (np.ones((2, 4)), {"cov_scale": "biased"}, "cov_scale"),
        (np.ones((2, 4)), {"alpha": 0.0}, "alpha"),
    ],
)
def test_bad_input_named(z, kwargs, match):
    with pytest.raises(ValueError, match=match):
        eigenscore(z, **kwargs)


LAYER_1 = SamplingConfig(embedding_layer=1)


def _row(embeddings, config=LAYER_1):
    n = embeddings.shape[0]
    return SampleSet(
        prompt="p",
        question=None,
        texts=("a",) * n,
        token_ids=((),) * n,
        token_logprobs=(torch.zeros(1),) * n,
        mean_logprobs=torch.zeros(n, dtype=torch.float64),
        embeddings=embeddings,
        stopped=(True,) * n,
        config=config,
    )


def test_scorer_confidence_and_details():
    g = torch.Generator().manual_seed(3)
    rows = [
        _row(torch.randn(10, 16, generator=g)),
        _row(torch.randn(1, 16, generator=g).repeat(10, 1)),
    ]
    result = EigenScore().fit([], np.array([])).score(rows)
    expected = [reference_svd(r.embeddings.double().numpy(), 1e-3) for r in rows]
    np.testing.assert_allclose(result.raw, expected, rtol=1e-10)
    np.testing.assert_array_equal(result.confidence, -result.raw)
    assert result.confidence[1] > result.confidence[0]  # identical answers: more confident
    assert result.raw_name == "eigenscore"
    d = result.details
    assert (d["alpha"], d["cov_scale"], d["embedding_layer"], d["n_samples"]) == (
        1e-3,
        "unscaled",
        1,
        10,
    )
    with pytest.raises(ValueError, match="row 0"):
        EigenScore().score([_row(torch.zeros(1, 16))])
    with pytest.raises(ValueError, match="cov_scale"):
        EigenScore(cov_scale="biased")
