"""Grouped and depthwise conv spectra, step windows under manual optimization, the appended curve points and peft
LoRA layers give on two processes the numbers of one."""

import importlib.util

import pytest

from tests.callbacks.ddp_new_features_helpers import CURVES, WORLD_SIZE, fit_grouped_manual, fit_lora
from tests.callbacks.training_ddp_helpers import assert_histories_close


def _logged(rows: list[dict[str, str]], prefixes: tuple[str, ...]) -> dict[tuple[int, str], float]:
    """The CSV logger's values by (step, key)."""
    return {
        (int(row["step"]), key): float(value)
        for row in rows
        for key, value in row.items()
        if value and key.startswith(prefixes)
    }


@pytest.mark.slow
def test_grouped_convs_manual_windows_and_appended_points_on_two_processes(tmp_path):
    # 96 samples, 16 rows per batch of one process and 8 per process on two: 6 batches, an optimizer step after every
    # 2nd (3 steps). Activation windows of 2 batches at steps 2 (and the initial point 0); weights at every step.
    single = fit_grouped_manual(tmp_path / "single", devices=1)
    ddp = fit_grouped_manual(tmp_path / "ddp", devices=WORLD_SIZE)

    assert sorted(single["curves"]["rank_train_curves"]["history"], key=int) == ["0", "2"]
    assert sorted(single["curves"]["weight_curves"]["history"], key=int) == ["0", "1", "2", "3"]
    # The window of step 2: batches 2 and 3, 2 x 16 rows of 3 x 3 positions each.
    assert single["curves"]["rank_train_curves"]["history"]["2"]["grouped"]["channel/spectrum_rows"] == 288
    # A grouped conv's matrix is block-diagonal: 6 x (4 * 9), rank 6.
    assert single["curves"]["weight_curves"]["history"]["0"]["grouped"]["numerical_rank"] == 6
    for name in CURVES:
        assert_histories_close(ddp["curves"][name]["history"], single["curves"][name]["history"], rel=1e-12)
        assert ddp["curves"][name]["layers"] == single["curves"][name]["layers"]
    # Before the fit's end, the curve files name a file of appended points, rank zero's only, that read_curve_file
    # reads into the same history; the end of fit rewrites the curve files whole and removes them.
    for run in (single, ddp):
        for snapshot in run["snapshots"].values():
            assert snapshot["jsonl"] == sorted(snapshot["appended"][name] for name in CURVES)
            for name in CURVES:
                assert snapshot["curves"][name]["history"] == run["curves"][name]["history"]
        assert run["jsonl"] == []
    assert ddp["snapshots"][0] == ddp["snapshots"][1]
    prefixes = ("rank_train/", "weight/")
    single_logged, ddp_logged = _logged(single["rows"], prefixes), _logged(ddp["rows"], prefixes)
    assert {step for step, _ in single_logged} == {0, 1, 2, 3}
    assert ddp_logged.keys() == single_logged.keys()
    assert ddp_logged == pytest.approx(single_logged, rel=1e-12, abs=1e-12, nan_ok=True)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="peft is not installed")
def test_lora_weights_and_updates_on_two_processes(tmp_path):
    # 64 sequences, 16 per step of one process and 8 per process on two: 3 SGD steps of the LoRA factors.
    single = fit_lora(tmp_path / "single", devices=1)
    ddp = fit_lora(tmp_path / "ddp", devices=WORLD_SIZE)

    history = single["weight_curves"]["history"]
    assert sorted(history, key=int) == ["0", "1", "2", "3"]
    update = "model.base_model.model.transformer.h.0.attn.c_attn.q_proj.lora_update"
    assert history["3"][update]["numerical_rank"] == 4  # B moved off zero: the update has the adapter's rank
    assert_histories_close(ddp["weight_curves"]["history"], history, rel=1e-12)
    single_logged, ddp_logged = _logged(single["rows"], ("weight/",)), _logged(ddp["rows"], ("weight/",))
    assert any(key.endswith("lora_update/numerical_rank") for _, key in single_logged)
    assert ddp_logged.keys() == single_logged.keys()
    assert ddp_logged == pytest.approx(single_logged, rel=1e-12, abs=1e-12, nan_ok=True)
