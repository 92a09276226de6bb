"""Step cadence: activation windows over training batches and weight spectra after every N-th optimizer step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import EarlyStopping, ModelCheckpoint
from torch import nn

from rank_lightning.callbacks import ActivationRankMonitor, WeightRankMonitor
from rank_lightning.callbacks.curves import read_curve_file
from rank_lightning.functional import effective_rank, numerical_rank, participation_ratio, total_cluster_variation
from tests.callbacks.recording_logger import RecordingLogger
from tests.callbacks.trainer_helpers import SmallClassifier, TrainBatches, quiet_trainer, small_loader

NUM_CLASSES = 4


def _model() -> SmallClassifier:
    return SmallClassifier((6, 12, NUM_CLASSES), lr=0.2, activation=nn.Tanh, seed=0)


def _loader(n: int = 64, batch_size: int = 8, seed: int = 0) -> torch.utils.data.DataLoader:
    generator = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, 6, generator=generator), torch.randint(0, NUM_CLASSES, (n,), generator=generator)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch_size)


def _fit(tmp_path: Path, callbacks: list, epochs: int = 2, **kwargs: Any) -> pl.Trainer:
    trainer = quiet_trainer(callbacks, max_epochs=epochs, default_root_dir=tmp_path, **kwargs)
    trainer.fit(_model(), train_dataloaders=_loader())
    return trainer


def _expected(rows: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    return {
        "numerical_rank": float(numerical_rank(rows)),
        "participation_ratio": float(participation_ratio(rows)),
        "effective_rank": float(effective_rank(rows)),
        "tcv": float(total_cluster_variation(rows, labels)),
    }


def _window(capture: TrainBatches, batch_numbers: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    chosen = [capture.batches[i] for i in batch_numbers]
    return torch.cat([b["output"] for b in chosen]), torch.cat([b["labels"] for b in chosen])


def test_windows_stream_the_training_batches_before_every_nth_step(tmp_path: Path) -> None:
    monitor = ActivationRankMonitor(
        layers=["net.0"], every_n_train_steps=3, window_batches=2, log_at_init=False, verbose=False
    )
    capture, logger = TrainBatches(), RecordingLogger()
    _fit(tmp_path, [capture, monitor], logger=logger)

    # 8 batches per epoch, 2 epochs: 16 optimizer steps, measured at steps 3, 6, 9, 12 and 15.
    assert monitor.curves.epochs == [3, 6, 9, 12, 15]
    assert monitor.curves.x_axis == "step"
    for step in monitor.curves.epochs:
        # The two batches taken while global_step was step - 2 and step - 1: batch numbers step - 2 and step - 1.
        rows, labels = _window(capture, [step - 2, step - 1])
        logged = monitor.curves.history[step]["net.0"]
        for metric, value in _expected(rows, labels).items():
            assert logged[metric] == pytest.approx(value, rel=1e-9, abs=1e-9), (step, metric)
    # Loggers receive each window at its step, as the curve file and figures show it, with no Lightning log call per
    # key.
    steps = [step for step, metrics in logger.calls if "rank_train/net.0/numerical_rank" in metrics]
    assert steps == [3, 6, 9, 12, 15]


def test_gradient_accumulation_counts_optimizer_steps(tmp_path: Path) -> None:
    monitor = ActivationRankMonitor(
        layers=["net.0"], every_n_train_steps=2, window_batches=3, log_at_init=False, verbose=False
    )
    capture = TrainBatches()
    _fit(tmp_path, [capture, monitor], epochs=1, accumulate_grad_batches=2)

    # 8 micro-batches, 2 per optimizer step: steps 1-4; measured at steps 2 and 4 over the 3 micro-batches before.
    assert monitor.curves.epochs == [2, 4]
    for step, last in ((2, 3), (4, 7)):
        rows, labels = _window(capture, [last - 2, last - 1, last])
        logged = monitor.curves.history[step]["net.0"]
        assert logged["participation_ratio"] == pytest.approx(float(participation_ratio(rows)), rel=1e-10)
        assert logged["tcv"] == pytest.approx(float(total_cluster_variation(rows, labels)), rel=1e-10)
    assert monitor.curves.facts["samples"] == 24


def test_initial_point_is_step_zero_and_the_curve_file_names_the_axis(tmp_path: Path) -> None:
    monitor = ActivationRankMonitor(layers=["net.0"], every_n_train_steps=4, window_batches=2, verbose=False)
    capture = TrainBatches()
    trainer = _fit(tmp_path, [capture, monitor], epochs=1)

    assert monitor.curves.epochs == [0, 4, 8]
    saved = read_curve_file(Path(trainer.default_root_dir) / "rank_curves" / "rank_train_curves.json")
    assert saved["facts"]["x_axis"] == "step"
    assert sorted(int(step) for step in saved["history"]) == [0, 4, 8]
    assert (Path(trainer.default_root_dir) / "rank_curves" / "rank_train_numerical_rank.png").is_file()


def test_weight_monitor_measures_right_after_every_nth_optimizer_step(tmp_path: Path) -> None:
    seen: dict[int, torch.Tensor] = {}

    class _Weights(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, i: int) -> None:
            seen[trainer.global_step] = pl_module.net[0].weight.detach().double().clone()

    monitor = WeightRankMonitor(layers=["net.0"], every_n_train_steps=3, log_at_init=True, verbose=False)
    _fit(tmp_path, [_Weights(), monitor], epochs=1, accumulate_grad_batches=2)

    # 8 micro-batches, 4 optimizer steps: measured at the untrained step 0 and after step 3 only.
    assert monitor.curves.epochs == [0, 3]
    expected = torch.linalg.matrix_norm(seen[3], ord=2)
    assert monitor.curves.history[3]["net.0"]["spectral_norm"] == pytest.approx(float(expected), rel=1e-10)


def test_checkpoint_and_early_stopping_read_step_metrics(tmp_path: Path) -> None:
    key = "rank_train/net.0/effective_rank"
    monitor = ActivationRankMonitor(layers=["net.0"], every_n_train_steps=2, log_at_init=False, verbose=False)
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor=key, mode="max", every_n_train_steps=2)
    stopping = EarlyStopping(monitor=key, mode="max", patience=100, check_on_train_epoch_end=True, strict=True)
    trainer = _fit(tmp_path, [monitor, checkpoint, stopping], epochs=2, enable_checkpointing=True)

    assert trainer.callback_metrics[key].dtype == torch.float64
    assert float(trainer.callback_metrics[key]) == monitor.curves.history[16]["net.0"]["effective_rank"]
    assert checkpoint.best_model_path and float(checkpoint.best_model_score) == max(
        values["net.0"]["effective_rank"] for values in monitor.curves.history.values()
    )


def test_every_step_gives_the_initial_point_and_each_window_a_step_of_their_own(tmp_path: Path) -> None:
    # The window of step 1 was logged at Lightning's logging step 0, where the initial point is.
    key = "rank_train/net.0/effective_rank"
    monitor = ActivationRankMonitor(layers=["net.0"], every_n_train_steps=1, verbose=False)
    logger = RecordingLogger()
    _fit(tmp_path, [monitor], epochs=1, logger=logger)

    logged = {step: metrics[key] for step, metrics in logger.calls if key in metrics}
    assert sorted(logged) == monitor.curves.epochs == list(range(9))
    for step, value in logged.items():
        assert value == monitor.curves.history[step]["net.0"]["effective_rank"]


def test_a_step_measurement_is_read_at_its_step_only(tmp_path: Path) -> None:
    # A checkpoint saved at every step named the previous window's value at the steps between two windows.
    keys = ("rank_train/net.0/effective_rank", "weight/net.0/spectral_norm")
    seen: dict[int, list[float | None]] = {}

    class _Read(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, i: int) -> None:
            values = [trainer.callback_metrics.get(key) for key in keys]
            seen[trainer.global_step] = [None if value is None else float(value) for value in values]

    monitor = ActivationRankMonitor(layers=["net.0"], every_n_train_steps=3, log_at_init=False, verbose=False)
    weights = WeightRankMonitor(layers=["net.0"], every_n_train_steps=3, log_at_init=False, verbose=False)
    _fit(tmp_path, [monitor, weights, _Read()], epochs=1)

    assert monitor.curves.epochs == weights.curves.epochs == [3, 6]
    for step in range(1, 9):
        expected = [None, None]
        if step in (3, 6):
            expected = [
                monitor.curves.history[step]["net.0"]["effective_rank"],
                weights.curves.history[step]["net.0"]["spectral_norm"],
            ]
        assert seen[step] == expected, step


def test_early_stopping_with_validation_after_the_measured_steps_sees_each_measurement_once(tmp_path: Path) -> None:
    key = "rank_train/net.0/effective_rank"
    checked: list[float | None] = []

    class _Stopping(EarlyStopping):
        def _run_early_stopping_check(self, trainer: pl.Trainer) -> None:
            value = trainer.callback_metrics.get(key)
            checked.append(None if value is None else float(value))
            super()._run_early_stopping_check(trainer)

    monitor = ActivationRankMonitor(
        layers=["net.0"], every_n_train_steps=4, window_batches=2, log_at_init=False, verbose=False
    )
    stopping = _Stopping(monitor=key, mode="max", patience=100, strict=False)
    trainer = quiet_trainer([monitor, stopping], max_epochs=2, default_root_dir=tmp_path, val_check_interval=4)
    trainer.fit(_model(), train_dataloaders=_loader(), val_dataloaders=_loader(16, seed=1))

    assert monitor.curves.epochs == [4, 8, 12, 16]
    assert checked == [monitor.curves.history[step]["net.0"]["effective_rank"] for step in (4, 8, 12, 16)]


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"every_n_epochs": 1, "every_n_train_steps": 5}, "choose one cadence"),
        ({"every_n_train_steps": 5, "stage": "val"}, "step windows stream training batches"),
        ({"every_n_train_steps": 0}, "every_n_train_steps"),
        ({"every_n_train_steps": 2, "window_batches": 0}, "window_batches"),
    ],
)
def test_bad_cadence_settings_are_named(options: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ActivationRankMonitor(**options)


def test_a_window_longer_than_the_period_is_refused_at_setup(tmp_path: Path) -> None:
    monitor = ActivationRankMonitor(layers=["net.0"], every_n_train_steps=2, window_batches=5, verbose=False)
    with pytest.raises(ValueError, match=r"window_batches=5 exceeds the 4 training batches"):
        _fit(tmp_path, [monitor], epochs=1, accumulate_grad_batches=2)


def test_a_fit_that_ends_before_the_first_measured_step_says_so(tmp_path):
    monitors = [
        ActivationRankMonitor(stage="train", every_n_train_steps=50, window_batches=2, verbose=False),
        WeightRankMonitor(every_n_train_steps=50, verbose=False),
    ]
    with pytest.warns(UserWarning) as caught:
        quiet_trainer(monitors, max_steps=10, default_root_dir=tmp_path).fit(SmallClassifier(), small_loader(96))
    messages = [str(w.message) for w in caught if "no step of this fit" in str(w.message)]
    expected = (
        "the fit ended at optimizer step 10, before step 50, the first it measures at (every_n_train_steps=50): no "
        "step of this fit was measured. Lower every_n_train_steps, or train for more steps."
    )
    assert messages == [f"ActivationRankMonitor: {expected}", f"WeightRankMonitor: {expected}"]
    assert [point for point in monitors[1].curves.epochs if point > 0] == []
