"""Micro-batching: concurrent requests share one generation call, run off the event loop.

Requests wait in a bounded queue (`QueueFull` when it is full; the server answers
429 with ``Retry-After``). One worker takes the oldest request, then gathers more for at most
``window_s`` (none when the queue already holds enough) up to ``max_batch``, and
runs the batch in a single worker thread, so the event loop keeps accepting and
streaming while the model generates. Requests whose settings differ (max_tokens,
stop strings: one ``generate`` call has one of each) wait for a later batch.
A request cancelled while queued (timeout, disconnect) is skipped (`Droppable.drop`).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from actmap.errors import ActmapUserError

log = logging.getLogger(__name__)


class QueueFull(RuntimeError):
    """The request queue is full."""


def _dropped(job) -> bool:
    """A job cancelled while queued (timeout, client gone) is skipped, and says so."""
    if job.cancelled:
        job.drop("queued")
    return job.cancelled


class MicroBatcher:
    """``run_batch(jobs) -> (results, info)`` called with lists of jobs of equal ``key``."""

    def __init__(
        self,
        run_batch: Callable[[list[Any]], tuple[list[Any], Any]],
        max_batch: int = 16,
        window_s: float = 0.01,
        max_queue: int = 256,
        on_batch: Callable[[list[Any], Any], None] | None = None,
    ) -> None:
        if max_batch < 1 or max_queue < 1 or window_s < 0:
            raise ActmapUserError("need max_batch >= 1, max_queue >= 1 and window_s >= 0")
        self.run_batch = run_batch
        self.max_batch, self.window_s, self.max_queue = max_batch, window_s, max_queue
        self.on_batch = on_batch
        self._queue: asyncio.Queue | None = None
        self._held: deque = deque()  # taken from the queue but waiting for a matching batch
        self._task: asyncio.Task | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="actmap-generate")

    @property
    def depth(self) -> int:
        return (self._queue.qsize() if self._queue else 0) + len(self._held)

    async def start(self) -> None:
        self._queue = asyncio.Queue(self.max_queue)
        self._task = asyncio.create_task(self._loop(), name="actmap-batcher")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        for job in [*self._held, *self._drain()]:
            if not job.future.done():
                job.future.set_exception(RuntimeError("server shutting down"))
        self._executor.shutdown(wait=True)

    def _drain(self) -> list:
        out = []
        while self._queue is not None and not self._queue.empty():
            out.append(self._queue.get_nowait())
        return out

    def submit(self, job) -> asyncio.Future:
        """Queue ``job`` (sets ``job.future``); raises `QueueFull`."""
        if self._queue is None:
            raise RuntimeError("the batcher is not started")
        if self.depth >= self.max_queue:
            raise QueueFull(f"{self.depth} requests are queued (limit {self.max_queue})")
        job.future = asyncio.get_running_loop().create_future()
        self._queue.put_nowait(job)
        return job.future

    async def _next(self, timeout: float | None):
        if timeout is None:
            return await self._queue.get()
        if not self._queue.empty():
            return self._queue.get_nowait()
        if timeout <= 0:
            return None
        try:
            return await asyncio.wait_for(self._queue.get(), timeout)
        except TimeoutError:
            return None

    async def _gather(self) -> list:
        first = self._held.popleft() if self._held else await self._next(None)
        while _dropped(first):
            first = self._held.popleft() if self._held else await self._next(None)
        batch = [first]
        for job in list(self._held):  # held jobs first: they are older
            if _dropped(job):
                self._held.remove(job)
            elif len(batch) < self.max_batch and job.key == first.key:
                batch.append(job)
                self._held.remove(job)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.window_s
        while len(batch) < self.max_batch:
            job = await self._next(deadline - loop.time())
            if job is None:
                break
            if _dropped(job):
                continue
            (batch if job.key == first.key else self._held).append(job)
        return batch

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = await self._gather()
            try:
                results, info = await loop.run_in_executor(self._executor, self.run_batch, batch)
            except Exception as error:  # the batch fails, the server goes on
                log.exception("a batch of %d requests failed", len(batch))
                for job in batch:
                    if not job.future.done():
                        job.future.set_exception(error)
                continue
            for job, result in zip(batch, results, strict=True):
                if not job.future.done():
                    job.future.set_result(result)
            if self.on_batch is not None:
                self.on_batch(batch, info)
