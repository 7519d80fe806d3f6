"""CNN/DailyMail summary factuality: the MiniCheck rule behind one small judge interface.

Rule (paper): split the summary into sentences, ask a judge for the probability that the
source article supports each sentence, and call the summary factual iff every sentence
is supported at probability >= 0.5. An empty summary (no sentence) is labelled not
factual: a degenerate generation is not a usable summary.

Two judges implement ``SummaryFactualityJudge``:

- ``MiniCheckJudge``: a MiniCheck Flan-T5 checkpoint (seq2seq) loaded from a local path
  or a hub name. It reads the article in chunks of about 500 words (whole sentences),
  scores each chunk and keeps the highest support probability, as MiniCheck does.
- ``LLMFactualityJudge``: any causal LM with a yes/no question (the offline judge is
  Qwen2.5-Coder-1.5B-Instruct).

Labels of two judges are never mixed in one table: every ``FactualityLabel`` carries
its judge's name.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from actmap.data.prompts import has_chat_template, render_chat
from actmap.errors import ActmapUserError
from actmap.llm.models import DTYPES, dtype_tag, load_model, resolve_model
from actmap.llm.prefix_cache import PrefixCache

logger = logging.getLogger(__name__)

SUPPORT_THRESHOLD = 0.5  # MiniCheck / paper: a sentence is supported at p >= 0.5


@runtime_checkable
class SummaryFactualityJudge(Protocol):
    """Anything that scores how well a document supports one claim sentence."""

    name: str  # recorded with every label

    def support_probability(self, document: str, claim: str) -> float: ...


# Abbreviations whose period does not end a sentence.
_ABBREVIATIONS = frozenset(
    {
        "mr",
        "mrs",
        "ms",
        "dr",
        "prof",
        "sr",
        "jr",
        "st",
        "mt",
        "vs",
        "etc",
        "inc",
        "ltd",
        "co",
        "corp",
        "gov",
        "sen",
        "rep",
        "gen",
        "col",
        "lt",
        "sgt",
        "capt",
        "no",
        "jan",
        "feb",
        "mar",
        "apr",
        "jun",
        "jul",
        "aug",
        "sep",
        "sept",
        "oct",
        "nov",
        "dec",
        "e.g",
        "i.e",
        "u.s",
        "u.k",
        "a.m",
        "p.m",
    }
)
# A candidate boundary: end punctuation, optional closing quotes/brackets, then whitespace.
_BOUNDARY = re.compile(r"[.!?]+['\"’”)\]]*\s+")


def _ends_with_abbreviation(chunk: str) -> bool:
    words = chunk.rstrip().rstrip("'\"’”)]").split()
    if not words:
        return False
    last = words[-1].lower().rstrip(".")
    # single capital letters ("J. K. Rowling") are initials, not sentence ends
    return last in _ABBREVIATIONS or (len(last) == 1 and last.isalpha())


def split_sentences(text: str) -> list[str]:
    """Sentences of ``text``: split at newlines and after ., ! or ? followed by whitespace.

    A period after a known abbreviation ("Mr.", "U.S.") or an initial ("J.") does not end
    a sentence; neither does a decimal point ("3.5"), since no whitespace follows it.
    CNN/DM's detached periods ("in June .") end sentences like attached ones.
    """
    sentences: list[str] = []
    for line in text.splitlines():
        start = 0
        for m in _BOUNDARY.finditer(line):
            piece = line[start : m.end()]
            if m.group().startswith(".") and _ends_with_abbreviation(line[start : m.start() + 1]):
                continue
            if piece.strip():
                sentences.append(piece.strip())
            start = m.end()
        if line[start:].strip():
            sentences.append(line[start:].strip())
    return sentences


@dataclass(frozen=True)
class FactualityLabel:
    """A summary's factuality label and the judge evidence behind it."""

    factual: bool  # every sentence supported at >= threshold (False for no sentence)
    judge: str  # the judge's name; never mix judges in one table
    threshold: float
    sentences: tuple[str, ...]
    support: tuple[float, ...]  # one probability per sentence scored (all, unless early stop)


def judge_summary(
    judge: SummaryFactualityJudge,
    article: str,
    summary: str,
    threshold: float = SUPPORT_THRESHOLD,
    early_stop: bool = False,
) -> FactualityLabel:
    """Score the sentences of ``summary`` against ``article`` and apply the MiniCheck rule.

    ``early_stop`` stops at the first sentence below the threshold (the label is known
    then); ``support`` then holds the sentences scored so far.
    """
    sentences = tuple(split_sentences(summary))
    support: list[float] = []
    for sentence in sentences:
        support.append(float(judge.support_probability(article, sentence)))
        if early_stop and support[-1] < threshold:
            break
    factual = bool(sentences) and all(p >= threshold for p in support)
    return FactualityLabel(factual, judge.name, threshold, sentences, tuple(support))


def summary_is_factual(
    judge: SummaryFactualityJudge,
    article: str,
    summary: str,
    threshold: float = SUPPORT_THRESHOLD,
) -> bool:
    """True iff every sentence is supported at >= threshold; stops at the first that is not."""
    return judge_summary(judge, article, summary, threshold, early_stop=True).factual


def chunk_document(document: str, max_words: int) -> list[str]:
    """Whole sentences of ``document`` packed into chunks of at most ~``max_words`` words.

    A single sentence longer than the limit forms its own chunk.
    """
    chunks: list[str] = []
    current: list[str] = []
    n_words = 0
    for sentence in split_sentences(document) or [""]:
        n = len(sentence.split())
        if current and n_words + n > max_words:
            chunks.append(" ".join(current))
            current, n_words = [], 0
        current.append(sentence)
        n_words += n
    chunks.append(" ".join(current))
    return [c for c in chunks if c] or [""]


def _first_token_ids(tokenizer, words: Sequence[str]) -> list[int]:
    ids: list[int] = []
    for w in words:
        tokens = tokenizer(w, add_special_tokens=False)["input_ids"]
        if tokens and tokens[0] not in ids:
            ids.append(tokens[0])
    if not ids:
        raise ValueError(f"the tokenizer gives no token for any of {list(words)}")
    return ids


def _device_of(model) -> torch.device:
    return next(model.parameters()).device


class MiniCheckJudge:
    """MiniCheck-compatible seq2seq judge (MiniCheck-Flan-T5-Large format).

    Input: ``"predict: " + chunk + eos_token + claim`` (at most ``max_input_tokens``
    tokens). One decoder step from the decoder start token; the support probability is
    the softmax over the logits of the first token of "1" (supported) and of "0" (not
    supported), which for the T5 vocabulary are ids 209 and 3, the ids MiniCheck reads.
    The document's chunks are scored in one batch and the maximum is kept.
    """

    def __init__(
        self,
        model,
        tokenizer,
        *,
        name: str = "minicheck",
        chunk_words: int = 500,  # MiniCheck's default chunk for Flan-T5
        max_input_tokens: int = 2048,  # MiniCheck's max input length for Flan-T5
    ) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name
        self.chunk_words = chunk_words
        self.max_input_tokens = max_input_tokens
        self.yes_id = _first_token_ids(tokenizer, ["1"])[0]
        self.no_id = _first_token_ids(tokenizer, ["0"])[0]
        if self.yes_id == self.no_id:
            raise ValueError("the tokenizer maps '1' and '0' to the same first token")

    @classmethod
    def from_pretrained(
        cls, name_or_path: str, *, device: str = "cpu", dtype: torch.dtype = torch.float32, **kw
    ) -> MiniCheckJudge:
        """Load a MiniCheck seq2seq checkpoint (local path or hub name); no remote code."""
        from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=False)
        model = AutoModelForSeq2SeqLM.from_pretrained(
            name_or_path, dtype=dtype, trust_remote_code=False
        ).to(device)
        kw.setdefault("name", cls.name_for(name_or_path))
        return cls(model, tokenizer, **kw)

    @staticmethod
    def name_for(name_or_path: str) -> str:
        """The name `from_pretrained` gives the judge, without loading it."""
        return f"minicheck:{name_or_path}"

    def chunk_probabilities(self, document: str, claim: str) -> list[float]:
        """Support probability of ``claim`` for each chunk of ``document``."""
        eos = self.tokenizer.eos_token or ""
        texts = [f"predict: {c}{eos}{claim}" for c in chunk_document(document, self.chunk_words)]
        batch = self.tokenizer(
            texts,
            max_length=self.max_input_tokens,
            truncation=True,
            padding=True,
            return_tensors="pt",
        ).to(_device_of(self.model))
        start = self.model.config.decoder_start_token_id
        decoder_input_ids = torch.full(
            (len(texts), 1), start, dtype=torch.long, device=batch["input_ids"].device
        )  # (B, 1)
        with torch.no_grad():
            logits = self.model(**batch, decoder_input_ids=decoder_input_ids).logits[:, 0]  # (B, V)
        pair = logits[:, [self.no_id, self.yes_id]].float()  # (B, 2)
        return torch.softmax(pair, dim=-1)[:, 1].tolist()

    def support_probability(self, document: str, claim: str) -> float:
        return max(self.chunk_probabilities(document, claim))


_CLAIM_SLOT = "\x00claim\x00"  # marks where the claim goes when splitting the prompt
JUDGE_PROMPT = (
    "Document:\n{document}\n\n"
    "Claim:\n{claim}\n\n"
    "Is the claim supported by the document? Answer with Yes or No."
)


class LLMFactualityJudge:
    """A causal LM asked whether the document supports the claim; reads P(Yes) vs P(No).

    The prompt is ``JUDGE_PROMPT``, rendered with the chat template when the tokenizer
    has one (the answer's first token is then read at the assistant turn), else followed
    by "\\nAnswer:". One forward pass; at the last position, the probabilities of the first
    tokens of "Yes"/" Yes" and of "No"/" No" are summed per side, and the support
    probability is P(yes) / (P(yes) + P(no)). Documents longer than
    ``max_document_tokens`` keep their beginning. Results are cached per (document, claim).

    Every claim of one document shares the prompt up to the claim, so that prefix is run
    once and its key/value cache reused (the cache of the latest document is kept): a
    summary of k sentences costs one pass over the article plus k short passes, not k
    passes over the article. Where the tokens of prefix + rest are not the prefix's tokens
    followed by more (a merge across the boundary), the whole prompt is run instead.
    """

    def __init__(
        self,
        model,
        tokenizer,
        *,
        name: str = "llm-judge",
        max_document_tokens: int = 3072,  # CNN/DM articles fit; bounds memory on long inputs
    ) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name
        self.max_document_tokens = max_document_tokens
        self.yes_ids = _first_token_ids(tokenizer, ["Yes", " Yes"])
        self.no_ids = _first_token_ids(tokenizer, ["No", " No"])
        if set(self.yes_ids) & set(self.no_ids):
            raise ValueError("the tokenizer gives 'Yes' and 'No' a shared first token")
        self._cache: dict[tuple[str, str], float] = {}
        self._prefix = PrefixCache(model, tokenizer)  # the latest article's key/value cache

    @classmethod
    def from_pretrained(
        cls, name_or_path: str, *, device: str = "cpu", dtype: str = "float32", **kw
    ) -> LLMFactualityJudge:
        """Any causal LM actmap can load (.gguf path, folder, hub id; no remote code).

        ``dtype`` other than float32 (bfloat16: about 4x the matmul rate of float32 on a CPU
        with AVX512-BF16) is part of the judge's name: its labels and checks are its own."""

        model, tokenizer, source = load_model(name_or_path, device=device, dtype=dtype)
        kw.setdefault("name", cls.name_for(source.name, dtype))
        return cls(model, tokenizer, **kw)

    @staticmethod
    def name_for(name_or_path: str, dtype: str = "float32") -> str:
        """The name `from_pretrained` gives the judge, without loading it."""

        return f"llm:{Path(name_or_path).stem}{dtype_tag(dtype)}"

    def prompt(self, document: str, claim: str) -> str:
        ids = self.tokenizer(document, add_special_tokens=False)["input_ids"]
        if len(ids) > self.max_document_tokens:
            document = self.tokenizer.decode(ids[: self.max_document_tokens])
        content = JUDGE_PROMPT.format(document=document, claim=claim)
        if has_chat_template(self.tokenizer):
            return render_chat(self.tokenizer, [{"role": "user", "content": content}])
        return content + "\nAnswer:"

    def support_probability(self, document: str, claim: str) -> float:
        key = (hashlib.sha1(document.encode()).hexdigest(), claim)
        if key not in self._cache:
            self._cache[key] = self._score(document, claim)
        return self._cache[key]

    def _score(self, document: str, claim: str) -> float:
        head, tail = self.prompt(document, _CLAIM_SLOT).split(_CLAIM_SLOT)
        special = not has_chat_template(self.tokenizer)  # a rendered template has its own
        logits = self._prefix.last_logits(head, head + claim + tail, special)  # (V,)
        probs = torch.softmax(logits, dim=-1)
        p_yes = probs[self.yes_ids].sum()
        p_no = probs[self.no_ids].sum()
        return float(p_yes / (p_yes + p_no))


class LazyJudge:
    """A judge whose model loads on its first claim, so that a resumed labelling or check
    with nothing left to score answers without loading it. ``name`` is the loaded judge's
    name (its ``name_for``); a loaded judge with another name is an error."""

    def __init__(self, name: str, load: Callable[[], SummaryFactualityJudge]) -> None:
        self.name = name
        self._load = load
        self._judge: SummaryFactualityJudge | None = None

    @property
    def loaded(self) -> bool:
        return self._judge is not None

    def support_probability(self, document: str, claim: str) -> float:
        if self._judge is None:
            judge = self._load()
            if judge.name != self.name:
                raise ValueError(f"the loaded judge is named {judge.name!r}, not {self.name!r}")
            self._judge = judge
        return self._judge.support_probability(document, claim)


def load_factuality_judge(
    spec: str | None,
    dtype: str = "float32",
    lazy: bool = False,
    on_load: Callable[[str], None] | None = None,
):
    """CNN/DM's judge: 'minicheck:<path or hub id>', or any causal LM actmap can load (LLM judge).

    ``lazy``: a `LazyJudge` that loads on its first claim (a finished step skips the load;
    ``on_load(spec)`` is called when it does); the spec and dtype are still checked at once."""
    if spec is None:
        return None
    if dtype not in DTYPES:
        raise ActmapUserError(f"judge dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    minicheck = spec.startswith("minicheck:")
    if minicheck and dtype != "float32":
        raise ActmapUserError("a MiniCheck judge runs in float32; drop --judge-dtype")
    checkpoint = spec.split(":", 1)[1] if minicheck else spec

    def load():
        if lazy and on_load is not None:
            on_load(spec)
        if minicheck:
            return MiniCheckJudge.from_pretrained(checkpoint)
        return LLMFactualityJudge.from_pretrained(checkpoint, dtype=dtype)

    if not lazy:
        return load()
    if minicheck:
        return LazyJudge(MiniCheckJudge.name_for(checkpoint), load)
    resolve_model(spec)  # a missing path fails now, not at the first claim
    return LazyJudge(LLMFactualityJudge.name_for(spec, dtype), load)
