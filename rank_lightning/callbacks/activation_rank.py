"""Per-layer rank curves of activations, logged every few epochs by :class:`ActivationRankMonitor`."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from rank_lightning.callbacks.curves import LayerCurves
from rank_lightning.callbacks.layers import check_layer_types, match_layer_names, match_layer_types, module_blocks
from rank_lightning.functional.reductions import CONV_REDUCTIONS, TOKEN_REDUCTIONS
from rank_lightning.metrics import ActivationSpectrum

__all__ = ["ACTIVATION_METRICS", "ActivationRankMonitor"]

ACTIVATION_METRICS: tuple[str, ...] = (
    "numerical_rank",
    "soft_rank",
    "participation_ratio",
    "stable_rank",
    "effective_rank",
    "variance_ratio",
    "tcv",
    "tcv_normalized",
    "classwise_variance_ratio",
)
STAGES = ("val", "train")
_LABEL_KEYS = ("y", "label", "labels", "target", "targets")
# Activation modules whose outputs are the hidden representations of a foreign model.
_ACTIVATION_TYPES: tuple[type[nn.Module], ...] = (
    nn.ReLU,
    nn.ReLU6,
    nn.LeakyReLU,
    nn.PReLU,
    nn.ELU,
    nn.SELU,
    nn.CELU,
    nn.GELU,
    nn.SiLU,
    nn.Mish,
    nn.Tanh,
    nn.Sigmoid,
    nn.Softplus,
    nn.Hardswish,
    nn.Hardtanh,
)


def _parameter_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _main_container(module: nn.Module) -> tuple[str, nn.Module]:
    """Descend through wrappers that hold all parameters in one child (``LightningModule -> self.net``)."""
    prefix, current = "", module
    total = _parameter_count(module)
    while True:
        heavy = [(name, child) for name, child in current.named_children() if _parameter_count(child) == total]
        if len(heavy) != 1 or not any(True for _ in heavy[0][1].children()):
            return prefix, current
        name, current = heavy[0]
        prefix = f"{prefix}{name}."


def default_layers(module: nn.Module) -> dict[str, str]:
    """The layers watched when none are named: ``short name -> module path``.

    ``module.blocks()`` when the module offers it (the package's LightningModules). Otherwise the choice is made
    inside the container that holds the network (found by descending through children that hold every parameter,
    ``LightningModule -> self.net``), among its direct children:

    1. its blocks: children that hold parameters and have children of their own (``layer1`` ... ``layer4`` of a
       torchvision ResNet), without the last one when it is the last child with parameters (it holds the head);
    2. else its activation modules (``nn.Sequential(Linear, ReLU, Linear, ReLU, Linear)``: the two ReLUs, the
       post-activation hidden representations);
    3. else its children with parameters except the last one (taken to be the head);
    4. else all its children.
    """
    blocks = module_blocks(module)
    if blocks is not None:
        return blocks
    prefix, container = _main_container(module)
    children = list(container.named_children())
    weighted = [name for name, child in children if _parameter_count(child) > 0]
    nested = [name for name, child in children if name in weighted and any(True for _ in child.children())]
    activations = [name for name, child in children if isinstance(child, _ACTIVATION_TYPES)]
    if nested:
        chosen = nested[:-1] if nested[-1] == weighted[-1] and len(nested) > 1 else nested
    elif activations:
        chosen = activations
    else:
        chosen = weighted[:-1] or [name for name, _ in children]
    return {f"{prefix}{name}": f"{prefix}{name}" for name in chosen}


class ActivationRankMonitor(pl.Callback):
    """Log the rank of every monitored layer's activations: numerical, soft and effective rank, r(H), VR_k, TCV.

    Forward hooks stream each monitored layer's outputs into a float64
    :class:`~rank_lightning.metrics.ActivationSpectrum` (Gram and class sums), so one eigendecomposition per layer
    gives every metric, exactly for any number of samples, and DDP reduces the sums across processes: every process
    logs the same values as one process would. Works with any LightningModule, nothing to inherit; with the
    package's modules the default layers are the backbone's ``blocks()``; otherwise a choice is made and printed
    (see :func:`default_layers`).

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
            against both); ``None`` picks the default layers.
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
        rank_eps: relative tolerance of the numerical rank; ``None`` is ``finfo(float32).eps * min(N, d)``.
        center: compute the spectral metrics of centred activations (``X - 1 mu^T``) instead of ``X``.
        num_classes: number of classes of the labels; ``None`` reads ``pl_module.num_classes`` or the datamodule's
            ``num_classes``; class metrics are skipped without it.
        label_key: where the labels are in a batch: an index for tuples/lists, a key for dicts; ``None`` takes
            ``batch[1]`` or the first of ``y``, ``label``, ``labels``, ``target``, ``targets``.
        label_fn: a function ``batch -> labels`` overriding ``label_key``.
        log_per_class: also log the class-wise VR of every class, not only their mean.
        max_gram_features: largest d for the exact d x d Gram; wider layers use the subsample fallback of
            :class:`~rank_lightning.metrics.ActivationSpectrum` (a warning names the layer once).
        figures_every_epoch: rewrite the PNG figures after every monitored epoch.
        background_figures: draw the figures on a background thread, so that ``fit`` does not wait for them
            (:func:`~rank_lightning.callbacks.curves.wait_for_figures` waits); ``False`` draws them in ``on_fit_end``.
        verbose: print the monitored layers at setup (rank zero).

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
        rank_eps: float | None = None,
        center: bool = False,
        num_classes: int | None = None,
        label_key: int | str | None = None,
        label_fn: Callable[[Any], Tensor] | None = None,
        log_per_class: bool = False,
        max_gram_features: int = 4096,
        figures_every_epoch: bool = False,
        background_figures: bool = True,
        verbose: bool = True,
    ) -> None:
        super().__init__()
        if layers is not None:
            layers = [layers] if isinstance(layers, str) else list(layers)
            if not layers or not all(isinstance(name, str) and name for name in layers):
                raise ValueError(f"layers must be None or a non-empty list of non-empty strings, got {layers!r}")
        if isinstance(every_n_epochs, bool) or not isinstance(every_n_epochs, int) or every_n_epochs < 1:
            raise ValueError(f"every_n_epochs must be a positive integer, got {every_n_epochs!r}")
        if stage not in STAGES:
            raise ValueError(f"unknown stage {stage!r}; stages are: {', '.join(STAGES)}")
        if max_samples is not None and max_samples < 1:
            raise ValueError(f"max_samples must be a positive integer or None, got {max_samples!r}")
        if conv_reduction not in CONV_REDUCTIONS:
            raise ValueError(f"unknown conv_reduction {conv_reduction!r}; valid choices are {CONV_REDUCTIONS}")
        if token_reduction not in TOKEN_REDUCTIONS:
            raise ValueError(f"unknown token_reduction {token_reduction!r}; valid choices are {TOKEN_REDUCTIONS}")
        metrics = [metrics] if isinstance(metrics, str) else list(metrics)
        unknown = [m for m in metrics if m not in ACTIVATION_METRICS]
        if unknown or not metrics:
            raise ValueError(f"unknown metrics {unknown or metrics!r}; valid choices are {ACTIVATION_METRICS}")
        if num_classes is not None and num_classes < 1:
            raise ValueError(f"num_classes must be a positive integer or None, got {num_classes!r}")
        if rank_eps is not None and not rank_eps > 0:
            raise ValueError(f"rank_eps must be positive or None, got {rank_eps!r}")
        # The metric checks the spectral settings now rather than at the first monitored batch.
        ActivationSpectrum(
            num_classes=num_classes,
            center=center,
            variance_ratio_ks=variance_ratio_ks,
            soft_rank_tau=soft_rank_tau,
            max_gram_features=max_gram_features,
        )
        self.layers = layers
        self.layer_types = None if layer_types is None else check_layer_types(layer_types)
        self.every_n_epochs = every_n_epochs
        self.stage = stage
        self.max_samples = max_samples
        self.conv_reduction = conv_reduction
        self.token_reduction = token_reduction
        self.metrics = tuple(metrics)
        self.variance_ratio_ks = tuple(variance_ratio_ks)
        self.soft_rank_tau = soft_rank_tau
        self.rank_eps = rank_eps
        self.center = center
        self.num_classes = num_classes
        self.label_key = label_key
        self.label_fn = label_fn
        self.log_per_class = log_per_class
        self.max_gram_features = max_gram_features
        self.verbose = verbose
        self.curves = LayerCurves(
            "rank" if stage == "val" else "rank_train",
            figures_every_epoch=figures_every_epoch,
            background_figures=background_figures,
        )
        # Filled at setup / per monitored epoch.
        self._layers: dict[str, str] = {}
        self._num_classes: int | None = None
        self._metrics: dict[str, ActivationSpectrum] = {}
        self._reductions: dict[str, str | None] = {}
        self._handles: list[RemovableHandle] = []
        self._active = False
        self._in_batch = False
        self._remaining: int | None = None
        self._batch: int | None = None
        self._take: int | None = None
        self._labels: Tensor | None = None
        self._seen_this_batch: set[str] = set()
        self._warned: set[tuple[str, str]] = set()
        self._reported_paths: set[str] = set()

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(layers=self.layers, stage=self.stage)

    @property
    def monitored(self) -> dict[str, str]:
        """``logged name -> module path`` of the monitored layers, in depth order (empty before setup)."""
        return dict(self._layers)

    def select(self, module: nn.Module) -> dict[str, str]:
        """Resolve ``layers`` and ``layer_types`` against ``module``; returns ``logged name -> module path``.

        Raises:
            ValueError: a name or pattern that matches no layer (the message lists the valid names).
        """
        modules = dict(module.named_modules())
        blocks = module_blocks(module) or {}
        if self.layers is None and self.layer_types is not None:
            # A type alone asks for every layer of that type, not for the default layers that happen to have it.
            chosen = {name: name for name in match_layer_types([n for n in modules if n], modules, self.layer_types)}
        elif self.layers is None:
            chosen = default_layers(module)
        else:
            candidates = {name: m for name, m in modules.items() if name}
            paths = match_layer_names(module, self.layers, candidates, blocks=blocks, expand_containers=False)
            by_path = {path: name for name, path in blocks.items()}
            chosen = {by_path.get(path, path): path for path in paths}
        if self.layers is not None and self.layer_types is not None:
            kept = set(match_layer_types(list(chosen.values()), modules, self.layer_types))
            chosen = {name: path for name, path in chosen.items() if path in kept}
        if not chosen:
            raise ValueError(
                f"{type(module).__name__} has no layer to monitor by default; name them with layers=[...] "
                f"(module names: {', '.join(n for n in modules if n) or 'none'})"
            )
        for name in chosen:
            if "/" in name:
                raise ValueError(f"layer name {name!r} contains '/', which separates the parts of a logged key")
        self._layers = chosen
        return self.monitored

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.select(pl_module)
        self._num_classes = self.num_classes or _num_classes_of(pl_module, trainer)
        if self.verbose and trainer.is_global_zero:
            names = ", ".join(name if name == path else f"{name} ({path})" for name, path in self._layers.items())
            classes = f"{self._num_classes} classes" if self._num_classes else "no class metrics (num_classes unknown)"
            how = ""
            if self.layers is None and self.layer_types is None and module_blocks(pl_module) is None:
                how = " (default choice: the module has no blocks(); pass layers=[...] to choose)"
            print(f"ActivationRankMonitor: monitoring {len(self._layers)} layers{how}, {classes}: {names}")

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._stop()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._stop()

    # -- when ---------------------------------------------------------------------------------------------------

    def _due(self, trainer: pl.Trainer, stage: str) -> bool:
        if stage != self.stage or trainer.sanity_checking:
            return False
        fn = getattr(trainer.state, "fn", None)
        if fn == "validate":
            return stage == "val"
        return fn == "fit" and (trainer.current_epoch + 1) % self.every_n_epochs == 0

    def _start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # An epoch cut short by an exception may have left partial sums behind.
        self._stop()
        for metric in self._metrics.values():
            metric.reset()
        if self.max_samples is None:
            self._remaining = None
        else:
            self._remaining = math.ceil(self.max_samples / max(trainer.world_size, 1))
        for name, path in self._layers.items():
            layer = pl_module.get_submodule(path)
            self._handles.append(layer.register_forward_hook(self._make_hook(name)))
        self._active = True

    def _stop(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._active = False
        self._in_batch = False

    def _finish(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._stop()
        values: dict[str, dict[str, float]] = {}
        for name in self._measured_everywhere(pl_module.device):
            values[name] = self._values_of(name, self._metrics[name], trainer.current_epoch)
        for metric in self._metrics.values():
            metric.reset()
        if values:
            self.curves.record_and_log(trainer, pl_module, values)

    def _measured_everywhere(self, device: torch.device) -> list[str]:
        """The layers that every process measured this epoch: ``compute()`` is a collective all of them must join."""
        counts = torch.tensor(
            [self._metrics[name].update_count if name in self._metrics else 0 for name in self._layers],
            dtype=torch.int64,
            device=device,
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
                self._warn_once(
                    name,
                    "unmeasured",
                    "ran on some processes only in a monitored epoch; it is not logged for such epochs.",
                )
        return measured

    def _batch_start(self, batch: Any) -> None:
        self._labels = self._extract_labels(batch) if self._num_classes else None
        self._batch = _batch_size(batch)
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

    @override
    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._due(trainer, "val"):
            self._start(trainer, pl_module)

    @override
    def on_validation_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if self._active and self.stage == "val":
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
        if self._active and self.stage == "val":
            self._take = 0

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._active and self.stage == "val":
            self._finish(trainer, pl_module)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._due(trainer, "train"):
            self._start(trainer, pl_module)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._active and self.stage == "train":
            self._batch_start(batch)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._active and self.stage == "train":
            self._take = 0

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._active and self.stage == "train":
            self._finish(trainer, pl_module)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Validation interrupts a monitored training epoch: its forward passes must not reach the training metrics.
        if self._active and self.stage == "train":
            self._in_batch = False

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.curves.finish(trainer)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"curves": self.curves.state_dict()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.curves.load_state_dict(state_dict["curves"])

    # -- what ---------------------------------------------------------------------------------------------------

    def _make_hook(self, name: str) -> Callable[[nn.Module, Any, Any], None]:
        def hook(module: nn.Module, inputs: Any, output: Any) -> None:
            if not self._in_batch:
                return
            if name in self._seen_this_batch:
                # A module called twice per forward (a shared ReLU) would mix two representations.
                self._warn_once(
                    name,
                    "reuse",
                    "runs more than once per forward pass; only its first call is measured. "
                    "Monitor a module that runs once instead.",
                )
                return
            self._seen_this_batch.add(name)
            activations = output[0] if isinstance(output, (tuple, list)) and output else output
            if not isinstance(activations, Tensor) or activations.ndim not in (2, 3, 4):
                shape = tuple(activations.shape) if isinstance(activations, Tensor) else type(activations).__name__
                self._warn_once(
                    name,
                    "shape",
                    f"gives {shape}, not (B, d) features, (B, T, D) tokens or (B, C, H, W) conv maps; it is skipped.",
                )
                return
            activations = self._batch_first(name, activations.detach())
            if activations is None:
                return
            take = self._claim(activations.shape[0])
            if take == 0:
                return
            labels = None if self._labels is None else self._labels[:take].to(activations.device)
            self._metric_for(name, activations).update(activations[:take], labels)

        return hook

    def _batch_first(self, name: str, activations: Tensor) -> Tensor | None:
        batch = self._batch
        if batch is None or activations.shape[0] == batch:
            return activations
        if activations.ndim == 3 and activations.shape[1] == batch:
            # Sequence-first tokens (T, B, D), the default layout of nn.Transformer and nn.MultiheadAttention.
            return activations.transpose(0, 1)
        self._warn_once(
            name,
            "batch",
            f"gives {tuple(activations.shape)}, with no leading dimension of the batch size {batch}; it is skipped.",
        )
        return None

    def _warn_once(self, name: str, kind: str, message: str) -> None:
        if (name, kind) not in self._warned:
            self._warned.add((name, kind))
            warnings.warn(f"ActivationRankMonitor: layer {name!r} {message}", stacklevel=3)

    def _metric_for(self, name: str, activations: Tensor) -> ActivationSpectrum:
        metric = self._metrics.get(name)
        if metric is None:
            reduction = {4: self.conv_reduction, 3: self.token_reduction}.get(activations.ndim)
            self._reductions[name] = reduction
            metric = ActivationSpectrum(
                num_classes=self._num_classes,
                reduction=reduction or "flatten",
                center=self.center,
                variance_ratio_ks=self.variance_ratio_ks,
                soft_rank_tau=self.soft_rank_tau,
                rank_eps=self.rank_eps,
                classwise="classwise_variance_ratio" in self.metrics,
                max_gram_features=self.max_gram_features,
            ).to(activations.device)
            self._metrics[name] = metric
        return metric

    def _values_of(self, name: str, metric: ActivationSpectrum, epoch: int) -> dict[str, float]:
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
        if result.path != "gram" and name not in self._reported_paths:
            self._reported_paths.add(name)
            warnings.warn(
                f"ActivationRankMonitor: layer {name!r} has {result.num_features} features, more than "
                f"max_gram_features={self.max_gram_features}; its spectrum comes from the {result.path!r} path "
                f"({result.num_spectrum_samples} rows).",
                stacklevel=2,
            )
        summary = result.centered if self.center else result.uncentered
        scalars = summary.as_dict() if summary is not None else {}
        values: dict[str, float] = {}
        for metric_name in self.metrics:
            if metric_name == "variance_ratio":
                values.update({k: v for k, v in scalars.items() if k.startswith("variance_ratio_")})
            elif metric_name == "tcv" and result.total_cluster_variation is not None:
                values["tcv"] = float(result.total_cluster_variation)
            elif metric_name == "tcv_normalized" and result.total_cluster_variation_normalized is not None:
                values["tcv_normalized"] = float(result.total_cluster_variation_normalized)
            elif metric_name == "classwise_variance_ratio" and result.classwise_variance_ratio is not None:
                per_class = result.classwise_variance_ratio
                key = f"classwise_variance_ratio_{result.classwise_k}"
                finite = per_class[~per_class.isnan()]
                values[f"{key}_mean"] = float(finite.mean()) if finite.numel() else math.nan
                if self.log_per_class:
                    values.update({f"{key}_class_{c}": float(v) for c, v in enumerate(per_class)})
            elif metric_name in scalars:
                values[metric_name] = scalars[metric_name]
        reduction = self._reductions.get(name)
        prefix = f"{reduction}/" if reduction else ""
        return {f"{prefix}{key}": value for key, value in values.items()}

    def _extract_labels(self, batch: Any) -> Tensor | None:
        if self.label_fn is not None:
            labels = self.label_fn(batch)
        elif isinstance(batch, Mapping):
            keys = [self.label_key] if self.label_key is not None else [k for k in _LABEL_KEYS if k in batch]
            labels = batch.get(keys[0]) if keys else None
        elif isinstance(batch, (tuple, list)):
            index = 1 if self.label_key is None else self.label_key
            labels = batch[index] if isinstance(index, int) and len(batch) > index else None
        else:
            labels = None
        if (
            not isinstance(labels, Tensor)
            or labels.ndim != 1
            or labels.is_floating_point()
            or labels.dtype == torch.bool
        ):
            return None
        return labels


def _batch_size(batch: Any) -> int | None:
    """Leading dimension of the batch's first tensor; ``None`` when it holds none (the activations then tell)."""
    if isinstance(batch, Tensor):
        return batch.shape[0] if batch.ndim else None
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, (tuple, list)):
        for item in batch:
            if isinstance(item, Tensor) and item.ndim > 0:
                return item.shape[0]
    return None


def _num_classes_of(pl_module: nn.Module, trainer: pl.Trainer) -> int | None:
    for source in (pl_module, getattr(trainer, "datamodule", None)):
        value = getattr(source, "num_classes", None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None
