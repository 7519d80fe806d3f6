"""vLLM's own OpenAI server with and without the actmap plugin, same flags, same threads.

Two servers, started one after the other and alternated ``--repeats`` times (plain, plugin,
plain, plugin, ...), each driven by ``c`` concurrent HTTP chat clients on loopback
(`bench_vllm.http_load`: built-in arithmetic questions, greedy, at most ``--max-tokens`` new
tokens). Both run ``python -m vllm.entrypoints.openai.api_server`` with the same flags; the
plugin's adds the worker extension, the middleware and ``--additional-config`` with a detector
(default: a logreg fitted on random maps; ``--detector RUN`` for a real one, e.g. an
actmap-plus, which also reads log-probs and entropies) and an audit store.

Targets (issue 54): plugin >= 0.95x plain throughput at 16 and 64 concurrent, p50 latency
<= 1.05x. Printed per concurrency: every repeat's req/s, the medians and their ratio.

    OMP_NUM_THREADS=1 python benchmarks/bench_vllm_plugin.py --concurrency 16,64 \\
        --requests 256 --repeats 3 --out runs/bench-vllm-plugin.json
    # GPU (issue 54 item 6): an 8B-shaped folder (benchmarks/llama_8b_shaped.py), random
    # weights, vLLM's compiled model with piecewise CUDA graphs (full ones are refused):
    python benchmarks/llama_8b_shaped.py /tmp/llama-8b-shaped
    python benchmarks/bench_vllm_plugin.py --model /tmp/llama-8b-shaped --dtype bfloat16 \
        --compiled --concurrency 16,64 --requests 256 --repeats 3 \
        --vllm-args "--load-format dummy -cc '{\"cudagraph_mode\": \"PIECEWISE\"}'"
    # smoke run (tiny settings): --model <tiny folder> --max-model-len 256 --concurrency 2 \
    #     --requests 4 --repeats 1 --max-tokens 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import free_port, make_detector, questions  # noqa: E402
from bench_vllm import SRC, http_load, stop_server, tree_peak_rss_mib, wait  # noqa: E402

PLUGIN = [
    "--worker-extension-cls", "actmap.capture.vllm_worker.ActmapWorker",
    "--middleware", "actmap.serve.vllm_plugin.ActmapMiddleware",
]  # fmt: skip


def command(args, folder: str, port: int, plugin: bool, audit: Path) -> list[str]:
    out = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", folder,
        "--served-model-name", "bench", "--dtype", args.dtype, "--port", str(port),
        "--max-num-seqs", str(max(args.concurrency)), "--max-model-len", str(args.max_model_len),
    ]  # fmt: skip
    if not args.compiled:
        out.append("--enforce-eager")
    out += shlex.split(args.vllm_args)
    if plugin:
        settings = {"actmap": {"detector": str(args.detector), "audit": str(audit),
                               **json.loads(args.plugin_settings)}}  # fmt: skip
        out += [*PLUGIN, "--additional-config", json.dumps(settings)]
    return out


def tree_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) spent so far by a server's processes, by process title
    (vLLM names its engine core ``VLLM::EngineCore``; the API server is the parent): which
    process the plugin's cost lands in, a figure other jobs on the machine barely move."""
    import psutil

    out: dict[str, float] = {}
    try:
        parent = psutil.Process(pid)
        for proc in [parent, *parent.children(recursive=True)]:
            try:
                title = "api-server" if proc.pid == pid else " ".join(proc.cmdline()[:1])
                times = proc.cpu_times()
                out[title] = out.get(title, 0.0) + times.user + times.system
            except psutil.NoSuchProcess:
                continue
    except psutil.NoSuchProcess:
        pass
    return out


def histogram(base: str, name: str) -> tuple[float, float]:
    """(sum, count) of a histogram on the server's ``/metrics`` (all its label sets)."""
    import httpx

    text = httpx.get(base + "/metrics", timeout=60).text
    got = {"sum": 0.0, "count": 0.0}
    for line in text.splitlines():
        for key in got:
            if line.startswith(f"{name}_{key}"):
                got[key] += float(line.split()[-1])
    return got["sum"], got["count"]


def mean_since(base: str, name: str, before: tuple[float, float]) -> float:
    (s1, c1), (s0, c0) = histogram(base, name), before
    return round((s1 - s0) / max(c1 - c0, 1), 4)


# vLLM's tokens per engine step (prompt + generated): with closed-loop clients, a server that
# holds answers longer keeps fewer requests in the engine, so each step computes fewer tokens
# for the same weights read (a decode step's cost is mostly the weights): a cost that shows up
# in the worker although it is not actmap's code
STEP_TOKENS = "vllm:iteration_tokens_total"
ROWS_WAIT = "actmap_vllm_rows_wait_seconds"


def one_server(args, folder: str, prompts: list[str], plugin: bool) -> list[dict]:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": SRC}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    rows = []
    with tempfile.TemporaryDirectory() as tmp, open(Path(tmp) / "server.log", "w") as log:
        # vLLM logs a lot: a pipe nobody reads would fill up and stop the server
        process = subprocess.Popen(
            command(args, folder, port, plugin, Path(tmp) / "audit"),
            env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            wait(process, base, "/health", log=Path(tmp) / "server.log")
            asyncio.run(http_load(base, "bench", prompts[:2], 1, args.max_tokens))  # warm-up
            for width in args.concurrency:
                n = max(args.requests, width)
                batch = (prompts * (n // len(prompts) + 1))[:n]
                for _ in range(args.warmup_passes):  # untimed: the same load first
                    asyncio.run(http_load(base, "bench", batch, width, args.max_tokens))
                before = tree_cpu_s(process.pid)
                waited, stepped = histogram(base, ROWS_WAIT), histogram(base, STEP_TOKENS)
                result = asyncio.run(http_load(base, "bench", batch, width, args.max_tokens))
                result["tokens_per_step"] = mean_since(base, STEP_TOKENS, stepped)
                if plugin:  # mean wait of an answer for its rows (push, or RPC)
                    result["rows_wait_mean_s"] = mean_since(base, ROWS_WAIT, waited)
                spent = {name: round(1e3 * (s - before.get(name, 0.0)) / n, 2)
                         for name, s in tree_cpu_s(process.pid).items()}  # fmt: skip
                rows.append({"mode": "plugin" if plugin else "plain", "concurrency": width,
                             "load": os.getloadavg()[0], **result,
                             "cpu_ms_per_request": spent})  # fmt: skip
            peak = tree_peak_rss_mib(process.pid)
            for row in rows:
                row["peak_rss_mib"] = round(peak, 1) if peak else None
        finally:
            stop_server(process)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--detector", type=Path, default=None)
    parser.add_argument("--concurrency", default="16,64")
    parser.add_argument("--requests", type=int, default=256, help="requests per concurrency")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3, help="alternated server pairs")
    parser.add_argument(
        "--warmup-passes", type=int, default=0,
        help="untimed passes of the same load before each timed one: bfloat16 on this CPU "
        "builds a oneDNN kernel per new matrix shape (each step's token count), seconds each",
    )  # fmt: skip
    parser.add_argument("--compiled", action="store_true", help="no --enforce-eager")
    parser.add_argument(
        "--vllm-args", default="", help='more flags for both servers, e.g. "--load-format dummy"'
    )
    parser.add_argument(
        "--plugin-settings", default="{}",
        help='more plugin settings as JSON, e.g. \'{"push": false}\' (rows by RPC only)',
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=None, help="write the rows as JSON")
    args = parser.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(f"load at start: {os.getloadavg()}  OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}")
    tmp = Path(tempfile.mkdtemp(prefix="bench-vllm-plugin-"))
    if args.detector is None:
        args.detector = make_detector(tmp / "run")
    from actmap.capture.vllm_engine import vllm_model_folder

    folder, _ = vllm_model_folder(args.model)
    prompts = questions(max(args.requests, 64))
    rows = []
    for _ in range(args.repeats):
        for plugin in (False, True):
            rows += one_server(args, folder, prompts, plugin)
    print("c    plain req/s (repeats)        plugin req/s (repeats)       ratio  p50 ratio")
    summary = []
    for width in args.concurrency:
        got = {m: [r for r in rows if r["mode"] == m and r["concurrency"] == width]
               for m in ("plain", "plugin")}  # fmt: skip
        rate = {m: float(np.median([r["req_per_s"] for r in got[m]])) for m in got}
        p50 = {m: float(np.median([r["p50_s"] for r in got[m]])) for m in got}
        ratio, p50_ratio = rate["plugin"] / rate["plain"], p50["plugin"] / p50["plain"]
        summary.append({"concurrency": width, "plain_req_per_s": rate["plain"],
                        "plugin_req_per_s": rate["plugin"], "ratio": round(ratio, 3),
                        "p50_ratio": round(p50_ratio, 3)})  # fmt: skip
        print(f"{width:<4} {rate['plain']:>7.2f} {[r['req_per_s'] for r in got['plain']]!s:<22}"
              f"{rate['plugin']:>7.2f} {[r['req_per_s'] for r in got['plugin']]!s:<22}"
              f"{ratio:>6.3f} {p50_ratio:>6.3f}")  # fmt: skip
    print("CPU ms per request by process (median over repeats):")
    for width in args.concurrency:
        for mode in ("plain", "plugin"):
            got = [r["cpu_ms_per_request"] for r in rows
                   if r["mode"] == mode and r["concurrency"] == width]  # fmt: skip
            names = sorted({k for g in got for k in g})
            cells = [f"{k} {np.median([g.get(k, 0.0) for g in got]):.1f}" for k in names]
            print(f"  {width:<4} {mode:<7} " + ", ".join(cells))
    for width in args.concurrency:
        waits = [r["rows_wait_mean_s"] for r in rows
                 if r["mode"] == "plugin" and r["concurrency"] == width]  # fmt: skip
        print(f"  {width:<4} plugin: an answer's mean wait for its rows {waits} s")
    for width in args.concurrency:
        steps = {m: [r["tokens_per_step"] for r in rows
                     if r["mode"] == m and r["concurrency"] == width]
                 for m in ("plain", "plugin")}  # fmt: skip
        print(f"  {width:<4} tokens per engine step: plain {steps['plain']}, "
              f"plugin {steps['plugin']}")  # fmt: skip
    errors = [e for r in rows for e in r["errors"]]
    if errors:
        print("errors:", errors[:3])
    print(f"load at end: {os.getloadavg()}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"rows": rows, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
