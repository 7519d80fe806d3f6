"""The proxy's checks at the settings where they decide: a greedy token that lies between
float32's and bfloat16's probe tolerance below the local one, an upstream that tokenizes the
probe prompt otherwise, and an upstream whose answer ids do not decode to its answer text (or
whose prompt ids are not the local ones). Each against a value worked out here by hand."""

from __future__ import annotations

import httpx
import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
from serve_helpers import save_tiny_detector  # noqa: E402
from test_serve_proxy import ServerThread  # noqa: E402
from test_serve_proxy_dtype import (  # noqa: E402
    QUESTIONS,
    engine_of,
    peaked_llama,
    tokenizer_with_template,
    vllm_like,
)

from actmap.capture import CaptureConfig  # noqa: E402
from actmap.capture.forced import capture_answers_batch  # noqa: E402
from actmap.capture.generate import stop_ids  # noqa: E402
from actmap.maps import build_map, stored_form  # noqa: E402
from actmap.serve.app import ServeSettings, create_app  # noqa: E402
from actmap.serve.settings import ProxySettings  # noqa: E402
from actmap.serve.upstream import PROBE_MESSAGES, PROBE_TOKENS, probe_weights  # noqa: E402


def greedy_path(model, prompt_ids: list[int], n: int) -> list[torch.Tensor]:
    """The log-probs (V,) at each of the first ``n`` greedy steps, by whole passes."""
    ids, out = list(prompt_ids), []
    with torch.inference_mode():
        for _ in range(n):
            logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, -1].float(), -1)
            out.append(logp)
            ids.append(int(logp.argmax()))
    return out


def test_a_greedy_token_between_float32s_and_bfloat16s_tolerance():
    """The upstream's greedy answer takes, at one step, a token .05-.25 nats below the local
    greedy one (what bfloat16 rounding can do): accepted when the upstream computes in
    bfloat16, named (step, both tokens, the margin) when both sides are float32."""
    tokenizer = tokenizer_with_template()
    model = peaked_llama(tokenizer)
    engine = engine_of(model, tokenizer)
    prompt_ids = engine.encode(engine.render_chat(list(PROBE_MESSAGES)))
    ends = stop_ids(model, tokenizer)
    path = greedy_path(model, prompt_ids, PROBE_TOKENS)
    ends = torch.tensor(sorted(ends))
    found = []
    for k, logp in enumerate(path):  # the first step with a token .07-.23 nats below greedy
        margins = logp.max() - logp
        near = (margins > 0.07) & (margins < 0.23)
        near[ends] = False
        if near.any():
            token = int(near.nonzero()[0])
            found.append((k, token, float(margins[token])))
            break
    ((step, token, margin),) = found
    force = [int(logp.argmax()) for logp in path[:step]] + [token]
    with ServerThread(vllm_like(model, tokenizer, force=force)) as upstream:
        url = upstream.url + "/v1"
        told = probe_weights(engine, url, "upstream", 30, "bfloat16")
        tight = probe_weights(engine, url, "upstream", 30)
    assert told.problem is None and told.tolerance == 0.25
    assert told.max_margin == pytest.approx(margin, abs=1e-4)  # the greedy path after is shared
    assert told.max_logprob_diff < 1e-4  # the same weights read the same tokens
    theirs, ours = tokenizer.decode([token]), tokenizer.decode([int(path[step].argmax())])
    assert tight.tolerance == 0.05 and tight.problem == (
        f"greedy probe token {step} is {theirs!r} upstream but {ours!r} here ({theirs!r} lies "
        f"{margin:.3f} nats below it; tolerance 0.05, local float32, upstream float32)"
    )


def test_an_upstream_that_tokenizes_the_probe_prompt_otherwise_is_named():
    tokenizer = tokenizer_with_template()
    model = peaked_llama(tokenizer)
    engine = engine_of(model, tokenizer)
    n = len(engine.encode(engine.render_chat(list(PROBE_MESSAGES))))

    def one_token_short(out, body):
        out["prompt_token_ids"] = out["prompt_token_ids"][:-1]

    with ServerThread(vllm_like(model, tokenizer, edit=one_token_short)) as upstream:
        probe = probe_weights(engine, upstream.url + "/v1", "upstream", 30)
    # the same weights and answer: only the prompt's tokens differ
    assert probe.upstream_answer == probe.local_answer
    assert probe.problem == (
        f"the upstream tokenizes the probe prompt differently ({n - 1} vs {n} tokens, "
        f"first difference at token {n - 1})"
    )


def test_answer_ids_that_do_not_decode_to_the_text_are_flagged_and_the_text_is_read(tmp_path):
    """Two misreports after an honest start-up probe: answer ids that are not the answer's
    (the proxy reads the text, flagged), and prompt ids that are not the local ones (the ids
    are read over the local prompt, flagged). p(correct) is the detector's reading of what the
    block says was read, computed here by a teacher-forced capture."""
    tokenizer = tokenizer_with_template()
    model = peaked_llama(tokenizer)
    save_tiny_detector(tmp_path / "run")

    def misreport(out, body):
        question = body["messages"][-1]["content"]
        if question == QUESTIONS[0]:  # ids of another answer: the text twice
            out["choices"][0]["token_ids"] = out["choices"][0]["token_ids"] * 2
        elif question == QUESTIONS[1]:
            out["prompt_token_ids"] = [*out["prompt_token_ids"], out["prompt_token_ids"][-1]]

    def factory():
        return engine_of(model, tokenizer, tmp_path / "run")

    with ServerThread(vllm_like(model, tokenizer, edit=misreport)) as upstream:
        settings = ServeSettings(
            model="tiny", detector=tmp_path / "run", proxy=ProxySettings(upstream.url + "/v1")
        )
        with ServerThread(create_app(settings, factory)) as proxy:
            engine = proxy.app.state.actmap.engine
            assert proxy.app.state.actmap.proxy.probe.problem is None
            outs = [
                httpx.post(
                    proxy.url + "/v1/chat/completions", timeout=60,
                    json={"model": "tiny", "messages": [{"role": "user", "content": q}],
                          "max_tokens": 6},
                ).json()
                for q in QUESTIONS
            ]  # fmt: skip
    config = CaptureConfig(max_new_tokens=6, max_context=64, greybox=False)
    for question, out in zip(QUESTIONS, outs, strict=True):
        text = out["choices"][0]["message"]["content"]
        assert text  # a non-empty answer, so twice its ids decode to another text
        prompt = engine.render_chat([{"role": "user", "content": question}])
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        (forced,) = capture_answers_batch(model, tokenizer, [prompt], [ids], config)
        grid = stored_form(build_map(forced.trajectory))[None]
        expected = float(engine.detector.predict_proba(grid)[0])
        block = out["actmap"]
        assert block["p_correct_raw"] == pytest.approx(expected, abs=1e-5)
        assert block["tokens"]["mismatch"] is True
    first, second = outs[0]["actmap"]["tokens"], outs[1]["actmap"]["tokens"]
    assert first["source"] == "retokenized"
    assert "the upstream's ids do not decode to its answer text" in first["detail"]
    assert second["source"] == "upstream_ids"
    n = len(engine.encode(engine.render_chat([{"role": "user", "content": QUESTIONS[1]}])))
    assert second["detail"].startswith(
        f"the upstream's prompt ids ({n + 1}) differ from the local tokenization ({n})"
    )
