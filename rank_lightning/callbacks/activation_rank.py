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

from rank_lightning.callbacks.base import CurveMonitor, first_val_loader
from rank_lightning.functional.reductions import CONV_REDUCTIONS, TOKEN_REDUCTIONS
from rank_lightning.layers import (
    BatchReader,
    FeatureLayer,
    buffers_kept,
    check_layer_types,
    declared_batch_first,
    eval_mode,
    forward_hooks,
    module_blocks,
    select_layers,
    train_mode,
)
from rank_lightning.metrics import ACTIVATION_METRICS, ActivationSpectrum
from rank_lightning.validation import check_choice, check_choices, check_names, check_positive_int

__all__ = ["ACTIVATION_METRICS", "STAGES", "TOKEN_LAYOUTS", "ActivationRankMonitor"]

STAGES = ("val", "train")
TOKEN_LAYOUTS = ("auto", "batch_first", "sequence_first")


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
    default of ``nn.Transformer``), are read as ``(B, T, D)``: the layout comes from ``token_layout``, else from the
    ``batch_first`` flag of the layer or its nearest ancestor
    (:func:`~rank_lightning.layers.declared_batch_first`), else from a batch whose shape tells it (the batch size in
    exactly one leading dimension); a batch whose shape cannot tell (``T == B``,
    e.g. a last partial batch) is skipped with a warning, never guessed. A layer whose output is of another kind is
    skipped with a warning, and so is, by name, every chosen layer that is not called in the forward pass of the
    first monitored batch (a ``ModuleList`` or ``ModuleDict`` is never called itself: name its children).

    Initial point: with ``log_at_init`` (default), a fresh ``fit`` measures the untrained model before the first
    training step, over one pass of the first validation loader (``stage="val"``, eval mode) or the first training
    batches up to ``max_samples`` (``stage="train"``, training mode with BatchNorm statistics restored), calling the
    module's ``forward`` on the inputs of each batch (``input_key``). It is recorded as epoch ``-1`` and sent to the
    loggers at step 0.

    Non-finite activations never stop training: a layer that gives NaN or Inf in a monitored epoch logs NaN for every
    metric of that epoch, with a warning naming it; the other layers and later epochs are unaffected.

    Args:
        layers: block names (``pl_module.blocks()``), module names (``named_modules()``) or glob patterns (matched
            against both), the syntax of :mod:`rank_lightning.layers`; ``None`` picks the default layers.
        layer_types: keep only layers of these types (classes, class names or dotted import paths); without
            ``layers``, every module of these types.
        every_n_epochs: monitor every this many epochs.
        stage: ``"val"`` (validation batches) or ``"train"`` (training batches; keys under ``rank_train/``).
        max_samples: inputs per monitored epoch, spread evenly over the epoch's batches (the first rows of every
            batch), so that a loader sorted by class still gives rows of every class; a warning names the classes
            that got no row. Under DDP each of the W processes takes ``ceil(max_samples / W)`` of its own. ``None``
            for all.
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
            ``batch[1]`` or the first of ``y``, ``label``, ``labels``, ``target``, ``targets``. One-hot labels are
            read as their argmax. An explicit ``label_key`` that finds no labels raises at the first batch; the
            default lookup finding none gives a warning saying where it looked, and no class metrics.
        label_fn: a function ``batch -> labels`` overriding ``label_key``.
        log_per_class: also log the class-wise VR of every class, not only their mean.
        max_gram_features: largest d for the exact d x d Gram; wider layers use the subsample fallback of
            :class:`~rank_lightning.metrics.ActivationSpectrum` (a warning names the layer once).
        token_layout: ``"auto"`` (see above), ``"batch_first"`` or ``"sequence_first"``: the layout of every
            monitored ``(., ., D)`` token output.
        input_key: where the inputs are in a batch, for the initial point (an index or a key; ``None``:
            ``batch[0]`` or the first of ``x``, ``input``, ``inputs``, ``image``, ``images``, ``pixel_values``,
            ``input_ids``).
        log_at_init: measure the untrained model at the start of a fresh ``fit`` (see above).
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
        them in float32; the curve file keeps float64. The initial point (``log_at_init``) logs the same keys with
        ``epoch = -1`` at step 0, straight to the loggers. With a ``WandbLogger``, also the charts
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
        token_layout: Literal["auto", "batch_first", "sequence_first"] = "auto",
        input_key: int | str | None = None,
        log_at_init: bool = True,
        figures_every_n_epochs: int | None = None,
        verbose: bool = True,
    ) -> None:
        stage = check_choice("stage", stage, STAGES)
        super().__init__(
            "rank" if stage == "val" else "rank_train",
            every_n_epochs=every_n_epochs,
            figures_every_n_epochs=figures_every_n_epochs,
            log_at_init=log_at_init,
            verbose=verbose,
        )
        for name, value in (("max_samples", max_samples), ("num_classes", num_classes)):
            check_positive_int(name, value, allow_none=True)
        self.layers = check_names("layers", layers)
        self.layer_types = None if layer_types is None else check_layer_types(layer_types)
        self.stage, self.max_samples, self.num_classes = stage, max_samples, num_classes
        conv = check_choice("conv_reduction", conv_reduction, CONV_REDUCTIONS)
        self.reductions = {4: conv, 3: check_choice("token_reduction", token_reduction, TOKEN_REDUCTIONS)}
        self.token_layout = check_choice("token_layout", token_layout, TOKEN_LAYOUTS)
        self.metrics = check_choices("metrics", metrics, ACTIVATION_METRICS)
        self.center, self.log_per_class = center, log_per_class
        self.batch_reader = BatchReader(input_key=input_key, label_key=label_key, label_fn=label_fn)
        self.spectrum_options = _spectrum_options(
            center, variance_ratio_ks, soft_rank_tau, rank_tolerance, tolerance_size, max_gram_features, self.metrics
        )
        self._init_state()

    def _init_state(self) -> None:
        # Filled at setup (layers, classes) and in monitored epochs (one metric per layer, hooks).
        self._layers: dict[str, str] = {}
        self._num_classes: int | None = None
        self._metrics: dict[str, ActivationSpectrum] = {}
        self._layer_reductions: dict[str, str | None] = {}
        self._layer_ndims: dict[str, int] = {}
        # Token layout per layer: declared by the module (batch_first) or learnt from an unambiguous batch.
        self._layouts: dict[str, bool] = {}
        self._hooks = ExitStack()
        self._clear_stream()

    def _clear_stream(self) -> None:
        self._active = self._in_batch = False
        self._remaining: int | None = None
        self._batches_left: float = math.inf
        self._batch: int | None = None
        self._take: int | None = None
        self._labels: Tensor | None = None
        self._seen_this_batch: set[str] = set()
        self._batches_seen = self._inputs_measured = 0

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
        self._layouts = {}
        if self.token_layout != "auto":
            self._layouts = dict.fromkeys(self._layers, self.token_layout == "batch_first")
        else:
            declared = {name: declared_batch_first(module, path) for name, path in self._layers.items()}
            self._layouts = {name: flag for name, flag in declared.items() if flag is not None}
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
        options = self.spectrum_options
        self.curves.describe(
            split=self.stage, rank_tolerance=options["rank_tolerance"], tolerance_size=options["tolerance_size"]
        )

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
            self._start(trainer, pl_module, sum(trainer.num_val_batches))

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
            self._batch_end()

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._monitoring("val"):
            self._finish(trainer, pl_module)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_epoch_start(trainer, pl_module)
        if self.stage == "train" and self.due(trainer):
            self._start(trainer, pl_module, trainer.num_training_batches)

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
            self._batch_end()

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

    def _start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, num_batches: float) -> None:
        """Hook the layers for a pass of ``num_batches`` batches (``inf`` when unknown)."""
        # An epoch cut short by an exception may have left partial sums behind.
        self._stop()
        for metric in self._metrics.values():
            metric.reset()
        self._remaining = None if self.max_samples is None else math.ceil(self.max_samples / max(trainer.world_size, 1))
        self._batches_left = num_batches if num_batches > 0 else math.inf
        layers = [FeatureLayer(name, path) for name, path in self._layers.items()]
        self._hooks.enter_context(forward_hooks(pl_module, layers, self._hook))
        self._active = True

    def _stop(self) -> None:
        self._hooks.close()
        self._clear_stream()

    def _batch_start(self, batch: Any) -> None:
        self._labels = self._read_labels(batch) if self._num_classes else None
        self._batch = BatchReader.batch_size(batch)
        if self._batch is None and self._labels is not None:
            self._batch = self._labels.shape[0]
        self._take = None
        self._seen_this_batch = set()
        self._in_batch = True

    def _read_labels(self, batch: Any) -> Tensor | None:
        # An explicit label_key or label_fn that finds nothing raises here, at the first batch.
        labels = self.batch_reader.labels(batch)
        if labels is None and ("labels",) not in self._warned:
            self.warn_once(
                ("labels",),
                f"num_classes={self._num_classes} but no class labels at {self.batch_reader.label_source(batch)}; "
                "the class metrics (TCV, class-wise VR) are not logged. Set label_key or label_fn.",
            )
        return labels

    def _claim(self, size: int) -> int:
        """Rows of the current batch to measure; the first monitored layer to run decides for all of them.

        With ``max_samples`` the rows still to take are spread evenly over the batches left in the pass, so a
        loader sorted by class still gives rows of every class.
        """
        if self._take is None:
            if self._remaining is None:
                self._take = size
            else:
                share = math.ceil(self._remaining / max(self._batches_left, 1))
                self._take = max(0, min(size, self._remaining, share))
                self._remaining -= self._take
            self._inputs_measured += self._take
        return self._take

    def _batch_end(self) -> None:
        self._take = 0
        self._batches_left -= 1
        self._batches_seen += 1
        if self._batches_seen == 1:
            # Containers that are never called (ModuleList, ModuleDict) and unused modules get no hook call.
            for name in self._layers:
                if name not in self._seen_this_batch:
                    path = self._layers[name]
                    message = f"({path}) was not called in the forward pass of a monitored batch; it is not logged."
                    self._warn_layer(name, "not called", message + " Name a module that runs (layers=[...]).")

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
        """``activations`` with the batch first; tokens may come sequence-first, ``(T, B, D)``."""
        batch, shape = self._batch, tuple(activations.shape)
        if activations.ndim != 3 or batch is None:
            if batch is None or shape[0] == batch:
                return activations
            self._warn_layer(name, "batch", f"gives {shape}, with no leading dimension of the batch size {batch}.")
            return None
        layout = self._layouts.get(name)
        if layout is None and (shape[0] == batch) != (shape[1] == batch):
            layout = self._layouts[name] = shape[0] == batch  # unambiguous: remembered for later batches
        if layout is None:
            reason = "in both leading dimensions" if shape[0] == batch else "in neither leading dimension"
            message = f"gives {shape} with the batch size {batch} {reason}: its token layout cannot be told. "
            self._warn_layer(name, "layout", message + "Set token_layout='batch_first' or 'sequence_first'.")
            return None
        if shape[0 if layout else 1] != batch:
            self._warn_layer(name, "batch", f"gives {shape}, not {'(B, T, D)' if layout else '(T, B, D)'}, B={batch}.")
            return None
        return activations if layout else activations.transpose(0, 1)

    def _check_classes(self, name: str, counts: Tensor | None, rows: int) -> None:
        missing = _missing_classes(counts)
        if missing:
            shown = ", ".join(map(str, missing[:10])) + (", ..." if len(missing) > 10 else "")
            message = f"saw no rows of classes [{shown}] among the {rows} measured; TCV and class-wise VR cover the "
            self._warn_layer(name, "classes", message + "others only (raise max_samples or shuffle the loader).")

    def _warn_layer(self, name: str, kind: str, message: str) -> None:
        self.warn_once((name, kind), f"layer {name!r} {message}")

    def _metric_for(self, name: str, activations: Tensor) -> ActivationSpectrum:
        metric = self._metrics.get(name)
        if metric is None:
            reduction = self.reductions.get(activations.ndim)
            self._layer_reductions[name], self._layer_ndims[name] = reduction, activations.ndim
            metric = ActivationSpectrum(
                num_classes=self._num_classes, reduction=reduction or "flatten", **self.spectrum_options
            ).to(activations.device)
            self._metrics[name] = metric
        return metric

    # -- the epoch's values -------------------------------------------------------------------------------------

    def _finish(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        values = self._pass_values(trainer.current_epoch, pl_module)
        if values:
            self.curves.record_and_log(trainer, pl_module, values)

    def _pass_values(self, epoch: int, pl_module: pl.LightningModule) -> dict[str, dict[str, float]]:
        """Unhook, compute every layer measured on every process (a collective), and reset the sums."""
        inputs = torch.tensor(self._inputs_measured, device=pl_module.device)
        self._stop()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(inputs)
        values = {name: self._values_of(name, epoch) for name in self._measured_everywhere(pl_module)}
        # The caption states the reductions the measured layers actually used (none for (B, d) layers).
        kinds = {4: "conv maps", 3: "tokens"}
        used = {
            kinds[n]: self.reductions[n] for n in sorted(set(self._layer_ndims.values()), reverse=True) if n in kinds
        }
        self.curves.describe(samples=int(inputs), **({"reduction": used} if used else {}))
        for metric in self._metrics.values():
            metric.reset()
        return values

    # -- the initial point ----------------------------------------------------------------------------------------

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        loader = first_val_loader(trainer) if self.stage == "val" else trainer.train_dataloader
        if loader is None or not self.initial_point_due(trainer):
            return
        # Validation data pass once over the loader (rows spread over it); training data only up to max_samples.
        batches = len(loader) if self.stage == "val" and hasattr(loader, "__len__") else math.inf
        self._start(trainer, pl_module, batches)
        try:
            self._initial_pass(trainer, pl_module, loader)
        except Exception as error:  # an initial point must never stop the fit it precedes
            self._stop()
            self.warn_once(("init",), f"no initial point: the forward pass on a batch failed ({error!r}).")
            return
        values = self._pass_values(-1, pl_module)
        if values:
            self.curves.record_initial(trainer, values)

    def _initial_pass(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loader: Any) -> None:
        # Validation runs in eval mode; training batches in training mode, without touching BatchNorm statistics.
        mode = eval_mode if self.stage == "val" else train_mode
        with torch.no_grad(), mode(pl_module), buffers_kept(pl_module):
            for batch in loader:
                if self._remaining == 0:
                    break
                batch = trainer.strategy.batch_to_device(batch)
                self._batch_start(batch)
                pl_module(self.batch_reader.inputs(batch))
                self._batch_end()

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
        self._check_classes(name, result.class_counts, result.num_samples)
        if result.path != "gram":
            message = f"has {result.num_features} features, more than max_gram_features={metric.max_gram_features}; "
            path = f"its spectrum comes from the {result.path!r} path ({result.num_spectrum_samples} rows)."
            self._warn_layer(name, "path", message + path)
        reduction = self._layer_reductions.get(name)
        prefix = f"{reduction}/" if reduction else ""
        scalars = result.scalars(self.metrics, centered=self.center, per_class=self.log_per_class)
        return {f"{prefix}{key}": value for key, value in scalars.items()}


def _missing_classes(counts: Tensor | None) -> list[int]:
    """Classes without a row, when some rows carried labels."""
    if counts is None or not counts.numel() or not int(counts.sum()):
        return []
    return [c for c, count in enumerate(counts.tolist()) if count == 0]


def _spectrum_options(
    center: bool,
    variance_ratio_ks: Sequence[int],
    soft_rank_tau: float,
    rank_tolerance: float | None,
    tolerance_size: str,
    max_gram_features: int,
    metrics: Sequence[str],
) -> dict[str, Any]:
    """The :class:`~rank_lightning.metrics.ActivationSpectrum` settings every monitored layer shares, checked now
    rather than at the first monitored batch."""
    options = {
        "center": center,
        "variance_ratio_ks": tuple(variance_ratio_ks),
        "soft_rank_tau": soft_rank_tau,
        "rank_tolerance": rank_tolerance,
        "tolerance_size": tolerance_size,
        "classwise": "classwise_variance_ratio" in metrics,
        "max_gram_features": max_gram_features,
    }
    ActivationSpectrum(**options)
    return options


def _num_classes_of(pl_module: nn.Module, trainer: pl.Trainer) -> int | None:
    for source in (pl_module, getattr(trainer, "datamodule", None)):
        value = getattr(source, "num_classes", None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None
