"""Capture inside vLLM against the transformers capture (real SmolLM2-135M, float32).

One in-process vLLM engine for the module, built small on purpose: at most 128 tokens
per step (a long prompt is prefilled in chunks) and a KV cache of 24 blocks of 32
tokens (768 tokens), so 32 requests in flight cannot all fit and vLLM preempts and
recomputes some of them. The reference is `actmap.capture.generate_batch` on the same
model (transformers, left-padded static batch).

Tolerance: greedy tokens must be identical; trajectories, log-probs and entropies agree
to float32 rounding between the two engines' kernels (measured: trajectory entries differ
by at most ~3e-4 on values up to ~140, i.e. ~2e-6 relative; log-probs by ~2e-5). Asserted:
``rtol=1e-4, atol=2e-3`` on trajectories and maps, ``atol=1e-4`` on log-probs and entropies.
"""

from __future__ import annotations

import pytest
import torch

from actmap.capture.generate import generate_batch
from actmap.capture.records import CaptureConfig
from actmap.maps import MapConfig, build_maps_from_list

pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'actmap[vllm]')")
pytestmark = pytest.mark.vllm

MAX_NEW = 12
CONFIG = CaptureConfig(max_new_tokens=MAX_NEW, max_context=512)
QUESTIONS = [
    "What is the capital of France?",
    "What is 17 + 25?",
]
TRAJ_TOL = dict(rtol=1e-4, atol=2e-3)
STAT_TOL = dict(rtol=0, atol=1e-4)


def chat(tokenizer, question: str) -> str:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
    )


@pytest.fixture(scope="module")
def engine(embedded_gguf):
    from actmap.capture.vllm_engine import VllmCapture, VllmOptions

    options = VllmOptions(
        max_num_seqs=32, max_num_batched_tokens=128, block_size=32, num_kv_blocks=24
    )
    capture = VllmCapture(str(embedded_gguf), options=options, max_context=512)
    yield capture
    capture.close()


@pytest.fixture(scope="module")
def reference(smollm2):
    """Transformers capture of prompts, memoised per (prompts, config)."""
    model, tokenizer, _ = smollm2
    cache = {}

    def run(prompts, config=CONFIG):
        key = (tuple(prompts), config)
        if key not in cache:
            cache[key] = generate_batch(model, tokenizer, list(prompts), config)
        return cache[key]

    return run


def assert_same(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids, (g.answer, w.answer)
        assert g.answer == w.answer
        assert g.stopped == w.stopped
        assert g.prompt_tokens == w.prompt_tokens
        assert g.trajectory.shape == w.trajectory.shape
        torch.testing.assert_close(g.trajectory, w.trajectory, **TRAJ_TOL)
        if w.logprobs is not None:
            torch.testing.assert_close(g.logprobs, w.logprobs, **STAT_TOL)
            torch.testing.assert_close(g.entropies, w.entropies, **STAT_TOL)
        assert g.extras.keys() == w.extras.keys()
        for k in w.extras:
            assert g.extras[k] == pytest.approx(w.extras[k], abs=1e-4)
    nonempty = [i for i, w in enumerate(want) if w.n_tokens]
    maps_got = build_maps_from_list([got[i].trajectory for i in nonempty], MapConfig())
    maps_want = build_maps_from_list([want[i].trajectory for i in nonempty], MapConfig())
    torch.testing.assert_close(maps_got, maps_want, **TRAJ_TOL)


def test_two_in_flight_equal_transformers(engine, reference):
    prompts = [chat(engine.tokenizer, q) for q in QUESTIONS]
    got = engine.generate(prompts, CONFIG)
    want = reference(prompts)
    assert [g.answer for g in got] == ["The capital of France is Paris.", "17 + 25 = 32."]
    assert all(g.stopped and g.n_tokens for g in got)
    assert_same(got, want)


def test_thirty_two_in_flight_with_preemption(engine, reference):
    """32 requests share the steps and do not fit the KV cache together: rows do not depend
    on what else was batched, and preempted requests get the rows they get alone."""
    # 23-25 token prompts fill one 32-token block each, then need a second while decoding
    quiz = (
        "Here is a short arithmetic quiz for a school class. Question: what is {} times {}? Answer:"
    )
    prompts = [chat(engine.tokenizer, q) for q in QUESTIONS]
    prompts += [quiz.format(a, a + 3) for a in range(2, 32)]
    recomputed_before = engine.recorder.recomputed
    keys = [engine.submit(p, CONFIG) for p in prompts]
    done = {e.key: e.finished for e in engine.run_until_done() if e.finished is not None}
    got = [done[k] for k in keys]
    assert engine.recorder.recomputed > recomputed_before, "no request was preempted"
    assert_same(got, reference(prompts))
    preempted = [i for i, k in enumerate(keys) if k in engine.recorder.recomputed_keys]
    assert preempted
    for i in preempted[:2]:  # a preempted request alone on the same engine: the same rows
        (alone,) = engine.generate([prompts[i]], CONFIG)
        assert alone.token_ids == got[i].token_ids
        torch.testing.assert_close(alone.trajectory, got[i].trajectory, **TRAJ_TOL)
        torch.testing.assert_close(alone.entropies, got[i].entropies, **STAT_TOL)


def test_long_prompt_prefilled_in_chunks(engine, reference):
    filler = " ".join(f"Item {i} is a {['red', 'blue', 'green'][i % 3]} box." for i in range(40))
    prompt = chat(engine.tokenizer, filler + " What colour is item 7?")
    n_prompt = len(engine.encode([prompt], CONFIG)[0])
    assert n_prompt > 2 * 128  # at least three prefill chunks of 128 tokens
    chunks_before = engine.recorder.steps_with_partial_prefill
    got = engine.generate([prompt], CONFIG)
    assert engine.recorder.steps_with_partial_prefill >= chunks_before + 2
    assert_same(got, reference([prompt]))


def test_stop_strings_cut_like_transformers(engine, reference):
    config = CaptureConfig(max_new_tokens=MAX_NEW, max_context=512, stop_strings=(" is", "\n"))
    prompts = ["The capital of France", "Q: What is 2 + 2?\nA:"]
    got = engine.generate(prompts, config)
    want = reference(prompts, config)
    assert any(w.stopped and "eos_logprob" in w.extras for w in want)
    assert_same(got, want)


def test_position_states_equal_transformers(engine, reference):
    """keep_positions: the (4, L, D) float16 states at the named positions equal the
    transformers capture's (float16 storage: rtol = atol = 2e-3), for answers ended by the end
    token, by a stop string and by max_new_tokens, while a request that keeps no positions
    shares the steps."""
    config = CaptureConfig(
        max_new_tokens=MAX_NEW, max_context=512, keep_positions=True, stop_strings=(" is",)
    )
    prompts = [chat(engine.tokenizer, q) for q in QUESTIONS]
    prompts += ["The capital of France", "Count slowly: one, two, three,"]
    beside = engine.submit(chat(engine.tokenizer, "Name a fruit."), CONFIG)
    got = engine.generate(prompts, config)
    want = reference(prompts, config)
    assert beside not in engine._requests  # finished in the same run, without positions
    assert {(w.stopped, "eos_logprob" in w.extras) for w in want} >= {(True, True), (False, False)}
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids, (g.answer, w.answer)
        assert g.positions.shape == w.positions.shape == (4, 30, 576)
        assert g.positions.dtype == torch.float16
        torch.testing.assert_close(g.positions.float(), w.positions.float(), rtol=2e-3, atol=2e-3)


def test_abort_leaves_no_partial_map(engine, reference):
    prompts = [chat(engine.tokenizer, q) for q in QUESTIONS]
    config = CONFIG
    keys = [engine.submit(p, config) for p in prompts]
    finished, seen = {}, 0
    while engine.busy:
        for event in engine.step():
            seen += event.key == keys[1] and bool(event.new_token_ids)
            if event.finished is not None:
                finished[event.key] = event.finished
        if seen >= 3 and keys[1] in engine._requests:
            engine.abort(keys[1])  # mid-answer: three tokens out
    assert set(finished) == {keys[0]}
    assert not engine.recorder.requests and not engine.recorder.pending
    assert_same([finished[keys[0]]], reference(prompts)[:1])


def test_a_request_in_flight_and_cut_give_the_rows_so_far(engine, reference):
    """`in_flight` reads the worker's rows in place (``actmap_peek``) and `cut` takes them and
    ends the request: the answer so far, whose tokens, rows and log-probs are the first ones of
    the transformers capture's answer; nothing is left in flight."""
    prompt = chat(engine.tokenizer, QUESTIONS[0])
    (want,) = reference([prompt])
    key = engine.submit(prompt, CONFIG)
    assert engine.in_flight(key) is None  # vLLM has not scheduled it yet
    for _ in range(4):
        engine.step()
    so_far = engine.in_flight(key)
    n = so_far.n_tokens
    assert 0 < n < want.n_tokens and not so_far.stopped
    assert so_far.token_ids == want.token_ids[:n]
    torch.testing.assert_close(so_far.trajectory, want.trajectory[:, :n], **TRAJ_TOL)
    torch.testing.assert_close(so_far.logprobs, want.logprobs[:n], **STAT_TOL)
    engine.step()
    cut = engine.cut(key)
    assert cut.n_tokens == n + 1 and cut.token_ids == want.token_ids[: n + 1]
    torch.testing.assert_close(cut.trajectory, want.trajectory[:, : n + 1], **TRAJ_TOL)
    assert not engine.busy and engine.in_flight(key) is None
    assert not engine.recorder.requests


def test_map_only_requests_skip_statistics(engine, reference):
    """Run twice: the second run is a prefix-cache hit (vLLM skips the cached first 32-token
    block; rows start at the last prompt position, never inside a cached block)."""
    config = CaptureConfig(max_new_tokens=MAX_NEW, max_context=512, greybox=False)
    prompts = [chat(engine.tokenizer, QUESTIONS[0])]
    (first,) = engine.generate(prompts, config)
    hits = engine.recorder.prefix_cache_hits
    (got,) = engine.generate(prompts, config)
    assert engine.recorder.prefix_cache_hits == hits + 1
    assert got.token_ids == first.token_ids
    torch.testing.assert_close(got.trajectory, first.trajectory, **TRAJ_TOL)
    assert got.logprobs is None and got.entropies is None and got.extras == {}
    (want,) = reference(prompts)
    assert got.token_ids == want.token_ids
    torch.testing.assert_close(got.trajectory, want.trajectory, **TRAJ_TOL)


def test_unsupported_settings_are_refused(engine):
    from actmap.errors import ActmapUserError

    with pytest.raises(ActmapUserError, match="keep_dense"):
        engine.submit("hello", CaptureConfig(max_new_tokens=4, keep_dense=True))


def test_full_preset_inputs_equal_transformers(engine, reference):
    """What actmap-plus:full reads (maps, scalars, position states and the lookback attention
    of K = 10 previous answer tokens) equals the transformers capture's, while a request that
    keeps no attention shares the steps (tests/test_capture_vllm_attention.py: the same on
    tiny models, with preemption, the store and a fitted detector). Attention entries:
    ``atol=1e-5``."""
    from actmap.capture.needs import CAPTURE_NEEDS

    config = CaptureConfig(
        max_new_tokens=MAX_NEW, max_context=512, **CAPTURE_NEEDS["actmap-plus:full"]
    )
    assert config.attention_keys == 10 and config.lookback_attention and config.keep_positions
    prompts = [chat(engine.tokenizer, q) for q in QUESTIONS]
    prompts += ["Count slowly: one, two, three,"]
    beside = engine.submit(chat(engine.tokenizer, "Name a fruit."), CONFIG)
    got = engine.generate(prompts, config)
    want = reference(prompts, config)
    assert beside not in engine._requests
    assert max(w.n_tokens for w in want) > 10  # an answer longer than K
    assert_same(got, want)
    for g, w in zip(got, want, strict=True):
        assert g.attention.shape == w.attention.shape == (w.n_tokens, 30, 9, 10)
        torch.testing.assert_close(g.attention, w.attention, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(g.positions.float(), w.positions.float(), rtol=2e-3, atol=2e-3)


class Killed(Exception):
    pass


def test_store_run_killed_and_resumed_matches_the_local_engine(engine, smollm2, tmp_path):
    """`run_capture_vllm` writes the local engine's store: the same ids, answers, labels and
    maps; a run killed after one committed batch resumes without repeating or losing an id;
    the manifest records the engine."""
    import numpy as np
    from test_capture_run import WordTask

    from actmap.capture.run import run_capture, store_config
    from actmap.capture.vllm_run import run_capture_vllm
    from actmap.store import MapStore

    model, tokenizer, source = smollm2
    task = WordTask(9)
    config = CaptureConfig(max_new_tokens=5, batch_size=3, max_context=512)

    def new_store(name):
        return MapStore.create(tmp_path / name, store_config(task, source, config, MapConfig(), {}))

    store = new_store("vllm")
    committed = []

    def die_after_one_batch(n):
        committed.append(n)
        raise Killed

    with pytest.raises(Killed):
        run_capture_vllm(
            engine, engine.tokenizer, source, task, task.examples, store, config,
            progress=die_after_one_batch,
        )  # fmt: skip
    assert not engine.busy  # the dead run's requests in flight were aborted
    store = MapStore.open(store.root)
    assert len(store.ids()) == 3
    summary = run_capture_vllm(engine, engine.tokenizer, source, task, task.examples, store, config)
    assert summary.skipped_existing == 3 and summary.written + summary.skipped_empty == 6
    store = MapStore.open(store.root)
    assert store.manifest["runs"][-1]["engine"]["name"] == "vllm"

    local = new_store("local")
    run_capture(model, tokenizer, source, task, task.examples, local, config)

    def rows(s):
        maps, meta = s.load_maps()
        order = np.argsort(meta["id"].to_numpy())
        return maps[order], meta.iloc[order].reset_index(drop=True)

    (vm, vmeta), (lm, lmeta) = rows(store), rows(local)
    for column in ("id", "split", "answer", "n_tokens", "label", "prompt"):
        assert vmeta[column].tolist() == lmeta[column].tolist(), column
    np.testing.assert_allclose(vm.astype(np.float32), lm.astype(np.float32), atol=2e-3)
    assert store.ids("skipped") == local.ids("skipped")


def test_cli_capture_engine_vllm_writes_a_resumable_store(
    engine, embedded_gguf, tmp_path, monkeypatch
):
    """`actmap capture --engine vllm` end to end (the module's engine stands in for the one
    the command would build: one engine per process): a store with the engine recorded, and
    a second run finds nothing left to do."""
    import json

    from typer.testing import CliRunner

    import actmap.capture.vllm_engine as vllm_engine
    from actmap.cli import app
    from actmap.store import MapStore

    built = []

    def reuse(model, dtype, options, **kwargs):
        built.append((model, dtype, options.max_num_seqs, options.enforce_eager, kwargs["greybox"]))
        return engine

    monkeypatch.setattr(vllm_engine, "VllmCapture", reuse)
    prompts = tmp_path / "prompts.jsonl"
    questions = ["What is the capital of Italy?", "Name a fruit.", "What is 3 + 4?"]
    prompts.write_text("".join(json.dumps({"prompt": q}) + "\n" for q in questions))
    args = [
        "capture",
        "--prompts",
        str(prompts),
        "--model",
        str(embedded_gguf),
        "--engine",
        "vllm",
        "--batch-size",
        "2",
        "--max-new-tokens",
        "6",
        "--out",
        str(tmp_path / "s"),
    ]
    result = CliRunner().invoke(app, [*args, "--vllm-eager"])
    assert result.exit_code == 0, result.output
    assert built == [(str(embedded_gguf), "float32", 2, True, True)]
    store = MapStore.open(tmp_path / "s")
    assert len(store.ids()) + len(store.ids("skipped")) == 3
    assert store.manifest["runs"][-1]["engine"]["name"] == "vllm"
    again = CliRunner().invoke(app, args)
    assert again.exit_code == 0 and "nothing to capture" in again.output


def test_recording_switched_off_and_on(engine, reference):
    """Off: vLLM runs a request of its own with the record points returning at once (nothing
    recorded); on again: capture as before."""
    from vllm import SamplingParams

    from actmap.capture import vllm_engine

    prompt = chat(engine.tokenizer, QUESTIONS[1])
    ids = engine.encode([prompt], CONFIG)[0]
    engine.set_recording(False)
    try:
        assert engine.recorder not in vllm_engine._ACTIVE
        before = engine.recorder.buffer.clone()
        params = SamplingParams(max_tokens=4, temperature=0.0)
        engine.engine.add_request("plain-0", {"prompt_token_ids": ids}, params)
        while engine.engine.has_unfinished_requests():
            engine.engine.step()
        assert torch.equal(engine.recorder.buffer, before)
    finally:
        engine.set_recording(True)
    assert_same(engine.generate([prompt], CONFIG), reference([prompt]))


def test_teacher_forced_reading_equals_capture_answers(engine, smollm2, monkeypatch):
    """`VllmCapture.read`: a (prompt, answer) pair read as one prefill of prompt + answer, rows
    from the answer's positions, against the transformers teacher-forced capture
    (`capture_answers`, one pair per pass: the same prompt truncation): the same tokens, answer
    text and cut, trajectories and maps (``TRAJ_TOL``), log-probs, entropies and the end
    token's extras (``STAT_TOL``). One answer is long enough that its prefill crosses a
    128-token chunk (the engine's ``max_num_batched_tokens``); one is token ids; one is
    empty (no rows; the end token's extras only). Read twice with prefix caching on (the
    engine's default): the second reading is no cache hit (each reading has its own
    ``cache_salt``) and gives the same rows. The forced rows' logits are computed 16 rows at a
    time here (`FORCED_LOGIT_ROWS`), so the long answer's take several pieces."""
    from actmap.capture import vllm_engine
    from actmap.capture.forced import capture_answers

    monkeypatch.setattr(vllm_engine, "FORCED_LOGIT_ROWS", 16)

    model, tokenizer, _ = smollm2
    config = CaptureConfig(max_new_tokens=MAX_NEW, max_context=512)
    long_answer = " ".join(f"Step {i}: add {i} to the total." for i in range(12))
    prompts = [chat(tokenizer, q) for q in (*QUESTIONS, "Count to twenty in steps.", "Hi")]
    answers = [
        "The capital of France is Paris.",
        tokenizer("17 + 25 = 42.", add_special_tokens=False)["input_ids"],
        long_answer,
        "",
    ]
    want = [capture_answers(model, tokenizer, [p], [a], config)[0]
            for p, a in zip(prompts, answers, strict=True)]  # fmt: skip
    hits = engine.recorder.prefix_cache_hits
    got = engine.read(prompts, answers, config)
    assert [g.n_tokens for g in got][3] == 0 and got[2].n_tokens > 100
    assert_same(got, want)
    assert all(w.extras and g.extras for g, w in zip(got, want, strict=True))
    pairs = [(g, w) for g, w in zip(got, want, strict=True) if w.n_tokens]
    print(
        "reading vs capture_answers: trajectory max abs diff "
        f"{max(float((g.trajectory - w.trajectory).abs().max()) for g, w in pairs):.2e} "
        f"(values up to {max(float(w.trajectory.abs().max()) for _, w in pairs):.0f}), log-prob "
        f"{max(float((g.logprobs - w.logprobs).abs().max()) for g, w in pairs):.2e}, entropy "
        f"{max(float((g.entropies - w.entropies).abs().max()) for g, w in pairs):.2e}, end extras "
        f"{max(abs(g.extras[k] - w.extras[k]) for g, w in zip(got, want, strict=True) for k in w.extras):.2e}"
    )
    # the long reading alone: its prefill takes more than one 128-token step
    key, steps, done = engine.submit_read(prompts[2], long_answer, config), 0, None
    while done is None:
        steps += 1
        done = next((e.finished for e in engine.step() if e.key == key and e.finished), None)
    assert steps >= 2 and got[2].prompt_tokens + got[2].n_tokens > 128
    again = engine.read(prompts[:2], answers[:2], config)
    assert engine.recorder.prefix_cache_hits == hits
    assert_same([done, *again], [want[2], *want[:2]])
    # map-only readings skip the statistics
    (bare,) = engine.read(prompts[:1], answers[:1], CaptureConfig(max_context=512, greybox=False))
    assert bare.logprobs is None and bare.extras == {}
    torch.testing.assert_close(bare.trajectory, want[0].trajectory, **TRAJ_TOL)


def test_a_reading_longer_than_the_context_is_refused(engine):
    from actmap.errors import ActmapUserError

    # the answer alone leaves no room for the prompt (a longer prompt keeps its last tokens,
    # as the transformers capture's does)
    with pytest.raises(ActmapUserError, match=r"answer \(511 tokens\) exceed .* 512 tokens"):
        engine.read(["Hello"], [list(range(10, 521))], CaptureConfig(max_context=512))
    assert not engine.busy


def test_a_step_whose_record_points_do_not_run_raises(engine):
    """What a model replayed from full CUDA graphs would look like to the capture: a layer's
    record point does not run. The step fails loudly instead of returning empty rows. (Last
    in the module: the engine is not used after a failed step.)"""
    engine.recorder.model._actmap_hooks.pop().remove()  # the last layer never records
    engine.submit(chat(engine.tokenizer, QUESTIONS[0]), CONFIG)
    with pytest.raises(RuntimeError, match="recorded 29 of 30 layers"):
        while engine.busy:
            engine.step()
