"""Monitoring leaves the fit it watches as it would be unmonitored: the same batches, dropout masks and draws."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn

from rank_lightning.callbacks import (
    ActivationRankMonitor,
    AdversarialValidation,
    ClassificationDimension,
    JacobianRankMonitor,
    LowDimensionalEvaluation,
    NeuralCollapseMonitor,
    RankCollapseAlarm,
    WeightRankMonitor,
)
from rank_lightning.data import DigitsDataModule
from tests.callbacks.trainer_helpers import quiet_trainer


class _NoisyConvNet(pl.LightningModule):
    """A small conv net with dropout, trained on inputs with noise drawn from torch, NumPy and Python's ``random``:
    every random stream a training loop may use decides its weights."""

    def __init__(self) -> None:
        super().__init__()
        self.num_classes = 10
        self.conv = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU())
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(8 * 64, 32), nn.ReLU(), nn.Dropout(0.3))
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.conv(x)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        scale = 0.05 * (1 + np.random.rand() + random.random())  # noqa: NPY002 - the user's global NumPy stream
        return F.cross_entropy(self(x + scale * torch.randn_like(x)), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val/loss", F.cross_entropy(self(batch[0]), batch[1]))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def _fit(tmp_path, callbacks: list[pl.Callback]) -> dict[str, torch.Tensor]:
    pl.seed_everything(0, verbose=False)
    model = _NoisyConvNet()
    trainer = quiet_trainer(callbacks, max_epochs=2, inference_mode=False, default_root_dir=tmp_path)
    trainer.fit(model, datamodule=DigitsDataModule(batch_size=64))
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def test_a_monitored_fit_ends_with_the_weights_of_the_unmonitored_one(tmp_path):
    plain = _fit(tmp_path / "plain", [])
    monitors = [
        # Initial passes over the validation and the training loader (dropout on for the latter), in eval and
        # training mode; extra passes over the loaders every epoch; attacks; Jacobians; weight spectra.
        ActivationRankMonitor(log_at_init=True, verbose=False),
        ActivationRankMonitor(stage="train", log_at_init=True, verbose=False),
        # No initial point: one training batch, in training mode, plans the states before training.
        ActivationRankMonitor(every_n_train_steps=5, log_at_init=False, namespace="rank_steps", verbose=False),
        NeuralCollapseMonitor(log_at_init=True, verbose=False),
        ClassificationDimension(verbose=False),
        LowDimensionalEvaluation(dims=(2, 5), every_n_epochs=1, verbose=False),
        AdversarialValidation(eps=[8 / 255], attacks=["fgsm"], max_samples=64, verbose=False),
        JacobianRankMonitor(num_inputs=2, verbose=False),
        WeightRankMonitor(verbose=False),
        RankCollapseAlarm(max_drop=0.5, verbose=False),
    ]
    monitored = _fit(tmp_path / "monitored", monitors)
    assert monitored.keys() == plain.keys()
    for name, value in plain.items():
        assert torch.equal(monitored[name], value), name
    # Each monitor did measure.
    assert monitors[0].curves.epochs == monitors[1].curves.epochs == [-1, 0, 1]
    assert monitors[2].curves.epochs == [5, 10, 15, 20, 25, 30]  # 17 batches per epoch
    assert monitors[3].result is not None and monitors[4].result is not None and monitors[5].results
