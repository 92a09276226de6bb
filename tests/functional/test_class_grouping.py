"""Labels grouped once per batch (``group_by_class``) and small CPU work on one thread (``serial_if_small``)."""

import math

import pytest
import torch

from rank_lightning.functional.spectral import SERIAL_EIGH_BELOW, serial_if_small
from rank_lightning.functional.streaming import (
    ClassGrouping,
    channel_gram_moments,
    class_counts,
    group_by_class,
    row_moments,
)
from rank_lightning.metrics import ActivationSpectrum
from rank_lightning.tracker import RankTracker


def test_grouping_sorts_stably_and_counts_on_the_host() -> None:
    labels = torch.tensor([2, 0, 2, 1, 0, 2])
    grouping = group_by_class(labels, 4)
    assert grouping.counts == (2, 1, 3, 0)
    assert all(isinstance(n, int) for n in grouping.counts)
    assert grouping.order.tolist() == [1, 4, 3, 0, 2, 5]  # stable: equal labels keep their input order
    assert grouping.sorted_labels.tolist() == [0, 0, 1, 2, 2, 2]


@pytest.mark.parametrize(
    ("labels", "message"),
    [
        (torch.tensor([0, 3]), r"labels must lie in \[0, 3\), got values in \[0, 3\]"),
        (torch.tensor([-1, 2]), r"labels must lie in \[0, 3\), got values in \[-1, 2\]"),
        (torch.tensor([0.0, 1.0]), "labels must be integer class indices, got dtype torch.float32"),
        (torch.tensor([[0, 1]]), r"labels must be 1-D, got shape \(1, 2\)"),
    ],
)
def test_grouping_names_bad_labels(labels: torch.Tensor, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        group_by_class(labels, 3)


def _class_grams(rows: torch.Tensor, labels: torch.Tensor, classes: int) -> torch.Tensor:
    return torch.stack([rows[labels == c].T @ rows[labels == c] for c in range(classes)])


def test_row_moments_with_host_counts_equal_the_direct_class_grams() -> None:
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(300, 130, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 5, (300,), generator=g)
    grouping = group_by_class(labels, 5)
    class_grams = torch.zeros(5, 130, 130, dtype=torch.float64)
    moments = row_moments(
        rows[grouping.order],
        grouping.sorted_labels,
        num_classes=5,
        class_grams=class_grams,
        sorted_counts=grouping.counts,
    )
    expected = _class_grams(rows, labels, 5)
    torch.testing.assert_close(class_grams.tril(), expected.tril(), rtol=1e-12, atol=1e-10)
    assert moments.class_counts.tolist() == list(grouping.counts)


def test_channel_moments_take_a_grouping_or_labels_alike() -> None:
    g = torch.Generator().manual_seed(1)
    maps = torch.randn(12, 6, 5, 5, generator=g)
    labels = torch.randint(0, 3, (12,), generator=g)
    results = []
    for given in (labels, group_by_class(labels, 3)):
        gram = torch.zeros(6, 6, dtype=torch.float64)
        class_grams = torch.zeros(3, 6, 6, dtype=torch.float64)
        moments = channel_gram_moments(maps, given, num_classes=3, gram=gram, class_grams=class_grams)
        results.append((class_grams, moments.class_sums, moments.class_counts))
    for first, second in zip(*results):
        torch.testing.assert_close(first, second, rtol=0, atol=0)
    rows = maps.permute(0, 2, 3, 1).reshape(-1, 6).double()
    expected = _class_grams(rows, labels.repeat_interleave(25), 3)
    torch.testing.assert_close(results[0][0].tril(), expected.tril(), rtol=1e-12, atol=1e-10)


@pytest.mark.parametrize("reduction", ["flatten", "channel"])
def test_metric_values_are_the_same_with_a_grouping(reduction: str) -> None:
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(16, 4, 3, 3, generator=g), torch.randint(0, 4, (16,), generator=g)) for _ in range(3)]
    by_labels = ActivationSpectrum(reduction=reduction, num_classes=4)
    by_grouping = ActivationSpectrum(reduction=reduction, num_classes=4)
    for x, y in batches:
        by_labels.update(x, y)
        by_grouping.update(x, group_by_class(y, 4))
    first, second = by_labels.compute().scalars(), by_grouping.compute().scalars()
    assert first.keys() == second.keys() and len(first) > 10
    for key, value in first.items():
        assert value == pytest.approx(second[key], rel=1e-12, abs=1e-12, nan_ok=True), key


def test_metric_rejects_a_grouping_of_another_batch_or_class_count() -> None:
    metric = ActivationSpectrum(num_classes=4)
    with pytest.raises(ValueError, match=r"labels must have shape \(8,\)"):
        metric.update(torch.randn(8, 5), group_by_class(torch.zeros(6, dtype=torch.long), 4))
    with pytest.raises(ValueError, match="grouped into 3 classes, not 4"):
        metric.update(torch.randn(8, 5), group_by_class(torch.zeros(8, dtype=torch.long), 3))


def test_stream_groups_each_batch_once_for_all_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    import rank_lightning.streams as streams

    calls = []

    def counting(labels: torch.Tensor, num_classes: int) -> ClassGrouping:
        calls.append(labels.shape[0])
        return group_by_class(labels, num_classes)

    monkeypatch.setattr(streams, "group_by_class", counting)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8), torch.nn.Linear(8, 3))
    g = torch.Generator().manual_seed(3)
    with RankTracker(model, layers=["0", "2", "3"], num_classes=3) as tracker:
        for _ in range(2):
            with tracker.batch(torch.randint(0, 3, (10,), generator=g)):
                model(torch.randn(10, 6, generator=g))
    assert calls == [10, 10]  # one grouping per batch, shared by the three layers
    values = tracker.compute()
    assert len(values) == 3 and all(math.isfinite(v["tcv"]) for v in values.values())


def test_serial_if_small_runs_small_cpu_work_on_one_thread() -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        cpu = torch.zeros(1)
        with serial_if_small(cpu, 64):
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        with serial_if_small(cpu, SERIAL_EIGH_BELOW):  # large: torch's count
            assert torch.get_num_threads() == 2
        with pytest.raises(RuntimeError, match="inside"), serial_if_small(cpu, 8):
            raise RuntimeError("inside")
        assert torch.get_num_threads() == 2  # restored after an error too
    finally:
        torch.set_num_threads(before)


def test_class_counts_equal_bincount_and_reject_labels_out_of_range() -> None:
    labels = torch.tensor([3, 0, 3, 1, 3])
    assert class_counts(labels, 5).tolist() == torch.bincount(labels, minlength=5).tolist() == [1, 1, 0, 3, 0]
    assert class_counts(labels, 5).dtype == torch.int64
    with pytest.raises(IndexError):
        class_counts(labels, 3)


def test_grouping_slots_give_each_input_its_place_within_its_class() -> None:
    labels = torch.tensor([2, 0, 2, 1, 0, 2])
    assert group_by_class(labels, 4).slots.tolist() == [0, 0, 1, 0, 1, 2]
    moved = group_by_class(labels, 4).to("cpu")
    assert moved.slots.tolist() == [0, 0, 1, 0, 1, 2]
    assert ClassGrouping(labels, labels, labels, (1,)).to("cpu").slots is None  # made without slots


def _batched_everywhere(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """Take the padded batched product of the class Grams (the path off the CPU) on the CPU; record its blocks."""
    import rank_lightning.functional.streaming as streaming

    shapes: list[tuple] = []
    original = streaming._padded_class_blocks

    def recording(values, labels, slots, num_classes, max_count):
        blocks = original(values, labels, slots, num_classes, max_count)
        shapes.append(tuple(blocks.shape))
        return blocks

    monkeypatch.setattr(streaming, "_batched_class_products", lambda device: True)
    monkeypatch.setattr(streaming, "_padded_class_blocks", recording)
    return shapes


def _channel_class_grams(maps: torch.Tensor, labels: torch.Tensor, classes: int, **options) -> tuple:
    """Fresh class Grams of ``maps`` (channel reduction) and the batch's moments."""
    channels = maps.shape[1]
    class_grams = torch.zeros(classes, channels, channels, dtype=torch.float64)
    gram = torch.zeros(channels, channels, dtype=torch.float64)
    grouping = group_by_class(labels, classes)
    moments = channel_gram_moments(maps, grouping, num_classes=classes, gram=gram, class_grams=class_grams, **options)
    return class_grams, moments


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_batched_class_products_equal_the_class_by_class_products(monkeypatch, dtype) -> None:
    import rank_lightning.functional.streaming as streaming

    g = torch.Generator().manual_seed(4)
    maps = torch.randn(40, 6, 5, 5, generator=g).to(dtype)
    labels = torch.randint(0, 4, (40,), generator=g)
    reference = torch.randn(6, generator=g, dtype=torch.float64)

    def run() -> tuple:
        return _channel_class_grams(maps, labels, 4, reference=reference)

    looped_grams, looped = run()
    shapes = _batched_everywhere(monkeypatch)
    most = max(group_by_class(labels, 4).counts)
    monkeypatch.setattr(streaming, "_CUDA_BLOCK_VALUES", 4 * 6 * most * 10)  # blocks of 10 positions: three products
    batched_grams, batched = run()
    assert shapes == [(4, 6, most * 10)] * 2 + [(4, 6, most * 5)]
    rows = maps.permute(0, 2, 3, 1).reshape(-1, 6).double() - reference
    expected = _class_grams(rows, labels.repeat_interleave(25), 4)
    torch.testing.assert_close(batched_grams.tril(), expected.tril(), rtol=1e-12, atol=1e-10)
    torch.testing.assert_close(batched_grams.tril(), looped_grams.tril(), rtol=1e-12, atol=1e-10)
    for name in ("feature_sum", "sum_squares", "class_sums"):
        torch.testing.assert_close(getattr(batched, name), getattr(looped, name), rtol=1e-12, atol=1e-10)
    torch.testing.assert_close(batched.class_counts, looped.class_counts, rtol=0, atol=0)


def test_classes_of_very_unequal_size_go_class_by_class(monkeypatch) -> None:
    g = torch.Generator().manual_seed(6)
    maps = torch.randn(20, 3, 4, 4, generator=g)
    labels = torch.zeros(20, dtype=torch.long)
    labels[0] = 1  # ten classes, one holding 19 of the 20 inputs: padding would be 10 x 19 inputs
    shapes = _batched_everywhere(monkeypatch)
    class_grams = torch.zeros(10, 3, 3, dtype=torch.float64)
    channel_gram_moments(
        maps,
        group_by_class(labels, 10),
        num_classes=10,
        gram=torch.zeros(3, 3, dtype=torch.float64),
        class_grams=class_grams,
    )
    assert shapes == []
    rows = maps.permute(0, 2, 3, 1).reshape(-1, 3).double()
    expected = _class_grams(rows, labels.repeat_interleave(16), 10)
    torch.testing.assert_close(class_grams.tril(), expected.tril(), rtol=1e-12, atol=1e-10)


@pytest.mark.parametrize("reduction", ["flatten", "channel"])
def test_metric_values_are_the_same_with_batched_class_products(monkeypatch, reduction: str) -> None:
    g = torch.Generator().manual_seed(7)
    batches = [(torch.randn(24, 4, 3, 3, generator=g), torch.randint(0, 3, (24,), generator=g)) for _ in range(3)]
    looped = ActivationSpectrum(reduction=reduction, num_classes=3)
    for x, y in batches:
        looped.update(x, y)
    shapes = _batched_everywhere(monkeypatch)
    batched = ActivationSpectrum(reduction=reduction, num_classes=3)
    for x, y in batches:
        batched.update(x, y)
    assert len(shapes) == 3  # one batched product per batch
    first, second = looped.compute().scalars(), batched.compute().scalars()
    assert first.keys() == second.keys() and any("classwise" in key or "vr" in key.lower() for key in first)
    for key, value in first.items():
        assert value == pytest.approx(second[key], rel=1e-10, abs=1e-12, nan_ok=True), key


@pytest.mark.parametrize("precision", ["float64", "float32"])
@pytest.mark.parametrize("centred", [False, True])
def test_batched_class_products_in_either_precision_with_or_without_a_reference(monkeypatch, precision, centred):
    g = torch.Generator().manual_seed(8)
    maps = torch.randn(30, 5, 3, 3, generator=g) + 2.0
    labels = torch.randint(0, 3, (30,), generator=g)
    reference = torch.full((5,), 2.0, dtype=torch.float64) if centred else None

    def run() -> tuple:
        return _channel_class_grams(maps, labels, 3, reference=reference, precision=precision)

    looped_grams, looped = run()
    shapes = _batched_everywhere(monkeypatch)
    batched_grams, batched = run()
    assert len(shapes) == 1
    rows = maps.permute(0, 2, 3, 1).reshape(-1, 5).double() - (0.0 if reference is None else reference)
    expected = _class_grams(rows, labels.repeat_interleave(9), 3)
    tolerance = 1e-12 if precision == "float64" else 1e-6  # float32 products: about 1e-7 of the Gram
    for grams in (looped_grams, batched_grams):
        torch.testing.assert_close(grams.tril(), expected.tril(), rtol=tolerance, atol=tolerance * expected.abs().max())
    for name in ("feature_sum", "sum_squares", "class_sums"):
        torch.testing.assert_close(getattr(batched, name), getattr(looped, name), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("unequal", [False, True])
def test_batched_row_class_products_equal_the_direct_class_grams(monkeypatch, unequal: bool) -> None:
    g = torch.Generator().manual_seed(5)
    rows = torch.randn(90, 7, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 3, (90,), generator=g)
    if unequal:
        labels = torch.zeros(90, dtype=torch.long)
        labels[:2] = torch.tensor([3, 5])  # 88 of 90 rows in one of eight classes: padding would be 8 x 88 rows
    classes = 8 if unequal else 3
    grouping = group_by_class(labels, classes)
    shapes = _batched_everywhere(monkeypatch)
    class_grams = torch.zeros(classes, 7, 7, dtype=torch.float64)
    sorted_rows = rows[grouping.order]
    options = {"num_classes": classes, "class_grams": class_grams, "sorted_counts": grouping.counts}
    row_moments(sorted_rows, grouping.sorted_labels, **options)
    assert shapes == ([] if unequal else [(3, 7, max(grouping.counts))])  # unequal classes: class by class
    expected = _class_grams(rows, labels, classes)
    torch.testing.assert_close(class_grams.tril(), expected.tril(), rtol=1e-12, atol=1e-10)
