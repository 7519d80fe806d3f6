"""The candidate product detectors tried on one store, one row each (docs/detectors.md).

Every row is fit on training rows and selected on the balanced validation rows;
its validation AUROC is what chose the winner. The test AUROC (balanced test
rows and every labelled test row) is printed beside it for the record only.

    python experiments/product_rows.py --store STORE --vit-run RUN --out rows.json

RUN is an `actmap train --detector vit` run on the same store (its seed-*/
detectors are loaded, not retrained).
"""

from __future__ import annotations

import argparse
import json
import logging
import warnings
from pathlib import Path

import numpy as np
from sklearn.linear_model import LogisticRegressionCV
from sklearn.model_selection import StratifiedKFold

from actmap import metrics
from actmap.comparison import PLUS_GRID, Rows, select_plus, store_rows
from actmap.detectors.base import CorrectnessDetector
from actmap.detectors.plus import ActMapPlus, PlusConfig
from actmap.store import MapStore


def grid(use_scalars: bool | None, class_weight: str | None = "balanced"):
    return [
        PlusConfig(c.n_components, c.use_scalars, class_weight)
        for c in PLUS_GRID
        if use_scalars is None or c.use_scalars == use_scalars
    ]


def plus_row(name, train: Rows, sets, configs):
    est, _ = select_plus(train, sets["validation"], configs)
    return row(name, lambda r: est.decision_function(r.maps, r.scalars), sets, est.config_)


def row(name, score, sets, chosen=None):
    out = {"row": name}
    for split in ("validation", "test", "test_all"):
        out[f"{split}_auroc"] = metrics.auroc(score(sets[split]), sets[split].labels)
    if chosen is not None:
        out["chosen"] = str(chosen)
    print(
        f"{name:60s} val {out['validation_auroc']:.3f}  test {out['test_auroc']:.3f}  "
        f"test(all) {out['test_all_auroc']:.3f}",
        flush=True,
    )
    return out


def fusion_lr(features: np.ndarray, labels: np.ndarray):
    folds = StratifiedKFold(5, shuffle=True, random_state=0)
    model = LogisticRegressionCV(
        Cs=10, cv=folds, scoring="roc_auc", class_weight="balanced", max_iter=5000
    )
    mean, scale = features.mean(0), features.std(0) + 1e-12
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model.fit((features - mean) / scale, labels)
    return lambda f: model.decision_function((f - mean) / scale)


def late_fusion_map_lr(train: Rows, sets):
    """Out-of-fold map-only logits on train, then a second LR over [map logit, scalars]."""
    cfg = PlusConfig(64, use_scalars=False)
    folds = StratifiedKFold(5, shuffle=True, random_state=0)
    oof = np.zeros(len(train.ids))
    for fit_idx, held in folds.split(train.maps, train.labels):
        est = ActMapPlus(cfg).fit(train.maps[fit_idx], train.labels[fit_idx])
        oof[held] = est.decision_function(train.maps[held])
    full = ActMapPlus(cfg).fit(train.maps, train.labels)
    fuse = fusion_lr(np.column_stack([oof, train.scalars]), train.labels)
    return row(
        "late fusion: map-PCA64-LR logit (out-of-fold) + scalars, all rows",
        lambda r: fuse(np.column_stack([full.decision_function(r.maps), r.scalars])),
        sets,
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--store", type=Path, required=True)
    parser.add_argument("--vit-run", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--vit-only", action="store_true", help="only the ViT rows")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    sets = store_rows(MapStore.open(args.store))
    bal, every = sets["train"], sets["train_all"]
    print({k: (len(v.ids), round(v.prevalence, 3)) for k, v in sets.items()}, flush=True)
    rows = (
        []
        if args.vit_only
        else [
            plus_row(
                "scalars only (LR), all rows class-weighted", every, sets, [PlusConfig(0, True)]
            ),
            plus_row("map PCA+LR, balanced rows", bal, sets, grid(False)),
            plus_row("map PCA+LR, all rows class-weighted", every, sets, grid(False)),
            plus_row("map PCA+LR + scalars (early fusion), balanced rows", bal, sets, grid(True)),
            plus_row(
                "map PCA+LR + scalars (early fusion), all rows class-weighted",
                every,
                sets,
                grid(True),
            ),
            plus_row(
                "map PCA+LR + scalars (early fusion), all rows unweighted",
                every,
                sets,
                grid(True, None),
            ),
            plus_row("actmap-plus: full grid, all rows class-weighted", every, sets, PLUS_GRID),
            late_fusion_map_lr(every, sets),
        ]
    )
    if args.vit_run is not None:
        vits = [CorrectnessDetector.load(d) for d in sorted(args.vit_run.glob("seed-*"))]
        for d in vits:
            rows.append(
                row(
                    f"paper ViT seed {d.seed}, balanced rows",
                    lambda r, d=d: d.decision_function(r.maps),
                    sets,
                )
            )
        mean_logit = lambda r: np.mean([d.decision_function(r.maps) for d in vits], axis=0)  # noqa: E731
        rows.append(row(f"paper ViT, mean of {len(vits)} seeds' logits", mean_logit, sets))
        fuse = fusion_lr(np.column_stack([mean_logit(every), every.scalars]), every.labels)
        rows.append(
            row(
                "late fusion: ViT logit (in-sample on train) + scalars, all rows",
                lambda r: fuse(np.column_stack([mean_logit(r), r.scalars])),
                sets,
            )
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
