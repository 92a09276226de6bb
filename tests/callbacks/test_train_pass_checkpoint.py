"""A checkpoint saved inside a monitored training epoch (``stage="train"``, epoch cadence) holds the epoch's partial
sums: the fit resumed from it measures that epoch over all its batches, as the uninterrupted fit does."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from rank_lightning.callbacks import ActivationRankMonitor
from rank_lightning.layers import BatchReader
from rank_lightning.streams import ActivationStream
from tests.callbacks.trainer_helpers import KillAtStep, ResumableBatches, SmallClassifier, quiet_trainer


def _batches() -> ResumableBatches:
    """8 batches of 4 rows in 3 classes, resumed where a checkpoint left them (a loader with ``state_dict``)."""
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32, 5, generator=generator), torch.randint(0, 3, (32,), generator=generator))
    return ResumableBatches(data)


def _fit(
    root: Path, options: dict, kill_at: int | None = None, ckpt: Path | None = None, loader: Any = None, **monitor: Any
) -> Any:
    settings = dict(layers=["net.0"], stage="train", log_at_init=False, verbose=False)
    watched = ActivationRankMonitor(**(settings | monitor))
    saving = ModelCheckpoint(dirpath=root, every_n_train_steps=1, save_top_k=-1, filename="{step}")
    options = dict(max_epochs=2, default_root_dir=root, enable_checkpointing=True) | options
    trainer = quiet_trainer([watched, saving, KillAtStep(kill_at)], **options)
    trainer.fit(SmallClassifier(seed=0), loader or _batches(), ckpt_path=ckpt)
    return watched


def _resumed(root: Path, options: dict, kill_at: int, **monitor: Any) -> tuple[Any, list[str]]:
    """The monitor of a fit killed after the checkpoint of step ``kill_at`` and resumed from it, and its warnings."""
    with pytest.raises(RuntimeError, match="killed"):
        _fit(root, options, kill_at=kill_at, **monitor)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = _fit(root, options, ckpt=root / f"step={kill_at}.ckpt", **monitor)
    return resumed, [str(w.message) for w in caught]


@pytest.mark.parametrize(
    ("options", "kill_at", "monitor", "rows"),
    [
        ({}, 11, {}, 32),
        ({}, 13, {"max_samples": 10, "log_per_class": True}, 10),
        ({}, 10, {"max_gram_features": 8}, 8),  # the subsample fallback (8 rows), whose random keys go on
        ({"accumulate_grad_batches": 3}, 5, {"max_samples": 20}, 20),  # 3 steps per epoch: step 5 is its 7th batch
    ],
    ids=["one epoch in", "max_samples, class statistics", "fallback", "accumulation"],
)
def test_a_fit_resumed_inside_a_monitored_epoch_gives_the_curves_of_the_uninterrupted_fit(
    tmp_path: Path, options: dict, kill_at: int, monitor: dict, rows: int
) -> None:
    whole = _fit(tmp_path / "whole", options, **monitor)
    resumed, caught = _resumed(tmp_path / "cut", options, kill_at, **monitor)
    assert not [message for message in caught if "resumed inside epoch" in message]
    assert whole.curves.epochs == resumed.curves.epochs == [0, 1]
    assert resumed.curves.history == whole.curves.history
    assert whole.curves.history[1]["net.0"]["spectrum_rows"] == rows


def test_a_fit_resumed_at_the_end_of_an_epoch_measures_the_next_epoch_whole(tmp_path: Path) -> None:
    # The checkpoint of step 8 is saved at the end of epoch 0's last batch: the resumed fit goes on with epoch 1 from
    # its first batch (Lightning calls no on_train_epoch_start then), whose rows max_samples spreads over its 8 batches.
    # A loader that starts every epoch afresh gives the resumed epoch the batches of the uninterrupted one.
    loader = DataLoader(_batches().batches, batch_size=None)
    whole = _fit(tmp_path / "whole", {}, loader=loader, max_samples=10)
    with pytest.raises(RuntimeError, match="killed"):
        _fit(tmp_path / "cut", {}, kill_at=8, loader=loader, max_samples=10)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = _fit(tmp_path / "cut", {}, ckpt=tmp_path / "cut" / "step=8.ckpt", loader=loader, max_samples=10)
    assert not [str(w.message) for w in caught if "resumed inside epoch" in str(w.message)]
    assert resumed.curves.epochs == [0, 1]
    assert resumed.curves.history[1] == whole.curves.history[1]
    assert whole.curves.history[1]["net.0"]["spectrum_rows"] == 10


def test_saved_sums_are_not_continued_by_a_monitor_with_other_settings(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="killed"):
        _fit(tmp_path, {}, kill_at=11)
    message = (
        r"the fit resumed inside epoch 1, after 3 of its batches: that epoch is measured on the batches still to "
        r"come \(its spectrum_rows counts them\): the checkpoint holds the sums of 3 of its batches, which this fit "
        r"does not continue: the monitor's settings differ \(max_samples 4096 there, 20 here\)"
    )
    with pytest.warns(UserWarning, match=message):
        resumed = _fit(tmp_path, {}, ckpt=tmp_path / "step=11.ckpt", max_samples=20)
    assert resumed.curves.history[1]["net.0"]["spectrum_rows"] == 20  # from the 5 batches after the resume


def _stream_over(model: nn.Module, loaders: list, batches: list, state: dict | None = None) -> dict:
    """A stream of ``model``'s first Linear over ``batches`` of ``loaders``' first loader, started afresh or resumed
    from a saved ``state``; returns its saved state."""
    stream = ActivationStream(
        {"fc": "0"}, num_classes=None, reductions={}, spectrum_options={}, batch_reader=BatchReader()
    )
    if state is None:
        stream.start(model, num_batches=4, loaders=loaders)
    else:
        stream.resume(model, state, "cpu", loaders=loaders)
    for batch in batches:
        stream.batch_start(batch, loader=0)
        model(batch[0])
        stream.batch_end()
    return stream.pass_state()


def test_a_resumed_pass_leaves_out_the_samples_a_distributed_sampler_repeats(tmp_path: Path) -> None:
    # 7 samples on the second of 2 processes: 4 each, the last of the second process a repeat of the first sample.
    data = TensorDataset(torch.randn(7, 5, generator=torch.Generator().manual_seed(0)), torch.zeros(7))
    loader = DataLoader(data, batch_size=1, sampler=DistributedSampler(data, num_replicas=2, rank=1, shuffle=False))
    model, batches = nn.Sequential(nn.Linear(5, 3)), list(loader)
    with torch.no_grad():
        whole = _stream_over(model, [loader], batches)
        saved = _stream_over(model, [loader], batches[:2])
        resumed = _stream_over(model, [loader], batches[2:], torch.load(_saved(tmp_path, saved)))
    assert whole["inputs_measured"] == resumed["inputs_measured"] == 3
    gram = whole["layers"]["fc"]["states"]["gram"]
    assert torch.equal(resumed["layers"]["fc"]["states"]["gram"], gram)


def _saved(root: Path, state: dict) -> Path:
    torch.save(state, root / "pass.pt")
    return root / "pass.pt"


def test_sums_saved_by_two_processes_are_not_continued_by_one(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="killed"):
        _fit(tmp_path, {}, kill_at=11)
    checkpoint = torch.load(tmp_path / "step=11.ckpt", weights_only=False)
    (state,) = [state["open_epoch"] for state in checkpoint["callbacks"].values() if "open_epoch" in state]
    state["streams"] = [state.pop("stream")] * 2  # as two processes save them
    torch.save(checkpoint, tmp_path / "two.ckpt")
    message = r"holds the sums of 3 of its batches, .*: it was saved by 2 processes and the fit runs on 1, each"
    with pytest.warns(UserWarning, match=message):
        resumed = _fit(tmp_path, {}, ckpt=tmp_path / "two.ckpt")
    assert resumed.curves.history[1]["net.0"]["spectrum_rows"] == 20  # the 5 batches after the resume
