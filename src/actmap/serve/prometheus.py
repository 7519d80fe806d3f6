"""Prometheus metrics of the server, in a registry of its own (one per app)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128)
SCORE_BUCKETS = tuple(i / 10 for i in range(1, 11))


class ServeMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "actmap_requests", "Answered requests", ["endpoint", "status"], registry=r
        )
        self.rejected = Counter("actmap_rejected_busy", "Requests refused: queue full", registry=r)
        # a client that leaves is normal: counted here, never logged as an error
        self.client_disconnects = Counter(
            "actmap_client_disconnects",
            "Streaming clients that left before their answer was fully sent",
            ["endpoint"],
            registry=r,
        )
        self.aborted = Counter(
            "actmap_aborted_answers",
            "Answers dropped unanswered because their request was cancelled (client gone, "
            "timeout): stage queued = never generated, generating = cut short; no audit row",
            ["endpoint", "stage"],
            registry=r,
        )
        self.tokens = Counter("actmap_tokens", "Tokens processed", ["kind"], registry=r)
        self.latency = Histogram(
            "actmap_request_latency_seconds",
            "Request latency, arrival to answer",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.generation = Histogram(
            "actmap_batch_generation_seconds",
            "Generation with capture, per batch",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.scoring = Histogram(
            "actmap_batch_scoring_seconds",
            "Maps + detector + policy, per batch",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2),
            registry=r,
        )
        self.batch_size = Histogram(
            "actmap_batch_size",
            "Requests per generation call",
            buckets=(1, 2, 4, 8, 16, 32, 64),
            registry=r,
        )
        self.forced = Histogram(
            "actmap_batch_forced_seconds",
            "Teacher-forced passes reading existing answers (proxy, /v1/actmap/score), per batch",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.forced_size = Histogram(
            "actmap_batch_forced_size",
            "Answers per batch of teacher-forced passes",
            buckets=(1, 2, 4, 8, 16, 32, 64),
            registry=r,
        )
        self.decisions = Counter("actmap_decisions", "Decisions", ["decision"], registry=r)
        self.scores = Histogram(
            "actmap_p_correct", "p(correct) of answers", buckets=SCORE_BUCKETS, registry=r
        )
        self.queue_depth = Gauge("actmap_queue_depth", "Requests waiting", registry=r)

    def on_drop(self, endpoint: str):
        """A job's ``on_drop`` (`actmap.serve.engine.Droppable`): counts it as aborted."""
        return lambda stage: self.aborted.labels(endpoint, stage).inc()

    async def watch_stream(self, events: AsyncIterator[str], endpoint: str) -> AsyncIterator[str]:
        """A response stream's events, counting a client that leaves before the end (the server
        cancels the stream, or closes it at a send: a normal event, not an error)."""
        try:
            async for event in events:
                yield event
        except (asyncio.CancelledError, GeneratorExit):
            self.client_disconnects.labels(endpoint).inc()
            raise
        finally:
            await events.aclose()  # its own clean-up now (cancel the job, close the upstream)

    def add_shift_gauges(self) -> None:
        """Gauges of the shift monitor (``actmap serve --monitor``), set by `observe_shift`."""
        r = self.registry
        self.shift_p = Gauge(
            "actmap_shift_window_p_value", "p-value of the latest window test", registry=r
        )
        self.shift_alarm = Gauge(
            "actmap_shift_alarm", "1 when the latest window test alarmed, else 0", registry=r
        )
        self.shift_windows = Gauge("actmap_shift_windows_tested", "Window tests run", registry=r)
        self.shift_alarms = Gauge(
            "actmap_shift_window_alarms", "Window tests that alarmed", registry=r
        )
        self.shift_maps = Gauge("actmap_shift_maps_seen", "Maps the monitor scored", registry=r)
        self.shift_flagged = Gauge(
            "actmap_shift_maps_flagged", "Maps flagged out of domain one by one", registry=r
        )

    def observe_shift(self, state: dict) -> None:
        """Copy the monitor's `StreamingMonitor.state()` into the gauges."""
        p = state["window_p_value"]
        self.shift_p.set(float("nan") if p is None else p)
        self.shift_alarm.set(int(state["alarm"]))
        self.shift_windows.set(state["windows_tested"])
        self.shift_alarms.set(state["window_alarms"])
        self.shift_maps.set(state["maps_seen"])
        self.shift_flagged.set(state["maps_flagged"])

    def observe_forced(self, timings) -> None:
        """A batch of `actmap.serve.answers.score_answers` (its pass is ``generation_s``)."""
        self.forced.observe(timings.generation_s)
        self.scoring.observe(timings.scoring_s)
        self.forced_size.observe(timings.size)

    def observe_batch(self, timings) -> None:
        self.generation.observe(timings.generation_s)
        self.scoring.observe(timings.scoring_s)
        self.batch_size.observe(timings.size)

    def observe_answer(self, endpoint: str, answer, seconds: float) -> None:
        self.requests.labels(endpoint, "200").inc()
        self.latency.labels(endpoint).observe(seconds)
        self.tokens.labels("prompt").inc(answer.prompt_tokens)
        self.tokens.labels("completion").inc(answer.n_tokens)
        self.decisions.labels(answer.decision).inc()
        if answer.p_correct is not None:
            self.scores.observe(answer.p_correct)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
