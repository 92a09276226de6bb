"""Keys sent to an ``MLFlowLogger``, whose metric names hold letters, digits and ``_/. -`` only: a layer's ``k``-th
call (``<layer>@<k>``, ``repeated_calls="each"``) must not meet another layer's curve under one name."""

from __future__ import annotations

import csv
import re
import warnings
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from rank_lightning.callbacks import ActivationRankMonitor
from rank_lightning.callbacks.curves import LayerCurves
from tests.callbacks.recording_logger import RecordingLogger
from tests.callbacks.trainer_helpers import quiet_trainer

# blocks.1 runs twice, so its calls are blocks.1@1 and blocks.1@2; MLflow's blocks.11 and blocks.12 are layers too.
LAYERS = ["blocks.1", "blocks.11", "blocks.12"]
RENAMED = {"blocks.1@1": "blocks.1_1", "blocks.1@2": "blocks.1_2", "blocks.11": "blocks.11", "blocks.12": "blocks.12"}


class LoopedBlocks(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(13))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            x = x + block(x) + (block(x) if i == 1 else 0)
        return x

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0]).square().mean()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class MLFlowLogger(RecordingLogger):
    """Stands in for Lightning's ``MLFlowLogger`` (told by its class name) without mlflow: drops from a key the
    characters MLflow refuses, as Lightning's does."""

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        kept: dict[str, float] = {}
        for key, value in metrics.items():
            kept.setdefault(re.sub("[^a-zA-Z0-9_/. -]+", "", key), value)  # the first of two keys that meet
        super().log_metrics(kept, step)


def _fit(loggers: list[Any], **monitor_options: Any) -> ActivationRankMonitor:
    monitor = ActivationRankMonitor(
        layers=LAYERS, repeated_calls="each", metrics=["numerical_rank"], verbose=False, **monitor_options
    )
    data = DataLoader(TensorDataset(torch.randn(16, 6, generator=torch.Generator().manual_seed(0))), batch_size=4)
    quiet_trainer([monitor], max_epochs=2, logger=loggers, log_every_n_steps=1).fit(LoopedBlocks(), data, data)
    return monitor


@pytest.fixture(autouse=True)
def _no_figures(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(LayerCurves, "write_figures", lambda self, *args, **kwargs: [])


def test_an_mlflow_logger_gets_one_accepted_name_per_key_and_one_warning():
    logger = MLFlowLogger()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monitor = _fit([logger], log_at_init=True)
    sent = [set(metrics) - {"epoch"} for _, metrics in logger.calls]
    names = {f"rank/{name}/{metric}" for name in RENAMED.values() for metric in ("numerical_rank", "spectrum_rows")}
    assert sent == [names] * 3  # the initial point and two epochs
    assert all(re.fullmatch(r"[A-Za-z0-9_/. -]+", name) for name in names)
    for layer, name in RENAMED.items():  # each curve under a name of its own, with the values the curves hold
        values = [metrics[f"rank/{name}/numerical_rank"] for _, metrics in logger.calls]
        assert values == monitor.curves.curve(layer, "numerical_rank")[1]
    renames = [str(w.message) for w in caught if "MLflow takes" in str(w.message)]
    assert len(renames) == 1
    first = "'rank/blocks.1@1/numerical_rank' -> 'rank/blocks.1_1/numerical_rank'"
    assert f"MLFlowLogger receives 4 keys renamed ({first}, " in renames[0]


@pytest.mark.parametrize(
    ("cadence", "steps"), [({}, [0, 3, 7]), ({"every_n_train_steps": 3}, [0, 3, 6])], ids=["epochs", "steps"]
)
def test_an_mlflow_run_holds_every_curve_at_the_steps_of_the_csv_logger(tmp_path, monkeypatch, cadence, steps):
    pytest.importorskip("mlflow")
    from pytorch_lightning.loggers import MLFlowLogger as LightningMLFlowLogger

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # a local file store: nothing leaves the machine
    mlflow = LightningMLFlowLogger(experiment_name="rank", tracking_uri=f"file:{tmp_path}/mlruns")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monitor = _fit([CSVLogger(tmp_path, name="csv", version=0), mlflow], **cadence)
    assert not [w for w in caught if "MLFlow only allows" in str(w.message)]  # Lightning's, for every key and write
    assert len([w for w in caught if "MLflow takes" in str(w.message)]) == 1
    rows = list(csv.DictReader(open(tmp_path / "csv" / "version_0" / "metrics.csv")))
    client, namespace = mlflow.experiment, monitor.curves.namespace
    for layer, name in RENAMED.items():
        key = monitor.curves.key(layer, "numerical_rank")
        history = client.get_metric_history(mlflow.run_id, f"{namespace}/{name}/numerical_rank")
        expected = [(int(row["step"]), float(row[key])) for row in rows if row.get(key)]
        assert [(point.step, point.value) for point in history] == expected
        assert [step for step, _ in expected] == steps  # the initial point, then the measured epochs or steps
