"""The vLLM plugin: vLLM's own OpenAI server (a subprocess, default multiprocess engine core,
its worker in its own process) with actmap's worker extension and middleware, on loopback,
driven by the official openai client. A tiny random-weight Llama folder and an actmap-plus
detector (maps + the six scalars, so the workers' log-probs and entropies are read too).

Every answer's block is checked against an independent reference: a teacher-forced
transformers pass over the same prompt and the answer tokens vLLM returned
(`actmap.capture.capture_answers`), its map (float16 stored form) and scalars scored by the
detector directly. One plugin server and one refused start (a detector trained on another
generator), started together once for the module.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'actmap[vllm]')")
from conftest import make_word_tokenizer  # noqa: E402
from serve_helpers import CHAT_TEMPLATE, save_tiny_plus  # noqa: E402
from serve_helpers import stop_process_group as stop  # noqa: E402
from test_serve_proxy import free_port  # noqa: E402

import actmap  # noqa: E402
from actmap.capture import CaptureConfig, capture_answers  # noqa: E402
from actmap.capture.answer_scalars import answer_scalars  # noqa: E402
from actmap.maps import build_map, stored_form  # noqa: E402
from actmap.serve.loaded_run import load_detector_run  # noqa: E402
from actmap.store import MapStore  # noqa: E402
from actmap.store.errors import StoreError  # noqa: E402

pytestmark = [pytest.mark.real_model, pytest.mark.vllm]
MODEL = "tiny"
ADAPTER = "tiny-lora"  # the LoRA adapter's model name on the plugin server
MESSAGES = [{"role": "user", "content": "what is the capital city"}]
MAX_TOKENS = 6
START_S = 900
TP_KEY = "tp-key"  # the TP server is started by `actmap serve --engine vllm --api-key`


def tiny_folder(folder: Path, seed: int = 0, heads: int = 2) -> Path:
    """A random-weight Llama vLLM's CPU attention runs (head size 64; ``heads`` query heads,
    half as many key/value heads) + the word tokenizer with JSON's punctuation added, so that
    structured output can write JSON (decoded with spaces between tokens)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = make_word_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.add_tokens(["{", "}", '"', ":", ","])
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64 * heads, intermediate_size=128 * heads,
        num_hidden_layers=3, num_attention_heads=heads, num_key_value_heads=heads // 2,
        max_position_embeddings=256,
        pad_token_id=0, eos_token_id=1, bos_token_id=None,
    )  # fmt: skip
    LlamaForCausalLM(config).eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def detector_for(run: Path, generator: Path) -> Path:
    """An actmap-plus run whose training maps, it says, came from ``generator``."""
    from actmap.detectors.plus import ActMapPlus

    plus = ActMapPlus.load(save_tiny_plus(run.with_name(run.name + "-fit")))
    store_config = {"model": {"name": str(generator), "revision": "local", "gguf_file": None}}
    plus.save(run / "seed-0", metadata={"validation_auroc": 0.5,
                                        "inputs": {"store_config": store_config}})  # fmt: skip
    return run


def start_vllm(
    folder: Path, run: Path, audit: Path, log: Path, tensor_parallel: int = 1,
    api_servers: int = 1, flags: tuple[str, ...] = (), **options,
) -> tuple[subprocess.Popen, str]:  # fmt: skip
    """vLLM's server with the plugin; ``api_servers > 1``: vLLM's own CLI (``vllm serve``),
    which starts that many API-server processes (`vllm_serve_cli`)."""
    port = free_port()
    # unbuffered: a failing test's log has the servers' tracebacks
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(Path(actmap.__file__).parents[1]),
           "PYTHONUNBUFFERED": "1"}  # fmt: skip
    # vLLM's default multiprocess engine core, whatever an in-process engine of an earlier test
    # module (`VllmCapture` sets this in os.environ) left behind
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    if tensor_parallel == 2:  # one core per rank (vLLM's CPU workers need a binding each)
        env["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    settings = {"actmap": {"detector": str(run), "audit": str(audit), **options}}
    if api_servers > 1:
        head = [sys.executable, str(Path(__file__).with_name("vllm_serve_cli.py")), "serve",
                str(folder), "--api-server-count", str(api_servers)]  # fmt: skip
    else:
        head = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder)]
    with open(log, "w") as out:
        process = subprocess.Popen(
            [*head, "--served-model-name", MODEL, "--dtype", "float32", "--port", str(port),
             "--max-model-len", "256", "--enforce-eager", "--max-num-seqs", "8",
             "--worker-extension-cls", "actmap.capture.vllm_worker.ActmapWorker",
             "--middleware", "actmap.serve.vllm_plugin.ActmapMiddleware",
             "--additional-config", json.dumps(settings),
             "--tensor-parallel-size", str(tensor_parallel), *flags],
            env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    return process, f"http://127.0.0.1:{port}"


def start_actmap_serve(
    folder: Path, run: Path, audit: Path, log: Path, tensor_parallel: int
) -> tuple[subprocess.Popen, str]:
    """The same server started as ``actmap serve --engine vllm`` (`actmap.serve.vllm_launch`:
    the process becomes vLLM's server with the plugin), with an API key."""
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(Path(actmap.__file__).parents[1]), "ACTMAP_API_KEY": TP_KEY,
           "PYTHONUNBUFFERED": "1"}  # fmt: skip
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # as in start_vllm
    if tensor_parallel == 2:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    with open(log, "w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "actmap.cli", "serve", "--engine", "vllm", "--model",
             str(folder), "--detector", str(run), "--audit", str(audit), "--served-model-name",
             MODEL, "--dtype", "float32", "--port", str(port), "--max-context", "256",
             "--vllm-eager", "--batch-size", "8", "--tensor-parallel-size", str(tensor_parallel),
             "--max-tokens-cap", "255"],
            env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    return process, f"http://127.0.0.1:{port}"


def lora_adapter(base: Path, adapter: Path, merged: Path, rank: int = 4) -> None:
    """A LoRA adapter of every layer's q_proj and v_proj in PEFT's layout (random A and B, so
    that it changes the model), and, as the reference, ``base`` with the adapter merged in."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(7)
    alpha, tensors = 2 * rank, {}
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            for name in ("q_proj", "v_proj"):
                linear = getattr(layer.self_attn, name)
                a = torch.randn(rank, linear.in_features, generator=generator) * 0.1
                b = torch.randn(linear.out_features, rank, generator=generator) * 0.1
                key = f"base_model.model.model.layers.{i}.self_attn.{name}"
                tensors[f"{key}.lora_A.weight"], tensors[f"{key}.lora_B.weight"] = a, b
                linear.weight += (alpha / rank) * (b @ a)
    adapter.mkdir(parents=True)
    save_file(tensors, adapter / "adapter_model.safetensors")
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
              "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0, "bias": "none",
              "base_model_name_or_path": str(base)}  # fmt: skip
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    model.save_pretrained(merged)
    AutoTokenizer.from_pretrained(base).save_pretrained(merged)


def wait_up(process: subprocess.Popen, url: str, log: Path, deadline: float) -> str | None:
    """None once ``url`` answers, else why not."""
    while time.time() < deadline:
        if process.poll() is not None:
            return f"vLLM with the plugin exited: {log.read_text()[-3000:]}"
        try:
            # /health: served once the app started, and outside vLLM's API-key check
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return None
        except httpx.TransportError:
            time.sleep(2)
    return "vLLM with the plugin did not come up"


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Three vLLM servers started side by side: the plugin (vLLM's CLI with two API-server
    processes, a LoRA adapter and /v1/actmap/score), the plugin at tensor parallel 2 (a 4-head
    model, one API-server process, started by ``actmap serve --engine vllm`` with an API key,
    its /v1/actmap/score read by vLLM), and a start the plugin refuses."""
    root = tmp_path_factory.mktemp("vllm-plugin")
    folder, folder_tp = tiny_folder(root / "tiny"), tiny_folder(root / "tiny-tp", heads=4)
    run, run_tp = detector_for(root / "run", folder), detector_for(root / "run-tp", folder_tp)
    other = detector_for(root / "run-other", root / "another-model")
    lora_adapter(folder, root / "adapter", root / "tiny-lora-merged")
    lora = ("--enable-lora", "--max-lora-rank", "8", "--lora-modules",
            f"{ADAPTER}={root / 'adapter'}")  # fmt: skip
    good, url = start_vllm(folder, run, root / "audit", root / "vllm.log", api_servers=2,
                           flags=lora, score_route=True)  # fmt: skip
    tp, url_tp = start_actmap_serve(folder_tp, run_tp, root / "audit-tp", root / "tp.log", 2)
    refused, _ = start_vllm(folder, other, root / "audit-other", root / "refused.log")
    deadline = time.time() + START_S
    problem = wait_up(good, url, root / "vllm.log", deadline) or wait_up(
        tp, url_tp, root / "tp.log", deadline
    )
    if problem is not None:
        stop(good), stop(tp), stop(refused)
        pytest.fail(problem)
    yield {"url": url, "url_tp": url_tp, "root": root, "folder": folder, "run": run,
           "folder_tp": folder_tp, "run_tp": run_tp, "refused": refused, "tp": tp,
           "merged": root / "tiny-lora-merged"}  # fmt: skip
    stop(good), stop(tp), stop(refused)


def load_reference(folder: Path, run: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(folder), load_detector_run(run)


@pytest.fixture(scope="module")
def reference_model(servers):
    return load_reference(servers["folder"], servers["run"])


def expected(reference_model, token_ids: list[int], messages=MESSAGES):
    """(raw p(correct), stored map) of the answer ``token_ids`` read by teacher forcing."""
    model, tokenizer, detector = reference_model
    answer = [t for t in token_ids if t != tokenizer.eos_token_id]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    config = CaptureConfig(max_new_tokens=len(answer) + 1, max_context=256)
    (gen,) = capture_answers(model, tokenizer, [prompt], [answer], config)
    stored = stored_form(build_map(gen.trajectory))
    scalars = answer_scalars(gen.logprobs, gen.entropies)[None]
    return float(detector.detector.predict_proba(stored[None], scalars)[0]), stored


def logit(p: float) -> float:
    return float(np.log(p) - np.log1p(-p))


def same_score(served: float, reference: float) -> bool:
    """Equal within 1e-3, and in log-odds within 1e-3 (the detector's scores sit near 0 on these
    random answers, where an absolute tolerance alone says little)."""
    return abs(served - reference) <= 1e-3 and abs(logit(served) - logit(reference)) <= 1e-3


def same_map(served: np.ndarray, reference: np.ndarray) -> bool:
    """Float16 stored maps equal within 2e-3 of their largest value (one float16 step)."""
    diff = np.abs(served.astype(np.float32) - reference.astype(np.float32)).max()
    return bool(diff <= 2e-3 * max(1.0, float(np.abs(reference).max())))


def audit_stores(audit: Path) -> list[Path]:
    """The audit stores of a server: one per API-server process (``AUDIT/api-<rank>``) with
    several, else ``audit`` itself."""
    return sorted(audit.glob("api-*")) or [audit]


def audit_rows(audit: Path, column: str = "id") -> list[dict]:
    """Every store's (id, ``column``) rows, store by store (none where none is committed)."""
    out = []
    for path in audit_stores(audit):
        try:
            store = MapStore.open(path)
            rows = {}
            for _, meta in store.iter_maps(columns=tuple(dict.fromkeys(("id", column)))):
                rows.update(zip(meta.column("id").to_pylist(), meta.column(column).to_pylist(),
                                strict=True))  # fmt: skip
        except StoreError:  # not created yet, or no maps committed yet
            rows = {}
        out.append(rows)
    return out


def audit_maps(audit: Path, wanted: set[str], timeout_s: float = 60) -> dict:
    """The audit store's maps of ``wanted`` ids (the server's writer commits in the background)."""
    deadline = time.time() + timeout_s
    found: dict = {}
    while time.time() < deadline:
        for path in audit_stores(audit):
            try:
                store = MapStore.open(path)
                for batch, meta in store.iter_maps(batch_size=64, columns=("id",)):
                    found.update(zip(meta.column("id").to_pylist(), batch, strict=True))
            except StoreError:  # not created yet, or no maps committed yet
                pass
        if wanted <= set(found):
            return found
        time.sleep(1)
    return found


def client_for(servers):
    return openai.OpenAI(base_url=servers["url"] + "/v1", api_key="none", max_retries=0,
                         timeout=300)  # fmt: skip


def test_plain_and_streamed_answers_carry_the_block(servers, reference_model):
    client = client_for(servers)
    ids = {"return_token_ids": True}
    plain = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, extra_body=ids
    )
    block = plain.model_extra["actmap"]
    assert set(block) >= {"p_correct", "p_correct_raw", "decision", "map_id", "detector"}
    assert block["decision"] in ("accept", "abstain") and block["map_id"]
    tokens = plain.choices[0].model_extra["token_ids"]
    assert len(tokens) == plain.usage.completion_tokens
    p_raw, stored = expected(reference_model, tokens)
    assert same_score(block["p_correct_raw"], p_raw)
    # the policy's default prior: none, so the corrected score is the raw one
    assert block["p_correct"] == pytest.approx(block["p_correct_raw"], abs=1e-9)

    # the same prompt without asking for ids: vLLM's body as it was, the same block
    again = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0
    )
    assert again.choices[0].message.content == plain.choices[0].message.content
    assert same_score(again.model_extra["actmap"]["p_correct_raw"], p_raw)
    assert again.model_extra["actmap"]["map_id"] != block["map_id"]
    # asking for vLLM's log-probs changes nothing for the block; vLLM's own are there
    with_logprobs = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, logprobs=True,
        top_logprobs=2,
    )  # fmt: skip
    assert len(with_logprobs.choices[0].logprobs.content) == len(tokens)
    assert same_score(with_logprobs.model_extra["actmap"]["p_correct_raw"], p_raw)

    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, stream=True
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    final = chunks[-1]
    assert final.choices == [] and final.id == chunks[0].id
    assert same_score(final.model_extra["actmap"]["p_correct_raw"], p_raw)

    maps = audit_maps(servers["root"] / "audit", {block["map_id"]})
    assert same_map(maps[block["map_id"]], stored)


def test_n_2_completion_and_tools_carry_a_block_each(servers, reference_model):
    client = client_for(servers)
    two = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=1.0, n=2, seed=3,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    assert len(two.choices) == 2
    for choice in two.choices:
        block = choice.model_extra["actmap"]
        p_raw, _ = expected(reference_model, choice.model_extra["token_ids"])
        assert same_score(block["p_correct_raw"], p_raw), choice.index
    assert two.model_extra["actmap"] == two.choices[0].model_extra["actmap"]
    assert two.choices[0].model_extra["actmap"]["map_id"] != two.choices[1].model_extra[
        "actmap"]["map_id"]  # fmt: skip

    streamed = list(
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=MAX_TOKENS,
            temperature=1.0,
            n=2,
            seed=3,
            stream=True,
        )  # fmt: skip
    )
    final = streamed[-1]
    assert [c.index for c in final.choices] == [0, 1]
    assert all(0 <= c.model_extra["actmap"]["p_correct"] <= 1 for c in final.choices)

    completion = client.completions.create(
        model=MODEL, prompt="what is the capital city", max_tokens=4, temperature=0,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    assert 0 <= completion.model_extra["actmap"]["p_correct"] <= 1

    tools = [
        {
            "type": "function",
            "function": {
                "name": "lookup",
                "description": "find a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    with_tools = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, tools=tools,
        tool_choice="none", extra_body={"return_token_ids": True},
    )  # fmt: skip
    p_raw, _ = expected(reference_model, with_tools.choices[0].model_extra["token_ids"])
    assert same_score(with_tools.model_extra["actmap"]["p_correct_raw"], p_raw)


def test_structured_output_passes_through_with_a_block(servers, reference_model):
    client = client_for(servers)
    schema = {"type": "object", "properties": {"city": {"enum": ["paris", "rome"]}},
              "required": ["city"], "additionalProperties": False}  # fmt: skip
    shaped = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=20, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}},
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    content = shaped.choices[0].message.content.replace(" ", "")  # word tokens: spaced
    assert json.loads(content)["city"] in ("paris", "rome")
    p_raw, _ = expected(reference_model, shaped.choices[0].model_extra["token_ids"])
    assert same_score(shaped.model_extra["actmap"]["p_correct_raw"], p_raw)
    chosen = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"structured_outputs": {"choice": ["paris", "rome"]}, "return_token_ids": True},
    )  # fmt: skip
    assert chosen.choices[0].message.content.strip() in ("paris", "rome")
    p_raw, _ = expected(reference_model, chosen.choices[0].model_extra["token_ids"])
    assert same_score(chosen.model_extra["actmap"]["p_correct_raw"], p_raw)


def test_requests_vllm_rejects_get_vllms_own_error(servers):
    client = client_for(servers)
    with pytest.raises(openai.BadRequestError, match="n must be 1 when using greedy"):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, n=2)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    bad = httpx.post(servers["url"] + "/v1/chat/completions", content=b"{not json",
                     headers={"content-type": "application/json"}, timeout=60)  # fmt: skip
    assert bad.status_code == 400 and "actmap" not in bad.json()
    # the server still answers afterwards
    ok = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, temperature=0)
    assert "actmap" in ok.model_extra


def test_a_detector_of_another_generator_refuses_to_start(servers):
    refused = servers["refused"]
    try:
        refused.wait(START_S)
    except subprocess.TimeoutExpired:
        pytest.fail("vLLM with a mismatched detector did not stop")
    log = (servers["root"] / "refused.log").read_text()
    lines = [line for line in log.splitlines() if "actmap: detector" in line]
    assert len(lines) == 1, log[-3000:]
    assert "another-model" in lines[0] and str(servers["folder"]) in lines[0]
    assert "Application startup failed" in log


def requests_total(url: str) -> float:
    """``actmap_requests_total`` of answered chat requests on vLLM's ``/metrics``."""
    text = httpx.get(url + "/metrics", timeout=60).text
    assert "actmap_p_correct_count" in text and "vllm:" in text  # beside vLLM's own metrics
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("actmap_requests_total{")
               and 'endpoint="chat"' in line and 'status="200"' in line)  # fmt: skip


def rows_by_way(url: str) -> dict[str, float]:
    """``actmap_vllm_rows_total`` by way (push, rpc) on vLLM's ``/metrics``."""
    text = httpx.get(url + "/metrics", timeout=60).text
    out = {"push": 0.0, "rpc": 0.0}
    for line in text.splitlines():
        if line.startswith("actmap_vllm_rows_total{"):
            out[line.split('way="')[1].split('"')[0]] += float(line.split()[-1])
    return out


def test_client_request_id_and_metrics(servers):
    """On the server with two API-server processes (vLLM's multiprocess metrics) and on the one
    with one (actmap's registry added to vLLM's)."""
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, "temperature": 0}
    for url in (servers["url"], servers["url_tp"]):
        headers = {"X-Request-Id": "client-chose-this", "Authorization": f"Bearer {TP_KEY}"}
        out = httpx.post(url + "/v1/chat/completions", json=body, headers=headers,
                         timeout=120).json()  # fmt: skip
        assert out["id"] == "chatcmpl-client-chose-this" and out["actmap"]["map_id"]
        assert requests_total(url) >= 1
    # `actmap serve --engine vllm --api-key` (ACTMAP_API_KEY): vLLM's server wants that key
    url = servers["url_tp"] + "/v1/chat/completions"
    assert httpx.post(url, json=body, timeout=120).status_code == 401
    # actmap serve's feedback route: a label for the answer just served (behind the key)
    feedback = servers["url_tp"] + "/v1/actmap/feedback"
    label = {"map_id": out["actmap"]["map_id"], "label": 1, "source": "test"}
    assert httpx.post(feedback, json=label, timeout=60).status_code == 401
    labelled = httpx.post(feedback, json=label, timeout=60,
                          headers={"Authorization": f"Bearer {TP_KEY}"})  # fmt: skip
    assert labelled.status_code == 200 and labelled.json()["map_id"] == label["map_id"]
    # and actmap serve's --max-tokens-cap: over it, the same 400 as actmap serve's
    over = httpx.post(url, json={**body, "max_tokens": 256}, timeout=120,
                      headers={"Authorization": f"Bearer {TP_KEY}"})  # fmt: skip
    assert over.status_code == 400, over.text
    assert over.json()["error"]["message"] == "max_tokens=256 exceeds this server's cap of 255"


def test_two_api_server_processes_lose_and_double_no_row(servers):
    """``--api-server-count 2``: 16 concurrent requests spread over both processes; each
    answer gets its own block, each map is written once (in the store of the process that
    answered it: ``AUDIT/api-<rank>``), and vLLM's ``/metrics`` counts each answer once, from
    whichever process serves the scrape."""
    url = servers["url"]
    before, ways = requests_total(url), rows_by_way(url)
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 3, "temperature": 0}

    def one(i: int) -> str:
        out = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
        assert out.status_code == 200 and "actmap" in out.json(), (
            out.text + (servers["root"] / "vllm.log").read_text()[-6000:]
        )
        return out.json()["actmap"]["map_id"]

    with ThreadPoolExecutor(16) as pool:
        ids = list(pool.map(one, range(16)))
    assert len(set(ids)) == 16
    deadline = time.time() + 60
    while time.time() < deadline:
        stores = audit_rows(servers["root"] / "audit")
        if set(ids) <= {k for rows in stores for k in rows}:
            break
        time.sleep(1)
    assert len(stores) == 2  # AUDIT/api-0 and AUDIT/api-1
    held = [set(ids) & set(rows) for rows in stores]
    assert held[0] | held[1] == set(ids) and not held[0] & held[1]
    assert held[0] and held[1], "one process answered all 16"
    assert [requests_total(url) - before for _ in range(4)] == [16] * 4
    # every answer's rows came by the worker's socket, to the process that served it
    after = rows_by_way(url)
    assert (after["push"] - ways["push"], after["rpc"] - ways["rpc"]) == (16, 0)


def test_a_lora_request_gets_the_block_of_the_adapted_model(servers, reference_model):
    """``--enable-lora``: a request for the adapter gets its block, read from the adapted
    model's layers (equal to the transformers reference with the adapter merged in, not to the
    base model's reading of the same tokens)."""
    client = client_for(servers)
    out = client.chat.completions.create(
        model=ADAPTER, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    assert out.model == ADAPTER
    block, tokens = out.model_extra["actmap"], out.choices[0].model_extra["token_ids"]
    adapted = load_reference(servers["merged"], servers["run"])
    p_adapted, stored = expected(adapted, tokens)
    p_base, base_map = expected(reference_model, tokens)
    assert same_score(block["p_correct_raw"], p_adapted)
    assert not same_map(base_map, stored) and not same_score(p_base, p_adapted)
    maps = audit_maps(servers["root"] / "audit", {block["map_id"]})
    assert same_map(maps[block["map_id"]], stored)


def greedy_and_sampled(client, seed: int) -> list[tuple[dict, list[int]]]:
    """(block, answer token ids) of a greedy answer and of two sampled ones (``n = 2``)."""
    out = []
    for options in ({"temperature": 0}, {"temperature": 1.0, "n": 2, "seed": seed}):
        answer = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS,
            extra_body={"return_token_ids": True}, **options,
        )  # fmt: skip
        for choice in answer.choices:
            block = choice.model_extra.get("actmap") or answer.model_extra["actmap"]
            out.append((block, choice.model_extra["token_ids"]))
    return out


def test_tensor_parallel_2_gives_the_reference_maps(servers):
    """TP=2 (two worker processes, rank 0 records): the blocks and audit maps of greedy and
    sampled answers equal the single-device transformers reference."""
    reference = load_reference(servers["folder_tp"], servers["run_tp"])
    client = openai.OpenAI(base_url=servers["url_tp"] + "/v1", api_key=TP_KEY, max_retries=0,
                           timeout=300)  # fmt: skip
    wanted, items = {}, []
    for block, token_ids in greedy_and_sampled(client, seed=3):
        p_raw, stored = expected(reference, token_ids)
        assert same_score(block["p_correct_raw"], p_raw)
        wanted[block["map_id"]] = stored
        tokens = [t for t in token_ids if t != reference[1].eos_token_id]
        items.append((p_raw, stored, {"messages": MESSAGES, "answer_token_ids": tokens}))
    # teacher-forced readings at TP=2 (both ranks compute the forced rows' logits together)
    scored = httpx.post(servers["url_tp"] + "/v1/actmap/score",
                        json={"items": [item for *_, item in items]}, timeout=300,
                        headers={"Authorization": f"Bearer {TP_KEY}"})  # fmt: skip
    assert scored.status_code == 200, scored.text
    for (p_raw, stored, _), result in zip(items, scored.json()["results"], strict=True):
        assert same_score(result["p_correct_raw"], p_raw)
        wanted[result["map_id"]] = stored
    maps = audit_maps(servers["root"] / "audit-tp", set(wanted))
    assert all(same_map(maps[key], stored) for key, stored in wanted.items())


def test_an_answer_the_client_abandons_writes_no_partial_map(servers):
    """A stream closed after its first token of 240: vLLM aborts the request and no block is
    computed, or (on a loaded machine) it had already finished all 240 tokens before the
    hang-up reached the server: then its map is the whole answer's, never a part of it."""
    url = servers["url"]

    def scored() -> float:
        text = httpx.get(url + "/metrics", timeout=60).text
        lines = [line for line in text.splitlines() if line.startswith("actmap_requests_total{")]
        return sum(float(line.split()[-1]) for line in lines)

    before = scored()
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 240, "temperature": 0,
            "stream": True, "ignore_eos": True}  # fmt: skip
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if '"content":"' in line.replace(" ", "") and '"content":""' not in line:
                break  # the first token: hang up
    client = client_for(servers)
    ok = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, temperature=0)
    assert ok.model_extra["actmap"]["map_id"]
    extra = scored() - before - 1
    assert extra in (0, 1)
    if extra:  # finished before the hang-up: the audit holds its whole answer (every other
        deadline = time.time() + 60  # answer of this module is 20 tokens at most)
        lengths: list[int] = []
        while time.time() < deadline and not any(n > 20 for n in lengths):
            time.sleep(1)
            lengths = [n for rows in audit_rows(servers["root"] / "audit", "n_tokens")
                       for n in rows.values()]  # fmt: skip
        assert [n for n in lengths if n > 20] == [240]


def streamed(url: str, body: dict) -> list[dict]:
    """The JSON chunks of a stream (``data: [DONE]`` checked and left out)."""
    events = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_running_scores_in_streamed_chunks_and_abort_below(servers, reference_model):
    """``actmap.stream_scores``: each chunk's running p(correct) over the answer's first
    n_tokens tokens equals the teacher-forced reference of those tokens; ``abort_below`` ends
    the answer in vLLM, and its block (decision abstain_early) is that of the tokens read."""
    url = servers["url"]
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0,
            "return_token_ids": True}  # fmt: skip
    tokens = httpx.post(url + "/v1/chat/completions", json=body, timeout=300).json()
    tokens = tokens["choices"][0]["token_ids"]
    chunks = streamed(url, {**body, "stream": True, "actmap": {"stream_scores": True}})
    running = [c["actmap"] for c in chunks if "actmap" in c and "n_tokens" in c["actmap"]]
    answer = [t for t in tokens if t != reference_model[1].eos_token_id]
    counts = [r["n_tokens"] for r in running]  # the workers may be a step ahead of the stream
    assert counts and counts == sorted(set(counts)) and 1 <= counts[0] <= counts[-1] <= len(answer)
    for score in running:
        p_raw, _ = expected(reference_model, answer[: score["n_tokens"]])
        assert same_score(score["p_correct"], p_raw), score
    final = chunks[-1]["actmap"]  # the whole answer's block, as without stream_scores
    assert same_score(final["p_correct_raw"], expected(reference_model, tokens)[0])

    # abort_below 1: the first running score ends a 240-token answer
    long = {**body, "max_tokens": 240, "ignore_eos": True, "stream": True,
            "actmap": {"stream_scores": True, "abort_below": 1.0}}  # fmt: skip
    chunks = streamed(url, long)
    scores = [c["actmap"] for c in chunks if "n_tokens" in c.get("actmap", {})]
    assert len(scores) == 1 and scores[0]["p_correct"] < 1.0
    cut = scores[0]["n_tokens"]
    last = chunks[-1]
    assert last["choices"] == [{"index": 0, "delta": {}, "finish_reason": "stop"}]
    block = last["actmap"]
    assert block["decision"] == "abstain_early" and block["map_id"]
    assert block["p_correct_raw"] == pytest.approx(scores[0]["p_correct"], abs=1e-6)
    prefix = httpx.post(url + "/v1/chat/completions", json={**body, "max_tokens": cut,
                        "ignore_eos": True}, timeout=300).json()["choices"][0]["token_ids"]  # fmt: skip
    assert reference_model[1].eos_token_id not in prefix
    p_raw, stored = expected(reference_model, prefix)
    assert same_score(block["p_correct_raw"], p_raw)
    maps = audit_maps(servers["root"] / "audit", {block["map_id"]})
    assert same_map(maps[block["map_id"]], stored)
    n_tokens = {k: n for rows in audit_rows(servers["root"] / "audit", "n_tokens")
                for k, n in rows.items()}  # fmt: skip
    assert n_tokens[block["map_id"]] == cut


def test_actmap_options_are_checked_by_name(servers):
    url = servers["url"] + "/v1/chat/completions"
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, "temperature": 0}
    for options, stream, param in (
        ({"abort_below": 0.5}, False, "actmap.abort_below"),  # needs a stream
        ({"abort_below": 2}, True, "actmap.abort_below"),  # outside 0..1
        ({"bogus": True}, True, "actmap.bogus"),
    ):
        out = httpx.post(url, json={**body, "stream": stream, "actmap": options}, timeout=60)
        assert out.status_code == 400 and out.json()["error"]["param"] == param, out.text


def test_the_block_equals_v1_actmap_score_on_the_same_answer(servers, reference_model):
    """``/v1/actmap/score`` on vLLM's server (``score_route``: each answer read by a
    teacher-forced request to vLLM itself, no model in the API server) gives each answer vLLM
    generated the score of its block, within 1e-3, and the transformers teacher-forced
    reference's; the same pair read twice (vLLM's prefix caching on) gives the same score and
    map; an empty answer gets no score (as ``actmap serve``); a pair longer than the context a
    400."""
    url, eos = servers["url"], reference_model[1].eos_token_id
    client = client_for(servers)
    answers = []
    for block, token_ids in greedy_and_sampled(client, seed=5):
        tokens = [t for t in token_ids if t != eos]
        answers.append((block, {"messages": MESSAGES, "answer_token_ids": tokens}))
    completion = client.completions.create(
        model=MODEL, prompt="what is the capital city", max_tokens=4, temperature=0,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    tokens = [t for t in completion.choices[0].model_extra["token_ids"] if t != eos]
    answers.append((completion.model_extra["actmap"],
                    {"prompt": "what is the capital city", "answer_token_ids": tokens}))  # fmt: skip
    items = [{"id": str(i), **item} for i, (_, item) in enumerate(answers)]
    scored = httpx.post(url + "/v1/actmap/score", json={"model": MODEL, "items": items},
                        timeout=300)  # fmt: skip
    assert scored.status_code == 200, scored.text
    out = scored.json()
    assert out["detector"] == answers[0][0]["detector"]
    for (block, item), result in zip(answers, out["results"], strict=True):
        assert result["n_tokens"] == len(item["answer_token_ids"])
        assert abs(result["p_correct"] - block["p_correct"]) <= 1e-3, (result, block)
        assert same_score(result["p_correct_raw"], block["p_correct_raw"])
        assert result["decision"] == block["decision"] and result["map_id"] != block["map_id"]
    pairs = [(r["p_correct_raw"], b["p_correct_raw"])
             for (b, _), r in zip(answers, out["results"], strict=True)]  # fmt: skip
    print(
        f"block vs /v1/actmap/score over {len(pairs)} answers: max |dp| "
        f"{max(abs(a - b) for a, b in pairs):.2e}, in log-odds "
        f"{max(abs(logit(a) - logit(b)) for a, b in pairs):.2e}, p in "
        f"[{min(min(pair) for pair in pairs):.3g}, {max(max(pair) for pair in pairs):.3g}]"
    )
    for (_, item), result in zip(answers[:3], out["results"][:3], strict=True):  # chat answers
        assert same_score(
            result["p_correct_raw"], expected(reference_model, item["answer_token_ids"])[0]
        )
    # the same pairs again: vLLM's prefix cache holds them, the readings are computed anew
    again = httpx.post(url + "/v1/actmap/score", json={"model": MODEL, "items": items},
                       timeout=300).json()["results"]  # fmt: skip
    for first, second in zip(out["results"], again, strict=True):
        assert second["p_correct_raw"] == pytest.approx(first["p_correct_raw"], abs=1e-6)
    wanted = {r["map_id"]: b["map_id"] for (b, _), r in zip(answers, out["results"], strict=True)}
    wanted |= {r["map_id"]: first["map_id"] for first, r in zip(out["results"], again, strict=True)}
    maps = audit_maps(servers["root"] / "audit", set(wanted) | set(wanted.values()))
    assert all(same_map(maps[scored_id], maps[block_id]) for scored_id, block_id in wanted.items())
    # an empty answer: read (its end token only), no map, no score, as actmap serve answers it
    empty_answer = httpx.post(url + "/v1/actmap/score", json={"items": [
        {"messages": MESSAGES, "answer": ""}]}, timeout=300)  # fmt: skip
    assert empty_answer.status_code == 200, empty_answer.text
    (result,) = empty_answer.json()["results"]
    assert result["n_tokens"] == 0 and result["p_correct"] is None
    assert result["decision"] == "abstain" and result["map_id"] is None
    # prompt + answer past the served context (256 tokens): 400, nothing read
    too_long = httpx.post(url + "/v1/actmap/score", json={"items": [
        {"messages": MESSAGES, "answer_token_ids": [5] * 260}]}, timeout=60)  # fmt: skip
    assert too_long.status_code == 400, too_long.text
    error = too_long.json()["error"]
    assert error["code"] == "context_length_exceeded" and "256 tokens" in error["message"]

    # actmap serve's checks and errors, unchanged
    bad = httpx.post(url + "/v1/actmap/score", json={"items": [{"messages": MESSAGES}]}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "items[0]", bad.text
    other = httpx.post(url + "/v1/actmap/score", json={"model": "gpt-4o", "items": items[:1]},
                       timeout=60)  # fmt: skip
    assert other.status_code == 404 and other.json()["error"]["code"] == "model_not_found"
    empty = httpx.post(url + "/v1/actmap/score", json={"items": []}, timeout=60)
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "items"
    # `actmap serve --engine vllm` (the TP server) serves the route, behind vLLM's API key
    # (a server without score_route: tests/test_vllm_plugin_parts.py)
    route = servers["url_tp"] + "/v1/actmap/score"
    assert httpx.post(route, json={"items": items[:1]}, timeout=60).status_code == 401
    keyed = httpx.post(route, json={"items": items[:1]}, timeout=300,
                       headers={"Authorization": f"Bearer {TP_KEY}"})  # fmt: skip
    assert keyed.status_code == 200 and keyed.json()["results"][0]["map_id"], keyed.text


def test_actmap_serve_engine_vllm_stops_on_sigterm(servers):
    """SIGTERM to the process ``actmap serve --engine vllm`` started (it became vLLM's API
    server) stops vLLM and every process it started (engine core, two workers). Last in the
    module: it ends the TP server."""
    tp = servers["tp"]
    assert tp.poll() is None
    os.kill(tp.pid, signal.SIGTERM)
    try:
        code = tp.wait(120)
    except subprocess.TimeoutExpired:
        pytest.fail("vLLM's server did not stop on SIGTERM")
    assert code in (0, -signal.SIGTERM), code
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            os.killpg(tp.pid, 0)  # any process of the group left?
        except ProcessLookupError:
            break
        time.sleep(1)
    else:
        pytest.fail("vLLM's engine core or workers outlived its API server")
    log = (servers["root"] / "tp.log").read_text()
    assert "starting vLLM's server with the actmap plugin:" in log
