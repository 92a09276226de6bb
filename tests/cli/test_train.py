"""The command line, end to end: every config parses, the quickstart trains, DDP fits."""

import csv
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rank_lightning.cli import main
from rank_lightning.data import create_datamodule, list_datamodules
from rank_lightning.data.base import get_datamodule_class
from rank_lightning.modules import ImageClassifier
from tests.cli.test_checkpoints import PARTIAL_CONFIGS
from tests.data.test_folder import write_folder

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted(p for p in (ROOT / "configs").rglob("*.yaml") if not {"loggers", "overlays", "sweeps"} & set(p.parts))


def _run_train(args: list[str], cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), WANDB_MODE="disabled")
    # Left over from a distributed run in this process, these would make the script wait for processes it must start.
    for name in ("LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        env.pop(name, None)
    return subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _last_metrics(run_dir: Path) -> dict[str, float]:
    """Last non-empty value of every column of a CSVLogger's metrics.csv."""
    [metrics_file] = run_dir.rglob("metrics.csv")
    last: dict[str, float] = {}
    with open(metrics_file) as f:
        for row in csv.DictReader(f):
            last.update({k: float(v) for k, v in row.items() if v not in ("", None)})
    return last


def test_configs_exist():
    names = {p.stem for p in CONFIGS}
    assert {"quickstart"} <= names
    assert len(CONFIGS) >= 5


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: str(p.relative_to(ROOT / "configs")))
def test_print_config(config, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(config), "--print_config"])
    assert exit_info.value.code in (0, None)
    assert "class_path" in capsys.readouterr().out


def test_wandb_switch_parses(capsys):
    with pytest.raises(SystemExit):
        main(
            [
                "fit",
                "--config",
                str(ROOT / "configs/quickstart.yaml"),
                "--config",
                str(ROOT / "configs/loggers/wandb.yaml"),
                "--print_config",
            ]
        )
    assert "WandbLogger" in capsys.readouterr().out


def test_two_lr_overlay_adds_the_layer_before_the_last_block(capsys):
    with pytest.raises(SystemExit):
        main(
            [
                "fit",
                "--config",
                str(ROOT / "configs/lr_layer_resnet18_cifar10.yaml"),
                "--config",
                str(ROOT / "configs/overlays/lr_layer_resnet18_2lr.yaml"),
                "--print_config",
            ]
        )
    out = capsys.readouterr().out
    assert "before: layer4" in out and "rank: 1000" in out and "before: head" in out


def _printed_config(capsys, *configs: str) -> dict:
    """The config ``fit`` resolves from ``configs`` (names under configs/, in order), as ``--print_config`` shows it."""
    with pytest.raises(SystemExit):
        main(
            [
                "fit",
                *(arg for config in configs for arg in ("--config", str(ROOT / "configs" / config))),
                "--print_config",
            ]
        )
    return yaml.safe_load(capsys.readouterr().out)


@pytest.mark.parametrize("overlay", [name for name in PARTIAL_CONFIGS if name.startswith("overlays/")])
def test_an_overlay_keeps_the_loggers_of_its_base_config(overlay, capsys):
    # A logger list in a later config replaces the earlier one: an overlay that gave only a CSVLogger dropped the
    # base config's TensorBoard logger.
    base = _printed_config(capsys, PARTIAL_CONFIGS[overlay])["trainer"]["logger"]
    composed = _printed_config(capsys, PARTIAL_CONFIGS[overlay], overlay)["trainer"]["logger"]
    assert [logger["class_path"] for logger in composed] == [logger["class_path"] for logger in base]


def test_the_two_lr_overlay_logs_under_its_own_name(capsys):
    config = _printed_config(capsys, "lr_layer_resnet18_cifar10.yaml", "overlays/lr_layer_resnet18_2lr.yaml")
    assert [
        (logger["class_path"].rsplit(".", 1)[1], logger["init_args"]["save_dir"], logger["init_args"]["name"])
        for logger in config["trainer"]["logger"]
    ] == [
        ("CSVLogger", "runs", "lr_layer_resnet18_2lr"),
        ("TensorBoardLogger", "runs/lr_layer_resnet18_2lr", "tensorboard"),
    ]


def test_unknown_backbone_is_a_clear_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "--config",
                str(ROOT / "configs/quickstart.yaml"),
                "--model.init_args.backbone=mlpp",
                "--trainer.logger=false",
            ],
            run=False,
        )
    assert exit_info.value.code == 1
    assert re.search(r"^error: unknown model 'mlpp'; models are: .*resnet18", capsys.readouterr().err, re.M)


@pytest.mark.slow
def test_quickstart_end_to_end(tmp_path):
    result = _run_train(["fit", "--config", str(ROOT / "configs/quickstart.yaml")], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    metrics = _last_metrics(tmp_path / "runs")
    assert metrics["val/acc"] > 0.9
    assert any(k.startswith("rank/") for k in metrics), sorted(metrics)
    assert any(k.startswith("weight/") for k in metrics), sorted(metrics)
    ckpts = list((tmp_path / "runs").rglob("*.ckpt"))
    assert ckpts

    validate = _run_train(
        ["validate", "--config", str(ROOT / "configs/quickstart.yaml"), f"--ckpt_path={ckpts[0]}"], cwd=tmp_path
    )
    assert validate.returncode == 0, validate.stderr[-4000:]
    test = _run_train(
        ["test", "--config", str(ROOT / "configs/quickstart.yaml"), f"--ckpt_path={ckpts[0]}"], cwd=tmp_path
    )
    assert test.returncode == 0, test.stderr[-4000:]
    assert "test/acc" in test.stdout + test.stderr


@pytest.mark.slow
def test_fit_ddp_two_processes(tmp_path):
    result = _run_train(
        [
            "fit",
            "--config",
            str(ROOT / "configs/quickstart.yaml"),
            "--trainer.strategy=ddp",
            "--trainer.accelerator=cpu",
            "--trainer.devices=2",
            "--trainer.max_epochs=1",
        ],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    metrics = _last_metrics(tmp_path / "runs")
    assert "val/acc" in metrics
    # The modules reduce what they log over the processes: Lightning has no reason to ask for sync_dist.
    assert not re.findall(r"self\.log\('(?:train|val)/[a-z_]*loss'", result.stderr)


def test_readme_documents_the_rank_lightning_command_and_it_runs(tmp_path):
    scripts = '\n[project.scripts]\nrank-lightning = "rank_lightning.cli:console_main"\n'
    assert scripts in (ROOT / "pyproject.toml").read_text()
    section = (ROOT / "README.md").read_text().split("\n## Training from the CLI\n", 1)[1].split("\n## ", 1)[0]
    [command] = [shlex.split(line.split("#")[0]) for line in section.splitlines() if line.startswith("rank-lightning ")]
    script = Path(sys.executable).with_name("rank-lightning")
    args = [str(ROOT / a) if a.startswith("configs/") else a for a in command[1:]]
    result = subprocess.run(
        [script, *args, "--print_config"], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "class_path: rank_lightning.modules.ImageClassifier" in result.stdout


def test_gaussian_noise_data_trains_with_the_default_loggers(tmp_path, monkeypatch):
    # The loggers merge the model's and the datamodule's hparams: the linked input_shape must be equal in both (the
    # datamodule's comes from the CLI's YAML dump, a list; a tuple on the model's side stopped every run).
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RANK_LIGHTNING_FIGURE_WORKERS", "0")
    options = ["--trainer.max_epochs", "1", "--trainer.limit_train_batches", "2", "--trainer.limit_val_batches", "1"]
    data = [
        "--data",
        "GaussianNoiseDataModule",
        "--data.init_args.input_shape",
        "[16]",
        "--data.init_args.batch_size",
        "32",
    ]
    main(["fit", "--config", str(ROOT / "configs/quickstart.yaml"), *data, *options])
    metrics = _last_metrics(tmp_path / "runs")
    assert any(key.startswith("rank/") for key in metrics), sorted(metrics)
    saved = list((tmp_path / "runs").rglob("hparams.yaml"))
    assert len(saved) == 2  # CSV and TensorBoard
    assert all("input_shape:\n- 16\n" in path.read_text() for path in saved)


def _clashing_hparams(model, datamodule) -> list[str]:
    """The keys Lightning refuses when it merges the two hparams for the loggers (``_log_hyperparams``): saved by
    both, with values of different types or unequal."""
    ours, theirs = model.hparams_initial, datamodule.hparams_initial
    return sorted(
        key
        for key in ours.keys() & theirs.keys()
        if key != "_class_path" and (type(ours[key]) is not type(theirs[key]) or ours[key] != theirs[key])
    )


def _datamodule_arguments(name: str, root: Path) -> dict:
    """Arguments that build datamodule ``name`` without data files (an image folder needs its class folders)."""
    if name == "image_folder":
        for label in range(4):
            (root / "train" / str(label)).mkdir(parents=True)
        return {"data_dir": str(root), "image_size": 8}
    return {"data_dir": str(root)} if name in ("mnist", "fashion_mnist", "cifar10", "cifar100") else {}


@pytest.mark.parametrize("name", list_datamodules())
def test_no_datamodule_saves_a_hyperparameter_the_model_saves_otherwise(name, tmp_path):
    kwargs = _datamodule_arguments(name, tmp_path)
    data = [f"--data={get_datamodule_class(name).__name__}"] + [f"--data.init_args.{k}={v}" for k, v in kwargs.items()]
    cli = main(["--config", str(ROOT / "configs/quickstart.yaml"), *data, "--trainer.logger=false"], run=False)
    assert cli.model.num_classes == cli.datamodule.num_classes
    assert _clashing_hparams(cli.model, cli.datamodule) == []
    datamodule = create_datamodule(name, **kwargs)
    model = ImageClassifier(num_classes=datamodule.num_classes, input_shape=datamodule.input_shape)
    assert _clashing_hparams(model, datamodule) == []


def test_an_image_folder_with_counted_classes_trains(tmp_path, monkeypatch):
    # num_classes: None counts the class folders; the datamodule saved None while the model saved the count, and
    # Lightning stopped the run before its first step.
    monkeypatch.chdir(tmp_path)
    write_folder(tmp_path / "images", classes=("cat", "dog", "fox", "owl"), per_class=4, size=8)
    config = tmp_path / "config.yaml"
    config.write_text(
        "trainer: {max_epochs: 1, enable_progress_bar: false, enable_model_summary: false, enable_checkpointing: false,"
        " logger: {class_path: pytorch_lightning.loggers.CSVLogger, init_args: {save_dir: runs, name: folder}}}\n"
        "model: {class_path: rank_lightning.modules.ImageClassifier,"
        " init_args: {backbone_kwargs: {depth: 2, width: 8}}}\n"
    )
    data = ["--data=ImageFolderDataModule", "--data.init_args.data_dir=images", "--data.init_args.image_size=8"]
    main(["fit", "--config", str(config), *data, "--data.init_args.batch_size=8"])
    metrics = _last_metrics(tmp_path / "runs")
    assert "val/acc" in metrics
    [hparams] = (tmp_path / "runs").rglob("hparams.yaml")
    assert "\nnum_classes: 4\n" in hparams.read_text()
