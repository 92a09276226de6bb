"""Pieces the callback tests share: a quiet CPU trainer of either Lightning package, a small classifier and its data,
and a one-thread torch."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

QUIET_OPTIONS: dict[str, Any] = dict(
    accelerator="cpu",
    devices=1,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
)


def quiet_trainer(callbacks: list, trainer_cls: type = pl.Trainer, **kwargs: Any) -> Any:
    """A ``trainer_cls`` (``pytorch_lightning`` or ``lightning.pytorch`` Trainer) on one CPU with no logger,
    checkpoints, progress bar or model summary; ``kwargs`` add options or override these."""
    return trainer_cls(callbacks=callbacks, **(QUIET_OPTIONS | kwargs))


@contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """Runs the block with ``count`` intra-op threads, then restores the previous number."""
    threads = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class SmallClassifier(pl.LightningModule):
    """``net``: Linear layers of the given widths with ReLUs between them (``net.0``, ``net.1``, ...), trained by SGD on
    cross-entropy. The steps call ``net`` itself, so a subclass may drop ``forward``."""

    def __init__(
        self,
        widths: tuple[int, ...] = (5, 12, 3),
        lr: float = 0.1,
        *,
        activation: type[nn.Module] = nn.ReLU,
        seed: int | None = None,
    ) -> None:
        super().__init__()
        if seed is not None:
            torch.manual_seed(seed)
        layers: list[nn.Module] = []
        for fan_in, fan_out in itertools.pairwise(widths):
            layers += [nn.Linear(fan_in, fan_out), activation()]
        self.net = nn.Sequential(*layers[:-1])
        self.lr = lr
        self.num_classes = widths[-1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return nn.functional.cross_entropy(self.net(batch[0]), batch[1])

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.net(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def small_data(rows: int = 32, features: int = 5, classes: int = 3, seed: int = 0) -> TensorDataset:
    """Seeded Gaussian inputs and random labels."""
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(rows, features, generator=g), torch.randint(0, classes, (rows,), generator=g))


def small_loader(rows: int = 32, features: int = 5, *, batch_size: int = 8, seed: int = 0) -> DataLoader:
    """:func:`small_data` in batches, in order."""
    return DataLoader(small_data(rows, features, seed=seed), batch_size=batch_size)


class TrainBatches(pl.Callback):
    """Our own record of every training batch, in order: its ``index`` and ``labels``, the ``step`` before it and the
    ``step_after`` it (``global_step``), and the ``output`` of the model's ``net[0]`` in its training forward pass."""

    def __init__(self) -> None:
        self.batches: list[dict[str, Any]] = []
        self._handle: Any = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        def hook(_module: nn.Module, _args: Any, output: torch.Tensor) -> None:
            if pl_module.training and self.batches and "output" not in self.batches[-1]:
                self.batches[-1]["output"] = output.detach().double().clone()

        self._handle = pl_module.net[0].register_forward_hook(hook)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        self.batches.append({"step": trainer.global_step, "index": idx, "labels": batch[1].clone()})

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        self.batches[-1]["step_after"] = trainer.global_step

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._handle.remove()

    def window(self, step: int, size: int) -> list[int]:
        """The numbers of the ``size`` batches up to the one after which Lightning took optimizer step ``step``."""
        last = next(i for i, b in enumerate(self.batches) if b["step_after"] == step)
        return list(range(last - size + 1, last + 1))


class KillAtStep(pl.Callback):
    """Raises at the start of the first batch after optimizer step ``step`` (``None``: never): a job preempted after
    the checkpoint of that step, to be resumed from it."""

    def __init__(self, step: int | None) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError("killed")


class ResumableBatches:
    """The batches of ``data`` (``batch_size`` rows each), resumed where a checkpoint left them, as Lightning resumes
    any iterable with ``state_dict``."""

    def __init__(self, data: Any, batch_size: int = 4) -> None:
        self.batches, self.position, self.start = list(DataLoader(data, batch_size=batch_size)), 0, 0

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Any:
        self.position, self.start = self.start, 0
        while self.position < len(self.batches):
            self.position += 1
            yield self.batches[self.position - 1]

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.start = state["position"]
