import math

import numpy as np
import pytest
import torch

import rank_lightning.functional as F
from rank_lightning.functional.spectral import SCIPY_BLAS
from rank_lightning.functional.streaming import (
    AUTO_GRAM_PRECISION,
    GRAM_PRECISIONS,
    Subsample,
    channel_gram_moments,
    classwise_variance_ratio_from_grams,
    classwise_variance_ratio_from_sample,
    count_sketch,
    gram_product_dtype,
    merge_subsamples,
    move_reference,
    reference_point,
    resolve_gram_precision,
    row_moments,
    sketch_spectrum,
    subsample_spectrum,
    subsample_update,
    symmetrize_lower,
)


def _rows(n: int = 60, d: int = 7, classes: int = 4, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=torch.float64) + torch.randn(d, generator=g, dtype=torch.float64)
    return x, torch.randint(0, classes, (n,), generator=g)


def _np_sv(x: torch.Tensor, center: bool = False) -> np.ndarray:
    a = x.double().numpy()
    return np.linalg.svd(a - a.mean(0) if center else a, compute_uv=False)


def test_row_moments_match_direct_sums() -> None:
    x, y = _rows()
    gram = torch.full((7, 7), 2.0, dtype=torch.float64)
    moments = row_moments(x, y, num_classes=5, gram=gram)
    a, labels = x.numpy(), y.numpy()
    assert moments.num_rows == 60 and int(moments.nonfinite) == 0
    np.testing.assert_allclose(moments.feature_sum.numpy(), a.sum(0), rtol=1e-13)
    assert float(moments.sum_squares) == pytest.approx((a**2).sum(), rel=1e-13)
    np.testing.assert_array_equal(moments.class_counts.numpy(), np.bincount(labels, minlength=5))
    for c in range(5):
        np.testing.assert_allclose(moments.class_sums[c].numpy(), a[labels == c].sum(0), rtol=1e-13, atol=1e-13)
    # The Gram is added into the running sum (its lower triangle, which symmetrize_lower mirrors).
    np.testing.assert_allclose(symmetrize_lower(gram).numpy(), 2.0 + a.T @ a, rtol=1e-13)
    plain = row_moments(x)
    assert plain.class_counts is None and plain.class_sums is None


@pytest.mark.parametrize("presorted", [False, True])
def test_row_moments_route_labelled_rows_into_their_class_gram(presorted: bool) -> None:
    x, y = _rows(n=80, d=5, classes=3)
    if presorted:
        y, order = torch.sort(y, stable=True)
        x = x[order]
    gram = torch.zeros(5, 5, dtype=torch.float64)
    class_grams = torch.ones(4, 5, 5, dtype=torch.float64)
    row_moments(x, y, num_classes=4, gram=gram, class_grams=class_grams)
    a, labels = x.numpy(), y.numpy()
    assert float(gram.abs().sum()) == 0.0  # labelled rows go to their class Gram only
    for c in range(4):
        rows = a[labels == c]
        np.testing.assert_allclose(symmetrize_lower(class_grams[c]).numpy(), 1.0 + rows.T @ rows, rtol=1e-13)
    np.testing.assert_allclose(symmetrize_lower(class_grams - 1).sum(0).numpy(), a.T @ a, rtol=1e-12)
    # Without labels, class Grams are left alone and the rows go to the Gram.
    row_moments(x, None, num_classes=4, gram=gram, class_grams=class_grams)
    np.testing.assert_allclose(symmetrize_lower(gram).numpy(), a.T @ a, rtol=1e-13)


def test_row_moments_flag_non_finite_batches() -> None:
    x, _ = _rows(n=10, d=3)
    for value in (math.nan, math.inf, -math.inf):
        bad = x.clone()
        bad[4, 1] = value
        assert int(row_moments(bad).nonfinite) == 1
    assert int(row_moments(x).nonfinite) == 0


# (150, 64, 8, 8) spans three blocks of 64 inputs; (9, 3, 5, 4) fits in one; maps smaller than C x C (one position,
# or 512 channels of 2 x 2) go through the same channel-major copy.
@pytest.mark.parametrize("shape", [(150, 64, 8, 8), (9, 3, 5, 4), (7, 16, 1, 1), (3, 512, 2, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_channel_gram_moments_equal_the_moments_of_the_channel_rows(shape: tuple, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    maps = torch.randn(*shape, generator=g).to(dtype)
    labels = torch.randint(0, 3, (shape[0],), generator=g)
    channels, positions = shape[1], shape[2] * shape[3]
    rows = F.reduce_activations(maps, "channel", dtype=torch.float64)
    row_labels = labels.repeat_interleave(positions)
    reference = row_moments(rows, row_labels, num_classes=3)

    gram = torch.zeros(channels, channels, dtype=torch.float64)
    moments = channel_gram_moments(maps, labels, num_classes=3, gram=gram)
    expected = (rows.T @ rows).numpy()
    # Summation order differs: off-diagonal entries that nearly cancel get an absolute bound on the Gram's scale.
    atol = 1e-13 * np.abs(expected).max()
    # Only the lower triangle is kept up to date (the blocks on and below the diagonal for 128 channels or more).
    np.testing.assert_allclose(symmetrize_lower(gram).numpy(), expected, rtol=1e-12, atol=atol)
    assert moments.num_rows == rows.shape[0] and int(moments.nonfinite) == 0
    for name in ("feature_sum", "sum_squares", "class_sums"):
        np.testing.assert_allclose(
            getattr(moments, name).numpy(), getattr(reference, name).numpy(), rtol=1e-12, atol=atol
        )
    torch.testing.assert_close(moments.class_counts, reference.class_counts, rtol=0, atol=0)

    class_grams = torch.zeros(3, channels, channels, dtype=torch.float64)
    untouched = torch.zeros(channels, channels, dtype=torch.float64)
    channel_gram_moments(maps, labels, num_classes=3, gram=untouched, class_grams=class_grams)
    assert float(untouched.abs().sum()) == 0.0
    for c in range(3):
        block = rows[row_labels == c]
        expected_class = (block.T @ block).numpy()
        np.testing.assert_allclose(symmetrize_lower(class_grams[c]).numpy(), expected_class, rtol=1e-12, atol=atol)

    poisoned = maps.clone()
    poisoned[-1, 0, 0, 0] = math.nan
    assert int(channel_gram_moments(poisoned, gram=torch.zeros_like(gram)).nonfinite) == 1


def _stream_subsample(rows: torch.Tensor, keys: torch.Tensor, labels: torch.Tensor | None, cap: int, step: int):
    sample = None
    for start in range(0, rows.shape[0], step):
        part = slice(start, start + step)
        sample = subsample_update(
            sample, rows[part], keys[part], None if labels is None else labels[part], capacity=cap
        )
    return sample


def _by_key(sample: Subsample) -> Subsample:
    order = torch.argsort(sample.keys)
    return Subsample(sample.rows[order], sample.keys[order], sample.labels[order])


@pytest.mark.parametrize("step", [7, 50, 1000])
def test_subsample_keeps_the_rows_with_the_smallest_keys(step: int) -> None:
    g = torch.Generator().manual_seed(1)
    rows = torch.randn(300, 4, generator=g, dtype=torch.float64)
    keys = torch.rand(300, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 5, (300,), generator=g)
    sample = _by_key(_stream_subsample(rows, keys, labels, cap=40, step=step))
    expected = torch.argsort(keys)[:40]
    torch.testing.assert_close(sample.rows, rows[expected], rtol=0, atol=0)
    torch.testing.assert_close(sample.keys, keys[expected], rtol=0, atol=0)
    torch.testing.assert_close(sample.labels, labels[expected], rtol=0, atol=0)


def test_subsample_keeps_every_row_below_capacity_and_marks_missing_labels() -> None:
    rows = torch.randn(30, 3, dtype=torch.bfloat16)
    keys = torch.rand(30, dtype=torch.float64)
    sample = _stream_subsample(rows, keys, None, cap=100, step=8)
    assert sample.rows.dtype == torch.float32  # kept in at least float32
    torch.testing.assert_close(sample.rows, rows.float(), rtol=0, atol=0)
    torch.testing.assert_close(sample.keys, keys, rtol=0, atol=0)
    assert (sample.labels == -1).all() and sample.labels.dtype == torch.int64


def test_bottom_k_merge_of_two_halves_equals_the_one_pass_subsample() -> None:
    g = torch.Generator().manual_seed(2)
    rows = torch.randn(500, 6, generator=g, dtype=torch.float64)
    keys = torch.rand(500, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 3, (500,), generator=g)
    one_pass = _by_key(_stream_subsample(rows, keys, labels, cap=64, step=30))
    # Two "ranks" see interleaved batches, as a distributed sampler would give them.
    halves = [torch.arange(500).view(-1, 25)[r::2].reshape(-1) for r in range(2)]
    parts = [_stream_subsample(rows[i], keys[i], labels[i], cap=64, step=25) for i in halves]
    merged = _by_key(merge_subsamples(parts, capacity=64))
    for a, b in zip(merged, one_pass):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    small = merge_subsamples([Subsample(rows[:5], keys[:5], labels[:5])], capacity=64)
    torch.testing.assert_close(small.rows, rows[:5], rtol=0, atol=0)


def test_subsample_spectrum_is_the_spectrum_of_the_rows() -> None:
    x, _ = _rows(n=20, d=9)
    for mean, center in ((None, False), (x.mean(0), True)):
        spec = subsample_spectrum(x.float(), mean=mean)
        assert (spec.num_samples, spec.num_features, spec.centered) == (20, 9, center)
        np.testing.assert_allclose(spec.singular_values.numpy(), _np_sv(x.float(), center), rtol=1e-6, atol=1e-6)


def test_count_sketch_is_the_product_with_a_sparse_sign_matrix() -> None:
    x, _ = _rows(n=40, d=5)
    update = count_sketch(x, 8, torch.Generator().manual_seed(0))
    s = torch.zeros(8, 40, dtype=torch.float64)
    s[update.buckets, torch.arange(40)] = update.signs
    assert set(update.signs.tolist()) <= {-1.0, 1.0} and 0 <= int(update.buckets.min()) <= int(update.buckets.max()) < 8
    sketch = torch.zeros(8, 5, dtype=torch.float64).index_add_(0, update.buckets, update.rows)
    torch.testing.assert_close(sketch, s @ x, rtol=1e-13, atol=1e-13)
    signs = torch.zeros(8, dtype=torch.float64).index_add_(0, update.buckets, update.signs)
    torch.testing.assert_close(signs, s.sum(1), rtol=0, atol=0)


def test_count_sketch_gram_is_unbiased() -> None:
    # E[Y^T Y] = X^T X: the cross terms sigma_i sigma_j x_i x_j^T of rows sharing a bucket average out.
    x, _ = _rows(n=30, d=4)
    gram = x.T @ x
    generator = torch.Generator().manual_seed(5)
    trials = 2000
    errors = []
    for _ in range(trials):
        update = count_sketch(x, 6, generator)
        y = torch.zeros(6, 4, dtype=torch.float64).index_add_(0, update.buckets, update.rows)
        errors.append(y.T @ y - gram)
    errors = torch.stack(errors)
    # For an unbiased estimate the mean error has norm about sqrt(E||error||^2 / trials); a bias stays put.
    scale = float(errors.square().sum(dim=(1, 2)).mean().div(trials).sqrt())
    assert float(errors.mean(0).norm()) < 3 * scale
    assert float(errors[0].norm()) > 10 * scale  # a single sketch is far off; only the mean is close


def test_sketch_spectrum_of_an_identity_sketch_is_the_exact_spectrum() -> None:
    # S = I: Y = X and S 1 = 1, so the estimate is the spectrum itself, centred through the sketch identity.
    x, _ = _rows(n=12, d=5)
    ones = torch.ones(12, dtype=torch.float64)
    for center in (False, True):
        spec = sketch_spectrum(x, 12, sketch_signs=ones, feature_sum=x.sum(0), center=center)
        assert (spec.num_samples, spec.num_features, spec.centered) == (12, 5, center)
        np.testing.assert_allclose(spec.singular_values.numpy(), _np_sv(x, center), rtol=1e-10)
    # Three sketch rows resolve three values; the rest of the min(N, d) = 5 are 0.
    short = sketch_spectrum(x[:3], 12)
    assert short.singular_values.shape == (5,) and float(short.singular_values[3:].abs().sum()) == 0.0
    np.testing.assert_allclose(short.singular_values[:3].numpy(), _np_sv(x[:3]), rtol=1e-10)
    with pytest.raises(ValueError, match="sketch_signs"):
        sketch_spectrum(x, 12, center=True)


@pytest.mark.parametrize("center", [False, True])
def test_classwise_variance_ratio_from_grams_matches_rows(center: bool) -> None:
    x, y = _rows(n=50, d=6, classes=3)
    grams = torch.stack([x[y == c].T @ x[y == c] for c in range(4)])
    sums = torch.stack([x[y == c].sum(0) for c in range(4)])
    counts = torch.bincount(y, minlength=4)
    ratios = classwise_variance_ratio_from_grams(grams, counts, class_sums=sums, k=2, center=center)
    expected = F.classwise_variance_ratio(x, y, k=2, num_classes=4, center=center)
    np.testing.assert_allclose(ratios.numpy(), expected.numpy(), rtol=1e-10)
    assert math.isnan(float(ratios[3]))
    s = _np_sv(x[y == 1], center)
    assert float(ratios[1]) == pytest.approx((s[:2] ** 2).sum() / (s**2).sum(), rel=1e-10)
    empty = classwise_variance_ratio_from_grams(grams, torch.zeros(4, dtype=torch.int64))
    assert torch.isnan(empty).all()


def test_classwise_variance_ratio_from_sample_ignores_unlabelled_rows() -> None:
    x, y = _rows(n=40, d=5, classes=2)
    labels = y.clone()
    labels[::4] = -1
    sample = Subsample(x.float(), torch.rand(40, dtype=torch.float64), labels)
    ratios = classwise_variance_ratio_from_sample(sample, 3, k=1, center=True)
    for c in range(2):
        s = _np_sv(x.float()[labels == c], center=True)
        assert float(ratios[c]) == pytest.approx(s[0] ** 2 / (s**2).sum(), rel=1e-9)
    assert math.isnan(float(ratios[2]))


def test_move_reference_gives_the_moments_around_the_new_point() -> None:
    x, y = _rows(n=90, d=6, classes=3)
    a = torch.linspace(-1.0, 2.0, 6, dtype=torch.float64)
    b = torch.linspace(3.0, 0.5, 6, dtype=torch.float64)
    around_a, around_b = x - a, x - b
    sums, grams, squares = move_reference(a - b, 90, around_a.sum(0), around_a.T @ around_a, around_a.square().sum())
    torch.testing.assert_close(sums, around_b.sum(0), rtol=1e-13, atol=1e-12)
    torch.testing.assert_close(grams, around_b.T @ around_b, rtol=1e-13, atol=1e-11)
    torch.testing.assert_close(squares, around_b.square().sum(), rtol=1e-13, atol=0)
    # Per-class moments broadcast over the leading class dimension; to the origin gives the plain sums.
    counts = torch.bincount(y, minlength=3)
    class_sums = torch.stack([around_a[y == c].sum(0) for c in range(3)])
    class_grams = torch.stack([around_a[y == c].T @ around_a[y == c] for c in range(3)])
    moved_sums, moved_grams, _ = move_reference(a, counts, class_sums, class_grams)
    for c in range(3):
        torch.testing.assert_close(moved_sums[c], x[y == c].sum(0), rtol=1e-13, atol=1e-12)
        torch.testing.assert_close(moved_grams[c], x[y == c].T @ x[y == c], rtol=1e-13, atol=1e-11)


@pytest.mark.parametrize("offset", [1e6, 1e8])
def test_moments_around_a_reference_keep_the_spread_of_offset_data(offset: float) -> None:
    # Rows at a large offset with a small spread: the plain sums lose every digit of the centred Gram, the sums
    # around a reference near the data keep them.
    g = torch.Generator().manual_seed(8)
    x = offset + 0.1 * torch.randn(200, 5, generator=g, dtype=torch.float64)
    centred = x - x.mean(0)
    expected = centred.T @ centred
    reference = reference_point(x[:20].mean(0))
    gram = torch.zeros(5, 5, dtype=torch.float64)
    moments = row_moments(x, gram=gram, reference=reference)
    found = symmetrize_lower(gram) - torch.outer(moments.feature_sum, moments.feature_sum) / 200
    torch.testing.assert_close(found, expected, rtol=1e-9, atol=1e-9 * float(expected.abs().max()))
    plain = torch.zeros(5, 5, dtype=torch.float64)
    plain_sum = row_moments(x, gram=plain).feature_sum
    lost = (symmetrize_lower(plain) - torch.outer(plain_sum, plain_sum) / 200 - expected).abs().max()
    lost = lost / expected.abs().max()
    assert float(lost) > 1e-3  # what the reference point prevents


def test_reference_point_is_float32_representable_and_finite() -> None:
    mean = torch.tensor([1.0 + 2.0**-40, math.nan, math.inf, -3.25], dtype=torch.float64)
    point = reference_point(mean)
    assert point.dtype == torch.float64
    torch.testing.assert_close(point, torch.tensor([1.0, 0.0, 0.0, -3.25], dtype=torch.float64), rtol=0, atol=0)
    torch.testing.assert_close(point.float().double(), point, rtol=0, atol=0)


@pytest.mark.parametrize("route", ["rows", "maps"])
def test_float32_gram_products_add_into_float64_sums(route: str) -> None:
    g = torch.Generator().manual_seed(4)
    maps = torch.randn(40, 12, 3, 3, generator=g) + 2.0
    labels = torch.randint(0, 3, (40,), generator=g)
    reference = reference_point(maps.mean(dim=(0, 2, 3), dtype=torch.float64))
    grams = {}
    for precision in ("float64", "float32", "tf32"):
        gram = torch.zeros(12, 12, dtype=torch.float64)
        class_grams = torch.zeros(3, 12, 12, dtype=torch.float64)
        if route == "rows":
            rows = F.reduce_activations(maps, "channel")
            row_labels = labels.repeat_interleave(9)
            args = (rows, row_labels)
            moments = row_moments(
                *args, num_classes=3, gram=gram, class_grams=class_grams, reference=reference, precision=precision
            )
        else:
            moments = channel_gram_moments(
                maps,
                labels,
                num_classes=3,
                gram=gram,
                class_grams=class_grams,
                reference=reference,
                precision=precision,
            )
        assert gram.dtype == class_grams.dtype == moments.feature_sum.dtype == moments.sum_squares.dtype
        assert moments.feature_sum.dtype == torch.float64
        grams[precision] = (class_grams, moments)
    exact, exact_moments = grams["float64"]
    for precision in ("float32", "tf32"):  # TF32 is float32 on a CPU
        approx, moments = grams[precision]
        error = float((symmetrize_lower(approx) - symmetrize_lower(exact)).abs().max() / exact.abs().max())
        assert 1e-10 < error < 1e-6, precision
        # The first moments are float64 sums of the same shifted values in both cases.
        torch.testing.assert_close(moments.feature_sum, exact_moments.feature_sum, rtol=1e-6, atol=1e-5)
        torch.testing.assert_close(moments.sum_squares, exact_moments.sum_squares, rtol=1e-7, atol=0)


def test_gram_precision_choices_and_the_tf32_flag_is_restored() -> None:
    assert resolve_gram_precision("auto", "cpu") == AUTO_GRAM_PRECISION["cpu"] == "float64"
    assert resolve_gram_precision("auto", torch.device("cuda")) == AUTO_GRAM_PRECISION["cuda"]
    assert resolve_gram_precision("float32", "cpu") == "float32"
    assert GRAM_PRECISIONS == ("float64", "float32", "tf32", "auto")
    with pytest.raises(ValueError, match=r"unknown gram_precision 'half'; valid choices are: float64, float32"):
        resolve_gram_precision("half", "cpu")
    before = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        with gram_product_dtype("tf32") as dtype:
            # Inside, set through torch's newer flag where it has one (the older one cannot be read while it is set).
            newer = getattr(torch.backends.cuda.matmul, "fp32_precision", None)
            assert dtype == torch.float32 and (newer == "tf32" if newer else torch.backends.cuda.matmul.allow_tf32)
        assert torch.backends.cuda.matmul.allow_tf32 is False
        with gram_product_dtype("float64") as dtype:
            assert dtype == torch.float64 and torch.backends.cuda.matmul.allow_tf32 is False
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


@pytest.mark.parametrize("precision", ["float64", "float32"])
@pytest.mark.parametrize(("features", "rows"), [(7, 300), (130, 300), (300, 300), (130, 40)])
def test_gram_products_keep_the_lower_triangle(features: int, rows: int, precision: str) -> None:
    # Only the lower triangle is kept up to date. In float64 on a CPU it is BLAS's symmetric rank-k update, which never
    # writes above the diagonal. Float32 products from 128 features and 256 rows multiply only the blocks on and below
    # the diagonal (partial sums above it); a float32 product of fewer rows or features is one call, exact everywhere.
    g = torch.Generator().manual_seed(5)
    x = torch.randn(rows, features, generator=g, dtype=torch.float64)
    y = torch.randint(0, 2, (rows,), generator=g)
    gram = torch.zeros(features, features, dtype=torch.float64)
    class_grams = torch.zeros(2, features, features, dtype=torch.float64)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # where SciPy's dsyrk is taken (SCIPY_BLAS.usable)
        row_moments(x, gram=gram, precision=precision)
        row_moments(x, y, num_classes=2, class_grams=class_grams, precision=precision)
        syrk = precision == "float64" and SCIPY_BLAS.usable()
    finally:
        torch.set_num_threads(threads)
    expected = x.T @ x
    tol = 1e-12 if precision == "float64" else 1e-5 * float(expected.abs().max())
    torch.testing.assert_close(gram.tril(), expected.tril(), rtol=tol, atol=tol)
    torch.testing.assert_close(symmetrize_lower(gram), expected, rtol=tol, atol=tol)
    torch.testing.assert_close(symmetrize_lower(class_grams).sum(0), expected, rtol=tol, atol=tol)
    if syrk:
        assert bool((gram.triu(1) == 0).all()) and bool((class_grams.triu(1) == 0).all())  # never written
    else:
        partial = not torch.allclose(gram.triu(1), expected.triu(1), rtol=tol, atol=tol)  # partial sums above
        assert partial is (features >= 128 and rows >= 256)
