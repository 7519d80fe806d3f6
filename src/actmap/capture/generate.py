"""`generate_with_capture`: ordinary batched generation plus the hooks of `hooks.py`."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from actmap.capture.attention import prompt_pass_without_weights, weights_implementation
from actmap.capture.hooks import StepRecorder, recording
from actmap.capture.layers import find_decoder_layers
from actmap.capture.lookback import lookback_attention, supports_lookback
from actmap.capture.positions import position_states
from actmap.capture.records import CaptureConfig, Generation
from actmap.capture.stopping import cut_row, end_token_ids, stop_criteria, stop_step_extras
from actmap.llm.prefix_cache import cache_keyword, cache_of

log = logging.getLogger(__name__)


def stop_ids(model: nn.Module, tokenizer) -> set[int]:
    """End-of-sequence ids of the model's generation config and of the tokenizer."""
    return end_token_ids(getattr(model, "generation_config", None), tokenizer)


def check_prompts(prompts: Sequence[str]) -> None:
    if not prompts:
        raise ValueError("no prompts given")
    for i, prompt in enumerate(prompts):
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f"prompt {i} is empty or not a string")


def tokenize_prompts(tokenizer, prompts: Sequence[str], config: CaptureConfig, device) -> dict:
    """Left-padded batch; prompts longer than the context budget keep their last tokens."""
    check_prompts(prompts)
    budget = config.max_context - config.max_new_tokens
    if budget <= 0:
        raise ValueError(
            f"max_context={config.max_context} leaves no room for "
            f"max_new_tokens={config.max_new_tokens}"
        )
    add_special = config.add_special_tokens
    if add_special is None:  # templated chat text already carries its special tokens
        add_special = not getattr(tokenizer, "chat_template", None)
    saved = tuple(
        getattr(tokenizer, a, None) for a in ("padding_side", "truncation_side", "pad_token")
    )
    tokenizer.padding_side = tokenizer.truncation_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    try:
        encoded = tokenizer(
            list(prompts),
            return_tensors="pt",
            padding=True,
            truncation=True,
            max_length=budget,
            add_special_tokens=add_special,
        )
    finally:  # the caller's tokenizer is left as it was
        tokenizer.padding_side, tokenizer.truncation_side, tokenizer.pad_token = saved
    return {k: v.to(device) for k, v in encoded.items()}


def left_padded_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids of a left-padded batch, as ``generate`` gives them: each row counts from 0 at
    its first real token; padding takes none (0, masked out anyway)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def _unpadded(encoded: dict) -> list[torch.Tensor]:
    pairs = zip(encoded["input_ids"], encoded["attention_mask"], strict=True)
    return [ids[mask.bool()] for ids, mask in pairs]


def shared_prefix_length(encoded: dict) -> int:
    """Tokens every row of a left-padded batch starts with, leaving each row one of its own."""
    rows = _unpadded(encoded)
    shortest = min(len(r) for r in rows)
    first = rows[0][: shortest - 1]
    same = torch.ones_like(first, dtype=torch.bool)
    for row in rows[1:]:
        same &= row[: len(first)] == first
    return int(same.int().cumprod(0).sum()) if len(first) else 0


def left_padded_tails(
    encoded: dict, rows: list[torch.Tensor], n_shared: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's tokens after the first ``n_shared``, left-padded to one width (the batch's
    pad id), and their attention mask: the part of a batch that follows a cached prefix."""
    ids, mask = encoded["input_ids"], encoded["attention_mask"]
    own = [row[n_shared:] for row in rows]
    width = max(len(o) for o in own)
    pad = int(ids[mask == 0][0]) if (mask == 0).any() else 0
    tail = torch.full((len(rows), width), pad, dtype=ids.dtype, device=ids.device)
    tail_mask = torch.zeros((len(rows), width), dtype=mask.dtype, device=mask.device)
    for i, o in enumerate(own):
        tail[i, width - len(o) :] = o
        tail_mask[i, width - len(o) :] = 1
    return tail, tail_mask


def with_shared_prefix(model: nn.Module, encoded: dict, n_shared: int) -> dict:
    """Generate inputs whose first ``n_shared`` tokens are already in a key/value cache.

    The batch becomes [shared prefix | left padding | each row's own tokens]: positions
    follow the attention mask, so the padding in the middle takes no position and every
    row sees exactly its own prompt. The prefix runs once, with no capture hooks on.
    """
    mask = encoded["attention_mask"]
    rows = _unpadded(encoded)
    prefix = rows[0][:n_shared]
    tail, tail_mask = left_padded_tails(encoded, rows, n_shared)
    cache = cache_of(model(input_ids=prefix[None], use_cache=True, logits_to_keep=1))
    cache.batch_repeat_interleave(len(rows))
    return {
        "input_ids": torch.cat([prefix.expand(len(rows), -1), tail], dim=1),
        "attention_mask": torch.cat([mask.new_ones((len(rows), n_shared)), tail_mask], dim=1),
        cache_keyword(model): cache,
    }


def _model_inputs(model: nn.Module, tokenizer, prompts, config: CaptureConfig) -> dict:
    """The batch ``generate`` is called with: tokenized prompts, plus a prefix cache when asked."""
    encoded = tokenize_prompts(tokenizer, prompts, config, _device(model))
    if config.share_prefix and len(prompts) > 1:
        n_shared = shared_prefix_length(encoded)
        if n_shared >= config.share_prefix:
            return with_shared_prefix(model, encoded, n_shared)
    return encoded


def _generate_kwargs(model: nn.Module, tokenizer, config: CaptureConfig, prompt_len: int) -> dict:
    """``generate`` settings for a batch of ``prompt_len`` tokens, stop strings included."""
    kwargs = dict(
        max_new_tokens=config.max_new_tokens,
        stopping_criteria=stop_criteria(
            tokenizer, config.stop_strings, prompt_len, skip_leading_whitespace=True
        ),
        do_sample=config.do_sample,
        pad_token_id=tokenizer.pad_token_id
        if tokenizer.pad_token_id is not None
        else tokenizer.eos_token_id,
        return_dict_in_generate=False,
    )
    if config.do_sample:
        kwargs.update(temperature=config.temperature, top_p=config.top_p, top_k=0)
    else:
        kwargs.update(temperature=None, top_p=None, top_k=None)
    return kwargs


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


@contextmanager
def _eager_attention(model: nn.Module, needed: bool) -> Iterator[None]:
    """Attention weights exist only in eager attention; switch for the block, restore after.
    A grouped-query model gets the eager attention that does not copy its cache
    (`actmap.capture.attention`): the same weights and output."""
    current = getattr(model.config, "_attn_implementation", None)
    wanted = weights_implementation(model) if needed else current
    if wanted == current:
        yield
        return
    model.set_attn_implementation(wanted)
    try:
        yield
    finally:
        model.set_attn_implementation(current)


def _attention_for(model: nn.Module, config: CaptureConfig):
    """The attention the capture needs: lookback weights beside the fused kernel when asked
    and the family is supported, else eager attention when weights are kept at all."""
    if config.attention_keys > 0 and config.lookback_attention and supports_lookback(model):
        return lookback_attention(model, config.attention_keys)
    return _eager_attention(model, config.attention_keys > 0)


@torch.inference_mode()
def generate_plain(
    model: nn.Module, tokenizer, prompts: Sequence[str], config: CaptureConfig
) -> torch.Tensor:
    """The same generation without hooks: (B, P + T') token ids; the reference for overhead."""
    encoded = _model_inputs(model, tokenizer, prompts, config)
    prompt_len = encoded["input_ids"].shape[1]
    return model.generate(**encoded, **_generate_kwargs(model, tokenizer, config, prompt_len))


# Called after every generated token with the recorder and the (B, t) tokens so far; rows
# 0..t-1 of ``recorder.pooled`` then hold the trajectory of those t tokens. It returns a (B,)
# bool tensor of rows to end now (or None); an ended row's later steps are padding.
StepCallback = Callable[[StepRecorder, torch.Tensor], torch.Tensor | None]


def _with_step_callback(kwargs: dict, on_step: StepCallback, recorder: StepRecorder, start: int):
    from transformers import StoppingCriteria, StoppingCriteriaList

    class OnStep(StoppingCriteria):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **_) -> torch.Tensor:
            end = on_step(recorder, input_ids[:, start:])
            if end is None:
                return torch.zeros(len(input_ids), dtype=torch.bool, device=input_ids.device)
            return end.to(input_ids.device)

    criteria = StoppingCriteriaList(kwargs["stopping_criteria"] or [])
    criteria.append(OnStep())
    kwargs["stopping_criteria"] = criteria


@torch.inference_mode()
def generate_batch(
    model: nn.Module,
    tokenizer,
    prompts: Sequence[str],
    config: CaptureConfig = CaptureConfig(),
    layers_path: str | None = None,
    on_step: StepCallback | None = None,
) -> list[Generation]:
    """One batch of prompts -> one `Generation` each, captured in the single generation pass.

    ``on_step`` (optional) sees every step while it happens: a server streams tokens and
    running scores from it and may end rows early.
    """
    device = _device(model)
    layers = find_decoder_layers(model, layers_path)
    encoded = _model_inputs(model, tokenizer, prompts, config)  # before any hook is on
    text_config = getattr(model.config, "text_config", model.config)
    recorder = StepRecorder(
        batch=len(prompts),
        n_layers=len(layers),
        max_steps=config.max_new_tokens,
        pooled_dim=config.pooled_dim,
        device=device,
        attention_keys=config.attention_keys,
        n_heads=getattr(text_config, "num_attention_heads", 0),
        dense_steps=min(config.dense_max_tokens, config.max_new_tokens) if config.keep_dense else 0,
        hidden_size=getattr(text_config, "hidden_size", 0),
        greybox=config.greybox,
        keep_positions=config.keep_positions,
    )
    prompt_len = encoded["input_ids"].shape[1]
    kwargs = _generate_kwargs(model, tokenizer, config, prompt_len)
    if on_step is not None:
        _with_step_callback(kwargs, on_step, recorder, prompt_len)
    with (
        _attention_for(model, config),
        prompt_pass_without_weights(),
        recording(model, recorder, layers_path),
    ):
        sequences = model.generate(**encoded, **kwargs)
        generated = sequences[:, prompt_len:]  # (B, steps)
        recorder.finish(generated[:, -1])
    ends = stop_ids(model, tokenizer)
    if config.stop_strings:  # a row ended by a stop string is padded from then on
        ends.add(kwargs["pad_token_id"])
    return _split_rows(recorder, generated, encoded, prompts, tokenizer, ends, config.stop_strings)


def _split_rows(
    recorder: StepRecorder,
    generated: torch.Tensor,
    encoded: dict,
    prompts: Sequence[str],
    tokenizer,
    stop_ids: set[int],
    stop_strings: tuple[str, ...] = (),
) -> list[Generation]:
    """Cut each row at its first stop token or stop string; padding and post-stop steps never
    leave the batch."""
    steps = generated.shape[1]
    prompt_tokens = encoded["attention_mask"].sum(1)
    greybox = recorder.logprobs is not None
    host = {  # one copy to the host per batch
        "pooled": recorder.pooled[:, :, :steps].cpu(),
        "logprobs": recorder.logprobs[:, :steps].cpu() if greybox else None,
        "entropies": recorder.entropies[:, :steps].cpu() if greybox else None,
        "attention": None if recorder.attention is None else recorder.attention[:, :steps].cpu(),
        "dense": None if recorder.dense is None else recorder.dense.cpu(),
        "states": None if recorder.states is None else recorder.states[:, :, :steps].cpu(),
    }
    records = []
    for row, prompt in enumerate(prompts):
        token_ids, answer, stopped, has_stop_step = cut_row(
            generated[row].tolist(), stop_ids, tokenizer, stop_strings
        )
        n = len(token_ids)
        extras = {}
        if greybox:
            extras = stop_step_extras(
                host["logprobs"][row], host["entropies"][row], n, has_stop_step
            )
        records.append(
            Generation(
                prompt=prompt,
                answer=answer,
                token_ids=token_ids,
                logprobs=host["logprobs"][row, :n].clone() if greybox else None,
                entropies=host["entropies"][row, :n].clone() if greybox else None,
                trajectory=host["pooled"][row, :, :n].clone(),  # (L, T, D')
                stopped=stopped,
                prompt_tokens=int(prompt_tokens[row]),
                attention=None if host["attention"] is None else host["attention"][row, :n].clone(),
                dense=None
                if host["dense"] is None
                else host["dense"][row, :, : min(n, host["dense"].shape[2])].clone(),
                positions=None
                if host["states"] is None or n == 0
                else position_states(host["states"][row], n),
                extras=extras,
            )
        )
    return records


def generate_with_capture(
    model: nn.Module,
    tokenizer,
    prompts: Sequence[str],
    config: CaptureConfig = CaptureConfig(),
    layers_path: str | None = None,
    progress=None,
) -> list[Generation]:
    """Generate answers for ``prompts`` in batches of ``config.batch_size``, capturing every layer.

    ``progress`` is an optional callable receiving the number of prompts finished
    after each batch (the CLI passes a rich progress bar's advance).
    """
    check_prompts(prompts)
    records: list[Generation] = []
    for start in range(0, len(prompts), config.batch_size):
        batch = list(prompts[start : start + config.batch_size])
        records.extend(generate_batch(model, tokenizer, batch, config, layers_path))
        if progress is not None:
            progress(len(batch))
    return records
