"""Rank-k projections of symmetric matrices: ensemble Nyström (Sanyal et al. Sec. 3.3) and exact eigh.

Both projections return a symmetric positive semidefinite matrix of rank at most ``k``, the set the LR-Layer's weight
must stay in (Sanyal et al. Sec. 3.3-3.4, Lemma 3.1):

* :func:`exact_projection` is the closest such matrix in Frobenius norm: the top-``k`` *positive* eigenpairs of the
  symmetrised input. Negative eigenvalues are dropped even when their magnitude is large; Sanyal et al. eq. 5 keeps the
  largest singular values whatever the sign, which for a symmetric indefinite matrix leaves the PSD set the Nyström
  argument relies on.
* :func:`nystrom_projection` approximates it from ``l = oversampling * k`` sampled columns at ``O(m l k + m^2 k)``
  cost instead of the ``O(m^3)`` of a full eigendecomposition.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from rank_lightning.functional.spectral import serial_if_small
from rank_lightning.validation import check_bool, check_positive

__all__ = ["PROJECTION_METHODS", "exact_projection", "nystrom_projection", "rank_projection"]

PROJECTION_METHODS = ("exact", "nystrom")

# Decompositions of W_II that fail to converge are retried with this many jitter shifts at most.
_MAX_FAILED_DECOMPOSITIONS = 100


def _check_square(w: Tensor, k: int) -> None:
    if not isinstance(w, Tensor):
        raise TypeError(f"w must be a torch.Tensor, got {type(w).__name__}")
    if w.ndim != 2 or w.shape[0] != w.shape[1]:
        raise ValueError(f"w must be a square matrix, got shape {tuple(w.shape)}")
    if not w.is_floating_point():
        raise TypeError(f"w must be a floating-point tensor, got dtype {w.dtype}")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= w.shape[0]:
        raise ValueError(f"k must be an integer in [1, {w.shape[0]}] (the size of w), got {k!r}")


def _check_finite(w: Tensor, what: str) -> None:
    if not torch.isfinite(w).all():
        raise ValueError(f"{what} contains NaN or Inf values; a rank projection of it is undefined")


def exact_projection(w: Tensor, k: int) -> Tensor:
    """Closest symmetric PSD matrix of rank at most ``k`` to ``W``, from a full eigendecomposition.

    Reference for the Nyström projection (Sanyal et al. eq. 5 restricted to PSD matrices): with
    ``(W + W^T) / 2 = sum_i lambda_i q_i q_i^T``, the result is ``sum_{i <= k, lambda_i > 0} lambda_i q_i q_i^T``.
    Fewer than ``k`` positive eigenvalues give a rank below ``k``; negative eigenvalues are always dropped.

    Args:
        w: (m, m) matrix; only its symmetric part ``(W + W^T) / 2`` is used.
        k: target rank, ``1 <= k <= m``.

    Returns:
        (m, m) symmetric PSD matrix of rank at most ``k``, in the dtype of ``w``. The eigendecomposition runs in that
        dtype too (float32 for float32 weights, the trade-off made at ``m = 16,384``), and in float32 for float16 and
        bfloat16 weights, for which ``torch.linalg.eigh`` has no kernel.

    Raises:
        ValueError: if ``w`` is not square, ``k`` is out of range or ``w`` holds NaN or Inf.
    """
    _check_square(w, k)
    _check_finite(w, "w")
    work = w.to(torch.promote_types(w.dtype, torch.float32))
    sym = (work + work.T) / 2
    eigenvalues, eigenvectors = torch.linalg.eigh(sym)  # ascending
    top_values = eigenvalues[-k:].clamp(min=0)
    top_vectors = eigenvectors[:, -k:]
    return ((top_vectors * top_values) @ top_vectors.T).to(w.dtype)


def _nystrom_factor(w: Tensor, k: int, num_columns: int, generator: torch.Generator | None, jitter: float) -> Tensor:
    """One Nyström run: a factor ``F`` (m x r, r <= k) with ``C W_k^+ C^T = F F^T`` (Sanyal et al. eq. 6)."""
    m = w.shape[0]
    index_device = generator.device if generator is not None else w.device
    index = torch.randperm(m, generator=generator, device=index_device)[:num_columns].to(w.device)
    # Symmetrising only the sampled rows and columns costs O(m l) instead of O(m^2).
    columns = (w[:, index] + w[index, :].T) / 2  # C, (m, l)
    _check_finite(columns, "the sampled columns of w")
    core = columns[index].to(torch.float64)  # W_II, (l, l)
    identity = torch.eye(num_columns, dtype=torch.float64, device=w.device)

    # Sanyal et al. Sec. 3.3 and footnote 4: add 0.01 * I to W_II until the decomposition converges.
    shift = 0.0
    for _ in range(_MAX_FAILED_DECOMPOSITIONS):
        try:
            with serial_if_small(core, core.shape[0]):
                eigenvalues, eigenvectors = torch.linalg.eigh(core + shift * identity)  # ascending
            break
        except torch.linalg.LinAlgError:
            shift += jitter
    else:
        raise RuntimeError(
            f"the eigendecomposition of the sampled {num_columns} x {num_columns} block did not converge after "
            f"{_MAX_FAILED_DECOMPOSITIONS} shifts of {jitter} * I"
        )

    # W_k^+: pseudo-inverse of the best rank-k PSD approximation of W_II, from its top-k positive eigenpairs.
    top_values = eigenvalues[-k:]
    top_vectors = eigenvectors[:, -k:]
    # Entries of W carry the rounding error of its own dtype: eigenvalues below l * eps * max|lambda| are noise and,
    # as in a pseudo-inverse, are not inverted. Half precisions count as float32, the precision the exact projection
    # decomposes them in: with bfloat16's eps (2^-7) the cut reaches max|lambda| at l = 128 columns and everything
    # would be dropped (a zero projection for every k >= 64).
    eps = torch.finfo(torch.promote_types(w.dtype, torch.float32)).eps
    keep = top_values > num_columns * eps * eigenvalues.abs().max()
    half_inverse = top_vectors[:, keep] / top_values[keep].sqrt()  # W_k^+ = half_inverse @ half_inverse.T
    return columns @ half_inverse.to(w.dtype)


def nystrom_projection(
    w: Tensor,
    k: int,
    *,
    num_runs: int = 1,
    oversampling: int = 2,
    generator: torch.Generator | None = None,
    jitter: float = 0.01,
    truncate: bool = True,
) -> Tensor:
    """Ensemble Nyström rank-``k`` projection of a symmetric matrix (Sanyal et al. Sec. 3.3, eq. 6, Lemma 3.1).

    Each run samples ``l = oversampling * k`` indices ``I`` uniformly without replacement, takes ``C = W[:, I]`` and
    ``W_II = W[I, I]``, adds ``jitter * I`` to ``W_II`` until its eigendecomposition succeeds, and forms
    ``X_k = C W_k^+ C^T`` with ``W_k^+`` the pseudo-inverse of the best rank-``k`` PSD approximation of ``W_II`` (its
    top-``k`` positive eigenpairs). The ``num_runs`` results are averaged (Kumar et al. 2009, uniform weights).

    "Succeeds" means that the eigensolver converges (Sanyal et al.: "until the SVD algorithm converges"; it can fail
    on ill-conditioned matrices), so in practice no shift is applied. Negative eigenvalues of ``W_II`` (``W`` not PSD,
    or rounding) trigger no shift: they are excluded from ``W_k^+``, which keeps ``X_k`` PSD as Lemma 3.1 requires.
    Shifting until ``W_II`` is PSD would instead bias almost every projection inside the LR-Layer, where the update
    makes ``W`` slightly indefinite and the eigenvalues of ``W_II`` (about ``l/m`` times those of ``W``) are often
    comparable to 0.01.

    Deviation from the paper: an average of ``t`` rank-``k`` matrices can have rank ``t * k``. With ``truncate=True``
    (default) the average is replaced by its own best rank-``k`` approximation, computed from the ``m x (t k)``
    factor of the average at ``O(m (t k)^2)`` extra cost, so the result always has rank at most ``k``. A single run
    needs no truncation. ``truncate=False`` returns the plain average of Kumar et al.

    For a PSD ``W`` whose rank is at most ``k`` and whose range is spanned by the sampled columns, the projection
    reproduces ``W`` exactly; ``l >= m`` samples every column and gives the exact projection of a PSD ``W``.

    Args:
        w: (m, m) matrix; only its symmetric part ``(W + W^T) / 2`` is used.
        k: target rank, ``1 <= k <= m``.
        num_runs: number ``t`` of independent Nyström runs averaged.
        oversampling: ``l / k``; Sanyal et al. use ``l = 2k``. ``l`` is capped at ``m``.
        generator: random generator for the column indices (share one seed across DDP ranks so that every rank
            projects identically).
        jitter: the multiple of the identity added to ``W_II`` per failed attempt (0.01 in the paper).
        truncate: truncate the ensemble average to rank ``k``.

    Returns:
        (m, m) symmetric PSD matrix of rank at most ``k`` (at most ``num_runs * k`` with ``truncate=False``), in the
        dtype of ``w``.

    Raises:
        ValueError: on a non-square ``w``, ``k`` out of range, non-positive ``num_runs``, ``oversampling`` or
            ``jitter``, or NaN / Inf in the sampled entries.
    """
    _check_square(w, k)
    if isinstance(num_runs, bool) or not isinstance(num_runs, int) or num_runs < 1:
        raise ValueError(f"num_runs must be a positive integer, got {num_runs!r}")
    if isinstance(oversampling, bool) or not isinstance(oversampling, int) or oversampling < 1:
        raise ValueError(f"oversampling must be a positive integer, got {oversampling!r}")
    check_positive("jitter", jitter)
    check_bool("truncate", truncate)
    num_columns = min(oversampling * k, w.shape[0])
    factors = [_nystrom_factor(w, k, num_columns, generator, jitter) for _ in range(num_runs)]
    factor = torch.cat(factors, dim=1) / math.sqrt(num_runs)  # (m, <= t k); average = factor @ factor.T
    if truncate and factor.shape[1] > k:
        # The top-k eigenvectors V_k of F^T F give the best rank-k approximation (F V_k)(F V_k)^T of F F^T.
        gram = (factor.T @ factor).to(torch.float64)
        with serial_if_small(gram, gram.shape[0]):
            _, vectors = torch.linalg.eigh(gram)
        factor = factor @ vectors[:, -k:].to(factor.dtype)
    return factor @ factor.T


def rank_projection(w: Tensor, k: int, method: str = "nystrom", **options: object) -> Tensor:
    """Rank-``k`` symmetric PSD projection ``Pi_k(W)`` by method name (Sanyal et al. eq. 5, Alg. 1).

    Args:
        w: (m, m) matrix; only its symmetric part is used.
        k: target rank.
        method: ``"nystrom"`` (:func:`nystrom_projection`) or ``"exact"`` (:func:`exact_projection`).
        **options: keyword arguments of the chosen projection (``num_runs``, ``generator``, ... for Nyström).

    Returns:
        (m, m) symmetric PSD matrix of rank at most ``k``.

    Raises:
        ValueError: on an unknown ``method``.
    """
    if method == "nystrom":
        return nystrom_projection(w, k, **options)
    if method == "exact":
        return exact_projection(w, k, **options)
    raise ValueError(f"unknown projection method {method!r}; valid methods are: {', '.join(PROJECTION_METHODS)}")
