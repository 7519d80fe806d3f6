"""Position states (`actmap.capture.positions`) against an unpadded teacher-forced pass.

Reference: ``output_hidden_states`` of one forward over [prompt; answer] with no padding and
no capture hooks. transformers returns the last layer after the final norm, so the last layer
is read from a forward hook on its block (the state capture records). Tolerance: the stored
states are float16, so atol = rtol = 2e-3 on states of magnitude ~1.
"""

from __future__ import annotations

import pytest
import torch
from test_capture_families import tiny_model

from actmap.capture import (
    CaptureConfig,
    capture_answers,
    find_decoder_layers,
    generate_plain,
    generate_with_capture,
)
from actmap.capture.positions import POSITION_NAMES, position_bytes, position_states

TOL = dict(atol=2e-3, rtol=2e-3)
PROMPTS = ["what is the capital of the river", "red blue", "one two three four five"]


def reference_states(model, tokenizer, prompt: str, answer_ids: list[int]):
    """(L, P + T, D) block outputs from output_hidden_states (+ a hook for the last layer)."""
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    last: list[torch.Tensor] = []
    handle = find_decoder_layers(model)[-1].register_forward_hook(
        lambda m, a, o: last.append(o if isinstance(o, torch.Tensor) else o[0])
    )
    try:
        with torch.no_grad():
            out = model(torch.tensor([prompt_ids + answer_ids]), output_hidden_states=True)
    finally:
        handle.remove()
    hidden = list(out.hidden_states[1:-1]) + last  # L block outputs, before the final norm
    return len(prompt_ids), torch.stack([h[0] for h in hidden])


def expected_positions(hidden: torch.Tensor, p: int, n: int, fed: int) -> torch.Tensor:
    """Hand-indexed: ``fed`` answer tokens' positions were computed (n, or n - 1 when cut)."""
    answer = hidden[:, p : p + fed] if fed else hidden[:, p - 1 : p]
    return torch.stack([hidden[:, p - 1], answer[:, 0], answer[:, -1], answer.mean(1)])


def eos_after_two_steps(model, tokenizer):
    """Make the token row 0 generates at step 2 an end-of-sequence token: some rows stop,
    others run to max_new_tokens."""
    plain = generate_plain(model, tokenizer, PROMPTS, CaptureConfig(max_new_tokens=6))
    width = plain.shape[1] - 6
    model.generation_config.eos_token_id = int(plain[0, width + 2])


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
def test_generation_positions_equal_a_teacher_forced_pass(family, word_tokenizer):
    model = tiny_model(family, word_tokenizer)
    eos_after_two_steps(model, word_tokenizer)
    config = CaptureConfig(max_new_tokens=6, batch_size=3, keep_positions=True)
    records = generate_with_capture(model, word_tokenizer, PROMPTS, config)
    layers, width = len(find_decoder_layers(model)), model.config.hidden_size
    assert any(r.stopped for r in records) and not all(r.stopped for r in records)
    for r in [r for r in records if r.n_tokens]:
        assert r.positions.shape == (len(POSITION_NAMES), layers, width)
        assert r.positions.dtype == torch.float16
        p, hidden = reference_states(model, word_tokenizer, r.prompt, r.token_ids)
        fed = r.n_tokens if r.stopped else r.n_tokens - 1  # a cut answer never fed its last
        want = expected_positions(hidden, p, r.n_tokens, fed)
        torch.testing.assert_close(r.positions.float(), want, **TOL)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_teacher_forced_capture_gives_the_same_positions(family, word_tokenizer):
    model = tiny_model(family, word_tokenizer)
    answers = [[5, 9, 11, 7], [12], [8, 8, 3]]  # ragged: right padding inside the batch
    config = CaptureConfig(batch_size=3, keep_positions=True)
    records = capture_answers(model, word_tokenizer, PROMPTS, answers, config)
    for r, ids in zip(records, answers, strict=True):
        p, hidden = reference_states(model, word_tokenizer, r.prompt, ids)
        want = expected_positions(hidden, p, len(ids), len(ids))  # every token was fed
        torch.testing.assert_close(r.positions.float(), want, **TOL)


def test_position_states_by_hand():
    states = torch.arange(2 * 5 * 3, dtype=torch.float32).reshape(2, 5, 3)  # (L, S, D)
    got = position_states(states, 4)  # S = T + 1: every answer token was fed
    assert torch.equal(got[0], states[:, 0].half())
    assert torch.equal(got[1], states[:, 1].half())
    assert torch.equal(got[2], states[:, 4].half())
    assert torch.equal(got[3], states[:, 1:5].mean(1).half())
    cut = position_states(states[:, :2], 2)  # cut at max_new_tokens: token 1 never fed
    assert torch.equal(cut[2], states[:, 1].half()) and torch.equal(cut[3], states[:, 1].half())
    alone = position_states(states[:, :1], 1)  # nothing fed: the last prompt state
    assert torch.equal(alone[1], states[:, 0].half())
    assert position_bytes(28, 1536) == 4 * 28 * 1536 * 2
    with pytest.raises(ValueError, match="at least|>= 1"):
        position_states(states, 0)


def test_positions_go_through_the_store(tmp_path, tiny_llama, word_tokenizer):
    from test_capture_run import SOURCE, WordTask

    from actmap.capture.from_store import read_generations
    from actmap.capture.run import run_capture, store_config
    from actmap.maps import MapConfig
    from actmap.store import MapStore

    task = WordTask(6)
    config = CaptureConfig(max_new_tokens=5, batch_size=3, keep_positions=True)
    store = MapStore.create(tmp_path, store_config(task, SOURCE, config, MapConfig(), {}))
    run_capture(tiny_llama, word_tokenizer, SOURCE, task, task.examples, store, config)
    ids = store.metadata()["id"].tolist()
    direct = generate_with_capture(
        tiny_llama, word_tokenizer, [e.question for e in task.examples], config
    )
    by_id = {f"words:{e.source_key}": r for e, r in zip(task.examples, direct, strict=True)}
    for key, read in zip(ids, read_generations(store, ids, with_positions=True), strict=True):
        # other batches (the run sorts by prompt length): the same to float16 rounding
        torch.testing.assert_close(read.positions, by_id[key].positions.float(), **TOL)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
def test_teacher_forcing_with_a_shared_prefix_gives_the_same_capture(family, word_tokenizer):
    model = tiny_model(family, word_tokenizer)
    head = "what is the capital of the river and the city "
    prompts = [head + "red blue", head + "one two three four", head + "who"]
    answers = [[5, 9, 11, 7], [12], [8, 8, 3]]
    plain = CaptureConfig(batch_size=3, keep_positions=True, attention_keys=2)
    shared = CaptureConfig(batch_size=3, keep_positions=True, attention_keys=2, share_prefix=4)
    a = capture_answers(model, word_tokenizer, prompts, answers, plain)
    b = capture_answers(model, word_tokenizer, prompts, answers, shared)
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids and x.prompt_tokens == y.prompt_tokens
        torch.testing.assert_close(y.trajectory, x.trajectory, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(y.logprobs, x.logprobs, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(y.attention, x.attention, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(y.positions.float(), x.positions.float(), **TOL)


def test_states_past_float16s_range_are_saturated_not_infinite(
    tiny_llama, word_tokenizer, tmp_path
):
    """Gemma-3-270M's residual stream passes 65,504 at some layers: a plain float16 cast stored
    inf, and every probe fit on that column gave NaN. Capture saturates instead, in generation
    and in teacher forcing; a store written before is read back saturated, and NaN is named."""
    import copy

    import numpy as np
    import pyarrow as pa

    from actmap.capture.forced import capture_answers_batch
    from actmap.detectors.inputs import read_positions
    from actmap.maps import FLOAT16_MAX, saturated_float16
    from actmap.store import MapStore
    from actmap.store.encoding import encode_array

    got = saturated_float16(torch.tensor([1e6, -7e4, 1.5, float("nan")]))
    assert got[:3].tolist() == [FLOAT16_MAX, -FLOAT16_MAX, 1.5] and got[3].isnan()

    loud = copy.deepcopy(tiny_llama)  # the embedding carries the stream past float16's range
    with torch.no_grad():
        loud.get_input_embeddings().weight.mul_(1e7)
    prompt, config = "what is the capital of", CaptureConfig(max_new_tokens=3, keep_positions=True)
    (generated,) = generate_with_capture(loud, word_tokenizer, [prompt], config)
    (forced,) = capture_answers_batch(loud, word_tokenizer, [prompt], [generated.token_ids], config)
    p, hidden = reference_states(loud, word_tokenizer, prompt, generated.token_ids)
    assert hidden.abs().max() > 2 * FLOAT16_MAX  # the float32 states do leave the range
    n = generated.n_tokens
    fed = {"generated": n if generated.stopped else n - 1, "forced": n}  # as the tests above
    for name, positions in (("generated", generated.positions), ("forced", forced.positions)):
        assert torch.isfinite(positions).all(), name
        # every step's state is kept saturated, so the answer mean is the mean of those
        want = expected_positions(hidden.clamp(-FLOAT16_MAX, FLOAT16_MAX), p, n, fed[name])
        # float16's spacing near its top is 32: a stored step is off by up to 16
        torch.testing.assert_close(positions.float(), want, atol=16, rtol=TOL["rtol"])

    store = MapStore.create(tmp_path, {})
    old = np.full((4, 2, 3), 1.0, dtype=np.float32)
    old[3, 1, 2] = np.inf  # what a plain cast stored
    nan = old.copy()
    nan[0, 0, 0] = np.nan
    table = pa.table({
        "id": ["old", "nan"], "shape": pa.array([[4, 2, 3]] * 2, pa.list_(pa.int32())),
        "positions": [encode_array(old), encode_array(nan)],
    })  # fmt: skip
    store.write_table("positions", table)
    read = read_positions(store, ["old"])
    assert read[0, 3, 1, 2] == FLOAT16_MAX and np.isfinite(read).all()
    with pytest.raises(ValueError, match=r"1 rows have NaN position states, e\.g\. \['nan'\]"):
        read_positions(store, ["old", "nan"])
