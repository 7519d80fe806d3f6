"""Claim verdicts follow the intervals: holds, does not hold, inconclusive."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from actmap.experiments.claims import (
    FAILS,
    HOLDS,
    UNSURE,
    beats_non_tensor,
    check_claims,
    classifier_barely_matters,
    matches_actvit,
    overhead_within_noise,
    permutation_most_damaging,
    signal_mid_depth,
    transfer_near_chance,
    transfer_within_task,
)
from actmap.experiments.cost import CaptureCost
from actmap.experiments.in_domain import Cell, InDomainColumn, InDomainMatrix, Paired
from actmap.experiments.transfer import TransferResult, TransferRow
from actmap.scoring.intervals import Interval


def iv(estimate, low, high, n=50):
    return Interval(estimate, low, high, n, 100)


def cell(method, family, auc=0.8):
    return Cell(method, family, 50, 1, iv(auc, auc - 0.1, auc + 0.1), iv(0.8, 0.7, 0.9), None)


def matrix(diff_tad, diff_actvit=None, ece_actvit=None):
    cells = [cell("actmap-vit", "actmap"), cell("tad", "white"), cell("answer_length", "control")]
    paired = [
        Paired("actmap-vit", "tad", diff_tad),
        Paired("actmap-vit", "answer_length", iv(-0.2, -0.3, -0.1)),
    ]
    paired_ece = []
    if diff_actvit is not None:
        cells.append(cell("actvit", "white"))
        paired.append(Paired("actmap-vit", "actvit", diff_actvit))
        paired_ece.append(Paired("actmap-vit", "actvit", ece_actvit))
    column = InDomainColumn("s", "g", "triviaqa", 50, cells, paired, None, [], paired_ece)
    return InDomainMatrix([column])


def test_beats_non_tensor_reads_the_paired_intervals_and_ignores_controls():
    assert beats_non_tensor(matrix(iv(0.1, 0.02, 0.2))).verdict == HOLDS
    assert beats_non_tensor(matrix(iv(0.05, -0.02, 0.1))).verdict == UNSURE
    assert beats_non_tensor(matrix(iv(-0.1, -0.2, -0.01))).verdict == FAILS
    assert beats_non_tensor(None).verdict == UNSURE


def test_matches_actvit_needs_equivalence_and_lower_ece():
    same, lower = iv(0.0, -0.03, 0.03), iv(-0.05, -0.08, -0.01)
    assert matches_actvit(matrix(iv(0.1, 0.05, 0.2), same, lower)).verdict == HOLDS
    wide = iv(0.0, -0.1, 0.1)
    assert matches_actvit(matrix(iv(0.1, 0.05, 0.2), wide, lower)).verdict == UNSURE
    behind = iv(-0.1, -0.15, -0.05)
    assert matches_actvit(matrix(iv(0.1, 0.05, 0.2), behind, lower)).verdict == FAILS
    assert matches_actvit(matrix(iv(0.1, 0.05, 0.2))).verdict == UNSURE  # no ACT-ViT


def test_transfer_claims_split_within_task_from_the_rest():
    tasks = {"a-tqa": "triviaqa", "a-nq": "nq_open", "a-math": "gsm8k", "b-tqa": "triviaqa"}
    rows = [
        TransferRow(
            "cross-dataset", "a-tqa", "a-nq", "mlp", iv(0.8, 0.7, 0.9), iv(0.82, 0.75, 0.9)
        ),
        TransferRow("cross-dataset", "a-tqa", "a-math", "mlp", iv(0.52, 0.45, 0.6)),
        TransferRow("leave-one-generator-out", "a-tqa", "b-tqa", "mlp", iv(0.5, 0.4, 0.6)),
        TransferRow("cross-task", "", "", "", skipped="no CNN/DM"),
    ]
    result = TransferResult(rows, "mlp", "all")
    assert transfer_within_task(result, tasks).verdict == HOLDS
    near = transfer_near_chance(result, tasks)
    assert near.verdict == HOLDS and "a-math" in near.ours and "a-nq" not in near.ours
    rows[2] = TransferRow("leave-one-generator-out", "a-tqa", "b-tqa", "mlp", iv(0.7, 0.65, 0.75))
    assert transfer_near_chance(TransferResult(rows, "mlp", "all"), tasks).verdict == FAILS


def variant(name, group, diff):
    return SimpleNamespace(name=name, group=group, summary=SimpleNamespace(difference=diff))


def test_ablation_claims_from_the_ablation_result():
    perm = variant("coordinate_permutation", "pooling", iv(-0.15, -0.2, -0.1))
    other = variant("last_token_only", "map", iv(-0.01, -0.03, 0.01))
    classifiers = [variant("classifier_mlp", "classifier", iv(0.01, -0.02, 0.03))]
    variants = [perm, other, *classifiers]
    result = SimpleNamespace(
        variants=variants,
        most_damaging=lambda: min(variants[:2], key=lambda v: v.summary.difference.estimate),
        classifier_spread=lambda: {"spread": 0.01},
    )
    assert permutation_most_damaging(result).verdict == HOLDS
    assert classifier_barely_matters(result).verdict == HOLDS
    worse = variant("single_state", "map", iv(-0.3, -0.35, -0.25))
    result.variants = [perm, worse]
    result.most_damaging = lambda: worse
    assert permutation_most_damaging(result).verdict == FAILS


def test_mid_depth_and_overhead_claims():
    def loc(profile):
        rows = np.linspace(0, 32, len(profile) + 1).astype(int).tolist()
        band = int(np.argmax(profile))
        return SimpleNamespace(
            depth_profile=lambda: np.array(profile),
            peak_depth_band=lambda: (rows[band], rows[band + 1] - 1),
            row_edges=rows,
            n_test=50,
        )

    mid = SimpleNamespace(maps={"vit": loc([0, 0.01, 0.05, 0.02, 0, 0, 0, 0])})
    assert signal_mid_depth(mid).verdict == HOLDS
    top = SimpleNamespace(maps={"vit": loc([0, 0, 0, 0, 0, 0, 0, 0.05])})
    assert signal_mid_depth(top).verdict == FAILS
    flat = SimpleNamespace(maps={"vit": loc([0.001] * 8)})
    assert signal_mid_depth(flat).verdict == UNSURE
    noisy = CaptureCost("m", 16, 32, [1.0, 1.2, 1.1], [1.12, 1.15, 1.2], 1.05, True, 60.0)
    assert overhead_within_noise(SimpleNamespace(capture=noisy)).verdict == HOLDS
    quiet = CaptureCost("m", 16, 32, [1.0, 1.01, 1.0], [1.3, 1.3, 1.3], 1.3, True, 60.0)
    assert overhead_within_noise(SimpleNamespace(capture=quiet)).verdict == FAILS


def test_check_claims_with_nothing_computed_is_inconclusive_throughout():
    result = check_claims({}, {})
    assert len(result.claims) == 8 and {c.verdict for c in result.claims} == {UNSURE}
