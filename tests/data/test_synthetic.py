import numpy as np
import pytest
import torch

from rank_lightning.data import GaussianMixtureDataModule, GaussianNoiseDataModule


def _all(dataset):
    x, y = dataset.tensors
    return x.double().numpy(), y.numpy()


def _total_cluster_variation(x, y):
    return sum(((x[y == c] - x[y == c].mean(0)) ** 2).sum() for c in np.unique(y))


@pytest.fixture(scope="module")
def mixture():
    dm = GaussianMixtureDataModule(num_classes=4, dim=16, sigma=0.3, samples_per_class=250, batch_size=64)
    dm.setup("fit")
    return dm


def test_mixture_shapes_and_balance(mixture):
    x, y = next(iter(mixture.train_dataloader()))
    assert x.shape == (64, 16) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert mixture.centers.shape == (4, 16)
    assert (mixture.input_shape, mixture.mean, mixture.std) == ((16,), (0.0,), (1.0,))
    for split, per_class in ((mixture.train_set, 150), (mixture.val_set, 50), (mixture.test_set, 50)):
        assert np.array_equal(np.bincount(split.tensors[1].numpy()), [per_class] * 4)


def test_mixture_samples_are_centers_plus_isotropic_noise(mixture):
    x, y = _all(mixture.train_set)
    centers = mixture.centers.double().numpy()
    noise = (x - centers[y]) / mixture.sigma
    assert abs(noise.mean()) < 0.05
    assert noise.std() == pytest.approx(1.0, abs=0.03)
    np.testing.assert_allclose(np.cov(noise.T), np.eye(16), atol=0.15)


def test_mixture_total_cluster_variation_matches_prop_4_1(mixture):
    # Zangrando Prop. 4.1, balanced isotropic case: E[TCV] = sum_k (n_k - 1) * dim * sigma^2.
    x, y = _all(mixture.train_set)
    expected = 4 * (150 - 1) * 16 * mixture.sigma**2
    assert _total_cluster_variation(x, y) == pytest.approx(expected, rel=0.06)


def test_mixture_sigma_sweep_rescales_the_same_noise():
    small = GaussianMixtureDataModule(sigma=0.05, seed=2)
    large = GaussianMixtureDataModule(sigma=2.0, seed=2)
    fewer = GaussianMixtureDataModule(sigma=2.0, seed=2, samples_per_class=40)
    small.setup()
    large.setup()
    assert torch.equal(small.centers, large.centers) and torch.equal(small.centers, fewer.centers)
    xs, ys = _all(small.train_set)
    xl, yl = _all(large.train_set)
    assert np.array_equal(ys, yl)
    centers = small.centers.double().numpy()
    np.testing.assert_allclose((xs - centers[ys]) / 0.05, (xl - centers[yl]) / 2.0, atol=1e-4)


def test_mixture_is_deterministic_and_seeded():
    a, b, c = (GaussianMixtureDataModule(seed=s, batch_size=100) for s in (4, 4, 5))
    for dm in (a, b, c):
        dm.setup()
    for (xa, ya), (xb, yb) in zip(a.train_dataloader(), b.train_dataloader()):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert not torch.equal(a.centers, c.centers)


def test_mixture_rejects_bad_sigma():
    with pytest.raises(ValueError, match="sigma"):
        GaussianMixtureDataModule(sigma=-1.0)


def test_noise_is_standard_gaussian():
    dm = GaussianNoiseDataModule(input_shape=(32,), num_samples=2000, seed=1)
    dm.setup()
    x = torch.cat([dm.train_set.tensors[0], dm.val_set.tensors[0], dm.test_set.tensors[0]]).double().numpy()
    assert x.shape == (2000, 32)
    assert abs(x.mean()) < 0.02
    assert x.std() == pytest.approx(1.0, abs=0.02)
    np.testing.assert_allclose(np.cov(x.T), np.eye(32), atol=0.15)


def test_noise_image_shape_and_channel_constants():
    dm = GaussianNoiseDataModule(input_shape=(3, 8, 8), num_classes=5, num_samples=100, batch_size=20)
    dm.setup()
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (20, 3, 8, 8) and y.dtype == torch.int64
    assert dm.mean == (0.0, 0.0, 0.0) and dm.std == (1.0, 1.0, 1.0)


def test_noise_balanced_labels_are_equal_sized():
    dm = GaussianNoiseDataModule(num_classes=4, num_samples=400, labels="balanced")
    dm.setup()
    for split, per_class in ((dm.train_set, 60), (dm.val_set, 20), (dm.test_set, 20)):
        assert np.array_equal(np.bincount(split.tensors[1].numpy()), [per_class] * 4)


def test_noise_random_labels_cover_the_classes_uniformly():
    dm = GaussianNoiseDataModule(num_classes=10, num_samples=5000, labels="random")
    dm.setup()
    y = np.concatenate([s.tensors[1].numpy() for s in (dm.train_set, dm.val_set, dm.test_set)])
    counts = np.bincount(y, minlength=10)
    assert counts.min() > 400 and counts.max() < 600
    assert counts.std() > 0


def test_noise_is_deterministic():
    a, b = GaussianNoiseDataModule(seed=9), GaussianNoiseDataModule(seed=9)
    a.setup()
    b.setup()
    assert torch.equal(a.test_set.tensors[0], b.test_set.tensors[0])


def test_noise_rejects_unknown_label_mode():
    with pytest.raises(ValueError, match="unknown labels 'fixed'; choose one of: random, balanced"):
        GaussianNoiseDataModule(labels="fixed")
