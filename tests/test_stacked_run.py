"""The stacked actmap-plus end to end on a tiny store: `actmap train --detector actmap-plus
--preset ...` writes a run, `actmap evaluate` re-scores it from the store, and the server
loads it, captures what it reads and serves the p(correct) the detector gives directly."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("fastapi")
from serve_helpers import client_for, tiny_generator  # noqa: E402
from test_capture_run import SOURCE, WordTask  # noqa: E402

from actmap.capture import CaptureConfig, generate_with_capture  # noqa: E402
from actmap.capture.run import run_capture, store_config  # noqa: E402
from actmap.maps import MapConfig, build_map, stored_form  # noqa: E402
from actmap.store import MapStore  # noqa: E402

PROMPT = "what is the capital of paris"


@pytest.fixture(scope="module")
def store_path(tmp_path_factory):
    model, tokenizer = tiny_generator()
    path = tmp_path_factory.mktemp("stacked-store")
    task = WordTask(90)
    config = CaptureConfig(
        max_new_tokens=5, batch_size=16, attention_keys=3, lookback_attention=True,
        keep_positions=True,
    )  # fmt: skip
    store = MapStore.create(path, store_config(task, SOURCE, config, MapConfig(), {}))
    run_capture(model, tokenizer, SOURCE, task, task.examples, store, config)
    store.close()
    return path


@pytest.mark.parametrize("preset", ["deployable", "full"])
def test_train_evaluate_and_serve_a_preset(preset, store_path, tmp_path):
    from typer.testing import CliRunner

    from actmap.cli import app
    from actmap.experiments.seeds import frozen_scores
    from actmap.serve.loaded_run import stacked_rows
    from actmap.stacked import StackedPlus

    run = tmp_path / f"plus-{preset}"
    args = ["train", "--store", str(store_path), "--out", str(run), "--detector", "actmap-plus"]
    result = CliRunner().invoke(app, [*args, "--preset", preset])
    assert result.exit_code == 0, result.output
    saved = json.loads((run / "seed-0" / "config.json").read_text())
    assert saved["detector"] == "actmap-plus" and saved["schema_version"] == 2
    assert saved["stack_config"]["preset"] == preset
    # the frozen run re-scores its own test rows from the store exactly as training scored them
    store = MapStore.open(store_path)
    import pandas as pd

    written = pd.read_parquet(run / "seed-0" / "test_scores.parquet")
    again = frozen_scores(run, store, written["id"].tolist())["0"]
    np.testing.assert_allclose(again, written["p_correct"].to_numpy(), rtol=1e-5)

    with client_for(run) as client:
        out = client.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT}).json()
        engine = client.app.state.actmap.engine
    detector = engine.detector
    assert isinstance(detector.detector, StackedPlus)
    assert out["actmap"]["detector"].startswith("actmap-plus:")
    # reference: capture with what the detector requires, score outside the server
    config = CaptureConfig(
        max_new_tokens=5, max_context=engine.max_context, **detector.capture_settings()
    )
    (gen,) = generate_with_capture(engine.model, engine.tokenizer, [PROMPT], config)
    assert out["choices"][0]["text"] == gen.answer
    maps = stored_form(build_map(gen.trajectory))[None]
    from actmap.capture.answer_scalars import answer_scalars

    needs = detector.requires
    scalars = answer_scalars(gen.logprobs, gen.entropies)[None] if "scalars" in needs else None
    assert (gen.positions is not None) == ("positions" in needs)
    assert (gen.attention is not None) == ("attention" in needs)
    want = detector.detector.predict_proba(stacked_rows(maps, scalars, [gen]))[0]
    assert out["actmap"]["p_correct_raw"] == pytest.approx(float(want), rel=1e-5)


def test_the_comparison_reads_only_rows_with_positions(store_path, tmp_path):
    import shutil

    import pyarrow.parquet as pq

    from actmap.experiments.compare_product import store_rows
    from actmap.experiments.stacked import with_positions_only

    root = tmp_path / "store"
    shutil.copytree(store_path, root)
    store = MapStore.open(root)
    shard = store.shards("positions")[0]
    table = pq.read_table(shard)
    dropped = set(table.column("id").to_pylist()[:5])
    pq.write_table(table.slice(5), shard)  # as if add_positions had not reached these rows yet
    sets = with_positions_only(MapStore.open(root), store_rows(MapStore.open(root)))
    full = store_rows(MapStore.open(root))
    for name, rows in sets.items():
        assert not dropped & set(rows.ids)
        kept = [i for i, k in enumerate(full[name].ids) if k not in dropped]
        np.testing.assert_array_equal(rows.maps, full[name].maps[kept])
        np.testing.assert_array_equal(rows.labels, full[name].labels[kept])
