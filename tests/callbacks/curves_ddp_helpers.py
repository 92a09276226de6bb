"""Model, callbacks and run of the DDP test of :func:`~rank_lightning.callbacks.curves.log_rank_equal`.

Run as ``python -m tests.callbacks.curves_ddp_helpers ROOT``: Lightning's ``ddp`` strategy starts the second process
by running the same command, and each process leaves by ``os._exit`` once its files are written. A spawned worker
(``ddp_spawn``) could abort at interpreter teardown after its work was done ("terminate called without an active
exception" from a native thread of the process group), which failed the test at random.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from datetime import timedelta
from pathlib import Path

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from pytorch_lightning.strategies import DDPStrategy

from rank_lightning.callbacks import AdversarialValidation, ClassificationDimension
from rank_lightning.callbacks.curves import LayerCurves
from tests.callbacks.feng_helpers import SHAPE, TinyNet

WORLD_SIZE = 2
ADVICE = "It is recommended to use `self.log("


class ProbedNet(TinyNet):
    """``TinyNet`` that also logs ``val/probe`` without ``sync_dist``: Lightning must advise reducing it."""

    def validation_step(self, batch, batch_idx):
        self.log("val/probe", F.cross_entropy(self(batch[0]), batch[1]))


class EqualCurves(pl.Callback):
    """Logs per-layer values that are equal on every process through :class:`LayerCurves`."""

    def __init__(self) -> None:
        self.curves = LayerCurves("test")

    def on_validation_epoch_end(self, trainer, pl_module):
        epoch = trainer.current_epoch
        self.curves.record_and_log(trainer, pl_module, {"first": {"m": 1.0 + epoch}, "second": {"m": 2.0 + epoch}})


class WarningLog(pl.Callback):
    """Writes the text of every warning a process emits between ``setup`` and ``teardown`` to a JSON file."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def setup(self, trainer, pl_module, stage):
        self._catcher = warnings.catch_warnings(record=True)
        self._caught = self._catcher.__enter__()
        warnings.simplefilter("always")

    def teardown(self, trainer, pl_module, stage):
        self._catcher.__exit__(None, None, None)
        name = getattr(stage, "value", stage)
        path = Path(self.directory, f"{name}_rank{trainer.global_rank}.json")
        path.write_text(json.dumps([str(w.message) for w in self._caught]))


def _trainer(root: Path, callbacks: list, **options) -> pl.Trainer:
    strategy = DDPStrategy(timeout=timedelta(seconds=60))
    return pl.Trainer(
        accelerator="cpu",
        devices=WORLD_SIZE,
        strategy=strategy,
        default_root_dir=root,
        logger=False,
        callbacks=[*callbacks, WarningLog(root)],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        **options,
    )


def fit_and_validate(root: Path) -> None:
    """A 2-epoch DDP fit (curves, adversarial validation), then a DDP validate (classification dimension); each process
    writes the texts of the warnings it emitted to ``<stage>_rank<r>.json`` in ``root`` (see :func:`warnings_of`).

    In the process that started the other, waits for it; then leaves at once (module docstring).
    """
    generator = torch.Generator().manual_seed(0)
    pixels = torch.rand(32, *SHAPE, generator=generator)  # in [0, 1], as the attacks expect
    labels = torch.randint(0, 5, (32,), generator=generator)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(pixels, labels), batch_size=8)
    model = ProbedNet()
    adversarial = AdversarialValidation(eps=[2 / 255], attacks=["fgsm"], max_samples=16, verbose=False)
    trainer = _trainer(root, [EqualCurves(), adversarial], max_epochs=2)
    trainer.fit(model, loader, loader)
    dimension = ClassificationDimension(ks=[1, 2], verbose=False)
    _trainer(root, [dimension], inference_mode=False).validate(model, loader, verbose=False)
    status = 0
    for process in getattr(trainer.strategy.launcher, "procs", []):
        status = status or process.wait(timeout=120)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def warnings_of(root: Path) -> dict[str, list[str]]:
    """``"<stage>_rank<r>" -> texts of the warnings that process emitted`` (written by :func:`fit_and_validate`)."""
    return {path.stem: json.loads(path.read_text()) for path in sorted(root.glob("*_rank*.json"))}


if __name__ == "__main__":
    fit_and_validate(Path(sys.argv[1]))
