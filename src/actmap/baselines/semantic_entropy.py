"""Semantic Entropy (Kuhn et al. ICLR 2023; Farquhar et al., Nature 2024), BASELINES.md B2.

Sampled answers are clustered by bidirectional entailment; the entropy of the
distribution over clusters is the uncertainty. Pure functions below; the
judge (`actmap.baselines.entailment`) is the only model call.

- Clustering follows the Nature code's loop by default (``mode="nature_code"``):
  each answer without a cluster opens one, and every *later* answer equivalent
  to it joins it, even one already placed. ``mode="paper"`` compares each
  answer with the first member of every existing cluster in creation order.
  The two differ only when the judge is not transitive.
- Equivalence asks the judge both ways. ``strict``: both entailment. Otherwise:
  no contradiction either way and not (neutral, neutral).
- SE is the Rao-Blackwellised estimator over renormalised cluster masses,
  with length-normalised log-likelihoods, natural log; discrete SE (cluster
  frequencies only) is reported beside it. Duplicate answers are not merged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

from actmap.baselines.base import BaselineUnavailable
from actmap.baselines.entailment import CONTRADICTION, ENTAILMENT, NEUTRAL, EntailmentJudge
from actmap.baselines.sampling import check_same_sampling
from actmap.scoring.contract import ScoreResult, negate

CLUSTERING_MODES = ("nature_code", "paper")


def are_equivalent(
    judge: EntailmentJudge, text_1: str, text_2: str, question: str | None, strict: bool = True
) -> bool:
    """Bidirectional entailment, asked as two separate judge calls (1 -> 2, then 2 -> 1)."""
    forward = judge.check_implication(text_1, text_2, question)
    backward = judge.check_implication(text_2, text_1, question)
    if strict:
        return forward == ENTAILMENT and backward == ENTAILMENT
    return CONTRADICTION not in (forward, backward) and (forward, backward) != (NEUTRAL, NEUTRAL)


def semantic_ids(
    texts: Sequence[str],
    judge: EntailmentJudge,
    question: str | None,
    strict: bool = True,
    mode: str = "nature_code",
) -> list[int]:
    """Cluster id per answer, ids 0.. in order of first appearance."""
    if mode not in CLUSTERING_MODES:
        raise ValueError(f"mode must be one of {CLUSTERING_MODES}, got {mode!r}")
    if mode == "paper":
        members: list[int] = []  # first member of each cluster, in creation order
        ids = []
        for i, text in enumerate(texts):
            found = next(
                (
                    c
                    for c, first in enumerate(members)
                    if are_equivalent(judge, texts[first], text, question, strict)
                ),
                None,
            )
            if found is None:
                found = len(members)
                members.append(i)
            ids.append(found)
        return ids
    ids = [-1] * len(texts)
    next_id = 0
    for i, text in enumerate(texts):
        if ids[i] != -1:
            continue
        ids[i] = next_id
        for j in range(i + 1, len(texts)):
            if are_equivalent(judge, text, texts[j], question, strict):
                ids[j] = next_id  # may take over an answer an earlier cluster claimed
        next_id += 1
    return ids


def _logsumexp(values: np.ndarray) -> float:
    top = values.max()
    return float(top + np.log(np.exp(values - top).sum()))


def logsumexp_by_id(log_likelihoods: Sequence[float], semantic_ids: Sequence[int]) -> np.ndarray:
    """(C,) log P(cluster), clusters in sorted id order, masses renormalised to sum to one."""
    ll = np.asarray(log_likelihoods, dtype=np.float64)
    ids = np.asarray(semantic_ids)
    if ll.ndim != 1 or ll.shape != ids.shape:
        raise ValueError(
            f"log_likelihoods {ll.shape} and semantic_ids {ids.shape} must be matching 1-D arrays"
        )
    if ll.size == 0:
        raise ValueError("no answers given")
    total = _logsumexp(ll)
    return np.array([_logsumexp(ll[ids == c]) - total for c in np.unique(ids)])


def predictive_entropy_rao(log_likelihoods: Sequence[float], semantic_ids: Sequence[int]) -> float:
    """SE = -sum_c P(c) log P(c) over renormalised cluster masses (Nature eq. 5), natural log."""
    log_p = logsumexp_by_id(log_likelihoods, semantic_ids)
    return float(-(np.exp(log_p) * log_p).sum())


def cluster_assignment_entropy(semantic_ids: Sequence[int]) -> float:
    """Discrete SE = -sum_c (n_c / M) log(n_c / M), from cluster frequencies only."""
    ids = np.asarray(semantic_ids)
    if ids.size == 0:
        raise ValueError("no answers given")
    p = np.unique(ids, return_counts=True)[1] / ids.size
    return float(-(p * np.log(p)).sum())


class SemanticEntropy:
    """confidence = -SE over each row's sampled answers; fit is a no-op.

    ``rows`` are `actmap.baselines.sampling.SampleSet`s (texts, mean_logprobs,
    question, config), all sampled with the same settings. ``judge`` is any
    `EntailmentJudge` (wrap it in `CachedJudge`); without one, ``score``
    raises `BaselineUnavailable`.
    """

    name: ClassVar[str] = "semantic_entropy"
    supervised: ClassVar[bool] = False
    requires: ClassVar[tuple[str, ...]] = ("samples", "judge")
    probability: ClassVar[bool] = False

    @classmethod
    def from_inputs(cls, inputs) -> SemanticEntropy:
        return cls(judge=inputs.entailment_judge())

    def __init__(
        self,
        judge: EntailmentJudge | None = None,
        strict: bool = True,
        clustering: str = "nature_code",
    ) -> None:
        if clustering not in CLUSTERING_MODES:
            raise ValueError(f"clustering must be one of {CLUSTERING_MODES}, got {clustering!r}")
        self.judge = judge  # recorded by name with every result
        self.strict = strict  # Nature code default: both directions must be entailment
        self.clustering = clustering  # "nature_code" (default) or "paper"

    def fit(
        self, train: Sequence[Any], y_train: np.ndarray, val=None, y_val=None
    ) -> SemanticEntropy:
        return self

    def score(self, rows: Sequence[Any]) -> ScoreResult:
        if self.judge is None:
            raise BaselineUnavailable(
                "Semantic Entropy needs an entailment judge: pass judge=load_llm_judge() "
                "or judge=NLIJudge.from_pretrained(...) (actmap.baselines.entailment)"
            )
        check_same_sampling(rows)
        se, dse, all_ids = [], [], []
        for index, row in enumerate(rows):
            if len(row.texts) < 2:
                raise ValueError(
                    f"row {index} has {len(row.texts)} sampled answers; Semantic Entropy needs >= 2"
                )
            ids = semantic_ids(row.texts, self.judge, row.question, self.strict, self.clustering)
            se.append(predictive_entropy_rao(np.asarray(row.mean_logprobs, dtype=np.float64), ids))
            dse.append(cluster_assignment_entropy(ids))
            all_ids.append(ids)
        config = rows[0].config
        raw = np.asarray(se, dtype=np.float64)
        return ScoreResult(
            confidence=negate(raw),
            raw=raw,
            raw_name="semantic_entropy",
            details={
                "discrete_semantic_entropy": np.asarray(dse, dtype=np.float64),
                "semantic_ids": all_ids,
                "judge": self.judge.name,
                "strict": self.strict,
                "clustering": self.clustering,
                "likelihoods": f"length-normalised, {config.logprob_source}",
                "n_samples": config.n_samples,
                "temperature": config.temperature,
                "top_p": config.top_p,
                "top_k": config.top_k,
            },
        )
