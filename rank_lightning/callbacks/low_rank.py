"""Callbacks of the LR-Layer method (Sanyal et al.): the rank projection after every optimizer step with its switch-on,
and the low-dimensional-embedding evaluation of Sec. 4.4."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor
from typing_extensions import override

from rank_lightning.callbacks.rank_pretraining import capture_features, select_feature_layer
from rank_lightning.functional.embedding import low_dimensional_accuracy
from rank_lightning.functional.reductions import REDUCTIONS, reduce_activations
from rank_lightning.nn.lr_layer import lr_layers

__all__ = ["LowDimensionalEvaluation", "LowRankProjection"]


class LowRankProjection(pl.Callback):
    """Switch the LR-Layers on and keep their weights at rank ``k`` (Sanyal et al. Alg. 1, Sec. 4).

    The model trains normally until the switch-on: the first epoch end at which ``trainer.callback_metrics[monitor]``
    reaches ``threshold`` (Sanyal et al.: 65% training accuracy), or the start of epoch ``switch_on_epoch``, whichever
    comes first. From then on every :class:`~rank_lightning.nn.LRLayer` computes its auxiliary loss (which the
    LightningModule adds to its loss with :func:`~rank_lightning.nn.collect_auxiliary_losses`), and after every
    optimizer step each layer's weight is projected, ``W_S <- Pi_k(W)``.

    The projection runs in ``on_train_batch_end``, the first hook after the optimizer step; ``on_before_zero_grad``
    would be too early, since Lightning zeroes gradients inside the step's closure, before ``backward``. A batch
    without a step (gradient accumulation) is recognised by an unchanged ``trainer.global_step`` and not projected.
    The Nyström column indices come from a generator seeded with ``seed + global_step``, identical on every DDP rank,
    so every rank projects its (identical) weights identically.

    Args:
        threshold: value of ``monitor`` at which the layers are switched on; ``None`` to use only ``switch_on_epoch``.
        monitor: key of the training accuracy in ``trainer.callback_metrics`` (log it with ``on_epoch=True``).
        switch_on_epoch: epoch at whose start the layers are switched on; ``0`` trains with them from the start.
        seed: base seed of the Nyström column sampling.
        log_losses: log each layer's reconstruction and norm losses.

    Logged metrics:
        ``lr_layer/enabled``: 1 once the LR-Layers are on, else 0 (epoch value).
        ``lr_layer/<layer>/reconstruction``: ``1/n sum_i ||W^T (a_i + b) - (a_i + b)||^2`` of the layer named
        ``<layer>`` (its path in the LightningModule), unweighted, averaged over the epoch's batches.
        ``lr_layer/<layer>/norm``: ``1/n sum_i |1 - ||a_i|| |``, unweighted, averaged over the epoch's batches.

    Raises:
        ValueError: if both ``threshold`` and ``switch_on_epoch`` are ``None``, or at fit start if the model has no
            LR-Layer.

    Example::

        insert_lr_layer(model.backbone, before="head", layer=LRLayer(128, rank=10))
        trainer = pl.Trainer(callbacks=[LowRankProjection(threshold=0.65, monitor="train/acc")])
    """

    def __init__(
        self,
        *,
        threshold: float | None = 0.65,
        monitor: str = "train/acc",
        switch_on_epoch: int | None = None,
        seed: int = 0,
        log_losses: bool = True,
    ) -> None:
        if threshold is None and switch_on_epoch is None:
            raise ValueError("LowRankProjection needs a threshold or a switch_on_epoch (or both); got neither")
        if switch_on_epoch is not None and (
            isinstance(switch_on_epoch, bool) or not isinstance(switch_on_epoch, int) or switch_on_epoch < 0
        ):
            raise ValueError(f"switch_on_epoch must be a non-negative integer or None, got {switch_on_epoch!r}")
        self.threshold = threshold
        self.monitor = monitor
        self.switch_on_epoch = switch_on_epoch
        self.seed = seed
        self.log_losses = log_losses
        self.enabled = False
        self.switched_on_epoch: int | None = None
        self._last_step: int | None = None
        self._warned_uncollected = False

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and not lr_layers(pl_module):
            raise ValueError(
                f"{type(pl_module).__name__} contains no LRLayer; add one with rank_lightning.nn.insert_lr_layer"
            )

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._set_layers(pl_module)
        self._last_step = trainer.global_step

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.enabled and self.switch_on_epoch is not None and trainer.current_epoch >= self.switch_on_epoch:
            self._switch_on(trainer, pl_module, f"epoch {trainer.current_epoch} reached")

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        layers = lr_layers(pl_module)
        stepped = trainer.global_step != self._last_step
        self._last_step = trainer.global_step
        if self.enabled and stepped:
            generator = torch.Generator().manual_seed(self.seed + trainer.global_step)
            for _, layer in layers:
                layer.project_(generator)
        uncollected = [name for name, layer in layers if layer.auxiliary_loss() is not None]
        if uncollected and not self._warned_uncollected:
            rank_zero_warn(
                f"the auxiliary losses of the LR-Layers {uncollected} were never collected: add "
                "rank_lightning.nn.collect_auxiliary_losses(self) to the loss in training_step"
            )
            self._warned_uncollected = True
        pl_module.log("lr_layer/enabled", float(self.enabled), on_step=False, on_epoch=True)
        if self.enabled and self.log_losses:
            for name, layer in layers:
                for key, value in layer.last_losses.items():
                    pl_module.log(f"lr_layer/{name}/{key}", value, on_step=False, on_epoch=True)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.enabled or self.threshold is None:
            return
        value = trainer.callback_metrics.get(self.monitor)
        if value is None:
            available = ", ".join(sorted(trainer.callback_metrics)) or "none"
            raise RuntimeError(
                f"LowRankProjection monitors {self.monitor!r}, which was not logged this epoch; "
                f"logged metrics are: {available}"
            )
        if float(value) >= self.threshold:
            self._switch_on(trainer, pl_module, f"{self.monitor} = {float(value):.4f} >= {self.threshold}")

    def _switch_on(self, trainer: pl.Trainer, pl_module: pl.LightningModule, reason: str) -> None:
        self.enabled = True
        self.switched_on_epoch = trainer.current_epoch
        self._set_layers(pl_module)
        rank_zero_info(f"LR-Layers switched on at epoch {trainer.current_epoch} ({reason})")

    def _set_layers(self, pl_module: pl.LightningModule) -> None:
        for _, layer in lr_layers(pl_module):
            layer.enabled = self.enabled

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"enabled": self.enabled, "switched_on_epoch": self.switched_on_epoch}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.enabled = bool(state_dict["enabled"])
        self.switched_on_epoch = state_dict.get("switched_on_epoch")


class LowDimensionalEvaluation(pl.Callback):
    """Accuracy of a linear max-margin classifier on PCA embeddings of one layer's features (Sanyal et al. Sec. 4.4).

    Features of ``layer`` are collected, in eval mode and without gradients, on the training data and on the first
    validation dataloader; :func:`~rank_lightning.functional.low_dimensional_accuracy` fits PCA and the classifier on
    the training features and scores the validation features for each dimension in ``dims``. It runs at the end of
    fit and, with ``every_n_epochs``, after every n-th validation epoch. Under DDP the features of all ranks are
    gathered first (every rank needs the same number of batches, which Lightning's distributed sampler ensures), so
    every rank computes and logs the same numbers.

    Args:
        dims: embedding dimensions ``m'``; dimensions above ``min(N, d)`` of the collected training features are
            skipped with a warning.
        layer: block name or submodule path whose output is read; default: the last block of ``pl_module.blocks()``,
            else the input of the last ``nn.Linear`` (the embeddings fed to the head, as in the paper).
        every_n_epochs: also evaluate after every n-th validation epoch; ``None`` for the end of fit only.
        max_batches: at most this many batches per dataloader (all by default).
        reduction: how conv or token features become an (N, d) matrix (``"flatten"`` is Sanyal et al.'s choice).

    Logged metrics:
        ``lowdim/acc@<m>``: validation accuracy of the classifier on ``m``-dimensional embeddings. Logged with
        ``pl_module.log`` after validation epochs, and sent to the loggers directly at the end of fit (where
        ``self.log`` is not allowed). The latest values are kept in :attr:`results` (``{m: accuracy}``).

    Example::

        trainer = pl.Trainer(callbacks=[LowDimensionalEvaluation(dims=(2, 5, 10, 20))])
    """

    def __init__(
        self,
        *,
        dims: Sequence[int] = (2, 5, 10, 20, 50),
        layer: str | None = None,
        every_n_epochs: int | None = None,
        max_batches: int | None = None,
        reduction: str = "flatten",
    ) -> None:
        if not dims or any(isinstance(m, bool) or not isinstance(m, int) or m < 1 for m in dims):
            raise ValueError(f"dims must be a non-empty sequence of positive integers, got {dims!r}")
        for name, value in (("every_n_epochs", every_n_epochs), ("max_batches", max_batches)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        if reduction not in REDUCTIONS:
            raise ValueError(f"unknown reduction {reduction!r}; valid choices are {REDUCTIONS}")
        self.dims = tuple(dims)
        self.layer = layer
        self.every_n_epochs = every_n_epochs
        self.max_batches = max_batches
        self.reduction = reduction
        self.results: dict[int, float] = {}

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            select_feature_layer(pl_module, self.layer)

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.every_n_epochs is None or trainer.sanity_checking:
            return
        if (trainer.current_epoch + 1) % self.every_n_epochs != 0:
            return
        for dim, accuracy in self._evaluate(trainer, pl_module).items():
            pl_module.log(f"lowdim/acc@{dim}", accuracy, on_step=False, on_epoch=True)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        results = self._evaluate(trainer, pl_module)
        if not results:
            return
        for logger in trainer.loggers:
            logger.log_metrics({f"lowdim/acc@{dim}": acc for dim, acc in results.items()}, step=trainer.global_step)
        rows = "\n".join(f"{dim:>6} {acc:>8.4f}" for dim, acc in results.items())
        rank_zero_info(f"low-dimensional embedding accuracy (validation)\n{'dim':>6} {'accuracy':>8}\n{rows}")

    def _evaluate(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[int, float]:
        val_loaders = trainer.val_dataloaders
        if isinstance(val_loaders, (list, tuple)):
            val_loaders = val_loaders[0] if val_loaders else None
        if trainer.train_dataloader is None or val_loaders is None:
            rank_zero_warn("LowDimensionalEvaluation needs training and validation data; nothing evaluated")
            return {}
        train_x, train_y = self._collect(trainer, pl_module, trainer.train_dataloader)
        val_x, val_y = self._collect(trainer, pl_module, val_loaders)
        max_dim = min(train_x.shape)
        dims = [m for m in self.dims if m <= max_dim]
        if len(dims) < len(self.dims):
            skipped = [m for m in self.dims if m > max_dim]
            rank_zero_warn(f"dims {skipped} exceed min(N, d) = {max_dim} of the collected features; skipped")
        if not dims:
            return {}
        self.results = low_dimensional_accuracy(train_x, train_y, val_x, val_y, dims)
        return self.results

    def _collect(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loader: Any) -> tuple[Tensor, Tensor]:
        layer = select_feature_layer(pl_module, self.layer)
        was_training = pl_module.training
        pl_module.eval()
        features, labels = [], []
        with torch.no_grad(), capture_features(pl_module, [layer]) as captured:
            for index, batch in enumerate(loader):
                if self.max_batches is not None and index >= self.max_batches:
                    break
                batch = trainer.strategy.batch_to_device(batch)
                pl_module(batch[0])
                features.append(reduce_activations(captured[layer.name], self.reduction).float())
                labels.append(batch[1])
        pl_module.train(was_training)
        x, y = torch.cat(features), torch.cat(labels)
        if trainer.world_size > 1:
            x = pl_module.all_gather(x).reshape(-1, x.shape[1])
            y = pl_module.all_gather(y).reshape(-1)
        return x.cpu(), y.cpu()
