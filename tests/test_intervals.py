"""The bootstrap helper against a direct resampling loop."""

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score

from actmap.intervals import bootstrap, paired_bootstrap


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
