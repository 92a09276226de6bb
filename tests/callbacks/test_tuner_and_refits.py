"""The monitors through Lightning's tuner (``Tuner.lr_find``, ``Tuner.scale_batch_size``), whose trial fits run without
them and restore a checkpoint of their own, and through the fits that follow it."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import BatchSizeFinder
from pytorch_lightning.tuner import Tuner
from torch.utils.data import DataLoader, TensorDataset

from rank_lightning.callbacks import ActivationRankMonitor, AdversarialValidation
from rank_lightning.callbacks.curves import read_curve_file
from rank_lightning.modules import ImageClassifier
from tests.callbacks.trainer_helpers import quiet_trainer


class _Data(pl.LightningDataModule):
    """96 seeded rows of 8 features in [0, 1), 3 classes; ``batch_size`` is what the batch-size finder scales."""

    def __init__(self, batch_size: int = 16) -> None:
        super().__init__()
        self.batch_size = batch_size
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.rand(96, 8, generator=g), torch.randint(0, 3, (96,), generator=g)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.x, self.y), batch_size=self.batch_size)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.x[:48], self.y[:48]), batch_size=self.batch_size)


def _model(seed: int) -> ImageClassifier:
    torch.manual_seed(seed)
    kwargs: dict[str, Any] = {"depth": 2, "width": 8}
    return ImageClassifier(backbone="mlp", backbone_kwargs=kwargs, num_classes=3, input_shape=(8,), lr=0.01)


def _monitor() -> ActivationRankMonitor:
    return ActivationRankMonitor(log_at_init=True, metrics=["stable_rank"], verbose=False)


def _tune(trainer: pl.Trainer, model: ImageClassifier, data: _Data, tuner: str, **kwargs: Any) -> None:
    if tuner == "lr_find":
        Tuner(trainer).lr_find(model, datamodule=data, num_training=4, update_attr=False)
    else:
        Tuner(trainer).scale_batch_size(model, datamodule=data, steps_per_trial=1, max_trials=1, **kwargs)


@pytest.mark.parametrize("tuner", ["lr_find", "scale_batch_size"])
def test_a_tuned_fit_keeps_the_curve_file_another_run_left_in_its_folder(tmp_path: Path, tuner: str) -> None:
    # The tuner restores its own checkpoint after the trials; that must not make the fit a resumed one, which took the
    # earlier run's curve file for its own: its initial point lost, its epochs "superseded" by this run's.
    quiet_trainer([_monitor()], max_epochs=2, default_root_dir=tmp_path).fit(_model(0), datamodule=_Data())
    earlier = read_curve_file(tmp_path / "rank_curves" / "rank_curves.json")["history"]
    monitor, model, data = _monitor(), _model(1), _Data()
    trainer = quiet_trainer([monitor], max_epochs=1, default_root_dir=tmp_path)
    _tune(trainer, model, data, tuner)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, datamodule=data)
    messages = [str(w.message) for w in caught if "LayerCurves" in str(w.message)]
    assert len(messages) == 2 and "kept as rank_curves-v1.json" in messages[0]
    assert "kept as rank_stable_rank-v1.png" in messages[1]  # its figure, too
    assert read_curve_file(tmp_path / "rank_curves" / "rank_curves-v1.json")["history"] == earlier
    ours = read_curve_file(tmp_path / "rank_curves" / "rank_curves.json")
    assert sorted(ours["history"]) == [-1, 0] and ours["superseded"] == []
    assert ours["history"] == monitor.curves.history


def test_a_fit_after_a_validation_tuned_on_another_trainer_starts_its_own_curves(tmp_path: Path) -> None:
    # Tuner.scale_batch_size(method="validate") leaves its deleted checkpoint in trainer.ckpt_path: the next fit is a
    # fresh one all the same, not the continuation of the earlier trainer's curves held by the same monitor.
    monitor = _monitor()
    quiet_trainer([monitor], max_epochs=3, default_root_dir=tmp_path).fit(_model(0), datamodule=_Data())
    earlier = monitor.curves.history
    model, data = _model(1), _Data()
    trainer = quiet_trainer([monitor], max_epochs=1, default_root_dir=tmp_path)
    _tune(trainer, model, data, "scale_batch_size", method="validate")
    trainer.fit(model, datamodule=data)
    assert monitor.curves.epochs == [-1, 0] and monitor.curves.superseded == []
    assert monitor.curves.history[-1] != earlier[-1]  # the initial point of this model, not of the earlier one


def test_a_tuned_fit_keeps_the_adversarial_file_another_run_left_in_its_folder(tmp_path: Path) -> None:
    def callback() -> AdversarialValidation:
        return AdversarialValidation(eps=[8 / 255], attacks=["fgsm"], max_samples=16, mean=[0], std=[1], verbose=False)

    quiet_trainer([callback()], max_epochs=2, default_root_dir=tmp_path).fit(_model(0), datamodule=_Data())
    earlier = (tmp_path / "rank_curves" / "adversarial.json").read_text()
    model, data = _model(1), _Data()
    trainer = quiet_trainer([callback()], max_epochs=1, default_root_dir=tmp_path)
    _tune(trainer, model, data, "lr_find")
    with pytest.warns(UserWarning, match="kept as adversarial-v1.json"):
        trainer.fit(model, datamodule=data)
    assert (tmp_path / "rank_curves" / "adversarial-v1.json").read_text() == earlier
    assert list(json.loads((tmp_path / "rank_curves" / "adversarial.json").read_text())) == ["0"]


def test_a_validation_that_scales_its_batch_size_is_recorded_at_the_last_trained_epoch(tmp_path: Path) -> None:
    # BatchSizeFinder scales trainer.validate too, restoring its checkpoint (epoch 2: the epochs the fit ran) before the
    # validation measures: the weights of epoch 1, recorded there, not at an epoch 2 that was never trained.
    monitor, model, data = _monitor(), _model(0), _Data()
    finder = BatchSizeFinder(steps_per_trial=1, max_trials=1)
    trainer = quiet_trainer([finder, monitor], max_epochs=2, default_root_dir=tmp_path)
    trainer.fit(model, datamodule=data)
    fitted = monitor.curves.history
    results = trainer.validate(model, datamodule=data, verbose=False)
    assert monitor.curves.epochs == [-1, 0, 1]
    assert results[0]["rank/layer1/stable_rank"] == pytest.approx(fitted[1]["layer1"]["stable_rank"], rel=1e-12)


def test_the_learning_rate_lr_find_suggests_is_the_one_the_fit_trains_with(tmp_path: Path) -> None:
    # Tuner.lr_find sets model.lr and model.hparams.lr; the optimizer must be built with it, not with the lr given to
    # the constructor (hparams.lr, saved in checkpoints, would name a learning rate the fit never used).
    model, data = _model(0), _Data()
    trainer = quiet_trainer([_monitor()], max_epochs=4, default_root_dir=tmp_path)
    finder = Tuner(trainer).lr_find(model, datamodule=data, num_training=20)
    suggestion = finder.suggestion()
    assert suggestion is not None and suggestion != 0.01
    assert model.hparams.lr == suggestion
    trainer.fit(model, datamodule=data)
    assert trainer.optimizers[0].param_groups[0]["lr"] == suggestion
    assert model.lr == suggestion
    with pytest.raises(ValueError, match=r"lr must be a positive number, got -0\.1"):
        model.lr = -0.1
