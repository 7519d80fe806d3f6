"""The HTTP server through FastAPI's TestClient, with a tiny random Llama and a fitted detector."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

pytest.importorskip("fastapi")
from serve_helpers import (  # noqa: E402
    client_for,
    reference,
    save_tiny_detector,
    tiny_engine,
)

from actmap.maps import build_map, stored_form  # noqa: E402
from actmap.scoring.prior import shift_to_prevalence  # noqa: E402
from actmap.serve.policy import Policy, PriorSetting, decide  # noqa: E402

PROMPT = "what is the capital of paris"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("run")
    save_tiny_detector(folder)
    return folder


@pytest.fixture(scope="module")
def client(run):
    with client_for(run) as c:
        yield c


def chat(client, content=PROMPT, **fields):
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}], **fields}
    return client.post("/v1/chat/completions", json=body)


def test_chat_completion_carries_actmap_block(client):
    response = chat(client)
    assert response.status_code == 200, response.text
    body = response.json()
    engine = client.app.state.actmap.engine
    gen, p_raw = reference(engine, engine.render_chat([{"role": "user", "content": PROMPT}]))
    assert body["object"] == "chat.completion" and body["model"] == "tiny"
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": gen.answer}
    assert choice["finish_reason"] == ("stop" if gen.stopped else "length")
    assert body["usage"] == {
        "prompt_tokens": gen.prompt_tokens,
        "completion_tokens": gen.n_tokens,
        "total_tokens": gen.prompt_tokens + gen.n_tokens,
    }
    block = body["actmap"]
    assert block["p_correct_raw"] == pytest.approx(p_raw, abs=1e-6)
    assert block["p_correct"] == block["p_correct_raw"]  # default policy: no prior correction
    assert block["decision"] == decide(block["p_correct"], Policy())
    assert block["detector"].startswith("logreg:") and block["map_id"] is None


def test_completion_with_known_prior_and_stop(run):
    policy = Policy(accept=0.9, review=0.6, route=0.3, prior=PriorSetting("known", 0.2))
    with client_for(run, lambda: tiny_engine(run, policy)) as client:
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8}
        response = client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        out = response.json()
        gen, p_raw = reference(client.app.state.actmap.engine, PROMPT, 8)
        assert out["object"] == "text_completion" and out["choices"][0]["text"] == gen.answer
        block = out["actmap"]
        assert block["p_correct_raw"] == pytest.approx(p_raw, abs=1e-6)
        assert block["p_correct"] == pytest.approx(shift_to_prevalence([p_raw], 0.2)[0], abs=1e-6)
        assert block["decision"] == decide(block["p_correct"], policy)
        # a stop string ends the answer before it, as in capture
        words = gen.answer.split()
        assert len(words) > 1  # the tiny model's answer here has several words
        stopped = client.post("/v1/completions", json={**body, "stop": [" " + words[1]]})
        assert stopped.json()["choices"][0]["text"] == words[0]
        assert stopped.json()["choices"][0]["finish_reason"] == "stop"


def test_models_health_metrics(client):
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "tiny"
    health = client.get("/health").json()
    assert health["status"] == "ok" and health["detector"].startswith("logreg:")
    chat(client)
    metrics = client.get("/metrics")
    assert metrics.headers["content-type"].startswith("text/plain")
    text = metrics.text
    assert 'actmap_requests_total{endpoint="chat",status="200"}' in text
    assert "actmap_p_correct_bucket" in text and "actmap_decisions_total" in text
    assert "actmap_batch_generation_seconds_count" in text


@pytest.mark.parametrize(
    "fields, status, message",
    [
        ({"messages": []}, 400, "messages must not be empty"),
        ({"messages": [{"role": "user", "content": "  "}]}, 400, "messages hold no text"),
        ({"model": "gpt-4"}, 404, "The model 'gpt-4' does not exist; this server serves 'tiny'"),
        ({"max_tokens": -3}, 400, "max_tokens must be at least 1, got -3"),
        ({"max_tokens": 0}, 400, "max_tokens must be at least 1, got 0"),
        ({"max_tokens": 17}, 400, "max_tokens=17 exceeds this server's cap of 16"),
        ({"temperature": 0.7}, 400, "temperature must be 0 or omitted, got 0.7"),
        ({"n": 2}, 400, "n must be 1, got 2"),
        ({"top_p": 0.5}, 400, "top_p must be 1 or omitted, got 0.5"),
        ({"stop": ["a", ""]}, 400, "stop must be at most 4 non-empty strings"),
        ({"messages": "hello"}, 400, "invalid request: messages: Input should be a valid list"),
        ({"actmap": {"abort_below": 2}}, 400, "invalid request: actmap.abort_below"),
        ({"actmap": {"unknown": 1}}, 400, "invalid request: actmap.unknown"),
    ],
)
def test_bad_requests_get_clear_json_errors(client, fields, status, message):
    body = {"model": "tiny", "messages": [{"role": "user", "content": PROMPT}], **fields}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == status
    error = response.json()["error"]
    assert error["message"].startswith(message), error
    assert error["type"]


def test_over_long_prompt_and_bad_json(client):
    long = " ".join(["the"] * 70)  # 70 tokens > the tiny engine's 64-token context
    response = client.post("/v1/completions", json={"model": "tiny", "prompt": long})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert error["message"] == (
        "the prompt has 70 tokens; with max_tokens=5 that exceeds this model's context of 64 tokens"
    )
    response = client.post(
        "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert response.status_code == 400 and "invalid request" in response.json()["error"]["message"]
    response = client.post("/v1/completions", json={"model": "tiny", "prompt": ""})
    assert response.json()["error"]["message"] == "prompt must not be empty"
    assert client.get("/v1/nothing").status_code == 404


def test_auth_and_body_limit(run):
    with client_for(run, api_key="s3cret", max_body_bytes=2000) as client:
        assert client.get("/health").status_code == 200  # open for load balancers
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            response = client.post(
                "/v1/completions", json={"model": "tiny", "prompt": PROMPT}, headers=headers
            )
            assert response.status_code == 401
            assert response.json()["error"]["code"] == "invalid_api_key"
        ok = {"Authorization": "Bearer s3cret"}
        assert client.get("/v1/models", headers=ok).status_code == 200
        assert client.get("/metrics").status_code == 401
        response = client.post(
            "/v1/completions", json={"model": "tiny", "prompt": PROMPT}, headers=ok
        )
        assert response.status_code == 200
        big = {"model": "tiny", "prompt": "the " * 1000}
        response = client.post("/v1/completions", json=big, headers=ok)
        assert response.status_code == 413
        assert response.json()["error"]["message"] == "request body exceeds 2000 bytes"

        def chunked():  # no Content-Length: the limit is counted while reading
            yield json.dumps(big).encode()

        response = client.post(
            "/v1/completions",
            content=chunked(),
            headers={**ok, "content-type": "application/json"},
        )
        assert response.status_code == 413


def recording_engine(run, sizes, gate=None, **kwargs):
    def factory():
        engine = tiny_engine(run, **kwargs)
        inner = engine.run

        def run_batch(jobs):
            sizes.append(len(jobs))
            if gate is not None:
                gate.wait(10)
            return inner(jobs)

        engine.run = run_batch
        return engine

    return factory


def test_concurrent_requests_share_a_generation_call(run):
    sizes: list[int] = []
    prompts = [f"what is the capital of {w}" for w in ("paris", "rome", "berlin", "madrid")] * 2
    with client_for(run, recording_engine(run, sizes), batch_window_ms=300, max_batch=8) as client:
        with ThreadPoolExecutor(8) as pool:
            responses = list(pool.map(lambda p: chat(client, p), prompts))
        engine = client.app.state.actmap.engine
        assert all(r.status_code == 200 for r in responses)
        assert sum(sizes) == 8 and max(sizes) > 1, sizes  # batched, not serialised
        for prompt, response in zip(prompts, responses, strict=True):
            gen, p_raw = reference(
                engine, engine.render_chat([{"role": "user", "content": prompt}])
            )
            body = response.json()
            assert body["choices"][0]["message"]["content"] == gen.answer
            assert body["actmap"]["p_correct_raw"] == pytest.approx(p_raw, abs=1e-4)


def test_full_queue_is_429_and_timeout_is_504(run):
    sizes: list[int] = []
    gate = threading.Event()
    factory = recording_engine(run, sizes, gate)
    with client_for(run, factory, max_batch=1, max_queue=1, timeout_s=30) as client:
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(chat, client)
            while not sizes:  # the first request is generating (held at the gate)
                time.sleep(0.01)
            second = pool.submit(chat, client)
            while client.get("/health").json()["queue"] < 1:
                time.sleep(0.01)
            busy = chat(client)
            assert busy.status_code == 429  # OpenAI's status for "retry later"
            assert busy.json()["error"]["message"].startswith("server busy: 1 requests are queued")
            assert busy.json()["error"]["code"] == "queue_full"
            assert busy.headers["retry-after"] == "1"
            gate.set()
            assert first.result().status_code == 200 and second.result().status_code == 200
    gate.clear()
    with client_for(run, recording_engine(run, [], gate), timeout_s=0.3) as client:
        response = chat(client)
        gate.set()
        assert response.status_code == 504
        assert response.json()["error"]["message"] == "request timed out after 0.3 s"


def sse_events(response) -> list[dict]:
    lines = [line for line in response.text.split("\n") if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


def test_streaming_matches_non_streaming(client):
    plain = chat(client).json()
    response = chat(client, stream=True, stream_options={"include_usage": True})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    assert text == plain["choices"][0]["message"]["content"]
    final = [e for e in events if e["choices"] and e["choices"][0].get("finish_reason")]
    assert len(final) == 1 and final[0]["actmap"]["decision"] == plain["actmap"]["decision"]
    assert final[0]["actmap"]["p_correct_raw"] == pytest.approx(plain["actmap"]["p_correct_raw"])
    assert events[-1]["choices"] == [] and events[-1]["usage"] == plain["usage"]
    # no running scores unless asked
    assert all("actmap" not in e for e in events if e is not final[0])


def test_stream_scores_are_running_p_correct(client):
    body = {"model": "tiny", "prompt": PROMPT, "stream": True, "actmap": {"stream_scores": True}}
    events = sse_events(client.post("/v1/completions", json=body))
    running = [e["actmap"] for e in events if e.get("actmap") and "decision" not in e["actmap"]]
    final = events[-1]["actmap"]
    engine = client.app.state.actmap.engine
    gen, _ = reference(engine, PROMPT)
    assert [r["n_tokens"] for r in running] == list(range(1, gen.n_tokens + 1))
    for r in running:  # each is the detector on the map of the first n tokens
        prefix = stored_form(build_map(gen.trajectory[:, : r["n_tokens"]]))[None]
        expected = float(engine.detector.detector.predict_proba(prefix)[0])
        assert r["p_correct"] == pytest.approx(expected, abs=1e-5)
    assert running[-1]["p_correct"] == pytest.approx(final["p_correct"], abs=1e-6)


def test_abort_below_stops_generation_early(client):
    for stream in (False, True):
        body = {
            "model": "tiny",
            "prompt": PROMPT,
            "max_tokens": 8,
            "stream": stream,
            "actmap": {"abort_below": 1.0},  # every running score is below 1: stop at token 1
        }
        response = client.post("/v1/completions", json=body)
        assert response.status_code == 200
        if stream:
            final = sse_events(response)[-1]
            block, choice = final["actmap"], final["choices"][0]
        else:
            out = response.json()
            block, choice = out["actmap"], out["choices"][0]
            assert out["usage"]["completion_tokens"] == 1
        assert block["decision"] == "abstain_early" and choice["finish_reason"] == "stop"
    gen, p_raw = reference(client.app.state.actmap.engine, PROMPT, 1)
    assert block["p_correct_raw"] == pytest.approx(p_raw, abs=1e-6)
    # a threshold no score falls below never aborts
    body = {"model": "tiny", "prompt": PROMPT, "actmap": {"abort_below": 0.0}}
    out = client.post("/v1/completions", json=body).json()
    assert out["actmap"]["decision"] != "abstain_early"
    assert (
        out["usage"]["completion_tokens"]
        == reference(client.app.state.actmap.engine, PROMPT)[0].n_tokens
    )
    np.testing.assert_equal(out["actmap"]["p_correct"] >= 0, True)


def test_served_answers_land_in_the_audit_store_and_rescore_exactly(run, tmp_path):
    import hashlib

    from actmap.serve.audit import AuditTrail, open_audit_store, read_audit, rescore
    from actmap.serve.loaded_run import load_detector_run

    root = tmp_path / "audit"

    def factory():
        return tiny_engine(run, audit=AuditTrail(root, flush_interval_s=0.05))

    prompts = ["what is the capital of rome", "how many days", "red blue green"]
    with client_for(run, factory) as client:
        bodies = [chat(client, p).json() for p in prompts]
        first_word = reference(client.app.state.actmap.engine, PROMPT)[0].answer.split()[0]
        empty = client.post(  # an answer of no tokens has no map: not audited, no score
            "/v1/completions", json={"model": "tiny", "prompt": PROMPT, "stop": [first_word]}
        ).json()
    store = open_audit_store(root)
    frame = read_audit(store).set_index("id")
    ids = [b["actmap"]["map_id"] for b in bodies]
    assert all(ids) and set(ids) <= set(frame.index)
    for prompt, body in zip(prompts, bodies, strict=True):
        row = frame.loc[body["actmap"]["map_id"]]
        assert row["p_correct_raw"] == body["actmap"]["p_correct_raw"]
        assert row["decision"] == body["actmap"]["decision"] and row["endpoint"] == "chat"
        assert row["prompt"] == "" and row["answer"] == ""  # text is off by default
        assert row["source_key"] == hashlib.sha256(f"user: {prompt}".encode()).hexdigest()
        assert row["n_tokens"] == body["usage"]["completion_tokens"]
        assert row["model_name"] == "tiny-llama"
    assert empty["usage"]["completion_tokens"] == 0 and empty["choices"][0]["text"] == ""
    assert empty["actmap"]["p_correct"] is None and empty["actmap"]["map_id"] is None
    assert empty["actmap"]["decision"] == "abstain" and len(frame) == 3
    # re-scoring the stored maps with the serving detector reproduces the served scores
    scores = rescore(store, load_detector_run(run)).set_index("id")
    np.testing.assert_allclose(
        scores.loc[ids, "p_correct_raw_new"], scores.loc[ids, "p_correct_raw"], atol=1e-6
    )


def test_em_prior_follows_the_recent_scores(run):
    from actmap.scoring.prior import em_prevalence
    from actmap.serve.engine import PrevalenceTracker

    tracker = PrevalenceTracker(PriorSetting("em", em_window=4, em_min_scores=3))
    assert tracker.update([0.9, 0.8]) is None  # too few scores yet
    assert tracker.update([0.7]) == pytest.approx(em_prevalence([0.9, 0.8, 0.7]).prevalence)
    tracker.update([0.1, 0.2])  # the window keeps the 4 newest
    assert list(tracker.window) == [0.8, 0.7, 0.1, 0.2]

    policy = Policy(prior=PriorSetting("em", em_min_scores=3))
    with client_for(run, lambda: tiny_engine(run, policy)) as client:
        words = ("paris", "rome", "berlin", "madrid")
        blocks = [chat(client, f"what is the capital of {w}").json()["actmap"] for w in words]
    raws = [b["p_correct_raw"] for b in blocks]
    assert blocks[0]["prevalence"] is None and blocks[0]["p_correct"] == raws[0]
    for k in (2, 3):  # from the third answer on: shifted to the EM estimate of the answers so far
        expected = em_prevalence(raws[: k + 1]).prevalence
        assert blocks[k]["prevalence"] == pytest.approx(expected)
        assert blocks[k]["p_correct"] == pytest.approx(shift_to_prevalence([raws[k]], expected)[0])
