"""Faults a deployed server meets, against real `actmap serve` processes on loopback.

Clients that leave mid-stream or while queued, a full queue, a slow reader, SIGTERM and
SIGKILL under load, and a proxy whose upstream dies mid-request and comes back. Every server
is the CLI in its own process (`fault_servers.ServeProcess`: SIGTERM and SIGKILL hit it as they
hit a deployment) over the tiny random-weight Llama; clients are the official ``openai``
client, httpx and raw sockets. Each case checks that no answer a client completed is missing
from the audit store, that the server still answers afterwards, and that its log holds no
ERROR line, traceback or "Future exception was never retrieved". `--engine vllm` is vLLM's
own server with the actmap plugin: a client that leaves is vLLM's abort there
(tests/test_vllm_plugin.py, `test_an_answer_the_client_abandons_writes_no_partial_map`).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import pytest
from fault_servers import MODEL_NAME, ServeProcess, free_port, rss_bytes, tiny_model_folder
from prometheus_client.parser import text_string_to_metric_families
from serve_helpers import save_tiny_detector
from typer.testing import CliRunner

from actmap.cli import app as cli
from actmap.serve.audit import open_audit_store, read_audit

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

LONG = 150  # answer tokens of a request that keeps the generator busy (~1-2 s here)
BAD_LOG = ("ERROR", "Traceback", "never retrieved")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    save_tiny_detector(root / "run")
    return SimpleNamespace(root=root, model=tiny_model_folder(root), run=root / "run")


def serve(tiny, name: str, *extra: str, detector: bool = True, port=None) -> ServeProcess:
    args = ["--model", str(tiny.model), "--served-model-name", MODEL_NAME,
            "--max-tokens", "8", "--max-tokens-cap", "250", "--batch-window-ms", "0", *extra]  # fmt: skip
    if detector:
        args += ["--detector", str(tiny.run)]
    return ServeProcess(args, tiny.root / f"{name}.log", port=port)


def client(server: ServeProcess, **options) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{server.base}/v1", api_key="unused", max_retries=0, timeout=60, **options
    )


def ask(server: ServeProcess, max_tokens: int = 8, content: str = "the cat", **options):
    return client(server).chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": content}],
        max_tokens=max_tokens,
        **options,
    )


def metric(server: ServeProcess, name: str, **labels) -> float:
    """The sum of the /metrics samples ``name`` with ``labels`` (0 when none), parsed by
    prometheus_client's own parser."""
    text = httpx.get(f"{server.base}/metrics", timeout=10).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )


def eventually(check, limit_s: float = 15.0):
    deadline = time.monotonic() + limit_s
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.05)


def audit_ids(root) -> set[str]:
    return set(read_audit(open_audit_store(root))["id"])


def clean_log(server: ServeProcess) -> None:
    bad = [line for line in server.output().splitlines() if any(b in line for b in BAD_LOG)]
    assert not bad, "\n".join(bad)


def queue_depth(server: ServeProcess) -> int:
    return httpx.get(f"{server.base}/health", timeout=10).json()["queue"]


def stream_until_content(server: ServeProcess, max_tokens: int = LONG):
    """An openai stream that has received its first text (its request is generating); a
    running score at every token keeps the generator busy longer."""
    stream = ask(server, max_tokens, stream=True, extra_body={"actmap": {"stream_scores": True}})
    chunks = iter(stream)
    for chunk in chunks:
        if chunk.choices and chunk.choices[0].delta.content:
            return stream, chunks
    raise AssertionError("the stream ended before any text")


def finish(chunks) -> dict:
    """Read a stream to its end; its final actmap block."""
    last = None
    for chunk in chunks:
        if getattr(chunk, "actmap", None):
            last = chunk.actmap
    assert last is not None and last["map_id"], "the stream ended without its actmap block"
    return last


@pytest.fixture(scope="module")
def plain(tiny):
    """One generation at a time (batch 1) and two waiting (queue 2): queueing is easy to make."""
    server = serve(tiny, "plain", "--batch-size", "1", "--queue-size", "2",
                   "--audit", str(tiny.root / "plain-audit"), "--audit-sync")  # fmt: skip
    yield server
    server.stop()
    clean_log(server)


def test_disconnects_mid_stream_and_while_queued_are_counted_not_errors(plain, tiny):
    before = audit_ids(tiny.root / "plain-audit")
    running, running_chunks = stream_until_content(plain, 250)  # generating (~2.5 s)
    queued = ask(plain, LONG, stream=True)  # headers and the role chunk: accepted, waiting
    assert eventually(lambda: queue_depth(plain) == 1)
    queued.close()  # leaves while queued
    with pytest.raises(openai.APITimeoutError):  # a plain request's client gives up while queued
        client(plain).with_options(timeout=0.3).chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "a dog"}], max_tokens=4
        )
    for _ in range(3):
        next(running_chunks)
    running.close()  # leaves mid-stream
    assert eventually(
        lambda: metric(plain, "actmap_client_disconnects_total", endpoint="chat") == 3
    )
    assert eventually(
        lambda: (
            metric(plain, "actmap_aborted_answers_total", endpoint="chat", stage="generating") == 1
        )
    )
    assert eventually(
        lambda: metric(plain, "actmap_aborted_answers_total", endpoint="chat", stage="queued") == 2
    )
    answer = ask(plain)  # the server still answers
    # the three dropped answers left no row; the completed one has its row (committed before sent)
    assert audit_ids(tiny.root / "plain-audit") - before == {answer.actmap["map_id"]}
    clean_log(plain)


def test_full_queue_answers_429_with_retry_after(plain, tiny):
    running, running_chunks = stream_until_content(plain, 200)
    waiting = [ask(plain, 40, stream=True) for _ in range(2)]  # the queue (2) is full
    assert eventually(lambda: queue_depth(plain) == 2)
    with pytest.raises(openai.RateLimitError) as refused:
        ask(plain)
    assert refused.value.status_code == 429
    assert refused.value.response.headers["retry-after"] == "1"
    assert refused.value.body["code"] == "queue_full"
    assert metric(plain, "actmap_rejected_busy_total") == 1
    # the openai client retries a 429 after its Retry-After: a refused request gets through
    retrying = client(plain).with_options(max_retries=5)
    with ThreadPoolExecutor(1) as pool:
        later = pool.submit(
            retrying.chat.completions.create,
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "a dog"}],
            max_tokens=4,
        )
        assert eventually(lambda: metric(plain, "actmap_rejected_busy_total") == 2)
        blocks = [finish(running_chunks), *(finish(iter(s)) for s in waiting)]
        retried = later.result(timeout=60)
    completed = {b["map_id"] for b in blocks} | {retried.actmap["map_id"]}
    assert completed <= audit_ids(tiny.root / "plain-audit")
    clean_log(plain)


def raw_stream(server: ServeProcess, max_tokens: int) -> socket.socket:
    """A streaming request on a socket with a small receive buffer that nobody reads yet."""
    body = json.dumps({"model": MODEL_NAME, "stream": True, "max_tokens": max_tokens,
                       "messages": [{"role": "user", "content": "the cat"}],
                       "actmap": {"stream_scores": True}}).encode()  # fmt: skip
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    sock.connect(("127.0.0.1", server.port))
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
            f"application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n")  # fmt: skip
    sock.sendall(head.encode() + body)
    return sock


def read_events(sock: socket.socket) -> list[str]:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    sock.close()
    return [line[6:] for line in data.decode().splitlines() if line.startswith("data: ")]


def test_slow_readers_do_not_hold_the_server_or_grow_its_memory(plain, tiny):
    """Three clients that read nothing while their 200-token streams are produced (with a
    running score in every chunk): the generator goes on, other requests are answered, the
    server's memory stays put (each stream holds at most its answer's events plus the
    transport's 64 KiB write buffer), and each slow reader gets its whole answer later."""
    rss = rss_bytes(plain.pid)
    slow = [raw_stream(plain, 200) for _ in range(3)]
    assert eventually(lambda: queue_depth(plain) == 0, 60)  # all three generated, unread
    answer = ask(plain)  # answered meanwhile
    grown = rss_bytes(plain.pid) - rss
    assert grown < 16 * 2**20, f"server RSS grew {grown / 2**20:.1f} MiB"
    ids = {answer.actmap["map_id"]}
    for sock in slow:
        events = read_events(sock)
        assert events[-1] == "[DONE]"
        final = json.loads(events[-2])["actmap"]
        running = [json.loads(e)["actmap"] for e in events[1:-2] if "actmap" in e]
        assert len(running) == 200 and final["map_id"]  # a running score for every token
        ids.add(final["map_id"])
    assert ids <= audit_ids(tiny.root / "plain-audit")
    clean_log(plain)


def store_cli(*args: str):
    return CliRunner().invoke(cli, ["store", *args])


def test_sigterm_turns_unready_then_drains_in_flight_requests(tiny):
    """SIGTERM with six streams in flight: /ready answers 503 at once, the streams all finish
    (zero failed), the process exits within grace + drain, and the audit store holds every
    answer; a restarted server answers on the same store."""
    audit = tiny.root / "sigterm-audit"
    grace, drain = 1.0, 20.0
    server = serve(tiny, "sigterm", "--batch-size", "2", "--queue-size", "8", "--audit",
                   str(audit), "--shutdown-grace", str(grace), "--drain-timeout", str(drain))  # fmt: skip
    streams = [ask(server, 200, content=f"the cat {i}", stream=True) for i in range(6)]
    with ThreadPoolExecutor(6) as pool:
        finished = [pool.submit(finish, iter(s)) for s in streams]
        assert eventually(lambda: queue_depth(server) >= 1)  # two generating, some waiting
        stopped_at = time.monotonic()
        server.process.terminate()  # SIGTERM
        ready = eventually(
            lambda: httpx.get(f"{server.base}/ready", timeout=5).status_code == 503, 0.5
        )
        assert ready and not all(f.done() for f in finished)  # unready while still serving
        blocks = [f.result(timeout=drain + 10) for f in finished]  # zero failed in flight
    server.process.join(grace + drain + 10)
    took = time.monotonic() - stopped_at
    assert server.process.exitcode == 0 and took < grace + drain + 5
    ids = {b["map_id"] for b in blocks}
    assert len(ids) == 6 and ids <= audit_ids(audit)
    assert store_cli("verify", str(audit)).exit_code == 0
    clean_log(server)
    again = serve(tiny, "sigterm-again", "--audit", str(audit))
    answer = ask(again)
    assert again.stop() == 0
    assert audit_ids(audit) == ids | {answer.actmap["map_id"]}
    clean_log(again)


def test_sigkill_under_load_loses_no_completed_answer(tiny):
    """SIGKILL while eight clients keep asking (--audit-sync): `store verify`, `store repair`,
    and every answer a client received is in the store; at most the requests in flight at the
    kill are lost (their rows may or may not have been committed); a restarted server answers."""
    audit = tiny.root / "sigkill-audit"
    server = serve(tiny, "sigkill", "--batch-size", "4", "--queue-size", "16",
                   "--audit", str(audit), "--audit-sync")  # fmt: skip
    completed, failed, killed = [], [], threading.Event()

    def keep_asking(i: int) -> None:
        k = 0
        while not killed.is_set():
            k += 1
            try:
                completed.append(ask(server, 4 + (i * 7 + k) % 40).actmap["map_id"])
            except (openai.APIConnectionError, openai.APIStatusError):
                failed.append(i)
                return

    threads = [threading.Thread(target=keep_asking, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    assert eventually(lambda: len(completed) >= 12, 60)
    server.process.kill()  # SIGKILL: no shutdown, no final flush
    killed.set()
    for t in threads:
        t.join(60)
    server.process.join()
    assert failed and len(failed) <= 8  # the requests in flight at the kill, at most one each
    verified = store_cli("verify", str(audit))
    if verified.exit_code != 0:  # a flush cut mid-write: repair sets it aside
        assert "damaged" in verified.output, verified.output
        assert store_cli("repair", str(audit)).exit_code == 0
        assert store_cli("verify", str(audit)).exit_code == 0
    stored = audit_ids(audit)
    assert set(completed) <= stored  # zero completed answers lost
    assert len(stored - set(completed)) <= len(failed)  # rows of answers the kill cut off
    again = serve(tiny, "sigkill-again", "--audit", str(audit))
    answer = ask(again)
    assert again.stop() == 0
    assert audit_ids(audit) == stored | {answer.actmap["map_id"]}
    clean_log(server)
    clean_log(again)


def test_proxy_upstream_killed_mid_request_then_back(tiny):
    """The proxy's upstream dies with requests in flight: those get 502, so do requests while it
    is down; once it is back the proxy answers again. A client leaving a proxied stream is
    counted. The audit store holds exactly the completed answers."""
    port = free_port()
    upstream = serve(tiny, "upstream", "--batch-size", "1", detector=False, port=port)
    audit = tiny.root / "proxy-audit"
    proxy = serve(tiny, "proxy", "--upstream", f"{upstream.base}/v1", "--audit", str(audit),
                  "--upstream-timeout", "30")  # fmt: skip
    completed = {ask(proxy).actmap["map_id"]}
    stream = ask(proxy, LONG, stream=True)
    next(iter(stream))
    stream.close()  # the client leaves a proxied stream
    assert eventually(
        lambda: metric(proxy, "actmap_client_disconnects_total", endpoint="chat") == 1
    )

    def status(max_tokens: int) -> int:
        try:
            ask(proxy, max_tokens)
            return 200
        except openai.APIStatusError as error:
            return error.status_code

    with ThreadPoolExecutor(3) as pool:
        in_flight = [pool.submit(status, LONG) for _ in range(3)]
        assert eventually(lambda: queue_depth(upstream) >= 1)
        upstream.process.kill()
        assert [f.result(timeout=60) for f in in_flight] == [502] * 3
    upstream.process.join()
    assert status(4) == 502  # down: connection refused
    assert metric(proxy, "actmap_upstream_failures_total") >= 4
    back = serve(tiny, "upstream-back", "--batch-size", "1", detector=False, port=port)
    completed.add(ask(proxy).actmap["map_id"])
    completed.add(finish(iter(ask(proxy, 6, stream=True)))["map_id"])
    assert proxy.stop() == 0 and back.stop() == 0
    assert audit_ids(audit) == completed
    clean_log(proxy)
    clean_log(back)


def test_audit_sync_commits_at_once_and_says_when(tmp_path):
    """`AuditTrail.append` returns the moment its rows are committed; with ``sync`` the writer
    commits as soon as anything is buffered, without it only at the flush interval."""
    from test_serve_audit import entries

    from actmap.serve.audit import AuditTrail

    synced = AuditTrail(tmp_path / "sync", flush_interval_s=60, sync=True)
    committed = synced.append(entries(0))
    assert committed.result(timeout=10) == 8  # long before the 60 s interval
    assert len(read_audit(open_audit_store(tmp_path / "sync"))) == 8
    synced.close()
    buffered = AuditTrail(tmp_path / "buffered", flush_interval_s=60)
    pending = buffered.append(entries(1))
    time.sleep(0.5)
    assert not pending.done()  # buffered until the interval, 64 rows or close
    buffered.close()
    assert pending.result(timeout=0) == 8
