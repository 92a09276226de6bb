"""Activation monitors on 3-D convolutional networks (video, volumetric images): conv maps (B, C, T, H, W)."""

from __future__ import annotations

import warnings

import pytest
import pytorch_lightning as pl
import torch
from torch import nn

import rank_lightning.functional as F
from rank_lightning.callbacks import ActivationRankMonitor
from tests.callbacks.trainer_helpers import quiet_trainer


class _Video(pl.LightningModule):
    """A LightningModule around ``net``, validated on ``(video, label)`` batches."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x):
        return self.net(x)

    def validation_step(self, batch, batch_idx):
        self(batch[0])


def _tiny_conv3d() -> nn.Module:
    return nn.Sequential(
        nn.Sequential(nn.Conv3d(3, 6, 3, padding=1), nn.BatchNorm3d(6), nn.ReLU()),  # block1: (B, 6, 4, 6, 6)
        nn.Sequential(nn.Conv3d(6, 5, 3, stride=2, padding=1), nn.ReLU()),  # block2: (B, 5, 2, 3, 3)
        nn.AdaptiveAvgPool3d(1),
        nn.Flatten(),
        nn.Linear(5, 4),
    )


def _rows(output: torch.Tensor, reduction: str) -> torch.Tensor:
    """The float64 rows of a (B, C, T, H, W) output, by an explicit reshape."""
    x = output.double()
    if reduction == "channel":
        return x.permute(0, 2, 3, 4, 1).reshape(-1, x.shape[1])
    return x.mean(dim=(2, 3, 4)) if reduction == "mean" else x.reshape(x.shape[0], -1)


def _monitor_against_reference(tmp_path, net, videos, labels, layers, reduction, batch_size):
    model = _Video(net)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(videos, labels), batch_size=batch_size)
    metrics = ["numerical_rank", "effective_rank", "participation_ratio", "tcv"]
    monitor = ActivationRankMonitor(
        layers=layers, conv_reduction=reduction, num_classes=4, metrics=metrics, max_samples=None, verbose=False
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*it is skipped")
        (results,) = quiet_trainer([monitor], max_epochs=1, default_root_dir=tmp_path).validate(model, loader)
    outputs = {name: [] for name in layers}  # our own hooks on the same modules, the same inputs
    hooks = [
        model.get_submodule(name).register_forward_hook(lambda m, i, o, name=name: outputs[name].append(o))
        for name in layers
    ]
    with torch.no_grad():
        net.eval()(videos)
    for hook in hooks:
        hook.remove()
    for name in layers:
        output = torch.cat(outputs[name])
        assert output.ndim == 5
        x = _rows(output, reduction)
        row_labels = labels.repeat_interleave(x.shape[0] // len(labels))
        s = torch.linalg.svdvals(x)
        p = s / s.sum()
        expected = {
            "numerical_rank": float((s > s[0] * torch.finfo(torch.float32).eps * max(x.shape)).sum()),
            "effective_rank": float(torch.exp(-(p * p.log()).nan_to_num().sum())),
            "participation_ratio": float(s.square().sum() ** 2 / s.pow(4).sum()),
            "tcv": float(F.total_cluster_variation(x, row_labels, num_classes=4)),
            "spectrum_rows": float(x.shape[0]),
        }
        for key, value in expected.items():
            logged = float(results[f"rank/{name}/{reduction}/{key}"])
            assert logged == pytest.approx(value, rel=2e-6), (name, key)
    assert monitor.curves._facts["reduction"] == {"conv maps": reduction}  # the figures' caption names it
    return results


@pytest.mark.parametrize("reduction", ["channel", "mean", "flatten"])
def test_a_conv3d_network_is_monitored_as_conv_maps(tmp_path, reduction):
    torch.manual_seed(0)
    videos, labels = torch.randn(8, 3, 4, 6, 6), torch.arange(8) % 4
    layers = ["net.0", "net.1"]
    results = _monitor_against_reference(tmp_path, _tiny_conv3d(), videos, labels, layers, reduction, batch_size=3)
    rows = {"channel": 8 * 4 * 6 * 6, "mean": 8, "flatten": 8}[reduction]
    assert results[f"rank/net.0/{reduction}/spectrum_rows"] == rows
    if reduction == "channel":  # 1152 positions of 6 channels: full rank
        assert results["rank/net.0/channel/numerical_rank"] == 6


def test_torchvision_r3d_18_is_monitored(tmp_path):
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    net = torchvision.models.video.r3d_18(weights=None, num_classes=4)
    videos, labels = torch.randn(4, 3, 4, 32, 32), torch.tensor([0, 1, 2, 3])
    layers = ["net.layer1", "net.layer4"]
    results = _monitor_against_reference(tmp_path, net, videos, labels, layers, "channel", batch_size=2)
    assert results["rank/net.layer1/channel/spectrum_rows"] == 4 * 4 * 16 * 16  # (B, 64, 4, 16, 16): every position
    assert results["rank/net.layer4/channel/spectrum_rows"] == 4 * 1 * 2 * 2  # (B, 512, 1, 2, 2)


class _ChannelsLast3d(nn.Module):
    """Video Swin's layout: a Conv3d patch embedding, then blocks over the last dimension of (B, T, H, W, C)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Conv3d(3, 6, (2, 2, 2), stride=(2, 2, 2))
        self.stage = nn.Sequential(nn.LayerNorm(6), nn.Linear(6, 6))  # (B, 2, 3, 3, 6): C last, no width 2 inside

    def forward(self, x):
        return self.stage(self.embed(x).permute(0, 2, 3, 4, 1))


def test_channels_last_3d_maps_of_a_video_swin_stage_keep_their_channels(tmp_path):
    torch.manual_seed(0)
    net, videos, labels = _ChannelsLast3d(), torch.randn(6, 3, 4, 6, 6), torch.arange(6) % 4
    model = _Video(net)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(videos, labels), batch_size=3)
    monitor = ActivationRankMonitor(layers=["net.stage"], num_classes=4, metrics=["participation_ratio"], verbose=False)
    read = r"gives \(3, 2, 3, 3, 6\) outputs, read as channels-last \(B, D1, D2, D3, C\) maps with C = 6"
    with pytest.warns(UserWarning, match=read):
        (results,) = quiet_trainer([monitor], max_epochs=1, default_root_dir=tmp_path).validate(model, loader)
    with torch.no_grad():
        maps = net.eval()(videos).permute(0, 4, 1, 2, 3)  # (B, C, T, H, W)
    s = torch.linalg.svdvals(_rows(maps, "channel"))
    assert results["rank/net.stage/channel/spectrum_rows"] == 6 * 2 * 3 * 3  # positions, not 6 * 6 * 2 * 3
    expected = float(s.square().sum() ** 2 / s.pow(4).sum())
    assert results["rank/net.stage/channel/participation_ratio"] == pytest.approx(expected, rel=2e-6)


class _Trained(_Video):
    def training_step(self, batch, batch_idx):
        return nn.functional.cross_entropy(self(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_rank_pretraining_measures_the_channel_rows_of_a_conv3d_block(tmp_path):
    from rank_lightning.callbacks import RankPretraining

    torch.manual_seed(0)
    pool = [nn.AdaptiveAvgPool3d(1), nn.Flatten(), nn.Linear(6, 4)]
    net = nn.Sequential(nn.Conv3d(3, 6, 3, padding=1), nn.ReLU(), *pool)
    videos, labels = torch.randn(4, 3, 2, 5, 5), torch.arange(4)
    with torch.no_grad():
        s = torch.linalg.svdvals(_rows(net[1](net[0](videos)), "channel"))  # (4*2*5*5, 6) rows of the ReLU's maps
    callback = RankPretraining(layer="net.1", num_batches=1, steps=1, lr=1e-3, reduction="channel", verbose=False)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(videos, labels), batch_size=4)
    quiet_trainer([callback], max_steps=1, default_root_dir=tmp_path).fit(_Trained(net), loader)
    expected = float(s.square().sum() ** 2 / s.pow(4).sum())
    assert callback.results["net.1"]["r_before"] == pytest.approx(expected, rel=1e-6)
