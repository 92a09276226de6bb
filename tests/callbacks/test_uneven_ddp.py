import pytest

from tests.callbacks.uneven_ddp_helpers import TRAIN_SAMPLES, VAL_SAMPLES, fit


@pytest.mark.slow
def test_callbacks_that_walk_the_loaders_measure_each_sample_once_on_two_processes(tmp_path):
    # 61 validation and 67 training samples on 2 processes: Lightning's samplers repeat one sample at the end of the
    # second process's passes, which was measured twice.
    single = fit(tmp_path / "single", devices=1)
    ddp = fit(tmp_path / "ddp", devices=2)

    # Low-dimensional evaluation: the training set, then the validation set, every sample exactly once.
    assert single["lowdim_samples"] == ddp["lowdim_samples"] == [list(range(TRAIN_SAMPLES)), list(range(VAL_SAMPLES))]
    assert single["neural_samples"] == ddp["neural_samples"] == VAL_SAMPLES
    for metric, value in single["neural_collapse"].items():
        assert ddp["neural_collapse"][metric] == pytest.approx(value, rel=1e-9, abs=1e-12), metric
    for key, value in single["clsdim"].items():
        assert ddp["clsdim"][key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
