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
from torch import nn

from rank_lightning.callbacks import (
    ActivationRankMonitor,
    ClassificationDimension,
    LowDimensionalEvaluation,
    LowRankProjection,
    NeuralCollapseMonitor,
    RankPretraining,
)
from rank_lightning.functional.neural_collapse import NC_METRICS
from rank_lightning.nn import LRLayer, collect_auxiliary_losses, insert_lr_layer
from tests.spawned import SpawnedDDP

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

    def __init__(self, val_samples: int = VAL_SAMPLES, second_val_samples: int | None = None) -> None:
        super().__init__()
        self.val_samples, self.second_val_samples = val_samples, second_val_samples
        self.inputs = nn.Identity()
        self.body = nn.Sequential(nn.Linear(6, 16), nn.ReLU())
        self.head = nn.Linear(16, NUM_CLASSES)
        # For the activation monitor: full-rank outputs (4 < 5 inputs) of the features without the index column. The
        # zero singular values of a rank-deficient layer come out of a float64 Gram as rounding noise that depends on
        # the order of the sums (README), and the index column would make its spectrum span orders of magnitude.
        self.probe = nn.Linear(5, 4).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inputs(x)
        self.probe(x[:, 1:])
        return self.head(self.body(x))

    def training_step(self, batch, batch_idx):
        return nn.functional.cross_entropy(self(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        self.log("val/loss", nn.functional.cross_entropy(self(batch[0]), batch[1]), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def train_dataloader(self):
        return _loader(TRAIN_SAMPLES, 1, shuffle=True)

    def val_dataloader(self):
        first = _loader(self.val_samples, 2, shuffle=False)
        return first if self.second_val_samples is None else [first, _loader(self.second_val_samples, 3, shuffle=False)]


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

    def __init__(self, directory: str, neural: Any, clsdim: Any, lowdim: Any, activations: Any) -> None:
        self.directory, self.neural, self.clsdim, self.lowdim = directory, neural, clsdim, lowdim
        self.activations = activations

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
            "activations": {str(epoch): values for epoch, values in self.activations.curves.history.items()},
        }
        Path(self.directory, f"rank{trainer.global_rank}.json").write_text(json.dumps(values))


def _fit_and_read(
    model: pl.LightningModule, root: Path, devices: int, callbacks: list[pl.Callback], epochs: int = 1
) -> list[dict]:
    """Fit ``model`` for ``epochs`` on ``devices`` spawned CPU processes (one: no DDP); the file each process's saving
    callback wrote."""
    strategy = SpawnedDDP(timeout=timedelta(seconds=60)) if devices > 1 else "auto"
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        callbacks=callbacks,
        max_epochs=epochs,
        logger=False,
        default_root_dir=root,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(model)
    return [json.loads((root / f"rank{rank}.json").read_text()) for rank in range(devices)]


def fit(
    root: Path,
    devices: int,
    val_samples: int = VAL_SAMPLES,
    max_samples: int | None = None,
    second_val_samples: int | None = None,
) -> dict:
    """Fit FrozenMLP for one epoch on ``val_samples`` validation samples (and a second validation loader of
    ``second_val_samples``) with the activation monitor (at the initial point and after the epoch), neural collapse,
    the classification dimension (those three measuring at most ``max_samples``) and the low-dimensional evaluation on
    ``devices`` CPU processes; what rank 0 computed."""
    torch.manual_seed(0)
    root.mkdir(parents=True, exist_ok=True)
    activations = ActivationRankMonitor(layers=["probe"], max_samples=max_samples, verbose=False)
    neural = NeuralCollapseMonitor(head="head", max_samples=max_samples, verbose=False)
    clsdim = ClassificationDimension(head="head", max_samples=max_samples, verbose=False)
    lowdim = RecordingLowDimensionalEvaluation(dims=(2,), layer="inputs", verbose=False)
    callbacks = [activations, neural, clsdim, lowdim, _Save(str(root), neural, clsdim, lowdim, activations)]
    ranks = _fit_and_read(FrozenMLP(val_samples, second_val_samples), root, devices, callbacks)
    assert all(dict(values, clsdim=None) == dict(ranks[0], clsdim=None) for values in ranks), "the processes disagree"
    return ranks[0]


class LowRankMLP(pl.LightningModule):
    """An MLP with an LR-Layer before its head, trained with a zero learning rate (one process and two hold the same
    weights)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, NUM_CLASSES))
        insert_lr_layer(self.net, "2", LRLayer(16, 2, projection="exact"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        # An accuracy logged without sync_dist that differs between the processes (1 on the first, 0 on the others).
        self.log("train/acc", float(self.global_rank == 0), on_step=False, on_epoch=True)
        return nn.functional.cross_entropy(self(batch[0]), batch[1]) + collect_auxiliary_losses(self)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def train_dataloader(self):
        return _loader(64, 1, shuffle=False)


class _SaveMethods(pl.Callback):
    """At the end of the fit, writes the pre-training table and the LR-Layer's logged losses, as every process holds
    them."""

    def __init__(self, directory: str, pretraining: Any) -> None:
        self.directory, self.pretraining = directory, pretraining

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        losses = {key: float(value) for key, value in trainer.callback_metrics.items() if key.startswith("lr_layer/")}
        values = {"pretraining": self.pretraining.results, "lr_layer": losses}
        Path(self.directory, f"rank{trainer.global_rank}.json").write_text(json.dumps(values))


def fit_methods(root: Path, devices: int) -> dict:
    """Fit LowRankMLP for one epoch with RankPretraining and LowRankProjection on ``devices`` CPU processes; what
    rank 0 reported, after checking that every process reports the same."""
    torch.manual_seed(0)
    root.mkdir(parents=True, exist_ok=True)
    pretraining = RankPretraining(layer="net.1", num_batches=2, steps=1, verbose=False)
    # Switched on by the mean accuracy (0.5 on two processes) after the first epoch, on every process at once.
    projection = LowRankProjection(threshold=0.4, verbose=False)
    callbacks = [pretraining, projection, _SaveMethods(str(root), pretraining)]
    ranks = _fit_and_read(LowRankMLP(), root, devices, callbacks, epochs=2)
    assert all(values == ranks[0] for values in ranks), f"the processes disagree: {ranks}"
    return ranks[0]
