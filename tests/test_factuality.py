"""CNN/DM factuality: sentence splitting, the all-sentences rule, and the two judges."""

from __future__ import annotations

import warnings

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    T5Config,
    T5ForConditionalGeneration,
)

from actmap.data.factuality import (
    JUDGE_PROMPT,
    FactualityLabel,
    LLMFactualityJudge,
    MiniCheckJudge,
    SummaryFactualityJudge,
    chunk_document,
    judge_summary,
    split_sentences,
    summary_is_factual,
)

WORDS = (
    [
        "<pad>",
        "</s>",
        "[UNK]",
        "<s>",
        "predict:",
        "1",
        "0",
        "Yes",
        "No",
        "Answer:",
        "Document:",
        "Claim:",
        "Is",
        "the",
        "claim",
        "supported",
        "by",
        "document?",
        "with",
        "or",
        "No.",
        "user:",
        "assistant:",
    ]
    + [f"w{i}." for i in range(30)]
    + [f"w{i}" for i in range(30)]
)
CHAT_TEMPLATE = (
    "{% for m in messages %}<s> {{ m['role'] }}: {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}<s> assistant: {% endif %}"
)


def word_tokenizer(chat_template: str | None = None) -> PreTrainedTokenizerFast:
    """A whitespace word-level tokenizer over WORDS (no download)."""
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.decoder = decoders.WordPiece(prefix="##")
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk, unk_token="[UNK]", pad_token="<pad>", eos_token="</s>", bos_token="<s>"
    )
    tok.chat_template = chat_template
    return tok


# ---------------------------------------------------------------- sentences


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("One. Two! Three?", ["One.", "Two!", "Three?"]),
        (
            "Mr. Smith went to Washington. He stayed.",
            ["Mr. Smith went to Washington.", "He stayed."],
        ),
        ("It cost 3.5 million. Then it fell.", ["It cost 3.5 million.", "Then it fell."]),
        ("The U.S. team won. Fans cheered.", ["The U.S. team won.", "Fans cheered."]),
        # known limit: a sentence ending in an abbreviation is joined to the next one
        ("They live in the U.S. Now they rest.", ["They live in the U.S. Now they rest."]),
        ("J. K. Rowling wrote it. Yes.", ["J. K. Rowling wrote it.", "Yes."]),
        ('He said "stop." She left.', ['He said "stop."', "She left."]),
        (
            "Membership gives the ICC jurisdiction .\nIsrael opposed the move .",
            ["Membership gives the ICC jurisdiction .", "Israel opposed the move ."],
        ),
        ("In 1996. The end", ["In 1996.", "The end"]),
        ("No final punctuation", ["No final punctuation"]),
        ("Line one\n\nLine two", ["Line one", "Line two"]),
        ("", []),
        ("   \n  ", []),
    ],
)
def test_split_sentences(text, expected):
    assert split_sentences(text) == expected


def test_chunk_document_packs_whole_sentences():
    doc = "aa bb cc. dd ee. ff gg hh ii. jj."
    # limits of 5 words: [aa bb cc. dd ee.] (5) [ff gg hh ii. jj.] (5)
    assert chunk_document(doc, 5) == ["aa bb cc. dd ee.", "ff gg hh ii. jj."]
    assert chunk_document(doc, 100) == [doc]
    # a sentence longer than the limit forms its own chunk
    assert chunk_document(doc, 2) == ["aa bb cc.", "dd ee.", "ff gg hh ii.", "jj."]
    assert chunk_document("", 5) == [""]


# ---------------------------------------------------------------- the rule


class FakeJudge:
    """Support probabilities by claim, recording every call."""

    name = "fake"

    def __init__(self, support: dict[str, float]):
        self.support = support
        self.calls: list[tuple[str, str]] = []

    def support_probability(self, document: str, claim: str) -> float:
        self.calls.append((document, claim))
        return self.support[claim]


def test_fake_judge_satisfies_protocol():
    assert isinstance(FakeJudge({}), SummaryFactualityJudge)


def test_all_sentences_rule_calls_the_judge_per_sentence():
    judge = FakeJudge({"A is true.": 0.9, "B is true.": 0.5, "C is false.": 0.49})
    assert summary_is_factual(judge, "doc", "A is true. B is true.")
    assert judge.calls == [("doc", "A is true."), ("doc", "B is true.")]
    judge.calls.clear()
    assert not summary_is_factual(judge, "doc", "C is false. A is true.")
    assert judge.calls == [("doc", "C is false.")]  # stops at the first unsupported sentence
    assert summary_is_factual(judge, "doc", "A is true.\nB is true.", threshold=0.5)
    assert not summary_is_factual(judge, "doc", "A is true. B is true.", threshold=0.6)
    assert not summary_is_factual(judge, "doc", "   ")  # no sentence: not factual


def test_judge_summary_records_evidence_and_judge_name():
    judge = FakeJudge({"A is true.": 0.9, "C is false.": 0.2})
    label = judge_summary(judge, "doc", "A is true. C is false.")
    assert label == FactualityLabel(
        factual=False,
        judge="fake",
        threshold=0.5,
        sentences=("A is true.", "C is false."),
        support=(0.9, 0.2),
    )
    assert judge_summary(judge, "doc", "A is true.").factual


# ---------------------------------------------------------------- MiniCheck judge


@pytest.fixture(scope="module")
def tiny_t5():
    torch.manual_seed(0)
    config = T5Config(
        vocab_size=len(WORDS),
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    )
    return T5ForConditionalGeneration(config).eval()


def _minicheck_reference(model, tok, chunk: str, claim: str) -> float:
    """One unpadded forward pass, written out: softmax over the logits of '0' and '1'."""
    ids = tok(f"predict: {chunk}</s>{claim}", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=ids, decoder_input_ids=torch.tensor([[0]])).logits[0, 0]
    no_id, yes_id = WORDS.index("0"), WORDS.index("1")
    return torch.softmax(logits[[no_id, yes_id]], dim=-1)[1].item()


def test_minicheck_judge_matches_reference_and_takes_max_over_chunks(tiny_t5):
    tok = word_tokenizer()
    judge = MiniCheckJudge(tiny_t5, tok, name="minicheck:tiny", chunk_words=3)
    assert (judge.no_id, judge.yes_id) == (WORDS.index("0"), WORDS.index("1"))
    document = "w1 w2 w3. w4 w5. w6 w7 w8. w9."
    chunks = chunk_document(document, 3)
    assert len(chunks) == 4
    probs = judge.chunk_probabilities(document, "w10 w11")
    expected = [_minicheck_reference(tiny_t5, tok, c, "w10 w11") for c in chunks]
    assert probs == pytest.approx(expected, abs=1e-5)  # padded batch == one by one
    assert all(0.0 <= p <= 1.0 for p in probs)
    assert judge.support_probability(document, "w10 w11") == pytest.approx(max(expected), abs=1e-5)
    assert len({round(p, 6) for p in probs}) > 1  # chunks really differ


def test_minicheck_judge_drives_the_summary_rule(tiny_t5):
    judge = MiniCheckJudge(tiny_t5, word_tokenizer(), chunk_words=500)
    document = "w1 w2 w3. w4 w5."
    summary = "w6 w7. w8 w9."
    p = [judge.support_probability(document, s) for s in ["w6 w7.", "w8 w9."]]
    label = judge_summary(judge, document, summary)
    assert label.support == pytest.approx(tuple(p))
    assert label.factual == all(x >= 0.5 for x in p)
    assert label.judge == "minicheck"


# ---------------------------------------------------------------- LLM judge


@pytest.fixture(scope="module")
def tiny_llama():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(WORDS),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    return LlamaForCausalLM(config).eval()


def _llm_reference(model, tok, text: str, special: bool) -> float:
    ids = tok(text, add_special_tokens=special, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        probs = torch.softmax(model(input_ids=ids).logits[0, -1], dim=-1)
    yes, no = probs[WORDS.index("Yes")], probs[WORDS.index("No")]
    return (yes / (yes + no)).item()


def test_llm_judge_with_chat_template_matches_reference(tiny_llama):
    tok = word_tokenizer(CHAT_TEMPLATE)
    judge = LLMFactualityJudge(tiny_llama, tok, name="llm:tiny")
    assert judge.yes_ids == [WORDS.index("Yes")] and judge.no_ids == [WORDS.index("No")]
    content = JUDGE_PROMPT.format(document="w1 w2 w3.", claim="w4 w5.")
    text = f"<s> user: {content} </s> <s> assistant: "
    assert judge.prompt("w1 w2 w3.", "w4 w5.") == text
    p = judge.support_probability("w1 w2 w3.", "w4 w5.")
    assert p == pytest.approx(_llm_reference(tiny_llama, tok, text, special=False), abs=1e-6)
    assert 0.0 <= p <= 1.0


def test_llm_judge_plain_prompt_truncation_and_cache(tiny_llama):
    tok = word_tokenizer()
    judge = LLMFactualityJudge(tiny_llama, tok, max_document_tokens=2)
    text = judge.prompt("w1 w2 w3 w4", "w5.")
    assert text == JUDGE_PROMPT.format(document="w1 w2", claim="w5.") + "\nAnswer:"
    p = judge.support_probability("w1 w2 w3 w4", "w5.")
    assert p == pytest.approx(_llm_reference(tiny_llama, tok, text, special=True), abs=1e-6)
    calls = []
    judge._score = lambda d, c: calls.append((d, c)) or 0.0  # cached pairs never reach it
    assert judge.support_probability("w1 w2 w3 w4", "w5.") == p
    assert calls == []
    assert judge.support_probability("w1 w2 w3 w4", "w6.") == 0.0 and len(calls) == 1


def test_judges_load_from_a_local_path(tmp_path, tiny_t5, tiny_llama):
    tok = word_tokenizer()
    tiny_t5.save_pretrained(tmp_path / "t5")
    tok.save_pretrained(tmp_path / "t5")
    loaded = MiniCheckJudge.from_pretrained(str(tmp_path / "t5"))
    in_memory = MiniCheckJudge(tiny_t5, tok)
    assert loaded.name == f"minicheck:{tmp_path / 't5'}"
    assert loaded.support_probability("w1 w2.", "w3.") == pytest.approx(
        in_memory.support_probability("w1 w2.", "w3."), abs=1e-6
    )
    tiny_llama.save_pretrained(tmp_path / "llm")
    tok.save_pretrained(tmp_path / "llm")
    llm = LLMFactualityJudge.from_pretrained(str(tmp_path / "llm"))
    assert llm.name.startswith("llm:")
    assert llm.support_probability("w1 w2.", "w3.") == pytest.approx(
        LLMFactualityJudge(tiny_llama, tok).support_probability("w1 w2.", "w3."), abs=1e-6
    )


@pytest.mark.parametrize("template", [None, CHAT_TEMPLATE])
def test_llm_judge_reuses_the_document_prefix_exactly(tiny_llama, template, vocabulary_projections):
    tok = word_tokenizer(template)
    judge = LLMFactualityJudge(tiny_llama, tok)
    special = template is None
    pairs = [
        ("w1 w2 w3 w4 w5.", "w6."),
        ("w1 w2 w3 w4 w5.", "w7 w8 w9."),
        ("w1 w2 w3 w4 w5.", "w2 w3."),
        ("w9 w8.", "w1."),  # another document: a new prefix
        ("w1 w2 w3 w4 w5.", "w4."),
    ]
    # reference: one full forward over each whole prompt
    expected = [_llm_reference(tiny_llama, tok, judge.prompt(d, c), special) for d, c in pairs]
    lengths = []  # tokens fed per forward while the judge works
    handle = tiny_llama.register_forward_pre_hook(
        lambda m, args, kwargs: lengths.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    try:
        with (
            warnings.catch_warnings(record=True) as seen,
            vocabulary_projections(tiny_llama) as projected,
        ):
            warnings.simplefilter("always")
            got = [judge.support_probability(d, c) for d, c in pairs]
    finally:
        handle.remove()
    assert got == pytest.approx(expected, abs=1e-5)
    assert projected == [1] * len(lengths)  # the last position only, prefixes included
    assert not [w for w in seen if "past_key_values" in str(w.message)]
    # three prefixes (document changes twice) and five short passes, each shorter than a prompt
    shortest = min(
        len(tok(judge.prompt(d, c), add_special_tokens=special)["input_ids"]) for d, c in pairs
    )
    assert len(lengths) == 3 + 5 and max(lengths) < shortest
