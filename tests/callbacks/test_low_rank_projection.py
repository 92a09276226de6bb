"""LowRankProjection: switch-on, projection after each optimizer step, resume."""

from __future__ import annotations

import math
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from rank_lightning.callbacks import LowRankProjection
from rank_lightning.nn import LRLayer, collect_auxiliary_losses, insert_lr_layer
from tests.callbacks.trainer_helpers import quiet_trainer


class _Scripted(pl.LightningModule):
    """Small MLP with an LR-Layer before its head; logs a scripted ``train/acc`` per epoch."""

    def __init__(self, accuracies: list[float], *, collect: bool = True) -> None:
        super().__init__()
        self.accuracies = accuracies
        self.collect = collect
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
        insert_lr_layer(self.net, "2", LRLayer(16, 2, projection="exact"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        if self.collect:
            loss = loss + collect_auxiliary_losses(self)
        self.log("train/acc", self.accuracies[self.current_epoch], on_step=False, on_epoch=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _loader(n: int = 64, batch_size: int = 16) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=generator)
    y = torch.randint(0, 3, (n,), generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


class _Probe(pl.Callback):
    """Records, per epoch, whether the LR-Layer was enabled during training and how many projections ran."""

    def __init__(self) -> None:
        self.enabled: list[bool] = []
        self.projections: list[int] = []

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.projections.append(0)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        if idx == 0:
            self.enabled.append(pl_module.net[2][0].enabled)


def _count_projections(module: _Scripted, probe: _Probe, monkeypatch: pytest.MonkeyPatch) -> None:
    layer = module.net[2][0]
    original = layer.project_

    def counted(generator: torch.Generator | None = None) -> None:
        probe.projections[-1] += 1
        original(generator)

    monkeypatch.setattr(layer, "project_", counted)


def test_switch_on_at_the_accuracy_threshold(monkeypatch: pytest.MonkeyPatch) -> None:
    module = _Scripted([0.3, 0.5, 0.7, 0.9])
    probe = _Probe()
    _count_projections(module, probe, monkeypatch)
    callback = LowRankProjection(threshold=0.65, monitor="train/acc")
    trainer = quiet_trainer([callback, probe], max_epochs=4)
    trainer.fit(module, _loader())
    # The accuracy of epoch 2 reaches 0.65, so epoch 3 trains with the LR-Layer: 4 batches, 4 projections.
    assert callback.switched_on_epoch == 2
    assert probe.enabled == [False, False, False, True]
    assert probe.projections == [0, 0, 0, 4]
    weight = module.net[2][0].weight.detach()
    assert torch.linalg.matrix_rank(weight, hermitian=True).item() <= 2
    assert torch.count_nonzero(weight) > 0
    metrics = trainer.callback_metrics
    assert metrics["lr_layer/enabled"].item() == 1.0
    assert metrics["lr_layer/net.2.0/reconstruction"].item() >= 0
    assert metrics["lr_layer/net.2.0/norm"].item() >= 0


def test_switch_on_at_a_fixed_epoch_and_only_after_optimizer_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    module = _Scripted([0.0] * 3)
    probe = _Probe()
    _count_projections(module, probe, monkeypatch)
    callback = LowRankProjection(threshold=None, switch_on_epoch=1)
    quiet_trainer([callback, probe], max_epochs=3, accumulate_grad_batches=2).fit(module, _loader())
    assert probe.enabled == [False, True, True]
    # 4 batches per epoch with accumulation over 2: two optimizer steps, two projections.
    assert probe.projections == [0, 2, 2]


def test_resume_restores_the_switched_on_state(tmp_path) -> None:
    module = _Scripted([0.9] * 4)
    callback = LowRankProjection(threshold=0.65)
    trainer = quiet_trainer([callback], max_epochs=2)
    trainer.fit(module, _loader())
    path = tmp_path / "last.ckpt"
    trainer.save_checkpoint(path)
    assert callback.state_dict() == {"enabled": True, "switched_on_epoch": 0, "highest": pytest.approx(0.9)}

    resumed_module = _Scripted([0.0] * 4)
    probe = _Probe()
    resumed = LowRankProjection(threshold=0.65)
    quiet_trainer([resumed, probe], max_epochs=4).fit(resumed_module, _loader(), ckpt_path=path)
    assert resumed.enabled and resumed.switched_on_epoch == 0
    assert probe.enabled == [True, True]


def test_a_resumed_fit_that_ends_with_the_layers_off_reports_the_highest_value_of_the_whole_fit(tmp_path) -> None:
    # The highest value was not saved: after a resume the warning named only the epochs after it.
    module = _Scripted([0.5, 0.1])
    callback = LowRankProjection(threshold=0.65)
    trainer = quiet_trainer([callback], max_epochs=1, default_root_dir=tmp_path)
    with pytest.warns(UserWarning, match="reached at most 0.5,"):
        trainer.fit(module, _loader())
    path = tmp_path / "last.ckpt"
    trainer.save_checkpoint(path)

    resumed = LowRankProjection(threshold=0.65)
    with pytest.warns(UserWarning, match="reached at most 0.5,"):
        quiet_trainer([resumed], max_epochs=2, default_root_dir=tmp_path).fit(
            _Scripted([0.1, 0.1]), _loader(), ckpt_path=path
        )
    # Checkpoints written before the value was saved still load.
    resumed.load_state_dict({"enabled": False, "switched_on_epoch": None})
    assert resumed.state_dict() == {"enabled": False, "switched_on_epoch": None, "highest": None}


def test_warns_when_the_module_does_not_collect_the_auxiliary_loss() -> None:
    module = _Scripted([0.0], collect=False)
    with pytest.warns(UserWarning, match="never collected"):
        quiet_trainer([LowRankProjection(threshold=None, switch_on_epoch=0)], max_epochs=1).fit(module, _loader())
    assert module.net[2][0].aux_loss is None


def test_errors() -> None:
    with pytest.raises(ValueError, match="threshold or a switch_on_epoch"):
        LowRankProjection(threshold=None)
    # Both were accepted and failed later: the seed at the first projection after switch-on, with a TypeError.
    with pytest.raises(ValueError, match="seed must be an integer, got '0'"):
        LowRankProjection(seed="0")
    with pytest.raises(ValueError, match="monitor must be the non-empty key of a logged metric, got 3"):
        LowRankProjection(monitor=3)
    module = _Scripted([0.5])
    message = r"monitors 'train/accuracy'.*logged metrics are: lr_layer/enabled, train/acc"
    with pytest.raises(RuntimeError, match=message):
        quiet_trainer([LowRankProjection(monitor="train/accuracy")], max_epochs=1).fit(module, _loader())

    class _Plain(_Scripted):
        def __init__(self) -> None:
            super().__init__([0.5])
            self.net = nn.Sequential(nn.Linear(8, 3))

    with pytest.raises(ValueError, match="contains no LRLayer"):
        quiet_trainer([LowRankProjection()], max_epochs=1).fit(_Plain(), _loader())


@pytest.mark.parametrize(
    ("threshold", "match"),
    [
        (65, r"threshold=65 for the accuracy 'train/acc', which lies in \[0, 1\].*did you mean 0.65\?"),
        (-0.1, r"threshold=-0.1 for the accuracy 'train/acc'"),
        (math.nan, "threshold must be a finite number or None, got nan"),
        ("0.65", "threshold must be a finite number or None, got '0.65'"),
    ],
)
def test_a_threshold_an_accuracy_cannot_reach_is_an_error(threshold, match) -> None:
    # 65 (the paper's "65%") was accepted, and the layers silently never switched on.
    with pytest.raises(ValueError, match=match):
        LowRankProjection(threshold=threshold, monitor="train/acc")
    assert LowRankProjection(threshold=65, monitor="train/f1_count").threshold == 65  # other metrics: any scale


def test_a_fit_that_ends_with_the_layers_off_says_so() -> None:
    module = _Scripted([0.3, 0.5])
    callback = LowRankProjection(threshold=0.65, monitor="train/acc")
    with pytest.warns(UserWarning, match=r"never switched on: train/acc reached at most 0.5, below the threshold 0.65"):
        quiet_trainer([callback], max_epochs=2).fit(module, _loader())
    assert not callback.enabled


def test_a_nan_in_the_lr_layer_skips_its_projection_with_a_warning_and_the_fit_goes_on() -> None:
    class _Poison(pl.Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, idx: int) -> None:
            if trainer.current_epoch == 1 and idx == 1:
                with torch.no_grad():
                    pl_module.net[0].weight[0, 0] = math.nan

    module = _Scripted([0.9] * 3)
    callback = LowRankProjection(threshold=0.65)
    trainer = quiet_trainer([callback, _Poison()], max_epochs=3)
    with pytest.warns(UserWarning, match=r"LR-Layer .net.2.0. holds NaN or Inf values at step 6; its rank-k proj"):
        trainer.fit(module, _loader())
    assert trainer.global_step == 12
    assert not torch.isfinite(module.net[2][0].weight).all()


def test_a_fresh_fit_of_a_model_saved_switched_on_keeps_its_layers_on(monkeypatch: pytest.MonkeyPatch) -> None:
    # The switched-on state travels in the state dict; a new fit (no ckpt_path) switched the layers off again, and
    # this fit, whose accuracy stays below the threshold, trained and ended without them.
    trained = _Scripted([0.9])
    quiet_trainer([LowRankProjection(threshold=0.65)], max_epochs=1).fit(trained, _loader())
    module = _Scripted([0.0, 0.0])
    module.load_state_dict(trained.state_dict())
    assert module.net[2][0].enabled
    probe = _Probe()
    _count_projections(module, probe, monkeypatch)
    callback = LowRankProjection(threshold=0.65)
    quiet_trainer([callback, probe], max_epochs=2).fit(module, _loader())
    assert probe.enabled == [True, True]
    assert probe.projections == [4, 4]
    assert callback.enabled and callback.switched_on_epoch == 0
