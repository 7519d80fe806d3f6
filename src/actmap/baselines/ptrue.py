"""P(True): the model judges its own answer in one extra forward pass (BASELINES Part B.4).

LM-Polygraph's variant: the verification prompt below (wrapped in the chat
template for instruction-tuned models, plain for base models), one forward
pass, and the log-softmax of the raw logits at the last position, read at the
id of the target "True". Confidence = P("True"); raw = -log P("True").

The target is spelled as the model would write it there: "True" at the start of
a chat's assistant turn, " True" after the plain prompt's "The possible answer
is:" (LM-Polygraph reads "True" in both; after "is:" a base model gives that
token almost no mass -- Gemma-3-270M: mean P("True") .0001 against P(" True")
.016 on its TriviaQA test rows -- so it read noise there).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from actmap.capture.generate import left_padded_positions
from actmap.capture.records import Generation
from actmap.scoring.contract import ScoreResult

log = logging.getLogger(__name__)

# LM-Polygraph's prompt, character for character (the leading spaces and the
# missing space after "answer:" are theirs).
PTRUE_TEMPLATE = (
    "Question: {question}\n Possible answer:{answer}\n "
    "Is the possible answer:\n (A) True\n (B) False\n The possible answer is:"
)


@dataclass(frozen=True)
class PTrueInput:
    """The question (not the full prompt) and the model's own answer."""

    question: str
    answer: str

    @classmethod
    def from_generation(cls, question: str, gen: Generation) -> PTrueInput:
        return cls(question=question, answer=gen.answer)


def target_token_id(tokenizer, target: str) -> tuple[int, str]:
    """The single-token id of ``target``, trying it as given and then with a leading space.

    Returns (id, the string that tokenised to one token). Tokenised without
    special tokens; raises ValueError if neither form is a single token.
    """
    for candidate in (target, " " + target):
        ids = tokenizer(candidate, add_special_tokens=False)["input_ids"]
        if len(ids) == 1:
            return int(ids[0]), candidate
    raise ValueError(f"P(True) target {target!r} is not a single token for this tokenizer")


def verification_text(
    tokenizer,
    question: str,
    answer: str,
    template: str,
    use_chat: bool,
    chat_kwargs: dict[str, Any] | None = None,
) -> str:
    """The text of the verification prompt, inside a user turn when use_chat.

    ``chat_kwargs`` go to ``apply_chat_template`` (e.g. ``{"enable_thinking": False}``
    for Qwen3, to judge in the same mode the answers were generated in).
    """
    text = template.format(question=question, answer=answer)
    if not use_chat:
        return text
    messages = [{"role": "user", "content": text}]
    return tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False, **(chat_kwargs or {})
    )


def left_pad(sequences: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token id lists -> input_ids (B, S), attention_mask (B, S)."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, width - len(s) :] = torch.tensor(s, dtype=torch.long)
        mask[i, width - len(s) :] = 1
    return ids, mask


@torch.no_grad()
def last_token_logprobs(
    model, input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> torch.Tensor:
    """log-softmax (float32) of the raw logits at each left-padded row's last position -> (B, V)."""
    position_ids = left_padded_positions(attention_mask)  # padding must not shift positions
    device = next(model.parameters()).device
    out = model(
        input_ids=input_ids.to(device),
        attention_mask=attention_mask.to(device),
        position_ids=position_ids.to(device),
        logits_to_keep=1,
    )
    return torch.log_softmax(out.logits[:, -1].float(), dim=-1).cpu()  # (B, V)


class PTrue:
    """Confidence = P(target | verification prompt), one extra forward pass per answer."""

    name: ClassVar[str] = "p_true"
    supervised: ClassVar[bool] = False
    requires: ClassVar[tuple[str, ...]] = ("verification", "model")
    probability: ClassVar[bool] = True  # P(True) is read as p(correct)

    @classmethod
    def from_inputs(cls, inputs) -> PTrue:
        model, tokenizer = inputs.generator()
        return cls(model, tokenizer, batch_size=inputs.options.ptrue_batch_size)

    def __init__(
        self,
        model,
        tokenizer,
        template: str = PTRUE_TEMPLATE,
        target: str | None = None,
        use_chat: bool | None = None,
        chat_kwargs: dict[str, Any] | None = None,
        batch_size: int = 8,
        max_length: int = 4096,
    ) -> None:
        self.model = model  # the generator itself, judging its own answers
        self.tokenizer = tokenizer
        self.template = template  # str.format fields: {question}, {answer}
        self.target = target  # read at its single-token id; None: `default_target()`
        self.use_chat = use_chat  # None = use the chat template iff the tokenizer has one
        self.chat_kwargs = chat_kwargs  # extra template switches, as used for the answers
        self.batch_size = batch_size
        self.max_length = max_length  # longer prompts lose their first tokens

    def fit(self, train: Sequence[Any], y_train: np.ndarray, val=None, y_val=None) -> PTrue:
        return self

    def default_target(self) -> str:
        """ "True" where the chat's assistant turn starts, " True" after the plain prompt."""
        return "True" if self._chat() else " True"

    def _chat(self) -> bool:
        if self.use_chat is not None:
            return self.use_chat
        return getattr(self.tokenizer, "chat_template", None) is not None

    def encode(self, row: PTrueInput) -> list[int]:
        """Token ids of one verification prompt (a chat template brings its own special tokens)."""
        chat = self._chat()
        text = verification_text(
            self.tokenizer, row.question, row.answer, self.template, chat, self.chat_kwargs
        )
        ids = self.tokenizer(text, add_special_tokens=not chat)["input_ids"]
        return list(ids[-self.max_length :])

    def score(self, rows: Sequence[PTrueInput]) -> ScoreResult:
        for i, row in enumerate(rows):
            if not isinstance(row, PTrueInput):
                raise TypeError(
                    f"row {i}: PTrue scores PTrueInput(question, answer), got {type(row).__name__}"
                )
        target_id, target_str = target_token_id(
            self.tokenizer, self.default_target() if self.target is None else self.target
        )
        pad_id = self.tokenizer.pad_token_id
        pad_id = pad_id if pad_id is not None else (self.tokenizer.eos_token_id or 0)
        logp = []
        for start in range(0, len(rows), self.batch_size):
            ids, mask = left_pad(
                [self.encode(r) for r in rows[start : start + self.batch_size]], pad_id
            )
            logp.append(last_token_logprobs(self.model, ids, mask)[:, target_id].double())
        log_true = torch.cat(logp).numpy() if logp else np.zeros(0)
        return ScoreResult(
            confidence=np.exp(log_true),
            raw=-log_true,
            raw_name="neg_log_p_true",
            details={
                "template": self.template,
                "target": target_str,
                "target_id": target_id,
                "chat_template": self._chat(),
                "chat_kwargs": dict(self.chat_kwargs or {}),
                "batch_size": self.batch_size,
            },
        )
