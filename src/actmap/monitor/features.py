"""What the monitor reads from a map: the layer profile of every channel.

A map is standardised per channel over its H x W entries (`actmap.maps`), so a
channel's overall mean and spread carry nothing; what varies from answer to
answer is how the channel is distributed over the layer rows. The summary of a
(C, H, W) map is, for every channel and layer row, the mean and the standard
deviation over the W pooled coordinates: 2 * C * H numbers (768 for the paper's
12 x 32 x 128 map). The summary does not depend on any detector, so a monitor
fitted on a detector's training rows sees them as it will see new rows.
"""

from __future__ import annotations

import numpy as np

CHUNK_ROWS = 512  # maps summarised at once (float32 copies stay small)


def layer_profiles(maps: np.ndarray) -> np.ndarray:
    """(N, C, H, W) maps (any float dtype) -> (N, 2 * C * H) float64 summaries.

    Columns: the (C, H) row means in C-order, then the (C, H) row standard deviations
    (ddof = 0), both over the W coordinates.
    """
    maps = np.asarray(maps)
    if maps.ndim != 4:
        raise ValueError(f"maps must have shape (N, C, H, W), got {maps.shape}")
    n, c, h, _ = maps.shape
    out = np.empty((n, 2 * c * h), dtype=np.float64)
    for start in range(0, n, CHUNK_ROWS):
        part = maps[start : start + CHUNK_ROWS].astype(np.float32)  # (b, C, H, W)
        out[start : start + len(part), : c * h] = part.mean(axis=3).reshape(len(part), -1)
        out[start : start + len(part), c * h :] = part.std(axis=3).reshape(len(part), -1)
    return out
