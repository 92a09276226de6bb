"""rank_lightning.metrics: torchmetrics accumulators that stream batches into rank_lightning.functional."""

from rank_lightning.metrics.activation_spectrum import ActivationSpectrum, ActivationSpectrumResult, SpectralSummary

__all__ = ["ActivationSpectrum", "ActivationSpectrumResult", "SpectralSummary"]
