"""Load test of `actmap serve` on loopback, and the cost of capture + map + scoring.

Starts ``actmap serve`` (SmolLM2 by default) on 127.0.0.1, sends a bounded load
(``--clients`` concurrent clients, ``--requests`` requests in all, built-in
arithmetic questions as chat messages), and reports throughput, p50/p99 latency,
errors, the server's peak RSS (VmHWM) and what the server's /metrics say about
batch sizes and per-batch time. Then, in this process, on the same prompts, it
times plain generation (`generate_plain`, no hooks) against generation with
capture + maps + detector (`generate_batch`, `answer_maps`, `predict_proba`), at
the batch size the server used most, so the added latency is measured in the
same run. Stops by itself; nothing leaves the machine.

    python benchmarks/bench_serve.py --detector runs/mlp --clients 16 --requests 200
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

SRC = str(Path(__file__).resolve().parents[1] / "src")
KEY = "bench"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_detector(folder: Path, dtype: str = "float32") -> Path:
    """A logistic-regression detector fitted on random maps: scoring costs what a real one
    costs; its scores mean nothing (the benchmark measures speed). ``dtype``: the generator
    dtype its (pretend) training store records, which `actmap serve` reads answers in."""
    from actmap.detectors.base import CorrectnessDetector
    from actmap.training.recipe import TrainConfig

    rng = np.random.default_rng(0)
    maps = rng.normal(size=(24, 12, 32, 128)).astype(np.float16)
    labels = np.arange(24) % 2
    config = TrainConfig(max_epochs=2, warmup_epochs=1, patience=2, device="cpu", batch_size=8)
    detector = CorrectnessDetector("logreg", config=config, seed=0, device="cpu")
    detector.fit(maps[:16], labels[:16], maps[16:], labels[16:])
    detector.save(folder / "seed-0", {"inputs": {"store_config": {"model": {"dtype": dtype}}}})
    return folder


def peak_rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def questions(n: int) -> list[str]:
    from actmap.data.builtin import INSTRUCTION, make_questions

    return [f"{q} {INSTRUCTION}" for q, _ in make_questions(n, seed=7)]


def start_server(args, port: int, audit: Path | None) -> subprocess.Popen:
    command = [
        sys.executable, "-m", "actmap.cli", "serve", "--model", args.model,
        "--detector", str(args.detector), "--port", str(port),
        "--max-tokens", str(args.max_tokens), "--batch-size", str(args.batch_size),
        "--batch-window-ms", str(args.window_ms), "--timeout", "600",
    ]  # fmt: skip
    if audit is not None:
        command += ["--audit", str(audit)]
    env = {**os.environ, "PYTHONPATH": SRC, "ACTMAP_API_KEY": KEY}
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def wait_ready(process: subprocess.Popen, base: str, limit_s: float = 600) -> None:
    deadline = time.time() + limit_s
    while time.time() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"actmap serve exited:\n{process.stdout.read().decode()}")
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    process.kill()
    raise SystemExit("actmap serve did not come up")


async def load(base: str, model: str, prompts: list[str], clients: int, max_tokens: int) -> dict:
    todo = list(enumerate(prompts))
    latencies, tokens, errors, decisions = [], [], [], {}
    headers = {"Authorization": f"Bearer {KEY}"}

    async def client(http: httpx.AsyncClient) -> None:
        while todo:
            _, prompt = todo.pop()
            body = {
                "model": model,
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": max_tokens,
            }
            tick = time.perf_counter()
            try:
                response = await http.post(
                    f"{base}/v1/chat/completions", json=body, headers=headers
                )
            except httpx.HTTPError as error:
                errors.append(repr(error))
                continue
            if response.status_code != 200:
                errors.append(f"{response.status_code}: {response.text[:200]}")
                continue
            latencies.append(time.perf_counter() - tick)
            out = response.json()
            tokens.append(out["usage"]["completion_tokens"])
            decision = out["actmap"]["decision"]
            decisions[decision] = decisions.get(decision, 0) + 1

    started = time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as http:
        await asyncio.gather(*(client(http) for _ in range(clients)))
    wall = time.perf_counter() - started
    lat = np.array(latencies)
    return {
        "requests": len(prompts),
        "ok": len(latencies),
        "errors": len(errors),
        "error_examples": errors[:3],
        "wall_s": wall,
        "throughput_rps": len(latencies) / wall,
        "completion_tokens_per_s": sum(tokens) / wall,
        "latency_p50_s": float(np.percentile(lat, 50)) if len(lat) else None,
        "latency_p99_s": float(np.percentile(lat, 99)) if len(lat) else None,
        "mean_completion_tokens": float(np.mean(tokens)) if tokens else None,
        "decisions": decisions,
    }


def server_metrics(base: str) -> dict:
    text = httpx.get(f"{base}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    values = {}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name, value = line.rsplit(" ", 1)
        values[name] = float(value)

    def mean(prefix: str) -> float | None:
        count = values.get(f"{prefix}_count", 0)
        return values.get(f"{prefix}_sum", 0) / count if count else None

    return {
        "batches": values.get("actmap_batch_size_count"),
        "mean_batch_size": mean("actmap_batch_size"),
        "mean_batch_generation_s": mean("actmap_batch_generation_seconds"),
        "mean_batch_scoring_s": mean("actmap_batch_scoring_seconds"),
    }


def added_latency(args, prompts: list[str], batch: int, repeats: int) -> dict:
    """Plain generation vs generation + capture + maps + detector, same prompts, interleaved."""
    import torch

    from actmap.capture import CaptureConfig, generate_batch, generate_plain
    from actmap.capture.answer_scalars import scalars_of_generations
    from actmap.llm.models import load_model
    from actmap.serve.loaded_run import answer_maps, load_detector_run

    model, tokenizer, _ = load_model(args.model)
    detector = load_detector_run(args.detector)
    chats = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
        )
        for p in prompts[:batch]
    ]
    config = CaptureConfig(  # what the server captures for this detector
        max_new_tokens=args.max_tokens, batch_size=batch, greybox=detector.needs_scalars
    )
    # wall seconds and this process's CPU seconds (less sensitive to other processes' load)
    plain, captured, scoring, plain_cpu, captured_cpu = [], [], [], [], []
    generate_plain(model, tokenizer, chats, config)  # warm-up
    for _ in range(repeats):
        tick, cpu = time.perf_counter(), time.process_time()
        generate_plain(model, tokenizer, chats, config)
        plain.append(time.perf_counter() - tick)
        plain_cpu.append(time.process_time() - cpu)
        tick, cpu = time.perf_counter(), time.process_time()
        generations = generate_batch(model, tokenizer, chats, config)
        middle = time.perf_counter()
        kept = [g for g in generations if g.n_tokens]
        scalars = scalars_of_generations(kept) if detector.needs_scalars else None
        detector.predict_proba(
            answer_maps([g.trajectory for g in kept], detector.map_config), scalars
        )
        done = time.perf_counter()
        captured.append(done - tick)
        captured_cpu.append(time.process_time() - cpu)
        scoring.append(done - middle)
    p, c, s, pc, cc = (
        statistics.median(x) for x in (plain, captured, scoring, plain_cpu, captured_cpu)
    )
    return {
        "batch": batch,
        "repeats": repeats,
        "threads": torch.get_num_threads(),
        "plain_generation_s": p,
        "capture_map_score_s": c,
        "of_which_map_and_score_s": s,
        "added_s_per_batch": c - p,
        "added_percent": 100 * (c - p) / p,
        "plain_generation_cpu_s": pc,
        "capture_map_score_cpu_s": cc,
        "added_cpu_percent": 100 * (cc - pc) / pc,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--detector", type=Path, required=True, help="run folder (actmap train)")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--window-ms", type=float, default=10.0)
    parser.add_argument("--no-audit", action="store_true", help="serve without an audit store")
    parser.add_argument("--repeats", type=int, default=3, help="added-latency repetitions")
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    parser.add_argument(
        "--only-added", type=int, metavar="BATCH", help="skip the load test; compare at BATCH"
    )
    args = parser.parse_args()

    prompts = questions(args.requests)
    if args.only_added:
        print(json.dumps(added_latency(args, prompts, args.only_added, args.repeats), indent=2))
        return
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp:
        audit = None if args.no_audit else Path(tmp) / "audit"
        process = start_server(args, port, audit)
        try:
            wait_ready(process, base)
            result = asyncio.run(load(base, args.model, prompts, args.clients, args.max_tokens))
            result["server"] = server_metrics(base)
            result["server_peak_rss_mib"] = peak_rss_mib(process.pid)
        finally:
            process.terminate()
            process.wait(120)
    print(json.dumps(result, indent=2), flush=True)  # the load test, before the in-process part
    batch = max(1, round(result["server"]["mean_batch_size"] or 1))
    result["added_latency"] = added_latency(args, prompts, batch, args.repeats)
    result["load_average"] = os.getloadavg()
    result["cpu_count"] = os.cpu_count()
    result["settings"] = {k: str(v) for k, v in vars(args).items()}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    if result["errors"]:
        raise SystemExit(f"{result['errors']} requests failed")


if __name__ == "__main__":
    main()
