"""The monitors of training batches give on two processes the numbers of one."""

import pytest

from tests.callbacks.training_ddp_helpers import WORLD_SIZE, assert_histories_close, fit_several_loaders, fit_steps


def _logged(rows: list[dict[str, str]]) -> dict[tuple[int, str], float]:
    """The CSV logger's values by (step, key)."""
    return {
        (int(row["step"]), key): float(value)
        for row in rows
        for key, value in row.items()
        if value and key.startswith(("rank_train/", "weight/"))
    }


@pytest.mark.slow
def test_step_windows_and_weights_with_accumulation_on_two_processes(tmp_path):
    # 84 samples, 16 rows per step of one process and 8 per process on two (the same rows), two batches per optimizer
    # step: 6 batches and 3 steps per epoch (the last batch of 4 rows, a step of its own). Every 2 steps, windows of 3
    # batches; the window of step 4 spans the epoch boundary (4 + 16 + 16 rows), max_steps=5 stops inside the window
    # of step 6, which is dropped.
    options = {"max_epochs": 2, "max_steps": 5, "accumulate_grad_batches": 2}
    single = fit_steps(tmp_path / "single", devices=1, num_samples=84, **options)
    ddp = fit_steps(tmp_path / "ddp", devices=WORLD_SIZE, num_samples=84, **options)

    for curves in ("rank_train_curves", "weight_curves"):
        assert sorted(single[curves]["history"], key=int) == ["0", "2", "4"]
        assert_histories_close(ddp[curves]["history"], single[curves]["history"], rel=1e-12)
    rows = {step: single["rank_train_curves"]["history"][step]["net.1"]["spectrum_rows"] for step in ("0", "2", "4")}
    assert rows == {"0": 48, "2": 48, "4": 36}
    # The loggers receive the same values at the same steps.
    single_logged, ddp_logged = _logged(single["rows"]), _logged(ddp["rows"])
    assert {step for step, _ in single_logged} == {0, 2, 4}
    assert ddp_logged.keys() == single_logged.keys()
    assert ddp_logged == pytest.approx(single_logged, rel=1e-12, abs=1e-12)


@pytest.mark.slow
def test_several_training_loaders_measure_each_sample_once_on_two_processes(tmp_path):
    # A dict of 23 and 7 samples (max_size_cycle: 2 steps, the second loader read twice): Lightning's samplers
    # repeat a sample at the end of the second process's pass over each loader. With several loaders the repeats were
    # measured, 40 rows where one process measures 37, and every metric of the epoch and the initial point differed.
    single = fit_several_loaders(tmp_path / "single", devices=1, sizes={"a": 23, "b": 7})["history"]
    ddp = fit_several_loaders(tmp_path / "ddp", devices=WORLD_SIZE, sizes={"a": 23, "b": 7})["history"]

    assert sorted(single) == ["-1", "0"]
    assert single["0"]["net.1"]["spectrum_rows"] == single["-1"]["net.1"]["spectrum_rows"] == 23 + 2 * 7
    assert_histories_close(ddp, single, rel=1e-9)
