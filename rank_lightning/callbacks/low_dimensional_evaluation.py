"""The low-dimensional-embedding evaluation of Sanyal et al. (Sec. 4.4): a linear classifier on PCA embeddings of one
layer's features."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import pytorch_lightning as pl
import torch
from torch import Tensor
from typing_extensions import override

from rank_lightning.callbacks.base import (
    Cadence,
    RankCallback,
    gather_rows,
    loader_list,
    repeated_layer_warner,
    step_inputs,
    val_loaders,
)
from rank_lightning.functional.embedding import low_dimensional_accuracy
from rank_lightning.functional.reductions import REDUCTIONS, reduce_activations, token_mask
from rank_lightning.layers import (
    BatchReader,
    FeatureLayer,
    capture_features,
    check_label_rows,
    eval_mode,
    feature_layer,
    forward_batch,
    random_state_kept,
)
from rank_lightning.sampling import (
    READABLE_ADVICE,
    UNREADABLE_LOADER,
    limit_to_own_samples,
    readable_beside,
    side_loader,
)
from rank_lightning.validation import check_choice, check_positive_int, check_positive_ints

__all__ = ["LowDimensionalEvaluation"]

# The reductions that give one row per input, which is what the classifier is trained and scored on.
SAMPLE_REDUCTIONS: tuple[str, ...] = tuple(name for name in REDUCTIONS if name not in ("channel", "token"))


class LowDimensionalEvaluation(RankCallback):
    """Accuracy of a linear max-margin classifier on PCA embeddings of one layer's features (Sanyal et al. Sec. 4.4).

    Features of ``layer`` are collected, in eval mode and without gradients, on the training data (the samples of every
    training loader, when there are several) and on the validation dataloaders (the samples of several are pooled:
    scored together, with a warning);
    :func:`~rank_lightning.functional.low_dimensional_accuracy` fits PCA and the classifier on the training features
    and scores the validation features for each dimension in ``dims``. Afterwards every
    submodule has its own train/eval flag back (a frozen BatchNorm in a training model stays frozen). It runs at the
    end of fit and, with ``every_n_epochs``, after every n-th validation epoch of fit
    (:class:`~rank_lightning.callbacks.base.Cadence`). Under DDP the features of all ranks are gathered first (every
    rank needs the same number of batches, which Lightning's distributed sampler ensures), so every rank computes and
    logs the same numbers. A training loader that a pass of its own would take the fit's batches from (a one-pass
    iterator such as a generator, or a resumable iterable that is not a ``DataLoader``:
    :func:`~rank_lightning.sampling.readable_beside`) is never read: a warning says so and nothing is evaluated.

    Its passes over the data run in the parameters' own dtype, outside the autocast that a mixed-precision fit
    (``bf16-mixed``, ``16-mixed``) puts around its steps, so their accuracies can differ slightly from the
    validation steps'.

    Args:
        dims: embedding dimensions ``m'``; dimensions above ``min(N, d)`` of the collected training features are
            skipped with a warning.
        layer: the layer whose output is read, in the syntax every callback accepts
            (:func:`~rank_lightning.layers.select_layers`: a block name, a module path or a glob pattern), matching
            exactly one module; default: the last block of ``pl_module.blocks()``, else the input of the last
            ``nn.Linear`` (the embeddings fed to the head, as in the paper).
        every_n_epochs: also evaluate after every n-th validation epoch; ``None`` for the end of fit only.
        max_batches: at most this many batches per dataloader (all by default).
        reduction: how conv or token features become one embedding per input: ``"flatten"`` (Sanyal et al.'s
            choice), ``"mean"``, ``"cls"`` or ``"last"`` (``"channel"`` and ``"token"``, one row per position, are
            refused). Token features leave out the padding of a dict batch's ``attention_mask``: ``"mean"`` averages
            the real tokens, ``"last"`` takes each input's last real token, ``"flatten"`` zeroes the padded positions.
        input_key: where the inputs are in a batch (:class:`~rank_lightning.layers.BatchReader`); ``None`` for
            ``batch[0]``, and for dict batches the rule of :func:`~rank_lightning.layers.forward_batch`
            (``forward(**entries)``, ``forward(batch)``, else the dict's ``x`` / ``image`` / ``input_ids`` ...).
        label_key: where the integer labels are in a batch; ``None`` for ``batch[1]`` or the usual keys of a dict.
        label_fn: ``batch -> labels``, overriding ``label_key`` (e.g. the hard labels kept beside mixup's soft targets).
        verbose: report the accuracies at the end of fit (rank zero, at INFO level).

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
        input_key: int | str | None = None,
        label_key: int | str | None = None,
        label_fn: Callable[[Any], Any] | None = None,
        verbose: bool = True,
    ) -> None:
        super().__init__(verbose=verbose)
        self.dims = check_positive_ints("dims", dims)
        check_positive_int("max_batches", max_batches, allow_none=True)
        if layer is not None and (not isinstance(layer, str) or not layer):
            raise ValueError(f"layer must be None or a non-empty block or module name, got {layer!r}")
        self.layer = layer
        self.every_n_epochs = every_n_epochs
        self.cadence = Cadence(every_n_epochs, on_validate=False)
        self.max_batches = max_batches
        if reduction in REDUCTIONS and reduction not in SAMPLE_REDUCTIONS:
            # "channel" and "token" give several rows per input, which the labels (one per input) do not match.
            raise ValueError(
                f"reduction {reduction!r} gives one row per position or token, but the classifier is trained on one "
                f"embedding per input; valid choices are: {', '.join(SAMPLE_REDUCTIONS)}"
            )
        self.reduction = check_choice("reduction", reduction, SAMPLE_REDUCTIONS)
        self.reader = BatchReader(input_key, label_key, label_fn)
        self.results: dict[int, float] = {}
        self._layer: FeatureLayer | None = None

    @override
    def prepare(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Resolved before any data is loaded, so that a wrong name fails at once.
        if stage == "fit":
            self._layer = feature_layer(pl_module, self.layer)

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.cadence.due(trainer):
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
        self.info(f"low-dimensional embedding accuracy (validation)\n{'dim':>6} {'accuracy':>8}\n{rows}")

    def _evaluate(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[int, float]:
        loaders = val_loaders(trainer)
        if trainer.train_dataloader is None or not loaders:
            self.warn_once(("no data",), "needs training and validation data; nothing evaluated")
            return {}
        if not readable_beside(trainer.train_dataloader):
            message = (
                f"the training loader is {UNREADABLE_LOADER}: a pass of its own would take the fit's batches, so "
                f"nothing evaluated. {READABLE_ADVICE}."
            )
            self.warn_once(("one-pass",), message)
            return {}
        pooled = "their samples are pooled into one scored set (the features of every loader together, max_batches "
        pooled += "of each)"
        self.warn_pooled_loaders(len(loaders), "validation", pooled)
        # The loaders' iterators draw seeds (and scikit-learn may draw from NumPy's): the fit's random stream stays
        # that of the unmonitored fit.
        with random_state_kept(pl_module, [trainer.train_dataloader, *loaders]):
            return self._evaluate_kept(trainer, pl_module, loaders)

    def _evaluate_kept(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loaders: list[Any]
    ) -> dict[int, float]:
        # Its own pass beside the training loop's (a validation inside an epoch interrupts it).
        # Several training loaders (a list or dict): their samples together, max_batches of each.
        training = [side_loader(loader) for loader in loader_list(trainer.train_dataloader)]
        fitted = [self._collect(trainer, pl_module, loader) for loader in training]
        train_x, train_y = torch.cat([x for x, _ in fitted]), torch.cat([y for _, y in fitted])
        scored = [self._collect(trainer, pl_module, loader) for loader in loaders]
        val_x, val_y = torch.cat([x for x, _ in scored]), torch.cat([y for _, y in scored])
        max_dim = min(train_x.shape)
        dims = [m for m in self.dims if m <= max_dim]
        skipped = [m for m in self.dims if m > max_dim]
        if skipped:
            self.warn_once(
                ("skipped", *map(str, skipped)),
                f"dims {skipped} exceed min(N, d) = {max_dim} of the collected features; skipped",
            )
        if not dims:
            return {}
        self.results = low_dimensional_accuracy(train_x, train_y, val_x, val_y, dims)
        return self.results

    def _rows(self, activations: Tensor, batch: Any, targets: Tensor) -> tuple[Tensor, Tensor]:
        """One embedding per input, and the labels of those kept. Tokens ``(B, T, D)`` leave out the padded positions of
        the batch's attention mask (:meth:`~rank_lightning.layers.BatchReader.mask`, when it is ``(B, T)``):
        ``"mean"`` averages the real tokens and ``"last"`` takes the last real one (an input without one is dropped,
        with its label), ``"flatten"`` zeroes the padded positions, ``"cls"`` takes the first token."""
        mask = self.reader.mask(batch) if activations.ndim == 3 else None
        if mask is None or tuple(mask.shape) != tuple(activations.shape[:2]):
            return reduce_activations(activations, self.reduction), targets
        mask = mask.to(activations.device)
        rows = reduce_activations(activations, self.reduction, mask=mask)
        if self.reduction in ("mean", "last"):
            targets = targets[token_mask(mask).any(dim=1).to(targets.device)]
        return rows, targets

    def _collect(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loader: Any) -> tuple[Tensor, Tensor]:
        """``(features (N, d), labels (N,))`` of ``loader``, gathered from every rank, on the CPU."""
        layer = self._layer or feature_layer(pl_module, self.layer)
        features, labels = [], []
        # The samples a DistributedSampler repeats at the end of a process's pass are taken once.
        left = limit_to_own_samples(None, loader)
        call: str | None = None  # how forward() takes a dict batch, learnt at the first one
        with (
            torch.no_grad(),
            eval_mode(pl_module),
            capture_features(pl_module, [layer], on_repeat=repeated_layer_warner(self)) as captured,
        ):
            for index, batch in enumerate(loader):
                # A process with nothing left to take still runs one batch: its (0, d) features join the gather.
                if (self.max_batches is not None and index >= self.max_batches) or (left == 0 and features):
                    break
                batch = step_inputs(trainer, batch)
                targets = cast(Tensor, self.reader.labels(batch, required=True))
                # As the steps pass it: a dict batch by its entries (Hugging Face style), by itself, or its inputs.
                captured.pop(layer.name, None)
                call = forward_batch(pl_module, batch, self.reader, call, ran=lambda: layer.name in captured)
                check_label_rows(targets, captured[layer.name].shape[0], f"the features of {layer.path!r}")
                rows, targets = self._rows(captured[layer.name], batch, targets)
                take = targets.shape[0] if left is None else min(targets.shape[0], left)
                features.append(rows[:take].float())
                labels.append(targets[:take])
                left = None if left is None else left - take
        x, y = torch.cat(features), torch.cat(labels)
        # A process may have one sample fewer than another.
        return gather_rows(pl_module, trainer, x).cpu(), gather_rows(pl_module, trainer, y).cpu()
