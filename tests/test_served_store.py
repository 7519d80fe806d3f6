"""An audit store written by a real server is a map store every command reads: the split rule
for served rows, its labels (`actmap.store.served`), store info / verify / repair / subset,
evaluate, train and policy fit on it, and stores written before labels existed."""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
from serve_helpers import ServerThread, save_tiny_detector, tiny_engine  # noqa: E402
from test_serve_audit import entries  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from actmap.cli import app  # noqa: E402
from actmap.serve.app import ServeSettings, create_app  # noqa: E402
from actmap.serve.audit import AuditTrail, open_audit_store, read_audit  # noqa: E402
from actmap.serve.policy import Policy  # noqa: E402
from actmap.store import MapStore  # noqa: E402
from actmap.store.rows import balanced_splits, natural_rows, row_metadata  # noqa: E402
from actmap.store.served import served_sampling, served_splits  # noqa: E402

runner = CliRunner()
WORDS = "red blue green what is the capital of rome how many days".split()
N_ANSWERS = 120
REVIEW_SAMPLE = 0.3
# the tiny detector's corrected p(correct) falls around .1-.8: review is the wide middle band
POLICY = Policy(accept=0.6, review=0.3, route=0.1)


def question(i: int) -> str:
    return " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(1 + i % 5))


def ask_all(url: str, n: int, start: int = 0, api_key: str = "none") -> list[dict]:
    """``n`` chat answers through the official client, 16 at a time; their actmap blocks."""
    client = openai.OpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0)

    def ask(i):
        messages = [{"role": "user", "content": question(i)}]
        reply = client.chat.completions.create(model="tiny", messages=messages)
        return reply.model_extra["actmap"]

    with ThreadPoolExecutor(16) as pool:
        return list(pool.map(ask, range(start, start + n)))


def served_app(run, root, **settings):
    options = dict(model="tiny", detector=run, default_max_tokens=5, max_tokens_cap=16)
    options.update(settings)

    def factory():
        trail = AuditTrail(root, keep_text=True, flush_interval_s=0.05, review_sample=REVIEW_SAMPLE)
        return tiny_engine(run, POLICY, audit=trail)

    return create_app(ServeSettings(**options), factory)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(run folder, audit store root, the served actmap blocks) of N_ANSWERS real answers."""
    folder = tmp_path_factory.mktemp("served")
    run = folder / "run"
    save_tiny_detector(run)
    root = folder / "audit"
    with ServerThread(served_app(run, root)) as server:
        blocks = ask_all(server.url, N_ANSWERS)
    return run, root, blocks


def hand_split(key: str) -> str:
    """The documented rule, computed here from its definition: sha256("served-split:0:<id>"),
    its first 8 bytes over 2^64, cut at .8 and .9."""
    u = int.from_bytes(hashlib.sha256(f"served-split:0:{key}".encode()).digest()[:8], "big")
    u /= 2.0**64
    return "train" if u < 0.8 else "validation" if u < 0.9 else "test"


def label_all(root, blocks, seed=0) -> dict[str, int]:
    """A label for every served answer drawn from its own p(correct); returns {map id: label}."""
    rng = np.random.default_rng(seed)
    labels = {b["map_id"]: int(rng.random() < b["p_correct"]) for b in blocks}
    for split in ("train", "validation", "test"):  # both labels in every split (map ids are
        keys = [k for k in labels if hand_split(k) == split]  # random, so are the splits)
        assert len(keys) >= 2, f"the served rows left '{split}' with {len(keys)} rows"
        if len({labels[k] for k in keys}) == 1:
            labels[keys[0]] = 1 - labels[keys[0]]
    trail = AuditTrail(root, background=False)
    try:
        for key, label in labels.items():
            trail.add_label(key, label, "test")
    finally:
        trail.close()
    return labels


def test_served_store_reads_as_a_map_store(served, tmp_path):
    run, root, blocks = served
    store = open_audit_store(root)
    frame = read_audit(store)
    assert len(frame) == N_ANSWERS and set(frame["endpoint"]) == {"chat"}
    meta = row_metadata(store).set_index("id")
    assert meta["split"].to_dict() == {key: hand_split(key) for key in meta.index}
    assert meta["label"].isna().all()  # no label yet
    assert served_splits(["x"] * 3) == [hand_split("x")] * 3  # the id alone decides
    # the review queue: every answer decided review, and the uniform sample of all bands
    queue = store.read_table("review").to_pandas().set_index("id")
    decided = {b["map_id"]: b["decision"] for b in blocks}
    reviews = {k for k, d in decided.items() if d == "review"}
    assert reviews <= set(queue.index) and len(reviews) > 10
    assert (queue.loc[list(reviews), "rate"] == 1.0).all()
    others = queue[queue["reason"] == "sample"]
    assert (others["rate"] == REVIEW_SAMPLE).all() and others["in_sample"].all()
    assert {decided[k] for k in others.index} <= {"route", "abstain", "accept"}
    assert 0.15 < queue["in_sample"].mean() * len(queue) / N_ANSWERS < 0.45

    info = runner.invoke(app, ["store", "info", str(root)])
    assert info.exit_code == 0, info.output
    assert "task served, model tiny-llama" in info.output
    total = [line for line in info.output.splitlines() if "total" in line][0]
    assert total.split("│")[2].strip() == str(N_ANSWERS) and total.split("│")[3].strip() == "0"
    verify = runner.invoke(app, ["store", "verify", str(root)])
    assert verify.exit_code == 0 and "verdict: ok" in verify.output
    repair = runner.invoke(app, ["store", "repair", str(root)])
    assert repair.exit_code == 0 and "nothing to repair" in repair.output
    unlabelled = runner.invoke(app, ["store", "subset", str(root), str(tmp_path / "none")])
    assert unlabelled.exit_code != 0 and "no balanced rows" in unlabelled.output


def test_labelled_served_store_trains_evaluates_and_fits_a_policy(served, tmp_path):
    run, root, blocks = served
    labels = label_all(root, blocks)
    store = MapStore.open(root)
    with served_sampling("all"):
        meta = row_metadata(store).set_index("id")
        assert meta["label"].astype(int).to_dict() == labels
        rows = natural_rows(store, ("train",))["train"]
        assert [labels[k] for k in rows.row_ids()] == rows.labels.tolist()
    with served_sampling("sample"):  # only the uniform sample's labels count
        queue = store.read_table("review").to_pandas()
        sampled = set(queue.loc[queue["in_sample"], "id"])
        counted = row_metadata(store).dropna(subset=["label"])
        assert set(counted["id"]) == sampled
        # what train reads by default: balanced rows drawn from the uniform sample only
        chosen = balanced_splits(store, persist=False)
        assert set().union(*chosen.values()) <= sampled and chosen["train"]
    info = runner.invoke(app, ["store", "info", str(root), "--json"])
    assert info.exit_code == 0
    import json

    summary = json.loads(info.output)
    assert summary["served"]["labelled"] == N_ANSWERS and summary["served"]["counted"] == "sample"
    assert summary["total"]["labelled"] == len(sampled)

    sub = tmp_path / "sub"
    result = runner.invoke(app, ["store", "subset", str(root), str(sub), "--sampling", "all"])
    assert result.exit_code == 0, result.output
    with served_sampling("all"):
        kept = row_metadata(MapStore.open(sub)).set_index("id")
    assert {k: labels[k] for k in kept.index} == kept["label"].astype(int).to_dict()

    out = tmp_path / "retrained"
    trained = runner.invoke(
        app,
        ["train", "--store", str(root), "--detector", "logreg", "--seeds", "1",
         "--max-epochs", "2", "--device", "cpu", "-o", str(out), "--sampling", "all"],
    )  # fmt: skip
    assert trained.exit_code == 0, trained.output
    evaluated = runner.invoke(
        app, ["evaluate", "--run", str(out), "--store", str(root), "--rows", "all",
              "--sampling", "all"],
    )  # fmt: skip
    assert evaluated.exit_code == 0, evaluated.output
    scored = json.loads((out / "evaluation.json").read_text())
    assert scored["n"] == N_ANSWERS
    fitted = runner.invoke(
        app, ["policy", "fit", "--run", str(out), "--store", str(root), "--target-risk", "0.5",
              "--split", "train", "--resamples", "0", "--sampling", "all",
              "-o", str(tmp_path / "p.toml")],
    )  # fmt: skip
    assert fitted.exit_code == 0, fitted.output
    train_ids = [k for k in labels if hand_split(k) == "train"]
    accuracy = np.mean([labels[k] for k in train_ids])
    assert f"{len(train_ids)} train rows, accuracy {accuracy:.3f}" in " ".join(
        fitted.output.split()
    )


def test_stores_written_before_labels_still_load(tmp_path):
    """An audit store without the labels and review tables (written before they existed)."""
    trail = AuditTrail(tmp_path / "old", background=False)
    trail.append(entries(0) + entries(1))
    trail.flush()
    trail.close()
    info = runner.invoke(app, ["store", "info", str(tmp_path / "old"), "--json"])
    assert info.exit_code == 0, info.output
    import json

    summary = json.loads(info.output)
    assert summary["total"]["rows"] == 16 and summary["total"]["labelled"] == 0
    assert summary["served"] == {
        "labelled": 0, "in_sample": 0, "queued": 0, "history": 0, "counted": "all"
    }  # fmt: skip


def test_verify_and_repair_a_damaged_labels_shard(served, tmp_path):
    """A torn labels shard is damage that verify names and repair sets aside; the other
    labels and every served row stay."""
    import shutil

    _, root, blocks = served
    copy = tmp_path / "audit"
    shutil.copytree(root, copy, ignore=shutil.ignore_patterns("*.lock"))
    kept, torn = blocks[0]["map_id"], blocks[1]["map_id"]
    with served_sampling("all"):  # (the module's other tests may have labelled them already)
        earlier = row_metadata(MapStore.open(copy)).set_index("id").loc[torn, "label"]
    trail = AuditTrail(copy, background=False)
    trail.add_label(kept, 1, "test")
    trail.add_label(torn, 0 if np.isnan(earlier) else 1 - int(earlier), "test")  # differs
    trail.close()
    shard = MapStore.open(copy).shards("labels")[-1]
    shard.write_bytes(shard.read_bytes()[:40])  # a torn file
    verify = runner.invoke(app, ["store", "verify", str(copy)])
    assert verify.exit_code == 1 and shard.name in verify.output
    repair = runner.invoke(app, ["store", "repair", str(copy)])
    assert repair.exit_code == 0 and f"moved labels/{shard.name}" in repair.output
    assert runner.invoke(app, ["store", "verify", str(copy)]).exit_code == 0
    with served_sampling("all"):
        meta = row_metadata(MapStore.open(copy)).set_index("id")
    assert len(meta) == N_ANSWERS and meta.loc[kept, "label"] == 1
    # the torn shard's label is gone: the answer has the label it had before, if any
    after = meta.loc[torn, "label"]
    assert (np.isnan(after) and np.isnan(earlier)) or after == earlier
