"""scikit-learn's bundled handwritten digits: real images that need no download."""

from __future__ import annotations

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch.utils.data import TensorDataset

from rank_lightning.data.base import RankDataModule, check_split_fractions, register_datamodule, stratified_split
from rank_lightning.validation import check_bool


@register_datamodule("digits")
class DigitsDataModule(RankDataModule):
    """The 1,797 8x8 grey-level digits of ``sklearn.datasets.load_digits``, ten classes; the offline default.

    Pixels (integers 0..16) are scaled to ``[0, 1]`` and normalised with the mean and standard deviation of all
    training pixels (one channel), so the training split has mean 0 and standard deviation 1 exactly. The split is
    stratified and seeded (:func:`~rank_lightning.data.base.stratified_split` with ``seed``): per class,
    ``round(test_fraction * n_c)`` images go to the test split, ``round(val_fraction * n_c)`` to the validation
    split and the rest to training. With the defaults (0.2, 0.2) that is 1,079 / 359 / 359 images. With
    ``val_fraction=0`` all the rest trains and validation runs on the test split. The images are loaded and the
    statistics computed in ``__init__`` (milliseconds), so ``mean`` and ``std`` are known before ``setup``.

    Args:
        val_fraction: fraction of every class held out for validation, in ``[0, 1)``.
        test_fraction: fraction of every class held out for testing, in ``(0, 1)``.
        flatten: serve inputs as ``(64,)`` vectors instead of ``(1, 8, 8)`` images.
        batch_size: samples per batch.
        num_workers: loader worker processes.
        pin_memory: page-lock batches.
        seed: seeds the split and the training shuffle order.
        drop_last: drop the last incomplete training batch.

    Example::

        dm = DigitsDataModule(batch_size=64)
        dm.setup("fit")
        x, y = next(iter(dm.train_dataloader()))  # (64, 1, 8, 8) float32, (64,) int64
    """

    def __init__(
        self,
        *,
        val_fraction: float = 0.2,
        test_fraction: float = 0.2,
        flatten: bool = False,
        batch_size: int = 128,
        num_workers: int = 0,
        pin_memory: bool = False,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        super().__init__(
            batch_size=batch_size, num_workers=num_workers, pin_memory=pin_memory, seed=seed, drop_last=drop_last
        )
        check_split_fractions(val_fraction, test_fraction)
        check_bool("flatten", flatten)
        self.save_hyperparameters()
        self.val_fraction = val_fraction
        self.test_fraction = test_fraction
        self.flatten = flatten

        digits = load_digits()
        pixels = digits.images / 16.0  # (N, 8, 8) float64 in [0, 1]
        labels = digits.target.astype(np.int64)
        self.train_indices, self.val_indices, self.test_indices = stratified_split(
            labels, (val_fraction, test_fraction), seed
        )
        train_pixels = pixels[self.train_indices]
        self.num_classes = 10
        self.input_shape = (64,) if flatten else (1, 8, 8)
        self.mean = (float(train_pixels.mean()),)
        self.std = (float(train_pixels.std()),)
        normalised = (pixels - self.mean[0]) / self.std[0]
        self._inputs = torch.from_numpy(normalised.reshape(len(labels), *self.input_shape)).float()
        self._labels = torch.from_numpy(labels)

    def setup(self, stage: str | None = None) -> None:
        """Build the three splits as in-memory tensor datasets (all stages at once)."""

        def subset(indices: np.ndarray) -> TensorDataset:
            index = torch.from_numpy(indices)
            return TensorDataset(self._inputs[index], self._labels[index])

        self.train_set = subset(self.train_indices)
        self.test_set = subset(self.test_indices)
        self.val_set = subset(self.val_indices) if self.val_fraction > 0 else self.test_set
