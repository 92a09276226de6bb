"""Accuracy of PCA embeddings with a linear max-margin classifier (Sanyal et al. Sec. 4.4)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rank_lightning.functional import low_dimensional_accuracy


def _two_classes(n: int, seed: int, informative_variance: float) -> tuple[np.ndarray, np.ndarray]:
    """Labels live in feature 0 (+-1 plus small noise); feature 1 is label-free with the given variance."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, n)
    x = np.zeros((n, 5))
    x[:, 0] = (2 * y - 1) + 0.1 * rng.standard_normal(n)
    x[:, 1] = np.sqrt(informative_variance) * rng.standard_normal(n)
    x[:, 2:] = 0.01 * rng.standard_normal((n, 3))
    return x, y


def test_class_information_in_the_top_principal_direction() -> None:
    x_train, y_train = _two_classes(200, 0, informative_variance=0.1)
    x_test, y_test = _two_classes(100, 1, informative_variance=0.1)
    result = low_dimensional_accuracy(
        torch.from_numpy(x_train), torch.from_numpy(y_train), torch.from_numpy(x_test), torch.from_numpy(y_test), [1, 2]
    )
    assert result == {1: 1.0, 2: 1.0}


def test_class_information_in_the_second_principal_direction() -> None:
    # The label-free feature has the larger variance, so a 1-D embedding keeps only noise: chance accuracy.
    x_train, y_train = _two_classes(400, 2, informative_variance=25.0)
    x_test, y_test = _two_classes(400, 3, informative_variance=25.0)
    result = low_dimensional_accuracy(x_train, y_train, x_test, y_test, [1, 2])
    assert 0.35 < result[1] < 0.65
    assert result[2] == 1.0


def test_bad_dimensions_and_shapes_raise() -> None:
    x, y = _two_classes(10, 4, informative_variance=1.0)
    with pytest.raises(ValueError, match=r"\[1, min\(N, d\)\] = \[1, 5\], got 6"):
        low_dimensional_accuracy(x, y, x, y, [6])
    with pytest.raises(ValueError, match="same width"):
        low_dimensional_accuracy(x, y, x[:, :3], y, [1])
    with pytest.raises(ValueError, match="one entry per sample"):
        low_dimensional_accuracy(x, y[:5], x, y, [1])
