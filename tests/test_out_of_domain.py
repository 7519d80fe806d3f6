"""Out of domain (`actmap.experiments.generalist`, `actmap.experiments.out_of_domain`): a
generalist over two tasks of one tiny generator, each task held out in turn against the
label-free baselines (checked against sklearn's AUROC and a direct loop's PRR), the first
labels drawn from training rows only, and bad input refused by name."""

from __future__ import annotations

import json
from fractions import Fraction

import numpy as np
import pytest

pytest.importorskip("fastapi")
from serve_helpers import tiny_generator  # noqa: E402
from test_capture_run import SOURCE, WordTask  # noqa: E402

from actmap.capture import CaptureConfig  # noqa: E402
from actmap.capture.run import ModelSource, run_capture, store_config  # noqa: E402
from actmap.errors import ActmapUserError  # noqa: E402
from actmap.maps import MapConfig  # noqa: E402
from actmap.scoring import metrics  # noqa: E402
from actmap.store import MapStore  # noqa: E402

CONFIG = CaptureConfig(
    max_new_tokens=5, batch_size=16, attention_keys=3, lookback_attention=True,
    keep_positions=True,
)  # fmt: skip


class LengthTask(WordTask):
    """The same questions, another answer rule: correct when the answer has an even length."""

    name = "lengths"

    def label(self, answer, example):
        return len(answer.strip()) % 2 == 0


class NoCorrectTestTask(WordTask):
    """WordTask's rule, except that no test answer is ever correct."""

    name = "no-correct-test"

    def label(self, answer, example):
        return example.split != "test" and super().label(answer, example)


class FewCorrectTestTask(WordTask):
    """WordTask's rule outside the test split; in it, exactly one answer is correct."""

    name = "few-correct-test"

    def label(self, answer, example):
        if example.split == "test":
            return example.source_key == "q2"
        return super().label(answer, example)


def capture_store(path, task, source=SOURCE, maps=MapConfig()):
    model, tokenizer = tiny_generator()
    store = MapStore.create(path, store_config(task, source, CONFIG, maps, {}))
    run_capture(model, tokenizer, source, task, task.examples, store, CONFIG)
    store.close()
    return path


@pytest.fixture(scope="module")
def two_tasks(tmp_path_factory):
    root = tmp_path_factory.mktemp("ood")
    return [capture_store(root / "words", WordTask(90)), capture_store(root / "lengths", LengthTask(90))]  # fmt: skip


@pytest.fixture(scope="module")
def on_lengths(two_tasks):
    """The tasks, and a deployable generalist fit on "lengths" alone ("words" held out)."""
    from actmap.experiments.generalist import fit_generalist, open_tasks

    words, lengths = open_tasks(two_tasks)
    return words, lengths, fit_generalist([lengths], "deployable")


def prr_by_loop(scores, labels, max_rejection):
    """PRR from its definition, one rejection rate at a time (distinct scores)."""
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    n, n_rej = len(scores), int(max_rejection * len(scores))

    def area(ranked):
        return sum(Fraction(sum(ranked[: n - j]), n - j) for j in range(n_rej)) / n

    y = [int(labels[i]) for i in order]
    random = Fraction(sum(y), n) * n_rej / n
    oracle = area(sorted(y, reverse=True))
    return float((area(y) - random) / (oracle - random))


def test_prr_against_hand_computed_values():
    scores, labels = [0.9, 0.8, 0.7, 0.6, 0.5, 0.4], [1, 0, 1, 0, 1, 0]
    # half rejected: kept accuracy 3/6, 3/5, 2/4; oracle 3/6, 3/5, 3/4; random 3/6 throughout
    want = (Fraction(1, 2) + Fraction(3, 5) + Fraction(1, 2) - Fraction(3, 2)) / (
        Fraction(1, 2) + Fraction(3, 5) + Fraction(3, 4) - Fraction(3, 2)
    )
    assert metrics.prr(scores, labels, 0.5) == pytest.approx(float(want))  # 2/7
    # the whole curve: kept accuracy 1/2, 3/5, 1/2, 2/3, 1/2, 1; oracle 1/2, 3/5, 3/4, 1, 1, 1
    area = Fraction(1, 2) + Fraction(3, 5) + Fraction(1, 2) + Fraction(2, 3) + Fraction(1, 2) + 1
    oracle = Fraction(1, 2) + Fraction(3, 5) + Fraction(3, 4) + 3
    assert metrics.prr(scores, labels, 1.0) == pytest.approx(float((area - 3) / (oracle - 3)))
    assert metrics.prr(labels, labels, 1.0) == pytest.approx(1.0)  # the oracle's own order
    assert metrics.prr([0.5] * 6, labels, 1.0) == pytest.approx(0.0)  # ties: a random order
    rng = np.random.default_rng(3)
    s, y = rng.normal(size=40), (rng.uniform(size=40) < 0.3).astype(int)
    assert metrics.prr(s, y, 0.5) == pytest.approx(prr_by_loop(s, y, 0.5))
    with pytest.raises(ValueError, match="single class"):
        metrics.prr(s, np.zeros(40), 0.5)


def test_leave_one_task_out_against_direct_scores(two_tasks):
    """Each held-out task's label-free rows are RAUQ / perplexity run on its balanced test
    rows (sklearn's AUROC, the loop's PRR); the generalist is the one fit on the other task;
    the paired difference is the difference of the two estimates."""
    from sklearn.metrics import roc_auc_score

    from actmap.baselines.registry import create_baseline
    from actmap.capture.from_store import read_generations
    from actmap.experiments.generalist import fit_generalist, open_tasks
    from actmap.experiments.out_of_domain import OutOfDomainConfig, leave_one_task_out
    from actmap.scoring.prior import em_prevalence, sigmoid

    config = OutOfDomainConfig(
        preset="deployable",
        mlp_epochs=1,
        curve_k=(0, 8),
        draws=2,
        n_resamples=50,
        max_rejection=0.5,
    )
    result = leave_one_task_out(two_tasks, config)
    tasks = open_tasks(two_tasks)
    assert [h.task for h in result.held_out] == ["words", "lengths"]
    assert result.generator["name"] == SOURCE.name
    for held, other, h in zip(tasks, tasks[::-1], result.held_out, strict=True):
        assert h.sources == [other.name] and not h.note
        test = held.sets["test"]
        y = np.asarray(test.labels)
        assert h.n_test == len(y) and h.n_test_all == len(held.sets["test_all"])
        rows = {m.method: m for m in h.methods}
        assert set(rows) >= {"generalist", "rauq", "perplexity", "mean_token_entropy", "tad",
                             "mlp", "in-domain stacked"}  # fmt: skip
        gens = read_generations(held.store, test.row_ids())
        for method in ("rauq", "perplexity"):
            conf = np.asarray(create_baseline(method).score(gens).confidence, dtype=np.float64)
            assert rows[method].auroc.estimate == pytest.approx(roc_auc_score(y, conf))
            assert rows[method].prr.estimate == pytest.approx(prr_by_loop(conf, y, 0.5))
            assert rows[method].calibration is None  # not a probability
        est = fit_generalist([other], result.preset)
        z = est.decision_function(held.inputs(test, est.requires))
        general = rows["generalist"]
        assert general.auroc.estimate == pytest.approx(roc_auc_score(y, z))
        assert general.prr.estimate == pytest.approx(prr_by_loop(z, y, 0.5))
        diff = rows["rauq"].vs_auroc
        assert diff.estimate == pytest.approx(general.auroc.estimate - rows["rauq"].auroc.estimate)
        assert general.vs_auroc is None
        # EM reads no label: its prior is the one the unlabelled scores give
        z_all = est.decision_function(held.inputs(held.sets["test_all"], est.requires))
        em = em_prevalence(sigmoid(z_all), 0.5)
        assert general.calibration.em_prevalence == pytest.approx(em.prevalence)
        assert general.calibration.em.estimate == pytest.approx(
            metrics.ece(em.probs, held.sets["test_all"].labels)
        )
        steps = {(p.step, p.k) for p in h.curve}
        assert steps == {("recalibrate", 0), ("recalibrate", 8), ("head refit", 8),
                         ("in-domain refit", 8)}  # fmt: skip
        k0 = next(p for p in h.curve if p.k == 0)
        assert k0.auroc == pytest.approx(roc_auc_score(y, z))  # recalibration keeps the ranking
    text = result.to_markdown()
    assert "held out: words" in text and "| generalist | generalist |" in text
    json.dumps(result.to_json(), default=float)


def test_first_labels_come_from_training_rows_only(on_lengths):
    from actmap.experiments.out_of_domain import draw_labelled, first_labels_curve

    words, _, est = on_lengths
    train = words.sets["train_all"]
    elsewhere = {i for s in ("validation_all", "test_all") for i in words.sets[s].row_ids()}
    z_all = est.decision_function(words.inputs(words.sets["test_all"], est.requires))
    ks = (0, 5, len(train))
    _, drawn = first_labels_curve(est, words, z_all, ks, draws=3)
    assert [len(d) for d in drawn] == [0, 5, 5, 5, len(train), len(train), len(train)]
    for ids in drawn:
        assert set(ids) <= set(train.row_ids()) and not set(ids) & elsewhere
        assert len(set(ids)) == len(ids)  # without replacement
    assert len({tuple(d) for d in drawn[1:4]}) > 1  # each draw its own rows
    with pytest.raises(ValueError, match="cannot draw"):
        draw_labelled(train, len(train) + 1, 0)


def test_generalist_run_trains_from_the_cli_and_loads_for_serving(two_tasks, tmp_path):
    import pandas as pd
    from sklearn.metrics import roc_auc_score
    from typer.testing import CliRunner

    from actmap.cli import app
    from actmap.detectors.stacked import StackedPlus
    from actmap.experiments.generalist import task_weights
    from actmap.serve.loaded_run import load_detector_run

    run = tmp_path / "generalist"
    args = ["train", "--detector", "actmap-plus", "--preset", "deployable", "--out", str(run)]
    args += [a for p in two_tasks for a in ("--store", str(p))]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    loaded = load_detector_run(run)
    assert isinstance(loaded.detector, StackedPlus)
    meta = loaded.detector.metadata_
    assert meta["generalist"] and meta["tasks"] == ["words", "lengths"]
    assert meta["inputs"]["store_config"]["model"]["name"] == SOURCE.name
    scores = pd.read_parquet(run / "seed-0" / "test_scores.parquet")
    summary = json.loads((run / "summary.json").read_text())
    for task, part in scores.groupby("task"):
        want = roc_auc_score(part["label"], part["logit"])
        assert summary["per_task"][task]["auroc"] == pytest.approx(want)
    weights = task_weights([30, 10])
    assert weights[:30].sum() == pytest.approx(weights[30:].sum()) and weights.mean() == 1.0
    wrong = CliRunner().invoke(app, [*args[:2], "mlp", *args[3:], "--overwrite"])
    assert wrong.exit_code != 0 and "actmap-plus" in wrong.output


def test_bad_input_is_refused_by_name(two_tasks, tmp_path):
    from typer.testing import CliRunner

    from actmap.cli import app
    from actmap.experiments.generalist import open_tasks
    from actmap.experiments.out_of_domain import OutOfDomainConfig, leave_one_task_out

    words = two_tasks[0]
    other = tmp_path / "other-generator"
    MapStore.create(other, store_config(LengthTask(9), ModelSource("tiny-2", "tiny-2", None, "0"),
                                        CONFIG, MapConfig(), {})).close()  # fmt: skip
    with pytest.raises(ActmapUserError, match="other-generator.*different generators.*tiny-2"):
        open_tasks([words, other])
    maps = tmp_path / "other-maps"
    MapStore.create(maps, store_config(LengthTask(9), SOURCE, CONFIG, MapConfig(n_segments=1),
                                       {})).close()  # fmt: skip
    with pytest.raises(ActmapUserError, match="other-maps.*different map configurations"):
        open_tasks([words, maps])
    with pytest.raises(ActmapUserError, match="given twice"):
        open_tasks([words, words])
    with pytest.raises(ActmapUserError, match="two or more stores"):
        open_tasks([words])
    # a held-out task without a correct test answer says so in one line; the others still run
    none = capture_store(tmp_path / "none", NoCorrectTestTask(90))
    config = OutOfDomainConfig(mlp=False, tad=False, in_domain=False, curve_k=(), n_resamples=50)
    result = leave_one_task_out([words, none], config, held_out=["no-correct-test"])
    (held,) = result.held_out
    assert held.note.startswith("held out no-correct-test: no correct answer among its")
    assert not held.methods
    out = CliRunner().invoke(
        app, ["out-of-domain", "--store", str(words), "--store", str(other), "--out",
              str(tmp_path / "o")],
    )  # fmt: skip
    assert out.exit_code != 0 and "different generators" in out.output


def test_an_adapted_generalist_recalibrates_refits_and_saves(on_lengths, tmp_path):
    """`adapt_generalist` (what policy fit / train can call on a small store): recalibration is
    sklearn's logistic regression on the generalist's logit; the adapted copy saves and loads
    to the same scores; labels of one class only move the prior."""
    from sklearn.linear_model import LogisticRegression

    from actmap.detectors.stacked import StackedPlus
    from actmap.experiments.out_of_domain import adapt_generalist

    words, _, est = on_lengths
    train, test = (words.inputs(words.sets[s], est.requires) for s in ("train_all", "test_all"))
    # labels the generalist ranks above chance (Platt's slope positive; a negative one moves
    # the prior only, `test_recalibration_never_reverses_the_ranking`)
    z_train = est.decision_function(train)
    noise = np.random.default_rng(0).normal(scale=z_train.std(), size=len(z_train))
    y = (z_train + noise > np.median(z_train)).astype(np.int64)
    adapted = adapt_generalist(est, train, y, "recalibrate")
    platt = LogisticRegression(C=1.0).fit(est.decision_function(train)[:, None], y)
    want = platt.predict_proba(est.decision_function(test)[:, None])[:, 1]
    np.testing.assert_allclose(adapted.predict_proba(test), want, rtol=1e-6)
    assert adapted.calibrated_prevalence_ == pytest.approx(y.mean())
    assert est.calibrated_prevalence_ == 0.5  # the generalist itself is left as it was
    head = adapt_generalist(est, train, y, "head refit")
    assert head.metadata_["adapted"] == {"step": "head refit", "labelled_rows": len(y)}
    loaded = StackedPlus.load(head.save(tmp_path / "adapted"))
    np.testing.assert_allclose(loaded.predict_proba(test), head.predict_proba(test), rtol=1e-6)
    wrong_only = adapt_generalist(est, train, np.zeros_like(y), "head refit")
    assert wrong_only.metadata_["adapted"]["step"] == "recalibrate"
    z = est.decision_function(test)
    np.testing.assert_allclose(wrong_only.decision_function(test) - z, (wrong_only.decision_function(test) - z)[0])  # fmt: skip
    assert wrong_only.decision_function(test)[0] < z[0]  # no correct label: the prior falls


def test_recalibration_never_reverses_the_ranking():
    from actmap.experiments.out_of_domain import recalibration
    from actmap.scoring.prior import logit

    z = np.array([-2.0, -1.0, 0.0, 1.0, 2.0, 3.0])
    assert recalibration(z, np.array([0, 0, 0, 1, 1, 1]), 0.3, 0.5)[0] > 0
    # the one correct answer scored lowest: Platt's slope would be negative; the prior alone
    slope, intercept = recalibration(z, np.array([1, 0, 0, 0, 0, 0]), 0.3, 0.5)
    assert slope == 1.0 and intercept == pytest.approx(logit((1 + 0.6) / 8) - logit(0.5))


def test_choose_step_follows_the_learning_curve():
    """The rule, pinned on hand-made labels: head refit from ten labelled answers of the
    rarer class (whichever it is), recalibration below, and with one class."""
    from actmap.experiments.new_task import HEAD_REFIT_MIN, choose_step

    assert HEAD_REFIT_MIN == 10
    assert choose_step([]) == "recalibrate"
    assert choose_step([1] * 200) == "recalibrate"  # one class: nothing to refit a head on
    assert choose_step([0] * 500) == "recalibrate"
    assert choose_step([1] * 9 + [0] * 500) == "recalibrate"  # 9 correct: too few
    assert choose_step([1] * 10 + [0] * 40) == "head refit"  # 10 correct, 40 incorrect
    assert choose_step([0] * 9 + [1] * 300) == "recalibrate"  # the rare class is incorrect
    assert choose_step([0] * 10 + [1] * 15) == "head refit"  # Qwen-0.5B's built-in task, k=25
    assert choose_step(np.array([True] * 12 + [False] * 12)) == "head refit"  # booleans count


def save_generalist(est, task, folder):
    """A run folder holding ``est`` the way `actmap train --store A --store B` saves one."""
    est.save(
        folder / "seed-0", metadata={"inputs": {"store_config": task.store.manifest["config"]}}
    )
    return folder


def test_train_adapts_a_generalist_to_a_small_store_by_default(on_lengths, two_tasks, tmp_path):
    """``actmap train --store SMALL --generalist RUN`` (no other option): the generalist is
    recalibrated on every labelled train / validation row of the store (the cheapest step,
    `choose_step`: fewer than ten of a class here), which is sklearn's Platt fit on its logit; the run
    serves, and its test rows (never used to adapt) are scored once."""
    import pandas as pd
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import roc_auc_score
    from typer.testing import CliRunner

    from actmap.cli import app
    from actmap.experiments.generalist import concat_stack_rows
    from actmap.scoring.prior import em_prevalence
    from actmap.serve.loaded_run import load_detector_run

    words, lengths, est = on_lengths
    run = save_generalist(est, lengths, tmp_path / "generalist")
    out = tmp_path / "adapted"
    args = ["train", "--store", str(two_tasks[0]), "--generalist", str(run), "--out", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    parts = [words.sets[s] for s in ("train_all", "validation_all")]
    y = np.concatenate([np.asarray(p.labels) for p in parts]).astype(int)
    from actmap.experiments.new_task import HEAD_REFIT_MIN

    assert min(y.sum(), len(y) - y.sum()) < HEAD_REFIT_MIN  # a small store: the recalibration
    assert (
        "adapted by recalibrate on" in result.output and f"{len(y)} labelled rows" in result.output
    )
    loaded = load_detector_run(out).detector
    assert loaded.metadata_["adapted"] == {"step": "recalibrate", "labelled_rows": len(y)}
    assert loaded.metadata_["adapted_run"]["task"] == "words"
    x = concat_stack_rows([words.inputs(p, est.requires) for p in parts])
    test = words.inputs(words.sets["test"], est.requires)
    z = est.decision_function(x)
    platt = LogisticRegression(C=1.0).fit(z[:, None], y)
    if platt.coef_[0, 0] > 0:  # Platt's fit on the generalist's logit is the recalibration
        want = platt.predict_proba(est.decision_function(test)[:, None])[:, 1]
    else:  # it would reverse the ranking (these tiny tasks): the prior alone moves, from EM's
        prior0 = em_prevalence(1 / (1 + np.exp(-z)), 0.5).prevalence
        prior = (y.sum() + 2 * prior0) / (len(y) + 2)
        shifted = est.decision_function(test) + np.log(prior / (1 - prior))
        want = 1 / (1 + np.exp(-shifted))
    np.testing.assert_allclose(loaded.predict_proba(test), want, rtol=1e-5)
    scores = pd.read_parquet(out / "seed-0" / "test_scores.parquet")
    assert list(scores["id"]) == list(words.sets["test"].ids)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["mean"]["auroc"] == pytest.approx(
        roc_auc_score(scores["label"], scores["logit"])
    )
    assert summary["labelled_rows"] == len(y) and summary["step_asked"] == "auto"
    head = CliRunner().invoke(app, [*args, "--adapt", "head refit", "--overwrite"])
    assert head.exit_code == 0, head.output
    assert load_detector_run(out).detector.metadata_["adapted"]["step"] == "head refit"


def test_train_with_a_generalist_refuses_bad_input_by_name(on_lengths, two_tasks, tmp_path):
    from serve_helpers import save_tiny_detector
    from typer.testing import CliRunner

    from actmap.cli import app

    words, lengths, est = on_lengths
    run = save_generalist(est, lengths, tmp_path / "generalist")

    def train(*extra, store=two_tasks[0], generalist=run):
        args = ["train", "--store", str(store), "--generalist", str(generalist), "--out",
                str(tmp_path / "o"), "--overwrite", *extra]  # fmt: skip
        result = CliRunner().invoke(app, args)
        assert result.exit_code != 0
        return result.output

    assert "--adapt must be one of" in train("--adapt", "everything")
    assert "cannot be adapted" in train("--detector", "vit")
    paper = save_tiny_detector(tmp_path / "paper")
    assert "not a stacked actmap-plus" in train(generalist=paper.parent)
    assert "not a run folder" in train(generalist=tmp_path / "nowhere")
    other = tmp_path / "other-generator"
    MapStore.create(other, store_config(LengthTask(9), ModelSource("tiny-2", "tiny-2", None, "0"),
                                        CONFIG, MapConfig(), {})).close()  # fmt: skip
    assert "another generator" in train(store=other) and "tiny-2" in train(store=other)


def test_a_held_out_task_with_too_few_test_rows_is_noted_and_the_others_still_run(
    two_tasks, tmp_path
):
    from actmap.experiments.out_of_domain import OutOfDomainConfig, leave_one_task_out

    few = capture_store(tmp_path / "few", FewCorrectTestTask(90))
    config = OutOfDomainConfig(
        preset="deployable", mlp=False, tad=False, in_domain=False, curve_k=(), n_resamples=50
    )
    result = leave_one_task_out([two_tasks[0], few], config)
    words, noted = result.held_out
    assert words.task == "words" and words.methods and not words.note
    assert noted.task == "few-correct-test" and not noted.methods
    assert noted.note == (
        "held out few-correct-test: 2 balanced test rows (1 of them correct); PRR rejecting "
        "up to 50% needs at least 4"
    )
    assert "held out few-correct-test: 2 balanced test rows" in result.to_markdown()
