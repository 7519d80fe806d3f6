"""The feedback API through a real uvicorn server: labels reach the audit store append-only
(history kept, the latest wins), the review queue lists what waits, and bad input (no key,
an unknown map id, a label outside {0, 1}, a body too large) gets a clear error and loses
nothing already in the store."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
from serve_helpers import ServerThread, save_tiny_detector  # noqa: E402
from test_served_store import ask_all, served_app  # noqa: E402

from actmap.serve.audit import open_audit_store, read_audit  # noqa: E402
from actmap.store.rows import row_metadata  # noqa: E402
from actmap.store.served import latest_labels, served_sampling  # noqa: E402

KEY = "s3cret"
AUTH = {"Authorization": f"Bearer {KEY}"}


def snapshot(root):
    """(audit rows, label rows) as the store holds them now."""
    store = open_audit_store(root)
    labels = store.read_table("labels").to_pandas() if store.has_table("labels") else None
    return read_audit(store), labels


def test_feedback_labels_reach_the_store_and_bad_input_loses_nothing(tmp_path):
    run = tmp_path / "run"
    save_tiny_detector(run)
    root = tmp_path / "audit"
    app = served_app(run, root, api_key=KEY, max_body_bytes=2000)
    with ServerThread(app) as server:
        blocks = ask_all(server.url, 12, api_key=KEY)
        first, second = blocks[0]["map_id"], blocks[1]["map_id"]
        post = lambda body, **kw: httpx.post(  # noqa: E731
            server.url + "/v1/actmap/feedback", json=body, timeout=30, **kw
        )
        # an answer just served may still be buffered: feedback commits it first
        ok = post({"map_id": first, "label": 1, "source": "thumbs"}, headers=AUTH)
        assert ok.status_code == 200, ok.text
        assert ok.json()["label"] == 1 and ok.json()["source"] == "thumbs"
        again = post({"map_id": first, "label": 0, "source": "unit-tests"}, headers=AUTH)
        assert again.status_code == 200
        post({"map_id": second, "label": 1, "correct_answer": "rome"}, headers=AUTH)
        app.state.actmap.engine.audit.flush()
        audit_before, labels_before = snapshot(root)
        assert len(labels_before) == 3

        bad = [
            (post({"map_id": first, "label": 1}), 401, "API key"),
            (post({"map_id": "nope", "label": 1}, headers=AUTH), 404, "'nope'"),
            (post({"map_id": first, "label": 2}, headers=AUTH), 400, "label must be 0"),
            (post({"map_id": first, "label": True}, headers=AUTH), 400, "label must be 0"),
            (post({"map_id": first}, headers=AUTH), 400, "label"),
            (post({"map_id": first, "label": 1, "correct_answer": "x" * 3000}, headers=AUTH),
             413, "exceeds 2000 bytes"),
        ]  # fmt: skip
        for response, status, message in bad:
            assert response.status_code == status, response.text
            assert message in response.json()["error"]["message"]
        assert bad[1][0].json()["error"]["code"] == "map_not_found"

        queue = httpx.get(server.url + "/v1/actmap/review/queue", headers=AUTH, timeout=30)
        assert queue.status_code == 200
        assert httpx.get(server.url + "/v1/actmap/review/queue", timeout=30).status_code == 401
        page = httpx.get(server.url + "/review", timeout=30)  # no data in it: served openly
        assert page.status_code == 200 and "actmap review" in page.text
    audit_after, labels_after = snapshot(root)
    assert audit_after.equals(audit_before)  # nothing lost, nothing added by the failures
    assert labels_after.equals(labels_before)
    history = labels_after[labels_after["id"] == first]
    assert history["label"].tolist() == [1, 0]  # both kept, in order
    assert history["source"].tolist() == ["thumbs", "unit-tests"]
    latest = latest_labels(open_audit_store(root))
    assert latest.loc[first, "label"] == 0 and latest.loc[second, "correct_answer"] == "rome"
    with served_sampling("all"):
        meta = row_metadata(open_audit_store(root)).set_index("id")
    assert meta.loc[first, "label"] == 0 and meta.loc[second, "label"] == 1  # the latest wins
    assert meta["label"].notna().sum() == 2
    pending = {item["map_id"] for item in queue.json()["items"]}
    queued = set(open_audit_store(root).read_table("review").to_pandas()["id"])
    assert pending == queued - {first, second}
    assert queue.json()["pending"] == len(pending) and queue.json()["text_kept"] is True


def test_review_sample_setting_reaches_the_audit_trail(tmp_path):
    from actmap.errors import ActmapUserError
    from actmap.serve.app import ServeSettings, audit_trail
    from actmap.serve.audit import AuditTrail
    from actmap.serve.loaded_run import load_detector_run

    run = tmp_path / "run"
    save_tiny_detector(run)
    settings = ServeSettings(detector=run, audit=tmp_path / "audit", review_sample=0.25)
    trail = audit_trail(settings, load_detector_run(run))
    try:
        assert trail.review_sample == 0.25
        drawn = [trail.in_sample(f"id-{i}") for i in range(4000)]
        assert abs(np.mean(drawn) - 0.25) < 0.03  # a uniform share of all answers
        assert trail.in_sample("id-7") == trail.in_sample("id-7")  # fixed by the id
    finally:
        trail.close()
    with pytest.raises(ActmapUserError, match=r"review_sample must be in \[0, 1\]"):
        AuditTrail(tmp_path / "other", review_sample=1.5)
