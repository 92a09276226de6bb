"""SciPy's BLAS and LAPACK on CPU float64: the symmetric rank-k Gram update and the VR_k of leading eigenvalues."""

from collections.abc import Iterator

import pytest
import torch

from rank_lightning.functional import classwise_variance_ratio, gram_variance_ratios
from rank_lightning.functional.spectral import SCIPY_BLAS, SCIPY_MAX_TORCH_THREADS
from rank_lightning.functional.streaming import (
    _add_product,
    _cpu_syrk,
    classwise_variance_ratio_from_grams,
    symmetrize_lower,
)

needs_scipy_blas = pytest.mark.skipif(not SCIPY_BLAS.available, reason="SciPy's BLAS is not its own OpenBLAS")


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """SciPy's kernels are taken where torch runs on one thread: pin it, whatever earlier tests left behind."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _rows(n: int, d: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g, dtype=torch.float64) + 3 * torch.randn(d, generator=g, dtype=torch.float64)


@needs_scipy_blas
@pytest.mark.parametrize("layout", ["columns", "rows", "strided"])
def test_syrk_update_adds_the_lower_triangle_of_every_layout(layout: str) -> None:
    x = _rows(300, 40, 0)
    columns = {"columns": x.T, "rows": x.T.contiguous(), "strided": x.T[:, ::2]}[layout]
    target = torch.full((40, 40), 2.0, dtype=torch.float64)
    _add_product(target, columns)
    expected = 2.0 + columns @ columns.T
    torch.testing.assert_close(target.tril(), expected.tril(), rtol=1e-13, atol=1e-11)
    above = torch.ones(40, 40, dtype=torch.bool).triu(1)
    assert bool((target[above] == 2.0).all())  # never written above the diagonal


@needs_scipy_blas
def test_scipy_blas_runs_on_one_thread_and_only_where_torch_runs_on_few() -> None:
    before = [library.num_threads for library in SCIPY_BLAS.libraries]
    torch_threads = torch.get_num_threads()
    x = _rows(300, 20, 3)
    try:
        for library in SCIPY_BLAS.libraries:
            library.set_num_threads(2)
        with SCIPY_BLAS.single_threaded():
            assert [library.num_threads for library in SCIPY_BLAS.libraries] == [1] * len(before)
            with SCIPY_BLAS.single_threaded():  # nested: still one thread, and leaving it restores nothing yet
                assert [library.num_threads for library in SCIPY_BLAS.libraries] == [1] * len(before)
            assert [library.num_threads for library in SCIPY_BLAS.libraries] == [1] * len(before)
        assert [library.num_threads for library in SCIPY_BLAS.libraries] == [2] * len(before)
        with pytest.raises(RuntimeError, match="inside"), SCIPY_BLAS.single_threaded():
            raise RuntimeError("inside")
        assert [library.num_threads for library in SCIPY_BLAS.libraries] == [2] * len(before)  # after an error too
        with SCIPY_BLAS.single_threaded():  # and the next block sets one thread again
            assert [library.num_threads for library in SCIPY_BLAS.libraries] == [1] * len(before)
        torch.set_num_threads(SCIPY_MAX_TORCH_THREADS + 1)
        assert not SCIPY_BLAS.usable()
        target = torch.zeros(20, 20, dtype=torch.float64)
        assert not _cpu_syrk(target, x.T) and float(target.abs().sum()) == 0.0  # torch's threads take the product
        _add_product(target, x.T)
        torch.testing.assert_close(symmetrize_lower(target), x.T @ x, rtol=1e-13, atol=1e-11)
        torch.set_num_threads(1)
        assert SCIPY_BLAS.usable() and _cpu_syrk(torch.zeros(20, 20, dtype=torch.float64), x.T)
    finally:
        torch.set_num_threads(torch_threads)
        for library, count in zip(SCIPY_BLAS.libraries, before):
            library.set_num_threads(count)


@needs_scipy_blas
@pytest.mark.parametrize("center", [False, True])
@pytest.mark.parametrize(("n", "d", "k"), [(36, 128, 1), (700, 160, 3), (5, 130, 4)])
def test_gram_variance_ratios_equal_the_svd_of_the_rows(center: bool, n: int, d: int, k: int) -> None:
    xs = [_rows(n, d, seed) for seed in range(4)]
    grams = torch.stack([x.T @ x for x in xs])
    sums = torch.stack([x.sum(0) for x in xs])
    found = gram_variance_ratios(grams, k, num_samples=[n] * 4, feature_sums=sums if center else None)
    assert found is not None
    for x, value in zip(xs, found):
        s2 = torch.linalg.svdvals(x - x.mean(0) if center else x).square()
        assert float(value) == pytest.approx(float(s2[:k].sum() / s2.sum()), rel=1e-12)


def test_gram_variance_ratios_decline_what_they_cannot_do_exactly() -> None:
    x = _rows(6, 130, 1)
    grams = (x.T @ x).unsqueeze(0)
    assert gram_variance_ratios(grams, 6, num_samples=[6]) is None  # k reaches the rank bound min(N, d)
    small = _rows(6, 64, 1)
    assert gram_variance_ratios((small.T @ small).unsqueeze(0), 1, num_samples=[6]) is None  # torch is as fast
    assert gram_variance_ratios(grams.float(), 1, num_samples=[6]) is None  # float32
    bad = grams.clone()
    bad[0, 2, 3] = float("nan")
    assert gram_variance_ratios(bad, 1, num_samples=[6]) is None  # non-finite: the eigh path warns and gives NaN


@pytest.mark.parametrize("d", [16, 128])
@pytest.mark.parametrize("k", [1, 2, 40])
def test_classwise_variance_ratio_from_grams_equals_the_rows(k: int, d: int) -> None:
    # k = 40 reaches the rank bound of the 30-row class, and 16 features are below the size where the leading
    # eigenvalues pay: every eigenvalue by the batched eigh there, the leading ones by LAPACK otherwise.
    x = _rows(200, d, 2)
    labels = torch.cat([torch.full((30,), 0), torch.full((170,), 2)])
    grams = torch.stack([x[labels == c].T @ x[labels == c] for c in range(3)])
    counts = torch.bincount(labels, minlength=3)
    sums = torch.stack([x[labels == c].sum(0) for c in range(3)])
    for center in (False, True):
        found = classwise_variance_ratio_from_grams(grams, counts, class_sums=sums, k=k, center=center)
        expected = classwise_variance_ratio(x, labels, k=k, num_classes=3, center=center)
        assert torch.isnan(found[1]) and torch.isnan(expected[1])  # class 1 has no rows
        torch.testing.assert_close(found[[0, 2]], expected[[0, 2]], rtol=1e-12, atol=0)
