"""Token batches of next-token classes and the per-rank body of the DDP test of NeuralCollapseStatistics on them
(importable by spawned workers)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from rank_lightning.metrics import NeuralCollapseStatistics
from tests.spawned import leave

VOCAB, WIDTH, LENGTH, BATCH = 9, 5, 7, 6


def token_batch(seed: int) -> tuple[torch.Tensor, ...]:
    """``(B, T, D)`` float64 tokens around their class centres, ``(B, T)`` labels (-100 at the last position and at
    padding), the ``(B, T)`` mask of right-padded sequences, ``(B, T, V)`` logits; padded positions hold NaN."""
    g = torch.Generator().manual_seed(seed)
    centres = 4.0 * torch.randn(VOCAB, WIDTH, generator=torch.Generator().manual_seed(99), dtype=torch.float64)
    # Unequal class frequencies, so that the most frequent classes are well defined.
    weights = torch.linspace(3.0, 0.3, VOCAB)
    labels = torch.multinomial(weights, BATCH * LENGTH, replacement=True, generator=g).view(BATCH, LENGTH)
    x = centres[labels] + torch.randn(BATCH, LENGTH, WIDTH, generator=g, dtype=torch.float64)
    mask = torch.arange(LENGTH)[None] < torch.randint(2, LENGTH + 1, (BATCH, 1), generator=g)
    labels[:, -1] = -100
    labels[~mask] = -100
    x[~mask] = float("nan")
    logits = torch.randn(BATCH, LENGTH, VOCAB, generator=g, dtype=torch.float64)
    return x, labels, mask, logits


def head_weight() -> torch.Tensor:
    return torch.randn(VOCAB, WIDTH, generator=torch.Generator().manual_seed(7), dtype=torch.float64)


def stream(seeds: list[int], top_classes: int | None = 3) -> NeuralCollapseStatistics:
    """Both passes over the token batches of ``seeds``; the metric, its head weight set."""
    metric = NeuralCollapseStatistics(VOCAB, WIDTH, top_classes=top_classes)
    for seed in seeds:
        x, y, mask, _ = token_batch(seed)
        metric.update(x, y, mask=mask)
    metric.start_second_pass()
    for seed in seeds:
        x, y, mask, logits = token_batch(seed)
        metric.update(x, y, logits, mask=mask)
    metric.head_weight = head_weight()
    return metric


def token_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    """Entry point of one spawned rank: join a gloo group, stream its three of six batches, save the results."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        metric = stream([seed for seed in range(6) if seed % world == rank])
        result = metric.compute()
        saved = {**result.as_dict(), "num_samples": result.num_samples, "selected": metric.selected_classes}
        torch.save(saved, Path(out_dir) / f"rank{rank}.pt")
    except BaseException:
        dist.destroy_process_group()
        raise
    leave()
