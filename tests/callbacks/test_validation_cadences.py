"""The epoch-cadence monitors under the validation cadences real runs use: validation inside epochs, in some epochs
only, limited or off, and ``trainer.validate`` around ``fit``."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
from torch import nn

from rank_lightning.callbacks import ActivationRankMonitor, AdversarialValidation, NeuralCollapseMonitor
from rank_lightning.callbacks.curves import read_curve_file
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
