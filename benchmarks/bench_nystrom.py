"""Ensemble Nyström rank-k projection against the exact eigh projection (Sanyal et al. Sec. 3.3).

The test matrix resembles an LR-Layer weight between two projections: a PSD matrix ``W = A A^T + sigma I`` whose
``k`` leading eigenvalues fall from about 1 to 0.5, followed by ``k`` more at about 0.05^2 and a floor ``sigma = 1e-3``
(``A`` is Gaussian, m x 2k, with scaled columns). Both projections run in float32, the dtype of the layer's weight.

Printed per size: the time of the exact projection (one call: a full eigendecomposition, O(m^3)), of one Nyström run
(``l = 2k`` columns, median of ``--repeats`` calls) and of a ``--runs``-run ensemble; the time ratios; the relative
Frobenius distance of each Nyström result to the exact projection; and the residual ratio
``||W - Nyström|| / ||W - exact||`` (1 is optimal). Sanyal et al.'s sizes are m = 16,384, k = 1000 (before ResNet-18's
last block) and m = 512, k = 50 (before the last FC layer); the exact eigh of the large size takes minutes on two cores.

Usage::

    python benchmarks/bench_nystrom.py            # m = 16384, k = 1000 and m = 512, k = 50
    python benchmarks/bench_nystrom.py --quick    # m = 4096, k = 250 and m = 512, k = 50

On a machine shared with other busy processes, ``--threads 1`` avoids the stalls of oversubscribed BLAS threads.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch

from rank_lightning.functional import exact_projection, nystrom_projection


def test_matrix(m: int, k: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    scales = torch.cat([torch.linspace(1.0, 0.5, k).sqrt(), torch.full((k,), 0.05)])
    a = torch.randn(m, 2 * k, generator=generator) / m**0.5 * scales
    w = a @ a.T
    w.diagonal().add_(1e-3)
    return w


def timed(function: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, float]:
    start = time.perf_counter()
    result = function()
    return result, time.perf_counter() - start


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.linalg.matrix_norm(a - b) / torch.linalg.matrix_norm(b))


def bench(m: int, k: int, runs: int, repeats: int, seed: int) -> None:
    w = test_matrix(m, k, seed)
    nystrom_projection(w[:64, :64].contiguous(), 8)  # warm-up of the linear-algebra kernels
    exact, exact_time = timed(lambda: exact_projection(w, k))
    single_times, ensemble_times = [], []
    for repeat in range(repeats):
        single, seconds = timed(lambda r=repeat: nystrom_projection(w, k, generator=torch.Generator().manual_seed(r)))
        single_times.append(seconds)
    for repeat in range(repeats):
        ensemble, seconds = timed(
            lambda r=repeat: nystrom_projection(w, k, num_runs=runs, generator=torch.Generator().manual_seed(r))
        )
        ensemble_times.append(seconds)
    single_time, ensemble_time = statistics.median(single_times), statistics.median(ensemble_times)
    exact_residual = torch.linalg.matrix_norm(w - exact)
    print(f"m = {m}, k = {k}, l = {2 * k}")
    print(f"  exact eigh projection       {exact_time:10.3f} s")
    print(
        f"  Nystrom, 1 run              {single_time:10.3f} s   speed-up {exact_time / single_time:7.1f}x   "
        f"rel. distance to exact {relative(single, exact):.4f}   "
        f"residual ratio {float(torch.linalg.matrix_norm(w - single) / exact_residual):.4f}"
    )
    print(
        f"  Nystrom, {runs} runs ensemble    {ensemble_time:10.3f} s   speed-up {exact_time / ensemble_time:7.1f}x   "
        f"rel. distance to exact {relative(ensemble, exact):.4f}   "
        f"residual ratio {float(torch.linalg.matrix_norm(w - ensemble) / exact_residual):.4f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="m = 4096, k = 250 instead of m = 16384, k = 1000")
    parser.add_argument("--runs", type=int, default=3, help="Nystrom runs of the ensemble")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per Nystrom variant (median reported)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    sizes = [(4096, 250) if args.quick else (16384, 1000), (512, 50)]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average {load:.1f}, float32")
    for m, k in sizes:
        bench(m, k, args.runs, args.repeats, args.seed)


if __name__ == "__main__":
    main()
