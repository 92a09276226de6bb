"""Counting how often a model's blocks run in one forward pass."""

import torch
from torch import nn

from rank_lightning.layers import FeatureLayer, forward_hooks


def count_block_calls(module: nn.Module, blocks: dict[str, str], x: torch.Tensor) -> dict[str, int]:
    """``{block name: calls}`` of one forward pass of ``module`` on ``x``."""
    calls = dict.fromkeys(blocks, 0)

    def count(layer: FeatureLayer, _: object) -> None:
        calls[layer.name] += 1

    with torch.no_grad(), forward_hooks(module, [FeatureLayer(name, path) for name, path in blocks.items()], count):
        module(x)
    return calls
