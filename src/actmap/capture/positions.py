"""Position states: the full-width residual stream at a few named positions of one answer.

Probes on hidden states at chosen positions (the token before the answer, the answer's own
tokens) read what pooling over every token blurs. From the states one capture pass computes
anyway, one answer keeps, at every decoder layer, the (unpooled, D-wide) state at

    last_prompt   the last prompt position (it predicts answer token 0; trajectory row 0)
    first_answer  answer token 0's position (it predicts token 1; row 1)
    last_answer   answer token T-1's position (it predicts the end of the answer)
    answer_mean   the mean over the answer tokens' positions (0..T-1)

as one (4, L, D) float16 array: 8 * L * D bytes per answer (SmolLM2-135M: 138 KiB,
Qwen2.5-1.5B: 344 KiB).

Any engine fills the same fields: it hands `position_states` the per-step states it
computed, (L, S, D) with step ``s`` the position that predicts answer token ``s`` (SPEC
section 1), and the answer length. A teacher-forced pass, or a generation that ended on an
end-of-sequence token or a stop string, computed S = T + 1 steps. A generation cut at
``max_new_tokens`` never fed its last token back (S = T): its ``last_answer`` and
``answer_mean`` then end at token T-2 (with T = 1, every answer field is the last prompt state).
"""

from __future__ import annotations

import torch

from actmap.maps import saturated_float16

POSITION_NAMES = ("last_prompt", "first_answer", "last_answer", "answer_mean")


def position_states(states: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """(L, S, D) per-step states of one answer of ``n_tokens`` tokens -> (4, L, D) float16."""
    if states.ndim != 3 or states.shape[1] == 0:
        raise ValueError(f"states must be (L, S>0, D), got {tuple(states.shape)}")
    if n_tokens < 1:
        raise ValueError(f"an answer needs >= 1 token, got {n_tokens}")
    available = min(n_tokens + 1, states.shape[1])
    answer = states[:, 1:available]  # (L, A, D): answer tokens 0..A-1's positions
    if answer.shape[1] == 0:  # the pass never fed an answer token back
        answer = states[:, :1]
    picked = [states[:, 0], answer[:, 0], answer[:, -1], answer.float().mean(1)]
    return torch.stack([saturated_float16(p) for p in picked])  # (4, L, D)


def position_bytes(n_layers: int, hidden_size: int) -> int:
    """Stored bytes per answer: four positions x L layers x D, float16."""
    return len(POSITION_NAMES) * n_layers * hidden_size * 2
