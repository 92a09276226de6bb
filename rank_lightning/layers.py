"""Choosing and reading the layers of a model: one selection syntax, hook context, eval switch and batch reader.

Every callback that hooks or reads a model goes through this module, so they all accept the same layer syntax:

* a block name from ``module.blocks()`` (the package's LightningModules: ``"layer3"``, ``"pool"``);
* an exact name from ``named_modules()`` (``"backbone.layer3"``);
* a glob pattern matched with ``fnmatch`` against block names and module names (``"layer*"``, ``"*.relu"``);
* module types (``layer_types``): classes (``nn.Conv2d``), class names (``"Conv2d"``, matched against the class and
  its bases) or dotted import paths (``"torch.nn.Linear"``).

An unknown name raises ``ValueError`` listing the valid names (block names first, then module names). When no layer is
named, :func:`default_layers` finds the repeated blocks of a model (or its hidden activations).

The rest reads what the chosen layers compute: :func:`forward_hooks` registers hooks and always removes them,
:func:`capture_features` keeps the latest features of some layers, :func:`eval_mode` / :func:`train_mode` switch a
model and restore every submodule's own flag, and :class:`BatchReader` finds the inputs and labels of a batch.
"""

from __future__ import annotations

import fnmatch
import importlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch
from torch import Tensor, nn

from rank_lightning.validation import check_names

__all__ = [
    "ACTIVATION_TYPES",
    "GLOB_CHARACTERS",
    "INPUT_KEYS",
    "LABEL_KEYS",
    "BatchReader",
    "FeatureLayer",
    "LayerType",
    "buffers_kept",
    "capture_features",
    "check_layer_types",
    "declared_batch_first",
    "default_layers",
    "eval_mode",
    "feature_layer",
    "forward_hooks",
    "match_layer_names",
    "match_layer_types",
    "module_blocks",
    "select_layers",
    "train_mode",
]

GLOB_CHARACTERS = frozenset("*?[")
LABEL_KEYS: tuple[str, ...] = ("y", "label", "labels", "target", "targets")
"""Keys tried, in order, for the labels of a dict batch when no ``label_key`` is given."""
INPUT_KEYS: tuple[str, ...] = ("x", "input", "inputs", "image", "images", "pixel_values", "input_ids")
"""Keys tried, in order, for the inputs of a dict batch when no ``input_key`` is given."""

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


def _is_of_type(module: nn.Module, wanted: LayerType) -> bool:
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
        expand_containers: an exact name or a glob naming a container that is not itself a candidate selects the
            candidates inside it (``"backbone.layer1"`` -> every Conv in it); otherwise the name must be a candidate.
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
            if expand_containers:
                # A glob that names containers selects the candidates inside them, as an exact container name does.
                containers = [name for name in fnmatch.filter(all_modules, pattern) if name and name not in candidates]
                matches += [name for name in candidates if any(name.startswith(c + ".") for c in containers)]
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


def _kind(module: nn.Module) -> Any:
    # Plain containers are told apart by what they hold: torchvision VGG's ``features`` and ``classifier`` are both
    # nn.Sequential, ResNet's ``layer1`` .. ``layer4`` are nn.Sequentials of the same residual block.
    if isinstance(module, _PLAIN_CONTAINERS):
        return type(module), frozenset(type(child) for child in module.children())
    return type(module)


def _never_called(module: nn.Module) -> bool:
    # nn.ModuleList and nn.ModuleDict have no forward: their children are called, never they themselves.
    return type(module).forward is nn.Module.forward


def _block_runs(container: nn.Module) -> list[list[str]]:
    """Runs of the container's children that repeat: >= 2 parameterised children with children, of the same kind.

    Children that are never called (a ModuleList, a ModuleDict) cannot be blocks; each run keeps the children's order.
    """
    runs: dict[Any, list[str]] = {}
    for name, child in container.named_children():
        if _has_children(child) and _parameter_count(child) > 0 and not _never_called(child):
            runs.setdefault(_kind(child), []).append(name)
    return [names for names in runs.values() if len(names) >= 2]


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


def _repeated_blocks(module: nn.Module, weights: Sequence[str]) -> list[str]:
    """The repeated blocks holding the most weight layers, if they hold at least half of them; else nothing.

    One run of blocks of one kind is looked for first (ties: the deepest container, then the first); when no run
    holds half of the weight layers, the runs of one container together (Inception: blocks of several classes).
    """
    single: list[list[str]] = []
    together: list[list[str]] = []
    for path, container in module.named_modules():
        runs = _block_runs(container)
        members = {name for run in runs for name in run}
        prefix = f"{path}." if path else ""
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
       runs of one container together are tried the same way (Inception's blocks of several classes). Every block
       is kept, the last one too: a head of another type is never among them.
    3. Else, a network of layers (an MLP, a VGG-like CNN): its hidden representations. The head is the last weight
       layer, the hidden layers are the others. The activation modules (:data:`ACTIVATION_TYPES`) anywhere in the
       network are chosen when they are at least as many as the hidden layers (``nn.Sequential(Linear, ReLU,
       Linear, ReLU, Linear)``: the two ReLUs); else the hidden layers themselves (activations applied
       functionally, or one ``self.act`` shared by every layer, which would run several times per forward).
    4. Else the children of the innermost wrapped network.
    """
    blocks = module_blocks(module)
    if blocks is not None:
        return blocks
    weights = _weight_layers(module)
    chosen = _repeated_blocks(module, weights)
    if not chosen:
        hidden = weights[:-1]
        activations = [path for path, m in module.named_modules() if isinstance(m, ACTIVATION_TYPES)]
        chosen = activations if activations and len(activations) >= len(hidden) else hidden
    if not chosen:
        prefix, network = list(_wrapped_networks(module))[-1]
        chosen = [prefix + name for name, _ in network.named_children()]
    return {path: path for path in chosen}


def _expand_to_candidates(paths: Iterable[str], candidates: Mapping[str, nn.Module], kind: str) -> list[str]:
    # A block name resolves to its container path; the candidates inside it are what is monitored.
    selected: set[str] = set()
    for path in paths:
        inside = [path] if path in candidates else [c for c in candidates if c.startswith(path + ".")]
        if not inside:
            raise ValueError(
                f"{kind} {path!r} holds nothing that can be monitored; {kind}s are: {', '.join(candidates)}"
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
            ``layers``, every candidate of these types.
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
    candidates = {name: m for name, m in modules.items() if name} if candidates is None else dict(candidates)
    blocks = module_blocks(module) or {}
    if layers is None and layer_types is not None:
        # A type alone asks for every layer of that type, not for the default layers that happen to have it.
        chosen = {name: name for name in match_layer_types(list(candidates), modules, layer_types)}
    elif layers is None:
        chosen = dict(default(module))
    else:
        paths = match_layer_names(module, layers, candidates, blocks=blocks, expand_containers=leaves, kind=kind)
        if leaves:
            chosen = {path: path for path in _expand_to_candidates(paths, candidates, kind)}
        else:
            by_path = {path: name for name, path in blocks.items()}
            chosen = {by_path.get(path, path): path for path in paths}
        if layer_types is not None:
            kept = set(match_layer_types(list(chosen.values()), modules, layer_types))
            chosen = {name: path for name, path in chosen.items() if path in kept}
    if not chosen:
        raise ValueError(
            f"{type(module).__name__} has no {kind} to monitor by default; name them with layers=[...] "
            f"(module names: {', '.join(candidates) or 'none'})"
        )
    for name in chosen:
        if "/" in name:
            raise ValueError(f"layer name {name!r} contains '/', which separates the parts of a logged key")
    return chosen


# -- one layer's features --------------------------------------------------------------------------------------------


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
        return FeatureLayer(name if name == layer else path, path)
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
            f"submodules are: {', '.join(paths)}"
        )
    return FeatureLayer(f"{linears[-1]}_input", linears[-1], "input")


# -- hooks and modes -------------------------------------------------------------------------------------------------


@contextmanager
def forward_hooks(
    module: nn.Module, layers: Iterable[FeatureLayer], hook: Callable[[FeatureLayer, Any], None]
) -> Iterator[None]:
    """Call ``hook(layer, value)`` whenever one of ``layers`` runs, for the duration of the block.

    ``value`` is what the layer returns (``capture="output"``) or its first positional input (``"input"``). The hooks
    are removed when the block ends, also on error.
    """
    handles = []
    try:
        for layer in layers:
            submodule = module.get_submodule(layer.path)
            if layer.capture == "output":
                handles.append(submodule.register_forward_hook(lambda _m, _a, out, layer=layer: hook(layer, out)))
            else:
                handles.append(submodule.register_forward_pre_hook(lambda _m, args, layer=layer: hook(layer, args[0])))
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def capture_features(module: nn.Module, layers: Sequence[FeatureLayer]) -> Iterator[dict[str, Tensor]]:
    """Hook ``layers`` of ``module`` for the duration of the block; yields ``{layer name: latest features}``.

    The captured tensors are not detached, so gradients can flow from them into the network.
    """
    captured: dict[str, Tensor] = {}

    def store(layer: FeatureLayer, value: Any) -> None:
        if not isinstance(value, Tensor):
            raise TypeError(f"layer {layer.name!r} produced a {type(value).__name__}, expected a tensor")
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


def declared_batch_first(model: nn.Module, path: str) -> bool | None:
    """The token layout that the module at ``path`` declares, or ``None`` when nothing declares one.

    The module itself or its nearest ancestor (the model itself excluded) decides: its own ``batch_first`` flag
    (``nn.MultiheadAttention``, ``nn.Transformer``), else the flag shared by the attention modules inside it
    (``nn.TransformerEncoderLayer``, ``nn.TransformerEncoder``: their ``self_attn``).
    """
    parts = path.split(".") if path else []
    for depth in range(len(parts), 0, -1):
        module = model.get_submodule(".".join(parts[:depth]))
        own = getattr(module, "batch_first", None)
        if isinstance(own, bool):
            return own
        flags = {m.batch_first for m in module.modules() if isinstance(m, nn.MultiheadAttention)}
        if len(flags) == 1:
            return flags.pop()
    return None


# -- batches ---------------------------------------------------------------------------------------------------------


def _describe(batch: Any) -> str:
    if isinstance(batch, Mapping):
        return f"a dict batch with keys {list(batch)}"
    if isinstance(batch, (tuple, list)):
        return f"a {type(batch).__name__} batch of length {len(batch)}"
    return f"a batch of type {type(batch).__name__}"


_NOT_ONE_HOT = "rows that are not one-hot: soft labels, mixup or regression targets are not class labels"


def _read_labels(value: Any) -> tuple[Tensor | None, str, bool]:
    """``(labels, what was found, refused)`` for the value where a batch's labels should be.

    ``labels`` are the ``(B,)`` integer class labels (``None`` when there are none), ``what was found`` a short
    description of ``value`` and ``refused`` whether it is a tensor holding no class labels.
    """
    if value is None:
        return None, "nothing", False
    if not isinstance(value, Tensor):
        return None, f"a {type(value).__name__}", False
    found = f"a Tensor {value.dtype} of shape {tuple(value.shape)}"
    if value.ndim == 1:
        if value.dtype == torch.bool:
            return None, f"{found}: boolean values, not class indices", True
        if value.is_floating_point() or value.is_complex():
            return None, f"{found}: float values, not class indices", True
        return value, found, False
    if value.ndim == 2 and not value.is_complex():
        # One-hot rows (B, C): every entry 0 or 1, exactly one 1 per row; anything else (label smoothing, mixup,
        # regression targets) has no single class per sample.
        is_one_hot = value.shape[1] >= 2 and bool(((value == 0) | (value == 1)).all() & (value.sum(1) == 1).all())
        if is_one_hot:
            return value.to(torch.uint8).argmax(1), f"{found}, one-hot: read as its argmax", False
        return None, f"{found}: {_NOT_ONE_HOT}", True
    return None, f"{found}: {value.ndim} dimensions, not one label per row", True


@dataclass(frozen=True)
class BatchReader:
    """Where the inputs and the class labels of a batch are.

    Batches may be a tensor (inputs only), a tuple or list (``(x, y, ...)``) or a dict (Hugging Face style).

    Attributes:
        input_key: index (tuples/lists) or key (dicts) of the inputs; ``None``: ``batch[0]``, the first of
            :data:`INPUT_KEYS` in a dict, or the batch itself when it is a tensor.
        label_key: index or key of the labels; ``None``: ``batch[1]`` or the first of :data:`LABEL_KEYS`.
        label_fn: ``batch -> labels``, overriding ``label_key``.

    Labels named by ``label_key`` or ``label_fn`` must be there: :meth:`labels` raises at the first batch when they
    are not. Labels looked for at the default places are optional unless asked for (``required``).
    """

    input_key: int | str | None = None
    label_key: int | str | None = None
    label_fn: Callable[[Any], Tensor] | None = None

    def __post_init__(self) -> None:
        for name in ("input_key", "label_key"):
            key = getattr(self, name)
            if key is not None and (isinstance(key, bool) or not isinstance(key, (int, str))):
                raise ValueError(f"{name} must be None, an index or a key, got {key!r}")
        if self.label_fn is not None and not callable(self.label_fn):
            raise ValueError(f"label_fn must be a function batch -> labels, got {self.label_fn!r}")

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
            where = repr(self.input_key) if self.input_key is not None else f"index 0 or one of {list(INPUT_KEYS)}"
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
            where = repr(self.label_key) if self.label_key is not None else f"index 1 or one of {list(LABEL_KEYS)}"
        return f"{where} in {_describe(batch)} (found {found})"

    def label_source(self, batch: Any) -> str:
        """Where the labels of ``batch`` were looked for and what was found there, as a short text.

        For example ``"index 1 or one of ['y', ...] in a dict batch with keys ['x', 'w'] (found nothing)"`` or
        ``"'y' in a dict batch with keys ['x', 'y'] (found a Tensor torch.float32 of shape (4, 3), one-hot: read as
        its argmax)"``: the text of :meth:`labels`' error, for a caller that warns instead of failing when labels
        are optional.
        """
        _, found, _ = _read_labels(self._label_value(batch))
        return self._label_where(batch, found)

    def labels(self, batch: Any, *, required: bool = False) -> Tensor | None:
        """The ``(B,)`` integer class labels of ``batch``; ``None`` when there are none and they are not ``required``.

        Integer labels are returned as they are; one-hot rows ``(B, C)`` (integer, boolean or float, entries 0 or 1,
        a single 1 per row) as their argmax. Other 2-D or float labels (soft labels, mixup, regression targets) and
        booleans are no class labels: ``None``, or an error when the labels are required or named.

        Raises:
            ValueError: no class labels where they should be, and they are ``required`` or were named by
                ``label_key`` / ``label_fn`` (a setup error, so it is raised at the first batch whatever
                ``required``); the message says where it looked, what it found and why it refused it.
        """
        labels, found, refused = _read_labels(self._label_value(batch))
        if labels is not None:
            return labels
        if not required and self.label_key is None and self.label_fn is None:
            return None
        if refused:
            advice = "class metrics need integer labels of shape (B,) or one-hot rows of shape (B, C)"
        else:
            advice = "set label_key (an index for tuples, a key for dicts) or label_fn"
        raise ValueError(f"cannot find integer class labels at {self._label_where(batch, found)}; {advice}")

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
