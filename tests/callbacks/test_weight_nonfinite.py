"""A weight matrix holding NaN during a fit: its metrics are NaN, a warning names it once, the others are measured."""

import math
import warnings

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from rank_lightning.callbacks import WeightRankMonitor


class _WithBrokenSpare(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 3))
        self.spare = nn.Linear(4, 4)  # not in the forward pass: stays NaN while the rest trains
        with torch.no_grad():
            self.spare.weight[0, 1] = math.nan

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        return nn.functional.cross_entropy(self(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.net.parameters(), lr=0.1)


def test_nan_weights_are_named_once_and_leave_the_other_layers_measured(tmp_path):
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32, 5, generator=g), torch.randint(0, 3, (32,), generator=g))
    monitor = WeightRankMonitor(verbose=False)
    trainer = pl.Trainer(
        max_epochs=3,
        accelerator="cpu",
        logger=False,
        callbacks=[monitor],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(_WithBrokenSpare(), DataLoader(data, batch_size=8))
    named = [str(w.message) for w in caught if "NaN or Inf weights" in str(w.message)]
    assert named == [
        "WeightRankMonitor: layer 'spare' has NaN or Inf weights (before training): its metrics are NaN "
        "while it does; the other layers are measured as usual."
    ]
    history = monitor.curves.history
    assert sorted(history) == [-1, 0, 1, 2]
    for values in history.values():
        assert all(math.isnan(v) for v in values["spare"].values())
        assert all(math.isfinite(v) for layer in ("net.0", "net.2") for v in values[layer].values())
