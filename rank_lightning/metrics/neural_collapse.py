"""Neural collapse streamed in two passes over the same data: class sums, then residuals around the class means."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric
from typing_extensions import override

from rank_lightning.functional.neural_collapse import (
    NeuralCollapse,
    between_class_directions,
    class_means,
    class_rows,
    most_frequent_classes,
    nearest_class_centre,
    neural_collapse_from_residuals,
    residual_moments,
)
from rank_lightning.functional.reductions import check_token_mask
from rank_lightning.functional.streaming import IGNORE_INDEX, class_counts, row_moments
from rank_lightning.layers import class_labels
from rank_lightning.metrics.activation_spectrum import device_move_only
from rank_lightning.validation import check_positive, check_positive_int, check_real, count_of, mib_text

__all__ = ["NeuralCollapseStatistics", "check_neural_collapse_memory", "neural_collapse_memory_mb"]


_FEATURE_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
_MIB = 1 << 20
# Measured peak of NC2's cosines and the CDNV's pair distances: about 34-36 bytes per (class, class) entry.
_PAIR_BYTES = 40
# The V x d float64 class sums, their all-reduced copy, the sync's copy and a batch's own sums, besides the K x d
# means of the metrics' classes and their SVD.
_SUM_COPIES, _MEAN_COPIES = 4, 3


def neural_collapse_memory_mb(num_classes: int, num_features: int, top_classes: int | None = None) -> float:
    """The memory (MiB) :class:`NeuralCollapseStatistics` plans for: its ``(C, d)`` float64 class sums (in a few
    copies) and the ``K x K`` objects of the metrics' ``K`` classes (NC2's cosines, the CDNV's pairs), ``K = C``
    without ``top_classes``."""
    selected = num_classes if top_classes is None else min(top_classes, num_classes)
    sums = 8 * num_features * (_SUM_COPIES * num_classes + _MEAN_COPIES * selected)
    return (sums + _PAIR_BYTES * selected**2) / _MIB


def check_neural_collapse_memory(
    num_classes: int, num_features: int, top_classes: int | None, memory_budget_mb: float | None
) -> None:
    """Refuse, before any sample, a neural collapse whose planned memory exceeds ``memory_budget_mb``.

    Raises:
        MemoryError: naming the memory planned, ``top_classes`` and ``memory_budget_mb``.
    """
    planned = neural_collapse_memory_mb(num_classes, num_features, top_classes)
    if memory_budget_mb is None or planned <= memory_budget_mb:
        return
    selected = num_classes if top_classes is None else min(top_classes, num_classes)
    pairs = _PAIR_BYTES * selected**2 / _MIB
    if neural_collapse_memory_mb(num_classes, num_features, 1) > memory_budget_mb:
        advice = "raise memory_budget_mb: the class sums alone exceed it"
    else:
        fits = 1
        while (
            2 * fits < selected and neural_collapse_memory_mb(num_classes, num_features, 2 * fits) <= memory_budget_mb
        ):
            fits *= 2
        planned_fits = neural_collapse_memory_mb(num_classes, num_features, fits)
        advice = (
            f"set top_classes to measure the K most frequent classes only (top_classes={fits} plans "
            f"{mib_text(planned_fits * _MIB)} MiB), or raise memory_budget_mb"
        )
    classes, features = count_of(num_classes, "class", "classes"), count_of(num_features, "feature")
    raise MemoryError(
        f"neural collapse of {classes} of {features} with top_classes={top_classes} plans {mib_text(planned * _MIB)} "
        f"MiB ({mib_text(pairs * _MIB)} MiB of it for the {selected} x {selected} class pairs of NC2 and the CDNV), "
        f"more than memory_budget_mb={memory_budget_mb:g}; {advice}"
    )


def _eps(dtype: torch.dtype) -> float:
    """``finfo(dtype).eps`` of a feature dtype; integer features count as float64 (exact)."""
    return torch.finfo(dtype if dtype.is_floating_point else torch.float64).eps


class NeuralCollapseStatistics(Metric):
    """Stream features, labels and the head's logits into the sums behind NC1-NC4 and the CDNV, exactly under DDP.

    NC4 compares the head with the nearest-class-centre rule, which needs the class means before the first sample is
    classified, and NC1 is computed best from residuals around the means (no moment difference at any offset; what is
    left is the rounding of the float64 means, warned of when it matters). So the metric takes two passes over the
    same samples (:func:`~rank_lightning.functional.neural_collapse_from_residuals`):

    1. :meth:`update` adds class counts and class sums (:func:`~rank_lightning.functional.row_moments`, float64);
    2. :meth:`start_second_pass` all-reduces them (every process must call it) and fixes the class means and the
       directions of their span; :meth:`update` then adds, per batch, ``sum_i (u_k^T (h_i - mu_{y_i}))^2`` along
       those directions (``C`` numbers), ``sum_{i in c} ||h_i - mu_c||^2`` per class, and, given logits, how many
       samples the head classifies as the nearest class mean does;
    3. :meth:`compute` all-reduces the second-pass sums and returns the
       :class:`~rank_lightning.functional.neural_collapse.NeuralCollapse`.

    The dtype of the features is recorded at :meth:`update` (the coarsest one seen in the first pass,
    :attr:`input_dtype`): NC1 drops the between-class directions at the rounding level of that precision
    (:func:`~rank_lightning.functional.neural_collapse.between_class_directions`), both when the second pass fixes
    the directions and in :meth:`compute`. Give the features in the dtype they were computed in.

    Every state is a ``"sum"`` state, so DDP processes holding different shares of the data give the numbers one
    process would give on all of it. The second pass must see the same samples as the first (a loader without random
    augmentation; the order may differ).

    Tokens as samples (the next-token classes of a language model, Wu & Papyan 2024): ``(B, T, D)`` features with
    ``(B, T)`` labels per token take every token as a row whose class is its label (the ``"token"`` reduction of
    :class:`~rank_lightning.metrics.ActivationSpectrum`); a position labelled -100 (no class: padding, the last
    position) or padded (``mask`` 0) is left out of every sum, as there. Logits are then ``(B, T, C)``.

    Vocabulary-sized class counts: the class sums stay ``C x d`` float64 (50,257 x 768: 294 MiB), but NC2's cosines
    and the CDNV's pairs take ``C x C`` (20 GB each for a vocabulary). ``top_classes=K`` computes the metrics of the
    ``K`` classes with the most samples in the first pass (all processes; ties to the smaller class index, see
    :func:`~rank_lightning.functional.neural_collapse.most_frequent_classes`), around the global mean of every sample
    (:func:`~rank_lightning.functional.neural_collapse.neural_collapse_from_residuals` with ``classes``); NC4 then
    compares the head's prediction among those classes with the nearest of their means. The constructor refuses a
    plan beyond ``memory_budget_mb`` (:func:`neural_collapse_memory_mb`) with a ``MemoryError`` naming both options.

    Args:
        num_classes: C; labels lie in ``[0, C)`` and logits have C columns.
        num_features: d, the width of the features.
        top_classes: compute the metrics of this many most frequent classes only; ``None`` for every class.
        memory_budget_mb: refuse (``MemoryError``) a plan beyond this many MiB; ``None`` for no limit.

    Attributes:
        head_weight: the head's ``(C, d)`` weight, set before :meth:`compute` for NC3 (``None``: NC3 is NaN); kept
            detached (the head's ``nn.Parameter`` may be given), and setting it forgets a computed result.
    """

    full_state_update = False

    def __init__(
        self,
        num_classes: int,
        num_features: int,
        *,
        top_classes: int | None = None,
        memory_budget_mb: float | None = 4096.0,
        **kwargs: object,
    ) -> None:
        super().__init__(**kwargs)
        check_positive_int("num_classes", num_classes)
        check_positive_int("num_features", num_features)
        check_positive_int("top_classes", top_classes, allow_none=True)
        check_positive("memory_budget_mb", memory_budget_mb, allow_none=True)
        check_neural_collapse_memory(num_classes, num_features, top_classes, memory_budget_mb)
        self.num_classes, self.num_features = num_classes, num_features
        self.top_classes, self.memory_budget_mb = top_classes, memory_budget_mb
        f64 = torch.float64
        self.add_state("class_counts", torch.zeros(num_classes, dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("class_sums", torch.zeros(num_classes, num_features, dtype=f64), dist_reduce_fx="sum")
        self.add_state("projected_scatter", torch.zeros(num_classes, dtype=f64), dist_reduce_fx="sum")
        self.add_state("class_scatter", torch.zeros(num_classes, dtype=f64), dist_reduce_fx="sum")
        self.add_state("agreements", torch.zeros((), dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("predicted_rows", torch.zeros((), dtype=torch.long), dist_reduce_fx="sum")
        # Of the predicted rows, those without a prediction to compare: NaN logits or non-finite features.
        self.add_state("undefined_predictions", torch.zeros((), dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("second_counts", torch.zeros(num_classes, dtype=torch.long), dist_reduce_fx="sum")
        # The largest eps of the first pass's feature dtypes (0: none seen): a state, so that it is saved, merged and
        # agreed across processes (the largest) with the sums it describes.
        self.add_state("input_eps", torch.zeros((), dtype=f64), dist_reduce_fx="max")
        # top_classes (0: every class), saved with the second-pass sums that are taken around the selected classes.
        self.add_state("class_selection", torch.tensor(top_classes or 0), dist_reduce_fx="max")
        self.head_weight: Tensor | None = None
        self._means: Tensor | None = None
        self._present: Tensor | None = None  # the classes of the metrics: present, and selected by top_classes
        self._selected: Tensor | None = None  # the classes top_classes selected (None: every class)
        # Each class's row among the means, for the second pass: -1 for a class not selected, -2 for one without a
        # sample in the first pass (a label of it in the second pass is an error).
        self._row_of: Tensor | None = None
        self._directions: Tensor | None = None
        self._totals: tuple[Tensor, Tensor] | None = None
        self._restored_second_pass = False  # load_state_dict brought second-pass sums: the means must be fixed again

    @override
    def __setattr__(self, name: str, value: Any) -> None:
        if name == "head_weight":
            # The head's own weight (a Parameter) is kept detached, not registered as a parameter of the metric (whose
            # module's state dict would gain a key that the model's checkpoints cannot load); a new head changes NC3,
            # so a result computed with the previous one is forgotten.
            if isinstance(value, Tensor):
                value = value.detach()
            if "_computed" in self.__dict__:
                self._computed = None
        super().__setattr__(name, value)

    @property
    def input_dtype(self) -> torch.dtype | None:
        """The coarsest dtype of the features given in the first pass (integers count as float64; ``None`` before
        any)."""
        eps = float(self.input_eps)
        return next((dtype for dtype in _FEATURE_DTYPES if _eps(dtype) == eps), None)

    @property
    def second_pass(self) -> bool:
        """Whether the means are fixed and :meth:`update` adds residuals."""
        return self._means is not None

    @property
    def between_class_rank(self) -> int | None:
        """The directions the centred class means span above rounding (``None`` before :meth:`start_second_pass`);
        ``0`` leaves NC1 and NC4 undefined (NaN)."""
        return None if self._directions is None else int(self._directions.shape[1])

    @property
    def selected_classes(self) -> list[int] | None:
        """The classes whose metrics :meth:`compute` gives (``None`` before :meth:`start_second_pass`): every class
        with a sample in the first pass, or the ``top_classes`` most frequent of them."""
        return None if self._present is None else self._present.tolist()

    @property
    def absent_classes(self) -> list[int] | None:
        """The classes without a sample in the first pass, summed over all processes (``None`` before
        :meth:`start_second_pass`): every metric leaves them out, and ``C`` counts the others."""
        if self._totals is None:
            return None
        return (self._totals[0] == 0).nonzero().squeeze(1).tolist()

    def update(
        self, features: Tensor, labels: Tensor, logits: Tensor | None = None, *, mask: Tensor | None = None
    ) -> None:
        """Add a batch: ``(B, d)`` features, ``(B,)`` labels in ``[0, C)``, optionally ``(B, C)`` logits (NC4); or
        ``(B, T, D)`` token features, ``(B, T)`` labels per token in ``[0, C)`` or -100, ``(B, T, C)`` logits and the
        ``(B, T)`` attention ``mask`` (true / 1 at real tokens; ignored for ``(B, d)`` features).

        The labels may also come in the other forms every class-aware part takes
        (:data:`~rank_lightning.layers.LABEL_FORMS`: a ``(B, 1)`` column, booleans, one-hot rows), and on another
        device than the features.

        Raises:
            TypeError: features or logits that are not tensors.
            ValueError: shapes that do not match, labels out of range or of no form taken, or complex features or
                logits.
        """
        check_real("features", features)
        if logits is not None:
            check_real("logits", logits)
        features, labels, logits, counted, odd_mask = self._token_rows(features, labels, logits, mask)
        labels = self._check(features, labels, logits, counted, odd_mask)
        if self._restored_second_pass and not self.second_pass:
            raise RuntimeError(
                "the loaded state was saved during the second pass; call start_second_pass() (a collective) again "
                "before streaming the rest of it"
            )
        if not self.second_pass:
            self.input_eps = self.input_eps.clamp_min(_eps(features.dtype))
            x = features.detach().to(torch.float64)
            moments = row_moments(x, labels, num_classes=self.num_classes, row_mask=counted)
            self.class_counts += moments.class_counts
            self.class_sums += moments.class_sums
            return
        self._add_residuals(features, labels, logits, counted)

    def _add_residuals(self, features: Tensor, labels: Tensor, logits: Tensor | None, counted: Tensor | None) -> None:
        """The second pass's sums of a batch; rows of classes not selected, and rows not ``counted``, add nothing."""
        means, present = self._means, self._present
        args = (features, labels, means, present, self._directions, self.num_classes)
        projected, scatter = residual_moments(*args, check=False, row_mask=counted)
        self.projected_scatter[: projected.shape[0]] += projected
        self.class_scatter += scatter
        # bincount would read its largest label back
        self.second_counts += class_counts(labels, self.num_classes, row_mask=counted)
        if logits is None:
            return
        nearest = present[nearest_class_centre(features, means)]
        scores = logits.detach()
        if self._selected is None:
            predicted = scores.argmax(dim=1)
        else:  # the head's prediction among the selected classes
            scores = scores[:, present.to(scores.device)]
            predicted = present[scores.argmax(dim=1).to(nearest.device)]
        measured = self._row_of.to(labels.device)[labels] >= 0
        if counted is not None:
            measured &= counted
        # A NaN score has no argmax (argmax takes the NaN), non-finite features no nearest mean: counted apart, they
        # make NC4 NaN rather than agreements or disagreements.
        defined = ~scores.isnan().any(dim=1).to(labels.device) & torch.isfinite(features).all(dim=1).to(labels.device)
        self.agreements += ((nearest == predicted.to(nearest.device)) & (measured & defined).to(nearest.device)).sum()
        self.predicted_rows += measured.sum()
        self.undefined_predictions += (measured & ~defined).sum()

    def _token_rows(
        self, features: Tensor, labels: Tensor, logits: Tensor | None, mask: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None, tuple[Tensor, torch.dtype] | None]:
        """``(B, d)`` batches as they are (no row mask); ``(B, T, D)`` tokens as ``(B*T, D)`` rows, their labels
        (0 where -100), ``(B*T, C)`` logits and which rows count (real tokens with a class, as
        :func:`~rank_lightning.functional.streaming.counted_tokens` counts them). A ``(B, T)`` mask of 0 / 1 numbers
        also gives whether it holds other values and its dtype, a device flag that :meth:`_check` reads with the label
        range (one read per batch)."""
        if features.ndim != 3:
            return features, labels, logits, None, None
        check_real("features", features)
        shape = tuple(features.shape)
        if labels.ndim != 2 or tuple(labels.shape) != shape[:2]:
            raise ValueError(
                f"token features {shape} (each token a row) need labels per token of shape (B, T) = {shape[:2]}, "
                f"got {tuple(labels.shape)}"
            )
        if logits is not None and tuple(logits.shape) != (*shape[:2], self.num_classes):
            expected = (*shape[:2], self.num_classes)
            raise ValueError(f"logits of token features must be {expected}, got {tuple(logits.shape)}")
        if labels.dtype.is_floating_point or labels.dtype == torch.bool or labels.is_complex():
            raise ValueError(f"labels per token must be integer class indices, got dtype {labels.dtype}")
        labels = labels.long().to(features.device)
        labelled = labels != IGNORE_INDEX
        odd_mask = None
        if mask is None:
            counted = labelled
        elif isinstance(mask, Tensor) and mask.dtype != torch.bool and tuple(mask.shape) == shape[:2]:
            # Whether it holds other values than 0 and 1 is read with the label range, not on its own.
            odd_mask = (((mask != 0) & (mask != 1)).any(), mask.dtype)
            counted = (mask != 0).to(features.device) & labelled
        else:
            counted = check_token_mask(mask, features) & labelled
        rows = features.reshape(-1, shape[2])
        flat_logits = None if logits is None else logits.reshape(-1, self.num_classes)
        return rows, labels.masked_fill(~labelled, 0).reshape(-1), flat_logits, counted.reshape(-1), odd_mask

    def forward(  # type: ignore[override]
        self, features: Tensor, labels: Tensor, logits: Tensor | None = None, *, mask: Tensor | None = None
    ) -> None:
        """The same as :meth:`update` (``metric(features, labels)`` streams a batch); returns ``None``.

        A two-pass metric has no value of one batch: torchmetrics' ``forward`` would reset the states to compute one,
        losing the sums streamed so far, and fail for want of the second pass.
        """
        self.update(features, labels, logits, mask=mask)

    def _check(
        self,
        features: Tensor,
        labels: Tensor,
        logits: Tensor | None,
        counted: Tensor | None,
        odd_mask: tuple[Tensor, torch.dtype] | None = None,
    ) -> Tensor:
        """The labels as ``(B,)`` int64 on the features' device, once the batch is checked (with a token batch's
        mask, ``odd_mask`` of :meth:`_token_rows`)."""
        check_real("features", features)
        if logits is not None:
            check_real("logits", logits)
        if features.ndim != 2 or features.shape[1] != self.num_features:
            raise ValueError(f"features must be (B, {self.num_features}), got {tuple(features.shape)}")
        # The forms every class-aware part takes: a (B, 1) column, booleans, one-hot rows as their argmax.
        labels = class_labels(labels, features.shape[0]).to(features.device)
        if labels.numel():
            # The label range, whether a token mask holds other values than 0 and 1 and, in the second pass,
            # whether a label's class has a mean: one read from a GPU.
            reads = [labels.min(), labels.max(), labels.new_zeros(()) if odd_mask is None else odd_mask[0].to(labels)]
            if self.second_pass:
                missing = self._row_of.to(labels.device)[labels.clamp(0, self.num_classes - 1)] == -2
                if counted is not None:
                    missing &= counted.to(labels.device)
                reads.append(missing.any().to(labels.dtype))
            low, high, odd, *missing_any = torch.stack(reads).tolist()
            if odd and odd_mask is not None:
                raise ValueError(
                    f"attention mask of dtype {odd_mask[1]} holds values other than 0 and 1; expected true / 1 at the "
                    "real tokens and false / 0 at padding"
                )
            if low < 0 or high >= self.num_classes:
                tokens = (
                    f"; per-token labels may also be {IGNORE_INDEX} (a token without a class)"
                    if counted is not None
                    else ""
                )
                raise ValueError(f"labels must lie in [0, {self.num_classes}), got {low}..{high}{tokens}")
            if any(missing_any):
                absent = sorted(set(labels[missing].tolist()))
                raise ValueError(f"labels {absent} belong to classes that had no sample when the means were computed")
        if logits is not None and logits.shape != (features.shape[0], self.num_classes):
            raise ValueError(f"logits must be ({features.shape[0]}, {self.num_classes}), got {tuple(logits.shape)}")
        return labels

    def start_second_pass(self) -> None:
        """All-reduce the class sums and fix the means; a collective: every process calls it.

        With ``sync_on_compute=False`` nothing is all-reduced: the means are those of this process's samples, as
        :meth:`compute` then gives the metrics of this process's samples (not a collective then).
        """
        # The context all-reduces the states and restores this process's own share afterwards, so that compute's
        # all-reduce still counts every share once.
        with self.sync_context(dist_sync_fn=self.dist_sync_fn, should_sync=self.sync_on_compute):
            self._totals = (self.class_counts.clone(), self.class_sums.clone())
            dtype = self.input_dtype  # of every process's features, as compute() will take it
        self._restored_second_pass = False
        self._selected = None if self.top_classes is None else most_frequent_classes(self._totals[0], self.top_classes)
        self._present, self._means, global_mean = class_means(*self._totals, classes=self._selected)
        self._row_of = class_rows(self._present, self.num_classes).masked_fill(self._totals[0] == 0, -2)
        counts = self._totals[0][self._present]
        basis = between_class_directions(self._means, global_mean, dtype=dtype, counts=counts)
        self._directions = basis.directions

    @override
    def merge_state(self, incoming_state: dict[str, Any] | Metric) -> None:
        """Add the sums of another :class:`NeuralCollapseStatistics` (or its ``metric_state``) to these, pass by pass.

        First-pass sums merge before :meth:`start_second_pass`, which then fixes the means of all of them; second-pass
        sums merge only into a metric whose class means are the incoming metric's.

        Raises:
            ValueError: sums of a metric with another ``top_classes`` (its selection and second pass are of other
                classes), first-pass sums into a metric whose means are fixed (they would be left out), second-pass
                sums into a metric in its first pass, or a second pass around other class means.
        """
        incoming = incoming_state if isinstance(incoming_state, NeuralCollapseStatistics) else None
        state = incoming.metric_state if incoming is not None else incoming_state
        selection = state.get("class_selection") if isinstance(state, dict) else None
        if isinstance(selection, Tensor) and int(selection) != (self.top_classes or 0):
            raise ValueError(
                f"cannot merge a NeuralCollapseStatistics with top_classes={int(selection) or None}: this one has "
                f"top_classes={self.top_classes}; merge metrics made with the same top_classes"
            )
        if isinstance(state, dict) and {"class_counts", "second_counts"} <= set(state):
            second = incoming.second_pass if incoming is not None else bool(state["second_counts"].sum())
            advice = "merge the first passes, call start_second_pass() on the merged metric, then stream the second"
            if not self.second_pass and second:
                raise ValueError(f"cannot merge second-pass sums into a metric in its first pass; {advice} pass")
            if self.second_pass and not second and bool(state["class_counts"].sum()):
                raise ValueError(f"cannot merge first-pass sums into a metric whose means are fixed; {advice} pass")
            if self.second_pass and incoming is not None and second and not self._same_means(incoming):
                raise ValueError(f"cannot merge a second pass around other class means; {advice} pass into it")
        super().merge_state(incoming_state)

    def _same_means(self, other: NeuralCollapseStatistics) -> bool:
        mine, theirs = (self._present, self._means, self._directions), (other._present, other._means, other._directions)
        return all(a.shape == b.shape and torch.equal(a, b.to(a.device)) for a, b in zip(mine, theirs))

    def compute(self) -> NeuralCollapse:
        """The metrics from both passes (NC4 NaN if no logits were given in the second pass).

        NaN, with a warning: every metric when no sample was streamed; the metrics that features holding NaN or Inf
        reach (every metric in the first pass, whose class means they enter; NC1, the CDNV and NC4 in the second);
        NC4 when logits hold NaN, or came with some of the second pass's batches only.

        Raises:
            RuntimeError: :meth:`start_second_pass` was not called, or the two passes saw different class counts
                (a loader that changed between them).
        """
        if self._totals is None:
            raise RuntimeError("NeuralCollapseStatistics.compute needs two passes: call start_second_pass() first")
        counts, sums = self._totals
        if not torch.equal(self.second_counts.to(counts.device), counts):
            more = int(self.second_counts.sum()) > int(counts.sum())
            hint = (
                "; a new measurement starts with reset() (the first pass's batches of a metric whose means are fixed "
                "add to the second)"
                if more
                else ""
            )
            raise RuntimeError(
                f"the two passes saw different samples: class counts {counts.tolist()} in the first, "
                f"{self.second_counts.tolist()} in the second; both must read the same data{hint}"
            )
        measured = int(counts[self._present.to(counts.device)].sum())
        defined = self._warn_undefined(sums, measured)
        agreements = self.agreements if defined and int(self.predicted_rows) == measured else None
        return neural_collapse_from_residuals(
            counts,
            sums,
            self.projected_scatter,
            self.class_scatter,
            head_weight=self.head_weight,
            agreements=agreements,
            dtype=self.input_dtype,
            classes=self._selected,
        )

    def _warn_undefined(self, sums: Tensor, measured: int) -> bool:
        """Warn of features or logits that held NaN or Inf (the metrics they reach are NaN), and of logits given for
        some samples only (NC4 NaN); whether NC4 is defined."""
        second = (self.class_scatter, self.projected_scatter)
        undefined, predicted = int(self.undefined_predictions), int(self.predicted_rows)
        if measured == 0:
            problem = "no sample was streamed; every metric is NaN"
        elif not bool(torch.isfinite(sums).all()):
            problem = "the features held NaN or Inf in the first pass; every metric is NaN"
        elif not all(bool(torch.isfinite(part).all()) for part in second):
            problem = "the features held NaN or Inf in the second pass; nc1, cdnv and nc4 are NaN"
        elif undefined:
            problem = f"the logits of {undefined} of {measured} samples held NaN (no argmax); nc4 is NaN"
        elif 0 < predicted < measured:
            problem = (
                f"logits came with {predicted} of the {measured} samples of the second pass; nc4 (the head's "
                "prediction of every sample against the nearest class mean) is NaN: give logits with every batch"
            )
        else:
            return True
        warnings.warn(f"NeuralCollapseStatistics: {problem}", RuntimeWarning, stacklevel=4)  # the caller of compute()
        return False

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        """Load the states; the class means of a state saved in the second pass are fixed again by
        :meth:`start_second_pass`, which :meth:`update` then requires."""
        loaded = prefix + "second_counts" in state_dict  # non-persistent states are not in it: nothing changes
        sums = state_dict.get(prefix + "class_sums")
        if loaded and sums is not None and tuple(sums.shape) != (self.num_classes, self.num_features):
            # torchmetrics sets the states as they come: sums of another shape failed, if at all, batches later.
            c, d = sums.shape
            message = f"the saved NeuralCollapseStatistics has num_classes={c}, num_features={d}; this one has "
            error_msgs.append(f"{message}num_classes={self.num_classes}, num_features={self.num_features}")
            return
        own = torch.tensor(self.top_classes or 0)
        saved = state_dict.get(prefix + "class_selection", torch.zeros((), dtype=torch.long))  # before: every class
        second = state_dict.get(prefix + "second_counts")
        if loaded and int(saved) != int(own) and second is not None and bool(second.sum()):
            # Second-pass sums are taken around the means of the classes selected then; the first pass's are not.
            was, now = int(saved) or None, self.top_classes
            error_msgs.append(
                f"the saved NeuralCollapseStatistics was in its second pass with top_classes={was}; this one has "
                f"top_classes={now}, whose second pass would be around the means of other classes"
            )
            return
        if loaded:
            state_dict[prefix + "class_selection"] = own
        if loaded and prefix + "input_eps" not in state_dict:
            # Saved before the dtype was a state: not known, as for a metric that saw no batch.
            state_dict[prefix + "input_eps"] = torch.zeros((), dtype=torch.float64)
        if loaded and prefix + "undefined_predictions" not in state_dict:
            # Saved before NaN logits were counted apart.
            state_dict[prefix + "undefined_predictions"] = torch.zeros((), dtype=torch.long)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        if not loaded:
            return
        self._computed = None  # of the sums before the load
        self._means = self._present = self._selected = self._row_of = self._directions = self._totals = None
        self._restored_second_pass = bool(self.second_counts.sum())

    @override
    def set_dtype(self, dst_type: str | torch.dtype) -> NeuralCollapseStatistics:
        """Keep the float64 states: the sums are float64 whatever the precision of the model or the features (float16
        class sums keep 3 digits and overflow at 65,504). Returns the metric."""
        return self

    @override
    def _apply(self, fn: Any, exclude_state: Sequence[str] = "") -> NeuralCollapseStatistics:
        """Device moves only (``metric.to(torch.float16)`` would round the float64 sums), applied also to the class
        means and directions that :meth:`start_second_pass` fixed, which the second pass's batches meet."""
        move = device_move_only(fn)
        super()._apply(move, exclude_state)
        for name in ("_means", "_present", "_selected", "_row_of", "_directions"):
            if getattr(self, name) is not None:
                setattr(self, name, move(getattr(self, name)))
        if self._totals is not None:
            self._totals = (move(self._totals[0]), move(self._totals[1]))
        return self

    def reset(self) -> None:
        """Clear both passes."""
        super().reset()
        self._restored_second_pass = False
        self._means = self._present = self._selected = self._row_of = self._directions = self._totals = None
