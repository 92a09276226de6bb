"""Turn layer outputs and weights into samples x features matrices.

Conv activations ``(B, C, H, W)`` and token activations ``(B, T, D)`` have no single matrix form; the reduction is an
explicit choice and is named in every logged key:

==========  =========================  ==========================================================================
reduction   conv ``(B, C, H, W)``      tokens ``(B, T, D)``
==========  =========================  ==========================================================================
flatten     ``(B, C*H*W)``             ``(B, T*D)``
channel     ``(B*H*W, C)``: each       (not defined)
            position is a sample
token       (not defined)              ``(B*T, D)``: each token is a sample
cls         (not defined)              ``(B, D)``: the first token
mean        ``(B, C)``: global average ``(B, D)``: mean over tokens
            pool
==========  =========================  ==========================================================================

Two-dimensional inputs ``(B, d)`` are already matrices and are returned unchanged for every reduction, so one setting
can serve all layers of a network.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["CONV_REDUCTIONS", "REDUCTIONS", "TOKEN_REDUCTIONS", "reduce_activations", "weight_as_matrix"]

CONV_REDUCTIONS: tuple[str, ...] = ("flatten", "channel", "mean")
TOKEN_REDUCTIONS: tuple[str, ...] = ("flatten", "token", "cls", "mean")
REDUCTIONS: tuple[str, ...] = ("flatten", "channel", "token", "cls", "mean")


def reduce_activations(x: Tensor, reduction: str = "flatten", *, dtype: torch.dtype | None = None) -> Tensor:
    """Reshape a batch of activations into an ``(N, d)`` samples x features matrix.

    Args:
        x: ``(B, d)`` features, ``(B, T, D)`` tokens or ``(B, C, H, W)`` conv maps.
        reduction: one of ``"flatten"``, ``"channel"``, ``"mean"`` for conv maps; ``"flatten"``, ``"token"``,
            ``"cls"``, ``"mean"`` for tokens; ignored (after validation) for 2-D input.
        dtype: convert to this dtype; ``"channel"`` then converts while it reorders (one copy instead of two).

    Returns:
        ``(N, d)`` tensor, in ``dtype`` or else the input dtype (a view where possible).

    Raises:
        ValueError: unknown reduction, a reduction not defined for the input's rank, or an unsupported rank.
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"unknown reduction {reduction!r}; valid choices are {REDUCTIONS}")
    if x.ndim == 2:
        return _cast(x, dtype)
    if x.ndim == 4:
        if reduction not in CONV_REDUCTIONS:
            raise ValueError(
                f"reduction {reduction!r} is not defined for conv activations of shape {tuple(x.shape)}; "
                f"valid choices are {CONV_REDUCTIONS}"
            )
        if reduction == "flatten":
            return _cast(x.flatten(1), dtype)
        if reduction == "channel":
            if dtype is None or dtype == x.dtype:
                return x.permute(0, 2, 3, 1).reshape(-1, x.shape[1])
            b, c, h, w = x.shape
            out = torch.empty((b, h, w, c), dtype=dtype, device=x.device)
            return out.copy_(x.permute(0, 2, 3, 1)).view(-1, c)
        return _cast(x, dtype).mean(dim=(2, 3))
    if x.ndim == 3:
        if reduction not in TOKEN_REDUCTIONS:
            raise ValueError(
                f"reduction {reduction!r} is not defined for token activations of shape {tuple(x.shape)}; "
                f"valid choices are {TOKEN_REDUCTIONS}"
            )
        if reduction == "flatten":
            return _cast(x.flatten(1), dtype)
        if reduction == "token":
            return _cast(x.reshape(-1, x.shape[2]), dtype)
        if reduction == "cls":
            return _cast(x[:, 0], dtype)
        return _cast(x, dtype).mean(dim=1)
    raise ValueError(
        f"activations of shape {tuple(x.shape)} are not supported; expected (B, d), tokens (B, T, D) "
        "or conv maps (B, C, H, W)"
    )


def weight_as_matrix(w: Tensor) -> Tensor:
    """View a layer weight as a matrix: Linear ``(out, in)`` as is, conv ``(out, in, *kernel)`` as ``(out, fan_in)``.

    ``fan_in = in * prod(kernel)``: every kernel offset of an output channel lands in its row (WeightWatcher
    instead splits the kernel per offset).

    Args:
        w: weight tensor with at least two dimensions.

    Returns:
        ``(out, fan_in)`` matrix (a view where possible).
    """
    if w.ndim < 2:
        raise ValueError(f"a weight matrix needs at least 2 dimensions, got shape {tuple(w.shape)}")
    return w if w.ndim == 2 else w.reshape(w.shape[0], -1)


def _cast(x: Tensor, dtype: torch.dtype | None) -> Tensor:
    return x if dtype is None else x.to(dtype)
