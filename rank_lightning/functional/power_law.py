"""Power laws in spectra: the heavy-tail exponent of a weight matrix's eigenvalues (Martin & Mahoney, WeightWatcher's
``alpha``) by the Clauset-Shalizi-Newman fit, and the decay exponent of a ranked eigenspectrum (alpha-ReQ, Agrawal et
al. 2022) by least squares in log-log.

Two different exponents, easily confused:

* :func:`power_law_alpha` treats the eigenvalues as *samples* of a density and fits ``p(lambda) ~ lambda^-alpha`` to
  its tail ``lambda >= x_min`` (Clauset, Shalizi & Newman 2009, eq. 3.1 and Sec. 3.3). Heavy-tailed self-regularised
  layers have ``alpha`` roughly in ``[2, 6]`` (Martin & Mahoney 2021).
* :func:`spectral_decay_alpha` treats the eigenvalues as a *ranked sequence* and fits ``lambda_i ~ i^-alpha``
  (Agrawal et al. 2022, alpha-ReQ; Stringer et al. 2019). A density tail ``p(lambda) ~ lambda^-a`` corresponds to a
  rank decay ``lambda_i ~ i^(-1 / (a - 1))``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from rank_lightning.validation import check_non_negative, check_positive_int

__all__ = ["PowerLawFit", "SpectralDecayFit", "power_law_alpha", "spectral_decay_alpha"]

# Candidate x_min values are scored in blocks of about this many (candidate, tail point) pairs: the full
# n x n table of a 4,096-eigenvalue spectrum would take 128 MiB in float64.
_BLOCK_PAIRS = 1 << 20


class PowerLawFit(NamedTuple):
    """A continuous power law ``p(x) = (alpha - 1) / x_min * (x / x_min)^-alpha`` fitted to the tail ``x >= x_min``.

    Attributes:
        alpha: the maximum-likelihood exponent ``1 + n / sum_{x_i >= x_min} log(x_i / x_min)`` (Clauset et al.
            eq. 3.1); NaN when no fit was possible.
        x_min: the chosen lower bound of the tail (one of the eigenvalues).
        ks_distance: Kolmogorov-Smirnov distance between the tail's empirical CDF and the fitted CDF, the quantity
            ``x_min`` minimises (Clauset et al. eq. 3.9).
        num_tail: n, the eigenvalues ``>= x_min`` behind the fit.
        sigma: standard error of ``alpha``, ``(alpha - 1) / sqrt(n)`` (Clauset et al. eq. 3.2).
        num_eigenvalues: eigenvalues above ``min_eigenvalue`` that the fit considered.
    """

    alpha: float
    x_min: float
    ks_distance: float
    num_tail: int
    sigma: float
    num_eigenvalues: int


def _failed(num_eigenvalues: int) -> PowerLawFit:
    return PowerLawFit(math.nan, math.nan, math.nan, 0, math.nan, num_eigenvalues)


def power_law_alpha(eigenvalues: Tensor, *, min_eigenvalue: float = 1e-5) -> PowerLawFit:
    """Heavy-tail exponent ``alpha`` of an eigenvalue spectrum, ``p(lambda) ~ lambda^-alpha`` above ``x_min``.

    The Clauset, Shalizi & Newman (2009) method, as WeightWatcher fits its ``alpha`` (Martin & Mahoney 2021):

    1. keep the eigenvalues above ``min_eigenvalue`` (absolute; WeightWatcher's ``EVALS_THRESH = 1e-5``), sorted
       ascending ``x_1 <= ... <= x_m``;
    2. for every candidate ``x_min = x_j`` except the largest, the maximum-likelihood exponent of the tail
       ``x_j..x_m`` (``n = m - j + 1`` values): ``alpha_j = 1 + n / sum_{i >= j} log(x_i / x_j)`` (eq. 3.1);
    3. its Kolmogorov-Smirnov distance ``D_j = max_{k < n} |(1 - (x_{j+k} / x_j)^(1 - alpha_j)) - k / n|``, the
       fitted CDF against the empirical CDF just below each tail point (WeightWatcher's convention; a candidate with
       ``alpha_j <= 1`` scores ``D_j = 1``);
    4. the fit is the candidate with the smallest ``D_j`` (eq. 3.9; the first one on ties).

    Conventions to match WeightWatcher's ``alpha`` on the same matrix: the eigenvalues are ``s_i^2`` of the weight
    matrix itself (those of ``W^T W``, unnormalised: WeightWatcher's default ``normalize=False``); WeightWatcher
    splits a ``k x k`` conv kernel into ``k^2`` matrices and pools their eigenvalues, and scales conv weights by
    ``1/sqrt(2)`` first (``conv2d_norm``), so its conv ``alpha`` is not the ``alpha`` of the reshaped
    ``out x (in * k^2)`` matrix; and below 20 eigenvalues it switches to a bias-corrected exponent
    ``1 + (n - 1) / sum log(x_i / x_min)`` with another objective, while this function keeps the method above for
    every size.

    Args:
        eigenvalues: 1-D eigenvalues (``s_i^2`` of a weight matrix), any order; NaN, Inf and values at or below
            ``min_eigenvalue`` are left out.
        min_eigenvalue: eigenvalues at or below it are treated as zero and left out.

    Returns:
        The :class:`PowerLawFit`; all NaN (``num_tail = 0``) with fewer than two usable eigenvalues or when every
        usable eigenvalue is equal.
    """
    check_non_negative("min_eigenvalue", min_eigenvalue)
    if eigenvalues.ndim != 1:
        raise ValueError(f"eigenvalues must be 1-D, got shape {tuple(eigenvalues.shape)}")
    x = eigenvalues.detach().to(torch.float64)
    x = torch.sort(x[torch.isfinite(x) & (x > min_eigenvalue)]).values
    m = x.shape[0]
    if m < 2 or bool(x[0] == x[-1]):
        return _failed(m)
    log_x = x.log()
    # Tail sums of log x by a reverse cumulative sum: sum_{i >= j} log x_i for every j.
    tail_log = log_x.flip(0).cumsum(0).flip(0)
    j = torch.arange(m - 1, device=x.device)
    n = (m - j).to(torch.float64)
    spread = tail_log[:-1] - n * log_x[:-1]
    alphas = torch.where(spread > 0, 1 + n / spread, torch.full_like(n, math.nan))
    distances = _ks_distances(log_x, alphas)
    best = int(torch.argmin(distances))
    alpha = float(alphas[best])
    tail = int(n[best])
    return PowerLawFit(alpha, float(x[best]), float(distances[best]), tail, (alpha - 1) / math.sqrt(tail), m)


def _ks_distances(log_x: Tensor, alphas: Tensor) -> Tensor:
    """``D_j`` of every candidate ``x_min = x_j`` (``log_x`` of ``x`` sorted ascending), in blocks of candidates.

    A block of candidates ``j in [start, stop)`` needs the points ``k >= start`` only; points below a candidate's
    ``x_min`` are masked.
    """
    m = log_x.shape[0]
    distances = torch.ones(m - 1, dtype=torch.float64, device=log_x.device)
    step = max(1, _BLOCK_PAIRS // m)
    for start in range(0, m - 1, step):
        stop = min(start + step, m - 1)
        j = torch.arange(start, stop, dtype=torch.float64, device=log_x.device).unsqueeze(1)  # (b, 1) candidates
        points = torch.arange(start, m, dtype=torch.float64, device=log_x.device).unsqueeze(0)  # (1, m - start)
        empirical = (points - j) / (m - j)  # k / n within each candidate's tail; negative below its x_min
        # Fitted CDF 1 - (x / x_min)^(1 - alpha), in place on one (b, m - start) block.
        gap = log_x[start:].unsqueeze(0) - log_x[start:stop].unsqueeze(1)
        gap.mul_((1 - alphas[start:stop]).unsqueeze(1)).expm1_().neg_()
        gap.sub_(empirical).abs_().masked_fill_(empirical < 0, 0)
        block = gap.amax(dim=1)
        valid = torch.isfinite(alphas[start:stop]) & (alphas[start:stop] > 1)
        distances[start:stop] = torch.where(valid, block, torch.ones_like(block))
    return distances


class SpectralDecayFit(NamedTuple):
    """A power-law decay ``lambda_i ~ c * i^-alpha`` of ranked eigenvalues, fitted by least squares in log-log.

    Attributes:
        alpha: the decay exponent (minus the slope of ``log lambda_i`` against ``log i``); NaN without a fit.
        r_squared: coefficient of determination of the log-log fit.
        first_index: the first rank used (1-based).
        last_index: the last rank used (1-based, inclusive).
    """

    alpha: float
    r_squared: float
    first_index: int
    last_index: int


def spectral_decay_alpha(
    eigenvalues: Tensor, *, first_index: int = 1, last_index: int | None = None, min_eigenvalue: float = 0.0
) -> SpectralDecayFit:
    """alpha-ReQ: the exponent of ``lambda_i ~ i^-alpha`` over ranks ``first_index..last_index`` (Agrawal et al. 2022).

    Ordinary least squares of ``log lambda_i`` on ``log i`` (1-based ranks ``i`` of the eigenvalues sorted
    descending); ``alpha`` is minus the slope. Agrawal et al. fit the eigenvalues of the (centred) covariance of the
    representations; their released code fits a fixed rank range (ranks 11 to 100 by default) with weights ``1 / i``,
    while this function weighs every rank equally over the range given (unweighted, as the paper's definition
    reads). Ranks whose eigenvalue is at or below ``min_eigenvalue`` (zeros of a rank-deficient spectrum, whose
    logarithm is ``-inf``) are left out of the fit.

    Args:
        eigenvalues: 1-D eigenvalues (any order; sorted descending here).
        first_index: first rank of the fit, 1-based.
        last_index: last rank (inclusive); ``None`` for the last one.
        min_eigenvalue: eigenvalues at or below it are left out.

    Returns:
        The :class:`SpectralDecayFit`; NaN ``alpha`` when fewer than two ranks remain or the spectrum is not finite.
    """
    check_positive_int("first_index", first_index)
    check_positive_int("last_index", last_index, allow_none=True)
    check_non_negative("min_eigenvalue", min_eigenvalue)
    if last_index is not None and last_index < first_index:
        raise ValueError(f"last_index={last_index} is below first_index={first_index}")
    if eigenvalues.ndim != 1:
        raise ValueError(f"eigenvalues must be 1-D, got shape {tuple(eigenvalues.shape)}")
    values = torch.sort(eigenvalues.detach().to(torch.float64), descending=True).values
    last = values.shape[0] if last_index is None else min(last_index, values.shape[0])
    if not bool(torch.isfinite(values).all()):
        return SpectralDecayFit(math.nan, math.nan, first_index, last)
    ranks = torch.arange(1, values.shape[0] + 1, dtype=torch.float64, device=values.device)
    keep = (ranks >= first_index) & (ranks <= last) & (values > min_eigenvalue)
    if int(keep.sum()) < 2:
        return SpectralDecayFit(math.nan, math.nan, first_index, last)
    log_i, log_l = ranks[keep].log(), values[keep].log()
    di, dl = log_i - log_i.mean(), log_l - log_l.mean()
    slope = (di * dl).sum() / di.square().sum()
    total = dl.square().sum()
    residual = (dl - slope * di).square().sum()
    r_squared = float(1 - residual / total) if total > 0 else math.nan
    return SpectralDecayFit(float(-slope), r_squared, first_index, last)
