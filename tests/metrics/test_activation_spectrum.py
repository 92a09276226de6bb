import io
import math
import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from sklearn.decomposition import PCA
from torchmetrics import MetricCollection

import rank_lightning.functional as F
import rank_lightning.metrics
from rank_lightning.functional.spectral import SPECTRAL_METRICS, SpectralSummary, default_rank_tolerance
from rank_lightning.functional.streaming import symmetrize_lower
from rank_lightning.metrics import ACTIVATION_METRICS, ActivationSpectrum, ActivationSpectrumResult
from tests.metrics.ddp_helpers import (
    DDP_CONFIGS,
    IDLE_RANK_CONFIGS,
    OFFSETS,
    clustered_data,
    ddp_results,
    ddp_worker,
    idle_rank_results,
    idle_rank_worker,
)


def _stream(metric: ActivationSpectrum, x: torch.Tensor, y: torch.Tensor | None, sizes: list[int]) -> None:
    start = 0
    for size in sizes:
        metric.update(x[start : start + size], None if y is None else y[start : start + size])
        start += size
    assert start == x.shape[0]


def _np_sv(x: torch.Tensor, center: bool = False) -> np.ndarray:
    a = x.double().numpy()
    return np.linalg.svd(a - a.mean(0) if center else a, compute_uv=False)


def _assert_scalars_close(a: dict[str, float], b: dict[str, float], rtol: float) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert a[key] == pytest.approx(b[key], rel=rtol, abs=1e-300, nan_ok=True), key


def test_gram_path_matches_numpy_and_functional() -> None:
    x, y = clustered_data()
    metric = ActivationSpectrum(num_classes=4, center="both", variance_ratio_ks=(1, 3, 6))
    _stream(metric, x, y, [100] * 6)
    result = metric.compute()
    assert isinstance(result, ActivationSpectrumResult)
    assert result.path == "gram"
    assert (result.num_samples, result.num_features, result.num_spectrum_samples) == (600, 24, 600)
    for summary, center in ((result.uncentered, False), (result.centered, True)):
        np.testing.assert_allclose(summary.spectrum.singular_values.numpy(), _np_sv(x, center), rtol=1e-9)
        assert summary.spectrum.centered is center
        spec = F.spectrum(x, center=center)
        assert int(summary.numerical_rank) == int(F.numerical_rank(spec))
        assert int(summary.soft_rank) == int(F.soft_rank(spec))
        for name in ("participation_ratio", "stable_rank", "effective_rank"):
            assert float(getattr(summary, name)) == pytest.approx(float(getattr(F, name)(spec)), rel=1e-9)
        for k in (1, 3, 6):
            assert float(summary.variance_ratio[k]) == pytest.approx(float(F.variance_ratio(spec, k)), rel=1e-9)
    pca = PCA().fit(x.numpy())
    np.testing.assert_allclose(
        result.centered.variance_ratio_curve.numpy(), np.cumsum(pca.explained_variance_ratio_), rtol=1e-9
    )
    assert float(result.total_cluster_variation) == pytest.approx(float(F.total_cluster_variation(x, y)), rel=1e-9)
    assert float(result.total_cluster_variation_normalized) == pytest.approx(
        float(F.total_cluster_variation(x, y, normalized=True)), rel=1e-9
    )
    assert result.classwise_source == "class_gram"
    np.testing.assert_allclose(
        result.classwise_variance_ratio.numpy(), F.classwise_variance_ratio(x, y, num_classes=4).numpy(), rtol=1e-9
    )
    scalars = result.as_dict()
    assert scalars["numerical_rank"] == float(result.uncentered.numerical_rank)
    assert {"centered_variance_ratio_3", "tcv", "tcv_normalized", "classwise_variance_ratio_1_class_3"} <= set(scalars)


def test_streaming_in_chunks_equals_one_shot() -> None:
    x, y = clustered_data(n=500, d=16)
    one_shot = ActivationSpectrum(num_classes=4, center="both")
    one_shot.update(x, y)
    chunked = ActivationSpectrum(num_classes=4, center="both")
    _stream(chunked, x, y, [1, 7, 250, 42, 200])
    a, b = one_shot.compute(), chunked.compute()
    _assert_scalars_close(a.as_dict(), b.as_dict(), rtol=1e-11)
    torch.testing.assert_close(
        a.centered.spectrum.singular_values, b.centered.spectrum.singular_values, rtol=1e-11, atol=0
    )


def test_default_center_is_uncentered_only() -> None:
    x, _ = clustered_data(n=50, d=8)
    metric = ActivationSpectrum()
    metric.update(x)
    result = metric.compute()
    assert result.centered is None and result.uncentered is not None
    assert result.total_cluster_variation is None and result.classwise_variance_ratio is None
    centred_only = ActivationSpectrum(center=True)
    centred_only.update(x)
    assert centred_only.compute().uncentered is None


def test_float32_and_bf16_activations_give_float64_answer() -> None:
    # Sums run in float64 on the upcast values: the result equals NumPy's float64 SVD of the same (rounded) data to
    # 1e-9, and the float64 data's metrics to 1e-5 (float32) or 2e-2 (bf16, 8-bit mantissa).
    x, y = clustered_data(n=400, d=20)
    reference = ActivationSpectrum(num_classes=4)
    reference.update(x, y)
    ref = reference.compute()
    for dtype, rtol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        metric = ActivationSpectrum(num_classes=4)
        _stream(metric, x.to(dtype), y, [150, 250])
        result = metric.compute()
        assert result.uncentered.spectrum.singular_values.dtype == torch.float64
        np.testing.assert_allclose(
            result.uncentered.spectrum.singular_values.numpy(), _np_sv(x.to(dtype).double()), rtol=1e-9, atol=1e-9
        )
        for key in ("participation_ratio", "stable_rank", "effective_rank", "variance_ratio_1", "tcv"):
            assert result.as_dict()[key] == pytest.approx(ref.as_dict()[key], rel=rtol), (dtype, key)


def test_conv_channel_reduction_repeats_labels() -> None:
    g = torch.Generator().manual_seed(2)
    maps = torch.randn(12, 5, 3, 3, generator=g)
    labels = torch.arange(12) % 3
    metric = ActivationSpectrum(num_classes=3, reduction="channel")
    metric.update(maps[:5], labels[:5])
    metric.update(maps[5:], labels[5:])
    result = metric.compute()
    rows = maps.permute(0, 2, 3, 1).reshape(-1, 5).double()
    row_labels = labels.repeat_interleave(9)
    assert result.num_samples == 108 and result.num_features == 5
    np.testing.assert_allclose(result.uncentered.spectrum.singular_values.numpy(), _np_sv(rows), rtol=1e-9)
    assert float(result.total_cluster_variation) == pytest.approx(
        float(F.total_cluster_variation(rows, row_labels)), rel=1e-9
    )


def test_token_and_mean_reductions() -> None:
    tokens = torch.randn(6, 4, 8)
    metric = ActivationSpectrum(reduction="token")
    metric.update(tokens)
    assert metric.compute().num_samples == 24
    pooled = ActivationSpectrum(reduction="mean")
    pooled.update(torch.randn(6, 3, 4, 4))
    assert pooled.compute().num_features == 3
    with pytest.raises(ValueError, match="earlier batches had 3"):
        pooled.update(torch.randn(6, 4, 4, 4))


def test_sample_gram_path_is_exact_when_every_row_fits() -> None:
    x, y = clustered_data(n=120, d=40)
    metric = ActivationSpectrum(num_classes=4, center="both", max_gram_features=32, max_samples=200)
    _stream(metric, x, y, [50, 50, 20])
    result = metric.compute()
    assert result.path == "sample_gram" and result.num_spectrum_samples == 120
    for summary, center in ((result.uncentered, False), (result.centered, True)):
        np.testing.assert_allclose(
            summary.spectrum.singular_values.numpy(), _np_sv(x, center), rtol=1e-8, atol=1e-8 * _np_sv(x)[0]
        )
    assert result.classwise_source == "sample"
    np.testing.assert_allclose(
        result.classwise_variance_ratio.numpy(), F.classwise_variance_ratio(x, y, num_classes=4).numpy(), rtol=1e-9
    )
    assert float(result.total_cluster_variation) == pytest.approx(float(F.total_cluster_variation(x, y)), rel=1e-9)


def test_sample_gram_subsample_is_uniform_and_bounded() -> None:
    n, d, cap = 3000, 40, 300
    # Feature 0 identifies the row, so the kept rows reveal which samples were chosen.
    x = torch.randn(n, d, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    x[:, 0] = torch.arange(n, dtype=torch.float64)
    metric = ActivationSpectrum(max_gram_features=32, max_samples=cap, seed=1)
    _stream(metric, x, None, [100] * 30)
    rows = metric._subsample().rows
    ids = rows[:, 0].long()
    assert rows.shape == (cap, d)
    assert ids.unique().numel() == cap
    torch.testing.assert_close(rows, x[ids], rtol=0, atol=0)
    # Uniform over the stream: mean index near n / 2 (std of the mean ~ 50), not skewed to early or late batches.
    assert abs(ids.double().mean().item() - n / 2) < 250
    assert (ids < n / 2).sum().item() == pytest.approx(cap / 2, abs=45)
    result = metric.compute()
    assert result.path == "sample_gram" and result.num_spectrum_samples == cap and result.num_samples == n


def test_default_fallback_size_follows_the_budget() -> None:
    metric = ActivationSpectrum(max_gram_features=999, memory_budget_mb=1.0)
    metric.update(torch.randn(4, 1000))
    assert metric.path == "sample_gram"
    m = metric.fallback_size
    assert 8 * (m * m + m * 1000) <= 2**20 < 8 * ((m + 1) ** 2 + (m + 1) * 1000)
    capped = ActivationSpectrum(max_gram_features=64)
    capped.update(torch.randn(4, 1000))
    assert capped.fallback_size == 64


def test_sketch_path_estimates_leading_singular_values() -> None:
    g = torch.Generator().manual_seed(6)
    s = torch.tensor([50.0, 30.0, 20.0, 10.0], dtype=torch.float64)
    u, _ = torch.linalg.qr(torch.randn(4000, 4, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(64, 4, generator=g, dtype=torch.float64))
    x = (u * s) @ v.T + 3.0
    metric = ActivationSpectrum(center="both", max_gram_features=32, fallback="sketch", max_samples=512)
    _stream(metric, x, None, [500] * 8)
    result = metric.compute()
    assert result.path == "sketch"
    assert result.uncentered.spectrum.singular_values.shape == (64,)
    est = result.centered.spectrum.singular_values[:4].numpy()
    np.testing.assert_allclose(est, _np_sv(x, center=True)[:4], rtol=0.15)
    assert int(result.centered.numerical_rank) == 4


def test_class_grams_over_budget_are_skipped() -> None:
    x, y = clustered_data(n=100, d=64)
    # Gram 32 KiB fits, 4 class Grams (128 KiB) do not.
    metric = ActivationSpectrum(num_classes=4, memory_budget_mb=0.1)
    metric.update(x, y)
    result = metric.compute()
    assert result.path == "gram" and not metric.uses_class_grams
    assert result.classwise_variance_ratio is None and result.classwise_source is None
    assert result.total_cluster_variation is not None


def test_num_features_preallocates_and_reset_clears() -> None:
    x, y = clustered_data(n=80, d=10)
    metric = ActivationSpectrum(num_classes=4, num_features=10)
    assert metric.gram.shape == (10, 10) and metric.class_grams.shape == (4, 10, 10)
    metric.update(x, y)
    first = metric.compute().as_dict()
    metric.reset()
    assert float(metric.gram.abs().sum()) == 0.0 and metric.gram.shape == (10, 10)
    metric.update(x, y)
    _assert_scalars_close(first, metric.compute().as_dict(), rtol=1e-12)


@pytest.mark.parametrize("value", [1, "yes"])
def test_classwise_center_is_checked_at_construction(value) -> None:
    # A non-bool was accepted here and refused by the class-wise VR at compute(), after the whole pass.
    with pytest.raises(ValueError, match=rf"unknown classwise_center {value!r}; valid choices are: False, True"):
        ActivationSpectrum(num_classes=2, classwise_center=value)


def test_reset_learns_the_width_again() -> None:
    # The width of the first batch outlived reset(): a layer of another width was "earlier batches had 6".
    metric = ActivationSpectrum()
    metric.update(torch.randn(9, 6))
    metric.reset()
    x = torch.randn(12, 4, dtype=torch.float64)
    metric.update(x)
    assert metric.num_features == 4
    assert int(metric.compute().uncentered.numerical_rank) == 4
    fixed = ActivationSpectrum(num_features=6)
    fixed.reset()
    with pytest.raises(ValueError, match="reduce to 4 features"):
        fixed.update(x)


@pytest.mark.parametrize("offset", [0.0, 1e3])
def test_merge_state_equals_one_stream(offset: float) -> None:
    # torchmetrics' own merge_state refused (full_state_update=True). Both halves take their sums around their own
    # first batch's mean; the merged metric must equal one metric that streamed every batch.
    x, y = clustered_data(n=150, d=12)
    x = x + offset
    options = {"num_classes": 4, "center": "both", "variance_ratio_ks": (1, 3)}
    whole = ActivationSpectrum(**options)
    _stream(whole, x, y, [40, 40, 40, 30])
    first, second = ActivationSpectrum(**options), ActivationSpectrum(**options)
    _stream(first, x[:80], y[:80], [40, 40])
    _stream(second, x[80:] * 1, y[80:], [40, 30])
    before = second.metric_state["gram"].clone()
    first.merge_state(second)
    assert torch.equal(second.metric_state["gram"], before)  # the incoming metric is left as it was
    expected = whole.compute().as_dict()
    _assert_scalars_close(expected, first.compute().as_dict(), rtol=1e-10)
    from_dict = ActivationSpectrum(**options)  # an empty metric takes the incoming reference
    from_dict.merge_state(first.metric_state)
    _assert_scalars_close(expected, from_dict.compute().as_dict(), rtol=1e-10)
    from_dict.update(x[:5], y[:5])  # and keeps streaming
    assert int(from_dict.num_samples) == 155


def test_merge_state_of_subsamples_and_bad_merges() -> None:
    x, y = clustered_data(n=120, d=40)
    options = {"num_classes": 4, "center": "both", "max_gram_features": 32, "max_samples": 200}
    first, second = ActivationSpectrum(seed=1, **options), ActivationSpectrum(seed=2, **options)
    _stream(first, x[:70], y[:70], [70])
    _stream(second, x[70:], y[70:], [50])
    first.merge_state(second)
    result = first.compute()
    assert result.path == "sample_gram" and result.num_spectrum_samples == 120
    np.testing.assert_allclose(
        result.uncentered.spectrum.singular_values.numpy(), _np_sv(x), rtol=1e-8, atol=1e-8 * _np_sv(x)[0]
    )
    same_seed = ActivationSpectrum(seed=1, **options)
    _stream(same_seed, x[:10], y[:10], [10])
    with pytest.raises(ValueError, match="'sample_gram' fallback drawn with seed=1; metrics to be merged need"):
        first.merge_state(same_seed)
    narrow = ActivationSpectrum(num_classes=4)
    narrow.update(torch.randn(5, 3), torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="cannot merge rows of 3 features into rows of 40 features"):
        first.merge_state(narrow)
    with pytest.raises(ValueError, match="num_classes=None into one with 4"):
        first.merge_state(ActivationSpectrum())
    with pytest.raises(ValueError, match="expected an ActivationSpectrum or its state dict, got int"):
        first.merge_state(3)


def test_merging_a_metric_that_keeps_its_rows_otherwise_raises_and_changes_nothing() -> None:
    # Other settings gave states of other shapes: the merge raised a bare size mismatch halfway, after the counts and
    # sums had been added, and the metric then computed a spectrum of half its rows over the count of all of them.
    x, y = clustered_data(n=120, d=12)
    merged, whole = ActivationSpectrum(num_classes=4), ActivationSpectrum(num_classes=4)
    _stream(merged, x[:60], y[:60], [60])
    _stream(whole, x, y, [60, 60])
    message = (
        r"keeps the exact Gram of 12 features \(4 classes\) into one that keeps the exact Gram and per-class Grams of "
        r"12 features \(4 classes\); merge metrics made with the same num_classes, classwise, max_gram_features"
    )
    kinds = {
        message: {"classwise": False},
        r"keeps a subsample of 30 rows of 12 features .* into one that keeps the exact Gram": {
            "max_gram_features": 8,
            "max_samples": 30,
            "seed": 1,
        },
    }
    for match, options in kinds.items():
        other = ActivationSpectrum(num_classes=4, **options)
        _stream(other, x[60:], y[60:], [60])
        with pytest.raises(ValueError, match=match):
            merged.merge_state(other)
        assert int(merged.num_samples) == 60
    correct = ActivationSpectrum(num_classes=4)
    _stream(correct, x[60:], y[60:], [60])
    merged.merge_state(correct)
    _assert_scalars_close(merged.compute().as_dict(), whole.compute().as_dict(), rtol=1e-12)


def test_merging_the_state_dict_of_a_subsample_drawn_with_the_same_seed_raises() -> None:
    # A state dict does not tell its seed: the i-th rows of both subsamples shared their random key, and the
    # smallest keys of the union kept rows in pairs, not a uniform subsample.
    x, _ = clustered_data(n=100, d=12)
    options = {"max_gram_features": 8, "max_samples": 30}
    merged, same_seed, other_seed = (ActivationSpectrum(**options, seed=seed) for seed in (0, 0, 3))
    merged.update(x[:50])
    same_seed.update(x[50:])
    other_seed.update(x[50:])
    shared = r"shares random keys with this one: rows drawn with the same seed \(this metric's is seed=0; metrics"
    with pytest.raises(ValueError, match=shared):
        merged.merge_state(same_seed.metric_state)
    assert int(merged.num_samples) == 50
    merged.merge_state(other_seed.metric_state)
    assert int(merged.num_samples) == 100 and merged.compute().num_spectrum_samples == 30
    with pytest.raises(ValueError, match="or rows merged twice"):
        merged.merge_state(other_seed.metric_state)


def test_a_move_to_another_device_goes_on_with_new_keys() -> None:
    # The generator is made anew on the rows' device; seeded as at the start, the rows after a move mid-stream
    # would get the first rows' keys again. (A CPU-only machine cannot move rows: ``cpu:0`` is another device to the
    # generator, which is what a move looks like to it.)
    x, _ = clustered_data(n=100, d=12)
    metric = ActivationSpectrum(max_gram_features=8, max_samples=30, seed=4)
    metric.update(x[:50])
    moved = torch.rand(50, generator=metric._rng(torch.device("cpu", 0)), dtype=torch.float64)
    first = torch.rand(50, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    assert not bool(torch.isin(moved, first).any())
    again = ActivationSpectrum(max_gram_features=8, max_samples=30, seed=4)
    again.update(x[:50])
    repeated = torch.rand(50, generator=again._rng(torch.device("cpu", 0)), dtype=torch.float64)
    assert torch.equal(moved, repeated)  # still reproducible from the seed


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_rows_streamed_after_a_round_trip_through_a_gpu_get_keys_of_their_own() -> None:
    x, _ = clustered_data(n=150, d=12)
    metric = ActivationSpectrum(max_gram_features=8, max_samples=150, seed=4)
    metric.update(x[:50])
    metric.to("cuda")
    metric.update(x[50:100].cuda())
    metric.to("cpu")
    metric.update(x[100:])
    keys = metric.sample_keys[0] if isinstance(metric.sample_keys, list) else metric.sample_keys
    assert keys.numel() == 150 and keys.unique().numel() == 150


def test_forward_returns_batch_result_and_accumulates() -> None:
    x, y = clustered_data(n=90, d=10)
    metric = ActivationSpectrum(num_classes=4)
    batch = metric(x[:30], y[:30])
    assert batch.num_samples == 30
    metric(x[30:], y[30:])
    assert metric.compute().num_samples == 90


def test_non_finite_rows_give_nan_and_warning_without_raising() -> None:
    x, y = clustered_data(n=60, d=8)
    bad = x.clone()
    bad[5, 2] = math.nan
    bad[40, 0] = math.inf
    for kwargs in ({}, {"max_gram_features": 4}, {"max_gram_features": 4, "fallback": "sketch"}):
        metric = ActivationSpectrum(num_classes=4, center="both", **kwargs)
        metric.update(bad[:30], y[:30])
        metric.update(bad[30:], y[30:])
        with pytest.warns(RuntimeWarning, match=r"2 batch\(es\) of activations contained NaN or Inf"):
            result = metric.compute()
        assert result.num_nonfinite_batches == 2
        values = result.as_dict()
        # Only the count of rows behind the (NaN) spectrum stays a number.
        assert values.pop("spectrum_rows") == 60
        assert values and all(math.isnan(v) for v in values.values()), kwargs


def test_degenerate_inputs() -> None:
    single = ActivationSpectrum(num_classes=2, center="both")
    single.update(torch.tensor([[3.0, 4.0]]), torch.tensor([1]))
    r = single.compute()
    assert int(r.uncentered.numerical_rank) == 1
    assert float(r.uncentered.spectrum.singular_values[0]) == pytest.approx(5.0)
    assert int(r.centered.numerical_rank) == 0
    assert float(r.total_cluster_variation) == 0.0
    assert math.isnan(float(r.classwise_variance_ratio[0]))
    assert float(r.classwise_variance_ratio[1]) == pytest.approx(1.0)

    one_feature = ActivationSpectrum()
    one_feature.update(torch.randn(50, 1))
    assert int(one_feature.compute().uncentered.numerical_rank) == 1

    zeros = ActivationSpectrum(num_classes=3)
    zeros.update(torch.zeros(20, 6), torch.zeros(20, dtype=torch.long))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        z = zeros.compute()
    assert int(z.uncentered.numerical_rank) == 0 and float(z.uncentered.participation_ratio) == 0.0
    assert float(z.total_cluster_variation) == 0.0

    one_class = ActivationSpectrum(num_classes=3)
    x, _ = clustered_data(n=40, d=5)
    one_class.update(x, torch.full((40,), 2))
    oc = one_class.compute()
    assert float(oc.total_cluster_variation_normalized) == pytest.approx(1.0)
    assert torch.isnan(oc.classwise_variance_ratio[:2]).all() and not torch.isnan(oc.classwise_variance_ratio[2])

    empty = ActivationSpectrum()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert math.isnan(empty.compute().as_dict()["numerical_rank"])
    assert any("no activations were streamed" in str(w.message) for w in caught)


def test_labels_are_validated_and_ignored_without_classes() -> None:
    x, y = clustered_data(n=20, d=4)
    metric = ActivationSpectrum(num_classes=4)
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 4\)"):
        metric.update(x, y + 4)
    with pytest.raises(ValueError, match="shape"):
        metric.update(x, y[:3])
    plain = ActivationSpectrum()
    plain.update(x, y)
    assert plain.compute().total_cluster_variation is None


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"reduction": "pool"}, "valid choices"),
        ({"center": "yes"}, "valid choices"),
        ({"fallback": "svd"}, "valid choices"),
        ({"tolerance_size": "mid"}, "valid choices"),
        ({"num_classes": 0}, "num_classes"),
        ({"variance_ratio_ks": (0, 2)}, "variance_ratio_ks"),
        ({"max_samples": 0}, "max_samples"),
        ({"memory_budget_mb": 0}, "memory_budget_mb"),
        # The seed is first used by a fallback's first draw: a bad one must fail here, not mid-fit.
        ({"seed": "3"}, r"seed must be an integer, got '3'"),
        ({"seed": 2.5}, r"seed must be an integer, got 2\.5"),
        ({"seed": True}, r"seed must be an integer, got True"),
    ],
)
def test_invalid_arguments(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ActivationSpectrum(**kwargs)


@pytest.mark.slow
def test_two_process_ddp_equals_one_process(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    mp.spawn(ddp_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    single = ddp_results(0, 1)
    for rank in range(2):
        distributed = torch.load(tmp_path / f"rank{rank}.pt")
        for name in DDP_CONFIGS:
            assert distributed[name]["num_samples"] == 480.0
            _assert_scalars_close(distributed[name], single[name], rtol=1e-9)
    # Far from the origin, the shared reference keeps one and two processes in agreement to rounding, and both
    # exact against the centred data.
    offset = torch.load(tmp_path / "rank1.pt")["offset"]
    x, y = clustered_data(n=480, d=24, seed=9)
    x = x + OFFSETS["offset"]
    assert offset["tcv"] == pytest.approx(float(F.total_cluster_variation(x, y)), rel=1e-12)
    centred = {k: v for k, v in offset.items() if k.startswith(("centered_", "tcv", "classwise"))}
    _assert_scalars_close(centred, {k: single["offset"][k] for k in centred}, rtol=1e-12)
    values, one_process = ([r[f"sv_{i}"] for i in range(24)] for r in (offset, single["offset"]))
    np.testing.assert_allclose(values, one_process, rtol=1e-12, atol=1e-12 * values[0])
    np.testing.assert_allclose(values, _np_sv(x, center=True), rtol=1e-9)


@pytest.mark.slow
def test_a_rank_that_never_sees_a_batch_syncs_without_num_features(tmp_path: Path) -> None:
    # Such a rank holds unshaped states (and empty subsample lists) when the others hold d-wide ones; the sync used to
    # abort the process group on mismatched collectives.
    torch.set_num_threads(1)
    mp.spawn(idle_rank_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    single = idle_rank_results(0, 1)
    for rank in range(2):
        distributed = torch.load(tmp_path / f"rank{rank}.pt")
        for name in IDLE_RANK_CONFIGS:
            for values in distributed[name]:
                assert values["num_samples"] == 240.0
                _assert_scalars_close(values, single[name][0], rtol=1e-12)


def test_tcv_is_not_reported_when_some_rows_lack_labels():
    torch.manual_seed(0)
    metric = ActivationSpectrum(num_classes=2)
    metric.update(torch.randn(8, 3), torch.tensor([0, 1] * 4))
    metric.update(torch.randn(8, 3))
    with pytest.warns(RuntimeWarning, match="without labels"):
        result = metric.compute()
    assert result.total_cluster_variation is None


def test_rank_tolerance_must_be_positive():
    with pytest.raises(ValueError, match=r"rank_tolerance must be a positive number or None, got -1\.0"):
        ActivationSpectrum(rank_tolerance=-1.0)


def test_labelled_and_unlabelled_batches_share_one_exact_gram() -> None:
    # Labelled rows feed the class Grams only; the spectrum must still cover every row, labelled or not.
    g = torch.Generator().manual_seed(5)
    x = torch.randn(40, 6, generator=g) + 2.0
    y = torch.randint(0, 3, (40,), generator=g)
    metric = ActivationSpectrum(num_classes=3, center="both")
    metric.update(x[:15], y[:15])
    metric.update(x[15:25])
    metric.update(x[25:], y[25:])
    with pytest.warns(RuntimeWarning, match="without labels"):
        result = metric.compute()
    np.testing.assert_allclose(result.uncentered.spectrum.singular_values.numpy(), _np_sv(x), rtol=1e-10)
    np.testing.assert_allclose(result.centered.spectrum.singular_values.numpy(), _np_sv(x, center=True), rtol=1e-9)
    labelled = torch.cat([x[:15], x[25:]])
    labels = torch.cat([y[:15], y[25:]])
    for c in range(3):
        s = _np_sv(labelled[labels == c])
        assert float(result.classwise_variance_ratio[c]) == pytest.approx(s[0] ** 2 / (s**2).sum(), rel=1e-10)


# (16, 1, 2): 4 x 2 positions < 16 channels, rows reordered; (3, 4, 4): per-input Grams of the maps as they are.
@pytest.mark.parametrize("shape", [(16, 1, 2), (3, 4, 4)])
@pytest.mark.parametrize("classwise_center", [False, True])
def test_channel_reduction_matches_rows_on_both_accumulation_routes(shape: tuple, classwise_center: bool) -> None:
    g = torch.Generator().manual_seed(6)
    channels = shape[0]
    maps = torch.randn(10, *shape, generator=g).abs()
    labels = torch.tensor([2, 0, 2, 1, 0, 2, 1, 1, 0, 2])
    metric = ActivationSpectrum(num_classes=4, reduction="channel", classwise_center=classwise_center, center="both")
    metric.update(maps[:7], labels[:7])
    metric.update(maps[7:], labels[7:])
    result = metric.compute()
    rows = maps.permute(0, 2, 3, 1).reshape(-1, channels).double()
    row_labels = labels.repeat_interleave(shape[1] * shape[2])
    assert result.num_samples == rows.shape[0] and result.num_features == channels
    np.testing.assert_allclose(result.uncentered.spectrum.singular_values.numpy(), _np_sv(rows), rtol=1e-10)
    np.testing.assert_allclose(result.centered.spectrum.singular_values.numpy(), _np_sv(rows, True), rtol=1e-9)
    assert float(result.total_cluster_variation) == pytest.approx(
        float(F.total_cluster_variation(rows, row_labels)), rel=1e-10
    )
    for c in range(3):
        s = _np_sv(rows[row_labels == c], center=classwise_center)
        assert float(result.classwise_variance_ratio[c]) == pytest.approx(s[0] ** 2 / (s**2).sum(), rel=1e-10)
    assert math.isnan(float(result.classwise_variance_ratio[3]))  # no sample of class 3

    unlabelled = ActivationSpectrum(reduction="channel")
    unlabelled.update(maps)
    np.testing.assert_allclose(
        unlabelled.compute().uncentered.spectrum.singular_values.numpy(), _np_sv(rows), rtol=1e-10
    )

    poisoned = maps.clone()
    poisoned[3, 0, 0, 0] = math.nan
    broken = ActivationSpectrum(num_classes=4, reduction="channel")
    broken.update(poisoned, labels)
    with pytest.warns(RuntimeWarning, match="NaN or Inf"):
        assert math.isnan(float(broken.compute().uncentered.numerical_rank))


def _callback_values(result: ActivationSpectrumResult, metrics: tuple, centered: bool, per_class: bool) -> dict:
    """The scalars the activation monitor logged before the result named its own keys (prefix parsing included)."""
    summary = result.centered if centered else result.uncentered
    families = tuple(m for m in ACTIVATION_METRICS if m in SPECTRAL_METRICS)
    scalars = summary.as_dict(families) if summary is not None else {}
    values = {}
    for name in metrics:
        if name == "variance_ratio":
            values.update({k: v for k, v in scalars.items() if k.startswith("variance_ratio_")})
        elif name == "tcv" and result.total_cluster_variation is not None:
            values["tcv"] = float(result.total_cluster_variation)
        elif name == "tcv_normalized" and result.total_cluster_variation_normalized is not None:
            values["tcv_normalized"] = float(result.total_cluster_variation_normalized)
        elif name == "classwise_variance_ratio" and result.classwise_variance_ratio is not None:
            ratios = result.classwise_variance_ratio
            key = f"classwise_variance_ratio_{result.classwise_k}"
            present = ratios[~ratios.isnan()]
            values[f"{key}_mean"] = float(present.mean()) if present.numel() else math.nan
            if per_class:
                values.update({f"{key}_class_{c}": float(v) for c, v in enumerate(ratios)})
        elif name in scalars:
            values[name] = scalars[name]
    if summary is not None and any(name in SPECTRAL_METRICS for name in metrics):
        values["spectrum_rows"] = float(result.spectrum_rows)
    return values


def test_scalars_key_names_and_values() -> None:
    x, y = clustered_data(n=200, d=12)
    y = y.clamp_max(2)  # class 3 never appears: its ratio is NaN and the mean skips it
    metric = ActivationSpectrum(num_classes=4, center="both", variance_ratio_ks=(1, 3), classwise_k=2)
    metric.update(x, y)
    result = metric.compute()
    scalars = result.scalars()
    assert list(scalars) == [
        "numerical_rank",
        "soft_rank",
        "participation_ratio",
        "stable_rank",
        "effective_rank",
        "variance_ratio_1",
        "variance_ratio_3",
        "tcv",
        "tcv_normalized",
        "classwise_variance_ratio_2_mean",
        "spectrum_rows",
    ]
    assert scalars["spectrum_rows"] == 200.0
    assert all(isinstance(v, float) for v in scalars.values())
    assert scalars["variance_ratio_3"] == float(result.uncentered.variance_ratio[3])
    assert scalars["tcv_normalized"] == float(result.total_cluster_variation_normalized)
    per_class = F.classwise_variance_ratio(x, y, k=2, num_classes=4).numpy()
    assert math.isnan(per_class[3])
    assert scalars["classwise_variance_ratio_2_mean"] == pytest.approx(per_class[:3].mean(), rel=1e-10)
    centred = result.scalars(("stable_rank", "classwise_variance_ratio", "tcv"), centered=True, per_class=True)
    assert list(centred) == ["stable_rank", "classwise_variance_ratio_2_mean"] + [
        f"classwise_variance_ratio_2_class_{c}" for c in range(4)
    ] + ["tcv", "spectrum_rows"]
    assert centred["stable_rank"] == float(result.centered.stable_rank) != scalars["stable_rank"]
    assert math.isnan(centred["classwise_variance_ratio_2_class_3"])
    assert result.scalars("soft_rank") == {"soft_rank": float(result.uncentered.soft_rank), "spectrum_rows": 200.0}
    assert "spectrum_rows" not in result.scalars(("tcv", "classwise_variance_ratio"))


@pytest.mark.parametrize("centered", [False, True])
@pytest.mark.parametrize("per_class", [False, True])
def test_scalars_give_what_the_activation_monitor_logged(centered: bool, per_class: bool) -> None:
    x, y = clustered_data(n=150, d=10)
    configs = (
        {"num_classes": 4, "center": "both"},
        {"num_classes": 4, "center": centered},
        {"num_classes": 4, "center": not centered},  # the spectrum asked for is missing: no spectral keys
        {"center": "both"},
        {"num_classes": 4, "max_gram_features": 8, "max_samples": 64, "center": "both"},
        {"num_classes": 4, "classwise": False, "center": "both"},
    )
    orders = (ACTIVATION_METRICS, ACTIVATION_METRICS[::-1], ("tcv", "variance_ratio", "classwise_variance_ratio"))
    for kwargs in configs:
        metric = ActivationSpectrum(**kwargs)
        metric.update(x, y)
        result = metric.compute()
        for metrics in orders:
            expected = _callback_values(result, metrics, centered, per_class)
            actual = result.scalars(metrics, centered=centered, per_class=per_class)
            assert list(actual) == list(expected), (kwargs, metrics)
            np.testing.assert_array_equal(list(actual.values()), list(expected.values()))


def test_scalars_by_default_come_from_the_spectrum_the_metric_computed() -> None:
    # A metric made with center=True has no uncentred spectrum: scalars() gave no spectral key at all.
    x, y = clustered_data(n=120, d=12, seed=2)
    metric = ActivationSpectrum(num_classes=4, center=True)
    metric.update(x, y)
    result = metric.compute()
    assert result.uncentered is None
    centred = result.scalars(centered=True)
    assert result.scalars() == centred and "numerical_rank" in centred
    reference = torch.linalg.svdvals(x.double() - x.double().mean(0))
    assert centred["numerical_rank"] == float((reference > reference[0] * 12 * torch.finfo(torch.float32).eps).sum())
    assert "numerical_rank" not in result.scalars(centered=False)  # asked for explicitly: not computed
    both = ActivationSpectrum(num_classes=4, center="both")
    both.update(x, y)
    assert both.compute().scalars() == both.compute().scalars(centered=False)


def test_scalars_of_an_empty_result_and_unknown_metrics() -> None:
    empty = ActivationSpectrum(num_classes=3)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The ``compute`` method", category=UserWarning)
        with pytest.warns(RuntimeWarning, match="no activations were streamed"):
            result = empty.compute()
    scalars = result.scalars(per_class=True)
    assert "classwise_variance_ratio_1_mean" in scalars and "classwise_variance_ratio_1_class_2" in scalars
    assert scalars.pop("spectrum_rows") == 0.0
    assert all(math.isnan(v) for v in scalars.values())
    with pytest.raises(ValueError, match=r"unknown metrics \['rank'\]; valid choices are: numerical_rank, soft_rank"):
        result.scalars(("numerical_rank", "rank"))
    with pytest.raises(ValueError, match=r"metrics names \['tcv'\] more than once"):
        result.scalars(("tcv", "tcv"))


def test_as_dict_is_every_scalar_of_both_spectra() -> None:
    x, y = clustered_data(n=100, d=8)
    metric = ActivationSpectrum(num_classes=4, center="both", variance_ratio_ks=(2,))
    metric.update(x, y)
    result = metric.compute()
    spectral = tuple(m for m in ACTIVATION_METRICS if m in SPECTRAL_METRICS)
    expected = dict(result.scalars(spectral))
    rows = expected.pop("spectrum_rows")
    expected.update({f"centered_{k}": v for k, v in result.scalars(spectral, centered=True).items()})
    expected["spectrum_rows"] = expected.pop("centered_spectrum_rows")
    assert expected["spectrum_rows"] == rows == 100.0
    expected.update(result.scalars(tuple(m for m in ACTIVATION_METRICS if m not in spectral), per_class=True))
    assert result.as_dict() == expected
    assert "centered_variance_ratio_2" in expected and "classwise_variance_ratio_1_class_3" in expected
    assert (
        "ACTIVATION_METRICS" in rank_lightning.metrics.__all__ and "SpectralSummary" in rank_lightning.metrics.__all__
    )
    assert rank_lightning.metrics.SpectralSummary is SpectralSummary


def _offset_data(offset: float, n: int = 600, d: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Three classes with a spread of 0.1 around ``offset``: tiny variation far from the origin."""
    g = torch.Generator().manual_seed(11)
    labels = torch.randint(0, 3, (n,), generator=g)
    centres = 0.3 * torch.randn(3, d, generator=g, dtype=torch.float64)
    x = centres[labels] + 0.1 * torch.randn(n, d, generator=g, dtype=torch.float64)
    return offset + x, labels


@pytest.mark.parametrize("offset", [1e6, 1e8])
def test_offset_activations_keep_tcv_and_centred_spectrum_exact(offset: float) -> None:
    # The plain moments gave a relative TCV error of 2.5e-3 at 1e6 and a TCV 130x too large at 1e8.
    x, y = _offset_data(offset)
    metric = ActivationSpectrum(num_classes=3, center="both", classwise_center=True)
    _stream(metric, x, y, [100] * 6)
    result = metric.compute()
    centred = x - x.mean(0)
    tcv = F.total_cluster_variation(x, y, num_classes=3)
    assert float(result.total_cluster_variation) == pytest.approx(float(tcv), rel=1e-9)
    expected_normalized = float(tcv) / float(centred.square().sum())
    assert float(result.total_cluster_variation_normalized) == pytest.approx(expected_normalized, rel=1e-9)
    np.testing.assert_allclose(result.centered.spectrum.singular_values.numpy(), _np_sv(centred), rtol=1e-9)
    expected_vr = F.classwise_variance_ratio(x, y, num_classes=3, center=True).numpy()
    np.testing.assert_allclose(result.classwise_variance_ratio.numpy(), expected_vr, rtol=1e-9)
    # The uncentred spectrum is dominated by the offset; its leading value is still exact.
    assert float(result.uncentered.spectral_norm) == pytest.approx(float(_np_sv(x)[0]), rel=1e-12)


@pytest.mark.parametrize("fallback", ["sample_gram", "sketch"])
def test_offset_activations_on_the_fallback_paths(fallback: str) -> None:
    x, y = _offset_data(1e6, n=200)
    metric = ActivationSpectrum(num_classes=3, center="both", max_gram_features=4, max_samples=256, fallback=fallback)
    _stream(metric, x, y, [50] * 4)
    result = metric.compute()
    assert float(result.total_cluster_variation) == pytest.approx(float(F.total_cluster_variation(x, y)), rel=1e-9)
    if fallback == "sample_gram":  # every row fits: exact
        np.testing.assert_allclose(result.centered.spectrum.singular_values.numpy(), _np_sv(x, True), rtol=1e-8)
    else:  # the sketch of the shifted rows keeps the centred spread (exactly here: 200 rows, 256 buckets)
        sketch = metric.sketch - torch.outer(metric.sketch_signs, metric.feature_sum / 200)
        np.testing.assert_allclose(result.centered.spectrum.singular_values.numpy()[:8], _np_sv(sketch)[:8], rtol=1e-9)
        assert float(result.centered.spectral_norm) == pytest.approx(float(_np_sv(x, True)[0]), rel=0.5)


def test_offset_conv_maps_on_the_channel_route() -> None:
    g = torch.Generator().manual_seed(12)
    labels = torch.randint(0, 4, (24,), generator=g)
    maps = 1e4 + 0.05 * torch.randn(24, 6, 5, 5, generator=g, dtype=torch.float64) + 0.01 * labels.view(-1, 1, 1, 1)
    metric = ActivationSpectrum(num_classes=4, reduction="channel", center="both", classwise_center=True)
    metric.update(maps[:10], labels[:10])
    metric.update(maps[10:], labels[10:])
    result = metric.compute()
    rows = F.reduce_activations(maps, "channel", dtype=torch.float64)
    row_labels = labels.repeat_interleave(25)
    assert float(result.total_cluster_variation) == pytest.approx(
        float(F.total_cluster_variation(rows, row_labels, num_classes=4)), rel=1e-9
    )
    np.testing.assert_allclose(result.centered.spectrum.singular_values.numpy(), _np_sv(rows, True), rtol=1e-9)
    expected_vr = F.classwise_variance_ratio(rows, row_labels, num_classes=4, center=True).numpy()
    np.testing.assert_allclose(result.classwise_variance_ratio.numpy(), expected_vr, rtol=1e-9)
    # The uncentred spectrum: s_1 ~ 6e5 and the rest ~1, which any Gram resolves to about 1e-16 * s_1^2 / s_i.
    plain = _np_sv(rows)
    found = result.uncentered.spectrum.singular_values.numpy()
    np.testing.assert_allclose(found, plain, rtol=1e-12, atol=1e-9 * plain[0])


def test_rows_behind_the_spectrum_and_the_rank_cap() -> None:
    g = torch.Generator().manual_seed(13)
    x = torch.randn(100, 32, generator=g, dtype=torch.float64)
    few = ActivationSpectrum()
    few.update(x[:5])
    result = few.compute()
    assert (result.path, result.spectrum_rows, result.rank_cap) == ("gram", 5, 5)
    assert int(result.uncentered.numerical_rank) == 5 and result.scalars("numerical_rank")["spectrum_rows"] == 5.0

    sampled = ActivationSpectrum(max_gram_features=8, max_samples=20)
    sampled.update(x)
    result = sampled.compute()
    assert (result.path, result.num_samples, result.spectrum_rows, result.rank_cap) == ("sample_gram", 100, 20, 20)
    assert int(result.uncentered.numerical_rank) == 20  # capped by the subsample, not by the 32 features
    assert result.scalars(("effective_rank",)) == {
        "effective_rank": float(result.uncentered.effective_rank),
        "spectrum_rows": 20.0,
    }

    sketched = ActivationSpectrum(max_gram_features=8, max_samples=16, fallback="sketch")
    sketched.update(x[:12])
    result = sketched.compute()
    occupied = int((sketched.sketch.abs().sum(dim=1) > 0).sum())
    assert result.num_spectrum_samples == 12 and result.spectrum_rows == result.rank_cap == occupied
    assert occupied < 12  # 12 rows into 16 buckets collide (this seed): the sketch's rank is its occupied buckets
    assert int(result.uncentered.numerical_rank) == occupied


def test_mean_of_half_precision_maps_on_the_fallback_is_taken_in_float64() -> None:
    g = torch.Generator().manual_seed(14)
    for dtype in (torch.bfloat16, torch.float16):
        maps = (torch.randn(64, 12, 6, 6, generator=g) + 3.0).to(dtype)
        metric = ActivationSpectrum(reduction="mean", max_gram_features=8, max_samples=64)
        metric.update(maps)
        result = metric.compute()
        assert result.path == "sample_gram"
        expected = _np_sv(maps.double().mean(dim=(2, 3)))
        found = result.uncentered.spectrum.singular_values.numpy()
        assert np.abs(found - expected).max() / expected[0] < 1e-12, dtype


def _low_rank_bf16(n: int = 300, d: int = 16, rank: int = 4) -> torch.Tensor:
    """A rank-4 matrix with equal singular values, rounded to bf16: the rounding adds noise at about 1e-3 of s_1."""
    g = torch.Generator().manual_seed(15)
    u = torch.linalg.qr(torch.randn(n, rank, generator=g, dtype=torch.float64))[0]
    v = torch.linalg.qr(torch.randn(d, rank, generator=g, dtype=torch.float64))[0]
    return (30.0 * u @ v.T).to(torch.bfloat16)


def test_input_tolerance_does_not_count_bf16_rounding_as_rank() -> None:
    x = _low_rank_bf16()
    ranks = {}
    for tolerance_dtype in (None, "input", torch.bfloat16, "bfloat16"):
        metric = ActivationSpectrum(tolerance_dtype=tolerance_dtype)
        _stream(metric, x, None, [100, 200])
        ranks[str(tolerance_dtype)] = int(metric.compute().uncentered.numerical_rank)
    assert ranks["None"] == 16  # float32 eps * K: the bf16 rounding noise counts as rank
    assert ranks["input"] == ranks["torch.bfloat16"] == ranks["bfloat16"] == 4
    # The lowest precision seen since the reset rules; float32 input alone gives the float32 default.
    mixed = ActivationSpectrum(tolerance_dtype="input")
    mixed.update(x[:100].float())
    assert float(mixed.input_eps) == torch.finfo(torch.float32).eps
    assert int(mixed.compute().uncentered.numerical_rank) == 16  # float32 input: the float32 tolerance
    mixed.update(x[100:])
    assert float(mixed.input_eps) == torch.finfo(torch.bfloat16).eps
    assert int(mixed.compute().uncentered.numerical_rank) == 4
    mixed.reset()
    assert float(mixed.input_eps) == 0.0


@pytest.mark.parametrize("width", [64, 256, 384, 1024])
def test_a_bf16_tolerance_counts_the_rank_of_wide_layers(width: int) -> None:
    # eps_bf16 * K is 0.5 at K = 64 and reaches 1 at K = 128, where no singular value would count: the coarse dtypes'
    # tolerance is their eps alone. A rank-40 matrix with singular values from 1 down to 0.02 (above eps_bf16 = 2^-7)
    # rounded to bf16 has rank 40; its rounding noise stays below 0.14 eps_bf16 s_1.
    g = torch.Generator().manual_seed(width)
    n, rank = 2 * width, 40
    u = torch.linalg.qr(torch.randn(n, rank, generator=g, dtype=torch.float64))[0]
    v = torch.linalg.qr(torch.randn(width, rank, generator=g, dtype=torch.float64))[0]
    x = ((u * torch.logspace(0, math.log10(0.02), rank, dtype=torch.float64)) @ v.T * 50.0).to(torch.bfloat16)
    for tolerance_dtype in ("input", torch.bfloat16):
        metric = ActivationSpectrum(tolerance_dtype=tolerance_dtype)
        metric.update(x)
        result = metric.compute().uncentered
        assert int(result.numerical_rank) == rank, tolerance_dtype
        assert metric._rank_tolerance(result.spectrum) == torch.finfo(torch.bfloat16).eps
    float32 = ActivationSpectrum()
    float32.update(x)
    assert int(float32.compute().uncentered.numerical_rank) > rank  # bf16 rounding noise counted as rank


def test_default_rank_tolerance_of_each_dtype() -> None:
    f32, bf16, f16, f64 = (torch.finfo(t).eps for t in (torch.float32, torch.bfloat16, torch.float16, torch.float64))
    assert default_rank_tolerance(500, 300) == f32 * 300
    assert default_rank_tolerance(500, 300, dtype_eps=f32) == f32 * 300
    assert default_rank_tolerance(500, 300, tolerance_size="max", dtype_eps=f64) == f64 * 500
    assert default_rank_tolerance(500, 300, dtype_eps=bf16) == bf16
    assert default_rank_tolerance(500, 300, dtype_eps=f16) == f16
    # Past 8192 singular values float32's rule exceeds float16's eps and is kept.
    assert default_rank_tolerance(20_000, 10_000, dtype_eps=f16) == f32 * 10_000


def test_tolerance_dtype_and_gram_precision_are_validated() -> None:
    with pytest.raises(ValueError, match=r"unknown tolerance_dtype 'int8'; valid choices are: None, a floating"):
        ActivationSpectrum(tolerance_dtype="int8")
    with pytest.raises(ValueError, match=r"unknown tolerance_dtype torch.int64"):
        ActivationSpectrum(tolerance_dtype=torch.int64)
    with pytest.raises(ValueError, match="exclude each other"):
        ActivationSpectrum(tolerance_dtype="input", rank_tolerance=1e-3)
    with pytest.raises(ValueError, match=r"unknown gram_precision 'fp32'; valid choices are: float64, float32, tf32"):
        ActivationSpectrum(gram_precision="fp32")


@pytest.mark.parametrize("reduction", ["flatten", "channel"])
def test_float32_gram_precision_stays_within_its_documented_tolerance(reduction: str) -> None:
    g = torch.Generator().manual_seed(16)
    maps = torch.randn(60, 10, 4, 4, generator=g) + 1.5
    labels = torch.randint(0, 3, (60,), generator=g)
    results, metrics = {}, {}
    for precision in ("float64", "float32", "tf32", "auto"):
        metric = ActivationSpectrum(num_classes=3, reduction=reduction, center="both", gram_precision=precision)
        _stream(metric, maps, labels, [25, 35])
        metrics[precision], results[precision] = metric, metric.compute()
        assert all(getattr(metric, name).dtype == torch.float64 for name in ("gram", "class_grams", "feature_sum"))
    exact = symmetrize_lower(metrics["float64"].class_grams)
    error = float((symmetrize_lower(metrics["float32"].class_grams) - exact).abs().max() / exact.abs().max())
    assert 1e-10 < error < 1e-6  # float32 rounding of each batch's product, about 1e-7
    approx, exact_values = results["float32"].as_dict(), results["float64"].as_dict()
    ranks = {key: (approx.pop(key), exact_values.pop(key)) for key in ("numerical_rank", "centered_numerical_rank")}
    # alpha-ReQ is fitted over the eigenvalues above the rank tolerance: it moves with the numerical rank (below).
    fits = {key: (approx.pop(key), exact_values.pop(key)) for key in ("alpha_req", "centered_alpha_req")}
    # The effective rank weighs s, not s^2: the noise floor of a float32 product (below) moves it by up to 1e-4.
    for key in ("effective_rank", "centered_effective_rank"):
        assert approx.pop(key) == pytest.approx(exact_values.pop(key), rel=1e-4)
    _assert_scalars_close(approx, exact_values, rtol=1e-5)
    if reduction == "channel":  # 960 rows of 10 features, well conditioned: the same ranks
        assert all(a == b == 10 for a, b in ranks.values())
        assert all(a == pytest.approx(b, rel=1e-5) for a, b in fits.values())
    else:
        # 60 rows of 160 features: the centred matrix has rank 59. A float32 product leaves rounding noise of about
        # sqrt(eps_32) s_1 = 3e-4 s_1 in place of the zero singular value, above the default tolerance: documented.
        assert ranks["centered_numerical_rank"] == (60.0, 59.0)
        assert ranks["numerical_rank"] == (60.0, 60.0)
        assert fits["alpha_req"][0] == pytest.approx(fits["alpha_req"][1], rel=1e-5)
    assert results["tf32"].as_dict() == results["float32"].as_dict()  # no TF32 on a CPU
    assert results["auto"].as_dict() == results["float64"].as_dict()  # "auto" is float64 on a CPU


@pytest.mark.parametrize("reduction", ["token", "mean"])
@pytest.mark.parametrize("classwise", [True, False])
def test_masked_tokens_are_left_out_and_labels_follow_the_kept_rows(reduction: str, classwise: bool) -> None:
    g = torch.Generator().manual_seed(17)
    tokens = torch.randn(12, 5, 6, generator=g, dtype=torch.float64)
    lengths = torch.tensor([5, 3, 1, 4, 5, 2, 0, 3, 5, 1, 2, 4])
    mask = torch.arange(5).unsqueeze(0) < lengths.unsqueeze(1)
    labels = torch.arange(12) % 3
    tokens[~mask] = 1e3  # padding that must never reach the sums
    metric = ActivationSpectrum(num_classes=3, reduction=reduction, center="both", classwise=classwise)
    metric.update(tokens[:7], labels[:7], mask=mask[:7])
    metric.update(tokens[7:], labels[7:], mask=mask[7:].long())
    result = metric.compute()
    if reduction == "token":
        rows, row_labels = tokens[mask], labels.repeat_interleave(lengths)
    else:
        kept = lengths > 0
        rows = tokens[kept].masked_fill(~mask[kept].unsqueeze(2), 0).sum(1) / lengths[kept].unsqueeze(1)
        row_labels = labels[kept]
    assert result.num_samples == rows.shape[0]
    np.testing.assert_allclose(result.centered.spectrum.singular_values.numpy(), _np_sv(rows, True), rtol=1e-9)
    tcv = F.total_cluster_variation(rows, row_labels, num_classes=3)
    assert float(result.total_cluster_variation) == pytest.approx(float(tcv), rel=1e-9)
    if classwise:
        expected = F.classwise_variance_ratio(rows, row_labels, num_classes=3).numpy()
        np.testing.assert_allclose(result.classwise_variance_ratio.numpy(), expected, rtol=1e-9)


def test_planned_bytes_match_the_allocated_states() -> None:
    def allocated(metric: ActivationSpectrum) -> int:
        tensors = [getattr(metric, name) for name in metric._defaults]
        return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))

    x, y = clustered_data(n=50, d=12)
    for kwargs in ({"num_classes": 4}, {}, {"num_classes": 4, "max_gram_features": 8, "fallback": "sketch"}):
        metric = ActivationSpectrum(**kwargs, max_samples=32)
        planned = metric.planned_bytes(12)
        metric.update(x, y)
        assert planned == allocated(metric), kwargs
    sampled = ActivationSpectrum(num_classes=4, max_gram_features=8, max_samples=32)
    # The subsample (float64 rows, keys, labels) and its sample Gram come on top of the shaped states.
    assert sampled.planned_bytes(12) == (12 + 4 + 48 + 12 + 4 + 32 * 14 + 32 * 32) * 8
    big = ActivationSpectrum(num_classes=10)
    assert big.planned_bytes(4096) == big.planned_bytes(4096)  # nothing allocated: d stays unknown
    assert big.path is None
    assert big.planned_bytes(1024) == (1024 + 1024**2 + 10 + 10 * 1024 + 10 * 1024**2 + 1024 + 4) * 8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_channel_reference_is_the_first_batchs_channel_mean(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(21)
    maps = (torch.randn(12, 5, 6, 6, generator=g, dtype=torch.float64) + 100.0).to(dtype)
    metric = ActivationSpectrum(reduction="channel")
    metric.update(maps)
    metric.update(maps + 7.0)  # later batches leave the reference alone
    exact = maps.to(torch.float64).mean(dim=(0, 2, 3))
    assert metric.reference.dtype == torch.float64
    torch.testing.assert_close(metric.reference, exact, rtol=1e-6, atol=0)  # to float32's rounding
    assert torch.equal(metric.reference, metric.reference.float().double())


def test_class_metrics_are_not_reported_without_a_labelled_row() -> None:
    x, _ = clustered_data(n=60, d=8)
    metric = ActivationSpectrum(num_classes=4)
    metric.update(x)  # rows without labels, as from a loader whose labels are not class labels
    result = metric.compute()
    assert result.classwise_variance_ratio is None and result.classwise_source is None
    assert result.total_cluster_variation is None
    scalars = result.scalars(ACTIVATION_METRICS)
    assert not any(key.startswith(("classwise", "tcv")) for key in scalars) and "numerical_rank" in scalars


@pytest.mark.parametrize(
    ("shape", "reduction", "match"),
    [
        ((6,), "flatten", r"activations of shape \(6,\) are not supported"),
        ((2, 3, 4, 5, 6), "token", r"conv activations of shape \(2, 3, 4, 5, 6\); valid choices"),
        ((5, 3, 4, 4), "cls", r"conv activations of shape \(5, 3, 4, 4\); valid choices"),
        ((5, 3, 4), "channel", r"token activations of shape \(5, 3, 4\); valid choices"),
    ],
)
def test_a_batch_of_the_wrong_shape_is_named_by_its_own_shape(shape: tuple, reduction: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ActivationSpectrum(reduction=reduction).update(torch.randn(shape))


def test_boolean_activations_count_as_zeros_and_ones_and_complex_ones_are_refused() -> None:
    g = torch.Generator().manual_seed(4)
    x = torch.randn(30, 5, generator=g) > 0
    metric = ActivationSpectrum(center="both")
    metric.update(x[:12])
    metric.update(x[12:])
    result = metric.compute()
    for center in (False, True):
        summary = result.centered if center else result.uncentered
        expected = F.summarize(F.spectrum(x.double(), center=center), variance_ratio_ks=(1, 10, 20))
        _assert_scalars_close(summary.as_dict(), expected.as_dict(), rtol=1e-12)
    with pytest.raises(ValueError, match=r"activations must be real, got torch\.complex64"):
        ActivationSpectrum().update(torch.randn(4, 3, dtype=torch.complex64))


def _saved_and_loaded(metric: ActivationSpectrum) -> dict:
    buffer = io.BytesIO()
    torch.save(metric.state_dict(), buffer)
    buffer.seek(0)
    return torch.load(buffer)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_classes": 4, "center": "both"},
        {"num_classes": 4, "center": "both", "max_gram_features": 16, "max_samples": 50},
        {"center": "both", "max_gram_features": 16, "max_samples": 40, "fallback": "sketch"},
    ],
    ids=["gram", "sample_gram", "sketch"],
)
def test_state_saved_mid_stream_and_restored_continues_to_the_same_result(kwargs: dict) -> None:
    x, y = clustered_data(n=200, d=24, seed=2)
    whole = ActivationSpectrum(**kwargs)
    whole.persistent(True)
    _stream(whole, x[:120], y[:120], [40, 40, 40])
    restored = ActivationSpectrum(**kwargs)
    restored.load_state_dict(_saved_and_loaded(whole))
    # Right after loading, compute() knows the width and the path, as the saved metric does.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _assert_scalars_close(restored.compute().as_dict(), whole.compute().as_dict(), rtol=1e-12)
    _stream(whole, x[120:], y[120:], [40, 40])
    _stream(restored, x[120:], y[120:], [40, 40])
    expected, result = whole.compute(), restored.compute()
    assert (result.path, result.num_features, result.num_samples) == (expected.path, 24, 200)
    _assert_scalars_close(result.as_dict(), expected.as_dict(), rtol=1e-12)
    if result.path == "gram":
        np.testing.assert_allclose(result.centered.spectrum.singular_values, _np_sv(x, center=True), rtol=1e-9)


def test_a_restored_subsample_without_a_generator_state_draws_new_keys() -> None:
    # A state dict without the generator (saved before it was stored): the rows after the restore must not get the
    # keys of the first rows again, or each would pair with one of them in the subsample.
    x, _ = clustered_data(n=80, d=24, seed=3)
    first = ActivationSpectrum(max_gram_features=16, max_samples=100)
    first.persistent(True)
    first.update(x[:40])
    state = {k: v for k, v in _saved_and_loaded(first).items() if k != "_generator_state"}
    restored = ActivationSpectrum(max_gram_features=16, max_samples=100)
    restored.load_state_dict(state)
    restored.update(x[40:])
    keys = torch.cat(restored.sample_keys)
    assert keys.numel() == 80 and torch.unique(keys).numel() == 80


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_set_dtype_keeps_the_float64_sums(dtype: torch.dtype) -> None:
    # torchmetrics' set_dtype converts every floating state: a float16 Gram of these rows overflows.
    x, y = clustered_data(n=200, d=24, seed=8)
    x = 30 * x + 100
    metric = ActivationSpectrum(num_classes=4, center="both")
    _stream(metric, x[:80], y[:80], [40, 40])
    metric.set_dtype(dtype)
    _stream(metric, x[80:], y[80:], [40, 40, 40])
    assert metric.gram.dtype == metric.class_grams.dtype == metric.feature_sum.dtype == torch.float64
    result = metric.compute()
    one_shot = ActivationSpectrum(num_classes=4, center="both")
    one_shot.update(x, y)
    _assert_scalars_close(result.as_dict(), one_shot.compute().as_dict(), rtol=1e-12)
    np.testing.assert_allclose(result.uncentered.spectrum.singular_values, _np_sv(x), rtol=1e-9)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_a_move_to_another_dtype_keeps_the_float64_sums(dtype: torch.dtype) -> None:
    # metric.to(dtype) (or model.to(dtype) with the metric inside) bypassed set_dtype and rounded every float64 state,
    # the defaults too: a metric moved before its first batch lost its sum of squares (the TCV) to float16.
    x, y = clustered_data(n=200, d=24, seed=8)
    x = 30 * x + 100
    one_shot = ActivationSpectrum(num_classes=4, center="both")
    one_shot.update(x, y)
    expected = one_shot.compute().as_dict()
    moved_midway = ActivationSpectrum(num_classes=4, center="both")
    _stream(moved_midway, x[:80], y[:80], [40, 40])
    moved_midway = moved_midway.to(dtype)
    _stream(moved_midway, x[80:], y[80:], [40, 40, 40])
    moved_first = torch.nn.Sequential(ActivationSpectrum(num_classes=4, center="both")).to(dtype=dtype)[0]
    _stream(moved_first, x, y, [40] * 5)
    for metric in (moved_midway, moved_first):
        assert metric.gram.dtype == metric.sum_squares.dtype == metric.reference.dtype == torch.float64
        _assert_scalars_close(metric.compute().as_dict(), expected, rtol=1e-12)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_classes": 4, "center": "both"},
        {"num_classes": 4, "max_gram_features": 16, "max_samples": 50},
        {"max_gram_features": 16, "max_samples": 40, "fallback": "sketch"},
    ],
    ids=["gram", "sample_gram", "sketch"],
)
def test_batches_under_inference_mode_and_outside_it_add_up(kwargs: dict) -> None:
    # States first allocated under inference mode (Lightning's validation) were inference tensors: the next batch
    # outside it failed with 'Inplace update to inference tensor outside InferenceMode'.
    x, y = clustered_data(n=160, d=24, seed=4)
    metric, plain = ActivationSpectrum(**kwargs), ActivationSpectrum(**kwargs)
    with torch.inference_mode():
        _stream(metric, x[:80], y[:80], [40, 40])
    _stream(metric, x[80:], y[80:], [40, 40])
    _stream(plain, x, y, [40, 40, 40, 40])
    _assert_scalars_close(metric.compute().as_dict(), plain.compute().as_dict(), rtol=1e-12)
    metric.reset()
    with torch.inference_mode():
        _stream(metric, x, y, [80, 80])
        result = metric.compute()
    assert result.num_samples == 160
    if result.path == "gram":
        _assert_scalars_close(result.as_dict(), plain.compute().as_dict(), rtol=1e-12)
    # A reset under inference mode (a validation epoch's end) makes inference tensors of the default states too.
    with torch.inference_mode():
        metric.reset()
    _stream(metric, x, y, [80, 80])
    assert metric.compute().num_samples == 160


def test_metrics_sharing_a_compute_group_all_compute_after_a_reset() -> None:
    # A MetricCollection compute group updates only its first member and hands the states to the others, which never
    # learnt the width from a batch after a reset: compute() failed with 'No samples to concatenate'.
    x, y = clustered_data(n=120, d=24, seed=6)
    collection = MetricCollection(
        {"plain": ActivationSpectrum(num_classes=4), "centred": ActivationSpectrum(num_classes=4, center=True)}
    )
    _stream(collection, x, y, [40, 40, 40])
    assert sorted(collection.compute_groups[0]) == ["centred", "plain"]
    collection.compute()
    collection.reset()
    # The next epoch's layer may even have another width.
    wider = torch.cat([x, torch.randn(120, 4, generator=torch.Generator().manual_seed(1), dtype=x.dtype)], dim=1)
    _stream(collection, wider, y, [40, 40, 40])
    results = collection.compute()
    for name, center in (("plain", False), ("centred", True)):
        expected = F.summarize(F.spectrum(wider, center=center), variance_ratio_ks=(1, 10, 20))
        summary = results[name].centered if center else results[name].uncentered
        assert results[name].num_features == 28
        _assert_scalars_close(summary.as_dict(), expected.as_dict(), rtol=1e-9)
    assert float(results["centred"].total_cluster_variation) == pytest.approx(
        float(F.total_cluster_variation(wider, y)), rel=1e-12
    )


def test_a_batch_of_another_width_names_where_the_width_came_from() -> None:
    with pytest.raises(ValueError, match=r"reduce to 6 features .*, but the metric was made with num_features=5"):
        ActivationSpectrum(num_features=5).update(torch.randn(3, 6))
    metric = ActivationSpectrum()
    metric.update(torch.randn(3, 5))
    with pytest.raises(ValueError, match="reduce to 6 features with reduction='flatten', but earlier batches had 5"):
        metric.update(torch.randn(3, 6))


def test_a_state_saved_with_other_settings_is_refused_and_the_metric_left_as_it_was() -> None:
    # Loaded into a metric without class Grams, the labelled rows (kept in the class Grams) were out of its Gram:
    # participation ratio 1.0 where the rows give 10.7, without a word; other paths failed deep in compute().
    x, y = clustered_data(n=120, d=12)
    saved = ActivationSpectrum(num_classes=4)
    saved.persistent(True)
    _stream(saved, x, y, [60, 60])
    state = saved.state_dict()
    kinds = {
        "this one would keep the exact Gram of 12 features": {"classwise": False},
        "this one would keep a subsample of 50 rows of 12 features": {"max_gram_features": 8, "max_samples": 50},
        "holds rows of 12 features, this one was made with num_features=10": {"num_features": 10},
    }
    for match, options in kinds.items():
        metric = ActivationSpectrum(num_classes=4, **options)
        metric.persistent(True)
        metric.update(x[:30, : options.get("num_features", 12)], y[:30])
        with pytest.raises(RuntimeError, match=match):
            metric.load_state_dict(dict(state))
        assert int(metric.num_samples) == 30
    small = ActivationSpectrum(max_gram_features=8, max_samples=20)
    small.persistent(True)
    small.update(x)
    with pytest.raises(RuntimeError, match=r"keeps a subsample of 20 rows .* would keep a subsample of 50 rows"):
        ActivationSpectrum(max_gram_features=8, max_samples=50).load_state_dict(small.state_dict())
    restored = ActivationSpectrum(num_classes=4)
    restored.load_state_dict(dict(state))
    s = _np_sv(x)
    assert restored.compute().uncentered.participation_ratio == pytest.approx((s**2).sum() ** 2 / (s**4).sum(), 1e-10)


def test_soft_rank_leaves_out_the_gram_rounding_of_far_activations() -> None:
    # Rows 1e8 from the origin: the uncentred Gram's rounding noise, s^2 / N ~ 1e2, passed tau = 0.5 (soft rank 7).
    g = torch.Generator().manual_seed(21)
    x = 1e8 + 1e-2 * torch.randn(600, 16, generator=g, dtype=torch.float64)
    metric = ActivationSpectrum()
    _stream(metric, x, None, [100] * 6)
    result = metric.compute()
    assert int(result.uncentered.soft_rank) == int((_np_sv(x) ** 2 / 600 >= 0.5).sum()) == 1
    assert int(F.soft_rank(x - 1e8, tau=1e-6)) == 16  # values above the resolution still count


def test_activations_below_the_float64_range_of_products_give_nan_with_a_warning() -> None:
    # Entries of 1e-170 square to 0 in float64: every metric read 0 (a zero matrix), silently.
    x = 1e-170 * torch.randn(200, 8, generator=torch.Generator().manual_seed(22), dtype=torch.float64)
    metric = ActivationSpectrum(num_classes=2, center="both")
    _stream(metric, x, torch.arange(200) % 2, [100, 100])
    with pytest.warns(RuntimeWarning, match=r"too small for float64 second moments \(entries of about 1\.\de-17\d"):
        result = metric.compute()
    assert math.isnan(float(result.uncentered.numerical_rank)) and math.isnan(float(result.total_cluster_variation))
    metric = ActivationSpectrum()
    metric.update(x * 1e30)  # 1e-140: the products are normal numbers, nothing is lost
    assert int(metric.compute().uncentered.numerical_rank) == 8


def test_a_first_batch_far_from_the_others_warns_of_the_centred_spectrum_it_costs() -> None:
    # One row 1e6 away, then 999 rows: the centred Gram cancels N 1e12 down to 1e-1; its small values came out 3.4x
    # the exact ones (1.21 for 0.351), above the rounding the README states, without a word.
    g = torch.Generator().manual_seed(23)
    x = 1e-2 * torch.randn(1000, 12, generator=g, dtype=torch.float64)
    x[1:] += 1e6
    metric = ActivationSpectrum(center=True)
    _stream(metric, x, None, [1, 999])
    with pytest.warns(RuntimeWarning, match=r"centred spectrum .* below about 4\.\de-07 \* s_1 can be rounding noise"):
        metric.compute()
    metric = ActivationSpectrum(center="both")
    _stream(metric, x[1:], None, [500, 499])  # a representative first batch: exact, no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = metric.compute()
    np.testing.assert_allclose(result.centered.spectrum.singular_values.numpy(), _np_sv(x[1:], True), rtol=1e-10)


def test_total_cluster_variation_of_tight_classes_warns_of_its_rounding() -> None:
    # Classes of spread 1e-8 around means of order 1: TCV = Q - sum ||S_c||^2 / n_c cancels every digit (0 for 1e-13).
    g = torch.Generator().manual_seed(24)
    labels = torch.randint(0, 4, (1000,), generator=g)
    means = torch.randn(4, 12, generator=g, dtype=torch.float64)
    for spread, warns in ((1e-8, True), (1e-2, False)):
        x = means[labels] + spread * torch.randn(1000, 12, generator=g, dtype=torch.float64)
        metric = ActivationSpectrum(num_classes=4)
        _stream(metric, x, labels, [100] * 10)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = metric.compute()
        messages = [str(w.message) for w in caught]
        assert any("total cluster variation" in m and "may be off by about" in m for m in messages) == warns
        if not warns:
            assert float(result.total_cluster_variation) == pytest.approx(
                float(F.total_cluster_variation(x, labels)), rel=1e-12
            )


def test_activations_or_labels_that_are_not_tensors_are_refused_naming_them() -> None:
    # They failed with "'list' object has no attribute 'ndim'" (or 'detach') from deep inside update().
    x, y = torch.randn(4, 3), [0, 1, 2, 0]
    metric = ActivationSpectrum(num_classes=3)
    with pytest.raises(ValueError, match=r"labels must be integer labels of shape \(B,\).*; got a list; pass integer"):
        metric.update(x, y)
    with pytest.raises(ValueError, match=r"; got a tuple; pass integer class indices"):
        ActivationSpectrum(num_classes=3, reduction="token").update(torch.randn(2, 3, 4), ((0, 1, 2), (0, 1, 2)))
    with pytest.raises(TypeError, match=r"^activations must be a torch.Tensor, got ndarray$"):
        metric.update(x.numpy(), torch.tensor(y))
    metric.update(x, torch.tensor(y))
    assert metric.compute().num_samples == 4


@pytest.mark.parametrize(
    ("shape", "reduction"),
    [((4, 0), "mean"), ((4, 3, 0, 5), "channel"), ((4, 0, 6), "cls"), ((4, 0, 6), "mean"), ((4, 3, 0, 5), "flatten")],
)
def test_an_empty_dimension_after_the_batch_is_refused_naming_the_shape(shape: tuple[int, ...], reduction: str) -> None:
    # They failed with "num_features must be a positive integer, got 0" (no num_features was given), a
    # ZeroDivisionError, an IndexError, or, for the mean of no token, NaN with a warning of NaN or Inf activations.
    metric = ActivationSpectrum(reduction=reduction)
    shown = re.escape(str(shape))
    with pytest.raises(ValueError, match=rf"^activations of shape {shown} have an empty dimension after the batch one"):
        metric.update(torch.randn(*shape))
    metric.update(torch.ones(0, *(size or 2 for size in shape[1:])))  # an empty batch stays a batch without rows
    assert metric.compute().num_samples == 0
