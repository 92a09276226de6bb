"""Choosing which layers a callback watches: by block name, exact module name, glob pattern or module type.

Shared by every rank callback so that one selection syntax works everywhere:

* a block name from ``pl_module.blocks()`` (the package's LightningModules: ``"layer3"``, ``"pool"``);
* an exact name from ``named_modules()`` (``"backbone.layer3"``);
* a glob pattern matched with ``fnmatch`` against block names and module names (``"layer*"``,
  ``"backbone.layer*"``, ``"*.relu"``);
* module types: classes (``nn.Conv2d``), class names (``"Conv2d"``, matched against the class and its bases) or
  dotted import paths (``"torch.nn.Linear"``).
"""

from __future__ import annotations

import fnmatch
import importlib
from collections.abc import Mapping, Sequence

from torch import nn

__all__ = ["GLOB_CHARACTERS", "check_layer_types", "match_layer_names", "match_layer_types", "module_blocks"]

GLOB_CHARACTERS = frozenset("*?[")


def module_blocks(module: nn.Module) -> dict[str, str] | None:
    """``module.blocks()`` (short name -> module path) when the module offers it and every path resolves.

    Models from elsewhere often have a ``blocks`` attribute of another kind (timm's ViT: an ``nn.Sequential`` of
    transformer blocks); anything that is not a method returning such a mapping gives ``None``.
    """
    blocks = getattr(module, "blocks", None)
    if not callable(blocks) or isinstance(blocks, nn.Module):
        return None
    try:
        mapping = dict(blocks())
    except (TypeError, ValueError, NotImplementedError, AttributeError):
        return None
    names = dict(module.named_modules())
    if not mapping or not all(isinstance(path, str) and path in names for path in mapping.values()):
        return None
    return mapping


def _resolve_type(name: str) -> type[nn.Module]:
    module_path, _, class_name = name.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_path), class_name)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"layer type {name!r} cannot be imported ({error})") from error
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise ValueError(f"layer type {name!r} is not a torch.nn.Module subclass")
    return cls


def check_layer_types(layer_types: Sequence[type[nn.Module] | str] | type | str) -> list[type[nn.Module] | str]:
    """Validate a ``layer_types`` setting; dotted paths are imported, bare class names kept as strings."""
    checked: list[type[nn.Module] | str] = []
    for entry in [layer_types] if isinstance(layer_types, (str, type)) else layer_types:
        if isinstance(entry, type) and issubclass(entry, nn.Module):
            checked.append(entry)
        elif isinstance(entry, str) and "." in entry:
            checked.append(_resolve_type(entry))
        elif isinstance(entry, str) and entry:
            checked.append(entry)
        else:
            raise ValueError(f"layer_types entries must be nn.Module classes or class names, got {entry!r}")
    if not checked:
        raise ValueError("layer_types must be None or a non-empty list")
    return checked


def _type_name(wanted: type[nn.Module] | str) -> str:
    return wanted if isinstance(wanted, str) else wanted.__name__


def _is_of_type(module: nn.Module, wanted: type[nn.Module] | str) -> bool:
    if isinstance(wanted, str):
        return any(cls.__name__ == wanted for cls in type(module).__mro__)
    return isinstance(module, wanted)


def match_layer_names(
    module: nn.Module,
    patterns: Sequence[str],
    candidates: Mapping[str, nn.Module],
    *,
    blocks: Mapping[str, str] | None = None,
    expand_containers: bool = True,
    kind: str = "layer",
) -> list[str]:
    """Module names of ``candidates`` selected by ``patterns``, in ``candidates``' order.

    Args:
        module: the model the names refer to.
        patterns: block names, exact module names or glob patterns (matched against block names and candidates).
        candidates: ``name -> module`` of the layers that may be chosen (in depth order).
        blocks: ``short name -> module path`` accepted as aliases; an alias gives its path as it is, candidate or not
            (a caller that watches leaf layers expands a block's container itself).
        expand_containers: an exact name of a container that is not itself a candidate selects the candidates inside
            it (``"backbone.layer1"`` -> every Conv in it); otherwise the name must be a candidate.
        kind: word used in error messages ("layer", "weight layer").

    Raises:
        ValueError: a pattern that matches nothing; the message lists the valid names.
    """
    all_modules = dict(module.named_modules())
    blocks = blocks or {}
    valid = [*blocks, *(name for name in candidates if name not in blocks)]
    selected: set[str] = set()
    for pattern in patterns:
        if pattern in blocks:
            matches = [blocks[pattern]]
        elif GLOB_CHARACTERS & set(pattern):
            matches = [blocks[name] for name in fnmatch.filter(blocks, pattern)] + fnmatch.filter(candidates, pattern)
        elif pattern in candidates:
            matches = [pattern]
        elif expand_containers and pattern in all_modules:
            matches = [name for name in candidates if name.startswith(pattern + ".")]
        else:
            raise ValueError(f"unknown {kind} {pattern!r}; {kind}s are: {', '.join(valid)}")
        if not matches:
            raise ValueError(
                f"{kind} {pattern!r} matches nothing that can be monitored; {kind}s are: {', '.join(valid)}"
            )
        selected.update(matches)
    order = {name: i for i, name in enumerate(all_modules)}
    return sorted(selected, key=order.__getitem__)


def match_layer_types(
    names: Sequence[str], modules: Mapping[str, nn.Module], layer_types: Sequence[type[nn.Module] | str]
) -> list[str]:
    """The entries of ``names`` whose module is an instance of one of ``layer_types``.

    Raises:
        ValueError: when no entry matches; the message lists the types present.
    """
    kept = [name for name in names if any(_is_of_type(modules[name], t) for t in layer_types)]
    if not kept:
        present = sorted({type(modules[name]).__name__ for name in names})
        wanted = [_type_name(t) for t in layer_types]
        raise ValueError(
            f"layer_types {wanted} match none of the selected layers; their types are: {', '.join(present)}"
        )
    return kept
