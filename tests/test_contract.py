"""The one detector contract (`actmap.detectors`): every registered name builds, fits on one
input bundle, saves and loads back through the one loader to the same scores; the one
registry refuses an unknown name; the capture table agrees with what each detector declares."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file
from test_stacked import KEYS, synthetic_rows

from actmap.capture.needs import CAPTURE_NEEDS
from actmap.detectors import (
    ALIASES,
    DetectorInputs,
    all_detectors,
    detector_name,
    load_detector,
    new_detector,
)
from actmap.errors import ActmapUserError
from actmap.training.recipe import TrainConfig

PAPER_SETTINGS = {"config": TrainConfig(max_epochs=2, batch_size=16, device="cpu")}


@pytest.fixture(scope="module")
def paper_data():
    """Maps (12 channels, as the paper's detectors read) with the label planted in a corner."""
    rng = np.random.default_rng(5)
    y = np.tile([0, 1], 24)
    maps = rng.standard_normal((48, 12, 16, 64)).astype(np.float16)
    maps[:, 0, :4, :4] += 2.0 * y[:, None, None].astype(np.float16)
    scalars = np.column_stack([rng.random(48) + y, rng.random((48, 5))])
    return DetectorInputs(maps, scalars), y


@pytest.fixture(scope="module")
def stacked_data():
    return synthetic_rows(120, 0), synthetic_rows(60, 1)


def fitted(name: str, paper_data, stacked_data):
    if name.startswith("actmap-plus:") and name != "actmap-plus:v1":
        (train, y), (val, y_val) = stacked_data
        detector = new_detector(name, map_components=8, tad_previous=KEYS)
        return detector.fit(train, y, val, y_val), val
    inputs, y = paper_data
    settings = {"n_components": 4, "n_strengths": 2} if name == "actmap-plus:v1" else PAPER_SETTINGS
    return new_detector(name, **settings).fit(inputs, y, inputs, y), inputs


@pytest.mark.parametrize("name", all_detectors())
def test_every_registered_name_round_trips_through_the_one_loader(
    name, paper_data, stacked_data, tmp_path
):
    detector, inputs = fitted(name, paper_data, stacked_data)
    p = detector.predict_proba(inputs)
    assert p.shape == (len(inputs),) and np.all((p >= 0) & (p <= 1))
    logits = np.asarray(detector.decision_function(inputs), dtype=np.float64)
    np.testing.assert_allclose(p, 1 / (1 + np.exp(-logits)), rtol=1e-5, atol=1e-6)
    result = detector.score(inputs)  # the scorer contract the baselines honour
    np.testing.assert_allclose(result.confidence, p, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(result.raw, logits, rtol=1e-6)
    assert result.raw_name == "logit"
    again = load_detector(detector.save(tmp_path / "saved"))
    assert type(again) is type(detector)
    assert (again.kind, again.requires) == (detector.kind, detector.requires)
    assert again.capture_needs() == detector.capture_needs()
    np.testing.assert_allclose(again.predict_proba(inputs), p, rtol=1e-6, atol=1e-6)
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert saved["detector"] == detector.kind  # what served answers record


def test_an_unknown_name_is_refused_naming_the_known_ones():
    with pytest.raises(ActmapUserError, match="unknown detector 'vitt'") as raised:
        new_detector("vitt")
    for known in (*all_detectors(), "actmap-plus"):
        assert known in str(raised.value)
    with pytest.raises(ActmapUserError, match="actmap-plus:v1"):
        detector_name("actmap-plus:v2")


def test_plain_actmap_plus_is_version_1():
    assert ALIASES == {"actmap-plus": "actmap-plus:v1"}
    assert detector_name("actmap-plus") == "actmap-plus:v1"
    plain = new_detector("actmap-plus")
    assert plain.kind == "actmap-plus" and plain.requires == ("maps", "scalars")
    assert not hasattr(plain, "selected_")  # not a stacked preset


@pytest.mark.parametrize("name", all_detectors())
def test_the_capture_table_is_what_each_detector_declares(name):
    """`actmap capture --methods <name>` keeps what the unfitted detector says it reads."""
    declared = new_detector(name).capture_needs()
    entry = name if name.startswith("actmap-plus") else "actmap"
    assert CAPTURE_NEEDS[entry] == declared
    # by hand, from what each reads: the map alone keeps no grey-box statistics
    if name.startswith("actmap-plus:") and name != "actmap-plus:v1":
        assert declared["greybox"] and declared["keep_positions"]
        assert ("attention_keys" in declared) == name.endswith(":full")
    else:
        assert declared == {"greybox": name == "actmap-plus:v1"}


def test_the_one_loader_scores_v1_as_its_saved_arrays_say(paper_data, tmp_path):
    """A reference independent of `ActMapPlus`: the logit recomputed with numpy from
    model.safetensors and config.json, as any reader of the artifact would."""
    inputs, y = paper_data
    new_detector("actmap-plus:v1", n_components=4, n_strengths=2).fit(inputs, y).save(tmp_path)
    arrays = load_file(tmp_path / "model.safetensors")
    x = np.asarray(inputs.maps, dtype=np.float32).reshape(len(y), -1)
    features = np.hstack([(x - arrays["map_mean"]) @ arrays["components"].T, inputs.scalars])
    z = (features - arrays["feature_mean"]) / arrays["feature_scale"] @ arrays["coef"]
    z += arrays["intercept"][0]
    np.testing.assert_allclose(
        load_detector(tmp_path).predict_proba(inputs), 1 / (1 + np.exp(-z)), rtol=1e-6
    )


def test_bare_maps_stand_for_a_bundle_of_maps(paper_data):
    inputs, y = paper_data
    maps_only = new_detector("logreg", **PAPER_SETTINGS).fit(inputs.maps, y, inputs.maps, y)
    np.testing.assert_array_equal(
        maps_only.predict_proba(inputs.maps), maps_only.predict_proba(inputs)
    )
    with pytest.raises(ValueError, match="inside the DetectorInputs"):
        maps_only.predict_proba(inputs, inputs.scalars)
