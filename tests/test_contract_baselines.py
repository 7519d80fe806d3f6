"""The one scorer contract, for the baselines that train: TAD, ACT-ViT, the answer length and
the permuted-label control each fit and predict through the one input bundle
(`DetectorInputs`) that `StoreInputs.bundle` reads from a tiny captured store, and score as
their former row path does, as sklearn does (the length), and as the runner stores."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from sklearn.linear_model import LogisticRegression
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler
from test_baselines_runner import OPTIONS, capture_alternating

from actmap.baselines.inputs import StoreInputs
from actmap.baselines.options import BaselineOptions
from actmap.baselines.runner import run_baselines, score_in_chunks
from actmap.capture.from_store import read_generations
from actmap.detectors.inputs import DetectorInputs
from actmap.store import MapStore
from actmap.store.rows import balanced_splits

TRAINABLE = ("answer_length", "tad", "actvit", "permuted_label")
ATOL = 1e-6


@pytest.fixture(scope="module")
def store(tmp_path_factory, tiny_llama, word_tokenizer):
    root = tmp_path_factory.mktemp("contract-baselines")
    return capture_alternating(root, tiny_llama, word_tokenizer)


def store_inputs(store) -> StoreInputs:
    options = BaselineOptions(**{**OPTIONS.__dict__, "permuted_inner": "tad"})
    return StoreInputs(store, options, balanced_splits(store))


def fit(inputs: StoreInputs, method: str, provide) -> object:
    """``method`` fit on the balanced train rows, selecting on validation, as ``provide`` hands
    them (the bundle, or the bare rows of the former path)."""
    scorer, splits = inputs.make_scorer(method), inputs.splits
    train, val = (provide(scorer, splits[s]) for s in ("train", "validation"))
    y, y_val = (inputs.labels(splits[s]) for s in ("train", "validation"))
    return scorer.fit(train, y, val, y_val)


def bare_rows(inputs: StoreInputs):
    return lambda scorer, ids: inputs.rows(scorer.requires, ids, scorer.name)


@pytest.mark.parametrize("method", TRAINABLE)
def test_every_trainable_baseline_fits_and_predicts_through_the_one_bundle(store, method):
    inputs = store_inputs(store)
    test_ids = inputs.splits["test"]
    scorer = fit(inputs, method, lambda s, ids: inputs.scorer_inputs(s, ids, s.name))
    bundle = inputs.scorer_inputs(scorer, test_ids, method)
    assert isinstance(bundle, DetectorInputs) and len(bundle) == len(test_ids)
    assert bundle.maps is None  # a baseline reads no map; the bundle holds what it requires
    assert (bundle.dense is not None) == ("dense" in scorer.requires)
    p = scorer.predict_proba(bundle)
    assert p.shape == (len(test_ids),) and np.all((p >= 0) & (p <= 1))
    result = scorer.score(bundle)
    if scorer.probability:
        np.testing.assert_allclose(p, result.confidence, atol=ATOL)
    else:  # TAD's sum_log: exp of the confidence, the product of (q_t + 1e-5), capped at 1
        np.testing.assert_allclose(p, np.minimum(np.exp(result.confidence), 1.0), atol=ATOL)
    # the former path: the same fitted object scoring the bare rows the runner used to hand it
    old = scorer.score(inputs.rows(scorer.requires, test_ids, method))
    np.testing.assert_allclose(result.confidence, old.confidence, atol=ATOL)
    np.testing.assert_allclose(result.raw, old.raw, atol=ATOL)
    assert result.raw_name == old.raw_name
    # fit by the former path too: the same choices, the same scores
    again = fit(inputs, method, bare_rows(inputs))
    old_rows = inputs.rows(scorer.requires, test_ids, method)
    np.testing.assert_allclose(again.score(old_rows).confidence, result.confidence, atol=ATOL)
    # the runner's chunks (`DetectorInputs.take`) score as the whole bundle does
    chunked, _, _ = score_in_chunks(inputs, method, scorer, bundle)
    np.testing.assert_allclose(chunked.confidence, result.confidence, atol=ATOL)


def test_the_trainable_baselines_tested_here_are_every_registered_one():
    from actmap.baselines.registry import baseline_class, list_baselines

    trains = {name for name in list_baselines() if baseline_class(name).supervised}
    assert trains == set(TRAINABLE)
    assert all(hasattr(baseline_class(name), "predict_proba") for name in trains)


def test_the_length_baseline_through_the_bundle_is_sklearn_on_the_token_counts(store):
    inputs = store_inputs(store)
    scorer = fit(inputs, "answer_length", lambda s, ids: inputs.bundle(s.requires, ids))
    splits = inputs.splits

    def features(ids):  # read independently of the bundle, straight from the store
        n = np.array([g.n_tokens for g in read_generations(store, ids)], dtype=np.float64)
        return np.column_stack([n, np.log1p(n)])

    reference = make_pipeline(StandardScaler(), LogisticRegression(C=1.0))
    reference.fit(features(splits["train"]), inputs.labels(splits["train"]))
    want = reference.predict_proba(features(splits["test"]))[:, 1]
    got = scorer.predict_proba(inputs.bundle(scorer.requires, splits["test"]))
    np.testing.assert_allclose(got, want, atol=ATOL)


def test_the_runner_stores_what_the_bundle_scores(store, tmp_path):
    """`run_baselines` calls every method that trains through the bundle: its stored
    confidences are the bundle's scores of a scorer fit the same way."""
    shutil.copytree(store.root, tmp_path / "store")
    store = MapStore.open(tmp_path / "store")
    inputs = store_inputs(store)
    methods = ["answer_length", "tad"]
    results = run_baselines(store, methods, options=inputs.options)
    assert {r.status for r in results.values()} == {"done"}
    for method in methods:
        table = store.read_table(f"results/{method}").to_pandas().set_index("id")
        scorer = fit(inputs, method, lambda s, ids: inputs.bundle(s.requires, ids))
        test_ids = inputs.splits["test"]
        want = scorer.score(inputs.bundle(scorer.requires, test_ids)).confidence
        np.testing.assert_allclose(table.loc[test_ids, "confidence"], want, atol=ATOL)


def test_a_bundle_without_the_part_a_baseline_reads_is_refused(store):
    inputs = store_inputs(store)
    scorer = fit(inputs, "answer_length", lambda s, ids: inputs.bundle(s.requires, ids))
    with pytest.raises(ValueError, match="answer_length reads generations"):
        scorer.predict_proba(DetectorInputs(maps=np.zeros((2, 1, 2, 2))))


def test_a_dense_bundle_takes_rows_like_every_other_part():
    import torch

    dense = torch.arange(5 * 2 * 3, dtype=torch.float16).reshape(5, 2, 3)
    gens = list("abcde")
    bundle = DetectorInputs(generations=gens, dense=dense)
    assert len(bundle) == 5 and len(DetectorInputs()) == 0
    part = bundle.take(np.array([4, 1]))
    assert part.generations == ["e", "b"] and torch.equal(part.dense, dense[[4, 1]])
    assert torch.equal(bundle.take(slice(1, 3)).dense, dense[1:3]) and part.maps is None
