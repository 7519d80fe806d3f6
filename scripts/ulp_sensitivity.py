"""How far does a detector's test AUROC move when its maps move in their last float16 bit?

A map depends on the batch it was captured in, in the last bit of some values (session 22:
0.47% of the values, 92% of them by one float16 step, on the same answers). This retrains a
detector (the paper's recipe, 3 seeds) on a store's balanced rows as stored, then TRIALS times
with a FRACTION of every split's map values moved one float16 step up or down at random, and
prints each seed's test AUROC, their mean and the AUROC of the seeds' mean p(correct) (the
report's ActMap figure):

    OMP_NUM_THREADS=1 PYTHONPATH=src .venv/bin/python scripts/ulp_sensitivity.py \
        runs/reproduce-full/stores/gemma3-triviaqa --detector mlp --trials 3
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import numpy as np
from sklearn.metrics import roc_auc_score

from actmap.experiments.seeds import load_balanced, run_seeds


def nudged(maps: np.ndarray, fraction: float, rng: np.random.Generator) -> np.ndarray:
    """A copy of float16 ``maps`` with about ``fraction`` of the values one step up or down."""
    out = maps.copy()
    flat = out.reshape(-1)
    where = rng.random(flat.size) < fraction
    values = flat[where]
    up = rng.random(values.size) < 0.5
    flat[where] = np.where(
        up, np.nextafter(values, np.float16(np.inf)), np.nextafter(values, np.float16(-np.inf))
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("store")
    parser.add_argument("--detector", default="mlp")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--fraction", type=float, default=0.005)
    parser.add_argument("--seeds", default="42,123,456")
    args = parser.parse_args()
    seeds = tuple(int(s) for s in args.seeds.split(","))
    splits, _ = load_balanced(args.store)
    for trial in range(args.trials + 1):
        rng = np.random.default_rng(trial)
        data = {
            name: split
            if trial == 0
            else replace(split, maps=nudged(split.maps, args.fraction, rng))
            for name, split in splits.items()
        }
        runs = run_seeds(
            data["train"], data["validation"], data["test"], detector=args.detector, seeds=seeds
        ).runs
        aurocs = [run.test_metrics["auroc"] for run in runs]
        mean_p = np.mean([run.test_scores.p_correct for run in runs], axis=0)
        ensemble = roc_auc_score(runs[0].test_scores.labels, mean_p)
        print(
            f"trial {trial} ({'as stored' if trial == 0 else 'nudged'}): seeds "
            f"{[round(a, 4) for a in aurocs]} mean {np.mean(aurocs):.4f}, "
            f"AUROC of the mean p {ensemble:.4f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
