"""Model, data and run of the ActivationRankMonitor DDP test.

Kept apart from the test module so that spawned workers import only torch, Lightning and rank_lightning.
"""

from __future__ import annotations

import csv
import json
from datetime import timedelta
from pathlib import Path

import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import CSVLogger
from pytorch_lightning.strategies import DDPStrategy
from torch import nn

from rank_lightning.callbacks import ActivationRankMonitor
from rank_lightning.callbacks.curves import FIGURE_DIR

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


def loader() -> torch.utils.data.DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(NUM_SAMPLES, 2, 6, 6, generator=generator)
    y = torch.randint(0, NUM_CLASSES, (NUM_SAMPLES,), generator=generator)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH_SIZE)


def validate(root: Path, devices: int) -> tuple[dict, list[dict[str, str]]]:
    """Validate on ``devices`` CPU processes; returns the curve file and the CSV rows rank zero wrote.

    ``trainer.validate`` rather than ``fit``: the monitor runs the same code in both, and ``fit`` would add the time of
    twenty figures drawn at its end.
    """
    torch.manual_seed(0)
    model = ConvNet()
    monitor = ActivationRankMonitor(layers=["conv", "act", "side"], max_samples=None, verbose=False)
    logger = CSVLogger(root, name="run", version=0)
    strategy = DDPStrategy(start_method="spawn", timeout=timedelta(seconds=60)) if devices > 1 else "auto"
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        logger=logger,
        callbacks=[monitor],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.validate(model, loader(), verbose=False)
    log_dir = Path(root, "run", "version_0")
    curves = json.loads((log_dir / FIGURE_DIR / "rank_curves.json").read_text())
    with (log_dir / "metrics.csv").open(newline="") as file:
        rows = list(csv.DictReader(file))
    return curves, rows
