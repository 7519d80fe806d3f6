"""How much of a stacked preset's natural-prevalence ECE is sampling noise, and how much the prior.

`actmap compare-stacked` reports each preset's ECE on every labelled test row, raw and
shifted to the training split's prevalence. On a store with a few hundred test rows an ECE
of .05-.1 can come from the labels' draw alone. This script fits the presets as
`compare-stacked` does (same rows, same choices on validation) and prints, per preset:

- the ECE raw, shifted to the training split's prevalence (the reported figure), and
  shifted to the test rows' own prevalence (an oracle: it reads the test labels' mean, so
  it says what the prior mismatch costs, never a figure to report as the detector's);
- the noise floor: the ECE of the same probabilities against labels drawn from them
  (Bernoulli(p), so perfectly calibrated by construction), median and 95th percentile
  over ``--draws`` draws, at the test rows' count;
- a bootstrap 95% interval of the reported ECE (test rows resampled).

    python scripts/ece_floor.py --store stores/smollm2-cnn_dm-stacked-judged

Prints JSON.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from actmap.experiments.compare_product import score_test_once, store_rows
from actmap.experiments.stacked import presets_scored, with_positions_only
from actmap.scoring.intervals import bootstrap, ece_rows
from actmap.scoring.metrics import ece
from actmap.scoring.prior import shift_to_prevalence
from actmap.store import MapStore


def floor(p: np.ndarray, draws: int, rng: np.random.Generator) -> tuple[float, float]:
    """(median, 95th percentile) ECE of ``p`` against labels drawn from ``p`` itself."""
    y = (rng.random((draws, len(p))) < p).astype(np.float64)
    values = ece_rows(np.broadcast_to(p, y.shape), y)
    return float(np.median(values)), float(np.quantile(values, 0.95))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", required=True)
    ap.add_argument("--draws", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    store = MapStore.open(args.store)
    sets = with_positions_only(store, store_rows(store))
    methods = presets_scored(store, sets, ("deployable", "full"))
    score_test_once(methods, sets)
    y = sets["test_all"].labels.astype(np.float64)
    train_prev = float(sets["train_all"].prevalence)
    out = {
        "store": args.store,
        "n_test_all": len(y),
        "test_prevalence": float(y.mean()),
        "train_prevalence": train_prev,
    }
    for m in methods:
        p = m.test_all
        at_train = shift_to_prevalence(p, train_prev, m.calibrated_prevalence)
        at_test = shift_to_prevalence(p, float(y.mean()), m.calibrated_prevalence)
        boot = bootstrap(at_train, y, ece, n_resamples=args.draws, seed=args.seed)
        out[m.name] = {
            "ece_raw": ece(p, y),
            "ece_at_train_prevalence": ece(at_train, y),
            "ece_at_test_prevalence_oracle": ece(at_test, y),
            "ece_at_train_prevalence_95": [boot.low, boot.high],
            "mean_p_at_train_prevalence": float(at_train.mean()),
            "noise_floor_median_95th": floor(at_train, args.draws, rng),
        }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
