"""The step cadence under manual optimization: windows planned from the optimizer steps the batches were seen to take
(an optimizer stepped every k-th batch, a step skipped), never longer than ``window_batches``."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import pytest
import torch
from pytorch_lightning.loggers import CSVLogger
from torch import nn

from rank_lightning.callbacks import ActivationRankMonitor, WeightRankMonitor
from rank_lightning.callbacks.base import repeating_steps
from rank_lightning.functional import participation_ratio
from tests.callbacks.trainer_helpers import SmallClassifier, TrainBatches, quiet_trainer

BATCH_SIZE = 4


class _Manual(SmallClassifier):
    """One optimizer, stepped by the module itself after every ``every``-th batch of an epoch, except in the
    ``(epoch, batch_idx)`` batches of ``skip`` (a step skipped on a non-finite loss)."""

    def __init__(self, every: int = 1, skip: tuple[tuple[int, int], ...] = ()) -> None:
        super().__init__((5, 4, 3), activation=nn.Tanh, seed=0)
        self.automatic_optimization = False
        self.every, self.skip = every, skip

    def training_step(self, batch: Any, batch_idx: int) -> None:
        optimizer = self.optimizers()
        self.manual_backward(nn.functional.cross_entropy(self.net(batch[0]), batch[1]))
        if (batch_idx + 1) % self.every == 0 and (self.current_epoch, batch_idx) not in self.skip:
            optimizer.step()
            optimizer.zero_grad()


def _fit(tmp_path: Path, module: _Manual, every: int, window: int) -> tuple[ActivationRankMonitor, TrainBatches, Any]:
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(8 * BATCH_SIZE, 5, generator=generator), torch.arange(8 * BATCH_SIZE) % 3
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH_SIZE)
    monitor = ActivationRankMonitor(
        layers=["net.0"], every_n_train_steps=every, window_batches=window, log_at_init=False, verbose=False
    )
    weights = WeightRankMonitor(layers=["net.0"], every_n_train_steps=every, log_at_init=False, verbose=False)
    record = TrainBatches()
    logger = CSVLogger(tmp_path, name="run", version=0)
    options = dict(max_epochs=2, num_sanity_val_steps=0, default_root_dir=tmp_path, logger=logger)
    trainer = quiet_trainer([record, monitor, weights], **options)
    trainer.fit(module, train_dataloaders=loader)
    return monitor, record, weights


def _logged_steps(tmp_path: Path, key: str) -> list[int]:
    with open(tmp_path / "run" / "version_0" / "metrics.csv") as file:
        return [int(row["step"]) for row in csv.DictReader(file) if row.get(key)]


def _window_rows(record: TrainBatches, batches: list[int]) -> torch.Tensor:
    return torch.cat([record.batches[i]["output"] for i in batches])


def test_manual_accumulation_windows_stream_the_batches_before_each_step(tmp_path: Path) -> None:
    # The optimizer is stepped after every 2nd batch: 4 steps per epoch, 8 in all; steps 3 and 6 end batches 5 and 11.
    monitor, record, weights = _fit(tmp_path, _Manual(every=2), every=3, window=2)
    assert [b["step_after"] for b in record.batches] == [0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7, 8]
    assert monitor.curves.epochs == [3, 6] and weights.curves.epochs == [3, 6]
    for step, last in ((3, 5), (6, 11)):
        logged = monitor.curves.history[step]["net.0"]
        assert logged["spectrum_rows"] == 2 * BATCH_SIZE, step
        expected = float(participation_ratio(_window_rows(record, [last - 1, last])))
        assert logged["participation_ratio"] == pytest.approx(expected, rel=1e-9), step
    assert _logged_steps(tmp_path, "rank_train/net.0/participation_ratio") == [3, 6]
    assert _logged_steps(tmp_path, "weight/net.0/stable_rank") == [3, 6]


def test_manual_accumulation_allows_windows_of_the_batches_between_measurements(tmp_path: Path) -> None:
    # A step every 2nd batch: 2 batches between measurements at every step, although accumulate_grad_batches is 1.
    monitor, record, _ = _fit(tmp_path, _Manual(every=2), every=1, window=2)
    assert monitor.curves.epochs == list(range(1, 9))
    for step in monitor.curves.epochs:
        logged = monitor.curves.history[step]["net.0"]
        expected = float(participation_ratio(_window_rows(record, [2 * step - 2, 2 * step - 1])))
        assert logged["spectrum_rows"] == 2 * BATCH_SIZE, step
        assert logged["participation_ratio"] == pytest.approx(expected, rel=1e-9), step


def test_a_skipped_step_never_makes_a_window_longer(tmp_path: Path) -> None:
    # Batch 5 of the first epoch takes no step: the window opened at batch 4 for step 6 reaches it only at batch 6.
    with pytest.warns(UserWarning, match=r"window of step 6 streamed 1 of window_batches=2") as caught:
        monitor, record, _ = _fit(tmp_path, _Manual(skip=((0, 5),)), every=3, window=2)
    assert [b["step_after"] for b in record.batches][:8] == [1, 2, 3, 4, 5, 5, 6, 7]
    assert any("took fewer optimizer steps than planned" in str(w.message) for w in caught)
    logged = monitor.curves.history[6]["net.0"]
    assert logged["spectrum_rows"] == BATCH_SIZE
    expected = float(participation_ratio(_window_rows(record, [6])))
    assert logged["participation_ratio"] == pytest.approx(expected, rel=1e-9)
    for step in (3, 9, 12, 15):  # the other windows stream the 2 batches before their step
        logged = monitor.curves.history[step]["net.0"]
        expected = float(participation_ratio(_window_rows(record, record.window(step, 2))))
        assert logged["spectrum_rows"] == 2 * BATCH_SIZE, step
        assert logged["participation_ratio"] == pytest.approx(expected, rel=1e-9), step


@pytest.mark.parametrize(
    ("history", "expected"),
    [
        ([], None),
        ([0, 0], None),
        ([2, 2, 2], [2]),
        ([0, 1, 0, 1], [0, 1]),
        ([0, 0, 1, 0, 0, 1, 0], [0, 1, 0]),
        ([1, 2, 1, 2, 1], [2, 1]),
        ([0, 1], [1]),  # one period seen: not yet repeated, the steps of the last batch that took any
        ([1, 1, 0] * 11 + [1, 1], [0, 1, 1]),  # not [1], which the last 2 batches alone repeat
        ([1] * 40 + [0] + [1] * 5, [1]),  # a skipped step: the pattern of the batches after it
        ([1, 1, 1, 1, 1, 0, 1], [1]),
        ([2, 1] * 4 + [2] + [2, 1] * 3, [2, 1]),  # an epoch of 9 batches: its end breaks the pattern
    ],
)
def test_repeating_steps(history: list[int], expected: list[int] | None) -> None:
    assert repeating_steps(history) == expected
