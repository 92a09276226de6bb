"""Per-layer spectral metrics of weight matrices, logged every few epochs by :class:`WeightRankMonitor`."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import pytorch_lightning as pl
import torch
from torch import nn
from typing_extensions import override

from rank_lightning.callbacks.base import CurveMonitor
from rank_lightning.callbacks.curves import check_distinct_namespaces, check_namespace, wandb_loggers
from rank_lightning.distributed import SHARDINGS, fsdp_parameter_shapes, weight_matrix_spectra
from rank_lightning.files import writes_files
from rank_lightning.functional.spectral import Spectrum, default_rank_tolerance, summarize
from rank_lightning.functional.weights import DECOMPOSITIONS
from rank_lightning.layers import check_layer_types, frozen_copies, select_layers, unapplied_copies
from rank_lightning.validation import (
    check_bool,
    check_choice,
    check_choices,
    check_metric_ks,
    check_names,
    check_positive,
    check_tolerance_dtype,
    count_of,
)
from rank_lightning.weight_matrices import (
    LORA_UPDATE_SUFFIX,
    ParameterShapes,
    WeightMatrix,
    is_lora_layer,
    is_weight_layer,
    logged_name,
    lora_unread_reason,
    matrices_of,
    parameter_shape,
    parent_layer,
    unread_stacks,
)

__all__ = ["DECOMPOSITIONS", "WEIGHT_METRICS", "WeightRankMonitor"]

WEIGHT_METRICS: tuple[str, ...] = (
    "numerical_rank",
    "stable_rank",
    "effective_rank",
    "spectral_norm",
    "tail_error",
    "alpha",
)
"""Metric families the monitor can log (names of :func:`~rank_lightning.functional.spectral.summarize`); all but
``alpha`` are logged by default."""
_TOLERANCE_SIZES = ("min", "max")
_HALF_PRECISION = (torch.bfloat16, torch.float16)


def _tolerance_advice(names: list[str], dtype: torch.dtype) -> str:
    """The warning for half-precision weights measured with the float32 tolerance, naming up to ten layers."""
    shown = ", ".join(repr(name) for name in names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
    subject = f"layer {shown} stores its" if len(names) == 1 else f"layers {shown} store their"
    dtype_name = str(dtype).removeprefix("torch.")
    return (
        f"{subject} weights in {dtype_name}, but numerical_rank takes the float32 tolerance, under which their "
        "rounding noise counts as rank. Set tolerance_dtype='input' for the tolerance of each weight's dtype (or "
        f"tolerance_dtype=torch.{dtype_name}; tolerance_dtype=torch.float32 keeps the float32 rule without this "
        "warning)."
    )


def _strategy_root(module: nn.Module) -> nn.Module:
    """The model as the trainer's strategy wrapped it (FSDP1 units live there), else ``module`` itself."""
    trainer = getattr(module, "_trainer", None)
    wrapped = getattr(trainer, "model", None) if trainer is not None else None
    return wrapped if isinstance(wrapped, nn.Module) else module


def _outer_layer(name: str, layers: set[str]) -> str | None:
    """The member of ``layers`` that holds the module ``name`` (``name`` itself excluded); ``None`` if none does."""
    parts = name.split(".")
    for end in range(1, len(parts)):
        outer = ".".join(parts[:end])
        if outer in layers:
            return outer
    return None


def _weight_candidates(
    module: nn.Module, modules: dict[str, nn.Module], read: set[str], shapes: Any
) -> dict[str, nn.Module]:
    """The layers whose weights may be chosen: every weight layer, except the parts of the LoRA layers ``read`` as one
    (their ``base_layer`` and factors) and peft's copies the forward pass does not apply
    (:func:`~rank_lightning.layers.unapplied_copies`)."""
    unapplied = unapplied_copies(module)  # the frozen original of a layer peft trains as a copy (modules_to_save)
    return {
        name: m
        for name, m in modules.items()
        if name
        and is_weight_layer(m, shapes=shapes)
        and _outer_layer(name, read) is None
        and name not in unapplied
        and _outer_layer(name, unapplied) is None
    }


class WeightRankMonitor(CurveMonitor):
    """Log the numerical, stable and effective rank, spectral norm and tail errors of every layer's weight matrix.

    Works with any LightningModule (nothing to inherit) and with both ``pytorch_lightning`` and
    ``lightning.pytorch`` trainers. Monitored by default: every ``nn.Linear``, ``nn.Conv1d/2d/3d``,
    ``nn.MultiheadAttention``, ``transformers``' ``Conv1D`` (GPT-2's projections) and every layer holding 3-D expert
    stacks (``transformers`` 5.x mixture-of-experts layers such as ``MixtralExperts``). Matrices, every one read as
    ``(out, fan_in)`` (:mod:`rank_lightning.weight_matrices`):

    * Linear: the ``(out, in)`` weight.
    * Conv: the ``(out, in / groups, *kernel)`` weight reshaped to ``out x (in / groups * prod(kernel))`` (every kernel
      offset of an output channel in its row; WeightWatcher splits per offset instead). A grouped conv (``groups >
      1``: ResNeXt, RegNet, depthwise convs) maps each group's ``in / groups`` input channels to its ``out / groups``
      outputs alone: its matrix is the block-diagonal ``out x (in * prod(kernel))`` one of the groups' filters, whose
      singular values are the union of the groups' own, computed exactly (every group a member of the batched
      decompositions). A depthwise conv's (one input channel per group) are its filters' norms: its numerical rank
      counts its non-zero filters.
    * ``Conv1D``: the transpose of the stored ``(in, out)`` weight, so its spectrum is that of the equivalent Linear.
    * Attention: the query, key and value blocks of the input projection (``<name>.q_proj``, ``<name>.k_proj``,
      ``<name>.v_proj``, each ``(embed_dim, in)``) and the output projection ``<name>.out_proj``; GPT-2's fused
      ``c_attn`` likewise as ``<name>.q_proj``, ``<name>.k_proj``, ``<name>.v_proj`` (``split_fused``), and the
      fused ``nn.Linear`` projections of GPT-NeoX / Pythia and Bloom (``query_key_value``, heads interleaved),
      Falcon (``query_key_value``: multi-query, grouped-query and per-head layouts), Phi-3 (``qkv_proj``, and the
      MLP's ``gate_up_proj`` as ``<name>.gate_proj`` and ``<name>.up_proj``), GPT-BigCode (``c_attn``), CodeGen,
      DBRX, ModernBERT, MPT, Persimmon, and timm's ViT and other attentions (``qkv``, ``kv``), each into the rows
      its layer's forward pass takes for q, k and v (every other fused Linear is one matrix; the list is in
      :mod:`rank_lightning.weight_matrices`).
    * Experts: every expert ``e`` of a fused ``(E, ., .)`` stack on its own, in the layout the layer declares through
      ``transformers``' ``use_experts_implementation`` (``is_transposed``, ``is_concatenated``, ``has_gate``): a
      concatenated ``gate_up_proj`` ``(E, 2I, H)`` as ``<name>.<e>.gate_proj`` and ``<name>.<e>.up_proj`` (rows
      ``[0, I)`` and ``[I, 2I)``, split like ``c_attn``; ``<name>.<e>.gate_up_proj`` with ``split_fused=False`` or
      when gate and up rows alternate), ``up_proj`` and ``down_proj`` as ``<name>.<e>.up_proj`` and
      ``<name>.<e>.down_proj``. The experts of all layers go through the batched decompositions below together. A
      3-D parameter in no layout the monitor knows (a stack of a layer that declares none, such as Llama 4's, or
      another 3-D parameter of an experts layer) is not measured, and a warning names it once.
    * LoRA (``peft``): a LoRA layer is one layer, named as in the model without peft (``...attn.c_attn``, its
      ``base_layer`` and ``lora_A`` / ``lora_B`` factors are not layers of their own), whose matrices are those of
      its base layer (``c_attn`` split as above) holding the weight it applies, ``W + (alpha / r) B A`` summed over
      its active adapters (the spectra of the merged model, ``merge_and_unload()``), and with ``lora_update``, the
      update ``(alpha / r) B A`` alone, ``<matrix>.lora_update``. A LoRA layer whose weight takes another form (DoRA,
      a quantized or non-Linear base) is read as its parts, with a warning naming it once.

    Sharded weights (``ModelParallelStrategy`` / FSDP2 ``DTensor``, ``FSDPStrategy``, ``DeepSpeedStrategy`` ZeRO-3)
    are never analysed piece by piece: the Gram of a matrix split by rows is the sum of its pieces' Grams (one
    all-reduce for all layers), otherwise the matrix is gathered one layer at a time (see ``sharding`` and
    :mod:`rank_lightning.distributed`); a layout that is not supported raises an error naming the strategies that are.

    Spectra are computed in float64 with one batched decomposition per distinct matrix shape (per GiB of float64
    matrices of that shape; :func:`~rank_lightning.functional.weights.weight_spectra`, see ``decomposition``); the
    metrics come from :func:`~rank_lightning.functional.spectral.summarize`. Values are computed identically on every
    rank and logged on every rank, so ``ModelCheckpoint`` and ``EarlyStopping`` can monitor them. A matrix holding NaN
    or Inf never stops training: its metrics are NaN while it does, with a warning naming the layer (once); the
    others are unaffected.

    Timing: during ``fit``, after validation in every ``every_n_epochs``-th epoch (``(epoch + 1) % every_n_epochs ==
    0``), or at the end of that training epoch when no validation ran; with ``every_n_train_steps=N``, right after
    every N-th optimizer step instead. Sanity checks, ``validate`` and ``test`` are
    not monitored. At the end of fit the figures of
    :class:`~rank_lightning.callbacks.curves.LayerCurves` are drawn into ``<run dir>/rank_curves/``.

    Args:
        layers: the layers to monitor, in the syntax of :func:`~rank_lightning.layers.select_layers`: block names of
            ``pl_module.blocks()`` (the package's modules: ``"layer4"``), exact names as in
            ``pl_module.named_modules()``, glob patterns matched with ``fnmatch`` (``"backbone.layer4.*"``). A block
            or container (``"backbone.layer1"``) selects every monitorable layer inside it. ``None``: every
            monitorable layer.
        layer_types: keep only layers of these types: classes (``nn.Conv2d``), class names (``"Conv2d"``, matched
            against the class and its bases) or dotted import paths (``"torch.nn.Linear"``). ``None``: all types.
        metrics: metrics to log, among ``WEIGHT_METRICS`` (default: all but ``alpha``, whose fit scores every
            eigenvalue as a candidate ``x_min``, O(K^2) per matrix).
        tail_ranks: the ``k`` of each logged tail error (Zangrando et al. eq. 22).
        every_n_epochs: monitor every this many epochs (default ``1`` without ``every_n_train_steps``).
        every_n_train_steps: monitor right after every this many optimizer steps instead (counting optimizer steps,
            not the micro-batches of gradient accumulation); the curves are then keyed by ``trainer.global_step``
            (figures, charts ``weight_curves/<metric>_vs_step``, ``step_XXXXXXXX.npz``) and the initial point is step
            ``0``. Under manual optimization a batch takes one step per ``optimizer.step()``; a batch whose steps pass
            a multiple of N is measured at the step it ends on. Setting both cadences is an error.
        rank_tolerance: relative tolerance ``eps`` of the numerical rank; ``None`` is the default of
            ``tolerance_dtype``: ``finfo(float32).eps * K`` (Feng et al. eq. 4), for bfloat16 and float16 their
            ``eps`` (:func:`~rank_lightning.functional.default_rank_tolerance`).
        tolerance_size: ``K`` of the default tolerance: ``"min"`` (``min(out, in)``, Feng) or ``"max"`` (NumPy,
            WeightWatcher).
        tolerance_dtype: the dtype of the default tolerance, as in
            :class:`~rank_lightning.callbacks.ActivationRankMonitor`: ``None`` for float32 (Feng et al.'s
            convention, right for float32 weights), a ``torch.dtype`` or its name (``torch.bfloat16``), or
            ``"input"`` for each matrix's stored dtype (bf16 under ``precision="bf16-true"``; float32 master weights
            under ``"bf16-mixed"``, whose float32 tolerance is right for them). Weights stored in bfloat16 or float16
            carry rounding noise of about ``eps * s_1`` that a float32 tolerance counts as rank (a rank-8 matrix
            rounded to bf16 reads as full rank): measured with the default tolerance, such layers are named in a
            warning with the setting to use (each layer once, at most ten named per warning). Exclusive with
            ``rank_tolerance``.
        decomposition: how spectra are computed, in float64 either way (error bounds in
            :func:`~rank_lightning.functional.weights.weight_spectra`). ``"svd"``: ``torch.linalg.svdvals``, exact to
            rounding (within a few ``eps_float64 * s_1``). ``"gram"``: eigenvalues of the smaller Gram matrix,
            ``W W^T`` or ``W^T W``, 1.5-1.8x faster on a CPU; absolute error up to about ``1.5e-8 * s_1`` on any
            singular value, far below the default numerical-rank tolerance but not below a tiny ``rank_tolerance``,
            and tail errors under about ``1e-6`` lose digits. ``"auto"`` (default): for weights stored in float32 or
            narrower the Gram route, with an exact SVD for every matrix whose ``s_min < 1e-3 * s_1``, so that every
            singular value is accurate to about ``1e-10`` relative; ``"svd"`` for float64 weights.
        split_fused: read fused query/key/value projections (``nn.MultiheadAttention.in_proj_weight``, GPT-2's
            ``c_attn``, the fused Linears of GPT-NeoX, Bloom, Falcon, Phi-3, GPT-BigCode, timm, ...) as three
            matrices ``<name>.q_proj``, ``.k_proj``, ``.v_proj``, and fused gate/up projections (experts'
            ``gate_up_proj``, Phi-3's) as ``<name>.<e>.gate_proj`` and ``.up_proj`` (``<name>.gate_proj`` and
            ``.up_proj``); ``False``: as one matrix (``<name>.in_proj`` for ``nn.MultiheadAttention``, ``<name>``
            for ``c_attn`` and a fused Linear, ``<name>.<e>.gate_up_proj`` for experts).
        lora_update: for every LoRA layer of ``peft``, also measure the update ``(alpha / r) B A`` of its active
            adapters on its own, ``<matrix>.lora_update`` beside each of its matrices (rank at most ``r``; all zeros,
            numerical rank 0, while ``B`` is at its zero initialisation). ``False``: the applied weights alone.
        sharding: how weights sharded by a strategy are read, exactly either way
            (:data:`~rank_lightning.distributed.SHARDINGS`): ``"auto"`` (default) sums the pieces' Grams where that
            Gram is the smaller one and gathers one layer at a time otherwise; ``"gram"`` sums Grams wherever the
            layout allows; ``"gather"`` always gathers. No effect on weights held in full.
        save_singular_values: also keep every monitored spectrum: one ``.npz`` (one array per layer) per point of
            the curves in ``<run dir>/rank_curves/weight_singular_values/epoch_XXXX.npz`` (``epoch_-001.npz`` for the
            untrained weights; ``step_XXXXXXXX.npz`` for curves keyed by step) and, with a
            ``WandbLogger``, one histogram per layer, ``weight_spectra/<layer>`` (``<namespace>_singular_values/``
            and ``<namespace>_spectra/<layer>`` under another namespace, so that two monitors keep apart).
        log_at_init: also measure the untrained weights at the start of a fresh ``fit`` (before the first optimizer
            step), recorded as epoch ``-1`` and sent to the loggers at step 0 (rank collapse starts at
            initialisation, Daneshmand et al.).
        figures_every_n_epochs: also draw the PNG figures after every this many monitored epochs; ``None`` draws
            them at the end of fit only.
        namespace: first part of the logged keys and of the curve file, figure, W&B chart and spectra names;
            ``None`` for ``"weight"``. Two weight monitors of one Trainer need two namespaces; the same one is an
            error at setup.
        verbose: report the monitored matrices (rank zero) at setup.

    Raises:
        ValueError: at construction for an invalid setting, at setup for a layer or layer type that does not match
            the model (the message lists the valid names) or a choice that holds no matrix the monitor can read.

    Example::

        import pytorch_lightning as pl
        from rank_lightning.callbacks import WeightRankMonitor

        monitor = WeightRankMonitor(layers=["backbone.layer*"], tail_ranks=(1, 10), every_n_epochs=5)
        trainer = pl.Trainer(max_epochs=50, callbacks=[monitor])
        trainer.fit(model, datamodule=datamodule)  # any LightningModule

    Logged metrics:
        For every monitored matrix ``<layer>`` (module name, without the ``_fsdp_wrapped_module`` segments FSDP
        inserts; ``<attention>.q_proj`` / ``.k_proj`` / ``.v_proj`` / ``.out_proj`` for ``nn.MultiheadAttention``,
        ``<c_attn>.q_proj`` / ``.k_proj`` / ``.v_proj`` for GPT-2's fused ``c_attn`` and likewise for the fused
        Linears named in ``split_fused`` (``<query_key_value>.q_proj``, ..., ``<gate_up_proj>.gate_proj`` /
        ``.up_proj``); ``<attention>.in_proj``, ``<c_attn>`` and ``<query_key_value>`` with ``split_fused=False``;
        ``<experts>.<e>.gate_proj`` / ``.up_proj`` / ``.down_proj`` for expert ``e`` of an experts layer,
        ``<experts>.<e>.gate_up_proj`` with ``split_fused=False``) and the selected metrics (key names from
        :meth:`~rank_lightning.functional.spectral.SpectralSummary.as_dict`):

        * ``weight/<layer>/numerical_rank``: ``#{i : s_i >= eps * s_1}`` (Feng et al. eq. 4; ``eps`` from
          ``rank_tolerance`` or ``tolerance_dtype``, as stated in the figures' caption).
        * ``weight/<layer>/stable_rank``: ``sum_i s_i^2 / s_1^2``.
        * ``weight/<layer>/effective_rank``: ``exp(H(p))``, ``p = s / sum s`` (Roy & Vetterli).
        * ``weight/<layer>/spectral_norm``: ``s_1``.
        * ``weight/<layer>/tail_error_k<k>``: ``sqrt(sum_{i>k} s_i^2 / sum_i s_i^2)`` for every ``k`` in
          ``tail_ranks`` (Zangrando et al. eq. 22).
        * ``weight/<layer>/alpha`` and ``weight/<layer>/alpha_ks_distance`` (with ``"alpha"`` in ``metrics``): the
          power-law exponent of the eigenvalues ``s_i^2`` above ``x_min`` and the KS distance of that fit
          (Clauset et al. 2009; :func:`~rank_lightning.functional.power_law_alpha`, equal to WeightWatcher's
          ``alpha`` for Linear layers; conv weights differ, since WeightWatcher splits kernels per offset).

        With a ``WandbLogger``, also the charts ``weight_curves/<metric>_vs_epoch`` (``_vs_step`` for curves keyed
        by step), ``weight_curves/<metric>_vs_depth``, the table ``weight_curves/layers`` and, with
        ``save_singular_values=True``, the histograms ``weight_spectra/<layer>`` (``<namespace>_curves/`` and
        ``<namespace>_spectra/`` under another namespace); the charts hold the whole history and are sent after the
        first monitored epoch, the 5th, 10th, 20th, 40th... (each time the history has doubled) and at the end of
        fit.
    """

    def __init__(
        self,
        *,
        layers: Sequence[str] | None = None,
        layer_types: Sequence[type[nn.Module] | str] | None = None,
        metrics: Sequence[str] = WEIGHT_METRICS[:5],
        tail_ranks: Sequence[int] = (1, 10, 50),
        every_n_epochs: int | None = None,
        every_n_train_steps: int | None = None,
        rank_tolerance: float | None = None,
        tolerance_size: Literal["min", "max"] = "min",
        tolerance_dtype: str | torch.dtype | None = None,
        decomposition: Literal["auto", "svd", "gram"] = "auto",
        split_fused: bool = True,
        lora_update: bool = True,
        sharding: Literal["auto", "gram", "gather"] = "auto",
        save_singular_values: bool = False,
        log_at_init: bool = True,
        figures_every_n_epochs: int | None = None,
        namespace: str | None = None,
        verbose: bool = True,
    ) -> None:
        self.namespace = None if namespace is None else check_namespace(namespace)
        super().__init__(
            self.namespace or "weight",
            every_n_epochs=every_n_epochs,
            every_n_train_steps=every_n_train_steps,
            on_validate=False,
            figures_every_n_epochs=figures_every_n_epochs,
            log_at_init=log_at_init,
            verbose=verbose,
        )
        self.layers = check_names("layers", layers)
        self.layer_types = None if layer_types is None else check_layer_types(layer_types)
        self.metrics = check_choices("metrics", metrics, WEIGHT_METRICS)
        tail_ranks = check_metric_ks("tail_ranks", tail_ranks, "tail_error", self.metrics)
        self.tail_ranks = tuple(sorted(set(tail_ranks)))
        self.rank_tolerance = check_positive("rank_tolerance", rank_tolerance, allow_none=True)
        self.tolerance_size = check_choice("tolerance_size", tolerance_size, _TOLERANCE_SIZES)
        self.tolerance_dtype = check_tolerance_dtype(tolerance_dtype, rank_tolerance)
        self.decomposition = check_choice("decomposition", decomposition, DECOMPOSITIONS)
        self.sharding = check_choice("sharding", sharding, SHARDINGS)
        self.split_fused = check_bool("split_fused", split_fused)
        self.lora_update = check_bool("lora_update", lora_update)
        self.curves.separate_suffixes = (LORA_UPDATE_SUFFIX,) if lora_update else ()  # their own figures
        self.save_singular_values = check_bool("save_singular_values", save_singular_values)
        self._matrices: list[WeightMatrix] = []
        self._resolved_for: int | None = None
        self._last_monitored_epoch = self._last_monitored_step = self._step_at_batch_start = None

    @property
    @override
    def state_key(self) -> str:
        layers = None if self.layers is None else list(self.layers)
        types = (
            None if self.layer_types is None else [t if isinstance(t, str) else t.__name__ for t in self.layer_types]
        )
        named = {} if self.namespace is None else {"namespace": self.namespace}
        return self._generate_state_key(layers=layers, layer_types=types, **named)

    @property
    def monitored(self) -> list[str]:
        """Names of the monitored matrices in depth order (empty before setup)."""
        return [matrix.name for matrix in self._matrices]

    def select(self, module: nn.Module) -> list[str]:
        """Resolve ``layers`` and ``layer_types`` against ``module`` and return the monitored matrix names.

        Shapes are those of the full weights under every sharding strategy (DeepSpeed ZeRO-3's placeholders, FSDP1's
        flat slices, whose shapes are read from the wrapped units in ``module`` or in the Trainer's ``model``).

        Raises:
            ValueError: a name, pattern or type that matches no monitorable layer (the message lists the valid ones),
                layers that hold no matrix the monitor can read (only 3-D parameters in no known layout, which
                are named in a warning), or a GPT-2 ``c_attn`` or experts layer held by FSDP1
                (``use_orig_params=True``) whose wrapped unit is not found (the message says what to do).
        """
        shapes = fsdp_parameter_shapes(_strategy_root(module))
        modules = dict(module.named_modules())
        lora = {name for name, m in modules.items() if name and is_lora_layer(m)}
        read = {name for name in lora if lora_unread_reason(modules[name]) is None}
        candidates = _weight_candidates(module, modules, read, shapes)
        if not candidates:
            raise ValueError(
                f"{type(module).__name__} has no Linear, Conv, MultiheadAttention, Conv1D or expert layer to monitor"
            )
        chosen = select_layers(
            module,
            self.layers,
            self.layer_types,
            candidates=candidates,
            default=lambda _: {name: name for name in candidates},
            leaves=True,
        )
        matrices: dict[str, WeightMatrix] = {}
        parts = {outer: None for outer in (_outer_layer(path, lora - read) for path in chosen.values()) if outer}
        self._warn_lora_parts({path: modules[path] for path in parts})
        for path in chosen.values():
            self._warn_unread(path, candidates[path], shapes)
            split, update = self.split_fused, self.lora_update
            parent = parent_layer(path, modules)
            for matrix in matrices_of(
                path, candidates[path], split_fused=split, shapes=shapes, lora_update=update, parent=parent
            ):
                # An attention's out_proj is also a Linear of its own; keep it once.
                matrices.setdefault(matrix.name, matrix)
        if not matrices:
            raise ValueError(f"the chosen layers hold no weight matrix the monitor can read: {', '.join(chosen)}")
        self._matrices = list(matrices.values())
        self._resolved_for = id(module)
        return self.monitored

    def _warn_unread(self, path: str, layer: nn.Module, shapes: ParameterShapes) -> None:
        """Name (once) every 3-D parameter of a chosen layer that is not read as weight matrices."""
        for attribute in unread_stacks(layer, shapes=shapes):
            name = f"{logged_name(path)}.{attribute}"
            shape = parameter_shape(layer, attribute, shapes)
            message = (
                f"parameter {name!r} ({type(layer).__name__}, shape {shape}) is 3-D in no layout the monitor reads "
                "as weight matrices, and is not measured; expert stacks are read where transformers' "
                "use_experts_implementation declares their layout (gate_up_proj, up_proj, down_proj; is_transposed)."
            )
            self.warn_once(("unread", name), message)

    def _warn_lora_parts(self, layers: dict[str, nn.Module]) -> None:
        """Name (once, up to ten per warning) the LoRA layers that are read as their parts, and why."""
        by_reason: dict[str, list[str]] = {}
        for path, layer in layers.items():
            if ("lora parts", path) not in self._warned:
                self._warned.add(("lora parts", path))
                by_reason.setdefault(str(lora_unread_reason(layer)), []).append(logged_name(path))
        for reason, names in by_reason.items():
            shown = ", ".join(map(repr, names[:10])) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
            message = (
                f"LoRA layer{'s' if len(names) > 1 else ''} {shown} {'are' if len(names) > 1 else 'is'} measured as "
                f"{'their' if len(names) > 1 else 'its'} parts, since {reason}: base_layer is the base weight without "
                "the adapters' update, lora_A and lora_B are the update's factors (LoRA layers are measured as their "
                "weight W + (alpha / r) B A where it is that)."
            )
            warnings.warn(f"{type(self).__name__}: {message}", UserWarning, stacklevel=3)

    def spectra(self, module: nn.Module) -> dict[str, Spectrum]:
        """Float64 spectra of the monitored matrices of ``module``, one batched decomposition per distinct shape.

        Args:
            module: the model; layers are resolved against it first if they were not yet.

        Returns:
            ``name -> Spectrum`` in depth order, on the CPU; rows of the matrix are its ``num_samples``. A matrix
            holding NaN or Inf gets an all-NaN spectrum.

        Raises:
            RuntimeError: a weight sharded in a layout that is not supported (the message names the supported
                strategies); under a sharding strategy every process must call this together.
        """
        if self._resolved_for != id(module):
            self.select(module)
        spectra = weight_matrix_spectra(
            self._matrices, decomposition=self.decomposition, sharding=self.sharding, root=_strategy_root(module)
        )
        return dict(zip(self.monitored, spectra))

    def measure(self, module: nn.Module) -> dict[str, dict[str, float]]:
        """Compute the configured metrics of every monitored matrix of ``module``.

        Returns:
            ``layer -> metric -> value`` in depth order (tail errors as ``tail_error_k<k>``).
        """
        return self._values(self.spectra(module))

    def _values(self, spectra: dict[str, Spectrum]) -> dict[str, dict[str, float]]:
        dtypes = self._stored_dtypes()
        return {name: self._metrics_of(spec, dtypes[name]) for name, spec in spectra.items()}

    def _stored_dtypes(self) -> dict[str, torch.dtype]:
        return {matrix.name: matrix.stored_dtype() for matrix in self._matrices}

    def _metrics_of(self, spec: Spectrum, dtype: torch.dtype) -> dict[str, float]:
        summary = summarize(
            spec,
            rank_tolerance=self._rank_tolerance(spec, dtype),
            tolerance_size=self.tolerance_size,
            variance_ratio_ks=(),
            tail_ranks=self.tail_ranks if "tail_error" in self.metrics else (),
        )
        return summary.as_dict(self.metrics)

    def _rank_tolerance(self, spec: Spectrum, stored: torch.dtype) -> float | None:
        """``rank_tolerance``, or the default for ``tolerance_dtype`` (``"input"``: the weight's stored dtype; see
        :func:`~rank_lightning.functional.default_rank_tolerance`)."""
        if self.rank_tolerance is not None or self.tolerance_dtype is None:
            return self.rank_tolerance
        dtype = stored if self.tolerance_dtype == "input" else self.tolerance_dtype
        eps = torch.finfo(dtype).eps if dtype.is_floating_point else None  # type: ignore[union-attr]
        size = self.tolerance_size
        return default_rank_tolerance(spec.num_samples, spec.num_features, tolerance_size=size, dtype_eps=eps)

    def measures_validation_only(self) -> bool:
        """No: epochs without validation are measured at their end."""
        return False

    @override
    def prepare(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        names = self.select(pl_module)
        check_distinct_namespaces(trainer, self)  # after this monitor's own settings are checked
        run = str(getattr(stage, "value", stage))
        if run in ("validate", "test", "predict"):
            # Weights are measured during fit: an evaluation run leaves them as the fit or the checkpoint has them.
            self.info(f"trainer.{run} is not monitored (weights are measured during fit)")
        else:
            self.info(f"monitoring {count_of(len(names), 'weight matrix', 'weight matrices')}: {', '.join(names)}")
            self._check_copy_updates(pl_module, names)
        dtype = self.tolerance_dtype
        self.curves.describe(
            rank_tolerance=self.rank_tolerance,
            tolerance_size=self.tolerance_size,
            tolerance_dtype=None if dtype is None else str(dtype).removeprefix("torch."),
            measured="weights",
        )

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        if self.initial_point_due(trainer):
            spectra = self._checked_spectra(pl_module, "before training")
            self.curves.record_initial(trainer, self._values(spectra))
            if self.save_singular_values and trainer.is_global_zero:
                self._save_singular_values(trainer, spectra, self.curves.initial_point)

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.due(trainer):
            self._monitor(trainer, pl_module)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Validation runs before the training epoch ends; monitor here only when it did not run this epoch.
        if self.due(trainer) and self._last_monitored_epoch != trainer.current_epoch:
            self._monitor(trainer, pl_module)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._step_at_batch_start = trainer.global_step

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # Step cadence: right after every every_n_train_steps-th optimizer step, in the batch that took it (not after
        # the micro-batches that accumulate gradients towards it, nor those of a fit resumed at such a step).
        if self.cadence.by_step:
            # The last measurement stayed one batch (every callback's batch end saw it once); a new one may come.
            self.curves.clear_stale_metrics(trainer)
        # A batch that took a step reaching a multiple of every_n_train_steps: under manual optimization a batch can
        # take several steps (one per optimizer) and pass over the multiple (2 -> 4 over 3).
        step, every = trainer.global_step, self.cadence.every_n_train_steps
        if every is None or step // every == self._step_at_batch_start // every or step == self._last_monitored_step:
            return
        self._last_monitored_step = step
        self._monitor(trainer, pl_module)

    def _check_copy_updates(self, pl_module: pl.LightningModule, names: Sequence[str]) -> None:
        """Warn when the step cadence measures a frozen copy (a momentum target) of a module that has its own
        ``on_train_batch_end``: Lightning runs it after the callbacks', so an update of the copy there comes after
        the measurement of its step."""
        hook = getattr(type(pl_module).on_train_batch_end, "__qualname__", "")
        if not self.cadence.by_step or hook == "ModelHooks.on_train_batch_end":
            return
        copies = [path for path in frozen_copies(pl_module) if any(f"{n}.".startswith(f"{path}.") for n in names)]
        if copies:
            message = (
                f"measures {', '.join(copies)}, a frozen copy (a momentum / EMA target), at the end of the batch of "
                f"each measured step (every_n_train_steps={self.cadence.every_n_train_steps}), in the callbacks' "
                "on_train_batch_end, which Lightning runs before the module's own: a copy updated in the module's "
                "on_train_batch_end is measured before that step's update. Update it in the module's optimizer_step "
                "(after super().optimizer_step(...)) to measure it with the step's update."
            )
            self.warn_once(("copy updates",), message)

    def _checked_spectra(self, pl_module: pl.LightningModule, when: str) -> dict[str, Spectrum]:
        """:meth:`spectra`, with a warning (once per layer) naming every matrix that holds NaN or Inf, and every
        half-precision matrix measured with the float32 tolerance."""
        spectra = self.spectra(pl_module)
        for name, spectrum in spectra.items():
            if not spectrum.is_finite:
                message = f"layer {name!r} has NaN or Inf weights ({when}): its metrics are NaN while it does; the "
                self.warn_once(("nonfinite", name), message + "other layers are measured as usual.", RuntimeWarning)
        self._check_tolerance()
        return spectra

    def _check_tolerance(self) -> None:
        """Warn, naming each layer once, when weights stored in bfloat16 or float16 get the float32 tolerance, under
        which their rounding noise counts as rank (a rank-8 matrix rounded to bf16 reads as full rank)."""
        if "numerical_rank" not in self.metrics or self.rank_tolerance is not None or self.tolerance_dtype is not None:
            return
        by_dtype: dict[torch.dtype, list[str]] = {}
        for name, dtype in self._stored_dtypes().items():
            if dtype in _HALF_PRECISION and ("tolerance", name) not in self._warned:
                self._warned.add(("tolerance", name))
                by_dtype.setdefault(dtype, []).append(name)
        for dtype, names in by_dtype.items():
            warnings.warn(f"{type(self).__name__}: {_tolerance_advice(names, dtype)}", UserWarning, stacklevel=3)

    def _monitor(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        when = f"at step {trainer.global_step}" if self.cadence.by_step else f"at epoch {trainer.current_epoch}"
        spectra = self._checked_spectra(pl_module, when)
        self.curves.record_and_log(trainer, pl_module, self._values(spectra))
        self._last_monitored_epoch = trainer.current_epoch
        if self.save_singular_values and trainer.is_global_zero:
            by_step = self.curves.x_axis == "step"  # the step cadence, or several validations per epoch
            self._save_singular_values(trainer, spectra, trainer.global_step if by_step else trainer.current_epoch)

    def _save_singular_values(self, trainer: pl.Trainer, spectra: dict[str, Spectrum], point: int) -> None:
        """Keep the spectra of the curves' ``point`` (an epoch or a step, as the curves are keyed; the untrained
        weights' ``-1`` or ``0``) in a file of its own, and send them to W&B beside the point's scalars."""
        arrays = {name: spec.singular_values.numpy() for name, spec in spectra.items()}
        # Named by namespace, as the curve files are: two weight monitors (an epoch and a step cadence, say) would
        # otherwise share one folder and one W&B key, taking each other's folder for another run's.
        namespace = self.curves.namespace
        directory = self.curves.figure_dir(trainer) / f"{namespace}_singular_values"
        at = f"step_{point:08d}" if self.curves.x_axis == "step" else f"epoch_{point:04d}"
        path = directory / f"{at}.npz"
        # Written beside and renamed over: a failed or killed write leaves the file of an earlier run whole, and a full
        # disk or a read-only folder is a warning.
        kept = "these singular values are not kept (the curves are, in the loggers and in checkpoints)"
        # An earlier run's are kept under another name; a debug run (fast_dev_run) writes none.
        if writes_files(trainer) and self.curves.claim(directory, "singular values"):
            self.write_file(path, lambda handle: np.savez_compressed(handle, **arrays), kept)
        loggers = wandb_loggers(trainer)
        if loggers:
            import wandb

            histograms = {
                f"{namespace}_spectra/{name}": wandb.Histogram(values[np.isfinite(values)])
                for name, values in arrays.items()
            }
            step = self.curves.logger_step(trainer)  # beside the scalars of the same measurement
            for logger in loggers:
                logger.log_metrics(histograms, step=step)
