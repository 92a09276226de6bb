"""The frame every reproduction runs in: the registry, the run context, the claim rows and the written files.

An experiment is a function ``run(context) -> list[Claim]`` registered under a name with :func:`experiment`. It
reads its sizes from ``context.quick``, reports progress with :meth:`Context.total` and :meth:`Context.advance`,
writes its figure with :meth:`Context.save`, every number the figure shows with :meth:`Context.write_csv`, and
returns one :class:`Claim` per statement of the paper it checks: the claim in words, the paper's number, ours, and a
verdict (``reproduced``, ``partly`` or ``not``). :func:`run_experiments` runs several into one output folder (never a
folder that already holds a run: :func:`~rank_lightning.analysis.output.fresh_directory`) and writes the summary
table of all their claims (``summary.csv`` and ``summary.md``). A quick run marks its summary (:data:`QUICK_NOTE`):
its verdicts come from smoke-test sizes and cannot stand for the documented ones.
"""

from __future__ import annotations

import csv
import io
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from matplotlib.figure import Figure
from PIL import Image
from rich.progress import Progress, TaskID

from rank_lightning.analysis.output import fresh_directory, progress_bar
from rank_lightning.reproduce.training import check_data_dir
from rank_lightning.validation import check_choice, check_choices

__all__ = [
    "DEVICE_TYPES",
    "EXPERIMENTS",
    "QUICK_NOTE",
    "VERDICTS",
    "Claim",
    "Context",
    "Experiment",
    "ExperimentResult",
    "check_device",
    "experiment",
    "marked_verdict",
    "run_experiments",
    "verdict",
    "write_summary",
]

VERDICTS = ("reproduced", "partly", "not")
# What every quick run's summary and printed verdicts say about themselves.
QUICK_NOTE = (
    "quick mode: smoke-test sizes, too small to confirm or refute the papers' claims; these verdicts only show that "
    "the experiments run (the verdicts at the default sizes are in docs/reproductions.md)"
)
# The value of the ``sizes`` column a quick run adds to ``summary.csv``, and the mark after its verdicts.
QUICK_SIZES = "quick (smoke test: cannot confirm the claim)"
QUICK_MARK = "quick size"
# Figures are committed to the documentation: small PNGs (a few tens of KB).
_DPI = 72
_COLORS = 96


@dataclass(frozen=True)
class Claim:
    """One statement of a paper checked by one experiment: a row of the summary table.

    Attributes:
        experiment: the experiment's registered name.
        claim: the paper's statement in words.
        paper: the paper's number (or the shape of its result) as text.
        ours: our measurement as text.
        verdict: ``reproduced``, ``partly`` or ``not``.
        reason: why the verdict, in a sentence (what differs from the paper's setting, which check failed).
        value: the headline number itself (for tests and tables); NaN when the claim has none.
    """

    experiment: str
    claim: str
    paper: str
    ours: str
    verdict: str
    reason: str = ""
    value: float = math.nan

    def __post_init__(self) -> None:
        check_choice("verdict", self.verdict, VERDICTS)


def verdict(holds: bool, partly: bool = False) -> str:
    """``reproduced`` when ``holds``, else ``partly`` when ``partly``, else ``not``."""
    return "reproduced" if holds else "partly" if partly else "not"


def marked_verdict(verdict: str, quick: bool) -> str:
    """``verdict`` as shown in tables and printed lines: followed by ``(quick size)`` in a quick run."""
    return f"{verdict} ({QUICK_MARK})" if quick else verdict


@dataclass
class Context:
    """What an experiment is given: its sizes, device, output folder and progress.

    Attributes:
        name: the experiment's name (prefix of its files).
        quick: smoke-test sizes (about a minute at most) instead of the full ones.
        device: where the networks run.
        directory: the run's folder; the experiment writes into ``directory / name``.
        seed: base seed; experiments derive their seeds from it.
        data_dir: folder holding torchvision's Fashion-MNIST files (``FashionMNIST/raw``), used instead of the
            bundled digits by every experiment that trains a classifier; ``None`` uses the digits.
        files: the paths written so far.
    """

    name: str
    quick: bool
    device: torch.device
    directory: Path
    seed: int = 0
    data_dir: Path | None = None
    files: list[Path] = field(default_factory=list)
    _progress: Progress | None = None
    _task: TaskID | None = None

    @property
    def folder(self) -> Path:
        """``directory / name``, created on first use."""
        folder = self.directory / self.name
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    def size(self, full: Any, quick: Any) -> Any:
        """``quick`` in a quick run, else ``full``."""
        return quick if self.quick else full

    def total(self, steps: int) -> None:
        """Announce the number of progress steps of this experiment."""
        if self._progress is not None and self._task is not None:
            self._progress.update(self._task, total=steps, completed=0)

    def advance(self, steps: int = 1) -> None:
        """Move the progress bar by ``steps``."""
        if self._progress is not None and self._task is not None:
            self._progress.advance(self._task, steps)

    def write_csv(self, stem: str, rows: Sequence[Mapping[str, Any]]) -> Path:
        """Write ``rows`` (dicts with the same keys) to ``<folder>/<stem>.csv``; floats with 6 significant digits."""
        path = self.folder / f"{stem}.csv"
        columns: list[str] = []
        for row in rows:
            columns += [key for key in row if key not in columns]
        with path.open("w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=columns)
            writer.writeheader()
            for row in rows:
                writer.writerow({key: _cell(row.get(key, "")) for key in columns})
        self.files.append(path)
        return path

    def save(self, figure: Figure, stem: str) -> Path:
        """Save ``figure`` as ``<folder>/<stem>.png``, documentation-sized: a small resolution and a palette of
        :data:`_COLORS` colours (a few tens of KB instead of a few hundred)."""
        path = self.folder / f"{stem}.png"
        buffer = io.BytesIO()
        figure.savefig(buffer, dpi=_DPI, format="png")
        buffer.seek(0)
        with Image.open(buffer) as image:
            # Image.MEDIANCUT, not Image.Quantize.MEDIANCUT: the enum is Pillow 9.1's, and Pillow >= 9 is supported.
            image.convert("RGB").quantize(colors=_COLORS, method=Image.MEDIANCUT).save(path, optimize=True)
        self.files.append(path)
        return path


def _cell(value: Any) -> Any:
    if isinstance(value, float):
        return f"{value:.6g}"
    return value


@dataclass(frozen=True)
class Experiment:
    """A registered reproduction: its name, the paper and figure it reproduces, and the function that runs it."""

    name: str
    paper: str
    title: str
    run: Callable[[Context], list[Claim]]


EXPERIMENTS: dict[str, Experiment] = {}


def experiment(name: str, *, paper: str, title: str) -> Callable[[Callable[[Context], list[Claim]]], Any]:
    """Register ``run(context) -> list[Claim]`` as the experiment ``name`` (decorator)."""

    def register(run: Callable[[Context], list[Claim]]) -> Callable[[Context], list[Claim]]:
        if name in EXPERIMENTS:
            raise ValueError(f"experiment {name!r} is registered twice")
        EXPERIMENTS[name] = Experiment(name=name, paper=paper, title=title, run=run)
        return run

    return register


@dataclass
class ExperimentResult:
    """What one experiment left: its claims, files, wall-clock run time and CPU time of this process, in seconds."""

    name: str
    claims: list[Claim]
    files: list[Path]
    seconds: float
    cpu_seconds: float = math.nan


def write_summary(results: Sequence[ExperimentResult], directory: Path, *, quick: bool = False) -> list[Path]:
    """``summary.csv`` and ``summary.md``: one row per claim of every experiment, with the run time.

    A ``quick`` run is marked so that its verdicts are never taken for the documented ones: ``summary.csv`` gets a
    last column ``sizes`` (:data:`QUICK_SIZES` on every row), ``summary.md`` opens with :data:`QUICK_NOTE` and
    each verdict reads e.g. ``reproduced (quick size)``.
    """
    directory.mkdir(parents=True, exist_ok=True)
    rows = [
        asdict(claim)
        | {"seconds": round(result.seconds, 1), "cpu_seconds": round(result.cpu_seconds, 1), "sizes": QUICK_SIZES}
        for result in results
        for claim in result.claims
    ]
    csv_path = directory / "summary.csv"
    columns = ["experiment", "claim", "paper", "ours", "verdict", "reason", "value", "seconds", "cpu_seconds"]
    columns += ["sizes"] if quick else []
    with csv_path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        for row in rows:
            writer.writerow({key: _cell(row[key]) for key in columns})
    lines = [f"**{QUICK_NOTE[0].upper()}{QUICK_NOTE[1:]}.**", ""] if quick else []
    lines += ["| experiment | claim | paper | ours | verdict |", "|---|---|---|---|---|"]
    lines += [
        f"| {r['experiment']} | {r['claim']} | {r['paper']} | {r['ours']} | {marked_verdict(r['verdict'], quick)} |"
        for r in rows
    ]
    md_path = directory / "summary.md"
    md_path.write_text("\n".join(lines) + "\n")
    return [csv_path, md_path]


DEVICE_TYPES = ("cpu", "cuda", "mps")


def check_device(device: str | torch.device) -> torch.device:
    """``device`` as a :class:`torch.device` the experiments can run on, checked before any work starts.

    Raises:
        ValueError: not a device string, a type other than :data:`DEVICE_TYPES`, or a CUDA/MPS device this machine
            does not have; the message names the device and what is available.
    """
    try:
        torch_device = torch.device(device)
    except RuntimeError as error:
        raise ValueError(f"invalid device {str(device)!r}: {error}") from None
    if torch_device.type not in DEVICE_TYPES:
        raise ValueError(f"unsupported device {str(device)!r}; valid device types are: {', '.join(DEVICE_TYPES)}")
    if torch_device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"device {str(device)!r} was asked for but CUDA is not available; use --device cpu")
        if torch_device.index is not None and torch_device.index >= count:
            raise ValueError(f"device {str(device)!r} does not exist: this machine has {count} CUDA device(s)")
    if torch_device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device {str(device)!r} was asked for but MPS is not available; use --device cpu")
    return torch_device


def run_experiments(
    names: Iterable[str],
    out: str | Path,
    *,
    quick: bool = False,
    device: str | torch.device = "cpu",
    seed: int = 0,
    data_dir: str | Path | None = None,
    show: bool = False,
) -> tuple[Path, list[ExperimentResult]]:
    """Run the experiments ``names`` into a fresh folder under ``out`` and write the summary table.

    Args:
        names: registered experiment names (:data:`EXPERIMENTS`).
        out: the requested output folder; a run never writes into a folder holding files (a new ``run_<n>``
            inside it is used instead).
        quick: smoke-test sizes.
        device: ``"cpu"``, ``"cuda"``, ``"cuda:1"``, ...
        seed: base seed.
        data_dir: Fashion-MNIST folder (see :class:`Context`).
        show: draw a progress bar.

    Returns:
        The folder written into and one :class:`ExperimentResult` per experiment, in order.

    Raises:
        ValueError: an unknown experiment or a device that cannot be used (:func:`check_device`).
        FileNotFoundError: ``data_dir`` holds no ``FashionMNIST/raw`` folder.
    """
    names = check_choices("experiment", list(names), tuple(EXPERIMENTS))
    data_path = check_data_dir(data_dir)
    torch_device = check_device(device)
    directory = fresh_directory(out)
    results: list[ExperimentResult] = []
    with progress_bar(show) as progress:
        overall = progress.add_task("experiments", total=len(names))
        for name in names:
            task = progress.add_task(name, total=None)
            context = Context(
                name=name,
                quick=quick,
                device=torch_device,
                directory=directory,
                seed=seed,
                data_dir=data_path,
                _progress=progress,
                _task=task,
            )
            start, cpu_start = time.perf_counter(), time.process_time()
            claims = EXPERIMENTS[name].run(context)
            wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
            results.append(ExperimentResult(name, claims, list(context.files), wall, cpu))
            progress.remove_task(task)
            progress.advance(overall)
            write_summary(results, directory, quick=quick)
    return directory, results
