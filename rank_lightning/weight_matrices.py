"""Which matrices a layer holds and how each is read from the stored weight tensor.

Layers store their weights in several layouts; a weight spectrum is only comparable across them when every matrix
is read as ``(out, fan_in)``, the layout of ``nn.Linear`` (rows are output units):

* ``nn.Linear``: the ``(out, in)`` weight as is.
* ``nn.Conv1d/2d/3d``: ``(out, in / groups, *kernel)`` reshaped to ``out x (in / groups * prod(kernel))``.
* ``transformers``' ``Conv1D`` (GPT-2's projections): the weight is stored ``(in, out)`` and the layer computes
  ``y = x W + b``, so the matrix is ``W^T`` and its spectrum is that of the equivalent ``nn.Linear``.
* Fused query/key/value projections, split into their parts by default (``split_fused=True``), named
  ``<layer>.q_proj``, ``<layer>.k_proj``, ``<layer>.v_proj``:

  - ``nn.MultiheadAttention``'s ``in_proj_weight`` ``(3E, E)``: rows ``[0, E)`` are the queries, ``[E, 2E)`` the keys,
    ``[2E, 3E)`` the values (or its separate ``q_proj_weight``, ``k_proj_weight``, ``v_proj_weight`` when the key or
    value width differs); its ``out_proj`` is ``<layer>.out_proj``.
  - GPT-2's ``c_attn`` (a ``Conv1D`` named ``c_attn`` with ``3E`` outputs for ``E`` inputs): q, k and v side by side
    in the output columns of the stored ``(E, 3E)`` weight; with ``2E`` outputs (GPT-2's cross-attention, whose
    queries are the separate ``q_attn``) the parts are ``k_proj`` and ``v_proj``.

  With ``split_fused=False`` a fused projection is one matrix: ``<layer>.in_proj`` for ``nn.MultiheadAttention``
  (``(3E, E)``), ``<layer>`` for ``c_attn`` (``(3E, E)`` after the transpose).

Fused layouts other than these two (heads interleaved, as in GPT-NeoX's ``query_key_value``) are read as one matrix.

Mixture-of-experts layers of ``transformers`` 5.x hold every expert's projection in one 3-D parameter, ``(E, out,
in)``, or ``(E, in, out)`` where the layer declares ``is_transposed`` (GPT-OSS, Aria); ``use_experts_implementation``
sets that flag and ``has_gate`` / ``is_concatenated`` on the layer, and these are what is read. Every expert ``e`` is
measured on its own, named ``<layer>.<e>.<projection>``:

* ``gate_up_proj`` ``(E, 2I, H)`` (Mixtral, Qwen-MoE, DeepSeek): expert ``e``'s gate rows ``[0, I)`` and up rows
  ``[I, 2I)`` (the forward pass chunks the output in two), split like a fused q/k/v projection into
  ``<layer>.<e>.gate_proj`` and ``<layer>.<e>.up_proj``, each ``(I, H)``; with ``split_fused=False``, or where gate
  and up rows alternate (``is_concatenated=False``, GPT-OSS), one matrix ``<layer>.<e>.gate_up_proj`` ``(2I, H)``.
* ``up_proj`` (experts without a gate, ``has_gate=False``) and ``down_proj`` ``(E, H, I)``: ``<layer>.<e>.up_proj``,
  ``<layer>.<e>.down_proj``.

A 3-D parameter in no layout named here (another parameter of an experts layer, or the expert stack of a layer that
declares no layout, such as Llama 4's) is not measured: :func:`unread_stacks` names it, and the monitor warns.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from torch import Tensor, nn

from rank_lightning.functional.reductions import weight_as_matrix
from rank_lightning.layers import eager_name

__all__ = [
    "FUSED_PARTS",
    "GATE_UP_PARTS",
    "WeightMatrix",
    "is_conv1d",
    "is_weight_layer",
    "logged_name",
    "matrices_of",
    "unread_stacks",
]

FUSED_PARTS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")
"""Suffixes of the parts of a fused query/key/value projection, in their order inside the fused weight."""

GATE_UP_PARTS: tuple[str, ...] = ("gate_proj", "up_proj")
"""Suffixes of the parts of an expert's fused ``gate_up_proj``, in their order inside the fused weight."""

_LAYER_TYPES: tuple[type[nn.Module], ...] = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.MultiheadAttention)


def is_conv1d(module: nn.Module) -> bool:
    """Whether ``module`` is ``transformers``' ``Conv1D`` (weight ``(in, out)``, ``y = x W + b``).

    Recognised by class name and defining package, so ``transformers`` is never imported here.
    """
    return any(
        cls.__name__ == "Conv1D" and cls.__module__.split(".")[0] == "transformers" for cls in type(module).__mro__
    )


def is_weight_layer(module: nn.Module) -> bool:
    """Whether a weight monitor reads ``module``: Linear, Conv1d/2d/3d, MultiheadAttention, ``Conv1D``, or a layer
    holding 3-D parameters of its own (expert stacks; :func:`unread_stacks` names those it cannot read)."""
    return isinstance(module, _LAYER_TYPES) or is_conv1d(module) or bool(_stacks(module))


def logged_name(path: str) -> str:
    """``path`` without the segments that ``torch.compile``, FSDP and activation checkpointing insert
    (``net._fsdp_wrapped_module.0`` -> ``net.0``; :func:`~rank_lightning.layers.eager_name`)."""
    return eager_name(path)


@dataclass(frozen=True)
class WeightMatrix:
    """One monitored matrix: the layer that stores it and how it sits in the stored tensor.

    Attributes:
        name: logged name (module path, or ``<path>.q_proj`` ... for the parts of a fused projection).
        module: the layer holding the tensor.
        attribute: name of the tensor on ``module`` (``"weight"``, ``"in_proj_weight"``, ...).
        transpose: the stored tensor is ``(in, out)`` (``Conv1D``); the matrix is its transpose.
        rows: ``(start, stop)`` of the matrix rows this part takes from the full matrix; ``None`` for all rows.
        expert: index into the first dimension of a stored ``(E, ., .)`` expert stack; ``None`` for a layer's own
            weight.
    """

    name: str
    module: nn.Module
    attribute: str = "weight"
    transpose: bool = False
    rows: tuple[int, int] | None = None
    expert: int | None = None

    def stored(self) -> Tensor:
        """The tensor as the module holds it now (possibly a shard or a DTensor under a sharding strategy)."""
        return getattr(self.module, self.attribute)

    def row_dims(self, ndim: int) -> tuple[int, ...]:
        """Dimensions of the stored tensor that index the matrix rows (the others index its columns or experts)."""
        first = 0 if self.expert is None else 1
        return (first + 1,) if self.transpose else (first,)

    def col_dims(self, ndim: int) -> tuple[int, ...]:
        """Dimensions of the stored tensor that index the matrix columns."""
        first = 0 if self.expert is None else 1
        return (first,) if self.transpose else tuple(range(first + 1, ndim))

    def whole(self, tensor: Tensor) -> Tensor:
        """The ``(out, fan_in)`` matrix of ``tensor`` (the stored tensor, or a process's piece of it that holds every
        expert) before a part's rows are taken: the layer's weight or the expert's slice, transposed if stored
        ``(in, out)``, conv kernels flattened."""
        if self.expert is not None:
            tensor = tensor[self.expert]
        return weight_as_matrix(tensor.mT if self.transpose else tensor)

    def from_stored(self, tensor: Tensor) -> Tensor:
        """The ``(out, fan_in)`` matrix (a view where possible) of the full stored ``tensor``."""
        matrix = self.whole(tensor)
        return matrix if self.rows is None else matrix[self.rows[0] : self.rows[1]]

    def shape(self, stored_shape: tuple[int, ...]) -> tuple[int, int]:
        """``(out, fan_in)`` of this matrix, given the shape of the full stored tensor."""
        rows = stored_shape[self.row_dims(len(stored_shape))[0]]
        cols = 1
        for dim in self.col_dims(len(stored_shape)):
            cols *= stored_shape[dim]
        if self.rows is not None:
            rows = self.rows[1] - self.rows[0]
        return rows, cols


def _split(
    name: str,
    module: nn.Module,
    attribute: str,
    suffixes: tuple[str, ...],
    *,
    transpose: bool,
    expert: int | None = None,
) -> Iterator[WeightMatrix]:
    """The parts of a fused projection whose rows hold ``suffixes`` one after the other, in equal blocks."""
    whole = WeightMatrix(name, module, attribute, transpose, expert=expert)
    size = whole.shape(tuple(whole.stored().shape))[0] // len(suffixes)
    for i, suffix in enumerate(suffixes):
        yield WeightMatrix(f"{name}.{suffix}", module, attribute, transpose, (i * size, (i + 1) * size), expert)


def _attention(name: str, attention: nn.MultiheadAttention, split_fused: bool) -> list[WeightMatrix]:
    if attention.in_proj_weight is None:
        blocks = [WeightMatrix(f"{name}.{part}", attention, f"{part[0]}_proj_weight") for part in FUSED_PARTS]
    elif split_fused:
        blocks = list(_split(name, attention, "in_proj_weight", FUSED_PARTS, transpose=False))
    else:
        blocks = [WeightMatrix(f"{name}.in_proj", attention, "in_proj_weight")]
    return [*blocks, WeightMatrix(f"{name}.out_proj", attention.out_proj)]


def _fused_parts(path: str, module: nn.Module) -> int:
    """Number of side-by-side q/k/v parts of a GPT-2 ``c_attn`` (3, or 2 for cross-attention); 1 otherwise."""
    if path.rsplit(".", 1)[-1] != "c_attn":
        return 1
    fan_in, out = module.weight.shape
    return out // fan_in if out in (2 * fan_in, 3 * fan_in) else 1


def _stacks(module: nn.Module) -> dict[str, Tensor]:
    """The 3-D parameters ``module`` holds itself (not its children's): expert stacks, read or not.

    A layer that declares no expert layout counts only stacks of more than one matrix: a ``(1, T, D)`` class token or
    position table is no stack of weight matrices.
    """
    if isinstance(module, _LAYER_TYPES) or is_conv1d(module):
        return {}
    declared = _expert_layout(module) is not None
    return {
        name: p for name, p in module.named_parameters(recurse=False) if p.ndim == 3 and (declared or p.shape[0] > 1)
    }


def _expert_layout(module: nn.Module) -> tuple[bool, bool, bool] | None:
    """``(is_transposed, is_concatenated, has_gate)`` as ``transformers``' ``use_experts_implementation`` sets them on
    an experts layer; ``None`` for a layer that declares no layout."""
    transposed, gated = getattr(module, "is_transposed", None), getattr(module, "has_gate", None)
    if not isinstance(transposed, bool) or not isinstance(gated, bool):
        return None
    return transposed, bool(getattr(module, "is_concatenated", True)), gated


def _expert_projections(module: nn.Module) -> tuple[str, ...]:
    """Names of the expert stacks of ``module`` that are read, in the order of the forward pass."""
    layout = _expert_layout(module)
    if layout is None:
        return ()
    stacks = _stacks(module)
    names = ("gate_up_proj" if layout[2] else "up_proj", "down_proj")
    return tuple(name for name in names if name in stacks)


def unread_stacks(module: nn.Module) -> list[str]:
    """Names of the 3-D parameters of ``module`` (its own) that :func:`matrices_of` does not read, because no layout
    says which dimensions are an expert's rows and columns (module docstring)."""
    read = _expert_projections(module)
    return [name for name in _stacks(module) if name not in read]


def _experts(name: str, module: nn.Module, split_fused: bool) -> list[WeightMatrix]:
    """Every expert's matrices, expert by expert, each in the order of the forward pass."""
    projections = _expert_projections(module)
    if not projections:
        return []
    transposed, concatenated, _ = _expert_layout(module)  # type: ignore[misc]
    count = max(getattr(module, attribute).shape[0] for attribute in projections)
    matrices: list[WeightMatrix] = []
    for expert in range(count):
        for attribute in projections:
            if expert >= getattr(module, attribute).shape[0]:
                continue
            prefix = f"{name}.{expert}"
            if attribute == "gate_up_proj" and split_fused and concatenated:
                matrices += _split(prefix, module, attribute, GATE_UP_PARTS, transpose=transposed, expert=expert)
            else:
                matrices.append(WeightMatrix(f"{prefix}.{attribute}", module, attribute, transposed, expert=expert))
    return matrices


def matrices_of(path: str, module: nn.Module, *, split_fused: bool = True) -> list[WeightMatrix]:
    """The matrices of one layer, named after its module ``path`` (wrapper segments of FSDP removed).

    Args:
        path: the layer's name as in ``named_modules()``.
        module: a layer for which :func:`is_weight_layer` holds.
        split_fused: read fused query/key/value projections and experts' fused gate/up projections as their parts
            (module docstring).

    Returns:
        The matrices in the order of the forward pass; none for a layer whose 3-D parameters are in no known layout
        (:func:`unread_stacks` names them).

    Raises:
        ValueError: ``module`` is not a layer a weight monitor can read.
    """
    name = logged_name(path)
    if isinstance(module, nn.MultiheadAttention):
        return _attention(name, module, split_fused)
    if is_conv1d(module):
        parts = _fused_parts(name, module) if split_fused else 1
        if parts > 1:
            return list(_split(name, module, "weight", FUSED_PARTS[len(FUSED_PARTS) - parts :], transpose=True))
        return [WeightMatrix(name, module, transpose=True)]
    if isinstance(module, _LAYER_TYPES):
        return [WeightMatrix(name, module)]
    if _stacks(module):
        return _experts(name, module, split_fused)
    raise ValueError(
        f"layer {path!r} is a {type(module).__name__}; weight matrices are read from Linear, Conv1d/2d/3d, "
        "MultiheadAttention, transformers' Conv1D and layers holding 3-D expert stacks"
    )
