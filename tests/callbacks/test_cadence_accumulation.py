"""Step windows under gradient accumulation: an epoch whose batches are not a multiple of ``accumulate_grad_batches``
ends with a shorter accumulation, and the window still streams the W batches before every N-th optimizer step."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from rank_lightning.callbacks import ActivationRankMonitor
from rank_lightning.callbacks.base import Cadence
from rank_lightning.functional import participation_ratio, total_cluster_variation
from tests.callbacks.trainer_helpers import SmallClassifier, TrainBatches, quiet_trainer

NUM_CLASSES = 3
BATCH_SIZE = 4


def _model() -> SmallClassifier:
    return SmallClassifier((5, 4, NUM_CLASSES), activation=nn.Tanh, seed=0)


def _fit(tmp_path: Path, every: int, window: int, *, batches: int, **kwargs: Any) -> tuple[Any, TrainBatches, int]:
    generator = torch.Generator().manual_seed(1)
    n = batches * BATCH_SIZE
    x, y = torch.randn(n, 5, generator=generator), torch.arange(n) % NUM_CLASSES
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH_SIZE)
    monitor = ActivationRankMonitor(
        layers=["net.0"], every_n_train_steps=every, window_batches=window, log_at_init=False, verbose=False
    )
    record = TrainBatches()
    trainer = quiet_trainer(
        [record, monitor], max_epochs=2, num_sanity_val_steps=0, default_root_dir=tmp_path, **kwargs
    )
    trainer.fit(_model(), train_dataloaders=loader)
    return monitor, record, trainer.global_step


def _check_windows(monitor: Any, record: TrainBatches, every: int, window: int, expected_steps: list[int]) -> None:
    assert monitor.curves.epochs == expected_steps
    for step in expected_steps:
        chosen = [record.batches[i] for i in record.window(step, window)]
        rows = torch.cat([b["output"] for b in chosen])
        labels = torch.cat([b["labels"] for b in chosen])
        logged = monitor.curves.history[step]["net.0"]
        assert logged["spectrum_rows"] == window * BATCH_SIZE, step
        assert logged["participation_ratio"] == pytest.approx(float(participation_ratio(rows)), rel=1e-9), step
        assert logged["tcv"] == pytest.approx(float(total_cluster_variation(rows, labels)), rel=1e-9), step


@pytest.mark.parametrize("window", [1, 2])
def test_partial_last_accumulation_of_an_epoch(tmp_path: Path, window: int) -> None:
    # 5 batches, 2 per step: steps end after batches 1, 3 and 4 (the last one alone); 3 steps per epoch, 6 in all.
    monitor, record, last_step = _fit(tmp_path, 3, window, batches=5, accumulate_grad_batches=2)
    assert last_step == 6
    _check_windows(monitor, record, 3, window, [3, 6])


def test_window_longer_than_an_accumulation_across_the_epoch_boundary(tmp_path: Path) -> None:
    # Steps end after batches 1, 3, 4 of each epoch; step 4's window of 3 is epoch 0's batch 4 and epoch 1's 0 and 1.
    monitor, record, last_step = _fit(tmp_path, 2, 3, batches=5, accumulate_grad_batches=2)
    assert last_step == 6
    _check_windows(monitor, record, 2, 3, [2, 4, 6])


def test_limit_train_batches_not_a_multiple_of_the_accumulation(tmp_path: Path) -> None:
    # 8 batches limited to 7, 3 per step: steps end after batches 2, 5 and 6 of each epoch; windows of 4 batches.
    monitor, record, last_step = _fit(tmp_path, 2, 4, batches=8, accumulate_grad_batches=3, limit_train_batches=7)
    assert last_step == 6
    _check_windows(monitor, record, 2, 4, [2, 4, 6])


@pytest.mark.parametrize("window", [1, 2])
def test_no_accumulation(tmp_path: Path, window: int) -> None:
    monitor, record, last_step = _fit(tmp_path, 2, window, batches=5)
    assert last_step == 10
    _check_windows(monitor, record, 2, window, [2, 4, 6, 8, 10])


def _opening_batches(cadence: Cadence, num_batches: float, accumulate: int, epochs: int) -> list[tuple[int, int]]:
    """Simulate Lightning's loop (a step after every ``accumulate`` batches and after an epoch's last batch) and
    return the ``(epoch, batch_idx)`` at which the window opens, with a window open until its step is taken."""
    trainer = SimpleNamespace(
        sanity_checking=False,
        state=SimpleNamespace(fn="fit"),
        accumulate_grad_batches=accumulate,
        num_training_batches=num_batches,
        global_step=0,
        strategy=SimpleNamespace(handles_gradient_accumulation=False),
    )
    opened, target = [], None
    for epoch in range(epochs):
        for batch_idx in range(int(num_batches)):
            if target is None and cadence.window_opens(trainer, batch_idx):
                target = cadence.next_step(trainer)
                opened.append((epoch, batch_idx))
            if (batch_idx + 1) % accumulate == 0 or batch_idx + 1 == num_batches:
                trainer.global_step += 1
            if target is not None and cadence.window_closes(trainer, target):
                target = None
    return opened


def test_window_opens_from_the_shared_loop_counters() -> None:
    # 5 batches, 2 per step: steps 1-3 in epoch 0, 4-6 in epoch 1. Step 3 (epoch 0, batch 4) takes one batch.
    assert _opening_batches(Cadence(every_n_train_steps=3, window_batches=1), 5, 2, 2) == [(0, 4), (1, 4)]
    assert _opening_batches(Cadence(every_n_train_steps=3, window_batches=2), 5, 2, 2) == [(0, 3), (1, 3)]
    assert _opening_batches(Cadence(every_n_train_steps=2, window_batches=3), 5, 2, 2) == [(0, 1), (0, 4), (1, 2)]
    assert _opening_batches(Cadence(every_n_train_steps=1, window_batches=1), 3, 1, 1) == [(0, 0), (0, 1), (0, 2)]


def _short_window_warnings(caught: pytest.WarningsRecorder) -> list[str]:
    return [str(w.message) for w in caught if "training batches: it opened after" in str(w.message)]


def test_full_windows_give_no_short_window_warning(tmp_path: Path, recwarn: pytest.WarningsRecorder) -> None:
    _fit(tmp_path, 3, 2, batches=5, accumulate_grad_batches=2)
    assert _short_window_warnings(recwarn) == []


def test_a_window_cut_by_the_epochs_last_accumulation_is_named(tmp_path: Path) -> None:
    # 5 batches, 2 per step: steps end after batches 1, 3 and 4. Step 2's window is batches 2-3, so step 3's window
    # (its step taken after batch 4 alone) has that one batch.
    with pytest.warns(UserWarning, match=r"window of step 3 streamed 1 of window_batches=2 training batches") as caught:
        monitor, record, _ = _fit(tmp_path, 1, 2, batches=5, accumulate_grad_batches=2)
    assert len(_short_window_warnings(caught)) == 1  # once, not at every epoch's short window
    history = monitor.curves.history
    assert [history[step]["net.0"]["spectrum_rows"] for step in (2, 3, 4, 6)] == [8, 4, 8, 4]
    rows = torch.cat([record.batches[i]["output"] for i in record.window(3, 1)])
    assert history[3]["net.0"]["participation_ratio"] == pytest.approx(float(participation_ratio(rows)), rel=1e-9)


def test_a_window_resumed_inside_goes_on_from_the_checkpoints_sums(tmp_path: Path) -> None:
    from pytorch_lightning.callbacks import ModelCheckpoint

    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 5, generator=generator), torch.arange(32) % NUM_CLASSES
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH_SIZE)

    def monitor() -> ActivationRankMonitor:
        return ActivationRankMonitor(
            layers=["net.0"], every_n_train_steps=4, window_batches=4, log_at_init=False, verbose=False
        )

    saving = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1)
    options = dict(max_epochs=2, num_sanity_val_steps=0, default_root_dir=tmp_path, enable_checkpointing=True)
    quiet_trainer([monitor(), saving], **options).fit(_model(), train_dataloaders=loader)
    checkpoint = tmp_path / "ckpt" / "epoch=1-step=14.ckpt"  # inside the window of step 16 (batches 4-7 of epoch 1)
    assert checkpoint.exists()
    resumed = monitor()
    with pytest.warns(UserWarning) as caught:
        quiet_trainer([resumed], **options).fit(_model(), train_dataloaders=loader, ckpt_path=checkpoint)
    messages = [str(w.message) for w in caught]
    # The checkpoint holds the window's first 2 batches: the window is not short.
    assert not any("window of step 16 streamed" in m for m in messages)
    # The curve file of the first fit holds step 16, which the resumed fit measures again: said in steps.
    rewind = (
        "older than the recorded curves and measures again from step 15 on; step 16 is trained again and its values"
    )
    assert any(rewind in m for m in messages)
    assert resumed.curves.history[16]["net.0"]["spectrum_rows"] == 4 * BATCH_SIZE


class _TwoOptimizers(SmallClassifier):
    """Manual optimization with two optimizers stepped in every batch (as a GAN's): ``global_step`` advances by 2."""

    def __init__(self) -> None:
        super().__init__((5, 4, NUM_CLASSES), activation=nn.Tanh, seed=0)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        optimizers = self.optimizers()
        for optimizer in optimizers:
            optimizer.zero_grad()
        self.manual_backward(nn.functional.cross_entropy(self.net(batch[0]), batch[1]))
        for optimizer in optimizers:
            optimizer.step()

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        first, rest = list(self.net[0].parameters()), list(self.net[2].parameters())
        return [torch.optim.SGD(first, lr=self.lr), torch.optim.SGD(rest, lr=self.lr)]


def _fit_manual(tmp_path: Path, callbacks: list, batches: int = 6) -> TrainBatches:
    generator = torch.Generator().manual_seed(1)
    n = batches * BATCH_SIZE
    x, y = torch.randn(n, 5, generator=generator), torch.arange(n) % NUM_CLASSES
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH_SIZE)
    record = TrainBatches()
    trainer = quiet_trainer([record, *callbacks], max_epochs=2, num_sanity_val_steps=0, default_root_dir=tmp_path)
    trainer.fit(_TwoOptimizers(), train_dataloaders=loader)
    assert trainer.global_step == 4 * batches  # two steps per batch, two epochs
    return record


def test_manual_optimization_windows_stream_the_batches_before_each_step(tmp_path: Path) -> None:
    monitor = ActivationRankMonitor(
        layers=["net.0"], every_n_train_steps=4, window_batches=2, log_at_init=False, verbose=False
    )
    with pytest.warns(UserWarning, match=r"window of step 4 streamed 1 of window_batches=2") as caught:
        record = _fit_manual(tmp_path, [monitor])
    # Only the first window, planned before a batch's two steps were seen, is short; the warning says why.
    assert any("each batch took 2 optimizer steps" in message for message in _short_window_warnings(caught))
    steps = list(range(4, 25, 4))
    assert monitor.curves.epochs == steps
    for step in steps:
        size = 1 if step == 4 else 2
        rows = torch.cat([record.batches[i]["output"] for i in record.window(step, size)])
        logged = monitor.curves.history[step]["net.0"]
        assert logged["spectrum_rows"] == size * BATCH_SIZE, step
        assert logged["participation_ratio"] == pytest.approx(float(participation_ratio(rows)), rel=1e-9), step


def test_manual_optimization_weights_are_measured_after_each_multiple_passed(tmp_path: Path) -> None:
    from rank_lightning.callbacks import WeightRankMonitor

    monitor = WeightRankMonitor(layers=["net.0"], every_n_train_steps=3, verbose=False)
    _fit_manual(tmp_path, [monitor], batches=3)
    # Steps 2, 4, ..., 12: the batches ending at 4, 6, 10 and 12 reach or pass 3, 6, 9 and 12.
    assert [step for step in monitor.curves.epochs if step > 0] == [4, 6, 10, 12]
