"""The files the callbacks write beside a run (curve files, figures, spectra, tables): each one replaced in one step,
and a failure to write one a warning, never the end of the fit.

A file is written beside its destination, under a name of its own (``.<name>.<pid>-<random>.partial``), then renamed
over it (:func:`replace_file`): a disk that fills up, a folder that turns read-only or a Ctrl-C in the middle of the
write leaves the earlier file whole, and two processes writing the same file never mix their bytes. What the
callbacks cannot write they report with :func:`unwritten_warning` and go on: the values are in the loggers, in memory
and in checkpoints.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import IO

__all__ = ["replace_file", "unwritten_warning"]


def replace_file(path: str | Path, write: Callable[[IO[bytes]], object]) -> Path:
    """Write ``path`` in one step: ``write`` fills a new file beside it, which is then renamed over it (its folder
    is created). The new file has the permissions an ordinary ``open`` gives (the umask applies).

    Raises:
        OSError: the folder or the file could not be written; ``path`` is then as it was, and no partial file stays.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.partial")
    try:
        with open(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "wb") as handle:
            write(handle)
        os.replace(partial, path)
    finally:
        with contextlib.suppress(OSError):  # gone once renamed; a folder turned read-only keeps the first error
            partial.unlink(missing_ok=True)
    return path


def unwritten_warning(path: str | Path, error: BaseException, kept: str) -> str:
    """The message of a file a callback could not write: the path, the error, and where the values are ``kept``."""
    return f"could not write {path} ({error!r}); the run goes on, {kept}"
