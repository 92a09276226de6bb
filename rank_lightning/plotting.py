"""Every figure the package draws, from plain numbers: the callbacks and ``analysis.report`` share these functions.

Figures are drawn synchronously with matplotlib's object-oriented API (``Figure``, no pyplot state), so drawing
never touches a global figure manager and can run inside any training loop. Each function returns the ``Figure``;
:func:`save_figure` writes it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

from matplotlib import colormaps
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import MaxNLocator

__all__ = [
    "adversarial_figure",
    "classification_dimension_figure",
    "evenly_spaced",
    "figure_filename",
    "layer_curves_figure",
    "runs_vs_depth_figure",
    "runs_vs_epoch_figure",
    "save_figure",
]

_UNSAFE_FILENAME = re.compile(r"[^A-Za-z0-9_.=-]+")

# Curves: epoch -> layer -> metric -> value.
History = Mapping[int, Mapping[str, Mapping[str, float]]]


def figure_filename(*parts: str) -> str:
    """``"<part>_<part>"`` with every character other than letters, digits and ``_.=-`` replaced by ``_``."""
    return _UNSAFE_FILENAME.sub("_", "_".join(parts))


def save_figure(figure: Figure, path: str | Path, dpi: int = 100) -> Path:
    """Write ``figure`` to ``path`` (its folder is created) and return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=dpi)
    return path


def evenly_spaced(items: Sequence[int], count: int) -> list[int]:
    """At most ``count`` of ``items``, evenly spaced, first and last included."""
    if len(items) <= count:
        return list(items)
    picks = {round(i * (len(items) - 1) / (count - 1)) for i in range(count)}
    return [items[i] for i in sorted(picks)]


def _value(history: History, epoch: int, layer: str, metric: str) -> float:
    return history[epoch].get(layer, {}).get(metric, math.nan)


def layer_curves_figure(
    namespace: str,
    metric: str,
    layers: Sequence[str],
    history: History,
    *,
    max_depth_curves: int = 8,
    x_label: str = "epoch",
) -> Figure:
    """One metric of one run: against epoch (a line per layer) beside against depth (a line per epoch).

    Args:
        namespace: the curves' namespace, shown in the title.
        metric: the metric drawn.
        layers: layers in depth order.
        history: ``epoch -> layer -> metric -> value``.
        max_depth_curves: at most this many epochs (evenly spaced) in the depth panel.
        x_label: name of the history's keys (``"epoch"``, ``"step"``).
    """
    depth_width = max(7.0, 0.3 * len(layers))
    height = 4.8
    figure = Figure(figsize=(7 + depth_width, height))
    # Fixed margins instead of a layout engine, which measures every text twice and doubles the drawing time;
    # the bottom margin leaves room for the rotated layer names (about 0.045 inch per character).
    longest = max((len(layer) for layer in layers), default=0)
    bottom = min(0.6, (0.5 + 0.045 * longest) / height)
    figure.subplots_adjust(left=0.06, right=0.98, top=0.88, bottom=bottom, wspace=0.18)
    by_epoch, by_depth = figure.subplots(1, 2, width_ratios=[7, depth_width])
    figure.suptitle(f"{namespace}: {metric}")
    epochs = sorted(history)

    colors = colormaps["viridis"]
    count = max(len(layers) - 1, 1)
    for depth, layer in enumerate(layers):
        xs = [e for e in epochs if metric in history[e].get(layer, {})]
        if xs:
            values = [history[e][layer][metric] for e in xs]
            by_epoch.plot(xs, values, marker=".", color=colors(depth / count), label=layer)
    by_epoch.set_xlabel(x_label)
    by_epoch.xaxis.set_major_locator(MaxNLocator(integer=True))
    by_epoch.set_ylabel(metric)
    by_epoch.set_title("per layer (dark = shallow, yellow = deep)", fontsize="medium")
    if len(layers) <= 16:
        by_epoch.legend(fontsize="x-small", ncol=2)
    by_epoch.grid(alpha=0.3)

    depth_epochs = evenly_spaced(epochs, max_depth_curves)
    blues = colormaps["Blues"]
    count = max(len(depth_epochs) - 1, 1)
    depth = list(range(len(layers)))
    for i, epoch in enumerate(depth_epochs):
        values = [_value(history, epoch, layer, metric) for layer in layers]
        by_depth.plot(depth, values, marker=".", color=blues(0.3 + 0.7 * i / count), label=f"{x_label} {epoch}")
    by_depth.set_xticks(depth)
    by_depth.set_xticklabels(layers, rotation=90, fontsize="x-small")
    by_depth.set_xlabel("layer (by depth)")
    by_depth.set_title(f"vs depth (darker = later {x_label})", fontsize="medium")
    by_depth.legend(fontsize="x-small")
    by_depth.grid(alpha=0.3)
    return figure


# -- several runs (analysis.report) ----------------------------------------------------------------------------------

# One run's curve of one metric: layer -> {epoch: value}.
RunCurve = Mapping[str, Mapping[int, float]]


def _run_colors(count: int) -> list[tuple[float, float, float, float]]:
    palette = colormaps["tab10" if count <= 10 else "viridis"]
    return [palette(i if count <= 10 else i / max(count - 1, 1)) for i in range(count)]


def runs_vs_epoch_figure(namespace: str, metric: str, layers: Sequence[str], runs: Mapping[str, RunCurve]) -> Figure:
    """One panel per layer, the metric against epoch, one line per run (``runs``: label -> layer -> epoch -> value)."""
    columns = min(4, len(layers))
    rows = math.ceil(len(layers) / columns)
    figure = Figure(figsize=(3.6 * columns, 2.6 * rows + 0.6), layout="constrained")
    axes = figure.subplots(rows, columns, squeeze=False, sharex=True)
    colors = _run_colors(len(runs))
    for index, layer in enumerate(layers):
        ax = axes[index // columns][index % columns]
        for curves, color in zip(runs.values(), colors):
            curve = curves.get(layer, {})
            if curve:
                epochs = sorted(curve)
                ax.plot(epochs, [curve[e] for e in epochs], marker=".", color=color)
        ax.set_title(layer, fontsize="small")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.ticklabel_format(axis="y", useOffset=False)
        ax.grid(alpha=0.3)
    for index in range(len(layers), rows * columns):
        axes[index // columns][index % columns].set_axis_off()
    figure.supxlabel("epoch")
    figure.suptitle(f"{namespace}: {metric} per layer")
    if len(runs) > 1:
        handles = [Line2D([], [], color=color, marker=".") for color in colors]
        figure.legend(handles, list(runs), loc="outside right upper", fontsize="small")
    return figure


def runs_vs_depth_figure(
    namespace: str, metric: str, layers: Sequence[str], runs: Mapping[str, tuple[int | None, RunCurve]]
) -> Figure:
    """The metric at each run's last epoch against depth (``runs``: label -> (last epoch, layer -> epoch -> value))."""
    figure = Figure(figsize=(max(7.0, 0.3 * len(layers)), 4.5), layout="constrained")
    ax = figure.subplots()
    for (label, (last, curves)), color in zip(runs.items(), _run_colors(len(runs))):
        values = [curves.get(layer, {}).get(last, math.nan) for layer in layers]
        ax.plot(range(len(layers)), values, marker=".", color=color, label=f"{label} (epoch {last})")
    ax.set_xticks(range(len(layers)))
    ax.set_xticklabels(layers, rotation=90, fontsize="x-small")
    ax.set_xlabel("layer (by depth)")
    ax.set_ylabel(metric)
    ax.set_title(f"{namespace}: {metric} vs depth at the last epoch")
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    return figure


# -- method-specific figures -----------------------------------------------------------------------------------------


def adversarial_figure(
    curves: Mapping[str, Mapping[str, Sequence[float]]],
    levels: Sequence[float],
    clean_accuracy: float,
    title: str,
    feature_layer: str | None = None,
) -> Figure:
    """Misclassification against L2 dissimilarity per attack (Sanyal et al. Fig. 5), beside ``D_Adv`` against eps.

    Args:
        curves: ``attack -> {"acc": [...], "l2": [...], "d_adv": [...]}``, one value per budget.
        levels: the budgets in grey levels, ascending.
        clean_accuracy: accuracy on the clean inputs (the first point of every curve).
        title: what the figure shows (stage and epoch).
        feature_layer: name of the layer of ``D_Adv``; ``None`` draws the first panel only.
    """
    with_d_adv = feature_layer is not None
    figure = Figure(figsize=(12 if with_d_adv else 6.5, 4.8), layout="constrained")
    panels = figure.subplots(1, 2 if with_d_adv else 1, squeeze=False)[0]
    figure.suptitle(f"Adversarial robustness ({title})")
    colors = colormaps["tab10"]
    for i, (name, curve) in enumerate(curves.items()):
        errors = [1 - acc for acc in curve["acc"]]
        distances = list(curve["l2"])
        panels[0].plot([0.0, *distances], [1 - clean_accuracy, *errors], marker="o", color=colors(i), label=name)
        for level, x, y in zip(levels, distances, errors):
            panels[0].annotate(f"{level:g}", (x, y), textcoords="offset points", xytext=(3, 3), fontsize="x-small")
        if with_d_adv:
            panels[1].plot(levels, list(curve["d_adv"]), marker="o", color=colors(i), label=name)
    panels[0].set_xlabel("normalised L2 dissimilarity ||x_a - x_d|| / ||x_d|| (Sanyal eq. 10)")
    panels[0].set_ylabel("misclassification rate")
    panels[0].set_ylim(-0.02, 1.02)
    panels[0].set_title("labels: eps in grey levels; first point: clean inputs", fontsize="medium")
    if with_d_adv:
        panels[1].set_xscale("symlog", linthresh=1.0)
        panels[1].set_xticks(list(levels), [f"{level:g}" for level in levels])
        panels[1].set_xlabel("eps (grey levels)")
        panels[1].set_ylabel(f"D_Adv at {feature_layer}")
        panels[1].set_title("mean ||f(x_a) - f(x_d)||^2 over originally correct samples", fontsize="medium")
    for panel in panels:
        panel.grid(alpha=0.3)
        panel.legend(fontsize="small")
    return figure


def classification_dimension_figure(
    ks: Sequence[int],
    accuracies: Sequence[float],
    eigenvalues: Sequence[float],
    *,
    cls_dim: int,
    ambient_dim: int,
    full_accuracy: float,
    threshold: float,
    centered: bool,
) -> Figure:
    """Accuracy of the head on top-k projections against k, beside the PCA spectrum (Feng et al. eq. 6, Table 2)."""
    figure = Figure(figsize=(12, 4.5))
    figure.subplots_adjust(left=0.07, right=0.98, top=0.86, bottom=0.12, wspace=0.22)
    accuracy_axes, spectrum_axes = figure.subplots(1, 2)
    how = "centred" if centered else "uncentred"
    figure.suptitle(f"classification dimension {cls_dim} / {ambient_dim} ({how} projection)")
    accuracy_axes.plot(list(ks), list(accuracies), marker=".", label="top-k projection")
    accuracy_axes.axhline(full_accuracy, color="black", lw=0.8, label="full accuracy")
    accuracy_axes.axhline(threshold * full_accuracy, color="gray", ls="--", lw=0.8, label=f"{threshold} x full")
    accuracy_axes.axvline(cls_dim, color="red", ls=":", label=f"cls_dim = {cls_dim}")
    accuracy_axes.set_xscale("log")
    accuracy_axes.set_xlabel("k (principal directions)")
    accuracy_axes.set_ylabel("accuracy of the model's head")
    accuracy_axes.legend(fontsize="small")
    accuracy_axes.grid(alpha=0.3)
    # Rounding leaves the null directions at tiny or negative values, which a log axis cannot show.
    positive = [(i + 1, v) for i, v in enumerate(eigenvalues) if v > 0]
    spectrum_axes.plot([i for i, _ in positive], [v for _, v in positive], marker=".")
    spectrum_axes.axvline(cls_dim, color="red", ls=":")
    spectrum_axes.set_yscale("log")
    spectrum_axes.set_xscale("log")
    spectrum_axes.set_xlabel("principal direction")
    spectrum_axes.set_ylabel("eigenvalue of the feature covariance")
    spectrum_axes.grid(alpha=0.3)
    return figure
