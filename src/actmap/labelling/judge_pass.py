"""Label a store of summaries with a factuality judge, as a separate resumable pass.

Capturing CNN/DailyMail summaries needs only the generator; judging them needs a
second, larger model (one pass per summary sentence over the article). Keeping the
two apart lets summaries be captured without a judge and labelled later, elsewhere
or in pieces:

    actmap capture --task cnn_dm --out stores/cnn               # labels None
    actmap judge --store stores/cnn --judge qwen.gguf --out stores/cnn-judged

The judged store shares the source's side tables (links) and holds a ``judgments``
table: per summary the judge's name, threshold, sentences and support
probabilities, and the label. Judgments are committed a batch at a time, so a
killed pass continues where it stopped; at the end of every pass the store's
maps are rewritten with the labels judged so far (rows not judged yet: None), unless
they hold those labels already (a finished labelling called again changes nothing).
Sentences are judged in order and a summary stops at its first unsupported
sentence (the label is then known), as in ``summary_is_factual``.

Before a judge labels anything, ``judge_check`` (``actmap judge check``) measures it on
a task with a known answer: per CNN/DM validation article, the first highlight sentence
of that article (supported) and that of another article (not supported). It reports
accuracy at the support threshold, AUROC with a bootstrap interval, and seconds per
claim, so judges can be chosen by quality per second; every CNN/DM figure is read next
to its judge's check.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from actmap.atomic import atomic_write_text
from actmap.data.factuality import (
    SUPPORT_THRESHOLD,
    SummaryFactualityJudge,
    judge_summary,
    split_sentences,
)
from actmap.errors import ActmapUserError
from actmap.labelling.relabel import write_labelled_copy
from actmap.scoring.intervals import Interval, bootstrap
from actmap.store import MapStore, StoreError

log = logging.getLogger(__name__)

JUDGMENTS = "judgments"


def _judgment_table(rows: list[tuple[str, object]]) -> pa.Table:
    return pa.table(
        {
            "id": [key for key, _ in rows],
            "label": pa.array([int(j.factual) for _, j in rows], pa.int8()),
            "judge": [j.judge for _, j in rows],
            "threshold": pa.array([j.threshold for _, j in rows], pa.float32()),
            "sentences": [list(j.sentences) for _, j in rows],
            "support": pa.array([list(j.support) for _, j in rows], pa.list_(pa.float32())),
        }
    )


def judge_store(
    source: MapStore,
    target: str | Path,
    judge: SummaryFactualityJudge,
    threshold: float = SUPPORT_THRESHOLD,
    batch_size: int = 8,
    limit: int | None = None,
    progress: Callable[[int], None] | None = None,
    resumed: Callable[[int], None] | None = None,
    up_to: int | None = None,
) -> MapStore:
    """Judge every summary of ``source`` not judged yet in ``target``; returns the target store.

    ``limit`` caps the summaries judged by this call (the rest wait for the next one);
    ``up_to`` caps the summaries judged in ``target`` over every call (a resumed pass stops
    there). The summaries judged before are reported once to ``resumed`` when given, else to
    ``progress``.
    """
    config = source.manifest.get("config", {})
    task = config.get("task", {})
    if task.get("task") != "cnn_dm":
        raise StoreError(
            f"{source.root} holds task {task.get('task')!r}; judging is for cnn_dm summaries"
        )
    if not source.has_table("generations"):
        raise StoreError(f"{source.root} has no generations table to judge")
    if batch_size < 1:
        raise ActmapUserError(f"batch_size must be >= 1, got {batch_size}")
    generations = source.read_latest("generations", ["question", "label_text"])
    committed = source.ids("maps")
    rows = [
        (key, article, summary)
        for key, article, summary in zip(
            *(generations.column(c).to_pylist() for c in ("id", "question", "label_text")),
            strict=True,
        )
        if key in committed
    ]
    store = MapStore.create(
        target,
        {
            **config,
            "task": {**task, "judge": judge.name, "threshold": threshold},
            "judged": {"source": str(source.root)},
        },
    )
    done = store.ids(JUDGMENTS)
    todo = [row for row in rows if row[0] not in done]
    restored = resumed or progress
    if restored is not None and len(rows) > len(todo):
        restored(len(rows) - len(todo))
    if up_to is not None:
        todo = todo[: max(0, up_to - (len(rows) - len(todo)))]
    todo = todo[:limit] if limit is not None else todo
    for start in range(0, len(todo), batch_size):
        batch = todo[start : start + batch_size]
        judged = [
            (key, judge_summary(judge, article, summary, threshold, early_stop=True))
            for key, article, summary in batch
        ]
        store.write_table(JUDGMENTS, _judgment_table(judged))
        if progress is not None:
            progress(len(batch))
    labels = judged_labels(store)
    write_labelled_copy(source, store, labels)
    log.info("%d of %d summaries judged in %s", len(labels), len(rows), store.root)
    return store


def judged_labels(store: MapStore) -> dict[str, int]:
    """id -> label of every judgment in ``store`` (the latest one per id)."""
    if not store.has_table(JUDGMENTS):
        return {}
    table = store.read_latest(JUDGMENTS, ["label"])
    return dict(zip(table.column("id").to_pylist(), table.column("label").to_pylist(), strict=True))


# ---------------------------------------------------------------- judge check

CHECK_CACHE = "judge-check.json"


@dataclass(frozen=True)
class ClaimPair:
    """One article with a highlight sentence of its own and one of another article."""

    article_id: str
    article: str
    positive: str  # a highlight sentence of this article: supported
    negative: str  # a highlight sentence of another article: not supported
    negative_from: str  # the other article's id


def claim_pairs(rows: Sequence, n_pairs: int, seed: int = 0) -> list[ClaimPair]:
    """``n_pairs`` (article, own highlight, foreign highlight) triples from CNN/DM rows.

    ``rows`` are ``SourceRow``s (article in ``question``, highlights in ``references[0]``).
    Articles are taken in a seeded order; each one's negative is a highlight sentence of
    the next article in that order (a cyclic shift, so never its own), and both claims are
    the first sentence of the highlights.
    """
    usable = [r for r in rows if r.references and split_sentences(r.references[0])]
    if len(usable) < 2:
        raise ActmapUserError(
            f"a judge check needs at least 2 articles with highlights, got {len(usable)}"
        )
    if n_pairs < 1:
        raise ActmapUserError(f"n_pairs must be >= 1, got {n_pairs}")
    order = np.random.default_rng(seed).permutation(len(usable))[: min(n_pairs, len(usable))]
    picked = [usable[i] for i in order]
    pairs = []
    for i, row in enumerate(picked):
        other = picked[(i + 1) % len(picked)] if len(picked) > 1 else usable[order[0] - 1]
        pairs.append(
            ClaimPair(
                article_id=row.source_key,
                article=row.question,
                positive=split_sentences(row.references[0])[0],
                negative=split_sentences(other.references[0])[0],
                negative_from=other.source_key,
            )
        )
    return pairs


@dataclass(frozen=True)
class JudgeCheck:
    """How well a judge tells an article's own highlight from another article's."""

    judge: str
    pairs: int
    claims: int
    accuracy: float  # both claims of all pairs, support >= threshold means "supported"
    auroc: Interval  # support probability vs own (1) / foreign (0), bootstrap interval
    seconds_per_claim: float  # judge wall time per claim, prefix reuse included
    threshold: float

    def to_json(self) -> dict:
        return {**asdict(self), "auroc": self.auroc.to_json()}

    @classmethod
    def from_json(cls, data: dict) -> JudgeCheck:
        return cls(**{**data, "auroc": Interval(**data["auroc"])})

    def summary(self) -> str:
        """One line to print beside a figure whose labels this judge made."""
        return (
            f"judge {self.judge}: check on {self.pairs} CNN/DM pairs, accuracy "
            f"{self.accuracy:.3f} at support >= {self.threshold:g}, AUROC {self.auroc}, "
            f"{self.seconds_per_claim:.1f} s per claim"
        )


CHECK_RESULT = "check.json"


def read_judge_check(path: str | Path) -> JudgeCheck:
    """The result `actmap judge check --out DIR` wrote: ``DIR`` or ``DIR/check.json``."""
    path = Path(path)
    file = path / CHECK_RESULT if path.is_dir() else path
    try:
        return JudgeCheck.from_json(json.loads(file.read_text(encoding="utf-8")))
    except FileNotFoundError:
        raise ActmapUserError(
            f"{file} does not exist; run `actmap judge check --out {path}` first"
        ) from None
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise ActmapUserError(f"{file} is not a judge-check result ({err!r})") from None


def _read_check_cache(path: Path, judge: str) -> dict[str, dict]:
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ActmapUserError(f"{path}: not a judge-check cache ({err}); move it away") from None
    if data.get("judge") != judge:
        raise ActmapUserError(
            f"{path} holds judge {data.get('judge')!r}, not {judge!r}; use another --out folder"
        )
    return {item["article_id"]: item for item in data.get("items", [])}


def judge_check(
    judge: SummaryFactualityJudge,
    pairs: Sequence[ClaimPair],
    out: str | Path | None = None,
    threshold: float = SUPPORT_THRESHOLD,
    save_every: int = 10,
    progress: Callable[[int], None] | None = None,
    resumed: Callable[[int], None] | None = None,
) -> JudgeCheck:
    """Score every pair's two claims with ``judge``; resumable through ``out/judge-check.json``.

    The cache records per pair both support probabilities and the seconds they took; a
    rerun with the same ``out`` scores only the pairs not cached yet (a pair whose negative
    changed, as the last one of a smaller check does, is scored again). The cached pairs are
    reported once to ``resumed`` when given, else to ``progress``.
    """
    path = Path(out) / CHECK_CACHE if out is not None else None
    done = _read_check_cache(path, judge.name) if path is not None else {}

    def save() -> None:
        if path is not None:
            items = [done[p.article_id] for p in pairs if p.article_id in done]
            atomic_write_text(path, json.dumps({"judge": judge.name, "items": items}, indent=1))

    def cached(pair: ClaimPair) -> bool:  # the same negative: a check of fewer pairs
        # took the last article's negative from another article (the cyclic shift)
        return done.get(pair.article_id, {}).get("negative_from") == pair.negative_from

    restored = resumed or progress
    if restored is not None and done:
        restored(sum(cached(p) for p in pairs))
    fresh = 0
    for pair in pairs:
        if cached(pair):
            continue
        start = time.perf_counter()
        positive = judge.support_probability(pair.article, pair.positive)
        negative = judge.support_probability(pair.article, pair.negative)
        done[pair.article_id] = {
            "article_id": pair.article_id,
            "negative_from": pair.negative_from,
            "positive": float(positive),
            "negative": float(negative),
            "seconds": time.perf_counter() - start,
        }
        fresh += 1
        if fresh % save_every == 0:
            save()
        if progress is not None:
            progress(1)
    save()
    items = [done[p.article_id] for p in pairs]
    support = np.array([i["positive"] for i in items] + [i["negative"] for i in items])
    labels = np.array([1] * len(items) + [0] * len(items))
    correct = (support >= threshold) == labels.astype(bool)
    return JudgeCheck(
        judge=judge.name,
        pairs=len(items),
        claims=len(support),
        accuracy=float(correct.mean()),
        auroc=bootstrap(support, labels),
        seconds_per_claim=float(sum(i["seconds"] for i in items) / len(support)),
        threshold=threshold,
    )
