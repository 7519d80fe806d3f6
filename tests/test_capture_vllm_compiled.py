"""Capture inside a compiled vLLM model (real SmolLM2-135M, float32, CPU).

vLLM's CPU build compiles the model with Dynamo once (``DYNAMO_TRACE_ONCE``) and then calls
the traced code without guards: a Python hook added after that never runs. The capture's
record points go in while the model loads and call an opaque custom op, so the compiled
forward keeps calling them. Here the engine is built with ``enforce_eager=False`` and
vLLM's CPU test setting (``VLLM_CPU_CI_ENV=1``: Dynamo traces the model, the graph runs
without Inductor, which would take minutes on two cores); the maps must equal the
transformers capture's to the tolerance of tests/test_capture_vllm.py. Inductor itself is
exercised by ``benchmarks/check_vllm_equality.py --compiled`` (docs/vllm.md).
"""

from __future__ import annotations

import os

import pytest
import torch

from actmap.capture.generate import generate_batch
from actmap.capture.records import CaptureConfig
from actmap.errors import ActmapUserError

pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'actmap[vllm]')")
pytestmark = pytest.mark.vllm

CONFIG = CaptureConfig(max_new_tokens=10, max_context=512)
QUESTIONS = [
    "What is the capital of France?",
    "What is 17 + 25?",
    "Name a primary colour.",
]


@pytest.fixture(scope="module")
def compiled_engine(embedded_gguf):
    import vllm.envs

    from actmap.capture.vllm_engine import VllmCapture, VllmOptions

    saved = os.environ.get("VLLM_CPU_CI_ENV")
    os.environ["VLLM_CPU_CI_ENV"] = "1"
    vllm.envs.disable_envs_cache()  # an earlier engine in this process froze the settings
    try:
        capture = VllmCapture(
            str(embedded_gguf), options=VllmOptions(max_num_seqs=8, enforce_eager=False),
            max_context=512,
        )  # fmt: skip
        # vLLM's CPU test setting also skips the warm-up that traces the model on its generic
        # shape; traced on a 1-token first request instead, vLLM itself corrupts memory on
        # the next batch (seen with plain vLLM 0.32, no capture). Warm it up as it would be.
        capture.engine.collective_rpc(_warm_up)
    finally:
        if saved is None:
            os.environ.pop("VLLM_CPU_CI_ENV", None)
        else:
            os.environ["VLLM_CPU_CI_ENV"] = saved
    yield capture
    capture.close()


def _warm_up(worker) -> None:
    worker.model_runner.warming_up_model()


def test_the_model_is_compiled_with_the_record_op_as_a_split_point(compiled_engine):
    from vllm.config import CompilationMode

    config = compiled_engine.engine.vllm_config.compilation_config
    assert config.mode == CompilationMode.DYNAMO_TRACE_ONCE
    assert "actmap::record_layer" in config.splitting_ops
    assert "actmap::record_attention" in config.splitting_ops
    model = compiled_engine.recorder.model
    traced = [m for m in model.modules() if getattr(m, "compiled", False)]
    assert traced, "no module of the vLLM model was compiled"
    # what a hook put in after compilation sees: nothing (the traced forward runs instead)
    calls = []
    layer = next(m for m in model.modules() if hasattr(m, "_actmap_sink"))
    handle = layer.register_forward_hook(lambda *args: calls.append(1))
    try:
        (generation,) = compiled_engine.generate(["Hello"], CONFIG)
    finally:
        handle.remove()
    assert calls == []
    assert generation.token_ids and generation.trajectory.abs().sum() > 0


def test_compiled_capture_equals_transformers(compiled_engine, smollm2):
    model, tokenizer, _ = smollm2
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
        )
        for q in QUESTIONS
    ]
    config = CaptureConfig(
        max_new_tokens=10, max_context=512, keep_positions=True, attention_keys=4,
        lookback_attention=True,
    )  # fmt: skip
    got = compiled_engine.generate(prompts, config)  # three in flight together
    want = generate_batch(model, tokenizer, prompts, config)
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids, (g.answer, w.answer)
        assert g.trajectory.shape == w.trajectory.shape
        torch.testing.assert_close(g.trajectory, w.trajectory, rtol=1e-4, atol=2e-3)
        torch.testing.assert_close(g.logprobs, w.logprobs, rtol=0, atol=1e-4)
        torch.testing.assert_close(g.entropies, w.entropies, rtol=0, atol=1e-4)
        torch.testing.assert_close(g.positions.float(), w.positions.float(), rtol=2e-3, atol=2e-3)
        torch.testing.assert_close(g.attention, w.attention, rtol=1e-4, atol=1e-5)


def test_a_second_engine_in_the_process_is_refused(compiled_engine, embedded_gguf):
    from actmap.capture.vllm_engine import VllmCapture

    with pytest.raises(ActmapUserError, match="one vLLM capture engine per process"):
        VllmCapture(str(embedded_gguf))


def test_full_cuda_graphs_are_refused_and_the_op_splits_the_graph():
    from vllm.config import CompilationConfig

    from actmap.capture.vllm_engine import _compilation_config

    with pytest.raises(ActmapUserError, match="cudagraph_mode=FULL"):
        _compilation_config({"compilation_config": {"cudagraph_mode": "FULL"}})
    config = _compilation_config({})
    assert config["cudagraph_mode"] == "PIECEWISE"
    ours = ["actmap::record_layer", "actmap::record_attention"]
    assert config["splitting_ops"] == [*CompilationConfig._attention_ops, *ours]
    mine = _compilation_config({"compilation_config": {"splitting_ops": ["vllm::x"]}})
    assert mine["splitting_ops"] == ["vllm::x", *ours]
