"""Proxy mode's cost: the upstream alone vs through ``actmap serve --upstream``, in one run.

Starts (unless ``--upstream`` is given) a vLLM OpenAI server (CPU build, float32
SmolLM2, prefix caching off so repeated prompts do not flatter the second pass)
from ``--vllm-python``, and an ``actmap serve --upstream`` process in front of
it, then reports:

- req/s and p50/p99 latency of the upstream alone and through the proxy, at 1 and
  16 concurrent requests (TriviaQA questions from the project's *train* split);
- teacher-forced scoring time per answer and per token (one pass, batches of 1 and 16),
  and what a running score would cost re-reading the answer at every token;
- the re-tokenization mismatch rate: on ``--answers`` vLLM answers, how often
  tokenizing the answer text gives other ids than vLLM generated.

Targets (issue 46): proxy throughput >= 0.8x the upstream's; added p50 below the
upstream's own p50. Both processes share this machine's cores: ``uptime`` is printed
before and after, since the machine is shared with other work.

    python benchmarks/bench_proxy.py --out runs/bench-proxy.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

SRC = str(Path(__file__).resolve().parents[1] / "src")
sys.path.insert(0, SRC)
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import free_port, make_detector  # noqa: E402

MODEL = "smollm2-135m-instruct"
SERVED = "smollm2"
INSTRUCTION = "Answer the question in a few words.\nQuestion: {}"


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def wait_up(url: str, process: subprocess.Popen, log: Path, limit_s: float) -> None:
    deadline = time.time() + limit_s
    while time.time() < deadline:
        if process.poll() is not None:
            sys.exit(f"{url} exited:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(2)
    sys.exit(f"{url} did not come up in {limit_s:.0f} s")


def start(command: list[str], env: dict, log: Path) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen(
            command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)


def questions(n: int) -> list[str]:
    """TriviaQA questions of the project's train split (never the held-out test questions)."""
    from actmap.data.datasets import TriviaQATask

    examples = TriviaQATask().load("train")  # ../shared/data, as every command reads it
    if len(examples) < n:
        sys.exit(f"only {len(examples)} train questions")
    return [e.question for e in examples[:n]]


def chat_body(question: str, max_tokens: int, **extra) -> dict:
    messages = [{"role": "user", "content": INSTRUCTION.format(question)}]
    return {"model": SERVED, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            **extra}  # fmt: skip


async def load(url: str, bodies: list[dict], concurrency: int) -> dict:
    """Send ``bodies`` with ``concurrency`` in flight; req/s and latency quantiles."""
    latencies: list[float] = []
    queue = list(bodies)
    async with httpx.AsyncClient(timeout=600) as client:

        async def worker():
            while queue:
                body = queue.pop(0)
                started = time.perf_counter()
                response = await client.post(url + "/v1/chat/completions", json=body)
                response.raise_for_status()
                latencies.append(time.perf_counter() - started)

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - started
    lat = np.array(latencies)
    return {
        "n": len(lat), "concurrency": concurrency, "req_per_s": len(lat) / wall,
        "p50_s": float(np.percentile(lat, 50)), "p99_s": float(np.percentile(lat, 99)),
    }  # fmt: skip


async def answers_with_ids(url: str, bodies: list[dict], concurrency: int = 16) -> list[dict]:
    out: list[dict] = [None] * len(bodies)  # type: ignore[list-item]
    pending = list(enumerate(bodies))
    async with httpx.AsyncClient(timeout=600) as client:

        async def worker():
            while pending:
                i, body = pending.pop(0)
                response = await client.post(url + "/v1/chat/completions", json=body)
                response.raise_for_status()
                out[i] = response.json()

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return out


def mismatch_rate(tokenizer, model, answers: list[dict]) -> dict:
    from actmap.capture.generate import stop_ids

    ends = stop_ids(model, tokenizer)
    differ = not_decoding = 0
    examples = []
    for body in answers:
        choice = body["choices"][0]
        ids = list(choice["token_ids"])
        while ids and ids[-1] in ends:
            ids.pop()
        text = choice["message"]["content"] or ""
        again = tokenizer(text, add_special_tokens=False)["input_ids"]
        if tokenizer.decode(ids, skip_special_tokens=True) != text:
            not_decoding += 1
        if again != ids:
            differ += 1
            if len(examples) < 5:
                examples.append({"text": text, "ids": ids, "retokenized": again})
    n = len(answers)
    return {"n": n, "retokenized_differs": differ, "rate": differ / n,
            "ids_do_not_decode_to_text": not_decoding, "examples": examples}  # fmt: skip


def scoring_cost(detector_run: Path, prompts: list[str], answer_ids: list[list[int]]) -> dict:
    """Teacher-forced scoring (capture + map + detector) per answer and per token."""
    import torch

    from actmap.capture.forced import capture_answers_batch
    from actmap.capture.records import CaptureConfig
    from actmap.serve.answers import ScoreJob, chat_prefix, score_answers
    from actmap.serve.app import ServeSettings, build_engine

    torch.set_num_threads(1)
    engine = build_engine(ServeSettings(model=MODEL, detector=detector_run))
    out = {}
    tokens = sum(len(a) for a in answer_ids)
    prompt_tokens = sum(engine.count_tokens(p) for p in prompts)  # the pass reads these too
    prefix = chat_prefix(engine)  # what the server runs once: the template's system turn
    out["chat_prefix_tokens"] = 0 if prefix is None else len(prefix.ids)
    for batch, shared in ((1, None), (1, prefix), (16, prefix)):
        started, cpu = time.perf_counter(), time.process_time()
        for i in range(0, len(prompts), batch):
            jobs = [ScoreJob(p, a) for p, a in zip(prompts[i : i + batch], answer_ids[i : i + batch], strict=True)]  # fmt: skip
            score_answers(engine, jobs, shared)
        seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
        out[f"batch_{batch}" + ("_prefix_cached" if shared is not None else "_full_pass")] = {"answers": len(prompts), "answer_tokens": tokens,
                                 "prompt_tokens": prompt_tokens,
                                 "ms_per_answer": 1000 * seconds / len(prompts),
                                 "ms_per_answer_token": 1000 * seconds / tokens,
                                 "cpu_ms_per_answer": 1000 * cpu / len(prompts),
                                 "cpu_ms_per_answer_token": 1000 * cpu / tokens}  # fmt: skip
    # a running score without a cache re-reads the prefix at every token: sum over t of a pass
    sample = [(p, a) for p, a in zip(prompts, answer_ids, strict=True) if len(a) >= 4][:10]
    config = CaptureConfig(max_context=engine.max_context, batch_size=1, greybox=False)
    one = every = 0.0
    for prompt, ids in sample:
        started = time.process_time()
        capture_answers_batch(engine.model, engine.tokenizer, [prompt], [ids], config)
        one += time.process_time() - started
        started = time.process_time()
        for t in range(1, len(ids) + 1):
            capture_answers_batch(engine.model, engine.tokenizer, [prompt], [ids[:t]], config)
        every += time.process_time() - started
    out["running_score"] = {
        "answers": len(sample), "one_pass_cpu_ms_per_answer": 1000 * one / len(sample),
        "pass_per_token_cpu_ms_per_answer": 1000 * every / len(sample), "ratio": every / one,
    }  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--vllm-python", default=sys.executable, help="a python that imports vllm (default: this one)"
    )
    parser.add_argument("--upstream", help="an already running upstream base URL (no /v1)")
    parser.add_argument("--detector", type=Path, help="detector run (default: a fitted logreg)")
    parser.add_argument("--requests", type=int, default=32, help="requests per load run")
    parser.add_argument("--answers", type=int, default=500, help="answers for the mismatch rate")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--out", type=Path, default=Path("runs/bench-proxy.json"))
    args = parser.parse_args()

    from actmap.llm.models import cache_dir, check_model, load_model

    model, tokenizer, source = load_model(MODEL)  # also writes the de-quantized folder vLLM reads
    folder = cache_dir() / f"{Path(source.gguf_file).stem}-{source.revision}"
    work = Path(tempfile.mkdtemp(prefix="bench-proxy-"))
    detector = args.detector or make_detector(work / "run")
    processes = []
    result = {"uptime_before": uptime(), "model": MODEL, "max_tokens": args.max_tokens}
    try:
        upstream = args.upstream
        if upstream is None:
            port = free_port()
            env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
            env.pop("PYTHONPATH", None)
            command = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model",
                       str(folder), "--served-model-name", SERVED, "--dtype", "float32", "--port",
                       str(port), "--max-model-len", "2048", "--no-enable-prefix-caching"]  # fmt: skip
            processes.append(start(command, env, work / "vllm.log"))
            upstream = f"http://127.0.0.1:{port}"
            wait_up(upstream + "/v1/models", processes[-1], work / "vllm.log", 1800)
        result["upstream"] = {"url": upstream, "started_here": args.upstream is None}
        proxy_port = free_port()
        env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}
        command = [sys.executable, "-m", "actmap.cli", "serve", "--upstream", upstream + "/v1",
                   "--model", MODEL, "--served-model-name", SERVED, "--detector", str(detector),
                   "--port", str(proxy_port), "--batch-window-ms", "5", "--timeout", "600",
                   "--upstream-timeout", "600"]  # fmt: skip
        processes.append(start(command, env, work / "proxy.log"))
        proxy = f"http://127.0.0.1:{proxy_port}"
        wait_up(proxy + "/health", processes[-1], work / "proxy.log", 600)
        check_model(MODEL)

        asked = questions(args.answers + 4 * args.requests)
        load_questions, mismatch_questions = asked[: 4 * args.requests], asked[4 * args.requests :]
        bodies = [chat_body(q, args.max_tokens) for q in load_questions]
        warm = [chat_body(q, args.max_tokens) for q in asked[-4:]]
        asyncio.run(load(upstream, warm, 4))  # warm both
        asyncio.run(load(proxy, warm, 4))
        runs = []
        # disjoint, interleaved questions for the two targets: a prompt seen once is not
        # answered from the upstream's prefix cache the second time
        split = {"upstream": bodies[0::2], "proxy": bodies[1::2]}
        for concurrency in (1, 16):
            n = args.requests if concurrency == 16 else max(8, args.requests // 2)
            for name, url in (("upstream", upstream), ("proxy", proxy)):
                row = asyncio.run(load(url, split[name][:n], concurrency))
                row["target"] = name
                runs.append(row)
                print(json.dumps(row), flush=True)
        result["load"] = runs

        generated = asyncio.run(
            answers_with_ids(
                upstream,
                [chat_body(q, args.max_tokens, return_token_ids=True) for q in mismatch_questions],
            )  # fmt: skip
        )
        result["mismatch"] = mismatch_rate(tokenizer, model, generated)
        print(
            json.dumps({k: v for k, v in result["mismatch"].items() if k != "examples"}), flush=True
        )

        from actmap.capture.generate import stop_ids

        ends = stop_ids(model, tokenizer)
        prompts, ids = [], []
        for question, body in list(zip(mismatch_questions, generated, strict=True))[:64]:
            answer = [t for t in body["choices"][0]["token_ids"] if t not in ends]
            messages = [{"role": "user", "content": INSTRUCTION.format(question)}]
            prompts.append(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))  # fmt: skip
            ids.append(answer)
        del model
        result["scoring"] = scoring_cost(detector, prompts, ids)
        print(json.dumps(result["scoring"]), flush=True)
    finally:
        for process in reversed(processes):
            stop(process)
    result["uptime_after"] = uptime()
    by = {(r["target"], r["concurrency"]): r for r in result["load"]}
    print(f"\nload before: {result['uptime_before']}\nload after:  {result['uptime_after']}")
    print(f"{'concurrency':>11} {'target':>9} {'req/s':>7} {'p50 s':>7} {'p99 s':>7}  ratio  added p50 (target: < upstream p50)")  # fmt: skip
    for c in (1, 16):
        up, px = by[("upstream", c)], by[("proxy", c)]
        for r in (up, px):
            print(f"{c:>11} {r['target']:>9} {r['req_per_s']:7.2f} {r['p50_s']:7.3f} {r['p99_s']:7.3f}")  # fmt: skip
        print(f"{'':>11} {'':>9} throughput ratio {px['req_per_s'] / up['req_per_s']:.2f} (target >= 0.8), added p50 {px['p50_s'] - up['p50_s']:+.3f} s vs upstream p50 {up['p50_s']:.3f} s")  # fmt: skip
    m = result["mismatch"]
    print(f"re-tokenization differs from vLLM's ids on {m['retokenized_differs']}/{m['n']} answers ({100 * m['rate']:.1f}%)")  # fmt: skip
    for key, row in result["scoring"].items():
        print(key, json.dumps(row))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
