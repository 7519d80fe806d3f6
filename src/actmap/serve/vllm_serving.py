"""`actmap serve --engine vllm`: vLLM's scheduler instead of the micro-batcher.

The server's API, validation, ``actmap`` block, policy, prior correction, audit trail,
shift monitor and streaming are those of `actmap.serve.app`; only what generates changes.
`VllmServeEngine` is an `actmap.serve.engine.Engine` (the same prompt rendering and the
same scoring of finished answers, `Engine.score`; the same running scores and stream emitter,
`Engine.running_scores` and `actmap.serve.engine.StreamEmitter`) whose generator is an in-process
`actmap.capture.vllm_engine.VllmCapture`. `StepLoop` takes the batcher's place: one thread
runs vLLM's engine step after step; a request submitted from the event loop is added to the
engine before the next step, so it joins the running batch (continuous batching) instead of
waiting for a batch to end. After every step it streams text deltas and running
p(correct) (the map of the answer so far, every ``score_every`` tokens), ends requests whose
running score falls below their ``abort_below`` (decision ``abstain_early``), aborts
requests whose client went away or timed out, and scores the answers that finished.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from actmap.capture.records import CaptureConfig, Generation
from actmap.capture.vllm_engine import VllmCapture, VllmOptions, enforce_eager_for
from actmap.errors import ActmapUserError
from actmap.serve.batcher import QueueFull
from actmap.serve.engine import BatchTimings, Engine, Job, StreamEmitter
from actmap.serve.loaded_run import refuse_what_vllm_cannot_read

log = logging.getLogger(__name__)


class VllmServeEngine(Engine):
    """Detector + policy over an in-process vLLM generator."""

    def __init__(self, capture, detector, **kwargs) -> None:
        super().__init__(None, capture.tokenizer, capture.source, detector, **kwargs)
        self.capture = capture

    def config_for(self, job: Job) -> CaptureConfig:
        # map-only when maps are all the detector reads; position states for a stacked run
        return CaptureConfig(
            max_new_tokens=job.max_tokens,
            stop_strings=job.stop,
            max_context=self.max_context,
            **self.detector.capture_settings(),
        )

    def make_batcher(self, max_queue: int, on_batch: Callable | None = None) -> StepLoop:
        return StepLoop(self, max_queue, on_batch)

    def run(self, jobs):  # the micro-batcher's entry point: not used with vLLM
        raise RuntimeError("the vLLM engine is driven by its StepLoop")


@dataclass(eq=False)
class _Live:
    job: Job
    key: str
    emitter: StreamEmitter | None  # None: the request does not stream


class StepLoop:
    """The batcher's interface (start, stop, submit, depth) over vLLM's step loop."""

    def __init__(self, engine: VllmServeEngine, max_queue: int, on_batch=None) -> None:
        self.engine, self.capture = engine, engine.capture
        self.max_queue, self.on_batch = max_queue, on_batch
        self._inbox: queue.Queue = queue.Queue()
        self._live: dict[str, _Live] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()

    @property
    def depth(self) -> int:
        """Requests accepted and not yet answered (queued or generating)."""
        return self._inbox.qsize() + len(self._live)

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="actmap-vllm", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._stopping.set()
        self._inbox.put(None)
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
        for live in list(self._live.values()):
            self._fail(live.job, RuntimeError("server shutting down"))
        while not self._inbox.empty():
            job = self._inbox.get_nowait()
            if job is not None:
                self._fail(job, RuntimeError("server shutting down"))

    def submit(self, job: Job) -> asyncio.Future:
        if self._loop is None:
            raise RuntimeError("the step loop is not started")
        if self.depth >= self.max_queue:
            raise QueueFull(f"{self.depth} requests are queued (limit {self.max_queue})")
        job.future = self._loop.create_future()
        self._inbox.put(job)
        return job.future

    # -- the generation thread -----------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                self._admit(block=not self.capture.busy)
                if not self.capture.busy:
                    continue
                self._step()
            except Exception as error:  # the running requests fail, the server goes on
                log.exception("a vLLM step failed")
                for key, live in list(self._live.items()):
                    self.capture.abort(key)
                    self._fail(live.job, error)
                self._live.clear()

    def _admit(self, block: bool) -> None:
        while True:
            try:
                job = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
            except queue.Empty:
                return
            block = False
            if job is None:  # stop() wakes us
                return
            if job.cancelled:
                self._discard(job, "queued")
                continue
            try:
                key = self.capture.submit(job.prompt, self.engine.config_for(job))
            except (ActmapUserError, ValueError) as error:
                self._fail(job, error)
                continue
            emitter = StreamEmitter(self.engine.tokenizer, job) if job.sink is not None else None
            self._live[key] = _Live(job, key, emitter)

    def _step(self) -> None:
        started = time.perf_counter()
        events = self.capture.step()
        finished: list[tuple[_Live, Generation, bool]] = []
        watched = []
        for event in events:
            live = self._live.get(event.key)
            if live is None:
                continue
            if event.finished is not None:
                finished.append((live, event.finished, False))
            elif live.job.watched:
                watched.append(live)
        for live in [v for v in self._live.values() if v.job.cancelled]:
            self.capture.abort(live.key)  # timeout or client gone: nobody reads the answer
            del self._live[live.key]
            self._discard(live.job, "generating")
        finished += self._watch([w for w in watched if w.key in self._live])
        generated = time.perf_counter()
        if finished:
            self._finish(finished, started, generated)

    def _watch(self, lives: list[_Live]) -> list[tuple[_Live, Generation, bool]]:
        """Stream deltas and running scores; end requests below their ``abort_below`` (the
        running scorer and the emitter are the transformers engine's: `Engine.prefix_scores`,
        `actmap.serve.engine.StreamEmitter`)."""
        engine = self.engine
        scored = []
        for live in lives:
            request = self.capture.in_flight(live.key)
            t = len(request.token_ids)
            if request.token_ids and request.token_ids[-1] in self.capture.ends:
                continue  # the end token: the finished answer is scored next
            if engine.wants_running_score(live.job, t):
                scored.append((live, request, t))
        running = {}
        if scored:
            p = engine.prefix_scores([(r.states, r.logprobs, r.entropies, t) for _, r, t in scored])
            running = {live.key: v for (live, _, _), v in zip(scored, p, strict=True)}
        ended = []
        for live in lives:
            p = running.get(live.key)
            request = self.capture.in_flight(live.key)
            if request is None:
                continue
            if live.emitter is not None:
                live.emitter.emit(request.token_ids, p, len(request.token_ids))
            if live.job.ends_below(p):
                ended.append((live, self.capture.cut(live.key), True))
        return ended

    def _finish(self, finished, started: float, generated: float) -> None:
        jobs = [live.job for live, _, _ in finished]
        for live, _, _ in finished:
            self._live.pop(live.key, None)
        try:
            answers = self.engine.score(
                jobs,
                [g for _, g, _ in finished],
                started,
                aborted=[aborted for _, _, aborted in finished],
            )
        except Exception as error:
            log.exception("scoring %d answers failed", len(jobs))
            for job in jobs:
                self._fail(job, error)
            return
        for job, answer in zip(jobs, answers, strict=True):
            # queued_s: from the request's arrival to its admission is not tracked per step
            self._resolve(job, answer)
        if self.on_batch is not None:
            timings = BatchTimings(len(jobs), generated - started, time.perf_counter() - generated)
            self._loop.call_soon_threadsafe(self.on_batch, jobs, timings)

    def _resolve(self, job: Job, answer) -> None:
        def done() -> None:
            if not job.future.done():
                job.future.set_result(answer)

        self._loop.call_soon_threadsafe(done)

    def _discard(self, job: Job, stage: str) -> None:
        """A cancelled job (client gone, timed out) is dropped: its future is cancelled, not
        failed, so no unread exception is left for asyncio to log as an error."""
        job.drop(stage)

        def done() -> None:
            if job.future is not None and not job.future.done():
                job.future.cancel()

        self._loop.call_soon_threadsafe(done)

    def _fail(self, job: Job, error: BaseException) -> None:
        def done() -> None:
            if job.future is not None and not job.future.done():
                job.future.set_exception(error)

        if self._loop is not None:
            self._loop.call_soon_threadsafe(done)


def build_vllm_engine(settings, detector, policy, audit, monitor, dtype: str) -> VllmServeEngine:
    """The generator of ``actmap serve --engine vllm`` (called by `actmap.serve.app.build_engine`)."""
    refuse_what_vllm_cannot_read(detector, "serve a deployable run, or use --engine local")
    capture = VllmCapture(
        settings.model,
        dtype,
        VllmOptions(
            max_num_seqs=settings.max_batch, enforce_eager=enforce_eager_for(settings.vllm.compile)
        ),
        greybox=detector.needs_scalars,
        max_context=settings.max_context,  # None: the model's own limit
    )
    if "attention" in detector.requires:
        try:
            capture.keep_attention()  # refused by name for a model it cannot read
        except ActmapUserError as error:
            capture.close()
            raise ActmapUserError(f"{error}; or serve a deployable run") from None
    return VllmServeEngine(
        capture,
        detector,
        policy=policy,
        max_context=capture.max_context,
        score_every=settings.score_every,
        audit=audit,
        monitor=monitor,
    )
