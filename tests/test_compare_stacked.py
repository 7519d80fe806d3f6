"""`compare_stacked` on the fixed split (no cross-fit): each method's balanced-test AUROC and
the paired difference "preset minus method", against sklearn on independently computed
scores (RAUQ run on the test rows; the preset as `train_plus_run` writes its test scores)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

pytest.importorskip("fastapi")
from sklearn.metrics import roc_auc_score  # noqa: E402
from test_stacked_run import store_path  # noqa: E402, F401  (the tiny store fixture)

from actmap.capture.from_store import read_generations  # noqa: E402
from actmap.experiments.compare_product import store_rows  # noqa: E402
from actmap.experiments.stacked import compare_stacked, train_plus_run  # noqa: E402
from actmap.signals.rauq import RAUQ  # noqa: E402
from actmap.store import MapStore  # noqa: E402

PRESET = "actmap-plus deployable"


def test_the_paired_difference_is_the_preset_minus_the_method(store_path, tmp_path):  # noqa: F811
    store = MapStore.open(store_path)
    result = compare_stacked(
        store, presets=("deployable",), baselines=("rauq", "answer_length"), n_resamples=200,
        with_v1=False,
    )  # fmt: skip
    test = store_rows(store)["test"]  # every row has position states: no row is cut
    ids, y = list(test.ids), np.asarray(test.labels)
    assert result.n_test == len(ids)
    rows = {r.method: r for r in result.rows}
    rauq = np.asarray(RAUQ().score(read_generations(store, ids)).confidence, dtype=np.float64)
    train_plus_run(store_path, tmp_path / "run", "deployable")
    scores = pd.read_parquet(tmp_path / "run" / "seed-0" / "test_scores.parquet").set_index("id")
    preset = scores.loc[ids, "p_correct"].to_numpy(dtype=np.float64)
    auroc_preset, auroc_rauq = roc_auc_score(y, preset), roc_auc_score(y, rauq)
    assert rows[PRESET].test_auroc.estimate == pytest.approx(auroc_preset)
    assert rows["rauq"].test_auroc.estimate == pytest.approx(auroc_rauq)
    assert abs(auroc_preset - auroc_rauq) > 0.02  # a sign flip would show
    diff = rows["rauq"].vs[PRESET]
    assert diff.estimate == pytest.approx(auroc_preset - auroc_rauq)
    assert diff.low <= diff.estimate <= diff.high and diff.n == len(y)
    assert PRESET not in rows[PRESET].vs  # no difference of a preset with itself
    length = rows["answer_length"]
    assert length.vs[PRESET].estimate == pytest.approx(auroc_preset - length.test_auroc.estimate)
