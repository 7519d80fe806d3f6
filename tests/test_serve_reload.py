"""Reload: the detector and policy swapped under 16 concurrent requests through a real uvicorn
server and the official openai client, with no failed request; every answer and audit row
names the detector and policy version that scored it. Also SIGHUP, a failed reload, and
audit stores written before the policy column."""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import replace

import httpx
import numpy as np
import pyarrow as pa
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
from serve_helpers import ServerThread, save_tiny_detector, tiny_engine  # noqa: E402
from test_serve_audit import entries  # noqa: E402

from actmap.serve.app import ServeSettings, create_app  # noqa: E402
from actmap.serve.audit import AUDIT_SCHEMA, AuditTrail, open_audit_store, read_audit, rescore  # noqa: E402
from actmap.serve.loaded_run import load_detector_run  # noqa: E402
from actmap.serve.policy import Policy, load_policy, policy_version, save_policy  # noqa: E402
from actmap.serve.reload import install_sighup  # noqa: E402
from actmap.store.check import verify_store  # noqa: E402

CLIENTS = 16


def test_reload_under_16_concurrent_requests_fails_none(tmp_path):
    run_a, run_b = tmp_path / "run-a", tmp_path / "run-b"
    save_tiny_detector(run_a, seed=0)
    save_tiny_detector(run_b, seed=1)
    policy_a = save_policy(Policy(0.6, 0.4, 0.2), tmp_path / "a.toml")
    policy_b = save_policy(Policy(0.9, 0.5, 0.1), tmp_path / "b.toml")
    versions = {p: policy_version(load_policy(p)) for p in (policy_a, policy_b)}
    ids = {r: load_detector_run(r).id for r in (run_a, run_b)}
    assert len(set(versions.values())) == 2 and len(set(ids.values())) == 2
    root = tmp_path / "audit"
    settings = ServeSettings(
        model="tiny", detector=run_a, policy=policy_a, default_max_tokens=4, max_tokens_cap=8,
        max_batch=8,
    )  # fmt: skip

    def factory():
        trail = AuditTrail(root, flush_interval_s=0.05)
        return tiny_engine(run_a, load_policy(policy_a), audit=trail)

    app = create_app(settings, factory)
    blocks, errors = [], []
    lock, stop = threading.Lock(), threading.Event()

    with ServerThread(app) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)

        def worker(k: int) -> None:
            i = 0
            while not stop.is_set():
                try:
                    reply = client.chat.completions.create(
                        model="tiny", messages=[{"role": "user", "content": f"red {k} blue {i}"}]
                    )
                    with lock:
                        blocks.append(reply.model_extra["actmap"])
                except Exception as error:  # any failed request fails the test
                    with lock:
                        errors.append(repr(error))
                i += 1

        def served() -> int:
            with lock:
                return len(blocks)

        def wait_for(n: int) -> None:
            deadline = time.time() + 120
            while served() < n and time.time() < deadline and not errors:
                time.sleep(0.02)

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(CLIENTS)]
        for thread in threads:
            thread.start()
        try:
            wait_for(CLIENTS * 2)
            swapped = httpx.post(
                server.url + "/v1/actmap/reload",
                json={"detector": str(run_b), "policy": str(policy_b)},
                timeout=60,
            )
            at_swap = served()
            wait_for(at_swap + CLIENTS * 2)
        finally:
            stop.set()
            for thread in threads:
                thread.join(60)
        assert swapped.status_code == 200, swapped.text
        body = swapped.json()
        assert (body["detector"], body["policy"]) == (ids[run_b], versions[policy_b])
        assert (body["previous_detector"], body["previous_policy"]) == (
            ids[run_a], versions[policy_a],
        )  # fmt: skip
        assert errors == []

        # a reload that cannot load keeps the served pair
        bad = httpx.post(
            server.url + "/v1/actmap/reload", json={"detector": str(tmp_path / "none")}, timeout=60
        )
        assert bad.status_code == 400 and "still serving the previous pair" in bad.text
        assert app.state.actmap.engine.detector.id == ids[run_b]

        # SIGHUP reloads the files in use: the policy file changed on disk
        policy_c = Policy(0.95, 0.5, 0.1)
        save_policy(policy_c, policy_b)
        previous = install_sighup(app)
        try:
            os.kill(os.getpid(), signal.SIGHUP)
            deadline = time.time() + 30
            while app.state.actmap.engine.policy_version != policy_version(policy_c):
                assert time.time() < deadline, "SIGHUP did not reload"
                time.sleep(0.02)
        finally:
            signal.signal(signal.SIGHUP, previous)
        app.state.actmap.engine.audit.flush()

    pairs = {(b["detector"], b["policy"]) for b in blocks}
    assert pairs == {(ids[run_a], versions[policy_a]), (ids[run_b], versions[policy_b])}
    frame = read_audit(open_audit_store(root)).set_index("id")
    assert len(frame) == len(blocks) and len(blocks) >= CLIENTS * 4
    for block in blocks:  # each answer and its audit row name the same pair
        row = frame.loc[block["map_id"]]
        assert (row["detector"], row["policy"]) == (block["detector"], block["policy"])
    # one switch: every row of the old pair was served before every row of the new
    ordered = frame.sort_values("served_at")["detector"].tolist()
    switch = ordered.index(ids[run_b])
    assert set(ordered[:switch]) == {ids[run_a]} and set(ordered[switch:]) == {ids[run_b]}
    # and each row's score is its named detector's
    for run in (run_a, run_b):
        scores = rescore(open_audit_store(root), load_detector_run(run)).set_index("id")
        mine = scores[scores["detector"] == ids[run]]
        np.testing.assert_allclose(mine["p_correct_raw_new"], mine["p_correct_raw"], atol=1e-6)


def test_audit_stores_without_the_policy_column_still_load(tmp_path):
    """A shard written before the policy column reads it as null; newer rows keep theirs."""
    trail = AuditTrail(tmp_path / "a", background=False)
    old = entries(0)
    before = pa.schema([f for f in AUDIT_SCHEMA if f.name != "policy"])
    rows = [
        {"id": e.record.id, "served_at": e.served_at, "endpoint": e.endpoint,
         "prompt_sha256": e.record.source_key, "prompt_tokens": e.prompt_tokens,
         "n_tokens": e.record.n_tokens, "finish_reason": e.finish_reason,
         "p_correct": e.p_correct, "p_correct_raw": e.p_correct_raw,
         "prevalence": e.prevalence, "decision": e.decision, "detector": e.detector}
        for e in old
    ]  # fmt: skip
    trail.store.write_table("audit", pa.Table.from_pylist(rows, schema=before))
    trail.store.write_maps([e.record for e in old])
    trail.append([replace(e, policy="policy-new") for e in entries(1)])
    trail.flush()
    trail.close()
    frame = read_audit(open_audit_store(tmp_path / "a")).set_index("id")
    assert len(frame) == 16
    assert frame.loc[[e.record.id for e in old], "policy"].isna().all()
    assert (frame.loc[[e.record.id for e in entries(1)], "policy"] == "policy-new").all()
    # older and newer audit shards side by side are not damage
    report = verify_store(tmp_path / "a")
    assert report.ok and not [f for f in report.findings if "schema" in f.message]
