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
    from actmap.detectors import live_inputs
    from actmap.detectors.stacked import StackedPlus
    from actmap.experiments.seeds import frozen_scores

    run = tmp_path / f"plus-{preset}"
    args = ["train", "--store", str(store_path), "--out", str(run), "--detector", "actmap-plus"]
    # no map+scalars fallback: the stack reads positions (and attention) end to end
    result = CliRunner().invoke(app, [*args, "--preset", preset, "--no-fallback"])
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
    want = detector.detector.predict_proba(live_inputs(maps, scalars, [gen]))[0]
    assert out["actmap"]["p_correct_raw"] == pytest.approx(float(want), rel=1e-5)
    assert_vllm_serving_takes(preset, detector)


def assert_vllm_serving_takes(preset, detector):
    """`--engine vllm` (vLLM's server with the actmap plugin) captures maps, scalars, position
    states and (for the families `actmap.capture.vllm_attention` reads) the lookback
    attention: a run is served with what it reads, and one that reads attention on another
    family is refused by name (by the launcher and the plugin alike)."""
    from actmap.errors import ActmapUserError
    from actmap.serve.loaded_run import refuse_what_vllm_cannot_read
    from actmap.serve.vllm_plugin import worker_settings

    for family in ("llama", "qwen2", None):  # None: not known before the model loads
        refuse_what_vllm_cannot_read(detector, "serve a deployable run", family)
    if "attention" in detector.requires:
        with pytest.raises(ActmapUserError, match="reads attention weights.*not 'gpt2'"):
            refuse_what_vllm_cannot_read(detector, "serve a deployable run", "gpt2")
    else:
        refuse_what_vllm_cannot_read(detector, "serve a deployable run", "gpt2")
    worker = worker_settings(detector, {"hold_s": 5})
    # position states and attention exactly when the fit reads them (not when map+scalars
    # replaced the stack)
    keys = detector.capture_settings().get("attention_keys", 0)
    assert (keys > 0) == ("attention" in detector.requires)
    assert worker == {"greybox": True, "keep_positions": "positions" in detector.requires,
                      "attention_keys": keys, "pooled_dim": 128, "hold_s": 5}  # fmt: skip


def test_vllm_serving_takes_a_full_fit_that_reads_attention(tmp_path):
    """The tiny store's full fit may fall back to map+scalars (then vLLM serves it on any
    family); one that stacks the attention blocks is served where vLLM's attention is read
    (its workers record the K keys it reads) and refused by name elsewhere."""
    from test_stacked import KEYS, synthetic_rows

    from actmap.detectors.stacked import StackConfig, StackedPlus
    from actmap.serve.loaded_run import LoadedDetector

    (train, y), (val, y_val) = synthetic_rows(120, 0), synthetic_rows(60, 1)
    config = StackConfig(preset="full", map_components=8, tad_previous=KEYS, fallback=False)
    fit = StackedPlus(config).fit(train, y, val, y_val)
    detector = LoadedDetector(fit, "actmap-plus:full", MapConfig(), tmp_path)
    assert "attention" in detector.requires
    assert_vllm_serving_takes("full", detector)


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


@pytest.mark.parametrize("preset", ["deployable", "full"])
def test_policy_fit_scores_a_stacked_run_from_the_store(preset, store_path, tmp_path):
    """`actmap policy fit` on a stacked run: the fit's p_raw of the validation rows is the
    estimator's own predict_proba on the inputs compare-stacked builds for those rows."""
    from typer.testing import CliRunner

    from actmap.cli import app
    from actmap.detectors import new_detector, read_inputs
    from actmap.detectors.stacked import StackedPlus
    from actmap.experiments.compare_product import store_rows
    from actmap.experiments.seeds import frozen_scores
    from actmap.experiments.stacked import train_plus_run
    from actmap.serve.fit import natural_scores, store_p_raw
    from actmap.serve.loaded_run import load_detector_run

    run = tmp_path / f"plus-{preset}"
    train_plus_run(store_path, run, preset, fallback=False)
    detector = load_detector_run(run)
    assert isinstance(detector.detector, StackedPlus)
    assert ("attention" in detector.requires) == (preset == "full")
    store = MapStore.open(store_path)
    scores = natural_scores(store, detector, "validation")
    # reference: compare-stacked's row sets (every labelled validation row, scalars read by
    # with_scalars) and its input builder (`fit_stacked` reads each row set with read_inputs,
    # attention for the full preset), scored by the saved estimator itself
    sets = store_rows(store)
    rows = sets["validation_all"]
    assert scores.ids == list(rows.ids)
    np.testing.assert_array_equal(scores.labels, rows.labels)
    assert rows.scalars is not None
    want = detector.detector.predict_proba(
        read_inputs(store, rows, new_detector(f"actmap-plus:{preset}").requires)
    )
    np.testing.assert_allclose(scores.p_raw, want, rtol=1e-6, atol=1e-9)
    assert 0 < scores.p_raw.min() and scores.p_raw.max() < 1 and np.ptp(scores.p_raw) > 0
    # scoring in chunks, in another row order, and from ids alone (frozen_scores) agree row by row
    order = np.random.default_rng(0).permutation(len(rows))
    shuffled = type(rows)([rows.ids[i] for i in order], rows.labels[order], rows.maps[order])
    np.testing.assert_allclose(
        store_p_raw(store, detector, shuffled, chunk=7), want[order], rtol=1e-6, atol=1e-9
    )
    again = frozen_scores(run, store, list(rows.ids))["0"]
    np.testing.assert_allclose(scores.p_raw, again, rtol=1e-5)
    # by hand, around read_inputs: position states and scalars decoded from the tables' own
    # Parquet rows (the store's last write per id), the attention weights' generations rebuilt
    np.testing.assert_allclose(
        detector.detector.predict_proba(hand_built_inputs(store, list(rows.ids), preset == "full")),
        want, rtol=1e-6, atol=1e-9,
    )  # fmt: skip

    out = tmp_path / "policy.toml"
    args = ["policy", "fit", "--run", str(run), "--store", str(store_path), "--out", str(out)]
    result = CliRunner().invoke(app, [*args, "--target-risk", "0.9", "--resamples", "50"])
    assert result.exit_code == 0, result.output
    assert f"{len(rows)} validation rows" in result.output
    assert detector.id in out.read_text()
    from actmap.serve.policy import correct_prior, load_policy, threshold_for_risk

    policy = load_policy(out)
    # (risk 0.9: above the tiny model's error rate, so a finite threshold exists) the written
    # threshold is the risk-coverage threshold of the fit's scores, corrected as
    # the file says (temperature, then the shift to the split's accuracy)
    assert policy.prior.method == "known" and policy.fitted["split"] == "validation"
    assert policy.prior.deployment_accuracy == pytest.approx(scores.accuracy)
    corrected = correct_prior(scores.p_raw, policy.prior)
    expected = threshold_for_risk(corrected, scores.labels, 0.9)[0]
    assert np.isfinite(policy.accept) and policy.accept == pytest.approx(expected)


def test_policy_fit_of_a_v1_run_on_the_same_store(store_path, tmp_path):
    """A v1 actmap-plus (maps + scalars) still fits through the same path, on the same rows."""
    from typer.testing import CliRunner

    from actmap.cli import app
    from actmap.detectors import DetectorInputs
    from actmap.detectors.plus import ActMapPlus, PlusConfig
    from actmap.experiments.compare_product import store_rows
    from actmap.serve.fit import natural_scores
    from actmap.serve.loaded_run import load_detector_run

    # too few rows for `actmap train`'s 5 folds: fit as tests/test_serve_plus.py does
    store = MapStore.open(store_path)
    sets = store_rows(store)
    train, rows = sets["train_all"], sets["validation_all"]
    run = tmp_path / "plus-v1"
    plus = ActMapPlus(PlusConfig(n_components=3, n_strengths=2, cv_folds=2))
    plus.fit(DetectorInputs(train.maps, train.scalars), train.labels).save(run / "seed-0")
    detector = load_detector_run(run)
    assert isinstance(detector.detector, ActMapPlus)
    scores = natural_scores(store, detector, "validation")
    want = detector.detector.predict_proba(rows.maps, rows.scalars)
    np.testing.assert_allclose(scores.p_raw, want, rtol=1e-6, atol=1e-9)
    out = tmp_path / "policy.toml"
    args = ["policy", "fit", "--run", str(run), "--store", str(store_path), "--out", str(out)]
    result = CliRunner().invoke(app, [*args, "--target-risk", "0.9", "--resamples", "0"])
    assert result.exit_code == 0, result.output
    assert out.is_file() and detector.id in out.read_text()


def test_policy_fit_names_missing_position_states(store_path, tmp_path):
    import shutil

    import pyarrow.parquet as pq
    from typer.testing import CliRunner

    from actmap.cli import app
    from actmap.experiments.stacked import train_plus_run

    run = tmp_path / "plus"
    train_plus_run(store_path, run, "deployable", fallback=False)
    root = tmp_path / "store"
    shutil.copytree(store_path, root)
    shard = MapStore.open(root).shards("positions")[0]
    pq.write_table(pq.read_table(shard).slice(len(pq.read_table(shard)) // 2), shard)
    out = tmp_path / "policy.toml"
    args = ["policy", "fit", "--run", str(run), "--store", str(root), "--out", str(out)]
    result = CliRunner().invoke(app, [*args, "--target-risk", "0.3", "--resamples", "0"])
    assert result.exit_code == 2, result.output
    assert "positions" in result.output and "add_positions" in result.output
    assert not out.exists()


def hand_built_inputs(store, ids, attention):
    """`actmap.detectors.DetectorInputs` of ``ids`` read without `read_inputs`: the positions and
    generations tables' Parquet shards read whole, their last row per id decoded by hand."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from actmap.capture.answer_scalars import answer_scalars
    from actmap.capture.from_store import read_generations
    from actmap.detectors import DetectorInputs

    def last_rows(table):
        whole = pa.concat_tables([pq.read_table(s) for s in store.shards(table)]).to_pylist()
        return {r["id"]: r for r in whole}  # a later row of an id supersedes an earlier one

    positions, gens = last_rows("positions"), last_rows("generations")
    states = np.stack([
        np.frombuffer(positions[k]["positions"], np.float16).reshape(positions[k]["shape"])
        for k in ids
    ])  # fmt: skip
    scalars = np.stack([answer_scalars(gens[k]["logprobs"], gens[k]["entropies"]) for k in ids])
    maps, _ = store.load_maps(ids)
    generations = read_generations(store, ids) if attention else None
    return DetectorInputs(maps, scalars, states, generations)


def test_audit_rescore_of_a_stacked_run_is_one_clear_error(store_path, tmp_path):
    """The audit trail keeps maps and scalars only: rescoring it with a stacked run that reads
    position states is refused by name, before anything is read (it raised a bare ValueError
    from inside the scoring loop)."""
    from typer.testing import CliRunner

    from actmap.cli import app
    from actmap.errors import ActmapUserError
    from actmap.serve.audit import rescore
    from actmap.serve.loaded_run import load_detector_run

    run = tmp_path / "plus-deployable"
    args = ["train", "--store", str(store_path), "--out", str(run), "--detector", "actmap-plus"]
    result = CliRunner().invoke(app, [*args, "--preset", "deployable", "--no-fallback"])
    assert result.exit_code == 0, result.output
    loaded = load_detector_run(run, None, "cpu")
    assert loaded.needs_generations
    with pytest.raises(ActmapUserError, match="audit trail does not keep") as raised:
        rescore(MapStore.open(store_path), loaded)
    assert "positions" in str(raised.value)


def test_the_auto_preset_is_the_richest_the_store_holds(store_path, tmp_path):
    """`actmap train --detector actmap-plus --preset auto`: full on a store with position
    states and attention weights; the map+scalars block replaces the stack exactly when it
    ranks validation better, and then maps and scalars alone score it (as the audit trail and
    the server's running scores hold them)."""
    from typer.testing import CliRunner

    from actmap.cli import app
    from actmap.detectors import INPUT_NAMES, DetectorInputs, read_inputs
    from actmap.detectors.stacked import FALLBACK
    from actmap.experiments.stacked import preset_for_store
    from actmap.serve.loaded_run import load_detector_run

    store = MapStore.open(store_path)
    assert preset_for_store(store) == "full"
    run = tmp_path / "plus"
    args = ["train", "--store", str(store_path), "--out", str(run), "--detector", "actmap-plus"]
    result = CliRunner().invoke(app, [*args, "--preset", "auto"])
    assert result.exit_code == 0, result.output
    assert "preset: full" in result.output
    saved = json.loads((run / "seed-0" / "config.json").read_text())
    assert saved["stack_config"]["preset"] == "full" and saved["stack_config"]["fallback"]
    validation = saved["validation"]
    assert validation["fallback"] == (validation[FALLBACK] > validation["stack"])
    assert (saved["selected"] == [FALLBACK]) == validation["fallback"]
    loaded = load_detector_run(run, None, "cpu")
    from actmap.experiments.compare_product import store_rows

    rows = store_rows(store)["test"]
    want = loaded.detector.predict_proba(read_inputs(store, rows, INPUT_NAMES))
    if validation["fallback"]:
        assert not loaded.needs_generations and loaded.requires == ("maps", "scalars")
        got = loaded.predict_proba(rows.maps, read_inputs(store, rows, ("maps", "scalars")).scalars)
        np.testing.assert_allclose(got, want, rtol=1e-6)
        np.testing.assert_allclose(
            loaded.detector.predict_proba(DetectorInputs(rows.maps, rows.scalars)), want, rtol=1e-6
        )
    else:
        assert loaded.needs_generations


def test_the_baselines_input_provider_hands_a_detector_its_one_bundle(store_path):
    """`StoreInputs.rows(requires, ids)`, the provider every baseline reads through, hands a
    detector the bundle it requires: equal to the tables decoded by hand, parts it does not
    require left out."""
    from actmap.baselines.inputs import StoreInputs
    from actmap.baselines.options import BaselineOptions

    store = MapStore.open(store_path)
    ids = store.metadata()["id"].tolist()[:12]
    provider = StoreInputs(store, BaselineOptions(device="cpu"), {})
    want = hand_built_inputs(store, ids, attention=True)
    full = provider.rows(("maps", "scalars", "positions", "attention"), ids)
    np.testing.assert_array_equal(full.maps, want.maps)
    np.testing.assert_allclose(full.scalars, want.scalars, rtol=1e-6)
    np.testing.assert_array_equal(full.positions, want.positions)
    assert [g.answer for g in full.generations] == [g.answer for g in want.generations]
    for a, b in zip(full.generations, want.generations, strict=True):
        np.testing.assert_array_equal(a.attention.numpy(), b.attention.numpy())
    maps_only = provider.rows(("maps",), ids)
    np.testing.assert_array_equal(maps_only.maps, want.maps)
    assert (maps_only.scalars, maps_only.positions, maps_only.generations) == (None, None, None)


def test_plain_actmap_plus_trains_v1_and_a_named_version_refuses_another_preset():
    """One meaning for plain actmap-plus everywhere (reproduce's and train's): actmap-plus:v1;
    --preset picks another only beside the plain name."""
    from actmap.errors import ActmapUserError
    from actmap.experiments.stacked import plus_preset

    assert plus_preset("actmap-plus") == "v1"
    assert plus_preset("actmap-plus", "auto") == "auto"
    assert plus_preset("actmap-plus:full") == "full"
    assert plus_preset("actmap-plus:deployable", "deployable") == "deployable"
    with pytest.raises(ActmapUserError, match="trains the full preset; --preset deployable"):
        plus_preset("actmap-plus:full", "deployable")
    with pytest.raises(ActmapUserError, match="unknown detector"):
        plus_preset("actmap-plus:v2")
