"""Models, data and runs of the tests that the monitors of training batches give on two processes the numbers of one:
step windows and weight spectra under gradient accumulation, and several training loaders.

Kept apart from the test module so that spawned workers import only torch, Lightning and rank_lightning.
"""

from __future__ import annotations

import csv
import json
import math
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import CSVLogger
from pytorch_lightning.utilities import CombinedLoader
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from rank_lightning.callbacks import ActivationRankMonitor, WeightRankMonitor
from rank_lightning.callbacks.curves import FIGURE_DIR
from tests.spawned import SpawnedDDP

WORLD_SIZE = 2
BATCH_SIZE = 8
NUM_CLASSES = 3


def _dataset(num_samples: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    y = torch.arange(num_samples) % NUM_CLASSES
    x = torch.randn(num_samples, 6, generator=generator, dtype=torch.float64) + nn.functional.one_hot(y, 6)
    return TensorDataset(x, y)


class StepNet(pl.LightningModule):
    """An MLP trained in float64 with plain SGD: one process and two take the same steps up to float64 rounding.

    One process reads ``WORLD_SIZE * BATCH_SIZE`` rows per batch in order; process r of a DDP run reads rows
    r, r + W, ... (a ``DistributedSampler`` without shuffling), so batch b of every process together holds the rows
    of batch b of one process, and the mean losses, averaged by DDP, give the same gradients."""

    def __init__(self, num_samples: int) -> None:
        super().__init__()
        self.num_samples, self.num_classes = num_samples, NUM_CLASSES
        self.net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 5), nn.Tanh(), nn.Linear(5, NUM_CLASSES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        return nn.functional.cross_entropy(self(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)

    def train_dataloader(self):
        data = _dataset(self.num_samples)
        world = self.trainer.world_size
        if world == 1:
            return DataLoader(data, batch_size=WORLD_SIZE * BATCH_SIZE)
        sampler = DistributedSampler(data, num_replicas=world, rank=self.global_rank, shuffle=False)
        return DataLoader(data, batch_size=BATCH_SIZE, sampler=sampler)


def fit_steps(root: Path, devices: int, num_samples: int = 80, **options: Any) -> dict[str, Any]:
    """Fit StepNet with an activation and a weight monitor on a step cadence on ``devices`` spawned CPU processes (one:
    no DDP); the curve files and the CSV rows rank zero wrote."""
    torch.manual_seed(0)
    activations = ActivationRankMonitor(
        layers=["net.1", "net.3"], every_n_train_steps=2, window_batches=3, max_samples=None, verbose=False
    )
    weights = WeightRankMonitor(layers=["net.0", "net.2"], every_n_train_steps=2, verbose=False)
    strategy = SpawnedDDP(timeout=timedelta(seconds=60)) if devices > 1 else "auto"
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        precision="64-true",
        logger=CSVLogger(root, name="run", version=0),
        callbacks=[activations, weights],
        use_distributed_sampler=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        **options,
    )
    trainer.fit(StepNet(num_samples))
    log_dir = Path(root, "run", "version_0")
    with (log_dir / "metrics.csv").open(newline="") as file:
        rows = list(csv.DictReader(file))
    curves = {
        name: json.loads((log_dir / FIGURE_DIR / f"{name}.json").read_text())
        for name in ("rank_train_curves", "weight_curves")
    }
    return {"rows": rows, **curves}


class SeveralLoadersNet(pl.LightningModule):
    """An MLP trained with a zero learning rate (one process and two hold the same weights) on a dict of training
    loaders whose inputs each step runs in one forward pass, concatenated in loader order."""

    def __init__(self, sizes: dict[str, int], mode: str) -> None:
        super().__init__()
        self.sizes, self.mode, self.num_classes = sizes, mode, NUM_CLASSES
        self.net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, NUM_CLASSES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        parts = [part for part in batch.values() if part is not None]
        return nn.functional.cross_entropy(self(torch.cat([p[0] for p in parts])), torch.cat([p[1] for p in parts]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def train_dataloader(self):
        # Lightning deals each loader out to the processes (shuffled): batches of half the size on two processes.
        batch_size = WORLD_SIZE * BATCH_SIZE // self.trainer.world_size
        loaders = {key: DataLoader(_dataset(n), batch_size=batch_size) for key, n in self.sizes.items()}
        return CombinedLoader(loaders, self.mode)


def combined_labels(batch: dict[str, Any]) -> torch.Tensor:
    """The labels of a combined batch, in loader order."""
    return torch.cat([part[1] for part in batch.values() if part is not None])


def fit_several_loaders(root: Path, devices: int, sizes: dict[str, int], mode: str = "max_size_cycle") -> dict:
    """Fit SeveralLoadersNet for one epoch with the activation monitor on the training batches (and the initial point)
    on ``devices`` spawned CPU processes; the curve file rank zero wrote."""
    torch.manual_seed(0)
    monitor = ActivationRankMonitor(
        layers=["net.1"], stage="train", max_samples=None, label_fn=combined_labels, verbose=False
    )
    strategy = SpawnedDDP(timeout=timedelta(seconds=60)) if devices > 1 else "auto"
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        precision="64-true",
        logger=False,
        default_root_dir=root,
        callbacks=[monitor],
        max_epochs=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(SeveralLoadersNet(sizes, mode))
    return json.loads((Path(root) / FIGURE_DIR / "rank_train_curves.json").read_text())


def assert_histories_close(ddp: dict, single: dict, rel: float) -> None:
    """The same points, layers and metrics; the numbers equal to ``rel`` relative (NaN where the other has NaN)."""
    assert ddp.keys() == single.keys()
    for point, layers in single.items():
        assert ddp[point].keys() == layers.keys(), point
        for layer, metrics in layers.items():
            assert ddp[point][layer].keys() == metrics.keys(), (point, layer)
            for metric, value in metrics.items():
                got = ddp[point][layer][metric]
                if math.isnan(value):
                    assert math.isnan(got), (point, layer, metric)
                else:
                    assert got == pytest.approx(value, rel=rel, abs=1e-12), (point, layer, metric)
