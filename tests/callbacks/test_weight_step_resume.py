"""WeightRankMonitor's step cadence in a fit resumed at a monitored step with gradient accumulation: the step is
not measured again by the micro-batches that take no optimizer step."""

import warnings

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from rank_lightning.callbacks import WeightRankMonitor


class _Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        return nn.functional.cross_entropy(self(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _trainer(root, monitor, epochs: int, checkpoint: ModelCheckpoint | None = None) -> pl.Trainer:
    return pl.Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        accumulate_grad_batches=2,
        logger=False,
        callbacks=[monitor, *([checkpoint] if checkpoint else [])],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=checkpoint is not None,
        default_root_dir=root,
    )


def test_a_fit_resumed_at_a_monitored_step_measures_it_once(tmp_path):
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32, 5, generator=g), torch.randint(0, 3, (32,), generator=g))
    loader = DataLoader(data, batch_size=8)  # 4 batches, 2 optimizer steps per epoch
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_epochs=1, save_top_k=-1)
    first = WeightRankMonitor(every_n_train_steps=2, verbose=False)
    _trainer(tmp_path / "a", first, 1, checkpoint).fit(_Net(), loader)
    assert sorted(first.curves.history) == [0, 2]
    [saved] = (tmp_path / "ckpt").glob("*.ckpt")  # at step 2, a monitored step
    resumed = WeightRankMonitor(every_n_train_steps=2, verbose=False)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*trained again.*")
        _trainer(tmp_path / "b", resumed, 3).fit(_Net(), loader, ckpt_path=saved)
    assert sorted(resumed.curves.history) == [0, 2, 4, 6]
    assert resumed.curves.superseded == []
    assert resumed.curves.history[2] == first.curves.history[2]  # the loaded value, not measured again
