"""``trainer.validate(ckpt_path=...)`` of a trained checkpoint: recorded at the checkpoint's epoch, where its fit
recorded the same weights, never over the restored initial point."""

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from rank_lightning.callbacks import ActivationRankMonitor


class _Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(5, 12), nn.ReLU(), nn.Linear(12, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        return nn.functional.cross_entropy(self(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx):
        self(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.2)


def _trainer(root, callbacks, epochs: int = 3) -> pl.Trainer:
    return pl.Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        logger=False,
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
    )


def test_validating_a_trained_checkpoint_keeps_the_initial_point(tmp_path):
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(48, 5, generator=g), torch.randint(0, 3, (48,), generator=g))
    loader = DataLoader(data, batch_size=8)
    fitted = ActivationRankMonitor(layers=["net.1"], verbose=False)
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="last")
    _trainer(tmp_path / "fit", [fitted, checkpoint]).fit(_Net(), loader, loader)
    assert sorted(fitted.curves.history) == [-1, 0, 1, 2]
    assert fitted.curves.history[-1] != fitted.curves.history[2]  # training moved the ranks
    validated = ActivationRankMonitor(layers=["net.1"], verbose=False)
    _trainer(tmp_path / "validate", [validated]).validate(_Net(), loader, ckpt_path=tmp_path / "ckpt" / "last.ckpt")
    history = validated.curves.history
    assert sorted(history) == [-1, 0, 1, 2]
    assert history[-1] == fitted.curves.history[-1]  # restored, not overwritten by the trained weights
    for metric, value in fitted.curves.history[2]["net.1"].items():
        assert history[2]["net.1"][metric] == pytest.approx(value, rel=1e-12, abs=1e-12), metric
