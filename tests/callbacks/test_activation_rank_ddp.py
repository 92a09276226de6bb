import math

import pytest
import torch

from tests.callbacks.activation_rank_ddp_helpers import (
    UNEVEN_SAMPLES,
    WORLD_SIZE,
    fit_by_step,
    fit_uneven,
    validate,
    validate_ragged,
)
from tests.callbacks.checkpoint_ddp_helpers import fit_two_processes


def _logged(rows: list[dict[str, str]]) -> dict[str, float]:
    (row,) = [row for row in rows if row.get("rank/act/numerical_rank")]
    return {key: float(value) for key, value in row.items() if key.startswith("rank/")}


@pytest.mark.slow
def test_two_process_ddp_logs_the_values_of_one_process(tmp_path):
    single_curves, single_rows = validate(tmp_path / "single", devices=1)
    ddp_curves, ddp_rows = validate(tmp_path / "ddp", devices=WORLD_SIZE)

    # validate() of an untrained model is the initial point, epoch -1.
    single, ddp = single_curves["history"]["-1"], ddp_curves["history"]["-1"]
    # "side" runs on the second process only: it is left out rather than hanging the first one in a collective.
    assert ddp_curves["layers"] == single_curves["layers"] == ["conv", "act"]
    assert ddp.keys() == single.keys()
    for layer in single:
        assert ddp[layer].keys() == single[layer].keys()
        assert "channel/tcv" in single[layer] or "tcv" in single[layer]
        for metric, value in single[layer].items():
            assert math.isfinite(value), (layer, metric)
            assert ddp[layer][metric] == pytest.approx(value, rel=1e-9, abs=1e-12), (layer, metric)
    # The logged scalars (float32 through LightningModule.log) agree as well.
    single_logged, ddp_logged = _logged(single_rows), _logged(ddp_rows)
    assert ddp_logged.keys() == single_logged.keys()
    assert len(single_logged) == 2 * 11  # ten metrics and spectrum_rows per layer
    assert ddp_logged == pytest.approx(single_logged, rel=1e-6)


@pytest.mark.slow
def test_step_windows_under_ddp_equal_one_process(tmp_path):
    single = fit_by_step(tmp_path / "single", devices=1)["history"]
    ddp = fit_by_step(tmp_path / "ddp", devices=WORLD_SIZE)["history"]

    # 4 optimizer steps per process: windows end at steps 2 and 4 on every process, as on one process.
    assert sorted(ddp) == sorted(single) == ["2", "4"]
    for step in single:
        for layer, metrics in single[step].items():
            assert ddp[step][layer].keys() == metrics.keys()
            for metric, value in metrics.items():
                assert ddp[step][layer][metric] == pytest.approx(value, rel=1e-9, abs=1e-12), (step, layer, metric)


@pytest.mark.slow
def test_a_layer_whose_flatten_width_differs_between_processes_is_left_out(tmp_path):
    # Each process's first batch fixes a layer's features; sums of 6 and 8 features cannot be added, and the
    # collective that syncs them failed (one process raised, the other was left waiting).
    single = validate_ragged(tmp_path / "single", devices=1)
    ddp = validate_ragged(tmp_path / "ddp", devices=WORLD_SIZE)
    assert single["layers"] == ["act", "tokens"]
    assert ddp["layers"] == ["act"]
    for metric, value in single["history"]["-1"]["act"].items():
        assert ddp["history"]["-1"]["act"][metric] == pytest.approx(value, rel=1e-9, abs=1e-12), metric


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["val", "train"])
def test_samples_the_distributed_sampler_repeats_are_measured_once(tmp_path, stage):
    # 61 samples on 2 processes: Lightning's sampler repeats one at the end of the second process's pass; counted
    # twice, every metric of the initial pass and of the epoch differed from one process's.
    single = fit_uneven(tmp_path / "single", devices=1, stage=stage)
    ddp = fit_uneven(tmp_path / "ddp", devices=WORLD_SIZE, stage=stage)

    assert sorted(ddp["history"]) == sorted(single["history"]) == ["-1", "0"]
    for epoch, layers in single["history"].items():
        assert ddp["history"][epoch].keys() == layers.keys() == {"conv", "act"}
        for layer, metrics in layers.items():
            assert ddp["history"][epoch][layer].keys() == metrics.keys()
            for metric, value in metrics.items():
                expected = pytest.approx(value, rel=1e-9, abs=1e-12)
                assert ddp["history"][epoch][layer][metric] == expected, (epoch, layer, metric)
    assert ddp["history"]["0"]["act"]["spectrum_rows"] == UNEVEN_SAMPLES


@pytest.mark.slow
def test_a_two_process_fit_resumed_inside_a_window_and_an_epoch_gives_the_uninterrupted_curves(tmp_path):
    # The checkpoint of step 6 holds both processes' sums of the window of step 8 (1 of its 3 batches) and of epoch 0
    # (6 of its 8 batches); each process of the resumed fit takes back its own and goes on.
    whole = fit_two_processes(tmp_path / "whole")
    resumed = fit_two_processes(tmp_path / "resumed", ckpt=tmp_path / "whole" / "step=6.ckpt")
    assert sorted(whole["rank_train"], key=int) == ["4", "8", "12", "16"]
    assert sorted(whole["rank_epoch"], key=int) == ["0", "1"]
    assert resumed == whole
    assert whole["rank_train"]["8"]["net.0"]["spectrum_rows"] == 2 * 3 * 4
    assert whole["rank_epoch"]["0"]["net.0"]["spectrum_rows"] == 20
    checkpoint = torch.load(tmp_path / "whole" / "step=6.ckpt", weights_only=False)
    states = checkpoint["callbacks"].values()
    saved = [state[key]["streams"] for state in states for key in ("open_window", "open_epoch") if key in state]
    assert [[part["batches_seen"] for part in streams] for streams in saved] == [[1, 1], [6, 6]]
    grams = [part["layers"]["net.0"]["states"]["class_grams"] for part in saved[0]]
    assert not torch.equal(*grams)  # each process's own
