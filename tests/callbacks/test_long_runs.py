"""Long step-cadence runs: what a record costs must not grow with the points recorded before it."""

from __future__ import annotations

import errno
import json
import pickle
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import rank_lightning.callbacks.curves as curves_module
from rank_lightning.callbacks.curves import FIGURE_DIR, LayerCurves, read_curve_file

_MODULE = SimpleNamespace(log_dict=lambda *args, **kwargs: None)


def _no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def _trainer(tmp_path: Path, loggers: list | None = None) -> SimpleNamespace:
    return SimpleNamespace(
        is_global_zero=True,
        loggers=loggers or [],
        default_root_dir=str(tmp_path),
        sanity_checking=False,
        global_step=0,
        current_epoch=0,
        callback_metrics={},
        state=SimpleNamespace(fn="fit"),
        callbacks=[],
    )


def _record_steps(curves: LayerCurves, trainer: SimpleNamespace, steps: range) -> None:
    for step in steps:
        trainer.global_step = step
        curves.record_and_log(trainer, _MODULE, {"block.0": {"m": step / 10}, "block.1": {"m": -step / 10}})


def _expected(steps: range) -> dict[int, dict[str, dict[str, float]]]:
    return {step: {"block.0": {"m": step / 10}, "block.1": {"m": -step / 10}} for step in steps}


def test_the_curve_file_holds_every_point_after_each_record_but_is_rewritten_whole_rarely(tmp_path, monkeypatch):
    rewrites = []
    original = curves_module.write_curve_file

    def counting(path, namespace, layers, metrics, history, **kwargs):
        rewrites.append(len(history))
        original(path, namespace, layers, metrics, history, **kwargs)

    monkeypatch.setattr(curves_module, "write_curve_file", counting)
    curves, trainer = LayerCurves("rank", x_axis="step", wandb_charts=False), _trainer(tmp_path)
    path = tmp_path / FIGURE_DIR / "rank_curves.json"
    for count in range(1, 41):
        _record_steps(curves, trainer, range(50 * count, 50 * count + 1))
        content = read_curve_file(path)
        assert content["history"] == _expected(range(50, 50 * count + 1, 50)), count
        assert content["layers"] == ["block.0", "block.1"] and content["metrics"] == ["m"]
        assert content["facts"] == {"x_axis": "step"}
    # Rewritten whole once as many points were appended as it held: 5 times in 40 records, not 40.
    assert rewrites == [1, 3, 7, 15, 31]


def test_a_run_killed_while_appending_a_point_leaves_a_readable_curve_file(tmp_path):
    curves, trainer = LayerCurves("rank", x_axis="step", wandb_charts=False), _trainer(tmp_path)
    _record_steps(curves, trainer, range(10, 90, 10))
    path = tmp_path / FIGURE_DIR / "rank_curves.json"
    (appended,) = (tmp_path / FIGURE_DIR).glob(".rank_curves.json.*.jsonl")
    assert json.loads(path.read_text())["appended"] == appended.name
    with appended.open("ab") as file:  # the run killed in the middle of a line
        file.write(b'\n{"point": 90, "values": {"block.0": {"m": 9')
    assert read_curve_file(path)["history"] == _expected(range(10, 90, 10))
    # A line appended after the cut one (the same history, resumed) is read: each line starts after a newline.
    _record_steps(curves, trainer, range(90, 100, 10))
    assert read_curve_file(path)["history"] == _expected(range(10, 100, 10))


def test_drawing_the_figures_leaves_one_json_curve_file_with_every_point(tmp_path, monkeypatch):
    monkeypatch.setattr(curves_module, "draw_figures", lambda jobs, **kwargs: [job.path for job in jobs])
    curves, trainer = LayerCurves("rank", x_axis="step", wandb_charts=False), _trainer(tmp_path)
    _record_steps(curves, trainer, range(1, 7))
    curves.finish(trainer)
    content = json.loads((tmp_path / FIGURE_DIR / "rank_curves.json").read_text())
    assert "appended" not in content
    assert {int(step) for step in content["history"]} == set(range(1, 7))
    assert [p.name for p in (tmp_path / FIGURE_DIR).iterdir()] == ["rank_curves.json"]


def test_a_resumed_fit_supersedes_the_appended_points_of_the_killed_run(tmp_path):
    trainer = _trainer(tmp_path)
    first = LayerCurves("rank", x_axis="step", wandb_charts=False)
    _record_steps(first, trainer, range(50, 250, 50))
    saved = first.state_dict()  # a checkpoint at step 200; the run goes on, then is killed
    _record_steps(first, trainer, range(250, 550, 50))

    resumed = LayerCurves("rank", x_axis="step", wandb_charts=False)
    resumed.load_state_dict(saved)
    trainer.global_step = 200
    with pytest.warns(UserWarning, match="steps 250, 300, 350, 400, 450, 500 are trained again"):
        resumed.settle_resume(trainer)
    _record_steps(resumed, trainer, range(250, 350, 50))
    content = read_curve_file(tmp_path / FIGURE_DIR / "rank_curves.json")
    assert content["history"] == _expected(range(50, 350, 50))
    assert content["superseded"] == [{"resumed_at": 201, "history": _expected(range(250, 550, 50))}]
    assert len(list((tmp_path / FIGURE_DIR).glob(".rank_curves.json.*.jsonl"))) == 1  # the killed run's is gone


def test_wandb_charts_are_sent_each_time_the_history_doubles(tmp_path):
    class WandbLogger:
        def __init__(self) -> None:
            self.log_dir = str(tmp_path)
            self.sent: list[int] = []

        def log_metrics(self, metrics: dict, step: int) -> None:
            if "rank_curves/m_vs_step" in metrics:
                self.sent.append(step)

        def save(self) -> None:
            pass

    logger = WandbLogger()
    curves = LayerCurves("rank", x_axis="step", wandb_charts_every_n_epochs=2)
    _record_steps(curves, _trainer(tmp_path, [logger]), range(1, 41))
    # Each chart carries the whole history: after the 1st, 2nd, 4th, 8th, 16th and 32nd points, not every 2nd.
    assert logger.sent == [1, 2, 4, 8, 16, 32]


def test_a_checkpoint_saves_each_layer_and_metric_name_once_not_once_per_point(tmp_path):
    curves = LayerCurves("rank", x_axis="step")
    for step in range(1, 201):  # the monitors build the names anew at every measurement
        curves.record(step, {"".join(["block.", "0"]): {"".join(["numerical_", "rank"]): float(step)}})
    saved = pickle.dumps(curves.state_dict())
    assert (saved.count(b"numerical_rank"), saved.count(b"block.0")) == (1, 1)
    torch.save(curves.state_dict(), tmp_path / "state.pt")
    restored = LayerCurves("rank", x_axis="step")
    restored.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    assert restored.history == {step: {"block.0": {"numerical_rank": float(step)}} for step in range(1, 201)}


def test_a_point_that_could_not_be_appended_is_in_the_curve_file_after_the_figures(tmp_path, monkeypatch):
    monkeypatch.setattr(curves_module, "draw_figures", lambda jobs, **kwargs: [job.path for job in jobs])
    curves, trainer = LayerCurves("rank", x_axis="step", wandb_charts=False), _trainer(tmp_path)
    _record_steps(curves, trainer, range(1, 4))  # rewritten whole at the 3rd
    with monkeypatch.context() as full_disk:
        full_disk.setattr(curves_module, "append_curve_point", _no_space)
        with pytest.warns(RuntimeWarning, match="No space left on device"):
            _record_steps(curves, trainer, range(4, 5))
    path = tmp_path / FIGURE_DIR / "rank_curves.json"
    assert read_curve_file(path)["history"] == _expected(range(1, 4))
    curves.finish(trainer)  # the last point measured, written with the figures
    assert read_curve_file(path)["history"] == _expected(range(1, 5))
    assert [p.name for p in path.parent.iterdir()] == ["rank_curves.json"]
