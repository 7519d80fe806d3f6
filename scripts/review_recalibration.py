"""Recalibrating a detector on a new task from a few reviewed answers: the ECE that follows.

Issue 56's target: after 200 reviewed answers from a new task, the recalibrated policy's
ECE at natural prevalence is at most .05 on held-out rows of that task. This script
simulates the review loop on a labelled store of the new task (``--store``): the
reviewed answers are a uniform random draw of ``--reviewed`` labelled rows of its train
and validation splits (what ``serve --review-sample`` queues, the rows ``policy fit``
counts by default on an audit store), the recalibration is `actmap.serve.fit`'s (a MAP
temperature, then the logit shift from the detector's prior to the reviewed answers'
accuracy, `fit_policy_temperature` + `PriorSetting("known")`), and the ECE is measured on
every labelled test row at its natural prevalence. Repeated over ``--draws`` draws of the
reviewed answers; the noise floor is the ECE of the recalibrated scores against labels
drawn from themselves (perfect calibration, same rows).

    python scripts/review_recalibration.py --detector runs/builtin-logreg \\
        --store stores/smollm2-triviaqa-stacked --reviewed 200 --draws 200

The stores are only read. Prints JSON.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from actmap.scoring.intervals import ece_rows
from actmap.scoring.metrics import ece
from actmap.serve.fit import detector_train_prevalence, fit_policy_temperature, store_p_raw
from actmap.serve.loaded_run import load_detector_run
from actmap.serve.policy import PriorSetting, correct_prior
from actmap.store import MapStore
from actmap.store.rows import natural_ids, read_rows

CHUNK = 512


def scores(store: MapStore, detector, ids: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(raw p(correct), labels) of ``ids``, read ``CHUNK`` rows at a time."""
    p, y = [], []
    for start in range(0, len(ids), CHUNK):
        rows = read_rows(store, ids[start : start + CHUNK])
        p.append(store_p_raw(store, detector, rows))
        y.append(rows.labels)
    return np.concatenate(p), np.concatenate(y)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--detector", required=True, help="run folder (trained on another task)")
    parser.add_argument("--store", required=True, help="labelled store of the new task")
    parser.add_argument("--reviewed", type=int, default=200)
    parser.add_argument("--draws", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    detector = load_detector_run(args.detector)
    store = MapStore.open(args.store)
    ids = natural_ids(store)
    pool_p, pool_y = scores(store, detector, ids["train"] + ids["validation"])
    test_p, test_y = scores(store, detector, ids["test"])
    prior = detector_train_prevalence(detector)
    rng = np.random.default_rng(args.seed)
    values, floors, temperatures = [], [], []
    for _ in range(args.draws):
        pick = rng.choice(len(pool_y), args.reviewed, replace=False)
        p, y = pool_p[pick], pool_y[pick]
        if y.min() == y.max():  # a draw holding one label: nothing to calibrate on
            continue
        t = fit_policy_temperature(p, y, prior)
        setting = PriorSetting("known", float(y.mean()), prior, temperature=t)
        corrected = correct_prior(test_p, setting)
        values.append(ece(corrected, test_y))
        drawn = (rng.random(len(corrected)) < corrected).astype(np.float64)
        floors.append(float(ece_rows(corrected[None], drawn[None])[0]))
        temperatures.append(t)
    values = np.array(values)
    print(
        json.dumps(
            {
                "detector": detector.id,
                "store": args.store,
                "pool_rows": len(pool_y),
                "pool_accuracy": float(pool_y.mean()),
                "test_rows": len(test_y),
                "test_accuracy": float(test_y.mean()),
                "reviewed": args.reviewed,
                "draws": len(values),
                "ece_raw": ece(test_p, test_y),
                "ece_recalibrated": {
                    "median": float(np.median(values)),
                    "p10": float(np.quantile(values, 0.1)),
                    "p90": float(np.quantile(values, 0.9)),
                    "share_at_most_0.05": float(np.mean(values <= 0.05)),
                },
                "noise_floor_median": float(np.median(floors)),
                "temperature_median": float(np.median(temperatures)),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
