"""Accuracy under attack, normalised L2 dissimilarity and D_Adv against NumPy and scikit-learn."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.metrics import accuracy_score

from rank_lightning.attacks import accuracy_under_attack, adversarial_feature_distance, l2_dissimilarity

MEAN = (0.49, 0.48, 0.45)
STD = (0.25, 0.24, 0.26)


def _pixels(seed: int, shape=(6, 3, 4, 4)) -> np.ndarray:
    return np.random.default_rng(seed).uniform(0.0, 1.0, size=shape)


def _normalise(pixels: np.ndarray) -> torch.Tensor:
    mean = np.asarray(MEAN).reshape(1, 3, 1, 1)
    std = np.asarray(STD).reshape(1, 3, 1, 1)
    return torch.tensor((pixels - mean) / std)


def test_l2_dissimilarity_in_pixel_space():
    clean = _pixels(0)
    adversarial = np.clip(clean + np.random.default_rng(1).uniform(-8 / 255, 8 / 255, clean.shape), 0, 1)
    expected = np.linalg.norm((adversarial - clean).reshape(6, -1), axis=1) / np.linalg.norm(
        clean.reshape(6, -1), axis=1
    )
    result = l2_dissimilarity(_normalise(adversarial), _normalise(clean), mean=MEAN, std=STD)
    assert result.shape == (6,)
    np.testing.assert_allclose(result.numpy(), expected, rtol=1e-10)
    # Without mean/std the batches are taken as pixels already.
    unnormalised = l2_dissimilarity(torch.tensor(adversarial), torch.tensor(clean))
    np.testing.assert_allclose(unnormalised.numpy(), expected, rtol=1e-12)
    # Measured on the normalised values instead, the number would differ.
    assert not np.allclose(l2_dissimilarity(_normalise(adversarial), _normalise(clean)).numpy(), expected, rtol=1e-2)


def test_l2_dissimilarity_of_low_precision_inputs_is_float32():
    clean = torch.tensor(_pixels(2), dtype=torch.bfloat16)
    result = l2_dissimilarity(clean + 0.01, clean)
    assert result.dtype == torch.float32


def test_accuracy_under_attack_matches_sklearn():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(50, 7, generator=generator)
    targets = torch.randint(0, 7, (50,), generator=generator)
    expected = accuracy_score(targets.numpy(), logits.argmax(dim=1).numpy())
    assert accuracy_under_attack(logits, targets).item() == pytest.approx(expected, abs=1e-7)


def test_adversarial_feature_distance_matches_numpy():
    rng = np.random.default_rng(3)
    clean = rng.normal(size=(8, 4, 3, 3))
    adversarial = clean + rng.normal(scale=0.1, size=clean.shape)
    mask = np.array([True, False, True, True, False, True, False, True])
    per_sample = ((adversarial - clean) ** 2).reshape(8, -1).sum(axis=1)
    features = (torch.tensor(adversarial), torch.tensor(clean))

    mean = adversarial_feature_distance(*features, torch.tensor(mask))
    np.testing.assert_allclose(mean.item(), per_sample[mask].mean(), rtol=1e-12)
    total = adversarial_feature_distance(*features, torch.tensor(mask), reduction="sum")
    np.testing.assert_allclose(total.item(), per_sample[mask].sum(), rtol=1e-12)
    np.testing.assert_allclose(adversarial_feature_distance(*features).item(), per_sample.mean(), rtol=1e-12)
    assert torch.isnan(adversarial_feature_distance(*features, torch.zeros(8, dtype=torch.bool)))


def test_adversarial_feature_distance_bad_arguments():
    features = torch.zeros(4, 5)
    with pytest.raises(ValueError, match="unknown reduction 'max'; reductions are: mean, sum"):
        adversarial_feature_distance(features, features, reduction="max")
    with pytest.raises(ValueError, match="differ in shape"):
        adversarial_feature_distance(features, torch.zeros(4, 6))
    with pytest.raises(ValueError, match="mask must be boolean"):
        adversarial_feature_distance(features, features, torch.ones(4))
