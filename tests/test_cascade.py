"""The cascade's arithmetic against hand-computed cases, a brute-force tie rule and a direct
bootstrap loop; its store join and CLI on two tiny stores."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from actmap.errors import ActmapUserError
from actmap.experiments.cascade import (
    measure_cascade,
    oracle_confidence,
    plot_cascade,
    routed_accuracy,
)
from actmap.scoring.intervals import resample_indices

# ten questions: the small model gets 4 right, the large one 7
SMALL = np.array([1, 1, 1, 0, 0, 0, 0, 1, 0, 0])
LARGE = np.array([1, 0, 1, 1, 1, 0, 1, 1, 0, 1])
# a router: rows 5, 3, 8, 1 are its four least confident, in that order
CONF = np.array([0.9, 0.4, 0.8, 0.2, 0.6, 0.1, 0.7, 0.95, 0.3, 0.5])


def test_routed_accuracy_by_hand():
    # 10%: row 5 (0 -> 0): 4/10; 20%: + row 3 (0 -> 1): 5/10; 30%: + row 8 (0 -> 0): 5/10;
    # 40%: + row 1 (1 -> 0): 4/10; 50%: + row 9 (0 -> 1): 5/10; 100%: the large model, 7/10
    for share, expected in [(0, 0.4), (0.1, 0.4), (0.2, 0.5), (0.3, 0.5), (0.4, 0.4),
                            (0.5, 0.5), (1.0, 0.7)]:  # fmt: skip
        assert routed_accuracy(CONF, SMALL, LARGE, share) == pytest.approx(expected), share
    # the oracle: rows 3, 4, 6, 9 (small wrong, large right) first: +1/10 each, then nothing
    oracle = oracle_confidence(SMALL, LARGE)
    assert [routed_accuracy(oracle, SMALL, LARGE, q) for q in (0.2, 0.4, 0.5, 0.9)] == pytest.approx([0.6, 0.8, 0.8, 0.8])  # fmt: skip
    # row 1 (small right, large wrong) is routed last
    assert routed_accuracy(oracle, SMALL, LARGE, 1.0) == pytest.approx(0.7)


def brute_force(conf, small, large, k) -> float:
    """Mean final accuracy over every way of breaking the ties at the routing boundary."""
    order = sorted(range(len(conf)), key=lambda i: conf[i])
    boundary = conf[order[k - 1]]
    sure = [i for i in order if conf[i] < boundary]
    tied = [i for i in order if conf[i] == boundary]
    values = []
    for chosen in itertools.combinations(tied, k - len(sure)):
        routed = set(sure) | set(chosen)
        values.append(np.mean([large[i] if i in routed else small[i] for i in range(len(conf))]))
    return float(np.mean(values))


def test_ties_are_routed_in_proportion():
    tied = np.array([0.1, 0.3, 0.3, 0.3, 0.3, 0.5, 0.5, 0.9, 0.9, 0.9])
    for k in range(1, 11):
        assert routed_accuracy(tied, SMALL, LARGE, k / 10) == pytest.approx(
            brute_force(tied, SMALL, LARGE, k)
        ), k
    # one tie group: random routing's expectation, small + share * (mean gain)
    flat = np.zeros(10)
    for q in (0.1, 0.3, 0.5):
        assert routed_accuracy(flat, SMALL, LARGE, q) == pytest.approx(0.4 + q * 0.3)


def test_measure_cascade_intervals_and_oracle_share():
    result = measure_cascade(
        SMALL, LARGE, {"actmap": CONF, "same": CONF.copy()}, shares=(0.2, 0.5), n_resamples=300
    )
    assert result.n == 10 and result.small_accuracy == 0.4 and result.large_accuracy == 0.7
    assert result.counts == {"both_right": 3, "small_only": 1, "large_only": 4, "both_wrong": 2}
    assert result.routers == ["actmap", "same", "random", "oracle"]
    at = result.point("actmap", 0.2)
    assert at.routed == 2 and at.accuracy.estimate == pytest.approx(0.5)
    # share of the oracle's gain: (0.5 - 0.4) / (0.6 - 0.4) at 20%; (0.5 - .4) / (.8 - .4) at 50%
    assert at.oracle_gain_share.estimate == pytest.approx(0.5)
    assert result.point("actmap", 0.5).oracle_gain_share.estimate == pytest.approx(0.25)
    assert result.point("oracle", 0.5).oracle_gain_share.estimate == pytest.approx(1.0)
    assert result.point("random", 0.2).accuracy.estimate == pytest.approx(0.46)
    # the same router, paired: a difference of exactly zero on every resample
    same = result.point("same", 0.2).vs_reference
    assert (same.estimate, same.low, same.high) == (0.0, 0.0, 0.0)
    assert result.point("actmap", 0.2).vs_reference is None
    # the interval is the percentile interval of the naive formula on the same resamples
    idx, _ = resample_indices(SMALL, 300, np.random.default_rng(0), need_both=True)
    values = []
    for rows in idx:
        c, s, g = CONF[rows], SMALL[rows], LARGE[rows]
        values.append(brute_force(c, s, g, 2))
    low, high = np.percentile(values, [2.5, 97.5])
    assert at.accuracy.low == pytest.approx(low) and at.accuracy.high == pytest.approx(high)
    diff = result.point("random", 0.2).vs_reference
    naive = []
    for rows in idx:
        c, s, g = CONF[rows], SMALL[rows], LARGE[rows]
        naive.append(brute_force(c, s, g, 2) - (s.mean() + 0.2 * (g - s).mean()))
    assert diff.low == pytest.approx(np.percentile(naive, 2.5))
    assert diff.high == pytest.approx(np.percentile(naive, 97.5))
    # AUROC for each model's correctness, against sklearn
    from sklearn.metrics import roc_auc_score

    assert result.aurocs["actmap"]["small"] == pytest.approx(roc_auc_score(SMALL, CONF))
    assert result.aurocs["actmap"]["large"] == pytest.approx(roc_auc_score(LARGE, CONF))
    assert set(result.aurocs) == {"actmap", "same"}
    text = result.to_markdown()
    assert "| actmap | 0.500 [" in text and "small alone 0.400, large alone 0.700" in text
    assert json.loads(json.dumps(result.to_json()))["points"][0]["accuracy"]["estimate"] == 0.5


def test_bad_input_is_named():
    with pytest.raises(ActmapUserError, match="must be \\(n,\\) each"):
        measure_cascade(SMALL, LARGE, {"x": CONF[:5]})
    with pytest.raises(ActmapUserError, match="NaN or inf"):
        measure_cascade(SMALL, LARGE, {"x": np.where(CONF > 0.5, np.nan, CONF)})
    with pytest.raises(ActmapUserError, match="right and wrong"):
        measure_cascade(np.ones(10), LARGE, {})
    with pytest.raises(ActmapUserError, match="share must lie in"):
        routed_accuracy(CONF, SMALL, LARGE, 1.5)
    with pytest.raises(ActmapUserError, match="large correctness must be 0 or 1"):
        measure_cascade(SMALL, LARGE * 2, {"x": CONF})


def test_plot(tmp_path):
    result = measure_cascade(SMALL, LARGE, {"actmap": CONF}, n_resamples=50)
    path = plot_cascade(result, tmp_path / "cascade.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


# -- from two captured stores ------------------------------------------------------------------


def captured_store(root, model, tokenizer, correct, sizes, seed=0):
    """A store captured by ``model`` over fixed questions; ``correct(split, i)`` labels row i."""
    from conftest import ListTask

    from actmap.capture import CaptureConfig
    from actmap.capture.run import run_capture, store_config
    from actmap.data.base import Example
    from actmap.llm.models import ModelSource
    from actmap.maps import MapConfig
    from actmap.store import MapStore

    words = "what is the capital of the river red blue green one two three".split()
    rng = np.random.default_rng(seed)
    examples = [
        Example(source_key=f"q{split}{i}", dataset="list", split=split,
                question=" ".join(rng.choice(words, size=4)), references=(),
                meta={"correct": str(int(correct(split, i)))})
        for split, n in sizes.items() for i in range(n)
    ]  # fmt: skip
    task = ListTask(examples)
    config = CaptureConfig(max_new_tokens=4, batch_size=8)
    source = ModelSource("tiny", "tiny", None, "0")
    store = MapStore.create(root, store_config(task, source, config, MapConfig(), {}))
    run_capture(model, tokenizer, source, task, task.examples, store, config)
    return MapStore.open(root)


def test_cascade_from_stores_and_cli(tmp_path, tiny_llama, word_tokenizer):
    from conftest import make_tiny_llama
    from serve_helpers import save_tiny_detector
    from typer.testing import CliRunner

    from actmap.capture.from_store import read_generations
    from actmap.cli import app
    from actmap.experiments.cascade import cascade_inputs
    from actmap.serve.loaded_run import load_detector_run

    small = captured_store(tmp_path / "small", tiny_llama, word_tokenizer,
                           lambda s, i: i % 3 == 0, {"train": 12, "validation": 6, "test": 12})  # fmt: skip
    large_model = make_tiny_llama(len(word_tokenizer), seed=4)
    # the large model answered only the first 9 test questions (a --limit), right on i % 2 == 0
    large = captured_store(tmp_path / "large", large_model, word_tokenizer,
                           lambda s, i: i % 2 == 0, {"test": 9})  # fmt: skip
    save_tiny_detector(tmp_path / "run")
    inputs = cascade_inputs(small, large, tmp_path / "run", "test", ["perplexity", "answer_length"])
    both = set(small.metadata()["id"]) & set(large.metadata()["id"])  # answers both gave
    assert sorted(inputs.ids) == sorted(both) and len(both) >= 7
    assert both <= {f"list:qtest{i}" for i in range(9)}
    index = {key: int(key.rsplit("qtest", 1)[1]) for key in inputs.ids}
    assert inputs.small.tolist() == [float(index[k] % 3 == 0) for k in inputs.ids]
    assert inputs.large.tolist() == [float(index[k] % 2 == 0) for k in inputs.ids]
    # actmap: the run's detector on the stored maps; perplexity: the mean answer log-prob
    maps, _ = small.load_maps(inputs.ids)
    detector = load_detector_run(tmp_path / "run")
    assert inputs.routers["actmap"] == pytest.approx(detector.predict_proba(maps, None), abs=1e-6)
    gens = read_generations(small, inputs.ids)
    assert inputs.routers["perplexity"] == pytest.approx(
        [float(np.asarray(g.logprobs, dtype=np.float64)[: g.n_tokens].mean()) for g in gens]
    )
    assert set(inputs.routers) == {"actmap", "perplexity", "answer_length"}
    result = CliRunner().invoke(app, [
        "cascade", "--small-store", str(small.root), "--large-store", str(large.root),
        "--run", str(tmp_path / "run"), "--out", str(tmp_path / "out"),
        "--baselines", "perplexity,rauq", "--resamples", "50",
    ])  # fmt: skip
    assert result.exit_code == 0, result.output
    written = json.loads((tmp_path / "out" / "cascade.json").read_text())
    assert written["n"] == len(both) and "rauq" in written["about"]["unavailable"]
    assert (tmp_path / "out" / "cascade.png").stat().st_size > 10_000
    # no question in common (the large model answered no train question): one line, exit 2
    bad = CliRunner().invoke(app, [
        "cascade", "--small-store", str(small.root), "--large-store", str(large.root),
        "--split", "train", "--out", str(tmp_path / "o2"),
    ])  # fmt: skip
    assert bad.exit_code == 2 and "holds no labelled row of the" in bad.output
    assert not (tmp_path / "o2").exists()
