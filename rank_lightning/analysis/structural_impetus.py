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

    python -m rank_lightning.analysis.structural_impetus --channels 16 --size 8 --samples 2048 --seed 0
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from rank_lightning.functional.jacobian import partial_jacobian
from rank_lightning.functional.spectral import numerical_rank

__all__ = ["COMPONENTS", "ComponentRank", "build_component", "main", "structural_impetus", "to_markdown"]

COMPONENTS = ("linear", "conv3x3", "batchnorm", "layernorm", "groupnorm", "instancenorm", "relu", "gelu", "attention")
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


def structural_impetus(
    components: Sequence[str] = COMPONENTS,
    *,
    channels: int = 16,
    size: int = 8,
    num_samples: int = 2048,
    seed: int = 0,
    heads: int = 4,
    groups: int = 4,
    dtype: torch.dtype = torch.float32,
) -> list[ComponentRank]:
    """Feature and Jacobian ranks of ``fc`` and of ``component o fc`` on standard Gaussian inputs (Feng et al. Fig. 3).

    The inputs and the fully-connected layer are shared by all components, so the "before" ranks are computed once.

    Args:
        components: names from :data:`COMPONENTS`.
        channels: C of the ``(C, size, size)`` maps; the fully-connected layer has ``C * size^2`` units.
        size: spatial side of the maps.
        num_samples: N, the rows of the feature matrices (at least ``C * size^2`` for a full rank to be possible).
        seed: seeds inputs and weights.
        heads: attention heads.
        groups: GroupNorm groups.
        dtype: precision of the computation (the rank tolerance is the float32 one either way).

    Returns:
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

    rows = []
    for name in components:
        component = build_component(name, channels, size, heads=heads, groups=groups).to(dtype)

        def after(x: Tensor, component: nn.Module = component) -> Tensor:
            return component(before(x)).flatten(1)

        with torch.no_grad():
            component.train()  # BatchNorm: batch statistics, also stored as running statistics (momentum=None)
            features_after = after(inputs)
        component.eval()
        rows.append(
            ComponentRank(
                component=name,
                dim_before=dim,
                dim_after=features_after.shape[1],
                feature_rank_before=feature_rank_before,
                feature_rank_after=int(numerical_rank(features_after)),
                jacobian_rank_before=jacobian_rank_before,
                jacobian_rank_after=int(numerical_rank(partial_jacobian(after, inputs[0], all_coordinates))),
            )
        )
    return rows


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


def main(argv: Sequence[str] | None = None) -> list[ComponentRank]:
    """Command line entry point: measure the components and print a markdown table."""
    parser = argparse.ArgumentParser(
        prog="python -m rank_lightning.analysis.structural_impetus",
        description="Rank before and after common network components on Gaussian inputs (Feng et al. Fig. 3).",
    )
    parser.add_argument("--components", nargs="+", choices=COMPONENTS, default=list(COMPONENTS))
    parser.add_argument("--channels", type=int, default=16, help="channels C of the C x size x size maps (paper: 128)")
    parser.add_argument("--size", type=int, default=8, help="spatial side of the maps (paper: 8)")
    parser.add_argument("--samples", type=int, default=2048, help="samples N of the feature matrices (paper: 5000)")
    parser.add_argument("--heads", type=int, default=4, help="attention heads")
    parser.add_argument("--groups", type=int, default=4, help="GroupNorm groups")
    parser.add_argument("--dtype", choices=tuple(_DTYPES), default="float32")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    dim = args.channels * args.size**2
    if args.samples < dim:
        parser.error(f"--samples {args.samples} is below the feature width {dim}: the feature rank would be capped")
    if args.channels % args.heads or args.channels % args.groups:
        parser.error(f"--heads {args.heads} and --groups {args.groups} must divide --channels {args.channels}")

    start = time.perf_counter()
    rows = structural_impetus(
        args.components,
        channels=args.channels,
        size=args.size,
        num_samples=args.samples,
        seed=args.seed,
        heads=args.heads,
        groups=args.groups,
        dtype=_DTYPES[args.dtype],
    )
    print(
        f"Gaussian inputs -> FC({dim}) -> component; N = {args.samples} samples, maps "
        f"{args.channels} x {args.size} x {args.size}, {args.dtype}, seed {args.seed}; "
        f"tolerance finfo(float32).eps * min(N, d)\n"
    )
    print(to_markdown(rows))
    print(f"\n({time.perf_counter() - start:.1f} s)")
    return rows


if __name__ == "__main__":
    main()
