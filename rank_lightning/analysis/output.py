"""Where the analysis commands write and what they show while they work.

* :func:`fresh_directory`: the output folder of a run, never one that already holds files (a numbered ``run_<n>``
  folder inside the requested one instead), so a second run cannot overwrite the first one's results;
* :func:`fresh_file`: the same for a command that writes one file: a numbered ``<stem>_<n><suffix>`` beside the
  requested file when it exists;
* :func:`progress_bar`: a ``rich`` progress bar on standard output, drawn only on a terminal and when not asked to be
  quiet (a log file or a pipe gets no control characters).
* :func:`print_written`: the closing summary, one line per group of files, short whatever the number of files;
* :func:`run_command`: a command's ``main`` run as ``python -m`` runs it, quiet when its reader stops early.

Both number from 2: the requested folder or file holds the first run, ``run_2`` (``<stem>_2``) the second, ``run_3``
the third. Neither creates anything: the writer creates the folders it needs (a run that fails leaves no empty folder
behind), and a path that cannot be written (an existing file where a folder is asked for, or the reverse) raises before
the work starts.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import NoReturn, TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

__all__ = ["at_least", "fresh_directory", "fresh_file", "print_written", "progress_bar", "run_command", "show_progress"]

# Files of a group named in full in the summary; longer groups show their first and last file.
_NAMED_FILES = 3


def run_command(main: Callable[[], object]) -> NoReturn:
    """Run a command's ``main`` and exit with its status: the ``int`` it returns, else 0.

    A reader that stops early (``python -m rank_lightning.analysis.report ... | head``) ends the command quietly with
    status 141 (128 + SIGPIPE, as a shell's own tools end), instead of a ``BrokenPipeError`` traceback on the
    terminal.
    """
    try:
        try:
            result = main()
        finally:
            sys.stdout.flush()
    except BrokenPipeError:
        # Standard output goes to the null device, so that Python's own flush at exit finds no closed pipe again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(141) from None
    raise SystemExit(result if isinstance(result, int) else 0)


def at_least(minimum: int) -> Callable[[str], int]:
    """An argparse ``type``: a whole number of at least ``minimum``; another value is an error naming it and the
    bound (``argument --heads: 0 is not a whole number of at least 1``)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least {minimum}")
        return value

    return parse


def _check_ancestors(target: Path) -> None:
    """Raise when the nearest existing folder above ``target`` is a file: no folder could be created there."""
    for parent in target.parents:
        if parent.exists():
            if not parent.is_dir():
                raise NotADirectoryError(f"cannot create {str(target)!r}: {str(parent)!r} is an existing file")
            return


def fresh_directory(target: str | Path) -> Path:
    """The folder a run writes into, chosen before the work starts and created by the writer (a run that fails
    leaves no empty folder behind).

    Args:
        target: the requested folder.

    Returns:
        ``target`` when it does not exist or is empty, else the first ``target/run_<n>`` (``n = 2, 3, ...``) that
        does not exist: ``target`` itself holds the first run.

    Raises:
        NotADirectoryError: ``target``, or the nearest existing folder above it, is an existing file.
    """
    target = Path(target)
    if target.exists() and not target.is_dir():
        raise NotADirectoryError(f"output folder {str(target)!r} is an existing file")
    _check_ancestors(target)
    if not target.exists() or not any(target.iterdir()):
        return target
    number = 2
    while (target / f"run_{number}").exists():
        number += 1
    return target / f"run_{number}"


def fresh_file(target: str | Path) -> Path:
    """The file a run writes, chosen before the work starts; the writer creates its folder.

    Args:
        target: the requested file, e.g. ``runs/theorem5.png``.

    Returns:
        ``target`` when it does not exist, else the first ``<stem>_<n><suffix>`` beside it (``runs/theorem5_2.png``,
        ``n = 2, 3, ...``) that does not exist: ``target`` itself holds the first run.

    Raises:
        IsADirectoryError: ``target`` is an existing folder.
        NotADirectoryError: the nearest existing folder above ``target`` is a file.
    """
    target = Path(target)
    if target.is_dir():
        raise IsADirectoryError(f"output file {str(target)!r} is an existing folder")
    _check_ancestors(target)
    if not target.exists():
        return target
    number = 2
    while (candidate := target.with_name(f"{target.stem}_{number}{target.suffix}")).exists():
        number += 1
    return candidate


def show_progress(quiet: bool, stream: TextIO | None = None) -> bool:
    """Whether to draw progress: not ``quiet`` and ``stream`` (standard output by default) is a terminal."""
    stream = sys.stdout if stream is None else stream
    return not quiet and stream.isatty()


class _Progress(Progress):
    """A ``rich`` progress that, disabled, also stops without a trace: older ``rich`` releases (13.0 among them) print
    an empty line when a disabled progress stops on a console that is not a terminal, which would open the output of
    every command run with ``--quiet`` or into a pipe. Its console is left as it is: lines printed through it
    (the sweep's start and end of each run) reach the stream whether the bar is drawn or not."""

    def stop(self) -> None:
        if not self.disable:
            super().stop()


def progress_bar(enabled: bool, stream: TextIO | None = None) -> Progress:
    """A progress bar (description, bar, ``done/total``, elapsed time) that vanishes when it stops.

    Args:
        enabled: draw it (see :func:`show_progress`), unless ``stream`` is a terminal that cannot redraw a line; a
            disabled bar accepts every call and draws nothing.
        stream: where to draw; standard output by default.

    Returns:
        The ``rich`` progress, to use as a context manager.
    """
    console = Console(file=sys.stdout if stream is None else stream, force_terminal=enabled or None)
    # A terminal that cannot redraw a line (TERM=dumb: an editor's shell, some CI consoles) gets no bar: rich draws
    # none there, only empty lines when it stops.
    enabled = enabled and console.is_interactive
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    return _Progress(*columns, console=console, disable=not enabled, transient=True)


def _file_list(paths: Sequence[Path]) -> str:
    names = [path.name for path in paths]
    if len(set(names)) < len(names):  # run folders all called version_0: name their parent too
        names = [f"{path.parent.name}/{path.name}" for path in paths]
    if len(names) <= _NAMED_FILES:
        return ", ".join(names)
    return f"{names[0]}, ..., {names[-1]}"


def print_written(directory: Path, groups: Mapping[str, Sequence[Path]], *, requested: str | Path) -> None:
    """Print where a run wrote and, per group, how many files and which.

    Args:
        directory: the folder written into (from :func:`fresh_directory`, or the folder of :func:`fresh_file`'s file).
        groups: ``group name -> files``, e.g. ``{"figures": [...], "tables": [...]}``; empty groups are left out.
        requested: the folder that was asked for, named when the run went into a ``run_<n>`` folder inside it; or,
            for a run that writes one file, the file that was asked for, named when it existed (the run then wrote
            a numbered file beside it).
    """
    requested = Path(requested)
    if requested == directory or any(requested == path for paths in groups.values() for path in paths):
        note = ""
    elif requested.parent == directory:
        note = f" ({requested} already existed)"
    else:
        note = f" ({requested} already held a run's files)"
    print(f"written to {directory}{note}:")
    width = max(len(name) for name in groups)
    for name, paths in groups.items():
        if paths:
            print(f"  {len(paths):>3} {name:<{width}}  {_file_list(paths)}")
