"""Rank monitors on the vision models researchers use (torchvision, timm), with random weights."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from rank_lightning.callbacks import RankCollapseAlarm, WeightRankMonitor
from rank_lightning.tracker import RankTracker


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


def _tiny_swin() -> nn.Module:
    swin = pytest.importorskip("torchvision.models.swin_transformer")
    torch.manual_seed(0)
    model = swin.SwinTransformer([4, 4], 16, [1, 1], [2, 2], [4, 4], num_classes=10)
    return model.eval()


@pytest.mark.parametrize("reduction", ["channel", "mean"])
def test_swin_channels_last_stage_outputs_are_reduced_over_their_channels(reduction: str) -> None:
    model, x = _tiny_swin(), torch.randn(8, 3, 32, 32)
    outputs = {}
    model.features[1].register_forward_hook(lambda module, args, output: outputs.setdefault("out", output))
    tracker = RankTracker(model, conv_reduction=reduction)
    assert tracker.layers == {"features.1": "features.1", "features.3": "features.3"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with tracker:
            model(x)
    named = [str(w.message) for w in caught if "read as channels-last" in str(w.message)]
    assert len(named) == 2 and named[0].startswith("layer 'features.1' gives (8, 8, 8, 16) outputs"), named
    values = tracker.compute()["features.1"]
    assert outputs["out"].shape == (8, 8, 8, 16)  # (B, H, W, C)
    maps = outputs["out"].double()
    features = maps.reshape(-1, 16) if reduction == "channel" else maps.mean(dim=(1, 2))
    gram = features.T @ features
    assert values[f"{reduction}/spectrum_rows"] == features.shape[0]  # 512 positions or 8 images, not H = 8 channels
    assert values[f"{reduction}/numerical_rank"] == (16.0 if reduction == "channel" else 8.0)
    expected = float(gram.trace() ** 2 / gram.square().sum())
    assert values[f"{reduction}/participation_ratio"] == pytest.approx(expected, rel=1e-9)


def test_channels_last_memory_format_gives_the_contiguous_numbers() -> None:
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.mobilenet_v3_small(weights=None).eval()
    x = torch.randn(6, 3, 64, 64)
    found = []
    for memory_format in (torch.contiguous_format, torch.channels_last):
        model = model.to(memory_format=memory_format)
        tracker = RankTracker(model, layers=["features.1", "features.4", "features.8"])
        with tracker, torch.no_grad():
            model(x.to(memory_format=memory_format))
        found.append(tracker.compute())
    assert list(found[0]) == ["features.1", "features.4", "features.8"]
    for layer, values in found[0].items():
        assert values["channel/numerical_rank"] == found[1][layer]["channel/numerical_rank"]
        assert values["channel/spectrum_rows"] == found[1][layer]["channel/spectrum_rows"]
        for metric, value in values.items():  # the convs' own float32 rounding differs between the formats
            assert found[1][layer][metric] == pytest.approx(value, rel=1e-5), (layer, metric)


def test_timm_depthwise_convs_and_default_layers() -> None:
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("convnext_atto", pretrained=False)
    depthwise = model.stages[0].blocks[0].conv_dw
    assert depthwise.groups == depthwise.out_channels == 40
    with torch.no_grad():
        depthwise.weight[:3] = 0.0  # three dead filters
    spectrum = WeightRankMonitor(decomposition="svd").spectra(model)["stages.0.blocks.0.conv_dw"]
    expected = depthwise.weight.detach().double().flatten(1).norm(dim=1).sort(descending=True).values
    torch.testing.assert_close(spectrum.singular_values, expected, rtol=0, atol=1e-12)
    assert WeightRankMonitor().measure(model)["stages.0.blocks.0.conv_dw"]["numerical_rank"] == 37.0
    tracker = RankTracker(model)
    assert list(tracker.layers) == ["stages.0", "stages.1", "stages.2", "stages.3"]
    with tracker, torch.no_grad():
        model(torch.randn(4, 3, 32, 32))
    values = tracker.compute()
    assert values["stages.0"]["channel/spectrum_rows"] == 4 * 8 * 8  # (B, C, H, W) kept: C = 40 features
    assert values["stages.3"]["channel/spectrum_rows"] == 4


def test_rank_collapse_alarm_width_of_a_grouped_conv_is_that_of_its_block_diagonal_matrix() -> None:
    model = nn.Sequential(nn.Conv2d(96, 96, 7, groups=96), nn.Conv2d(64, 128, 3, groups=32))
    with torch.no_grad():
        model[0].weight[:40] = 0.0  # 56 of 96 depthwise filters alive
    alarm = RankCollapseAlarm(min_width_fraction=0.5, verbose=False)
    assert alarm.width("weight/0/numerical_rank", model) == 96  # min(96, 96 * 7 * 7), not min(96, 7 * 7)
    assert alarm.width("weight/1/numerical_rank", model) == 128  # min(128, 64 * 3 * 3)
    rank = WeightRankMonitor().measure(model)["0"]["numerical_rank"]
    assert rank == 56.0
    assert alarm.judge("weight/0/numerical_rank", rank, model) is None
    assert alarm.judge("weight/0/numerical_rank", 47.0, model) == "is below 0.5 x width 96 = 48"
