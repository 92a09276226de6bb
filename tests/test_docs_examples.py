"""The documentation as a reader follows it: the Python blocks and command lines of README.md and docs/*.md.

Python blocks. A block that imports or defines every name it uses is an example to run: it runs as written, in a
temporary folder. Any other block is a fragment around the reader's own objects (``model``, ``train_loader``): its
imports of the package, Lightning and torch run (with those of the page's earlier blocks), and every call of what
they import, or of a method of an object built from it, must name attributes that exist and arguments they take; so
must the calls quoted in the prose (`RankPretraining(num_batches=M, steps=T)`).

Command lines. Every ``configs/``, ``scripts/``, ``benchmarks/``, ``tests/`` or ``docs/`` path and every relative
link exists; every ``train.py`` / ``rank-lightning`` command (bash blocks and inline code) prints its config, names
only keys of that config (no abbreviation) and builds its model, data and trainer; every option of a
``python -m rank_lightning...`` tool or a benchmark script, and every bare ``--option`` of the prose, exists.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import importlib
import inspect
import io
import random
import re
import shlex
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml

from rank_lightning.cli import check_linked_settings, main, resolve_config
from rank_lightning.layers import classifier_head, select_layers

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CHECKED_IMPORTS = ("rank_lightning", "pytorch_lightning", "lightning", "torch")
PATH = re.compile(r"(?<![\w/.])((?:configs|scripts|benchmarks|tests|docs)/(?!_build/)[\w/.=-]*\w)")
CLI_FLAG = re.compile(r"^--(trainer|model|data|seed_everything|ckpt_path|optimizer|lr_scheduler)(?=[.=]|$)")


def _fenced(page: Path, language: str) -> list[tuple[str, str]]:
    """``(where, code)`` of the page's fenced blocks of ``language``, ``where`` being ``page:line``."""
    text = page.read_text()
    pattern = re.compile(rf"^```{language}\n(.*?)^```", re.MULTILINE | re.DOTALL)
    return [(f"{page.name}:{text[: m.start()].count(chr(10)) + 1}", m.group(1)) for m in pattern.finditer(text)]


def _prose(page: Path) -> str:
    return " ".join(re.sub(r"^```.*?^```", "", page.read_text(), flags=re.MULTILINE | re.DOTALL).split())


def _free_names(tree: ast.AST) -> set[str]:
    """Names the code reads but neither imports, defines, assigns nor takes as an argument (scopes merged)."""
    bound, read = set(dir(builtins)), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.alias):
            bound.add((node.asname or node.name).split(".")[0])
    return read - bound


PYTHON_BLOCKS = [(where, code) for page in PAGES for where, code in _fenced(page, "python")]
EXAMPLES = [(where, code) for where, code in PYTHON_BLOCKS if not _free_names(ast.parse(code))]


def test_the_docs_have_runnable_examples_and_fragments():
    assert len(EXAMPLES) >= 5 and len(PYTHON_BLOCKS) - len(EXAMPLES) >= 5, [where for where, _ in EXAMPLES]


@pytest.mark.parametrize(("where", "code"), EXAMPLES, ids=[where for where, _ in EXAMPLES])
def test_a_self_contained_example_runs_as_written(where, code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    exec(compile(code, where, "exec"), {"__name__": "__docs__"})


def _checked_imports(code: str) -> list[ast.stmt]:
    return [
        node
        for node in ast.parse(code).body
        if isinstance(node, (ast.Import, ast.ImportFrom))
        and all(name.split(".")[0] in CHECKED_IMPORTS for name in _imported_modules(node))
    ]


def _imported_modules(node: ast.Import | ast.ImportFrom) -> list[str]:
    return [alias.name for alias in node.names] if isinstance(node, ast.Import) else [node.module or ""]


def _resolve(chain: list[str], namespace: dict, instances: dict, where: str) -> Any:
    """The object a dotted call target names, or ``None`` where the reader's own objects name it."""
    if chain[0] in instances:
        cls, rest = instances[chain[0]], chain[1:]
        if rest and not hasattr(cls, rest[0]):
            sources = "".join(inspect.getsource(c) for c in cls.__mro__ if c.__module__.startswith(CHECKED_IMPORTS))
            assert re.search(rf"self\.{rest[0]}\b", sources), f"{where}: {cls.__name__} has no attribute {rest[0]!r}"
            return None
        obj = cls
    elif chain[0] in namespace:
        obj, rest = namespace[chain[0]], chain[1:]
    else:
        return None
    for name in rest:
        assert hasattr(obj, name), f"{where}: {'.'.join(chain)}: {obj!r} has no attribute {name!r}"
        obj = getattr(obj, name)
    return obj


def _chain(node: ast.expr) -> list[str] | None:
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute) and (head := _chain(node.value)) is not None:
        return [*head, node.attr]
    return None


def _instances(code: str, namespace: dict, where: str) -> dict[str, type]:
    """``{name: class}`` of the block's ``name = Class(...)`` of classes it imports (their methods are checked too)."""
    instances = {}
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            chain = _chain(node.value.func) if isinstance(node.value, ast.Call) else None
            built = _resolve(chain, namespace, {}, where) if chain else None
            if isinstance(built, type):
                instances[node.targets[0].id] = built
    return instances


def _check_calls(where: str, code: str, namespace: dict) -> int:
    """Every call of an imported object, or of a method of an object built from one, binds; returns how many."""
    instances, checked = _instances(code, namespace, where), 0
    for node in ast.walk(ast.parse(code)):
        chain = _chain(node.func) if isinstance(node, ast.Call) else None
        target = _resolve(chain, namespace, instances, where) if chain else None
        if (
            target is None
            or any(isinstance(a, ast.Starred) for a in node.args)
            or None in [k.arg for k in node.keywords]
        ):
            continue
        try:
            signature = inspect.signature(target)
        except (TypeError, ValueError):  # a builtin without a signature
            continue
        self = [None] if chain[0] in instances and inspect.isfunction(target) else []
        try:
            signature.bind_partial(*self, *node.args, **{k.arg: None for k in node.keywords})
        except TypeError as error:
            raise AssertionError(f"{where}: {ast.unparse(node)[:120]}: {error}") from None
        checked += 1
    return checked


def test_every_python_block_calls_the_package_as_it_is():
    checked = 0
    for page in PAGES:
        namespace: dict = {}
        for where, code in _fenced(page, "python"):
            for node in _checked_imports(code):  # the page's earlier imports stay in scope, as for a reader
                exec(compile(ast.Module(body=[node], type_ignores=[]), where, "exec"), namespace)
            checked += _check_calls(where, code, namespace)
    assert checked >= 40, checked


def _commands() -> list[tuple[str, list[str]]]:
    """``(where, words)`` of every command line of the bash blocks and of the prose's inline code."""
    commands = []
    for page in PAGES:
        for where, code in _fenced(page, "bash"):
            for line in code.replace("\\\n", " ").splitlines():
                commands.append((where, shlex.split(line, comments=True)))
        for span in re.findall(r"`((?:python |train\.py |rank-lightning |make )[^`]*)`", _prose(page)):
            commands.append((page.name, shlex.split(span)))
    # leading environment settings (MASTER_ADDR=... python ...) are not words of the command
    return [(where, words[[("=" in w) for w in words].index(False) :]) for where, words in commands if words]


def _lightning_arguments() -> list[tuple[str, list[str]]]:
    """The arguments of every ``train.py`` / ``rank-lightning`` command, placeholders (``<ckpt>``) filled in."""
    found = []
    for where, words in _commands():
        if words[:2] in (["python", "train.py"], [".venv/bin/python", "train.py"]):
            words = words[1:]
        if words and words[0] in ("train.py", "rank-lightning") and ("--config" in words or words[1:] == ["configs"]):
            arguments = ["last.ckpt" if "<" in w else str(ROOT / w) if PATH.fullmatch(w) else w for w in words[1:]]
            found.append((where, arguments))
    return found


def _printed_config(arguments: list[str]) -> dict:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), pytest.raises(SystemExit) as stop:
        main([*arguments, "--print_config"])
    assert stop.value.code in (0, None), err.getvalue()[-2000:]
    return yaml.safe_load(out.getvalue())


def _has_key(config: Any, flag: str) -> bool:
    """Whether the config holds the dotted key of ``--a.b.c=value`` (in any element of a list, such as loggers)."""
    key, _, rest = flag.removeprefix("--").split("=", 1)[0].partition(".")
    if isinstance(config, list):
        return any(_has_key(item, f"{key}.{rest}" if rest else key) for item in config)
    return isinstance(config, dict) and key in config and (not rest or _has_key(config[key], rest))


LIGHTNING_COMMANDS = {" ".join(args): where for where, args in _lightning_arguments() if args != ["configs"]}
IDS = [re.sub(r"\S*/configs/", "configs/", command) for command in sorted(LIGHTNING_COMMANDS)]


@pytest.fixture
def _seeds_kept(monkeypatch):
    """The configs' ``seed_everything`` seeds the global generators and sets PL_GLOBAL_SEED: both are put back."""
    for name in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS"):
        monkeypatch.delenv(name, raising=False)
    states = random.getstate(), np.random.get_state()  # noqa: NPY002 - the global streams themselves
    with torch.random.fork_rng(devices=[]):
        yield
    random.setstate(states[0])
    np.random.set_state(states[1])  # noqa: NPY002


@pytest.mark.parametrize("command", sorted(LIGHTNING_COMMANDS), ids=IDS)
def test_a_documented_training_command_parses_and_builds(command, tmp_path, monkeypatch, _seeds_kept):
    monkeypatch.chdir(tmp_path)
    where, arguments = LIGHTNING_COMMANDS[command], [a for a in command.split() if a != "--print_config"]
    config = _printed_config(arguments)
    flags = [a for a in arguments if a.startswith("--") and a not in ("--config", "--print_config")]
    unknown = [flag for flag in flags if not _has_key(config, flag)]
    assert not unknown, f"{where}: {command}: no such key in the resolved config: {unknown}"
    # Build model, data and trainer (run=False: no subcommand, no checkpoint), on the CPU where no device is named.
    built = [a for i, a in enumerate(arguments[1:]) if "--ckpt_path" not in (a, arguments[i])]
    if not any(a.startswith("--trainer.accelerator") for a in built) and config["trainer"]["accelerator"] == "auto":
        built.append("--trainer.accelerator=cpu")
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            cli = main(built, run=False)
    except SystemExit:
        raise AssertionError(f"{where}: {command}: {err.getvalue()[-2000:]}") from None
    assert cli.model is not None and cli.datamodule is not None and cli.trainer is not None


def test_rank_lightning_configs_lists_the_bundled_configs(capsys):
    assert ["configs"] in [arguments for _, arguments in _lightning_arguments()]
    with pytest.raises(SystemExit) as stop:
        main(["configs"])
    assert stop.value.code == 0 and "  quickstart\n" in capsys.readouterr().out


def _tool_options(words: list[str]) -> tuple[str, str] | None:
    """``(tool, its options text)`` of a ``python -m rank_lightning...`` or ``python benchmarks/...`` command."""
    if words[:2] == ["python", "-m"] and words[2].startswith("rank_lightning"):
        module = importlib.import_module(words[2])
        entry = getattr(module, "main", None) or importlib.import_module(f"{words[2]}.__main__").main
        out = io.StringIO()
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
            entry(["--help"])
        return words[2], out.getvalue()
    scripts = [w for w in words[:2] if w.startswith("benchmarks/")]
    return (scripts[0], (ROOT / scripts[0]).read_text()) if scripts else None


def test_every_documented_tool_option_exists():
    tools = {}
    for where, words in _commands():
        if (tool := _tool_options(words)) is not None:
            tools.setdefault(tool[0], tool[1])
            missing = [w for w in words if w.startswith("--") and not _names(tool[1], w)]
            assert not missing, f"{where}: {' '.join(words)}: {tool[0]} has no option {missing}"
        elif words[0] == "make":
            targets = re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.MULTILINE)
            assert set(words[1:]) <= set(targets), f"{where}: {' '.join(words)}: Makefile targets are {targets}"
    assert {"rank_lightning.analysis.report", "rank_lightning.analysis.sweep", "rank_lightning.reproduce"} <= set(tools)
    # A bare option of the prose (`--namespaces jacobian`) belongs to train.py or to one of the documented tools.
    scripts = {path for page in PAGES for path in PATH.findall(page.read_text()) if path.startswith("benchmarks/")}
    options = "\n".join([*tools.values(), *((ROOT / path).read_text() for path in scripts)])
    config = _printed_config(["fit", "--config", str(ROOT / "configs/quickstart.yaml"), "--config", "loggers/wandb"])
    for page in PAGES:
        for span in re.findall(r"`(--[^`]*)`", _prose(page)):
            for option in (w for w in span.split() if w.startswith("--")):
                if CLI_FLAG.match(option):
                    known = _has_key(config, option) or _refused(option)
                else:
                    known = option == "--config" or _names(options, option)
                assert known, f"{page.name}: `{span}`: no option {option.split('=')[0]}"
            if span.startswith("--config "):
                resolve_config(span.split()[1])


def _names(text: str, option: str) -> bool:
    """Whether ``text`` (a tool's help or source) names ``option`` (``--out``, not ``--output``; ``=value`` aside)."""
    return re.search(rf"{re.escape(option.split('=')[0])}(?![\w-])", text) is not None


def _refused(option: str) -> bool:
    """Whether the command line refuses the option by name (the model settings linked from the datamodule)."""
    try:
        check_linked_settings([option])
    except ValueError:
        return True
    return False


def test_every_path_and_link_of_the_docs_exists():
    for page in PAGES:
        text = page.read_text()
        missing = [path for path in PATH.findall(text) if not (ROOT / path).exists()]
        assert not missing, f"{page.name} names missing files: {missing}"
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if target.startswith("#"):
                assert target[1:] in _anchors(text), f"{page.name}: no heading for the link {target}"
            elif not target.startswith(("http://", "https://")):
                assert (page.parent / target.split("#")[0]).exists(), f"{page.name}: broken link {target}"


def _anchors(text: str) -> set[str]:
    """GitHub's anchors of the page's headings: lower case, punctuation dropped, spaces to dashes."""
    headings = re.findall(r"^#+ (.+)$", re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


def test_the_documented_block_index_pattern_selects_the_blocks_of_a_six_block_model():
    # docs/transformers.md's one-character index pattern, on a T5-small-sized encoder (6 blocks, fewer than ten).
    text = " ".join((ROOT / "docs/transformers.md").read_text().split())
    recipe = re.search(r"one character at a time: `layers=(\[[^`]*\])` selects blocks 0 to 9", text)
    assert recipe is not None, "the index pattern recipe is gone from docs/transformers.md"
    blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()) for _ in range(6))
    model = torch.nn.ModuleDict({"model": torch.nn.ModuleDict({"encoder": torch.nn.ModuleDict({"block": blocks})})})
    chosen = select_layers(model, ast.literal_eval(recipe.group(1)))
    assert list(chosen.values()) == [f"model.encoder.block.{i}" for i in range(6)]


def test_the_documented_language_model_head_names_a_module_of_the_pages_language_model():
    # docs/transformers.md's LightningModule holds GPT2LMHeadModel as `self.model`: its head is `model.lm_head`.
    text = (ROOT / "docs/transformers.md").read_text()
    assert "self.model = GPT2LMHeadModel(" in text
    heads = re.findall(r'head="([^"]+)"', text.split("### Neural collapse of the next-token classes")[1])
    assert heads, "the next-token neural collapse section names no head"
    layers = {"transformer": torch.nn.Linear(4, 4), "lm_head": torch.nn.Linear(4, 10)}
    module = torch.nn.ModuleDict({"model": torch.nn.ModuleDict(layers)})
    for head in heads:
        assert classifier_head(module, head) == "model.lm_head"


def test_every_inline_call_of_the_prose_takes_its_arguments():
    # `WeightRankMonitor(tail_ranks=(1, 10))`, `EarlyStopping(monitor=..., strict=False)`: calls quoted in the prose.
    import pytorch_lightning as pl

    import rank_lightning.callbacks as callbacks
    from rank_lightning import functional, nn
    from rank_lightning.metrics import ActivationSpectrum
    from rank_lightning.tracker import RankTracker

    namespace = {name: getattr(callbacks, name) for name in callbacks.__all__} | {
        "EarlyStopping": pl.callbacks.EarlyStopping,
        "ModelCheckpoint": pl.callbacks.ModelCheckpoint,
        "ActivationSpectrum": ActivationSpectrum,
        "RankTracker": RankTracker,
        "LRLayer": nn.LRLayer,
        "insert_lr_layer": nn.insert_lr_layer,
        "functional": functional,
    }
    checked = 0
    for page in PAGES:
        for span in re.findall(r"`([^`]+\))`", _prose(page)):
            with contextlib.suppress(SyntaxError):
                checked += _check_calls(page.name, span, namespace)
    assert checked >= 20, checked


def test_the_readmes_lightning_module_methods_log_the_spectrum_and_the_quoted_error_is_lightnings():
    # README's ActivationSpectrum in a LightningModule: its two methods in a module, validated; and the error it
    # quotes for logging the metric object itself.
    import pytorch_lightning as pl

    from rank_lightning.metrics import ActivationSpectrum

    text = (ROOT / "README.md").read_text().split("so a `LightningModule` cannot log the metric object")[1]
    quoted = re.search(r'fails with Lightning\'s "(.+?)"\. Update', " ".join(text.split())).group(1)
    methods: dict = {}
    exec(text.split("```python\n")[1].split("```")[0], methods)

    class Module(pl.LightningModule):
        def __init__(self, log_the_metric: bool = False) -> None:
            super().__init__()
            self.backbone, self.spectrum = torch.nn.Linear(4, 6), ActivationSpectrum(num_classes=3)
            self.log_the_metric = log_the_metric

        def validation_step(self, batch, batch_idx):
            methods["validation_step"](self, batch, batch_idx)
            if self.log_the_metric:
                self.log("val_rank", self.spectrum)

        def on_validation_epoch_end(self):
            if not self.log_the_metric:
                methods["on_validation_epoch_end"](self)

    data = torch.utils.data.TensorDataset(torch.eye(4).repeat(3, 1), torch.arange(12) % 3)
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    trainer = pl.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")
    module = Module()
    (logged,) = trainer.validate(module, loader, verbose=False)
    assert logged["val_rank/numerical_rank"] == 4 and logged["val_rank/spectrum_rows"] == 12
    assert int(module.spectrum.num_samples) == 0  # reset for the next epoch
    with pytest.raises(ValueError, match=re.escape(quoted)):
        trainer.validate(Module(log_the_metric=True), loader, verbose=False)
