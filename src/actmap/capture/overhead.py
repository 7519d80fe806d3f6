"""Capture overhead: hooked vs plain generation on the same prompts, interleaved repeats."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

from actmap.capture.generate import generate_batch, generate_plain
from actmap.capture.records import CaptureConfig


@dataclass(frozen=True)
class Overhead:
    plain_s: list[float]  # one wall time per repeat
    hooked_s: list[float]
    identical_tokens: bool

    @property
    def median_ratio(self) -> float:
        """Median over repeats of hooked / plain time (1.0 = no overhead)."""
        return statistics.median(h / p for h, p in zip(self.hooked_s, self.plain_s, strict=True))

    @property
    def overhead_pct(self) -> float:
        return 100.0 * (self.median_ratio - 1.0)

    @property
    def plain_spread_pct(self) -> float:
        """The plain runs' own spread: half their range, in % of their median (0 for one run).

        The same generation timed twice differs by about this much, so an overhead whose
        size is below it is not a measured cost (a negative one is noise, not a speed-up)."""
        median = statistics.median(self.plain_s)
        return 100.0 * (max(self.plain_s) - min(self.plain_s)) / 2.0 / median

    @property
    def within_noise(self) -> bool:
        """True when |overhead| is no larger than the plain runs' spread."""
        return abs(self.overhead_pct) <= self.plain_spread_pct

    def describe(self) -> str:
        """One line: '+3.2% (median of 3; plain runs spread +-5.0%: within noise)'."""
        verdict = "within noise" if self.within_noise else "beyond the plain runs' spread"
        return (
            f"{self.overhead_pct:+.1f}% (median of {len(self.plain_s)}; plain runs spread "
            f"±{self.plain_spread_pct:.1f}%: {verdict})"
        )


def measure_overhead(
    model, tokenizer, prompts: Sequence[str], config: CaptureConfig, repeats: int = 3
) -> Overhead:
    """Alternate plain and hooked generation of one batch; also check the tokens agree."""
    prompts = list(prompts)[: config.batch_size]
    generate_plain(model, tokenizer, prompts, config)  # warm-up, excluded
    plain_s, hooked_s, identical = [], [], True
    for _ in range(repeats):
        tick = time.perf_counter()
        plain = generate_plain(model, tokenizer, prompts, config)
        plain_s.append(time.perf_counter() - tick)
        tick = time.perf_counter()
        records = generate_batch(model, tokenizer, prompts, config)
        hooked_s.append(time.perf_counter() - tick)
        start = max(r.prompt_tokens for r in records)  # the left-padded prompt width
        for row, record in enumerate(records):
            identical &= record.token_ids == plain[row, start : start + record.n_tokens].tolist()
    return Overhead(plain_s, hooked_s, identical)
