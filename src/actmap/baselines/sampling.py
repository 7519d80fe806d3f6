"""Sampled answers for the sampling-based baselines (Semantic Entropy, EigenScore).

`sample_answers` draws N answers per prompt in one ``generate`` call per batch
and keeps, per answer, what both methods read: the text, the per-token
log-likelihoods, their mean, and one middle-layer embedding. The prompt runs
once: its key/value cache is copied to the N rows, which then only decode
(``num_return_sequences=N`` would run the prompt N times; on a few-shot prompt
that prefill is most of the cost).

Conventions (BASELINES.md decisions 2, 5, 6):

- An answer ends at its first end-of-sequence token or at the first stop
  string, whichever comes first. Neither is part of the answer: the text is
  cut before the stop string, and the answer tokens are those whose text
  starts before it (a token that carries answer text and then the stop string
  stays in). An answer with no token at all keeps the log-likelihood of its
  first generated token (the stop itself), as the Nature code does.
- Log-likelihoods come from the *processed* sampling distribution by default
  (after temperature, top-k and top-p, renormalised), as the Nature code's
  ``compute_transition_scores(normalize_logits=True)``; ``logprob_source="raw"``
  takes them from the raw logits instead. The choice is recorded.
- The embedding is the output of decoder block ``embedding_layer`` (0-based;
  default ``L // 2 - 1``, which is ``hidden_states[L // 2]`` of transformers,
  LM-Polygraph's layer) at the answer's own last real step in actmap's
  alignment: the position whose output distribution produced the last answer
  token (SPEC section 1, row ``T - 1`` of a trajectory). With an empty answer
  it is the last prompt position.
- Top-k then top-p run as one step (`TopKTopP`) that sorts the k kept scores, not the
  vocabulary: it keeps the tokens transformers' two warpers keep, so a seed draws the
  same answers, at a fraction of the cost on large vocabularies (Qwen 151k, Gemma 262k).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import nn

from actmap.capture.generate import left_padded_positions, stop_ids, tokenize_prompts
from actmap.capture.hooks import _first_tensor
from actmap.capture.layers import find_decoder_layers
from actmap.capture.records import CaptureConfig
from actmap.capture.stopping import check_stop_strings, cut_at_stop, stop_criteria
from actmap.defaults import (
    CONTEXT_LENGTH,
    N_SAMPLES,
    SAMPLE_TEMPERATURE,
    SAMPLE_TOP_K,
    SAMPLE_TOP_P,
    SHORT_MAX_NEW_TOKENS,
)
from actmap.llm.prefix_cache import cache_keyword, cache_of

log = logging.getLogger(__name__)

# The Nature code's stop sequences; the first occurrence of any of them ends an answer.
NATURE_STOP_STRINGS: tuple[str, ...] = ("\n\n\n\n", "\n\n\n", "\n\n", "\n", "Question:", "Context:")
LOGPROB_SOURCES = ("processed", "raw")


@dataclass(frozen=True)
class SamplingConfig:
    """How the N answers per prompt are drawn; stored with every `SampleSet`."""

    n_samples: int = N_SAMPLES
    temperature: float = SAMPLE_TEMPERATURE
    top_p: float = SAMPLE_TOP_P
    top_k: int = SAMPLE_TOP_K
    max_new_tokens: int = SHORT_MAX_NEW_TOKENS
    embedding_layer: int | None = None  # 0-based block; None = L // 2 - 1 (LM-Polygraph)
    stop_strings: tuple[str, ...] = NATURE_STOP_STRINGS  # cut from the text; end the answer
    logprob_source: str = "processed"  # "processed" (Nature code) or "raw" logits
    seed: int = 0  # torch seed for the whole call; the global RNG state is restored afterwards
    batch_size: int = 1  # prompts per generate call; each expands to n_samples rows
    max_context: int = CONTEXT_LENGTH  # prompt + answer tokens; longer prompts keep the last

    def __post_init__(self) -> None:
        if self.n_samples < 1:
            raise ValueError(f"n_samples must be >= 1, got {self.n_samples}")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0 for sampling, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.logprob_source not in LOGPROB_SOURCES:
            raise ValueError(
                f"logprob_source must be one of {LOGPROB_SOURCES}, got {self.logprob_source!r}"
            )
        check_stop_strings(self.stop_strings)
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")


@dataclass(frozen=True)
class SampleSet:
    """N sampled answers to one prompt, with what SE and EigenScore read."""

    prompt: str
    question: str | None  # what the entailment judge sees; None when not given
    texts: tuple[str, ...]  # (N,) answers, stop string cut, whitespace stripped
    token_ids: tuple[tuple[int, ...], ...]  # N x (T_i,) answer tokens
    token_logprobs: tuple[torch.Tensor, ...]  # N x (max(T_i, 1),) float32, natural log
    mean_logprobs: torch.Tensor  # (N,) float64, length-normalised log-likelihood per answer
    embeddings: torch.Tensor  # (N, D) float32, block `config.embedding_layer` at the last real step
    stopped: tuple[bool, ...]  # (N,) ended by end-of-sequence or a stop string
    config: SamplingConfig  # embedding_layer resolved to the block actually read

    @property
    def n_samples(self) -> int:
        return len(self.texts)


def check_same_sampling(rows: Sequence[SampleSet]) -> None:
    """Scores compare across rows only when every row was sampled with the same settings."""
    if not rows:
        raise ValueError("no rows to score")
    configs = {row.config for row in rows}
    if len(configs) > 1:
        raise ValueError(
            f"rows were sampled with {len(configs)} different settings; score them apart"
        )


def cut_answer(
    token_ids: Sequence[int], tokenizer, stop_strings: Sequence[str]
) -> tuple[int, str, bool]:
    """(answer tokens kept, answer text stripped, cut) under `actmap.capture.stopping`'s rule.

    The Nature code's convention: a stop string at the very start gives an empty answer.
    """
    kept, text, cut = cut_at_stop(token_ids, tokenizer, stop_strings)
    return kept, text.strip(), cut


def resolve_embedding_layer(n_layers: int, embedding_layer: int | None) -> int:
    """0-based block index; the default ``L // 2 - 1`` is ``hidden_states[L // 2]``."""
    layer = max(n_layers // 2 - 1, 0) if embedding_layer is None else embedding_layer
    if not 0 <= layer < n_layers:
        raise ValueError(
            f"embedding_layer={embedding_layer} is outside the model's {n_layers} decoder blocks"
        )
    return layer


def _shared_prompt(model, encoded: dict, n: int) -> tuple[dict, dict]:
    """(inputs, cache kwargs) that make ``generate`` decode N rows per prompt on one prompt pass.

    All prompt tokens but the last run once, at batch width B, with the positions ``generate``
    gives a left-padded row; the cache is repeated N times prompt-major, and ``generate`` runs
    only the last token. A one-token prompt, or a cache that cannot be repeated, runs as N
    copies instead (``num_return_sequences``)."""
    ids, mask = encoded["input_ids"], encoded["attention_mask"]
    if ids.shape[1] < 2 or n == 1:
        return {**encoded, "num_return_sequences": n}, {}
    positions = left_padded_positions(mask)
    out = model(
        input_ids=ids[:, :-1],
        attention_mask=mask[:, :-1],
        position_ids=positions[:, :-1],
        use_cache=True,
        logits_to_keep=1,  # only the cache is kept
    )
    cache = cache_of(out)
    if not hasattr(cache, "batch_repeat_interleave"):
        return {**encoded, "num_return_sequences": n}, {}
    cache.batch_repeat_interleave(n)
    inputs = {k: v.repeat_interleave(n, dim=0) for k, v in encoded.items()}
    return {**inputs, "num_return_sequences": 1}, {cache_keyword(model): cache}


class TopKTopP:
    """transformers' top-k warper followed by its top-p warper, in one step over the kept
    scores: top-k keeps every score at or above the k-th largest (ties included), then top-p
    removes the kept tokens whose ascending cumulative probability is at most 1 - top_p,
    keeping the most likely one. The top-p warper sorts the whole vocabulary every step
    (about 125 ms for 10 rows of Qwen's 151,936 scores on one thread); this sorts the k kept.
    A logits processor by its call ``(input_ids, scores) -> scores`` (transformers is imported
    only where `generate` runs)."""

    def __init__(self, top_k: int, top_p: float, filter_value: float = -float("inf")) -> None:
        if top_k < 1 or not 0 < top_p <= 1:
            raise ValueError(f"TopKTopP needs top_k >= 1 and 0 < top_p <= 1, got {top_k}, {top_p}")
        self.top_k, self.top_p, self.filter_value = top_k, top_p, filter_value

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        kth = torch.topk(scores, min(self.top_k, scores.shape[-1])).values[..., -1:]
        kept = scores >= kth  # top-k's rule: ties with the k-th score stay
        values, indices = torch.topk(scores, int(kept.sum(-1).max()))  # descending
        if self.top_p < 1:
            ascending = values.masked_fill(values < kth, self.filter_value).flip(-1)
            remove = ascending.softmax(-1).cumsum(-1) <= 1 - self.top_p
            remove[..., -1] = False  # the most likely token always stays
            order = indices.flip(-1)
            kept = kept.scatter(1, order, kept.gather(1, order) & ~remove)
        return scores.masked_fill(~kept, self.filter_value)


def _warpers(config: SamplingConfig) -> dict:
    """``generate`` keywords for top-k and top-p: `TopKTopP` when both apply (top-k >= 1),
    else transformers' own warpers (top-p alone must sort the vocabulary anyway)."""
    from transformers import LogitsProcessorList

    if config.top_k < 1:
        return {"top_p": config.top_p, "top_k": 0}
    return {
        "top_p": 1.0,  # off in generate: the processor below does both
        "top_k": 0,
        "logits_processor": LogitsProcessorList([TopKTopP(config.top_k, config.top_p)]),
    }


@torch.inference_mode()
def _generate(
    model: nn.Module, tokenizer, encoded: dict, config: SamplingConfig, layer: nn.Module
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(generated ids (B*N, S), chosen-token log p (B*N, S), block states (B*N, S, D)) on the host.

    Rows are prompt-major (N samples of prompt 0 first). State ``s`` is the
    block output at the last position of forward step ``s``: the position whose
    distribution produced generated token ``s``.
    """
    states: list[torch.Tensor] = []  # one (B*N, D) per forward step of generate

    def hook(module: nn.Module, args: tuple, output: object) -> None:
        states.append(_first_tensor(output)[:, -1, :].float())

    prompt_len = encoded["input_ids"].shape[1]
    processed = config.logprob_source == "processed"
    inputs, cache = _shared_prompt(model, encoded, config.n_samples)  # before the hook
    handle = layer.register_forward_hook(hook)
    try:
        out = model.generate(
            **inputs,
            **cache,
            do_sample=True,
            temperature=config.temperature,
            **_warpers(config),
            max_new_tokens=config.max_new_tokens,
            pad_token_id=tokenizer.pad_token_id,
            return_dict_in_generate=True,
            output_scores=processed,
            output_logits=not processed,
            stopping_criteria=stop_criteria(tokenizer, config.stop_strings, prompt_len),
        )
    finally:
        handle.remove()
    generated = out.sequences[:, prompt_len:]  # (B*N, S)
    per_step = (
        out.scores if processed else out.logits
    )  # S x (B*N, V); one step at a time saves memory
    chosen = [
        s.float().log_softmax(-1).gather(1, generated[:, i, None]).squeeze(1)
        for i, s in enumerate(per_step)
    ]
    logp = torch.stack(chosen, dim=1)  # (B*N, S)
    hidden = torch.stack(states[: generated.shape[1]], dim=1)  # (B*N, S, D)
    return generated.cpu(), logp.cpu(), hidden.cpu()


def _sample_set(
    prompt: str,
    question: str | None,
    generated: torch.Tensor,
    logp: torch.Tensor,
    hidden: torch.Tensor,
    tokenizer,
    config: SamplingConfig,
    eos_ids: set[int],
) -> SampleSet:
    """One prompt's N rows, each cut at its own end-of-sequence or stop string."""
    steps = generated.shape[1]
    texts, ids, lps, embs, stopped = [], [], [], [], []
    for r, row in enumerate(generated.tolist()):
        n_eos = next((i for i, t in enumerate(row) if t in eos_ids), steps)
        kept, text, cut = cut_answer(row[:n_eos], tokenizer, config.stop_strings)
        n_ll = max(kept, 1)  # an empty answer keeps its stop token's likelihood (Nature code)
        texts.append(text)
        ids.append(tuple(row[:kept]))
        lps.append(logp[r, :n_ll].clone())
        embs.append(hidden[r, n_ll - 1])  # the state that produced the last answer token
        stopped.append(cut or n_eos < steps)
    return SampleSet(
        prompt=prompt,
        question=question,
        texts=tuple(texts),
        token_ids=tuple(ids),
        token_logprobs=tuple(lps),
        mean_logprobs=torch.stack([lp.double().mean() for lp in lps]),
        embeddings=torch.stack(embs),
        stopped=tuple(stopped),
        config=config,
    )


def sample_answers(
    model: nn.Module,
    tokenizer,
    prompts: Sequence[str],
    n_samples: int = N_SAMPLES,
    temperature: float = SAMPLE_TEMPERATURE,
    top_p: float = SAMPLE_TOP_P,
    max_new_tokens: int = SHORT_MAX_NEW_TOKENS,
    embedding_layer: int | None = None,
    stop_strings: Sequence[str] = NATURE_STOP_STRINGS,
    seed: int = 0,
    *,
    questions: Sequence[str | None] | None = None,
    top_k: int = SAMPLE_TOP_K,
    logprob_source: str = "processed",
    batch_size: int = 1,
    max_context: int = CONTEXT_LENGTH,
    layers_path: str | None = None,
) -> list[SampleSet]:
    """Draw ``n_samples`` answers for every prompt; one `SampleSet` per prompt, in order.

    ``prompts`` are the exact texts fed to the model (chat template already
    applied, as for the greedy pass); ``questions`` are the bare questions the
    entailment judge sees. The middle-layer embedding is read by a forward
    hook on that one block, removed when generation ends or fails.
    """
    if questions is None:
        questions = [None] * len(prompts)
    if len(questions) != len(prompts):
        raise ValueError(f"questions has {len(questions)} entries for {len(prompts)} prompts")
    config = SamplingConfig(
        n_samples=n_samples,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        max_new_tokens=max_new_tokens,
        embedding_layer=embedding_layer,
        stop_strings=tuple(stop_strings),
        logprob_source=logprob_source,
        seed=seed,
        batch_size=batch_size,
        max_context=max_context,
    )
    layers = find_decoder_layers(model, layers_path)
    config = replace(config, embedding_layer=resolve_embedding_layer(len(layers), embedding_layer))
    block = layers[config.embedding_layer]
    eos_ids = stop_ids(model, tokenizer)
    device = next(model.parameters()).device
    budget = CaptureConfig(max_new_tokens=max_new_tokens, max_context=max_context)
    n = config.n_samples
    sets: list[SampleSet] = []
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        for start in range(0, len(prompts), batch_size):
            batch = list(prompts[start : start + batch_size])
            encoded = tokenize_prompts(tokenizer, batch, budget, device)
            generated, logp, hidden = _generate(model, tokenizer, encoded, config, block)
            for p, prompt in enumerate(batch):
                rows = slice(p * n, (p + 1) * n)
                sets.append(
                    _sample_set(
                        prompt,
                        questions[start + p],
                        generated[rows],
                        logp[rows],
                        hidden[rows],
                        tokenizer,
                        config,
                        eos_ids,
                    )
                )
            log.debug("sampled %d/%d prompts", len(sets), len(prompts))
    return sets
