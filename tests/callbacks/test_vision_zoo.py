"""Rank monitors on the vision models researchers use (torchvision, timm), with random weights."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from rank_lightning.callbacks import WeightRankMonitor


def _block_diagonal_svdvals(conv: nn.Conv2d) -> torch.Tensor:
    """Singular values of the conv's linear map: the explicit block-diagonal out x (in * kh * kw) matrix."""
    weight = conv.weight.detach().double().flatten(1)
    return torch.linalg.svdvals(torch.block_diag(*weight.chunk(conv.groups)))


@pytest.mark.parametrize("decomposition", ["auto", "svd", "gram"])
def test_grouped_and_depthwise_convs_measure_the_block_diagonal_operator(decomposition: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(64, 64, 3, groups=32),  # ResNeXt-style: 32 groups of 2 x 18
        nn.Conv2d(48, 48, 3, groups=48),  # depthwise: 48 filters of 1 x 9
        nn.Conv2d(16, 32, 1, groups=4),  # 4 groups of 8 x 4: rank 4 each
        nn.Conv2d(8, 16, 3),  # groups == 1: the (out, in * kh * kw) matrix, unchanged
    )
    with torch.no_grad():
        model[1].weight[5] = 0.0  # one dead depthwise filter: rank 47
    monitor = WeightRankMonitor(decomposition=decomposition)
    spectra = monitor.spectra(model)
    for name, conv in zip(["0", "1", "2", "3"], model):
        expected = _block_diagonal_svdvals(conv)
        spectrum = spectra[name]
        assert spectrum.singular_values.shape == expected.shape
        fan_in = conv.in_channels * conv.kernel_size[0] * conv.kernel_size[1]
        assert (spectrum.num_samples, spectrum.num_features) == (conv.out_channels, fan_in)
        atol = 1e-12 if decomposition == "svd" else 1e-8 * float(expected[0])
        torch.testing.assert_close(spectrum.singular_values, expected, rtol=0, atol=atol)
    ranks = {name: values["numerical_rank"] for name, values in monitor.measure(model).items()}
    assert ranks == {"0": 64.0, "1": 47.0, "2": 16.0, "3": 16.0}


def test_convnext_layer_scale_is_no_expert_stack() -> None:
    torchvision = pytest.importorskip("torchvision")
    model = torchvision.models.convnext_tiny(weights=None)
    with warnings.catch_warnings():
        # A (C, 1, 1) layer_scale was read as an unread 3-D stack: one warning per block.
        warnings.simplefilter("error")
        names = WeightRankMonitor().select(model)
    assert len(names) == 59
    assert [name for name in names if name.startswith("features.1.0.")] == [
        "features.1.0.block.0",
        "features.1.0.block.3",
        "features.1.0.block.5",
    ]
