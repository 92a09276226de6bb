"""Structural impetus of rank loss: the rank before and after common network components (Feng et al. Fig. 3).

Feng et al. Sec. 4.3 ("Structural Impetus") feed standard Gaussian inputs through a fully-connected layer followed
by one randomly initialised component and measure, before and after the component,

* the feature rank: the numerical rank of the ``N x d`` matrix of features of ``N`` samples, and
* the Jacobian rank: the numerical rank of the Jacobian of the network up to that point at one input.

By their Theorem 3 a component whose output is invariant along some input direction loses rank. A normalisation
layer is invariant to a shift of each normalised group (one Jacobian direction and one feature dimension per group:
the output has zero mean) and, up to its epsilon, to a rescaling (a second Jacobian direction per group once
``epsilon / variance`` falls below the tolerance, as it does at the default sizes). Linear maps (dense, convolution,
attention) lose as many directions as their weights' numerical rank deficiency, and ReLU zeroes the Jacobian rows of
the inactive units. Paper sizes are 128 x 8 x 8
inputs, an 8,192-unit layer and 5,000 samples; the defaults here (16 x 8 x 8, 2,048 samples) run in about a minute on
two CPU cores.

Conventions: the fully-connected layer maps the flattened ``C * H * W`` input to ``C * H * W`` units, reshaped to
``(C, H, W)`` for the component. Ranks use :func:`~rank_lightning.functional.spectral.numerical_rank` with its default
tolerance ``finfo(float32).eps * min(N, d)`` on singular values (Feng et al. threshold PCA eigenvalues, the squared
singular values, instead). Weights of dense, convolution and attention layers keep PyTorch's random initialisation;
normalisation layers keep their default affine parameters (1, 0), which change no rank. BatchNorm computes the
features with the batch statistics (training mode) and the single-input Jacobian with running statistics equal to the
batch statistics (eval mode): per input it is then an affine map per channel.

Usage::

    python -m rank_lightning.analysis.structural_impetus --channels 16 --size 8 --samples 2048 --seed 0 --out DIR

prints the table and, with ``--out``, writes into ``DIR`` (created when missing; when it already holds files, into a
new ``DIR/run_<n>``: ``run_2`` for the second run, ``run_3`` for the third) ``structural_impetus.png`` (the figure,
drawn like Feng et al. Fig. 3: the feature dimension and the Jacobian rank before and after each component, side by
side), ``structural_impetus.csv`` (every number the figure shows) and ``structural_impetus.md`` (the table). On a
terminal a progress bar follows the components (``--quiet`` turns it off); a summary of what was written, and where,
closes the run.
"""

from __future__ import annotations

import argparse
import csv
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from matplotlib.figure import Figure
from torch import Tensor, nn

from rank_lightning.analysis.output import (
    at_least,
    fresh_directory,
    print_written,
    progress_bar,
    run_command,
    show_progress,
)
from rank_lightning.functional.jacobian import partial_jacobian
from rank_lightning.functional.spectral import default_rank_tolerance, numerical_rank
from rank_lightning.plotting import save_figure

__all__ = [
    "COMPONENTS",
    "COMPONENT_LABELS",
    "ComponentRank",
    "build_component",
    "iter_structural_impetus",
    "main",
    "structural_impetus",
    "structural_impetus_figure",
    "to_markdown",
    "write_results",
]

COMPONENTS = ("linear", "conv3x3", "batchnorm", "layernorm", "groupnorm", "instancenorm", "relu", "gelu", "attention")
# The components' names in the figure, in Feng et al.'s abbreviations where the paper has one.
COMPONENT_LABELS = {
    "linear": "FC",
    "conv3x3": "Conv\n3×3",
    "batchnorm": "BN",
    "layernorm": "LN",
    "groupnorm": "GN",
    "instancenorm": "IN",
    "relu": "ReLU",
    "gelu": "GELU",
    "attention": "Attention",
}
FILE_STEM = "structural_impetus"
_DTYPES = {"float32": torch.float32, "float64": torch.float64}


class _Flat(nn.Module):
    """Applies a layer of flat vectors to ``(B, C, H, W)`` images."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: Tensor) -> Tensor:
        return self.layer(x.flatten(1))


class _SelfAttention(nn.Module):
    """Multi-head self-attention over the ``H * W`` positions of a ``(B, C, H, W)`` map (C-dimensional tokens)."""

    def __init__(self, channels: int, heads: int) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(channels, heads, batch_first=True)

    def forward(self, x: Tensor) -> Tensor:
        tokens = x.flatten(2).transpose(1, 2)  # (B, H*W, C)
        return self.attention(tokens, tokens, tokens, need_weights=False)[0]


def build_component(name: str, channels: int, size: int, *, heads: int = 4, groups: int = 4) -> nn.Module:
    """One randomly initialised component acting on ``(B, channels, size, size)`` maps.

    Args:
        name: one of :data:`COMPONENTS`.
        channels: C.
        size: H = W.
        heads: attention heads (must divide ``channels``).
        groups: GroupNorm groups (must divide ``channels``).

    Returns:
        The component.
    """
    dim = channels * size * size
    factories = {
        "linear": lambda: _Flat(nn.Linear(dim, dim)),
        "conv3x3": lambda: nn.Conv2d(channels, channels, 3, padding=1),
        "batchnorm": lambda: nn.BatchNorm2d(channels, momentum=None),
        # Over all C x H x W features of a sample, as in a convolutional network.
        "layernorm": lambda: nn.LayerNorm([channels, size, size]),
        "groupnorm": lambda: nn.GroupNorm(groups, channels),
        "instancenorm": lambda: nn.InstanceNorm2d(channels, affine=True),
        "relu": nn.ReLU,
        "gelu": nn.GELU,
        "attention": lambda: _SelfAttention(channels, heads),
    }
    if name not in factories:
        raise ValueError(f"unknown component {name!r}; components are: {', '.join(COMPONENTS)}")
    return factories[name]()


@dataclass(frozen=True)
class ComponentRank:
    """Ranks before and after one component (Feng et al. Fig. 3)."""

    component: str
    dim_before: int
    dim_after: int
    feature_rank_before: int
    feature_rank_after: int
    jacobian_rank_before: int
    jacobian_rank_after: int


def iter_structural_impetus(
    components: Sequence[str] = COMPONENTS,
    *,
    channels: int = 16,
    size: int = 8,
    num_samples: int = 2048,
    seed: int = 0,
    heads: int = 4,
    groups: int = 4,
    dtype: torch.dtype = torch.float32,
) -> Iterator[ComponentRank]:
    """Feature and Jacobian ranks of ``fc`` and of ``component o fc`` on standard Gaussian inputs (Feng et al. Fig. 3).

    The inputs and the fully-connected layer are shared by all components, so the "before" ranks are computed once,
    before the first component. Each component's ranks are yielded as soon as they are measured (for progress);
    :func:`structural_impetus` collects them.

    Args:
        components: names from :data:`COMPONENTS`.
        channels: C of the ``(C, size, size)`` maps; the fully-connected layer has ``C * size^2`` units.
        size: spatial side of the maps.
        num_samples: N, the rows of the feature matrices (at least ``C * size^2`` for a full rank to be possible).
        seed: seeds inputs and weights.
        heads: attention heads.
        groups: GroupNorm groups.
        dtype: precision of the computation (the rank tolerance is the float32 one either way).

    Yields:
        One :class:`ComponentRank` per component, in the given order.
    """
    torch.manual_seed(seed)
    dim = channels * size * size
    fc = nn.Linear(dim, dim).to(dtype)
    inputs = torch.randn(num_samples, dim, dtype=dtype)
    all_coordinates = torch.arange(dim)

    def before(x: Tensor) -> Tensor:
        return fc(x).view(-1, channels, size, size)

    with torch.no_grad():
        feature_rank_before = int(numerical_rank(before(inputs).flatten(1)))
    jacobian_rank_before = int(
        numerical_rank(partial_jacobian(lambda x: before(x).flatten(1), inputs[0], all_coordinates))
    )

    for name in components:
        component = build_component(name, channels, size, heads=heads, groups=groups).to(dtype)

        def after(x: Tensor, component: nn.Module = component) -> Tensor:
            return component(before(x)).flatten(1)

        with torch.no_grad():
            component.train()  # BatchNorm: batch statistics, also stored as running statistics (momentum=None)
            features_after = after(inputs)
        component.eval()
        yield ComponentRank(
            component=name,
            dim_before=dim,
            dim_after=features_after.shape[1],
            feature_rank_before=feature_rank_before,
            feature_rank_after=int(numerical_rank(features_after)),
            jacobian_rank_before=jacobian_rank_before,
            jacobian_rank_after=int(numerical_rank(partial_jacobian(after, inputs[0], all_coordinates))),
        )


def structural_impetus(components: Sequence[str] = COMPONENTS, **settings: Any) -> list[ComponentRank]:
    """The measurements of :func:`iter_structural_impetus` (same keyword arguments) as a list, one row per
    component."""
    return list(iter_structural_impetus(components, **settings))


def to_markdown(rows: Sequence[ComponentRank]) -> str:
    """Markdown table of the measurements, one row per component."""
    lines = [
        "| component | dim | feature rank before | feature rank after | lost | Jacobian rank before "
        "| Jacobian rank after | lost |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        cells = [
            r.component,
            f"{r.dim_before} -> {r.dim_after}" if r.dim_after != r.dim_before else str(r.dim_before),
            str(r.feature_rank_before),
            str(r.feature_rank_after),
            str(r.feature_rank_before - r.feature_rank_after),
            str(r.jacobian_rank_before),
            str(r.jacobian_rank_after),
            str(r.jacobian_rank_before - r.jacobian_rank_after),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def structural_impetus_figure(rows: Sequence[ComponentRank], *, caption: str | None = None) -> Figure:
    """Feng et al. Fig. 3: per component, the rank before and after it, for the features and for the Jacobian.

    Two panels of paired bars, (a) the dimension of the feature space (numerical rank of the ``N x d`` features) and
    (b) the rank of the Jacobian; each "after" bar is labelled with the rank the component lost, which is small next
    to ``d`` for the normalisation layers. A dashed line marks the width ``d`` of the fully-connected layer.

    Args:
        rows: the measurements, one per component, in the order drawn.
        caption: a line under the panels (settings: N, sizes, tolerance).

    Returns:
        The figure (matplotlib's object API, no pyplot state).
    """
    figure = Figure(figsize=(12, 4.8), layout="constrained")
    positions = list(range(len(rows)))
    width = max(row.dim_before for row in rows)
    panels = (
        ("feature", "(a) PCA dimension of the feature space", "feature dimension (numerical rank)"),
        ("jacobian", "(b) Rank of the Jacobian matrix", "rank of the Jacobian"),
    )
    for axes, (kind, title, y_label) in zip(figure.subplots(1, 2), panels, strict=True):
        before = [getattr(row, f"{kind}_rank_before") for row in rows]
        after = [getattr(row, f"{kind}_rank_after") for row in rows]
        axes.bar([p - 0.2 for p in positions], before, 0.4, color="#1f5fa8", label="before: Gaussian input → FC")
        bars = axes.bar(
            [p + 0.2 for p in positions], after, 0.4, color="#e0701b", label="after: Gaussian input → FC → component"
        )
        axes.bar_label(
            bars, labels=[f"−{b - a}" if b > a else "0" for b, a in zip(before, after)], padding=2, fontsize=8
        )
        axes.axhline(width, color="0.35", linestyle="--", linewidth=1, zorder=0, label=f"FC width d = {width}")
        axes.set_xticks(positions, [COMPONENT_LABELS[row.component] for row in rows], fontsize=10)
        axes.set_ylim(0, 1.12 * width)
        axes.set_title(title, fontsize=12)
        axes.set_xlabel("component after the fully-connected layer", fontsize=11)
        axes.set_ylabel(y_label, fontsize=11)
    handles, labels = axes.get_legend_handles_labels()  # the same entries in both panels: one legend above them
    figure.legend(handles, labels, loc="outside upper center", ncols=3, fontsize=10, frameon=False)
    if caption:
        figure.supxlabel(caption, fontsize=9)
    return figure


def _csv_rows(rows: Sequence[ComponentRank]) -> list[dict[str, object]]:
    return [
        {
            "component": row.component,
            "label": COMPONENT_LABELS[row.component],
            **asdict(row),
            "feature_rank_lost": row.feature_rank_before - row.feature_rank_after,
            "jacobian_rank_lost": row.jacobian_rank_before - row.jacobian_rank_after,
        }
        for row in rows
    ]


def write_results(rows: Sequence[ComponentRank], directory: str | Path, *, settings: str) -> list[Path]:
    """Write the figure, the numbers it shows and the table into ``directory``.

    Args:
        rows: the measurements.
        directory: the folder, created if missing.
        settings: one line of settings, the figure's caption and the table's heading.

    Returns:
        The paths of ``structural_impetus.png``, ``.csv`` (one row per component: its ranks before and after, the
        ranks lost, the widths) and ``.md``.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    figure = save_figure(structural_impetus_figure(rows, caption=settings), directory / f"{FILE_STEM}.png", dpi=150)
    table = directory / f"{FILE_STEM}.csv"
    with table.open("w", newline="") as file:
        records = _csv_rows(rows)
        writer = csv.DictWriter(file, fieldnames=list(records[0]))
        writer.writeheader()
        writer.writerows(records)
    markdown = directory / f"{FILE_STEM}.md"
    markdown.write_text(f"{settings}\n\n{to_markdown(rows)}\n")
    return [figure, table, markdown]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m rank_lightning.analysis.structural_impetus",
        description="Rank before and after common network components on Gaussian inputs (Feng et al. Fig. 3).",
    )
    parser.add_argument("--components", nargs="+", choices=COMPONENTS, default=list(COMPONENTS))
    parser.add_argument(
        "--channels", type=at_least(1), default=16, help="channels C of the C x size x size maps (paper: 128)"
    )
    parser.add_argument("--size", type=at_least(1), default=8, help="spatial side of the maps (paper: 8)")
    parser.add_argument(
        "--samples", type=at_least(1), default=2048, help="samples N of the feature matrices (paper: 5000)"
    )
    parser.add_argument("--heads", type=at_least(1), default=4, help="attention heads")
    parser.add_argument("--groups", type=at_least(1), default=4, help="GroupNorm groups")
    parser.add_argument("--dtype", choices=tuple(_DTYPES), default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out",
        metavar="DIR",
        help="folder for the figure, its numbers (CSV) and the table (a new DIR/run_<n> when it already holds files)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar (none is drawn outside a terminal)")
    return parser


def main(argv: Sequence[str] | None = None) -> list[ComponentRank]:
    """Command line entry point: measure the components, print a markdown table and, with ``--out``, write files."""
    parser = _parser()
    args = parser.parse_args(argv)
    dim = args.channels * args.size**2
    if args.samples < dim:
        parser.error(f"--samples {args.samples} is below the feature width {dim}: the feature rank would be capped")
    if args.channels % args.heads or args.channels % args.groups:
        parser.error(f"--heads {args.heads} and --groups {args.groups} must divide --channels {args.channels}")
    try:
        out_dir = None if args.out is None else fresh_directory(args.out)
    except NotADirectoryError as error:
        parser.error(str(error))

    start = time.perf_counter()
    measurements = iter_structural_impetus(
        args.components,
        channels=args.channels,
        size=args.size,
        num_samples=args.samples,
        seed=args.seed,
        heads=args.heads,
        groups=args.groups,
        dtype=_DTYPES[args.dtype],
    )
    with progress_bar(show_progress(args.quiet)) as progress:
        total = len(args.components)
        rows = list(progress.track(measurements, total=total, description="measuring components"))
    settings = (
        f"Gaussian inputs -> FC({dim}) -> component; N = {args.samples} samples, maps "
        f"{args.channels} x {args.size} x {args.size}, {args.dtype}, seed {args.seed}; "
        f"tolerance finfo(float32).eps * min(N, d) = {default_rank_tolerance(args.samples, dim):.2g}"
    )
    print(f"{settings}\n")
    print(to_markdown(rows))
    print(f"\n{len(rows)} component(s) in {time.perf_counter() - start:.1f} s")
    if out_dir is not None:
        print_written(out_dir, {"files": write_results(rows, out_dir, settings=settings)}, requested=args.out)
    return rows


if __name__ == "__main__":
    run_command(main)
