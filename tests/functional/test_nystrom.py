"""Rank-k projections: exact eigh reference and ensemble Nyström (Sanyal et al. Sec. 3.3)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rank_lightning.functional import exact_projection, nystrom_projection, rank_projection
from rank_lightning.functional import nystrom as nystrom_module


def _psd(m: int, eigenvalues: np.ndarray, seed: int = 0) -> torch.Tensor:
    """Symmetric PSD matrix with a random orthonormal eigenbasis and the given eigenvalues (padded with zeros)."""
    rng = np.random.default_rng(seed)
    q, _ = np.linalg.qr(rng.standard_normal((m, m)))
    values = np.zeros(m)
    values[: len(eigenvalues)] = eigenvalues
    return torch.from_numpy((q * values) @ q.T)


def _numpy_best_psd(w: np.ndarray, k: int) -> np.ndarray:
    values, vectors = np.linalg.eigh((w + w.T) / 2)
    values, vectors = values[::-1][:k], vectors[:, ::-1][:, :k]
    values = np.maximum(values, 0)
    return (vectors * values) @ vectors.T


def _assert_symmetric_psd_rank(x: torch.Tensor, k: int) -> None:
    x64 = x.double()
    scale = x64.abs().max().item() or 1.0
    assert torch.allclose(x64, x64.T, atol=1e-10 * scale)
    eigenvalues = torch.linalg.eigvalsh((x64 + x64.T) / 2)
    assert eigenvalues.min().item() >= -1e-10 * scale
    assert torch.linalg.matrix_rank(x64, hermitian=True).item() <= k


def test_exact_projection_matches_numpy_and_drops_negative_eigenvalues() -> None:
    rng = np.random.default_rng(1)
    a = rng.standard_normal((40, 40))
    w = a + a.T  # indefinite, about half the eigenvalues negative
    result = exact_projection(torch.from_numpy(w), 6)
    np.testing.assert_allclose(result.numpy(), _numpy_best_psd(w, 6), atol=1e-10)
    _assert_symmetric_psd_rank(result, 6)
    # Only negative eigenvalues: the closest PSD matrix is zero.
    assert exact_projection(torch.from_numpy(-(a @ a.T)), 3).abs().max().item() < 1e-10


def test_exact_projection_uses_symmetric_part() -> None:
    rng = np.random.default_rng(2)
    w = rng.standard_normal((20, 20))
    np.testing.assert_allclose(exact_projection(torch.from_numpy(w), 4).numpy(), _numpy_best_psd(w, 4), atol=1e-10)


@pytest.mark.parametrize("num_runs", [1, 3])
@pytest.mark.parametrize("kind", ["psd", "indefinite"])
def test_nystrom_is_symmetric_psd_with_rank_at_most_k(num_runs: int, kind: str) -> None:
    rng = np.random.default_rng(3)
    a = torch.from_numpy(rng.standard_normal((60, 60)))
    w = a @ a.T / 60 if kind == "psd" else a + a.T
    result = nystrom_projection(w, 7, num_runs=num_runs, generator=torch.Generator().manual_seed(0))
    _assert_symmetric_psd_rank(result, 7)
    assert result.abs().max() > 0


def test_nystrom_without_truncation_is_the_plain_ensemble_average() -> None:
    w = _psd(60, np.linspace(3.0, 0.5, 60), seed=4)
    generator = torch.Generator().manual_seed(5)
    average = nystrom_projection(w, 5, num_runs=3, generator=generator, truncate=False)
    generator = torch.Generator().manual_seed(5)
    runs = [nystrom_projection(w, 5, generator=generator) for _ in range(3)]
    torch.testing.assert_close(average, sum(runs) / 3, rtol=0, atol=1e-10)
    # The plain average exceeds the target rank, the default truncation does not.
    assert torch.linalg.matrix_rank(average, hermitian=True).item() > 5
    generator = torch.Generator().manual_seed(5)
    truncated = nystrom_projection(w, 5, num_runs=3, generator=generator)
    torch.testing.assert_close(truncated, exact_projection(average, 5), rtol=0, atol=1e-10)


@pytest.mark.parametrize("rank", [3, 8])
def test_nystrom_recovers_a_psd_matrix_of_rank_at_most_k_exactly(rank: int) -> None:
    # A rank-r PSD matrix with a generic eigenbasis is reproduced from any l >= r sampled columns (Sanyal eq. 6).
    w = _psd(80, np.linspace(2.0, 1.0, rank), seed=rank)
    result = nystrom_projection(w, 8, generator=torch.Generator().manual_seed(0))
    assert (result - w).norm() / w.norm() < 1e-10


def test_nystrom_with_all_columns_is_the_exact_projection() -> None:
    w = _psd(30, np.linspace(5.0, 0.1, 30), seed=6)
    result = nystrom_projection(w, 15, oversampling=2)  # l = 30 = m
    torch.testing.assert_close(result, exact_projection(w, 15), rtol=0, atol=1e-10)


def test_nystrom_is_close_to_exact_on_psd_low_rank_plus_noise() -> None:
    # Rank-20 signal (eigenvalues 10..1) plus a flat tail of 0.01; the exact projection leaves a relative residual
    # ||W - Pi_k(W)|| / ||W|| of 0.0049. Tolerance: relative Frobenius distance of Nystrom to the exact projection
    # below 0.03 (about 6x that residual; observed 0.015-0.026 for single runs) on average over seeds, and the
    # 4-run ensemble closer than single runs.
    m, k = 200, 20
    w = _psd(m, np.concatenate([np.linspace(10.0, 1.0, k), np.full(m - k, 0.01)]), seed=7)
    exact = exact_projection(w, k)

    def mean_error(num_runs: int) -> float:
        errors = [
            (nystrom_projection(w, k, num_runs=num_runs, generator=torch.Generator().manual_seed(s)) - exact).norm()
            / exact.norm()
            for s in range(5)
        ]
        return float(sum(errors) / len(errors))

    single, ensemble = mean_error(1), mean_error(4)
    assert single < 0.03
    assert ensemble < single


def test_nystrom_float32_stays_float32_and_is_deterministic_per_seed() -> None:
    w = _psd(50, np.linspace(2.0, 0.1, 50), seed=8).float()
    first = nystrom_projection(w, 5, generator=torch.Generator().manual_seed(3))
    second = nystrom_projection(w, 5, generator=torch.Generator().manual_seed(3))
    other = nystrom_projection(w, 5, generator=torch.Generator().manual_seed(4))
    assert first.dtype == torch.float32
    assert torch.equal(first, second)
    assert not torch.equal(first, other)


def test_nystrom_shifts_w_ii_until_the_decomposition_converges(monkeypatch: pytest.MonkeyPatch) -> None:
    # Simulate an eigensolver that fails unless the sampled block was shifted by at least 0.025 (three shifts of 0.01).
    w = _psd(40, np.linspace(1.0, 0.2, 40), seed=9)
    real_eigh = torch.linalg.eigh
    diagonal = {}

    def flaky_eigh(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if "base" not in diagonal:
            diagonal["base"] = matrix.diagonal().clone()
        if (matrix.diagonal() - diagonal["base"]).min() < 0.025:
            raise torch.linalg.LinAlgError("did not converge")
        return real_eigh(matrix)

    monkeypatch.setattr(nystrom_module.torch.linalg, "eigh", flaky_eigh)
    result = nystrom_projection(w, 4, generator=torch.Generator().manual_seed(2))
    monkeypatch.undo()

    index = torch.randperm(40, generator=torch.Generator().manual_seed(2))[:8].numpy()
    c = w.numpy()[:, index]
    values, vectors = np.linalg.eigh(c[index] + 0.03 * np.eye(8))
    values, vectors = values[-4:], vectors[:, -4:]
    expected = c @ (vectors / values) @ vectors.T @ c.T
    np.testing.assert_allclose(result.numpy(), expected, atol=1e-10)


def test_nystrom_of_zero_is_zero() -> None:
    assert torch.count_nonzero(nystrom_projection(torch.zeros(10, 10), 2)) == 0


def test_rank_projection_dispatches_by_name() -> None:
    w = _psd(30, np.linspace(3.0, 0.1, 30), seed=10)
    torch.testing.assert_close(rank_projection(w, 4, "exact"), exact_projection(w, 4))
    torch.testing.assert_close(
        rank_projection(w, 4, "nystrom", generator=torch.Generator().manual_seed(0), num_runs=2),
        nystrom_projection(w, 4, generator=torch.Generator().manual_seed(0), num_runs=2),
    )
    with pytest.raises(ValueError, match="unknown projection method 'svd'; valid methods are: exact, nystrom"):
        rank_projection(w, 4, "svd")


@pytest.mark.parametrize("function", [exact_projection, nystrom_projection])
def test_bad_input_raises(function) -> None:
    with pytest.raises(ValueError, match="square"):
        function(torch.zeros(3, 4), 1)
    with pytest.raises(ValueError, match=r"k must be an integer in \[1, 3\]"):
        function(torch.zeros(3, 3), 4)
    with pytest.raises(ValueError, match="NaN"):
        function(torch.full((3, 3), float("nan")), 1)


def test_nystrom_bad_options_raise() -> None:
    with pytest.raises(ValueError, match="num_runs"):
        nystrom_projection(torch.eye(4), 1, num_runs=0)
    with pytest.raises(ValueError, match="oversampling"):
        nystrom_projection(torch.eye(4), 1, oversampling=0)
    with pytest.raises(ValueError, match="jitter"):
        nystrom_projection(torch.eye(4), 1, jitter=0.0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("method", ["exact", "nystrom"])
def test_half_precision_weights_are_projected_in_their_dtype(dtype: torch.dtype, method: str) -> None:
    # Weights trained with precision="16-true" / "bf16-true": eigh has no half-precision kernel, so the exact
    # projection decomposes in float32 and returns the weight's dtype, as the Nystrom projection does.
    w = _psd(12, np.array([3.0, 2.0, 1.0, 0.5]), seed=9)
    options = {"generator": torch.Generator().manual_seed(0)} if method == "nystrom" else {}
    projected = rank_projection(w.to(dtype), 2, method, **options)
    assert projected.dtype == dtype
    reference = torch.from_numpy(_numpy_best_psd(w.to(dtype).double().numpy(), 2))
    if method == "exact":
        assert torch.allclose(projected.double(), reference, atol=2e-2 * reference.abs().max().item())


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
def test_nystrom_of_half_precision_weights_keeps_the_top_k(dtype: torch.dtype, tolerance: float) -> None:
    # The noise cut l * eps * max|lambda| used the weight's own eps: with bfloat16's 2^-7 it dropped every eigenvalue
    # from l = 128 sampled columns on (a zero projection, relative error 1.0 here; 0.16 for float16).
    rank = 64
    w = _psd(200, np.linspace(2.0, 1.0, rank), seed=10).to(dtype)
    projected = nystrom_projection(w, rank, generator=torch.Generator().manual_seed(0))
    assert projected.dtype == dtype
    reference = exact_projection(w.float(), rank).double()
    error = (projected.double() - reference).norm() / reference.norm()
    assert error < tolerance
