"""Which matrices a layer holds and how each is read from the stored weight tensor.

Layers store their weights in several layouts; a weight spectrum is only comparable across them when every matrix
is read as ``(out, fan_in)``, the layout of ``nn.Linear`` (rows are output units):

* ``nn.Linear``: the ``(out, in)`` weight as is.
* ``nn.Conv1d/2d/3d``: ``(out, in / groups, *kernel)`` reshaped to ``out x (in / groups * prod(kernel))``. With
  ``groups > 1`` (ResNeXt, RegNet, depthwise convs) these rows stack the filters of ``groups`` independent blocks; the
  layer's map is the block-diagonal matrix of those blocks, and its spectrum, the union of the blocks' spectra, is
  what is measured (:attr:`WeightMatrix.groups`, :func:`~rank_lightning.functional.weights.weight_spectra`).
* ``transformers``' ``Conv1D`` (GPT-2's projections): the weight is stored ``(in, out)`` and the layer computes
  ``y = x W + b``, so the matrix is ``W^T`` and its spectrum is that of the equivalent ``nn.Linear``.
* Fused query/key/value projections, split into their parts by default (``split_fused=True``), named
  ``<layer>.q_proj``, ``<layer>.k_proj``, ``<layer>.v_proj`` (Phi-3's fused gate/up projection likewise, into
  ``<layer>.gate_proj`` and ``<layer>.up_proj``):

  - ``nn.MultiheadAttention``'s ``in_proj_weight`` ``(3E, E)``: rows ``[0, E)`` are the queries, ``[E, 2E)`` the keys,
    ``[2E, 3E)`` the values (or its separate ``q_proj_weight``, ``k_proj_weight``, ``v_proj_weight`` when the key or
    value width differs); its ``out_proj`` is ``<layer>.out_proj``.
  - GPT-2's ``c_attn`` (a ``Conv1D`` named ``c_attn`` with ``3E`` outputs for ``E`` inputs): q, k and v side by side
    in the output columns of the stored ``(E, 3E)`` weight; with ``2E`` outputs (GPT-2's cross-attention, whose
    queries are the separate ``q_attn``) the parts are ``k_proj`` and ``v_proj``.
  - A fused ``nn.Linear`` whose attention or MLP layer (its parent module, wrappers skipped: :func:`parent_layer`)
    is one of the classes below, split as that class's forward pass cuts the output, with the sizes its settings
    give (``D``: head size, ``H`` query heads, ``G`` key/value heads, ``E`` width); the parts of a per-head layout
    take their rows from every head (or group) in turn, in the order of the heads:

    * GPT-NeoX / Pythia ``GPTNeoXAttention.query_key_value``, Bloom ``BloomAttention.query_key_value``: per head,
      ``q (D) | k (D) | v (D)``.
    * Falcon ``FalconAttention.query_key_value``: with ``new_decoder_architecture``, per group of ``H / G`` heads,
      ``q (H / G * D) | k (D) | v (D)``; else with ``multi_query``, ``q (E) | k (D) | v (D)``; else per head,
      ``q (D) | k (D) | v (D)``.
    * Phi-3 ``Phi3Attention.qkv_proj``: ``q (H * D) | k (G * D) | v (G * D)``; Phi-3 ``Phi3MLP.gate_up_proj``
      (``I``: its ``intermediate_size``): ``gate (I) | up (I)``, named ``<layer>.gate_proj`` and ``<layer>.up_proj``.
    * GPT-BigCode ``GPTBigCodeAttention.c_attn`` (an ``nn.Linear``): with ``multi_query``,
      ``q (E) | k (D) | v (D)``; else per head, ``q (D) | k (D) | v (D)``.
    * timm's ``Attention.qkv`` (``timm.layers.attention``, the attention of its ViTs; defined in
      ``timm.models.vision_transformer`` by earlier timm 1.0 releases): ``q (H * D) | k (H * D) | v (H * D)``.
    * CodeGen ``CodeGenAttention.qkv_proj``: in every one of its ``mp_num`` (4) blocks of ``3 E / mp_num`` rows,
      ``q | v | k`` (values before keys), ``E / mp_num`` rows each; named, like every split, in the order q, k, v.
    * GPT-NeoX-Japanese ``GPTNeoXJapaneseAttention.query_key_value``, Persimmon
      ``PersimmonAttention.query_key_value``, DeBERTa ``DisentangledSelfAttention.in_proj``: per head,
      ``q (D) | k (D) | v (D)``.
    * DBRX ``DbrxAttention.Wqkv``: ``q (E) | k (G * D) | v (G * D)``.
    * A third of the rows each, ``q | k | v`` (the forward pass reshapes the output ``(..., 3, heads, head_dim)``
      or chunks it in three): ModernBERT ``ModernBertAttention.Wqkv``, MPT ``MptAttention.Wqkv``, Bark
      ``BarkSelfAttention.att_proj``, the ``qkv`` of the vision encoders of Qwen2-VL, Qwen2.5-VL, Qwen3-VL, GLM-4V,
      SAM (and SAM-HQ, GOT-OCR2, SegGPT, ViTDet, which took over its attention), BLIP, BLIP-2 and InstructBLIP;
      and the ``qkv`` of timm's ``AttentionRope``,
      ``AttentionPool2d``, ``DiffAttention``, BEiT ``Attention``, EVA ``EvaAttention``, Swin (v1, v2)
      ``WindowAttention``, Swin v2 CR ``WindowMultiHeadAttention``, CaiT ``TalkingHeadAttn``, XCiT ``XCA``,
      EdgeNeXt ``CrossCovarianceAttn``, Twins ``LocallyGroupedAttn``, MViT v2 and Hiera-Det ``MultiScaleAttention``,
      Hiera ``MaskUnitAttention``, ConViT ``MHSA``, DaViT ``ChannelAttention``, ``ChannelAttentionV2`` and
      ``WindowAttention``, and the ``Attention`` of NesT, FastViT, MetaFormer, VOLO and timm's SAM ViT,
      ``RelPosAttention``; MaxViT ``AttentionCl`` with ``head_first=False`` (with ``head_first=True``, per head
      ``q (D) | k (D) | v (D)``); GC ViT ``WindowAttentionGlobal`` (with ``use_global``, ``k | v``, halves).
    * timm's fused key/value ``kv`` (the queries are a Linear of their own): ``k | v``, halves, named
      ``<layer>.k_proj`` and ``<layer>.v_proj``: PVT v2 ``Attention``, Twins ``GlobalSubSampleAttn``, VOLO
      ``ClassAttention``, ``AttentionPoolLatent``.
    * TinyViT and EfficientFormer ``Attention.qkv`` (``Dk``: key width, ``Dv``: value width of a head): per head,
      ``q (Dk) | k (Dk) | v (Dv)``; LeViT likewise for the Linear of the ``LinearNorm`` (Linear, then batch norm)
      ``qkv`` of its ``Attention`` (``<layer>.qkv.linear``, whose layer is the attention:
      :func:`parent_layer`), and ``k (Dk) | v (Dv)`` per head for its ``AttentionDownsample.kv``.

    The class is recognised by its name and defining module, not a subclass's (whose forward pass may cut the
    output another way), except transformers 4.x's ``SdpaAttention`` and ``FlashAttention2`` subclasses of the
    GPT-NeoX, Phi-3 and GPT-BigCode attentions (what their ``attn_implementation`` picks), which cut it as their
    base. A layer of one of these classes whose weight does not hold its layout, or whose settings (head size, head
    counts) are not found, is one matrix with a warning naming it; a cross-attention
    ``GPTBigCodeAttention`` (whose forward pass takes keys and values of one head's width) and every other fused
    ``nn.Linear`` (a ``query_key_value`` or ``qkv`` of a model not named here, models loaded with
    ``trust_remote_code``) are one matrix, as are fused 1x1 convolutions (MaxViT's ``Attention2d``, LeViT with
    ``use_conv``). The package's own ViT (torchvision's encoder) holds ``nn.MultiheadAttention``, split as above.

  With ``split_fused=False`` a fused projection is one matrix: ``<layer>.in_proj`` for ``nn.MultiheadAttention``
  (``(3E, E)``), ``<layer>`` for ``c_attn`` (``(3E, E)`` after the transpose) and for a fused ``nn.Linear``.

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

A LoRA layer of ``peft`` (:func:`is_lora_layer`) wraps its base layer (``<layer>.base_layer``) and adds the update
``(alpha / r) B A`` of its adapters (the Linears ``<layer>.lora_A.<adapter>`` ``(r, in)`` and
``<layer>.lora_B.<adapter>`` ``(out, r)``). It is read as one layer, named ``<layer>`` as in the model without peft:
its matrices are those of the base layer (a ``c_attn`` or fused ``nn.Linear`` split into its parts), each holding
the weight the layer applies, the stored base weight plus the update of every active adapter (``peft``'s
``get_delta_weight``, added as ``merge`` adds it, so the spectra are those of the merged model); and, with
``lora_update=True``, the update alone, ``<matrix>.lora_update`` (``<layer>.q_proj.lora_update``, ...: rank at most
``r``). A merged layer's base weight holds its update already; a layer whose adapters are disabled applies its base
weight alone. The base layer and the adapters' factors are not read on their own. A LoRA layer whose applied weight
is not ``W + (alpha / r) B A`` (DoRA and other variants, a base layer other than Linear, Conv or ``Conv1D``, a
quantized base weight) is not read as one layer (:func:`lora_unread_reason` says why): its base layer and factors
are read as the layers they are.

Every decision that depends on a shape (whether a ``c_attn`` holds two or three parts, whether a fused ``nn.Linear``
holds the rows of its layer's layout, which parameters are 3-D stacks, how many experts a stack holds) takes the shape
of the whole parameter, not of the piece a sharding strategy leaves on this process (:func:`parameter_shape`): a
``DTensor``'s global shape, DeepSpeed ZeRO-3's ``ds_shape``, and for FSDP1 with ``use_orig_params=True`` (whose
parameters are 1-D slices, or empty, between forward passes) the shape its flat parameter records, passed in as
``shapes`` (:func:`rank_lightning.distributed.fsdp_parameter_shapes`; a fused ``nn.Linear`` not in ``shapes`` falls back
on its ``out_features`` and ``in_features``). The rows of a part of a fused projection are found when the matrix is
read, from the whole tensor then in hand (:meth:`WeightMatrix.from_stored`), or from the global row offset of a
process's piece of it (:meth:`WeightMatrix.local_rows`).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn

from rank_lightning.functional.reductions import weight_as_matrix
from rank_lightning.layers import eager_name

__all__ = [
    "FUSED_PARTS",
    "GATE_UP_PARTS",
    "LORA_UPDATE_SUFFIX",
    "ParameterShapes",
    "WeightMatrix",
    "is_conv1d",
    "is_lora_layer",
    "is_weight_layer",
    "logged_name",
    "lora_unread_reason",
    "lora_weight",
    "matrices_of",
    "parameter_shape",
    "parent_layer",
    "unread_stacks",
]

FUSED_PARTS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")
"""Suffixes of the parts of a fused query/key/value projection, in their order inside the fused weight."""

GATE_UP_PARTS: tuple[str, ...] = ("gate_proj", "up_proj")
"""Suffixes of the parts of an expert's fused ``gate_up_proj``, in their order inside the fused weight."""

LORA_UPDATE_SUFFIX = ".lora_update"
"""Ending of the name of a LoRA layer's update matrix, ``<matrix>.lora_update`` (see :func:`matrices_of`)."""

_LAYER_TYPES: tuple[type[nn.Module], ...] = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.MultiheadAttention)
_EXPERT_STACKS: tuple[str, ...] = ("gate_up_proj", "up_proj", "down_proj")

ParameterShapes = Mapping[tuple[int, str], tuple[int, ...]]
"""Full shapes of parameters that this process holds only a flat piece of, keyed by ``(id(module), attribute)``:
what FSDP1's flat parameters record (:func:`rank_lightning.distributed.fsdp_parameter_shapes`)."""


def parameter_shape(module: nn.Module, attribute: str, shapes: ParameterShapes | None = None) -> tuple[int, ...] | None:
    """Shape of the whole tensor ``module.<attribute>``, whichever piece of it this process holds.

    ``shapes`` first (FSDP1's records), then DeepSpeed ZeRO-3's ``ds_shape`` (the stored tensor is an empty
    placeholder), then the tensor's own shape (a ``DTensor``'s is its global shape; FSDP1 with
    ``use_orig_params=False`` leaves views of the full shape). ``None`` for a parameter that FSDP1 with
    ``use_orig_params=True`` has flattened into a 1-D slice and that ``shapes`` does not hold: its shape is recorded
    only in the wrapped unit.
    """
    known = None if shapes is None else shapes.get((id(module), attribute))
    if known is not None:
        return tuple(known)
    tensor = getattr(module, attribute)
    ds_shape = getattr(tensor, "ds_shape", None)
    if ds_shape is not None:
        return tuple(ds_shape)
    if getattr(tensor, "_fsdp_flattened", False) and tensor.ndim <= 1:  # FSDP1's mark on the original parameters
        return None
    return tuple(tensor.shape)


def _unknown_shape(name: str, module: nn.Module, attributes: list[str]) -> ValueError:
    held = ", ".join(f"{type(module).__name__}.{attribute}" for attribute in attributes)
    return ValueError(
        f"the full shape of {held} (layer {name!r}) is not known on this process: FSDP1 (FSDPStrategy, "
        "FullyShardedDataParallel with use_orig_params=True) holds each process's piece of it as a 1-D slice, and only "
        "the wrapped unit records its shape. Select the layers before wrapping the model (as the Trainer does at "
        "setup), or select them on the wrapped model (or on a LightningModule attached to the Trainer, whose "
        "trainer.model is searched), so that the units are found."
    )


def is_conv1d(module: nn.Module) -> bool:
    """Whether ``module`` is ``transformers``' ``Conv1D`` (weight ``(in, out)``, ``y = x W + b``).

    Recognised by class name and defining package, so ``transformers`` is never imported here.
    """
    return any(
        cls.__name__ == "Conv1D" and cls.__module__.split(".")[0] == "transformers" for cls in type(module).__mro__
    )


def is_weight_layer(module: nn.Module, *, shapes: ParameterShapes | None = None) -> bool:
    """Whether a weight monitor reads ``module``: Linear, Conv1d/2d/3d, MultiheadAttention, ``Conv1D``, a LoRA layer
    of ``peft`` that is read as one layer (:func:`lora_unread_reason`), or a layer holding 3-D parameters of its own
    (expert stacks; :func:`unread_stacks` names those it cannot read), judged by the full shapes (``shapes``:
    :func:`parameter_shape`)."""
    return (
        isinstance(module, _LAYER_TYPES)
        or is_conv1d(module)
        or (is_lora_layer(module) and lora_unread_reason(module) is None)
        or bool(_stacks(module, shapes))
        or bool(_unknown_stacks(module, shapes))
    )


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
        part: ``(index, count)``: this matrix is the ``index``-th of ``count`` equal blocks of rows of the full matrix
            (a part of a fused projection); ``None`` for all rows. The rows themselves are found from the whole
            tensor's shape when it is read (:meth:`row_range`), never from a shard's.
        expert: index into the first dimension of a stored ``(E, ., .)`` expert stack; ``None`` for a layer's own
            weight.
        lora: the ``peft`` LoRA layer whose base layer is ``module``: the stored tensor is then the weight the LoRA
            layer applies (base weight plus its adapters' update, :func:`lora_weight`); ``None`` for other layers.
        lora_update: with ``lora``, the stored tensor is the adapters' update alone.
        groups: the ``groups`` of a conv layer: the ``(out, fan_in)`` matrix holds that many blocks of rows, each
            acting on its own ``in / groups`` input channels, and the spectrum is that of the block-diagonal matrix
            they form (``out x (fan_in * groups)``); 1 for every other matrix.
        rows: ``(start, stop, period)``: this matrix takes rows ``[start, stop)`` of every consecutive block of
            ``period`` rows of the full matrix, in order (a part of a fused projection whose layout the attention
            layer fixes: heads interleaved, as in GPT-NeoX, or parts of unequal sizes, ``period`` then the full row
            count); ``None`` where ``part`` says which rows.
    """

    name: str
    module: nn.Module
    attribute: str = "weight"
    transpose: bool = False
    part: tuple[int, int] | None = None
    expert: int | None = None
    lora: nn.Module | None = None
    lora_update: bool = False
    groups: int = 1
    rows: tuple[int, int, int] | None = None

    @property
    def is_part(self) -> bool:
        """Whether this matrix takes some rows of the stored matrix only (a part of a fused projection)."""
        return self.part is not None or self.rows is not None

    def stored(self) -> Tensor:
        """The tensor as the module holds it now (possibly a shard or a DTensor under a sharding strategy); for a LoRA
        layer, the weight it applies (or its update) in the layout of the stored base weight."""
        tensor = getattr(self.module, self.attribute)
        if self.lora is None:
            return tensor
        return lora_weight(self.lora, tensor, update=self.lora_update, name=self.name)

    def stored_dtype(self) -> torch.dtype:
        """The dtype of :meth:`stored`, without computing a LoRA layer's weight."""
        tensor = getattr(self.module, self.attribute)
        return tensor.dtype if self.lora is None or not self.lora_update else _update_dtype(self.lora, tensor)

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

    def row_range(self, stored_shape: tuple[int, ...]) -> tuple[int, int]:
        """``(start, stop)`` of the rows this matrix takes from the full matrix, given the shape of the full stored
        tensor (all rows unless it is a part); for ``rows`` repeated in every block of ``period`` rows, the range
        they take in the first block."""
        rows = stored_shape[self.row_dims(len(stored_shape))[0]]
        if self.rows is not None:
            return self.rows[0], self.rows[1]
        if self.part is None:
            return 0, rows
        index, count = self.part
        size = rows // count
        return index * size, (index + 1) * size

    def _blocks(self, stored_shape: tuple[int, ...]) -> int:
        """How many blocks of ``period`` rows the full matrix holds (1 unless ``rows`` is periodic)."""
        if self.rows is None:
            return 1
        total = stored_shape[self.row_dims(len(stored_shape))[0]]
        period = self.rows[2]
        if total % period:
            raise ValueError(
                f"matrix {self.name!r} takes rows {self.rows[0]}:{self.rows[1]} of every {period} rows of "
                f"{type(self.module).__name__}.{self.attribute}, whose {total} rows are not a multiple of {period}"
            )
        return total // period

    def local_rows(self, stored_shape: tuple[int, ...], first: int, count: int) -> slice | Tensor:
        """Indices, into a piece holding rows ``[first, first + count)`` of the full matrix, of the rows of this
        matrix that the piece holds (a slice where they are contiguous)."""
        start, stop = self.row_range(stored_shape)
        blocks = self._blocks(stored_shape)
        if blocks == 1:
            return slice(min(max(start - first, 0), count), min(max(stop - first, 0), count))
        period = self.rows[2]  # type: ignore[index]
        rows = (torch.arange(blocks)[:, None] * period + torch.arange(start, stop)).reshape(-1) - first
        return rows[(rows >= 0) & (rows < count)]

    def from_stored(self, tensor: Tensor) -> Tensor:
        """The ``(out, fan_in)`` matrix (a view where possible) of the full stored ``tensor``."""
        matrix = self.whole(tensor)
        if not self.is_part:
            return matrix
        start, stop = self.row_range(tuple(tensor.shape))
        blocks = self._blocks(tuple(tensor.shape))
        if blocks == 1:
            return matrix[start:stop]
        # Rows [start, stop) of every block of ``period`` rows, block after block.
        return matrix.reshape(blocks, -1, matrix.shape[-1])[:, start:stop].reshape(-1, matrix.shape[-1])

    def shape(self, stored_shape: tuple[int, ...]) -> tuple[int, int]:
        """``(out, fan_in)`` of this matrix, given the shape of the full stored tensor."""
        start, stop = self.row_range(stored_shape)
        cols = 1
        for dim in self.col_dims(len(stored_shape)):
            cols *= stored_shape[dim]
        return (stop - start) * self._blocks(stored_shape), cols


def _split(
    name: str,
    module: nn.Module,
    attribute: str,
    suffixes: tuple[str, ...],
    *,
    transpose: bool,
    expert: int | None = None,
) -> Iterator[WeightMatrix]:
    """The parts of a fused projection whose rows hold ``suffixes`` one after the other, in equal blocks (their rows
    are found from the whole tensor when it is read)."""
    for i, suffix in enumerate(suffixes):
        yield WeightMatrix(f"{name}.{suffix}", module, attribute, transpose, (i, len(suffixes)), expert)


def _attention(name: str, attention: nn.MultiheadAttention, split_fused: bool) -> list[WeightMatrix]:
    if attention.in_proj_weight is None:
        blocks = [WeightMatrix(f"{name}.{part}", attention, f"{part[0]}_proj_weight") for part in FUSED_PARTS]
    elif split_fused:
        blocks = list(_split(name, attention, "in_proj_weight", FUSED_PARTS, transpose=False))
    else:
        blocks = [WeightMatrix(f"{name}.in_proj", attention, "in_proj_weight")]
    return [*blocks, WeightMatrix(f"{name}.out_proj", attention.out_proj)]


def _fused_parts(path: str, module: nn.Module, shapes: ParameterShapes | None) -> int:
    """Number of side-by-side q/k/v parts of a GPT-2 ``c_attn`` (3, or 2 for cross-attention); 1 otherwise.

    Read from the full weight's shape ``(in, out)``, or where this process cannot know it, from the ``nx`` and ``nf``
    (inputs and outputs) that ``Conv1D`` records.
    """
    if path.rsplit(".", 1)[-1] != "c_attn":
        return 1
    shape = parameter_shape(module, "weight", shapes)
    if shape is None:
        declared = getattr(module, "nx", None), getattr(module, "nf", None)
        if not all(isinstance(size, int) for size in declared):
            raise _unknown_shape(path, module, ["weight"])
        shape = declared
    fan_in, out = shape
    return out // fan_in if out in (2 * fan_in, 3 * fan_in) else 1


_TRANSFORMERS = "transformers.models.{0}.modeling_{0}"


def _attention_classes(model: str) -> tuple[str, ...]:
    """``<model>Attention`` and the subclasses that transformers 4.x picks by ``attn_implementation`` (sdpa, the
    default, and flash-attention 2), whose forward passes cut the fused output as ``<model>Attention``'s."""
    return f"{model}Attention", f"{model}SdpaAttention", f"{model}FlashAttention2"


def _class_is(module: nn.Module | None, where: str, *names: str) -> bool:
    """Whether ``module``'s own class (not a subclass, whose forward pass may cut the output another way) is one of
    ``names`` defined in the module ``where``; recognised by name, so its package is never imported here."""
    cls = type(module)
    return cls.__name__ in names and cls.__module__ == where


def _int(module: nn.Module | object, *path: str) -> int | None:
    """The integer attribute ``module.<path[0]>.<path[1]>...``; ``None`` where it is missing or not an integer."""
    value: object = module
    for attribute in path:
        value = getattr(value, attribute, None)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


_UNREAD_SETTINGS = "its settings (head size, head counts) are not found where its forward pass reads them"
"""What :func:`_fused_rows` gives for a layer of a known class whose layout cannot be told."""


def _fused_rows(
    child: str, parent: nn.Module | None
) -> tuple[tuple[str, ...], tuple[int, ...] | None, int | None] | str | None:
    """``(parts, sizes, period)`` of a fused ``nn.Linear`` named ``child`` inside the layer ``parent``, as the
    parent's forward pass cuts its output: every block of ``period`` rows holds the parts one after the other,
    ``sizes`` rows each (``period`` is ``None`` for one block, the whole matrix; ``sizes`` is ``None`` for parts of
    equal size, whatever the rows, as a forward pass that reshapes to ``(..., 3, heads, -1)`` cuts them; the parts
    named in the order of the weight's rows, CodeGen's ``q | v | k``). ``None`` for a layer in no layout
    named in the module docstring (a GPT-BigCode cross-attention included); :data:`_UNREAD_SETTINGS` for a layer of
    such a class whose settings (head size, head counts) are not found or do not fit its layout.
    """
    if (
        _class_is(parent, _TRANSFORMERS.format("gpt_neox"), *_attention_classes("GPTNeoX"))
        and child == "query_key_value"
    ):
        head = _int(parent, "head_size")  # view(..., heads, 3 * head_size), then chunk(3): per head q | k | v
        return _UNREAD_SETTINGS if head is None else (FUSED_PARTS, (head,) * 3, 3 * head)
    if _class_is(parent, _TRANSFORMERS.format("bloom"), "BloomAttention") and child == "query_key_value":
        head = _int(parent, "head_dim")  # view(..., heads, 3, head_dim)
        return _UNREAD_SETTINGS if head is None else (FUSED_PARTS, (head,) * 3, 3 * head)
    if (
        _class_is(parent, _TRANSFORMERS.format("falcon"), "FalconAttention", "FalconFlashAttention2")
        and child == "query_key_value"
    ):
        head, heads, kv_heads = _int(parent, "head_dim"), _int(parent, "num_heads"), _int(parent, "num_kv_heads")
        if head is None or heads is None:
            return _UNREAD_SETTINGS
        if getattr(parent, "new_decoder_architecture", None) is True:
            # view(..., kv_heads, heads / kv_heads + 2, head_dim): each group's queries, then its key and value.
            if kv_heads is None or heads % kv_heads:
                return _UNREAD_SETTINGS
            queries = heads // kv_heads * head
            return FUSED_PARTS, (queries, head, head), queries + 2 * head
        if getattr(parent, "multi_query", None) is True:
            return FUSED_PARTS, (heads * head, head, head), None  # view(..., heads + 2, head_dim)
        if getattr(parent, "multi_query", None) is False:
            return FUSED_PARTS, (head,) * 3, 3 * head  # view(..., heads, 3, head_dim)
        return _UNREAD_SETTINGS
    if _class_is(parent, _TRANSFORMERS.format("phi3"), *_attention_classes("Phi3")) and child == "qkv_proj":
        head, heads = _int(parent, "head_dim"), _int(parent, "config", "num_attention_heads")
        kv_heads = _int(parent, "num_key_value_heads")
        if head is None or heads is None or kv_heads is None:
            return _UNREAD_SETTINGS
        return FUSED_PARTS, (heads * head, kv_heads * head, kv_heads * head), None
    if _class_is(parent, _TRANSFORMERS.format("phi3"), "Phi3MLP") and child == "gate_up_proj":
        size = _int(parent, "config", "intermediate_size")  # chunk(2): gate, then up
        return _UNREAD_SETTINGS if size is None else (GATE_UP_PARTS, (size, size), None)
    if _class_is(parent, _TRANSFORMERS.format("gpt_bigcode"), *_attention_classes("GPTBigCode")) and child == "c_attn":
        head, heads, kv = _int(parent, "head_dim"), _int(parent, "num_heads"), _int(parent, "kv_dim")
        if head is None or heads is None:
            return _UNREAD_SETTINGS
        if getattr(parent, "is_cross_attention", None) is not False:
            return None  # cross-attention: keys and values of the encoder states, split by the forward pass per head
        if getattr(parent, "multi_query", None) is True:
            return _UNREAD_SETTINGS if kv is None else (FUSED_PARTS, (heads * head, kv, kv), None)  # split((E, kv, kv))
        if getattr(parent, "multi_query", None) is False:
            return FUSED_PARTS, (head,) * 3, 3 * head  # view(..., heads, 3 * head_dim), split(3 * [head_dim])
        return _UNREAD_SETTINGS
    timm_vit = ("timm.layers.attention", "timm.models.vision_transformer")  # where later / earlier timm defines it
    if any(_class_is(parent, where, "Attention") for where in timm_vit) and child == "qkv":
        head, heads = _int(parent, "head_dim"), _int(parent, "num_heads")  # reshape(B, N, 3, heads, head_dim)
        return _UNREAD_SETTINGS if head is None or heads is None else (FUSED_PARTS, (heads * head,) * 3, None)
    cls = type(parent)
    parts = _EQUAL_PARTS.get((cls.__module__, cls.__name__, child))
    if parts is not None:
        return parts, None, None
    return _per_head_rows(child, parent)


_TIMM_MODELS = "timm.models.{0}"

_EQUAL_PARTS: dict[tuple[str, str, str], tuple[str, ...]] = {
    (where, cls, child): parts
    for where, classes, child, parts in [
        # reshape(..., 3, heads, head_dim) (or chunk(3)) with the 3 outermost: q | k | v, a third of the rows each.
        ("timm.layers.attention", ("AttentionRope",), "qkv", FUSED_PARTS),
        ("timm.layers.attention_pool2d", ("AttentionPool2d",), "qkv", FUSED_PARTS),
        ("timm.layers.diff_attention", ("DiffAttention",), "qkv", FUSED_PARTS),
        (_TIMM_MODELS.format("beit"), ("Attention",), "qkv", FUSED_PARTS),
        (_TIMM_MODELS.format("cait"), ("TalkingHeadAttn",), "qkv", FUSED_PARTS),
        (_TIMM_MODELS.format("convit"), ("MHSA",), "qkv", FUSED_PARTS),
        (
            _TIMM_MODELS.format("davit"),
            ("ChannelAttention", "ChannelAttentionV2", "WindowAttention"),
            "qkv",
            FUSED_PARTS,
        ),
        (_TIMM_MODELS.format("edgenext"), ("CrossCovarianceAttn",), "qkv", FUSED_PARTS),
        (_TIMM_MODELS.format("eva"), ("EvaAttention",), "qkv", FUSED_PARTS),
        (_TIMM_MODELS.format("fastvit"), ("Attention",), "qkv", FUSED_PARTS),
        (_TIMM_MODELS.format("hiera"), ("MaskUnitAttention",), "qkv", FUSED_PARTS),
        (_TIMM_MODELS.format("hieradet_sam2"), ("MultiScaleAttention",), "qkv", FUSED_PARTS),
        (_TIMM_MODELS.format("metaformer"), ("Attention",), "qkv", FUSED_PARTS),
        (_TIMM_MODELS.format("mvitv2"), ("MultiScaleAttention",), "qkv", FUSED_PARTS),
        (_TIMM_MODELS.format("nest"), ("Attention",), "qkv", FUSED_PARTS),
        (_TIMM_MODELS.format("swin_transformer"), ("WindowAttention",), "qkv", FUSED_PARTS),
        (_TIMM_MODELS.format("swin_transformer_v2"), ("WindowAttention",), "qkv", FUSED_PARTS),
        (_TIMM_MODELS.format("swin_transformer_v2_cr"), ("WindowMultiHeadAttention",), "qkv", FUSED_PARTS),
        (_TIMM_MODELS.format("twins"), ("LocallyGroupedAttn",), "qkv", FUSED_PARTS),
        (_TIMM_MODELS.format("vision_transformer_relpos"), ("RelPosAttention",), "qkv", FUSED_PARTS),
        (_TIMM_MODELS.format("vision_transformer_sam"), ("Attention",), "qkv", FUSED_PARTS),
        (_TIMM_MODELS.format("volo"), ("Attention",), "qkv", FUSED_PARTS),
        (_TIMM_MODELS.format("xcit"), ("XCA",), "qkv", FUSED_PARTS),
        (_TRANSFORMERS.format("bark"), ("BarkSelfAttention", "BarkSelfFlashAttention2"), "att_proj", FUSED_PARTS),
        (_TRANSFORMERS.format("blip"), ("BlipAttention",), "qkv", FUSED_PARTS),
        (_TRANSFORMERS.format("blip_2"), ("Blip2Attention",), "qkv", FUSED_PARTS),
        (_TRANSFORMERS.format("glm4v"), ("Glm4vVisionAttention",), "qkv", FUSED_PARTS),
        (_TRANSFORMERS.format("instructblip"), ("InstructBlipAttention",), "qkv", FUSED_PARTS),
        (_TRANSFORMERS.format("instructblipvideo"), ("InstructBlipVideoAttention",), "qkv", FUSED_PARTS),
        (_TRANSFORMERS.format("qwen2_5_vl"), ("Qwen2_5_VLVisionAttention",), "qkv", FUSED_PARTS),
        (_TRANSFORMERS.format("qwen3_vl"), ("Qwen3VLVisionAttention",), "qkv", FUSED_PARTS),
        (_TRANSFORMERS.format("modernbert"), ("ModernBertAttention",), "Wqkv", FUSED_PARTS),
        (_TRANSFORMERS.format("mpt"), ("MptAttention",), "Wqkv", FUSED_PARTS),
        (_TRANSFORMERS.format("qwen2_vl"), ("VisionAttention",), "qkv", FUSED_PARTS),
        (_TRANSFORMERS.format("sam"), ("SamVisionAttention", "SamVisionSdpaAttention"), "qkv", FUSED_PARTS),
        (_TRANSFORMERS.format("sam_hq"), ("SamHQVisionAttention", "SamHQVisionSdpaAttention"), "qkv", FUSED_PARTS),
        (_TRANSFORMERS.format("got_ocr2"), ("GotOcr2VisionAttention",), "qkv", FUSED_PARTS),
        (_TRANSFORMERS.format("vitdet"), ("VitDetAttention",), "qkv", FUSED_PARTS),
        (_TRANSFORMERS.format("seggpt"), ("SegGptAttention",), "qkv", FUSED_PARTS),
        # reshape(..., 2, heads, head_dim): k | v, half of the rows each (the queries are a layer of their own).
        ("timm.layers.attention_pool", ("AttentionPoolLatent",), "kv", FUSED_PARTS[1:]),
        (_TIMM_MODELS.format("pvt_v2"), ("Attention",), "kv", FUSED_PARTS[1:]),
        (_TIMM_MODELS.format("twins"), ("GlobalSubSampleAttn",), "kv", FUSED_PARTS[1:]),
        (_TIMM_MODELS.format("volo"), ("ClassAttention",), "kv", FUSED_PARTS[1:]),
    ]
    for cls in classes
}
"""Fused ``nn.Linear`` layers (``(defining module, class, attribute)`` of the layer holding them) whose output the
forward pass cuts into equal blocks of rows, one per part, in the order given."""


def _per_head_rows(
    child: str, parent: nn.Module | None
) -> tuple[tuple[str, ...], tuple[int, ...] | None, int | None] | str | None:
    """The layouts of :func:`_fused_rows` that depend on the layer's settings beyond the ones above."""
    if _class_is(parent, _TRANSFORMERS.format("gpt_neox_japanese"), "GPTNeoXJapaneseAttention") and child == (
        "query_key_value"
    ):
        head = _int(parent, "head_size")  # view(..., heads, 3 * head_size), then per head [:D], [D:2D], [2D:]
        return _UNREAD_SETTINGS if head is None else (FUSED_PARTS, (head,) * 3, 3 * head)
    if _class_is(parent, _TRANSFORMERS.format("deberta"), "DisentangledSelfAttention") and child == "in_proj":
        head = _int(parent, "attention_head_size")  # view(..., heads, 3 * head_size), then chunk(3)
        return _UNREAD_SETTINGS if head is None else (FUSED_PARTS, (head,) * 3, 3 * head)
    if _class_is(parent, _TRANSFORMERS.format("persimmon"), "PersimmonAttention") and child == "query_key_value":
        head = _int(parent, "head_dim")  # view(..., heads, 3, head_dim)
        return _UNREAD_SETTINGS if head is None else (FUSED_PARTS, (head,) * 3, 3 * head)
    if _class_is(parent, _TRANSFORMERS.format("dbrx"), "DbrxAttention") and child == "Wqkv":
        width, head = _int(parent, "hidden_size"), _int(parent, "head_dim")
        kv_heads = _int(parent, "num_key_value_heads")  # split([E, G * D, G * D])
        if width is None or head is None or kv_heads is None:
            return _UNREAD_SETTINGS
        return FUSED_PARTS, (width, kv_heads * head, kv_heads * head), None
    if _class_is(parent, _TRANSFORMERS.format("codegen"), "CodeGenAttention") and child == "qkv_proj":
        # view(..., mp_num, 3 * local), split(local): in every one of the mp_num blocks q | v | k (values before keys).
        width, blocks = _int(parent, "embed_dim"), _int(parent, "mp_num")
        if width is None or blocks is None or width % blocks:
            return _UNREAD_SETTINGS
        local = width // blocks
        return ("q_proj", "v_proj", "k_proj"), (local,) * 3, 3 * local
    if _class_is(parent, _TIMM_MODELS.format("tiny_vit"), "Attention") or _class_is(
        parent, _TIMM_MODELS.format("efficientformer"), "Attention"
    ):
        if child != "qkv":
            return None
        key, value = _int(parent, "key_dim"), _int(parent, "val_dim")  # view(..., heads, -1).split([Dk, Dk, Dv])
        return _UNREAD_SETTINGS if key is None or value is None else (FUSED_PARTS, (key, key, value), 2 * key + value)
    if _class_is(parent, _TIMM_MODELS.format("levit"), "Attention", "AttentionDownsample"):
        # The Linear of a LinearNorm (Linear, then batch norm): view(..., heads, -1).split([Dk, Dk, Dv]) for qkv,
        # split([Dk, Dv]) for kv.
        parts = {"qkv.linear": FUSED_PARTS, "kv.linear": FUSED_PARTS[1:]}.get(child)
        key, value = _int(parent, "key_dim"), _int(parent, "val_dim")
        if parts is None:
            return None
        if key is None or value is None:
            return _UNREAD_SETTINGS
        sizes = (key, key, value)[3 - len(parts) :]
        return parts, sizes, sum(sizes)
    if _class_is(parent, _TIMM_MODELS.format("maxxvit"), "AttentionCl") and child == "qkv":
        head_first, head = getattr(parent, "head_first", None), _int(parent, "dim_head")
        if head_first is False:  # reshape(B, -1, 3, heads, dim_head)
            return FUSED_PARTS, None, None
        if head_first is not True or head is None:  # view(B, -1, heads, 3 * dim_head).chunk(3): per head q | k | v
            return _UNREAD_SETTINGS
        return FUSED_PARTS, (head,) * 3, 3 * head
    if _class_is(parent, _TIMM_MODELS.format("gcvit"), "WindowAttentionGlobal") and child == "qkv":
        use_global = getattr(parent, "use_global", None)  # the queries of a global attention are the global ones
        if not isinstance(use_global, bool):
            return _UNREAD_SETTINGS
        return (FUSED_PARTS[1:] if use_global else FUSED_PARTS), None, None
    return None


def _fused_linear(
    path: str, name: str, module: nn.Module, parent: nn.Module | None, shapes: ParameterShapes | None
) -> list[WeightMatrix] | None:
    """The parts of a fused ``nn.Linear`` whose layout its attention or MLP layer ``parent`` fixes
    (:func:`_fused_rows`), checked against the full weight's rows; ``None`` (one matrix) where the rows do not
    match that layout."""
    # The Linear of LeViT's LinearNorm is named after its LinearNorm (``qkv.linear``; see :func:`parent_layer`).
    child = ".".join(name.split(".")[-2:]) if name.endswith(".linear") else name.rsplit(".", 1)[-1]
    layout = _fused_rows(child, parent)
    if layout is None:
        return None
    if isinstance(layout, str):
        warnings.warn(
            f"{path}: {layout} in its {type(parent).__name__}, so its parts are not known; it is read as one matrix",
            UserWarning,
            stacklevel=2,
        )
        return None
    parts, sizes, period = layout
    shape = parameter_shape(module, "weight", shapes)
    if shape is None:
        declared = getattr(module, "out_features", None), getattr(module, "in_features", None)
        if not all(isinstance(size, int) for size in declared):
            raise _unknown_shape(path, module, ["weight"])
        shape = declared
    equal = sizes is None
    if sizes is None:  # equal blocks: their size is the whole weight's rows over the parts
        sizes = (max(shape[0] // len(parts), 1),) * len(parts)
    total, one_block = shape[0], period is None
    period = sum(sizes) if period is None else period
    if len(shape) != 2 or sum(sizes) != period or total % period or (one_block and total != period):
        # A layer of a known class whose weight does not hold its layout (edited, or another version of the class):
        # its parts are unknown, and it is said so rather than read as one matrix without a word.
        cut = f"{' | '.join(f'{part} ({size})' for part, size in zip(parts, sizes))} rows"
        cut += " in one block" if one_block else f" in every block of {period} rows"
        if equal:
            cut = f"{len(parts)} blocks of equal rows, {' | '.join(parts)}"
        warnings.warn(
            f"{path}: its {type(parent).__name__} cuts its output into {cut}, which its weight of shape "
            f"{tuple(shape)} does not hold; it is read as one matrix, not as its parts",
            UserWarning,
            stacklevel=2,
        )
        return None
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    matrices = [
        WeightMatrix(f"{name}.{part}", module, rows=(start, start + size, period))
        for part, start, size in zip(parts, starts, sizes)
    ]
    order = FUSED_PARTS + GATE_UP_PARTS  # q, k, v whatever their order in the weight (CodeGen's q | v | k)
    return sorted(matrices, key=lambda matrix: order.index(matrix.name.rsplit(".", 1)[-1]))


def _own_shapes(module: nn.Module, shapes: ParameterShapes | None) -> dict[str, tuple[int, ...] | None]:
    """Full shape (``None``: unknown here) of every parameter ``module`` holds itself, and of the expert stacks a
    declared experts layer holds as plain tensors (FSDP1 with ``use_orig_params=False`` between forward passes)."""
    names = [name for name, _ in module.named_parameters(recurse=False)]
    if _expert_layout(module) is not None:
        names += [n for n in _EXPERT_STACKS if n not in names and isinstance(getattr(module, n, None), Tensor)]
    return {name: parameter_shape(module, name, shapes) for name in names}


def _stacks(module: nn.Module, shapes: ParameterShapes | None = None) -> dict[str, tuple[int, ...]]:
    """Full shapes of the 3-D parameters ``module`` holds itself (not its children's): expert stacks, read or not.

    A layer that declares no expert layout counts only stacks of more than one matrix, each with more than one row
    and column: a ``(1, T, D)`` class token or position table, or a ``(C, 1, 1)`` per-channel scale (ConvNeXt's
    ``layer_scale``), is no stack of weight matrices.
    """
    if isinstance(module, _LAYER_TYPES) or is_conv1d(module):
        return {}
    declared = _expert_layout(module) is not None
    return {
        name: shape
        for name, shape in _own_shapes(module, shapes).items()
        if shape is not None and len(shape) == 3 and (declared or min(shape) > 1)
    }


def _unknown_stacks(module: nn.Module, shapes: ParameterShapes | None) -> list[str]:
    """Expert stacks of a declared experts layer (``gate_up_proj``, ``up_proj``, ``down_proj``) whose full shape this
    process cannot know (:func:`parameter_shape`)."""
    if isinstance(module, _LAYER_TYPES) or is_conv1d(module) or _expert_layout(module) is None:
        return []
    return [name for name, shape in _own_shapes(module, shapes).items() if shape is None and name in _EXPERT_STACKS]


def _expert_layout(module: nn.Module) -> tuple[bool, bool, bool] | None:
    """``(is_transposed, is_concatenated, has_gate)`` as ``transformers``' ``use_experts_implementation`` sets them on
    an experts layer; ``None`` for a layer that declares no layout."""
    transposed, gated = getattr(module, "is_transposed", None), getattr(module, "has_gate", None)
    if not isinstance(transposed, bool) or not isinstance(gated, bool):
        return None
    return transposed, bool(getattr(module, "is_concatenated", True)), gated


def _expert_projections(stacks: Mapping[str, tuple[int, ...]], module: nn.Module) -> tuple[str, ...]:
    """Names of the expert stacks of ``module`` (``stacks``: :func:`_stacks`) that are read, in the order of the
    forward pass."""
    layout = _expert_layout(module)
    if layout is None:
        return ()
    names = ("gate_up_proj" if layout[2] else "up_proj", "down_proj")
    return tuple(name for name in names if name in stacks)


def unread_stacks(module: nn.Module, *, shapes: ParameterShapes | None = None) -> list[str]:
    """Names of the 3-D parameters of ``module`` (its own) that :func:`matrices_of` does not read, because no layout
    says which dimensions are an expert's rows and columns (module docstring); ``shapes`` as in
    :func:`parameter_shape`."""
    stacks = _stacks(module, shapes)
    read = _expert_projections(stacks, module)
    return [name for name in stacks if name not in read]


def _experts(name: str, module: nn.Module, split_fused: bool, shapes: ParameterShapes | None) -> list[WeightMatrix]:
    """Every expert's matrices, expert by expert, each in the order of the forward pass."""
    stacks = _stacks(module, shapes)
    projections = _expert_projections(stacks, module)
    if not projections:
        return []
    transposed, concatenated, _ = _expert_layout(module)  # type: ignore[misc]
    count = max(stacks[attribute][0] for attribute in projections)
    matrices: list[WeightMatrix] = []
    for expert in range(count):
        for attribute in projections:
            if expert >= stacks[attribute][0]:
                continue
            prefix = f"{name}.{expert}"
            if attribute == "gate_up_proj" and split_fused and concatenated:
                matrices += _split(prefix, module, attribute, GATE_UP_PARTS, transpose=transposed, expert=expert)
            else:
                matrices.append(WeightMatrix(f"{prefix}.{attribute}", module, attribute, transposed, expert=expert))
    return matrices


def is_lora_layer(module: nn.Module) -> bool:
    """Whether ``module`` is a LoRA layer of ``peft`` (a ``LoraLayer``: ``base_layer``, ``lora_A``, ``lora_B``).

    Recognised by class name and defining package, so ``peft`` is never imported here.
    """
    return any(cls.__name__ == "LoraLayer" and cls.__module__.split(".")[0] == "peft" for cls in type(module).__mro__)


def _lora_adapters(layer: nn.Module) -> list[str]:
    """The adapters of a LoRA layer that hold an ``A`` and ``B`` (not those of its other kinds, such as embeddings)."""
    return [name for name in getattr(layer, "lora_A", {}) if name in getattr(layer, "lora_B", {})]


def lora_unread_reason(layer: nn.Module) -> str | None:
    """Why the LoRA layer ``layer`` is not read as one layer of weight ``W + (alpha / r) B A``; ``None`` when it is.

    It is read when its base layer is a Linear, Conv1d/2d/3d or ``transformers``' ``Conv1D`` holding a floating-point
    weight, and none of its adapters is a variant whose applied weight takes another form (DoRA's, for example).
    """
    base = getattr(layer, "base_layer", None)
    if not callable(getattr(layer, "get_delta_weight", None)) or not isinstance(base, nn.Module):
        return "no update weight is computed for it (get_delta_weight)"
    if hasattr(base, "base_layer"):
        return "the base layer is itself an adapter layer"
    if not (isinstance(base, _LAYER_TYPES) and not isinstance(base, nn.MultiheadAttention)) and not is_conv1d(base):
        return f"the base layer is a {type(base).__name__}, not a Linear, Conv or Conv1D"
    weight = getattr(base, "weight", None)
    if not isinstance(weight, Tensor) or not weight.is_floating_point():
        kind = type(weight).__name__ if not isinstance(weight, Tensor) else str(weight.dtype).removeprefix("torch.")
        return f"the base weight is not a floating-point tensor ({kind}; a quantized weight)"
    adapters = _lora_adapters(layer)
    variants = [name for name in adapters if name in (getattr(layer, "lora_variant", None) or {})]
    variants += [name for name in adapters if (getattr(layer, "use_dora", None) or {}).get(name, False)]
    if variants:
        return f"adapter {variants[0]!r} is a LoRA variant (DoRA or another), whose weight is not W + (alpha / r) B A"
    return None


def _carried_adapters(layer: nn.Module) -> list[str]:
    """The adapters whose update the weight that ``layer`` applies carries, as its forward pass decides: none while
    adapters are disabled, the merged ones when some are merged (the forward pass is then the base layer's), else
    every active adapter."""
    adapters = _lora_adapters(layer)
    if getattr(layer, "disable_adapters", False):
        return []
    merged = [name for name in getattr(layer, "merged_adapters", []) if name in adapters]
    if merged:
        return merged
    active = getattr(layer, "active_adapters", None) or []
    return [name for name in ([active] if isinstance(active, str) else active) if name in adapters]


def _update_dtype(layer: nn.Module, base: Tensor) -> torch.dtype:
    """The dtype of a LoRA layer's update: that of its ``B`` factors (``get_delta_weight``'s), promoted over the
    adapters it carries (the first adapter's when it carries none; the base weight's without adapters)."""
    adapters = _carried_adapters(layer) or _lora_adapters(layer)[:1]
    dtypes = [layer.lora_B[adapter].weight.dtype for adapter in adapters]  # type: ignore[index]
    dtype = dtypes[0] if dtypes else base.dtype
    for other in dtypes[1:]:
        dtype = torch.promote_types(dtype, other)
    return dtype


def lora_weight(layer: nn.Module, base: Tensor, *, update: bool = False, name: str = "") -> Tensor:
    """The weight a LoRA layer applies, in the layout of its stored base weight ``base``; with ``update``, the update
    of its adapters alone (zeros when none is applied).

    The updates come from ``peft``'s ``get_delta_weight`` (``(alpha / r) B A``, transposed for a ``fan_in_fan_out``
    layer) and are added to the stored weight one adapter at a time, as ``merge`` adds them. A merged layer applies
    its stored weight, which holds the merged updates; one whose adapters are disabled applies its weight without them.

    Raises:
        RuntimeError: ``base`` is held sharded (the effective weight is read from weights held in full), or an
            update's shape is not that of ``base``.
    """
    sharded = type(base) not in (Tensor, nn.Parameter) or hasattr(base, "ds_shape")
    if sharded or getattr(base, "_fsdp_flattened", False):
        raise RuntimeError(
            f"the base weight of LoRA layer {name!r} is held as a {type(base).__name__} piece of a sharded weight; "
            "the weight of a LoRA layer is read where its base weight is held in full (single device, DDP)"
        )
    with torch.no_grad():
        carried = _carried_adapters(layer)
        deltas = [layer.get_delta_weight(adapter) for adapter in carried]  # type: ignore[operator]
        for adapter, delta in zip(carried, deltas):
            if delta.shape != base.shape:
                raise RuntimeError(
                    f"the update of adapter {adapter!r} of LoRA layer {name!r} has shape {tuple(delta.shape)}, not "
                    f"that of its base weight {tuple(base.shape)} (fan_in_fan_out set for the wrong layout?)"
                )
        if update:
            if not deltas:
                return torch.zeros(base.shape, dtype=_update_dtype(layer, base), device=base.device)
            total = deltas[0]
            for delta in deltas[1:]:
                total = total + delta
            return total
        weight = base.detach()
        merged = [adapter for adapter in getattr(layer, "merged_adapters", []) if adapter in _lora_adapters(layer)]
        if merged and not carried:  # disabled adapters: the forward pass takes the merged updates out again
            deltas = [-layer.get_delta_weight(adapter) for adapter in reversed(merged)]  # type: ignore[operator]
        elif merged:
            return weight
        for delta in deltas:
            weight = (weight + delta).to(base.dtype)
        return weight


def matrices_of(
    path: str,
    module: nn.Module,
    *,
    split_fused: bool = True,
    shapes: ParameterShapes | None = None,
    lora_update: bool = True,
    parent: nn.Module | None = None,
) -> list[WeightMatrix]:
    """The matrices of one layer, named after its module ``path`` (wrapper segments of FSDP removed).

    Args:
        path: the layer's name as in ``named_modules()``.
        module: a layer for which :func:`is_weight_layer` holds.
        split_fused: read fused query/key/value projections and fused gate/up projections as their parts (module
            docstring).
        shapes: full shapes of parameters that FSDP1 holds as flat slices (:func:`parameter_shape`); needed only
            for a ``c_attn`` or an experts layer so held, whose matrices depend on the full shape.
        parent: the layer that holds ``module`` (wrappers skipped: :func:`parent_layer`), whose class and settings
            fix the layout of a fused ``nn.Linear`` (GPT-NeoX's ``query_key_value``, ...; module docstring);
            ``None``: a Linear is one matrix.
        lora_update: for a LoRA layer, also its adapters' update, ``<matrix>.lora_update`` for each of its matrices
            (module docstring).

    Returns:
        The matrices in the order of the forward pass; none for a layer whose 3-D parameters are in no known layout
        (:func:`unread_stacks` names them).

    Raises:
        ValueError: ``module`` is not a layer a weight monitor can read, or its matrices depend on a full shape that
            this process cannot know (an FSDP1 flat slice not in ``shapes``; the message says what to do).
    """
    name = logged_name(path)
    if is_lora_layer(module) and lora_unread_reason(module) is None:
        base_layer: nn.Module = module.base_layer  # type: ignore[assignment]
        base = matrices_of(path, base_layer, split_fused=split_fused, shapes=shapes, parent=parent)
        matrices = [replace(matrix, lora=module) for matrix in base]
        if lora_update:
            matrices += [replace(m, name=m.name + LORA_UPDATE_SUFFIX, lora=module, lora_update=True) for m in base]
        return matrices
    if isinstance(module, nn.MultiheadAttention):
        return _attention(name, module, split_fused)
    if is_conv1d(module):
        parts = _fused_parts(name, module, shapes) if split_fused else 1
        if parts > 1:
            return list(_split(name, module, "weight", FUSED_PARTS[len(FUSED_PARTS) - parts :], transpose=True))
        return [WeightMatrix(name, module, transpose=True)]
    if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        return [WeightMatrix(name, module, groups=module.groups)]
    if isinstance(module, nn.Linear) and split_fused:
        parts = _fused_linear(path, name, module, parent, shapes)
        if parts is not None:
            return parts
    if isinstance(module, _LAYER_TYPES):
        return [WeightMatrix(name, module)]
    unknown = _unknown_stacks(module, shapes)
    if unknown:
        raise _unknown_shape(name, module, unknown)
    if _stacks(module, shapes):
        return _experts(name, module, split_fused, shapes)
    raise ValueError(
        f"layer {path!r} is a {type(module).__name__}; weight matrices are read from Linear, Conv1d/2d/3d, "
        "MultiheadAttention, transformers' Conv1D and layers holding 3-D expert stacks"
    )


def parent_layer(path: str, modules: Mapping[str, nn.Module]) -> nn.Module | None:
    """The layer that holds the module ``path`` of ``modules`` (``named_modules()`` of the model): the module one
    level up, wrappers skipped (the module that ``torch.compile``, FSDP or activation checkpointing wraps, at the
    longest path of that name), and LeViT's ``LinearNorm`` (a Linear and its batch norm) skipped too, so that the
    Linear of its fused ``qkv`` finds its attention layer; ``None`` for a module at the top."""
    eager = logged_name(path)
    if "." not in eager:
        return None
    wanted, parts = eager.rsplit(".", 1)[0], path.split(".")
    for end in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:end])
        if logged_name(prefix) == wanted and prefix in modules:
            if _class_is(modules[prefix], _TIMM_MODELS.format("levit"), "LinearNorm"):
                return parent_layer(prefix, modules)  # its Linear's rows are cut by the attention that holds it
            return modules[prefix]
    return None
