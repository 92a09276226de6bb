"""Per-rank body of the DDP test of NeuralCollapseStatistics (importable by spawned workers)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from rank_lightning.metrics import NeuralCollapseStatistics
from tests.spawned import leave


def mixture(n: int = 360, d: int = 10, classes: int = 4, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Gaussian class clusters, random logits and a random head weight, in float64."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(n) % classes
    centres = 3.0 * torch.randn(classes, d, generator=g, dtype=torch.float64)
    x = centres[labels] + torch.randn(n, d, generator=g, dtype=torch.float64)
    logits = torch.randn(n, classes, generator=g, dtype=torch.float64) + 2 * torch.nn.functional.one_hot(labels)
    return x, labels, logits, torch.randn(classes, d, generator=g, dtype=torch.float64)


def stream(rank: int, world: int, batch: int = 30, *, sync_on_compute: bool = True) -> dict[str, float]:
    """Both passes over this rank's share (every world-th batch), then the metrics."""
    x, y, logits, weight = mixture()
    metric = NeuralCollapseStatistics(num_classes=4, num_features=x.shape[1], sync_on_compute=sync_on_compute)
    shares = [(xb, yb, lb) for i, (xb, yb, lb) in enumerate(zip(x.split(batch), y.split(batch), logits.split(batch)))]
    mine = [part for i, part in enumerate(shares) if i % world == rank]
    for xb, yb, _ in mine:
        metric.update(xb.float(), yb)
    metric.start_second_pass()
    for xb, yb, lb in mine:
        metric.update(xb.float(), yb, lb)
    metric.head_weight = weight
    result = metric.compute()
    return {**result.as_dict(), "num_samples": float(result.num_samples)}


def ddp_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    """Entry point of one spawned rank: join a gloo group, stream, save the results."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.save(stream(rank, world), Path(out_dir) / f"rank{rank}.pt")
        torch.save(stream(rank, world, sync_on_compute=False), Path(out_dir) / f"local{rank}.pt")
    except BaseException:
        dist.destroy_process_group()
        raise
    leave()
