"""The one interface every backbone offers, and the registry that creates backbones by name."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from rank_lightning.validation import check_non_negative_int, check_positive_int

_REGISTRY: dict[str, Callable[..., Backbone]] = {}


def check_image_sizes(num_classes: int, in_channels: int, image_size: int) -> None:
    """The sizes every image backbone is built from: ``num_classes >= 0`` (0: no head), ``in_channels`` and
    ``image_size`` at least 1.

    Raises:
        ValueError: a size that is not such an integer, naming it.
    """
    check_non_negative_int("num_classes", num_classes)
    check_positive_int("in_channels", in_channels)
    check_positive_int("image_size", image_size)


class Backbone(nn.Module):
    """Base class of the backbones: features, head and named blocks.

    Subclasses set ``num_classes``, ``num_features``, ``input_shape`` and ``head_path`` and implement
    ``forward_features``, ``forward_head`` and ``blocks``.

    Attributes:
        num_classes: Width of the head's output; 0 when the backbone was built without a head (the head is then
            ``nn.Identity`` and ``forward`` returns the features).
        num_features: Width of ``forward_features``' output.
        input_shape: Shape of one input sample the backbone was built for, ``(C, H, W)`` or ``(d,)``.
        head_path: Dotted submodule path of the head; checkpoint tensors under it are dropped when their shape does
            not fit (for example an ImageNet head loaded into a 10-class model).
    """

    num_classes: int
    num_features: int
    input_shape: tuple[int, ...]
    head_path: str

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:  # (B, ...) -> (B, num_features)
        """Everything before the head: ``(B, *input_shape)`` inputs to ``(B, num_features)`` features."""
        raise NotImplementedError(f"{type(self).__name__} must implement forward_features")

    def forward_head(self, features: torch.Tensor) -> torch.Tensor:  # (B, num_features) -> (B, num_classes)
        """The classification head: ``(B, num_features)`` features to ``(B, num_classes)`` logits."""
        raise NotImplementedError(f"{type(self).__name__} must implement forward_head")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))

    def blocks(self) -> dict[str, str]:
        """Ordered map ``short name -> dotted submodule path`` of the layers monitored by default.

        Ordered by depth; the last entry is the layer whose output feeds the head.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement blocks")


def register_model(name: str) -> Callable[[Callable[..., Backbone]], Callable[..., Backbone]]:
    """Decorator adding a backbone factory to the registry under ``name``."""

    def wrap(factory: Callable[..., Backbone]) -> Callable[..., Backbone]:
        if name in _REGISTRY:
            raise ValueError(f"model {name!r} is registered twice")
        _REGISTRY[name] = factory
        return factory

    return wrap


def list_models() -> list[str]:
    """Names accepted by :func:`create_model`, sorted."""
    return sorted(_REGISTRY)


def get_model_factory(name: str) -> Callable[..., Backbone]:
    """The factory registered as ``name`` (its signature lists the model's arguments)."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown model {name!r}; models are: {', '.join(list_models())}")
    return _REGISTRY[name]


def create_model(name: str, **kwargs: Any) -> Backbone:
    """Create the backbone registered as ``name`` with the factory's keyword arguments.

    Raises:
        ValueError: For an unknown model name, or an argument the model's factory does not take (the message lists
            the valid ones).
    """
    factory = get_model_factory(name)
    parameters = inspect.signature(factory).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        unknown = sorted(set(kwargs) - set(parameters))
        if unknown:
            raise ValueError(
                f"unknown argument(s) {', '.join(map(repr, unknown))} for model {name!r}; "
                f"arguments are: {', '.join(parameters)}"
            )
    return factory(**kwargs)
