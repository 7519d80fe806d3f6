"""The candidate product detectors tried on one store, one row each (docs/results/log.md).

Every row is fit on training rows and selected on the balanced validation rows;
its validation AUROC is what chose the winner. The test AUROC (balanced test
rows and every labelled test row) is printed beside it for the record only, and
for rows whose score is a probability the ECE on every labelled test row, raw
and prior-corrected to the training split's natural accuracy.

    python scripts/product_rows.py --store STORE --vit-run RUN --out rows.json \
        [--pretrain-store OTHER ...]

RUN is an `actmap train --detector vit` run on the same store (its seed-*/
detectors are loaded, not retrained). OTHER: a store of the same generator on
another dataset, for the pretraining rows (its labelled training rows are the
source data; the target's validation still chooses).
"""

from __future__ import annotations

import argparse
import json
import logging
import warnings
from dataclasses import replace
from pathlib import Path

import numpy as np
from sklearn.linear_model import LogisticRegressionCV
from sklearn.model_selection import StratifiedKFold

from actmap.capture.answer_scalars import with_scalars
from actmap.detectors import DetectorInputs
from actmap.detectors.base import CorrectnessDetector
from actmap.detectors.plus import ActMapPlus, PlusConfig
from actmap.experiments.compare_product import PLUS_GRID, select_plus, store_rows
from actmap.scoring import metrics
from actmap.store import MapStore
from actmap.store.rows import Rows, natural_rows


def grid(use_scalars: bool | None, class_weight: str | None = "balanced"):
    return [
        PlusConfig(c.n_components, c.use_scalars, class_weight)
        for c in PLUS_GRID
        if use_scalars is None or c.use_scalars == use_scalars
    ]


def plus_row(name, train: Rows, sets, configs):
    est, _ = select_plus(train, sets["validation"], configs)
    return row(
        name,
        lambda r: est.decision_function(r.maps, r.scalars),
        sets,
        est.config_,
        proba=lambda r: est.predict_proba(r.maps, r.scalars),
        calibrated=est.calibrated_prevalence_,
    )


def row(name, score, sets, chosen=None, proba=None, calibrated=None):
    """AUROC on validation, balanced test and every test row; natural ECE when ``proba``."""
    out = {"row": name}
    for split in ("validation", "test", "test_all"):
        out[f"{split}_auroc"] = metrics.auroc(score(sets[split]), sets[split].labels)
    if chosen is not None:
        out["chosen"] = str(chosen)
    ece = ""
    if proba is not None:
        deploy = sets["train_all"].prevalence
        raw, corrected = metrics.natural_ece(
            proba(sets["test_all"]), sets["test_all"].labels, deploy, calibrated
        )
        out.update(natural_ece_raw=raw, natural_ece_corrected=corrected)
        ece = f"  ECE(all) {raw:.3f} / corrected {corrected:.3f}"
    print(
        f"{name:64s} val {out['validation_auroc']:.3f}  test {out['test_auroc']:.3f}  "
        f"test(all) {out['test_all_auroc']:.3f}{ece}",
        flush=True,
    )
    return out


def seed_average_row(train: Rows, sets, seeds=(0, 1, 2)):
    """The setting validation chooses (seed 0), refit with other PCA / fold seeds; mean logit."""
    chosen, _ = select_plus(train, sets["validation"], grid(None))
    fits = [ActMapPlus(replace(chosen.config_, seed=s)).fit(DetectorInputs(train.maps, train.scalars), train.labels)
            for s in seeds]  # fmt: skip

    def mean_logit(r):
        return np.mean([f.decision_function(r.maps, r.scalars) for f in fits], axis=0)

    return row(
        f"actmap-plus grid, all rows class-weighted, mean logit of seeds {seeds}",
        mean_logit,
        sets,
        chosen.config_,
        proba=lambda r: 1 / (1 + np.exp(-mean_logit(r))),
        calibrated=0.5,
    )


def concat(a: Rows, b: Rows) -> Rows:
    return Rows(
        a.ids + b.ids,
        np.concatenate([a.labels, b.labels]),
        np.concatenate([a.maps, b.maps]),
        np.concatenate([a.scalars, b.scalars]),
    )


def pretrain_rows(source: Rows, source_name: str, every: Rows, sets) -> list[dict]:
    """Pretraining on another dataset of the same generator, three ways."""
    out = []
    # 1. the source alone, applied to the target as is (no target label)
    src, _ = select_plus(source, sets["validation"], grid(None))
    out.append(
        row(
            f"pretrained on {source_name} only (no target rows)",
            lambda r: src.decision_function(r.maps, r.scalars),
            sets,
            src.config_,
        )
    )
    # 2. pooled: source and target rows together (class-weighted), target validation chooses
    out.append(
        plus_row(
            f"pooled: {source_name} + target all rows, class-weighted",
            concat(source, every),
            sets,
            grid(None),
        )
    )
    # 3. pretrain then fit: the source detector's logit is one more input of the target fit
    tgt, _ = select_plus(every, sets["validation"], grid(None))
    folds = StratifiedKFold(5, shuffle=True, random_state=0)
    oof = np.zeros(len(every.ids))
    for fit_idx, held in folds.split(every.maps, every.labels):
        part = ActMapPlus(tgt.config_).fit(
            DetectorInputs(every.maps[fit_idx], every.scalars[fit_idx]), every.labels[fit_idx]
        )
        oof[held] = part.decision_function(every.maps[held], every.scalars[held])
    fuse = fusion_lr(
        np.column_stack([oof, src.decision_function(every.maps, every.scalars)]), every.labels
    )
    out.append(
        row(
            f"pretrained on {source_name}, then fit: LR over [target logit (out-of-fold), "
            "source logit]",
            lambda r: fuse(
                np.column_stack(
                    [
                        tgt.decision_function(r.maps, r.scalars),
                        src.decision_function(r.maps, r.scalars),
                    ]
                )
            ),
            sets,
        )
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
    parser.add_argument(
        "--pretrain-only", action="store_true", help="only the --pretrain-store rows"
    )
    parser.add_argument(
        "--pretrain-store", type=Path, action="append", default=[],
        help="another store of the same generator (repeatable)",
    )  # fmt: skip
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    sets = store_rows(MapStore.open(args.store))
    bal, every = sets["train"], sets["train_all"]
    print({k: (len(v.ids), round(v.prevalence, 3)) for k, v in sets.items()}, flush=True)
    rows = (
        []
        if args.vit_only or args.pretrain_only
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
            seed_average_row(every, sets),
        ]
    )
    for other in args.pretrain_store:
        opened = MapStore.open(other)
        source = with_scalars(
            opened, natural_rows(opened, ("train",))["train"]
        )  # labelled train rows
        print(f"source {other.name}: {len(source.ids)} rows, {source.prevalence:.3f}", flush=True)
        rows += pretrain_rows(source, other.name, every, sets)
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
