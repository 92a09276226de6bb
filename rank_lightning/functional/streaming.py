"""Streaming estimators of an activation spectrum: what one batch adds to running sums, and spectra from those sums.

A layer's ``(N, d)`` activation matrix ``X`` arrives in batches ``X_b``. Every quantity here is a sum over batches (or
a merge of per-batch pieces), so it adds across batches and DDP ranks and is exact for any N:

* first moments: row count ``N``, ``X^T 1``, ``||X||_F^2`` and per-class counts and sums (:func:`row_moments`);
* second moments: the feature Gram ``X^T X = sum_b X_b^T X_b``, or per-class Grams ``X_c^T X_c`` whose sum is
  ``X^T X`` (:func:`row_moments`, :func:`channel_gram_moments` for conv maps under the ``"channel"`` reduction);
* a uniform subsample of the rows by bottom-k random keys (:func:`subsample_update`, :func:`merge_subsamples`);
* a CountSketch ``Y = S X`` with ``E[Y^T Y] = X^T X`` (:func:`count_sketch`, :func:`sketch_spectrum`).

Moments are taken around a reference point ``r`` (the streaming metric uses its first batch's mean): the sums of
``x - r`` instead of ``x``. Activations far from the origin compared with their spread (an offset of ``1e6`` and a
spread of ``0.1``) would otherwise cancel catastrophically when the centred Gram ``X^T X - s s^T / N`` or the total
cluster variation ``sum ||x||^2 - sum_c ||S_c||^2 / n_c`` is formed. Both are translation invariant, so the shifted
sums give them exactly; :func:`move_reference` moves sums to another reference (to the origin for the uncentred
spectrum, or to a reference shared by DDP processes) with exact formulas.

The per-batch Gram products run in float64 by default; ``precision="float32"`` (or ``"tf32"``) multiplies the
shifted rows in float32 and adds the product into the float64 running sums (:data:`GRAM_PRECISIONS`). Counts, feature
sums and sums of squares always accumulate in float64.

Functions return the batch's contribution; the caller adds it to its running sums. The one exception is the running
d x d Gram (or the C x d x d class Grams): the products are added into the given sums in place, because a returned
copy would cost one more pass over d^2 values per batch, which for fewer rows than features (N = 128, d = 2048) is as
much as the product itself. Only their lower triangle is kept up to date (the blocks on and below the diagonal, 5/8 of
the work of the full product); :func:`symmetrize_lower` gives the full matrices.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor

from rank_lightning.functional.reductions import check_token_mask
from rank_lightning.functional.spectral import (
    SCIPY_BLAS,
    Spectrum,
    _check_center,
    classwise_variance_ratio,
    gram_variance_ratios,
    serial_if_small,
    spectra_from_grams,
    spectrum_from_gram,
    variance_ratio,
)
from rank_lightning.validation import check_choice

__all__ = [
    "AUTO_GRAM_PRECISION",
    "GRAM_PRECISIONS",
    "IGNORE_INDEX",
    "UPDATE_CHUNK_BYTES",
    "BatchMoments",
    "ClassGrouping",
    "SketchUpdate",
    "Subsample",
    "channel_block_values",
    "channel_gram_moments",
    "class_counts",
    "classwise_variance_ratio_from_grams",
    "classwise_variance_ratio_from_sample",
    "count_sketch",
    "counted_tokens",
    "gram_product_dtype",
    "group_by_class",
    "group_token_labels",
    "merge_subsamples",
    "move_reference",
    "reduced_float32_format",
    "reference_point",
    "resolve_gram_precision",
    "row_moments",
    "row_temporary_values",
    "rows_per_chunk",
    "sketch_draws",
    "sketch_spectrum",
    "subsample_spectrum",
    "subsample_update",
    "symmetrize_lower",
]

# Float64 blocks of about 2^18 values (2 MiB) stay in cache between the conversion and the product: 40% faster than
# 16 MiB blocks for 64 x 32 x 32 maps.
_BLOCK_VALUES = 1 << 18
# On a GPU the blocks only bound the copy's memory (128 MiB of float64): small blocks would be thousands of kernel
# launches per batch (a 512 x 64 x 32 x 32 batch in 2^18-value blocks: 128 blocks of about six kernels each).
_CUDA_BLOCK_VALUES = 1 << 24
# Gram products of at least this many features compute only the blocks on and below the diagonal, in this many row
# blocks (a symmetric rank-k update): fewer features gain nothing from it.
_TRIANGLE_MIN_FEATURES = 128
_TRIANGLE_PARTS = 4
# ... and only with at least this many rows: a product of a few rows (one class's share of a batch) costs less than
# the calls it would be split into (40 calls of 6 rows each took 0.1 ms apiece for 10 classes at d = 128).
_TRIANGLE_MIN_ROWS = 256
# Row updates of fewer multiply-adds (N d^2) than this run on one thread (see serial_if_small): 64 rows of 128
# features 0.18 ms on 2 threads and 0.09 ms on one; from about 256 rows of 128 on, two threads are as fast or faster.
_SERIAL_UPDATE_BELOW = 1 << 22
# At least this many rows per block product, so that reading and writing the C x C Gram is amortised over the
# product (a 512 x 512 Gram of 4 x 4 maps, one input at a time, is as much memory traffic as arithmetic).
_MIN_BLOCK_ROWS = 512
# Padded class blocks (see _batched_class_products) may hold at most this many times the batch's inputs: classes of
# very unequal size in a batch, or more classes than inputs, go one product per class.
_MAX_PADDING = 2.0

UPDATE_CHUNK_BYTES = 256 * 2**20
"""The default bound of a batch's float64 row temporaries in :func:`row_moments` (``chunk_bytes``), 256 MiB: rows
past it are shifted, converted and multiplied a chunk at a time, so that (8, 4096, 4096) bf16 hidden states (256 MiB)
never stand as a 1 GiB float64 copy beside the model on its device."""


def rows_per_chunk(num_features: int, chunk_bytes: int | None) -> int | None:
    """Rows of ``num_features`` float64 values per chunk of at most ``chunk_bytes`` (at least one row); ``None``
    without a bound."""
    if chunk_bytes is None:
        return None
    return max(1, chunk_bytes // (8 * max(num_features, 1)))


def row_temporary_values(
    num_rows: int, num_features: int, chunk_bytes: int | None, device: torch.device, *, class_blocks: bool = False
) -> int:
    """The most float64 values of one temporary of :func:`row_moments` for ``num_rows`` rows on ``device``: a chunk's
    shifted rows or, with ``class_blocks`` (class Grams of sorted rows) off the CPU, its zero-padded class blocks,
    which may hold twice its rows (the chunks are halved for them)."""
    factor = int(_MAX_PADDING) if class_blocks and _batched_class_products(device) else 1
    step = rows_per_chunk(num_features, _row_chunk_bytes(chunk_bytes, class_blocks, device))
    return factor * (num_rows if step is None else min(num_rows, step)) * num_features


def _row_chunk_bytes(chunk_bytes: int | None, class_blocks: bool, device: torch.device) -> int | None:
    """The bytes of a chunk's float64 rows: ``chunk_bytes``, less where padded class blocks may double them."""
    if chunk_bytes is None or not (class_blocks and _batched_class_products(device)):
        return chunk_bytes
    return int(chunk_bytes // _MAX_PADDING)


GRAM_PRECISIONS: tuple[str, ...] = ("float64", "float32", "tf32", "auto")
"""How the per-batch Gram products are computed; the running sums are float64 in every case.

* ``"float64"``: the shifted rows in float64, multiplied in float64 (exact to float64 rounding);
* ``"float32"``: the shifted rows rounded to float32 and multiplied in IEEE float32, whatever
  ``torch.set_float32_matmul_precision`` set (relative error about ``1e-7`` of the batch's Gram), then added into the
  float64 sums. Singular values below about ``sqrt(eps_32) s_1 = 3e-4 s_1`` are
  then rounding noise: the numerical rank at Feng's tolerance (``1.2e-7 K s_1``) counts them on rank-deficient data;
* ``"tf32"``: as ``"float32"``, with TF32 tensor-core products allowed for those products only (CUDA; about ``1e-3``
  relative, 10-bit mantissa); the global setting is restored afterwards (:func:`gram_product_dtype`). On a CPU it is
  ``"float32"``;
* ``"auto"``: per device type, :data:`AUTO_GRAM_PRECISION`.
"""

AUTO_GRAM_PRECISION: dict[str, str] = {
    # A CPU multiplies float64 at half the float32 rate: the exact product costs little there.
    "cpu": "float64",
    # Measured by benchmarks/bench_precision.py on an H100 (float64 tensor cores at half the float32 rate): float64
    # updates took 0.66-3.5 ms, float32 0.69-4.2 ms and TF32 0.68-4.0 ms for d = 256-1024, while float32 moved the
    # metrics by up to 8.5e-8 and TF32 by up to 1.6e-5 and the numerical rank by one. Exact costs nothing there.
    # Consumer GPUs multiply float64 at 1/32-1/64 of float32: pass gram_precision="float32" explicitly (README).
    "cuda": "float64",
}
"""The precision ``"auto"`` stands for, per ``torch.device.type`` (``"float64"`` for any type not listed)."""


class ClassGrouping(NamedTuple):
    """A batch's labels grouped by class, made once per batch and shared by the updates of every layer.

    Grouping needs the class counts on the host (to cut each class's rows out of the batch); on a GPU reading them is
    a synchronisation. :func:`group_by_class` reads them, and checks the labels, in one transfer per batch instead of
    several per layer.

    Attributes:
        labels: ``(B,)`` int64 labels in input order.
        order: ``(B,)`` stable order that sorts them (inputs of class 0 first).
        sorted_labels: ``labels[order]``.
        counts: inputs per class (``num_classes`` entries), host integers.
        slots: ``(B,)`` int64 position of each input among the inputs of its class, in input order (``None`` where it
            was not made): where :func:`channel_gram_moments` puts it in its class's block of a batched product.
        labelled: ``None`` for labels per input; for labels per token (:func:`group_token_labels`), the ``(B, T)``
            booleans true where a token has a class (its label is not :data:`IGNORE_INDEX`). ``labels`` then holds
            the ``B*T`` token labels row by row (0 in place of the ignored ones, which every count leaves out), and
            ``order``, ``sorted_labels`` and ``counts`` group those ``B*T`` rows.
    """

    labels: Tensor
    order: Tensor
    sorted_labels: Tensor
    counts: tuple[int, ...]
    slots: Tensor | None = None
    labelled: Tensor | None = None

    def to(self, device: torch.device | str) -> ClassGrouping:
        """The same grouping with its tensors on ``device``."""
        return self._replace(
            labels=self.labels.to(device),
            order=self.order.to(device),
            sorted_labels=self.sorted_labels.to(device),
            slots=None if self.slots is None else self.slots.to(device),
            labelled=None if self.labelled is None else self.labelled.to(device),
        )


def class_counts(labels: Tensor, num_classes: int, *, row_mask: Tensor | None = None) -> Tensor:
    """Rows per class, ``(num_classes,)`` int64, of labels in ``[0, num_classes)``, without a host synchronisation.

    ``torch.bincount`` on a GPU reads the largest label back to size its output: a synchronisation per call. Adding
    ones at the labels into ``num_classes`` zeros gives the same counts on the device. Out-of-range labels raise.
    With ``row_mask`` (``(N,)`` booleans) only the labels where it is true are counted.
    """
    ones = torch.ones_like(labels, dtype=torch.int64) if row_mask is None else row_mask.to(torch.int64)
    return torch.zeros(num_classes, dtype=torch.int64, device=labels.device).index_add_(0, labels, ones)


def group_by_class(labels: Tensor, num_classes: int) -> ClassGrouping:
    """Check ``labels`` and group them by class (see :class:`ClassGrouping`), with one device-to-host transfer.

    Raises:
        ValueError: ``labels`` is not a 1-D tensor of integer class indices in ``[0, num_classes)``.
    """
    if labels.ndim != 1:
        raise ValueError(f"labels must be 1-D, got shape {tuple(labels.shape)}")
    if labels.dtype.is_floating_point or labels.dtype == torch.bool or labels.is_complex():
        raise ValueError(f"labels must be integer class indices, got dtype {labels.dtype}")
    labels = labels.long()
    if labels.numel() == 0:
        empty = labels.new_zeros(0)
        return ClassGrouping(labels, empty, empty, (0,) * num_classes)
    low, high = labels.min(), labels.max()
    counts = class_counts(labels.clamp(0, num_classes - 1), num_classes)
    summary = torch.cat([low.view(1), high.view(1), counts]).tolist()  # the one synchronisation
    if summary[0] < 0 or summary[1] >= num_classes:
        raise ValueError(f"labels must lie in [0, {num_classes}), got values in [{summary[0]}, {summary[1]}]")
    order = torch.argsort(labels, stable=True)
    sorted_labels = labels.index_select(0, order)
    return ClassGrouping(labels, order, sorted_labels, tuple(summary[2:]), _slots(sorted_labels, order, counts))


IGNORE_INDEX = -100
"""The label of a token without a class (Hugging Face's ``ignore_index`` of the loss): a padded position, or the last
of a sequence, which has no next token."""


def group_token_labels(labels: Tensor, num_classes: int) -> ClassGrouping:
    """Check ``(B, T)`` labels per token and group their ``B*T`` rows by class (see :class:`ClassGrouping`), with one
    device-to-host transfer.

    Every token position is a row whose class is its label (a causal language model's next tokens, Wu & Papyan 2024);
    positions labelled :data:`IGNORE_INDEX` (-100) have no class: ``labelled`` is false there, and the metrics leave
    them out.

    Raises:
        ValueError: ``labels`` is not a 2-D tensor of integer class indices in ``[0, num_classes)`` or -100.
    """
    if labels.ndim != 2:
        raise ValueError(f"labels per token must have shape (B, T), got {tuple(labels.shape)}")
    if labels.dtype.is_floating_point or labels.dtype == torch.bool or labels.is_complex():
        raise ValueError(f"labels per token must be integer class indices, got dtype {labels.dtype}")
    labels = labels.long()
    labelled = labels != IGNORE_INDEX
    try:
        grouping = group_by_class(labels.masked_fill(~labelled, 0).reshape(-1), num_classes)
    except ValueError as error:
        raise ValueError(f"{error}; per-token labels may also be {IGNORE_INDEX} (a token without a class)") from None
    return grouping._replace(labelled=labelled)


def counted_tokens(grouping: ClassGrouping, mask: Tensor | None, activations: Tensor) -> Tensor:
    """``(B, T)`` booleans, true at the token rows the class statistics count: real tokens (``mask``, checked by
    :func:`~rank_lightning.functional.reductions.check_token_mask`; all without one) that have a class (a label other
    than :data:`IGNORE_INDEX`, ``grouping.labelled`` of :func:`group_token_labels`) of ``(B, T, D)`` ``activations``."""
    if mask is None:
        return grouping.labelled
    return check_token_mask(mask, activations) & grouping.labelled


def _slots(sorted_labels: Tensor, order: Tensor | None, counts: Tensor) -> Tensor:
    """Each row's position among the rows of its class, stable, on the rows' device (no synchronisation): in input
    order given the sorting ``order``, in sorted order without one."""
    starts = torch.cumsum(counts, 0) - counts
    positions = torch.arange(sorted_labels.shape[0], device=sorted_labels.device)
    in_sorted = positions - starts.index_select(0, sorted_labels)
    if order is None:
        return in_sorted
    return torch.empty_like(in_sorted).index_copy_(0, order, in_sorted)


class BatchMoments(NamedTuple):
    """First moments of one batch's rows: what the batch adds to the running counts and sums.

    Summed over batches they centre the Gram (``X^T X - s s^T / N`` with ``s = X^T 1``) and give the total cluster
    variation ``sum_i ||x_i||^2 - sum_c ||S_c||^2 / n_c`` (Zangrando et al. Def. 3.2, see
    :func:`~rank_lightning.functional.total_cluster_variation_from_moments`).

    Attributes:
        num_rows: rows in the batch (after the reduction); an int64 device scalar where a row mask counted them.
        nonfinite: int64 scalar, 1 if the batch holds NaN or Inf, else 0 (a tensor, so no device sync).
        feature_sum: ``(d,)`` float64 ``X_b^T 1``.
        sum_squares: float64 scalar ``||X_b||_F^2 = sum_i ||x_i||^2``.
        class_counts: ``(C,)`` int64 rows per class; ``None`` without labels.
        class_sums: ``(C, d)`` float64 ``sum_{i in c} x_i``; ``None`` without labels.
    """

    num_rows: int | Tensor
    nonfinite: Tensor
    feature_sum: Tensor
    sum_squares: Tensor
    class_counts: Tensor | None
    class_sums: Tensor | None


def _nonfinite(feature_sum: Tensor) -> Tensor:
    # A NaN or Inf anywhere in the batch shows in its column sums (float64 sums of float32 values cannot overflow).
    return (~torch.isfinite(feature_sum).all()).long()


def _class_moments(
    labels: Tensor | None,
    num_classes: int | None,
    sums: Tensor,
    repeats: int = 1,
    row_mask: Tensor | None = None,
    into: Tensor | None = None,
) -> tuple[Tensor | None, Tensor | None]:
    """Rows per class (each label counting ``repeats`` rows; with ``row_mask``, only where it is true) and per-class
    sums of ``sums`` (one row per label), added into ``into`` where given."""
    if labels is None or num_classes is None:
        return None, None
    counts = class_counts(labels, num_classes, row_mask=row_mask) * repeats
    class_sums = sums.new_zeros(num_classes, sums.shape[1]) if into is None else into
    class_sums = class_sums.index_add_(0, labels, sums)
    return counts, class_sums


def resolve_gram_precision(precision: str, device: torch.device | str) -> str:
    """The concrete precision (``"float64"``, ``"float32"`` or ``"tf32"``) of ``precision`` on ``device``.

    Raises:
        ValueError: ``precision`` is not one of :data:`GRAM_PRECISIONS`.
    """
    check_choice("gram_precision", precision, GRAM_PRECISIONS)
    if precision != "auto":
        return precision
    return AUTO_GRAM_PRECISION.get(torch.device(device).type, "float64")


@contextmanager
def gram_product_dtype(precision: str) -> Iterator[torch.dtype]:
    """The dtype of the per-batch Gram products of a resolved ``precision``; sets the float32 product precision inside.

    ``"tf32"`` allows TF32 tensor-core products (CUDA), ``"float32"`` asks for IEEE float32 products, whatever
    ``torch.set_float32_matmul_precision`` set for the model (``"high"`` or ``"medium"`` would otherwise make them TF32
    on CUDA and bfloat16-based on a CPU with oneDNN). The setting is changed for the products inside the block only and
    restored after it, through ``torch.backends.cuda.matmul.fp32_precision`` (and oneDNN's) where torch has it: reading
    or writing the older ``allow_tf32`` flag raises once a program has used that newer setting.
    """
    check_choice("precision", precision, GRAM_PRECISIONS[:3])
    if precision == "float64":
        yield torch.float64
        return
    with _float32_products(tf32=precision == "tf32"):
        yield torch.float32


@contextmanager
def _float32_products(*, tf32: bool) -> Iterator[None]:
    """Float32 matrix products inside the block: TF32 on CUDA with ``tf32``, IEEE float32 otherwise (and on a CPU)."""
    cuda = torch.backends.cuda.matmul
    if not hasattr(cuda, "fp32_precision"):  # torch < 2.9: the one flag there is
        previous = cuda.allow_tf32
        cuda.allow_tf32 = tf32
        try:
            yield
        finally:
            cuda.allow_tf32 = previous
        return
    cpu = torch.backends.mkldnn.matmul
    saved = (cuda.fp32_precision, cpu.fp32_precision)
    cuda.fp32_precision, cpu.fp32_precision = ("tf32" if tf32 else "ieee"), "ieee"
    try:
        yield
    finally:
        cuda.fp32_precision, cpu.fp32_precision = saved


def _flag(*path: str) -> str:
    """Torch's ``fp32_precision`` setting at ``torch.backends.<path>``, its parents' where it is ``"none"``."""
    for end in range(len(path), -1, -1):
        value = getattr(_backend(path[:end]), "fp32_precision", "none")
        if value != "none":
            return value
    return "none"


def _backend(path: Sequence[str]) -> Any:
    """``torch.backends.<path>`` (``torch.backends`` for an empty path)."""
    module: Any = torch.backends
    for part in path:
        module = getattr(module, part)
    return module


def reduced_float32_format(device_type: str, *, conv: bool) -> str | None:
    """The reduced format torch's float32 precision flags let this device's float32 products run in: ``"tf32"``
    (CUDA matrix products or, for ``conv``, cuDNN convolutions, on GPUs with TF32 units: a 10-bit mantissa, float16's),
    ``"bf16"`` (oneDNN on a CPU with bf16 units, ``torch.set_float32_matmul_precision("medium")``), or ``None``. The
    flags allow; whether the hardware has those units is not checked.

    Torch from 2.9 on: ``torch.backends.{cuda.matmul, cudnn.conv, mkldnn.matmul, mkldnn.conv}.fp32_precision``,
    whose ``"none"`` defers to the parent's (``"none"`` all the way up is IEEE float32; cuDNN convolutions default to
    TF32). Earlier torch: ``allow_tf32`` and ``torch.get_float32_matmul_precision()``.
    """
    if not hasattr(torch.backends.cudnn, "conv"):  # torch < 2.9
        if device_type == "cuda":
            tf32 = torch.backends.cudnn.allow_tf32 if conv else torch.backends.cuda.matmul.allow_tf32
            return "tf32" if tf32 else None
        return "bf16" if device_type == "cpu" and torch.get_float32_matmul_precision() == "medium" else None
    if device_type == "cuda":
        value = _flag("cudnn", "conv") if conv else _flag("cuda", "matmul")
        return value if value in ("tf32", "bf16") else None
    if device_type == "cpu":  # TF32 on a CPU needs units few have; bf16 products, those of many recent ones
        return "bf16" if _flag("mkldnn", "conv" if conv else "matmul") == "bf16" else None
    return None


def reference_point(mean: Tensor) -> Tensor:
    """A reference point for shifted moments from a batch mean: float64, rounded to float32, non-finite entries 0.

    Any point works (every quantity is exact for any reference); one near the data keeps the shifted sums free of
    cancellation. Rounded to float32 so that rows shifted in float32 (``precision="float32"``) use the very point the
    float64 sums are taken around.
    """
    point = mean.detach().to(torch.float32).to(torch.float64)
    return torch.nan_to_num(point, nan=0.0, posinf=0.0, neginf=0.0)


def move_reference(
    delta: Tensor,
    counts: Tensor | int,
    sums: Tensor,
    grams: Tensor | None = None,
    sum_squares: Tensor | None = None,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Moments of ``x - a`` turned into those of ``x - b``, with ``delta = a - b`` (so ``x - b = (x - a) + delta``).

    For ``n`` rows with ``S = sum (x - a)``, ``G = sum (x - a)(x - a)^T`` and ``Q = sum ||x - a||^2``:
    ``S' = S + n delta``, ``G' = G + S delta^T + delta S^T + n delta delta^T`` and ``Q' = Q + 2 delta^T S +
    n ||delta||^2``. Exact algebra; moving to the origin (``b = 0``, ``delta = a``) gives the plain sums ``X^T 1``,
    ``X^T X`` and ``||X||_F^2``. Leading batch dimensions broadcast (per-class counts ``(C,)``, sums ``(C, d)``,
    Grams ``(C, d, d)``).

    Args:
        delta: ``(d,)`` ``a - b``.
        counts: rows behind the sums: an int, a scalar or a ``(C,)`` tensor.
        sums: ``(..., d)`` sums of ``x - a``.
        grams: ``(..., d, d)`` Grams of ``x - a`` (optional).
        sum_squares: ``(...)`` sums of ``||x - a||^2`` (optional).

    Returns:
        ``(sums, grams, sum_squares)`` around ``b``; ``None`` where not given.
    """
    delta = delta.to(sums.dtype)
    n = torch.as_tensor(counts, dtype=sums.dtype, device=sums.device)
    moved_sums = sums + n.unsqueeze(-1) * delta
    moved_grams = None
    if grams is not None:
        # G + S d^T + d S^T + n d d^T, added left to right in place: the rounding of the plain expression (which
        # DDP's merge of differently shifted sums must reproduce), with two temporaries of the Grams' size fewer.
        cross = sums.unsqueeze(-1) * delta
        moved_grams = grams + cross
        moved_grams += cross.transpose(-1, -2)
        moved_grams += n.view(*n.shape, 1, 1) * torch.outer(delta, delta)
    moved_squares = None
    if sum_squares is not None:
        moved_squares = sum_squares + 2 * (sums @ delta) + n * delta.dot(delta)
    return moved_sums, moved_grams, moved_squares


def row_moments(
    rows: Tensor,
    labels: Tensor | None = None,
    *,
    num_classes: int | None = None,
    gram: Tensor | None = None,
    class_grams: Tensor | None = None,
    reference: Tensor | None = None,
    precision: str = "float64",
    sorted_counts: Sequence[int] | None = None,
    row_mask: Tensor | None = None,
    chunk_bytes: int | None = UPDATE_CHUNK_BYTES,
    class_sums: Tensor | None = None,
) -> BatchMoments:
    """First moments of a batch of rows; with ``gram``, also adds the batch's Gram into its lower triangle.

    The moments are those of the shifted rows ``x - r`` (``r = reference``, the origin if ``None``), formed in
    float64 whatever the rows' dtype: the feature sum ``sum (x - r)``, ``sum ||x - r||^2``, class sums, and the Gram
    ``(X - 1 r^T)^T (X - 1 r^T)``, whose product runs in ``precision`` (see :data:`GRAM_PRECISIONS`).

    With ``class_grams`` and labels, the rows of class ``c`` go into ``class_grams[c]`` (``X_c^T X_c``, the input of
    the class-wise variance ratio, Sanyal et al. Sec. 4.3) instead of ``gram``: since ``sum_c X_c^T X_c = X^T X``,
    the Gram of every row is ``gram + class_grams.sum(0)`` and the O(N d^2) product is paid once. Each class Gram
    is one matrix product on a contiguous block: rows whose labels are not sorted are first grouped by a stable
    sort, at the cost of one copy of the float64 rows (sorting the inputs before their reduction is cheaper).

    Args:
        rows: ``(N, d)`` rows of the batch, any floating dtype.
        labels: ``(N,)`` int64 class of each row, in ``[0, num_classes)``.
        num_classes: C; class counts and sums are returned when given together with ``labels``.
        gram: running float64 ``(d, d)`` feature Gram, added into in place; only its lower triangle is kept up to
            date (:func:`symmetrize_lower` gives the full matrix).
        class_grams: running float64 ``(C, d, d)`` class Grams, added into in place likewise (with ``labels`` only).
        reference: ``(d,)`` float64 point the moments are taken around.
        precision: ``"float64"``, ``"float32"`` or ``"tf32"`` (resolved, see :func:`resolve_gram_precision`).
        sorted_counts: rows per class, on the host, when ``labels`` are known to be sorted (from a
            :class:`ClassGrouping`): the class Grams then need no synchronisation to find each class's rows.
        row_mask: ``(N,)`` booleans: only the rows where it is true are counted (the moments equal those of
            ``rows[row_mask]``), e.g. the real tokens of a padded batch
            (:func:`~rank_lightning.functional.reductions.masked_token_rows`). The other rows are zeroed after the
            shift, whatever they hold, and their Gram products add zeros; no count is read back to the host.
        chunk_bytes: the most bytes of a float64 copy of the rows (:data:`UPDATE_CHUNK_BYTES`); a batch whose rows
            take more is added a chunk of rows at a time (at least one row), each chunk's moments summed, with no
            read back to the host. The chunks change the order of the float64 additions only (the sums agree with
            those of one pass to about 1e-15 relative). ``None``: one pass whatever the size.
        class_sums: ``(C, d)`` float64 sums the batch's class sums are added into in place (and returned), instead
            of new ones: the chunks of a batch share one (C may be a vocabulary).

    Returns:
        The batch's :class:`BatchMoments` (of ``x - r``); with ``row_mask``, its ``num_rows`` is a device tensor.
    """
    num_rows, num_features = rows.shape
    class_blocks = class_grams is not None and labels is not None and sorted_counts is not None
    step = rows_per_chunk(num_features, _row_chunk_bytes(chunk_bytes, class_blocks, rows.device))
    if step is not None and num_rows > step:
        return _chunked_row_moments(
            rows, labels, step, num_classes, gram, class_grams, reference, precision, sorted_counts, row_mask
        )
    # A batch of a few rows is a handful of small operations: one thread does them several times faster.
    with serial_if_small(rows, num_rows * num_features * num_features, _SERIAL_UPDATE_BELOW):
        shifted = rows.to(torch.float64) if reference is None else torch.sub(rows, reference.to(torch.float64))
        if row_mask is not None:
            # In place on a copy of the rows' own: no second float64 temporary of the batch.
            fill = shifted.masked_fill_ if shifted.data_ptr() != rows.data_ptr() else shifted.masked_fill
            shifted = fill(~row_mask.unsqueeze(1), 0)
            num_rows = row_mask.sum()
        feature_sum = shifted.sum(dim=0)
        counts, class_sums = _class_moments(labels, num_classes, shifted, row_mask=row_mask, into=class_sums)
        with gram_product_dtype(precision) as dtype:
            factor = shifted.to(dtype)
            if class_grams is not None and labels is not None:
                _add_class_grams(class_grams, factor, labels, sorted_counts)
            elif gram is not None:
                _add_product(gram, factor.T)
        # The norm reduces without the N x d temporary of rows.square().
        sum_squares = torch.linalg.vector_norm(shifted).square()
    return BatchMoments(num_rows, _nonfinite(feature_sum), feature_sum, sum_squares, counts, class_sums)


def _chunked_row_moments(
    rows: Tensor,
    labels: Tensor | None,
    step: int,
    num_classes: int | None,
    gram: Tensor | None,
    class_grams: Tensor | None,
    reference: Tensor | None,
    precision: str,
    sorted_counts: Sequence[int] | None,
    row_mask: Tensor | None,
) -> BatchMoments:
    """:func:`row_moments` of ``rows`` taken ``step`` rows at a time, the chunks' moments summed (the Grams are added
    into in place by each chunk). Sorted rows keep their per-class counts, cut at the chunks' bounds on the host."""
    bounds = list(itertools.accumulate(sorted_counts, initial=0)) if sorted_counts is not None else None
    total: BatchMoments | None = None
    class_sums = None  # the first chunk's, which the others add into
    for start in range(0, rows.shape[0], step):
        stop = min(start + step, rows.shape[0])
        counts = None
        if bounds is not None:
            counts = [max(0, min(high, stop) - max(low, start)) for low, high in itertools.pairwise(bounds)]
        part = row_moments(
            rows[start:stop],
            None if labels is None else labels[start:stop],
            num_classes=num_classes,
            gram=gram,
            class_grams=class_grams,
            reference=reference,
            precision=precision,
            sorted_counts=counts,
            row_mask=None if row_mask is None else row_mask[start:stop],
            chunk_bytes=None,
            class_sums=class_sums,
        )
        class_sums = part.class_sums
        # Summed as they come: one chunk's moments (and class sums, C x d) held at a time.
        if total is None:
            total = part
        else:  # the class sums are already the total's
            total = BatchMoments(*(_add_sums(a, b) for a, b in zip(total[:5], part[:5])), class_sums)
    assert total is not None
    return total._replace(nonfinite=_nonfinite(total.feature_sum))


def _add_sums(a: Any, b: Any) -> Any:
    """``a + b`` in place where ``a`` is a tensor (a chunk's own sums), ``None`` where both are."""
    if a is None:
        return None
    if isinstance(a, Tensor):
        return a.add_(b)
    return a + b


def _add_product(target: Tensor, columns: Tensor) -> None:
    """``tril(target) += tril(Y Y^T)`` for ``Y = columns`` (d x K).

    A float64 product on a CPU where torch runs on one thread is BLAS's symmetric rank-k update
    (:func:`_cpu_syrk`), which computes the lower triangle alone. Otherwise the product runs in
    :data:`_TRIANGLE_PARTS` row blocks: row block ``i`` multiplies only the columns up to its own last one, the blocks
    on and below the diagonal, about ``(p + 1) / 2p`` of the full product's work (5/8 for p = 4). Entries above the
    diagonal are not kept up to date; :func:`symmetrize_lower` makes the full Gram from the lower triangle. On a GPU,
    and for few rows, the product is one call: launches and call overhead would cost more than the saved work.
    """
    if _cpu_syrk(target, columns):
        return
    d, k = columns.shape
    whole = d < _TRIANGLE_MIN_FEATURES or k < _TRIANGLE_MIN_ROWS or columns.device.type != "cpu"
    step = d if whole else -(-d // _TRIANGLE_PARTS)
    for start in range(0, d, step):
        stop = min(start + step, d)
        block, left, right = target[start:stop, :stop], columns[start:stop], columns[:stop]
        if columns.dtype == target.dtype:
            block.addmm_(left, right.T)
        else:
            block += left @ right.T


def _cpu_syrk(target: Tensor, columns: Tensor) -> bool:
    """``tril(target) += tril(Y Y^T)`` by SciPy's ``dsyrk`` for float64 CPU tensors; ``False`` if not applicable.

    BLAS's symmetric rank-k update computes the lower triangle alone (half the multiply-adds of the full product) at
    the full product's rate: on one thread 1.2-1.9x faster than torch's triangle blocks for 64-512 features and
    64-100,000 rows; torch's blocks on two threads beat it from 256 features on (``benchmarks/bench_gram_update.py``),
    hence one thread only. Same float64
    arithmetic, another order of summation. ``target`` must be a contiguous ``(d, d)`` float64 CPU tensor and ``Y`` a
    float64 CPU matrix with unit stride along one dimension, read in place. Returns ``False`` (nothing added)
    otherwise, and where :meth:`~rank_lightning.functional.spectral.ScipyBlas.usable` is false (no SciPy OpenBLAS of
    its own, or torch on more threads than one SciPy thread keeps up with).
    """
    if (
        target.device.type != "cpu"
        or columns.device.type != "cpu"
        or target.dtype != torch.float64
        or columns.dtype != torch.float64
        or not target.is_contiguous()
        or 0 in columns.shape
        or not SCIPY_BLAS.usable()
    ):
        return False
    from scipy.linalg.blas import dsyrk

    y = columns.detach()
    if y.stride(0) == 1 and y.stride(1) >= max(1, y.shape[0]):  # Fortran order: a = Y, a a^T
        a, trans = y.numpy(), 0
    elif y.stride(1) == 1 and y.stride(0) >= max(1, y.shape[1]):  # C order: a = Y^T in Fortran order, a^T a
        a, trans = y.numpy().T, 1
    else:
        return False
    # target's rows are the columns of the Fortran-order view target^T, so its lower triangle is that view's upper.
    c = target.detach().numpy().T
    with SCIPY_BLAS.single_threaded():
        out = dsyrk(1.0, a, beta=1.0, c=c, trans=trans, lower=0, overwrite_c=1)
    if not np.shares_memory(out, c):
        c[...] = out
    return True


def symmetrize_lower(gram: Tensor) -> Tensor:
    """The symmetric matrix (or batch of matrices) whose lower triangle is that of ``gram``.

    The running Grams of :func:`row_moments` and :func:`channel_gram_moments` are kept up to date in their lower
    triangle only (the upper one holds partial sums, or nothing added where BLAS's ``dsyrk`` ran); this gives the
    full Gram.
    """
    d = gram.shape[-1]
    lower = torch.ones(d, d, dtype=torch.bool, device=gram.device).tril_()
    return torch.where(lower, gram, gram.mT)  # one pass, no temporaries of the Gram's size


def _add_class_grams(class_grams: Tensor, rows: Tensor, labels: Tensor, counts: Sequence[int] | None = None) -> None:
    """``class_grams[c] += X_c^T X_c``, one matrix product per class on its rows made contiguous.

    ``counts`` (rows per class) says that the rows are already sorted by class; without it they are checked and
    sorted here, and the counts read from the device. Off the CPU, sorted rows go into every class Gram by one batched
    product over zero-padded class blocks (:func:`_batched_class_products`) where padding at most doubles the rows.
    """
    num_classes = class_grams.shape[0]
    if counts is not None and _padded_rows_fit(rows, counts, class_grams):
        slots = _slots(labels, None, class_counts(labels, num_classes))
        blocks = _padded_class_blocks(rows.unsqueeze(-1), labels, slots, num_classes, max(counts))
        _add_batched_products(class_grams, blocks)
        return
    if counts is None:
        if labels.shape[0] > 1 and not bool((labels[1:] >= labels[:-1]).all()):
            labels, order = torch.sort(labels, stable=True)
            rows = rows.index_select(0, order)
        counts = torch.bincount(labels, minlength=num_classes).tolist()
    start = 0
    # Entered once for every class's dsyrk (see _cpu_syrk) rather than per class.
    with SCIPY_BLAS.single_threaded() if rows.device.type == "cpu" else contextlib.nullcontext():
        for c, count in enumerate(counts):
            if count:
                _add_product(class_grams[c], rows[start : start + count].T)
                start += count


def channel_gram_moments(
    maps: Tensor,
    labels: Tensor | ClassGrouping | None = None,
    *,
    num_classes: int | None = None,
    gram: Tensor,
    class_grams: Tensor | None = None,
    reference: Tensor | None = None,
    precision: str = "float64",
) -> BatchMoments:
    """Moments of the ``"channel"`` reduction of conv maps (every position a sample), with one transposing pass.

    The ``(B*H*W, C)`` rows of :func:`~rank_lightning.functional.reduce_activations` need a copy that gathers one
    value per row from each channel's map, which costs more than the Gram itself for large maps. Here the maps of a
    block of inputs are copied channel-major instead, ``Y = [X_1 ... X_b]`` (C x b*H*W, each ``X_i = maps[i]``
    viewed as C x HW, contiguous runs of H*W values), shifted by the reference and converted to the product's dtype
    in the same pass; ``Y Y^T`` is the block's feature Gram. With labels the inputs are grouped by class and each
    class's blocks go into its Gram ``class_grams[c]``; every position inherits its input's label. Blocks hold about
    2^18 values (at least 512 positions), so the copy stays in cache for the product.

    Args:
        maps: ``(B, C, H, W)`` activations of any floating dtype; maps of more spatial dimensions, ``(B, C, D1, D2,
            D3)``, the same way, their ``D1*D2*D3`` positions taking the place of the ``H*W``.
        labels: ``(B,)`` int64 class of each input, in ``[0, num_classes)``, or their :class:`ClassGrouping`.
        num_classes: C; class counts and sums are returned when given together with ``labels``.
        gram: running float64 ``(C, C)`` feature Gram, added into its lower triangle in place (see
            :func:`symmetrize_lower`).
        class_grams: running float64 ``(num_classes, C, C)`` class Grams, likewise (with ``labels`` only).
        reference: ``(C,)`` float64 point the moments are taken around (see :func:`reference_point`).
        precision: ``"float64"``, ``"float32"`` or ``"tf32"``.

    Returns:
        The batch's :class:`BatchMoments` over its ``B*H*W`` rows (of ``x - r``).
    """
    batch, channels = maps.shape[:2]
    per_map = math.prod(maps.shape[2:])  # positions of one input's map
    flat = maps.reshape(batch, channels, per_map)
    grouping = labels if isinstance(labels, ClassGrouping) else None
    labels = grouping.labels if grouping is not None else labels
    by_class = class_grams is not None and labels is not None
    if by_class and grouping is None:
        grouping = group_by_class(labels, class_grams.shape[0])
    with gram_product_dtype(precision) as dtype:
        shift = flat.new_zeros((), dtype=dtype) if reference is None else reference.to(dtype).view(channels, 1, 1)
        positions = _padded_positions(flat, grouping, class_grams, dtype) if by_class else None
        if positions is not None:
            feature_sum, sum_squares, class_sums = _padded_channel_moments(
                flat, grouping, class_grams, shift.view(-1, 1), dtype, positions
            )
            class_sums = class_sums if num_classes else None
        else:
            groups = _class_groups(labels, class_grams.shape[0], grouping) if by_class else [(-1, None, batch)]
            feature_sum, sum_squares, class_sums = _blockwise_channel_moments(
                flat, groups, gram, class_grams, shift, dtype, num_classes if by_class else None
            )
    counts = None
    if labels is not None and num_classes is not None:
        counts = class_counts(labels, num_classes) * per_map
        if class_sums is None:
            class_sums = _channel_class_sums(flat, labels, num_classes, reference)
    return BatchMoments(batch * per_map, _nonfinite(feature_sum), feature_sum, sum_squares, counts, class_sums)


def _blockwise_channel_moments(
    flat: Tensor,
    groups: list[tuple[int, Tensor | None, int]],
    gram: Tensor,
    class_grams: Tensor | None,
    shift: Tensor,
    dtype: torch.dtype,
    num_classes: int | None,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Feature sum, sum of squares and class sums (with ``num_classes``) of ``flat``'s shifted positions, adding the
    Gram of each class's blocks (:func:`_channel_blocks`) into its Gram, ``gram`` for the class ``-1`` of all inputs.
    """
    # Per-block sums and norms are combined once at the end: a few kernels per block instead of ten.
    block_sums: list[Tensor] = []
    block_norms: list[Tensor] = []
    block_classes: list[int] = []
    for c, index, count in groups:
        target = gram if c < 0 or class_grams is None else class_grams[c]
        for block in _channel_blocks(flat, index, count, shift, dtype):
            _add_product(target, block)
            block_sums.append(block.sum(dim=1, dtype=torch.float64))
            block_norms.append(torch.linalg.vector_norm(block, dtype=torch.float64))
            block_classes.append(c)
    sums = torch.stack(block_sums)  # (blocks, C)
    feature_sum = sums.sum(dim=0)
    sum_squares = torch.linalg.vector_norm(torch.stack(block_norms)).square()
    class_sums = None
    if num_classes:
        # The blocks of a class are consecutive: one reduction per class present, no index sent to the device.
        class_sums = sums.new_zeros(num_classes, flat.shape[1])
        start = 0
        for c, blocks in itertools.groupby(block_classes):
            stop = start + len(list(blocks))
            class_sums[c] = sums[start:stop].sum(dim=0)
            start = stop
    return feature_sum, sum_squares, class_sums


def _batched_class_products(device: torch.device) -> bool:
    """Whether the class Grams of a batch are updated by one batched product over zero-padded class blocks
    (:func:`_padded_class_blocks`) rather than a product per class: off the CPU, where each kernel launch costs more
    host time than these products take on the device. On a CPU the per-class products (BLAS's ``dsyrk`` on the
    lower triangle, cache-sized blocks) do less arithmetic."""
    return device.type != "cpu"


def _padded_class_blocks(values: Tensor, labels: Tensor, slots: Tensor, num_classes: int, max_count: int) -> Tensor:
    """``(num_classes, F, max_count * M)`` blocks: input ``i``'s ``(F, M)`` values ``values[i]`` at columns
    ``slots[i] * M ...`` of block ``labels[i]``, zeros elsewhere; block ``c``'s Gram is ``sum_{i in c} V_i V_i^T``."""
    _, features, samples = values.shape
    blocks = values.new_zeros(num_classes, features, max_count, samples)
    blocks.permute(0, 2, 1, 3)[labels, slots] = values  # one scatter of every input into its class's block
    return blocks.view(num_classes, features, max_count * samples)


def _add_batched_products(targets: Tensor, blocks: Tensor) -> None:
    """``targets[c] += blocks[c] blocks[c]^T`` for every ``c``, one batched product (added in float64)."""
    if blocks.dtype == targets.dtype:
        targets.baddbmm_(blocks, blocks.mT)
    else:
        targets += torch.bmm(blocks, blocks.mT)


def _padded_rows_fit(rows: Tensor, counts: Sequence[int], class_grams: Tensor) -> bool:
    """Whether sorted ``rows`` go into their class Grams by one padded product (:func:`_add_class_grams`): off the
    CPU, where padding at most doubles the rows and the padded blocks (and a float32 product's ``(C, d, d)`` result)
    stay within ``_CUDA_BLOCK_VALUES``."""
    if not _batched_class_products(rows.device) or not any(counts):
        return False
    num_classes, features = class_grams.shape[0], rows.shape[1]
    padded = num_classes * max(counts)
    product = 0 if rows.dtype == class_grams.dtype else num_classes * features * features
    return padded <= _MAX_PADDING * rows.shape[0] and max(padded * features, product) <= _CUDA_BLOCK_VALUES


def _padded_positions(flat: Tensor, grouping: ClassGrouping, class_grams: Tensor, dtype: torch.dtype) -> int | None:
    """Map positions per padded product for ``flat``'s class Grams (:func:`_padded_channel_moments`), or ``None``
    where the class blocks go one by one: on a CPU, without slots, where padding would more than double the work
    (classes of very unequal size in the batch), where the blocks of a single position exceed ``_CUDA_BLOCK_VALUES``
    or would take more products than there are classes, and where a float32 product's ``(C, d, d)`` result would."""
    if not _batched_class_products(flat.device) or grouping.slots is None or not any(grouping.counts):
        return None
    batch, channels, positions = flat.shape
    num_classes, max_count = class_grams.shape[0], max(grouping.counts)
    if num_classes * max_count > _MAX_PADDING * batch:
        return None
    if dtype != class_grams.dtype and num_classes * channels * channels > _CUDA_BLOCK_VALUES:
        return None
    step = _CUDA_BLOCK_VALUES // (num_classes * channels * max_count)
    if step < 1 or -(-positions // step) > num_classes:
        return None
    return min(step, positions)


def _padded_channel_moments(
    flat: Tensor, grouping: ClassGrouping, class_grams: Tensor, shift: Tensor, dtype: torch.dtype, step: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Feature sum, sum of squares and class sums of ``flat``'s shifted positions, adding every class's Gram by one
    batched product per ``step`` positions of the maps (the blocks' memory stays within ``_CUDA_BLOCK_VALUES``)."""
    num_classes, max_count = class_grams.shape[0], max(grouping.counts)
    class_sums = flat.new_zeros(num_classes, flat.shape[1], dtype=torch.float64)
    norms = []
    for start in range(0, flat.shape[2], step):
        values = torch.sub(flat[:, :, start : start + step], shift).to(dtype)
        blocks = _padded_class_blocks(values, grouping.labels, grouping.slots, num_classes, max_count)
        _add_batched_products(class_grams, blocks)
        class_sums += blocks.sum(dim=2, dtype=torch.float64)
        norms.append(torch.linalg.vector_norm(values, dtype=torch.float64))
    sum_squares = torch.linalg.vector_norm(torch.stack(norms)).square()
    return class_sums.sum(dim=0), sum_squares, class_sums


def _class_groups(
    labels: Tensor, num_classes: int, grouping: ClassGrouping | None = None
) -> list[tuple[int, Tensor, int]]:
    """``(class, input indices, count)`` of every class present in ``labels`` (from ``grouping`` when given)."""
    if grouping is None:
        grouping = group_by_class(labels, num_classes)
    order = grouping.order
    groups, start = [], 0
    for c, count in enumerate(grouping.counts):
        if count:
            groups.append((c, order[start : start + count], count))
            start += count
    return groups


def _channel_blocks(flat: Tensor, index: Tensor | None, count: int, shift: Tensor, dtype: torch.dtype) -> Iterator:
    """The ``(C, b*HW)`` shifted channel-major blocks of ``flat[index]`` (``flat[:count]`` without an index)."""
    channels, positions = flat.shape[1], flat.shape[2]
    values = _BLOCK_VALUES if flat.device.type == "cpu" else _CUDA_BLOCK_VALUES
    step = max(1, values // (channels * positions), -(-_MIN_BLOCK_ROWS // positions))
    for start in range(0, count, step):
        part = flat[start : start + step] if index is None else flat.index_select(0, index[start : start + step])
        block = torch.empty((channels, part.shape[0], positions), dtype=dtype, device=flat.device)
        torch.sub(part.transpose(0, 1), shift, out=block)
        yield block.view(channels, -1)


def channel_block_values(maps: Tensor, class_blocks: bool = False) -> int:
    """The most values of a shifted block that :func:`channel_gram_moments` copies out of ``maps`` (``(B, C, ...)``)
    at a time: blocks of about 2^18 values on a CPU and 2^24 elsewhere, at least one input's map (and 512
    positions); with ``class_blocks`` off the CPU, the padded class blocks too (at most 2^24 values, twice the
    batch)."""
    batch, channels = maps.shape[:2]
    positions = math.prod(maps.shape[2:])
    values = _BLOCK_VALUES if maps.device.type == "cpu" else _CUDA_BLOCK_VALUES
    step = max(1, values // max(channels * positions, 1), -(-_MIN_BLOCK_ROWS // max(positions, 1)))
    largest = min(step, batch) * channels * positions
    if class_blocks and _batched_class_products(maps.device):
        largest = max(largest, min(_CUDA_BLOCK_VALUES, int(_MAX_PADDING * batch * channels * positions)))
    return largest


def _channel_class_sums(flat: Tensor, labels: Tensor, num_classes: int, reference: Tensor | None) -> Tensor:
    """Per-class sums of the shifted positions, for labelled maps whose Grams are not kept per class."""
    sums = flat.sum(dim=2, dtype=torch.float64)  # (B, C)
    if reference is not None:
        sums = sums - flat.shape[2] * reference
    return sums.new_zeros(num_classes, sums.shape[1]).index_add_(0, labels, sums)


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

    On a CPU, once the subsample is full, the evicted rows are overwritten in place rather than the whole subsample
    copied per batch; on other devices it is gathered anew, without a host synchronisation. ``sample`` is consumed:
    use the returned one.

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
    if rows.device.type != "cpu":
        # Evicting in place needs the number of rows that enter, which a GPU would read back to the host: there the
        # subsample is the bottom-k of the kept and the new rows, gathered anew (the same rows, in another order).
        both = (Subsample(kept_rows, kept_keys, kept_labels), Subsample(rows, keys, labels))
        return merge_subsamples(both, capacity=capacity)
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
        generator: generator of the buckets and signs, on the rows' device (drawn there, nothing is copied from the
            host, which would wait for a GPU).

    Returns:
        The batch's :class:`SketchUpdate`; ``sketch.index_add_(0, u.buckets, u.rows)`` adds it.
    """
    buckets, signs = sketch_draws(rows.shape[0], num_buckets, generator, rows.device)
    return SketchUpdate(buckets, rows * signs.unsqueeze(1), signs)


def sketch_draws(
    num_rows: int, num_buckets: int, generator: torch.Generator, device: torch.device
) -> tuple[Tensor, Tensor]:
    """The buckets (int64) and float64 signs of :func:`count_sketch` for ``num_rows`` rows, drawn as it draws them:
    a batch's rows can then be signed and added a chunk at a time."""
    buckets = torch.randint(num_buckets, (num_rows,), generator=generator, device=device)
    signs = torch.randint(2, (num_rows,), generator=generator, dtype=torch.float64, device=device) * 2 - 1
    return buckets, signs


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
    _check_center(center)
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
    """``VR_k`` of each class (Sanyal et al. eq. 7, Sec. 4.3) from its Gram ``X_c^T X_c``.

    On a CPU, for d >= 128, the ``k`` leading eigenvalues of each Gram and its trace (:func:`gram_variance_ratios`);
    elsewhere, and for ``k`` not below a class's rank bound ``min(N_c, d)``, every eigenvalue in one batched ``eigh``.

    Args:
        class_grams: ``(C, d, d)`` class Grams.
        class_counts: ``(C,)`` rows per class.
        class_sums: ``(C, d)`` ``X_c^T 1``; required with ``center``.
        k: number of leading singular values.
        center: subtract each class's mean first (Sanyal et al. do not).

    Returns:
        float64 ``(C,)``; NaN for a class without rows.
    """
    _check_center(center)
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
    sizes = [counts[c] for c in present]
    leading = gram_variance_ratios(grams, k, feature_sums=sums if center else None, num_samples=sizes)
    if leading is not None:
        out[present] = leading
        return out
    spectra = spectra_from_grams(grams, sizes, feature_sums=sums, center=center)
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
    _check_center(center)
    labelled = sample.labels >= 0
    rows, labels = sample.rows[labelled].to(torch.float64), sample.labels[labelled]
    return classwise_variance_ratio(rows, labels, k=k, num_classes=num_classes, center=center)
