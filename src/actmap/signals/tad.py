"""TAD v2: trainable attention-based dependency, two-stage Ridge with stacking (BASELINES Part A.2).

Rows ``t = 0..T-1`` of the capture; ``a[t, k]`` is the attention over all L*H
heads, at step t, to answer token t-k (``Generation.attention[t, :, :, k-1]``).
Token t >= 1 gets the feature vector (dimension 1 + K*(L*H + 3))

    [p_t, block_1, ..., block_K],   block_k = [a[t, k], p_{t-k}, q_{t-k}, p_t * q_{t-k}]

with zero blocks where t - k < 0. A Ridge f maps it to the token's confidence;
inference is recurrent: q_0 = p_0, q_t = clip(f(x_t), 0, 1). The sequence
confidence is mean_t q_t or sum_t log(q_t + 1e-5).

Training (target = the generation's binary label for every token):
stage 1 uses the oracle q = label; stage 2 rebuilds the features with
out-of-fold recurrent q from 5 stage-1 models (KFold over sequences, shuffle,
random_state=1) and fits the final Ridge. The Ridge alpha of each stage and the
aggregation are chosen by AUROC on the shared balanced validation rows.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
from scipy.linalg import LinAlgWarning
from sklearn.linear_model import Ridge
from sklearn.model_selection import KFold

from actmap.capture.records import Generation
from actmap.scoring.contract import ScoreResult, negate
from actmap.scoring.metrics import auroc
from actmap.signals.steps import answer_steps, captured_attention

log = logging.getLogger(__name__)

# upstream's Ridge grid, in its order (ties keep the first)
ALPHA_GRID = (10.0, 1.0, 0.1, 0.01, 1e-3, 1e-4)
AGGREGATIONS = ("mean", "sum_log")
LOG_FLOOR = 1e-5  # upstream's offset inside sum log(q + 1e-5)


@dataclass(frozen=True)
class TadSequence:
    """What TAD reads from one answer."""

    p: np.ndarray  # (T,) float64 token probabilities
    attention: np.ndarray  # (T, K, L*H) float32, zero where t - k < 0


def tad_sequence(gen: Generation, n_previous: int) -> TadSequence:
    """Token probabilities and the first ``n_previous`` attention keys of one Generation."""
    p = np.exp(answer_steps(gen, "logprobs"))  # (T,), or (1,) for an empty answer's EOS step
    att = captured_attention(gen, "TAD", "K")  # (T, L, H, Kc)
    t, n_layers, n_heads, kc = att.shape
    if kc < n_previous:
        raise ValueError(
            f"Generation.attention keeps K={kc} keys but TAD needs n_previous={n_previous}"
        )
    blocks = att[..., :n_previous].transpose(0, 3, 1, 2).reshape(t, n_previous, n_layers * n_heads)
    if t == 0:  # empty answer: the EOS step alone, no attention feature is ever read
        blocks = np.zeros((1, n_previous, n_layers * n_heads), dtype=np.float32)
    return TadSequence(p=p, attention=np.ascontiguousarray(blocks, dtype=np.float32))


def tad_features(p: np.ndarray, q: np.ndarray, attention: np.ndarray) -> np.ndarray:
    """Feature rows for tokens t = 1..T-1.

    p, q: (T,); attention: (T, K, LH) -> (T-1, 1 + K*(LH+3)) float32.
    """
    n_tok, k_prev, lh = attention.shape
    t = np.arange(1, n_tok)[:, None]  # (T-1, 1)
    src = t - np.arange(1, k_prev + 1)[None, :]  # (T-1, K) index t - k
    valid = (src >= 0).astype(np.float64)  # (T-1, K)
    src = np.maximum(src, 0)
    p_prev = p[src] * valid  # (T-1, K)
    q_prev = q[src] * valid
    p_cur = p[1:, None]  # (T-1, 1)
    att = attention[1:] * valid[..., None]  # (T-1, K, LH)
    scalars = np.stack([p_prev, q_prev, p_cur * q_prev], axis=-1)  # (T-1, K, 3)
    blocks = np.concatenate([att, scalars], axis=-1).reshape(n_tok - 1, k_prev * (lh + 3))
    return np.concatenate([p_cur, blocks], axis=1).astype(np.float32)


def tad_recurrence(seq: TadSequence, coef: np.ndarray, intercept: float) -> np.ndarray:
    """q_0 = p_0, q_t = clip(coef . x_t + intercept, 0, 1) with x_t built from the q so far -> (T,).

    The part of coef . x_t that does not involve q is computed for all tokens at
    once; only the q terms run token by token.
    """
    p, att = seq.p, seq.attention
    n_tok, k_prev, lh = att.shape
    w_p, w_blocks = coef[0], coef[1:].reshape(k_prev, lh + 3)  # (K, LH + 3)
    w_att = w_blocks[:, :lh]  # (K, LH) attention weights
    w_pp, w_q, w_pq = w_blocks[:, lh], w_blocks[:, lh + 1], w_blocks[:, lh + 2]  # (K,) each
    static = intercept + w_p * p + np.einsum("tkd,kd->tk", att, w_att).sum(axis=1)  # (T,)
    q = np.empty(n_tok, dtype=np.float64)
    q[0] = p[0]
    for t in range(1, n_tok):
        ks = np.arange(1, min(k_prev, t) + 1)  # existing previous tokens
        value = (
            static[t]
            + np.dot(w_pp[ks - 1], p[t - ks])
            + np.dot(w_q[ks - 1] + w_pq[ks - 1] * p[t], q[t - ks])
        )
        q[t] = min(max(value, 0.0), 1.0)
    return q


def aggregate(q: np.ndarray, how: str) -> float:
    """Sequence confidence from token confidences: mean q, or sum log(q + 1e-5)."""
    if how == "mean":
        return float(np.mean(q))
    if how == "sum_log":
        return float(np.sum(np.log(q + LOG_FLOOR)))
    raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {how!r}")


def design_matrix(seqs: Sequence[TadSequence], qs: Sequence[np.ndarray], targets: np.ndarray):
    """Stack every sequence's feature rows.

    Returns X (n_tok, F) float32, y (n_tok,) float32, owner (n_tok,) sequence ids.
    """
    xs = [tad_features(s.p, q, s.attention) for s, q in zip(seqs, qs, strict=False)]
    owner = np.concatenate([np.full(len(x), j) for j, x in enumerate(xs)])
    return np.concatenate(xs), np.repeat(targets, [len(x) for x in xs]).astype(np.float32), owner


def oracle_q(seqs: Sequence[TadSequence], targets: np.ndarray) -> list[np.ndarray]:
    """Stage 1: every previous-token confidence is the sequence's own label."""
    return [np.full(len(s.p), float(y)) for s, y in zip(seqs, targets, strict=False)]


@contextmanager
def ill_conditioned_solves_logged(what: str) -> Iterator[None]:
    """Inside: scipy's `LinAlgWarning` (an ill-conditioned Ridge solve, usual at the grid's
    smallest alphas on few rows) is counted instead of printed once per solve, and logged
    once at the end; every other warning passes through unchanged."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", LinAlgWarning)
        yield
    ill = [w for w in caught if issubclass(w.category, LinAlgWarning)]
    for w in caught:
        if not issubclass(w.category, LinAlgWarning):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
    if ill:
        log.info("%s: %d ill-conditioned Ridge solves (scipy LinAlgWarning)", what, len(ill))


def stacked_q(
    seqs: Sequence[TadSequence], targets: np.ndarray, alpha: float, n_folds: int = 5, seed: int = 1
) -> tuple[list[np.ndarray], list[tuple[np.ndarray, np.ndarray]]]:
    """Stage 2's out-of-fold recurrent q: a stage-1 Ridge per fold, run on unseen sequences."""
    if len(seqs) < n_folds:
        raise ValueError(
            f"TAD stacking needs at least {n_folds} training sequences, got {len(seqs)}"
        )
    x1, y1, owner = design_matrix(seqs, oracle_q(seqs, targets), targets)
    qs: list[np.ndarray] = [np.empty(0)] * len(seqs)
    folds = list(
        KFold(n_splits=n_folds, shuffle=True, random_state=seed).split(np.arange(len(seqs)))
    )
    for fit_idx, held_idx in folds:
        rows = np.isin(owner, fit_idx)
        model = Ridge(alpha=alpha).fit(x1[rows], y1[rows])
        for j in held_idx:
            qs[j] = tad_recurrence(seqs[j], model.coef_, float(model.intercept_))
    return qs, folds


def select_on_validation(x, y, val: Sequence[TadSequence], y_val: np.ndarray, alphas, aggregations):
    """One Ridge per alpha, validation rows scored recurrently.

    Returns ((AUROC, alpha, aggregation) of the best, {setting: validation AUROC}).
    """
    table: dict[str, float] = {}
    best = (-np.inf, alphas[0], aggregations[0])
    for alpha in alphas:
        model = Ridge(alpha=alpha).fit(x, y)
        qs = [tad_recurrence(s, model.coef_, float(model.intercept_)) for s in val]
        for how in aggregations:
            auc = auroc([aggregate(q, how) for q in qs], y_val)
            table[f"alpha={alpha:g},{how}"] = auc
            if auc > best[0]:
                best = (auc, alpha, how)
    return best, table


class TAD:
    """Supervised TAD; fit on labelled training generations, select on validation ones."""

    name: ClassVar[str] = "tad"
    supervised: ClassVar[bool] = True
    requires: ClassVar[tuple[str, ...]] = ("generations", "attention")

    @property
    def probability(self) -> bool:
        """Only the mean of per-token confidences (each in [0, 1]) estimates p(correct)."""
        return getattr(self, "aggregation_", self.aggregation) == "mean"

    @classmethod
    def from_inputs(cls, inputs) -> TAD:
        """K = ``options.tad_previous``, else min(10, attention keys the store keeps)."""
        keys = inputs.attention_keys("tad")
        k = inputs.options.tad_previous or min(10, keys)
        if k < 10:
            log.warning(
                "TAD reads K=%d previous tokens (the store keeps %d; upstream uses 10)", k, keys
            )
        return cls(n_previous=k)

    def __init__(
        self,
        n_previous: int = 10,
        alpha: float | None = None,
        aggregation: str | None = None,
        n_folds: int = 5,
        seed: int = 1,
        stage1_alpha: float | None = None,
    ) -> None:
        self.n_previous = n_previous  # K: previous answer tokens whose attention is read
        self.alpha = alpha  # None = pick from ALPHA_GRID on validation rows (both stages)
        self.stage1_alpha = stage1_alpha  # stage 1's Ridge alpha when fixed; None = as ``alpha``
        self.aggregation = aggregation  # None = pick "mean" or "sum_log" on validation rows
        self.n_folds = n_folds  # stacking folds over training sequences
        self.seed = seed  # KFold random_state, upstream's 1

    def _check_val(self, val, y_val) -> None:
        if (self.alpha is None or self.aggregation is None) and (val is None or y_val is None):
            raise ValueError(
                "TAD selects alpha/aggregation on validation rows: pass val and y_val, or fix both"
            )
        if val is not None and y_val is not None and len(np.unique(y_val)) < 2:
            raise ValueError("y_val must hold both classes to select by AUROC")

    def fit(self, train: Sequence[Generation], y_train: np.ndarray, val=None, y_val=None) -> TAD:
        with ill_conditioned_solves_logged("TAD fit"):
            return self._fit(train, y_train, val, y_val)

    def _fit(self, train: Sequence[Generation], y_train: np.ndarray, val, y_val) -> TAD:
        y_train = np.clip(np.asarray(y_train, dtype=np.float64), 0.0, 1.0)
        if len(train) != len(y_train):
            raise ValueError(f"train has {len(train)} rows but y_train has {len(y_train)}")
        self._check_val(val, y_val)
        seqs = [tad_sequence(g, self.n_previous) for g in train]
        val_seqs = [tad_sequence(g, self.n_previous) for g in val] if val is not None else []
        alphas = ALPHA_GRID if self.alpha is None else (self.alpha,)
        aggs = AGGREGATIONS if self.aggregation is None else (self.aggregation,)
        x1, y1, _ = design_matrix(seqs, oracle_q(seqs, y_train), y_train)
        alpha1 = self.stage1_alpha if self.stage1_alpha is not None else alphas[0]
        if len(alphas) > 1 and self.stage1_alpha is None:
            (auc1, alpha1, _), self.stage1_val_auroc_ = select_on_validation(
                x1, y1, val_seqs, y_val, alphas, aggs
            )
            log.info("TAD stage 1: alpha=%g (validation AUROC %.4f)", alpha1, auc1)
        qs, self.folds_ = stacked_q(seqs, y_train, alpha1, self.n_folds, self.seed)
        x2, y2, _ = design_matrix(seqs, qs, y_train)
        alpha2, agg = alphas[0], aggs[0]
        if len(alphas) > 1 or len(aggs) > 1:
            (auc2, alpha2, agg), self.val_auroc_ = select_on_validation(
                x2, y2, val_seqs, y_val, alphas, aggs
            )
            log.info(
                "TAD stage 2: alpha=%g, aggregation=%s (validation AUROC %.4f)", alpha2, agg, auc2
            )
        self.model_ = Ridge(alpha=alpha2).fit(x2, y2)
        self.stage1_alpha_, self.alpha_, self.aggregation_ = alpha1, alpha2, agg
        self.n_features_in_ = x2.shape[1]
        return self

    def fixed_choices(self) -> TAD:
        """An unfitted TAD with the alphas and aggregation this fitted one chose on validation.

        The permuted-label control refits it on shuffled labels, so only the labels change.
        """
        if not hasattr(self, "model_"):
            raise RuntimeError("TAD.fixed_choices called before fit")
        return TAD(
            self.n_previous,
            alpha=self.alpha_,
            aggregation=self.aggregation_,
            n_folds=self.n_folds,
            seed=self.seed,
            stage1_alpha=self.stage1_alpha_,
        )

    def token_confidences(self, gen: Generation) -> np.ndarray:
        """q_t for every answer token of one generation -> (T,)."""
        seq = tad_sequence(gen, self.n_previous)
        n_features = 1 + self.n_previous * (seq.attention.shape[2] + 3)
        if n_features != self.n_features_in_:
            raise ValueError(
                f"features have dimension {n_features}, "
                f"the fitted TAD expects {self.n_features_in_}"
            )
        return tad_recurrence(seq, self.model_.coef_, float(self.model_.intercept_))

    def score(self, rows: Sequence[Generation]) -> ScoreResult:
        if not hasattr(self, "model_"):
            raise RuntimeError("TAD.score called before fit")
        conf = np.array([aggregate(self.token_confidences(g), self.aggregation_) for g in rows])
        return ScoreResult(
            confidence=conf,
            raw=negate(conf),
            raw_name="tad_uncertainty",
            details={
                "n_previous": self.n_previous,
                "alpha_stage1": self.stage1_alpha_,
                "alpha": self.alpha_,
                "aggregation": self.aggregation_,
                "n_folds": self.n_folds,
                "seed": self.seed,
                "selection": "validation AUROC",
                "include_eos": False,
            },
        )
