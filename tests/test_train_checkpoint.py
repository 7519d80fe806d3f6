"""Epoch checkpoints: a killed seed resumes to the weights an unstopped run ends with."""

from __future__ import annotations

import logging
from dataclasses import asdict

import pytest
import torch

from actmap.detectors import create_detector
from actmap.experiments.seeds import run_seeds
from actmap.store.rows import Rows
from actmap.training import checkpoint as train_checkpoint
from actmap.training import recipe as training
from actmap.training.recipe import (
    EarlyStopping,
    LoopState,
    TrainConfig,
    select_epoch,
    train_detector,
)
from actmap.training.run_folder import checkpoint_path, prepare_run_folder, read_run

SHAPE = (4, 8, 16)
VIT = {"depth": 1, "dim": 16, "heads": 2, "readout_hidden": 8, "patch": (4, 4)}
# every random draw of the recipe in play: noise, mixup and (in the ViT) dropout
CFG = TrainConfig(max_epochs=5, warmup_epochs=2, batch_size=8, patience=50, device="cpu")


class Killed(Exception):
    pass


def data(seed: int, n: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(n) % 2
    maps = torch.randn((n, *SHAPE), generator=g)
    maps[:, 0] += (0.5 * (2 * labels - 1)).float()[:, None, None]
    return maps.half(), labels


def fresh_model(seed: int = 7) -> torch.nn.Module:
    torch.manual_seed(seed)
    return create_detector("vit", in_channels=4, map_height=8, map_width=16, **VIT)


def train(x, y, vx, vy, checkpoint=None, kill_after=None, seen=None):
    """train_detector on a fresh ViT; ``kill_after``: raise once that epoch has finished and
    been checkpointed (as a session that ends mid-seed)."""

    def progress(epoch, info):
        if seen is not None:
            seen.append(epoch)
        if kill_after is not None and epoch == kill_after + 1:
            raise Killed

    model = fresh_model()
    result = train_detector(
        model, x, y, vx, vy, CFG, seed=3, progress=progress, checkpoint=checkpoint,
        checkpoint_every_s=0,
    )  # fmt: skip
    return model, result


def history(result) -> list[dict]:
    return [{k: v for k, v in asdict(r).items() if k != "epoch_time_s"} for r in result.history]


def assert_same_training(a, b) -> None:
    (model_a, result_a), (model_b, result_b) = a, b
    assert history(result_a) == history(result_b)
    assert result_a.best_epoch == result_b.best_epoch
    for key, value in model_a.state_dict().items():
        assert torch.equal(value, model_b.state_dict()[key]), key


@pytest.fixture(scope="module")
def splits():
    return (*data(0), *data(1, 16))


@pytest.fixture(scope="module")
def unstopped(splits):
    return train(*splits)


@pytest.mark.parametrize("kill_after", [0, 2])
def test_a_killed_seed_resumes_to_what_an_unstopped_run_learns(
    tmp_path, splits, unstopped, kill_after
):
    path = tmp_path / "seed.safetensors"
    with pytest.raises(Killed):
        train(*splits, checkpoint=path, kill_after=kill_after)
    assert path.is_file()
    seen = []
    resumed = train(*splits, checkpoint=path, seen=seen)
    assert seen == list(range(kill_after + 1, CFG.max_epochs))  # only the lost epochs ran
    assert_same_training(resumed, unstopped)
    assert resumed[1].wall_time_s > 0


def test_without_the_generators_restored_resuming_would_differ(
    tmp_path, splits, unstopped, monkeypatch
):
    """The exactness above rests on the random generators: restoring all but the
    global one (dropout) trains the later epochs differently."""
    path = tmp_path / "seed.safetensors"
    with pytest.raises(Killed):
        train(*splits, checkpoint=path, kill_after=1)
    real = training.Rngs.restore

    def restore_but_global(self, states, mixup, device):
        kept = torch.get_rng_state()
        real(self, states, mixup, device)
        torch.set_rng_state(kept)

    monkeypatch.setattr(training.Rngs, "restore", restore_but_global)
    _, result = train(*splits, checkpoint=path)
    after = history(result)[2:]  # the epochs run after the resume
    assert [r["train_loss"] for r in after] != [r["train_loss"] for r in history(unstopped[1])[2:]]


def test_a_checkpoint_of_other_data_or_a_damaged_one_is_ignored(tmp_path, splits, caplog):
    x, y, vx, vy = splits
    path = tmp_path / "seed.safetensors"
    with pytest.raises(Killed):
        train(x, y, vx, vy, checkpoint=path, kill_after=1)
    other = (x, y, vx, 1 - vy)  # the validation labels differ
    seen = []
    with caplog.at_level(logging.WARNING, logger="actmap.training.checkpoint"):
        resumed = train(*other, checkpoint=path, seen=seen)
    assert "written for another run (differs in: data)" in caplog.text
    assert seen == list(range(CFG.max_epochs))
    assert_same_training(resumed, train(*other))

    path.write_bytes(b"not a safetensors file")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="actmap.training.checkpoint"):
        again = train(*other, checkpoint=path)
    assert "is not a readable checkpoint" in caplog.text
    assert_same_training(again, resumed)


def test_identity_names_what_a_checkpoint_holds_for(splits):
    x, y, vx, vy = splits
    model = fresh_model()
    tensors = {"train_maps": x, "train_labels": y}
    ident = train_checkpoint.identity(3, CFG.to_dict(), torch.device("cpu"), model, tensors)
    same = train_checkpoint.identity(
        3, {**CFG.to_dict(), "eval_batch_size": 7}, torch.device("cpu"), fresh_model(), tensors
    )
    assert same == ident  # scoring batch size and initial weights: not what it is for
    for changed in (
        train_checkpoint.identity(4, CFG.to_dict(), torch.device("cpu"), model, tensors),
        train_checkpoint.identity(
            3, {**CFG.to_dict(), "lr": 0.5}, torch.device("cpu"), model, tensors
        ),
        train_checkpoint.identity(
            3, CFG.to_dict(), torch.device("cpu"), model, {**tensors, "train_labels": 1 - y}
        ),
    ):
        assert changed != ident


def test_select_epoch_resumed_after_its_early_stop_trains_nothing():
    scores = iter([0.6, 0.7, 0.65, 0.65])  # best at epoch 1, stops after two more (patience 2)
    states: list[LoopState] = []
    model = torch.nn.Linear(1, 1)
    trained = []

    def train_epoch(epoch):
        trained.append(epoch)
        return 0.0

    def validate():
        return next(scores), 0.0

    first = select_epoch(model, 10, train_epoch, validate, 2, after_epoch=states.append)
    assert trained == [0, 1, 2, 3] and first.best_epoch == 1 and first.epochs == 4
    assert [s.epochs for s in states] == [1, 2, 3, 4] and states[-1].stopper.should_stop
    trained.clear()
    again = select_epoch(model, 10, train_epoch, validate, 2, resume=states[-1])
    assert trained == [] and (again.best_epoch, again.epochs) == (1, 4)
    midway = LoopState(2, EarlyStopping(2, 0.7, 1, 0), None)
    scores = iter([0.9])
    resumed = select_epoch(model, 3, train_epoch, validate, 2, resume=midway)
    assert trained == [2] and (resumed.best_epoch, resumed.epochs) == (2, 3)


def test_run_seeds_removes_a_seeds_checkpoint_once_its_folder_is_written(tmp_path, monkeypatch):
    monkeypatch.setattr(training, "CHECKPOINT_EVERY_S", 0.0)
    (x, y), (tx, ty) = data(5, 48), data(6, 16)
    split = (Rows(None, y[:32], x[:32]), Rows(None, y[32:], x[32:]), Rows(None, ty, tx))
    cfg = TrainConfig(max_epochs=3, warmup_epochs=1, device="cpu")

    def dying(epoch, info):
        if info["seed"] == 2 and epoch == 1:
            raise Killed

    with pytest.raises(Killed):
        run_seeds(*split, tmp_path, detector="logreg", config=cfg, seeds=(1, 2), progress=dying)
    assert checkpoint_path(tmp_path, 2).is_file()
    assert not checkpoint_path(tmp_path, 1).exists()
    assert set(read_run(tmp_path).seed_dirs) == {1}  # the checkpoint is no seed
    only_checkpoint = tmp_path / "fresh"
    only_checkpoint.mkdir()
    checkpoint_path(tmp_path, 2).rename(checkpoint_path(only_checkpoint, 2))
    prepare_run_folder(only_checkpoint, "logreg", cfg.to_dict())  # counts as empty
    run_seeds(*split, only_checkpoint, detector="logreg", config=cfg, seeds=(2,))
    assert not list(only_checkpoint.glob(".checkpoint-*"))
    assert set(read_run(only_checkpoint).seed_dirs) == {2}
