"""Where the vLLM plugin's time goes: py-spy samples of vLLM's processes under chat load.

Starts one vLLM server with the plugin (`bench_vllm_plugin.command`: the same flags, a logreg
on random maps, an audit store), sends ``--requests`` greedy chat requests at ``--concurrency``
and samples the API server, the engine core and the worker with py-spy (``pip install
py-spy``; not a dependency of actmap) while they run, then prints, per process, the share of
samples inside each actmap function (inclusive) and the top leaf frames.

    OMP_NUM_THREADS=1 python benchmarks/profile_vllm_plugin.py --concurrency 16 --requests 96

``--plain`` profiles vLLM's server without the plugin (same flags), ``--native`` adds C/C++
frames (py-spy pauses the process to unwind them): run both ways and compare the worker's top
leaves to see which native work the plugin adds.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_vllm_plugin import (  # noqa: E402
    SRC,
    command,
    free_port,
    http_load,
    make_detector,
    questions,
    stop_server,
    wait,
)


def shares(path: Path, top: int, requests: int) -> None:
    total, inside, leaves = 0, collections.Counter(), collections.Counter()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        n = int(count)
        total += n
        frames = stack.split(";")
        for name in {f.split(" (")[0] for f in frames if "actmap" in f}:
            inside[name] += n
        leaves[frames[-1][:100]] += n
    # py-spy skips idle threads by default: at 50 Hz a sample is about 20 ms of CPU
    print(f"== {path.stem}: {total} samples, {total / requests:.2f} per request")
    for name, n in inside.most_common(top):
        print(f"  {100 * n / total:5.1f}%  {name}")
    print("  top leaves:")
    for name, n in leaves.most_common(top):
        print(f"  {100 * n / total:5.1f}%  {name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--seconds", type=int, default=60, help="py-spy's longest recording")
    parser.add_argument("--py-spy", default=shutil.which("py-spy") or "py-spy")
    parser.add_argument("--out", type=Path, default=Path(tempfile.mkdtemp(prefix="profile-")))
    parser.add_argument("--plain", action="store_true", help="vLLM's server without the plugin")
    parser.add_argument("--native", action="store_true", help="C/C++ frames too (py-spy --native)")
    parser.add_argument("--top", type=int, default=12, help="leaves and actmap frames printed")
    args = parser.parse_args()
    import psutil

    from actmap.capture.vllm_engine import vllm_model_folder

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    settings = argparse.Namespace(
        dtype=args.dtype, concurrency=[args.concurrency], max_model_len=2048, compiled=False,
        vllm_args="", plugin_settings="{}", detector=make_detector(args.out / "run"),
    )  # fmt: skip
    folder, _ = vllm_model_folder(args.model)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": SRC}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    log = args.out / "server.log"
    with open(log, "w") as sink:
        server = subprocess.Popen(command(settings, folder, port, not args.plain, args.out / "audit"),
                                  env=env, stdout=sink, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        wait(server, base, "/health", log=log)
        prompts = questions(args.requests)
        asyncio.run(http_load(base, "bench", prompts[:2], 1, args.max_tokens))  # warm-up
        kids = {c.cmdline()[0]: c.pid for c in psutil.Process(server.pid).children(True)}
        targets = {"api-server": server.pid, "engine-core": kids.get("VLLM::EngineCore"),
                   "worker": kids.get("VLLM::Worker")}  # fmt: skip
        spies = [
            subprocess.Popen([args.py_spy, "record", "-p", str(pid), "-r", "50", "-f", "raw",
                              "-o", str(args.out / f"{name}.txt"), "-d", str(args.seconds),
                              *(["--native"] if args.native else ["--nonblocking"])],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for name, pid in targets.items() if pid
        ]  # fmt: skip
        result = asyncio.run(http_load(base, "bench", prompts, args.concurrency, args.max_tokens))
        for spy in spies:
            spy.send_signal(2)
        for spy in spies:
            spy.wait()
        print(f"{result['req_per_s']} req/s at {args.concurrency}; load {os.getloadavg()}")
    finally:
        stop_server(server)
    for name in ("worker", "api-server", "engine-core"):
        if (args.out / f"{name}.txt").exists():
            shares(args.out / f"{name}.txt", args.top, args.requests)


if __name__ == "__main__":
    main()
