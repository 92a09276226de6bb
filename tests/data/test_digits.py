import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits

from rank_lightning.data import DigitsDataModule


@pytest.fixture(scope="module")
def reference():
    digits = load_digits()
    return digits.images / 16.0, digits.target


@pytest.fixture(scope="module")
def dm():
    module = DigitsDataModule(batch_size=100)
    module.setup("fit")
    return module


def _denormalise(dm, x):
    return x.double().numpy() * dm.std[0] + dm.mean[0]


def test_batches_have_the_documented_shapes_and_dtypes(dm):
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (100, 1, 8, 8) and x.dtype == torch.float32
    assert y.shape == (100,) and y.dtype == torch.int64
    assert dm.num_classes == 10 and dm.input_shape == (1, 8, 8)


def test_flatten_serves_vectors():
    dm = DigitsDataModule(flatten=True, batch_size=10)
    dm.setup("fit")
    x, _ = next(iter(dm.val_dataloader()))
    assert x.shape == (10, 64) and dm.input_shape == (64,)


def test_split_sizes_and_class_balance(dm, reference):
    _, labels = reference
    assert (len(dm.train_set), len(dm.val_set), len(dm.test_set)) == (1079, 359, 359)
    counts = np.bincount(labels, minlength=10)
    for split in (dm.val_set, dm.test_set):
        split_counts = np.bincount(split.tensors[1].numpy(), minlength=10)
        assert np.array_equal(split_counts, np.round(0.2 * counts).astype(int))


def test_splits_are_disjoint_and_match_sklearn(dm, reference):
    images, labels = reference
    indices = np.concatenate([dm.train_indices, dm.val_indices, dm.test_indices])
    assert np.array_equal(np.sort(indices), np.arange(len(labels)))
    for split, idx in ((dm.train_set, dm.train_indices), (dm.val_set, dm.val_indices), (dm.test_set, dm.test_indices)):
        x, y = split.tensors
        np.testing.assert_allclose(_denormalise(dm, x)[:, 0], images[idx], atol=1e-6)
        assert np.array_equal(y.numpy(), labels[idx])


def test_normalisation_uses_train_statistics(dm, reference):
    images, _ = reference
    train_pixels = images[dm.train_indices]
    assert dm.mean[0] == pytest.approx(train_pixels.mean(), rel=1e-12)
    assert dm.std[0] == pytest.approx(train_pixels.std(), rel=1e-12)
    x = torch.cat([x for x, _ in dm.train_dataloader()]).double()
    assert x.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert x.std(correction=0).item() == pytest.approx(1.0, abs=1e-6)


def test_two_instances_give_identical_batches():
    a, b = DigitsDataModule(batch_size=50, seed=3), DigitsDataModule(batch_size=50, seed=3)
    a.setup("fit")
    b.setup("fit")
    for (xa, ya), (xb, yb) in zip(a.train_dataloader(), b.train_dataloader()):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_seed_changes_the_split():
    assert not np.array_equal(DigitsDataModule(seed=0).test_indices, DigitsDataModule(seed=1).test_indices)


def test_zero_val_fraction_validates_on_test_split():
    dm = DigitsDataModule(val_fraction=0.0, test_fraction=0.25)
    dm.setup("fit")
    assert dm.val_set is dm.test_set
    assert len(dm.train_set) + len(dm.test_set) == 1797


def test_bad_fraction_is_named():
    with pytest.raises(ValueError, match="test_fraction must lie in"):
        DigitsDataModule(test_fraction=0.0)
