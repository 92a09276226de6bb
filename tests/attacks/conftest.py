"""Models and batches shared by the attack tests."""

from __future__ import annotations

import pytest
import torch
from sklearn.datasets import load_digits
from torch import nn

RGB_MEAN = (0.49, 0.48, 0.45)
RGB_STD = (0.25, 0.24, 0.26)


def small_cnn(seed: int = 0) -> nn.Module:
    """Random CNN with BatchNorm and dropout, so that eval mode matters, on (3, 8, 8) inputs."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Dropout(0.5),
        nn.Flatten(),
        nn.Linear(8 * 8 * 8, 10),
    )


@pytest.fixture
def cnn() -> nn.Module:
    return small_cnn()


@pytest.fixture
def rgb_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """64 normalised images of 8-bit random pixels and random labels."""
    generator = torch.Generator().manual_seed(1)
    pixels = torch.randint(0, 256, (64, 3, 8, 8), generator=generator).float() / 255
    labels = torch.randint(0, 10, (64,), generator=generator)
    mean = torch.tensor(RGB_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(RGB_STD).view(1, 3, 1, 1)
    return (pixels - mean) / std, labels


class DigitsTask:
    """An MLP trained on scikit-learn's digits; inputs (1, 8, 8) normalised with one mean and std."""

    def __init__(self) -> None:
        digits = load_digits()
        pixels = torch.tensor(digits.images / 16.0, dtype=torch.float32).unsqueeze(1)  # (1797, 1, 8, 8)
        labels = torch.tensor(digits.target, dtype=torch.int64)
        permutation = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
        pixels, labels = pixels[permutation], labels[permutation]
        train_pixels = pixels[:1297]
        self.mean = (float(train_pixels.mean()),)
        self.std = (float(train_pixels.std()),)
        normalised = (pixels - self.mean[0]) / self.std[0]
        self.train_inputs, self.train_labels = normalised[:1297], labels[:1297]
        self.inputs, self.labels = normalised[1297:], labels[1297:]

        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
        optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-2)
        for _ in range(300):
            optimizer.zero_grad()
            nn.functional.cross_entropy(self.model(self.train_inputs), self.train_labels).backward()
            optimizer.step()
        self.model.eval()
        for parameter in self.model.parameters():
            parameter.grad = None

    def accuracy(self, inputs: torch.Tensor) -> float:
        with torch.no_grad():
            return float((self.model(inputs).argmax(dim=1) == self.labels).float().mean())


@pytest.fixture(scope="session")
def digits() -> DigitsTask:
    return DigitsTask()
