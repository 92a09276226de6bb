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
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from torch import Tensor, nn

from rank_lightning.functional.reductions import weight_as_matrix
from rank_lightning.layers import eager_name

__all__ = ["FUSED_PARTS", "WeightMatrix", "is_conv1d", "is_weight_layer", "logged_name", "matrices_of"]

FUSED_PARTS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")
"""Suffixes of the parts of a fused query/key/value projection, in their order inside the fused weight."""

_LAYER_TYPES: tuple[type[nn.Module], ...] = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.MultiheadAttention)


def is_conv1d(module: nn.Module) -> bool:
    """Whether ``module`` is ``transformers``' ``Conv1D`` (weight ``(in, out)``, ``y = x W + b``).

    Recognised by class name and defining package, so ``transformers`` is never imported here.
    """
    return any(
        cls.__name__ == "Conv1D" and cls.__module__.split(".")[0] == "transformers" for cls in type(module).__mro__
    )


def is_weight_layer(module: nn.Module) -> bool:
    """Whether a weight monitor can read ``module``: Linear, Conv1d/2d/3d, MultiheadAttention or ``Conv1D``."""
    return isinstance(module, _LAYER_TYPES) or is_conv1d(module)


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
    """

    name: str
    module: nn.Module
    attribute: str = "weight"
    transpose: bool = False
    rows: tuple[int, int] | None = None

    def stored(self) -> Tensor:
        """The tensor as the module holds it now (possibly a shard or a DTensor under a sharding strategy)."""
        return getattr(self.module, self.attribute)

    def row_dims(self, ndim: int) -> tuple[int, ...]:
        """Dimensions of the stored tensor that index the matrix rows (the others index its columns)."""
        return (1,) if self.transpose else (0,)

    def col_dims(self, ndim: int) -> tuple[int, ...]:
        """Dimensions of the stored tensor that index the matrix columns."""
        return (0,) if self.transpose else tuple(range(1, ndim))

    def from_stored(self, tensor: Tensor) -> Tensor:
        """The ``(out, fan_in)`` matrix (a view where possible) of the full stored ``tensor``."""
        matrix = weight_as_matrix(tensor.mT if self.transpose else tensor)
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


def _split(name: str, module: nn.Module, attribute: str, parts: int, *, transpose: bool) -> Iterator[WeightMatrix]:
    size = getattr(module, attribute).shape[1 if transpose else 0] // parts
    suffixes = FUSED_PARTS[len(FUSED_PARTS) - parts :]
    for i, suffix in enumerate(suffixes):
        yield WeightMatrix(f"{name}.{suffix}", module, attribute, transpose, (i * size, (i + 1) * size))


def _attention(name: str, attention: nn.MultiheadAttention, split_fused: bool) -> list[WeightMatrix]:
    if attention.in_proj_weight is None:
        blocks = [WeightMatrix(f"{name}.{part}", attention, f"{part[0]}_proj_weight") for part in FUSED_PARTS]
    elif split_fused:
        blocks = list(_split(name, attention, "in_proj_weight", 3, transpose=False))
    else:
        blocks = [WeightMatrix(f"{name}.in_proj", attention, "in_proj_weight")]
    return [*blocks, WeightMatrix(f"{name}.out_proj", attention.out_proj)]


def _fused_parts(path: str, module: nn.Module) -> int:
    """Number of side-by-side q/k/v parts of a GPT-2 ``c_attn`` (3, or 2 for cross-attention); 1 otherwise."""
    if path.rsplit(".", 1)[-1] != "c_attn":
        return 1
    fan_in, out = module.weight.shape
    return out // fan_in if out in (2 * fan_in, 3 * fan_in) else 1


def matrices_of(path: str, module: nn.Module, *, split_fused: bool = True) -> list[WeightMatrix]:
    """The matrices of one layer, named after its module ``path`` (wrapper segments of FSDP removed).

    Args:
        path: the layer's name as in ``named_modules()``.
        module: a layer for which :func:`is_weight_layer` holds.
        split_fused: read fused query/key/value projections as their parts (module docstring).

    Raises:
        ValueError: ``module`` is not a layer a weight monitor can read.
    """
    name = logged_name(path)
    if isinstance(module, nn.MultiheadAttention):
        return _attention(name, module, split_fused)
    if is_conv1d(module):
        parts = _fused_parts(name, module) if split_fused else 1
        if parts > 1:
            return list(_split(name, module, "weight", parts, transpose=True))
        return [WeightMatrix(name, module, transpose=True)]
    if isinstance(module, _LAYER_TYPES):
        return [WeightMatrix(name, module)]
    raise ValueError(
        f"layer {path!r} is a {type(module).__name__}; weight matrices are read from Linear, Conv1d/2d/3d, "
        "MultiheadAttention and transformers' Conv1D"
    )
