"""Forward passes that run a module more than once: activation checkpointing (``torch.utils.checkpoint``), whose
backward pass runs the checkpointed blocks again, and modules called several times in one forward pass."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, TensorDataset

from rank_lightning.callbacks import (
    ActivationRankMonitor,
    AdversarialValidation,
    LowDimensionalEvaluation,
    RankPretraining,
)
from rank_lightning.callbacks.curves import LayerCurves
from rank_lightning.functional.jacobian import partial_jacobian_ranks
from rank_lightning.tracker import RankTracker
from tests.callbacks.trainer_helpers import quiet_trainer

FEATURES, CLASSES = 6, 3


@pytest.fixture(autouse=True)
def _quick_runs(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """Runs write their curve files under ``tmp_path`` and draw no figures (not what these tests are about)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(LayerCurves, "write_figures", lambda self, *args, **kwargs: [])


class Blocks(pl.LightningModule):
    """An input layer, then residual MLP blocks, each run under ``torch.utils.checkpoint`` (``use_reentrant``) or
    plainly (``None``)."""

    def __init__(self, use_reentrant: bool | None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(FEATURES, FEATURES)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(FEATURES, FEATURES), nn.Tanh()) for _ in range(2))
        self.head = nn.Linear(FEATURES, CLASSES)
        self.use_reentrant = use_reentrant

    def forward(self, x: Tensor) -> Tensor:
        x = self.embed(x)
        for block in self.blocks:
            plain = self.use_reentrant is None
            x = x + (block(x) if plain else checkpoint(block, x, use_reentrant=self.use_reentrant))
        return self.head(x)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return nn.functional.cross_entropy(self(batch[0]), batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _loader(rows: int = 48, batch_size: int = 8) -> DataLoader:
    generator = torch.Generator().manual_seed(1)
    x, y = torch.rand(rows, FEATURES, generator=generator), torch.randint(0, CLASSES, (rows,), generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


def _fit(use_reentrant: bool | None, **options: Any) -> tuple[dict, list[str]]:
    """The curve history of a step-cadence fit and the messages of the warnings it gave."""
    monitor = ActivationRankMonitor(layers=["blocks.0", "blocks.1", "blocks.0.0"], num_classes=CLASSES, **options)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_trainer([monitor], max_epochs=1).fit(Blocks(use_reentrant), _loader())
    return monitor.curves.history, [str(warning.message) for warning in caught]


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_checkpointed_blocks_give_the_numbers_of_the_plain_run_and_no_gradient_warning(use_reentrant):
    # The initial point runs the training forward pass without gradients, where a reentrant checkpoint would say that
    # "Gradients will be None": not a problem of the fit, whose own forward passes have gradients.
    options = dict(every_n_train_steps=2, window_batches=2, max_samples=None)
    plain, _ = _fit(None, **options)
    history, messages = _fit(use_reentrant, **options)
    assert not [message for message in messages if "requires_grad" in message or "more than once" in message]
    assert list(history) == [0, 2, 4, 6]
    assert history == plain
    assert history[2]["blocks.1"]["spectrum_rows"] == 16  # the two batches of the window, once each


def test_rank_pretraining_measures_checkpointed_blocks_without_a_gradient_warning():
    # r(H) before and after the ascent is measured without gradients, in training mode: the reentrant checkpoint's
    # "Gradients will be None" is true of that measurement only. The ascent itself runs the checkpoints with gradients.
    results = {}
    for use_reentrant in (None, True):
        callback = RankPretraining(layer="blocks.1", num_batches=2, steps=2, verbose=False)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            quiet_trainer([callback], max_steps=1).fit(Blocks(use_reentrant), _loader())
        assert not [warning for warning in caught if "requires_grad" in str(warning.message)]
        results[use_reentrant] = callback.results
    assert results[True] == results[None]
    assert results[True]["blocks.1"]["r_after"] != results[True]["blocks.1"]["r_before"]


class SecondView(Blocks):
    """Blocks whose second block also runs, after the forward pass's own call, on a second view of the batch (zeros)
    when ``twice``; validated on the training data."""

    def __init__(self, twice: bool) -> None:
        super().__init__(None)
        self.twice = twice

    def forward(self, x: Tensor) -> Tensor:
        logits = super().forward(x)
        if self.twice:
            self.blocks[1](torch.zeros_like(self.embed(x)))
        return logits

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self(batch[0])


READERS = {
    "LowDimensionalEvaluation": lambda: LowDimensionalEvaluation(layer="blocks.1", dims=(2, 4), verbose=False),
    "RankPretraining": lambda: RankPretraining(layer="blocks.1", num_batches=2, steps=2, verbose=False),
    "AdversarialValidation": lambda: AdversarialValidation(
        layer="blocks.1", eps=[8 / 255], attacks=["fgsm"], max_samples=16, verbose=False
    ),
}


@pytest.mark.parametrize("reader", list(READERS))
def test_a_layer_called_twice_per_forward_pass_is_read_at_its_first_call_with_a_warning(reader):
    results = {}
    for twice in (False, True):
        callback = READERS[reader]()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer = quiet_trainer([callback], max_epochs=1, inference_mode=False)
            trainer.fit(SecondView(twice), _loader(), _loader(rows=16))
        repeated = [str(w.message) for w in caught if "more than once per forward pass" in str(w.message)]
        assert len(repeated) == twice
        results[twice] = getattr(callback, "results", None) or callback.history
    assert "'blocks.1'" in repeated[0] and "only its first call" in repeated[0]
    assert results[True] == results[False]


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_a_tracked_model_run_under_checkpoint_counts_each_forward_pass_as_one_batch(use_reentrant):
    # The backward pass calls the checkpointed model again, its root hooks included: not a batch of the pass, which
    # would shift how max_samples is spread over the num_batches batches.
    def measure(checkpointed: bool) -> dict:
        torch.manual_seed(0)
        stem, model, head = (
            nn.Linear(FEATURES, FEATURES),
            nn.Sequential(nn.Linear(FEATURES, 12), nn.Tanh()),
            nn.Linear(12, 3),
        )
        tracker = RankTracker(model, layers=["1"], max_samples=20, num_batches=5)
        with tracker:
            for x, y in _loader(rows=40):
                h = stem(x)
                out = checkpoint(model, h, use_reentrant=use_reentrant) if checkpointed else model(h)
                nn.functional.cross_entropy(head(out), y).backward()
            assert tracker.stream.batches_seen == 5
            return tracker.compute()

    plain = measure(False)
    assert measure(True) == plain
    assert plain["1"]["spectrum_rows"] == 20


def test_a_jacobian_through_a_reentrant_checkpoint_names_the_checkpoint_and_the_fix():
    # Forward-mode Jacobians (torch.func.jvp under vmap) cannot run a reentrant checkpoint's autograd.Function; the
    # error says which setting of the model is the cause, where torch's own names setup_context.
    inputs = next(iter(_loader(rows=2, batch_size=2)))[0]
    for use_reentrant in (None, False):
        ranks = partial_jacobian_ranks(Blocks(use_reentrant), inputs, layers=["blocks.1"])["blocks.1"].ranks
        assert ranks.tolist() == [FEATURES, FEATURES]
    with pytest.raises(RuntimeError, match=r"use_reentrant=True.*use_reentrant=False, or only in training mode"):
        partial_jacobian_ranks(Blocks(True), inputs, layers=["blocks.1"])
