"""One-off (docs/results/log.md): actmap-plus's unweighted candidate on a store compared before it.

The session-4 grid adds every labelled training row without class weights. On a
store whose comparison ran before (SmolLM2 x TriviaQA) this fits that candidate,
and if its validation AUROC beats the comparison's choice (argv[2], .8949 there)
scores the test rows once, paired with the TAD scores `actmap baselines` stored.

    python scripts/plus_unweighted_choice.py STORE BEST_VAL OUT.json
"""

import json
import sys

from actmap.experiments.compare_product import (
    PLUS_GRID,
    plus_candidates,
    plus_label,
    select_plus,
    store_rows,
)
from actmap.scoring import metrics
from actmap.scoring.intervals import bootstrap, paired_bootstrap
from actmap.store import MapStore

store = MapStore.open(sys.argv[1])
sets = store_rows(store)
rows, configs = plus_candidates(PLUS_GRID)["train_all unweighted"]
est, table = select_plus(sets[rows], sets["validation"], configs)
print(json.dumps(table, indent=1), flush=True)
best = max(table.values())
print("unweighted best", plus_label(est.config_), best, flush=True)
out = {"unweighted_grid": table, "chosen": plus_label(est.config_), "validation_auroc": best}
if best > float(sys.argv[2]):
    test, test_all = sets["test"], sets["test_all"]
    p = est.predict_proba(test.maps, test.scalars)
    p_all = est.predict_proba(test_all.maps, test_all.scalars)
    tad = (
        store.read_table("results/tad")
        .to_pandas()
        .drop_duplicates("id", keep="last")
        .set_index("id")
    )
    t = tad.loc[test.ids, "confidence"].to_numpy()
    out["test_auroc"] = str(bootstrap(p, test.labels, n_resamples=2000))
    out["minus_tad"] = str(paired_bootstrap(p, t, test.labels, n_resamples=2000))
    out["natural_auroc"] = metrics.auroc(p_all, test_all.labels)
    raw, corr = metrics.natural_ece(
        p_all, test_all.labels, sets["train_all"].prevalence, est.calibrated_prevalence_
    )
    out.update(
        natural_ece_raw=raw,
        natural_ece_corrected=corr,
        calibrated_prevalence=est.calibrated_prevalence_,
    )
print(json.dumps(out, indent=1), flush=True)
json.dump(out, open(sys.argv[3], "w"), indent=1)
