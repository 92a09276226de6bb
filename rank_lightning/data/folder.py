"""ImageNet-style folders of images, one subfolder per class, via ``torchvision.datasets.ImageFolder``."""

from __future__ import annotations

import warnings
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

import torch
from torchvision import datasets
from torchvision.transforms import v2

from rank_lightning.data.base import RankDataModule, check_data_dir, register_datamodule
from rank_lightning.validation import check_bool, check_finite, check_positive, check_positive_int

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class _ImageFolderOfClasses(datasets.ImageFolder):
    """``ImageFolder`` whose labels follow a given class-to-index map (the training folder's), not its own folders.

    Classes of the map without a folder, or with an empty one, have no samples; folders outside the map are not read.
    """

    def __init__(self, root: Path, class_to_idx: dict[str, int], **kwargs: Any) -> None:
        self._given_classes = dict(class_to_idx)
        super().__init__(str(root), allow_empty=True, **kwargs)

    def find_classes(self, directory: str) -> tuple[list[str], dict[str, int]]:
        return list(self._given_classes), dict(self._given_classes)


@register_datamodule("image_folder")
class ImageFolderDataModule(RankDataModule):
    """RGB images laid out as ``<data_dir>/<split>/<class name>/<image file>``.

    The training split is ``train_dir``, validation ``val_dir``; the test split is ``test_dir``, or the
    validation folder when ``test_dir`` is None (as for ImageNet, whose public ``val`` set serves as test set).
    Class indices follow the sorted class-folder names of the training folder, in every split: a validation or test
    folder may lack some of the training classes (a small hold-out set often does; a warning names them), and its
    labels are still the training folder's indices (``torchvision.datasets.ImageFolder`` alone would number its own
    folders and shift every later class). A class folder that the training folder lacks is an error, since the
    model has no output for it. Evaluation images are resized (shorter side ``resize_size``) and centre-cropped to
    ``image_size``; training images likewise, or with ``augment=True`` randomly resized-cropped to
    ``image_size`` and flipped horizontally. Normalisation defaults to the ImageNet constants.

    ``num_classes`` must be known after ``__init__``: given, it is checked against the folders in ``setup``;
    left None, it is the number of class folders in the training folder, counted in ``__init__`` and saved as such in
    ``hparams`` (the module the CLI links it into saves the count, and Lightning refuses two different values).

    Args:
        data_dir: root folder holding the split folders.
        train_dir: training folder name, under ``data_dir``.
        val_dir: validation folder name, under ``data_dir``.
        test_dir: test folder name, under ``data_dir``; None uses the validation folder.
        num_classes: number of classes; None counts the training class folders.
        image_size: side of the square images served.
        resize_size: shorter side after resizing, before the centre crop; None uses ``round(image_size / 0.875)``.
        augment: random resized crop and horizontal flip of training images.
        mean: per-channel mean of the normalisation.
        std: per-channel standard deviation of the normalisation.
        batch_size: samples per batch.
        num_workers: loader worker processes.
        pin_memory: page-lock batches.
        seed: seeds the training shuffle order.
        drop_last: drop the last incomplete training batch.

    Example::

        dm = ImageFolderDataModule(data_dir="data/imagenet", image_size=224, num_workers=8)
        dm.setup("fit")
    """

    def __init__(
        self,
        *,
        data_dir: str | Path = "data/",
        train_dir: str = "train",
        val_dir: str = "val",
        test_dir: str | None = None,
        num_classes: int | None = None,
        image_size: int = 224,
        resize_size: int | None = None,
        augment: bool = False,
        mean: Sequence[float] = IMAGENET_MEAN,
        std: Sequence[float] = IMAGENET_STD,
        batch_size: int = 128,
        num_workers: int = 0,
        pin_memory: bool = False,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        super().__init__(
            batch_size=batch_size, num_workers=num_workers, pin_memory=pin_memory, seed=seed, drop_last=drop_last
        )
        check_data_dir(data_dir)
        for name, values in (("mean", mean), ("std", std)):
            if isinstance(values, str) or not isinstance(values, Collection):
                raise ValueError(f"{name} must be a list of one value per RGB channel, got {values!r}")
        if len(mean) != 3 or len(std) != 3:
            raise ValueError(f"mean and std need one value per RGB channel, got {tuple(mean)} and {tuple(std)}")
        for index, (m, s) in enumerate(zip(mean, std, strict=True)):
            check_finite(f"mean[{index}]", m)
            check_positive(f"std[{index}]", s)
        for name, folder in (("train_dir", train_dir), ("val_dir", val_dir), ("test_dir", test_dir)):
            if folder is not None and (not isinstance(folder, str) or not folder):
                raise ValueError(f"{name} must be a non-empty folder name, got {folder!r}")
        check_positive_int("image_size", image_size)
        check_positive_int("resize_size", resize_size, allow_none=True)
        check_positive_int("num_classes", num_classes, allow_none=True)
        check_bool("augment", augment)
        self.save_hyperparameters()
        self.data_dir = Path(data_dir)
        self.split_dirs = {"train": train_dir, "val": val_dir, "test": test_dir or val_dir}
        self.image_size = image_size
        self.resize_size = resize_size if resize_size is not None else round(image_size / 0.875)
        self.augment = augment
        self.input_shape = (3, image_size, image_size)
        self.mean = tuple(float(m) for m in mean)
        self.std = tuple(float(s) for s in std)
        if num_classes is None:
            num_classes = len(datasets.folder.find_classes(str(self._split_path("train")))[0])
            self._save_resolved_hyperparameters(num_classes=num_classes)
        self.num_classes = num_classes

    def setup(self, stage: str | None = None) -> None:
        """Index the image files of all splits (all stages at once; repeated calls reuse them)."""
        if self.train_set is not None:
            return
        to_float = [v2.ToDtype(torch.float32, scale=True), v2.Normalize(self.mean, self.std)]
        evaluation = v2.Compose([v2.ToImage(), v2.Resize(self.resize_size), v2.CenterCrop(self.image_size), *to_float])
        if self.augment:
            training = v2.Compose(
                [v2.ToImage(), v2.RandomResizedCrop(self.image_size), v2.RandomHorizontalFlip(), *to_float]
            )
        else:
            training = evaluation
        train = datasets.ImageFolder(str(self._split_path("train")), transform=training)
        classes = train.classes
        if len(classes) != self.num_classes:
            raise ValueError(
                f"num_classes={self.num_classes} but {self._split_path('train')} holds {len(classes)} class folders"
            )
        val = self._evaluation_folder("val", train, evaluation)
        test = (
            val
            if self.split_dirs["test"] == self.split_dirs["val"]
            else self._evaluation_folder("test", train, evaluation)
        )
        self.train_set, self.val_set, self.test_set = train, val, test

    def _evaluation_folder(
        self, split: str, train: datasets.ImageFolder, transform: v2.Transform
    ) -> datasets.ImageFolder:
        """The ``split`` folder, labelled with the training folder's class indices.

        Raises:
            ValueError: the folder holds a class folder that the training folder lacks.
        """
        path = self._split_path(split)
        unknown = sorted(set(datasets.folder.find_classes(str(path))[0]) - set(train.classes))
        if unknown:
            raise ValueError(
                f"class folders of {path} that the training folder {self._split_path('train')} lacks: {unknown}; "
                "every class of the validation and test folders needs training images (the model has no output for it)"
            )
        dataset = _ImageFolderOfClasses(path, train.class_to_idx, transform=transform)
        present = {train.classes[label] for label in dataset.targets}
        missing = [name for name in train.classes if name not in present]
        if missing:
            warnings.warn(
                f"{path} holds no images of the training classes {missing}: it is labelled with the training "
                "folder's class indices, and these classes are absent from its metrics",
                UserWarning,
                stacklevel=3,
            )
        return dataset

    def _split_path(self, split: str) -> Path:
        path = self.data_dir / self.split_dirs[split]
        if not path.is_dir():
            raise FileNotFoundError(
                f"image folder {path} not found: the {split} split must be laid out as "
                f"{path}/<class name>/<image file> (e.g. {path}/cat/0001.png), one subfolder per class"
            )
        return path
