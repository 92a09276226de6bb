"""VGG-11 and VGG-19 (with or without BatchNorm) from torchvision's layer configurations, sized for 32x32 images."""

from __future__ import annotations

import torch
from torch import nn
from torchvision.models.vgg import cfgs, make_layers

from rank_lightning.models.base import Backbone, check_image_sizes, register_model
from rank_lightning.models.pretrained import initialise_backbone
from rank_lightning.validation import check_fraction, check_positive_int

# torchvision's configuration letter and batch-norm flag of each architecture.
ARCHITECTURES: dict[str, tuple[str, bool]] = {
    "vgg11": ("A", False),
    "vgg11_bn": ("A", True),
    "vgg19": ("E", False),
    "vgg19_bn": ("E", True),
}


class VGG(Backbone):
    """torchvision's VGG convolutions, global average pooling and a three-layer fully connected classifier.

    ``features`` is torchvision's ``make_layers`` output (same indices, so torchvision checkpoints load); the
    classifier ``Linear(512 * pool_size**2, w), ReLU, Dropout, Linear(w, w), ReLU, Dropout, Linear(w, num_classes)``
    is torchvision's with ``w = classifier_width``. The defaults (``pool_size=1``, ``w=512``, no dropout) give the
    CIFAR VGG-19 of Sanyal et al. (512 -> 512 -> 512 -> classes); ``pool_size=7``, ``w=4096``, ``dropout=0.5`` give
    torchvision's ImageNet model, which its ImageNet weights fit.

    Small images: a pooling stage whose input is smaller than 2x2 gets ``nn.Identity`` instead of its max pooling
    (indices unchanged), so the five stages run on any size: 32x32 halves five times down to 1x1, 28x28 (MNIST)
    pools four times (28, 14, 7, 3, 1), 8x8 (digits) three times.

    Blocks: ``stage1`` .. ``stage5``, the output of each stage's (possibly identity) pooling, ``(B, C_k, s_k, s_k)``
    with ``C = 64, 128, 256, 512, 512`` and ``s_k`` the size after k poolings as above; ``fc1`` and ``fc2``, the
    ``(B, classifier_width)`` outputs of the first two fully connected layers after ReLU and dropout (paths
    ``classifier.2`` and ``classifier.5``); ``fc2`` is the feature layer, the input of the last linear map.

    Args:
        arch: One of :data:`ARCHITECTURES`.
        num_classes: Outputs of the head; 0 for no head (``forward`` returns the features).
        in_channels: Input channels (1 for MNIST-like images).
        image_size: Input height and width.
        classifier_width: Width of the two hidden fully connected layers.
        pool_size: Output size of the adaptive average pooling before the classifier.
        dropout: Dropout probability after each hidden fully connected layer.
    """

    head_path = "classifier.6"

    def __init__(
        self,
        arch: str = "vgg19",
        num_classes: int = 10,
        in_channels: int = 3,
        image_size: int = 32,
        classifier_width: int = 512,
        pool_size: int = 1,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        check_image_sizes(num_classes, in_channels, image_size)
        check_positive_int("classifier_width", classifier_width)
        check_positive_int("pool_size", pool_size)
        check_fraction("dropout", dropout, closed_low=True)
        if arch not in ARCHITECTURES:
            raise ValueError(f"unknown VGG architecture {arch!r}; architectures are: {', '.join(ARCHITECTURES)}")
        config, batch_norm = ARCHITECTURES[arch]
        self.input_shape = (in_channels, image_size, image_size)
        self.num_classes = num_classes
        self.num_features = classifier_width

        self.features = make_layers(cfgs[config], batch_norm=batch_norm)
        if in_channels != 3:
            self.features[0] = nn.Conv2d(in_channels, self.features[0].out_channels, kernel_size=3, padding=1)
        size = image_size
        self._stage_ends: list[int] = []
        for index, module in enumerate(list(self.features)):
            if isinstance(module, nn.MaxPool2d):
                if size >= 2:
                    size //= 2
                else:
                    self.features[index] = nn.Identity()
                self._stage_ends.append(index)
            elif isinstance(module, nn.ReLU):
                # A forward hook must see what a layer computed, not values a later in-place ReLU overwrote.
                module.inplace = False
        channels = cfgs[config][-2]
        self.avgpool = nn.AdaptiveAvgPool2d(pool_size)
        self.classifier = nn.Sequential(
            nn.Linear(channels * pool_size * pool_size, classifier_width),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(classifier_width, classifier_width),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(classifier_width, num_classes) if num_classes > 0 else nn.Identity(),
        )
        # torchvision's VGG initialisation, which make_layers alone does not apply.
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
                nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, 0.0, 0.01)
                nn.init.zeros_(module.bias)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:  # (B, C, H, W) -> (B, classifier_width)
        x = self.avgpool(self.features(x)).flatten(1)  # (B, 512 * pool_size**2)
        return self.classifier[:-1](x)

    def forward_head(self, features: torch.Tensor) -> torch.Tensor:  # (B, classifier_width) -> (B, num_classes)
        return self.classifier[-1](features)

    def blocks(self) -> dict[str, str]:
        stages = {f"stage{k + 1}": f"features.{index}" for k, index in enumerate(self._stage_ends)}
        return {**stages, "fc1": "classifier.2", "fc2": "classifier.5"}


def _vgg(
    arch: str,
    *,
    num_classes: int,
    in_channels: int,
    image_size: int,
    classifier_width: int,
    pool_size: int,
    dropout: float,
    init: str | None,
    pretrained: str | None,
    strict: bool,
) -> VGG:
    model = VGG(
        arch,
        num_classes=num_classes,
        in_channels=in_channels,
        image_size=image_size,
        classifier_width=classifier_width,
        pool_size=pool_size,
        dropout=dropout,
    )
    return initialise_backbone(model, init=init, pretrained=pretrained, strict=strict, torchvision_arch=arch)


@register_model("vgg11")
def vgg11(
    *,
    num_classes: int = 10,
    in_channels: int = 3,
    image_size: int = 32,
    classifier_width: int = 512,
    pool_size: int = 1,
    dropout: float = 0.0,
    init: str | None = None,
    pretrained: str | None = None,
    strict: bool = True,
) -> VGG:
    """VGG-11 (torchvision configuration A); see :class:`VGG` for the architecture arguments, blocks and shapes.

    Args:
        init: Weight scheme of :func:`~rank_lightning.models.init_weights`; ``None`` keeps torchvision's.
        pretrained: torchvision weights name (``"IMAGENET1K_V1"``, ``"DEFAULT"``; they fit ``pool_size=7``,
            ``classifier_width=4096`` and 3 input channels) or path of a ``state_dict`` file.
        strict: See :func:`~rank_lightning.models.pretrained.load_pretrained`.
    """
    return _vgg(
        "vgg11",
        num_classes=num_classes,
        in_channels=in_channels,
        image_size=image_size,
        classifier_width=classifier_width,
        pool_size=pool_size,
        dropout=dropout,
        init=init,
        pretrained=pretrained,
        strict=strict,
    )


@register_model("vgg11_bn")
def vgg11_bn(
    *,
    num_classes: int = 10,
    in_channels: int = 3,
    image_size: int = 32,
    classifier_width: int = 512,
    pool_size: int = 1,
    dropout: float = 0.0,
    init: str | None = None,
    pretrained: str | None = None,
    strict: bool = True,
) -> VGG:
    """VGG-11 with BatchNorm after every convolution; arguments as :func:`vgg11`."""
    return _vgg(
        "vgg11_bn",
        num_classes=num_classes,
        in_channels=in_channels,
        image_size=image_size,
        classifier_width=classifier_width,
        pool_size=pool_size,
        dropout=dropout,
        init=init,
        pretrained=pretrained,
        strict=strict,
    )


@register_model("vgg19")
def vgg19(
    *,
    num_classes: int = 10,
    in_channels: int = 3,
    image_size: int = 32,
    classifier_width: int = 512,
    pool_size: int = 1,
    dropout: float = 0.0,
    init: str | None = None,
    pretrained: str | None = None,
    strict: bool = True,
) -> VGG:
    """VGG-19 (torchvision configuration E), the CIFAR network of Sanyal et al.; arguments as :func:`vgg11`."""
    return _vgg(
        "vgg19",
        num_classes=num_classes,
        in_channels=in_channels,
        image_size=image_size,
        classifier_width=classifier_width,
        pool_size=pool_size,
        dropout=dropout,
        init=init,
        pretrained=pretrained,
        strict=strict,
    )


@register_model("vgg19_bn")
def vgg19_bn(
    *,
    num_classes: int = 10,
    in_channels: int = 3,
    image_size: int = 32,
    classifier_width: int = 512,
    pool_size: int = 1,
    dropout: float = 0.0,
    init: str | None = None,
    pretrained: str | None = None,
    strict: bool = True,
) -> VGG:
    """VGG-19 with BatchNorm after every convolution; arguments as :func:`vgg11`."""
    return _vgg(
        "vgg19_bn",
        num_classes=num_classes,
        in_channels=in_channels,
        image_size=image_size,
        classifier_width=classifier_width,
        pool_size=pool_size,
        dropout=dropout,
        init=init,
        pretrained=pretrained,
        strict=strict,
    )
