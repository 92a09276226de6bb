"""Self-supervised learning: two views of a batch, momentum (EMA) target networks, the figure workers' pipes."""

import gc
import io
import os
import signal
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import pytorch_lightning as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from rank_lightning import figure_workers
from rank_lightning.callbacks import ActivationRankMonitor
from rank_lightning.functional import effective_rank, total_cluster_variation
from tests.callbacks.trainer_helpers import quiet_trainer


def test_a_figure_worker_closes_its_answer_pipe_when_it_exits(monkeypatch):
    # A worker's answers go to a duplicate of its standard output; left open at exit, the interpreter printed
    # "ResourceWarning: unclosed file <_io.BufferedWriter name=3>" at the end of a fit (PYTHONWARNINGS=default).
    read, write = os.pipe()
    exit_message = figure_workers._TAG + (0).to_bytes(8, "little")
    monkeypatch.setattr(sys, "stdin", SimpleNamespace(buffer=io.BytesIO(exit_message)))
    handler = signal.getsignal(signal.SIGINT)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            figure_workers._serve(write)
            gc.collect()
    finally:
        signal.signal(signal.SIGINT, handler)
    assert [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)] == []
    assert os.read(read, 1) == b""  # the write end is closed: the reader sees the end of the pipe
    os.close(read)


class SimCLR(pl.LightningModule):
    """A backbone and a projector trained contrastively on two noisy views of each batch, run through the encoder
    together (``torch.cat``, one forward pass) or one after the other (``twice``)."""

    def __init__(self, twice: bool = False) -> None:
        super().__init__()
        self.twice = twice
        self.backbone = nn.Sequential(nn.Linear(16, 24), nn.ReLU(), nn.Linear(24, 24), nn.ReLU())
        self.projector = nn.Sequential(nn.Linear(24, 24), nn.ReLU(), nn.Linear(24, 8))

    def forward(self, x: Tensor) -> Tensor:
        return self.projector(self.backbone(x))

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        x = batch[0]
        views = [x + 0.1 * torch.randn_like(x), x + 0.1 * torch.randn_like(x)]
        z1, z2 = [self(v) for v in views] if self.twice else self(torch.cat(views)).chunk(2)
        z = nn.functional.normalize(torch.cat([z1, z2]), dim=1)
        similarity = (z @ z.T / 0.5).fill_diagonal_(-1e9)
        n = len(x)
        return nn.functional.cross_entropy(similarity, torch.cat([torch.arange(n, 2 * n), torch.arange(n)]))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _views_fit(monitor: ActivationRankMonitor, root: Path, twice: bool = False) -> tuple[pl.Trainer, list[Tensor]]:
    """Fit two steps of 12 inputs and 3 classes; returns the trainer and what ``backbone.3`` gave in each
    ``training_step`` (not in the monitor's planning pass, ``forward`` on one batch)."""
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(24, 16), torch.arange(24) % 3)
    model, rows = SimCLR(twice), []
    model.backbone[3].register_forward_hook(lambda module, args, output: rows.append(output.detach().clone()))
    trainer = quiet_trainer([monitor], max_steps=2, default_root_dir=root)
    trainer.fit(model, DataLoader(data, batch_size=12))
    return trainer, rows[-2:]


def test_two_views_in_one_forward_pass_are_measured_as_views_of_the_batch(tmp_path):
    # torch.cat of two views gives 2B rows from a batch of B: every layer was skipped ("no leading dimension of the
    # batch size"), so a SimCLR-style step logged no training rank at all.
    monitor = ActivationRankMonitor(
        layers=["backbone.3"], every_n_train_steps=2, window_batches=2, log_at_init=False, num_classes=3
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer, rows = _views_fit(monitor, tmp_path)
    metrics = trainer.callback_metrics
    assert float(metrics["rank_train/backbone.3/spectrum_rows"]) == 48  # 2 batches x 2 views x 12 inputs
    measured = torch.cat(rows).double()
    assert float(metrics["rank_train/backbone.3/effective_rank"]) == pytest.approx(float(effective_rank(measured)))
    labels = (torch.arange(12) % 3).repeat(4)  # each input's label, for each of its views
    tcv = total_cluster_variation(measured, labels, num_classes=3)
    assert float(metrics["rank_train/backbone.3/tcv"]) == pytest.approx(float(tcv), rel=1e-9)
    views = [str(w.message) for w in caught if "views of every input" in str(w.message)]
    assert views == [
        "ActivationRankMonitor: layer 'backbone.3' gives (24, 24) from a batch of 12 inputs: read as 2 views of every "
        "input run in one forward pass (torch.cat of the views, one after another): all 24 rows are measured, "
        "max_samples counts inputs, and an input's label is that of each of its views."
    ]


def test_max_samples_counts_the_inputs_of_views_run_in_one_forward_pass(tmp_path):
    monitor = ActivationRankMonitor(
        layers=["backbone.3"], every_n_train_steps=2, window_batches=2, max_samples=10, log_at_init=False
    )
    trainer, rows = _views_fit(monitor, tmp_path)
    assert float(trainer.callback_metrics["rank_train/backbone.3/spectrum_rows"]) == 20  # 10 inputs x 2 views
    first = [batch.unflatten(0, (2, 12))[:, :5].flatten(0, 1) for batch in rows]  # 5 inputs of each batch
    expected = float(effective_rank(torch.cat(first).double()))
    assert float(trainer.callback_metrics["rank_train/backbone.3/effective_rank"]) == pytest.approx(expected)


def test_views_run_one_after_the_other_are_read_at_the_first_with_advice(tmp_path):
    monitor = ActivationRankMonitor(layers=["backbone.3"], every_n_train_steps=2, window_batches=2, log_at_init=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer, _ = _views_fit(monitor, tmp_path, twice=True)
    assert float(trainer.callback_metrics["rank_train/backbone.3/spectrum_rows"]) == 24  # the first view of 2 batches
    reuse = [str(w.message) for w in caught if "runs more than once per batch" in str(w.message)]
    assert len(reuse) == 1 and "the views of the batch in one pass (torch.cat" in reuse[0]
