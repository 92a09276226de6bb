"""LightningDataModules created by name: ``create_datamodule(name, **kwargs)``; ``list_datamodules()`` lists names."""

from rank_lightning.data.base import (
    EpochShuffleSampler,
    RankDataModule,
    create_datamodule,
    list_datamodules,
    register_datamodule,
    stratified_split,
)
from rank_lightning.data.digits import DigitsDataModule
from rank_lightning.data.folder import ImageFolderDataModule
from rank_lightning.data.synthetic import GaussianMixtureDataModule, GaussianNoiseDataModule
from rank_lightning.data.vision import (
    CIFAR10DataModule,
    CIFAR100DataModule,
    FashionMNISTDataModule,
    MNISTDataModule,
    PixelDataset,
)

__all__ = [
    "CIFAR10DataModule",
    "CIFAR100DataModule",
    "DigitsDataModule",
    "EpochShuffleSampler",
    "FashionMNISTDataModule",
    "GaussianMixtureDataModule",
    "GaussianNoiseDataModule",
    "ImageFolderDataModule",
    "MNISTDataModule",
    "PixelDataset",
    "RankDataModule",
    "create_datamodule",
    "list_datamodules",
    "register_datamodule",
    "stratified_split",
]
