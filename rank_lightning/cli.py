"""Command line: ``python train.py {fit,validate,test} --config configs/<name>.yaml`` (or ``rank-lightning ...``).

The configs of ``configs/`` are shipped inside the package, so an installed package runs them by name from any folder:
``rank-lightning fit --config quickstart`` (or ``daneshmand/digits_bn``, ``loggers/wandb``; ``rank-lightning configs``
lists them). A ``--config`` value that is an existing file is always read as that file.

The datamodule's ``num_classes`` and ``input_shape`` are linked into the model, so a config names a
dataset once. Without a logger in the config, runs are logged to CSV and TensorBoard under ``runs/``,
which needs no account and no network; ``configs/loggers/wandb.yaml`` switches to Weights & Biases.

Every run writes its resolved config into its own directory (the one holding ``checkpoints/``), so runs never
compete for one file. Errors that explain themselves (an unknown backbone, a missing dataset file, ...) are printed
as one message; ``RANK_LIGHTNING_DEBUG=1`` shows their traceback.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
import inspect
import math
import os
import re
import shutil
import sys
import warnings
import zipfile
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any, NoReturn

# OpenMP threads that spin while waiting make every small CPU op tens of times slower as soon as another process
# holds a core (train.py says more). The installed ``rank-lightning`` command starts here, so it is set here too,
# before the imports below load torch; an explicit setting is kept.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback
from pytorch_lightning.loggers.logger import DummyLogger
from pytorch_lightning.utilities import rank_zero_warn
from pytorch_lightning.utilities.exceptions import MisconfigurationException

from rank_lightning.callbacks.curves import run_directory, wandb_loggers
from rank_lightning.data.base import get_datamodule_class, list_datamodules
from rank_lightning.modules.base import RankModule
from rank_lightning.validation import SetupError

DEBUG_ENV = "RANK_LIGHTNING_DEBUG"
"""Environment variable: set to ``1`` to see the traceback of an error instead of its message alone."""

USER_ERRORS = (ValueError, FileNotFoundError, SetupError, MisconfigurationException)
"""Errors whose message says what is wrong and how to fix it; the CLI prints them without a traceback."""

CONFIG_SUFFIXES = (".yaml", ".yml")
"""File endings of the bundled configs."""

# Files a run writes before its first logged value (config, hyperparameters, TensorBoard's file header): a run
# directory holding nothing else holds no result.
_SETUP_FILES = ("config*.yaml", "hparams.yaml", "events.out.tfevents.*")


# The block of lines indented below the class's line; a blank line inside it (the parser writes one after the option's
# key before the lines about reading the value as a config file's path) does not end it.
_CLASS_PROBLEM = re.compile(
    r"^( *)- Problem with given class_path '([^']+)':\n((?:\1 +\S.*(?:\n|$)|\n(?=\1 +\S))+)", re.MULTILINE
)
# A value refused for a Callable (an argument such as label_fn), with the reason the parser gives.
_FUNCTION_PROBLEM = re.compile(r"- Type \S*Callable.* expects a function or a callable class: (.*)")
_PARSER_KEY = re.compile(r'^Parser key "([^"]+)"')
_PARSER_HINT = f"({DEBUG_ENV}=1 shows the parser's whole message)"


def _type_name(text: str) -> str:
    """``<class 'int'>`` -> ``int``, ``typing.Literal['val', 'train']`` -> ``one of 'val', 'train'``."""
    text = re.sub(r"<class '(?:[\w.]+\.)?(\w+)'>", r"\1", text.strip()).replace("typing.", "")
    if literal := re.fullmatch(r"Literal\[(.*)\]", text):
        return f"one of {literal.group(1)}"
    return "None" if text == "NoneType" else text


def _expected(body: list[str]) -> list[str]:
    """What the ``- Expected a ...`` lines of the parser's message about one option ask for, in words, each once; a
    function (``label_fn``) is asked for by its import path, with the reason the value given is none. The parser's
    attempt to read the value as a config file's path is left out."""
    expected = []
    for line in body:
        if function := _FUNCTION_PROBLEM.match(line):
            expected.append(f"the import path of a function, module.function ({function.group(1).rstrip('.')})")
        elif line.startswith("- Expected a dot import path string"):
            expected.append("an import path, module.name")
        elif line.startswith("- Expected a ") and not line.startswith("- Expected a path but "):
            expected.append(_type_name(line.removeprefix("- Expected a ")))
    return list(dict.fromkeys(expected))


def _init_options(class_path: str) -> list[str]:
    """The keyword arguments of the class at ``class_path`` (empty when it cannot be imported)."""
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
        parameters = inspect.signature(cls).parameters.values()
    except (ImportError, AttributeError, TypeError, ValueError):
        return []
    return [p.name for p in parameters if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def _module_classes(class_path: str) -> list[str]:
    """The public classes of the module of ``class_path`` (empty when it cannot be imported)."""
    module, _, _ = class_path.rpartition(".")
    try:
        found = importlib.import_module(module)
    except ImportError:
        return []
    return sorted(name for name, value in vars(found).items() if inspect.isclass(value) and not name.startswith("_"))


def class_argument_error(message: str) -> str | None:
    """One line for the parser's message about a class given in a config (a callback, a logger, the model): the class
    and option at fault, the value given and what is valid; ``None`` for other messages.

    The parser reports a misspelled option of ``trainer.callbacks`` as a dozen lines about union subtypes; the first
    ``Problem with given class_path`` block in them is the class the config names.
    """
    key, problem = _PARSER_KEY.match(message), _CLASS_PROBLEM.search(message)
    if key is None or problem is None:
        return None
    class_path = problem.group(2)
    name = class_path.rpartition(".")[2]
    # The message of a class nested in the class (a callback's Patch) is shortened first, with its own hint.
    body = [line.strip() for line in problem.group(3).splitlines() if line.strip() not in ("", _PARSER_HINT)]
    where = f"{key.group(1)}: {name}"
    if unknown := re.fullmatch(r"Option '([^']+)' is not accepted", body[0]):
        option, options = unknown.group(1), _init_options(class_path)
        close = difflib.get_close_matches(option, options, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return f"{where} has no option {option!r}{hint}; its options are: {', '.join(options)}"
    if inner := _PARSER_KEY.match(body[0]):
        given = next((line.removeprefix("Given value: ") for line in body if line.startswith("Given value: ")), None)
        expected = _expected(body)
        single = [re.search(r"Expected a (.+?)\. Got value: (.*)", line) for line in body if "Got value" in line]
        if not expected and single and single[0] is not None:  # one type: 'Expected a <type>. Got value: <value>'
            expected, given = [_type_name(single[0].group(1))], single[0].group(2)
        value = "" if given is None else f"={given}"
        return f"{where}: {inner.group(1)}{value} is not valid; expected {' or '.join(expected) or body[-1]}"
    if "has no attribute" in body[0] or "No module named" in body[0]:
        close = difflib.get_close_matches(name, _module_classes(class_path), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        return f"{key.group(1)}: cannot import {class_path!r} ({body[0]}){hint}"
    return f"{where}: {' '.join(body)}"


def _meant_datamodule(message: str, classes: list[str]) -> str | None:
    """The datamodule class a bad ``--data`` value (``Given value: ...`` in the parser's ``message``) likely means: the
    class registered under that name (``mnist``: ``MNISTDataModule``), or the closest class name."""
    given = re.search(r"^ *Given value: (.+)$", message, re.MULTILINE)
    if given is None:
        return None
    value = given.group(1).strip()
    if in_dict := re.search(r"'class_path': '([^']+)'", value):  # a config's data: {class_path: ..., init_args: ...}
        value = in_dict.group(1)
    if value in list_datamodules():
        return get_datamodule_class(value).__name__
    by_lower = {name.lower(): name for name in classes}
    close = difflib.get_close_matches(value.rpartition(".")[2].lower(), list(by_lower), n=1, cutoff=0.8)
    return by_lower[close[0]] if close else None


class RankArgumentParser(LightningArgumentParser):
    """Lightning's parser, whose error for a bad ``--data`` value also lists the package's datamodules, and whose
    error for a bad option of a class in the config (a misspelled callback argument, a value of the wrong type) is
    one line naming the class, the option, the value and what is valid (:func:`class_argument_error`;
    ``RANK_LIGHTNING_DEBUG=1`` shows the parser's whole message)."""

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        if message.startswith('Parser key "data"'):
            classes = [get_datamodule_class(name).__name__ for name in list_datamodules()]
            message += f"\nvalid --data values: {', '.join(classes)}, or the import path of any LightningDataModule"
            if meant := _meant_datamodule(message, classes):
                message += f"\ndid you mean --data={meant}?"
        elif os.environ.get(DEBUG_ENV, "") in ("", "0") and (short := class_argument_error(message)) is not None:
            message = f"{short}\n{_PARSER_HINT}"
        super().error(message, ex)


class RunConfigCallback(SaveConfigCallback):
    """Saves the resolved config as ``config.yaml`` in the run's own directory, never over an existing file.

    Lightning's callback writes to ``trainer.log_dir``, which for a logger without a versioned directory (W&B, none at
    all) is the same folder for every run, and refuses to start the second run. Here the folder is the run's
    (``rank_lightning.callbacks.curves.run_directory``: the first logger's versioned directory, W&B's
    ``<save_dir>/<project>/<run id>``), and a file already there (a resumed W&B run, a logger-less run in
    ``default_root_dir``) is kept: the config goes to ``config-v1.yaml``, ``config-v2.yaml``, ... instead.
    """

    def __init__(self, parser: LightningArgumentParser, config: Any, **kwargs: Any) -> None:
        super().__init__(parser, config, **{**kwargs, "save_to_log_dir": False})

    def save_config(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        path = run_directory(trainer) / self.config_filename
        stem, suffix = path.stem, path.suffix
        version = 0
        while path.exists() and not self.overwrite:
            version += 1
            path = path.with_name(f"{stem}-v{version}{suffix}")
        path.parent.mkdir(parents=True, exist_ok=True)
        self.parser.save(self.config, str(path), skip_none=False, overwrite=self.overwrite, multifile=self.multifile)


def _as_list(shape: Any) -> list[int]:
    return [int(size) for size in shape]


class RankCLI(LightningCLI):
    """LightningCLI over the package's modules and datamodules, with account-free default loggers."""

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        """Lightning's subcommands without ``predict``: no module or datamodule of the package predicts."""
        return {name: skip for name, skip in LightningCLI.subcommands().items() if name != "predict"}

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("data.num_classes", "model.init_args.num_classes", apply_on="instantiate")
        # As a list: the CLI saves a datamodule's hparams from its YAML dump (lists), and Lightning refuses to merge
        # the model's and the datamodule's hparams when one key holds a tuple in one and an equal list in the other.
        parser.link_arguments(
            "data.input_shape", "model.init_args.input_shape", compute_fn=_as_list, apply_on="instantiate"
        )
        # Each logger versions its own directory (runs/default/version_<n>/ and
        # runs/default/tensorboard/version_<n>/), so no run overwrites another.
        parser.set_defaults(
            {
                "trainer.logger": [
                    {
                        "class_path": "pytorch_lightning.loggers.CSVLogger",
                        "init_args": {"save_dir": "runs", "name": "default"},
                    },
                    {
                        "class_path": "pytorch_lightning.loggers.TensorBoardLogger",
                        "init_args": {"save_dir": "runs/default", "name": "tensorboard"},
                    },
                ]
            }
        )

    def instantiate_classes(self) -> None:
        super().instantiate_classes()
        # W&B writes a run to <save_dir>/wandb/ only when save_dir already exists: some versions (0.17) otherwise
        # put it in the system's temporary folder (/tmp/wandb/), where `wandb sync` and the next reboot find it.
        for logger in wandb_loggers(self.trainer):
            if logger.save_dir:
                Path(logger.save_dir).mkdir(parents=True, exist_ok=True)

    def _parse_ckpt_path(self) -> None:
        # Lightning reads the checkpoint's hyperparameters here, before any run folder exists.
        if self.config.get("subcommand"):
            check_checkpoint_file(self.config[self.config.subcommand].get("ckpt_path"))
        super()._parse_ckpt_path()

    def _prepare_subcommand_kwargs(self, subcommand: str) -> dict[str, Any]:
        kwargs = super()._prepare_subcommand_kwargs(subcommand)
        if kwargs.get("ckpt_path") == "last":
            kwargs["ckpt_path"] = last_checkpoint(self.trainer, subcommand)
            check_checkpoint_data(kwargs["ckpt_path"], self.datamodule)
        elif kwargs.get("ckpt_path") == "best":
            # Lightning's `best` is the path a ModelCheckpoint holds in memory after a fit of the same process.
            raise ValueError(
                "--ckpt_path best names the best checkpoint of a fit run in the same process, which a command never "
                "has; give the checkpoint's path (configs that monitor val/acc keep the best epoch as "
                "<run dir>/checkpoints/epoch=<n>-step=<m>.ckpt)"
            )
        else:
            check_checkpoint_data(kwargs.get("ckpt_path"), self.datamodule)
        return kwargs

    def _run_subcommand(self, subcommand: str) -> None:
        # The loggers create their versioned directories (and the folders above them: runs/<name>/tensorboard/ for
        # the first run) before the callbacks' and the model's setup, so a setup error would leave an empty
        # version_<n>/ behind and push the next run to version_<n+1>. LightningCLI has no hook for a failed
        # subcommand; this method is where it calls the trainer.
        new_directories = _new_log_directories(self.trainer)
        new_parents = _missing_parents(new_directories)
        try:
            super()._run_subcommand(subcommand)
        except Exception:
            if self.trainer.is_global_zero and not self.trainer.logged_metrics:
                for directory in new_directories:
                    _remove_if_without_results(directory)
                for directory in new_parents:
                    _remove_if_empty(directory)
            raise


def check_checkpoint_file(ckpt_path: Any) -> None:
    """Refuse a ``--ckpt_path`` naming a local file that is no checkpoint (a config, a curve file, a truncated copy),
    which ``torch.load`` answers with a pickling traceback; other values (``last``, ``best``, remote paths, missing
    files) are Lightning's to answer.

    Raises:
        ValueError: naming the file and what a checkpoint is.
    """
    if not isinstance(ckpt_path, (str, os.PathLike)) or not Path(ckpt_path).is_file():
        return
    with open(ckpt_path, "rb") as file:
        legacy = file.read(1) == b"\x80"  # torch.save's format before zip files: a pickle
    if not (legacy or zipfile.is_zipfile(ckpt_path)):
        raise ValueError(
            f"--ckpt_path {str(ckpt_path)!r} is not a checkpoint (a file ModelCheckpoint or torch.save wrote, such as "
            "<run dir>/checkpoints/last.ckpt), or it was cut short"
        )


def _fits_input(trained: tuple[int, ...], given: tuple[int, ...]) -> bool:
    """Whether weights trained on inputs of shape ``trained`` take inputs of shape ``given``: a flat input of the same
    size (an MLP flattens its inputs), or images of the same channel count (a convolution takes any image size)."""
    if len(trained) == 1 or len(given) == 1:
        return math.prod(trained) == math.prod(given)
    return len(trained) == len(given) and trained[0] == given[0]


def check_checkpoint_data(ckpt_path: Any, datamodule: Any) -> None:
    """Refuse a checkpoint whose model was trained for another number of classes, or for inputs its weights cannot
    take, than the datamodule gives: the CLI builds the model for the datamodule (``num_classes`` and
    ``input_shape`` are linked), and loading the weights would stop with a traceback about tensor sizes.

    Raises:
        ValueError: naming the checkpoint, both settings and the datamodule.
    """
    if not isinstance(ckpt_path, (str, os.PathLike)) or not Path(ckpt_path).is_file() or datamodule is None:
        return
    try:
        checkpoint = torch.load(ckpt_path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(ckpt_path))
    except Exception:  # a checkpoint torch reads only in full (weights_only=False) is Lightning's to load and judge
        return
    hparams = (checkpoint.get("hyper_parameters") if isinstance(checkpoint, dict) else None) or {}
    trained = {name: hparams.get(name) for name in _LINKED}
    given = {name: getattr(datamodule, name, None) for name in _LINKED}
    if any(value is None for value in (*trained.values(), *given.values())):
        return
    if trained["num_classes"] == given["num_classes"] and _fits_input(
        tuple(trained["input_shape"]), tuple(given["input_shape"])
    ):
        return
    raise ValueError(
        f"--ckpt_path {str(ckpt_path)!r} holds a model of "
        f"{', '.join(f'{name}={value!r}' for name, value in trained.items())}, but {type(datamodule).__name__} gives "
        f"{', '.join(f'{name}={value!r}' for name, value in given.items())}: give the data it was trained on"
    )


def last_checkpoint(trainer: pl.Trainer, subcommand: str) -> str | None:
    """What ``--ckpt_path last`` names: the newest ``last*.ckpt`` of the earlier runs of the config.

    Every run with a logger writes into a new versioned folder (``runs/<name>/version_<n>/``), whose ``checkpoints/``
    is empty when it starts, so Lightning's own ``last`` (the newest ``last*.ckpt`` in the checkpoint folder of the
    run it starts) never finds one: ``validate`` would measure the untrained model and ``fit`` start from scratch,
    each after a warning alone. Here ``last`` is the newest ``last*.ckpt`` in the ``checkpoints/`` of every run folder
    beside the new one. Without a logger (as under ``fast_dev_run``), or with a checkpoint callback given its own
    ``dirpath``, runs share one checkpoint folder, and Lightning's ``last`` is kept.

    Returns:
        The checkpoint's path; ``"last"`` for Lightning to resolve; ``None`` for a ``fit`` without an earlier
        checkpoint, which starts from scratch (as Lightning's ``last`` does, so a restarted job may name it from its
        first run on).

    Raises:
        ValueError: ``validate`` or ``test`` without an earlier checkpoint, naming the folders looked in.
    """
    shared = any(isinstance(c, ModelCheckpoint) and c.dirpath for c in trainer.checkpoint_callbacks)
    # fast_dev_run replaces the loggers by a DummyLogger, without a folder of its own.
    if shared or not [logger for logger in trainer.loggers if not isinstance(logger, DummyLogger)]:
        return "last"
    runs = run_directory(trainer).parent
    found = [p for p in runs.glob("*/checkpoints/*.ckpt") if p.stem == "last" or p.stem.startswith("last-")]
    if found:
        return str(max(found, key=lambda path: path.stat().st_mtime))
    where = f"no last*.ckpt in {runs}/*/checkpoints/ (an earlier fit of this config writes one)"
    if subcommand == "fit":
        rank_zero_warn(f"--ckpt_path last: {where}; this fit starts from scratch")
        return None
    raise ValueError(f"--ckpt_path last: {where}; give the checkpoint's path")


def _new_log_directories(trainer: pl.Trainer) -> list[Path]:
    """The versioned directories of the trainer's loggers (CSV, TensorBoard) that do not exist yet."""
    directories = [getattr(logger, "log_dir", None) for logger in trainer.loggers]
    return [Path(d) for d in directories if d is not None and not Path(d).exists()]


def _missing_parents(directories: list[Path]) -> list[Path]:
    """The folders above ``directories`` that do not exist yet, deepest first (so each is emptied before its parent)."""
    missing = set()
    for directory in directories:
        parent = directory.parent
        while not parent.exists():
            missing.add(parent)
            parent = parent.parent
    return sorted(missing, key=lambda path: len(path.parts), reverse=True)


def _remove_if_empty(directory: Path) -> None:
    """Remove ``directory`` if it exists and is empty; one that another run has written to meanwhile is kept."""
    with contextlib.suppress(OSError):  # rmdir removes only an empty folder
        directory.rmdir()


def _remove_if_without_results(directory: Path) -> None:
    """Remove ``directory`` if it exists and holds only files a run writes before its first logged value."""
    if directory.is_dir() and all(
        any(path.match(pattern) for pattern in _SETUP_FILES) for path in directory.rglob("*") if path.is_file()
    ):
        shutil.rmtree(directory)


_PACKAGE = Path(__file__).parent
"""The package's folder, where the code that raises its own errors is."""


def _raised_here(error: BaseException) -> bool:
    """Whether ``error`` was raised by the package's own code."""
    traceback = error.__traceback__
    while traceback is not None and traceback.tb_next is not None:
        traceback = traceback.tb_next
    return traceback is not None and Path(traceback.tb_frame.f_code.co_filename).is_relative_to(_PACKAGE)


def _user_message(error: BaseException) -> str:
    """The message of the error in ``error``'s chain of causes that explains itself: the outermost one the package
    raised, else the innermost.

    Errors raised while instantiating a class from a config arrive wrapped by the config parser ("Does not validate
    against any of the Union subtypes ..."), with the package's own error as their cause; that one may in turn have
    the error it explains as its cause (``eps entries must be numbers or fractions such as '8/255'; got 'abc'`` from
    Python's ``Invalid literal for Fraction: 'abc'``).
    """
    chain = [error]
    while isinstance(chain[-1].__cause__, USER_ERRORS):
        chain.append(chain[-1].__cause__)
    return str(next((cause for cause in chain if _raised_here(cause)), chain[-1]))


def configs_directory() -> Path:
    """The folder of the configs shipped with the package (``configs/`` of a checkout)."""
    return Path(str(resources.files("rank_lightning") / "configs"))


def list_configs() -> list[str]:
    """Names of the bundled configs, as ``--config`` takes them: ``quickstart``, ``daneshmand/digits_bn``, ..."""
    root = configs_directory()
    paths = (path for suffix in CONFIG_SUFFIXES for path in root.rglob(f"*{suffix}"))
    names = (path.relative_to(root).with_suffix("").as_posix() for path in paths)
    # sweeps/ holds W&B sweep definitions (``wandb sweep <file>``), not LightningCLI configs.
    return sorted(name for name in names if not name.startswith("sweeps/"))


def resolve_config(value: str) -> str:
    """The file a ``--config`` value names.

    Args:
        value: a path (returned unchanged when the file exists), the name of a bundled config (``quickstart``,
            ``quickstart.yaml``, ``configs/quickstart.yaml`` or ``daneshmand/digits_bn``: resolved to the file
            shipped with the package, so the names work from any folder), or a YAML string (returned unchanged).

    Returns:
        The path of the config file, or ``value`` itself.

    Raises:
        ValueError: ``value`` is neither an existing file nor a bundled config's name nor YAML; the message lists the
            bundled configs.
    """
    if Path(value).is_file() or any(mark in value for mark in (":", "{", "\n")):
        return value
    name = value.removeprefix("./").removeprefix("configs/")
    for suffix in CONFIG_SUFFIXES:
        name = name.removesuffix(suffix)
    names = list_configs()
    if name in names:
        root = configs_directory()
        return str(next(root / f"{name}{suffix}" for suffix in CONFIG_SUFFIXES if (root / f"{name}{suffix}").is_file()))
    raise ValueError(
        f"config {value!r} is neither a file nor a bundled config; bundled configs are: {', '.join(names)}"
    )


def resolve_config_arguments(args: Sequence[str]) -> list[str]:
    """``args`` with every ``--config``/``-c`` value passed through :func:`resolve_config`."""
    resolved = list(args)
    for i, arg in enumerate(resolved):
        if arg in ("--config", "-c") and i + 1 < len(resolved):
            resolved[i + 1] = resolve_config(resolved[i + 1])
        elif arg.startswith("--config="):
            resolved[i] = "--config=" + resolve_config(arg.removeprefix("--config="))
    return resolved


_LINKED = ("num_classes", "input_shape")
"""Model settings the CLI takes from the datamodule (``link_arguments``)."""


def check_linked_settings(args: Sequence[str]) -> None:
    """Refuse a model setting on the command line that the CLI links from the datamodule (``num_classes``,
    ``input_shape``): the link would replace it without a word. (A ``--config`` file may hold them, as the configs
    the CLI saves into every run do; there the datamodule's value wins.)

    Raises:
        ValueError: naming the setting and where to set it instead.
    """
    keys = {f"--model.{prefix}{name}" for prefix in ("", "init_args.") for name in _LINKED}
    named = [arg.split("=", 1)[0] for arg in args if arg.split("=", 1)[0] in keys]
    if named:
        raise ValueError(
            f"{', '.join(named)}: the CLI takes num_classes and input_shape from the datamodule and would replace "
            "the value given; set the datamodule's instead (e.g. --data.init_args.num_classes for the synthetic data)"
        )


def print_configs() -> None:
    """Print the bundled configs' names and the folder they are in (``rank-lightning configs``)."""
    print(f"bundled configs (in {configs_directory()}), run with --config <name>:")
    for name in list_configs():
        print(f"  {name}")


def main(args: list[str] | None = None, *, run: bool = True) -> RankCLI:
    """Run the command line with ``args`` (``sys.argv[1:]`` when ``None``); the ``rank-lightning`` command.

    ``--config`` values may name a bundled config (:func:`resolve_config`); ``configs`` as the only argument lists
    them and exits. An error of :data:`USER_ERRORS` is printed as ``error: <message>`` on stderr and ends
    the program with exit code 1, unless the environment variable ``RANK_LIGHTNING_DEBUG`` is set to anything but
    ``0``, which re-raises it.
    """
    try:
        given = sys.argv[1:] if args is None else args
        if list(given) == ["configs"]:
            print_configs()
            raise SystemExit(0)
        resolved = resolve_config_arguments(given)
        check_linked_settings(resolved)
        # Lightning's own use of a deprecated torch pytree API, printed once in every run; nothing a user of
        # this command can act on.
        warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")
        if args is None:
            # LightningCLI warns when it is given arguments while the command line has some: the resolved ones
            # replace the command line's instead.
            sys.argv[1:] = resolved
        else:
            args = resolved
        return RankCLI(
            model_class=RankModule,
            datamodule_class=pl.LightningDataModule,
            save_config_callback=RunConfigCallback,
            parser_class=RankArgumentParser,
            subclass_mode_model=True,
            subclass_mode_data=True,
            args=args,
            run=run,
        )
    except USER_ERRORS as error:
        if os.environ.get(DEBUG_ENV, "") not in ("", "0"):
            raise
        sys.stderr.write(f"error: {_user_message(error)}\n({DEBUG_ENV}=1 shows the traceback)\n")
        raise SystemExit(1) from None


def console_main() -> None:
    """The ``rank-lightning`` command: :func:`main` on the command line's arguments, exit status 0 when it returns.

    A console script exits with what its function returns, and any object but ``None`` or an integer is printed and
    read as failure, so the command does not return :func:`main`'s ``RankCLI``.
    """
    main()
