"""The paper's training recipe (SPEC section 4), as small functions read top to bottom.

`train_detector` trains one module on one seed: AdamW, per-epoch warm-up +
cosine schedule, Gaussian input noise per map, batch mixup, BCE with
pos_weight = N-/N+, grad-norm clipping, validation AUROC each epoch, strict-
improvement checkpointing and early stopping. Seeds, test evaluation and run
folders are the experiments' side (`actmap.experiments.seeds`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import logging
import math
import os
import random
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from actmap.device import resolve_device
from actmap.scoring import metrics
from actmap.training import checkpoint as train_checkpoint

log = logging.getLogger(__name__)

ProgressCallback = Callable[[int, dict[str, float]], None]


CHECKPOINT_EVERY_S = 30.0  # train_detector's default: seconds of training a kill can lose

SCORING_PRECISIONS = ("float32", "bfloat16")  # of predict_logits and TrainConfig.precision
# torch.compile modes predict_logits takes; "reduce-overhead" replays CUDA graphs on a GPU
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclass(frozen=True)
class TrainConfig:
    """Hyperparameters of every detector's training (paper Table "training")."""

    lr: float = 1e-3  # AdamW peak learning rate
    weight_decay: float = 0.05  # AdamW decoupled weight decay
    batch_size: int = 64
    max_epochs: int = 80
    warmup_epochs: int = 5  # linear warm-up (e+1)/w, then cosine
    final_lr_multiplier: float = 0.01  # cosine ends at this fraction of lr
    patience: int = 20  # epochs without a strict val-AUROC improvement before stopping
    grad_clip: float = 1.0  # max global gradient norm
    input_noise_sigma: float = 0.08  # Gaussian noise per training map; 0 disables
    mixup_alpha: float = 0.2  # lambda ~ Beta(alpha, alpha) per batch; 0 disables mixup
    seeds: tuple[int, ...] = (42, 123, 456)  # run_seeds trains one detector per seed
    deterministic: bool = True  # deterministic torch algorithms and cuDNN while training
    device: str = "auto"  # "auto" = cuda when available, else cpu
    eval_batch_size: int = 256  # batch for validation/test scoring; does not change results
    # "bfloat16": forward passes (training and validation) under bf16 autocast, faster on
    # AVX512-BF16/AMX CPUs and GPUs; changes the numerics, so the paper's recipe keeps float32
    precision: str = "float32"

    def __post_init__(self) -> None:
        positive = ("lr", "batch_size", "max_epochs", "patience", "grad_clip", "eval_batch_size")
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"TrainConfig.{name} must be > 0, got {getattr(self, name)}")
        for name in ("weight_decay", "warmup_epochs", "input_noise_sigma", "mixup_alpha"):
            if getattr(self, name) < 0:
                raise ValueError(f"TrainConfig.{name} must be >= 0, got {getattr(self, name)}")
        if not 0.0 <= self.final_lr_multiplier <= 1.0:
            raise ValueError(
                f"TrainConfig.final_lr_multiplier must be in [0, 1], got {self.final_lr_multiplier}"
            )
        if len(self.seeds) == 0:
            raise ValueError("TrainConfig.seeds is empty")
        if self.precision not in SCORING_PRECISIONS:
            raise ValueError(
                f"TrainConfig.precision must be one of {SCORING_PRECISIONS}, got {self.precision!r}"
            )
        object.__setattr__(self, "seeds", tuple(int(s) for s in self.seeds))

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "seeds": list(self.seeds)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown TrainConfig fields: {', '.join(unknown)}")
        return cls(**data)


# --- determinism ---------------------------------------------------


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (all devices) global generators."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


@contextlib.contextmanager
def deterministic_torch(enabled: bool = True) -> Iterator[None]:
    """Deterministic algorithms and cuDNN inside the block; previous settings restored after."""
    previous = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )
    if enabled:
        # cuBLAS reads this once, at its first use; without it deterministic GEMMs only warn.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = previous[2:]


@dataclass
class Rngs:
    """Every random draw of one training run, seeded from its seed."""

    shuffle: torch.Generator  # CPU: batch order and mixup permutations
    noise: torch.Generator  # on the training device: input noise
    mixup: np.random.Generator  # Beta(alpha, alpha) mixing coefficients

    @classmethod
    def from_seed(cls, seed: int, device: torch.device) -> Rngs:
        return cls(
            shuffle=torch.Generator().manual_seed(seed),
            noise=torch.Generator(device=device).manual_seed(seed),
            mixup=np.random.default_rng(seed),
        )

    def states(self, device: torch.device) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """(torch generator states, the mixup generator's state): these and the global
        generators (dropout) are every random draw an epoch makes."""
        torch_states = {
            "global": torch.get_rng_state(),
            "shuffle": self.shuffle.get_state(),
            "noise": self.noise.get_state(),
        }
        if device.type == "cuda":
            torch_states["cuda"] = torch.cuda.get_rng_state(device)
        return torch_states, self.mixup.bit_generator.state

    def restore(
        self, torch_states: dict[str, torch.Tensor], mixup: dict[str, Any], device: torch.device
    ) -> None:
        """Put every generator back where `states` found it."""
        torch.set_rng_state(torch_states["global"])
        self.shuffle.set_state(torch_states["shuffle"])
        self.noise.set_state(torch_states["noise"])
        if device.type == "cuda":
            torch.cuda.set_rng_state(torch_states["cuda"], device)
        self.mixup.bit_generator.state = mixup


# --- the recipe's pieces ------------------------------------------------------


def lr_multiplier(epoch: int, cfg: TrainConfig) -> float:
    """Zero-indexed epoch -> lr multiplier: linear warm-up, then cosine to the final multiplier."""
    w = cfg.warmup_epochs
    if epoch < w:
        return (epoch + 1) / w
    progress = (epoch - w) / max(cfg.max_epochs - w, 1)  # short runs (max_epochs <= warm-up)
    f = cfg.final_lr_multiplier
    return f + (1.0 - f) / 2.0 * (1.0 + math.cos(math.pi * progress))


def positive_class_weight(labels: torch.Tensor) -> float:
    """pos_weight = N- / N+ for BCE-with-logits (1.0 on balanced splits)."""
    n_pos = int((labels == 1).sum())
    if n_pos == 0 or n_pos == len(labels):
        raise ValueError("training labels contain a single class")
    return (len(labels) - n_pos) / n_pos


def add_input_noise(x: torch.Tensor, sigma: float, generator: torch.Generator) -> torch.Tensor:
    """Independent Gaussian noise on every entry of every map."""
    if sigma == 0:
        return x
    return x + sigma * torch.randn(x.shape, generator=generator, device=x.device, dtype=x.dtype)


def sample_mixup(batch: int, alpha: float, rngs: Rngs) -> tuple[float, torch.Tensor]:
    """One lambda ~ Beta(alpha, alpha) for the batch and a random permutation of its rows."""
    perm = torch.randperm(batch, generator=rngs.shuffle)
    if alpha == 0:
        return 1.0, perm
    return float(rngs.mixup.beta(alpha, alpha)), perm


def mix(x: torch.Tensor, lam: float, perm: torch.Tensor) -> torch.Tensor:
    return lam * x + (1.0 - lam) * x[perm]  # (B, C, H, W)


def mixup_bce_loss(
    logits: torch.Tensor, y: torch.Tensor, lam: float, perm: torch.Tensor, pos_weight: torch.Tensor
) -> torch.Tensor:
    """lam * BCE(logits, y) + (1 - lam) * BCE(logits, y[perm]), each with pos_weight."""
    bce = F.binary_cross_entropy_with_logits
    return lam * bce(logits, y, pos_weight=pos_weight) + (1.0 - lam) * bce(
        logits, y[perm], pos_weight=pos_weight
    )


@dataclass
class EarlyStopping:
    """Model selection on a validation score: strict improvements only, ties keep the earlier."""

    patience: int
    best_score: float = -math.inf
    best_epoch: int = -1
    epochs_without_improvement: int = 0

    def update(self, epoch: int, score: float) -> bool:
        """Record one epoch's score; True when it strictly improves (NaN never does)."""
        if score > self.best_score:
            self.best_score, self.best_epoch = score, epoch
            self.epochs_without_improvement = 0
            return True
        self.epochs_without_improvement += 1
        return False

    @property
    def should_stop(self) -> bool:
        return self.epochs_without_improvement >= self.patience


@dataclass(frozen=True)
class EpochRecord:
    epoch: int
    train_loss: float  # mean mixup BCE over training maps
    val_loss: float  # mean unweighted BCE on validation maps
    val_auroc: float
    lr: float
    epoch_time_s: float
    improved: bool  # the checkpoint was replaced after this epoch


@dataclass
class TrainResult:
    best_epoch: int
    best_val_auroc: float
    history: list[EpochRecord]
    state_dict: dict[str, torch.Tensor]  # the selected (best-epoch) weights, on CPU
    wall_time_s: float
    device: str


# --- loops --------------------------------------------------------------------


def bf16_supported(device: torch.device) -> bool:
    """Whether bf16 matrix products run natively here (AVX512-BF16 / AMX CPUs, most GPUs)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type == "cpu" and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def amx_bf16_cpu() -> bool:
    """Whether oneDNN may take its AMX bf16 kernels here: the CPU has ``amx_bf16`` and
    ``ONEDNN_MAX_CPU_ISA`` (read by oneDNN when the process starts) does not cap it below
    AMX. On such a CPU bf16 ViT scoring lost its ranking on a real store (docs/performance.md)."""
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    if cap and cap != "ALL" and "AMX" not in cap:
        return False
    return "amx_bf16" in _cpu_flags()


@functools.cache
def _cpu_flags() -> frozenset[str]:
    """The words of /proc/cpuinfo, read once (`amx_bf16_cpu` runs on every bf16 ViT scoring)."""
    try:
        return frozenset(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return frozenset()


_STAGING_ELEMENTS = 1 << 18  # float32 staging slice of `copy_maps_` (1 MiB, stays in cache)


def copy_maps_(out: torch.Tensor, maps: torch.Tensor) -> torch.Tensor:
    """`out.copy_(maps)`, with float16 -> bfloat16 on the CPU staged through float32.

    The CPU has no vectorised float16 -> bfloat16 cast (it is four times slower
    than float16 -> float32 -> bfloat16); each slice is staged in a small
    float32 buffer that stays in cache. Both casts are exact or round to
    nearest, so the result equals the direct cast.
    """
    if not (
        maps.dtype == torch.float16
        and out.dtype == torch.bfloat16
        and out.device.type == "cpu"
        and maps.device.type == "cpu"
        and out.is_contiguous()
        and maps.is_contiguous()
    ):
        return out.copy_(maps)
    flat_in, flat_out = maps.view(-1), out.view(-1)
    staging = torch.empty(min(_STAGING_ELEMENTS, flat_in.numel()))
    for start in range(0, flat_in.numel(), _STAGING_ELEMENTS):
        part = slice(start, start + _STAGING_ELEMENTS)
        stage = staging[: len(flat_in[part])].copy_(flat_in[part])
        flat_out[part].copy_(stage)
    return out


_BUFFERS = threading.local()  # per thread: {(dtype, device): last input buffer of predict_logits}


def _input_buffer(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """This thread's reusable (B, C, H, W) input buffer of `dtype`: the first B rows of one
    kept buffer, replaced when a map's shape changes or more rows are asked for.

    A fresh 50 MB batch costs page faults on every call (more than the
    conversion itself on the CPU); a server or benchmark scoring batch after
    batch reuses one buffer per thread and dtype instead.
    """
    if not hasattr(_BUFFERS, "tensors"):
        _BUFFERS.tensors = {}
    buffer = _BUFFERS.tensors.get((dtype, device))
    if buffer is None or buffer.shape[1:] != shape[1:] or len(buffer) < shape[0]:
        buffer = _BUFFERS.tensors[(dtype, device)] = torch.empty(shape, dtype=dtype, device=device)
    return buffer[: shape[0]]


def compiler_available(device: torch.device) -> bool:
    """Whether torch.compile's default backend can build code here: a C++ compiler for
    the CPU (inductor's CPU code is C++), Triton for CUDA."""
    if device.type == "cpu":
        return any(shutil.which(c) for c in (os.environ.get("CXX", ""), "g++", "c++", "clang++"))
    return importlib.util.find_spec("triton") is not None


def compile_mode(compile: bool | str) -> str | None:
    """The torch.compile mode of a ``compile`` argument: False -> None, True -> "default"."""
    if compile is False or compile is None:
        return None
    if compile is True:
        return "default"
    if compile not in COMPILE_MODES:
        raise ValueError(f"compile must be True, False or one of {COMPILE_MODES}, got {compile!r}")
    return compile


def _compiled(
    model: nn.Module, device: torch.device, mode: str
) -> Callable[[torch.Tensor], torch.Tensor]:
    """`torch.compile(model, mode=mode)`, made once per model and mode and kept on it (outside
    its submodules and state dict); the model itself where nothing can be compiled here."""
    forwards = model.__dict__.setdefault("_compiled_forwards", {})
    forward = forwards.get(mode)
    if forward is None:
        if compiler_available(device):
            forward = torch.compile(model, mode=mode)
        else:
            log.warning(
                "torch.compile needs a C++ compiler (CPU) or Triton (CUDA); running eagerly"
            )
            forward = model
        forwards[mode] = forward
    return forward


def _forward(model: nn.Module, x: torch.Tensor, mode: str | None, device: torch.device):
    """``model(x)``, through torch.compile in ``mode`` when one is given; a failed compile
    falls back to eager."""
    forward = model if mode is None else _compiled(model, device, mode)
    if forward is model:
        return model(x)
    try:
        return forward(x)
    except Exception as error:  # a backend that cannot build this graph here: score eagerly
        log.warning("torch.compile failed (%s: %s); running eagerly", type(error).__name__, error)
        model.__dict__["_compiled_forwards"][mode] = model
        return model(x)


@torch.inference_mode()
def predict_logits(
    model: nn.Module,
    maps: torch.Tensor,
    batch_size: int = 256,
    device: torch.device | None = None,
    precision: str = "float32",
    compile: bool | str = False,
) -> torch.Tensor:
    """Eval-mode logits for (N, C, H, W) maps of any float dtype; returns (N,) float32 on CPU.

    Stored float16 maps are converted batch by batch into one reused buffer.
    ``precision="bfloat16"`` runs the model under bf16 autocast (float16 inputs
    go to bf16 through `copy_maps_`); "float32" computes exactly as the model
    was trained. On the CPU a model's ``cpu_scoring_rows`` (the ViT's: 64)
    caps the rows per forward pass, so its activations stay in cache; the
    logits do not depend on the batch.

    ``compile=True`` runs the model through `torch.compile` (compiled at the
    first call, minutes on a small CPU, then kept on the model; a short last
    batch is padded so one shape is compiled); a string names the mode, and
    "reduce-overhead" replays the batch as one CUDA graph on a GPU, where the
    ViT's launches, not its kernels, are the limit in bf16 (docs/performance.md).
    It is optional: where nothing can be compiled, or the compile fails, the
    model runs eagerly with a warning.
    """
    if precision not in SCORING_PRECISIONS:
        raise ValueError(f"precision must be one of {SCORING_PRECISIONS}, got {precision!r}")
    mode = compile_mode(compile)
    device = device or next(model.parameters()).device
    if device.type == "cpu":
        batch_size = min(batch_size, getattr(model, "cpu_scoring_rows", batch_size))
    dtype = torch.bfloat16 if precision == "bfloat16" else torch.float32
    was_training = model.training
    model.eval()
    logits = torch.empty(len(maps))
    try:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            for start in range(0, len(maps), batch_size):
                chunk = maps[start : start + batch_size]
                n = len(chunk)
                pad = mode is not None and start > 0 and n < batch_size  # one compiled shape
                if chunk.dtype == dtype and chunk.device == device and not pad:
                    x = chunk
                else:
                    rows = batch_size if pad else n
                    buffer = _input_buffer((rows, *chunk.shape[1:]), dtype, device)
                    copy_maps_(buffer[:n], chunk)  # (B, C, H, W), no fresh batch
                    x = (
                        buffer.index_fill_(0, torch.arange(n, rows, device=device), 0)
                        if pad
                        else buffer
                    )
                # copied out at once: a CUDA graph's output is overwritten by its next replay
                logits[start : start + n] = _forward(model, x, mode, device)[:n].float().cpu()
    finally:
        model.train(was_training)
    return logits


def train_one_epoch(
    model: nn.Module,
    maps: torch.Tensor,
    labels: torch.Tensor,
    optimizer: torch.optim.Optimizer,
    pos_weight: torch.Tensor,
    cfg: TrainConfig,
    rngs: Rngs,
    device: torch.device,
) -> float:
    """One pass over shuffled training maps with noise and mixup; returns the mean loss."""
    model.train()
    order = torch.randperm(len(maps), generator=rngs.shuffle)
    total = 0.0
    for start in range(0, len(maps), cfg.batch_size):
        idx = order[start : start + cfg.batch_size]
        x = maps[idx].to(device, torch.float32)  # (B, C, H, W)
        y = labels[idx].to(device, torch.float32)  # (B,)
        x = add_input_noise(x, cfg.input_noise_sigma, rngs.noise)
        lam, perm = sample_mixup(len(idx), cfg.mixup_alpha, rngs)
        perm = perm.to(device)
        with torch.autocast(device.type, torch.bfloat16, enabled=cfg.precision == "bfloat16"):
            logits = model(mix(x, lam, perm)).float()  # (B,)
        loss = mixup_bce_loss(logits, y, lam, perm, pos_weight)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        total += loss.item() * len(idx)
    return total / len(maps)


def validate(
    model: nn.Module,
    maps: torch.Tensor,
    labels: torch.Tensor,
    cfg: TrainConfig,
    device: torch.device,
) -> tuple[float, float]:
    """(validation AUROC, mean BCE); AUROC is NaN when the logits are not finite."""
    logits = predict_logits(model, maps, cfg.eval_batch_size, device, cfg.precision)
    y = labels.float()
    if not torch.isfinite(logits).all():
        log.warning("validation logits are not finite; this epoch cannot be selected")
        return math.nan, math.nan
    loss = F.binary_cross_entropy_with_logits(logits, y).item()
    return metrics.auroc(torch.sigmoid(logits).numpy(), labels.numpy()), loss


@dataclass(frozen=True)
class EpochOutcome:
    """What one epoch of `select_epoch` produced, handed to its ``on_epoch`` callback."""

    epoch: int
    train_loss: float
    val_score: float  # validation AUROC; NaN is never selected
    val_loss: float
    improved: bool  # the kept checkpoint was replaced after this epoch
    seconds: float
    best_score: float
    best_epoch: int


@dataclass
class LoopState:
    """Where `select_epoch` stands after an epoch; what it needs to go on from there."""

    epochs: int  # epochs finished
    stopper: EarlyStopping
    best: dict[str, torch.Tensor] | None  # the kept weights on CPU; None before any epoch is


@dataclass
class Selection:
    best_epoch: int
    best_score: float
    state: dict[str, torch.Tensor] | None  # the selected weights on CPU; None if no epoch was
    epochs: int  # epochs run


def select_epoch(
    model: nn.Module,
    max_epochs: int,
    train_epoch: Callable[[int], float],
    validate_epoch: Callable[[], tuple[float, float]],
    patience: int | None = None,
    on_epoch: Callable[[EpochOutcome], None] | None = None,
    resume: LoopState | None = None,
    after_epoch: Callable[[LoopState], None] | None = None,
) -> Selection:
    """The one training loop: train an epoch, validate, keep the checkpoint of the best
    validation score (strict improvements only, ties keep the earlier), stop after
    ``patience`` epochs without one (None = never stop early).

    ``train_epoch(epoch)`` trains one epoch and returns its mean loss;
    ``validate_epoch()`` returns (validation AUROC, validation loss). The detectors'
    recipe (`train_detector`) and ACT-ViT both train through it. ``resume`` goes on from
    a `LoopState` that ``after_epoch`` was handed after an epoch of an earlier run.
    """
    if resume is None:
        resume = LoopState(
            0, EarlyStopping(patience if patience is not None else max_epochs + 1), None
        )
    stopper, state, epochs = resume.stopper, resume.best, resume.epochs
    if epochs > 0 and stopper.should_stop:  # it stopped early just before it was killed
        return Selection(stopper.best_epoch, stopper.best_score, state, epochs)
    for epoch in range(epochs, max_epochs):
        t0 = time.perf_counter()
        train_loss = train_epoch(epoch)
        val_score, val_loss = validate_epoch()
        improved = stopper.update(epoch, val_score)
        if improved:
            state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        epochs += 1
        if on_epoch is not None:
            seconds = time.perf_counter() - t0
            on_epoch(
                EpochOutcome(
                    epoch,
                    train_loss,
                    val_score,
                    val_loss,
                    improved,
                    seconds,
                    stopper.best_score,
                    stopper.best_epoch,
                )
            )
        if after_epoch is not None:
            after_epoch(LoopState(epochs, stopper, state))
        if stopper.should_stop:
            break
    return Selection(stopper.best_epoch, stopper.best_score, state, epochs)


@dataclass
class EpochCheckpoints:
    """`train_detector`'s checkpoint file (`actmap.training.checkpoint`): the state of one
    seed's training, resumed when a killed run left it, saved again as epochs end."""

    path: Path
    ident: dict[str, Any]  # what the file must have been written for to be resumed
    every_s: float  # seconds between two saves (the last epoch is always saved)
    cfg: TrainConfig
    model: nn.Module
    optimizer: torch.optim.Optimizer
    schedule: torch.optim.lr_scheduler.LRScheduler
    rngs: Rngs
    device: torch.device
    history: list[EpochRecord]  # the run's, extended with the resumed epochs
    started: float  # train_detector's perf_counter at its start
    earlier_s: float = 0.0  # training seconds of the killed run resumed
    last_save: float = dataclasses.field(default_factory=time.perf_counter)

    def resume(self, seed: int) -> LoopState | None:
        """Put the model, optimizer, schedule and generators where the file left them and
        return where the loop stood; None when there is nothing of this run to resume."""
        saved = train_checkpoint.load(self.path, self.ident)
        if saved is None:
            return None
        self.model.load_state_dict(saved.model)
        self.optimizer.load_state_dict(saved.optimizer)
        self.schedule.load_state_dict(saved.schedule)
        self.rngs.restore(saved.generators, saved.numpy_generator, self.device)
        self.history.extend(EpochRecord(**record) for record in saved.history)
        self.earlier_s = saved.elapsed_s
        log.info("seed %d: resuming %s after epoch %d", seed, self.path, saved.epochs)
        return LoopState(saved.epochs, EarlyStopping(**saved.stopper), saved.best)

    def save(self, loop: LoopState) -> None:
        """`select_epoch`'s after-epoch hook: write the file if it is time to."""
        now = time.perf_counter()
        last = loop.stopper.should_stop or loop.epochs == self.cfg.max_epochs
        if now - self.last_save < self.every_s and not last:
            return
        generators, mixup = self.rngs.states(self.device)
        state = train_checkpoint.TrainState(
            epochs=loop.epochs,
            model=self.model.state_dict(),
            best=loop.best,
            optimizer=self.optimizer.state_dict(),
            schedule=self.schedule.state_dict(),
            stopper=asdict(loop.stopper),
            generators=generators,
            numpy_generator=mixup,
            history=[asdict(record) for record in self.history],
            elapsed_s=self.earlier_s + now - self.started,
        )
        train_checkpoint.save(self.path, state, self.ident)
        self.last_save = time.perf_counter()


def train_detector(
    model: nn.Module,
    train_maps: torch.Tensor,
    train_labels: torch.Tensor,
    val_maps: torch.Tensor,
    val_labels: torch.Tensor,
    cfg: TrainConfig,
    seed: int,
    device: torch.device | str | None = None,
    progress: ProgressCallback | None = None,
    checkpoint: str | Path | None = None,
    checkpoint_every_s: float | None = None,
) -> TrainResult:
    """Train `model` in place with the paper's recipe; it ends holding the selected weights.

    Maps are (N, C, H, W) tensors (float16 is fine, batches are cast to float32);
    labels are (N,) with 1 = correct. `device` overrides `cfg.device`.

    With ``checkpoint`` (a file path), the training state is saved there at the end of an
    epoch at most every ``checkpoint_every_s`` seconds (default `CHECKPOINT_EVERY_S`) and
    after the last one, and a checkpoint already there from a killed run of the same seed,
    recipe, device, module and data is resumed (`EpochCheckpoints`): the result is the
    same as an unstopped run's. The file is left in place; delete it once the result is
    saved.
    """
    device = resolve_device(device if device is not None else cfg.device)
    started = time.perf_counter()
    history: list[EpochRecord] = []
    with deterministic_torch(cfg.deterministic):
        seed_everything(seed)
        rngs = Rngs.from_seed(seed, device)
        model.to(device)
        pos_weight = torch.tensor(positive_class_weight(train_labels), device=device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda e: lr_multiplier(e, cfg))
        epoch_lr: list[float] = []
        saver = None
        if checkpoint is not None:
            data = {
                "train_maps": train_maps,
                "train_labels": train_labels,
                "val_maps": val_maps,
                "val_labels": val_labels,
            }
            ident = train_checkpoint.identity(seed, cfg.to_dict(), device, model, data)
            every_s = CHECKPOINT_EVERY_S if checkpoint_every_s is None else checkpoint_every_s
            saver = EpochCheckpoints(
                Path(checkpoint),
                ident,
                every_s,
                cfg,
                model,
                optimizer,
                schedule,
                rngs,
                device,
                history,
                started,
            )
        resume = saver.resume(seed) if saver is not None else None

        def train_epoch(epoch: int) -> float:
            epoch_lr.append(optimizer.param_groups[0]["lr"])
            loss = train_one_epoch(
                model, train_maps, train_labels, optimizer, pos_weight, cfg, rngs, device
            )
            schedule.step()  # per epoch: the next epoch's learning rate
            return loss

        def on_epoch(o: EpochOutcome) -> None:
            record = EpochRecord(
                o.epoch, o.train_loss, o.val_loss, o.val_score, epoch_lr[-1], o.seconds, o.improved
            )
            history.append(record)
            log.debug("seed %d %s", seed, record)
            if progress is not None:
                progress(
                    o.epoch,
                    {
                        **asdict(record),
                        "seed": seed,
                        "max_epochs": cfg.max_epochs,
                        "best_val_auroc": o.best_score,
                        "best_epoch": o.best_epoch,
                    },
                )

        selection = select_epoch(
            model,
            cfg.max_epochs,
            train_epoch,
            lambda: validate(model, val_maps, val_labels, cfg, device),
            cfg.patience,
            on_epoch,
            resume,
            saver.save if saver is not None else None,
        )
    if selection.state is None:
        raise RuntimeError("no epoch produced finite validation logits; training diverged")
    model.load_state_dict(selection.state)
    wall = (saver.earlier_s if saver is not None else 0.0) + time.perf_counter() - started
    log.info(
        "seed %d: best epoch %d, val AUROC %.4f, %d epochs, %.1f s on %s",
        seed,
        selection.best_epoch,
        selection.best_score,
        len(history),
        wall,
        device,
    )
    return TrainResult(
        selection.best_epoch, selection.best_score, history, selection.state, wall, str(device)
    )
