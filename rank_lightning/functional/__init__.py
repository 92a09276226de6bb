"""rank_lightning.functional: pure tensor -> tensor math (no state, no Lightning)."""

from rank_lightning.functional.embedding import low_dimensional_accuracy
from rank_lightning.functional.nystrom import exact_projection, nystrom_projection, rank_projection
from rank_lightning.functional.reductions import reduce_activations, weight_as_matrix
from rank_lightning.functional.spectral import (
    Spectrum,
    classwise_variance_ratio,
    default_rank_tolerance,
    effective_rank,
    numerical_rank,
    participation_ratio,
    singular_values,
    soft_rank,
    spectrum,
    spectrum_from_gram,
    stable_rank,
    tail_error,
    total_cluster_variation,
    total_cluster_variation_from_moments,
    variance_ratio,
)

__all__ = [
    "Spectrum",
    "classwise_variance_ratio",
    "default_rank_tolerance",
    "effective_rank",
    "exact_projection",
    "low_dimensional_accuracy",
    "numerical_rank",
    "nystrom_projection",
    "participation_ratio",
    "rank_projection",
    "reduce_activations",
    "singular_values",
    "soft_rank",
    "spectrum",
    "spectrum_from_gram",
    "stable_rank",
    "tail_error",
    "total_cluster_variation",
    "total_cluster_variation_from_moments",
    "variance_ratio",
    "weight_as_matrix",
]
