"""The serving figures on a real store: running-score AUROC by answer position, prior correction.

Reads a store captured with ``--keep-trajectories`` and a run from ``actmap train``
on it (nothing is written to the store) and prints JSON:

- ``running_auroc``: AUROC of the running p(correct) after k answer tokens on the
  split's labelled answers (all of them, at natural prevalence; AUROC ignores it);
- ``prior_correction``: ECE of raw p(correct) on the split at its natural
  prevalence, and after the logit shift to a known accuracy (the train split's,
  a labelled sample from deployment) and to the EM estimate from the split's own
  unlabelled scores, each without and with a temperature fitted first as the
  policy fit fits it (`fit_policy_temperature` on the labelled validation rows at
  their natural prevalence, from the detector's training prior);
- ``prevalence_shift``: the split resampled to several prevalences, same three ECEs.

    python scripts/serve_figures.py --store stores/smollm2-builtin --run runs/mlp
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from actmap.serve.fit import (
    detector_train_prevalence,
    fit_policy_temperature,
    natural_scores,
    prevalence_shift_ece,
    prior_correction_ece,
)
from actmap.serve.loaded_run import load_detector_run
from actmap.serve.streaming import running_auroc
from actmap.store import MapStore
from actmap.store.rows import natural_accuracy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--store", type=Path, required=True)
    parser.add_argument("--run", type=Path, required=True)
    parser.add_argument("--split", default="test")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    store = MapStore.open(args.store)
    detector = load_detector_run(args.run, args.seed)
    scores = natural_scores(store, detector, args.split)
    validation = natural_scores(store, detector, "validation")
    temperature = fit_policy_temperature(
        validation.p_raw, validation.labels, detector_train_prevalence(detector)
    )
    known = natural_accuracy(store).get("train", float("nan"))
    result = {
        "store": str(args.store),
        "detector": detector.id,
        "running_auroc": running_auroc(store, detector, args.split).to_json(),
        "prior_correction": prior_correction_ece(scores, known, temperature).to_json(),
        "prevalence_shift": prevalence_shift_ece(
            scores.p_raw, scores.labels, temperature=temperature
        ),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
