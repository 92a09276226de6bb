"""The monitors under Lightning loops beyond one plain fit: several validation or test dataloaders, the same monitors
on a second Trainer, a fit continued with more epochs."""

from __future__ import annotations

from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch

from rank_lightning.callbacks import ActivationRankMonitor, WeightRankMonitor
from rank_lightning.callbacks.curves import read_curve_file
from rank_lightning.functional import participation_ratio, stable_rank
from tests.callbacks.trainer_helpers import SmallClassifier, quiet_trainer, small_loader


class _LoaderRows(pl.Callback):
    """The ``net.0`` outputs of the last validation or test run, by dataloader, from a forward hook of our own."""

    def __init__(self) -> None:
        self.rows: dict[int, list[torch.Tensor]] = {}
        self._loader = 0
        self._handle = None

    def _start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.rows = {}

        def hook(_module: torch.nn.Module, _args: object, output: torch.Tensor) -> None:
            self.rows.setdefault(self._loader, []).append(output.detach().double())

        self._handle = pl_module.net[0].register_forward_hook(hook)

    def _batch(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: object, idx: int, loader: int = 0):
        self._loader = loader

    def _end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._handle.remove()

    on_validation_epoch_start = on_test_epoch_start = _start
    on_validation_batch_start = on_test_batch_start = _batch
    on_validation_epoch_end = on_test_epoch_end = _end


class _Tested(SmallClassifier):
    def test_step(self, batch: object, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.net(batch[0])


def test_two_validation_loaders_are_pooled_with_a_warning(tmp_path: Path) -> None:
    rows = _LoaderRows()
    monitor = ActivationRankMonitor(layers=["net.0"], log_at_init=False, max_samples=None, verbose=False)
    trainer = quiet_trainer([monitor, rows], max_epochs=1, num_sanity_val_steps=0, default_root_dir=tmp_path)
    loaders = [small_loader(16, seed=1), small_loader(24, seed=2)]
    with pytest.warns(UserWarning, match=r"2 validation dataloaders: their activations are pooled"):
        trainer.fit(SmallClassifier(seed=0), small_loader(32), loaders)
    first, second = torch.cat(rows.rows[0]), torch.cat(rows.rows[1])
    logged = float(trainer.callback_metrics["rank/net.0/participation_ratio"])
    assert logged == pytest.approx(float(participation_ratio(torch.cat([first, second]))), rel=1e-12)
    # The two data sets alone differ from their pool (2.91 and 2.70 against 2.93): pooling is not a detail.
    assert abs(float(participation_ratio(first)) - logged) > 1e-3
    assert abs(float(participation_ratio(second)) - logged) > 1e-1
    assert float(trainer.callback_metrics["rank/net.0/spectrum_rows"]) == 40


def test_two_test_loaders_are_pooled_with_a_warning(tmp_path: Path) -> None:
    rows = _LoaderRows()
    monitor = ActivationRankMonitor(layers=["net.0"], on_test=True, max_samples=None, verbose=False)
    trainer = quiet_trainer([monitor, rows], default_root_dir=tmp_path)
    with pytest.warns(UserWarning, match=r"2 test dataloaders: their activations are pooled"):
        results = trainer.test(_Tested(seed=0), [small_loader(16, seed=1), small_loader(24, seed=2)])
    pooled = torch.cat(rows.rows[0] + rows.rows[1])
    assert results[0]["rank_test/net.0/participation_ratio"] == pytest.approx(
        float(participation_ratio(pooled)), rel=1e-6
    )


def _reference(model: SmallClassifier) -> tuple[float, float]:
    """Our own participation ratio of ``net.0``'s outputs on the validation rows and stable rank of its weight."""
    with torch.no_grad():
        rows = model.net[0](small_loader(16, seed=1).dataset.tensors[0]).double()
        return float(participation_ratio(rows)), float(stable_rank(model.net[0].weight.double()))


def _fit(monitors: list, model: SmallClassifier, root: Path, trainer: pl.Trainer | None = None, epochs: int = 2):
    trainer = trainer or quiet_trainer(monitors, max_epochs=epochs, num_sanity_val_steps=0, default_root_dir=root)
    trainer.fit_loop.max_epochs = epochs
    trainer.fit(model, small_loader(32), small_loader(16, seed=1))
    return trainer


def _points(activations: ActivationRankMonitor, weights: WeightRankMonitor) -> dict[int, tuple[float, float]]:
    history, weight_history = activations.curves.history, weights.curves.history
    return {p: (history[p]["net.0"]["participation_ratio"], weight_history[p]["net.0"]["stable_rank"]) for p in history}


def test_the_same_monitors_on_a_second_trainer_start_new_curves(tmp_path: Path) -> None:
    activations = ActivationRankMonitor(layers=["net.0"], log_at_init=True, verbose=False)
    weights = WeightRankMonitor(layers=["net.0"], log_at_init=True, verbose=False)
    _fit([activations, weights], SmallClassifier(seed=0), tmp_path / "first")
    second = SmallClassifier(seed=1)
    initial = _reference(second)
    trainer = _fit([activations, weights], second, tmp_path / "second")
    points = _points(activations, weights)
    assert sorted(points) == [-1, 0, 1]
    # The initial point is the second model's (participation ratio 3.32), not the first one's (2.93).
    assert points[-1] == pytest.approx(initial, rel=1e-12)
    assert points[1] == pytest.approx(_reference(second), rel=1e-12)
    saved = read_curve_file(activations.curves.figure_dir(trainer) / "rank_curves.json")
    assert saved["history"][-1]["net.0"]["participation_ratio"] == pytest.approx(initial[0], rel=1e-12)


def test_a_fit_continued_with_more_epochs_keeps_its_curves(tmp_path: Path) -> None:
    activations = ActivationRankMonitor(layers=["net.0"], log_at_init=True, verbose=False)
    weights = WeightRankMonitor(layers=["net.0"], log_at_init=True, verbose=False)
    model = SmallClassifier(seed=0)
    initial = _reference(model)
    trainer = _fit([activations, weights], model, tmp_path)
    after_two = _points(activations, weights)
    _fit([], model, tmp_path, trainer=trainer, epochs=4)
    points = _points(activations, weights)
    assert sorted(points) == [-1, 0, 1, 2, 3]
    assert points[-1] == pytest.approx(initial, rel=1e-12)
    assert all(points[p] == after_two[p] for p in (-1, 0, 1))
    assert points[3] == pytest.approx(_reference(model), rel=1e-12)


def test_trainer_predict_says_that_it_is_not_monitored(tmp_path: Path, callback_messages: list[str]) -> None:
    activations = ActivationRankMonitor(layers=["net.0"])
    weights = WeightRankMonitor(layers=["net.0"])
    model = SmallClassifier(seed=0)
    model.predict_step = lambda batch, batch_idx, dataloader_idx=0: model.net(batch[0])
    predictions = quiet_trainer([activations, weights], default_root_dir=tmp_path).predict(model, small_loader(16))
    assert len(predictions) == 2
    assert callback_messages == [
        "ActivationRankMonitor: trainer.predict is not monitored (validation, training or test batches are)",
        "WeightRankMonitor: trainer.predict is not monitored (weights are measured during fit)",
    ]
    assert activations.curves.epochs == weights.curves.epochs == []
