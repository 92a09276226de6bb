"""Small configurations of the registered backbones, so that forward and backward passes stay cheap on a CPU."""

from collections.abc import Callable
from typing import Any

import pytest
import torch

from rank_lightning.models import Backbone, create_model

# 1x8x8 inputs (the shape of scikit-learn's digits) for the image models: every stage still runs (the ResNet CIFAR
# stem reaches 1x1 at layer4, VGG replaces its last poolings by identities); ViTs keep two encoder layers.
# Models missing here are built with their defaults.
SMALL_KWARGS: dict[str, dict[str, Any]] = {
    "mlp": {"input_shape": (1, 8, 8), "depth": 3, "width": 16},
    "resnet18": {"in_channels": 1, "image_size": 8},
    "resnet50": {"in_channels": 1, "image_size": 8},
    "vgg11": {"in_channels": 1, "image_size": 8, "classifier_width": 32},
    "vgg11_bn": {"in_channels": 1, "image_size": 8, "classifier_width": 32},
    "vgg19": {"in_channels": 1, "image_size": 8, "classifier_width": 32},
    "vgg19_bn": {"in_channels": 1, "image_size": 8, "classifier_width": 32},
    "vit_tiny": {"in_channels": 1, "image_size": 8, "num_layers": 2},
    "vit_small": {"in_channels": 1, "image_size": 8, "num_layers": 2},
}


@pytest.fixture
def make_small() -> Callable[..., Backbone]:
    """``make_small(name, **overrides)``: the small configuration of a registered backbone."""

    def make(name: str, **overrides: Any) -> Backbone:
        return create_model(name, **{**SMALL_KWARGS.get(name, {}), **overrides})

    return make


@pytest.fixture
def block_shapes() -> Callable[[Backbone], dict[str, tuple[int, ...]]]:
    """``block_shapes(model)``: output shape of every block for a batch of 2, run on the meta device (no compute)."""

    def shapes_of(model: Backbone) -> dict[str, tuple[int, ...]]:
        shapes: dict[str, tuple[int, ...]] = {}
        handles = [
            model.get_submodule(path).register_forward_hook(
                lambda module, inputs, output, name=name: shapes.__setitem__(name, tuple(output.shape))
            )
            for name, path in model.blocks().items()
        ]
        model(torch.empty(2, *model.input_shape, device="meta"))
        for handle in handles:
            handle.remove()
        return shapes

    return shapes_of
