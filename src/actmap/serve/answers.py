"""Scoring answers that already exist: one teacher-forced pass each, then the server's scoring.

`score_answers` is what the scoring batcher calls off the event loop for
``POST /v1/actmap/score`` and for the proxy (`actmap.serve.proxy`): the
``prompt + answer`` pairs of a batch go through `capture_answers_batch` together
(one forward pass, no generation), which gives the same records generation-time
capture gives for the same tokens; `Engine.score` then builds the maps and
applies the detector, the prior correction, the policy and the audit trail
exactly as for a generated answer. An answer is text (tokenized on its own, as
``actmap capture --answers`` does) or the token ids the engine produced.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from actmap.capture.forced import ForcedPrefix, capture_answers_batch, forced_prefix
from actmap.capture.generate import _unpadded, shared_prefix_length, stop_ids, tokenize_prompts
from actmap.capture.records import CaptureConfig
from actmap.serve.engine import Answer, BatchTimings, Droppable, Engine


@dataclass(eq=False)
class ScoreJob(Droppable):
    """One existing answer to score, as the scoring thread sees it."""

    prompt: str  # fully rendered (chat template applied)
    answer: str | list[int]  # text, or the answer's token ids (end token not included)
    prompt_for_audit: str = ""  # the request's prompt text (hashed; kept only when asked)
    endpoint: str = "score"
    cancelled: bool = False
    enqueued_at: float = field(default_factory=time.perf_counter)
    future: object = None  # the asyncio future the batcher resolves with the Answer
    on_drop: Callable[[str], None] | None = None  # see `Droppable`

    key = ("teacher-forced",)  # every scoring job can share a pass


def answer_ids(engine: Engine, answer: str | Sequence[int]) -> list[int]:
    """The token ids the map is read over: text tokenized on its own, ids as given."""
    if isinstance(answer, str):
        return engine.encode(answer, add_special_tokens=False)
    return [int(t) for t in answer]


def strip_end_tokens(engine: Engine, ids: Sequence[int]) -> list[int]:
    """Token ids without trailing end-of-sequence tokens (engines count the stop token; capture
    keeps no row for it)."""
    ends = stop_ids(engine.model, engine.tokenizer)
    ids = list(ids)
    while ids and ids[-1] in ends:
        ids.pop()
    return ids


def chat_prefix(engine: Engine) -> ForcedPrefix | None:
    """The tokens every chat prompt of this template starts with (its system turn), run once:
    each teacher-forced pass then reads only the conversation's own tokens. None without a
    template or a shared start."""
    if not getattr(engine.tokenizer, "chat_template", None):
        return None
    ids = [
        engine.encode(engine.render_chat([{"role": "user", "content": text}]), False)
        for text in ("Which river is longest?", "2 + 2 =")
    ]
    n = next((i for i, (a, b) in enumerate(zip(*ids, strict=False)) if a != b), min(map(len, ids)))
    n -= 1  # the last shared token may merge with a message's first characters
    if n < 1:
        return None
    with engine.lock:
        return forced_prefix(engine.model, ids[0][:n])


class PrefixCache:
    """Key/value caches of the token prefixes prompts share, each computed once (the template's
    system turn, a system prompt, an instruction): a teacher-forced pass whose prompts all start
    with one reads only the rest, as vLLM's prefix caching spares generation.

    Seeded with ``base`` (`chat_prefix`). A new prefix is the longest run of tokens a batch's
    prompts share, with each other or with the previous batch's first prompt, when it is at
    least ``min_gain`` tokens longer than the longest cached prefix they start with; each row
    keeps one token of its own. At most ``capacity`` prefixes, least recently used out first.
    The rows a cached prefix gives equal a full pass's to float rounding (`forced_prefix`)."""

    def __init__(
        self, engine: Engine, base: ForcedPrefix | None = None, capacity: int = 8,
        min_gain: int = 8,
    ) -> None:  # fmt: skip
        self.engine, self.capacity, self.min_gain = engine, capacity, min_gain
        self.entries: OrderedDict[tuple[int, ...], ForcedPrefix] = OrderedDict()
        if base is not None:
            self.entries[tuple(base.ids.tolist())] = base
        self.previous: str | None = None  # the previous batch's first prompt
        self.built = 0  # prefixes computed (the seed not counted)
        self._lock = threading.Lock()

    def for_prompts(self, prompts: Sequence[str], config: CaptureConfig) -> ForcedPrefix | None:
        """The longest cached prefix every prompt starts with (computing a new one first where
        the prompts share a longer run), or None."""
        if config.attention_keys or config.keep_dense:
            return None  # attention entries and dense states index the whole sequence
        with self._lock:
            texts = [*prompts, *([self.previous] if self.previous else [])]
            encoded = tokenize_prompts(self.engine.thread_tokenizer, texts, config, "cpu")
            rows = [r.tolist() for r in _unpadded(encoded)[: len(prompts)]]
            best = self._longest_cached(rows)
            n = shared_prefix_length(encoded) if len(texts) > 1 else 0
            if n >= (0 if best is None else len(best.ids)) + self.min_gain:
                with self.engine.lock:
                    best = forced_prefix(self.engine.model, rows[0][:n])
                self.entries[tuple(rows[0][:n])] = best
                self.built += 1
                while len(self.entries) > self.capacity:
                    self.entries.popitem(last=False)
            if best is not None:
                self.entries.move_to_end(tuple(best.ids.tolist()))
            self.previous = prompts[0]
            return best

    def _longest_cached(self, rows: list[list[int]]) -> ForcedPrefix | None:
        fits = [
            (len(key), prefix)
            for key, prefix in self.entries.items()
            if all(len(r) > len(key) and tuple(r[: len(key)]) == key for r in rows)
        ]
        return max(fits, key=lambda pair: pair[0])[1] if fits else None


# What one more forward pass costs beyond its tokens, in tokens: a pass of one SmolLM2-135M
# answer (~70 tokens) took ~80 ms of CPU in bfloat16 where 16 answers took ~58 ms each
PASS_TOKENS = 32


def length_groups(
    lengths: Sequence[tuple[int, int]], pass_tokens: int = PASS_TOKENS
) -> list[list[int]]:
    """Split a batch into passes by length: ``lengths`` are each row's (prompt tokens the
    pass reads, answer tokens); a pass is [left-padded prompts | right-padded answers], so it
    costs rows x (longest prompt + longest answer) tokens plus ``pass_tokens``. Rows sorted
    by length, the cheapest cut into consecutive groups (dynamic programming) -> row indices
    of each pass; one group when splitting saves nothing."""
    order = sorted(range(len(lengths)), key=lambda i: (sum(lengths[i]), lengths[i]))
    n = len(order)
    best = [0.0] + [float("inf")] * n  # best[k]: cheapest passes over the first k sorted rows
    cut = [0] * (n + 1)
    for end in range(1, n + 1):
        prompt = answer = 0
        for start in range(end - 1, -1, -1):  # group order[start:end]
            prompt = max(prompt, lengths[order[start]][0])
            answer = max(answer, lengths[order[start]][1])
            cost = best[start] + (end - start) * (prompt + answer) + pass_tokens
            if cost < best[end]:
                best[end], cut[end] = cost, start
    groups, end = [], n
    while end > 0:
        groups.append(order[cut[end] : end])
        end = cut[end]
    return groups[::-1]


def score_answers(
    engine: Engine, jobs: list[ScoreJob], prefix: ForcedPrefix | PrefixCache | None = None
) -> tuple[list[Answer], BatchTimings]:
    """Teacher-forced passes over a batch of existing answers -> scored `Answer`s (over
    ``prefix``'s cache when every prompt starts with it: `chat_prefix`, or the longest one a
    `PrefixCache` holds for these prompts). Rows of very different lengths go in separate
    passes (`length_groups`) when that reads fewer padding tokens than it costs."""
    started = time.perf_counter()
    config = CaptureConfig(
        max_context=engine.max_context,
        batch_size=len(jobs),
        # map-only capture when maps are all the detector reads (positions and attention
        # weights too for a stacked actmap-plus)
        **engine.detector.capture_settings(),
    )
    if isinstance(prefix, PrefixCache):
        prefix = prefix.for_prompts([j.prompt for j in jobs], config)
    groups = [list(range(len(jobs)))]
    if len(jobs) > 2:
        shared = 0 if prefix is None else len(prefix.ids)  # an upper bound: what it skips
        lengths = [
            (max(1, engine.count_tokens(j.prompt) - shared), len(answer_ids(engine, j.answer)))
            for j in jobs
        ]
        groups = length_groups(lengths)
    generations: list = [None] * len(jobs)
    with engine.lock:
        for group in groups:
            records = capture_answers_batch(
                engine.model,
                engine.thread_tokenizer,
                [jobs[i].prompt for i in group],
                [jobs[i].answer for i in group],
                config,
                engine.layers_path,
                prefix,
            )
            for i, record in zip(group, records, strict=True):
                generations[i] = record
    forced = time.perf_counter()
    answers = engine.score(jobs, generations, started)
    return answers, BatchTimings(len(jobs), forced - started, time.perf_counter() - forced)


def score_pairs(
    engine: Engine,
    prompts: list[str],
    answers: list[str | list[int]],
    batch_size: int = 16,
    progress=None,
) -> list[Answer]:
    """Offline scoring (``actmap score``): ``prompts`` rendered, in batches of ``batch_size``."""
    if len(prompts) != len(answers):
        raise ValueError(f"{len(prompts)} prompts but {len(answers)} answers")
    out: list[Answer] = []
    prefix = PrefixCache(engine, chat_prefix(engine))
    for start in range(0, len(prompts), batch_size):
        jobs = [
            ScoreJob(p, a, p, "score")
            for p, a in zip(
                prompts[start : start + batch_size],
                answers[start : start + batch_size],
                strict=True,
            )
        ]
        out += score_answers(engine, jobs, prefix)[0]
        if progress is not None:
            progress(len(jobs))
    return out
