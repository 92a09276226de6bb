"""ResNet-18 and ResNet-50 from torchvision's building blocks, with the CIFAR stem for small images."""

from __future__ import annotations

import torch
import torchvision
from torch import nn

from rank_lightning.models.base import Backbone, check_image_sizes, register_model
from rank_lightning.models.pretrained import initialise_backbone
from rank_lightning.validation import check_bool

ARCHITECTURES: tuple[str, ...] = ("resnet18", "resnet50")


class ResNet(Backbone):
    """torchvision's ResNet with its module names kept, so torchvision checkpoints load as they are.

    Attributes ``conv1``, ``bn1``, ``relu``, ``maxpool`` (the stem), ``layer1`` .. ``layer4``, ``avgpool`` and ``fc``
    (the head) are torchvision's modules; a layer can be put in front of a stage by replacing the attribute, e.g.
    ``model.layer4 = nn.Sequential(extra, model.layer4)`` before ResNet-18's last stage, where a 32x32 input gives
    256 x 8 x 8 = 16,384 features (Sanyal et al. Sec. 4). ``avgpool`` is global average pooling followed by
    flattening, so it outputs the ``(B, num_features)`` feature vector.

    The CIFAR stem (3x3 convolution with stride 1, no max pooling) replaces ImageNet's 7x7 stride-2 convolution and
    max pooling; it keeps small inputs large enough for the four stages (even 8x8 digits reach layer4 at 1x1).

    Blocks and their output shapes for an ``s x s`` input, with ``e`` = 1 (resnet18) or 4 (resnet50),
    ``c(s) = ceil(s / 2)`` and ``s0 = s`` with the CIFAR stem or ``c(c(s))`` with the ImageNet stem:
    ``stem`` (path ``maxpool``) ``(B, 64, s0, s0)``; ``layer1`` ``(B, 64e, s0, s0)``; ``layer2``
    ``(B, 128e, c(s0), c(s0))``; ``layer3`` ``(B, 256e, c(c(s0)), ...)``; ``layer4`` ``(B, 512e, c(c(c(s0))), ...)``;
    ``pool`` (path ``avgpool``, the feature layer) ``(B, 512e)``.

    Args:
        arch: One of :data:`ARCHITECTURES`.
        num_classes: Outputs of the head; 0 for no head (``forward`` returns the features).
        in_channels: Input channels (1 for MNIST-like images).
        image_size: Input height and width.
        cifar_stem: Use the CIFAR stem; ``None`` chooses it when ``image_size <= 64``.
    """

    head_path = "fc"

    def __init__(
        self,
        arch: str = "resnet18",
        num_classes: int = 10,
        in_channels: int = 3,
        image_size: int = 32,
        cifar_stem: bool | None = None,
    ) -> None:
        super().__init__()
        check_image_sizes(num_classes, in_channels, image_size)
        check_bool("cifar_stem", cifar_stem, allow_none=True)
        if arch not in ARCHITECTURES:
            raise ValueError(f"unknown ResNet architecture {arch!r}; architectures are: {', '.join(ARCHITECTURES)}")
        net: torchvision.models.ResNet = getattr(torchvision.models, arch)(num_classes=max(num_classes, 1))
        self.cifar_stem = image_size <= 64 if cifar_stem is None else cifar_stem
        self.input_shape = (in_channels, image_size, image_size)
        self.num_classes = num_classes
        self.num_features = net.fc.in_features

        self.conv1 = net.conv1
        self.maxpool = net.maxpool
        if self.cifar_stem:
            self.conv1 = nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
            self.maxpool = nn.Identity()
        elif in_channels != 3:
            self.conv1 = nn.Conv2d(in_channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
        if self.conv1 is not net.conv1:  # same initialisation as torchvision's convolutions
            nn.init.kaiming_normal_(self.conv1.weight, mode="fan_out", nonlinearity="relu")
        self.bn1 = net.bn1
        self.relu = net.relu
        self.layer1 = net.layer1
        self.layer2 = net.layer2
        self.layer3 = net.layer3
        self.layer4 = net.layer4
        self.avgpool = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(1))
        self.fc = net.fc if num_classes > 0 else nn.Identity()
        # A forward hook must see what a layer computed, not values a later in-place ReLU overwrote.
        for module in self.modules():
            if isinstance(module, nn.ReLU):
                module.inplace = False

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:  # (B, C, H, W) -> (B, num_features)
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.avgpool(x)

    def forward_head(self, features: torch.Tensor) -> torch.Tensor:  # (B, num_features) -> (B, num_classes)
        return self.fc(features)

    def blocks(self) -> dict[str, str]:
        return {
            "stem": "maxpool",
            "layer1": "layer1",
            "layer2": "layer2",
            "layer3": "layer3",
            "layer4": "layer4",
            "pool": "avgpool",
        }


def _resnet(
    arch: str,
    *,
    num_classes: int,
    in_channels: int,
    image_size: int,
    cifar_stem: bool | None,
    init: str | None,
    pretrained: str | None,
    strict: bool,
) -> ResNet:
    model = ResNet(arch, num_classes=num_classes, in_channels=in_channels, image_size=image_size, cifar_stem=cifar_stem)
    return initialise_backbone(model, init=init, pretrained=pretrained, strict=strict, torchvision_arch=arch)


@register_model("resnet18")
def resnet18(
    *,
    num_classes: int = 10,
    in_channels: int = 3,
    image_size: int = 32,
    cifar_stem: bool | None = None,
    init: str | None = None,
    pretrained: str | None = None,
    strict: bool = True,
) -> ResNet:
    """ResNet-18 (see :class:`ResNet` for the architecture arguments, blocks and shapes).

    Args:
        init: Weight scheme of :func:`~rank_lightning.models.init_weights`; ``None`` keeps torchvision's.
        pretrained: torchvision weights name (``"IMAGENET1K_V1"``, ``"DEFAULT"``) or path of a ``state_dict`` file.
        strict: See :func:`~rank_lightning.models.pretrained.load_pretrained`. ImageNet weights fit the ImageNet
            stem (``image_size > 64`` or ``cifar_stem=False``) with 3 input channels.
    """
    return _resnet(
        "resnet18",
        num_classes=num_classes,
        in_channels=in_channels,
        image_size=image_size,
        cifar_stem=cifar_stem,
        init=init,
        pretrained=pretrained,
        strict=strict,
    )


@register_model("resnet50")
def resnet50(
    *,
    num_classes: int = 10,
    in_channels: int = 3,
    image_size: int = 32,
    cifar_stem: bool | None = None,
    init: str | None = None,
    pretrained: str | None = None,
    strict: bool = True,
) -> ResNet:
    """ResNet-50 (see :class:`ResNet` and :func:`resnet18` for the arguments)."""
    return _resnet(
        "resnet50",
        num_classes=num_classes,
        in_channels=in_channels,
        image_size=image_size,
        cifar_stem=cifar_stem,
        init=init,
        pretrained=pretrained,
        strict=strict,
    )
