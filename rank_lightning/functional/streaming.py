"""Streaming estimators of an activation spectrum: what one batch adds to running sums, and spectra from those sums.

A layer's ``(N, d)`` activation matrix ``X`` arrives in batches ``X_b``. Every quantity here is a sum over batches (or
a merge of per-batch pieces), so it adds across batches and DDP ranks and is exact for any N:

* first moments: row count ``N``, ``X^T 1``, ``||X||_F^2`` and per-class counts and sums (:func:`row_moments`);
* second moments: the feature Gram ``X^T X = sum_b X_b^T X_b``, or per-class Grams ``X_c^T X_c`` whose sum is
  ``X^T X`` (:func:`row_moments`, :func:`channel_gram_moments` for conv maps under the ``"channel"`` reduction);
* a uniform subsample of the rows by bottom-k random keys (:func:`subsample_update`, :func:`merge_subsamples`);
* a CountSketch ``Y = S X`` with ``E[Y^T Y] = X^T X`` (:func:`count_sketch`, :func:`sketch_spectrum`).

Functions return the batch's contribution; the caller adds it to its running sums. The one exception is the running
d x d Gram (or the C x d x d class Grams): the products are added into the given sums in place, because a returned
copy would cost one more pass over d^2 values per batch, which for fewer rows than features (N = 128, d = 2048) is as
much as the product itself.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from typing import NamedTuple

import torch
from torch import Tensor

from rank_lightning.functional.spectral import (
    Spectrum,
    classwise_variance_ratio,
    spectra_from_grams,
    spectrum_from_gram,
    variance_ratio,
)

__all__ = [
    "BatchMoments",
    "SketchUpdate",
    "Subsample",
    "channel_gram_moments",
    "channel_gram_pays",
    "classwise_variance_ratio_from_grams",
    "classwise_variance_ratio_from_sample",
    "count_sketch",
    "merge_subsamples",
    "row_moments",
    "sketch_spectrum",
    "subsample_spectrum",
    "subsample_update",
]

# Float64 blocks of about 2^18 values (2 MiB, maps and per-input Grams) stay in cache between the conversion and the
# product: 40% faster than 16 MiB blocks for 64 x 32 x 32 maps.
_BLOCK_VALUES = 1 << 18


class BatchMoments(NamedTuple):
    """First moments of one batch's rows: what the batch adds to the running counts and sums.

    Summed over batches they centre the Gram (``X^T X - s s^T / N`` with ``s = X^T 1``) and give the total cluster
    variation ``sum_i ||x_i||^2 - sum_c ||S_c||^2 / n_c`` (Zangrando et al. Def. 3.2, see
    :func:`~rank_lightning.functional.total_cluster_variation_from_moments`).

    Attributes:
        num_rows: rows in the batch (after the reduction).
        nonfinite: int64 scalar, 1 if the batch holds NaN or Inf, else 0 (a tensor, so no device sync).
        feature_sum: ``(d,)`` float64 ``X_b^T 1``.
        sum_squares: float64 scalar ``||X_b||_F^2 = sum_i ||x_i||^2``.
        class_counts: ``(C,)`` int64 rows per class; ``None`` without labels.
        class_sums: ``(C, d)`` float64 ``sum_{i in c} x_i``; ``None`` without labels.
    """

    num_rows: int
    nonfinite: Tensor
    feature_sum: Tensor
    sum_squares: Tensor
    class_counts: Tensor | None
    class_sums: Tensor | None


def _nonfinite(feature_sum: Tensor) -> Tensor:
    # A NaN or Inf anywhere in the batch shows in its column sums (float64 sums of float32 values cannot overflow).
    return (~torch.isfinite(feature_sum).all()).long()


def _class_moments(
    labels: Tensor | None, num_classes: int | None, sums: Tensor, repeats: int = 1
) -> tuple[Tensor | None, Tensor | None]:
    """Rows per class (each label counting ``repeats`` rows) and per-class sums of ``sums`` (one row per label)."""
    if labels is None or num_classes is None:
        return None, None
    counts = torch.bincount(labels, minlength=num_classes) * repeats
    class_sums = sums.new_zeros(num_classes, sums.shape[1]).index_add_(0, labels, sums)
    return counts, class_sums


def row_moments(
    rows: Tensor,
    labels: Tensor | None = None,
    *,
    num_classes: int | None = None,
    gram: Tensor | None = None,
    class_grams: Tensor | None = None,
) -> BatchMoments:
    """First moments of a batch of rows; with ``gram``, also adds the batch's Gram ``X_b^T X_b`` into it.

    With ``class_grams`` and labels, the rows of class ``c`` go into ``class_grams[c]`` (``X_c^T X_c``, the input of
    the class-wise variance ratio, Sanyal et al. Sec. 4.3) instead of ``gram``: since ``sum_c X_c^T X_c = X^T X``,
    the Gram of every row is ``gram + class_grams.sum(0)`` and the O(N d^2) product is paid once. Each class Gram
    is one matrix product on a contiguous block: rows whose labels are not sorted are first grouped by a stable
    sort, at the cost of one copy of the float64 rows (sorting the inputs before their reduction is cheaper).

    Args:
        rows: ``(N, d)`` float64 rows of the batch.
        labels: ``(N,)`` int64 class of each row, in ``[0, num_classes)``.
        num_classes: C; class counts and sums are returned when given together with ``labels``.
        gram: running ``(d, d)`` feature Gram, added into in place.
        class_grams: running ``(C, d, d)`` class Grams, added into in place (used only with ``labels``).

    Returns:
        The batch's :class:`BatchMoments`.
    """
    feature_sum = rows.sum(dim=0)
    counts, class_sums = _class_moments(labels, num_classes, rows)
    if class_grams is not None and labels is not None:
        _add_class_grams(class_grams, rows, labels)
    elif gram is not None:
        gram.addmm_(rows.T, rows)
    # The norm reduces without the N x d temporary of rows.square().
    sum_squares = torch.linalg.vector_norm(rows).square()
    return BatchMoments(rows.shape[0], _nonfinite(feature_sum), feature_sum, sum_squares, counts, class_sums)


def _add_class_grams(class_grams: Tensor, rows: Tensor, labels: Tensor) -> None:
    """``class_grams[c] += X_c^T X_c``, one matrix product per class on its rows made contiguous."""
    if labels.shape[0] > 1 and not bool((labels[1:] >= labels[:-1]).all()):
        labels, order = torch.sort(labels, stable=True)
        rows = rows.index_select(0, order)
    start = 0
    for c, count in enumerate(torch.bincount(labels, minlength=class_grams.shape[0]).tolist()):
        if count:
            block = rows[start : start + count]
            class_grams[c].addmm_(block.T, block)
            start += count


def channel_gram_pays(activations: Tensor, reduction: str) -> bool:
    """Whether :func:`channel_gram_moments` is the faster Gram route for this batch.

    True for conv maps ``(B, C, H, W)`` under the ``"channel"`` reduction unless the maps are much smaller than
    C x C (ResNet-18's 512 x 4 x 4 maps go through :func:`row_moments` on the reordered rows instead).
    """
    if reduction != "channel" or activations.ndim != 4:
        return False
    channels, height, width = activations.shape[1:]
    return 4 * height * width >= channels


def channel_gram_moments(
    maps: Tensor,
    labels: Tensor | None = None,
    *,
    num_classes: int | None = None,
    gram: Tensor,
    class_grams: Tensor | None = None,
) -> BatchMoments:
    """Moments of the ``"channel"`` reduction of conv maps (every position a sample) without reordering them.

    Input b contributes ``X_b X_b^T`` with ``X_b = maps[b]`` viewed as C x HW: the same feature Gram ``X^T X`` as the
    ``(B*H*W, C)`` rows of :func:`~rank_lightning.functional.reduce_activations`, without its transposing copy
    (which costs more than the product when the maps are large). The per-input Grams are computed in float64 blocks
    of about 2 MiB and summed into ``gram``, or with labels into their class Gram ``class_grams[y_b]``; every
    position inherits its input's label.

    Args:
        maps: ``(B, C, H, W)`` activations of any floating dtype.
        labels: ``(B,)`` int64 class of each input, in ``[0, num_classes)``.
        num_classes: C; class counts and sums are returned when given together with ``labels``.
        gram: running ``(C, C)`` feature Gram, added into in place.
        class_grams: running ``(num_classes, C, C)`` class Grams, added into in place (used only with ``labels``).

    Returns:
        The batch's :class:`BatchMoments` over its ``B*H*W`` rows.
    """
    batch, channels, height, width = maps.shape
    flat = maps.reshape(batch, channels, height * width)
    by_class = class_grams is not None and labels is not None
    step = max(1, _BLOCK_VALUES // (channels * max(channels, height * width)))
    # X^T 1 of each input; filled in place, since a list of small per-block tensors slows the loop down by a third.
    sums = torch.empty(batch, channels, dtype=torch.float64, device=maps.device)
    sum_squares = torch.zeros((), dtype=torch.float64, device=maps.device)
    for start in range(0, batch, step):
        block = flat[start : start + step].to(torch.float64)  # (b, C, HW)
        grams = torch.bmm(block, block.transpose(1, 2))  # (b, C, C)
        torch.sum(block, dim=2, out=sums[start : start + step])
        sum_squares += grams.diagonal(dim1=1, dim2=2).sum()
        if by_class:
            class_grams.index_add_(0, labels[start : start + step], grams)
        else:
            gram += grams.sum(dim=0)
    feature_sum = sums.sum(dim=0)
    counts, class_sums = _class_moments(labels, num_classes, sums, repeats=height * width)
    return BatchMoments(batch * height * width, _nonfinite(feature_sum), feature_sum, sum_squares, counts, class_sums)


class Subsample(NamedTuple):
    """A uniform subsample of streamed rows: the rows with the smallest of i.i.d. uniform keys (bottom-k sampling).

    Attributes:
        rows: ``(n, d)`` kept rows, float32 or float64.
        keys: ``(n,)`` float64 keys of the kept rows.
        labels: ``(n,)`` int64 labels of the kept rows, ``-1`` for a row streamed without one.
    """

    rows: Tensor
    keys: Tensor
    labels: Tensor


def subsample_update(
    sample: Subsample | None, rows: Tensor, keys: Tensor, labels: Tensor | None = None, *, capacity: int
) -> Subsample:
    """Add a batch to a bottom-k subsample: keep the ``capacity`` rows with the smallest keys seen so far.

    Bottom-k sampling (Cohen & Kaplan, 2007): with i.i.d. uniform keys, the rows holding the k smallest keys are a
    uniform sample without replacement of every row streamed, and the bottom-k of a union is the bottom-k of the
    parts' bottom-k: subsamples kept apart (per DDP rank) merge exactly with :func:`merge_subsamples`.

    Once the subsample is full, the evicted rows are overwritten in place rather than the whole subsample copied per
    batch: ``sample`` is consumed, use the returned one.

    Args:
        sample: the subsample so far (``None`` before the first batch).
        rows: ``(N, d)`` new rows of any floating dtype; kept in at least float32.
        keys: ``(N,)`` float64 i.i.d. uniform keys of the new rows.
        labels: ``(N,)`` int64 labels of the new rows; ``None`` stores ``-1``.
        capacity: the most rows kept.

    Returns:
        The updated :class:`Subsample`.
    """
    rows = rows.to(torch.promote_types(rows.dtype, torch.float32))
    if labels is None:
        labels = torch.full((rows.shape[0],), -1, dtype=torch.int64, device=rows.device)
    kept_rows, kept_keys, kept_labels = sample if sample is not None else (rows[:0], keys[:0], labels[:0])
    rows = rows.to(torch.promote_types(rows.dtype, kept_rows.dtype))
    kept_rows = kept_rows.to(rows.dtype)
    num_kept = kept_keys.shape[0]
    if num_kept + keys.shape[0] <= capacity:
        return Subsample(torch.cat([kept_rows, rows]), torch.cat([kept_keys, keys]), torch.cat([kept_labels, labels]))
    chosen = torch.zeros(num_kept + keys.shape[0], dtype=torch.bool, device=keys.device)
    chosen[torch.topk(torch.cat([kept_keys, keys]), capacity, largest=False).indices] = True
    entering = chosen[num_kept:].nonzero().squeeze(1)
    leaving = (~chosen[:num_kept]).nonzero().squeeze(1)
    if num_kept < capacity:
        # Still filling: the free slots after the kept rows take the newcomers that the evicted rows cannot.
        free = capacity - num_kept
        kept_rows = torch.cat([kept_rows, rows.new_empty(free, rows.shape[1])])
        kept_keys = torch.cat([kept_keys, keys.new_empty(free)])
        kept_labels = torch.cat([kept_labels, labels.new_empty(free)])
        leaving = torch.cat([leaving, torch.arange(num_kept, capacity, device=keys.device)])
    kept_rows[leaving] = rows[entering]
    kept_keys[leaving] = keys[entering]
    kept_labels[leaving] = labels[entering]
    return Subsample(kept_rows, kept_keys, kept_labels)


def merge_subsamples(samples: Sequence[Subsample], *, capacity: int) -> Subsample:
    """The bottom-k subsample of the union of several (per-rank) subsamples: the ``capacity`` smallest keys overall.

    Exact: it equals the subsample one stream of every row would have kept with the same keys.
    """
    rows, keys, labels = (torch.cat(parts) for parts in zip(*samples))
    if keys.shape[0] > capacity:
        index = torch.topk(keys, capacity, largest=False).indices
        rows, keys, labels = rows[index], keys[index], labels[index]
    return Subsample(rows, keys, labels)


def subsample_spectrum(rows: Tensor, *, mean: Tensor | None = None) -> Spectrum:
    """Spectrum of a row subsample through its n x n sample Gram ``X_s X_s^T``.

    Args:
        rows: ``(n, d)`` subsampled rows.
        mean: ``(d,)`` mean to subtract from every row, for the centred spectrum; the exact streamed mean
            ``X^T 1 / N`` centres a subsample better than the subsample's own mean.

    Returns:
        The :class:`Spectrum` of the n rows (``centered`` when ``mean`` is given).
    """
    rows = rows.to(torch.float64)
    centred = rows - mean if mean is not None else rows
    spec = spectrum_from_gram(centred @ centred.T, rows.shape[0], side="sample", num_features=rows.shape[1])
    return replace(spec, centered=mean is not None)


class SketchUpdate(NamedTuple):
    """A batch's CountSketch ``S_b X_b`` in coordinate form: row i adds ``rows[i]`` to sketch row ``buckets[i]``.

    Attributes:
        buckets: ``(N,)`` int64 bucket ``h(i)`` of each row.
        rows: ``(N, d)`` signed rows ``sigma_i x_i``.
        signs: ``(N,)`` float64 signs ``sigma_i``; summed per bucket they give ``S 1``, which centres the sketch.
    """

    buckets: Tensor
    rows: Tensor
    signs: Tensor


def count_sketch(rows: Tensor, num_buckets: int, generator: torch.Generator) -> SketchUpdate:
    """CountSketch of a batch of rows: every row goes with a random sign into a random one of ``num_buckets`` rows.

    ``Y = S X`` with ``S`` an m x N matrix holding one ``+-1`` per column (Clarkson & Woodruff, 2013); since
    ``E[S^T S] = I``, ``E[Y^T Y] = X^T X`` and the leading singular values of ``Y`` estimate those of ``X``.
    Sketches of batches (and ranks, with independent generators) add up to the sketch of all rows.

    Args:
        rows: ``(N, d)`` float64 rows.
        num_buckets: m, the rows of the sketch.
        generator: CPU generator of the buckets and signs.

    Returns:
        The batch's :class:`SketchUpdate`; ``sketch.index_add_(0, u.buckets, u.rows)`` adds it.
    """
    n = rows.shape[0]
    buckets = torch.randint(num_buckets, (n,), generator=generator).to(rows.device)
    signs = (torch.randint(2, (n,), generator=generator, dtype=torch.float64) * 2 - 1).to(rows.device)
    return SketchUpdate(buckets, rows * signs.unsqueeze(1), signs)


def sketch_spectrum(
    sketch: Tensor,
    num_samples: int,
    *,
    sketch_signs: Tensor | None = None,
    feature_sum: Tensor | None = None,
    center: bool = False,
) -> Spectrum:
    """Estimated spectrum of the N x d matrix ``X`` from its m x d CountSketch ``Y = S X``.

    Centring uses ``S (X - 1 mu^T) = Y - (S 1) mu^T``. The spectrum has ``min(N, d)`` values, those beyond the m
    that the sketch can resolve being 0: leading values are estimated well, the tail and the numerical rank are
    capped by m.

    Args:
        sketch: ``(m, d)`` sketch ``S X``.
        num_samples: N, rows sketched.
        sketch_signs: ``(m,)`` ``S 1``; required with ``center``.
        feature_sum: ``(d,)`` ``X^T 1``; required with ``center``.
        center: estimate the spectrum of ``X - 1 mu^T``.
    """
    y = sketch
    if center:
        if sketch_signs is None or feature_sum is None:
            raise ValueError("center=True needs sketch_signs (S 1) and feature_sum (X^T 1)")
        y = y - torch.outer(sketch_signs, feature_sum / num_samples)
    spec = spectrum_from_gram(y @ y.T, y.shape[0], side="sample", num_features=y.shape[1])
    length = min(num_samples, y.shape[1])
    values = spec.singular_values[:length]
    values = torch.cat([values, values.new_zeros(length - values.shape[0])])
    return Spectrum(values, num_samples, y.shape[1], center)


def classwise_variance_ratio_from_grams(
    class_grams: Tensor,
    class_counts: Tensor,
    *,
    class_sums: Tensor | None = None,
    k: int = 1,
    center: bool = False,
) -> Tensor:
    """``VR_k`` of each class (Sanyal et al. eq. 7, Sec. 4.3) from its Gram ``X_c^T X_c``, in one batched eigh.

    Args:
        class_grams: ``(C, d, d)`` class Grams.
        class_counts: ``(C,)`` rows per class.
        class_sums: ``(C, d)`` ``X_c^T 1``; required with ``center``.
        k: number of leading singular values.
        center: subtract each class's mean first (Sanyal et al. do not).

    Returns:
        float64 ``(C,)``; NaN for a class without rows.
    """
    out = torch.full((class_grams.shape[0],), math.nan, dtype=torch.float64, device=class_grams.device)
    counts = class_counts.tolist()
    present = [c for c, count in enumerate(counts) if count]
    if not present:
        return out
    grams, sums = class_grams, class_sums
    if len(present) < len(counts):
        index = torch.tensor(present, device=class_grams.device)
        grams = grams.index_select(0, index)
        sums = sums.index_select(0, index) if sums is not None else None
    spectra = spectra_from_grams(grams, [counts[c] for c in present], feature_sums=sums, center=center)
    for c, spec in zip(present, spectra):
        out[c] = variance_ratio(spec, k)
    return out


def classwise_variance_ratio_from_sample(
    sample: Subsample, num_classes: int, *, k: int = 1, center: bool = False
) -> Tensor:
    """``VR_k`` of each class (Sanyal et al. eq. 7, Sec. 4.3) from the labelled rows of a subsample.

    Rows without a label (``-1``) are left out; see :func:`~rank_lightning.functional.classwise_variance_ratio`.

    Returns:
        float64 ``(num_classes,)``; NaN for a class without subsampled rows.
    """
    labelled = sample.labels >= 0
    rows, labels = sample.rows[labelled].to(torch.float64), sample.labels[labelled]
    return classwise_variance_ratio(rows, labels, k=k, num_classes=num_classes, center=center)
