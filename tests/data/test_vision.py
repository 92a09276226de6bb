"""The torchvision-backed datamodules, on tiny files written here in the real on-disk formats.

CIFAR files carry md5 sums that torchvision checks; files written by a test cannot match the official sums, so
the tests that load CIFAR fixtures point torchvision's checksum tables at the fixtures' own md5 sums (the check
itself still runs), and one test shows that without that the package reports the files as corrupted.
"""

import hashlib
import pickle
import struct
from pathlib import Path
from urllib.error import URLError

import numpy as np
import pytest
import torch
from torchvision import datasets

from rank_lightning.cli import DEBUG_ENV, main
from rank_lightning.data import CIFAR10DataModule, CIFAR100DataModule, FashionMNISTDataModule, MNISTDataModule
from rank_lightning.validation import SetupError


def _write_idx_images(path: Path, images: np.ndarray) -> None:
    path.write_bytes(struct.pack(">IIII", 0x0803, *images.shape) + images.astype(np.uint8).tobytes())


def _write_idx_labels(path: Path, labels: np.ndarray) -> None:
    path.write_bytes(struct.pack(">II", 0x0801, len(labels)) + labels.astype(np.uint8).tobytes())


def _random_split(rng, num_classes: int, per_class: int, shape: tuple[int, ...]):
    labels = np.tile(np.arange(num_classes), per_class)
    images = rng.integers(0, 256, (len(labels), *shape), dtype=np.uint8)
    return images, labels


def write_mnist(root: Path, folder: str, per_class: int = 10):
    rng = np.random.default_rng(0)
    raw = root / folder / "raw"
    raw.mkdir(parents=True)
    train = _random_split(rng, 10, per_class, (28, 28))
    test = _random_split(rng, 10, 2, (28, 28))
    for prefix, (images, labels) in (("train", train), ("t10k", test)):
        _write_idx_images(raw / f"{prefix}-images-idx3-ubyte", images)
        _write_idx_labels(raw / f"{prefix}-labels-idx1-ubyte", labels)
    return train, test


def _pickle(path: Path, obj) -> None:
    with open(path, "wb") as f:
        pickle.dump(obj, f)


def write_cifar10(root: Path):
    rng = np.random.default_rng(1)
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    batches = [_random_split(rng, 10, 2, (3, 32, 32)) for _ in range(5)]
    for i, (images, labels) in enumerate(batches, start=1):
        _pickle(folder / f"data_batch_{i}", {"data": images.reshape(len(images), -1), "labels": labels.tolist()})
    test = _random_split(rng, 10, 1, (3, 32, 32))
    _pickle(folder / "test_batch", {"data": test[0].reshape(len(test[0]), -1), "labels": test[1].tolist()})
    _pickle(folder / "batches.meta", {"label_names": [f"class{i}" for i in range(10)]})
    train = (np.concatenate([b[0] for b in batches]), np.concatenate([b[1] for b in batches]))
    return train, test


def write_cifar100(root: Path):
    rng = np.random.default_rng(2)
    folder = root / "cifar-100-python"
    folder.mkdir(parents=True)
    splits = {}
    for name, per_class in (("train", 4), ("test", 1)):
        images, fine = _random_split(rng, 100, per_class, (3, 32, 32))
        coarse = (fine * 7) % 20  # a fixture mapping that differs from the fine labels in every residue
        _pickle(
            folder / name,
            {"data": images.reshape(len(images), -1), "fine_labels": fine.tolist(), "coarse_labels": coarse.tolist()},
        )
        splits[name] = (images, fine, coarse)
    meta = {"fine_label_names": [f"f{i}" for i in range(100)], "coarse_label_names": [f"c{i}" for i in range(20)]}
    _pickle(folder / "meta", meta)
    return splits


def _md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def trust_fixture_checksums(monkeypatch, tv_class, root: Path) -> None:
    """Make torchvision's md5 tables hold the sums of the fixture files, so its integrity check accepts them."""
    folder = root / tv_class.base_folder
    for attr in ("train_list", "test_list"):
        monkeypatch.setattr(tv_class, attr, [[name, _md5(folder / name)] for name, _ in getattr(tv_class, attr)])
    monkeypatch.setattr(tv_class, "meta", {**tv_class.meta, "md5": _md5(folder / tv_class.meta["filename"])})


def served_pixels(dm, dataset) -> tuple[np.ndarray, np.ndarray]:
    """Every sample of a split, un-normalised back to uint8 pixels, in dataset order."""
    xs, ys = zip(*(dataset[i] for i in range(len(dataset))))
    x = torch.stack(xs).reshape(len(xs), *dm.image_shape)
    mean = torch.tensor(dm.mean).view(-1, 1, 1)
    std = torch.tensor(dm.std).view(-1, 1, 1)
    pixels = ((x * std + mean) * 255).round()
    assert torch.all((pixels - (x * std + mean) * 255).abs() < 1e-3)
    return pixels.to(torch.uint8).numpy(), torch.stack(ys).numpy()


def assert_same_samples(served, written) -> None:
    """Same (image, label) pairs, in any order."""
    key = {(img.tobytes(), int(lab)) for img, lab in zip(*written)}
    got = [(img.tobytes(), int(lab)) for img, lab in zip(*served)]
    assert len(got) == len(set(got)) == len(key)
    assert set(got) == key


@pytest.mark.parametrize(("cls", "folder"), [(MNISTDataModule, "MNIST"), (FashionMNISTDataModule, "FashionMNIST")])
def test_mnist_family_loads_idx_files(tmp_path, cls, folder):
    train, test = write_mnist(tmp_path, folder)
    dm = cls(data_dir=tmp_path, val_fraction=0.2, batch_size=16)
    dm.prepare_data()
    dm.setup("fit")
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (16, 1, 28, 28) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert np.array_equal(np.bincount(dm.val_set.targets.numpy()), [2] * 10)
    train_px, train_y = served_pixels(dm, dm.train_set)
    val_px, val_y = served_pixels(dm, dm.val_set)
    written_train = (train[0][:, None], train[1])
    assert_same_samples((np.concatenate([train_px, val_px]), np.concatenate([train_y, val_y])), written_train)
    test_px, test_y = served_pixels(dm, dm.test_set)
    assert np.array_equal(test_px[:, 0], test[0]) and np.array_equal(test_y, test[1])


@pytest.mark.parametrize(("cls", "folder"), [(MNISTDataModule, "MNIST"), (FashionMNISTDataModule, "FashionMNIST")])
def test_mnist_family_loads_the_older_processed_layout(tmp_path, cls, folder):
    # torchvision still reads processed/{training,test}.pt; the datamodule asked for the raw files instead.
    rng = np.random.default_rng(2)
    processed = tmp_path / folder / "processed"
    processed.mkdir(parents=True)
    train, test = _random_split(rng, 10, 5, (28, 28)), _random_split(rng, 10, 2, (28, 28))
    for name, (images, labels) in (("training.pt", train), ("test.pt", test)):
        torch.save((torch.from_numpy(images), torch.from_numpy(labels).long()), processed / name)
    dm = cls(data_dir=tmp_path, val_fraction=0.2, batch_size=8)
    dm.prepare_data()
    dm.setup("fit")
    test_px, test_y = served_pixels(dm, dm.test_set)
    assert np.array_equal(test_px[:, 0], test[0]) and np.array_equal(test_y, test[1])
    assert len(dm.train_set) + len(dm.val_set) == 50


def test_mnist_flatten_and_determinism(tmp_path):
    write_mnist(tmp_path, "MNIST")
    a, b = (MNISTDataModule(data_dir=tmp_path, flatten=True, val_fraction=0.2, batch_size=32) for _ in range(2))
    a.setup()
    b.setup()
    assert a.input_shape == (784,)
    for (xa, ya), (xb, yb) in zip(a.train_dataloader(), b.train_dataloader()):
        assert xa.shape[1:] == (784,)
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


@pytest.mark.parametrize(
    ("cls", "files"),
    [
        (MNISTDataModule, ["MNIST/raw/: train-images-idx3-ubyte", "t10k-labels-idx1-ubyte", "gunzip"]),
        (FashionMNISTDataModule, ["FashionMNIST/raw/", "train-labels-idx1-ubyte"]),
        (CIFAR10DataModule, ["cifar-10-batches-py/", "data_batch_5", "batches.meta", "cifar-10-python.tar.gz"]),
        (CIFAR100DataModule, ["cifar-100-python/", "train, test, meta", "cifar-100-python.tar.gz"]),
    ],
)
def test_missing_files_give_a_clear_error(tmp_path, cls, files):
    dm = cls(data_dir=tmp_path)
    for step in (dm.prepare_data, dm.setup):
        with pytest.raises(FileNotFoundError, match="not found, missing files") as info:
            step()
        message = str(info.value)
        assert "download=True" in message and str(tmp_path) in message
        for fragment in files:
            assert fragment in message


def test_partially_present_files_list_only_the_missing_ones(tmp_path):
    write_mnist(tmp_path, "MNIST")
    (tmp_path / "MNIST" / "raw" / "t10k-images-idx3-ubyte").unlink()
    with pytest.raises(FileNotFoundError) as info:
        MNISTDataModule(data_dir=tmp_path).setup()
    assert "t10k-images-idx3-ubyte" in str(info.value)
    assert "train-images-idx3-ubyte" not in str(info.value).split("Set download")[0]


@pytest.mark.parametrize(("cls", "module"), [(MNISTDataModule, datasets.mnist), (CIFAR10DataModule, datasets.cifar)])
def test_failed_download_says_how_to_get_the_files(tmp_path, monkeypatch, cls, module):
    def offline(*args, **kwargs):
        raise URLError("no network")

    monkeypatch.setattr(module, "download_and_extract_archive", offline)
    with pytest.raises(RuntimeError, match=r"downloading .* failed") as info:
        cls(data_dir=tmp_path, download=True).prepare_data()
    assert "Without internet access, download" in str(info.value)


def test_cifar10_loads_python_batches(tmp_path, monkeypatch):
    train, test = write_cifar10(tmp_path)
    trust_fixture_checksums(monkeypatch, datasets.CIFAR10, tmp_path)
    dm = CIFAR10DataModule(data_dir=tmp_path, val_fraction=0.5, batch_size=8)
    dm.prepare_data()
    dm.setup("fit")
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (8, 3, 32, 32) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert (len(dm.train_set), len(dm.val_set), len(dm.test_set)) == (50, 50, 10)
    train_px, train_y = served_pixels(dm, dm.train_set)
    val_px, val_y = served_pixels(dm, dm.val_set)
    assert_same_samples((np.concatenate([train_px, val_px]), np.concatenate([train_y, val_y])), train)
    test_px, test_y = served_pixels(dm, dm.test_set)
    assert np.array_equal(test_px, test[0]) and np.array_equal(test_y, test[1])


def test_cifar_fixture_without_matching_checksums_is_reported_corrupted(tmp_path):
    write_cifar10(tmp_path)
    dm = CIFAR10DataModule(data_dir=tmp_path)
    dm.prepare_data()  # every file is present
    with pytest.raises(SetupError, match=r"present but torchvision rejected them.*corrupted"):
        dm.setup()


def test_corrupted_files_are_one_line_from_the_cli(tmp_path, monkeypatch, capsys):
    # The package's own RuntimeError explained itself, but the CLI printed it under a 47-line traceback.
    write_cifar10(tmp_path / "data")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    arguments = ["--data=CIFAR10DataModule", "--data.init_args.data_dir=data", "--trainer.logger=false"]
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", "quickstart", *arguments])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "error: CIFAR-10 files under data are present but torchvision rejected them" in err


def _crops_and_flips(image: np.ndarray) -> set[bytes]:
    padded = np.pad(image, ((0, 0), (4, 4), (4, 4)))
    crops = [padded[:, i : i + 32, j : j + 32] for i in range(9) for j in range(9)]
    return {c.tobytes() for c in crops} | {c[:, :, ::-1].tobytes() for c in crops}


def test_cifar_augmentation_is_a_padded_crop_and_flip_of_training_images_only(tmp_path, monkeypatch):
    write_cifar10(tmp_path)
    trust_fixture_checksums(monkeypatch, datasets.CIFAR10, tmp_path)
    torch.manual_seed(0)
    plain = CIFAR10DataModule(data_dir=tmp_path, val_fraction=0.5)
    augmented = CIFAR10DataModule(data_dir=tmp_path, val_fraction=0.5, augment=True)
    plain.setup()
    augmented.setup()
    originals, _ = served_pixels(plain, plain.train_set)
    views, _ = served_pixels(augmented, augmented.train_set)
    assert all(v.tobytes() in _crops_and_flips(o) for o, v in zip(originals, views))
    assert sum(not np.array_equal(o, v) for o, v in zip(originals, views)) > 40
    assert np.array_equal(served_pixels(plain, plain.val_set)[0], served_pixels(augmented, augmented.val_set)[0])


@pytest.mark.parametrize("labels", ["fine", "coarse"])
def test_cifar100_fine_and_coarse_labels(tmp_path, monkeypatch, labels):
    splits = write_cifar100(tmp_path)
    trust_fixture_checksums(monkeypatch, datasets.CIFAR100, tmp_path)
    dm = CIFAR100DataModule(data_dir=tmp_path, labels=labels, val_fraction=0.25)
    assert dm.num_classes == (100 if labels == "fine" else 20)
    dm.setup()
    images, fine, coarse = splits["train"]
    expected = fine if labels == "fine" else coarse
    train_px, train_y = served_pixels(dm, dm.train_set)
    val_px, val_y = served_pixels(dm, dm.val_set)
    assert_same_samples((np.concatenate([train_px, val_px]), np.concatenate([train_y, val_y])), (images, expected))
    test_images, test_fine, test_coarse = splits["test"]
    test_px, test_y = served_pixels(dm, dm.test_set)
    assert np.array_equal(test_px, test_images)
    assert np.array_equal(test_y, test_fine if labels == "fine" else test_coarse)
    assert dm.val_set.targets.max() < dm.num_classes


def test_cifar100_rejects_unknown_label_granularity():
    with pytest.raises(ValueError, match="unknown labels 'super'; choose one of: fine, coarse"):
        CIFAR100DataModule(labels="super")


def test_zero_val_fraction_validates_on_official_test_split(tmp_path):
    write_mnist(tmp_path, "MNIST")
    dm = MNISTDataModule(data_dir=tmp_path, val_fraction=0.0)
    dm.setup()
    assert dm.val_set is dm.test_set and len(dm.train_set) == 100


def test_missing_files_from_the_cli_name_the_download_option(tmp_path, monkeypatch, capsys):
    # The message said "Set download=True", which a command line user has to translate into a config key.
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", "quickstart", "--data=MNISTDataModule", "--trainer.logger=false"])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert f"error: MNIST not found, missing files in {Path('data/MNIST/raw')}/: train-images-idx3-ubyte" in err
    assert "Set download=True (--data.init_args.download=true) on a machine with internet access, or download" in err
