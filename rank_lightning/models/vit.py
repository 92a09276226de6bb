"""Vision Transformers (ViT-Tiny, ViT-Small widths) from torchvision's VisionTransformer, for small images."""

from __future__ import annotations

import math

import torch
from torch import nn
from torchvision.models.vision_transformer import VisionTransformer

from rank_lightning.models.base import Backbone, check_image_sizes, register_model
from rank_lightning.models.pretrained import initialise_backbone
from rank_lightning.validation import check_fraction, check_non_negative_int, check_positive_int


class ClassToken(nn.Module):
    """Select the class token: ``(B, T, D) -> (B, D)``; a module so that the feature vector can be hooked."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return tokens[:, 0]


class ViT(Backbone):
    """torchvision's VisionTransformer with its module names kept (``conv_proj``, ``class_token``, ``encoder``,
    ``heads``), so torchvision checkpoints of the same size load as they are.

    An ``s x s`` image is cut into ``(s / patch_size)**2`` patches; with the class token the encoder sees
    ``T = 1 + (s / patch_size)**2`` tokens (65 for 32x32 with patch 4, 50 for 28x28, 5 for 8x8).

    Blocks: ``block0`` .. ``block{num_layers-1}`` (paths ``encoder.layers.encoder_layer_i``), the ``(B, T, D)``
    token activations after each encoder layer; ``cls`` (path ``cls_pool``, the feature layer), the ``(B, D)`` class
    token after the encoder's final LayerNorm, ``D = hidden_dim``. The head is torchvision's ``heads.head``
    (initialised to zero by torchvision).

    Args:
        num_classes: Outputs of the head; 0 for no head (``forward`` returns the features).
        in_channels: Input channels (1 for MNIST-like images).
        image_size: Input height and width; a multiple of ``patch_size``.
        patch_size: Side of the square patches.
        num_layers: Encoder layers.
        num_heads: Attention heads per layer; divides ``hidden_dim``.
        hidden_dim: Token width ``D``.
        mlp_dim: Hidden width of each encoder layer's MLP.
        dropout: Dropout probability of torchvision's encoder.
        attention_dropout: Dropout probability on the attention weights.
    """

    head_path = "heads.head"

    def __init__(
        self,
        num_classes: int = 10,
        in_channels: int = 3,
        image_size: int = 32,
        patch_size: int = 4,
        num_layers: int = 12,
        num_heads: int = 3,
        hidden_dim: int = 192,
        mlp_dim: int = 768,
        dropout: float = 0.0,
        attention_dropout: float = 0.0,
    ) -> None:
        super().__init__()
        check_image_sizes(num_classes, in_channels, image_size)
        for name, size in (("patch_size", patch_size), ("num_heads", num_heads), ("hidden_dim", hidden_dim)):
            check_positive_int(name, size)
        check_non_negative_int("num_layers", num_layers)
        check_positive_int("mlp_dim", mlp_dim)
        check_fraction("dropout", dropout, closed_low=True)
        check_fraction("attention_dropout", attention_dropout, closed_low=True)
        if image_size % patch_size != 0:
            raise ValueError(f"image_size {image_size} is not a multiple of patch_size {patch_size}")
        if hidden_dim % num_heads != 0:
            raise ValueError(f"hidden_dim {hidden_dim} is not a multiple of num_heads {num_heads}")
        net = VisionTransformer(
            image_size=image_size,
            patch_size=patch_size,
            num_layers=num_layers,
            num_heads=num_heads,
            hidden_dim=hidden_dim,
            mlp_dim=mlp_dim,
            dropout=dropout,
            attention_dropout=attention_dropout,
            num_classes=max(num_classes, 1),
        )
        self.input_shape = (in_channels, image_size, image_size)
        self.num_classes = num_classes
        self.num_features = hidden_dim
        self.patch_size = patch_size
        self.conv_proj = net.conv_proj
        if in_channels != 3:
            self.conv_proj = nn.Conv2d(in_channels, hidden_dim, kernel_size=patch_size, stride=patch_size)
            # torchvision's initialisation of the patch embedding.
            nn.init.trunc_normal_(self.conv_proj.weight, std=math.sqrt(1 / self.conv_proj.weight[0].numel()))
            nn.init.zeros_(self.conv_proj.bias)
        self.class_token = net.class_token
        self.encoder = net.encoder
        self.cls_pool = ClassToken()
        self.heads = net.heads
        if num_classes == 0:
            self.heads.head = nn.Identity()

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:  # (B, C, H, W) -> (B, hidden_dim)
        _, _, height, width = x.shape
        if (height, width) != self.input_shape[1:]:
            raise ValueError(f"expected {self.input_shape[1]}x{self.input_shape[2]} images, got {height}x{width}")
        x = self.conv_proj(x).flatten(2).transpose(1, 2)  # (B, T - 1, D): one token per patch, row-major
        x = torch.cat([self.class_token.expand(x.shape[0], -1, -1), x], dim=1)  # (B, T, D)
        return self.cls_pool(self.encoder(x))

    def forward_head(self, features: torch.Tensor) -> torch.Tensor:  # (B, hidden_dim) -> (B, num_classes)
        return self.heads(features)

    def blocks(self) -> dict[str, str]:
        layers = {f"block{i}": f"encoder.layers.encoder_layer_{i}" for i in range(len(self.encoder.layers))}
        return {**layers, "cls": "cls_pool"}


@register_model("vit_tiny")
def vit_tiny(
    *,
    num_classes: int = 10,
    in_channels: int = 3,
    image_size: int = 32,
    patch_size: int = 4,
    num_layers: int = 12,
    num_heads: int = 3,
    hidden_dim: int = 192,
    mlp_dim: int = 768,
    dropout: float = 0.0,
    attention_dropout: float = 0.0,
    init: str | None = None,
    pretrained: str | None = None,
    strict: bool = True,
) -> ViT:
    """ViT-Tiny width (192 wide, 12 layers, 3 heads, MLP 768) on 4x4 patches; see :class:`ViT` for the arguments.

    Args:
        init: Weight scheme of :func:`~rank_lightning.models.init_weights`; ``None`` keeps torchvision's.
        pretrained: Path of a ``state_dict`` file (torchvision has no weights of this size).
        strict: See :func:`~rank_lightning.models.pretrained.load_pretrained`.
    """
    model = ViT(
        num_classes=num_classes,
        in_channels=in_channels,
        image_size=image_size,
        patch_size=patch_size,
        num_layers=num_layers,
        num_heads=num_heads,
        hidden_dim=hidden_dim,
        mlp_dim=mlp_dim,
        dropout=dropout,
        attention_dropout=attention_dropout,
    )
    return initialise_backbone(model, init=init, pretrained=pretrained, strict=strict)


@register_model("vit_small")
def vit_small(
    *,
    num_classes: int = 10,
    in_channels: int = 3,
    image_size: int = 32,
    patch_size: int = 4,
    num_layers: int = 12,
    num_heads: int = 6,
    hidden_dim: int = 384,
    mlp_dim: int = 1536,
    dropout: float = 0.0,
    attention_dropout: float = 0.0,
    init: str | None = None,
    pretrained: str | None = None,
    strict: bool = True,
) -> ViT:
    """ViT-Small width (384 wide, 12 layers, 6 heads, MLP 1536) on 4x4 patches; arguments as :func:`vit_tiny`."""
    model = ViT(
        num_classes=num_classes,
        in_channels=in_channels,
        image_size=image_size,
        patch_size=patch_size,
        num_layers=num_layers,
        num_heads=num_heads,
        hidden_dim=hidden_dim,
        mlp_dim=mlp_dim,
        dropout=dropout,
        attention_dropout=attention_dropout,
    )
    return initialise_backbone(model, init=init, pretrained=pretrained, strict=strict)
