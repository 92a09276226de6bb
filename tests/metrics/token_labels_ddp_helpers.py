"""Data and the per-rank body of the DDP test of labels per token.

Kept apart from the test module so that spawned workers import only torch and rank_lightning.
"""

from __future__ import annotations

import torch

from rank_lightning.metrics import ActivationSpectrum
from tests.metrics.ddp_helpers import _in_group

CLASSES, D = 3, 5


def token_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens (4, 6, D), next-token labels with -100 at the last position and at padding, and the attention mask."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, CLASSES, (4, 6), generator=g)
    x = 3.0 * torch.nn.functional.one_hot(labels, D).float() + torch.randn(4, 6, D, generator=g)
    mask = torch.arange(6)[None] < torch.tensor([[6], [4], [2], [5]])
    labels = labels.masked_fill(~mask, -100)
    labels[:, -1] = -100  # the last position has no next token
    labels[1, 0] = -100  # a prompt token left out of the loss
    return x, labels, mask


def token_results(rank: int, world: int) -> dict[str, object]:
    """Every scalar and the class counts from this rank's share (every world-th) of six batches."""
    metric = ActivationSpectrum(num_classes=CLASSES, reduction="token", center="both")
    for seed in range(rank, 6, world):
        x, y, m = token_batch(seed)
        metric.update(x, y, mask=m)
    result = metric.compute()
    return {"scalars": result.as_dict(), "counts": result.class_counts.tolist(), "rows": result.num_samples}


def token_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    """Entry point of one spawned rank: join a gloo group, compute, save the results."""
    _in_group(token_results, rank, world, init_file, out_dir)
