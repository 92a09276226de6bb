"""Models, data and runs of the tests that grouped and depthwise conv spectra, step windows under manual optimization,
the appended curve points and peft LoRA layers give on two processes the numbers of one.

Kept apart from the test module so that spawned workers import only torch, Lightning and rank_lightning (and peft,
for the LoRA run).
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
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from rank_lightning.callbacks import ActivationRankMonitor, WeightRankMonitor
from rank_lightning.callbacks.curves import FIGURE_DIR, read_curve_file
from tests.spawned import SpawnedDDP

WORLD_SIZE = 2
BATCH_SIZE = 8
NUM_CLASSES = 3
CURVES = ("rank_train_curves", "weight_curves")


def _loader(module: pl.LightningModule, data: TensorDataset) -> DataLoader:
    """One process reads ``WORLD_SIZE * BATCH_SIZE`` rows per batch in order; process r of a DDP run reads rows r,
    r + W, ...: batch b of every process together holds the rows of batch b of one process."""
    world = module.trainer.world_size
    if world == 1:
        return DataLoader(data, batch_size=WORLD_SIZE * BATCH_SIZE)
    sampler = DistributedSampler(data, num_replicas=world, rank=module.global_rank, shuffle=False)
    return DataLoader(data, batch_size=BATCH_SIZE, sampler=sampler)


class GroupedConvNet(pl.LightningModule):
    """A grouped and a depthwise conv, then a linear head, trained in float64 by manual optimization: SGD stepped
    after every 2nd batch (the gradients of both batches summed)."""

    def __init__(self, num_samples: int) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.num_samples, self.num_classes = num_samples, NUM_CLASSES
        self.grouped = nn.Conv2d(4, 6, 3, groups=2)
        self.depthwise = nn.Conv2d(6, 6, 3, groups=6, padding=1)
        self.act = nn.Tanh()
        self.head = nn.Linear(6 * 3 * 3, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act(self.depthwise(torch.tanh(self.grouped(x)))).flatten(1))

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        self.manual_backward(nn.functional.cross_entropy(self(batch[0]), batch[1]))
        if (batch_idx + 1) % 2 == 0:
            optimizer.step()
            optimizer.zero_grad()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(0)
        y = torch.arange(self.num_samples) % NUM_CLASSES
        x = torch.randn(self.num_samples, 4, 5, 5, generator=generator, dtype=torch.float64)
        x[:, 0] += y.view(-1, 1, 1)
        return _loader(self, TensorDataset(x, y))


class CurveSnapshot(pl.Callback):
    """At the end of training (before ``on_fit_end`` rewrites the curve files whole) every rank writes to
    ``snapshot_rank<r>.json`` what :func:`read_curve_file` reads and the ``.jsonl`` files beside the curve files."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def on_train_end(self, trainer, pl_module):
        trainer.strategy.barrier()  # rank zero has written its last point
        directory = Path(trainer.log_dir) / FIGURE_DIR
        snapshot = {
            "curves": {name: _as_text(read_curve_file(directory / f"{name}.json")) for name in CURVES},
            "appended": {name: json.loads((directory / f"{name}.json").read_text()).get("appended") for name in CURVES},
            "jsonl": sorted(path.name for path in self.root.rglob("*.jsonl")),
        }
        (self.root / f"snapshot_rank{trainer.global_rank}.json").write_text(json.dumps(snapshot))
        trainer.strategy.barrier()


def _as_text(content: dict[str, Any]) -> dict[str, Any]:
    return {**content, "history": {str(k): v for k, v in content["history"].items()}}


def _trainer(root: Path, devices: int, callbacks: list[pl.Callback], **options: Any) -> pl.Trainer:
    strategy = SpawnedDDP(timeout=timedelta(seconds=60)) if devices > 1 else "auto"
    return pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        precision="64-true",
        logger=CSVLogger(root, name="run", version=0),
        callbacks=callbacks,
        use_distributed_sampler=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        **options,
    )


def _results(root: Path, devices: int, names: tuple[str, ...]) -> dict[str, Any]:
    log_dir = Path(root, "run", "version_0")
    with (log_dir / "metrics.csv").open(newline="") as file:
        rows = list(csv.DictReader(file))
    curves = {name: _as_text(read_curve_file(log_dir / FIGURE_DIR / f"{name}.json")) for name in names}
    snapshots = {r: json.loads(Path(root, f"snapshot_rank{r}.json").read_text()) for r in range(devices)}
    return {
        "rows": rows,
        "curves": curves,
        "snapshots": snapshots,
        "jsonl": sorted(p.name for p in root.rglob("*.jsonl")),
    }


def fit_grouped_manual(root: Path, devices: int, num_samples: int = 96) -> dict[str, Any]:
    """Fit GroupedConvNet for one epoch (6 batches, 3 optimizer steps) with an activation monitor on windows of 2
    batches every 2 steps and a weight monitor every step; the CSV rows, the curve files read after the fit and the
    snapshots taken before the fit's end."""
    torch.manual_seed(0)
    activations = ActivationRankMonitor(
        layers=["grouped", "act"], every_n_train_steps=2, window_batches=2, max_samples=None, verbose=False
    )
    weights = WeightRankMonitor(layers=["grouped", "depthwise", "head"], every_n_train_steps=1, verbose=False)
    trainer = _trainer(root, devices, [activations, weights, CurveSnapshot(root)], max_epochs=1)
    trainer.fit(GroupedConvNet(num_samples))
    return _results(root, devices, CURVES)


class LoraLanguageModel(pl.LightningModule):
    """A tiny GPT-2 (no dropout) with peft LoRA adapters on ``c_attn`` and ``c_proj``, trained in float64 by SGD."""

    def __init__(self) -> None:
        super().__init__()
        import peft
        from transformers import GPT2Config, GPT2LMHeadModel

        torch.manual_seed(0)
        config = GPT2Config(
            n_layer=2,
            n_embd=16,
            n_head=2,
            vocab_size=40,
            n_positions=8,
            bos_token_id=0,
            eos_token_id=0,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
        settings = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": ["c_attn", "c_proj"]}
        self.model = peft.get_peft_model(GPT2LMHeadModel(config), peft.LoraConfig(fan_in_fan_out=True, **settings))

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch[0], labels=batch[0]).loss

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=1.0)

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(0)
        return _loader(self, TensorDataset(torch.randint(0, 40, (4 * WORLD_SIZE * BATCH_SIZE, 8), generator=generator)))


def fit_lora(root: Path, devices: int) -> dict[str, Any]:
    """Fit LoraLanguageModel for 3 steps with a weight monitor every step; the CSV rows and the weight curve file."""
    torch.manual_seed(0)
    weights = WeightRankMonitor(every_n_train_steps=1, verbose=False)
    trainer = _trainer(root, devices, [weights], max_steps=3)
    trainer.fit(LoraLanguageModel())
    log_dir = Path(root, "run", "version_0")
    with (log_dir / "metrics.csv").open(newline="") as file:
        rows = list(csv.DictReader(file))
    return {"rows": rows, "weight_curves": _as_text(read_curve_file(log_dir / FIGURE_DIR / "weight_curves.json"))}
