"""One batch of requests -> answers with p(correct) and a decision, in one generation pass.

`Engine.run` is what the server's micro-batcher calls off the event loop: the
prompts of a batch go through `actmap.capture.generate_batch` together; each
answer's trajectory becomes a map (`actmap.maps`), rounded to the store's
float16 form, scored by the detector (with the answer's six per-answer scalars
when the detector reads them, `actmap.capture.answer_scalars`: the capture then keeps
the grey-box statistics, else it is map-only), shifted to the deployment
prevalence and decided by the policy (`actmap.serve.policy`). While generating, a step watch
streams text and running scores to requests that asked for them and ends rows
whose running score falls below their ``abort_below``.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from actmap.capture.answer_scalars import answer_scalars, scalars_of_generations
from actmap.capture.generate import generate_batch, stop_ids
from actmap.capture.records import CaptureConfig, Generation
from actmap.capture.stopping import stop_position
from actmap.llm.models import ModelSource
from actmap.maps import MapConfig, build_maps, build_maps_from_list, stored_form
from actmap.monitor.stream import MapShift, StreamingMonitor
from actmap.scoring.prior import em_prevalence
from actmap.serve.loaded_run import LoadedDetector, answer_maps
from actmap.serve.policy import (
    Policy,
    PriorSetting,
    calibrate,
    correct_prior,
    decide,
    policy_version,
)

log = logging.getLogger(__name__)


class Droppable:
    """A queued job the server may cancel (``cancelled``; timeout, client gone): `drop` tells
    ``on_drop`` once, from the worker thread, that it was dropped unanswered, with the stage it
    reached: "queued" (never run) or "generating" (cut short, or run but not yet scored)."""

    cancelled: bool
    on_drop: Callable[[str], None] | None

    def drop(self, stage: str) -> None:
        on_drop, self.on_drop = self.on_drop, None
        if on_drop is not None:
            on_drop(stage)


@dataclass(eq=False)
class Job(Droppable):
    """One request as the generation thread sees it."""

    prompt: str  # fully rendered (chat template applied)
    prompt_tokens: int
    max_tokens: int
    stop: tuple[str, ...] = ()
    stream_scores: bool = False
    abort_below: float | None = None
    # streamed events {"text", "n_tokens", "p_correct"}; called from the generation thread
    sink: Callable[[dict], None] | None = None
    prompt_for_audit: str = ""  # the request's prompt text (hashed; kept only when asked)
    endpoint: str = ""
    cancelled: bool = False  # set by the server on timeout or client disconnect
    enqueued_at: float = field(default_factory=time.perf_counter)
    future: object = None  # the asyncio future the batcher resolves with the Answer
    on_drop: Callable[[str], None] | None = None  # see `Droppable`; a dropped job gets no audit row

    @property
    def key(self) -> tuple:
        """Jobs with equal keys can share one generation call."""
        return (self.max_tokens, self.stop)

    @property
    def watched(self) -> bool:
        return self.sink is not None or self.stream_scores or self.abort_below is not None

    def ends_below(self, p: float | None) -> bool:
        """Whether running score ``p`` ends this request (``abort_below``; abstain_early)."""
        return p is not None and self.abort_below is not None and p < self.abort_below


@dataclass(frozen=True)
class Answer:
    text: str
    n_tokens: int
    prompt_tokens: int
    finish_reason: str  # "stop" | "length"
    p_correct_raw: float | None  # None for an empty answer (no map exists)
    p_correct: float | None
    decision: str
    prevalence: float | None  # the prevalence p_correct was shifted to (None: raw or known)
    map_id: str | None
    map: np.ndarray | None  # (C, H, W) float16, the stored form
    queued_s: float = 0.0
    scalars: np.ndarray | None = None  # (6,) per-answer scalars, when the detector reads them
    shift: MapShift | None = None  # the shift monitor's view (None without a monitor)
    # resolved once the answer's audit row is committed (None: no row); see `AuditTrail.append`
    committed: Future | None = None
    detector: str | None = None  # the id of the detector that scored it (None: unscored)
    policy: str | None = None  # the version of the policy that decided (`policy_version`)


@dataclass(frozen=True)
class BatchTimings:
    size: int
    generation_s: float  # generate_batch: generation with capture hooks
    scoring_s: float  # maps + detector + prior + policy


class PrevalenceTracker:
    """The EM prevalence estimate over the most recent calibrated scores (``prior.method = em``)."""

    def __init__(self, setting: PriorSetting) -> None:
        self.setting = setting
        self.window: deque[float] = deque(maxlen=setting.em_window)
        self.prevalence: float | None = None
        self._lock = threading.Lock()

    def update(self, raw: Sequence[float]) -> float | None:
        if self.setting.method != "em":
            return None
        with self._lock:
            self.window.extend(calibrate(raw, self.setting).tolist())
            if len(self.window) >= self.setting.em_min_scores:
                estimate = em_prevalence(
                    np.fromiter(self.window, float), self.setting.train_prevalence
                )
                self.prevalence = estimate.prevalence
            return self.prevalence


class StreamEmitter:
    """The text deltas of one streamed answer, as the transformers step watch sends them: the
    tokens so far are decoded, cut at a stop string, and what may be the start of a stop string
    or of a multi-byte character is held back; each call sends the new text (and the running
    score, with ``stream_scores``) to the job's sink."""

    def __init__(self, tokenizer, job: Job) -> None:
        self.tokenizer, self.job = tokenizer, job
        self.sent = ""
        self.holdback = max((len(s) for s in job.stop), default=1) - 1

    def emit(self, tokens: list[int], p: float | None, t: int) -> None:
        job = self.job
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        cut = stop_position(text, job.stop, skip_leading_whitespace=True) if job.stop else None
        if cut is not None:
            visible = text[:cut]
        else:  # hold back what may be the start of a stop string or of a multi-byte character
            visible = text[: len(text) - self.holdback] if self.holdback else text
            visible = visible.rstrip("\ufffd")
        delta = visible[len(self.sent) :] if visible.startswith(self.sent) else ""
        self.sent += delta
        if delta or (p is not None and job.stream_scores):
            job.sink({"text": delta, "n_tokens": t, "p_correct": p if job.stream_scores else None})


class _StepWatch:
    """The ``on_step`` callback of one batch: streams deltas and running scores, ends rows."""

    def __init__(self, engine: Engine, jobs: list[Job]) -> None:
        self.engine, self.jobs = engine, jobs
        self.ends = stop_ids(engine.model, engine.tokenizer)
        self.length: list[int | None] = [None] * len(jobs)  # answer tokens when a row ended
        self.aborted = [False] * len(jobs)
        self.emitters = [StreamEmitter(engine.tokenizer, job) for job in jobs]
        self.scalars = engine.detector is not None and engine.detector.needs_scalars

    def __call__(self, recorder, generated: torch.Tensor) -> torch.Tensor:
        t = generated.shape[1]  # tokens so far; trajectory rows 0..t-1 are filled
        last = generated[:, -1].tolist()
        end = torch.zeros(len(self.jobs), dtype=torch.bool)
        live = []
        for i, job in enumerate(self.jobs):
            if self.length[i] is not None:
                continue
            if last[i] in self.ends:
                self.length[i] = t - 1
            elif job.cancelled:
                self.length[i] = t
                end[i] = True
            else:
                live.append(i)
        scored = [i for i in live if self.engine.wants_running_score(self.jobs[i], t)]
        running = {}
        if scored:
            maps = build_maps(recorder.pooled[scored, :, :t], [t] * len(scored), self.engine.map_config)  # fmt: skip
            scalars = prefix_scalars(recorder, generated, scored) if self.scalars else None
            running = dict(zip(scored, self.engine.running_scores(maps, scalars), strict=True))
        for i in live:
            p = running.get(i)
            if self.jobs[i].ends_below(p):
                self.length[i], self.aborted[i] = t, True
                end[i] = True
            if self.jobs[i].sink is not None:
                self.emitters[i].emit(generated[i].tolist(), p, t)
        return end

    def trim(self, i: int, generation: Generation) -> Generation:
        """An aborted or cancelled row ends where it was stopped (later steps are padding)."""
        n = self.length[i]
        if n is None or self.ends_naturally(i):
            return generation
        n = min(n, generation.n_tokens)
        ids = generation.token_ids[:n]
        return replace(
            generation,
            token_ids=ids,
            answer=self.engine.tokenizer.decode(ids, skip_special_tokens=True),
            logprobs=None if generation.logprobs is None else generation.logprobs[:n],
            entropies=None if generation.entropies is None else generation.entropies[:n],
            trajectory=generation.trajectory[:, :n],
            stopped=True,
        )

    def ends_naturally(self, i: int) -> bool:
        return not self.aborted[i] and not self.jobs[i].cancelled


def prefix_scalars(recorder, generated: torch.Tensor, rows: Sequence[int]) -> np.ndarray:
    """(len(rows), 6) per-answer scalars of the tokens generated so far by ``rows``."""
    logprobs, entropies = recorder.statistics_so_far(list(rows), generated[list(rows), -1])
    if logprobs.shape[1] != generated.shape[1]:
        raise RuntimeError(f"{logprobs.shape[1]} steps recorded for {generated.shape[1]} tokens")
    pairs = zip(logprobs.double().cpu(), entropies.double().cpu(), strict=True)
    return np.stack([answer_scalars(lp, h) for lp, h in pairs])


class Engine:
    """Generator + detector + policy; `run` is called from one worker thread at a time."""

    def __init__(
        self,
        model,
        tokenizer,
        source: ModelSource,
        detector: LoadedDetector | None,  # None: a plain generator, answers go unscored
        policy: Policy = Policy(),
        max_context: int = 2048,
        score_every: int = 1,
        audit=None,
        layers_path: str | None = None,
        monitor: StreamingMonitor | None = None,
    ) -> None:
        self.model, self.tokenizer, self.source = model, tokenizer, source
        self.monitor = monitor
        self.detector = detector
        self.map_config = detector.map_config if detector is not None else MapConfig()
        self.policy = policy
        self.policy_version = policy_version(policy)
        # held by every batch from capture to decision, and by `swap`: a batch is scored,
        # decided and audited by one detector and one policy
        self.swap_lock = threading.RLock()
        self.max_context = max_context
        self.score_every = max(1, score_every)
        self.audit = audit
        self.layers_path = layers_path
        self.prevalence = PrevalenceTracker(policy.prior)
        # one forward pass on the model at a time: generation and teacher-forced scoring
        # (`actmap.serve.answers`) run in different worker threads and install hooks
        self.lock = threading.Lock()
        self._tokenizers = threading.local()

    @property
    def thread_tokenizer(self):
        """This thread's own copy of the tokenizer, for encoding. A fast tokenizer sets
        padding and truncation on its one backend before each encode, so a request encoded
        on the event loop while a worker thread pads a batch could strip that batch's
        padding; each thread encoding with its own copy keeps the two apart. (Reading the
        tokenizer's attributes, decoding and chat templates use ``tokenizer``.)"""
        copy_ = getattr(self._tokenizers, "tokenizer", None)
        if copy_ is None:
            copy_ = self._tokenizers.tokenizer = copy.deepcopy(self.tokenizer)
        return copy_

    def encode(self, text: str, add_special_tokens: bool | None = None) -> list[int]:
        """Token ids of ``text`` (special tokens added where there is no chat template: templated
        text carries its own)."""
        if add_special_tokens is None:
            add_special_tokens = not getattr(self.tokenizer, "chat_template", None)
        return self.thread_tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]

    # -- prompts ---------------------------------------------------------------------------
    def render_chat(self, messages: list[dict]) -> str:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(
                "this model's tokenizer has no chat template; use /v1/completions with a prompt"
            )
        return self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )

    def count_tokens(self, prompt: str) -> int:
        return len(self.encode(prompt))

    # -- swapping the detector and policy -------------------------------------------------
    def swap(self, detector: LoadedDetector, policy: Policy) -> None:
        """Score and decide with ``detector`` and ``policy`` from the next batch on (the batch
        running now finishes with the old pair). The new detector must read the same map
        and the same capture as the old: another kind needs a restart."""
        self.check_swap(detector)
        with self.swap_lock:
            self.detector, self.policy = detector, policy
            self.policy_version = policy_version(policy)
            self.prevalence = PrevalenceTracker(policy.prior)

    def check_swap(self, detector: LoadedDetector) -> None:
        """Raise ValueError unless ``detector`` may replace the served one (`swap`)."""
        if self.detector is None:
            raise ValueError("this server has no detector to replace (a plain generator)")
        if detector.map_config != self.map_config:
            raise ValueError(
                f"{detector.id} reads maps of another config ({detector.map_config}) than the "
                f"served {self.detector.id} ({self.map_config}): restart the server to change it"
            )
        if detector.capture_settings() != self.detector.capture_settings():
            raise ValueError(
                f"{detector.id} reads other inputs ({', '.join(detector.requires)}) than the "
                f"served {self.detector.id} ({', '.join(self.detector.requires)}): restart the "
                "server to change them"
            )

    # -- running scores (both engines' step loops) ----------------------------------------
    def wants_running_score(self, job: Job, t: int) -> bool:
        """Whether ``job`` gets a running score after its ``t``-th token: it streams scores or
        may end early, and ``t`` is a multiple of ``score_every`` (or its last token). A
        detector of whole answers (positions, attention) gives none."""
        return (
            self.detector is not None
            and not self.detector.needs_generations
            and (job.stream_scores or job.abort_below is not None)
            and (t % self.score_every == 0 or t == job.max_tokens)
        )

    def running_scores(self, maps: np.ndarray, scalars: np.ndarray | None) -> list[float]:
        """Prior-corrected p(correct) of answers so far: their maps (rounded to the stored form
        here) and, when the detector reads them, their scalars so far."""
        raw = self.detector.predict_proba(stored_form(maps), scalars)
        return correct_prior(raw, self.policy.prior, self.prevalence.prevalence).tolist()

    def prefix_scores(self, rows: Sequence[tuple[torch.Tensor, Any, Any, int]]) -> list[float]:
        """`running_scores` of answers so far, each given as (its layer states, log-probs and
        entropies as recorded, the t tokens to read; the statistics may be None when the
        detector reads no scalars): the running scorer of the vLLM plugin
        (`actmap.serve.vllm_plugin`), whose rows arrive one by one."""
        with self.swap_lock:
            maps = build_maps_from_list(
                [states[:, :t] for states, _, _, t in rows], self.map_config
            )
            scalars = None
            if self.detector.needs_scalars:
                scalars = np.stack(
                    [answer_scalars(lp[:t], h[:t].double().numpy()) for _, lp, h, t in rows]
                )
            return self.running_scores(maps, scalars)

    # -- one batch -------------------------------------------------------------------------
    def run(self, jobs: list[Job]) -> tuple[list[Answer], BatchTimings]:
        with self.swap_lock:
            return self._run(jobs)

    def _run(self, jobs: list[Job]) -> tuple[list[Answer], BatchTimings]:
        started = time.perf_counter()
        config = CaptureConfig(
            max_new_tokens=jobs[0].max_tokens,
            stop_strings=jobs[0].stop,
            max_context=self.max_context,
            batch_size=len(jobs),
            # map-only capture when maps are all the detector reads
            **(
                self.detector.capture_settings()
                if self.detector is not None
                else {"greybox": False}
            ),
        )
        watch = _StepWatch(self, jobs) if any(j.watched for j in jobs) else None
        with self.lock:
            generations = generate_batch(
                self.model,
                self.thread_tokenizer,
                [j.prompt for j in jobs],
                config,
                self.layers_path,
                on_step=watch,
            )
        if watch is not None:
            generations = [watch.trim(i, g) for i, g in enumerate(generations)]
        generated = time.perf_counter()
        answers = self._score(jobs, generations, started, None if watch is None else watch.aborted)
        timings = BatchTimings(len(jobs), generated - started, time.perf_counter() - generated)
        return answers, timings

    def score(
        self,
        jobs,
        generations: list[Generation],
        started: float,
        aborted: list[bool] | None = None,
    ) -> list[Answer]:
        """Answers of captured ``generations`` (one per job): detector, prior, policy, audit;
        ``aborted[i]``: row i was ended by its running score (decision abstain_early)."""
        with self.swap_lock:
            return self._score(jobs, generations, started, aborted)

    def _score(self, jobs, generations, started, aborted=None) -> list[Answer]:
        if self.detector is None:  # a plain generator (e.g. the upstream of a proxy)
            return [_unscored(job, g, started) for job, g in zip(jobs, generations, strict=True)]
        scored = [i for i, g in enumerate(generations) if g.n_tokens > 0]
        raw = np.full(len(jobs), np.nan)
        maps = scalars = None
        if scored:
            maps = answer_maps([generations[i].trajectory for i in scored], self.map_config)
            if self.detector.needs_scalars:
                scalars = scalars_of_generations([generations[i] for i in scored])
            gens = [generations[i] for i in scored] if self.detector.needs_generations else None
            raw[scored] = self.detector.predict_proba(maps, scalars, gens)
        shifts = self.monitor.observe(maps) if self.monitor is not None and scored else None
        prevalence = self.prevalence.update(raw[scored])
        corrected = np.full(len(jobs), np.nan)  # an empty answer has no score to correct
        if scored:
            corrected[scored] = correct_prior(raw[scored], self.policy.prior, prevalence)
        answers, records = [], []
        map_index = {row: k for k, row in enumerate(scored)}
        for i, (job, g) in enumerate(zip(jobs, generations, strict=True)):
            ended_early = aborted is not None and aborted[i]
            has_map = i in map_index
            dropped = job.cancelled  # nobody reads this answer (client gone, timed out)
            if dropped:
                job.drop("generating")
            if ended_early:
                decision = "abstain_early"
            elif has_map:
                decision = decide(float(corrected[i]), self.policy)
            else:
                decision = "abstain"  # an empty answer has no map to score
            audited = has_map and self.audit is not None and not dropped  # no row when dropped
            map_id = uuid.uuid4().hex if audited else None
            answer = Answer(
                text=g.answer,
                n_tokens=g.n_tokens,
                prompt_tokens=g.prompt_tokens,
                finish_reason="stop" if g.stopped else "length",
                p_correct_raw=float(raw[i]) if has_map else None,
                p_correct=float(corrected[i]) if has_map else None,
                decision=decision,
                prevalence=prevalence if self.policy.prior.method == "em" else None,
                map_id=map_id,
                map=maps[map_index[i]] if has_map else None,
                queued_s=started - job.enqueued_at,
                scalars=scalars[map_index[i]] if has_map and scalars is not None else None,
                shift=shifts[map_index[i]] if shifts is not None and has_map else None,
                detector=self.detector.id,
                policy=self.policy_version,
            )
            answers.append(answer)
            if map_id is not None:
                records.append((job, answer))
        if records:
            committed = self.audit.append([self.audit.entry(j, a, self.source) for j, a in records])
            answers = [replace(a, committed=committed) if a.map_id else a for a in answers]
        return answers


def _unscored(job: Job, generation: Generation, started: float) -> Answer:
    return Answer(
        text=generation.answer,
        n_tokens=generation.n_tokens,
        prompt_tokens=generation.prompt_tokens,
        finish_reason="stop" if generation.stopped else "length",
        p_correct_raw=None,
        p_correct=None,
        decision="unscored",
        prevalence=None,
        map_id=None,
        map=None,
        queued_s=started - job.enqueued_at,
    )
