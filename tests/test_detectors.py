"""Detector architectures (paper parameter counts) and the CorrectnessDetector contract."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from sklearn.exceptions import NotFittedError

from actmap.detectors import (
    CorrectnessDetector,
    DetectorInputs,
    create_detector,
    list_detectors,
    parameter_breakdown,
    register_detector,
)
from actmap.detectors.mlp import mlp_parameters
from actmap.detectors.vit import Attention, drop_path, dropout, dropout_mask
from actmap.training.recipe import TrainConfig, predict_logits

PAPER_TOTAL = 2_401_985
IN_FEATURES = 12 * 32 * 128  # 49,152


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


# --- architectures ----------------------------------------------------------------


def test_vit_matches_paper_parameter_accounting():
    model = create_detector("vit")
    assert parameter_breakdown(model) == {
        "patch_embed": 147_648,
        "position": 3_456,
        "blocks": 2_225_664,
        "norm": 384,
        "head": 24_833,
        "total": PAPER_TOTAL,
    }
    assert n_params(model) == PAPER_TOTAL


def test_vit_structure_and_regularisation():
    model = create_detector("vit")
    assert model.patch_embed.kernel_size == (4, 16) and model.patch_embed.stride == (4, 16)
    assert len(model.blocks) == 6 and model.blocks[0].attn.heads == 6
    assert model.blocks[0].mlp.fc1.out_features == 576
    assert [b.drop_path.p for b in model.blocks] == pytest.approx([0, 0.01, 0.02, 0.03, 0.04, 0.05])
    assert model.blocks[0].attn.attn_drop == 0.1
    assert model.blocks[0].mlp.drop.p == 0.3
    assert model.pos_drop.p == 0.15
    assert model.head[2].p == 0.3


def test_vit_initialisation():
    torch.manual_seed(0)
    model = create_detector("vit")
    w = model.patch_embed.weight  # (192, 12, 4, 16): fan_in 768, fan_out 192
    bound = math.sqrt(6 / (12 * 4 * 16 + 192))
    assert w.abs().max() <= bound and w.abs().max() > 0.95 * bound
    assert w.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.05)
    for p in (model.row_embed, model.col_embed):
        assert p.std().item() == pytest.approx(0.02, rel=0.2)


@pytest.mark.parametrize(
    "shape", [(12, 32, 128), (9, 32, 128), (16, 32, 128), (12, 16, 64), (12, 64, 256)]
)
@pytest.mark.parametrize("name", ["vit", "mlp", "mlp4x", "logreg"])
def test_forward_shapes(name, shape):
    c, h, w = shape
    model = create_detector(name, in_channels=c, map_height=h, map_width=w).eval()
    with torch.no_grad():
        out = model(torch.randn(3, c, h, w))
    assert out.shape == (3,) and out.dtype == torch.float32 and torch.isfinite(out).all()


@pytest.mark.parametrize(("h", "w"), [(16, 64), (32, 128), (64, 256)])
def test_vit_positions_follow_resolution(h, w):
    model = create_detector("vit", map_height=h, map_width=w)
    rows, cols = h // 4, w // 16
    assert model.row_embed.shape == (rows, 192) and model.col_embed.shape == (cols, 192)
    assert parameter_breakdown(model)["position"] == 192 * (2 + rows + cols)
    assert model.forward_features(torch.randn(2, 12, h, w)).shape == (2, 192)


def test_vit_rejects_indivisible_map():
    with pytest.raises(ValueError, match="divisible"):
        create_detector("vit", map_height=30)


def test_attention_matches_naive_softmax_attention():
    torch.manual_seed(0)
    attn = Attention(dim=12, heads=3, attn_drop=0.1).eval()
    x = torch.randn(2, 5, 12)
    q, k, v = attn.qkv(x).split(12, dim=-1)
    heads = []
    for hd in range(3):
        sl = slice(4 * hd, 4 * hd + 4)
        weights = torch.softmax(q[..., sl] @ k[..., sl].transpose(1, 2) / 2.0, dim=-1)
        heads.append(weights @ v[..., sl])
    expected = attn.proj(torch.cat(heads, dim=-1))
    torch.testing.assert_close(attn(x), expected)
    # bf16 scoring on the CPU takes two batched products instead of the fused kernel
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        fast = attn(x)
    assert fast.dtype == torch.bfloat16
    torch.testing.assert_close(fast.float(), expected, rtol=0, atol=3e-2)


def test_bf16_cpu_attention_equals_the_fused_kernel_in_bf16():
    torch.manual_seed(0)
    attn = Attention(dim=192, heads=6, attn_drop=0.1).eval().bfloat16()
    x = torch.randn(4, 65, 192, dtype=torch.bfloat16)
    with torch.inference_mode():
        got = attn(x)
        qkv = attn.qkv(x).reshape(4, 65, 3, 6, 32).permute(2, 0, 3, 1, 4)
        fused = F.scaled_dot_product_attention(*qkv).transpose(1, 2).reshape(4, 65, 192)
        expected = attn.proj(fused)
    torch.testing.assert_close(got.float(), expected.float(), rtol=0, atol=5e-3)  # bf16 rounding
    assert (got.float() - expected.float()).abs().mean() < 5e-4  # a wrong scale gives 0.09


def test_drop_path_drops_whole_samples():
    torch.manual_seed(0)
    x = torch.ones(1000, 3, 4)
    out = drop_path(x, 0.25, training=True)
    per_sample = out.flatten(1)
    kept = (per_sample == 1 / 0.75).all(1)
    dropped = (per_sample == 0).all(1)
    assert bool((kept | dropped).all())
    assert dropped.float().mean().item() == pytest.approx(0.25, abs=0.05)
    assert torch.equal(drop_path(x, 0.25, training=False), x)


@pytest.mark.parametrize("p", [0.1, 0.15, 0.3])
def test_dropout_mask_keeps_each_entry_independently_with_probability_one_minus_p(p):
    torch.manual_seed(0)
    x = torch.empty(400, 1000)
    mask = dropout_mask(x, p)
    assert mask.shape == x.shape and mask.dtype == torch.float32
    kept = mask != 0
    assert torch.equal(mask[kept], torch.full((int(kept.sum()),), 1 / (1 - p)))
    n = x.numel()
    sd = math.sqrt(p * (1 - p) / n)
    assert abs(1 - kept.float().mean().item() - p) < 5 * sd  # binomial, 5 sigma
    # the two halves of one 64-bit draw (even / odd entries) and neighbouring rows are independent
    pairs = kept.view(-1, 2)
    assert (pairs[:, 0] & pairs[:, 1]).float().mean().item() == pytest.approx(
        (1 - p) ** 2, abs=0.01
    )
    assert (kept[1:] & kept[:-1]).float().mean().item() == pytest.approx((1 - p) ** 2, abs=0.01)
    torch.manual_seed(0)
    assert torch.equal(dropout_mask(x, p), mask)  # seeded by torch's generator
    assert not torch.equal(dropout_mask(x, p), mask)
    odd = dropout_mask(torch.empty(3, 5, dtype=torch.bfloat16), p)  # odd count, bf16
    assert odd.dtype == torch.bfloat16 and odd.shape == (3, 5)


def test_dropout_keeps_the_mean_and_is_off_in_eval():
    torch.manual_seed(0)
    x = torch.rand(200, 500, dtype=torch.float64) + 0.5
    out = dropout(x, 0.3, training=True)
    kept = out != 0
    torch.testing.assert_close(out[kept], x[kept] / 0.7)
    assert out.mean().item() == pytest.approx(x.mean().item(), rel=0.01)
    assert dropout(x, 0.3, training=False) is x and dropout(x, 0.0, training=True) is x
    assert torch.equal(dropout(x, 1.0, training=True), torch.zeros_like(x))
    with pytest.raises(ValueError, match="dropout probability"):
        dropout_mask(x, 1.0)


def test_training_attention_is_softmax_attention_with_dropped_weights():
    torch.manual_seed(0)
    attn = Attention(dim=12, heads=3, attn_drop=0.25).train()
    x = torch.randn(2, 5, 12)
    torch.manual_seed(1)
    got = attn(x)
    torch.manual_seed(1)
    # the same draw by hand: 32 random bits per weight, kept when >= the 25% quantile
    words = torch.empty(2 * 3 * 5 * 5 // 2, dtype=torch.int64).random_(-(2**63), None)
    keep = (words.view(torch.int32).view(2, 3, 5, 5) >= -(2**31) + 2**30).double() / 0.75
    q, k, v = attn.qkv(x).double().split(12, dim=-1)
    heads = []
    for hd in range(3):
        sl = slice(4 * hd, 4 * hd + 4)
        weights = torch.softmax(q[..., sl] @ k[..., sl].transpose(1, 2) / 2.0, dim=-1)
        heads.append((weights * keep[:, hd]) @ v[..., sl])
    expected = attn.proj(torch.cat(heads, dim=-1).float())
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    attn.attn_drop = 0.0  # no dropout: the fused kernel's result
    qkv = attn.qkv(x).reshape(2, 5, 3, 3, 4).permute(2, 0, 3, 1, 4)
    fused = attn.proj(F.scaled_dot_product_attention(*qkv).transpose(1, 2).reshape(2, 5, 12))
    torch.testing.assert_close(attn(x), fused)


def test_vit_dropout_only_in_training_mode():
    model = create_detector("vit", depth=2)
    x = torch.randn(4, 12, 32, 128)
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(x), model(x))
        model.train()
        assert not torch.equal(model(x), model(x))


@pytest.mark.parametrize(("name", "budget"), [("mlp", PAPER_TOTAL), ("mlp4x", 4 * PAPER_TOTAL)])
def test_mlp_width_is_the_closest_integer_to_the_budget(name, budget):
    model = create_detector(name)
    h = model.hidden
    assert n_params(model) == h * IN_FEATURES + h + h + 1
    gap = abs(n_params(model) - budget)
    for other in (h - 1, h + 1):
        neighbour = other * (IN_FEATURES + 1) + other + 1
        assert gap <= abs(neighbour - budget)
    assert mlp_parameters(IN_FEATURES, h) == n_params(model)


def test_mlp_widths_for_paper_map():
    assert create_detector("mlp").hidden == 49  # 2,408,547 params
    assert create_detector("mlp4x").hidden == 195  # 9,585,031 params


def test_logreg_has_49153_parameters():
    assert n_params(create_detector("logreg")) == 49_153


def test_registry():
    assert {"vit", "mlp", "mlp4x", "logreg"} <= set(list_detectors())
    with pytest.raises(ValueError, match="unknown detector 'nope'"):
        create_detector("nope")
    with pytest.raises(ValueError, match="already registered"):
        register_detector("vit")(lambda **kw: None)


# --- the estimator contract --------------------------------------------------------

FAST = TrainConfig(max_epochs=4, warmup_epochs=1, patience=3, device="cpu")


def separable_maps(n: int, seed: int, shape=(12, 32, 128)) -> tuple[np.ndarray, np.ndarray]:
    """Correct maps have channel 0 shifted up, incorrect ones down; balanced labels."""
    rng = np.random.default_rng(seed)
    labels = np.arange(n) % 2
    rng.shuffle(labels)
    maps = rng.standard_normal((n, *shape)).astype(np.float32)
    maps[:, 0] += (0.3 * (2 * labels - 1))[:, None, None]
    return maps.astype(np.float16), labels


@pytest.fixture(scope="module")
def fitted() -> tuple[CorrectnessDetector, np.ndarray, np.ndarray]:
    maps, labels = separable_maps(160, 0)
    test_maps, test_labels = separable_maps(64, 1)
    det = CorrectnessDetector("logreg", config=FAST, seed=7)
    det.fit(maps[:96], labels[:96], maps[96:], labels[96:])
    return det, test_maps, test_labels


def test_init_only_stores_arguments():
    det = CorrectnessDetector("mlp", {"dropout": 0.1}, FAST, seed=3, device="cpu")
    assert vars(det) == {
        "detector": "mlp",
        "detector_kwargs": {"dropout": 0.1},
        "config": FAST,
        "seed": 3,
        "device": "cpu",
        "precision": "float32",
        "compile": False,
    }
    with pytest.raises(NotFittedError):
        det.predict_proba(np.zeros((1, 12, 32, 128), np.float32))


def test_fit_learns_and_scores_are_confidences(fitted):
    det, test_maps, test_labels = fitted
    assert det.detector_kwargs_ == {"in_channels": 12, "map_height": 32, "map_width": 128}
    p = det.predict_proba(test_maps)
    assert p.shape == (64,) and p.dtype == np.float32
    assert ((p >= 0) & (p <= 1)).all()
    from sklearn.metrics import roc_auc_score

    assert roc_auc_score(test_labels, p) > 0.9  # higher p = correct
    np.testing.assert_allclose(p, 1 / (1 + np.exp(-det.decision_function(test_maps))), rtol=1e-5)
    # float16 input is cast, so it scores exactly as its float32 copy
    np.testing.assert_array_equal(p, det.predict_proba(torch.from_numpy(test_maps).float()))


def test_float16_maps_score_in_batches_exactly_like_one_float32_pass():
    torch.manual_seed(0)
    model = create_detector("vit").eval()
    maps16 = torch.randn(11, 12, 32, 128).half()
    with torch.inference_mode():
        expected = model(maps16.float())  # one plain float32 forward
    got = predict_logits(model, maps16, batch_size=4)  # 4 + 4 + 3, one reused buffer
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert not model.training


def test_vit_scores_at_most_its_cpu_scoring_rows_per_forward_pass(monkeypatch):
    torch.manual_seed(0)
    model = create_detector("vit", depth=1, dim=32, heads=2, readout_hidden=8).eval()
    monkeypatch.setattr(model, "cpu_scoring_rows", 4)
    rows = []
    model.register_forward_pre_hook(lambda m, args: rows.append(len(args[0])))
    maps16 = torch.randn(10, 12, 32, 128).half()
    with torch.inference_mode():
        expected = {"float32": model(maps16.float())}
        with torch.autocast("cpu", dtype=torch.bfloat16):  # one bf16 pass over all ten maps
            expected["bfloat16"] = model(maps16.float()).float()
    rows.clear()
    # scored in chunks of 4, each precision gives what one pass over every map gives (how far
    # bf16 lies from float32 depends on the CPU's kernels: on AMX cores oneDNN's bf16 path
    # differs from float32 by up to .15 in this tiny random ViT's logits, on AVX-512 BF16 by
    # under .05; benchmarks/check_bf16_auroc.py measures what that does to AUROC on a store)
    for precision in ("float32", "bfloat16"):
        got = predict_logits(model, maps16, batch_size=256, precision=precision)
        torch.testing.assert_close(got, expected[precision], rtol=0, atol=1e-5)
    assert rows == [4, 4, 2] * 2


def test_bf16_scoring_runs_in_bf16_and_keeps_the_ranking(fitted, tmp_path):
    det, test_maps, test_labels = fitted
    seen = []
    handle = det.model_.register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype))
    try:
        fast = CorrectnessDetector.load(det.save(tmp_path / "d"), precision="bfloat16")
        fast.model_.register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype))
        p_fast = fast.predict_proba(test_maps)
    finally:
        handle.remove()
    assert seen == [torch.bfloat16]
    p = det.predict_proba(test_maps)
    np.testing.assert_allclose(p_fast, p, atol=2e-2)
    from sklearn.metrics import roc_auc_score

    assert abs(roc_auc_score(test_labels, p_fast) - roc_auc_score(test_labels, p)) < 0.01
    with pytest.raises(
        ValueError, match="precision must be one of .'float32', 'bfloat16'., got 'fp8'"
    ):
        predict_logits(det.model_, torch.zeros(1, 12, 32, 128), precision="fp8")


def test_save_load_round_trip(fitted, tmp_path):
    det, test_maps, _ = fitted
    det.save(tmp_path / "d", metadata={"dataset": "synthetic"})
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == [
        "config.json",
        "model.safetensors",
    ]
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["detector"] == "logreg" and cfg["seed"] == 7 and cfg["schema_version"] == 1
    assert cfg["actmap_version"] == "0.1.0" and cfg["metadata"] == {"dataset": "synthetic"}
    assert cfg["train_config"]["max_epochs"] == 4 and len(cfg["history"]) == len(det.history_)
    loaded = CorrectnessDetector.load(tmp_path / "d", device="cpu")
    np.testing.assert_array_equal(loaded.predict_proba(test_maps), det.predict_proba(test_maps))
    assert loaded.config_ == det.config_ and loaded.best_epoch_ == det.best_epoch_
    assert loaded.history_ == det.history_ and loaded.wall_time_s_ == det.wall_time_s_
    read_only = test_maps.copy()
    read_only.flags.writeable = False  # e.g. a memory-mapped store shard
    np.testing.assert_array_equal(loaded.predict_proba(read_only), det.predict_proba(test_maps))


def test_vit_save_load_round_trip(tmp_path):
    torch.manual_seed(0)
    det = CorrectnessDetector(
        "vit",
        {"depth": 1, "dim": 24, "heads": 2, "readout_hidden": 8, "patch": (8, 32)},
        TrainConfig(max_epochs=1, device="cpu"),
    )
    maps, labels = separable_maps(8, 2)
    det.fit(maps, labels, maps, labels)
    loaded = CorrectnessDetector.load(det.save(tmp_path / "v"))
    assert loaded.detector_kwargs_["patch"] == (8, 32)  # the JSON list is a tuple again
    assert loaded.model_.grid == (4, 4)
    np.testing.assert_array_equal(loaded.predict_proba(maps), det.predict_proba(maps))


def test_load_rejects_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        CorrectnessDetector.load(tmp_path)


GOOD_MAPS = np.zeros((4, 12, 32, 128), np.float32)
GOOD_LABELS = np.array([0, 1, 0, 1])


@pytest.mark.parametrize(
    ("maps", "labels", "match"),
    [
        (np.zeros((4, 32, 128), np.float32), GOOD_LABELS, r"\(N, C, H, W\)"),
        (np.full((4, 12, 32, 128), np.nan, np.float32), GOOD_LABELS, "NaN"),
        (np.zeros((4, 12, 32, 128), np.int64), GOOD_LABELS, "floating point"),
        (GOOD_MAPS, np.array([0, 1, 2, 1]), "0 or 1"),
        (GOOD_MAPS, np.array([1, 1, 1, 1]), "single class"),
        (GOOD_MAPS, np.array([0, 1, 0]), "3 rows but the maps have 4"),
        (GOOD_MAPS, np.array([[0, 1, 0, 1]]), "1-D"),
    ],
)
def test_fit_rejects_bad_input(maps, labels, match):
    with pytest.raises(ValueError, match=match):
        CorrectnessDetector("logreg", config=FAST).fit(maps, labels, GOOD_MAPS, GOOD_LABELS)


def test_fit_rejects_bad_validation_and_shape_conflicts():
    det = CorrectnessDetector("logreg", config=FAST)
    with pytest.raises(ValueError, match="val_labels contain a single class"):
        det.fit(GOOD_MAPS, GOOD_LABELS, GOOD_MAPS, np.zeros(4))
    with pytest.raises(ValueError, match="val_maps have map shape"):
        det.fit(GOOD_MAPS, GOOD_LABELS, np.zeros((4, 9, 32, 128), np.float32), GOOD_LABELS)
    with pytest.raises(ValueError, match="in_channels=9 but the maps have 12"):
        CorrectnessDetector("logreg", {"in_channels": 9}, FAST).fit(
            GOOD_MAPS, GOOD_LABELS, GOOD_MAPS, GOOD_LABELS
        )


def test_predict_rejects_wrong_map_shape(fitted):
    det = fitted[0]
    with pytest.raises(ValueError, match="detector expects"):
        det.predict_proba(np.zeros((2, 12, 16, 64), np.float32))


def test_float16_to_bfloat16_staging_equals_the_direct_cast(monkeypatch):
    import actmap.training.recipe as training

    monkeypatch.setattr(training, "_STAGING_ELEMENTS", 1000)  # several slices and a short last one
    values = torch.randn(3, 12, 8, 16) * torch.logspace(-9, 4, 16)  # subnormal .. large
    maps16 = values.half()
    flat = maps16.view(-1)
    flat[:6] = torch.tensor([float("inf"), -float("inf"), float("nan"), 65504.0, -0.0, 6e-8])
    out = torch.empty(maps16.shape, dtype=torch.bfloat16)
    assert training.copy_maps_(out, maps16) is out
    expected = maps16.to(torch.bfloat16)
    nan = expected.isnan()
    assert torch.equal(out.isnan(), nan)  # NaN stays NaN (its bit pattern may differ)
    assert torch.equal(out[~nan].view(torch.int16), expected[~nan].view(torch.int16))  # bit for bit


def test_bf16_scoring_from_float16_equals_a_direct_bf16_forward():
    torch.manual_seed(0)
    model = create_detector("mlp").eval()
    maps16 = torch.randn(7, 12, 32, 128).half()
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(maps16.to(torch.bfloat16)).float()
    for _ in range(2):  # the second pass reuses this thread's buffers, the float32 one between
        got = predict_logits(model, maps16, batch_size=4, precision="bfloat16")
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
        float32 = predict_logits(model, maps16, batch_size=4)
        with torch.inference_mode():
            torch.testing.assert_close(float32, model(maps16.float()), rtol=1e-5, atol=1e-5)


def test_a_loaded_detector_scores_through_the_compile_mode_it_is_given(
    fitted, tmp_path, monkeypatch
):
    import actmap.training.recipe as training

    det, test_maps, _ = fitted
    modes = []

    def fake_compile(module, mode=None):  # stands in for torch.compile
        modes.append(mode)
        return lambda x: module(x)

    monkeypatch.setattr(training, "compiler_available", lambda device: True)
    monkeypatch.setattr(torch, "compile", fake_compile)
    graphs = CorrectnessDetector.load(det.save(tmp_path / "d"), compile="reduce-overhead")
    np.testing.assert_allclose(
        graphs.predict_proba(test_maps), det.predict_proba(test_maps), rtol=0, atol=1e-6
    )
    assert modes == ["reduce-overhead"] and graphs.compile == "reduce-overhead"


def test_compiled_scoring_pads_to_one_shape_and_falls_back_to_eager(monkeypatch, caplog):
    import actmap.training.recipe as training

    torch.manual_seed(0)
    model = create_detector("vit", depth=1, dim=32, heads=2, readout_hidden=8).eval()
    maps16 = torch.randn(10, 12, 32, 128).half()
    with torch.inference_mode():
        expected = model(maps16.float())
    shapes, modes = [], []

    def fake_compile(module, mode=None):  # stands in for torch.compile: records its calls
        modes.append(mode)

        def forward(x):
            shapes.append((mode, tuple(x.shape)))
            return module(x)

        return forward

    monkeypatch.setattr(training, "compiler_available", lambda device: True)
    monkeypatch.setattr(torch, "compile", fake_compile)
    got = predict_logits(model, maps16, batch_size=4, compile=True)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert shapes == [("default", (4, 12, 32, 128))] * 3  # the last 2 maps padded to 4 rows
    # a named mode is compiled once beside the first and kept; the first is not compiled again
    for _ in range(2):
        got = predict_logits(model, maps16, batch_size=4, compile="reduce-overhead")
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    predict_logits(model, maps16, batch_size=4, compile=True)
    assert modes == ["default", "reduce-overhead"]
    assert [m for m, _ in shapes] == ["default"] * 3 + ["reduce-overhead"] * 6 + ["default"] * 3
    with pytest.raises(ValueError, match="compile must be True, False or one of"):
        predict_logits(model, maps16, compile="fast")

    other = create_detector("vit", depth=1, dim=32, heads=2, readout_hidden=8).eval()
    other.load_state_dict(model.state_dict())

    def failing_compile(module, mode=None):
        def forward(x):
            raise RuntimeError("no backend here")

        return forward

    monkeypatch.setattr(torch, "compile", failing_compile)
    with caplog.at_level("WARNING", logger="actmap.training.recipe"):
        got = predict_logits(other, maps16, batch_size=4, compile=True)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert "torch.compile failed (RuntimeError: no backend here); running eagerly" in caplog.text
    assert not any("compiled" in name for name in dict(other.named_modules()))  # no submodule
    assert set(other.state_dict()) == set(model.state_dict())


@pytest.mark.parametrize("name", ["logreg", "mlp", "vit", "actmap-plus:v1"])
def test_every_detector_honours_one_protocol(name, tmp_path):
    """Fit each kind on tiny planted maps; then the same calls score it, whatever it is."""
    from actmap.detectors import ActMapPlus, Detector, all_detectors, load_detector
    from actmap.detectors.plus import PlusConfig

    assert name in all_detectors()
    rng = np.random.default_rng(3)
    y = np.tile([0, 1], 24)
    maps = rng.standard_normal((48, 12, 16, 64)).astype(np.float16)
    maps[:, 0, :4, :4] += 2.0 * y[:, None, None].astype(np.float16)
    scalars = np.column_stack([rng.random(48) + y, rng.random((48, 5))])
    if name == "actmap-plus:v1":
        detector = ActMapPlus(PlusConfig(n_components=4, n_strengths=2)).fit(
            DetectorInputs(maps, scalars), y
        )
        assert detector.requires == ("maps", "scalars")
    else:
        config = TrainConfig(max_epochs=2, batch_size=16, device="cpu")
        detector = CorrectnessDetector(name, config=config).fit(maps, y, maps, y)
        assert detector.requires == ("maps",)
        # a maps-only detector does not read the scalars it is handed
        np.testing.assert_array_equal(
            detector.predict_proba(maps, scalars), detector.predict_proba(maps)
        )
    assert isinstance(detector, Detector)
    p = detector.predict_proba(maps, scalars)
    assert p.shape == (48,) and np.all((p >= 0) & (p <= 1))
    logits = detector.decision_function(maps, scalars)
    np.testing.assert_allclose(
        p, 1 / (1 + np.exp(-logits.astype(np.float64))), rtol=1e-5, atol=1e-6
    )
    again = load_detector(detector.save(tmp_path / name.replace(":", "-")))
    assert again.requires == detector.requires
    np.testing.assert_allclose(again.predict_proba(maps, scalars), p, rtol=1e-6, atol=1e-7)


def test_bf16_vit_scoring_warns_on_an_amx_cpu(monkeypatch, tmp_path):
    """bf16 ViT scoring lost its ranking under oneDNN's AMX kernels on a real store: a ViT
    scored in bf16 on such a CPU warns; in float32, or on another CPU, it does not."""
    import warnings

    from actmap.detectors import base
    from actmap.training import recipe

    maps, labels = separable_maps(32, 0)
    tiny = {"depth": 1, "dim": 32, "heads": 2, "readout_hidden": 8}
    det = CorrectnessDetector("vit", tiny, FAST, seed=0, device="cpu")
    det.fit(maps[:24], labels[:24], maps[24:], labels[24:])
    fast = CorrectnessDetector.load(det.save(tmp_path / "vit"), device="cpu", precision="bfloat16")
    monkeypatch.setattr(base, "amx_bf16_cpu", lambda: True)
    with pytest.warns(UserWarning, match="ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16"):
        fast.predict_proba(maps[:4])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        det.predict_proba(maps[:4])  # float32
        monkeypatch.setattr(base, "amx_bf16_cpu", lambda: False)
        fast.predict_proba(maps[:4])
    # the CPU check: an ISA cap below AMX says no whatever the CPU has
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    assert recipe.amx_bf16_cpu() is False
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_AMX")
    cpuinfo = open("/proc/cpuinfo").read().split()
    assert recipe.amx_bf16_cpu() is ("amx_bf16" in cpuinfo)
