"""NeuralCollapseStatistics on next-token classes (Wu & Papyan 2024): every real token with a label is a sample, and
``top_classes`` keeps the class-pair objects of a vocabulary to the most frequent classes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from rank_lightning.functional.neural_collapse import most_frequent_classes, neural_collapse
from rank_lightning.metrics import NeuralCollapseStatistics
from tests.metrics.token_neural_collapse_ddp_helpers import VOCAB, head_weight, stream, token_batch, token_worker

SEEDS = [0, 1, 2]


def _counted_rows(seeds: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Features, labels and logits of the real tokens with a class, as float64 / int64 arrays."""
    parts = [token_batch(seed) for seed in seeds]
    kept = [(mask & (y != -100)) for _, y, mask, _ in parts]
    x = torch.cat([b[0][k] for b, k in zip(parts, kept, strict=True)]).numpy()
    y = torch.cat([b[1][k] for b, k in zip(parts, kept, strict=True)]).numpy()
    logits = torch.cat([b[3][k] for b, k in zip(parts, kept, strict=True)]).numpy()
    return x, y, logits


def _reference(x: np.ndarray, y: np.ndarray, logits: np.ndarray, weight: np.ndarray, chosen: list[int]) -> dict:
    """The SPEC's definitions on the chosen classes' samples, around the mean of every sample, in NumPy float64."""
    s = np.array(chosen)
    rows = np.isin(y, s)
    xs, ys = x[rows], y[rows]
    means = np.stack([x[y == c].mean(0) for c in s])
    m = means - x.mean(0)
    k = len(s)
    residuals = xs - means[np.searchsorted(s, ys)]
    within, between = residuals.T @ residuals / len(xs), m.T @ m / k
    norms = np.linalg.norm(m, axis=1)
    cosines = (m / norms[:, None]) @ (m / norms[:, None]).T
    off = cosines[~np.eye(k, dtype=bool)]
    w = weight[s]
    nearest = s[np.argmin(((xs[:, None] - means[None]) ** 2).sum(-1), axis=1)]
    predicted = s[logits[rows][:, s].argmax(1)]
    variances = [((x[y == c] - means[i]) ** 2).sum(1).mean() for i, c in enumerate(s)]
    pairs = [(i, j) for i in range(k) for j in range(i + 1, k)]
    cdnv = np.mean([(variances[i] + variances[j]) / (2 * ((means[i] - means[j]) ** 2).sum()) for i, j in pairs])
    return {
        "nc1": np.trace(within @ np.linalg.pinv(between)) / k,
        "nc2_equinorm": norms.std(ddof=1) / norms.mean(),
        "nc2_equiangularity": np.abs(off + 1 / (k - 1)).mean(),
        "nc2_cosine_std": off.std(ddof=1),
        "nc3": ((w / np.linalg.norm(w) - m / np.linalg.norm(m)) ** 2).sum(),
        "nc4": (nearest == predicted).mean(),
        "cdnv": cdnv,
    }


def test_the_most_frequent_token_classes_equal_an_independent_float64_computation() -> None:
    metric = stream(SEEDS, top_classes=3)
    x, y, logits = _counted_rows(SEEDS)
    counts = np.bincount(y, minlength=VOCAB)
    chosen = sorted(sorted(range(VOCAB), key=lambda c: (-counts[c], c))[:3])
    assert metric.selected_classes == chosen
    result = metric.compute()
    assert result.num_classes == 3
    assert result.num_samples == int(np.isin(y, chosen).sum())
    want = _reference(x, y, logits, head_weight().numpy(), chosen)
    assert result.as_dict() == pytest.approx(want, rel=1e-9)


def test_every_class_of_the_tokens_equals_the_in_memory_neural_collapse() -> None:
    """Without top_classes: the padded positions (NaN) and those labelled -100 are left out, nothing else."""
    metric = stream(SEEDS, top_classes=None)
    x, y, logits = _counted_rows(SEEDS)
    want = neural_collapse(
        torch.from_numpy(x),
        torch.from_numpy(y),
        num_classes=VOCAB,
        head_weight=head_weight(),
        predictions=torch.from_numpy(logits).argmax(1),
    )
    result = metric.compute()
    assert result.num_samples == x.shape[0] and result.num_classes == len(set(y.tolist()))
    assert result.as_dict() == pytest.approx(want.as_dict(), rel=1e-10)


def test_most_frequent_classes_break_ties_by_the_smaller_class_and_skip_absent_ones() -> None:
    counts = torch.tensor([5, 7, 7, 0, 5, 7])
    assert most_frequent_classes(counts, 2).tolist() == [1, 2]
    assert most_frequent_classes(counts, 4).tolist() == [0, 1, 2, 5]
    assert most_frequent_classes(counts, 10).tolist() == [0, 1, 2, 4, 5]
    with pytest.raises(ValueError, match="top_classes must be a positive integer, got 0"):
        most_frequent_classes(counts, 0)


def test_a_vocabulary_without_top_classes_is_refused_before_any_sample() -> None:
    message = (
        r"neural collapse of 50257 classes of 16 features with top_classes=None plans 96393.3 MiB "
        r"\(96350.3 MiB of it for the 50257 x 50257 class pairs of NC2 and the CDNV\), more than "
        r"memory_budget_mb=4096; set top_classes to measure the K most frequent classes only \(top_classes=8192 "
        r"plans 2587.5 MiB\), or raise memory_budget_mb"
    )
    with pytest.raises(MemoryError, match=message):
        NeuralCollapseStatistics(50257, 16)
    assert NeuralCollapseStatistics(50257, 16, top_classes=8192).class_sums.shape == (50257, 16)
    assert NeuralCollapseStatistics(50257, 16, memory_budget_mb=None).top_classes is None


def test_a_second_pass_saved_with_top_classes_resumes_only_with_the_same_top_classes() -> None:
    x, y, mask, logits = token_batch(0)
    saved = NeuralCollapseStatistics(VOCAB, x.shape[2], top_classes=3)
    saved.persistent(True)
    saved.update(x, y, mask=mask)
    saved.start_second_pass()
    saved.update(x[:3], y[:3], logits[:3], mask=mask[:3])
    message = "was in its second pass with top_classes=3; this one has top_classes=None"
    with pytest.raises(RuntimeError, match=message):
        NeuralCollapseStatistics(VOCAB, x.shape[2]).load_state_dict(saved.state_dict())
    metric = NeuralCollapseStatistics(VOCAB, x.shape[2], top_classes=3)
    metric.load_state_dict(saved.state_dict())
    metric.start_second_pass()
    metric.update(x[3:], y[3:], logits[3:], mask=mask[3:])
    metric.head_weight = head_weight()
    assert metric.compute().as_dict() == pytest.approx(stream([0], top_classes=3).compute().as_dict(), rel=1e-12)


@pytest.mark.parametrize(
    ("labels", "logits", "message"),
    [
        (torch.zeros(6, dtype=torch.long), None, r"need labels per token of shape \(B, T\) = \(6, 7\), got \(6,\)"),
        (torch.full((6, 7), 9), None, r"labels must lie in \[0, 9\).*may also be -100"),
        (torch.zeros(6, 7, dtype=torch.long), torch.zeros(6, 7, 4), r"must be \(6, 7, 9\), got \(6, 7, 4\)"),
    ],
)
def test_bad_token_batches_name_the_value_and_what_is_valid(labels, logits, message) -> None:
    x, _, mask, _ = token_batch(0)
    with pytest.raises(ValueError, match=message):
        NeuralCollapseStatistics(VOCAB, x.shape[2]).update(x, labels, logits, mask=mask)


@pytest.mark.slow
def test_two_processes_give_the_values_of_one(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    mp.spawn(token_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    single = stream(list(range(6)))
    want = {**single.compute().as_dict(), "num_samples": single.compute().num_samples}
    for rank in range(2):
        distributed = torch.load(tmp_path / f"rank{rank}.pt")
        assert distributed.pop("selected") == single.selected_classes
        assert distributed == pytest.approx(want, rel=1e-10)
