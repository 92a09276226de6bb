"""Epoch-cadence monitors in fits that validate several times per epoch (``val_check_interval`` below an epoch): every
measurement keeps its own point in the curves, keyed by optimizer step."""

from __future__ import annotations

import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from rank_lightning.callbacks import ActivationRankMonitor, WeightRankMonitor
from rank_lightning.callbacks.base import validations_per_epoch
from rank_lightning.callbacks.curves import read_curve_file
from rank_lightning.functional import numerical_rank, participation_ratio, stable_rank
from tests.callbacks.recording_logger import RecordingLogger
from tests.callbacks.trainer_helpers import SmallClassifier, quiet_trainer

NUM_CLASSES = 3


def _loader(n: int, seed: int) -> torch.utils.data.DataLoader:
    generator = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, 5, generator=generator), torch.randint(0, NUM_CLASSES, (n,), generator=generator)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)


def _monitors() -> tuple[ActivationRankMonitor, WeightRankMonitor]:
    activations = ActivationRankMonitor(layers=["net.0"], log_at_init=True, verbose=False)
    weights = WeightRankMonitor(layers=["net.0"], log_at_init=True, verbose=False)
    return activations, weights


def _fit(callbacks: list, model: SmallClassifier, epochs: int, ckpt_path: str | None = None, **kwargs: Any) -> Any:
    trainer = quiet_trainer(callbacks, max_epochs=epochs, **kwargs)
    # 64 training rows in batches of 8: 8 optimizer steps per epoch.
    trainer.fit(model, _loader(64, seed=0), _loader(24, seed=1), ckpt_path=ckpt_path)
    return trainer


def _model() -> SmallClassifier:
    return SmallClassifier((5, 12, NUM_CLASSES), activation=nn.Tanh, seed=0)


def test_two_validations_per_epoch_give_two_points_per_epoch_keyed_by_step(tmp_path: Path) -> None:
    activations, weights = _monitors()
    logger, model = RecordingLogger(), _model()
    trainer = _fit([activations, weights], model, 2, val_check_interval=0.5, logger=logger, default_root_dir=tmp_path)

    # Validation after batches 4 and 8 of each epoch: optimizer steps 4, 8, 12 and 16; the initial point at step 0.
    for monitor in (activations, weights):
        assert monitor.curves.x_axis == "step"
        assert monitor.curves.epochs == [0, 4, 8, 12, 16]
        saved = read_curve_file(monitor.curves.figure_dir(trainer) / f"{monitor.curves.namespace}_curves.json")
        assert sorted(saved["history"]) == [0, 4, 8, 12, 16] and saved["facts"]["x_axis"] == "step"
    # Every point is the value logged at its step (four distinct measurements, none replaced by the next).
    logged = {(step, key): value for step, metrics in logger.calls for key, value in metrics.items()}
    for step in (4, 8, 12, 16):
        assert activations.curves.history[step]["net.0"]["participation_ratio"] == pytest.approx(
            logged[(step, "rank/net.0/participation_ratio")], rel=1e-15
        )
    ratios = {activations.curves.history[step]["net.0"]["participation_ratio"] for step in (4, 8, 12, 16)}
    assert len(ratios) == 4
    # The last point: the trained model's own numbers, computed here.
    with torch.no_grad():
        rows = torch.cat([model.net[0](x) for x, _ in _loader(24, seed=1)]).double()
        weight = model.net[0].weight.double()
    last = activations.curves.history[16]["net.0"]
    assert last["participation_ratio"] == pytest.approx(float(participation_ratio(rows)), rel=1e-9)
    assert last["numerical_rank"] == float(numerical_rank(rows))
    assert weights.curves.history[16]["net.0"]["stable_rank"] == pytest.approx(float(stable_rank(weight)), rel=1e-12)


def test_one_validation_per_epoch_keeps_the_epoch_axis(tmp_path: Path) -> None:
    activations, weights = _monitors()
    train_side = ActivationRankMonitor(layers=["net.0"], stage="train", verbose=False)
    _fit([activations, weights, train_side], _model(), 2, default_root_dir=tmp_path)
    assert [m.curves.x_axis for m in (activations, weights, train_side)] == ["epoch"] * 3
    assert activations.curves.epochs == weights.curves.epochs == [-1, 0, 1]


def test_a_training_data_monitor_keeps_the_epoch_axis_whatever_the_validation(tmp_path: Path) -> None:
    train_side = ActivationRankMonitor(layers=["net.0"], stage="train", verbose=False)
    _fit([train_side], _model(), 2, val_check_interval=0.5, default_root_dir=tmp_path)
    assert train_side.curves.x_axis == "epoch" and train_side.curves.epochs == [-1, 0, 1]


def test_a_resumed_fit_keeps_its_step_axis(tmp_path: Path) -> None:
    first, _ = _monitors()
    trainer = _fit([first], _model(), 1, val_check_interval=0.5, default_root_dir=tmp_path)
    checkpoint = str(tmp_path / "one_epoch.ckpt")
    trainer.save_checkpoint(checkpoint)

    resumed, _ = _monitors()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*keyed by epoch.*")
        _fit([resumed], _model(), 2, ckpt_path=checkpoint, val_check_interval=0.5, default_root_dir=tmp_path)
    assert resumed.curves.x_axis == "step"
    assert resumed.curves.epochs == [0, 4, 8, 12, 16]
    assert resumed.curves.history[8] == first.curves.history[8]


def test_resuming_epoch_keyed_curves_with_several_validations_per_epoch_warns(tmp_path: Path) -> None:
    first, _ = _monitors()
    trainer = _fit([first], _model(), 1, default_root_dir=tmp_path)
    checkpoint = str(tmp_path / "one_epoch.ckpt")
    trainer.save_checkpoint(checkpoint)

    resumed, _ = _monitors()
    with pytest.warns(UserWarning, match=r"validation runs 2 times per training epoch \(val_check_interval=0.5\).*"):
        _fit([resumed], _model(), 2, ckpt_path=checkpoint, val_check_interval=0.5, default_root_dir=tmp_path)
    assert resumed.curves.x_axis == "epoch" and resumed.curves.epochs == [-1, 0, 1]


def test_an_interval_counted_across_epochs_keeps_every_validation(tmp_path: Path) -> None:
    # check_val_every_n_epoch=None: validation after every 5th batch of the fit, batches 5, 10 and 15 of two epochs
    # of 8: one in the first epoch and two in the second, which keyed by epoch would leave one point for both.
    activations, weights = _monitors()
    logger, model = RecordingLogger(), _model()
    options = dict(val_check_interval=5, check_val_every_n_epoch=None, logger=logger, default_root_dir=tmp_path)
    _fit([activations, weights], model, 2, **options)
    for monitor in (activations, weights):
        assert monitor.curves.x_axis == "step"
        assert monitor.curves.epochs == [0, 5, 10, 15]
    logged = {(step, key): value for step, metrics in logger.calls for key, value in metrics.items()}
    ratios = [activations.curves.history[step]["net.0"]["participation_ratio"] for step in (5, 10, 15)]
    assert ratios == [logged[(step, "rank/net.0/participation_ratio")] for step in (5, 10, 15)]
    assert len(set(ratios)) == 3


@pytest.mark.parametrize(
    ("check_batch", "batches", "every_n_epoch", "expected"),
    [
        (5, 8, None, 2.0),  # batches 5 | 10, 15 | 20 | 25, 30 | ...: two in every other epoch
        (4, 6, None, 2.0),  # batches 4 | 8, 12 | 16 | ...
        (3, 8, None, 3.0),  # batches 3, 6 | 9, 12, 15 | ...
        (4, 8, None, 2.0),
        (6, 4, None, 1.0),  # batches 6 (second epoch) | 12 (third) | ...: never two in one epoch
        (5, 8, 1, 1.0),  # counted within each epoch: batch 5 only
    ],
)
def test_validations_per_epoch_of_an_interval_counted_across_epochs(
    check_batch: int, batches: int, every_n_epoch: int | None, expected: float
) -> None:
    trainer = SimpleNamespace(
        val_check_batch=check_batch,
        num_training_batches=batches,
        enable_validation=True,
        check_val_every_n_epoch=every_n_epoch,
    )
    assert validations_per_epoch(trainer) == expected


@pytest.mark.parametrize(
    ("check_batch", "batches", "enabled", "expected"),
    [
        (4, 8, True, 2.0),
        (8, 8, True, 1.0),
        (24, 8, True, 1.0),  # every third epoch (check_val_every_n_epoch=None)
        (3, 8, True, 2.0),  # after batches 3 and 6 (and Lightning's own check at the epoch's end)
        (100, float("inf"), True, float("inf")),  # one epoch of unknown length, validated every 100 batches
        (float("inf"), 8, True, 1.0),  # at epoch ends
        (4, 8, False, 1.0),  # no validation
    ],
)
def test_validations_per_epoch(check_batch: float, batches: float, enabled: bool, expected: float) -> None:
    trainer = SimpleNamespace(val_check_batch=check_batch, num_training_batches=batches, enable_validation=enabled)
    assert validations_per_epoch(trainer) == expected
