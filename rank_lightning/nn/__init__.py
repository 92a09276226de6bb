"""Layers from the papers: the LR-Layer of Sanyal et al. and the helpers that place it and collect its loss."""

from rank_lightning.nn.lr_layer import LRLayer, collect_auxiliary_losses, insert_lr_layer, lr_layers

__all__ = ["LRLayer", "collect_auxiliary_losses", "insert_lr_layer", "lr_layers"]
