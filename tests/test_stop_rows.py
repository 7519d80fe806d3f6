"""The two engines' end-token ids and per-row cut are one rule (`actmap.capture.stopping`):
the transformers engine's `stop_ids` / `_split_rows` and the vLLM engine's `end_ids` /
`_record` give what a hand-worked cut gives, row for row."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from actmap.capture.generate import _split_rows, stop_ids
from actmap.capture.records import CaptureConfig
from actmap.capture.stopping import end_token_ids
from actmap.capture.vllm_engine import _record, _Request, end_ids


def test_end_token_ids_takes_ints_lists_and_skips_none():
    sources = [SimpleNamespace(eos_token_id=[7, 9]), None, SimpleNamespace(eos_token_id=3)]
    assert end_token_ids(*sources) == {3, 7, 9}
    assert end_token_ids(SimpleNamespace(eos_token_id=None), object()) == set()


def test_both_engines_read_the_same_end_ids(tmp_path, tiny_llama, word_tokenizer):
    tiny_llama.generation_config.eos_token_id = [1, 5]  # a list, as chat models carry
    folder = tmp_path / "model"
    tiny_llama.save_pretrained(folder)
    word_tokenizer.save_pretrained(folder)
    naive = set()
    for value in (tiny_llama.generation_config.eos_token_id, word_tokenizer.eos_token_id):
        naive |= {value} if isinstance(value, int) else set(value)
    assert naive == {1, 5}
    assert stop_ids(tiny_llama, word_tokenizer) == naive
    assert end_ids(str(folder), word_tokenizer) == naive
    assert end_ids(str(tmp_path / "no-generation-config"), word_tokenizer) == {1}


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# (generated words, stop strings) -> (answer words, answer text, stopped, has stop step),
# worked out by hand: <eos> (id 1) ends a row; a stop string drops the tokens that start at it
CASES = [
    ("paris is the", (), ("paris is the", "paris is the", False, False)),
    ("paris <eos> <pad> <pad>", (), ("paris", "paris", True, True)),
    ("<eos> <pad> <pad>", (), ("", "", True, True)),
    ("paris is rome <eos>", (" rome",), ("paris is", "paris is", True, True)),
    ("rome paris rome <eos>", (" rome",), ("rome paris", "rome paris", True, True)),
    # the word tokenizer decodes "rome" as " rome": that token carries answer text (the
    # space) before the stop string, so it stays, and no later step produced the stop
    ("paris is rome <eos>", ("rome",), ("paris is rome", "paris is ", True, False)),
    ("one two", ("three",), ("one two", "one two", False, False)),
]


@pytest.mark.parametrize(("words", "stops", "expected"), CASES)
def test_both_engines_cut_a_row_as_worked_by_hand(word_tokenizer, words, stops, expected):
    tokenizer = word_tokenizer
    generated = _ids(tokenizer, words)
    steps, layers, dim = len(generated), 2, 3
    pooled = torch.arange(layers * steps * dim, dtype=torch.float32).view(1, layers, steps, dim)
    logprobs = -torch.arange(1, steps + 1, dtype=torch.float32).view(1, steps) / 10
    entropies = torch.arange(1, steps + 1, dtype=torch.float32).view(1, steps) / 100
    recorder = SimpleNamespace(
        pooled=pooled, logprobs=logprobs, entropies=entropies, attention=None, dense=None,
        states=None,
    )  # fmt: skip
    encoded = {"attention_mask": torch.ones(1, 4, dtype=torch.long)}
    ends = {tokenizer.eos_token_id, tokenizer.pad_token_id}
    local = _split_rows(
        recorder, torch.tensor([generated]), encoded, ["q"], tokenizer, ends, stops
    )[0]
    config = CaptureConfig(max_new_tokens=steps, stop_strings=stops, greybox=True)
    request = _Request(
        "r", "q", [5, 6, 7, 8], config, pooled[0].clone(), entropies[0].clone(),
        token_ids=list(generated), logprobs=logprobs[0].tolist(), recorded=steps,
    )  # fmt: skip
    served = _record(request, tokenizer, ends)
    answer_words, text, stopped, has_stop_step = expected
    n = len(_ids(tokenizer, answer_words))
    for generation in (local, served):
        assert generation.token_ids == generated[:n]
        assert generation.answer == text
        assert generation.stopped is stopped
        assert torch.equal(generation.trajectory, pooled[0, :, :n])
        assert torch.equal(generation.logprobs, logprobs[0, :n])
        assert generation.prompt_tokens == 4
        if has_stop_step:  # the stop step's own statistics: step n
            assert generation.extras == {
                "eos_logprob": pytest.approx(float(logprobs[0, n])),
                "eos_entropy": pytest.approx(float(entropies[0, n])),
            }
        else:
            assert generation.extras == {}
