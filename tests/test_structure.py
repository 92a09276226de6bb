"""The package's shape: short functions in the stateful layers, one callback per file named after it."""

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "rank_lightning"
MAX_FUNCTION_LINES = 50
# Shared pieces of the callbacks rather than callbacks of their own.
SHARED_CALLBACK_MODULES = {"__init__", "base", "curves"}


def _functions(path: Path) -> list[tuple[str, int]]:
    tree = ast.parse(path.read_text())
    return [
        (f"{path.relative_to(PACKAGE)}:{node.name}", node.end_lineno - node.lineno + 1)
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    ]


@pytest.mark.parametrize("package", ["metrics", "callbacks"])
def test_no_function_of_the_stateful_layers_is_longer_than_fifty_lines(package):
    functions = [item for path in sorted((PACKAGE / package).glob("*.py")) for item in _functions(path)]
    assert functions
    too_long = [(name, lines) for name, lines in functions if lines > MAX_FUNCTION_LINES]
    assert too_long == []


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def test_every_callback_has_a_file_of_its_own_named_after_it():
    import rank_lightning.callbacks as callbacks

    modules = {path.stem for path in (PACKAGE / "callbacks").glob("*.py")} - SHARED_CALLBACK_MODULES
    defined = {}
    for stem in modules:
        tree = ast.parse((PACKAGE / "callbacks" / f"{stem}.py").read_text())
        defined[stem] = [node.name for node in tree.body if isinstance(node, ast.ClassDef) and node.name[0] != "_"]
    assert all(len(classes) == 1 for classes in defined.values()), defined
    for stem, (name,) in defined.items():
        assert _snake(name).removesuffix("_monitor") == stem
        assert getattr(callbacks, name).__module__ == f"rank_lightning.callbacks.{stem}"
