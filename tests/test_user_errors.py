"""A user's mistake ends in one line naming the file, line, id or option; a bug keeps its traceback."""

from __future__ import annotations

import json
import shutil
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_cli import synthetic_store
from typer.testing import CliRunner

from actmap.cli import app
from actmap.errors import ActmapUserError

runner = CliRunner()


def one_line_error(result, *fragments: str) -> str:
    """The command failed with exit 2 and a single 'error:' line holding every fragment."""
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert "Traceback" not in result.output
    assert len(lines) == 1 and lines[0].startswith("error:"), result.output
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


@pytest.fixture()
def tiny_model_dir(tmp_path, tiny_llama, word_tokenizer):
    folder = tmp_path / "tiny-model"
    tiny_llama.save_pretrained(folder)
    word_tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("run")
    synthetic_store(root / "store")
    args = ["train", "--store", str(root / "store"), "--out", str(root / "run")]
    result = runner.invoke(
        app, [*args, "--detector", "logreg", "--seeds", "1", "--max-epochs", "2"]
    )
    assert result.exit_code == 0, result.output
    return root


def damaged_copy(trained_run, tmp_path, damage) -> str:
    run = tmp_path / "run"
    shutil.copytree(trained_run / "run", run)
    damage(run / "seed-1")
    return str(run)


def truncate(seed):
    data = (seed / "model.safetensors").read_bytes()
    (seed / "model.safetensors").write_bytes(data[: len(data) // 2])


def garble(seed):
    (seed / "model.safetensors").write_bytes(b"\x00garbage" * 100)


def wrong_shape(seed):
    from safetensors.torch import load_file, save_file

    state = load_file(seed / "model.safetensors")
    key = max(state, key=lambda k: state[k].numel())
    state[key] = state[key].flatten()[:-1].contiguous()
    save_file(state, seed / "model.safetensors")


def without_history(seed):
    config = json.loads((seed / "config.json").read_text())
    del config["history"]
    (seed / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("damage", "fragments"),
    [
        (truncate, ("model.safetensors", "not a readable safetensors file")),
        (garble, ("model.safetensors", "not a readable safetensors file")),
        (wrong_shape, ("model.safetensors", "has shape", "config.json's detector needs")),
        (without_history, ("config.json", "lacks the field(s) history")),
    ],
)
def test_damaged_detector_folder_is_one_line(trained_run, tmp_path, damage, fragments):
    run = damaged_copy(trained_run, tmp_path, damage)
    result = runner.invoke(app, ["evaluate", "--run", run, "--store", str(trained_run / "store")])
    one_line_error(result, *fragments)


def test_detector_trained_on_cuda_scores_on_a_cpu_machine(trained_run, tmp_path):
    import torch

    from actmap.detectors.base import CorrectnessDetector

    def on_cuda(seed):
        config = json.loads((seed / "config.json").read_text())
        config["train_config"]["device"] = "cuda"
        (seed / "config.json").write_text(json.dumps(config))

    run = damaged_copy(trained_run, tmp_path, on_cuda)
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    detector = CorrectnessDetector.load(f"{run}/seed-1")
    assert detector.device_ == torch.device("cpu")
    result = runner.invoke(app, ["evaluate", "--run", run, "--store", str(trained_run / "store")])
    assert result.exit_code == 0, result.output
    with pytest.raises(ActmapUserError, match="CUDA is not available"):
        CorrectnessDetector.load(f"{run}/seed-1", device="cuda")
    store = str(trained_run / "store")
    train = ["train", "--store", store, "--out", str(tmp_path / "r2"), "--device", "cuda"]
    one_line_error(runner.invoke(app, train), "'cuda'", "CUDA is not available")


def test_missing_model_folder_fails_without_asking_the_hub(tmp_path, monkeypatch):
    import transformers

    def no_hub(*args, **kwargs):
        raise AssertionError("the hub was asked")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_hub)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "what is the capital"}\n')
    out = tmp_path / "s"
    for path in ("/nonexistent/folder", "./no/such/model", "../nowhere/", "~/missing-model/x"):
        result = runner.invoke(
            app, ["capture", "--prompts", str(prompts), "--model", path, "--out", str(out)]
        )
        one_line_error(result, "model folder not found")
    assert not out.exists()


def test_unknown_hub_id_offline_fails_fast(tmp_path, monkeypatch):
    import actmap.llm.models

    monkeypatch.setattr(actmap.llm.models, "_hub_answers", lambda endpoint, timeout_s: False)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "what is the capital"}\n')
    started = time.perf_counter()
    result = runner.invoke(
        app,
        [
            "capture",
            "--prompts",
            str(prompts),
            "--model",
            "no-org/no-model",
            "--out",
            str(tmp_path / "s"),
        ],
    )
    one_line_error(result, "no-org/no-model", "offline")
    assert time.perf_counter() - started < 10
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ActmapUserError, match="offline"):
        actmap.llm.models.check_hub_reachable("no-org/no-model", "main")


def test_hub_probe_answers_false_for_a_closed_port():
    from actmap.llm.models import _hub_answers

    started = time.perf_counter()
    assert _hub_answers("http://127.0.0.1:9", 1.0) is False  # discard port, nothing listens
    assert time.perf_counter() - started < 3


@pytest.mark.parametrize(
    ("content", "fragments"),
    [
        (b"", ("p.jsonl is empty",)),
        (b"\n  \n", ("p.jsonl is empty",)),
        (
            b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n',
            ("p.jsonl: line 2", "not valid UTF-8", "0xe9"),
        ),
        (
            b'{"prompt": "a", "id": "x"}\n{"prompt": "b", "id": "x"}\n',
            ("p.jsonl: line 2", "repeats line 1"),
        ),
        (b'{"prompt": "a", "split": "dev"}\n', ("p.jsonl: line 1", "'split'")),
        (b"[1, 2]\n", ("p.jsonl: line 1", "JSON object")),
    ],
)
def test_bad_prompt_files_name_the_file_and_line(tmp_path, tiny_model_dir, content, fragments):
    prompts = tmp_path / "p.jsonl"
    prompts.write_bytes(content)
    out = tmp_path / "s"
    args = ["capture", "--prompts", str(prompts), "--model", str(tiny_model_dir), "--out", str(out)]
    one_line_error(runner.invoke(app, args), *fragments)
    assert not out.exists()


def test_answers_file_needs_an_answer(tmp_path, tiny_model_dir):
    answers = tmp_path / "a.jsonl"
    answers.write_text('{"prompt": "what is the capital", "answer": "paris"}\n{"prompt": "red"}\n')
    args = ["capture", "--answers", str(answers), "--model", str(tiny_model_dir)]
    one_line_error(
        runner.invoke(app, [*args, "--out", str(tmp_path / "s")]), "a.jsonl: line 2", "'answer'"
    )


@pytest.mark.parametrize(
    ("option", "value"),
    [("--batch-size", "0"), ("--max-new-tokens", "0"), ("--limit", "0"), ("--batch-size", "-3")],
)
def test_option_values_are_checked_before_anything_is_written(tmp_path, option, value):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "what is the capital"}\n')
    out = tmp_path / "s"
    result = runner.invoke(
        app, ["capture", "--prompts", str(prompts), "--out", str(out), option, value]
    )
    assert result.exit_code == 2
    assert option in result.output and "Traceback" not in result.output
    assert not out.exists()


@pytest.mark.parametrize("resolution", ["abc", "32x", "0x128", "32x128x4", "-1x64"])
def test_resolution_must_be_l_x_d_integers(tmp_path, resolution):
    out = tmp_path / "m.safetensors"
    args = ["build-maps", "--store", str(tmp_path), "--out", str(out), "--resolution", resolution]
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    assert "LxD" in result.output and "int()" not in result.output
    assert not out.exists()


def test_non_finite_maps_name_the_store_and_id(tmp_path):
    store = synthetic_store(tmp_path / "store")
    shard = next((tmp_path / "store" / "maps").glob("*.parquet"))
    table = pq.read_table(shard)
    blobs = table.column("map").to_pylist()
    ids = table.column("id").to_pylist()
    victim = next(
        i
        for i, key in enumerate(ids)
        if store.metadata().set_index("id").at[key, "split"] == "train"
    )
    array = np.frombuffer(blobs[victim], np.float16).copy()
    array[7] = np.nan
    blobs[victim] = array.tobytes()
    column = pa.array(blobs, table.schema.field("map").type)
    pq.write_table(table.set_column(table.schema.get_field_index("map"), "map", column), shard)
    args = ["train", "--store", str(tmp_path / "store"), "--out", str(tmp_path / "run")]
    result = runner.invoke(app, [*args, "--detector", "logreg", "--max-epochs", "1"])
    one_line_error(result, str(tmp_path / "store"), f"'{ids[victim]}'", "NaN or infinite")


def test_predict_proba_names_the_non_finite_row(trained_run):
    from actmap.detectors.base import CorrectnessDetector

    detector = CorrectnessDetector.load(trained_run / "run" / "seed-1")
    maps = np.zeros((5, 12, 32, 128), np.float32)
    maps[3, 0, 0, 0] = np.inf
    with pytest.raises(ActmapUserError, match=r"row 3\)"):
        detector.predict_proba(maps)


def test_debug_shows_the_traceback_of_a_user_error(tmp_path):
    missing = str(tmp_path / "nothing")
    plain = runner.invoke(app, ["evaluate", "--run", missing])
    one_line_error(plain, "has no seed-*/ folders")
    debug = runner.invoke(app, ["--debug", "evaluate", "--run", missing])
    assert debug.exit_code == 1 and isinstance(debug.exception, ActmapUserError)


def test_a_bug_keeps_its_traceback(tmp_path, monkeypatch):
    """A ValueError that is not the user's (here: inside the run reader) is not hidden."""
    import actmap.experiments.seeds

    def broken(run):
        raise ValueError("a genuine bug")

    monkeypatch.setattr(actmap.experiments.seeds, "read_run", broken)  # evaluate's run reader
    result = runner.invoke(app, ["evaluate", "--run", str(tmp_path)])
    assert result.exit_code == 1
    assert isinstance(result.exception, ValueError) and "genuine bug" in str(result.exception)
    assert "error: a genuine bug" not in result.output
