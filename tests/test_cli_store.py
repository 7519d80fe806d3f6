"""``actmap store verify|repair`` and the capture command's store checks, as a user runs them."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from actmap.cli import app
from actmap.cli.common import fraction
from actmap.store import MapStore

runner = CliRunner()


def capture_args(tmp_path, model, store, *extra):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": f"red blue {i}", "split": "test"}) + "\n" for i in range(6))
    )
    return [
        "capture",
        "--prompts",
        str(prompts),
        "--model",
        str(model),
        "--out",
        str(store),
        "--splits",
        "test",
        "--max-new-tokens",
        "3",
        "--batch-size",
        "3",
        *extra,
    ]


def words(text: str) -> str:
    return " ".join(text.split())


def test_verify_and_repair_commands_name_damage_and_what_a_resume_redoes(tmp_path, tiny_model_dir):
    store = tmp_path / "store"
    args = capture_args(tmp_path, tiny_model_dir, store)
    assert runner.invoke(app, args).exit_code == 0
    ok = runner.invoke(app, ["store", "verify", str(store)])
    assert ok.exit_code == 0 and "verdict: ok" in ok.output
    shard = MapStore.open(store).shards("maps")[0]
    ids = MapStore.open(store).read_table("maps", ["id"]).column("id").to_pylist()[:3]
    shard.write_bytes(shard.read_bytes()[:100])
    damaged = runner.invoke(app, ["store", "verify", str(store)])
    assert damaged.exit_code == 1
    assert f"damage maps/{shard.name}: unreadable" in words(damaged.output)
    assert "verdict: damaged (1 problem(s))" in words(damaged.output)
    repaired = runner.invoke(app, ["store", "repair", str(store)])
    assert repaired.exit_code == 0, repaired.output
    text = words(repaired.output)
    assert f"moved maps/{shard.name} to quarantine/" in text
    assert f"a resumed `actmap capture` will regenerate 3 ids: {', '.join(sorted(ids))}" in text
    assert "verify after repair: ok" in text
    resumed = runner.invoke(app, args)
    assert resumed.exit_code == 0 and "wrote 3 rows (3 already stored" in words(resumed.output)
    final = runner.invoke(app, ["store", "verify", str(store)])
    assert final.exit_code == 0 and "verdict: ok" in final.output
    assert "nothing to repair" in words(runner.invoke(app, ["store", "repair", str(store)]).output)


def test_capture_checks_the_store_before_loading_the_model(tmp_path, tiny_model_dir, monkeypatch):
    store = tmp_path / "store"
    assert runner.invoke(app, capture_args(tmp_path, tiny_model_dir, store)).exit_code == 0
    import actmap.llm.models

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the store's config was checked")

    monkeypatch.setattr(actmap.llm.models, "load_model", no_load)
    other = capture_args(tmp_path, tiny_model_dir, store, "--keep-trajectories")
    refused = runner.invoke(app, other)
    assert refused.exit_code == 2, refused.output
    assert "another config" in refused.output and "keep.trajectories: None -> True" in words(
        refused.output
    )
    # the same options spelled "off" differently are the same config: it resumes, and with
    # every example stored there is nothing to capture and no model to load
    same = capture_args(tmp_path, tiny_model_dir, store, "--attention-keys", "0", "--no-keep-dense")
    resumed = runner.invoke(app, same)
    assert resumed.exit_code == 0, resumed.output
    assert "holds every one of the 6 examples asked for" in words(resumed.output)
    assert "natural accuracy in the store" in resumed.output


def test_a_finished_capture_resumes_without_its_model_only_when_nothing_is_left(
    tmp_path, tiny_model_dir, monkeypatch
):
    """Relaunching a queue walks captures that are done: they need no model load. A store
    with examples left, or one asked for with another model, loads the model as always."""
    import actmap.llm.models

    store = tmp_path / "store"
    args = capture_args(tmp_path, tiny_model_dir, store)
    assert runner.invoke(app, args).exit_code == 0
    runs = len(MapStore.open(store).manifest["runs"])
    loads, real_load = [], actmap.llm.models.load_model

    def counted_load(*a, **kw):
        loads.append(a[0])
        return real_load(*a, **kw)

    monkeypatch.setattr(actmap.llm.models, "load_model", counted_load)
    again = runner.invoke(app, args)
    assert again.exit_code == 0 and "nothing to capture" in again.output and loads == []
    assert len(MapStore.open(store).manifest["runs"]) == runs  # no empty run logged
    # two more prompts in the file: the model loads and only they are captured
    prompts = tmp_path / "prompts.jsonl"
    extra = "".join(json.dumps({"prompt": f"blue red {i}", "split": "test"}) + "\n" for i in (7, 8))
    grown = capture_args(tmp_path, tiny_model_dir, store)  # rewrites the six prompts
    prompts.write_text(prompts.read_text() + extra)
    more = runner.invoke(app, grown)
    assert more.exit_code == 0 and "wrote 2 rows (6 already stored" in words(more.output)
    assert loads == [str(tiny_model_dir)]
    # the same folder copied elsewhere and named another way: the model loads to be checked
    alias = tmp_path / "alias"
    alias.symlink_to(tiny_model_dir)
    other = [str(alias) if a == str(tiny_model_dir) else a for a in grown]
    prompts.write_text(prompts.read_text())
    runner.invoke(app, other)
    assert loads[-1] == str(alias)


@pytest.mark.parametrize(("value", "text"), [(float("nan"), "n/a"), (0.5, "0.500"), (0.0, "0.000")])
def test_fractions_of_nothing_are_na(value, text):
    assert fraction(value) == text
