"""The registry and the interface every registered backbone shares."""

import pytest
import torch
from torch import nn

from rank_lightning.models import Backbone, create_model, list_models, register_model

EXPECTED_MODELS = {"mlp", "resnet18", "resnet50", "vgg11", "vgg11_bn", "vgg19", "vgg19_bn", "vit_tiny", "vit_small"}


def _record_blocks(model: Backbone) -> tuple[list[str], dict[str, torch.Tensor], list]:
    """Hook every block; return (names in firing order, outputs by name, hook handles)."""
    order: list[str] = []
    outputs: dict[str, torch.Tensor] = {}

    def hook(name: str):
        def record(module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
            order.append(name)
            outputs[name] = output.detach().clone()

        return record

    handles = [model.get_submodule(path).register_forward_hook(hook(name)) for name, path in model.blocks().items()]
    return order, outputs, handles


def test_registry_lists_every_backbone():
    assert set(list_models()) >= EXPECTED_MODELS
    assert list_models() == sorted(list_models())


def test_unknown_model_lists_valid_names():
    with pytest.raises(ValueError, match=r"unknown model 'resnet19'; models are: .*resnet18.*vit_tiny"):
        create_model("resnet19")


def test_unknown_argument_lists_valid_arguments():
    with pytest.raises(ValueError, match=r"'widht'.*'mlp'; arguments are: .*width"):
        create_model("mlp", widht=3)


def test_registering_a_name_twice_fails():
    with pytest.raises(ValueError, match="registered twice"):
        register_model("mlp")(lambda: None)


@pytest.mark.parametrize("name", list_models())
def test_forward_backward(name, make_small):
    torch.manual_seed(0)
    model = make_small(name)
    assert isinstance(model, Backbone)
    x = torch.randn(4, *model.input_shape, requires_grad=True)
    out = model(x)
    assert out.shape == (4, model.num_classes)
    (out.sum() + model.forward_features(x).square().sum()).backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    for param_name, param in model.named_parameters():
        assert param.grad is not None, param_name
        assert torch.isfinite(param.grad).all(), param_name


@pytest.mark.parametrize("name", list_models())
def test_forward_is_head_of_features(name, make_small):
    torch.manual_seed(0)
    model = make_small(name).eval()
    # torchvision starts the ViT head at zero, which would make any two outputs equal.
    nn.init.normal_(model.get_submodule(model.head_path).weight)
    x = torch.randn(3, *model.input_shape)
    with torch.no_grad():
        features = model.forward_features(x)
        assert features.shape == (3, model.num_features)
        torch.testing.assert_close(model(x), model.forward_head(features), rtol=0, atol=0)
        assert model(x).std() > 0


@pytest.mark.parametrize("name", list_models())
def test_blocks_fire_in_depth_order_and_end_at_the_features(name, make_small):
    torch.manual_seed(0)
    model = make_small(name).eval()
    blocks = model.blocks()
    assert len(blocks) >= 2
    order, outputs, handles = _record_blocks(model)
    x = torch.randn(3, *model.input_shape)
    with torch.no_grad():
        features = model.forward_features(x)
    for handle in handles:
        handle.remove()
    assert order == list(blocks)
    torch.testing.assert_close(outputs[order[-1]], features, rtol=0, atol=0)


@pytest.mark.parametrize("name", list_models())
def test_no_head(name, make_small):
    model = make_small(name, num_classes=0).eval()
    assert model.num_classes == 0
    x = torch.randn(2, *model.input_shape)
    with torch.no_grad():
        torch.testing.assert_close(model(x), model.forward_features(x))
    assert not list(model.get_submodule(model.head_path).parameters())


@pytest.mark.parametrize("name", list_models())
def test_unknown_init_lists_schemes(name, make_small):
    with pytest.raises(
        ValueError, match=r"unknown init scheme 'xavier'; schemes are: default, gaussian, kaiming, orthogonal"
    ):
        make_small(name, init="xavier")


def test_backbone_without_implementation_says_what_is_missing():
    with pytest.raises(NotImplementedError, match="Backbone must implement forward_features"):
        Backbone()(torch.zeros(1))
    with pytest.raises(NotImplementedError, match="Backbone must implement blocks"):
        Backbone().blocks()


@pytest.mark.parametrize("name", ["resnet18", "vgg11", "vit_tiny"])
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_classes": -3}, "num_classes must be a non-negative integer, got -3"),
        ({"image_size": 0}, "image_size must be a positive integer, got 0"),
        ({"in_channels": 0}, "in_channels must be a positive integer, got 0"),
    ],
)
def test_image_backbones_refuse_impossible_sizes(name, kwargs, match):
    # ResNet and VGG came back headless with num_classes=-3; the MLP already refused.
    with pytest.raises(ValueError, match=match):
        create_model(name, **kwargs)
