"""Generated data with known structure: Gaussian mixtures (Zangrando Sec. 4) and Gaussian noise (Feng, Daneshmand)."""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
from torch.utils.data import TensorDataset

from rank_lightning.data.base import RankDataModule, check_split_fractions, register_datamodule, stratified_split
from rank_lightning.validation import check_non_negative, check_positive_int, check_positive_ints

_LABEL_MODES = ("random", "balanced")


def _tensor_splits(
    inputs: np.ndarray, labels: np.ndarray, val_fraction: float, test_fraction: float, seed: int
) -> tuple[TensorDataset, TensorDataset, TensorDataset]:
    """Stratified train/val/test tensor datasets; ``val_fraction=0`` makes validation reuse the test split."""
    x = torch.from_numpy(inputs).float()
    y = torch.from_numpy(labels.astype(np.int64))
    parts = stratified_split(labels, (val_fraction, test_fraction), seed)
    train, val, test = (TensorDataset(x[torch.from_numpy(p)], y[torch.from_numpy(p)]) for p in parts)
    return train, val if val_fraction > 0 else test, test


@register_datamodule("gaussian_mixture")
class GaussianMixtureDataModule(RankDataModule):
    """Balanced isotropic Gaussian mixture: ``x = mu_k + sigma * z``, ``z ~ N(0, I_dim)`` (Zangrando Sec. 4, 6.1).

    The ``num_classes`` cluster means ``mu_k`` are drawn once from ``N(0, center_scale^2 I_dim)`` and exposed as
    ``centers`` (``(num_classes, dim)``), e.g. for Zangrando's centroid-based loss. Means and noise come from two
    independent streams spawned from ``seed``, so for a fixed seed the means and every ``z`` are the same whatever
    ``sigma`` and ``samples_per_class``: a sweep over ``sigma`` rescales the within-cluster spread of one and the
    same data set. With the labels as partition the expected total cluster variation is
    ``sum_k (n_k - 1) * dim * sigma^2`` (Zangrando Prop. 4.1, balanced isotropic case).

    ``y`` is always the blob index. For the autoencoding task of Zangrando Sec. 6.1 the autoencoder module takes
    ``x`` itself as its target and ignores ``y``. Inputs are not pixels and are not normalised: ``mean = (0.0,)``,
    ``std = (1.0,)``. The ``samples_per_class`` samples of every blob are split like
    :class:`~rank_lightning.data.digits.DigitsDataModule` (stratified, seeded, ``val_fraction=0`` validates on the
    test split).

    Args:
        num_classes: number of blobs K.
        dim: input dimension.
        sigma: standard deviation of every coordinate within a blob (>= 0).
        samples_per_class: samples drawn from each blob, before splitting.
        center_scale: standard deviation of the coordinates of the cluster means.
        val_fraction: fraction of every blob held out for validation, in ``[0, 1)``.
        test_fraction: fraction of every blob held out for testing, in ``(0, 1)``.
        batch_size: samples per batch.
        num_workers: loader worker processes.
        pin_memory: page-lock batches.
        seed: seeds the means, the samples, the split and the training shuffle order.
        drop_last: drop the last incomplete training batch.

    Example::

        dm = GaussianMixtureDataModule(num_classes=4, dim=16, sigma=0.1, batch_size=600)
        dm.setup("fit")
        x, y = next(iter(dm.train_dataloader()))  # (600, 16) float32, (600,) int64 blob indices
    """

    def __init__(
        self,
        *,
        num_classes: int = 4,
        dim: int = 16,
        sigma: float = 0.1,
        samples_per_class: int = 250,
        center_scale: float = 1.0,
        val_fraction: float = 0.2,
        test_fraction: float = 0.2,
        batch_size: int = 128,
        num_workers: int = 0,
        pin_memory: bool = False,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        super().__init__(
            batch_size=batch_size, num_workers=num_workers, pin_memory=pin_memory, seed=seed, drop_last=drop_last
        )
        for name, count in (("num_classes", num_classes), ("dim", dim), ("samples_per_class", samples_per_class)):
            check_positive_int(name, count)
        check_non_negative("sigma", sigma)
        check_non_negative("center_scale", center_scale)
        check_split_fractions(val_fraction, test_fraction)
        self.save_hyperparameters()
        self.num_classes = num_classes
        self.dim = dim
        self.sigma = sigma
        self.samples_per_class = samples_per_class
        self.val_fraction = val_fraction
        self.test_fraction = test_fraction
        self.input_shape = (dim,)
        self.mean = (0.0,)
        self.std = (1.0,)
        self._center_seed, self._noise_seed = np.random.SeedSequence(seed).spawn(2)
        centers = center_scale * np.random.default_rng(self._center_seed).standard_normal((num_classes, dim))
        self.centers = torch.from_numpy(centers).float()

    def setup(self, stage: str | None = None) -> None:
        """Draw the samples and build the three splits (all stages at once; repeated calls reuse them)."""
        if self.train_set is not None:
            return
        labels = np.repeat(np.arange(self.num_classes), self.samples_per_class)
        noise = np.random.default_rng(self._noise_seed).standard_normal((labels.size, self.dim))
        inputs = self.centers.double().numpy()[labels] + self.sigma * noise
        self.train_set, self.val_set, self.test_set = _tensor_splits(
            inputs, labels, self.val_fraction, self.test_fraction, self.seed
        )


@register_datamodule("gaussian_noise")
class GaussianNoiseDataModule(RankDataModule):
    """Standard Gaussian inputs of any shape, the probe inputs of Feng Fig. 1(d-f) and Daneshmand Fig. 2-3.

    Every input entry is drawn i.i.d. from ``N(0, 1)``; labels carry no information about the inputs:
    ``labels="random"`` draws them uniformly from ``range(num_classes)``, ``labels="balanced"`` assigns sample
    ``i`` the class ``i mod num_classes`` (equal class sizes). Inputs are already standard: ``mean`` and ``std``
    are zeros and ones per channel (the first entry of ``input_shape`` for images, one entry for vectors).
    Splits as in :class:`~rank_lightning.data.digits.DigitsDataModule`.

    Args:
        input_shape: shape of one input, ``(d,)`` or ``(C, H, W)``.
        num_classes: number of label values.
        num_samples: samples drawn in total, before splitting.
        labels: ``"random"`` or ``"balanced"``.
        val_fraction: fraction of every class held out for validation, in ``[0, 1)``.
        test_fraction: fraction of every class held out for testing, in ``(0, 1)``.
        batch_size: samples per batch.
        num_workers: loader worker processes.
        pin_memory: page-lock batches.
        seed: seeds the inputs, the labels, the split and the training shuffle order.
        drop_last: drop the last incomplete training batch.

    Example::

        dm = GaussianNoiseDataModule(input_shape=(32,), num_samples=160, val_fraction=0.0, test_fraction=0.2)
        dm.setup("fit")
        x, y = next(iter(dm.train_dataloader()))  # (128, 32) float32, (128,) int64
    """

    def __init__(
        self,
        *,
        input_shape: tuple[int, ...] = (32,),
        num_classes: int = 10,
        num_samples: int = 1280,
        labels: Literal["random", "balanced"] = "random",
        val_fraction: float = 0.2,
        test_fraction: float = 0.2,
        batch_size: int = 128,
        num_workers: int = 0,
        pin_memory: bool = False,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        super().__init__(
            batch_size=batch_size, num_workers=num_workers, pin_memory=pin_memory, seed=seed, drop_last=drop_last
        )
        if labels not in _LABEL_MODES:
            raise ValueError(f"unknown labels {labels!r}; choose one of: {', '.join(_LABEL_MODES)}")
        # Saved as a tuple, as the classifier saves the value it is given from this attribute: Lightning merges the two
        # hparams and refuses a list against an equal tuple (the CLI saves both as lists).
        input_shape = check_positive_ints("input_shape", input_shape)
        check_positive_int("num_classes", num_classes)
        check_positive_int("num_samples", num_samples)
        check_split_fractions(val_fraction, test_fraction)
        self.save_hyperparameters()
        self.num_classes = num_classes
        self.num_samples = num_samples
        self.labels = labels
        self.val_fraction = val_fraction
        self.test_fraction = test_fraction
        self.input_shape = input_shape
        channels = self.input_shape[0] if len(self.input_shape) == 3 else 1
        self.mean = (0.0,) * channels
        self.std = (1.0,) * channels

    def setup(self, stage: str | None = None) -> None:
        """Draw inputs and labels and build the three splits (all stages at once; repeated calls reuse them)."""
        if self.train_set is not None:
            return
        rng = np.random.default_rng(self.seed)
        inputs = rng.standard_normal((self.num_samples, *self.input_shape), dtype=np.float32)
        if self.labels == "random":
            labels = rng.integers(0, self.num_classes, self.num_samples)
        else:
            labels = np.arange(self.num_samples) % self.num_classes
        self.train_set, self.val_set, self.test_set = _tensor_splits(
            inputs, labels, self.val_fraction, self.test_fraction, self.seed
        )
