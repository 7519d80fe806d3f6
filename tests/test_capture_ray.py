"""Capture on Ray Data: the same rows and maps as the local engine, the same store, and a
resume after a killed run that neither repeats nor loses an id. Needs the ``ray`` extra."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from test_capture_run import SOURCE, WordTask

from actmap.capture import CaptureConfig
from actmap.capture.ray_engine import RayOptions, require_ray, run_capture_ray
from actmap.capture.run import run_capture, store_config
from actmap.errors import ActmapUserError
from actmap.maps import MapConfig
from actmap.store import MapStore

CONFIG = CaptureConfig(max_new_tokens=5, batch_size=6, attention_keys=2)


def test_without_ray_the_engine_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    with pytest.raises(ActmapUserError, match=r"pip install 'actmap\[ray\]'"):
        require_ray()


def test_capture_engine_ray_without_ray_names_the_extra(monkeypatch, tmp_path, tiny_model_dir):
    from typer.testing import CliRunner

    from actmap.cli import app

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "what is the capital"}\n')
    monkeypatch.setitem(sys.modules, "ray", None)
    args = ["capture", "--prompts", str(prompts), "--model", str(tiny_model_dir)]
    result = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "s"), "--engine", "ray"])
    assert result.exit_code == 2 and "pip install 'actmap[ray]'" in result.output
    assert not (tmp_path / "s").exists()  # refused before anything was written


@pytest.fixture(scope="module")
def local_ray():
    ray = pytest.importorskip("ray")
    pytest.importorskip("ray.data")
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    ray.shutdown()


def new_store(path, task):
    return MapStore.create(path, store_config(task, SOURCE, CONFIG, MapConfig(), {}))


def capture_ray(folder, task, store, progress=None):
    return run_capture_ray(
        str(folder), "main", "cpu", load_tokenizer(folder), SOURCE, task, task.examples, store,
        CONFIG, options=RayOptions(workers=2), progress=progress,
    )  # fmt: skip


def load_tokenizer(folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def rows(store):
    maps, meta = store.load_maps()
    order = np.argsort(meta["id"].to_numpy())
    return maps[order], meta.iloc[order].reset_index(drop=True)


class Killed(Exception):
    pass


def test_two_ray_workers_killed_and_resumed_write_the_rows_and_maps_of_the_local_engine(
    local_ray, tmp_path, tiny_model_dir
):
    """One Ray run dies after two committed batches, a second finishes it: every id once,
    and the rows and maps are those the local engine writes for the same prompts."""
    from actmap.llm.models import load_model

    task = WordTask(30)
    distributed = new_store(tmp_path / "ray", task)
    done = []

    def die_after_two_batches(n):
        done.append(n)
        if len(done) == 2:
            raise Killed  # the driver dies with batches committed and others in flight

    with pytest.raises(Killed):
        capture_ray(tiny_model_dir, task, distributed, die_after_two_batches)
    assert len(MapStore.open(distributed.root).ids()) == 12  # two batches of 6
    resumed = capture_ray(tiny_model_dir, task, MapStore.open(distributed.root))
    assert resumed.skipped_existing == 12 and resumed.written == 18
    distributed = MapStore.open(distributed.root)
    ids = distributed.read_table("maps", ["id"]).column("id").to_pylist()
    assert len(ids) == len(set(ids)) == 30
    assert set(ids) == {f"words:{e.source_key}" for e in task.examples}
    assert distributed.manifest["runs"][-1]["engine"]["workers"] == 2

    model, tokenizer, _ = load_model(str(tiny_model_dir))
    local = new_store(tmp_path / "local", task)
    run_capture(model, tokenizer, SOURCE, task, task.examples, local, CONFIG)
    local_maps, local_meta = rows(local)
    ray_maps, ray_meta = rows(distributed)
    for column in ("id", "split", "answer", "n_tokens", "label", "prompt"):
        assert local_meta[column].tolist() == ray_meta[column].tolist(), column
    np.testing.assert_allclose(
        ray_maps.astype(np.float32), local_maps.astype(np.float32), atol=2e-3
    )
    # the side tables baselines read are there too, row for row
    for table in ("generations", "attention"):
        assert distributed.ids(table) == local.ids(table)
