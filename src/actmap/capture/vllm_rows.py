"""A vLLM worker's captured rows of one request, as they travel to the API server.

`payload` (in the worker, `actmap.capture.vllm_worker`) turns a request's rows into plain
values: vLLM's ``collective_rpc`` carries no tensors without pickle, so states go as float32 /
float16 bytes with their shapes. `generation_from_payload` (in the API server,
`actmap.serve.vllm_plugin`) makes them the `Generation` the in-process engine gives. Nothing
here imports vLLM.
"""

from __future__ import annotations

import numpy as np
import torch

from actmap.capture.records import CaptureConfig, Generation
from actmap.capture.vllm_engine import _record, _Request


def child_index(req_id: str, base: str) -> int | None:
    """Which choice ``req_id`` answers for the request whose id holds ``base``, or None.

    vLLM names a request ``<prefix>-<base>-<8 random>``, and the children of an ``n > 1``
    request ``<i>_<prefix>-<base>-<8 random>``."""
    head, sep, rest = req_id.partition("_")
    if sep and head.isdigit() and f"-{base}-" in rest:
        return int(head)
    return 0 if f"-{base}-" in req_id else None


def payload(request: _Request, index: int) -> dict:
    """One request's captured rows as plain values (vLLM's RPC carries no tensors without
    pickle): float32 / float16 bytes with their shapes."""
    rows = request.recorded
    states = request.states[:, :rows].contiguous()
    out = {
        "req_id": request.key,
        "index": index,
        "prompt_ids": list(request.prompt_ids),
        "token_ids": list(request.token_ids),
        "logprobs": list(request.logprobs) if request.entropies is not None else None,
        "recorded": rows,
        "states_shape": list(states.shape),
        "states": states.numpy().tobytes(),
        "entropies": None,
        "full": None,
        "attention": None,
    }
    if request.entropies is not None:
        out["entropies"] = request.entropies[:rows].contiguous().numpy().tobytes()
    if request.full_rows:
        full = torch.stack(request.full_rows)  # (rows, L, D) float16
        out["full"], out["full_shape"] = full.numpy().tobytes(), list(full.shape)
    if request.attention is not None:  # (rows, L, H, K) float32
        attention = request.attention[:rows].contiguous()
        out["attention"] = attention.numpy().tobytes()
        out["attention_shape"] = list(attention.shape)
    return out


def payload_attention(item: dict) -> torch.Tensor | None:
    """A `payload`'s lookback attention ``(rows, L, H, K)`` float32, or None."""
    if item.get("attention") is None:
        return None
    attention = np.frombuffer(item["attention"], np.float32).reshape(item["attention_shape"])
    return torch.from_numpy(attention.copy())


def payload_arrays(item: dict) -> tuple[torch.Tensor, torch.Tensor | None, list | None]:
    """A `payload`'s (states ``(L, rows, D')`` float32, entropies or None, full rows or None)."""
    n_layers, rows, dim = item["states_shape"]
    states = torch.from_numpy(np.frombuffer(item["states"], np.float32).copy())
    states = states.view(n_layers, rows, dim)
    entropies = None
    if item["entropies"] is not None:
        entropies = torch.from_numpy(np.frombuffer(item["entropies"], np.float32).copy())
    full_rows = None
    if item["full"] is not None:
        full = np.frombuffer(item["full"], np.float16).reshape(item["full_shape"])
        full_rows = list(torch.from_numpy(full.copy()))
    return states, entropies, full_rows


def generation_from_payload(
    item: dict,
    tokenizer,
    ends: set[int],
    stop_strings: tuple[str, ...] = (),
    tokens: int | None = None,
) -> Generation:
    """A `payload` back as the `Generation` the in-process engine gives for the same rows
    (`actmap.capture.vllm_engine._record`: end token and stop string cut by actmap's rule);
    ``tokens``: only the answer's first ``tokens`` tokens (an answer ended early)."""
    states, entropies, full_rows = payload_arrays(item)
    attention = payload_attention(item)
    token_ids = list(item["token_ids"])[:tokens]
    logprobs = list(item["logprobs"] or [])
    recorded = int(item["recorded"])
    if tokens is not None:
        logprobs = logprobs[:tokens]
        recorded = min(recorded, tokens)
        full_rows = None if full_rows is None else full_rows[:tokens]
    config = CaptureConfig(
        max_new_tokens=max(1, len(token_ids)),
        stop_strings=tuple(stop_strings),
        greybox=entropies is not None,
        keep_positions=full_rows is not None,
        attention_keys=0 if attention is None else attention.shape[-1],
    )
    prompt_ids = list(item["prompt_ids"])
    request = _Request(
        item["req_id"], tokenizer.decode(prompt_ids), prompt_ids, config, states, entropies,
        full_rows=full_rows, token_ids=token_ids,
        logprobs=logprobs, recorded=recorded,
        internal_id=item["req_id"], attention=attention,
    )  # fmt: skip
    return _record(request, tokenizer, ends)
