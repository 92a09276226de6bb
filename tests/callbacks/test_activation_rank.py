import csv
import json
import math
import warnings
from pathlib import Path

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.loggers import CSVLogger, WandbLogger
from torch import nn

from rank_lightning.callbacks import ActivationRankMonitor, WeightRankMonitor
from rank_lightning.callbacks.curves import FIGURE_DIR
from rank_lightning.data.digits import DigitsDataModule
from rank_lightning.functional import (
    alpha_req,
    classwise_variance_ratio,
    effective_rank,
    numerical_rank,
    participation_ratio,
    reduce_activations,
    soft_rank,
    stable_rank,
    total_cluster_variation,
    variance_ratio,
)
from rank_lightning.layers import default_layers
from tests.callbacks.recording_logger import RecordingLogger
from tests.callbacks.trainer_helpers import quiet_trainer
from tests.callbacks.wandb_helpers import offline_run_history

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _trainer(tmp_path: Path, callbacks: list, trainer_cls=pl.Trainer, **kwargs):
    return quiet_trainer(callbacks, trainer_cls, **({"max_epochs": 1, "default_root_dir": tmp_path} | kwargs))


def _loader(x: torch.Tensor, y: torch.Tensor, batch_size: int = 16) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch_size)


def _gaussian(n: int, d: int, seed: int, classes: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=generator), torch.randint(0, classes, (n,), generator=generator)


def _csv_rows(log_dir: str | Path) -> list[dict[str, str]]:
    with (Path(log_dir) / "metrics.csv").open(newline="") as file:
        return list(csv.DictReader(file))


def _collect(model: nn.Module, names: list[str], loader) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Outputs of the named submodules over ``loader`` in eval mode, gathered by our own forward hooks."""
    outputs: dict[str, list[torch.Tensor]] = {name: [] for name in names}
    handles = [
        model.get_submodule(name).register_forward_hook(lambda m, i, o, name=name: outputs[name].append(o.detach()))
        for name in names
    ]
    labels = []
    model.eval()
    try:
        with torch.no_grad():
            for x, y in loader:
                model(x)
                labels.append(y)
    finally:
        for handle in handles:
            handle.remove()
    return {name: torch.cat(chunks) for name, chunks in outputs.items()}, torch.cat(labels)


def _reference(x: torch.Tensor, labels: torch.Tensor | None = None, num_classes: int = 10) -> dict[str, float]:
    """Every logged metric of an (N, d) matrix from rank_lightning.functional (SVD of X itself, not a Gram)."""
    values = {
        "numerical_rank": float(numerical_rank(x)),
        "soft_rank": float(soft_rank(x, tau=0.5)),
        "participation_ratio": float(participation_ratio(x)),
        "stable_rank": float(stable_rank(x)),
        "effective_rank": float(effective_rank(x)),
        "variance_ratio_1": float(variance_ratio(x, 1)),
        "variance_ratio_10": float(variance_ratio(x, 10)),
        "spectrum_rows": float(x.shape[0]),
    }
    if labels is not None:
        values["tcv"] = float(total_cluster_variation(x, labels, num_classes=num_classes))
        values["tcv_normalized"] = float(total_cluster_variation(x, labels, normalized=True, num_classes=num_classes))
        per_class = classwise_variance_ratio(x, labels, k=1, num_classes=num_classes)
        values["classwise_variance_ratio_1_mean"] = float(per_class[~per_class.isnan()].mean())
    return values


def _assert_close(logged: dict[str, float], expected: dict[str, float], rel: float = 2e-6) -> None:
    assert logged.keys() == expected.keys()
    for key, value in expected.items():
        assert logged[key] == pytest.approx(value, rel=rel, abs=1e-9), key


# -- 1. logged values equal the functional metrics -------------------------------------------------------------------


class _ConvTokenNet(pl.LightningModule):
    """Conv maps (B, 4, 8, 8), tokens (B, 16, 6) and a rank-3 linear layer (B, 12) on 8x8 digits."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.pool = nn.AvgPool2d(2)
        self.embed = nn.Linear(4, 6)
        self.hidden = nn.Linear(96, 12)
        self.head = nn.Linear(12, 10)
        generator = torch.Generator().manual_seed(3)
        with torch.no_grad():
            self.hidden.weight.copy_(torch.randn(12, 3, generator=generator) @ torch.randn(3, 96, generator=generator))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        maps = self.pool(torch.relu(self.conv(x)))
        tokens = self.embed(maps.flatten(2).transpose(1, 2))
        return self.head(torch.relu(self.hidden(tokens.flatten(1))))

    def training_step(self, batch, batch_idx):
        return nn.functional.cross_entropy(self(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", nn.functional.cross_entropy(self(batch[0]), batch[1]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


@pytest.mark.parametrize(("conv_reduction", "token_reduction"), [("channel", "token"), ("flatten", "cls")])
def test_logged_values_equal_the_functional_metrics(tmp_path, conv_reduction, token_reduction):
    torch.manual_seed(0)
    model = _ConvTokenNet()
    datamodule = DigitsDataModule(batch_size=64)
    monitor = ActivationRankMonitor(
        layers=["conv", "embed", "hidden"],
        conv_reduction=conv_reduction,
        token_reduction=token_reduction,
        max_samples=None,
        verbose=False,
    )
    logger = CSVLogger(tmp_path, name="run", version=0)
    trainer = _trainer(tmp_path, [monitor], logger=logger)
    (results,) = trainer.validate(model, datamodule=datamodule, verbose=False)

    outputs, labels = _collect(model, ["conv", "embed", "hidden"], datamodule.val_dataloader())
    assert labels.shape == (359,)
    prefixes = {"conv": f"{conv_reduction}/", "embed": f"{token_reduction}/", "hidden": ""}
    reductions = {"conv": conv_reduction, "embed": token_reduction, "hidden": "flatten"}
    expected = {}
    for name, output in outputs.items():
        x = reduce_activations(output, reductions[name])
        # "channel" and "token" make every position a sample that keeps its input's label.
        row_labels = labels.repeat_interleave(x.shape[0] // labels.shape[0])
        for metric, value in _reference(x, row_labels).items():
            expected[f"rank/{name}/{prefixes[name]}{metric}"] = value
    assert expected["rank/hidden/numerical_rank"] == 4  # rank-3 weight plus the bias
    if conv_reduction == "channel":
        assert expected["rank/conv/channel/numerical_rank"] == 4

    from_trainer = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("rank/")}
    _assert_close(from_trainer, expected)
    assert {k: v for k, v in results.items() if k.startswith("rank/")} == pytest.approx(from_trainer)
    (row,) = [row for row in _csv_rows(logger.log_dir) if row.get("rank/hidden/numerical_rank")]
    _assert_close({k: float(v) for k, v in row.items() if k.startswith("rank/")}, expected)
    # The history holds the same values (in float64: the tiny singular values of a rank-deficient layer that the Gram
    # gives, ~1e-8 s_1 instead of the SVD's, still move the effective rank by ~1e-7).
    history = monitor.curves.history[-1]  # validate() of an untrained model records the initial point
    _assert_close({f"rank/{layer}/{m}": v for layer, ms in history.items() for m, v in ms.items()}, expected)


# -- 2. any LightningModule, either Lightning package ----------------------------------------------------------------


class _PlainSteps:
    """An MLP in an nn.Sequential, with nothing from this package (no blocks(), no num_classes)."""

    def build(self) -> None:
        self.net = nn.Sequential(nn.Linear(8, 24), nn.ReLU(), nn.Linear(24, 24), nn.ReLU(), nn.Linear(24, 3))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        return nn.functional.cross_entropy(self(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", nn.functional.cross_entropy(self(batch[0]), batch[1]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


class _PlainModel(_PlainSteps, pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.build()


def _lightning_plain_model():
    lightning = pytest.importorskip("lightning.pytorch")

    class LightningPlainModel(_PlainSteps, lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.build()

    return LightningPlainModel(), lightning.Trainer


@pytest.mark.parametrize("flavour", ["pytorch_lightning", "lightning.pytorch"])
def test_a_plain_module_gets_default_layers_curves_and_figures(tmp_path, callback_messages, flavour):
    torch.manual_seed(0)
    model, trainer_cls = (_PlainModel(), pl.Trainer) if flavour == "pytorch_lightning" else _lightning_plain_model()
    x, y = _gaussian(48, 8, seed=1, classes=3)
    monitor = ActivationRankMonitor(metrics=["numerical_rank", "participation_ratio"])
    weights = WeightRankMonitor(metrics=["stable_rank"])
    trainer = _trainer(tmp_path, [monitor, weights], trainer_cls=trainer_cls, max_epochs=2)
    trainer.fit(model, _loader(x, y), _loader(x, y))

    printed = "\n".join(callback_messages)
    assert "ActivationRankMonitor: monitoring 2 layers (default choice" in printed
    assert "no class metrics (num_classes unknown): net.1, net.3" in printed
    assert "WeightRankMonitor: monitoring 3 weight matrices: net.0, net.2, net.4" in printed
    assert monitor.monitored == {"net.1": "net.1", "net.3": "net.3"}
    assert monitor.curves.epochs == [-1, 0, 1]  # -1: the untrained model

    outputs, _ = _collect(model, ["net.1", "net.3"], _loader(x, y))
    for layer, output in outputs.items():
        reference = _reference(output)
        for metric in ("numerical_rank", "participation_ratio"):
            assert float(trainer.callback_metrics[f"rank/{layer}/{metric}"]) == pytest.approx(reference[metric], 2e-6)
    assert {k for k in trainer.callback_metrics if k.startswith("weight/")} == {
        f"weight/net.{i}/stable_rank" for i in (0, 2, 4)
    }
    directory = tmp_path / FIGURE_DIR
    for figure in ("rank_numerical_rank.png", "rank_participation_ratio.png", "weight_stable_rank.png"):
        assert (directory / figure).read_bytes()[:8] == PNG_MAGIC
    curves = json.loads((directory / "rank_curves.json").read_text())
    assert curves["layers"] == ["net.1", "net.3"]
    assert sorted(curves["history"], key=int) == ["-1", "0", "1"]


def test_default_layer_choice_for_foreign_networks():
    mlp = nn.Module()
    mlp.net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    assert list(default_layers(mlp)) == ["net.1", "net.3"]

    # ResNet-like: the parameterised blocks, not the stem activation.
    resnet = nn.Module()
    resnet.model = nn.Module()
    resnet.model.conv1 = nn.Conv2d(3, 4, 3)
    resnet.model.relu = nn.ReLU()
    for i in (1, 2):
        setattr(resnet.model, f"layer{i}", nn.Sequential(nn.Conv2d(4, 4, 3), nn.ReLU()))
    resnet.model.fc = nn.Linear(4, 2)
    assert list(default_layers(resnet)) == ["model.layer1", "model.layer2"]

    # VGG-like: the hidden activations of features and classifier (the classifier holds the head), not the one
    # features container, which gave rank vs depth a single point.
    vgg = nn.Sequential()
    vgg.features = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())
    vgg.classifier = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    assert list(default_layers(vgg)) == ["features.1", "classifier.1"]

    # No activation modules (functional relu): the parameterised children except the head.
    linear = nn.Module()
    linear.fc1, linear.fc2, linear.out = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)
    assert list(default_layers(linear)) == ["fc1", "fc2"]


def test_layer_types_alone_selects_every_layer_of_that_type():
    model = _ConvTokenNet()
    assert ActivationRankMonitor(layer_types=[nn.Linear]).select(model) == {
        "embed": "embed",
        "hidden": "hidden",
        "head": "head",
    }
    assert ActivationRankMonitor(layers=["conv", "embed"], layer_types=["Conv2d"]).select(model) == {"conv": "conv"}


# -- 4. resuming continues the curves -------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")
def test_resuming_from_a_checkpoint_continues_the_curves(tmp_path):
    torch.manual_seed(0)
    x, y = _gaussian(32, 8, seed=2, classes=3)
    options = dict(layers=["net.1"], metrics=["numerical_rank"], verbose=False)

    first = ActivationRankMonitor(**options)
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "checkpoints", save_last=True)
    trainer = _trainer(
        tmp_path, [first, checkpoint], max_epochs=2, enable_checkpointing=True, logger=CSVLogger(tmp_path, version=0)
    )
    trainer.fit(_PlainModel(), _loader(x, y), _loader(x, y))
    assert first.curves.epochs == [-1, 0, 1]

    second = ActivationRankMonitor(**options)
    logger = CSVLogger(tmp_path, version=1)
    resumed = _trainer(tmp_path, [second], max_epochs=4, logger=logger)
    resumed.fit(_PlainModel(), _loader(x, y), _loader(x, y), ckpt_path=tmp_path / "checkpoints" / "last.ckpt")

    assert second.curves.epochs == [-1, 0, 1, 2, 3]  # a resumed run measures no second initial point
    assert {e: second.curves.history[e] for e in (-1, 0, 1)} == first.curves.history
    curves = json.loads((Path(logger.log_dir) / FIGURE_DIR / "rank_curves.json").read_text())
    assert sorted(curves["history"], key=int) == ["-1", "0", "1", "2", "3"]
    assert curves["history"]["3"]["net.1"]["numerical_rank"] == second.curves.history[3]["net.1"]["numerical_rank"]
    # The resumed run logged only its own epochs.
    logged = [int(r["epoch"]) for r in _csv_rows(logger.log_dir) if r.get("rank/net.1/numerical_rank")]
    assert logged == [2, 3]


# -- 5. NaN activations ----------------------------------------------------------------------------------------------


class _Poison(nn.Module):
    """Turns its input into NaN while ``active``."""

    def __init__(self) -> None:
        super().__init__()
        self.active = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.full_like(x, math.nan) if self.active else x


class _PoisonedModel(pl.LightningModule):
    def __init__(self, poison_epoch: int) -> None:
        super().__init__()
        self.poison_epoch = poison_epoch
        self.fc = nn.Linear(8, 16)
        self.act = nn.ReLU()
        self.poison = _Poison()
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.poison(self.act(self.fc(x))))

    def training_step(self, batch, batch_idx):
        self.poison.active = False
        return nn.functional.cross_entropy(self(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx):
        self.poison.active = self.current_epoch == self.poison_epoch
        self.log("val/loss", nn.functional.cross_entropy(self(batch[0]), batch[1]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def test_nan_activations_are_logged_as_nan_with_a_warning_and_training_goes_on(tmp_path):
    torch.manual_seed(0)
    x, y = _gaussian(32, 8, seed=3, classes=3)
    monitor = ActivationRankMonitor(
        layers=["act", "poison"], metrics=["numerical_rank", "variance_ratio", "tcv"], num_classes=3, verbose=False
    )
    trainer = _trainer(tmp_path, [monitor], max_epochs=3)
    with pytest.warns(RuntimeWarning, match="layer 'poison' gave NaN or Inf activations in 2 batch\\(es\\) at epoch 1"):
        trainer.fit(_PoisonedModel(poison_epoch=1), _loader(x, y), _loader(x, y))

    assert monitor.curves.epochs == [-1, 0, 1, 2]
    history = monitor.curves.history
    assert history[1]["poison"].keys() == {
        "numerical_rank",
        "variance_ratio_1",
        "variance_ratio_10",
        "tcv",
        "spectrum_rows",
    }
    # Every metric is NaN; the count of rows behind the spectrum is still known.
    assert all(math.isnan(v) for k, v in history[1]["poison"].items() if k != "spectrum_rows")
    assert history[1]["poison"]["spectrum_rows"] == history[1]["act"]["spectrum_rows"] > 0
    for epoch in (0, 1, 2):
        assert all(math.isfinite(v) for v in history[epoch]["act"].values()), epoch
    # The sums are reset after the poisoned epoch.
    assert all(math.isfinite(v) for v in history[2]["poison"].values())
    assert history[2]["poison"]["numerical_rank"] == history[2]["act"]["numerical_rank"]
    assert trainer.global_step == 3 * 2


# -- 6. W&B offline run ----------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_offline_wandb_run_holds_the_rank_keys_and_charts(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    torch.manual_seed(0)
    model = _ConvTokenNet()
    datamodule = DigitsDataModule(batch_size=128, val_fraction=0.1)
    monitor = ActivationRankMonitor(layers=["conv", "hidden"], metrics=["numerical_rank"], verbose=False)
    logger = WandbLogger(mode="offline", save_dir=tmp_path, project="rank")
    try:
        _trainer(tmp_path, [monitor], logger=logger, max_epochs=2, limit_train_batches=2).fit(
            model, datamodule=datamodule
        )
        run_id = logger.experiment.id
    finally:
        wandb.finish()

    history = offline_run_history(tmp_path)
    for layer, metric in (("conv", "channel/numerical_rank"), ("hidden", "numerical_rank")):
        logged = [float(v) for v in history[f"rank/{layer}/{metric}"]]
        # The untrained model first (epoch -1), then the two trained epochs.
        assert logged == [monitor.curves.history[epoch][layer][metric] for epoch in (-1, 0, 1)]
    for metric in ("numerical_rank", "channel/numerical_rank"):
        for chart in ("vs_epoch", "vs_depth"):
            assert json.loads(history[f"rank_curves/{metric}_{chart}_table/_type"][-1]) == "table-file"
    assert json.loads(history["rank_curves/layers/_type"][0]) == "table-file"
    directory = tmp_path / "rank" / run_id / FIGURE_DIR
    assert json.loads((directory / "rank_curves.json").read_text())["layers"] == ["conv", "hidden"]
    assert (directory / "rank_channel_numerical_rank.png").read_bytes()[:8] == PNG_MAGIC


# -- 7. unknown layers -----------------------------------------------------------------------------------------------


class _CountingModel(_PlainModel):
    def __init__(self) -> None:
        super().__init__()
        self.steps = 0

    def training_step(self, batch, batch_idx):
        self.steps += 1
        return super().training_step(batch, batch_idx)


def test_an_unknown_layer_fails_at_setup_listing_the_valid_names(tmp_path):
    model = _CountingModel()
    x, y = _gaussian(16, 8, seed=0)
    trainer = _trainer(tmp_path, [ActivationRankMonitor(layers=["net.1", "net.9"])], num_sanity_val_steps=0)
    with pytest.raises(ValueError, match=r"unknown layer 'net\.9'; layers are: net, net\.0, net\.1, net\.2, net\.3"):
        trainer.fit(model, _loader(x, y), _loader(x, y))
    assert model.steps == 0


def test_block_names_of_package_modules_are_accepted_and_logged_by_short_name():
    from rank_lightning.modules import ImageClassifier

    model = ImageClassifier(backbone="mlp", backbone_kwargs={"depth": 2, "width": 8}, input_shape=(64,))
    assert ActivationRankMonitor(layers=["layer2"]).select(model) == {"layer2": "backbone.layers.1"}
    assert ActivationRankMonitor(layers=["layer*"]).select(model) == {
        "layer1": "backbone.layers.0",
        "layer2": "backbone.layers.1",
    }
    with pytest.raises(ValueError, match="unknown layer 'layer7'; layers are: layer1, layer2, backbone"):
        ActivationRankMonitor(layers=["layer7"]).select(model)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"stage": "test"}, r"unknown stage 'test'; valid choices are: val, train"),
        ({"conv_reduction": "token"}, r"unknown conv_reduction 'token'; valid choices are: flatten, channel"),
        ({"token_reduction": "channel"}, r"unknown token_reduction 'channel'; valid choices are: flatten, token"),
        ({"metrics": ["rank"]}, r"unknown metrics \['rank'\]; valid choices are: numerical_rank"),
        ({"every_n_epochs": 0}, "every_n_epochs must be a positive integer or None, got 0"),
        ({"max_samples": 0}, "max_samples must be a positive integer or None, got 0"),
        ({"layers": []}, "layers must be None or a non-empty list"),
        ({"soft_rank_tau": 0.0}, r"soft_rank_tau must be a positive number, got 0\.0"),
        ({"variance_ratio_ks": [0]}, r"variance_ratio_ks must be positive integers, got \[0\]"),
        ({"rank_tolerance": -1e-3}, "rank_tolerance must be a positive number or None, got -0.001"),
        ({"layer_types": ["torch.nn.Nope"]}, "layer type 'torch.nn.Nope' cannot be imported"),
    ],
)
def test_constructor_rejects_bad_settings(options, message):
    with pytest.raises(ValueError, match=message):
        ActivationRankMonitor(**options)


# -- 8. sample cap, timing, training stage, hooks, validate ---------------------------------------------------------


WIDE_INPUT = 80


class _Wide(pl.LightningModule):
    """A 64-wide linear layer on 80 features: its activations have rank min(N, 64) for N Gaussian inputs."""

    def __init__(self, lr: float = 0.0) -> None:
        super().__init__()
        self.lr = lr
        self.wide = nn.Linear(WIDE_INPUT, 64)
        self.head = nn.Linear(64, 4)

    def forward(self, x):
        return self.head(torch.relu(self.wide(x)))

    def training_step(self, batch, batch_idx):
        return nn.functional.cross_entropy(self(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", nn.functional.cross_entropy(self(batch[0]), batch[1]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def test_max_samples_caps_the_inputs_per_epoch(tmp_path):
    torch.manual_seed(0)
    model = _Wide()
    x, y = _gaussian(96, WIDE_INPUT, seed=4)
    monitor = ActivationRankMonitor(layers=["wide"], max_samples=50, num_classes=4, verbose=False)
    trainer = _trainer(tmp_path, [monitor])
    (results,) = trainer.validate(model, _loader(x, y, batch_size=16), verbose=False)

    outputs, labels = _collect(model, ["wide"], _loader(x, y))
    # 50 rows spread over the six batches of 16: 9, 9, 8, 8, 8, 8 first rows of each.
    rows = torch.cat([torch.arange(16 * b, 16 * b + take) for b, take in enumerate([9, 9, 8, 8, 8, 8])])
    capped = _reference(outputs["wide"][rows], labels[rows], num_classes=4)
    assert capped["numerical_rank"] == 50
    assert _reference(outputs["wide"], labels, num_classes=4)["numerical_rank"] == 64
    _assert_close({k.removeprefix("rank/wide/"): v for k, v in results.items() if k.startswith("rank/")}, capped)


class _HookProbe(pl.Callback):
    """Counts the forward hooks on the watched modules at every batch start."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.val: list[tuple[int, bool, int]] = []
        self.train: list[int] = []

    def _count(self, pl_module) -> int:
        return sum(len(pl_module.get_submodule(name)._forward_hooks) for name in self.names)

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        self.val.append((trainer.current_epoch, trainer.sanity_checking, self._count(pl_module)))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.train.append(self._count(pl_module))


def test_every_n_epochs_and_hooks_exist_only_while_an_epoch_is_monitored(tmp_path):
    torch.manual_seed(0)
    model = _Wide(lr=0.01)
    x, y = _gaussian(32, WIDE_INPUT, seed=5)
    monitor = ActivationRankMonitor(
        layers=["wide", "head"], metrics=["numerical_rank"], every_n_epochs=2, verbose=False
    )
    probe = _HookProbe(["wide", "head"])
    trainer = _trainer(tmp_path, [monitor, probe], max_epochs=4, num_sanity_val_steps=1)
    trainer.fit(model, _loader(x, y), _loader(x, y))

    assert monitor.curves.epochs == [-1, 1, 3]
    assert probe.val[0] == (0, True, 0)  # sanity check: not monitored
    assert [(epoch, hooks) for epoch, sanity, hooks in probe.val[1:]] == [
        (epoch, 2 if epoch % 2 else 0) for epoch in range(4) for _ in range(2)
    ]
    assert set(probe.train) == {0}
    assert all(not module._forward_hooks for module in model.modules())
    outputs, _ = _collect(model, ["wide"], _loader(x, y))
    assert float(trainer.callback_metrics["rank/wide/numerical_rank"]) == 32
    assert _reference(outputs["wide"])["numerical_rank"] == 32


def test_training_stage_measures_training_batches_only(tmp_path):
    torch.manual_seed(0)
    model = _Wide(lr=0.0)  # frozen weights: the training activations can be recomputed afterwards
    x_train, y_train = _gaussian(40, WIDE_INPUT, seed=6)
    x_val, y_val = _gaussian(48, WIDE_INPUT, seed=7)
    monitor = ActivationRankMonitor(
        layers=["wide"], stage="train", metrics=["numerical_rank", "participation_ratio"], verbose=False
    )
    trainer = _trainer(tmp_path, [monitor], num_sanity_val_steps=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, _loader(x_train, y_train, batch_size=8), _loader(x_val * 10, y_val, batch_size=8))
    # Not even a "runs more than once" warning: validation forward passes never reach the hooks. The one warning
    # says that 40 training rows (all there are: max_samples is not the limit) cap the ranks of a wider layer.
    messages = [str(w.message) for w in caught if "ActivationRankMonitor" in str(w.message)]
    assert messages == [
        "ActivationRankMonitor: layer 'wide' was measured on 40 rows, fewer than its 64 features: its "
        "ranks are at most 40 (measure more batches to measure more rows)."
    ]

    outputs, _ = _collect(model, ["wide"], _loader(x_train, y_train))
    expected = _reference(outputs["wide"])
    logged = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith(("rank", "rank_train"))}
    assert logged.keys() == {
        "rank_train/wide/numerical_rank",
        "rank_train/wide/participation_ratio",
        "rank_train/wide/spectrum_rows",
    }
    assert logged["rank_train/wide/spectrum_rows"] == 40
    assert logged["rank_train/wide/numerical_rank"] == expected["numerical_rank"] == 40
    assert logged["rank_train/wide/participation_ratio"] == pytest.approx(expected["participation_ratio"], rel=2e-6)
    assert (tmp_path / FIGURE_DIR / "rank_train_curves.json").is_file()
    assert all(not module._forward_hooks for module in model.modules())


def test_sequence_first_token_layers_are_read_batch_first(tmp_path):
    layer = nn.TransformerEncoderLayer(d_model=8, nhead=2, dim_feedforward=16, dropout=0.0)  # (T, B, D) layout

    class SequenceFirst(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = layer

        def forward(self, x):
            return self.encoder(x.transpose(0, 1))

        def validation_step(self, batch, batch_idx):
            self(batch[0])

    torch.manual_seed(0)
    x = torch.randn(24, 5, 8)  # 24 sequences of 5 tokens
    model = SequenceFirst()
    monitor = ActivationRankMonitor(layers=["encoder"], max_samples=6, metrics=["participation_ratio"], verbose=False)
    (results,) = _trainer(tmp_path, [monitor]).validate(model, _loader(x, torch.zeros(24), batch_size=4), verbose=False)
    with torch.no_grad():
        # Six sequences spread over the six batches of four: the first of each.
        tokens = model.eval()(x).transpose(0, 1)[::4].reshape(-1, 8).double().numpy()
    s2 = np.linalg.svd(tokens, compute_uv=False) ** 2
    expected = s2.sum() ** 2 / (s2**2).sum()
    assert results["rank/encoder/token/participation_ratio"] == pytest.approx(expected, rel=2e-6)


class _TokenConv(nn.Module):
    """A Conv1d over the positions of tokens (B, L, D) that returns tokens (B, L, D), as positional convolutions do."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv = nn.Conv1d(width, width, 3, padding=1)

    def forward(self, tokens):
        return self.conv(tokens.transpose(1, 2)).transpose(1, 2)


class _Conv1dNet(pl.LightningModule):
    """Embedded tokens through nn.Conv1d layers: conv maps (B, C, L), channels before positions, then a Linear on
    tokens (B, L, D) whose layout is the other one."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 8)
        self.conv = nn.Conv1d(8, 6, 3, padding=1)  # 6 channels at 10 positions
        self.block = nn.Sequential(nn.Conv1d(6, 6, 3, padding=1, groups=2), nn.BatchNorm1d(6), nn.ReLU())
        self.proj = nn.Linear(6, 4)
        self.smooth = _TokenConv(4)
        self.head = nn.Linear(4, 3)

    def forward(self, ids):
        maps = self.block(self.conv(self.embed(ids).transpose(1, 2)))
        return self.head(self.smooth(self.proj(maps.transpose(1, 2))).mean(1))

    def validation_step(self, batch, batch_idx):
        self(batch[0])


@pytest.mark.parametrize("conv_reduction", ["channel", "mean", "flatten"])
def test_conv1d_maps_are_reduced_as_conv_maps_not_as_tokens(tmp_path, conv_reduction):
    # A (B, C, L) Conv1d output read as tokens would take its C channels as tokens of L features (rank at most L).
    torch.manual_seed(0)
    model = _Conv1dNet()
    ids, labels = torch.randint(0, 20, (24, 10)), torch.arange(24) % 3
    loader = _loader(ids, labels, batch_size=8)
    layers = ["conv", "block", "block.2", "proj", "smooth"]
    monitor = ActivationRankMonitor(
        layers=layers, conv_reduction=conv_reduction, max_samples=None, num_classes=3, verbose=False
    )
    (results,) = _trainer(tmp_path, [monitor]).validate(model, loader, verbose=False)

    outputs, row_labels = _collect(model, layers, loader)
    expected = {}
    for name in layers:
        output = outputs[name]
        if name in ("proj", "smooth"):  # tokens (B, L, 4), the second a Conv1d's maps transposed back
            x, prefix = reduce_activations(output, "token"), "token/"
        else:
            assert output.shape == (24, 6, 10)
            x, prefix = reduce_activations(output.unsqueeze(-1), conv_reduction), f"{conv_reduction}/"
        for metric, value in _reference(x, row_labels.repeat_interleave(x.shape[0] // 24), num_classes=3).items():
            expected[f"rank/{name}/{prefix}{metric}"] = value
    if conv_reduction == "channel":
        assert expected["rank/conv/channel/spectrum_rows"] == 240  # every position of every input: 6 features
        assert expected["rank/conv/channel/numerical_rank"] == 6
    _assert_close({k: float(v) for k, v in results.items() if k.startswith("rank/")}, expected)


def test_the_layout_of_a_conv1d_map_comes_from_the_module():
    from rank_lightning.layers import channel_first_layers

    model = _Conv1dNet()
    layers = {name: name for name in ["conv", "block", "block.0", "block.1", "block.2", "proj", "embed", "smooth"]}
    # Each with the channels of its last 1-d conv or norm layer: the stream reads (B, L, C) of "smooth" as tokens.
    expected = {"conv": 6, "block": 6, "block.0": 6, "block.1": 6, "block.2": 6, "smooth": 4}
    assert channel_first_layers(model, layers) == expected
    mixed = nn.Sequential(nn.Conv1d(4, 4, 1), nn.Linear(4, 4), nn.GELU())  # a token layer inside: not a conv map
    assert channel_first_layers(mixed, {"all": "", "act": "2", "conv": "0"}) == {"conv": 4}
    # Activations follow the layer before them: those after a Conv1d give conv maps, the Linear's tokens.
    plain = nn.Sequential(nn.Conv1d(4, 8, 1), nn.ReLU(), nn.MaxPool1d(2), nn.Tanh(), nn.Linear(5, 5), nn.Tanh())
    assert channel_first_layers(plain, {str(i): str(i) for i in range(6)}) == {"0": 8, "1": 8, "2": None, "3": 8}


class _DictBatches(_Wide):
    def validation_step(self, batch, batch_idx):
        self(batch["image"])


class _DictDataset(torch.utils.data.Dataset):
    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"image": self.x[i], "target": self.y[i]}


@pytest.mark.parametrize(
    ("options", "num_classes", "relabel"),
    [({}, 4, lambda y: y), ({"label_fn": lambda batch: batch["target"] // 2}, 2, lambda y: y // 2)],
    ids=["target_key", "label_fn"],
)
def test_labels_are_found_in_dict_batches(tmp_path, options, num_classes, relabel):
    torch.manual_seed(0)
    model = _DictBatches()
    x, y = _gaussian(40, WIDE_INPUT, seed=8)
    monitor = ActivationRankMonitor(
        layers=["wide"], metrics=["tcv", "tcv_normalized"], num_classes=num_classes, verbose=False, **options
    )
    loader = torch.utils.data.DataLoader(_DictDataset(x, y), batch_size=16)
    (results,) = _trainer(tmp_path, [monitor]).validate(model, loader, verbose=False)
    outputs, labels = _collect(model, ["wide"], _loader(x, y))
    expected = _reference(outputs["wide"], relabel(labels), num_classes=num_classes)
    assert results["rank/wide/tcv"] == pytest.approx(expected["tcv"], rel=2e-6)
    assert results["rank/wide/tcv_normalized"] == pytest.approx(expected["tcv_normalized"], rel=2e-6)


# -- 9. token layout, spread sampling, uncalled layers, labels, initial point -----------------------------------------


class _Tokens(pl.LightningModule):
    """A module whose (B, T, D) inputs reach the monitored layer as (T, B, D)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x.transpose(0, 1))

    def validation_step(self, batch, batch_idx):
        self(batch[0])


class _SequenceFirstLinear(nn.Module):
    """A plain linear map on (T, B, D) tokens: nothing in it declares a layout."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return self.proj(x)


def _token_reference(model: nn.Module, x: torch.Tensor) -> float:
    with torch.no_grad():
        tokens = model.eval()(x).transpose(0, 1).reshape(-1, 8).double()
    return float(participation_ratio(tokens))


@pytest.mark.parametrize("declared", [True, False], ids=["batch_first_flag", "token_layout_argument"])
def test_sequence_first_tokens_are_read_right_when_the_sequence_is_as_long_as_the_batch(tmp_path, declared):
    torch.manual_seed(0)
    if declared:
        inner = nn.TransformerEncoderLayer(d_model=8, nhead=2, dim_feedforward=16, dropout=0.0)  # batch_first=False
        options = {}
    else:
        inner = _SequenceFirstLinear()
        options = {"token_layout": "sequence_first"}
    model = _Tokens(inner)
    x = torch.randn(12, 4, 8)  # 12 sequences of 4 tokens, batches of 4: T == B in every batch
    monitor = ActivationRankMonitor(
        layers=["inner"], max_samples=None, metrics=["participation_ratio"], verbose=False, **options
    )
    (results,) = _trainer(tmp_path, [monitor]).validate(model, _loader(x, torch.zeros(12), batch_size=4), verbose=False)
    assert results["rank/inner/token/participation_ratio"] == pytest.approx(_token_reference(model, x), rel=2e-6)


def test_a_token_layout_the_shapes_cannot_tell_is_never_guessed(tmp_path):
    torch.manual_seed(0)
    model = _Tokens(_SequenceFirstLinear())
    x = torch.randn(8, 4, 8)
    monitor = ActivationRankMonitor(layers=["inner"], max_samples=None, metrics=["participation_ratio"], verbose=False)
    with pytest.warns(UserWarning, match=r"layer 'inner' gives \(4, 4, 8\) with the batch size 4 in both leading"):
        (results,) = _trainer(tmp_path, [monitor]).validate(
            model, _loader(x, torch.zeros(8), batch_size=4), verbose=False
        )
    assert not [key for key in results if key.startswith("rank/")]


def _class_sorted(n_per_class: int, classes: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, _ = _gaussian(n_per_class * classes, WIDE_INPUT, seed=seed)
    y = torch.arange(classes).repeat_interleave(n_per_class)
    return x + 3.0 * y[:, None].float(), y


def test_max_samples_spreads_over_a_class_sorted_loader(tmp_path):
    torch.manual_seed(0)
    model = _Wide()
    x, y = _class_sorted(16, 4, seed=11)  # 64 rows sorted by class, 8 batches of 8
    monitor = ActivationRankMonitor(layers=["wide"], max_samples=16, num_classes=4, verbose=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        (results,) = _trainer(tmp_path, [monitor]).validate(model, _loader(x, y, batch_size=8), verbose=False)
    messages = [str(w.message) for w in caught if "ActivationRankMonitor" in str(w.message)]
    assert len(messages) == 1 and "measured on 16 rows, fewer than its" in messages[0]  # no class is missing
    outputs, labels = _collect(model, ["wide"], _loader(x, y))
    rows = torch.cat([torch.arange(8 * b, 8 * b + 2) for b in range(8)])  # two rows of each batch
    assert sorted(set(labels[rows].tolist())) == [0, 1, 2, 3]
    expected = _reference(outputs["wide"][rows], labels[rows], num_classes=4)
    _assert_close({k.removeprefix("rank/wide/"): v for k, v in results.items() if k.startswith("rank/")}, expected)


def test_classes_missing_from_the_measured_rows_are_named(tmp_path):
    torch.manual_seed(0)
    model = _Wide()
    x, y = _class_sorted(16, 4, seed=12)
    monitor = ActivationRankMonitor(layers=["wide"], max_samples=2, num_classes=4, verbose=False)
    with pytest.warns(UserWarning, match=r"layer 'wide' saw no rows of classes \[1, 2, 3\] among the 2 measured"):
        _trainer(tmp_path, [monitor]).validate(model, _loader(x, y, batch_size=8), verbose=False)


def test_many_missing_classes_are_counted_and_expected_of_a_vocabulary(tmp_path):
    torch.manual_seed(0)
    x, y = _class_sorted(16, 4, seed=12)
    monitor = ActivationRankMonitor(layers=["wide"], num_classes=30, verbose=False)  # classes 4-29 never occur
    shown = ", ".join(map(str, range(4, 14)))
    message = (
        rf"saw no rows of classes \[{shown}, \.\.\.\] among the 64 measured \(26 of its 30 classes\); TCV and "
        r"class-wise VR cover the others only \(raise max_samples or shuffle the loader; with the tokens of a "
        r"vocabulary as classes, most are expected to be absent\)"
    )
    with pytest.warns(UserWarning, match=message):
        _trainer(tmp_path, [monitor]).validate(_Wide(), _loader(x, y, batch_size=8), verbose=False)


class _Blocks(_Wide):
    """``wide`` again, and two blocks in a ModuleList that the forward pass calls one by one."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(64, 64), nn.Linear(64, 64)])

    def forward(self, x):
        h = self.wide(x)
        for block in self.blocks:
            h = torch.relu(block(h))
        return self.head(h)


def test_a_chosen_layer_that_is_never_called_is_named_in_a_warning(tmp_path):
    torch.manual_seed(0)
    x, y = _gaussian(16, WIDE_INPUT, seed=13)
    monitor = ActivationRankMonitor(layers=["blocks", "blocks.1"], metrics=["numerical_rank"], verbose=False)
    with pytest.warns(UserWarning, match=r"layer 'blocks' \(blocks\) was not called in the forward pass"):
        (results,) = _trainer(tmp_path, [monitor]).validate(_Blocks(), _loader(x, y), verbose=False)
    assert [key for key in results if key.startswith("rank/")] == [
        "rank/blocks.1/numerical_rank",
        "rank/blocks.1/spectrum_rows",
    ]


class _DictWide(_Wide):
    def validation_step(self, batch, batch_idx):
        self(batch["x"])


class _Dicts(torch.utils.data.Dataset):
    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "cls": self.y[i]}


def test_labels_that_cannot_be_found_are_reported(tmp_path):
    torch.manual_seed(0)
    x, y = _gaussian(16, WIDE_INPUT, seed=14)
    loader = torch.utils.data.DataLoader(_Dicts(x, y), batch_size=8)
    quiet = ActivationRankMonitor(layers=["wide"], num_classes=4, verbose=False)
    with pytest.warns(UserWarning, match=r"num_classes=4 but no class labels at .*'y', 'label'.*keys \['x', 'cls'\]"):
        (results,) = _trainer(tmp_path, [quiet]).validate(_DictWide(), loader, verbose=False)
    assert "rank/wide/tcv" not in results and "rank/wide/numerical_rank" in results
    explicit = ActivationRankMonitor(layers=["wide"], num_classes=4, label_key="label", verbose=False)
    with pytest.raises(ValueError, match="'label'"):
        _trainer(tmp_path, [explicit]).validate(_DictWide(), loader, verbose=False)
    found = ActivationRankMonitor(layers=["wide"], num_classes=4, label_key="cls", verbose=False)
    (results,) = _trainer(tmp_path, [found]).validate(_DictWide(), loader, verbose=False)
    assert "rank/wide/tcv" in results


def test_the_untrained_model_is_the_first_point_of_the_curves(tmp_path):
    torch.manual_seed(0)
    model = _Wide(lr=0.05)
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    x, y = _gaussian(32, WIDE_INPUT, seed=15, classes=4)
    activations = ActivationRankMonitor(layers=["wide"], metrics=["participation_ratio"], verbose=False)
    weights = WeightRankMonitor(layers=["wide"], metrics=["stable_rank"], verbose=False)
    recorder = RecordingLogger()
    _trainer(tmp_path, [activations, weights], max_epochs=2, logger=recorder).fit(model, _loader(x, y), _loader(x, y))
    assert activations.curves.epochs == weights.curves.epochs == [-1, 0, 1]

    untrained = _Wide()
    untrained.load_state_dict(initial)
    outputs, _ = _collect(untrained, ["wide"], _loader(x, y))
    initial_r = float(participation_ratio(outputs["wide"]))
    assert activations.curves.history[-1]["wide"]["participation_ratio"] == pytest.approx(initial_r, rel=1e-9)
    assert weights.curves.history[-1]["wide"]["stable_rank"] == pytest.approx(
        float(stable_rank(initial["wide.weight"])), rel=1e-9
    )
    sent = [metrics for step, metrics in recorder.calls if metrics.get("epoch") == -1]
    assert any("rank/wide/participation_ratio" in m for m in sent) and any("weight/wide/stable_rank" in m for m in sent)
    trained_r = activations.curves.history[1]["wide"]["participation_ratio"]
    assert trained_r != pytest.approx(initial_r, rel=1e-6)


def test_a_validation_before_fit_is_the_initial_point_and_is_kept(tmp_path):
    torch.manual_seed(0)
    x, y = _gaussian(32, WIDE_INPUT, seed=16)
    monitor = ActivationRankMonitor(layers=["wide"], metrics=["participation_ratio"], verbose=False)
    trainer = _trainer(tmp_path, [monitor], max_epochs=1)
    model = _Wide(lr=0.05)
    (before,) = trainer.validate(model, _loader(x, y), verbose=False)
    trainer.fit(model, _loader(x, y), _loader(x, y))
    assert monitor.curves.epochs == [-1, 0]
    initial = monitor.curves.history[-1]["wide"]["participation_ratio"]
    assert before["rank/wide/participation_ratio"] == pytest.approx(initial, rel=1e-6)
    assert monitor.curves.history[0]["wide"]["participation_ratio"] != pytest.approx(initial, rel=1e-6)


def test_an_initial_point_that_cannot_be_measured_is_reported_and_training_goes_on(tmp_path):
    class TwoInputs(_Wide):
        """A forward pass that needs more than the batch's inputs: the initial pass cannot call it."""

        def forward(self, x, scale):
            return super().forward(x * scale)

        def training_step(self, batch, batch_idx):
            return nn.functional.cross_entropy(self(batch[0], 1.0), batch[1])

        def validation_step(self, batch, batch_idx):
            self(batch[0], 1.0)

    torch.manual_seed(0)
    x, y = _gaussian(16, WIDE_INPUT, seed=17)
    monitor = ActivationRankMonitor(layers=["wide"], metrics=["numerical_rank"], verbose=False)
    with pytest.warns(UserWarning, match=r"ActivationRankMonitor: no initial point: the forward pass .*TypeError"):
        _trainer(tmp_path, [monitor], max_epochs=1).fit(TwoInputs(lr=0.01), _loader(x, y), _loader(x, y))
    assert monitor.curves.epochs == [0]


def test_alpha_req_is_logged_when_asked_for(tmp_path):
    torch.manual_seed(0)
    model = _Wide()
    x, y = _gaussian(96, WIDE_INPUT, seed=21)
    monitor = ActivationRankMonitor(layers=["wide"], metrics=["numerical_rank", "alpha_req"], verbose=False)
    (results,) = _trainer(tmp_path, [monitor]).validate(model, _loader(x, y), verbose=False)

    outputs, _ = _collect(model, ["wide"], _loader(x, y))
    assert float(results["rank/wide/alpha_req"]) == pytest.approx(float(alpha_req(outputs["wide"].double())), rel=1e-6)
    assert "alpha_req" not in ActivationRankMonitor(verbose=False).metrics  # off by default


def test_alpha_req_over_a_chosen_range_of_centred_activations(tmp_path):
    # Agrawal et al. fit the covariance eigenvalues of ranks 11 to 100; the monitor had no range option.
    torch.manual_seed(0)
    model = _Wide()
    x, y = _gaussian(96, WIDE_INPUT, seed=21)
    options = {"layers": ["wide"], "metrics": ["alpha_req"], "verbose": False, "center": True}
    monitor = ActivationRankMonitor(alpha_req_range=(3, 12), **options)
    (results,) = _trainer(tmp_path, [monitor]).validate(model, _loader(x, y), verbose=False)

    outputs, _ = _collect(model, ["wide"], _loader(x, y))
    expected = float(alpha_req(outputs["wide"].double(), first_index=3, last_index=12, center=True))
    assert float(results["rank/wide/alpha_req"]) == pytest.approx(expected, rel=1e-9)
    assert expected != pytest.approx(float(alpha_req(outputs["wide"].double(), center=True)), rel=1e-3)
    with pytest.raises(ValueError, match=r"alpha_req_range must have last_index > first_index, got \(12, 3\)"):
        ActivationRankMonitor(alpha_req_range=(12, 3))


@pytest.mark.parametrize("center", ["both", "no", 1])
def test_center_is_a_bool(center):
    # center="both" (an ActivationSpectrum choice) was accepted and gave only the centred values under the plain keys.
    with pytest.raises(ValueError, match=rf"unknown center {center!r}; valid choices are: False, True"):
        ActivationRankMonitor(center=center)
