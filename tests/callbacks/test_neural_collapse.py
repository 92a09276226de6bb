"""NeuralCollapseMonitor: NC1 falls when a classifier trains, and the logged numbers equal the direct computation."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from torch import nn

from rank_lightning.callbacks import NeuralCollapseMonitor
from rank_lightning.data import GaussianMixtureDataModule
from rank_lightning.functional.neural_collapse import NC_METRICS, neural_collapse
from tests.callbacks.trainer_helpers import quiet_trainer


class _Steps:
    """Layers and steps shared by the pytorch_lightning and lightning.pytorch modules."""

    def build(self, dim: int = 16, width: int = 32, classes: int = 4) -> None:
        self.net = nn.Sequential(nn.Linear(dim, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU())
        self.fc = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.net(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self(x), y))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


class _Classifier(_Steps, pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.build()


def _datamodule() -> GaussianMixtureDataModule:
    return GaussianMixtureDataModule(
        num_classes=4, dim=16, sigma=0.6, samples_per_class=100, val_fraction=0.3, test_fraction=0.1, batch_size=40
    )


def _direct(model: nn.Module, datamodule: GaussianMixtureDataModule):
    model.eval()
    xs, ys = zip(*datamodule.val_dataloader())
    x, y = torch.cat(xs), torch.cat(ys)
    with torch.no_grad():
        features = model.net(x)
        predictions = model.fc(features).argmax(dim=1)
    return neural_collapse(features, y, num_classes=4, head_weight=model.fc.weight, predictions=predictions)


def test_nc1_falls_during_training_and_equals_the_direct_computation(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, datamodule = _Classifier(), _datamodule()
    monitor = NeuralCollapseMonitor(every_n_epochs=4, log_at_init=True, verbose=False)
    trainer = quiet_trainer([monitor], max_epochs=8, default_root_dir=tmp_path)
    trainer.fit(model, datamodule=datamodule)
    assert monitor.head_path == "fc"
    epochs, nc1 = monitor.curves.curve("fc", "nc1")
    assert epochs == [-1, 3, 7]
    assert nc1[-1] < 0.5 * nc1[0]
    assert (tmp_path / "rank_curves" / "neural_collapse_nc1.png").is_file()
    assert monitor.curves.curve("fc", "nc4")[1][-1] > 0.9
    # The last measurement saw the final weights: it equals the in-memory computation on the same samples.
    expected = _direct(model, datamodule).as_dict()
    for key in NC_METRICS:
        assert monitor.result.as_dict()[key] == pytest.approx(expected[key], rel=1e-9), key
        assert float(trainer.callback_metrics[f"neural_collapse/fc/{key}"]) == pytest.approx(expected[key], rel=1e-6)


def test_validate_run_max_samples_and_metric_choice(tmp_path: Path) -> None:
    torch.manual_seed(1)
    model, datamodule = _Classifier(), _datamodule()
    monitor = NeuralCollapseMonitor(metrics=("nc1", "cdnv"), max_samples=50, head="fc", verbose=False)
    trainer = quiet_trainer([monitor], default_root_dir=tmp_path)
    trainer.validate(model, datamodule=datamodule)
    assert set(trainer.callback_metrics) >= {"neural_collapse/fc/nc1", "neural_collapse/fc/cdnv"}
    assert "neural_collapse/fc/nc3" not in trainer.callback_metrics
    assert monitor.result.num_samples == 50


def test_works_with_a_lightning_pytorch_trainer(tmp_path: Path) -> None:
    lightning = pytest.importorskip("lightning.pytorch")

    class LightningClassifier(_Steps, lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.build()

    torch.manual_seed(2)
    model, datamodule = LightningClassifier(), _datamodule()
    monitor = NeuralCollapseMonitor(verbose=False)
    trainer = quiet_trainer([monitor], lightning.Trainer, default_root_dir=tmp_path)
    datamodule.setup("validate")  # a pytorch_lightning datamodule: its loaders go to the other package's trainer
    trainer.validate(model, dataloaders=datamodule.val_dataloader())
    expected = _direct(model, datamodule).as_dict()
    for key in NC_METRICS:
        assert float(trainer.callback_metrics[f"neural_collapse/fc/{key}"]) == pytest.approx(expected[key], rel=1e-6)


def test_a_head_without_a_class_weight_logs_nc3_as_nan(tmp_path: Path) -> None:
    # The hidden Sequential as "head": its output (32 columns) is read as logits, but it has no (32, 16) weight.
    monitor = NeuralCollapseMonitor(head="net", verbose=False)
    trainer = quiet_trainer([monitor], default_root_dir=tmp_path)
    with pytest.warns(UserWarning, match=r"the head has no \(32, 16\) weight \(found None\); nc3 is logged as NaN"):
        trainer.validate(_Classifier(), datamodule=_datamodule())
    assert math.isnan(monitor.result.nc3) and not math.isnan(monitor.result.nc1)


def test_a_head_behind_an_lr_layer_is_the_wrapped_head(tmp_path: Path) -> None:
    # insert_lr_layer turns the head into nn.Sequential(LRLayer, head): the Sequential has no weight, and nc3 was
    # logged as NaN for every model trained with an LR-Layer before its head (Sanyal et al.).
    from rank_lightning.nn import LRLayer, insert_lr_layer

    torch.manual_seed(3)
    model, datamodule = _Classifier(), _datamodule()
    model.head_path = "fc"  # named as the package's modules name their head
    insert_lr_layer(model, "fc", LRLayer(32, 2))
    monitor = NeuralCollapseMonitor(verbose=False)
    quiet_trainer([monitor], default_root_dir=tmp_path).validate(model, datamodule=datamodule)
    assert monitor.head_path == "fc.1"
    model.fc = model.fc[1]  # the LR-Layer is an identity: the same network without it
    expected = _direct(model, datamodule).as_dict()
    for key in NC_METRICS:
        assert monitor.result.as_dict()[key] == pytest.approx(expected[key], rel=1e-9), key


class _Features(_Classifier):
    """The inputs are the features: the head reads them as they come."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def test_class_means_that_differ_by_rounding_only_log_nc1_and_nc4_as_nan_with_a_warning(tmp_path: Path) -> None:
    # Features near (1, ..., 1) whose class means differ by 2e-6, below the float32 cut-off 32 * eps32 * ||mu_c||.
    generator = torch.Generator().manual_seed(0)
    y = torch.arange(40) % 4
    x = torch.ones(40, 32) + 2e-6 * nn.functional.one_hot(y, 32) + 1e-6 * torch.randn(40, 32, generator=generator)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=10)
    monitor = NeuralCollapseMonitor(verbose=False)
    trainer = quiet_trainer([monitor], default_root_dir=tmp_path)
    with pytest.warns(UserWarning, match=r"class means of the input of 'fc' differ by no more than the rounding of "):
        trainer.validate(_Features(), loader)
    assert math.isnan(monitor.result.nc1) and math.isnan(monitor.result.nc4)
    assert math.isfinite(monitor.result.cdnv)


def _features_loader(x: torch.Tensor, y: torch.Tensor) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=10)


def test_a_class_absent_from_the_validation_data_is_named_and_left_out(tmp_path: Path) -> None:
    generator = torch.Generator().manual_seed(0)
    y = torch.tensor([0, 2, 3] * 10)  # class 1 of the head's 4 has no sample
    x = 3.0 * nn.functional.one_hot(y, 32) + torch.randn(30, 32, generator=generator)
    model = _Features()
    monitor = NeuralCollapseMonitor(verbose=False)
    message = r"no sample of classes \[1\] of the head's 4: the metrics cover the other 3 only \(C = 3"
    with pytest.warns(UserWarning, match=message):
        quiet_trainer([monitor], default_root_dir=tmp_path).validate(model, _features_loader(x, y))
    with torch.no_grad():
        predictions = model.fc(x).argmax(dim=1)
    expected = neural_collapse(x, y, num_classes=4, head_weight=model.fc.weight, predictions=predictions)
    assert monitor.result.num_classes == 3
    for key in NC_METRICS:
        assert monitor.result.as_dict()[key] == pytest.approx(expected.as_dict()[key], rel=1e-9), key


def test_one_class_only_is_named_as_the_reason_for_nan(tmp_path: Path) -> None:
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(10, 32, generator=generator), torch.full((10,), 2)
    monitor = NeuralCollapseMonitor(verbose=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_trainer([monitor], default_root_dir=tmp_path).validate(_Features(), _features_loader(x, y))
    messages = [str(w.message) for w in caught if "NeuralCollapseMonitor" in str(w.message)]
    named = "no sample of classes [0, 1, 3] of the head's 4: with 1 class every metric is NaN"
    assert any(named in m for m in messages)
    assert not any("differ by no more than the rounding" in m for m in messages)  # not the reason here
    assert all(math.isnan(value) for value in monitor.result.as_dict().values())


class _TwoViews(_Classifier):
    """The head runs twice per forward pass: on the features of the inputs and of their negatives."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.net(x)) + self.fc(self.net(-x))


def test_a_head_called_twice_per_forward_is_read_at_its_first_call_with_a_warning(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, datamodule = _TwoViews(), _datamodule()
    monitor = NeuralCollapseMonitor(verbose=False)
    trainer = quiet_trainer([monitor], default_root_dir=tmp_path)
    with pytest.warns(UserWarning, match=r"the head 'fc' runs more than once per forward pass .* first call"):
        trainer.validate(model, datamodule=datamodule)
    expected = _direct(model, datamodule)  # the first call: fc on net(x), its own argmax for NC4
    for name in NC_METRICS:
        assert getattr(monitor.result, name) == pytest.approx(getattr(expected, name), rel=1e-9), name


class _DictSteps(_Classifier):
    """``forward(x)``, with steps that pass it the ``image`` of dict batches ``{"image", "label"}``."""

    def validation_step(self, batch, batch_idx):
        self(batch["image"])


class _WholeBatch(_Classifier):
    """``forward`` takes the whole dict batch ``{"image", "label"}``, as a Hugging Face-style module does."""

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.fc(self.net(batch["image"]))

    def validation_step(self, batch, batch_idx):
        self(batch)


@pytest.mark.parametrize("model_cls", [_WholeBatch, _DictSteps], ids=["forward(batch)", "forward(x)"])
def test_dict_batches_reach_forward_as_the_steps_pass_them(tmp_path: Path, model_cls: type) -> None:
    # forward(batch) gets the dict; forward(x) (whose steps pass batch["image"]) gets the dict's inputs.
    torch.manual_seed(0)
    model, datamodule = model_cls(), _datamodule()
    datamodule.setup("validate")
    rows = [{"image": x, "label": y} for xs, ys in datamodule.val_dataloader() for x, y in zip(xs, ys)]
    monitor = NeuralCollapseMonitor(verbose=False)
    quiet_trainer([monitor], default_root_dir=tmp_path).validate(model, torch.utils.data.DataLoader(rows, 40))
    expected = _direct(model, datamodule)
    for name in NC_METRICS:
        assert getattr(monitor.result, name) == pytest.approx(getattr(expected, name), rel=1e-9), name


def test_bad_arguments_raise_with_the_choices() -> None:
    with pytest.raises(ValueError, match="nc1"):
        NeuralCollapseMonitor(metrics=("nc9",))
    with pytest.raises(ValueError, match="head must be None or a module path"):
        NeuralCollapseMonitor(head="")
    with pytest.raises(ValueError, match="max_samples"):
        NeuralCollapseMonitor(max_samples=0)
    with pytest.raises(ValueError, match="nope"):
        NeuralCollapseMonitor(head="nope").find_head(_Classifier())
    with pytest.raises(ValueError, match=r"has no head_path and no nn\.Linear"):
        NeuralCollapseMonitor().find_head(nn.Sequential(nn.ReLU()))


def test_non_finite_features_log_nan_without_stopping(tmp_path: Path) -> None:
    class _Broken(_Classifier):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.net(x)
            return self.fc(h * math.inf)

    monitor = NeuralCollapseMonitor(verbose=False)
    trainer = quiet_trainer([monitor], default_root_dir=tmp_path)
    trainer.validate(_Broken(), datamodule=_datamodule())
    assert all(math.isnan(v) for v in monitor.result.as_dict().values())


@pytest.mark.parametrize("precision", ["bf16-true", "64-true"])
def test_its_own_pass_casts_the_inputs_as_the_steps_do(tmp_path: Path, precision: str) -> None:
    """Under bf16-true and 64-true the weights are bf16 / float64: float32 inputs would fail the forward pass."""
    torch.manual_seed(1)
    model, datamodule = _Classifier(), _datamodule()
    monitor = NeuralCollapseMonitor(metrics=("nc1",), head="fc", verbose=False)
    trainer = quiet_trainer([monitor], default_root_dir=tmp_path, precision=precision)
    trainer.validate(model, datamodule=datamodule)
    assert math.isfinite(float(trainer.callback_metrics["neural_collapse/fc/nc1"]))


class _ShiftedInputs(_Classifier):
    """A module whose batch-transfer hook takes the whole ``(x, y)`` batch, as Lightning's steps pass it."""

    def on_after_batch_transfer(self, batch, dataloader_idx):
        x, y = batch
        return x + 1.0, y


def test_its_own_passes_give_the_batch_transfer_hook_the_whole_batch(tmp_path: Path) -> None:
    torch.manual_seed(1)
    model, datamodule = _ShiftedInputs(), _datamodule()
    monitor = NeuralCollapseMonitor(metrics=("nc1",), head="fc", verbose=False)
    quiet_trainer([monitor], default_root_dir=tmp_path).validate(model, datamodule=datamodule)
    datamodule.setup("validate")
    xs, ys = zip(*datamodule.val_dataloader())
    with torch.no_grad():
        features = model.net(torch.cat(xs) + 1.0)  # the inputs the steps see
    expected = neural_collapse(features, torch.cat(ys), num_classes=4, head_weight=model.fc.weight)
    assert monitor.result.nc1 == pytest.approx(float(expected.nc1), rel=1e-9)
