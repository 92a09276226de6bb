"""ViT: documented block shapes (on the meta device), equality with torchvision's forward, input checks."""

import pytest
import torch
from torch import nn
from torchvision.models.vision_transformer import VisionTransformer

from rank_lightning.layers import FeatureLayer, capture_features, default_layers
from rank_lightning.models import ViT, create_model
from tests.models.block_helpers import count_block_calls


@pytest.mark.parametrize(
    ("name", "kwargs", "tokens", "width", "layers"),
    [
        ("vit_tiny", {}, 65, 192, 12),  # 32x32 in 4x4 patches: 64 patches + class token
        ("vit_small", {}, 65, 384, 12),
        ("vit_tiny", {"in_channels": 1, "image_size": 28}, 50, 192, 12),
        ("vit_tiny", {"in_channels": 1, "image_size": 8, "num_layers": 3, "hidden_dim": 24}, 5, 24, 3),
        ("vit_small", {"image_size": 32, "patch_size": 8}, 17, 384, 12),
    ],
)
def test_block_shapes(name, kwargs, tokens, width, layers, block_shapes):
    with torch.device("meta"):
        model = create_model(name, **kwargs)
    expected = {f"block{i}": (2, tokens, width) for i in range(layers)}
    assert block_shapes(model) == {**expected, "cls": (2, width)}
    assert model.num_features == width


def test_forward_equals_torchvision():
    """Same modules, same parameter names: a torchvision state dict gives the same logits."""
    torch.manual_seed(0)
    config = {"image_size": 16, "patch_size": 4, "num_layers": 2, "num_heads": 3, "hidden_dim": 24, "mlp_dim": 48}
    reference = VisionTransformer(**config, num_classes=5).eval()
    nn.init.normal_(reference.heads.head.weight)
    ours = create_model("vit_tiny", num_classes=5, **config).eval()
    ours.load_state_dict(reference.state_dict())
    x = torch.randn(3, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), reference(x))


def test_wrong_image_size_is_rejected():
    model = create_model("vit_tiny", in_channels=1, image_size=8, num_layers=1)
    with pytest.raises(ValueError, match="expected 8x8 images, got 12x12"):
        model(torch.zeros(1, 1, 12, 12))


def test_invalid_configurations_are_rejected():
    with pytest.raises(ValueError, match="image_size 30 is not a multiple of patch_size 4"):
        ViT(image_size=30)
    with pytest.raises(ValueError, match="hidden_dim 100 is not a multiple of num_heads 3"):
        ViT(hidden_dim=100)


def test_one_block_per_encoder_layer_each_run_once_ending_with_the_features(make_small):
    model = make_small("vit_tiny", num_layers=3).eval()
    assert list(model.blocks()) == ["block0", "block1", "block2", "cls"]
    x = torch.randn(2, 1, 8, 8)
    assert count_block_calls(model, model.blocks(), x) == dict.fromkeys(model.blocks(), 1)
    with torch.no_grad(), capture_features(model, [FeatureLayer("cls", model.blocks()["cls"])]) as captured:
        features = model.forward_features(x)
    torch.testing.assert_close(captured["cls"], features, rtol=0, atol=0)


def test_a_user_lightning_module_wrapping_the_vit_monitors_every_block(make_small):
    wrapper = nn.Module()  # what a user's LightningModule with ``self.net = create_model(...)`` looks like
    wrapper.net = make_small("vit_tiny", num_layers=3).eval()
    wrapper.criterion = nn.CrossEntropyLoss()
    expected = {name: f"net.{path}" for name, path in wrapper.net.blocks().items()}
    assert default_layers(wrapper) == expected
    assert count_block_calls(wrapper.net, wrapper.net.blocks(), torch.randn(2, 1, 8, 8)) == dict.fromkeys(expected, 1)
