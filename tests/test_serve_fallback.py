"""The fallback detector (`actmap.serve.fallback`) through a real uvicorn server on loopback:
the in-domain run scores until the shift monitor alarms, then the generalist given at start,
and the answers say which; labels sent through the feedback API refit the generalist's
recalibration (checked against the documented MAP objective minimised on a dense grid); bad
setups are refused by name."""

from __future__ import annotations

import math
import time

import httpx
import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
from serve_helpers import ServerThread, reference, save_tiny_detector, tiny_engine  # noqa: E402

from actmap.errors import ActmapUserError  # noqa: E402
from actmap.monitor import MonitorConfig, ShiftMonitor  # noqa: E402
from actmap.monitor.stream import StreamingMonitor  # noqa: E402
from actmap.serve.app import ServeSettings, create_app  # noqa: E402
from actmap.serve.audit import AuditTrail  # noqa: E402
from actmap.serve.fallback import install_fallback  # noqa: E402
from actmap.serve.policy import Policy, policy_version, save_policy  # noqa: E402

WINDOW = 3
PROMPTS = ["what is the capital", "red blue green", "one two three", "paris rome", "a b c d",
           "seven eight", "the moon is", "cats and dogs", "blue sky", "ten nine"]  # fmt: skip


def sigmoid(x):
    return 1 / (1 + np.exp(-x))


def map_temperature(p_raw, y, train_prevalence=0.5, sigma=0.5):
    """The documented MAP temperature, minimised on a dense grid of log T (not the server's
    search): p = sigmoid(z / T + logit(acc) - logit(pi_train)) against Platt's smoothed
    targets, log T ~ N(0, sigma^2)."""
    z = np.log(p_raw / (1 - p_raw))
    n_pos, n_neg = int(y.sum()), int(len(y) - y.sum())
    target = np.where(y == 1, (n_pos + 1) / (n_pos + 2), 1 / (n_neg + 2))
    offset = math.log(n_pos / n_neg) - math.log(train_prevalence / (1 - train_prevalence))
    u = np.arange(-4, 4, 1e-4)[:, None]  # a grid of log T, one row each
    q = z[None] * np.exp(-u) + offset
    loss = np.sum(np.logaddexp(0, q) - target * q, axis=1) + u[:, 0] ** 2 / (2 * sigma**2)
    return math.exp(u[int(np.argmin(loss)), 0])


def send_labels(client, blocks, labels, in_domain_block) -> np.ndarray:
    """Labels of the generalist's answers ``blocks`` through ``POST /v1/actmap/feedback``, and
    one of an answer the in-domain run scored (it must not count); returns the answers' raw
    p(correct)."""
    for block, label in zip(blocks, labels, strict=True):
        reply = client.post("/v1/actmap/feedback",
                            json={"map_id": block["map_id"], "label": int(label)})  # fmt: skip
        assert reply.status_code == 200, reply.text
    reply = client.post(
        "/v1/actmap/feedback", json={"map_id": in_domain_block["map_id"], "label": 1}
    )
    assert reply.status_code == 200, reply.text
    return np.array([block["p_correct_raw"] for block in blocks])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(in-domain run, generalist run, a fitted shift monitor), shared by a module's tests
    (none changes them)."""
    tmp_path = tmp_path_factory.mktemp("runs")
    primary, generalist = tmp_path / "in-domain", tmp_path / "generalist"
    save_tiny_detector(primary, seed=0)
    save_tiny_detector(generalist, seed=1)
    # Gaussian maps: the tiny model's maps lie far from them, so the first full window alarms
    maps = np.random.default_rng(0).normal(size=(60, 12, 32, 128)).astype(np.float16)
    monitor = ShiftMonitor(MonitorConfig(n_components=4, n_permutations=39)).fit(maps)
    return primary, generalist, monitor


def test_the_generalist_scores_on_the_alarm_and_learns_from_labels(runs, tmp_path):
    primary, generalist, monitor = runs
    trail = AuditTrail(tmp_path / "audit", keep_text=True, flush_interval_s=0.05)
    policy = Policy(accept=0.6, review=0.4, route=0.2)
    engine = tiny_engine(primary, policy, audit=trail, monitor=StreamingMonitor(monitor, WINDOW))
    fallback = install_fallback(engine, generalist)
    primary_id, generalist_id = engine.detector.id, fallback.generalist.id
    assert primary_id != generalist_id and fallback.fitted == {"labels": 0}
    settings = ServeSettings(model="tiny", detector=primary, default_max_tokens=5,
                             max_tokens_cap=16)  # fmt: skip

    with (
        ServerThread(create_app(settings, lambda: engine)) as server,
        httpx.Client(base_url=server.url, timeout=60) as client,
    ):

        def ask(prompt):
            body = {"model": "tiny", "messages": [{"role": "user", "content": prompt}]}
            return client.post("/v1/chat/completions", json=body).json()["actmap"]

        first = [ask(p) for p in PROMPTS[:WINDOW]]
        # the in-domain run scored the first window; its test alarmed on the last answer
        assert [a["detector"] for a in first] == [primary_id] * WINDOW
        assert [a["shift"]["alarm"] for a in first] == [False] * (WINDOW - 1) + [True]
        assert fallback.swapped.wait(30)
        assert client.get("/health").json()["detector"] == generalist_id
        gen, p_gen = reference(engine, PROMPTS[WINDOW])  # engine.detector: the generalist now
        later = [ask(p) for p in PROMPTS[WINDOW:]]
        assert {a["detector"] for a in later} == {generalist_id}
        assert later[0]["p_correct_raw"] == pytest.approx(p_gen, abs=1e-6)
        # before any label: EM's prior, which leaves the first 50 scores as they are
        assert later[0]["p_correct"] == pytest.approx(later[0]["p_correct_raw"], abs=1e-9)
        # labels of the generalist's answers (feedback API): its recalibration is refit
        labels = np.array([1, 0, 1, 1, 0, 0, 1])
        p_raw = send_labels(client, later, labels, first[0])
        assert fallback.fitted["labels"] == len(labels) and fallback.fitted["correct"] == 4
        want_t = map_temperature(p_raw, labels)
        assert fallback.fitted["temperature"] == pytest.approx(want_t, rel=1e-3)
        assert fallback.fitted["prior"] == pytest.approx(4 / 7)
        after = ask(PROMPTS[0])
        assert after["detector"] == generalist_id and after["policy"] != later[0]["policy"]
        z = np.log(after["p_correct_raw"] / (1 - after["p_correct_raw"]))
        want = sigmoid(z / want_t + math.log(4 / 3))  # prior 4/7 from 0.5
        assert after["p_correct"] == pytest.approx(want, rel=1e-3)
        # a label changed (the latest wins) refits too
        client.post("/v1/actmap/feedback", json={"map_id": later[0]["map_id"], "label": 0})
        assert fallback.fitted["labels"] == len(labels) and fallback.fitted["correct"] == 3
        # a reload while the generalist scores replaces the in-domain pair, not the generalist
        save_tiny_detector(tmp_path / "in-domain-2", seed=2)
        new_policy = Policy(accept=0.9, review=0.5, route=0.1)
        body = {"detector": str(tmp_path / "in-domain-2"),
                "policy": str(save_policy(new_policy, tmp_path / "new.toml"))}  # fmt: skip
        reply = client.post("/v1/actmap/reload", json=body)
        assert reply.status_code == 200, reply.text
        reloaded = reply.json()
        reloaded_id = reloaded["detector"]
        assert reloaded_id not in (primary_id, generalist_id)
        assert reloaded["scoring"] == generalist_id
        assert reloaded["policy"] == policy_version(new_policy)
        assert (reloaded["previous_detector"], reloaded["previous_policy"]) == (
            primary_id, policy_version(policy),
        )  # fmt: skip
        assert fallback.primary[0].id == reloaded_id
        assert client.get("/health").json()["detector"] == generalist_id
        during = ask(PROMPTS[2])
        assert during["detector"] == generalist_id
        assert during["policy"] == policy_version(fallback.policy)
        # the alarm clears: the reloaded in-domain run and its policy score
        fallback.swapped.clear()
        fallback.on_alarm(False)
        assert fallback.swapped.wait(30)
        assert engine.detector.id == reloaded_id
        assert engine.policy_version == policy_version(new_policy)
        deadline = time.time() + 10
        while client.get("/health").json()["detector"] != reloaded_id and time.time() < deadline:
            time.sleep(0.05)
        back = ask(PROMPTS[1])
        assert back["detector"] == reloaded_id
        assert back["policy"] == policy_version(new_policy)


def test_bad_fallback_setups_are_refused_by_name(runs, tmp_path):
    from typer.testing import CliRunner

    from actmap.cli import app
    from actmap.maps import MapConfig
    from actmap.serve.loaded_run import load_detector_run

    primary, generalist, monitor = runs
    with pytest.raises(ActmapUserError, match="needs a detector.*--monitor"):
        install_fallback(tiny_engine(primary), generalist)
    engine = tiny_engine(primary, monitor=StreamingMonitor(monitor, WINDOW))
    with pytest.raises(ActmapUserError, match="--fallback-run: .*does not exist"):
        install_fallback(engine, tmp_path / "nowhere")
    other = load_detector_run(generalist)
    other_maps = type(other)(other.detector, other.id, MapConfig(n_segments=1), other.path)
    engine.detector = other_maps
    with pytest.raises(ActmapUserError, match="reads maps of another config"):
        install_fallback(engine, generalist)
    result = CliRunner().invoke(
        app, ["serve", "--detector", str(primary), "--fallback-run", str(generalist)]
    )
    assert (
        result.exit_code != 0 and "--fallback-run needs --detector and --monitor" in result.output
    )


def served_entries(keys, p_raw, detector_id):
    """Audit entries of answers ``detector_id`` scored with raw p(correct) ``p_raw``."""
    from datetime import UTC, datetime

    from actmap.serve.audit import AuditEntry
    from actmap.store import MapRecord

    blank = np.zeros((12, 32, 128), dtype=np.float16)

    def entry(key, p):
        record = MapRecord(id=key, source_key="0" * 64, dataset="served", split="chat",
                           model_name="m", model_revision="r", prompt="", answer="",
                           n_tokens=3, label=None, map=blank)  # fmt: skip
        return AuditEntry(record, datetime.now(UTC), "chat", 4, "stop", float(p), float(p),
                          None, "accept", detector_id)  # fmt: skip

    return [entry(key, p) for key, p in zip(keys, p_raw, strict=True)]


def test_labels_refit_from_the_pairs_kept_not_by_rereading_the_audit_store(
    runs, tmp_path, monkeypatch
):
    import actmap.serve.audit as audit_module
    from actmap.serve.loaded_run import load_detector_run

    primary, generalist, monitor = runs
    generalist_id = load_detector_run(generalist).id
    reads = []
    read_audit = audit_module.read_audit
    monkeypatch.setattr(audit_module, "read_audit", lambda s: reads.append(1) or read_audit(s))
    rng = np.random.default_rng(3)
    p_raw = rng.uniform(0.05, 0.95, 12)
    keys = [f"g{i}" for i in range(12)]
    trail = AuditTrail(tmp_path / "audit", background=False)
    trail.append(served_entries(keys[:8], p_raw[:8], generalist_id))
    trail.append(served_entries(["d0", "d1"], [0.3, 0.7], "in-domain-run"))
    trail.flush()
    truth = {"g0": 1, "g1": 0, "g2": 1}  # labelled before the server (re)starts
    trail.add_labels([(key, y, "test", None) for key, y in truth.items()])

    def check(fallback):
        """The fit equals the documented MAP fit from scratch on the same pairs."""
        p = np.array([p_raw[keys.index(key)] for key in truth])
        y = np.array(list(truth.values()))
        assert fallback.fitted["labels"] == len(y) and fallback.fitted["correct"] == y.sum()
        assert fallback.fitted["temperature"] == pytest.approx(map_temperature(p, y), rel=1e-3)
        assert fallback.fitted["prior"] == pytest.approx(y.mean())

    engine = tiny_engine(primary, audit=trail, monitor=StreamingMonitor(monitor, WINDOW))
    fallback = install_fallback(engine, generalist)
    assert len(reads) == 1  # read once, at start
    check(fallback)
    # answers the generalist scores after the start arrive through the trail's commits
    trail.append(served_entries(keys[8:], p_raw[8:], generalist_id))
    trail.flush()
    labels = [("g3", 0), ("g9", 1), ("g4", 1), ("g0", 0), ("g11", 0), ("d0", 1)]  # g0: relabel
    for key, y in labels:
        trail.add_label(key, y, "test")
        fitted = fallback.labelled(key, y)
        if key.startswith("g"):
            truth[key] = y
        check(fallback)
        assert fitted is fallback.fitted
    assert len(reads) == 1  # no label re-read the audit table
    # a restarted server refits from the labels in its store: the same fit
    trail.close()
    restarted = tiny_engine(primary, audit=AuditTrail(tmp_path / "audit", background=False),
                            monitor=StreamingMonitor(monitor, WINDOW))  # fmt: skip
    again = install_fallback(restarted, generalist)
    assert len(reads) == 2
    assert again.fitted == pytest.approx(fallback.fitted)
    restarted.audit.close()


def test_under_a_review_sample_only_the_samples_labels_refit(runs, tmp_path):
    """With ``--review-sample`` the kept pairs count as the store counts labels (the uniform
    sample's only): the fit equals the one on the labels `served_view` counts."""
    from actmap.serve.audit import read_audit
    from actmap.serve.fallback import recalibrated_policy
    from actmap.serve.loaded_run import load_detector_run
    from actmap.store.served import served_view

    primary, generalist, monitor = runs
    generalist_id = load_detector_run(generalist).id
    trail = AuditTrail(tmp_path / "audit", background=False, review_sample=0.5)
    engine = tiny_engine(primary, audit=trail, monitor=StreamingMonitor(monitor, WINDOW))
    fallback = install_fallback(engine, generalist)
    keys = [f"s{i}" for i in range(16)]
    p_raw = np.random.default_rng(4).uniform(0.05, 0.95, len(keys))
    trail.append(served_entries(keys, p_raw, generalist_id))
    trail.flush()
    sampled = [key for key in keys if trail.in_sample(key)]
    assert 4 <= len(sampled) < len(keys)  # both kinds among the labelled answers
    for i, key in enumerate(keys):
        label = int(i % 3 != 0)
        trail.add_label(key, label, "test")
        fallback.labelled(key, label)
    # from scratch, as the store counts them
    frame = read_audit(trail.store)
    frame = frame.assign(label=served_view(trail.store, frame[["id"]])["label"].to_numpy())
    frame = frame[frame["label"].notna()]
    assert sorted(frame["id"]) == sorted(sampled)
    _, want = recalibrated_policy(
        fallback.policy, frame["p_correct_raw"], frame["label"], fallback.train_prevalence
    )
    assert fallback.fitted == pytest.approx(want)
    trail.close()


def test_retention_drops_labelled_answers_while_labels_arrive(runs, tmp_path):
    """`AuditTrail.on_drop`: retention dropping labelled answers takes them out of the fit at
    once (the fit equals the MAP fit on the labelled answers the store still holds, and a
    restarted server's); a label of an answer already dropped is refused by the trail, and one
    written just before its answer was dropped does not count; then, labels and retention
    racing on two threads end on the from-scratch fit over what the store holds."""
    import threading

    from actmap.serve.audit import UnknownMapId, read_audit
    from actmap.serve.loaded_run import load_detector_run
    from actmap.store.served import latest_labels

    primary, generalist, monitor = runs
    generalist_id = load_detector_run(generalist).id
    rng = np.random.default_rng(5)
    keys = [f"r{i}" for i in range(40)]
    p_raw = dict(zip(keys, rng.uniform(0.05, 0.95, len(keys)), strict=True))
    trail = AuditTrail(tmp_path / "audit", background=False, max_rows=8)  # two shards of 4

    def serve(shard: int) -> None:  # one flush: one shard of four answers
        part = keys[4 * shard : 4 * shard + 4]
        trail.append(served_entries(part, [p_raw[k] for k in part], generalist_id))
        trail.flush()

    def label(key: str, y: int) -> None:  # what POST /v1/actmap/feedback does
        trail.add_label(key, y, "test")
        fallback.labelled(key, y)

    def from_store() -> dict:
        """The fit on the store's labelled answers of the generalist, from scratch."""
        frame = read_audit(trail.store)
        labels = latest_labels(trail.store)["label"]
        frame = frame[frame["id"].isin(labels.index) & (frame["detector"] == generalist_id)]
        if frame.empty:
            return {"labels": 0}
        y = labels[frame["id"]].to_numpy().astype(int)
        p = frame["p_correct_raw"].to_numpy()
        fitted = {"labels": len(y), "correct": int(y.sum()), "prior": y.mean()}
        if 0 < y.sum() < len(y):
            fitted["temperature"] = map_temperature(p, y)
        return fitted

    def check(want: dict) -> None:
        got = {k: fallback.fitted[k] for k in want}
        assert got == pytest.approx(want, rel=1e-3)

    engine = tiny_engine(primary, audit=trail, monitor=StreamingMonitor(monitor, WINDOW))
    fallback = install_fallback(engine, generalist)
    serve(0), serve(1)
    for key, y in (("r0", 1), ("r1", 0), ("r4", 1), ("r5", 0), ("r6", 0)):
        label(key, y)
    p = np.array([p_raw[k] for k in ("r0", "r1", "r4", "r5", "r6")])
    check({"labels": 5, "correct": 2, "temperature": map_temperature(p, np.array([1, 0, 1, 0, 0]))})
    serve(2)
    assert trail.apply_retention() == 4  # r0-r3 dropped: r0 and r1 leave the fit at once
    p = np.array([p_raw[k] for k in ("r4", "r5", "r6")])
    want = {"labels": 3, "correct": 1, "temperature": map_temperature(p, np.array([1, 0, 0]))}
    check(want)
    check(from_store())
    with pytest.raises(UnknownMapId):  # a label of a dropped answer: the trail refuses it
        trail.add_label("r2", 1, "test")
    # a label written just before retention dropped its answer: it does not count
    serve(3)
    trail.add_label("r7", 1, "test")
    assert trail.apply_retention() == 4  # r4-r7 dropped
    assert fallback.labelled("r7", 1) is fallback.fitted and fallback.fitted == {"labels": 0}
    check(from_store())
    # a restarted server makes the same fit from its store
    label("r8", 1)
    check({"labels": 1, "correct": 1, "prior": 2 / 3})  # one class: (correct + 1) / (n + 2)
    trail.close()
    trail = AuditTrail(tmp_path / "audit", background=False, max_rows=8)
    engine = tiny_engine(primary, audit=trail, monitor=StreamingMonitor(monitor, WINDOW))
    kept, fallback = dict(fallback.fitted), install_fallback(engine, generalist)
    assert fallback.fitted == pytest.approx(kept)

    # labels and retention racing: every answer served is labelled at once, from another thread
    committed: set[str] = set()
    trail.on_commit.append(lambda entries: committed.update(e.record.id for e in entries))
    errors: list[BaseException] = []

    def labeller() -> None:
        try:
            for i, key in enumerate(keys[16:]):
                while key not in committed:  # served yet?
                    time.sleep(0.001)
                try:
                    label(key, int(i % 3 == 0))
                except UnknownMapId:  # dropped before its label came
                    pass
        except BaseException as error:  # pragma: no cover (reported below)
            errors.append(error)

    thread = threading.Thread(target=labeller)
    thread.start()
    for shard in range(4, 10):
        serve(shard)
        trail.apply_retention()
    thread.join(60)
    assert not thread.is_alive() and not errors
    trail.apply_retention()
    want = from_store()
    assert want["labels"] >= 4  # the newest two shards' answers, labelled
    check(want)
    trail.close()
