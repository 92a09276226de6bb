"""The LR-Layer method of Sanyal et al. (Alg. 1, Sec. 4): switch the layers on, then project their weights to rank k
after every optimizer step."""

from __future__ import annotations

import math
from typing import Any

import pytorch_lightning as pl
import torch
from typing_extensions import override

from rank_lightning.callbacks.base import RankCallback
from rank_lightning.layers import eager_name
from rank_lightning.nn.lr_layer import lr_layers
from rank_lightning.validation import check_bool, check_finite, check_non_negative_int

__all__ = ["LowRankProjection"]


class LowRankProjection(RankCallback):
    """Switch the LR-Layers on and keep their weights at rank ``k`` (Sanyal et al. Alg. 1, Sec. 4).

    The model trains normally until the switch-on: the first epoch end at which ``trainer.callback_metrics[monitor]``
    reaches ``threshold`` (Sanyal et al.: 65% training accuracy), or the start of epoch ``switch_on_epoch``, whichever
    comes first; a fit that starts with an LR-Layer already on (weights saved after the switch-on, whose state dict
    keeps it) starts switched on. From then on every :class:`~rank_lightning.nn.LRLayer` computes its auxiliary loss
    (which the LightningModule adds to its loss with :func:`~rank_lightning.nn.collect_auxiliary_losses`), and after
    every optimizer step each layer's weight is projected, ``W_S <- Pi_k(W)``.

    The projection runs in ``on_train_batch_end``, the first hook after the optimizer step; ``on_before_zero_grad``
    would be too early, since Lightning zeroes gradients inside the step's closure, before ``backward``. A batch
    without a step (gradient accumulation) is recognised by an unchanged ``trainer.global_step`` and not projected.
    The Nyström column indices come from a generator seeded with ``seed + global_step``, identical on every DDP rank,
    so every rank projects its (identical) weights identically. A layer whose weight holds NaN or Inf is not
    projected (a warning names it once); the fit goes on.

    Args:
        threshold: value of ``monitor`` at which the layers are switched on; ``None`` to use only ``switch_on_epoch``.
            An accuracy is a fraction: ``0.65`` for Sanyal et al.'s 65% (a threshold above 1 for a ``monitor`` whose
            name contains ``acc`` is an error). A fit that ends with the layers still off warns, naming the
            highest value ``monitor`` reached.
        monitor: key of the training accuracy in ``trainer.callback_metrics`` (log it with ``on_epoch=True``).
        switch_on_epoch: epoch at whose start the layers are switched on; ``0`` trains with them from the start.
        seed: base seed of the Nyström column sampling.
        log_losses: log each layer's reconstruction and norm losses.
        verbose: report the switch-on (rank zero, at INFO level).

    Logged metrics:
        ``lr_layer/enabled``: 1 once the LR-Layers are on, else 0 (epoch value).
        ``lr_layer/<layer>/reconstruction``: ``1/n sum_i ||W^T (a_i + b) - (a_i + b)||^2`` of the layer named
        ``<layer>`` (its path in the LightningModule), unweighted, averaged over the epoch's batches.
        ``lr_layer/<layer>/norm``: ``1/n sum_i |1 - ||a_i|| |``, unweighted, averaged over the epoch's batches.

    Raises:
        ValueError: if both ``threshold`` and ``switch_on_epoch`` are ``None``, ``threshold`` is not a finite number
            or is above 1 for an accuracy, ``monitor`` is not a non-empty string, ``seed`` is not an integer, or at
            fit start if the model has no LR-Layer.

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
        verbose: bool = True,
    ) -> None:
        super().__init__(verbose=verbose)
        if threshold is None and switch_on_epoch is None:
            raise ValueError("LowRankProjection needs a threshold or a switch_on_epoch (or both); got neither")
        check_non_negative_int("switch_on_epoch", switch_on_epoch, allow_none=True)
        if not isinstance(monitor, str) or not monitor:
            raise ValueError(f"monitor must be the non-empty key of a logged metric, got {monitor!r}")
        # Checked here: the seed is first used at the first projection after switch-on, possibly hours into the fit.
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an integer, got {seed!r}")
        check_finite("threshold", threshold, allow_none=True)
        check_bool("log_losses", log_losses)
        if threshold is not None:
            if "acc" in monitor.lower() and not 0 <= threshold <= 1:
                hint = f"; did you mean {threshold / 100:g}?" if 1 < threshold <= 100 else ""
                raise ValueError(
                    f"threshold={threshold!r} for the accuracy {monitor!r}, which lies in [0, 1]: the layers would "
                    f"never switch on{hint}"
                )
        self.threshold = threshold
        self.monitor = monitor
        self.switch_on_epoch = switch_on_epoch
        self.seed = seed
        self.log_losses = log_losses
        self.enabled = False
        self.switched_on_epoch: int | None = None
        self._last_step: int | None = None
        self._highest: float | None = None

    @override
    def prepare(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and not lr_layers(pl_module):
            raise ValueError(
                f"{type(pl_module).__name__} contains no LRLayer; add one with rank_lightning.nn.insert_lr_layer"
            )

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        loaded_on = [name for name, layer in lr_layers(pl_module) if layer.enabled]
        if not self.enabled and loaded_on:
            # Weights saved after the switch-on (their state dict keeps it) continue with the layers on.
            self._switch_on(trainer, pl_module, f"the LR-Layers {loaded_on} were on in the model's weights")
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
        # Named without wrapper segments: a compiled network's LR-Layer has the keys of the uncompiled one.
        layers = [(eager_name(name), layer) for name, layer in lr_layers(pl_module)]
        stepped = trainer.global_step != self._last_step
        self._last_step = trainer.global_step
        if self.enabled and stepped:
            generator = torch.Generator().manual_seed(self.seed + trainer.global_step)
            for name, layer in layers:
                if not bool(torch.isfinite(layer.weight).all()):
                    # A NaN or Inf (an exploding step, a bad batch upstream) has no rank-k projection: the layer is
                    # left as it is and the fit goes on, as it would without the LR-Layer's projection.
                    self.warn_once(
                        ("nonfinite", name),
                        f"the weight of the LR-Layer {name!r} holds NaN or Inf values at step {trainer.global_step}; "
                        "its rank-k projection is skipped while they remain",
                    )
                    continue
                layer.project_(generator)
        uncollected = [name for name, layer in layers if layer.pop_auxiliary_loss() is not None]
        if uncollected:
            self.warn_once(
                ("uncollected",),
                f"the auxiliary losses of the LR-Layers {uncollected} were never collected: add "
                "rank_lightning.nn.collect_auxiliary_losses(self) to the loss in training_step",
            )
        pl_module.log("lr_layer/enabled", float(self.enabled), on_step=False, on_epoch=True)
        if self.enabled and self.log_losses:
            for name, layer in layers:
                for key, value in layer.last_losses.items():
                    # Each process's batches differ: the epoch's value is the mean over all processes (synchronised
                    # once, at the epoch's end), so every process holds and logs the same number.
                    pl_module.log(f"lr_layer/{name}/{key}", value, on_step=False, on_epoch=True, sync_dist=True)

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
        if trainer.world_size > 1:
            # A value logged without sync_dist differs between processes: the mean decides for all of them, so the
            # LR-Layers switch on together (and every process logs their losses, which are synchronised).
            local = torch.as_tensor(value, dtype=torch.float64, device=pl_module.device)
            value = trainer.strategy.reduce(local, reduce_op="mean")
        if math.isfinite(float(value)):
            self._highest = max(float(value), self._highest if self._highest is not None else -math.inf)
        if float(value) >= self.threshold:
            self._switch_on(trainer, pl_module, f"{self.monitor} = {float(value):.4f} >= {self.threshold}")

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.enabled or self.threshold is None or trainer.sanity_checking:
            return
        reached = "was never finite" if self._highest is None else f"reached at most {self._highest:.4g}"
        self.warn_once(
            ("never on",),
            f"the LR-Layers were never switched on: {self.monitor} {reached}, below the threshold "
            f"{self.threshold}; the fit trained without them",
        )

    def _switch_on(self, trainer: pl.Trainer, pl_module: pl.LightningModule, reason: str) -> None:
        self.enabled = True
        self.switched_on_epoch = trainer.current_epoch
        self._set_layers(pl_module)
        self.info(f"LR-Layers switched on at epoch {trainer.current_epoch} ({reason})")

    def _set_layers(self, pl_module: pl.LightningModule) -> None:
        for _, layer in lr_layers(pl_module):
            layer.enabled = self.enabled

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"enabled": self.enabled, "switched_on_epoch": self.switched_on_epoch, "highest": self._highest}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.enabled = bool(state_dict["enabled"])
        self.switched_on_epoch = state_dict.get("switched_on_epoch")
        # The highest value of the monitor so far: a resumed fit that ends with the layers off reports it for the
        # whole fit, not only for the epochs after the resume.
        self._highest = state_dict.get("highest")
