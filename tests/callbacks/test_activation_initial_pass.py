"""The initial point (``log_at_init``) and ``max_samples`` over loaders of unknown length or limited by the
Trainer: measured on the data every later point is measured on."""

import warnings

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from rank_lightning.callbacks import ActivationRankMonitor
from rank_lightning.tracker import RankTracker
from tests.callbacks.trainer_helpers import SmallClassifier, quiet_trainer, small_data, small_loader

ROWS = 64
BATCH = 8


class _Unsized(IterableDataset):
    """Batches of a tensor dataset with no length: Lightning counts ``inf`` batches."""

    def __init__(self, data: TensorDataset) -> None:
        self.data = data

    def __iter__(self):
        x, y = self.data.tensors
        for start in range(0, ROWS, BATCH):
            yield x[start : start + BATCH], y[start : start + BATCH]


def _fit(root, monitor: ActivationRankMonitor, val: object, **trainer_options) -> dict:
    trainer = quiet_trainer([monitor], max_epochs=2, default_root_dir=root, **trainer_options)
    trainer.fit(SmallClassifier(), small_loader(ROWS), val)
    return monitor.curves.history


def _rows(history: dict) -> dict[int, float]:
    return {point: values["net.1"]["spectrum_rows"] for point, values in history.items()}


def test_an_unsized_validation_loader_gets_an_initial_point_and_max_samples_rows(tmp_path):
    monitor = ActivationRankMonitor(layers=["net.1"], log_at_init=True, max_samples=20, verbose=False)
    history = _fit(tmp_path, monitor, DataLoader(_Unsized(small_data(ROWS, seed=1)), batch_size=None))
    assert sorted(history) == [-1, 0, 1]
    assert _rows(history) == {-1: 20, 0: 20, 1: 20}  # the first 20 rows of every pass


@pytest.mark.parametrize(("limit", "batches"), [(2, 2), (0.5, 4)])
def test_the_initial_pass_keeps_to_limit_val_batches(tmp_path, limit, batches):
    monitor = ActivationRankMonitor(layers=["net.1"], log_at_init=True, max_samples=None, verbose=False)
    history = _fit(tmp_path, monitor, small_loader(ROWS, seed=1), limit_val_batches=limit)
    assert _rows(history) == {-1: batches * BATCH, 0: batches * BATCH, 1: batches * BATCH}


def test_the_initial_pass_streams_every_validation_loader(tmp_path):
    monitor = ActivationRankMonitor(layers=["net.1"], log_at_init=True, max_samples=None, verbose=False)
    history = _fit(tmp_path, monitor, [small_loader(ROWS, seed=1), small_loader(ROWS, seed=2)])
    assert _rows(history) == {-1: 2 * ROWS, 0: 2 * ROWS, 1: 2 * ROWS}


def test_training_data_initial_point_with_the_default_max_samples(tmp_path):
    monitor = ActivationRankMonitor(layers=["net.1"], stage="train", log_at_init=True, verbose=False)
    history = _fit(tmp_path, monitor, None, limit_train_batches=3)
    assert _rows(history) == {-1: 3 * BATCH, 0: 3 * BATCH, 1: 3 * BATCH}


def test_a_tracker_without_a_batch_count_measures_the_first_max_samples_inputs():
    model = SmallClassifier().eval()
    tracker = RankTracker(model, layers=["net.1"], max_samples=20)
    x, _ = small_data(ROWS).tensors
    with torch.no_grad(), tracker:
        for batch in x.split(BATCH):
            with tracker.batch():
                model(batch)
        assert tracker.inputs_measured == 20
    assert tracker.compute()["net.1"]["spectrum_rows"] == 20


class _DictSteps(SmallClassifier):
    """``forward(x)`` on a tensor, and steps that read it from dict batches (``batch["image"]``, ``batch["label"]``)."""

    def training_step(self, batch, batch_idx):
        return torch.nn.functional.cross_entropy(self(batch["image"]), batch["label"])

    def validation_step(self, batch, batch_idx):
        self(batch["image"])


def _dict_loader(seed: int) -> DataLoader:
    x, y = small_data(ROWS, seed=seed).tensors
    rows = [{"image": x[i], "label": y[i], "index": i} for i in range(ROWS)]
    return DataLoader(rows, batch_size=BATCH)


def test_the_initial_point_of_a_forward_x_module_with_dict_batches_reads_the_dict_inputs(tmp_path):
    # forward(batch) fails on such a module: the initial point runs forward(batch["image"]) as its steps do.
    model = _DictSteps()
    with torch.no_grad():
        untrained = model.net[:2](small_data(ROWS, seed=1).tensors[0]).double()
    monitor = ActivationRankMonitor(
        layers=["net.1"], log_at_init=True, max_samples=None, metrics=["participation_ratio"], verbose=False
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*no initial point.*")
        quiet_trainer([monitor], max_epochs=1, default_root_dir=tmp_path).fit(model, _dict_loader(0), _dict_loader(1))
    history = monitor.curves.history
    assert sorted(history) == [-1, 0]
    s2 = torch.linalg.svdvals(untrained) ** 2
    assert history[-1]["net.1"]["spectrum_rows"] == ROWS
    assert history[-1]["net.1"]["participation_ratio"] == pytest.approx(float(s2.sum() ** 2 / (s2**2).sum()), rel=1e-10)
