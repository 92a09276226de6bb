"""``trainer.validate(ckpt_path=...)`` of a trained checkpoint: recorded at the checkpoint's epoch, where its fit
recorded the same weights, never over the restored initial point."""

import pytest
import torch
from pytorch_lightning.callbacks import ModelCheckpoint

from rank_lightning.callbacks import ActivationRankMonitor
from rank_lightning.functional import numerical_rank, participation_ratio
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


def test_trainer_test_logs_the_test_data_under_keys_of_its_own(tmp_path, callback_messages):
    model = SmallClassifier(widths=(5, 12, 3), seed=0)
    monitor = ActivationRankMonitor(layers=["net.0"], verbose=True)
    trainer = quiet_trainer([monitor], default_root_dir=tmp_path)
    test_loader = small_loader(rows=40, seed=5)
    model.test_step = model.validation_step
    (results,) = trainer.test(model, test_loader, verbose=False)
    with torch.no_grad():
        rows = torch.cat([model.net[0](x) for x, _ in test_loader]).double()
    assert results["rank_test/net.0/participation_ratio"] == pytest.approx(float(participation_ratio(rows)), rel=1e-9)
    assert results["rank_test/net.0/numerical_rank"] == float(numerical_rank(rows))
    assert not any(key.startswith("rank/") for key in results)
    assert monitor.curves.epochs == []  # the test data is not a point of the validation curves
    assert any("the test data under rank_test/" in message for message in callback_messages)
    # Off: nothing measured, and setup says so.
    quiet = ActivationRankMonitor(layers=["net.0"], on_test=False)
    (results,) = quiet_trainer([quiet], default_root_dir=tmp_path).test(model, test_loader, verbose=False)
    assert not any(key.startswith("rank") for key in results)
    assert "ActivationRankMonitor: trainer.test is not monitored (on_test=False)" in callback_messages
