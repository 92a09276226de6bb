"""CLI errors: the message alone (the traceback on request), valid choices listed, no empty run folder left."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import pytorch_lightning as pl

from rank_lightning.cli import DEBUG_ENV, class_argument_error, main

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = str(ROOT / "configs/quickstart.yaml")
FAST = ["--trainer.limit_train_batches=2", "--trainer.limit_val_batches=2", "--trainer.enable_model_summary=false"]


class FailInSecondEpoch(pl.Callback):
    """Raises once the first epoch has been logged, as a crash in the middle of training would."""

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.current_epoch == 1:
            raise ValueError("stopped in epoch 1")


def test_unknown_optimizer_is_one_message_without_traceback(tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "fit", "--config", QUICKSTART, "--model.init_args.optimizer=sgdd"],
        cwd=tmp_path,
        env={k: v for k, v in os.environ.items() if k != DEBUG_ENV},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 1
    assert "Traceback" not in result.stderr, result.stderr
    assert "error: unknown optimizer 'sgdd'; optimizers are: sgd, adam, adamw\n" in result.stderr
    assert len(result.stderr.splitlines()) <= 4, result.stderr


def test_debug_variable_raises_the_error_with_its_traceback(monkeypatch):
    monkeypatch.setenv(DEBUG_ENV, "1")
    with pytest.raises(ValueError, match=r"unknown model 'mlpp'; models are: .*resnet18"):
        main(["--config", QUICKSTART, "--model.init_args.backbone=mlpp", "--trainer.logger=false"], run=False)


@pytest.mark.parametrize(
    "argument", ["--data=digits", "--data.class_path=rank_lightning.data.DigitsDataModul"], ids=["name", "class_path"]
)
def test_unknown_datamodule_lists_the_valid_ones(argument, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", QUICKSTART, argument, "--print_config"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert argument.split("=")[1] in err
    names = (
        "CIFAR10DataModule, CIFAR100DataModule, DigitsDataModule, FashionMNISTDataModule, GaussianMixtureDataModule, "
        "GaussianNoiseDataModule, ImageFolderDataModule, MNISTDataModule"
    )
    assert f"valid --data values: {names}, or the import path of any LightningDataModule\n" in err


SETUP_ERRORS = pytest.mark.parametrize(
    ("arguments", "message"),
    [
        # Fails in the callbacks' setup, before the config is saved.
        (
            [
                "--trainer.callbacks+=rank_lightning.callbacks.ActivationRankMonitor",
                "--trainer.callbacks.init_args.layers=[layer9]",
            ],
            "unknown layer 'layer9'",
        ),
        # Fails in configure_optimizers, after the config is saved into the run's folder.
        (["--trainer.max_epochs=-1"], "scheduler 'cosine' needs trainer.max_epochs"),
    ],
    ids=["callback_setup", "configure_optimizers"],
)


@SETUP_ERRORS
def test_a_setup_error_leaves_no_version_folder(arguments, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", QUICKSTART, *FAST, *arguments])
    assert exit_info.value.code == 1
    assert message in capsys.readouterr().err
    assert sorted((tmp_path / "runs").rglob("version_*")) == []


@SETUP_ERRORS
def test_a_failed_first_run_leaves_no_folder_behind(arguments, message, tmp_path, monkeypatch, capsys):
    # The loggers made runs/, runs/quickstart/ and runs/quickstart/tensorboard/ for their version folders; an empty
    # tensorboard/ was left behind.
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):
        main(["fit", "--config", QUICKSTART, *FAST, *arguments])
    assert message in capsys.readouterr().err
    assert sorted(tmp_path.iterdir()) == []


def test_a_failed_run_keeps_the_folders_that_were_there_before(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    kept = [tmp_path / "runs" / "quickstart" / "tensorboard", tmp_path / "runs" / "quickstart" / "notes"]
    for folder in kept:
        folder.mkdir(parents=True)
    with pytest.raises(SystemExit):
        main(["fit", "--config", QUICKSTART, *FAST, "--trainer.max_epochs=-1"])
    assert sorted(path for path in tmp_path.rglob("*")) == sorted(
        [tmp_path / "runs", tmp_path / "runs" / "quickstart", *kept]
    )


def test_an_error_after_the_first_logged_epoch_keeps_the_run_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):
        main(["fit", "--config", QUICKSTART, *FAST, f"--trainer.callbacks+={__name__}.FailInSecondEpoch"])
    assert "error: stopped in epoch 1" in capsys.readouterr().err
    run = tmp_path / "runs" / "quickstart" / "version_0"
    assert (run / "metrics.csv").is_file() and (run / "config.yaml").is_file()
    assert sorted(p.name for p in (tmp_path / "runs" / "quickstart" / "tensorboard").iterdir()) == ["version_0"]


def test_logger_less_runs_never_overwrite_each_others_config(tmp_path, monkeypatch):
    # Without a logger every run's folder is trainer.default_root_dir: Lightning's own config callback refuses the
    # second run there; each run keeps its own file instead.
    monkeypatch.chdir(tmp_path)
    for _ in range(2):
        main(["fit", "--config", QUICKSTART, *FAST, "--trainer.max_epochs=1", "--trainer.logger=false"])
    assert sorted(p.name for p in tmp_path.glob("config*.yaml")) == ["config-v1.yaml", "config.yaml"]
    assert "backbone: mlp" in (tmp_path / "config-v1.yaml").read_text()


def test_adversarial_validate_in_inference_mode_is_one_message(tmp_path, monkeypatch, capsys):
    # The README's Sanyal config validated without --trainer.inference_mode=false: no input gradient can be taken.
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["validate", "--config", str(ROOT / "configs/sanyal_adversarial_digits.yaml"), *FAST])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert "error: AdversarialValidation needs input gradients, but trainer.validate() runs under" in err
    assert "--trainer.inference_mode=false" in err and "Traceback" not in err


@pytest.mark.parametrize("argument", ["--model.init_args.num_classes=5", "--model.input_shape=[1,28,28]"])
def test_a_linked_model_setting_on_the_command_line_is_refused(argument, capsys):
    # The datamodule's value replaced it without a word: the run trained 10 classes where 5 were asked for.
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", QUICKSTART, argument, "--trainer.logger=false"])
    assert exit_info.value.code == 1
    key = argument.split("=")[0]
    assert f"error: {key}: the CLI takes num_classes and input_shape from the datamodule" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (
            ["--trainer.callbacks.init_args.every_n_epoch=2"],
            "error: trainer.callbacks: ActivationRankMonitor has no option 'every_n_epoch' (did you mean "
            "'every_n_epochs'?); its options are: layers, layer_types, every_n_epochs, every_n_train_steps, ",
        ),
        (
            ["--trainer.callbacks.init_args.stage=tset"],
            "error: trainer.callbacks: ActivationRankMonitor: stage=tset is not valid; expected one of 'val', 'train' "
            "or None\n",
        ),
        (
            ["--trainer.callbacks.init_args.window_batches=abc"],
            "error: trainer.callbacks: ActivationRankMonitor: window_batches=abc is not valid; expected int\n",
        ),
        (
            ["--trainer.callbacks.init_args.label_fn=no_such_module.labels"],
            "error: trainer.callbacks: ActivationRankMonitor: label_fn=no_such_module.labels is not valid; expected "
            "the import path of a function, module.function (No module named 'no_such_module') or None\n",
        ),
    ],
    ids=["misspelled_option", "bad_literal", "bad_int", "bad_function_path"],
)
def test_a_bad_callback_argument_is_one_line_naming_it_and_the_valid_ones(arguments, message, capsys, monkeypatch):
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    callback = "--trainer.callbacks+=rank_lightning.callbacks.ActivationRankMonitor"
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", QUICKSTART, callback, *arguments, "--print_config"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Union subtypes" not in err
    assert err.endswith(f"\n({DEBUG_ENV}=1 shows the parser's whole message)\n")


def test_a_refused_function_is_one_line_past_the_blank_line_of_the_parsers_message():
    # The parser's message when a function's return annotation does not fit: a blank line after the option's key.
    message = """Parser key "trainer.callbacks":
  Errors:
    - Problem with given class_path 'rank_lightning.callbacks.ActivationRankMonitor':
        Parser key "label_fn":

          - Expected a path but data.labels either not accessible or invalid
          - Does not validate against any of the Union subtypes
          Errors:
            - Type collections.abc.Callable[[typing.Any], torch.Tensor] expects a function or a callable class: \
Expected 'data.labels' to be a function that returns <class 'Tensor'>.
            - Expected a <class 'NoneType'>
          Given value: data.labels
    - Expected a <class 'NoneType'>
"""
    assert class_argument_error(message) == (
        "trainer.callbacks: ActivationRankMonitor: label_fn=data.labels is not valid; expected the import path of a "
        "function, module.function (Expected 'data.labels' to be a function that returns <class 'Tensor'>) or None"
    )


def _added_callback_error(capsys, monkeypatch, callback: str, argument: str) -> tuple[int, str]:
    """The exit status and standard error of a quickstart fit with ``callback`` added, given ``argument``."""
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    added = f"--trainer.callbacks+=rank_lightning.callbacks.{callback}"
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", QUICKSTART, added, f"--trainer.callbacks.{argument}", "--trainer.logger=false"])
    return exit_info.value.code, capsys.readouterr().err


def test_a_callbacks_own_message_is_printed_not_the_error_it_explains(capsys, monkeypatch):
    code, err = _added_callback_error(capsys, monkeypatch, "AdversarialValidation", "eps=[abc]")
    assert code == 1
    # Not Python's 'Invalid literal for Fraction', which the callback's message explains.
    assert err.startswith("error: eps entries must be numbers or fractions such as '8/255'; got 'abc'\n")


def test_a_bad_argument_of_a_class_inside_a_callback_is_one_line_with_one_hint(capsys, monkeypatch):
    code, err = _added_callback_error(capsys, monkeypatch, "JacobianRankMonitor", "patch={top: 1}")
    assert code == 2
    assert err.endswith(
        "error: trainer.callbacks: JacobianRankMonitor: patch: Patch: the following arguments are required: left, "
        f"height, width\n({DEBUG_ENV}=1 shows the parser's whole message)\n"
    )


def test_a_misspelled_callback_class_names_the_close_ones(capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--config", QUICKSTART, "--trainer.callbacks+=rank_lightning.callbacks.ActivationRankMonitr"])
    assert (
        "error: trainer.callbacks: cannot import 'rank_lightning.callbacks.ActivationRankMonitr' (module "
        "'rank_lightning.callbacks' has no attribute 'ActivationRankMonitr'); did you mean ActivationRankMonitor"
    ) in capsys.readouterr().err


def test_the_debug_variable_keeps_the_parsers_whole_message(capsys, monkeypatch):
    monkeypatch.setenv(DEBUG_ENV, "1")
    callback = "--trainer.callbacks+=rank_lightning.callbacks.ActivationRankMonitor"
    with pytest.raises(SystemExit):
        main(["fit", "--config", QUICKSTART, callback, "--trainer.callbacks.init_args.every_n_epoch=2"])
    err = capsys.readouterr().err
    assert "Option 'every_n_epoch' is not accepted" in err
    assert "has no option" not in err


@pytest.mark.parametrize("subcommand", ["validate", "fit"])
def test_a_ckpt_path_that_is_no_checkpoint_is_one_message(subcommand, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    not_a_checkpoint = tmp_path / "config.yaml"
    not_a_checkpoint.write_text("seed_everything: 0\n")
    with pytest.raises(SystemExit) as exit_info:
        main([subcommand, "--config", QUICKSTART, "--ckpt_path", str(not_a_checkpoint)])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert f"error: --ckpt_path {str(not_a_checkpoint)!r} is not a checkpoint (a file ModelCheckpoint" in err
    assert "Traceback" not in err and "weights_only" not in err
    assert not (tmp_path / "runs").exists()


def test_predict_is_refused_with_the_valid_subcommands(tmp_path, monkeypatch, capsys):
    # No module or datamodule of the package predicts: `predict` loaded the checkpoint, then stopped on Lightning's
    # "`predict_dataloader` must be implemented".
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["predict", "--config", QUICKSTART, "--trainer.logger=false"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert re.search(
        r"error: argument subcommand: invalid choice: '?predict'? \(choose from '?fit'?, '?validate'?, '?test'?\)", err
    )


@pytest.mark.parametrize(
    ("argument", "meant"),
    [
        ("--data=mnist", "MNISTDataModule"),
        ("--data=fashion_mnist", "FashionMNISTDataModule"),
        ("--data=Cifar10DataModule", "CIFAR10DataModule"),
        ("--data.class_path=rank_lightning.data.DigitsDataModul", "DigitsDataModule"),
    ],
)
def test_a_datamodule_given_by_its_registry_name_or_misspelled_names_the_one_meant(argument, meant, capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--config", QUICKSTART, argument, "--print_config"])
    assert capsys.readouterr().err.endswith(f"LightningDataModule\ndid you mean --data={meant}?\n")
