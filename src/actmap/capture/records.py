"""Typed records that leave the generation pass.

One `Generation` per answer holds everything every scorer reads (the
"compute once, read many" split): the answer, its token ids, the raw-logit
log-probabilities and entropies of each step, the pooled trajectory, and,
when asked for, the attention entries RAUQ/TAD need and the dense
hidden states ACT-ViT needs.

Alignment (SPEC section 1): row ``t`` of every per-token array belongs to the
forward position whose output distribution produced generated token ``t``.
Row 0 is the last prompt position of the prefill pass; row ``t > 0`` is the
decode step that fed token ``t - 1``. The end-of-sequence token is *not* part
of the returned answer and never counts as a generated token, so ``T`` is the
number of answer tokens. A stop string (``CaptureConfig.stop_strings``) ends an
answer the same way: the answer text stops before it and its tokens are dropped
(see `actmap.capture.stopping`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from actmap.defaults import CONTEXT_LENGTH, SHORT_MAX_NEW_TOKENS
from actmap.errors import ActmapUserError


@dataclass(frozen=True)
class CaptureConfig:
    """How one generation pass is run and what it keeps."""

    max_new_tokens: int = SHORT_MAX_NEW_TOKENS  # the task sets 384 for summaries
    # paper: greedy answers; sampling only for Semantic Entropy / EigenScore
    do_sample: bool = False
    temperature: float = 1.0  # used only when do_sample
    top_p: float = 1.0  # used only when do_sample
    pooled_dim: int = 128  # D' of the online D -> 128 pooling
    max_context: int = CONTEXT_LENGTH  # prompt + answer tokens; longer prompts are left-truncated
    # K previous generated keys kept per head (TAD uses 10, RAUQ 1); 0 = none
    attention_keys: int = 0
    # read those K weights beside the fused attention kernel (`actmap.capture.lookback`)
    # instead of switching to eager attention; same weights, map-only capture's tokens
    lookback_attention: bool = False
    # per-step log-probs and entropies over the vocabulary (the grey-box baselines, RAUQ,
    # TAD); False = map-only capture: the hooks pool layer states and nothing else
    greybox: bool = True
    keep_dense: bool = False  # keep full (unpooled) hidden states for ACT-ViT
    dense_max_tokens: int = 100  # ACT-ViT's N_max: dense states kept for the first tokens only
    # full-width states at four named positions, every layer (`actmap.capture.positions`)
    keep_positions: bool = False
    batch_size: int = 32
    # tokenizer special tokens (e.g. BOS) for plain prompts; None = only when the tokenizer
    # has no chat template (templated text already carries them)
    add_special_tokens: bool | None = None
    # end each answer at the first of these texts (e.g. "\n" after a few-shot answer);
    # leading whitespace never ends an answer. Rule in `actmap.capture.stopping`.
    stop_strings: tuple[str, ...] = ()
    # run the token prefix every prompt of a batch shares (a few-shot block) once and reuse
    # its key/value cache; only when it is at least this many tokens long. 0 = never.
    # Same tokens; states agree with the plain pass to float rounding (tested per family).
    share_prefix: int = 0

    def __post_init__(self) -> None:
        from actmap.capture.stopping import check_stop_strings

        object.__setattr__(self, "stop_strings", check_stop_strings(self.stop_strings))
        if self.share_prefix < 0:
            raise ActmapUserError(f"share_prefix must be >= 0, got {self.share_prefix}")


@dataclass(frozen=True)
class Generation:
    """One prompt's answer and everything captured while producing it.

    Shapes use ``T`` answer tokens, ``L`` decoder layers, ``H`` query heads.
    """

    prompt: str
    answer: str
    token_ids: list[int]  # (T,) generated ids, end-of-sequence excluded
    # (T,) float32, log p(chosen token) from raw logits, natural log; None in map-only capture
    logprobs: torch.Tensor | None
    # (T,) float32, entropy of the full next-token distribution (nats); None in map-only capture
    entropies: torch.Tensor | None
    trajectory: torch.Tensor  # (L, T, 128) float32, pooled hidden states
    stopped: bool  # True when generation ended on an end-of-sequence token or a stop string
    prompt_tokens: int  # prompt length after truncation
    # (T, L, H, K) float32: attention at step t to generated token t-k (k = 1..K),
    # zero where t - k < 0; None unless CaptureConfig.attention_keys > 0.
    attention: torch.Tensor | None = None
    # (L, min(T, dense_max_tokens), D) float16 unpooled states; None unless keep_dense.
    dense: torch.Tensor | None = None
    # (4, L, D) float16 states at `actmap.capture.positions.POSITION_NAMES`; None unless
    # keep_positions
    positions: torch.Tensor | None = None
    extras: dict[str, float] = field(default_factory=dict)

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)
