import math
import warnings

import numpy as np
import pytest
import torch

from rank_lightning.functional.weights import DECOMPOSITIONS, weight_spectra

SHAPES = [(30, 70), (64, 16), (12, 12)]


def _with_spectrum(rows: int, cols: int, log_low: float, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """``U diag(s) V^T`` with singular values ``3 * logspace(0, log_low)``: condition number ``10^-log_low``."""
    rng = np.random.default_rng(seed)
    k = min(rows, cols)
    u, _ = np.linalg.qr(rng.standard_normal((rows, k)))
    v, _ = np.linalg.qr(rng.standard_normal((cols, k)))
    return torch.tensor((u * 3 * np.logspace(0, log_low, k)) @ v.T, dtype=dtype)


def _numpy_svd(matrix: torch.Tensor) -> np.ndarray:
    return np.linalg.svd(matrix.double().numpy(), compute_uv=False)


@pytest.mark.parametrize("decomposition", DECOMPOSITIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_random_matrices_match_numpy_svd_to_1e10_relative(decomposition, dtype):
    # Gaussian matrices and a condition number of 100: within 1e-10 relative by every route (docstring).
    generator = torch.Generator().manual_seed(0)
    matrices = [torch.randn(rows, cols, generator=generator, dtype=dtype) for rows, cols in SHAPES[:2]]
    matrices += [_with_spectrum(rows, cols, -2, dtype, seed) for seed, (rows, cols) in enumerate(SHAPES)]
    spectra = weight_spectra(matrices, decomposition=decomposition)
    assert len(spectra) == len(matrices)
    for matrix, spec in zip(matrices, spectra):
        reference = _numpy_svd(matrix)
        assert reference[-1] >= 1e-3 * reference[0]
        assert (spec.num_samples, spec.num_features) == tuple(matrix.shape)
        assert spec.singular_values.dtype == torch.float64 and spec.singular_values.device.type == "cpu"
        np.testing.assert_allclose(spec.singular_values.numpy(), reference, rtol=1e-10, atol=0)


@pytest.mark.parametrize("decomposition", ["svd", "auto"])
@pytest.mark.parametrize("log_low", [-6, -12])
def test_ill_conditioned_matrices_by_svd_and_auto_are_exact_to_rounding(decomposition, log_low):
    # Within a few eps64 * s_1 of the exact values, hence 1e-10 relative for every s_i above about 1e-4 s_1.
    matrices = [_with_spectrum(rows, cols, log_low, torch.float32, seed) for seed, (rows, cols) in enumerate(SHAPES)]
    for matrix, spec in zip(matrices, weight_spectra(matrices, decomposition=decomposition)):
        reference = _numpy_svd(matrix)
        np.testing.assert_allclose(spec.singular_values.numpy(), reference, rtol=1e-10, atol=1e-14 * reference[0])


@pytest.mark.parametrize("log_low", [-6, -12])
def test_ill_conditioned_matrices_by_gram_stay_within_sqrt_eps_of_s1(log_low):
    matrices = [_with_spectrum(rows, cols, log_low, torch.float32, seed) for seed, (rows, cols) in enumerate(SHAPES)]
    for matrix, spec in zip(matrices, weight_spectra(matrices, decomposition="gram")):
        reference = _numpy_svd(matrix)
        values = spec.singular_values.numpy()
        np.testing.assert_allclose(values, reference, rtol=0, atol=math.sqrt(np.finfo(np.float64).eps) * reference[0])
        # Squaring loses the small values' relative accuracy, the reason "auto" redoes such matrices by SVD.
        assert np.max(np.abs(values - reference) / reference) > 1e-10


def test_auto_takes_the_gram_route_for_well_conditioned_float32_and_the_svd_otherwise():
    well = [_with_spectrum(20, 40, -2, torch.float32, seed) for seed in range(2)]
    ill = _with_spectrum(20, 40, -4, torch.float32, 2)
    group = [well[0], ill, well[1]]
    auto = weight_spectra(group)
    gram = weight_spectra(group, decomposition="gram")
    svd = weight_spectra(group, decomposition="svd")
    for got, expected in zip(auto, [gram[0], svd[1], gram[2]]):
        assert torch.equal(got.singular_values, expected.singular_values)
    assert not torch.equal(gram[0].singular_values, svd[0].singular_values)

    doubles = [matrix.double() for matrix in group]
    for got, expected in zip(weight_spectra(doubles), weight_spectra(doubles, decomposition="svd")):
        assert torch.equal(got.singular_values, expected.singular_values)


@pytest.mark.parametrize("decomposition", DECOMPOSITIONS)
def test_wide_and_tall_orientations_give_the_same_values(decomposition):
    matrix = _with_spectrum(24, 9, -1, torch.float64, 0)
    tall, wide = weight_spectra([matrix, matrix.T], decomposition=decomposition)
    assert (tall.num_samples, tall.num_features, wide.num_samples, wide.num_features) == (24, 9, 9, 24)
    np.testing.assert_allclose(wide.singular_values.numpy(), tall.singular_values.numpy(), rtol=1e-12)


@pytest.mark.parametrize("decomposition", DECOMPOSITIONS)
def test_non_finite_matrices_give_nan_spectra_without_touching_the_others(decomposition):
    generator = torch.Generator().manual_seed(0)
    matrices = [torch.randn(5, 8, generator=generator) for _ in range(3)]
    matrices[1][2, 3] = math.inf
    matrices[2][0, 0] = math.nan
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        spectra = weight_spectra(matrices, decomposition=decomposition)
    assert all(torch.isnan(spec.singular_values).all() and spec.singular_values.shape == (5,) for spec in spectra[1:])
    np.testing.assert_allclose(spectra[0].singular_values.numpy(), _numpy_svd(matrices[0]), rtol=1e-10)


@pytest.mark.parametrize("decomposition", DECOMPOSITIONS)
def test_many_matrices_of_one_shape_are_decomposed_in_bounded_batches_with_the_same_values(decomposition, monkeypatch):
    import rank_lightning.functional.weights as weights

    generator = torch.Generator().manual_seed(0)
    matrices = [torch.randn(6, 4, generator=generator) for _ in range(7)]
    matrices[3] = _with_spectrum(6, 4, -5, torch.float32, 0)  # "auto" redoes it by the SVD, inside its batch
    whole = weight_spectra(matrices, decomposition=decomposition)
    sizes: list[int] = []
    decomposed = weights._decomposed

    def recording(group, device, route):
        sizes.append(len(group))
        return decomposed(group, device, route)

    monkeypatch.setattr(weights, "_decomposed", recording)
    monkeypatch.setattr(weights, "_BATCH_BYTES", 3 * 6 * 4 * 8)  # three float64 matrices per batch
    batched = weight_spectra(matrices, decomposition=decomposition)
    assert sizes == [3, 3, 1]
    for got, expected in zip(batched, whole):
        torch.testing.assert_close(got.singular_values, expected.singular_values, rtol=1e-13, atol=0)


def test_empty_input_and_invalid_arguments():
    assert weight_spectra([]) == []
    with pytest.raises(ValueError, match="unknown decomposition 'qr'; valid choices are: auto, svd, gram"):
        weight_spectra([torch.eye(3)], decomposition="qr")
    with pytest.raises(ValueError, match=r"matrices\[1\] must be a non-empty 2-D matrix, got shape \(2, 3, 3\)"):
        weight_spectra([torch.eye(3), torch.ones(2, 3, 3)])
    with pytest.raises(ValueError, match=r"matrices\[0\] must be a non-empty 2-D matrix, got shape \(0, 4\)"):
        weight_spectra([torch.ones(0, 4)])


def test_gram_route_keeps_float64_weights_beyond_the_range_of_their_squares():
    # Entries of 1e160 overflowed the Gram (all NaN), entries of 1e-170 underflowed it (every singular value 0).
    base = torch.randn(12, 9, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    expected = torch.linalg.svdvals(base)
    for scale in (1e160, 1e-170, 1.0):
        gram = weight_spectra([base * scale, base * scale], decomposition="gram")[0]
        torch.testing.assert_close(gram.singular_values / scale, expected, rtol=1e-13, atol=0)
    zero = weight_spectra([torch.zeros(4, 3, dtype=torch.float64)], decomposition="gram")[0]
    assert zero.singular_values.tolist() == [0.0, 0.0, 0.0]
