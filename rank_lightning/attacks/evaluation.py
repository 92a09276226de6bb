"""What an attack did: accuracy under attack, image dissimilarity and feature displacement (Sanyal et al. Sec. 5)."""

from __future__ import annotations

import torch

from rank_lightning.attacks.pixels import ChannelStats, to_pixels
from rank_lightning.layers import class_labels

REDUCTIONS = ("mean", "sum")


def _at_least_float32(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


def l2_dissimilarity(
    adversarial: torch.Tensor,
    clean: torch.Tensor,
    *,
    mean: ChannelStats = None,
    std: ChannelStats = None,
) -> torch.Tensor:
    """Normalised L2 dissimilarity ``||x_a - x_d||_2 / ||x_d||_2`` of each sample (Sanyal et al. eq. 10).

    Sanyal et al. measure the perturbation relative to the magnitude of the image, so both batches are
    un-normalised to pixels in [0, 1] first; the value then does not depend on the datamodule's normalisation.
    Eq. 10 sums over samples; this returns one value per sample, to be averaged by the caller.

    Args:
        adversarial: adversarial batch ``(B, ...)``, normalised like the model's inputs.
        clean: clean batch of the same shape.
        mean: the datamodule's per-channel mean, or ``None`` for inputs already in [0, 1].
        std: the datamodule's per-channel std, or ``None`` for inputs already in [0, 1].

    Returns:
        ``(B,)`` dissimilarities, in float32 or wider; an all-black clean image gives ``inf`` (``nan`` if unchanged).
    """
    if adversarial.shape != clean.shape:
        raise ValueError(
            f"adversarial and clean batches differ in shape: {tuple(adversarial.shape)} vs {tuple(clean.shape)}"
        )
    adversarial_pixels = _at_least_float32(to_pixels(adversarial, mean, std)).flatten(1)
    clean_pixels = _at_least_float32(to_pixels(clean, mean, std)).flatten(1)
    return torch.linalg.vector_norm(adversarial_pixels - clean_pixels, dim=1) / torch.linalg.vector_norm(
        clean_pixels, dim=1
    )


def accuracy_under_attack(adversarial_logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Fraction of adversarial inputs still classified as their true label (the complement of Sanyal Fig. 5's y-axis).

    Args:
        adversarial_logits: logits ``(B, num_classes)`` of the adversarial batch.
        targets: true class labels ``(B,)`` (or another of :data:`~rank_lightning.layers.LABEL_FORMS`).

    Returns:
        Scalar float32 tensor in [0, 1] (``nan`` for an empty batch).
    """
    if adversarial_logits.dim() != 2 or adversarial_logits.shape[0] != targets.shape[0]:
        raise ValueError(
            f"expected logits (B, num_classes) and targets (B,); got {tuple(adversarial_logits.shape)} and "
            f"{tuple(targets.shape)}"
        )
    # A (B, 1) column compared with (B,) predictions would broadcast to (B, B): read as (B,), as everywhere.
    targets = class_labels(targets, adversarial_logits.shape[0], name="targets").to(adversarial_logits.device)
    return (adversarial_logits.argmax(dim=1) == targets).float().mean()


def adversarial_feature_distance(
    adversarial_features: torch.Tensor,
    clean_features: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    reduction: str = "mean",
) -> torch.Tensor:
    """``D_Adv = 1/N sum_i ||f_l(x_a,i) - f_l(x_d,i)||_2^2`` over the samples selected by ``mask`` (Sanyal Sec. 5.1.1).

    Sanyal et al. average over the samples the model classified correctly before the attack; pass that as
    ``mask``. Features of any shape ``(B, ...)`` are flattened per sample.

    Args:
        adversarial_features: activations ``(B, ...)`` of layer l on the adversarial batch.
        clean_features: activations of the same layer on the clean batch.
        mask: boolean ``(B,)`` selecting the samples to include; ``None`` includes all.
        reduction: ``"mean"`` (D_Adv itself; ``nan`` when no sample is selected) or ``"sum"`` (to accumulate
            across batches together with ``mask.sum()``).

    Returns:
        Scalar tensor, in float32 or wider.
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"unknown reduction {reduction!r}; reductions are: {', '.join(REDUCTIONS)}")
    if adversarial_features.shape != clean_features.shape:
        raise ValueError(
            f"adversarial and clean features differ in shape: {tuple(adversarial_features.shape)} vs "
            f"{tuple(clean_features.shape)}"
        )
    difference = _at_least_float32(adversarial_features).flatten(1) - _at_least_float32(clean_features).flatten(1)
    squared = difference.square().sum(dim=1)
    if mask is not None:
        if mask.dtype != torch.bool or mask.shape != squared.shape:
            raise ValueError(
                f"mask must be boolean of shape {tuple(squared.shape)}; got {mask.dtype} {tuple(mask.shape)}"
            )
        squared = squared[mask]
    return squared.mean() if reduction == "mean" else squared.sum()
