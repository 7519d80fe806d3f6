"""Depth-wise localization (paper section "Depth-Wise Localization"): where in the map a frozen
detector reads its signal, on a grid of depth bands x coordinate bands.

    localize(detector, test, LocalizationConfig()) -> Localization (to_json, to_markdown)

Three views on the same grid (default 8 x 8: bands of 4 layer rows x 16 coordinates, the
ViT's patches):

- occlusion: every region (all channels) is set to 0 -- the per-channel mean of a
  standardised map -- on every test map, and the test AUROC drop is recorded; so is the
  drop when a whole depth band (every coordinate) is occluded at once. Occluding
  the whole map makes every map identical, so every score ties and AUROC is exactly 0.5
  (`whole_map_auroc`, checked in the tests).
- integrated gradients of the logit from the all-zero map, |attribution| summed over
  channels and region cells, averaged over test maps, as a share of the total.
- attention rollout (Abnar and Zuidema, 2020) of the class token over the patch tokens,
  averaged over test maps; only for the ViT, whose patches are the grid's cells when the
  grid matches its patch layout.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from actmap.detectors.vit import MapViT
from actmap.scoring import metrics
from actmap.store.rows import Rows


@dataclass(frozen=True)
class LocalizationConfig:
    depth_bands: int = 8  # layer-row bands (the map's 32 rows in 8 bands of 4)
    coord_bands: int = 8  # coordinate bands (128 columns in 8 bands of 16)
    fill: float = 0.0  # occlusion value: the per-channel mean of a standardised map
    ig_steps: int = 32  # integrated-gradients path steps (midpoint rule)
    batch_size: int = 256

    def __post_init__(self) -> None:
        if min(self.depth_bands, self.coord_bands, self.ig_steps, self.batch_size) < 1:
            raise ValueError("LocalizationConfig fields must be >= 1")


def band_edges(size: int, bands: int) -> np.ndarray:
    """(bands + 1,) integer edges splitting ``size`` into near-equal contiguous bands."""
    if bands > size:
        raise ValueError(f"{bands} bands do not fit in {size} rows/columns")
    return np.linspace(0, size, bands + 1).round().astype(int)


@dataclass(frozen=True)
class Localization:
    grid: tuple[int, int]  # (depth bands, coordinate bands)
    row_edges: list[int]
    col_edges: list[int]
    n_test: int
    auroc: float  # the frozen detector on unoccluded test maps
    whole_map_auroc: float  # every region occluded at once: 0.5 by construction
    occlusion_drop: np.ndarray  # (depth, coord) AUROC(full) - AUROC(region occluded)
    band_drop: np.ndarray  # (depth,) AUROC(full) - AUROC(whole depth band occluded)
    integrated_gradients: np.ndarray  # (depth, coord) share of |attribution|, sums to 1
    rollout: np.ndarray | None  # (depth, coord) class-token attention share, ViT only
    detector: str

    def depth_profile(self, view: str = "band_drop") -> np.ndarray:
        """(depth bands,) the AUROC drop when each whole band is occluded (default), or a
        grid view (``occlusion_drop``, ``integrated_gradients``, ``rollout``) summed over
        coordinate bands."""
        values = np.asarray(getattr(self, view))
        return values if values.ndim == 1 else values.sum(axis=1)

    def peak_depth_band(self, view: str = "band_drop") -> tuple[int, int]:
        """(first, last) map row of the depth band where ``depth_profile(view)`` is highest:
        by default the band whose occlusion hurts most."""
        band = int(np.argmax(self.depth_profile(view)))
        return self.row_edges[band], self.row_edges[band + 1] - 1

    def to_json(self) -> dict:
        def arr(a):
            return None if a is None else np.asarray(a).round(6).tolist()

        return {
            "detector": self.detector,
            "grid": list(self.grid),
            "row_edges": self.row_edges,
            "col_edges": self.col_edges,
            "n_test": self.n_test,
            "auroc": self.auroc,
            "whole_map_auroc": self.whole_map_auroc,
            "occlusion_drop": arr(self.occlusion_drop),
            "band_drop": arr(self.band_drop),
            "integrated_gradients": arr(self.integrated_gradients),
            "rollout": arr(self.rollout),
            "depth_profile_occlusion": arr(self.depth_profile("occlusion_drop")),
            "depth_profile_ig": arr(self.depth_profile("integrated_gradients")),
            "peak_depth_rows_occlusion": list(self.peak_depth_band()),
        }

    def to_markdown(self) -> str:
        rows = self.grid[0]
        lines = [
            f"Detector {self.detector}, {self.n_test} balanced test rows: AUROC "
            f"{self.auroc:.3f}; whole map occluded {self.whole_map_auroc:.3f}.",
            "",
            "| depth band (map rows) | ΔAUROC, whole band occluded | "
            "largest single-region ΔAUROC | IG share | rollout share |",
            "|---|---|---|---|---|",
        ]
        occ, ig = self.band_drop, self.depth_profile("integrated_gradients")
        roll = None if self.rollout is None else self.depth_profile("rollout")
        for r in range(rows):
            band = f"{self.row_edges[r]}-{self.row_edges[r + 1] - 1}"
            lines.append(
                f"| {band} | {occ[r]:+.3f} | {self.occlusion_drop[r].max():+.3f} | {ig[r]:.3f} | "
                + ("n/a" if roll is None else f"{roll[r]:.3f}")
                + " |"
            )
        return "\n".join(lines) + "\n"


def _logits(detector, maps: torch.Tensor) -> np.ndarray:
    return np.asarray(detector.decision_function(maps), dtype=np.float64)


def occlusion(detector, test: Rows, config: LocalizationConfig):
    """(AUROC, whole-map AUROC, (depth, coord) drops, (depth,) band drops, row and column
    edges) of the frozen detector."""
    x = torch.as_tensor(np.asarray(test.maps, dtype=np.float32))  # (N, C, H, W)
    y = np.asarray(test.labels).astype(np.int64)
    rows, cols = (
        band_edges(x.shape[2], config.depth_bands),
        band_edges(x.shape[3], config.coord_bands),
    )
    full = metrics.auroc(_logits(detector, x), y)
    drops = np.zeros((config.depth_bands, config.coord_bands))
    for r in range(config.depth_bands):
        for c in range(config.coord_bands):
            occluded = x.clone()
            occluded[:, :, rows[r] : rows[r + 1], cols[c] : cols[c + 1]] = config.fill
            drops[r, c] = full - metrics.auroc(_logits(detector, occluded), y)
    bands = np.zeros(config.depth_bands)
    for r in range(config.depth_bands):
        occluded = x.clone()
        occluded[:, :, rows[r] : rows[r + 1], :] = config.fill
        bands[r] = full - metrics.auroc(_logits(detector, occluded), y)
    whole = metrics.auroc(_logits(detector, torch.full_like(x, config.fill)), y)
    return full, whole, drops, bands, rows, cols


def _pool_grid(values: torch.Tensor, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """(H, W) -> (bands, bands) sums over each region."""
    out = np.zeros((len(rows) - 1, len(cols) - 1))
    for r in range(len(rows) - 1):
        for c in range(len(cols) - 1):
            out[r, c] = float(values[rows[r] : rows[r + 1], cols[c] : cols[c + 1]].sum())
    return out


def integrated_gradients(
    model: torch.nn.Module, x: torch.Tensor, steps: int = 32, batch_size: int = 256
) -> torch.Tensor:
    """(N, C, H, W) attributions of the logit from the all-zero baseline (midpoint rule):
    x * mean_k grad f(alpha_k x), alpha_k = (k + 0.5) / steps; they sum to about f(x) - f(0)."""
    model = model.eval()
    device = next(model.parameters()).device
    out = torch.zeros_like(x, dtype=torch.float32)
    alphas = (torch.arange(steps, dtype=torch.float32) + 0.5) / steps
    for start in range(0, len(x), batch_size):
        chunk = x[start : start + batch_size].float().to(device)  # (b, C, H, W)
        total = torch.zeros_like(chunk)
        for alpha in alphas:
            point = (alpha * chunk).requires_grad_(True)
            (grad,) = torch.autograd.grad(model(point).sum(), point)
            total += grad
        out[start : start + len(chunk)] = (chunk * total / steps).cpu()
    return out


def attention_rollout(model, x: torch.Tensor, batch_size: int = 256) -> torch.Tensor:
    """(N, rows, cols) class-token rollout over the patch tokens of a `MapViT`.

    Per block, the head-averaged attention A gets the residual (0.5 A + 0.5 I, rows
    renormalised); the product over blocks, read at the class token, is its share of
    each patch token. Recomputes each block's attention from its qkv projection.
    """
    model = model.eval()
    device = next(model.parameters()).device
    out = []
    with torch.no_grad():
        for start in range(0, len(x), batch_size):
            h = x[start : start + batch_size].float().to(device)
            h = model.patch_embed(h).flatten(2).transpose(1, 2) + model.positions()  # (b, N, D)
            cls = (model.cls_token + model.cls_pos).expand(h.shape[0], -1, -1)
            h = torch.cat([cls, h], dim=1)  # (b, 1 + N, D)
            rollout = torch.eye(h.shape[1], device=device).expand(h.shape[0], -1, -1)
            for block in model.blocks:
                attn = _block_attention(block, block.norm1(h))  # (b, 1 + N, 1 + N)
                attn = 0.5 * attn + 0.5 * torch.eye(h.shape[1], device=device)
                attn = attn / attn.sum(-1, keepdim=True)
                rollout = attn @ rollout
                h = block(h)
            out.append(rollout[:, 0, 1:].reshape(-1, *model.grid).cpu())  # (b, rows, cols)
    return torch.cat(out)


def _block_attention(block, h: torch.Tensor) -> torch.Tensor:
    """Head-averaged softmax attention of one block on its normalised input (b, T, D)."""
    attn = block.attn
    b, t, d = h.shape
    qkv = attn.qkv(h).reshape(b, t, 3, attn.heads, d // attn.heads).permute(2, 0, 3, 1, 4)
    q, k = qkv[0], qkv[1]  # (b, heads, T, d_head)
    weights = torch.softmax(q @ k.transpose(-2, -1) / (d // attn.heads) ** 0.5, dim=-1)
    return weights.mean(dim=1)  # (b, T, T)


def localize(
    detector, test: Rows, config: LocalizationConfig = LocalizationConfig()
) -> Localization:
    """Occlusion, integrated gradients and (ViT) attention rollout of a frozen detector."""

    full, whole, drops, bands, rows, cols = occlusion(detector, test, config)
    x = torch.as_tensor(np.asarray(test.maps, dtype=np.float32))
    attributions = integrated_gradients(detector.model_, x, config.ig_steps, config.batch_size)
    ig = _pool_grid(attributions.abs().sum(dim=(0, 1)), rows, cols)
    ig = ig / max(ig.sum(), 1e-12)
    rollout = None
    model = detector.model_
    if isinstance(model, MapViT):
        shares = attention_rollout(model, x, config.batch_size).mean(dim=0)  # (prow, pcol)
        if tuple(shares.shape) == (config.depth_bands, config.coord_bands):
            rollout = (shares / shares.sum()).numpy()
        else:  # spread each patch's share over its cells, then sum per region
            cells = torch.kron(
                shares, torch.ones(x.shape[2] // shares.shape[0], x.shape[3] // shares.shape[1])
            )
            rollout = _pool_grid(cells, rows, cols)
            rollout = rollout / rollout.sum()
    return Localization(
        (config.depth_bands, config.coord_bands),
        rows.tolist(),
        cols.tolist(),
        len(test.labels),
        full,
        whole,
        drops,
        bands,
        ig,
        rollout,
        getattr(detector, "detector", type(model).__name__),
    )


def with_grid(config: LocalizationConfig, depth: int, coords: int) -> LocalizationConfig:
    return dataclasses.replace(config, depth_bands=depth, coord_bands=coords)
