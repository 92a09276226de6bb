"""Model, data and run of the ActivationRankMonitor DDP test.

Kept apart from the test module so that spawned workers import only torch, Lightning and rank_lightning.
"""

from __future__ import annotations

import csv
import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import CSVLogger
from torch import nn
from torch.utils.data.distributed import DistributedSampler

from rank_lightning.callbacks import ActivationRankMonitor
from rank_lightning.callbacks.curves import FIGURE_DIR
from tests.spawned import SpawnedDDP

WORLD_SIZE = 2
BATCH_SIZE = 8
# Divisible by world size x batch size, so the distributed sampler pads nothing.
NUM_SAMPLES = 4 * WORLD_SIZE * BATCH_SIZE
NUM_CLASSES = 3


class ConvNet(pl.LightningModule):
    """Conv maps (B, 3, 6, 6), a ReLU MLP, and a side layer that runs on the second process only."""

    def __init__(self) -> None:
        super().__init__()
        self.num_classes = NUM_CLASSES
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.fc = nn.Linear(108, 16)
        self.act = nn.ReLU()
        self.head = nn.Linear(16, NUM_CLASSES)
        self.side = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.act(self.fc(torch.relu(self.conv(x)).flatten(1)))
        if self.global_rank == 1:
            # A layer measured by one process only: the others never join its metric's collective.
            self.side(hidden)
        return self.head(hidden)

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", nn.functional.cross_entropy(self(batch[0]), batch[1]), sync_dist=True)


def loader(num_samples: int = NUM_SAMPLES, shuffle: bool = False) -> torch.utils.data.DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(num_samples, 2, 6, 6, generator=generator)
    y = torch.randint(0, NUM_CLASSES, (num_samples,), generator=generator)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH_SIZE, shuffle=shuffle)


def _validating_trainer(devices: int, monitor: pl.Callback, **options: Any) -> pl.Trainer:
    """A quiet CPU Trainer with ``monitor`` on ``devices`` spawned DDP processes (one: no DDP)."""
    strategy = SpawnedDDP(timeout=timedelta(seconds=60)) if devices > 1 else "auto"
    return pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        callbacks=[monitor],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        **options,
    )


def validate(root: Path, devices: int) -> tuple[dict, list[dict[str, str]]]:
    """Validate on ``devices`` CPU processes; returns the curve file and the CSV rows rank zero wrote.

    ``trainer.validate`` rather than ``fit``: the monitor runs the same code in both, and ``fit`` would add the time of
    twenty figures drawn at its end.
    """
    torch.manual_seed(0)
    model = ConvNet()
    monitor = ActivationRankMonitor(layers=["conv", "act", "side"], max_samples=None, verbose=False)
    trainer = _validating_trainer(devices, monitor, logger=CSVLogger(root, name="run", version=0))
    trainer.validate(model, loader(), verbose=False)
    log_dir = Path(root, "run", "version_0")
    curves = json.loads((log_dir / FIGURE_DIR / "rank_curves.json").read_text())
    with (log_dir / "metrics.csv").open(newline="") as file:
        rows = list(csv.DictReader(file))
    return curves, rows


class FrozenConvNet(ConvNet):
    """ConvNet trained with a zero learning rate: the weights stay as initialised, so a window's activations depend
    only on which batches it covers, and a DDP run can be compared with one process exactly."""

    def training_step(self, batch, batch_idx):
        return nn.functional.cross_entropy(self(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def train_dataloader(self):
        # In order, not shuffled (Lightning shuffles the training rows it deals out to DDP processes): process r reads
        # rows r, r + W, r + 2W, ..., so batch b of every process together holds rows b*W*B .. (b+1)*W*B - 1, which
        # is batch b of one process reading W*B rows at a time.
        data = loader().dataset
        world = self.trainer.world_size
        if world == 1:
            return torch.utils.data.DataLoader(data, batch_size=WORLD_SIZE * BATCH_SIZE)
        sampler = DistributedSampler(data, num_replicas=world, rank=self.global_rank, shuffle=False)
        return torch.utils.data.DataLoader(data, batch_size=BATCH_SIZE, sampler=sampler)


def _fitting_trainer(root: Path, devices: int, monitor: pl.Callback, **options: Any) -> pl.Trainer:
    """A one-epoch CPU Trainer with ``monitor`` and a CSV logger on ``devices`` spawned DDP processes (one: no DDP)."""
    # The side layer never reaches the loss: DDP must be told that some parameters get no gradient.
    strategy = "auto"
    if devices > 1:
        strategy = SpawnedDDP(timeout=timedelta(seconds=60), find_unused_parameters=True)
    return pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        logger=CSVLogger(root, name="run", version=0),
        callbacks=[monitor],
        max_epochs=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        **options,
    )


def fit_by_step(root: Path, devices: int) -> dict:
    """Fit one epoch with a step cadence on ``devices`` CPU processes; returns the curve file rank zero wrote.

    One process reads batches of ``WORLD_SIZE * BATCH_SIZE``: batch b holds exactly the rows that the DDP processes'
    batches b hold together (:meth:`FrozenConvNet.train_dataloader`), so the windows cover the same rows.
    """
    torch.manual_seed(0)
    model = FrozenConvNet()
    monitor = ActivationRankMonitor(
        layers=["conv", "act"], every_n_train_steps=2, window_batches=2, log_at_init=False, verbose=False
    )
    _fitting_trainer(root, devices, monitor, use_distributed_sampler=False).fit(model)
    return json.loads((Path(root, "run", "version_0") / FIGURE_DIR / "rank_train_curves.json").read_text())


class RaggedNet(ConvNet):
    """ConvNet with a token layer whose length differs between processes: (B, 3, 2) on the first, (B, 4, 2) on the
    second, as batches padded to their own longest sequence can be."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.act(self.fc(torch.relu(self.conv(x)).flatten(1)))
        self.tokens(hidden.view(-1, 4, 4)[:, : 3 + self.global_rank])
        return self.head(hidden)


def validate_ragged(root: Path, devices: int) -> dict:
    """The curve file of a validation of RaggedNet with the token layer flattened, on ``devices`` CPU processes."""
    torch.manual_seed(0)
    monitor = ActivationRankMonitor(layers=["act", "tokens"], token_reduction="flatten", verbose=False)
    trainer = _validating_trainer(devices, monitor, logger=False, default_root_dir=root)
    trainer.validate(RaggedNet(), loader(), verbose=False)
    return json.loads((Path(root) / FIGURE_DIR / "rank_curves.json").read_text())


# Odd: Lightning's DistributedSampler gives each of 2 processes 31 samples, the second process's last one a repeat of
# sample 0 (in the shuffled order, of the permutation's first).
UNEVEN_SAMPLES = 61


class UnevenNet(FrozenConvNet):
    """FrozenConvNet on loaders of UNEVEN_SAMPLES rows that Lightning deals out itself (a shuffled training loader):
    an epoch's sums cover the same rows, in any order, on one process and on two."""

    def train_dataloader(self):
        return loader(UNEVEN_SAMPLES, shuffle=True)

    def val_dataloader(self):
        return loader(UNEVEN_SAMPLES)


def fit_uneven(root: Path, devices: int, stage: str) -> dict:
    """Fit UnevenNet for one epoch with the monitor on ``stage`` every epoch (and at the initial point) on
    ``devices`` CPU processes; returns the curve file rank zero wrote."""
    torch.manual_seed(0)
    monitor = ActivationRankMonitor(layers=["conv", "act"], stage=stage, verbose=False)
    _fitting_trainer(root, devices, monitor).fit(UnevenNet())
    name = "rank_curves.json" if stage == "val" else "rank_train_curves.json"
    return json.loads((Path(root, "run", "version_0") / FIGURE_DIR / name).read_text())
