"""Per-layer rank curves of activations, logged every few epochs or steps by :class:`ActivationRankMonitor`."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import pytorch_lightning as pl
import torch
from torch import Tensor, nn
from typing_extensions import override

from rank_lightning import streams
from rank_lightning.callbacks.base import (
    STEP_HISTORY,
    CurveMonitor,
    TrainingBatches,
    at_last_batch,
    loader_list,
    repeating_steps,
    several_training_loaders,
    step_inputs,
    step_precision,
)
from rank_lightning.callbacks.curves import TEST_SUFFIX, check_distinct_namespaces, check_namespace, log_rank_equal
from rank_lightning.functional.reductions import CONV_REDUCTIONS, TOKEN_REDUCTIONS
from rank_lightning.layers import (
    BatchReader,
    OutputSelector,
    buffers_kept,
    channel_first_layers,
    channels_last_layers,
    check_layer_types,
    compiled_modules,
    eval_mode,
    forward_batch,
    frozen_copies,
    measuring_without_grad,
    module_blocks,
    random_state_kept,
    select_layers,
    token_layouts,
    train_mode,
)
from rank_lightning.metrics import ACTIVATION_METRICS, DEFAULT_ACTIVATION_METRICS, ActivationSpectrum
from rank_lightning.sampling import READABLE_ADVICE, UNREADABLE_LOADER, readable_beside, side_loader
from rank_lightning.streams import REPEATED_CALLS, ActivationStream
from rank_lightning.validation import (
    check_bool,
    check_choice,
    check_choices,
    check_metric_ks,
    check_names,
    check_positive,
    check_positive_int,
    count_of,
    mib_text,
)

__all__ = ["ACTIVATION_METRICS", "REPEATED_CALLS", "STAGES", "TOKEN_LAYOUTS", "ActivationRankMonitor"]

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

    Timing: with ``stage="val"``, during validation of every ``every_n_epochs``-th epoch of ``fit`` (``(epoch + 1) %
    every_n_epochs == 0``), of every ``trainer.validate`` run and (``on_test``) of every ``trainer.test`` run, whose
    values go to keys of their own (``rank_test/...``, see Logged metrics) and not into the curves; with
    ``stage="train"``, over the training batches of those epochs (validation run in between is not measured). Several
    validation (or test) dataloaders are pooled: their rows together make one spectrum per layer, with a warning. With
    ``every_n_train_steps=N`` (step cadence, for long runs logged by step): over the ``window_batches`` training batches
    before every N-th optimizer step, from the training forward pass itself (no extra forward), logged at that step
    (:class:`~rank_lightning.callbacks.base.Cadence`); gradient accumulation counts optimizer steps, and every DDP
    process closes the same window. Step curves are keyed by ``trainer.global_step`` in the curve file, the figures and
    the W&B charts; the initial point is step ``0``. Sanity checks are skipped. Hooks exist only while an epoch is
    monitored and are removed afterwards. The curve file ``rank_curves.json`` (float64 history) is brought up to date
    at every monitored epoch (each point appended, at a cost that does not grow with the history) and the figures
    are drawn at the end of fit, both in ``<run dir>/rank_curves/``
    (:class:`~rank_lightning.callbacks.curves.LayerCurves`); the history is saved in checkpoints, so a resumed run
    continues its curves.

    Activations of conv layers ``(B, C, H, W)`` and token layers ``(B, T, D)`` are reduced to a samples x features
    matrix by ``conv_reduction`` (``flatten``: C*H*W features; ``channel``: every position a sample with C features;
    ``mean``: global average pool) and ``token_reduction`` (``flatten``, ``token``, ``cls``, ``mean``, ``last``); the
    reduction is part of the logged key of those layers. The 3-D outputs of 1-d conv layers, ``(B, C, L)`` (a
    ``Conv1d``, ``BatchNorm1d``, 1-d pooling, a block of such layers and activations, or an activation after one:
    :func:`~rank_lightning.layers.channel_first_layers`), are conv maps with one spatial dimension, reduced by
    ``conv_reduction`` (``channel``: each of the L positions a sample with C features), never as tokens. The 5-D
    outputs of 3-d conv layers, ``(B, C, D1, D2, D3)`` (``Conv3d``: video ``(B, C, T, H, W)``, volumetric images),
    are conv maps with three spatial dimensions under the same reductions (``flatten``: C*D1*D2*D3 features;
    ``channel``: each of the D1*D2*D3 positions a sample with C features; ``mean``: global average pool). The
    channels-last ``(B, H, W, C)`` outputs of Swin's stages and blocks (``(B, T, H, W, C)`` in Video Swin) are read
    as ``(B, C, H, W)`` (``(B, C, T, H, W)``) before the conv reduction
    (:func:`~rank_lightning.layers.channels_last_layers` says when). Token layers
    laid out sequence-first, ``(T, B, D)`` (the default of ``nn.Transformer``), are read as ``(B, T, D)``: the layout
    comes from ``token_layout``, else from the
    ``batch_first`` flag of the layer or its nearest ancestor
    (:func:`~rank_lightning.layers.declared_batch_first`), else from a batch whose shape tells it (the batch size in
    exactly one leading dimension); a batch whose shape cannot tell (``T == B``, e.g. a last partial batch) is read
    batch-first in a Hugging Face model, whose hidden states are
    (:func:`~rank_lightning.layers.batch_first_when_ambiguous`), and is skipped with a warning elsewhere, never
    guessed.

    Outputs that are not a tensor (Hugging Face blocks return tuples, models return ``ModelOutput``) are read
    through :func:`~rank_lightning.layers.hidden_state` (the first tensor of a tuple, ``last_hidden_state`` of a
    mapping or dataclass; ``output_selector`` overrides). Token reductions leave out padded positions: the batch's
    attention mask (``mask_key``; ``attention_mask`` of dict batches by default, and ``decoder_attention_mask`` for
    the layers in the decoder of an encoder-decoder model: :func:`~rank_lightning.layers.decoder_layers`)
    selects the rows of ``token``, weights the ``mean`` and zeroes ``flatten``. A layer whose output is of another
    kind is skipped with a warning, and so is, by name, every chosen layer that is not called in the forward pass of
    the first monitored batch (a ``ModuleList`` or ``ModuleDict`` is never called itself: name its children). A layer
    called more than once per batch (a module shared by several places of the forward pass, an ALBERT-style block
    applied N times, a second view of the batch) is measured at its first call of each batch only, with a warning
    naming it; with ``repeated_calls="each"`` its ``k``-th call of each batch is measured as a layer of its own,
    logged as ``<layer>@<k>`` (``<layer>@1`` its first; after the layer in depth order, in the figures, charts and
    curve file; each one a layer's worth of state in the memory plan, reading the batch's attention mask as the
    layer does), so that a weight-tied block (ALBERT's one ``AlbertLayer``, a Universal Transformer, a block looped
    N times) gives one curve per application. A batch that calls the layer another number of times than the pass's
    first (adaptive computation) is named in a warning: the ``k``-th application sums the rows of the batches that
    made at least ``k`` calls. Under DDP an application that ran on some processes only is named in a warning and
    not logged (the sums of every process stay aligned). Views of the batch run in one forward pass
    (``torch.cat([view_1, view_2])``, SimCLR) give a ``(B, d)`` or ``(B, C, H, W)`` output ``k`` times the batch's
    rows (in a batch that tells its size and has no attention mask, where ``k`` is not the length ``T`` of its
    ``(B, T)`` token ids, whose ``B * T`` flattened positions a mixture-of-experts router gives: see
    ``unbatched``): they are read as ``k`` views of every input,
    view after view, and all rows are measured (``max_samples`` counts inputs; an input's label is that of each of its
    views), with a warning naming the layer. Calls made by the backward pass, where activation
    checkpointing (``torch.utils.checkpoint``, ``gradient_checkpointing_enable()``) runs checkpointed modules again,
    are not calls of the batch: each batch's rows are measured once, as without checkpointing.

    Initial point: with ``log_at_init`` (default), a fresh ``fit`` measures the untrained model before the first
    training step, over the batches a monitored epoch streams: one pass of every validation loader within
    ``limit_val_batches`` (``stage="val"``, eval mode), or the training batches within ``limit_train_batches`` (one
    window with a step cadence; of a loader of unknown length, such as an endless ``IterableDataset``, those up to
    ``max_samples`` and at most the ``max_steps * accumulate_grad_batches`` the fit can take; ``stage="train"``,
    training mode with BatchNorm statistics restored), calling the
    module's ``forward`` on the inputs of each batch (``input_key``; for a dict batch without it, ``forward(**entries)``
    when ``forward`` names them, else ``forward(batch)``, and when that fails before any monitored layer ran, the dict's
    inputs, ``forward(batch["image"])``). Several training loaders (a list or dict, which Lightning's ``CombinedLoader``
    combines in the fit's mode) give each step's batches of every loader, whose inputs (``input_key`` of each) run in
    one ``forward`` call, concatenated in loader order; the labels are read from the combined batch, as in the
    monitored passes (``label_fn``, e.g. ``lambda batch: torch.cat([part[1] for part in batch.values()])``). It is
    recorded as epoch ``-1`` and sent to the loggers at step 0. A loader that cannot be read beside the fit (a
    one-pass iterator such as a generator, or a resumable iterable that is not a ``DataLoader``:
    :func:`~rank_lightning.sampling.readable_beside`) gives no initial point, with a warning, and is never read
    before training.

    Memory: the float64 states of all monitored layers together stay within ``memory_budget_mb`` on each device
    (a d x d Gram is 128 MiB at d = 4096); their planned size is printed after the first monitored batch, with the
    layers that have class Grams and why the others have none. The spectra come first: a layer whose
    exact Gram no longer fits takes the subsample fallback, within an even share of what is left among the layers
    not planned yet; one whose fallback does not fit either raises a
    ``MemoryError`` at that first batch, naming it, before anything is allocated. The class Grams of the class-wise
    VR (``num_classes`` d x d float64 per layer) come second, from what every layer's spectrum leaves: the smallest
    first, each within an even share of what is left among the layers still waiting, so that a layer never loses its
    exact Gram to the class Grams of another, and layers of one width all have them or none does. A layer without
    them logs no class-wise VR, with a warning naming it and why; under DDP, so does a layer whose class Grams fit on
    some processes only (a layer that runs on some processes only takes memory there). Until the first batch
    ends, the measured rows of the layers whose class Grams are not decided yet are held as a copy.

    Non-finite activations never stop training: a layer that gives NaN or Inf in a monitored epoch logs NaN for every
    metric of that epoch, with a warning naming it; the other layers and later epochs are unaffected. A layer whose
    activations are all zero (a dead ReLU; centred: all equal) logs 0 for every rank and NaN for the variance ratios
    and the normalised TCV (0 / 0), with a warning naming it.

    Args:
        layers: block names (``pl_module.blocks()``), module names (``named_modules()``) or glob patterns (matched
            against both), the syntax of :mod:`rank_lightning.layers`; ``None`` picks the default layers.
        layer_types: keep only layers of these types (classes, class names or dotted import paths); without
            ``layers``, every module of these types.
        every_n_epochs: monitor every this many epochs (default ``1`` without ``every_n_train_steps``).
        every_n_train_steps: monitor every this many optimizer steps instead (see Timing); setting both is an error.
        window_batches: training batches streamed per step measurement, at most ``every_n_train_steps`` times
            ``accumulate_grad_batches`` (not checked under manual optimization, whose steps per batch are known once
            seen). A checkpoint saved inside an open window holds its partial sums (the layers' float64 states, the
            size of the memory plan; under DDP those of every process, gathered into the checkpoint), so a fit
            resumed from it continues the window (on as many processes, each from its own sums; not in a monitor of
            other settings, nor on another number of processes, which warns). A window that
            streams fewer (the fit resumed inside it without those sums, or an epoch's short last accumulation
            brought it within ``window_batches`` of the previous one, or came unforeseen at the end of an epoch of
            unknown length, an ``IterableDataset`` without ``__len__``; under manual optimization, a window planned
            before the steps of the batches were seen, or one whose batches took fewer steps than planned, which
            starts again rather than stream more) is named in a warning.
        stage: ``"val"`` (validation batches) or ``"train"`` (training batches; keys under ``rank_train/``);
            ``None`` is ``"train"`` with ``every_n_train_steps`` (which needs it) and ``"val"`` otherwise. With
            ``"train"`` and the epoch cadence, a checkpoint saved inside a monitored epoch holds the epoch's partial
            sums (under DDP those of every process), so a fit resumed from it measures the whole epoch; without them
            (a checkpoint saved by an older version, or loaded into a monitor of other settings or a fit on another
            number of processes) the epoch is measured on the batches still to come, with a warning.
        namespace: first part of the logged keys and of the curve file and figure names; ``None`` for ``"rank"``
            (``"rank_train"`` for ``stage="train"``). Two monitors of one Trainer need two namespaces (a second one
            with other layers, a reduction or centring: ``namespace="rank_channel"``); the same one is an error at
            setup.
        max_samples: inputs per monitored epoch, spread evenly over the epoch's batches (the first rows of every
            batch), so that a loader sorted by class still gives rows of every class; a warning names the classes
            that got no row. Under DDP the W processes share it exactly (``max_samples // W`` each, one more on the
            first ``max_samples % W``), without the samples a ``DistributedSampler`` repeats. ``None`` for all.
        conv_reduction: reduction of conv activations, the ``(B, C, L)`` maps of 1-d conv layers and the
            ``(B, C, D1, D2, D3)`` maps of 3-d conv layers too.
        token_reduction: reduction of token activations ``(B, T, D)``: ``"token"`` (each real token a row),
            ``"mean"``, ``"last"`` (each sequence's last real token, a decoder-only model's sequence embedding),
            ``"cls"`` or ``"flatten"``; keys ``.../<reduction>/<metric>``.
        metrics: which of ``ACTIVATION_METRICS`` to log; by default all but ``alpha_req``.
        variance_ratio_ks: the ``k`` of the logged ``VR_k``.
        soft_rank_tau: threshold of the soft rank (Daneshmand et al. use 0.5 on BN-scaled features).
        rank_tolerance: relative tolerance of the numerical rank; ``None`` is the default of ``tolerance_dtype``:
            ``finfo(float32).eps * K`` (Feng), for bfloat16 and float16 activations their ``eps`` (``eps * K`` would
            reach 1 at ``K = 128`` in bfloat16; :func:`~rank_lightning.functional.default_rank_tolerance`).
        tolerance_size: ``K`` of the default tolerance: ``"min"`` (``min(N, d)``, Feng) or ``"max"`` (NumPy).
        tolerance_dtype: the dtype of the default tolerance: ``None`` for float32 (Feng et al.'s convention, right for
            float32 activations), a ``torch.dtype`` (``torch.bfloat16`` for a model computed in bf16, where a float32
            tolerance counts rounding noise as rank), or ``"input"`` for the lowest precision the hooked outputs
            arrived in. Under ``precision="bf16-mixed"`` that is bf16 only for layers that return bf16 themselves (a
            ``Linear``); blocks that add to a float32 residual stream (GPT-2's) return float32: name the dtype
            (a warning says so when ``"input"`` finds float32 outputs of layers run under autocast).
        gram_precision: precision of each batch's Gram product before it is added into the float64 sums:
            ``"float64"``, ``"float32"``, ``"tf32"`` or ``"auto"`` (per device, see
            :class:`~rank_lightning.metrics.ActivationSpectrum`).
        center: compute the spectral metrics of centred activations (``X - 1 mu^T``) instead of ``X``. Agrawal et
            al.'s alpha-ReQ is a property of the covariance, i.e. of centred activations.
        alpha_req_range: ``(first_index, last_index)``, the 1-based eigenvalue ranks the ``alpha_req`` fit covers
            (Agrawal et al. fit 11 to 100); ``last_index=None`` for the last numerically non-zero one.
        num_classes: number of classes of the labels; ``None`` reads ``pl_module.num_classes``, the datamodule's
            ``num_classes``, or the ``config.num_labels`` of a Hugging Face ``...ForSequenceClassification`` (image,
            audio) model inside the module; class metrics are skipped without it.
        label_key: where the labels are in a batch: an index for tuples/lists, a key for dicts; ``None`` takes
            ``batch[1]`` or the first of ``y``, ``label``, ``labels``, ``target``, ``targets``. The labels may take
            any of :data:`~rank_lightning.layers.LABEL_FORMS` (a ``(B, 1)`` column, booleans, one-hot rows read as
            their argmax); float values and soft targets are no class labels. An explicit ``label_key`` that
            finds no labels raises at the first batch; the default lookup finding none gives a warning saying where
            it looked, and no class metrics. Labels of another number of rows than the batch raise. Integer labels
            per token ``(B, T)`` (next-token classes of a causal language model, already shifted; -100 where a
            token has no class) give each token row of the ``"token"`` reduction its own class, with ``num_classes``
            the vocabulary size: a token labelled -100 is left out of that layer's spectrum too, as a padded one is
            (:class:`~rank_lightning.metrics.ActivationSpectrum`). A layer whose rows are one per input (``(B, d)``
            outputs, conv maps, the ``"mean"`` / ``"cls"`` / ``"last"`` / ``"flatten"`` token reductions) is named in
            a warning and logs no class metric.
        label_fn: a function ``batch -> labels`` overriding ``label_key``.
        mask_key: where the ``(B, T)`` attention mask (true / 1 at real tokens) is in a batch: an index, a key, a
            function ``batch -> mask``, or ``False`` for none; ``None`` reads ``attention_mask`` from dict batches
            and no mask otherwise. With ``None`` or ``"attention_mask"`` the layers in the decoder of an
            encoder-decoder model read ``decoder_attention_mask`` instead (without one they are measured whole, with a
            warning when the batch has an ``attention_mask`` or ``labels`` padded with -100), and the layers in an
            image tower of a Hugging Face model that takes no attention mask (CLIP's ``vision_model``:
            :func:`~rank_lightning.layers.unmasked_layers`) read none; any other ``mask_key`` names the mask of every
            layer.
        output_selector: which tensor of a layer's output to measure: an index, a key or attribute name, or a
            function ``output -> Tensor``; ``None`` follows :func:`~rank_lightning.layers.hidden_state`'s rule.
        repeated_calls: what a layer called more than once per batch gives: ``"first"`` its first call of each
            batch, with a warning; ``"each"`` every call, the ``k``-th as layer ``<layer>@<k>`` (see above).
        unbatched: read every monitored layer's output as rows with no batch dimension: all ``N`` rows of a
            ``(N, d)`` output, whatever ``N``, with no mask and no labels (no class metrics), for the layers of a
            mixture of experts whose rows are not the batch's inputs: a routed expert, called on the ``(n_routed,
            d)`` tokens routed to it, or a router whose ``(B * T, E)`` logits cover every position of the batch,
            padded ones included. A batch to which ``max_samples`` gives no input gives no rows; outputs of other
            shapes are skipped with a warning. Use a monitor of its own (``namespace``) beside the one of the
            blocks. Without it, a layer at or inside a routed expert (:func:`~rank_lightning.layers.expert_layers`)
            is skipped with a warning, and so is a ``(B * T, d)`` output of a batch of ``B`` sequences of ``T``
            tokens (token ids, labels or mask ``(B, T)``), never read as ``T`` views of the batch.
        log_per_class: also log the class-wise VR of every class, not only their mean.
        max_gram_features: largest d for the exact d x d Gram; wider layers use the subsample fallback of
            :class:`~rank_lightning.metrics.ActivationSpectrum` (a warning names the layer once).
        memory_budget_mb: total state memory of all monitored layers on a device (see Memory); ``None`` for no
            total limit, each layer's states then within the 1024 MiB default of
            :class:`~rank_lightning.metrics.ActivationSpectrum` (class Grams beyond it are left out, with a warning).
        token_layout: ``"auto"`` (see above), ``"batch_first"`` or ``"sequence_first"``: the layout of every
            monitored ``(., ., D)`` token output.
        input_key: where the inputs are in a batch, for the initial point (an index or a key; ``None``:
            ``batch[0]`` or the first of ``x``, ``input``, ``inputs``, ``image``, ``images``, ``pixel_values``,
            ``input_ids``).
        log_at_init: measure the untrained model at the start of a fresh ``fit`` (see above).
        on_test: with ``stage="val"``, also measure the test data of every ``trainer.test`` run.
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
        For every monitored layer ``<layer>`` (block name or module name; ``<layer>@<k>``, its ``k``-th call of each
        batch, for a layer called more than once under ``repeated_calls="each"``), with ``<r>/`` = ``<reduction>/``
        for conv and token layers and empty for ``(B, d)`` layers, under ``rank/`` (``rank_train/`` with
        ``stage="train"``):

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

        * ``rank/<layer>/<r>alpha_req`` (only when asked for in ``metrics``): alpha-ReQ, the decay exponent of
          ``lambda_i ~ i^-alpha`` fitted in log-log over the eigenvalues above the rank tolerance (Agrawal et al. 2022).
        * ``rank/<layer>/<r>spectrum_rows``: the rows behind the spectrum (all measured rows on the exact path, the
          subsample or sketch rows on the fallback path): no rank can exceed it, and a warning names the layer when it
          caps the ranks below the width.

        Class metrics need labels and ``num_classes``. Values are written in one batch per measurement straight to
        the loggers (rank zero) and into ``trainer.callback_metrics`` (every rank, float64), where
        ``ModelCheckpoint(monitor=...)`` and ``EarlyStopping`` read them; the curve file keeps float64. The initial
        point (``log_at_init``) logs the same keys with
        ``epoch = -1`` at step 0, straight to the loggers. With a ``WandbLogger``, also the charts
        ``rank_curves/<r><metric>_vs_epoch`` and ``rank_curves/<r><metric>_vs_depth`` and the table
        ``rank_curves/layers`` (``rank_train_curves/`` with ``stage="train"``); the charts hold the whole history
        and are sent after the first monitored epoch, the 5th, 10th, 20th, 40th... (each time the history has
        doubled) and at the end of fit.

        ``trainer.test`` (``on_test``, ``stage="val"``): the same metrics of the test data under
        ``rank_test/<layer>/<r><metric>`` (``<namespace>_test/``), logged through the module, so that
        ``trainer.test`` returns them; they are not recorded in the curves and draw no figure.
    """

    # Whether the open step window opened at the last batch of an epoch of unknown length (known only then).
    _opened_at_unforeseen_end = False
    # The open step window a loaded checkpoint holds (until the fit continues it), and whether this fit said the size
    # of a window saved in a checkpoint.
    _saved_window: dict[str, Any] | None = None
    _window_size_said = False
    # The open pass of a monitored training epoch (stage="train", epoch cadence) a loaded checkpoint holds.
    _saved_epoch: dict[str, Any] | None = None
    # The optimizer steps taken when the current training batch started (set at every batch start).
    _step_at_batch_start = 0

    def __init__(
        self,
        *,
        layers: Sequence[str] | None = None,
        layer_types: Sequence[type[nn.Module] | str] | None = None,
        every_n_epochs: int | None = None,
        every_n_train_steps: int | None = None,
        window_batches: int = 1,
        stage: Literal["val", "train"] | None = None,
        namespace: str | None = None,
        max_samples: int | None = 4096,
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
        num_classes: int | None = None,
        label_key: int | str | None = None,
        label_fn: Callable[[Any], Any] | None = None,
        mask_key: Literal[False] | int | str | Callable[[Any], Tensor | None] | None = None,
        output_selector: OutputSelector | None = None,
        repeated_calls: Literal["first", "each"] = "first",
        unbatched: bool = False,
        log_per_class: bool = False,
        max_gram_features: int = 4096,
        memory_budget_mb: float | None = 4096.0,
        token_layout: Literal["auto", "batch_first", "sequence_first"] = "auto",
        input_key: int | str | None = None,
        log_at_init: bool = True,
        on_test: bool = True,
        figures_every_n_epochs: int | None = None,
        verbose: bool = True,
    ) -> None:
        # The arguments, checked and stored by _configure: this signature alone is near the function length limit.
        self._configure({name: value for name, value in locals().items() if name != "self"})
        self._layers: dict[str, str] = {}
        self._layouts, self._ambiguous_layouts = dict[str, bool](), dict[str, bool]()
        self._channel_maps: dict[str, int | None] = {}
        self._channels_last: dict[str, tuple[frozenset[int], frozenset[int]]] = {}
        self._num_classes: int | None = None
        self._stream: ActivationStream | None = None
        self._target_step: int | None = None
        self._manual_steps: deque[int] = deque(maxlen=STEP_HISTORY)
        self._reset_manual_steps()

    def _reset_manual_steps(self) -> None:
        """Step cadence under manual optimization: forget the optimizer steps each recent training batch took, the
        steps the batches to come are expected to take (:func:`repeating_steps`) and the step of a window started
        again (its batches took fewer steps than planned)."""
        self._manual_steps.clear()
        self._manual_pattern: list[int] | None = None
        self._restarted_window: int | None = None

    def _configure(self, options: dict[str, Any]) -> None:
        o = options
        for name in ("on_test", "log_per_class"):
            check_bool(name, o[name])
        stage = _stage(o["stage"], o["every_n_train_steps"])
        self.namespace = None if o["namespace"] is None else check_namespace(o["namespace"])
        super().__init__(
            self.namespace or ("rank" if stage == "val" else "rank_train"),
            every_n_epochs=o["every_n_epochs"],
            every_n_train_steps=o["every_n_train_steps"],
            window_batches=o["window_batches"],
            figures_every_n_epochs=o["figures_every_n_epochs"],
            log_at_init=o["log_at_init"],
            on_test=o["on_test"] and stage == "val",
            verbose=o["verbose"],
        )
        for name in ("max_samples", "num_classes"):
            check_positive_int(name, o[name], allow_none=True)
        check_positive("memory_budget_mb", o["memory_budget_mb"], allow_none=True)
        self.layers = check_names("layers", o["layers"])
        self.layer_types = None if o["layer_types"] is None else check_layer_types(o["layer_types"])
        self.stage, self.max_samples, self.num_classes = stage, o["max_samples"], o["num_classes"]
        conv = check_choice("conv_reduction", o["conv_reduction"], CONV_REDUCTIONS)
        self.reductions = {4: conv, 3: check_choice("token_reduction", o["token_reduction"], TOKEN_REDUCTIONS)}
        self.token_layout = check_choice("token_layout", o["token_layout"], TOKEN_LAYOUTS)
        self.metrics = check_choices("metrics", o["metrics"], ACTIVATION_METRICS)
        self.center = check_choice("center", o["center"], (False, True))
        variance_ratio_ks = check_metric_ks("variance_ratio_ks", o["variance_ratio_ks"], "variance_ratio", self.metrics)
        self.log_per_class = o["log_per_class"]
        self.output_selector, self.memory_budget_mb = o["output_selector"], o["memory_budget_mb"]
        self.repeated_calls = check_choice("repeated_calls", o["repeated_calls"], REPEATED_CALLS)
        self.unbatched = check_choice("unbatched", o["unbatched"], (False, True))
        keys = {key: o[key] for key in ("input_key", "label_key", "label_fn", "mask_key")}
        self.batch_reader = BatchReader(**keys)
        spectrum = (
            "center",
            "soft_rank_tau",
            "rank_tolerance",
            "tolerance_size",
            "tolerance_dtype",
            "gram_precision",
            "alpha_req_range",
        )
        self.spectrum_options = _spectrum_options(
            variance_ratio_ks=variance_ratio_ks,
            classwise="classwise_variance_ratio" in self.metrics,
            max_gram_features=o["max_gram_features"],
            **{key: o[key] for key in spectrum},
        )

    @property
    @override
    def state_key(self) -> str:
        # A list, as before layers became a tuple: checkpoints saved then still find their state.
        named = {} if self.namespace is None else {"namespace": self.namespace}
        return self._generate_state_key(
            layers=None if self.layers is None else list(self.layers), stage=self.stage, **named
        )

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
        self._layouts, self._ambiguous_layouts = token_layouts(module, self._layers, self.token_layout)
        self._channel_maps = channel_first_layers(module, self._layers)
        self._channels_last = channels_last_layers(module, self._layers)
        return self.monitored

    @override
    def prepare(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.cadence.check_window(trainer, pl_module.automatic_optimization)
        self.select(pl_module)
        check_distinct_namespaces(trainer, self)  # after this monitor's own settings are checked
        self._num_classes = self.num_classes or _num_classes_of(pl_module, trainer)
        names = ", ".join(name if name == path else f"{name} ({path})" for name, path in self._layers.items())
        classes = "no class metrics (num_classes unknown)"
        if self._num_classes:
            classes = count_of(self._num_classes, "class", "classes")
        how = ""
        if self.layers is None and self.layer_types is None and module_blocks(pl_module) is None:
            copies = frozen_copies(pl_module)
            left_out = f"; frozen copies (momentum targets) left out: {', '.join(copies)}" if copies else ""
            how = f" (default choice: the module has no blocks(){left_out}; pass layers=[...] to choose)"
        if str(getattr(stage, "value", stage)) == "predict":
            self.info("trainer.predict is not monitored (validation, training or test batches are)")
        elif stage == "test" and not self.cadence.on_test:
            why = "stage='train' measures training batches" if self.stage == "train" else "on_test=False"
            self.info(f"trainer.test is not monitored ({why})")
        else:
            data = f", the test data under {self.curves.namespace}{TEST_SUFFIX}/" if stage == "test" else ""
            self.info(f"monitoring {count_of(len(self._layers), 'layer')}{how}, {classes}{data}: {names}")
        self._warn_eager_epochs(pl_module, stage)
        self._stop()
        self._stream = ActivationStream(
            self._layers,
            num_classes=self._num_classes,
            reductions=self.reductions,
            spectrum_options=self.spectrum_options,
            batch_reader=self.batch_reader,
            layouts=self._layouts,
            ambiguous_layouts=self._ambiguous_layouts,
            channel_maps=self._channel_maps,
            channels_last=self._channels_last,
            output_selector=self.output_selector,
            max_samples=self.max_samples,
            memory_budget_mb=self.memory_budget_mb,
            warn=self._warn_layer,
            info=self.info,
            repeated_calls=self.repeated_calls,
            unbatched=self.unbatched,
        )
        options = self.spectrum_options
        dtype = options["tolerance_dtype"]
        self.curves.describe(
            split=self.stage,
            rank_tolerance=options["rank_tolerance"],
            tolerance_size=options["tolerance_size"],
            tolerance_dtype=None if dtype is None else str(dtype).removeprefix("torch."),
        )

    def _warn_eager_epochs(self, pl_module: pl.LightningModule, stage: str) -> None:
        """Say, for ``fit``, that the monitored training epochs of a compiled model run eagerly: an epoch pass hooks
        every batch, and compiled code runs eagerly while hooks are registered
        (:func:`~rank_lightning.layers.forward_hooks`)."""
        epochs = str(getattr(stage, "value", stage)) == "fit" and self.stage == "train" and not self.cadence.by_step
        compiled = compiled_modules(pl_module) if epochs else []
        if not compiled:
            return
        names = ", ".join(repr(path) if path else "the LightningModule" for path in compiled)
        message = (
            "stage='train' at epoch cadence measures every batch of the monitored training epochs "
            f"(every_n_epochs={self.cadence.every_n_epochs}), and compiled code never calls the hooks that read them: "
            f"those epochs run eagerly, without the speed-up of torch.compile (compiled: {names}). Measure windows of "
            "training steps instead (every_n_train_steps=..., window_batches=...): the other steps run compiled."
        )
        self.warn_once(("compiled training epochs",), message)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._stop()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._stop()
        super().on_exception(trainer, pl_module, exception)

    # -- when ---------------------------------------------------------------------------------------------------

    def _monitoring(self, stage: str) -> bool:
        return self._stream is not None and self._stream.active and self.stage == stage

    @override
    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.stage == "val" and self.due(trainer):
            loaders = loader_list(trainer.val_dataloaders)
            self._warn_pooled_loaders(len(loaders), "validation")
            self._start(trainer, pl_module, sum(trainer.num_val_batches), loaders)

    @override
    def on_validation_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if self._monitoring("val"):
            self._stream.batch_start(batch, loader=dataloader_idx)

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
            self._stream.batch_end()

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._monitoring("val"):
            self._finish(trainer, pl_module)

    # -- trainer.test: the test data under keys of their own, outside the curves ---------------------------------

    @override
    def on_test_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.stage == "val" and self.due(trainer):
            loaders = loader_list(trainer.test_dataloaders)
            self._warn_pooled_loaders(len(loaders), "test")
            self._start(trainer, pl_module, sum(trainer.num_test_batches), loaders)

    def _warn_pooled_loaders(self, count: int, kind: str) -> None:
        """Say once that the rows of several validation (or test) loaders make one spectrum, not one per loader."""
        pooled = "their activations are pooled into one spectrum per layer (the rows of every loader together)"
        self.warn_pooled_loaders(count, kind, pooled)

    # The test batches are read as the validation batches are (the stream is the validation-data one).
    on_test_batch_start = on_validation_batch_start
    on_test_batch_end = on_validation_batch_end

    @override
    def on_test_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._monitoring("val"):
            return
        values, _ = self._stream.compute(
            pl_module.device, metrics=self.metrics, centered=self.center, per_class=self.log_per_class, when="in test"
        )
        namespace = f"{self.curves.namespace}{TEST_SUFFIX}"
        scalars = {f"{namespace}/{layer}/{key}": value for layer, row in values.items() for key, value in row.items()}
        log_rank_equal(pl_module, scalars)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_epoch_start(trainer, pl_module)
        if self.stage == "train" and not self.cadence.by_step and self.due(trainer):
            self._start(trainer, pl_module, trainer.num_training_batches, [trainer.train_dataloader])

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._step_at_batch_start = trainer.global_step
        steps_per_batch = None if pl_module.automatic_optimization else self._manual_pattern
        target, window = self._target_step, self.cadence.window_batches
        if target is not None and self._monitoring("train") and self._stream.batches_seen >= window:
            # The window's batches took fewer optimizer steps than planned (under manual optimization, a batch that
            # broke the pattern, such as a step skipped): a window never streams more than window_batches batches, so
            # it starts again over the batches still to come before its step.
            self._stop()
            self._restarted_window = target
        idle = self._stream is not None and not self._stream.active
        if idle and self.cadence.window_opens(trainer, batch_idx, steps_per_batch):
            self._target_step = self.cadence.next_step(trainer)
            # Opened at the last batch of an epoch of unknown length, known only then (said if the window is short).
            self._opened_at_unforeseen_end = math.isinf(trainer.num_training_batches) and at_last_batch(trainer)
            self._start(trainer, pl_module, self.cadence.window_batches)
        if self._monitoring("train"):
            self._stream.batch_start(batch, combined=several_training_loaders(trainer))

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.cadence.by_step:
            # The last window's values stayed one batch (every callback's batch end saw them once); a new one may come.
            self.curves.clear_stale_metrics(trainer)
            if not pl_module.automatic_optimization:
                self._manual_steps.append(trainer.global_step - self._step_at_batch_start)
                self._manual_pattern = repeating_steps(self._manual_steps)
        if not self._monitoring("train"):
            return
        self._stream.batch_end()
        if self._target_step is not None and self.cadence.window_closes(trainer, self._target_step):
            self._warn_short_window(trainer)
            self._target_step = None
            self._finish(trainer, pl_module)

    def _warn_short_window(self, trainer: pl.Trainer) -> None:
        """Name a step window that streamed fewer than ``window_batches`` batches: one opened after the fit resumed
        inside it, one that an epoch's short last accumulation brought closer to the previous window, one whose step
        followed the short last accumulation of an epoch of unknown length (known at its last batch only), or under
        manual optimization the first window (planned before a batch's steps were seen), windows longer than the batches
        between two measurements, and windows started again because their batches took fewer steps than planned."""
        streamed, window = self._stream.batches_seen, self.cadence.window_batches
        if streamed >= window:
            return
        if self._restarted_window == self._target_step:
            message = (
                f"the window of step {trainer.global_step} streamed {streamed} of window_batches={window} training "
                "batches: its batches took fewer optimizer steps than planned (under manual optimization, a batch "
                "that stepped no optimizer, such as a step skipped on a non-finite loss, or steps that follow no "
                "repeating pattern), so it started again over the batches still to come before its step, never "
                "streaming more than window_batches. Its values stand on fewer rows (logged as spectrum_rows)."
            )
            self.warn_once(("restarted window",), message)
            return
        unforeseen_end = self._opened_at_unforeseen_end or at_last_batch(trainer)
        if not self._manual_steps and math.isinf(trainer.num_training_batches) and unforeseen_end:
            accumulate = trainer.accumulate_grad_batches
            message = (
                f"the window of step {trainer.global_step} streamed {streamed} of window_batches={window} training "
                "batches: the training loader has no length (an IterableDataset without __len__), so the end of the "
                "epoch, whose last step follows a shorter accumulation (its batches are not a multiple of "
                f"accumulate_grad_batches={accumulate}), was known only at its last batch. Its values stand on fewer "
                f"rows (logged as spectrum_rows). Give the dataset a __len__, or epochs of a multiple of {accumulate} "
                "batches, for full windows."
            )
            self.warn_once(("short window", "epoch of unknown length"), message)
            return
        message = (
            f"the window of step {trainer.global_step} streamed {streamed} of window_batches={window} training "
            "batches: it opened after the fit resumed inside it from a checkpoint that holds none of its sums (one "
            "saved inside a batch, or by an older version), or an epoch's short last accumulation "
            "brought it within window_batches of the previous window. Its values stand on fewer rows (logged as "
            "spectrum_rows)."
        )
        pattern = self._manual_pattern
        if pattern is not None and pattern != [1]:
            every, rate = self.cadence.every_n_train_steps, sum(pattern) / len(pattern)
            took = f"each batch took {pattern[0]}" if len(set(pattern)) == 1 else f"the batches took {pattern}"
            message += (
                f" Under manual optimization {took} optimizer steps, repeating (trainer.global_step counts every "
                f"optimizer.step()): every_n_train_steps={every} spans {every / rate:.3g} batch(es), and the first "
                f"windows are planned before the steps of the batches are seen. Choose every_n_train_steps >= "
                f"window_batches x {rate:.3g}."
            )
        self.warn_once(("short window",), message)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._monitoring("train") and not self.cadence.by_step:
            self._finish(trainer, pl_module)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_validation_start(trainer, pl_module)
        # Validation interrupts a monitored training epoch or window: its forward passes are not training data.
        if self._monitoring("train"):
            self._stream.pause()

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        # A step window still open when training stops never reached its step: nothing is logged for it.
        if self.cadence.by_step:
            self._stop()

    # -- a pass ---------------------------------------------------------------------------------------------------

    def _start(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        num_batches: float,
        loaders: list[Any] | None = None,
        *,
        name_uncalled: bool = True,
    ) -> None:
        """Hook the layers for a pass of ``num_batches`` batches (``inf`` when unknown) over ``loaders`` (whose
        repeated samples under a ``DistributedSampler`` are left out; none for a step window, which measures its batches
        as they come)."""
        self._stream.start(
            pl_module,
            num_batches=num_batches,
            world_size=trainer.world_size,
            rank=trainer.global_rank,
            loaders=loaders or (),
            name_uncalled=name_uncalled,
        )

    def _stop(self) -> None:
        if self._stream is not None:
            self._stream.stop()
        self._target_step = None

    def _warn_layer(self, name: str, kind: str, message: str) -> None:
        if name:
            self.warn_once((name, kind), f"layer {name!r} {message}")
        else:
            self.warn_once((kind,), message)

    def _finish(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        values = self._pass_values(trainer, pl_module, initial=False)
        if values:
            self.curves.record_and_log(trainer, pl_module, values)

    def _pass_values(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, *, initial: bool
    ) -> dict[str, dict[str, float]]:
        """Unhook and compute every layer measured on every process (a collective); the caption states N and the
        reductions the measured layers used."""
        if initial:
            when = "before training"
        else:
            when = f"at step {trainer.global_step}" if self.cadence.by_step else f"at epoch {trainer.current_epoch}"
        values, samples = self._stream.compute(
            pl_module.device, metrics=self.metrics, centered=self.center, per_class=self.log_per_class, when=when
        )
        used = self._stream.used_reductions()
        self.curves.describe(samples=samples, **({"reduction": used} if used else {}))
        return values

    # -- the initial point ----------------------------------------------------------------------------------------

    @override
    def measures_each_validation(self) -> bool:
        return super().measures_each_validation() and self.stage == "val"

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._reset_manual_steps()  # the steps of this fit's batches
        self._window_size_said = False
        self._initial_point(trainer, pl_module)
        self._resume_inside_epoch(trainer, pl_module)
        self._continue_window(trainer, pl_module)

    def _resume_inside_epoch(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """A fit resumed inside a monitored training epoch (``stage="train"``, epoch cadence): Lightning does not start
        that epoch again (no ``on_train_epoch_start``), so its pass starts here. It continues the sums of the epoch's
        batches before the checkpoint when the checkpoint holds them (:meth:`on_save_checkpoint`), so that the epoch is
        measured as without the interruption; else it streams the batches still to come, and a warning says that the
        epoch's values stand on those only."""
        saved, self._saved_epoch = self._saved_epoch, None
        fit_loop = getattr(trainer, "fit_loop", None)
        if (
            self.stage != "train"
            or self.cadence.by_step
            or self._stream is None
            or not getattr(fit_loop, "restarted_mid_epoch", False)
            or not self.due(trainer)
        ):
            return
        progress = fit_loop.epoch_loop.batch_progress
        if progress.is_last_batch:
            # Saved at the end of the previous epoch's last batch: Lightning goes on with this epoch from its first
            # batch, without on_train_epoch_start.
            self._start(trainer, pl_module, trainer.num_training_batches, [trainer.train_dataloader])
            return
        done = progress.current.processed  # completed lags a checkpoint of batch end
        why = "the checkpoint holds no sums of its batches before (one saved by an older version)"
        if saved is not None:
            why = self._continue_epoch(trainer, pl_module, saved, done)
            if why is None:
                return
        remaining = trainer.num_training_batches - done
        self._start(trainer, pl_module, remaining, [trainer.train_dataloader])
        message = (
            f"the fit resumed inside epoch {trainer.current_epoch}, after {done} of its batches: that epoch is "
            f"measured on the batches still to come (its spectrum_rows counts them): {why}."
        )
        self.warn_once(("resumed inside epoch",), message)

    def _continue_epoch(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, saved: dict[str, Any], done: int
    ) -> str | None:
        """Continue the pass of the epoch the fit resumed inside of, ``done`` batches in, with the sums ``saved`` in
        the checkpoint; ``None`` when it goes on, else why not, in words."""
        streamed = _batches_streamed(saved)
        held = f"the checkpoint holds the sums of {streamed} of its batches, which this fit does not continue"
        why = self._pass_mismatch(trainer, saved)
        position = (saved.get("epoch"), saved.get("global_step"))
        if why is None and position != (trainer.current_epoch, trainer.global_step):
            why = f"they are of epoch {saved.get('epoch')} at step {saved.get('global_step')}, not of this step"
        if why is None and not (isinstance(streamed, int) and 0 < streamed <= done):
            why = f"they are of {streamed} batches, not of the {done} run before it"
        if why is not None:
            return f"{held}: {why}"
        try:
            stream = self._saved_stream(trainer, saved)
            self._stream.resume(pl_module, stream, pl_module.device, loaders=[trainer.train_dataloader])
        except (KeyError, TypeError, ValueError, RuntimeError) as error:
            self._stop()
            reason = str(error).splitlines()[0] if str(error) else type(error).__name__
            return f"{held}: they cannot be loaded ({reason})"
        if streamed < done:  # the pass was itself begun after an earlier resume inside the epoch, without sums
            message = (
                f"the fit resumed inside epoch {trainer.current_epoch}, after {done} of its batches, from a checkpoint "
                f"whose sums hold {streamed} of them: that epoch is measured on those and the batches still to come "
                "(its spectrum_rows counts them)."
            )
            self.warn_once(("resumed inside epoch",), message)
        return None

    # -- a step window open at a checkpoint -----------------------------------------------------------------------

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # A checkpoint loaded by an earlier run of the trainer is not this one's.
        self._saved_window = self._saved_epoch = None
        super().setup(trainer, pl_module, stage)

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        window, epoch = state_dict.get("open_window"), state_dict.get("open_epoch")
        self._saved_window = window if isinstance(window, dict) else None
        self._saved_epoch = epoch if isinstance(epoch, dict) else None

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """A checkpoint saved while a step window or a monitored training epoch (``stage="train"``) is open (between
        its batches) holds the pass's partial sums, so that a fit resumed from it continues the pass
        (:meth:`_continue_window`, :meth:`_resume_inside_epoch`). Under DDP each process streams batches of its own and
        Lightning writes the first process's state only: the sums of every process are gathered into it (a collective,
        which every process joins as Lightning saves a checkpoint on each), and each process of a fit resumed on as
        many processes takes back its own."""
        states = checkpoint.get("callbacks")
        stream = self._stream
        if (
            (self.cadence.by_step and self._target_step is None)
            or not self._monitoring("train")
            or not stream.between_batches
            or not stream.batches_seen
            or not isinstance(states, dict)
            or not isinstance(states.get(self.state_key), dict)
        ):
            return
        streams = _gathered(stream.pass_state(), trainer.world_size)
        if streams is None:
            return
        saved: dict[str, Any] = {"global_step": trainer.global_step, "settings": self._pass_settings()}
        saved |= {"stream": streams[0]} if len(streams) == 1 else {"streams": streams}
        if self.cadence.by_step:
            saved |= {
                "target_step": self._target_step,
                "opened_at_unforeseen_end": self._opened_at_unforeseen_end,
                "restarted": self._restarted_window == self._target_step,
            }
            what, whole = f"window of step {self._target_step}", "window"
            streamed = f"{stream.batches_seen} of window_batches={self.cadence.window_batches} batches"
        else:
            saved["epoch"] = trainer.current_epoch
            what, whole = f"pass of epoch {trainer.current_epoch}", "epoch"
            streamed = f"{stream.batches_seen} of its batches"
        states[self.state_key]["open_window" if self.cadence.by_step else "open_epoch"] = saved
        if not self._window_size_said:
            self._window_size_said = True
            size = sum(_state_bytes(layer["states"]) for part in streams for layer in part["layers"].values())
            processes = f" of {len(streams)} processes" if len(streams) > 1 else ""
            self.info(
                f"the checkpoint at step {trainer.global_step} holds the open {what} ({streamed}): "
                f"{mib_text(size)} MiB of float64 sums{processes}, so that a fit resumed from it measures the whole "
                f"{whole}"
            )

    def _pass_settings(self) -> dict[str, str]:
        """The settings the sums of a step window or a training epoch's pass depend on, in words, to compare with a
        checkpoint's."""
        if self.cadence.by_step:
            cadence = {
                "every_n_train_steps": self.cadence.every_n_train_steps,
                "window_batches": self.cadence.window_batches,
            }
        else:
            cadence = {"every_n_epochs": self.cadence.every_n_epochs}
        settings = {
            **cadence,
            "layers": self._layers,
            "reductions": self.reductions,
            "max_samples": self.max_samples,
            "num_classes": self._num_classes,
            "memory_budget_mb": self.memory_budget_mb,
            "spectrum options": sorted(self.spectrum_options.items()),
        }
        if self.repeated_calls != "first":  # the windows saved before the option existed measured first calls
            settings["repeated_calls"] = self.repeated_calls
        if self.unbatched:  # rows of every number, which a monitor without it skips
            settings["unbatched"] = self.unbatched
        return {name: repr(value) for name, value in settings.items()}

    def _continue_window(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """A fit resumed from a checkpoint saved inside a step window continues that window with the sums the
        checkpoint holds, so that its step is measured over all its ``window_batches`` batches, as without the
        interruption. A window the fit cannot continue (other monitor settings, another number of processes, states
        that do not fit) is named in a warning and measured over the batches still to come."""
        saved, self._saved_window = self._saved_window, None
        if saved is None or self._stream is None:
            return
        target, streamed = saved.get("target_step"), _batches_streamed(saved)
        why = self._window_mismatch(trainer, saved)
        if why is None:
            try:
                self._stream.resume(pl_module, self._saved_stream(trainer, saved), pl_module.device)
            except (KeyError, TypeError, ValueError, RuntimeError) as error:
                self._stop()
                reason = str(error).splitlines()[0] if str(error) else type(error).__name__
                why = f"its sums cannot be loaded ({reason})"
        if why is not None:
            message = (
                f"the checkpoint holds the open window of step {target} ({streamed} of its batches streamed), which "
                f"this fit does not continue: {why}. The window streams the batches still to come, fewer than "
                "window_batches."
            )
            self.warn_once(("saved window",), message)
            return
        self._target_step = target
        self._opened_at_unforeseen_end = bool(saved.get("opened_at_unforeseen_end", False))
        if saved.get("restarted"):
            self._restarted_window = target

    def _window_mismatch(self, trainer: pl.Trainer, saved: dict[str, Any]) -> str | None:
        """Why the saved step window ``saved`` cannot go on in this fit; ``None`` when it can."""
        why = self._pass_mismatch(trainer, saved)
        if why is not None:
            return why
        target = saved.get("target_step")
        if saved.get("global_step") != trainer.global_step or target != self.cadence.next_step(trainer):
            return f"the fit resumed at step {trainer.global_step}, not at the checkpoint's step inside that window"
        return None

    def _pass_mismatch(self, trainer: pl.Trainer, saved: dict[str, Any]) -> str | None:
        """Why the pass ``saved`` in a checkpoint (a step window or a training epoch's) cannot go on in this fit, as far
        as the monitor's settings and the processes tell; ``None`` when it can."""
        settings = saved.get("settings")
        if not isinstance(settings, dict):
            return "it was saved in a form this version does not read"
        ours = self._pass_settings()
        differ = [name for name in ours if settings.get(name) != ours[name]]
        if differ:
            shown = "; ".join(f"{name} {settings.get(name)} there, {ours[name]} here" for name in differ)
            return f"the monitor's settings differ ({shown})"
        processes = len(saved["streams"]) if isinstance(saved.get("streams"), list) else 1
        if processes != trainer.world_size:
            return (
                f"it was saved by {count_of(processes, 'process', 'processes')} and the fit runs on "
                f"{trainer.world_size}, each streaming "
                "batches of its own"
            )
        if not isinstance(self._saved_stream(trainer, saved), dict):
            return "it was saved in a form this version does not read"
        return None

    def _saved_stream(self, trainer: pl.Trainer, saved: dict[str, Any]) -> Any:
        """This process's part of the pass ``saved`` in a checkpoint (of as many processes as the fit runs on)."""
        streams = saved.get("streams")
        return streams[trainer.global_rank] if isinstance(streams, list) else saved.get("stream")

    def _initial_point(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        loaders = _initial_loaders(trainer, self.stage, self.cadence.window_batches if self.cadence.by_step else None)
        if not loaders or self._stream is None:
            return
        initial = self.initial_point_due(trainer)
        if not self._readable(loaders, initial):
            return
        if not initial:
            # One batch before training all the same: the layers' states are planned now (a memory budget they
            # exceed raises now, a layer that never runs is named now), not at the first monitored batch, which may
            # come hours into the fit. Its sums are dropped.
            loaders = [(loaders[0][0], 1)]
        batches = sum(batches for _, batches in loaders)
        # The layers forward() does not run may run in the module's own steps: named by the monitored passes only.
        self._start(trainer, pl_module, batches, [_loader_of(loader) for loader, _ in loaders], name_uncalled=initial)
        try:
            self._initial_pass(trainer, pl_module, loaders)
        except Exception as error:  # a model that cannot run a loader's batch must not stop the fit it precedes
            self._stop()
            if _raised_by_package(error):
                raise  # a setting that does not fit the model or the data: the first monitored batch would raise too
            if not initial:
                return  # forward() may not run a batch by itself; the monitored passes run the module's own steps
            reason = f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"
            message = f"no initial point: the forward pass on a batch failed ({reason}). "
            if type(pl_module).forward is nn.Module.forward:
                advice = (
                    "The LightningModule defines no forward(): define one that runs the model, or log_at_init=False."
                )
            else:
                advice = (
                    "forward() is called with the batch's inputs (input_key), a dict batch's entries by name, the "
                    "batch itself or its inputs (x, image, input_ids, ...): give forward() one of these signatures, "
                    "set input_key, or log_at_init=False."
                )
            self.warn_once(("init",), message + advice)
            return
        if not initial:
            self._stop()
            return
        values = self._pass_values(trainer, pl_module, initial=True)
        if values:
            self.curves.record_initial(trainer, values)

    def _readable(self, loaders: list[tuple[Any, float]], initial: bool) -> bool:
        """Whether the initial pass may read ``loaders`` without taking batches from the fit: a one-pass iterator (a
        generator) would lose them, a resumable iterable would give them from where a resumed fit continues. A warning
        says why there is no initial point."""
        if all(readable_beside(_loader_of(loader)) for loader, _ in loaders):
            return True
        if initial:
            message = (
                f"no initial point: the {'training' if self.stage == 'train' else 'validation'} loader is "
                f"{UNREADABLE_LOADER}, whose batches a pass before training would take from the fit. "
                f"{READABLE_ADVICE} to measure the untrained model."
            )
            self.warn_once(("init",), message)
        return False

    def _initial_pass(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loaders: list[tuple[Any, float]]
    ) -> None:
        # Validation runs in eval mode; training batches in training mode, without touching BatchNorm statistics.
        mode = eval_mode if self.stage == "val" else train_mode
        # The loaders draw seeds and orders, dropout draws masks: the fit's random streams stay those of the
        # unmonitored fit.
        kept = random_state_kept(pl_module, [_loader_of(loader) for loader, _ in loaders])
        # Under the steps' precision (bf16 autocast): the point must be comparable with the monitored passes'.
        precision = step_precision(trainer, self.stage)
        call: str | None = None  # how forward() takes a dict batch, learnt at the first one
        stream = self._stream
        # A training loader of unknown length may be endless: no more of its batches than the fit takes to max_steps.
        cap = _batches_before_max_steps(trainer) if self.stage == "train" else math.inf

        def ran() -> int:
            return 0 if stream is None else stream.layers_run_in_batch

        with measuring_without_grad(), mode(pl_module), buffers_kept(pl_module), kept, precision:
            for number, (loader, batches) in enumerate(loaders):
                for index, batch in enumerate(loader):
                    # A loader of unknown length stops once max_samples is offered (on every process at the same
                    # batch); one of known length runs its batches, over which the rows are spread.
                    last = cap if math.isinf(batches) else batches
                    if index >= last or (math.isinf(batches) and self._stream.exhausted):
                        break
                    batch = step_inputs(trainer, batch)
                    combined = isinstance(loader, TrainingBatches) and loader.combined
                    self._stream.batch_start(batch, loader=number, combined=combined)
                    if combined:
                        # A step of several training loaders: their inputs in one forward pass, in loader order.
                        pl_module(torch.cat([self.batch_reader.inputs(part) for part in loader.parts(batch)]))
                    else:
                        call = forward_batch(pl_module, batch, self.batch_reader, call, ran=ran)
                    self._stream.batch_end()


def _initial_loaders(trainer: pl.Trainer, stage: str, window: int | None) -> list[tuple[Any, float]]:
    """The loaders of the initial pass and the batches to take from each, as the monitored passes take them: the
    counts Lightning set for the fit (``num_val_batches`` per validation loader, ``num_training_batches``, after
    ``limit_*_batches``; ``inf`` for a loader of unknown length, whose rows then stop at ``max_samples``), or one
    step ``window`` of training batches."""
    if stage == "train":
        # Copies of the loaders (Lightning holds the training iterators already); several are combined as in the fit.
        # A loader is never asked for its truth value: a DataLoader of an IterableDataset without __len__ raises.
        training = TrainingBatches(trainer)
        batches = window if window is not None else trainer.num_training_batches
        return [(training, batches)] if training.loaders is not None and batches > 0 else []
    loaders = loader_list(trainer.val_dataloaders)
    counts = list(trainer.num_val_batches)
    if len(counts) != len(loaders):  # not counted yet: every batch, up to max_samples
        counts = [math.inf] * len(loaders)
    return [(side_loader(loader), batches) for loader, batches in zip(loaders, counts) if batches > 0]


def _gathered(state: dict[str, Any], world_size: int) -> list[dict[str, Any]] | None:
    """The saved pass ``state`` of every process, in process order (a collective under DDP: every process calls it);
    ``[state]`` on one process, ``None`` for several processes without a process group to gather them over.

    The processes send theirs in turn (``broadcast_object_list``), so that the device holds one process's sums at a
    time on the way (an ``all_gather_object`` holds all of them at once, twice), never W times them."""
    if world_size <= 1:
        return [state]
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    rank, gathered = torch.distributed.get_rank(), []
    for sender in range(torch.distributed.get_world_size()):
        box = [state if sender == rank else None]
        torch.distributed.broadcast_object_list(box, src=sender)
        gathered.append(box[0])
    return gathered


def _batches_streamed(saved: dict[str, Any]) -> Any:
    """The batches a pass saved in a checkpoint had streamed (on every process alike), ``None`` if it does not say."""
    streams = saved.get("streams") if isinstance(saved.get("streams"), list) else [saved.get("stream")]
    first = streams[0] if streams and isinstance(streams[0], dict) else {}
    return first.get("batches_seen")


def _state_bytes(states: dict[str, Any]) -> int:
    """Bytes of the tensors of a metric's saved states (a tensor, or a list of them, per state)."""
    total = 0
    for value in states.values():
        for part in value if isinstance(value, list) else [value]:
            if isinstance(part, Tensor):
                total += part.numel() * part.element_size()
    return total


def _batches_before_max_steps(trainer: pl.Trainer) -> float:
    """The training batches that take a fresh fit to ``max_steps`` under automatic optimization (``max_steps`` times
    ``accumulate_grad_batches``), the most its first epoch can stream: where the initial pass over a training loader
    of unknown length (an endless ``IterableDataset``) with ``max_samples=None`` stops. ``inf`` without ``max_steps``,
    or under manual optimization, whose batches per step are not known before training."""
    max_steps = getattr(trainer, "max_steps", -1)
    module = getattr(trainer, "lightning_module", None)
    if not isinstance(max_steps, int) or max_steps < 0 or not getattr(module, "automatic_optimization", True):
        return math.inf
    return float(max_steps * max(int(getattr(trainer, "accumulate_grad_batches", 1) or 1), 1))


def _loader_of(loader: Any) -> Any:
    """The loader (or collection of loaders) behind one loader of an initial pass."""
    return loader.loaders if isinstance(loader, TrainingBatches) else loader


def _raised_by_package(error: BaseException) -> bool:
    """Whether ``error`` was raised while the stream read a batch or a layer's output (a setting checked against the
    model or the data, such as ``label_key``, ``mask_key``, ``output_selector`` or ``memory_budget_mb``) rather than
    by the model's own forward: whether its traceback passes through :mod:`rank_lightning.streams`."""
    stream_file = Path(streams.__file__).resolve()
    traceback = error.__traceback__
    while traceback is not None:
        if Path(traceback.tb_frame.f_code.co_filename).resolve() == stream_file:
            return True
        traceback = traceback.tb_next
    return False


def _stage(stage: str | None, every_n_train_steps: int | None) -> str:
    """The monitored stage: ``"train"`` for a step cadence (which streams training batches), else ``"val"``."""
    if stage is None:
        return "train" if every_n_train_steps is not None else "val"
    stage = check_choice("stage", stage, STAGES)
    if every_n_train_steps is not None and stage != "train":
        raise ValueError(
            f"stage={stage!r} with every_n_train_steps={every_n_train_steps}: step windows stream training batches; "
            "use stage='train' (or leave it unset), or every_n_epochs for validation"
        )
    return stage


def _spectrum_options(**options: Any) -> dict[str, Any]:
    """The :class:`~rank_lightning.metrics.ActivationSpectrum` settings every monitored layer shares, checked now
    rather than at the first monitored batch."""
    ActivationSpectrum(**options)
    return options


_CLASSIFIER_SUFFIXES = ("ForSequenceClassification", "ForImageClassification", "ForAudioClassification")


def _num_classes_of(pl_module: nn.Module, trainer: pl.Trainer) -> int | None:
    """``num_classes`` of the module or the datamodule, else ``config.num_labels`` of a Hugging Face classifier of
    whole inputs (``...ForSequenceClassification`` and the like) inside the module."""
    for source in (pl_module, getattr(trainer, "datamodule", None)):
        value = getattr(source, "num_classes", None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    for module in pl_module.modules():
        labels = getattr(getattr(module, "config", None), "num_labels", None)
        if type(module).__name__.endswith(_CLASSIFIER_SUFFIXES) and isinstance(labels, int) and labels > 1:
            return labels
    return None
