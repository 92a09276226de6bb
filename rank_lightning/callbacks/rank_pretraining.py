"""Rank-increasing pre-training (Daneshmand et al. Sec. 4, App. G, Alg. 1)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import pytorch_lightning as pl
import torch
from torch import Tensor
from typing_extensions import override

from rank_lightning.callbacks.base import RankCallback, TrainingBatches, repeated_layer_warner, step_inputs
from rank_lightning.functional.reductions import REDUCTIONS, reduce_activations
from rank_lightning.functional.spectral import participation_ratio
from rank_lightning.layers import (
    BatchReader,
    FeatureLayer,
    buffers_kept,
    capture_features,
    feature_layer,
    forward_batch,
    measuring_without_grad,
    module_blocks,
    train_mode,
)
from rank_lightning.nn import collect_auxiliary_losses
from rank_lightning.sampling import READABLE_ADVICE, UNREADABLE_LOADER, readable_beside
from rank_lightning.validation import check_bool, check_choice, check_positive, check_positive_int

__all__ = ["RankPretraining"]


class RankPretraining(RankCallback):
    """Gradient ascent on the rank lower bound ``r(H)`` of one layer before training (Daneshmand et al. App. G).

    Daneshmand et al. Alg. 1: for each of ``num_batches`` minibatches ``X_k`` of the training data, take ``steps``
    gradient-ascent steps on ``r(H_L(X_k)) = Tr(M)^2 / ||M||_F^2`` (their eq. 4, computed by
    :func:`~rank_lightning.functional.participation_ratio`) with respect to all parameters, then train normally. It
    runs once, in ``on_train_start`` (the training dataloader exists from then on), with its own SGD optimizer, so
    the module's optimizer and its state are left alone. The module is in training mode during the ascent. Under DDP
    the ascent gradients are averaged over ranks so that every rank keeps the same weights. Afterwards every
    submodule has its own train/eval flag back (a frozen BatchNorm stays frozen). An ascent step whose ``r(H)`` or
    gradient is NaN or Inf (a NaN in a layer before the target, or in the inputs) is skipped, with a warning that
    counts the skipped steps; the fit goes on.

    Deviations from the paper, on by default: the ascent's SGD has momentum (``momentum=0.9``; Alg. 1 takes plain
    gradient steps, ``momentum=0`` restores them), and each step moves along the gradient divided by its global norm
    (``normalize_gradient``). Through a deep vanilla network the gradient of ``r(H)`` spans orders of magnitude from
    one step to the next; with a fixed step size, plain SGD either barely moves or overshoots into dead ReLUs. On
    bias-free ReLU MLPs of depth 32 and width 128 with Gaussian inputs, the default 75 normalised steps raised
    ``r(H_L)`` from about 1.04 to 8-26, where plain SGD at any of the step sizes tried reached at most about 2.
    With biases and PyTorch's default initialisation the same networks map every input to one constant vector
    (``r = 1`` to machine precision); there the gradient of ``r(H)`` vanishes (about 1e-14) and no ascent helps.

    ``r(H)`` of every block is measured before and after, averaged over the same minibatches, without changing the
    weights or buffers (batch-norm running statistics are restored after measuring), and reported as a table
    (under DDP, the mean over every process's minibatches, so that every process reports the same numbers).

    Its measuring and ascent passes run in the parameters' own dtype, outside the autocast that a mixed-precision fit
    (``bf16-mixed``, ``16-mixed``) puts around its steps, so ``r(H)`` can differ slightly from its value under the
    steps' precision.

    Args:
        layer: the layer whose output ``H`` is pre-trained, in the syntax every callback accepts
            (:func:`~rank_lightning.layers.select_layers`: a block name, a module path or a glob pattern), matching
            exactly one module; default: the last block of ``pl_module.blocks()`` (the last hidden layer), else the
            input of the last ``nn.Linear``.
        num_batches: M, the number of minibatches (taken in order from the training dataloader, restarting it if it
            has fewer batches; a one-pass iterator, such as a generator, is refused with a ``ValueError``: its
            batches would be taken from the fit). With several training loaders (a list or dict), a minibatch is a
            step's batch of every loader (combined in the fit's ``CombinedLoader`` mode), their inputs concatenated
            in loader order.
        steps: T, gradient-ascent steps per minibatch (Daneshmand et al. Fig. 6: 25 or 75 iterations in total).
        lr: learning rate of the ascent. With ``normalize_gradient`` the gradient has unit norm, so a step is ``lr``
            long without momentum; with ``momentum`` the steps add up along a steady direction, to at most
            ``lr / (1 - momentum)`` (ten times ``lr`` at the default 0.9).
        momentum: momentum of the ascent's SGD.
        normalize_gradient: divide the gradient by its global l2 norm over all parameters before each step.
        reduction: how conv or token features become an (N, d) matrix (see
            :func:`~rank_lightning.functional.reduce_activations`).
        input_key: where the inputs are in a batch (:class:`~rank_lightning.layers.BatchReader`); ``None`` for
            ``batch[0]``, or the batch itself when it is a tensor, and for dict batches the rule of
            :func:`~rank_lightning.layers.forward_batch` (``forward(**entries)``, so that an ``attention_mask`` reaches
            the model, ``forward(batch)``, else the dict's ``x`` / ``image`` / ``input_ids`` ...).
        verbose: report the table of ``r(H)`` before and after (rank zero, at INFO level).

    Logged metrics:
        ``pretrain/<block>/r_before`` and ``pretrain/<block>/r_after``: mean ``r(H)`` of each block (and of the
        pre-trained layer) over the pre-training minibatches, sent to the loggers once at step ``trainer.global_step``.
        The values are also kept in :attr:`results` (``{block: {"r_before": ..., "r_after": ...}}``).

    Example::

        trainer = pl.Trainer(callbacks=[RankPretraining(num_batches=5, steps=15, lr=0.01)])
    """

    def __init__(
        self,
        *,
        layer: str | None = None,
        num_batches: int = 5,
        steps: int = 15,
        lr: float = 0.01,
        momentum: float = 0.9,
        normalize_gradient: bool = True,
        reduction: str = "flatten",
        input_key: int | str | None = None,
        verbose: bool = True,
    ) -> None:
        super().__init__(verbose=verbose)
        check_positive_int("num_batches", num_batches)
        check_positive_int("steps", steps)
        check_positive("lr", lr)
        if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0 <= momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {momentum!r}")
        if layer is not None and (not isinstance(layer, str) or not layer):
            raise ValueError(
                f"layer must be None or a layer name, path or glob pattern (a non-empty string), got {layer!r}"
            )
        self.layer = layer
        self.num_batches = num_batches
        self.steps = steps
        self.lr = lr
        self.momentum = momentum
        self.normalize_gradient = check_bool("normalize_gradient", normalize_gradient)
        self.reduction = check_choice("reduction", reduction, REDUCTIONS)
        self.reader = BatchReader(input_key)
        self._call: str | None = None  # how forward() takes a dict batch (layers.forward_batch)
        self.done = False
        self.results: dict[str, dict[str, float]] = {}

    @override
    def prepare(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Fail before any data is loaded if the layer does not exist.
        if stage == "fit":
            feature_layer(pl_module, self.layer)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.done:
            return
        target = feature_layer(pl_module, self.layer)
        monitored = [FeatureLayer(name, path) for name, path in (module_blocks(pl_module) or {}).items()]
        if target.name not in {layer.name for layer in monitored}:
            monitored.append(target)
        batches = self._batches(trainer)
        before = self._measure(trainer, pl_module, monitored, batches)
        self._ascend(trainer, pl_module, target, batches)
        after = self._measure(trainer, pl_module, monitored, batches)
        self.results = {name: {"r_before": before[name], "r_after": after[name]} for name in before}
        self.done = True
        metrics = {
            f"pretrain/{name}/{key}": value for name, values in self.results.items() for key, value in values.items()
        }
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
        rows = [f"{name:<32} {v['r_before']:>10.3f} {v['r_after']:>10.3f}" for name, v in self.results.items()]
        title = f"rank-increasing pre-training of {target.name!r}: r(H) per block"
        header = f"{'block':<32} {'before':>10} {'after':>10}"
        self.info("\n".join([title, header, *rows]))

    def _batches(self, trainer: pl.Trainer) -> list[Any]:
        """The first ``num_batches`` training batches, as the steps get them (on the module's device, cast by the
        precision plugin: bf16 / fp16 / float64 under ``"bf16-true"``, ``"16-true"``, ``"64-true"``); of a batch of
        several training loaders, their inputs concatenated in loader order
        (:class:`~rank_lightning.callbacks.base.TrainingBatches`)."""
        if trainer.train_dataloader is None:
            raise RuntimeError("RankPretraining needs a training dataloader")
        if not readable_beside(trainer.train_dataloader):
            raise ValueError(
                f"RankPretraining reads {self.num_batches} training batches before the fit, but the training loader "
                f"is {UNREADABLE_LOADER}: those batches would be taken from the fit. {READABLE_ADVICE}."
            )
        loader = TrainingBatches(trainer)
        batches: list[Any] = []
        while len(batches) < self.num_batches:
            start = len(batches)
            for batch in loader:
                batch = step_inputs(trainer, batch)
                if loader.combined:
                    batches.append(torch.cat([self.reader.inputs(part) for part in loader.parts(batch)]))
                else:
                    # Run as the steps run it (layers.forward_batch): a dict batch keeps its attention mask.
                    batches.append(batch)
                if len(batches) == self.num_batches:
                    break
            if len(batches) == start:
                raise RuntimeError("the training dataloader yielded no batch")
        return batches

    def _features(self, pl_module: pl.LightningModule, layers: Sequence[FeatureLayer], batch: Any) -> dict[str, Tensor]:
        """The features of ``layers`` on a batch of :meth:`_batches`: the inputs of several training loaders together,
        or one loader's batch run as the steps run it, a dict batch by its entries (Hugging Face style: its
        ``attention_mask`` too) when ``forward`` names them (:func:`~rank_lightning.layers.forward_batch`)."""
        with capture_features(pl_module, layers, on_repeat=repeated_layer_warner(self)) as captured:
            if isinstance(batch, Tensor):
                pl_module(batch)
            else:
                self._call = forward_batch(pl_module, batch, self.reader, self._call, ran=lambda: len(captured))
        return {name: reduce_activations(value, self.reduction) for name, value in captured.items()}

    def _measure(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, layers: Sequence[FeatureLayer], batches: Sequence[Any]
    ) -> dict[str, float]:
        """Mean ``r(H)`` of each layer over ``batches`` (and over the processes' batches under DDP, so that every
        process reports the same numbers), in training mode, leaving weights and buffers unchanged."""
        totals = dict.fromkeys((layer.name for layer in layers), 0.0)
        with measuring_without_grad(), train_mode(pl_module), buffers_kept(pl_module):
            for batch in batches:
                for name, features in self._features(pl_module, layers, batch).items():
                    totals[name] += float(participation_ratio(features))
        means = torch.tensor([total / len(batches) for total in totals.values()], dtype=torch.float64)
        if trainer.world_size > 1:
            means = trainer.strategy.reduce(means.to(pl_module.device), reduce_op="mean").cpu()
        return dict(zip(totals, means.tolist()))

    def _ascend(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, target: FeatureLayer, batches: Sequence[Any]
    ) -> None:
        """Daneshmand et al. Alg. 1: ``steps`` ascent steps on ``r(H_target)`` for each batch, in training mode."""
        parameters = [p for p in pl_module.parameters() if p.requires_grad]
        optimizer = torch.optim.SGD(parameters, lr=self.lr, momentum=self.momentum)
        skipped = 0
        with torch.enable_grad(), train_mode(pl_module):
            for batch in batches:
                for _ in range(self.steps):
                    optimizer.zero_grad(set_to_none=True)
                    features = self._features(pl_module, [target], batch)[target.name]
                    objective = participation_ratio(features)
                    if bool(torch.isfinite(objective)):
                        (-objective).backward()
                    else:
                        # A NaN or Inf in the features (a layer before the target holds one) gives a NaN r(H) with
                        # no gradient. NaN gradients for the parameters the features depend on, the ones a finite
                        # r(H) reaches: every DDP rank averages the same gradients, and all of them skip this step.
                        (features.sum() * math.nan).backward()
                    # The forward pass leaves the auxiliary losses of LR-Layers pending: dropped at once, since one
                    # left pending joins the next pass's and keeps that step's graph alive.
                    collect_auxiliary_losses(pl_module)
                    self._prepare_gradients(trainer, parameters)
                    if all(bool(torch.isfinite(p.grad).all()) for p in parameters if p.grad is not None):
                        optimizer.step()
                    else:
                        skipped += 1
        pl_module.zero_grad(set_to_none=True)
        if skipped:
            self.warn_once(
                ("nonfinite",),
                f"r(H) of {target.name!r} or its gradient was NaN or Inf at {skipped} of "
                f"{len(batches) * self.steps} ascent steps (a NaN or Inf in the network or the inputs); those steps "
                "were skipped, leaving the weights as they were",
            )

    def _prepare_gradients(self, trainer: pl.Trainer, parameters: Sequence[Tensor]) -> None:
        """Average the gradients over DDP ranks and, with ``normalize_gradient``, divide them by their global norm."""
        grads = [p for p in parameters if p.grad is not None]
        if trainer.world_size > 1:
            for p in grads:
                p.grad = trainer.strategy.reduce(p.grad, reduce_op="mean")
        if self.normalize_gradient:
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in grads]))
            if norm > 0:
                for p in grads:
                    p.grad.div_(norm)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"done": self.done, "results": self.results}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.done = bool(state_dict["done"])
        self.results = dict(state_dict.get("results", {}))
