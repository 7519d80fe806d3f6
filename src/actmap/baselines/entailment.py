"""Entailment judges for Semantic Entropy's clustering (BASELINES.md decision 5, B2 step 4).

One small interface, ``check_implication(premise, hypothesis, question) ->
0 | 1 | 2`` (contradiction, neutral, entailment), with three implementations:

- `NLIJudge`: a sequence-classification NLI model (``microsoft/deberta-large-mnli``
  or any local folder), label ids read from ``config.id2label`` by name.
- `LLMEntailmentJudge`: any causal LM asked the Nature prompt, greedy decoding.
- `SameAnswerJudge`: any causal LM asked whether two answers to the question name
  the same thing, read from one forward pass (yes vs no). Small offline LLMs answer
  the Nature prompt "neutral" whatever the pair (Qwen2.5-Coder-1.5B did for every
  one of 120 real TriviaQA pairs); see docs/data.md for the check behind this judge.

`CachedJudge` wraps either with a cache keyed by a hash of the judge's name
and its full input, kept in memory and optionally in a JSON file. Every judge
has a ``name`` that results record (``"llm:qwen2.5-coder-1.5b-instruct"``).
No NLI weights exist offline here, so real runs default to the LLM judge.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path
from typing import Protocol

import torch

from actmap.atomic import atomic_write_text
from actmap.baselines.base import BaselineUnavailable
from actmap.llm.models import dtype_tag, load_model
from actmap.llm.prefix_cache import PrefixCache

log = logging.getLogger(__name__)

CONTRADICTION, NEUTRAL, ENTAILMENT = 0, 1, 2
DEFAULT_NLI_MODEL = "microsoft/deberta-large-mnli"  # Kuhn 2023 and LM-Polygraph's choice
# Judges by short name: GGUF files in the folder the `get-model` fetcher fills by default.
# Qwen2.5-Coder-1.5B-Instruct is the strongest instruction-tuned LLM that runs offline here.
LLM_JUDGES = {
    "qwen2.5-coder-1.5b-instruct": "~/.cache/actmap-models/qwen2.5-coder-1.5b-instruct.gguf",
    "qwen2.5-coder-0.5b-instruct": "~/.cache/actmap-models/qwen2.5-coder-0.5b-instruct.gguf",
}
DEFAULT_LLM_JUDGE = LLM_JUDGES["qwen2.5-coder-1.5b-instruct"]


class EntailmentJudge(Protocol):
    """Does ``premise_text`` entail ``hypothesis_text``? 0 contradiction, 1 neutral, 2 entailment."""

    name: str

    def check_implication(
        self, premise_text: str, hypothesis_text: str, question: str | None = None
    ) -> int: ...


# -- NLI model ---------------------------------------------------------------------------------
_LABEL_PREFIXES = {"contradict": CONTRADICTION, "neutral": NEUTRAL, "entail": ENTAILMENT}


def nli_label_map(id2label: dict) -> dict[int, int]:
    """Model output id -> actmap label, matched on the label names (never assumed by position)."""
    mapping = {}
    for idx, label in id2label.items():
        for prefix, value in _LABEL_PREFIXES.items():
            if str(label).lower().startswith(prefix):
                mapping[int(idx)] = value
    if sorted(mapping.values()) != [CONTRADICTION, NEUTRAL, ENTAILMENT]:
        raise ValueError(
            f"config.id2label={id2label} does not name exactly one contradiction, "
            "neutral and entailment label"
        )
    return mapping


class NLIJudge:
    """A sequence-classification NLI model; argmax over its three labels."""

    def __init__(
        self,
        model,
        tokenizer,
        model_name: str,
        condition_on_question: bool = True,
        max_length: int = 512,
    ) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.condition_on_question = condition_on_question  # Nature code: "{question} {answer}"
        self.max_length = max_length  # tokens of the (premise, hypothesis) pair, truncated beyond
        self.label_map = nli_label_map(model.config.id2label)
        suffix = "" if condition_on_question else ":unconditioned"
        self.name = f"nli:{model_name}{suffix}"

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str = DEFAULT_NLI_MODEL,
        device: str = "cpu",
        revision: str = "main",
        condition_on_question: bool = True,
    ) -> NLIJudge:
        """Load from a hub name or a local folder; never runs remote code."""
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(name_or_path, revision=revision)
            model = AutoModelForSequenceClassification.from_pretrained(
                name_or_path, revision=revision, trust_remote_code=False
            )
        except OSError as err:
            raise BaselineUnavailable(
                f"NLI model '{name_or_path}' cannot be loaded ({err}); pass a local folder "
                "or use the LLM judge"
            ) from err
        return cls(model.to(device), tokenizer, Path(name_or_path).name, condition_on_question)

    def inputs(
        self, premise_text: str, hypothesis_text: str, question: str | None
    ) -> tuple[str, str]:
        if not self.condition_on_question:
            return premise_text, hypothesis_text
        if question is None:
            raise ValueError(f"{self.name} is question-conditioned but question is None")
        return f"{question} {premise_text}", f"{question} {hypothesis_text}"

    def render(self, premise_text: str, hypothesis_text: str, question: str | None = None) -> str:
        """The full model input, for cache keys."""
        return json.dumps(self.inputs(premise_text, hypothesis_text, question))

    @torch.inference_mode()
    def check_implication(
        self, premise_text: str, hypothesis_text: str, question: str | None = None
    ) -> int:
        premise, hypothesis = self.inputs(premise_text, hypothesis_text, question)
        device = next(self.model.parameters()).device
        encoded = self.tokenizer(
            premise, hypothesis, return_tensors="pt", truncation=True, max_length=self.max_length
        )
        logits = self.model(**{k: v.to(device) for k, v in encoded.items()}).logits  # (1, 3)
        return self.label_map[int(logits[0].argmax())]


# -- LLM judge ---------------------------------------------------------------------------------
def entailment_prompt(question: str, answer_1: str, answer_2: str) -> str:
    """The Nature code's LLM-judge prompt shape (B2 step 4)."""
    return (
        f'We are evaluating answers to the question "{question}"\n'
        "Here are two possible answers:\n"
        f"Possible Answer 1: {answer_1}\n"
        f"Possible Answer 2: {answer_2}\n"
        "Does Possible Answer 1 semantically entail Possible Answer 2? "
        "Respond only with entailment, contradiction, or neutral.\n"
        "Response:"
    )


def parse_entailment(response: str) -> int:
    """First 30 characters, lower-cased, checked in the Nature code's order; else neutral."""
    head = response.lower()[:30]
    if "entailment" in head:
        return ENTAILMENT
    if "neutral" in head:
        return NEUTRAL
    if "contradiction" in head:
        return CONTRADICTION
    log.debug("judge response %r names no label; taken as neutral", response)
    return NEUTRAL


class _PromptedLLMJudge:
    """A causal LM asked one prompt per answer pair, in its chat template when it has one."""

    def __init__(self, model, tokenizer, model_name: str, use_chat_template: bool | None) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.model_name = model_name
        has_template = bool(getattr(tokenizer, "chat_template", None))
        if use_chat_template and not has_template:
            raise ValueError(
                f"use_chat_template=True but {model_name}'s tokenizer has no chat template"
            )
        self.use_chat_template = has_template if use_chat_template is None else use_chat_template

    def _templated(self, prompt: str, plain_suffix: str = "") -> str:
        if not self.use_chat_template:
            return prompt + plain_suffix
        messages = [{"role": "user", "content": prompt}]
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )

    def _encode(self, text: str) -> dict[str, torch.Tensor]:
        device = next(self.model.parameters()).device
        # a templated prompt already holds its special tokens
        encoded = self.tokenizer(
            text, return_tensors="pt", add_special_tokens=not self.use_chat_template
        )
        return {k: v.to(device) for k, v in encoded.items()}


class LLMEntailmentJudge(_PromptedLLMJudge):
    """Any causal LM answering the Nature prompt, greedily; chat template when it has one."""

    def __init__(
        self,
        model,
        tokenizer,
        model_name: str,
        max_new_tokens: int = 30,
        use_chat_template: bool | None = None,
    ) -> None:
        super().__init__(model, tokenizer, model_name, use_chat_template)
        self.max_new_tokens = max_new_tokens  # Nature code: up to 30 new tokens
        self.name = f"llm:{model_name}"

    def render(self, premise_text: str, hypothesis_text: str, question: str | None = None) -> str:
        """The exact text fed to the model."""
        if question is None:
            raise ValueError(f"{self.name} needs the question; got question=None")
        return self._templated(entailment_prompt(question, premise_text, hypothesis_text))

    @torch.inference_mode()
    def respond(self, premise_text: str, hypothesis_text: str, question: str | None = None) -> str:
        """The model's raw answer to the prompt."""
        encoded = self._encode(self.render(premise_text, hypothesis_text, question))
        pad = self.tokenizer.pad_token_id
        out = self.model.generate(
            **encoded,
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
            max_new_tokens=self.max_new_tokens,
            pad_token_id=self.tokenizer.eos_token_id if pad is None else pad,
        )
        return self.tokenizer.decode(
            out[0, encoded["input_ids"].shape[1] :], skip_special_tokens=True
        )

    def check_implication(
        self, premise_text: str, hypothesis_text: str, question: str | None = None
    ) -> int:
        return parse_entailment(self.respond(premise_text, hypothesis_text, question))


# -- same-answer judge --------------------------------------------------------------------------
_SLOT = "\x00answer\x00"  # marks where the first answer goes when splitting the prompt


def same_answer_prompt(answer_1: str, answer_2: str, question: str | None = None) -> str:
    """Two answers, one yes/no question: do they name the same thing?"""
    head = "" if question is None else f"Question: {question}\n"
    return (
        f"{head}Answer 1: {answer_1}\nAnswer 2: {answer_2}\n"
        "Do the two answers name the same thing? Respond only with yes or no."
    )


class SameAnswerJudge(_PromptedLLMJudge):
    """Any causal LM asked `same_answer_prompt`; one forward pass, no decoding.

    The verdict is the sign of the margin log p(yes) - log p(no) over the first answer
    token (each side the log-sum of its lower- and capitalised first token): entailment
    when yes wins, else contradiction. The question is in the prompt by default (the
    Nature code conditions on it). Chat template when the tokenizer has one. The prompt up
    to "Answer 1:" is shared by every pair of one question: its key/value cache is kept
    (`PrefixCache`) and each pair runs only the tokens after it."""

    def __init__(
        self,
        model,
        tokenizer,
        model_name: str,
        condition_on_question: bool = True,
        use_chat_template: bool | None = None,
    ) -> None:
        super().__init__(model, tokenizer, model_name, use_chat_template)
        self.condition_on_question = condition_on_question
        self._prefix = PrefixCache(self.model, tokenizer)
        self.yes_ids = self._first_ids("yes", "Yes")
        self.no_ids = self._first_ids("no", "No")
        if set(self.yes_ids) & set(self.no_ids):
            raise ValueError(f"{model_name}'s tokenizer starts 'yes' and 'no' with one token")
        suffix = "" if condition_on_question else ":unconditioned"
        self.name = f"llm-same:{model_name}{suffix}"

    def _first_ids(self, *words: str) -> list[int]:
        return sorted({self.tokenizer(w, add_special_tokens=False)["input_ids"][0] for w in words})

    def render(self, premise_text: str, hypothesis_text: str, question: str | None = None) -> str:
        """The exact text fed to the model."""
        if self.condition_on_question and question is None:
            raise ValueError(f"{self.name} is question-conditioned but question is None")
        asked = question if self.condition_on_question else None
        prompt = same_answer_prompt(premise_text, hypothesis_text, asked)
        return self._templated(prompt, plain_suffix="\nResponse:")

    @torch.inference_mode()
    def margin(self, premise_text: str, hypothesis_text: str, question: str | None = None) -> float:
        """log p(yes) - log p(no) for the first answer token."""
        # every pair of one question shares the prompt up to "Answer 1:"; run that once
        head, tail = self.render(_SLOT, hypothesis_text, question).split(_SLOT)
        text = head + premise_text + tail  # the prompt `render` gives, rendered once
        logits = self._prefix.last_logits(head.rstrip(" "), text, not self.use_chat_template)
        logp = torch.log_softmax(logits, dim=-1)
        yes = torch.logsumexp(logp[self.yes_ids], dim=0)
        no = torch.logsumexp(logp[self.no_ids], dim=0)
        return float(yes - no)

    def check_implication(
        self, premise_text: str, hypothesis_text: str, question: str | None = None
    ) -> int:
        yes = self.margin(premise_text, hypothesis_text, question) > 0
        return ENTAILMENT if yes else CONTRADICTION


JUDGE_PROMPTS = ("entailment", "same_answer")  # LLMEntailmentJudge, SameAnswerJudge


def load_llm_judge(
    name: str = DEFAULT_LLM_JUDGE,
    device: str = "cpu",
    dtype: str = "float32",
    prompt: str = "entailment",
) -> LLMEntailmentJudge | SameAnswerJudge:
    """The LLM judge from a short name, a ``.gguf`` path, a local folder or a hub id; a dtype
    other than float32 is part of its name (its cached verdicts are its own). ``prompt``:
    "entailment" (the Nature prompt, `LLMEntailmentJudge`) or "same_answer"
    (`SameAnswerJudge`)."""

    if prompt not in JUDGE_PROMPTS:
        raise ValueError(f"judge prompt must be one of {JUDGE_PROMPTS}, got {prompt!r}")

    name = LLM_JUDGES.get(name, name)

    try:
        model, tokenizer, source = load_model(name, device=device, dtype=dtype)
    except (FileNotFoundError, OSError) as err:
        raise BaselineUnavailable(
            f"LLM judge '{name}' cannot be loaded ({err}); "
            "fetch it with `get-model qwen2.5-coder-1.5b-instruct` or pass --judge with a local "
            "folder or .gguf file of an instruction-tuned LLM"
        ) from err
    label = Path(source.gguf_file).stem if source.gguf_file else Path(source.name).name
    kind = SameAnswerJudge if prompt == "same_answer" else LLMEntailmentJudge
    return kind(model, tokenizer, label + dtype_tag(dtype))


# -- cache -------------------------------------------------------------------------------------
class CachedJudge:
    """Answers each distinct full prompt once; JSON persistence when ``path`` is given.

    With a path the cache also saves itself after a new answer once ``save_every_s`` seconds
    have passed since the last save: a run killed between its own saves (a judge call takes
    seconds on a CPU, a row of Semantic Entropy up to a minute) loses at most that much."""

    def __init__(
        self,
        judge: EntailmentJudge,
        path: str | Path | None = None,
        save_every_s: float | None = 60.0,
    ) -> None:
        self.judge = judge
        self.path = Path(path) if path is not None else None
        self.save_every_s = save_every_s
        self.labels: dict[str, int] = {}
        self.hits = 0
        self.misses = 0
        self._saved_at = time.monotonic()
        if self.path is not None and self.path.exists():
            self._load(self.path)

    @property
    def name(self) -> str:
        return self.judge.name

    def key(self, premise_text: str, hypothesis_text: str, question: str | None = None) -> str:
        render = getattr(self.judge, "render", None)
        if render is not None:
            text = render(premise_text, hypothesis_text, question)
        else:
            text = json.dumps([question, premise_text, hypothesis_text])
        return hashlib.sha256(f"{self.name}\n{text}".encode()).hexdigest()

    def check_implication(
        self, premise_text: str, hypothesis_text: str, question: str | None = None
    ) -> int:
        key = self.key(premise_text, hypothesis_text, question)
        if key in self.labels:
            self.hits += 1
            return self.labels[key]
        self.misses += 1
        label = int(self.judge.check_implication(premise_text, hypothesis_text, question))
        self.labels[key] = label
        due = self.save_every_s is not None and (
            time.monotonic() - self._saved_at >= self.save_every_s
        )
        if self.path is not None and due:
            self.save()
        return label

    def save(self) -> None:
        """Write the cache atomically (temporary file, then rename)."""
        if self.path is None:
            raise ValueError("CachedJudge has no path to save to")
        atomic_write_text(self.path, json.dumps({"judge": self.name, "labels": self.labels}))
        self._saved_at = time.monotonic()

    def _load(self, path: Path) -> None:
        data = json.loads(path.read_text())
        if data.get("judge") != self.name:
            raise ValueError(
                f"cache {path} belongs to judge {data.get('judge')!r}, not {self.name!r}"
            )
        labels = data.get("labels", {})
        bad = {k: v for k, v in labels.items() if v not in (CONTRADICTION, NEUTRAL, ENTAILMENT)}
        if bad:
            raise ValueError(f"cache {path} holds labels outside 0/1/2: {list(bad.items())[:3]}")
        self.labels = dict(labels)
