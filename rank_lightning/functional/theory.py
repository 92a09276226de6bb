"""Closed-form predictions for the rank of deep products of Gaussian matrices (Feng et al. Theorem 5, Corollary 1).

For the product ``J = W_L ... W_1`` of ``L`` independent ``n x n`` matrices with i.i.d. standard Gaussian entries,
Feng et al. Theorem 5 states that almost surely

    ``lim_{L -> inf} (s_k / s_1)^(1 / L) = exp((psi((n - k + 1) / 2) - psi(n / 2)) / 2)``,  ``psi`` = digamma,

i.e. the ``k``-th singular value decays relative to the first at a fixed exponential rate per layer. These are the
Lyapunov exponents ``(log 2 + psi((n - k + 1) / 2)) / 2`` of the Gaussian matrix product, shifted by the top one.
Scaling the matrices by a constant changes no ratio, so the prediction holds for any weight scale.
"""

from __future__ import annotations

import numpy as np
import torch
from scipy.special import digamma
from torch import Tensor

from rank_lightning.functional.spectral import default_rank_tolerance
from rank_lightning.validation import check_positive, check_positive_int

__all__ = [
    "gaussian_product_log_singular_ratio",
    "gaussian_product_numerical_rank",
    "gaussian_product_singular_ratio",
]


def _indices(n: int, k: int | Tensor | np.ndarray | None) -> np.ndarray:
    check_positive_int("n", n)
    ks = np.arange(1, n + 1) if k is None else np.asarray(k.cpu() if isinstance(k, Tensor) else k, dtype=np.int64)
    if ks.size and (ks.min() < 1 or ks.max() > n):
        raise ValueError(f"k must lie in [1, {n}], got values in [{ks.min()}, {ks.max()}]")
    return ks


def gaussian_product_log_singular_ratio(
    n: int, k: int | Tensor | np.ndarray | None = None, depth: float = 1.0
) -> Tensor:
    """Predicted ``log(s_k / s_1)`` of a product of ``depth`` Gaussian ``n x n`` matrices (Feng et al. Theorem 5).

    ``depth * (psi((n - k + 1) / 2) - psi(n / 2)) / 2``: exact as a rate (divided by ``depth``) in the limit of
    infinite depth. Working with logarithms keeps deep products, whose ratios underflow float64, representable.

    Args:
        n: width of the square matrices.
        k: singular-value index (1-based) or an array of them; ``None`` gives ``k = 1, ..., n``.
        depth: number of factors ``L``; ``1`` gives the per-layer rate.

    Returns:
        float64 tensor shaped like ``k`` (non-positive; 0 at ``k = 1``).
    """
    ks = _indices(n, k)
    check_positive("depth", depth)
    rate = (digamma((n - ks + 1) / 2) - digamma(n / 2)) / 2
    return torch.from_numpy(np.asarray(depth * rate, dtype=np.float64))


def gaussian_product_singular_ratio(n: int, k: int | Tensor | np.ndarray | None = None, depth: float = 1.0) -> Tensor:
    """Predicted ``s_k / s_1`` of a product of ``depth`` Gaussian ``n x n`` matrices (Feng et al. Theorem 5, eq. 10).

    With ``depth = 1`` this is the limit of ``(s_k / s_1)^(1 / L)``,
    ``exp((psi((n - k + 1) / 2) - psi(n / 2)) / 2)``; with ``depth = L`` it is the predicted ratio itself.

    Args:
        n: width of the square matrices.
        k: singular-value index (1-based) or an array of them; ``None`` gives ``k = 1, ..., n``.
        depth: number of factors ``L``.

    Returns:
        float64 tensor shaped like ``k``, in ``(0, 1]`` (deep ratios may underflow to 0).
    """
    return gaussian_product_log_singular_ratio(n, k, depth).exp()


def gaussian_product_numerical_rank(n: int, depth: float, *, rank_tolerance: float | None = None) -> int:
    """Predicted numerical rank of a product of ``depth`` Gaussian ``n x n`` matrices (Feng et al. Theorem 5).

    The number of ``k`` whose predicted ratio ``s_k / s_1`` reaches the tolerance, ``#{k : s_k / s_1 >= eps}``
    (Feng et al. eq. 4), compared in log space so that deep products do not underflow.

    Args:
        n: width of the square matrices.
        depth: number of factors ``L``.
        rank_tolerance: relative tolerance ``eps``; ``None`` takes the default of the numerical rank,
            ``finfo(float32).eps * n``.

    Returns:
        The predicted rank, between 1 and ``n``.
    """
    check_positive("rank_tolerance", rank_tolerance, allow_none=True)
    check_positive_int("n", n)  # before the default tolerance, which is computed from it
    eps = default_rank_tolerance(n, n) if rank_tolerance is None else rank_tolerance
    return int((gaussian_product_log_singular_ratio(n, None, depth) >= np.log(eps)).sum())
