"""Forward hooks that record one batch's trajectory while `generate` runs.

Each forward call of the model is one decoding step: the prefill is step 0
and decode step ``s`` feeds generated token ``s - 1``. At step ``s`` the last
position of every layer's output is the state that produces generated token
``s``, so it becomes row ``s`` of the trajectory (SPEC section 1). Every hook
writes into buffers preallocated on the model's device; nothing is copied to
the host until the batch is done.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from actmap.capture.layers import find_attention_modules, find_decoder_layers
from actmap.maps import pool_hidden, saturated_float16


def _first_tensor(output: object) -> torch.Tensor:
    # transformers 5 decoder layers return a tensor; 4.x returned a tuple
    return output if isinstance(output, torch.Tensor) else output[0]


class StepRecorder:
    """Buffers for one batch: pooled states and, when asked, log-probs and entropies,
    attention entries and dense states.

    With ``greybox=False`` (map-only capture) nothing runs per step over the
    vocabulary: the hooks pool the layer states and do nothing else.
    """

    def __init__(
        self,
        batch: int,
        n_layers: int,
        max_steps: int,
        pooled_dim: int,
        device: torch.device,
        attention_keys: int = 0,
        n_heads: int = 0,
        dense_steps: int = 0,
        hidden_size: int = 0,
        greybox: bool = True,
        keep_positions: bool = False,
    ) -> None:
        self.step = -1
        self.max_steps = max_steps
        self.attention_keys = attention_keys
        self.dense_steps = dense_steps
        self.pooled = torch.zeros(
            batch, n_layers, max_steps, pooled_dim, device=device
        )  # (B, L, T, D')
        # (B, T) chosen-token log p and entropy of each step; None in map-only capture
        self.logprobs = torch.zeros(batch, max_steps, device=device) if greybox else None
        self.entropies = torch.zeros(batch, max_steps, device=device) if greybox else None
        self._last_logp: torch.Tensor | None = None  # (B, V) newest step, until its token is known
        self._step_hidden = torch.zeros(batch, n_layers, hidden_size, device=device)  # (B, L, D)
        self.attention = (
            torch.zeros(batch, max_steps, n_layers, n_heads, attention_keys, device=device)
            if attention_keys
            else None
        )  # (B, T, L, H, K)
        self.dense = (
            torch.zeros(
                batch, n_layers, dense_steps, hidden_size, device=device, dtype=torch.float16
            )
            if dense_steps
            else None
        )  # (B, L, N, D)
        # (B, L, T, D) float16 state of every step, for `positions.position_states`
        self.states = (
            torch.zeros(batch, n_layers, max_steps, hidden_size, device=device, dtype=torch.float16)
            if keep_positions
            else None
        )

    # -- hooks -------------------------------------------------------------------------------
    def on_model_start(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.step += 1
        if self.step >= self.max_steps:
            raise RuntimeError(f"more forward steps than max_new_tokens={self.max_steps}")
        if self.step > 0 and self.logprobs is not None:
            fed = kwargs.get("input_ids") if "input_ids" in kwargs else (args[0] if args else None)
            if fed is None:
                raise RuntimeError("capture needs input_ids at every decode step")
            self.record_chosen(fed[:, -1])

    def record_chosen(self, token_ids: torch.Tensor) -> None:
        """Log-prob of the token chosen at the previous step (now known)."""
        if self.logprobs is None:  # map-only capture
            return
        assert self._last_logp is not None
        index = token_ids.to(self._last_logp.device).view(-1, 1)
        self.logprobs[:, self.step - 1] = self._last_logp.gather(1, index).squeeze(1)

    def statistics_so_far(
        self, rows: list[int], newest: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(len(rows), t) log-probs and entropies of the t = step + 1 tokens generated so far.

        For a step callback: the newest token (``newest``, (len(rows),) ids) is not fed back
        yet, so its log-prob is read from the step's log-softmax. Needs grey-box capture.
        """
        if self.logprobs is None or self._last_logp is None:
            raise RuntimeError("running statistics need grey-box capture (greybox=True)")
        t = self.step + 1
        index = torch.as_tensor(rows, device=self.logprobs.device)
        last = self._last_logp[index].gather(1, newest.to(self.logprobs.device).view(-1, 1))
        return torch.cat([self.logprobs[index, : t - 1], last], 1), self.entropies[index, :t]

    def on_model_end(self, module: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
        # every layer has run: pool this step's states in one call, (B, L, D) -> (B, L, D')
        self.pooled[:, :, self.step] = pool_hidden(self._step_hidden, self.pooled.shape[-1])
        if self.dense is not None and self.step < self.dense_steps:
            self.dense[:, :, self.step] = saturated_float16(self._step_hidden)
        if self.states is not None:
            self.states[:, :, self.step] = saturated_float16(self._step_hidden)
        if self.entropies is None:  # map-only capture: nothing over the vocabulary
            return
        logits = output.logits if hasattr(output, "logits") else _first_tensor(output)
        logp = torch.log_softmax(logits[:, -1, :].float(), dim=-1)  # (B, V) raw logits
        self.entropies[:, self.step] = -(logp.exp() * logp).sum(-1)
        self._last_logp = logp

    def layer_hook(self, index: int):
        def hook(module: nn.Module, args: tuple, output: object) -> None:
            # (B, D): the position that predicts token `step`; pooled once per step above
            self._step_hidden[:, index] = _first_tensor(output)[:, -1, :]

        return hook

    def attention_hook(self, index: int):
        keys = self.attention_keys

        def hook(module: nn.Module, args: tuple, output: object) -> None:
            if self.step == 0:
                return  # the prefill attends to no generated token
            weights = output[1] if isinstance(output, tuple) and len(output) > 1 else None
            if weights is None:
                raise RuntimeError(
                    "attention weights are not materialised; load the model with "
                    "attn_implementation='eager' to capture attention"
                )
            # (B, H, kv) weights of the newest query; left padding keeps the newest keys last
            last = weights[:, :, -1, :].float()
            take = min(keys, self.step, last.shape[-1])  # only generated keys, k = 1..step
            recent = last[:, :, -take:].flip(-1)  # (B, H, take), [..., 0] = own position (k = 1)
            self.attention[:, self.step, index, :, :take] = recent

        return hook

    def finish(self, last_tokens: torch.Tensor) -> None:
        """Record the final step's chosen token (never fed back into the model)."""
        self.step += 1
        self.record_chosen(last_tokens)


@contextmanager
def recording(
    model: nn.Module,
    recorder: StepRecorder,
    layers_path: str | None = None,
) -> Iterator[StepRecorder]:
    """Hooks live only inside this block; they are removed even when generation raises."""
    layers = find_decoder_layers(model, layers_path)
    handles = [
        model.register_forward_pre_hook(recorder.on_model_start, with_kwargs=True),
        model.register_forward_hook(recorder.on_model_end, with_kwargs=True),
    ]
    try:
        handles += [
            layer.register_forward_hook(recorder.layer_hook(i)) for i, layer in enumerate(layers)
        ]
        if recorder.attention is not None:
            attention = find_attention_modules(layers)
            handles += [
                m.register_forward_hook(recorder.attention_hook(i)) for i, m in enumerate(attention)
            ]
        yield recorder
    finally:
        for handle in handles:
            handle.remove()
