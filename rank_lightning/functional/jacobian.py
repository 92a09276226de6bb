"""Partial rank of the Jacobian of a network with respect to a fixed input patch (Feng et al. eq. 5, Lemma 2).

The full Jacobian of a network slice is far too large to compute, so Feng et al. measure the rank of the columns that
belong to a small input patch ``P``: ``J_P = d f(x) / d x_P``, a ``(num_outputs, K)`` matrix with ``K = |P|``. With
``psi`` the map that zero-pads a patch vector into an image, ``J_P`` is the Jacobian of ``v -> f(x + psi(v))`` at
``v = 0``, so its ``K`` columns are the Jacobian-vector products of ``f`` at ``x`` along the ``K`` one-hot images
``psi(e_k)``. They are computed in one forward-mode pass, ``torch.func.vmap`` over ``k`` of ``torch.func.jvp``, which
costs about ``K`` batched forward passes instead of ``num_outputs`` backward passes for reverse mode.

Feng et al. Lemma 2: the difference of the partial ranks of two nested sub-networks lower-bounds the difference of
their full ranks, so a drop of the partial rank from one block to the next certifies a drop of the full rank.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Literal, cast

import torch
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from rank_lightning.functional.spectral import default_rank_tolerance, numerical_rank
from rank_lightning.layers import compiled_code_eager
from rank_lightning.layers import eval_mode as switch_to_eval
from rank_lightning.validation import (
    check_choice,
    check_non_negative_int,
    check_non_negative_ints,
    check_positive,
    check_positive_int,
)

__all__ = [
    "PartialJacobianRank",
    "Patch",
    "capture_block_outputs",
    "default_patch_size",
    "partial_jacobian",
    "partial_jacobian_rank",
    "partial_jacobian_ranks",
]

# Feng et al. Sec. 4.3 use the central 16 x 16 x 3 patch of 224 x 224 ImageNet images (K = 768 columns).
_FENG_PATCH_SIZE = 16

JacobianOutput = Tensor | dict[str, Tensor]


def default_patch_size(height: int, width: int) -> int:
    """Side of the default square patch: a quarter of the shorter image side, at most Feng et al.'s 16.

    This gives 8 on 32 x 32 images (CIFAR: an 8 x 8 x 3 patch, K = 192), 7 on 28 x 28 (MNIST), 2 on 8 x 8 (digits) and
    Feng et al.'s 16 on 224 x 224 images (K = 768).

    Args:
        height: image height in pixels.
        width: image width in pixels.

    Returns:
        The side length, at least 1.
    """
    check_positive_int("height", height)
    check_positive_int("width", width)
    return max(1, min(_FENG_PATCH_SIZE, math.ceil(min(height, width) / 4)))


@dataclass(frozen=True)
class Patch:
    """A rectangular patch of a ``(C, H, W)`` image: rows ``top:top+height``, columns ``left:left+width``.

    Attributes:
        top: first row.
        left: first column.
        height: number of rows.
        width: number of columns.
        channels: the channels in the patch; ``None`` takes all of them (Feng et al.'s choice).
    """

    top: int
    left: int
    height: int
    width: int
    channels: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        check_non_negative_int("top", self.top)
        check_non_negative_int("left", self.left)
        check_positive_int("height", self.height)
        check_positive_int("width", self.width)
        if self.channels is not None:  # a list (as YAML gives it) is kept as the tuple it stands for
            object.__setattr__(self, "channels", check_non_negative_ints("channels", self.channels))

    @classmethod
    def central(cls, input_shape: Sequence[int], size: int | None = None) -> Patch:
        """The central ``size x size`` patch over all channels of an image of shape ``(C, H, W)``.

        Args:
            input_shape: ``(C, H, W)`` of one image (no batch dimension).
            size: side of the square; ``None`` uses :func:`default_patch_size`.

        Returns:
            The patch, centred (rounded towards the top-left corner when the margins are odd).
        """
        if len(input_shape) != 3:
            raise ValueError(f"a central patch needs an image shape (C, H, W), got {tuple(input_shape)}")
        _, height, width = input_shape
        side = default_patch_size(height, width) if size is None else size
        if not 1 <= side <= min(height, width):
            raise ValueError(f"patch size {side} does not fit an image of {height} x {width}")
        return cls(top=(height - side) // 2, left=(width - side) // 2, height=side, width=side)

    def mask(self, input_shape: Sequence[int]) -> Tensor:
        """Boolean mask of shape ``(C, H, W)`` that is True inside the patch."""
        if len(input_shape) != 3:
            raise ValueError(f"a Patch applies to an image shape (C, H, W), got {tuple(input_shape)}")
        channels, height, width = input_shape
        if self.height < 1 or self.width < 1 or self.top < 0 or self.left < 0:
            raise ValueError(f"{self} must have a non-negative corner and a positive size")
        if self.top + self.height > height or self.left + self.width > width:
            raise ValueError(f"{self} does not fit an image of {height} x {width}")
        chosen = range(channels) if self.channels is None else self.channels
        bad = [c for c in chosen if not 0 <= c < channels]
        if bad or not chosen:
            raise ValueError(f"patch channels {self.channels} must be a non-empty subset of 0..{channels - 1}")
        mask = torch.zeros(tuple(input_shape), dtype=torch.bool)
        rows = slice(self.top, self.top + self.height)
        cols = slice(self.left, self.left + self.width)
        mask[list(chosen), rows, cols] = True
        return mask


@dataclass(frozen=True)
class PartialJacobianRank:
    """Partial Jacobian ranks of one output over a few inputs (Feng et al. eq. 5).

    Attributes:
        ranks: int64 tensor, the numerical rank of ``J_P`` at each input.
        num_outputs: rows of ``J_P`` (the flattened output size).
        num_directions: columns of ``J_P``, ``K`` = the number of input coordinates in the patch.
    """

    ranks: Tensor
    num_outputs: int
    num_directions: int

    @property
    def mean(self) -> float:
        """Rank averaged over the inputs (the value Feng et al. plot)."""
        return float(self.ranks.double().mean())

    @property
    def max_rank(self) -> int:
        """The largest rank possible, ``min(num_outputs, K)``."""
        return min(self.num_outputs, self.num_directions)


def _patch_indices(sample_shape: torch.Size, patch: Patch | Tensor | None) -> Tensor:
    """Flat indices (into one flattened input) of the patch coordinates ``j_1 < ... < j_K``."""
    numel = math.prod(sample_shape)
    if patch is None:
        if len(sample_shape) == 3:
            return Patch.central(sample_shape).mask(sample_shape).flatten().nonzero().squeeze(1)
        return torch.arange(numel)
    if isinstance(patch, Patch):
        return patch.mask(sample_shape).flatten().nonzero().squeeze(1)
    if not isinstance(patch, Tensor):
        raise TypeError(f"patch must be a Patch, a boolean mask, an index tensor or None, got {type(patch).__name__}")
    if patch.dtype == torch.bool:
        if patch.shape != sample_shape:
            raise ValueError(f"boolean patch mask has shape {tuple(patch.shape)}, expected {tuple(sample_shape)}")
        indices = patch.flatten().nonzero().squeeze(1)
    elif patch.dtype.is_floating_point or patch.ndim != 1:
        raise ValueError(f"an index patch must be a 1-D integer tensor, got dtype {patch.dtype} and ndim {patch.ndim}")
    else:
        indices = patch.long().unique()
        if indices.numel() and not 0 <= int(indices[0]) <= int(indices[-1]) < numel:
            raise ValueError(f"patch indices must lie in [0, {numel}), got range [{indices[0]}, {indices[-1]}]")
    if indices.numel() == 0:
        raise ValueError("the patch is empty")
    return indices.cpu()


def _flatten_columns(tangents: Tensor) -> Tensor:
    """(K, 1, ...) stacked Jacobian-vector products -> (num_outputs, K) Jacobian."""
    return tangents.reshape(tangents.shape[0], -1).T


@contextmanager
def _forward_mode_context() -> Iterator[None]:
    """Use the attention kernels that have a forward-mode derivative (not the fused ones), restoring the settings;
    run compiled code eagerly (``torch.func.jvp`` of a compiled model would make TorchDynamo skip its ``forward``
    from then on, see :func:`~rank_lightning.layers.compiled_code_eager`)."""
    enabled = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with warnings.catch_warnings(), sdpa_kernel(SDPBackend.MATH), compiled_code_eager():
            # On first use, forward-mode AD compiles torch's own decompositions with torch.jit.script and warns about
            # that deprecated call, which the user can do nothing about.
            warnings.filterwarnings("ignore", message=r"`torch\.jit\.script` is deprecated", category=FutureWarning)
            yield
    finally:
        torch.backends.mha.set_fastpath_enabled(enabled)


# torch.func's error for an autograd.Function without setup_context, such as the reentrant checkpoint's.
_UNTRANSFORMABLE_FUNCTION = "autograd.Function with functorch transforms"

# The most bytes the K x K one-hot directions of a patch may take: K = 16,384 float32 coordinates. Past it the
# Jacobian itself, (num_outputs, K), is rarely smaller, and allocating either would end the run out of memory.
MAX_DIRECTION_BYTES = 2**30


def _check_patch_size(num_directions: int, x: Tensor) -> None:
    """Refuse a patch whose ``K x K`` directions would not fit in :data:`MAX_DIRECTION_BYTES` (all coordinates of a
    video ``(C, T, H, W)`` or of a large non-image input), before anything is allocated."""
    size = num_directions * num_directions * x.element_size()
    if size <= MAX_DIRECTION_BYTES:
        return
    fits = math.isqrt(MAX_DIRECTION_BYTES // x.element_size())
    raise ValueError(
        f"the partial Jacobian over K = {num_directions:,} coordinates of inputs of shape {tuple(x.shape)} needs "
        f"K x K directions of {size / 2**30:,.1f} GiB (and a Jacobian of K columns); at most {fits:,} coordinates "
        "are taken: give a patch of fewer coordinates (patch=Patch(...) for (C, H, W) images, or a boolean mask or "
        "flat indices of the input, e.g. a few pixels of one frame of a video)"
    )


def partial_jacobian(
    fn: Callable[[Tensor], JacobianOutput],
    x: Tensor,
    patch: Patch | Tensor | None = None,
    *,
    chunk_size: int | None = None,
) -> JacobianOutput:
    """Jacobian of ``fn`` at one input with respect to the coordinates of a patch (Feng et al. eq. 5).

    ``fn`` receives a batch of one, ``x.unsqueeze(0)``; its output (or every output of a dict) is flattened. The
    columns are computed in one forward-mode pass: ``torch.func.vmap`` over the ``K`` patch coordinates of
    ``torch.func.jvp`` along the one-hot image ``psi(e_k)``. ``fn`` must be deterministic and must not depend on the
    batch (BatchNorm in eval mode, no dropout); see :func:`partial_jacobian_ranks` for models.

    Args:
        fn: maps a ``(1, *x.shape)`` batch to a tensor or to a dict of tensors.
        x: one input without batch dimension, e.g. ``(C, H, W)``.
        patch: the coordinates ``P``: a :class:`Patch`, a boolean mask of ``x.shape``, or a 1-D tensor of flat
            indices. ``None`` uses ``Patch.central`` for images ``(C, H, W)`` (:func:`default_patch_size`) and all
            coordinates otherwise (the full Jacobian).
        chunk_size: number of directions pushed through ``fn`` at once; ``None`` does all ``K`` together. Smaller
            chunks bound the memory at the same result.

    Returns:
        ``J_P`` of shape ``(num_outputs, K)``, columns ordered by flat input index; a dict of them if ``fn`` returns a
        dict.

    Raises:
        ValueError: ``x`` is not floating point (integer token ids, which have no derivative), or a patch of more
            coordinates than :data:`MAX_DIRECTION_BYTES` allows (``K x K`` directions over 1 GiB: every
            coordinate of a video or of a large non-image input), refused before anything is allocated.
    """
    check_positive_int("chunk_size", chunk_size, allow_none=True)
    if not x.is_floating_point():
        raise ValueError(
            f"the inputs are {str(x.dtype).removeprefix('torch.')}, not floating point: a Jacobian with respect to "
            "them does not exist (integer token ids of an embedding model have no derivative); the partial Jacobian "
            "rank needs real-valued inputs such as images or features"
        )
    indices = _patch_indices(x.shape, patch)
    _check_patch_size(indices.numel(), x)
    indices = indices.to(x.device)
    primal = x.detach().unsqueeze(0)
    flat_zeros = torch.zeros(primal.numel(), dtype=x.dtype, device=x.device)

    def column(direction: Tensor) -> JacobianOutput:
        # psi: place the K patch values into an otherwise zero image.
        tangent = flat_zeros.scatter(0, indices, direction).view_as(primal)
        return torch.func.jvp(fn, (primal,), (tangent,))[1]

    eye = torch.eye(indices.numel(), dtype=x.dtype, device=x.device)
    with _forward_mode_context():
        try:
            columns = torch.func.vmap(column, chunk_size=chunk_size)(eye)
        except RuntimeError as error:
            if _UNTRANSFORMABLE_FUNCTION not in str(error):
                raise
            raise RuntimeError(
                "the model (fn) runs an autograd.Function that the forward-mode Jacobian (torch.func.jvp under "
                "vmap) cannot run: torch.utils.checkpoint(..., use_reentrant=True) is one. Checkpoint with "
                "use_reentrant=False, or only in training mode (if self.training: ...), as transformers' gradient "
                "checkpointing does (partial_jacobian_ranks and JacobianRankMonitor run the model in eval mode)."
            ) from error
    if isinstance(columns, dict):
        return {name: _flatten_columns(value) for name, value in columns.items()}
    if not isinstance(columns, Tensor):
        raise TypeError(f"fn must return a tensor or a dict of tensors, got {type(columns).__name__}")
    return _flatten_columns(columns)


def partial_jacobian_rank(
    fn: Callable[[Tensor], JacobianOutput],
    inputs: Tensor,
    patch: Patch | Tensor | None = None,
    *,
    rank_tolerance: float | None = None,
    tolerance_size: Literal["min", "max"] = "min",
    chunk_size: int | None = None,
) -> PartialJacobianRank | dict[str, PartialJacobianRank]:
    """Numerical rank of the partial Jacobian ``d fn(x) / d x_P`` at each of a few inputs (Feng et al. eq. 5).

    Args:
        fn: maps a batch of one input to a tensor or a dict of tensors (see :func:`partial_jacobian`).
        inputs: ``(B, ...)`` a few inputs; one Jacobian per row.
        patch: the patch ``P`` (see :func:`partial_jacobian`).
        rank_tolerance: relative tolerance of :func:`~rank_lightning.functional.spectral.numerical_rank`; ``None``
            takes the default ``finfo(float32).eps * min(num_outputs, K)`` (``max`` with ``tolerance_size="max"``);
            for a Jacobian computed in bfloat16 or float16 (half-precision weights, or autocast), at least
            ``finfo(dtype).eps`` (:func:`~rank_lightning.functional.spectral.default_rank_tolerance` with
            ``dtype_eps``), so that rounding noise is not counted as rank.
        tolerance_size: ``"min"`` (Feng et al.: the number of singular values) or ``"max"`` dimension of ``J_P``.
        chunk_size: directions per forward-mode chunk (memory bound).

    Returns:
        A :class:`PartialJacobianRank`, or a dict of them keyed like ``fn``'s output.
    """
    # Checked before the Jacobians, which can take minutes, rather than after them.
    check_choice("tolerance_size", tolerance_size, ("min", "max"))
    check_positive("rank_tolerance", rank_tolerance, allow_none=True)
    check_positive_int("chunk_size", chunk_size, allow_none=True)
    if inputs.ndim < 2 or inputs.shape[0] == 0:
        raise ValueError(f"inputs must be a non-empty batch (B, ...), got shape {tuple(inputs.shape)}")
    per_input: dict[str | None, list[Tensor]] = {}
    shapes: dict[str | None, tuple[int, int]] = {}
    for x in inputs:
        # Forward-mode AD works under no_grad; this only stops reverse-mode graphs through the parameters.
        with torch.no_grad():
            jacobian = partial_jacobian(fn, x, patch, chunk_size=chunk_size)
        named = jacobian if isinstance(jacobian, dict) else {None: jacobian}
        for name, matrix in named.items():
            tolerance = rank_tolerance
            dtype_eps = float(torch.finfo(matrix.dtype).eps)
            if tolerance is None and dtype_eps > torch.finfo(torch.float32).eps:
                # A half-precision Jacobian carries rounding noise far above float32's tolerance.
                tolerance = default_rank_tolerance(*matrix.shape, tolerance_size=tolerance_size, dtype_eps=dtype_eps)
            per_input.setdefault(name, []).append(
                numerical_rank(matrix, rank_tolerance=tolerance, tolerance_size=tolerance_size)
            )
            shapes[name] = tuple(matrix.shape)
    results = {
        name: PartialJacobianRank(torch.stack(ranks), num_outputs=shapes[name][0], num_directions=shapes[name][1])
        for name, ranks in per_input.items()
    }
    return results[None] if None in results else results


class _AllBlocksSeen(Exception):
    """Raised inside the forward pass once every monitored block has run, to skip the rest of the network."""


def _resolve_layers(
    model: nn.Module, layers: Mapping[str, str | nn.Module] | Sequence[str] | str | None
) -> dict[str, nn.Module]:
    if layers is None:
        if not hasattr(model, "blocks"):
            raise ValueError(f"{type(model).__name__} has no blocks(); pass layers= explicitly (names or modules)")
        layers = model.blocks()
    if isinstance(layers, str):  # one dotted path, not a sequence of one-character names
        layers = [layers]
    named = dict(layers) if isinstance(layers, Mapping) else {name: name for name in layers}
    if not named:
        raise ValueError("layers is empty; pass at least one layer name or module")
    resolved = {}
    for name, layer in named.items():
        if isinstance(layer, nn.Module):
            resolved[name] = layer
            continue
        try:
            resolved[name] = model.get_submodule(layer)
        except AttributeError:
            valid = ", ".join(n for n, _ in model.named_modules() if n)
            raise ValueError(f"unknown layer {layer!r}; layers are: {valid}") from None
    return resolved


def _first_tensor(output: object, name: str) -> Tensor:
    if isinstance(output, Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], Tensor):
        # Modules such as nn.MultiheadAttention return (output, attention weights).
        return output[0]
    raise TypeError(
        f"layer {name!r} returns {type(output).__name__}; a tensor (or a tuple starting with one) is needed"
    )


def capture_block_outputs(
    model: nn.Module, layers: Mapping[str, str | nn.Module] | Sequence[str] | str | None = None
) -> Callable[[Tensor], dict[str, Tensor]]:
    """Wrap a model into a function returning the outputs of chosen blocks, for use under ``torch.func`` transforms.

    Forward hooks are registered only while the returned function runs, and the captured outputs are returned rather
    than stored, so under ``vmap``/``jvp`` they stay inside the transform (a tensor kept in a hook would leak a batched
    dual tensor out of it). The forward pass stops as soon as every block has produced its output, so the part of the
    network after the deepest monitored block costs nothing. A block called more than once keeps its first output; a
    block returning a tuple contributes its first tensor. Outputs are cloned, because later in-place operations
    (``ReLU(inplace=True)``) would otherwise overwrite them.

    Args:
        model: the network.
        layers: ``{name: dotted path or module}``, a list of dotted paths (used as names) or one dotted path;
            ``None`` takes ``model.blocks()`` (the backbone interface of ``rank_lightning.models``).

    Returns:
        ``fn(x) -> {name: output}``, ordered like ``layers``.
    """
    modules = _resolve_layers(model, layers)

    def fn(x: Tensor) -> dict[str, Tensor]:
        captured: dict[str, Tensor] = {}

        def make_hook(name: str) -> Callable[[nn.Module, object, object], None]:
            def hook(module: nn.Module, args: object, output: object) -> None:
                if name not in captured:
                    captured[name] = _first_tensor(output, name).clone()
                if len(captured) == len(modules):
                    raise _AllBlocksSeen

            return hook

        handles = [module.register_forward_hook(make_hook(name)) for name, module in modules.items()]
        try:
            model(x)
        except _AllBlocksSeen:
            pass
        finally:
            for handle in handles:
                handle.remove()
        missing = [name for name in modules if name not in captured]
        if missing:
            raise RuntimeError(f"layers {missing} were not called in the forward pass of {type(model).__name__}")
        return {name: captured[name] for name in modules}

    return fn


def _check_no_training_batchnorm(model: nn.Module) -> None:
    """Raise when a BatchNorm or a dropout of ``model`` is in training mode (batch-dependent or random output)."""
    training_bn = [
        name for name, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training
    ]
    if training_bn:
        raise ValueError(
            f"BatchNorm layers {training_bn} are in training mode: their output depends on the whole batch and "
            "vmap cannot update running statistics; call model.eval() or pass eval_mode=True"
        )
    training_dropout = [
        name
        for name, m in model.named_modules()
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.training and m.p > 0
    ]
    if training_dropout:
        raise ValueError(
            f"dropout layers {training_dropout} are in training mode: they would draw a different mask for every "
            "direction of the Jacobian; call model.eval() or pass eval_mode=True"
        )


def partial_jacobian_ranks(
    model: nn.Module,
    inputs: Tensor,
    layers: Mapping[str, str | nn.Module] | Sequence[str] | str | None = None,
    patch: Patch | Tensor | None = None,
    *,
    rank_tolerance: float | None = None,
    tolerance_size: Literal["min", "max"] = "min",
    chunk_size: int | None = None,
    eval_mode: bool = True,
) -> dict[str, PartialJacobianRank]:
    """Partial Jacobian rank of every monitored block of a model, from one forward-mode pass per input.

    Feng et al. eq. 5 and Fig. 1 (a-c): the rank of ``d F_k(x) / d x_P`` for the sub-networks ``F_k`` ending at each
    block, averaged over a few inputs. All blocks share the same Jacobian-vector products, so one ``vmap``/``jvp``
    pass per input yields every block's Jacobian.

    BatchNorm must use its running statistics: in training mode its output depends on the other samples of the batch
    and ``vmap`` cannot update the running statistics. With ``eval_mode=True`` (default) the model is switched to
    eval mode for the computation (which also disables dropout) and every submodule's training flag is restored
    afterwards, even on error; with ``eval_mode=False`` a BatchNorm or a dropout in training mode raises
    ``ValueError``.

    Args:
        model: the network; ``inputs`` must be on its device.
        inputs: ``(B, C, H, W)`` (or ``(B, ...)``) a few inputs.
        layers: blocks to measure (see :func:`capture_block_outputs`); ``None`` takes ``model.blocks()``.
        patch: the patch ``P`` (see :func:`partial_jacobian`); default: central, :func:`default_patch_size`.
        rank_tolerance: relative tolerance of the numerical rank; ``None`` takes
            ``finfo(float32).eps * min(num_outputs, K)``, at least ``finfo(dtype).eps`` for a bfloat16 or float16
            Jacobian (see :func:`partial_jacobian_rank`).
        tolerance_size: ``K`` of the default tolerance: ``"min"`` (Feng et al.) or ``"max"`` dimension of ``J_P``.
        chunk_size: directions per forward-mode chunk (memory bound).
        eval_mode: switch the model to eval mode temporarily (True) or require it (False).

    Returns:
        ``{block name: PartialJacobianRank}`` ordered like ``layers``.
    """
    fn = capture_block_outputs(model, layers)
    if not eval_mode:
        _check_no_training_batchnorm(model)
    with switch_to_eval(model) if eval_mode else nullcontext():
        result = partial_jacobian_rank(
            fn, inputs, patch, rank_tolerance=rank_tolerance, tolerance_size=tolerance_size, chunk_size=chunk_size
        )
    return cast(dict[str, PartialJacobianRank], result)
