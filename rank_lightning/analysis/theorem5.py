"""Rank decay of a deep linear MLP with Gaussian weights against Feng et al. Theorem 5 (Fig. 1 d-f).

The network is ``L`` bias-free dense layers of width ``n`` with i.i.d. Gaussian weights, fed with standard Gaussian
inputs (Feng et al.: MLP-50 of width 1,000; defaults here: width 128, depth 50). For each layer ``l`` it measures

* the Jacobian rank: the numerical rank of ``J_l = W_l ... W_1`` (input to layer ``l``; the network is linear, so
  ``J_l`` does not depend on the input and its rows come from pushing the identity matrix through the layers), and
* the feature rank: the numerical rank of the ``N x n`` features of ``N`` Gaussian inputs at layer ``l``,

and prints them beside Theorem 5's prediction ``#{k : exp(l (psi((n-k+1)/2) - psi(n/2)) / 2) >= eps}``
(:func:`~rank_lightning.functional.theory.gaussian_product_numerical_rank`), together with the measured and predicted
per-layer rates ``(1 / L) log(s_k / s_1)`` at the last layer, and saves a figure.

Weights are ``N(0, 1 / n)``: a constant multiple of the standard Gaussian of the theorem, which changes no ratio
``s_k / s_1`` and hence no rank, and keeps ``s_1`` of order one at any depth (with unit variance it grows like
``exp(1.2 L)`` at ``n = 128`` and float32 overflows beyond about 35 layers).

Precision and tolerance. The rank depends on the tolerance far more than on the precision of the products. The
tolerance is the float32 one, ``eps = finfo(float32).eps * n`` (Feng et al. Sec. 4.3: the accuracy float32 data can
resolve; about 1.5e-5 at ``n = 128``), whatever the precision of the computation. The products are computed in float64
by default, whose rounding floor (about ``1e-16 s_1``) lies eleven orders of magnitude below that tolerance, so the
measured rank counts true singular values; ``--dtype float32`` puts the floor (about ``1e-7 s_1``, growing slowly
with depth) two orders below it. Taking the tolerance from float64 instead, ``finfo(float64).eps * n``, moves the
threshold from ``log(eps) = -11`` to ``-31`` and roughly doubles the rank at depth 50; the table shows that variant
(measured in the float64 products, and predicted) as well. Theorem 5 is a limit: at finite depth ``log s_1`` carries
an O(1) excess over ``L`` times its rate, so the measured rates ``(1 / L) log(s_k / s_1)`` sit below the prediction by
O(1 / L) and the measured ranks a few units below the predicted ones.

Usage::

    python -m rank_lightning.analysis.theorem5 --width 128 --depth 50 --seeds 3 --out runs/theorem5.png

The figure goes to ``--out`` (default ``theorem5.png``), whose folder is created when missing, or, when that file
already exists, to a new ``<stem>_<n>.png`` beside it (``runs/theorem5_2.png``, then ``_3``, ...), so a second run
never overwrites the first one's figure. On a terminal a progress bar follows the layers of each network
(``--quiet``, or output to a file or pipe, turns it off); the closing lines say how long it took and where the
figure was written.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from rank_lightning.analysis.output import at_least, fresh_file, print_written, progress_bar, run_command, show_progress
from rank_lightning.functional.spectral import default_rank_tolerance, numerical_rank, spectrum
from rank_lightning.functional.theory import gaussian_product_log_singular_ratio, gaussian_product_numerical_rank

__all__ = ["LayerRanks", "deep_linear_mlp", "main", "plot", "rate_table", "theorem5_ranks", "to_markdown"]

_DTYPES = {"float32": torch.float32, "float64": torch.float64}


def deep_linear_mlp(width: int, depth: int, *, seed: int = 0, dtype: torch.dtype = torch.float64) -> nn.Sequential:
    """``depth`` bias-free ``width x width`` dense layers with i.i.d. ``N(0, 1 / width)`` weights.

    Args:
        width: n.
        depth: L.
        seed: seeds the weights.
        dtype: parameter dtype.

    Returns:
        The network as an ``nn.Sequential`` of ``nn.Linear`` layers.
    """
    generator = torch.Generator().manual_seed(seed)
    layers = []
    for _ in range(depth):
        layer = nn.Linear(width, width, bias=False, dtype=dtype)
        with torch.no_grad():
            layer.weight.copy_(torch.randn(width, width, generator=generator, dtype=dtype) / math.sqrt(width))
        layers.append(layer)
    return nn.Sequential(*layers)


@dataclass(frozen=True)
class LayerRanks:
    """Measured ranks at one depth (averaged over seeds) and Theorem 5's prediction.

    The ``_eps64`` fields use the float64 tolerance ``finfo(float64).eps * n`` instead of the float32 one.
    """

    layer: int
    jacobian_rank: float
    feature_rank: float
    predicted_rank: int
    jacobian_rank_eps64: float
    predicted_rank_eps64: int


def theorem5_ranks(
    width: int = 128,
    depth: int = 50,
    *,
    num_samples: int | None = None,
    seeds: Sequence[int] = (0, 1, 2),
    dtype: torch.dtype = torch.float64,
    rank_tolerance: float | None = None,
    on_layer: Callable[[], None] | None = None,
) -> tuple[list[LayerRanks], Tensor]:
    """Jacobian and feature ranks of a deep linear Gaussian MLP, layer by layer, beside Feng et al. Theorem 5.

    Args:
        width: n.
        depth: L.
        num_samples: N Gaussian inputs for the features; ``None`` takes ``2 n``.
        seeds: one network and input set per seed; ranks are averaged over them.
        dtype: precision of the forward passes.
        rank_tolerance: rank tolerance ``eps``; ``None`` takes ``finfo(float32).eps * n``. The ``_eps64`` results
            always use ``finfo(float64).eps * n``.
        on_layer: called after each layer of each seed's network is measured (``len(seeds) * depth`` calls; e.g. to
            advance a progress bar).

    Returns:
        The per-layer ranks, and the measured rates ``(1 / L) log(s_k / s_1)`` of ``J_L`` averaged over seeds
        (float64, length n).
    """
    if width < 1 or depth < 1 or not seeds:
        raise ValueError(f"width and depth must be positive and seeds non-empty, got {width}, {depth}, {seeds}")
    num_samples = 2 * width if num_samples is None else num_samples
    eps = default_rank_tolerance(width, width) if rank_tolerance is None else rank_tolerance
    eps64 = float(torch.finfo(torch.float64).eps) * width
    jacobian = torch.zeros(len(seeds), depth)
    jacobian_eps64 = torch.zeros(len(seeds), depth)
    features = torch.zeros(len(seeds), depth)
    rates = torch.zeros(width, dtype=torch.float64)
    for row, seed in enumerate(seeds):
        model = deep_linear_mlp(width, depth, seed=seed, dtype=dtype)
        generator = torch.Generator().manual_seed(10_000 + seed)
        h = torch.randn(num_samples, width, generator=generator, dtype=dtype)  # (N, n) features of layer 0
        j = torch.eye(width, dtype=dtype)  # (n, n) rows of J_l^T: a linear layer applied to the identity
        with torch.no_grad():
            for index, layer in enumerate(model):
                h, j = layer(h), layer(j)
                jacobian_spectrum = spectrum(j)
                jacobian[row, index] = float(numerical_rank(jacobian_spectrum, rank_tolerance=eps))
                jacobian_eps64[row, index] = float(numerical_rank(jacobian_spectrum, rank_tolerance=eps64))
                features[row, index] = float(numerical_rank(h, rank_tolerance=eps))
                if on_layer is not None:
                    on_layer()
        s = jacobian_spectrum.singular_values
        rates += (s / s[0]).log() / depth / len(seeds)
    rows = [
        LayerRanks(
            layer=index + 1,
            jacobian_rank=float(jacobian[:, index].mean()),
            feature_rank=float(features[:, index].mean()),
            predicted_rank=gaussian_product_numerical_rank(width, index + 1, rank_tolerance=eps),
            jacobian_rank_eps64=float(jacobian_eps64[:, index].mean()),
            predicted_rank_eps64=gaussian_product_numerical_rank(width, index + 1, rank_tolerance=eps64),
        )
        for index in range(depth)
    ]
    return rows, rates


def to_markdown(rows: Sequence[LayerRanks]) -> str:
    """Markdown table: layer, measured Jacobian and feature ranks, predicted rank (and the float64-tolerance pair)."""
    lines = [
        "| layer | Jacobian rank | feature rank | Theorem 5 | Jacobian rank, float64 eps | Theorem 5, float64 eps |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r.layer} | {r.jacobian_rank:.1f} | {r.feature_rank:.1f} | {r.predicted_rank} "
        f"| {r.jacobian_rank_eps64:.1f} | {r.predicted_rank_eps64} |"
        for r in rows
    ]
    return "\n".join(lines)


def rate_table(rates: Tensor, depth: int, dtype: torch.dtype = torch.float64) -> str:
    """Markdown table of measured and predicted ``(1 / L) log(s_k / s_1)`` at the last layer.

    Only ``k`` whose predicted ratio ``s_k / s_1`` stays above ``1e4`` times the rounding unit of ``dtype`` (the
    precision of the products) are listed; smaller ratios are not resolved.
    """
    width = rates.shape[0]
    resolved = math.log(float(torch.finfo(dtype).eps) * 1e4)
    predicted = gaussian_product_log_singular_ratio(width)
    ks = sorted({2, *(max(2, round(width * q)) for q in (0.125, 0.25, 0.375, 0.5, 0.625, 0.75))})
    lines = ["| k | measured | Theorem 5 | difference |", "|---:|---:|---:|---:|"]
    for k in ks:
        if predicted[k - 1] * depth < resolved:
            continue
        measured, expected = float(rates[k - 1]), float(predicted[k - 1])
        lines.append(f"| {k} | {measured:.4f} | {expected:.4f} | {measured - expected:+.4f} |")
    return "\n".join(lines)


def plot(rows: Sequence[LayerRanks], path: str | Path, *, title: str) -> None:
    """Save ranks against depth (log scale: exponential decay is a straight line); the folder is created if missing."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = [r.layer for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(layers, [r.jacobian_rank for r in rows], "o-", ms=3, label="Jacobian rank (measured)")
    ax.plot(layers, [r.feature_rank for r in rows], "s-", ms=3, label="feature rank (measured)")
    ax.plot(layers, [r.predicted_rank for r in rows], "k--", label="Theorem 5")
    ax.set_yscale("log")
    ax.set_xlabel("layer")
    ax.set_ylabel("numerical rank")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> list[LayerRanks]:
    """Command line entry point: print the tables and save the figure."""
    parser = argparse.ArgumentParser(
        prog="python -m rank_lightning.analysis.theorem5",
        description="Rank decay of a deep linear Gaussian MLP against Feng et al. Theorem 5.",
    )
    parser.add_argument("--width", type=at_least(2), default=128, help="layer width n (paper: 1000)")
    parser.add_argument("--depth", type=at_least(1), default=50, help="number of layers L (paper: 50)")
    parser.add_argument(
        "--samples", type=at_least(1), default=None, help="Gaussian inputs N for the features (default 2n)"
    )
    parser.add_argument("--seeds", type=at_least(1), default=3, help="number of random networks averaged (paper: 3)")
    parser.add_argument("--dtype", choices=tuple(_DTYPES), default="float64", help="precision of the products")
    parser.add_argument(
        "--out",
        default="theorem5.png",
        help="path of the figure; its folder is created, and an existing file is kept (a new <stem>_<n>.png beside it)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar (none is drawn outside a terminal)")
    args = parser.parse_args(argv)
    try:
        figure = fresh_file(args.out)
    except OSError as error:
        parser.error(str(error))

    start = time.perf_counter()
    with progress_bar(show_progress(args.quiet)) as progress:
        task = progress.add_task(f"measuring {args.seeds} network(s)", total=args.seeds * args.depth)
        rows, rates = theorem5_ranks(
            args.width,
            args.depth,
            num_samples=args.samples,
            seeds=range(args.seeds),
            dtype=_DTYPES[args.dtype],
            on_layer=lambda: progress.advance(task),
        )
    eps = default_rank_tolerance(args.width, args.width)
    print(
        f"Deep linear MLP: width {args.width}, depth {args.depth}, N(0, 1/n) weights, {args.seeds} seeds, "
        f"{args.dtype} products; tolerance eps = finfo(float32).eps * n = {eps:.3g}\n"
    )
    print(to_markdown(rows))
    print(f"\nPer-layer rate (1/L) log(s_k / s_1) of the Jacobian at L = {args.depth} (mean over seeds):\n")
    print(rate_table(rates, args.depth, _DTYPES[args.dtype]))
    plot(rows, figure, title=f"MLP-{args.depth}, width {args.width}, {args.dtype}")
    print(f"\n{args.seeds} network(s) of {args.depth} layers in {time.perf_counter() - start:.1f} s")
    print_written(figure.absolute().parent, {"figure": [figure.absolute()]}, requested=Path(args.out).absolute())
    return rows


if __name__ == "__main__":
    run_command(main)
