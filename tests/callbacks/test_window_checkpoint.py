"""A checkpoint saved inside an open step window holds the window's partial sums: the resumed fit measures that step
over the whole window, as the uninterrupted fit does."""

from __future__ import annotations

import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from torch.utils.data import TensorDataset

from rank_lightning.callbacks import ActivationRankMonitor
from tests.callbacks.trainer_helpers import KillAtStep, ResumableBatches, SmallClassifier, quiet_trainer


def _batches() -> ResumableBatches:
    """16 batches of 4 rows, resumed where a checkpoint left them (a loader with ``state_dict``)."""
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 5, generator=generator), torch.randint(0, 3, (64,), generator=generator))
    return ResumableBatches(data)


def _fit(root: Path, options: dict, kill_at: int | None = None, ckpt: Path | None = None, **monitor: Any) -> Any:
    settings = dict(layers=["net.0"], every_n_train_steps=4, window_batches=3, log_at_init=False, verbose=False)
    watched = ActivationRankMonitor(**(settings | monitor))
    saving = ModelCheckpoint(dirpath=root, every_n_train_steps=1, save_top_k=-1, filename="{step}")
    options = dict(max_steps=8, default_root_dir=root, enable_checkpointing=True) | options
    trainer = quiet_trainer([watched, saving, KillAtStep(kill_at)], **options)
    trainer.fit(SmallClassifier(seed=0), _batches(), ckpt_path=ckpt)
    return watched


def test_the_size_of_the_sums_a_checkpoint_holds_is_printed_as_the_memory_plan_prints_sizes(tmp_path, monkeypatch):
    said: list[str] = []
    monkeypatch.setattr(ActivationRankMonitor, "info", lambda self, message: said.append(message))
    _fit(tmp_path, {}, num_classes=None)
    window = [message for message in said if message.startswith("the checkpoint at step")]
    assert window == [
        "the checkpoint at step 2 holds the open window of step 4 (1 of window_batches=3 batches): 0.00491 MiB of "
        "float64 sums, so that a fit resumed from it measures the whole window"
    ]


@pytest.mark.parametrize(
    ("options", "kill_at", "monitor", "rows"),
    [
        ({}, 6, {}, 12),
        ({}, 7, {"max_samples": 10}, 10),
        ({}, 6, {"max_gram_features": 8}, 8),  # the subsample fallback (8 rows), whose random keys go on
        ({"accumulate_grad_batches": 2}, 7, {}, 12),
    ],
    ids=["one batch in", "two batches in, max_samples", "fallback", "accumulation"],
)
def test_a_fit_resumed_inside_a_window_gives_the_curves_of_the_uninterrupted_fit(
    tmp_path: Path, options: dict, kill_at: int, monitor: dict, rows: int
) -> None:
    # Steps 4 and 8 measured over the 3 batches before them; the checkpoint of step kill_at is inside the second window.
    whole = _fit(tmp_path / "whole", options, **monitor)
    with pytest.raises(RuntimeError, match="killed"):
        _fit(tmp_path / "cut", options, kill_at=kill_at, **monitor)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = _fit(tmp_path / "cut", options, ckpt=tmp_path / "cut" / f"step={kill_at}.ckpt", **monitor)
    assert not [str(w.message) for w in caught if "window" in str(w.message)]  # no short window
    assert whole.curves.epochs == resumed.curves.epochs == [4, 8]
    assert resumed.curves.history == whole.curves.history
    assert whole.curves.history[8]["net.0"]["spectrum_rows"] == rows


def test_a_saved_window_is_not_continued_by_a_monitor_with_other_settings(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="killed"):
        _fit(tmp_path, {}, kill_at=6)
    message = (
        r"the checkpoint holds the open window of step 8 \(1 of its batches streamed\), which this fit does not "
        r"continue: the monitor's settings differ \(window_batches 3 there, 2 here\)"
    )
    with pytest.warns(UserWarning, match=message):
        resumed = _fit(tmp_path, {}, ckpt=tmp_path / "step=6.ckpt", window_batches=2)
    assert resumed.curves.epochs == [4, 8]
    assert resumed.curves.history[8]["net.0"]["spectrum_rows"] == 8  # its own 2 batches, nothing of the saved one


def test_a_checkpoint_without_a_saved_window_gives_the_short_window_as_before(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="killed"):
        _fit(tmp_path, {}, kill_at=7)
    checkpoint = torch.load(tmp_path / "step=7.ckpt", weights_only=False)
    for state in checkpoint["callbacks"].values():
        assert state.pop("open_window", {}) is not None
    torch.save(checkpoint, tmp_path / "old.ckpt")
    with pytest.warns(UserWarning, match=r"the window of step 8 streamed 1 of window_batches=3 training batches"):
        resumed = _fit(tmp_path, {}, ckpt=tmp_path / "old.ckpt")
    assert resumed.curves.history[8]["net.0"]["spectrum_rows"] == 4


def test_several_processes_without_a_process_group_save_no_window(tmp_path: Path) -> None:
    # Each DDP process streams batches of its own, and Lightning writes the first process's state only: the sums of
    # every process are gathered into it over the process group; without one to gather them over, no window is saved
    # (a resumed fit measures the batches still to come, with a warning).
    monitor = ActivationRankMonitor(layers=["net.0"], every_n_train_steps=4, window_batches=3, verbose=False)
    saved: dict[int, dict] = {}

    class _Probe(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
            for world_size in (1, 2) if trainer.global_step == 6 else ():
                checkpoint = {"callbacks": {monitor.state_key: {}}}
                fake = SimpleNamespace(world_size=world_size, global_step=6)
                monitor.on_save_checkpoint(fake, pl_module, checkpoint)
                saved[world_size] = checkpoint["callbacks"][monitor.state_key]

    quiet_trainer([monitor, _Probe()], max_steps=8, default_root_dir=tmp_path).fit(SmallClassifier(seed=0), _batches())
    assert saved[2] == {}
    window = saved[1]["open_window"]
    assert (window["target_step"], window["stream"]["batches_seen"]) == (8, 1)
    assert window["stream"]["layers"]["net.0"]["states"]["gram"].shape == (12, 12)


def test_saved_sums_that_cannot_be_loaded_leave_the_window_to_the_batches_still_to_come(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="killed"):
        _fit(tmp_path, {}, kill_at=6)
    checkpoint = torch.load(tmp_path / "step=6.ckpt", weights_only=False)
    (state,) = [state for state in checkpoint["callbacks"].values() if "open_window" in state]
    state["open_window"]["stream"]["layers"]["net.0"]["states"]["feature_sum"] = torch.zeros(7, dtype=torch.float64)
    torch.save(checkpoint, tmp_path / "bad.ckpt")
    with pytest.warns(UserWarning, match=r"window of step 8 \(1 of its batches streamed\), .*: its sums cannot be"):
        resumed = _fit(tmp_path, {}, ckpt=tmp_path / "bad.ckpt")
    assert resumed.curves.history[8]["net.0"]["spectrum_rows"] == 8  # measured over the 2 batches after the resume
