"""`actmap serve --engine vllm`: one real server process (vLLM in-process, SmolLM2 float32) on
loopback, driven by the official openai client; answers, maps and scores checked against the
transformers capture of the same prompt."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest
from test_serve_real import KEY, reference, start_actmap_serve, trained_run

openai = pytest.importorskip("openai")
pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'actmap[vllm]')")
pytestmark = [pytest.mark.real_model, pytest.mark.vllm]
MODEL = "smollm2"
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def server(tmp_path_factory, embedded_gguf):
    root = tmp_path_factory.mktemp("vllm-serve")
    run = trained_run(root)
    base, stop = start_actmap_serve(
        ["--engine", "vllm", "--detector", str(run), "--model", str(embedded_gguf),
         "--served-model-name", MODEL, "--max-tokens", "12", "--audit", str(root / "audit"),
         "--batch-size", "8", "--dtype", "float32"],
        "actmap serve --engine vllm", limit_s=400,
    )  # fmt: skip
    yield base, run, root, stop
    stop()


def test_openai_client_plain_stream_errors_and_audit(server, smollm2):
    base, run, root, stop = server
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=300)
    messages = [{"role": "user", "content": QUESTION}]
    prompt = smollm2[1].apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    gen, p_raw = reference(smollm2, run, prompt)

    response = client.chat.completions.create(model=MODEL, messages=messages, temperature=0)
    assert response.choices[0].message.content == gen.answer == "The capital of France is Paris."
    assert response.usage.completion_tokens == gen.n_tokens
    block = response.actmap
    # the map from vLLM's pass scores like the transformers capture's (float16 map rounding)
    assert block["p_correct_raw"] == pytest.approx(p_raw, abs=1e-3)
    assert block["decision"] in ("accept", "abstain") and block["map_id"]

    stream = client.chat.completions.create(
        model=MODEL, messages=messages, stream=True, extra_body={"actmap": {"stream_scores": True}}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == gen.answer
    running = [c.actmap for c in chunks if getattr(c, "actmap", None) and "n_tokens" in c.actmap]
    assert [r["n_tokens"] for r in running] == list(range(1, gen.n_tokens + 1))
    assert chunks[-1].actmap["p_correct"] == pytest.approx(block["p_correct"], abs=1e-6)
    assert running[-1]["p_correct"] == pytest.approx(block["p_correct"], abs=1e-5)

    # abort_below above any score: ended after the first scored token, abstain_early
    early = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        extra_body={"actmap": {"abort_below": 1.0}},
    )
    assert early.actmap["decision"] == "abstain_early" and early.usage.completion_tokens == 1

    completion = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=6, stop=["."]
    )
    assert completion.choices[0].text.strip() and "." not in completion.choices[0].text

    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-4o", messages=messages)
    with pytest.raises(openai.BadRequestError, match="temperature must be 0"):
        client.chat.completions.create(model=MODEL, messages=messages, temperature=0.8)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10_000)
    # the one rule of every mode (`actmap.serve.request_path`): a conversation without text
    with pytest.raises(openai.BadRequestError, match="messages hold no text"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": " "}])

    # given answers are read by the transformers engine's teacher-forced pass: a clear 400 here
    scored = httpx.post(
        f"{base}/v1/actmap/score",
        json={"items": [{"prompt": "2 + 2 =", "answer": " 4"}]},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=60,
    )
    assert scored.status_code == 400, scored.text
    assert "--engine local" in scored.json()["error"]["message"]

    # requests arriving while others run join the running batch; each gets its own answer
    questions = [f"What is {a} plus {a}?" for a in range(2, 8)]
    answers: dict[int, str] = {}

    def ask(i: int) -> None:
        time.sleep(0.2 * i)  # staggered: later requests arrive mid-generation
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": questions[i]}]
        )
        answers[i] = r.choices[0].message.content

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(questions))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, q in enumerate(questions):
        p = smollm2[1].apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
        )
        assert answers[i] == reference(smollm2, run, p)[0].answer

    assert stop() in (0, -signal.SIGTERM)
    from actmap.serve.audit import open_audit_store, read_audit

    audited = read_audit(open_audit_store(root / "audit")).set_index("id")
    assert audited.loc[block["map_id"], "p_correct_raw"] == block["p_correct_raw"]
