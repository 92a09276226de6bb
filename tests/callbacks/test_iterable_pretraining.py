"""Language-model pre-training loops: a stream of token batches with no length (an ``IterableDataset``), ``max_steps``
with ``max_epochs=-1``, gradient accumulation and clipping, a per-step warm-up schedule, and the step-cadence
monitors."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

from rank_lightning.callbacks import ActivationRankMonitor, WeightRankMonitor
from rank_lightning.callbacks.curves import read_curve_file
from rank_lightning.functional import effective_rank, participation_ratio
from tests.callbacks.trainer_helpers import TrainBatches, quiet_trainer

VOCAB, WIDTH, TOKENS, BATCH = 24, 8, 5, 4


class _Tokens(IterableDataset):
    """Seeded token sequences ``(input_ids, next tokens)``, endless or ``limit`` of them; no ``__len__``."""

    def __init__(self, limit: int | None = None, seed: int = 0) -> None:
        self.limit, self.seed = limit, seed

    def __iter__(self):
        index = 0
        while self.limit is None or index < self.limit:
            ids = torch.randint(0, VOCAB, (TOKENS + 1,), generator=torch.Generator().manual_seed(self.seed + index))
            yield ids[:-1], ids[1:]
            index += 1


class _TinyLM(pl.LightningModule):
    """Embedding, a tanh layer and a head over the vocabulary, trained by AdamW with a per-step linear warm-up."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        layers = [nn.Embedding(VOCAB, WIDTH), nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, VOCAB)]
        self.net = nn.Sequential(*layers)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.net(ids)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return nn.functional.cross_entropy(self.net(batch[0]).flatten(0, 1), batch[1].flatten())

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", nn.functional.cross_entropy(self.net(batch[0]).flatten(0, 1), batch[1].flatten()))

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=0.01)
        warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 4))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}


def _stream(limit: int | None = None, seed: int = 0) -> DataLoader:
    return DataLoader(_Tokens(limit, seed), batch_size=BATCH)


def _pretrain(
    root: Path, callbacks: list, max_steps: int, train: DataLoader, val: DataLoader | None = None, **options: Any
) -> pl.Trainer:
    trainer = quiet_trainer(
        callbacks, max_steps=max_steps, max_epochs=-1, gradient_clip_val=1.0, default_root_dir=root, **options
    )
    trainer.fit(_TinyLM(), train, val)
    return trainer


def _rows(record: TrainBatches, numbers: list[int]) -> torch.Tensor:
    return torch.cat([record.batches[i]["output"].reshape(-1, WIDTH) for i in numbers])


def test_an_endless_token_stream_is_measured_at_every_nth_step(tmp_path: Path) -> None:
    # A DataLoader of an IterableDataset without __len__ raised TypeError (its truth value asks for its length) when
    # training started, whether or not an initial point was asked for.
    record = TrainBatches()
    activations = ActivationRankMonitor(layers=["net.0"], every_n_train_steps=3, window_batches=4, verbose=False)
    weights = WeightRankMonitor(layers=["net.1"], every_n_train_steps=3, verbose=False)
    _pretrain(tmp_path, [record, activations, weights], 9, _stream(), accumulate_grad_batches=2)

    assert activations.curves.epochs == weights.curves.epochs == [0, 3, 6, 9]
    for step in (3, 6, 9):  # the 4 micro-batches of the 2 optimizer steps before the step
        rows = _rows(record, record.window(step, 4))
        logged = activations.curves.history[step]["net.0"]
        assert logged["token/spectrum_rows"] == 4 * BATCH * TOKENS
        assert logged["token/effective_rank"] == pytest.approx(float(effective_rank(rows)), rel=1e-12)
        assert logged["token/participation_ratio"] == pytest.approx(float(participation_ratio(rows)), rel=1e-12)
    # The initial point: the untrained model on the first window of the stream.
    ids = torch.stack([ids for ids, _ in itertools.islice(_Tokens(), 4 * BATCH)])
    rows = _TinyLM().net[0](ids).detach().double().reshape(-1, WIDTH)
    initial = activations.curves.history[0]["net.0"]["token/effective_rank"]
    assert initial == pytest.approx(float(effective_rank(rows)), rel=1e-12)


def test_an_epoch_of_a_finite_stream_is_measured_whole(tmp_path: Path) -> None:
    # The epoch cadence on training batches (stage="train") raised the same TypeError at the start of training.
    record = TrainBatches()
    monitor = ActivationRankMonitor(layers=["net.0"], stage="train", log_at_init=False, verbose=False)
    trainer = quiet_trainer([record, monitor], max_epochs=2, default_root_dir=tmp_path)
    trainer.fit(_TinyLM(), _stream(limit=3 * BATCH))

    assert monitor.curves.epochs == [0, 1]
    for epoch, numbers in ((0, [0, 1, 2]), (1, [3, 4, 5])):
        logged = monitor.curves.history[epoch]["net.0"]
        assert logged["token/spectrum_rows"] == 3 * BATCH * TOKENS
        assert logged["token/effective_rank"] == pytest.approx(float(effective_rank(_rows(record, numbers))), rel=1e-12)


def _short_accumulation_fit(root: Path, window: int) -> tuple[ActivationRankMonitor, TrainBatches]:
    # 10 batches an epoch, 3 per step: steps after batches 2, 5, 8 and 9 (the last alone), 4 steps an epoch.
    record = TrainBatches()
    monitor = ActivationRankMonitor(
        layers=["net.0"], every_n_train_steps=2, window_batches=window, log_at_init=False, verbose=False
    )
    _pretrain(root, [record, monitor], 12, _stream(limit=10 * BATCH), accumulate_grad_batches=3)
    return monitor, record


def test_the_step_of_a_finite_streams_short_last_accumulation_is_measured(tmp_path: Path) -> None:
    # The loader has no length: the step after batch 9 came unforeseen, its window never opened, and steps 4, 8 and 12
    # were missing from the curves, without a warning.
    monitor, record = _short_accumulation_fit(tmp_path, 1)
    assert monitor.curves.epochs == [2, 4, 6, 8, 10, 12]
    for step in monitor.curves.epochs:
        logged = monitor.curves.history[step]["net.0"]
        assert logged["token/spectrum_rows"] == BATCH * TOKENS
        rows = _rows(record, record.window(step, 1))
        assert logged["token/effective_rank"] == pytest.approx(float(effective_rank(rows)), rel=1e-12)


def test_a_window_cut_by_a_finite_streams_unforeseen_epoch_end_says_why(tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match=r"window of step 4 streamed 1 of window_batches=2 training batches: the tra"):
        monitor, record = _short_accumulation_fit(tmp_path, 2)
    assert monitor.curves.epochs == [2, 4, 6, 8, 10, 12]
    rows = {step: monitor.curves.history[step]["net.0"]["token/spectrum_rows"] for step in monitor.curves.epochs}
    assert rows == {2: 40, 4: 20, 6: 40, 8: 20, 10: 40, 12: 20}
    logged = monitor.curves.history[8]["net.0"]["token/effective_rank"]
    assert logged == pytest.approx(float(effective_rank(_rows(record, record.window(8, 1)))), rel=1e-12)


def test_the_initial_epoch_pass_over_an_endless_stream_stops_at_max_steps(tmp_path: Path) -> None:
    # max_samples=None: the initial pass read the training stream to its end, which an endless one never reaches (the
    # fit hung before its first step). It reads the batches the fit takes to max_steps, as the monitored epoch does.
    monitor = ActivationRankMonitor(layers=["net.0"], stage="train", max_samples=None, verbose=False)
    stream = _stream(limit=250 * BATCH)  # endless for this fit: a pass that does not stop fails instead of hanging
    _pretrain(tmp_path, [monitor], 3, stream, accumulate_grad_batches=2)

    assert monitor.curves.epochs == [-1, 0]
    rows = {epoch: values["net.0"]["token/spectrum_rows"] for epoch, values in monitor.curves.history.items()}
    assert rows == {-1: 6 * BATCH * TOKENS, 0: 6 * BATCH * TOKENS}
    ids = torch.stack([ids for ids, _ in itertools.islice(_Tokens(), 6 * BATCH)])
    untrained = _TinyLM().net[0](ids).detach().double().reshape(-1, WIDTH)
    initial = monitor.curves.history[-1]["net.0"]["token/effective_rank"]
    assert initial == pytest.approx(float(effective_rank(untrained)), rel=1e-12)


class _OwnGenerator(IterableDataset):
    """An endless stream drawn from a generator the dataset holds (torch's or NumPy's), which iterating moves on."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.generator = torch.Generator().manual_seed(3) if kind == "torch" else None
        self.rng = np.random.default_rng(3) if kind == "numpy" else None

    def __iter__(self):
        while True:
            if self.kind == "torch":
                ids = torch.randint(0, VOCAB, (TOKENS + 1,), generator=self.generator)
            else:
                ids = torch.from_numpy(self.rng.integers(0, VOCAB, TOKENS + 1))
            yield ids[:-1], ids[1:]


@pytest.mark.parametrize("kind", ["torch", "numpy"])
def test_monitoring_leaves_a_stream_drawn_from_the_datasets_own_generator_to_the_fit(tmp_path: Path, kind: str) -> None:
    # The initial pass (and, with log_at_init=False, the batch that plans the states) took its batches from the
    # dataset's generator: the monitored fit trained on other token sequences than the same fit unmonitored.
    trained = []
    for callbacks in ([], [ActivationRankMonitor(layers=["net.0"], every_n_train_steps=2, window_batches=2)]):
        model = _TinyLM()
        trainer = quiet_trainer(callbacks, max_steps=4, max_epochs=-1, default_root_dir=tmp_path)
        trainer.fit(model, DataLoader(_OwnGenerator(kind), batch_size=BATCH))
        trained.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert torch.equal(trained[0], trained[1])
    # Lightning fetched the fit's first batch before training started: the initial window is the two batches after it.
    ids = torch.stack([ids for ids, _ in itertools.islice(_OwnGenerator(kind), BATCH, 3 * BATCH)])
    rows = _TinyLM().net[0](ids).detach().double().reshape(-1, WIDTH)
    initial = callbacks[0].curves.history[0]["net.0"]["token/effective_rank"]
    assert initial == pytest.approx(float(effective_rank(rows)), rel=1e-12)


def test_a_window_opened_at_a_finite_streams_last_batch_and_cut_short_says_why(tmp_path: Path) -> None:
    # Steps after batches 2, 5, 8, 9, then 2 of the next epoch (step 5). The window of step 5 opens at batch 9, the
    # epoch's last, known only then: 4 of 5 batches. The warning blamed a resume or the previous window.
    monitor = ActivationRankMonitor(
        layers=["net.0"], every_n_train_steps=5, window_batches=5, log_at_init=False, verbose=False
    )
    with pytest.warns(UserWarning, match=r"step 5 streamed 4 of window_batches=5 training batches: the training loa"):
        _pretrain(tmp_path, [monitor], 5, _stream(limit=10 * BATCH), accumulate_grad_batches=3)
    assert monitor.curves.history[5]["net.0"]["token/spectrum_rows"] == 4 * BATCH * TOKENS


class _Cyclic(_Tokens):
    """The first 4 batches of sequences, endlessly: a resume that starts the stream again (a checkpoint after a
    multiple of 4 batches) gives the batches of the uninterrupted fit."""

    def __iter__(self):
        while True:
            yield from itertools.islice(_Tokens(), 4 * BATCH)


def _resumable_fit(root: Path, max_steps: int, kill_at: int | None = None, ckpt: Path | None = None) -> list:
    class _Kill(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            if trainer.global_step == kill_at:
                raise RuntimeError("killed")

    monitors = [
        ActivationRankMonitor(layers=["net.0"], every_n_train_steps=3, window_batches=2, verbose=False),
        WeightRankMonitor(layers=["net.1"], every_n_train_steps=3, verbose=False),
        ActivationRankMonitor(layers=["net.0"], max_samples=None, verbose=False),  # at every validation
    ]
    saving = ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=4, save_last=True, save_top_k=-1)
    options = dict(val_check_interval=4, check_val_every_n_epoch=None, limit_val_batches=2, enable_checkpointing=True)
    trainer = quiet_trainer(
        [*monitors, saving, _Kill()],
        max_steps=max_steps,
        max_epochs=-1,
        accumulate_grad_batches=2,
        gradient_clip_val=1.0,
        default_root_dir=root,
        **options,
    )
    trainer.fit(_TinyLM(), DataLoader(_Cyclic(), batch_size=BATCH), _stream(seed=500), ckpt_path=ckpt)
    return monitors


def test_a_killed_and_resumed_pretraining_run_gives_the_curves_of_an_uninterrupted_one(tmp_path: Path) -> None:
    whole = _resumable_fit(tmp_path / "whole", 12)
    with pytest.raises(RuntimeError, match="killed"):  # after the checkpoint of step 8, steps 9 and 10 measured
        _resumable_fit(tmp_path / "cut", 12, kill_at=10)
    with pytest.warns(UserWarning, match="resumed from a checkpoint older than the recorded curves"):
        resumed = _resumable_fit(tmp_path / "cut", 12, ckpt=tmp_path / "cut" / "ckpt" / "epoch=0-step=8.ckpt")

    assert [m.curves.epochs for m in whole] == [[0, 3, 6, 9, 12]] * 2 + [[0, 2, 4, 6, 8, 10, 12]]
    # Step 9 measured again and kept under "superseded"; the validation at step 8 (after its checkpoint, of its
    # weights) stays, and the run was killed before the validation at step 10.
    for first, again, superseded in zip(whole, resumed, ([[9]], [[9]], [])):
        assert again.curves.history == first.curves.history  # to the bit: same batches, same weights
        saved = read_curve_file(tmp_path / "cut" / "rank_curves" / f"{again.curves.namespace}_curves.json")
        assert saved["history"] == first.curves.history
        assert [sorted(block["history"]) for block in saved["superseded"]] == superseded


def test_a_validation_monitor_in_a_pretraining_fit_without_validation_data_says_it_measures_nothing(
    tmp_path: Path,
) -> None:
    # ActivationRankMonitor() measures validation runs: without validation data it recorded nothing, silently.
    monitor = ActivationRankMonitor(layers=["net.0"], verbose=False)
    expected = r"ActivationRankMonitor: this fit runs no validation \(no validation dataloader, or a module without "
    with pytest.warns(UserWarning, match=expected + r"validation_step\), so this monitor, which measures in valid"):
        _pretrain(tmp_path, [monitor], 2, _stream())
    assert monitor.curves.epochs == []
