"""vLLM with and without actmap: plain vLLM, vLLM with map-only capture, `actmap serve --engine
vllm`, vLLM's own OpenAI server, and today's `actmap serve`, on the same chat prompts.

Two parts, one run, same prompts (built-in arithmetic questions, greedy, at most
``--max-tokens`` new tokens, SmolLM2 by default, float32):

1. In-process (this process, one vLLM engine): plain vLLM (no hooks: the capture is detached)
   against vLLM with map-only capture (`actmap.capture.vllm_engine.VllmCapture`, greybox off),
   interleaved ``--repeats`` times, each at ``c`` requests in flight (a new request is added
   as soon as one finishes). Target: capture >= 0.97x plain throughput at 16 in flight.
2. Servers on loopback, driven by ``c`` concurrent HTTP clients: vLLM's own OpenAI server
   (``python -m vllm.entrypoints.openai.api_server``, ``--enforce-eager`` like the capture),
   ``actmap serve --engine vllm`` (vLLM's own server with the actmap plugin: capture +
   detector + policy + audit; before issue 54 item 5 an in-process server) and ``actmap serve``
   (transformers, micro-batches). Target: ``actmap serve --engine vllm`` >= 0.9x vLLM's server.

Every figure: requests/s, completion tokens/s, p50/p99 latency, peak RSS (servers: the sum of
the VmHWM of the server process and its children; in-process: this process's, both modes
together, KV cache included: VLLM_CPU_KVCACHE_SPACE=2 GiB everywhere). Record the machine's load
next to the figures (printed at start and end).

    OMP_NUM_THREADS=1 python benchmarks/bench_vllm.py --concurrency 1,16,64 --requests 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import KEY, free_port, make_detector, peak_rss_mib, questions  # noqa: E402

SRC = str(Path(__file__).resolve().parents[1] / "src")


def summary(latencies: list[float], tokens: int, wall: float, n: int) -> dict:
    lat = np.array(latencies)
    return {
        "requests": n,
        "ok": len(latencies),
        "wall_s": round(wall, 2),
        "req_per_s": round(len(latencies) / wall, 3),
        "tokens_per_s": round(tokens / wall, 2),
        "p50_s": round(float(np.percentile(lat, 50)), 3) if len(lat) else None,
        "p99_s": round(float(np.percentile(lat, 99)), 3) if len(lat) else None,
    }


# -- part 1: in-process ------------------------------------------------------------------------
def in_flight(
    capture, prompts: list[list[int]], width: int, max_tokens: int, plain_engine=None,
    config=None,
) -> dict:  # fmt: skip
    """Keep ``width`` requests in flight until every prompt is answered: on ``plain_engine``
    (a vLLM engine without record points) when given, else through the capture (``config``:
    what each request keeps; None: map-only)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    from actmap.capture.records import CaptureConfig

    config = config or CaptureConfig(max_new_tokens=max_tokens, greybox=False)
    params = SamplingParams(
        max_tokens=max_tokens, temperature=0.0, detokenize=False,
        stop_token_ids=sorted(capture.ends), output_kind=RequestOutputKind.DELTA,
    )  # fmt: skip
    plain = plain_engine is not None
    engine = plain_engine
    todo = list(enumerate(prompts))
    started_at, latencies, tokens, counts = {}, [], 0, {}
    counter = iter(range(10**9))

    def add() -> None:
        i, ids = todo.pop(0)
        if plain:
            key = f"plain-{next(counter)}"
            engine.add_request(key, {"prompt_token_ids": ids}, params)
        else:
            key = capture.submit("", config, ids)
        started_at[key] = time.perf_counter()

    tick, cpu = time.perf_counter(), time.process_time()
    while todo or started_at:
        while todo and len(started_at) < width:
            add()
        if plain:
            for out in engine.step():
                new = list(out.outputs[0].token_ids)
                counts[out.request_id] = counts.get(out.request_id, 0) + len(new)
                if out.finished:
                    latencies.append(time.perf_counter() - started_at.pop(out.request_id))
                    ended = bool(new) and new[-1] in capture.ends  # the end token is no answer
                    tokens += counts.pop(out.request_id) - ended
        else:
            for event in capture.step():
                if event.finished is not None:
                    latencies.append(time.perf_counter() - started_at.pop(event.key))
                    tokens += event.finished.n_tokens
    out = summary(latencies, tokens, time.perf_counter() - tick, len(prompts))
    out["cpu_s"] = round(time.process_time() - cpu, 2)  # this process's CPU: less load-sensitive
    return out


def part_in_process(args, prompts_text: list[str]) -> list[dict]:
    from vllm import LLM

    from actmap.capture.records import CaptureConfig
    from actmap.capture.vllm_engine import VllmCapture, VllmOptions, vllm_model_folder

    widest = max(args.concurrency)
    eager = not args.compiled
    options = VllmOptions(max_num_seqs=widest, kv_cache_gib=2, enforce_eager=eager)
    # plain vLLM: a second engine in this process, built the same way without record points.
    # Built first: of two engines in one process the one built second ran about 4% faster
    # here whichever it was, so "idle" (the capture engine with its record points switched
    # off) is the comparison without that effect.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    folder, _ = vllm_model_folder(args.model)
    plain = LLM(
        model=folder, tokenizer=folder, dtype=args.dtype, enforce_eager=eager, max_model_len=2048,
        max_num_seqs=widest, enable_prefix_caching=True, seed=0, max_logprobs=1,
    ).llm_engine  # fmt: skip
    capture = VllmCapture(args.model, args.dtype, options, greybox=False, max_context=2048)
    chats = [
        capture.tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
        )
        for p in prompts_text
    ]
    ids = capture.encode(chats, CaptureConfig(max_new_tokens=args.max_tokens))
    rows = []
    for width in args.concurrency:
        n = max(args.requests if width > 1 else args.requests_single, width)
        batch = (ids * (n // len(ids) + 1))[:n]
        runs = {"plain": [], "idle": [], "capture": []}
        engines = {"plain": plain, "idle": capture.engine, "capture": None}
        for engine in (plain, None):  # warm-up
            in_flight(capture, batch[: min(4, n)], width, args.max_tokens, engine)
        for _ in range(args.repeats):
            for mode, engine in engines.items():
                capture.set_recording(mode != "idle")
                runs[mode].append(in_flight(capture, batch, width, args.max_tokens, engine))
        capture.set_recording(True)
        median = {}
        for mode, results in runs.items():
            median[mode] = sorted(results, key=lambda r: r["req_per_s"])[len(results) // 2]
            row = {"part": "in-process", "mode": mode, "concurrency": width, **median[mode]}
            row["all_req_per_s"] = [r["req_per_s"] for r in results]
            rows.append(row)
        for base in ("plain", "idle"):
            ratio = median["capture"]["req_per_s"] / median[base]["req_per_s"]
            rows[-1][f"ratio_vs_{base}"] = round(ratio, 3)
            cpu = np.median([r["cpu_s"] for r in runs[base]])
            capture_cpu = np.median([r["cpu_s"] for r in runs["capture"]])
            rows[-1][f"cpu_ratio_vs_{base}"] = round(float(cpu / capture_cpu), 3)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    for r in rows:
        r["peak_rss_mib"] = round(peak, 1)
    capture.close()
    return rows


# -- part 2: servers ---------------------------------------------------------------------------
async def http_load(base: str, model: str, prompts: list[str], clients: int, max_tokens: int):
    todo = list(prompts)
    latencies, tokens, errors = [], [0], []
    headers = {"Authorization": f"Bearer {KEY}"}

    async def client(http: httpx.AsyncClient) -> None:
        while todo:
            prompt = todo.pop()
            body = {
                "model": model, "messages": [{"role": "user", "content": prompt}],
                "max_tokens": max_tokens, "temperature": 0,
            }  # fmt: skip
            tick = time.perf_counter()
            response = await http.post(f"{base}/v1/chat/completions", json=body, headers=headers)
            if response.status_code != 200:
                errors.append(f"{response.status_code}: {response.text[:200]}")
                continue
            latencies.append(time.perf_counter() - tick)
            tokens[0] += response.json()["usage"]["completion_tokens"]

    started = time.perf_counter()
    async with httpx.AsyncClient(timeout=1200) as http:
        await asyncio.gather(*(client(http) for _ in range(clients)))
    out = summary(latencies, tokens[0], time.perf_counter() - started, len(prompts))
    out["errors"] = errors[:3]
    return out


def start(kind: str, args, port: int, folder: str, audit: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": SRC, "ACTMAP_API_KEY": KEY}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    widest = str(max(args.concurrency))
    if kind == "vllm-openai":
        command = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", folder,
            "--served-model-name", "bench", "--dtype", args.dtype, "--port", str(port),
            "--max-num-seqs", widest, "--enforce-eager", "--max-model-len", "2048",
        ]  # fmt: skip
        env.pop("ACTMAP_API_KEY")
    else:
        command = [
            sys.executable, "-m", "actmap.cli", "serve", "--model", args.model,
            "--served-model-name", "bench", "--detector", str(args.detector),
            "--port", str(port), "--max-tokens", str(args.max_tokens),
            "--audit", str(audit), "--dtype", args.dtype,
        ]  # fmt: skip
        if kind == "actmap-vllm":  # vLLM's own server with the actmap plugin (docs/vllm.md)
            command += ["--engine", "vllm", "--batch-size", widest, "--max-context", "2048",
                        "--vllm-eager"]  # fmt: skip
        else:  # today's server caps a batch at 16
            command += ["--batch-size", "16", "--timeout", "1200", "--queue-size", "1024"]
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def wait(
    process: subprocess.Popen, base: str, path: str, limit_s: float = 900, log: Path | None = None
) -> None:
    """Until ``base + path`` answers 200; the server's output is its stdout pipe, or ``log``."""
    deadline = time.time() + limit_s
    while time.time() < deadline:
        if process.poll() is not None:
            output = log.read_text() if log is not None else process.stdout.read().decode()
            errors = "\n".join([line for line in output.splitlines() if "ERROR" in line][-5:])
            raise SystemExit(f"server exited:\n{output[-3000:]}\n{errors}")
        try:
            if httpx.get(f"{base}{path}", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(1)
    process.kill()
    raise SystemExit("server did not come up")


def part_servers(args, prompts: list[str], folder: str) -> list[dict]:
    rows = []
    for kind in args.servers:
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        with tempfile.TemporaryDirectory() as tmp:
            process = start(kind, args, port, folder, Path(tmp) / "audit")
            try:
                wait(process, base, "/health")
                asyncio.run(http_load(base, "bench", prompts[:2], 1, args.max_tokens))  # warm-up
                for width in args.concurrency:
                    n = max(args.requests if width > 1 else args.requests_single, width)
                    batch = (prompts * (n // len(prompts) + 1))[:n]
                    result = asyncio.run(http_load(base, "bench", batch, width, args.max_tokens))
                    rows.append({"part": "server", "mode": kind, "concurrency": width, **result})
                peak = tree_peak_rss_mib(process.pid)
                for r in rows:
                    if r["mode"] == kind:
                        r["peak_rss_mib"] = round(peak, 1) if peak else None
            finally:
                stop_server(process)
    return rows


def stop_server(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(60)
    except subprocess.TimeoutExpired:
        process.kill()


def tree_peak_rss_mib(pid: int) -> float | None:
    """Sum of the peak RSS (VmHWM) of a server and its child processes (vLLM's own server runs
    its engine core in a child process): an upper bound of the tree's peak."""
    import psutil

    try:
        pids = [pid] + [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return None
    peaks = [peak_rss_mib(p) for p in pids]
    return sum(p for p in peaks if p is not None) or None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--detector", type=Path, default=None, help="run folder (default: a "
                        "logreg fitted on random maps, written to a temporary folder)")
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--requests", type=int, default=64, help="requests per concurrency > 1")
    parser.add_argument("--requests-single", type=int, default=4, help="at concurrency 1")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="in-process interleaved repeats")
    parser.add_argument("--servers", default="vllm-openai,actmap-vllm,actmap")
    parser.add_argument("--skip", default="", help="in-process | servers")
    parser.add_argument("--out", type=Path, default=None, help="write the rows as JSON")
    parser.add_argument(
        "--compiled", action="store_true", help="in-process part: vLLM's compiled model, both modes"
    )
    args = parser.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.servers = [s for s in args.servers.split(",") if s]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(f"load at start: {os.getloadavg()}  OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}")
    tmp = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    if args.detector is None:
        args.detector = make_detector(tmp / "run")
    prompts = questions(max(args.requests, 64))
    from actmap.capture.vllm_engine import vllm_model_folder

    folder, _ = vllm_model_folder(args.model)
    rows = []
    if "in-process" not in args.skip:
        rows += part_in_process(args, prompts)
    if "servers" not in args.skip:
        rows += part_servers(args, prompts, folder)
    reference = {(r["mode"], r["concurrency"]): r for r in rows}
    for r in rows:
        if r["mode"] == "actmap-vllm" and ("vllm-openai", r["concurrency"]) in reference:
            base = reference[("vllm-openai", r["concurrency"])]["req_per_s"]
            r["ratio_vs_vllm_server"] = round(r["req_per_s"] / base, 3)
        if r["mode"] == "actmap" and ("actmap-vllm", r["concurrency"]) in reference:
            r["ratio_vs_actmap_vllm"] = round(
                r["req_per_s"] / reference[("actmap-vllm", r["concurrency"])]["req_per_s"], 3
            )
    header = "part        mode          c   req/s  tok/s   p50_s   p99_s  peakMiB  ratio"
    print(header)
    for r in rows:
        ratio = r.get("ratio_vs_vllm_server") or ""
        if "ratio_vs_plain" in r:
            ratio = f"{r['ratio_vs_plain']} vs plain, {r['ratio_vs_idle']} vs idle"
        print(
            f"{r['part']:<11} {r['mode']:<12} {r['concurrency']:>3} {r['req_per_s']:>7} "
            f"{r['tokens_per_s']:>6} {r['p50_s']!s:>7} {r['p99_s']!s:>7} "
            f"{r.get('peak_rss_mib')!s:>8}  {ratio}"
        )
    for r in rows:
        if "all_req_per_s" in r:
            print(f"{r['mode']:<8} c={r['concurrency']}: every repeat's req/s {r['all_req_per_s']}"
                  + (f"; CPU-time ratio capture/plain {r['cpu_ratio_vs_plain']}, capture/idle "
                     f"{r['cpu_ratio_vs_idle']}" if "cpu_ratio_vs_plain" in r else ""))
    print("targets: capture >= 0.97x plain at c=16; actmap-vllm >= 0.9x vllm-openai at c=16, 64")
    print(f"load at end: {os.getloadavg()}")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
