"""rank_lightning.functional: pure tensor -> tensor math (no state, no Lightning)."""

from rank_lightning.functional.classification import (
    ClassificationDimension,
    classification_dimension,
    independence_deficit,
    independence_deficit_markdown,
)
from rank_lightning.functional.embedding import low_dimensional_accuracy
from rank_lightning.functional.jacobian import (
    PartialJacobianRank,
    Patch,
    capture_block_outputs,
    default_patch_size,
    partial_jacobian,
    partial_jacobian_rank,
    partial_jacobian_ranks,
)
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
    spectra_from_grams,
    spectrum,
    spectrum_from_gram,
    stable_rank,
    tail_error,
    total_cluster_variation,
    total_cluster_variation_from_moments,
    variance_ratio,
)
from rank_lightning.functional.theory import (
    gaussian_product_log_singular_ratio,
    gaussian_product_numerical_rank,
    gaussian_product_singular_ratio,
)

__all__ = [
    "ClassificationDimension",
    "PartialJacobianRank",
    "Patch",
    "Spectrum",
    "capture_block_outputs",
    "classification_dimension",
    "classwise_variance_ratio",
    "default_patch_size",
    "default_rank_tolerance",
    "effective_rank",
    "exact_projection",
    "gaussian_product_log_singular_ratio",
    "gaussian_product_numerical_rank",
    "gaussian_product_singular_ratio",
    "independence_deficit",
    "independence_deficit_markdown",
    "low_dimensional_accuracy",
    "numerical_rank",
    "nystrom_projection",
    "partial_jacobian",
    "partial_jacobian_rank",
    "partial_jacobian_ranks",
    "participation_ratio",
    "rank_projection",
    "reduce_activations",
    "singular_values",
    "soft_rank",
    "spectra_from_grams",
    "spectrum",
    "spectrum_from_gram",
    "stable_rank",
    "tail_error",
    "total_cluster_variation",
    "total_cluster_variation_from_moments",
    "variance_ratio",
    "weight_as_matrix",
]
