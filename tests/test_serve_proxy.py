"""Proxy mode against real HTTP upstreams on loopback (uvicorn threads): a second actmap server
without a detector (the same tiny weights), and a misbehaving upstream (down, slow, 500, garbage)."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import numpy as np
import pytest

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
from fastapi import FastAPI, Request  # noqa: E402
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402
from serve_helpers import (  # noqa: E402
    TINY_SOURCE,
    ServerThread,
    free_port,
    reference,
    save_tiny_detector,
    tiny_engine,
    tiny_generator,
)

from actmap.errors import ActmapUserError  # noqa: E402
from actmap.maps import build_map, stored_form  # noqa: E402
from actmap.serve.app import ServeSettings, create_app  # noqa: E402
from actmap.serve.audit import AuditTrail, open_audit_store, read_audit  # noqa: E402
from actmap.serve.engine import Engine  # noqa: E402
from actmap.serve.settings import ProxySettings  # noqa: E402
from actmap.store import MapStore  # noqa: E402

QUESTION = "what is the capital of paris"


def plain_upstream() -> FastAPI:
    """`actmap serve` without a detector, over the tiny generator (the proxy's own weights)."""
    settings = ServeSettings(model="tiny", default_max_tokens=6, max_tokens_cap=16)

    def factory():
        model, tokenizer = tiny_generator()
        return Engine(model, tokenizer, TINY_SOURCE, None, max_context=64)

    return create_app(settings, factory)


def proxy_app(run, upstream: str, audit_root, timeout_s: float = 30.0, seed: int = 0, **settings):
    proxy = ProxySettings(upstream + "/v1", timeout_s=timeout_s, **settings)
    options = dict(model="tiny", detector=run, proxy=proxy, audit=audit_root)

    def factory():
        trail = AuditTrail(audit_root, background=False)  # the tests flush: no races
        engine = tiny_engine(run, audit=trail)
        if seed:  # other weights than the upstream's
            from conftest import make_tiny_llama

            engine.model = make_tiny_llama(len(engine.tokenizer), seed=seed)
        return engine

    return create_app(ServeSettings(**options), factory)


def audit_rows(root) -> int:
    if not (root / "manifest.json").exists():
        return 0
    return len(read_audit(open_audit_store(root)))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("run")
    save_tiny_detector(folder)
    return folder


@pytest.fixture(scope="module")
def upstream():
    with ServerThread(plain_upstream()) as server:
        yield server


@pytest.fixture(scope="module")
def proxy(run, upstream, tmp_path_factory):
    root = tmp_path_factory.mktemp("proxy") / "audit"
    with ServerThread(proxy_app(run, upstream.url, root)) as server:
        server.audit_root = root
        yield server


def chat_body(content=QUESTION, **fields):
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], **fields}


def test_plain_upstream_has_no_actmap_block(upstream):
    out = httpx.post(upstream.url + "/v1/chat/completions", json=chat_body()).json()
    assert out["actmap"] is None and out["choices"][0]["message"]["content"]
    response = httpx.post(upstream.url + "/v1/actmap/score", json={"items": [{"prompt": "a", "answer": "b"}]})  # fmt: skip
    assert response.status_code == 400 and "no detector" in response.json()["error"]["message"]


def test_proxied_answer_map_and_score_equal_generation_time_capture(proxy, upstream, run):
    direct = httpx.post(upstream.url + "/v1/chat/completions", json=chat_body(max_tokens=8)).json()
    out = httpx.post(proxy.url + "/v1/chat/completions", json=chat_body(max_tokens=8)).json()
    block = out.pop("actmap")
    # the upstream's body passes through unchanged (apart from its per-request id and time)
    for body in (out, direct):
        body.pop("id"), body.pop("created")
    direct.pop("actmap")
    assert out == direct
    # the reference: generation-time capture of the same prompt on the same weights
    engine = tiny_engine(run)
    prompt = engine.render_chat([{"role": "user", "content": QUESTION}])
    gen, p_raw = reference(engine, prompt, max_tokens=8)
    assert out["choices"][0]["message"]["content"] == gen.answer
    assert block["tokens"]["source"] == "retokenized" and block["tokens"]["mismatch"] is False
    assert block["p_correct_raw"] == pytest.approx(p_raw, abs=1e-5)
    assert block["decision"] in ("accept", "abstain") and block["map_id"]
    # the map the proxy audited equals the generation-time map (float16 store form)
    proxy.app.state.actmap.engine.audit.flush()
    store = MapStore.open(proxy.audit_root)
    maps = {}
    for batch, meta in store.iter_maps(batch_size=64, columns=("id",)):
        maps.update(zip(meta.column("id").to_pylist(), batch, strict=True))
    expected = stored_form(build_map(gen.trajectory)).astype(np.float32)
    served = maps[block["map_id"]].astype(np.float32)
    assert np.abs(served - expected).max() <= 2e-3 * max(1.0, np.abs(expected).max())


def test_openai_client_plain_and_streaming(proxy, run):
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="none", max_retries=0)
    messages = [{"role": "user", "content": "who wrote the red river"}]
    plain = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6)
    block = plain.model_extra["actmap"]
    assert block["detector"].startswith("logreg:")
    # the reference: generation-time capture on the same weights, read by the same detector
    engine = tiny_engine(run)
    gen, p_raw = reference(engine, engine.render_chat(messages), max_tokens=6)
    assert plain.choices[0].message.content == gen.answer
    assert block["p_correct_raw"] == pytest.approx(p_raw, abs=1e-5)
    assert block["p_correct"] == pytest.approx(p_raw, abs=1e-5)  # no policy: no prior shift
    chunks = list(
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, stream=True)
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    final = chunks[-1]
    assert final.choices == [] and final.model_extra["actmap"]["p_correct_raw"] == pytest.approx(
        block["p_correct_raw"], abs=1e-6
    )
    completion = client.completions.create(model="tiny", prompt="the capital of", max_tokens=4)
    assert completion.model_extra["actmap"]["tokens"]["source"] == "retokenized"
    gen, p_raw = reference(engine, "the capital of", max_tokens=4)
    assert completion.choices[0].text == gen.answer
    assert completion.model_extra["actmap"]["p_correct_raw"] == pytest.approx(p_raw, abs=1e-5)
    streamed = list(client.completions.create(model="tiny", prompt="the capital of", max_tokens=4, stream=True))  # fmt: skip
    assert "".join(c.choices[0].text for c in streamed if c.choices) == completion.choices[0].text
    assert streamed[-1].model_extra["actmap"]["p_correct_raw"] == pytest.approx(
        completion.model_extra["actmap"]["p_correct_raw"], abs=1e-6
    )
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=messages)


def test_weights_mismatch_refuses_to_start(run, upstream, tmp_path):
    app = proxy_app(run, upstream.url, tmp_path / "audit", seed=7)
    with pytest.raises(ActmapUserError) as error, TestClient(app):
        pass
    message = str(error.value)
    assert "\n" not in message and "does not serve the weights of tiny" in message
    assert "greedy probe answer is" in message and "--allow-weights-mismatch" in message
    allowed = proxy_app(run, upstream.url, tmp_path / "audit2", seed=7, allow_weights_mismatch=True)
    with TestClient(allowed) as client:
        assert client.post("/v1/chat/completions", json=chat_body()).status_code == 200


# -- a misbehaving upstream -------------------------------------------------------------------

ANSWER = "paris is the capital"


def misbehaving_upstream() -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "tiny-upstream", "object": "model"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        what = body["messages"][-1]["content"]
        if what == "500":
            return JSONResponse({"error": {"message": "boom"}}, status_code=500)
        if what == "garbage":
            return PlainTextResponse("<html>oops</html>")
        if what == "no choices":
            return {"id": "x", "object": "chat.completion"}
        if what == "refuse":
            return JSONResponse({"error": {"message": "bad field", "type": "invalid"}}, 400)
        if what == "slow":
            await asyncio.sleep(3)
        if body.get("stream"):
            return StreamingResponse(stream(what), media_type="text/event-stream")
        return {
            "id": "chatcmpl-fixed", "object": "chat.completion", "created": 1, "model": body["model"],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": ANSWER},
                         "finish_reason": "stop", "stop_reason": None}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 9 if what == "miscount" else 4,
                      "total_tokens": 7},
            "system_fingerprint": "fp-upstream", "extra_field": {"kept": [1, 2]},
        }  # fmt: skip

    async def stream(what):
        head = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
        for word in ANSWER.split(" "):
            delta = {"index": 0, "delta": {"content": word + " "}, "finish_reason": None}
            yield f"data: {json.dumps({**head, 'choices': [delta]})}\n\n"
            if what == "stream garbage":
                yield "data: {not json\n\n"
                return
            if what == "stream cut":
                return
        yield "data: [DONE]\n\n"

    return app


@pytest.fixture(scope="module")
def bad(run, tmp_path_factory):
    root = tmp_path_factory.mktemp("bad") / "audit"
    with ServerThread(misbehaving_upstream()) as up:
        app = proxy_app(run, up.url, root, timeout_s=1.0, allow_weights_mismatch=True)
        with TestClient(app) as client:
            client.upstream, client.audit_root = up, root
            yield client


def failures(client, kind: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(f'actmap_upstream_failures_total{{kind="{kind}"}}'):
            return float(line.split()[-1])
    return 0.0


def committed(client) -> int:
    """Audit rows of the proxy behind ``client``, once everything buffered is flushed."""
    client.app.state.actmap.engine.audit.flush()
    return audit_rows(client.audit_root)


def test_upstream_body_passes_through_unchanged(bad):
    response = bad.post("/v1/chat/completions", json=chat_body("ok"))
    assert response.status_code == 200
    out = response.json()
    block = out.pop("actmap")
    assert out["model"] == "tiny-upstream"  # the upstream's own model name, as it sent it
    assert out["extra_field"] == {"kept": [1, 2]} and out["system_fingerprint"] == "fp-upstream"
    assert out["choices"][0]["message"]["content"] == ANSWER and set(out) == {
        "id", "object", "created", "model", "choices", "usage", "system_fingerprint", "extra_field"
    }  # fmt: skip
    # no ids upstream: the text is re-tokenized; the upstream counted 4 tokens, so do we
    assert block["tokens"]["source"] == "retokenized" and block["tokens"]["mismatch"] is False
    assert committed(bad) >= 1
    miscounted = bad.post("/v1/chat/completions", json=chat_body("miscount")).json()["actmap"]
    assert miscounted["tokens"]["mismatch"] is True  # never silent
    assert "the upstream counted 9 answer tokens, re-tokenizing its text gives 4" in miscounted["tokens"]["detail"]  # fmt: skip


@pytest.mark.parametrize(
    "content, status, kind",
    [("500", 502, "http_5xx"), ("garbage", 502, "malformed"), ("no choices", 502, "malformed"),
     ("slow", 504, "timeout")],
)  # fmt: skip
def test_upstream_failures_get_their_error_and_no_audit(bad, content, status, kind, caplog):
    before_rows, before = committed(bad), failures(bad, kind)
    with caplog.at_level("WARNING", logger="actmap.serve.proxy"):
        response = bad.post("/v1/chat/completions", json=chat_body(content))
    assert response.status_code == status, response.text
    error = response.json()["error"]
    # the server's log says it too: an operator reads why a client got a 502 or 504
    assert any(
        f"upstream failure ({kind}, {status})" in r.getMessage()
        and error["message"] in r.getMessage()
        for r in caplog.records
    ), caplog.text
    assert error["code"] == kind and error["type"] in ("upstream_error", "timeout")
    assert failures(bad, kind) == before + 1
    ok = bad.post("/v1/chat/completions", json=chat_body("ok"))  # the proxy keeps serving
    assert ok.status_code == 200
    assert committed(bad) == before_rows + 1  # only the good one
    metrics = bad.get("/metrics").text
    assert f'actmap_requests_total{{endpoint="chat",status="{status}"}}' in metrics


def test_upstream_refusal_passes_through(bad):
    response = bad.post("/v1/chat/completions", json=chat_body("refuse"))
    assert response.status_code == 400
    assert response.json() == {"error": {"message": "bad field", "type": "invalid"}}


def test_streaming_failures_end_the_stream_with_an_error(bad):
    rows = committed(bad)
    for content, kind in (("stream garbage", "malformed"), ("stream cut", "malformed")):
        body = chat_body(content, stream=True)
        with bad.stream("POST", "/v1/chat/completions", json=body) as response:
            events = [line for line in response.iter_lines() if line.startswith("data:")]
        last = json.loads(events[-1][5:])
        assert last["error"]["code"] == kind and events[-1] != "data: [DONE]"
    streamed = bad.post("/v1/chat/completions", json=chat_body("ok", stream=True)).text
    events = [line[5:].strip() for line in streamed.splitlines() if line.startswith("data:")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["actmap"]["p_correct"] is not None
    assert "".join(json.loads(e)["choices"][0]["delta"]["content"] for e in events[:-2]) == ANSWER + " "  # fmt: skip
    assert committed(bad) == rows + 1


def test_slow_upstream_does_not_block_other_requests(bad):
    slow = {}

    def call():
        slow["response"] = bad.post("/v1/chat/completions", json=chat_body("slow"))

    thread = threading.Thread(target=call)
    thread.start()
    time.sleep(0.2)
    started = time.perf_counter()
    fast = bad.post("/v1/chat/completions", json=chat_body("ok"))
    scored = bad.post("/v1/actmap/score", json={"items": [{"prompt": "the sum", "answer": "two"}]})
    elapsed = time.perf_counter() - started
    thread.join()
    assert fast.status_code == 200 and scored.status_code == 200
    assert slow["response"].status_code == 504
    assert elapsed < 0.9  # both answered while the slow request waited on its 1 s timeout


def test_upstream_down_then_back(run, tmp_path):
    root = tmp_path / "audit"
    port = free_port()
    with ServerThread(misbehaving_upstream(), port) as up:
        app = proxy_app(run, up.url, root, timeout_s=2.0, allow_weights_mismatch=True)
        client = TestClient(app).__enter__()
    try:  # the upstream is gone: connection refused, after the transport's connect retries
        response = client.post("/v1/chat/completions", json=chat_body("ok"))
        assert response.status_code == 502 and response.json()["error"]["code"] == "unreachable"
        assert failures(client, "unreachable") == 1
        with ServerThread(misbehaving_upstream(), port):
            assert client.post("/v1/chat/completions", json=chat_body("ok")).status_code == 200
        client.app.state.actmap.engine.audit.flush()
        assert audit_rows(root) == 1
    finally:
        client.__exit__(None, None, None)
    with pytest.raises(ActmapUserError, match="could not list the upstream's models"):
        with TestClient(proxy_app(run, f"http://127.0.0.1:{free_port()}", tmp_path / "a2")):
            pass


def test_cli_refuses_to_start_in_one_line(run, upstream, tmp_path):
    """`actmap serve --upstream`: other weights upstream, or no upstream, is one red line and
    exit code 2, before anything listens."""
    from conftest import make_tiny_llama, make_word_tokenizer
    from typer.testing import CliRunner

    from actmap.cli import app

    tokenizer = make_word_tokenizer()  # no chat template: the probe goes through /completions
    folder = tmp_path / "other-weights"
    make_tiny_llama(len(tokenizer), seed=5).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    base = ["serve", "--detector", str(run), "--model", str(folder), "--served-model-name", "tiny"]
    result = CliRunner().invoke(app, [*base, "--upstream", upstream.url + "/v1", "--upstream-model", "tiny"])  # fmt: skip
    assert result.exit_code == 2, result.output
    line = result.output.strip().splitlines()[-1]
    assert line.startswith("error: the upstream") and "does not serve the weights" in line
    assert "greedy probe" in line and "--allow-weights-mismatch" in line
    closed = f"http://127.0.0.1:{free_port()}/v1"
    result = CliRunner().invoke(app, [*base, "--upstream", closed])
    assert result.exit_code == 2 and "could not list the upstream's models" in result.output
