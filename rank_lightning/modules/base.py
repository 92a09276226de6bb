"""Behaviour shared by the package's LightningModules: optimiser set-up and the named blocks."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn

from rank_lightning.modules.optim import (
    build_optimizer,
    build_scheduler,
    check_optimizer_settings,
    check_scheduler_settings,
)
from rank_lightning.sampling import combined_parts
from rank_lightning.validation import check_positive, check_positive_ints


def _same_input(ours: tuple[int, ...], theirs: tuple[int, ...]) -> bool:
    """Equal shapes, or a flat vector of as many values as the other shape (an MLP flattens its inputs)."""
    return ours == theirs or ((len(ours) == 1 or len(theirs) == 1) and math.prod(ours) == math.prod(theirs))


class RankModule(pl.LightningModule):
    """A LightningModule whose network lives in ``self.backbone`` and exposes named blocks.

    Args:
        optimizer: ``sgd``, ``adam`` or ``adamw``.
        lr: learning rate.
        weight_decay: weight decay of the decayed parameter group.
        momentum: SGD momentum.
        decay_norm_and_bias: also decay biases and normalisation parameters (off by default).
        scheduler: ``none``, ``cosine`` (over ``trainer.max_epochs``), ``step`` or ``multistep``.
        step_size, milestones, gamma: settings of the ``step`` / ``multistep`` schedules (in epochs).
    """

    backbone: nn.Module

    def __init__(
        self,
        *,
        optimizer: str = "sgd",
        lr: float = 0.1,
        weight_decay: float = 0.0,
        momentum: float = 0.9,
        decay_norm_and_bias: bool = False,
        scheduler: str = "none",
        step_size: int = 30,
        milestones: tuple[int, ...] = (),
        gamma: float = 0.1,
    ) -> None:
        super().__init__()
        # Fail at construction, not at the first optimizer step.
        check_optimizer_settings(optimizer, lr, weight_decay, momentum, decay_norm_and_bias)
        check_scheduler_settings(scheduler, step_size, milestones, gamma)
        milestones = check_positive_ints("milestones", milestones, allow_empty=True)
        self._optim_settings = dict(
            name=optimizer, lr=lr, weight_decay=weight_decay, momentum=momentum, decay_norm_and_bias=decay_norm_and_bias
        )
        self._sched_settings = dict(name=scheduler, step_size=step_size, milestones=tuple(milestones), gamma=gamma)

    @property
    def lr(self) -> float:
        """The learning rate :meth:`configure_optimizers` builds the optimizer with. Setting it, as Lightning's
        learning-rate finder does with its suggestion (``Tuner.lr_find``, which also sets ``hparams.lr``), sets the
        learning rate of the fits that follow.

        Raises:
            ValueError: on setting a value that is not a positive number.
        """
        return self._optim_settings["lr"]

    @lr.setter
    def lr(self, value: float) -> None:
        self._optim_settings["lr"] = check_positive("lr", value)

    def setup(self, stage: str) -> None:
        """Compare the settings that describe the data with the trainer's datamodule, if it has them.

        Raises:
            ValueError: the module's ``num_classes`` or ``input_shape`` differs from the datamodule's (the fit
                would stop at the first batch with a shape or target error that names neither).
        """
        data = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        for name in ("num_classes", "input_shape"):
            ours, theirs = getattr(self, name, None), getattr(data, name, None)
            if ours is None or theirs is None:
                continue
            same = _same_input(tuple(ours), tuple(theirs)) if name == "input_shape" else ours == theirs
            if not same:
                raise ValueError(
                    f"{type(self).__name__} has {name}={ours!r} but {type(data).__name__} gives {name}={theirs!r}; "
                    f"build the module with the datamodule's {name} (the CLI links it)"
                )

    def training_batch(self, batch: Any) -> Any:
        """A training batch as one loader's: of several training loaders (a list or dict, which Lightning combines
        into a list or dict of per-loader batches), the tensors of every loader at each position (``x``, ``y``, ...)
        concatenated in loader order (without the loaders a ``"max_size"`` batch has none of), so that a step trains
        on all their rows; one loader's batch as it is."""
        loaders = self.trainer.train_dataloader if self._trainer is not None else None
        if not isinstance(loaders, (Mapping, list, tuple)):
            return batch
        parts = combined_parts(loaders, batch)
        return [torch.cat(column) for column in zip(*parts, strict=False)]

    def blocks(self) -> dict[str, str]:
        """The backbone's blocks (``short name -> submodule path``), with paths relative to this module."""
        return {name: f"backbone.{path}" for name, path in self.backbone.blocks().items()}

    def configure_optimizers(self) -> Any:
        optimizer = build_optimizer(self, **self._optim_settings)
        max_epochs = self.trainer.max_epochs if self._trainer is not None else None
        scheduler = build_scheduler(optimizer, max_epochs=max_epochs, **self._sched_settings)
        if scheduler is None:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "epoch"}}
