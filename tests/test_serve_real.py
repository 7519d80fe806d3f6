"""One real `actmap serve` process on loopback, SmolLM2 inside, driven by the official openai client."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from test_cli_serve import imbalanced_store
from typer.testing import CliRunner

from actmap.capture import CaptureConfig, generate_with_capture
from actmap.cli import app
from actmap.maps import build_map, stored_form
from actmap.serve.loaded_run import load_detector_run

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

pytestmark = pytest.mark.real_model
SRC = str(Path(__file__).resolve().parents[1] / "src")
KEY = "test-key"
MODEL = "smollm2-135m-instruct"
QUESTION = "What is 2 plus 3? Reply with just the number."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_actmap_serve(serve_args: list[str], label: str, limit_s: float):
    """`actmap serve` with ``serve_args`` on a free loopback port, as a user starts it (a
    subprocess, API key set, 1 thread) -> (base URL, stop()); stop() ends it with SIGTERM, so
    the lifespan flushes the audit trail, and returns its exit code."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1", "ACTMAP_API_KEY": KEY}
    process = subprocess.Popen(
        [sys.executable, "-m", "actmap.cli", "serve", *serve_args, "--port", str(port)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + limit_s
    while time.time() < deadline:
        if process.poll() is not None:
            pytest.fail(f"{label} exited: {process.stdout.read()[-3000:]}")
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.5)
    else:
        process.kill()
        pytest.fail(f"{label} did not come up in {limit_s:.0f} s")

    def stop() -> int:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)  # graceful: the lifespan flushes the audit trail
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
        return process.returncode

    return base, stop


def trained_run(root):
    """A small MLP run (one seed, two epochs) on an imbalanced store of 80 maps under ``root``."""
    imbalanced_store(root / "store", n=80)
    run = root / "run"
    trained = CliRunner().invoke(
        app,
        ["train", "--store", str(root / "store"), "--out", str(run), "--detector", "mlp",
         "--seeds", "0", "--max-epochs", "2"],
    )  # fmt: skip
    assert trained.exit_code == 0, trained.output
    return run


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2):
    root = tmp_path_factory.mktemp("real-serve")
    run = trained_run(root)
    base, stop = start_actmap_serve(
        ["--detector", str(run), "--max-tokens", "12", "--audit", str(root / "audit"),
         "--batch-window-ms", "50"],
        "actmap serve", limit_s=300,
    )  # fmt: skip
    yield base, run, root, stop
    stop()


def reference(smollm2, run, prompt: str, max_tokens: int = 12):
    model, tokenizer, _ = smollm2
    (gen,) = generate_with_capture(
        model, tokenizer, [prompt], CaptureConfig(max_new_tokens=max_tokens)
    )
    stored = stored_form(build_map(gen.trajectory))[None]
    return gen, float(load_detector_run(run).predict_proba(stored)[0])


def test_openai_client_chat_stream_and_completion(server, smollm2):
    base, run, root, stop = server
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=300)
    assert [m.id for m in client.models.list().data] == [MODEL]
    messages = [{"role": "user", "content": QUESTION}]
    prompt = smollm2[1].apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    gen, p_raw = reference(smollm2, run, prompt)

    response = client.chat.completions.create(model=MODEL, messages=messages, temperature=0)
    assert response.choices[0].message.content == gen.answer
    assert response.usage.completion_tokens == gen.n_tokens
    block = response.actmap  # the extra field, kept by the client
    assert block["p_correct_raw"] == pytest.approx(p_raw, abs=1e-5)
    assert block["decision"] in ("accept", "abstain") and block["map_id"]

    stream = client.chat.completions.create(
        model=MODEL, messages=messages, stream=True, extra_body={"actmap": {"stream_scores": True}}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == gen.answer
    running = [c.actmap for c in chunks if getattr(c, "actmap", None) and "n_tokens" in c.actmap]
    assert [r["n_tokens"] for r in running] == list(range(1, gen.n_tokens + 1))
    final = chunks[-1]
    assert final.choices[0].finish_reason == response.choices[0].finish_reason
    assert final.actmap["p_correct"] == pytest.approx(block["p_correct"], abs=1e-6)
    assert running[-1]["p_correct"] == pytest.approx(block["p_correct"], abs=1e-5)

    completion = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=6
    )
    gen, p_raw = reference(smollm2, run, "The capital of France is", 6)
    assert completion.choices[0].text == gen.answer
    assert completion.actmap["p_correct_raw"] == pytest.approx(p_raw, abs=1e-5)

    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-4o", messages=messages)
    with pytest.raises(openai.BadRequestError, match="temperature must be 0"):
        client.chat.completions.create(model=MODEL, messages=messages, temperature=0.8)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0).models.list()
    metrics = httpx.get(f"{base}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    assert 'actmap_requests_total{endpoint="chat",status="200"} 2.0' in metrics
    assert np.isfinite(block["p_correct"])

    assert stop() in (0, -signal.SIGTERM)  # uvicorn re-raises SIGTERM after a clean shutdown
    from actmap.serve.audit import open_audit_store, read_audit

    audited = read_audit(open_audit_store(root / "audit")).set_index("id")
    assert len(audited) == 3  # chat, streamed chat, completion
    assert audited.loc[block["map_id"], "p_correct_raw"] == block["p_correct_raw"]
    assert set(audited["endpoint"]) == {"chat", "completion"}
