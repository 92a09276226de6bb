"""Backbones created by name: ``create_model(name, **kwargs)``; ``list_models()`` lists the names.

Importing this package registers ``mlp``, ``resnet18``, ``resnet50``, ``vgg11``, ``vgg11_bn``, ``vgg19``,
``vgg19_bn``, ``vit_tiny`` and ``vit_small``.
"""

from rank_lightning.models.base import Backbone, create_model, get_model_factory, list_models, register_model
from rank_lightning.models.initialization import INIT_SCHEMES, init_weights
from rank_lightning.models.mlp import ACTIVATIONS, MLP
from rank_lightning.models.pretrained import load_pretrained
from rank_lightning.models.resnet import ResNet
from rank_lightning.models.vgg import VGG
from rank_lightning.models.vit import ViT

__all__ = [
    "ACTIVATIONS",
    "INIT_SCHEMES",
    "MLP",
    "VGG",
    "Backbone",
    "ResNet",
    "ViT",
    "create_model",
    "get_model_factory",
    "init_weights",
    "list_models",
    "load_pretrained",
    "register_model",
]
