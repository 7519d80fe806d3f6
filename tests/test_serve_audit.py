"""The audit trail: atomic batched appends (SIGKILL mid-batch), retention, rescore, summary."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from actmap.serve.audit import (
    AuditEntry,
    AuditTrail,
    open_audit_store,
    read_audit,
    rescore,
    summarize,
)
from actmap.store import MapRecord, MapStore, StoreError

SRC = str(Path(__file__).resolve().parents[1] / "src")


def expected_map(key: str) -> np.ndarray:
    seed = int(key.split("-")[1]) * 1000 + int(key.split("-")[2])
    return np.random.default_rng(seed).normal(size=(12, 32, 128)).astype(np.float16)


def entries(batch: int, size: int = 8, p: float = 0.7, decision: str = "accept") -> list:
    out = []
    for row in range(size):
        key = f"b-{batch}-{row}"
        record = MapRecord(
            id=key,
            source_key="0" * 64,
            dataset="served",
            split="chat",
            model_name="m",
            model_revision="r",
            prompt="",
            answer="",
            n_tokens=3,
            label=None,
            map=expected_map(key),
        )
        out.append(
            AuditEntry(
                record=record,
                served_at=datetime.now(UTC),
                endpoint="chat",
                prompt_tokens=4,
                finish_reason="stop",
                p_correct=p,
                p_correct_raw=p,
                prevalence=None,
                decision=decision,
                detector="det",
            )
        )
    return out


WRITER = textwrap.dedent(
    """
    import sys
    sys.path[:0] = [{src!r}, {tests!r}]
    from test_serve_audit import entries
    from actmap.serve.audit import AuditTrail
    trail = AuditTrail({root!r}, background=False)
    batch = {start}
    while True:
        trail.append(entries(batch))
        trail.flush()
        print(batch, flush=True)
        batch += 1
    """
)


def test_sigkill_mid_batch_leaves_no_torn_or_lost_row(tmp_path):
    root = tmp_path / "audit"
    committed: list[int] = []
    start = 0
    for delay in (0.0, 0.005):  # kill at different points of the next flush
        script = WRITER.format(
            src=SRC, tests=str(Path(__file__).parent), root=str(root), start=start
        )
        child = subprocess.Popen(
            [sys.executable, "-c", script],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        for _ in range(3):
            line = child.stdout.readline()
            assert line, "the writer died before committing"
            committed.append(int(line))
        if delay:
            import time

            time.sleep(delay)
        child.send_signal(signal.SIGKILL)
        child.wait()
        start = committed[-1] + 100  # the killed batch's ids are never reused
    store = open_audit_store(root)
    frame = read_audit(store)
    maps, meta = store.load_maps()
    by_batch = pd.Series([int(k.split("-")[1]) for k in meta["id"]]).value_counts()
    assert (by_batch == 8).all(), "a batch is partly committed"
    assert set(committed) <= set(by_batch.index), "a committed batch was lost"
    assert len(meta) == len(set(meta["id"])) and set(frame["id"]) == set(meta["id"])
    for key, stored in zip(meta["id"], maps, strict=True):
        np.testing.assert_array_equal(stored, expected_map(key))
    # a restarted writer takes over the store and goes on appending
    trail = AuditTrail(root, background=False)
    trail.append(entries(10_000))
    assert trail.flush() == 8
    trail.close()
    assert len(read_audit(open_audit_store(root))) == len(frame) + 8


def test_one_writer_per_store_and_kind_check(tmp_path):
    trail = AuditTrail(tmp_path / "a", background=False)
    with pytest.raises(StoreError, match="another process is writing the audit store"):
        AuditTrail(tmp_path / "a", background=False)
    trail.close()
    MapStore.create(tmp_path / "plain", {"task": "x"})
    with pytest.raises(StoreError, match="not an audit store"):
        open_audit_store(tmp_path / "plain")


def test_background_writer_batches_and_close_flushes(tmp_path):
    trail = AuditTrail(tmp_path / "a", flush_rows=16, flush_interval_s=60)
    trail.append(entries(0))  # 8 < 16: stays buffered
    trail.append(entries(1))  # 16: the writer commits both batches in one flush
    for _ in range(200):
        if trail.committed == 16:
            break
        import time

        time.sleep(0.01)
    store = open_audit_store(tmp_path / "a")
    assert trail.committed == 16 and len(store.dataset("maps").files) == 1
    trail.append(entries(2))
    trail.close()
    assert len(read_audit(store)) == 24 and len(store.dataset("maps").files) == 2


def test_retention_by_count_and_age(tmp_path):
    trail = AuditTrail(tmp_path / "a", background=False)
    for batch in range(5):
        trail.append(entries(batch))
        trail.flush()
    trail.close()
    trail = AuditTrail(tmp_path / "a", background=False, max_rows=20)  # applied when opened
    kept = read_audit(trail.store)
    assert sorted({int(k.split("-")[1]) for k in kept["id"]}) == [2, 3, 4]  # newest 24 >= 20
    assert len(trail.store.read_table("audit")) == 24  # side rows of dropped shards go too
    trail.max_rows, trail.max_age_days = None, 1.0
    assert trail.apply_retention(now=datetime.now(UTC) + timedelta(days=0.5)) == 0
    assert trail.apply_retention(now=datetime.now(UTC) + timedelta(days=2)) == 16
    assert {int(k.split("-")[1]) for k in read_audit(trail.store)["id"]} == {4}  # newest stays
    trail.close()
    from actmap.store.check import verify_store

    assert verify_store(tmp_path / "a").findings == []  # dropped shards left the manifest too
    with pytest.raises(ValueError, match="max_rows must be >= 1"):
        AuditTrail(tmp_path / "b", max_rows=0)


class TableDetector:
    """A scorer with a known closed form: the mean of the first channel, squashed."""

    needs_scalars = False  # reads the map only, like a LoadedDetector of a paper detector

    def predict_proba(self, maps, scalars=None):
        x = np.asarray(maps, dtype=np.float64)[:, 0].mean(axis=(1, 2))
        return 1 / (1 + np.exp(-x))


def test_rescore_and_summary(tmp_path):
    trail = AuditTrail(tmp_path / "a", background=False)
    trail.append(entries(0, p=0.9) + entries(1, p=0.2, decision="abstain"))
    trail.flush()
    trail.close()
    store = open_audit_store(tmp_path / "a")
    scores = rescore(store, TableDetector(), batch_size=5)
    assert len(scores) == 16
    for key, new in zip(scores["id"], scores["p_correct_raw_new"], strict=True):
        direct = TableDetector().predict_proba(expected_map(key)[None])[0]
        assert new == pytest.approx(direct)
    assert set(scores["p_correct_raw"]) == {0.9, 0.2}
    summary = summarize(read_audit(store), every="1D")
    assert len(summary) == 1
    row = summary.iloc[0]
    assert (row["n"], row["accept"], row["abstain"], row["review"]) == (16, 8, 8, 0)
    assert row["p_mean"] == pytest.approx(0.55) and row["p50"] == pytest.approx(0.55)
