"""Moving inputs between the model's normalised space and pixel space [0, 1].

Datamodules normalise pixels in [0, 1] per channel, ``x = (p - mean) / std``; attack budgets and the
dissimilarity of Sanyal et al. eq. 10 are stated in pixel units, so both undo that normalisation.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

ChannelStats = Sequence[float] | torch.Tensor | None


def channel_stats(
    mean: ChannelStats, std: ChannelStats, like: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Per-channel ``mean`` and ``std`` shaped to broadcast against ``like`` (channels on dim 1).

    Args:
        mean: one value per channel, a single value for all channels, or ``None`` for inputs already in [0, 1].
        std: same length rules as ``mean``; every value must be positive.
        like: a batch ``(B, C, ...)`` giving the number of channels, the dtype and the device.

    Returns:
        ``(mean, std)`` of shape ``(1, C or 1, 1, ...)``, or ``None`` when both are ``None``.

    Raises:
        ValueError: only one of ``mean``/``std`` given, a length other than 1 or C, or a non-positive std.
    """
    if mean is None and std is None:
        return None
    if mean is None or std is None:
        raise ValueError(f"give both mean and std or neither; got mean={mean!r}, std={std!r}")
    if like.dim() < 2:
        raise ValueError(f"inputs must be batched (B, C, ...) to be un-normalised; got shape {tuple(like.shape)}")
    channels = like.shape[1]
    shape = (1, -1) + (1,) * (like.dim() - 2)
    stats = []
    for name, values in (("mean", mean), ("std", std)):
        tensor = torch.as_tensor(values, dtype=like.dtype, device=like.device).flatten()
        if tensor.numel() not in (1, channels):
            raise ValueError(
                f"{name} has {tensor.numel()} values but the inputs have {channels} channels (dim 1); "
                f"give 1 or {channels} values"
            )
        stats.append(tensor.reshape(shape))
    if bool((stats[1] <= 0).any()):
        raise ValueError(f"std must be positive; got {std!r}")
    return stats[0], stats[1]


def to_pixels(inputs: torch.Tensor, mean: ChannelStats = None, std: ChannelStats = None) -> torch.Tensor:
    """Undo the datamodule's normalisation: ``p = x * std + mean`` (identity when both are ``None``)."""
    stats = channel_stats(mean, std, inputs)
    if stats is None:
        return inputs
    return inputs * stats[1] + stats[0]


def from_pixels(pixels: torch.Tensor, mean: ChannelStats = None, std: ChannelStats = None) -> torch.Tensor:
    """Apply the datamodule's normalisation: ``x = (p - mean) / std`` (identity when both are ``None``)."""
    stats = channel_stats(mean, std, pixels)
    if stats is None:
        return pixels
    return (pixels - stats[0]) / stats[1]
