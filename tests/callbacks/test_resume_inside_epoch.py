"""A training-data monitor (epoch cadence) whose fit resumes inside a monitored epoch from a checkpoint without the
epoch's sums (saved by an older version, or under DDP) measures the rest of it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pytorch_lightning.callbacks import ModelCheckpoint

from rank_lightning.callbacks import ActivationRankMonitor
from tests.callbacks.trainer_helpers import SmallClassifier, quiet_trainer, small_loader


def test_a_fit_resumed_inside_a_monitored_epoch_measures_the_rest_of_it(tmp_path: Path) -> None:
    every_step = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1, filename="{step}")
    first = ActivationRankMonitor(layers=["net.0"], stage="train", max_samples=None, verbose=False)
    trainer = quiet_trainer([first, every_step], max_epochs=3, enable_checkpointing=True, default_root_dir=tmp_path)
    # 32 rows in batches of 8: 4 steps per epoch; step 6 is the second batch of epoch 1.
    trainer.fit(SmallClassifier(seed=0), small_loader(32), small_loader(16))
    assert first.curves.epochs == [-1, 0, 1, 2]
    checkpoint = torch.load(tmp_path / "step=6.ckpt", weights_only=False)
    states = [state for state in checkpoint["callbacks"].values() if "open_epoch" in state]
    assert [state.pop("open_epoch")["epoch"] for state in states] == [1]
    torch.save(checkpoint, tmp_path / "old.ckpt")

    resumed = ActivationRankMonitor(layers=["net.0"], stage="train", max_samples=None, verbose=False)
    again = quiet_trainer([resumed], max_epochs=3, default_root_dir=tmp_path)
    message = r"the fit resumed inside epoch 1, after 2 of its batches: that epoch is .*the checkpoint holds no sums"
    with pytest.warns(UserWarning, match=message):
        again.fit(SmallClassifier(seed=0), small_loader(32), small_loader(16), ckpt_path=str(tmp_path / "old.ckpt"))
    assert resumed.curves.epochs == [-1, 0, 1, 2]
    rows = resumed.curves.history[1]["net.0"]["spectrum_rows"]
    assert 0 < rows < first.curves.history[1]["net.0"]["spectrum_rows"] == 32
    assert resumed.curves.history[0] == first.curves.history[0]
    assert torch.isfinite(torch.tensor(resumed.curves.history[1]["net.0"]["participation_ratio"]))
