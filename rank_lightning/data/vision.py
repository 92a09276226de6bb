"""MNIST, Fashion-MNIST, CIFAR-10 and CIFAR-100, read from disk by torchvision and served from memory.

torchvision reads the files (and checks CIFAR's md5 sums); the decoded uint8 images are kept as one
``(N, C, H, W)`` tensor and every sample is scaled, normalised and optionally augmented as a tensor, which is
about twenty times cheaper per sample than torchvision's PIL round trip on a CPU.

Nothing is downloaded unless ``download=True``. When files are missing, ``prepare_data`` and ``setup`` raise
``FileNotFoundError`` naming every missing file and how to obtain it; files present but corrupted (CIFAR md5
mismatch) raise ``RuntimeError`` saying so.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from torch.utils.data import Dataset
from torchvision import datasets
from torchvision.transforms import v2

from rank_lightning.data.base import RankDataModule, check_data_dir, register_datamodule, stratified_split
from rank_lightning.validation import SetupError, check_bool, check_finite

_CIFAR100_LABELS = ("fine", "coarse")


class PixelDataset(Dataset):
    """uint8 images served as normalised float32 tensors: ``x = (augment(p) / 255 - mean) / std``.

    Args:
        images: ``(N, C, H, W)`` uint8 pixels.
        targets: ``(N,)`` int64 labels.
        mean: per-channel mean of the normalisation.
        std: per-channel standard deviation of the normalisation.
        augment: random transform of one uint8 ``(C, H, W)`` image, applied before scaling; None for none.
        flatten: return ``(C * H * W,)`` vectors instead of ``(C, H, W)`` images.
    """

    def __init__(
        self,
        images: torch.Tensor,
        targets: torch.Tensor,
        mean: tuple[float, ...],
        std: tuple[float, ...],
        augment: Callable[[torch.Tensor], torch.Tensor] | None = None,
        flatten: bool = False,
    ) -> None:
        if images.dtype != torch.uint8 or images.ndim != 4:
            raise ValueError(f"images must be a (N, C, H, W) uint8 tensor, got {images.dtype} {tuple(images.shape)}")
        if len(images) != len(targets):
            raise ValueError(f"{len(images)} images but {len(targets)} targets")
        self.images = images
        self.targets = targets.long()
        self.mean = torch.tensor(mean, dtype=torch.float32).view(-1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(-1, 1, 1)
        if augment is not None and not callable(augment):
            raise ValueError(f"augment must be None or a callable on one image tensor, got {augment!r}")
        self.augment = augment
        self.flatten = check_bool("flatten", flatten)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        image = self.images[index]
        if self.augment is not None:
            image = self.augment(image)
        x = (image.float() / 255.0 - self.mean) / self.std
        return (x.reshape(-1) if self.flatten else x), self.targets[index]


class TorchvisionDataModule(RankDataModule):
    """Shared logic of the torchvision-backed datamodules: file checks, download, split, datasets.

    The official training set is split (stratified, seeded) into training and validation parts, with
    ``round(val_fraction * n_c)`` images of every class for validation; the official test set is the test split.
    ``val_fraction=0`` trains on the whole official training set and validates on the official test set (the
    setting of most papers, which report test accuracy).

    Subclasses set ``torchvision_class``, ``display_name``, ``num_classes``, the normalisation constants
    ``pixel_mean``/``pixel_std``, and implement ``_read``, ``_expected_files`` and ``_how_to_get``.
    """

    torchvision_class: type[datasets.VisionDataset]
    display_name: str
    pixel_mean: tuple[float, ...]
    pixel_std: tuple[float, ...]
    image_shape: tuple[int, int, int]

    def __init__(
        self,
        *,
        data_dir: str | Path,
        download: bool,
        val_fraction: float,
        flatten: bool,
        batch_size: int,
        num_workers: int,
        pin_memory: bool,
        seed: int,
        drop_last: bool,
    ) -> None:
        super().__init__(
            batch_size=batch_size, num_workers=num_workers, pin_memory=pin_memory, seed=seed, drop_last=drop_last
        )
        check_finite("val_fraction", val_fraction)
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction must lie in [0, 1), got {val_fraction}")
        check_bool("download", download)
        check_bool("flatten", flatten)
        check_data_dir(data_dir)
        self.data_dir = Path(data_dir)
        self.download = download
        self.val_fraction = val_fraction
        self.flatten = flatten
        self.input_shape = (int(np.prod(self.image_shape)),) if flatten else self.image_shape
        self.mean = self.pixel_mean
        self.std = self.pixel_std

    def prepare_data(self) -> None:
        """Download both official splits when ``download=True``; then check that every file is in place."""
        if self.download:
            try:
                for train in (True, False):
                    self.torchvision_class(str(self.data_dir), train=train, download=True)
            except (OSError, RuntimeError) as err:
                raise SetupError(
                    f"downloading {self.display_name} into {self.data_dir} failed: {err}. "
                    f"Without internet access, {self._how_to_get()}"
                ) from err
        self._check_files()

    def setup(self, stage: str | None = None) -> None:
        """Read both official splits and build train/val/test (all stages at once; repeated calls reuse them)."""
        if self.train_set is not None:
            return
        self._check_files()
        try:
            train_images, train_targets = self._read(train=True)
            test_images, test_targets = self._read(train=False)
        except RuntimeError as err:
            raise SetupError(
                f"{self.display_name} files under {self.data_dir} are present but torchvision rejected them ({err}); "
                f"they are corrupted or incomplete: delete them and {self._how_to_get()}"
            ) from err
        train_idx, val_idx = (
            torch.from_numpy(i) for i in stratified_split(train_targets.numpy(), (self.val_fraction,), self.seed)
        )

        def pixels(images: torch.Tensor, targets: torch.Tensor, augment: Callable | None = None) -> PixelDataset:
            return PixelDataset(images, targets, self.mean, self.std, augment=augment, flatten=self.flatten)

        self.train_set = pixels(train_images[train_idx], train_targets[train_idx], self._train_augment())
        self.test_set = pixels(test_images, test_targets)
        self.val_set = pixels(train_images[val_idx], train_targets[val_idx]) if self.val_fraction > 0 else self.test_set

    def _train_augment(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        return None

    def _read(self, train: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """One official split as ``(N, C, H, W)`` uint8 images and ``(N,)`` int64 labels."""
        raise NotImplementedError(f"{type(self).__name__} must implement _read")

    def _expected_files(self) -> list[Path]:
        """Every file torchvision reads, as paths under ``data_dir``."""
        raise NotImplementedError(f"{type(self).__name__} must implement _expected_files")

    def _how_to_get(self) -> str:
        """How to put the files in place, as the end of a sentence."""
        raise NotImplementedError(f"{type(self).__name__} must implement _how_to_get")

    def _check_files(self) -> None:
        missing = [p for p in self._expected_files() if not p.is_file()]
        if missing:
            folders: dict[Path, list[str]] = {}
            for path in missing:
                folders.setdefault(path.parent, []).append(path.name)
            listing = "; ".join(f"in {folder}/: {', '.join(names)}" for folder, names in folders.items())
            raise FileNotFoundError(
                f"{self.display_name} not found, missing files {listing}. "
                "Set download=True (--data.init_args.download=true) on a machine with internet access, or "
                f"{self._how_to_get()}"
            )


@register_datamodule("mnist")
class MNISTDataModule(TorchvisionDataModule):
    """MNIST handwritten digits, ``(1, 28, 28)``, ten classes, via ``torchvision.datasets.MNIST``.

    Expects the four uncompressed idx files ``{train,t10k}-{images-idx3,labels-idx1}-ubyte`` in
    ``<data_dir>/MNIST/raw/`` (the layout torchvision's download produces), or torchvision's older
    ``<data_dir>/MNIST/processed/{training,test}.pt``. Normalisation: the usual training-set
    constants mean 0.1307, std 0.3081. Split: see :class:`TorchvisionDataModule`.

    Args:
        data_dir: root folder holding ``MNIST/raw/``.
        download: download the files when missing (needs internet access).
        val_fraction: fraction of every class of the official training set held out for validation.
        flatten: serve ``(784,)`` vectors instead of ``(1, 28, 28)`` images.
        batch_size: samples per batch.
        num_workers: loader worker processes.
        pin_memory: page-lock batches.
        seed: seeds the split and the training shuffle order.
        drop_last: drop the last incomplete training batch.

    Example::

        dm = MNISTDataModule(data_dir="data/", download=True)
        dm.prepare_data()
        dm.setup("fit")
    """

    torchvision_class = datasets.MNIST
    display_name = "MNIST"
    pixel_mean = (0.1307,)
    pixel_std = (0.3081,)
    image_shape = (1, 28, 28)

    def __init__(
        self,
        *,
        data_dir: str | Path = "data/",
        download: bool = False,
        val_fraction: float = 0.1,
        flatten: bool = False,
        batch_size: int = 128,
        num_workers: int = 0,
        pin_memory: bool = False,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        super().__init__(
            data_dir=data_dir,
            download=download,
            val_fraction=val_fraction,
            flatten=flatten,
            batch_size=batch_size,
            num_workers=num_workers,
            pin_memory=pin_memory,
            seed=seed,
            drop_last=drop_last,
        )
        self.save_hyperparameters()
        self.num_classes = 10

    def _raw_folder(self) -> Path:
        return self.data_dir / self.torchvision_class.__name__ / "raw"

    def _expected_files(self) -> list[Path]:
        # torchvision's older layout, processed/{training,test}.pt, which torchvision still reads first when present.
        processed = self._raw_folder().parent / "processed"
        legacy = [processed / self.torchvision_class.training_file, processed / self.torchvision_class.test_file]
        if all(path.is_file() for path in legacy):
            return legacy
        # torchvision downloads the .gz archives and reads their uncompressed copies.
        names = [os.path.basename(url).removesuffix(".gz") for url, _ in self.torchvision_class.resources]
        return [self._raw_folder() / name for name in names]

    def _how_to_get(self) -> str:
        mirror = self.torchvision_class.mirrors[0]
        archives = ", ".join(name for name, _ in self.torchvision_class.resources)
        return f"download {archives} from {mirror} and gunzip them into {self._raw_folder()}/."

    def _read(self, train: bool) -> tuple[torch.Tensor, torch.Tensor]:
        dataset = self.torchvision_class(str(self.data_dir), train=train, download=False)
        return dataset.data.unsqueeze(1), dataset.targets.long()  # (N, 28, 28) -> (N, 1, 28, 28)


@register_datamodule("fashion_mnist")
class FashionMNISTDataModule(MNISTDataModule):
    """Fashion-MNIST clothing images, ``(1, 28, 28)``, ten classes, via ``torchvision.datasets.FashionMNIST``.

    Same files and arguments as :class:`MNISTDataModule`, under ``<data_dir>/FashionMNIST/raw/``.
    Normalisation: training-set constants mean 0.2860, std 0.3530.
    """

    torchvision_class = datasets.FashionMNIST
    display_name = "Fashion-MNIST"
    pixel_mean = (0.2860,)
    pixel_std = (0.3530,)


class CIFARDataModule(TorchvisionDataModule):
    """Shared CIFAR logic: the pickled ``python`` version files and the standard training augmentation.

    ``augment=True`` applies the standard CIFAR augmentation to training images only: a random 32x32 crop of the
    image zero-padded by 4 pixels, then a horizontal flip with probability 1/2.
    """

    torchvision_class: type[datasets.CIFAR10]
    image_shape = (3, 32, 32)
    augment: bool

    def _train_augment(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        if not self.augment:
            return None
        return v2.Compose([v2.RandomCrop(32, padding=4), v2.RandomHorizontalFlip()])

    def _folder(self) -> Path:
        return self.data_dir / self.torchvision_class.base_folder

    def _expected_files(self) -> list[Path]:
        tv = self.torchvision_class
        names = [name for name, _ in tv.train_list + tv.test_list] + [tv.meta["filename"]]
        return [self._folder() / name for name in names]

    def _how_to_get(self) -> str:
        tv = self.torchvision_class
        return f"download {tv.url} and extract it into {self.data_dir}/ so that {self._folder()}/ exists."

    def _read(self, train: bool) -> tuple[torch.Tensor, torch.Tensor]:
        dataset = self.torchvision_class(str(self.data_dir), train=train, download=False)
        images = torch.from_numpy(dataset.data).permute(0, 3, 1, 2).contiguous()  # (N, H, W, C) -> (N, C, H, W)
        return images, torch.tensor(dataset.targets, dtype=torch.int64)


@register_datamodule("cifar10")
class CIFAR10DataModule(CIFARDataModule):
    """CIFAR-10, ``(3, 32, 32)``, ten classes, via ``torchvision.datasets.CIFAR10``.

    Expects ``<data_dir>/cifar-10-batches-py/`` with ``data_batch_1`` .. ``data_batch_5``, ``test_batch`` and
    ``batches.meta`` (the extracted ``cifar-10-python.tar.gz``); torchvision checks their md5 sums. Normalisation:
    per-channel training-set mean (0.4914, 0.4822, 0.4465) and standard deviation (0.2470, 0.2435, 0.2616).
    Split: see :class:`TorchvisionDataModule`; augmentation: see :class:`CIFARDataModule`.

    Args:
        data_dir: root folder holding ``cifar-10-batches-py/``.
        download: download the archive when files are missing (needs internet access).
        val_fraction: fraction of every class of the official training set held out for validation.
        augment: random crop (padding 4) and horizontal flip of training images.
        batch_size: samples per batch.
        num_workers: loader worker processes.
        pin_memory: page-lock batches.
        seed: seeds the split and the training shuffle order.
        drop_last: drop the last incomplete training batch.

    Example::

        dm = CIFAR10DataModule(data_dir="data/", augment=True, val_fraction=0.0)
        dm.setup("fit")
    """

    torchvision_class = datasets.CIFAR10
    display_name = "CIFAR-10"
    pixel_mean = (0.4914, 0.4822, 0.4465)
    pixel_std = (0.2470, 0.2435, 0.2616)

    def __init__(
        self,
        *,
        data_dir: str | Path = "data/",
        download: bool = False,
        val_fraction: float = 0.1,
        augment: bool = False,
        batch_size: int = 128,
        num_workers: int = 0,
        pin_memory: bool = False,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        super().__init__(
            data_dir=data_dir,
            download=download,
            val_fraction=val_fraction,
            flatten=False,
            batch_size=batch_size,
            num_workers=num_workers,
            pin_memory=pin_memory,
            seed=seed,
            drop_last=drop_last,
        )
        check_bool("augment", augment)
        self.save_hyperparameters()
        self.augment = augment
        self.num_classes = 10


@register_datamodule("cifar100")
class CIFAR100DataModule(CIFARDataModule):
    """CIFAR-100, ``(3, 32, 32)``, with its 100 fine or 20 coarse (superclass) labels.

    Expects ``<data_dir>/cifar-100-python/`` with ``train``, ``test`` and ``meta`` (the extracted
    ``cifar-100-python.tar.gz``); torchvision checks their md5 sums and reads the fine labels. For
    ``labels="coarse"`` (Sanyal Tables 3-4) the ``coarse_labels`` entry is read from the same pickled
    ``train``/``test`` files, whose samples are in the same order. Normalisation: per-channel training-set mean
    (0.5071, 0.4865, 0.4409) and standard deviation (0.2673, 0.2564, 0.2762). Split: see
    :class:`TorchvisionDataModule` (stratified by the chosen labels); augmentation: see :class:`CIFARDataModule`.

    Args:
        data_dir: root folder holding ``cifar-100-python/``.
        download: download the archive when files are missing (needs internet access).
        labels: ``"fine"`` (100 classes) or ``"coarse"`` (20 superclasses).
        val_fraction: fraction of every class of the official training set held out for validation.
        augment: random crop (padding 4) and horizontal flip of training images.
        batch_size: samples per batch.
        num_workers: loader worker processes.
        pin_memory: page-lock batches.
        seed: seeds the split and the training shuffle order.
        drop_last: drop the last incomplete training batch.
    """

    torchvision_class = datasets.CIFAR100
    display_name = "CIFAR-100"
    pixel_mean = (0.5071, 0.4865, 0.4409)
    pixel_std = (0.2673, 0.2564, 0.2762)

    def __init__(
        self,
        *,
        data_dir: str | Path = "data/",
        download: bool = False,
        labels: Literal["fine", "coarse"] = "fine",
        val_fraction: float = 0.1,
        augment: bool = False,
        batch_size: int = 128,
        num_workers: int = 0,
        pin_memory: bool = False,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        if labels not in _CIFAR100_LABELS:
            raise ValueError(f"unknown labels {labels!r}; choose one of: {', '.join(_CIFAR100_LABELS)}")
        super().__init__(
            data_dir=data_dir,
            download=download,
            val_fraction=val_fraction,
            flatten=False,
            batch_size=batch_size,
            num_workers=num_workers,
            pin_memory=pin_memory,
            seed=seed,
            drop_last=drop_last,
        )
        check_bool("augment", augment)
        self.save_hyperparameters()
        self.augment = augment
        self.labels = labels
        self.num_classes = 100 if labels == "fine" else 20

    def _read(self, train: bool) -> tuple[torch.Tensor, torch.Tensor]:
        images, fine = super()._read(train)
        if self.labels == "fine":
            return images, fine
        # torchvision keeps only the fine labels; the coarse ones sit beside them in the same pickle.
        split_files = self.torchvision_class.train_list if train else self.torchvision_class.test_list
        coarse: list[int] = []
        for name, _ in split_files:
            with open(self._folder() / name, "rb") as f:
                coarse.extend(pickle.load(f, encoding="latin1")["coarse_labels"])
        return images, torch.tensor(coarse, dtype=torch.int64)
