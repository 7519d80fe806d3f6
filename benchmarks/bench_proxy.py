"""Proxy mode's cost: the upstream alone vs through ``actmap serve --upstream``, in one run.

For each configuration ``UPSTREAM/PROXY`` of ``--configs`` (dtypes; default
``float32/float32,bfloat16/bfloat16,float32/bfloat16``) it starts (unless ``--upstream``
is given) a vLLM OpenAI server (CPU build, SmolLM2 in the upstream's dtype, prefix
caching off so repeated prompts do not flatter the second pass) from ``--vllm-python``,
and an ``actmap serve --upstream`` process in front of it that reads answers in the
proxy's dtype (its detector recorded as fit on maps of that dtype, as the proxy
requires), then reports:

- req/s and p50/p99 latency of the upstream alone and through the proxy, at 1 and
  16 concurrent requests (TriviaQA questions from the project's *train* split),
  each ratio beside the target;
- the start-up weights probe of each pair of dtypes (log-prob difference, greedy
  margin, tolerance);
- teacher-forced scoring time per answer and per token in each proxy dtype (one pass,
  batches of 1 and 16), and what a running score would cost re-reading the answer at
  every token;
- the re-tokenization mismatch rate: on ``--answers`` answers of the first upstream, how
  often tokenizing the answer text gives other ids than vLLM generated.

Targets (issue 46): proxy throughput >= 0.8x the upstream's; added p50 below the
upstream's own p50. Both processes share this machine's cores: ``uptime`` is printed
before and after, since the machine is shared with other work.

    python benchmarks/bench_proxy.py --vllm-python /work/venv-vllm/bin/python \
        --out runs/bench-proxy.json

``--reader vllm`` starts the proxy with ``actmap serve --reader vllm``: answers read by
teacher-forced requests to an in-process vLLM engine of the proxy's weights (one prefill each,
batched by vLLM's scheduler) instead of transformers passes (issue 54: >= .8x the upstream at
16 concurrent); the per-answer scoring times (``scoring``) still time the transformers pass.
Alternate the two readers in one session to compare them::

    python benchmarks/bench_proxy.py --configs bfloat16/bfloat16 --reader vllm \
        --out runs/bench-proxy-vllm-reader.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import httpx
import numpy as np

SRC = str(Path(__file__).resolve().parents[1] / "src")
sys.path.insert(0, SRC)
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import free_port, make_detector  # noqa: E402
from bench_vllm_plugin import tree_cpu_s  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from serve_helpers import stop_process_group as stop  # noqa: E402

MODEL = "smollm2-135m-instruct"
SERVED = "smollm2"
INSTRUCTIONS = {  # --answer-length: what the user message asks for
    "short": "Answer the question in a few words.\nQuestion: {}",
    "long": "Answer the question, then explain your answer in a short paragraph.\nQuestion: {}",
}


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


def questions(n: int) -> list[str]:
    """TriviaQA questions of the project's train split (never the held-out test questions)."""
    from actmap.data.datasets import TriviaQATask

    examples = TriviaQATask().load("train")  # ../shared/data, as every command reads it
    if len(examples) < n:
        sys.exit(f"only {len(examples)} train questions")
    return [e.question for e in examples[:n]]


def chat_body(question: str, max_tokens: int, instruction: str, **extra) -> dict:
    messages = [{"role": "user", "content": instruction.format(question)}]
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
                if response.status_code != 200:
                    sys.exit(f"{url} answered {response.status_code}: {response.text[:2000]}")
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
                if response.status_code != 200:
                    sys.exit(f"{url} answered {response.status_code}: {response.text[:2000]}")
                out[i] = response.json()

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return out


def mismatch_rate(tokenizer, ends: set[int], answers: list[dict]) -> dict:
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


def timed_scoring(
    score, prompts: list[str], answer_ids: list[list[int]], batch: int, prompt_tokens: int
) -> dict:
    """Wall and CPU time per answer and per answer token of ``score(jobs)`` over the answers,
    ``batch`` at a time (CPU: this process, every thread)."""
    from actmap.serve.answers import ScoreJob

    tokens = sum(len(a) for a in answer_ids)
    started, cpu = time.perf_counter(), time.process_time()
    for i in range(0, len(prompts), batch):
        jobs = [ScoreJob(p, a) for p, a in zip(prompts[i : i + batch], answer_ids[i : i + batch], strict=True)]  # fmt: skip
        score(jobs)
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    return {"answers": len(prompts), "answer_tokens": tokens, "prompt_tokens": prompt_tokens,
            "ms_per_answer": 1000 * seconds / len(prompts),
            "ms_per_answer_token": 1000 * seconds / tokens,
            "cpu_ms_per_answer": 1000 * cpu / len(prompts),
            "cpu_ms_per_answer_token": 1000 * cpu / tokens}  # fmt: skip


def vllm_reading_cost(
    detector_run: Path, prompts: list[str], answer_ids: list[list[int]], dtype: str
) -> dict:
    """The proxy's ``--reader vllm`` (`InProcessReader`: reading + map + detector) per answer
    and per token, batches of 1, 4 and 16, its readings sharing cached prompt blocks and, for
    comparison, each with a cache salt of its own (nothing shared)."""
    import torch

    from actmap.serve.answers import ScoreJob
    from actmap.serve.app import ServeSettings, build_engine
    from actmap.serve.vllm_reader import InProcessReader

    torch.set_num_threads(1)
    settings = ServeSettings(model=MODEL, detector=detector_run, dtype=dtype)
    engine = build_engine(settings)
    reader = InProcessReader.build(settings, engine, dtype)
    try:
        prompt_tokens = sum(engine.count_tokens(p) for p in prompts)
        shared = reader.salt
        reader([ScoreJob(prompts[0], answer_ids[0])])  # warm
        out = {"dtype": dtype}
        for salt, name in ((None, "own_salt"), (shared, "shared_blocks")):
            reader.salt = salt  # None: a salt per reading (`read_request`)
            for batch in (1, 4, 16):
                # each pair read once per timing (a pair read again would find its own blocks
                # cached past its prompt and be read twice: `InProcessReader`)
                reader.capture.llm.reset_prefix_cache()
                out[f"vllm_batch_{batch}_{name}"] = timed_scoring(
                    reader, prompts, answer_ids, batch, prompt_tokens
                )
        out["vllm_reread"] = reader.reread
        out["vllm_prefix_cache_hits"] = reader.capture.recorder.prefix_cache_hits
        return out
    finally:
        reader.close()


def scoring_cost(
    detector_run: Path, prompts: list[str], answer_ids: list[list[int]], dtype: str
) -> dict:
    """Teacher-forced scoring (capture + map + detector) per answer and per token."""
    import torch

    from actmap.capture.forced import capture_answers_batch
    from actmap.capture.records import CaptureConfig
    from actmap.serve.answers import ScoreJob, chat_prefix, score_answers
    from actmap.serve.app import ServeSettings, build_engine

    torch.set_num_threads(1)
    engine = build_engine(ServeSettings(model=MODEL, detector=detector_run, dtype=dtype))
    out = {"dtype": dtype}
    prompt_tokens = sum(engine.count_tokens(p) for p in prompts)  # the pass reads these too
    prefix = chat_prefix(engine)  # what the server runs once: the template's system turn
    out["chat_prefix_tokens"] = 0 if prefix is None else len(prefix.ids)
    score_answers(engine, [ScoreJob(prompts[0], answer_ids[0])], prefix)  # warm
    for batch, shared in ((1, None), (1, prefix), (16, prefix)):
        key = f"batch_{batch}" + ("_prefix_cached" if shared is not None else "_full_pass")
        score = partial(score_answers, engine, prefix=shared)
        out[key] = timed_scoring(score, prompts, answer_ids, batch, prompt_tokens)
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


def probe(detector_run: Path, upstream: str, proxy_dtype: str, upstream_dtype: str) -> dict:
    """The start-up weights probe of this pair of dtypes, as the proxy ran it."""
    from actmap.serve.app import ServeSettings, build_engine
    from actmap.serve.upstream import probe_weights

    engine = build_engine(ServeSettings(model=MODEL, detector=detector_run, dtype=proxy_dtype))
    result = probe_weights(engine, upstream + "/v1", SERVED, 120, upstream_dtype)
    keys = ("max_logprob_diff", "max_margin", "tolerance", "problem")
    return {k: getattr(result, k) for k in keys}


def parse_configs(text: str) -> list[tuple[str, str]]:
    from actmap.llm.models import DTYPES

    configs = []
    for item in text.split(","):
        pair = tuple(item.strip().split("/"))
        if len(pair) != 2 or not all(d in DTYPES for d in pair):
            sys.exit(f"--configs: {item!r} is not UPSTREAM/PROXY with dtypes in {DTYPES}")
        configs.append(pair)
    return configs


def start_vllm(args, folder: Path, dtype: str, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    env.pop("PYTHONPATH", None)
    command = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model",
               str(folder), "--served-model-name", SERVED, "--dtype", dtype, "--port",
               str(port), "--max-model-len", "2048", "--no-enable-prefix-caching"]  # fmt: skip
    if args.enforce_eager:
        command.append("--enforce-eager")
    process = start(command, env, log)
    url = f"http://127.0.0.1:{port}"
    wait_up(url + "/v1/models", process, log, 1800)
    return process, url


def start_proxy(
    args, upstream: str, detector: Path, proxy_dtype: str, upstream_dtype: str, log: Path
) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "actmap.cli", "serve", "--upstream", upstream + "/v1",
               "--model", MODEL, "--served-model-name", SERVED, "--detector", str(detector),
               "--dtype", proxy_dtype, "--upstream-dtype", upstream_dtype,
               "--port", str(port), "--batch-window-ms", str(args.batch_window_ms), "--timeout", "600",
               "--upstream-timeout", "600", "--reader", args.reader]  # fmt: skip
    if args.proxy_nice:  # the scoring yields the cores to the engine it shares them with
        command = ["nice", "-n", str(args.proxy_nice), *command]
    process = start(command, env, log)
    url = f"http://127.0.0.1:{port}"
    wait_up(url + "/health", process, log, 600)
    return process, url


def pass_totals(proxy: str) -> dict:
    """The proxy's scoring batches so far (its /metrics): count, answers, seconds."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(proxy + "/metrics", timeout=30).text
    values = {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    return {
        "batches": values.get("actmap_batch_forced_seconds_count", 0.0),
        "answers": values.get("actmap_batch_forced_size_sum", 0.0),
        "seconds": values.get("actmap_batch_forced_seconds_sum", 0.0),
    }


MAIN_THREAD = "of which its main thread"  # the server's event loop (uvicorn runs it there)


def cpu_by_process(pid: int | None) -> dict[str, float]:
    """CPU seconds so far of a server's processes by title (`bench_vllm_plugin.tree_cpu_s`:
    the server, vLLM's ``VLLM::EngineCore``, ...) and of the server's main thread (its event
    loop: HTTP, JSON, the proxy's own logic): a run's share is the difference."""
    if pid is None:
        return {}
    import psutil

    # tree_cpu_s names the process it was given "api-server"; here that is either server
    out = {("server process" if k == "api-server" else k): v for k, v in tree_cpu_s(pid).items()}
    try:
        main = next(t for t in psutil.Process(pid).threads() if t.id == pid)
        out[MAIN_THREAD] = main.user_time + main.system_time
    except (psutil.NoSuchProcess, StopIteration):
        pass
    return out


def spent_per_request(before: dict, after: dict, n: int) -> dict[str, float]:
    return {k: (s - before.get(k, 0.0)) / n for k, s in after.items()}


def profile_proxy(pid: int, out: Path, py_spy: str) -> subprocess.Popen:
    """py-spy sampling the proxy (every thread, vLLM's in-process engine included) until
    stopped with SIGINT; raw stacks to ``out``."""
    return subprocess.Popen(
        [py_spy, "record", "-p", str(pid), "-r", "50", "-f", "raw", "-o", str(out),
         "--subprocesses", "--nonblocking"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip


# where a proxy sample goes: the first part one of whose marks its stack holds
PROFILE_PARTS = (
    ("actmap recorder in the forward (rows, statistics)", ("_Recorder.record ", "_Recorder._begin_step", "_Recorder._end_step", "_Recorder._pool_step", "_Recorder.scatter", "<locals>.compute_logits", "forced_statistics", "forced_rows", "record_hook")),
    ("reading forward (vLLM model)", ("GPUModelRunner._model_forward",)),
    ("vLLM engine, rest (scheduler, inputs, sampler, outputs)", ("vllm/",)),
    ("scoring (maps, detector, policy, audit)", ("Engine.score",)),
    ("tokenization, chat template", ("tokeniz", "render_chat", "apply_chat_template")),
    ("event loop (HTTP, JSON, httpx, proxy logic)", ("Runner.run",)),
)  # fmt: skip


def profile_split(path: Path) -> dict[str, float]:
    """Share of the proxy's samples in each of `PROFILE_PARTS` (an idle thread is not
    sampled: py-spy without ``--idle``)."""
    counts: dict[str, int] = {}
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        n = int(count)
        total += n
        part = next(
            (name for name, marks in PROFILE_PARTS if any(m in stack for m in marks)), "other"
        )
        counts[part] = counts.get(part, 0) + n
    return {
        "samples": total,
        **{k: v / max(total, 1) for k, v in sorted(counts.items(), key=lambda kv: -kv[1])},
    }


def measure(
    upstream: str,
    proxy: str,
    pools: dict,
    warm: list[dict],
    pids: dict,
    repeats: int,
    profile: Path | None = None,
    py_spy: str = "py-spy",
) -> list:
    """Upstream alone and through the proxy at 1 and 16 concurrent requests, ``repeats``
    times each, the two targets alternating (which goes first swaps every repeat, so a drift
    of the machine's speed falls on both). Each run sends its own questions (a prompt seen
    once is not answered from the upstream's prefix cache the second time) and records the
    CPU seconds each server's processes spent on it, per request (and by process title).
    With ``profile``, py-spy samples the proxy during its first run at 16 concurrent."""
    asyncio.run(load(upstream, warm, 4))  # warm both
    asyncio.run(load(proxy, warm, 4))
    runs = []
    for concurrency, bodies in pools.items():
        per_run = len(bodies) // (2 * repeats)
        chunks = iter([bodies[i : i + per_run] for i in range(0, 2 * repeats * per_run, per_run)])
        for repeat in range(repeats):
            order = [("upstream", upstream), ("proxy", proxy)]
            for name, url in order if repeat % 2 == 0 else order[::-1]:
                before = pass_totals(proxy) if name == "proxy" else None
                spy = None
                if profile is not None and name == "proxy" and concurrency > 1 and repeat == 0:
                    spy = profile_proxy(pids["proxy"], profile, py_spy)
                    time.sleep(1)  # attached before the load starts
                cpu = {k: cpu_by_process(pid) for k, pid in pids.items()}
                row = asyncio.run(load(url, next(chunks), concurrency))
                row.update(target=name, repeat=repeat)
                for k, pid in pids.items():
                    if cpu[k]:
                        spent = spent_per_request(cpu[k], cpu_by_process(pid), row["n"])
                        row[f"{k}_cpu_s_per_request"] = sum(
                            v for t, v in spent.items() if t != MAIN_THREAD
                        )
                        row[f"{k}_cpu_s_by_process"] = spent
                if spy is not None:
                    spy.send_signal(2)
                    spy.wait()
                if before is not None:  # the proxy's own scoring during this run (wall seconds)
                    after = pass_totals(proxy)
                    batches = after["batches"] - before["batches"]
                    row["scoring_batches"] = batches
                    row["answers_per_batch"] = (after["answers"] - before["answers"]) / max(batches, 1)  # fmt: skip
                    row["scoring_batch_s_total"] = after["seconds"] - before["seconds"]
                runs.append(row)
                print(json.dumps(row), flush=True)
    return runs


def summary(runs: list[dict]) -> dict:
    """Per concurrency: each repeat's proxy/upstream req/s ratio (the pair run back to back),
    their median and range, and the median p50s."""
    out = {}
    for c in sorted({r["concurrency"] for r in runs}):
        rows = [r for r in runs if r["concurrency"] == c]
        by = {(r["target"], r["repeat"]): r for r in rows}
        repeats = sorted({r["repeat"] for r in rows})
        ratios = [by["proxy", k]["req_per_s"] / by["upstream", k]["req_per_s"] for k in repeats]
        p50 = {t: float(np.median([by[t, k]["p50_s"] for k in repeats])) for t in ("upstream", "proxy")}  # fmt: skip
        out[c] = {
            "ratios": ratios, "ratio_median": float(np.median(ratios)),
            "upstream_p50_s": p50["upstream"], "added_p50_s": p50["proxy"] - p50["upstream"],
            "requests_per_run": rows[0]["n"],
        }  # fmt: skip
        for t in ("upstream", "proxy"):
            for key in ("upstream_cpu_s_per_request", "proxy_cpu_s_per_request"):
                values = [by[t, k][key] for k in repeats if key in by[t, k]]
                if values:
                    out[c][f"{t}_run_{key}"] = float(np.median(values))
        out[c].update(cpu_bounds(out[c]))
    return out


def cpu_bounds(s: dict) -> dict:
    """What the CPU per request allows when both servers share the cores and are CPU-bound:
    U = the upstream's CPU per request alone, U' = the upstream's behind the proxy, R = the
    proxy's. ``bound``: U / (U + R) (the proxy's own cost only); ``cpu_predicted``:
    U / (U' + R), the ratio of the CPU per request of the two runs."""
    try:
        u = s["upstream_run_upstream_cpu_s_per_request"]
        u_via = s["proxy_run_upstream_cpu_s_per_request"]
        r = s["proxy_run_proxy_cpu_s_per_request"]
    except KeyError:
        return {}
    return {"bound": u / (u + r), "cpu_predicted": u / (u_via + r)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--vllm-python",
        default=sys.executable,
        help="a python that imports vllm (default: this one)",
    )
    parser.add_argument(
        "--upstream", help="an already running upstream base URL (no /v1): one configuration"
    )
    parser.add_argument(
        "--configs", default="float32/float32,bfloat16/bfloat16,float32/bfloat16",
        help="UPSTREAM/PROXY dtype pairs, comma-separated (with --upstream: one pair, its "
        "UPSTREAM naming the running server's dtype)",
    )  # fmt: skip
    parser.add_argument(
        "--requests", type=int, default=128, help="requests per load run at 16 concurrent"
    )
    parser.add_argument(
        "--requests-single", type=int, default=16, help="requests per load run at 1 concurrent"
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="load runs per target and concurrency"
    )
    parser.add_argument(
        "--upstream-pid", type=int,
        help="with --upstream: its server's process id, for its processes' CPU time",
    )  # fmt: skip
    parser.add_argument(
        "--profile", type=Path,
        help="a folder: py-spy samples the proxy during its first run at 16 concurrent "
        "(PROXY-DTYPES.txt, raw stacks) and the split of its samples is printed",
    )  # fmt: skip
    parser.add_argument("--py-spy", default=shutil.which("py-spy") or "py-spy")
    parser.add_argument(
        "--batch-window-ms", type=float, default=5.0, help="the proxy's batch window"
    )
    parser.add_argument("--proxy-nice", type=int, default=0, help="start the proxy under nice -n N")
    parser.add_argument(
        "--reader", choices=("transformers", "vllm"), default="transformers",
        help="what the proxy reads answers with (actmap serve --reader): transformers passes, "
        "or teacher-forced requests to an in-process vLLM engine (needs vLLM where actmap runs)",
    )  # fmt: skip
    parser.add_argument("--answers", type=int, default=500, help="answers for the mismatch rate")
    parser.add_argument("--scoring-answers", type=int, default=64, help="answers timed per dtype")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument(
        "--answer-length", choices=sorted(INSTRUCTIONS), default="short",
        help="short: 'in a few words' (the proxy's worst case: its pass reads mostly prompt); "
        "long: an answer with a short explanation (raise --max-tokens with it)",
    )  # fmt: skip
    parser.add_argument(
        "--enforce-eager", action="store_true", help="vLLM without compilation (faster start)"
    )
    parser.add_argument("--out", type=Path, default=Path("runs/bench-proxy.json"))
    args = parser.parse_args()
    configs = parse_configs(args.configs)
    instruction = INSTRUCTIONS[args.answer_length]
    if args.upstream and len({u for u, _ in configs}) != 1:
        sys.exit("--upstream is one running server: give --configs of its one upstream dtype")

    from actmap.capture.generate import stop_ids
    from actmap.llm.models import cache_dir, check_model, load_model

    model, tokenizer, source = load_model(MODEL)  # also writes the de-quantized folder vLLM reads
    folder = cache_dir() / f"{Path(source.gguf_file).stem}-{source.revision}"
    ends = stop_ids(model, tokenizer)
    del model
    work = Path(tempfile.mkdtemp(prefix="bench-proxy-"))
    detectors = {p: make_detector(work / f"run-{p}", p) for p in {p for _, p in configs}}
    result = {"uptime_before": uptime(), "model": MODEL, "max_tokens": args.max_tokens,
              "answer_length": args.answer_length, "instruction": instruction,
              "configs": [f"{u}/{p}" for u, p in configs], "load": [], "probe": {},
              "scoring": {}, "summary": {}, "profile": {}, "repeats": args.repeats,
              "batch_window_ms": args.batch_window_ms, "proxy_nice": args.proxy_nice,
              "reader": args.reader}  # fmt: skip
    sizes = {1: 2 * args.repeats * args.requests_single, 16: 2 * args.repeats * args.requests}
    asked = questions(args.answers + sum(sizes.values()))
    load_questions, mismatch_questions = asked[: sum(sizes.values())], asked[sum(sizes.values()) :]
    bodies = [chat_body(q, args.max_tokens, instruction) for q in load_questions]
    pools = {1: bodies[: sizes[1]], 16: bodies[sizes[1] :]}
    warm = [chat_body(q, args.max_tokens, instruction) for q in asked[-4:]]
    prompts, ids = [], []
    for upstream_dtype in dict.fromkeys(u for u, _ in configs):  # in order, each once
        processes = []
        try:
            upstream = args.upstream
            if upstream is None:
                log = work / f"vllm-{upstream_dtype}.log"
                process, upstream = start_vllm(args, folder, upstream_dtype, log)
                processes.append(process)
                upstream_pid = process.pid
            else:
                upstream_pid = args.upstream_pid
            for u, proxy_dtype in configs:
                if u != upstream_dtype:
                    continue
                name = f"{u}/{proxy_dtype}"
                log = work / f"proxy-{u}-{proxy_dtype}.log"
                process, proxy = start_proxy(
                    args, upstream, detectors[proxy_dtype], proxy_dtype, u, log
                )
                processes.append(process)
                check_model(MODEL)
                pids = {"upstream": upstream_pid, "proxy": process.pid}
                spied = None
                if args.profile is not None:
                    args.profile.mkdir(parents=True, exist_ok=True)
                    spied = args.profile / f"proxy-{u}-{proxy_dtype}.txt"
                runs = measure(upstream, proxy, pools, warm, pids, args.repeats, spied, args.py_spy)
                if spied is not None and spied.exists():
                    result["profile"][name] = profile_split(spied)
                    print(name, "proxy profile", json.dumps(result["profile"][name]), flush=True)
                result["load"] += [{"config": name, **row} for row in runs]
                result["summary"][name] = summary(runs)
                stop(processes.pop())
                result["probe"][name] = probe(detectors[proxy_dtype], upstream, proxy_dtype, u)
                print(name, "probe", json.dumps(result["probe"][name]), flush=True)
            if "mismatch" not in result:  # the first upstream's answers
                generated = asyncio.run(
                    answers_with_ids(
                        upstream,
                        [
                            chat_body(q, args.max_tokens, instruction, return_token_ids=True)
                            for q in mismatch_questions
                        ],
                    )  # fmt: skip
                )
                result["mismatch"] = mismatch_rate(tokenizer, ends, generated)
                result["mismatch"]["upstream_dtype"] = upstream_dtype
                print(json.dumps({k: v for k, v in result["mismatch"].items() if k != "examples"}), flush=True)  # fmt: skip
                pairs = list(zip(mismatch_questions, generated, strict=True))
                for question, body in pairs[: args.scoring_answers]:
                    answer = [t for t in body["choices"][0]["token_ids"] if t not in ends]
                    messages = [{"role": "user", "content": instruction.format(question)}]
                    prompts.append(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))  # fmt: skip
                    ids.append(answer)
        finally:
            for process in reversed(processes):
                stop(process)
    result["upstream"] = {"url": args.upstream, "started_here": args.upstream is None}
    for proxy_dtype in dict.fromkeys(p for _, p in configs):  # all servers stopped
        result["scoring"][proxy_dtype] = scoring_cost(detectors[proxy_dtype], prompts, ids, proxy_dtype)  # fmt: skip
        if args.reader == "vllm":  # what the proxy's reader costs, off the load
            reading = vllm_reading_cost(detectors[proxy_dtype], prompts, ids, proxy_dtype)
            result["scoring"][proxy_dtype].update(reading)
        print(json.dumps(result["scoring"][proxy_dtype]), flush=True)
    result["uptime_after"] = uptime()
    report(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"written to {args.out}")


def report(result: dict) -> None:
    print(f"\nload before: {result['uptime_before']}\nload after:  {result['uptime_after']}")
    print(f"{result['repeats']} runs per target and concurrency, alternating; proxy batch window {result['batch_window_ms']} ms, nice {result['proxy_nice']}")  # fmt: skip
    print(f"{'upstream/proxy':>17} {'conc.':>5} {'rep':>3} {'target':>9} {'req/s':>7} {'p50 s':>7} {'p99 s':>7} {'up cpu/req':>10} {'proxy cpu/req':>13}")  # fmt: skip
    for name in result["configs"]:
        for c in (1, 16):
            for r in (r for r in result["load"] if r["config"] == name and r["concurrency"] == c):
                cpu = [f"{r[k]:.3f}" if k in r else "-" for k in ("upstream_cpu_s_per_request", "proxy_cpu_s_per_request")]  # fmt: skip
                print(f"{name:>17} {c:>5} {r['repeat']:>3} {r['target']:>9} {r['req_per_s']:7.2f} {r['p50_s']:7.3f} {r['p99_s']:7.3f} {cpu[0]:>10} {cpu[1]:>13}")  # fmt: skip
                for k in ("upstream", "proxy"):
                    if r["target"] == "proxy" and f"{k}_cpu_s_by_process" in r:
                        parts = ", ".join(f"{t} {1e3 * v:.1f}" for t, v in r[f"{k}_cpu_s_by_process"].items())  # fmt: skip
                        print(f"{'':>17} {'':>5} {'':>3} {k} cpu ms/request by process: {parts}")  # fmt: skip
                if "scoring_batches" in r:
                    print(f"{'':>17} {'':>5} {'':>3} the proxy's scoring: {r['scoring_batches']:.0f} batches of {r['answers_per_batch']:.1f} answers, {r['scoring_batch_s_total']:.2f} s in all")  # fmt: skip
            s = result["summary"][name][c]
            ratio, added = s["ratio_median"], s["added_p50_s"]
            ratios = ", ".join(f"{x:.2f}" for x in s["ratios"])
            print(f"{'':>17} {'':>5} throughput ratio {ratio:.2f} median of [{ratios}] (target >= 0.8: {'met' if ratio >= 0.8 else 'NOT met'}), added p50 {added:+.3f} s vs upstream p50 {s['upstream_p50_s']:.3f} s ({'met' if added < s['upstream_p50_s'] else 'NOT met'})")  # fmt: skip
            if "bound" in s:
                print(f"{'':>17} {'':>5} cpu bound U/(U+R) {s['bound']:.2f} (U {s['upstream_run_upstream_cpu_s_per_request']:.3f} s the upstream alone, R {s['proxy_run_proxy_cpu_s_per_request']:.3f} s the proxy); U/(U'+R) {s['cpu_predicted']:.2f} (U' {s['proxy_run_upstream_cpu_s_per_request']:.3f} s the upstream behind the proxy)")  # fmt: skip
        for part, share in result.get("profile", {}).get(name, {}).items():
            if part != "samples":
                print(f"{'':>17} proxy profile {100 * share:5.1f}%  {part}")
        p = result["probe"][name]
        print(f"{'':>17} weights probe: log-prob diff {p['max_logprob_diff']}, greedy margin {p['max_margin']}, tolerance {p['tolerance']}, problem {p['problem']}")  # fmt: skip
    m = result["mismatch"]
    print(f"re-tokenization differs from vLLM's ({m['upstream_dtype']}) ids on {m['retokenized_differs']}/{m['n']} answers ({100 * m['rate']:.1f}%)")  # fmt: skip
    print(f"{'proxy dtype':>11} {'pass':>26} {'ms/answer':>9} {'ms/token':>8} {'cpu ms/answer':>13} {'cpu ms/token':>12}")  # fmt: skip
    for dtype, rows in result["scoring"].items():
        for key, row in rows.items():
            if key.startswith(("batch_", "vllm_batch_")):
                print(f"{dtype:>11} {key:>26} {row['ms_per_answer']:9.1f} {row['ms_per_answer_token']:8.2f} {row['cpu_ms_per_answer']:13.1f} {row['cpu_ms_per_answer_token']:12.2f}")  # fmt: skip
        r = rows["running_score"]
        print(f"{dtype:>11} running score (a pass per token): {r['ratio']:.1f}x one pass")


if __name__ == "__main__":
    main()
