"""ResNet: documented block shapes (computed on the meta device, so full sizes cost nothing), stems, structure."""

import math

import pytest
import torch
from torch import nn

from rank_lightning.models import ResNet, create_model


def _half(size: int) -> int:
    """Output size of the stride-2 convolutions with padding (3x3 pad 1, 7x7 pad 3, max pool 3x3 pad 1)."""
    return math.ceil(size / 2)


def _expected(expansion: int, size: int, channels: int = 64) -> dict[str, tuple[int, ...]]:
    sizes = [size, size, _half(size), _half(_half(size)), _half(_half(_half(size)))]
    widths = [channels, 64 * expansion, 128 * expansion, 256 * expansion, 512 * expansion]
    names = ["stem", "layer1", "layer2", "layer3", "layer4"]
    shapes = {n: (2, c, s, s) for n, c, s in zip(names, widths, sizes)}
    return {**shapes, "pool": (2, 512 * expansion)}


@pytest.mark.parametrize(
    ("name", "kwargs", "expansion", "stem_size"),
    [
        ("resnet18", {}, 1, 32),  # CIFAR
        ("resnet50", {}, 4, 32),
        ("resnet18", {"in_channels": 1, "image_size": 28}, 1, 28),  # MNIST
        ("resnet50", {"in_channels": 1, "image_size": 8}, 4, 8),  # digits
        ("resnet18", {"image_size": 224}, 1, 56),  # ImageNet stem: 224 -> 112 -> 56
        ("resnet50", {"image_size": 224}, 4, 56),
        ("resnet18", {"image_size": 32, "cifar_stem": False}, 1, 8),
        ("resnet18", {"image_size": 96, "cifar_stem": True}, 1, 96),
    ],
)
def test_block_shapes(name, kwargs, expansion, stem_size, block_shapes):
    with torch.device("meta"):
        model = create_model(name, **kwargs)
    assert list(model.blocks()) == ["stem", "layer1", "layer2", "layer3", "layer4", "pool"]
    assert block_shapes(model) == _expected(expansion, stem_size)
    assert model.num_features == 512 * expansion


def test_cifar_stem_is_a_stride_one_3x3_convolution_without_max_pooling():
    model = create_model("resnet18", in_channels=1)
    assert model.cifar_stem
    assert (model.conv1.in_channels, model.conv1.kernel_size, model.conv1.stride) == (1, (3, 3), (1, 1))
    assert isinstance(model.maxpool, nn.Identity)
    imagenet = create_model("resnet18", image_size=65)
    assert not imagenet.cifar_stem
    assert (imagenet.conv1.kernel_size, imagenet.conv1.stride) == ((7, 7), (2, 2))
    assert isinstance(imagenet.maxpool, nn.MaxPool2d)


class Tap(nn.Module):
    """Identity that also runs ``probe`` on its input (a stand-in for a layer with a side loss)."""

    def __init__(self, probe: nn.Module) -> None:
        super().__init__()
        self.probe = probe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.probe(x)
        return x


def test_a_layer_can_be_inserted_before_the_last_stage():
    """Sanyal et al.: 16,384 = 256 x 8 x 8 features enter ResNet-18's last stage on 32x32 inputs."""
    with torch.device("meta"):
        model = create_model("resnet18")
        seen = {}
        probe = nn.Flatten(1)
        probe.register_forward_hook(lambda module, inputs, output: seen.setdefault("shape", output.shape))
        stage = model.layer4
        model.layer4 = nn.Sequential(Tap(probe), stage)
        assert model(torch.empty(2, 3, 32, 32)).shape == (2, 10)
    assert seen["shape"] == (2, 16384)


def test_relus_are_not_in_place():
    model = create_model("resnet50", in_channels=1, image_size=8)
    assert all(not m.inplace for m in model.modules() if isinstance(m, nn.ReLU))


def test_unknown_architecture_lists_valid_ones():
    with pytest.raises(ValueError, match=r"unknown ResNet architecture 'resnet34'; architectures are: resnet18, res"):
        ResNet("resnet34")
