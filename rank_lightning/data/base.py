"""The base class shared by every datamodule, the name registry, the seeded stratified split and shuffle order."""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Iterator, Sequence, Sized
from typing import Any, TypeVar

import numpy as np
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, Dataset, RandomSampler

from rank_lightning.validation import check_bool, check_finite, check_non_negative_int, check_positive_int

_REGISTRY: dict[str, type[RankDataModule]] = {}
_D = TypeVar("_D", bound="type[RankDataModule]")


def register_datamodule(name: str) -> Callable[[_D], _D]:
    """Class decorator adding a datamodule to the registry under ``name``."""

    def wrap(cls: _D) -> _D:
        if name in _REGISTRY:
            raise ValueError(f"datamodule {name!r} is registered twice")
        _REGISTRY[name] = cls
        return cls

    return wrap


def list_datamodules() -> list[str]:
    """Names accepted by :func:`create_datamodule`, sorted."""
    return sorted(_REGISTRY)


def get_datamodule_class(name: str) -> type[RankDataModule]:
    """The class registered as ``name``, e.g. ``DigitsDataModule`` for ``"digits"``; a config names it by class."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown datamodule {name!r}; datamodules are: {', '.join(list_datamodules())}")
    return _REGISTRY[name]


def create_datamodule(name: str, **kwargs: Any) -> RankDataModule:
    """Create the datamodule registered as ``name`` with the class's keyword arguments.

    Example::

        dm = create_datamodule("digits", batch_size=64, flatten=True)
        dm.num_classes, dm.input_shape  # (10, (64,))
    """
    return get_datamodule_class(name)(**kwargs)


def stratified_split(labels: np.ndarray, fractions: Sequence[float], seed: int) -> tuple[np.ndarray, ...]:
    """Split sample indices class by class into a remainder and one hold-out part per fraction.

    Within every class the indices are permuted with ``numpy.random.default_rng(seed)`` (classes visited in
    increasing label order) and ``round(fraction * class_size)`` of them go to each hold-out part, so every part
    keeps the class proportions of the whole set up to rounding.

    Args:
        labels: ``(N,)`` integer class labels.
        fractions: fraction of every class in each hold-out part; each in ``[0, 1)``, summing to less than 1.
        seed: seed of the permutation; the same labels, fractions and seed always give the same split.

    Returns:
        ``(rest, part_1, ..., part_k)``: sorted int64 index arrays, disjoint, covering ``range(N)``.

    Raises:
        ValueError: bad labels or fractions, or a positive fraction that rounds to no sample in every class (the
            split would be empty, and a loop over it would fail far from the cause).
    """
    labels = np.asarray(labels)
    if labels.ndim != 1:
        raise ValueError(f"labels must be one-dimensional, got shape {labels.shape}")
    for index, fraction in enumerate(fractions):
        check_finite(f"fractions[{index}]", fraction)
    if any(not 0.0 <= f < 1.0 for f in fractions) or sum(fractions) >= 1.0:
        raise ValueError(f"fractions must each lie in [0, 1) and sum to less than 1, got {tuple(fractions)}")
    rng = np.random.default_rng(seed)
    parts: list[list[np.ndarray]] = [[] for _ in range(len(fractions) + 1)]
    for cls in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == cls))
        start = 0
        for i, fraction in enumerate(fractions):
            count = min(round(fraction * len(members)), len(members) - start)
            parts[i + 1].append(members[start : start + count])
            start += count
        parts[0].append(members[start:])
    for i, fraction in enumerate(fractions):
        if fraction > 0 and not sum(len(p) for p in parts[i + 1]):
            largest = max(int((labels == cls).sum()) for cls in np.unique(labels)) if labels.size else 0
            raise ValueError(
                f"a hold-out fraction of {fraction} gives no sample: round({fraction} * class size) is 0 for every "
                f"class (the largest has {largest} samples); raise the fraction or use more data"
            )
    return tuple(np.sort(np.concatenate(p)).astype(np.int64) if p else np.zeros(0, np.int64) for p in parts)


class EpochShuffleSampler(RandomSampler):
    """A new random order of ``data_source`` in every epoch, which depends on ``seed`` and the epoch alone.

    Epoch ``e`` reads the samples in the order ``torch.randperm(n, generator=torch.Generator().manual_seed(s))``,
    where ``s`` is drawn from ``numpy.random.SeedSequence([seed, e])``. Lightning calls :meth:`set_epoch` at the start
    of every training epoch with the number of epochs already finished, which a fit resumed from a checkpoint restores
    (``fit_loop`` in Lightning 2.x): the resumed fit reads every epoch in the order the uninterrupted fit read it.
    (A generator seeded once and drawn from in every epoch would restart from the first epoch's order instead.) The
    sampler keeps no random state, so an extra pass over the loader, such as a callback's, changes no later order.

    It is a :class:`~torch.utils.data.RandomSampler`, so under DDP Lightning replaces it with its
    ``DistributedSampler(shuffle=True)``, whose order is a function of ``seed_everything``'s seed and the epoch.

    Args:
        data_source: the dataset to shuffle.
        seed: seed of the orders, a non-negative integer.

    Example::

        sampler = EpochShuffleSampler(dataset, seed=0)
        loader = DataLoader(dataset, batch_size=64, sampler=sampler)
        sampler.set_epoch(3)  # Lightning does this; list(sampler) is now epoch 3's order
    """

    def __init__(self, data_source: Sized, *, seed: int = 0) -> None:
        super().__init__(data_source)
        check_non_negative_int("seed", seed)
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Serve the order of epoch ``epoch`` (0 for the first epoch) from now on."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        [state] = np.random.SeedSequence([self.seed, self.epoch]).generate_state(1, np.uint64)
        generator = torch.Generator().manual_seed(int(state))
        yield from torch.randperm(len(self.data_source), generator=generator).tolist()


def check_data_dir(data_dir: object) -> None:
    """Raise ``ValueError`` unless ``data_dir`` is a path (a string or ``os.PathLike``)."""
    if not isinstance(data_dir, (str, os.PathLike)):
        raise ValueError(f"data_dir must be a folder path, got {data_dir!r}")


def check_split_fractions(val_fraction: float, test_fraction: float) -> None:
    """Raise ``ValueError`` unless ``0 <= val_fraction``, ``0 < test_fraction`` and their sum is below 1."""
    check_finite("val_fraction", val_fraction)
    check_finite("test_fraction", test_fraction)
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must lie in [0, 1), got {val_fraction}")
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must lie in (0, 1), got {test_fraction}")
    if val_fraction + test_fraction >= 1.0:
        raise ValueError(
            f"val_fraction + test_fraction must be below 1 to leave training data, got {val_fraction} + {test_fraction}"
        )


class RankDataModule(pl.LightningDataModule):
    """Base of every datamodule in :mod:`rank_lightning.data`: loader settings and the common interface.

    Subclasses set, inside ``__init__`` (so a CLI can link them into the model before any file is read):

    - ``num_classes``: number of class labels;
    - ``input_shape``: shape of one input, ``(C, H, W)`` for images, ``(d,)`` for vectors;
    - ``mean``, ``std``: per-channel normalisation applied to pixels in ``[0, 1]`` (``x = (p - mean) / std``),
      which the attacks undo; identity ``(0.0,)``/``(1.0,)`` for inputs that are not pixels.

    and fill ``train_set``, ``val_set`` and ``test_set`` in ``setup``. Batches are ``(x, y)``: ``x`` float32 of
    shape ``(B, *input_shape)``, ``y`` int64 class labels.

    Args:
        batch_size: samples per batch, in every split.
        num_workers: loader worker processes; 0 loads in the main process.
        pin_memory: page-lock batches for faster host-to-GPU copies.
        seed: seeds everything random in the data (splits, generated samples, the training shuffle order); a
            non-negative integer.
        drop_last: drop the last incomplete training batch (BatchNorm fails on a batch of one sample).
    """

    num_classes: int
    input_shape: tuple[int, ...]
    mean: tuple[float, ...]
    std: tuple[float, ...]

    def __init__(
        self,
        *,
        batch_size: int = 128,
        num_workers: int = 0,
        pin_memory: bool = False,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        super().__init__()
        check_positive_int("batch_size", batch_size)
        check_non_negative_int("num_workers", num_workers)
        check_non_negative_int("seed", seed)
        check_bool("pin_memory", pin_memory)
        check_bool("drop_last", drop_last)
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.seed = seed
        self.drop_last = drop_last
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None
        self.test_set: Dataset | None = None

    def _save_resolved_hyperparameters(self, **values: Any) -> None:
        """Replace saved hyperparameters by the values they resolved to, e.g. ``num_classes=None`` by the count.

        The CLI links the datamodule's ``num_classes`` and ``input_shape`` into the model, which saves the resolved
        values; Lightning refuses to log a model and a datamodule that saved one key with two values ("Error while
        merging hparams"), and a checkpoint should record what was trained. Call after ``save_hyperparameters``.
        """
        self.hparams.update(values)
        self._hparams_initial.update(copy.deepcopy(values))

    def train_dataloader(self) -> DataLoader:
        """Shuffled training batches, in an order that is a function of ``seed`` and the epoch
        (:class:`EpochShuffleSampler`): a fit resumed from a checkpoint reads the epochs as the uninterrupted fit."""
        dataset = self._split("train")
        return self._loader(dataset, sampler=EpochShuffleSampler(dataset, seed=self.seed), drop_last=self.drop_last)

    def val_dataloader(self) -> DataLoader:
        """Validation batches in a fixed order."""
        return self._loader(self._split("val"), shuffle=False, drop_last=False)

    def test_dataloader(self) -> DataLoader:
        """Test batches in a fixed order."""
        return self._loader(self._split("test"), shuffle=False, drop_last=False)

    def _split(self, name: str) -> Dataset:
        dataset = getattr(self, f"{name}_set")
        if dataset is None:
            raise RuntimeError(f"the {name} split of {type(self).__name__} is not set up: call setup() first")
        return dataset

    def _loader(self, dataset: Dataset, **kwargs: Any) -> DataLoader:
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            persistent_workers=self.num_workers > 0,
            **kwargs,
        )
