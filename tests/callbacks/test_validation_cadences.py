"""The epoch-cadence monitors under the validation cadences real runs use: validation inside epochs, in some epochs
only, limited or off, and ``trainer.validate`` around ``fit``."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from rank_lightning.callbacks import (
    ActivationRankMonitor,
    AdversarialValidation,
    JacobianRankMonitor,
    NeuralCollapseMonitor,
)
from rank_lightning.callbacks.curves import read_curve_file
from rank_lightning.functional import participation_ratio
from tests.callbacks.recording_logger import RecordingLogger
from tests.callbacks.trainer_helpers import SmallClassifier, quiet_trainer, small_loader


def _model() -> SmallClassifier:
    return SmallClassifier((5, 12, 3), activation=nn.Tanh, seed=0)


def test_validating_before_a_fit_that_validates_within_epochs_keys_the_curves_by_step(tmp_path: Path) -> None:
    activations = ActivationRankMonitor(layers=["net.0"], verbose=False)
    collapse = NeuralCollapseMonitor(verbose=False)
    logger = RecordingLogger()
    options = dict(max_epochs=2, val_check_interval=0.5, logger=logger, default_root_dir=tmp_path)
    trainer = quiet_trainer([activations, collapse], **options)
    model, val = _model(), small_loader(24, seed=1)
    trainer.validate(model, val, verbose=False)
    untrained = activations.curves.history[-1]
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*keyed by epoch.*")
        # 64 rows in batches of 8: validation after batches 4 and 8 of each epoch, optimizer steps 4, 8, 12 and 16.
        trainer.fit(model, small_loader(64), val)
    for monitor in (activations, collapse):
        assert monitor.curves.x_axis == "step"
        assert monitor.curves.epochs == [0, 4, 8, 12, 16]
        saved = read_curve_file(monitor.curves.curve_path(trainer))
        assert sorted(saved["history"]) == [0, 4, 8, 12, 16] and saved["facts"]["x_axis"] == "step"
    assert activations.curves.history[0] == untrained  # the untrained model, measured by trainer.validate
    ratios = {activations.curves.history[step]["net.0"]["participation_ratio"] for step in (4, 8, 12, 16)}
    assert len(ratios) == 4  # no validation replaced the one before it
    logged = [step for step, metrics in logger.calls if "rank/net.0/participation_ratio" in metrics]
    assert logged == [0, 4, 8, 12, 16]


def test_adversarial_validation_names_a_fit_without_validation(tmp_path: Path) -> None:
    callback = AdversarialValidation(eps=(0.1,), attacks=("fgsm",), verbose=False)
    trainer = quiet_trainer([callback], max_epochs=1, limit_val_batches=0, default_root_dir=tmp_path)
    message = r"AdversarialValidation: limit_val_batches=0: this fit runs no validation, so no input is attacked in it"
    with pytest.warns(UserWarning, match=message):
        trainer.fit(_model(), small_loader(), small_loader())
    assert callback.history == {"validate": {}, "test": {}}
    assert not (tmp_path / "rank_curves").exists()


def test_validating_after_fit_keeps_the_fits_point_of_other_weights(tmp_path: Path) -> None:
    # val_check_interval=0.75 of 8 batches: one validation per epoch, after its 6th batch (optimizer step 6, then 14),
    # so the curves are keyed by epoch; the fit ends at step 16, with weights no validation of it measured.
    monitor = ActivationRankMonitor(layers=["net.0"], log_at_init=False, verbose=False)
    trainer = quiet_trainer([monitor], max_epochs=2, val_check_interval=0.75, default_root_dir=tmp_path)
    model, val = _model(), small_loader(24, seed=1)
    trainer.fit(model, small_loader(64), val)
    fitted = monitor.curves.history
    assert sorted(fitted) == [0, 1]
    message = r"measures the weights of optimizer step 16, but epoch 1, .* holds the fit's measurement at step 14"
    with pytest.warns(UserWarning, match=message):
        (results,) = trainer.validate(model, val, verbose=False)
    assert monitor.curves.history == fitted  # the fit's measurement of epoch 1 is not replaced
    assert read_curve_file(monitor.curves.curve_path(trainer))["history"] == fitted
    with torch.no_grad():  # what trainer.validate returns: the final weights' numbers
        rows = torch.cat([model.net[0](x) for x, _ in val]).double()
    assert results["rank/net.0/participation_ratio"] == pytest.approx(float(participation_ratio(rows)), rel=1e-9)
    assert results["rank/net.0/participation_ratio"] != fitted[1]["net.0"]["participation_ratio"]


def test_validating_a_checkpoint_of_other_weights_keeps_the_fits_point(tmp_path: Path) -> None:
    monitor = ActivationRankMonitor(layers=["net.0"], log_at_init=False, verbose=False)
    # Saved at the end of each epoch (step 8, then 16), after the validation inside it (step 6, then 14).
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="last", save_on_train_epoch_end=True)
    options = dict(max_epochs=2, val_check_interval=0.75, enable_checkpointing=True, default_root_dir=tmp_path)
    val = small_loader(24, seed=1)
    quiet_trainer([monitor, checkpoint], **options).fit(_model(), small_loader(64), val)
    validated = ActivationRankMonitor(layers=["net.0"], log_at_init=False, verbose=False)
    trainer = quiet_trainer([validated], default_root_dir=tmp_path / "validate")
    with pytest.warns(UserWarning, match=r"weights of optimizer step 16, but epoch 1, .* measurement at step 14"):
        (results,) = trainer.validate(_model(), val, ckpt_path=tmp_path / "ckpt" / "last.ckpt", verbose=False)
    assert validated.curves.history == monitor.curves.history
    assert "rank/net.0/participation_ratio" in results


def _pixels(rows: int, seed: int) -> DataLoader:
    generator = torch.Generator().manual_seed(seed)
    x, y = torch.rand(rows, 5, generator=generator), torch.randint(0, 3, (rows,), generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=8)


def test_adversarial_validation_after_fit_keeps_the_fits_evaluation_of_other_weights(tmp_path: Path) -> None:
    callback = AdversarialValidation(eps=(0.1,), attacks=("fgsm",), verbose=False)
    options = dict(max_epochs=2, val_check_interval=0.75, inference_mode=False, default_root_dir=tmp_path)
    trainer = quiet_trainer([callback], **options)
    model, val = _model(), _pixels(24, seed=1)
    trainer.fit(model, _pixels(64, seed=0), val)
    fitted = {point: dict(values) for point, values in callback.history["validate"].items()}
    assert sorted(fitted) == [0, 1]  # after optimizer steps 6 and 14; the fit ends at step 16
    message = r"AdversarialValidation: .* weights of optimizer step 16, but epoch 1, .* evaluation at step 14"
    with pytest.warns(UserWarning, match=message):
        (results,) = trainer.validate(model, val, verbose=False)
    assert callback.history["validate"] == fitted
    saved = json.loads((tmp_path / "rank_curves" / "adversarial.json").read_text())
    assert saved["1"]["step"] == 14 and saved["1"]["adv/clean_acc"] == fitted[1]["clean_acc"]
    assert "adv/clean_acc" in results


def test_the_default_cadence_measures_every_validation_of_sparse_validation_without_a_warning(tmp_path: Path) -> None:
    monitors = [
        ActivationRankMonitor(layers=["net.0"], log_at_init=False, verbose=False),
        NeuralCollapseMonitor(verbose=False),
        JacobianRankMonitor(verbose=False),
    ]
    trainer = quiet_trainer(monitors, max_epochs=4, check_val_every_n_epoch=2, default_root_dir=tmp_path)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*check_val_every_n_epoch.*")
        trainer.fit(_model(), small_loader(), small_loader(24, seed=1))
    assert [monitor.curves.epochs for monitor in monitors] == [[1, 3]] * 3  # every validation, once


def test_validation_more_frequent_than_optimizer_steps_is_named(tmp_path: Path) -> None:
    monitor = ActivationRankMonitor(layers=["net.0"], verbose=False)
    options = dict(max_epochs=1, val_check_interval=0.25, accumulate_grad_batches=4, default_root_dir=tmp_path)
    trainer = quiet_trainer([monitor], **options)
    message = (
        r"ActivationRankMonitor: validation runs every 2 training batches, fewer than the accumulate_grad_batches=4 "
        r"of one optimizer step: .* Validate every multiple of 4 training batches"
    )
    with pytest.warns(UserWarning, match=message):
        trainer.fit(_model(), small_loader(64), small_loader(24, seed=1))
    # Validation after batches 2, 4, 6 and 8: optimizer steps 0, 1, 1 and 2, each kept once.
    assert monitor.curves.x_axis == "step" and monitor.curves.epochs == [0, 1, 2]
