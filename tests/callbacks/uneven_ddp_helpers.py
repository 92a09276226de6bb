"""Model, data and run of the tests that an uneven dataset gives the same numbers on one process and on two.

Kept apart from the test module so that spawned workers import only torch, Lightning and rank_lightning.
"""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.strategies import DDPStrategy
from torch import nn

from rank_lightning.callbacks import ClassificationDimension, LowDimensionalEvaluation, NeuralCollapseMonitor
from rank_lightning.functional.neural_collapse import NC_METRICS

NUM_CLASSES = 3
# Odd: Lightning's DistributedSampler gives each of two processes 31 validation and 34 training samples, the second
# process's last one a repeat.
VAL_SAMPLES = 61
TRAIN_SAMPLES = 67


def _loader(num_samples: int, seed: int, shuffle: bool) -> torch.utils.data.DataLoader:
    """Three Gaussian classes in 6 dimensions; column 0 holds the sample's index, so a run can tell which samples it
    measured."""
    generator = torch.Generator().manual_seed(seed)
    y = torch.arange(num_samples) % NUM_CLASSES
    x = torch.randn(num_samples, 6, generator=generator) + 3 * nn.functional.one_hot(y, 6).float()
    x[:, 0] = torch.arange(num_samples, dtype=torch.float32)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8, shuffle=shuffle)


class FrozenMLP(pl.LightningModule):
    """An MLP trained with a zero learning rate, so that one process and two hold the same weights; ``inputs``
    passes the inputs through unchanged, for a callback that should see them."""

    def __init__(self) -> None:
        super().__init__()
        self.inputs = nn.Identity()
        self.body = nn.Sequential(nn.Linear(6, 16), nn.ReLU())
        self.head = nn.Linear(16, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.inputs(x)))

    def training_step(self, batch, batch_idx):
        return nn.functional.cross_entropy(self(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", nn.functional.cross_entropy(self(batch[0]), batch[1]), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def train_dataloader(self):
        return _loader(TRAIN_SAMPLES, 1, shuffle=True)

    def val_dataloader(self):
        return _loader(VAL_SAMPLES, 2, shuffle=False)


class RecordingLowDimensionalEvaluation(LowDimensionalEvaluation):
    """Records the sample indices (column 0 of the inputs) of every collection, as gathered from all processes."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.collected: list[list[int]] = []

    def _collect(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loader: Any) -> tuple:
        x, y = super()._collect(trainer, pl_module, loader)
        self.collected.append(sorted(int(i) for i in x[:, 0].round().tolist()))
        return x, y


class _Save(pl.Callback):
    """At the end of the fit, writes what the other callbacks computed, as every process holds it."""

    def __init__(self, directory: str, neural: Any, clsdim: Any, lowdim: Any) -> None:
        self.directory, self.neural, self.clsdim, self.lowdim = directory, neural, clsdim, lowdim

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The classification dimension is computed on rank zero alone.
        result = self.clsdim.result if trainer.is_global_zero else None
        values = {
            "neural_collapse": self.neural.result.as_dict(NC_METRICS),
            "neural_samples": self.neural.result.num_samples,
            "clsdim": result
            and {
                "full_accuracy": result.full_accuracy,
                "accuracies": result.accuracies.tolist(),
                "eigenvalues": result.eigenvalues.tolist(),
            },
            "lowdim_samples": self.lowdim.collected,
        }
        Path(self.directory, f"rank{trainer.global_rank}.json").write_text(json.dumps(values))


def fit(root: Path, devices: int) -> dict:
    """Fit FrozenMLP for one epoch with the three callbacks on ``devices`` CPU processes; what rank 0 computed."""
    torch.manual_seed(0)
    root.mkdir(parents=True, exist_ok=True)
    neural = NeuralCollapseMonitor(head="head", verbose=False)
    clsdim = ClassificationDimension(head="head", verbose=False)
    lowdim = RecordingLowDimensionalEvaluation(dims=(2,), layer="inputs", verbose=False)
    strategy = DDPStrategy(start_method="spawn", timeout=timedelta(seconds=60)) if devices > 1 else "auto"
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        callbacks=[neural, clsdim, lowdim, _Save(str(root), neural, clsdim, lowdim)],
        max_epochs=1,
        logger=False,
        default_root_dir=root,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(FrozenMLP())
    ranks = [json.loads((root / f"rank{rank}.json").read_text()) for rank in range(devices)]
    assert all(dict(values, clsdim=None) == dict(ranks[0], clsdim=None) for values in ranks), "the processes disagree"
    return ranks[0]
