"""EigenScore (Chen et al., INSIDE, ICLR 2024), LM-Polygraph's variant (BASELINES.md decision 6, B3).

K sampled answers are embedded by one middle block at each answer's own last
real step (`actmap.baselines.sampling`). With Z the (K, d) embeddings,

    Sigma = Z J_d Z^T,  J_d = I_d - (1/d) 1 1^T     (each embedding centred over its own features)
    E = (1/K) sum_i ln lambda_i(Sigma + alpha I_K)

computed in float64 with ``eigh`` eigenvalues floored at 1e-10. Divergent
answers spread the embeddings and raise E; confidence = -E. No feature
clipping. ``cov_scale="d_minus_1"`` divides Sigma by d - 1, as the official
code's ``torch.cov`` does; that changes how alpha acts, so record it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

from actmap.baselines.sampling import check_same_sampling
from actmap.scoring.contract import ScoreResult, negate

COV_SCALES = ("unscaled", "d_minus_1")
EIGEN_FLOOR = 1e-10  # LM-Polygraph's floor before the log


def eigenscore(embeddings, alpha: float = 1e-3, cov_scale: str = "unscaled") -> float:
    """Mean natural-log eigenvalue of the regularised (K, K) covariance of K embeddings (K, d)."""
    if hasattr(embeddings, "detach"):  # torch, possibly bf16 or on a GPU
        embeddings = embeddings.detach().cpu().double().numpy()
    z = np.asarray(embeddings, dtype=np.float64)  # (K, d)
    if z.ndim != 2 or z.shape[0] < 2 or z.shape[1] < 2:
        raise ValueError(f"embeddings must be (K >= 2, d >= 2), got shape {z.shape}")
    if not np.isfinite(z).all():
        raise ValueError("embeddings hold NaN or infinite values")
    if alpha <= 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    if cov_scale not in COV_SCALES:
        raise ValueError(f"cov_scale must be one of {COV_SCALES}, got {cov_scale!r}")
    centred = z - z.mean(axis=1, keepdims=True)  # (K, d)
    sigma = centred @ centred.T  # (K, K)
    if cov_scale == "d_minus_1":
        sigma /= z.shape[1] - 1
    eigvals = np.linalg.eigvalsh(sigma + alpha * np.eye(z.shape[0]))
    return float(np.log(np.maximum(eigvals, EIGEN_FLOOR)).mean())


class EigenScore:
    """confidence = -EigenScore of each row's sampled-answer embeddings; fit is a no-op.

    ``rows`` are `actmap.baselines.sampling.SampleSet`s (embeddings, config).
    """

    name: ClassVar[str] = "eigenscore"
    supervised: ClassVar[bool] = False
    requires: ClassVar[tuple[str, ...]] = ("samples",)
    probability: ClassVar[bool] = False

    def __init__(self, alpha: float = 1e-3, cov_scale: str = "unscaled") -> None:
        if cov_scale not in COV_SCALES:
            raise ValueError(f"cov_scale must be one of {COV_SCALES}, got {cov_scale!r}")
        self.alpha = alpha  # INSIDE and LM-Polygraph: 1e-3
        self.cov_scale = cov_scale  # "unscaled" (LM-Polygraph) or "d_minus_1" (official torch.cov)

    def fit(self, train: Sequence[Any], y_train: np.ndarray, val=None, y_val=None) -> EigenScore:
        return self

    def score(self, rows: Sequence[Any]) -> ScoreResult:
        check_same_sampling(rows)
        raw = []
        for index, row in enumerate(rows):
            try:
                raw.append(eigenscore(row.embeddings, self.alpha, self.cov_scale))
            except ValueError as err:
                raise ValueError(f"row {index}: {err}") from err
        raw = np.asarray(raw, dtype=np.float64)
        config = rows[0].config
        return ScoreResult(
            confidence=negate(raw),
            raw=raw,
            raw_name="eigenscore",
            details={
                "alpha": self.alpha,
                "cov_scale": self.cov_scale,
                "log": "natural",
                "embedding_layer": config.embedding_layer,
                "embedding_position": "last answer token's producing state",
                "n_samples": config.n_samples,
                "temperature": config.temperature,
                "top_p": config.top_p,
                "top_k": config.top_k,
            },
        )
