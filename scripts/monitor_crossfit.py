"""The monitor's false-alarm rate on real in-domain maps, by repeated cross-fitting.

A store's own held-out rows are few (the built-in store: 226 validation + test rows,
one window of 200), so one fitted monitor says little about its false-alarm rate.
Here the store's rows are split at random ``--repeats`` times into a fitting part
(``--fit`` of them) and a held-out part; a monitor is fitted on the first and tested
on disjoint windows of the second. Windows of one repeat share the monitor, windows
of different repeats share nothing but the store, so the pooled rate estimates the
false-alarm rate averaged over monitors (the exact `alpha` of the permutation test),
and its spread over repeats shows how far one monitor strays from it.

    python scripts/monitor_crossfit.py --store stores/smollm2-builtin --window 50,200
    python scripts/monitor_crossfit.py --store stores/smollm2-builtin --prevalence 0.1

Prints JSON: per window size, alarms / windows pooled, an exact binomial 95% interval
(it treats windows as independent, which holds across repeats, not within one), and
the alarm rate of each repeat.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
from scipy.stats import binomtest

from actmap.monitor import MonitorConfig, ShiftMonitor
from actmap.store import MapStore


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", required=True)
    parser.add_argument("--window", default="50,200")
    parser.add_argument("--fit", type=float, default=0.6, help="fraction of rows fitted on")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--alpha", type=float, default=0.05)
    parser.add_argument(
        "--prevalence", type=float, default=None,
        help="resample the held-out rows to this fraction correct (a prevalence change only)",
    )  # fmt: skip
    opts = parser.parse_args()
    maps, meta = MapStore.open(opts.store).load_maps()
    labels = meta["label"].to_numpy(dtype=float)
    sizes = [int(w) for w in opts.window.split(",")]
    alarms = {w: [] for w in sizes}
    for repeat in range(opts.repeats):
        rng = np.random.default_rng(1000 + repeat)
        order = rng.permutation(len(maps))
        cut = int(opts.fit * len(maps))
        config = MonitorConfig(alpha=opts.alpha, seed=repeat)
        monitor = ShiftMonitor(config).fit(maps[np.sort(order[:cut])])
        held_rows = order[cut:]
        if opts.prevalence is not None:
            held_rows = resample(held_rows, labels, opts.prevalence, rng)
        held = monitor.transform(maps[held_rows])
        for w in sizes:
            alarms[w].append(
                [
                    monitor.test_features(held[i : i + w], rng).alarm
                    for i in range(0, len(held) - w + 1, w)
                ]
            )
    result = {"store": opts.store, "rows": len(maps), "fit_rows": cut, "held_out_rows": len(held),
              "prevalence": opts.prevalence, "repeats": opts.repeats, "alpha": opts.alpha,
              "windows": {}}  # fmt: skip
    for w in sizes:
        flat = [a for rep in alarms[w] for a in rep]
        ci = binomtest(sum(flat), len(flat)).proportion_ci(0.95, method="exact")
        result["windows"][str(w)] = {
            "alarms": int(sum(flat)),
            "windows": len(flat),
            "alarm_rate": sum(flat) / len(flat),
            "interval": [float(ci.low), float(ci.high)],
            "per_repeat": [float(np.mean(rep)) for rep in alarms[w]],
        }
    print(json.dumps(result, indent=2))


def resample(rows: np.ndarray, labels: np.ndarray, prevalence: float, rng) -> np.ndarray:
    """``rows`` cut to ``prevalence`` correct without replacement (as many as the rarer side allows)."""
    correct = rows[labels[rows] == 1]
    wrong = rows[labels[rows] == 0]
    total = min(len(correct) / prevalence, len(wrong) / (1 - prevalence))
    n_correct, n_wrong = int(total * prevalence), int(total * (1 - prevalence))
    chosen = np.concatenate(
        [rng.choice(correct, n_correct, replace=False), rng.choice(wrong, n_wrong, replace=False)]
    )
    return rng.permutation(chosen)


if __name__ == "__main__":
    main()
