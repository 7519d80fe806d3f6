"""Serving actmap-plus: the server captures the grey-box statistics the detector reads and scores
every answer from its map and its six per-answer scalars (through FastAPI's TestClient)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytest.importorskip("fastapi")
from serve_helpers import (  # noqa: E402
    client_for,
    reference,
    save_tiny_detector,
    save_tiny_plus,
    tiny_engine,
)

import actmap.serve.engine as engine_module  # noqa: E402
from actmap.capture import CaptureConfig  # noqa: E402
from actmap.capture.answer_scalars import answer_scalars  # noqa: E402
from actmap.detectors import DetectorInputs
from actmap.detectors.plus import ActMapPlus  # noqa: E402
from actmap.errors import ActmapUserError  # noqa: E402
from actmap.maps import build_map, stored_form  # noqa: E402

PROMPT = "what is the capital of paris"


@pytest.fixture(scope="module")
def plus_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("plus-run")
    save_tiny_plus(folder)
    return folder


def test_served_p_correct_reads_the_map_and_the_scalars_of_the_same_pass(plus_run):
    with client_for(plus_run) as client:
        body = {"model": "tiny", "messages": [{"role": "user", "content": PROMPT}]}
        out = client.post("/v1/chat/completions", json=body).json()
        engine = client.app.state.actmap.engine
    gen, p_raw = reference(engine, engine.render_chat(body["messages"]))
    assert gen.n_tokens > 1  # the scalars of a real answer, not a one-token corner
    assert out["choices"][0]["message"]["content"] == gen.answer
    assert out["actmap"]["detector"].startswith("actmap-plus:")
    assert out["actmap"]["p_correct_raw"] == pytest.approx(p_raw, rel=1e-6)
    # the scalars matter: the same map with another answer's statistics scores differently
    plus = ActMapPlus.load(engine.detector.path)
    stored = stored_form(build_map(gen.trajectory))[None]
    own = answer_scalars(gen.logprobs, gen.entropies)[None]
    other = answer_scalars(gen.logprobs[:1] - 3.0, gen.entropies[:1])[None]
    assert abs(plus.decision_function(stored, other) - plus.decision_function(stored, own)) > 0.1


def test_running_scores_use_the_prefix_scalars(plus_run):
    with client_for(plus_run) as client:
        body = {
            "model": "tiny",
            "prompt": PROMPT,
            "stream": True,
            "actmap": {"stream_scores": True},
        }
        text = client.post("/v1/completions", json=body).text
        engine = client.app.state.actmap.engine
    events = [json.loads(x[6:]) for x in text.split("\n") if x.startswith("data: {")]
    running = [e["actmap"] for e in events if e.get("actmap") and "decision" not in e["actmap"]]
    gen, p_final = reference(engine, PROMPT)
    assert [r["n_tokens"] for r in running] == list(range(1, gen.n_tokens + 1))
    for r in running:
        _, expected = reference(engine, PROMPT, n_tokens=r["n_tokens"])
        assert r["p_correct"] == pytest.approx(expected, rel=1e-5)
    assert events[-1]["actmap"]["p_correct_raw"] == pytest.approx(p_final, rel=1e-6)


def test_capture_is_grey_box_exactly_when_the_detector_reads_scalars(
    plus_run, tmp_path, monkeypatch
):
    seen = []
    real = engine_module.generate_batch

    def spy(model, tokenizer, prompts, config, *args, **kwargs):
        seen.append(config.greybox)
        return real(model, tokenizer, prompts, config, *args, **kwargs)

    monkeypatch.setattr(engine_module, "generate_batch", spy)
    maps_only = tmp_path / "logreg"
    save_tiny_detector(maps_only)
    for run, greybox in ((plus_run, True), (maps_only, False)):
        with client_for(run) as client:
            # an early stop trims the answer: in map-only capture it has no log-probs to trim
            body = {"model": "tiny", "prompt": PROMPT, "actmap": {"abort_below": 1.0}}
            out = client.post("/v1/completions", json=body).json()
        assert out["actmap"]["decision"] == "abstain_early", out
        assert out["usage"]["completion_tokens"] == 1
        assert seen[-1] is greybox


def test_audit_rescore_reproduces_actmap_plus_scores(plus_run, tmp_path):
    from actmap.serve.audit import AuditTrail, open_audit_store, rescore
    from actmap.serve.loaded_run import load_detector_run

    root = tmp_path / "audit"
    factory = lambda: tiny_engine(plus_run, audit=AuditTrail(root, flush_interval_s=0.05))  # noqa: E731
    with client_for(plus_run, factory) as client:
        prompts = ["what is the capital of rome", "how many days", "red blue green"]
        bodies = [
            client.post("/v1/completions", json={"model": "tiny", "prompt": p}).json()
            for p in prompts
        ]
    ids = [b["actmap"]["map_id"] for b in bodies]
    scores = rescore(open_audit_store(root), load_detector_run(plus_run)).set_index("id")
    served = [b["actmap"]["p_correct_raw"] for b in bodies]
    np.testing.assert_allclose(scores.loc[ids, "p_correct_raw_new"], served, rtol=1e-6)
    # an audit store written by a maps-only detector has no scalars to rescore with
    other = tmp_path / "audit-maps-only"
    logreg = tmp_path / "logreg"
    save_tiny_detector(logreg)
    factory = lambda: tiny_engine(logreg, audit=AuditTrail(other, flush_interval_s=0.05))  # noqa: E731
    with client_for(logreg, factory) as client:
        client.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT})
    with pytest.raises(ActmapUserError, match="no per-answer scalars"):
        rescore(open_audit_store(other), load_detector_run(plus_run))


@pytest.fixture(scope="module")
def captured(tmp_path_factory, tiny_llama, word_tokenizer):
    """A tiny captured store (maps, generations, trajectories) and an actmap-plus fit on it."""
    from test_baselines_runner import SOURCE, AlternatingTask

    from actmap.capture.run import run_capture, store_config
    from actmap.detectors.plus import PlusConfig
    from actmap.experiments.compare_product import store_rows
    from actmap.maps import MapConfig
    from actmap.store import MapStore

    task = AlternatingTask()
    config = CaptureConfig(max_new_tokens=5, batch_size=8)
    root = tmp_path_factory.mktemp("plus-store") / "store"
    store = MapStore.create(root, store_config(task, SOURCE, config, MapConfig(), {}))
    run_capture(
        tiny_llama, word_tokenizer, SOURCE, task, task.examples, store, config,
        keep_trajectories=True,
    )  # fmt: skip
    train = store_rows(store)["train_all"]
    plus = ActMapPlus(PlusConfig(n_components=3, n_strengths=2, cv_folds=2))
    plus.fit(DetectorInputs(train.maps, train.scalars), train.labels).save(
        root.parent / "run" / "seed-0"
    )
    return store, root.parent / "run"


def test_policy_fit_and_running_auroc_read_the_stores_scalars(captured):
    from sklearn.metrics import roc_auc_score

    from actmap.capture.answer_scalars import scalars_from_store
    from actmap.capture.from_store import read_generations
    from actmap.serve.fit import balanced_scores, natural_scores
    from actmap.serve.loaded_run import load_detector_run
    from actmap.serve.streaming import running_auroc
    from actmap.store import decode_array

    store, run = captured
    detector = load_detector_run(run)
    assert detector.requires == ("maps", "scalars")
    plus = ActMapPlus.load(run / "seed-0")
    for scores in (
        natural_scores(store, detector, "test"),
        balanced_scores(store, detector, "test"),
    ):
        maps, _ = store.load_maps(scores.ids)
        expected = plus.predict_proba(maps, scalars_from_store(store, scores.ids))
        np.testing.assert_allclose(scores.p_raw, expected, rtol=1e-9)
    # running AUROC: at each position k, the prefix map and the prefix's scalars (naive loop)
    result = running_auroc(store, detector, split="test", positions=[1, 2])
    ids = natural_scores(store, detector, "test").ids
    gens = read_generations(store, ids)
    labels = natural_scores(store, detector, "test").labels
    table = store.read_latest("trajectories")
    at = {key: i for i, key in enumerate(table.column("id").to_pylist())}
    trajectories = [
        torch.from_numpy(
            decode_array(
                table.column("trajectory")[at[k]].as_py(), table.column("shape")[at[k]].as_py()
            ).astype(np.float32)
        )
        for k in ids
    ]
    for position in result.positions:
        scores = []
        for g, trajectory in zip(gens, trajectories, strict=True):
            n = min(position.position, g.n_tokens)
            prefix = stored_form(build_map(trajectory[:, :n]))[None]
            scalars = answer_scalars(g.logprobs[:n], g.entropies[:n])[None]
            scores.append(plus.predict_proba(prefix, scalars)[0])
        assert position.auroc == pytest.approx(roc_auc_score(labels, scores), abs=1e-9)
