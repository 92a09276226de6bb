"""Per-layer activation ranks in a plain PyTorch loop, without Lightning: :class:`RankTracker`.

The tracker hooks the chosen layers of a model around the user's own forward passes and streams their outputs into
one float64 :class:`~rank_lightning.metrics.ActivationSpectrum` per layer, through the same
:class:`~rank_lightning.streams.ActivationStream` that :class:`~rank_lightning.callbacks.ActivationRankMonitor` runs
in Lightning: on the same batches both give the same numbers.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from types import TracebackType
from typing import Any, Literal

import torch
from torch import Tensor, nn

from rank_lightning.functional.reductions import CONV_REDUCTIONS, TOKEN_REDUCTIONS
from rank_lightning.layers import (
    BatchReader,
    OutputSelector,
    channel_first_layers,
    channels_last_layers,
    check_layer_types,
    select_layers,
    token_layouts,
)
from rank_lightning.metrics import ACTIVATION_METRICS, DEFAULT_ACTIVATION_METRICS, ActivationSpectrum
from rank_lightning.streams import REPEATED_CALLS, ActivationStream, in_backward
from rank_lightning.validation import (
    check_choice,
    check_choices,
    check_metric_ks,
    check_names,
    check_positive,
    check_positive_int,
)

__all__ = ["TOKEN_LAYOUTS", "RankTracker"]

TOKEN_LAYOUTS = ("auto", "batch_first", "sequence_first")
"""Valid ``token_layout`` values: learnt from the layer or the batch shape, or given."""


class RankTracker:
    """Per-layer rank metrics of a model's activations over the forward passes of a hand-written loop.

    Use it as a context manager around the forward passes to measure, then call :meth:`compute`. Labels (for the
    class metrics: TCV, class-wise variance ratio) come per batch through :meth:`batch`; a forward pass outside
    :meth:`batch` is one batch of its own, its labels read from keyword inputs (``model(**batch)`` with a
    ``labels`` entry) and none from a tensor. The settings mean what they mean for
    :class:`~rank_lightning.callbacks.ActivationRankMonitor`, whose streaming code the tracker runs
    (:class:`~rank_lightning.streams.ActivationStream`), so the values equal the monitor's logged values on the same
    batches (without the ``rank/`` prefix).

    Example::

        tracker = RankTracker(model, layers=["layer3", "layer4"], num_classes=10)
        model.eval()
        with torch.no_grad(), tracker:
            for x, y in loader:
                with tracker.batch(labels=y):
                    model(x)
        values = tracker.compute()  # {"layer3": {"channel/numerical_rank": ..., ...}, "layer4": {...}}

    Args:
        model: the network; its layers are chosen once, here.
        layers: layer names as every callback takes them (block name, module path, glob; see
            :func:`~rank_lightning.layers.select_layers`); default: the model's blocks, or the repeated blocks that
            :func:`~rank_lightning.layers.default_layers` finds.
        layer_types: module types (or their names) whose instances are monitored, alone or besides ``layers``.
        num_classes: classes of the labels; ``None`` skips the class metrics.
        max_samples: inputs measured per pass, spread evenly over ``num_batches`` when given; ``None`` for all.
        num_batches: batches a pass will see, for spreading ``max_samples``; ``None`` when unknown (then the first
            ``max_samples`` inputs are measured).
        conv_reduction: ``(B, C, H, W)`` (and ``(B, C, D1, D2, D3)``) outputs: ``"channel"``, ``"flatten"`` or
            ``"mean"``.
        token_reduction: ``(B, T, D)`` outputs: ``"token"``, ``"flatten"``, ``"cls"``, ``"mean"`` or ``"last"``
            (each sequence's last real token, a decoder-only model's sequence embedding).
        metrics: which of :data:`~rank_lightning.metrics.ACTIVATION_METRICS` to compute.
        variance_ratio_ks: the ``k`` of ``variance_ratio_<k>`` (Sanyal et al. eq. 7).
        soft_rank_tau: the threshold of the soft rank (Daneshmand et al. eq. 3).
        rank_tolerance: the numerical rank's tolerance (Feng et al. eq. 4); ``None`` for ``finfo(float32).eps * K``.
        tolerance_size: ``K = min(N, d)`` (``"min"``) or ``max(N, d)`` (``"max"``).
        tolerance_dtype: whose machine epsilon the default tolerance uses (see
            :class:`~rank_lightning.metrics.ActivationSpectrum`).
        gram_precision: precision of the Gram products (see :class:`~rank_lightning.metrics.ActivationSpectrum`).
        center: subtract the feature mean before the spectrum (``False`` or ``True``).
        alpha_req_range: the eigenvalue ranks of the ``alpha_req`` fit (see
            :class:`~rank_lightning.metrics.ActivationSpectrum`).
        log_per_class: also return the per-class values of the class-wise metrics.
        max_gram_features: layers wider than this use the subsample (or sketch) fallback.
        memory_budget_mb: total memory the states of all layers may take; ``None`` for no total limit, each layer's
            states then within the 1024 MiB default of :class:`~rank_lightning.metrics.ActivationSpectrum`.
        token_layout: ``"auto"``, ``"batch_first"`` or ``"sequence_first"`` for token outputs.
        output_selector: which tensor of a layer's output is its hidden state (see
            :func:`~rank_lightning.layers.hidden_state`).
        repeated_calls: a layer called more than once per forward pass (a block applied N times): ``"first"``
            measures its first call, with a warning; ``"each"`` its ``k``-th call as layer ``<layer>@<k>``, as in
            :class:`~rank_lightning.callbacks.ActivationRankMonitor`.
        label_key: where :meth:`batch`'s ``batch=`` holds the labels (index or key); default as the callbacks.
        label_fn: ``batch -> labels``, instead of ``label_key``.
        mask_key: where ``batch=`` holds the attention mask: an index, a key, a function ``batch -> mask``, or
            ``False`` for none (default ``attention_mask`` of dict batches). By default
            (and with ``"attention_mask"``) the layers in the decoder of an encoder-decoder model read the
            batch's ``decoder_attention_mask`` instead (:func:`~rank_lightning.layers.decoder_layers`), and the
            layers in an image tower that takes no attention mask none (:func:`~rank_lightning.layers.unmasked_layers`);
            another ``mask_key`` names the mask of every layer.
        unbatched: measure all ``N`` rows of every layer's ``(N, d)`` output whatever ``N``, with no mask and no
            labels: the tokens routed to an expert of a mixture-of-experts layer, a router's logits, as in
            :class:`~rank_lightning.callbacks.ActivationRankMonitor`.

    Raises:
        ValueError: a bad setting, or a layer name that matches no layer of ``model`` (the valid names listed).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        layers: Sequence[str] | None = None,
        layer_types: Sequence[type[nn.Module] | str] | None = None,
        num_classes: int | None = None,
        max_samples: int | None = None,
        num_batches: int | None = None,
        conv_reduction: str = "channel",
        token_reduction: str = "token",
        metrics: Sequence[str] = DEFAULT_ACTIVATION_METRICS,
        variance_ratio_ks: Sequence[int] = (1, 10),
        soft_rank_tau: float = 0.5,
        rank_tolerance: float | None = None,
        tolerance_size: Literal["min", "max"] = "min",
        tolerance_dtype: str | torch.dtype | None = None,
        gram_precision: str = "auto",
        center: bool = False,
        alpha_req_range: tuple[int, int | None] = (1, None),
        log_per_class: bool = False,
        max_gram_features: int = 4096,
        memory_budget_mb: float | None = 4096.0,
        token_layout: Literal["auto", "batch_first", "sequence_first"] = "auto",
        output_selector: OutputSelector | None = None,
        repeated_calls: Literal["first", "each"] = "first",
        label_key: int | str | None = None,
        label_fn: Callable[[Any], Any] | None = None,
        mask_key: Literal[False] | int | str | Callable[[Any], Tensor | None] | None = None,
        unbatched: bool = False,
    ) -> None:
        for name, value in (("max_samples", max_samples), ("num_classes", num_classes), ("num_batches", num_batches)):
            check_positive_int(name, value, allow_none=True)
        check_positive("memory_budget_mb", memory_budget_mb, allow_none=True)
        self.model = model
        self.num_classes, self.num_batches = num_classes, num_batches
        self.metrics = check_choices("metrics", metrics, ACTIVATION_METRICS)
        self.center = check_choice("center", center, (False, True))
        self.log_per_class = log_per_class
        reductions = {
            4: check_choice("conv_reduction", conv_reduction, CONV_REDUCTIONS),
            3: check_choice("token_reduction", token_reduction, TOKEN_REDUCTIONS),
        }
        layout = check_choice("token_layout", token_layout, TOKEN_LAYOUTS)
        check_choice("unbatched", unbatched, (False, True))
        spectrum_options = dict(
            center=center,
            alpha_req_range=alpha_req_range,
            variance_ratio_ks=check_metric_ks("variance_ratio_ks", variance_ratio_ks, "variance_ratio", self.metrics),
            soft_rank_tau=soft_rank_tau,
            rank_tolerance=rank_tolerance,
            tolerance_size=tolerance_size,
            tolerance_dtype=tolerance_dtype,
            gram_precision=gram_precision,
            classwise="classwise_variance_ratio" in self.metrics,
            max_gram_features=max_gram_features,
        )
        ActivationSpectrum(**spectrum_options)  # bad settings fail here, not at the first batch
        types = None if layer_types is None else check_layer_types(layer_types)
        self.layers = select_layers(model, check_names("layers", layers), types)
        layouts, ambiguous_layouts = token_layouts(model, self.layers, layout)
        self.stream = ActivationStream(
            self.layers,
            num_classes=num_classes,
            reductions=reductions,
            spectrum_options=spectrum_options,
            batch_reader=BatchReader(label_key=label_key, label_fn=label_fn, mask_key=mask_key),
            layouts=layouts,
            ambiguous_layouts=ambiguous_layouts,
            channel_maps=channel_first_layers(model, self.layers),
            channels_last=channels_last_layers(model, self.layers),
            output_selector=output_selector,
            repeated_calls=check_choice("repeated_calls", repeated_calls, REPEATED_CALLS),
            unbatched=unbatched,
            max_samples=max_samples,
            memory_budget_mb=memory_budget_mb,
            warn=self._warn_once,
        )
        self._warned: set[tuple[str, str]] = set()
        self._explicit_batch = False
        self._root_hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._loader: Any = None
        self._uncomputed = 0  # inputs measured in passes that ended without compute()

    def _warn_once(self, layer: str, kind: str, message: str) -> None:
        """Warn about a layer's problem of one kind once, as the callbacks do (not at every pass)."""
        if (layer, kind) not in self._warned:
            self._warned.add((layer, kind))
            warnings.warn(f"layer {layer!r} {message}" if layer else message, UserWarning, stacklevel=4)

    # -- a pass -----------------------------------------------------------------------------------------------------

    def over(self, loader: Any) -> RankTracker:
        """Tell the tracker that its passes go over ``loader``, one batch per :meth:`batch` (or forward pass), from
        the next :meth:`start` to the end of the ``with`` block: ``with tracker.over(val_loader):``. Returns the
        tracker.

        Under ``torch.distributed`` with a ``DistributedSampler`` (``drop_last=False``), the samples the sampler
        repeats at the end of this process's pass to even out the processes are then left out, so the processes
        together measure every sample once, as one process would (:mod:`rank_lightning.sampling`). Without
        ``num_batches``, ``max_samples`` is spread over the loader's length.
        """
        self._loader = loader
        return self

    def start(self) -> RankTracker:
        """Hook the layers and start a pass; what runs from now on is measured (until :meth:`stop` or
        :meth:`compute`). The sums of an earlier pass that :meth:`compute` did not read are dropped, with a warning."""
        self.stop()
        if self._uncomputed:
            message = (
                f"RankTracker: a new pass starts and drops the {self._uncomputed} input(s) measured since the last "
                "compute(); each `with tracker:` block (or start()) is a pass of its own: call compute() before the "
                "next one, or keep one block around every forward pass of the pass"
            )
            self._warn_once("", "uncomputed pass", message)
            self._uncomputed = 0
        batches = math.inf if self.num_batches is None else self.num_batches
        if self.num_batches is None and self._loader is not None:
            try:
                batches = len(self._loader)
            except TypeError:  # an iterable dataset of unknown length
                pass
        world_size = torch.distributed.get_world_size() if _distributed() else 1
        rank = torch.distributed.get_rank() if _distributed() else 0
        loaders = () if self._loader is None else (self._loader,)
        self.stream.start(self.model, num_batches=batches, world_size=world_size, rank=rank, loaders=loaders)
        self._root_hooks = [
            self.model.register_forward_pre_hook(self._implicit_batch_start, with_kwargs=True),
            self.model.register_forward_hook(self._implicit_batch_end),
        ]
        return self

    def stop(self) -> None:
        """Remove the hooks; the sums stay until :meth:`compute` (or the next :meth:`start`)."""
        self._uncomputed += self.stream.inputs_measured if self.stream.active else 0
        for handle in self._root_hooks:
            handle.remove()
        self._root_hooks = []
        self.stream.stop()

    def __enter__(self) -> RankTracker:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.stop()
        self._loader = None  # over() applies to its block only

    @contextmanager
    def batch(
        self,
        labels: Tensor | None = None,
        *,
        batch: Any = None,
        mask: Tensor | None = None,
        decoder_mask: Tensor | None = None,
    ) -> Iterator[None]:
        """The forward passes inside are one batch, with these labels (and attention masks).

        Args:
            labels: ``(B,)`` class labels of the batch.
            batch: the batch as the loader gave it; labels (and the masks) are read from it when not given, as the
                callbacks read them (``batch[1]``, or a dict's ``labels``/``label``/``y``/...; ``label_key``).
            mask: ``(B, T)`` attention mask of token inputs (padded positions are not measured).
            decoder_mask: ``(B, T')`` mask of the target tokens of an encoder-decoder model, taken by the
                layers in its decoder (``decoder_attention_mask`` of ``batch`` when not given); ``mask`` is then the
                encoder's. With a ``mask_key`` of the tracker's own (other than ``"attention_mask"``), ``mask`` is
                every layer's and ``decoder_mask`` is not used.
        """
        if not self.stream.active:
            raise RuntimeError("RankTracker.batch() outside a pass: use `with tracker:` (or tracker.start()) first")
        self.stream.batch_start(batch, labels=labels, mask=mask, decoder_mask=decoder_mask)
        self._explicit_batch = True
        try:
            yield
        finally:
            self._explicit_batch = False
            self.stream.batch_end()

    def _implicit_batch_start(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        # A forward pass outside batch() is one batch: the first positional input (a tensor: no labels), or the
        # keyword inputs (``model(**batch)``: labels and attention mask read from them as from a dict batch). A call
        # made by the backward pass is activation checkpointing recomputing a forward pass (``checkpoint(model, x)``):
        # no batch of its own.
        if not self._explicit_batch and self.stream.active and not in_backward():
            self.stream.batch_start(args[0] if args else dict(kwargs))

    def _implicit_batch_end(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if not self._explicit_batch and self.stream.active and not in_backward():
            self.stream.batch_end()

    # -- the values -------------------------------------------------------------------------------------------------

    @property
    def inputs_measured(self) -> int:
        """Inputs measured in the current pass (on this process)."""
        return self.stream.inputs_measured

    def compute(self) -> dict[str, dict[str, float]]:
        """The metrics of every measured layer, ``{layer: {key: value}}``; ends the pass and resets the sums.

        The keys are the monitor's logged keys without ``rank/<layer>/``: ``numerical_rank``, ``soft_rank``, ...,
        with the reduction first for conv and token layers (``channel/numerical_rank``). Under
        ``torch.distributed`` this is a collective: every process calls it and gets the values of all processes'
        rows. Inside ``with tracker:`` a new pass starts right away.
        """
        hooked = self.stream.active
        self._uncomputed = 0
        device = next((p.device for p in self.model.parameters()), torch.device("cpu"))
        values, _ = self.stream.compute(
            device, metrics=self.metrics, centered=self.center, per_class=self.log_per_class, when="in this pass"
        )
        if hooked:
            self.start()
        return values


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()
