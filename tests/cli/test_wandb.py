"""The README's W&B command lines, run as written: offline, twice in a row, with no network and no account."""

import os
import shlex
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml
from pytorch_lightning.loggers import Logger

from rank_lightning.cli import main

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
QUICKSTART = str(ROOT / "configs/quickstart.yaml")
FAST = ["--trainer.max_epochs=1", "--trainer.limit_train_batches=2", "--trainer.limit_val_batches=2"]


class RunIdLogger(Logger):
    """A logger shaped like W&B's: no ``log_dir``; every run is a new id under ``<save_dir>/<name>/``."""

    def __init__(self, save_dir: str = "runs") -> None:
        super().__init__()
        self._save_dir = save_dir
        self._id = uuid.uuid4().hex[:8]

    @property
    def name(self) -> str:
        return "project"

    @property
    def version(self) -> str:
        return self._id

    @property
    def save_dir(self) -> str:
        return self._save_dir

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        pass

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


def _readme_wandb_commands() -> list[list[str]]:
    section = README.split("\n## Weights & Biases\n", 1)[1].split("\n## ", 1)[0]
    return [shlex.split(line) for line in section.splitlines() if line.startswith("python train.py ")]


def _in_repository(args: list[str]) -> list[str]:
    """The README's arguments with the repository's relative paths made absolute, to run from another folder."""
    return [str(ROOT / a) if a.startswith("configs/") else a for a in args]


def test_the_readme_offline_switch_sets_the_wandb_logger_mode(capsys):
    [online, offline] = _readme_wandb_commands()
    assert offline[: len(online)] == online
    with pytest.raises(SystemExit) as exit_info:
        main([*_in_repository(offline[2:]), "--print_config"])
    assert exit_info.value.code in (0, None)
    loggers = yaml.safe_load(capsys.readouterr().out)["trainer"]["logger"]
    [wandb] = [logger for logger in loggers if logger["class_path"].endswith("WandbLogger")]
    assert wandb["init_args"]["mode"] == "offline"
    assert wandb["init_args"]["name"] is None


def test_runs_of_a_logger_without_a_versioned_folder_keep_their_own_config(tmp_path, monkeypatch):
    # Lightning's own config callback writes to the logger's save_dir, the same for every run, and refuses the second.
    monkeypatch.chdir(tmp_path)
    for _ in range(2):
        main(["fit", "--config", QUICKSTART, f"--trainer.logger={__name__}.RunIdLogger", *FAST])
    runs = sorted((tmp_path / "runs" / "project").iterdir())
    assert len(runs) == 2
    assert all((run / "config.yaml").is_file() and (run / "checkpoints" / "last.ckpt").is_file() for run in runs)


@pytest.mark.slow
def test_the_readme_offline_command_runs_twice_in_a_row(tmp_path):
    [_, offline] = _readme_wandb_commands()
    assert offline[:2] == ["python", "train.py"]
    # Nothing from the environment may switch W&B off or offline: the README's switch alone must.
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update({f"WANDB_{kind}_DIR": str(tmp_path / "wandb_home") for kind in ("CONFIG", "CACHE", "DATA")})
    env["PYTHONPATH"] = str(ROOT)
    for _ in range(2):
        result = subprocess.run(
            [sys.executable, str(ROOT / "train.py"), *_in_repository(offline[2:]), *FAST],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert result.returncode == 0, result.stderr[-4000:]
    assert len(list((tmp_path / "runs" / "wandb").glob("offline-run-*/*.wandb"))) == 2
    configs = sorted((tmp_path / "runs").rglob("config*.yaml"))
    assert [p.relative_to(tmp_path / "runs").as_posix() for p in configs] == [
        "csv/version_0/config.yaml",
        "csv/version_1/config.yaml",
    ]
    for config in configs:
        assert (config.parent / "checkpoints" / "last.ckpt").is_file()
        loggers = yaml.safe_load(config.read_text())["trainer"]["logger"]
        assert [logger["init_args"].get("mode") for logger in loggers] == [None, "offline"]


def test_the_wandb_save_dir_exists_before_the_run_starts(tmp_path, monkeypatch):
    # W&B 0.17 writes a run whose save_dir does not exist yet to the system's temporary folder (/tmp/wandb/): the
    # first offline run of the README's command landed there instead of in runs/wandb/.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    wandb_overlay = str(ROOT / "configs/loggers/wandb.yaml")
    cli = main(["--config", QUICKSTART, "--config", wandb_overlay, *FAST], run=False)
    [logger] = [logger for logger in cli.trainer.loggers if type(logger).__name__ == "WandbLogger"]
    assert logger.save_dir == "runs"
    assert (tmp_path / "runs").is_dir()
    assert not (tmp_path / "runs" / "wandb").exists()  # no experiment started yet
