"""Streaming spectra of layer activations: float64 sums in, every spectral rank metric out."""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor
from torchmetrics import Metric
from torchmetrics.utilities.data import dim_zero_cat
from torchmetrics.utilities.distributed import gather_all_tensors
from typing_extensions import override

from rank_lightning.functional.reductions import (
    REDUCTIONS,
    check_token_mask,
    masked_token_rows,
    reduce_activations,
    token_rows_per_sample,
    warn_cls_left_padding,
)
from rank_lightning.functional.spectral import (
    SPECTRAL_METRICS,
    SpectralSummary,
    Spectrum,
    check_alpha_req_range,
    default_rank_tolerance,
    moment_difference_error,
    serial_if_small,
    spectrum_from_gram,
    summarize,
    total_cluster_variation_from_moments,
    warn_moment_rounding,
)
from rank_lightning.functional.streaming import (
    GRAM_PRECISIONS,
    UPDATE_CHUNK_BYTES,
    BatchMoments,
    ClassGrouping,
    Subsample,
    channel_block_values,
    channel_gram_moments,
    class_counts,
    classwise_variance_ratio_from_grams,
    classwise_variance_ratio_from_sample,
    counted_tokens,
    group_by_class,
    group_token_labels,
    merge_subsamples,
    move_reference,
    reference_point,
    resolve_gram_precision,
    row_moments,
    row_temporary_values,
    rows_per_chunk,
    sketch_draws,
    sketch_spectrum,
    subsample_spectrum,
    subsample_update,
    symmetrize_lower,
)
from rank_lightning.layers import class_labels
from rank_lightning.validation import (
    check_bool,
    check_choice,
    check_choices,
    check_int,
    check_positive,
    check_positive_int,
    check_positive_ints,
    check_real,
    check_tolerance_dtype,
    count_of,
    mib_text,
)

__all__ = [
    "ACTIVATION_METRICS",
    "SPECTRUM_ROWS_KEY",
    "ActivationSpectrum",
    "ActivationSpectrumResult",
    "SpectralSummary",
]

ACTIVATION_METRICS: tuple[str, ...] = (
    *SPECTRAL_METRICS[:6],
    "alpha_req",
    "tcv",
    "tcv_normalized",
    "classwise_variance_ratio",
)
"""Metric families of :meth:`ActivationSpectrumResult.scalars`: the spectral ones of
:class:`~rank_lightning.functional.spectral.SpectralSummary` (alpha-ReQ, the power-law decay of the eigenspectrum,
Agrawal et al. 2022, last among them), then the total cluster variation (plain and normalised) and the class-wise
variance ratio."""

DEFAULT_ACTIVATION_METRICS: tuple[str, ...] = tuple(m for m in ACTIVATION_METRICS if m != "alpha_req")
"""What the activation monitors log unless told otherwise: every family but ``alpha_req`` (asked for by name)."""

PATHS = ("gram", "sample_gram", "sketch")
FALLBACKS = ("sample_gram", "sketch")
_CENTER_CHOICES = (False, True, "both")
_SPECTRAL_FAMILIES = tuple(m for m in ACTIVATION_METRICS if m in SPECTRAL_METRICS)
_CLUSTER_FAMILIES = tuple(m for m in ACTIVATION_METRICS if m not in SPECTRAL_METRICS)
_FLOAT64_BYTES = 8
_EPS64 = float(torch.finfo(torch.float64).eps)
# Entries below this (3e-151) have float64 products below 2^-1000, near the subnormal range (from 2^-1022) where the
# Gram loses digits.
_SMALLEST_ENTRY = 2.0**-500
# Class Grams are turned into class-wise variance ratios this many float64 values (32 MiB) at a time.
_CLASS_GRAM_CHUNK_VALUES = 2**22
SPECTRUM_ROWS_KEY = "spectrum_rows"
"""The key :meth:`ActivationSpectrumResult.scalars` adds to every spectral selection: the rows behind the spectrum."""


class ActivationSpectrumResult:
    """What :meth:`ActivationSpectrum.compute` returns.

    A plain class rather than a dataclass: torchmetrics maps ``clone`` and device moves over dataclasses in a metric's
    output, which the frozen :class:`Spectrum` inside does not allow.

    Attributes:
        uncentered: metrics of ``X`` (``None`` if only the centred variant was requested).
        centered: metrics of ``X - 1 mu^T`` (``None`` unless requested).
        total_cluster_variation: ``sum_c sum_{i in c} ||x_i - mu_c||^2`` over all streamed rows (Zangrando et al.
            Def. 3.2); ``None`` without ``num_classes``.
        total_cluster_variation_normalized: the same divided by ``sum_i ||x_i - mu||^2``; ``None`` without classes.
        classwise_variance_ratio: ``(num_classes,)`` tensor of ``VR_k`` per class (Sanyal et al. Sec. 4.3), NaN for a
            class without samples; ``None`` when unavailable (see ``classwise_source``).
        classwise_k: the ``k`` of ``classwise_variance_ratio``.
        classwise_source: ``"class_gram"`` (exact, per-class Grams), ``"sample"`` (from the subsample of the
            ``sample_gram`` path; NaN for a class of which it kept too few rows to tell, see the class), or ``None``
            (no classes, no labelled rows, disabled, or the per-class Grams exceed the memory budget).
        path: how the spectra were obtained: ``"gram"`` (exact d x d Gram), ``"sample_gram"`` (sample Gram of a
            uniform subsample, exact when every row fitted), or ``"sketch"`` (CountSketch of the rows).
        num_samples: rows streamed (after the reduction).
        num_features: d.
        num_spectrum_samples: rows the spectra describe: ``num_samples`` for ``gram`` and ``sketch``, the subsample
            size for ``sample_gram``.
        spectrum_rows: rows actually behind the spectra: ``num_samples`` for ``gram``, the subsample size for
            ``sample_gram``, the occupied buckets of the sketch for ``sketch`` (logged as ``spectrum_rows``).
        rank_cap: the largest rank the spectra can show, ``min(spectrum_rows, num_features)``: below ``num_features``
            every rank metric (numerical, soft, effective rank, participation ratio, ...) is capped by the rows, not
            by the layer (fewer rows than features, a subsample, or a sketch).
        num_nonfinite_batches: batches that held NaN or Inf; when positive, every metric is NaN.
        class_counts: ``(num_classes,)`` int64 rows per class over every process; ``None`` without ``num_classes``.
    """

    def __init__(
        self,
        *,
        uncentered: SpectralSummary | None,
        centered: SpectralSummary | None,
        total_cluster_variation: Tensor | None,
        total_cluster_variation_normalized: Tensor | None,
        classwise_variance_ratio: Tensor | None,
        classwise_k: int,
        classwise_source: str | None,
        path: str,
        num_samples: int,
        num_features: int,
        num_spectrum_samples: int,
        num_nonfinite_batches: int,
        class_counts: Tensor | None = None,
        spectrum_rows: int | None = None,
    ) -> None:
        self.uncentered = uncentered
        self.centered = centered
        self.total_cluster_variation = total_cluster_variation
        self.total_cluster_variation_normalized = total_cluster_variation_normalized
        self.classwise_variance_ratio = classwise_variance_ratio
        self.classwise_k = classwise_k
        self.classwise_source = classwise_source
        self.path = path
        self.num_samples = num_samples
        self.num_features = num_features
        self.num_spectrum_samples = num_spectrum_samples
        self.spectrum_rows = num_spectrum_samples if spectrum_rows is None else spectrum_rows
        self.rank_cap = min(self.spectrum_rows, num_features)
        self.num_nonfinite_batches = num_nonfinite_batches
        self.class_counts = class_counts

    def scalars(
        self,
        metrics: Sequence[str] = DEFAULT_ACTIVATION_METRICS,
        *,
        centered: bool | None = None,
        per_class: bool = False,
    ) -> dict[str, float]:
        """The scalars of the metric families ``metrics``, in that order, as Python floats; only those computed.

        Keys: the spectral families as :meth:`SpectralSummary.as_dict` names them (``numerical_rank``, ...,
        ``variance_ratio_<k>``), ``tcv``, ``tcv_normalized``, ``classwise_variance_ratio_<k>_mean`` (mean over the
        classes that have a value; NaN if none has) and, with ``per_class``, ``classwise_variance_ratio_<k>_class_<c>``.
        Whenever a spectral family is given, ``spectrum_rows`` (:data:`SPECTRUM_ROWS_KEY`, last) is the number of
        rows behind the spectrum, so that a logged rank carries its cap ``min(spectrum_rows, num_features)``.

        Args:
            metrics: families from :data:`ACTIVATION_METRICS` (a single name counts as one).
            centered: take the spectral families from the centred spectrum (``True``) or the uncentred one
                (``False``: none where it was not computed); ``None``, the default, from the uncentred one where it
                was computed, else from the centred one (a metric made with ``center=True``).
            per_class: also give the class-wise variance ratio of every class.

        Raises:
            ValueError: an unknown or repeated family; the message lists the valid ones.
        """
        if centered is None:
            centered = self.uncentered is None and self.centered is not None
        summary = self.centered if centered else self.uncentered
        cluster = {"tcv": self.total_cluster_variation, "tcv_normalized": self.total_cluster_variation_normalized}
        out: dict[str, float] = {}
        chosen = check_choices("metrics", metrics, ACTIVATION_METRICS)
        for metric in chosen:
            if metric in SPECTRAL_METRICS:
                out.update(summary.as_dict((metric,)) if summary is not None else {})
            elif metric == "classwise_variance_ratio":
                out.update(self._classwise_scalars(per_class))
            elif cluster[metric] is not None:
                out[metric] = float(cluster[metric])
        if summary is not None and any(metric in SPECTRAL_METRICS for metric in chosen):
            out[SPECTRUM_ROWS_KEY] = float(self.spectrum_rows)
        return out

    def _classwise_scalars(self, per_class: bool) -> dict[str, float]:
        ratios = self.classwise_variance_ratio
        if ratios is None:
            return {}
        key = f"classwise_variance_ratio_{self.classwise_k}"
        present = ratios[~ratios.isnan()]
        out = {f"{key}_mean": float(present.mean()) if present.numel() else math.nan}
        if per_class:
            out.update({f"{key}_class_{c}": float(v) for c, v in enumerate(ratios)})
        return out

    def as_dict(self) -> dict[str, float]:
        """Every scalar that was computed, keyed as :meth:`scalars` keys them.

        The spectral families of the uncentred spectrum, those of the centred one with a ``centered_`` prefix, then
        ``spectrum_rows``, ``tcv``, ``tcv_normalized`` and the class-wise variance ratio (mean and every class).
        """
        out = self.scalars(_SPECTRAL_FAMILIES, centered=False)
        centred = self.scalars(_SPECTRAL_FAMILIES, centered=True)
        out.update({f"centered_{k}": v for k, v in centred.items() if k != SPECTRUM_ROWS_KEY})
        if SPECTRUM_ROWS_KEY in centred:
            out[SPECTRUM_ROWS_KEY] = centred[SPECTRUM_ROWS_KEY]
        out.update(self.scalars(_CLUSTER_FAMILIES, per_class=True))
        return out

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(path={self.path!r}, num_samples={self.num_samples}, "
            f"num_features={self.num_features}, spectrum_rows={self.spectrum_rows}, rank_cap={self.rank_cap}, "
            f"num_nonfinite_batches={self.num_nonfinite_batches}, "
            f"scalars={self.as_dict()})"
        )


class _Estimate(NamedTuple):
    """What one path of :meth:`ActivationSpectrum.compute` estimates from the synced states."""

    spectra: dict[bool, Spectrum]
    num_spectrum_samples: int
    classwise: Tensor | None = None
    classwise_source: str | None = None
    spectrum_rows: int | None = None


class ActivationSpectrum(Metric):
    """Stream layer activations into float64 sums; compute every spectral rank metric from one eigendecomposition.

    Each :meth:`update` reduces the raw layer output to an ``(N, d)`` matrix (see
    :func:`~rank_lightning.functional.reduce_activations`) and adds its rows, through the estimators of
    :mod:`rank_lightning.functional.streaming`, to sums declared with ``"sum"`` reduction:
    the sample count, ``sum ||x||^2``, the feature sum ``X^T 1``, and, on the default path, the Gram ``X^T X``. Sums
    add across batches and DDP ranks, so the result is exact for any N at O(d^2) memory and DDP sync is one all-reduce.

    The Gram states hold their lower triangle (the products skip the blocks above the diagonal;
    :func:`~rank_lightning.functional.streaming.symmetrize_lower` gives the full matrices). The sums are taken
    around a reference point ``r``, the mean of the first batch (rounded to float32): sums of
    ``x - r``, Gram ``(X - 1 r^T)^T (X - 1 r^T)``. The centred spectrum and the total cluster variation are translation
    invariant and come from the shifted sums without the cancellation that sums of ``x`` suffer when the activations
    sit far from the origin compared with their spread (at an offset of ``1e6`` and a spread of ``0.1`` the plain
    moments lose every digit); the uncentred spectrum moves the sums back to the origin with exact formulas
    (:func:`~rank_lightning.functional.streaming.move_reference`). What the shift cannot remove is the rounding of
    sums far from the point itself, about ``eps64 * sum ||x - r||^2``: :meth:`compute` warns where it exceeds the
    Gram's own resolution (a first batch far from the later ones) or ``1e-6`` of the total cluster variation (classes
    far tighter than their distance from ``r``). Under DDP each process has its own reference; at
    the sync every process moves its sums to the reference of the lowest-ranked process that saw rows before the
    sums are added, so one process and N processes agree to rounding.
    With ``num_classes``, per-class counts and sums give the total cluster variation exactly, and per-class Grams
    (C x d x d) give the class-wise variance ratio when they fit in ``memory_budget_mb``; labelled rows then go into
    their class Gram only, and :meth:`compute` adds the class Grams up, so the O(N d^2) work is not done twice. When
    they do not fit (1,000 classes of 512 features need 2,000 MiB), :meth:`compute` warns that the class-wise variance
    ratio is not computed; the total cluster variation, from the class sums, is exact on every path.

    Labels per token: with ``reduction="token"``, ``(B, T)`` labels give every token row its own class, as in the
    "linguistic collapse" of causal language models (Wu & Papyan 2024), where each token position is a sample whose
    class is its next token. A position labelled -100 (Hugging Face's ignore index: padding, prompt tokens, the last
    position, which has no next token) is left out like a padded one, from the spectrum as well as from the class
    statistics, so that every metric describes the same rows: the real tokens (``mask``) that have a class. The labels
    are taken as given: the ``labels`` of a Hugging Face causal LM equal its ``input_ids`` (the model shifts them
    inside its loss) and must be shifted first,
    ``torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], 1)``. A vocabulary as classes takes ``V x d``
    class sums on every path (50,257 x 768 float64: 294 MiB); its class Grams (``V x d x d``, 221 GiB) do not fit, so
    the class-wise variance ratio is then not computed (warned at :meth:`compute`), while the total cluster variation
    stays exact.

    When ``d > max_gram_features`` (or the d x d Gram exceeds the budget) the metric falls back to:

    * ``"sample_gram"`` (default): a uniform subsample of at most ``max_samples`` rows (bottom-k random keys, which
      merge exactly across ranks), decomposed through its N x N sample Gram. Exact while every row fits; otherwise an
      estimate from the subsample, whose spectrum describes ``num_spectrum_samples`` rows. Class-wise variance ratios
      come from the subsampled rows of each class; a class of which the subsample kept ``classwise_k`` rows or fewer
      (one more with ``classwise_center``) of more streamed is NaN, with a warning naming it (so few rows give
      ``VR_k = 1`` whatever the data).
    * ``"sketch"``: a CountSketch ``Y = S X`` with ``max_samples`` rows (each row added with a random sign to a random
      bucket; ``E[Y^T Y] = X^T X``), a sum state like the Gram. Leading singular values are estimated well; the
      tail and the numerical rank are capped by the sketch size. No class-wise variance ratio.

    Non-finite activations never raise: batches holding NaN or Inf are counted, and :meth:`compute` then warns and
    returns NaN for every metric. Labels are ignored when ``num_classes`` is ``None``.

    Every rank is capped by the rows behind the spectrum: the result's ``spectrum_rows`` and ``rank_cap``
    (``min(spectrum_rows, num_features)``) say by how much; ``spectrum_rows`` is logged with the spectral scalars.

    Args:
        num_classes: number of classes of the labels passed to :meth:`update`; enables the total cluster variation
            and the class-wise variance ratio.
        reduction: how conv ``(B, C, H, W)`` / ``(B, C, D1, D2, D3)`` and token ``(B, T, D)`` activations become a
            matrix; one of ``"flatten"``, ``"channel"``, ``"token"``, ``"cls"``, ``"mean"``, ``"last"`` (each
            sequence's last real token: a decoder-only model's sequence embedding). With ``"channel"`` and
            ``"token"`` every position inherits its input's label; with ``"token"``, ``(B, T)`` labels give each token
            its own.
        center: ``False`` (the papers' convention), ``True`` (PCA convention), or ``"both"`` (one extra
            eigendecomposition from the same sums).
        variance_ratio_ks: the ``k`` of the reported ``VR_k`` scalars.
        soft_rank_tau: threshold of the soft rank.
        rank_tolerance: relative tolerance of the numerical rank; ``None`` uses the default of ``tolerance_dtype``
            (:func:`~rank_lightning.functional.default_rank_tolerance`: ``finfo(float32).eps * K``, for bfloat16 and
            float16 their ``eps``).
        tolerance_size: ``K`` of the default tolerance, ``"min"`` (Feng) or ``"max"`` (NumPy) of ``(N, d)``.
        tolerance_dtype: the dtype whose epsilon the default tolerance uses: ``None`` for float32 (Feng et al.'s
            convention, whatever the activations' precision), ``"input"`` for the lowest-precision floating dtype the
            activations arrived in since the last reset (bf16 activations give ``finfo(bfloat16).eps``, so that
            their rounding noise is not counted as rank; recorded as a state, the largest epsilon over DDP
            processes), or a floating ``torch.dtype`` (or its name, ``"bfloat16"``). Exclusive with
            ``rank_tolerance``.
        classwise: compute the class-wise variance ratio (needs ``num_classes``).
        classwise_k: the ``k`` of the class-wise ``VR_k`` (Sanyal et al. plot ``VR_1``).
        classwise_center: subtract each class's mean first (Sanyal et al. do not).
        max_gram_features: largest d for the exact d x d Gram; bounds the eigendecomposition size (an eigh of
            4096 x 4096 takes seconds on a CPU, of 16,384 x 16,384 minutes).
        max_samples: rows kept by the fallback (subsample or sketch size); ``None`` picks the largest count whose
            rows and sample Gram fit in the budget, at most ``max_gram_features``.
        fallback: ``"sample_gram"`` or ``"sketch"``, used when d is too large for the Gram.
        memory_budget_mb: memory the states may use (Grams, per-class Grams, subsample), in MiB.
        num_features: d, if known; allocates the states at construction (otherwise at the first update). Not needed
            for DDP: a process that never sees a batch takes d from the others at the sync.
        seed: seed of the subsample keys and sketch buckets (offset by the DDP rank).
        gram_precision: how each batch's Gram product is computed, the running sums being float64 in every case:
            ``"float64"`` (exact); ``"float32"`` (the shifted rows multiplied in IEEE float32, whatever
            ``torch.set_float32_matmul_precision`` says for the model: about ``1e-7`` relative
            error per batch Gram; the metrics of ``s^2``, participation ratio, stable rank, ``VR_k``, stay within
            ``1e-5`` relative of float64 and the effective rank within ``1e-4``, but singular values below about
            ``sqrt(eps_32) s_1 = 3e-4 s_1`` are rounding noise, so on rank-deficient activations the numerical rank
            at the default tolerance counts them); ``"tf32"`` (float32 with TF32 tensor-core products on CUDA, about
            ``1e-3`` relative per product, a few ``1e-6`` on the metrics; the global TF32 setting is restored after
            each product) or ``"auto"`` (per device,
            :data:`~rank_lightning.functional.streaming.AUTO_GRAM_PRECISION`). Applies to the Gram, the class Grams
            and the conv-map Grams.
        alpha_req_range: ``(first_index, last_index)``, the 1-based ranks of the eigenvalues that the alpha-ReQ
            fit covers (:func:`~rank_lightning.functional.alpha_req`; Agrawal et al. fit ranks 11 to 100);
            ``last_index=None`` for the last numerically non-zero one.
        update_chunk_mb: the most MiB of a float64 copy of a batch's rows that :meth:`update` makes (default 256):
            a larger batch is shifted, converted and multiplied a chunk of rows at a time (the ``"mean"`` reduction
            of tokens and maps takes its float64 means a chunk of inputs at a time; the fallbacks sketch and
            subsample a chunk of rows at a time), so that the per-batch
            temporaries stay bounded whatever the batch (a bf16 (8, 4096, 4096) batch of hidden states would
            otherwise be 1 GiB of float64 rows per hooked layer). Chunks change the order of the float64 additions
            only (about 1e-15 relative). The attribute ``largest_update_bytes`` says how large the largest one was.
        kwargs: passed to :class:`torchmetrics.Metric`.

    Example::

        metric = ActivationSpectrum(num_classes=10, reduction="mean", center="both")
        for x, y in loader:
            metric.update(model.layer3(x), y)
        result = metric.compute()
        result.uncentered.numerical_rank, result.total_cluster_variation, result.path
        result.scalars(("numerical_rank", "classwise_variance_ratio"), per_class=True)
    """

    is_differentiable = False
    higher_is_better = None
    # forward() on lazily shaped states needs the two-update implementation.
    full_state_update = True

    def __init__(
        self,
        num_classes: int | None = None,
        *,
        reduction: str = "flatten",
        center: bool | Literal["both"] = False,
        variance_ratio_ks: Sequence[int] = (1, 10, 20),
        soft_rank_tau: float = 0.5,
        rank_tolerance: float | None = None,
        tolerance_size: Literal["min", "max"] = "min",
        classwise: bool = True,
        classwise_k: int = 1,
        classwise_center: bool = False,
        max_gram_features: int = 4096,
        max_samples: int | None = None,
        fallback: Literal["sample_gram", "sketch"] = "sample_gram",
        memory_budget_mb: float = 1024.0,
        num_features: int | None = None,
        seed: int = 0,
        tolerance_dtype: str | torch.dtype | None = None,
        gram_precision: Literal["float64", "float32", "tf32", "auto"] = "float64",
        alpha_req_range: tuple[int, int | None] = (1, None),
        update_chunk_mb: float = UPDATE_CHUNK_BYTES / 2**20,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        check_positive_int("num_classes", num_classes, allow_none=True)
        self.num_classes, self.reduction = num_classes, check_choice("reduction", reduction, REDUCTIONS)
        self.center = check_choice("center", center, _CENTER_CHOICES)
        self.variance_ratio_ks = check_positive_ints("variance_ratio_ks", variance_ratio_ks, allow_empty=True)
        check_positive("soft_rank_tau", soft_rank_tau)
        check_positive("rank_tolerance", rank_tolerance, allow_none=True)
        self.soft_rank_tau, self.rank_tolerance = soft_rank_tau, rank_tolerance
        self.tolerance_dtype = check_tolerance_dtype(tolerance_dtype, rank_tolerance)
        self.gram_precision = check_choice("gram_precision", gram_precision, GRAM_PRECISIONS)
        self.tolerance_size = check_choice("tolerance_size", tolerance_size, ("min", "max"))
        self.alpha_req_range = check_alpha_req_range(alpha_req_range)
        self._set_update_chunk(update_chunk_mb)
        self._set_classwise(classwise, classwise_k, classwise_center)
        self._set_fallback(max_gram_features, max_samples, fallback, memory_budget_mb)
        # Checked here: the seed is first used by a fallback's first draw, possibly hours into the fit.
        check_int("seed", seed)
        self.seed, self._given_num_features = seed, num_features
        self._num_features: int | None = None
        self._generator: torch.Generator | None = None
        # Set by load_state_dict: the saved generator state (or, without one, the rows already streamed), so that the
        # restored metric never draws the keys and buckets of its first rows again.
        self._restored_rng: Tensor | int | None = None
        self._add_states(num_features)

    def _set_update_chunk(self, update_chunk_mb: float) -> None:
        """Check and keep the bound of an update's float64 row temporaries."""
        check_positive("update_chunk_mb", update_chunk_mb)
        self.update_chunk_bytes = max(1, int(update_chunk_mb * 2**20))
        # The largest float64 row temporary an update has made, in bytes (the memory plan prints it).
        self.largest_update_bytes = 0

    def _set_classwise(self, classwise: bool, classwise_k: int, classwise_center: bool) -> None:
        """Check and keep the settings of the class-wise variance ratio."""
        check_positive_int("classwise_k", classwise_k)
        check_choice("classwise_center", classwise_center, (False, True))
        check_bool("classwise", classwise)
        self.classwise, self.classwise_k, self.classwise_center = classwise, classwise_k, classwise_center

    def _set_fallback(
        self, max_gram_features: int, max_samples: int | None, fallback: str, memory_budget_mb: float
    ) -> None:
        """Check and keep the settings of the path past ``max_gram_features`` features (the fallback)."""
        check_positive_int("max_gram_features", max_gram_features)
        check_positive_int("max_samples", max_samples, allow_none=True)
        self.max_gram_features, self.max_samples = max_gram_features, max_samples
        self.fallback = check_choice("fallback", fallback, FALLBACKS)
        check_positive("memory_budget_mb", memory_budget_mb)
        self.memory_budget_bytes = int(memory_budget_mb * 2**20)

    def _add_states(self, num_features: int | None) -> None:
        f64 = torch.float64
        self.add_state("num_samples", torch.zeros((), dtype=torch.int64), dist_reduce_fx="sum")
        self.add_state("num_nonfinite_batches", torch.zeros((), dtype=torch.int64), dist_reduce_fx="sum")
        # sum ||x_i||^2, the first term of the total cluster variation.
        self.add_state("sum_squares", torch.zeros((), dtype=f64), dist_reduce_fx="sum")
        # The point every sum is taken around: empty until the first batch; agreed across processes at the sync.
        self.add_state("reference", torch.zeros(0, dtype=f64), dist_reduce_fx="max")
        # The largest epsilon of the activations' dtypes (the lowest precision seen), for tolerance_dtype="input".
        self.add_state("input_eps", torch.zeros((), dtype=f64), dist_reduce_fx="max")
        # Shaped states start empty and get their size from the first batch unless num_features is given.
        shaped = ("feature_sum", "gram", "class_counts", "class_sums", "class_grams", "sketch", "sketch_signs")
        for name in (*shaped, "sketch_rows"):
            self.add_state(name, torch.zeros(0, dtype=f64), dist_reduce_fx="sum")
        # The subsample merges by concatenation; the smallest keys overall form a uniform subsample of the union.
        self.add_state("sample_rows", [], dist_reduce_fx="cat")
        self.add_state("sample_keys", [], dist_reduce_fx="cat")
        self.add_state("sample_labels", [], dist_reduce_fx="cat")
        if num_features is not None:
            self._configure(num_features)
            for name, shape in self._state_shapes().items():
                dtype = torch.int64 if name == "class_counts" else f64
                setattr(self, name, torch.zeros(shape, dtype=dtype))
                self._defaults[name] = torch.zeros(shape, dtype=dtype)

    @property
    def path(self) -> str | None:
        """``"gram"``, ``"sample_gram"`` or ``"sketch"``; ``None`` until d is known."""
        return None if self._num_features is None else self._path_for(self._num_features)

    @property
    def num_features(self) -> int | None:
        """d, the columns of the reduced batches, learnt from the first batch; ``None`` until then."""
        return self._num_features

    def path_for(self, num_features: int) -> str:
        """The path these settings take for ``d = num_features`` (see :attr:`path`), without allocating anything."""
        check_positive_int("num_features", num_features)
        return self._path_for(num_features)

    def _path_for(self, d: int) -> str:
        if d <= self.max_gram_features and d * d * _FLOAT64_BYTES <= self.memory_budget_bytes:
            return "gram"
        return self.fallback

    @property
    def fallback_size(self) -> int:
        """Rows kept by the fallback path: ``max_samples``, or the largest count that fits the budget."""
        return self._fallback_size_for(self._num_features or 1)

    def _fallback_size_for(self, d: int) -> int:
        if self.max_samples is not None:
            return self.max_samples
        # Rows (n x d) plus the sample Gram (n x n) within the budget: n^2 + n d <= budget / 8.
        budget = self.memory_budget_bytes / _FLOAT64_BYTES
        n = int((math.sqrt(d * d + 4 * budget) - d) / 2)
        return max(1, min(n, self.max_gram_features))

    @property
    def uses_class_grams(self) -> bool:
        """Whether per-class Grams are accumulated (gram path, classes, and within the memory budget)."""
        return self._uses_class_grams_for(self._num_features or 0)

    def _uses_class_grams_for(self, d: int) -> bool:
        if not d or self._path_for(d) != "gram" or not self.classwise or self.num_classes is None:
            return False
        return (self.num_classes + 1) * d * d * _FLOAT64_BYTES <= self.memory_budget_bytes

    def planned_bytes(self, num_features: int) -> int:
        """Bytes the states take for ``d = num_features`` with these settings, without allocating anything.

        Counts every shaped state (Gram, class Grams, class sums, feature sum, reference, sketch) and, on the
        ``sample_gram`` path, the subsample at float64 (rows, keys, labels) plus the n x n sample Gram formed by
        :meth:`compute`.
        """
        check_positive_int("num_features", num_features)
        shapes = self._state_shapes(num_features)
        values = sum(math.prod(shape) for shape in shapes.values()) + num_features + 4
        if self._path_for(num_features) == "sample_gram":
            n = self._fallback_size_for(num_features)
            values += n * (num_features + 2) + n * n
        return values * _FLOAT64_BYTES

    def _configure(self, num_features: int) -> None:
        check_positive_int("num_features", num_features)
        self._num_features = num_features

    def _state_shapes(self, d: int | None = None) -> dict[str, tuple[int, ...]]:
        d = self._num_features if d is None else d
        c = self.num_classes or 0
        path = self._path_for(d)
        m = self._fallback_size_for(d)
        return {
            "feature_sum": (d,),
            "gram": (d, d) if path == "gram" else (0,),
            "class_counts": (c,),
            "class_sums": (c, d) if c else (0,),
            "class_grams": (c, d, d) if self._uses_class_grams_for(d) else (0,),
            "sketch": (m, d) if path == "sketch" else (0,),
            "sketch_signs": (m,) if path == "sketch" else (0,),
            "sketch_rows": (m,) if path == "sketch" else (0,),
        }

    def _ensure_states(self, device: torch.device, fresh: bool) -> None:
        for name, shape in self._state_shapes().items():
            state = getattr(self, name)
            if tuple(state.shape) != shape:
                dtype = torch.int64 if name == "class_counts" else torch.float64
                setattr(self, name, torch.zeros(shape, dtype=dtype, device=device))
            elif fresh and state.device != device:
                setattr(self, name, state.to(device))
        if fresh:
            for name in ("num_samples", "num_nonfinite_batches", "sum_squares", "input_eps"):
                setattr(self, name, getattr(self, name).to(device))

    def _rng(self, device: torch.device) -> torch.Generator:
        """The generator of the fallback's keys and buckets, on the device of the rows (a GPU then draws them itself:
        copies from the host would wait for it). The same seed draws other numbers on a CPU and on a GPU."""
        if self._generator is None or self._generator.device != device:
            previous = self._generator
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
            # Ranks need independent keys and buckets, or their sketches would correlate.
            self._generator = torch.Generator(device=device).manual_seed(self.seed + 1_000_003 * rank)
            restored, self._restored_rng = self._restored_rng, None
            if previous is not None:
                # Moved to another device mid-stream: the draws go on from the old generator's, or the rows after the
                # move would get the keys (buckets) of the first rows again.
                self._generator.manual_seed(_continued_seed(previous))
            elif isinstance(restored, Tensor) and restored.numel() == self._generator.get_state().numel():
                self._generator.set_state(restored)  # the draws go on where the saved metric's stopped
            elif restored is not None:
                # No state to go on from (or one of another device): a seed of its own for the draws after the restored
                # rows, so that they do not repeat those of the first rows.
                rows = int(restored) if isinstance(restored, int) else int(restored.double().sum())
                self._generator.manual_seed(hash((self.seed, rank, rows)) & (2**63 - 1))
        return self._generator

    _RNG_KEY = "_generator_state"

    @override
    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        """With persistent states, also the state of the fallback's generator, so that a restored metric draws what
        this one would have drawn next."""
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self._generator is not None and self._persistent.get("sample_keys", False):
            destination[prefix + self._RNG_KEY] = self._generator.get_state()

    @override
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
        """Load the states, then learn d from them (as :meth:`update` would have) and restore the generator."""
        rng = state_dict.pop(prefix + self._RNG_KEY, None)
        loaded = prefix + "feature_sum" in state_dict
        problem = self._unloadable(state_dict, prefix) if loaded else None
        if problem:
            error_msgs.append(problem)  # load_state_dict raises it; this metric stays as it was
            return
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        if not loaded:
            return
        self._computed = None
        self._width_from_states()
        rows = int(self.num_samples)
        if rows:
            self._update_count = max(self._update_count, 1)  # rows arrived: compute() is no longer "before update"
            self._generator = None
            self._restored_rng = rng if rng is not None else rows

    def _unloadable(self, state_dict: dict[str, Any], prefix: str) -> str | None:
        """Why the states in ``state_dict`` cannot go on in this metric: rows kept another way (other Grams, another
        path or subsample size) or of another width than ``num_features``; ``None`` when they can."""
        d = int(state_dict[prefix + "feature_sum"].shape[0])
        if not d:
            return None  # nothing streamed: the width is learnt again
        expected = self._state_shapes(d)
        found = {name: tuple(state_dict[prefix + name].shape) for name in expected if prefix + name in state_dict}
        capacity = self._fallback_size_for(d)
        keys = state_dict.get(prefix + "sample_keys", [])
        kept = sum(int(part.shape[0]) for part in keys) if isinstance(keys, list) else int(keys.shape[0])
        rows = int(state_dict.get(prefix + "num_samples", 0))
        smaller = self._path_for(d) == "sample_gram" and kept < min(rows, capacity)  # it kept fewer than it saw
        given = self._given_num_features
        if given is not None and given != d:
            saved = f"the saved ActivationSpectrum holds rows of {d} features"
            return f"{saved}, this one was made with num_features={given}"
        if found == {name: expected[name] for name in found} and not smaller:
            return None
        return (
            f"the saved ActivationSpectrum keeps {_kept({**expected, **found}, kept)}, this one would keep "
            f"{_kept(expected, capacity)}; load it into a metric made with the same num_classes, classwise, "
            "max_gram_features, max_samples, fallback and memory_budget_mb"
        )

    def update(
        self, activations: Tensor, labels: Tensor | ClassGrouping | None = None, *, mask: Tensor | None = None
    ) -> None:
        """Add a batch of raw layer outputs.

        Args:
            activations: ``(B, d)``, ``(B, T, D)``, ``(B, C, H, W)`` or ``(B, C, D1, D2, D3)``; any floating
                dtype.
            labels: ``(B,)`` integer class labels in ``[0, num_classes)``; ignored when ``num_classes`` is ``None``.
                Also taken, as everywhere in the package (:data:`~rank_lightning.layers.LABEL_FORMS`): a ``(B, 1)``
                column, booleans (classes 0 and 1) and one-hot rows ``(B, C)`` (their argmax); float values and soft
                targets are refused. With the ``"channel"`` and ``"token"`` reductions every row inherits its
                input's label. With ``"token"``, ``(B, T)`` labels per token instead (a causal language model's
                next tokens, already shifted), in ``[0, num_classes)`` or -100: a token labelled -100 is left out of
                every sum, as a padded one is; other reductions of token activations, one row per input, refuse them. A
                :class:`~rank_lightning.functional.streaming.ClassGrouping` of them (``group_by_class``, or
                ``group_token_labels`` for labels per token), made once per batch and passed to the metrics of every
                layer, saves each its own grouping (on a GPU, its own synchronisation).
            mask: ``(B, T)`` attention mask of token activations (true / 1 at real tokens): padded positions never
                reach the sums (see :func:`~rank_lightning.functional.reduce_activations`); ignored for other
                shapes. A boolean mask is taken as it is; one of 0 / 1 integers or floats has its values checked,
                which on a GPU reads a flag back to the host (convert it with ``mask.bool()`` once per batch when
                several layers share it). Under ``"cls"`` a mask whose first position is padding (left padding) is
                named in a warning, which reads one more flag back.
        """
        check_real("activations", activations)
        if not torch.is_inference_mode_enabled():
            self._leave_inference_mode()
        activations, labels, mask = self._prepare(activations.detach(), labels, mask)
        if activations.shape[0] == 0:
            return
        if activations.dtype.is_floating_point:
            self.input_eps = self.input_eps.clamp_min(torch.finfo(activations.dtype).eps)
        precision = resolve_gram_precision(self.gram_precision, activations.device)
        options = {"num_classes": self.num_classes, "precision": precision, **self._grams()}
        if self.path == "gram" and self.reduction == "channel" and activations.ndim >= 4:
            self._ensure_reference(lambda: _channel_mean(activations))
            moments = channel_gram_moments(activations, labels, reference=self.reference, **options)
            by_class = labels is not None and options.get("class_grams") is not None
            self._note_temporary(channel_block_values(activations, by_class))
        else:
            moments = self._row_update(activations, labels, mask, options)
            if moments is None:
                return
        self._add_moments(moments)

    def _row_update(
        self, activations: Tensor, labels: Tensor | ClassGrouping | None, mask: Tensor | None, options: dict[str, Any]
    ) -> BatchMoments | None:
        """The moments of a batch's rows (every path but the one-pass channel Gram), added a chunk of rows at a time,
        and the fallback's share of them; ``None`` for a batch without rows."""
        rows, labels, counts, real = self._rows(activations, labels, mask)
        if rows.shape[0] == 0:
            return None
        self._ensure_reference(lambda: _row_mean(rows, real), until_rows=real is not None)
        chunk = self.update_chunk_bytes
        moments = row_moments(
            rows, labels, reference=self.reference, sorted_counts=counts, row_mask=real, chunk_bytes=chunk, **options
        )
        class_blocks = counts is not None and options.get("class_grams") is not None and labels is not None
        self._note_temporary(row_temporary_values(*rows.shape, chunk, rows.device, class_blocks=class_blocks))
        if self.path == "sketch":
            self._add_to_sketch(rows, real)
        elif self.path == "sample_gram":
            self._add_to_subsample(rows, labels, real)
        return moments

    def _note_temporary(self, values: int) -> None:
        """Keep the largest float64 row temporary of the updates so far, ``values`` float64 values."""
        self.largest_update_bytes = max(self.largest_update_bytes, 8 * values)

    def _leave_inference_mode(self) -> None:
        """Copy the states made under ``torch.inference_mode`` (allocated by its first batch, or by a reset there, as
        in Lightning's validation) into ordinary tensors, which a batch outside inference mode can add to in place."""
        for name in self._defaults:
            value = getattr(self, name)
            if isinstance(value, list):
                if any(part.is_inference() for part in value):
                    setattr(self, name, [part.clone() for part in value])
            elif value.is_inference():
                setattr(self, name, value.clone())

    def _width_from_states(self) -> None:
        """Learn d from the states when they were set from outside rather than by :meth:`update`: loaded from a state
        dict, or shared by a ``MetricCollection`` compute group (whose members other than the first see no batch)."""
        if self.feature_sum.numel():
            self._num_features = int(self.feature_sum.shape[0])
        elif self._given_num_features is None:
            self._num_features = None

    def _ensure_reference(self, mean: Any, *, until_rows: bool = False) -> None:
        """Set the reference point from the first batch (``mean`` computes that batch's mean).

        ``until_rows``: the batch may hold no real row (padded tokens kept in place), whose mean is no point near the
        data. Then every batch replaces the point, on the device, for as long as no row was counted: the sums so far
        are exact zeros, the same around any point.
        """
        if self.reference.numel() == 0:
            self.reference = reference_point(mean())
        elif until_rows:
            self.reference = torch.where(self.num_samples > 0, self.reference, reference_point(mean()))

    def _rows(
        self, activations: Tensor, grouping: ClassGrouping | None, mask: Tensor | None
    ) -> tuple[Tensor, Tensor | None, list[int] | None, Tensor | None]:
        """The batch as ``(N, d)`` rows, their labels, the rows per class when the rows are sorted by class, and which
        rows are real (``None``: all; else padded token rows kept in place, see :meth:`_reduce`).

        Rows are in their own precision, except ``"mean"`` in float64.
        """
        if grouping is not None and grouping.labelled is not None:
            return self._token_rows(activations, grouping, mask)
        by_class = grouping is not None and self.uses_class_grams
        if by_class:
            # Inputs sorted by class give each class contiguous rows, with no float64 copy of the rows to group them.
            activations = activations.index_select(0, grouping.order)
            mask = mask.index_select(0, grouping.order) if mask is not None else None
        rows, real, per_input = self._reduce(activations, mask)
        if grouping is None:
            return rows, None, None, real
        labels = grouping.sorted_labels if by_class else grouping.labels
        if per_input is not None:
            return rows, labels.repeat_interleave(per_input), None, real
        repeats = rows.shape[0] // max(activations.shape[0], 1)
        counts = [n * repeats for n in grouping.counts] if by_class else None
        return rows, labels.repeat_interleave(repeats) if repeats > 1 else labels, counts, real

    def _token_rows(
        self, activations: Tensor, grouping: ClassGrouping, mask: Tensor | None
    ) -> tuple[Tensor, Tensor, list[int] | None, Tensor | None]:
        """:meth:`_rows` of tokens with a label each: a row counts where the mask marks a real token and its label is
        not -100. On a CPU the counted rows are selected; elsewhere every row stays in place, sorted by class when the
        class Grams take them (the grouping's counts, read once per batch, then cut the classes' blocks)."""
        keep = counted_tokens(grouping, mask, activations)
        rows, real = masked_token_rows(activations, "token", keep)
        if not _keeps_padded_rows(rows.device):
            return rows[real], grouping.labels[real], None, None
        if self.uses_class_grams:
            order = grouping.order
            return rows.index_select(0, order), grouping.sorted_labels, list(grouping.counts), real[order]
        return rows, grouping.labels, None, real

    def _reduce(self, activations: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """``(rows, real, per_input)``: the reduced rows; for masked tokens whose padded rows stay in place, which
        rows are real; for masked tokens whose real rows were selected, how many rows each input gave.

        The real rows of masked tokens are selected on a CPU (less work); on a GPU every row stays in place and only
        the real ones are counted, so that their number is never read back to the host (a synchronisation per layer
        and batch): the sums skip the others, the sketch adds them with weight 0, the subsample gives them an
        infinite key.
        """
        # A mean over half-precision values is taken in float64 (a bf16 mean loses 3 digits); reshapes are exact.
        dtype = torch.float64 if self.reduction == "mean" and activations.ndim > 2 else None
        if (mask is None or activations.ndim != 3) and dtype is None:
            return reduce_activations(activations, self.reduction), None, None
        if mask is None or activations.ndim != 3:
            means = self._by_inputs(lambda x: reduce_activations(x, self.reduction, dtype=dtype), activations)
            return means, None, None
        keep = check_token_mask(mask, activations)
        if self.reduction == "cls":
            warn_cls_left_padding(keep, stacklevel=4)  # update() -> _rows() -> _reduce()
        if dtype is None:
            rows, real = masked_token_rows(activations, self.reduction, keep)
        else:
            rows, real = self._by_inputs(
                lambda x, k: masked_token_rows(x, self.reduction, k, dtype=dtype), activations, keep
            )
        if real is None or _keeps_padded_rows(rows.device):
            return rows, real, None
        return rows[real], None, token_rows_per_sample(keep, self.reduction)

    def _by_inputs(self, reduce: Any, activations: Tensor, keep: Tensor | None = None) -> Any:
        """``reduce(activations[, keep])`` of float64 rows, taken a chunk of inputs at a time where a float64 copy of
        the batch would exceed ``update_chunk_mb``, the chunks' rows (and real-row masks) joined. Every row is reduced
        as in one call: the results are equal."""
        batch = activations.shape[0]
        step = rows_per_chunk(math.prod(activations.shape[1:]), self.update_chunk_bytes)
        args = (activations,) if keep is None else (activations, keep)
        self._note_temporary(min(batch, step) * math.prod(activations.shape[1:]))
        if batch <= step:
            return reduce(*args)
        parts = [reduce(*(arg[start : start + step] for arg in args)) for start in range(0, batch, step)]
        if not isinstance(parts[0], tuple):
            return torch.cat(parts)
        return tuple(None if part[0] is None else torch.cat(part) for part in zip(*parts))

    def _prepare(
        self, activations: Tensor, labels: Tensor | None, mask: Tensor | None
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """Check the batch (:meth:`update` has refused complex ones), learn d from it, and put the batch and the states
        on one device."""
        if activations.dtype == torch.bool:
            activations = activations.to(torch.uint8)  # 0 / 1, as the functional metrics read a boolean matrix
        if 0 in activations.shape[1:]:
            raise ValueError(
                f"activations of shape {tuple(activations.shape)} have an empty dimension after the batch one: every "
                "input needs at least one feature, channel, position or token"
            )
        # One input's reduction gives d (and validates the reduction) without touching the batch.
        try:
            num_features = reduce_activations(activations[:1], self.reduction).shape[1]
        except (ValueError, IndexError):
            # The same check on the whole batch, so that the message names the batch's own shape, not one input's.
            reduce_activations(activations, self.reduction)
            raise
        if self._num_features is None:
            self._configure(num_features)
        elif num_features != self._num_features:
            if self._given_num_features is not None:
                expected = f"the metric was made with num_features={self._num_features}"
            else:
                expected = f"earlier batches had {self._num_features}"
            raise ValueError(
                f"activations reduce to {num_features} features with reduction={self.reduction!r}, but {expected}"
            )
        if self.num_classes is None or labels is None:
            labels = None
        else:
            labels = self._input_grouping(labels, activations)
        # Before anything is accumulated the states follow the activations' device; afterwards the batch follows them.
        fresh = self._update_count <= 1
        device = activations.device if fresh else self.feature_sum.device
        self._ensure_states(device, fresh)
        moved = [None if t is None else t.to(device) for t in (labels, mask if activations.ndim == 3 else None)]
        return activations.to(device), moved[0], moved[1]

    def _input_grouping(self, labels: Tensor | ClassGrouping, activations: Tensor) -> ClassGrouping:
        batch = activations.shape[0]
        given = labels.labels if isinstance(labels, ClassGrouping) else labels
        if not isinstance(given, Tensor):
            class_labels(given)  # raises, naming what was found and the forms taken
        per_token = labels.labelled is not None if isinstance(labels, ClassGrouping) else given.ndim == 2
        if per_token and activations.ndim == 3 and self.reduction == "token":
            return self._token_grouping(labels, activations)
        if per_token and activations.ndim == 3:
            raise ValueError(
                f"labels per token (B, T) need reduction='token' (a row per token); reduction={self.reduction!r} "
                f"gives a row per input, which takes labels of shape ({batch},)"
            )
        if isinstance(labels, ClassGrouping) and per_token:
            raise ValueError(
                f"labels per token need (B, T, D) token activations, got activations of shape "
                f"{tuple(activations.shape)}"
            )
        if isinstance(labels, ClassGrouping):
            if given.ndim != 1 or given.shape[0] != batch:
                raise ValueError(
                    f"labels must have shape ({batch},) to match the activations, got {tuple(given.shape)}"
                )
            if len(labels.counts) != self.num_classes:
                grouped = count_of(len(labels.counts), "class", "classes")
                raise ValueError(f"labels are grouped into {grouped}, not {self.num_classes}")
            return labels
        try:
            # The forms every class-aware part takes: a (B, 1) column, booleans, one-hot rows as their argmax.
            read = class_labels(given)
        except ValueError:
            integers = given.ndim == 2 and not (given.is_floating_point() or given.dtype == torch.bool)
            if not (integers and given.shape[0] == batch):
                raise
            # A label per position of rows that are not tokens: say what is taken instead.
            raise ValueError(
                f"labels must have shape ({batch},) to match the activations, got {tuple(given.shape)}: one integer "
                "label per input, which every row of the input inherits under the 'token' and 'channel' reductions; "
                "labels per position (B, T), such as a language model's next tokens, need (B, T, D) token activations "
                "and reduction='token', and one-hot rows (B, C) are read as their argmax"
            ) from None
        if read.shape[0] != batch:
            raise ValueError(f"labels must have shape ({batch},) to match the activations, got {tuple(given.shape)}")
        return group_by_class(read, self.num_classes)

    def _token_grouping(self, labels: Tensor | ClassGrouping, activations: Tensor) -> ClassGrouping:
        """The grouping of labels per token, checked against the ``(B, T)`` of the token activations."""
        expected = tuple(activations.shape[:2])
        if isinstance(labels, ClassGrouping):
            shape = tuple(labels.labelled.shape)
        else:
            shape = tuple(labels.shape)
        if shape != expected:
            raise ValueError(f"labels per token must have shape (B, T) = {expected} of the activations, got {shape}")
        if isinstance(labels, ClassGrouping):
            if len(labels.counts) != self.num_classes:
                grouped = count_of(len(labels.counts), "class", "classes")
                raise ValueError(f"labels are grouped into {grouped}, not {self.num_classes}")
            return labels
        return group_token_labels(labels, self.num_classes)

    def _grams(self) -> dict[str, Tensor | None]:
        """The running Grams a batch is added into (gram path only); labelled rows go into their class Gram if kept."""
        if self.path != "gram":
            return {}
        return {"gram": self.gram, "class_grams": self.class_grams if self.uses_class_grams else None}

    def _add_moments(self, moments: BatchMoments) -> None:
        # The sums of a batch with NaN or Inf are poisoned but never used: compute() reports NaN once one batch was bad.
        self.num_samples += moments.num_rows
        self.num_nonfinite_batches += moments.nonfinite
        self.feature_sum += moments.feature_sum
        self.sum_squares += moments.sum_squares
        if moments.class_counts is not None:
            self.class_counts += moments.class_counts
            self.class_sums += moments.class_sums

    def _add_to_sketch(self, rows: Tensor, real: Tensor | None) -> None:
        """Add the (real) rows to the CountSketch; a row where ``real`` is false adds zeros, whatever it holds."""
        buckets, signs = sketch_draws(rows.shape[0], self.sketch.shape[0], self._rng(rows.device), rows.device)
        # A chunk of float64 rows at a time (update_chunk_mb): each row shifted, zeroed where not real and signed as
        # in one pass, and added in the same order.
        step = rows_per_chunk(rows.shape[1], self.update_chunk_bytes)
        for start in range(0, rows.shape[0], step):
            stop = start + step
            shifted = torch.sub(rows[start:stop], self.reference)
            if real is not None:
                shifted.masked_fill_(~real[start:stop].unsqueeze(1), 0)
            self.sketch.index_add_(0, buckets[start:stop], shifted.mul_(signs[start:stop].unsqueeze(1)))
        counted = torch.ones_like(signs) if real is None else real.to(signs.dtype)
        self.sketch_signs.index_add_(0, buckets, signs * counted)
        self.sketch_rows.index_add_(0, buckets, counted)

    def _add_to_subsample(self, rows: Tensor, labels: Tensor | None, real: Tensor | None) -> None:
        """Add the (real) rows to the bottom-k subsample; a row where ``real`` is false gets an infinite key: it never
        displaces a real row, and :meth:`_subsample` leaves it out."""
        keys = torch.rand(rows.shape[0], generator=self._rng(rows.device), dtype=torch.float64, device=rows.device)
        if real is not None:
            keys = keys.masked_fill(~real, math.inf)
        sample = None
        if self.sample_rows:
            sample = Subsample(self.sample_rows[0], self.sample_keys[0], self.sample_labels[0])
        # A chunk of rows at a time (update_chunk_mb): the bottom-k of the chunks one after another is that of the
        # batch (the same rows, kept in another order), without the batch's rows in float32 beside the subsample.
        step = rows_per_chunk(rows.shape[1], self.update_chunk_bytes)
        for start in range(0, rows.shape[0], step):
            part = slice(start, start + step)
            chunk_labels = None if labels is None else labels[part]
            sample = subsample_update(sample, rows[part], keys[part], chunk_labels, capacity=self.fallback_size)
        self.sample_rows[:], self.sample_keys[:], self.sample_labels[:] = [sample.rows], [sample.keys], [sample.labels]

    @override
    def set_dtype(self, dst_type: str | torch.dtype) -> ActivationSpectrum:
        """Keep the float64 states: the sums are float64 whatever the precision of the model or the activations (a
        float16 Gram overflows at 65,504 and every metric came out NaN, with no warning). Returns the metric."""
        return self

    @override
    def _apply(self, fn: Any, exclude_state: Sequence[str] = "") -> ActivationSpectrum:
        """Device moves only: ``metric.to(torch.float16)`` (or a model's ``.to(dtype)``, which reaches its metrics)
        converts every floating state, which :meth:`set_dtype` does not guard, and would round the float64 sums."""
        return super()._apply(device_move_only(fn), exclude_state)

    @override
    def reset(self) -> None:
        """Forget every streamed row; d is learnt again from the next batch (unless ``num_features`` was given)."""
        super().reset()
        if self._given_num_features is None:
            self._num_features = None

    @override
    def merge_state(self, incoming_state: dict[str, Any] | Metric) -> None:
        """Add the rows streamed into another :class:`ActivationSpectrum` (or a state dict such as its
        ``metric_state``) to these, as if this metric had streamed them too (up to the order of the additions).

        The two sets of sums are taken around different reference points; the incoming ones are moved to this
        metric's point first with the exact formulas of the DDP sync
        (:func:`~rank_lightning.functional.streaming.move_reference`), and the subsamples merge into the subsample of
        the union. The incoming metric is left unchanged.

        Args:
            incoming_state: an :class:`ActivationSpectrum` with the same settings, or a state dict of one with the
                settings of this metric.

        Raises:
            ValueError: anything else; a metric with other ``num_classes`` or ``reduction``; rows of a different
                number of features; rows kept another way (without per-class Grams, on another path, in a subsample
                or sketch of another size: other settings); a metric whose subsample or sketch was drawn with this
                metric's ``seed`` (the i-th rows of both would share their random key or bucket). A refused merge
                changes nothing.
        """
        if isinstance(incoming_state, ActivationSpectrum):
            for name in ("num_classes", "reduction"):
                mine, theirs = getattr(self, name), getattr(incoming_state, name)
                if mine != theirs:
                    raise ValueError(
                        f"cannot merge an ActivationSpectrum with {name}={theirs!r} into one with {mine!r}"
                    )
            fallback = incoming_state.path not in (None, "gram") and int(incoming_state.num_samples)
            if fallback and incoming_state.seed == self.seed:
                # Equal seeds draw equal keys and buckets for the i-th row of each stream: not a random union.
                raise ValueError(
                    f"both metrics keep a {incoming_state.path!r} fallback drawn with seed={self.seed}; metrics to be "
                    "merged need different seeds"
                )
            other = copy.deepcopy(incoming_state)
        elif isinstance(incoming_state, dict):
            missing = sorted(set(self._defaults) - set(incoming_state))
            if missing:
                raise ValueError(f"the incoming state lacks {', '.join(missing)}; pass an ActivationSpectrum's state")
            other = copy.deepcopy(self)
            for name in self._defaults:
                setattr(other, name, copy.deepcopy(incoming_state[name]))
            other._num_features = int(other.feature_sum.shape[0]) if other.feature_sum.numel() else None
        else:
            raise ValueError(f"expected an ActivationSpectrum or its state dict, got {type(incoming_state).__name__}")
        self._merge(other)

    def _merge(self, other: ActivationSpectrum) -> None:
        if int(other.num_samples):
            self._check_mergeable(other)  # before anything changes: a refused merge leaves this metric as it was
        self._computed = None
        device = self.feature_sum.device
        self.num_nonfinite_batches = self.num_nonfinite_batches + other.num_nonfinite_batches.to(device)
        self.input_eps = torch.maximum(self.input_eps, other.input_eps.to(device))
        if int(other.num_samples) == 0:
            return
        self._update_count += 1  # rows arrived: compute() is no longer "before update", the states keep their device
        if self._num_features is None:
            self._configure(other._num_features)
        self._ensure_states(device, fresh=False)
        if int(self.num_samples) == 0:
            self.reference = other.reference.to(device).clone()
        else:
            other._move_sums(other.reference.to(other.feature_sum.device) - self.reference.to(other.feature_sum.device))
        sums = ("num_samples", "sum_squares", "feature_sum", "gram", "class_counts", "class_sums", "class_grams")
        for name in (*sums, "sketch", "sketch_signs", "sketch_rows"):
            setattr(self, name, getattr(self, name) + getattr(other, name).to(device))
        states = (self.sample_rows, self.sample_keys, self.sample_labels)
        incoming = (other.sample_rows, other.sample_keys, other.sample_labels)
        parts = [Subsample(*(dim_zero_cat(s) for s in group)) for group in (states, incoming) if group[0]]
        if parts:
            merged = merge_subsamples(
                [part._replace(rows=part.rows.to(device)) for part in parts], capacity=self.fallback_size
            )
            self.sample_rows[:], self.sample_keys[:], self.sample_labels[:] = (
                [merged.rows],
                [merged.keys.to(device)],
                [merged.labels.to(device)],
            )

    def _check_mergeable(self, other: ActivationSpectrum) -> None:
        """Raise unless the rows of ``other`` add to these: the same width, kept the same way (the same Grams, or a
        subsample or sketch of the same size)."""
        d = other._num_features
        if self._num_features is not None and d != self._num_features:
            raise ValueError(f"cannot merge rows of {d} features into rows of {self._num_features} features")
        expected = self._state_shapes(d)
        found = {name: tuple(getattr(other, name).shape) for name in expected}
        theirs, mine = other.fallback_size, self._fallback_size_for(d)
        if found != expected or (self._path_for(d) == "sample_gram" and theirs != mine):
            raise ValueError(
                f"cannot merge an ActivationSpectrum that keeps {_kept(found, theirs)} into one that keeps "
                f"{_kept(expected, mine)}; merge metrics made with the same num_classes, classwise, "
                "max_gram_features, max_samples, fallback and memory_budget_mb"
            )
        if self.sample_keys and other.sample_keys:
            # Random keys that recur: rows drawn with this metric's seed (a state dict, whose seed is not known), or the
            # same rows merged twice; the smallest keys of the union would not be a uniform subsample.
            keys, incoming = dim_zero_cat(self.sample_keys), dim_zero_cat(other.sample_keys)
            incoming = incoming[torch.isfinite(incoming)]
            if bool(torch.isin(incoming, keys.to(incoming.device)).any()):
                raise ValueError(
                    "the incoming subsample shares random keys with this one: rows drawn with the same seed (this "
                    f"metric's is seed={self.seed}; metrics to be merged need different seeds), or rows merged twice"
                )

    # -- DDP: one reference point for every process ----------------------------------------------------------------

    def _sync_dist(self, dist_sync_fn: Any = gather_all_tensors, process_group: Any | None = None) -> None:
        """Move this process's sums to the reference shared by every process, then sum the states as usual."""
        self._share_reference(dist_sync_fn, process_group or self.process_group)
        if self.path == "sample_gram":
            self._subsample_for_sync()
        super()._sync_dist(dist_sync_fn, process_group)

    def _subsample_for_sync(self) -> None:
        """One tensor per subsample state, rows in float64: every process then gathers tensors of one shape and dtype,
        also a process that saw no row (whose empty lists torchmetrics would fill with 1-D tensors of another dtype) or
        whose rows arrived in another precision."""
        device, d = self.feature_sum.device, self._num_features
        empty = {
            "sample_rows": torch.zeros(0, d, dtype=torch.float64, device=device),
            "sample_keys": torch.zeros(0, dtype=torch.float64, device=device),
            "sample_labels": torch.zeros(0, dtype=torch.int64, device=device),
        }
        for name, none in empty.items():
            parts = getattr(self, name)
            setattr(self, name, [dim_zero_cat(parts).to(none.dtype) if parts else none])

    def _share_reference(self, gather: Any, group: Any) -> None:
        """The reference of the lowest-ranked process with rows becomes every process's; sums move with exact
        formulas (:func:`~rank_lightning.functional.streaming.move_reference`)."""
        references = gather(self.reference, group=group)
        counts = gather(self.num_samples, group=group)
        common = next((r for r, n in zip(references, counts) if int(n) > 0 and r.numel()), None)
        if common is None:
            return
        common = common.to(device=self.feature_sum.device, dtype=torch.float64)
        if self._num_features is None:
            # This process saw no batch: d is the width of the others' rows.
            self._configure(common.numel())
        # A process that saw no batch holds unshaped states: zeros of the others' shapes, so that the sums add up.
        self._ensure_states(self.feature_sum.device, fresh=False)
        if self.reference.numel() and int(self.num_samples) > 0:
            self._move_sums(self.reference - common)
        self.reference = common.clone()

    def _move_sums(self, delta: Tensor) -> None:
        """Every sum of ``x - a`` turned into the sum of ``x - b`` for ``delta = a - b``."""
        n = self.num_samples.to(torch.float64)
        if self.path == "gram":
            count, sums = n, self.feature_sum
            if self.uses_class_grams:
                # The Gram holds the unlabelled rows only, the class Grams the labelled ones.
                count, sums = n - self.class_counts.sum(), self.feature_sum - self.class_sums.sum(dim=0)
                self.class_grams = move_reference(delta, self.class_counts, self.class_sums, self.class_grams)[1]
            self.gram = move_reference(delta, count, sums, self.gram)[1]
        elif self.path == "sketch":
            self.sketch = self.sketch + torch.outer(self.sketch_signs, delta)
        if self.num_classes:
            self.class_sums = move_reference(delta, self.class_counts, self.class_sums)[0]
        self.feature_sum, _, self.sum_squares = move_reference(delta, n, self.feature_sum, sum_squares=self.sum_squares)

    # -- results ---------------------------------------------------------------------------------------------------

    def compute(self) -> ActivationSpectrumResult:
        """Spectra and every metric; see :class:`ActivationSpectrumResult`."""
        self._width_from_states()
        n, bad = int(self.num_samples), int(self.num_nonfinite_batches)
        if bad or n == 0:
            problem = f"{bad} batch(es) of activations contained NaN or Inf" if bad else "no activations were streamed"
            warnings.warn(f"ActivationSpectrum: {problem}; every metric is NaN", RuntimeWarning, stacklevel=2)
            return self._nan_result(n)
        if self._underflows(n):
            warnings.warn(
                "ActivationSpectrum: the activations are too small for float64 second moments (entries of about "
                f"{self._entry_scale(n):.1e} and below {_SMALLEST_ENTRY:.1e}: their products underflow); every metric "
                "is NaN. Scale the activations up (the ranks and ratios do not depend on the scale)",
                RuntimeWarning,
                stacklevel=2,
            )
            return self._nan_result(n)
        # Element-wise work on a few d x d matrices is too small to share between threads (see serial_if_small).
        with serial_if_small(self.feature_sum, self.feature_sum.shape[-1]):
            if self.path == "gram":
                estimate = self._gram_estimate(n)
            elif self.path == "sketch":
                estimate = self._sketch_estimate(n)
            else:
                estimate = self._sample_estimate(n)
            if self.num_classes and not int(self.class_counts.sum()):
                # No labelled row, no class to take a ratio of: not reported, like the TCV.
                estimate = estimate._replace(classwise=None, classwise_source=None)
            elif self.path == "gram" and self.num_classes and self.classwise and not self.uses_class_grams:
                self._warn_class_grams_over_budget()
            if self.path == "gram":
                self._warn_far_reference(estimate.spectra, n)
            return self._result(estimate, tcv=self._tcv(n), n=n)

    def _warn_class_grams_over_budget(self) -> None:
        """Say that the class-wise variance ratio asked for is not computed: its class Grams exceed the budget."""
        d, classes = self.feature_sum.shape[-1], self.num_classes
        needs = (classes + 1) * d * d * _FLOAT64_BYTES
        warnings.warn(
            f"ActivationSpectrum: the class-wise variance ratio is not computed: its {count_of(classes, 'class Gram')} "
            f"of {d} x {d} float64 and the Gram need {mib_text(needs)} MiB, more than the "
            f"{self.memory_budget_bytes / 2**20:.6g} MiB "
            "of memory budget it was given (memory_budget_mb); raise it, or leave the class-wise "
            "variance ratio out (classwise=False)",
            RuntimeWarning,
            stacklevel=3,
        )

    def _entry_scale(self, n: int) -> float:
        """The size of the streamed entries around the reference point: the larger of their root mean square and of
        the largest column mean (a batch whose squares underflowed still shows in its sums)."""
        d = self.feature_sum.shape[-1]
        rms = math.sqrt(float(self.sum_squares) / (n * d))
        return max(rms, float(self.feature_sum.abs().max()) / n)

    def _underflows(self, n: int) -> bool:
        """Whether the rows are so close to the reference point (to the origin: the point is rounded to float32,
        which has no number below 1e-45) that their float64 products underflow: the Gram would read as zeros."""
        scale = self._entry_scale(n)
        return 0 < scale < _SMALLEST_ENTRY

    def _warn_far_reference(self, spectra: dict[bool, Spectrum], n: int) -> None:
        """Warn where the Gram's rounding, ``eps64 * Q`` with ``Q = sum ||x - r||^2`` around the reference point,
        exceeds the resolution ``d * eps64 * s_1^2`` that a Gram of rows near their reference has (README, "What it
        computes"): the rows lie far from the point their sums were taken around (a first batch far from the later
        ones, or float64 activations beyond float32's range, where the point is the origin). Singular values below
        about ``sqrt(eps64 * Q)`` can then be rounding noise (a bound: the rounding usually stays well below it)."""
        d, total = self.feature_sum.shape[-1], float(self.sum_squares)
        for centred, spec in spectra.items():
            top = float(spec.singular_values[0]) if spec.singular_values.numel() else math.nan
            if not (math.isfinite(top) and total > d * top * top):
                continue
            floor = math.sqrt(_EPS64 * total) / top
            variant = "centred" if centred else "uncentred"
            warnings.warn(
                f"ActivationSpectrum: the {variant} spectrum comes from sums around a point far from the activations "
                f"(the mean of the first batch): singular values below about {floor:.1e} * s_1 can be rounding noise, "
                f"more than the {math.sqrt(d * _EPS64):.1e} * s_1 of a float64 Gram; feed a first batch "
                "representative of the data",
                RuntimeWarning,
                stacklevel=3,
            )

    @property
    def _centers(self) -> list[bool]:
        return [c for c in (False, True) if self.center == "both" or self.center == c]

    def _reference_point(self) -> Tensor:
        return self.reference if self.reference.numel() else torch.zeros_like(self.feature_sum)

    def _gram_estimate(self, n: int) -> _Estimate:
        # Rows with labels went into the class Grams, the others into the Gram: their sum is the Gram of every row.
        shifted = symmetrize_lower(self.gram + self.class_grams.sum(dim=0) if self.uses_class_grams else self.gram)
        spectra = {}
        if True in self._centers:
            spectra[True] = spectrum_from_gram(shifted, n, feature_sum=self.feature_sum, center=True)
        if False in self._centers:
            plain = move_reference(self._reference_point(), n, self.feature_sum, shifted)[1]
            spectra[False] = spectrum_from_gram(plain, n)
        if not self.uses_class_grams:
            return _Estimate(spectra, n)
        return _Estimate(spectra, n, self._classwise_from_grams(), "class_gram")

    def _classwise_from_grams(self) -> Tensor:
        """The class-wise ``VR_k`` of the class Grams, a chunk of classes at a time: the full, moved Grams of every
        class at once are temporaries of several times the class Grams' size (8 GB beside the 2 GB of 1,000 class
        Grams of 512 x 512)."""
        d = self.class_grams.shape[-1]
        step = max(1, _CLASS_GRAM_CHUNK_VALUES // (d * d))
        parts = []
        for start in range(0, self.class_grams.shape[0], step):
            chunk = slice(start, start + step)
            counts, sums = self.class_counts[chunk], self.class_sums[chunk]
            grams = symmetrize_lower(self.class_grams[chunk])
            if not self.classwise_center:
                grams = move_reference(self._reference_point(), counts, sums, grams)[1]
            parts.append(
                classwise_variance_ratio_from_grams(
                    grams, counts, class_sums=sums, k=self.classwise_k, center=self.classwise_center
                )
            )
        return torch.cat(parts)

    def _sketch_estimate(self, n: int) -> _Estimate:
        spectra = {}
        if True in self._centers:
            sums = {"sketch_signs": self.sketch_signs, "feature_sum": self.feature_sum}
            spectra[True] = sketch_spectrum(self.sketch, n, center=True, **sums)
        if False in self._centers:
            plain = self.sketch + torch.outer(self.sketch_signs, self._reference_point())
            spectra[False] = sketch_spectrum(plain, n)
        occupied = int((self.sketch_rows > 0).sum())
        return _Estimate(spectra, n, spectrum_rows=occupied)

    def _subsample(self) -> Subsample:
        """The subsample of every streamed row (of every rank, once synced), rows in float64."""
        states = (self.sample_rows, self.sample_keys, self.sample_labels)
        # Synced, each state holds every rank's subsample back to back (up to fallback_size rows each); unsynced, a
        # list of one: the smallest keys overall form a uniform subsample of the union.
        sample = merge_subsamples(
            [Subsample(*(dim_zero_cat(s) if isinstance(s, list) else s for s in states))], capacity=self.fallback_size
        )
        real = torch.isfinite(sample.keys)  # padded token rows kept in place hold an infinite key
        if not bool(real.all()):
            sample = Subsample(sample.rows[real], sample.keys[real], sample.labels[real])
        return sample._replace(rows=sample.rows.to(torch.float64), labels=sample.labels.long())

    def _sample_estimate(self, n: int) -> _Estimate:
        sample = self._subsample()
        mean = self._reference_point() + self.feature_sum / n
        spectra = {c: subsample_spectrum(sample.rows, mean=mean if c else None) for c in self._centers}
        if not (self.num_classes and self.classwise and bool((sample.labels >= 0).any())):
            return _Estimate(spectra, sample.rows.shape[0])
        classwise = classwise_variance_ratio_from_sample(
            sample, self.num_classes, k=self.classwise_k, center=self.classwise_center
        )
        self._drop_undetermined_classes(classwise, sample.labels)
        return _Estimate(spectra, sample.rows.shape[0], classwise, "sample")

    def _drop_undetermined_classes(self, classwise: Tensor, sample_labels: Tensor) -> None:
        """NaN, with a warning naming them, for the classes whose subsampled rows fix their ``VR_k`` at 1 whatever
        the data (``k`` rows or fewer, ``k + 1`` centred) although they streamed more: a value of the subsample's
        size, not of the class."""
        labelled = sample_labels[sample_labels >= 0].to(self.class_counts.device)
        kept = class_counts(labelled, self.num_classes)
        fixed = (kept <= self.classwise_k + int(self.classwise_center)) & (kept < self.class_counts) & (kept > 0)
        undetermined = fixed.nonzero().squeeze(1).tolist()
        if not undetermined:
            return
        classwise[undetermined] = math.nan
        shown = ", ".join(map(str, undetermined[:10])) + (", ..." if len(undetermined) > 10 else "")
        rows = f"{self.classwise_k + int(self.classwise_center)} or fewer"
        warnings.warn(
            f"ActivationSpectrum: the class-wise variance ratio of {len(undetermined)} of {self.num_classes} classes "
            f"([{shown}]) is NaN: the {self.fallback_size}-row subsample of the 'sample_gram' path holds {rows} of "
            f"their rows, whose VR_{self.classwise_k} is 1 whatever the data; raise max_samples or memory_budget_mb",
            RuntimeWarning,
            stacklevel=4,
        )

    def _tcv(self, n: int) -> tuple[Tensor, Tensor] | None:
        """Total cluster variation, plain and normalised (Zangrando et al. Def. 3.2), from the streamed moments.

        The moments are those of ``x - r``; both variants are translation invariant, so no cancellation of the
        distance of the data from the origin enters.
        """
        labelled = int(self.class_counts.sum()) if self.num_classes else 0
        if labelled and labelled != n:
            # The sums of squares cover every row, the class sums only the labelled ones: TCV would be wrong.
            warnings.warn(
                f"ActivationSpectrum: {n - labelled} of {n} rows came without labels; the total cluster variation "
                "needs labels for every row and is not reported",
                RuntimeWarning,
                stacklevel=3,
            )
        if not labelled or labelled != n:
            return None
        moments = (self.sum_squares, self.class_sums, self.class_counts)
        tcv = tuple(total_cluster_variation_from_moments(*moments, normalized=norm) for norm in (False, True))
        # TCV = Q - sum_c ||S_c||^2 / n_c cancels down from Q = sum ||x - r||^2: its rounding is about eps64 * Q.
        q = float(self.sum_squares)
        warn_moment_rounding(
            "ActivationSpectrum: the total cluster variation",
            float(tcv[0]),
            moment_difference_error(q),
            how=f" is {q:.3e} (the sum of squares around the reference point) minus the classes' share",
            why=": the classes are tight compared with their distance from the reference point (the first batch's "
            "mean)",
            stacklevel=3,
        )
        return tcv

    def _nan_result(self, n: int) -> ActivationSpectrumResult:
        """Every metric NaN, shaped as a real result would be."""
        d = self._num_features or 0
        values = torch.full((max(1, min(n, d)),), math.nan, dtype=torch.float64)
        nan = torch.tensor(math.nan, dtype=torch.float64)
        classes = self.num_classes
        classwise = torch.full((classes,), math.nan, dtype=torch.float64) if classes and self.classwise else None
        estimate = _Estimate({c: Spectrum(values, max(n, 1), max(d, 1), c) for c in self._centers}, n, classwise)
        return self._result(estimate, tcv=(nan, nan) if classes else None, n=n)

    def _rank_tolerance(self, spec: Spectrum) -> float | None:
        """``rank_tolerance``, or the default for ``tolerance_dtype`` (``None``: float32; see
        :func:`~rank_lightning.functional.default_rank_tolerance`)."""
        if self.rank_tolerance is not None or self.tolerance_dtype is None:
            return self.rank_tolerance
        if self.tolerance_dtype == "input":
            # No floating batch seen: the float32 default.
            eps = float(self.input_eps) or None
        else:
            eps = torch.finfo(self.tolerance_dtype).eps
        size = self.tolerance_size
        return default_rank_tolerance(spec.num_samples, spec.num_features, tolerance_size=size, dtype_eps=eps)

    def _result(self, estimate: _Estimate, *, tcv: tuple[Tensor, Tensor] | None, n: int) -> ActivationSpectrumResult:
        summaries = {
            c: summarize(
                spec,
                rank_tolerance=self._rank_tolerance(spec),
                tolerance_size=self.tolerance_size,
                soft_rank_tau=self.soft_rank_tau,
                variance_ratio_ks=self.variance_ratio_ks,
                alpha_req_range=self.alpha_req_range,
            )
            for c, spec in estimate.spectra.items()
        }
        return ActivationSpectrumResult(
            uncentered=summaries.get(False),
            centered=summaries.get(True),
            total_cluster_variation=tcv[0] if tcv else None,
            total_cluster_variation_normalized=tcv[1] if tcv else None,
            classwise_variance_ratio=estimate.classwise,
            classwise_k=self.classwise_k,
            classwise_source=estimate.classwise_source,
            path=self.path or "gram",
            num_samples=n,
            num_features=self._num_features or 0,
            num_spectrum_samples=estimate.num_spectrum_samples,
            num_nonfinite_batches=int(self.num_nonfinite_batches),
            class_counts=self.class_counts.clone() if self.num_classes else None,
            spectrum_rows=estimate.spectrum_rows,
        )


def _kept(shapes: dict[str, tuple[int, ...]], fallback_size: int) -> str:
    """How a metric whose states have ``shapes`` keeps its rows, in words (for a refused merge)."""
    d, classes = shapes["feature_sum"][0], shapes["class_counts"][0]
    if shapes["gram"] != (0,):
        kept = "the exact Gram" + (" and per-class Grams" if shapes["class_grams"] != (0,) else "")
    elif shapes["sketch"] != (0,):
        kept = f"a sketch of {shapes['sketch'][0]} rows"
    else:
        kept = f"a subsample of {fallback_size} rows"
    return f"{kept} of {count_of(d, 'feature')} ({count_of(classes, 'class', 'classes')})"


def device_move_only(fn: Any) -> Any:
    """``fn`` (a function ``Module._apply`` maps over tensors) restricted to moving a tensor to its device: a tensor it
    would also convert to another dtype keeps its own (moved, never rounded through the other)."""

    def move(tensor: Tensor) -> Tensor:
        target = fn(tensor.new_empty(0))  # where and as what fn puts a tensor, at no cost
        return fn(tensor) if target.dtype == tensor.dtype else tensor.to(target.device)

    return move


def _continued_seed(generator: torch.Generator) -> int:
    """A seed drawn from ``generator``: a generator seeded with it goes on where ``generator`` stopped, with draws
    unrelated to those ``generator`` made so far (used when the metric's rows move to another device mid-stream)."""
    return int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device).item())


def _keeps_padded_rows(device: torch.device) -> bool:
    """Whether masked token rows stay in place, the padded ones counted out (:meth:`ActivationSpectrum._reduce`): off
    the CPU, where selecting the real rows would read their number back to the host."""
    return device.type != "cpu"


def _row_mean(rows: Tensor, real: Tensor | None) -> Tensor:
    """The float64 mean of the (real) rows, the first batch's reference point; NaN (then the origin) for none."""
    if real is None:
        return rows.mean(dim=0, dtype=torch.float64)
    total = rows.masked_fill(~real.unsqueeze(1), 0).sum(dim=0, dtype=torch.float64)
    return total / real.sum()


def _channel_mean(maps: Tensor) -> Tensor:
    """The float64 mean of every channel of ``(B, C, H, W)`` (or ``(B, C, D1, D2, D3)``) maps, the first batch's
    reference point.

    Each input's map is summed in (at least) float32 first, then the ``(B, C)`` sums in float64: a float64 mean over
    ``(0, 2, 3)`` converts every value and reduces across strides, 20-25x slower for 250 maps of 64 x 32 x 32 on a
    CPU. The point is rounded to float32 anyway (:func:`~rank_lightning.functional.streaming.reference_point`): the
    sums are exact around any point, and one near the data keeps them free of cancellation.
    """
    spatial = tuple(range(2, maps.ndim))
    sums = maps.sum(dim=spatial, dtype=torch.promote_types(maps.dtype, torch.float32))
    return sums.mean(dim=0, dtype=torch.float64) / math.prod(maps.shape[2:])
