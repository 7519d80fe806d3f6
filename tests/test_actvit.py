"""ACT-ViT baseline: preprocessing against naive loops, model shapes and sizes, protocol, sweep, scorer."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from sklearn.metrics import roc_auc_score

from actmap.baselines.actvit import (
    SWEEP_GRID,
    ACTViT,
    ACTViTConfig,
    ACTViTScorer,
    LabeledTensors,
    SweepResult,
    actvit_tensor,
    count_parameters,
    pad_tokens,
    patchify,
    pool_layers,
    run_sweep,
    sweep_key,
    tensor_nbytes,
    train_config,
)
from actmap.baselines.base import BaselineUnavailable
from actmap.capture.records import Generation
from actmap.scoring.contract import ScoreResult

torch.set_num_threads(1)

# small enough for one CPU core: 2 heads of width 8, MLP 32, 16-wide ViT
TINY = ACTViTConfig(dim=16, depth=1, heads=2, dim_head=8, mlp_dim=32, patch=(8, 1), batch_size=32)


# ----------------------------------------------------------------------------- naive references


def naive_actvit(dense: torch.Tensor, n_max: int, groups: int, pad_mode: str) -> torch.Tensor:
    """Element by element: token slice/zero-pad, layer pad to a multiple of groups, max per group."""
    L, N, D = dense.shape
    padded_layers = L if L % groups == 0 else (L // groups + 1) * groups
    per_group = padded_layers // groups
    out = torch.empty(groups, n_max, D, dtype=dense.dtype)
    for g in range(groups):
        for t in range(n_max):
            best = None
            for layer in range(g * per_group, (g + 1) * per_group):
                if layer < L:
                    row = dense[layer, t] if t < N else torch.zeros(D, dtype=dense.dtype)
                elif pad_mode == "zero":
                    row = torch.zeros(D, dtype=dense.dtype)
                else:  # replicate the last real layer
                    row = dense[L - 1, t] if t < N else torch.zeros(D, dtype=dense.dtype)
                best = row.clone() if best is None else torch.maximum(best, row)
            out[g, t] = best
    return out


def naive_patchify(x: torch.Tensor, ph: int, pw: int) -> torch.Tensor:
    _, G, N, _ = x.shape
    patches = []
    for i in range(G // ph):
        for j in range(N // pw):
            vals = [x[:, i * ph + a, j * pw + b, :] for a in range(ph) for b in range(pw)]
            patches.append(torch.cat(vals, dim=-1))
    return torch.stack(patches, dim=1)


def formula_params(D: int, cfg: ACTViTConfig) -> int:
    """Parameter count written out layer by layer (vit-pytorch layout, our adapter in front)."""
    dp, dim, m = cfg.resolved_adapter_dim, cfg.dim, cfg.resolved_mlp_dim
    inner = cfg.heads * cfg.dim_head
    patch_dim = cfg.patch[0] * cfg.patch[1] * dp
    n_patches = (8 // cfg.patch[0]) * (100 // cfg.patch[1])
    adapter = D * dp + dp
    embed = 2 * patch_dim + (patch_dim * dim + dim) + 2 * dim
    tokens = dim + (n_patches + 1) * dim
    block = (2 * dim + dim * 3 * inner + inner * dim + dim) + (
        2 * dim + dim * m + m + m * dim + dim
    )
    return adapter + embed + tokens + cfg.depth * block + 2 * dim + dim + 1


def separable(n: int, d: int, seed: int, shift: float = 1.5) -> tuple[torch.Tensor, np.ndarray]:
    """Correct rows carry +shift on the first two hidden coordinates of the first 20 tokens."""
    g = torch.Generator().manual_seed(seed)
    y = np.array([i % 2 for i in range(n)])
    x = torch.randn(n, 8, 100, d, generator=g)
    x[torch.from_numpy(y == 1), :, :20, :2] += shift
    return x.half(), y


# ----------------------------------------------------------------------------- preprocessing


@pytest.mark.parametrize("pad_mode", ["zero", "replicate"])
@pytest.mark.parametrize("L,N", list(itertools.product([18, 28, 30, 32], [1, 5, 100, 130])))
def test_actvit_tensor_matches_naive_loop(L, N, pad_mode):
    g = torch.Generator().manual_seed(L * 1000 + N)
    dense = torch.randn(L, N, 3, generator=g).half()  # negatives make zero padding visible
    got = actvit_tensor(dense, pad_mode=pad_mode)
    assert got.shape == (8, 100, 3) and got.dtype == torch.float16
    torch.testing.assert_close(got, naive_actvit(dense, 100, 8, pad_mode), rtol=0, atol=0)


def test_zero_and_replicate_padding_differ_where_expected():
    dense = -torch.rand(28, 4, 2) - 1.0  # all negative
    zero = pool_layers(dense, pad_mode="zero")
    rep = pool_layers(dense, pad_mode="replicate")
    assert torch.equal(zero[:7], rep[:7])  # 28 = 7 full groups of 4
    assert torch.equal(zero[7], torch.zeros(4, 2))  # 8th group is only padding
    assert torch.equal(rep[7], dense[27])  # replicated last layer
    assert torch.equal(
        pool_layers(dense[:24], pad_mode="zero"), pool_layers(dense[:24], pad_mode="replicate")
    )


def test_pad_tokens_slices_and_pads():
    dense = torch.arange(2 * 130 * 1, dtype=torch.float32).reshape(2, 130, 1)
    assert torch.equal(pad_tokens(dense), dense[:, :100])
    short = pad_tokens(dense[:, :3])
    assert torch.equal(short[:, :3], dense[:, :3]) and short[:, 3:].abs().sum() == 0
    assert pad_tokens(dense[:, :0]).shape == (2, 100, 1)  # empty answer -> all zeros


def test_preprocessing_rejects_bad_input():
    with pytest.raises(ValueError, match=r"\(L, N, D\)"):
        pad_tokens(torch.zeros(3, 4))
    with pytest.raises(ValueError, match="pad_mode"):
        pool_layers(torch.zeros(3, 4, 2), pad_mode="edge")
    with pytest.raises(ValueError, match="no layers"):
        pool_layers(torch.zeros(0, 4, 2))


def test_bytes_per_row():
    assert tensor_nbytes(576) == 8 * 100 * 576 * 2 == 921_600
    assert tensor_nbytes(4096) == 6.25 * 2**20  # the paper's 6.25 MiB


# ----------------------------------------------------------------------------- model


@pytest.mark.parametrize("patch", [(1, 1), (8, 1), (4, 2), (2, 5)])
def test_patchify_matches_naive_loop(patch):
    x = torch.randn(2, 8, 100, 3)
    torch.testing.assert_close(patchify(x, patch), naive_patchify(x, *patch), rtol=0, atol=0)


def test_sweep_grid_is_the_24_configurations():
    assert len(SWEEP_GRID) == 24 and len(set(SWEEP_GRID)) == 24
    expected = set(itertools.product((128, 1024), (1, 3), (1.0, 1e-3), ((1, 1), (8, 1), (4, 2))))
    assert {(c.dim, c.depth, c.weight_decay, c.patch) for c in SWEEP_GRID} == expected
    fixed = (4, 0.3, 1e-3, 15, 128, 0.1)  # heads, dropout, lr, epochs, batch, warm-up
    for c in SWEEP_GRID:
        assert (c.heads, c.dropout, c.lr, c.epochs, c.batch_size, c.warmup_fraction) == fixed


@pytest.mark.parametrize("D", [576, 4096])
def test_parameter_counts_match_layer_formula(D):
    for cfg in SWEEP_GRID:
        with torch.device("meta"):
            model = ACTViT.from_config(cfg, D)
        assert count_parameters(model) == formula_params(D, cfg)


def test_paper_selected_config_parameter_count():
    # hidden 128, depth 1, wd 1e-3, patch 4x2 on a D = 4096 model (paper: 5.16M, see docs)
    cfg = ACTViTConfig(dim=128, depth=1, weight_decay=1e-3, patch=(4, 2))
    with torch.device("meta"):
        assert count_parameters(ACTViT.from_config(cfg, 4096)) == 868_993
        # a wider adapter is where the paper's extra parameters would have to live
        wide = ACTViT.from_config(dataclasses.replace(cfg, adapter_dim=1024), 4096)
    assert abs(count_parameters(wide) - 5.16e6) / 5.16e6 < 0.07


def test_forward_shapes_and_input_check():
    model = ACTViT.from_config(TINY, 6).eval()
    assert model(torch.randn(3, 8, 100, 6).half()).shape == (3,)
    with pytest.raises(ValueError, match="expects"):
        model(torch.randn(3, 8, 100, 7))


def test_bfloat16_precision_is_autocast_over_float32_weights():
    fp32 = ACTViT.from_config(TINY, 6).eval()
    bf16 = ACTViT.from_config(dataclasses.replace(TINY, precision="bfloat16"), 6).eval()
    bf16.load_state_dict(fp32.state_dict())  # same float32 weights
    assert {p.dtype for p in bf16.parameters()} == {torch.float32}
    x = torch.randn(8, 8, 100, 6)
    with torch.no_grad():
        exact, mixed = fp32(x), bf16(x)
        # the same model with every weight rounded to bfloat16, run in bfloat16 by hand
        by_hand = copy.deepcopy(fp32).to(torch.bfloat16)(x.to(torch.bfloat16))
    assert mixed.dtype == torch.float32 and mixed.shape == (8,)
    assert not torch.equal(mixed, exact)  # the matmuls did run in bfloat16
    torch.testing.assert_close(mixed, exact, atol=0.05, rtol=0.05)
    torch.testing.assert_close(mixed, by_hand.float(), atol=0.05, rtol=0.05)
    with pytest.raises(ValueError, match="precision must be one of float32, bfloat16"):
        dataclasses.replace(TINY, precision="float16")
    # a record written before the field existed reads as float32
    old = {k: v for k, v in TINY.to_dict().items() if k != "precision"}
    assert ACTViTConfig.from_dict(old) == TINY
    mixed_cfg = dataclasses.replace(TINY, precision="bfloat16")
    assert ACTViTConfig.from_dict(mixed_cfg.to_dict()) == mixed_cfg


def test_a_sweep_reports_every_epoch_of_every_configuration():
    train, val = separable(32, 4, 0), separable(16, 4, 1)
    grid = [dataclasses.replace(TINY, epochs=2), dataclasses.replace(TINY, epochs=3, dim=8)]
    reports = []
    result = run_sweep(
        train,
        val,
        grid=grid,
        retrain_seeds=(5,),
        device="cpu",
        progress=lambda *r: reports.append(r),
    )
    e = result.selected.epochs  # the retrain's epochs: the total is exact once it is known
    assert [r[:2] for r in reports] == [
        *[(k, 8) for k in (0, 1, 2)],  # configuration 1: 2 epochs (8 = 2 + 3 + at most 3)
        *[(k, 8) for k in (2, 3, 4, 5)],  # configuration 2: 3 epochs
        *[(k, 5 + e) for k in range(5, 6 + e)],  # the retrain with seed 5
    ]
    assert reports[2][2] == "config 1/2 (width 16, depth 1, decay 0.001, patch 8x1) epoch 2/2"
    assert reports[-1][2] == f"seed 5 ({result.selected.label()}) epoch {e}/{e}"
    mixed = dataclasses.replace(TINY, precision="bfloat16")
    assert mixed.label() == "width 16, depth 1, decay 0.001, patch 8x1, bfloat16"


def test_bfloat16_training_separates_and_keys_its_own_sweep():
    train, val, test = separable(192, 4, 0), separable(64, 4, 1), separable(64, 4, 2)
    cfg = dataclasses.replace(TINY, epochs=6, dropout=0.0, emb_dropout=0.0)
    mixed = dataclasses.replace(cfg, precision="bfloat16")
    exact_run = train_config(cfg, train, val, test, seed=42, device="cpu")
    mixed_run = train_config(mixed, train, val, test, seed=42, device="cpu")
    assert mixed_run.test_auroc > 0.95
    assert mixed_run.test_auroc == pytest.approx(roc_auc_score(test[1], mixed_run.test_scores))
    np.testing.assert_allclose(mixed_run.test_scores, exact_run.test_scores, atol=0.1)
    rows = LabeledTensors(*train), LabeledTensors(*val)
    keys = {sweep_key([c], 42, *rows) for c in (cfg, mixed)}
    assert len(keys) == 2  # a float32 sweep never resumes from a bfloat16 one


def test_config_rejects_patch_that_does_not_divide_grid():
    with pytest.raises(ValueError, match="patch"):
        ACTViTConfig(patch=(3, 2))


# ----------------------------------------------------------------------------- protocol


def lr_multiplier(step: int, total_steps: int, warmup_steps: int) -> float:
    """Per-step factor: linear warm-up from 0, then half-cosine to 0 at `total_steps`.

    ACT-ViT's recipe as written (the reference): training uses transformers'
    `get_cosine_schedule_with_warmup`, which the test below checks equals it step by step.
    """
    if step < warmup_steps:
        return step / max(1, warmup_steps)
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))


def test_lr_multiplier_matches_transformers_cosine_with_warmup():
    from transformers import get_cosine_schedule_with_warmup

    total, warmup = 155, 15
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = get_cosine_schedule_with_warmup(opt, warmup, total)
    for step in range(total):
        assert lr_multiplier(step, total, warmup) == pytest.approx(
            sched.get_last_lr()[0], abs=1e-12
        )
        opt.step()
        sched.step()
    assert lr_multiplier(warmup, total, warmup) == 1.0
    assert lr_multiplier(warmup + (total - warmup) // 2, total, warmup) == pytest.approx(0.5)


def test_training_separates_synthetic_classes():
    train, val, test = separable(192, 4, 0), separable(64, 4, 1), separable(64, 4, 2)
    cfg = dataclasses.replace(TINY, epochs=6, dropout=0.0, emb_dropout=0.0)
    run = train_config(cfg, train, val, test, seed=42, device="cpu")
    assert run.test_auroc > 0.95
    assert run.test_auroc == pytest.approx(roc_auc_score(test[1], run.test_scores))
    assert ((run.test_scores >= 0) & (run.test_scores <= 1)).all()
    val_aurocs = [h.val_auroc for h in run.history]
    assert run.val_auroc == max(val_aurocs) and run.best_epoch == val_aurocs.index(max(val_aurocs))


def test_training_is_deterministic_per_seed():
    train, val = separable(64, 4, 0, shift=0.3), separable(32, 4, 1, shift=0.3)
    cfg = dataclasses.replace(TINY, epochs=2)
    a = train_config(cfg, train, val, val, seed=7, device="cpu")
    b = train_config(cfg, train, val, val, seed=7, device="cpu")
    c = train_config(cfg, train, val, val, seed=8, device="cpu")
    np.testing.assert_array_equal(a.test_scores, b.test_scores)
    assert a.history == b.history
    assert not np.array_equal(a.test_scores, c.test_scores)
    assert not torch.are_deterministic_algorithms_enabled()  # flag restored after training


def test_micro_batches_give_the_full_batch_step_and_bound_each_pass(monkeypatch):
    train, val = separable(80, 4, 0, shift=0.3), separable(32, 4, 1, shift=0.3)
    # 80 rows in batches of 32: steps of 32, 32 and 16 rows; no dropout, so the only
    # difference a micro batch may make is float rounding in the summed gradients
    cfg = dataclasses.replace(TINY, epochs=3, dropout=0.0, emb_dropout=0.0)
    rows_per_pass = []
    forward = ACTViT.forward

    def counting(self, x):
        rows_per_pass.append((torch.is_grad_enabled(), x.shape[0]))
        return forward(self, x)

    monkeypatch.setattr(ACTViT, "forward", counting)
    whole = train_config(cfg, train, val, val, seed=3, device="cpu")
    assert [n for grad, n in rows_per_pass if grad] == [32, 32, 16] * 3
    assert [n for grad, n in rows_per_pass if not grad] == [32] * 4  # val per epoch, then test
    rows_per_pass.clear()
    sliced = train_config(cfg, train, val, val, seed=3, device="cpu", micro_batch=5)
    # each 32-row step runs as 5 x 6 + 2 rows, the 16-row step as 5 x 3 + 1
    step = [5] * 6 + [2] + [5] * 6 + [2] + [5] * 3 + [1]
    assert [n for grad, n in rows_per_pass if grad] == step * 3
    assert [n for grad, n in rows_per_pass if not grad] == ([5] * 6 + [2]) * 4
    for key, tensor in whole.state.items():
        torch.testing.assert_close(sliced.state[key], tensor, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(sliced.test_scores, whole.test_scores, rtol=1e-4, atol=1e-6)
    losses = [h.train_loss for h in whole.history]
    assert [h.train_loss for h in sliced.history] == pytest.approx(losses, rel=1e-5)
    with pytest.raises(ValueError, match="micro_batch must be >= 1"):
        train_config(cfg, train, val, seed=3, device="cpu", micro_batch=0)


def test_ties_keep_earlier_epoch_and_earlier_config():
    train, val = separable(32, 4, 0), separable(16, 4, 1)
    frozen = dataclasses.replace(TINY, epochs=3, lr=0.0)  # weights never move: equal val AUROC
    run = train_config(frozen, train, val, seed=42, device="cpu")
    assert len({h.val_auroc for h in run.history}) == 1 and run.best_epoch == 0
    grid = [frozen, dataclasses.replace(frozen, weight_decay=1.0)]
    result = run_sweep(train, val, seed=42, retrain_seeds=(), grid=grid, device="cpu")
    assert result.grid[0].val_auroc == result.grid[1].val_auroc
    assert result.selected == grid[0]


def test_bad_labels_and_missing_class_are_named():
    x, y = separable(8, 4, 0)
    with pytest.raises(ValueError, match="val: AUROC needs both"):
        train_config(TINY, (x, y), (x, np.ones(8)), device="cpu")
    with pytest.raises(ValueError, match="train: labels must be 0/1"):
        train_config(TINY, (x, y * 2), (x, y), device="cpu")


# ----------------------------------------------------------------------------- sweep and scorer


def test_tiny_sweep_selects_by_validation_and_round_trips(tmp_path):
    train, val = separable(48, 4, 0, shift=0.5), separable(24, 4, 1, shift=0.5)
    test = separable(24, 4, 2)
    grid = [TINY, dataclasses.replace(TINY, patch=(4, 2)), dataclasses.replace(TINY, depth=2)]
    result = run_sweep(train, val, test, seed=42, grid=grid, epochs=1, device="cpu")
    assert [g.config.epochs for g in result.grid] == [1, 1, 1]
    vals = [g.val_auroc for g in result.grid]
    best = vals.index(max(vals))
    assert result.selected == result.grid[best].config
    assert [r.seed for r in result.runs] == [42, 123, 456]
    assert result.n_params == count_parameters(ACTViT.from_config(result.selected, 4))
    assert result.runs[0].val_auroc == vals[best]  # the seed-42 run is the sweep's own
    for run in result.runs:
        assert run.test_auroc == pytest.approx(roc_auc_score(test[1], run.test_scores))
    assert result.test_auroc_mean == pytest.approx(np.mean([r.test_auroc for r in result.runs]))

    result.save(tmp_path / "sweep")
    assert not list((tmp_path / "sweep").glob("*.pkl"))
    loaded = SweepResult.load(tmp_path / "sweep")
    assert loaded.selected == result.selected and loaded.grid == result.grid
    for a, b in zip(loaded.runs, result.runs, strict=False):
        np.testing.assert_array_equal(a.test_scores, b.test_scores)
        assert a.history == b.history and a.state.keys() == b.state.keys()
        assert all(torch.equal(a.state[k], b.state[k]) for k in a.state)


def test_a_killed_sweep_resumes_at_the_next_configuration_with_the_same_result(
    tmp_path, monkeypatch
):
    """Each finished configuration is kept; a rerun after a kill trains only the rest and
    selects, retrains and scores exactly as one uninterrupted sweep does."""
    import actmap.baselines.actvit as actvit

    train, val = separable(48, 4, 0, shift=0.5), separable(24, 4, 1, shift=0.5)
    test = separable(24, 4, 2)
    grid = [TINY, dataclasses.replace(TINY, patch=(4, 2)), dataclasses.replace(TINY, depth=2)]
    kw = dict(seed=42, retrain_seeds=(123,), grid=grid, epochs=1, device="cpu")
    whole = run_sweep(train, val, test, **kw)

    real, calls = actvit.train_config, []

    def killed_at_third(config, *args, **kwargs):
        calls.append(config)
        if len(calls) == 3:
            raise KeyboardInterrupt  # the session ends mid-sweep
        return real(config, *args, **kwargs)

    monkeypatch.setattr(actvit, "train_config", killed_at_third)
    with pytest.raises(KeyboardInterrupt):
        run_sweep(train, val, test, progress_dir=tmp_path, **kw)
    assert len(list(tmp_path.glob("*/best-config-*.safetensors"))) == 1  # the best so far
    calls.clear()
    other_val = separable(24, 4, 3, shift=0.5)  # other rows: their own state, none reused
    with pytest.raises(KeyboardInterrupt):
        run_sweep(train, other_val, test, progress_dir=tmp_path, **kw)
    assert len(calls) == 3
    calls.clear()
    monkeypatch.setattr(
        actvit, "train_config", lambda c, *a, **k: calls.append(c) or real(c, *a, **k)
    )
    reports = []
    resumed = run_sweep(
        train, val, test, progress_dir=tmp_path, progress=lambda *r: reports.append(r), **kw
    )
    assert calls[0] == dataclasses.replace(grid[2], epochs=1) and len(calls) == 2  # + a retrain
    # epochs over the whole sweep: 3 configurations + 1 retrain, the first 2 already done
    selected = resumed.selected.label()
    assert reports == [
        (2, 4, "config 3/3 (width 16, depth 2, decay 0.001, patch 8x1) epoch 0/1"),
        (3, 4, "config 3/3 (width 16, depth 2, decay 0.001, patch 8x1) epoch 1/1"),
        (3, 4, f"seed 123 ({selected}) epoch 0/1"),
        (4, 4, f"seed 123 ({selected}) epoch 1/1"),
    ]
    assert resumed.grid == whole.grid and resumed.selected == whole.selected
    for a, b in zip(resumed.runs, whole.runs, strict=True):
        np.testing.assert_array_equal(a.test_scores, b.test_scores)
    # a finished sweep leaves no partial state; an unreadable one is named, not guessed at
    (progress,) = tmp_path.glob(f"*/{actvit.SWEEP_PROGRESS}")  # the other rows' sweep
    progress.write_text("{not json")
    with pytest.raises(ValueError, match="unreadable sweep progress"):
        run_sweep(train, other_val, test, progress_dir=tmp_path, **kw)


def _generation(dense: torch.Tensor | None) -> Generation:
    T = 3
    return Generation(
        prompt="q",
        answer="a",
        token_ids=[1] * T,
        logprobs=torch.zeros(T),
        entropies=torch.zeros(T),
        trajectory=torch.zeros(30, T, 128),
        stopped=True,
        prompt_tokens=4,
        dense=dense,
    )


def test_scorer_fixed_config_honours_contract():
    train, val = separable(64, 4, 0), separable(32, 4, 1)
    cfg = dataclasses.replace(TINY, epochs=2)
    scorer = ACTViTScorer(config=cfg, seeds=(42, 123), device="cpu")
    assert scorer.fit(train[0], train[1], val[0], val[1]) is scorer
    rows = [val[0][i] for i in range(5)]  # sequence of (8, 100, D) tensors
    res = scorer.score(rows)
    assert isinstance(res, ScoreResult) and res.confidence.shape == (5,)
    assert res.confidence.dtype == np.float64 and np.array_equal(res.raw, res.confidence)
    assert res.details["config"] == cfg.to_dict() and res.details["seeds"] == [42, 123]
    assert res.details["n_params"] == count_parameters(ACTViT.from_config(cfg, 4))
    np.testing.assert_array_equal(res.details["confidence_by_seed"][42], res.confidence)
    (swept,) = res.details["grid"]  # the sweep's record: one configuration here
    assert (
        swept["config"] == cfg.to_dict()
        and swept["val_auroc"] == res.details["val_auroc_by_seed"][42]
    )
    # the same rows given as Generation records with dense states are preprocessed identically
    dense = torch.randn(30, 7, 4).half()
    from_gen = scorer.score([_generation(dense)]).confidence
    from_tensor = scorer.score(actvit_tensor(dense)[None]).confidence
    np.testing.assert_array_equal(from_gen, from_tensor)


def test_scorer_errors():
    scorer = ACTViTScorer(config=TINY, device="cpu")
    x, y = separable(8, 4, 0)
    with pytest.raises(ValueError, match="val"):
        scorer.fit(x, y)
    with pytest.raises(RuntimeError, match="before fit"):
        scorer.score(x)
    with pytest.raises(BaselineUnavailable, match="keep_dense"):
        scorer.fit([_generation(None)], np.array([1]), x, y)
    assert ACTViTScorer.supervised is True and ACTViTScorer.name == "actvit"


def test_grid_option_names_the_configurations_swept():
    from types import SimpleNamespace

    from actmap.baselines.options import BaselineOptions
    from actmap.errors import ActmapUserError

    def grid_of(name):
        inputs = SimpleNamespace(
            require_table=lambda table, method: None,
            options=BaselineOptions(actvit_grid=name, device="cpu"),
            store=SimpleNamespace(root=Path("/stores/s")),
        )
        scorer = ACTViTScorer.from_inputs(inputs)
        assert scorer.progress_dir == Path("/stores/s/actvit-sweeps")  # resumable in the store
        return scorer.grid

    assert grid_of("full") == SWEEP_GRID
    small = grid_of("small")
    assert len(small) == 6 and {(c.dim, c.depth) for c in small} == {(128, 1)}
    assert {(c.weight_decay, c.patch) for c in small} == set(
        itertools.product((1.0, 1e-3), ((1, 1), (8, 1), (4, 2)))
    )
    (selected,) = grid_of("selected")  # the paper's selected configuration, no sweep
    assert (selected.dim, selected.depth, selected.weight_decay, selected.patch) == (
        128,
        1,
        1e-3,
        (4, 2),
    )
    with pytest.raises(ActmapUserError, match="actvit_grid must be one of full, small, selected"):
        BaselineOptions(actvit_grid="tiny")
    inputs = SimpleNamespace(
        require_table=lambda table, method: None,
        options=BaselineOptions(actvit_micro_batch=16),
        store=SimpleNamespace(root=Path("/stores/s")),
    )
    assert ACTViTScorer.from_inputs(inputs).micro_batch == 16
    with pytest.raises(ActmapUserError, match="actvit_micro_batch must be >= 1, got 0"):
        BaselineOptions(actvit_micro_batch=0)
    # a named grid runs at the options' precision; configurations given as a tuple keep theirs
    inputs.options = BaselineOptions(actvit_grid="small", actvit_precision="bfloat16")
    small_bf16 = ACTViTScorer.from_inputs(inputs).grid
    assert small_bf16 == tuple(dataclasses.replace(c, precision="bfloat16") for c in small)
    inputs.options = BaselineOptions(actvit_grid=(TINY,), actvit_precision="bfloat16")
    assert ACTViTScorer.from_inputs(inputs).grid == (TINY,)
    with pytest.raises(ActmapUserError, match="actvit_precision must be one of"):
        BaselineOptions(actvit_precision="half")
    # the fit reports its epochs through the run's progress, under the method's name
    reports = []
    inputs.report = lambda *r: reports.append(r)
    inputs.options = BaselineOptions(actvit_grid=(TINY,), actvit_epochs=2, actvit_seeds=(42,))
    train, val = separable(32, 4, 0), separable(16, 4, 1)
    ACTViTScorer.from_inputs(inputs).fit(train[0], train[1], val[0], val[1])
    assert [r[:3] for r in reports] == [("actvit", k, 2) for k in (0, 1, 2)]


def test_inputs_beyond_float16_saturate_and_nan_is_named():
    from actmap.baselines.actvit import _as_batch

    x = torch.zeros(3, 8, 100, 4, dtype=torch.float16)
    x[1, 2, 5, 0], x[1, 0, 0, 3], x[2, 7, 99, 1] = float("inf"), float("-inf"), 7.0
    out = _as_batch(x)
    assert torch.isfinite(out).all()
    assert out[1, 2, 5, 0] == 65504 and out[1, 0, 0, 3] == -65504  # float16's largest
    unchanged = torch.ones_like(out, dtype=torch.bool)
    unchanged[1, 2, 5, 0] = unchanged[1, 0, 0, 3] = False
    assert torch.equal(out[unchanged], x[unchanged])
    x[2, 3, 3, 3] = float("nan")
    with pytest.raises(ValueError, match=r"NaN in rows \[2\]"):
        _as_batch(x)
