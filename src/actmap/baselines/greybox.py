"""Grey-box baselines read from the one greedy pass: perplexity and mean token entropy.

Both read the raw-logit statistics the capture stores per answer token
(``Generation.logprobs``, ``Generation.entropies``; natural log, full
vocabulary, float32). The end-of-sequence step is not part of the answer and
is left out by default (BASELINES decision 2); ``include_eos=True`` appends it
when the answer stopped on EOS, which is what LM-Polygraph does.

An empty answer (the model emitted EOS first) has no answer step; it is scored
by its EOS step, the only step that produced it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

from actmap.capture.records import Generation
from actmap.scoring.contract import ScoreResult, negate
from actmap.signals.steps import answer_steps, log_perplexity, mean_token_entropy


class Perplexity:
    """Confidence = mean token log-likelihood = -log-perplexity."""

    name: ClassVar[str] = "perplexity"
    supervised: ClassVar[bool] = False
    requires: ClassVar[tuple[str, ...]] = ("generations",)
    probability: ClassVar[bool] = False

    def __init__(self, include_eos: bool = False) -> None:
        self.include_eos = include_eos  # True = count the EOS step too, as LM-Polygraph does

    def fit(self, train: Sequence[Any], y_train: np.ndarray, val=None, y_val=None) -> Perplexity:
        return self

    def score(self, rows: Sequence[Generation]) -> ScoreResult:
        raw = np.array(
            [log_perplexity(answer_steps(g, "logprobs", self.include_eos)) for g in rows]
        )
        return ScoreResult(
            confidence=negate(raw),
            raw=raw,
            raw_name="log_perplexity",
            details={"include_eos": self.include_eos, "log_base": "e"},
        )


class MeanTokenEntropy:
    """Confidence = -mean entropy of the next-token distributions of the answer."""

    name: ClassVar[str] = "mean_token_entropy"
    supervised: ClassVar[bool] = False
    requires: ClassVar[tuple[str, ...]] = ("generations",)
    probability: ClassVar[bool] = False

    def __init__(self, include_eos: bool = False) -> None:
        self.include_eos = include_eos  # True = count the EOS step too, as LM-Polygraph does

    def fit(
        self, train: Sequence[Any], y_train: np.ndarray, val=None, y_val=None
    ) -> MeanTokenEntropy:
        return self

    def score(self, rows: Sequence[Generation]) -> ScoreResult:
        raw = np.array(
            [mean_token_entropy(answer_steps(g, "entropies", self.include_eos)) for g in rows]
        )
        return ScoreResult(
            confidence=negate(raw),
            raw=raw,
            raw_name="mean_token_entropy",
            details={"include_eos": self.include_eos, "log_base": "e"},
        )
