"""`actmap serve`, `actmap policy fit`, `actmap audit rescore` and `actmap audit summary`."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from test_serve_audit import entries
from typer.testing import CliRunner

from actmap.cli import app
from actmap.serve.audit import AuditTrail
from actmap.serve.loaded_run import load_detector_run
from actmap.serve.policy import load_policy, threshold_for_risk
from actmap.store import MapRecord, MapStore

runner = CliRunner()


def flat(result) -> str:
    """The output with rich's line wrapping undone."""
    return " ".join(result.output.split())


@pytest.mark.parametrize(
    "command", [["serve"], ["policy", "fit"], ["audit", "rescore"], ["audit", "summary"]]
)
def test_help(command):
    result = runner.invoke(app, [*command, "--help"])
    assert result.exit_code == 0 and "Usage" in result.output


def imbalanced_store(path, n=200, seed=0, config=None):
    """Channel 0 carries the label; about 30% of rows are correct, in every split."""
    rng = np.random.default_rng(seed)
    store = MapStore.create(path, config or {"synthetic": True})
    records = []
    for i in range(n):
        label = int(i % 10 < 3)
        grid = rng.standard_normal((12, 32, 128)).astype(np.float32)
        grid[0] += 0.3 * label
        split = ("train", "train", "validation", "test")[i % 4]
        records.append(MapRecord(f"s:{i}", str(i), "s", split, "m", "r", "p", "a", 5, label, grid))
    store.write_maps(records)
    return store


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli-serve")
    imbalanced_store(root / "store")
    run = root / "run"
    args = ["train", "--store", str(root / "store"), "--out", str(run), "--detector", "logreg"]
    result = runner.invoke(app, [*args, "--seeds", "0", "--max-epochs", "3"])
    assert result.exit_code == 0, result.output
    return root / "store", run


def test_policy_fit_matches_the_risk_coverage_curve(trained, tmp_path, caplog):
    store, run = trained
    out = tmp_path / "policy.toml"
    args = ["policy", "fit", "--run", str(run), "--store", str(store), "--out", str(out)]
    result = runner.invoke(
        app, [*args, "--target-risk", "0.5", "--prior", "none", "--no-calibrate"]
    )
    assert result.exit_code == 0, result.output
    assert "policy written to" in result.output
    policy = load_policy(out)
    # the reference: every labelled validation row scored by the same detector
    opened = MapStore.open(store)
    meta = opened.metadata()
    rows = meta[meta["split"] == "validation"]
    maps, _ = opened.load_maps(rows["id"].tolist())
    p = load_detector_run(run).predict_proba(maps)
    threshold, coverage, risk = threshold_for_risk(p, rows["label"].to_numpy(), 0.5)
    assert policy.accept == pytest.approx(threshold)
    assert policy.fitted["accept"]["coverage"] == pytest.approx(coverage)
    assert policy.fitted["accept"]["risk"] == pytest.approx(risk) and risk <= 0.5
    assert policy.fitted["n"] == len(rows) and policy.prior.method == "none"
    # with the known prior (default: the split's accuracy) the thresholds move, coverage not
    known = runner.invoke(app, [*args, "--target-risk", "0.5", "--no-calibrate"])
    assert known.exit_code == 0, known.output
    shifted = load_policy(out)
    assert shifted.prior.method == "known" and shifted.prior.temperature == 1.0
    assert shifted.prior.deployment_accuracy == pytest.approx(rows["label"].mean())
    assert shifted.fitted["accept"]["coverage"] == pytest.approx(coverage)
    assert shifted.accept < policy.accept  # 30% accuracy shifts p(correct) down
    # calibrated (default): the MAP temperature on every labelled validation row, with
    # bootstrap intervals printed and written, and a warning: 50 rows are fewer than 100
    calibrated = runner.invoke(app, [*args, "--target-risk", "0.5", "--resamples", "300"])
    assert calibrated.exit_code == 0, calibrated.output
    from test_serve_fit import map_temperature_by_grid

    fitted = load_policy(out)
    expected = map_temperature_by_grid(p, rows["label"].to_numpy())
    assert fitted.prior.temperature == pytest.approx(expected, rel=2e-4)
    assert fitted.prior.train_prevalence == 0.5  # a paper detector, trained on balanced rows
    assert fitted.fitted["accept"]["coverage"] == pytest.approx(coverage)
    low, high = fitted.fitted["temperature"]["low"], fitted.fitted["temperature"]["high"]
    assert low <= fitted.prior.temperature <= high
    f = fitted.fitted["accept"]
    assert f["coverage_low"] <= f["coverage"] <= f["coverage_high"]
    text = flat(calibrated)
    assert "fitted on 50 labelled rows (fewer than 100)" in fitted.fitted["warning"]
    assert fitted.fitted["warning"] in caplog.text  # logged (stderr, through the CLI's logging)
    assert f"temperature {fitted.prior.temperature:.3f} [{low:.3f}, {high:.3f}]" in text
    assert (
        f"coverage {f['coverage']:.3f} [{f['coverage_low']:.3f}, {f['coverage_high']:.3f}]" in text
    )
    assert f"risk {f['risk']:.3f} [{f['risk_low']:.3f}, {f['risk_high']:.3f}]" in text


def test_policy_fit_and_serve_errors(trained, tmp_path):
    store, run = trained
    missing = runner.invoke(
        app,
        ["policy", "fit", "--run", str(tmp_path / "nope"), "--store", str(store),
         "--target-risk", "0.1", "--out", str(tmp_path / "p.toml")],
    )  # fmt: skip
    assert missing.exit_code == 2
    assert f"error: detector run {tmp_path / 'nope'} does not exist" in flat(missing)
    served = runner.invoke(app, ["serve", "--detector", str(tmp_path / "nope")])
    assert served.exit_code == 2 and "does not exist" in flat(served)
    bad_split = runner.invoke(
        app,
        ["policy", "fit", "--run", str(run), "--store", str(store), "--target-risk", "0.1",
         "--out", str(tmp_path / "p.toml"), "--split", "dev"],
    )  # fmt: skip
    assert bad_split.exit_code == 2 and "no labelled rows in split 'dev'" in flat(bad_split)


def test_the_server_runs_the_generator_in_the_dtype_the_detector_was_fit_on(
    tmp_path, tiny_model_dir, caplog
):
    """A detector fit on maps a bfloat16 generator wrote is served with the generator in
    bfloat16 by default; another --dtype is honoured, with a warning naming both."""
    import logging

    import torch

    from actmap.serve.app import ServeSettings, build_engine

    store = tmp_path / "store"
    imbalanced_store(store, n=40, config={"model": {"name": "m", "dtype": "bfloat16"}})
    run = tmp_path / "run"
    args = ["train", "--store", str(store), "--out", str(run), "--detector", "logreg"]
    assert runner.invoke(app, [*args, "--seeds", "0", "--max-epochs", "1"]).exit_code == 0
    assert load_detector_run(run).dtype == "bfloat16"
    settings = ServeSettings(model=str(tiny_model_dir), detector=run)
    engine = build_engine(settings)
    assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}
    with caplog.at_level(logging.WARNING, logger="actmap.serve.app"):
        engine = build_engine(
            ServeSettings(model=str(tiny_model_dir), detector=run, dtype="float32")
        )
    assert {p.dtype for p in engine.model.parameters()} == {torch.float32}
    assert "in float32, but detector" in caplog.text and "captured in bfloat16" in caplog.text
    served = runner.invoke(app, ["serve", "--detector", str(run), "--dtype", "int4"])
    assert served.exit_code == 2 and "dtype must be one of" in flat(served)


def test_audit_rescore_and_summary(trained, tmp_path):
    _, run = trained
    trail = AuditTrail(tmp_path / "audit", background=False)
    trail.append(entries(0, p=0.9) + entries(1, p=0.3, decision="abstain"))
    trail.flush()
    trail.close()
    out = tmp_path / "rescored.parquet"
    result = runner.invoke(
        app,
        ["audit", "rescore", "--store", str(tmp_path / "audit"), "--detector", str(run),
         "--out", str(out)],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "16 answers re-scored" in flat(result)
    frame = pd.read_parquet(out)
    maps, meta = MapStore.open(tmp_path / "audit").load_maps(frame["id"].tolist())
    direct = load_detector_run(run).predict_proba(maps)
    np.testing.assert_allclose(frame["p_correct_raw_new"], direct, rtol=1e-6)
    summary = runner.invoke(app, ["audit", "summary", "--store", str(tmp_path / "audit")])
    assert summary.exit_code == 0, summary.output
    header, line = summary.stdout.splitlines()[0], summary.stdout.splitlines()[-1]
    assert header.split()[:7] == [
        "n",
        "accept",
        "review",
        "route",
        "abstain",
        "abstain_early",
        "p_mean",
    ]
    assert line.split()[2:9] == ["16", "8", "0", "0", "8", "0", "0.600"]
    not_audit = runner.invoke(app, ["audit", "summary", "--store", str(trained[0])])
    assert not_audit.exit_code == 2 and "not an audit store" in flat(not_audit)


def test_policy_fit_calibrates_from_the_prior_the_detector_holds_at(tmp_path):
    """An actmap-plus fit without class weights on rows 30% correct holds its p(correct) at
    .3: the policy's temperature is fitted from there (the server shifts from there too)."""
    from test_serve_fit import map_temperature_by_grid

    from actmap.detectors.plus import ActMapPlus, PlusConfig

    opened = imbalanced_store(tmp_path / "store")
    meta = opened.metadata()
    train = meta[meta["split"] == "train"]
    maps, _ = opened.load_maps(train["id"].tolist())
    config = PlusConfig(n_components=4, use_scalars=False, class_weight=None, n_strengths=2)
    plus = ActMapPlus(config).fit(maps, train["label"].to_numpy())
    assert plus.calibrated_prevalence_ == pytest.approx(0.3)  # 30 of every 100 rows correct
    plus.save(tmp_path / "run" / "seed-0")
    out = tmp_path / "policy.toml"
    result = runner.invoke(
        app,
        ["policy", "fit", "--run", str(tmp_path / "run"), "--store", str(tmp_path / "store"),
         "--out", str(out), "--target-risk", "0.5", "--resamples", "20"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    policy = load_policy(out)
    assert policy.prior.train_prevalence == pytest.approx(0.3)
    rows = meta[meta["split"] == "validation"]
    p = plus.predict_proba(opened.load_maps(rows["id"].tolist())[0])
    y = rows["label"].to_numpy()
    expected = map_temperature_by_grid(p, y, train_prevalence=plus.calibrated_prevalence_)
    assert policy.prior.temperature == pytest.approx(expected, rel=2e-4)
    # the check can tell: from a balanced prior the temperature would be another
    assert abs(map_temperature_by_grid(p, y) / expected - 1) > 0.05
    assert "detector's prior 0.300" in flat(result)


def test_serve_flags_land_in_their_mode_groups(monkeypatch, tmp_path):
    """Every mode flag of `actmap serve` reaches its settings group (`actmap.serve.settings`):
    the flags are read back from the settings `build_engine` is given."""
    import actmap.serve.app as serve_app
    import actmap.serve.vllm_launch as vllm_launch
    from actmap.errors import ActmapUserError
    from actmap.serve.settings import ActionSettings, ProxySettings, VllmSettings

    given = []

    def build_engine(settings, *args, **kwargs):
        given.append(settings)
        raise ActmapUserError("stop here")

    monkeypatch.setattr(serve_app, "build_engine", build_engine)
    monkeypatch.setattr(vllm_launch, "vllm_server_command", build_engine)  # --engine vllm
    base = ["serve", "--model", "tiny", "--detector", str(tmp_path), "--batch-size", "3"]
    proxy = [
        "--upstream", "http://127.0.0.1:9/v1", "--upstream-model", "big", "--upstream-timeout",
        "7", "--upstream-api-key", "k", "--upstream-dtype", "bfloat16",
        "--allow-weights-mismatch", "--allow-dtype-mismatch",
    ]  # fmt: skip
    actions = [
        "--route-to", "http://127.0.0.1:8/v1", "--route-model", "huge", "--route-api-key", "r",
        "--route-timeout", "3", "--abstain-message", "no",
    ]  # fmt: skip
    vllm = ["--engine", "vllm", "--vllm-compile", "--tensor-parallel-size", "2"]
    for extra in (proxy, vllm, actions, []):
        result = runner.invoke(app, [*base, *extra])
        assert result.exit_code == 2 and "stop here" in result.output, result.output
    as_proxy, as_vllm, acting, plain = given
    assert as_proxy.proxy == ProxySettings(
        upstream="http://127.0.0.1:9/v1", model="big", timeout_s=7.0, api_key="k",
        dtype="bfloat16", allow_weights_mismatch=True, allow_dtype_mismatch=True,
    )  # fmt: skip
    assert (as_proxy.mode, as_proxy.vllm, as_proxy.actions) == ("proxy", None, ActionSettings())
    assert (as_vllm.mode, as_vllm.vllm, as_vllm.proxy) == (
        "vllm", VllmSettings(compile=True, tensor_parallel_size=2), None,
    )  # fmt: skip
    assert acting.actions == ActionSettings(
        route_to="http://127.0.0.1:8/v1", route_model="huge", route_api_key="r",
        route_timeout_s=3.0, abstain_message="no",
    )  # fmt: skip
    assert acting.actions.acting and not plain.actions.acting
    assert (plain.mode, plain.max_batch, plain.model) == ("local", 3, "tiny")
    refused = runner.invoke(app, [*base, "--engine", "ray"])
    assert refused.exit_code == 2 and "--engine must be 'local' or 'vllm', got 'ray'" in flat(
        refused
    )
