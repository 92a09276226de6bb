"""Conv maps of 3-D convolutions, (B, C, D1, D2, D3): the conv reductions and the spectrum of their rows."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

import rank_lightning.functional as F
from rank_lightning.functional import reduce_activations
from rank_lightning.metrics import ActivationSpectrum


def _maps(seed: int = 0) -> torch.Tensor:
    return torch.randn(3, 4, 2, 3, 5, generator=torch.Generator().manual_seed(seed))  # (B, C, T, H, W)


def test_each_conv_reduction_of_5d_maps_equals_a_hand_made_reshape() -> None:
    x = _maps()
    positions = list(itertools.product(range(3), range(2), range(3), range(5)))  # (b, t, h, w), w fastest
    channel = torch.stack([x[b, :, t, h, w] for b, t, h, w in positions])
    flatten = torch.stack([torch.cat([x[b, c].reshape(-1) for c in range(4)]) for b in range(3)])
    mean = torch.stack([torch.stack([x[b, c].sum() / 30 for c in range(4)]) for b in range(3)])
    assert reduce_activations(x, "channel").shape == (90, 4)
    torch.testing.assert_close(reduce_activations(x, "channel"), channel, rtol=0, atol=0)
    torch.testing.assert_close(reduce_activations(x, "channel", dtype=torch.float64), channel.double(), rtol=0, atol=0)
    torch.testing.assert_close(reduce_activations(x, "flatten"), flatten, rtol=0, atol=0)
    assert reduce_activations(x, "flatten").shape == (3, 120)
    torch.testing.assert_close(reduce_activations(x, "mean"), mean)
    # Channels-last 3-d memory (torch.channels_last_3d) reduces to the same rows.
    last = x.contiguous(memory_format=torch.channels_last_3d)
    torch.testing.assert_close(reduce_activations(last, "channel"), channel, rtol=0, atol=0)


def test_5d_maps_refuse_token_reductions_and_other_ranks_name_the_shapes() -> None:
    with pytest.raises(ValueError, match=r"conv activations of shape \(3, 4, 2, 3, 5\); valid choices are "):
        reduce_activations(_maps(), "token")
    with pytest.raises(ValueError, match=r"expected .*conv maps \(B, C, H, W\) / \(B, C, D1, D2, D3\)"):
        reduce_activations(torch.zeros(5), "channel")


@pytest.mark.parametrize("reduction", ["channel", "flatten", "mean"])
def test_the_spectrum_of_5d_maps_matches_a_float64_reference(reduction: str) -> None:
    x = _maps(1)
    labels = torch.tensor([0, 2, 2])
    metric = ActivationSpectrum(num_classes=3, reduction=reduction, center="both")
    metric.update(x[:1], labels[:1])  # two batches: the second goes around the first one's reference point
    metric.update(x[1:], labels[1:])
    result = metric.compute()
    rows = {
        "channel": x.double().permute(0, 2, 3, 4, 1).reshape(-1, 4),
        "flatten": x.double().reshape(3, -1),
        "mean": x.double().mean(dim=(2, 3, 4)),
    }[reduction]
    row_labels = labels.repeat_interleave(rows.shape[0] // 3)
    assert (result.num_samples, result.num_features) == tuple(rows.shape)
    expected = np.linalg.svd(rows.numpy(), compute_uv=False)
    np.testing.assert_allclose(result.uncentered.spectrum.singular_values.numpy(), expected, rtol=1e-9, atol=1e-9)
    centered = np.linalg.svd((rows - rows.mean(0)).numpy(), compute_uv=False)
    # Three inputs centred span two dimensions: a Gram's zero eigenvalue is rounding, its root ~sqrt(eps) s_1.
    atol = 1e-7 * centered[0]
    np.testing.assert_allclose(result.centered.spectrum.singular_values.numpy(), centered, rtol=1e-9, atol=atol)
    tcv = F.total_cluster_variation(rows, row_labels, num_classes=3)
    assert float(result.total_cluster_variation) == pytest.approx(float(tcv), rel=1e-9)
    if reduction == "channel":  # 180 rows of 4 features: the class Grams give the class-wise VR_1 exactly
        assert result.classwise_source == "class_gram"
        per_class = F.classwise_variance_ratio(rows, row_labels, k=1, num_classes=3)
        np.testing.assert_allclose(result.classwise_variance_ratio.numpy(), per_class.numpy(), rtol=1e-9)


def test_the_subsample_fallback_takes_the_positions_of_5d_maps_as_rows() -> None:
    x, labels = _maps(2), torch.tensor([1, 0, 1])
    # 4 channels over max_gram_features=2: the sample Gram of a subsample that keeps every one of the 90 positions.
    metric = ActivationSpectrum(num_classes=2, reduction="channel", max_gram_features=2, max_samples=200)
    metric.update(x[:2], labels[:2])
    metric.update(x[2:], labels[2:])
    result = metric.compute()
    rows = x.double().permute(0, 2, 3, 4, 1).reshape(-1, 4)
    assert (result.path, result.num_samples, result.spectrum_rows) == ("sample_gram", 90, 90)
    expected = np.linalg.svd(rows.numpy(), compute_uv=False)
    np.testing.assert_allclose(result.uncentered.spectrum.singular_values.numpy(), expected, rtol=1e-9)
    per_class = F.classwise_variance_ratio(rows, labels.repeat_interleave(30), k=1, num_classes=2)
    assert result.classwise_source == "sample"
    np.testing.assert_allclose(result.classwise_variance_ratio.numpy(), per_class.numpy(), rtol=1e-9)


def test_the_batched_class_products_of_a_gpu_give_the_same_values_on_5d_maps(monkeypatch) -> None:
    import rank_lightning.functional.streaming as streaming

    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(12, 4, 2, 3, 3, generator=g), torch.randint(0, 3, (12,), generator=g)) for _ in range(2)]
    looped = ActivationSpectrum(reduction="channel", num_classes=3)
    for x, y in batches:
        looped.update(x, y)
    # The path off the CPU (one padded batched product of every class's positions), taken on the CPU.
    monkeypatch.setattr(streaming, "_batched_class_products", lambda device: True)
    blocks, original = [], streaming._padded_class_blocks
    monkeypatch.setattr(streaming, "_padded_class_blocks", lambda *args: blocks.append(original(*args)) or blocks[-1])
    batched = ActivationSpectrum(reduction="channel", num_classes=3)
    for x, y in batches:
        batched.update(x, y)
    assert len(blocks) == 2 and blocks[0].shape[:2] == (3, 4)  # one product per batch: 3 classes x 4 channels
    first, second = looped.compute(), batched.compute()
    assert first.num_samples == second.num_samples == 2 * 12 * 18
    torch.testing.assert_close(second.classwise_variance_ratio, first.classwise_variance_ratio, rtol=1e-10, atol=0)
    for key, value in first.scalars().items():
        assert second.scalars()[key] == pytest.approx(value, rel=1e-10, abs=1e-12), key
