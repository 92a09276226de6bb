"""NeuralCollapseStatistics: two streamed passes equal the in-memory computation, in one process and under DDP."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from rank_lightning.functional.neural_collapse import NC_METRICS, nc3, neural_collapse
from rank_lightning.metrics import NeuralCollapseStatistics
from tests.metrics.neural_collapse_ddp_helpers import ddp_worker, mixture, stream


def test_two_streamed_passes_equal_the_in_memory_computation() -> None:
    x, y, logits, weight = mixture(seed=1)
    metric = NeuralCollapseStatistics(num_classes=4, num_features=x.shape[1])
    for xb, yb in zip(x.split(50), y.split(50)):
        metric.update(xb, yb)
    assert not metric.second_pass
    metric.start_second_pass()
    # The second pass may see the batches in another order.
    for xb, yb, lb in reversed(list(zip(x.split(70), y.split(70), logits.split(70)))):
        metric.update(xb, yb, lb)
    metric.head_weight = weight
    result = metric.compute()
    expected = neural_collapse(x, y, head_weight=weight, predictions=logits.argmax(dim=1))
    for key in NC_METRICS:
        assert result.as_dict()[key] == pytest.approx(expected.as_dict()[key], rel=1e-10), key
    assert result.num_samples == 360


def test_without_logits_or_head_nc3_and_nc4_are_nan() -> None:
    x, y, _, _ = mixture(seed=2)
    metric = NeuralCollapseStatistics(num_classes=4, num_features=x.shape[1])
    metric.update(x, y)
    metric.start_second_pass()
    metric.update(x, y)
    result = metric.compute()
    assert math.isnan(result.nc3) and math.isnan(result.nc4)
    assert result.nc1 == pytest.approx(neural_collapse(x, y).nc1, rel=1e-10)
    metric.reset()
    assert not metric.second_pass and int(metric.class_counts.sum()) == 0


def test_passes_over_different_data_and_bad_batches_raise() -> None:
    x, y, logits, _ = mixture(seed=3)
    metric = NeuralCollapseStatistics(num_classes=4, num_features=x.shape[1])
    with pytest.raises(RuntimeError, match="start_second_pass"):
        metric.compute()
    metric.update(x, y)
    metric.start_second_pass()
    metric.update(x[:100], y[:100])
    with pytest.raises(RuntimeError, match="different samples"):
        metric.compute()
    with pytest.raises(ValueError, match=r"features must be \(B, 10\)"):
        metric.update(x[:, :5], y)
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 4\)"):
        metric.update(x, y + 1)
    with pytest.raises(ValueError, match=r"logits must be \(360, 4\)"):
        metric.update(x, y, logits[:, :3])
    with pytest.raises(ValueError, match="num_classes"):
        NeuralCollapseStatistics(num_classes=0, num_features=3)


@pytest.mark.slow
def test_two_process_ddp_equals_one_process(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    mp.spawn(ddp_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    single = stream(0, 1)
    for rank in range(2):
        distributed = torch.load(tmp_path / f"rank{rank}.pt")
        assert distributed["num_samples"] == 360.0
        for key, value in single.items():
            assert distributed[key] == pytest.approx(value, rel=1e-10), key
        # sync_on_compute=False: both passes over this process's share only (its class means, not the global ones).
        local, own_share = torch.load(tmp_path / f"local{rank}.pt"), stream(rank, 2)
        assert local["num_samples"] == own_share["num_samples"] == 180.0
        for key, value in own_share.items():
            assert local[key] == pytest.approx(value, rel=1e-10, nan_ok=True), key


def test_float32_features_drop_rounding_directions_when_streamed() -> None:
    # 6 classes in d = 30 whose features have rank 3: float32 rounding must not count as between-class directions.
    gen = torch.Generator().manual_seed(1)
    centres = torch.randn(6, 30, generator=gen, dtype=torch.float64) * 3
    y = torch.arange(6).repeat_interleave(50)
    x64 = centres[y] + torch.randn(300, 30, generator=gen, dtype=torch.float64)
    mixing = torch.randn(30, 3, generator=gen, dtype=torch.float64)
    x64 = x64 @ mixing @ mixing.T / 30
    x32 = x64.float()
    metric = NeuralCollapseStatistics(num_classes=6, num_features=30)
    for xb, yb in zip(x32.split(64), y.split(64)):
        metric.update(xb, yb)
    assert metric.input_dtype == torch.float32
    metric.start_second_pass()
    for xb, yb in zip(x32.split(64), y.split(64)):
        metric.update(xb, yb)
    result = metric.compute()
    assert result.nc1 == pytest.approx(neural_collapse(x64, y).nc1, rel=1e-5)
    assert result.nc1 == pytest.approx(neural_collapse(x32, y).nc1, rel=1e-10)


def test_second_pass_labels_of_a_class_without_mean_raise_naming_it() -> None:
    x, y, _, _ = mixture(seed=4)
    metric = NeuralCollapseStatistics(num_classes=4, num_features=x.shape[1])
    seen = y < 3
    metric.update(x[seen], y[seen])
    metric.start_second_pass()
    metric.update(x[seen], y[seen])  # the classes of the first pass: accepted
    with pytest.raises(ValueError, match=r"labels \[3\] belong to classes that had no sample"):
        metric.update(x, y)


def test_complex_features_or_logits_are_refused_naming_them() -> None:
    # Converting them to float64 would drop the imaginary part without a word.
    metric = NeuralCollapseStatistics(num_classes=2, num_features=3)
    labels = torch.tensor([0, 1, 0, 1])
    with pytest.raises(ValueError, match=r"features must be real, got torch\.complex64"):
        metric.update(torch.randn(4, 3, dtype=torch.complex64), labels)
    metric.update(torch.randn(4, 3), labels)
    metric.start_second_pass()
    with pytest.raises(ValueError, match=r"logits must be real, got torch\.complex64"):
        metric.update(torch.randn(4, 3), labels, torch.randn(4, 2, dtype=torch.complex64))


def test_calling_the_metric_streams_the_batch_like_update() -> None:
    # torchmetrics' forward would reset the states to compute the batch's value, losing the sums streamed so far.
    x, y, logits, weight = mixture(seed=5)
    expected = neural_collapse(x, y, head_weight=weight, predictions=logits.argmax(dim=1)).as_dict()
    metric = NeuralCollapseStatistics(num_classes=4, num_features=x.shape[1])
    for xb, yb in zip(x.split(50), y.split(50)):
        assert metric(xb, yb) is None
    metric.start_second_pass()
    for xb, yb, lb in zip(x.split(50), y.split(50), logits.split(50)):
        assert metric(xb, yb, lb) is None
    metric.head_weight = weight
    result = metric.compute()
    for key in NC_METRICS:
        assert result.as_dict()[key] == pytest.approx(expected[key], rel=1e-10), key


def test_a_state_saved_in_the_second_pass_resumes_after_start_second_pass() -> None:
    x, y, logits, weight = mixture(seed=6)
    expected = neural_collapse(x, y, head_weight=weight, predictions=logits.argmax(dim=1)).as_dict()
    saved = NeuralCollapseStatistics(num_classes=4, num_features=x.shape[1])
    saved.persistent(True)
    saved.update(x, y)
    saved.start_second_pass()
    saved.update(x[:150], y[:150], logits[:150])
    metric = NeuralCollapseStatistics(num_classes=4, num_features=x.shape[1])
    metric.load_state_dict(saved.state_dict())
    # Without the means the batch would be added to the class sums of the first pass.
    with pytest.raises(RuntimeError, match="saved during the second pass; call start_second_pass"):
        metric.update(x[150:], y[150:], logits[150:])
    metric.start_second_pass()
    metric.update(x[150:], y[150:], logits[150:])
    metric.head_weight = weight
    result = metric.compute()
    for key in NC_METRICS:
        assert result.as_dict()[key] == pytest.approx(expected[key], rel=1e-10), key


def test_set_dtype_keeps_the_float64_sums() -> None:
    x, y, logits, weight = mixture(seed=7)
    metric = NeuralCollapseStatistics(num_classes=4, num_features=x.shape[1])
    metric.update(x[:180] + 1000, y[:180])
    metric.set_dtype(torch.float16)
    metric.update(x[180:] + 1000, y[180:])
    metric.start_second_pass()
    metric.update(x + 1000, y, logits)
    metric.head_weight = weight
    assert metric.class_sums.dtype == metric.class_scatter.dtype == torch.float64
    expected = neural_collapse(x, y, head_weight=weight, predictions=logits.argmax(dim=1)).as_dict()
    result = metric.compute().as_dict()
    for key in NC_METRICS:
        assert result[key] == pytest.approx(expected[key], rel=1e-9), key


def test_a_move_to_another_dtype_keeps_the_float64_sums_and_moves_the_means() -> None:
    # metric.to(dtype) bypassed set_dtype and rounded the float64 sums; a device move left the fixed means behind.
    x, y, logits, weight = mixture(seed=7)
    metric = NeuralCollapseStatistics(num_classes=4, num_features=x.shape[1])
    metric.update(x[:180] + 1000, y[:180])
    metric = metric.to(torch.float16)
    metric.update(x[180:] + 1000, y[180:])
    metric.start_second_pass()
    metric.update(x + 1000, y, logits)
    metric.head_weight = weight
    assert metric.class_sums.dtype == metric.class_scatter.dtype == metric.input_eps.dtype == torch.float64
    expected = neural_collapse(x, y, head_weight=weight, predictions=logits.argmax(dim=1)).as_dict()
    result = metric.compute().as_dict()
    for key in NC_METRICS:
        assert result[key] == pytest.approx(expected[key], rel=1e-9), key
    metric.to("meta")
    assert metric._means.device.type == metric._directions.device.type == metric.class_sums.device.type == "meta"
    assert metric._means.dtype == torch.float64


def test_the_first_pass_dtype_survives_a_saved_state_and_a_merge() -> None:
    # The dtype that sets NC1's rounding threshold was a plain attribute: a loaded or merged first pass forgot it and
    # kept float32 rounding as between-class directions (NC1 of 14.7 instead of 0.116 on these features).
    gen = torch.Generator().manual_seed(1)
    y = torch.arange(6).repeat_interleave(50)
    centres = 3 * torch.randn(6, 30, generator=gen, dtype=torch.float64)
    x64 = centres[y] + torch.randn(300, 30, generator=gen, dtype=torch.float64)
    mixing = torch.randn(30, 3, generator=gen, dtype=torch.float64)
    x32 = (x64 @ mixing @ mixing.T / 30).float()
    saved, merged = NeuralCollapseStatistics(6, 30), NeuralCollapseStatistics(6, 30)
    saved.persistent(True)
    saved.update(x32[:150], y[:150])
    loaded = NeuralCollapseStatistics(6, 30)
    loaded.load_state_dict(saved.state_dict())
    merged.update(x32[150:].double(), y[150:])
    merged.merge_state(saved)
    loaded.update(x32[150:], y[150:])
    for metric in (loaded, merged):
        assert metric.input_dtype == torch.float32
        metric.start_second_pass()
        metric.update(x32, y)
        assert metric.compute().nc1 == pytest.approx(neural_collapse(x32, y).nc1, rel=1e-10)
    assert neural_collapse(x32, y).nc1 == pytest.approx(0.1164, rel=1e-3)
    older = saved.state_dict()
    del older["input_eps"]  # saved before the dtype was a state: loads, the dtype unknown
    loaded.load_state_dict(older)
    assert loaded.input_dtype is None and int(loaded.class_counts.sum()) == 150


def test_merge_state_refuses_sums_of_another_pass_or_around_other_means() -> None:
    # Both merges went through and computed without the merged rows, or with residuals around other means.
    x, y, logits, weight = mixture(seed=8)
    half = [(x[i::2], y[i::2], logits[i::2]) for i in (0, 1)]
    metric, other, first_only = (NeuralCollapseStatistics(num_classes=4, num_features=10) for _ in range(3))
    metric.update(x, y)
    metric.start_second_pass()
    metric.update(*half[0])
    first_only.update(x, y)
    with pytest.raises(ValueError, match="first-pass sums into a metric whose means are fixed; merge the first"):
        metric.merge_state(first_only)
    other.update(*half[1][:2])
    other.start_second_pass()  # the means of its own half
    other.update(*half[1])
    with pytest.raises(ValueError, match="cannot merge a second pass around other class means"):
        metric.merge_state(other)
    with pytest.raises(ValueError, match="second-pass sums into a metric in its first pass"):
        first_only.merge_state(other.metric_state)
    # The way that works: the first passes merged, then one second pass around the means of all of them.
    merged = NeuralCollapseStatistics(num_classes=4, num_features=10)
    merged.update(*half[0][:2])
    rest = NeuralCollapseStatistics(num_classes=4, num_features=10)
    rest.update(*half[1][:2])
    merged.merge_state(rest)
    merged.start_second_pass()
    merged.update(x, y, logits)
    merged.head_weight = weight
    expected = neural_collapse(x, y, head_weight=weight, predictions=logits.argmax(dim=1)).as_dict()
    for key in NC_METRICS:
        assert merged.compute().as_dict()[key] == pytest.approx(expected[key], rel=1e-10), key


def test_a_state_of_another_shape_is_refused_and_the_metric_left_as_it_was() -> None:
    # torchmetrics set the states as they came: (3, 10) class sums went into a metric of 4 classes, which failed, if
    # at all, batches later.
    x, y, _, _ = mixture(seed=9, classes=3)
    saved = NeuralCollapseStatistics(num_classes=3, num_features=10)
    saved.persistent(True)
    saved.update(x, y)
    for classes, features in ((4, 10), (3, 8)):
        metric = NeuralCollapseStatistics(num_classes=classes, num_features=features)
        message = f"has num_classes=3, num_features=10; this one has num_classes={classes}, num_features={features}"
        with pytest.raises(RuntimeError, match=message):
            metric.load_state_dict(saved.state_dict())
        assert tuple(metric.class_sums.shape) == (classes, features) and int(metric.class_counts.sum()) == 0
    restored = NeuralCollapseStatistics(num_classes=3, num_features=10)
    restored.load_state_dict(saved.state_dict())
    restored.start_second_pass()
    restored.update(x, y)
    assert restored.compute().nc1 == pytest.approx(neural_collapse(x, y).nc1, rel=1e-10)


def test_classes_tight_against_their_distance_from_the_origin_warn_of_the_rounded_means() -> None:
    # A float64 class mean 1e6 from the origin is off by about eps64 * 1e6 = 2e-10: for a spread 1e-8 that moves the
    # residual scatter, hence NC1 and the CDNV, by about 1e-4 (measured 4e-5 to 7e-5); a spread 1e-2 loses nothing.
    g = torch.Generator().manual_seed(5)
    y = torch.arange(4).repeat_interleave(60)
    means = torch.randn(4, 8, generator=g, dtype=torch.float64)
    for offset, spread, warns in ((1e6, 1e-8, True), (1e3, 1e-2, False)):
        x = means[y] + spread * torch.randn(240, 8, generator=g, dtype=torch.float64) + offset
        halves = [NeuralCollapseStatistics(4, 8), NeuralCollapseStatistics(4, 8)]
        for metric, xs, ys in zip(halves, x.split(120), y.split(120)):
            for xb, yb in zip(xs.split(25), ys.split(25)):
                metric.update(xb, yb)
        halves[0].merge_state(halves[1])
        halves[0].start_second_pass()
        for xb, yb in zip(x.split(25), y.split(25)):
            halves[0].update(xb, yb)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = halves[0].compute()
        messages = [str(w.message) for w in caught]
        for statistic in ("NC1", "CDNV"):
            named = [m for m in messages if m.startswith(f"neural collapse: {statistic} (")]
            assert len(named) == int(warns), messages
            assert all("may be off by about" in m and "residuals around class means" in m for m in named)
        if not warns:
            expected = neural_collapse(x, y)
            assert result.nc1 == pytest.approx(expected.nc1, rel=1e-9)
            assert result.cdnv == pytest.approx(expected.cdnv, rel=1e-9)


def test_nan_logits_or_non_finite_features_give_nan_with_a_warning_not_a_wrong_value() -> None:
    # NaN logits used to be read as predictions (argmax takes the NaN): NC4 was 0.3556 here instead of NaN.
    x, y, logits, _ = mixture(n=90, d=6, classes=3, seed=4)
    clean, broken = NeuralCollapseStatistics(3, 6), NeuralCollapseStatistics(3, 6)
    bad_logits = logits.clone()
    bad_logits[:45, 1] = math.nan
    for metric, scores in ((clean, logits), (broken, bad_logits)):
        metric.update(x, y)
        metric.start_second_pass()
        metric.update(x, y, scores)
    with pytest.warns(RuntimeWarning, match=r"the logits of 45 of 90 samples held NaN \(no argmax\); nc4 is NaN"):
        result = broken.compute()
    assert math.isnan(result.nc4) and not math.isnan(clean.compute().nc4)
    assert result.nc1 == clean.compute().nc1
    # Features that are NaN in the second pass only: the class means stand, the residuals do not.
    second = NeuralCollapseStatistics(3, 6)
    second.update(x, y)
    second.start_second_pass()
    x_nan = x.clone()
    x_nan[5, 2] = math.nan
    second.update(x_nan, y, logits)
    with pytest.warns(RuntimeWarning, match="NaN or Inf in the second pass; nc1, cdnv and nc4 are NaN"):
        values = second.compute().as_dict()
    assert [k for k, v in values.items() if math.isnan(v)] == ["nc1", "nc3", "nc4", "cdnv"]  # nc3: no head
    assert values["nc2_equinorm"] == clean.compute().nc2_equinorm
    # In the first pass they enter the class means: every metric is NaN.
    first = NeuralCollapseStatistics(3, 6)
    first.update(x_nan, y)
    first.start_second_pass()
    first.update(x, y, logits)
    with pytest.warns(RuntimeWarning, match="NaN or Inf in the first pass; every metric is NaN"):
        assert all(math.isnan(v) for v in first.compute().as_dict().values())
    first.persistent(True)
    older = first.state_dict()
    del older["undefined_predictions"]  # saved before the count existed: loads as none
    first.load_state_dict(older)
    assert int(first.undefined_predictions) == 0


def test_features_logits_or_labels_that_are_not_tensors_are_refused_naming_them() -> None:
    x, y, logits, _ = mixture(n=12, d=4, classes=3)
    metric = NeuralCollapseStatistics(3, 4)
    with pytest.raises(TypeError, match=r"^features must be a torch.Tensor, got ndarray$"):
        metric.update(x.numpy(), y)
    with pytest.raises(ValueError, match=r"^labels must be integer labels .*; got a list; pass integer"):
        metric.update(x, y.tolist())
    metric.update(x, y)
    metric.start_second_pass()
    with pytest.raises(TypeError, match=r"^logits must be a torch.Tensor, got list$"):
        metric.update(x, y, logits.tolist())
    metric.update(x, y, logits)
    metric.head_weight = torch.randn(3, 4).numpy()
    with pytest.raises(TypeError, match=r"^head_weight must be a torch.Tensor, got ndarray$"):
        metric.compute()


def test_a_new_measurement_without_reset_is_named_as_the_cause_of_different_passes() -> None:
    # A loop over epochs without reset() streams the next first pass into the second: the counts then differ,
    # which was reported as passes over different data only.
    x, y, _, _ = mixture(n=30, d=4, classes=3)
    metric = NeuralCollapseStatistics(3, 4)
    for epoch in range(2):
        metric.update(x, y)
        metric.start_second_pass()
        metric.update(x, y)
        if epoch == 0:
            assert metric.compute().num_samples == 30
    message = r"\[10, 10, 10\] in the first, \[30, 30, 30\] in the second; both must read the same data; a new "
    with pytest.raises(RuntimeError, match=message + r"measurement starts with reset\(\)"):
        metric.compute()
    metric.reset()
    metric.update(x, y)
    metric.start_second_pass()
    metric.update(x, y)
    assert metric.compute().num_samples == 30


def test_a_head_weight_set_after_compute_is_used_and_never_joins_the_state_dict() -> None:
    # compute() returned its cached result (NC3 NaN) after a head was set, and the head's own Parameter was
    # registered as a parameter of the metric: the model's checkpoint held "nc.head_weight", which a new model
    # refused as an unexpected key.
    class _Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(10, 4, dtype=torch.float64)
            self.nc = NeuralCollapseStatistics(4, 10)

    x, y, _, weight = mixture(seed=5)
    net = _Net()
    net.nc.update(x, y)
    net.nc.start_second_pass()
    net.nc.update(x, y)
    assert math.isnan(net.nc.compute().nc3)
    net.nc.head_weight = weight
    assert net.nc.compute().nc3 == pytest.approx(neural_collapse(x, y, head_weight=weight).nc3, rel=1e-10)
    net.nc.head_weight = net.fc.weight
    assert net.nc.compute().nc3 == pytest.approx(neural_collapse(x, y, head_weight=net.fc.weight).nc3, rel=1e-10)
    assert not net.nc.head_weight.requires_grad
    assert list(net.state_dict()) == ["fc.weight", "fc.bias"]
    _Net().load_state_dict(net.state_dict())


def test_a_loaded_state_replaces_the_result_computed_before_it() -> None:
    # compute() returned the cached result of the sums before the load (30 samples) instead of asking for the
    # second pass of the loaded first pass.
    x, y, _, _ = mixture(n=30, d=4, classes=3)
    metric, saved = NeuralCollapseStatistics(3, 4), NeuralCollapseStatistics(3, 4)
    metric.update(x, y)
    metric.start_second_pass()
    metric.update(x, y)
    assert metric.compute().num_samples == 30
    saved.persistent(True)
    saved.update(x[:12], y[:12])
    metric.load_state_dict(saved.state_dict())
    with pytest.raises(RuntimeError, match=r"needs two passes: call start_second_pass\(\) first"):
        metric.compute()
    metric.start_second_pass()
    metric.update(x[:12], y[:12])
    assert metric.compute().num_samples == 12


def test_logits_given_with_some_batches_only_leave_nc4_nan_with_a_warning() -> None:
    x, y, logits, _ = mixture(n=90, d=6, classes=3)
    metric = NeuralCollapseStatistics(3, 6)
    metric.update(x, y)
    metric.start_second_pass()
    metric.update(x[:60], y[:60], logits[:60])
    metric.update(x[60:], y[60:])
    with pytest.warns(RuntimeWarning, match=r"logits came with 60 of the 90 samples of the second pass; nc4 .* is NaN"):
        assert math.isnan(metric.compute().nc4)
    metric.reset()  # no logits at all: NC4 is NaN as documented, without a warning
    metric.update(x, y)
    metric.start_second_pass()
    metric.update(x, y)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert math.isnan(metric.compute().nc4)


def test_no_sample_gives_nan_with_a_warning() -> None:
    metric = NeuralCollapseStatistics(3, 4)
    metric.update(torch.zeros(0, 4), torch.zeros(0, dtype=torch.long))
    metric.start_second_pass()
    with pytest.warns(RuntimeWarning, match=r"^NeuralCollapseStatistics: no sample was streamed; every metric is NaN$"):
        result = metric.compute()
    assert result.num_samples == 0 and all(math.isnan(v) for v in result.as_dict().values())


def test_no_sample_gives_nan_nc3_with_the_heads_weight_set() -> None:
    # The warning says every metric is NaN: NC3 too, which compared the head with no class mean and gave 0.0.
    metric = NeuralCollapseStatistics(3, 4)
    metric.head_weight = torch.ones(3, 4)
    metric.update(torch.zeros(0, 4), torch.zeros(0, dtype=torch.long))
    metric.start_second_pass()
    with pytest.warns(RuntimeWarning, match="every metric is NaN"):
        result = metric.compute()
    assert result.num_samples == 0 and all(math.isnan(v) for v in result.as_dict().values())
    assert math.isnan(nc3(torch.zeros(0, 4), torch.zeros(0, 4), torch.zeros(4)))
