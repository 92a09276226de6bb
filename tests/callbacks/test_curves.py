import csv
import json
import math
import subprocess
import sys
import threading
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import EarlyStopping, ModelCheckpoint
from pytorch_lightning.loggers import CSVLogger, TensorBoardLogger, WandbLogger
from torch import nn

from rank_lightning.callbacks import ActivationRankMonitor, WeightRankMonitor
from rank_lightning.callbacks import curves as curves_module
from rank_lightning.callbacks.curves import (
    FIGURE_DIR,
    INITIAL_EPOCH,
    LayerCurves,
    log_rank_equal,
    read_curve_file,
    run_directory,
    wandb_loggers,
    write_curve_file,
)
from tests.callbacks.wandb_helpers import offline_run_history


class _Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def training_step(self, batch, batch_idx):
        return nn.functional.cross_entropy(self.fc(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", nn.functional.cross_entropy(self.fc(batch[0]), batch[1]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _CheckpointedCurves(pl.Callback):
    """A callback whose ``curves`` are saved in checkpoints, as the package's monitors save theirs."""

    curves: LayerCurves

    def state_dict(self):
        return {"curves": self.curves.state_dict()}

    def load_state_dict(self, state_dict):
        self.curves.load_state_dict(state_dict["curves"])


class _EpochCurves(_CheckpointedCurves):
    """Logs known per-layer values (a function of the epoch) through LayerCurves, as a rank callback would."""

    def __init__(self) -> None:
        self.curves = LayerCurves("test")
        self.calls = 0

    def on_validation_epoch_end(self, trainer, pl_module):
        self.calls += 1
        epoch = trainer.current_epoch
        values = {"z_first": {"m": 10.0 + epoch, "odd/name": math.nan}, "a_second": {"m": torch.tensor(20 + epoch)}}
        self.curves.record_and_log(trainer, pl_module, values)

    def on_fit_end(self, trainer, pl_module):
        self.curves.write_figures(trainer)


def _loader() -> torch.utils.data.DataLoader:
    data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,)))
    return torch.utils.data.DataLoader(data, batch_size=8)


def _trainer(tmp_path: Path, *callbacks: pl.Callback, **kwargs) -> pl.Trainer:
    options = dict(
        max_epochs=2,
        default_root_dir=tmp_path,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=1,
        enable_checkpointing=False,
        callbacks=list(callbacks),
    )
    options.update(kwargs)
    return pl.Trainer(**options)


def _read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as file:
        return list(csv.DictReader(file))


def test_record_keeps_depth_order_and_state_dict_round_trips(tmp_path):
    curves = LayerCurves("rank")
    curves.record(0, {"layer2": {"a": 1.0}, "layer10": {"a": 2.0, "b": torch.tensor(3)}})
    curves.record(1, {"layer2": {"a": math.nan}, "layer10": {"a": 4.0, "b": 5.0}})
    assert curves.layers == ["layer2", "layer10"]
    assert curves.metrics == ["a", "b"]
    assert curves.key("layer10", "b") == "rank/layer10/b"
    assert curves.curve("layer10", "a") == ([0, 1], [2.0, 4.0])

    torch.save(curves.state_dict(), tmp_path / "state.pt")
    restored = LayerCurves("rank")
    restored.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    assert restored.layers == curves.layers
    assert restored.metrics == curves.metrics
    assert restored.epochs == [0, 1]
    assert restored.history[1]["layer10"] == {"a": 4.0, "b": 5.0}
    assert math.isnan(restored.history[1]["layer2"]["a"])


def test_load_state_dict_rejects_another_namespace():
    weight = LayerCurves("weight")
    weight.record(0, {"fc": {"a": 1.0}})
    with pytest.raises(ValueError, match=r"'weight'.*'rank'"):
        LayerCurves("rank").load_state_dict(weight.state_dict())


@pytest.mark.parametrize("bad", ["", "a/b"])
def test_bad_namespaces_are_rejected(bad):
    with pytest.raises(ValueError, match="without '/'"):
        LayerCurves(bad)


def test_layer_names_with_slashes_are_rejected():
    with pytest.raises(ValueError, match="without '/'"):
        LayerCurves("rank").record(0, {"x/y": {"a": 1.0}})


def test_logs_records_and_draws_during_fit_with_csv_logger(tmp_path):
    callback = _EpochCurves()
    logger = CSVLogger(tmp_path)
    _trainer(tmp_path, callback, logger=logger).fit(_Net(), _loader(), _loader())

    # The sanity check called the hook but left nothing behind.
    assert callback.calls == 3
    assert callback.curves.epochs == [0, 1]
    rows = [row for row in _read_csv(Path(logger.log_dir) / "metrics.csv") if row["test/z_first/m"]]
    assert [(int(r["epoch"]), float(r["test/z_first/m"]), float(r["test/a_second/m"])) for r in rows] == [
        (0, 10.0, 20.0),
        (1, 11.0, 21.0),
    ]
    assert all(math.isnan(float(r["test/z_first/odd/name"])) for r in rows)

    directory = Path(logger.log_dir) / FIGURE_DIR
    content = json.loads((directory / "test_curves.json").read_text())
    assert content["layers"] == ["z_first", "a_second"]
    assert content["history"]["1"]["a_second"]["m"] == 21.0
    assert {p.name for p in directory.glob("*.png")} == {"test_m.png", "test_odd_name.png"}
    assert all(p.stat().st_size > 1000 for p in directory.glob("*.png"))


class _TrainEpochEndCurves(pl.Callback):
    """Records through LayerCurves at the end of every training epoch, as a monitor of unvalidated epochs does."""

    def __init__(self) -> None:
        self.curves = LayerCurves("test", wandb_charts=False)

    def on_train_epoch_end(self, trainer, pl_module):
        self.curves.record_and_log(trainer, pl_module, {"layer": {"m": float(trainer.current_epoch)}})


class _NetLoggingEpochLoss(_Net):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train/loss", loss, on_step=False, on_epoch=True)
        return loss


def test_values_recorded_at_the_end_of_a_training_epoch_reach_the_loggers_at_that_epochs_step(tmp_path):
    # Lightning logs a training epoch's metrics at the step of its last batch, one below the optimizer steps taken by
    # then; a measurement of the same epoch must land beside them, not on the first step of the next epoch.
    callback = _TrainEpochEndCurves()
    logger = CSVLogger(tmp_path)
    trainer = _trainer(tmp_path, callback, logger=logger, max_epochs=3, limit_val_batches=0)
    trainer.fit(_NetLoggingEpochLoss(), _loader())

    rows = _read_csv(Path(logger.log_dir) / "metrics.csv")
    loss_steps = [(int(r["epoch"]), int(r["step"])) for r in rows if r["train/loss"]]
    rank_steps = [(int(r["epoch"]), int(r["step"])) for r in rows if r["test/layer/m"]]
    assert loss_steps == [(0, 1), (1, 3), (2, 5)]
    assert rank_steps == loss_steps


def test_resumed_run_continues_its_curves(tmp_path):
    first = _EpochCurves()
    trainer = _trainer(tmp_path, first, logger=False, max_epochs=1)
    trainer.fit(_Net(), _loader(), _loader())
    checkpoint = tmp_path / "after_epoch_0.ckpt"
    trainer.save_checkpoint(checkpoint)

    resumed = _EpochCurves()
    _trainer(tmp_path, resumed, logger=False, max_epochs=3).fit(_Net(), _loader(), _loader(), ckpt_path=checkpoint)
    assert resumed.curves.epochs == [0, 1, 2]
    assert [resumed.curves.history[e]["z_first"]["m"] for e in (0, 1, 2)] == [10.0, 11.0, 12.0]


@pytest.mark.parametrize("with_tensorboard", [False, True], ids=["no_logger", "tensorboard"])
def test_figures_go_to_the_run_directory(tmp_path, with_tensorboard):
    callback = _EpochCurves()
    callback.curves.figures_every_n_epochs = 1
    logger = TensorBoardLogger(tmp_path, name="tb") if with_tensorboard else False
    _trainer(tmp_path, callback, logger=logger, max_epochs=1).fit(_Net(), _loader(), _loader())
    directory = (tmp_path / "tb" / "version_0" if with_tensorboard else tmp_path) / FIGURE_DIR
    assert (directory / "test_m.png").is_file()
    assert json.loads((directory / "test_curves.json").read_text())["history"]["0"]["z_first"]["m"] == 10.0


def _recorded_curves(**options) -> LayerCurves:
    curves = LayerCurves("test", **options)
    for epoch in range(3):
        curves.record(epoch, {"first": {"m": float(epoch)}, "second": {"m": 2.0 * epoch}})
    return curves


def _rank_zero(tmp_path: Path) -> SimpleNamespace:
    return SimpleNamespace(is_global_zero=True, loggers=[], default_root_dir=str(tmp_path))


def test_figures_are_written_before_write_figures_returns_and_nothing_is_left_running(tmp_path):
    threads = threading.active_count()
    [path] = _recorded_curves().write_figures(_rank_zero(tmp_path))
    assert path == tmp_path / FIGURE_DIR / "test_m.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert threading.active_count() == threads


def test_figures_follow_their_cadence(tmp_path, monkeypatch):
    drawn: list[list[int]] = []
    original = curves_module.layer_curves_figure

    def counting(namespace, metric, layers, history, **kwargs):
        drawn.append(sorted(history))
        return original(namespace, metric, layers, history, **kwargs)

    monkeypatch.setattr(curves_module, "layer_curves_figure", counting)
    curves = LayerCurves("test", figures_every_n_epochs=2, wandb_charts=False)
    trainer = SimpleNamespace(
        is_global_zero=True, loggers=[], default_root_dir=str(tmp_path), sanity_checking=False, current_epoch=0
    )
    module = SimpleNamespace(log_dict=lambda *args, **kwargs: None)
    for epoch in range(5):
        trainer.current_epoch = epoch
        curves.record_and_log(trainer, module, {"first": {"m": float(epoch)}})
    assert drawn == [[0, 1], [0, 1, 2, 3]]
    curves.finish(trainer)
    assert drawn[-1] == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="figures_every_n_epochs must be a positive integer or None, got 0"):
        LayerCurves("test", figures_every_n_epochs=0)


def test_a_failing_figure_warns_and_never_raises(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no fonts")

    monkeypatch.setattr(curves_module, "layer_curves_figure", broken)
    with pytest.warns(RuntimeWarning, match=r"drawing 'test' 'm' failed.*no fonts.*test_curves.json"):
        assert _recorded_curves().write_figures(_rank_zero(tmp_path)) == []


def test_the_curve_file_reader_returns_what_the_writer_wrote(tmp_path):
    history = {0: {"a": {"m": 1.5, "n": math.nan}}, 10: {"a": {"m": math.inf}, "b": {"m": -2.0}}}
    path = tmp_path / "deeper" / "x_curves.json"
    write_curve_file(path, "x", ["a", "b"], ["m", "n"], history)
    content = read_curve_file(path)
    assert (content["namespace"], content["layers"], content["metrics"]) == ("x", ["a", "b"], ["m", "n"])
    assert list(content["history"]) == [0, 10]
    assert content["history"][10] == {"a": {"m": math.inf}, "b": {"m": -2.0}}
    assert content["history"][0]["a"]["m"] == 1.5 and math.isnan(content["history"][0]["a"]["n"])


def test_wandb_charts_are_sent_every_n_epochs_and_once_more_at_the_end(tmp_path):
    class WandbLogger:
        """Records when charts are sent; wandb_loggers() recognises loggers by this class name."""

        def __init__(self, log_dir: Path) -> None:
            self.log_dir = str(log_dir)
            self.steps: list[int] = []

        def log_metrics(self, metrics: dict, step: int) -> None:
            assert "test_curves/m_vs_epoch" in metrics and "test_curves/m_vs_depth" in metrics
            self.steps.append(step)

    curves = LayerCurves("test", wandb_charts_every_n_epochs=3)
    logger = WandbLogger(tmp_path)
    trainer = SimpleNamespace(is_global_zero=True, loggers=[logger], sanity_checking=False, current_epoch=0)
    module = SimpleNamespace(log_dict=lambda *args, **kwargs: None)
    for epoch in range(7):
        trainer.current_epoch = trainer.global_step = epoch
        curves.record_and_log(trainer, module, {"first": {"m": float(epoch)}})
    # After the 1st, 3rd and 6th recorded epochs: each chart holds the whole history, so not after every epoch.
    assert logger.steps == [0, 2, 5]
    curves.finish(trainer)
    assert logger.steps == [0, 2, 5, 6]
    curves.finish(trainer)  # nothing new to send
    assert logger.steps == [0, 2, 5, 6]
    assert (tmp_path / FIGURE_DIR / "test_m.png").is_file()
    with pytest.raises(ValueError, match="wandb_charts_every_n_epochs must be a positive integer, got 0"):
        LayerCurves("test", wandb_charts_every_n_epochs=0)


def test_run_directory_follows_the_first_logger(tmp_path):
    csv_logger = CSVLogger(tmp_path, name="csv", version=3)
    tensorboard = TensorBoardLogger(tmp_path, name="tb", version="v")
    no_save_dir = SimpleNamespace(log_dir=None, save_dir=None, name="proj", version="abc")
    trainer = SimpleNamespace(loggers=[csv_logger, tensorboard], default_root_dir=str(tmp_path / "root"))
    assert run_directory(trainer) == tmp_path / "csv" / "version_3"
    trainer.loggers = [tensorboard]
    assert run_directory(trainer) == tmp_path / "tb" / "v"
    trainer.loggers = [no_save_dir]
    assert run_directory(trainer) == tmp_path / "root" / "proj" / "abc"
    trainer.loggers = []
    assert run_directory(trainer) == tmp_path / "root"


def test_wandb_loggers_of_both_lightning_packages_are_found(tmp_path):
    found = [WandbLogger(mode="disabled", save_dir=tmp_path)]
    lightning_loggers = pytest.importorskip("lightning.pytorch.loggers")
    found.append(lightning_loggers.WandbLogger(mode="disabled", save_dir=tmp_path))
    trainer = SimpleNamespace(loggers=[CSVLogger(tmp_path), *found])
    assert wandb_loggers(trainer) == found


@pytest.mark.parametrize("bad", [1, 0, True, 2.5])
def test_max_depth_curves_is_validated(bad):
    with pytest.raises(ValueError, match="max_depth_curves"):
        LayerCurves("rank", max_depth_curves=bad)


@pytest.mark.slow
def test_two_process_ddp_gives_no_sync_dist_advice_for_values_equal_on_every_rank(tmp_path):
    from tests.callbacks.curves_ddp_helpers import ADVICE, warnings_of

    command = [sys.executable, "-m", "tests.callbacks.curves_ddp_helpers", str(tmp_path)]
    run = subprocess.run(command, cwd=Path(__file__).resolve().parents[2], timeout=600, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-4000:]
    caught = warnings_of(tmp_path)
    assert set(caught) == {f"{stage}_rank{rank}" for stage in ("fit", "validate") for rank in (0, 1)}
    advice = [text for texts in caught.values() for text in texts if text.startswith(ADVICE)]
    # The model's own unreduced key is still advised about (so the warnings were recorded); none of the callbacks'.
    assert any("'val/probe'" in text for text in advice)
    assert [text for text in advice if "'val/probe'" not in text] == []


def test_log_rank_equal_logs_every_value_synchronised_by_the_exact_maximum():
    calls = []
    module = SimpleNamespace(log_dict=lambda scalars, **options: calls.append((scalars, options)))
    log_rank_equal(module, {"rank/a/m": 1.0 + 2**-40, "rank/b/m": torch.tensor(2.0)})
    log_rank_equal(module, {})
    options = dict(on_step=False, on_epoch=True, sync_dist=True, reduce_fx="max")
    [(scalars, given)] = calls
    assert given == options
    # float64 tensors: LightningModule.log would make a Python float a float32 tensor (1 + 2^-40 -> 1).
    assert {key: (value.dtype, value.item()) for key, value in scalars.items()} == {
        "rank/a/m": (torch.float64, 1.0 + 2**-40),
        "rank/b/m": (torch.float64, 2.0),
    }


def test_values_returned_by_validate_keep_the_float64_digits_of_the_curve_file(tmp_path):
    from rank_lightning.callbacks import ActivationRankMonitor
    from tests.callbacks.trainer_helpers import SmallClassifier, quiet_trainer, small_loader

    monitor = ActivationRankMonitor(layers=["net.0"], verbose=False)
    trainer = quiet_trainer([monitor], default_root_dir=tmp_path)
    (results,) = trainer.validate(SmallClassifier(seed=0), small_loader(), verbose=False)
    recorded = monitor.curves.history[INITIAL_EPOCH]["net.0"]
    assert recorded
    for metric, value in recorded.items():
        assert results[f"rank/net.0/{metric}"] == value, metric  # equal, not to float32's 6e-8


class _EveryOtherEpoch(pl.Callback):
    """Logs ``test/first/m`` in every second epoch (1, 3, 5, ...), as a monitor with ``every_n_epochs=2`` would."""

    def __init__(self, values: dict[int, float]) -> None:
        self.curves = LayerCurves("test", wandb_charts=False)
        self.values = values

    def on_train_epoch_start(self, trainer, pl_module):
        self.curves.clear_stale_metrics(trainer)

    def on_validation_epoch_end(self, trainer, pl_module):
        if not trainer.sanity_checking and (trainer.current_epoch + 1) % 2 == 0:
            self.curves.record_and_log(trainer, pl_module, {"first": {"m": self.values[trainer.current_epoch]}})


def _rank_keyed_tools(tmp_path: Path, key: str) -> tuple[EarlyStopping, ModelCheckpoint]:
    """EarlyStopping and ModelCheckpoint on a rank key, configured as the README says."""
    stopping = EarlyStopping(monitor=key, mode="max", patience=2, strict=False)
    checkpoints = ModelCheckpoint(
        dirpath=tmp_path / "checkpoints",
        monitor=key,
        mode="max",
        every_n_epochs=2,
        save_top_k=-1,
        filename=f"epoch={{epoch}}-rank={{{key}:.1f}}",
        auto_insert_metric_name=False,
    )
    return stopping, checkpoints


def test_early_stopping_on_a_key_logged_every_other_epoch_counts_measured_epochs_only(tmp_path):
    # Best at epoch 3, no improvement at 5 and 7: patience 2 runs out at epoch 7. A stale value repeated in the epochs
    # between would count as no improvement at epoch 4 and stop the fit at epoch 5.
    callback = _EveryOtherEpoch({1: 1.0, 3: 2.0, 5: 2.0, 7: 2.0, 9: 3.0, 11: 3.0})
    stopping, checkpoints = _rank_keyed_tools(tmp_path, "test/first/m")
    logger = CSVLogger(tmp_path)
    trainer = _trainer(
        tmp_path, callback, stopping, checkpoints, max_epochs=12, logger=logger, enable_checkpointing=True
    )
    trainer.fit(_Net(), _loader(), _loader())

    assert stopping.stopped_epoch == 7
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "epoch=1-rank=1.0.ckpt",
        "epoch=3-rank=2.0.ckpt",
        "epoch=5-rank=2.0.ckpt",
        "epoch=7-rank=2.0.ckpt",
    ]
    # metrics.csv holds the measurements, not repeated copies of them.
    rows = _read_csv(Path(logger.log_dir) / "metrics.csv")
    assert [(int(r["epoch"]), float(r["test/first/m"])) for r in rows if r["test/first/m"]] == [
        (1, 1.0),
        (3, 2.0),
        (5, 2.0),
        (7, 2.0),
    ]


class _FrozenMLP(pl.LightningModule):
    """An MLP that never changes (learning rate 0): its ranks are the same in every epoch."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 8)
        self.act = nn.ReLU()
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.act(self.fc(x)))

    def training_step(self, batch, batch_idx):
        return nn.functional.cross_entropy(self(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", nn.functional.cross_entropy(self(batch[0]), batch[1]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


@pytest.mark.parametrize(
    ("monitor", "key"),
    [
        (lambda: ActivationRankMonitor(layers=["act"], every_n_epochs=2, verbose=False), "rank/act/numerical_rank"),
        (lambda: WeightRankMonitor(layers=["fc"], every_n_epochs=2, verbose=False), "weight/fc/numerical_rank"),
    ],
    ids=["activations", "weights"],
)
def test_rank_monitors_drive_early_stopping_and_checkpoint_names_every_other_epoch(tmp_path, monitor, key):
    # The rank never changes: measured in epochs 1, 3, 5, it improves once (epoch 1), then patience 2 runs out at
    # epoch 5. Without a value, epochs 0, 2 and 4 are skipped (strict=False) rather than raising or counting.
    stopping, checkpoints = _rank_keyed_tools(tmp_path, key)
    logger = CSVLogger(tmp_path)
    trainer = _trainer(
        tmp_path, monitor(), stopping, checkpoints, max_epochs=10, logger=logger, enable_checkpointing=True
    )
    trainer.fit(_FrozenMLP(), _loader(), _loader())

    assert stopping.stopped_epoch == 5
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert [name.split("-rank=")[0] for name in names] == ["epoch=1", "epoch=3", "epoch=5"]
    assert all(p.is_file() for p in (tmp_path / "checkpoints").iterdir())  # no folders made of the key's "/"
    rows = _read_csv(Path(logger.log_dir) / "metrics.csv")
    assert sorted({int(r["epoch"]) for r in rows if r[key]} - {INITIAL_EPOCH}) == [1, 3, 5]


class _Offset(_EpochCurves):
    """``_EpochCurves`` with every value shifted by ``offset``, to tell two runs of the same epochs apart."""

    def __init__(self, offset: float) -> None:
        super().__init__()
        self.offset = offset

    def on_validation_epoch_end(self, trainer, pl_module):
        self.calls += 1
        epoch = trainer.current_epoch
        self.curves.record_and_log(trainer, pl_module, {"z_first": {"m": self.offset + epoch}})


@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")
def test_a_fit_resumed_from_an_older_checkpoint_reports_the_rewind_and_keeps_the_old_values(tmp_path):
    first = _Offset(100.0)
    saving = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1, filename="{epoch}")
    _trainer(tmp_path, first, saving, max_epochs=4, logger=False, enable_checkpointing=True).fit(
        _Net(), _loader(), _loader()
    )
    curve_file = tmp_path / FIGURE_DIR / "test_curves.json"
    assert sorted(read_curve_file(curve_file)["history"]) == [0, 1, 2, 3]

    # Resumed after epoch 1 into the same run directory: epochs 2 and 3 are trained again.
    resumed = _Offset(200.0)
    with pytest.warns(
        UserWarning, match=r"measures again from epoch 2 on; epochs 2-3 are trained again and their values are replaced"
    ) as caught:
        _trainer(tmp_path, resumed, max_epochs=4, logger=False).fit(
            _Net(), _loader(), _loader(), ckpt_path=tmp_path / "ckpt" / "epoch=1.ckpt"
        )
    [rewind] = [str(w.message) for w in caught if "LayerCurves" in str(w.message)]
    assert str(curve_file) in rewind
    content = read_curve_file(curve_file)
    assert {e: v["z_first"]["m"] for e, v in content["history"].items()} == {0: 100.0, 1: 101.0, 2: 202.0, 3: 203.0}
    [block] = content["superseded"]
    assert block["resumed_at"] == 2
    assert {e: v["z_first"]["m"] for e, v in block["history"].items()} == {2: 102.0, 3: 103.0}
    assert resumed.curves.superseded == content["superseded"]
    assert resumed.curves.state_dict()["superseded"] == content["superseded"]


class _ResumingOffset(_Offset):
    """``_Offset`` that settles a resume when training starts and calls ``start_epoch`` at every training epoch, as
    the package's monitors do."""

    def on_train_start(self, trainer, pl_module):
        self.curves.settle_resume(trainer)

    def on_train_epoch_start(self, trainer, pl_module):
        self.curves.start_epoch(trainer)


@pytest.mark.parametrize("first_epochs", [1, 2])
def test_a_measurement_made_after_its_checkpoint_was_saved_survives_the_resume(tmp_path, first_epochs):
    # Two batches per epoch: ModelCheckpoint(every_n_train_steps=2) saves at the end of every epoch's last batch, before
    # that epoch's validation measures the same weights. The resumed fit goes on with the next epoch and never measures
    # the checkpoint's epoch again: its value, in the curve file only, is neither trained again nor to be dropped.
    first = _ResumingOffset(100.0)
    saving = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_last=True, save_top_k=-1)
    _trainer(tmp_path, first, saving, max_epochs=first_epochs, logger=False, enable_checkpointing=True).fit(
        _Net(), _loader(), _loader()
    )
    curve_file = tmp_path / FIGURE_DIR / "test_curves.json"
    assert sorted(read_curve_file(curve_file)["history"]) == list(range(first_epochs))
    states = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)["callbacks"]
    saved = states["_ResumingOffset"]["curves"]["history"]
    assert sorted(saved) == list(range(first_epochs - 1))  # saved before the last epoch's measurement

    resumed = _ResumingOffset(200.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _trainer(tmp_path, resumed, max_epochs=first_epochs + 2, logger=False).fit(
            _Net(), _loader(), _loader(), ckpt_path=tmp_path / "ckpt" / "last.ckpt"
        )
    assert not [str(w.message) for w in caught if "LayerCurves" in str(w.message)]
    expected = {e: 100.0 + e for e in range(first_epochs)} | {e: 200.0 + e for e in (first_epochs, first_epochs + 1)}
    assert {e: v["z_first"]["m"] for e, v in resumed.curves.history.items()} == expected
    assert resumed.curves.layers == ["z_first"]
    assert resumed.curves.superseded == []
    content = read_curve_file(curve_file)
    assert {e: v["z_first"]["m"] for e, v in content["history"].items()} == expected
    assert content["superseded"] == []


@pytest.mark.parametrize("val_check_interval", [1.0, 0.5])
def test_monitors_resumed_from_a_checkpoint_saved_before_validating_keep_its_measurement(tmp_path, val_check_interval):
    from tests.callbacks.trainer_helpers import SmallClassifier, small_loader

    def fit(max_epochs, ckpt_path=None):
        monitors = [
            ActivationRankMonitor(layers=["net.0"], metrics=["stable_rank"], verbose=False),
            WeightRankMonitor(layers=["net.0"], metrics=["stable_rank"], verbose=False),
        ]
        # Six batches per epoch: a save at every validation's step, at the end of its batch, before it validates.
        saving = ModelCheckpoint(
            dirpath=tmp_path / "ckpt", every_n_train_steps=int(6 * val_check_interval), save_last=True, save_top_k=-1
        )
        trainer = _trainer(
            tmp_path,
            *monitors,
            saving,
            max_epochs=max_epochs,
            logger=False,
            enable_checkpointing=True,
            val_check_interval=val_check_interval,
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(SmallClassifier(seed=0), small_loader(48), small_loader(16), ckpt_path=ckpt_path)
        assert not [str(w.message) for w in caught if "LayerCurves" in str(w.message)]
        return monitors

    first = fit(1)
    resumed = fit(3, tmp_path / "ckpt" / "last.ckpt")
    points = [-1, 0, 1, 2] if val_check_interval == 1.0 else [0, 3, 6, 9, 12, 15, 18]
    for before, after in zip(first, resumed):
        assert after.curves.epochs == points
        assert after.curves.superseded == []
        for point, values in before.curves.history.items():
            assert after.curves.history[point] == values  # the last one measured after the checkpoint was saved
        content = read_curve_file(tmp_path / FIGURE_DIR / f"{after.curves.namespace}_curves.json")
        assert content["history"] == after.curves.history


def test_a_resumed_fit_that_continues_where_its_checkpoint_ended_reports_nothing(tmp_path):
    first = _Offset(100.0)
    trainer = _trainer(tmp_path, first, max_epochs=2, logger=False)
    trainer.fit(_Net(), _loader(), _loader())
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    resumed = _Offset(200.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _trainer(tmp_path, resumed, max_epochs=3, logger=False).fit(
            _Net(), _loader(), _loader(), ckpt_path=tmp_path / "last.ckpt"
        )
    assert not [w for w in caught if "LayerCurves" in str(w.message)]
    assert resumed.curves.superseded == []
    assert "superseded" not in json.loads((tmp_path / FIGURE_DIR / "test_curves.json").read_text())


def test_loading_older_curves_into_curves_that_went_further_supersedes_the_later_epochs(tmp_path):
    curves = LayerCurves("test", wandb_charts=False)
    for epoch in range(4):
        curves.record(epoch, {"a": {"m": float(epoch)}})
    older = LayerCurves("test")
    older.record(0, {"a": {"m": 0.0}})
    curves.load_state_dict(older.state_dict())
    trainer = SimpleNamespace(
        is_global_zero=True,
        loggers=[],
        default_root_dir=str(tmp_path),
        sanity_checking=False,
        current_epoch=1,
        state=SimpleNamespace(fn="fit"),
    )
    module = SimpleNamespace(log_dict=lambda *args, **kwargs: None)
    with pytest.warns(UserWarning, match="epochs 1-3 are trained again"):
        curves.record_and_log(trainer, module, {"a": {"m": 10.0}})
    assert curves.history == {0: {"a": {"m": 0.0}}, 1: {"a": {"m": 10.0}}}
    assert curves.superseded == [{"resumed_at": 1, "history": {e: {"a": {"m": float(e)}} for e in (1, 2, 3)}}]
    trainer.current_epoch = 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the check is made once, at the first epoch after loading
        curves.record_and_log(trainer, module, {"a": {"m": 20.0}})


class _WithInitialPoint(_EpochCurves):
    """``_EpochCurves`` that also measures the untrained model, at the start of training."""

    def on_train_start(self, trainer, pl_module):
        self.curves.record_initial(trainer, {"z_first": {"m": 5.0}, "a_second": {"m": torch.tensor(6.0)}})


def test_the_initial_point_is_recorded_at_epoch_minus_one_and_sent_to_the_loggers(tmp_path):
    callback = _WithInitialPoint()
    logger = CSVLogger(tmp_path)
    _trainer(tmp_path, callback, logger=logger).fit(_Net(), _loader(), _loader())

    assert callback.curves.epochs == [INITIAL_EPOCH, 0, 1]
    rows = [row for row in _read_csv(Path(logger.log_dir) / "metrics.csv") if row["test/z_first/m"]]
    assert [(int(r["epoch"]), int(r["step"]), float(r["test/a_second/m"])) for r in rows] == [
        (-1, 0, 6.0),
        (0, 1, 20.0),
        (1, 3, 21.0),
    ]
    content = read_curve_file(Path(logger.log_dir) / FIGURE_DIR / "test_curves.json")
    assert content["history"][INITIAL_EPOCH] == {"z_first": {"m": 5.0}, "a_second": {"m": 6.0}}
    assert (Path(logger.log_dir) / FIGURE_DIR / "test_m.png").is_file()


def test_the_initial_point_reaches_the_loggers_of_rank_zero_only_and_not_the_cadences(tmp_path):
    class Logger:
        def __init__(self) -> None:
            self.log_dir = str(tmp_path)
            self.calls: list[tuple[dict, int]] = []

        def log_metrics(self, metrics: dict, step: int) -> None:
            self.calls.append((metrics, step))

    logger = Logger()
    trainer = SimpleNamespace(is_global_zero=False, loggers=[logger], default_root_dir=str(tmp_path), global_step=0)
    curves = LayerCurves("test", figures_every_n_epochs=1)
    curves.record_initial(trainer, {"first": {"m": 1.0}})
    assert logger.calls == [] and curves.epochs == [INITIAL_EPOCH]
    trainer.is_global_zero = True
    curves.record_initial(trainer, {"first": {"m": 1.0}})
    assert logger.calls == [({"test/first/m": 1.0, "epoch": INITIAL_EPOCH}, 0)]
    assert not list((tmp_path / FIGURE_DIR).glob("*.png"))  # the figure cadence counts trained epochs only


def test_wandb_chart_cadence_does_not_count_the_initial_point(tmp_path):
    class WandbLogger:
        def __init__(self) -> None:
            self.log_dir = str(tmp_path)
            self.steps: list[int] = []

        def log_metrics(self, metrics: dict, step: int) -> None:
            if "test_curves/m_vs_epoch" in metrics:
                self.steps.append(step)

    logger = WandbLogger()
    trainer = SimpleNamespace(is_global_zero=True, loggers=[logger], sanity_checking=False, global_step=0)
    curves = LayerCurves("test", wandb_charts_every_n_epochs=3)
    curves.record_initial(trainer, {"first": {"m": -1.0}})
    module = SimpleNamespace(log_dict=lambda *args, **kwargs: None)
    for epoch in range(4):
        trainer.current_epoch = trainer.global_step = epoch
        curves.record_and_log(trainer, module, {"first": {"m": float(epoch)}})
    assert logger.steps == [0, 2]


def test_described_facts_caption_the_figures_and_travel_in_state_and_curve_file(tmp_path, monkeypatch):
    captions = []
    original = curves_module.layer_curves_figure

    def recording(*args, caption=None, **kwargs):
        captions.append(caption)
        return original(*args, caption=caption, **kwargs)

    monkeypatch.setattr(curves_module, "layer_curves_figure", recording)
    curves = LayerCurves("rank")
    curves.describe(split="val", samples=512, reduction={"conv maps": "channel"})
    curves.describe(samples=4096, rank_tolerance=None, tolerance_size="min", dtype=torch.float64)
    trainer = SimpleNamespace(
        is_global_zero=True, loggers=[], default_root_dir=str(tmp_path), sanity_checking=False, current_epoch=0
    )
    curves.record_and_log(trainer, SimpleNamespace(log_dict=lambda *a, **k: None), {"fc": {"numerical_rank": 3}})
    curves.write_figures(trainer)
    assert captions == [
        "split: validation set · N = 4,096 inputs · reduction: channel (conv maps) · "
        "rank tolerance: float32 eps \u00d7 min(rows, columns) (default) · dtype: torch.float64"
    ]
    facts = read_curve_file(tmp_path / FIGURE_DIR / "rank_curves.json")["facts"]
    assert facts == {
        "split": "val",
        "samples": 4096,
        "reduction": {"conv maps": "channel"},
        "rank_tolerance": None,
        "tolerance_size": "min",
        "dtype": "torch.float64",
    }
    restored = LayerCurves("rank")
    restored.describe(samples=100)  # described at setup, before the checkpoint is loaded: the run's own facts win
    restored.load_state_dict(curves.state_dict())
    assert restored.facts == facts | {"samples": 100}


class _EveryOtherEpochResumable(_EveryOtherEpoch, _CheckpointedCurves):
    """``_EveryOtherEpoch`` whose values are ``offset + epoch``, calling ``start_epoch`` as the package's monitors do,
    with its curves in checkpoints."""

    def __init__(self, offset: float) -> None:
        super().__init__({epoch: offset + epoch for epoch in range(10)})

    def on_train_epoch_start(self, trainer, pl_module):
        self.curves.start_epoch(trainer)


@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")
def test_resuming_twice_from_an_older_checkpoint_keeps_every_superseded_run(tmp_path):
    saving = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1, filename="{epoch}")
    options = dict(logger=False, num_sanity_val_steps=0)
    first = _trainer(
        tmp_path, _EveryOtherEpochResumable(100.0), saving, max_epochs=4, enable_checkpointing=True, **options
    )
    first.fit(_Net(), _loader(), _loader())
    curve_file = tmp_path / FIGURE_DIR / "test_curves.json"
    checkpoint = tmp_path / "ckpt" / "epoch=1.ckpt"

    def values(history):
        return {e: v["first"]["m"] for e, v in history.items()}

    # Resumed at epoch 2 (after epoch 1): measured epoch 3 of the first run is superseded, named at epoch 2.
    second = _EveryOtherEpochResumable(200.0)
    with pytest.warns(
        UserWarning, match=r"measures again from epoch 2 on; epoch 3 is trained again and its values are replaced"
    ):
        _trainer(tmp_path, second, max_epochs=6, **options).fit(_Net(), _loader(), _loader(), ckpt_path=checkpoint)
    assert values(read_curve_file(curve_file)["history"]) == {1: 101.0, 3: 203.0, 5: 205.0}

    # Resumed there again, stopping at epoch 2 before anything is measured: the second run's epochs 3 and 5 are
    # superseded at once (file and figures agree), and the first run's superseded block is kept.
    third = _EveryOtherEpochResumable(300.0)
    with pytest.warns(
        UserWarning, match=r"measures again from epoch 2 on; epochs 3, 5 are trained again and their values"
    ):
        _trainer(tmp_path, third, max_epochs=3, **options).fit(_Net(), _loader(), _loader(), ckpt_path=checkpoint)
    content = read_curve_file(curve_file)
    assert values(content["history"]) == {1: 101.0}
    assert third.curves.history == content["history"]
    assert [(b["resumed_at"], values(b["history"])) for b in content["superseded"]] == [
        (2, {3: 103.0}),
        (2, {3: 203.0, 5: 205.0}),
    ]
    assert third.curves.superseded == content["superseded"]


@pytest.mark.slow
def test_a_wandb_chart_longer_than_a_table_keeps_every_layer_to_its_last_point(tmp_path, monkeypatch):
    # A line-series chart is a table of one row per layer and point; W&B truncates a table past wandb.Table.MAX_ROWS
    # rows, which cut the last layers' curves short (or off). The points are thinned instead, evenly, first and last
    # kept.
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setattr(wandb.Table, "MAX_ROWS", 10)
    logger = WandbLogger(mode="offline", save_dir=tmp_path, project="rank")
    trainer = SimpleNamespace(is_global_zero=True, loggers=[logger], global_step=6, callbacks=[])
    curves = LayerCurves("test")
    for epoch in range(7):
        curves.record(epoch, {layer: {"m": 10.0 * depth + epoch} for depth, layer in enumerate(["a", "b", "c"])})
    try:
        curves._log_wandb_charts(trainer)
        files = Path(logger.experiment.dir)
    finally:
        wandb.finish()

    history = offline_run_history(tmp_path)
    table = json.loads((files / json.loads(history["test_curves/m_vs_epoch_table/path"][0])).read_text())
    # 10 // 3 layers: 3 points a layer, epochs 0, 3 and 6.
    assert table["data"] == [[e, layer, 10.0 * depth + e] for depth, layer in enumerate("abc") for e in (0, 3, 6)]
    depth_table = json.loads((files / json.loads(history["test_curves/m_vs_depth_table/path"][0])).read_text())
    # The depth chart alike: 3 of the 7 epochs, each a line over the 3 layers.
    expected = [[depth, f"epoch {e}", 10.0 * depth + e] for e in (0, 3, 6) for depth in range(3)]
    assert depth_table["data"] == expected


def test_layers_of_a_separate_suffix_get_figures_of_their_own(tmp_path, monkeypatch):
    drawn = []
    original = curves_module.layer_curves_figure

    def spy(namespace, metric, layers, *args, **kwargs):
        drawn.append((metric, list(layers)))
        return original(namespace, metric, layers, *args, **kwargs)

    monkeypatch.setattr(curves_module, "layer_curves_figure", spy)
    curves = WeightRankMonitor().curves  # LoRA updates (lora_update=True, the default) are drawn apart
    assert WeightRankMonitor(lora_update=False).curves.separate_suffixes == ()
    layers = ["a", "a.lora_update", "b", "b.lora_update"]
    for epoch in range(2):
        curves.record(epoch, {layer: {"numerical_rank": float(len(layer))} for layer in layers})
    assert curves.figure_layer_groups() == [("", ["a", "b"]), (".lora_update", ["a.lora_update", "b.lora_update"])]
    paths = curves.write_figures(SimpleNamespace(is_global_zero=True, loggers=[], default_root_dir=str(tmp_path)))
    assert sorted(path.name for path in paths) == ["weight_numerical_rank.lora_update.png", "weight_numerical_rank.png"]
    assert sorted(drawn) == [("numerical_rank", ["a", "b"]), ("numerical_rank", ["a.lora_update", "b.lora_update"])]
