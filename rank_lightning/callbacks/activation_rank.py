"""Per-layer rank curves of activations, logged every few epochs by :class:`ActivationRankMonitor`."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from typing import Any, Literal

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from torch import Tensor, nn
from typing_extensions import override

from rank_lightning.callbacks.base import CurveMonitor
from rank_lightning.functional.reductions import CONV_REDUCTIONS, TOKEN_REDUCTIONS
from rank_lightning.layers import (
    BatchReader,
    FeatureLayer,
    check_layer_types,
    forward_hooks,
    module_blocks,
    select_layers,
)
from rank_lightning.metrics import ACTIVATION_METRICS, ActivationSpectrum
from rank_lightning.validation import check_choice, check_choices, check_names, check_positive_int

__all__ = ["ACTIVATION_METRICS", "STAGES", "ActivationRankMonitor"]

STAGES = ("val", "train")


class ActivationRankMonitor(CurveMonitor):
    """Log the rank of every monitored layer's activations: numerical, soft and effective rank, r(H), VR_k, TCV.

    Forward hooks stream each monitored layer's outputs into a float64
    :class:`~rank_lightning.metrics.ActivationSpectrum` (Gram and class sums), so one eigendecomposition per layer
    gives every metric, exactly for any number of samples, and DDP reduces the sums across processes: every process
    logs the same values as one process would. Works with any LightningModule, nothing to inherit; with the
    package's modules the default layers are the backbone's ``blocks()``; otherwise a choice is made and reported
    (see :func:`~rank_lightning.layers.default_layers`).

    Timing: with ``stage="val"``, during validation of every ``every_n_epochs``-th epoch of ``fit``
    (``(epoch + 1) % every_n_epochs == 0``) and of every ``trainer.validate`` run; with ``stage="train"``, over the
    training batches of those epochs (validation run in between is not measured). Sanity checks are skipped. Hooks
    exist only while an epoch is monitored and are removed afterwards. The curve file ``rank_curves.json`` (float64
    history) is rewritten every monitored epoch and the figures are drawn at the end of fit, both in
    ``<run dir>/rank_curves/`` (:class:`~rank_lightning.callbacks.curves.LayerCurves`); the history is saved in
    checkpoints, so a resumed run continues its curves.

    Activations of conv layers ``(B, C, H, W)`` and token layers ``(B, T, D)`` are reduced to a samples x features
    matrix by ``conv_reduction`` (``flatten``: C*H*W features; ``channel``: every position a sample with C features;
    ``mean``: global average pool) and ``token_reduction`` (``flatten``, ``token``, ``cls``, ``mean``); the
    reduction is part of the logged key of those layers. Token layers laid out sequence-first, ``(T, B, D)`` (the
    default of ``nn.Transformer``), are recognised by their second dimension being the batch size and read as
    ``(B, T, D)``; a layer whose output is of another kind is skipped with a warning.

    Non-finite activations never stop training: a layer that gives NaN or Inf in a monitored epoch logs NaN for every
    metric of that epoch, with a warning naming it; the other layers and later epochs are unaffected.

    Args:
        layers: block names (``pl_module.blocks()``), module names (``named_modules()``) or glob patterns (matched
            against both), the syntax of :mod:`rank_lightning.layers`; ``None`` picks the default layers.
        layer_types: keep only layers of these types (classes, class names or dotted import paths); without
            ``layers``, every module of these types.
        every_n_epochs: monitor every this many epochs.
        stage: ``"val"`` (validation batches) or ``"train"`` (training batches; keys under ``rank_train/``).
        max_samples: inputs per monitored epoch, the first ones seen; under DDP each of the W processes takes
            ``ceil(max_samples / W)`` of its own. ``None`` for all.
        conv_reduction: reduction of conv activations.
        token_reduction: reduction of token activations.
        metrics: which of ``ACTIVATION_METRICS`` to log.
        variance_ratio_ks: the ``k`` of the logged ``VR_k``.
        soft_rank_tau: threshold of the soft rank (Daneshmand et al. use 0.5 on BN-scaled features).
        rank_tolerance: relative tolerance of the numerical rank; ``None`` is ``finfo(float32).eps * K``.
        tolerance_size: ``K`` of the default tolerance: ``"min"`` (``min(N, d)``, Feng) or ``"max"`` (NumPy).
        center: compute the spectral metrics of centred activations (``X - 1 mu^T``) instead of ``X``.
        num_classes: number of classes of the labels; ``None`` reads ``pl_module.num_classes`` or the datamodule's
            ``num_classes``; class metrics are skipped without it.
        label_key: where the labels are in a batch: an index for tuples/lists, a key for dicts; ``None`` takes
            ``batch[1]`` or the first of ``y``, ``label``, ``labels``, ``target``, ``targets``.
        label_fn: a function ``batch -> labels`` overriding ``label_key``.
        log_per_class: also log the class-wise VR of every class, not only their mean.
        max_gram_features: largest d for the exact d x d Gram; wider layers use the subsample fallback of
            :class:`~rank_lightning.metrics.ActivationSpectrum` (a warning names the layer once).
        figures_every_n_epochs: also redraw the PNG figures after every this many monitored epochs (by default they
            are drawn once, at the end of fit and of ``trainer.validate``).
        verbose: report the monitored layers at setup (rank zero).

    Raises:
        ValueError: at construction for an invalid setting; at setup for a layer that does not exist (the message
            lists the valid names).

    Example::

        import pytorch_lightning as pl
        from rank_lightning.callbacks import ActivationRankMonitor

        trainer = pl.Trainer(max_epochs=20, callbacks=[ActivationRankMonitor(layers=["layer2", "layer4"])])
        trainer.fit(model, datamodule=datamodule)  # any LightningModule

    Logged metrics:
        For every monitored layer ``<layer>`` (block name or module name), with ``<r>/`` = ``<reduction>/`` for conv
        and token layers and empty for ``(B, d)`` layers, under ``rank/`` (``rank_train/`` with ``stage="train"``):

        * ``rank/<layer>/<r>numerical_rank``: ``#{i : s_i >= eps * s_1}`` (Feng et al. eq. 4).
        * ``rank/<layer>/<r>soft_rank``: ``#{i : s_i^2 / N >= tau}`` (Daneshmand et al. eq. 3).
        * ``rank/<layer>/<r>participation_ratio``: r(H) = ``(sum s_i^2)^2 / sum s_i^4`` (Daneshmand et al. eq. 4).
        * ``rank/<layer>/<r>stable_rank``: ``sum s_i^2 / s_1^2``.
        * ``rank/<layer>/<r>effective_rank``: ``exp(H(s / sum s))``.
        * ``rank/<layer>/<r>variance_ratio_<k>``: VR_k for each ``k`` in ``variance_ratio_ks`` (Sanyal et al. eq. 7).
        * ``rank/<layer>/<r>tcv`` and ``rank/<layer>/<r>tcv_normalized``: total cluster variation with the labels as
          partition, raw and divided by the total sum of squares (Zangrando et al. Def. 3.2).
        * ``rank/<layer>/<r>classwise_variance_ratio_<k>_mean``: mean over classes of the class-wise VR_k (Sanyal
          et al. Sec. 4.3); with ``log_per_class``, ``..._class_<c>`` for every class too.

        Class metrics need labels and ``num_classes``. Values pass through ``LightningModule.log``, which stores
        them in float32; the curve file keeps float64. With a ``WandbLogger``, also the charts
        ``rank_curves/<r><metric>_vs_epoch`` and ``rank_curves/<r><metric>_vs_depth`` and the table
        ``rank_curves/layers`` (``rank_train_curves/`` with ``stage="train"``); the charts hold the whole history
        and are sent after the first monitored epoch, every fifth one and at the end of fit.
    """

    def __init__(
        self,
        *,
        layers: Sequence[str] | None = None,
        layer_types: Sequence[type[nn.Module] | str] | None = None,
        every_n_epochs: int = 1,
        stage: Literal["val", "train"] = "val",
        max_samples: int | None = 4096,
        conv_reduction: str = "channel",
        token_reduction: str = "token",
        metrics: Sequence[str] = ACTIVATION_METRICS,
        variance_ratio_ks: Sequence[int] = (1, 10),
        soft_rank_tau: float = 0.5,
        rank_tolerance: float | None = None,
        tolerance_size: Literal["min", "max"] = "min",
        center: bool = False,
        num_classes: int | None = None,
        label_key: int | str | None = None,
        label_fn: Callable[[Any], Tensor] | None = None,
        log_per_class: bool = False,
        max_gram_features: int = 4096,
        figures_every_n_epochs: int | None = None,
        verbose: bool = True,
    ) -> None:
        stage = check_choice("stage", stage, STAGES)
        namespace = "rank" if stage == "val" else "rank_train"
        super().__init__(
            namespace, every_n_epochs=every_n_epochs, figures_every_n_epochs=figures_every_n_epochs, verbose=verbose
        )
        for name, value in (("max_samples", max_samples), ("num_classes", num_classes)):
            check_positive_int(name, value, allow_none=True)
        self.layers = check_names("layers", layers)
        self.layer_types = None if layer_types is None else check_layer_types(layer_types)
        self.stage, self.max_samples, self.num_classes = stage, max_samples, num_classes
        conv = check_choice("conv_reduction", conv_reduction, CONV_REDUCTIONS)
        self.reductions = {4: conv, 3: check_choice("token_reduction", token_reduction, TOKEN_REDUCTIONS)}
        self.metrics = check_choices("metrics", metrics, ACTIVATION_METRICS)
        self.center, self.log_per_class = center, log_per_class
        self.batch_reader = BatchReader(label_key=label_key, label_fn=label_fn)
        self.spectrum_options: dict[str, Any] = {
            "center": center,
            "variance_ratio_ks": tuple(variance_ratio_ks),
            "soft_rank_tau": soft_rank_tau,
            "rank_tolerance": rank_tolerance,
            "tolerance_size": tolerance_size,
            "classwise": "classwise_variance_ratio" in self.metrics,
            "max_gram_features": max_gram_features,
        }
        ActivationSpectrum(num_classes=num_classes, **self.spectrum_options)  # checks the settings now
        self._init_state()

    def _init_state(self) -> None:
        # Filled at setup (layers, classes) and in monitored epochs (one metric per layer, hooks).
        self._layers: dict[str, str] = {}
        self._num_classes: int | None = None
        self._metrics: dict[str, ActivationSpectrum] = {}
        self._layer_reductions: dict[str, str | None] = {}
        self._hooks = ExitStack()
        self._clear_stream()

    def _clear_stream(self) -> None:
        self._active = self._in_batch = False
        self._remaining: int | None = None
        self._batch: int | None = None
        self._take: int | None = None
        self._labels: Tensor | None = None
        self._seen_this_batch: set[str] = set()

    @property
    @override
    def state_key(self) -> str:
        # A list, as before layers became a tuple: checkpoints saved then still find their state.
        return self._generate_state_key(layers=None if self.layers is None else list(self.layers), stage=self.stage)

    @property
    def monitored(self) -> dict[str, str]:
        """``logged name -> module path`` of the monitored layers, in depth order (empty before setup)."""
        return dict(self._layers)

    def select(self, module: nn.Module) -> dict[str, str]:
        """Resolve ``layers`` and ``layer_types`` against ``module``; returns ``logged name -> module path``.

        Raises:
            ValueError: a name or pattern that matches no layer (the message lists the valid names).
        """
        self._layers = select_layers(module, self.layers, self.layer_types)
        return self.monitored

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.select(pl_module)
        self._num_classes = self.num_classes or _num_classes_of(pl_module, trainer)
        names = ", ".join(name if name == path else f"{name} ({path})" for name, path in self._layers.items())
        classes = f"{self._num_classes} classes" if self._num_classes else "no class metrics (num_classes unknown)"
        how = ""
        if self.layers is None and self.layer_types is None and module_blocks(pl_module) is None:
            how = " (default choice: the module has no blocks(); pass layers=[...] to choose)"
        self.info(f"monitoring {len(self._layers)} layers{how}, {classes}: {names}")

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._stop()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._stop()

    # -- when ---------------------------------------------------------------------------------------------------

    def _monitoring(self, stage: str) -> bool:
        return self._active and self.stage == stage

    @override
    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.stage == "val" and self.due(trainer):
            self._start(trainer, pl_module)

    @override
    def on_validation_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if self._monitoring("val"):
            self._batch_start(batch)

    @override
    def on_validation_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        # Forward passes made by other callbacks between batches (attacks, Jacobians) are not validation data.
        if self._monitoring("val"):
            self._take = 0

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._monitoring("val"):
            self._finish(trainer, pl_module)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.stage == "train" and self.due(trainer):
            self._start(trainer, pl_module)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._monitoring("train"):
            self._batch_start(batch)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._monitoring("train"):
            self._take = 0

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._monitoring("train"):
            self._finish(trainer, pl_module)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Validation interrupts a monitored training epoch: its forward passes must not reach the training metrics.
        if self._monitoring("train"):
            self._in_batch = False

    # -- an epoch's stream --------------------------------------------------------------------------------------

    def _start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # An epoch cut short by an exception may have left partial sums behind.
        self._stop()
        for metric in self._metrics.values():
            metric.reset()
        self._remaining = None if self.max_samples is None else math.ceil(self.max_samples / max(trainer.world_size, 1))
        layers = [FeatureLayer(name, path) for name, path in self._layers.items()]
        self._hooks.enter_context(forward_hooks(pl_module, layers, self._hook))
        self._active = True

    def _stop(self) -> None:
        self._hooks.close()
        self._clear_stream()

    def _batch_start(self, batch: Any) -> None:
        self._labels = self.batch_reader.labels(batch) if self._num_classes else None
        self._batch = BatchReader.batch_size(batch)
        if self._batch is None and self._labels is not None:
            self._batch = self._labels.shape[0]
        self._take = None
        self._seen_this_batch = set()
        self._in_batch = True

    def _claim(self, size: int) -> int:
        """Rows of the current batch to measure; the first monitored layer to run decides for all of them."""
        if self._take is None:
            self._take = size if self._remaining is None else max(0, min(size, self._remaining))
            if self._remaining is not None:
                self._remaining -= self._take
        return self._take

    def _hook(self, layer: FeatureLayer, output: Any) -> None:
        name = layer.name
        if not self._in_batch:
            return
        if name in self._seen_this_batch:
            # A module called twice per forward (a shared ReLU) would mix two representations.
            message = "runs more than once per forward pass; only its first call is measured. Monitor a module that "
            self._warn_layer(name, "reuse", message + "runs once instead.")
            return
        self._seen_this_batch.add(name)
        activations = output[0] if isinstance(output, (tuple, list)) and output else output
        if not isinstance(activations, Tensor) or activations.ndim not in (2, 3, 4):
            shape = tuple(activations.shape) if isinstance(activations, Tensor) else type(activations).__name__
            message = "not (B, d) features, (B, T, D) tokens or (B, C, H, W) conv maps; it is skipped."
            self._warn_layer(name, "shape", f"gives {shape}, {message}")
            return
        activations = self._batch_first(name, activations.detach())
        take = 0 if activations is None else self._claim(activations.shape[0])
        if take:
            labels = None if self._labels is None else self._labels[:take].to(activations.device)
            self._metric_for(name, activations).update(activations[:take], labels)

    def _batch_first(self, name: str, activations: Tensor) -> Tensor | None:
        batch = self._batch
        if batch is None or activations.shape[0] == batch:
            return activations
        if activations.ndim == 3 and activations.shape[1] == batch:
            # Sequence-first tokens (T, B, D), the default layout of nn.Transformer and nn.MultiheadAttention.
            return activations.transpose(0, 1)
        shape = tuple(activations.shape)
        self._warn_layer(
            name, "batch", f"gives {shape}, with no leading dimension of the batch size {batch}; it is skipped."
        )
        return None

    def _warn_layer(self, name: str, kind: str, message: str) -> None:
        self.warn_once((name, kind), f"layer {name!r} {message}")

    def _metric_for(self, name: str, activations: Tensor) -> ActivationSpectrum:
        metric = self._metrics.get(name)
        if metric is None:
            reduction = self.reductions.get(activations.ndim)
            self._layer_reductions[name] = reduction
            metric = ActivationSpectrum(
                num_classes=self._num_classes, reduction=reduction or "flatten", **self.spectrum_options
            ).to(activations.device)
            self._metrics[name] = metric
        return metric

    # -- the epoch's values -------------------------------------------------------------------------------------

    def _finish(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._stop()
        values = {name: self._values_of(name, trainer.current_epoch) for name in self._measured_everywhere(pl_module)}
        for metric in self._metrics.values():
            metric.reset()
        if values:
            self.curves.record_and_log(trainer, pl_module, values)

    def _measured_everywhere(self, pl_module: pl.LightningModule) -> list[str]:
        """The layers that every process measured this epoch: ``compute()`` is a collective all of them must join."""
        counts = torch.tensor(
            [self._metrics[name].update_count if name in self._metrics else 0 for name in self._layers],
            dtype=torch.int64,
            device=pl_module.device,
        )
        fewest, most = counts, counts
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # One all-reduce gives both the minimum and (negated) the maximum over processes.
            both = torch.cat([counts, -counts])
            dist.all_reduce(both, op=dist.ReduceOp.MIN)
            fewest, most = both[: len(counts)], -both[len(counts) :]
        measured = []
        for name, low, high in zip(self._layers, fewest.tolist(), most.tolist()):
            if low > 0:
                measured.append(name)
            elif high > 0:
                message = "ran on some processes only in a monitored epoch; it is not logged for such epochs."
                self._warn_layer(name, "unmeasured", message)
        return measured

    def _values_of(self, name: str, epoch: int) -> dict[str, float]:
        metric = self._metrics[name]
        with warnings.catch_warnings():
            # Replaced below by a warning that names the layer.
            warnings.filterwarnings("ignore", message="ActivationSpectrum: .*NaN or Inf", category=RuntimeWarning)
            result = metric.compute()
        if result.num_nonfinite_batches:
            warnings.warn(
                f"ActivationRankMonitor: layer {name!r} gave NaN or Inf activations in {result.num_nonfinite_batches} "
                f"batch(es) at epoch {epoch}; its metrics are logged as NaN for that epoch.",
                RuntimeWarning,
                stacklevel=2,
            )
        if result.path != "gram":
            message = f"has {result.num_features} features, more than max_gram_features={metric.max_gram_features}; "
            path = f"its spectrum comes from the {result.path!r} path ({result.num_spectrum_samples} rows)."
            self._warn_layer(name, "path", message + path)
        reduction = self._layer_reductions.get(name)
        prefix = f"{reduction}/" if reduction else ""
        scalars = result.scalars(self.metrics, centered=self.center, per_class=self.log_per_class)
        return {f"{prefix}{key}": value for key, value in scalars.items()}


def _num_classes_of(pl_module: nn.Module, trainer: pl.Trainer) -> int | None:
    for source in (pl_module, getattr(trainer, "datamodule", None)):
        value = getattr(source, "num_classes", None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None
