"""The fast gradient sign family: FGSM, Iter-FGSM and Iter-LL-FGSM with budgets in pixel units.

Every attack takes a classifier mapping *normalised* inputs to logits and a batch as the datamodule yields it.
It un-normalises the batch with the datamodule's per-channel ``mean``/``std``, perturbs the pixels in [0, 1]
inside the L-infinity ball of radius ``eps`` (so ``eps = 8/255`` is eight grey levels), and returns the
adversarial batch normalised again. This is the convention of torchattacks and of Kurakin et al. (2016), whose
budgets are grey levels of 8-bit images. Sanyal et al. Sec. 5 differ: they divide the budget by 255 and add it to
images normalised to unit variance, so their ``eps`` is ``eps * std / 255`` in pixel units per channel (about a
quarter of the pixel budget of the same name for CIFAR's std of about 0.25). Compare their Fig. 5 by the normalised
L2 dissimilarity (eq. 10, in pixels), which does not depend on the convention, rather than by ``eps``.

While attacking, the model runs in eval mode (BatchNorm uses its running statistics and is not updated, dropout
is off); afterwards every submodule's train/eval flag is what it was, and no parameter's ``.grad`` is touched,
since gradients are taken with respect to the inputs only.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from rank_lightning.attacks.pixels import ChannelStats, channel_stats
from rank_lightning.layers import class_labels, eval_mode
from rank_lightning.validation import check_non_negative, check_non_negative_int

ATTACKS = ("fgsm", "iter_fgsm", "iter_ll_fgsm")

# Normalisation round trips and low-precision batches move pixels slightly outside [0, 1]; anything beyond one
# grey level means the batch was not normalised with the given mean/std (or is not an image at all).
_PIXEL_SLACK = 1.0 / 255.0


def kurakin_steps(eps: float) -> int:
    """Default number of iterations of Kurakin et al. (2016): ``min(eps + 4, 1.25 eps)`` with eps in grey levels.

    Written ``int(min(255 eps + 4, 1.25 * 255 eps))`` for eps in pixel units, the convention of torchattacks'
    BIM; for every integer number of grey levels it equals ``floor(min(k + 4, 1.25 k))``.

    Args:
        eps: L-infinity budget in pixel units, in [0, 1] (``8/255`` for eight grey levels).

    Returns:
        The number of iterations, 0 for ``eps`` below 0.8 grey levels (``0.8/255``), where the iterative attacks
        with ``steps=None`` return their inputs unchanged.
    """
    _check_eps(eps)
    return int(min(eps * 255 + 4, 1.25 * eps * 255))


def fgsm(
    model: nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    eps: float,
    *,
    mean: ChannelStats = None,
    std: ChannelStats = None,
) -> torch.Tensor:
    """Fast gradient sign method (Goodfellow et al., 2014): ``x_a = Clip_[0,1](x + eps * sign(grad_x L(x, y)))``.

    Args:
        model: classifier mapping normalised inputs ``(B, ...)`` to logits ``(B, num_classes)``.
        inputs: normalised batch ``(B, C, ...)`` as the datamodule yields it.
        targets: class labels ``(B,)`` (or another of :data:`~rank_lightning.layers.LABEL_FORMS`).
        eps: L-infinity budget in pixel units, in [0, 1] (``8/255`` for eight grey levels).
        mean: the datamodule's per-channel mean, or ``None`` for inputs already in [0, 1].
        std: the datamodule's per-channel std, or ``None`` for inputs already in [0, 1].

    Returns:
        The adversarial batch, normalised like ``inputs``, detached.

    Raises:
        RuntimeError: called under ``torch.inference_mode`` or with inference tensors, where no gradient exists.
        ValueError: ``eps`` outside [0, 1], bad ``mean``/``std``, or inputs outside [0, 1] once un-normalised.
    """
    return _sign_gradient_attack(model, inputs, targets, eps=eps, alpha=eps, steps=1, mean=mean, std=std)


def iterative_fgsm(
    model: nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    eps: float,
    *,
    alpha: float = 1.0 / 255.0,
    steps: int | None = None,
    mean: ChannelStats = None,
    std: ChannelStats = None,
) -> torch.Tensor:
    """Iter-FGSM / BIM: ``x^{n+1} = Clip_{x,eps}(x^n + alpha * sign(grad L(x^n, y)))`` (Sanyal et al. eq. 8).

    Sanyal et al. write the step as ``eps``; the step of Kurakin et al. (2016), whom they follow, is one grey
    level, ``alpha = 1/255``, with :func:`kurakin_steps` iterations. ``Clip_{x,eps}`` keeps every pixel within
    ``eps`` of the clean one and inside [0, 1].

    Args:
        model: classifier mapping normalised inputs ``(B, ...)`` to logits ``(B, num_classes)``.
        inputs: normalised batch ``(B, C, ...)`` as the datamodule yields it.
        targets: class labels ``(B,)`` (or another of :data:`~rank_lightning.layers.LABEL_FORMS`).
        eps: L-infinity budget in pixel units, in [0, 1] (``8/255`` for eight grey levels).
        alpha: step size in pixel units.
        steps: number of iterations; ``None`` takes :func:`kurakin_steps` of ``eps``.
        mean: the datamodule's per-channel mean, or ``None`` for inputs already in [0, 1].
        std: the datamodule's per-channel std, or ``None`` for inputs already in [0, 1].

    Returns:
        The adversarial batch, normalised like ``inputs``, detached.

    Raises:
        RuntimeError: called under ``torch.inference_mode`` or with inference tensors, where no gradient exists.
        ValueError: bad ``eps``, ``alpha``, ``steps``, ``mean``/``std``, or inputs outside [0, 1] once un-normalised.
    """
    return _sign_gradient_attack(model, inputs, targets, eps=eps, alpha=alpha, steps=steps, mean=mean, std=std)


def iterative_ll_fgsm(
    model: nn.Module,
    inputs: torch.Tensor,
    eps: float,
    *,
    alpha: float = 1.0 / 255.0,
    steps: int | None = None,
    mean: ChannelStats = None,
    std: ChannelStats = None,
) -> torch.Tensor:
    """Iter-LL-FGSM: ``x^{n+1} = Clip_{x,eps}(x^n - alpha * sign(grad L(x^n, y_LL)))`` (Sanyal et al. eq. 9).

    The target ``y_LL`` is the least-likely class of the clean input, the argmin of its logits, fixed for all
    iterations as in Kurakin et al. (2016) and torchattacks; Sanyal et al.'s eq. 9 writes it per iteration.
    Stepping against the target's loss pushes every input towards its least-likely class, so no labels are
    needed.

    Args:
        model: classifier mapping normalised inputs ``(B, ...)`` to logits ``(B, num_classes)``.
        inputs: normalised batch ``(B, C, ...)`` as the datamodule yields it.
        eps: L-infinity budget in pixel units, in [0, 1] (``8/255`` for eight grey levels).
        alpha: step size in pixel units.
        steps: number of iterations; ``None`` takes :func:`kurakin_steps` of ``eps``.
        mean: the datamodule's per-channel mean, or ``None`` for inputs already in [0, 1].
        std: the datamodule's per-channel std, or ``None`` for inputs already in [0, 1].

    Returns:
        The adversarial batch, normalised like ``inputs``, detached.

    Raises:
        RuntimeError: called under ``torch.inference_mode`` or with inference tensors, where no gradient exists.
        ValueError: bad ``eps``, ``alpha``, ``steps``, ``mean``/``std``, or inputs outside [0, 1] once un-normalised.
    """
    return _sign_gradient_attack(
        model, inputs, None, eps=eps, alpha=alpha, steps=steps, mean=mean, std=std, least_likely=True
    )


def attack(
    name: str,
    model: nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    eps: float,
    *,
    alpha: float = 1.0 / 255.0,
    steps: int | None = None,
    mean: ChannelStats = None,
    std: ChannelStats = None,
) -> torch.Tensor:
    """Run the attack called ``name``: ``"fgsm"``, ``"iter_fgsm"`` or ``"iter_ll_fgsm"``.

    ``alpha`` and ``steps`` apply to the iterative attacks only; ``targets`` is unused by ``"iter_ll_fgsm"``,
    which picks its own targets. See :func:`fgsm`, :func:`iterative_fgsm` and :func:`iterative_ll_fgsm`.

    Raises:
        ValueError: ``name`` is not one of :data:`ATTACKS`, or any error of the chosen attack.
    """
    # Checked for every attack: a bad alpha or steps is a mistake even where FGSM takes no steps.
    _check_steps(alpha, steps)
    if name == "fgsm":
        return fgsm(model, inputs, targets, eps, mean=mean, std=std)
    if name == "iter_fgsm":
        return iterative_fgsm(model, inputs, targets, eps, alpha=alpha, steps=steps, mean=mean, std=std)
    if name == "iter_ll_fgsm":
        return iterative_ll_fgsm(model, inputs, eps, alpha=alpha, steps=steps, mean=mean, std=std)
    raise ValueError(f"unknown attack {name!r}; attacks are: {', '.join(ATTACKS)}")


def model_logits(output: Any) -> torch.Tensor:
    """The logits in what a classifier's forward returned: a tensor, or the ``"logits"`` entry of a dict or of a
    Hugging Face ``ModelOutput`` (a mapping).

    Raises:
        TypeError: anything else; the message names what the forward returned.
    """
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping) and isinstance(output.get("logits"), torch.Tensor):
        return output["logits"]
    keys = f" with keys {list(output.keys())}" if isinstance(output, Mapping) else ""
    raise TypeError(
        f"the attacks need the model's logits, but its forward returned a {type(output).__name__}{keys}; return a "
        "tensor (B, num_classes), or a dict or ModelOutput holding it under 'logits'"
    )


def _check_continuous(inputs: torch.Tensor) -> None:
    """Integer inputs (token ids, class indices) have no gradient and no pixel range: no sign attack applies."""
    if not inputs.is_floating_point():
        raise ValueError(
            f"the attacks perturb continuous inputs (pixels in [0, 1], or normalised pixels), but the inputs have "
            f"dtype {inputs.dtype} (token ids?), which have no input gradient; attack a model whose inputs are "
            "images, or name the floating-point inputs of the batch with input_key"
        )


def _check_eps(eps: float) -> None:
    # Pixels lie in [0, 1]: a budget above 1 is grey levels written as pixel units (8 for 8/255), and clipping to the
    # image would make every budget from 1 on the same attack.
    real = isinstance(eps, numbers.Real) and not isinstance(eps, bool)  # "0.03" or True: the type first
    if not (real and math.isfinite(eps) and 0 <= eps <= 1):
        hint = f", did you mean {eps:g}/255?" if real and math.isfinite(eps) and eps > 1 else ""
        raise ValueError(f"eps must lie in [0, 1] in pixel units (8/255 for 8 grey levels); got {eps!r}{hint}")


def _check_steps(alpha: float, steps: int | None) -> None:
    check_non_negative("alpha", alpha)
    check_non_negative_int("steps", steps, allow_none=True)


def _check_gradients_possible(inputs: torch.Tensor) -> None:
    if torch.is_inference_mode_enabled():
        raise RuntimeError(
            "adversarial attacks need input gradients, which torch.inference_mode forbids; Lightning's "
            "validate/test/predict run in inference mode unless the Trainer is built with "
            "Trainer(inference_mode=False)"
        )
    if inputs.is_inference():
        raise RuntimeError(
            "the inputs are inference tensors (made under torch.inference_mode), which cannot take part in "
            "gradient computations; build the Trainer with Trainer(inference_mode=False), or clone the inputs "
            "outside inference mode"
        )


def _sign_gradient_attack(
    model: nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor | None,
    *,
    eps: float,
    alpha: float,
    steps: int | None,
    mean: ChannelStats,
    std: ChannelStats,
    least_likely: bool = False,
) -> torch.Tensor:
    _check_eps(eps)
    _check_steps(alpha, steps)
    if steps is None:
        steps = kurakin_steps(eps)
    _check_continuous(inputs)
    _check_gradients_possible(inputs)
    if targets is not None and not least_likely:
        # The forms every class-aware part takes: a (B, 1) column, booleans, one-hot rows as their argmax.
        targets = class_labels(targets, inputs.shape[0], name="targets").to(inputs.device)
    # Under DDP a forward of the wrapper primes gradient synchronisation that an input-only backward never
    # completes; the wrapped module computes the same logits without it.
    if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        model = model.module

    inputs = inputs.detach()
    stats = channel_stats(mean, std, inputs)
    clean = inputs if stats is None else inputs * stats[1] + stats[0]
    low_pixel, high_pixel = (float(bound) for bound in torch.aminmax(clean))
    if low_pixel < -_PIXEL_SLACK or high_pixel > 1 + _PIXEL_SLACK:
        raise ValueError(
            f"un-normalised inputs span [{low_pixel:.4g}, {high_pixel:.4g}], not pixels in [0, 1]; pass the "
            f"datamodule's mean and std (got mean={mean!r}, std={std!r})"
        )
    low = (clean - eps).clamp_(min=0)
    high = (clean + eps).clamp_(max=1)
    # Descending on the least-likely class's loss is ascending on its negative.
    direction = -1.0 if least_likely else 1.0

    adversarial = clean.clone()
    with torch.enable_grad(), eval_mode(model):
        if least_likely:
            with torch.no_grad():
                targets = model_logits(model(inputs)).argmin(dim=1)
        for _ in range(steps):
            # The gradient is taken in the model's (normalised) input space: it differs from the pixel-space
            # gradient by the positive factor 1/std per channel, so the signs agree and two backward ops are saved.
            model_input = adversarial if stats is None else (adversarial - stats[0]) / stats[1]
            model_input = model_input.detach().requires_grad_(True)
            # A summed loss keeps each sample's gradient independent of the batch it is attacked in.
            loss = F.cross_entropy(model_logits(model(model_input)), targets, reduction="sum")
            (grad,) = torch.autograd.grad(loss, model_input)
            adversarial = adversarial + (direction * alpha) * grad.sign()
            adversarial = torch.minimum(torch.maximum(adversarial, low), high)

    if stats is None:
        return adversarial
    # Adding the normalised perturbation to the untouched inputs returns them bit for bit where nothing moved
    # (eps = 0 gives back the clean batch), which a full normalisation round trip would not.
    return inputs + (adversarial - clean) / stats[1]
