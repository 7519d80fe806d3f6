"""The settings of one baseline run; scorers read theirs in ``from_inputs``."""

from __future__ import annotations

from dataclasses import dataclass

from actmap.baselines.actvit import PRECISIONS
from actmap.baselines.entailment import JUDGE_PROMPTS
from actmap.defaults import N_SAMPLES, SAMPLE_TEMPERATURE, SAMPLE_TOP_P
from actmap.errors import ActmapUserError
from actmap.llm.models import check_dtype

ACTVIT_GRIDS = ("full", "small", "selected")


@dataclass(frozen=True)
class BaselineOptions:
    """Settings of one `run_baselines` call; the relevant ones are recorded with each result."""

    force: bool = False  # recompute methods whose stored results already cover the rows
    model: str | None = None  # generator for P(True) and sampling; None = the store's own model
    device: str | None = None  # "cpu" | "cuda"; None = cuda when available
    judge: str | None = "qwen2.5-coder-1.5b-instruct"  # SE's LLM judge (name or path); None = none
    judge_dtype: str = "float32"  # the LLM judge's weights; not float32: part of its name
    judge_prompt: str = "entailment"  # "entailment" (Nature prompt) | "same_answer" (yes/no)
    instruct: bool = True  # RAUQ's alpha rule; every generator in the paper is instruction-tuned
    tad_previous: int | None = None  # TAD's K; None = min(10, attention keys in the store)
    n_samples: int = N_SAMPLES  # SE and EigenScore: answers sampled per prompt
    temperature: float = SAMPLE_TEMPERATURE  # Nature SE sampling
    top_p: float = SAMPLE_TOP_P  # Nature SE sampling
    sample_max_new_tokens: int | None = None  # None = the store's capture max_new_tokens
    sample_seed: int = 0  # each row's sampling seed derives from it and the row id
    # prompts per samples shard: a killed run loses fewer; one sampled prompt of a 1.5B model
    # costs a minute of one CPU thread, a shard write milliseconds
    samples_commit_every: int = 4
    ptrue_batch_size: int = 8  # verification prompts per forward pass
    # "full" (24 configs), "small" (6), "selected" (1: ACTViTConfig(), the paper's selected
    # configuration), or a tuple of ACTViTConfigs
    actvit_grid: str | tuple = "full"
    actvit_epochs: int | None = 15  # ACT-ViT's published 15 epochs; None = each config's own
    actvit_seeds: tuple[int, ...] = (42, 123, 456)  # selection seed first, then retrains
    actvit_micro_batch: int | None = None  # rows per forward pass (memory); None = whole batch
    actvit_precision: str = "float32"  # a named grid's forward pass: float32 | bfloat16 (autocast)
    permuted_inner: str = "tad"  # the supervised scorer permuted_label refits on shuffled labels
    score_chunk: int = 64  # rows per score() call: progress and judge-cache saves in between

    def __post_init__(self) -> None:
        if self.n_samples < 2:
            raise ActmapUserError(
                f"n_samples must be >= 2 (SE and EigenScore), got {self.n_samples}"
            )

        if self.actvit_precision not in PRECISIONS:
            raise ActmapUserError(
                f"actvit_precision must be one of {', '.join(PRECISIONS)}, "
                f"got {self.actvit_precision!r}"
            )
        if self.actvit_micro_batch is not None and self.actvit_micro_batch < 1:
            raise ActmapUserError(f"actvit_micro_batch must be >= 1, got {self.actvit_micro_batch}")
        if self.score_chunk < 1 or self.samples_commit_every < 1:
            raise ActmapUserError("score_chunk and samples_commit_every must be >= 1")

        check_dtype(self.judge_dtype)

        if self.judge_prompt not in JUDGE_PROMPTS:
            raise ActmapUserError(
                f"judge_prompt must be one of {', '.join(JUDGE_PROMPTS)}, got {self.judge_prompt!r}"
            )
        if isinstance(self.actvit_grid, str) and self.actvit_grid not in ACTVIT_GRIDS:
            raise ActmapUserError(
                f"actvit_grid must be one of {', '.join(ACTVIT_GRIDS)}, got {self.actvit_grid!r}"
            )
