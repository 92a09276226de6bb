"""Layers built in ``configure_model`` (Lightning's way for sharded models; Lightning calls it after the callbacks'
``setup``) are chosen when the stage starts, where they exist."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from torch import nn

from rank_lightning.callbacks import ActivationRankMonitor, NeuralCollapseMonitor, WeightRankMonitor
from rank_lightning.callbacks.base import builds_layers_later
from rank_lightning.functional import participation_ratio, stable_rank
from tests.callbacks.trainer_helpers import quiet_trainer, small_loader


class _BuiltLate(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net: nn.Sequential | None = None
        self.num_classes = 3

    def configure_model(self) -> None:
        if self.net is None:
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return nn.functional.cross_entropy(self(batch[0]), batch[1])

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self(batch[0])

    test_step = validation_step

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_layers_built_in_configure_model_are_monitored(tmp_path: Path) -> None:
    activations = ActivationRankMonitor(layers=["net.1"], verbose=False)
    weights = WeightRankMonitor(verbose=False)
    collapse = NeuralCollapseMonitor(verbose=False)
    model = _BuiltLate()
    trainer = quiet_trainer([activations, weights, collapse], max_epochs=2, default_root_dir=tmp_path)
    trainer.fit(model, small_loader(), small_loader(seed=1))
    assert weights.curves.layers == ["net.0", "net.2"] and activations.curves.layers == ["net.1"]
    assert collapse.curves.epochs == [0, 1]
    with torch.no_grad():
        rows = torch.cat([model.net[:2](x) for x, _ in small_loader(seed=1)]).double()
    assert activations.curves.history[1]["net.1"]["participation_ratio"] == pytest.approx(
        float(participation_ratio(rows)), rel=1e-9
    )
    assert weights.curves.history[1]["net.2"]["stable_rank"] == pytest.approx(
        float(stable_rank(model.net[2].weight.double())), rel=1e-12
    )
    # A later evaluation of a module built late: chosen when it starts, too.
    (results,) = quiet_trainer(
        [ActivationRankMonitor(layers=["net.1"], verbose=False)], default_root_dir=tmp_path
    ).test(model, small_loader(seed=2), verbose=False)
    assert "rank_test/net.1/participation_ratio" in results


def test_only_modules_that_override_configure_model_build_their_layers_later() -> None:
    assert builds_layers_later(_BuiltLate())
    assert not builds_layers_later(pl.LightningModule())
    assert not builds_layers_later(nn.Linear(2, 2))
