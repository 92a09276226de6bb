import numpy as np
import pytest
import pytorch_lightning as pl
import torch

from rank_lightning.data import (
    DigitsDataModule,
    GaussianNoiseDataModule,
    RankDataModule,
    create_datamodule,
    list_datamodules,
    stratified_split,
)
from rank_lightning.data.base import EpochShuffleSampler, check_split_fractions
from rank_lightning.modules import ImageClassifier

EXPECTED_NAMES = [
    "cifar10",
    "cifar100",
    "digits",
    "fashion_mnist",
    "gaussian_mixture",
    "gaussian_noise",
    "image_folder",
    "mnist",
]


def test_registry_lists_every_datamodule():
    assert list_datamodules() == EXPECTED_NAMES


@pytest.mark.parametrize("name", ["digits", "gaussian_mixture", "gaussian_noise", "mnist", "cifar10", "cifar100"])
def test_interface_is_known_after_init_without_files(name, tmp_path):
    kwargs = {"data_dir": tmp_path} if name in ("mnist", "cifar10", "cifar100") else {}
    dm = create_datamodule(name, **kwargs)
    assert isinstance(dm, RankDataModule)
    assert isinstance(dm, pl.LightningDataModule)
    assert isinstance(dm.num_classes, int) and dm.num_classes > 1
    assert all(isinstance(s, int) for s in dm.input_shape)
    channels = dm.input_shape[0] if len(dm.input_shape) == 3 else 1
    assert len(dm.mean) == len(dm.std) == channels
    assert all(s > 0 for s in dm.std)


def test_create_passes_kwargs():
    dm = create_datamodule("digits", batch_size=7, flatten=True)
    assert isinstance(dm, DigitsDataModule)
    assert dm.batch_size == 7 and dm.input_shape == (64,)
    assert dm.hparams["batch_size"] == 7


def test_unknown_name_lists_choices():
    with pytest.raises(ValueError, match=r"unknown datamodule 'imagenet'.*digits.*gaussian_mixture"):
        create_datamodule("imagenet")


def test_stratified_split_partitions_each_class_by_rounded_fractions():
    rng = np.random.default_rng(3)
    labels = rng.integers(0, 5, 503)
    rest, val, test = stratified_split(labels, (0.2, 0.15), seed=11)
    everything = np.concatenate([rest, val, test])
    assert np.array_equal(np.sort(everything), np.arange(labels.size))
    for cls in range(5):
        n_c = int((labels == cls).sum())
        assert int((labels[val] == cls).sum()) == round(0.2 * n_c)
        assert int((labels[test] == cls).sum()) == round(0.15 * n_c)
    assert all(p.dtype == np.int64 for p in (rest, val, test))


def test_stratified_split_is_deterministic_and_seeded():
    labels = np.repeat(np.arange(4), 50)
    first = stratified_split(labels, (0.3,), seed=0)
    again = stratified_split(labels, (0.3,), seed=0)
    other = stratified_split(labels, (0.3,), seed=1)
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    assert not np.array_equal(first[1], other[1])


@pytest.mark.parametrize("fractions", [(1.0,), (-0.1,), (0.6, 0.5)])
def test_stratified_split_rejects_bad_fractions(fractions):
    with pytest.raises(ValueError, match="fractions"):
        stratified_split(np.zeros(10, dtype=int), fractions, seed=0)


@pytest.mark.parametrize(
    ("val", "test", "match"),
    [(-0.1, 0.2, "val_fraction"), (0.2, 0.0, "test_fraction"), (0.2, 1.0, "test_fraction"), (0.5, 0.5, r"0.5 \+ 0.5")],
)
def test_check_split_fractions_names_the_bad_value(val, test, match):
    with pytest.raises(ValueError, match=match):
        check_split_fractions(val, test)


def test_loaders_require_setup():
    dm = GaussianNoiseDataModule()
    with pytest.raises(RuntimeError, match="call setup"):
        dm.train_dataloader()


def test_bad_loader_settings_raise():
    with pytest.raises(ValueError, match="batch_size"):
        GaussianNoiseDataModule(batch_size=0)
    with pytest.raises(ValueError, match="num_workers"):
        GaussianNoiseDataModule(num_workers=-1)


def _labels_in_order(loader):
    return torch.cat([y for _, y in loader])


def test_train_is_shuffled_by_seed_and_eval_loaders_are_not():
    dm = GaussianNoiseDataModule(num_samples=400, batch_size=32, seed=5)
    dm.setup("fit")
    first = _labels_in_order(dm.train_dataloader())
    again = _labels_in_order(dm.train_dataloader())
    dataset_order = dm.train_set.tensors[1]
    assert torch.equal(first, again)
    assert not torch.equal(first, dataset_order)
    assert torch.equal(torch.sort(first).values, torch.sort(dataset_order).values)
    assert torch.equal(_labels_in_order(dm.val_dataloader()), dm.val_set.tensors[1])
    assert torch.equal(_labels_in_order(dm.test_dataloader()), dm.test_set.tensors[1])


def test_drop_last_only_affects_training():
    dm = GaussianNoiseDataModule(num_samples=100, batch_size=16, drop_last=True, val_fraction=0.2, test_fraction=0.2)
    dm.setup("fit")
    assert all(len(y) == 16 for _, y in dm.train_dataloader())
    assert sum(len(y) for _, y in dm.val_dataloader()) == len(dm.val_set)


class _LinearProbe(pl.LightningModule):
    def __init__(self, in_features: int, num_classes: int) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(in_features, num_classes)
        self.seen_dtypes: set[torch.dtype] = set()

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.seen_dtypes.add(y.dtype)
        return torch.nn.functional.cross_entropy(self.layer(x.flatten(1)), y)

    def validation_step(self, batch, batch_idx):
        self.seen_dtypes.add(batch[1].dtype)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_trainer_runs_a_datamodule_end_to_end():
    dm = DigitsDataModule(batch_size=64)
    model = _LinearProbe(64, dm.num_classes)
    trainer = pl.Trainer(
        fast_dev_run=2, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False
    )
    trainer.fit(model, datamodule=dm)
    assert model.seen_dtypes == {torch.int64}


def test_a_fraction_that_rounds_to_no_sample_is_an_error():
    labels = np.repeat(np.arange(5), 4)  # four per class: round(0.1 * 4) = 0 everywhere
    with pytest.raises(ValueError, match=r"a hold-out fraction of 0.1 gives no sample.*the largest has 4 samples"):
        stratified_split(labels, (0.1,), seed=0)
    rest, part = stratified_split(labels, (0.25,), seed=0)
    assert len(part) == 5 and len(rest) == 15


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"batch_size": 2.5}, "batch_size must be a positive integer, got 2.5"),
        ({"num_workers": -1}, "num_workers must be a non-negative integer"),
        ({"seed": -1}, "seed must be a non-negative integer"),
    ],
)
def test_loader_settings_are_checked_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DigitsDataModule(**kwargs)


def _epoch_order(loader, epoch: int) -> list[int]:
    loader.sampler.set_epoch(epoch)
    return list(loader.sampler)


def test_the_training_order_is_a_function_of_seed_and_epoch():
    dm = GaussianNoiseDataModule(num_samples=400, batch_size=32, seed=5)
    dm.setup("fit")
    loader = dm.train_dataloader()
    assert isinstance(loader.sampler, EpochShuffleSampler)
    orders = [_epoch_order(loader, epoch) for epoch in range(3)]
    assert all(sorted(order) == list(range(len(dm.train_set))) for order in orders)
    assert orders[0] != orders[1] != orders[2] != orders[0]
    # A new loader, as a resumed fit builds, starts at any epoch with that epoch's order; extra passes draw nothing.
    fresh = dm.train_dataloader()
    assert _epoch_order(fresh, 2) == orders[2] and list(fresh.sampler) == orders[2]
    assert _epoch_order(fresh, 0) == orders[0]
    other_seed = GaussianNoiseDataModule(num_samples=400, batch_size=32, seed=6)
    other_seed.setup("fit")
    assert _epoch_order(other_seed.train_dataloader(), 0) != orders[0]
    [state] = np.random.SeedSequence([5, 1]).generate_state(1, np.uint64)
    assert orders[1] == torch.randperm(len(dm.train_set), generator=torch.Generator().manual_seed(int(state))).tolist()


class _RecordOrder(pl.Callback):
    """The epoch Lightning gave the training sampler and the first labels of the epoch, at every epoch start."""

    def __init__(self) -> None:
        self.epochs: list[int] = []
        self.first_labels: list[torch.Tensor] = []

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.epochs.append(trainer.train_dataloader.sampler.epoch)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == 0:
            self.first_labels.append(batch[1].clone())


def test_lightning_sets_the_epoch_of_the_training_sampler():
    dm = GaussianNoiseDataModule(num_samples=400, batch_size=32, seed=5)
    record = _RecordOrder()
    trainer = pl.Trainer(
        max_epochs=3,
        limit_train_batches=1,
        limit_val_batches=0,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[record],
    )
    trainer.fit(_LinearProbe(32, dm.num_classes), datamodule=dm)
    assert record.epochs == [0, 1, 2]
    labels = dm.train_set.tensors[1]
    for epoch, first in enumerate(record.first_labels):
        order = _epoch_order(dm.train_dataloader(), epoch)
        assert torch.equal(first, labels[order[:32]])


def test_under_ddp_lightning_shuffles_with_its_distributed_sampler():
    # What Lightning's data connector puts in the place of a training loader's sampler under DDP: a RandomSampler
    # becomes PyTorch's DistributedSampler, which shuffles by seed_everything's seed and the epoch (a custom sampler
    # would be wrapped instead, its order shuffled a second time).
    from pytorch_lightning.trainer.connectors.data_connector import _get_distributed_sampler

    dm = GaussianNoiseDataModule(num_samples=400, batch_size=32, seed=5)
    dm.setup("fit")
    sampler = _get_distributed_sampler(dm.train_dataloader(), shuffle=True, overfit_batches=0, num_replicas=2, rank=0)
    assert type(sampler) is torch.utils.data.DistributedSampler and sampler.shuffle


class _Crash(Exception):
    pass


class _CrashAtEpoch(pl.Callback):
    """Raises at the start of epoch ``epoch``, after the previous epoch's checkpoint was written, as a crash would."""

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.current_epoch == self.epoch:
            raise _Crash


def _digits_fit(root, max_epochs: int, crash_at: int | None = None, ckpt_path: str | None = None) -> ImageClassifier:
    pl.seed_everything(0)
    dm = DigitsDataModule(batch_size=64, flatten=True)
    model = ImageClassifier(
        backbone="mlp", backbone_kwargs={"depth": 2, "width": 32}, num_classes=10, input_shape=(64,), lr=0.05
    )
    trainer = pl.Trainer(
        max_epochs=max_epochs,
        limit_train_batches=4,
        limit_val_batches=1,
        accelerator="cpu",
        logger=False,
        default_root_dir=root,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[pl.callbacks.ModelCheckpoint(dirpath=root, filename="last")]
        + ([_CrashAtEpoch(crash_at)] if crash_at is not None else []),
    )
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
    return model


@pytest.mark.filterwarnings("ignore:The dirpath has changed")  # the resumed fit writes its own folder, as the CLI's
def test_a_resumed_fit_ends_with_the_weights_of_the_uninterrupted_fit(tmp_path):
    uninterrupted = _digits_fit(tmp_path / "full", max_epochs=4)
    with pytest.raises(_Crash):
        _digits_fit(tmp_path / "crashed", max_epochs=4, crash_at=2)
    assert torch.load(tmp_path / "crashed" / "last.ckpt", weights_only=False)["epoch"] == 1
    resumed = _digits_fit(tmp_path / "resumed", max_epochs=4, ckpt_path=str(tmp_path / "crashed" / "last.ckpt"))
    for (name, a), b in zip(uninterrupted.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
