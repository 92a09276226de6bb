import math

import numpy as np
import pytest
import torch
from sklearn.decomposition import PCA

import rank_lightning.functional as F
from rank_lightning.functional import Spectrum


def _low_rank(n: int, d: int, rank: int, noise: float = 0.0, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, rank, generator=g, dtype=torch.float64) @ torch.randn(rank, d, generator=g, dtype=torch.float64)
    return x + noise * torch.randn(n, d, generator=g, dtype=torch.float64)


def _with_singular_values(n: int, d: int, s: np.ndarray, seed: int = 0) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    u, _ = np.linalg.qr(rng.standard_normal((n, len(s))))
    v, _ = np.linalg.qr(rng.standard_normal((d, len(s))))
    return torch.from_numpy(u @ np.diag(s) @ v.T)


def _np_sv(x: torch.Tensor, center: bool = False) -> np.ndarray:
    a = x.double().numpy()
    if center:
        a = a - a.mean(axis=0)
    return np.linalg.svd(a, compute_uv=False)


@pytest.mark.parametrize("shape", [(40, 7), (7, 40), (25, 25)])
@pytest.mark.parametrize("center", [False, True])
def test_singular_values_match_numpy(shape: tuple[int, int], center: bool) -> None:
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    spec = F.spectrum(x, center=center)
    assert spec.singular_values.dtype == torch.float64
    assert spec.singular_values.shape == (min(shape),)
    assert (spec.num_samples, spec.num_features, spec.centered) == (*shape, center)
    np.testing.assert_allclose(spec.singular_values.numpy(), _np_sv(x, center), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(F.singular_values(x, center=center).numpy(), _np_sv(x, center), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("center", [False, True])
def test_spectrum_from_feature_and_sample_gram(center: bool) -> None:
    x = _low_rank(30, 12, 4, noise=0.1)
    ref = _np_sv(x, center)
    from_features = F.spectrum_from_gram(x.T @ x, 30, feature_sum=x.sum(0), center=center)
    from_samples = F.spectrum_from_gram(x @ x.T, 30, side="sample", num_features=12, center=center)
    for spec in (from_features, from_samples):
        assert spec.singular_values.shape == (12,)
        assert (spec.num_samples, spec.num_features, spec.centered) == (30, 12, center)
        np.testing.assert_allclose(spec.singular_values.numpy(), ref, rtol=1e-8, atol=1e-6)


def test_spectrum_from_gram_errors() -> None:
    g = torch.eye(3, dtype=torch.float64)
    with pytest.raises(ValueError, match="feature_sum"):
        F.spectrum_from_gram(g, 5, center=True)
    with pytest.raises(ValueError, match="valid choices"):
        F.spectrum_from_gram(g, 5, side="rows")
    with pytest.raises(ValueError, match="num_features is required"):
        F.spectrum_from_gram(g, 3, side="sample")


def test_default_rank_tolerance() -> None:
    eps32 = np.finfo(np.float32).eps
    assert F.default_rank_tolerance(100, 30) == pytest.approx(eps32 * 30)
    assert F.default_rank_tolerance(100, 30, tolerance_size="max") == pytest.approx(eps32 * 100)
    with pytest.raises(ValueError, match="valid choices"):
        F.default_rank_tolerance(100, 30, tolerance_size="median")


@pytest.mark.parametrize("rank", [1, 3, 10])
def test_numerical_rank_of_known_rank_matrix_with_noise(rank: int) -> None:
    # Noise of 1e-9 relative sits far below eps32 * K, so the rank is the planted one; NumPy's float64 default
    # tolerance sees the noise and reports full rank.
    x = _low_rank(200, 40, rank, noise=1e-9)
    assert int(F.numerical_rank(x)) == rank
    assert np.linalg.matrix_rank(x.numpy()) == 40
    s = _np_sv(x)
    tol = np.finfo(np.float32).eps * 40 * s[0]
    assert np.linalg.matrix_rank(x.numpy(), tol=tol) == rank
    assert F.numerical_rank(x).dtype == torch.int64


def test_numerical_rank_tolerance_options() -> None:
    s = np.array([1.0, 1e-3, 4e-6, 1e-8])
    x = _with_singular_values(50, 20, s)
    assert int(F.numerical_rank(x)) == 3  # eps = 1.19e-7 * 20 = 2.4e-6
    assert int(F.numerical_rank(x, tolerance_size="max")) == 2  # eps = 1.19e-7 * 50 = 6e-6
    assert int(F.numerical_rank(x, rank_tolerance=1e-6)) == 3
    assert int(F.numerical_rank(x, rank_tolerance=1e-9)) == 4
    assert int(F.numerical_rank(F.spectrum(x), rank_tolerance=1e-2)) == 1


def test_soft_rank_counts_second_moment_eigenvalues() -> None:
    n = 100
    # Eigenvalues of X^T X / N: 4, 1, 0.6, 0.4, 0.01.
    s = np.sqrt(np.array([4.0, 1.0, 0.6, 0.4, 0.01]) * n)
    x = _with_singular_values(n, 10, s)
    assert int(F.soft_rank(x)) == 3
    assert int(F.soft_rank(x, tau=0.05)) == 4
    assert int(F.soft_rank(F.spectrum(x), tau=2.0)) == 1
    with pytest.raises(ValueError, match="tau"):
        F.soft_rank(x, tau=0.0)


def test_participation_ratio_formula_and_gradient() -> None:
    x = _low_rank(30, 15, 5, noise=0.05)
    s2 = _np_sv(x) ** 2
    expected = s2.sum() ** 2 / (s2**2).sum()
    assert float(F.participation_ratio(x)) == pytest.approx(expected, rel=1e-10)
    assert float(F.participation_ratio(F.spectrum(x))) == pytest.approx(expected, rel=1e-10)
    assert float(F.participation_ratio(x.T)) == pytest.approx(expected, rel=1e-10)
    # Lemma 1 of Daneshmand et al.: r(H) <= rank(H).
    assert expected <= 15

    small = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(F.participation_ratio, (small,))
    wide = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: F.participation_ratio(t, center=True), (wide,))

    # Gradient ascent raises r(H) of a nearly rank-one matrix (the rank-increasing pre-training use).
    h = (_low_rank(20, 8, 1) + 0.01 * torch.randn(20, 8, dtype=torch.float64)).requires_grad_(True)
    before = float(F.participation_ratio(h.detach()))
    opt = torch.optim.Adam([h], lr=0.05)
    for _ in range(30):
        opt.zero_grad()
        (-F.participation_ratio(h)).backward()
        opt.step()
    assert before < 1.01
    assert float(F.participation_ratio(h.detach())) > 3.0


def test_participation_ratio_of_float32_input_is_float64_and_differentiable() -> None:
    x = torch.randn(10, 5, requires_grad=True)
    r = F.participation_ratio(x)
    assert r.dtype == torch.float64
    r.backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_stable_and_effective_rank() -> None:
    s = np.array([3.0, 2.0, 1.0, 0.5])
    x = _with_singular_values(40, 12, s)
    assert float(F.stable_rank(x)) == pytest.approx((s**2).sum() / 9.0, rel=1e-10)
    p = s / s.sum()
    assert float(F.effective_rank(x)) == pytest.approx(math.exp(-(p * np.log(p)).sum()), rel=1e-8)
    # Equal singular values: every rank-like measure equals the rank.
    flat = _with_singular_values(40, 12, np.ones(6))
    for fn in (F.stable_rank, F.effective_rank, F.participation_ratio):
        assert float(fn(flat)) == pytest.approx(6.0, rel=1e-8)


def test_variance_ratio_uncentered_matches_numpy() -> None:
    x = _low_rank(60, 20, 6, noise=0.1)
    s2 = _np_sv(x) ** 2
    curve = F.variance_ratio(x)
    np.testing.assert_allclose(curve.numpy(), np.cumsum(s2) / s2.sum(), rtol=1e-10)
    assert float(F.variance_ratio(x, 3)) == pytest.approx(s2[:3].sum() / s2.sum(), rel=1e-10)
    assert float(F.variance_ratio(x, 500)) == pytest.approx(1.0)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="k must be"):
            F.variance_ratio(x, bad)


def test_centered_variance_ratio_equals_sklearn_pca() -> None:
    x = _low_rank(80, 15, 5, noise=0.2, seed=3) + 4.0
    pca = PCA().fit(x.numpy())
    curve = F.variance_ratio(x, center=True)
    np.testing.assert_allclose(curve.numpy(), np.cumsum(pca.explained_variance_ratio_), rtol=1e-9)
    # The mean offset makes the uncentred first direction dominant: a different, larger VR_1.
    assert float(F.variance_ratio(x, 1)) > float(F.variance_ratio(x, 1, center=True)) + 0.1


def test_precomputed_spectrum_center_mismatch_raises() -> None:
    spec = F.spectrum(torch.randn(10, 4), center=True)
    assert float(F.variance_ratio(spec, 1)) == float(F.variance_ratio(spec, 1, center=True))
    with pytest.raises(ValueError, match="centered=True"):
        F.variance_ratio(spec, 1, center=False)


def test_classwise_variance_ratio_matches_per_class_numpy() -> None:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(90, 6, generator=g, dtype=torch.float64)
    labels = torch.arange(90) % 4
    labels[labels == 2] = 0  # class 2 is empty
    out = F.classwise_variance_ratio(x, labels, num_classes=5)
    assert out.shape == (5,)
    for c in range(5):
        rows = x[labels == c]
        if rows.shape[0] == 0:
            assert math.isnan(float(out[c]))
        else:
            s2 = _np_sv(rows) ** 2
            assert float(out[c]) == pytest.approx(s2[0] / s2.sum(), rel=1e-10)
    centred = F.classwise_variance_ratio(x, labels, k=2, center=True)
    rows = x[labels == 1]
    s2 = _np_sv(rows, center=True) ** 2
    assert float(centred[1]) == pytest.approx(s2[:2].sum() / s2.sum(), rel=1e-10)


def _tcv_loop(x: np.ndarray, labels: np.ndarray) -> tuple[float, float]:
    tcv = 0.0
    for c in np.unique(labels):
        members = [x[i] for i in range(len(x)) if labels[i] == c]
        mu = sum(members) / len(members)
        tcv += sum(float(((m - mu) ** 2).sum()) for m in members)
    mu = x.mean(axis=0)
    total = sum(float(((row - mu) ** 2).sum()) for row in x)
    return tcv, tcv / total


def test_total_cluster_variation_matches_direct_loop() -> None:
    g = torch.Generator().manual_seed(7)
    labels = torch.randint(0, 5, (120,), generator=g)
    centres = 3.0 * torch.randn(5, 8, generator=g, dtype=torch.float64)
    x = centres[labels] + 0.5 * torch.randn(120, 8, generator=g, dtype=torch.float64)
    tcv, normalized = _tcv_loop(x.numpy(), labels.numpy())
    assert float(F.total_cluster_variation(x, labels)) == pytest.approx(tcv, rel=1e-10)
    assert float(F.total_cluster_variation(x, labels, normalized=True)) == pytest.approx(normalized, rel=1e-10)
    counts = torch.bincount(labels, minlength=5)
    sums = torch.zeros(5, 8, dtype=torch.float64).index_add_(0, labels, x)
    moments = F.total_cluster_variation_from_moments(x.square().sum(), sums, counts)
    assert float(moments) == pytest.approx(tcv, rel=1e-9)
    moments_n = F.total_cluster_variation_from_moments(x.square().sum(), sums, counts, normalized=True)
    assert float(moments_n) == pytest.approx(normalized, rel=1e-9)


def test_total_cluster_variation_one_class_and_bad_labels() -> None:
    x = torch.randn(20, 3, dtype=torch.float64)
    labels = torch.zeros(20, dtype=torch.long)
    assert float(F.total_cluster_variation(x, labels, normalized=True)) == pytest.approx(1.0)
    assert float(F.total_cluster_variation(x, labels)) == pytest.approx(float((x - x.mean(0)).square().sum()))
    with pytest.raises(ValueError, match="integer"):
        F.total_cluster_variation(x, labels.float())
    with pytest.raises(ValueError, match="out of range"):
        F.total_cluster_variation(x, labels + 3, num_classes=2)
    with pytest.raises(ValueError, match="shape"):
        F.total_cluster_variation(x, labels[:5])


def test_tail_error_is_eckart_young_distance() -> None:
    w = torch.randn(12, 30, dtype=torch.float64)
    a = w.numpy()
    u, s, vt = np.linalg.svd(a, full_matrices=False)
    curve = F.tail_error(w)
    assert curve.shape == (12,)
    for k in (1, 4, 11, 12):
        best = u[:, :k] @ np.diag(s[:k]) @ vt[:k]
        expected = np.linalg.norm(a - best) / np.linalg.norm(a)
        assert float(F.tail_error(w, k)) == pytest.approx(expected, rel=1e-9, abs=1e-12)
        assert float(curve[k - 1]) == pytest.approx(expected, rel=1e-9, abs=1e-12)
    assert float(F.tail_error(w, 50)) == 0.0


def test_tail_error_reshapes_conv_weights() -> None:
    w = torch.randn(8, 3, 3, 3, dtype=torch.float64)
    s = _np_sv(w.reshape(8, 27))
    assert float(F.tail_error(w, 2)) == pytest.approx(math.sqrt((s[2:] ** 2).sum() / (s**2).sum()), rel=1e-10)


def test_float32_and_bf16_inputs_match_float64() -> None:
    # Stated tolerances: float32 data reproduce the float64 metrics to 1e-5 relative (the rank exactly, as eps is
    # the float32 epsilon); bf16 data (8-bit mantissa) to 2e-2, and bit for bit the float64 answer of the
    # upcast bf16 values, since every computation runs in float64.
    x64 = _low_rank(300, 32, 6, noise=1e-3, seed=11)
    for dtype, rtol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        x = x64.to(dtype)
        spec = F.spectrum(x)
        assert spec.singular_values.dtype == torch.float64
        np.testing.assert_allclose(spec.singular_values.numpy(), _np_sv(x.double()), rtol=1e-10, atol=1e-9)
        np.testing.assert_allclose(spec.singular_values[:6].numpy(), _np_sv(x64)[:6], rtol=rtol)
        for fn in (F.participation_ratio, F.stable_rank, F.effective_rank):
            assert float(fn(x)) == pytest.approx(float(fn(x64)), rel=rtol)
        assert float(F.variance_ratio(x, 6)) == pytest.approx(float(F.variance_ratio(x64, 6)), rel=rtol)
    assert int(F.numerical_rank(x64.float())) == int(F.numerical_rank(x64)) == 32
    assert int(F.numerical_rank(_low_rank(300, 32, 6, noise=1e-8).float())) == 6


def test_degenerate_shapes() -> None:
    one_row = torch.tensor([[3.0, 4.0, 0.0]])
    assert int(F.numerical_rank(one_row)) == 1
    assert float(F.singular_values(one_row)[0]) == pytest.approx(5.0)
    assert float(F.participation_ratio(one_row)) == pytest.approx(1.0)
    assert float(F.variance_ratio(one_row, 1)) == pytest.approx(1.0)
    centred = F.spectrum(one_row, center=True)
    assert int(F.numerical_rank(centred)) == 0
    one_col = torch.randn(10, 1)
    assert int(F.numerical_rank(one_col)) == 1
    assert float(F.effective_rank(one_col)) == pytest.approx(1.0)
    assert float(F.tail_error(one_col, 1)) == 0.0
    with pytest.raises(ValueError, match="2-D"):
        F.spectrum(torch.randn(3, 4, 5))
    with pytest.raises(ValueError, match="at least one"):
        F.spectrum(torch.randn(0, 4))


def test_all_zero_input() -> None:
    z = torch.zeros(6, 4)
    assert int(F.numerical_rank(z)) == 0
    assert int(F.soft_rank(z)) == 0
    for fn in (F.participation_ratio, F.stable_rank, F.effective_rank):
        assert float(fn(z)) == 0.0
    assert torch.isnan(F.variance_ratio(z, 1))
    assert torch.isnan(F.tail_error(z, 1))
    z_req = torch.zeros(6, 4, dtype=torch.float64, requires_grad=True)
    F.participation_ratio(z_req).backward()
    assert torch.isfinite(z_req.grad).all()


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_input_gives_nan_and_warning(bad: float) -> None:
    x = torch.randn(10, 4)
    x[3, 1] = bad
    with pytest.warns(RuntimeWarning, match="NaN or Inf"):
        spec = F.spectrum(x)
    assert not spec.is_finite
    for fn in (F.numerical_rank, F.soft_rank, F.participation_ratio, F.stable_rank, F.effective_rank):
        assert math.isnan(float(fn(spec)))
    assert torch.isnan(F.variance_ratio(spec)).all()
    assert math.isnan(float(F.tail_error(spec, 1)))
    with pytest.warns(RuntimeWarning, match="NaN or Inf"):
        assert math.isnan(float(F.participation_ratio(x)))
    with pytest.warns(RuntimeWarning, match="NaN or Inf"):
        assert math.isnan(float(F.total_cluster_variation(x, torch.zeros(10, dtype=torch.long))))
    gram = torch.eye(4, dtype=torch.float64)
    gram[0, 0] = bad
    with pytest.warns(RuntimeWarning, match="NaN or Inf"):
        assert torch.isnan(F.spectrum_from_gram(gram, 10).singular_values).all()


def test_spectrum_is_frozen() -> None:
    spec = Spectrum(torch.ones(2, dtype=torch.float64), 3, 2)
    with pytest.raises(AttributeError):
        spec.num_samples = 5  # type: ignore[misc]


@pytest.mark.parametrize("center", [False, True])
def test_spectra_from_grams_match_one_by_one(center: bool) -> None:
    g = torch.Generator().manual_seed(3)
    blocks = [torch.randn(n, 5, generator=g, dtype=torch.float64) + 1.0 for n in (3, 9, 1)]
    grams = torch.stack([b.T @ b for b in blocks])
    sums = torch.stack([b.sum(0) for b in blocks])
    spectra = F.spectra_from_grams(grams, [b.shape[0] for b in blocks], feature_sums=sums, center=center)
    for block, spec in zip(blocks, spectra):
        expected = _np_sv(block, center=center)
        assert spec.num_samples == block.shape[0] and spec.num_features == 5 and spec.centered == center
        assert spec.singular_values.shape[0] == min(block.shape)
        # A Gram resolves singular values only down to ~sqrt(float64 eps) * s_1 (the centred 3-row block has rank 2).
        np.testing.assert_allclose(spec.singular_values.numpy(), expected, rtol=1e-8, atol=1e-6)


def test_spectra_from_grams_isolates_a_non_finite_gram() -> None:
    grams = torch.eye(3, dtype=torch.float64).repeat(2, 1, 1)
    grams[1, 0, 0] = math.nan
    with pytest.warns(RuntimeWarning, match="NaN or Inf"):
        good, bad = F.spectra_from_grams(grams, [4, 4])
    np.testing.assert_allclose(good.singular_values.numpy(), [1.0, 1.0, 1.0])
    assert not bad.is_finite


def test_spectra_from_grams_errors() -> None:
    grams = torch.eye(3).repeat(2, 1, 1)
    with pytest.raises(ValueError, match=r"\(B, d, d\)"):
        F.spectra_from_grams(torch.eye(3), [1])
    with pytest.raises(ValueError, match="2 Grams"):
        F.spectra_from_grams(grams, [1])
    with pytest.raises(ValueError, match="at least 1"):
        F.spectra_from_grams(grams, [1, 0])
    with pytest.raises(ValueError, match="feature_sums"):
        F.spectra_from_grams(grams, [1, 1], center=True)


@pytest.mark.parametrize("scale", [1e-200, 1e-150, 1e-80, 1e80, 1e150, 1e200])
def test_scale_free_ratios_at_extreme_scales(scale: float) -> None:
    # In absolute units s^4 underflows to 0 or overflows to inf from about 1e+-77: the participation ratio read 0 at
    # 1e-150 and NaN at 1e80; stable rank, VR_k and the tail error followed further out.
    x = torch.randn(60, 20, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    s = _np_sv(x)
    expected = {
        "participation_ratio": (s**2).sum() ** 2 / (s**4).sum(),
        "stable_rank": (s**2).sum() / s[0] ** 2,
        "variance_ratio": (s[:3] ** 2).sum() / (s**2).sum(),
        "tail_error": math.sqrt((s[3:] ** 2).sum() / (s**2).sum()),
        "alpha_req": float(F.alpha_req(x)),
    }
    scaled = x * scale
    spec = F.spectrum(scaled)
    measured = {
        "participation_ratio": F.participation_ratio(spec),
        "stable_rank": F.stable_rank(spec),
        "variance_ratio": F.variance_ratio(spec, 3),
        "tail_error": F.tail_error(spec, 3),
        "alpha_req": F.alpha_req(spec),
    }
    for name, value in expected.items():
        assert float(measured[name]) == pytest.approx(value, rel=1e-12), name
    assert float(F.participation_ratio(scaled)) == pytest.approx(expected["participation_ratio"], rel=1e-12)
    assert float(F.variance_ratio(spec)[-1]) == pytest.approx(1.0, rel=1e-12)


def test_participation_ratio_gradient_is_scale_free() -> None:
    # The matrix path divides by the largest entry; the gradient must still be that of r(H) itself: for a function of
    # degree 0, x . grad = 0 and grad(c x) = grad(x) / c.
    x = torch.randn(9, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64, requires_grad=True)
    F.participation_ratio(x).backward()
    scaled = (x.detach() * 1e3).requires_grad_()
    F.participation_ratio(scaled).backward()
    assert float((x.grad * x.detach()).sum()) == pytest.approx(0.0, abs=1e-12)
    torch.testing.assert_close(scaled.grad * 1e3, x.grad, rtol=1e-12, atol=1e-15)
    assert torch.autograd.gradcheck(F.participation_ratio, (x.detach().clone().requires_grad_(),))


@pytest.mark.parametrize("center", ["no", "yes", 1, "both"])
def test_center_must_be_a_bool(center: object) -> None:
    # A truthy string centred the data: center="no" gave the centred value.
    x = torch.randn(8, 3) + 3
    labels = torch.arange(8) % 2
    calls = [
        lambda: F.spectrum(x, center=center),
        lambda: F.participation_ratio(x, center=center),
        lambda: F.numerical_rank(x, center=center),
        lambda: F.variance_ratio(x, 1, center=center),
        lambda: F.classwise_variance_ratio(x, labels, center=center),
        lambda: F.spectrum_from_gram(torch.eye(3, dtype=torch.float64), 8, center=center),
    ]
    for call in calls:
        with pytest.raises(ValueError, match=rf"unknown center {center!r}; valid choices are: False, True"):
            call()


@pytest.mark.parametrize("tau", [math.nan, math.inf, 0.0, -1.0])
def test_soft_rank_threshold_must_be_a_finite_positive_number(tau: float) -> None:
    with pytest.raises(ValueError, match=r"tau must be a positive number, got"):
        F.soft_rank(torch.randn(5, 3), tau=tau)


def test_numpy_integers_are_integers() -> None:
    x = torch.randn(12, 6, dtype=torch.float64)
    assert float(F.variance_ratio(x, np.int64(2))) == float(F.variance_ratio(x, 2))
    summary = F.summarize(F.spectrum(x), variance_ratio_ks=np.array([1, 5]))
    assert list(summary.variance_ratio) == [1, 5] and all(type(k) is int for k in summary.variance_ratio)


def test_bad_options_are_named_before_the_input_is_read() -> None:
    x = torch.randn(5, 3)
    x[0, 0] = math.nan
    with pytest.raises(ValueError, match="unknown tolerance_size 'bogus'"):
        F.numerical_rank(x, tolerance_size="bogus")


def test_complex_input_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"x must be real, got torch.complex64"):
        F.spectrum(torch.randn(4, 3, dtype=torch.complex64))
