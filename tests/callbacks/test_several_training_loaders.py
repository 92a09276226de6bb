"""Several training loaders (a list or a dict, combined by Lightning's ``CombinedLoader``): the callbacks that make
their own pass over the training data read the batches the training step receives."""

from __future__ import annotations

from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.utilities import CombinedLoader
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from rank_lightning.callbacks import ActivationRankMonitor, LowDimensionalEvaluation, RankPretraining
from rank_lightning.functional import low_dimensional_accuracy
from rank_lightning.modules import ImageClassifier
from rank_lightning.nn import lr_layers
from tests.callbacks.trainer_helpers import quiet_trainer


def _loader(rows: int, seed: int) -> DataLoader:
    generator = torch.Generator().manual_seed(seed)
    x, y = torch.randn(rows, 8, generator=generator), torch.randint(0, 3, (rows,), generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=4)


class _Concatenating(pl.LightningModule):
    """Trains on the inputs of every training loader of a step, concatenated in loader order."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 6), nn.Tanh(), nn.Linear(6, 3))
        self.num_classes = 3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        parts = [part for part in (batch.values() if isinstance(batch, dict) else batch) if part is not None]
        x, y = torch.cat([part[0] for part in parts]), torch.cat([part[1] for part in parts])
        return nn.functional.cross_entropy(self(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _participation_ratio(model: _Concatenating, inputs: torch.Tensor) -> float:
    with torch.no_grad():
        s2 = torch.linalg.svdvals(model.net[:2](inputs).double()) ** 2
    return float(s2.sum() ** 2 / (s2**2).sum())


@pytest.mark.parametrize(
    ("make", "inputs"),
    [
        # max_size_cycle: 4 steps; the shorter loader b (2 batches) starts again.
        (lambda a, b: {"a": a, "b": b}, lambda a, b: [a[:16], b[:8], b[:8]]),
        (lambda a, b: [a, b], lambda a, b: [a[:16], b[:8], b[:8]]),
        (lambda a, b: CombinedLoader({"a": a, "b": b}, "min_size"), lambda a, b: [a[:8], b[:8]]),
        (lambda a, b: CombinedLoader([a, b], "max_size"), lambda a, b: [a[:16], b[:8]]),
    ],
)
def test_the_initial_point_of_training_batches_reads_every_training_loader(make, inputs, tmp_path):
    a, b = _loader(16, 1), _loader(8, 2)
    model = _Concatenating()
    expected = _participation_ratio(model, torch.cat(inputs(a.dataset.tensors[0], b.dataset.tensors[0])))
    rows = sum(len(part) for part in inputs(a.dataset.tensors[0], b.dataset.tensors[0]))
    monitor = ActivationRankMonitor(layers=["net.1"], stage="train", max_samples=None, verbose=False)
    quiet_trainer([monitor], max_epochs=1, default_root_dir=tmp_path).fit(model, make(a, b))
    initial = monitor.curves.history[-1]["net.1"]
    assert initial["spectrum_rows"] == rows
    assert initial["participation_ratio"] == pytest.approx(expected, rel=1e-9)


def test_labels_of_a_combined_training_batch_come_from_label_fn(tmp_path):
    def labels(batch: dict) -> torch.Tensor:
        return torch.cat([part[1] for part in batch.values()])

    monitor = ActivationRankMonitor(layers=["net.1"], stage="train", max_samples=None, label_fn=labels, verbose=False)
    loaders = {"a": _loader(16, 1), "b": _loader(8, 2)}
    quiet_trainer([monitor], max_epochs=1, default_root_dir=tmp_path).fit(_Concatenating(), loaders)
    assert set(monitor.curves.history) == {-1, 0}
    for point in monitor.curves.history.values():
        assert point["net.1"]["spectrum_rows"] == 32
        assert point["net.1"]["tcv"] > 0


def test_no_labels_in_a_combined_training_batch_name_label_fn(tmp_path):
    monitor = ActivationRankMonitor(layers=["net.1"], stage="train", max_samples=None, log_at_init=False)
    loaders = {"a": _loader(16, 1), "b": _loader(8, 2)}
    with pytest.warns(UserWarning, match=r"keys \['a', 'b'\].*a batch of several loaders.*label_fn=lambda batch"):
        quiet_trainer([monitor], max_epochs=1, default_root_dir=tmp_path).fit(_Concatenating(), loaders)


@pytest.mark.parametrize("make", [lambda a, b: {"a": a, "b": b}, lambda a, b: [a, b]])
def test_rank_pretraining_takes_the_inputs_of_every_training_loader(make, tmp_path):
    a, b = _loader(16, 1), _loader(8, 2)
    model = _Concatenating()
    xa, xb = a.dataset.tensors[0], b.dataset.tensors[0]
    # Two minibatches: the first batch of each loader, then the second of each, concatenated in loader order.
    expected = (
        _participation_ratio(model, torch.cat([xa[:4], xb[:4]]))
        + _participation_ratio(model, torch.cat([xa[4:8], xb[4:8]]))
    ) / 2
    pretraining = RankPretraining(layer="net.1", num_batches=2, steps=1, verbose=False)
    quiet_trainer([pretraining], max_epochs=1, max_steps=1, default_root_dir=tmp_path).fit(model, make(a, b))
    assert pretraining.results["net.1"]["r_before"] == pytest.approx(expected, rel=1e-9)


def test_low_dimensional_evaluation_fits_on_the_samples_of_every_training_loader(tmp_path):
    a, b, val = _loader(16, 1), _loader(8, 2), _loader(12, 3)
    model = _Concatenating()
    evaluation = LowDimensionalEvaluation(dims=(2, 5), layer="net.1", verbose=False)
    trainer = quiet_trainer([evaluation], max_epochs=1, default_root_dir=tmp_path)
    trainer.fit(model, {"a": a, "b": b}, val)
    (xa, ya), (xb, yb), (xv, yv) = (loader.dataset.tensors for loader in (a, b, val))
    with torch.no_grad():
        train_x, val_x = model.net[:2](torch.cat([xa, xb])), model.net[:2](xv)
    expected = low_dimensional_accuracy(train_x, torch.cat([ya, yb]), val_x, yv, (2, 5))
    assert evaluation.results == pytest.approx(expected)


def test_rank_pretraining_leaves_no_auxiliary_loss_for_the_first_step(tmp_path):
    # The ascent's pending LR-Layer loss (its graph freed by the ascent's backward) must not join the first step's.
    model = ImageClassifier(
        backbone="mlp",
        backbone_kwargs={"depth": 2, "width": 8},
        num_classes=3,
        input_shape=(8,),
        lr_layers=[{"before": "head", "rank": 2}],
    )
    for _, layer in lr_layers(model):
        layer.enabled = True
    trainer = quiet_trainer(
        [RankPretraining(num_batches=1, steps=2, verbose=False)], max_steps=1, default_root_dir=tmp_path
    )
    trainer.fit(model, _loader(16, 1))
    assert trainer.global_step == 1


class _OnePassPerLoader(_Concatenating):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return sum(nn.functional.cross_entropy(self(x), y) for x, y in batch.values())


def test_a_step_with_one_pass_per_training_loader_is_named_with_the_remedy(tmp_path):
    monitor = ActivationRankMonitor(layers=["net.1"], stage="train", max_samples=None, log_at_init=False)
    loaders = {"a": _loader(16, 1), "b": _loader(8, 2)}
    with pytest.warns(UserWarning, match=r"'net.1' runs more than once per batch: .*one pass per training loader"):
        quiet_trainer([monitor], max_epochs=1, default_root_dir=tmp_path).fit(_OnePassPerLoader(), loaders)
    assert monitor.curves.history[0]["net.1"]["spectrum_rows"] == 16  # the first loader's rows only


class _Inputs(torch.utils.data.Dataset):
    """Bare input tensors, no labels (an autoencoder's data)."""

    def __init__(self, loader: DataLoader) -> None:
        self.x = loader.dataset.tensors[0]

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.x[index]


class _ConcatenatingInputs(_Concatenating):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(torch.cat(list(batch.values()))).square().mean()


@pytest.mark.parametrize("steps", [None, 2])
def test_combined_batches_of_bare_inputs_are_measured_on_all_their_rows(steps, tmp_path):
    # The combined batch's first tensor is loader a's (4 rows); the layers see 8 rows a step.
    a, b = _loader(16, 1), _loader(8, 2)
    loaders = {"a": DataLoader(_Inputs(a), batch_size=4), "b": DataLoader(_Inputs(b), batch_size=4)}
    model = _ConcatenatingInputs()
    xa, xb = a.dataset.tensors[0], b.dataset.tensors[0]
    rows = [xa[:8], xb[:8]] if steps else [xa, xb, xb]
    expected = _participation_ratio(model, torch.cat(rows))
    cadence = {"every_n_train_steps": steps, "window_batches": 2} if steps else {"stage": "train"}
    monitor = ActivationRankMonitor(layers=["net.1"], max_samples=None, verbose=False, **cadence)
    quiet_trainer([monitor], max_epochs=1, default_root_dir=tmp_path).fit(model, loaders)
    first = min(monitor.curves.history)
    assert monitor.curves.history[first]["net.1"]["participation_ratio"] == pytest.approx(expected, rel=1e-9)
    assert all(point["net.1"]["spectrum_rows"] == len(torch.cat(rows)) for point in monitor.curves.history.values())
