"""The LR-Layer of Sanyal et al. (Sec. 3, Alg. 1): an identity layer whose auxiliary loss pulls activations into a
low-rank affine subspace, and the helpers that place it in a network and collect its loss."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from rank_lightning.functional.nystrom import PROJECTION_METHODS, rank_projection
from rank_lightning.validation import check_non_negative

__all__ = ["LRLayer", "collect_auxiliary_losses", "insert_lr_layer", "lr_layers"]


class LRLayer(nn.Module):
    """Identity layer carrying the low-rank prior of Sanyal et al. (Sec. 3.1-3.4, eq. 4, Alg. 1).

    The forward pass returns its input ``A`` unchanged. While the layer is ``enabled``, in training mode and with
    gradients enabled, it also computes, on the (n, m) activation matrix, the auxiliary loss

    ``lambda_1 / n * sum_i ||W^T (a_i + b) - (a_i + b)||^2  +  lambda_2 / n * sum_i |1 - ||a_i|| |``

    (reconstruction loss ``L_c`` and norm constraint ``L_N``, eq. 4 with the ``1/n`` scaling of Alg. 1), with the
    symmetric weight ``W = (W_S + W_S^T) / 2`` (Sec. 3.4). The loss is not detached from ``A``, so its gradient reaches
    the layers before. The model's loss must add it: see :func:`collect_auxiliary_losses`. After every optimizer step,
    :meth:`project_` sets ``W_S <- Pi_k(W)`` (done by :class:`~rank_lightning.callbacks.LowRankProjection`).

    ``W_S`` starts at zero: a PSD matrix (the hypothesis of Lemma 3.1) that gradient descent on ``L_c`` grows along the
    second moment of ``A + b``, a dense matrix whose columns uniform Nyström sampling represents well. An identity
    start would be projected onto ``k`` coordinate axes, which a sample of ``2k`` columns mostly misses. The paper
    states no initialisation and no values for ``lambda_1`` and ``lambda_2``.

    Under a large learning rate the update of ``W`` is unstable when the activations are large (the curvature of
    ``L_c`` in ``W`` is about ``2 lambda_1 E||a + b||^2``); the norm constraint pulls ``||a_i||`` to 1, but switching
    the layer on late in training, when activations have grown, may need a smaller learning rate.

    Args:
        num_features: m, the width of one activation vector (``C * H * W`` for flattened conv activations, 16,384
            before ResNet-18's last block at 32x32 inputs).
        rank: target rank ``k`` of ``W`` (Sanyal et al.: 50 before the last FC layer, 1000 before the last block).
        lambda_1: weight of the reconstruction loss.
        lambda_2: weight of the norm constraint.
        projection: ``"nystrom"`` (ensemble Nyström, the paper's choice) or ``"exact"`` (eigh).
        num_runs: Nyström runs averaged per projection (Nyström only: ``projection="exact"`` refuses another value).
        oversampling: Nyström columns per unit of rank (``l = oversampling * k``; 2 in the paper; Nyström only).
        flatten: ``True`` treats each input ``(B, ...)`` as B samples of ``prod(...)`` features (conv activations
            ``(B, C, H, W)`` become ``(B, C*H*W)``); ``False`` treats the last dimension as the features and every other
            position as a sample (tokens ``(B, T, D)`` become ``(B*T, D)``), padded tokens included: the layer sees
            no attention mask.

    Attributes:
        weight: ``W_S``, (m, m).
        bias: ``b``, (m,); the origin of the affine subspace.
        enabled: whether training forward passes compute the auxiliary loss (off until switch-on).
        aux_loss: the auxiliary loss of the training forward passes not yet collected, or ``None``; of several (a step
            that runs each of several training loaders apart), their mean over the rows of all, as one pass over the
            concatenated inputs gives; summed over the features in float32 at least (float32 for a float16 or
            bfloat16 layer). Before switch-on, and for a batch of no rows, it is a zero connected to the
            parameters, so that DDP sees a (zero) gradient for them.
        last_losses: detached ``{"reconstruction": L_c, "norm": L_N}`` of the latest loss (unweighted means over its
            rows).

    Example::

        layer = LRLayer(512, rank=50, lambda_1=1.0, lambda_2=1.0)
        insert_lr_layer(model, before="fc", layer=layer)
        loss = F.cross_entropy(model(x), y) + collect_auxiliary_losses(model)
    """

    def __init__(
        self,
        num_features: int,
        rank: int,
        *,
        lambda_1: float = 1.0,
        lambda_2: float = 1.0,
        projection: str = "nystrom",
        num_runs: int = 1,
        oversampling: int = 2,
        flatten: bool = True,
    ) -> None:
        super().__init__()
        if isinstance(num_features, bool) or not isinstance(num_features, int) or num_features < 1:
            raise ValueError(f"num_features must be a positive integer, got {num_features!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= num_features:
            raise ValueError(f"rank must be an integer in [1, num_features={num_features}], got {rank!r}")
        if projection not in PROJECTION_METHODS:
            valid = ", ".join(PROJECTION_METHODS)
            raise ValueError(f"unknown projection {projection!r}; valid projections are: {valid}")
        check_non_negative("lambda_1", lambda_1)
        check_non_negative("lambda_2", lambda_2)
        if isinstance(num_runs, bool) or not isinstance(num_runs, int) or num_runs < 1:
            raise ValueError(f"num_runs must be a positive integer, got {num_runs!r}")
        if isinstance(oversampling, bool) or not isinstance(oversampling, int) or oversampling < 1:
            raise ValueError(f"oversampling must be a positive integer, got {oversampling!r}")
        if not isinstance(flatten, bool):
            raise ValueError(f"flatten must be True or False, got {flatten!r}")
        if projection == "exact" and (num_runs, oversampling) != (1, 2):
            raise ValueError(
                f"num_runs={num_runs} and oversampling={oversampling} set the Nystrom projection; the exact projection "
                "has neither (leave them at 1 and 2, or use projection='nystrom')"
            )
        self.num_features = num_features
        self.rank = rank
        self.lambda_1 = float(lambda_1)
        self.lambda_2 = float(lambda_2)
        self.projection = projection
        self.num_runs = num_runs
        self.oversampling = oversampling
        self.flatten = flatten
        self.weight = nn.Parameter(torch.zeros(num_features, num_features))
        self.bias = nn.Parameter(torch.zeros(num_features))
        self.enabled = False
        self.aux_loss: Tensor | None = None
        self.last_losses: dict[str, Tensor] = {}
        self._pending_rows = 0  # the rows behind aux_loss

    @property
    def effective_weight(self) -> Tensor:
        """``W = (W_S + W_S^T) / 2`` (Sanyal et al. Sec. 3.4)."""
        return (self.weight + self.weight.T) / 2

    def _as_matrix(self, x: Tensor) -> Tensor:
        # The width spelt out: reshape(B, -1) cannot size an empty batch.
        a = x.reshape(x.shape[0], math.prod(x.shape[1:])) if self.flatten else x.reshape(-1, x.shape[-1])
        if a.shape[1] != self.num_features:
            how = "flattened per sample" if self.flatten else "last dimension"
            raise ValueError(
                f"LRLayer has num_features={self.num_features} but the input of shape {tuple(x.shape)} has "
                f"{a.shape[1]} features ({how}, flatten={self.flatten})"
            )
        return a

    def forward(self, x: Tensor) -> Tensor:
        if not (self.training and torch.is_grad_enabled()):
            return x
        if not self.enabled:
            # A zero that depends on the parameters: DDP without find_unused_parameters expects every parameter to
            # receive a gradient in every step, also before switch-on.
            self.aux_loss = (self.weight[0, 0] + self.bias[0]) * 0.0
            self._pending_rows = 0
            return x
        a = self._as_matrix(x)  # (n, m)
        # (A layer saved whole before _pending_rows existed has none: nothing pending.)
        rows, earlier = a.shape[0], getattr(self, "_pending_rows", 0) if self.aux_loss is not None else 0
        if rows == 0:
            # No rows add nothing to the step's loss; their mean would be NaN, and a NaN weight ends the fit.
            if not earlier:
                self.aux_loss, self._pending_rows = (self.weight[0, 0] + self.bias[0]) * 0.0, 0
            return x
        shifted = a + self.bias  # rows a_i + b
        # Sums over the m features in float32 at least: in float16 a sum of squares passes 65504 (inf) at m = 16,384
        # activations of size 2.
        work = torch.promote_types(a.dtype, torch.float32)
        # Row form of W^T (a_i + b): (a_i + b)^T W.
        reconstruction = (shifted @ self.effective_weight - shifted).to(work).square().sum(dim=1).mean()
        norm = (1 - torch.linalg.vector_norm(a, dim=1, dtype=work)).abs().mean()
        loss = self.lambda_1 * reconstruction + self.lambda_2 * norm
        losses = {"reconstruction": reconstruction.detach(), "norm": norm.detach()}
        if earlier:
            # Another forward pass of the same step (a step that runs each of several training loaders apart): the
            # mean over the rows of both, as one pass over the concatenated inputs gives, none counted twice.
            share = rows / (earlier + rows)
            loss = torch.lerp(self.aux_loss, loss, share)
            losses = {key: torch.lerp(self.last_losses[key], value, share) for key, value in losses.items()}
        self.aux_loss, self.last_losses, self._pending_rows = loss, losses, earlier + rows
        return x

    def pop_auxiliary_loss(self) -> Tensor | None:
        """Return the pending auxiliary loss (``None`` if there is none) and clear it."""
        loss, self.aux_loss, self._pending_rows = self.aux_loss, None, 0
        return loss

    @torch.no_grad()
    def project_(self, generator: torch.Generator | None = None) -> None:
        """Set ``W_S <- Pi_k((W_S + W_S^T) / 2)`` in place (Sanyal et al. Alg. 1, update step; Sec. 3.4).

        Args:
            generator: random generator of the Nyström column indices (ignored by the exact projection).
        """
        options: dict[str, Any] = {}
        if self.projection == "nystrom":
            options = {"num_runs": self.num_runs, "oversampling": self.oversampling, "generator": generator}
        projected = rank_projection(self.effective_weight, self.rank, self.projection, **options)
        self.weight.copy_(projected)

    def get_extra_state(self) -> dict[str, Any]:
        return {"enabled": self.enabled}

    def set_extra_state(self, state: dict[str, Any]) -> None:
        self.enabled = bool(state["enabled"])

    def extra_repr(self) -> str:
        return (
            f"num_features={self.num_features}, rank={self.rank}, lambda_1={self.lambda_1}, "
            f"lambda_2={self.lambda_2}, projection={self.projection!r}, num_runs={self.num_runs}, "
            f"flatten={self.flatten}, enabled={self.enabled}"
        )


def lr_layers(module: nn.Module) -> list[tuple[str, LRLayer]]:
    """All :class:`LRLayer` submodules of ``module`` as ``(dotted name, layer)`` pairs, in registration order."""
    return [(name, child) for name, child in module.named_modules() if isinstance(child, LRLayer)]


def collect_auxiliary_losses(module: nn.Module) -> Tensor:
    """Sum of the pending auxiliary losses of every :class:`LRLayer` in ``module``, which are then cleared.

    Call it once per training step and add the result to the task loss (Sanyal et al. eq. 4)::

        loss = F.cross_entropy(logits, y) + collect_auxiliary_losses(self)

    Args:
        module: a model or LightningModule containing LR-Layers (or none).

    Returns:
        Scalar tensor; zero when no layer has a pending loss (before switch-on, in eval mode, or without LR-Layers).
    """
    losses = [loss for _, layer in lr_layers(module) if (loss := layer.pop_auxiliary_loss()) is not None]
    if losses:
        return torch.stack(losses).sum()
    parameter = next(module.parameters(), None)
    return torch.zeros((), device=parameter.device if parameter is not None else None)


class _InFront(nn.Sequential):
    """``nn.Sequential(layer, module)`` that hands every further argument of a call on to ``module``."""

    def forward(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        # A plain nn.Sequential takes one input: a module called with more (a transformer block with its attention
        # mask) raised a TypeError once an LR-Layer stood in front of it.
        return self[1](self[0](x), *args, **kwargs)


def insert_lr_layer(model: nn.Module, before: str, layer: LRLayer) -> LRLayer:
    """Place ``layer`` in front of the submodule ``before`` of ``model``.

    The submodule is replaced by ``nn.Sequential(layer, submodule)``: the forward pass and the submodule's output are
    unchanged, the LR-Layer's parameters appear in the state dict as ``<before>.0.weight`` / ``<before>.0.bias`` and
    the original ones under ``<before>.1.``. The LR-Layer sees the first positional argument of a call; any further
    arguments (a transformer block's attention mask, keyword arguments) go to the submodule unchanged. A state dict
    saved from a model with the layer inserted loads into a model built the same way; load weights saved without the
    layer before inserting it.

    Args:
        model: the network (any ``nn.Module``, e.g. a backbone or a LightningModule).
        before: dotted path of the submodule, as in ``model.named_modules()`` (e.g. ``"fc"``, ``"backbone.layer4"``).
        layer: the LR-Layer; its ``num_features`` must match the width of the submodule's input.

    Returns:
        ``layer``.

    Raises:
        ValueError: if ``before`` names no submodule of ``model``.
    """
    if not isinstance(layer, LRLayer):
        raise ValueError(f"layer must be an LRLayer, got {layer!r}")
    names = [name for name, _ in model.named_modules() if name]
    if before not in names:
        raise ValueError(f"unknown submodule {before!r}; submodules are: {', '.join(names)}")
    parent_name, _, child_name = before.rpartition(".")
    parent = model.get_submodule(parent_name)
    setattr(parent, child_name, _InFront(layer, model.get_submodule(before)))
    return layer
