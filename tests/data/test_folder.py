import re
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


def test_a_class_only_in_an_evaluation_folder_is_refused(tmp_path):
    write_folder(tmp_path, splits=("train",))
    write_folder(tmp_path, splits=("val",), classes=("cat", "dog", "owl"))
    with pytest.raises(ValueError, match=r"class folders of .*val that the training folder .*train lacks: \['owl'\]"):
        ImageFolderDataModule(data_dir=tmp_path).setup()


def test_an_evaluation_folder_may_lack_a_class_and_keeps_the_training_labels(tmp_path):
    # torchvision's ImageFolder numbers a folder's own classes: alone, it would label val's 'fox' 1 (the training
    # folder's 'dog') instead of 2.
    write_folder(tmp_path, splits=("train",))
    written = write_folder(tmp_path, splits=("val",), classes=("cat", "fox"))
    (tmp_path / "val" / "dog").mkdir()  # an empty class folder counts as a missing class
    test_images = write_folder(tmp_path, splits=("test",), classes=("dog",))["test"][0]
    dm = ImageFolderDataModule(data_dir=tmp_path, test_dir="test", image_size=12, resize_size=12, batch_size=4)
    with pytest.warns(UserWarning) as caught:
        dm.setup()
    messages = sorted(str(w.message) for w in caught)
    assert len(messages) == 2
    assert re.fullmatch(
        r".*test holds no images of the training classes \['cat', 'fox'\]: it is labelled .*", messages[0]
    )
    assert re.fullmatch(r".*val holds no images of the training classes \['dog'\]: it is labelled .*", messages[1])
    x_val, y_val = (torch.cat(t) for t in zip(*dm.val_dataloader()))
    assert y_val.tolist() == [0, 0, 0, 2, 2, 2]
    assert np.array_equal(_pixels(dm, x_val), written["val"][0])
    x_test, y_test = (torch.cat(t) for t in zip(*dm.test_dataloader()))
    assert y_test.tolist() == [1, 1, 1]
    assert np.array_equal(_pixels(dm, x_test), test_images)
    assert dm.val_set.classes == dm.test_set.classes == list(CLASSES)


def test_a_counted_num_classes_is_saved_as_the_count(tmp_path):
    # The CLI links num_classes into the model, which saves the count; Lightning refuses two values of one key.
    write_folder(tmp_path, splits=("train",))
    dm = ImageFolderDataModule(data_dir=tmp_path)
    assert dm.num_classes == dm.hparams["num_classes"] == dm.hparams_initial["num_classes"] == 3
    given = ImageFolderDataModule(data_dir=tmp_path / "elsewhere", num_classes=5)
    assert given.hparams["num_classes"] == given.hparams_initial["num_classes"] == 5


def test_bad_normalisation_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="one value per RGB channel"):
        ImageFolderDataModule(data_dir=tmp_path, num_classes=2, mean=(0.5,), std=(0.5,))
