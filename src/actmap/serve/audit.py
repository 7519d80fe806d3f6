"""The audit trail: every served answer's map, score and decision, in a map store.

An audit store is an ordinary `actmap.store.MapStore` (same Parquet layout, so
every store tool reads it) whose manifest config says ``kind = "audit"``. Each
served answer with a map becomes one row of ``maps`` (label unknown; the prompt
and answer text only when ``keep_text``; ``source_key`` is the prompt's SHA-256)
and one row of the side table ``audit`` (scores, decision, detector id, timing);
when the detector reads the per-answer scalars (actmap-plus), they go to the side
table ``audit_scalars``, so `rescore` can reproduce the served score. What an action
did with the answer (`actmap.serve.actions`: routed to a stronger model, a failed route,
replaced by the abstain message) goes to the side table ``audit_actions`` (`note_action`);
the row itself stays the small model's answer, its map and its score.

Writes are batched: answers are buffered and a writer thread flushes them every
``flush_rows`` answers or ``flush_interval_s`` seconds. A flush writes the
``audit`` shard first and the ``maps`` shard last, each atomically (temporary
file + rename), so a row is committed exactly when its map is in ``maps``: a
crash at any moment leaves committed rows whole and loses only the answers not
yet flushed. Readers join ``audit`` onto the committed ids. With ``sync`` (``actmap serve
--audit-sync``) the writer flushes as soon as anything is buffered (answers that arrive during
a flush share the next one: group commit) and the server sends an answer only once its row is
committed (`AuditTrail.append` returns that moment), so a crash loses no answer a client got.

Retention (`AuditTrail.apply_retention`) drops whole flushed shards that are older
than ``max_age_days`` or beyond the newest ``max_rows`` rows, maps shard first.
Shard granularity keeps it atomic and cheap: a store keeps at least ``max_rows``
rows and at most one flush more.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from actmap.capture.answer_scalars import SCALAR_NAMES
from actmap.data.splits import key_uniform
from actmap.errors import ActmapUserError
from actmap.maps import MapConfig, map_shape
from actmap.store import MapRecord, MapStore, StoreError
from actmap.store.served import (
    LABELS_TABLE,
    REVIEW_TABLE,
    SCALARS_TABLE,  # id + the six per-answer scalars, when the detector reads them
    SERVED_KIND,
)

log = logging.getLogger(__name__)

AUDIT_TABLE = "audit"
ACTIONS_TABLE = "audit_actions"  # id + what an action did with the served answer
AUDIT_KIND = SERVED_KIND
LABELS_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("label", pa.int8()),
        ("source", pa.string()),
        ("labelled_at", pa.timestamp("us", tz="UTC")),
        ("correct_answer", pa.string()),
    ]
)
REVIEW_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("queued_at", pa.timestamp("us", tz="UTC")),
        ("reason", pa.string()),  # "review" (decided review) | "sample" (the uniform sample)
        ("rate", pa.float64()),  # the probability this answer had of entering the queue
        ("in_sample", pa.bool_()),  # drawn in the uniform random sample (rate review_sample)
        ("decision", pa.string()),
        ("p_correct", pa.float64()),
    ]
)
AUDIT_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("served_at", pa.timestamp("us", tz="UTC")),
        ("endpoint", pa.string()),
        ("prompt_sha256", pa.string()),
        ("prompt_tokens", pa.int32()),
        ("n_tokens", pa.int32()),
        ("finish_reason", pa.string()),
        ("p_correct", pa.float64()),
        ("p_correct_raw", pa.float64()),
        ("prevalence", pa.float64()),
        ("decision", pa.string()),
        ("detector", pa.string()),
        ("policy", pa.string()),  # the policy's version (`policy_version`); null in older stores
    ]
)
ACTIONS_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("acted_at", pa.timestamp("us", tz="UTC")),
        ("action", pa.string()),  # routed | route_failed | abstained
        ("route_model", pa.string()),
        ("route_error", pa.string()),
    ]
)


class UnknownMapId(KeyError):
    """A label for a map id the audit store does not hold."""

    def __init__(self, map_id: str) -> None:
        super().__init__(map_id)
        self.map_id = map_id


def prompt_digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class AuditEntry:
    """One served answer, as it will be written."""

    record: MapRecord
    served_at: datetime
    endpoint: str
    prompt_tokens: int
    finish_reason: str
    p_correct: float
    p_correct_raw: float
    prevalence: float | None
    decision: str
    detector: str
    scalars: np.ndarray | None = None  # (6,) in SCALAR_NAMES order, when the detector reads them
    policy: str | None = None  # the version of the policy that decided


def audit_config(map_config: MapConfig = MapConfig()) -> dict:
    return {"kind": AUDIT_KIND, "map": asdict(map_config)}


def open_audit_store(root: str | Path) -> MapStore:
    """An existing audit store; a clear error for a folder that is another kind of store."""
    store = MapStore.open(root)
    kind = (store.manifest.get("config") or {}).get("kind")
    if kind != AUDIT_KIND:
        raise StoreError(f"{root} is a map store but not an audit store (config.kind = {kind!r})")
    return store


class AuditTrail:
    """Buffered, atomic appends of served answers to an audit store (one writer per store)."""

    def __init__(
        self,
        root: str | Path,
        map_config: MapConfig = MapConfig(),
        keep_text: bool = False,
        max_rows: int | None = None,
        max_age_days: float | None = None,
        flush_rows: int = 64,
        flush_interval_s: float = 1.0,
        background: bool = True,
        sync: bool = False,
        review_sample: float = 0.0,
        review_seed: int = 0,
    ) -> None:
        if not 0.0 <= review_sample <= 1.0:
            raise ActmapUserError(f"audit review_sample must be in [0, 1], got {review_sample}")
        if max_rows is not None and max_rows < 1:
            raise ActmapUserError(f"audit max_rows must be >= 1, got {max_rows}")
        if max_age_days is not None and max_age_days <= 0:
            raise ActmapUserError(f"audit max_age_days must be > 0, got {max_age_days}")
        self.store = MapStore.create(
            root, audit_config(map_config), resume=True, map_shape=map_shape(map_config)
        )
        self._lock_file = open(self.store.root / ".audit-writer.lock", "w")  # noqa: SIM115
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.close()
            raise StoreError(f"another process is writing the audit store {root}") from None
        self.keep_text = keep_text
        self.max_rows, self.max_age_days = max_rows, max_age_days
        self.flush_rows, self.flush_interval_s = flush_rows, flush_interval_s
        self.sync = sync  # the writer flushes as soon as anything is buffered (group commit)
        self.review_sample, self.review_seed = review_sample, review_seed
        self.committed = 0  # rows this trail has committed
        self._ids = self.store.ids("maps")  # committed map ids: what feedback may label
        # called with the entries of each commit (before feedback may label them) and with
        # the ids retention drops (`actmap.serve.fallback` keeps its labelled pairs by them)
        self.on_commit: list[Callable[[list[AuditEntry]], None]] = []
        self.on_drop: list[Callable[[set[str]], None]] = []
        self._buffer: list[AuditEntry] = []
        self._waiting: list[Future] = []  # one per append, resolved by the flush that commits it
        self._actions: list[dict] = []  # rows of ACTIONS_TABLE, written with the next flush
        self._cond = threading.Condition()
        self._write_lock = threading.Lock()
        self._closed = False
        self._thread = None
        self.apply_retention()
        if background:
            self._thread = threading.Thread(target=self._writer, name="actmap-audit", daemon=True)
            self._thread.start()

    # -- building entries ------------------------------------------------------------------
    def entry(self, job, answer, source) -> AuditEntry:
        """An `AuditEntry` from an engine job and its answer (which names the detector and the
        policy version that scored it)."""
        record = MapRecord(
            id=answer.map_id,
            source_key=prompt_digest(job.prompt_for_audit or job.prompt),
            dataset="served",
            split=job.endpoint or "served",
            model_name=source.name,
            model_revision=source.revision,
            prompt=(job.prompt_for_audit or job.prompt) if self.keep_text else "",
            answer=answer.text if self.keep_text else "",
            n_tokens=answer.n_tokens,
            label=None,
            map=answer.map,
        )
        return AuditEntry(
            record=record,
            served_at=datetime.now(UTC),
            endpoint=job.endpoint,
            prompt_tokens=answer.prompt_tokens,
            finish_reason=answer.finish_reason,
            p_correct=answer.p_correct,
            p_correct_raw=answer.p_correct_raw,
            prevalence=answer.prevalence,
            decision=answer.decision,
            detector=answer.detector,
            scalars=answer.scalars,
            policy=answer.policy,
        )

    def note_action(
        self, map_id: str, action: str, route_model: str | None = None, route_error=None
    ) -> None:
        """Record what an action did with the served answer ``map_id`` (buffered: written by
        the next flush, before that flush's maps shard)."""
        row = dict(id=map_id, acted_at=datetime.now(UTC), action=action,
                   route_model=route_model, route_error=route_error)  # fmt: skip
        with self._cond:
            if self._closed:
                raise StoreError("the audit trail is closed")
            self._actions.append(row)

    # -- writing ---------------------------------------------------------------------------
    def append(self, entries: list[AuditEntry]) -> Future:
        """Buffer entries; the writer thread (or `flush`) commits them. The future resolves
        (with the rows of its flush, or the flush's error) once they are committed."""
        committed: Future = Future()
        with self._cond:
            if self._closed:
                raise StoreError("the audit trail is closed")
            self._buffer.extend(entries)
            self._waiting.append(committed)
            if self.sync or len(self._buffer) >= self.flush_rows:
                self._cond.notify()
        return committed

    def flush(self) -> int:
        """Commit every buffered entry now; returns the number of rows committed. Entries are
        taken under the write lock, so when it returns, every entry appended before the call
        is committed (also those another thread's flush had taken); the futures `append`
        returned for them resolve (with the flush's error when it fails)."""
        with self._write_lock:
            with self._cond:
                entries, self._buffer = self._buffer, []
                waiting, self._waiting = self._waiting, []
                actions, self._actions = self._actions, []
            try:
                if actions:
                    table = pa.Table.from_pylist(actions, ACTIONS_SCHEMA)
                    self.store.write_table(ACTIONS_TABLE, table)
                if entries:
                    self._commit(entries)
            except BaseException as error:
                for committed in waiting:
                    committed.set_exception(error)
                raise
            for committed in waiting:
                committed.set_result(len(entries))
        return len(entries)

    def _commit(self, entries: list[AuditEntry]) -> None:
        """Write ``entries`` (the caller holds the write lock): side tables first, maps last."""
        side = pa.table(
            {
                "id": [e.record.id for e in entries],
                "served_at": [e.served_at for e in entries],
                "endpoint": [e.endpoint for e in entries],
                "prompt_sha256": [e.record.source_key for e in entries],
                "prompt_tokens": [e.prompt_tokens for e in entries],
                "n_tokens": [e.record.n_tokens for e in entries],
                "finish_reason": [e.finish_reason for e in entries],
                "p_correct": [e.p_correct for e in entries],
                "p_correct_raw": [e.p_correct_raw for e in entries],
                "prevalence": [e.prevalence for e in entries],
                "decision": [e.decision for e in entries],
                "detector": [e.detector for e in entries],
                "policy": [e.policy for e in entries],
            },
            schema=AUDIT_SCHEMA,
        )
        self.store.write_table(AUDIT_TABLE, side)
        queued = self.review_queue(entries)
        if queued.num_rows:
            self.store.write_table(REVIEW_TABLE, queued)
        with_scalars = [e for e in entries if e.scalars is not None]
        if with_scalars:
            values = np.stack([e.scalars for e in with_scalars]).astype(np.float64)
            columns = {"id": [e.record.id for e in with_scalars]}
            columns.update({name: values[:, j] for j, name in enumerate(SCALAR_NAMES)})
            self.store.write_table(SCALARS_TABLE, pa.table(columns))
        self.store.write_maps([e.record for e in entries])  # last: the commit
        self.committed += len(entries)
        for listener in self.on_commit:
            listener(entries)
        self._ids.update(e.record.id for e in entries)

    # -- the review queue ------------------------------------------------------------------
    def in_sample(self, map_id: str) -> bool:
        """Whether an answer is drawn in the uniform random review sample: a seeded hash of
        its map id below ``review_sample`` (every decision band alike)."""
        return key_uniform(map_id, self.review_seed, salt="review-sample") < self.review_sample

    def review_queue(self, entries: list[AuditEntry]) -> pa.Table:
        """The queue rows of ``entries``: every answer decided review (rate 1) and the
        uniform random sample of all answers (rate ``review_sample``)."""
        rows = []
        for e in entries:
            sampled = self.in_sample(e.record.id)
            if e.decision != "review" and not sampled:
                continue
            review = e.decision == "review"
            rows.append(
                {
                    "id": e.record.id, "queued_at": e.served_at,
                    "reason": "review" if review else "sample",
                    "rate": 1.0 if review else self.review_sample, "in_sample": sampled,
                    "decision": e.decision, "p_correct": e.p_correct,
                }
            )  # fmt: skip
        return pa.Table.from_pylist(rows, schema=REVIEW_SCHEMA)

    # -- labels ----------------------------------------------------------------------------
    def add_label(
        self, map_id: str, label: int, source: str, correct_answer: str | None = None
    ) -> dict:
        """Append one label of a served answer (see `add_labels`); returns the row written."""
        return self.add_labels([(map_id, label, source, correct_answer)])[0]

    def add_labels(self, labels: list[tuple[str, int, str, str | None]]) -> list[dict]:
        """Append labels ``(map id, 0 | 1, source, correct answer or None)`` as one atomic
        shard of the ``labels`` table, durable on return (the latest label of an id wins;
        earlier ones stay as history). Answers still buffered are committed first; a map id
        the store does not hold raises `UnknownMapId` and nothing is written."""
        for _, label, _, _ in labels:
            if isinstance(label, bool) or label not in (0, 1):
                raise ActmapUserError(f"label must be 0 or 1, got {label!r}")
        if any(key not in self._ids for key, *_ in labels):
            self.flush()  # an answer just served may still be buffered, or being flushed
            missing = [key for key, *_ in labels if key not in self._ids]
            if missing:
                raise UnknownMapId(missing[0])
        now = datetime.now(UTC)
        rows = [
            {"id": key, "label": int(label), "source": source, "labelled_at": now,
             "correct_answer": answer}
            for key, label, source, answer in labels
        ]  # fmt: skip
        with self._write_lock:
            self.store.write_table(LABELS_TABLE, pa.Table.from_pylist(rows, schema=LABELS_SCHEMA))
        return rows

    def _writer(self) -> None:
        flushes = 0
        while True:
            with self._cond:
                wanted = 1 if self.sync else self.flush_rows
                if not self._closed and len(self._buffer) < wanted:
                    self._cond.wait(self.flush_interval_s)
                closing = self._closed
            try:
                if self.flush():
                    flushes += 1
                    if flushes % 16 == 0:
                        self.apply_retention()
            except Exception:  # a failed flush must not kill the writer; the error is logged
                log.exception("audit flush to %s failed", self.store.root)
            if closing:
                return

    def close(self) -> None:
        """Flush what is buffered, apply retention and release the store."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()
        self.flush()
        self.apply_retention()
        self._lock_file.close()
        self.store.close()  # gives up the store's writer lock

    # -- retention -------------------------------------------------------------------------
    def apply_retention(self, now: datetime | None = None) -> int:
        """Drop whole shards past the age or count limit; returns the rows dropped."""
        if (self.max_rows is None and self.max_age_days is None) or not self.store.has_table(
            "maps"
        ):
            return 0
        now = now or datetime.now(UTC)
        with self._write_lock:
            shards = []  # (path, ids, newest created_at), oldest shard first
            for path in self.store.shards("maps"):
                table = pq.read_table(path, columns=["id", "created_at"])
                newest = pc.max(table.column("created_at")).as_py()
                shards.append((Path(path), table.column("id").to_pylist(), newest))
            kept_rows = sum(len(ids) for _, ids, _ in shards)
            dropped: set[str] = set()
            for path, ids, newest in shards[:-1]:  # the newest shard always stays
                too_old = self.max_age_days is not None and newest < now - timedelta(
                    days=self.max_age_days
                )
                too_many = self.max_rows is not None and kept_rows - len(ids) >= self.max_rows
                if not (too_old or too_many):
                    break
                self.store.forget_shards("maps", [path], unlink=True)
                kept_rows -= len(ids)
                dropped.update(ids)
            self._ids -= dropped
            for listener in self.on_drop if dropped else ():
                listener(dropped)
            for table in (AUDIT_TABLE, SCALARS_TABLE, REVIEW_TABLE, ACTIONS_TABLE):
                if not dropped or not self.store.has_table(table):
                    continue
                for path in self.store.shards(table):
                    ids = set(pq.read_table(path, columns=["id"]).column("id").to_pylist())
                    if ids <= dropped:
                        self.store.forget_shards(table, [path], unlink=True)
        if dropped:
            log.info("audit retention dropped %d rows from %s", len(dropped), self.store.root)
        return len(dropped)


# -- reading --------------------------------------------------------------------------------


def read_audit(store: MapStore) -> pd.DataFrame:
    """Committed rows: the maps metadata joined with their ``audit`` side rows, oldest first."""
    if not store.has_table("maps"):
        return pd.DataFrame(columns=["id", *AUDIT_SCHEMA.names[1:]])
    maps = store.metadata(latest=True)
    side = store.read_table(AUDIT_TABLE, schema=AUDIT_SCHEMA).to_pandas()  # older: no policy
    side = side.drop_duplicates("id", keep="last")
    side = side.drop(columns=["n_tokens"])
    frame = maps.merge(side, on="id", how="inner", validate="one_to_one")
    if store.has_table(ACTIONS_TABLE):  # what an action did (no row: handed out as decided)
        actions = store.read_table(ACTIONS_TABLE).to_pandas().drop_duplicates("id", keep="last")
        frame = frame.merge(actions, on="id", how="left", validate="one_to_one")
    return frame.sort_values("served_at", kind="stable").reset_index(drop=True)


def rescore(store: MapStore, detector, batch_size: int = 256) -> pd.DataFrame:
    """Every committed map scored by ``detector`` (a `LoadedDetector`), without the LLM.

    Columns: id, served_at, detector (the one that served), p_correct_raw (served),
    p_correct_raw_new, decision (served).
    """
    # a LoadedDetector says what it reads; a bare estimator reads maps (and scalars)
    if getattr(detector, "needs_generations", False):
        raise ActmapUserError(
            f"{detector.id} (stacked actmap-plus) reads {', '.join(detector.requires)}, which the "
            "audit trail does not keep (it keeps maps and scalars): rescore with a detector that "
            "reads maps and scalars only (a paper detector or actmap-plus v1)"
        )
    ids, scores = [], []
    scalars = audit_scalars(store) if detector.needs_scalars else None
    for maps, meta in store.iter_maps(batch_size=batch_size, columns=("id",)):
        batch = meta.column("id").to_pylist()
        ids.extend(batch)
        rows = None
        if scalars is not None:
            missing = [key for key in batch if key not in scalars]
            if missing:
                raise ActmapUserError(
                    f"{store.root}: {len(missing)} answers have no per-answer scalars "
                    f"(served by a maps-only detector?), e.g. {missing[0]}; {detector.id} reads them"
                )
            rows = np.stack([scalars[key] for key in batch])
        scores.append(detector.predict_proba(maps, rows))
    new = pd.DataFrame(
        {"id": ids, "p_correct_raw_new": np.concatenate(scores) if scores else np.zeros(0)}
    ).drop_duplicates("id", keep="last")
    served = read_audit(store)[["id", "served_at", "detector", "p_correct_raw", "decision"]]
    return served.merge(new, on="id", how="inner")


def audit_scalars(store: MapStore) -> dict[str, np.ndarray]:
    """{answer id: (6,) per-answer scalars} of the answers served by a detector that reads them."""
    if not store.has_table(SCALARS_TABLE):
        return {}
    table = store.read_table(SCALARS_TABLE)
    values = np.column_stack([table.column(n).to_numpy() for n in SCALAR_NAMES])
    return dict(zip(table.column("id").to_pylist(), values, strict=True))


def summarize(frame: pd.DataFrame, every: str = "1h") -> pd.DataFrame:
    """Per period of ``every`` (a pandas frequency): answers, decisions and p(correct) quantiles."""
    from actmap.serve.policy import DECISIONS

    if frame.empty:
        return pd.DataFrame(columns=["n", *DECISIONS, "p_mean", "p10", "p50", "p90"])
    period = frame["served_at"].dt.floor(every)
    grouped = frame.groupby(period)
    out = pd.DataFrame({"n": grouped.size()})
    counts = pd.crosstab(period, frame["decision"])
    for decision in DECISIONS:
        out[decision] = counts[decision] if decision in counts else 0
    p = grouped["p_correct"]
    out["p_mean"] = p.mean()
    for q in (10, 50, 90):
        out[f"p{q}"] = p.quantile(q / 100)
    out.index.name = "period"
    return out
