"""Proxy mode across dtypes: the detector's dtype rule, the dtype-aware weights probe, and a
bfloat16 proxy reading the answers of a float32 and of a bfloat16 upstream.

The upstream here is vLLM-shaped (greedy, ``return_token_ids``, chat log-probs) over a tiny
Llama whose large initial weights give peaked next-token distributions, as a trained model's
are: rounding to bfloat16 then moves log-probs by about a tenth of a nat, other weights by
whole nats."""

from __future__ import annotations

import time
from dataclasses import replace

import httpx
import numpy as np
import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
from conftest import make_tiny_llama, make_word_tokenizer  # noqa: E402
from fastapi import FastAPI, Request  # noqa: E402
from serve_helpers import CHAT_TEMPLATE, TINY_SOURCE, save_tiny_detector  # noqa: E402
from test_serve_proxy import ServerThread  # noqa: E402

from actmap.capture import CaptureConfig, generate_with_capture  # noqa: E402
from actmap.capture.forced import capture_answers_batch, forced_prefix  # noqa: E402
from actmap.errors import ActmapUserError  # noqa: E402
from actmap.maps import build_map, stored_form  # noqa: E402
from actmap.serve.app import ServeSettings, build_engine, create_app  # noqa: E402
from actmap.serve.audit import AuditTrail  # noqa: E402
from actmap.serve.engine import Engine  # noqa: E402
from actmap.serve.loaded_run import load_detector_run  # noqa: E402
from actmap.serve.settings import ProxySettings  # noqa: E402
from actmap.serve.upstream import (  # noqa: E402
    PROBE_TOLERANCE,
    local_reading,
    probe_tolerance,
    probe_weights,
)
from actmap.store import MapStore  # noqa: E402

QUESTIONS = ("what is the capital of paris", "how many days are in two weeks")


def tokenizer_with_template():
    tokenizer = make_word_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def peaked_llama(tokenizer, seed: int = 0, noise: float = 0.0, dtype=torch.float32):
    """The tiny Llama with peaked outputs; ``noise``: relative Gaussian noise on every weight
    (another checkpoint of the same architecture)."""
    model = make_tiny_llama(len(tokenizer), seed=seed, initializer_range=0.5)
    if noise:
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=generator) * p.std() * noise)
    return model.to(dtype)


def vllm_like(model, tokenizer, force=(), edit=None) -> FastAPI:
    """An OpenAI chat server answering greedily as vLLM does: token ids when asked
    (``return_token_ids``, end token included), per-token log-probs of the raw logits.
    ``force``: the answer's first tokens, whatever is greedy (then greedy on); ``edit(out,
    body)`` changes the answer to request ``body`` before it is sent (an upstream that
    misreports)."""
    app = FastAPI()

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": "upstream", "object": "model"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        prompt = tokenizer.apply_chat_template(
            body["messages"], add_generation_prompt=True, tokenize=False
        )
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        answer, logprobs = [], []
        with torch.inference_mode():
            for step in range(body.get("max_tokens") or 16):
                logits = model(input_ids=torch.tensor([prompt_ids + answer])).logits[0, -1]
                logp = torch.log_softmax(logits.float(), -1)
                answer.append(force[step] if step < len(force) else int(logp.argmax()))
                logprobs.append(float(logp[answer[-1]]))
                if answer[-1] == tokenizer.eos_token_id:
                    break
        choice = {
            "index": 0, "finish_reason": "stop" if answer[-1] == tokenizer.eos_token_id else "length",
            "message": {"role": "assistant", "content": tokenizer.decode(answer, skip_special_tokens=True)},
        }  # fmt: skip
        if body.get("logprobs"):
            choice["logprobs"] = {"content": [{"logprob": lp} for lp in logprobs]}
        out = {"id": "chatcmpl-1", "object": "chat.completion", "created": int(time.time()),
               "model": "upstream", "choices": [choice],
               "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(answer)}}  # fmt: skip
        if body.get("return_token_ids"):
            choice["token_ids"], out["prompt_token_ids"] = answer, prompt_ids
        if edit is not None:
            edit(out, body)
        return out

    return app


def engine_of(model, tokenizer, run=None, audit=None) -> Engine:
    detector = load_detector_run(run) if run is not None else None
    return Engine(model, tokenizer, TINY_SOURCE, detector, max_context=64, audit=audit)


def test_probe_tolerance_follows_the_coarser_dtype():
    assert probe_tolerance("float32", "float32") == PROBE_TOLERANCE["float32"] == 0.05
    assert probe_tolerance("bfloat16", "float32") == probe_tolerance("float32", "bfloat16")
    assert probe_tolerance("float32", "bfloat16") == PROBE_TOLERANCE["bfloat16"] == 0.25
    with pytest.raises(ValueError, match="int8"):
        probe_tolerance("float32", "int8")


def test_local_reading_equals_a_naive_loop_of_whole_passes():
    tokenizer = tokenizer_with_template()
    model = peaked_llama(tokenizer, dtype=torch.bfloat16)
    engine = engine_of(model, tokenizer)
    prompt = tokenizer("what is the capital of paris", add_special_tokens=False)["input_ids"]
    answer = tokenizer("rome red the", add_special_tokens=False)["input_ids"]  # not greedy
    chosen, margins, best = local_reading(engine, prompt, answer, ended=True)
    expected_chosen, expected_margins, expected_best = [], [], []
    with torch.inference_mode():
        for t in range(len(answer) + 1):
            logits = model(input_ids=torch.tensor([prompt + answer[:t]])).logits[0, -1]
            logp = torch.log_softmax(logits.float(), -1)
            expected_best.append(int(logp.argmax()))
            if t < len(answer):
                expected_chosen.append(float(logp[answer[t]]))
                expected_margins.append(float(logp.max() - logp[answer[t]]))
            else:  # the end token after the answer
                expected_margins.append(float(logp.max() - logp[tokenizer.eos_token_id]))
    # bfloat16: one pass over the whole sequence vs growing passes, same rounding per row
    np.testing.assert_allclose(chosen, expected_chosen, atol=0.05)
    np.testing.assert_allclose(margins, expected_margins, atol=0.05)
    assert max(margins) > 1.0  # the words were chosen to be far from greedy
    far = [t for t, m in enumerate(expected_margins) if m > 0.1]  # no near tie to flip
    assert far and [best[t] for t in far] == [expected_best[t] for t in far]
    # an upstream that ended at once: no tokens, one margin (its end token's)
    with torch.inference_mode():
        logp = torch.log_softmax(model(input_ids=torch.tensor([prompt])).logits[0, -1].float(), -1)
    chosen, margins, best = local_reading(engine, prompt, [], ended=True)
    assert (
        chosen == []
        and best == [int(logp.argmax())]
        and margins == [pytest.approx(float(logp.max() - logp[1]), abs=0.05)]
    )


def test_the_probe_accepts_the_same_weights_across_dtypes_within_its_stated_tolerance():
    tokenizer = tokenizer_with_template()
    float32 = peaked_llama(tokenizer)
    with (
        ServerThread(vllm_like(float32, tokenizer)) as up32,
        ServerThread(vllm_like(peaked_llama(tokenizer, dtype=torch.bfloat16), tokenizer)) as up16,
    ):
        # a bfloat16 proxy reading a float32 upstream: bfloat16's tolerance
        bf16 = engine_of(peaked_llama(tokenizer, dtype=torch.bfloat16), tokenizer)
        probe = probe_weights(bf16, up32.url + "/v1", "upstream", 30, "float32")
        assert probe.problem is None and probe.token_ids, probe.problem
        assert probe.dtypes == ("bfloat16", "float32") and probe.tolerance == 0.25
        # rounding to bfloat16 moved the log-probs past float32's tolerance: the probe needs
        # the dtype-aware one
        assert PROBE_TOLERANCE["float32"] < probe.max_logprob_diff < probe.tolerance
        # a float32 proxy in front of a bfloat16 upstream it was not told about: refused,
        # naming the option; told, it passes
        fp32 = engine_of(float32, tokenizer)
        refused = probe_weights(fp32, up16.url + "/v1", "upstream", 30)
        assert refused.problem is not None and "--upstream-dtype" in refused.problem
        assert "tolerance 0.05, local float32, upstream float32" in refused.problem
        told = probe_weights(fp32, up16.url + "/v1", "upstream", 30, "bfloat16")
        assert told.problem is None and told.tolerance == 0.25
        # float32 on both sides: the old, tight check
        same = probe_weights(fp32, up32.url + "/v1", "upstream", 30)
        assert same.problem is None and same.max_logprob_diff < 1e-4 and same.max_margin == 0


@pytest.mark.parametrize(
    "other", [{"noise": 0.01}, {"seed": 7}], ids=["1%-weight-noise", "another-init"]
)
def test_the_probe_still_catches_other_weights_in_bfloat16(other):
    tokenizer = tokenizer_with_template()
    with ServerThread(vllm_like(peaked_llama(tokenizer, **other), tokenizer)) as upstream:
        bf16 = engine_of(peaked_llama(tokenizer, dtype=torch.bfloat16), tokenizer)
        probe = probe_weights(bf16, upstream.url + "/v1", "upstream", 30, "float32")
    assert probe.problem is not None and "tolerance 0.25" in probe.problem, probe
    # what differed, in nats: a greedy token far below the local one, or the log-probs
    assert (probe.max_margin or 0) > 0.25 or (probe.max_logprob_diff or 0) > 0.25


def test_the_proxy_reads_in_the_dtype_the_detectors_maps_were_captured_in(tiny_model_dir, tmp_path):
    fp32_run, bf16_run = tmp_path / "fp32", tmp_path / "bf16"
    save_tiny_detector(fp32_run)
    detector = save_tiny_detector(bf16_run)
    config = (detector / "config.json").read_text()  # as if fit on a bfloat16 store
    (detector / "config.json").write_text(
        config.replace('"metadata": {}', '"metadata": {"inputs": {"store_config": {"model": {"dtype": "bfloat16"}}}}')
    )  # fmt: skip
    assert load_detector_run(bf16_run).dtype == "bfloat16"
    upstream = ProxySettings("http://127.0.0.1:9/v1")  # never contacted
    proxy = dict(model=str(tiny_model_dir), proxy=upstream)
    with pytest.raises(ActmapUserError) as refused:
        build_engine(ServeSettings(detector=fp32_run, dtype="bfloat16", **proxy))
    message = str(refused.value)
    assert "fit on maps captured in float32" in message and "--allow-dtype-mismatch" in message
    allowed = build_engine(
        ServeSettings(
            model=str(tiny_model_dir),
            detector=fp32_run,
            dtype="bfloat16",
            proxy=replace(upstream, allow_dtype_mismatch=True),
        )  # fmt: skip
    )
    assert next(allowed.model.parameters()).dtype == torch.bfloat16
    default = build_engine(ServeSettings(detector=bf16_run, **proxy))  # the detector's dtype
    assert next(default.model.parameters()).dtype == torch.bfloat16
    with pytest.raises(ActmapUserError, match="dtype must be one of"):
        build_engine(
            ServeSettings(
                model=str(tiny_model_dir), detector=bf16_run, proxy=replace(upstream, dtype="int8")
            )
        )
    # the CLI: one line, exit code 2, before anything is contacted
    from typer.testing import CliRunner

    from actmap.cli import app

    base = ["serve", "--model", str(tiny_model_dir), "--upstream", "http://127.0.0.1:9/v1"]
    result = CliRunner().invoke(app, [*base, "--detector", str(fp32_run), "--dtype", "bfloat16"])
    assert result.exit_code == 2, result.output
    line = result.output.strip().splitlines()[-1]
    assert line.startswith("error: --dtype bfloat16") and "--allow-dtype-mismatch" in line
    result = CliRunner().invoke(
        app, [*base, "--detector", str(bf16_run), "--upstream-dtype", "fp8"]
    )
    assert result.exit_code == 2 and "dtype must be one of" in result.output


def maps_by_id(root) -> dict:
    maps = {}
    for batch, meta in MapStore.open(root).iter_maps(batch_size=64, columns=("id",)):
        maps.update(zip(meta.column("id").to_pylist(), batch, strict=True))
    return maps


# bfloat16 rounds every state to 8 mantissa bits: the one teacher-forced pass and generation's
# step-by-step passes (other shapes, other rounding) gave maps within 1.3% of the map's largest
# value on this model and 3% on SmolLM2-135M-Instruct; float32's differ by ~1e-6 of it
BF16_MAP_TOLERANCE = 0.04


@pytest.mark.parametrize("upstream_dtype", ["float32", "bfloat16"])
def test_a_bfloat16_proxy_reads_the_map_bfloat16_generation_gives(upstream_dtype, tmp_path):
    tokenizer = tokenizer_with_template()
    dtype = getattr(torch, upstream_dtype)
    save_tiny_detector(tmp_path / "run")
    local = peaked_llama(tokenizer, dtype=torch.bfloat16)
    settings = ServeSettings(model="tiny", detector=tmp_path / "run", audit=tmp_path / "audit")

    def factory():
        trail = AuditTrail(tmp_path / "audit", background=False)
        return engine_of(local, tokenizer, tmp_path / "run", audit=trail)

    with (
        ServerThread(vllm_like(peaked_llama(tokenizer, dtype=dtype), tokenizer)) as upstream,
        ServerThread(
            create_app(
                replace(settings, proxy=ProxySettings(upstream.url + "/v1", dtype=upstream_dtype)),
                factory,
            )
        ) as proxy,
    ):
        state = proxy.app.state.actmap
        assert state.proxy.probe.problem is None and state.proxy.probe.token_ids
        blocks = []
        for question in QUESTIONS:
            body = {"model": "tiny", "messages": [{"role": "user", "content": question}],
                    "max_tokens": 8}  # fmt: skip
            out = httpx.post(proxy.url + "/v1/chat/completions", json=body, timeout=60).json()
            tokens = out["actmap"]["tokens"]  # (<unk> re-tokenizes otherwise: a detail)
            assert tokens["source"] == "upstream_ids" and tokens["mismatch"] is False
            blocks.append((question, out))
        state.engine.audit.flush()
        metrics = httpx.get(proxy.url + "/metrics", timeout=30).text
    # the proxy's teacher-forced passes are counted apart from generation (none here)
    assert "actmap_batch_forced_size_sum 2.0" in metrics
    assert "actmap_batch_forced_seconds_count 2.0" in metrics
    assert "actmap_batch_generation_seconds_count 0.0" in metrics
    maps = maps_by_id(tmp_path / "audit")
    compared = 0
    for question, out in blocks:
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
        )
        config = CaptureConfig(max_new_tokens=8, max_context=64, greybox=False)
        (generated,) = generate_with_capture(local, tokenizer, [prompt], config)
        if generated.answer != out["choices"][0]["message"]["content"]:
            # only a float32 upstream may choose another greedy answer than bfloat16 here
            assert upstream_dtype == "float32"
            continue
        expected = stored_form(build_map(generated.trajectory)).astype(np.float32)
        served = maps[out["actmap"]["map_id"]].astype(np.float32)
        assert np.abs(served - expected).max() <= BF16_MAP_TOLERANCE * np.abs(expected).max()
        compared += 1
    assert compared >= 1


def test_the_cached_chat_prefix_pass_in_bfloat16_equals_bfloat16_generation():
    """The proxy's batched pass over a chat template's cached system turn (`ForcedPrefix`), in
    bfloat16: the maps of generation-time capture in bfloat16 for the same tokens, within
    the stated tolerance; float32's stay within 1e-4."""
    tokenizer = make_word_tokenizer()
    tokenizer.chat_template = "the capital of the city is {% for m in messages %}{{ m['content'] }} {% endfor %}"  # fmt: skip
    questions = [*QUESTIONS, "red blue", "who wrote the answer"]
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        for q in questions
    ]  # fmt: skip
    shared = tokenizer(prompts[0], add_special_tokens=False)["input_ids"][:6]
    gaps = {}
    for dtype, tolerance in ((torch.float32, 1e-4), (torch.bfloat16, BF16_MAP_TOLERANCE)):
        model = peaked_llama(tokenizer, dtype=dtype)
        config = CaptureConfig(max_new_tokens=8, batch_size=2, greybox=False)
        generated = generate_with_capture(model, tokenizer, prompts, config)
        forced = capture_answers_batch(
            model, tokenizer, prompts, [g.token_ids for g in generated],
            CaptureConfig(batch_size=len(prompts), greybox=False), prefix=forced_prefix(model, shared),
        )  # fmt: skip
        gaps[dtype] = []
        for g, f in zip(generated, forced, strict=True):
            assert f.token_ids == g.token_ids and g.n_tokens > 0
            a, b = build_map(g.trajectory), build_map(f.trajectory)
            gaps[dtype].append(float((a - b).abs().max() / a.abs().max()))
        assert max(gaps[dtype]) <= tolerance, (dtype, gaps[dtype])
    assert max(gaps[torch.bfloat16]) > 10 * max(gaps[torch.float32])  # bfloat16's rounding shows
