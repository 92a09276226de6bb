"""Feng et al.'s two analysis tools as callbacks: partial Jacobian rank per block, and classification dimension.

* :class:`JacobianRankMonitor`: every few epochs, the rank of ``d F_k(x) / d x_P`` for the sub-network ``F_k`` ending
  at each monitored block, at a few fixed inputs and a fixed input patch (Feng et al. eq. 5, Fig. 1 a-c).
* :class:`ClassificationDimension`: at the end of fit (or under ``trainer.validate``), the fewest principal
  directions of the final features that keep 95% of the accuracy of the model's own head (Feng et al. eq. 6,
  Table 2), optionally with the independence deficit of the logits (eq. 11-12, Fig. 4).

Both compute on rank zero and broadcast the numbers, so every DDP process logs the same values.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import pytorch_lightning as pl
import torch
from matplotlib.figure import Figure
from pytorch_lightning.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor, nn
from typing_extensions import override

from rank_lightning.callbacks.activation_rank import default_layers
from rank_lightning.callbacks.curves import LayerCurves, run_directory, wandb_loggers
from rank_lightning.callbacks.layers import match_layer_names, module_blocks
from rank_lightning.functional.classification import (
    ClassificationDimension as ClassificationDimensionResult,
)
from rank_lightning.functional.classification import (
    classification_dimension,
    independence_deficit,
    independence_deficit_markdown,
)
from rank_lightning.functional.jacobian import PartialJacobianRank, Patch, partial_jacobian_ranks

__all__ = ["CLSDIM_DIR", "ClassificationDimension", "JacobianRankMonitor"]

CLSDIM_DIR = "clsdim"
"""Folder inside the run directory that receives the classification-dimension files."""

_SIZES = ("min", "max")
_FIT_ON = ("all", "class")


def _positive_int(name: str, value: Any, *, allow_none: bool = False) -> None:
    if allow_none and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        allowed = "a positive integer or None" if allow_none else "a positive integer"
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def _first_val_loader(trainer: pl.Trainer) -> Any:
    loaders = trainer.val_dataloaders
    if isinstance(loaders, (list, tuple)):
        return loaders[0] if loaders else None
    return loaders


def _batch_part(batch: Any, index: int, what: str) -> Tensor:
    if isinstance(batch, Tensor) and index == 0:
        return batch
    if isinstance(batch, (tuple, list)) and len(batch) > index and isinstance(batch[index], Tensor):
        return batch[index]
    raise TypeError(
        f"cannot read the {what} from a batch of type {type(batch).__name__}: batches must be (x, y) tuples or lists"
    )


def _keep_modes(module: nn.Module) -> dict[nn.Module, bool]:
    return {m: m.training for m in module.modules()}


def _restore_modes(flags: Mapping[nn.Module, bool]) -> None:
    for m, flag in flags.items():
        m.training = flag


class JacobianRankMonitor(pl.Callback):
    """Log the partial Jacobian rank of every monitored block at a few fixed inputs (Feng et al. eq. 5, Fig. 1).

    For each monitored block ``k``, ``J_P = d F_k(x) / d x_P`` is the Jacobian of the block's output with respect to
    the ``K`` input coordinates of a fixed patch ``P`` (default: the central square of side
    :func:`~rank_lightning.functional.jacobian.default_patch_size` over all channels: 2 x 2 on 8 x 8 digits, 8 x 8 x 3
    on CIFAR, Feng et al.'s 16 x 16 x 3 on 224 x 224 images; non-image inputs use all coordinates). Its numerical rank
    (Feng et al. eq. 4) is computed by :func:`~rank_lightning.functional.jacobian.partial_jacobian_ranks` (one
    forward-mode pass per input serves every block) and averaged over the inputs. By Feng et al. Lemma 2, a drop of
    this partial rank from one block to the next certifies a drop of the full Jacobian rank.

    The inputs are the first ``num_inputs`` samples of the validation dataset (``dataset[0]``, ``dataset[1]``, ...,
    whatever the sampler; for an iterable dataset the first ones its loader yields), captured at the first measurement
    and kept for the whole run: they are saved in checkpoints, so a resumed run measures the same inputs. The model's
    forward pass must accept the ``x`` of an ``(x, y)`` batch.

    Timing: at the end of the validation of every ``every_n_epochs``-th epoch of ``fit``
    (``(epoch + 1) % every_n_epochs == 0``, sanity check excluded) and of every ``trainer.validate`` run. The model
    runs in eval mode for the computation (BatchNorm uses its running statistics, as ``vmap`` needs; dropout is off)
    and every submodule's own training flag is restored afterwards. Forward-mode derivatives need no autograd graph:
    they work under ``torch.no_grad`` (validation inside ``fit``) and under ``torch.inference_mode``
    (``trainer.validate``), because ``torch.func.jvp`` runs its function outside inference mode; the values are the
    same in all three settings. Under DDP, rank zero computes and broadcasts, so every process logs the same numbers
    (the others wait in the broadcast).

    Curves (:class:`~rank_lightning.callbacks.curves.LayerCurves`, namespace ``"jacobian"``): the history is
    rewritten to ``<run dir>/rank_curves/jacobian_curves.json`` at every measurement; the figures
    ``jacobian_rank.png`` and ``jacobian_rank_max.png`` (rank against epoch, and rank against depth) are drawn at the
    end of fit and of ``trainer.validate``.

    Args:
        layers: block names (``pl_module.blocks()``), module names (``named_modules()``) or glob patterns; ``None``
            takes the blocks of the package's modules, or the choice of
            :func:`~rank_lightning.callbacks.activation_rank.default_layers` for other modules.
        every_n_epochs: measure every this many epochs of ``fit``.
        num_inputs: number of fixed inputs the ranks are averaged over.
        patch_size: side of the central square patch; ``None`` for the default. Only for ``(C, H, W)`` inputs.
        patch: an explicit :class:`~rank_lightning.functional.jacobian.Patch` (any position, channels); exclusive
            with ``patch_size``.
        rank_eps: relative tolerance of the numerical rank; ``None`` is ``finfo(float32).eps * min(num_outputs, K)``.
        size: ``"min"`` (Feng et al.) or ``"max"`` dimension of ``J_P`` in the default tolerance.
        chunk_size: patch directions pushed through the model at once; ``None`` for all ``K`` (bounds memory only).
        log_per_input: also log the rank at each input.
        figures_every_epoch: redraw the figures after every measurement.
        background_figures: draw the figures on a background thread, so that ``fit`` does not wait for them
            (:func:`~rank_lightning.callbacks.curves.wait_for_figures` waits); ``False`` draws them in ``on_fit_end``.
        verbose: print the monitored blocks and the patch at setup (rank zero).

    Logged metrics:
        ``jacobian/<block>/rank``: partial Jacobian rank averaged over the inputs.
        ``jacobian/<block>/rank_max``: the largest possible rank, ``min(num_outputs, K)``.
        ``jacobian/<block>/rank_input_<i>`` (with ``log_per_input``): the rank at input ``i``.

    Raises:
        ValueError: at construction for an invalid setting; at setup for an unknown layer (the message lists the
            valid names); at the first measurement for a patch that does not fit the inputs.

    Example::

        import pytorch_lightning as pl
        from rank_lightning.callbacks import JacobianRankMonitor

        monitor = JacobianRankMonitor(every_n_epochs=5, num_inputs=4, patch_size=8)
        trainer = pl.Trainer(max_epochs=50, callbacks=[monitor])
        trainer.fit(model, datamodule=datamodule)
        # afterwards, from a checkpoint (trainer.validate works in inference mode too)
        pl.Trainer(callbacks=[JacobianRankMonitor()]).validate(model, datamodule=datamodule, ckpt_path="last.ckpt")
    """

    def __init__(
        self,
        *,
        layers: Sequence[str] | None = None,
        every_n_epochs: int = 1,
        num_inputs: int = 4,
        patch_size: int | None = None,
        patch: Patch | None = None,
        rank_eps: float | None = None,
        size: Literal["min", "max"] = "min",
        chunk_size: int | None = None,
        log_per_input: bool = False,
        figures_every_epoch: bool = False,
        background_figures: bool = True,
        verbose: bool = True,
    ) -> None:
        super().__init__()
        if layers is not None:
            layers = [layers] if isinstance(layers, str) else list(layers)
            if not layers or not all(isinstance(name, str) and name for name in layers):
                raise ValueError(f"layers must be None or a non-empty list of non-empty strings, got {layers!r}")
        _positive_int("every_n_epochs", every_n_epochs)
        _positive_int("num_inputs", num_inputs)
        _positive_int("patch_size", patch_size, allow_none=True)
        _positive_int("chunk_size", chunk_size, allow_none=True)
        if patch is not None and not isinstance(patch, Patch):
            raise ValueError(f"patch must be a rank_lightning.functional.jacobian.Patch or None, got {patch!r}")
        if patch is not None and patch_size is not None:
            raise ValueError(f"give patch or patch_size, not both (got patch={patch}, patch_size={patch_size})")
        if rank_eps is not None and not rank_eps > 0:
            raise ValueError(f"rank_eps must be positive or None, got {rank_eps!r}")
        if size not in _SIZES:
            raise ValueError(f"unknown size {size!r}; valid choices are {_SIZES}")
        self.layers = layers
        self.every_n_epochs = every_n_epochs
        self.num_inputs = num_inputs
        self.patch_size = patch_size
        self.patch = patch
        self.rank_eps = rank_eps
        self.size = size
        self.chunk_size = chunk_size
        self.log_per_input = log_per_input
        self.verbose = verbose
        self.curves = LayerCurves(
            "jacobian", figures_every_epoch=figures_every_epoch, background_figures=background_figures
        )
        self._layers: dict[str, str] = {}
        self._inputs: Tensor | None = None

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(layers=self.layers, num_inputs=self.num_inputs)

    @property
    def monitored(self) -> dict[str, str]:
        """``logged name -> module path`` of the monitored blocks, in depth order (empty before setup)."""
        return dict(self._layers)

    @property
    def inputs(self) -> Tensor | None:
        """The fixed inputs ``(num_inputs, ...)`` on the CPU; ``None`` before the first measurement."""
        return self._inputs

    def select(self, module: nn.Module) -> dict[str, str]:
        """Resolve ``layers`` against ``module``; returns ``logged name -> module path``.

        Raises:
            ValueError: a name or pattern that matches no module (the message lists the valid names).
        """
        if self.layers is None:
            chosen = default_layers(module)
        else:
            blocks = module_blocks(module) or {}
            candidates = {name: m for name, m in module.named_modules() if name}
            paths = match_layer_names(module, self.layers, candidates, blocks=blocks, expand_containers=False)
            by_path = {path: name for name, path in blocks.items()}
            chosen = {by_path.get(path, path): path for path in paths}
        for name in chosen:
            if "/" in name:
                raise ValueError(f"layer name {name!r} contains '/', which separates the parts of a logged key")
        self._layers = chosen
        return self.monitored

    def resolve_patch(self, sample_shape: Sequence[int]) -> Patch | None:
        """The patch used for inputs of shape ``sample_shape``; ``None`` means all coordinates (non-image inputs).

        Raises:
            ValueError: ``patch_size`` for inputs that are not ``(C, H, W)`` images, or a patch that does not fit.
        """
        if self.patch is not None:
            self.patch.mask(sample_shape)
            return self.patch
        if len(sample_shape) != 3:
            if self.patch_size is not None:
                raise ValueError(
                    f"patch_size={self.patch_size} needs (C, H, W) image inputs, got samples of shape "
                    f"{tuple(sample_shape)}; leave it None to use every input coordinate"
                )
            return None
        return Patch.central(sample_shape, self.patch_size)

    def measure(self, pl_module: nn.Module, inputs: Tensor | None = None) -> dict[str, PartialJacobianRank]:
        """Partial Jacobian ranks of the monitored blocks at ``inputs`` (default: the fixed inputs).

        The model is switched to eval mode for the computation; every submodule's training flag is restored.
        """
        inputs = self._inputs if inputs is None else inputs
        if inputs is None:
            raise RuntimeError("JacobianRankMonitor has no inputs yet; they are captured at the first validation")
        if not self._layers:
            self.select(pl_module)
        parameter = next((p for p in pl_module.parameters() if p.is_floating_point()), None)
        device = parameter.device if parameter is not None else inputs.device
        x = inputs.to(device)
        if parameter is not None and x.is_floating_point():
            x = x.to(parameter.dtype)
        return partial_jacobian_ranks(
            pl_module,
            x,
            self._layers,
            self.resolve_patch(x.shape[1:]),
            eps=self.rank_eps,
            size=self.size,
            chunk_size=self.chunk_size,
            eval_mode=True,
        )

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.select(pl_module)
        if self.verbose and trainer.is_global_zero:
            names = ", ".join(name if name == path else f"{name} ({path})" for name, path in self._layers.items())
            if self.patch is not None:
                patch = str(self.patch)
            else:
                patch = (
                    "central, default size"
                    if self.patch_size is None
                    else f"central {self.patch_size}x{self.patch_size}"
                )
            print(f"JacobianRankMonitor: {len(self._layers)} blocks, {self.num_inputs} inputs, patch {patch}: {names}")

    def _due(self, trainer: pl.Trainer) -> bool:
        if trainer.sanity_checking:
            return False
        fn = getattr(trainer.state, "fn", None)
        if fn == "validate":
            return True
        return fn == "fit" and (trainer.current_epoch + 1) % self.every_n_epochs == 0

    def _capture_inputs(self, trainer: pl.Trainer) -> Tensor | None:
        loader = _first_val_loader(trainer)
        if loader is None:
            return None
        dataset = getattr(loader, "dataset", None)
        if (
            dataset is not None
            and not isinstance(dataset, torch.utils.data.IterableDataset)
            and hasattr(dataset, "__len__")
            and hasattr(dataset, "__getitem__")
        ):
            count = min(self.num_inputs, len(dataset))
            batch = loader.collate_fn([dataset[i] for i in range(count)])
            x = _batch_part(batch, 0, "inputs")
        else:
            pieces, taken = [], 0
            for batch in loader:
                piece = _batch_part(batch, 0, "inputs")[: self.num_inputs - taken]
                pieces.append(piece)
                taken += piece.shape[0]
                if taken >= self.num_inputs:
                    break
            if not pieces:
                return None
            x = torch.cat(pieces)
        # Outside inference mode the copy is an ordinary tensor that checkpoints and later runs can use.
        with torch.inference_mode(False):
            return x.detach().to("cpu").clone()

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._due(trainer):
            return
        values: dict[str, dict[str, float]] | None = None
        if trainer.is_global_zero:
            if self._inputs is None:
                self._inputs = self._capture_inputs(trainer)
            if self._inputs is None:
                rank_zero_warn("JacobianRankMonitor: no validation data to take inputs from; nothing measured")
            else:
                values = {}
                for name, result in self.measure(pl_module).items():
                    values[name] = {"rank": result.mean, "rank_max": float(result.max_rank)}
                    if self.log_per_input:
                        values[name].update({f"rank_input_{i}": float(r) for i, r in enumerate(result.ranks)})
        values = trainer.strategy.broadcast(values, src=0)
        if values:
            self.curves.record_and_log(trainer, pl_module, values)

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if getattr(trainer.state, "fn", None) == "validate":
            self.curves.finish(trainer)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.curves.finish(trainer)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"curves": self.curves.state_dict(), "inputs": self._inputs}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.curves.load_state_dict(state_dict["curves"])
        inputs = state_dict.get("inputs")
        self._inputs = None if inputs is None else inputs.detach().to("cpu")


class ClassificationDimension(pl.Callback):
    """Log the classification dimension of the final features (Feng et al. eq. 6, Table 2) at the end of fit.

    The final features are the input of the model's head, read by a forward pre-hook on it (the head of the package's
    modules is ``backbone.<head_path>``; for other modules, the ``head`` given or the last ``nn.Linear``), together
    with the labels ``y`` of ``(x, y)`` batches, on the first validation dataloader, in eval mode and without
    gradients (every submodule's training flag is restored afterwards). The features are projected onto their top-k
    principal directions and fed to that same head;
    :func:`~rank_lightning.functional.classification_dimension` returns the smallest ``k`` keeping ``threshold``
    (0.95) of the full accuracy. The default projection is Feng et al.'s (their released code and Table 2): linear
    through the origin on uncentred features, ``F Q_k Q_k^T``; ``center=True`` projects through the mean instead.

    With ``independence_deficit=True`` each chosen class's logit is also fitted, by the Lasso, as a sparse combination
    of the other logits (:func:`~rank_lightning.functional.independence_deficit`, Feng et al. eq. 11-12, Fig. 4).
    Feng et al.'s ``eta = 20`` is for ImageNet logits; the penalty is not scale-free, so small models may need a
    smaller one.

    Timing: once at the end of ``fit`` (``on_train_end``), and at the end of every ``trainer.validate`` run (its
    validation loop is not changed; the features are read in a pass of their own). Under DDP every process reads its
    share of the data (at most ``ceil(max_samples / world_size)`` samples) and the features are gathered; rank zero
    computes and broadcasts the numbers, so every process logs the same values. Lightning's distributed sampler pads
    the last batch with repeated samples, which then count twice.

    Files, written by rank zero into ``<run dir>/clsdim/``:
    ``accuracy_vs_k.csv`` (columns ``k``, ``accuracy``, ``relative_accuracy`` = accuracy / full accuracy,
    ``eigenvalue`` = the k-th PCA eigenvalue), ``accuracy_vs_k.png`` (accuracy against k with the threshold and the
    classification dimension marked, beside the PCA spectrum), and with the independence deficit
    ``independence_deficit.md`` (:func:`~rank_lightning.functional.independence_deficit_markdown`) and
    ``independence_deficit.csv``. A later evaluation in the same run directory overwrites them. With a
    ``WandbLogger``, the tables ``clsdim/accuracy_vs_k`` (and its line plot ``clsdim/accuracy_vs_k_plot``),
    ``clsdim/independence_deficit`` and the image ``clsdim/figure`` are logged too. The latest result is kept in
    :attr:`result` and :attr:`deficit` on rank zero.

    Args:
        threshold: fraction of the full accuracy to keep (Feng et al.: 0.95).
        center: project through the mean (True) or through the origin (False, Feng et al.'s choice).
        ks: the numbers of directions evaluated; ``None`` for every ``k`` in ``1..d`` (one head evaluation each).
        max_samples: at most this many validation samples; ``None`` for all.
        head: module path of the head on the LightningModule; ``None`` finds it (see above).
        independence_deficit: also compute and log the Lasso independence deficit of the logits.
        deficit_eta: the Lasso penalty ``eta`` of Feng et al. eq. 11.
        deficit_classes: the classes whose logit is explained; ``None`` for all.
        deficit_fit_on: ``"all"`` samples (eq. 11) or only those of the ``"class"`` (Feng et al.'s code).
        class_names: names of the classes for the deficit table; indices otherwise.
        verbose: print the result (rank zero).

    Logged metrics:
        ``clsdim/cls_dim``: the classification dimension k.
        ``clsdim/ambient_dim``: d, the width of the features.
        ``clsdim/full_acc``: accuracy of the head on the unprojected features.
        ``clsdim/acc_at_cls_dim``: accuracy on the projection onto the top ``cls_dim`` directions.
        ``clsdim/num_samples``: the number of samples evaluated.
        ``clsdim/deficit_acc_drop`` (with ``independence_deficit``): mean over the chosen classes of the accuracy
        lost when ``logit_i`` is replaced by its fit (all samples).
        ``clsdim/deficit_class_acc_drop``: the same over the samples of class ``i``.
        ``clsdim/deficit_num_terms``: mean number of classes with a non-zero Lasso weight.

    Raises:
        ValueError: at construction for an invalid setting; at setup when no head can be found.

    Example::

        import pytorch_lightning as pl
        from rank_lightning.callbacks import ClassificationDimension

        trainer = pl.Trainer(callbacks=[ClassificationDimension(independence_deficit=True, deficit_eta=1.0)])
        trainer.fit(model, datamodule=datamodule)
        # or on a checkpoint
        pl.Trainer(callbacks=[ClassificationDimension()]).validate(model, datamodule=datamodule, ckpt_path="last.ckpt")
    """

    def __init__(
        self,
        *,
        threshold: float = 0.95,
        center: bool = False,
        ks: Sequence[int] | None = None,
        max_samples: int | None = None,
        head: str | None = None,
        independence_deficit: bool = False,
        deficit_eta: float = 20.0,
        deficit_classes: Sequence[int] | None = None,
        deficit_fit_on: Literal["all", "class"] = "all",
        class_names: Sequence[str] | None = None,
        verbose: bool = True,
    ) -> None:
        super().__init__()
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 < threshold <= 1:
            raise ValueError(f"threshold must lie in (0, 1], got {threshold!r}")
        if ks is not None and (not ks or any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in ks)):
            raise ValueError(f"ks must be None or a non-empty list of positive integers, got {ks!r}")
        _positive_int("max_samples", max_samples, allow_none=True)
        if head is not None and (not isinstance(head, str) or not head):
            raise ValueError(f"head must be None or a module path, got {head!r}")
        if not deficit_eta > 0:
            raise ValueError(f"deficit_eta must be positive, got {deficit_eta!r}")
        if deficit_fit_on not in _FIT_ON:
            raise ValueError(f"unknown deficit_fit_on {deficit_fit_on!r}; valid choices are {_FIT_ON}")
        self.threshold = float(threshold)
        self.center = center
        self.ks = None if ks is None else list(ks)
        self.max_samples = max_samples
        self.head = head
        self.independence_deficit = independence_deficit
        self.deficit_eta = deficit_eta
        self.deficit_classes = None if deficit_classes is None else list(deficit_classes)
        self.deficit_fit_on = deficit_fit_on
        self.class_names = None if class_names is None else list(class_names)
        self.verbose = verbose
        self.result: ClassificationDimensionResult | None = None
        self.deficit: list[dict[str, Any]] | None = None
        self._head_path: str | None = None

    @property
    def head_path(self) -> str | None:
        """Module path of the head on the LightningModule (resolved at setup)."""
        return self._head_path

    def find_head(self, module: nn.Module) -> str:
        """Module path of the head: ``head``, else ``backbone.<head_path>``, else ``<head_path>``, else the last Linear.

        Raises:
            ValueError: an unknown ``head`` (the message lists the module names), or no head at all.
        """
        names = [name for name, _ in module.named_modules() if name]
        if self.head is not None:
            if self.head not in names:
                raise ValueError(f"unknown head {self.head!r}; modules are: {', '.join(names)}")
            path = self.head
        else:
            backbone = getattr(module, "backbone", None)
            inner = getattr(backbone, "head_path", None) if isinstance(backbone, nn.Module) else None
            own = getattr(module, "head_path", None)
            linears = [name for name, m in module.named_modules() if name and isinstance(m, nn.Linear)]
            if isinstance(inner, str) and f"backbone.{inner}" in names:
                path = f"backbone.{inner}"
            elif isinstance(own, str) and own in names:
                path = own
            elif linears:
                path = linears[-1]
            else:
                raise ValueError(
                    f"{type(module).__name__} has no head_path and no nn.Linear; name the head with head=... "
                    f"(modules: {', '.join(names) or 'none'})"
                )
        if isinstance(module.get_submodule(path), nn.Identity):
            raise ValueError(f"the head {path!r} is nn.Identity (a model without classes); name the head with head=...")
        return path

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._head_path = self.find_head(pl_module)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        scalars = self._evaluate(trainer, pl_module)
        if scalars:
            for logger in trainer.loggers:
                logger.log_metrics(scalars, step=trainer.global_step)

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or getattr(trainer.state, "fn", None) != "validate":
            return
        scalars = self._evaluate(trainer, pl_module)
        if scalars:
            # Every process holds the same broadcast values: no reduction needed.
            pl_module.log_dict(scalars, on_step=False, on_epoch=True, sync_dist=False)

    # -- collection ---------------------------------------------------------------------------------------------

    def _collect(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loader: Any) -> tuple[Tensor, Tensor]:
        head = pl_module.get_submodule(self._head_path or self.find_head(pl_module))
        limit = None if self.max_samples is None else math.ceil(self.max_samples / max(trainer.world_size, 1))
        captured: list[Tensor] = []
        features, labels, taken = [], [], 0
        handle = head.register_forward_pre_hook(lambda module, args: captured.append(args[0]))
        flags = _keep_modes(pl_module)
        pl_module.eval()
        try:
            with torch.no_grad():
                for batch in loader:
                    if limit is not None and taken >= limit:
                        break
                    x = _batch_part(batch, 0, "inputs").to(pl_module.device)
                    y = _batch_part(batch, 1, "labels").to(pl_module.device)
                    captured.clear()
                    pl_module(x)
                    if not captured:
                        raise RuntimeError(f"the head {self._head_path!r} was not called in the forward pass")
                    take = y.shape[0] if limit is None else min(y.shape[0], limit - taken)
                    features.append(captured[0][:take].detach())
                    labels.append(y[:take])
                    taken += take
        finally:
            handle.remove()
            _restore_modes(flags)
        if not features:
            return torch.empty(0), torch.empty(0, dtype=torch.long)
        return torch.cat(features), torch.cat(labels).long()

    @staticmethod
    def _gather(pl_module: pl.LightningModule, trainer: pl.Trainer, x: Tensor) -> Tensor:
        """Concatenate the processes' tensors, which may differ in length (padded for ``all_gather``)."""
        if trainer.world_size <= 1:
            return x
        count = torch.tensor([x.shape[0]], device=pl_module.device)
        counts = pl_module.all_gather(count).reshape(-1).tolist()
        padded = x.new_zeros((int(max(counts)), *x.shape[1:]))
        padded[: x.shape[0]] = x
        gathered = pl_module.all_gather(padded)
        return torch.cat([gathered[rank, : int(n)] for rank, n in enumerate(counts)])

    # -- evaluation ---------------------------------------------------------------------------------------------

    def _evaluate(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, float]:
        loader = _first_val_loader(trainer)
        if loader is None:
            rank_zero_warn("ClassificationDimension needs validation data; nothing evaluated")
            return {}
        features, labels = self._collect(trainer, pl_module, loader)
        shape = features.shape[1:]
        features = self._gather(pl_module, trainer, features.flatten(1) if features.ndim > 2 else features)
        labels = self._gather(pl_module, trainer, labels)
        if self.max_samples is not None:
            features, labels = features[: self.max_samples], labels[: self.max_samples]
        scalars: dict[str, float] | None = None
        if trainer.is_global_zero and features.shape[0] > 0:
            scalars = self._compute(trainer, pl_module, features, labels, shape)
        scalars = trainer.strategy.broadcast(scalars, src=0)
        return scalars or {}

    def _compute(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        features: Tensor,
        labels: Tensor,
        shape: torch.Size,
    ) -> dict[str, float]:
        head_module = pl_module.get_submodule(self._head_path or self.find_head(pl_module))

        def head(f: Tensor) -> Tensor:
            # Heads that take conv maps or tokens see the projected features in their own shape.
            return head_module(f.reshape(f.shape[0], *shape))

        flags = _keep_modes(pl_module)
        pl_module.eval()
        try:
            result = classification_dimension(
                features, labels, head, threshold=self.threshold, center=self.center, ks=self.ks
            )
            deficit = None
            if self.independence_deficit:
                with torch.no_grad():
                    logits = torch.cat([head(chunk) for chunk in features.split(4096)])
                deficit = independence_deficit(
                    logits, labels, self.deficit_classes, eta=self.deficit_eta, fit_on=self.deficit_fit_on
                )
        finally:
            _restore_modes(flags)
        self.result, self.deficit = result, deficit
        position = int((result.ks == result.cls_dim).nonzero()[0])
        scalars = {
            "clsdim/cls_dim": float(result.cls_dim),
            "clsdim/ambient_dim": float(result.ambient_dim),
            "clsdim/full_acc": result.full_accuracy,
            "clsdim/acc_at_cls_dim": float(result.accuracies[position]),
            "clsdim/num_samples": float(features.shape[0]),
        }
        if deficit:
            scalars["clsdim/deficit_acc_drop"] = _mean([r["accuracy"] - r["accuracy_fit"] for r in deficit])
            scalars["clsdim/deficit_class_acc_drop"] = _mean(
                [r["class_accuracy"] - r["class_accuracy_fit"] for r in deficit]
            )
            scalars["clsdim/deficit_num_terms"] = _mean([float(r["num_terms"]) for r in deficit])
        directory = run_directory(trainer) / CLSDIM_DIR
        figure = self._write_files(directory, result, deficit)
        self._log_wandb(trainer, result, deficit, figure)
        if self.verbose:
            how = "centred" if self.center else "uncentred"
            rank_zero_info(
                f"ClassificationDimension: cls_dim = {result.cls_dim} of {result.ambient_dim} ({how} PCA, "
                f"{features.shape[0]} samples, full accuracy {result.full_accuracy:.4f}, "
                f"threshold {self.threshold}); files in {directory}"
            )
            if deficit:
                rank_zero_info("Independence deficit:\n" + independence_deficit_markdown(deficit, self.class_names))
        return scalars

    def _write_files(
        self, directory: Path, result: ClassificationDimensionResult, deficit: list[dict[str, Any]] | None
    ) -> Path:
        directory.mkdir(parents=True, exist_ok=True)
        full = result.full_accuracy
        with (directory / "accuracy_vs_k.csv").open("w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(["k", "accuracy", "relative_accuracy", "eigenvalue"])
            for k, accuracy in zip(result.ks.tolist(), result.accuracies.tolist()):
                relative = accuracy / full if full > 0 else math.nan
                writer.writerow([k, repr(accuracy), repr(relative), repr(float(result.eigenvalues[k - 1]))])
        figure_path = directory / "accuracy_vs_k.png"
        self._draw(result).savefig(figure_path, dpi=100)
        if deficit is not None:
            (directory / "independence_deficit.md").write_text(
                independence_deficit_markdown(deficit, self.class_names) + "\n"
            )
            with (directory / "independence_deficit.csv").open("w", newline="") as handle:
                writer = csv.writer(handle)
                writer.writerow(_DEFICIT_COLUMNS)
                for row in deficit:
                    writer.writerow(_deficit_cells(row))
        return figure_path

    def _draw(self, result: ClassificationDimensionResult) -> Figure:
        figure = Figure(figsize=(12, 4.5))
        figure.subplots_adjust(left=0.07, right=0.98, top=0.86, bottom=0.12, wspace=0.22)
        accuracy_axes, spectrum_axes = figure.subplots(1, 2)
        how = "centred" if result.centered else "uncentred"
        figure.suptitle(f"classification dimension {result.cls_dim} / {result.ambient_dim} ({how} projection)")
        accuracy_axes.plot(result.ks.tolist(), result.accuracies.tolist(), marker=".", label="top-k projection")
        accuracy_axes.axhline(result.full_accuracy, color="black", lw=0.8, label="full accuracy")
        accuracy_axes.axhline(
            result.threshold * result.full_accuracy, color="gray", ls="--", lw=0.8, label=f"{result.threshold} x full"
        )
        accuracy_axes.axvline(result.cls_dim, color="red", ls=":", label=f"cls_dim = {result.cls_dim}")
        accuracy_axes.set_xscale("log")
        accuracy_axes.set_xlabel("k (principal directions)")
        accuracy_axes.set_ylabel("accuracy of the model's head")
        accuracy_axes.legend(fontsize="small")
        accuracy_axes.grid(alpha=0.3)
        # Rounding leaves the null directions at tiny or negative values, which a log axis cannot show.
        positive = [(i + 1, v) for i, v in enumerate(result.eigenvalues.tolist()) if v > 0]
        spectrum_axes.plot([i for i, _ in positive], [v for _, v in positive], marker=".")
        spectrum_axes.axvline(result.cls_dim, color="red", ls=":")
        spectrum_axes.set_yscale("log")
        spectrum_axes.set_xscale("log")
        spectrum_axes.set_xlabel("principal direction")
        spectrum_axes.set_ylabel("eigenvalue of the feature covariance")
        spectrum_axes.grid(alpha=0.3)
        return figure

    def _log_wandb(
        self,
        trainer: pl.Trainer,
        result: ClassificationDimensionResult,
        deficit: list[dict[str, Any]] | None,
        figure: Path,
    ) -> None:
        loggers = wandb_loggers(trainer)
        if not loggers:
            return
        import wandb

        table = wandb.Table(
            columns=["k", "accuracy"], data=[[k, a] for k, a in zip(result.ks.tolist(), result.accuracies.tolist())]
        )
        payload: dict[str, Any] = {
            "clsdim/accuracy_vs_k": table,
            "clsdim/accuracy_vs_k_plot": wandb.plot.line(table, "k", "accuracy", title="accuracy vs k"),
            "clsdim/figure": wandb.Image(str(figure)),
        }
        if deficit is not None:
            payload["clsdim/independence_deficit"] = wandb.Table(
                columns=list(_DEFICIT_COLUMNS), data=[_deficit_cells(row) for row in deficit]
            )
        for logger in loggers:
            logger.log_metrics(payload, step=trainer.global_step)


_DEFICIT_COLUMNS = (
    "class",
    "terms",
    "weights",
    "num_terms",
    "r2",
    "relative_residual",
    "accuracy",
    "accuracy_fit",
    "class_accuracy",
    "class_accuracy_fit",
)


def _deficit_cells(row: Mapping[str, Any]) -> list[Any]:
    cells = []
    for column in _DEFICIT_COLUMNS:
        value = row[column]
        cells.append(" ".join(str(v) for v in value) if isinstance(value, list) else value)
    return cells


def _mean(values: Sequence[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return sum(finite) / len(finite) if finite else math.nan
