"""Per-answer scalars the one generation pass already gives, next to the map.

The capture keeps, per answer token, log p(chosen token) and the entropy of the
full next-token distribution (raw logits, natural log). Six numbers summarise
them; a detector may read them beside the map at no extra model cost:

    n_tokens          answer length in tokens (end-of-sequence excluded)
    sum_logprob       sum_t log p(y_t)    (the sequence log-likelihood)
    mean_logprob      mean_t log p(y_t)   (minus the log-perplexity)
    mean_entropy      mean_t H_t (nats)
    max_entropy       max_t H_t
    first_token_prob  p(y_0), the confidence of the first answer token
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from actmap.store.served import SCALARS_TABLE

SCALAR_NAMES = (
    "n_tokens",
    "sum_logprob",
    "mean_logprob",
    "mean_entropy",
    "max_entropy",
    "first_token_prob",
)


def answer_scalars(logprobs, entropies) -> np.ndarray:
    """(T,) log-probs and (T,) entropies of one answer -> (6,) float64 in SCALAR_NAMES order."""
    if logprobs is None or entropies is None:
        raise ValueError(
            "the answer has no log-probs or entropies (map-only capture); capture with "
            "greybox statistics on (`actmap capture` without --no-greybox)"
        )
    lp = np.asarray(logprobs, dtype=np.float64).reshape(-1)
    h = np.asarray(entropies, dtype=np.float64).reshape(-1)
    if len(lp) != len(h):
        raise ValueError(f"logprobs has {len(lp)} steps but entropies has {len(h)}")
    if len(lp) == 0:
        raise ValueError("an empty answer has no per-token statistics")
    return np.array(
        [len(lp), lp.sum(), lp.mean(), h.mean(), h.max(), np.exp(lp[0])], dtype=np.float64
    )


def scalars_of_generations(generations: Sequence) -> np.ndarray:
    """(N, 6) scalars of captured `Generation` records (or anything with logprobs/entropies)."""
    return np.stack([answer_scalars(g.logprobs, g.entropies) for g in generations])


def scalars_from_store(store, ids: Sequence[str]) -> np.ndarray:
    """(N, 6) scalars of the store rows ``ids``, read from its ``generations`` table (an
    audit store keeps them ready in ``audit_scalars``)."""
    if not store.has_table("generations") and store.has_table(SCALARS_TABLE):
        table = store.read_latest(SCALARS_TABLE)
        index = {key: i for i, key in enumerate(table.column("id").to_pylist())}
        missing = [key for key in ids if key not in index]
        if missing:
            raise ValueError(
                f"{store.root}: {len(missing)} served answers have no per-answer scalars "
                f"(served by a maps-only detector?), e.g. {missing[:3]}"
            )
        values = np.column_stack([table.column(n).to_numpy() for n in SCALAR_NAMES])
        return values[[index[key] for key in ids]]
    table = store.read_latest("generations", ["logprobs", "entropies"])
    index = {key: i for i, key in enumerate(table.column("id").to_pylist())}
    missing = [key for key in ids if key not in index]
    if missing:
        raise ValueError(
            f"{store.root}: {len(missing)} rows have no 'generations' entry, e.g. {missing[:3]}"
        )
    logprobs, entropies = table.column("logprobs"), table.column("entropies")
    return np.stack(
        [answer_scalars(logprobs[index[k]].as_py(), entropies[index[k]].as_py()) for k in ids]
    )


def with_scalars(store, rows):
    """``rows`` (a `actmap.store.rows.Rows` of ``store``) with their per-answer scalars."""
    return dataclasses.replace(rows, scalars=scalars_from_store(store, rows.row_ids()))
