"""The window test: maximum mean discrepancy with a Gaussian kernel, by permutation.

For a window X (m rows) and the reference Y (n rows) in feature space, the
biased estimate MMD^2 = a^T K a, with K the Gaussian Gram matrix of the pooled
rows and a = (1/m, ..., 1/m, -1/n, ..., -1/n). Under "no shift" the pooled rows
are exchangeable, so relabelling them at random gives the statistic's null
distribution for this very window; the p-value (1 + #{T_b >= T}) / (1 + B) of
B relabellings is exact (a test at level alpha alarms with probability at most
alpha), whatever the window size and the feature distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def squared_distances(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """(n, m) squared Euclidean distances between the rows of x (n, d) and y (m, d)."""
    d2 = (x * x).sum(1)[:, None] + (y * y).sum(1)[None, :] - 2.0 * x @ y.T
    return np.maximum(d2, 0.0)


def median_bandwidth(x: np.ndarray) -> float:
    """The median heuristic: the median pairwise distance among the rows of x (d > 0)."""
    d2 = squared_distances(x, x)[np.triu_indices(len(x), k=1)]
    positive = d2[d2 > 0]
    return float(np.sqrt(np.median(positive))) if len(positive) else 1.0


def gaussian_gram(x: np.ndarray, y: np.ndarray, bandwidth: float) -> np.ndarray:
    """k(x, y) = exp(-|x - y|^2 / (2 bandwidth^2)) for every pair of rows."""
    return np.exp(-squared_distances(x, y) / (2.0 * bandwidth**2))


@dataclass(frozen=True)
class PermutationTest:
    statistic: float  # MMD^2 of the window against the reference (biased estimate)
    p_value: float  # (1 + #{permuted >= observed}) / (1 + B)
    n_permutations: int


def mmd_permutation_test(
    window: np.ndarray,
    reference: np.ndarray,
    bandwidth: float,
    n_permutations: int,
    rng: np.random.Generator,
) -> PermutationTest:
    """MMD^2 of ``window`` (m, d) against ``reference`` (n, d) and its permutation p-value."""
    m, n = len(window), len(reference)
    pooled = np.concatenate([window, reference])  # (m + n, d)
    gram = gaussian_gram(pooled, pooled, bandwidth)  # (m + n, m + n)
    # column 0 the observed split, columns 1..B random relabellings of the pooled rows
    in_window = np.zeros((m + n, n_permutations + 1), dtype=bool)
    in_window[:m, 0] = True
    for b in range(1, n_permutations + 1):
        in_window[rng.permutation(m + n)[:m], b] = True
    weights = np.where(in_window, 1.0 / m, -1.0 / n)  # (m + n, B + 1)
    stats = np.einsum("ib,ib->b", weights, gram @ weights)  # a_b^T K a_b for every column
    observed = stats[0]
    # a relabelling equal to the observed one up to float rounding counts as >=
    exceed = int(np.sum(stats[1:] >= observed - 1e-12 * max(1.0, abs(observed))))
    return PermutationTest(float(observed), (1 + exceed) / (1 + n_permutations), n_permutations)
