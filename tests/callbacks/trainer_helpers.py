"""Pieces the callback tests share: a quiet CPU trainer of either Lightning package, and a one-thread torch."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytorch_lightning as pl
import torch

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
