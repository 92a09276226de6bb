"""Neural collapse of the features feeding the classifier head, logged every few epochs by
:class:`NeuralCollapseMonitor` (Papyan, Han & Donoho 2020; Galanti et al. 2022)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Literal, cast

import pytorch_lightning as pl
import torch
from torch import Tensor, nn
from typing_extensions import override

from rank_lightning.callbacks.base import CurveMonitor, RowQuota, first_call_keeper, step_inputs, val_loaders
from rank_lightning.callbacks.curves import check_distinct_namespaces
from rank_lightning.functional.neural_collapse import NC_METRICS, NeuralCollapse
from rank_lightning.layers import (
    DECODER_MASK_KEY,
    MASK_KEY,
    BatchReader,
    FeatureLayer,
    check_label_rows,
    classifier_head,
    decoder_layers,
    eager_name,
    eval_mode,
    forward_batch,
    forward_hooks,
    random_state_kept,
)
from rank_lightning.metrics import NeuralCollapseStatistics
from rank_lightning.metrics.neural_collapse import check_neural_collapse_memory
from rank_lightning.sampling import process_share
from rank_lightning.validation import check_choices, check_positive, check_positive_int, count_of

__all__ = ["NC_METRICS", "NeuralCollapseMonitor"]


class NeuralCollapseMonitor(CurveMonitor):
    """Log neural collapse NC1-NC4 and the CDNV of the head's input features (the last hidden representation).

    The head is ``head`` when given (the syntax of :func:`~rank_lightning.layers.select_layers`, one module), else the
    package's ``backbone.<head_path>``, else the module's ``head_path``, else its last ``nn.Linear``. A forward hook on
    it reads its input ``h`` (the features, ``(B, d)``), its output (the logits, whose argmax is the network's
    prediction for NC4) and its ``(C, d)`` weight (for NC3); C is the head's output width and the labels must lie in
    ``[0, C)``. Definitions and conventions: :mod:`rank_lightning.functional.neural_collapse`.

    Two passes: NC4 compares the head with the nearest-class-centre rule, which needs the class means before any
    sample is classified, and NC1 is exact only from residuals around the means. So, in every monitored epoch, the
    monitor reads the validation data twice, in eval mode and without gradients (every submodule's training flag is
    restored afterwards): the first pass streams class counts and class sums, the second the residuals around the
    class means and the agreements (:class:`~rank_lightning.metrics.NeuralCollapseStatistics`). Several validation
    dataloaders are pooled: both passes read every loader in turn, and their samples together make one measurement,
    with a warning. Both passes must see the same samples: a validation loader without random augmentation (the order
    may differ; with ``max_samples`` the first batches are taken, in loader order, so the order must not change). The
    cost is two forward passes over those samples per monitored epoch, besides the validation loop itself, whose
    ``limit_val_batches`` does not apply. Under DDP every process reads its share (``max_samples`` shared out exactly:
    ``max_samples // world_size``, one more on the first ``max_samples % world_size`` processes) and the sums are
    all-reduced, so every process logs the numbers one process would compute on all the samples; the samples
    Lightning's distributed sampler repeats to pad the processes to one length are left out
    (:func:`~rank_lightning.sampling.own_samples`).

    Timing: at the end of validation (``on_validation_epoch_end``) in every ``every_n_epochs``-th epoch of ``fit``
    and, with ``on_validate``, of every ``trainer.validate`` run; with ``log_at_init``, also once before the first
    training step (recorded as epoch ``-1``). Sanity checks are skipped. Figures and the curve file
    ``neural_collapse_curves.json`` go to ``<run dir>/rank_curves/``
    (:class:`~rank_lightning.callbacks.curves.LayerCurves`). A value that cannot be computed is logged as NaN
    (non-finite features; fewer than two classes; for NC1 and NC4, class means that coincide up to rounding, which a
    warning names; no head weight for NC3) and never stops training. A class of the head without a sample among the
    measured ones is left out of every metric (C counts the classes present), with a warning naming it. The class
    sums are kept in float64, and NC1 drops the between-class directions at the rounding level of the precision the
    features were computed in (:func:`~rank_lightning.functional.neural_collapse.between_class_directions`).

    Next-token classes (Wu & Papyan 2024): a head applied to every token (a language model's ``lm_head``, input
    ``(B, T, D)``, logits ``(B, T, V)``) with labels per token ``(B, T)`` (the next tokens, -100 where a position has
    no class) takes every real token with a class as a sample: the rows, the attention mask (``mask_key``) and the
    -100 exclusion are those of ``ActivationRankMonitor(num_classes=V)``'s ``token`` layers, and ``max_samples``
    counts sequences. A vocabulary's ``V x V`` class pairs do not fit in memory: ``top_classes=K`` computes the
    metrics of the ``K`` most frequent classes of the measured tokens (around the mean of every token,
    :class:`~rank_lightning.metrics.NeuralCollapseStatistics`), and a plan beyond ``memory_budget_mb`` is refused
    with a ``MemoryError`` at setup, naming both options, before any training step.

    Args:
        head: the classifier head on the LightningModule (module path, block name or glob matching one module);
            ``None`` finds it (see above).
        metrics: which of :data:`~rank_lightning.functional.neural_collapse.NC_METRICS` to log.
        every_n_epochs: monitor every this many epochs.
        on_validate: also monitor ``trainer.validate`` runs.
        max_samples: at most this many validation samples per pass (the first, in loader order); ``None`` for all.
        input_key: where the inputs are in a batch; ``None`` for the ``x`` of ``(x, y)`` batches, and for dict
            batches the rule of :func:`~rank_lightning.layers.forward_batch` (``forward(**entries)``,
            ``forward(batch)``, else the dict's ``x`` / ``image`` / ``input_ids`` ...).
        label_key: where the integer labels are in a batch; ``None`` for the ``y`` of ``(x, y)`` batches.
        label_fn: ``batch -> labels``, overriding ``label_key``.
        log_at_init: also measure the untrained model at the start of a fresh ``fit``.
        figures_every_n_epochs: also draw the figures after every this many monitored epochs.
        verbose: report the head at setup (rank zero).
        top_classes: measure the ``K`` classes with the most samples only (a vocabulary's next-token classes), their
            samples counted in the first of each measurement's two passes (over all processes; ties go to the smaller
            class index); ``None`` for every class.
        mask_key: where a token head's ``(B, T)`` attention mask is (:class:`~rank_lightning.layers.BatchReader`);
            ``None``: the batch's ``decoder_attention_mask`` if it has one, else its ``attention_mask`` (not for the
            head of an encoder-decoder model, T5's ``lm_head``: the labels' -100 alone then, with a warning).
        memory_budget_mb: the most memory (MiB) the neural-collapse statistics may plan for; ``None`` for no limit.

    Raises:
        ValueError: at construction for an invalid setting; at setup when no head can be found or ``head`` matches
            no module or several.
        MemoryError: at setup (or, for a head without a ``(C, d)`` weight, at the first measured batch) when the
            statistics of the head's classes plan more than ``memory_budget_mb``; the message names ``top_classes``.

    Example::

        import pytorch_lightning as pl
        from rank_lightning.callbacks import NeuralCollapseMonitor

        monitor = NeuralCollapseMonitor(every_n_epochs=5)
        trainer = pl.Trainer(max_epochs=200, callbacks=[monitor])
        trainer.fit(model, datamodule=datamodule)  # any LightningModule with a classifier head

    Logged metrics:
        For the head ``<head>`` (its module path) and the chosen metrics:

        * ``neural_collapse/<head>/nc1``: ``Tr(Sigma_W Sigma_B^+) / C`` (Papyan et al. 2020, NC1).
        * ``neural_collapse/<head>/nc2_equinorm``: ``std_c ||mu_c - mu_G|| / mean_c ||mu_c - mu_G||`` (NC2).
        * ``neural_collapse/<head>/nc2_equiangularity``: ``mean_{c != c'} |cos(mu_c - mu_G, mu_c' - mu_G) +
          1/(C-1)|``, the deviation from the simplex angle (NC2).
        * ``neural_collapse/<head>/nc2_cosine_std``: ``std_{c != c'}`` of those cosines (NC2).
        * ``neural_collapse/<head>/nc3``: ``||W/||W||_F - M/||M||_F||_F^2``, head weight against centred class
          means (NC3).
        * ``neural_collapse/<head>/nc4``: fraction of samples whose prediction equals the nearest class mean (NC4;
          collapse drives it to 1; NaN when the class means span no direction).
        * ``neural_collapse/<head>/cdnv``: ``mean_{c < c'} (V_c + V_c') / (2 ||mu_c - mu_c'||^2)`` (Galanti et al.).
    """

    def __init__(
        self,
        *,
        head: str | None = None,
        metrics: Sequence[str] = NC_METRICS,
        every_n_epochs: int = 1,
        on_validate: bool = True,
        max_samples: int | None = None,
        input_key: int | str | None = None,
        label_key: int | str | None = None,
        label_fn: Callable[[Any], Any] | None = None,
        log_at_init: bool = False,
        figures_every_n_epochs: int | None = None,
        verbose: bool = True,
        top_classes: int | None = None,
        mask_key: Literal[False] | int | str | Callable[[Any], Tensor | None] | None = None,
        memory_budget_mb: float | None = 4096.0,
    ) -> None:
        super().__init__(
            "neural_collapse",
            every_n_epochs=every_n_epochs,
            on_validate=on_validate,
            figures_every_n_epochs=figures_every_n_epochs,
            log_at_init=log_at_init,
            verbose=verbose,
        )
        if head is not None and (not isinstance(head, str) or not head):
            raise ValueError(f"head must be None or a module path, got {head!r}")
        check_positive_int("max_samples", max_samples, allow_none=True)
        check_positive_int("top_classes", top_classes, allow_none=True)
        check_positive("memory_budget_mb", memory_budget_mb, allow_none=True)
        self.head = head
        self.metrics = check_choices("metrics", metrics, NC_METRICS)
        self.max_samples = max_samples
        self.top_classes, self.memory_budget_mb = top_classes, memory_budget_mb
        self.reader = BatchReader(input_key=input_key, label_key=label_key, label_fn=label_fn, mask_key=mask_key)
        self._call: str | None = None  # how forward() takes a dict batch (layers.forward_batch)
        self.result: NeuralCollapse | None = None
        self._head_path: str | None = None
        self._target_head = False  # the head reads an encoder-decoder's target tokens (set at setup)

    @property
    def head_path(self) -> str | None:
        """Module path of the head on the LightningModule (resolved at setup)."""
        return self._head_path

    def find_head(self, module: nn.Module) -> str:
        """Module path of the head: ``head``, else ``backbone.<head_path>``, else ``head_path``, else the last Linear.

        Raises:
            ValueError: ``head`` matching no module or several, an ``nn.Identity`` head, or a module without any.
        """
        return classifier_head(module, self.head)

    @override
    def prepare(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        check_distinct_namespaces(trainer, self)
        self._head_path = self.find_head(pl_module)
        # The head of an encoder-decoder (T5's lm_head) reads the decoder's tokens: never the encoder's mask.
        by_default = self.reader.default_mask_lookup
        self._target_head = by_default and bool(decoder_layers(pl_module, {self._head_path: self._head_path}))
        weight = getattr(pl_module.get_submodule(self._head_path), "weight", None)
        if isinstance(weight, Tensor) and weight.ndim == 2:
            # The head's (C, d) weight tells the plan before any training step (else the first batch's shapes do).
            check_neural_collapse_memory(*weight.shape, self.top_classes, self.memory_budget_mb)
        head = eager_name(self._head_path)
        self.info(f"neural collapse of the input of {head!r} (two passes over the validation data)")
        self.curves.describe(split="val")

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        if self.initial_point_due(trainer):
            values = self.measure(trainer, pl_module)
            if values:
                self.curves.record_initial(trainer, values)

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.due(trainer):
            values = self.measure(trainer, pl_module)
            if values:
                self.curves.record_and_log(trainer, pl_module, values)

    def measure(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, dict[str, float]]:
        """Both passes over the validation loaders, pooled; ``{head: {metric: value}}`` (empty without data)."""
        loaders = val_loaders(trainer)
        if not loaders:
            self.warn_once(("no validation data",), "needs validation data; nothing measured")
            return {}
        pooled = "their samples are pooled into one measurement (the class means and neural collapse of every "
        pooled += "loader's samples together; max_samples takes the first samples in loader order)"
        self.warn_pooled_loaders(len(loaders), "validation", pooled)
        path = self._head_path or self.find_head(pl_module)
        limit = process_share(self.max_samples, trainer.world_size, trainer.global_rank)
        self._call = None  # learnt again for this module and loader
        with random_state_kept(pl_module, loaders):  # the loaders' iterators draw seeds
            metric = self._stream(pl_module, loaders, path, limit, None)
            if metric is None:
                return {}
            metric.start_second_pass()
            self._stream(pl_module, loaders, path, limit, metric)
        # Logged under the eager name: a compiled network's head has the key of the uncompiled one.
        return {eager_name(path): self._values(metric, pl_module.get_submodule(path))}

    def _values(self, metric: NeuralCollapseStatistics, head: nn.Module) -> dict[str, float]:
        weight = getattr(head, "weight", None)
        shape = (metric.num_classes, metric.num_features)
        metric.head_weight = weight.detach() if isinstance(weight, Tensor) and tuple(weight.shape) == shape else None
        if metric.head_weight is None and "nc3" in self.metrics:
            found = tuple(weight.shape) if isinstance(weight, Tensor) else None
            self.warn_once(("nc3",), f"the head has no {shape} weight (found {found}); nc3 is logged as NaN")
        try:
            self.result = metric.compute()
        except RuntimeError as error:  # the passes saw different data: say so, log NaN, keep training
            self.warn_once(("passes differ",), f"{error}; neural collapse is logged as NaN")
            return dict.fromkeys(self.metrics, math.nan)
        self.curves.describe(samples=self.result.num_samples)
        self._warn_absent_classes(metric)
        undefined = [name for name in ("nc1", "nc4") if name in self.metrics]
        if undefined and self.result.num_classes >= 2 and metric.between_class_rank == 0:
            if bool(torch.isfinite(metric.class_sums).all()):
                dtype = str(metric.input_dtype or torch.float64).removeprefix("torch.")
                message = (
                    f"the class means of the input of {self._head_path!r} differ by no more than the rounding of "
                    f"its {dtype} features (their centred means span no direction above max(C, d) * eps * max_c "
                    f"||mu_c||): {' and '.join(undefined)} are logged as NaN until the classes separate"
                )
                self.warn_once(("no between-class directions",), message)
        return self.result.as_dict(self.metrics)

    def _warn_absent_classes(self, metric: NeuralCollapseStatistics) -> None:
        """Name the head's classes that the measured samples do not hold: the metrics are over the others only."""
        absent = metric.absent_classes or []
        if not absent or (self.top_classes is not None and len(metric.selected_classes or []) == self.top_classes):
            return  # the selected classes are the top_classes most frequent: the others are not measured anyway
        present = metric.num_classes - len(absent)
        if present < 2:
            effect = (
                f"with {count_of(present, 'class', 'classes')} every metric is NaN (neural collapse compares two "
                "classes or more)"
            )
        else:
            nc4 = "nc4 counts a sample the head assigns to an absent class as a disagreement"
            if self.top_classes is not None:
                nc4 = f"fewer than top_classes={self.top_classes}; nc4 takes the head's prediction among them"
            effect = (
                f"the metrics cover the other {present} only (C = {present}: nc2's simplex angle is -1/{present - 1}; "
                f"{nc4})"
            )
        named = (
            f"{absent}" if len(absent) <= 10 else f"{absent[:10]} and {len(absent) - 10} more ({len(absent)} in all)"
        )
        message = (
            f"the measured validation samples hold no sample of classes {named} of the head's {metric.num_classes}: "
            f"{effect}; measure more samples (max_samples) or a loader that holds every class"
        )
        self.warn_once(("absent classes", tuple(absent)), message)

    def _stream(
        self,
        pl_module: pl.LightningModule,
        loaders: list[Any],
        path: str,
        limit: int | None,
        metric: NeuralCollapseStatistics | None,
    ) -> NeuralCollapseStatistics | None:
        """One pass: feed (features, labels[, logits]) of every batch of ``loaders``, in turn, to ``metric`` (created
        at the first batch); the samples a ``DistributedSampler`` repeats are measured once (:class:`RowQuota`)."""
        captured: dict[str, Tensor] = {}
        layers = [FeatureLayer("features", path, "input"), FeatureLayer("logits", path, "output")]
        # A process with nothing to take still runs one batch, to join the collective with the metric.
        second, quota = metric is not None, RowQuota(limit, started=metric is not None)
        with forward_hooks(pl_module, layers, first_call_keeper(self, path, captured)):
            with eval_mode(pl_module), torch.no_grad():
                for index, (batch, room) in enumerate(quota.batches(loaders)):
                    # The whole batch, as the steps get it (the module's batch-transfer hooks, the precision's cast).
                    batch = step_inputs(pl_module.trainer, batch)
                    y = cast(Tensor, self.reader.labels(batch, required=True, per_token=True))
                    # Labels per token: the head's rows are tokens. A mask's 0 / 1 values are checked here at a pass's
                    # first batch, later by the metric in its one read of the batch (as the label range).
                    mask = self._mask(batch, convert=index == 0) if y.ndim == 2 else None
                    captured.clear()
                    self._call = forward_batch(pl_module, batch, self.reader, self._call, ran=lambda: captured)
                    features = captured.get("features")
                    if isinstance(features, Tensor) and features.ndim:
                        check_label_rows(y, features.shape[0], f"the inputs of the head {path!r}")
                    take = y.shape[0] if room is None else min(y.shape[0], room)
                    mask = None if mask is None else mask[:take].to(pl_module.device)
                    metric = self._update(metric, captured, y[:take].to(pl_module.device), take, second, mask)
                    if metric is None:
                        return None
                    quota.took(take)
        return metric

    def _mask(self, batch: Any, *, convert: bool = True) -> Tensor | None:
        """The attention mask of a token head's rows: ``mask_key``'s, else the batch's decoder mask (a target's
        tokens), else its ``attention_mask``; used only for ``(B, T, D)`` head inputs. The head of an encoder-decoder
        model (:func:`~rank_lightning.layers.decoder_layers`) never takes the ``attention_mask``, the encoder's: without
        a decoder mask its rows are left out by the labels' -100 alone, with a warning."""
        decoder = self.reader.decoder_mask(batch, convert=convert)
        if decoder is not None or not self._target_head:
            return decoder if decoder is not None else self.reader.mask(batch, convert=convert)
        message = (
            f"the head {self._head_path!r} reads the decoder's tokens of an encoder-decoder model, but the batch has "
            f"no {DECODER_MASK_KEY!r} (its {MASK_KEY!r}, if any, is the encoder's and is not used): every target "
            f"position whose label is not -100 is a sample. Put the target's mask in the batch as "
            f"{DECODER_MASK_KEY!r} (e.g. labels != -100 for right-padded labels), or name it with mask_key."
        )
        self.warn_once(("decoder mask",), message)
        return None

    def _update(
        self,
        metric: NeuralCollapseStatistics | None,
        captured: dict[str, Tensor],
        labels: Tensor,
        take: int,
        second: bool,
        mask: Tensor | None,
    ) -> NeuralCollapseStatistics | None:
        features, logits = captured.get("features"), captured.get("logits")
        if not isinstance(features, Tensor) or not isinstance(logits, Tensor):
            raise RuntimeError(f"the head {self._head_path!r} was not called in the forward pass")
        tokens = features.ndim == 3 and logits.ndim == 3 and labels.ndim == 2
        if labels.ndim == 2 and not tokens:
            raise ValueError(
                f"the batch's labels are per token, of shape {tuple(labels.shape)}, but the head {self._head_path!r} "
                f"takes {tuple(features.shape)} and gives {tuple(logits.shape)}: labels per token need a head applied "
                "to every token, (B, T, D) -> (B, T, C) (a language model's lm_head); a head of one row per sequence "
                "needs one label per sequence"
            )
        if not tokens and (features.ndim != 2 or logits.ndim != 2):
            self.warn_once(
                ("shape",),
                f"the head's input {tuple(features.shape)} and output {tuple(logits.shape)} are not (B, d) and "
                "(B, C), nor (B, T, D) and (B, T, C) with labels per token; neural collapse needs one feature vector "
                "per sample and is not measured",
            )
            return None
        if metric is None:
            options = {"top_classes": self.top_classes, "memory_budget_mb": self.memory_budget_mb}
            metric = NeuralCollapseStatistics(logits.shape[-1], features.shape[-1], **options).to(features.device)
        # Also with no row to take: the batch tells the precision of the features (NC1's cut-off), as on the others.
        metric.update(features[:take], labels, logits[:take] if second else None, mask=mask if tokens else None)
        return metric
