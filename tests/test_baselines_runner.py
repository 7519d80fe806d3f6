"""run_baselines / compare_methods on a tiny captured store, checked against direct computations."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
from conftest import ListTask
from sklearn.metrics import average_precision_score, roc_auc_score

from actmap.baselines import runner
from actmap.baselines.actvit import ACTViTConfig
from actmap.baselines.entailment import ENTAILMENT, NEUTRAL
from actmap.baselines.runner import BaselineOptions, resolve_methods, run_baselines
from actmap.baselines.samples_table import SAMPLES_TABLE, decode_embeddings
from actmap.capture import CaptureConfig
from actmap.capture.run import run_capture, store_config
from actmap.data.base import Example
from actmap.llm.models import ModelSource
from actmap.maps import MapConfig
from actmap.report.side_by_side import compare_methods, format_table
from actmap.store import MapStore, encode_array
from actmap.store.rows import balanced_splits

WORDS = "what is the capital of the river red blue green one two three four five".split()
SOURCE = ModelSource("tiny", "tiny", None, "0")
SPLIT_SIZES = {"train": 16, "validation": 8, "test": 8}
ALL = [
    "ppl",
    "mte",
    "answer_length",
    "rauq",
    "tad",
    "p_true",
    "eigenscore",
    "semantic_entropy",
    "actvit",
]


class AlternatingTask(ListTask):
    """Labels alternate by example, so every split holds both classes in equal numbers."""

    name = "alternating"
    max_new_tokens = 5

    def __init__(self):
        rng = np.random.default_rng(0)
        super().__init__([])
        for split, n in SPLIT_SIZES.items():
            for i in range(n):
                words = rng.choice(WORDS, size=int(rng.integers(2, 7)))
                self.examples.append(
                    Example(
                        source_key=f"{split}{i}",
                        dataset="alternating",
                        split=split,
                        question=" ".join(words),
                        references=(),
                        meta={"correct": str(i % 2)},
                    )
                )


class ExactMatchJudge:
    """Entailment iff the two answers are the same text: clusters are groups of equal answers."""

    name = "stub:exact-match"

    def __init__(self):
        self.calls = 0

    def check_implication(self, premise_text, hypothesis_text, question=None):
        self.calls += 1
        return ENTAILMENT if premise_text.strip() == hypothesis_text.strip() else NEUTRAL


OPTIONS = BaselineOptions(
    n_samples=3,
    sample_max_new_tokens=4,
    samples_commit_every=3,
    actvit_grid=(  # a sweep of two configurations
        ACTViTConfig(dim=16, depth=1, heads=2, dim_head=8, batch_size=8),
        ACTViTConfig(dim=8, depth=1, heads=2, dim_head=4, batch_size=8, weight_decay=1.0),
    ),
    actvit_epochs=1,
    actvit_seeds=(42, 123),
    device="cpu",
    score_chunk=3,
)


def capture_alternating(root, model, tokenizer) -> MapStore:
    """A tiny store of `AlternatingTask` at ``root``, with attention (K=3) and dense states."""
    task = AlternatingTask()
    config = CaptureConfig(max_new_tokens=5, batch_size=8, attention_keys=3, keep_dense=True)
    store = MapStore.create(root, store_config(task, SOURCE, config, MapConfig(), {}))
    run_capture(model, tokenizer, SOURCE, task, task.examples, store, config)
    return store


@pytest.fixture(scope="module")
def captured(tmp_path_factory, tiny_llama, word_tokenizer):
    root = tmp_path_factory.mktemp("captured")
    capture_alternating(root, tiny_llama, word_tokenizer)
    return root


@pytest.fixture(scope="module")
def scored(captured, tmp_path_factory, tiny_llama, word_tokenizer):
    root = tmp_path_factory.mktemp("scored") / "store"
    shutil.copytree(captured, root)
    store = MapStore.open(root)
    events = []
    results = run_baselines(
        store,
        ALL,
        model=tiny_llama,
        tokenizer=word_tokenizer,
        judge=ExactMatchJudge(),
        progress=lambda *event: events.append(event),
        options=OPTIONS,
    )
    return store, results, events


def results_frame(store: MapStore, method: str) -> pd.DataFrame:
    return store.read_table(f"results/{method}").to_pandas().set_index("id")


def test_resolve_methods_aliases_and_errors():
    assert resolve_methods("ppl,mte,ptrue,ppl") == ["perplexity", "mean_token_entropy", "p_true"]
    assert "permuted_label" not in resolve_methods("all")
    with pytest.raises(ValueError, match="unknown method 'bogus'"):
        resolve_methods("ppl,bogus")


def test_every_method_scores_each_requested_row_once(scored):
    store, results, events = scored
    splits = balanced_splits(store)
    assert all(len(splits[s]) >= 4 for s in SPLIT_SIZES)  # both classes survived capture
    test = set(splits["test"])
    for method, result in results.items():
        assert result.status == "done", (method, result.reason)
        frame = results_frame(store, method)
        assert set(frame.index) == test and len(frame) == len(test)
        assert (frame["split"] == "test").all()
        assert frame["confidence"].dtype == np.float64 and frame["raw"].dtype == np.float64
        assert np.isfinite(frame["confidence"]).all()
        record = store.manifest["results"][method]
        assert record["rows"] == len(test) and record["latency_ms_per_answer"] > 0
    assert {e[0] for e in events} >= set(results)  # progress was reported per method
    # a judged method moves one row at a time (the others by score_chunk = 3 rows)
    scoring = [e for e in events if e[0] == "semantic_entropy" and e[3] == "scoring"]
    assert [e[1] for e in scoring] == list(range(1, len(test) + 1))
    ppl = [e[1] for e in events if e[0] == "perplexity" and e[3] == "scoring"]
    assert ppl == [min(k, len(test)) for k in range(3, len(test) + 3, 3)]


def test_greybox_confidence_equals_mean_of_stored_steps(scored):
    store, _, _ = scored
    gens = pd.read_parquet(store.root / "generations").drop_duplicates("id", keep="last")
    gens = gens.set_index("id")
    ppl, mte = results_frame(store, "perplexity"), results_frame(store, "mean_token_entropy")
    for key in ppl.index:
        logprobs = np.asarray(gens.at[key, "logprobs"], dtype=np.float64)
        entropies = np.asarray(gens.at[key, "entropies"], dtype=np.float64)
        assert ppl.at[key, "confidence"] == pytest.approx(logprobs.sum() / len(logprobs))
        assert ppl.at[key, "raw"] == pytest.approx(-logprobs.sum() / len(logprobs))
        assert mte.at[key, "confidence"] == pytest.approx(-entropies.sum() / len(entropies))


def test_sampling_methods_match_a_direct_computation_on_stored_samples(scored):
    store, _, _ = scored
    samples = store.read_table("samples").to_pandas().set_index("id")
    se, es = results_frame(store, "semantic_entropy"), results_frame(store, "eigenscore")
    assert set(samples.index) == set(se.index)
    for key in se.index:
        texts = [t.strip() for t in samples.at[key, "texts"]]
        assert len(texts) == 3
        mass = np.exp(np.asarray(samples.at[key, "mean_logprobs"], dtype=np.float64))
        p = np.array([mass[[t == u for t in texts]].sum() for u in dict.fromkeys(texts)])
        p /= p.sum()
        assert se.at[key, "confidence"] == pytest.approx(float((p * np.log(p)).sum()), abs=1e-9)
        # EigenScore: mean log eigenvalue = log det / K of the regularised (K, K) Gram matrix
        z = decode_embeddings(samples.at[key, "embeddings"], samples.at[key, "shape"])
        z = z.astype(np.float64)
        z = z - z.mean(axis=1, keepdims=True)
        _, logdet = np.linalg.slogdet(z @ z.T + 1e-3 * np.eye(len(z)))
        assert es.at[key, "confidence"] == pytest.approx(-logdet / len(z), rel=1e-6)
    record = store.manifest["results"]["semantic_entropy"]
    assert record["details"]["judge"] == "stub:exact-match"
    assert record["latency_ms_per_answer"] == pytest.approx(
        record["sampling_ms_per_answer"] + record["judging_ms_per_answer"]
    )
    assert (store.root / "judge-cache.json").is_file()


def test_actvit_and_tad_record_their_fit(scored):
    store, _, _ = scored
    actvit = results_frame(store, "actvit")
    for seed in (42, 123):
        assert (
            (actvit[f"confidence_by_seed_{seed}"] >= 0)
            & (actvit[f"confidence_by_seed_{seed}"] <= 1)
        ).all()
    np.testing.assert_array_equal(actvit["confidence"], actvit["confidence_by_seed_42"])
    record = store.manifest["results"]["actvit"]
    assert record["details"]["n_params"] > 0 and record["fit_rows"] == {
        "train": 16,
        "validation": 8,
    }
    assert store.manifest["results"]["tad"]["details"]["n_previous"] == 3  # the store keeps K=3


def forced_eigenscore(store, model, tokenizer):
    """EigenScore run again on ``store`` (forced), from its stored samples where it can."""
    options = BaselineOptions(**{**OPTIONS.__dict__, "force": True})
    return run_baselines(store, ["eigenscore"], model=model, tokenizer=tokenizer, options=options)


def test_resume_skips_stored_methods_and_reuses_samples(
    scored, monkeypatch, tiny_llama, word_tokenizer
):
    store, first, _ = scored

    def forbidden(*args, **kwargs):
        raise AssertionError("called on resume")

    monkeypatch.setattr(runner, "make_scorer", forbidden)
    again = run_baselines(store, ALL, model=tiny_llama, tokenizer=word_tokenizer, options=OPTIONS)
    assert {r.status for r in again.values()} == {"skipped"}
    monkeypatch.undo()
    # forced, EigenScore is recomputed from the stored samples: no new sampling
    import actmap.baselines.sampling as sampling

    monkeypatch.setattr(sampling, "sample_answers", forbidden)
    before = results_frame(store, "eigenscore")["confidence"]
    forced = forced_eigenscore(store, tiny_llama, word_tokenizer)
    assert forced["eigenscore"].status == "done"
    assert forced["eigenscore"].record["samples"] == {"reused": 8, "sampled": 0}
    pd.testing.assert_series_equal(results_frame(store, "eigenscore")["confidence"], before)


def test_embeddings_keep_values_beyond_float16_and_an_overflowed_row_is_drawn_again(
    scored, tmp_path, tiny_llama, word_tokenizer
):
    root = tmp_path / "store"
    shutil.copytree(scored[0].root, root)
    store = MapStore.open(root)
    samples = store.read_table(SAMPLES_TABLE).to_pylist()
    before = results_frame(store, "eigenscore")["confidence"]
    # stored in float32: a value float16 cannot hold reads back as written
    big = np.full((3, 5), 1e5, dtype=np.float32) * np.arange(1, 4, dtype=np.float32)[:, None]
    assert np.array_equal(decode_embeddings(encode_array(big, np.float32), big.shape), big)
    old = np.array([[1.5, -2.25], [3.0, 0.5]], dtype=np.float32)  # float16 bytes, written before
    assert np.array_equal(decode_embeddings(encode_array(old), old.shape), old)
    # a row written in float16 before, whose embeddings overflowed there, supersedes one row
    row = dict(samples[0])
    z = decode_embeddings(row["embeddings"], row["shape"]).copy()
    z[0, 0] = 1e6  # beyond 65,504: infinite in float16
    with np.errstate(over="ignore"):
        row["embeddings"] = encode_array(z)
    store.write_table(
        SAMPLES_TABLE, pa.Table.from_pylist([row], schema=store.dataset(SAMPLES_TABLE).schema)
    )
    forced = forced_eigenscore(store, tiny_llama, word_tokenizer)
    assert forced["eigenscore"].status == "done"
    assert forced["eigenscore"].record["samples"] == {"reused": 7, "sampled": 1}
    latest = {r["id"]: r for r in store.read_table(SAMPLES_TABLE).to_pylist()}[row["id"]]
    assert latest["texts"] == samples[0]["texts"]  # the same draw: its seed is fixed by the id
    redrawn = decode_embeddings(latest["embeddings"], latest["shape"])
    assert np.isfinite(redrawn).all() and len(latest["embeddings"]) == 4 * redrawn.size
    after = results_frame(store, "eigenscore")["confidence"]
    pd.testing.assert_series_equal(after, before, rtol=1e-3)  # float32 against float16 rounding


def test_unavailable_methods_are_reported_and_the_others_run(captured, tmp_path):
    root = tmp_path / "store"
    shutil.copytree(captured, root)
    shutil.rmtree(root / "attention")
    shutil.rmtree(root / "dense")
    options = BaselineOptions(**{**OPTIONS.__dict__, "judge": "/nonexistent/judge.gguf"})
    results = run_baselines(
        MapStore.open(root), ["rauq", "ppl", "actvit", "semantic_entropy"], options=options
    )
    assert results["perplexity"].status == "done"
    assert results["rauq"].status == "unavailable"
    assert "--attention-keys 10" in results["rauq"].reason
    assert results["actvit"].status == "unavailable" and "--keep-dense" in results["actvit"].reason
    assert results["semantic_entropy"].status == "unavailable"
    assert "get-model" in results["semantic_entropy"].reason
    no_judge = run_baselines(
        MapStore.open(root), ["se"], options=BaselineOptions(**{**OPTIONS.__dict__, "judge": None})
    )
    assert "--judge none" in no_judge["semantic_entropy"].reason
    assert not (root / "samples").exists()  # nothing sampled for a method that cannot run


def fake_run(root, store, seeds=(1, 2), ids=None):
    """A folder shaped like `actmap train` output: seed-<s>/test_scores.parquet."""
    meta = store.metadata().set_index("id")
    ids = ids or balanced_splits(store)["test"]
    rng = np.random.default_rng(0)
    for seed in seeds:
        folder = root / f"seed-{seed}"
        folder.mkdir(parents=True)
        p = rng.uniform(size=len(ids))
        pd.DataFrame(
            {
                "id": ids,
                "label": meta.loc[ids, "label"].to_numpy(dtype=np.int64),
                "logit": np.log(p / (1 - p)),
                "p_correct": p,
            }
        ).to_parquet(folder / "test_scores.parquet")
        config = {"detector": "mlp", "train_config": {"max_epochs": 2, "seeds": [seed]}}
        (folder / "config.json").write_text(json.dumps(config))
    return root


def test_compare_matches_sklearn_on_the_stored_confidences(scored, tmp_path):
    store, _, _ = scored
    test = balanced_splits(store)["test"]
    labels = store.metadata().set_index("id").loc[test, "label"].to_numpy(dtype=np.int64)
    run = fake_run(tmp_path / "run", store)
    rows = {r["method"]: r for r in compare_methods(store, [run])}
    for method in ("perplexity", "mean_token_entropy", "rauq", "tad", "p_true", "semantic_entropy"):
        confidence = results_frame(store, method).loc[test, "confidence"]
        assert rows[method]["auroc"] == pytest.approx(roc_auc_score(labels, confidence))
        assert rows[method]["auprc"] == pytest.approx(average_precision_score(labels, confidence))
        assert rows[method]["n"] == len(test)
    assert rows["perplexity"]["ece"] is None and "ECE n/a" in rows["perplexity"]["note"]
    assert rows["p_true"]["ece"] is not None
    actvit = results_frame(store, "actvit").loc[test]
    per_seed = [roc_auc_score(labels, actvit[f"confidence_by_seed_{s}"]) for s in (42, 123)]
    assert rows["actvit"]["auroc"] == pytest.approx(np.mean(per_seed))
    assert rows["actvit"]["auroc_std"] == pytest.approx(np.std(per_seed, ddof=1))
    actmap = rows["actmap-mlp (run)"]
    expected = [
        roc_auc_score(labels, pd.read_parquet(run / f"seed-{s}/test_scores.parquet")["p_correct"])
        for s in (1, 2)
    ]
    assert actmap["auroc"] == pytest.approx(np.mean(expected)) and actmap["seeds"] == 2
    aurocs = [r["auroc"] for r in rows.values()]
    assert list(rows) == [r["method"] for r in compare_methods(store, [run])]
    assert aurocs == sorted(aurocs, reverse=True)
    table = format_table(list(rows.values()))
    assert table.count("\n") == len(rows) + 2 and "± " in table


def test_compare_rejects_a_run_on_other_rows_and_fits_the_length_control(captured, tmp_path):
    store = MapStore.open(captured)
    ids = balanced_splits(store)["test"][:-1]
    with pytest.raises(ValueError, match="balanced test rows"):
        compare_methods(store, [fake_run(tmp_path / "run", store, ids=ids)])
    rows = compare_methods(store)  # no stored results: the length control is fit here
    assert [r["method"] for r in rows] == ["answer_length"]
    assert rows[0]["n"] == len(balanced_splits(store)["test"]) and rows[0]["ece"] is not None


def test_permuted_label_control_refits_its_inner_scorer(captured, tmp_path):
    root = tmp_path / "store"
    shutil.copytree(captured, root)
    store = MapStore.open(root)
    options = BaselineOptions(**{**OPTIONS.__dict__, "permuted_inner": "answer_length"})
    result = run_baselines(store, ["permuted_label", "answer_length"], options=options)
    assert {r.status for r in result.values()} == {"done"}
    record = store.manifest["results"]["permuted_label"]
    assert record["raw_name"] == "permuted_p_correct_from_length"
    assert record["details"]["inner"] == "answer_length" and record["fit_rows"]["train"] == 16
    rows = {r["method"]: r for r in compare_methods(store)}
    assert rows["permuted_label"]["kind"] == "control" and rows["permuted_label"]["ece"] is not None
    bad = BaselineOptions(**{**OPTIONS.__dict__, "permuted_inner": "perplexity", "force": True})
    failed = run_baselines(store, ["permuted_label"], options=bad)["permuted_label"]
    assert failed.status == "failed" and "supervised inner scorer" in failed.reason


def test_a_toy_baseline_runs_by_one_registration(captured, tmp_path, monkeypatch):
    """A new method needs its class and one registration; the runner provides, fits, scores
    and writes it like the built-in ones."""
    from actmap.baselines import registry
    from actmap.scoring.contract import ScoreResult, bundle_part

    monkeypatch.setattr(registry, "BASELINES", dict(registry.BASELINES))

    def first_logprobs(inputs):  # the bundle's generations (`DetectorInputs`)
        return np.array([float(g.logprobs[0]) for g in bundle_part(inputs, "generations")])

    @registry.register_baseline
    class FirstTokenThreshold:
        """Supervised toy: p(correct) = the train rows' accuracy above/below the median
        first-token log-probability."""

        name = "first_token"
        supervised = True
        requires = ("generations",)
        probability = True

        def fit(self, inputs, y, val_inputs=None, y_val=None):
            first = first_logprobs(inputs)
            self.cut_ = float(np.median(first))
            high = first > self.cut_
            self.p_ = (float(y[~high].mean()), float(y[high].mean()))
            return self

        def predict_proba(self, inputs):
            return np.where(first_logprobs(inputs) > self.cut_, self.p_[1], self.p_[0])

        def score(self, inputs):
            p = self.predict_proba(inputs)
            return ScoreResult(p, first_logprobs(inputs), "first_logprob", {"cut": self.cut_})

    root = tmp_path / "store"
    shutil.copytree(captured, root)
    store = MapStore.open(root)
    (result,) = run_baselines(store, "first_token", options=OPTIONS).values()
    assert result.status == "done", result.reason
    # independent reference: the stored generations and labels, read with pandas
    gens = pd.read_parquet(root / "generations").drop_duplicates("id", keep="last")
    first = {k: float(lp[0]) for k, lp in zip(gens["id"], gens["logprobs"], strict=True)}
    meta = store.metadata().set_index("id")
    splits = balanced_splits(store)
    train_first = np.array([first[k] for k in splits["train"]])
    cut = float(np.median(train_first))
    y_train = meta.loc[splits["train"], "label"].to_numpy()
    p_low, p_high = y_train[train_first <= cut].mean(), y_train[train_first > cut].mean()
    frame = results_frame(store, "first_token")
    assert set(frame.index) == set(splits["test"]) and (frame["split"] == "test").all()
    for key in splits["test"]:
        expected = p_high if first[key] > cut else p_low
        assert frame.at[key, "confidence"] == pytest.approx(expected)
        assert frame.at[key, "raw"] == pytest.approx(first[key])
    record = store.manifest["results"]["first_token"]
    assert record["requires"] == ["generations"] and record["probability"] is True
    assert record["details"]["cut"] == pytest.approx(cut) and record["fit_rows"]["train"] == 16
    row = {r["method"]: r for r in compare_methods(store)}["first_token"]
    labels = meta.loc[splits["test"], "label"].to_numpy()
    expected_auroc = roc_auc_score(labels, frame.loc[splits["test"], "confidence"])
    assert row["auroc"] == pytest.approx(expected_auroc) and row["ece"] is not None
    with pytest.raises(ValueError, match="already registered"):
        registry.register_baseline(FirstTokenThreshold)


def test_register_baseline_rejects_an_undeclared_contract(monkeypatch):
    from actmap.baselines import registry

    monkeypatch.setattr(registry, "BASELINES", dict(registry.BASELINES))

    class NoRequires:
        name, supervised, probability = "x", False, False

    class UnknownInput:
        name, supervised, probability, requires = "y", False, False, ("telepathy",)

    class TrainsButCannotPredict:  # the one contract: a method that trains has predict_proba
        name, supervised, probability, requires = "z", True, True, ("generations",)

        def fit(self, inputs, y, val_inputs=None, y_val=None):
            return self

    with pytest.raises(TypeError, match="does not declare requires"):
        registry.register_baseline(NoRequires)
    with pytest.raises(TypeError, match="does not declare predict_proba"):
        registry.register_baseline(TrainsButCannotPredict)
    with pytest.raises(ValueError, match="unknown inputs"):
        registry.register_baseline(UnknownInput)


def test_the_report_states_each_methods_settings_and_run_time(scored, tmp_path):
    from actmap.report.parts import method_runs
    from actmap.report.sections import ReportContext, StoreRef

    store, _, _ = scored
    ref = StoreRef("tiny-alternating", store.root, "tiny", "alternating")
    context = ReportContext({ref.name: ref}, {}, tmp_path / "out", tmp_path / "scratch")
    result = method_runs.compute(context)
    records = store.manifest["results"]
    by_method = {r.method: r for r in result.runs}
    assert set(by_method) == set(records)
    for method, record in records.items():
        run = by_method[method]
        assert run.rows == record["rows"] == len(store.ids(f"results/{method}"))
        assert run.wall_s == record["wall_time_s"]
        assert run.latency_ms == record["latency_ms_per_answer"]
        assert run.fit_s == record.get("fit_time_s")
    assert by_method["semantic_entropy"].settings.startswith("3 samples, T = 1, top-p 0.9; judge")
    assert by_method["tad"].settings == "K = 3"
    # the ACT-ViT sweep: both configurations with their validation AUROC, one selected
    grid = records["actvit"]["details"]["grid"]
    assert [s.val_auroc for s in result.sweeps] == [g["val_auroc"] for g in grid]
    (chosen,) = [s for s in result.sweeps if s.selected]
    assert chosen.val_auroc == max(g["val_auroc"] for g in grid)
    assert by_method["actvit"].settings.startswith(f"{chosen.config} (selected of 2); 2 seeds")
    text = method_runs.render(result, tmp_path)
    assert [method_runs._seconds(v) for v in (None, 0.01337, 2.456, 96989.18)] == [
        "--",
        "0.0134",
        "2.46",
        "96,989.2",
    ]
    assert "| tiny-alternating | actvit | 8 |" in text and "| validation AUROC |" in text
