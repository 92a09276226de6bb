"""The worker of the two-process test of a block applied another number of times on each process (spawned processes
import this module, not the test module, which imports ``transformers``)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn

from rank_lightning.layers import BatchReader
from rank_lightning.streams import ActivationStream
from tests.spawned import leave

FEATURES = 6


class LoopedBlock(nn.Module):
    """One residual block applied ``loops`` times."""

    def __init__(self, loops: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.block = nn.Sequential(nn.Linear(FEATURES, FEATURES), nn.Tanh())
        self.loops = loops

    def forward(self, x: Tensor) -> Tensor:
        for _ in range(self.loops):
            x = x + self.block(x)
        return x


def halves() -> list[list[Tensor]]:
    """Two batches of 8 rows, each split into the halves of the two processes."""
    x = torch.rand(16, FEATURES, generator=torch.Generator().manual_seed(1))
    return [[batch[rank::2] for rank in (0, 1)] for batch in x.split(8)]


def ddp_worker(rank: int, port: int, out: str) -> None:
    """Two processes stream the block looped 3 times (rank 0) and 2 times (rank 1); each writes what it computed."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    model = LoopedBlock(loops=3 - rank)
    warned: list[str] = []
    stream = ActivationStream(
        {"block": "block"}, num_classes=None, reductions={}, spectrum_options={}, batch_reader=BatchReader(),
        repeated_calls="each", warn=lambda layer, kind, message: warned.append(f"{layer}: {message}"),
    )  # fmt: skip
    stream.start(model, world_size=2, rank=rank)
    with torch.no_grad():
        for parts in halves():
            stream.batch_start(parts[rank])
            model(parts[rank])
            stream.batch_end()
    values, inputs = stream.compute("cpu", metrics=("effective_rank",), centered=False, per_class=False)
    Path(out, f"{rank}.json").write_text(json.dumps({"values": values, "inputs": inputs, "warned": warned}))
    leave()
