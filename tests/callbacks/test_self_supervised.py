"""Self-supervised learning: two views of a batch, momentum (EMA) target networks, the figure workers' pipes."""

import copy
import gc
import io
import os
import signal
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from rank_lightning import figure_workers
from rank_lightning.callbacks import ActivationRankMonitor, WeightRankMonitor
from rank_lightning.functional import effective_rank, total_cluster_variation
from rank_lightning.layers import default_layers, frozen_copies
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


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(12, 12)

    def forward(self, x: Tensor) -> Tensor:
        return x + torch.relu(self.linear(x))


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(16, 12)
        self.blocks = nn.Sequential(Block(), Block(), Block())
        self.head = nn.Linear(12, 6)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.blocks(self.stem(x)))


class BYOL(pl.LightningModule):
    """An online encoder and its momentum target (a frozen ``copy.deepcopy``), updated in ``optimizer_step``;
    validation runs the online encoder only."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.online = Encoder()
        self.predictor = nn.Linear(6, 6)
        self.target = copy.deepcopy(self.online).requires_grad_(False)

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        x = batch[0]
        with torch.no_grad():
            z = self.target(x + 0.1 * torch.randn_like(x))
        p = self.predictor(self.online(x + 0.1 * torch.randn_like(x)))
        return 2 - 2 * nn.functional.cosine_similarity(p, z).mean()

    def validation_step(self, batch: list[Tensor], batch_idx: int) -> None:
        self.online(batch[0])

    def update_target(self) -> None:
        with torch.no_grad():
            for online, target in zip(self.online.parameters(), self.target.parameters()):
                target.lerp_(online, 0.5)

    def optimizer_step(self, *args, **kwargs) -> None:
        super().optimizer_step(*args, **kwargs)
        self.update_target()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([*self.online.parameters(), *self.predictor.parameters()], lr=0.5)


class BatchEndBYOL(BYOL):
    """The target updated in ``on_train_batch_end`` instead, which Lightning runs after the callbacks' own."""

    def optimizer_step(self, *args, **kwargs) -> None:
        pl.LightningModule.optimizer_step(self, *args, **kwargs)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.update_target()


def _byol_loader(rows: int = 16) -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(rows, 16, generator=torch.Generator().manual_seed(1))), batch_size=8)


def test_the_default_layers_leave_out_a_frozen_momentum_copy(tmp_path, caplog):
    # The online and target encoders were taken for two repeated blocks: one layer each, and 'target', never run by
    # validation, named in a "not called" warning.
    assert frozen_copies(BYOL()) == ["target"]
    assert default_layers(BYOL()) == {f"online.blocks.{i}": f"online.blocks.{i}" for i in range(3)}
    monitor = ActivationRankMonitor()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_trainer([monitor], max_epochs=1, default_root_dir=tmp_path).fit(BYOL(), _byol_loader(), _byol_loader())
    assert not [str(w.message) for w in caught if "was not called" in str(w.message)]
    assert sorted(monitor.curves.history[0]) == ["online.blocks.0", "online.blocks.1", "online.blocks.2"]
    assert "frozen copies (momentum targets) left out: target;" in caplog.text


@pytest.mark.parametrize("compiled", ["online", "target"])
def test_a_momentum_copy_is_left_out_when_only_one_of_the_pair_is_compiled(compiled):
    # The target is a copy of the online encoder made before ``torch.compile`` wrapped one of them: the wrapper's class
    # and its parameter names (``_orig_mod.``) are not the copy's, yet the pair is an encoder and its frozen copy.
    model = BYOL()
    setattr(model, compiled, torch.compile(getattr(model, compiled), backend="eager"))
    assert frozen_copies(model) == ["target"]
    assert list(default_layers(model)) == [f"online.blocks.{i}" for i in range(3)]


def test_frozen_blocks_of_a_stack_are_no_copies():
    # Fine-tuning with the first blocks frozen: they run in the forward pass and stay among the default layers.
    encoder = Encoder()
    encoder.blocks[0].requires_grad_(False)
    assert frozen_copies(encoder) == []
    assert default_layers(encoder) == {f"blocks.{i}": f"blocks.{i}" for i in range(3)}


@pytest.mark.parametrize("update_in_step", [False, True])
def test_a_momentum_target_updated_after_the_weight_measurement_is_named(tmp_path, update_in_step):
    monitor = WeightRankMonitor(layers=["target.head"], every_n_train_steps=1, metrics=["spectral_norm"])
    model = BYOL() if update_in_step else BatchEndBYOL()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_trainer([monitor], max_steps=2, default_root_dir=tmp_path).fit(model, _byol_loader())
    named = [str(w.message) for w in caught if "a frozen copy (a momentum / EMA target)" in str(w.message)]
    assert len(named) == (not update_in_step)
    final = float(torch.linalg.matrix_norm(model.target.head.weight.double(), 2))
    measured = monitor.curves.history[2]["target.head"]["spectral_norm"]
    assert (measured == pytest.approx(final, rel=1e-9)) == update_in_step  # else the weights before step 2's update


def _rankme(z: Tensor, eps: float) -> float:
    """RankMe as Garrido et al. (2023) publish it: ``exp(-sum p log p)``, ``p_k = s_k / ||s||_1 + eps``."""
    s = torch.linalg.svdvals(z.double())
    p = s / s.sum() + eps
    return float(torch.exp(-(p * p.log()).sum()))


def test_effective_rank_is_rankme_without_its_eps_by_the_documented_amounts():
    g = torch.Generator().manual_seed(0)
    found = []
    for rows in (256, 2048):
        full = torch.randn(rows, 512, generator=g)
        low = torch.randn(rows, 10, generator=g) @ torch.randn(10, 512, generator=g)
        for z in (full, low):
            ours = float(effective_rank(z))
            assert _rankme(z, 0.0) == pytest.approx(ours, rel=1e-11)
            found.append((round(ours, 4), round(_rankme(z, 1e-7), 4)))
    # docs/self-supervised.md, "RankMe and the package's effective rank"
    assert found == [(236.8516, 236.8797), (9.9245, 9.9285), (494.6678, 494.8014), (9.9673, 9.9753)]
