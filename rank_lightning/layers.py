"""Choosing and reading the layers of a model: one selection syntax, hook context, eval switch and batch reader.

Every callback that hooks or reads a model goes through this module, so they all accept the same layer syntax:

* a block name from ``module.blocks()`` (the package's LightningModules: ``"layer3"``, ``"pool"``);
* an exact name from ``named_modules()`` (``"backbone.layer3"``);
* a glob pattern matched with ``fnmatch`` against block names and module names (``"layer*"``, ``"*.relu"``), whose
  ``*`` and ``?`` match dots too: ``"encoder.block.*"`` is every block and every module inside them (for the blocks
  alone, match the index, ``"encoder.block.?"`` for blocks 0 to 9, or name the blocks' class in ``layer_types``);
* module types (``layer_types``): classes (``nn.Conv2d``), class names (``"Conv2d"``, matched against the class and
  its bases) or dotted import paths (``"torch.nn.Linear"``); an adapter layer of ``peft`` (LoRA) is also of the
  type of the layer it wraps.

An unknown name raises ``ValueError`` listing the valid names (block names first, then module names). When no layer is
named, :func:`default_layers` finds the repeated blocks of a model (or its hidden activations).

The rest reads what the chosen layers compute: :func:`forward_hooks` registers hooks and always removes them,
:func:`hidden_state` picks the hidden-state tensor out of what a block returns (tensor, tuple, dict or
``ModelOutput``), :func:`capture_features` keeps the latest features of some layers, :func:`eval_mode` /
:func:`train_mode` switch a model and restore every submodule's own flag, and :class:`BatchReader` finds the inputs,
labels and attention mask of a batch.
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import importlib
import inspect
import random
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any, Literal, cast

import numpy as np
import torch
from torch import Tensor, nn

from rank_lightning.validation import check_names

__all__ = [
    "ACTIVATION_TYPES",
    "DECODER_MASK_KEY",
    "GLOB_CHARACTERS",
    "HIDDEN_STATE_KEYS",
    "INPUT_KEYS",
    "LABEL_FORMS",
    "LABEL_KEYS",
    "MASK_KEY",
    "BatchReader",
    "FeatureLayer",
    "LayerType",
    "OutputSelector",
    "batch_first_when_ambiguous",
    "buffers_kept",
    "capture_features",
    "channel_first_layers",
    "channels_last_layers",
    "check_layer_types",
    "check_output_selector",
    "class_labels",
    "classifier_head",
    "compiled_code_eager",
    "compiled_modules",
    "declared_batch_first",
    "decoder_layers",
    "default_layers",
    "eval_mode",
    "expert_layers",
    "feature_layer",
    "forward_batch",
    "forward_hooks",
    "frozen_copies",
    "hidden_state",
    "match_layer_names",
    "match_layer_types",
    "measuring_without_grad",
    "module_blocks",
    "random_state_kept",
    "select_layers",
    "token_layouts",
    "train_mode",
    "unapplied_copies",
    "unmasked_layers",
]

GLOB_CHARACTERS = frozenset("*?[")
LABEL_KEYS: tuple[str, ...] = ("y", "label", "labels", "target", "targets")
"""Keys tried, in order, for the labels of a dict batch when no ``label_key`` is given."""
INPUT_KEYS: tuple[str, ...] = ("x", "input", "inputs", "image", "images", "pixel_values", "input_ids")
"""Keys tried, in order, for the inputs of a dict batch when no ``input_key`` is given."""
MASK_KEY = "attention_mask"
"""Key of the ``(B, T)`` attention mask in a dict batch when no ``mask_key`` is given (Hugging Face's name)."""
DECODER_MASK_KEY = "decoder_attention_mask"
"""Key of the ``(B, T')`` mask of an encoder-decoder's target tokens in a dict batch (Hugging Face's name), read for the
layers in the decoder (:func:`decoder_layers`) when the mask is looked up by default (``mask_key`` ``None`` or
``"attention_mask"``)."""
HIDDEN_STATE_KEYS: tuple[str, ...] = ("last_hidden_state", "hidden_states")
"""Fields tried, in order, for the hidden states of a dict, ``ModelOutput`` or dataclass output (see
:func:`hidden_state`)."""

# Activation modules whose outputs are the hidden representations of a foreign model.
ACTIVATION_TYPES: tuple[type[nn.Module], ...] = (
    nn.ReLU,
    nn.ReLU6,
    nn.LeakyReLU,
    nn.PReLU,
    nn.ELU,
    nn.SELU,
    nn.CELU,
    nn.GELU,
    nn.SiLU,
    nn.Mish,
    nn.Tanh,
    nn.Sigmoid,
    nn.Softplus,
    nn.Hardswish,
    nn.Hardtanh,
)

LayerType = type[nn.Module] | str

_PLAIN_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


# -- selection -------------------------------------------------------------------------------------------------------


def _parameter_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _has_children(module: nn.Module) -> bool:
    return any(True for _ in module.children())


def _wrapped_networks(module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``(path prefix, module)`` for ``module`` and each network it wraps, outermost first.

    A wrapper holds all its parameters in one child that has children of its own (``LightningModule -> self.net``).
    """
    prefix, current = "", module
    total = _parameter_count(module)
    while True:
        yield prefix, current
        heavy = [(name, child) for name, child in current.named_children() if _parameter_count(child) == total]
        if len(heavy) != 1 or not _has_children(heavy[0][1]):
            return
        name, current = heavy[0]
        prefix = f"{prefix}{name}."


def _own_blocks(module: nn.Module) -> dict[str, str] | None:
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


def module_blocks(module: nn.Module) -> dict[str, str] | None:
    """``blocks()`` (short name -> module path) of the module, or of the network it wraps; ``None`` without one.

    A wrapper holds all its parameters in one child (a user's LightningModule with a package backbone in
    ``self.net``): the backbone's blocks are returned with their paths prefixed (``"net.layer3"``), so block names
    select layers on the wrapper too. Models from elsewhere often have a ``blocks`` attribute of another kind (timm's
    ViT: an ``nn.Sequential`` of transformer blocks); anything that is not a method returning a mapping whose paths
    all resolve is ignored.
    """
    for prefix, network in _wrapped_networks(module):
        blocks = _own_blocks(network)
        if blocks is not None:
            return {name: prefix + path for name, path in blocks.items()}
    return None


def _resolve_type(name: str) -> type[nn.Module]:
    module_path, _, class_name = name.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_path), class_name)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"layer type {name!r} cannot be imported ({error})") from error
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise ValueError(f"layer type {name!r} is not a torch.nn.Module subclass")
    return cls


def check_layer_types(layer_types: Sequence[LayerType] | LayerType) -> list[LayerType]:
    """Validate a ``layer_types`` setting; dotted paths are imported, bare class names kept as strings."""
    checked: list[LayerType] = []
    if not isinstance(layer_types, (str, type, Sequence)):
        raise ValueError(
            f"layer_types must be None, an nn.Module class, a class name or a list of them, got {layer_types!r}"
        )
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


def _type_name(wanted: LayerType) -> str:
    return wanted if isinstance(wanted, str) else wanted.__name__


def _adapter_base_layer(module: nn.Module) -> nn.Module | None:
    """The layer that an adapter layer of ``peft`` (a ``BaseTunerLayer``: LoRA, ...) wraps as its ``base_layer``;
    ``None`` for other modules. Recognised by class name and defining package, so ``peft`` is never imported here."""
    classes = type(module).__mro__
    if not any(cls.__name__ == "BaseTunerLayer" and cls.__module__.split(".")[0] == "peft" for cls in classes):
        return None
    base = module
    while isinstance(getattr(base, "base_layer", None), nn.Module):
        base = base.base_layer
    return base if base is not module else None


def _is_modules_to_save_wrapper(module: nn.Module) -> bool:
    return any(
        cls.__name__ == "ModulesToSaveWrapper" and cls.__module__.split(".")[0] == "peft"
        for cls in type(module).__mro__
    )


def unapplied_copies(module: nn.Module) -> set[str]:
    """Paths of the layers that a ``peft`` ``ModulesToSaveWrapper`` holds but its forward pass does not apply.

    ``peft`` trains a layer named in ``modules_to_save`` (a classifier head, which it adds by itself for sequence
    classification) as a copy per adapter, ``<layer>.modules_to_save.<adapter>``, beside the frozen
    ``<layer>.original_module``. The forward pass applies the first active adapter's copy, or the original where
    adapters are disabled or none of them has a copy here. The others are never applied, so no monitor chooses them:
    a frozen original would give a flat weight curve, and a hook on it would never fire. The layer applied is chosen
    under its path. Recognised by class name and defining package (``peft`` is never imported here); a wrapper
    whose attributes differ from these gives nothing.
    """
    unapplied: set[str] = set()
    for name, layer in module.named_modules():
        if not _is_modules_to_save_wrapper(layer):
            continue
        try:
            copies = dict(layer.modules_to_save.items())
            # peft 0.14's wrapper names its one active adapter in ``active_adapter`` only.
            active = getattr(layer, "active_adapters", None)
            active = layer.active_adapter if active is None else active
            active = [active] if isinstance(active, str) else list(active)
            passthrough = bool(layer.disable_adapters) or not active or any(a not in copies for a in active)
        except (AttributeError, TypeError):
            continue
        applied = "original_module" if passthrough else f"modules_to_save.{active[0]}"
        held = ["original_module", *(f"modules_to_save.{adapter}" for adapter in copies)]
        unapplied.update(f"{name}.{path}" if name else path for path in held if path != applied)
    return unapplied


def _at_or_inside(name: str, roots: set[str]) -> bool:
    """Whether the module at ``name`` is one of ``roots`` or lies inside one."""
    parts = name.split(".")
    return bool(roots) and any(".".join(parts[:i]) in roots for i in range(1, len(parts) + 1))


def _is_of_type(module: nn.Module, wanted: LayerType) -> bool:
    """Whether ``module`` is of type ``wanted``, or wraps a layer of that type as a ``peft`` adapter layer does (a
    LoRA-adapted ``nn.Linear`` is a Linear)."""
    base = _adapter_base_layer(module)
    if base is not None and _is_of_type(base, wanted):
        return True
    if isinstance(wanted, str):
        return any(cls.__name__ == wanted for cls in type(module).__mro__)
    return isinstance(module, wanted)


WRAPPER_SEGMENTS = ("_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module")
"""Path segments that wrappers insert between a model and its layers: ``torch.compile``'s ``OptimizedModule``, FSDP and
activation checkpointing. Layers are named without them, so that a compiled or sharded run logs the keys of the eager,
unsharded one and takes its layer names."""


def eager_name(path: str) -> str:
    """``path`` without :data:`WRAPPER_SEGMENTS` (``net._orig_mod.layers.0`` -> ``net.layers.0``)."""
    if not any(segment in path for segment in WRAPPER_SEGMENTS):
        return path
    return ".".join(part for part in path.split(".") if part not in WRAPPER_SEGMENTS)


def _by_name(paths: Iterable[str], pattern: str) -> dict[str, str]:
    """``name -> path`` of ``paths`` in the form ``pattern`` uses: their paths when it names a wrapper segment, else
    their eager names (a wrapper and the module it wraps share one; the wrapped module, the later path, wins)."""
    if any(segment in pattern for segment in WRAPPER_SEGMENTS):
        return {path: path for path in paths}
    return {eager_name(path): path for path in paths}


NAMES_SHOWN = 40
"""How many names an error message lists in full; a longer list is cut to the closest and the top-level names."""


def describe_names(kind: str, names: Sequence[str], pattern: str | None = None) -> str:
    """``"<kind>s are: a, b, c"`` for an error message, bounded on a large model.

    Up to :data:`NAMES_SHOWN` names are all listed. Beyond that the message gives the names closest to ``pattern``
    (:func:`difflib.get_close_matches`), the names at the top levels (the :data:`NAMES_SHOWN` shallowest, level by
    level, in model order) and ``"... and N more"``.
    """
    names = list(dict.fromkeys(names))
    if len(names) <= NAMES_SHOWN:
        return f"{kind}s are: {', '.join(names)}"
    # The shallowest names first, filling the list level by level; shown in model order.
    shallow = set(sorted(names, key=lambda name: name.count("."))[:NAMES_SHOWN])
    top = [name for name in names if name in shallow]
    close = difflib.get_close_matches(pattern, names, n=5, cutoff=0.6) if pattern else []
    closest = f"the closest {kind}s are: {', '.join(close)}; " if close else ""
    more = len(names) - len(top)
    return f"{closest}{kind}s at the top levels are: {', '.join(top)} ... and {more} more"


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

    Names leave out :data:`WRAPPER_SEGMENTS` (``net.layers.0`` for ``net._orig_mod.layers.0``), as the layers are
    logged, unless they name one themselves.

    Args:
        module: the model the names refer to.
        patterns: block names, exact module names or glob patterns (matched against block names and candidates).
        candidates: ``name -> module`` of the layers that may be chosen (in depth order).
        blocks: ``short name -> module path`` accepted as aliases; an alias gives its path as it is, candidate or not
            (a caller that watches leaf layers expands a block's container itself).
        expand_containers: an exact name or a glob naming a container that is not itself a candidate selects the
            candidates inside it (``"backbone.layer1"`` -> every Conv in it); otherwise the name must be a candidate.
        kind: word used in error messages ("layer", "weight layer").

    Raises:
        ValueError: a pattern that matches nothing; the message lists the valid names (see :func:`describe_names`).
    """
    all_modules = dict(module.named_modules())
    blocks = blocks or {}
    valid = list(dict.fromkeys([*blocks, *(eager_name(name) for name in candidates if name not in blocks)]))
    selected: set[str] = set()
    for pattern in patterns:
        named_candidates, named_modules = _by_name(candidates, pattern), _by_name(all_modules, pattern)
        if pattern in blocks:
            matches = [blocks[pattern]]
        elif GLOB_CHARACTERS & set(pattern):
            matches = [blocks[name] for name in fnmatch.filter(blocks, pattern)]
            matches += [named_candidates[name] for name in fnmatch.filter(named_candidates, pattern)]
            if expand_containers:
                # A glob that names containers selects the candidates inside them, as an exact container name does.
                named = [named_modules[name] for name in fnmatch.filter(named_modules, pattern)]
                containers = [name for name in named if name and name not in candidates]
                matches += [name for name in candidates if any(name.startswith(c + ".") for c in containers)]
        elif pattern in named_candidates:
            matches = [named_candidates[pattern]]
        elif expand_containers and pattern in named_modules:
            matches = [name for name in candidates if name.startswith(named_modules[pattern] + ".")]
        else:
            raise ValueError(f"unknown {kind} {pattern!r}; {describe_names(kind, valid, pattern)}")
        if not matches:
            raise ValueError(
                f"{kind} {pattern!r} matches nothing that can be monitored; {describe_names(kind, valid, pattern)}"
            )
        selected.update(matches)
    order = {name: i for i, name in enumerate(all_modules)}
    return sorted(selected, key=order.__getitem__)


def match_layer_types(
    names: Sequence[str], modules: Mapping[str, nn.Module], layer_types: Sequence[LayerType]
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


_STACK = "stack"


def _kind(module: nn.Module, *, stacks: bool = False) -> Any:
    # Plain containers are told apart by what they hold: torchvision VGG's ``features`` and ``classifier`` are both
    # nn.Sequential, ResNet's ``layer1`` .. ``layer4`` are nn.Sequentials of the same residual block.
    if isinstance(module, _PLAIN_CONTAINERS):
        return type(module), frozenset(type(child) for child in module.children())
    if stacks and _stack_blocks(module) is not None:
        return _STACK  # an encoder and a decoder are blocks of one kind, whatever their classes (BART's)
    return type(module)


def _never_called(module: nn.Module) -> bool:
    # nn.ModuleList and nn.ModuleDict have no forward: their children are called, never they themselves.
    return type(module).forward is nn.Module.forward


def _routed_experts(path: str, container: nn.Module) -> bool:
    """Whether ``container`` (at ``path``) holds the routed experts of a mixture-of-experts layer: a ``ModuleList`` or
    ``ModuleDict`` held as ``experts`` (Switch Transformers' ``experts.expert_<e>``, the ``experts.<e>`` of
    ``transformers`` 4.x Mixtral and Qwen-MoE blocks), whose members are called on the tokens routed to them."""
    return path.rpartition(".")[2] == "experts" and isinstance(container, (nn.ModuleList, nn.ModuleDict))


def _block_runs(container: nn.Module, *, stacks: bool = False) -> list[list[str]]:
    """Runs of the container's children that repeat: >= 2 parameterised children with children, of the same kind.

    Children that are never called (a ModuleList, a ModuleDict) cannot be blocks; each run keeps the children's order.
    With ``stacks``, the children that are stacks (:func:`_stack_blocks`) are of one kind whatever their classes.
    """
    runs: dict[Any, list[str]] = {}
    for name, child in container.named_children():
        # A block wrapped alone (``blocks[0] = torch.compile(blocks[0])``, activation checkpointing of some blocks)
        # is of the kind of the block it wraps; the wrapper's path is the block's.
        inner = _unwrapped(child)
        if _has_children(inner) and _parameter_count(inner) > 0 and not _never_called(inner):
            runs.setdefault(_kind(inner, stacks=stacks), []).append(name)
    return [names for names in runs.values() if len(names) >= 2]


def _unwrapped(module: nn.Module) -> nn.Module:
    """The module that wrappers (:data:`WRAPPER_SEGMENTS`: ``torch.compile``'s ``OptimizedModule``, FSDP, activation
    checkpointing) hold, through any nesting of them; ``module`` itself when it is no wrapper."""
    while len(module._modules) == 1:
        name, inner = next(iter(module._modules.items()))
        if name not in WRAPPER_SEGMENTS or inner is None:
            break
        module = inner
    return module


def _weight_layers(module: nn.Module) -> list[str]:
    """Paths of the submodules owning a weight matrix or kernel (a parameter of >= 2 dimensions), in module order.

    ``nn.MultiheadAttention`` counts as one layer: it applies its ``out_proj`` weights without calling the module.
    """
    attention = [f"{path}." for path, m in module.named_modules() if isinstance(m, nn.MultiheadAttention)]
    return [
        path
        for path, m in module.named_modules()
        if path
        and any(p.ndim >= 2 for p in m.parameters(recurse=False))
        and not any(path.startswith(inside) for inside in attention)
    ]


def _repeated_blocks(
    module: nn.Module, weights: Sequence[str], *, stacks: bool = False, leave_out: tuple[str, ...] = ()
) -> list[str]:
    """The repeated blocks holding the most weight layers, if they hold at least half of them; else nothing.

    One run of blocks of one kind is looked for first (ties: the deepest container, then the first); when no run
    holds half of the weight layers, the runs of one container together (Inception: blocks of several classes).
    ``stacks``: stacks side by side are blocks of one kind (:func:`_block_runs`). ``leave_out``: path prefixes
    (ending in ``.``) of modules that are no blocks, nor hold any. Routed experts (:func:`_routed_experts`) are no
    blocks: each sees only the tokens routed to it, and a layer holding them is no stack.
    """
    single: list[list[str]] = []
    together: list[list[str]] = []
    for path, container in module.named_modules():
        if _routed_experts(path, container):
            continue
        prefix = f"{path}." if path else ""
        runs = _block_runs(container, stacks=stacks)
        if leave_out:
            runs = [
                kept
                for run in runs
                if len(kept := [n for n in run if not (prefix + n + ".").startswith(leave_out)]) >= 2
            ]
        members = {name for run in runs for name in run}
        single += [[prefix + name for name in run] for run in runs]
        together += [[prefix + name for name, _ in container.named_children() if name in members]] if runs else []
    for candidates in (single, together):
        best: tuple[int, int] = (0, -1)
        chosen: list[str] = []
        for blocks in candidates:
            held = sum(any(w == b or w.startswith(f"{b}.") for b in blocks) for w in weights)
            rank = (held, blocks[0].count("."))
            if held > 0 and 2 * held >= len(weights) and rank > best:
                best, chosen = rank, blocks
        if chosen:
            return chosen
    return []


def frozen_copies(module: nn.Module) -> list[str]:
    """Paths of the submodules that are frozen copies of a sibling: of its class, with the same parameter names and
    shapes, every parameter with ``requires_grad=False`` while the sibling has trainable ones. The momentum (EMA)
    target network of BYOL and MoCo and DINO's teacher (a ``copy.deepcopy`` of the online network, updated outside
    the optimizer) are such copies; :func:`default_layers` leaves them out. The children of a plain container
    (``nn.Sequential``, ``nn.ModuleList``, ``nn.ModuleDict``) are never copies: frozen blocks of a stack (the first
    layers of a model fine-tuned with them frozen) are part of its forward pass."""
    found: list[str] = []
    for path, container in module.named_modules():
        if isinstance(container, _PLAIN_CONTAINERS):
            continue
        children = [(name, child) for name, child in container.named_children() if _parameter_count(child) > 0]
        frozen = [(name, child) for name, child in children if not any(p.requires_grad for p in child.parameters())]
        for name, child in frozen:
            # Seen through wrappers: a copy made before torch.compile wrapped one of the pair is a copy still.
            kind, shapes = type(_unwrapped(child)), _parameter_shapes(child)
            if any(
                type(_unwrapped(other)) is kind
                and any(p.requires_grad for p in other.parameters())
                and _parameter_shapes(other) == shapes
                for _, other in children
            ):
                found.append(f"{path}.{name}" if path else name)
    return found


def _parameter_shapes(module: nn.Module) -> list[tuple[str, torch.Size]]:
    """``(name, shape)`` of the parameters of ``module``, named without :data:`WRAPPER_SEGMENTS`."""
    return [(eager_name(key), p.shape) for key, p in module.named_parameters()]


def _stack_blocks(block: nn.Module) -> list[str] | None:
    """The repeated blocks of ``block`` (paths inside it) when it is a stack; else ``None``.

    A stack is a module that is not a plain container and whose repeated blocks, held in a container it loops over
    (a ModuleList, never called itself), hold at least half of its weight layers: an encoder, a decoder. ResNet's
    stages (``nn.Sequential``) and a block's parallel branches are no stacks.
    """
    if isinstance(block, _PLAIN_CONTAINERS):
        return None
    found = _repeated_blocks(block, _weight_layers(block))
    parents = {name.rpartition(".")[0] for name in found}
    if not found or len(parents) != 1 or not _never_called(block.get_submodule(parents.pop())):
        return None
    return found


def _stack_layers(module: nn.Module, blocks: Sequence[str]) -> list[str]:
    """The layers inside ``blocks`` when each is a stack of its own (an encoder and a decoder); else ``blocks``."""
    inner: list[str] = []
    for path in blocks:
        found = _stack_blocks(module.get_submodule(path))
        if found is None:
            return list(blocks)
        inner += [f"{path}.{name}" for name in found]
    return inner


def _looped_block(module: nn.Module, weights: Sequence[str]) -> list[str]:
    """The one block a Hugging Face model applies several times per forward pass, as a list of its path; else ``[]``.

    A never-called container (a ModuleList) of one parameterised block inside a model whose ``config`` declares more
    hidden layers (``num_hidden_layers``) than that one: ALBERT's encoder loops over its one ``AlbertLayerGroup``
    (and the one ``AlbertLayer`` inside) ``num_hidden_layers`` times. Kept when the weight layers it applies, counted
    once per application, are at least half of those the model applies; the deepest such block is chosen.
    """
    found: list[str] = []
    configs: list[tuple[str, int]] = []  # (path prefix, num_hidden_layers) of the models holding the modules seen
    for path, container in module.named_modules():
        config = getattr(container, "config", None)
        layers = getattr(config, "num_hidden_layers", None)
        if _hugging_face_model(container) and isinstance(layers, int) and not isinstance(layers, bool):
            configs.append((f"{path}." if path else "", layers))
        if not _never_called(container) or len(container._modules) != 1:
            continue
        name, child = next(iter(container.named_children()))
        block = f"{path}.{name}" if path else name
        holding = [n for prefix, n in configs if block.startswith(prefix)]
        if not holding or holding[-1] <= 1 or not _has_children(child) or _never_called(child):
            continue
        held = sum(w == block or w.startswith(f"{block}.") for w in weights)
        applied = held * holding[-1]
        if held and 2 * applied >= applied + len(weights) - held:
            found.append(block)
    return [max(found, key=lambda path: path.count("."))] if found else []  # the deepest; ties: the first


def default_layers(module: nn.Module) -> dict[str, str]:
    """The layers watched when none are named: ``short name -> module path`` (a foreign layer is named by its path).

    1. ``blocks()`` of the module, or of the network it wraps (a LightningModule holding a package backbone in
       ``self.net``; paths prefixed): the package's choice wins.
    2. Repeated blocks: the members of a run of >= 2 parameterised blocks (children with children) of one kind in
       one container, e.g. ``layer1`` .. ``layer4`` of a torchvision ResNet, ``transformer.h.<i>`` of a Hugging
       Face model, ``layers.<i>`` of an ``nn.TransformerEncoder``, the values of an ``nn.ModuleDict``. Plain
       containers (``nn.Sequential``, ``nn.ModuleList``, ``nn.ModuleDict`` and their subclasses) are of one kind
       when they hold the same module types. A module without ``forward`` (a ModuleList or ModuleDict) is never a
       block: it is never called itself, its children are. The run chosen is the one whose blocks hold the most
       weight layers (modules owning a parameter of >= 2 dimensions), ties to the deepest container, then the
       first; and only when they hold at least half of the network's weight layers. When no single run does, the
       runs of one container together are tried the same way (Inception's blocks of several classes). The routed
       experts of a mixture-of-experts layer (a ``ModuleList`` or ``ModuleDict`` held as ``experts``:
       ``transformers`` 4.x Mixtral's and Qwen-MoE's, Switch Transformers') are never blocks, nor is a layer
       holding them a stack: each expert sees only the tokens routed to it. Every block is kept, the last one too:
       a head of another type is never among them. Stacks (modules, not plain containers, whose own repeated blocks sit
       in a ModuleList they loop over and hold at least half of their weight layers: an encoder, a decoder) side by
       side in one module are blocks of one kind whatever their classes: T5's two ``T5Stack``, BART's, Marian's and
       Whisper's encoder and decoder, ``nn.Transformer``'s ``TransformerEncoder`` and ``TransformerDecoder``, the two
       towers of CLIP. When the chosen blocks are stacks, their layers are chosen instead, stack by stack in module
       order (the encoder's, then the decoder's), so that depth has more than two points.
    3. Else, the one block a weight-tied Hugging Face model applies several times per forward pass: the only block of
       a ModuleList inside a model whose ``config.num_hidden_layers`` is larger (ALBERT's shared ``AlbertLayer``),
       when the weight layers it applies, counted once per application, are at least half of the model's (the
       deepest such block). It is measured at its first call of each batch, with a warning, or at every call with
       ``repeated_calls="each"``.
    4. Else, a network of layers (an MLP, a VGG-like CNN): its hidden representations. The head is the last weight
       layer, the hidden layers are the others. The activation modules (:data:`ACTIVATION_TYPES`) anywhere in the
       network are chosen when they are at least as many as the hidden layers (``nn.Sequential(Linear, ReLU,
       Linear, ReLU, Linear)``: the two ReLUs); else the hidden layers themselves (activations applied
       functionally, or one ``self.act`` shared by every layer, which would run several times per forward).
    5. Else the children of the innermost wrapped network.

    Frozen copies are left out of every step (:func:`frozen_copies`): the momentum (EMA) target network of BYOL or
    MoCo, DINO's teacher, a ``copy.deepcopy`` of a sibling whose parameters all have ``requires_grad=False`` while the
    sibling trains. They run in ``training_step`` only, not in validation; name them to measure them
    (``layers=["target.*"]`` with ``stage="train"``).

    A layer found inside a ``torch.compile`` wrapper is named without the wrapper's ``_orig_mod`` (``net.layers.0``
    for the path ``net._orig_mod.layers.0``), so a compiled model logs the keys of the eager one.
    """
    blocks = module_blocks(module)
    if blocks is not None:
        return blocks
    copies = tuple(f"{path}." for path in frozen_copies(module))

    def kept(paths: Iterable[str]) -> list[str]:
        return [path for path in paths if not f"{path}.".startswith(copies)]

    weights = kept(_weight_layers(module))
    repeated = _repeated_blocks(module, weights, stacks=True, leave_out=copies)
    chosen = _stack_layers(module, repeated) or _looped_block(module, weights)
    if not chosen:
        hidden = weights[:-1]
        activations = kept(path for path, m in module.named_modules() if isinstance(m, ACTIVATION_TYPES))
        chosen = activations if activations and len(activations) >= len(hidden) else hidden
    if not chosen:
        prefix, network = list(_wrapped_networks(module))[-1]
        chosen = kept(prefix + name for name, _ in network.named_children())
    # A compiled network is reached through its wrapper's ``_orig_mod``; its layers keep the names they have eagerly.
    return {eager_name(path): path for path in chosen}


def _expand_to_candidates(paths: Iterable[str], candidates: Mapping[str, nn.Module], kind: str) -> list[str]:
    # A block name resolves to its container path; the candidates inside it are what is monitored.
    selected: set[str] = set()
    for path in paths:
        inside = [path] if path in candidates else [c for c in candidates if c.startswith(path + ".")]
        if not inside:
            raise ValueError(
                f"{kind} {path!r} holds nothing that can be monitored; {describe_names(kind, list(candidates), path)}"
            )
        selected.update(inside)
    return [name for name in candidates if name in selected]


def select_layers(
    module: nn.Module,
    layers: Sequence[str] | None = None,
    layer_types: Sequence[LayerType] | None = None,
    *,
    candidates: Mapping[str, nn.Module] | None = None,
    default: Callable[[nn.Module], Mapping[str, str]] = default_layers,
    leaves: bool = False,
    kind: str = "layer",
) -> dict[str, str]:
    """Resolve a layer choice against ``module``: ``logged name -> module path``, in depth order.

    Args:
        module: the model (a LightningModule or a network).
        layers: block names, module names or glob patterns (see the module docstring); ``None`` for the default.
        layer_types: keep only layers of these types (already checked by :func:`check_layer_types`); without
            ``layers``, every candidate of these types, where a ``peft`` adapter layer (LoRA) is one layer, of its
            base layer's type, and its parts are not chosen.
        candidates: ``name -> module`` of what may be chosen; ``None`` for every submodule.
        default: the choice when neither ``layers`` nor ``layer_types`` is given.
        leaves: a chosen container that is not a candidate stands for the candidates inside it (weight layers:
            ``"layer4"`` selects every Linear and Conv in it), which are then named by their module path.
        kind: word used in error messages.

    Raises:
        ValueError: a name, pattern or type that matches nothing (the message lists the valid names), or a logged
            name containing ``"/"`` (it separates the parts of a logged key).
    """
    modules = dict(module.named_modules())
    if candidates is None:
        unapplied = unapplied_copies(module)
        candidates = {
            name: m
            for name, m in modules.items()
            if name and not _inside_metric(name, modules) and not _at_or_inside(name, unapplied)
        }
    else:
        candidates = dict(candidates)
    blocks = module_blocks(module) or {}
    if layers is None and layer_types is not None:
        # A type alone asks for every layer of that type, not for the default layers that happen to have it; a peft
        # adapter layer is one layer of its base layer's type, not its parts (base_layer, lora_A, lora_B).
        adapters = {name for name, layer in modules.items() if _adapter_base_layer(layer) is not None}
        typed = [name for name in candidates if not _inside_adapter(name, adapters)]
        chosen = {eager_name(name): name for name in match_layer_types(typed, modules, layer_types)}
    elif layers is None:
        chosen = dict(default(module))
    else:
        paths = match_layer_names(module, layers, candidates, blocks=blocks, expand_containers=leaves, kind=kind)
        if leaves:
            chosen = {eager_name(path): path for path in _expand_to_candidates(paths, candidates, kind)}
        else:
            by_path = {path: name for name, path in blocks.items()}
            chosen = {by_path.get(path, eager_name(path)): path for path in paths}
        if layer_types is not None:
            kept = set(match_layer_types(list(chosen.values()), modules, layer_types))
            chosen = {name: path for name, path in chosen.items() if path in kept}
    if not chosen:
        raise ValueError(
            f"{type(module).__name__} has no {kind} to monitor by default; name them with layers=[...] "
            f"({describe_names('module name', list(candidates)) if candidates else 'module names: none'})"
        )
    for name in chosen:
        if "/" in name:
            raise ValueError(f"layer name {name!r} contains '/', which separates the parts of a logged key")
    return chosen


def _is_metric(module: nn.Module) -> bool:
    """Whether ``module`` is a torchmetrics ``Metric`` (or collection): a module of the LightningModule that holds
    running statistics, not a layer of the network (told by its classes, without importing torchmetrics)."""
    return any(
        cls.__name__ in ("Metric", "MetricCollection") and cls.__module__.startswith("torchmetrics")
        for cls in type(module).__mro__
    )


def _inside_adapter(name: str, adapters: set[str]) -> bool:
    """Whether the module at ``name`` lies inside one of the ``peft`` adapter layers at ``adapters`` (its
    ``base_layer``, ``lora_A``, ...)."""
    parts = name.split(".")
    return bool(adapters) and any(".".join(parts[:i]) in adapters for i in range(1, len(parts)))


def _inside_metric(name: str, modules: dict[str, nn.Module]) -> bool:
    """Whether the module at ``name`` is a metric or lies inside one."""
    parts = name.split(".")
    return any(
        _is_metric(modules[".".join(parts[:i])]) for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in modules
    )


# -- one layer's features --------------------------------------------------------------------------------------------


def classifier_head(module: nn.Module, head: str | None = None) -> str:
    """Module path of a classifier's head: ``head`` (the layer syntax of :func:`select_layers`, exactly one module),
    else ``backbone.<head_path>`` of a package backbone, else the module's own ``head_path``, else its last
    ``nn.Linear``. A head behind an LR-Layer (``nn.Sequential(LRLayer, head)`` from
    :func:`~rank_lightning.nn.insert_lr_layer`) is the wrapped head: the LR-Layer is an identity, so its input and
    output are the same, and its weight is the classifier's.

    Raises:
        ValueError: a ``head`` that matches no module or several (the message lists them), an ``nn.Identity`` head
            (a model without classes), or no head at all.
    """
    if head is not None:
        chosen = select_layers(module, [head], kind="head")
        if len(chosen) != 1:
            raise ValueError(f"head {head!r} matches {len(chosen)} modules ({', '.join(chosen.values())}); name one")
        path = next(iter(chosen.values()))
    else:
        path = _default_head(module)
    path = _behind_lr_layers(module, path)
    if isinstance(module.get_submodule(path), nn.Identity):
        raise ValueError(f"the head {path!r} is nn.Identity (a model without classes); name the head with head=...")
    return path


def _behind_lr_layers(module: nn.Module, path: str) -> str:
    """``path`` itself, or the path of the module that LR-Layers inserted in front of it wrap."""
    # Imported here: rank_lightning.nn imports rank_lightning.functional, which imports this module.
    from rank_lightning.nn.lr_layer import LRLayer

    inner = module.get_submodule(path)
    while isinstance(inner, nn.Sequential) and len(inner) == 2 and isinstance(inner[0], LRLayer):
        path, inner = f"{path}.1", inner[1]
    return path


def _default_head(module: nn.Module) -> str:
    names = [name for name, _ in module.named_modules() if name]
    backbone = getattr(module, "backbone", None)
    inner = getattr(backbone, "head_path", None) if isinstance(backbone, nn.Module) else None
    own = getattr(module, "head_path", None)
    if isinstance(inner, str) and f"backbone.{inner}" in names:
        return f"backbone.{inner}"
    if isinstance(own, str) and own in names:
        return own
    linears = [name for name, m in module.named_modules() if name and isinstance(m, nn.Linear)]
    if linears:
        return linears[-1]
    raise ValueError(
        f"{type(module).__name__} has no head_path and no nn.Linear; name the head with head=... "
        f"({describe_names('module name', names) if names else 'it has no submodules'})"
    )


@dataclass(frozen=True)
class FeatureLayer:
    """A layer whose features are read.

    Attributes:
        name: name used in logged keys (a block name, a submodule path, or ``<path>_input``); never contains ``"/"``.
        path: dotted submodule path, as in ``named_modules()``.
        capture: ``"output"`` reads what the submodule returns, ``"input"`` what it receives.
    """

    name: str
    path: str
    capture: Literal["output", "input"] = "output"


def feature_layer(module: nn.Module, layer: str | None = None, *, required: bool = True) -> FeatureLayer | None:
    """The one layer whose features a callback reads (the features feeding the head, by default).

    ``layer`` takes the syntax of :func:`select_layers` and must match exactly one module. By default the last block
    of :func:`module_blocks` is taken (the features feeding the head, see ``docs/architecture.md``; also through a
    wrapper such as a LightningModule holding a package backbone); a module without ``blocks()`` gets the input of
    its last ``nn.Linear``, i.e. the last hidden representation, or ``None`` when ``required`` is false.

    Raises:
        ValueError: ``layer`` matches no module or several, or there is no default layer and one is required.
    """
    if layer is not None:
        chosen = select_layers(module, check_names("layer", layer))
        if len(chosen) != 1:
            raise ValueError(f"layer {layer!r} matches {len(chosen)} modules ({', '.join(chosen.values())}); name one")
        ((name, path),) = chosen.items()
        return FeatureLayer(name if name == layer else eager_name(path), path)
    blocks = module_blocks(module)
    if blocks:
        name, path = list(blocks.items())[-1]
        return FeatureLayer(name, path)
    if not required:
        return None
    linears = [name for name, child in module.named_modules() if name and isinstance(child, nn.Linear)]
    if not linears:
        paths = [name for name, _ in module.named_modules() if name]
        raise ValueError(
            f"{type(module).__name__} has no blocks() and no nn.Linear layer; name the layer explicitly, "
            f"{describe_names('submodule', paths) if paths else 'it has no submodules'}"
        )
    # Named without wrapper segments: a compiled network's layer has the name (and keys) of the uncompiled one.
    return FeatureLayer(f"{eager_name(linears[-1])}_input", linears[-1], "input")


# -- block outputs ---------------------------------------------------------------------------------------------------

OutputSelector = int | str | Callable[[Any], Any]
"""How :func:`hidden_state` picks a block's hidden states: an index, a key / attribute name, or a function."""


def check_output_selector(selector: Any) -> OutputSelector | None:
    """Validate an ``output_selector`` setting (see :func:`hidden_state`) and return it.

    Raises:
        ValueError: anything but ``None``, an int, a non-empty string or a callable.
    """
    index = isinstance(selector, int) and not isinstance(selector, bool)
    if selector is not None and not (index or (isinstance(selector, str) and selector) or callable(selector)):
        raise ValueError(
            f"output_selector must be None (the documented rule), an index, a key / attribute name or a function "
            f"output -> Tensor, got {selector!r}"
        )
    return selector


def _fields(output: Any) -> list[tuple[str, Any]] | None:
    """``(name, value)`` of a dict, ``ModelOutput`` or dataclass output, in order; ``None`` for other outputs.

    A ``ModelOutput`` is a dict holding only its fields that are set.
    """
    if isinstance(output, Mapping):
        return list(output.items())
    if dataclasses.is_dataclass(output) and not isinstance(output, type):
        return [(field.name, getattr(output, field.name)) for field in dataclasses.fields(output)]
    return None


def _is_state(value: Any) -> bool:
    # A 0-dimensional tensor (the loss of a ModelOutput) is never a hidden state.
    return isinstance(value, Tensor) and value.ndim > 0


def _default_hidden_state(output: Any) -> Tensor | None:
    if isinstance(output, Tensor):
        return output
    if isinstance(output, (tuple, list)):
        return next((value for value in output if _is_state(value)), None)
    fields = _fields(output)
    if fields is None:
        return None
    named = dict(fields)
    for key in HIDDEN_STATE_KEYS:
        if _is_state(named.get(key)):
            return named[key]
    return next((value for _, value in fields if _is_state(value)), None)


def _describe_output(output: Any) -> str:
    if isinstance(output, Tensor):
        return f"a Tensor of shape {tuple(output.shape)}"
    if isinstance(output, (tuple, list)):
        return f"a {type(output).__name__} of length {len(output)}"
    fields = _fields(output)
    if fields is not None:
        return f"a {type(output).__name__} with fields {[name for name, _ in fields]}"
    return f"a {type(output).__name__}"


def _select(output: Any, selector: int | str) -> Any:
    fields = _fields(output)
    if isinstance(selector, int):
        if isinstance(output, (tuple, list)):
            values = list(output)
        elif fields is not None:
            # ModelOutput's own indexing: the i-th field that is set.
            values = [value for _, value in fields if value is not None]
        else:
            raise ValueError(
                f"output_selector={selector} indexes a tuple, list or ModelOutput, but the layer returned "
                f"{_describe_output(output)}; use output_selector=None for outputs that are tensors"
            )
        if not -len(values) <= selector < len(values):
            raise ValueError(f"output_selector={selector} is out of range for {_describe_output(output)}")
        return values[selector]
    if isinstance(output, Mapping) and selector in output:
        return output[selector]
    if not isinstance(output, (Tensor, Mapping)) and hasattr(output, selector):
        return getattr(output, selector)  # dataclasses, ModelOutputs' unset fields, named tuples
    raise ValueError(f"output_selector={selector!r} is not a key or attribute of {_describe_output(output)}")


def hidden_state(output: Any, selector: OutputSelector | None = None) -> Tensor | None:
    """The hidden-state tensor in what a hooked block returns; ``None`` when it holds none.

    Blocks return their hidden states in several forms. Without a ``selector`` the rule is:

    * a tensor is the hidden state itself (Hugging Face ``transformers`` 5.x blocks, ``nn.TransformerEncoderLayer``,
      every plain PyTorch module);
    * a tuple or list gives its first tensor (``transformers`` 4.x blocks return ``(hidden_states, present,
      attentions)``);
    * a dict, a ``ModelOutput`` (itself a dict of its set fields) or a dataclass gives its ``last_hidden_state``,
      else its ``hidden_states`` if that is a tensor (a tuple of per-layer states is not one), else its first tensor
      field.

    A 0-dimensional tensor (a ``ModelOutput``'s ``loss``) is never taken. A nested tensor (``nn.TransformerEncoder``
    in eval mode with a padding mask runs its layers on nested tensors) is returned padded with zeros to
    ``(B, T', D)``, ``T'`` being the longest sequence of the batch. ``selector`` overrides the rule:

    * an int indexes a tuple or list, or the set fields of a dict / ``ModelOutput`` / dataclass in order (as
      ``ModelOutput[i]`` does);
    * a string is a key of a dict, else an attribute (dataclass field, named-tuple field);
    * a callable ``output -> Tensor | None`` is applied to the output (``None``: nothing to measure this call).

    Raises:
        ValueError: the selector does not fit the output (an index into a tensor, an unknown key, an index out of
            range), it picks something that is not a tensor, a selector function raises, or it is none of the
            accepted kinds; the message describes the output.
    """
    check_output_selector(selector)
    if selector is None:
        return _padded(_default_hidden_state(output))
    if isinstance(selector, (int, str)):
        value = _select(output, selector)
        picked = f"output_selector={selector!r}"
    else:
        picked = f"output_selector {getattr(selector, '__name__', repr(selector))}"
        try:
            value = selector(output)
        except Exception as error:
            raise ValueError(
                f"{picked} raised {type(error).__name__}: {error}, given {_describe_output(output)}"
            ) from error
        if value is None:
            return None
    if not isinstance(value, Tensor):
        raise ValueError(
            f"{picked} picks a {type(value).__name__}, not a tensor, from {_describe_output(output)}; "
            "pick the hidden-state tensor"
        )
    return _padded(value)


def _padded(value: Tensor | None) -> Tensor | None:
    # nn.TransformerEncoder's fast path (eval, no grad, a padding mask) hands nested tensors from layer to layer.
    if value is not None and value.is_nested:
        return value.to_padded_tensor(0.0)
    return value


# -- hooks and modes -------------------------------------------------------------------------------------------------


def compiled_modules(module: nn.Module) -> list[str]:
    """Paths of the submodules of ``module`` (``""``: itself) that run code compiled by ``torch.compile``.

    Found: the wrappers ``torch.compile(net)`` returns (their network is ``<path>._orig_mod``), modules compiled in
    place with ``net.compile()``, and a LightningModule compiled before ``trainer.fit`` (Lightning compiles its
    ``forward`` and ``*_step`` methods). Code compiled otherwise (a compiled function calling the model) cannot be
    seen from the model.
    """
    compiled = []
    for path, child in module.named_modules():
        wrapper = hasattr(child, "_orig_mod") and hasattr(child, "dynamo_ctx")
        if wrapper or getattr(child, "_compiled_call_impl", None) is not None or getattr(child, "_compiler_ctx", None):
            compiled.append(path)
    return compiled


class _EagerWhileHooked:
    """Runs compiled code eagerly while at least one :func:`forward_hooks` block is open.

    ``torch.compile`` does not guard on forward hooks that were absent when it compiled (PyTorch's
    ``torch._dynamo.config.skip_nnmodule_hook_guards``, on by default): hooks registered on the submodules of a model
    that already ran compiled are never called. ``torch.compiler.set_stance("force_eager")`` runs the model's own
    modules instead, so the hooks fire and see real tensors; the compiled code and its caches stay as they are and
    are used again, without recompiling, once the last block closes. A count, not a stack: blocks of several
    callbacks may close in any order.
    """

    def __init__(self) -> None:
        self.open_blocks = 0
        self._stance: Any = None

    @contextmanager
    def hold(self) -> Iterator[None]:
        set_stance = getattr(torch.compiler, "set_stance", None)
        if set_stance is None or torch.compiler.is_compiling():
            yield  # inside a compiled region the stance cannot change (and the hooks are traced as they are)
            return
        if self.open_blocks == 0:
            self._stance = set_stance("force_eager")  # sets it now; leaving it restores the stance before
        self.open_blocks += 1
        try:
            yield
        finally:
            self.open_blocks -= 1
            if self.open_blocks == 0:
                stance, self._stance = self._stance, None
                stance.__exit__(None, None, None)


_EAGER_WHILE_HOOKED = _EagerWhileHooked()


@contextmanager
def compiled_code_eager() -> Iterator[None]:
    """Run every function compiled by ``torch.compile`` eagerly for the duration of the block
    (``torch.compiler.set_stance("force_eager")``), as :func:`forward_hooks` does; blocks of both nest in any order.

    For passes that compiled code cannot run: ``torch.func.jvp`` and ``vmap`` of a compiled model make TorchDynamo
    give up on the model's ``forward`` for the rest of the process (the compiled code is never used again), which
    running it eagerly avoids.
    """
    with _EAGER_WHILE_HOOKED.hold():
        yield


@contextmanager
def forward_hooks(
    module: nn.Module, layers: Iterable[FeatureLayer], hook: Callable[[FeatureLayer, Any], None]
) -> Iterator[None]:
    """Call ``hook(layer, value)`` whenever one of ``layers`` runs, for the duration of the block.

    ``value`` is what the layer returns (``capture="output"``) or its first positional input (``"input"``). The hooks
    are removed when the block ends, also on error.

    ``torch.compile``: compiled code never calls forward hooks registered after it was compiled, so while the block
    lasts every compiled function runs eagerly (``torch.compiler.set_stance("force_eager")``, restored when the last
    open block ends). The monitored passes of a compiled model thus run at eager speed and give the numbers of the
    eager model; the other passes run the compiled code, which is not recompiled. A compiled network's submodules
    are named through its wrapper (``net._orig_mod.layers.0``, see :func:`compiled_modules`).
    """
    handles = []
    with _EAGER_WHILE_HOOKED.hold():
        try:
            for layer in layers:
                submodule = module.get_submodule(layer.path)
                if layer.capture == "output":
                    handles.append(submodule.register_forward_hook(lambda _m, _a, out, layer=layer: hook(layer, out)))
                else:
                    pre_hook = lambda _m, args, layer=layer: hook(layer, args[0])  # noqa: E731
                    handles.append(submodule.register_forward_pre_hook(pre_hook))
            yield
        finally:
            for handle in handles:
                handle.remove()


@contextmanager
def capture_features(
    module: nn.Module, layers: Sequence[FeatureLayer], *, on_repeat: Callable[[FeatureLayer], None] | None = None
) -> Iterator[dict[str, Tensor]]:
    """Hook ``layers`` of ``module`` for the duration of the block; yields ``{layer name: latest features}``.

    With ``on_repeat``, a layer's first call is kept instead, until the caller takes it out of the dict (before each
    forward pass), and ``on_repeat(layer)`` is called for each later call: a layer that runs more than once in one
    forward pass (a shared module, a second view of the batch) is read at its first call, as the monitors read it.
    The captured tensors are not detached, so gradients can flow from them into the network.
    """
    captured: dict[str, Tensor] = {}

    def store(layer: FeatureLayer, value: Any) -> None:
        if not isinstance(value, Tensor):
            raise TypeError(f"layer {layer.name!r} produced a {type(value).__name__}, expected a tensor")
        if on_repeat is not None and layer.name in captured:
            on_repeat(layer)
            return
        captured[layer.name] = value

    with forward_hooks(module, layers, store):
        yield captured


@contextmanager
def _mode(module: nn.Module, training: bool) -> Iterator[nn.Module]:
    flags = {m: m.training for m in module.modules()}
    module.train(training)
    try:
        yield module
    finally:
        # module.train(previous) would give every submodule the top-level flag (a frozen BatchNorm inside a
        # training model would start training); each keeps its own.
        for m, flag in flags.items():
            m.training = flag


def eval_mode(module: nn.Module) -> AbstractContextManager[nn.Module]:
    """Put ``module`` in eval mode for the block; afterwards every submodule gets back its own training flag."""
    return _mode(module, False)


def train_mode(module: nn.Module) -> AbstractContextManager[nn.Module]:
    """Put ``module`` in training mode for the block; afterwards every submodule gets back its own training flag."""
    return _mode(module, True)


@contextmanager
def buffers_kept(module: nn.Module) -> Iterator[None]:
    """Restore every buffer (BatchNorm running statistics) of ``module`` when the block ends."""
    saved = [(buffer, buffer.clone()) for buffer in module.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in saved:
                buffer.copy_(value)


# torch.utils.checkpoint (use_reentrant=True) when no input of a checkpointed call requires grad.
_CHECKPOINT_WITHOUT_GRAD = "None of the inputs have requires_grad=True"


@contextmanager
def measuring_without_grad() -> Iterator[None]:
    """``torch.no_grad()`` for a forward pass made only to read activations (an initial point before training).

    A model that checkpoints its blocks in training mode (``torch.utils.checkpoint(..., use_reentrant=True)``, as
    ``model.gradient_checkpointing_enable()`` of ``transformers`` 4.x does) warns in such a pass that "Gradients will be
    None": true of a pass that computes no gradient, and no sign of a problem with the fit's own steps. That warning is
    left out for the block; every other one is given as usual.
    """
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_CHECKPOINT_WITHOUT_GRAD, category=UserWarning)
        yield


@contextmanager
def random_state_kept(module: nn.Module | None = None, loaders: Iterable[Any] = ()) -> Iterator[None]:
    """Restore the random generators when the block ends: torch's CPU generator, that of ``module``'s GPU (its first
    parameter's), Python's ``random``, NumPy's global one, and the generators ``loaders`` hold (a ``DataLoader``'s
    ``generator``, its sampler's, and those its dataset holds as attributes: a ``torch.Generator``, a NumPy
    ``Generator`` or ``RandomState``, a ``random.Random``).

    A monitor's own pass over a loader draws a seed for the loader's iterator and a shuffled order from the loader's
    generator, a forward pass in training mode draws dropout masks, and the iterator of a dataset that draws its
    samples from a generator of its own (an endless ``IterableDataset`` of random token sequences) moves that
    generator on; without this, the batches, masks and augmentations the fit draws afterwards would differ from those
    of the same fit unmonitored.
    """
    parameter = next(module.parameters(), None) if module is not None else None
    devices = [parameter.device] if parameter is not None and parameter.device.type == "cuda" else []
    generators = {id(g): g for loader in loaders for g in _loader_generators(loader)}.values()
    loader_states = [(generator, _generator_state(generator)) for generator in generators]
    # NumPy's legacy global generator is the one kept: it is what a user's np.random.* calls draw from.
    python_state, numpy_state = random.getstate(), np.random.get_state()  # noqa: NPY002
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)  # noqa: NPY002
        for generator, state in loader_states:
            _set_generator_state(generator, state)


_GENERATORS = (torch.Generator, np.random.Generator, np.random.RandomState, random.Random)


def _loader_generators(loader: Any) -> list[Any]:
    """The generators a loader draws from besides the global ones: its own, its sampler's and its batch sampler's
    sampler's, and those its dataset holds as attributes (the loaders inside a list or a dict of loaders too)."""
    if isinstance(loader, Mapping):
        return [g for inner in loader.values() for g in _loader_generators(inner)]
    if isinstance(loader, (list, tuple)):
        return [g for inner in loader for g in _loader_generators(inner)]
    sampler = getattr(loader, "sampler", None)
    inner = getattr(getattr(loader, "batch_sampler", None), "sampler", None)
    found = [getattr(source, "generator", None) for source in (loader, sampler, inner)]
    found += list(getattr(getattr(loader, "dataset", None), "__dict__", {}).values())
    return [generator for generator in found if isinstance(generator, _GENERATORS)]


def _generator_state(generator: Any) -> Any:
    """The state of one of the :data:`_GENERATORS`."""
    if isinstance(generator, np.random.Generator):
        return generator.bit_generator.state
    if isinstance(generator, random.Random):
        return generator.getstate()
    return generator.get_state()  # torch.Generator, np.random.RandomState


def _set_generator_state(generator: Any, state: Any) -> None:
    if isinstance(generator, np.random.Generator):
        generator.bit_generator.state = state
    elif isinstance(generator, random.Random):
        generator.setstate(state)
    else:
        generator.set_state(state)


def declared_batch_first(model: nn.Module, path: str) -> bool | None:
    """The token layout that the module at ``path`` declares, or ``None`` when nothing declares one.

    The module itself or its nearest ancestor (the model itself excluded) decides: its own ``batch_first`` flag
    (``nn.MultiheadAttention``, ``nn.Transformer``), else the flag shared by the attention modules inside it
    (``nn.TransformerEncoderLayer``, ``nn.TransformerEncoder``: their ``self_attn``). The search stops at a Hugging
    Face model: attention modules somewhere inside a whole model (Mask2Former's decoder) declare nothing about its
    other layers (its backbone's blocks).
    """
    parts = path.split(".") if path else []
    for depth in range(len(parts), 0, -1):
        module = model.get_submodule(".".join(parts[:depth]))
        if _hugging_face_model(module):
            return None
        own = getattr(module, "batch_first", None)
        if isinstance(own, bool):
            return own
        flags = {m.batch_first for m in module.modules() if isinstance(m, nn.MultiheadAttention)}
        if len(flags) == 1:
            return flags.pop()
    return None


# Layers whose 3-D outputs are 1-d conv maps, (B, C, L): channels before positions.
_CHANNEL_FIRST_TYPES: tuple[type[nn.Module], ...] = (
    nn.Conv1d,
    nn.ConvTranspose1d,
    nn.BatchNorm1d,
    nn.InstanceNorm1d,
    nn.MaxPool1d,
    nn.AvgPool1d,
    nn.LPPool1d,
    nn.AdaptiveAvgPool1d,
    nn.AdaptiveMaxPool1d,
)
# Layers whose 3-D outputs are tokens, (B, T, D) or (T, B, D): features last.
_TOKEN_TYPES: tuple[type[nn.Module], ...] = (
    nn.Linear,
    nn.Bilinear,
    nn.Embedding,
    nn.MultiheadAttention,
    nn.LayerNorm,
    nn.RMSNorm,
    nn.TransformerEncoderLayer,
    nn.TransformerDecoderLayer,
    nn.RNNBase,
)


def _layout_kind(module: nn.Module) -> bool | None:
    """The layout a layer declares by its type: ``True`` for a 1-d conv map ``(B, C, L)``, ``False`` for tokens
    (``transformers``' ``Conv1D``, GPT-2's projections, and a Hugging Face model are token layers), ``None`` for none
    (activations, dropout, containers)."""
    if isinstance(module, _CHANNEL_FIRST_TYPES):
        return True
    if isinstance(module, _TOKEN_TYPES) or _hugging_face_model(module) or _is_transformers_conv1d(module):
        return False
    return None


def _is_transformers_conv1d(module: nn.Module) -> bool:
    return any(
        cls.__name__ == "Conv1D" and cls.__module__.split(".")[0] == "transformers" for cls in type(module).__mro__
    )


def _channels(module: nn.Module) -> int | None:
    """The channels of a conv map a 1-d layer outputs (``None`` for a pooling layer, which keeps its input's)."""
    for attribute in ("out_channels", "num_features"):
        value = getattr(module, attribute, None)
        if isinstance(value, int):
            return value
    return None


def _last_layout(modules: Iterable[nn.Module], stop: nn.Module | None = None) -> tuple[set[bool], int | None]:
    """The layouts the layers in ``modules`` (up to ``stop``) declare, and the channels of the last 1-d conv layer
    with channels among them."""
    kinds, channels, last = set(), None, None
    for inner in modules:
        if inner is stop:
            break
        kind = _layout_kind(inner)
        if kind is not None:
            kinds.add(kind)
            last = kind
            channels = (_channels(inner) or channels) if kind else None
    return ({last} if stop is not None and last is not None else kinds), channels


def _channel_first(model: nn.Module, path: str) -> tuple[bool, int | None]:
    module = model.get_submodule(path)
    kinds, channels = _last_layout(module.modules())
    if kinds:
        return kinds == {True}, channels
    # A layer with no layout of its own (an activation): the last layer registered before it in its nearest
    # ancestor that has one (the layer it follows in an nn.Sequential).
    parts = path.split(".") if path else []
    for depth in range(len(parts) - 1, -1, -1):
        kinds, channels = _last_layout(model.get_submodule(".".join(parts[:depth])).modules(), stop=module)
        if kinds:
            return kinds == {True}, channels
    return False, None


def channel_first_layers(model: nn.Module, layers: Mapping[str, str]) -> dict[str, int | None]:
    """The names of ``layers`` (``name -> module path``) whose 3-D outputs are 1-d conv maps ``(B, C, L)`` (channels,
    then positions), to be reduced as conv maps (``conv_reduction``) rather than as tokens, each with ``C``, the
    channels of its last 1-d conv or norm layer (``None`` when none tells).

    The modules decide, never the output's shape alone (``C == L`` happens): a ``Conv1d``, ``ConvTranspose1d``,
    ``BatchNorm1d``, ``InstanceNorm1d`` or 1-d pooling layer is one, and so is a block whose layers are all of those
    kinds or layout-free (activations, dropout); a block with a token layer among them (``Linear``, attention,
    ``LayerNorm``, ``Embedding``, a recurrent layer) is read as tokens. A layer with no such layer inside (an
    activation, ``nn.Identity``) follows the last one registered before it in its nearest ancestor that has one: the
    layer it follows in an ``nn.Sequential``. A block that transposes its conv maps back to tokens, ``(B, L, C)``, is
    told by ``C`` in its last dimension and not its second (see :class:`~rank_lightning.streams.ActivationStream`).
    """
    found = {name: _channel_first(model, path) for name, path in layers.items()}
    return {name: channels for name, (first, channels) in found.items() if first}


ChannelWidths = tuple[frozenset[int], frozenset[int]]
"""``(token, all)`` widths of a layer whose 4-D or 5-D outputs may be channels-last (:func:`channels_last_layers`)."""


def _widths(module: nn.Module) -> tuple[set[int], set[int]]:
    """``(token, all)``: the widths of the last dimension of the outputs of the Linear and norm layers over the last
    dimension inside ``module`` (``out_features``, ``normalized_shape[-1]``), and those together with the channels of
    its conv and batch-norm layers (``out_channels``, ``num_features``, ``num_channels``)."""
    token: set[int] = set()
    widths: set[int] = set()
    for inner in module.modules():
        if isinstance(inner, nn.Linear):
            token.add(inner.out_features)
        elif isinstance(inner, (nn.LayerNorm, nn.RMSNorm)) and inner.normalized_shape:
            token.add(inner.normalized_shape[-1])
        for attribute in ("out_channels", "num_features", "num_channels"):
            value = getattr(inner, attribute, None)
            if isinstance(value, int):
                widths.add(value)
    return token, token | widths


def channels_last_layers(model: nn.Module, layers: Mapping[str, str]) -> dict[str, ChannelWidths]:
    """The names of ``layers`` (``name -> module path``) whose 4-D (5-D) outputs may be channels-last maps
    ``(B, H, W, C)`` (``(B, T, H, W, C)``) (Swin's stages and blocks, which apply their Linear and LayerNorm layers
    over the last dimension), each with ``(token, all)`` widths (:func:`_widths`): a layer holding a Linear or a norm
    over the last dimension.

    A 4-D output of such a layer is read as ``(B, H, W, C)`` and brought to ``(B, C, H, W)`` (a 5-D one, Video Swin's
    ``(B, T, H, W, C)``, to ``(B, C, T, H, W)``) when its last dimension is a width of those layers and its second
    is the width of no layer inside it (ConvNeXt's blocks, which permute back to ``(B, C, H, W)``, give their channels
    in the second dimension); see :class:`~rank_lightning.streams.ActivationStream`.
    """
    found = {name: _widths(model.get_submodule(path)) for name, path in layers.items()}
    return {name: (frozenset(token), frozenset(widths)) for name, (token, widths) in found.items() if token}


# Hugging Face model types whose layers (or attention internals) run sequence-first, (T, B, D).
_SEQUENCE_FIRST_MODEL_TYPES = frozenset({"xlnet", "fsmt", "transfo-xl", "longformer", "led"})


def batch_first_when_ambiguous(model: nn.Module, path: str) -> bool | None:
    """The layout of the module at ``path`` for a ``(B, T, D)``-or-``(T, B, D)`` output whose shape cannot tell (as many
    sequences as tokens): batch-first inside a Hugging Face ``transformers`` model (a ``PreTrainedModel``, the model
    itself included), whose hidden states are ``(B, T, D)``; ``None`` (undecided) elsewhere and for the model types
    that run layers sequence-first inside (XLNet, FSMT, Longformer, ...). The shape decides whenever it can.
    """
    parts = path.split(".") if path else []
    for depth in range(len(parts), -1, -1):
        module = model.get_submodule(".".join(parts[:depth]))
        if _hugging_face_model(module):
            model_type = getattr(getattr(module, "config", None), "model_type", None)
            return None if model_type in _SEQUENCE_FIRST_MODEL_TYPES else True
    return None


def token_layouts(
    model: nn.Module, layers: Mapping[str, str], token_layout: str = "auto"
) -> tuple[dict[str, bool], dict[str, bool]]:
    """``(layouts, when_ambiguous)`` of the monitored ``layers`` (``name -> module path``), each ``name ->
    batch_first``: the layouts given by ``token_layout`` (``"batch_first"`` or ``"sequence_first"`` for all) or
    declared by the modules (:func:`declared_batch_first`), and for the other layers the layout a batch whose shape
    cannot tell is read in (:func:`batch_first_when_ambiguous`)."""
    if token_layout != "auto":
        return dict.fromkeys(layers, token_layout == "batch_first"), {}
    declared = {name: declared_batch_first(model, path) for name, path in layers.items()}
    layouts = {name: flag for name, flag in declared.items() if flag is not None}
    guessed = {name: batch_first_when_ambiguous(model, path) for name, path in layers.items() if name not in layouts}
    return layouts, {name: flag for name, flag in guessed.items() if flag is not None}


def _hugging_face_model(module: nn.Module) -> bool:
    """Whether ``module`` is a ``transformers`` ``PreTrainedModel`` (told by its classes, without importing it)."""
    return any(
        cls.__name__ == "PreTrainedModel" and cls.__module__.startswith("transformers.") for cls in type(module).__mro__
    )


def _decoder_of(module: nn.Module) -> nn.Module | None:
    """The decoder of an encoder-decoder model: the ``decoder`` of an ``nn.Transformer``, the ``get_decoder()`` of a
    Hugging Face encoder-decoder model (a ``PreTrainedModel`` whose ``config.is_encoder_decoder`` is true); ``None``
    for other modules, and where ``get_decoder()`` gives no submodule of its own (T5's stacks carry their model's flag
    and give themselves)."""
    if isinstance(module, nn.Transformer):
        return module.decoder
    if not _hugging_face_model(module) or not getattr(getattr(module, "config", None), "is_encoder_decoder", False):
        return None
    try:
        decoder = module.get_decoder()
    except (AttributeError, NotImplementedError, TypeError, ValueError):
        return None
    return decoder if isinstance(decoder, nn.Module) and decoder is not module else None


def _target_head_of(module: nn.Module) -> nn.Module | None:
    """The output layer of a Hugging Face encoder-decoder model (``get_output_embeddings()``: T5's and BART's
    ``lm_head``, Whisper's ``proj_out``), applied to the decoder's hidden states outside the decoder module; ``None``
    for other modules."""
    if _decoder_of(module) is None or isinstance(module, nn.Transformer):
        return None
    try:
        head = module.get_output_embeddings()
    except (AttributeError, NotImplementedError, TypeError, ValueError):
        return None
    return head if isinstance(head, nn.Module) and head is not module else None


def decoder_layers(model: nn.Module, layers: Mapping[str, str]) -> list[str]:
    """The names of ``layers`` (``name -> module path``) in the decoder of an encoder-decoder model (``nn.Transformer``;
    a Hugging Face T5, BART, Marian, Whisper, ``EncoderDecoderModel``: a ``PreTrainedModel`` whose
    ``config.is_encoder_decoder`` is true, whose decoder is ``get_decoder()``), the decoder itself included, and the
    layers at or inside the output layer that such a Hugging Face model applies to its decoder's hidden states
    outside the decoder (its ``get_output_embeddings()``: T5's and BART's ``lm_head``, Whisper's ``proj_out``).

    Their tokens are the target's, not the source's: the batch's ``attention_mask`` (the encoder's) does not belong to
    them, even when source and target are padded to one length. The outermost such model on a layer's path decides;
    a layer that holds the whole model is not in its decoder.
    """
    found = []
    for name, path in layers.items():
        parts = path.split(".") if path else []
        modules = [model.get_submodule(".".join(parts[:depth])) for depth in range(len(parts) + 1)]
        for depth, module in enumerate(modules):
            decoder = _decoder_of(module)
            if decoder is not None:
                head = _target_head_of(module)
                if any(inner is decoder or inner is head for inner in modules[depth + 1 :]):
                    found.append(name)
                break
    return found


def expert_layers(model: nn.Module, layers: Mapping[str, str]) -> list[str]:
    """The names of ``layers`` (``name -> module path``) at or inside a routed expert of a mixture-of-experts layer: a
    member of a ``ModuleList`` or ``ModuleDict`` held as ``experts`` (Switch Transformers' ``experts.expert_<e>``,
    the ``experts.<e>`` of ``transformers`` 4.x Mixtral and Qwen-MoE blocks).

    Such a module is called on the tokens routed to it, ``(n_routed, d)`` rows whose number changes from batch to
    batch and belongs to no input of the batch. Fused experts (``transformers`` 5.x ``MixtralExperts``, one 3-D
    weight for every expert) hold no module per expert and are not listed.
    """
    found = []
    for name, path in layers.items():
        parts = path.split(".") if path else []
        for depth in range(len(parts) - 1):
            prefix = ".".join(parts[: depth + 1])
            if parts[depth] == "experts" and _routed_experts(prefix, model.get_submodule(prefix)):
                found.append(name)
                break
    return found


def _takes_no_tokens(module: nn.Module) -> bool:
    """Whether ``module`` is a Hugging Face model whose ``forward`` names neither ``input_ids`` nor
    ``attention_mask``: an image model or tower (CLIP's and SigLIP's ``vision_model``, a ViT), fed ``pixel_values``;
    or a module of ``transformers`` fed ``pixel_values`` alone (transformers 4.x's ``CLIPVisionTransformer``, the
    vision tower that is no ``PreTrainedModel`` there)."""
    pretrained = _hugging_face_model(module)
    if not pretrained and not type(module).__module__.startswith("transformers."):
        return False
    try:
        parameters = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False
    if MASK_KEY in parameters or "input_ids" in parameters:
        return False
    return pretrained or "pixel_values" in parameters


def unmasked_layers(model: nn.Module, layers: Mapping[str, str]) -> list[str]:
    """The names of ``layers`` (``name -> module path``) inside a Hugging Face model that takes no attention mask (its
    ``forward`` names neither ``input_ids`` nor ``attention_mask``): the vision tower of a two-tower or
    multimodal model (CLIP's and SigLIP's ``vision_model``, a LLaVA ``vision_tower``) and image models.

    Their tokens are image patches, none of them padding: the batch's ``attention_mask``, the text's, does not belong
    to them, even when the text is padded to as many tokens as the image has patches.
    """
    found = []
    for name, path in layers.items():
        parts = path.split(".") if path else []
        if any(_takes_no_tokens(model.get_submodule(".".join(parts[:depth]))) for depth in range(len(parts) + 1)):
            found.append(name)
    return found


# -- batches ---------------------------------------------------------------------------------------------------------


def _describe(batch: Any) -> str:
    if isinstance(batch, Mapping):
        return f"a dict batch with keys {list(batch)}"
    if isinstance(batch, (tuple, list)):
        return f"a {type(batch).__name__} batch of length {len(batch)}"
    return f"a batch of type {type(batch).__name__}"


def _default_place(batch: Any, keys: Sequence[str], index: int) -> str:
    """Where a value is looked for in ``batch`` without a key of its own, in words: the ``keys`` of a dict batch, the
    ``index`` of a tuple or list batch, both for a batch of another type."""
    if isinstance(batch, Mapping):
        return f"one of {list(keys)}"
    if isinstance(batch, (tuple, list)):
        return f"index {index}"
    return f"index {index} or one of {list(keys)}"


def key_advice(batch: Any, what: str) -> str:
    """What to set for a value ``what`` of ``batch`` that is not where it was looked for: its ``<what>_key`` (a key of
    a dict batch, an index of a tuple or list batch) or ``<what>_fn``; only the function for a batch of another type,
    which has neither."""
    if isinstance(batch, Mapping):
        return f"set {what}_key (a key of the dict batch) or {what}_fn"
    if isinstance(batch, (tuple, list)):
        return f"set {what}_key (an index of the {type(batch).__name__} batch) or {what}_fn"
    return f"set {what}_fn (a batch of type {type(batch).__name__} has no index or key for {what}_key)"


def several_loaders_advice(batch: Any) -> str:
    """Advice for the labels of a batch that looks like a batch of several loaders (a dict or list of per-loader
    batches, as Lightning's ``CombinedLoader`` gives them: no tensor of its own, a tuple, list or dict in it); else
    ``""``."""
    items = list(batch.values()) if isinstance(batch, Mapping) else batch
    if not isinstance(items, (tuple, list)) or len(items) < 2 or any(isinstance(item, Tensor) for item in items):
        return ""
    if not any(isinstance(item, (tuple, list, Mapping)) for item in items):
        return ""
    parts = "batch.values()" if isinstance(batch, Mapping) else "batch"
    return (
        " It is a batch of several loaders (Lightning combines several training loaders): set label_fn to the labels "
        "of the rows the step runs, in its order, e.g. "
        f"label_fn=lambda batch: torch.cat([part[1] for part in {parts}])."
    )


_NOT_ONE_HOT = "rows that are not one-hot: soft labels, mixup or regression targets are not class labels"

LABEL_FORMS = (
    "integer labels of shape (B,) or one-hot rows of shape (B, C) (read as their argmax), also as a (B, 1) column or "
    "as booleans (False: class 0, True: class 1)"
)
"""The class labels every class-aware part of the package takes (:func:`class_labels`, :meth:`BatchReader.labels`)."""


def _shown(values: Tensor) -> str:
    """The first few values of ``values`` (read back from its device), as ``[0.9, 0.05, 0.05]``."""
    shown = ", ".join(repr(round(v, 4)) if isinstance(v, float) else str(v) for v in values.reshape(-1)[:4].tolist())
    return f"[{shown}{', ...' if values.numel() > 4 else ''}]"


def _read_labels(value: Any, per_token: bool = False) -> tuple[Tensor | None, str, bool]:
    """``(labels, what was found, refused)`` for the value where a batch's labels should be.

    ``labels`` are the ``(B,)`` int64 class labels (``None`` when there are none), or with ``per_token`` also
    ``(B, T)`` integer labels per token; ``what was found`` a short description of ``value`` and ``refused`` whether it
    is a tensor holding no class labels. The forms taken are :data:`LABEL_FORMS`: a ``(B, 1)`` column is read as
    ``(B,)``, booleans as the classes 0 and 1, one-hot rows as their argmax.
    """
    if value is None:
        return None, "nothing", False
    if not isinstance(value, Tensor):
        return None, f"a {type(value).__name__}", False
    found = f"a Tensor {value.dtype} of shape {tuple(value.shape)}"
    column = value.ndim == 2 and value.shape[1] == 1
    if column:
        value = value[:, 0]  # one label per row, as a DataFrame column or y.unsqueeze(1) gives them
    if value.ndim == 1:
        if value.dtype == torch.bool:
            return value.long(), f"{found}: booleans, read as the classes 0 and 1", False
        if value.is_floating_point() or value.is_complex():
            return None, f"{found}: float values, not class indices", True
        return value.long(), f"{found}: a column, read as ({value.shape[0]},)" if column else found, False
    if value.ndim == 2 and not value.is_complex():
        # One-hot rows (B, C): every entry 0 or 1, exactly one 1 per row; anything else (label smoothing, mixup,
        # regression targets) has no single class per sample.
        # Both flags in one read: on a GPU each read waits for the device (labels per token are read at every batch).
        binary, single = torch.stack([((value == 0) | (value == 1)).all(), (value.sum(1) == 1).all()]).tolist()
        if value.shape[1] >= 2 and binary and single:
            return value.to(torch.uint8).argmax(1), f"{found}, one-hot: read as its argmax", False
        if not value.is_floating_point() and value.dtype != torch.bool and not binary:
            # Integer (B, T) beyond 0 and 1: a label per token (a language model's next tokens, token classification).
            if per_token:
                return value.long(), f"{found}: a class label per token", False
            message = "a class label per token or position, not one per sample (per-token labels are not supported)"
            return None, f"{found}: {message}", True
        return None, f"{found}: {_NOT_ONE_HOT}", True
    return None, f"{found}: {value.ndim} dimensions, not one label per row", True


def label_advice(value: Any, *, in_batch: bool = True) -> str:
    """What to pass instead of ``value``, labels that :func:`_read_labels` refused, with the values that tell why:
    read from a batch (``in_batch``, where ``label_key`` / ``label_fn`` choose them) or given to a metric or function.
    Reads the values back from their device: for an error message only."""
    where = ", e.g. with label_key or label_fn" if in_batch else ""
    if not isinstance(value, Tensor) or value.is_complex() or not value.numel():
        return "pass integer class indices" + where
    rows = value.reshape(value.shape[0], -1) if value.ndim else value.reshape(1, 1)
    if rows.shape[1] == 1 and value.is_floating_point():
        if bool(torch.isfinite(value).all() & (value == value.round()).all()):
            cast = "e.g. label_fn=lambda batch: batch[1].long()" if in_batch else "labels.long()"
            return f"these hold whole numbers stored as floats ({_shown(value)}): pass them as integers, {cast}"
        return (
            f"these hold fractional values ({_shown(value)}), which are no classes: pass integer class indices{where}"
        )
    if value.ndim == 2 and (value.is_floating_point() or value.dtype == torch.bool):
        row = int((((rows != 0) & (rows != 1)).any(1) | (rows.sum(1) != 1)).to(torch.uint8).argmax())
        kept = ", e.g. kept in the batch beside the mixed targets and named with label_key or label_fn"
        return (
            f"row {row} is {_shown(rows[row])}: soft targets (mixup, CutMix, label smoothing) have no class; pass "
            f"the integer class indices{kept if in_batch else ''}"
        )
    return "pass integer class indices" + where


def class_labels(labels: Any, rows: int | None = None, *, name: str = "labels", per_token: bool = False) -> Tensor:
    """``labels`` in one of the :data:`LABEL_FORMS` as ``(B,)`` int64 class indices, on their own device.

    A ``(B, 1)`` column is read as ``(B,)``, booleans as the classes 0 and 1, one-hot rows ``(B, C)`` (entries 0 or
    1, a single 1 per row) as their argmax; the labels of :meth:`BatchReader.labels` and of every metric and function
    that takes class labels are read here, so that every one of them takes the same forms. ``per_token`` also takes
    ``(B, T)`` integer labels per token (values other than 0 and 1), returned as int64.

    Raises:
        ValueError: anything else (float values, soft targets such as mixup's, a label per token), or, with ``rows``,
            labels for another number of rows; the message names what was found and what is taken.
    """
    value, found, _ = _read_labels(labels, per_token)
    if value is None:
        forms = f"{LABEL_FORMS}, or (B, T) integer labels per token" if per_token else LABEL_FORMS
        raise ValueError(f"{name} must be {forms}; got {found}; {label_advice(labels, in_batch=False)}")
    if rows is not None and value.shape[0] != rows:
        raise ValueError(f"{name} must have shape ({rows},), one class label per row, got {found}")
    return value


def check_label_rows(labels: Tensor, rows: int, what: str) -> None:
    """Raise unless the batch's ``labels`` hold one label for each of the ``rows`` samples of ``what`` (the inputs, or
    the features of a layer): labels of other rows, cut or padded to fit, would pair samples with other classes.

    Raises:
        ValueError: the two row counts differ; the message names both.
    """
    if labels.shape[0] != rows:
        raise ValueError(
            f"the batch's labels have {labels.shape[0]} rows (shape {tuple(labels.shape)}) but {what} have {rows}: "
            "one class label per sample is needed; check label_key or label_fn"
        )


def forward_batch(
    module: nn.Module, batch: Any, reader: BatchReader, call: str | None = None, *, ran: Callable[[], Any] = lambda: 0
) -> str | None:
    """Run ``module`` on a batch as its own steps would, for a callback's own pass over a loader.

    ``forward(inputs)`` (:meth:`BatchReader.inputs`: ``input_key``, ``batch[0]``); for a dict batch without
    ``input_key``, ``forward(**entries)`` when ``forward`` names some of its keys (Hugging Face style), else
    ``forward(batch)`` (a module that reads the dict itself), and when that fails before anything the caller watches
    ran (``ran()`` false), ``forward(inputs)`` with the dict's inputs (its ``x``, ``image``, ``input_ids``, ...: a
    ``forward(x)`` whose steps pass ``batch["image"]``).

    ``call`` is how an earlier dict batch of the pass was run (``"batch"`` or ``"inputs"``; ``None`` to find out);
    returns how this one was, to be passed with the next batch.

    Raises:
        ValueError: the batch holds no inputs where :meth:`BatchReader.inputs` looks (the message says where).
    """
    if reader.input_key is not None or not isinstance(batch, Mapping) or call == "inputs":
        module(reader.inputs(batch))
        return call
    parameters = inspect.signature(module.forward).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    named = {key: value for key, value in batch.items() if takes_any or key in parameters}
    if named:
        module(**named)
        return call
    try:
        module(batch)
    except Exception as error:
        if call is not None or ran():
            raise
        try:
            inputs = reader.inputs(batch)
        except ValueError as missing:
            raise missing from error
        module(inputs)
        return "inputs"
    return "batch"


@dataclass(frozen=True)
class BatchReader:
    """Where the inputs and the class labels of a batch are.

    Batches may be a tensor (inputs only), a tuple or list (``(x, y, ...)``) or a dict (Hugging Face style).

    Attributes:
        input_key: index (tuples/lists) or key (dicts) of the inputs; ``None``: ``batch[0]``, the first of
            :data:`INPUT_KEYS` in a dict, or the batch itself when it is a tensor.
        label_key: index or key of the labels; ``None``: ``batch[1]`` or the first of :data:`LABEL_KEYS`.
        label_fn: ``batch -> labels``, overriding ``label_key``.
        mask_key: where the ``(B, T)`` attention mask is (true / 1 at the real tokens, false / 0 at padding): an
            index (tuples/lists), a key (dicts) or a function ``batch -> mask``; ``None``: :data:`MASK_KEY`
            (``"attention_mask"``) of a dict batch, if there is one, and no mask for other batches; ``False``: never
            a mask. With ``None`` or ``"attention_mask"`` (Hugging Face's names, :attr:`default_mask_lookup`) the
            layers in the decoder of an encoder-decoder read :meth:`decoder_mask` instead; any other ``mask_key``
            names the one mask of every layer.

    Labels named by ``label_key`` or ``label_fn`` must be there: :meth:`labels` raises at the first batch when they
    are not. Labels looked for at the default places are optional unless asked for (``required``). The same holds
    for a mask named by ``mask_key``.
    """

    input_key: int | str | None = None
    label_key: int | str | None = None
    # Returning Any: a LightningCLI config refuses the import path of a function whose return annotation is not the
    # Callable's, and most label functions have none.
    label_fn: Callable[[Any], Any] | None = None
    # Literal[False] first: a LightningCLI config then reads `false` as False and writes it back as `false`
    # (listed after str, `--mask_key=false` is the key 'false' and a saved False cannot be read back). The callbacks'
    # and RankTracker's mask_key list the same types in the same order.
    mask_key: Literal[False] | int | str | Callable[[Any], Tensor | None] | None = None

    def __post_init__(self) -> None:
        for name in ("input_key", "label_key"):
            key = getattr(self, name)
            if key is not None and (isinstance(key, bool) or not isinstance(key, (int, str))):
                raise ValueError(f"{name} must be None, an index or a key, got {key!r}")
        if self.label_fn is not None and not callable(self.label_fn):
            raise ValueError(f"label_fn must be a function batch -> labels, got {self.label_fn!r}")
        mask_key = self.mask_key
        if mask_key is True or not (
            mask_key is None or mask_key is False or isinstance(mask_key, (int, str)) or callable(mask_key)
        ):
            raise ValueError(
                f"mask_key must be None (the {MASK_KEY!r} of a dict batch), False (no mask), an index, a key or a "
                f"function batch -> mask, got {mask_key!r}"
            )

    @staticmethod
    def _lookup(batch: Any, key: int | str | None, defaults: Sequence[str], position: int) -> Any:
        if isinstance(batch, Mapping):
            keys = [key] if key is not None else [k for k in defaults if k in batch]
            return batch.get(keys[0]) if keys else None
        if isinstance(batch, (tuple, list)):
            index = position if key is None else key
            return batch[index] if isinstance(index, int) and -len(batch) <= index < len(batch) else None
        return None

    def inputs(self, batch: Any) -> Tensor:
        """The input tensor of ``batch``.

        Raises:
            ValueError: no tensor where the inputs should be; the message says where it looked.
        """
        if isinstance(batch, Tensor) and self.input_key is None:
            return batch
        value = self._lookup(batch, self.input_key, INPUT_KEYS, 0)
        if not isinstance(value, Tensor):
            where = repr(self.input_key) if self.input_key is not None else _default_place(batch, INPUT_KEYS, 0)
            raise ValueError(f"cannot find the inputs at {where} in {_describe(batch)}; set input_key")
        return value

    def _label_value(self, batch: Any) -> Any:
        if self.label_fn is not None:
            return self.label_fn(batch)
        return self._lookup(batch, self.label_key, LABEL_KEYS, 1)

    def _label_where(self, batch: Any, found: str) -> str:
        if self.label_fn is not None:
            where = "label_fn"
        else:
            where = repr(self.label_key) if self.label_key is not None else _default_place(batch, LABEL_KEYS, 1)
        return f"{where} in {_describe(batch)} (found {found})"

    def label_source(self, batch: Any, *, per_token: bool = False) -> str:
        """Where the labels of ``batch`` were looked for and what was found there, as a short text.

        For example ``"one of ['y', ...] in a dict batch with keys ['x', 'w'] (found nothing)"`` or
        ``"'y' in a dict batch with keys ['x', 'y'] (found a Tensor torch.float32 of shape (4, 3), one-hot: read as
        its argmax)"``: the text of :meth:`labels`' error, for a caller that warns instead of failing when labels
        are optional.
        """
        _, found, _ = _read_labels(self._label_value(batch), per_token)
        return self._label_where(batch, found)

    def refused_label_advice(self, batch: Any) -> str:
        """What to pass instead of the labels of ``batch`` when they are a tensor in none of the :data:`LABEL_FORMS`
        (soft targets, float values: with the values that tell why); ``""`` otherwise. For a warning only: it reads
        the labels back from their device."""
        value = self._label_value(batch)
        _, _, refused = _read_labels(value, per_token=True)
        return label_advice(value) if refused else ""

    def labels(self, batch: Any, *, required: bool = False, per_token: bool = False) -> Tensor | None:
        """The ``(B,)`` int64 class labels of ``batch``; ``None`` when there are none and they are not ``required``.

        The forms taken are :data:`LABEL_FORMS`, as every class-aware part of the package takes them
        (:func:`class_labels`): integer labels of any integer dtype, a ``(B, 1)`` column read as ``(B,)``, booleans
        as the classes 0 (false) and 1 (true), one-hot rows ``(B, C)`` (integer, boolean or float, entries 0 or 1, a
        single 1 per row) as their argmax. Float values (also whole numbers such as ``3.0``: cast them with
        ``label_fn``), soft targets (mixup, CutMix, label smoothing) and other 2-D labels are no class labels:
        ``None``, or an error naming what was found when the labels are required or named.

        ``per_token=True`` (for the layers whose rows are tokens) also returns ``(B, T)`` integer labels that hold
        values other than 0 and 1 (a language model's next tokens, -100 where a token has no class) as they are: a
        label per token, which only the ``"token"`` reduction of ``(B, T, D)`` activations takes.

        Raises:
            ValueError: no class labels where they should be, and they are ``required`` or were named by
                ``label_key`` / ``label_fn`` (a setup error, so it is raised at the first batch whatever
                ``required``); the message says where it looked, what it found and why it refused it.
        """
        value = self._label_value(batch)
        labels, found, refused = _read_labels(value, per_token)
        if labels is not None:
            return labels
        if not required and self.label_key is None and self.label_fn is None:
            return None
        if refused:
            advice = f"class metrics need {LABEL_FORMS}; {label_advice(value)}"
        else:
            advice = key_advice(batch, "label")
        advice += several_loaders_advice(batch)
        raise ValueError(f"cannot find integer class labels at {self._label_where(batch, found)}; {advice}")

    def mask(self, batch: Any, *, convert: bool = True) -> Tensor | None:
        """The ``(B, T)`` boolean attention mask of ``batch`` (true at the real tokens); ``None`` when there is none.

        ``convert=False`` returns the mask as found, its shape checked but not its values (checking them reads a flag
        back from a GPU).

        Without ``mask_key`` a dict batch's ``"attention_mask"`` is taken when present; other batches have none. In
        an encoder-decoder that mask is the encoder's: the decoder's layers read :meth:`decoder_mask`.
        Integer or float masks must hold only 0 and 1 (Hugging Face's ``attention_mask``); PyTorch's
        ``key_padding_mask`` marks the padding instead and is passed inverted, e.g.
        ``mask_key=lambda batch: ~batch["padding_mask"]``.

        Raises:
            ValueError: a mask named by ``mask_key`` that is not in the batch, or a mask that is not a ``(B, T)``
                tensor of booleans or 0 / 1 values; the message says where it looked and what it found.
        """
        key = self.mask_key
        if key is False:
            return None
        if key is None:
            value = batch.get(MASK_KEY) if isinstance(batch, Mapping) else None
            where = repr(MASK_KEY)
        elif callable(key):
            value, where = key(batch), "mask_key"
        else:
            value, where = self._lookup(batch, key, (), -1), repr(key)
            if value is None:
                raise ValueError(
                    f"cannot find the attention mask at {where} in {_describe(batch)}; set mask_key to where the "
                    "(B, T) mask is, or to False for none"
                )
        return self._checked_mask(batch, value, where, convert)

    @property
    def default_mask_lookup(self) -> bool:
        """Whether the mask is looked up by Hugging Face's names: ``mask_key`` is ``None`` or ``"attention_mask"``.

        The batch's ``attention_mask`` is then the encoder's, and the layers in the decoder of an encoder-decoder
        (:func:`decoder_layers`) read :meth:`decoder_mask`. Naming ``"attention_mask"`` is the default lookup, except
        that a batch without it is an error.
        """
        return self.mask_key is None or (isinstance(self.mask_key, str) and self.mask_key == MASK_KEY)

    def decoder_mask(self, batch: Any, *, convert: bool = True) -> Tensor | None:
        """The ``(B, T')`` mask of an encoder-decoder's target tokens: :data:`DECODER_MASK_KEY`
        (``"decoder_attention_mask"``) of a dict batch under the :attr:`default_mask_lookup`; ``None`` when the batch
        has none or another ``mask_key`` is set (that mask is then every layer's). Checked and converted as
        :meth:`mask`.

        Raises:
            ValueError: a value that is not a ``(B, T')`` tensor of booleans or 0 / 1 values.
        """
        if not self.default_mask_lookup or not isinstance(batch, Mapping):
            return None
        return self._checked_mask(batch, batch.get(DECODER_MASK_KEY), repr(DECODER_MASK_KEY), convert)

    @staticmethod
    def _checked_mask(batch: Any, value: Any, where: str, convert: bool) -> Tensor | None:
        if value is None:
            return None
        found = f"a Tensor of shape {tuple(value.shape)}" if isinstance(value, Tensor) else f"a {type(value).__name__}"
        if not isinstance(value, Tensor) or value.ndim != 2:
            raise ValueError(
                f"the attention mask at {where} in {_describe(batch)} must be a (B, T) tensor, found {found}"
            )
        if not convert:
            return value
        # Imported here: the functional package imports this module (functional/jacobian.py uses eval_mode).
        from rank_lightning.functional.reductions import token_mask

        try:
            return token_mask(value)
        except ValueError as error:
            raise ValueError(f"the attention mask at {where} in {_describe(batch)}: {error}") from error

    def split(self, batch: Any) -> tuple[Tensor, Tensor]:
        """``(inputs, labels)`` of a labelled batch; raises ``ValueError`` (see :meth:`inputs`, :meth:`labels`)."""
        labels = self.labels(batch, required=True)
        return self.inputs(batch), cast(Tensor, labels)

    @staticmethod
    def batch_size(batch: Any) -> int | None:
        """Leading dimension of the batch's first tensor; ``None`` when it holds none."""
        if isinstance(batch, Tensor):
            return batch.shape[0] if batch.ndim else None
        items = list(batch.values()) if isinstance(batch, Mapping) else batch
        if isinstance(items, (tuple, list)):
            for item in items:
                if isinstance(item, Tensor) and item.ndim > 0:
                    return item.shape[0]
        return None
