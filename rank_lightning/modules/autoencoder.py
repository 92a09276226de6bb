"""Fully connected autoencoder for the Gaussian-mixture experiments (Zangrando et al. Sec. 4)."""

from __future__ import annotations

import itertools
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from rank_lightning.modules.base import RankModule
from rank_lightning.validation import check_bool, check_positive_int, check_positive_ints

ACTIVATIONS = {"tanh": nn.Tanh, "relu": nn.ReLU, "gelu": nn.GELU, "identity": nn.Identity}


class AutoEncoderNet(nn.Module):
    """``d -> hidden_dims[0] -> ... -> hidden_dims[-1] -> d`` with an activation after every hidden layer.

    With ``activation="identity"`` it is the deep linear autoencoder of Zangrando Sec. 5.
    """

    def __init__(self, input_dim: int, hidden_dims: tuple[int, ...], activation: str = "tanh", bias: bool = True):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}; activations are: {', '.join(ACTIVATIONS)}")
        hidden_dims = check_positive_ints("hidden_dims", hidden_dims)  # at least one hidden layer
        check_positive_int("input_dim", input_dim)
        check_bool("bias", bias)
        widths = (input_dim, *hidden_dims)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(w_in, w_out, bias=bias), ACTIVATIONS[activation]())
            for w_in, w_out in itertools.pairwise(widths)
        )
        self.output = nn.Linear(widths[-1], input_dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.flatten(1)  # (B, d)
        for layer in self.layers:
            h = layer(h)
        return self.output(h).view_as(x)

    def blocks(self) -> dict[str, str]:
        """Hidden layers (after the activation) by depth; ``layer{i}`` maps to ``layers.{i-1}``."""
        return {f"layer{i + 1}": f"layers.{i}" for i in range(len(self.layers))}


class AutoEncoder(RankModule):
    """Mean-squared reconstruction of the inputs of ``(x, y)`` batches; ``y`` is kept for class metrics.

    Zangrando et al. train a four-layer fully connected tanh autoencoder on an isotropic Gaussian mixture
    over a grid of cluster widths sigma and weight decays, and measure how close each weight matrix is to
    rank K (the number of blobs).

    Args:
        input_shape: shape of one input; linked from the datamodule by the CLI.
        hidden_dims: widths of the hidden layers (three hidden layers give Zangrando's four weight matrices).
        activation: ``tanh`` (the paper's), ``relu``, ``gelu`` or ``identity`` (deep linear autoencoder).
        bias: use biases in the linear layers.
        **optim: optimiser and schedule settings of :class:`~rank_lightning.modules.base.RankModule`.

    Logged metrics:
        ``train/loss``, ``val/loss``, ``test/loss``; with several validation (or test) dataloaders, each loader's
        loss under Lightning's ``val/loss/dataloader_idx_<i>`` keys.
    """

    def __init__(
        self,
        input_shape: tuple[int, ...] = (16,),
        hidden_dims: tuple[int, ...] = (64, 32, 64),
        activation: str = "tanh",
        bias: bool = True,
        optimizer: str = "sgd",
        lr: float = 0.05,
        weight_decay: float = 0.0,
        momentum: float = 0.9,
        decay_norm_and_bias: bool = False,
        scheduler: str = "none",
        step_size: int = 30,
        milestones: tuple[int, ...] = (),
        gamma: float = 0.1,
        num_classes: int | None = None,
    ) -> None:
        super().__init__(
            optimizer=optimizer,
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            decay_norm_and_bias=decay_norm_and_bias,
            scheduler=scheduler,
            step_size=step_size,
            milestones=milestones,
            gamma=gamma,
        )
        self.save_hyperparameters()
        self.input_shape = check_positive_ints("input_shape", input_shape)
        check_positive_int("num_classes", num_classes, allow_none=True)
        self.num_classes = num_classes
        self.backbone = AutoEncoderNet(math.prod(self.input_shape), hidden_dims, activation, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backbone(x)

    def _shared_step(self, batch: Any, stage: str) -> torch.Tensor:
        x = (self.training_batch(batch) if stage == "train" else batch)[0]
        loss = F.mse_loss(self(x), x)
        on_step = stage == "train"
        # Reduced over processes in every stage: the epoch value is then the mean over all samples, not rank 0's.
        self.log(f"{stage}/loss", loss, on_step=on_step, on_epoch=True, prog_bar=True, sync_dist=True)
        return loss

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._shared_step(batch, "train")

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._shared_step(batch, "val")

    def test_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._shared_step(batch, "test")
