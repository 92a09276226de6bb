"""A two-process fit killed inside an open step window and a monitored training epoch, and resumed from its
checkpoint, for the test that the resumed curves equal the uninterrupted ones.

Kept apart from the test module so that spawned workers import only torch, Lightning and rank_lightning.
"""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from torch.utils.data import TensorDataset

from rank_lightning.callbacks import ActivationRankMonitor
from tests.callbacks.trainer_helpers import ResumableBatches, SmallClassifier
from tests.spawned import SpawnedDDP

WORLD_SIZE = 2


class RankBatches(SmallClassifier):
    """:class:`SmallClassifier` whose process r reads 8 batches of 4 rows of its own (seeded by r), resumed where a
    checkpoint left them."""

    def train_dataloader(self) -> ResumableBatches:
        generator = torch.Generator().manual_seed(self.global_rank)
        x, y = torch.randn(32, 5, generator=generator), torch.randint(0, 3, (32,), generator=generator)
        return ResumableBatches(TensorDataset(x, y))


def fit_two_processes(root: Path, ckpt: Path | None = None) -> dict[str, Any]:
    """Fit two epochs (16 steps) on two CPU processes with a step-window monitor (every 4 steps, windows of 3 batches)
    and an epoch monitor of the training batches (``max_samples=20``), saving a checkpoint at steps 6 and 12 (inside
    the window of step 8 and epoch 0, the window of step 12 closed, epoch 1); returns the histories of both curve
    files rank zero wrote."""
    common = dict(layers=["net.0"], log_at_init=False, verbose=False)
    monitors = [
        ActivationRankMonitor(every_n_train_steps=4, window_batches=3, **common),
        ActivationRankMonitor(stage="train", namespace="rank_epoch", max_samples=20, **common),
    ]
    saving = ModelCheckpoint(dirpath=root, every_n_train_steps=6, save_top_k=-1, filename="{step}")
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=WORLD_SIZE,
        strategy=SpawnedDDP(timeout=timedelta(seconds=60)),
        callbacks=[*monitors, saving],
        max_epochs=2,
        default_root_dir=root,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(RankBatches(seed=0), ckpt_path=ckpt)
    files = {name: root / "rank_curves" / f"{name}_curves.json" for name in ("rank_train", "rank_epoch")}
    return {name: json.loads(path.read_text())["history"] for name, path in files.items()}
