"""Soak test of `actmap serve`: hours of load with clients that leave, and a SIGTERM restart.

For each engine (``--engines local,vllm``) it starts ``actmap serve`` with an audit store on
loopback and keeps ``--concurrency`` clients busy for ``--minutes``: chat requests, half of
them streamed, a ``--disconnect`` share of the streams dropped by their client after a few
chunks. Halfway it restarts the server with SIGTERM the way a deployment does: the load
generator polls ``GET /ready`` as a load balancer would and stops sending when it turns 503;
the requests in flight must finish; a new server takes over the same port and audit store.
At the end it prints, each beside its target:

- requests served, and errors: unexplained ones (target 0) apart from the dropped streams
  and any connection refused between the old server closing and the new one listening;
- the server's RSS after warm-up and at the end of each server's life (growth < 5%);
- audit rows against completed answers: every answer a client completed has its row
  (missing = 0), and the extra rows are exactly the dropped streams whose answer was scored
  before the client left (streams dropped minus the server's
  ``actmap_aborted_answers_total``: a dropped stream is either aborted, with no row, or was
  scored first; a client that closes after the server sent everything is no disconnect to
  the server, so ``actmap_client_disconnects_total`` can be lower than the drops).

Not CI: the full run takes ``--minutes`` per engine (30 by default; the vLLM engine needs
vLLM and a model it serves)::

    python benchmarks/soak.py --minutes 30 --concurrency 16 --engines local,vllm \\
        --model smollm2-135m-instruct

    python benchmarks/soak.py --tiny --minutes 1 --engines local   # the smoke run

``--tiny`` serves the test suite's random-weight tiny Llama (seconds to start, answers are
noise) and a logistic-regression detector fitted on random maps. Prints one JSON report.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import free_port, make_detector, questions  # noqa: E402
from fault_servers import rss_bytes, tiny_model_folder, wait_ready  # noqa: E402

RSS_GROWTH_TARGET = 0.05
WORDS = ["the cat", "a dog runs", "one two three", "the red house", "four and five"]


class Server:
    """``actmap serve`` as a user starts it (a subprocess), with its output in a log file."""

    def __init__(self, args, engine: str, port: int, audit: Path, log: Path) -> None:
        command = [
            sys.executable, "-m", "actmap.cli", "serve", "--engine", engine,
            "--model", args.model, "--served-model-name", "soak", "--detector", str(args.detector),
            "--port", str(port), "--audit", str(audit), "--max-tokens", str(args.max_tokens),
            "--max-tokens-cap", str(args.max_tokens), "--batch-size", str(args.concurrency),
            "--queue-size", str(4 * args.concurrency), "--shutdown-grace", "2",
            "--drain-timeout", "60",
        ]  # fmt: skip
        if args.audit_sync:
            command.append("--audit-sync")
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
        self.log = log
        with open(log, "ab") as out:
            self.process = subprocess.Popen(command, env=env, stdout=out, stderr=out)
        self.base = f"http://127.0.0.1:{port}"

    def wait_ready(self, limit_s: float = 900) -> None:
        alive = lambda: self.process.poll() is None  # noqa: E731
        wait_ready(self.base, alive, self.log.read_text, self.process.kill, limit_s)

    def counters(self) -> dict[str, float]:
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"{self.base}/metrics", timeout=10).text
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    out[sample.name] = out.get(sample.name, 0.0) + sample.value
        return out


class Load:
    """The clients, and what they saw."""

    def __init__(self, args, base: str, prompts: list[str]) -> None:
        self.args, self.base, self.prompts = args, base, prompts
        self.open = asyncio.Event()  # set while the server is ready (the load balancer's view)
        self.open.set()
        self.completed: list[str] = []  # map ids of answers a client read to the end
        self.dropped = 0  # streams their client left on purpose
        self.refused = 0  # connections refused while the server restarted (explained)
        self.errors: list[str] = []  # everything else (target: none)
        self.restarting = False
        self.finished = False  # the clients stop
        self.rng = random.Random(args.seed)

    async def one(self, http: httpx.AsyncClient) -> None:
        stream = self.rng.random() < 0.5
        leave_after = self.rng.randint(1, 4) if stream and self.rng.random() < self.args.disconnect else None  # fmt: skip
        body = {
            "model": "soak",
            "messages": [{"role": "user", "content": self.rng.choice(self.prompts)}],
            "max_tokens": self.rng.randint(4, self.args.max_tokens),
            "stream": stream,
        }
        url = f"{self.base}/v1/chat/completions"
        try:
            if not stream:
                response = await http.post(url, json=body)
                if response.status_code != 200:
                    self.errors.append(f"{response.status_code}: {response.text[:200]}")
                    return
                self.completed.append(response.json()["actmap"]["map_id"])
                return
            async with http.stream("POST", url, json=body) as response:
                if response.status_code != 200:
                    self.errors.append(f"{response.status_code}: {(await response.aread())[:200]}")
                    return
                chunks, final, done = 0, None, False
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        done = True
                        break
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        self.errors.append(f"stream error: {chunk['error']}")
                        return
                    final = chunk.get("actmap") or final
                    chunks += 1
                    if leave_after is not None and chunks > leave_after and not self.restarting:
                        self.dropped += 1  # leaving the block closes the connection
                        return
                if not done or not final or not final.get("map_id"):
                    self.errors.append("a stream ended without its actmap block and [DONE]")
                    return
                self.completed.append(final["map_id"])
        except httpx.ConnectError as error:
            if self.restarting:
                self.refused += 1
            else:
                self.errors.append(repr(error))
        except httpx.HTTPError as error:
            self.errors.append(repr(error))

    async def client(self, http: httpx.AsyncClient) -> None:
        while not self.finished:
            await self.open.wait()
            if not self.finished:
                await self.one(http)

    async def watch_ready(self) -> None:
        """Poll /ready as a load balancer does: stop sending while it is not 200."""
        async with httpx.AsyncClient(timeout=2) as http:
            while True:
                try:
                    ready = (await http.get(f"{self.base}/ready")).status_code == 200
                except httpx.TransportError:
                    ready = False
                if ready:
                    self.open.set()
                else:
                    self.open.clear()
                await asyncio.sleep(0.25)


def life_report(server: Server, rss: list[tuple[float, int]], warm_at: float) -> dict:
    warm = next((b for t, b in rss if t >= warm_at), rss[-1][1])
    end = rss[-1][1]
    counters = server.counters()
    return {
        "rss_after_warmup_mib": round(warm / 2**20, 1),
        "rss_end_mib": round(end / 2**20, 1),
        "rss_growth": round(end / warm - 1, 4),
        "client_disconnects": counters.get("actmap_client_disconnects_total", 0.0),
        "aborted_answers": counters.get("actmap_aborted_answers_total", 0.0),
    }


async def soak_engine(args, engine: str, work: Path) -> dict:
    port, audit, log = free_port(), work / f"audit-{engine}", work / f"{engine}.log"
    load = Load(args, f"http://127.0.0.1:{port}", WORDS if args.tiny else questions(64))
    server = Server(args, engine, port, audit, log)
    await asyncio.to_thread(server.wait_ready)
    lives = []
    async with httpx.AsyncClient(timeout=600) as http:
        watcher = asyncio.create_task(load.watch_ready())
        clients = [asyncio.create_task(load.client(http)) for _ in range(args.concurrency)]
        for life in range(2):  # half the time each, with a SIGTERM restart between
            started, rss = time.monotonic(), []
            until = started + args.minutes * 30
            while time.monotonic() < until:
                rss.append((time.monotonic(), rss_bytes(server.process.pid)))
                await asyncio.sleep(1)
            load.restarting = True  # no client leaves from now on: the counters are final
            await asyncio.sleep(0.5)
            report = life_report(server, rss, started + args.warmup * (until - started))
            server.process.send_signal(signal.SIGTERM)  # the clients stop once /ready says so
            stopped = time.monotonic()
            if life == 1:
                load.finished = True
                await asyncio.gather(*clients)
            report["exit_code"] = await asyncio.to_thread(server.process.wait)
            report["sigterm_to_exit_s"] = round(time.monotonic() - stopped, 2)
            lives.append(report)
            if life == 0:
                server = Server(args, engine, port, audit, log)
                await asyncio.to_thread(server.wait_ready)
                load.restarting = False
        watcher.cancel()
    from actmap.serve.audit import open_audit_store, read_audit

    rows = set(read_audit(open_audit_store(audit))["id"])
    completed = set(load.completed)
    # a dropped stream either was aborted by the server (no row) or its answer was scored
    # first (a row): cut short after scoring, or wholly sent before the client closed
    aborted = sum(life["aborted_answers"] for life in lives)
    log_errors = [
        line
        for line in log.read_text().splitlines()
        if any(bad in line for bad in ("ERROR", "Traceback", "never retrieved"))
    ]
    return {
        "engine": engine,
        "requests_served": len(load.completed),
        "streams_dropped_by_client": load.dropped,
        "refused_while_restarting": load.refused,
        "unexplained_errors": len(load.errors),
        "error_examples": load.errors[:5],
        "error_log_lines": log_errors[:5],
        "lives": lives,
        "audit_rows": len(rows),
        "completed_answers": len(completed),
        "completed_missing_from_audit": len(completed - rows),
        "extra_audit_rows": len(rows - completed),
        "extra_rows_explained": int(load.dropped - aborted),  # dropped streams, scored first
    }


def verdicts(result: dict) -> list[str]:
    lines = [f"[{result['engine']}] requests served {result['requests_served']}"]
    errors = result["unexplained_errors"] + len(result["error_log_lines"])
    lines.append(f"  unexplained errors {errors} (target 0; ERROR log lines included)")
    for i, life in enumerate(result["lives"]):
        lines.append(
            f"  server {i + 1}: RSS {life['rss_after_warmup_mib']} MiB after warm-up -> "
            f"{life['rss_end_mib']} MiB at the end, growth {life['rss_growth']:+.2%} "
            f"(target < {RSS_GROWTH_TARGET:.0%}); SIGTERM to exit {life['sigterm_to_exit_s']} s"
        )
    lines.append(
        f"  audit rows {result['audit_rows']} = completed answers {result['completed_answers']} "
        f"+ dropped streams scored first {result['extra_rows_explained']} (target: equal; "
        f"completed answers missing from the audit store {result['completed_missing_from_audit']}"
        ", target 0)"
    )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="per engine")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--engines", default="local", help="comma-separated: local,vllm")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--detector", type=Path, default=None, help="default: a random logreg")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--disconnect", type=float, default=0.3, help="share of streams dropped")
    parser.add_argument("--warmup", type=float, default=0.2, help="share of each server's life")
    parser.add_argument("--tiny", action="store_true", help="the tests' random tiny Llama")
    parser.add_argument("--audit-sync", action="store_true", help="serve with --audit-sync")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="write the JSON report here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="actmap-soak-") as tmp:
        work = Path(tmp)
        if args.tiny:
            args.model = str(tiny_model_folder(work))
        if args.detector is None:
            args.detector = make_detector(work / "run")
        results = [
            asyncio.run(soak_engine(args, engine, work)) for engine in args.engines.split(",")
        ]
    report = {"settings": {k: str(v) for k, v in vars(args).items()}, "results": results}
    text = json.dumps(report, indent=2)
    if args.out:
        args.out.write_text(text)
    print(text)
    for result in results:
        print("\n".join(verdicts(result)))


if __name__ == "__main__":
    main()
