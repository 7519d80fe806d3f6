"""Does a detector fit on float32 maps score bfloat16 answers (and back)? Session 7's figure.

One generator on the same questions in two dtypes (the grid's Qwen2.5-Coder-0.5B x TriviaQA
stores); an MLP (3 seeds, the paper's recipe) per store, each frozen and scored on the test
split of both stores (natural prevalence), with a paired bootstrap of the difference:

    .venv/bin/actmap train --store stores/qwen-0.5b-triviaqa --detector mlp \
        --seeds 42,123,456 --out runs/dtype-transfer/mlp
    .venv/bin/actmap train --store stores/qwen-0.5b-triviaqa-bf16 --detector mlp \
        --seeds 42,123,456 --out runs/dtype-transfer/mlp-bf16
    .venv/bin/python scripts/dtype_transfer.py
"""

from __future__ import annotations

import sys

import numpy as np
from sklearn.metrics import roc_auc_score

from actmap.experiments.seeds import frozen_scores
from actmap.scoring.intervals import bootstrap
from actmap.store import MapStore

STORES = {"float32": "stores/qwen-0.5b-triviaqa", "bfloat16": "stores/qwen-0.5b-triviaqa-bf16"}
RUNS = {"float32": "runs/dtype-transfer/mlp", "bfloat16": "runs/dtype-transfer/mlp-bf16"}


def test_scores(run: str, store_path: str) -> tuple[np.ndarray, np.ndarray]:
    store = MapStore.open(store_path)
    meta = store.metadata()
    meta = meta[meta["split"] == "test"].sort_values("id")
    p = np.mean(list(frozen_scores(run, store, meta["id"].tolist()).values()), axis=0)
    return p, meta["label"].to_numpy()


def paired(a, b, n_resamples: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """AUROC(b) - AUROC(a) on the same questions, resampled together."""
    (pa, ya), (pb, yb) = a, b
    rng, diffs = np.random.default_rng(seed), []
    while len(diffs) < n_resamples:
        i = rng.integers(0, len(ya), len(ya))
        if ya[i].min() == ya[i].max() or yb[i].min() == yb[i].max():
            continue
        diffs.append(roc_auc_score(yb[i], pb[i]) - roc_auc_score(ya[i], pa[i]))
    low, high = np.percentile(diffs, [2.5, 97.5])
    return roc_auc_score(yb, pb) - roc_auc_score(ya, pa), low, high


def main() -> int:
    for fit, run in RUNS.items():
        scored = {dtype: test_scores(run, path) for dtype, path in STORES.items()}
        for dtype, (p, y) in scored.items():
            print(
                f"MLP fit on {fit} maps -> {dtype} test rows: AUROC {bootstrap(p, y)} "
                f"n={len(y)} correct={int(y.sum())}"
            )
        d, low, high = paired(scored["float32"], scored["bfloat16"])
        print(
            f"MLP fit on {fit}: bfloat16 minus float32 test rows {d:+.3f} [{low:+.3f}, {high:+.3f}]"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
