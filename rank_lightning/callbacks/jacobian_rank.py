"""The partial Jacobian rank of every monitored block at a few fixed inputs, as curves (Feng et al. eq. 5, Fig. 1)."""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any, Literal

import pytorch_lightning as pl
import torch
from torch import Tensor, nn
from typing_extensions import override

from rank_lightning.callbacks.base import CurveMonitor, first_val_loader
from rank_lightning.callbacks.curves import check_distinct_namespaces
from rank_lightning.functional.jacobian import PartialJacobianRank, Patch, partial_jacobian_ranks
from rank_lightning.functional.streaming import reduced_float32_format
from rank_lightning.layers import BatchReader, check_layer_types, random_state_kept, select_layers
from rank_lightning.validation import (
    check_bool,
    check_choice,
    check_names,
    check_positive,
    check_positive_int,
    count_of,
)

__all__ = ["JacobianRankMonitor"]

_TOLERANCE_SIZES = ("min", "max")


class JacobianRankMonitor(CurveMonitor):
    """Log the partial Jacobian rank of every monitored block at a few fixed inputs (Feng et al. eq. 5, Fig. 1).

    For each monitored block ``k``, ``J_P = d F_k(x) / d x_P`` is the Jacobian of the block's output with respect to
    the ``K`` input coordinates of a fixed patch ``P`` (default: the central square of side
    :func:`~rank_lightning.functional.jacobian.default_patch_size` over all channels: 2 x 2 on 8 x 8 digits, 8 x 8 x 3
    on CIFAR, Feng et al.'s 16 x 16 x 3 on 224 x 224 images; non-image inputs use all coordinates). Its numerical rank
    (Feng et al. eq. 4) is computed by :func:`~rank_lightning.functional.jacobian.partial_jacobian_ranks` (one
    forward-mode pass per input serves every block) and averaged over the inputs. By Feng et al. Lemma 2, a drop of
    this partial rank from one block to the next certifies a drop of the full Jacobian rank.

    The inputs are the first ``num_inputs`` samples of the validation dataset (``dataset[0]``, ``dataset[1]``, ...,
    whatever the sampler; for an iterable dataset the first ones its loader yields; with several validation
    dataloaders, the first loader's), read from the batch by
    :class:`~rank_lightning.layers.BatchReader` (``input_key``), captured at the first measurement and kept for the
    whole run: they are saved in checkpoints, so a resumed run measures the same inputs. The model's forward pass
    must accept them.

    Timing (:class:`~rank_lightning.callbacks.base.Cadence`): at the end of the validation of every
    ``every_n_epochs``-th epoch of ``fit`` (``(epoch + 1) % every_n_epochs == 0``, sanity check excluded) and of every
    ``trainer.validate`` run. The model runs in eval mode for the computation (BatchNorm uses its running statistics,
    as ``vmap`` needs; dropout is off) and every submodule's own training flag is restored afterwards. Forward-mode
    derivatives need no autograd graph: they work under ``torch.no_grad`` (validation inside ``fit``) and under
    ``torch.inference_mode`` (``trainer.validate``), because ``torch.func.jvp`` runs its function outside inference
    mode; the values are the same in all three settings. Under DDP, rank zero computes and broadcasts, so every
    process logs the same numbers (the others wait in the broadcast).

    Non-finite values never stop training: a block whose partial Jacobian holds NaN or Inf at an input (a NaN or Inf
    in its output or before it) logs NaN for its rank (and for that input's rank), with a warning naming it and the
    inputs that were non-finite (once per block); the blocks before it are unaffected. One such input of several
    makes the mean NaN: a mean over the finite inputs only would average other inputs than the other measurements
    do, so its curve would move without the model's rank moving. A Jacobian that is exactly zero (behind a layer of
    dead ReLUs) has rank 0.

    Curves (:class:`~rank_lightning.callbacks.curves.LayerCurves`, namespace ``"jacobian"``): the history is
    written to ``<run dir>/rank_curves/jacobian_curves.json`` at every measurement (appended); the figures
    ``jacobian_rank.png`` and ``jacobian_rank_max.png`` (rank against epoch, and rank against depth) are drawn at the
    end of fit and of ``trainer.validate``.

    Args:
        layers: block names (``pl_module.blocks()``), module names (``named_modules()``) or glob patterns
            (:func:`~rank_lightning.layers.select_layers`); ``None`` takes
            :func:`~rank_lightning.layers.default_layers` (the blocks of the package's modules).
        layer_types: keep only blocks of these module types (classes, class names or dotted paths).
        every_n_epochs: measure every this many epochs of ``fit``.
        num_inputs: number of fixed inputs the ranks are averaged over.
        patch_size: side of the central square patch; ``None`` for the default. Only for ``(C, H, W)`` inputs.
        patch: an explicit :class:`~rank_lightning.functional.jacobian.Patch` (any position, channels), or, for
            inputs of any shape (a video ``(C, T, H, W)``, features), a boolean mask of one input's shape or a 1-D
            tensor of flat indices into it; exclusive with ``patch_size``. Every coordinate of a video is more than
            :func:`~rank_lightning.functional.jacobian.partial_jacobian` takes: give it a patch.
        rank_tolerance: relative tolerance of the numerical rank; ``None`` is
            ``finfo(float32).eps * min(num_outputs, K)``, at least ``finfo(dtype).eps`` for a model whose weights are
            bfloat16 or float16 (``precision="bf16-true"``; the Jacobian is computed in the weights' dtype).
        tolerance_size: ``"min"`` (Feng et al.) or ``"max"`` dimension of ``J_P`` in the default tolerance.
        chunk_size: patch directions pushed through the model at once; ``None`` for all ``K`` (bounds memory only).
        input_key: where the inputs are in a batch (:class:`~rank_lightning.layers.BatchReader`); ``None`` takes
            the ``x`` of ``(x, y)`` batches, a tensor batch itself, or the usual keys of dict batches.
        log_per_input: also log the rank at each input.
        figures_every_n_epochs: also draw the figures after every this many measurements; ``None``: at the end only.
        verbose: print the monitored blocks and the patch at setup (rank zero).

    Logged metrics:
        ``jacobian/<block>/rank``: partial Jacobian rank averaged over the inputs.
        ``jacobian/<block>/rank_max``: the largest possible rank, ``min(num_outputs, K)``.
        ``jacobian/<block>/rank_input_<i>`` (with ``log_per_input``): the rank at input ``i``.

    Raises:
        ValueError: at construction for an invalid setting; at setup for an unknown layer (the message lists the
            valid names); at the first measurement for a patch that does not fit the inputs, or inputs that are
            not floating point (integer token ids have no Jacobian).

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
        layer_types: Sequence[type[nn.Module] | str] | None = None,
        every_n_epochs: int = 1,
        num_inputs: int = 4,
        patch_size: int | None = None,
        patch: Patch | Tensor | None = None,
        rank_tolerance: float | None = None,
        tolerance_size: Literal["min", "max"] = "min",
        chunk_size: int | None = None,
        input_key: int | str | None = None,
        log_per_input: bool = False,
        figures_every_n_epochs: int | None = None,
        verbose: bool = True,
    ) -> None:
        super().__init__(
            "jacobian",
            every_n_epochs=every_n_epochs,
            on_validate=True,
            figures_every_n_epochs=figures_every_n_epochs,
            verbose=verbose,
        )
        check_positive_int("num_inputs", num_inputs)
        check_positive_int("patch_size", patch_size, allow_none=True)
        check_positive_int("chunk_size", chunk_size, allow_none=True)
        check_positive("rank_tolerance", rank_tolerance, allow_none=True)
        if patch is not None and not isinstance(patch, (Patch, Tensor)):
            raise ValueError(
                "patch must be a rank_lightning.functional.jacobian.Patch, a boolean mask of one input's shape, a 1-D "
                f"tensor of flat indices or None, got {patch!r}"
            )
        if patch is not None and patch_size is not None:
            raise ValueError(f"give patch or patch_size, not both (got patch={patch}, patch_size={patch_size})")
        self.layers = check_names("layers", layers)
        self.layer_types = None if layer_types is None else check_layer_types(layer_types)
        self.num_inputs = num_inputs
        self.patch_size = patch_size
        self.patch = patch
        self.rank_tolerance = rank_tolerance
        self.tolerance_size = check_choice("tolerance_size", tolerance_size, _TOLERANCE_SIZES)
        self.chunk_size = chunk_size
        self.reader = BatchReader(input_key=input_key)
        self.log_per_input = check_bool("log_per_input", log_per_input)
        self._layers: dict[str, str] = {}
        self._inputs: Tensor | None = None

    @property
    @override
    def state_key(self) -> str:
        layers = None if self.layers is None else list(self.layers)
        return self._generate_state_key(layers=layers, num_inputs=self.num_inputs)

    @property
    def monitored(self) -> dict[str, str]:
        """``logged name -> module path`` of the monitored blocks, in depth order (empty before setup)."""
        return dict(self._layers)

    @property
    def inputs(self) -> Tensor | None:
        """The fixed inputs ``(num_inputs, ...)`` on the CPU; ``None`` before the first measurement."""
        return self._inputs

    def select(self, module: nn.Module) -> dict[str, str]:
        """Resolve ``layers`` and ``layer_types`` against ``module``; returns ``logged name -> module path``.

        Raises:
            ValueError: a name, pattern or type that matches no module (the message lists the valid names).
        """
        self._layers = select_layers(module, self.layers, self.layer_types)
        return self.monitored

    def resolve_patch(self, sample_shape: Sequence[int]) -> Patch | Tensor | None:
        """The patch used for inputs of shape ``sample_shape``; ``None`` means all coordinates (non-image inputs).

        Raises:
            ValueError: ``patch_size`` for inputs that are not ``(C, H, W)`` images, or a patch that does not fit.
        """
        if isinstance(self.patch, Patch):
            self.patch.mask(sample_shape)
        if self.patch is not None:
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
            rank_tolerance=self.rank_tolerance,
            tolerance_size=self.tolerance_size,
            chunk_size=self.chunk_size,
            eval_mode=True,
        )

    @override
    def prepare(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        check_distinct_namespaces(trainer, self)
        self.select(pl_module)
        names = ", ".join(name if name == path else f"{name} ({path})" for name, path in self._layers.items())
        blocks, inputs = count_of(len(self._layers), "block"), count_of(self.num_inputs, "input")
        self.info(f"{blocks}, {inputs}, patch {self._patch_text()}: {names}")

    def _patch_text(self) -> str:
        if isinstance(self.patch, Tensor):
            if self.patch.dtype == torch.bool:
                return f"a mask of {count_of(int(self.patch.sum()), 'coordinate')}"
            return count_of(self.patch.numel(), "flat index", "flat indices")
        if self.patch is not None:
            return str(self.patch)
        return "central, default size" if self.patch_size is None else f"central {self.patch_size}x{self.patch_size}"

    def _capture_inputs(self, trainer: pl.Trainer) -> Tensor | None:
        """The first ``num_inputs`` inputs of the first validation dataset, as a CPU tensor; ``None`` without data."""
        loader = first_val_loader(trainer)
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
            x = self.reader.inputs(loader.collate_fn([dataset[i] for i in range(count)]))
        else:
            pieces, taken = [], 0
            for batch in loader:
                pieces.append(self.reader.inputs(batch)[: self.num_inputs - taken])
                taken += pieces[-1].shape[0]
                if taken >= self.num_inputs:
                    break
            if not pieces:
                return None
            x = torch.cat(pieces)
        # Outside inference mode the copy is an ordinary tensor that checkpoints and later runs can use.
        with torch.inference_mode(False):
            return x.detach().to("cpu").clone()

    def _measure_values(self, trainer: pl.Trainer, pl_module: nn.Module) -> dict[str, dict[str, float]] | None:
        """``block -> metric -> value`` at the fixed inputs (captured now if need be); ``None`` without data."""
        if self._inputs is None:
            self._inputs = self._capture_inputs(trainer)
            if self._inputs is not None and self._inputs.shape[0] < self.num_inputs:
                found = count_of(self._inputs.shape[0], "input")
                message = f"num_inputs={self.num_inputs}, but the validation data holds {found} only: the ranks are "
                self.warn_once(("few inputs",), message + "averaged over those")
        if self._inputs is None:
            self.warn_once(("no validation data",), "no validation data to take inputs from; nothing measured")
            return None
        self._warn_reduced_products(pl_module)
        with warnings.catch_warnings():
            # A non-finite Jacobian is reported below, naming its block, once instead of once per input and epoch.
            warnings.filterwarnings("ignore", r".* contains NaN or Inf values; the spectrum", RuntimeWarning)
            results = self.measure(pl_module)
        values = {}
        for name, result in results.items():
            if math.isnan(result.mean):
                bad = [i for i, rank in enumerate(result.ranks.tolist()) if not math.isfinite(rank)]
                which = ("input " if len(bad) == 1 else "inputs ") + ", ".join(map(str, bad))
                self.warn_once(
                    ("not finite", name),
                    f"the partial Jacobian of block {name!r} holds NaN or Inf values at {len(bad)} of the "
                    f"{len(result.ranks)} inputs ({which}); its rank, the mean over the inputs, is logged as "
                    "NaN while any input's is (log_per_input=True logs the rank at each input)",
                    RuntimeWarning,
                )
            values[name] = {"rank": result.mean, "rank_max": float(result.max_rank)}
            if self.log_per_input:
                values[name].update({f"rank_input_{i}": float(r) for i, r in enumerate(result.ranks)})
        return values

    def _warn_reduced_products(self, pl_module: nn.Module) -> None:
        """Warn (once) when the default tolerance meets a float32 Jacobian whose products torch's flags let run in TF32
        or bf16 (:func:`~rank_lightning.functional.streaming.reduced_float32_format`: cuDNN convolutions by default on
        GPUs with TF32 units, matrix products after ``torch.set_float32_matmul_precision("high")``): their rounding
        noise, at float16's or bfloat16's level, counts as rank under the float32 tolerance."""
        parameter = next((p for p in pl_module.parameters() if p.is_floating_point()), None)
        if self.rank_tolerance is not None or parameter is None or parameter.dtype != torch.float32:
            return
        device = parameter.device.type
        convs = any(isinstance(m, nn.modules.conv._ConvNd) for m in pl_module.modules())
        reduced = reduced_float32_format(device, conv=False) or (convs and reduced_float32_format(device, conv=True))
        if reduced:
            eps = torch.finfo(torch.float16 if reduced == "tf32" else torch.bfloat16).eps
            message = (
                f"the Jacobians are float32 computed with {reduced.upper()} products (torch's fp32_precision flags, "
                "torch.set_float32_matmul_precision, or cuDNN's TF32 default), whose rounding noise counts as rank "
                f"under the default float32 tolerance. Set rank_tolerance (at least {eps:.3g}, that precision's eps), "
                "or turn them off for float32 products (torch.backends.cudnn.allow_tf32 = False, "
                'torch.set_float32_matmul_precision("highest")).'
            )
            self.warn_once(("reduced products",), message)

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.due(trainer):
            return
        values = None
        if trainer.is_global_zero:
            # A loader that has to be iterated for the inputs draws a seed: the fit's stays that of the unmonitored fit.
            with random_state_kept(pl_module, [first_val_loader(trainer)]):
                values = self._measure_values(trainer, pl_module)
        values = trainer.strategy.broadcast(values, src=0)
        if values:
            self.curves.record_and_log(trainer, pl_module, values)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "inputs": self._inputs}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        inputs = state_dict.get("inputs")
        self._inputs = None if inputs is None else inputs.detach().to("cpu")
