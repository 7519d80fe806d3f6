"""The command line: help on every command, capture from a prompts file, train and evaluate a store."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from actmap.cli import app
from actmap.store import MapRecord, MapStore

runner = CliRunner()
COMMANDS = [
    "capture",
    "build-maps",
    "store",
    "judge",
    "train",
    "evaluate",
    "demo",
    "baselines",
    "compare",
    "monitor",
    "report",
    "reproduce",
]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help(command):
    result = runner.invoke(app, [command, "--help"])
    assert result.exit_code == 0, result.output
    assert "Usage" in result.output


def test_capture_from_prompts_file_and_rebuild_maps(tmp_path, tiny_model_dir):
    prompts = tmp_path / "prompts.jsonl"
    lines = [
        {"prompt": "what is the capital", "id": "a", "answers": ["paris"], "split": "test"},
        {"prompt": "red blue green", "split": "test"},
    ]
    prompts.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    store = tmp_path / "store"
    args = [
        "capture",
        "--prompts",
        str(prompts),
        "--model",
        str(tiny_model_dir),
        "--out",
        str(store),
        "--splits",
        "test",
        "--max-new-tokens",
        "4",
        "--keep-trajectories",
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    frame = pd.read_parquet(store / "maps")
    other = frame.loc[frame["source_key"] != "a", "source_key"].item()  # a hash of its text
    assert sorted(frame["id"]) == sorted(["prompts:a", f"prompts:{other}"])
    assert frame.set_index("source_key").loc["a", "label"] in (0, 1)  # has answers -> labelled
    assert pd.isna(frame[frame["source_key"] != "a"]["label"]).all()  # no answers -> unknown
    again = runner.invoke(app, args)  # resume: nothing new, so no model load
    assert again.exit_code == 0
    assert "holds every one of the 2 examples asked for" in again.output.replace("\n", " ")
    out = tmp_path / "maps16"
    built = runner.invoke(
        app, ["build-maps", "--store", str(store), "--out", str(out), "--resolution", "16x64"]
    )
    assert built.exit_code == 0, built.output
    from actmap.store import MapStore

    derived = MapStore.open(out)
    assert derived.manifest["map_shape"] == [12, 16, 64]
    maps, meta = derived.load_maps()
    assert maps.shape == (2, 12, 16, 64)
    assert sorted(meta["id"]) == sorted(frame["id"])  # same rows, same labels as the source


def test_stop_strings_come_from_the_task_or_the_command_line(tmp_path, tiny_model_dir):
    from actmap.capture.job import stop_strings
    from actmap.data.builtin import BuiltinArithmeticTask
    from actmap.data.datasets import NQOpenTask

    assert stop_strings(NQOpenTask(), None, False) == ("\n",)
    assert stop_strings(BuiltinArithmeticTask(), None, False) == ()
    assert stop_strings(NQOpenTask(), ["\\n", "Question:"], False) == ("\n", "Question:")
    assert stop_strings(NQOpenTask(), None, True) == ()
    with pytest.raises(ValueError, match="--no-stop"):
        stop_strings(NQOpenTask(), ["x"], True)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        json.dumps({"prompt": "what is the capital", "id": "a", "split": "test"}) + "\n"
    )
    store = tmp_path / "store"
    args = ["capture", "--prompts", str(prompts), "--model", str(tiny_model_dir)]
    args += ["--out", str(store), "--splits", "test", "--max-new-tokens", "6", "--stop", " "]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    opened = MapStore.open(store)
    assert opened.manifest["config"]["capture"]["stop_strings"] == [" "]
    # the word tokenizer puts a space between words, so every answer is one word long
    assert opened.metadata()["n_tokens"].tolist() == [1]


def test_capture_keeps_what_the_methods_need():
    from actmap.capture.needs import capture_settings

    default = capture_settings(None, None, 0, False)
    off = {"keep_positions": False, "lookback_attention": False}
    assert default == {"greybox": True, "attention_keys": 0, "keep_dense": False, **off}
    assert capture_settings(["actmap"], None, 0, False)["greybox"] is False  # map-only
    both = capture_settings(["actmap", " tad", "actvit"], None, 0, False)
    assert both == {"greybox": True, "attention_keys": 10, "keep_dense": True, **off}
    full = capture_settings(["actmap-plus:full"], None, 0, False)
    assert full == {
        "greybox": True, "attention_keys": 10, "keep_dense": False,
        "keep_positions": True, "lookback_attention": True,
    }  # fmt: skip
    assert capture_settings(["rauq"], None, 12, False)["attention_keys"] == 12
    with pytest.raises(ValueError, match="unknown method 'vitt' in --methods; known: actmap"):
        capture_settings(["vitt"], None, 0, False)
    with pytest.raises(ValueError, match="--no-greybox contradicts --methods: perplexity"):
        capture_settings(["perplexity"], False, 0, False)


def test_map_only_capture_and_the_prefix_default_of_new_and_old_stores(tmp_path, tiny_model_dir):
    from actmap.capture.job import AUTO_SHARE_PREFIX

    prompts = tmp_path / "prompts.jsonl"
    line = {"prompt": "what is the capital", "id": "a", "split": "test"}
    prompts.write_text(json.dumps(line) + "\n")
    base = ["capture", "--prompts", str(prompts), "--model", str(tiny_model_dir)]
    base += ["--splits", "test", "--max-new-tokens", "3"]
    new = tmp_path / "new"
    result = runner.invoke(app, [*base, "--out", str(new), "--methods", "actmap"])
    assert result.exit_code == 0, result.output
    recorded = MapStore.open(new).manifest["config"]["capture"]
    assert recorded["greybox"] is False and recorded["share_prefix"] == AUTO_SHARE_PREFIX
    # a store made before the default existed records no share_prefix: it resumes with 0
    old = tmp_path / "old"
    result = runner.invoke(app, [*base, "--out", str(old), "--share-prefix", "0"])
    assert result.exit_code == 0, result.output
    assert "share_prefix" not in MapStore.open(old).manifest["config"]["capture"]
    again = runner.invoke(app, [*base, "--out", str(old)])
    assert again.exit_code == 0, again.output
    assert "holds every one of the 1 examples" in again.output.replace("\n", " ")


def test_a_bfloat16_capture_is_recorded_resumed_only_in_bfloat16_and_reloaded_so(
    tmp_path, tiny_model_dir
):
    """--dtype bfloat16 runs the generator in bfloat16 (the maps are still built in float32
    and finite), records the dtype in the store, refuses a float32 resume naming the key, and
    the baselines reload the store's generator in the dtype that wrote it."""
    import torch

    from actmap.baselines.inputs import StoreInputs
    from actmap.baselines.options import BaselineOptions

    prompts = tmp_path / "prompts.jsonl"
    lines = [{"prompt": f"what is the capital {i}", "id": f"q{i}", "split": "test"} for i in (1, 2)]
    prompts.write_text("".join(json.dumps(x) + "\n" for x in lines))
    store = tmp_path / "store"
    base = ["capture", "--prompts", str(prompts), "--model", str(tiny_model_dir)]
    base += ["--out", str(store), "--splits", "test", "--max-new-tokens", "4"]
    result = runner.invoke(app, [*base, "--dtype", "bfloat16"])
    assert result.exit_code == 0, result.output
    opened = MapStore.open(store)
    assert opened.manifest["config"]["model"]["dtype"] == "bfloat16"
    maps, _ = opened.load_maps()
    assert maps.shape[0] == 2 and np.isfinite(maps).all() and maps.astype(np.float32).std() > 0
    again = runner.invoke(app, base)  # float32 into a bfloat16 store
    assert again.exit_code != 0 and "model.dtype" in again.output, again.output
    resumed = runner.invoke(app, [*base, "--dtype", "bfloat16"])
    assert resumed.exit_code == 0 and "nothing to capture" in resumed.output.replace("\n", " ")
    model, _ = StoreInputs(opened, BaselineOptions(device="cpu"), {}).generator()
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    bad = runner.invoke(app, [*base, "--out", str(tmp_path / "other"), "--dtype", "int8"])
    assert bad.exit_code == 2 and "dtype must be one of float32, bfloat16, float16" in bad.output
    assert not (tmp_path / "other").exists()  # refused before anything was written


def test_capture_reports_bad_input_clearly(tmp_path, tiny_model_dir):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "x"}\n')
    result = runner.invoke(
        app,
        [
            "capture",
            "--prompts",
            str(bad),
            "--model",
            str(tiny_model_dir),
            "--out",
            str(tmp_path / "s"),
        ],
    )
    assert result.exit_code == 2
    assert "bad.jsonl: line 1" in result.output and "prompt" in result.output


def synthetic_store(path, n=120, seed=0):
    """Maps whose channel 0 carries the label, spread over the three splits."""
    rng = np.random.default_rng(seed)
    store = MapStore.create(path, {"synthetic": True})
    records = []
    for i in range(n):
        label = i % 2
        grid = rng.standard_normal((12, 32, 128)).astype(np.float32)
        grid[0] += 1.5 * label
        split = "train" if i % 10 < 6 else "validation" if i % 10 < 8 else "test"
        records.append(
            MapRecord(
                f"s:{i}",
                str(i),
                "s",
                split,
                "m",
                "r",
                "p",
                "a",
                int(rng.integers(1, 30)),
                label,
                grid,
            )
        )
    store.write_maps(records)
    return store


def test_train_then_evaluate_on_a_store(tmp_path):
    synthetic_store(tmp_path / "store")
    run = tmp_path / "run"
    result = runner.invoke(
        app,
        [
            "train",
            "--store",
            str(tmp_path / "store"),
            "--out",
            str(run),
            "--detector",
            "logreg",
            "--seeds",
            "42,123",
            "--max-epochs",
            "6",
        ],
    )
    assert result.exit_code == 0, result.output
    assert (run / "seed-42" / "model.safetensors").is_file() and (run / "summary.json").is_file()
    evaluated = runner.invoke(app, ["evaluate", "--run", str(run)])
    assert evaluated.exit_code == 0, evaluated.output
    report = json.loads((run / "evaluation.json").read_text())
    from sklearn.metrics import roc_auc_score

    scores = pd.read_parquet(run / "seed-42" / "test_scores.parquet")
    assert report["per_seed"]["42"]["auroc"] == pytest.approx(
        roc_auc_score(scores["label"], scores["p_correct"])
    )
    assert report["mean"]["auroc"] > 0.9
    # frozen detectors on another store (transfer path) score its balanced test rows
    synthetic_store(tmp_path / "other", seed=1)
    transfer = runner.invoke(
        app,
        [
            "evaluate",
            "--run",
            str(run),
            "--store",
            str(tmp_path / "other"),
            "--out",
            str(tmp_path / "t.json"),
        ],
    )
    assert transfer.exit_code == 0, transfer.output
    assert json.loads((tmp_path / "t.json").read_text())["mean"]["auroc"] > 0.9
    assert "test metrics (balanced rows)" in transfer.output
    # every labelled row: the table says so (it once said "balanced rows" for any --rows)
    every = runner.invoke(
        app,
        ["evaluate", "--run", str(run), "--store", str(tmp_path / "other"), "--rows", "all",
         "--out", str(tmp_path / "all.json")],
    )  # fmt: skip
    assert every.exit_code == 0, every.output
    written = json.loads((tmp_path / "all.json").read_text())
    flat = " ".join(every.output.split())
    assert f"metrics (all rows: n={written['n']}, {written['n_correct']} correct)" in flat
    assert "balanced rows" not in flat
