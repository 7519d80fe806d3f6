"""One request path for every server mode (`actmap.serve.request_path`): the same malformed
request gets the same OpenAI-shaped error from the plain server and the proxy, each a real
uvicorn server on loopback, read with httpx and the official openai client; a conversation
without text is refused alike in every mode. (`--engine vllm` is vLLM's own server with the
actmap plugin: vLLM's own checks and errors, tests/test_vllm_plugin.py.)"""

from __future__ import annotations

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
from serve_helpers import (  # noqa: E402
    TINY_SOURCE,
    ServerThread,
    save_tiny_detector,
    tiny_engine,
    tiny_generator,
)

from actmap.serve.app import ServeSettings, create_app  # noqa: E402
from actmap.serve.engine import Engine  # noqa: E402
from actmap.serve.request_path import flatten_messages  # noqa: E402
from actmap.serve.settings import ProxySettings  # noqa: E402

USER = [{"role": "user", "content": "what is the capital of paris"}]
COMMON = dict(model="tiny", default_max_tokens=4, max_tokens_cap=16)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("run")
    save_tiny_detector(folder)
    return folder


def _upstream_app():
    def factory():
        model, tokenizer = tiny_generator()
        return Engine(model, tokenizer, TINY_SOURCE, None, max_context=64)

    return create_app(ServeSettings(**COMMON), factory)


@pytest.fixture(scope="module")
def servers(run):
    with ServerThread(_upstream_app()) as upstream:
        proxy = create_app(
            ServeSettings(detector=run, proxy=ProxySettings(upstream.url + "/v1"), **COMMON),
            lambda: tiny_engine(run),
        )
        plain = create_app(ServeSettings(detector=run, **COMMON), lambda: tiny_engine(run))
        with ServerThread(plain) as a, ServerThread(proxy) as b:
            yield {"plain": a.url, "proxy": b.url}


# (endpoint, body fields replacing a valid request's) -> the same error in every mode
MALFORMED = [
    ("chat", {"model": "gpt-4"}),
    ("chat", {"n": 2}),
    ("chat", {"messages": []}),
    ("chat", {"messages": [{"role": "user", "content": "   "}]}),
    ("chat", {"messages": [{"role": "user", "content": None}]}),
    ("chat", {"messages": [{"role": "system", "content": ""}, {"role": "user", "content": ""}]}),
    (
        "chat",
        {
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
            ]
        },
    ),  # fmt: skip
    ("chat", {"messages": "hello"}),
    ("chat", {"messages": [{"role": "wizard", "content": "hi"}]}),
    ("chat", {"actmap": {"abort_below": 2}}),
    ("completion", {"prompt": ""}),
    ("completion", {"prompt": "  \n"}),
    ("completion", {"prompt": ["a", "b"]}),
    ("completion", {"model": "gpt-4"}),
]

# what the first cases must say, written out once (the message a user reads)
EXPECTED = {
    0: (404, "The model 'gpt-4' does not exist; this server serves 'tiny'", "model_not_found"),
    1: (400, "n must be 1, got 2: one answer is scored", None),
    2: (400, "messages must not be empty", None),
    3: (400, "messages hold no text", None),
    4: (400, "messages hold no text", None),
    5: (400, "messages hold no text", None),
    6: (400, "messages hold no text", None),
    10: (400, "prompt must not be empty", None),
    11: (400, "prompt must not be empty", None),
    12: (400, "one prompt per request, got 2", None),
}


def _post(url: str, endpoint: str, fields: dict) -> httpx.Response:
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    base = {"model": "tiny", "max_tokens": 4}
    base.update({"messages": USER} if endpoint == "chat" else {"prompt": "what is the"})
    return httpx.post(url + path, json={**base, **fields}, timeout=30)


@pytest.mark.parametrize("case", range(len(MALFORMED)))
def test_the_same_malformed_request_gets_the_same_error_in_every_mode(servers, case):
    endpoint, fields = MALFORMED[case]
    answers = {mode: _post(url, endpoint, fields) for mode, url in servers.items()}
    plain = answers["plain"]
    assert 400 <= plain.status_code < 500, plain.text
    body = plain.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    for mode in ("proxy",):
        assert answers[mode].status_code == plain.status_code, (mode, answers[mode].text)
        assert answers[mode].json() == body, mode
    if case in EXPECTED:
        status, message, code = EXPECTED[case]
        assert (plain.status_code, body["error"]["message"], body["error"]["code"]) == (
            status, message, code,
        )  # fmt: skip
        assert body["error"]["param"] == ("model" if code else ("n" if case == 1 else (
            "messages" if endpoint == "chat" else "prompt")))  # fmt: skip


def test_bad_json_gets_the_same_error_in_every_mode(servers):
    answers = [
        httpx.post(
            url + "/v1/completions",
            content=b"{not json",
            headers={"content-type": "application/json"},
        )  # fmt: skip
        for url in servers.values()
    ]
    assert {a.status_code for a in answers} == {400}
    assert answers[0].json()["error"]["message"].startswith("invalid request")
    assert all(a.json() == answers[0].json() for a in answers)


def test_openai_client_reads_the_same_refusal_from_plain_server_and_proxy(servers):
    seen = []
    for mode in ("plain", "proxy"):
        client = openai.OpenAI(base_url=servers[mode] + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": " "}], max_tokens=4
            )
        with pytest.raises(openai.NotFoundError) as missing:
            client.completions.create(model="gpt-4", prompt="the", max_tokens=4)
        seen.append((refused.value.body, missing.value.body))
    assert seen[0][0]["message"] == "messages hold no text"
    assert seen[0] == seen[1]


def test_a_message_without_text_beside_one_with_text_is_answered(servers):
    """Only a conversation with no text at all is refused: an empty assistant turn is fine
    (plain server and proxy answer it, with a score)."""
    messages = [*USER, {"role": "assistant", "content": None}, {"role": "user", "content": "paris"}]
    for mode in ("plain", "proxy"):
        response = _post(servers[mode], "chat", {"messages": messages})
        assert response.status_code == 200, (mode, response.text)
        assert 0.0 <= response.json()["actmap"]["p_correct"] <= 1.0


def test_flatten_messages_keeps_text_parts_in_order():
    from actmap.serve.protocol import ChatMessage

    messages = [
        ChatMessage(role="system", content="be brief"),
        ChatMessage(
            role="user",
            content=[
                {"type": "text", "text": "what is "},
                {"type": "image_url", "image_url": {}},
                {"type": "text", "text": "this"},
            ],
        ),  # fmt: skip
        ChatMessage(role="assistant", content=None),
    ]
    assert flatten_messages(messages) == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "what is this"},
        {"role": "assistant", "content": ""},
    ]


def test_every_error_has_one_shape():
    """`APIError`'s JSON body and its stream event carry the same object."""
    import json

    from actmap.serve.request_path import APIError

    error = APIError(504, "request timed out after 1 s", type="timeout", code="t")
    response = error.response()
    assert response.status_code == 504
    expected = {"error": {"message": "request timed out after 1 s", "type": "timeout",
                          "param": None, "code": "t"}}  # fmt: skip
    assert json.loads(response.body) == expected
    event = error.event()
    assert event.startswith("data: ") and event.endswith("\n\n")
    assert json.loads(event[6:]) == expected


@pytest.mark.parametrize(
    ("words", "stop", "expected"),
    [
        ("paris is the capital", (), "paris is the capital"),
        ("paris is rome the", (" rome",), "paris is"),
        ("rome paris rome", (" rome",), "rome paris"),
    ],
)
def test_stream_emitter_sends_the_cut_answer_once(words, stop, expected):
    """Both step loops' `StreamEmitter`: fed the tokens one at a time, the deltas join to the
    answer cut before its stop string (worked by hand), and no delta carries the stop."""
    from actmap.serve.engine import Job, StreamEmitter

    _, tokenizer = tiny_generator()
    ids = tokenizer(words, add_special_tokens=False)["input_ids"]
    events = []
    job = Job(prompt="q", prompt_tokens=1, max_tokens=len(ids), stop=stop, sink=events.append)
    emitter = StreamEmitter(tokenizer, job)
    for t in range(1, len(ids) + 1):
        emitter.emit(ids[:t], None, t)
    assert "".join(e["text"] for e in events) == expected == emitter.sent
    assert all(e["text"] for e in events) and all(e["p_correct"] is None for e in events)
    assert all(s not in e["text"] for e in events for s in stop)
