"""ACT-ViT baseline: a small ViT over the dense (layer x token x hidden) activation tensor.

The straight line (BASELINES.md Part B section 1, decision 9; paper appendix
"ACT-ViT Reproduction Protocol"):

    Generation.dense (L, min(T, 100), D) float16, row t = state that produced token t
    -> pad_tokens       (L, 100, D)     first 100 tokens, zero rows appended
    -> pool_layers      (8, 100, D)     layer axis padded to a multiple of 8, max over 8 groups
    -> ACTViT           per-LLM Linear(D -> D') on every cell, (p_h, p_w) patches, ViT, CLS -> logit
    -> sigmoid          p(correct)

Training follows ACT-ViT's own published protocol, not the ActMap recipe:
AdamW lr 1e-3, BCE-with-logits (positive = correct), batch 128, 15 epochs,
per-step cosine schedule with a 10% step warm-up, checkpoint on strict
improvement of validation AUROC. `run_sweep` searches the 24-configuration
grid with seed 42 and retrains the selected configuration with 123 and 456.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import logging
import math
import shutil
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from sklearn.metrics import roc_auc_score
from torch import nn

from actmap.artifacts import package_version
from actmap.atomic import atomic_path, atomic_write_text
from actmap.baselines.base import BaselineUnavailable
from actmap.device import resolve_device
from actmap.maps import DENSE_LAYER_GROUPS, FLOAT16_MAX, PadMode, pool_layers, saturated_float16
from actmap.scoring.contract import ScoreResult, bundle_part
from actmap.training.recipe import (
    EpochOutcome,
    deterministic_torch,
    seed_everything,
    select_epoch,
)

logger = logging.getLogger(__name__)

N_MAX = 100  # ACT-ViT's fixed token axis (first generated tokens)
LAYER_GROUPS = DENSE_LAYER_GROUPS  # ACT-ViT's L_eff: layer axis max-pooled to 8 contiguous groups
PRECISIONS = ("float32", "bfloat16")  # bfloat16: autocast (mixed precision), float32 weights
EVAL_BATCH = 256  # rows per inference pass unless a micro batch bounds it
RESULT_SCHEMA_VERSION = 1
SHARD_SCHEMA_VERSION = 1

# --------------------------------------------------------------------------- preprocessing


def pad_tokens(dense: torch.Tensor, n_max: int = N_MAX) -> torch.Tensor:
    """Keep the first `n_max` generated tokens, or append all-zero token rows up to `n_max`.

    (L, N, D) -> (L, n_max, D). No mask is carried forward (as upstream).
    """
    if dense.ndim != 3:
        raise ValueError(f"dense must be (L, N, D), got shape {tuple(dense.shape)}")
    if n_max < 1:
        raise ValueError(f"n_max must be >= 1, got {n_max}")
    n_layers, n_tokens, d_model = dense.shape
    if n_tokens >= n_max:
        return dense[:, :n_max]
    pad = dense.new_zeros(n_layers, n_max - n_tokens, d_model)
    return torch.cat([dense, pad], dim=1)  # (L, n_max, D)


def actvit_tensor(
    dense: torch.Tensor,
    n_max: int = N_MAX,
    groups: int = LAYER_GROUPS,
    pad_mode: PadMode = "zero",
) -> torch.Tensor:
    """One generation's dense states (L, N, D) -> ACT-ViT input (groups, n_max, D) float16."""
    return pool_layers(pad_tokens(dense, n_max), groups, pad_mode).to(torch.float16)


def tensor_nbytes(d_model: int, n_max: int = N_MAX, groups: int = LAYER_GROUPS) -> int:
    """Bytes of one float16 ACT-ViT input row: groups * n_max * D * 2."""
    return groups * n_max * d_model * 2


def _as_batch(rows: Any, pad_mode: PadMode = "zero") -> torch.Tensor:
    """Stack scorer inputs into (n, 8, 100, D) float16.

    Accepts a stacked tensor, a sequence of (8, 100, D) tensors, or a sequence
    of `Generation` records whose `dense` field is set (preprocessed here).
    """
    if isinstance(rows, torch.Tensor):
        batch = rows
    else:
        rows = list(rows)
        if not rows:
            raise ValueError("no rows given")
        tensors = []
        for i, row in enumerate(rows):
            if isinstance(row, torch.Tensor):
                tensors.append(row)
            elif hasattr(row, "dense"):
                if row.dense is None:
                    raise BaselineUnavailable(
                        f"row {i} has no dense hidden states; capture with keep_dense=True"
                    )
                tensors.append(actvit_tensor(row.dense, pad_mode=pad_mode))
            else:
                raise ValueError(f"row {i}: expected a tensor or a Generation, got {type(row)}")
        shapes = {tuple(t.shape) for t in tensors}
        if len(shapes) != 1:
            raise ValueError(f"rows have different shapes: {sorted(shapes)}")
        batch = torch.stack(tensors)
    if batch.ndim != 4 or batch.shape[1] != LAYER_GROUPS or batch.shape[2] != N_MAX:
        raise ValueError(
            f"ACT-ViT inputs must be (n, {LAYER_GROUPS}, {N_MAX}, D), got {tuple(batch.shape)}"
        )
    return _saturate(batch.to(torch.float16))


def _saturate(batch: torch.Tensor) -> torch.Tensor:
    """±inf (a state beyond float16's range when the dense table was written: Gemma-3's
    residual stream reaches 6e4) becomes ±65504, the nearest float16; NaN is an error."""

    def rows_with(mask: torch.Tensor) -> list[int]:
        return mask.flatten(1).any(1).nonzero().flatten().tolist()

    bad = ~torch.isfinite(batch)
    if not bad.any():
        return batch
    nan = torch.isnan(batch)
    if nan.any():
        raise ValueError(f"ACT-ViT inputs hold NaN in rows {rows_with(nan)[:10]} (of {len(batch)})")
    logger.warning(
        "ACT-ViT: %d values in %d rows beyond the float16 range saturated to ±%g",
        int(bad.sum()),
        len(rows_with(bad)),
        FLOAT16_MAX,
    )
    return saturated_float16(batch)


# --------------------------------------------------------------------------- artifacts


def _atomic_save(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """safetensors written through the one atomic writer (no torn files)."""
    with atomic_path(path) as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()}, tmp, metadata=metadata)


# --------------------------------------------------------------------------- model


def _check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")


@dataclass(frozen=True)
class ACTViTConfig:
    """One point of the ACT-ViT search space plus its training protocol."""

    dim: int = 128  # ViT width; grid {128, 1024}; 128 is the paper's selected value
    depth: int = 1  # encoder blocks; grid {1, 3}
    weight_decay: float = 1e-3  # AdamW decoupled decay; grid {1, 1e-3}
    patch: tuple[int, int] = (4, 2)  # (layer groups, tokens) per patch; grid (1,1) (8,1) (4,2)
    heads: int = 4  # fixed by the protocol
    dim_head: int = 64  # vit-pytorch default; not pinned down upstream
    mlp_dim: int | None = None  # MLP width; None = 2 * dim (vit-pytorch examples' ratio)
    adapter_dim: int | None = None  # D' of the per-LLM adapter; None = dim (BASELINES B1 step 4)
    dropout: float = 0.3  # attention and MLP dropout, fixed by the protocol
    emb_dropout: float = 0.3  # same value as dropout (BASELINES: inferred)
    lr: float = 1e-3  # fixed by the protocol
    epochs: int = 15  # every configuration runs all 15 (released patience 30 > 15)
    batch_size: int = 128  # published batch size
    warmup_fraction: float = 0.1  # warm-up over 10% of all optimizer steps, then cosine
    # the forward pass's matmuls: float32, or bfloat16 under autocast (weights, optimizer
    # and loss stay float32); part of the configuration because it changes the result
    precision: str = "float32"

    def __post_init__(self) -> None:
        _check_precision(self.precision)
        if len(self.patch) != 2 or LAYER_GROUPS % self.patch[0] or N_MAX % self.patch[1]:
            raise ValueError(f"patch {self.patch} must divide the ({LAYER_GROUPS}, {N_MAX}) grid")
        if self.dim < 1 or self.depth < 1 or self.heads < 1 or self.dim_head < 1:
            raise ValueError("dim, depth, heads and dim_head must be >= 1")
        if not 0.0 <= self.warmup_fraction < 1.0:
            raise ValueError(f"warmup_fraction must be in [0, 1), got {self.warmup_fraction}")

    def label(self) -> str:
        """The grid coordinates in a few words: ``width 128, depth 1, decay 0.001, patch 4x2``."""
        p = f"width {self.dim}, depth {self.depth}, decay {self.weight_decay:g}"
        p += f", patch {self.patch[0]}x{self.patch[1]}"
        return p if self.precision == "float32" else f"{p}, {self.precision}"

    @property
    def resolved_mlp_dim(self) -> int:
        return self.mlp_dim if self.mlp_dim is not None else 2 * self.dim

    @property
    def resolved_adapter_dim(self) -> int:
        return self.adapter_dim if self.adapter_dim is not None else self.dim

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["patch"] = list(self.patch)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ACTViTConfig:
        return cls(**{**d, "patch": tuple(d["patch"])})


# hidden {128, 1024} x depth {1, 3} x weight decay {1, 1e-3} x patch {(1,1), (8,1), (4,2)}
SWEEP_GRID: tuple[ACTViTConfig, ...] = tuple(
    ACTViTConfig(dim=dim, depth=depth, weight_decay=wd, patch=patch)
    for dim, depth, wd, patch in itertools.product(
        (128, 1024), (1, 3), (1.0, 1e-3), ((1, 1), (8, 1), (4, 2))
    )
)


class ActVitAttention(nn.Module):
    """Pre-norm multi-head self-attention (no mask: zero-padded tokens are visible, as upstream).

    vit-pytorch's layout, which ACT-ViT's checkpoints and parameter counts follow: the
    LayerNorm inside, ``dim_head`` apart from ``dim``, no qkv bias. The map ViT's
    `actmap.detectors.vit.Attention` is timm's (norm in the block, qkv bias, its own dropout
    masks); the two are kept apart so each matches its paper's parameter count."""

    def __init__(self, dim: int, heads: int, dim_head: int, dropout: float):
        super().__init__()
        self.heads = heads
        self.dropout = dropout
        inner = heads * dim_head
        self.norm = nn.LayerNorm(dim)
        self.to_qkv = nn.Linear(dim, 3 * inner, bias=False)
        self.to_out = nn.Sequential(nn.Linear(inner, dim), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        qkv = self.to_qkv(self.norm(x))  # (B, n, 3 * H * Dh)
        q, k, v = qkv.view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)  # 3 x (B, H, n, Dh)
        p = self.dropout if self.training else 0.0
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=p)  # (B, H, n, Dh)
        return self.to_out(out.transpose(1, 2).reshape(b, n, -1))  # (B, n, dim)


class ActVitFeedForward(nn.Module):
    """Pre-norm GELU MLP."""

    def __init__(self, dim: int, hidden: int, dropout: float):
        super().__init__()
        self.net = nn.Sequential(
            nn.LayerNorm(dim),
            nn.Linear(dim, hidden),
            nn.GELU(),
            nn.Dropout(dropout),
            nn.Linear(hidden, dim),
            nn.Dropout(dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class ActVitBlock(nn.Module):
    def __init__(self, dim: int, heads: int, dim_head: int, mlp_dim: int, dropout: float):
        super().__init__()
        self.attn = ActVitAttention(dim, heads, dim_head, dropout)
        self.ff = ActVitFeedForward(dim, mlp_dim, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x)
        return x + self.ff(x)


def patchify(x: torch.Tensor, patch: tuple[int, int]) -> torch.Tensor:
    """(B, G, N, C) -> (B, (G / p_h) * (N / p_w), p_h * p_w * C), patches in row-major order.

    Each patch flattens as (row within patch, column within patch, channel),
    the vit-pytorch `(p1 p2 c)` order.
    """
    b, g, n, c = x.shape
    ph, pw = patch
    x = x.reshape(b, g // ph, ph, n // pw, pw, c)  # (B, G', p_h, N', p_w, C)
    x = x.permute(0, 1, 3, 2, 4, 5)  # (B, G', N', p_h, p_w, C)
    return x.reshape(b, (g // ph) * (n // pw), ph * pw * c)  # (B, P, p_h * p_w * C)


class ACTViT(nn.Module):
    """Per-LLM adapter + vit-pytorch style ViT over the (8, 100, D) activation grid."""

    def __init__(
        self,
        d_model: int,
        adapter_dim: int,
        dim: int,
        depth: int,
        heads: int,
        dim_head: int,
        mlp_dim: int,
        patch: tuple[int, int],
        dropout: float,
        emb_dropout: float,
        groups: int = LAYER_GROUPS,
        n_tokens: int = N_MAX,
        precision: str = "float32",
    ):
        super().__init__()
        _check_precision(precision)
        self.precision = precision
        if groups % patch[0] or n_tokens % patch[1]:
            raise ValueError(f"patch {patch} must divide the ({groups}, {n_tokens}) grid")
        self.d_model, self.groups, self.n_tokens, self.patch = d_model, groups, n_tokens, patch
        n_patches = (groups // patch[0]) * (n_tokens // patch[1])
        patch_dim = patch[0] * patch[1] * adapter_dim
        # the only LLM-specific part; applied to every (group, token) cell after pooling
        self.adapter = nn.Linear(d_model, adapter_dim)
        self.patch_embed = nn.Sequential(
            nn.LayerNorm(patch_dim), nn.Linear(patch_dim, dim), nn.LayerNorm(dim)
        )
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim))
        self.pos_embedding = nn.Parameter(torch.randn(1, n_patches + 1, dim))
        self.emb_dropout = nn.Dropout(emb_dropout)
        self.blocks = nn.ModuleList(
            ActVitBlock(dim, heads, dim_head, mlp_dim, dropout) for _ in range(depth)
        )
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 1)

    @classmethod
    def from_config(cls, config: ACTViTConfig, d_model: int) -> ACTViT:
        return cls(
            d_model=d_model,
            adapter_dim=config.resolved_adapter_dim,
            dim=config.dim,
            depth=config.depth,
            heads=config.heads,
            dim_head=config.dim_head,
            mlp_dim=config.resolved_mlp_dim,
            patch=config.patch,
            dropout=config.dropout,
            emb_dropout=config.emb_dropout,
            precision=config.precision,
        )

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """(B, 8, 100, D) -> (B, dim), the normalized CLS token."""
        expected = (self.groups, self.n_tokens, self.d_model)
        if x.ndim != 4 or tuple(x.shape[1:]) != expected:
            raise ValueError(
                f"ACTViT expects (B, {', '.join(map(str, expected))}), got {tuple(x.shape)}"
            )
        x = self.adapter(x.to(self.adapter.weight.dtype))  # (B, G, N, D')
        x = self.patch_embed(patchify(x, self.patch))  # (B, P, dim)
        cls = self.cls_token.expand(x.shape[0], -1, -1)  # (B, 1, dim)
        x = torch.cat([cls, x], dim=1) + self.pos_embedding  # (B, P + 1, dim)
        x = self.emb_dropout(x)
        for block in self.blocks:
            x = block(x)
        return self.norm(x)[:, 0]  # (B, dim)

    def forward_head(self, features: torch.Tensor) -> torch.Tensor:
        return self.head(features).squeeze(-1)  # (B,) logit of "correct"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, 8, 100, D) -> (B,) float32 logits; bfloat16 precision runs under autocast."""
        bf16 = self.precision == "bfloat16"
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=bf16):
            return self.forward_head(self.forward_features(x)).float()


def count_parameters(model: nn.Module) -> int:
    """Trainable parameters."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


# --------------------------------------------------------------------------- training


class LabeledTensors(NamedTuple):
    """ACT-ViT inputs and their labels (1 = correct)."""

    x: torch.Tensor  # (n, 8, 100, D) float16
    y: np.ndarray  # (n,) {0, 1}


def _check_split(split: Any, name: str, need_both_classes: bool) -> LabeledTensors:
    x, y = split
    x = _as_batch(x)
    y = np.asarray(y)
    if y.ndim != 1 or y.shape[0] != x.shape[0]:
        raise ValueError(f"{name}: labels shape {y.shape} does not match {x.shape[0]} rows")
    if not np.isin(y, (0, 1)).all():
        raise ValueError(f"{name}: labels must be 0/1 (1 = correct)")
    if need_both_classes and len(np.unique(y)) < 2:
        raise ValueError(f"{name}: AUROC needs both correct and incorrect rows")
    return LabeledTensors(x, y.astype(np.float32))


@contextmanager
def seeded(seed: int) -> Iterator[torch.Generator]:
    """The recipe's seeding and deterministic settings (restored after); yields the data-order generator."""
    seed_everything(seed)
    with deterministic_torch():
        yield torch.Generator().manual_seed(seed)


@torch.no_grad()
def predict_proba(
    model: ACTViT,
    x: torch.Tensor,
    batch_size: int | None = None,
    device: torch.device | None = None,
) -> np.ndarray:
    """p(correct) for every row of x (n, 8, 100, D), float64; ``batch_size`` rows per pass
    (None: ``EVAL_BATCH``; training passes its micro batch)."""
    batch_size = batch_size or EVAL_BATCH
    device = device or next(model.parameters()).device
    model.eval()
    out = [
        torch.sigmoid(model(x[i : i + batch_size].to(device).float())).double().cpu()
        for i in range(0, x.shape[0], batch_size)
    ]
    return torch.cat(out).numpy()


@dataclass(frozen=True)
class EpochStats:
    epoch: int
    train_loss: float
    val_auroc: float


@dataclass(frozen=True)
class ActVitSeedRun:
    """One trained configuration at one seed, at its best-validation epoch."""

    seed: int
    best_epoch: int
    val_auroc: float
    history: tuple[EpochStats, ...]
    state: dict[str, torch.Tensor] = field(repr=False)  # selected checkpoint, on CPU
    test_auroc: float | None = None
    test_scores: np.ndarray | None = field(default=None, repr=False)  # (n_test,) p(correct)


def _check_micro_batch(micro_batch: int | None) -> None:
    if micro_batch is not None and micro_batch < 1:
        raise ValueError(f"micro_batch must be >= 1 or None, got {micro_batch}")


def train_config(
    config: ACTViTConfig,
    train: Any,
    val: Any,
    test: Any | None = None,
    seed: int = 42,
    device: str | torch.device | None = None,
    micro_batch: int | None = None,
    on_epoch: Callable[[int], None] | None = None,
) -> ActVitSeedRun:
    """Train one configuration with one seed; evaluate its best-validation checkpoint on test once.

    `train`, `val`, `test` are `(x (n, 8, 100, D), y (n,))` with y = 1 for correct.
    ``micro_batch`` bounds the rows of one forward pass: each step's batch of
    ``config.batch_size`` rows is run in slices of that many rows whose gradients add up to
    the batch's (the loss is the batch mean, so the step is the same up to float rounding and
    dropout's draws). It trades speed for memory: at width 1024 with 1x1 patches, a batch of
    128 rows holds about 14 GB of attention activations. ``on_epoch(k)`` is called after the
    k-th epoch (1-based).
    """
    _check_micro_batch(micro_batch)
    train = _check_split(train, "train", need_both_classes=False)
    val = _check_split(val, "val", need_both_classes=True)
    if test is not None:
        test = _check_split(test, "test", need_both_classes=True)
    device = resolve_device(device)
    d_model = train.x.shape[-1]
    if val.x.shape[-1] != d_model:
        raise ValueError(f"val hidden size {val.x.shape[-1]} != train hidden size {d_model}")
    n = train.x.shape[0]
    steps_per_epoch = math.ceil(n / config.batch_size)
    total_steps = steps_per_epoch * config.epochs
    warmup_steps = int(config.warmup_fraction * total_steps)
    y_train = torch.from_numpy(train.y)

    with seeded(seed) as data_gen:
        from transformers import get_cosine_schedule_with_warmup

        model = ACTViT.from_config(config, d_model).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
        sched = get_cosine_schedule_with_warmup(opt, warmup_steps, total_steps)  # warm-up + cosine
        history = []

        def train_epoch(epoch: int) -> float:
            model.train()
            order = torch.randperm(n, generator=data_gen)
            loss_sum = 0.0
            for i in range(0, n, config.batch_size):
                idx = order[i : i + config.batch_size]
                opt.zero_grad(set_to_none=True)
                for part in idx.split(micro_batch or len(idx)):
                    xb = train.x[part].to(device).float()  # (b, 8, 100, D)
                    yb = y_train[part].to(device)
                    loss = F.binary_cross_entropy_with_logits(model(xb), yb, reduction="sum")
                    (loss / len(idx)).backward()  # gradients add up to the batch mean's
                    loss_sum += loss.item()
                opt.step()
                sched.step()  # per step
            return loss_sum / n

        def validate_epoch() -> tuple[float, float]:
            p_val = predict_proba(model, val.x, micro_batch, device)
            return float(roc_auc_score(val.y, p_val)), math.nan

        def record(o: EpochOutcome) -> None:
            history.append(EpochStats(o.epoch, o.train_loss, o.val_score))
            if on_epoch is not None:
                on_epoch(o.epoch + 1)
            logger.debug(
                "seed %d epoch %d loss %.4f val AUROC %.4f",
                seed,
                o.epoch,
                o.train_loss,
                o.val_score,
            )

        selection = select_epoch(model, config.epochs, train_epoch, validate_epoch, None, record)
        best_auroc, best_epoch, best_state = (
            selection.best_score,
            selection.best_epoch,
            selection.state,
        )

        test_auroc, test_scores = None, None
        if test is not None:
            model.load_state_dict(best_state)
            test_scores = predict_proba(model, test.x, micro_batch, device)
            test_auroc = float(roc_auc_score(test.y, test_scores))
    return ActVitSeedRun(
        seed, best_epoch, best_auroc, tuple(history), best_state, test_auroc, test_scores
    )


# --------------------------------------------------------------------------- sweep


@dataclass(frozen=True)
class ConfigResult:
    config: ACTViTConfig
    val_auroc: float  # best-epoch validation AUROC with the selection seed
    best_epoch: int
    n_params: int


@dataclass(frozen=True)
class SweepResult:
    """Every configuration's validation AUROC, the selected one, and its runs per seed."""

    d_model: int
    grid: tuple[ConfigResult, ...]
    selected: ACTViTConfig
    n_params: int  # of the selected configuration
    runs: tuple[ActVitSeedRun, ...]  # selection seed first

    @property
    def test_auroc_mean(self) -> float | None:
        values = [r.test_auroc for r in self.runs]
        return None if any(v is None for v in values) else float(np.mean(values))

    def save(self, directory: str | Path) -> Path:
        """result.json + one safetensors per seed (checkpoint, test scores). Never pickle."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        meta = {
            "method": "actvit",
            "schema_version": RESULT_SCHEMA_VERSION,
            "actmap_version": package_version(),
            "d_model": self.d_model,
            "selected": self.selected.to_dict(),
            "n_params": self.n_params,
            "test_auroc_mean": self.test_auroc_mean,
            "grid": _config_records(self.grid),
            "runs": [],
        }
        for run in self.runs:
            file = f"seed-{run.seed}.safetensors"
            meta["runs"].append(_save_run(run, self.selected, directory / file))
        atomic_write_text(directory / "result.json", json.dumps(meta, indent=2))
        return directory

    @classmethod
    def load(cls, directory: str | Path) -> SweepResult:
        directory = Path(directory)
        meta = json.loads((directory / "result.json").read_text())
        return cls(
            d_model=meta["d_model"],
            grid=_config_results(meta["grid"]),
            selected=ACTViTConfig.from_dict(meta["selected"]),
            n_params=meta["n_params"],
            runs=tuple(_load_run(r, directory) for r in meta["runs"]),
        )


def _config_records(results: Sequence[ConfigResult]) -> list[dict]:
    return [{**dataclasses.asdict(g), "config": g.config.to_dict()} for g in results]


def _config_results(rows: list[dict]) -> tuple[ConfigResult, ...]:
    return tuple(ConfigResult(**{**g, "config": ACTViTConfig.from_dict(g["config"])}) for g in rows)


def _save_run(run: ActVitSeedRun, config: ACTViTConfig, path: Path) -> dict:
    """One seed's checkpoint (and test scores) as safetensors; returns its JSON record."""
    tensors = {f"state.{k}": v for k, v in run.state.items()}
    if run.test_scores is not None:
        tensors["test_scores"] = torch.from_numpy(np.asarray(run.test_scores, np.float64))
    _atomic_save(tensors, path, {"config": json.dumps(config.to_dict())})
    return {**_save_meta(run), "file": path.name}


def _save_meta(run: ActVitSeedRun) -> dict:
    return {
        "seed": run.seed,
        "best_epoch": run.best_epoch,
        "val_auroc": run.val_auroc,
        "test_auroc": run.test_auroc,
        "history": [dataclasses.asdict(h) for h in run.history],
    }


def _load_run(record: dict, directory: Path) -> ActVitSeedRun:
    tensors = load_file(str(directory / record["file"]))
    state = {k[len("state.") :]: v for k, v in tensors.items() if k.startswith("state.")}
    scores = tensors.get("test_scores")
    return ActVitSeedRun(
        seed=record["seed"],
        best_epoch=record["best_epoch"],
        val_auroc=record["val_auroc"],
        history=tuple(EpochStats(**h) for h in record["history"]),
        state=state,
        test_auroc=record["test_auroc"],
        test_scores=None if scores is None else scores.numpy(),
    )


SWEEP_PROGRESS = "sweep-progress.json"
SWEEP_FOLDER = "actvit-sweeps"  # in a store: one folder per sweep key


def sweep_key(grid: Sequence[ACTViTConfig], seed: int, train: Any, val: Any) -> str:
    """What a sweep's partial results hold for: the grid, the selection seed and the rows."""
    digest = hashlib.sha256(json.dumps([[c.to_dict() for c in grid], seed]).encode())
    for split in (train, val):
        digest.update(split.x.detach().cpu().contiguous().numpy().tobytes())
        digest.update(np.asarray(split.y, np.float32).tobytes())
    return digest.hexdigest()[:20]


class SweepProgress:
    """The configurations a sweep has trained and its best run so far, kept in ``folder`` after
    each configuration so a killed sweep resumes at the next one (CPU sweeps take hours).

    ``sweep-progress.json`` names the best run's checkpoint file; a new best is written under
    a new name before the JSON points at it, so a kill between the two leaves the old pair."""

    def __init__(self, folder: Path, key: str) -> None:
        self.folder = Path(folder) / key
        self.path = self.folder / SWEEP_PROGRESS

    def load(self) -> tuple[list[ConfigResult], ActVitSeedRun | None, int]:
        if not self.path.exists():
            return [], None, -1
        try:
            meta = json.loads(self.path.read_text(encoding="utf-8"))
            return (
                list(_config_results(meta["grid"])),
                _load_run(meta["best_run"], self.folder),
                meta["best"],
            )
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise ValueError(
                f"{self.path}: unreadable sweep progress ({err!r}); move it away"
            ) from None

    def save(self, results: list[ConfigResult], best_run: ActVitSeedRun, best: int) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        file = self.folder / f"best-config-{best}.safetensors"
        if not file.exists():
            _save_run(best_run, results[best].config, file)
        meta = {
            "grid": _config_records(results),
            "best": best,
            "best_run": {**_save_meta(best_run), "file": file.name},
        }
        atomic_write_text(self.path, json.dumps(meta, indent=1))
        for old in self.folder.glob("best-config-*.safetensors"):
            if old != file:
                old.unlink()

    def clear(self) -> None:
        """The sweep is done (its result is the caller's to keep): drop the partial state."""
        shutil.rmtree(self.folder, ignore_errors=True)


def run_sweep(
    train: Any,
    val: Any,
    test: Any | None = None,
    *,
    seed: int = 42,
    retrain_seeds: Sequence[int] = (123, 456),
    grid: Sequence[ACTViTConfig] = SWEEP_GRID,
    epochs: int | None = None,
    device: str | torch.device | None = None,
    progress_dir: str | Path | None = None,
    micro_batch: int | None = None,
    progress: Callable[[int, int, str], None] | None = None,
) -> SweepResult:
    """Train every grid configuration with `seed`, select by validation AUROC, retrain with the rest.

    Ties between configurations keep the earlier grid entry. The test split is
    only scored with each seed's selected checkpoint, never used to select. With
    ``progress_dir``, each finished configuration is kept there (`SweepProgress`, under a key
    of the grid, seed and rows) until the sweep returns, and a rerun of the same sweep after
    a kill starts at the next configuration. ``micro_batch``: see `train_config` (it bounds
    memory, not the result, so it is not part of the sweep's key). ``progress(done, total,
    info)`` counts epochs over the whole sweep, retrains included, after every epoch.
    """
    if not grid:
        raise ValueError("grid is empty")
    if epochs is not None:
        grid = [dataclasses.replace(c, epochs=epochs) for c in grid]
    train = _check_split(train, "train", need_both_classes=False)
    val = _check_split(val, "val", need_both_classes=True)
    d_model = train.x.shape[-1]

    kept = None
    if progress_dir is not None:
        kept = SweepProgress(Path(progress_dir), sweep_key(grid, seed, train, val))
    results, best_run, best_i = kept.load() if kept is not None else ([], None, -1)
    if results:
        logger.info("sweep resumed after %d of %d configurations", len(results), len(grid))
    total = sum(c.epochs for c in grid) + len(retrain_seeds) * max(c.epochs for c in grid)
    # (the retrains' share is exact once a configuration is selected)
    done = sum(c.epochs for c in grid[: len(results)])

    def epochs_of(what: str, epochs: int) -> Callable[[int], None] | None:
        if progress is None:
            return None
        start = done

        def report(k: int) -> None:
            progress(start + k, total, f"{what} epoch {k}/{epochs}")

        progress(start, total, f"{what} epoch 0/{epochs}")
        return report

    for i, config in enumerate(grid):
        if i < len(results):
            continue
        what = f"config {i + 1}/{len(grid)} ({config.label()})"
        run = train_config(
            config, train, val, None, seed, device, micro_batch, epochs_of(what, config.epochs)
        )
        done += config.epochs
        n_params = count_parameters(ACTViT.from_config(config, d_model))
        results.append(ConfigResult(config, run.val_auroc, run.best_epoch, n_params))
        logger.info("%s: val AUROC %.4f", what, run.val_auroc)
        if best_run is None or run.val_auroc > best_run.val_auroc:
            best_run, best_i = run, i
        if kept is not None:
            kept.save(results, best_run, best_i)
    selected = grid[best_i]
    total = sum(c.epochs for c in grid) + len(retrain_seeds) * selected.epochs  # now exact

    runs = [_score_test(selected, best_run, test, d_model, device, micro_batch)]
    for s in retrain_seeds:
        report = epochs_of(f"seed {s} ({selected.label()})", selected.epochs)
        runs.append(train_config(selected, train, val, test, s, device, micro_batch, report))
        done += selected.epochs
    if kept is not None:
        kept.clear()
    return SweepResult(d_model, tuple(results), selected, results[best_i].n_params, tuple(runs))


def _score_test(
    config: ACTViTConfig,
    run: ActVitSeedRun,
    test: Any | None,
    d_model: int,
    device: Any,
    micro_batch: int | None = None,
) -> ActVitSeedRun:
    """The selection seed's checkpoint, scored once on test."""
    if test is None:
        return run
    test = _check_split(test, "test", need_both_classes=True)
    model = ACTViT.from_config(config, d_model)
    model.load_state_dict(run.state)
    scores = predict_proba(model.to(resolve_device(device)), test.x, micro_batch)
    auroc = float(roc_auc_score(test.y, scores))
    return dataclasses.replace(run, test_auroc=auroc, test_scores=scores)


# --------------------------------------------------------------------------- scorer


class ACTViTScorer:
    """The scorer contract over ACT-ViT: fit runs the sweep (or one fixed config), score gives p(correct).

    Inputs are a `DetectorInputs` bundle holding ``dense`` (n, 8, 100, D) states, or bare
    rows: (8, 100, D) tensors, one stacked (n, 8, 100, D) tensor, or `Generation` records
    captured with `keep_dense=True`. `confidence` comes
    from the first seed's checkpoint (the selection seed); the other seeds'
    scores are in `details["confidence_by_seed"]` so metrics can be averaged
    over seeds as the protocol reports them.
    """

    name: ClassVar[str] = "actvit"
    supervised: ClassVar[bool] = True
    requires: ClassVar[tuple[str, ...]] = ("dense",)
    probability: ClassVar[bool] = True

    @classmethod
    def from_inputs(cls, inputs) -> ACTViTScorer:
        """The grid, precision, epochs, seeds and device of the run's options.

        A named grid runs at ``actvit_precision``; a tuple of configurations keeps its own."""
        inputs.require_table("dense", cls.name)
        grid = inputs.options.actvit_grid
        if isinstance(grid, str):
            if grid == "full":
                grid = SWEEP_GRID
            elif grid == "small":  # the paper's selected width and depth; every decay and patch
                grid = tuple(c for c in SWEEP_GRID if c.dim == 128 and c.depth == 1)
            else:  # "selected", no sweep: the paper's selected configuration (ACTViTConfig())
                grid = (ACTViTConfig(),)
            precision = inputs.options.actvit_precision
            grid = tuple(dataclasses.replace(c, precision=precision) for c in grid)
        return cls(
            grid=tuple(grid),
            epochs=inputs.options.actvit_epochs,
            seeds=inputs.options.actvit_seeds,
            device=inputs.options.device,
            progress_dir=inputs.store.root / SWEEP_FOLDER,  # a killed sweep resumes
            micro_batch=inputs.options.actvit_micro_batch,
            progress=lambda done, total, info: inputs.report(cls.name, done, total, info),
        )

    @property
    def models_per_answer(self) -> int:
        """score() runs the checkpoint of every seed."""
        return len(self.seeds)

    def __init__(
        self,
        config: ACTViTConfig | None = None,
        seeds: Sequence[int] = (42, 123, 456),
        grid: Sequence[ACTViTConfig] = SWEEP_GRID,
        epochs: int | None = None,
        layer_pad_mode: PadMode = "zero",
        device: str | None = None,
        progress_dir: str | Path | None = None,
        micro_batch: int | None = None,
        progress: Callable[[int, int, str], None] | None = None,  # fit: epochs done, total
    ):
        _check_micro_batch(micro_batch)
        self.micro_batch = micro_batch
        self.progress = progress
        self.config = config
        self.progress_dir = progress_dir
        self.seeds = tuple(seeds)
        self.grid = tuple(grid)
        self.epochs = epochs
        self.layer_pad_mode = layer_pad_mode
        self.device = device

    def fit(
        self,
        train: Any,
        y_train: np.ndarray,
        val: Any | None = None,
        y_val: np.ndarray | None = None,
    ) -> ACTViTScorer:
        if val is None or y_val is None:
            raise ValueError(
                "ACT-ViT selects its epoch and configuration on validation rows: pass val"
            )
        if not self.seeds:
            raise ValueError("seeds is empty")
        grid = (self.config,) if self.config is not None else self.grid
        self.result_ = run_sweep(
            (self._batch(train), y_train),
            (self._batch(val), y_val),
            seed=self.seeds[0],
            retrain_seeds=self.seeds[1:],
            grid=grid,
            epochs=self.epochs,
            device=self.device,
            progress_dir=self.progress_dir,
            micro_batch=self.micro_batch,
            progress=self.progress,
        )
        device = resolve_device(self.device)
        self.models_ = []
        for run in self.result_.runs:
            model = ACTViT.from_config(self.result_.selected, self.result_.d_model)
            model.load_state_dict(run.state)
            self.models_.append(model.to(device).eval())
        return self

    def _batch(self, inputs: Any) -> torch.Tensor:
        return _as_batch(bundle_part(inputs, "dense", self.name), self.layer_pad_mode)

    def predict_proba_by_seed(self, inputs: Any) -> dict[int, np.ndarray]:
        """Each seed's checkpoint's (N,) p(correct), the selection seed first."""
        if not hasattr(self, "models_"):
            raise RuntimeError("ACTViTScorer used before fit")
        x = self._batch(inputs)
        return {
            run.seed: predict_proba(m, x, self.micro_batch)
            for run, m in zip(self.result_.runs, self.models_, strict=False)
        }

    def predict_proba(self, inputs: Any) -> np.ndarray:
        """(N,) p(correct) of the selection seed's checkpoint."""
        return self.predict_proba_by_seed(inputs)[self.result_.runs[0].seed]

    def score(self, inputs: Any) -> ScoreResult:
        by_seed = self.predict_proba_by_seed(inputs)
        confidence = by_seed[self.result_.runs[0].seed]
        return ScoreResult(
            confidence=confidence,
            raw=confidence.copy(),
            raw_name="p_correct",
            details={
                "config": self.result_.selected.to_dict(),
                "n_params": self.result_.n_params,
                "seeds": [r.seed for r in self.result_.runs],
                "val_auroc_by_seed": {r.seed: r.val_auroc for r in self.result_.runs},
                "confidence_by_seed": by_seed,
                "layer_pad_mode": self.layer_pad_mode,
                "d_model": self.result_.d_model,
                # every configuration the sweep trained: its best validation AUROC with the
                # selection seed, best epoch and parameter count (the sweep's own record)
                "grid": _config_records(self.result_.grid),
            },
        )
