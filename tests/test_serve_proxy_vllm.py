"""Proxy mode in front of a real vLLM OpenAI server (the CPU build, float32 SmolLM2) on loopback.

vLLM runs from this interpreter (`make test` installs ``actmap[vllm]``) or from another
virtual environment named by ``ACTMAP_VLLM_PYTHON``; the test is skipped, saying why, where
that python cannot import vllm. It starts with ``--enforce-eager`` (no compilation: about two minutes
on two busy cores instead of five); ``ACTMAP_VLLM_URL`` reuses a server already running. vLLM reads a transformers folder: the de-quantized SmolLM2
folder `actmap.llm.models.load_model` caches (safetensors, no quantization_config).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
from serve_helpers import save_tiny_detector, stop_process_group  # noqa: E402
from test_serve_proxy import ServerThread, audit_rows, free_port  # noqa: E402

from actmap.capture import CaptureConfig, generate_with_capture  # noqa: E402
from actmap.maps import build_map, stored_form  # noqa: E402
from actmap.serve.app import ServeSettings, create_app  # noqa: E402
from actmap.serve.audit import AuditTrail  # noqa: E402
from actmap.serve.engine import Engine  # noqa: E402
from actmap.serve.loaded_run import load_detector_run  # noqa: E402
from actmap.serve.settings import ProxySettings  # noqa: E402
from actmap.store import MapStore  # noqa: E402

pytestmark = pytest.mark.real_model
VLLM_PYTHON = os.environ.get("ACTMAP_VLLM_PYTHON", sys.executable)
QUESTIONS = ("What is the capital of France?", "Who wrote Hamlet? Answer in a few words.")
MAX_TOKENS = 12


def vllm_missing() -> str | None:
    if not Path(VLLM_PYTHON).is_file():
        return f"no vLLM python at {VLLM_PYTHON} (set ACTMAP_VLLM_PYTHON)"
    check = subprocess.run(
        [VLLM_PYTHON, "-c", "import vllm"], capture_output=True, text=True, timeout=300
    )
    if check.returncode != 0:
        return f"{VLLM_PYTHON} cannot import vllm: {check.stderr.strip().splitlines()[-1:]}"
    return None


def converted_folder(source) -> Path:
    """The de-quantized transformers folder `load_model` caches for a GGUF model."""
    from actmap.llm.models import cache_dir

    folder = cache_dir() / f"{Path(source.gguf_file).stem}-{source.revision}"
    assert (folder / "model.safetensors").is_file(), folder
    return folder


@pytest.fixture(scope="module")
def vllm_server(smollm2, tmp_path_factory):
    running = os.environ.get("ACTMAP_VLLM_URL")  # a server already serving SmolLM2 as "smollm2"
    if running:
        yield running.rstrip("/")
        return
    reason = vllm_missing()
    if reason:
        pytest.skip(reason)
    _, _, source = smollm2
    port = free_port()
    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONPATH", None)
    with open(log, "w") as out:
        process = subprocess.Popen(
            [VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model",
             str(converted_folder(source)), "--served-model-name", "smollm2", "--dtype", "float32",
             "--port", str(port), "--max-model-len", "2048", "--enforce-eager"],
            env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 900
    while time.time() < deadline:
        if process.poll() is not None:
            pytest.fail(f"vLLM exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(2)
    else:
        os.killpg(process.pid, signal.SIGKILL)
        pytest.fail("vLLM did not come up in 900 s")
    yield url
    stop_process_group(process)


@pytest.fixture(scope="module")
def proxy(vllm_server, smollm2, tmp_path_factory):
    model, tokenizer, source = smollm2
    root = tmp_path_factory.mktemp("vllm-proxy")
    save_tiny_detector(root / "run")
    settings = ServeSettings(
        model="smollm2-135m-instruct", detector=root / "run", served_model_name="smollm2",
        proxy=ProxySettings(vllm_server + "/v1"), audit=root / "audit",
    )  # fmt: skip

    def factory():
        trail = AuditTrail(root / "audit", background=False)
        return Engine(model, tokenizer, source, load_detector_run(root / "run"), audit=trail)

    with ServerThread(create_app(settings, factory)) as server:
        server.audit_root = root / "audit"
        yield server


def test_proxy_in_front_of_vllm_reads_the_generation_time_map(proxy, vllm_server, smollm2):
    model, tokenizer, _ = smollm2
    state = proxy.app.state.actmap
    probe = state.proxy.probe
    assert probe.problem is None and probe.token_ids  # vLLM returns ids; same weights
    assert probe.max_logprob_diff is not None and probe.max_logprob_diff < 0.05
    engine = state.engine
    for question in QUESTIONS:
        body = {"model": "smollm2", "messages": [{"role": "user", "content": question}],
                "max_tokens": MAX_TOKENS, "temperature": 0}  # fmt: skip
        direct = httpx.post(vllm_server + "/v1/chat/completions", json=body, timeout=120).json()
        out = httpx.post(proxy.url + "/v1/chat/completions", json=body, timeout=120).json()
        block = out.pop("actmap")
        for answer in (out, direct):
            answer.pop("id"), answer.pop("created")
        assert out == direct  # vLLM's body unchanged, the ids the proxy asked for read null again
        assert block["tokens"] == {"source": "upstream_ids", "mismatch": False}
        # generation-time capture of the same prompt with the same (local) weights
        prompt = engine.render_chat([{"role": "user", "content": question}])
        config = CaptureConfig(max_new_tokens=MAX_TOKENS, max_context=2048, greybox=False)
        (gen,) = generate_with_capture(model, tokenizer, [prompt], config)
        assert gen.answer == out["choices"][0]["message"]["content"]
        expected = stored_form(build_map(gen.trajectory))
        p_raw = float(engine.detector.detector.predict_proba(expected[None])[0])
        assert block["p_correct_raw"] == pytest.approx(p_raw, abs=1e-5)
        engine.audit.flush()
        store = MapStore.open(proxy.audit_root)
        maps = {}
        for batch, meta in store.iter_maps(batch_size=64, columns=("id",)):
            maps.update(zip(meta.column("id").to_pylist(), batch, strict=True))
        served = maps[block["map_id"]].astype(np.float32)
        diff = np.abs(served - expected.astype(np.float32)).max()
        assert diff <= 2e-3 * max(1.0, np.abs(expected).max()), diff
    assert audit_rows(proxy.audit_root) == len(QUESTIONS)


def test_openai_client_against_vllm_proxy(proxy):
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="none", max_retries=0)
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    plain = client.chat.completions.create(
        model="smollm2", messages=messages, max_tokens=MAX_TOKENS, temperature=0
    )
    block = plain.model_extra["actmap"]
    assert block["tokens"]["source"] == "upstream_ids"
    chunks = list(
        client.chat.completions.create(
            model="smollm2", messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    final = chunks[-1].model_extra["actmap"]
    assert final["tokens"]["source"] == "upstream_ids"
    assert final["p_correct_raw"] == pytest.approx(block["p_correct_raw"], abs=1e-5)
    completion = client.completions.create(
        model="smollm2", prompt="The capital of France is", max_tokens=6, temperature=0,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    # asked for by the client: the ids stay in the body
    assert completion.choices[0].model_extra["token_ids"]
    assert completion.model_extra["actmap"]["tokens"]["source"] == "upstream_ids"
