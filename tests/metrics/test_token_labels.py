"""Labels per token (a causal language model's next tokens) under the 'token' reduction: every real token position is
a row whose class is its own label; positions labelled -100 are left out."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from rank_lightning.functional.streaming import group_token_labels
from rank_lightning.metrics import ActivationSpectrum
from rank_lightning.metrics import activation_spectrum as module
from tests.metrics.token_labels_ddp_helpers import CLASSES, token_batch, token_results, token_worker


def _expected(batches: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> dict[str, object]:
    """TCV, normalised TCV, class-wise VR_1 and class counts in float64 from the rows of the labelled real tokens."""
    kept = [(x[m & (y != -100)].double(), y[m & (y != -100)]) for x, y, m in batches]
    x, y = torch.cat([k[0] for k in kept]), torch.cat([k[1] for k in kept])
    tcv = sum(float((x[y == c] - x[y == c].mean(0)).square().sum()) for c in range(CLASSES))
    vr1 = [float(torch.linalg.svdvals(x[y == c])[0] ** 2 / x[y == c].square().sum()) for c in range(CLASSES)]
    counts = [int((y == c).sum()) for c in range(CLASSES)]
    return {
        "rows": x.shape[0],
        "tcv": tcv,
        "tcv_n": tcv / float((x - x.mean(0)).square().sum()),
        "vr1": vr1,
        "counts": counts,
    }


PATHS = {
    "class_grams": ({}, "class_gram"),
    "no_class_grams": ({"memory_budget_mb": 0.0005}, None),  # the Gram fits, the class Grams do not
    "sample_gram": ({"max_gram_features": 4, "max_samples": 100}, "sample"),  # every row fits in the subsample
}


@pytest.mark.parametrize("in_place", [False, True], ids=["selected", "kept_in_place"])
@pytest.mark.parametrize("path", PATHS)
def test_token_labels_give_the_class_statistics_of_the_labelled_tokens(monkeypatch, in_place, path) -> None:
    # kept_in_place: the rows of a GPU, padded and -100 rows kept in place under the row mask, sorted by class for the
    # class Grams; selected: the real rows of a CPU.
    monkeypatch.setattr(module, "_keeps_padded_rows", lambda device: in_place)
    options, source = PATHS[path]
    batches = [token_batch(seed) for seed in range(3)]
    metric = ActivationSpectrum(num_classes=CLASSES, reduction="token", center="both", **options)
    for x, y, m in batches:
        metric.update(x, y, mask=m)
    with pytest.warns(RuntimeWarning, match="class-wise variance ratio is not computed") if not source else _nothing():
        result = metric.compute()
    want = _expected(batches)
    assert result.classwise_source == source
    assert result.num_samples == want["rows"] == 3 * 15
    assert result.class_counts.tolist() == want["counts"]
    assert float(result.total_cluster_variation) == pytest.approx(want["tcv"], rel=1e-12)
    assert float(result.total_cluster_variation_normalized) == pytest.approx(want["tcv_n"], rel=1e-12)
    if source:
        assert result.classwise_variance_ratio.tolist() == pytest.approx(want["vr1"], rel=1e-12)
    # The spectrum is that of the same rows: those of the labelled real tokens.
    rows = torch.cat([x[m & (y != -100)] for x, y, m in batches])
    plain = ActivationSpectrum(reduction="token", center="both")
    plain.update(rows)
    assert result.centered.effective_rank == pytest.approx(float(plain.compute().centered.effective_rank), rel=1e-12)


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


@pytest.mark.parametrize("reduction", ["mean", "cls", "flatten"])
def test_token_labels_are_refused_where_a_row_is_one_input(reduction) -> None:
    x, y, m = token_batch(0)
    metric = ActivationSpectrum(num_classes=CLASSES, reduction=reduction)
    expected = (
        f"labels per token (B, T) need reduction='token' (a row per token); reduction={reduction!r} gives a row per "
        "input, which takes labels of shape (4,)"
    )
    with pytest.raises(ValueError, match=re.escape(expected)):
        metric.update(x, y, mask=m)
    assert int(metric.num_samples) == 0


@pytest.mark.parametrize(
    ("labels", "message"),
    [
        (
            torch.full((4, 6), -1),
            "labels must lie in [0, 3), got values in [-1, -1]; per-token labels may also be -100",
        ),
        (torch.full((4, 6), 3), "labels must lie in [0, 3), got values in [3, 3]; per-token labels may also be -100"),
        (
            torch.zeros(4, 5, dtype=torch.long),
            "labels per token must have shape (B, T) = (4, 6) of the activations, got (4, 5)",
        ),
        (torch.zeros(4, 6), "labels per token must be integer class indices, got dtype torch.float32"),
    ],
    ids=["negative", "beyond", "shape", "float"],
)
def test_bad_token_labels_name_the_value_and_what_is_valid(labels, message) -> None:
    metric = ActivationSpectrum(num_classes=CLASSES, reduction="token")
    with pytest.raises(ValueError, match=re.escape(message)):
        metric.update(token_batch(0)[0], labels)
    assert int(metric.num_samples) == 0


def test_a_grouping_made_once_per_batch_equals_the_labels() -> None:
    """One grouping of the batch's token labels serves the metrics of every layer (one host transfer per batch)."""
    x, y, m = token_batch(1)
    grouping = group_token_labels(y, CLASSES)
    assert grouping.labelled.tolist() == (y != -100).tolist()
    assert grouping.counts == tuple(int(((y == c) | ((y == -100) & (c == 0))).sum()) for c in range(CLASSES))
    results = []
    for labels in (y, grouping):
        metric = ActivationSpectrum(num_classes=CLASSES, reduction="token")
        metric.update(x, labels, mask=m)
        results.append(metric.compute())
    assert results[0].as_dict() == results[1].as_dict()
    assert results[0].class_counts.tolist() == results[1].class_counts.tolist() == [4, 4, 7]


@pytest.mark.slow
def test_two_processes_add_up_to_one(tmp_path: Path) -> None:
    """Class counts and sums add across processes: two processes of three batches each give the values of one process
    of all six, and the class statistics of the labelled real tokens of all six."""
    torch.set_num_threads(1)
    mp.spawn(token_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    single = token_results(0, 1)
    want = _expected([token_batch(seed) for seed in range(6)])
    for rank in range(2):
        distributed = torch.load(tmp_path / f"rank{rank}.pt")
        assert distributed["rows"] == single["rows"] == want["rows"] == 6 * 15
        assert distributed["counts"] == single["counts"] == want["counts"]
        assert distributed["scalars"] == pytest.approx(single["scalars"], rel=1e-12)
        assert distributed["scalars"]["tcv"] == pytest.approx(want["tcv"], rel=1e-12)
        mean_vr1 = distributed["scalars"]["classwise_variance_ratio_1_mean"]
        assert mean_vr1 == pytest.approx(sum(want["vr1"]) / CLASSES, rel=1e-12)


def test_without_a_mask_the_labels_leave_out_their_positions() -> None:
    """Padding labelled -100 (as Hugging Face's collators pad labels) needs no mask: the same rows are left out."""
    x, y, m = token_batch(2)
    results = []
    for mask in (m, None):
        metric = ActivationSpectrum(num_classes=CLASSES, reduction="token")
        metric.update(x.masked_fill(~m.unsqueeze(2), 1e3), y, mask=mask)  # padding far away: it would show
        results.append(metric.compute())
    assert results[0].num_samples == results[1].num_samples == 15
    assert results[0].as_dict() == pytest.approx(results[1].as_dict(), rel=1e-12)
