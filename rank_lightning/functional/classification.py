"""Low dimension of the final features seen through the classifier (Feng et al. Sec. 3.3 and 5).

* :func:`classification_dimension`: the fewest principal directions of the final features that keep 95% of the
  model's accuracy (Feng et al. eq. 6, Fig. 2, Table 2).
* :func:`independence_deficit`: the logit of a class written as a sparse linear combination of the logits of the
  other classes, found by the Lasso (Feng et al. eq. 11-12, Fig. 4).
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from sklearn.linear_model import Lasso
from torch import Tensor

from rank_lightning.functional.spectral import serial_if_small
from rank_lightning.layers import class_labels
from rank_lightning.validation import (
    check_choice,
    check_fraction,
    check_non_negative_ints,
    check_positive,
    check_positive_int,
)

__all__ = [
    "ClassificationDimension",
    "classification_dimension",
    "independence_deficit",
    "independence_deficit_markdown",
]

_FIT_ON_CHOICES = ("all", "class")
_CENTER_CHOICES = (False, True)


@dataclass(frozen=True)
class ClassificationDimension:
    """Result of :func:`classification_dimension`.

    When the features have no principal directions (every row the same, up to float64 rounding of the rows, or any
    entry NaN or Inf), the classification dimension is undefined: ``cls_dim`` and ``accuracies`` are NaN (see
    :attr:`defined`). So is it (``cls_dim`` NaN, the accuracies measured) when the full accuracy is 0, which every
    ``k`` keeps.

    Attributes:
        cls_dim: the classification dimension, the smallest evaluated ``k`` whose accuracy reaches
            ``threshold * full_accuracy``; ``math.nan`` (a float) when undefined (full accuracy 0 included).
        ambient_dim: d, the width of the features.
        full_accuracy: accuracy of the head on the unprojected features; NaN for non-finite features.
        threshold: the fraction of ``full_accuracy`` to reach.
        centered: whether the projection was affine through the mean (True) or linear through the origin (False).
        ks: int64, the evaluated numbers of principal directions, ascending (always ending with ``d``).
        accuracies: float64, the accuracy of the head on the projection onto the top-``k`` directions, for each ``k``;
            NaN when undefined.
        eigenvalues: float64, descending eigenvalues of the feature covariance (the PCA spectrum); zeros for
            constant features, NaN for non-finite ones.
    """

    cls_dim: int | float
    ambient_dim: int
    full_accuracy: float
    threshold: float
    centered: bool
    ks: Tensor
    accuracies: Tensor
    eigenvalues: Tensor

    @property
    def defined(self) -> bool:
        """Whether the classification dimension could be computed (``cls_dim`` is an integer, not NaN)."""
        return not (isinstance(self.cls_dim, float) and math.isnan(self.cls_dim))


def _check_labels(labels: Tensor, num_samples: int) -> Tensor:
    # The forms every class-aware part takes: a (B, 1) column, booleans, one-hot rows as their argmax.
    return class_labels(labels, num_samples)


def _check_ks(ks: Sequence[int] | Tensor | None, dim: int) -> list[int]:
    if ks is None:
        return list(range(1, dim + 1))
    entries = ks.tolist() if isinstance(ks, Tensor) else list(ks)
    if not all(isinstance(k, numbers.Integral) and not isinstance(k, bool) for k in entries):
        # int() would truncate 2.5 to 2 and read True as 1: a different sweep from the one asked for.
        raise ValueError(f"ks must be integers in [1, {dim}] (the feature width), got {entries}")
    values = sorted({int(k) for k in entries})
    bad = [k for k in values if not 1 <= k <= dim]
    if bad:
        raise ValueError(f"ks must lie in [1, {dim}] (the feature width), got {bad}")
    # k = d is always evaluated: there the projection is the identity, so the sweep always reaches the threshold.
    if not values or values[-1] != dim:
        values.append(dim)
    return values


def classification_dimension(
    features: Tensor,
    labels: Tensor,
    head: Callable[[Tensor], Tensor],
    *,
    threshold: float = 0.95,
    center: bool = False,
    ks: Sequence[int] | Tensor | None = None,
    batch_size: int = 4096,
) -> ClassificationDimension:
    """Classification dimension of the final features (Feng et al. eq. 6, Table 2).

    The principal directions ``q_1, q_2, ...`` are the eigenvectors of the covariance of the features, by decreasing
    eigenvalue (Feng et al. Sec. 3.3). For each ``k`` the features are projected onto the top-``k`` directions and fed
    to the model's own head; the classification dimension is the smallest ``k`` whose accuracy is at least
    ``threshold`` times the accuracy on the unprojected features. The accuracy need not grow monotonically with ``k``,
    so every ``k`` of the sweep is evaluated and the first to reach the threshold is taken (not a bisection). Each
    ``k`` costs one head evaluation, since projections are built incrementally.

    Two projections are offered. ``center=False`` (default) is what Feng et al.'s released code does and what their
    Table 2 reports: the raw features are projected linearly, ``P_k(F) = F Q_k Q_k^T``, so the component of the mean
    outside the top-``k`` directions is dropped as well. ``center=True`` is the PCA reconstruction through the mean,
    ``P_k(F) = mu + (F - mu) Q_k Q_k^T``, which keeps the mean and needs fewer directions when the mean is large (as
    for post-ReLU features). Both give the identity at ``k = d``.

    Features without principal directions have no classification dimension: when every row equals the mean up to
    float64 rounding (``|F - mu| <= max(N, d) * eps_float64 * max |F|`` entrywise, e.g. a layer of dead ReLUs) or
    any entry is NaN or Inf, a ``RuntimeWarning`` says so and ``cls_dim`` and the accuracies are NaN (the full
    accuracy too for non-finite features; the eigenvalues are then NaN, zeros for constant features). A head that
    classifies no sample correctly (full accuracy 0) has none either: every ``k`` would keep ``threshold`` times zero,
    so the first one evaluated would be taken for a dimension; a ``RuntimeWarning`` says so and ``cls_dim`` is NaN
    (the accuracies and the eigenvalues are those measured).

    Args:
        features: ``(N, d)`` final features of the evaluation set (the input of the head).
        labels: ``(N,)`` integer class labels.
        head: the model's classifier, ``(B, d) -> (B, num_classes)`` logits (e.g. ``backbone.forward_head``); it is
            called under ``torch.no_grad`` on features of ``features``' dtype and device, so put a module with dropout
            or BatchNorm in eval mode first.
        threshold: the fraction of the full accuracy to reach (Feng et al.: 0.95).
        center: projection through the mean (True) or through the origin (False, Feng et al.'s code); a bool.
        ks: the numbers of directions to evaluate; ``None`` evaluates every ``k`` in ``1..d``. Give a coarse grid for
            large ``d``: the result is then the smallest grid point reaching the threshold. ``d`` is always added.
        batch_size: samples per head call (bounds memory; the result does not depend on it).

    Returns:
        :class:`ClassificationDimension`.

    Raises:
        ValueError: a ``center`` other than False or True, features that are not a non-empty matrix, a threshold
            outside ``(0, 1]``, labels of the wrong shape or type, or ``ks`` that are not integers in ``[1, d]``.
    """
    check_choice("center", center, _CENTER_CHOICES)
    if features.ndim != 2 or features.shape[0] == 0:
        raise ValueError(f"features must be a non-empty (N, d) matrix, got shape {tuple(features.shape)}")
    check_fraction("threshold", threshold)
    check_positive_int("batch_size", batch_size)
    num_samples, dim = features.shape
    labels = _check_labels(labels, num_samples).to(features.device)
    grid = _check_ks(ks, dim)

    f64 = features.detach().to(torch.float64)
    if not bool(torch.isfinite(f64).all()):
        warnings.warn(
            "the features contain NaN or Inf values; the classification dimension, the accuracies and the "
            "spectrum are NaN",
            RuntimeWarning,
            stacklevel=2,
        )
        nan = torch.full((dim,), math.nan, dtype=torch.float64)
        return _undefined(grid, dim, math.nan, threshold, center, nan)
    mean = f64.mean(dim=0)
    centered = f64 - mean
    rounding = max(num_samples, dim) * torch.finfo(torch.float64).eps * float(f64.abs().max())
    if float(centered.abs().max()) <= rounding:
        warnings.warn(
            "the features are constant (every row equals the mean): they have no principal directions, so the "
            "classification dimension and the accuracies are NaN",
            RuntimeWarning,
            stacklevel=2,
        )
        full_accuracy = _head_accuracy(features, labels, head, batch_size)
        return _undefined(grid, dim, full_accuracy, threshold, center, torch.zeros(dim, dtype=torch.float64))
    with serial_if_small(centered, dim):
        eigenvalues, eigenvectors = torch.linalg.eigh(centered.T @ centered / num_samples)
    eigenvalues, basis = eigenvalues.flip(0), eigenvectors.flip(1)  # (d,), (d, d): columns q_1, q_2, ...

    correct = torch.zeros(len(grid), dtype=torch.float64)
    full_correct = 0.0
    with torch.no_grad():
        for start in range(0, num_samples, batch_size):
            rows = slice(start, start + batch_size)
            y = labels[rows]
            full_correct += float((head(features[rows].detach()).argmax(dim=1) == y).sum())
            scores = (centered[rows] if center else f64[rows]) @ basis  # (B, d) coordinates along q_1..q_d
            projection = mean.expand_as(scores).clone() if center else torch.zeros_like(scores)
            done = 0
            for index, k in enumerate(grid):
                projection += scores[:, done:k] @ basis[:, done:k].T
                done = k
                logits = head(projection.to(features.dtype))
                correct[index] += float((logits.argmax(dim=1) == y).sum())

    accuracies = correct / num_samples
    full_accuracy = full_correct / num_samples
    if full_accuracy == 0:
        warnings.warn(
            f"the head classifies none of the {num_samples} samples correctly (full accuracy 0): every k keeps "
            f"{threshold} of it, so the classification dimension is undefined (NaN)",
            RuntimeWarning,
            stacklevel=2,
        )
        cls_dim = math.nan
    else:
        reached = (accuracies >= threshold * full_accuracy).nonzero()
        # Rounding at k = d can leave the accuracy a hair below the full one; d is the answer then.
        cls_dim = grid[int(reached[0])] if reached.numel() else dim
    return ClassificationDimension(
        cls_dim=cls_dim,
        ambient_dim=dim,
        full_accuracy=full_accuracy,
        threshold=threshold,
        centered=center,
        ks=torch.tensor(grid, dtype=torch.int64),
        accuracies=accuracies,
        eigenvalues=eigenvalues.cpu(),
    )


def _head_accuracy(features: Tensor, labels: Tensor, head: Callable[[Tensor], Tensor], batch_size: int) -> float:
    correct = 0.0
    with torch.no_grad():
        for start in range(0, features.shape[0], batch_size):
            rows = slice(start, start + batch_size)
            correct += float((head(features[rows].detach()).argmax(dim=1) == labels[rows]).sum())
    return correct / features.shape[0]


def _undefined(
    grid: list[int], dim: int, full_accuracy: float, threshold: float, center: bool, eigenvalues: Tensor
) -> ClassificationDimension:
    return ClassificationDimension(
        cls_dim=math.nan,
        ambient_dim=dim,
        full_accuracy=full_accuracy,
        threshold=threshold,
        centered=center,
        ks=torch.tensor(grid, dtype=torch.int64),
        accuracies=torch.full((len(grid),), math.nan, dtype=torch.float64),
        eigenvalues=eigenvalues,
    )


def _mean_correct(predicted: np.ndarray, labels: np.ndarray) -> float:
    return float((predicted == labels).mean()) if labels.size else math.nan


def _accuracy(logits: np.ndarray, labels: np.ndarray) -> float:
    return _mean_correct(logits.argmax(axis=1), labels)


def independence_deficit(
    logits: Tensor,
    labels: Tensor,
    classes: Sequence[int] | None = None,
    *,
    eta: float = 20.0,
    fit_on: Literal["all", "class"] = "all",
    max_iter: int = 10_000,
    tol: float = 1e-6,
) -> list[dict[str, Any]]:
    """Independence deficit: each chosen class's logit as a sparse combination of the others (Feng et al. eq. 11-12).

    For a class ``i`` the Lasso problem

        ``min_lambda  mean_x (logit_i(x) - sum_{j != i} lambda_j logit_j(x))^2 + eta * ||lambda||_1``

    is solved over the evaluation samples (no intercept). The mean over samples is Feng et al.'s expectation in eq. 11
    and the mean squared error of their released code, whose ``eta = 20`` is the default here. scikit-learn's
    ``Lasso`` minimises ``(1 / 2N) ||y - X w||^2 + alpha ||w||_1``, half the objective above, so it is called with
    ``alpha = eta / 2``. The penalty is not scale-free: multiplying all logits by ``c`` asks for ``eta * c^2`` to
    select the same classes.

    Feng et al. Fig. 4 report the few classes with non-zero weight and the accuracy when ``logit_i`` is replaced by
    its fit (eq. 12); both are returned, over all samples and over the samples of class ``i``.

    Args:
        logits: ``(N, C)`` logits of the evaluation set.
        labels: ``(N,)`` integer labels, used for the accuracies (and for ``fit_on="class"``).
        classes: the classes ``i`` to explain; ``None`` takes all ``C``.
        eta: weight of the L1 penalty in the objective above.
        fit_on: ``"all"`` fits over every sample (eq. 11); ``"class"`` only over the samples labelled ``i``, as
            Feng et al.'s released code does. The accuracies always use every sample.
        max_iter: coordinate-descent iterations of scikit-learn's ``Lasso``.
        tol: its tolerance on the duality gap.

    Returns:
        One dict per class, ready for a table (see :func:`independence_deficit_markdown`):
        ``class``; ``terms``, ``weights`` (the classes with non-zero ``lambda_j`` and their weights, by decreasing
        ``|lambda_j|``); ``num_terms``; ``objective`` (the value of the objective above); ``r2`` (``1 - SS_res /
        SS_tot`` on the fitted samples); ``relative_residual`` (``||logit_i - fit|| / ||logit_i||``); ``accuracy`` and
        ``accuracy_fit`` (top-1 accuracy over all samples with the true logits, and with ``logit_i`` replaced by its
        fit); ``class_accuracy`` and ``class_accuracy_fit`` (the same over the samples labelled ``i``).

    Raises:
        ValueError: logits that are not an ``(N, C)`` matrix with ``C >= 2`` or hold NaN or Inf values, an unknown
            ``fit_on``, ``eta <= 0``, classes out of range, or a class without samples under ``fit_on="class"``.
    """
    if logits.ndim != 2 or logits.shape[1] < 2:
        raise ValueError(f"logits must be an (N, C) matrix with C >= 2 classes, got shape {tuple(logits.shape)}")
    if fit_on not in _FIT_ON_CHOICES:
        raise ValueError(f"unknown fit_on {fit_on!r}; valid choices are {_FIT_ON_CHOICES}")
    check_positive("eta", eta)
    check_positive_int("max_iter", max_iter)
    check_positive("tol", tol)
    if classes is not None:
        listed = classes.tolist() if isinstance(classes, (Tensor, np.ndarray)) else classes
        classes = check_non_negative_ints("classes", listed, allow_empty=True)
    if not bool(torch.isfinite(logits.detach()).all()):
        raise ValueError("logits contain NaN or Inf values; the Lasso needs finite logits")
    num_samples, num_classes = logits.shape
    y_true = _check_labels(labels, num_samples).cpu().numpy()
    chosen = list(range(num_classes)) if classes is None else [int(c) for c in classes]
    bad = [c for c in chosen if not 0 <= c < num_classes]
    if bad:
        raise ValueError(f"classes {bad} are out of range; valid classes are 0..{num_classes - 1}")

    z = logits.detach().to(torch.float64).cpu().numpy()
    gram_all = z.T @ z if fit_on == "all" else None
    accuracy = _accuracy(z, y_true)
    # The two largest logits of each sample give the best class other than i without copying the logits per class.
    top2 = np.argsort(-z, axis=1, kind="stable")[:, :2]
    sample = np.arange(num_samples)
    rows = []
    for i in chosen:
        others = np.array([j for j in range(num_classes) if j != i])
        fit_rows = np.ones(num_samples, dtype=bool) if fit_on == "all" else y_true == i
        if not fit_rows.any():
            raise ValueError(f"class {i} has no samples to fit on (fit_on='class')")
        x_fit, y_fit = z[fit_rows][:, others], z[fit_rows, i]
        gram = gram_all[np.ix_(others, others)] if gram_all is not None else x_fit.T @ x_fit
        lasso = Lasso(alpha=eta / 2, fit_intercept=False, precompute=gram, max_iter=max_iter, tol=tol)
        weights = lasso.fit(x_fit, y_fit).coef_

        residual = y_fit - x_fit @ weights
        ss_tot = float(np.sum((y_fit - y_fit.mean()) ** 2))
        fitted = z[:, others] @ weights
        best_other = np.where(top2[:, 0] == i, top2[:, 1], top2[:, 0])
        best_value = z[sample, best_other]
        # argmax with logit_i replaced; on a tie argmax takes the smaller index.
        wins = (fitted > best_value) | ((fitted == best_value) & (i < best_other))
        predicted = np.where(wins, i, best_other)
        in_class = y_true == i
        order = np.argsort(-np.abs(weights), kind="stable")
        nonzero = [k for k in order if weights[k] != 0]
        rows.append(
            {
                "class": i,
                "terms": [int(others[k]) for k in nonzero],
                "weights": [float(weights[k]) for k in nonzero],
                "num_terms": len(nonzero),
                "objective": float(np.mean(residual**2) + eta * np.abs(weights).sum()),
                "r2": 1.0 - float(residual @ residual) / ss_tot if ss_tot > 0 else math.nan,
                "relative_residual": float(np.linalg.norm(residual) / np.linalg.norm(y_fit))
                if np.any(y_fit)
                else math.nan,
                "accuracy": accuracy,
                "accuracy_fit": _mean_correct(predicted, y_true),
                "class_accuracy": _accuracy(z[in_class], y_true[in_class]),
                "class_accuracy_fit": _mean_correct(predicted[in_class], y_true[in_class]),
            }
        )
    return rows


def independence_deficit_markdown(
    rows: Sequence[dict[str, Any]],
    class_names: Sequence[str] | None = None,
    *,
    max_terms: int = 5,
    digits: int = 3,
) -> str:
    """Markdown table of :func:`independence_deficit` rows (Feng et al. Fig. 4 as a table).

    Args:
        rows: the output of :func:`independence_deficit`.
        class_names: names indexed by class; class indices are printed without them.
        max_terms: the largest number of terms printed per class (by decreasing ``|lambda_j|``); the count of the
            remaining ones is appended.
        digits: decimals of the weights and scores.

    Returns:
        The table as a string.
    """

    def name(c: int) -> str:
        return str(class_names[c]) if class_names is not None else str(c)

    def number(value: float) -> str:
        return "nan" if math.isnan(value) else f"{value:.{digits}f}"

    lines = [
        "| class | logit_i ~ sum_j lambda_j logit_j | terms | R^2 | acc | acc (fit) | class acc | class acc (fit) |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        shown = [f"{w:+.{digits}f} x {name(c)}" for c, w in zip(row["terms"][:max_terms], row["weights"][:max_terms])]
        hidden = row["num_terms"] - len(shown)
        if hidden > 0:
            shown.append(f"(+{hidden} more)")
        combination = " ".join(shown) if shown else "0"
        cells = [
            name(row["class"]),
            combination,
            str(row["num_terms"]),
            number(row["r2"]),
            number(row["accuracy"]),
            number(row["accuracy_fit"]),
            number(row["class_accuracy"]),
            number(row["class_accuracy_fit"]),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
