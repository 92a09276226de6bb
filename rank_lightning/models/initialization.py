"""Weight initialisation schemes for any module: PyTorch's default, Gaussian, Kaiming, orthogonal, asymmetric."""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch import nn
from torch.nn.modules.conv import _ConvNd

INIT_SCHEMES: tuple[str, ...] = ("default", "gaussian", "kaiming", "orthogonal", "asymmetric")


def init_weights(module: nn.Module, scheme: str) -> nn.Module:
    """Re-initialise, in place, every linear, convolution and multi-head attention layer inside ``module``.

    With ``fan_in`` the number of inputs of one output unit (``in_features``, ``in_channels / groups * kh * kw``,
    or the embedding width for each of the query, key and value projections of an attention layer):

    - ``"default"``: each layer's own PyTorch initialisation (``reset_parameters``), e.g. weights
      ``U[-1/sqrt(fan_in), 1/sqrt(fan_in)]`` for ``nn.Linear``; biases included.
    - ``"gaussian"``: weights ``N(0, 1/fan_in)``, the i.i.d. Gaussian setting of Feng et al. Theorem 5 and of
      Daneshmand et al. Def. 1 scaled to unit activation variance.
    - ``"kaiming"``: weights ``N(0, 2/fan_in)`` (He et al.), which keeps the activation scale through ReLU layers,
      so deep vanilla ReLU networks can still pass a signal.
    - ``"orthogonal"``: weights with orthonormal rows or columns (gain 1, so all singular values are 1); a convolution
      is treated as its ``out x (in * kh * kw)`` matrix, an attention input projection as three square blocks.
    - ``"asymmetric"``: weights ``U[0, 2/sqrt(fan_in)]``, the "breaking BN" initialisation of Daneshmand et al.
      Sec. 4, whose non-zero mean destroys the rank preservation of batch normalisation.

    The non-default schemes set the biases of these layers to zero, as in the random-network analyses they come
    from. Normalisation layers, embeddings and tokens are left untouched.

    Args:
        module: Any module; typically a whole backbone or one of its submodules.
        scheme: One of :data:`INIT_SCHEMES`.

    Returns:
        ``module`` itself.

    Raises:
        ValueError: For an unknown ``scheme``; the message lists the valid ones.
    """
    if scheme not in INIT_SCHEMES:
        raise ValueError(f"unknown init scheme {scheme!r}; schemes are: {', '.join(INIT_SCHEMES)}")
    with torch.no_grad():
        if scheme == "default":
            _reset_to_default(module)
            return module
        for weight, fan_in, blocks in _weight_matrices(module):
            if scheme == "gaussian":
                nn.init.normal_(weight, mean=0.0, std=1.0 / math.sqrt(fan_in))
            elif scheme == "kaiming":
                nn.init.normal_(weight, mean=0.0, std=math.sqrt(2.0 / fan_in))
            elif scheme == "asymmetric":
                nn.init.uniform_(weight, 0.0, 2.0 / math.sqrt(fan_in))
            else:
                for block in weight.chunk(blocks, dim=0):
                    nn.init.orthogonal_(block)
        for bias in _biases(module):
            nn.init.zeros_(bias)
    return module


def _reset_to_default(module: nn.Module) -> None:
    # Attention layers re-initialise after their output projection, as they do at construction: their own reset
    # zeroes that projection's bias.
    layers = list(module.modules())
    for layer in layers:
        if isinstance(layer, (nn.Linear, _ConvNd)):
            layer.reset_parameters()
    for layer in layers:
        if isinstance(layer, nn.MultiheadAttention):
            layer._reset_parameters()


def _weight_matrices(module: nn.Module) -> Iterator[tuple[torch.Tensor, int, int]]:
    """Yield ``(weight, fan_in, number of matrices stacked along dim 0)`` for every weight matrix."""
    for layer in module.modules():
        if isinstance(layer, nn.Linear):
            yield layer.weight, layer.in_features, 1
        elif isinstance(layer, _ConvNd):
            yield layer.weight, layer.weight[0].numel(), 1
        elif isinstance(layer, nn.MultiheadAttention):
            if layer.in_proj_weight is not None:  # (3 * embed_dim, embed_dim): query, key, value stacked
                yield layer.in_proj_weight, layer.in_proj_weight.shape[1], 3
            else:
                for weight in (layer.q_proj_weight, layer.k_proj_weight, layer.v_proj_weight):
                    yield weight, weight.shape[1], 1


def _biases(module: nn.Module) -> Iterator[torch.Tensor]:
    for layer in module.modules():
        if isinstance(layer, (nn.Linear, _ConvNd)) and layer.bias is not None:
            yield layer.bias
        elif isinstance(layer, nn.MultiheadAttention) and layer.in_proj_bias is not None:
            yield layer.in_proj_bias
