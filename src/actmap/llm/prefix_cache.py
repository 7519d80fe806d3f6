"""Prompts that share a prefix: run the prefix once, then only what follows it.

An LLM judge asks one model many prompts that begin alike (every claim of one article, every
answer pair of one question). `PrefixCache` keeps the key/value cache of the latest shared
prefix and runs each prompt's remaining tokens on top of it, giving the last position's
logits of a full pass at the cost of the rest. Every pass projects only its last position
onto the vocabulary (``logits_to_keep=1``).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch


def cache_keyword(model) -> str:
    """The keyword ``model`` takes its key/value cache by: ``cache`` in the transformers
    releases that renamed it (they warn on the old name), ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def cache_of(output) -> Any:
    """The key/value cache a forward pass returned, under either release's name."""
    return output["cache"] if "cache" in output else output["past_key_values"]


class PrefixCache:
    """Last-position logits of prompts, reusing the key/value cache of their shared prefix.

    The cache of the latest prefix text is kept. A prompt whose token ids start with the
    prefix's ids runs only its remaining ids, and the cache is cropped back to the prefix
    afterwards; a prompt whose ids do not (a token merged across the boundary) runs whole,
    so the logits are always those of the prompt's own tokenization."""

    def __init__(self, model, tokenizer) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self._prefix: tuple[str, bool, list[int], Any] | None = None  # text, special, ids, KV

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _state(self, head: str, special: bool) -> tuple[list[int], Any]:
        if self._prefix is None or self._prefix[:2] != (head, special):
            ids = self.tokenizer(head, add_special_tokens=special)["input_ids"]
            tensor = torch.tensor([ids], device=self._device())
            with torch.no_grad():
                # no logits wanted: the vocabulary projection of the prefix's positions
                # would be about a sixth of a 1.5B judge's pass over an article
                cache = cache_of(self.model(input_ids=tensor, use_cache=True, logits_to_keep=1))
            self._prefix = (head, special, ids, cache)
        return self._prefix[2], self._prefix[3]

    def last_logits(self, head: str, text: str, add_special_tokens: bool) -> torch.Tensor:
        """(V,) float32 logits at the last position of ``text``, which starts with ``head``."""
        ids = self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
        prefix, cache = self._state(head, add_special_tokens)
        device = self._device()
        with torch.no_grad():
            if len(ids) > len(prefix) and ids[: len(prefix)] == prefix:
                rest = ids[len(prefix) :]
                out = self.model(
                    input_ids=torch.tensor([rest], device=device),
                    use_cache=True,
                    logits_to_keep=1,
                    **{cache_keyword(self.model): cache},
                )
                cache.crop(-len(rest))  # back to the prefix for the next prompt
            else:
                out = self.model(input_ids=torch.tensor([ids], device=device), logits_to_keep=1)
        return out.logits[0, -1].float()
