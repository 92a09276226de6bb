"""LightningModules: :class:`ImageClassifier` and :class:`AutoEncoder`."""

from rank_lightning.modules.autoencoder import AutoEncoder, AutoEncoderNet
from rank_lightning.modules.base import RankModule
from rank_lightning.modules.classifier import ImageClassifier
from rank_lightning.modules.optim import build_optimizer, build_scheduler, split_decay_parameters

__all__ = [
    "AutoEncoder",
    "AutoEncoderNet",
    "ImageClassifier",
    "RankModule",
    "build_optimizer",
    "build_scheduler",
    "split_decay_parameters",
]
