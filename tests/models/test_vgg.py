"""VGG: documented block shapes (on the meta device), pooling adapted to small images, torchvision layout."""

import pytest
import torch
import torchvision
from torch import nn

from rank_lightning.layers import FeatureLayer, capture_features, default_layers
from rank_lightning.models import VGG, create_model
from tests.models.block_helpers import count_block_calls

CHANNELS = (64, 128, 256, 512, 512)


def _expected(sizes: tuple[int, ...], width: int = 512) -> dict[str, tuple[int, ...]]:
    stages = {f"stage{k + 1}": (2, c, s, s) for k, (c, s) in enumerate(zip(CHANNELS, sizes))}
    return {**stages, "fc1": (2, width), "fc2": (2, width)}


@pytest.mark.parametrize("name", ["vgg11", "vgg11_bn", "vgg19", "vgg19_bn"])
@pytest.mark.parametrize(
    ("kwargs", "sizes"),
    [
        ({}, (16, 8, 4, 2, 1)),  # CIFAR: five poolings
        ({"in_channels": 1, "image_size": 28}, (14, 7, 3, 1, 1)),  # MNIST: the fifth pooling becomes an identity
        ({"in_channels": 1, "image_size": 8}, (4, 2, 1, 1, 1)),  # digits: three poolings
        ({"image_size": 224, "pool_size": 7, "classifier_width": 4096}, (112, 56, 28, 14, 7)),
    ],
)
def test_block_shapes(name, kwargs, sizes, block_shapes):
    with torch.device("meta"):
        model = create_model(name, **kwargs)
    width = kwargs.get("classifier_width", 512)
    assert block_shapes(model) == _expected(sizes, width)
    assert model.num_features == width
    poolings = sum(isinstance(m, nn.MaxPool2d) for m in model.features)
    assert poolings == sum(s_in >= 2 for s_in in (kwargs.get("image_size", 32), *sizes[:-1]))


def test_sanyal_classifier_is_512_512_512_classes():
    model = create_model("vgg19", num_classes=100)
    linears = [m for m in model.classifier if isinstance(m, nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(512, 512), (512, 512), (512, 100)]
    assert sum(isinstance(m, nn.Conv2d) for m in model.features) == 16
    assert model.blocks()["fc2"] == "classifier.5" and model.head_path == "classifier.6"


@pytest.mark.parametrize("name", ["vgg11", "vgg19_bn"])
def test_imagenet_configuration_has_torchvision_parameter_names_and_shapes(name):
    with torch.device("meta"):
        ours = create_model(name, num_classes=1000, image_size=224, pool_size=7, classifier_width=4096)
        reference = getattr(torchvision.models, name)()
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in reference.state_dict().items()}


def test_dropout_is_configurable_and_off_by_default():
    assert all(m.p == 0.0 for m in create_model("vgg11").classifier if isinstance(m, nn.Dropout))
    model = create_model("vgg11", in_channels=1, image_size=8, classifier_width=16, dropout=0.5)
    assert [m.p for m in model.classifier if isinstance(m, nn.Dropout)] == [0.5, 0.5]


def test_relus_are_not_in_place():
    model = create_model("vgg11", in_channels=1, image_size=8, classifier_width=16)
    assert all(not m.inplace for m in model.modules() if isinstance(m, nn.ReLU))


def test_unknown_architecture_lists_valid_ones():
    with pytest.raises(ValueError, match=r"unknown VGG architecture 'vgg16'; architectures are: vgg11, vgg11_bn"):
        VGG("vgg16")


@pytest.mark.parametrize("name", ["vgg11", "vgg19_bn"])
def test_one_block_per_stage_each_run_once_ending_with_the_features(name, make_small):
    model = make_small(name).eval()
    assert list(model.blocks()) == ["stage1", "stage2", "stage3", "stage4", "stage5", "fc1", "fc2"]
    x = torch.randn(2, 1, 8, 8)
    assert count_block_calls(model, model.blocks(), x) == dict.fromkeys(model.blocks(), 1)
    with torch.no_grad(), capture_features(model, [FeatureLayer("fc2", model.blocks()["fc2"])]) as captured:
        features = model.forward_features(x)
    torch.testing.assert_close(captured["fc2"], features, rtol=0, atol=0)


def test_a_user_lightning_module_wrapping_the_vgg_monitors_every_stage(make_small):
    wrapper = nn.Module()  # what a user's LightningModule with ``self.net = create_model(...)`` looks like
    wrapper.net = make_small("vgg11").eval()
    wrapper.criterion = nn.CrossEntropyLoss()
    assert default_layers(wrapper) == {name: f"net.{path}" for name, path in wrapper.net.blocks().items()}
