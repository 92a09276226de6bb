"""The monitors of training batches give on two processes the numbers of one."""

import math

import pytest

from tests.callbacks.training_ddp_helpers import WORLD_SIZE, fit_several_loaders


def _assert_close(ddp: dict, single: dict, rel: float = 1e-9) -> None:
    """The same points, layers and metrics; the numbers equal to ``rel`` relative (NaN where the other has NaN)."""
    assert ddp.keys() == single.keys()
    for point, layers in single.items():
        assert ddp[point].keys() == layers.keys(), point
        for layer, metrics in layers.items():
            assert ddp[point][layer].keys() == metrics.keys(), (point, layer)
            for metric, value in metrics.items():
                got = ddp[point][layer][metric]
                if math.isnan(value):
                    assert math.isnan(got), (point, layer, metric)
                else:
                    assert got == pytest.approx(value, rel=rel, abs=1e-12), (point, layer, metric)


@pytest.mark.slow
def test_several_training_loaders_measure_each_sample_once_on_two_processes(tmp_path):
    # A dict of 23 and 7 samples (max_size_cycle: 2 steps, the second loader read twice): Lightning's samplers
    # repeat a sample at the end of the second process's pass over each loader. With several loaders the repeats were
    # measured, 40 rows where one process measures 37, and every metric of the epoch and the initial point differed.
    single = fit_several_loaders(tmp_path / "single", devices=1, sizes={"a": 23, "b": 7})["history"]
    ddp = fit_several_loaders(tmp_path / "ddp", devices=WORLD_SIZE, sizes={"a": 23, "b": 7})["history"]

    assert sorted(single) == ["-1", "0"]
    assert single["0"]["net.1"]["spectrum_rows"] == single["-1"]["net.1"]["spectrum_rows"] == 23 + 2 * 7
    _assert_close(ddp, single)
