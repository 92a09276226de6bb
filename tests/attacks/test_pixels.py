"""Normalisation round trips between model inputs and pixels in [0, 1]."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rank_lightning.attacks import channel_stats, from_pixels, to_pixels


def test_to_pixels_matches_numpy_per_channel():
    mean, std = (0.1, 0.2, 0.3), (0.5, 0.25, 2.0)
    inputs = np.random.default_rng(0).normal(size=(2, 3, 4, 5))
    expected = inputs * np.asarray(std).reshape(1, 3, 1, 1) + np.asarray(mean).reshape(1, 3, 1, 1)
    np.testing.assert_allclose(to_pixels(torch.tensor(inputs), mean, std).numpy(), expected, rtol=1e-12)
    np.testing.assert_allclose(from_pixels(torch.tensor(expected), mean, std).numpy(), inputs, rtol=1e-10, atol=1e-12)


def test_single_value_stats_broadcast_and_none_is_identity():
    inputs = torch.randn(4, 64, dtype=torch.float64)
    torch.testing.assert_close(to_pixels(inputs, (0.5,), (0.25,)), inputs * 0.25 + 0.5)
    assert to_pixels(inputs) is inputs
    assert from_pixels(inputs) is inputs


def test_channel_stats_follow_dtype_and_shape():
    like = torch.zeros(2, 3, 4, 4, dtype=torch.float64)
    mean, std = channel_stats([0.1, 0.2, 0.3], torch.tensor([1.0, 2.0, 3.0]), like)
    assert mean.shape == std.shape == (1, 3, 1, 1)
    assert mean.dtype == std.dtype == torch.float64
    assert channel_stats(None, None, like) is None


def test_channel_stats_errors():
    like = torch.zeros(2, 3, 4, 4)
    with pytest.raises(ValueError, match="std has 2 values but the inputs have 3 channels"):
        channel_stats((0.5, 0.5, 0.5), (0.2, 0.2), like)
    with pytest.raises(ValueError, match="must be batched"):
        channel_stats((0.5,), (0.2,), torch.zeros(5))
