"""Neural collapse from sums against direct NumPy computations on raw features (Papyan et al. 2020, Galanti et al.)."""

from __future__ import annotations

import math
import re
import warnings

import numpy as np
import pytest
import torch

from rank_lightning.functional.neural_collapse import (
    NC_METRICS,
    between_class_directions,
    class_means,
    nearest_class_centre,
    neural_collapse,
    neural_collapse_from_moments,
    neural_collapse_from_residuals,
    residual_moments,
)


def _data(n_per_class=(30, 20, 25, 40), dim=12, spread=0.5, offset=0.0, seed=0):
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((len(n_per_class), dim)) * 2 + offset
    x = np.concatenate([c + spread * rng.standard_normal((n, dim)) for c, n in zip(centres, n_per_class)])
    y = np.concatenate([np.full(n, c) for c, n in enumerate(n_per_class)])
    order = rng.permutation(len(y))
    return x[order], y[order]


def _direct(x: np.ndarray, y: np.ndarray, w: np.ndarray, predictions: np.ndarray) -> dict[str, float]:
    """Every metric straight from the definitions (SPEC), NumPy float64, on the raw rows."""
    classes = np.unique(y)
    c = len(classes)
    mu_g = x.mean(axis=0)
    means = np.stack([x[y == k].mean(axis=0) for k in classes])
    centred = means - mu_g
    sigma_w = sum((x[y == k] - means[i]).T @ (x[y == k] - means[i]) for i, k in enumerate(classes)) / len(y)
    sigma_b = centred.T @ centred / c
    nc1 = np.trace(sigma_w @ np.linalg.pinv(sigma_b)) / c
    norms = np.linalg.norm(centred, axis=1)
    cos = (centred @ centred.T) / np.outer(norms, norms)
    off = cos[~np.eye(c, dtype=bool)]
    nc3 = np.sum((w / np.linalg.norm(w) - centred / np.linalg.norm(centred)) ** 2)
    distances = np.linalg.norm(x[:, None, :] - means[None], axis=2)
    nc4 = np.mean(classes[distances.argmin(axis=1)] == predictions)
    variances = [np.mean(np.sum((x[y == k] - means[i]) ** 2, axis=1)) for i, k in enumerate(classes)]
    pairs = [(a, b) for a in range(c) for b in range(a + 1, c)]
    cdnv = np.mean([(variances[a] + variances[b]) / (2 * np.sum((means[a] - means[b]) ** 2)) for a, b in pairs])
    return {
        "nc1": nc1,
        "nc2_equinorm": norms.std(ddof=1) / norms.mean(),
        "nc2_equiangularity": np.mean(np.abs(off + 1 / (c - 1))),
        "nc2_cosine_std": off.std(ddof=1),
        "nc3": nc3,
        "nc4": nc4,
        "cdnv": cdnv,
    }


def _close(result: dict[str, float], expected: dict[str, float], rtol: float) -> None:
    for key, value in expected.items():
        assert result[key] == pytest.approx(value, rel=rtol, abs=1e-12), key


def _inputs(offset=0.0, seed=0):
    x, y = _data(offset=offset, seed=seed)
    rng = np.random.default_rng(seed + 1)
    w = rng.standard_normal((4, x.shape[1]))
    predictions = rng.integers(0, 4, size=len(y))
    # Make the predictions agree with the nearest centre on part of the rows, so NC4 is neither 0 nor 1.
    means = np.stack([x[y == k].mean(axis=0) for k in range(4)])
    nearest = np.linalg.norm(x[:, None] - means[None], axis=2).argmin(axis=1)
    predictions[::2] = nearest[::2]
    return x, y, w, predictions


def test_neural_collapse_matches_the_definitions_on_raw_features() -> None:
    x, y, w, predictions = _inputs()
    result = neural_collapse(
        torch.from_numpy(x),
        torch.from_numpy(y),
        head_weight=torch.from_numpy(w),
        predictions=torch.from_numpy(predictions),
    )
    _close(result.as_dict(), _direct(x, y, w, predictions), 1e-10)
    assert result.num_classes == 4 and result.num_samples == len(y)
    assert 0 < result.nc4 < 1


def test_streamed_residual_passes_equal_the_direct_computation() -> None:
    x, y, w, predictions = _inputs(seed=3)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    counts, sums = torch.zeros(4, dtype=torch.long), torch.zeros(4, x.shape[1], dtype=torch.float64)
    batches = list(zip(xt.split(17), yt.split(17), torch.from_numpy(predictions).split(17)))
    for xb, yb, _ in batches:  # pass one: class sums
        counts += torch.bincount(yb, minlength=4)
        sums.index_add_(0, yb, xb)
    present, means, mu_g = class_means(counts, sums)
    basis = between_class_directions(means, mu_g)
    projected, scatter, agree = torch.zeros(4, dtype=torch.float64), torch.zeros(4, dtype=torch.float64), 0
    for xb, yb, pb in batches:  # pass two: residuals and agreement
        p, s = residual_moments(xb, yb, means, present, basis.directions, 4)
        projected[: p.shape[0]] += p
        scatter += s
        agree += int((present[nearest_class_centre(xb, means)] == pb).sum())
    result = neural_collapse_from_residuals(
        counts, sums, projected, scatter, head_weight=torch.from_numpy(w), agreements=agree
    )
    _close(result.as_dict(), _direct(x, y, w, predictions), 1e-10)


def _from_class_grams(x: torch.Tensor, y: torch.Tensor, counts, sums, classes: int, **options) -> object:
    """:func:`neural_collapse_from_moments` of the class Grams of ``x``, as the streamed sums hold them."""
    class_grams = torch.stack([x[y == k].T @ x[y == k] for k in range(classes)])
    gram, squares = class_grams.sum(0), class_grams.diagonal(dim1=1, dim2=2).sum(1)
    return neural_collapse_from_moments(counts, sums, gram=gram, class_sum_squares=squares, **options)


def test_one_pass_moments_equal_the_direct_computation_without_nc4() -> None:
    x, y, w, predictions = _inputs(seed=5)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    counts = torch.bincount(yt, minlength=4)
    sums = torch.zeros(4, x.shape[1], dtype=torch.float64).index_add_(0, yt, xt)
    result = _from_class_grams(xt, yt, counts, sums, 4, head_weight=torch.from_numpy(w))
    expected = _direct(x, y, w, predictions)
    expected.pop("nc4")
    _close(result.as_dict(), expected, 1e-10)
    assert math.isnan(result.nc4)


def test_residual_route_stays_exact_far_from_the_origin() -> None:
    # Offset 1e6 with spread 0.5: moment differences would lose about 12 of 16 digits; residuals lose none.
    x, y, w, predictions = _inputs(offset=1e6, seed=7)
    result = neural_collapse(torch.from_numpy(x), torch.from_numpy(y), predictions=torch.from_numpy(predictions))
    # The reference centres the rows before any product, as the residual route does.
    expected = _direct(x - x.mean(axis=0), y, w, predictions)
    for key in ("nc1", "cdnv", "nc2_equinorm", "nc2_equiangularity", "nc4"):
        assert result.as_dict()[key] == pytest.approx(expected[key], rel=1e-9), key


def test_a_simplex_etf_with_collapsed_classes_scores_perfect_collapse() -> None:
    classes, dim = 5, 8
    etf = torch.eye(classes, dim, dtype=torch.float64)
    etf[:, :classes] -= 1 / classes  # centred one-hot vectors: a simplex ETF
    features = etf.repeat_interleave(3, dim=0) + 4.0
    labels = torch.arange(classes).repeat_interleave(3)
    result = neural_collapse(features, labels, head_weight=2.5 * etf, predictions=labels)
    assert result.nc1 == pytest.approx(0, abs=1e-20)
    assert result.nc2_equinorm == pytest.approx(0, abs=1e-12)
    assert result.nc2_equiangularity == pytest.approx(0, abs=1e-12)
    assert result.nc2_cosine_std == pytest.approx(0, abs=1e-12)
    assert result.nc3 == pytest.approx(0, abs=1e-12)
    assert result.nc4 == 1.0
    assert result.cdnv == pytest.approx(0, abs=1e-20)


def test_classes_without_samples_are_left_out() -> None:
    x, y, w, predictions = _inputs(seed=9)
    shifted = y.copy()
    shifted[shifted == 3] = 5  # classes 3 and 4 have no sample, class 5 takes class 3's rows
    w6 = np.zeros((6, x.shape[1]))
    w6[[0, 1, 2, 5]] = w
    preds = predictions.copy()
    preds[preds == 3] = 5
    result = neural_collapse(
        torch.from_numpy(x),
        torch.from_numpy(shifted),
        num_classes=6,
        head_weight=torch.from_numpy(w6),
        predictions=torch.from_numpy(preds),
    )
    _close(result.as_dict(), _direct(x, shifted, w, preds), 1e-10)
    assert result.num_classes == 4


def test_undefined_cases_are_nan_and_bad_input_raises() -> None:
    one_class = neural_collapse(torch.randn(6, 3), torch.zeros(6, dtype=torch.long))
    assert all(math.isnan(v) for k, v in one_class.as_dict().items())
    with pytest.raises(ValueError, match="out of range"):
        neural_collapse(torch.randn(4, 3), torch.tensor([0, 1, 2, 3]), num_classes=3)
    with pytest.raises(ValueError, match=r"head_weight must be \(C=2"):
        neural_collapse(torch.randn(4, 3), torch.tensor([0, 1, 0, 1]), head_weight=torch.randn(3, 3))
    with pytest.raises(ValueError, match="metrics"):
        one_class.as_dict(("nc5",))
    assert list(one_class.as_dict()) == list(NC_METRICS)


def _rank_deficient(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """6 classes of 50 rows in d = 30 whose features have rank 3: the means span 3 of the C - 1 = 5 directions."""
    rng = np.random.default_rng(1)
    classes, per_class, dim, rank = 6, 50, 30, 3
    centres = rng.normal(size=(classes, dim)) * 3
    x = np.concatenate([centres[c] + rng.normal(size=(per_class, dim)) for c in range(classes)])
    mixing = rng.normal(size=(dim, rank))
    x = x @ mixing @ mixing.T / dim
    return torch.from_numpy(x).to(dtype), torch.from_numpy(np.repeat(np.arange(classes), per_class))


def test_float32_rounding_is_not_counted_as_between_class_directions() -> None:
    x64, y = _rank_deficient(torch.float64)
    x32 = x64.float()
    reference = neural_collapse(x64, y)
    # float32 rounding leaves the centred means singular values near 1e-9 s_1 along two directions the classes do
    # not span; with a float64 cut-off they were kept and NC1 came out 28 times too large.
    result = neural_collapse(x32, y)
    assert result.nc1 == pytest.approx(reference.nc1, rel=1e-5)
    assert result.cdnv == pytest.approx(reference.cdnv, rel=1e-5)

    counts = torch.bincount(y)
    sums = torch.zeros(6, 30, dtype=torch.float64).index_add_(0, y, x32.double())
    _, means, mu_g = class_means(counts, sums)
    assert between_class_directions(means, mu_g, dtype=torch.float32).singular_values.numel() == 3
    assert between_class_directions(means, mu_g, dtype=torch.bfloat16).singular_values.numel() == 3
    # The default (float64) keeps the pseudo-inverse's cut-off: the rounding directions of float32 data stay.
    assert between_class_directions(means, mu_g).singular_values.numel() == 5
    assert between_class_directions(means, mu_g, dtype=torch.float64).singular_values.numel() == 5

    # The summed entry points take the dtype too and agree with the in-memory computation.
    basis = between_class_directions(means, mu_g, dtype=torch.float32)
    present = torch.arange(6)
    projected, scatter = residual_moments(x32, y, means, present, basis.directions, 6)
    streamed = neural_collapse_from_residuals(counts, sums, projected, scatter, dtype=torch.float32)
    assert streamed.nc1 == pytest.approx(result.nc1, rel=1e-12)
    moments = _from_class_grams(x32.double(), y, counts, sums, 6, dtype=torch.float32)
    assert moments.nc1 == pytest.approx(reference.nc1, rel=1e-5)


@pytest.mark.parametrize(("dtype", "offset", "spread"), [(torch.bfloat16, 5.0, 0.005), (torch.float16, 5.0, 0.002)])
def test_half_precision_keeps_class_directions_its_averaged_rounding_resolves(dtype, offset, spread) -> None:
    # A cut-off of the whole eps_bf16 (0.0078 of the means' size) dropped every direction of these classes, whose
    # means spread over about 1e-3 of it: NC1 was NaN. 2000 rows per class average the rounding down to 2e-4.
    torch.manual_seed(0)
    classes, d, n = 10, 64, 2000
    y = torch.arange(classes).repeat_interleave(n)
    x64 = (
        offset
        + spread * torch.randn(classes, d, dtype=torch.float64)[y]
        + 0.1 * torch.randn(classes * n, d, dtype=torch.float64)
    )
    rounded = x64.to(dtype)
    result = neural_collapse(rounded, y, num_classes=classes)
    assert result.nc1 == pytest.approx(neural_collapse(x64, y, num_classes=classes).nc1, rel=0.05)
    assert result.nc1 == pytest.approx(neural_collapse(rounded.double(), y, num_classes=classes).nc1, rel=1e-9)
    # Without the class sizes (one row per class at worst) the cut-off stays the whole eps: nothing is resolved.
    counts = torch.bincount(y)
    _, means, mu_g = class_means(
        counts, torch.zeros(classes, d, dtype=torch.float64).index_add_(0, y, rounded.double())
    )
    assert between_class_directions(means, mu_g, dtype=dtype).singular_values.numel() == 0
    assert between_class_directions(means, mu_g, dtype=dtype, counts=counts).singular_values.numel() == classes - 1


@pytest.mark.parametrize("predicted", [0, 2])
def test_nc4_is_nan_when_the_class_means_coincide(predicted: int) -> None:
    # Every distance to a class mean ties, so the nearest centre is argmin's first index, not a property of the data.
    labels = torch.arange(40) % 4
    result = neural_collapse(torch.ones(40, 6), labels, predictions=torch.full((40,), predicted))
    assert math.isnan(result.nc1) and math.isnan(result.nc4)
    one_class = neural_collapse(torch.randn(6, 3), torch.zeros(6, dtype=torch.long), predictions=torch.zeros(6))
    assert math.isnan(one_class.nc4)


def test_complex_features_or_head_weight_are_refused_naming_them() -> None:
    # Converted to float64 they would lose their imaginary part with only torch's cast warning.
    labels = torch.arange(12) % 3
    with pytest.raises(ValueError, match=r"features must be real, got torch\.complex64"):
        neural_collapse(torch.randn(12, 4, dtype=torch.complex64), labels)
    with pytest.raises(ValueError, match=r"head_weight must be real, got torch\.complex64"):
        neural_collapse(torch.randn(12, 4), labels, head_weight=torch.randn(3, 4, dtype=torch.complex64))


@pytest.mark.parametrize("dtype", ["float64", 64, np.float32])
def test_a_dtype_that_is_no_torch_dtype_is_refused_by_name(dtype) -> None:
    x, y = (torch.from_numpy(a) for a in _data())
    counts = torch.bincount(y, minlength=4)
    sums = torch.zeros(4, x.shape[1], dtype=torch.float64).index_add_(0, y, x)
    message = (
        f"dtype must be None or a torch.dtype, got {dtype!r}; valid dtypes are: torch.float64, torch.float32, "
        "torch.bfloat16, torch.float16 (or an integer torch dtype)"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        _from_class_grams(x, y, counts, sums, 4, dtype=dtype)
    # Means that are not finite return before the cut-off is computed: the dtype is checked all the same.
    with pytest.raises(ValueError, match=re.escape(message)):
        between_class_directions(torch.full((2, 3), math.nan), torch.zeros(3), dtype=dtype)
    assert _from_class_grams(x, y, counts, sums, 4, dtype=torch.float32).num_samples == 115


def test_one_pass_moments_of_tight_classes_warn_of_their_rounding() -> None:
    # Classes of spread 1e-8 around means 2 apart: X^T X - sum_c S_c S_c^T / n_c cancels every digit of Sigma_W.
    for spread, warns in ((1e-8, True), (1e-2, False)):
        x, y = _data(spread=spread, seed=3)
        xt, yt = torch.from_numpy(x), torch.from_numpy(y)
        counts = torch.bincount(yt, minlength=4)
        sums = torch.zeros(4, x.shape[1], dtype=torch.float64).index_add_(0, yt, xt)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = _from_class_grams(xt, yt, counts, sums, 4)
        messages = [str(w.message) for w in caught]
        for statistic in ("NC1", "CDNV"):
            named = [m for m in messages if m.startswith(f"neural_collapse_from_moments: {statistic} (")]
            assert len(named) == int(warns), messages
            assert all("may be off by about" in m and "neural_collapse_from_residuals" in m for m in named)
        if not warns:
            expected = neural_collapse(xt, yt)
            assert result.nc1 == pytest.approx(expected.nc1, rel=1e-9)
            assert result.cdnv == pytest.approx(expected.cdnv, rel=1e-9)
