"""The vLLM capture's recorder on a scripted scheduler (no vLLM engine, no model): which rows
each step writes, checked against the row rule by hand.

A request's trajectory row t is the state of the position that predicts answer token t
(row 0: the last prompt position). A preempted request is prefilled again from position 0:
vLLM recomputes every row it already recorded. The recorded row must win (the recomputed
one is the same to kernel rounding at best, and another batch's at worst), so the recompute
step writes only the rows past what was recorded. Here every pass writes its own values, so
a recomputed row that overwrote a recorded one shows.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch
from torch import nn

from actmap.capture.records import CaptureConfig
from actmap.capture.vllm_engine import _Recorder, _Request

N_LAYERS, WIDTH, PROMPT, MAX_ROWS = 2, 4, 3, 8


class ScriptedRunner:
    """vLLM's model runner as the recorder sees it: one request, one forward per step, whose
    every layer outputs ``pass_value + 10 * layer + flat position`` at each flat token."""

    def __init__(self) -> None:
        self.model_config = SimpleNamespace(get_hidden_size=lambda: WIDTH)
        self.recorder: _Recorder | None = None
        self.pass_value = 0.0

    def _model_forward(self) -> None:
        n = int(self.query_start_loc.np[-1])
        for layer in range(N_LAYERS):
            value = self.pass_value + 10 * layer + torch.arange(n, dtype=torch.float32)
            self.recorder.record(layer, value[:, None].expand(n, WIDTH).contiguous(), None)

    def step(self, computed: int, n_tokens: int, pass_value: float) -> None:
        """One forward of ``n_tokens`` positions starting at position ``computed``."""
        self.input_batch = SimpleNamespace(
            num_reqs=1,
            req_ids=["r"],
            num_computed_tokens_cpu=np.array([computed]),
            num_prompt_tokens=np.array([PROMPT]),
        )
        self.query_start_loc = SimpleNamespace(np=np.array([0, n_tokens]))
        self.pass_value = pass_value
        self._model_forward()  # the recorder's wrapper around the forward above
        self.recorder.scatter()


def expected_row(pass_value: float, flat: int) -> torch.Tensor:
    """(L, D') the row the recorder keeps for flat token ``flat`` of a pass."""
    return torch.stack(
        [torch.full((WIDTH,), pass_value + 10 * layer + flat) for layer in range(N_LAYERS)]
    )


def test_recomputed_rows_after_preemption_keep_the_recorded_values():
    runner = ScriptedRunner()
    recorder = _Recorder(runner, nn.Linear(1, 1), N_LAYERS, WIDTH, capacity=16, greybox=False)
    try:
        check_recomputed_rows(runner, recorder)
    finally:  # one recorder per process: the next engine in this process needs none left
        recorder.remove()


def check_recomputed_rows(runner, recorder) -> None:
    runner.recorder = recorder
    request = _Request(
        key="k", prompt="p", prompt_ids=[1, 2, 3], config=CaptureConfig(),
        states=torch.full((N_LAYERS, MAX_ROWS, WIDTH), float("nan")), entropies=None,
        internal_id="r",
    )  # fmt: skip
    recorder.requests["r"] = request
    runner.step(computed=0, n_tokens=PROMPT, pass_value=0.0)  # prefill: row 0 at flat 2
    runner.step(computed=3, n_tokens=1, pass_value=100.0)  # decode: row 1
    runner.step(computed=4, n_tokens=1, pass_value=200.0)  # decode: row 2
    assert request.recorded == 3 and recorder.recomputed == 0
    # preempted, then prefilled again: prompt + 3 fed tokens = 6 positions, rows -2..3;
    # rows 0..2 are recomputed (other values here), row 3 is new
    runner.step(computed=0, n_tokens=PROMPT + 3, pass_value=1000.0)
    assert recorder.recomputed == 1 and recorder.recomputed_keys == {"k"}
    assert request.recorded == 4
    want = [
        expected_row(0.0, 2),  # the first prefill's last position
        expected_row(100.0, 0),
        expected_row(200.0, 0),
        expected_row(1000.0, 5),  # the recompute's last position: the one new row
    ]
    for row, expected in enumerate(want):
        torch.testing.assert_close(request.states[:, row], expected, rtol=0, atol=0)
    assert request.states[:, 4:].isnan().all()  # nothing past the rows computed
