"""Class statistics at the scale of CIFAR-100 and ImageNet: memory of the class computations, classes missing from
the measured samples, and class-wise ratios that a subsample or the budget cannot give."""

import warnings

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, TensorDataset

from rank_lightning.callbacks import ActivationRankMonitor
from rank_lightning.functional.neural_collapse import cdnv, neural_collapse
from rank_lightning.metrics import ActivationSpectrum, activation_spectrum
from tests.callbacks.trainer_helpers import quiet_trainer


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


def _variance_ratio_1(rows: torch.Tensor) -> float:
    values = torch.linalg.svdvals(rows.to(torch.float64)).square()
    return float(values[0] / values.sum())


def test_classwise_ratio_of_a_subsample_with_one_row_of_a_class_is_nan_not_one() -> None:
    """On the 'sample_gram' path a class of which the subsample kept one row (of two streamed) had VR_1 = 1 exactly,
    whatever its rows: with 1,000 classes and a few thousand subsampled rows most classes did, and the logged mean
    was about 1. Such classes are now NaN, named in a warning; a class the subsample holds whole stays exact."""
    torch.manual_seed(0)
    classes = 30
    x = torch.randn(2 * classes, 6, dtype=torch.float64) + 3
    y = torch.arange(classes).repeat(2)
    metric = ActivationSpectrum(num_classes=classes, max_gram_features=4, max_samples=24, seed=1)
    metric.update(x, y)
    kept = torch.bincount(metric._subsample().labels, minlength=classes)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = metric.compute()
    assert result.path == "sample_gram" and result.classwise_source == "sample"
    single, whole = (kept == 1).nonzero().squeeze(1).tolist(), (kept == 2).nonzero().squeeze(1).tolist()
    assert single and whole
    ratios = result.classwise_variance_ratio
    assert ratios[single].isnan().all()
    assert ratios[whole].tolist() == pytest.approx([_variance_ratio_1(x[y == c]) for c in whole], rel=1e-12)
    expected_mean = sum(_variance_ratio_1(x[y == c]) for c in whole) / len(whole)
    assert result.scalars(("classwise_variance_ratio",))["classwise_variance_ratio_1_mean"] == pytest.approx(
        expected_mean, rel=1e-12
    )
    messages = [str(w.message) for w in caught if "class-wise variance ratio" in str(w.message)]
    assert len(messages) == 1
    assert f"of {len(single)} of {classes} classes ([{', '.join(map(str, single[:10]))}" in messages[0]
    assert "24-row subsample" in messages[0] and "raise max_samples" in messages[0]


def test_class_grams_beyond_the_budget_are_planned_out_and_named_in_a_warning() -> None:
    """ImageNet's 1,000 classes at d = 512: the class Grams (1,000 x 512 x 512 float64, 2,000 MiB) do not fit the
    default 1,024 MiB, so the plan keeps the Gram and class sums only, and the class-wise VR_1 that was asked for
    was left out of the result without a word. CIFAR-100 at d = 512 fits and is planned exactly."""
    cifar = ActivationSpectrum(num_classes=100)
    assert cifar.path_for(512) == "gram" and cifar._uses_class_grams_for(512)
    d = 512
    assert cifar.planned_bytes(d) == 8 * (2 * d + d * d + 100 + 100 * d + 100 * d * d + 4)
    metric = ActivationSpectrum(num_classes=1000)
    assert metric.planned_bytes(2048) == 8 * (2 * 2048 + 2048**2 + 1000 + 1000 * 2048 + 4)
    assert metric.planned_bytes(d) == 8 * (2 * d + d * d + 1000 + 1000 * d + 4)
    torch.manual_seed(0)
    x, y = torch.randn(64, d), torch.randint(0, 1000, (64,))
    metric.update(x, y)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = metric.compute()
    assert result.classwise_source is None and result.classwise_variance_ratio is None
    assert result.total_cluster_variation is not None  # from the class sums, exact
    messages = [str(w.message) for w in caught if "class-wise" in str(w.message)]
    assert messages == [
        "ActivationSpectrum: the class-wise variance ratio is not computed: its 1000 class Grams of 512 x 512 float64 "
        "and the Gram need 2002.0 MiB, more than the 1024 MiB of memory budget it was given (memory_budget_mb); raise "
        "it, or leave the class-wise variance ratio out (classwise=False)"
    ]


@pytest.mark.parametrize("center", [False, True])
def test_classwise_ratio_of_class_grams_is_taken_a_chunk_of_classes_at_a_time(
    center: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """compute() made full, moved copies of every class Gram at once: 8 GB of temporaries beside the 2 GB of 1,000
    class Grams of 512 x 512 (measured at 100 classes: 809 MiB more than the 200 MiB of class Grams). A chunk of
    classes at a time gives the same ratios (checked against each class's own rows) with temporaries of one chunk."""
    monkeypatch.setattr(activation_spectrum, "_CLASS_GRAM_CHUNK_VALUES", 4 * 16 * 16, raising=False)
    torch.manual_seed(0)
    classes, d = 12, 16
    y = torch.arange(classes).repeat(5)
    y[y == 7] = 3  # a class without rows
    x = torch.randn(y.shape[0], d, dtype=torch.float64) + 5 * torch.randn(classes, d, dtype=torch.float64)[y]
    metric = ActivationSpectrum(num_classes=classes, classwise_center=center)
    metric.update(x[:30], y[:30])
    metric.update(x[30:], y[30:])
    with _LargestTensor() as record:
        result = metric.compute()
    assert result.classwise_source == "class_gram"
    assert record.largest <= 4 * d * d
    expected = [
        _variance_ratio_1(x[y == c] - (x[y == c].mean(0) if center else 0)) if c != 7 else float("nan")
        for c in range(classes)
    ]
    assert result.classwise_variance_ratio.tolist() == pytest.approx(expected, rel=1e-10, nan_ok=True)


def test_labels_per_token_are_refused_saying_what_the_class_metrics_take() -> None:
    """A causal language model's next-token labels (B, T), -100 at padding, reached the metric's shape check, whose
    message named the shapes only; it now says what is taken: one label per input, inherited by its tokens, and labels
    per position for token activations under the 'token' reduction only (here the rows are (B, d) features)."""
    metric = ActivationSpectrum(num_classes=50, reduction="token")
    features = torch.randn(2, 4)
    next_tokens = torch.tensor([[5, 17, -100], [3, 9, 2]])
    expected = (
        "labels must have shape (2,) to match the activations, got (2, 3): one integer label per input, which every "
        "row of the input inherits under the 'token' and 'channel' reductions; labels per position (B, T), such as a "
        "language model's next tokens, need (B, T, D) token activations and reduction='token', and one-hot rows "
        "(B, C) are read as their argmax"
    )
    with pytest.raises(ValueError) as error:
        metric.update(features, next_tokens)
    assert str(error.value) == expected
    assert int(metric.num_samples) == 0


class _Head(pl.LightningModule):
    """A 768-wide representation before a 50,257-way head's place (a language model's vocabulary as classes)."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Linear(4, 768)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.features(x)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self(batch[0])


def test_class_sums_beyond_the_budget_are_named_before_anything_is_allocated(tmp_path) -> None:
    """50,257 classes of 768 features: the class sums alone take 294 MiB on every path, yet the error before training
    spoke of the fallback path only and advised lowering max_gram_features, which frees nothing."""
    data = TensorDataset(torch.randn(8, 4), torch.randint(0, 50257, (8,)))
    monitor = ActivationRankMonitor(layers=["features"], num_classes=50257, memory_budget_mb=100, verbose=False)
    trainer = quiet_trainer([monitor], default_root_dir=tmp_path)
    expected = (
        "layer 'features' (768 features) needs 294.9 MiB of state even on its fallback path (294.5 MiB of it the sums "
        "of its 50257 classes, on every path), more than all of the memory_budget_mb=100. Raise memory_budget_mb, "
        "monitor fewer layers, or pass fewer classes (num_classes)."
    )
    with pytest.raises(MemoryError) as error:
        trainer.validate(_Head(), DataLoader(data, batch_size=4), verbose=False)
    assert str(error.value) == expected
