"""rank_lightning.metrics: torchmetrics accumulators that stream batches into rank_lightning.functional."""

from rank_lightning.functional.spectral import SpectralSummary
from rank_lightning.metrics.activation_spectrum import ACTIVATION_METRICS, ActivationSpectrum, ActivationSpectrumResult

__all__ = ["ACTIVATION_METRICS", "ActivationSpectrum", "ActivationSpectrumResult", "SpectralSummary"]
