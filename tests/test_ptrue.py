"""P(True): prompt text, target token, and the probability read from one forward pass."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from actmap.baselines.ptrue import (
    PTRUE_TEMPLATE,
    PTrue,
    PTrueInput,
    target_token_id,
    verification_text,
)

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tokenizer(embedded_tokenizer):
    return embedded_tokenizer


@pytest.fixture(scope="module")
def model(tokenizer):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return transformers.LlamaForCausalLM(config).eval()


ROWS = [
    PTrueInput("What is the capital of France?", " Paris"),
    PTrueInput("Who wrote the novel War and Peace, published in 1869?", " Leo Tolstoy"),
    PTrueInput("2+2?", "4"),
]


def test_prompt_is_lm_polygraph_shape_verbatim(tokenizer):
    text = verification_text(tokenizer, "Q?", "A", PTRUE_TEMPLATE, use_chat=False)
    assert text == (
        "Question: Q?\n Possible answer:A\n Is the possible answer:\n"
        " (A) True\n (B) False\n The possible answer is:"
    )
    chat = verification_text(tokenizer, "Q?", "A", PTRUE_TEMPLATE, use_chat=True)
    assert (
        chat.startswith("<|im_start|>")
        and text in chat
        and chat.endswith("<|im_start|>assistant\n")
    )


def test_chat_kwargs_reach_the_chat_template():
    class RecordingTokenizer:
        def apply_chat_template(self, messages, **kwargs):
            self.messages, self.kwargs = messages, kwargs
            return "templated"

    rec = RecordingTokenizer()
    out = verification_text(rec, "Q?", "A", PTRUE_TEMPLATE, True, {"enable_thinking": False})
    assert out == "templated" and rec.kwargs["enable_thinking"] is False
    assert rec.kwargs["add_generation_prompt"] is True
    content = PTRUE_TEMPLATE.format(question="Q?", answer="A")
    assert rec.messages == [{"role": "user", "content": content}]


def test_target_token_is_single_and_falls_back_to_leading_space(tokenizer):
    tid, used = target_token_id(tokenizer, "True")
    assert used == "True"
    assert tokenizer("True", add_special_tokens=False)["input_ids"] == [tid]
    tid, used = target_token_id(tokenizer, "banana")  # "banana" is two tokens, " banana" one
    assert used == " banana"
    assert tokenizer(" banana", add_special_tokens=False)["input_ids"] == [tid]
    with pytest.raises(ValueError, match="single token"):
        target_token_id(tokenizer, "Supercalifragilisticexpialidocious")


@pytest.mark.parametrize("use_chat", [True, False])
def test_score_equals_softmax_of_direct_forward(model, tokenizer, use_chat):
    scorer = PTrue(model, tokenizer, use_chat=use_chat, batch_size=1)
    result = scorer.score(ROWS)
    # the assistant turn starts with "True"; the plain prompt's "is:" continues with " True"
    target = "True" if use_chat else " True"
    (true_id,) = tokenizer(target, add_special_tokens=False)["input_ids"]
    for i, row in enumerate(ROWS):
        text = PTRUE_TEMPLATE.format(question=row.question, answer=row.answer)
        if use_chat:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
            )
        ids = tokenizer(text, add_special_tokens=not use_chat, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            logits = model(ids).logits[0, -1].double()
        p_true = torch.softmax(logits, -1)[true_id].item()
        assert result.confidence[i] == pytest.approx(p_true, rel=1e-4)
        assert result.raw[i] == pytest.approx(-np.log(p_true), rel=1e-4)
    assert result.details["target"] == target and result.details["chat_template"] is use_chat
    given = PTrue(model, tokenizer, target="True", use_chat=use_chat).score(ROWS[:1])
    assert given.details["target"] == "True"  # an explicit target is read as given


def test_batched_equals_unbatched(model, tokenizer):
    one = PTrue(model, tokenizer, batch_size=1).score(ROWS).confidence
    batched = PTrue(model, tokenizer, batch_size=3).score(ROWS).confidence
    lengths = {len(PTrue(model, tokenizer).encode(r)) for r in ROWS}
    assert len(lengths) == 3  # the batch really is left-padded
    np.testing.assert_allclose(batched, one, rtol=1e-4)


def test_rows_must_be_ptrue_inputs(model, tokenizer):
    with pytest.raises(TypeError, match="PTrueInput"):
        PTrue(model, tokenizer).score([("q", "a")])
