"""`capture_answers`: the capture of answers that already exist, by teacher forcing.

One forward pass over ``prompt + answer`` (batched: prompts left-padded as in
generation, answers right-padded) gives every position's state at once. The
alignment is generation's (SPEC section 1): row ``t`` is the state at the
position whose output distribution predicts answer token ``t``, i.e. the last
prompt position for ``t = 0`` and answer token ``t - 1``'s position after. The
state after the last answer token predicts what follows; like the state that
produced a stop token, it is not a row, and its end-of-sequence log-probability
and entropy go into ``extras``. So a map built here equals the map capture
during generation gives for the same tokens (to float rounding).

The same hooks as generation are installed and removed by `recording`; the
recorder below fills generation's buffers from the one pass instead of one
step at a time, and `_split_rows` cuts them into records exactly as there.
"""

from __future__ import annotations

import copy
import inspect
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from actmap.capture.generate import (
    _device,
    _eager_attention,
    _split_rows,
    _unpadded,
    check_prompts,
    left_padded_positions,
    left_padded_tails,
    shared_prefix_length,
    stop_ids,
    tokenize_prompts,
    with_shared_prefix,
)
from actmap.capture.hooks import StepRecorder, _first_tensor, recording
from actmap.capture.layers import find_decoder_layers
from actmap.capture.records import CaptureConfig, Generation
from actmap.llm.prefix_cache import cache_keyword, cache_of
from actmap.maps import pool_hidden, saturated_float16

log = logging.getLogger(__name__)


class ForcedRecorder(StepRecorder):
    """Generation's buffers, filled from one teacher-forced pass over (B, P + T) tokens.

    ``start`` is the last prompt position (P - 1); ``chosen`` (B, S) holds each row's
    answer tokens, then its end token, so step ``s`` scores ``chosen[:, s]``.
    """

    def __init__(self, chosen: torch.Tensor, start: int, key_offset: int = 0, **buffers) -> None:
        batch, steps = chosen.shape
        super().__init__(batch=batch, max_steps=steps, device=chosen.device, **buffers)
        self.chosen, self.start, self.steps = chosen, start, steps
        self.key_offset = key_offset  # keys of a shared prefix in the cache, before the queries
        self.calls = 0

    def _rows(self, per_position: torch.Tensor) -> torch.Tensor:
        """(B, P + T, ...) -> (B, S, ...): the positions that predict answer tokens 0..S-1."""
        return per_position[:, self.start : self.start + self.steps]

    # -- hooks (same names and signatures as generation's StepRecorder) -----------------------
    def on_model_start(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.calls += 1
        if self.calls > 1:
            raise RuntimeError("teacher-forced capture expects exactly one forward pass")

    def on_model_end(self, module: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
        if self.entropies is None:  # map-only capture: nothing over the vocabulary
            return
        logits = output.logits if hasattr(output, "logits") else _first_tensor(output)
        logp = torch.log_softmax(self._rows(logits).float(), dim=-1)  # (B, S, V) raw logits
        self.entropies[:] = -(logp.exp() * logp).sum(-1)
        self.logprobs[:] = logp.gather(-1, self.chosen.unsqueeze(-1)).squeeze(-1)

    def layer_hook(self, index: int):
        def hook(module: nn.Module, args: tuple, output: object) -> None:
            hidden = self._rows(_first_tensor(output))  # (B, S, D)
            self.pooled[:, index] = pool_hidden(hidden, self.pooled.shape[-1])
            if self.dense is not None:
                self.dense[:, index] = saturated_float16(hidden[:, : self.dense_steps])
            if self.states is not None:
                self.states[:, index] = saturated_float16(hidden)

        return hook

    def attention_hook(self, index: int):
        def hook(module: nn.Module, args: tuple, output: object) -> None:
            weights = output[1] if isinstance(output, tuple) and len(output) > 1 else None
            if weights is None:
                raise RuntimeError("attention weights are not materialised (eager attention)")
            # step s's query sits at start + s; its k-th previous generated key (k = 1 is
            # its own position, answer token s - 1) at start + s - k + 1, for k <= s
            for k in range(min(self.attention_keys, self.steps - 1)):
                steps = torch.arange(k + 1, self.steps, device=weights.device)
                query = self.start + steps
                picked = weights[:, :, query, query + self.key_offset - k]  # (B, H, S - k - 1)
                self.attention[:, k + 1 :, index, :, k] = picked.permute(0, 2, 1).float()

        return hook


def _logits_kept(model: nn.Module, config: CaptureConfig) -> dict:
    """Map-only capture reads no logits: the head over the vocabulary (a fifth of a small
    model's compute) then runs for the last position only."""
    if config.greybox or "logits_to_keep" not in inspect.signature(model.forward).parameters:
        return {}
    return {"logits_to_keep": 1}


@dataclass(frozen=True)
class ForcedPrefix:
    """Token ids many prompts start with (a chat template's system turn) and their key/value
    cache, computed once: a pass over prompts that start with ``ids`` runs only the rest."""

    ids: torch.Tensor  # (n,)
    cache: Any  # the model's key/value cache of ``ids``, batch 1; copied, never extended


@torch.inference_mode()
def forced_prefix(model: nn.Module, ids: Sequence[int]) -> ForcedPrefix:
    """Run ``ids`` once (no hooks) and keep their key/value cache."""
    tensor = torch.tensor(list(ids), dtype=torch.long, device=_device(model))
    out = model(input_ids=tensor[None], use_cache=True, **_logits_kept(model, CaptureConfig(greybox=False)))  # fmt: skip
    return ForcedPrefix(tensor, cache_of(out))


def _prefix_inputs(
    prefix: ForcedPrefix | None, encoded: dict, config: CaptureConfig
) -> dict | None:
    """[tail | answer] inputs over ``prefix``'s cache when every row starts with its ids and
    leaves one prompt token of its own; None when the batch cannot use it. The padding sits
    between the prefix and each row's own tokens and takes no position (as in generation's
    shared prefix), so each row sees exactly its own prompt."""
    if prefix is None or config.attention_keys > 0 or config.keep_dense:
        return None  # attention entries and dense states index the whole sequence
    n = len(prefix.ids)
    rows = _unpadded(encoded)
    if not all(len(r) > n and torch.equal(r[:n], prefix.ids.to(r.device)) for r in rows):
        return None
    tail, tail_mask = left_padded_tails(encoded, rows, n)
    cache = copy.deepcopy(prefix.cache)
    cache.batch_repeat_interleave(len(rows))
    return {"tail": tail, "tail_mask": tail_mask, "n": n, "cache": cache}


def answer_token_ids(tokenizer, answers: Sequence[str | Sequence[int]]) -> list[list[int]]:
    """Token ids of each answer: text is tokenized on its own, without special tokens.

    An empty answer (the model stopped at once) gets a record with no rows, as in generation.
    """
    return [
        tokenizer(a, add_special_tokens=False)["input_ids"]
        if isinstance(a, str)
        else [int(t) for t in a]
        for a in answers
    ]


def check_pairs(prompts: Sequence[str], answers: Sequence) -> None:
    check_prompts(prompts)
    if len(answers) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(answers)} answers")


@torch.inference_mode()
def capture_answers_batch(
    model: nn.Module,
    tokenizer,
    prompts: Sequence[str],
    answers: Sequence[str | Sequence[int]],
    config: CaptureConfig = CaptureConfig(),
    layers_path: str | None = None,
    prefix: ForcedPrefix | None = None,
) -> list[Generation]:
    """One forward pass over each ``prompt + answer`` of a batch -> one `Generation` each.

    With ``prefix`` (`forced_prefix`), prompts that all start with its ids run only the rest
    on top of its key/value cache: the same rows to float rounding, fewer tokens per pass."""
    check_pairs(prompts, answers)
    device = _device(model)
    layers = find_decoder_layers(model, layers_path)
    token_ids = answer_token_ids(tokenizer, answers)
    longest = max(len(t) for t in token_ids)
    # prompts keep the room generation would leave: the answer plus its end token
    encoded = tokenize_prompts(
        tokenizer, prompts, replace(config, max_new_tokens=longest + 1), device
    )
    ends = stop_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(ends, default=0)
    end = min(ends) if ends else pad
    ends.add(end)
    batch, width = len(prompts), encoded["input_ids"].shape[1]
    chosen = torch.full((batch, longest + 1), end, dtype=torch.long, device=device)  # (B, S)
    answer_mask = torch.zeros(
        (batch, longest), dtype=encoded["attention_mask"].dtype, device=device
    )
    for row, ids in enumerate(token_ids):
        chosen[row, : len(ids)] = torch.tensor(ids, device=device)
        answer_mask[row, : len(ids)] = 1
    fed = torch.where(answer_mask.bool(), chosen[:, :longest], torch.full_like(chosen[:, :1], pad))
    input_ids = torch.cat([encoded["input_ids"], fed], dim=1)  # (B, P + T)
    mask = torch.cat([encoded["attention_mask"], answer_mask], dim=1)
    positions = left_padded_positions(mask)
    cached = {}
    shared = _prefix_inputs(prefix, encoded, config)
    if shared is not None:  # (B, W + T) after the n cached tokens
        input_ids = torch.cat([shared["tail"], fed], dim=1)
        mask = torch.cat([mask.new_ones((batch, shared["n"])), shared["tail_mask"], answer_mask], dim=1)  # fmt: skip
        positions = left_padded_positions(mask)[:, shared["n"] :]
        width = shared["tail"].shape[1]
        cached = {cache_keyword(model): shared["cache"], "use_cache": True}
    key_offset = 0
    n_shared = shared_prefix_length(encoded) if config.share_prefix and batch > 1 else 0
    if shared is None and config.share_prefix and n_shared >= config.share_prefix:
        # the few-shot block every prompt of this batch shares runs once (no hooks), as in
        # generation; attention entries then index keys past its n_shared cached ones
        joint = with_shared_prefix(model, encoded, n_shared)
        input_ids = torch.cat([joint["input_ids"], fed], dim=1)[:, n_shared:]
        mask = torch.cat([joint["attention_mask"], answer_mask], dim=1)
        positions = left_padded_positions(mask)[:, n_shared:]
        width, key_offset = joint["input_ids"].shape[1] - n_shared, n_shared
        cached = {cache_keyword(model): joint[cache_keyword(model)], "use_cache": True}
    text_config = getattr(model.config, "text_config", model.config)
    recorder = ForcedRecorder(
        chosen,
        start=width - 1,
        key_offset=key_offset,
        n_layers=len(layers),
        pooled_dim=config.pooled_dim,
        attention_keys=config.attention_keys,
        n_heads=getattr(text_config, "num_attention_heads", 0),
        dense_steps=min(config.dense_max_tokens, longest + 1) if config.keep_dense else 0,
        hidden_size=getattr(text_config, "hidden_size", 0),
        greybox=config.greybox,
        keep_positions=config.keep_positions,
    )
    with (
        _eager_attention(model, config.attention_keys > 0),
        recording(model, recorder, layers_path),
    ):
        model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            **({"use_cache": False} | cached),
            **_logits_kept(model, config),
        )
    return _split_rows(recorder, chosen, encoded, prompts, tokenizer, ends)


def capture_answers(
    model: nn.Module,
    tokenizer,
    prompts: Sequence[str],
    answers: Sequence[str | Sequence[int]],
    config: CaptureConfig = CaptureConfig(),
    layers_path: str | None = None,
    progress: Callable[[int], None] | None = None,
) -> list[Generation]:
    """Capture existing answers (text or token ids) in batches of ``config.batch_size``.

    Each record is what `generate_with_capture` would have returned had the model
    generated exactly these tokens and then stopped.
    """
    check_pairs(prompts, answers)
    records: list[Generation] = []
    for start in range(0, len(prompts), config.batch_size):
        stop = start + config.batch_size
        records += capture_answers_batch(
            model, tokenizer, prompts[start:stop], answers[start:stop], config, layers_path
        )
        if progress is not None:
            progress(len(prompts[start:stop]))
    return records
