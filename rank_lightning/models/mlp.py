"""Fully connected networks: vanilla, batch-normalised, residual, or linear (identity activation)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from rank_lightning.models.base import Backbone, register_model
from rank_lightning.models.pretrained import initialise_backbone
from rank_lightning.validation import (
    check_bool,
    check_finite,
    check_non_negative_int,
    check_positive_int,
    check_positive_ints,
)

ACTIVATIONS: dict[str, type[nn.Module]] = {"relu": nn.ReLU, "tanh": nn.Tanh, "gelu": nn.GELU, "identity": nn.Identity}


class MLPBlock(nn.Module):
    """One hidden layer: ``h -> act(BN(W h + b))``, or ``h + gamma * act(BN(W h + b))`` with a residual branch.

    The optional BatchNorm1d sits between the linear map and the activation, as in the networks of Daneshmand et al.
    (Sec. 3-4); the residual form ``H_{l+1} = H_l + gamma * W_l H_l`` is their eq. 6 for the identity activation.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        activation: str,
        batch_norm: bool,
        residual_gamma: float | None,
        bias: bool,
    ) -> None:
        super().__init__()
        if residual_gamma is not None and in_features != out_features:
            raise ValueError(f"a residual layer needs equal widths, got {in_features} -> {out_features}")
        self.linear = nn.Linear(in_features, out_features, bias=bias)
        self.norm = nn.BatchNorm1d(out_features) if batch_norm else nn.Identity()
        self.act = ACTIVATIONS[activation]()
        self.residual_gamma = residual_gamma

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # (B, in_features) -> (B, out_features)
        branch = self.act(self.norm(self.linear(h)))
        if self.residual_gamma is None:
            return branch
        return h + self.residual_gamma * branch

    def extra_repr(self) -> str:
        return "" if self.residual_gamma is None else f"residual_gamma={self.residual_gamma}"


class MLP(Backbone):
    """Multilayer perceptron on flattened inputs: ``depth`` hidden layers of ``width`` units, then a linear head.

    Blocks: ``layer1`` .. ``layer{depth}`` (paths ``layers.0`` .. ``layers.{depth-1}``), each the ``(B, width)``
    output of a hidden layer after its activation (and residual sum); ``layer{depth}`` is the feature layer. With
    ``depth=0`` the network is a linear classifier and its only block is ``input`` (path ``flatten``, the flattened
    ``(B, d)`` input).

    Args:
        input_shape: Shape of one input sample (flattened inside), or its dimension ``d``.
        num_classes: Outputs of the head; 0 for no head (``forward`` returns the features).
        depth: Number of hidden layers.
        width: Units per hidden layer.
        activation: One of :data:`ACTIVATIONS` (``identity`` gives a linear network).
        batch_norm: BatchNorm1d after each hidden linear map, before the activation.
        residual_gamma: Strength of the residual branch ``h + gamma * act(BN(W h))`` on every hidden layer whose
            input has ``width`` features (all but the first unless the input has ``width`` features); ``None`` for
            no residual connections.
        bias: Biases in all linear maps, head included.
    """

    head_path = "head"

    def __init__(
        self,
        input_shape: int | Sequence[int] = (1, 28, 28),
        num_classes: int = 10,
        depth: int = 3,
        width: int = 128,
        activation: str = "relu",
        batch_norm: bool = False,
        residual_gamma: float | None = None,
        bias: bool = True,
    ) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}; activations are: {', '.join(ACTIVATIONS)}")
        check_non_negative_int("depth", depth)
        check_positive_int("width", width)
        check_non_negative_int("num_classes", num_classes)
        check_finite("residual_gamma", residual_gamma, allow_none=True)
        check_bool("batch_norm", batch_norm)
        check_bool("bias", bias)
        self.input_shape = check_positive_ints("input_shape", input_shape)
        in_features = math.prod(self.input_shape)
        self.num_classes = num_classes
        self.num_features = width if depth > 0 else in_features
        self.flatten = nn.Flatten(1)
        layers = []
        for _ in range(depth):
            gamma = residual_gamma if in_features == width else None
            layers.append(
                MLPBlock(
                    in_features,
                    width,
                    activation=activation,
                    batch_norm=batch_norm,
                    residual_gamma=gamma,
                    bias=bias,
                )
            )
            in_features = width
        self.layers = nn.Sequential(*layers)
        self.head = nn.Linear(self.num_features, num_classes, bias=bias) if num_classes > 0 else nn.Identity()

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:  # (B, *input_shape) -> (B, num_features)
        return self.layers(self.flatten(x))

    def forward_head(self, features: torch.Tensor) -> torch.Tensor:  # (B, num_features) -> (B, num_classes)
        return self.head(features)

    def blocks(self) -> dict[str, str]:
        if len(self.layers) == 0:
            return {"input": "flatten"}
        return {f"layer{i + 1}": f"layers.{i}" for i in range(len(self.layers))}


@register_model("mlp")
def mlp(
    *,
    input_shape: int | Sequence[int] = (1, 28, 28),
    num_classes: int = 10,
    depth: int = 3,
    width: int = 128,
    activation: str = "relu",
    batch_norm: bool = False,
    residual_gamma: float | None = None,
    bias: bool = True,
    init: str | None = None,
    pretrained: str | None = None,
    strict: bool = True,
) -> MLP:
    """Multilayer perceptron (see :class:`MLP` for the architecture arguments).

    Args:
        init: Weight scheme of :func:`~rank_lightning.models.init_weights` (``default``, ``gaussian``,
            ``orthogonal``, ``asymmetric``); ``None`` keeps PyTorch's, the same as ``default``.
        pretrained: Path of a ``state_dict`` file.
        strict: See :func:`~rank_lightning.models.pretrained.load_pretrained`.
    """
    model = MLP(
        input_shape=input_shape,
        num_classes=num_classes,
        depth=depth,
        width=width,
        activation=activation,
        batch_norm=batch_norm,
        residual_gamma=residual_gamma,
        bias=bias,
    )
    return initialise_backbone(model, init=init, pretrained=pretrained, strict=strict)
