"""`actmap reproduce`: the whole chain on a tiny random model, resumed without redoing work."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from actmap.cli import app
from actmap.errors import ActmapUserError
from actmap.reproduce import config_from_dict, load_config

WORDS = "red blue green one two three four five paris rome".split()


def answers_file(path, sizes=(("train", 24), ("validation", 12), ("test", 12))):
    rows = []
    for split, n in sizes:
        for k in range(n):
            words = " ".join(WORDS[(k + j) % len(WORDS)] for j in range(1 + k % 4))
            rows.append(
                {
                    "id": f"{split}{k}",
                    "prompt": f"say {words}",
                    "answer": words if k % 2 else "no",
                    "label": k % 2,
                    "split": split,
                }
            )
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def tiny_config(tmp_path, model_dir, *, seeds, name, baselines, sections):
    """A reproduce config: one store captured from answers_file with the tiny model, logreg."""
    answers = answers_file(tmp_path / "answers.jsonl")
    config = tmp_path / "reproduce.toml"
    config.write_text(
        f"""
out = "out"
detectors = ["logreg"]
seeds = {json.dumps(seeds)}
max_epochs = 2
device = "cpu"
n_resamples = 100
[[stores]]
name = "{name}"
path = "captured/{name}"
baselines = {json.dumps(baselines)}
[stores.capture]
answers = "{answers}"
model = "{model_dir}"
batch_size = 16
[report]
sections = {json.dumps(sections)}
"""
    )
    return config


def test_reproduce_runs_every_stage_then_skips_what_is_done(tmp_path, tiny_model_dir):
    config = tiny_config(
        tmp_path,
        tiny_model_dir,
        seeds=[1],
        name="tiny-answers",
        baselines=["perplexity", "answer_length"],
        sections=["map_channels", "in_domain"],
    )
    result = CliRunner().invoke(app, ["reproduce", "--config", str(config)])
    assert result.exit_code == 0, result.output
    out = tmp_path / "out"
    text = (out / "report" / "report.md").read_text()
    assert "| actmap-logreg |" in text.replace("ActMap (white box) ", "")
    assert "perplexity" in text and "map_channels.png" in text
    source = tmp_path / "captured" / "tiny-answers"
    assert not (source / "results").exists()  # baselines wrote into the copy only
    assert (out / "stores" / "tiny-answers" / "results" / "perplexity").is_dir()
    assert (out / "runs" / "tiny-answers" / "logreg" / "seed-1" / "metrics.json").is_file()
    again = CliRunner().invoke(app, ["reproduce", "--config", str(config)])
    assert again.exit_code == 0, again.output
    for stage in ("capture/", "copy/", "baselines/", "train/"):
        assert f"{stage}tiny-answers" in again.output
    skipped = [line for line in again.output.splitlines() if "skipped (done before)" in line]
    assert len(skipped) == 4  # capture, copy, baselines, train; the report is rebuilt


def test_lost_stage_markers_keep_the_copy_and_its_finished_work(
    tmp_path, tiny_model_dir, monkeypatch
):
    """With the state folder gone (a slip, a bad clean-up) the copy still holds the source's
    rows: it is kept, not linked again, so no baseline is scored again and no seed retrained.
    A copy of other rows is linked again."""
    import actmap.experiments.seeds as runs
    from actmap.baselines import runner

    config = tiny_config(
        tmp_path,
        tiny_model_dir,
        seeds=[1],
        name="tiny",
        baselines=["perplexity", "answer_length"],
        sections=["in_domain"],
    )
    result = CliRunner().invoke(app, ["reproduce", "--config", str(config)])
    assert result.exit_code == 0, result.output
    out = tmp_path / "out"
    copy = out / "stores" / "tiny"
    shard = next((copy / "results" / "perplexity").glob("*.parquet"))
    before = shard.stat().st_mtime_ns

    def forbidden(*args, **kwargs):
        raise AssertionError("work done again")

    monkeypatch.setattr(runner, "make_scorer", forbidden)
    monkeypatch.setattr(runs.CorrectnessDetector, "fit", forbidden)
    shutil.rmtree(out / "state")
    again = CliRunner().invoke(app, ["reproduce", "--config", str(config)])
    assert again.exit_code == 0, again.output
    assert shard.is_file() and shard.stat().st_mtime_ns == before
    assert json.loads((copy / "manifest.json").read_text())["results"].keys() >= {
        "perplexity",
        "answer_length",
    }
    # a copy that holds other rows than the source is linked again
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["shards"]["maps"] = {"part-elsewhere.parquet": 3}
    (copy / "manifest.json").write_text(json.dumps(manifest))
    shutil.rmtree(out / "state")
    monkeypatch.undo()
    third = CliRunner().invoke(app, ["reproduce", "--config", str(config)])
    assert third.exit_code == 0, third.output
    relinked = json.loads((copy / "manifest.json").read_text())
    assert "part-elsewhere.parquet" not in relinked["shards"]["maps"]


def test_a_source_that_grew_retrains_its_detectors_even_after_a_killed_call(
    tmp_path, tiny_model_dir, monkeypatch
):
    """The source store grows after its detectors were trained, and the call that copies it
    again dies before training (a session's end). The next call must still train them again,
    on the rows the store holds now, not keep the runs of the old rows."""
    import pandas as pd

    from actmap.baselines import runner
    from actmap.capture.job import CaptureJob, capture_store
    from actmap.reproduce import plan
    from actmap.store import MapStore
    from actmap.store.rows import balanced_splits

    config = tiny_config(
        tmp_path, tiny_model_dir, seeds=[1], name="tiny", baselines=["answer_length"],
        sections=["in_domain"],
    )  # fmt: skip
    result = CliRunner().invoke(app, ["reproduce", "--config", str(config)])
    assert result.exit_code == 0, result.output
    run = tmp_path / "out" / "runs" / "tiny" / "logreg"

    def test_ids() -> set[str]:
        return set(pd.read_parquet(run / "seed-1" / "test_scores.parquet")["id"].astype(str))

    old_ids = test_ids()
    marker = tmp_path / "out" / "state" / "train__tiny__logreg.json"
    saved_marker = marker.read_text()
    saved_baselines = (tmp_path / "out" / "state" / "baselines__tiny.json").read_text()
    source = tmp_path / "captured" / "tiny"
    answers = answers_file(
        tmp_path / "answers.jsonl", (("train", 24), ("validation", 12), ("test", 24))
    )  # the same file with 12 more test answers: the capture resumes and adds them
    options = {"answers": str(answers), "model": str(tiny_model_dir), "batch_size": 16}
    capture_store(CaptureJob.from_options(source, options))
    new_ids = {str(i) for i in balanced_splits(MapStore.open(source), persist=False)["test"]}
    assert new_ids != old_ids  # the test split grew

    def session_ends(*args, **kwargs):
        raise KeyboardInterrupt  # as the signal that ends a session

    # the copy runs again, then the session ends in the baselines, before any training
    monkeypatch.setattr(runner, "make_scorer", session_ends)
    killed = CliRunner().invoke(app, ["reproduce", "--config", str(config)])
    assert killed.exit_code != 0 and "copy/tiny: skipped" not in killed.output  # it ran
    monkeypatch.undo()
    assert not marker.exists()  # the renewed copy took its later stages' markers first
    # a marker left by an actmap before that: the run of the old rows is still not done
    marker.write_text(saved_marker)
    stages = {s.name: s for s in plan(load_config(config))}
    assert not stages["train/tiny/logreg"].done()
    # and the baselines of the old copy's marker: the new copy has none of their results
    (tmp_path / "out" / "state" / "baselines__tiny.json").write_text(saved_baselines)
    assert not stages["baselines/tiny"].done()
    again = CliRunner().invoke(app, ["reproduce", "--config", str(config)])
    assert again.exit_code == 0, again.output
    assert "train/tiny/logreg: done" in again.output
    assert test_ids() == new_ids


HOLD_LOCK = """
import sys, time
sys.path.insert(0, {src!r})
from actmap.store.lock import acquire
acquire({folder!r})
print("held", flush=True)
time.sleep(60)
"""


def test_two_calls_never_run_one_store_at_once(tmp_path):
    """A call whose store another live call holds stops at once, naming that call; a call on
    another store is not held back; the lock of a call that ended is free."""
    path = tmp_path / "reproduce.toml"
    stores = "".join(f'[[stores]]\nname = "{n}"\npath = "stores/{n}"\n' for n in ("a", "b"))
    path.write_text('out = "out"\n' + stores)
    folder = tmp_path / "out" / "state" / "locks" / "a"
    script = HOLD_LOCK.format(
        src=str(Path(__file__).resolve().parents[1] / "src"), folder=str(folder)
    )
    holder = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        args = ["reproduce", "--config", str(path)]
        held = CliRunner().invoke(app, [*args, "--store", "a"])
        assert held.exit_code != 0
        assert "store 'a' are running in another call" in held.output
        assert f"process {holder.pid}" in held.output
        other = CliRunner().invoke(
            app, [*args, "--store", "b"]
        )  # b does not exist: its copy says so
        assert other.exit_code != 0 and "another call" not in other.output
        assert "does not exist" in other.output
    finally:
        holder.kill()
        holder.wait()
    after = CliRunner().invoke(app, ["reproduce", "--config", str(path), "--store", "a"])
    assert "another call" not in after.output and "does not exist" in after.output


def test_shipped_configs_parse(tmp_path):
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "configs"
    small = load_config(root / "reproduce-small.toml")
    assert [s.capture["task"] for s in small.stores] == ["builtin", "triviaqa"]
    assert small.detectors == ("vit", "mlp", "logreg") and len(small.seeds) == 3
    full = load_config(root / "reproduce-full.toml")
    # the full config reads the stores the queues capture (never captures itself), each
    # under its own name
    assert len(full.stores) >= 6 and all(s.capture is None for s in full.stores)
    assert all(s.path.name == s.name and s.path.parent.name == "stores" for s in full.stores)


def test_config_errors_name_the_problem(tmp_path):
    with pytest.raises(ActmapUserError, match="unknown key"):
        config_from_dict({"out": "x", "stores": [{"name": "a"}], "sedes": [1]}, tmp_path)
    with pytest.raises(ActmapUserError, match="repeat"):
        config_from_dict({"out": "x", "stores": [{"name": "a"}, {"name": "a"}]}, tmp_path)
    with pytest.raises(ActmapUserError, match="detector"):
        config_from_dict({"out": "x", "stores": [{"name": "a"}], "detectors": ["cnn"]}, tmp_path)


def test_a_capture_table_becomes_a_capture_job_or_a_clear_error(tmp_path):
    from actmap.capture.job import CaptureJob

    table = {"task": "triviaqa", "chat_template": False, "limit": 5, "splits": "train, test",
             "answers": "a.jsonl", "stop": ["\\n"], "gpus_per_worker": 1}  # fmt: skip
    job = CaptureJob.from_options(tmp_path, table)
    assert job == CaptureJob(
        tmp_path, task="triviaqa", chat_template=False, limit=5, splits=("train", "test"),
        answers=Path("a.jsonl"), stop=("\\n",), gpus_per_worker=1.0,
    )  # fmt: skip
    with pytest.raises(ActmapUserError, match="unknown capture option 'limt'; known: answers"):
        CaptureJob.from_options(tmp_path, {"limt": 5})
    with pytest.raises(ActmapUserError, match="capture option 'limit' must be int"):
        CaptureJob.from_options(tmp_path, {"limit": "5"})
    with pytest.raises(ActmapUserError, match="capture option 'chat_template' must be bool"):
        CaptureJob.from_options(tmp_path, {"chat_template": 1})
    # a reproduce config is checked when it is read, before any stage runs
    raw = {"out": "x", "stores": [{"name": "a", "capture": {"keep_trajectory": True}}]}
    with pytest.raises(ActmapUserError, match="unknown capture option 'keep_trajectory'"):
        config_from_dict(raw, tmp_path)


def test_a_store_spelled_two_ways_is_one_store(tmp_path):
    """Configs in two folders that name the same store (``../stores/x`` from each) plan the
    same copy stage: a finished copy is not redone because the path was spelled otherwise."""
    from actmap.reproduce import plan

    store = tmp_path / "stores" / "s"
    store.mkdir(parents=True)
    (store / "manifest.json").write_text("{}")
    fingerprints = []
    for folder in ("configs", "runs"):
        (tmp_path / folder).mkdir()
        raw = {"out": "../out", "stores": [{"name": "s", "path": "../stores/s"}]}
        config = config_from_dict(raw, tmp_path / folder)
        assert config.stores[0].path == store.resolve() and config.out == tmp_path / "out"
        copy = next(s for s in plan(config) if s.name == "copy/s")
        fingerprints.append(copy.fingerprint())
    assert fingerprints[0] == fingerprints[1]


def test_copy_is_redone_when_rows_change_not_when_a_no_op_run_is_logged(tmp_path):
    """A capture that resumes a finished store logs a run with nothing written, and training
    on the source writes its balanced split: neither may renew the copy (and retrain everything
    after it); a new shard must."""
    from actmap.reproduce import plan

    store = tmp_path / "stores" / "s"
    store.mkdir(parents=True)
    manifest = {"config": {"task": "t"}, "shards": {"maps": {"part-0.parquet": 32}}, "runs": []}
    (store / "manifest.json").write_text(json.dumps(manifest))
    config = config_from_dict(
        {"out": "out", "stores": [{"name": "s", "path": "stores/s"}]}, tmp_path
    )

    def copy_fingerprint():
        return next(s for s in plan(config) if s.name == "copy/s").fingerprint()

    before = copy_fingerprint()
    manifest["runs"].append({"written": 0, "skipped_existing": 32})
    (store / "manifest.json").write_text(json.dumps(manifest, indent=2))  # also a new mtime
    assert copy_fingerprint() == before
    # `actmap train` on the source writes its balanced split (derived from the rows)
    manifest["balanced"] = {"test": {"correct": 3, "incorrect": 29, "per_class": 3}}
    manifest["shards"]["splits"] = {"part-0.parquet": 6}
    (store / "manifest.json").write_text(json.dumps(manifest))
    assert copy_fingerprint() == before
    manifest["shards"]["maps"]["part-1.parquet"] = 8
    (store / "manifest.json").write_text(json.dumps(manifest))
    assert copy_fingerprint() != before


def test_store_selection_plans_only_the_named_stores(tmp_path):
    """`--store` runs the stores that exist while the others are still being captured: the plan
    holds only their stages (in the config's order) and a report (none with --no-report); an
    unknown name is an error that lists the config's stores."""
    from actmap.reproduce import plan, select_stores

    raw = {"out": "out", "stores": [{"name": n, "path": f"stores/{n}"} for n in ("a", "b", "c")]}
    config = config_from_dict(raw, tmp_path)
    assert select_stores(config, []) is config
    picked = select_stores(config, ["c", "a"])
    names = [s.name for s in plan(picked)]
    assert {n.split("/")[1] for n in names if n != "report"} == {"a", "c"}
    assert names.index("copy/a") < names.index("copy/c") and names[-1] == "report"
    with pytest.raises(ActmapUserError, match=r"\['z'\].*\['a', 'b', 'c'\]"):
        select_stores(config, ["a", "z"])
    path = tmp_path / "reproduce.toml"
    path.write_text(
        'out = "out"\n' + "".join(f'[[stores]]\nname = "{n}"\n' for n in ("a", "b", "c"))
    )
    args = ["reproduce", "--config", str(path)]
    result = CliRunner().invoke(app, [*args, "--store", "b", "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "copy/b: to run" in result.output and "copy/a" not in result.output
    bad = CliRunner().invoke(app, [*args, "--store", "x"])
    assert bad.exit_code != 0 and "no store named ['x']" in bad.output
    assert [s.name for s in plan(picked, report=False)] == names[:-1]
    alone = CliRunner().invoke(app, [*args, "--store", "b", "--dry-run", "--no-report"])
    assert alone.exit_code == 0, alone.output
    assert "copy/b: to run" in alone.output and "report" not in alone.output


def test_a_killed_train_stage_keeps_its_finished_seeds_and_resumes_the_one_in_training(
    tmp_path, tiny_model_dir, ending_session
):
    """A session that ends mid-stage loses at most the epochs since the training seed's last
    checkpoint: the rerun resumes that seed, trains the others, and the run holds every
    seed; a changed source retrains all of them from their first epoch."""
    config = tiny_config(
        tmp_path, tiny_model_dir, seeds=[1, 2, 3], name="tiny", baselines=[], sections=["in_domain"]
    )
    fitted, epochs = ending_session.fitted, ending_session.epochs
    ending_session.restart(kill_at=3)  # seeds 1 and 2 finish, seed 3 dies in its second epoch
    result = CliRunner().invoke(app, ["reproduce", "--config", str(config)])
    assert result.exit_code != 0 and fitted == [1, 2, 3]
    run = tmp_path / "out" / "runs" / "tiny" / "logreg"
    first = (run / "seed-1" / "metrics.json").read_text()
    assert not (run / "seed-3" / "metrics.json").exists()
    assert (run / ".checkpoint-seed-3.safetensors").is_file()
    assert not (run / ".checkpoint-seed-1.safetensors").exists()  # removed once finished

    ending_session.restart()
    result = CliRunner().invoke(app, ["reproduce", "--config", str(config)])
    assert result.exit_code == 0, result.output
    assert fitted == [3]  # only the seed the kill interrupted
    assert len(epochs) == 1  # of its two epochs, the one the kill lost
    assert (run / "seed-1" / "metrics.json").read_text() == first
    assert not list(run.glob(".checkpoint-*"))
    resumed = json.loads((run / "seed-3" / "metrics.json").read_text())
    summary = json.loads((run / "summary.json").read_text())
    manifest = json.loads((run / "manifest.json").read_text())
    assert summary["seeds"] == manifest["seeds"] == [1, 2, 3]

    # what the seeds were trained on changed: none is kept (the stage marker goes, as a
    # renewed copy would make the stage run again)
    key = json.loads((run / "stage-key.json").read_text())
    (run / "stage-key.json").write_text(json.dumps({**key, "source": "another"}))
    (tmp_path / "out" / "state" / "train__tiny__logreg.json").unlink()
    ending_session.restart()
    result = CliRunner().invoke(app, ["reproduce", "--config", str(config)])
    assert result.exit_code == 0, result.output
    assert fitted == [1, 2, 3] and len(epochs) == 6
    # seed 3 from scratch on the same rows: what its resumed run scored
    assert json.loads((run / "seed-3" / "metrics.json").read_text()) == resumed


def test_a_missing_or_torn_marker_reads_as_none(tmp_path):
    """Stage markers, train keys and fit inputs are read with `read_json`: a file a killed
    call left half written, or never wrote, is no marker."""
    from actmap.artifacts import read_json, write_json

    write_json(tmp_path / "whole.json", {"fingerprint": "abc", "seeds": (1, 2)})
    (tmp_path / "torn.json").write_text('{"fingerprint": "ab')
    assert read_json(tmp_path / "whole.json") == {"fingerprint": "abc", "seeds": [1, 2]}
    assert read_json(tmp_path / "torn.json") is None
    assert read_json(tmp_path / "missing.json") is None


def test_reproduce_trains_actmap_plus_like_any_registered_detector(tmp_path, tiny_model_dir):
    """actmap-plus is trained by the chain as the paper's detectors are: one fit into seed-0/
    of its run folder (the layout `actmap train --detector actmap-plus` writes), skipped
    when called again."""
    import pandas as pd
    from sklearn.metrics import roc_auc_score

    from actmap.detectors import ALIASES, all_detectors
    from actmap.training.run_folder import read_run

    assert {"vit", "mlp", "mlp4x", "logreg", "actmap-plus:v1"} <= set(all_detectors())
    assert ALIASES == {"actmap-plus": "actmap-plus:v1"}  # the plain name: one meaning
    config = tiny_config(
        tmp_path, tiny_model_dir, seeds=[1], name="tiny", baselines=[], sections=["in_domain"]
    )
    config.write_text(
        config.read_text().replace('detectors = ["logreg"]', 'detectors = ["actmap-plus"]')
    )
    result = CliRunner().invoke(app, ["reproduce", "--config", str(config)])
    assert result.exit_code == 0, result.output
    run = tmp_path / "out" / "runs" / "tiny" / "actmap-plus"
    assert read_run(run).detector == "actmap-plus" and list(read_run(run).seed_dirs) == [0]
    metrics = json.loads((run / "seed-0" / "metrics.json").read_text())
    scores = pd.read_parquet(run / "seed-0" / "test_scores.parquet")
    assert metrics["auroc"] == pytest.approx(roc_auc_score(scores["label"], scores["p_correct"]))
    again = CliRunner().invoke(app, ["reproduce", "--config", str(config)])
    assert again.exit_code == 0 and "train/tiny/actmap-plus: skipped" in again.output


def test_reproduce_trains_the_stacked_presets_and_reports_them(tmp_path, tiny_model_dir):
    config = tiny_config(
        tmp_path,
        tiny_model_dir,
        seeds=[1],
        name="tiny-stacked",
        baselines=["perplexity"],
        sections=["in_domain"],
    )
    text = config.read_text()
    text = text.replace('detectors = ["logreg"]', 'detectors = ["actmap-plus:deployable"]')
    config.write_text(text.replace("batch_size = 16", "batch_size = 16\nkeep_positions = true"))
    result = CliRunner().invoke(app, ["reproduce", "--config", str(config)])
    assert result.exit_code == 0, result.output
    run = tmp_path / "out" / "runs" / "tiny-stacked" / "actmap-plus-deployable"
    saved = json.loads((run / "seed-0" / "config.json").read_text())
    assert saved["schema_version"] == 2 and saved["stack_config"]["preset"] == "deployable"
    assert any(b.startswith("probe:") for b in saved["selected"])  # the positions were captured
    report = (tmp_path / "out" / "report" / "report.md").read_text()
    assert "actmap-plus-deployable" in report
    again = CliRunner().invoke(app, ["reproduce", "--config", str(config)])
    assert "train/tiny-stacked/actmap-plus:deployable: skipped (done before)" in again.output


def test_reproduce_takes_registry_names_and_refuses_others(tmp_path, tiny_model_dir):
    """A config's detectors are the registry's names (`actmap.detectors.catalog`) or the alias;
    a version's run folder spells its colon as a dash; another name is refused, naming them."""
    from actmap.reproduce import load_config, run_path

    config = tiny_config(
        tmp_path, tiny_model_dir, seeds=[1], name="tiny", baselines=[], sections=["in_domain"]
    )
    text = config.read_text()
    names = '["actmap-plus", "actmap-plus:v1", "actmap-plus:full", "vit"]'
    config.write_text(text.replace('detectors = ["logreg"]', f"detectors = {names}"))
    loaded = load_config(config)
    assert loaded.detectors == tuple(json.loads(names))
    spec = loaded.stores[0]
    assert run_path(loaded, spec, "actmap-plus:full").name == "actmap-plus-full"
    assert run_path(loaded, spec, "actmap-plus").name == "actmap-plus"
    config.write_text(text.replace('detectors = ["logreg"]', 'detectors = ["actmap-plus:v2"]'))
    with pytest.raises(ActmapUserError, match=r"unknown detector\(s\) \['actmap-plus:v2'\]") as err:
        load_config(config)
    assert "actmap-plus:deployable" in str(err.value) and "logreg" in str(err.value)
