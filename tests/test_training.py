"""The paper's training recipe: schedule, mixup, pos_weight, selection, reproducibility, artifacts."""

from __future__ import annotations

import json
import math
from dataclasses import asdict

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from scipy import stats
from sklearn.metrics import roc_auc_score

from actmap.detectors import CorrectnessDetector, create_detector
from actmap.device import resolve_device
from actmap.experiments.seeds import run_seeds
from actmap.store.rows import Rows
from actmap.training import recipe as training
from actmap.training.recipe import (
    EarlyStopping,
    Rngs,
    TrainConfig,
    add_input_noise,
    lr_multiplier,
    mix,
    mixup_bce_loss,
    positive_class_weight,
    sample_mixup,
    train_detector,
)


def separable(n: int, seed: int, shape=(12, 32, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    labels = torch.randperm(n, generator=g) % 2
    maps = torch.randn((n, *shape), generator=g)
    maps[:, 0] += (0.3 * (2 * labels - 1)).float()[:, None, None]
    return maps.half(), labels


# --- config and schedule --------------------------------------------------------------


def test_train_config_defaults_are_the_papers():
    cfg = TrainConfig()
    assert (cfg.lr, cfg.weight_decay, cfg.batch_size, cfg.max_epochs) == (1e-3, 0.05, 64, 80)
    assert (cfg.warmup_epochs, cfg.final_lr_multiplier, cfg.patience) == (5, 0.01, 20)
    assert (cfg.grad_clip, cfg.input_noise_sigma, cfg.mixup_alpha) == (1.0, 0.08, 0.2)
    assert cfg.seeds == (42, 123, 456) and cfg.deterministic and cfg.precision == "float32"
    assert TrainConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("lr", 0.0),
        ("patience", 0),
        ("mixup_alpha", -1.0),
        ("final_lr_multiplier", 2.0),
        ("seeds", ()),
        ("precision", "float16"),
    ],
)
def test_train_config_rejects_bad_values(field, value):
    with pytest.raises(ValueError, match=field):
        TrainConfig(**{field: value})


def test_train_config_from_dict_rejects_unknown_fields():
    with pytest.raises(ValueError, match="unknown TrainConfig fields: epochs"):
        TrainConfig.from_dict({"epochs": 3})


@pytest.mark.parametrize("epoch", [0, 4, 5, 42, 79])
def test_lr_multiplier_matches_paper_formula(epoch):
    expected = (
        (epoch + 1) / 5 if epoch < 5 else 0.01 + 0.495 * (1 + math.cos(math.pi * (epoch - 5) / 75))
    )
    assert lr_multiplier(epoch, TrainConfig()) == pytest.approx(expected, abs=1e-12)


def test_lr_schedule_endpoints():
    cfg = TrainConfig()
    assert lr_multiplier(4, cfg) == 1.0 and lr_multiplier(5, cfg) == pytest.approx(1.0)
    assert lr_multiplier(80, cfg) == pytest.approx(0.01)


# --- augmentation and loss ---------------------------------------------------------


def manual_bce(z: torch.Tensor, y: torch.Tensor, pos_weight: float) -> torch.Tensor:
    p = 1 / (1 + torch.exp(-z))
    return -(pos_weight * y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()


def test_mixup_loss_is_the_convex_combination():
    z = torch.tensor([0.3, -1.2, 2.0, 0.5], dtype=torch.float64)
    y = torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=torch.float64)
    perm = torch.tensor([2, 3, 1, 0])
    lam, pw = 0.3, 1.5
    expected = lam * manual_bce(z, y, pw) + (1 - lam) * manual_bce(
        z, torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=torch.float64), pw
    )
    got = mixup_bce_loss(z, y, lam, perm, torch.tensor(pw, dtype=torch.float64))
    assert got.item() == pytest.approx(expected.item(), rel=1e-12)


def test_mix_inputs_by_hand():
    x = torch.tensor([[1.0], [2.0], [4.0]])
    out = mix(x, 0.25, torch.tensor([1, 2, 0]))
    torch.testing.assert_close(out, torch.tensor([[0.25 + 1.5], [0.5 + 3.0], [1.0 + 0.75]]))


def test_positive_class_weight():
    assert positive_class_weight(torch.tensor([1, 0, 0, 0])) == pytest.approx(3.0)
    assert positive_class_weight(torch.tensor([1, 0, 1, 0])) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="single class"):
        positive_class_weight(torch.tensor([1, 1]))


def test_sample_mixup_draws_beta_and_a_permutation():
    rngs = Rngs.from_seed(0, torch.device("cpu"))
    draws = [sample_mixup(8, 0.2, rngs) for _ in range(2000)]
    lams = np.array([d[0] for d in draws])
    assert stats.kstest(lams, stats.beta(0.2, 0.2).cdf).pvalue > 1e-3
    assert all(sorted(d[1].tolist()) == list(range(8)) for d in draws)
    assert sample_mixup(8, 0.0, rngs)[0] == 1.0  # alpha 0 disables mixing


def test_input_noise_is_independent_per_map_and_seeded():
    x = torch.zeros(4, 12, 32, 128)
    noise = add_input_noise(x, 0.08, torch.Generator().manual_seed(1))
    assert noise.std().item() == pytest.approx(0.08, rel=0.02)
    assert not torch.equal(noise[0], noise[1])
    torch.testing.assert_close(noise, add_input_noise(x, 0.08, torch.Generator().manual_seed(1)))
    assert torch.equal(add_input_noise(x, 0.0, torch.Generator()), x)


# --- model selection ---------------------------------------------------------------


def test_early_stopping_keeps_strict_improvements_only():
    stopper = EarlyStopping(patience=3)
    scores = [0.6, 0.7, 0.7, 0.65, 0.71, float("nan"), 0.71, 0.5]
    improved = [stopper.update(e, s) for e, s in enumerate(scores) if not stopper.should_stop]
    assert improved == [True, True, False, False, True, False, False, False]
    assert stopper.best_epoch == 4 and stopper.best_score == 0.71 and stopper.should_stop


def test_train_detector_restores_the_selected_checkpoint(monkeypatch):
    scripted = iter([0.5, 0.8, 0.8, 0.7, 0.6, 0.9, 0.9])  # best 0.8 at epoch 1, tie at 2
    monkeypatch.setattr(training, "validate", lambda *a, **k: (next(scripted), 0.0))
    torch.manual_seed(0)
    model = create_detector("logreg", in_channels=1, map_height=4, map_width=4)
    states = {}

    def snapshot(epoch, info):
        states[epoch] = {k: v.clone() for k, v in model.state_dict().items()}

    x, y = torch.randn(16, 1, 4, 4), torch.arange(16) % 2
    cfg = TrainConfig(max_epochs=10, warmup_epochs=1, patience=3, device="cpu")
    result = train_detector(model, x, y, x, y, cfg, seed=0, progress=snapshot)
    assert [r.epoch for r in result.history] == [0, 1, 2, 3, 4]  # 3 epochs without improvement
    assert [r.improved for r in result.history] == [True, True, False, False, False]
    assert result.best_epoch == 1 and result.best_val_auroc == 0.8
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, states[1][k])
        torch.testing.assert_close(result.state_dict[k], states[1][k])
    assert not torch.equal(states[1]["linear.weight"], states[2]["linear.weight"])
    # the per-epoch learning rates follow the schedule
    lrs = [r.lr for r in result.history]
    assert lrs == pytest.approx([1e-3 * lr_multiplier(e, cfg) for e in range(5)])


def test_train_detector_learns_and_is_reproducible():
    x, y = separable(128, 0)
    vx, vy = separable(64, 1)
    cfg = TrainConfig(max_epochs=5, warmup_epochs=1, device="cpu")

    def run(seed):
        torch.manual_seed(seed)
        model = create_detector("logreg")
        result = train_detector(model, x, y, vx, vy, cfg, seed=seed)
        return result, [
            {k: v for k, v in asdict(r).items() if k != "epoch_time_s"} for r in result.history
        ]

    result, history = run(42)
    assert result.best_val_auroc > 0.9 and result.device == "cpu"
    assert run(42)[1] == history
    assert run(123)[1] != history


def test_small_vit_training_is_reproducible():
    x, y = separable(48, 2)
    cfg = TrainConfig(max_epochs=2, warmup_epochs=1, batch_size=16, device="cpu")
    kwargs = {"depth": 2, "dim": 32, "heads": 2, "readout_hidden": 16}

    def history(seed):
        det = CorrectnessDetector("vit", kwargs, cfg, seed=seed).fit(x, y, x[:24], y[:24])
        return [(r.train_loss, r.val_loss, r.val_auroc) for r in det.history_]

    assert history(5) == history(5)


def test_bf16_training_runs_its_products_in_bf16_and_still_learns():
    x, y = separable(128, 0)
    vx, vy = separable(64, 1)
    model = create_detector("mlp")
    dtypes = set()
    model.fc1.register_forward_hook(lambda m, args, out: dtypes.add((m.training, out.dtype)))
    fp32 = TrainConfig(max_epochs=4, warmup_epochs=1, device="cpu")
    cfg = TrainConfig(max_epochs=4, warmup_epochs=1, device="cpu", precision="bfloat16")
    result = train_detector(model, x, y, vx, vy, cfg, seed=42)
    assert dtypes == {(True, torch.bfloat16), (False, torch.bfloat16)}  # training, validation
    assert result.best_val_auroc > 0.85
    reference = train_detector(create_detector("mlp"), x, y, vx, vy, fp32, seed=42)
    assert abs(result.best_val_auroc - reference.best_val_auroc) < 0.05


def test_deterministic_torch_restores_previous_settings():
    before = torch.are_deterministic_algorithms_enabled()
    with training.deterministic_torch(True):
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert torch.are_deterministic_algorithms_enabled() == before


def test_resolve_device():
    assert resolve_device("cpu") == torch.device("cpu")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected


# --- seeds and artifacts ---------------------------------------------------------


def test_run_seeds_writes_per_seed_artifacts(tmp_path):
    x, y = separable(96, 3)
    tx, ty = separable(40, 4)
    ids = [f"row-{i}" for i in range(40)]
    seen = []
    cfg = TrainConfig(max_epochs=3, warmup_epochs=1, device="cpu")
    result = run_seeds(
        Rows(None, y[:64], x[:64]),
        Rows(None, y[64:], x[64:]),
        Rows(ids, ty, tx),
        tmp_path,
        detector="logreg",
        config=cfg,
        seeds=(42, 123),
        inputs={"store": "abc123"},
        metadata={"dataset": "synthetic"},
        progress=lambda epoch, info: seen.append((info["seed"], epoch)),
    )
    assert seen == [(42, 0), (42, 1), (42, 2), (123, 0), (123, 1), (123, 2)]
    assert [r.seed for r in result.runs] == [42, 123]
    aurocs = []
    for seed in (42, 123):
        d = tmp_path / f"seed-{seed}"
        assert {p.name for p in d.iterdir()} == {
            "model.safetensors",
            "config.json",
            "history.json",
            "test_scores.parquet",
            "metrics.json",
        }
        table = pq.read_table(d / "test_scores.parquet").to_pandas()
        assert list(table.columns) == ["id", "label", "logit", "p_correct"]
        assert table["id"].tolist() == ids and table["label"].tolist() == ty.tolist()
        np.testing.assert_allclose(table["p_correct"], 1 / (1 + np.exp(-table["logit"])), rtol=1e-5)
        loaded = CorrectnessDetector.load(d)
        np.testing.assert_array_equal(loaded.predict_proba(tx), table["p_correct"].to_numpy())
        m = json.loads((d / "metrics.json").read_text())
        assert m["auroc"] == pytest.approx(roc_auc_score(table["label"], table["p_correct"]))
        assert m["n_test"] == 40 and m["best_epoch"] == loaded.best_epoch_
        assert len(json.loads((d / "history.json").read_text())) == len(loaded.history_)
        config = json.loads((d / "config.json").read_text())
        assert config["metadata"]["dataset"] == "synthetic"
        assert config["metadata"]["splits"]["train"] == {"n": 64, "n_correct": int(y[:64].sum())}
        aurocs.append(m["auroc"])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["mean"]["auroc"] == pytest.approx(np.mean(aurocs))
    assert summary["std"]["auroc"] == pytest.approx(np.std(aurocs, ddof=1))
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["inputs"] == {"store": "abc123"} and manifest["torch"] == torch.__version__
    assert manifest["device"] == "cpu" and manifest["seeds"] == [42, 123]


def test_labeled_maps_rejects_mismatched_ids():
    with pytest.raises(ValueError, match="ids has 2 rows but labels has 3"):
        Rows(["a", "b"], np.array([0, 1, 0]), np.zeros((3, 1, 1, 1))).row_ids()
