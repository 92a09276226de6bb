"""``last.ckpt`` of every config is the model after the last finished epoch, not after the best one."""

from pathlib import Path

import pytest
import torch
import yaml

from rank_lightning.cli import main

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted(p for p in (ROOT / "configs").rglob("*.yaml") if not {"loggers", "overlays", "sweeps"} & set(p.parts))
# The configs that complete another one (given after it on the command line), each with the config it completes.
PARTIAL_CONFIGS = {
    "loggers/wandb.yaml": "quickstart.yaml",
    "overlays/lr_layer_resnet18_2lr.yaml": "lr_layer_resnet18_cifar10.yaml",
}


def _checkpoint_arguments(config: Path) -> list[dict]:
    callbacks = (yaml.safe_load(config.read_text()).get("trainer") or {}).get("callbacks") or []
    return [c.get("init_args") or {} for c in callbacks if c["class_path"].endswith(".ModelCheckpoint")]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: str(p.relative_to(ROOT / "configs")))
def test_the_checkpoint_writing_last_ckpt_saves_every_epoch(config):
    # Lightning 2.6 writes `save_last` only alongside a checkpoint the same callback saves: with a monitor, that is
    # an epoch that improved the monitored value, so last.ckpt would lag behind the last epoch.
    for arguments in _checkpoint_arguments(config):
        if arguments.get("save_last") or arguments.get("filename") == "last":
            assert arguments.get("monitor") is None, arguments
            assert arguments.get("save_top_k", 1) != 0, arguments
            assert arguments.get("every_n_epochs", 1) == 1 and arguments.get("every_n_train_steps") is None, arguments


def test_configs_with_a_monitored_checkpoint_also_write_last_ckpt():
    monitored = [c for c in CONFIGS if any(a.get("monitor") for a in _checkpoint_arguments(c))]
    assert monitored
    for config in monitored:
        assert any(a.get("filename") == "last" for a in _checkpoint_arguments(config)), config


@pytest.fixture(scope="module")
def parser():
    """The CLI's parser, built once: parsing a config with it takes a tenth of a second, building it most of one."""
    return main(["--config", str(ROOT / "configs/quickstart.yaml"), "--trainer.logger=false"], run=False).parser


def test_every_partial_config_names_the_config_it_completes():
    partial = {
        p.relative_to(ROOT / "configs").as_posix()
        for d in ("loggers", "overlays")
        for p in (ROOT / "configs" / d).rglob("*.yaml")
    }
    assert partial == set(PARTIAL_CONFIGS)


@pytest.mark.parametrize(
    "configs",
    [[config] for config in CONFIGS]
    + [[ROOT / "configs" / base, ROOT / "configs" / p] for p, base in PARTIAL_CONFIGS.items()],
    ids=lambda configs: " + ".join(str(c.relative_to(ROOT / "configs")) for c in configs),
)
def test_every_config_keeps_last_ckpt_of_the_last_epoch(configs, parser):
    # The README's `validate` and resumed `fit` read <run>/checkpoints/last.ckpt; without a ModelCheckpoint of their
    # own, runs kept only Lightning's default epoch=<n>-step=<m>.ckpt.
    trainer = parser.parse_args([arg for config in configs for arg in ("--config", str(config))]).trainer
    assert trainer.enable_checkpointing is not False
    writers = [
        c.init_args
        for c in trainer.callbacks or []
        if c.class_path.endswith(".ModelCheckpoint") and (c.init_args.filename == "last" or c.init_args.save_last)
    ]
    assert any(
        w.monitor is None
        and w.dirpath is None
        and w.save_top_k != 0
        and w.every_n_epochs in (None, 1)
        and not w.every_n_train_steps
        and w.train_time_interval is None
        for w in writers
    ), writers


def test_quickstart_last_ckpt_is_the_last_epoch_when_val_acc_stops_improving(tmp_path, monkeypatch):
    # A learning rate too small to move any weight keeps val/acc at its epoch-0 value, so the val/acc checkpoint is
    # never replaced after epoch 0; last.ckpt must still hold epoch 2.
    monkeypatch.chdir(tmp_path)
    main(
        [
            "fit",
            "--config",
            str(ROOT / "configs/quickstart.yaml"),
            "--trainer.max_epochs=3",
            "--trainer.limit_train_batches=2",
            "--trainer.limit_val_batches=2",
            "--trainer.enable_model_summary=false",
            "--model.init_args.lr=1e-12",
        ]
    )
    [run] = (tmp_path / "runs" / "quickstart").glob("version_*")
    checkpoints = {p.name: torch.load(p, map_location="cpu", weights_only=False) for p in run.glob("checkpoints/*")}
    last = checkpoints.pop("last.ckpt")
    assert (last["epoch"], last["global_step"]) == (2, 6)
    [best] = checkpoints.values()
    assert (best["epoch"], best["global_step"]) == (0, 2)


FAST = ["--trainer.limit_train_batches=2", "--trainer.limit_val_batches=2", "--trainer.enable_model_summary=false"]
QUICK = ["--config", str(ROOT / "configs/quickstart.yaml"), *FAST, "--trainer.enable_progress_bar=false"]
NO_BAR = ["--trainer.callbacks=[]", "--trainer.callbacks+=ModelCheckpoint", "--trainer.callbacks.filename=last"]


def test_ckpt_path_last_reads_the_last_ckpt_of_the_newest_earlier_run(tmp_path, monkeypatch):
    # Every run writes into a new version_<n>/, so Lightning looked for last.ckpt in the new run's empty folder:
    # `validate` measured the untrained model, and `fit` started again from epoch 0, each after a warning alone.
    monkeypatch.chdir(tmp_path)
    main(["fit", *QUICK, *NO_BAR, "--trainer.max_epochs=1"])
    main(["fit", *QUICK, *NO_BAR, "--trainer.max_epochs=2"])
    newest = tmp_path / "runs/quickstart/version_1/checkpoints/last.ckpt"
    validate = main(["validate", *QUICK, *NO_BAR, "--ckpt_path=last"])
    assert Path(validate.trainer.ckpt_path).resolve() == newest.resolve()
    resumed = main(["fit", *QUICK, *NO_BAR, "--trainer.max_epochs=3", "--ckpt_path=last"])
    assert Path(resumed.trainer.ckpt_path).resolve() == newest.resolve()
    assert resumed.trainer.global_step == 6  # two epochs restored, one trained
    assert torch.load(newest, weights_only=False)["global_step"] == 4  # the earlier run's file is kept as it was


def test_ckpt_path_last_without_an_earlier_checkpoint(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RANK_LIGHTNING_DEBUG", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        main(["validate", *QUICK, *NO_BAR, "--ckpt_path=last"])
    assert exit_info.value.code == 1
    assert (
        f"error: --ckpt_path last: no last*.ckpt in {Path('runs/quickstart')}/*/checkpoints/ (an earlier fit of this "
        "config writes one); give the checkpoint's path" in capsys.readouterr().err
    )
    assert not (tmp_path / "runs").exists()
    # A fit may name `last` before its first run (a job that is restarted): it starts from scratch.
    fit = main(["fit", *QUICK, *NO_BAR, "--trainer.max_epochs=1", "--ckpt_path=last"])
    assert fit.trainer.ckpt_path is None and fit.trainer.global_step == 2


def test_ckpt_path_best_says_to_give_the_path(tmp_path, monkeypatch, capsys):
    # Lightning answered that the ModelCheckpoint "is not configured to save the best model", which the quickstart's
    # is: a new process has no best path in memory.
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RANK_LIGHTNING_DEBUG", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        main(["validate", "--config", str(ROOT / "configs/quickstart.yaml"), *FAST, "--ckpt_path=best"])
    assert exit_info.value.code == 1
    assert (
        "error: --ckpt_path best names the best checkpoint of a fit run in the same process, which a command never "
        "has; give the checkpoint's path (configs that monitor val/acc keep the best epoch as <run dir>/checkpoints/"
        "epoch=<n>-step=<m>.ckpt)\n"
    ) in capsys.readouterr().err


def test_a_checkpoint_of_other_data_is_one_message(tmp_path, monkeypatch, capsys):
    # The model is built for the datamodule given (the CLI links num_classes and input_shape), and loading the
    # checkpoint's weights into it stopped with a 30-line traceback about tensor sizes.
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RANK_LIGHTNING_DEBUG", raising=False)
    main(["fit", *QUICK, *NO_BAR, "--trainer.max_epochs=1"])
    checkpoint = Path("runs/quickstart/version_0/checkpoints/last.ckpt")
    other = ["--data=GaussianNoiseDataModule", "--data.init_args.num_classes=5", "--data.init_args.input_shape=[32]"]
    with pytest.raises(SystemExit) as exit_info:
        main(["validate", *QUICK, *NO_BAR, *other, f"--ckpt_path={checkpoint}"])
    assert exit_info.value.code == 1
    assert (
        f"error: --ckpt_path {str(checkpoint)!r} holds a model of num_classes=10, input_shape=[1, 8, 8], but "
        "GaussianNoiseDataModule gives num_classes=5, input_shape=(32,): give the data it was trained on\n"
    ) in capsys.readouterr().err
    # The same digits served flat fit the MLP's weights as they are.
    flat = main(["validate", *QUICK, *NO_BAR, "--data.init_args.flatten=true", f"--ckpt_path={checkpoint}"])
    assert flat.trainer.ckpt_path == str(checkpoint) and "val/acc" in flat.trainer.callback_metrics


def test_ckpt_path_last_under_fast_dev_run_looks_in_no_other_folder(tmp_path, monkeypatch):
    # fast_dev_run replaces the loggers by one without a folder: the run's folder was the working folder, and `last`
    # was looked for in the folders beside it.
    other = tmp_path / "other_project" / "checkpoints"
    other.mkdir(parents=True)
    (other / "last.ckpt").write_bytes(b"not this one")
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    cli = main(["validate", *QUICK, *NO_BAR, "--trainer.fast_dev_run=1", "--ckpt_path=last"])
    assert cli.trainer.ckpt_path is None
