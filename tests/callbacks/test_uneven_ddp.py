import math

import pytest

from tests.callbacks.uneven_ddp_helpers import TRAIN_SAMPLES, VAL_SAMPLES, fit, fit_methods


def _assert_close(ddp: object, single: object, where: str = "", rel: float = 1e-9) -> None:
    """Equal structure; numbers equal to ``rel`` relative (NaN where the other has NaN)."""
    if isinstance(single, dict):
        assert isinstance(ddp, dict) and ddp.keys() == single.keys(), where
        for key in single:
            _assert_close(ddp[key], single[key], f"{where}/{key}", rel)
    elif isinstance(single, list):
        assert isinstance(ddp, list) and len(ddp) == len(single), where
        for i, (a, b) in enumerate(zip(ddp, single)):
            _assert_close(a, b, f"{where}[{i}]", rel)
    elif isinstance(single, float) and math.isnan(single):
        assert isinstance(ddp, float) and math.isnan(ddp), where
    else:
        assert ddp == pytest.approx(single, rel=rel, abs=1e-12), where


@pytest.mark.slow
def test_callbacks_that_walk_the_loaders_measure_each_sample_once_on_two_processes(tmp_path):
    # 61 validation and 67 training samples on 2 processes: Lightning's samplers repeat one sample at the end of the
    # second process's passes, which was measured twice.
    single = fit(tmp_path / "single", devices=1)
    ddp = fit(tmp_path / "ddp", devices=2)

    # Low-dimensional evaluation: the training set, then the validation set, every sample exactly once.
    assert single["lowdim_samples"] == ddp["lowdim_samples"] == [list(range(TRAIN_SAMPLES)), list(range(VAL_SAMPLES))]
    assert single["neural_samples"] == ddp["neural_samples"] == VAL_SAMPLES
    assert sorted(single["activations"]) == ["-1", "0"]
    assert single["activations"]["0"]["probe"]["spectrum_rows"] == VAL_SAMPLES
    _assert_close(ddp, single)


@pytest.mark.slow
def test_a_validation_set_smaller_than_the_processes(tmp_path):
    # One validation sample on 2 processes: the second process's only sample is a repeat, so it measures none. The
    # activation monitor logged nothing, neural collapse hung in its collective, the classification dimension and the
    # low-dimensional evaluation crashed in theirs.
    single = fit(tmp_path / "single", devices=1, val_samples=1)
    ddp = fit(tmp_path / "ddp", devices=2, val_samples=1)

    assert ddp["lowdim_samples"][1] == [0]
    assert ddp["neural_samples"] == ddp["activations"]["0"]["probe"]["spectrum_rows"] == 1
    _assert_close(ddp, single)


@pytest.mark.slow
def test_two_validation_loaders_are_pooled_each_sample_once_on_two_processes(tmp_path):
    # 61 and 13 validation samples: the second process repeats one sample at the end of each loader.
    single = fit(tmp_path / "single", devices=1, second_val_samples=13)
    ddp = fit(tmp_path / "ddp", devices=2, second_val_samples=13)

    validation = [list(range(VAL_SAMPLES)), list(range(13))]
    assert single["lowdim_samples"] == ddp["lowdim_samples"] == [list(range(TRAIN_SAMPLES)), *validation]
    assert single["neural_samples"] == ddp["neural_samples"] == VAL_SAMPLES + 13
    assert single["activations"]["0"]["probe"]["spectrum_rows"] == VAL_SAMPLES + 13
    # The same rows, up to the float32 rounding of the forward pass, which depends on a row's place in its batch.
    _assert_close(ddp, single, rel=1e-7)


@pytest.mark.slow
def test_an_odd_max_samples_is_shared_out_exactly(tmp_path):
    # max_samples=33 on 2 processes: each took ceil(33 / 2) = 17, 34 in all.
    single = fit(tmp_path / "single", devices=1, max_samples=33)
    ddp = fit(tmp_path / "ddp", devices=2, max_samples=33)

    assert single["neural_samples"] == ddp["neural_samples"] == 33
    for run in (single, ddp):
        assert run["activations"]["0"]["probe"]["spectrum_rows"] == 33
    # Neural collapse and the classification dimension take the first samples of each process: together the first
    # 33, as one process takes them. (The activation monitor spreads each process's share over its own batches.)
    _assert_close(ddp["neural_collapse"], single["neural_collapse"])
    _assert_close(ddp["clsdim"], single["clsdim"])


@pytest.mark.slow
def test_the_methods_report_one_number_on_every_process(tmp_path):
    # RankPretraining's r(H) table and LowRankProjection's losses were each process's own batches' values, and the
    # LR-Layers switched on by each process's own accuracy: the two processes logged (and decided on) different
    # numbers.
    reported = fit_methods(tmp_path, devices=2)  # raises if the processes disagree
    assert set(reported["pretraining"]) >= {"net.1"}
    assert all(math.isfinite(v) for values in reported["pretraining"].values() for v in values.values())
    assert {"lr_layer/net.2.0/reconstruction", "lr_layer/net.2.0/norm"} <= set(reported["lr_layer"])
    assert reported["lr_layer"]["lr_layer/enabled"] == 1.0
