"""The separate judging pass: labels from a judge, resumable, the source store untouched."""

from __future__ import annotations

import json

import numpy as np
import pytest

from actmap.capture import CaptureConfig
from actmap.capture.run import run_capture, store_config
from actmap.data.datasets import CNNDMTask
from actmap.data.factuality import split_sentences
from actmap.errors import ActmapUserError
from actmap.labelling.judge_pass import (
    JUDGMENTS,
    claim_pairs,
    judge_check,
    judge_store,
    judged_labels,
)
from actmap.llm.models import ModelSource
from actmap.maps import MapConfig
from actmap.store import MapStore, StoreError

WORDS = "the capital of river red blue green one two three paris rome".split()
SOURCE = ModelSource("tiny", "tiny", None, "0")


def supported(claim: str) -> bool:
    return claim.split()[0] < "n"  # about half of the word list


class FirstWordJudge:
    """Supports a sentence iff its first word sorts before "n"; counts calls."""

    name = "first-word"

    def __init__(self):
        self.calls = 0

    def support_probability(self, document: str, claim: str) -> float:
        self.calls += 1
        return 0.9 if supported(claim) else 0.1


@pytest.fixture
def summary_store(tmp_path, tiny_llama, word_tokenizer):
    rng = np.random.default_rng(0)
    folder = tmp_path / "data" / "cnn_dm"
    folder.mkdir(parents=True)
    rows = [
        {"id": f"t{i}", "article": " ".join(rng.choice(WORDS, 6)), "highlights": "one ."}
        for i in range(10)
    ]
    (folder / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "validation.jsonl").write_text(
        json.dumps({"id": "v0", "article": "red", "highlights": "red ."}) + "\n"
    )
    task = CNNDMTask(tmp_path / "data")
    config = CaptureConfig(max_new_tokens=6, batch_size=4)
    store = MapStore.create(
        tmp_path / "cnn", store_config(task, SOURCE, config, MapConfig(), keep={})
    )
    run_capture(tiny_llama, word_tokenizer, SOURCE, task, task.load("test"), store, config)
    return store


def test_judging_labels_every_summary_and_resumes(summary_store, tmp_path):
    assert summary_store.metadata()["label"].isna().all()  # captured without a judge
    judge = FirstWordJudge()
    partial = judge_store(summary_store, tmp_path / "judged", judge, batch_size=3, limit=4)
    meta = partial.metadata().set_index("id")
    assert meta["label"].notna().sum() == 4 and len(meta) == 10  # the rest wait, as None
    first_calls = judge.calls
    restored, advanced = [], []
    judged = judge_store(
        summary_store, tmp_path / "judged", judge, batch_size=3,
        progress=advanced.append, resumed=restored.append,
    )  # fmt: skip
    assert restored == [4] and advanced == [3, 3]  # the judged 4 apart from this call's 6
    labels = judged.metadata().set_index("id")["label"]
    # independent reference: the all-sentences rule applied by hand to the stored texts
    gens = summary_store.read_table("generations").to_pandas().set_index("id")
    for key, label in labels.items():
        sentences = split_sentences(gens.at[key, "label_text"])
        assert label == int(bool(sentences) and all(supported(s) for s in sentences))
    assert len(judged_labels(judged)) == 10
    assert 0 < labels.sum() < 10  # both labels occur, so the comparison can fail
    # the second call judged only the six remaining summaries, stopping at unsupported ones
    assert judge.calls - first_calls <= sum(
        len(split_sentences(gens.at[k, "label_text"])) for k in labels.index[4:]
    )
    assert len(judged.read_table(JUDGMENTS)) == 10  # nothing judged twice
    assert summary_store.metadata()["label"].isna().all()  # the source is untouched
    assert judged.manifest["config"]["task"]["judge"] == "first-word"
    assert judged.has_table("generations") and judged.has_table("maps")


def test_judging_up_to_a_total_stops_a_resumed_pass_there(summary_store, tmp_path):
    """``up_to`` counts the summaries judged over every call; ``limit`` counts this call's."""
    judge, out = FirstWordJudge(), tmp_path / "judged"
    judge_store(summary_store, out, judge, batch_size=3, limit=4, up_to=6)
    restored, advanced = [], []
    judged = judge_store(
        summary_store, out, judge, batch_size=3, up_to=6,
        progress=advanced.append, resumed=restored.append,
    )  # fmt: skip
    assert restored == [4] and advanced == [2]  # two more make six
    assert len(judged_labels(judged)) == 6 and len(judged.read_table(JUDGMENTS)) == 6
    calls = judge.calls
    again = judge_store(summary_store, out, judge, up_to=6, progress=advanced.append)
    assert judge.calls == calls and len(judged_labels(again)) == 6  # nothing left to judge
    # the first six summaries in the source's order, as one call of six would have chosen
    order = summary_store.read_latest("generations", ["label_text"]).column("id").to_pylist()
    assert sorted(judged_labels(again)) == sorted(order[:6])


def test_a_labelling_with_nothing_new_leaves_the_store_as_it_was(
    summary_store, tmp_path, monkeypatch
):
    """A finished labelling called again rewrites no maps, so the store's manifest (what a
    copy of it is checked against) stays the same; judgments committed by a pass killed
    before its rewrite still reach the maps on the next call."""
    out = tmp_path / "judged"
    judge_store(summary_store, out, FirstWordJudge(), up_to=6)
    manifest = (out / "manifest.json").read_text()
    shards = MapStore.open(out).shards("maps")
    again = judge_store(summary_store, out, FirstWordJudge(), up_to=6)
    assert (out / "manifest.json").read_text() == manifest
    assert again.shards("maps") == shards and all(shard.exists() for shard in shards)

    def killed(*args):
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr("actmap.labelling.judge_pass.write_labelled_copy", killed)
        with pytest.raises(KeyboardInterrupt):
            judge_store(summary_store, out, FirstWordJudge())  # judges the last four
    assert len(judged_labels(MapStore.open(out))) == 10
    assert MapStore.open(out).metadata()["label"].isna().sum() == 4  # maps not rewritten
    resumed = judge_store(summary_store, out, FirstWordJudge())
    assert resumed.metadata()["label"].notna().all() and resumed.shards("maps") != shards


def test_a_lazy_judge_loads_only_when_a_summary_is_left_to_judge(summary_store, tmp_path):
    """A resumed labelling with nothing left answers without loading its judge; one with
    work loads it once, and a loaded judge under another name is refused."""
    from actmap.data.factuality import LazyJudge

    out = tmp_path / "judged"
    judge_store(summary_store, out, FirstWordJudge(), up_to=6)
    loads = []

    def load():
        loads.append(1)
        return FirstWordJudge()

    lazy = LazyJudge("first-word", load)
    judge_store(summary_store, out, lazy, up_to=6)
    assert not lazy.loaded and loads == []
    judged = judge_store(summary_store, out, lazy)
    assert lazy.loaded and loads == [1] and len(judged_labels(judged)) == 10
    other = LazyJudge("another-judge", FirstWordJudge)
    with pytest.raises(ValueError, match="named 'first-word', not 'another-judge'"):
        other.support_probability("a document", "a claim")


def test_judging_refuses_a_store_that_is_not_summaries(tmp_path):
    store = MapStore.create(tmp_path / "qa", {"task": {"task": "triviaqa"}})
    with pytest.raises(StoreError, match="cnn_dm"):
        judge_store(store, tmp_path / "out", FirstWordJudge())


# ---------------------------------------------------------------- judge check


class OverlapJudge:
    """Support = share of the claim's words found in the document; counts calls."""

    name = "overlap"

    def __init__(self):
        self.calls = 0

    def support_probability(self, document: str, claim: str) -> float:
        self.calls += 1
        words = claim.lower().split()
        return sum(w in document.lower().split() for w in words) / len(words)


def article_rows(n: int):
    from actmap.data.datasets import SourceRow

    rng = np.random.default_rng(1)
    vocab = [f"w{i}" for i in range(200)]
    rows = []
    for i in range(n):
        article = " ".join(rng.choice(vocab, 30))
        own = " ".join(article.split()[:3])
        rows.append(SourceRow(f"a{i}", "train", article, (f"{own} . Second line .",), {}))
    return rows


def test_claim_pairs_take_the_negative_from_another_article():
    rows = article_rows(12)
    pairs = claim_pairs(rows, 8, seed=3)
    assert len(pairs) == 8 and len({p.article_id for p in pairs}) == 8
    by_id = {r.source_key: r for r in rows}
    for p in pairs:
        assert p.negative_from != p.article_id
        assert p.positive == split_sentences(by_id[p.article_id].references[0])[0]
        assert p.negative == split_sentences(by_id[p.negative_from].references[0])[0]
    assert claim_pairs(rows, 8, seed=3) == pairs  # seeded
    assert len(claim_pairs(rows, 50)) == 12  # capped at the articles there are


def test_judge_check_metrics_match_sklearn_and_resume(tmp_path):
    from sklearn.metrics import roc_auc_score

    pairs = claim_pairs(article_rows(20), 20)
    judge = OverlapJudge()
    first = judge_check(judge, pairs[:7], tmp_path)
    assert judge.calls == 14 and first.pairs == 7
    restored, advanced = [], []
    result = judge_check(judge, pairs, tmp_path, progress=advanced.append, resumed=restored.append)
    assert judge.calls == 40  # the 7 cached pairs are not scored again
    assert restored == [7] and advanced == [1] * 13
    support = [judge.support_probability(p.article, c) for p in pairs for c in (p.positive,)]
    support += [judge.support_probability(p.article, p.negative) for p in pairs]
    labels = [1] * 20 + [0] * 20
    assert result.auroc.estimate == pytest.approx(roc_auc_score(labels, support))
    expected = np.mean([(s >= 0.5) == bool(y) for s, y in zip(support, labels, strict=True)])
    assert result.accuracy == pytest.approx(expected)
    assert result.claims == 40 and result.seconds_per_claim >= 0
    assert result.auroc.low <= result.auroc.estimate <= result.auroc.high


def test_judge_check_extended_to_more_pairs_rescores_a_pair_whose_negative_changed(tmp_path):
    rows = article_rows(20)
    small, large = claim_pairs(rows, 7), claim_pairs(rows, 20)
    assert large[:6] == small[:6] and large[6].negative_from != small[6].negative_from
    judge = OverlapJudge()
    judge_check(judge, small, tmp_path)
    judge_check(judge, large, tmp_path)
    assert judge.calls == 14 + 2 * 14  # 13 new pairs and the 7th again, with its new negative
    saved = json.loads((tmp_path / "judge-check.json").read_text())["items"]
    assert [i["negative_from"] for i in saved] == [p.negative_from for p in large]


def test_judge_check_refuses_a_cache_of_another_judge(tmp_path):
    pairs = claim_pairs(article_rows(4), 4)
    judge_check(OverlapJudge(), pairs, tmp_path)
    other = FirstWordJudge()
    with pytest.raises(ActmapUserError, match="holds judge 'overlap'"):
        judge_check(other, pairs, tmp_path)


def judge_model_dir(tmp_path):
    """A tiny random Llama whose word vocabulary has "Yes" and "No", saved as a model folder."""
    from test_factuality import WORDS as JUDGE_WORDS
    from test_factuality import word_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(JUDGE_WORDS),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    folder = tmp_path / "judge-model"
    LlamaForCausalLM(config).save_pretrained(folder)
    word_tokenizer().save_pretrained(folder)
    return folder


def test_cli_judge_check_runs_a_real_causal_lm_judge(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from actmap.cli import app

    tiny_model_dir = judge_model_dir(tmp_path)

    folder = tmp_path / "data" / "cnn_dm"
    folder.mkdir(parents=True)
    rows = [
        {"id": f"v{i}", "article": " ".join(WORDS[i % 5 :]), "highlights": f"{WORDS[i]} ."}
        for i in range(6)
    ]
    (folder / "validation.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "test.jsonl").write_text(json.dumps(rows[0] | {"id": "t0"}) + "\n")
    out = tmp_path / "check"
    args = ["judge", "check", "--judge", str(tiny_model_dir), "--pairs", "4", "--out", str(out)]
    result = CliRunner().invoke(app, [*args, "--data-dir", str(tmp_path / "data")])
    assert result.exit_code == 0, result.output
    written = json.loads((out / "check.json").read_text())
    assert written["pairs"] == 4 and written["claims"] == 8
    assert 0.0 <= written["auroc"]["estimate"] <= 1.0
    # a finished check answers again from its cache without loading the judge
    from actmap.data.factuality import LLMFactualityJudge

    def refuse(*args, **kwargs):
        raise AssertionError("a finished check loaded its judge")

    monkeypatch.setattr(LLMFactualityJudge, "from_pretrained", refuse)
    again = CliRunner().invoke(app, [*args, "--data-dir", str(tmp_path / "data")])
    assert again.exit_code == 0, again.output
    assert "loading judge" not in again.output
    assert json.loads((out / "check.json").read_text()) == written
    missing = [*args[:3], str(tmp_path / "nowhere.gguf"), *args[4:]]
    lost = CliRunner().invoke(app, [*missing, "--data-dir", str(tmp_path / "data")])
    assert lost.exit_code != 0 and "nowhere.gguf" in lost.output
    bare = CliRunner().invoke(app, ["judge", "--store", str(tmp_path)])
    assert bare.exit_code != 0 and "--judge" in bare.output


def test_a_bfloat16_judge_names_its_dtype_and_agrees_with_float32(tmp_path):
    """bfloat16 weights (the CPU's fast path) give the judge its own name, so its labels and
    checks never mix with float32 ones, and support probabilities within bfloat16's precision."""
    import torch
    from test_factuality import WORDS as JUDGE_WORDS

    from actmap.data.factuality import load_factuality_judge

    folder = judge_model_dir(tmp_path)
    full = load_factuality_judge(str(folder))
    half = load_factuality_judge(str(folder), "bfloat16")
    assert full.name == "llm:judge-model" and half.name == "llm:judge-model@bfloat16"
    # a lazy judge knows the loaded judge's name before loading it
    assert load_factuality_judge(str(folder), lazy=True).name == full.name
    assert load_factuality_judge(str(folder), "bfloat16", lazy=True).name == half.name
    assert {p.dtype for p in half.model.parameters()} == {torch.bfloat16}
    document, claim = " ".join(JUDGE_WORDS[:8]), " ".join(JUDGE_WORDS[2:5])
    p32, p16 = full.support_probability(document, claim), half.support_probability(document, claim)
    assert 0.0 < p16 < 1.0 and p16 == pytest.approx(p32, abs=0.02)
    with pytest.raises(ActmapUserError, match="judge dtype must be one of"):
        load_factuality_judge(str(folder), "int8")
