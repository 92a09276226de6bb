import math

import numpy as np
import pytest
import torch

import rank_lightning.functional as F
from rank_lightning.functional.streaming import (
    Subsample,
    channel_gram_moments,
    channel_gram_pays,
    classwise_variance_ratio_from_grams,
    classwise_variance_ratio_from_sample,
    count_sketch,
    merge_subsamples,
    row_moments,
    sketch_spectrum,
    subsample_spectrum,
    subsample_update,
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
    # The Gram is added into the running sum.
    np.testing.assert_allclose(gram.numpy(), 2.0 + a.T @ a, rtol=1e-13)
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
        np.testing.assert_allclose(class_grams[c].numpy(), 1.0 + rows.T @ rows, rtol=1e-13)
    np.testing.assert_allclose((class_grams - 1).sum(0).numpy(), a.T @ a, rtol=1e-12)
    # Without labels, class Grams are left alone and the rows go to the Gram.
    row_moments(x, None, num_classes=4, gram=gram, class_grams=class_grams)
    np.testing.assert_allclose(gram.numpy(), a.T @ a, rtol=1e-13)


def test_row_moments_flag_non_finite_batches() -> None:
    x, _ = _rows(n=10, d=3)
    for value in (math.nan, math.inf, -math.inf):
        bad = x.clone()
        bad[4, 1] = value
        assert int(row_moments(bad).nonfinite) == 1
    assert int(row_moments(x).nonfinite) == 0


@pytest.mark.parametrize(
    ("shape", "pays"), [((64, 8, 8), True), ((16, 2, 2), True), ((16, 1, 2), False), ((512, 4, 4), False)]
)
def test_channel_gram_pays_for_large_maps_under_channel_reduction(shape: tuple, pays: bool) -> None:
    maps = torch.zeros(2, *shape)
    assert channel_gram_pays(maps, "channel") is pays
    assert not channel_gram_pays(maps, "flatten")
    assert not channel_gram_pays(torch.zeros(2, 8), "channel")


# (150, 64, 8, 8) spans three blocks of 64 inputs; (9, 3, 5, 4) fits in one.
@pytest.mark.parametrize("shape", [(150, 64, 8, 8), (9, 3, 5, 4)])
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
    np.testing.assert_allclose(gram.numpy(), expected, rtol=1e-12, atol=atol)
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
        np.testing.assert_allclose(class_grams[c].numpy(), (block.T @ block).numpy(), rtol=1e-12, atol=atol)

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
