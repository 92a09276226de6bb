"""Data and the per-rank body of the DDP equality test.

Kept apart from the test module so that spawned workers import only torch and rank_lightning, not scikit-learn.
"""

from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from rank_lightning.metrics import ActivationSpectrum
from tests.spawned import leave

DDP_CONFIGS = {
    "gram": {"num_classes": 4, "center": "both", "num_features": 24},
    "sample_gram": {"num_classes": 4, "center": "both", "max_gram_features": 16, "max_samples": 512},
    # Float64 activations at 1e8 from the origin: each process's sums are taken around its own first batch's mean
    # and moved to a shared reference at the sync.
    "offset": {"num_classes": 4, "center": "both", "num_features": 24, "classwise_center": True},
}
OFFSETS = {"offset": 1e8}


def clustered_data(n: int = 600, d: int = 24, classes: int = 4, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Class clusters around random centres, spread in a 6-dimensional subspace, plus small isotropic noise."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, classes, (n,), generator=g)
    centres = 2.0 * torch.randn(classes, d, generator=g, dtype=torch.float64)
    basis = torch.randn(6, d, generator=g, dtype=torch.float64)
    x = centres[labels] + torch.randn(n, 6, generator=g, dtype=torch.float64) @ basis
    return x + 0.05 * torch.randn(n, d, generator=g, dtype=torch.float64), labels


def ddp_results(rank: int, world: int) -> dict[str, dict[str, float]]:
    """Every scalar and centred singular value of each configuration, from this rank's share of the batches."""
    x, y = clustered_data(n=480, d=24, seed=9)
    out = {}
    for name, kwargs in DDP_CONFIGS.items():
        metric = ActivationSpectrum(**kwargs)
        data = x + OFFSETS[name] if name in OFFSETS else x.float()
        # Rank r takes every world-th batch of 40, as a distributed sampler would.
        for i, (xb, yb) in enumerate(zip(data.split(40), y.split(40))):
            if i % world == rank:
                metric.update(xb, yb)
        result = metric.compute()
        values = result.as_dict()
        values["num_samples"] = float(result.num_samples)
        values.update({f"sv_{i}": float(v) for i, v in enumerate(result.centered.spectrum.singular_values)})
        out[name] = values
    return out


def _in_group(results: Callable[[int, int], object], rank: int, world: int, init_file: str, out_dir: str) -> None:
    """Join a gloo group, save ``results(rank, world)`` as ``rank<r>.pt`` in ``out_dir``, leave the group."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.save(results(rank, world), Path(out_dir) / f"rank{rank}.pt")
    except BaseException:
        dist.destroy_process_group()
        raise
    leave()


def ddp_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    """Entry point of one spawned rank: join a gloo group, compute, save the results."""
    _in_group(ddp_results, rank, world, init_file, out_dir)


# Settings that learn d from the first batch (no num_features), on every path.
IDLE_RANK_CONFIGS = {
    "gram": {"num_classes": 4, "center": "both"},
    "sample_gram": {"num_classes": 4, "center": "both", "max_gram_features": 16, "max_samples": 512},
    "sketch": {"num_classes": 4, "center": "both", "max_gram_features": 16, "max_samples": 64, "fallback": "sketch"},
}


def idle_rank_results(rank: int, world: int) -> dict[str, list[dict[str, float]]]:
    """Every scalar of each configuration when only rank 0 sees batches (the others never learn d), computed twice."""
    x, y = clustered_data(n=240, d=24, seed=5)
    out = {}
    for name, kwargs in IDLE_RANK_CONFIGS.items():
        metric = ActivationSpectrum(**kwargs)
        if rank == 0:
            for xb, yb in zip(x.float().split(40), y.split(40)):
                metric.update(xb, yb)
        out[name] = []
        for _ in range(2):
            result = metric.compute()
            out[name].append({**result.as_dict(), "num_samples": float(result.num_samples)})
            metric._computed = None  # compute again: a second sync after the first one was undone
    return out


def idle_rank_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    """Entry point of one spawned rank of the idle-rank test."""
    _in_group(idle_rank_results, rank, world, init_file, out_dir)
