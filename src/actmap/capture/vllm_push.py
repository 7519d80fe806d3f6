"""Finished answers' rows pushed from vLLM's worker to the API servers, beside vLLM's RPC.

``collective_rpc("actmap_take")`` reaches a worker through vLLM's engine core, which handles
it only between two steps: the middleware waits up to a whole step for rows that are already
there (measured at 64 concurrent requests on SmolLM2, one thread: .49 s median, .87 s mean per
answer, about a tenth of its latency), and a client waiting longer sends its next request
later. So the recording worker (global rank 0) also publishes every finished request's
`actmap.capture.vllm_rows.payload` on a ZeroMQ PUB socket of its own (`RowPublisher`, an
``ipc://`` path) the moment it retires the request; each API-server process subscribes
(`RowSubscriber`) and keeps the rows of the requests it serves in flight. The RPC stays the
way back for a row the socket did not bring (a subscriber on another host, a full queue, a
request whose rows came before its middleware knew it): `actmap.serve.vllm_plugin` waits
``wait_s`` for pushed rows and then takes the rest by RPC. Rows that came by the socket are
dropped from the worker with one ``actmap_forget`` RPC per batch, off the answer's path.

Messages are msgpack (``msgspec``: bytes stay bytes), never pickle. Nothing here imports vLLM.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import tempfile
import uuid
from collections.abc import Callable

import msgspec
import zmq
import zmq.asyncio

log = logging.getLogger(__name__)

HIGH_WATER = 4096  # messages queued per subscriber before the publisher drops (RPC then)


class RowPublisher:
    """The worker's end: one PUB socket on an ``ipc://`` path of this host."""

    def __init__(self, directory: str | None = None) -> None:
        name = f"actmap-rows-{uuid.uuid4().hex}"
        path = os.path.join(directory or tempfile.gettempdir(), name)
        if len(path) > zmq.IPC_PATH_MAX_LEN:  # a socket's path is short (107 bytes on Linux)
            path = os.path.join("/tmp", name)
        self.address = f"ipc://{path}"
        self.host = socket.gethostname()
        self._socket = zmq.Context.instance().socket(zmq.PUB)
        self._socket.setsockopt(zmq.SNDHWM, HIGH_WATER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(self.address)
        self._path = path
        self.sent = self.dropped = 0

    def send(self, item: dict) -> None:
        """Publish one payload; never blocks (a full queue drops it: the RPC still has it)."""
        try:
            self._socket.send(msgspec.msgpack.encode(item), zmq.NOBLOCK)
            self.sent += 1
        except zmq.Again:
            self.dropped += 1

    def close(self) -> None:
        self._socket.close(0)
        if os.path.exists(self._path):
            os.unlink(self._path)


class RowSubscriber:
    """An API server's end: keeps the pushed rows of the requests registered with `expect`.

    ``match(req_id, base)``: the choice index ``req_id`` answers for the request named after
    ``base``, or None (`actmap.capture.vllm_rows.child_index`)."""

    def __init__(self, address: str, match: Callable[[str, str], int | None]) -> None:
        self.match = match
        self._socket = zmq.asyncio.Context.instance().socket(zmq.SUB)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._socket.setsockopt(zmq.RCVHWM, HIGH_WATER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(address)
        self._rows: dict[str, list[dict]] = {}  # base -> rows pushed so far
        self._waiting: dict[str, tuple[int, asyncio.Future]] = {}  # base -> (count, future)
        self._task = asyncio.create_task(self._listen())

    def expect(self, base: str) -> None:
        """Keep the rows of requests named after ``base`` from now on (before vLLM sees it)."""
        self._rows.setdefault(base, [])

    def release(self, base: str) -> list[dict]:
        """Stop keeping them (the request ended, scored or not); the rows never taken."""
        waiting = self._waiting.pop(base, None)
        if waiting is not None and not waiting[1].done():
            waiting[1].cancel()
        return self._rows.pop(base, None) or []

    async def take(self, base: str, count: int, wait_s: float) -> list[dict]:
        """The rows pushed for ``base``, once ``count`` have come or after ``wait_s``; taken."""
        rows = self._rows.get(base)
        if rows is not None and len(rows) < count and wait_s > 0:
            future = asyncio.get_running_loop().create_future()
            self._waiting[base] = (count, future)
            try:
                await asyncio.wait({future}, timeout=wait_s)  # no error on a timeout
            finally:
                self._waiting.pop(base, None)
        got = self._rows.get(base) or []
        if base in self._rows:
            self._rows[base] = []
        return got

    async def _listen(self) -> None:
        while True:
            try:
                data = await self._socket.recv()
                item = msgspec.msgpack.decode(data)
            except asyncio.CancelledError:
                raise
            except Exception as error:  # a malformed message must not stop the listener
                log.warning("actmap: a pushed row could not be read: %s", error)
                continue
            for base, rows in self._rows.items():
                index = self.match(item["req_id"], base)
                if index is None:
                    continue
                rows.append({**item, "index": index, "base": base})
                waiting = self._waiting.get(base)
                if waiting is not None and len(rows) >= waiting[0] and not waiting[1].done():
                    waiting[1].set_result(None)
                break

    async def close(self) -> None:
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass
        self._socket.close(0)


def same_host(host: str | None) -> bool:
    """An ``ipc://`` path is reachable only on the host that bound it."""
    return host is not None and host == socket.gethostname()
