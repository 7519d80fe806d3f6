"""The label-free per-answer signals of the one greedy pass, in one low room that the detectors
(`actmap.detectors.stacked`) and the baselines (`actmap.baselines`) both read: an answer's
per-step log-probabilities and entropies (the end-of-sequence step appended when asked, or
alone for an empty answer), its captured attention entries, and the log-prob scalars built on
them (log-perplexity, mean token entropy)."""

from __future__ import annotations

import numpy as np

from actmap.capture.records import Generation

EOS_LOGPROB = "eos_logprob"  # Generation.extras key: log p(EOS) at the stopping step
EOS_ENTROPY = "eos_entropy"  # Generation.extras key: entropy at the stopping step


def captured_attention(gen: Generation, method: str, keys: str) -> np.ndarray:
    """(T, L, H, K) float32 attention entries of one answer (RAUQ, TAD); an error naming
    ``method`` and the ``attention_keys`` it needs when they were not captured as such."""
    if gen.attention is None:
        raise ValueError(
            f"{method} needs Generation.attention (capture with attention_keys >= {keys})"
        )
    att = gen.attention.float().numpy()  # (T, L, H, K)
    if att.ndim != 4 or att.shape[0] != gen.n_tokens:
        raise ValueError(
            f"Generation.attention must be (T={gen.n_tokens}, L, H, K), got {tuple(att.shape)}"
        )
    return att


def answer_steps(gen: Generation, field: str, include_eos: bool = False) -> np.ndarray:
    """The per-step values of one answer as float64, optionally with the EOS step appended.

    ``field`` is "logprobs" or "entropies". The EOS step is also used, alone,
    for an empty answer; an answer with no step at all is an error.
    """
    if field not in ("logprobs", "entropies"):
        raise ValueError(f"field must be 'logprobs' or 'entropies', got {field!r}")
    if getattr(gen, field) is None:
        raise ValueError(
            f"Generation.{field} was not captured (map-only capture); capture with "
            "greybox statistics on (`actmap capture` without --no-greybox)"
        )
    values = np.asarray(getattr(gen, field), dtype=np.float64).reshape(-1)  # (T,)
    if values.shape[0] != gen.n_tokens:
        raise ValueError(
            f"Generation.{field} has {values.shape[0]} steps but token_ids has {gen.n_tokens}"
        )
    eos_key = EOS_LOGPROB if field == "logprobs" else EOS_ENTROPY
    if (include_eos or values.size == 0) and gen.stopped and eos_key in gen.extras:
        values = np.append(values, float(gen.extras[eos_key]))  # (T + 1,)
    elif include_eos and gen.stopped:
        raise ValueError(f"include_eos=True but Generation.extras has no {eos_key!r}")
    if values.size == 0:
        raise ValueError(
            f"empty answer without an EOS step to score (prompt {gen.prompt[:40]!r}); "
            f"Generation.extras needs {eos_key!r}"
        )
    return values


def log_perplexity(logprobs: np.ndarray) -> float:
    """-(1/T) sum_t log p(y_t): the log-perplexity (natural log, not exponentiated)."""
    return -float(np.mean(logprobs))


def mean_token_entropy(entropies: np.ndarray) -> float:
    """(1/T) sum_t H_t, entropies in nats."""
    return float(np.mean(entropies))
