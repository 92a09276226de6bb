import math

import mpmath
import numpy as np
import pytest
import torch
from scipy.special import digamma

from rank_lightning.functional.theory import (
    gaussian_product_log_singular_ratio,
    gaussian_product_numerical_rank,
    gaussian_product_singular_ratio,
)

N = 8


def test_closed_form_values():
    # psi(1/2) - psi(1) = -2 log 2, so for n = 2 the second singular value decays by exactly 1/2 per layer.
    assert gaussian_product_singular_ratio(2, 2).item() == pytest.approx(0.5, rel=1e-12)
    assert gaussian_product_singular_ratio(2, 2, depth=10).item() == pytest.approx(0.5**10, rel=1e-10)
    ratios = gaussian_product_singular_ratio(N)
    assert ratios.shape == (N,) and ratios.dtype == torch.float64
    assert ratios[0].item() == 1.0
    assert torch.all(ratios[1:] < ratios[:-1])
    torch.testing.assert_close(gaussian_product_log_singular_ratio(N, torch.tensor([3, 5])), ratios[[2, 4]].log())


def _mc_log_ratios(depth: int, seeds: range) -> np.ndarray:
    """(1/L) log(s_k / s_1) of products of L standard Gaussian N x N matrices, in 50-digit arithmetic.

    The smallest ratios fall far below float64's relative precision (about exp(-1.6 L)), hence mpmath.
    """
    mpmath.mp.dps = 50
    rates = []
    for seed in seeds:
        rng = np.random.default_rng(seed)
        product = mpmath.eye(N)
        for _ in range(depth):
            product = mpmath.matrix(rng.standard_normal((N, N)).tolist()) * product
        logs = sorted((float(mpmath.log(s)) for s in mpmath.svd_r(product, compute_uv=False)), reverse=True)
        rates.append((np.array(logs) - logs[0]) / depth)
    return np.mean(rates, axis=0)


def test_theorem5_matches_monte_carlo_products():
    """Feng et al. Theorem 5 at n = 8 against exact SVDs of 16 products of depth 60.

    At finite depth log s_1 carries an O(1/L) bias (about 0.1 at L = 40 for the smallest k, half that at L = 80) and
    the mean over 16 seeds a standard error up to 0.04, hence the tolerance of 0.12 on rates of up to 1.6 in size.
    """
    predicted = gaussian_product_log_singular_ratio(N).numpy()
    measured = _mc_log_ratios(depth=60, seeds=range(16))
    np.testing.assert_allclose(measured, predicted, atol=0.12)
    # The prediction is far more specific than the tolerance: halving or shifting psi's argument misses.
    assert np.abs(measured - 2 * predicted).max() > 0.5


def test_theorem5_rates_are_the_lyapunov_spectrum_at_large_depth():
    """QR iteration (the stable way to follow a long product) gives the exponents of 4,000-layer products."""
    rng = np.random.default_rng(0)
    depth = 4000
    basis = np.eye(N)
    log_growth = np.zeros(N)
    for _ in range(depth):
        basis, triangle = np.linalg.qr(rng.standard_normal((N, N)) @ basis)
        log_growth += np.log(np.abs(np.diag(triangle)))
    exponents = log_growth / depth
    predicted = gaussian_product_log_singular_ratio(N).numpy()
    np.testing.assert_allclose(exponents - exponents[0], predicted, atol=0.05)
    # Feng et al. Corollary 1: log s_1 grows like L (log 2 + psi(n / 2)) / 2.
    assert exponents[0] == pytest.approx((math.log(2) + digamma(N / 2)) / 2, abs=0.03)


def test_predicted_numerical_rank_counts_ratios_above_the_tolerance():
    eps = float(np.finfo(np.float32).eps) * 128
    for depth in (1, 10, 50, 200):
        ratios = gaussian_product_singular_ratio(128, depth=depth)
        assert gaussian_product_numerical_rank(128, depth) == int((ratios >= eps).sum())
    ranks = [gaussian_product_numerical_rank(128, depth) for depth in (1, 5, 20, 50, 100, 1000)]
    assert ranks[0] == 128
    assert ranks == sorted(ranks, reverse=True) and ranks[-1] < ranks[2]
    assert gaussian_product_numerical_rank(128, 10**6) == 1
    assert gaussian_product_numerical_rank(16, 30, rank_tolerance=0.5) == int(
        (gaussian_product_log_singular_ratio(16, depth=30) >= math.log(0.5)).sum()
    )


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match=r"k must lie in \[1, 8\]"):
        gaussian_product_singular_ratio(8, 9)
    with pytest.raises(ValueError, match="n must be a positive integer"):
        gaussian_product_singular_ratio(0)
    with pytest.raises(ValueError, match="rank_tolerance must be a positive number"):
        gaussian_product_numerical_rank(8, 3, rank_tolerance=0.0)
