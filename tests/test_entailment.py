"""Entailment judges: NLI label mapping, LLM prompt/decoding/parsing, the prompt-keyed cache."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from actmap.baselines.base import BaselineUnavailable
from actmap.baselines.entailment import (
    CONTRADICTION,
    ENTAILMENT,
    NEUTRAL,
    CachedJudge,
    LLMEntailmentJudge,
    NLIJudge,
    SameAnswerJudge,
    entailment_prompt,
    nli_label_map,
    parse_entailment,
)

QUESTION = "what is the capital of france ?"


# -- parsing and prompt ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "response, label",
    [
        ("Entailment.", ENTAILMENT),
        (" NEUTRAL", NEUTRAL),
        ("contradiction", CONTRADICTION),
        ("Contradiction, not entailment", ENTAILMENT),  # entailment is checked first
        ("neutral or contradiction", NEUTRAL),  # neutral before contradiction
        ("The two answers are in contradiction", NEUTRAL),  # the label starts after char 30
        ("", NEUTRAL),
        ("yes", NEUTRAL),
    ],
)
def test_parse_entailment(response, label):
    assert parse_entailment(response) == label


def test_entailment_prompt_shape():
    lines = entailment_prompt("Q?", "Paris", "London").split("\n")
    assert lines == [
        'We are evaluating answers to the question "Q?"',
        "Here are two possible answers:",
        "Possible Answer 1: Paris",
        "Possible Answer 2: London",
        (
            "Does Possible Answer 1 semantically entail Possible Answer 2? "
            "Respond only with entailment, contradiction, or neutral."
        ),
        "Response:",
    ]


# -- LLM judge ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smol_tokenizer(embedded_tokenizer):
    return embedded_tokenizer


def forced_llama(tokenizer, prompt_last_id: int, response_ids: list[int]):
    """A tiny random Llama whose greedy continuation is ``response_ids`` then EOS.

    Its blocks add nothing to the residual stream, so the logits depend only on
    the current token; the LM head maps each chain token to its successor.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    chain = [prompt_last_id, *response_ids, tokenizer.eos_token_id]
    assert len(set(chain[:-1])) == len(chain) - 1
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        head.zero_()
        for a, b in itertools.pairwise(chain):
            head[b] += 10 * emb[a] / emb[a].norm()
    return model


def _last_prompt_id(tokenizer, judge: LLMEntailmentJudge) -> int:
    text = judge.render("Paris", "London", QUESTION)
    return tokenizer(text, add_special_tokens=not judge.use_chat_template)["input_ids"][-1]


@pytest.mark.parametrize(
    "response, label",
    [("Entailment", ENTAILMENT), ("Contradiction.", CONTRADICTION), ("Paris", NEUTRAL)],
)
@pytest.mark.parametrize("chat", [True, False])
def test_llm_judge_decodes_greedily_and_parses(smol_tokenizer, response, label, chat):
    probe = LLMEntailmentJudge(
        forced_llama(smol_tokenizer, 0, []), smol_tokenizer, "tiny", use_chat_template=chat
    )
    ids = smol_tokenizer(response, add_special_tokens=False)["input_ids"]
    model = forced_llama(smol_tokenizer, _last_prompt_id(smol_tokenizer, probe), ids)
    judge = LLMEntailmentJudge(model, smol_tokenizer, "tiny", use_chat_template=chat)
    assert judge.respond("Paris", "London", QUESTION) == response
    assert judge.check_implication("Paris", "London", QUESTION) == label
    assert judge.name == "llm:tiny"


def test_llm_judge_prompt_and_template(smol_tokenizer):
    model = forced_llama(smol_tokenizer, 0, [])
    chat = LLMEntailmentJudge(model, smol_tokenizer, "tiny")
    raw = LLMEntailmentJudge(model, smol_tokenizer, "tiny", use_chat_template=False)
    prompt = entailment_prompt(QUESTION, "Paris", "London")
    assert raw.render("Paris", "London", QUESTION) == prompt
    templated = chat.render("Paris", "London", QUESTION)
    assert chat.use_chat_template and prompt in templated
    assert templated.endswith("<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="question"):
        chat.check_implication("Paris", "London", None)


# -- same-answer judge -------------------------------------------------------------------------
def _same_answer_model(tokenizer, answer: str):
    """A forced Llama whose next token after the same-answer prompt is ``answer``'s first."""
    probe = SameAnswerJudge(forced_llama(tokenizer, 0, []), tokenizer, "tiny")
    text = probe.render("Paris", "London", QUESTION)
    last = tokenizer(text, add_special_tokens=False)["input_ids"][-1]
    first = tokenizer(answer, add_special_tokens=False)["input_ids"][0]
    return forced_llama(tokenizer, last, [first])


@pytest.mark.parametrize("answer, label", [("yes", ENTAILMENT), ("No", CONTRADICTION)])
def test_same_answer_judge_reads_yes_against_no(smol_tokenizer, answer, label):
    """The verdict is the sign of log p(yes) - log p(no), each side summed over its lower- and
    capitalised first token; checked against the probabilities summed by hand."""
    model = _same_answer_model(smol_tokenizer, answer)
    judge = SameAnswerJudge(model, smol_tokenizer, "tiny")
    assert judge.check_implication("Paris", "London", QUESTION) == label
    text = judge.render("Paris", "London", QUESTION)
    ids = smol_tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        probs = model(ids).logits[0, -1].double().softmax(-1)
    first = {
        w: smol_tokenizer(w, add_special_tokens=False)["input_ids"][0]
        for w in ("yes", "Yes", "no", "No")
    }
    p_yes = sum(probs[first[w]] for w in {"yes", "Yes"})
    p_no = sum(probs[first[w]] for w in {"no", "No"})
    expected = float(torch.log(p_yes) - torch.log(p_no))
    assert judge.margin("Paris", "London", QUESTION) == pytest.approx(expected, abs=1e-4)
    assert (expected > 0) == (label == ENTAILMENT)


def test_same_answer_judge_prompt_name_and_question(smol_tokenizer):
    model = forced_llama(smol_tokenizer, 0, [])
    judge = SameAnswerJudge(model, smol_tokenizer, "tiny")
    templated = judge.render("Paris", "London", QUESTION)
    assert templated.endswith("<|im_start|>assistant\n")
    assert f"Question: {QUESTION}\nAnswer 1: Paris\nAnswer 2: London\n" in templated
    assert judge.name == "llm-same:tiny"
    with pytest.raises(ValueError, match="question-conditioned"):
        judge.check_implication("Paris", "London", None)
    bare = SameAnswerJudge(
        model, smol_tokenizer, "tiny", condition_on_question=False, use_chat_template=False
    )
    assert bare.name == "llm-same:tiny:unconditioned"
    assert bare.render("Paris", "London", None) == (
        "Answer 1: Paris\nAnswer 2: London\n"
        "Do the two answers name the same thing? Respond only with yes or no.\nResponse:"
    )
    # its verdicts are cached apart from the entailment judge's on the same texts
    entail = CachedJudge(LLMEntailmentJudge(model, smol_tokenizer, "tiny"))
    assert CachedJudge(judge).key("Paris", "London", QUESTION) != entail.key(
        "Paris", "London", QUESTION
    )


def test_load_llm_judge_prompt(embedded_gguf, tiny_model_dir):
    from actmap.baselines.entailment import load_llm_judge
    from actmap.baselines.options import BaselineOptions
    from actmap.errors import ActmapUserError

    same = load_llm_judge(str(embedded_gguf), prompt="same_answer")
    assert isinstance(same, SameAnswerJudge)
    # the baselines' options reach the judge SE loads, behind the store's verdict cache
    from types import SimpleNamespace

    from actmap.baselines.inputs import StoreInputs

    options = BaselineOptions(judge=str(embedded_gguf), judge_prompt="same_answer", device="cpu")
    cached = StoreInputs(SimpleNamespace(root=tiny_model_dir), options, {}).entailment_judge()
    assert isinstance(cached.judge, SameAnswerJudge) and cached.name == same.name
    assert cached.path == tiny_model_dir / "judge-cache.json"
    assert same.name == f"llm-same:{embedded_gguf.stem}"
    assert same.check_implication("Paris", "Paris", QUESTION) in (ENTAILMENT, CONTRADICTION)
    # a tokenizer that cannot tell yes from no (both unknown words) is refused
    with pytest.raises(ValueError, match="starts 'yes' and 'no' with one token"):
        load_llm_judge(str(tiny_model_dir), prompt="same_answer")
    with pytest.raises(ValueError, match="judge prompt must be one of"):
        load_llm_judge(str(tiny_model_dir), prompt="nli")
    with pytest.raises(ActmapUserError, match="judge_prompt must be one of"):
        BaselineOptions(judge_prompt="yes-no")


# -- NLI judge ---------------------------------------------------------------------------------
WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "paris", "london", "is", "the", "capital",
         "of", "france", "what", "?", "a", "city"]  # fmt: skip


def _save_nli(tmp_path, id2label, seed=0, bias_label=None):
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizer

    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=len(WORDS),
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        num_labels=3,
        id2label=id2label,
        label2id={v: k for k, v in id2label.items()},
    )
    model = BertForSequenceClassification(config).eval()
    if bias_label is not None:
        with torch.no_grad():
            model.classifier.weight.zero_()
            model.classifier.bias.zero_()
            model.classifier.bias[bias_label] = 5.0
    BertTokenizer(vocab={w: i for i, w in enumerate(WORDS)}).save_pretrained(tmp_path)
    model.save_pretrained(tmp_path)
    return tmp_path


PERMUTED = {0: "ENTAILMENT", 1: "NEUTRAL", 2: "CONTRADICTION"}


@pytest.mark.parametrize("output_id, expected", [(0, ENTAILMENT), (1, NEUTRAL), (2, CONTRADICTION)])
def test_nli_labels_mapped_by_name(tmp_path, output_id, expected):
    judge = NLIJudge.from_pretrained(str(_save_nli(tmp_path, PERMUTED, bias_label=output_id)))
    assert judge.check_implication("paris", "london", QUESTION) == expected
    assert judge.name == f"nli:{tmp_path.name}"


@pytest.mark.parametrize("conditioned", [True, False])
def test_nli_matches_direct_forward(tmp_path, conditioned):
    from transformers import AutoModelForSequenceClassification, BertTokenizer

    path = _save_nli(tmp_path, PERMUTED, seed=3)
    judge = NLIJudge.from_pretrained(str(path), condition_on_question=conditioned)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    tokenizer = BertTokenizer(vocab={w: i for i, w in enumerate(WORDS)})
    to_actmap = {0: ENTAILMENT, 1: NEUTRAL, 2: CONTRADICTION}
    pairs = [
        ("paris", "london"),
        ("london", "paris"),
        ("a city", "paris is a city"),
        ("the capital", "?"),
    ]
    for answer_1, answer_2 in pairs:
        premise, hypothesis = answer_1, answer_2
        if conditioned:
            premise, hypothesis = f"{QUESTION} {answer_1}", f"{QUESTION} {answer_2}"
        with torch.no_grad():
            logits = model(**tokenizer(premise, hypothesis, return_tensors="pt")).logits[0]
        expected = to_actmap[int(logits.argmax())]
        assert judge.check_implication(answer_1, answer_2, QUESTION) == expected
        assert judge.render(answer_1, answer_2, QUESTION) == json.dumps([premise, hypothesis])


def test_nli_rejects_unnamed_labels_and_missing_question(tmp_path):
    with pytest.raises(ValueError, match="id2label"):
        nli_label_map({0: "LABEL_0", 1: "LABEL_1", 2: "LABEL_2"})
    assert nli_label_map({"0": "contradiction", "1": "neutral", "2": "entailment"}) == {
        0: 0,
        1: 1,
        2: 2,
    }
    judge = NLIJudge.from_pretrained(str(_save_nli(tmp_path, PERMUTED)))
    with pytest.raises(ValueError, match="question"):
        judge.check_implication("paris", "london", None)


def test_nli_never_trusts_remote_code(tmp_path, monkeypatch):
    import transformers

    path = _save_nli(tmp_path, PERMUTED)
    seen = {}
    real = transformers.AutoModelForSequenceClassification.from_pretrained

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForSequenceClassification, "from_pretrained", spy)
    NLIJudge.from_pretrained(str(path))
    assert seen["trust_remote_code"] is False


def test_nli_missing_weights_unavailable(tmp_path):
    with pytest.raises(BaselineUnavailable, match="NLI model"):
        NLIJudge.from_pretrained(str(tmp_path / "absent"))


# -- cache -------------------------------------------------------------------------------------
class CountingJudge:
    """Test double: entailment iff both texts share their first word."""

    def __init__(self, name="stub"):
        self.name = name
        self.calls = 0

    def check_implication(self, premise_text, hypothesis_text, question=None):
        self.calls += 1
        return (
            ENTAILMENT if premise_text.split()[0] == hypothesis_text.split()[0] else CONTRADICTION
        )


class Exploding(CountingJudge):
    def check_implication(self, premise_text, hypothesis_text, question=None):
        raise AssertionError("the cache should have answered")


def test_cache_answers_each_prompt_once_and_persists_as_json(tmp_path):
    path = tmp_path / "judge-cache.json"
    inner = CountingJudge()
    cached = CachedJudge(inner, path)
    assert cached.check_implication("paris x", "paris y", "q") == ENTAILMENT
    assert cached.check_implication("paris x", "paris y", "q") == ENTAILMENT
    assert cached.check_implication("paris x", "london", "q") == CONTRADICTION
    assert cached.check_implication("paris x", "paris y", "other q") == ENTAILMENT
    assert (inner.calls, cached.hits, cached.misses) == (3, 1, 3)
    cached.save()
    data = json.loads(path.read_text())
    assert data["judge"] == "stub" and sorted(data["labels"].values()) == [0, 2, 2]

    reloaded = CachedJudge(Exploding(), path)
    assert reloaded.check_implication("paris x", "london", "q") == CONTRADICTION
    assert reloaded.check_implication("paris x", "paris y", "other q") == ENTAILMENT
    with pytest.raises(ValueError, match="belongs to judge 'stub'"):
        CachedJudge(CountingJudge("llm:other"), path)


def test_cache_saves_itself_when_a_new_answer_comes_after_its_interval(tmp_path):
    """A killed run keeps the answers judged up to the last timed save; a cache read from
    disk holds them."""
    path = tmp_path / "judge-cache.json"
    never = CachedJudge(CountingJudge(), path, save_every_s=None)
    never.check_implication("paris x", "paris y", "q")
    assert not path.exists()
    hourly = CachedJudge(CountingJudge(), path, save_every_s=3600)
    hourly.check_implication("paris x", "paris y", "q")
    assert not path.exists()
    every = CachedJudge(CountingJudge(), path, save_every_s=0)
    every.check_implication("paris x", "paris y", "q")
    every.check_implication("paris x", "paris y", "q")  # a hit: nothing new to save
    every.check_implication("rome x", "london", "q")
    assert len(CachedJudge(Exploding(), path).labels) == 2
    assert CachedJudge(Exploding(), path).check_implication("rome x", "london", "q") == 0


def test_cache_key_is_the_full_prompt(smol_tokenizer):
    model = forced_llama(smol_tokenizer, 0, [])
    chat = CachedJudge(LLMEntailmentJudge(model, smol_tokenizer, "tiny"))
    raw = CachedJudge(LLMEntailmentJudge(model, smol_tokenizer, "tiny", use_chat_template=False))
    assert chat.name == raw.name == "llm:tiny"
    # same judge name and texts, different full prompts -> different keys
    assert chat.key("Paris", "London", QUESTION) != raw.key("Paris", "London", QUESTION)
    assert chat.key("Paris", "London", QUESTION) != chat.key("London", "Paris", QUESTION)
    with pytest.raises(ValueError, match="no path"):
        chat.save()


def test_a_bfloat16_entailment_judge_is_named_apart(tiny_model_dir):
    """SE's LLM judge loads in the dtype asked; a non-float32 one has its own name, so its
    cached verdicts never answer for the float32 judge; a dtype we do not know is refused."""
    from actmap.baselines.entailment import load_llm_judge
    from actmap.baselines.options import BaselineOptions
    from actmap.errors import ActmapUserError

    full = load_llm_judge(str(tiny_model_dir))
    half = load_llm_judge(str(tiny_model_dir), dtype="bfloat16")
    assert half.name == full.name + "@bfloat16"
    assert {p.dtype for p in half.model.parameters()} == {torch.bfloat16}
    assert half.check_implication("paris", "paris", "what is the capital") in (0, 1, 2)
    with pytest.raises(ActmapUserError, match="dtype must be one of"):
        BaselineOptions(judge_dtype="int8")


@pytest.mark.parametrize("chat", [True, False])
def test_same_answer_judge_runs_a_question_prefix_once_with_full_pass_margins(smol_tokenizer, chat):
    """Pairs of one question share the prompt up to "Answer 1:": it runs once, each pair runs
    its rest, and every margin equals one full forward pass over the pair's whole prompt."""
    from conftest import make_tiny_llama

    # attention live (unlike forced_llama): the cache must be right
    model = make_tiny_llama(len(smol_tokenizer), layers=2, seed=1)
    judge = SameAnswerJudge(model, smol_tokenizer, "tiny", use_chat_template=chat)
    pairs = [
        ("Paris", "the capital of France", QUESTION),
        ("Lyon", "Paris", QUESTION),
        ("Paris, France", "Paris", QUESTION),
        ("Jupiter", "Saturn", "Which is the largest planet?"),  # a new question: a new prefix
        ("London", "Paris", QUESTION),
    ]
    first = {
        w: smol_tokenizer(w, add_special_tokens=False)["input_ids"][0]
        for w in ("yes", "Yes", "no", "No")
    }

    def reference(a, b, q):
        text = judge.render(a, b, q)
        ids = smol_tokenizer(text, add_special_tokens=not chat, return_tensors="pt")
        with torch.no_grad():
            logp = model(ids["input_ids"]).logits[0, -1].double().log_softmax(-1)
        yes = torch.logsumexp(logp[[first["yes"], first["Yes"]]], 0)
        no = torch.logsumexp(logp[[first["no"], first["No"]]], 0)
        return float(yes - no), ids["input_ids"].shape[1]

    expected = [reference(*p) for p in pairs]
    lengths = []
    handle = model.register_forward_pre_hook(
        lambda m, args, kwargs: lengths.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    try:
        got = [judge.margin(*p) for p in pairs]
    finally:
        handle.remove()
    assert got == pytest.approx([e[0] for e in expected], abs=1e-4)
    # three prefix passes (the question changes twice) and five short passes
    shortest = min(n for _, n in expected)
    assert len(lengths) == 3 + 5
    # calls: prefix 0, pairs 1-3 at 1, 2, 3; prefix 4, pair 4 at 5; prefix 6, pair 5 at 7
    prefix_of = {1: 0, 2: 0, 3: 0, 5: 4, 7: 6}
    fed = [lengths[prefix_of[i]] + lengths[i] for i in (1, 2, 3, 5, 7)]
    assert fed == [n for _, n in expected]  # prefix + rest is each whole prompt, no fallback
    assert max(lengths[i] for i in prefix_of) < shortest
