"""`actmap serve --engine vllm`: a launcher of vLLM's own server with the actmap plugin
(`actmap.serve.vllm_launch`). Here: the command built from actmap serve's flags against a
hand-written one, the settings the plugin reads back from it, and the flags refused by name.
The launched server itself (a real start through this command, answers, maps, SIGTERM) is in
tests/test_vllm_plugin.py."""

from __future__ import annotations

import json
import sys
from dataclasses import fields

import pytest
from serve_helpers import save_tiny_detector
from typer.testing import CliRunner

import actmap.capture.vllm_engine as vllm_engine
from actmap.cli import app
from actmap.errors import ActmapUserError
from actmap.serve import vllm_launch
from actmap.serve.settings import ServeSettings, VllmSettings
from actmap.serve.vllm_launch import NOT_CARRIED, vllm_server_command
from actmap.serve.vllm_plugin import SETTINGS, plugin_settings

runner = CliRunner()


@pytest.fixture
def model_and_run(tmp_path, monkeypatch):
    """A model folder (vLLM is not started: only a config) and a detector run; vLLM's import
    check passes, so that these tests run where vLLM is not installed too."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    run = tmp_path / "run"
    save_tiny_detector(run)
    monkeypatch.setattr(vllm_engine, "require_vllm", lambda: None)
    return folder, run


def test_the_command_is_vllms_server_with_the_plugin(model_and_run, tmp_path):
    folder, run = model_and_run
    settings = ServeSettings(
        model=str(folder), detector=run, audit=tmp_path / "audit", served_model_name="tiny",
        api_key="secret", max_context=256, max_batch=8, default_max_tokens=12,
        stream_scores=True, score_every=2, vllm=VllmSettings(tensor_parallel_size=2),
    )  # fmt: skip
    command = vllm_server_command(settings, "0.0.0.0", 8123, gpu=False)
    assert command.argv[:-1] == [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
        "--served-model-name", "tiny", "--host", "0.0.0.0", "--port", "8123",
        "--dtype", "float32", "--max-num-seqs", "8", "--tensor-parallel-size", "2",
        "--max-model-len", "256", "--enforce-eager",
        "--worker-extension-cls", "actmap.capture.vllm_worker.ActmapWorker",
        "--middleware", "actmap.serve.vllm_plugin.ActmapMiddleware", "--additional-config",
    ]  # fmt: skip
    options = json.loads(command.argv[-1])
    assert options == {"actmap": {
        "detector": str(run), "audit": str(tmp_path / "audit"), "audit_text": False,
        "review_sample": 0.0, "monitor_window": 50, "device": "cpu", "stream_scores": True,
        "score_every": 2, "max_score_items": 64, "default_max_tokens": 12, "max_tokens_cap": 512,
        "score_route": True,
    }}  # fmt: skip
    # the key goes in vLLM's environment, never on the command line (ps shows that)
    assert command.env == {"VLLM_API_KEY": "secret"}
    assert not any("secret" in part for part in command.argv)
    # the plugin reads back the settings it was given
    read, worker = plugin_settings(options["actmap"], str(folder))
    assert worker == {}
    for name in SETTINGS:
        assert getattr(read, name) == getattr(settings, name), name

    # compiled by default on a GPU; --vllm-eager / --vllm-compile choose; no optional flags
    plain = ServeSettings(model=str(folder), detector=run)
    on_gpu = vllm_server_command(plain, gpu=True).argv
    assert "--enforce-eager" not in on_gpu and "--max-model-len" not in on_gpu
    assert on_gpu[on_gpu.index("--served-model-name") + 1] == str(folder)
    eager = replace_vllm(plain, compile=False)
    assert "--enforce-eager" in vllm_server_command(eager, gpu=True).argv
    assert "--enforce-eager" not in vllm_server_command(replace_vllm(plain, compile=True)).argv
    assert vllm_server_command(plain, gpu=True).env == {}


def replace_vllm(settings: ServeSettings, **kwargs) -> ServeSettings:
    from dataclasses import replace

    return replace(settings, vllm=VllmSettings(**kwargs))


def test_a_gguf_model_is_served_from_its_de_quantized_folder(model_and_run, embedded_gguf):
    """vLLM loads the folder actmap de-quantizes a GGUF file into; the model keeps its name
    for clients, and a detector trained on that GGUF file matches it."""
    from actmap.llm.models import cache_dir, resolve_model

    _, run = model_and_run
    source = resolve_model(str(embedded_gguf))
    path = run / "seed-0" / "config.json"
    config = json.loads(path.read_text())
    generator = {"name": source.name, "revision": source.revision, "gguf_file": source.gguf_file}
    config.setdefault("metadata", {}).setdefault("inputs", {})["store_config"] = {
        "model": generator
    }
    path.write_text(json.dumps(config))
    argv = vllm_server_command(ServeSettings(model=str(embedded_gguf), detector=run)).argv
    folder = cache_dir() / f"{embedded_gguf.stem}-{source.revision}"
    assert argv[argv.index("--model") + 1] == str(folder)
    assert (folder / "config.json").is_file() and "quantization_config" not in json.loads(
        (folder / "config.json").read_text()
    )
    assert argv[argv.index("--served-model-name") + 1] == str(embedded_gguf)


def test_every_serve_setting_is_carried_mapped_or_refused():
    mapped = {"model", "served_model_name", "api_key", "max_context", "max_batch", "dtype", "vllm"}
    refused = {name for name, _, _ in NOT_CARRIED}
    assert not (set(SETTINGS) & refused) and not (mapped & (set(SETTINGS) | refused))
    assert {f.name for f in fields(ServeSettings)} == set(SETTINGS) | refused | mapped


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--queue-size", "3"], "--queue-size"),
        (["--timeout", "5"], "--timeout"),
        (["--batch-window-ms", "1"], "--batch-window-ms"),
        (["--max-body-bytes", "9"], "--max-body-bytes"),
        (["--audit-sync"], "--audit-sync"),
        (["--abstain-message", "no"], "--route-to / --abstain-message"),
        (["--route-to", "http://127.0.0.1:9/v1"], "--route-to / --abstain-message"),
        (["--upstream", "http://127.0.0.1:9/v1"], "--upstream"),
        (["--shutdown-grace", "1"], "--shutdown-grace / --drain-timeout"),
    ],
)
def test_a_flag_the_plugin_does_not_carry_is_refused_by_name(model_and_run, flags, named):
    folder, run = model_and_run
    result = runner.invoke(
        app, ["serve", "--engine", "vllm", "--model", str(folder), "--detector", str(run), *flags]
    )
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and named in lines[0] and "actmap plugin" in lines[0], result.output


def test_refusals_before_vllm_starts(model_and_run, tmp_path):
    folder, run = model_and_run
    with pytest.raises(ActmapUserError, match="--fallback-run"):
        vllm_server_command(ServeSettings(model=str(folder), detector=run), fallback_run=run)
    with pytest.raises(ActmapUserError, match="needs --detector RUN"):
        vllm_server_command(ServeSettings(model=str(folder)))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        vllm_server_command(ServeSettings(model=str(folder), detector=tmp_path / "nowhere"))
    # a detector trained on another generator: refused before vLLM loads anything
    path = run / "seed-0" / "config.json"
    config = json.loads(path.read_text())
    other = {"name": str(tmp_path / "another-model"), "revision": "local", "gguf_file": None}
    config.setdefault("metadata", {}).setdefault("inputs", {})["store_config"] = {"model": other}
    path.write_text(json.dumps(config))
    with pytest.raises(ActmapUserError, match="another-model.*generates with"):
        vllm_server_command(ServeSettings(model=str(folder), detector=run))
    refused = runner.invoke(app, ["serve", "--model", str(folder), "--tensor-parallel-size", "2"])
    assert refused.exit_code == 2 and "--tensor-parallel-size needs --engine vllm" in refused.output


def test_the_cli_becomes_vllms_server(model_and_run, monkeypatch):
    """`actmap serve --engine vllm` prints the command and replaces itself with it."""
    folder, run = model_and_run
    ran = []
    monkeypatch.setattr(vllm_launch, "exec_vllm_server", ran.append)
    result = runner.invoke(
        app, ["serve", "--engine", "vllm", "--model", str(folder), "--detector", str(run),
              "--port", "8123", "--max-tokens", "12", "--vllm-eager", "--api-key", "secret"],
        env={"COLUMNS": "40"},
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    want = vllm_server_command(
        ServeSettings(model=str(folder), detector=run, default_max_tokens=12, api_key="secret",
                      vllm=VllmSettings(compile=False)), port=8123,
    )  # fmt: skip
    assert [c.argv for c in ran] == [want.argv] and ran[0].env == {"VLLM_API_KEY": "secret"}
    assert want.shown() in result.output.splitlines()  # one line, as a shell takes it
