"""The bootstrap helper against a direct resampling loop."""

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score

from actmap.scoring.intervals import bootstrap, paired_bootstrap


def data(n=80, seed=1):
    rng = np.random.default_rng(seed)
    y = np.r_[np.ones(n // 2), np.zeros(n // 2)].astype(int)
    a = y + rng.normal(scale=1.0, size=n)
    b = y + rng.normal(scale=1.5, size=n)
    return a, b, y


def direct_loop(a, b, y, n_resamples, seed):
    """The same draws as the helper, written out: one index vector per resample."""
    rng = np.random.default_rng(seed)
    single, diff = [], []
    while len(single) < n_resamples:
        idx = rng.integers(0, len(y), len(y))
        if len(set(y[idx])) < 2:
            continue
        single.append(roc_auc_score(y[idx], a[idx]))
        diff.append(roc_auc_score(y[idx], a[idx]) - roc_auc_score(y[idx], b[idx]))
    return np.percentile(single, [2.5, 97.5]), np.percentile(diff, [2.5, 97.5])


def test_unpaired_and_paired_match_a_direct_loop():
    a, b, y = data()
    a[:10] = np.round(a[:10])  # some tied scores
    (lo, hi), (dlo, dhi) = direct_loop(a, b, y, 200, seed=3)
    one = bootstrap(a, y, n_resamples=200, seed=3)
    two = paired_bootstrap(a, b, y, n_resamples=200, seed=3)
    assert one.estimate == pytest.approx(roc_auc_score(y, a))
    assert (one.low, one.high) == pytest.approx((lo, hi))
    assert two.estimate == pytest.approx(roc_auc_score(y, a) - roc_auc_score(y, b))
    assert (two.low, two.high) == pytest.approx((dlo, dhi))
    assert one.n == 80 and one.n_resamples == 200
    assert bootstrap(a, y).n_resamples == 2000  # the default


def test_any_metric_goes_through_the_loop():
    a, _, y = data()
    mean_gap = lambda s, t: float(s[t == 1].mean() - s[t == 0].mean())  # noqa: E731
    rng = np.random.default_rng(5)
    values = []
    while len(values) < 200:
        idx = rng.integers(0, len(y), len(y))
        if len(set(y[idx])) == 2:
            values.append(mean_gap(a[idx], y[idx]))
    result = bootstrap(a, y, metric=mean_gap, n_resamples=200, seed=5)
    assert (result.low, result.high) == pytest.approx(tuple(np.percentile(values, [2.5, 97.5])))


def test_paired_interval_is_narrower_than_separate_ones_for_correlated_methods():
    rng = np.random.default_rng(0)
    y = np.r_[np.ones(100), np.zeros(100)].astype(int)
    base = y + rng.normal(size=200)
    a, b = base, base + rng.normal(scale=0.1, size=200)
    paired = paired_bootstrap(a, b, y, n_resamples=500)
    single = bootstrap(a, y, n_resamples=500)
    assert paired.high - paired.low < 0.5 * (single.high - single.low)


def test_single_class_resamples_are_redrawn_and_counted():
    y = np.array([1] + [0] * 7)
    s = np.arange(8.0)
    result = bootstrap(s, y, n_resamples=200)
    assert result.redrawn > 0
    assert 0.0 <= result.low <= result.high <= 1.0


def test_mismatched_rows_are_refused():
    with pytest.raises(ValueError, match="scores have 2, 1 rows but labels have 2"):
        paired_bootstrap([0.1, 0.2], [0.1], [0, 1])


def test_row_metrics_equal_the_scalar_metric_on_every_row():
    from sklearn.metrics import average_precision_score

    from actmap.scoring import metrics
    from actmap.scoring.intervals import auprc_rows, auroc_rows, ece_rows

    rng = np.random.default_rng(7)
    y = rng.integers(0, 2, (120, 25))
    y[:, 0], y[:, 1] = 0, 1  # both classes in every row
    p = rng.random((120, 25))
    p[::2] = np.round(p[::2], 1)  # many ties (and values on bin edges) in half the rows
    p[5] = 0.5  # one row tied throughout
    p[6, :5] = 1.0  # p = 1 falls in the last bin
    np.testing.assert_allclose(
        auroc_rows(p, y), [roc_auc_score(t, s) for s, t in zip(p, y, strict=True)]
    )
    np.testing.assert_allclose(
        auprc_rows(p, y),
        [average_precision_score(t, s) for s, t in zip(p, y, strict=True)],
        rtol=1e-12,
    )
    np.testing.assert_allclose(
        ece_rows(p, y), [metrics.ece(s, t) for s, t in zip(p, y, strict=True)]
    )
    np.testing.assert_allclose(
        ece_rows(p, y, 7), [metrics.ece(s, t, 7) for s, t in zip(p, y, strict=True)], atol=1e-15
    )


@pytest.mark.parametrize("name", ["auprc", "ece"])
def test_auprc_and_ece_intervals_match_a_direct_loop(name, monkeypatch):
    """The vectorised AUPRC / ECE bootstrap (unpaired, paired, seeds) against a loop calling
    the scalar metric on each resample; a small chunk makes the helper work in pieces."""
    from actmap.scoring import intervals, metrics

    monkeypatch.setattr(intervals, "ROW_CHUNK", 1000)
    metric = getattr(metrics, name)
    rng = np.random.default_rng(11)
    y = rng.integers(0, 2, 60)
    seeds = np.clip(y * 0.3 + rng.random((3, 60)) * 0.7, 0, 1)  # (S, n) probabilities
    seeds[:, :20] = np.round(seeds[:, :20], 1)  # ties
    other = rng.random(60)
    draw = np.random.default_rng(4)
    single, diff = [], []
    while len(single) < 200:
        idx = draw.integers(0, 60, 60)
        if len(set(y[idx])) < 2:
            continue
        mean_seeds = np.mean([metric(s[idx], y[idx]) for s in seeds])
        single.append(mean_seeds)
        diff.append(mean_seeds - metric(other[idx], y[idx]))
    one = intervals.bootstrap(seeds, y, metric, n_resamples=200, seed=4)
    two = intervals.paired_bootstrap(seeds, other, y, metric, n_resamples=200, seed=4)
    assert (one.low, one.high) == pytest.approx(tuple(np.percentile(single, [2.5, 97.5])))
    assert (two.low, two.high) == pytest.approx(tuple(np.percentile(diff, [2.5, 97.5])))
    assert one.estimate == pytest.approx(np.mean([metric(s, y) for s in seeds]))


def test_ece_interval_refuses_scores_that_are_not_probabilities():
    from actmap.scoring import metrics

    with pytest.raises(ValueError, match="probs must lie in"):
        bootstrap(np.array([0.2, 1.5, 0.3, 0.9]), np.array([0, 1, 0, 1]), metrics.ece)


def test_risk_coverage_rows_and_their_intervals_equal_the_scalar_metric_loop():
    from actmap.scoring import metrics
    from actmap.scoring.intervals import (
        coverage_at_risk_metric,
        coverage_at_risk_rows,
        risk_at_coverage_metric,
        risk_at_coverage_rows,
    )

    rng = np.random.default_rng(2)
    y = rng.integers(0, 2, (150, 30))
    p = np.round(rng.random((150, 30)) * 0.6 + 0.4 * y, 1)  # ties; some rows reach 5% risk
    for target in (0.05, 0.3):
        np.testing.assert_array_equal(
            coverage_at_risk_rows(p, y, target),
            [metrics.coverage_at_risk(s, t, target) for s, t in zip(p, y, strict=True)],
        )
    for coverage in (0.8, 0.5, 1.0):
        np.testing.assert_array_equal(
            risk_at_coverage_rows(p, y, coverage),
            [metrics.risk_at_coverage(s, t, coverage) for s, t in zip(p, y, strict=True)],
        )
    scores, labels = p[:3], y[0]  # (S, n): three seeds on the same rows
    for fast, scalar in (
        (coverage_at_risk_metric(0.05), lambda s, t: metrics.coverage_at_risk(s, t, 0.05)),
        (risk_at_coverage_metric(0.8), lambda s, t: metrics.risk_at_coverage(s, t, 0.8)),
    ):
        assert fast(p[0], y[0]) == scalar(p[0], y[0])
        a = bootstrap(scores, labels, fast, n_resamples=300, seed=9)
        b = bootstrap(scores, labels, scalar, n_resamples=300, seed=9)  # a resample at a time
        assert (a.estimate, a.low, a.high, a.redrawn) == (b.estimate, b.low, b.high, b.redrawn)
