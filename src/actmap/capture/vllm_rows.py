"""A vLLM worker's captured rows of one request, as they travel to the API server.

`payload` (in the worker, `actmap.capture.vllm_worker`) turns a request's rows into plain
values: vLLM's ``collective_rpc`` carries no tensors without pickle, so states go as float32 /
float16 bytes with their shapes. `generation_from_payload` (in the API server,
`actmap.serve.vllm_plugin`) makes them the `Generation` the in-process engine gives. Nothing
here imports vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from actmap.capture.positions import position_states
from actmap.capture.records import CaptureConfig, Generation
from actmap.capture.stopping import cut_row, stop_step_extras


@dataclass(frozen=True)
class ForcedRead:
    """A teacher-forced reading: vLLM prefills prompt + answer (``max_tokens=1``) and the rows
    are positions ``origin - 1 .. origin + T - 1`` of that prefill (``origin``: the original
    prompt's length P). ``chosen``: the T answer tokens, then the end token, so row ``t``'s
    log-prob is that of ``chosen[t]`` (row T's: the end token's, the stop step's extras)."""

    origin: int
    chosen: tuple[int, ...]


@dataclass(eq=False)
class _Request:
    key: str  # external request id
    prompt: str
    prompt_ids: list[int]
    config: CaptureConfig
    states: torch.Tensor  # (L, max_rows, D') float32, host
    entropies: torch.Tensor | None  # (max_rows,) float32, host; None in map-only capture
    # keep_positions: row t's (L, D) float16, as a list, or one (rows, L, D) tensor
    full_rows: list[torch.Tensor] | torch.Tensor | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    recorded: int = 0  # rows 0..recorded-1 are filled
    seen: bool = False  # scheduled at least once
    internal_id: str = ""
    finish_reason: str | None = None
    max_rows: int | None = None  # None: ``states`` holds every row (allocated up front)
    # attention_keys > 0: row t's lookback weights (rows, L, H, K) float32, host
    # (`actmap.capture.vllm_attention`); grown with ``states``
    attention: torch.Tensor | None = None
    forced: ForcedRead | None = None  # a teacher-forced reading (rows from the prefill)

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def row_limit(self) -> int:
        return self.states.shape[1] if self.max_rows is None else self.max_rows

    def reserve(self, rows: int) -> None:
        """Room for rows ``0..rows-1`` (a request tracked without an up-front allocation grows
        its host arrays by doubling)."""
        have = self.states.shape[1]
        if rows <= have:
            return
        size = max(rows, 2 * have)
        states = torch.zeros(self.states.shape[0], size, self.states.shape[2])
        states[:, :have] = self.states
        self.states = states
        if self.entropies is not None:
            entropies = torch.zeros(size)
            entropies[:have] = self.entropies
            self.entropies = entropies
        if self.attention is not None:
            attention = self.attention.new_zeros((size, *self.attention.shape[1:]))
            attention[:have] = self.attention
            self.attention = attention


def _record(request: _Request, tokenizer, ends: set[int]) -> Generation:
    """One finished request -> its `Generation`, cut as `actmap.capture.generate._split_rows`
    cuts a row (end token and stop string excluded, the stop step's statistics kept)."""
    steps = len(request.token_ids)
    token_ids, answer, stopped, has_stop_step = cut_row(
        request.token_ids, ends, tokenizer, request.config.stop_strings
    )
    n = len(token_ids)
    if request.recorded < min(n + has_stop_step, steps):
        raise RuntimeError(
            f"request {request.key}: {request.recorded} rows recorded for {steps} tokens"
        )
    greybox = request.entropies is not None
    logprobs = torch.tensor(request.logprobs, dtype=torch.float32) if greybox else None
    extras = stop_step_extras(logprobs, request.entropies, n, has_stop_step)
    positions = None
    if request.full_rows is not None and n > 0:
        rows = request.full_rows
        steps = rows.transpose(0, 1) if torch.is_tensor(rows) else torch.stack(rows, dim=1)
        positions = position_states(steps, n)  # (L, rows, D): a view of one tensor
    return Generation(
        prompt=request.prompt,
        answer=answer,
        token_ids=list(token_ids),
        logprobs=logprobs[:n].clone() if greybox else None,
        entropies=request.entropies[:n].clone() if greybox else None,
        trajectory=request.states[:, :n].clone(),
        stopped=stopped,
        prompt_tokens=request.prompt_tokens,
        attention=None if request.attention is None else request.attention[:n].clone(),
        positions=positions,
        extras=extras,
    )


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
    if request.full_rows is not None and len(request.full_rows):
        full = request.full_rows
        full = full if torch.is_tensor(full) else torch.stack(full)  # (rows, L, D) float16
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


def payload_arrays(
    item: dict,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """A `payload`'s (states ``(L, rows, D')`` float32, entropies or None, full rows
    ``(rows, L, D)`` float16 or None)."""
    n_layers, rows, dim = item["states_shape"]
    states = torch.from_numpy(np.frombuffer(item["states"], np.float32).copy())
    states = states.view(n_layers, rows, dim)
    entropies = None
    if item["entropies"] is not None:
        entropies = torch.from_numpy(np.frombuffer(item["entropies"], np.float32).copy())
    full_rows = None
    if item["full"] is not None:
        full = np.frombuffer(item["full"], np.float16).reshape(item["full_shape"])
        full_rows = torch.from_numpy(full.copy())
    return states, entropies, full_rows


def generation_from_payload(
    item: dict,
    tokenizer,
    ends: set[int],
    stop_strings: tuple[str, ...] = (),
    tokens: int | None = None,
    prompt: str | None = None,
) -> Generation:
    """A `payload` back as the `Generation` the in-process engine gives for the same rows
    (`_record`: end token and stop string cut by actmap's rule);
    ``tokens``: only the answer's first ``tokens`` tokens (an answer ended early); ``prompt``:
    the prompt's text (None: its token ids decoded)."""
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
        item["req_id"], tokenizer.decode(prompt_ids) if prompt is None else prompt, prompt_ids, config, states, entropies,
        full_rows=full_rows, token_ids=token_ids,
        logprobs=logprobs, recorded=recorded,
        internal_id=item["req_id"], attention=attention,
    )  # fmt: skip
    return _record(request, tokenizer, ends)
