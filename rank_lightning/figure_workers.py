"""PNG figures drawn by worker processes, on the cores a finished fit leaves idle.

Drawing is matplotlib's work in Python, one core per figure (0.15-0.3 s for a figure of
:func:`~rank_lightning.plotting.layer_curves_figure`), and the figures of a run are independent: :func:`draw_figures`
shares them between the calling process and a few worker processes, and returns when every file is written, as
drawing them in place does. Figures come out the same, byte for byte: the workers draw with the caller's matplotlib
settings (``rcParams``) and the same :func:`~rank_lightning.plotting.save_figure`.

The workers:

- are fresh interpreters (``python -c``) that import this module and, with it, matplotlib, then draw what they are
  sent through a pipe. Nothing is forked from the training process (whose torch thread pools and logger threads a
  fork would copy in an unknown state), and the caller's ``__main__`` module is never imported again (as
  ``multiprocessing``'s spawn and fork-server methods do, which would run an unguarded training script twice).
- stay, idle, for the next figures of the process, and exit with it (or at :func:`shutdown_figure_workers`); one
  whose parent dies exits at the end of its input. They ignore Ctrl-C, which the training process handles.
- are started ahead of time by :func:`start_figure_workers`: the rank callbacks' curves call it on global rank zero
  when they record values, with the number of figures the run's curves will draw (none start for a run of fewer
  than :data:`MIN_PARALLEL_FIGURES`), so matplotlib's import (about a second of CPU per worker) is done while the
  model trains.
- number one less than the cores this process may run on (``os.sched_getaffinity``; the caller draws too), at most
  :data:`MAX_WORKERS`, and one less than the figures; none for fewer than :data:`MIN_PARALLEL_FIGURES` figures or on
  one core, and none in a frozen application (PyInstaller), whose interpreter is the application itself. The
  environment variable ``RANK_LIGHTNING_FIGURE_WORKERS`` sets the number (``0``: every figure is drawn in the calling
  process); a value that is not a number of workers is an error when a fit starts.

A figure whose drawing fails is returned with its error, and the others are still written. If a worker fails (killed,
the package not importable by a fresh interpreter, or no answer for :data:`STALL_SECONDS` once the calling process has
drawn its share: it is then killed), the figures it did not write are drawn in the calling process, with a warning:
none is lost.
"""

from __future__ import annotations

import atexit
import collections
import os
import pickle
import queue
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, NamedTuple

import matplotlib
from matplotlib import rc_context
from matplotlib.figure import Figure

from rank_lightning.plotting import save_figure

__all__ = [
    "MAX_WORKERS",
    "MIN_PARALLEL_FIGURES",
    "WORKERS_ENV",
    "FigureJob",
    "draw_figures",
    "figure_workers",
    "shutdown_figure_workers",
    "start_figure_workers",
]

WORKERS_ENV = "RANK_LIGHTNING_FIGURE_WORKERS"
"""Environment variable with the number of worker processes; ``0`` draws every figure in the calling process."""

MAX_WORKERS = 7
"""At most this many workers (each holds matplotlib, about 100 MiB); with the caller, eight figures at a time."""

MIN_PARALLEL_FIGURES = 4
"""Fewer figures than this are drawn in the calling process alone."""

STALL_SECONDS = 120.0
"""Once the calling process has drawn its share, a worker without an answer for this long is killed and its figure
drawn by the caller (one figure takes well under a second)."""

# Every message on the pipes: this tag, the length of the pickle (8 bytes, little-endian), the pickle; length 0 asks a
# worker to exit. A message longer than _MAX_MESSAGE is garbage (bytes some import printed before the redirect, say).
_TAG = b"rlfw"
_MAX_MESSAGE = 1 << 30

# rcParams that select or configure a GUI backend; workers draw on Agg whatever the caller displays with.
_RC_NOT_SENT = ("backend", "interactive", "macosx.", "tk.", "webagg.")


class FigureJob(NamedTuple):
    """One PNG file to draw: ``save_figure(draw(*args, **kwargs), path, dpi)``.

    Attributes:
        path: where the file goes (made absolute before it is handed to a worker).
        draw: a module-level function (one a fresh interpreter can import by name, such as those of
            :mod:`rank_lightning.plotting`) that returns the figure.
        args: its positional arguments (sent to a worker by pickle).
        kwargs: its keyword arguments.
        dpi: resolution of the file.
    """

    path: Path
    draw: Callable[..., Figure]
    args: tuple = ()
    kwargs: Mapping[str, Any] = {}
    dpi: int = 100


def _available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _setting() -> int | None:
    value = os.environ.get(WORKERS_ENV, "").strip()
    if not value:
        return None
    if not value.isdigit():
        raise ValueError(f"{WORKERS_ENV}={value!r} is not a number of worker processes; use 0 (none) or more")
    return int(value)


def figure_workers(count: int, workers: int | None = None) -> int:
    """How many worker processes help the calling process draw ``count`` figures (``0``: it draws them alone).

    Args:
        count: the number of figures.
        workers: the number asked for; ``None`` for ``RANK_LIGHTNING_FIGURE_WORKERS`` or, without it, one less than
            the available cores (at most :data:`MAX_WORKERS`; none below :data:`MIN_PARALLEL_FIGURES` figures).

    Raises:
        ValueError: a negative ``workers``, or an environment variable that is not a non-negative integer.
    """
    if workers is not None and workers < 0:
        raise ValueError(f"workers={workers} is not a number of worker processes; use 0 (none) or more")
    if workers is None:
        workers = _setting()
        if workers is None:
            workers = 0 if count < MIN_PARALLEL_FIGURES else min(_available_cores() - 1, MAX_WORKERS)
    if getattr(sys, "frozen", False):
        return 0
    return max(0, min(workers, count - 1))


class _Worker:
    """One worker interpreter and the pipe ends that talk to it."""

    def __init__(self) -> None:
        # Standard output is moved aside before anything is imported, so that nothing an import prints can reach the
        # answers; sys.path is the caller's, so that a package run from a source checkout is found too.
        code = (
            "import os, sys; answers = os.dup(1); os.dup2(2, 1); sys.stdout = sys.stderr; "
            f"sys.path[:] = {list(sys.path)!r}; from {__name__} import _serve; _serve(answers)"
        )
        self.process = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def draw(self, request: bytes) -> tuple[str, Any]:
        """Send a pickled ``(job, rc)`` and wait for the worker's answer (:func:`_serve`). Raises ``OSError`` or
        ``EOFError`` when the worker is gone."""
        assert self.process.stdin is not None and self.process.stdout is not None
        _write_message(self.process.stdin, request)
        return pickle.loads(_read_message(self.process.stdout))

    def kill(self) -> None:
        """End the worker now (a thread waiting for its answer sees the end of the pipe)."""
        self.process.kill()

    def ask_to_exit(self) -> None:
        """Send the exit message and close the input: the worker exits after its current figure."""
        stdin = self.process.stdin
        if stdin is None or stdin.closed:
            return  # asked already
        try:
            _write_message(stdin, b"")
        except OSError:
            pass  # already gone
        try:
            stdin.close()
        except OSError:
            pass

    def close(self, timeout: float = 10.0) -> None:
        """Ask the worker to exit and wait for it (killed after ``timeout`` seconds)."""
        self.ask_to_exit()
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()


class _Pool:
    """The process's figure workers, started on first use and kept. One drawing call uses them at a time."""

    def __init__(self) -> None:
        self.busy = threading.Lock()  # held while a call draws with the workers
        self._lock = threading.Lock()  # guards the list
        self._workers: list[_Worker] = []

    def get(self, size: int) -> list[_Worker]:
        """``size`` live workers, started where fewer are running."""
        with self._lock:
            for worker in [worker for worker in self._workers if not worker.alive]:
                self._workers.remove(worker)
                worker.close()
            while len(self._workers) < size:
                self._workers.append(_Worker())
            return self._workers[:size]

    def discard(self, worker: _Worker) -> None:
        with self._lock:
            if worker in self._workers:
                self._workers.remove(worker)
        worker.close(timeout=1.0)

    def shutdown(self, timeout: float = 5.0) -> None:
        """Ask every worker to exit, then wait for them together (``timeout`` seconds in all, then killed)."""
        with self._lock:
            workers, self._workers = self._workers, []
        for worker in workers:
            worker.ask_to_exit()
        deadline = time.monotonic() + timeout
        for worker in workers:
            worker.close(max(0.0, deadline - time.monotonic()))


_POOL = _Pool()
atexit.register(_POOL.shutdown)


def start_figure_workers(count: int = 2 * MAX_WORKERS) -> int:
    """Start now the workers that :func:`draw_figures` will use for ``count`` figures, so that their import of
    matplotlib is done by then. Returns at once, with the number of workers (``0`` where the caller draws alone).

    Raises:
        ValueError: ``RANK_LIGHTNING_FIGURE_WORKERS`` is not a non-negative integer.
    """
    workers = figure_workers(count)
    if workers:
        try:
            _POOL.get(workers)
        except Exception:  # no interpreter to start (an embedded Python), no processes left: never fail a fit here
            return 0  # draw_figures tries again and falls back to the caller, with a warning
    return workers


def shutdown_figure_workers() -> None:
    """Stop the worker processes (after the figures they are drawing); later figures start new ones."""
    _POOL.shutdown()


def _draw(job: FigureJob, rc: Mapping[str, Any] | None = None) -> Path:
    """Draw and write one job (under ``rc`` in a worker)."""
    if rc is None:
        return save_figure(job.draw(*job.args, **job.kwargs), job.path, dpi=job.dpi)
    with rc_context(rc):
        return save_figure(job.draw(*job.args, **job.kwargs), job.path, dpi=job.dpi)


def _sendable(error: Exception) -> Exception:
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:  # any error that does not survive the pipe is sent as its text
        return RuntimeError(repr(error))
    return error


def _write_message(stream: IO[bytes], message: bytes) -> None:
    stream.write(_TAG + len(message).to_bytes(8, "little") + message)
    stream.flush()


def _read_message(stream: IO[bytes]) -> bytes:
    """One message (see ``_TAG``); ``EOFError`` at the end of the stream, within a message or on bytes that are not
    one."""
    header = stream.read(len(_TAG) + 8)
    if len(header) != len(_TAG) + 8:
        raise EOFError("the other end closed the pipe")
    size = int.from_bytes(header[len(_TAG) :], "little")
    if header[: len(_TAG)] != _TAG or size > _MAX_MESSAGE:
        raise EOFError(f"not a message of the figure workers: {header!r}")
    message = stream.read(size)
    if len(message) != size:
        raise EOFError("the other end closed the pipe")
    return message


# A worker's answers: the path written, the error drawing raised, or a job it cannot even load (a function of the
# caller's __main__ module, say), which the caller then draws itself.
_WRITTEN, _FAILED, _UNLOADABLE = "written", "failed", "unloadable"
_HERE = object()  # in the queue of results: a job the caller draws


def _serve(answers_fd: int) -> None:
    """A worker's loop: read pickled ``(job, rc)`` messages from standard input, draw each, write each answer to
    ``answers_fd`` (the original standard output; standard output itself goes to standard error)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the training process's to handle
    # Closed on the way out: a file left open at exit is a ResourceWarning on the worker's standard error, which is
    # the training process's.
    with os.fdopen(answers_fd, "wb") as answers:
        _answer(sys.stdin.buffer, answers)


def _answer(requests: IO[bytes], answers: IO[bytes]) -> None:
    """Draw each request of ``requests`` and write its answer to ``answers``, until the exit message or the end."""
    while True:
        try:
            request = _read_message(requests)
        except EOFError:
            return
        if not request:  # the exit message
            return
        try:
            job, rc = pickle.loads(request)
        except Exception as error:  # the caller draws this job itself
            answer: tuple[str, Any] = (_UNLOADABLE, repr(error))
        else:
            try:
                answer = (_WRITTEN, _draw(job, rc))
            except Exception as error:  # reported by the caller, like an error drawn in place
                answer = (_FAILED, _sendable(error))
        _write_message(answers, pickle.dumps(answer, protocol=pickle.HIGHEST_PROTOCOL))


def draw_figures(
    jobs: Sequence[FigureJob],
    *,
    workers: int | None = None,
    on_figure: Callable[[int, Path | Exception], None] | None = None,
) -> list[Path | Exception]:
    """Draw and write every job, helped by worker processes where there are cores for them (module docstring).

    Args:
        jobs: the figures.
        workers: worker processes to use (see :func:`figure_workers`); ``0`` draws in this process alone.
        on_figure: called in this process with each job's index and result as it completes (progress).

    Returns:
        In job order, the path written or the exception its drawing raised.

    Raises:
        ValueError: a negative ``workers`` (or ``RANK_LIGHTNING_FIGURE_WORKERS``).
    """
    jobs = [job._replace(path=Path(os.path.abspath(job.path))) for job in jobs]
    results: dict[int, Path | Exception] = {}

    def finish(index: int, result: Path | Exception) -> None:
        results[index] = result
        if on_figure is not None:
            on_figure(index, result)

    count = figure_workers(len(jobs), workers)
    if count and _POOL.busy.acquire(blocking=False):  # another thread drawing with the workers: draw here alone
        try:
            _draw_with_workers(jobs, count, finish)
        finally:
            _POOL.busy.release()
    for index, job in enumerate(jobs):  # all of them without workers; those a failed worker left with them
        if index not in results:
            finish(index, _draw_here(job))
    return [results[index] for index in range(len(jobs))]


def _draw_here(job: FigureJob) -> Path | Exception:
    try:
        return _draw(job)
    except Exception as error:  # returned to the caller, who reports it
        return error


def _caller_rc() -> dict[str, Any]:
    """The caller's matplotlib settings that the workers draw with (no backend settings). Keys are filtered before
    values are read: reading ``rcParams["backend"]`` resolves the backend, which imports pyplot."""
    return {key: matplotlib.rcParams[key] for key in matplotlib.rcParams if not key.startswith(_RC_NOT_SENT)}


def _draw_with_workers(jobs: Sequence[FigureJob], count: int, finish: Callable[[int, Path | Exception], None]) -> None:
    """Share ``jobs`` between this thread and ``count`` workers (a thread feeds each); jobs a failed worker held are
    left out of ``finish``, with a warning, for the caller to draw."""
    try:
        workers = _POOL.get(count)
    except Exception as error:  # the caller draws every figure
        _warn_fallback(error)
        return
    rc = _caller_rc()
    todo: collections.deque[tuple[int, FigureJob]] = collections.deque(enumerate(jobs))
    done: queue.Queue[tuple[int, Any, BaseException | None]] = queue.Queue()

    def feed(worker: _Worker) -> None:
        while True:
            try:
                index, job = todo.popleft()
            except IndexError:
                return
            try:
                request = pickle.dumps((job, rc), protocol=pickle.HIGHEST_PROTOCOL)
            except Exception:  # a job that cannot be sent (a local function) is drawn by the caller
                done.put((index, _HERE, None))
                continue
            try:
                kind, answer = worker.draw(request)
            except (OSError, EOFError, pickle.UnpicklingError) as error:
                done.put((index, _HERE, error))  # this worker is done for; its job goes back to the caller
                _POOL.discard(worker)
                return
            done.put((index, _HERE if kind == _UNLOADABLE else answer, None))

    threads = [threading.Thread(target=feed, args=(worker,), daemon=True) for worker in workers]
    for thread in threads:
        thread.start()
    try:
        while True:  # this thread draws too, and reports the workers' figures between its own
            while not done.empty():
                _report(done.get(), finish)
            try:
                index, job = todo.popleft()
            except IndexError:
                break
            finish(index, _draw_here(job))
        _collect(threads, workers, done, lambda item: _report(item, finish))
    finally:
        todo.clear()  # after an error here: the workers take nothing more, and finish before the pool is released
        _collect(threads, workers, done, lambda item: None)


def _collect(threads: Sequence[threading.Thread], workers: Sequence[_Worker], done: queue.Queue, report: Any) -> None:
    """Report what the workers send until their threads end; kill the workers after :data:`STALL_SECONDS` without
    an answer (their threads then return their jobs to the caller)."""
    last = time.monotonic()
    while any(thread.is_alive() for thread in threads):
        try:
            item = done.get(timeout=0.05)
        except queue.Empty:
            if time.monotonic() - last > STALL_SECONDS:
                for worker, thread in zip(workers, threads):
                    if thread.is_alive():
                        worker.kill()
                last = time.monotonic()
            continue
        last = time.monotonic()
        report(item)
    for thread in threads:
        thread.join()
    while not done.empty():
        report(done.get())


def _report(item: tuple[int, Any, BaseException | None], finish: Callable[[int, Path | Exception], None]) -> None:
    """A worker's result to ``finish``; a job it could not draw stays for the caller (with a warning if it failed)."""
    index, result, failure = item
    if failure is not None:
        _warn_fallback(failure)
    if result is not _HERE:
        finish(index, result)


def _warn_fallback(error: BaseException) -> None:
    warnings.warn(
        f"a figure worker process failed ({error!r}); its figures are drawn in this process instead (set "
        f"{WORKERS_ENV}=0 to draw every figure here)",
        RuntimeWarning,
        stacklevel=2,
    )
