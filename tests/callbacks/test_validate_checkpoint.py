"""``trainer.validate(ckpt_path=...)`` of a trained checkpoint: recorded at the checkpoint's epoch, where its fit
recorded the same weights, never over the restored initial point."""

import pytest
from pytorch_lightning.callbacks import ModelCheckpoint

from rank_lightning.callbacks import ActivationRankMonitor
from tests.callbacks.trainer_helpers import SmallClassifier, quiet_trainer, small_loader


def test_validating_a_trained_checkpoint_keeps_the_initial_point(tmp_path):
    loader = small_loader(48)
    fitted = ActivationRankMonitor(layers=["net.1"], verbose=False)
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="last")
    fit = quiet_trainer([fitted, checkpoint], max_epochs=3, enable_checkpointing=True, default_root_dir=tmp_path)
    fit.fit(SmallClassifier(lr=0.2), loader, loader)
    assert sorted(fitted.curves.history) == [-1, 0, 1, 2]
    assert fitted.curves.history[-1] != fitted.curves.history[2]  # training moved the ranks
    validated = ActivationRankMonitor(layers=["net.1"], verbose=False)
    trainer = quiet_trainer([validated], default_root_dir=tmp_path / "validate")
    trainer.validate(SmallClassifier(lr=0.2), loader, ckpt_path=tmp_path / "ckpt" / "last.ckpt")
    history = validated.curves.history
    assert sorted(history) == [-1, 0, 1, 2]
    assert history[-1] == fitted.curves.history[-1]  # restored, not overwritten by the trained weights
    for metric, value in fitted.curves.history[2]["net.1"].items():
        assert history[2]["net.1"][metric] == pytest.approx(value, rel=1e-12, abs=1e-12), metric
