"""Turn layer outputs and weights into samples x features matrices.

Conv activations ``(B, C, H, W)`` and token activations ``(B, T, D)`` have no single matrix form; the reduction is an
explicit choice and is named in every logged key:

==========  ===========================  ========================================================================
reduction   conv ``(B, C, H, W)``        tokens ``(B, T, D)``
==========  ===========================  ========================================================================
flatten     ``(B, C*H*W)``               ``(B, T*D)``
channel     ``(B*H*W, C)``: each         (not defined)
            position is a sample
token       (not defined)                ``(B*T, D)``: each token is a sample
cls         (not defined)                ``(B, D)``: the first token
mean        ``(B, C)``: global average   ``(B, D)``: mean over tokens
            pool
last        (not defined)                ``(B, D)``: the last token, position ``T - 1`` (a decoder-only model's
                                         sequence embedding: the one token that has seen the whole sequence)
==========  ===========================  ========================================================================

Conv maps of more spatial dimensions, ``(B, C, D1, D2, D3)`` of a 3-D convolution (video ``(B, C, T, H, W)``,
volumetric images), take the same reductions over all their positions: ``flatten`` gives ``(B, C*D1*D2*D3)``,
``channel`` ``(B*D1*D2*D3, C)`` (each position a sample) and ``mean`` ``(B, C)`` (global average pool).

Two-dimensional inputs ``(B, d)`` are already matrices and are returned unchanged for every reduction, so one setting
can serve all layers of a network.

Padded token batches (a Hugging Face ``attention_mask``) pass a ``(B, T)`` mask whose true entries mark the real
tokens; padded positions then never reach the spectrum:

==========  ==================================================================================================
reduction   with a ``(B, T)`` mask
==========  ==================================================================================================
flatten     ``(B, T*D)`` with the padded positions zeroed (every sample keeps the same number of features)
token       ``(K, D)``: only the ``K = mask.sum()`` real tokens, sample by sample
cls         ``(B, D)``: unchanged (the first token is real in every right-padded batch); a mask whose first
            position is padding (left padding) is named in a warning: those rows are a pad token's state
mean        ``(B', D)``: the mean over each sample's real tokens; a sample without any real token is dropped
last        ``(B', D)``: each sample's last real token, the last position whose mask is true: the end of the
            sequence with right padding, position ``T - 1`` with left padding, and for a mask with holes (packed
            or unusual masks) its last true position, whatever comes before; a sample without any real token is
            dropped
==========  ==================================================================================================

:func:`token_rows_per_sample` gives how many rows each sample left, so per-sample labels can be repeated with
``labels.repeat_interleave(counts)``.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

__all__ = [
    "CONV_REDUCTIONS",
    "REDUCTIONS",
    "TOKEN_REDUCTIONS",
    "check_token_mask",
    "masked_token_rows",
    "reduce_activations",
    "token_mask",
    "token_rows_per_sample",
    "warn_cls_left_padding",
    "weight_as_matrix",
]

CONV_REDUCTIONS: tuple[str, ...] = ("flatten", "channel", "mean")
TOKEN_REDUCTIONS: tuple[str, ...] = ("flatten", "token", "cls", "mean", "last")
REDUCTIONS: tuple[str, ...] = ("flatten", "channel", "token", "cls", "mean", "last")


def reduce_activations(
    x: Tensor, reduction: str = "flatten", *, dtype: torch.dtype | None = None, mask: Tensor | None = None
) -> Tensor:
    """Reshape a batch of activations into an ``(N, d)`` samples x features matrix.

    Args:
        x: ``(B, d)`` features, ``(B, T, D)`` tokens, or ``(B, C, H, W)`` (or ``(B, C, D1, D2, D3)``, any number
            of spatial dimensions) conv maps.
        reduction: one of ``"flatten"``, ``"channel"``, ``"mean"`` for conv maps; ``"flatten"``, ``"token"``,
            ``"cls"``, ``"mean"``, ``"last"`` for tokens; ignored (after validation) for 2-D input.
        dtype: convert to this dtype; ``"channel"`` then converts while it reorders (one copy instead of two).
        mask: ``(B, T)`` true (or 1) at the real tokens, false (0) at padding; applies to token activations only
            (see the module docstring), ignored for ``(B, d)`` features and conv maps.

    Returns:
        ``(N, d)`` tensor, in ``dtype`` or else the input dtype (a view where possible).

    Raises:
        ValueError: unknown reduction, a reduction not defined for the input's rank, an unsupported rank, or a mask
            that is not ``(B, T)`` for ``(B, T, D)`` tokens.

    Warns:
        UserWarning: ``"cls"`` with a mask whose first position is padding in some sequence (left padding).
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"unknown reduction {reduction!r}; valid choices are {REDUCTIONS}")
    if x.ndim == 2:
        return _cast(x, dtype)
    if x.ndim >= 4:
        return _reduce_conv(x, reduction, dtype)
    if x.ndim == 3:
        if reduction not in TOKEN_REDUCTIONS:
            raise ValueError(
                f"reduction {reduction!r} is not defined for token activations of shape {tuple(x.shape)}; "
                f"valid choices are {TOKEN_REDUCTIONS}"
            )
        if mask is not None:
            return _reduce_masked_tokens(x, reduction, dtype, check_token_mask(mask, x))
        if reduction == "flatten":
            return _cast(x.flatten(1), dtype)
        if reduction == "token":
            return _cast(x.reshape(-1, x.shape[2]), dtype)
        if reduction == "cls":
            return _cast(x[:, 0], dtype)
        if reduction == "last":
            return _cast(x[:, -1], dtype)
        return _cast(x, dtype).mean(dim=1)
    raise ValueError(
        f"activations of shape {tuple(x.shape)} are not supported; expected (B, d), tokens (B, T, D) "
        "or conv maps (B, C, H, W) / (B, C, D1, D2, D3)"
    )


def _reduce_conv(x: Tensor, reduction: str, dtype: torch.dtype | None) -> Tensor:
    if reduction not in CONV_REDUCTIONS:
        raise ValueError(
            f"reduction {reduction!r} is not defined for conv activations of shape {tuple(x.shape)}; "
            f"valid choices are {CONV_REDUCTIONS}"
        )
    if reduction == "flatten":
        return _cast(x.flatten(1), dtype)
    if reduction == "channel":
        # (B, C, *spatial) -> (B, *spatial, C) -> (B*prod(spatial), C): each position a sample.
        last = (0, *range(2, x.ndim), 1)
        if dtype is None or dtype == x.dtype:
            return x.permute(last).reshape(-1, x.shape[1])
        out = torch.empty((x.shape[0], *x.shape[2:], x.shape[1]), dtype=dtype, device=x.device)
        return out.copy_(x.permute(last)).view(-1, x.shape[1])
    return _cast(x, dtype).mean(dim=tuple(range(2, x.ndim)))


def _reduce_masked_tokens(x: Tensor, reduction: str, dtype: torch.dtype | None, keep: Tensor) -> Tensor:
    if reduction == "cls":
        warn_cls_left_padding(keep, stacklevel=3)
    rows, real = masked_token_rows(x, reduction, keep, dtype=dtype)
    return rows if real is None else rows[real]


def masked_token_rows(
    x: Tensor, reduction: str, keep: Tensor, *, dtype: torch.dtype | None = None
) -> tuple[Tensor, Tensor | None]:
    """Masked ``(B, T, D)`` tokens as rows in a layout fixed by the shapes alone, with a mask of the real rows.

    :func:`reduce_activations` with a mask returns ``rows[real]``: the rows of the padded positions (``"token"``) or
    of the samples without a real token (``"mean"``, ``"last"``) left out. Their number depends on the mask's values,
    which a GPU would have to read back; here every row stays in place and ``real`` (``None`` when every row is real:
    ``"cls"``, and ``"flatten"`` whose padded positions are zeroed) says which rows to count. A sum that skips the
    rows where ``real`` is false (:func:`~rank_lightning.functional.streaming.row_moments` with ``row_mask``) equals
    the sum over ``rows[real]``.

    Args:
        x: ``(B, T, D)`` token activations.
        reduction: one of :data:`TOKEN_REDUCTIONS`.
        keep: ``(B, T)`` boolean mask, true at the real tokens (:func:`check_token_mask`).
        dtype: convert to this dtype first (a mean over half-precision tokens is best taken in float64).

    Returns:
        ``(rows, real)``: ``(B*T, D)`` and ``keep.reshape(-1)`` for ``"token"``; ``(B, D)`` means over each sample's
        real tokens and ``(B,)`` "has a real token" for ``"mean"``; ``(B, D)`` last real tokens (the last position
        whose mask is true; a zero row for a sample without any) and ``(B,)`` "has a real token" for ``"last"``;
        ``(B, D)`` first tokens for ``"cls"`` and ``(B, T*D)`` zero-padded rows for ``"flatten"``, both with
        ``real=None``.
    """
    if reduction not in TOKEN_REDUCTIONS:
        raise ValueError(f"unknown token reduction {reduction!r}; valid choices are {TOKEN_REDUCTIONS}")
    if reduction == "cls":
        return _cast(x[:, 0], dtype), None
    if reduction == "token":
        return _cast(x.reshape(-1, x.shape[2]), dtype), keep.reshape(-1)
    if reduction == "last":
        return _last_real_tokens(x, keep, dtype)
    # masked_fill, not a product: whatever a padded position holds (even inf or NaN) contributes exactly zero.
    zeroed = _cast(x, dtype).masked_fill(~keep.unsqueeze(2), 0)
    if reduction == "flatten":
        return zeroed.flatten(1), None
    counts = keep.sum(dim=1)
    return zeroed.sum(dim=1) / counts.clamp_min(1).unsqueeze(1).to(zeroed.dtype), counts > 0


def _last_real_tokens(x: Tensor, keep: Tensor, dtype: torch.dtype | None) -> tuple[Tensor, Tensor]:
    """Each sample's token at the last position its mask marks real, found on the device (no read back), and which
    samples have one; the row of a sample without a real token is zero, whatever its positions hold."""
    batch, length, width = x.shape
    if length == 0:
        return x.new_zeros((batch, width), dtype=dtype), keep.new_zeros((batch,), dtype=torch.bool)
    positions = torch.arange(length, device=keep.device)
    last = torch.where(keep, positions, -1).amax(dim=1)  # -1 where no position is real
    real = last >= 0
    rows = _cast(x[torch.arange(batch, device=x.device), last.clamp_min(0).to(x.device)], dtype)
    return rows.masked_fill(~real.to(rows.device).unsqueeze(1), 0), real


def warn_cls_left_padding(keep: Tensor, *, stacklevel: int = 2) -> None:
    """Warn when the ``(B, T)`` boolean mask ``keep`` marks the first position of some sequence as padding (left
    padding, as Llama's and GPT-2's tokenizers pad for generation): ``"cls"`` would measure a pad token's state there.
    Reads one flag back from the mask's device; ``stacklevel`` as :func:`warnings.warn` counts it from the caller."""
    if keep.ndim == 2 and keep.shape[1] and not bool(keep[:, 0].all()):
        warnings.warn(_CLS_LEFT_PADDING, UserWarning, stacklevel=stacklevel + 1)


_CLS_LEFT_PADDING = (
    "reduction='cls' takes each sequence's first position, but the attention mask marks it as padding in some "
    "sequences (left padding): their rows are a pad token's hidden state. Pad on the right, or use reduction='last' "
    "(each sequence's last real token, the sequence embedding of a decoder-only model) or 'mean'."
)


def check_token_mask(mask: Tensor, x: Tensor) -> Tensor:
    """The attention mask of token activations ``x`` ``(B, T, D)`` as a ``(B, T)`` boolean tensor on ``x``'s device.

    Accepted: booleans, or integers / floats that are all 0 or 1 (1 marks a real token, as in Hugging Face's
    ``attention_mask``). A mask longer than the tokens, ``(B, T)`` for ``(B, T', D)`` with ``T' < T``, is cut to
    ``T'`` when every position cut off is padding (tokens that end at the batch's longest sequence, as a nested
    tensor padded back to a tensor does).

    Raises:
        ValueError: the mask is not a tensor, its shape is not ``(B, T)`` of ``x``, or it holds other values (an
            additive ``0 / -inf`` mask, or PyTorch's ``key_padding_mask`` convention would need converting first).
    """
    if not isinstance(mask, Tensor):
        raise ValueError(f"the attention mask must be a (B, T) tensor, got a {type(mask).__name__}")
    if x.ndim == 3 and mask.ndim == 2 and mask.shape[0] == x.shape[0] and mask.shape[1] > x.shape[1]:
        # Tokens cut to the batch's longest sequence (a nested tensor padded back): the cut positions must be padding.
        cut = token_mask(mask[:, x.shape[1] :])
        if not bool(cut.any()):
            mask = mask[:, : x.shape[1]]
    if x.ndim != 3 or tuple(mask.shape) != tuple(x.shape[:2]):
        expected = f"(B, T) = {tuple(x.shape[:2])}" if x.ndim == 3 else "(B, T) of (B, T, D) token activations"
        raise ValueError(
            f"attention mask of shape {tuple(mask.shape)} does not match activations of shape {tuple(x.shape)}; "
            f"expected {expected} (a layer whose tokens are not the batch's: set mask_key to False or name "
            "the matching mask)"
        )
    return token_mask(mask).to(x.device)


def token_mask(mask: Tensor) -> Tensor:
    """An attention mask as a boolean tensor: true at the real tokens, false at padding.

    Accepted: booleans, or integers / floats that are all 0 or 1 (Hugging Face's ``attention_mask``).

    Raises:
        ValueError: other values (an additive ``0 / -inf`` mask; PyTorch's ``key_padding_mask``, true at padding,
            must be inverted first).
    """
    if mask.dtype == torch.bool:
        return mask
    if bool(((mask != 0) & (mask != 1)).any()):
        raise ValueError(
            f"attention mask of dtype {mask.dtype} holds values other than 0 and 1; expected true / 1 at the "
            "real tokens and false / 0 at padding"
        )
    return mask != 0


def token_rows_per_sample(mask: Tensor, reduction: str = "token") -> Tensor:
    """How many rows each sample contributes to :func:`reduce_activations` of masked ``(B, T, D)`` tokens.

    Args:
        mask: ``(B, T)`` attention mask (true / 1 at the real tokens).
        reduction: the token reduction: ``"token"`` keeps each sample's real tokens; ``"mean"`` and ``"last"`` one
            row per sample with at least one real token (none for a fully padded sample); ``"cls"`` and ``"flatten"``
            one row per sample.

    Returns:
        ``(B,)`` int64 counts on ``mask``'s device, summing to the rows of the reduced matrix; repeat per-sample
        labels with ``labels.repeat_interleave(counts)``.

    Raises:
        ValueError: a mask that is not 2-D or holds values other than 0 and 1, or a reduction that is not a token
            reduction.
    """
    if reduction not in TOKEN_REDUCTIONS:
        raise ValueError(f"unknown token reduction {reduction!r}; valid choices are {TOKEN_REDUCTIONS}")
    if not isinstance(mask, Tensor) or mask.ndim != 2:
        shape = tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__
        raise ValueError(f"the attention mask must be a (B, T) tensor, got {shape}")
    counts = token_mask(mask).sum(dim=1)
    if reduction == "token":
        return counts
    if reduction in ("mean", "last"):
        return (counts > 0).long()
    return torch.ones_like(counts)


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
