"""Sampled answers (Semantic Entropy, EigenScore) kept in the store's ``samples`` table.

Drawn once per (request, id), committed a shard at a time, and reused by every
later run whose sampling request is the same. Embeddings are stored in float32: a
middle block of Gemma-3 holds values beyond float16's range (65,504). Rows written
in float16 before read as they were, except one whose embeddings overflowed to
infinity there: it counts as not sampled, so the next run draws it again (the same
draw: a row's seed is fixed by its id).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from actmap.baselines.sampling import NATURE_STOP_STRINGS, SampleSet, SamplingConfig, sample_answers
from actmap.defaults import SAMPLE_TOP_K, SHORT_MAX_NEW_TOKENS
from actmap.store import MapStore, decode_array, encode_array, latest_rows

SAMPLES_TABLE = "samples"

log = logging.getLogger(__name__)


def sampling_request(generator: str, options, capture: dict) -> dict:
    """What decides a row's samples; rows sampled under another request are drawn again."""

    return {
        "model": generator,
        "n_samples": options.n_samples,
        "temperature": options.temperature,
        "top_p": options.top_p,
        "top_k": SAMPLE_TOP_K,
        "max_new_tokens": options.sample_max_new_tokens
        or capture.get("max_new_tokens", SHORT_MAX_NEW_TOKENS),
        "stop_strings": list(NATURE_STOP_STRINGS),
        "logprob_source": "processed",
        "seed": options.sample_seed,
    }


def row_seed(seed: int, key: str) -> int:
    """The sampling seed of one row: fixed by (seed, id), so resuming never changes a sample."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{key}".encode()).digest()[:4], "big") >> 1


def draw_samples(
    store: MapStore,
    model,
    tokenizer,
    rows: list[tuple[str, str, str]],
    request: dict,
    commit_every: int,
    done: Callable[[dict[str, tuple[Any, float]], int], None],
) -> None:
    """Sample (id, prompt, question) rows one prompt at a time; commit a shard every
    ``commit_every`` rows. After each row ``done(committed now, rows so far)`` is called."""

    key = json.dumps(request, sort_keys=True)
    kwargs = {k: v for k, v in request.items() if k not in ("model", "seed")}
    pending: list[tuple[str, Any, float]] = []
    for count, (row, prompt, question) in enumerate(rows, start=1):
        start = time.perf_counter()
        (sampled,) = sample_answers(
            model,
            tokenizer,
            [prompt],
            questions=[question],
            seed=row_seed(request["seed"], row),
            **kwargs,
        )
        sampled = dataclasses.replace(  # as stored: scores never depend on a resume
            sampled,
            embeddings=sampled.embeddings.float(),
            config=dataclasses.replace(sampled.config, seed=request["seed"]),
        )
        pending.append((row, sampled, time.perf_counter() - start))
        committed = {}
        if len(pending) == commit_every or count == len(rows):
            store.write_table(SAMPLES_TABLE, samples_table(pending, key))
            committed, pending = {k: (s, t) for k, s, t in pending}, []
        done(committed, count)


def samples_table(rows: list[tuple[str, Any, float]], key: str) -> pa.Table:
    sets = [s for _, s, _ in rows]
    return pa.table(
        {
            "id": [k for k, _, _ in rows],
            "request": [key] * len(rows),
            "config": [json.dumps(dataclasses.asdict(s.config)) for s in sets],
            "question": [s.question for s in sets],
            "texts": [list(s.texts) for s in sets],
            "token_ids": pa.array(
                [[list(t) for t in s.token_ids] for s in sets], pa.list_(pa.list_(pa.int32()))
            ),
            "token_logprobs": pa.array(
                [[lp.tolist() for lp in s.token_logprobs] for s in sets],
                pa.list_(pa.list_(pa.float32())),
            ),
            "mean_logprobs": pa.array([s.mean_logprobs.tolist() for s in sets]),
            "stopped": [list(s.stopped) for s in sets],
            "shape": pa.array([list(s.embeddings.shape) for s in sets], pa.list_(pa.int32())),
            "embeddings": [encode_array(s.embeddings.numpy(), np.float32) for s in sets],
            "sampling_s": pa.array([t for _, _, t in rows], pa.float64()),
        }
    )


def decode_embeddings(blob: bytes, shape) -> np.ndarray:
    """A row's stored (K, d) embeddings as float32: float32 bytes, or float16 ones written
    before (told apart by their length)."""
    n = int(np.prod(shape))
    dtype = np.float32 if len(blob) == 4 * n else np.float16
    return decode_array(blob, shape, dtype).astype(np.float32)


def read_samples(store: MapStore, request: dict, prompts) -> dict[str, tuple[Any, float]]:
    """{id: (SampleSet, sampling seconds)} of the rows sampled under ``request``; a row whose
    stored embeddings are not finite (float16 overflow) is left out, to be drawn again."""
    import torch

    if not store.has_table(SAMPLES_TABLE):
        return {}
    key = json.dumps(request, sort_keys=True)
    table = store.read_table(SAMPLES_TABLE)
    table = latest_rows(table.filter(pc.equal(table.column("request"), key)))
    out, overflowed = {}, []
    for row in table.to_pylist():
        embeddings = decode_embeddings(row["embeddings"], row["shape"])
        if not np.isfinite(embeddings).all():
            overflowed.append(row["id"])
            continue
        config = json.loads(row["config"])
        config = SamplingConfig(**{**config, "stop_strings": tuple(config["stop_strings"])})
        out[row["id"]] = (
            SampleSet(
                prompt=prompts.get(row["id"], ""),
                question=row["question"],
                texts=tuple(row["texts"]),
                token_ids=tuple(tuple(t) for t in row["token_ids"]),
                token_logprobs=tuple(torch.tensor(lp) for lp in row["token_logprobs"]),
                mean_logprobs=torch.tensor(row["mean_logprobs"], dtype=torch.float64),
                embeddings=torch.from_numpy(embeddings),
                stopped=tuple(row["stopped"]),
                config=config,
            ),
            row["sampling_s"],
        )
    if overflowed:
        log.warning(
            "%d rows of %s's samples hold embeddings beyond float16's range, stored before "
            "embeddings were kept in float32; they are sampled again: %s",
            len(overflowed),
            store.root,
            ", ".join(overflowed[:5]) + (" ..." if len(overflowed) > 5 else ""),
        )
    return out
