"""Semantic Entropy: clustering loops, equivalence rules and entropies against hand computation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from actmap.baselines.base import BaselineUnavailable
from actmap.baselines.entailment import CONTRADICTION, ENTAILMENT, NEUTRAL
from actmap.baselines.sampling import SampleSet, SamplingConfig
from actmap.baselines.semantic_entropy import (
    SemanticEntropy,
    are_equivalent,
    cluster_assignment_entropy,
    logsumexp_by_id,
    predictive_entropy_rao,
    semantic_ids,
)


class TableJudge:
    """Test double: answers from a table of (premise, hypothesis) -> label, default contradiction.

    Records every call so tests can check both directions were asked.
    """

    name = "stub:table"

    def __init__(self, table=None, same_first_word=False):
        self.table = table or {}
        self.same_first_word = same_first_word
        self.calls = []

    def check_implication(self, premise_text, hypothesis_text, question=None):
        self.calls.append((premise_text, hypothesis_text, question))
        if (premise_text, hypothesis_text) in self.table:
            return self.table[(premise_text, hypothesis_text)]
        if self.same_first_word and premise_text.split()[0] == hypothesis_text.split()[0]:
            return ENTAILMENT
        return CONTRADICTION


def _symmetric(pairs, label=ENTAILMENT):
    table = {}
    for a, b in pairs:
        table[(a, b)] = table[(b, a)] = label
    return table


# -- equivalence ---------------------------------------------------------------------------------
LABELS = [CONTRADICTION, NEUTRAL, ENTAILMENT]


@pytest.mark.parametrize("forward", LABELS)
@pytest.mark.parametrize("backward", LABELS)
def test_equivalence_rules(forward, backward):
    judge = TableJudge({("a", "b"): forward, ("b", "a"): backward})
    strict = are_equivalent(judge, "a", "b", "q", strict=True)
    loose = are_equivalent(judge, "a", "b", "q", strict=False)
    assert strict == (forward == backward == ENTAILMENT)
    # non-strict: (E,E), (E,N), (N,E) merge; any contradiction or (N,N) keeps them apart
    assert loose == ((forward, backward) in {(2, 2), (2, 1), (1, 2)})
    assert judge.calls == [("a", "b", "q"), ("b", "a", "q"), ("a", "b", "q"), ("b", "a", "q")]


# -- clustering ----------------------------------------------------------------------------------
def test_transitive_judge_gives_same_clusters_in_both_modes():
    texts = ["paris a", "london a", "paris b", "rome", "london b", "paris c"]
    for mode in ("nature_code", "paper"):
        assert semantic_ids(texts, TableJudge(same_first_word=True), "q", mode=mode) == [
            0,
            1,
            0,
            2,
            1,
            0,
        ]


def test_non_transitive_judge_separates_the_two_loops():
    # s0 ~ s2 and s1 ~ s2, but s0 !~ s1 (B2 step 3)
    texts = ["s0", "s1", "s2"]
    table = _symmetric([("s0", "s2"), ("s1", "s2")])
    # Nature code: s0 opens 0 and claims s2; s1 opens 1 and takes s2 over
    assert semantic_ids(texts, TableJudge(table), "q", mode="nature_code") == [0, 1, 1]
    # paper: s2 joins the first cluster whose first member it matches, s0's
    assert semantic_ids(texts, TableJudge(table), "q", mode="paper") == [0, 1, 0]


def test_strict_flag_reaches_clustering():
    texts = ["x", "y"]
    table = {("x", "y"): ENTAILMENT, ("y", "x"): NEUTRAL}
    assert semantic_ids(texts, TableJudge(table), "q", strict=True) == [0, 1]
    assert semantic_ids(texts, TableJudge(table), "q", strict=False) == [0, 0]


def test_nature_loop_asks_every_later_answer_of_each_new_cluster():
    judge = TableJudge(same_first_word=True)
    semantic_ids(["a 1", "b 1", "a 2"], judge, "q")
    # a1 vs b1, a1 vs a2 (both ways), then b1 vs a2; a2 is already placed so never a representative
    pairs = [(p, h) for p, h, _ in judge.calls]
    assert pairs == [
        ("a 1", "b 1"),
        ("b 1", "a 1"),
        ("a 1", "a 2"),
        ("a 2", "a 1"),
        ("b 1", "a 2"),
        ("a 2", "b 1"),
    ]


def test_bad_mode_named():
    with pytest.raises(ValueError, match="mode"):
        semantic_ids(["a", "b"], TableJudge(), "q", mode="kuhn")


# -- entropies -----------------------------------------------------------------------------------
def test_rao_entropy_by_hand():
    # unnormalised likelihoods 0.2, 0.1 | 0.15, 0.05 -> masses 0.6 | 0.4 after renormalising
    ll = np.log([0.2, 0.1, 0.15, 0.05])
    ids = [0, 0, 1, 1]
    np.testing.assert_allclose(np.exp(logsumexp_by_id(ll, ids)), [0.6, 0.4], rtol=1e-12)
    expected = -(0.6 * math.log(0.6) + 0.4 * math.log(0.4))
    assert predictive_entropy_rao(ll, ids) == pytest.approx(expected, rel=1e-12)
    assert cluster_assignment_entropy(ids) == pytest.approx(math.log(2), rel=1e-12)


def test_rao_entropy_uneven_clusters_and_shift_invariance():
    ll = np.array([-0.5, -2.0, -1.0, -3.0, -0.1])
    ids = [2, 0, 2, 1, 0]  # ids need not be contiguous or ordered
    w = np.exp(ll)
    masses = np.array([w[[1, 4]].sum(), w[3], w[[0, 2]].sum()]) / w.sum()
    expected = -(masses * np.log(masses)).sum()
    assert predictive_entropy_rao(ll, ids) == pytest.approx(expected, rel=1e-12)
    assert predictive_entropy_rao(ll - 700.0, ids) == pytest.approx(
        expected, rel=1e-9
    )  # no underflow
    counts = np.array([2, 1, 2]) / 5
    assert cluster_assignment_entropy(ids) == pytest.approx(
        -(counts * np.log(counts)).sum(), rel=1e-12
    )


def test_one_cluster_has_zero_entropy_and_all_distinct_is_log_m():
    ll = np.log([0.5, 0.3, 0.2])
    assert predictive_entropy_rao(ll, [0, 0, 0]) == pytest.approx(0.0, abs=1e-15)
    assert cluster_assignment_entropy([0, 1, 2, 3]) == pytest.approx(math.log(4))


def test_entropy_input_errors():
    with pytest.raises(ValueError, match="semantic_ids"):
        predictive_entropy_rao([0.0, -1.0], [0])
    with pytest.raises(ValueError, match="no answers"):
        cluster_assignment_entropy([])


# -- scorer --------------------------------------------------------------------------------------
FOUR = SamplingConfig(n_samples=4)


def _row(texts, mean_ll, question="capital of France?", config=FOUR):
    n = len(texts)
    return SampleSet(
        prompt="p",
        question=question,
        texts=tuple(texts),
        token_ids=tuple(() for _ in texts),
        token_logprobs=tuple(torch.tensor([v], dtype=torch.float32) for v in mean_ll),
        mean_logprobs=torch.tensor(mean_ll, dtype=torch.float64),
        embeddings=torch.zeros(n, 4),
        stopped=(True,) * n,
        config=config,
    )


def test_scorer_confidence_is_negated_se_with_details():
    ll = list(np.log([0.2, 0.1, 0.15, 0.05]))
    rows = [
        _row(["paris a", "paris b", "lyon a", "lyon b"], ll),
        _row(["rome", "rome x", "rome y", "rome z"], ll),
    ]
    judge = TableJudge(same_first_word=True)
    result = SemanticEntropy(judge).fit([], np.array([])).score(rows)
    expected = -(0.6 * math.log(0.6) + 0.4 * math.log(0.4))
    np.testing.assert_allclose(result.raw, [expected, 0.0], atol=1e-12)
    np.testing.assert_array_equal(result.confidence, -result.raw)
    assert result.raw_name == "semantic_entropy"
    d = result.details
    np.testing.assert_allclose(d["discrete_semantic_entropy"], [math.log(2), 0.0], atol=1e-12)
    assert d["semantic_ids"] == [[0, 0, 1, 1], [0, 0, 0, 0]]
    assert (d["judge"], d["strict"], d["clustering"]) == ("stub:table", True, "nature_code")
    assert (d["n_samples"], d["temperature"], d["top_p"]) == (4, 1.0, 0.9)
    assert {q for _, _, q in judge.calls} == {"capital of France?"}


def test_scorer_checks_inputs():
    judge = TableJudge()
    with pytest.raises(ValueError, match="row 1 has 1 sampled answers"):
        SemanticEntropy(judge).score([_row(["a", "b"], [-1.0, -2.0]), _row(["a"], [-1.0])])
    with pytest.raises(ValueError, match="different settings"):
        SemanticEntropy(judge).score(
            [
                _row(["a", "b"], [-1.0, -2.0]),
                _row(["a", "b"], [-1.0, -2.0], config=SamplingConfig(top_p=1.0)),
            ]
        )
    with pytest.raises(ValueError, match="clustering"):
        SemanticEntropy(judge, clustering="kuhn")
    with pytest.raises(ValueError, match="no rows"):
        SemanticEntropy(judge).score([])
    with pytest.raises(BaselineUnavailable, match="entailment judge"):
        SemanticEntropy().score([_row(["a", "b"], [-1.0, -2.0])])
