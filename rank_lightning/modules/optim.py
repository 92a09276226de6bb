"""Optimisers and learning-rate schedules shared by the LightningModules.

Weight-decay studies (Zangrando et al. Sec. 6) need to know exactly which tensors are decayed, so the
parameters are split into a decay group and a no-decay group: by default biases and the affine
parameters of normalisation layers are not decayed (as in nanoGPT and timm).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from rank_lightning.nn import LRLayer
from rank_lightning.validation import (
    check_bool,
    check_non_negative,
    check_positive,
    check_positive_int,
    check_positive_ints,
)

OPTIMIZERS = ("sgd", "adam", "adamw")
SCHEDULERS = ("none", "cosine", "step", "multistep")

_NORM_TYPES = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm)


def split_decay_parameters(module: nn.Module, *, decay_norm_and_bias: bool = False) -> tuple[list, list]:
    """Split ``module``'s trainable parameters into ``(decay, no_decay)`` lists.

    A parameter is in ``no_decay`` when it belongs to a normalisation layer, is a bias, or is a
    0-/1-dimensional tensor (e.g. a class token scale), unless ``decay_norm_and_bias`` is set, in which
    case every parameter is decayed. The parameters of LR-Layers are never decayed: their weight is set by
    the rank-k projection (Sanyal et al. Alg. 1), not learned as a network weight.
    """
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    seen: set[int] = set()
    for mod in module.modules():
        for name, param in mod.named_parameters(recurse=False):
            if not param.requires_grad or id(param) in seen:
                continue
            seen.add(id(param))
            if isinstance(mod, LRLayer):
                no_decay.append(param)
                continue
            exempt = isinstance(mod, _NORM_TYPES) or name.endswith("bias") or param.ndim <= 1
            (no_decay if exempt and not decay_norm_and_bias else decay).append(param)
    return decay, no_decay


def check_optimizer_settings(
    name: str, lr: float, weight_decay: float, momentum: float, decay_norm_and_bias: bool
) -> None:
    """Raise ``ValueError`` naming the first bad optimiser setting (an unknown name, an ``lr`` that is not a positive
    number, a negative or non-finite ``weight_decay`` or ``momentum``, a ``decay_norm_and_bias`` that is not a bool)."""
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; optimizers are: {', '.join(OPTIMIZERS)}")
    check_positive("lr", lr)
    check_non_negative("weight_decay", weight_decay)
    check_non_negative("momentum", momentum)
    check_bool("decay_norm_and_bias", decay_norm_and_bias)


def check_scheduler_settings(name: str, step_size: int, milestones: int | tuple[int, ...], gamma: float) -> None:
    """Raise ``ValueError`` naming the first bad schedule setting (an unknown name, a ``step_size`` that is not a
    positive integer, ``milestones`` that are not positive integers, a ``gamma`` that is not a positive number)."""
    if name not in SCHEDULERS:
        raise ValueError(f"unknown scheduler {name!r}; schedulers are: {', '.join(SCHEDULERS)}")
    check_positive_int("step_size", step_size)
    check_positive_ints("milestones", milestones, allow_empty=True)
    check_positive("gamma", gamma)


def build_optimizer(
    module: nn.Module,
    *,
    name: str = "sgd",
    lr: float = 0.1,
    weight_decay: float = 0.0,
    momentum: float = 0.9,
    decay_norm_and_bias: bool = False,
) -> torch.optim.Optimizer:
    """Create the optimiser ``name`` over ``module``'s parameters with the decay/no-decay split."""
    check_optimizer_settings(name, lr, weight_decay, momentum, decay_norm_and_bias)
    decay, no_decay = split_decay_parameters(module, decay_norm_and_bias=decay_norm_and_bias)
    groups: list[dict[str, Any]] = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=momentum)
    if name == "adam":
        # Adam's weight_decay is an L2 penalty added to the gradient (the loss-level regulariser of
        # Zangrando eq. 2); AdamW decouples it.
        return torch.optim.Adam(groups, lr=lr)
    return torch.optim.AdamW(groups, lr=lr)


def build_scheduler(
    optimizer: torch.optim.Optimizer,
    *,
    name: str = "none",
    max_epochs: int | None = None,
    step_size: int = 30,
    milestones: tuple[int, ...] = (),
    gamma: float = 0.1,
) -> torch.optim.lr_scheduler.LRScheduler | None:
    """Create the per-epoch learning-rate schedule ``name`` (``none`` returns ``None``)."""
    check_scheduler_settings(name, step_size, milestones, gamma)
    if name == "none":
        return None
    if name == "cosine":
        if not max_epochs or max_epochs < 1:
            raise ValueError("scheduler 'cosine' needs trainer.max_epochs to be set to a positive number")
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max_epochs)
    if name == "step":
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=step_size, gamma=gamma)
    if not milestones:
        raise ValueError("scheduler 'multistep' needs milestones, e.g. [100, 150]")
    return torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=list(milestones), gamma=gamma)
