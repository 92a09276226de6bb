"""The files the callbacks write beside a run (curve files, figures, spectra, tables): each one replaced in one step,
and a failure to write one a warning, never the end of the fit.

A file is written beside its destination, under a name of its own (``.<name>.<pid>-<random>.partial``), then renamed
over it (:func:`replace_file`): a disk that fills up, a folder that turns read-only or a Ctrl-C in the middle of the
write leaves the earlier file whole, and two processes writing the same file never mix their bytes. What the
callbacks cannot write they report with :func:`unwritten_warning` and go on: the values are in the loggers, in memory
and in checkpoints. A file of another run found where a run writes its own (a second fit into the same folder) is kept
under another name (:class:`RunFiles`). A debug run (``Trainer(fast_dev_run=...)``), for which Lightning writes no logs
and no checkpoints, gets no files either (:func:`writes_files`): its callbacks measure and log as usual.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO

__all__ = ["RunFiles", "file_stamp", "free_version", "replace_file", "unwritten_warning", "writes_files"]


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


def writes_files(trainer: object) -> bool:
    """Whether the callbacks write files for the run of ``trainer``: not for a debug run (``fast_dev_run``), for which
    Lightning writes no logs and no checkpoints either; its files would land in ``default_root_dir`` (the working
    directory by default) and push the files of a real run there aside (:class:`RunFiles`)."""
    return not getattr(trainer, "fast_dev_run", False)


def unwritten_warning(path: str | Path, error: BaseException, kept: str) -> str:
    """The message of a file a callback could not write: the path, the error, and where the values are ``kept``."""
    return f"could not write {path} ({error!r}); the run goes on, {kept}"


def free_version(path: str | Path) -> Path:
    """The first ``<stem>-v<n><suffix>`` beside ``path`` (``n = 1, 2, ...``) that does not exist: where a file or folder
    of an earlier run is kept when a new run would write over it (Lightning names checkpoints so, too)."""
    path = Path(path)
    version = 1
    while os.path.lexists(candidate := path.with_name(f"{path.stem}-v{version}{path.suffix}")):
        version += 1
    return candidate


class RunFiles:
    """The files and folders of a run directory that one writer (a callback's history) has made its own.

    Before its first write of a path, a writer calls :meth:`claim`: a path left there by another run (a second fit
    into the same folder: ``logger=False``, or a logger with a fixed version) is renamed to the first free
    ``<stem>-v<n><suffix>`` (:func:`free_version`), with a warning naming both, so that nothing of that run is
    overwritten. A writer that continues a saved run (its history loaded from a checkpoint) sets :attr:`continues`:
    the files it finds are its own. A file the writer has written (:meth:`wrote`) and finds changed by someone else
    before its next write (two runs writing the same folder at the same time) is set aside again.

    Args:
        owner: the writer, in words, first in its warnings (``"LayerCurves('rank')"``).
    """

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.continues = False
        self._claimed: set[str] = set()
        self._written: dict[str, tuple[int, int, int] | None] = {}
        self._warned: set[tuple[str, str]] = set()

    def wrote(self, path: str | Path) -> None:
        """Note that the writer has just written the file ``path``, so that a later change by another is seen."""
        self._written[str(path)] = file_stamp(path)

    def claim(self, path: str | Path, what: str) -> bool:
        """Make ``path`` (a file or folder) this run's before its first write (see the class); whether it may be
        written: not when the earlier one could not be set aside (a warning, once per path and error; it is left as it
        is).

        Args:
            path: the file or folder.
            what: what it holds, in words (``"curves"``, ``"singular values"``), for the warnings.
        """
        return self.claim_all([path], what)[0]

    def claim_all(self, paths: Sequence[str | Path], what: str) -> list[bool]:
        """:meth:`claim` every path of ``paths`` (files a writer makes together, such as the figures of a run), with
        one warning for all those set aside rather than one each; whether each may be written.

        Args:
            paths: the files or folders.
            what: what they hold, in words (``"figures"``), for the warnings.
        """
        kept: list[tuple[Path, Path]] = []
        allowed = []
        for path in paths:
            may_write, aside = self._claim(Path(path), what)
            allowed.append(may_write)
            if aside is not None:
                kept.append((Path(path), aside))
        if len(kept) == 1:
            path, aside = kept[0]
            message = f"{self.owner}: {path} held the {what} of another run; they are kept as {aside.name} and this "
            warnings.warn(message + "run writes its own", UserWarning, stacklevel=3)
        elif kept:
            names = ", ".join(f"{path.name} as {aside.name}" for path, aside in kept)
            message = f"{self.owner}: {len(kept)} files in {kept[0][0].parent} held the {what} of another run; "
            warnings.warn(message + f"they are kept ({names}) and this run writes its own", UserWarning, stacklevel=3)
        return allowed

    def _claim(self, path: Path, what: str) -> tuple[bool, Path | None]:
        """``(may write, where another run's path was moved)`` for one path of :meth:`claim_all`."""
        key = str(path)
        if key in self._claimed:
            written = self._written.get(key)
            if written is None or file_stamp(path) in (None, written):
                return True, None  # its own (or gone): a file written since by another writer is set aside below
        elif self.continues or not os.path.lexists(path):  # (never raises: an unreadable folder fails the write)
            self._claimed.add(key)
            return True, None
        aside = free_version(path)
        try:
            os.replace(path, aside)
        except OSError as error:
            if (key, repr(error)) not in self._warned:
                self._warned.add((key, repr(error)))
                message = (
                    f"{self.owner}: {path} holds the {what} of another run and could not be renamed to {aside.name} "
                    f"({error!r}); it is left as it is and this run's {what} are not written there"
                )
                warnings.warn(message, RuntimeWarning, stacklevel=4)
            return False, None
        self._claimed.add(key)
        return True, aside


def file_stamp(path: str | Path) -> tuple[int, int, int] | None:
    """What tells one version of a file from another: inode (a new one at every :func:`replace_file`), modification
    time and size; ``None`` when there is no file."""
    try:
        status = os.stat(path)
    except OSError:
        return None
    return status.st_ino, status.st_mtime_ns, status.st_size
