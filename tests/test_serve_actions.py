"""Decisions that act (`actmap.serve.actions`): route to a second real server, abstain with a
message. Real uvicorn servers on loopback, driven by the official openai client; the route
target is a tiny random-weight `actmap serve` (other weights than the small model's) or a
misbehaving one (slow, garbage, 5xx, refusal, down)."""

from __future__ import annotations

import json
import math

import httpx
import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
from conftest import make_tiny_llama  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402
from serve_helpers import TINY_SOURCE, reference, save_tiny_detector, tiny_engine  # noqa: E402
from test_serve_proxy import ServerThread, free_port, misbehaving_upstream  # noqa: E402

from actmap.errors import ActmapUserError  # noqa: E402
from actmap.maps import build_map, stored_form  # noqa: E402
from actmap.serve.actions import action_for  # noqa: E402
from actmap.serve.app import ServeSettings, create_app  # noqa: E402
from actmap.serve.audit import AuditTrail, open_audit_store, read_audit  # noqa: E402
from actmap.serve.engine import Engine  # noqa: E402
from actmap.serve.policy import DECISIONS, Policy  # noqa: E402
from actmap.serve.settings import ActionSettings, ProxySettings  # noqa: E402
from actmap.store import MapStore  # noqa: E402

QUESTION = "what is the capital of paris"
MESSAGE = "I do not know."
ROUTE_ALL = Policy(accept=math.inf, review=math.inf, route=0.0)  # every answer decided "route"
ABSTAIN_ALL = Policy(accept=math.inf, review=math.inf, route=math.inf)  # every one "abstain"


def test_action_for_every_decision_and_setting():
    """The rule, by hand: route only with a target, abstain only with a message."""
    expected = {  # (route_to set, abstain_message set) -> decision -> action
        (False, False): {d: "answer" for d in DECISIONS},
        (True, False): {**{d: "answer" for d in DECISIONS}, "route": "route"},
        (False, True): {
            **{d: "answer" for d in DECISIONS}, "abstain": "abstain", "abstain_early": "abstain"
        },
        (True, True): {"accept": "answer", "review": "answer", "route": "route",
                       "abstain": "abstain", "abstain_early": "abstain"},
    }  # fmt: skip
    for (route, abstain), table in expected.items():
        settings = ActionSettings(
            route_to="http://127.0.0.1:1/v1" if route else None,
            abstain_message=MESSAGE if abstain else None,
        )
        assert {d: action_for(d, settings) for d in DECISIONS} == table
    # an empty message still acts (the operator chose it); "unscored" never does
    assert action_for("abstain", ActionSettings(abstain_message="")) == "abstain"
    assert action_for("unscored", ActionSettings(route_to="x", abstain_message="m")) == "answer"


# -- servers ----------------------------------------------------------------------------------


def big_target() -> ServerThread:
    """The route target: a plain `actmap serve` of another tiny model, served as "big"."""
    settings = ServeSettings(model="big", default_max_tokens=6, max_tokens_cap=16)

    def factory():
        engine = tiny_engine_plain()
        engine.model = make_tiny_llama(len(engine.tokenizer), seed=3)
        return engine

    return ServerThread(create_app(settings, factory))


def tiny_engine_plain() -> Engine:
    from serve_helpers import tiny_generator

    model, tokenizer = tiny_generator()
    return Engine(model, tokenizer, TINY_SOURCE, None, max_context=64)


def small_app(run, audit_root, policy: Policy, **settings):
    options = dict(model="tiny", detector=run, default_max_tokens=5, max_tokens_cap=16,
                   audit=audit_root, audit_text=True)  # fmt: skip
    options["actions"] = ActionSettings(**settings)

    def factory():  # the tests flush: no races
        return tiny_engine(
            run, policy, audit=AuditTrail(audit_root, keep_text=True, background=False)
        )

    return create_app(ServeSettings(**options), factory)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("run")
    save_tiny_detector(folder)
    return folder


@pytest.fixture(scope="module")
def target():
    with big_target() as server:
        yield server


@pytest.fixture(scope="module")
def router(run, target, tmp_path_factory):
    root = tmp_path_factory.mktemp("router") / "audit"
    app = small_app(run, root, ROUTE_ALL, route_to=target.url + "/v1", route_timeout_s=30.0)
    with ServerThread(app) as server:
        server.audit_root = root
        yield server


def audited(server) -> dict:
    """{map id: audit row} after a flush, and the stored maps by id."""
    server.app.state.actmap.engine.audit.flush()
    frame = read_audit(open_audit_store(server.audit_root))
    return {row.id: row for row in frame.itertuples()}


def stored_map(root, map_id) -> np.ndarray:
    for batch, meta in MapStore.open(root).iter_maps(batch_size=64, columns=("id",)):
        for key, value in zip(meta.column("id").to_pylist(), batch, strict=True):
            if key == map_id:
                return value.astype(np.float32)
    raise KeyError(map_id)


def small_reference(run, content=QUESTION, max_tokens=5):
    engine = tiny_engine(run)
    prompt = engine.render_chat([{"role": "user", "content": content}])
    return reference(engine, prompt, max_tokens=max_tokens)


def chat(content=QUESTION, **fields):
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], **fields}


# -- route ------------------------------------------------------------------------------------


def test_routed_answer_is_the_targets_with_the_small_models_score(router, target, run):
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0)
    messages = [{"role": "user", "content": QUESTION}]
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5)
    direct = httpx.post(
        target.url + "/v1/chat/completions",
        json={"model": "big", "messages": messages, "max_tokens": 5},
    ).json()
    gen, p_raw = small_reference(run)
    assert direct["choices"][0]["message"]["content"] != gen.answer  # the two models differ
    assert out.choices[0].message.content == direct["choices"][0]["message"]["content"]
    assert (
        out.model == "big" and out.usage.completion_tokens == direct["usage"]["completion_tokens"]
    )
    block = out.model_extra["actmap"]
    assert block["routed"] is True and block["route_model"] == "big"
    assert block["decision"] == "route" and "route_error" not in block
    assert block["p_correct_raw"] == pytest.approx(p_raw, abs=1e-5)  # the small model's score
    # the audit keeps the small model's answer, its map, and that it was routed
    row = audited(router)[block["map_id"]]
    assert row.answer == gen.answer and row.decision == "route"
    assert row.action == "routed" and row.route_model == "big" and row.p_correct_raw == pytest.approx(p_raw, abs=1e-5)  # fmt: skip
    expected = stored_form(build_map(gen.trajectory)).astype(np.float32)
    assert np.abs(stored_map(router.audit_root, block["map_id"]) - expected).max() <= 2e-3 * max(
        1.0, np.abs(expected).max()
    )


def test_routed_stream_and_completion(router, target):
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0)
    messages = [{"role": "user", "content": "who wrote the red river"}]
    plain = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4)
    chunks = list(
        client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=4, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    final = next(c for c in chunks if c.choices and c.choices[0].finish_reason)
    assert final.model_extra["actmap"]["routed"] is True and final.model == "big"
    assert final.model_extra["actmap"]["p_correct_raw"] == pytest.approx(
        plain.model_extra["actmap"]["p_correct_raw"], abs=1e-6
    )
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    completion = client.completions.create(model="tiny", prompt="the capital of", max_tokens=4)
    direct = httpx.post(
        target.url + "/v1/completions",
        json={"model": "big", "prompt": "the capital of", "max_tokens": 4},
    ).json()
    assert completion.choices[0].text == direct["choices"][0]["text"]
    assert completion.model_extra["actmap"]["routed"] is True


# -- a route target that fails -----------------------------------------------------------------


@pytest.fixture(scope="module")
def bad_router(run, tmp_path_factory):
    root = tmp_path_factory.mktemp("bad") / "audit"
    with ServerThread(misbehaving_upstream()) as up:  # lists one model: tiny-upstream
        app = small_app(run, root, ROUTE_ALL, route_to=up.url + "/v1", route_timeout_s=1.0)
        with ServerThread(app) as server:
            server.audit_root = root
            yield server


def counted(server, outcome: str) -> float:
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith(f'actmap_actions_total{{action="route",outcome="{outcome}"}}'):
            return float(line.split()[-1])
    return 0.0


@pytest.mark.parametrize(
    "content, kind, says",
    [("slow", "timeout", "did not answer within 1 s"), ("garbage", "malformed", "not JSON"),
     ("no choices", "malformed", "has no choices"), ("500", "http_5xx", "returned 500"),
     ("refuse", "refused", "refused the request (400): bad field")],
)  # fmt: skip
def test_failed_route_falls_back_to_the_small_answer_flagged(bad_router, run, content, kind, says):
    before = counted(bad_router, kind)
    rows = len(audited(bad_router))
    client = openai.OpenAI(base_url=bad_router.url + "/v1", api_key="none", max_retries=0)
    out = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": content}], max_tokens=5
    )
    gen, p_raw = small_reference(run, content)
    assert out.choices[0].message.content == gen.answer and out.model == "tiny"
    block = out.model_extra["actmap"]
    assert (
        block["routed"] is False and block["decision"] == "route" and says in block["route_error"]
    )
    assert block["p_correct_raw"] == pytest.approx(p_raw, abs=1e-5)
    assert counted(bad_router, kind) == before + 1
    after = audited(bad_router)
    assert len(after) == rows + 1  # nothing lost, the new answer kept
    row = after[block["map_id"]]
    assert row.action == "route_failed" and says in row.route_error


def test_failed_route_in_a_stream_replays_the_small_answer(bad_router, run):
    body = chat("garbage", stream=True, max_tokens=5, actmap={"stream_scores": True})
    with httpx.stream("POST", bad_router.url + "/v1/chat/completions", json=body) as response:
        events = [line[5:].strip() for line in response.iter_lines() if line.startswith("data:")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    gen, _ = small_reference(run, "garbage")
    assert text == gen.answer
    running = [c["actmap"] for c in chunks[:-1] if c.get("actmap")]
    assert running and all("n_tokens" in r for r in running)  # the held running scores, replayed
    final = chunks[-1]["actmap"]
    assert final["routed"] is False and "not JSON" in final["route_error"]


def test_route_target_down(run, tmp_path):
    closed = f"http://127.0.0.1:{free_port()}/v1"
    # without --route-model the target is asked for its model at start: refused in one line
    app = small_app(run, tmp_path / "a1", ROUTE_ALL, route_to=closed)
    with pytest.raises(ActmapUserError) as error, TestClient(app):
        pass
    assert str(error.value).startswith("--route-to: could not list the upstream's models")
    # with it, the server starts; each routed request falls back, flagged "unreachable"
    app = small_app(run, tmp_path / "a2", ROUTE_ALL, route_to=closed, route_model="big")
    with TestClient(app) as client:
        out = client.post("/v1/chat/completions", json=chat()).json()
    assert out["actmap"]["routed"] is False and "unreachable" in out["actmap"]["route_error"]


def test_route_and_abstain_refused_with_upstream(run, tmp_path):
    from actmap.serve.app import build_engine

    for extra in ({"route_to": "http://127.0.0.1:1/v1"}, {"abstain_message": MESSAGE}):
        settings = ServeSettings(
            model="tiny", detector=run, proxy=ProxySettings("http://127.0.0.1:1/v1"),
            actions=ActionSettings(**extra),
        )  # fmt: skip
        with pytest.raises(ActmapUserError, match="act on answers generated here"):
            build_engine(settings)
    with pytest.raises(ActmapUserError, match="with --route-to"):
        build_engine(
            ServeSettings(model="tiny", actions=ActionSettings(route_to="http://127.0.0.1:1/v1"))
        )


# -- abstain ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def abstainer(run, tmp_path_factory):
    root = tmp_path_factory.mktemp("abstain") / "audit"
    with ServerThread(small_app(run, root, ABSTAIN_ALL, abstain_message=MESSAGE)) as server:
        server.audit_root = root
        yield server


def test_abstain_replaces_the_answer_and_audits_the_original(abstainer, run):
    client = openai.OpenAI(base_url=abstainer.url + "/v1", api_key="none", max_retries=0)
    out = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": QUESTION}], max_tokens=5
    )
    gen, p_raw = small_reference(run)
    assert gen.answer and gen.answer != MESSAGE
    assert out.choices[0].message.content == MESSAGE
    assert out.choices[0].finish_reason == "content_filter"
    block = out.model_extra["actmap"]
    assert block["abstained"] is True and block["decision"] == "abstain"
    assert block["p_correct_raw"] == pytest.approx(p_raw, abs=1e-5)
    assert out.usage.completion_tokens == gen.n_tokens  # the small model's tokens were generated
    row = audited(abstainer)[block["map_id"]]
    assert row.answer == gen.answer and row.action == "abstained"  # the original: audit only
    streamed = list(client.completions.create(model="tiny", prompt=QUESTION, max_tokens=5, stream=True))  # fmt: skip
    assert "".join(c.choices[0].text for c in streamed if c.choices) == MESSAGE
    last = next(c for c in streamed if c.choices and c.choices[0].finish_reason)
    assert last.choices[0].finish_reason == "content_filter"
    assert last.model_extra["actmap"]["abstained"] is True


def test_abstain_early_stream_is_replaced(run, tmp_path):
    """A stream stopped by abort_below (decision abstain_early) under an accept-all policy."""
    root = tmp_path / "audit"
    accept_all = Policy(accept=0.0, review=0.0, route=0.0)
    with ServerThread(small_app(run, root, accept_all, abstain_message=MESSAGE)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        messages = [{"role": "user", "content": QUESTION}]
        kept = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5)
        assert kept.model_extra["actmap"]["decision"] == "accept"
        assert kept.choices[0].message.content != MESSAGE and "abstained" not in kept.model_extra["actmap"]  # fmt: skip
        chunks = list(
            client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=5, stream=True,
                extra_body={"actmap": {"abort_below": 1.0}},
            )
        )  # fmt: skip
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        final = chunks[-1]
        assert text == MESSAGE and final.choices[0].finish_reason == "content_filter"
        assert final.model_extra["actmap"]["decision"] == "abstain_early"
        server.app.state.actmap.engine.audit.flush()
        frame = read_audit(open_audit_store(root))
        row = frame[frame["id"] == final.model_extra["actmap"]["map_id"]].iloc[0]
        assert row["action"] == "abstained" and row["decision"] == "abstain_early"
        assert row["answer"] and row["answer"] != MESSAGE


def test_audit_actions_join_and_retention(tmp_path):
    """note_action rows join their answer in read_audit, survive a flush with no new answer,
    and leave with their answer's shard under retention."""
    from test_serve_audit import entries

    trail = AuditTrail(tmp_path / "a", background=False)
    trail.append(entries(0, size=3, decision="route"))
    trail.flush()
    trail.note_action("b-0-0", "routed", route_model="big")
    trail.note_action("b-0-1", "route_failed", route_error="timed out")
    assert trail.flush() == 0  # no answer committed, the actions are
    trail.append(entries(1, size=2, decision="abstain"))
    trail.note_action("b-1-0", "abstained")
    trail.flush()
    frame = read_audit(trail.store).set_index("id")
    assert frame.loc["b-0-0", ["action", "route_model"]].tolist() == ["routed", "big"]
    assert frame.loc["b-0-1", ["action", "route_error"]].tolist() == ["route_failed", "timed out"]
    assert frame.loc["b-1-0", "action"] == "abstained"
    assert frame["action"].isna().sum() == 2  # handed out as decided: no action row
    trail.max_rows = 2  # the first shard (3 answers) goes, with its actions
    assert trail.apply_retention() == 3
    kept = read_audit(trail.store)
    assert sorted(kept["id"]) == ["b-1-0", "b-1-1"]
    actions = trail.store.read_table("audit_actions").to_pandas()
    assert sorted(actions["id"]) == ["b-1-0"]
    trail.close()


def test_cli_refuses_an_unlisted_route_target_in_one_line(run, tmp_path):
    """`actmap serve --route-to` a closed port without --route-model: one line, exit 2,
    before anything listens."""
    from conftest import make_word_tokenizer
    from typer.testing import CliRunner

    from actmap.cli import app

    tokenizer = make_word_tokenizer()
    make_tiny_llama(len(tokenizer)).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    closed = f"http://127.0.0.1:{free_port()}/v1"
    args = ["serve", "--detector", str(run), "--model", str(tmp_path / "model"), "--route-to", closed]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    line = result.output.strip().splitlines()[-1]
    assert line.startswith("error: --route-to: could not list the upstream's models at " + closed)
