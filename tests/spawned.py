"""How spawned test workers end.

A spawned worker could abort at interpreter teardown after its work was done ("terminate called without an active
exception"): a native thread (gloo's, DeepSpeed's, transformers') was still joinable when the interpreter shut down.
The spawning test then failed at random although every rank had finished. Workers that succeed therefore leave by
``os._exit`` once their process group is gone; a worker that raises still ends the normal way, so that torch's
``spawn`` reports its traceback.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch.distributed as dist
from pytorch_lightning.strategies import DDPStrategy
from pytorch_lightning.strategies.launchers.multiprocessing import _MultiProcessingLauncher


def leave() -> None:
    """End a worker whose work is done: destroy its process group (if any), flush its output and exit at once."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class _LeavingLauncher(_MultiProcessingLauncher):
    def _wrapping_function(self, process_idx: int, *args: Any, **kwargs: Any) -> None:
        # Rank 0 has put its results on Lightning's SimpleQueue (a synchronous pipe write) when this returns.
        super()._wrapping_function(process_idx, *args, **kwargs)
        leave()


class SpawnedDDP(DDPStrategy):
    """``DDPStrategy(start_method="spawn")`` whose workers :func:`leave` once the trainer's function returns."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(start_method="spawn", **kwargs)

    def _configure_launcher(self) -> None:
        self._launcher = _LeavingLauncher(self, start_method=self._start_method)
