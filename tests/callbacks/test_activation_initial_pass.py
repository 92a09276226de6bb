"""The initial point (``log_at_init``) and ``max_samples`` over loaders of unknown length or limited by the
Trainer: measured on the data every later point is measured on."""

from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from rank_lightning.callbacks import ActivationRankMonitor
from rank_lightning.tracker import RankTracker

ROWS = 64
BATCH = 8


class _Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(5, 12), nn.ReLU(), nn.Linear(12, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        return nn.functional.cross_entropy(self(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        self(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _data(seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(ROWS, 5, generator=g), torch.randint(0, 3, (ROWS,), generator=g))


class _Unsized(IterableDataset):
    """Batches of a tensor dataset with no length: Lightning counts ``inf`` batches."""

    def __init__(self, data: TensorDataset) -> None:
        self.data = data

    def __iter__(self):
        x, y = self.data.tensors
        for start in range(0, ROWS, BATCH):
            yield x[start : start + BATCH], y[start : start + BATCH]


def _fit(root: Path, monitor: ActivationRankMonitor, val: object, **trainer_options) -> dict:
    trainer = pl.Trainer(
        max_epochs=2,
        accelerator="cpu",
        logger=False,
        callbacks=[monitor],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=root,
        **trainer_options,
    )
    trainer.fit(_Net(), DataLoader(_data(), batch_size=BATCH), val)
    return monitor.curves.history


def _rows(history: dict) -> dict[int, float]:
    return {point: values["net.1"]["spectrum_rows"] for point, values in history.items()}


def test_an_unsized_validation_loader_gets_an_initial_point_and_max_samples_rows(tmp_path):
    monitor = ActivationRankMonitor(layers=["net.1"], log_at_init=True, max_samples=20, verbose=False)
    history = _fit(tmp_path, monitor, DataLoader(_Unsized(_data(1)), batch_size=None))
    assert sorted(history) == [-1, 0, 1]
    assert _rows(history) == {-1: 20, 0: 20, 1: 20}  # the first 20 rows of every pass


@pytest.mark.parametrize(("limit", "batches"), [(2, 2), (0.5, 4)])
def test_the_initial_pass_keeps_to_limit_val_batches(tmp_path, limit, batches):
    monitor = ActivationRankMonitor(layers=["net.1"], log_at_init=True, max_samples=None, verbose=False)
    history = _fit(tmp_path, monitor, DataLoader(_data(1), batch_size=BATCH), limit_val_batches=limit)
    assert _rows(history) == {-1: batches * BATCH, 0: batches * BATCH, 1: batches * BATCH}


def test_the_initial_pass_streams_every_validation_loader(tmp_path):
    monitor = ActivationRankMonitor(layers=["net.1"], log_at_init=True, max_samples=None, verbose=False)
    loaders = [DataLoader(_data(1), batch_size=BATCH), DataLoader(_data(2), batch_size=BATCH)]
    history = _fit(tmp_path, monitor, loaders)
    assert _rows(history) == {-1: 2 * ROWS, 0: 2 * ROWS, 1: 2 * ROWS}


def test_training_data_initial_point_with_the_default_max_samples(tmp_path):
    monitor = ActivationRankMonitor(layers=["net.1"], stage="train", log_at_init=True, verbose=False)
    history = _fit(tmp_path, monitor, None, limit_train_batches=3)
    assert _rows(history) == {-1: 3 * BATCH, 0: 3 * BATCH, 1: 3 * BATCH}


def test_a_tracker_without_a_batch_count_measures_the_first_max_samples_inputs():
    model = _Net().eval()
    tracker = RankTracker(model, layers=["net.1"], max_samples=20)
    x, _ = _data().tensors
    with torch.no_grad(), tracker:
        for batch in x.split(BATCH):
            with tracker.batch():
                model(batch)
        assert tracker.inputs_measured == 20
    assert tracker.compute()["net.1"]["spectrum_rows"] == 20
