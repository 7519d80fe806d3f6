"""Training runs over seeds: train one detector per seed with the paper's recipe, evaluate
each selected checkpoint once on test, and write a run folder.

    run_seeds(train, val, test, out_dir)        -> SeedRuns (+ seed-<s>/ folders, manifest, summary)
    train_on_store(store, detector, seeds, out) -> the same on a store's balanced rows
    frozen_scores(run, store, ids)              -> a run's saved detectors on any store's rows
    evaluate_run(run, store=None)               -> per-seed metrics of a run folder
"""

from __future__ import annotations

import datetime as dt
import logging
import platform
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from actmap.artifacts import package_version, write_json
from actmap.detectors import INPUT_NAMES, CorrectnessDetector, load_detector, read_inputs
from actmap.scoring import metrics
from actmap.store import MapStore
from actmap.store.rows import Rows, balanced_rows, rows_to_score, with_empty_answers
from actmap.training.recipe import ProgressCallback, TrainConfig
from actmap.training.run_folder import checkpoint_path, read_run, seed_folder

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RowScores:
    """One score per test row of one seed's selected checkpoint."""

    ids: list[Any]
    labels: np.ndarray  # (N,) int64, 1 = correct
    logits: np.ndarray  # (N,) float32
    p_correct: np.ndarray  # (N,) float32, sigmoid(logit)

    def write_parquet(self, path: Path) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pa.table(
            {
                "id": self.ids,
                "label": self.labels,
                "logit": self.logits,
                "p_correct": self.p_correct,
            }
        )
        pq.write_table(table, path)


def scoring_metrics(scores: RowScores) -> dict[str, float]:
    """The per-seed test metrics written to metrics.json."""
    headline = metrics.compute_metrics(scores.p_correct, scores.labels)
    return {
        **asdict(headline),
        "coverage_at_5pct_risk": metrics.coverage_at_risk(scores.p_correct, scores.labels, 0.05),
        "risk_at_80pct_coverage": metrics.risk_at_coverage(scores.p_correct, scores.labels, 0.8),
        "n_test": len(scores.labels),
        "n_correct": int(scores.labels.sum()),
    }


def evaluate_on_test(detector, test: Rows) -> tuple[RowScores, dict[str, float]]:
    """Score a fitted CorrectnessDetector once on test: per-row scores and metrics."""
    logits = detector.decision_function(test.maps)
    labels = np.asarray(test.labels).astype(np.int64)
    if len(labels) != len(logits):
        raise ValueError(f"test maps have {len(logits)} rows but labels have {len(labels)}")
    scores = RowScores(
        test.row_ids(),
        labels,
        logits.astype(np.float32),
        torch.sigmoid(torch.from_numpy(logits)).numpy().astype(np.float32),
    )
    return scores, scoring_metrics(scores)


@dataclass
class SeedRun:
    seed: int
    detector: Any  # the fitted CorrectnessDetector (selected state, history, config)
    test_scores: RowScores
    test_metrics: dict[str, float]


@dataclass
class SeedRuns:
    runs: list[SeedRun]
    summary: dict[str, Any] = field(default_factory=dict)


def summarize_runs(runs: Sequence[SeedRun]) -> dict[str, Any]:
    """Per-seed metrics and their mean and sample std (ddof=1) over seeds."""
    mean, std = {}, {}
    for name in metrics.SUMMARY_METRICS:
        mean[name], std[name] = metrics.seed_summary([r.test_metrics[name] for r in runs])
    return {
        "seeds": [r.seed for r in runs],
        "per_seed": {str(r.seed): r.test_metrics for r in runs},
        "mean": mean,
        "std": std,
        "std_ddof": 1,
    }


def environment_manifest(device: torch.device, inputs: dict[str, Any] | None) -> dict[str, Any]:
    """Software/hardware stack and input identifiers for one training run."""
    cuda = device.type == "cuda" and torch.cuda.is_available()
    return {
        "timestamp_utc": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "os": platform.platform(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if cuda else platform.processor(),
        "numpy": np.__version__,
        "actmap": package_version(),
        "inputs": inputs or {},
    }


def run_seeds(
    train: Rows,
    val: Rows,
    test: Rows,
    out_dir: str | Path | None = None,
    detector: str = "vit",
    detector_kwargs: dict[str, Any] | None = None,
    config: TrainConfig | None = None,
    seeds: Sequence[int] | None = None,
    device: str | None = None,
    inputs: dict[str, Any] | None = None,
    metadata: dict[str, Any] | None = None,
    progress: ProgressCallback | None = None,
) -> SeedRuns:
    """Train one detector per seed, evaluate each selected checkpoint once on test.

    With `out_dir`, writes `seed-<s>/{model.safetensors, config.json, history.json,
    test_scores.parquet, metrics.json}`, `manifest.json` (stack, device, `inputs`
    identifiers such as the map store's manifest hash) and `summary.json`.
    `metadata` is saved into every seed's config.json.
    """
    config = config or TrainConfig()
    seeds = tuple(seeds) if seeds is not None else config.seeds
    out = Path(out_dir) if out_dir is not None else None
    split_counts = {
        name: {"n": len(s.labels), "n_correct": int(np.asarray(s.labels).sum())}
        for name, s in (("train", train), ("val", val), ("test", test))
    }
    meta = {**(metadata or {}), "splits": split_counts, "inputs": inputs or {}}
    runs = []
    for seed in seeds:
        est = CorrectnessDetector(detector, detector_kwargs, config, seed=seed, device=device)
        checkpoint = None if out is None else checkpoint_path(out, seed)
        est.fit(train.maps, train.labels, val.maps, val.labels, progress, checkpoint)
        scores, seed_metrics = evaluate_on_test(est, test)
        seed_metrics.update(best_epoch=est.best_epoch_, best_val_auroc=est.best_val_auroc_)
        runs.append(SeedRun(seed, est, scores, seed_metrics))
        log.info("seed %d test: %s", seed, seed_metrics)
        if out is not None:
            seed_dir = seed_folder(out, seed)
            est.save(seed_dir, metadata=meta)
            write_json(seed_dir / "history.json", [asdict(r) for r in est.history_])
            scores.write_parquet(seed_dir / "test_scores.parquet")
            write_json(seed_dir / "metrics.json", seed_metrics)
            checkpoint.unlink(missing_ok=True)  # metrics.json is the seed's last file
    result = SeedRuns(runs, summarize_runs(runs))
    if out is not None:
        manifest = environment_manifest(runs[0].detector.device_, inputs)
        manifest.update(
            detector=detector, seeds=list(seeds), splits=split_counts, train_config=config.to_dict()
        )
        write_json(out / "manifest.json", manifest)
        write_json(out / "summary.json", {"detector": detector, **result.summary})
    return result


# --- a store's balanced rows ------------------------------------------------------------------


def load_balanced(store_path: str | Path):
    """({split: Rows} on the store's balanced rows, the opened store)."""

    store = MapStore.open(store_path)
    return balanced_rows(store), store


def recipe_config(max_epochs: int | None = None) -> TrainConfig:
    """The paper's training recipe, with an optional epoch cap (tests, quick looks, CPU)."""
    return TrainConfig() if max_epochs is None else replace(TrainConfig(), max_epochs=max_epochs)


def train_on_store(
    store_path: str | Path,
    detector: str,
    seeds: Sequence[int],
    out: str | Path | None,
    config: TrainConfig | None = None,
    device: str | None = None,
    progress: ProgressCallback | None = None,
    balanced: tuple[dict[str, Rows], Any] | None = None,
) -> tuple[SeedRuns, dict[str, Rows]]:
    """The paper's recipe on a store's balanced rows, one detector per seed.

    ``balanced``: what `load_balanced(store_path)` returned, when already read.
    Returns the seed runs and the balanced splits they were trained and tested on.
    """
    splits, store = balanced if balanced is not None else load_balanced(store_path)
    sizes = {s: len(v.row_ids()) for s, v in splits.items()}
    runs = run_seeds(
        splits["train"],
        splits["validation"],
        splits["test"],
        out,
        detector=detector,
        config=config or TrainConfig(),
        seeds=tuple(seeds),
        device=device,
        inputs={
            "store": str(store_path),
            "store_created_at": store.manifest.get("created_at"),
            "store_config": store.manifest.get("config"),
            "balanced_rows": sizes,
        },
        progress=progress,
    )
    return runs, splits


FROZEN_CHUNK = 2048  # maps read and scored at once (about 200 MB of float16 maps)


def frozen_scores(
    run: str | Path, store, ids: Sequence[str], chunk: int | None = None
) -> dict[str, np.ndarray]:
    """p(correct) of every seed of a run folder's frozen detectors on ``ids`` of ``store``
    (an opened MapStore, only read): ``{seed: (N,) probabilities}``. The maps are read and
    scored ``chunk`` rows at a time (a transfer target's every row would not fit in memory;
    each row's score does not depend on the others)."""

    checked = read_run(Path(run))
    detectors = {str(seed): load_detector(folder) for seed, folder in checked.seed_dirs.items()}
    # what any of them reads, read once per chunk (each reads its own part of it)
    need = [n for n in INPUT_NAMES if any(n in d.requires for d in detectors.values())]
    ids, step = list(ids), chunk or FROZEN_CHUNK
    parts: dict[str, list[np.ndarray]] = {seed: [] for seed in detectors}
    for start in range(0, len(ids), step):
        inputs = read_inputs(store, ids[start : start + step], need)
        for seed, detector in detectors.items():
            parts[seed].append(detector.predict_proba(inputs))
    return {
        seed: np.concatenate(p) if p else np.zeros(0, dtype=np.float32) for seed, p in parts.items()
    }


def evaluate_run(
    run: str | Path, store: str | Path | None = None, rows: str = "balanced"
) -> dict[str, Any]:
    """AUROC / AUPRC / ECE per seed of an `actmap train` run folder, and their mean and std.

    Without ``store``: the run's own stored test scores. With ``store``: the frozen
    detectors score that store's rows (transfer), which it only reads: ``rows`` is
    "balanced" (its balanced test split), "test" (every labelled test row, the natural
    prevalence) or "all" (every labelled row). In "test" and "all", empty answers (no
    map: the stop token came first) count as incorrect answers scored 0.
    """
    import pandas as pd

    run = Path(run)
    checked = read_run(run)  # one detector, one recipe: its seeds can be averaged
    per_seed, counts = {}, {}
    if store is None:
        for seed, folder in checked.seed_dirs.items():
            scores = pd.read_parquet(folder / "test_scores.parquet")
            probs, labels = scores["p_correct"].to_numpy(), scores["label"].to_numpy()
            per_seed[str(seed)] = metrics.compute_metrics(probs, labels).__dict__
            counts = {"n": len(labels), "n_correct": int(labels.sum())}
    else:
        the_store = MapStore.open(store)
        chosen = rows_to_score(the_store, rows)
        for seed, probs in frozen_scores(run, the_store, chosen.ids).items():
            probs, labels = with_empty_answers(probs, chosen.labels, chosen.n_empty)
            per_seed[seed] = metrics.compute_metrics(probs, labels).__dict__
        counts = {
            "n": len(chosen.ids) + chosen.n_empty,
            "n_correct": int(chosen.labels.sum()),
            "n_empty_counted_incorrect": chosen.n_empty,
            "n_empty_split_unknown": chosen.empty_split_unknown,
        }
    names = ("auroc", "auprc", "ece")
    mean_std = {k: metrics.seed_summary([m[k] for m in per_seed.values()]) for k in names}
    return {
        "run": str(run),
        "detector": checked.detector,
        "store": str(store) if store else None,
        "rows": rows if store else "run's own test rows",
        **counts,
        "per_seed": per_seed,
        "mean": {k: v[0] for k, v in mean_std.items()},
        "std": {k: v[1] for k, v in mean_std.items()},
    }
