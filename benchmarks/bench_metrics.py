"""Streaming spectra (ActivationSpectrum) against collecting every activation and calling torch.linalg.svdvals.

For each case (N samples, d features) both methods see the same float32 activations, produced batch by batch from a
fixed rank-64 model plus 1e-6 noise (numerical rank 64):

* streaming: ``ActivationSpectrum().update(batch)`` per batch, then ``compute()`` (one float64 eigendecomposition and
  every metric: numerical, soft, participation, stable and effective rank, variance ratios);
* naive: copy every batch into a preallocated N x d buffer (the cheapest way to collect), then
  ``torch.linalg.svdvals`` and the numerical rank from those values (``matrix_rank`` would run a second SVD).

Time: wall-clock seconds spent in the method (batch generation excluded, identical for both); "final s/n" is the part
spent after the last batch (compute() / svdvals).
Peak memory: every (case, method) runs in a fresh subprocess; after imports and one warm-up batch the kernel's peak
RSS counter is reset (``/proc/self/clear_refs``), and the reported peak is ``VmHWM - VmRSS(at reset)``: every byte
the process touched, torch's allocator and LAPACK workspaces included (tracemalloc would miss them). Times are
medians and peaks maxima over the repeats. Ratios are streaming / naive: below 1 means faster or smaller.

Run::

    python benchmarks/bench_metrics.py            # N in {10k, 50k} x d in {512, 2048}, 3 alternating runs each
    python benchmarks/bench_metrics.py --quick    # N = 5k, d in {128, 512}, one run: a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

RANK = 64
TARGET = (50_000, 512)


def _proc_status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} missing from /proc/self/status")


def _batches(n: int, d: int, batch_size: int):
    g = torch.Generator().manual_seed(0)
    mixing = torch.randn(RANK, d, generator=g) / RANK**0.5
    for start in range(0, n, batch_size):
        b = min(batch_size, n - start)
        yield torch.randn(b, RANK, generator=g) @ mixing + 1e-6 * torch.randn(b, d, generator=g)


def _streaming(n: int, d: int, batch_size: int) -> tuple[float, float, int]:
    from rank_lightning.metrics import ActivationSpectrum

    metric = ActivationSpectrum()
    elapsed = 0.0
    for batch in _batches(n, d, batch_size):
        start = time.perf_counter()
        metric.update(batch)
        elapsed += time.perf_counter() - start
    start = time.perf_counter()
    rank = int(metric.compute().uncentered.numerical_rank)
    compute = time.perf_counter() - start
    return elapsed + compute, compute, rank


def _naive(n: int, d: int, batch_size: int) -> tuple[float, float, int]:
    buffer = torch.empty(n, d)
    elapsed, row = 0.0, 0
    for batch in _batches(n, d, batch_size):
        start = time.perf_counter()
        buffer[row : row + batch.shape[0]] = batch
        row += batch.shape[0]
        elapsed += time.perf_counter() - start
    start = time.perf_counter()
    s = torch.linalg.svdvals(buffer)
    rank = int((s >= torch.finfo(torch.float32).eps * min(n, d) * s[0]).sum())
    compute = time.perf_counter() - start
    return elapsed + compute, compute, rank


def _worker(method: str, n: int, d: int, batch_size: int) -> None:
    from rank_lightning.metrics import ActivationSpectrum

    # Warm up imports, the allocator and the BLAS threads outside the measurement.
    warm = ActivationSpectrum()
    warm.update(next(_batches(batch_size, d, batch_size)))
    warm.compute()
    del warm
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    baseline = _proc_status_kib("VmRSS")
    seconds, final, rank = (_streaming if method == "streaming" else _naive)(n, d, batch_size)
    peak = _proc_status_kib("VmHWM") - baseline
    print(json.dumps({"seconds": seconds, "final_seconds": final, "peak_mib": peak / 1024, "rank": rank}))


def _run_once(method: str, n: int, d: int, batch_size: int) -> dict[str, float]:
    cmd = [sys.executable, __file__, "--worker", method, str(n), str(d), "--batch-size", str(batch_size)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _run_case(n: int, d: int, batch_size: int, repeats: int) -> dict[str, dict[str, float]]:
    """Median time and largest peak of each method over ``repeats`` alternating runs."""
    runs: dict[str, list[dict[str, float]]] = {"streaming": [], "naive": []}
    for i in range(repeats):
        # Alternating the order spreads drifts in machine load evenly over both methods.
        for method in ("streaming", "naive") if i % 2 == 0 else ("naive", "streaming"):
            runs[method].append(_run_once(method, n, d, batch_size))
    return {
        method: {
            "seconds": statistics.median(r["seconds"] for r in results),
            "final_seconds": statistics.median(r["final_seconds"] for r in results),
            "peak_mib": max(r["peak_mib"] for r in results),
            "rank": results[0]["rank"],
        }
        for method, results in runs.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="N = 5k, d in {128, 512}: a smoke run")
    parser.add_argument("--batch-size", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs per case and method (median time)")
    parser.add_argument("--worker", nargs=3, metavar=("METHOD", "N", "D"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        method, n, d = args.worker
        _worker(method, int(n), int(d), args.batch_size)
        return

    cases = [(5_000, 128), (5_000, 512)] if args.quick else [(n, d) for n in (10_000, 50_000) for d in (512, 2048)]
    print(__doc__.split("Run::")[0].strip())
    repeats = 1 if args.quick else args.repeats
    print(
        f"\ntorch {torch.__version__}, {torch.get_num_threads()} threads, batch size {args.batch_size}, "
        f"median of {repeats} run(s), load average at start {os.getloadavg()[0]:.1f}\n"
    )
    header = (
        f"{'N':>7} {'d':>5} | {'stream s':>9} {'naive s':>9} {'time ratio':>10} {'final s/n':>11} | "
        f"{'stream MiB':>10} {'naive MiB':>10} {'mem ratio':>9} | {'rank s/n':>9}"
    )
    print(header)
    print("-" * len(header))
    for n, d in cases:
        results = _run_case(n, d, args.batch_size, repeats)
        stream, naive = results["streaming"], results["naive"]
        time_ratio = stream["seconds"] / naive["seconds"]
        mem_ratio = stream["peak_mib"] / max(naive["peak_mib"], 1e-9)
        print(
            f"{n:>7} {d:>5} | {stream['seconds']:>9.2f} {naive['seconds']:>9.2f} {time_ratio:>10.3f} "
            f"{stream['final_seconds']:>5.2f}/{naive['final_seconds']:<5.2f} | "
            f"{stream['peak_mib']:>10.1f} {naive['peak_mib']:>10.1f} {mem_ratio:>9.3f} | "
            f"{stream['rank']:>4}/{naive['rank']:<4}",
            flush=True,
        )
        if (n, d) == TARGET:
            ok = time_ratio <= 1.0 and mem_ratio <= 0.1
            print(f"{'':>15}target at N={n}, d={d}: memory <= 1/10 and time <= 1x naive: {'met' if ok else 'NOT met'}")


if __name__ == "__main__":
    main()
