"""The callbacks in a user's own LightningCLI: every setting parses from YAML and the command line, and the config
the CLI saves gives the same callbacks back."""

import inspect
import shlex
import sys
import types
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
import yaml
from pytorch_lightning.cli import LightningCLI
from torch import nn

from rank_lightning import callbacks

MONITOR = "--trainer.callbacks+=rank_lightning.callbacks.ActivationRankMonitor"


class UserModel(pl.LightningModule):
    """A module of the user's own, nothing taken from the package."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 2))

    def training_step(self, batch, batch_idx):
        return nn.functional.cross_entropy(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def user_cli(*args: str) -> LightningCLI:
    """The user's CLI on ``args``, classes instantiated, nothing run."""
    return LightningCLI(UserModel, args=["--trainer.logger=false", *args], run=False)


def test_mask_key_false_survives_the_saved_config(tmp_path):
    cli = user_cli(MONITOR, "--trainer.callbacks.mask_key=false")
    assert cli.trainer.callbacks[0].batch_reader.mask_key is False  # not the key 'false'
    saved = tmp_path / "config.yaml"
    saved.write_text(cli.parser.dump(cli.config, skip_none=False))  # as SaveConfigCallback writes it
    assert "mask_key: false\n" in saved.read_text()
    restarted = user_cli("--config", str(saved))
    assert restarted.trainer.callbacks[0].batch_reader.mask_key is False
    assert user_cli(MONITOR, "--trainer.callbacks.mask_key=0").trainer.callbacks[0].batch_reader.mask_key == 0


def labels_of(batch):
    """A user's label function, without a return annotation, as most are written."""
    return batch[1]


def test_label_fn_is_a_functions_import_path_in_yaml(tmp_path):
    config = tmp_path / "callbacks.yaml"
    config.write_text(
        "trainer:\n  callbacks:\n"
        "    - class_path: rank_lightning.callbacks.NeuralCollapseMonitor\n"
        f"      init_args: {{label_fn: {__name__}.labels_of}}\n"
    )
    cli = user_cli("--config", str(config))
    assert cli.trainer.callbacks[0].reader.label_fn is labels_of
    saved = tmp_path / "config.yaml"
    saved.write_text(cli.parser.dump(cli.config, skip_none=False))
    assert f"label_fn: {__name__}.labels_of\n" in saved.read_text()
    assert user_cli("--config", str(saved)).trainer.callbacks[0].reader.label_fn is labels_of


def test_a_lightning_pytorch_cli_takes_the_callbacks():
    lightning = pytest.importorskip("lightning.pytorch")
    cli_module = pytest.importorskip("lightning.pytorch.cli")

    class LightningUserModel(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(4, 2)

    arguments = ["--trainer.callbacks+=rank_lightning.callbacks.WeightRankMonitor"]
    arguments += ["--trainer.callbacks.every_n_epochs=2", "--trainer.logger=false"]
    cli = cli_module.LightningCLI(LightningUserModel, args=arguments, run=False)
    monitor = cli.trainer.callbacks[0]
    assert type(monitor).__name__ == "WeightRankMonitor" and monitor.every_n_epochs == 2


def test_every_argument_of_every_callback_parses_and_survives_the_saved_config(tmp_path):
    config = Path(__file__).with_name("user_callbacks.yaml")
    given = yaml.safe_load(config.read_text())["trainer"]["callbacks"]
    classes = {entry["class_path"].rpartition(".")[2]: entry["init_args"] for entry in given}
    helpers = {"Cadence", "CurveMonitor", "LayerCurves", "RankCallback"}  # bases and parts, not callbacks to add
    assert set(classes) == set(callbacks.__all__) - helpers
    for name, arguments in classes.items():
        assert set(arguments) == set(inspect.signature(getattr(callbacks, name)).parameters), name
    cli = user_cli("--config", str(config))
    assert [type(c).__name__ for c in cli.trainer.callbacks[: len(classes)]] == list(classes)
    saved = tmp_path / "config.yaml"
    saved.write_text(cli.parser.dump(cli.config, skip_none=False))
    restarted = user_cli("--config", str(saved))
    assert restarted.parser.dump(restarted.config, skip_none=False) == saved.read_text()
    printed = yaml.safe_load(saved.read_text())["trainer"]["callbacks"][: len(classes)]
    assert {entry["class_path"].rpartition(".")[2]: entry["init_args"] for entry in printed} == classes


def test_the_readmes_config_and_command_line_build_their_callbacks(tmp_path, monkeypatch):
    # README's "In a LightningCLI of your own": its config, then its command line after that config.
    readme = (Path(__file__).parents[2] / "README.md").read_text().split("In a `LightningCLI` of your own")[1]
    config, command = (readme.split(f"```{language}\n")[1].split("```")[0] for language in ("yaml", "bash"))
    (tmp_path / "config.yaml").write_text(config)
    monkeypatch.chdir(tmp_path)
    package, data = types.ModuleType("mypackage"), types.ModuleType("mypackage.data")
    data.labels = labels_of
    monkeypatch.setitem(sys.modules, "mypackage", package)
    monkeypatch.setitem(sys.modules, "mypackage.data", data)
    words = shlex.split(command.replace("\\\n", " "))
    assert words[:3] == ["python", "main.py", "fit"]
    cli = user_cli(*words[3:])
    built = cli.trainer.callbacks[:3]
    assert [type(c).__name__ for c in built] == ["ActivationRankMonitor", "WeightRankMonitor", "NeuralCollapseMonitor"]
    assert built[0].batch_reader.label_fn is labels_of and built[0].num_classes == 10
    assert built[2].every_n_epochs == 5
