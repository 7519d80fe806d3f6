"""The vLLM plugin's parts that need no vLLM server: request ids, the rows' round trip from a
worker to the API server, and how the middleware splices the block into vLLM's answers (an
ASGI app answering as vLLM's server does, chunked the way uvicorn may deliver it).
The plugin inside a real vLLM server: tests/test_vllm_plugin.py."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
import torch

from actmap.capture.records import CaptureConfig
from actmap.capture.vllm_engine import _record, _Request
from actmap.capture.vllm_rows import child_index, generation_from_payload, payload
from actmap.serve.settings import ServeSettings
from actmap.serve.vllm_plugin import ActmapMiddleware

BASE = "actmap-0123abcd"


def test_child_index_reads_vllms_request_ids():
    assert child_index(f"chatcmpl-{BASE}-1a2b3c4d", BASE) == 0
    assert child_index(f"1_chatcmpl-{BASE}-1a2b3c4d", BASE) == 1
    assert child_index(f"12_cmpl-{BASE}-1a2b3c4d", BASE) == 12
    assert child_index(f"chatcmpl-{BASE}x-1a2b3c4d", BASE) is None  # another id's prefix
    assert child_index("chatcmpl-other-1a2b3c4d", BASE) is None


def test_rows_round_trip_to_the_in_process_engines_generation(word_tokenizer):
    """What the worker sends becomes exactly the `Generation` the in-process engine cuts
    from the same request (end token excluded, its statistics kept)."""
    torch.manual_seed(0)
    tokens = [word_tokenizer.convert_tokens_to_ids(w) for w in ("paris", "is", "<eos>")]
    states, entropies = torch.randn(3, 8, 128), torch.rand(8)
    full = [torch.randn(3, 16).half() for _ in range(3)]

    def request() -> _Request:
        config = CaptureConfig(max_new_tokens=4, keep_positions=True)
        return _Request(
            "0_chatcmpl-x", "", [5, 6, 7], config, states.clone(), entropies.clone(),
            full_rows=[f.clone() for f in full], token_ids=list(tokens),
            logprobs=[-0.5, -1.0, -0.1], recorded=3,
        )  # fmt: skip

    ends = {word_tokenizer.eos_token_id}
    item = json.loads(json.dumps(payload(request(), 1), default=lambda b: b.hex()))
    for key in ("states", "entropies", "full"):  # bytes as the RPC carries them
        item[key] = bytes.fromhex(item[key])
    got = generation_from_payload(item, word_tokenizer, ends)
    want = _record(request(), word_tokenizer, ends)
    assert got.token_ids == want.token_ids == tokens[:2] and got.answer == want.answer
    assert torch.equal(got.trajectory, want.trajectory) and got.trajectory.shape == (3, 2, 128)
    assert torch.equal(got.entropies, entropies[:2]) and torch.equal(got.logprobs, want.logprobs)
    assert got.extras == want.extras and got.extras["eos_entropy"] == pytest.approx(
        float(entropies[2])
    )
    assert torch.equal(got.positions, want.positions)


class Blocks:
    """Scores by choice index (what `VllmPlugin.blocks` returns); records what it was asked."""

    settings = ServeSettings(model="tiny")
    gives_running_scores = True
    limits_tokens = False

    def __init__(self) -> None:
        self.asked = []

    def expect(self, base) -> None:  # the push socket's registration: none here
        pass

    def release(self, base) -> None:
        pass

    async def blocks(self, base, body, endpoint, arrived, tokens=None):
        self.asked.append((base, endpoint))
        return {i: {"p_correct": 0.25 + i / 10} for i in range(body.get("n", 1))}


def vllm_like(status: int, parts: list[bytes], content_type: bytes):
    """An ASGI app answering with ``parts`` (one body message each), and the headers it saw."""
    seen = {}

    async def app(scope, receive, send):
        seen["headers"] = dict(scope["headers"])
        message = await receive()
        seen["body"] = message["body"]
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", content_type)]})  # fmt: skip
        for k, part in enumerate(parts):
            more = k < len(parts) - 1
            await send({"type": "http.response.body", "body": part, "more_body": more})

    return app, seen


def call(app, body: bytes, headers=(), plugin=None):
    plugin = plugin or Blocks()
    middleware = ActmapMiddleware(app)
    middleware.plugin = plugin
    sent = []
    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions",
             "headers": list(headers)}  # fmt: skip
    messages = [{"type": "http.request", "body": body[:5], "more_body": True},
                {"type": "http.request", "body": body[5:], "more_body": False}]  # fmt: skip

    async def receive():
        return messages.pop(0)

    async def send(message):
        sent.append(message)

    asyncio.run(middleware(scope, receive, send))
    out = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0], out, plugin


def test_json_answers_get_the_block_per_choice():
    answer = {"id": "chatcmpl-x", "choices": [{"index": 0}, {"index": 1}]}
    raw = json.dumps(answer).encode()
    app, seen = vllm_like(200, [raw[:7], raw[7:]], b"application/json")
    start, out, plugin = call(app, json.dumps({"n": 2, "messages": []}).encode())
    data = json.loads(out)
    assert data["actmap"] == {"p_correct": 0.25}
    assert [c["actmap"]["p_correct"] for c in data["choices"]] == [0.25, 0.35]
    assert dict(start["headers"])[b"content-length"] == str(len(out)).encode()
    base = seen["headers"][b"x-request-id"].decode()  # named for vLLM, taken by that name
    assert base.startswith("actmap-") and plugin.asked == [(base, "chat")]
    assert json.loads(seen["body"]) == {"n": 2, "messages": []}  # the body vLLM reads


def test_a_clients_request_id_is_kept_and_errors_pass_untouched():
    error = b'{"error": {"message": "n must be 1", "code": 400}}'
    app, seen = vllm_like(400, [error], b"application/json")
    start, out, plugin = call(app, b'{"n": 2, "temperature": 0}', [(b"x-request-id", b"mine")])
    assert start["status"] == 400 and out == error and plugin.asked == []
    assert seen["headers"][b"x-request-id"] == b"mine"


def test_max_tokens_get_actmap_serves_default_and_cap_when_configured():
    """With ``default_max_tokens`` / ``max_tokens_cap`` in the plugin's settings (``actmap
    serve --engine vllm`` passes both), vLLM gets the default when a request names none and a
    request over the cap is refused as ``actmap serve`` refuses it; without them vLLM's rules."""
    limited = Blocks()
    limited.limits_tokens = True
    limited.settings = ServeSettings(model="tiny", default_max_tokens=12, max_tokens_cap=20)
    answer = b'{"choices": [{"index": 0}]}'
    sent = {}
    for name, body, plugin in [
        ("default", {"messages": []}, limited),
        ("given", {"messages": [], "max_completion_tokens": 5}, limited),
        ("vllm's", {"messages": []}, Blocks()),
    ]:
        app, seen = vllm_like(200, [answer], b"application/json")
        start, _, _ = call(app, json.dumps(body).encode(), plugin=plugin)
        assert start["status"] == 200
        sent[name] = json.loads(seen["body"])
    assert sent == {"default": {"messages": [], "max_tokens": 12},
                    "given": {"messages": [], "max_completion_tokens": 5},
                    "vllm's": {"messages": []}}  # fmt: skip
    app, seen = vllm_like(200, [answer], b"application/json")
    start, out, _ = call(app, b'{"messages": [], "max_tokens": 21}', plugin=limited)
    assert start["status"] == 400 and seen == {}  # never reached vLLM
    error = json.loads(out)["error"]
    assert (error["message"], error["param"]) == (
        "max_tokens=21 exceeds this server's cap of 20", "max_tokens",
    )  # fmt: skip


def test_a_stream_gets_one_more_chunk_before_done():
    events = [b'data: {"id": "c1", "object": "chat.completion.chunk", "created": 1, '
              b'"model": "m", "choices": [{"index": 0, "delta": {"content": "hi"}}]}\n\n',
              b"data: [DONE]\n\n"]  # fmt: skip
    stream = b"".join(events)
    parts = [stream[:30], stream[30:-9], stream[-9:]]  # events split across body messages
    app, _ = vllm_like(200, parts, b"text/event-stream")
    _, out, plugin = call(app, b'{"stream": true}')
    chunks = [e for e in out.decode().split("\n\n") if e]
    assert chunks[0] == events[0].decode().strip() and chunks[-1] == "data: [DONE]"
    final = json.loads(chunks[-2][len("data: ") :])
    assert final == {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m",
                     "choices": [], "actmap": {"p_correct": 0.25}}  # fmt: skip
    assert len(plugin.asked) == 1


def test_a_stream_that_reported_an_error_gets_no_block():
    stream = b'data: {"error": {"message": "boom"}}\n\ndata: [DONE]\n\n'
    app, _ = vllm_like(200, [stream], b"text/event-stream")
    _, out, plugin = call(app, b'{"stream": true}')
    assert out == stream and plugin.asked == []


class Running(Blocks):
    """A plugin whose running score falls by 0.2 a token (tokens so far: one per chunk)."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = 0
        self.cut = None

    async def running(self, request, choices, since):
        self.tokens += 1
        return {0: (1.0 - 0.2 * self.tokens, self.tokens)}

    async def blocks(self, base, body, endpoint, arrived, tokens=None):
        self.cut = tokens
        return {0: {"decision": "abstain_early" if tokens else "accept"}}


def streaming_vllm(n_chunks: int):
    """An ASGI app streaming ``n_chunks`` token chunks as Starlette's StreamingResponse does:
    it stops when ``receive`` says the client left (vLLM then aborts the request)."""
    seen = {"sent": 0}

    async def app(scope, receive, send):
        seen["body"] = (await receive())["body"]
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})  # fmt: skip

        async def stream():
            for k in range(n_chunks):
                chunk = {"id": "c1", "choices": [{"index": 0, "delta": {"content": f"w{k}"}}]}
                await send({"type": "http.response.body", "more_body": True,
                            "body": b"data: " + json.dumps(chunk).encode() + b"\n\n"})  # fmt: skip
                seen["sent"] += 1
                await asyncio.sleep(0.01)
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

        async def listen():
            while (await receive())["type"] != "http.disconnect":
                pass

        tasks = {asyncio.ensure_future(stream()), listen_task := asyncio.ensure_future(listen())}
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
        seen["disconnected"] = listen_task in done

    return app, seen


def stream_through(app, plugin, body: dict) -> list[dict]:
    middleware = ActmapMiddleware(app)
    middleware.plugin = plugin
    sent = []
    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": []}
    messages = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]

    async def receive():  # the client stays connected
        if messages:
            return messages.pop(0)
        await asyncio.Event().wait()

    async def send(message):
        sent.append(message)

    asyncio.run(asyncio.wait_for(middleware(scope, receive, send), 10))
    bodies = [m for m in sent if m["type"] == "http.response.body"]
    assert not bodies[-1].get("more_body", False) and all(m.get("more_body") for m in bodies[:-1])
    events = b"".join(m["body"] for m in bodies).decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    return [json.loads(e[len("data: ") :]) for e in events[:-2]]


def test_running_scores_and_abort_below_end_the_stream_in_vllm():
    app, seen = streaming_vllm(20)
    plugin = Running()
    body = {"stream": True, "messages": [], "actmap": {"stream_scores": True, "abort_below": 0.5}}
    chunks = stream_through(app, plugin, body)
    assert "actmap" not in json.loads(seen["body"])  # actmap's options never reach vLLM
    # 0.8, 0.6 pass; 0.4 < 0.5 ends the answer after its third token
    running = [c["actmap"] for c in chunks[:-1]]
    assert running == [
        {"p_correct": pytest.approx(1.0 - 0.2 * k), "n_tokens": k} for k in (1, 2, 3)
    ]
    assert seen["disconnected"] and seen["sent"] < 20  # vLLM heard a client that left
    final = chunks[-1]
    assert final["choices"] == [{"index": 0, "delta": {}, "finish_reason": "stop"}]
    assert final["actmap"] == {"decision": "abstain_early"} and plugin.cut == 3


def test_running_scores_without_abort_leave_the_stream_whole():
    app, seen = streaming_vllm(4)
    plugin = Running()
    chunks = stream_through(app, plugin, {"stream": True, "actmap": {"stream_scores": True}})
    assert [c["actmap"]["n_tokens"] for c in chunks[:-1]] == [1, 2, 3, 4]
    assert chunks[-1]["actmap"] == {"decision": "accept"} and plugin.cut is None
    assert not seen["disconnected"] and seen["sent"] == 4


def test_one_client_id_sent_twice_at_once_names_two_requests():
    """The rows are taken by the id vLLM names a request after: a second request with a client's
    id still in flight gets a suffix (else the first would take both answers' rows)."""
    ids, both = [], asyncio.Event()

    async def app(scope, receive, send):
        ids.append(dict(scope["headers"])[b"x-request-id"].decode())
        await receive()
        if len(ids) == 2:
            both.set()
        await both.wait()  # both in flight together
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})  # fmt: skip
        await send({"type": "http.response.body", "body": b'{"choices": []}'})

    middleware = ActmapMiddleware(app)
    middleware.plugin = Blocks()
    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions",
             "headers": [(b"x-request-id", b"mine")]}  # fmt: skip

    async def one():
        sent = []
        messages = [{"type": "http.request", "body": b"{}", "more_body": False}]

        async def receive():
            return messages.pop(0)

        async def send(message):
            sent.append(message)

        await middleware(dict(scope), receive, send)
        return json.loads(sent[-1]["body"])

    async def main():
        first = await asyncio.wait_for(asyncio.gather(one(), one()), 10)
        again = await asyncio.wait_for(one(), 10)  # no longer in flight: the client's id
        return first, again

    (a, b), _ = asyncio.run(main())
    assert ids[0] == "mine" and ids[1].startswith("mine-") and ids[2] == "mine"
    assert sorted(base for base, _ in middleware.plugin.asked) == sorted(ids)  # each by its id
    assert a["actmap"] == b["actmap"] == {"p_correct": 0.25}


class ReadingVllm:
    """vLLM's engine client as `actmap.serve.vllm_reader.VllmReader` uses it, with a worker
    that reads by the transformers teacher-forced capture: ``generate`` finds where the answer
    starts from the request id alone (`forced_read_of`, as the workers do), reads the pair with
    `capture_answers` and holds the rows (and the end step's statistics) as a worker's payload;
    ``collective_rpc("actmap_take")`` hands them out by base, once."""

    def __init__(self, engine) -> None:
        self.engine, self.held, self.requests = engine, {}, []

    async def generate(self, inputs, params, request_id):
        from actmap.capture import capture_answers
        from actmap.capture.vllm_engine import forced_read_of

        assert params.max_tokens == 1 and inputs["cache_salt"] in request_id
        self.requests.append(request_id)
        ids = inputs["prompt_token_ids"]
        read = forced_read_of(request_id, ids)
        tokenizer, rows = self.engine.tokenizer, len(read.chosen)
        greybox = self.engine.detector.capture_settings()["greybox"]
        config = CaptureConfig(max_context=self.engine.max_context, greybox=greybox)
        (gen,) = capture_answers(self.engine.model, tokenizer, [tokenizer.decode(ids[: read.origin])],
                                 [list(read.chosen[:-1])], config)  # fmt: skip
        assert gen.prompt_tokens == read.origin
        states = torch.cat([gen.trajectory, torch.zeros_like(gen.trajectory[:, :1])], dim=1)
        entropies, logprobs = None, []
        if greybox:
            entropies = torch.cat([gen.entropies, torch.tensor([gen.extras["eos_entropy"]])])
            logprobs = [*gen.logprobs.tolist(), gen.extras["eos_logprob"]]
        request = _Request(f"{request_id}-1a2b3c4d", "", ids[: read.origin], config, states,
                           entropies, token_ids=list(read.chosen), logprobs=logprobs,
                           recorded=rows)  # fmt: skip
        self.held[inputs["cache_salt"]] = payload(request, 0)
        yield {"finished": True}

    async def collective_rpc(self, method, args=()):
        assert method == "actmap_take"
        return [[{**self.held.pop(b), "base": b} for b in args[0] if b in self.held]]


def test_the_score_route_reads_through_vllm_and_scores_as_actmap_serve(tmp_path):
    """``POST /v1/actmap/score`` on the plugin: each item one teacher-forced request to vLLM's
    engine client (``max_tokens=1``, a cache salt of its own, where the answer starts in its
    id), its rows taken by that salt and scored as a generated answer's: the same results as
    ``actmap serve``'s route over the transformers teacher-forced pass (`score_answers`), for
    text and token-id answers, an empty one, and an actmap-plus (log-probs, entropies and the
    end token's statistics travel with the rows). No model in the API server."""
    import httpx
    from serve_helpers import save_tiny_plus, tiny_engine

    from actmap.serve.answers import ScoreJob, score_answers
    from actmap.serve.vllm_plugin import VllmPlugin

    pytest.importorskip("vllm", reason="the reader builds vLLM's SamplingParams")
    run = save_tiny_plus(tmp_path / "run")
    engine = tiny_engine(run)  # reads for the fake worker, and the reference
    vllm = ReadingVllm(engine)
    scorer = tiny_engine(run)
    scorer.model = None  # the plugin's engine: tokenizer, detector, policy only
    plugin = VllmPlugin(scorer, vllm, {1}, ServeSettings(model="tiny", detector=run))
    items = [{"prompt": "what is the capital", "answer": "paris is the capital"},
             {"messages": [{"role": "user", "content": "name a city"}],
              "answer_token_ids": engine.encode("paris", False)},
             {"prompt": "what is the capital", "answer": ""}]  # fmt: skip

    async def main():
        await plugin.start_score_route("tiny")
        transport = httpx.ASGITransport(app=plugin.score_app)
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://plugin") as client:
                return await client.post("/v1/actmap/score", json={"items": items})
        finally:
            await plugin.close()

    reply = asyncio.run(main())
    assert reply.status_code == 200, reply.text
    assert len(vllm.requests) == 3 and not vllm.held  # one reading each, each taken
    chat = engine.render_chat([{"role": "user", "content": "name a city"}])
    jobs = [ScoreJob(items[0]["prompt"], items[0]["answer"]),
            ScoreJob(chat, items[1]["answer_token_ids"]),
            ScoreJob(items[2]["prompt"], "")]  # fmt: skip
    want, _ = score_answers(engine, jobs)
    got = reply.json()["results"]
    for result, answer in zip(got, want, strict=True):
        assert result["n_tokens"] == answer.n_tokens and result["decision"] == answer.decision
        if answer.p_correct_raw is None:
            assert result["p_correct_raw"] is None
        else:
            assert result["p_correct_raw"] == pytest.approx(answer.p_correct_raw, abs=1e-6)
    assert got[2]["n_tokens"] == 0 and got[2]["p_correct"] is None


def test_a_server_without_the_score_route_says_how_to_turn_it_on():
    plugin = Blocks()
    plugin.score_app = None
    middleware = ActmapMiddleware(lambda *args: pytest.fail("reached vLLM"))
    middleware.plugin = plugin
    sent = []

    async def receive():
        return {"type": "http.request", "body": b'{"items": []}', "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/actmap/score", "headers": []}
    asyncio.run(middleware(scope, receive, send))
    assert sent[0]["status"] == 400
    error = json.loads(b"".join(m.get("body", b"") for m in sent[1:]))["error"]
    assert error["param"] == "score_route" and '"score_route": true' in error["message"]


def test_the_score_route_builds_the_scoring_side_alone(tmp_path, monkeypatch):
    """`VllmPlugin.start_score_route`: a `ServerState` with the plugin's own metrics (those on
    vLLM's /metrics) and no generation batcher (vLLM generates); a score request through its
    app is counted there (the teacher-forced batch too). With a shift monitor the plugin's
    metrics carry its gauges, so the answers' shift state can be copied into them. The route
    sits outside vLLM's own key check: it checks vLLM's keys itself."""
    pytest.importorskip("vllm", reason="the route's key check is vLLM's own middleware")
    import httpx
    from serve_helpers import save_tiny_detector, tiny_engine

    from actmap.monitor import MonitorConfig, ShiftMonitor
    from actmap.monitor.stream import StreamingMonitor
    from actmap.serve.app import ServerState
    from actmap.serve.vllm_plugin import VllmPlugin

    def no_generation(self):
        raise AssertionError("the plugin's score route built a generation batcher")

    monkeypatch.setattr(ServerState, "_generation_batcher", no_generation)
    run = save_tiny_detector(tmp_path / "run")
    maps = np.random.default_rng(0).normal(size=(30, 12, 32, 128)).astype(np.float16)
    monitor = ShiftMonitor(MonitorConfig(n_components=2, n_permutations=19)).fit(maps)
    engine = tiny_engine(run, monitor=StreamingMonitor(monitor, 3))
    pytest.importorskip("vllm", reason="the reader builds vLLM's SamplingParams")
    plugin = VllmPlugin(engine, ReadingVllm(engine), {1}, ServeSettings(model="tiny", detector=run))

    async def main():
        await plugin.start_score_route("tiny", ["the-key"])
        transport = httpx.ASGITransport(app=plugin.score_app)
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://plugin") as client:
                items = [{"prompt": "what is the capital", "answer": "paris"}]
                wrong = await client.post("/v1/actmap/score", json={"items": items},
                                          headers={"Authorization": "Bearer nope"})  # fmt: skip
                right = await client.post("/v1/actmap/score", json={"items": items},
                                          headers={"Authorization": "Bearer the-key"})  # fmt: skip
                return wrong, right
        finally:
            await plugin.close()

    # vLLM's --api-key / VLLM_API_KEY guards the route as it guards vLLM's own /v1 paths
    wrong, reply = asyncio.run(main())
    assert wrong.status_code == 401 and wrong.json() == {"error": "Unauthorized"}
    assert reply.status_code == 200, reply.text
    state = plugin.score_state
    assert state.batcher is None and state.metrics is plugin.metrics
    registry = plugin.metrics.registry
    assert registry.get_sample_value("actmap_requests_total", {"endpoint": "score", "status": "200"}) == 1  # fmt: skip
    assert registry.get_sample_value("actmap_batch_forced_size_count") == 1
    plugin.metrics.observe_shift(engine.monitor.state())  # the gauges exist
    assert registry.get_sample_value("actmap_shift_alarm") == 0


def test_feedback_and_the_review_queue_on_vllms_server(tmp_path):
    """`VllmPlugin.start_label_routes`: ``actmap serve``'s feedback route and review queue
    over the plugin's audit store, reached through the middleware (not vLLM's app), behind
    vLLM's API key (the middleware sits outside vLLM's own key check)."""
    pytest.importorskip("vllm", reason="the routes' key check is vLLM's own middleware")
    import httpx
    from serve_helpers import save_tiny_detector, tiny_engine
    from test_serve_audit import entries

    from actmap.serve.audit import AuditTrail
    from actmap.serve.vllm_plugin import VllmPlugin

    run = save_tiny_detector(tmp_path / "run")
    trail = AuditTrail(tmp_path / "audit", flush_interval_s=60)
    trail.append(entries(0, size=3, decision="review"))
    trail.flush()
    plugin = VllmPlugin(tiny_engine(run, audit=trail), None, set(), ServeSettings(model="tiny"))
    plugin.start_label_routes(["the-key"])
    middleware = ActmapMiddleware(lambda *args: pytest.fail("reached vLLM's app"))
    middleware.plugin = plugin
    key = {"Authorization": "Bearer the-key"}

    async def main():
        transport = httpx.ASGITransport(app=middleware)
        async with httpx.AsyncClient(transport=transport, base_url="http://vllm") as client:
            feedback = "/v1/actmap/feedback"
            return (
                await client.post(feedback, json={"map_id": "b-0-1", "label": 1}),
                await client.post(
                    feedback, json={"map_id": "b-0-1", "label": 0, "source": "thumbs"}, headers=key
                ),  # fmt: skip
                await client.post(feedback, json={"map_id": "nope", "label": 1}, headers=key),
                await client.post(feedback, json={"map_id": "b-0-1", "label": 2}, headers=key),
                await client.get("/v1/actmap/review/queue", headers=key),
                await client.get("/review"),
            )

    try:
        no_key, labelled, unknown, bad, queue, page = asyncio.run(main())
    finally:
        asyncio.run(plugin.close())
    assert no_key.status_code == 401
    assert labelled.status_code == 200, labelled.text
    assert (labelled.json()["map_id"], labelled.json()["label"]) == ("b-0-1", 0)
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "map_not_found"
    assert bad.status_code == 400 and "label must be 0" in bad.json()["error"]["message"]
    assert queue.status_code == 200, queue.text
    # decided review: queued until labelled (b-0-1 now is)
    assert sorted(item["map_id"] for item in queue.json()["items"]) == ["b-0-0", "b-0-2"]
    assert page.status_code == 200 and "actmap review" in page.text
    from actmap.serve.audit import open_audit_store

    labels = open_audit_store(tmp_path / "audit").read_table("labels").to_pandas()
    assert labels[["id", "label", "source"]].values.tolist() == [["b-0-1", 0, "thumbs"]]


def _pushed_item(req_id: str, seed: int) -> dict:
    torch.manual_seed(seed)
    config = CaptureConfig(max_new_tokens=4)
    request = _Request(req_id, "", [5, 6], config, torch.randn(2, 3, 128), None,
                       token_ids=[7, 8, 9], recorded=3)  # fmt: skip
    return payload(request, 0)


class FakeClient:
    """vLLM's engine client as the plugin calls it: ``actmap_take`` returns ``held`` rows of the
    asked bases (taken once); every call is recorded."""

    def __init__(self, held: list[dict]) -> None:
        self.held, self.calls = held, []

    async def collective_rpc(self, method, args=()):
        self.calls.append((method, list(args[0])))
        if method != "actmap_take":
            return [len(args[0])]
        found = [
            dict(i, base=b)
            for b in args[0]
            for i in self.held
            if child_index(i["req_id"], b) is not None
        ]
        self.held = [
            i for i in self.held if all(child_index(i["req_id"], b) is None for b in args[0])
        ]
        return [found]


def test_pushed_rows_reach_the_request_that_expects_them_and_the_rpc_takes_the_rest(tmp_path):
    """The worker's socket brings each finished answer's rows to the API server that expects
    its request (another request's rows are not kept); when fewer than the request's answers
    come within ``push_wait_s``, the rest are taken by RPC, and rows that came by the socket
    are forgotten in the worker."""
    from actmap.capture.vllm_push import RowPublisher, RowSubscriber
    from actmap.serve.vllm_plugin import VllmPlugin, _answers, _Forget, _Rows

    assert _answers({"n": 3}, "chat") == 3 and _answers({}, "chat") == 1
    assert _answers({"prompt": ["a", "b"], "n": 2}, "completion") == 4
    assert _answers({"prompt": [1, 2, 3]}, "completion") == 1  # one prompt of token ids
    first, second = f"chatcmpl-{BASE}-aaaa1111", f"1_chatcmpl-{BASE}-bbbb2222"
    other = "chatcmpl-actmap-other-cccc3333"
    import tempfile
    from pathlib import Path

    import zmq

    too_long = RowPublisher(str(tmp_path / ("x" * 120)))  # no socket path is that long
    assert too_long.address.startswith("ipc:///tmp/actmap-rows-")
    assert len(too_long.address.removeprefix("ipc://")) <= zmq.IPC_PATH_MAX_LEN
    too_long.close()
    short = Path(tempfile.mkdtemp(prefix="actmap-push-", dir="/tmp"))
    publisher = RowPublisher(str(short))
    assert publisher.address.startswith(f"ipc://{short}/")

    async def scenario():
        subscriber = RowSubscriber(publisher.address, child_index)
        subscriber.expect(BASE)
        await asyncio.sleep(0.3)  # the subscription reaches the publisher
        for req_id, seed in ((second, 1), (other, 2), (first, 3)):
            publisher.send(_pushed_item(req_id, seed))
        got = await subscriber.take(BASE, 2, wait_s=10)
        assert sorted((i["index"], i["req_id"]) for i in got) == [(0, first), (1, second)]
        want = _pushed_item(second, 1)
        assert next(i for i in got if i["index"] == 1)["states"] == want["states"]
        assert await subscriber.take(BASE, 1, wait_s=0.2) == []  # nothing more came

        # the plugin: one answer pushed, its sibling only in the worker (RPC)
        plugin = object.__new__(VllmPlugin)
        client = FakeClient([_pushed_item(first, 4)])
        plugin.pushed, plugin.push_wait_s = subscriber, 0.3
        plugin.taker, plugin.forgetter = _Rows(client, "actmap_take"), _Forget(client)
        from prometheus_client import CollectorRegistry, Counter, Histogram

        registry = CollectorRegistry()
        plugin.rows_by = Counter("rows", "", ["way"], registry=registry)
        plugin.rows_wait = Histogram("rows_wait", "", registry=registry)
        publisher.send(_pushed_item(second, 5))
        rows = await plugin.rows(BASE, 2)
        assert sorted(i["req_id"] for i in rows) == sorted([first, second])
        assert client.calls == [("actmap_take", [BASE])]
        assert registry.get_sample_value("rows_wait_count") == 1  # the answer's wait, once
        # both pushed: no RPC waits, and the worker is told to drop them
        publisher.send(_pushed_item(first, 6))
        publisher.send(_pushed_item(second, 7))
        rows = await plugin.rows(BASE, 2)
        assert sorted(i["req_id"] for i in rows) == sorted([first, second])
        await plugin.forgetter.task
        assert client.calls[1:] == [("actmap_forget", [i["req_id"] for i in rows])]
        assert plugin.rows_by.labels("push")._value.get() == 2
        assert plugin.rows_by.labels("rpc")._value.get() == 1
        subscriber.expect("actmap-late")
        publisher.send(_pushed_item("chatcmpl-actmap-late-dddd4444", 8))
        await asyncio.sleep(0.3)
        assert [i["req_id"] for i in subscriber.release("actmap-late")] == [
            "chatcmpl-actmap-late-dddd4444"
        ]
        await subscriber.close()

    try:
        asyncio.run(scenario())
    finally:
        publisher.close()
    assert not list(short.iterdir())  # the socket's path is removed
    short.rmdir()
