"""Singular values of weight matrices, many at once: the route choice of a weight-spectrum monitor.

A network holds many weight matrices of few distinct shapes; :func:`weight_spectra` decomposes every shape's matrices
in one batched float64 call, by a full SVD or through the smaller Gram matrix, and picks the route per matrix so that
the result stays accurate (``decomposition="auto"``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

from rank_lightning.functional.spectral import SERIAL_SVD_BELOW, Spectrum, serial_if_small, spectra_from_grams
from rank_lightning.validation import check_choice

__all__ = ["DECOMPOSITIONS", "needs_exact_svd", "weight_spectra", "weight_spectra_from_grams"]

DECOMPOSITIONS: tuple[str, ...] = ("auto", "svd", "gram")
"""Routes of :func:`weight_spectra`."""

# With s_min >= 1e-3 s_1 (condition number <= 1e3) the Gram route's relative error eps64 * (s_1 / s_i)^2 / 2 stays
# below 1e-10 for every singular value.
_AUTO_CONDITION = 1e-3


def weight_spectra(
    matrices: Sequence[Tensor],
    *,
    decomposition: Literal["auto", "svd", "gram"] = "auto",
    groups: Sequence[int] | None = None,
) -> list[Spectrum]:
    """Float64 spectra of weight matrices, one batched decomposition per distinct shape and device (per GiB of
    float64 matrices of that shape).

    Every matrix is read as ``(out, fan_in)`` (rows are the spectrum's ``num_samples``); bring conv kernels into that
    form first with :func:`~rank_lightning.functional.weight_as_matrix`. ``eps64 = 2.2e-16`` below is the float64
    machine epsilon, ``s_1`` the largest singular value of the matrix.

    Routes:

    * ``"svd"``: ``torch.linalg.svdvals`` of the tall orientation (a wide matrix is transposed first: same values,
      several times faster in LAPACK); on CUDA, a near-square matrix (sides within a factor 2) takes the symmetric
      eigensolver of ``[[0, W], [W^T, 0]]`` instead, with the same error bound, several times faster than cuSOLVER's
      SVD. Backward stable: every singular value is within a small multiple of
      ``eps64 * s_1`` of the exact one, so the relative error stays below ``1e-10`` for every ``s_i`` above about
      ``1e-5 * s_1``.
    * ``"gram"``: square roots of the eigenvalues of the smaller Gram matrix, ``W W^T`` or ``W^T W``
      (:func:`~rank_lightning.functional.spectra_from_grams`), 1.5-1.8x faster on a CPU. Squaring the matrix leaves an
      absolute error of at most about ``sqrt(eps64) * s_1 = 1.5e-8 * s_1`` on any singular value, a relative error of
      about ``eps64 * (s_1 / s_i)^2 / 2``: below ``1e-10`` for a matrix with ``s_min >= 1e-3 * s_1``; values above
      ``1e-4 * s_1`` keep 8 digits, values below ``1e-7 * s_1`` lose their relative accuracy. Each matrix is
      scaled by a power of two near its largest entry first (exact), so that float64 weights of any finite size
      neither overflow nor underflow in the Gram.
    * ``"auto"``: for matrices stored in float32 or narrower, the Gram route, redone by the exact SVD for every
      matrix whose ``s_min < 1e-3 * s_1`` (where the Gram route's relative error could exceed ``1e-10``); every
      singular value is then within ``1e-10`` relative, or within the SVD's error, whichever is larger. Matrices
      stored in float64 (any member of a shape group) take the SVD.

    A matrix holding NaN or Inf gets an all-NaN spectrum, without disturbing the others. Matrices on an MPS device
    (which has no float64) are decomposed on the CPU; the others where they live.

    Grouped convolutions (``groups > 1``): the ``(out, in / groups * prod(kernel))`` matrix of such a layer stacks the
    filters of its ``g`` groups, each group ``g``-th of the rows seeing only its ``g``-th of the inputs. The layer's
    linear map is the block-diagonal ``out x (in * prod(kernel))`` matrix with the groups' ``(out / g, in / g *
    prod(kernel))`` blocks on its diagonal, whose singular values are the union of the blocks' own: that union is
    the spectrum returned (``min(out, in * prod(kernel))`` values, ``num_features = in * prod(kernel)``). The blocks
    are decomposed in the batches of their shape, by the route chosen for each. For a depthwise conv (one input
    channel per group) every block is one filter, and the spectrum is the filters' norms.

    Args:
        matrices: 2-D weight matrices, of any shapes, dtypes and devices.
        decomposition: ``"auto"``, ``"svd"`` or ``"gram"`` (:data:`DECOMPOSITIONS`).
        groups: the number of groups of the layer of each matrix (its rows split into that many equal blocks, as
            above); ``None``: 1 for every matrix.

    Returns:
        One :class:`~rank_lightning.functional.Spectrum` per matrix, in the given order, on the CPU (the scalars
        derived from it are then computed without a device round trip each).

    Raises:
        ValueError: an unknown ``decomposition``, a matrix that is not a non-empty 2-D tensor, or ``groups`` of
            another length than ``matrices`` or not dividing a matrix's rows.
    """
    check_choice("decomposition", decomposition, DECOMPOSITIONS)
    if groups is not None and any(g != 1 for g in groups):
        return _grouped_spectra(matrices, groups, decomposition)
    spectra: dict[int, Spectrum] = {}
    with torch.no_grad():
        for device, members in _shape_groups(matrices):
            group = [matrices[i] for i in members]
            route = "svd" if decomposition == "auto" and any(w.dtype == torch.float64 for w in group) else decomposition
            spectra.update(zip(members, _group_spectra(group, device, route)))
    return [spectra[i] for i in range(len(matrices))]


def _grouped_spectra(matrices: Sequence[Tensor], groups: Sequence[int], decomposition: str) -> list[Spectrum]:
    """:func:`weight_spectra` of matrices of grouped layers: each the union of its row blocks' spectra."""
    if len(groups) != len(matrices):
        raise ValueError(f"groups holds {len(groups)} values for {len(matrices)} matrices")
    blocks: list[Tensor] = []
    for index, (matrix, count) in enumerate(zip(matrices, groups)):
        if not isinstance(count, int) or count < 1 or matrix.ndim != 2 or matrix.shape[0] % count:
            raise ValueError(
                f"groups[{index}] = {count!r} does not split the {tuple(matrix.shape)} matrices[{index}] into equal "
                "row blocks (valid: a positive divisor of its rows)"
            )
        blocks += list(matrix.chunk(count)) if count > 1 else [matrix]
    parts = weight_spectra(blocks, decomposition=decomposition)  # type: ignore[arg-type]
    spectra, start = [], 0
    for matrix, count in zip(matrices, groups):
        own, start = parts[start : start + count], start + count
        if count == 1:
            spectra.append(own[0])
            continue
        values = torch.cat([spectrum.singular_values for spectrum in own]).sort(descending=True).values
        if not all(spectrum.is_finite for spectrum in own):
            values = torch.full_like(values, math.nan)
        spectra.append(Spectrum(values, matrix.shape[0], matrix.shape[1] * count))
    return spectra


def _shape_groups(matrices: Sequence[Tensor]) -> list[tuple[torch.device, list[int]]]:
    """Indices of the matrices decomposed together: same shape, same device (MPS counting as the CPU)."""
    groups: dict[tuple[tuple[int, ...], torch.device], list[int]] = {}
    for index, matrix in enumerate(matrices):
        if matrix.ndim != 2 or 0 in matrix.shape:
            raise ValueError(f"matrices[{index}] must be a non-empty 2-D matrix, got shape {tuple(matrix.shape)}")
        # MPS has no float64.
        device = torch.device("cpu") if matrix.device.type == "mps" else matrix.device
        groups.setdefault((tuple(matrix.shape), device), []).append(index)
    return [(device, members) for (_, device), members in groups.items()]


# Bytes of one float64 batch of same-shape matrices: a mixture of experts holds hundreds of matrices of one shape, all
# of which in one float64 batch would take several times the memory of the model's weights.
_BATCH_BYTES = 2**30


def _group_spectra(matrices: list[Tensor], device: torch.device, route: str) -> list[Spectrum]:
    """Spectra of same-shape matrices in batched decompositions by ``route``, ``_BATCH_BYTES`` of float64 at a time."""
    rows, cols = matrices[0].shape
    size = max(1, _BATCH_BYTES // (rows * cols * 8))
    with serial_if_small(torch.empty(0, device=device), min(rows, cols), SERIAL_SVD_BELOW):
        return [
            spectrum
            for start in range(0, len(matrices), size)
            for spectrum in _decomposed(matrices[start : start + size], device, route)
        ]


def _decomposed(matrices: list[Tensor], device: torch.device, route: str) -> list[Spectrum]:
    batch = torch.stack([w.detach().to(device=device, dtype=torch.float64) for w in matrices])  # (B, out, fan_in)
    finite = torch.isfinite(batch).flatten(1).all(dim=1)
    # LAPACK fails on non-finite input: decompose zeros there and mark the result NaN.
    batch = torch.where(finite[:, None, None], batch, 0.0)
    values = _svdvals(batch) if route == "svd" else _gram_svdvals(batch)  # (B, min(out, fan_in))
    if route == "auto":
        ill = values[:, -1] < _AUTO_CONDITION * values[:, 0]
        if bool(ill.any()):
            values[ill] = _svdvals(batch[ill])
    values = values.cpu()
    values[~finite.cpu()] = math.nan
    rows, cols = batch.shape[1:]
    return [Spectrum(row, rows, cols) for row in values]


def needs_exact_svd(spectrum: Spectrum) -> bool:
    """Whether ``decomposition="auto"`` redoes a Gram-route spectrum by the exact SVD: ``s_min < 1e-3 * s_1``.

    Below that condition number the Gram route's relative error ``eps64 * (s_1 / s_i)^2 / 2`` could exceed ``1e-10``
    (see :func:`weight_spectra`). A non-finite spectrum is not redone (the SVD of a non-finite matrix is NaN too).
    """
    values = spectrum.singular_values
    return bool(torch.isfinite(values).all()) and bool(values[-1] < _AUTO_CONDITION * values[0])


def weight_spectra_from_grams(grams: Sequence[Tensor], shapes: Sequence[tuple[int, int]]) -> list[Spectrum]:
    """Float64 spectra of weight matrices given by one of their Grams, one batched eigendecomposition per Gram size.

    The Gram route of :func:`weight_spectra` for matrices that are not held in one piece: the Gram of a matrix
    whose rows are split over processes is the sum of the pieces' Grams (``W^T W = sum_k W_k^T W_k``), so a summed
    Gram gives the spectrum without gathering the matrix. The singular values are the square roots of the
    eigenvalues of either Gram, ``W^T W`` (``fan_in x fan_in``) or ``W W^T`` (``out x out``); the larger Gram has
    ``|out - fan_in|`` extra eigenvalues at zero, which are dropped. Error bounds: those of the ``"gram"`` route.

    Args:
        grams: square Grams, ``W^T W`` or ``W W^T``, of any dtype and device (summed in float64 ideally).
        shapes: the ``(out, fan_in)`` shape of every matrix, in the order of ``grams``.

    Returns:
        One :class:`~rank_lightning.functional.Spectrum` per matrix (rows ``out`` as ``num_samples``), of length
        ``min(out, fan_in)``, on the CPU; an all-NaN spectrum for a Gram holding NaN or Inf.

    Raises:
        ValueError: a Gram that is not square or whose size is neither ``out`` nor ``fan_in`` of its shape.
    """
    if len(grams) != len(shapes):
        raise ValueError(f"{len(grams)} Grams for {len(shapes)} shapes")
    groups: dict[tuple[int, torch.device], list[int]] = {}
    for index, (gram, (rows, cols)) in enumerate(zip(grams, shapes)):
        if gram.ndim != 2 or gram.shape[0] != gram.shape[1] or gram.shape[0] not in (rows, cols):
            raise ValueError(
                f"grams[{index}] of shape {tuple(gram.shape)} is not a Gram of a {rows} x {cols} matrix "
                f"(valid: ({rows}, {rows}) or ({cols}, {cols}))"
            )
        device = torch.device("cpu") if gram.device.type == "mps" else gram.device
        groups.setdefault((gram.shape[0], device), []).append(index)
    spectra: dict[int, Spectrum] = {}
    with torch.no_grad():
        for (size, device), members in groups.items():
            batch = torch.stack([grams[i].detach().to(device=device, dtype=torch.float64) for i in members])
            # X^T X with d = size: X = W (d = fan_in, N = out) or X = W^T (d = out, N = fan_in).
            others = [shapes[i][0] if size == shapes[i][1] else shapes[i][1] for i in members]
            for i, spec in zip(members, spectra_from_grams(batch, others)):
                rows, cols = shapes[i]
                spectra[i] = Spectrum(spec.singular_values.cpu(), rows, cols)
    return [spectra[i] for i in range(len(grams))]


def _svdvals(batch: Tensor) -> Tensor:
    rows, cols = batch.shape[1:]
    if batch.device.type == "cuda" and max(rows, cols) <= 2 * min(rows, cols):
        return _jordan_wielandt_svdvals(batch)
    # Same singular values, but LAPACK's SVD of a wide matrix is several times slower than of its transpose (conv
    # kernels are wide: out < in * kh * kw).
    return torch.linalg.svdvals(batch.mT if rows < cols else batch)


# Bytes of the augmented matrices decomposed at once on CUDA.
_AUGMENTED_CHUNK_BYTES = 2**29


def _jordan_wielandt_svdvals(batch: Tensor) -> Tensor:
    """Singular values as the non-negative eigenvalues of ``[[0, W], [W^T, 0]]`` (Jordan-Wielandt).

    Its eigenvalues are ``+-s_i`` and ``|rows - cols|`` zeros. A symmetric eigensolver is backward stable like the
    SVD (absolute error a small multiple of ``eps64 * s_1`` on every value), and cuSOLVER's is several times faster
    than its SVD for near-square matrices (on an H100, 36 float64 768 x 768 matrices: 0.64 s against 2.0 s).
    """
    rows, cols = batch.shape[1:]
    size = rows + cols
    chunk = max(1, _AUGMENTED_CHUNK_BYTES // (size * size * batch.element_size()))
    values = []
    for part in batch.split(chunk):
        augmented = part.new_zeros(part.shape[0], size, size)
        augmented[:, rows:, :rows] = part.mT  # eigvalsh reads the lower triangle only
        values.append(torch.linalg.eigvalsh(augmented).flip(-1)[:, : min(rows, cols)].clamp_min(0))
    return torch.cat(values)


def _gram_svdvals(batch: Tensor) -> Tensor:
    # W W^T is the feature Gram of W^T: the smaller of the two Grams gives the same singular values.
    # Each matrix in units of a power of two near its largest entry (exact): float64 weights beyond 1e154 (or below
    # 1e-154) would overflow (underflow to zeros) in the Gram, giving NaN (every metric 0) for a finite matrix.
    exponents = torch.frexp(batch.abs().amax(dim=(1, 2))).exponent
    batch = torch.ldexp(batch, -exponents.view(-1, 1, 1))
    rows, cols = batch.shape[1:]
    grams = batch @ batch.mT if rows < cols else batch.mT @ batch
    spectra = spectra_from_grams(grams, [max(rows, cols)] * batch.shape[0])
    return torch.ldexp(torch.stack([spec.singular_values for spec in spectra]), exponents.view(-1, 1))
