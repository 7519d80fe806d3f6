"""RAUQ: recurrent attention-based uncertainty from one generation pass (BASELINES Part A.1).

With rows ``t = 0..T-1`` of the capture (row t produced answer token t),
``a[t]`` is the attention, at step t, from the query (token t-1) to its own
key, i.e. ``Generation.attention[t, l, h, 0]`` (the paper's a_i(1), i = t+1).

    layers  l in {floor(L/3), ..., ceil(2L/3)}              (middle third, inclusive)
    head    h_l = argmax_h mean_{t>=1} a^{l,h}[t]            (per sequence)
    c_0 = p_0,   c_t = alpha * p_t + (1 - alpha) * a^{l,h_l}[t] * c_{t-1}
    u_l = -mean_t log c_t,   u = max_l u_l,   confidence = -u

lm-polygraph reports ``1 + u``; the offset changes no ranking.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

from actmap.capture.records import Generation
from actmap.scoring.contract import ScoreResult, negate
from actmap.signals.steps import answer_steps, captured_attention


def rauq_layers(n_layers: int) -> list[int]:
    """0-based layer ids floor(L/3) .. ceil(2L/3), inclusive, within the model (L=32: 10..22)."""
    if n_layers < 1:
        raise ValueError(f"n_layers must be >= 1, got {n_layers}")
    last = min(-(-2 * n_layers // 3), n_layers - 1)
    return list(range(n_layers // 3, last + 1))


def default_alpha(instruct: bool, use_entropy: bool) -> float:
    """lm-polygraph's defaults: 0.5 / 0.9 (entropy) for instruct models, 0.2 / 0.8 for base."""
    if instruct:
        return 0.9 if use_entropy else 0.5
    return 0.8 if use_entropy else 0.2


def select_head(prev_attn: np.ndarray) -> int:
    """The head with the highest mean attention to the previous token over steps t >= 1.

    prev_attn: (T, H) with T >= 2; row 0 (the prefill) has no previous answer token.
    """
    return int(np.argmax(prev_attn[1:].mean(axis=0)))


def rauq_recurrence(p: np.ndarray, a: np.ndarray, alpha: float) -> np.ndarray:
    """c_0 = p_0, c_t = alpha p_t + (1 - alpha) a_t c_{t-1}; p, a: (T,) -> c: (T,)."""
    c = np.empty_like(p, dtype=np.float64)
    c[0] = p[0]
    for t in range(1, len(p)):
        c[t] = alpha * p[t] + (1.0 - alpha) * a[t] * c[t - 1]
    return c


def rauq_uncertainty(
    p: np.ndarray, prev_attn: np.ndarray, alpha: float, eps: float = 1e-10
) -> tuple[float, np.ndarray, np.ndarray]:
    """RAUQ's u for one answer.

    p: (T,) token confidences (probabilities, or log V - H_t for the entropy variant).
    prev_attn: (T, L', H) attention to the previous token in the selected layers.
    Returns (u, u_l per layer (L',), chosen head per layer (L',)). With T = 1 no head
    can be chosen and u = -log p_0 for every layer (heads are -1).
    """
    p = np.asarray(p, dtype=np.float64)
    prev_attn = np.asarray(prev_attn, dtype=np.float64)
    if p.ndim != 1 or p.size == 0:
        raise ValueError(f"p must be a non-empty (T,) array, got shape {p.shape}")
    if prev_attn.ndim != 3 or prev_attn.shape[0] != p.size:
        raise ValueError(f"prev_attn must be (T={p.size}, L', H), got shape {prev_attn.shape}")
    n_sel = prev_attn.shape[1]
    if p.size == 1:
        u = -math.log(max(p[0], eps))
        return u, np.full(n_sel, u), np.full(n_sel, -1)
    heads = np.array([select_head(prev_attn[:, j]) for j in range(n_sel)])  # (L',)
    per_layer = np.array(
        [
            -np.mean(np.log(np.maximum(rauq_recurrence(p, prev_attn[:, j, h], alpha), eps)))
            for j, h in enumerate(heads)
        ]
    )  # (L',)
    return float(per_layer.max()), per_layer, heads


class RAUQ:
    """Unsupervised RAUQ over captured attention; confidence = -u."""

    name: ClassVar[str] = "rauq"
    supervised: ClassVar[bool] = False
    requires: ClassVar[tuple[str, ...]] = ("generations", "attention")
    probability: ClassVar[bool] = False

    @classmethod
    def from_inputs(cls, inputs) -> RAUQ:
        return cls(instruct=inputs.options.instruct)

    def __init__(
        self,
        instruct: bool = True,
        alpha: float | None = None,
        use_entropy: bool = False,
        vocab_size: int | None = None,
        eps: float = 1e-10,
    ) -> None:
        self.instruct = instruct  # picks alpha; every generator in the paper is instruct
        self.alpha = alpha  # None = lm-polygraph default for (instruct, use_entropy)
        self.use_entropy = use_entropy  # replace p_t by log V - H_t
        self.vocab_size = vocab_size  # V of the entropy variant, else extras["vocab_size"]
        self.eps = eps  # floor inside log c_t

    def fit(self, train: Sequence[Any], y_train: np.ndarray, val=None, y_val=None) -> RAUQ:
        return self

    def _alpha(self) -> float:
        if self.alpha is not None:
            return self.alpha
        return default_alpha(self.instruct, self.use_entropy)

    def _confidences(self, gen: Generation) -> np.ndarray:
        if not self.use_entropy:
            return np.exp(answer_steps(gen, "logprobs"))
        vocab = self.vocab_size or gen.extras.get("vocab_size")
        if not vocab:
            raise ValueError("the entropy variant needs vocab_size (argument or Generation.extras)")
        return math.log(vocab) - answer_steps(gen, "entropies")

    def score_one(self, gen: Generation) -> tuple[float, np.ndarray, np.ndarray]:
        p = self._confidences(gen)  # (T,) or (1,) for an empty answer scored by its EOS step
        if gen.n_tokens == 0:
            return rauq_uncertainty(p, np.zeros((1, 1, 1)), self._alpha(), self.eps)
        att = captured_attention(gen, "RAUQ", "1")  # (T, L, H, K)
        layers = rauq_layers(att.shape[1])
        prev_attn = att[..., 0][:, layers]  # (T, L', H); k = 1 is the query's own key
        return rauq_uncertainty(p, prev_attn, self._alpha(), self.eps)

    def score(self, rows: Sequence[Generation]) -> ScoreResult:
        results = [self.score_one(g) for g in rows]
        raw = np.array([r[0] for r in results], dtype=np.float64)
        return ScoreResult(
            confidence=negate(raw),
            raw=raw,
            raw_name="rauq_uncertainty",
            details={
                "alpha": self._alpha(),
                "instruct": self.instruct,
                "use_entropy": self.use_entropy,
                "layer_aggregation": "max",
                "token_aggregation": "mean_log",
                "eps": self.eps,
                "include_eos": False,
            },
        )
