"""Class statistics at the scale of CIFAR-100 and ImageNet: memory of the class computations, classes missing from
the measured samples, and class-wise ratios that a subsample or the budget cannot give."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rank_lightning.functional.neural_collapse import cdnv, neural_collapse


class _LargestTensor(TorchDispatchMode):
    """Records the most elements of any tensor an operation returns."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(value, torch.Tensor):
                self.largest = max(self.largest, value.numel())
        return out


def test_cdnv_of_many_classes_never_forms_every_pair_of_means() -> None:
    """1,000 classes of 2,048 features gave a (499500, 2048) float64 difference of every pair of means (8 GB) in the
    CDNV and again in its rounding check; the pairwise distances are now formed in blocks."""
    torch.manual_seed(0)
    classes, d = 600, 64
    x = torch.randn(classes * 3, d, dtype=torch.float64) + 4 * torch.randn(classes, d, dtype=torch.float64).repeat(3, 1)
    y = torch.arange(classes).repeat(3)
    means = torch.stack([x[y == c].mean(0) for c in range(classes)])
    variances = torch.stack([(x[y == c] - means[c]).square().sum(1).mean() for c in range(classes)])
    i, j = torch.triu_indices(classes, classes, offset=1)
    expected = float(((variances[i] + variances[j]) / (2 * (means[i] - means[j]).square().sum(1))).mean())
    with _LargestTensor() as record:
        value = cdnv(means, variances)
        result = neural_collapse(x, y)
    assert value == pytest.approx(expected, rel=1e-12)
    assert result.cdnv == pytest.approx(expected, rel=1e-12)
    pairs = classes * (classes - 1) // 2
    assert record.largest < pairs * d / 2  # blocks of rows, not the (C (C - 1) / 2, d) differences of every pair
