"""A monitor's own pass over the training loader leaves the training loop's iterator alone: with persistent workers
(one iterator, reset by ``iter()``) and with resumable loaders (which save their last iterator's position)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from rank_lightning.callbacks import ActivationRankMonitor, LowDimensionalEvaluation
from rank_lightning.sampling import own_samples, side_loader
from tests.callbacks.trainer_helpers import ResumableBatches, quiet_trainer

ROWS = 32


def _dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(ROWS, 4, generator=generator), torch.arange(ROWS) % 2, torch.arange(ROWS))


class _Recorder(pl.LightningModule):
    """Records the sample indices of every training batch."""

    def __init__(self, **loader_options: Any) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc, self.act, self.head = nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)
        self.num_classes = 2
        self.loader_options, self.seen = loader_options, []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act(self.fc(x)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, index = batch
        self.seen.append(index.tolist())
        return nn.functional.cross_entropy(self(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_dataset(), batch_size=8, **self.loader_options)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(_dataset(), batch_size=8)


def _batches(root: Path, callbacks: list, **kwargs: Any) -> list[list[int]]:
    model = _Recorder(num_workers=1, persistent_workers=True)
    quiet_trainer(callbacks, max_epochs=2, default_root_dir=root, **kwargs).fit(model)
    return model.seen


@pytest.mark.parametrize(
    "make",
    [
        lambda: ActivationRankMonitor(layers=["act"], every_n_train_steps=2, window_batches=2, verbose=False),
        lambda: ActivationRankMonitor(layers=["act"], every_n_train_steps=2, log_at_init=False, verbose=False),
        lambda: ActivationRankMonitor(layers=["act"], stage="train", verbose=False),
        lambda: LowDimensionalEvaluation(layer="act", dims=[2], every_n_epochs=1, verbose=False),
    ],
    ids=["step cadence", "step cadence, no initial point", "training data", "low-dimensional evaluation"],
)
def test_persistent_workers_train_on_the_batches_of_the_unmonitored_fit(tmp_path: Path, make) -> None:
    every_batch = [list(range(start, start + 8)) for start in range(0, ROWS, 8)] * 2
    assert _batches(tmp_path, [], val_check_interval=0.5) == every_batch
    assert _batches(tmp_path, [make()], val_check_interval=0.5) == every_batch


class _Resumable(DataLoader):
    """A loader that keeps its last iterator and reports its position, as resumable loaders save it in checkpoints."""

    def __iter__(self) -> Any:
        self.last = super().__iter__()
        return self.last

    def state_dict(self) -> dict[str, int]:
        return {"yielded": self.last._num_yielded}


def test_a_pass_beside_the_loop_keeps_a_resumable_loaders_position() -> None:
    loader = _Resumable(_dataset(), batch_size=8)
    training = iter(loader)
    next(training), next(training)
    assert sum(1 for _ in side_loader(loader)) == ROWS // 8
    assert loader.state_dict() == {"yielded": 2}
    assert next(training)[2].tolist() == list(range(16, 24))


def test_a_pass_beside_the_loop_keeps_a_persistent_iterator_going() -> None:
    loader = DataLoader(_dataset(), batch_size=8, num_workers=1, persistent_workers=True)
    training = iter(loader)
    assert next(training)[2].tolist() == list(range(8))
    copy = side_loader(loader)
    assert [batch[2].tolist() for batch in copy] == [list(range(s, s + 8)) for s in range(0, ROWS, 8)]
    assert next(training)[2].tolist() == list(range(8, 16))


def test_the_copy_keeps_the_distributed_share_and_its_padding() -> None:
    sampler = DistributedSampler(TensorDataset(torch.arange(13)), num_replicas=2, rank=1, shuffle=False)
    loader = DataLoader(
        TensorDataset(torch.arange(13)), batch_size=4, sampler=sampler, persistent_workers=True, num_workers=1
    )
    copy = side_loader(loader)
    assert copy is not loader and own_samples(copy) == own_samples(loader) == 6
    assert [batch[0].tolist() for batch in copy] == [[1, 3, 5, 7], [9, 11, 0]]


def test_other_loaders_are_iterated_themselves() -> None:
    plain = DataLoader(_dataset(), batch_size=8)
    assert side_loader(plain) is plain
    assert side_loader([plain, plain]) == [plain, plain]
    assert side_loader({"a": plain})["a"] is plain


class _Noisy(torch.utils.data.Dataset):
    """Inputs with noise drawn in the loader's worker: its random stream decides what validation sees."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return torch.rand(4), torch.tensor(index % 2), torch.tensor(index)


class _ValidationRecorder(_Recorder):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.validated = [*getattr(self, "validated", []), batch[0].clone()]
        self(batch[0])

    def val_dataloader(self) -> DataLoader:
        return DataLoader(_Noisy(), batch_size=8, num_workers=1, persistent_workers=True)


def test_passes_over_a_persistent_validation_loader_leave_its_workers_random_state(tmp_path: Path) -> None:
    def validated(callbacks: list) -> torch.Tensor:
        pl.seed_everything(0, verbose=False)
        model = _ValidationRecorder()
        quiet_trainer(callbacks, max_epochs=2, default_root_dir=tmp_path).fit(model)
        return torch.cat(model.validated)

    plain = validated([])
    assert torch.equal(validated([ActivationRankMonitor(layers=["act"], verbose=False)]), plain)


def _every_batch(stop: int, size: int = 4) -> list[list[int]]:
    return [list(range(start, start + size)) for start in range(0, stop, size)]


def test_a_generator_of_training_batches_is_left_to_the_fit_and_the_missing_initial_point_is_named(tmp_path) -> None:
    """A one-pass iterator cannot be read beside the loop: every batch it gives is one the fit would not train on."""
    model = _Recorder()
    monitor = ActivationRankMonitor(layers=["act"], every_n_train_steps=2, window_batches=2, verbose=False)
    batches = iter(DataLoader(_dataset(), batch_size=4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_trainer([monitor], max_steps=6, max_epochs=1, default_root_dir=tmp_path).fit(model, batches)
    assert model.seen == _every_batch(24)
    assert monitor.curves.epochs == [2, 4, 6]
    named = [str(w.message) for w in caught if "no initial point" in str(w.message)]
    assert len(named) == 1 and "one-pass iterator" in named[0] and "DataLoader" in named[0], named


@pytest.mark.parametrize("log_at_init", [True, False])
def test_a_resumed_fit_continues_a_resumable_iterable_where_its_checkpoint_left_it(tmp_path, log_at_init) -> None:
    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1)
    options = dict(max_steps=3, max_epochs=1, enable_checkpointing=True, default_root_dir=tmp_path)
    quiet_trainer([checkpoint], **options).fit(_Recorder(), ResumableBatches(_dataset()))
    model = _Recorder()
    monitor = ActivationRankMonitor(layers=["act"], every_n_train_steps=2, log_at_init=log_at_init, verbose=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = quiet_trainer([monitor], **(options | {"max_steps": 6, "enable_checkpointing": False}))
        trainer.fit(
            model, ResumableBatches(_dataset()), ckpt_path=checkpoint.best_model_path or checkpoint.last_model_path
        )
    assert model.seen == _every_batch(24)[3:]
    assert monitor.curves.epochs == [4, 6]


def test_low_dimensional_evaluation_leaves_a_generator_of_training_batches_to_the_fit(tmp_path) -> None:
    model = _Recorder()
    callback = LowDimensionalEvaluation(layer="act", dims=[2], every_n_epochs=1, verbose=False)
    batches = iter(DataLoader(_dataset(), batch_size=4))
    trainer = quiet_trainer([callback], max_epochs=1, limit_train_batches=8, val_check_interval=4)
    with pytest.warns(UserWarning, match=r"the training loader is a one-pass iterator .* nothing evaluated"):
        trainer.fit(model, batches, DataLoader(_dataset(), batch_size=8))
    assert model.seen == _every_batch(32)
    assert callback.results == {}
