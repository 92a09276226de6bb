"""Pretrained weights for the backbones: torchvision's named weights or a local ``state_dict`` file."""

from __future__ import annotations

import pickle
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import TypeVar

import torch
import torchvision

from rank_lightning.models.base import Backbone
from rank_lightning.models.initialization import init_weights
from rank_lightning.validation import SetupError

# Prefix of the backbone's tensors in the checkpoints of this package's LightningModules (they keep it as
# ``self.backbone``).
_MODULE_PREFIX = "backbone."

BackboneT = TypeVar("BackboneT", bound=Backbone)


def load_pretrained(
    model: Backbone, pretrained: str, *, strict: bool = True, torchvision_arch: str | None = None
) -> Backbone:
    """Load pretrained weights into ``model`` in place.

    Args:
        model: The backbone to fill.
        pretrained: Either the name of torchvision weights for ``torchvision_arch`` (``"IMAGENET1K_V1"``,
            ``"DEFAULT"``, or the full ``"ResNet18_Weights.IMAGENET1K_V1"``), fetched through torchvision's download
            cache, or the path of a file saved with ``torch.save(model.state_dict(), path)``. A Lightning checkpoint
            of this package's modules also works: its ``state_dict`` entry is used and the ``backbone.`` prefix
            removed.
        strict: Raise when the checkpoint misses tensors of the model, has tensors the model lacks, or has tensors
            of another shape. With ``strict=False`` only the fitting tensors are loaded and the rest is reported in a
            warning. Either way, a head of another shape (an ImageNet head for a 10-class model) is dropped with a
            warning and keeps its initialisation.
        torchvision_arch: torchvision's name of the architecture (``"resnet18"``) whose named weights ``pretrained``
            may refer to; ``None`` when torchvision has none for this backbone.

    Returns:
        ``model`` itself.

    Raises:
        FileNotFoundError: When ``pretrained`` is neither a weights name nor an existing file.
        SetupError: (a ``RuntimeError``) When named weights cannot be downloaded (the message says which file to fetch
            by hand), or, with ``strict=True``, when the checkpoint does not fit the model.
        ValueError: When the file holds no ``state_dict``.
    """
    weights_enum = torchvision.models.get_model_weights(torchvision_arch) if torchvision_arch else None
    name = pretrained
    if weights_enum is not None and name.startswith(f"{weights_enum.__name__}."):
        name = name[len(weights_enum.__name__) + 1 :]
    if weights_enum is not None and name in weights_enum.__members__:
        weights = weights_enum[name]
        state_dict = _download(weights)
        source = repr(weights)
    else:
        path = Path(pretrained).expanduser()
        if not path.is_file():
            names = ", ".join(weights_enum.__members__) if weights_enum is not None else "none for this model"
            raise FileNotFoundError(
                f"pretrained {pretrained!r} is neither an existing file nor a torchvision weights name "
                f"(torchvision weights: {names})"
            )
        state_dict = read_state_dict(path)
        source = str(path)
    load_checked_state_dict(model, state_dict, strict=strict, source=source)
    return model


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Read a ``state_dict`` saved with ``torch.save`` (tensors only: loaded with ``weights_only=True``).

    A mapping with a ``state_dict`` entry (a Lightning checkpoint) yields that entry.
    """
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise ValueError(
            f"{path} holds objects other than tensors and cannot be read safely; save the weights with "
            f"torch.save(model.state_dict(), path) ({err})"
        ) from err
    if isinstance(loaded, Mapping) and isinstance(loaded.get("state_dict"), Mapping):
        loaded = loaded["state_dict"]
    if not isinstance(loaded, Mapping) or not all(isinstance(v, torch.Tensor) for v in loaded.values()):
        raise ValueError(f"{path} does not hold a state_dict (a mapping from parameter names to tensors)")
    return dict(loaded)


def load_checked_state_dict(
    model: Backbone, state_dict: Mapping[str, torch.Tensor], *, strict: bool = True, source: str = "checkpoint"
) -> None:
    """Copy ``state_dict`` into ``model``, dropping a head that does not fit; see :func:`load_pretrained`."""
    own = model.state_dict()
    if not own.keys() & state_dict.keys() and any(k.startswith(_MODULE_PREFIX) for k in state_dict):
        state_dict = {k[len(_MODULE_PREFIX) :]: v for k, v in state_dict.items() if k.startswith(_MODULE_PREFIX)}

    head = f"{model.head_path}."
    head_fits = all(k in own and own[k].shape == v.shape for k, v in state_dict.items() if k.startswith(head))
    dropped_head = [] if head_fits else sorted(k for k in state_dict if k.startswith(head))
    body = {k: v for k, v in state_dict.items() if k not in dropped_head}

    mismatched = sorted(k for k, v in body.items() if k in own and own[k].shape != v.shape)
    unexpected = sorted(k for k in body if k not in own)
    missing = sorted(k for k in own if k not in body and (head_fits or not k.startswith(head)))
    problems = [
        f"{label}: {', '.join(keys)}"
        for label, keys in (
            ("missing", missing),
            ("unexpected", unexpected),
            ("shape mismatch", [f"{k} {tuple(body[k].shape)} vs {tuple(own[k].shape)}" for k in mismatched]),
        )
        if keys
    ]
    if problems and strict:
        raise SetupError(
            f"{source} does not fit {type(model).__name__} ({'; '.join(problems)}); "
            "pass strict=False to load the fitting tensors only"
        )
    if dropped_head:
        shapes = ", ".join(f"{k} {tuple(state_dict[k].shape)}" for k in dropped_head)
        warnings.warn(
            f"the head of {source} ({shapes}) does not fit num_classes={model.num_classes}; it is not loaded and "
            "the head keeps its initialisation",
            stacklevel=3,
        )
    if problems:
        warnings.warn(f"loading {source} with strict=False skipped tensors ({'; '.join(problems)})", stacklevel=3)
    model.load_state_dict({k: v for k, v in body.items() if k in own and k not in mismatched}, strict=False)


def _download(weights: torchvision.models.WeightsEnum) -> dict[str, torch.Tensor]:
    try:
        return weights.get_state_dict(progress=False, check_hash=True)
    except OSError as err:
        cache = Path(torch.hub.get_dir()) / "checkpoints"
        raise SetupError(
            f"could not download {weights!r} from {weights.url} ({err}). Without internet access, download that "
            f"file on another machine and pass its path as pretrained='/path/to/{Path(weights.url).name}', or put "
            f"it in {cache}"
        ) from err


def initialise_backbone(
    model: BackboneT,
    *,
    init: str | None = None,
    pretrained: str | None = None,
    strict: bool = True,
    torchvision_arch: str | None = None,
) -> BackboneT:
    """Apply the factories' shared ``init`` and ``pretrained`` arguments: the scheme first, then the weights.

    A head dropped from the checkpoint therefore keeps the ``init`` scheme.
    """
    if init is not None:
        init_weights(model, init)
    if pretrained is not None:
        load_pretrained(model, pretrained, strict=strict, torchvision_arch=torchvision_arch)
    return model
