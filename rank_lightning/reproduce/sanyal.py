"""Sanyal, Kanade and Torr, *Low Rank Structure of Learned Representations*: variance ratios with and without the
LR-Layer (Figs. 1-4), accuracy of low-dimensional embeddings (Tables 3-4) and robustness to Iter-FGSM against the
normalised L2 dissimilarity (Fig. 5), with a sweep over the LR-Layer's loss weights ``lambda_1``, ``lambda_2``.

Setting here: an MLP (3 hidden layers of 128, ReLU) on the digits, with one LR-Layer of target rank 10 before the
classification layer (the paper: rank 50 before the last FC layer of ResNets on CIFAR). As in the paper the network
trains normally until 65% training accuracy, then the layer is switched on: its auxiliary loss joins the
cross-entropy and ``W`` is projected to rank ``k`` by the ensemble Nyström method after every step (Alg. 1).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import torch
from matplotlib.figure import Figure
from torch import nn

from rank_lightning.attacks.evaluation import adversarial_feature_distance, l2_dissimilarity
from rank_lightning.attacks.gradient_sign import iterative_fgsm
from rank_lightning.functional.embedding import low_dimensional_accuracy
from rank_lightning.functional.spectral import classwise_variance_ratio, spectrum, variance_ratio
from rank_lightning.models import create_model
from rank_lightning.nn.lr_layer import LRLayer, collect_auxiliary_losses, insert_lr_layer
from rank_lightning.reproduce.core import Claim, Context, experiment, verdict
from rank_lightning.reproduce.training import (
    Dataset,
    Diverged,
    accuracy,
    features_of,
    load_classification,
    train_epochs,
)

__all__ = ["sanyal", "train_model"]

_SWITCH_ON_ACCURACY = 0.65
_RANK = 10
_COLORS = ("#555555", "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728")


def train_model(
    data: Dataset, *, lambdas: tuple[float, float] | None, epochs: int, seed: int, device: torch.device
) -> tuple[nn.Module, int | None, bool]:
    """Train the MLP, with an LR-Layer of weights ``lambdas`` before its head (``None``: without one).

    Returns:
        The model (eval mode), the epoch the LR-Layer was switched on (``None`` without a layer or if training
        accuracy never reached 65%), and whether training diverged (a non-finite loss or LR-Layer weight; training
        stops there and the model is reported as diverged).
    """
    torch.manual_seed(seed)
    model = create_model("mlp", input_shape=data.image_shape, depth=3, width=128).to(device)
    x = data.x_train.view(-1, *data.image_shape)
    if lambdas is None:
        train_epochs(model, x, data.y_train, epochs=epochs, lr=0.05, momentum=0.9, seed=seed)
        return model, None, False
    layer = insert_lr_layer(
        model, "head", LRLayer(128, _RANK, lambda_1=lambdas[0], lambda_2=lambdas[1], projection="nystrom")
    ).to(device)
    generator = torch.Generator().manual_seed(seed)  # CPU indices, moved to the device by the projection
    switched: list[int] = []

    def switch_on(epoch: int) -> None:
        if not layer.enabled and accuracy(model, x, data.y_train) >= _SWITCH_ON_ACCURACY:
            layer.enabled = True
            switched.append(epoch + 1)

    def project() -> None:
        if layer.enabled:
            if not torch.isfinite(layer.weight).all():
                raise Diverged("the LR-Layer's weight is not finite")
            layer.project_(generator)

    try:
        train_epochs(
            model, x, data.y_train, epochs=epochs, lr=0.05, momentum=0.9, seed=seed,
            extra_loss=lambda: collect_auxiliary_losses(model), after_step=project, after_epoch=switch_on,
        )  # fmt: skip
    except Diverged:
        model.eval()
        return model, switched[0] if switched else None, True
    return model, switched[0] if switched else None, False


def _robustness(model: nn.Module, data: Dataset, eps_grid: Sequence[float]) -> list[dict[str, float]]:
    """Iter-FGSM (Kurakin steps, one grey level per step) at each eps: misclassification over the test set, mean
    normalised L2 dissimilarity (eq. 10) and D_Adv at the features (over the originally correct samples)."""
    x = data.x_test.view(-1, *data.image_shape)
    y = data.y_test
    with torch.no_grad():
        clean_features = model.forward_features(x)
        correct = model(x).argmax(dim=1) == y
    rows = []
    for eps in eps_grid:
        adversarial = iterative_fgsm(model, x, y, eps, mean=data.mean, std=data.std)
        with torch.no_grad():
            logits = model(adversarial)
            features = model.forward_features(adversarial)
        rows.append(
            {
                "eps": eps,
                "misclassification": float((logits.argmax(dim=1) != y).float().mean()),
                "l2_dissimilarity": float(l2_dissimilarity(adversarial, x, mean=data.mean, std=data.std).mean()),
                "d_adv": float(adversarial_feature_distance(features, clean_features, correct)),
                "d_adv_relative": float(
                    adversarial_feature_distance(features, clean_features, correct)
                    / clean_features[correct].square().sum(dim=1).mean()
                ),
            }
        )
    return rows


def _misclassification_at(rows: Sequence[dict[str, float]], l2: float) -> float:
    """Misclassification interpolated linearly in the L2 dissimilarity at ``l2`` (clamped to the measured range)."""
    points = sorted((r["l2_dissimilarity"], r["misclassification"]) for r in rows)
    if l2 <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in itertools.pairwise(points):
        if x0 <= l2 <= x1:
            return y0 + (y1 - y0) * (l2 - x0) / (x1 - x0) if x1 > x0 else y1
    return points[-1][1]


@experiment(
    "sanyal",
    paper="Sanyal et al.",
    title="Figs. 1-5, Tables 3-4: VR_k, class-wise VR_1, low-dim. embeddings, robustness vs L2 (lambda sweep)",
)
def sanyal(context: Context) -> list[Claim]:
    """Baseline and LR-Layer models for each ``(lambda_1, lambda_2)`` of the sweep; per model: ``VR_k`` of the test
    features for ``k = 1..30``, class-wise ``VR_1``, the accuracy of a linear max-margin classifier on PCA embeddings
    of several dimensions, and Iter-FGSM misclassification against the L2 dissimilarity with ``D_Adv``."""
    data = load_classification(context.data_dir).to(context.device)
    settings: list[tuple[float, float] | None] = [
        None,
        *context.size([(0.01, 0.01), (0.1, 0.1), (1.0, 1.0), (10.0, 1.0)], [(1.0, 1.0)]),
    ]
    epochs = context.size(40, 4)
    eps_grid = context.size([0.02, 0.05, 0.1, 0.15, 0.2, 0.3], [0.05, 0.2])
    dims = [128, 20, 10, 5, 2]
    context.total(len(settings))
    vr_rows, class_rows, table_rows, robust_rows = [], [], [], []
    names = []
    diverged = []
    never_on = []
    sweep_rows = []
    for setting in settings:
        name = "without LR-Layer" if setting is None else f"LR-Layer, lambda = {setting[0]:g}, {setting[1]:g}"
        model, switched, failed = train_model(
            data, lambdas=setting, epochs=epochs, seed=context.seed, device=context.device
        )
        context.advance()
        sweep_rows.append(
            {
                "model": name,
                "lr_layer": int(setting is not None),
                "lambda_1": 0.0 if setting is None else setting[0],
                "lambda_2": 0.0 if setting is None else setting[1],
                "diverged": int(failed),
            }
        )
        if failed:
            diverged.append(name)
            continue
        names.append(name)
        if setting is not None and switched is None:
            never_on.append(name)
        train_x, test_x = data.x_train.view(-1, *data.image_shape), data.x_test.view(-1, *data.image_shape)
        train_features, test_features = (
            features_of(model.forward_features, train_x),
            features_of(model.forward_features, test_x),
        )
        spec = spectrum(test_features)
        vr_rows += [{"model": name, "k": k, "vr_k": float(variance_ratio(spec, k))} for k in range(1, 31)]
        class_vr = classwise_variance_ratio(test_features, data.y_test, k=1, num_classes=10)
        class_rows += [{"model": name, "class": c, "vr_1": float(v)} for c, v in enumerate(class_vr)]
        low_dim = low_dimensional_accuracy(train_features, data.y_train, test_features, data.y_test, dims)
        table_rows += [
            {
                "model": name,
                "embedding_dim": dim,
                "accuracy": acc,
                "test_accuracy_of_network": accuracy(model, test_x, data.y_test),
                "switched_on_epoch": "" if switched is None else switched,
            }
            for dim, acc in low_dim.items()
        ]
        robust_rows += [{"model": name} | row for row in _robustness(model, data, eps_grid)]
    context.write_csv("sweep", sweep_rows)
    context.write_csv("variance_ratio", vr_rows)
    context.write_csv("classwise_vr1", class_rows)
    context.write_csv("low_dimensional_accuracy", table_rows)
    context.write_csv("robustness", robust_rows)
    context.save(_vr_figure(vr_rows, class_rows, names, data.name), "sanyal_fig1_3")
    context.save(_table_figure(table_rows, names, dims, data.name), "sanyal_tables3_4")
    context.save(_robust_figure(robust_rows, names, data.name), "sanyal_fig5")
    # A layer never switched on leaves the network without it: comparing it would pass that network off as an LR model.
    compared = [name for name in names if name not in never_on]
    if len(compared) < 2:
        raise RuntimeError(
            f"no LR-Layer setting can be compared: diverged: {', '.join(diverged) or 'none'}; never switched on "
            f"(training accuracy below {_SWITCH_ON_ACCURACY:.0%} in {epochs} epochs): {', '.join(never_on) or 'none'}"
        )
    claims = _claims(compared, vr_rows, class_rows, table_rows, robust_rows, data.name, epochs)
    notes = [f"diverged and left out: {', '.join(diverged)}"] if diverged else []
    if never_on:
        notes.append(
            f"LR-Layer never switched on (training accuracy below {_SWITCH_ON_ACCURACY:.0%}) and left out: "
            + ", ".join(never_on)
        )
    if notes:
        claims = [dataclasses.replace(claim, reason="; ".join([claim.reason, *notes])) for claim in claims]
    return claims


def _vr_figure(vr_rows: Sequence[dict], class_rows: Sequence[dict], names: Sequence[str], data_name: str) -> Figure:
    figure = Figure(figsize=(10, 3.4), layout="constrained")
    left, right = figure.subplots(1, 2)
    width = 0.8 / len(names)
    for index, (name, color) in enumerate(zip(names, _COLORS)):
        rows = [r for r in vr_rows if r["model"] == name]
        left.plot([r["k"] for r in rows], [r["vr_k"] for r in rows], "o-", ms=2.5, color=color, label=name)
        classes = [r for r in class_rows if r["model"] == name]
        right.bar([r["class"] + (index - len(names) / 2 + 0.5) * width for r in classes], [r["vr_1"] for r in classes],
                  width, color=color, label=name)  # fmt: skip
    left.axvline(_RANK, color="k", linestyle=":", linewidth=1)
    left.set_xlabel("k")
    left.set_ylabel("variance ratio VR$_k$")
    left.set_title("VR$_k$ of the features before the last FC layer", fontsize=10)
    left.grid(alpha=0.3)
    left.legend(fontsize=7)
    right.set_xticks(range(10))
    right.set_xlabel("class")
    right.set_ylabel("VR$_1$ of the class's features")
    right.set_title("Class-wise VR$_1$", fontsize=10)
    right.set_ylim(0, 1)
    figure.suptitle(f"{data_name}, MLP 3x128, LR-Layer rank {_RANK} before the head (test set)", fontsize=10)
    return figure


def _table_figure(rows: Sequence[dict], names: Sequence[str], dims: Sequence[int], data_name: str) -> Figure:
    figure = Figure(figsize=(5.5, 3.4), layout="constrained")
    ax = figure.subplots()
    for name, color in zip(names, _COLORS):
        points = [r for r in rows if r["model"] == name]
        ax.plot([r["embedding_dim"] for r in points], [r["accuracy"] for r in points], "o-", color=color, label=name)
    ax.set_xscale("log")
    ax.set_xticks(list(dims), [str(d) for d in dims])
    ax.set_xlabel("embedding dimension (PCA)")
    ax.set_ylabel("test accuracy, linear max-margin")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title(f"Tables 3-4: low-dimensional embeddings ({data_name})", fontsize=10)
    return figure


def _robust_figure(rows: Sequence[dict], names: Sequence[str], data_name: str) -> Figure:
    figure = Figure(figsize=(10, 3.4), layout="constrained")
    left, right = figure.subplots(1, 2)
    for name, color in zip(names, _COLORS):
        points = [r for r in rows if r["model"] == name]
        left.plot([r["l2_dissimilarity"] for r in points], [r["misclassification"] for r in points], "o-",
                  color=color, label=name)  # fmt: skip
        right.plot([r["eps"] for r in points], [r["d_adv_relative"] for r in points], "o-", color=color, label=name)
    left.set_xlabel("normalised L2 dissimilarity")
    left.set_ylabel("adversarial misclassification")
    left.set_ylim(0, 1.02)
    left.set_title("Fig. 5: Iter-FGSM", fontsize=10)
    left.legend(fontsize=7)
    right.set_xlabel("eps (pixel units)")
    right.set_ylabel(r"$D_{Adv}$ / mean $\|f(x)\|^2$")
    right.set_yscale("log")
    right.set_title("feature displacement at the LR-Layer's input", fontsize=10)
    for ax in (left, right):
        ax.grid(alpha=0.3)
    figure.suptitle(f"Robustness on {data_name} (test set)", fontsize=10)
    return figure


def _claims(
    names: Sequence[str],
    vr_rows: Sequence[dict],
    class_rows: Sequence[dict],
    table_rows: Sequence[dict],
    robust_rows: Sequence[dict],
    data_name: str,
    epochs: int,
) -> list[Claim]:
    base, lr_names = names[0], names[1:]

    def vr(name: str, k: int) -> float:
        return next(float(r["vr_k"]) for r in vr_rows if (r["model"], r["k"]) == (name, k))

    def class_vr(name: str) -> float:
        values = [float(r["vr_1"]) for r in class_rows if r["model"] == name]
        return sum(values) / len(values)

    def acc(name: str, dim: int) -> float:
        return next(float(r["accuracy"]) for r in table_rows if (r["model"], r["embedding_dim"]) == (name, dim))

    best_vr = max(lr_names, key=lambda n: vr(n, _RANK))
    best_class = max(lr_names, key=class_vr)
    smallest = min(int(r["embedding_dim"]) for r in table_rows)
    drop = {n: acc(n, 128) - acc(n, smallest) for n in names}
    best_drop = min(lr_names, key=drop.__getitem__)
    l2 = sorted(float(r["l2_dissimilarity"]) for r in robust_rows if r["model"] == base)
    probe = l2[len(l2) // 2]
    misclass = {n: _misclassification_at([r for r in robust_rows if r["model"] == n], probe) for n in names}
    best_robust = min(lr_names, key=misclass.__getitem__)
    setting = f"{data_name}, MLP 3x128, rank {_RANK}, {epochs} epochs; lambdas swept: " + "; ".join(
        n.split("= ")[1] for n in lr_names
    )
    return [
        Claim(
            "sanyal",
            f"the LR-Layer concentrates the features' variance in the top {_RANK} directions",
            "LR models' VR_k is near 1 at k = target rank, models without are not (Figs. 1-2)",
            f"VR_{_RANK}: with ({best_vr.split(', ', 1)[1]}) {vr(best_vr, _RANK):.3f} vs without "
            f"{vr(base, _RANK):.3f}; VR_1 {vr(best_vr, 1):.3f} vs {vr(base, 1):.3f}",
            verdict(
                vr(best_vr, _RANK) >= 0.95 and vr(best_vr, _RANK) > vr(base, _RANK),
                partly=vr(best_vr, _RANK) > vr(base, _RANK),
            ),
            setting,
            value=vr(best_vr, _RANK) - vr(base, _RANK),
        ),
        Claim(
            "sanyal",
            "one singular value carries most of each class's variance with the LR-Layer",
            "class-wise VR_1 high for LR models, lower without (Figs. 3-4)",
            f"mean class-wise VR_1: with {class_vr(best_class):.3f} vs without {class_vr(base):.3f}",
            verdict(class_vr(best_class) > class_vr(base) + 0.05, partly=class_vr(best_class) > class_vr(base)),
            "uncentred class features, as the paper",
            value=class_vr(best_class) - class_vr(base),
        ),
        Claim(
            "sanyal",
            "low-dimensional embeddings of LR models keep their accuracy better",
            "5-dim embeddings: ResNet-50-LR 72% (from 78.1%) vs 48% (from 75.6%) without (Table 3, CIFAR-100 coarse)",
            f"{smallest}-dim: with ({best_drop.split('= ')[1]}) {acc(best_drop, smallest):.1%} (from "
            f"{acc(best_drop, 128):.1%}) vs without {acc(base, smallest):.1%} (from {acc(base, 128):.1%}); 5-dim: "
            f"{acc(best_drop, 5):.1%} vs {acc(base, 5):.1%}",
            verdict(drop[best_drop] < drop[base] - 0.1, partly=drop[best_drop] < drop[base] - 0.02),
            f"linear SVM on standardised PCA embeddings of the train features, scored on the test features; compared "
            f"at the smallest dimension ({smallest}): 10 digit classes are still separable in 5",
            value=drop[base] - drop[best_drop],
        ),
        Claim(
            "sanyal",
            "LR models are more robust to Iter-FGSM at equal L2 dissimilarity",
            "at L2 dissimilarity 0.2: LR models misclassify < 50%, the normal model ~90% (Fig. 5, CIFAR-10)",
            f"at L2 dissimilarity {probe:.3f}: without {misclass[base]:.0%}; "
            + ", ".join(f"{n.split('= ')[1]}: {misclass[n]:.0%}" for n in lr_names),
            verdict(misclass[best_robust] < misclass[base] - 0.1, partly=misclass[best_robust] < misclass[base] - 0.05),
            "misclassification interpolated at the median dissimilarity of the model without the layer; a gain below "
            "5 points counts as none",
            value=misclass[base] - misclass[best_robust],
        ),
    ]
