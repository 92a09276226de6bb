from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from rank_lightning.data import ImageFolderDataModule
from rank_lightning.data.folder import IMAGENET_MEAN, IMAGENET_STD

CLASSES = ("cat", "dog", "fox")


def write_folder(root: Path, splits=("train", "val"), classes=CLASSES, per_class: int = 3, size: int = 12):
    """PNG images ``root/<split>/<class>/<i>.png``; returns ``{split: (images (N, H, W, 3), labels)}``."""
    rng = np.random.default_rng(0)
    written = {}
    for split in splits:
        images, labels = [], []
        for label, name in enumerate(classes):
            (root / split / name).mkdir(parents=True)
            for i in range(per_class):
                image = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
                Image.fromarray(image).save(root / split / name / f"{i}.png")
                images.append(image)
                labels.append(label)
        written[split] = (np.stack(images), np.array(labels))
    return written


def _pixels(dm, x: torch.Tensor) -> np.ndarray:
    mean = torch.tensor(dm.mean).view(1, 3, 1, 1)
    std = torch.tensor(dm.std).view(1, 3, 1, 1)
    return ((x * std + mean) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()


def test_loads_pngs_with_sorted_class_indices(tmp_path):
    written = write_folder(tmp_path)
    dm = ImageFolderDataModule(data_dir=tmp_path, image_size=12, resize_size=12, batch_size=4)
    assert (dm.num_classes, dm.input_shape) == (3, (3, 12, 12))
    assert (dm.mean, dm.std) == (IMAGENET_MEAN, IMAGENET_STD)
    dm.setup("fit")
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (4, 3, 12, 12) and x.dtype == torch.float32 and y.dtype == torch.int64
    x_val, y_val = (torch.cat(t) for t in zip(*dm.val_dataloader()))
    images, labels = written["val"]  # files are indexed in sorted class, then file-name order
    assert np.array_equal(y_val.numpy(), labels)
    assert np.array_equal(_pixels(dm, x_val), images)
    assert dm.test_set.root == dm.val_set.root


def test_resize_and_crop_give_the_requested_size(tmp_path):
    write_folder(tmp_path, size=20)
    dm = ImageFolderDataModule(data_dir=tmp_path, image_size=8, batch_size=9)
    assert dm.resize_size == 9
    dm.setup()
    for loader in (dm.train_dataloader(), dm.val_dataloader()):
        assert next(iter(loader))[0].shape == (9, 3, 8, 8)


def test_augment_only_changes_training_images(tmp_path):
    write_folder(tmp_path)
    torch.manual_seed(0)
    dm = ImageFolderDataModule(data_dir=tmp_path, image_size=12, resize_size=12, augment=True, batch_size=9)
    plain = ImageFolderDataModule(data_dir=tmp_path, image_size=12, resize_size=12, batch_size=9)
    dm.setup()
    plain.setup()
    train_aug = torch.stack([dm.train_set[i][0] for i in range(9)])
    train_plain = torch.stack([plain.train_set[i][0] for i in range(9)])
    assert train_aug.shape == train_plain.shape
    assert not torch.allclose(train_aug, train_plain)
    assert torch.equal(dm.val_set[0][0], plain.val_set[0][0])


def test_separate_test_folder(tmp_path):
    written = write_folder(tmp_path, splits=("train", "val", "test"), per_class=2)
    dm = ImageFolderDataModule(data_dir=tmp_path, test_dir="test", image_size=12, resize_size=12)
    dm.setup("test")
    x, y = (torch.cat(t) for t in zip(*dm.test_dataloader()))
    assert np.array_equal(_pixels(dm, x), written["test"][0])
    assert np.array_equal(y.numpy(), written["test"][1])


def test_missing_folder_says_what_layout_is_expected(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"train split must be laid out as .*/train/<class name>/<image file>"):
        ImageFolderDataModule(data_dir=tmp_path)
    write_folder(tmp_path, splits=("train",))
    dm = ImageFolderDataModule(data_dir=tmp_path)
    with pytest.raises(FileNotFoundError, match="val split"):
        dm.setup()


def test_given_num_classes_is_checked(tmp_path):
    write_folder(tmp_path)
    dm = ImageFolderDataModule(data_dir=tmp_path / "elsewhere", num_classes=5)
    assert dm.num_classes == 5
    dm = ImageFolderDataModule(data_dir=tmp_path, num_classes=5)
    with pytest.raises(ValueError, match=r"num_classes=5 but .* holds 3 class folders"):
        dm.setup()
    assert dm.train_set is None


def test_class_mismatch_between_splits_is_reported(tmp_path):
    write_folder(tmp_path, splits=("train",))
    write_folder(tmp_path, splits=("val",), classes=("cat", "dog", "owl"))
    with pytest.raises(ValueError, match=r"only in val: \['owl'\], only in train: \['fox'\]"):
        ImageFolderDataModule(data_dir=tmp_path).setup()


def test_bad_normalisation_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="one value per RGB channel"):
        ImageFolderDataModule(data_dir=tmp_path, num_classes=2, mean=(0.5,), std=(0.5,))
