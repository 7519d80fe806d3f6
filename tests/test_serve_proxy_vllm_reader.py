"""Proxy mode reading through vLLM (``actmap serve --upstream URL --reader vllm``): the
upstream's answers are read by teacher-forced requests to an in-process vLLM engine of the same
weights (`actmap.serve.vllm_reader.InProcessReader`) instead of transformers passes.

A random-weight Llama folder vLLM's CPU attention runs (`test_vllm_plugin.tiny_folder`) and an
actmap-plus detector (maps + log-probs + entropies); the upstream is ``actmap serve`` without a
detector over the same folder (transformers, a uvicorn thread on loopback). Reference: the
transformers teacher-forced reading of the answer's tokens, scored by the detector directly.
"""

from __future__ import annotations

import httpx
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'actmap[vllm]')")
pytest.importorskip("uvicorn")
from serve_helpers import ServerThread  # noqa: E402
from test_vllm_plugin import (  # noqa: E402
    detector_for,
    expected,
    load_reference,
    same_map,
    same_score,
    tiny_folder,
)

from actmap.serve.app import ServeSettings, build_engine, create_app  # noqa: E402
from actmap.serve.settings import ProxySettings  # noqa: E402

pytestmark = [pytest.mark.real_model, pytest.mark.vllm]
MESSAGES = [{"role": "user", "content": "what is the capital city"}]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    root = tmp_path_factory.mktemp("proxy-vllm")
    folder = tiny_folder(root / "tiny")
    run = detector_for(root / "run", folder)
    upstream_settings = ServeSettings(model=str(folder), served_model_name="tiny",
                                      default_max_tokens=6)  # fmt: skip
    upstream_engine = build_engine(upstream_settings)
    with ServerThread(create_app(upstream_settings, lambda: upstream_engine)) as upstream:
        settings = ServeSettings(
            model=str(folder), served_model_name="tiny", detector=run, audit=root / "audit",
            proxy=ProxySettings(upstream.url + "/v1", reader="vllm"),
        )  # fmt: skip
        engine = build_engine(settings)  # the in-process vLLM engine is built here
        try:
            with ServerThread(create_app(settings, lambda: engine)) as proxy:
                yield {"proxy": proxy, "engine": engine, "folder": folder, "run": run,
                       "root": root}  # fmt: skip
        finally:
            engine.forced_reader.close()


def test_the_proxy_reads_the_upstreams_answer_through_vllm(servers):
    from actmap.serve.vllm_reader import InProcessReader

    engine, url = servers["engine"], servers["proxy"].url
    state = servers["proxy"].app.state.actmap
    assert isinstance(state.scorer.run_batch, InProcessReader)
    reference = load_reference(servers["folder"], servers["run"])
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 6, "temperature": 0}
    answers = [httpx.post(url + "/v1/chat/completions", json=body, timeout=120).json()
               for _ in range(2)]  # fmt: skip
    recorder = engine.forced_reader.capture.recorder
    assert recorder.prefix_cache_hits == 0  # the second reading of the pair was computed anew
    for out in answers:
        block = out["actmap"]
        text = out["choices"][0]["message"]["content"]
        tokens = engine.encode(text, False)
        assert block["tokens"]["source"] == "retokenized" and not block["tokens"]["mismatch"]
        p_raw, stored = expected(reference, tokens)
        assert same_score(block["p_correct_raw"], p_raw), (block, p_raw)
    # /v1/actmap/score on the proxy reads through vLLM too
    scored = httpx.post(url + "/v1/actmap/score", timeout=120, json={"items": [
        {"messages": MESSAGES, "answer_token_ids": tokens}]})  # fmt: skip
    assert scored.status_code == 200, scored.text
    (result,) = scored.json()["results"]
    assert same_score(result["p_correct_raw"], p_raw)
    engine.audit.flush()
    from test_vllm_plugin import audit_maps

    maps = audit_maps(servers["root"] / "audit", {result["map_id"], block["map_id"]})
    assert same_map(maps[result["map_id"]], stored) and same_map(maps[block["map_id"]], stored)


def test_readings_share_prompt_blocks_and_never_skip_answer_rows(servers):
    """Readings whose prompts start with the same system prompt share its cached block; a pair
    read again later, whose blocks are then cached past its prompt (its answer rows), is caught
    by its all-zero first row and computed anew. Each scores as the transformers reading."""
    from conftest import WORDS

    from actmap.serve.answers import ScoreJob

    engine = servers["engine"]
    reader = engine.forced_reader
    reference = load_reference(servers["folder"], servers["run"])
    system = {"role": "system", "content": " ".join(WORDS[i % 20] for i in range(40))}
    first = [system, {"role": "user", "content": "what is the capital city"}]  # 45 tokens
    second = [system, {"role": "user", "content": "what is a river"}]  # 44 tokens
    answer = engine.encode(" ".join(WORDS[(3 * i) % 30] for i in range(30)), False)
    pairs = [(first, answer), (second, answer[:5]), (first, answer)]
    recorder = reader.capture.recorder
    hits, reread = recorder.prefix_cache_hits, reader.reread
    results = []
    for messages, ids in pairs:  # a batch each: the third finds all of the first's blocks
        (scored,), _ = reader([ScoreJob(engine.render_chat(messages), list(ids))])
        results.append(scored)
    # block 0 (32 tokens of the system prompt) shared by the second and third readings; the
    # third's cached blocks reached position 64, past its prompt (45): read again
    assert recorder.prefix_cache_hits - hits == 2
    assert reader.reread - reread == 1
    for (messages, ids), scored in zip(pairs, results, strict=True):
        p_raw, stored = expected(reference, ids, messages)
        assert same_score(scored.p_correct_raw, p_raw), (scored.p_correct_raw, p_raw)
        assert same_map(scored.map, stored)


def test_reader_needs_an_upstream(tmp_path):
    from typer.testing import CliRunner

    from actmap.cli import app

    out = CliRunner().invoke(app, ["serve", "--model", "x", "--reader", "vllm"])
    assert out.exit_code != 0 and "--reader reads an upstream's answers" in out.output
    out = CliRunner().invoke(app, ["serve", "--model", "x", "--upstream", "http://127.0.0.1:9/v1",
                                   "--reader", "sglang"])  # fmt: skip
    assert out.exit_code != 0 and "--reader must be 'transformers' or 'vllm'" in out.output
