"""The exact prompts fed to the generator, and the answer post-processing before labeling.

Two prompt styles for the short-form tasks, recorded with every result:

- ``"few_shot"`` (default): the instruction, then fixed question/answer demonstrations
  drawn from the train split (never evaluated), then the question. Small models answer
  at length under a bare instruction (SmolLM2-135M scored 0% with the zero-shot prompt
  under the paper's label rule); demonstrations teach the short answer format, as the
  Semantic Entropy authors' prompts do.
- ``"zero_shot"``: the instruction and the question only.

When the tokenizer has a chat template the prompt is rendered with it
(``add_generation_prompt=True``), the demonstrations becoming earlier user/assistant
turns; ``enable_thinking=False`` is passed so templates that know it (Qwen3) answer
directly. Templates that know no such variable ignore it. Without a template (base
models such as Gemma-3-270M) the plain text form is used::

    {instruction}

    Question: {demo question 1}
    Answer: {demo answer 1}

    ...

    Question: {question}
    Answer:

A prompt rendered by a chat template already holds the template's special tokens
(e.g. a BOS); tokenize it with ``add_special_tokens=False``, and a plain prompt with
``True`` (``uses_chat_template`` tells which). ``chat=False`` forces the plain form for
chat models too: SmolLM2-135M-Instruct answers few-shot chat prompts in full sentences
but the plain few-shot text in a few words.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Literal

from actmap.data.base import DataError
from actmap.defaults import CONTEXT_LENGTH, SUMMARY_MAX_NEW_TOKENS  # noqa: F401 (re-exported)

logger = logging.getLogger(__name__)

PromptStyle = Literal["few_shot", "zero_shot"]
PROMPT_STYLES: tuple[str, ...] = ("few_shot", "zero_shot")

QA_INSTRUCTION = "Answer the following question with a short answer only."
GSM8K_INSTRUCTION = "Solve the following math problem. Give only the final number, no reasoning."
SUMMARY_INSTRUCTION = "Summarize the following article in a few sentences."


def check_prompt_style(style: str) -> str:
    if style not in PROMPT_STYLES:
        raise ValueError(f"unknown prompt style {style!r}; choose one of {PROMPT_STYLES}")
    return style


def has_chat_template(tokenizer) -> bool:
    return tokenizer is not None and getattr(tokenizer, "chat_template", None) is not None


def render_chat(tokenizer, messages: list[dict[str, str]]) -> str:
    """The chat template's text for ``messages``, ending with the assistant's turn opener."""
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )


def uses_chat_template(tokenizer, chat: bool = True) -> bool:
    """Whether a prompt for ``tokenizer`` is rendered with its chat template.

    True prompts carry the template's special tokens (tokenize them with
    ``add_special_tokens=False``); plain prompts need the tokenizer's own (``True``).
    """
    return chat and has_chat_template(tokenizer)


def qa_prompt(
    question: str,
    tokenizer,
    *,
    instruction: str,
    demonstrations: Sequence[tuple[str, str]] = (),
    chat: bool = True,
) -> str:
    """A short-answer prompt: instruction, (question, answer) demonstrations, the question.

    ``demonstrations`` empty gives the zero-shot prompt. ``chat=False`` gives the plain
    text even when the tokenizer has a chat template.
    """
    if not uses_chat_template(tokenizer, chat):
        turns = [f"Question: {q}\nAnswer: {a}" for q, a in demonstrations]
        turns.append(f"Question: {question}\nAnswer:")
        return instruction + "\n\n" + "\n\n".join(turns)
    messages: list[dict[str, str]] = []
    for q, a in demonstrations:
        messages.append({"role": "user", "content": f"Question: {q}"})
        messages.append({"role": "assistant", "content": a})
    messages.append({"role": "user", "content": f"Question: {question}"})
    messages[0]["content"] = instruction + "\n\n" + messages[0]["content"]
    return render_chat(tokenizer, messages)


def _summary_text(article: str, tokenizer, chat: bool) -> str:
    content = f"{SUMMARY_INSTRUCTION}\n\nArticle:\n{article}"
    if not uses_chat_template(tokenizer, chat):
        return content + "\n\nSummary:"
    return render_chat(tokenizer, [{"role": "user", "content": content}])


def count_tokens(text: str, tokenizer) -> int:
    """Tokens of ``text`` including any special tokens the tokenizer adds (an upper bound)."""
    return len(tokenizer(text, add_special_tokens=True)["input_ids"])


def summary_prompt(
    article: str,
    tokenizer,
    *,
    context_length: int = CONTEXT_LENGTH,
    max_new_tokens: int = SUMMARY_MAX_NEW_TOKENS,
    truncation_side: Literal["left", "right"] = "left",
    chat: bool = True,
) -> str:
    """The CNN/DailyMail prompt, its article cut by tokens so prompt + answer fit the context.

    Only the article is ever cut, never the instruction or the template. ``"left"`` drops
    the article's first tokens (keeps its end), ``"right"`` drops its last tokens (keeps
    the lead). Without a tokenizer no truncation is possible and the whole article is used.
    """
    if truncation_side not in ("left", "right"):
        raise ValueError(f"truncation_side must be 'left' or 'right', got {truncation_side!r}")
    text = _summary_text(article, tokenizer, chat)
    if tokenizer is None:
        return text
    budget = context_length - max_new_tokens
    n_prompt = count_tokens(text, tokenizer)
    if n_prompt <= budget:
        return text
    ids = tokenizer(article, add_special_tokens=False)["input_ids"]
    keep = len(ids) - (n_prompt - budget)
    for _ in range(8):  # re-tokenizing decoded text can shift a few tokens; shrink until it fits
        if keep <= 0:
            raise DataError(
                f"the summary prompt without its article needs more than {budget} tokens"
            )
        kept = ids[-keep:] if truncation_side == "left" else ids[:keep]
        text = _summary_text(tokenizer.decode(kept), tokenizer, chat)
        n_prompt = count_tokens(text, tokenizer)
        if n_prompt <= budget:
            logger.debug("article cut from %d to %d tokens (%s)", len(ids), keep, truncation_side)
            return text
        keep -= n_prompt - budget
    raise DataError(f"could not fit the article into {budget} prompt tokens")


_ANSWER_PREFIX = "answer:"


def extract_answer(text: str) -> str:
    """The short answer inside a raw generation, used for labeling (the raw text is kept too).

    Steps: strip leading whitespace; drop a leading "Answer:" (chat models often echo the
    demonstration format); cut at the first newline; cut at "Question:" (a model that
    learned the few-shot format goes on with an invented next question); strip.
    """
    s = text.lstrip()
    if s[: len(_ANSWER_PREFIX)].lower() == _ANSWER_PREFIX:
        s = s[len(_ANSWER_PREFIX) :].lstrip()
    s = s.split("\n", 1)[0]
    s = s.split("Question:", 1)[0]
    return s.strip()


def extract_summary(text: str) -> str:
    """The summary inside a raw generation: the text stripped of surrounding whitespace.

    Summaries span several sentences and may span lines, so nothing is cut.
    """
    return text.strip()
