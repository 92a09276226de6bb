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


@pytest.mark.parametrize("max_steps", [-1, 10])
def test_validating_after_fit_is_recorded_at_the_last_trained_epoch(tmp_path, max_steps):
    # 6 batches per epoch: max_steps=10 stops inside epoch 1, whose end-of-epoch validation never runs.
    loader = small_loader(48)
    monitor = ActivationRankMonitor(layers=["net.1"], verbose=False)
    trainer = quiet_trainer([monitor], max_epochs=3, max_steps=max_steps, default_root_dir=tmp_path)
    model = SmallClassifier(lr=0.2)
    trainer.fit(model, loader, loader)
    fitted = monitor.curves.history
    last = 2 if max_steps == -1 else 1
    assert trainer.current_epoch == last + 1  # Lightning counts the epochs run by now, not the last one
    trainer.validate(model, loader, verbose=False)
    history = monitor.curves.history
    # The final weights are those of the last epoch trained: no epoch after it appears in the curves.
    assert sorted(history) == [-1, 0, *([1, 2] if last == 2 else [1])]
    assert {e: v for e, v in history.items() if e != last} == {e: v for e, v in fitted.items() if e != last}
    if last in fitted:  # the same weights and data as the fit's own measurement of that epoch
        for metric, value in fitted[last]["net.1"].items():
            assert history[last]["net.1"][metric] == pytest.approx(value, rel=1e-12, abs=1e-12), metric
