"""`--engine vllm` without vLLM installed: a clear error naming the extra, nothing written
or started."""

from __future__ import annotations

import sys

import pytest

from actmap.capture.vllm_engine import require_vllm
from actmap.errors import ActmapUserError


def test_without_vllm_the_engine_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError
    with pytest.raises(ActmapUserError, match=r"pip install 'actmap\[vllm\]'"):
        require_vllm()


def test_capture_engine_vllm_without_vllm_names_the_extra(monkeypatch, tmp_path, tiny_model_dir):
    from typer.testing import CliRunner

    from actmap.cli import app

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "what is the capital"}\n')
    monkeypatch.setitem(sys.modules, "vllm", None)
    args = ["capture", "--prompts", str(prompts), "--model", str(tiny_model_dir)]
    result = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "s"), "--engine", "vllm"])
    assert result.exit_code == 2 and "pip install 'actmap[vllm]'" in result.output
    assert not (tmp_path / "s").exists()


def test_capture_engine_vllm_refuses_keep_dense(tmp_path, tiny_model_dir):
    pytest.importorskip("vllm", reason="vLLM is not installed")
    from typer.testing import CliRunner

    from actmap.cli import app

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "what is the capital"}\n')
    args = ["capture", "--prompts", str(prompts), "--model", str(tiny_model_dir)]
    result = CliRunner().invoke(
        app, [*args, "--out", str(tmp_path / "s"), "--engine", "vllm", "--keep-dense"]
    )
    assert result.exit_code == 2 and "--engine local" in result.output
    assert not (tmp_path / "s").exists()


def test_serve_engine_vllm_without_vllm_names_the_extra(monkeypatch, tmp_path, tiny_model_dir):
    from serve_helpers import save_tiny_detector
    from typer.testing import CliRunner

    from actmap.cli import app
    from actmap.serve import vllm_launch

    monkeypatch.setitem(sys.modules, "vllm", None)
    monkeypatch.setattr(vllm_launch, "exec_vllm_server", lambda command: pytest.fail("ran"))
    run = save_tiny_detector(tmp_path / "run").parent
    args = ["serve", "--engine", "vllm", "--model", str(tiny_model_dir), "--detector", str(run)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and "pip install 'actmap[vllm]'" in result.output


def test_capture_tensor_parallel_size_reaches_the_vllm_engine(
    monkeypatch, tmp_path, tiny_model_dir
):
    """``--tensor-parallel-size 2`` builds `VllmCapture` with vLLM's ``tensor_parallel_size=2``
    (the engine itself at TP=2: benchmarks/check_vllm_capture_tp.py); refused without
    ``--engine vllm``, before anything is written."""
    pytest.importorskip("vllm", reason="vLLM is not installed")
    from typer.testing import CliRunner

    import actmap.capture.vllm_engine as vllm_engine
    from actmap.cli import app

    built = []

    def engine(model, dtype, options, **kwargs):
        built.append(options.engine_args)
        raise ActmapUserError("built")  # stop before generating

    monkeypatch.setattr(vllm_engine, "VllmCapture", engine)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "what is the capital"}\n')
    args = ["capture", "--prompts", str(prompts), "--model", str(tiny_model_dir),
            "--tensor-parallel-size", "2"]  # fmt: skip
    result = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "v"), "--engine", "vllm"])
    assert result.exit_code == 2 and "built" in result.output
    assert built == [{"tensor_parallel_size": 2}]
    result = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "s")])
    assert result.exit_code == 2 and "--tensor-parallel-size needs --engine vllm" in result.output
    assert not (tmp_path / "s").exists() and len(built) == 1
