"""Neural collapse (Papyan, Han & Donoho 2020) and the class-distance normalised variance (Galanti et al. 2022) from
class sums, so that they stream and add across batches and DDP processes.

Notation (SPEC): features ``h_i`` (rows of an ``(N, d)`` matrix) with labels ``y_i``; the ``C`` classes present
(``n_c > 0``; a class without samples is left out of every metric, and ``C`` counts the classes present);
class means ``mu_c``; the global mean ``mu_G = sum_i h_i / N`` (over samples, so a class weighs by its size);
``M = [mu_c - mu_G]`` (``C x d`` here, rows); the within-class covariance
``Sigma_W = (1/N) sum_i (h_i - mu_{y_i})(h_i - mu_{y_i})^T`` and the between-class covariance
``Sigma_B = (1/C) sum_c (mu_c - mu_G)(mu_c - mu_G)^T = M^T M / C``.

Metrics (:class:`NeuralCollapse`):

* ``nc1 = Tr(Sigma_W Sigma_B^+) / C`` (Papyan et al., NC1, variability collapse): within-class variability relative
  to the spread of the means. ``Sigma_B^+`` only acts on the span of the centred means, so the trace needs only
  ``u_k^T Sigma_W u_k`` along the right singular vectors ``u_k`` of ``M`` (singular values ``s_k``):
  ``nc1 = sum_k u_k^T Sigma_W u_k / s_k^2``. This is what makes it cheap to stream: a pass that knows the means
  accumulates ``sum_i (u_k^T (h_i - mu_{y_i}))^2``, ``C`` numbers, instead of a ``d x d`` matrix.
* ``nc2_equinorm = std_c ||mu_c - mu_G|| / mean_c ||mu_c - mu_G||`` (Papyan et al., NC2, equinorm; ``std`` with
  Bessel's correction, ``torch.std``'s default);
* ``nc2_equiangularity = mean_{c != c'} |cos(mu_c - mu_G, mu_c' - mu_G) + 1/(C-1)|``, the deviation from the
  simplex angle (Papyan et al., NC2, "maximal-angle equiangularity");
* ``nc2_cosine_std = std_{c != c'} cos(mu_c - mu_G, mu_c' - mu_G)`` (Papyan et al., NC2, equal angles);
* ``nc3 = || W / ||W||_F - M / ||M||_F ||_F^2`` with the head's ``(C, d)`` weight ``W`` (Papyan et al., NC3,
  self-duality; the head's bias is not used);
* ``nc4``: the fraction of samples whose head prediction ``argmax_c (W h + b)_c`` equals the nearest class centre
  ``argmin_c ||h - mu_c||`` (Papyan et al., NC4, who plot the mismatch ``1 - nc4``); NaN when the class means do
  not span a direction (fewer than two classes, or all means equal up to rounding), where the nearest centre is
  decided by ties or rounding rather than by the features;
* ``cdnv = mean_{c < c'} (V_c + V_c') / (2 ||mu_c - mu_c'||^2)`` with ``V_c = mean_{i in c} ||h_i - mu_c||^2``
  (Galanti et al. 2022, the class-distance normalised variance, averaged over the pairs of classes).

Selected classes (``classes=`` of :func:`neural_collapse_from_residuals` and :func:`neural_collapse`, e.g. the
:func:`most_frequent_classes` of a vocabulary, Wu & Papyan 2024): the ``C x C`` objects (NC2's cosines, the CDNV's
pairs) of ``C = 50,257`` classes take 20 GB each. The metrics can cover ``K`` chosen classes instead: ``C = K``, ``N``,
``Sigma_W``, ``M``, the head's rows and NC4 are those of the samples of the chosen classes (NC4 with the head's
prediction among them), while ``mu_G`` stays the mean of every sample, so that a class's centred mean is the same
whichever classes are chosen. Choosing every class present gives the metrics of all of them.

Where rhubarbwu/neural-collapse (a reference implementation of these metrics) differs: its global mean defaults to the
unweighted mean of the class means (equal to ours for balanced classes); its ``simplex_etf_error`` and
``self_duality_error`` measure NC2 and NC3 as a Frobenius distance of the normalised ``M M^T`` (resp. ``W M^T``) from
the simplex-ETF Gram (Kothapalli 2023), not the quantities above; its ``distance_norms`` gives NC3 per class from
unit-normalised rows; its NC1 and CDNV match the definitions above.

Precision: the class means are computed in float64, but features computed in a coarser precision carry that
precision's rounding, which leaves the centred means ``M`` with tiny singular values along directions the classes
do not span; NC1 divides by ``s_k^2`` and would be dominated by them. :func:`between_class_directions` therefore drops
the singular values below a cut-off tied to the precision the features were computed in (the ``dtype`` argument of
the entry points; :func:`neural_collapse` takes the features' own dtype).

Entry points: :func:`neural_collapse` (raw features, the reference), :func:`neural_collapse_from_moments` (one pass
of first and second moments: class counts, class sums, the Gram ``X^T X = sum_c X_c^T X_c`` and the per-class
``sum ||h||^2``; no NC4, and ``Sigma_W`` comes from a difference of moments, which loses digits when the features
sit far from the origin compared with their spread) and :func:`neural_collapse_from_residuals` (two passes: the
class sums first, then the residuals around the class means, free of moment differences at any offset, and NC4).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from rank_lightning.functional.spectral import default_rank_tolerance, moment_difference_error, warn_moment_rounding
from rank_lightning.layers import class_labels
from rank_lightning.validation import check_choices, check_dtype, check_positive_int, check_real

__all__ = [
    "NC_METRICS",
    "BetweenClassDirections",
    "NeuralCollapse",
    "between_class_directions",
    "cdnv",
    "class_means",
    "class_rows",
    "class_scatter_from_moments",
    "most_frequent_classes",
    "nc1",
    "nc2",
    "nc3",
    "nearest_class_centre",
    "neural_collapse",
    "neural_collapse_from_moments",
    "neural_collapse_from_residuals",
    "residual_moments",
    "within_class_scatter_from_moments",
]

NC_METRICS: tuple[str, ...] = (
    "nc1",
    "nc2_equinorm",
    "nc2_equiangularity",
    "nc2_cosine_std",
    "nc3",
    "nc4",
    "cdnv",
)
"""The metrics of :class:`NeuralCollapse`, in the order they are logged."""


class NeuralCollapse(NamedTuple):
    """Neural-collapse metrics of one set of features (module docstring for the definitions).

    Attributes:
        nc1: ``Tr(Sigma_W Sigma_B^+) / C``.
        nc2_equinorm: coefficient of variation of the centred class-mean norms.
        nc2_equiangularity: mean ``|cos + 1/(C-1)|`` over pairs of centred class means.
        nc2_cosine_std: standard deviation of those cosines.
        nc3: ``||W/||W||_F - M/||M||_F||_F^2``; NaN without the head's weight.
        nc4: agreement of the head with the nearest-class-centre rule; NaN without predictions and when the
            class means span no direction.
        cdnv: class-distance normalised variance averaged over pairs of classes.
        num_classes: C, the classes with at least one sample.
        num_samples: N.
    """

    nc1: float
    nc2_equinorm: float
    nc2_equiangularity: float
    nc2_cosine_std: float
    nc3: float
    nc4: float
    cdnv: float
    num_classes: int
    num_samples: int

    def as_dict(self, metrics: Sequence[str] = NC_METRICS) -> dict[str, float]:
        """``metric -> value`` for the chosen ``metrics`` (names of :data:`NC_METRICS`), in that order.

        Raises:
            ValueError: an unknown or repeated metric; the message lists the valid ones.
        """
        return {metric: float(getattr(self, metric)) for metric in check_choices("metrics", metrics, NC_METRICS)}


class BetweenClassDirections(NamedTuple):
    """The span of the centred class means: ``M = A diag(s) U^T`` (thin SVD), directions with ``s_k > 0``.

    Attributes:
        directions: ``(d, r)`` orthonormal columns ``u_k``, ``r <= C``.
        singular_values: ``(r,)`` the ``s_k``; the non-zero eigenvalues of ``Sigma_B`` are ``s_k^2 / C``.
    """

    directions: Tensor
    singular_values: Tensor


def _check_counts(class_counts: Tensor, class_sums: Tensor) -> None:
    if class_counts.ndim != 1 or class_sums.ndim != 2 or class_sums.shape[0] != class_counts.shape[0]:
        raise ValueError(
            f"class_counts must be (C,) and class_sums (C, d), got {tuple(class_counts.shape)} and "
            f"{tuple(class_sums.shape)}"
        )


def class_means(
    class_counts: Tensor, class_sums: Tensor, *, classes: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """Means of the classes present (among ``classes``, if given) and the global mean, in float64.

    Args:
        class_counts: ``(C,)`` samples per class.
        class_sums: ``(C, d)`` ``sum_{i in c} h_i``.
        classes: the class indices the metrics cover (:func:`most_frequent_classes`); ``None`` for all. The global
            mean is over the samples of every class either way.

    Returns:
        ``(present, means, global_mean)``: the ``(C',)`` indices of the (selected) classes with samples, their
        ``(C', d)`` means, and the ``(d,)`` mean over all samples (NaN features give NaN means, and every metric NaN).
    """
    _check_counts(class_counts, class_sums)
    counts = class_counts.to(torch.float64)
    has_samples = counts > 0
    if classes is not None:
        has_samples &= torch.isin(torch.arange(counts.shape[0], device=counts.device), classes.to(counts.device))
    present = has_samples.nonzero().squeeze(1)
    sums = class_sums.to(torch.float64)
    means = sums[present] / counts[present].unsqueeze(1)
    global_mean = sums.sum(dim=0) / counts.sum().clamp_min(1)
    return present, means, global_mean


def most_frequent_classes(class_counts: Tensor, top_classes: int) -> Tensor:
    """The ``top_classes`` classes with the most samples, in increasing class order (``(K,)`` int64).

    Ties go to the smaller class index, so every process, given the same all-reduced counts, selects the same classes.
    Classes without samples are never selected: with fewer than ``top_classes`` classes present, all of them are.
    """
    check_positive_int("top_classes", top_classes)
    counts = class_counts.to(torch.int64)
    order = torch.sort(-counts, stable=True).indices[: min(top_classes, counts.shape[0])]
    return order[counts[order] > 0].sort().values


def _dtype_eps(dtype: torch.dtype | None) -> float:
    """``finfo(dtype).eps`` of a floating dtype; float64's for ``None`` and for integer or boolean data (exact)."""
    if dtype is None or not dtype.is_floating_point:
        return float(torch.finfo(torch.float64).eps)
    return float(torch.finfo(dtype).eps)


def between_class_directions(
    means: Tensor, global_mean: Tensor, *, dtype: torch.dtype | None = None, counts: Tensor | None = None
) -> BetweenClassDirections:
    """Orthonormal directions of ``span{mu_c - mu_G}`` and the singular values of ``M`` along them.

    Singular values at or below ``tol * max(s_1, max_c ||mu_c||)`` are rounding and are dropped. ``tol`` is the
    package's numerical-rank tolerance for a ``C x d`` matrix with ``K = max(C, d)``
    (:func:`~rank_lightning.functional.spectral.default_rank_tolerance` with ``tolerance_size="max"`` and
    ``dtype_eps = finfo(dtype).eps``):

    * features computed in float64 (``dtype=None``, float64, or integers): ``max(C, d) * eps_float64``, the
      pseudo-inverse's cut-off (NumPy's ``pinv`` uses ``max(C, d) * eps * s_1``);
    * float32: ``max(C, d) * eps_float32``. The means are accumulated in float64, but the features carry float32
      rounding, which leaves singular values near ``1e-9 s_1`` along directions the classes do not span; a float64
      cut-off would keep them, and ``1 / s_k^2`` in NC1 would let them dominate;
    * coarser (bfloat16, float16): ``max(max(C, d) * eps_float32, eps_dtype / sqrt(n_min))``, ``n_min`` the
      smallest class (``counts``; 1 without them). A class mean averages ``n_c`` roundings of relative size
      ``eps_dtype``, which the spread of the features within the class makes independent: its error, and the
      singular values it leaves along directions the classes do not span, are of order ``eps_dtype / sqrt(n_c)``
      (measured: 1.2e-4 of the scale for 50 bf16 rows per class, against a cut-off of 1.1e-3). Without that spread
      (rows equal within each class) the error does not average out, but the within-class covariance along such a
      direction is then zero too, so it adds nothing to NC1. The whole ``eps_dtype`` would drop real directions:
      bf16 features 5 away from the origin, in classes of 2000 rows whose means spread over 1e-3 of that, lost
      every direction (NC1 NaN).

    The scale is raised from ``s_1`` to the size of the uncentred means, since means computed far from the origin
    carry an absolute error of about ``eps * ||mu_c||`` that centring cannot remove (``sum_c n_c (mu_c - mu_G) = 0``
    makes ``M`` rank-deficient, and the missing direction would come back as rounding, scaled up by ``1 / s_k^2`` in
    NC1).

    Args:
        means: ``(C, d)`` class means.
        global_mean: ``(d,)`` mean over all samples.
        dtype: the dtype the features were computed in (before any conversion to float64); ``None`` for float64.
        counts: the rows of each class in ``means`` (bfloat16 and float16 only).

    Raises:
        ValueError: ``dtype`` is neither ``None`` nor a ``torch.dtype`` (a dtype name such as ``"float64"``).
    """
    check_dtype("dtype", dtype)
    centred = means - global_mean  # (C, d)
    if not bool(torch.isfinite(centred).all()):
        empty = centred.new_zeros(centred.shape[1], 0)
        return BetweenClassDirections(empty, centred.new_zeros(0))
    _, s, vh = torch.linalg.svd(centred, full_matrices=False)
    scale = max(float(s[0]), float(means.norm(dim=1).max())) if s.numel() else 0.0
    eps = _dtype_eps(dtype)
    if eps > torch.finfo(torch.float32).eps:
        smallest = max(int(counts.min()), 1) if counts is not None and counts.numel() else 1
        eps /= math.sqrt(smallest)
    tolerance = default_rank_tolerance(*centred.shape, tolerance_size="max", dtype_eps=eps)
    keep = s > tolerance * scale
    return BetweenClassDirections(vh[keep].T.contiguous(), s[keep])


def _nc1_from_projection(projected_covariance: Tensor, singular_values: Tensor) -> float:
    """``sum_k u_k^T Sigma_W u_k / s_k^2`` (see the module docstring)."""
    if singular_values.numel() == 0:
        return math.nan
    return float((projected_covariance / singular_values.square()).sum())


def nc1(
    within_covariance: Tensor,
    means: Tensor,
    global_mean: Tensor,
    *,
    dtype: torch.dtype | None = None,
    counts: Tensor | None = None,
) -> float:
    """``Tr(Sigma_W Sigma_B^+) / C`` (Papyan et al. 2020) from a ``(d, d)`` within-class covariance.

    Args:
        within_covariance: ``Sigma_W``, ``(d, d)``.
        means: ``(C, d)`` class means.
        global_mean: ``(d,)`` mean over all samples.
        dtype: the dtype the features were computed in, which sets the cut-off of ``Sigma_B^+``
            (:func:`between_class_directions`); ``None`` for float64.
        counts: the rows of each class, for bfloat16 and float16 features (:func:`between_class_directions`).

    Returns:
        NC1; NaN when all class means coincide (``Sigma_B = 0``).
    """
    basis = between_class_directions(means, global_mean, dtype=dtype, counts=counts)
    u = basis.directions
    projected = ((within_covariance.to(torch.float64) @ u) * u).sum(dim=0)  # u_k^T Sigma_W u_k
    return _nc1_from_projection(projected, basis.singular_values)


def nc2(means: Tensor, global_mean: Tensor) -> tuple[float, float, float]:
    """``(equinorm, equiangularity, cosine_std)`` of the centred class means (Papyan et al. 2020, NC2).

    Returns:
        NaN where undefined: fewer than two classes, or a class mean equal to the global mean (no direction).
    """
    centred = means - global_mean
    classes = centred.shape[0]
    if classes < 2:
        return math.nan, math.nan, math.nan
    norms = centred.norm(dim=1)
    equinorm = float(norms.std() / norms.mean())
    if bool((norms == 0).any()):
        return equinorm, math.nan, math.nan
    unit = centred / norms.unsqueeze(1)
    off_diagonal = ~torch.eye(classes, dtype=torch.bool, device=means.device)
    cosines = (unit @ unit.T)[off_diagonal]
    equiangularity = float((cosines + 1 / (classes - 1)).abs().mean())
    cosine_std = float(cosines.std()) if cosines.numel() > 1 else 0.0
    return equinorm, equiangularity, cosine_std


def nc3(head_weight: Tensor, means: Tensor, global_mean: Tensor) -> float:
    """Self-duality ``||W/||W||_F - M/||M||_F||_F^2`` (Papyan et al. 2020, NC3); NaN without a class mean.

    Args:
        head_weight: ``(C, d)`` classifier weight, rows in the order of ``means``.
        means: ``(C, d)`` class means.
        global_mean: ``(d,)`` mean over all samples.
    """
    if head_weight.shape != means.shape:
        raise ValueError(
            f"head_weight must have the shape of the class means {tuple(means.shape)}, got {tuple(head_weight.shape)}"
        )
    if means.shape[0] == 0:  # no class mean to compare the head with (an empty sum would give 0.0)
        return math.nan
    w = head_weight.detach().to(torch.float64)
    centred = means - global_mean
    return float((w / w.norm() - centred / centred.norm()).square().sum())


def nearest_class_centre(features: Tensor, means: Tensor) -> Tensor:
    """Index (into the rows of ``means``) of the nearest class mean of every row of ``features``, in float64.

    Distances are computed directly, not through ``||h||^2 - 2 h.mu + ||mu||^2``, which cancels when the features sit
    far from the origin.
    """
    x = features.detach().to(torch.float64)
    distances = torch.cdist(x, means.to(x.device), compute_mode="donot_use_mm_for_euclid_dist")
    return distances.argmin(dim=1)


def cdnv(means: Tensor, variances: Tensor) -> float:
    """``mean_{c < c'} (V_c + V_c') / (2 ||mu_c - mu_c'||^2)`` (Galanti et al. 2022).

    Args:
        means: ``(C, d)`` class means.
        variances: ``(C,)`` ``V_c = mean_{i in c} ||h_i - mu_c||^2``.

    Returns:
        The mean over pairs; NaN with fewer than two classes, Inf when two class means coincide.
    """
    classes = means.shape[0]
    if classes < 2:
        return math.nan
    i, j, distance = _pair_distances(means)
    return float(((variances[i] + variances[j]) / (2 * distance)).mean())


def _pair_distances(means: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(i, j, ||mu_i - mu_j||^2)`` over the pairs ``i < j`` of the rows of ``means``.

    From the ``(C, C)`` distances of :func:`torch.cdist`, formed from the differences directly (no
    ``||mu||^2 - 2 mu.mu' + ||mu'||^2``, which cancels for means far from the origin): the ``(C (C - 1) / 2, d)``
    differences of every pair at once are 8 GB of float64 for 1,000 classes of 2,048 features.
    """
    classes = means.shape[0]
    i, j = torch.triu_indices(classes, classes, offset=1, device=means.device)
    distances = torch.cdist(means, means, compute_mode="donot_use_mm_for_euclid_dist")
    return i, j, distances[i, j].square()


def within_class_scatter_from_moments(gram: Tensor, class_counts: Tensor, class_sums: Tensor) -> Tensor:
    """``sum_i (h_i - mu_{y_i})(h_i - mu_{y_i})^T = X^T X - sum_c S_c S_c^T / n_c`` (``N Sigma_W``) from moments.

    Args:
        gram: ``(d, d)`` ``X^T X``, the sum of the class Grams ``X_c^T X_c``.
        class_counts: ``(C,)`` samples per class.
        class_sums: ``(C, d)`` class sums ``S_c``.
    """
    _check_counts(class_counts, class_sums)
    counts = class_counts.to(torch.float64)
    sums = class_sums.to(torch.float64)[counts > 0]
    return gram.to(torch.float64) - sums.T @ (sums / counts[counts > 0].unsqueeze(1))


def class_scatter_from_moments(class_sum_squares: Tensor, class_counts: Tensor, class_sums: Tensor) -> Tensor:
    """``sum_{i in c} ||h_i - mu_c||^2 = sum_{i in c} ||h_i||^2 - ||S_c||^2 / n_c`` per class (0 without samples).

    Args:
        class_sum_squares: ``(C,)`` ``sum_{i in c} ||h_i||^2`` (the traces of the class Grams).
        class_counts: ``(C,)`` samples per class.
        class_sums: ``(C, d)`` class sums ``S_c``.
    """
    _check_counts(class_counts, class_sums)
    counts = class_counts.to(torch.float64).clamp_min(1)
    scatter = class_sum_squares.to(torch.float64) - class_sums.to(torch.float64).square().sum(dim=1) / counts
    return scatter.clamp_min(0)


def class_rows(present: Tensor, num_classes: int) -> Tensor:
    """``(num_classes,)`` int64: the row of each class among the means of the classes ``present``, -1 for the others
    (on ``present``'s device)."""
    row_of = torch.full((num_classes,), -1, dtype=torch.long, device=present.device)
    row_of[present] = torch.arange(present.shape[0], device=present.device)
    return row_of


def residual_moments(
    features: Tensor,
    labels: Tensor,
    means: Tensor,
    present: Tensor,
    directions: Tensor,
    num_classes: int,
    *,
    check: bool = True,
    row_mask: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """What one batch adds in the second pass: residuals ``r_i = h_i - mu_{y_i}`` around known class means.

    Args:
        features: ``(B, d)`` features.
        labels: ``(B,)`` labels in ``[0, num_classes)``.
        means: ``(C', d)`` means of the classes ``present``.
        present: ``(C',)`` class indices of the rows of ``means``.
        directions: ``(d, r)`` :attr:`BetweenClassDirections.directions`.
        num_classes: C, the length of the per-class output.
        check: raise for a label of a class not ``present`` (a read from the device); ``False`` for a caller whose
            rows of the other classes (classes not selected, :func:`class_means`) are to add nothing.
        row_mask: ``(B,)`` booleans: only the rows where it is true are counted (the others add zeros, whatever they
            hold), e.g. the real, labelled tokens of a padded batch.

    Returns:
        ``(projected, class_scatter)``: ``(r,)`` ``sum_i (u_k^T r_i)^2`` and ``(num_classes,)``
        ``sum_{i in c} ||r_i||^2``, both float64.
    """
    labels = labels.to(means.device)
    rows = class_rows(present.to(means.device), num_classes)[labels]
    counted = rows >= 0 if row_mask is None else (rows >= 0) & row_mask.to(means.device)
    if check:
        missing = rows < 0 if row_mask is None else (rows < 0) & row_mask.to(means.device)
        if bool(missing.any()):
            absent = sorted(set(labels[missing].tolist()))
            raise ValueError(f"labels {absent} belong to classes that had no sample when the means were computed")
    residuals = features.detach().to(torch.float64) - means[rows.clamp_min(0)]
    residuals = residuals.masked_fill(~counted.unsqueeze(1), 0)
    projected = (residuals @ directions).square().sum(dim=0)
    scatter = torch.zeros(num_classes, dtype=torch.float64, device=means.device)
    scatter.index_add_(0, labels, residuals.square().sum(dim=1))
    return projected, scatter


def _head_rows(head_weight: Tensor | None, present: Tensor, num_classes: int) -> Tensor | None:
    if head_weight is None:
        return None
    check_real("head_weight", head_weight)
    if head_weight.ndim != 2 or head_weight.shape[0] != num_classes:
        raise ValueError(f"head_weight must be (C={num_classes}, d), got {tuple(head_weight.shape)}")
    return head_weight.detach().to(torch.float64)[present.to(head_weight.device)].to(present.device)


def _assemble(
    means: Tensor,
    global_mean: Tensor,
    projected_covariance: Tensor,
    basis: BetweenClassDirections,
    variances: Tensor,
    head_weight: Tensor | None,
    nc4: float,
    num_samples: int,
) -> NeuralCollapse:
    if not bool(torch.isfinite(means).all()):
        # Non-finite features: every metric is NaN (NC4 too, since distances to NaN means decide nothing).
        return NeuralCollapse(*([math.nan] * len(NC_METRICS)), num_classes=means.shape[0], num_samples=num_samples)
    if basis.singular_values.numel() == 0:
        # The means span no direction: the nearest centre is decided by ties (argmin takes the first) or rounding.
        nc4 = math.nan
    equinorm, equiangularity, cosine_std = nc2(means, global_mean)
    return NeuralCollapse(
        nc1=_nc1_from_projection(projected_covariance, basis.singular_values),
        nc2_equinorm=equinorm,
        nc2_equiangularity=equiangularity,
        nc2_cosine_std=cosine_std,
        nc3=math.nan if head_weight is None else nc3(head_weight, means, global_mean),
        nc4=nc4,
        cdnv=cdnv(means, variances),
        num_classes=means.shape[0],
        num_samples=num_samples,
    )


def neural_collapse_from_residuals(
    class_counts: Tensor,
    class_sums: Tensor,
    projected_scatter: Tensor,
    class_scatter: Tensor,
    *,
    head_weight: Tensor | None = None,
    agreements: int | Tensor | None = None,
    dtype: torch.dtype | None = None,
    classes: Tensor | None = None,
) -> NeuralCollapse:
    """Neural collapse from two streamed passes: class sums, then residuals around the class means.

    Pass one sums ``class_counts`` and ``class_sums``; from them :func:`class_means` and
    :func:`between_class_directions` give the means and the directions ``u_k``, and pass two sums
    :func:`residual_moments` (and the NC4 agreements). Every input is a sum, so the result is exact for any number of
    batches and processes, and no moment difference loses digits. What is left is the rounding of the float64 class
    means, about ``eps_float64 * ||mu_c||``: it moves NC1 and the CDNV by about ``(eps_float64 * ||mu_c|| / spread)^2``
    relative, and a ``RuntimeWarning`` names the statistic and the size of its possible error when that can exceed
    1e-6 (classes some 1e-13 as wide as their distance from the origin).

    Args:
        class_counts: ``(C,)`` samples per class.
        class_sums: ``(C, d)`` class sums.
        projected_scatter: ``(r,)`` or longer (zero-padded) ``sum_i (u_k^T r_i)^2`` along the directions of
            :func:`between_class_directions` of these means.
        class_scatter: ``(C,)`` ``sum_{i in c} ||h_i - mu_c||^2``.
        head_weight: the head's ``(C, d)`` weight, for NC3.
        agreements: samples whose head prediction equals the nearest class centre, for NC4.
        dtype: the dtype the features were computed in (:func:`between_class_directions`); ``None`` for float64.
            Pass two must have used the directions of the same ``dtype``.
        classes: the classes the metrics cover (:func:`most_frequent_classes`); ``None`` for all. ``mu_G`` stays
            the mean of every sample; ``C``, ``N``, ``Sigma_W``, ``M``, the head's rows and the NC4 agreements are
            those of the selected classes' samples, and pass two must have used the directions of their means.
    """
    present, means, global_mean = class_means(class_counts, class_sums, classes=classes)
    basis = between_class_directions(means, global_mean, dtype=dtype, counts=class_counts[present])
    num_samples = int(class_counts[present].sum())
    rank = basis.singular_values.shape[0]
    projected = projected_scatter.to(torch.float64)[:rank] / max(num_samples, 1)
    counts = class_counts.to(torch.float64)[present]
    variances = class_scatter.to(torch.float64)[present] / counts
    agree = math.nan if agreements is None else float(agreements) / max(num_samples, 1)
    head = _head_rows(head_weight, present, class_counts.shape[0])
    result = _assemble(means, global_mean, projected, basis, variances, head, agree, num_samples)
    # The residuals are exact around the means as computed, but a mean summed from n_c rows in float64 is off by up to
    # about sqrt(n_c) eps64 ||mu_c|| (measured: less), which adds n_c ||delta_c||^2 to the class scatter: nothing for
    # features of any offset in float32, the whole scatter for classes 1e-14 as wide as their distance from the origin.
    eps = _dtype_eps(None)
    scatter_errors = counts.pow(1.5) * (eps * means.norm(dim=1)).square()
    _warn_rounding(
        result,
        "neural collapse",
        scatter_errors,
        float(scatter_errors.sum()),
        means,
        basis,
        how=" comes from residuals around class means that float64 sums round to about eps_float64 * ||mu_c||",
        why=": the classes are tight compared with their distance from the origin",
    )
    return result


def neural_collapse_from_moments(
    class_counts: Tensor,
    class_sums: Tensor,
    *,
    gram: Tensor,
    class_sum_squares: Tensor,
    head_weight: Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> NeuralCollapse:
    """Neural collapse (NC1-NC3, CDNV) from one pass of moments; NC4 needs the means first and is NaN.

    ``Sigma_W`` is :func:`within_class_scatter_from_moments` ``/ N`` and ``V_c`` is
    :func:`class_scatter_from_moments` ``/ n_c``: differences of moments, which lose about
    ``log10(||mu||^2 / spread^2)`` digits when the features sit far from the origin;
    :func:`neural_collapse_from_residuals` does not. A ``RuntimeWarning`` names NC1 or the CDNV, with the size of its
    possible error, when that rounding (about ``eps_float64 * sum_i ||h_i||^2`` for ``N Sigma_W`` along a direction,
    ``eps_float64 * sum_{i in c} ||h_i||^2`` for a class scatter) can exceed 1e-6 of its value.

    Args:
        class_counts: ``(C,)`` samples per class.
        class_sums: ``(C, d)`` class sums.
        gram: ``(d, d)`` ``X^T X`` (the sum of the class Grams).
        class_sum_squares: ``(C,)`` ``sum_{i in c} ||h_i||^2`` (the traces of the class Grams).
        head_weight: the head's ``(C, d)`` weight, for NC3.
        dtype: the dtype the features were computed in (:func:`between_class_directions`); ``None`` for float64.
    """
    present, means, global_mean = class_means(class_counts, class_sums)
    num_samples = int(class_counts.sum())
    within = within_class_scatter_from_moments(gram, class_counts, class_sums) / max(num_samples, 1)
    basis = between_class_directions(means, global_mean, dtype=dtype, counts=class_counts[present])
    u = basis.directions
    projected = ((within @ u) * u).sum(dim=0)
    scatter = class_scatter_from_moments(class_sum_squares, class_counts, class_sums)[present]
    variances = scatter / class_counts.to(torch.float64)[present]
    head = _head_rows(head_weight, present, class_counts.shape[0])
    result = _assemble(means, global_mean, projected, basis, variances, head, math.nan, num_samples)
    # u_k^T (X^T X - sum_c S_c S_c^T / n_c) u_k carries about eps64 * sum_i ||h_i||^2, and the class scatter
    # sum_{i in c} ||h_i||^2 - ||S_c||^2 / n_c about eps64 * sum_{i in c} ||h_i||^2: a V_c error of that over n_c.
    scatter_errors = moment_difference_error(class_sum_squares.to(torch.float64))
    _warn_rounding(
        result,
        "neural_collapse_from_moments",
        scatter_errors[present.to(scatter_errors.device)],
        moment_difference_error(float(gram.to(torch.float64).diagonal().sum())),
        means,
        basis,
        how=" comes from moment differences (X^T X - sum_c S_c S_c^T / n_c)",
        why=": the classes are tight compared with their distance from the origin; neural_collapse_from_residuals "
        "(two passes, NeuralCollapseStatistics) does not lose these digits",
    )
    return result


def _warn_rounding(
    result: NeuralCollapse,
    source: str,
    scatter_errors: Tensor,
    projected_error: float,
    means: Tensor,
    basis: BetweenClassDirections,
    *,
    how: str,
    why: str,
) -> None:
    """Warn for NC1 and the CDNV when the rounding of the sums behind them can exceed 1e-6 of their value (the rule of
    the streamed total cluster variation, :func:`~rank_lightning.functional.spectral.warn_moment_rounding`).

    Args:
        result: the metrics.
        source: the route, which starts the message.
        scatter_errors: ``(C,)`` the possible error of each class scatter ``sum_{i in c} ||h_i - mu_c||^2``.
        projected_error: that of ``N u_k^T Sigma_W u_k`` along any direction.
        means: ``(C, d)`` the class means.
        basis: the directions of NC1.
        how: how the statistics were taken, after their value in the message.
        why: the cause, at the end of the message.
    """
    counts_sum = max(result.num_samples, 1)
    if basis.singular_values.numel():
        nc1_error = projected_error / counts_sum * float(basis.singular_values.square().reciprocal().sum())
        warn_moment_rounding(f"{source}: NC1", result.nc1, nc1_error, how=how, why=why, stacklevel=3)
    classes = means.shape[0]
    if classes >= 2:
        i, j, distance = _pair_distances(means)
        errors = scatter_errors.to(means.device, torch.float64)
        cdnv_error = float(((errors[i] + errors[j]) / (2 * distance)).mean())
        warn_moment_rounding(f"{source}: CDNV", result.cdnv, cdnv_error, how=how, why=why, stacklevel=3)


def neural_collapse(
    features: Tensor,
    labels: Tensor,
    *,
    num_classes: int | None = None,
    head_weight: Tensor | None = None,
    predictions: Tensor | None = None,
    classes: Tensor | Sequence[int] | None = None,
) -> NeuralCollapse:
    """Neural collapse of a feature matrix held in memory (the two-pass computation on all rows at once).

    The cut-off of the between-class directions follows ``features.dtype`` (:func:`between_class_directions`): pass
    the features in the precision they were computed in, not converted to float64.

    Args:
        features: ``(N, d)`` features (the head's input).
        labels: ``(N,)`` integer labels in ``[0, num_classes)``.
        num_classes: C; defaults to ``labels.max() + 1``.
        head_weight: the head's ``(C, d)`` weight, for NC3.
        predictions: ``(N,)`` the head's predicted classes, for NC4 (with ``classes``, its prediction among them).
        classes: the classes the metrics cover (:func:`neural_collapse_from_residuals`); ``None`` for all.
    """
    if features.ndim != 2 or not isinstance(labels, Tensor) or labels.ndim not in (1, 2):
        shape = tuple(labels.shape) if isinstance(labels, Tensor) else type(labels).__name__
        raise ValueError(f"features must be (N, d) and labels (N,), got {tuple(features.shape)} and {shape}")
    check_real("features", features)
    # The forms every class-aware part takes: a (B, 1) column, booleans, one-hot rows as their argmax.
    labels = class_labels(labels, features.shape[0]).to(features.device)
    if labels.numel() and int(labels.min()) < 0:
        raise ValueError("labels must be non-negative integer class indices")
    check_positive_int("num_classes", num_classes, allow_none=True)
    total = int(labels.max()) + 1 if num_classes is None else num_classes
    if labels.numel() and int(labels.max()) >= total:
        raise ValueError(f"label {int(labels.max())} is out of range for num_classes={total}")
    selected = None if classes is None else torch.as_tensor(classes, dtype=torch.long)
    x = features.detach().to(torch.float64)
    counts = torch.bincount(labels, minlength=total)
    sums = x.new_zeros(total, x.shape[1]).index_add_(0, labels, x)
    present, means, global_mean = class_means(counts, sums, classes=selected)
    basis = between_class_directions(means, global_mean, dtype=features.dtype, counts=counts[present])
    check = selected is None
    projected, scatter = residual_moments(x, labels, means, present, basis.directions, total, check=check)
    agreements = None
    if predictions is not None:
        if predictions.shape != labels.shape:
            raise ValueError(f"predictions must be (N,) = {tuple(labels.shape)}, got {tuple(predictions.shape)}")
        nearest = present[nearest_class_centre(x, means)]
        counted = torch.isin(labels, present)
        agreements = int(((nearest == predictions.to(nearest.device)) & counted).sum())
    return neural_collapse_from_residuals(
        counts,
        sums,
        projected,
        scatter,
        head_weight=head_weight,
        agreements=agreements,
        dtype=features.dtype,
        classes=selected,
    )
