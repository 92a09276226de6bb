"""Adversarial attacks in pixel units (FGSM, Iter-FGSM, Iter-LL-FGSM) and the measures of Sanyal et al. Sec. 5."""

from rank_lightning.attacks.evaluation import accuracy_under_attack, adversarial_feature_distance, l2_dissimilarity
from rank_lightning.attacks.gradient_sign import (
    ATTACKS,
    attack,
    fgsm,
    iterative_fgsm,
    iterative_ll_fgsm,
    kurakin_steps,
)
from rank_lightning.attacks.pixels import channel_stats, from_pixels, to_pixels

__all__ = [
    "ATTACKS",
    "accuracy_under_attack",
    "adversarial_feature_distance",
    "attack",
    "channel_stats",
    "fgsm",
    "from_pixels",
    "iterative_fgsm",
    "iterative_ll_fgsm",
    "kurakin_steps",
    "l2_dissimilarity",
    "to_pixels",
]
