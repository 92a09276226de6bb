import csv
import json
import math
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import CSVLogger, TensorBoardLogger, WandbLogger
from torch import nn

from rank_lightning.callbacks import curves as curves_module
from rank_lightning.callbacks.curves import (
    FIGURE_DIR,
    LayerCurves,
    read_curve_file,
    run_directory,
    wandb_loggers,
    write_curve_file,
)


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


class _EpochCurves(pl.Callback):
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

    def state_dict(self):
        return {"curves": self.curves.state_dict()}

    def load_state_dict(self, state_dict):
        self.curves.load_state_dict(state_dict["curves"])


def _loader() -> torch.utils.data.DataLoader:
    data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,)))
    return torch.utils.data.DataLoader(data, batch_size=8)


def _trainer(tmp_path: Path, callback: pl.Callback, **kwargs) -> pl.Trainer:
    options = dict(
        max_epochs=2,
        default_root_dir=tmp_path,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=1,
        enable_checkpointing=False,
        callbacks=[callback],
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
