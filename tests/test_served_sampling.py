"""Labels from a biased review queue back into the policy: the review band is reviewed in
full, every answer at a 25% uniform rate. Simulated with a known truth: the served
answers' true p(correct) is sigmoid(z), labels are drawn from it, and the detector reads z
at a balanced prior. Fitting the policy on every label (uncorrected) misreads the natural
accuracy and the calibration; fitting on the uniform sample only (`--sampling sample`, the
default when a sample exists) recovers the truth within the stated tolerances."""

from __future__ import annotations

from datetime import UTC, datetime

import numpy as np
import pytest

from actmap.detectors import as_inputs
from actmap.maps import MapConfig, channel_names
from actmap.scoring.metrics import ece
from actmap.scoring.prior import logit, shift_to_prevalence, sigmoid
from actmap.serve.audit import AuditEntry, AuditTrail
from actmap.serve.fit import fit_policy_from_store
from actmap.serve.policy import Policy, correct_prior, decide
from actmap.store import MapRecord, MapStore
from actmap.store.served import served_sampling

TINY = MapConfig(n_segments=1, layers_out=1, coords_out=2, channels=(channel_names()[0],))
SERVED_POLICY = Policy(accept=0.6, review=0.25, route=0.1)  # review: the wide middle band
MEAN_Z, SD_Z = 0.8, 1.5
N_SERVED, REVIEW_SAMPLE = 5000, 0.25


def natural_accuracy() -> float:
    """E[sigmoid(z)], z ~ N(MEAN_Z, SD_Z), by quadrature (the truth the fit should find)."""
    nodes, weights = np.polynomial.hermite_e.hermegauss(80)
    return float(np.sum(weights * sigmoid(MEAN_Z + SD_Z * nodes)) / np.sqrt(2 * np.pi))


class BalancedDetector:
    """Reads z from the map and says p(correct) at a balanced prior, as a detector trained
    on balanced rows does: sigmoid(z - logit(natural accuracy))."""

    requires = ("maps",)
    needs_scalars = False  # reads the map only, like a LoadedDetector of a paper detector

    def predict_proba(self, maps, scalars=None):
        maps = as_inputs(maps).maps  # a store's DetectorInputs, or bare maps
        z = np.asarray(maps, dtype=np.float64)[:, 0, 0, 0]
        return sigmoid(z - logit(natural_accuracy()))


def served_z(n: int, rng) -> np.ndarray:
    """z as the store keeps it (float16)."""
    return rng.normal(MEAN_Z, SD_Z, n).astype(np.float16).astype(np.float64)


def biased_store(root, rng) -> None:
    """N_SERVED answers through an `AuditTrail` with a 25% uniform review sample; every
    queued answer is labelled from its true p(correct)."""
    z = served_z(N_SERVED, rng)
    p_true = sigmoid(z)
    trail = AuditTrail(root, TINY, background=False, review_sample=REVIEW_SAMPLE)
    entries = []
    for i, (zi, p) in enumerate(zip(z, p_true, strict=True)):
        record = MapRecord(
            id=f"a{i}", source_key="0" * 64, dataset="served", split="chat", model_name="m",
            model_revision="r", prompt="", answer="", n_tokens=3, label=None,
            map=np.array([[[zi, 0.0]]], dtype=np.float16),
        )  # fmt: skip
        entries.append(
            AuditEntry(record, datetime.now(UTC), "chat", 4, "stop", p, p, None,
                       decide(p, SERVED_POLICY), "sim")
        )  # fmt: skip
    trail.append(entries)
    trail.flush()
    queue = trail.store.read_table("review").to_pandas()
    truth = dict(zip([e.record.id for e in entries], p_true, strict=True))
    labels = [(key, int(rng.random() < truth[key]), "review", None) for key in queue["id"]]
    trail.add_labels(labels)
    trail.close()


def test_the_uniform_sample_corrects_the_review_band_bias(tmp_path):
    rng = np.random.default_rng(7)
    biased_store(tmp_path / "audit", rng)
    store = MapStore.open(tmp_path / "audit")
    fits = {}
    for sampling in ("all", "sample"):
        with served_sampling(sampling):
            fits[sampling] = fit_policy_from_store(
                store, BalancedDetector(), 0.1, split="train", n_resamples=200
            )
    held_out = served_z(20_000, rng)  # natural prevalence, never seen by the fit
    p_true = sigmoid(held_out)
    y = (rng.random(len(held_out)) < p_true).astype(int)
    p_raw = BalancedDetector().predict_proba(held_out[:, None, None, None])
    truth = natural_accuracy()
    error, calibration = {}, {}
    for sampling, fitted in fits.items():
        p = correct_prior(p_raw, fitted.policy.prior)
        error[sampling] = float(np.mean(np.abs(p - p_true)))  # against the known truth
        calibration[sampling] = ece(p, y)
    sample, everything = fits["sample"], fits["all"]
    assert sample.policy.fitted["sampling"] == "sample"
    # the uniform sample: about 25% of the train split's answers (~1,000), at the natural
    # accuracy within 0.04 (2.7 binomial standard errors)
    assert 0.2 < len(sample.scores.labels) / (0.8 * N_SERVED) < 0.3
    assert abs(sample.scores.accuracy - truth) < 0.04
    assert sample.temperature.low < 1.0 < sample.temperature.high
    assert error["sample"] < 0.03 and calibration["sample"] < 0.03
    # every label: the review band dominates, the accuracy and the calibration are off
    assert len(everything.scores.labels) > 1.5 * len(sample.scores.labels)
    assert truth - everything.scores.accuracy > 0.06
    assert error["all"] > 0.05 and calibration["all"] > 0.05
    # the fitted accept threshold keeps the target risk on held-out answers only when corrected
    accepted = correct_prior(p_raw, sample.policy.prior) >= sample.policy.accept
    assert 1 - y[accepted].mean() == pytest.approx(0.1, abs=0.03)
    # (a reference for the shift: the held-out truth is the balanced score moved to `truth`)
    np.testing.assert_allclose(shift_to_prevalence(p_raw, truth), p_true, atol=1e-9)
