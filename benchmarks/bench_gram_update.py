"""The CPU float64 kernels of activation monitoring, SciPy's BLAS/LAPACK against torch's, side by side in one run.

1. The per-batch Gram update ``tril(G) += tril(Y Y^T)`` (``functional.streaming._add_product``): SciPy's ``dsyrk``
   on one thread (the symmetric rank-k update, the lower triangle alone), the default on a CPU where torch runs on at
   most ``SCIPY_MAX_TORCH_THREADS`` threads, against torch's product in four row blocks (the blocks on and below the
   diagonal, 5/8 of the full product's work) on torch's threads, the path taken on more threads, without SciPy's own
   OpenBLAS and for float32 products. Shapes are those of the monitors: the channel rows of ResNet-18's stages
   (100 inputs of 32x32 x 64 channels down to 4x4 x 512), one class's share of them, and small MLP batches.
2. The class-wise variance ratio ``VR_1`` of ten class Grams (``classwise_variance_ratio_from_grams``): the leading
   eigenvalue of each by LAPACK's selected-eigenvalue solver and the trace (``gram_variance_ratios``) against every
   eigenvalue by torch's batched ``eigvalsh``.

Both are run on one thread and on torch's default thread count; the medians of ``--repeats`` timed calls are
compared, with the largest difference between the two results (relative to the largest entry or value).

Run::

    python benchmarks/bench_gram_update.py
    python benchmarks/bench_gram_update.py --repeats 50
"""

from __future__ import annotations

import os

# Spinning OpenMP threads slow every small CPU op many-fold as soon as another process holds a core (as in train.py).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from rank_lightning.functional.spectral import SCIPY_BLAS
from rank_lightning.functional.streaming import _add_product, classwise_variance_ratio_from_grams

# (rows, features): ResNet-18 stage outputs of 100 CIFAR inputs as channel rows, one class's share, MLP batches.
UPDATE_SHAPES = [(102_400, 64), (25_600, 128), (6_400, 256), (1_600, 512), (160, 512), (640, 256), (64, 128)]
# From 128 features on (below, the package keeps torch's eigvalsh: both columns would time the same call).
EIGEN_SIZES = [128, 256, 512]


def _median_ms(function: Callable[[], object], repeats: int) -> float:
    function()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def _without_scipy(function: Callable[[], object]) -> Callable[[], object]:
    """``function`` with SciPy's BLAS hidden, so that the package takes torch's path."""

    def run() -> object:
        libraries, SCIPY_BLAS.libraries = SCIPY_BLAS.libraries, []
        try:
            return function()
        finally:
            SCIPY_BLAS.libraries = libraries

    return run


def _updates(repeats: int) -> None:
    print(f"\nGram update tril(G) += tril(Y Y^T), float64, {torch.get_num_threads()} thread(s), medians in ms:")
    print(f"  {'rows':>8} {'d':>5} {'torch blocks':>13} {'scipy dsyrk':>12} {'speed-up':>9} {'max rel diff':>13}")
    generator = torch.Generator().manual_seed(0)
    for rows, features in UPDATE_SHAPES:
        columns = torch.randn(features, rows, generator=generator, dtype=torch.float64)  # channel-major, as the blocks
        grams = {name: torch.zeros(features, features, dtype=torch.float64) for name in ("torch", "scipy")}
        timed = {
            "torch": _without_scipy(lambda g=grams["torch"], y=columns: _add_product(g, y)),
            "scipy": lambda g=grams["scipy"], y=columns: _add_product(g, y),
        }
        ms = {name: _median_ms(function, repeats) for name, function in timed.items()}
        lower = {name: gram.tril() / (repeats + 1) for name, gram in grams.items()}
        diff = float((lower["torch"] - lower["scipy"]).abs().max() / lower["torch"].abs().max())
        speedup = ms["torch"] / ms["scipy"]
        print(f"  {rows:>8} {features:>5} {ms['torch']:>13.3f} {ms['scipy']:>12.3f} {speedup:>8.2f}x {diff:>13.1e}")


def _classwise(repeats: int) -> None:
    print(f"\nClass-wise VR_1 of ten class Grams, {torch.get_num_threads()} thread(s), medians in ms:")
    print(f"  {'d':>5} {'eigvalsh (all)':>15} {'leading + trace':>16} {'speed-up':>9} {'max rel diff':>13}")
    generator = torch.Generator().manual_seed(1)
    for features in EIGEN_SIZES:
        rows = torch.randn(10, 4 * features, features, generator=generator, dtype=torch.float64)
        grams = rows.mT @ rows
        counts = torch.full((10,), 4 * features)
        timed = {
            "all": _without_scipy(lambda g=grams, n=counts: classwise_variance_ratio_from_grams(g, n)),
            "leading": lambda g=grams, n=counts: classwise_variance_ratio_from_grams(g, n),
        }
        ms = {name: _median_ms(function, repeats) for name, function in timed.items()}
        values = {name: function() for name, function in timed.items()}
        diff = float(((values["all"] - values["leading"]) / values["all"]).abs().max())
        speedup = ms["all"] / ms["leading"]
        print(f"  {features:>5} {ms['all']:>15.2f} {ms['leading']:>16.2f} {speedup:>8.2f}x {diff:>13.1e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per case (median)")
    args = parser.parse_args()
    if not SCIPY_BLAS.available:
        raise SystemExit("SciPy's BLAS is not its own OpenBLAS here: the package uses torch's kernels only")
    default_threads = torch.get_num_threads()
    print(f"torch {torch.__version__}; SciPy's OpenBLAS: {', '.join(lib.filepath for lib in SCIPY_BLAS.libraries)}")
    for threads in sorted({1, default_threads}):
        torch.set_num_threads(threads)
        _updates(args.repeats)
        _classwise(max(3, args.repeats // 4))
    torch.set_num_threads(default_threads)


if __name__ == "__main__":
    main()
