"""Weight spectra of models whose parameters a strategy has sharded over processes.

Under Lightning's sharding strategies a parameter read from a callback is not the weight matrix:

* ``ModelParallelStrategy`` (FSDP2 ``fully_shard``, tensor parallelism) and plain ``fully_shard``: a ``DTensor``
  whose local part holds some rows (``Shard(0)``) or columns (``Shard(1)``) of the weight.
* ``FSDPStrategy`` (FSDP1): the layers' weights are views into one flat parameter per wrapped unit, of which every
  process holds a contiguous slice; outside the forward pass a weight attribute is either a 1-D slice
  (``use_orig_params=True``) or a view of freed storage (``use_orig_params=False``).
* ``DeepSpeedStrategy`` with ZeRO stage 3: the weight is an empty placeholder carrying ``ds_tensor`` (this process's
  partition) and ``ds_status``.

:func:`weight_matrix_spectra` never analyses such a piece as a matrix. It reads each monitored matrix by the cheapest
exact route:

* **Gram sum, no gather** (``DTensor``): when the processes split the matrix by rows, its Gram ``W^T W`` is the sum
  of the pieces' Grams ``W_k^T W_k``; split by columns, ``W W^T = sum_k W_k W_k^T``. Every process computes its
  piece's float64 Gram, and one all-reduce per process group (all monitored matrices in one buffer) gives every
  process the exact Gram of the full matrix, from which
  :func:`~rank_lightning.functional.weights.weight_spectra_from_grams` takes the spectrum. With ``sharding="auto"``
  this route is taken when the summed Gram is the smaller of the two (the one the unsharded ``"gram"`` route
  builds, so no more work and no more memory than without sharding); otherwise gathering the matrix moves fewer
  bytes than all-reducing the larger Gram.
* **Gather one layer at a time**: ``DTensor.full_tensor()``, FSDP1's ``summon_full_params`` of the one wrapped
  unit that holds the layer (``recurse=False``, ``writeback=False``), or DeepSpeed's ``GatheredParameters`` of the
  one parameter; every matrix read from that parameter (the q/k/v parts of a fused projection, every expert of a
  stack) is decomposed from the one gathered copy, which is released before the next parameter is gathered, so at
  most one parameter is held in full at a time. Used for the SVD route (``decomposition="svd"``, float64 weights,
  and the ill-conditioned matrices that ``decomposition="auto"`` redoes by the SVD), for pieces that split both rows
  and columns (or split the experts of a stack), and for FSDP1 and DeepSpeed, whose flat slices cut rows apart.

A layout that is neither of these (a 1-D or empty tensor where a matrix is expected, freed storage) raises a
``RuntimeError`` naming the strategies that are supported, never a spectrum of a piece. Every process must call
:func:`weight_matrix_spectra` with the same matrices in the same order (the collectives are matched by order), as
every process of a Lightning strategy does in the same callback hook.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn

from rank_lightning.functional.spectral import Spectrum
from rank_lightning.functional.weights import needs_exact_svd, weight_spectra, weight_spectra_from_grams
from rank_lightning.validation import check_choice
from rank_lightning.weight_matrices import WeightMatrix

__all__ = ["SHARDINGS", "fsdp_parameter_shapes", "shard_layout", "weight_matrix_spectra"]

SHARDINGS: tuple[str, ...] = ("auto", "gram", "gather")
"""How sharded matrices are read: ``"auto"`` (Gram sum where it is the smaller Gram, else gather), ``"gram"`` (Gram
sum wherever the layout allows), ``"gather"`` (always gather one layer at a time)."""

_SUPPORTED = (
    "supported: DDP and single-device strategies, ModelParallelStrategy / fully_shard (FSDP2, DTensor), "
    "FSDPStrategy (FSDP1) and DeepSpeedStrategy with ZeRO stage 3 (deepspeed installed)"
)


@dataclass
class _GramJob:
    """One matrix read by the Gram-sum route: its local Gram and the process groups that hold its other pieces."""

    index: int
    gram: Tensor
    shape: tuple[int, int]
    groups: tuple[Any, ...]


def shard_layout(tensor: Tensor, owner: nn.Module | None = None) -> Literal["plain", "dtensor", "fsdp", "deepspeed"]:
    """How a process holds ``tensor``: in full (``"plain"``), as a ``DTensor``, in an FSDP1 flat parameter
    (``owner``, its wrapped unit, is given) or as a DeepSpeed ZeRO-3 partition (``ds_tensor`` / ``ds_status``)."""
    if hasattr(tensor, "ds_tensor") or hasattr(tensor, "ds_status"):
        return "deepspeed"
    if _is_dtensor(tensor):
        return "dtensor"
    return "fsdp" if owner is not None else "plain"


def _is_dtensor(tensor: Tensor) -> bool:
    if not dist.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def _fsdp_owners(root: nn.Module | None) -> dict[int, nn.Module]:
    """``id(layer) -> the FSDP1 unit whose flat parameter holds the layer's weights`` for every layer under ``root``."""
    if root is None or not dist.is_available():
        return {}
    from torch.distributed.fsdp import FullyShardedDataParallel

    units = [m for m in root.modules() if isinstance(m, FullyShardedDataParallel)]
    owners: dict[int, nn.Module] = {}
    # Innermost units first: a layer belongs to the smallest unit around it.
    for unit in sorted(units, key=lambda u: sum(1 for _ in u.modules())):
        for module in unit.modules():
            owners.setdefault(id(module), unit)
    return owners


def fsdp_parameter_shapes(root: nn.Module | None) -> dict[tuple[int, str], tuple[int, ...]]:
    """Full shapes of the parameters that the FSDP1 units under ``root`` hold, keyed by ``(id(module), attribute)``.

    With ``use_orig_params=True`` FSDP1 leaves each original parameter between forward passes as a 1-D slice of this
    process's shard of the flat parameter (or an empty tensor), whose shape differs between processes and says
    nothing of the weight's; the flat parameter records every original parameter's module, name and shape
    (``_param_infos``, ``_shapes``; a shared parameter under its primary's shape). What
    :func:`~rank_lightning.weight_matrices.parameter_shape` reads as ``shapes``.
    """
    shapes: dict[tuple[int, str], tuple[int, ...]] = {}
    for unit in {id(unit): unit for unit in _fsdp_owners(root).values()}.values():
        flat = getattr(unit, "_flat_param", None)
        if flat is None:
            continue
        for info, shape in zip(flat._param_infos, flat._shapes):
            shapes[(id(info.module), info.param_name)] = tuple(shape)
        for shared in flat._shared_param_infos:
            primary = shapes.get((id(shared.prim_module), shared.prim_param_name))
            if primary is not None:
                shapes[(id(shared.module), shared.param_name)] = primary
    return shapes


def _initialise_fsdp(owners: Mapping[int, nn.Module]) -> None:
    """Let the outermost FSDP1 unit initialise itself as the root, if no forward pass has yet.

    FSDP1 initialises lazily, at the root's first forward. Gathering a nested unit first (the initial point, before
    any step) would make that unit initialise as a root of its own, which FSDP then refuses. Gathering the outermost
    unit's own parameters (``recurse=False``: not the nested units') initialises it as the root.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel

    units = {id(unit): unit for unit in owners.values()}.values()
    outermost = max(units, key=lambda unit: sum(1 for _ in unit.modules()))
    if getattr(outermost, "_is_root", False) is None:  # FSDP1 sets it at its lazy initialisation
        with FullyShardedDataParallel.summon_full_params(outermost, recurse=False, writeback=False):
            pass


def _check_plain(matrix: WeightMatrix, tensor: Tensor) -> None:
    freed = tensor.device.type != "meta" and tensor.numel() > 0 and tensor.untyped_storage().size() == 0
    if tensor.ndim < 2 or tensor.numel() == 0 or freed:
        what = "freed storage" if freed else f"shape {tuple(tensor.shape)}"
        raise RuntimeError(
            f"the weight of {matrix.name!r} ({type(matrix.module).__name__}.{matrix.attribute}) is held as {what}, "
            "not as a matrix: a piece of a parameter sharded by a strategy whose wrapper was not found (FSDP1 "
            f"wrapped units are looked up from the model passed as root); {_SUPPORTED}"
        )


def _dtensor_plan(matrix: WeightMatrix, tensor: Any, decomposition: str, sharding: str) -> tuple[str, tuple] | None:
    """``(side, groups)`` of the Gram-sum route for a DTensor, or ``None`` when the matrix is gathered instead."""
    if sharding == "gather" or decomposition == "svd" or (decomposition == "auto" and tensor.dtype == torch.float64):
        return None
    if matrix.groups > 1:  # the spectrum is that of the groups' blocks (weight_spectra), read from the whole weight
        return None
    ndim = tensor.ndim
    dims, groups = set(), []
    for mesh_dim, placement in enumerate(tensor.placements):
        if placement.is_shard():
            dims.add(placement.dim % ndim)
            groups.append(tensor.device_mesh.get_group(mesh_dim))
        elif not placement.is_replicate():
            return None  # a partial sum: gathering completes it
    rows, cols = matrix.shape(tuple(tensor.shape))
    strided = any(p.is_shard() and type(p).__name__ != "Shard" for p in tensor.placements)
    if dims <= set(matrix.row_dims(ndim)) and not (strided and matrix.is_part):
        # A strided row split (FSDP2 over tensor parallelism) keeps rows whole, but not in one offset range.
        side, size = "feature", cols
    elif dims <= set(matrix.col_dims(ndim)):
        side, size = "row", rows
    else:
        return None
    if sharding == "auto" and size > min(rows, cols):
        return None
    return side, tuple(groups)


def _local_gram(matrix: WeightMatrix, tensor: Any, side: str) -> Tensor:
    """Float64 Gram of this process's piece of the matrix (zeros when it holds none of it)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    # The experts' dimension is never split on this route (_dtensor_plan): the piece holds every expert.
    piece = matrix.whole(tensor.to_local())
    if matrix.is_part:
        first = 0
        if side == "feature":
            # Rows are split: keep the part's rows that fall in this process's row range.
            _, offsets = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
            first = offsets[matrix.row_dims(tensor.ndim)[0]]
        # Found from the global shape: the rows of the whole matrix.
        rows = matrix.local_rows(tuple(tensor.shape), first, piece.shape[0])
        piece = piece[rows if isinstance(rows, slice) else rows.to(piece.device)]
    piece = piece.to(torch.float64)
    return piece.mT @ piece if side == "feature" else piece @ piece.mT


def _all_reduce(jobs: list[_GramJob]) -> None:
    """Sum every job's Gram over the processes holding the other pieces: one all-reduce per process group."""
    by_groups: dict[tuple[int, ...], list[_GramJob]] = {}
    for job in jobs:
        by_groups.setdefault(tuple(id(g) for g in job.groups), []).append(job)
    for members in by_groups.values():
        buffer = torch.cat([job.gram.reshape(-1) for job in members])
        for group in members[0].groups:
            dist.all_reduce(buffer, group=group)
        offset = 0
        for job in members:
            job.gram = buffer[offset : offset + job.gram.numel()].view_as(job.gram)
            offset += job.gram.numel()


def _gather_context(
    matrix: WeightMatrix, tensor: Tensor, layout: str, owner: nn.Module | None
) -> AbstractContextManager[Any]:
    if layout == "fsdp":
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel.summon_full_params(owner, recurse=False, writeback=False)
    if layout == "deepspeed":
        try:
            # ``deepspeed.zero`` is an attribute of the package, not a module of that name: ``from deepspeed.zero
            # import ...`` fails even where deepspeed is installed.
            import deepspeed
        except ImportError as error:
            raise RuntimeError(
                f"the weight of {matrix.name!r} is partitioned by DeepSpeed ZeRO stage 3 (DeepSpeedStrategy) and "
                "deepspeed cannot be imported to gather it; install deepspeed, or monitor with ZeRO stage 1 or 2"
            ) from error
        return deepspeed.zero.GatheredParameters([tensor], modifier_rank=None)
    return nullcontext()


def _gather_spectra(
    group: Sequence[WeightMatrix], layout: str, owner: nn.Module | None, decomposition: str
) -> list[Spectrum]:
    """Spectra of the matrices read from one parameter (the parts of a fused projection, every expert of a stack),
    gathered in full once for them; the full parameter is released on return."""
    first = group[0]
    tensor = first.stored()
    if layout == "dtensor":
        full = tensor.full_tensor()  # type: ignore[attr-defined]
        groups = [m.groups for m in group]
        return weight_spectra([m.from_stored(full) for m in group], decomposition=decomposition, groups=groups)  # type: ignore[arg-type]
    with _gather_context(first, tensor, layout, owner):
        whole = first.stored()
        _check_plain(first, whole)
        groups = [m.groups for m in group]
        return weight_spectra([m.from_stored(whole) for m in group], decomposition=decomposition, groups=groups)  # type: ignore[arg-type]


def _by_parameter(matrices: Sequence[WeightMatrix], indices: Sequence[int]) -> list[list[int]]:
    """``indices`` grouped by the parameter their matrices are read from, in order of first appearance."""
    groups: dict[tuple[int, str], list[int]] = {}
    for index in indices:
        groups.setdefault((id(matrices[index].module), matrices[index].attribute), []).append(index)
    return list(groups.values())


def weight_matrix_spectra(
    matrices: Sequence[WeightMatrix],
    *,
    decomposition: Literal["auto", "svd", "gram"] = "auto",
    sharding: Literal["auto", "gram", "gather"] = "auto",
    root: nn.Module | None = None,
) -> list[Spectrum]:
    """Float64 spectra of the monitored matrices, whether their weights are held in full or sharded.

    Matrices held in full go through :func:`~rank_lightning.functional.weights.weight_spectra` together (one
    batched decomposition per shape); sharded ones are read by the routes of the module docstring. The result equals
    that of the unsharded model up to rounding (the summed Grams differ from one product only in the order of the
    additions).

    Args:
        matrices: the matrices, each naming its layer and how it sits in the stored tensor.
        decomposition: ``"auto"``, ``"svd"`` or ``"gram"``, as in
            :func:`~rank_lightning.functional.weights.weight_spectra`.
        sharding: ``"auto"``, ``"gram"`` or ``"gather"`` (:data:`SHARDINGS`).
        root: the outermost model, as the strategy wrapped it (``trainer.model``); FSDP1 wrapped units are looked
            up in it. ``None``: no FSDP1.

    Returns:
        One :class:`~rank_lightning.functional.Spectrum` per matrix, in the given order, on the CPU.

    Raises:
        RuntimeError: a weight held in a layout that is not a matrix and not one of the supported sharded layouts
            (the message names the matrix and the supported strategies), or a DeepSpeed ZeRO-3 partition without
            ``deepspeed`` installed.
        ValueError: an unknown ``decomposition`` or ``sharding``.
    """
    check_choice("sharding", sharding, SHARDINGS)
    owners = _fsdp_owners(root)
    spectra: dict[int, Spectrum] = {}
    plain: list[int] = []
    lora: list[int] = []
    jobs: list[_GramJob] = []
    gathers: dict[int, tuple[str, nn.Module | None]] = {}
    with torch.no_grad():
        for index, matrix in enumerate(matrices):
            if matrix.lora is not None:  # computed from weights held in full (a sharded one raises when computed)
                lora.append(index)
                continue
            tensor, owner = matrix.stored(), owners.get(id(matrix.module))
            layout = shard_layout(tensor, owner)
            plan = _dtensor_plan(matrix, tensor, decomposition, sharding) if layout == "dtensor" else None
            if plan is not None:
                gram = _local_gram(matrix, tensor, plan[0])
                jobs.append(_GramJob(index, gram, matrix.shape(tuple(tensor.shape)), plan[1]))
            elif layout == "plain":
                _check_plain(matrix, tensor)
                plain.append(index)
            else:
                gathers[index] = (layout, owner)
        weights = [matrices[i].from_stored(matrices[i].stored()) for i in plain]
        groups = [matrices[i].groups for i in plain]
        spectra.update(zip(plain, weight_spectra(weights, decomposition=decomposition, groups=groups)))
        spectra.update(_lora_spectra(matrices, lora, decomposition))
        if jobs:
            spectra.update(_summed_gram_spectra(matrices, jobs, decomposition))
        if any(layout == "fsdp" for layout, _ in gathers.values()):
            _initialise_fsdp(owners)
        for group in _by_parameter(matrices, list(gathers)):
            layout, owner = gathers[group[0]]
            read = _gather_spectra([matrices[i] for i in group], layout, owner, decomposition)
            spectra.update(zip(group, read))
    return [spectra[i] for i in range(len(matrices))]


_LORA_BYTES = 2**30
"""Bytes of the LoRA weights computed at once: every adapted layer's ``W + (alpha / r) B A`` at once would take about
the memory of the model's weights again."""


def _lora_spectra(matrices: Sequence[WeightMatrix], indices: list[int], decomposition: str) -> dict[int, Spectrum]:
    """Spectra of the matrices of LoRA layers, whose weights are computed (:meth:`WeightMatrix.stored`) about
    :data:`_LORA_BYTES` at a time, each layer's once for all its parts (q, k and v of a ``c_attn``)."""
    spectra: dict[int, Spectrum] = {}
    start = 0
    while start < len(indices):
        computed: dict[tuple[int, bool], Tensor] = {}
        chunk: list[int] = []
        size = 0
        for index in indices[start:]:
            matrix = matrices[index]
            key = (id(matrix.lora), matrix.lora_update)
            if key not in computed:
                if size >= _LORA_BYTES:
                    break
                computed[key] = matrix.stored()
                size += computed[key].numel() * computed[key].element_size()
            chunk.append(index)
        weights = [matrices[i].from_stored(computed[id(matrices[i].lora), matrices[i].lora_update]) for i in chunk]
        groups = [matrices[i].groups for i in chunk]
        spectra.update(zip(chunk, weight_spectra(weights, decomposition=decomposition, groups=groups)))
        start += len(chunk)
    return spectra


def _summed_gram_spectra(matrices: Sequence[WeightMatrix], jobs: list[_GramJob], decomposition: str) -> dict:
    """Spectra of the Gram-sum route: one all-reduce per process group, then one eigendecomposition per Gram size;
    with ``decomposition="auto"``, the ill-conditioned matrices are redone by the SVD of the gathered matrix."""
    _all_reduce(jobs)
    grams = weight_spectra_from_grams([job.gram for job in jobs], [job.shape for job in jobs])
    spectra = {job.index: spectrum for job, spectrum in zip(jobs, grams)}
    if decomposition != "auto":
        return spectra
    flags = torch.tensor([needs_exact_svd(spectra[job.index]) for job in jobs], dtype=torch.int32)
    if dist.is_available() and dist.is_initialized():
        # Every process must gather the same layers; the summed Grams agree, the maximum makes it certain.
        flags = flags.to(jobs[0].gram.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    redo = [job.index for job, flag in zip(jobs, flags.tolist()) if flag]
    for group in _by_parameter(matrices, redo):
        spectra.update(zip(group, _gather_spectra([matrices[i] for i in group], "dtensor", None, "svd")))
    return spectra
