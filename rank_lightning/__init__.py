"""rank_lightning: measure and steer the rank of neural networks with PyTorch Lightning."""

__version__ = "0.1.0"
