"""Grid sweeps of ``train.py fit``, one subprocess per grid point, aggregated into a table and a figure.

The weight-decay sweeps of Zangrando et al. Sec. 6 (rank of every layer against the weight decay) and, through
``--grid``, any grid over LightningCLI arguments::

    python -m rank_lightning.analysis.sweep --config configs/zangrando_mlp_digits.yaml \\
        --weight-decays 0 1e-4 1e-3 5e-3 1e-2 --processes 2 --out runs/sweep_wd

    # several axes: their Cartesian product is run (sigma x weight decay, Zangrando et al. Sec. 6.1, Fig. 1)
    python -m rank_lightning.analysis.sweep --config configs/autoencoder_gaussian_mixture.yaml \\
        --grid data.init_args.sigma=0.02,0.1,0.5 --weight-decays 0 1e-3 1e-2 --processes 2 --out runs/sweep_sigma_wd

    # arguments after "--" go to every run; the table and figure again from the runs already in OUT:
    python -m rank_lightning.analysis.sweep ... --out runs/sweep_wd -- --trainer.max_epochs=50
    python -m rank_lightning.analysis.sweep --out runs/sweep_wd --aggregate-only

``--weight-decays A B`` is short for ``--grid model.init_args.weight_decay=A,B``. Every grid key is checked against the
command line (``train.py fit --config ... --print_config``) before any run starts. Each run is
``train.py fit --config <configs> --<key>=<value> ... <extra arguments>`` with its loggers replaced by a ``CSVLogger``
and a ``TensorBoardLogger`` writing into the sweep folder, so the configs' callbacks (``WeightRankMonitor`` for weight
spectra and tail errors, ``ActivationRankMonitor`` for per-layer TCV) log every run separately:

* ``OUT/<point>/version_<n>/``: the run directory (``metrics.csv``, ``config.yaml``, ``checkpoints/``,
  ``rank_curves/``); ``<point>`` names the grid values, e.g. ``weight_decay=1e-3`` or ``sigma=0.1__weight_decay=0``
  (the last dotted part of each key, the whole key where two keys share it);
* ``OUT/<point>/version_<n>.json``: the grid point, the command, its exit status and duration;
* ``OUT/<point>/version_<n>.log``: the run's output;
* ``OUT/<point>/tensorboard/version_<n>/``: TensorBoard events (``tensorboard --logdir OUT``).

Runs are never overwritten: sweeping again into the same ``OUT`` adds ``version_<n+1>`` to every point. The aggregate
is a view of those runs, written anew on every call (and by ``--aggregate-only``) from, per point, the newest version
that finished with exit status 0, so that it always shows the folder's latest runs; its ``run`` column names the
version behind each row, and an earlier version stays in its folder, where ``analysis.report`` reads it. The aggregate
is ``OUT/sweep.csv`` and ``OUT/sweep.md``, one row per grid point, namespace (``weight``: weight matrices, ``rank``:
activations) and layer with the last monitored epoch's (or step's) metrics and the run's final ``val/acc``,
``val/loss`` and ``train/loss_epoch``, and ``OUT/sweep.png``, every selected metric per layer against the x key (the
weight decay by default; a log axis when the values span a decade, with 0 drawn one decade below the smallest positive
value and labelled ``0``), one row of panels per combination of the other keys.

Threads: every run gets ``--threads`` CPU threads (``OMP_NUM_THREADS``; by default the value already set in the
environment, else 1), whatever ``--processes`` is, and its record says how many. The thread count changes the order
of floating-point sums in the CPU kernels, and with it a run's numbers (``configs/zangrando_mlp_digits.yaml`` after 40
epochs: the first layer's stable rank is 9.997 on one thread and 9.991 on two, the same on every repeat of either):
a fixed count gives a point the same numbers in a sweep of any width and when run alone. One thread is also the faster
choice for the small CPU models of the configs (on 2 cores, one 40-epoch run of that config took 27-40 s on one thread,
45-48 s on two); for large models, raise ``--threads`` and keep ``--processes`` times ``--threads`` at most the number
of cores.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import itertools
import json
import math
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from fnmatch import fnmatch
from pathlib import Path

from matplotlib import colormaps
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from rank_lightning.analysis.output import print_written, progress_bar, run_command, show_progress
from rank_lightning.analysis.report import DEFAULT_NAMESPACES, load_run, summary_rows

__all__ = [
    "DEFAULT_FIGURE_METRICS",
    "DEFAULT_FINAL_METRICS",
    "DEFAULT_TABLE_METRICS",
    "WEIGHT_DECAY_KEY",
    "GridPoint",
    "SweepRun",
    "aggregate",
    "check_arguments",
    "find_sweep_runs",
    "grid_points",
    "main",
    "parse_grid",
    "run_sweep",
    "short_names",
    "sweep_table",
    "train_command",
    "write_figure",
    "write_table",
]

WEIGHT_DECAY_KEY = "model.init_args.weight_decay"
DEFAULT_TABLE_METRICS: tuple[str, ...] = (
    "weight/numerical_rank",
    "weight/stable_rank",
    "weight/tail_error_k*",
    "rank/*numerical_rank",
    "rank/*tcv",
    "rank/*tcv_normalized",
)
DEFAULT_FIGURE_METRICS: tuple[str, ...] = (
    "weight/numerical_rank",
    "weight/stable_rank",
    "weight/tail_error_k*",
    "rank/*tcv_normalized",
)
DEFAULT_FINAL_METRICS: tuple[str, ...] = ("val/acc", "val/loss", "train/loss_epoch")
_TRAIN_SCRIPT = Path(__file__).resolve().parents[2] / "train.py"
_UNSAFE = re.compile(r"[^A-Za-z0-9_.=-]+")
_VERSION = re.compile(r"^version_(\d+)$")
_RECORD = re.compile(r"^version_(\d+)\.json$")
_CLOSING = {"[": "]", "{": "}", "(": ")"}
# Columns of report.summary_rows that a grid column must not shadow.
_TABLE_COLUMNS = ("run", "namespace", "layer", "depth", "epoch")


@dataclass(frozen=True)
class GridPoint:
    """One point of a grid: a value (as typed on the command line) for every swept key.

    Attributes:
        values: ``key -> value`` in the grid's key order.
        name: the point's folder name inside the sweep folder.
    """

    values: dict[str, str]
    name: str

    def arguments(self) -> list[str]:
        """The point's command-line arguments, ``--<key>=<value>``."""
        return [f"--{key}={value}" for key, value in self.values.items()]


@dataclass
class SweepRun:
    """One run of a grid point: where it lives and how it ended.

    Attributes:
        point: the grid point.
        version: ``n`` of ``version_<n>``.
        directory: the run directory ``OUT/<point>/version_<n>``.
        returncode: exit status of ``train.py``; ``None`` while running or when it was killed.
        seconds: wall-clock duration.
    """

    point: GridPoint
    version: int
    directory: Path
    returncode: int | None = None
    seconds: float | None = None

    @property
    def label(self) -> str:
        """``<point>/version_<n>``."""
        return f"{self.point.name}/version_{self.version}"

    @property
    def record_path(self) -> Path:
        """The run's JSON record, ``OUT/<point>/version_<n>.json``."""
        return self.directory.with_suffix(".json")

    @property
    def log_path(self) -> Path:
        """The run's output, ``OUT/<point>/version_<n>.log``."""
        return self.directory.with_suffix(".log")


def _split_values(text: str) -> list[str]:
    """Split on commas outside brackets and quotes, so list values such as ``[64,32]`` stay whole."""
    values, current, stack, quote = [], [], [], None
    for char in text:
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in _CLOSING:
            stack.append(_CLOSING[char])
        elif stack and char == stack[-1]:
            stack.pop()
        elif char == "," and not stack:
            values.append("".join(current).strip())
            current = []
            continue
        current.append(char)
    values.append("".join(current).strip())
    return values


def parse_grid(specs: Sequence[str], weight_decays: Sequence[str] | None = None) -> dict[str, list[str]]:
    """Read ``KEY=V1,V2,...`` grid specifications.

    Args:
        specs: one ``KEY=V1,V2,...`` per swept LightningCLI argument (``data.init_args.sigma=0.05,0.1``); commas inside
            brackets or quotes do not split (``model.init_args.hidden_dims=[64,32],[32,16]``).
        weight_decays: values of ``model.init_args.weight_decay``, appended as one more key.

    Returns:
        ``key -> values`` in the given order.

    Raises:
        ValueError: a specification without ``=``, an empty key or value, a repeated key or value, no key at all, or a
            weight decay that is not a finite number >= 0.
    """
    entries = []
    for spec in specs:
        key, equals, text = spec.partition("=")
        key = key.strip().removeprefix("--")
        if not equals or not key:
            raise ValueError(f"grid specification {spec!r} is not KEY=V1,V2,... (e.g. data.init_args.sigma=0.05,0.1)")
        entries.append((spec, key, _split_values(text)))
    if weight_decays:
        entries.append(
            ("--weight-decays " + " ".join(weight_decays), WEIGHT_DECAY_KEY, [v.strip() for v in weight_decays])
        )
    grid: dict[str, list[str]] = {}
    for spec, key, values in entries:
        if not all(values):
            raise ValueError(f"grid specification {spec!r} has an empty value; values are {values}")
        # Numbers are compared as numbers: 1e-3 and 0.001 are one point of the grid, which would run twice.
        compared = [value if _number(value) is None else _number(value) for value in values]
        if len(set(compared)) != len(compared):
            raise ValueError(f"grid specification {spec!r} repeats a value: {values}")
        if key in grid:
            raise ValueError(f"grid key {key!r} is given twice; keys so far: {', '.join(grid)}")
        grid[key] = values
    if not grid:
        raise ValueError("the grid is empty: give --grid KEY=V1,V2,... or --weight-decays")
    # The command-line check (--print_config) parses types but builds no optimizer: a negative weight decay would
    # pass it and fail every run of its points, each after loading the data.
    bad = [value for value in grid.get(WEIGHT_DECAY_KEY, []) if not _is_weight_decay(value)]
    if bad:
        raise ValueError(
            f"weight decays must be finite numbers >= 0; got {', '.join(map(repr, bad))} among {grid[WEIGHT_DECAY_KEY]}"
        )
    return grid


def _is_weight_decay(value: str) -> bool:
    number = _number(value)
    return number is not None and math.isfinite(number) and number >= 0


def short_names(keys: Sequence[str], reserved: Sequence[str] = ()) -> dict[str, str]:
    """Names of grid keys in folder names and table columns.

    The last dotted part of a key (``model.init_args.weight_decay`` -> ``weight_decay``); the whole key where two keys
    share their last part or where the last part is in ``reserved`` (the table's own columns, such as ``depth``).
    """
    last = [key.rsplit(".", 1)[-1] for key in keys]
    return {key: (tail if last.count(tail) == 1 and tail not in reserved else key) for key, tail in zip(keys, last)}


def _point_name(values: Mapping[str, str], names: Mapping[str, str]) -> str:
    return "__".join(_UNSAFE.sub("_", f"{names[key]}={value}") for key, value in values.items())


def grid_points(grid: Mapping[str, Sequence[str]]) -> list[GridPoint]:
    """The Cartesian product of the grid, the last key varying fastest, each point named after its values.

    Returns:
        The points; names are like ``weight_decay=1e-3`` or ``sigma=0.1__weight_decay=0``.

    Raises:
        ValueError: two points that would share a folder name (values equal after unsafe characters become ``_``).
    """
    names = short_names(list(grid))
    points = [
        GridPoint(values=(values := dict(zip(grid, combination))), name=_point_name(values, names))
        for combination in itertools.product(*grid.values())
    ]
    seen: dict[str, GridPoint] = {}
    for point in points:
        if point.name in seen:
            raise ValueError(f"grid points {seen[point.name].values} and {point.values} share the name {point.name!r}")
        seen[point.name] = point
    return points


def train_command() -> list[str]:
    """The command that runs the package's LightningCLI: ``python <repository>/train.py``.

    A package installed without its repository has no ``train.py``; the CLI is then started with ``python -c``, which
    works for every strategy but ``ddp``, whose relaunch needs a script.
    """
    if _TRAIN_SCRIPT.is_file():
        return [sys.executable, str(_TRAIN_SCRIPT)]
    return [sys.executable, "-c", "from rank_lightning.cli import main; main()"]


def check_arguments(configs: Sequence[str], grid: Mapping[str, Sequence[str]], extra_args: Sequence[str] = ()) -> None:
    """Parse command lines of the grid as ``train.py fit ... --print_config`` does, in this process, without training.

    Every value of every key is checked once: the ``i``-th command line takes the ``i``-th value of each key (cycling
    through shorter keys), so ``max(len(values))`` parses cover the grid.

    Raises:
        ValueError: a grid key or value, or an extra argument, that the command line rejects; with its message.
    """
    from rank_lightning.cli import main as cli_main

    for i in range(max(len(values) for values in grid.values())):
        point = {key: values[i % len(values)] for key, values in grid.items()}
        args = [
            "fit",
            *(f"--config={config}" for config in configs),
            *(f"--{key}={value}" for key, value in point.items()),
            *extra_args,
        ]
        err = io.StringIO()
        code: object = 0
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            try:
                cli_main([*args, "--print_config"])
            except SystemExit as exit_info:
                code = exit_info.code
        if code not in (0, None):
            lines = err.getvalue().splitlines()
            starts = [i for i, line in enumerate(lines) if line.startswith("error:")] or [max(len(lines) - 10, 0)]
            detail = "\n".join(lines[starts[-1] : starts[-1] + 12]) or f"exit status {code}"
            raise ValueError(f"train.py rejects the command line {args}:\n{detail}")


def _next_version(point_dir: Path) -> int:
    used = [-1]
    if point_dir.is_dir():
        for entry in point_dir.iterdir():
            match = _VERSION.match(entry.name) or _RECORD.match(entry.name)
            if match:
                used.append(int(match.group(1)))
    return max(used) + 1


def _reserve(out: Path, point: GridPoint, command: list[str]) -> SweepRun:
    """Claim the next free ``version_<n>`` of a point by creating its record exclusively (safe against races)."""
    point_dir = out / point.name
    point_dir.mkdir(parents=True, exist_ok=True)
    while True:
        version = _next_version(point_dir)
        run = SweepRun(point=point, version=version, directory=point_dir / f"version_{version}")
        try:
            with run.record_path.open("x") as file:
                json.dump(_record(run, command), file, indent=2)
            return run
        except FileExistsError:
            continue


def _record(run: SweepRun, command: list[str]) -> dict[str, object]:
    return {
        "point": run.point.name,
        "values": run.point.values,
        "version": run.version,
        "command": command,
        "cwd": os.getcwd(),
        "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "returncode": run.returncode,
        "seconds": run.seconds,
    }


def _logger_argument(out: Path, run: SweepRun) -> str:
    loggers = [
        {
            "class_path": "pytorch_lightning.loggers.CSVLogger",
            "init_args": {"save_dir": str(out), "name": run.point.name, "version": run.version},
        },
        {
            "class_path": "pytorch_lightning.loggers.TensorBoardLogger",
            "init_args": {"save_dir": str(out / run.point.name), "name": "tensorboard", "version": run.version},
        },
    ]
    return "--trainer.logger=" + json.dumps(loggers)


def run_sweep(
    configs: Sequence[str],
    points: Sequence[GridPoint],
    out: str | Path,
    *,
    processes: int = 1,
    threads: int | None = None,
    extra_args: Sequence[str] = (),
    echo: Callable[[str], None] = print,
    on_done: Callable[[SweepRun], None] | None = None,
) -> list[SweepRun]:
    """Run ``train.py fit`` once per grid point, ``processes`` at a time, each into its own new run directory.

    Args:
        configs: config files, in order (later ones override earlier ones).
        points: the grid points (:func:`grid_points`).
        out: the sweep folder.
        processes: runs at the same time.
        threads: CPU threads of every run (``OMP_NUM_THREADS``), the same whatever ``processes`` is, so that a point's
            numbers do not depend on how many ran beside it; ``None``: ``OMP_NUM_THREADS`` of the environment, else 1.
        extra_args: further command-line arguments for every run (after the grid's).
        echo: receives one progress line per started and finished run.
        on_done: called with each run once it has ended (e.g. to advance a progress bar).

    Returns:
        The runs, in the order of ``points``, with their exit status and duration.
    """
    if processes < 1:
        raise ValueError(f"processes must be a positive integer, got {processes!r}")
    if threads is not None and threads < 1:
        raise ValueError(f"threads must be a positive integer, got {threads!r}")
    out = Path(out).absolute()
    env = dict(os.environ)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    env.setdefault("OMP_NUM_THREADS", "1")
    base = [*train_command(), "fit", *(f"--config={config}" for config in configs)]
    total = len(points)

    def launch(index: int, point: GridPoint) -> SweepRun:
        command = [*base, *point.arguments(), *extra_args]
        run = _reserve(out, point, command)
        command = [*command, _logger_argument(out, run)]
        echo(f"[{index + 1}/{total}] start  {run.label}")
        start = time.monotonic()
        with run.log_path.open("w") as log:
            log.write(" ".join(command) + "\n\n")
            log.flush()
            completed = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env, check=False)
        run.returncode, run.seconds = completed.returncode, time.monotonic() - start
        content = json.loads(run.record_path.read_text())
        content.update(
            command=command,
            omp_num_threads=env["OMP_NUM_THREADS"],
            returncode=run.returncode,
            seconds=round(run.seconds, 1),
        )
        run.record_path.write_text(json.dumps(content, indent=2))
        status = "done  " if run.returncode == 0 else f"FAILED (exit {run.returncode}, see {run.log_path})"
        echo(f"[{index + 1}/{total}] {status} {run.label} in {run.seconds:.0f} s")
        if on_done is not None:
            on_done(run)
        return run

    with ThreadPoolExecutor(max_workers=processes) as pool:
        return list(pool.map(launch, range(total), points))


def find_sweep_runs(out: str | Path) -> tuple[list[SweepRun], list[SweepRun]]:
    """The runs recorded in a sweep folder: per grid point, the newest version that finished with exit status 0.

    Returns:
        ``(chosen, skipped)``: the chosen runs, sorted by grid values, and the newest unfinished or failed version of
        every point that has no successful one.

    Raises:
        FileNotFoundError: ``out`` is not a folder or holds no run record.
    """
    out = Path(out)
    if not out.is_dir():
        raise FileNotFoundError(f"sweep folder {str(out)!r} does not exist")
    by_point: dict[str, list[SweepRun]] = {}
    for record in sorted(out.glob("*/version_*.json")):
        if not _RECORD.match(record.name):
            continue
        content = json.loads(record.read_text())
        point = GridPoint(values={k: str(v) for k, v in content["values"].items()}, name=record.parent.name)
        run = SweepRun(
            point=point,
            version=int(content["version"]),
            directory=record.with_suffix(""),
            returncode=content.get("returncode"),
            seconds=content.get("seconds"),
        )
        by_point.setdefault(point.name, []).append(run)
    if not by_point:
        raise FileNotFoundError(f"no sweep run in {str(out)!r}: expected <point>/version_<n>.json records")
    chosen, skipped = [], []
    for runs in by_point.values():
        runs.sort(key=lambda run: run.version)
        finished = [run for run in runs if run.returncode == 0 and run.directory.is_dir()]
        (chosen if finished else skipped).append(finished[-1] if finished else runs[-1])
    keys = _union(run.point.values for run in chosen)
    chosen.sort(key=lambda run: [_sort_key(run.point.values.get(key)) for key in keys])
    return chosen, skipped


def _union(lists: Iterable[Iterable[str]]) -> list[str]:
    """The items of all lists (or keys of all mappings), once each, in first-seen order."""
    merged: dict[str, None] = {}
    for items in lists:
        merged.update(dict.fromkeys(items))
    return list(merged)


def _number(value: object) -> float | None:
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None


def _sort_key(value: str | None) -> tuple[int, float, str]:
    number = _number(value)
    return (0, number, "") if number is not None else (1, 0.0, value or "")


def _matches(column: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch(column, pattern) for pattern in patterns)


def _metric_columns(columns: Sequence[str]) -> list[str]:
    """The ``<namespace>/<layer metric>`` columns of a :func:`sweep_table` (between ``epoch`` and the final ones)."""
    return [c for c in columns[columns.index("epoch") + 1 :] if c.split("/", 1)[0] in DEFAULT_NAMESPACES]


def sweep_table(
    runs: Sequence[SweepRun],
    *,
    metrics: Sequence[str] = DEFAULT_TABLE_METRICS,
    final_metrics: Sequence[str] = DEFAULT_FINAL_METRICS,
) -> tuple[list[str], list[dict[str, object]]]:
    """One row per run, namespace and layer: grid values, the last monitored epoch's metrics, the run's final metrics.

    Curves are read with :func:`rank_lightning.analysis.report.load_run` and tabulated by
    :func:`~rank_lightning.analysis.report.summary_rows`.

    Args:
        runs: the runs (:func:`find_sweep_runs`).
        metrics: ``fnmatch`` patterns of the ``<namespace>/<metric>`` columns to keep; ``("*",)`` keeps all.
        final_metrics: keys whose last logged value joins every row of the run, when logged.

    Returns:
        ``(columns, rows)``: the grid keys (named by :func:`short_names`), ``run``, ``namespace``, ``layer``,
        ``depth`` (of the layer), ``epoch`` (the last monitored one), the metrics, the final metrics present; a
        missing value is ``None``.
    """
    curves = [
        load_run(run.directory, label=run.label, namespaces=DEFAULT_NAMESPACES, final_metrics=final_metrics)
        for run in runs
    ]
    columns, rows = summary_rows(curves)
    keys = _union([run.point.values for run in runs])
    names = short_names(keys, reserved=_TABLE_COLUMNS)
    grid = {run.label: run.point.values for run in runs}
    metric_columns = _metric_columns(columns)
    kept = [c for c in columns if c not in metric_columns or _matches(c, metrics)]
    table = [
        {**{names[key]: grid[str(row["run"])].get(key) for key in keys}, **{c: row[c] for c in kept}} for row in rows
    ]
    return [*(names[key] for key in keys), *kept], table


def _format(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def write_table(columns: Sequence[str], rows: Sequence[Mapping[str, object]], out: str | Path) -> tuple[Path, Path]:
    """Write the table as ``sweep.csv`` and ``sweep.md`` into ``out``.

    Returns:
        The two paths.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    csv_path, md_path = out / "sweep.csv", out / "sweep.md"
    with csv_path.open("w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=list(columns))
        writer.writeheader()
        writer.writerows({c: ("" if row.get(c) is None else row[c]) for c in columns} for row in rows)
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_format(row.get(c)) for c in columns) + " |" for row in rows]
    md_path.write_text("\n".join(lines) + "\n")
    return csv_path, md_path


def _x_axis(values: Sequence[str]) -> tuple[dict[str, float], str, list[float], list[str]]:
    """Positions of the x values, the axis scale, ticks and tick labels.

    Numbers that include at least one positive value and no negative one, spanning a decade or more with 0 counted
    as a decade below the smallest positive value, go on a log axis with 0 drawn there and labelled ``0``; other
    numbers on a linear axis; anything else at evenly spaced positions.
    """
    numbers = {value: _number(value) for value in values}
    if any(number is None or math.isnan(number) for number in numbers.values()):
        positions = {value: float(i) for i, value in enumerate(values)}
        return positions, "linear", list(positions.values()), list(values)
    positive = [n for n in numbers.values() if n > 0]
    negative = [n for n in numbers.values() if n < 0]
    low = min(positive) if positive else 0.0
    span = (max(positive) / low if positive else 1.0) * (10.0 if 0.0 in numbers.values() else 1.0)
    if positive and not negative and span >= 10.0:
        positions = {value: (n if n > 0 else low / 10.0) for value, n in numbers.items()}
        scale = "log"
    else:
        positions = {value: float(n) for value, n in numbers.items()}
        scale = "linear"
    ordered = sorted(positions, key=positions.get)
    labels = ["0" if numbers[value] == 0 else value for value in ordered]
    return positions, scale, [positions[value] for value in ordered], labels


def _panel_lines(
    rows: Sequence[Mapping[str, object]], column: str, x: str, positions: Mapping[str, float], per_run: bool
) -> dict[str, list[tuple[float, float]]]:
    """The lines of one panel: ``label -> [(x position, value), ...]``, one line per layer (by depth) or one in all."""
    if per_run:
        groups = {"": list({str(row["run"]): row for row in rows}.values())}
    else:
        namespace = column.split("/", 1)[0]
        chosen = [row for row in rows if row["namespace"] == namespace and row.get(column) is not None]
        depths = {str(row["layer"]): int(row["depth"]) for row in chosen}  # type: ignore[call-overload]
        groups = {layer: [row for row in chosen if row["layer"] == layer] for layer in sorted(depths, key=depths.get)}
    lines = {}
    for label, members in groups.items():
        values = [(positions[str(row[x])], _number(row.get(column))) for row in members]
        lines[label] = sorted((position, math.nan if v is None else v) for position, v in values)
    return lines


def last_point(rows: Sequence[Mapping[str, object]]) -> str:
    """What the rows' values were measured at the last of: ``"epoch"``, ``"step"`` (runs keyed by optimizer step, whose
    rows hold a ``step``), or ``"epoch or step"``."""
    return " or ".join(sorted({"epoch" if row.get("step") is None else "step" for row in rows}))


def write_figure(
    columns: Sequence[str],
    rows: Sequence[Mapping[str, object]],
    path: str | Path,
    *,
    x: str,
    metrics: Sequence[str] = DEFAULT_FIGURE_METRICS,
    final_metrics: Sequence[str] = DEFAULT_FINAL_METRICS,
) -> Path:
    """Draw every selected metric of every layer against the grid column ``x``.

    One panel per metric (the ``<namespace>/<metric>`` columns matching ``metrics``, in the order of the patterns, then
    the final metrics present)
    and combination of the other grid columns: a row of panels per combination, or, with a single combination,
    four panels to a row. One line per layer coloured by depth (dark: first layer); one black line per final metric.

    Args:
        columns: the table's columns (:func:`sweep_table`).
        rows: the table's rows.
        path: the PNG file.
        x: the grid column on the x axis.
        metrics: ``fnmatch`` patterns of the metric columns to draw.
        final_metrics: run-level columns to draw, when present.

    Returns:
        ``path``.

    Raises:
        ValueError: ``x`` is not a grid column, or no column matches ``metrics`` and ``final_metrics``.
    """
    grid_columns = list(columns[: columns.index("run")])
    if x not in grid_columns:
        raise ValueError(f"unknown x column {x!r}; grid columns are: {', '.join(grid_columns)}")
    others = [c for c in grid_columns if c != x]
    finals = [c for c in final_metrics if c in columns]
    metric_columns = _metric_columns(columns)
    panels = _union([[c for c in metric_columns if fnmatch(c, pattern)] for pattern in metrics]) + finals
    if not panels:
        raise ValueError(f"no column matches {list(metrics)} or {list(final_metrics)}; columns are: {list(columns)}")
    positions, scale, ticks, tick_labels = _x_axis(_union([[str(row[x])] for row in rows]))
    combinations = _union([[json.dumps([row[c] for c in others])] for row in rows])
    # One combination: panels wrap four to a row; several: a row of panels per combination.
    columns_count = min(4, len(panels)) if len(combinations) == 1 else len(panels)
    rows_count = math.ceil(len(panels) / columns_count) * len(combinations)
    figure = Figure(figsize=(3.3 * columns_count + 0.5, 2.9 * rows_count + 0.8), layout="constrained")
    axes = figure.subplots(rows_count, columns_count, squeeze=False).ravel()
    for ax in axes[len(panels) * len(combinations) :]:
        ax.set_axis_off()
    palette = colormaps["viridis"]
    for i, combination in enumerate(combinations):
        selected = [row for row in rows if json.dumps([row[c] for c in others]) == combination]
        subtitle = ", ".join(f"{c}={v}" for c, v in zip(others, json.loads(combination)))
        for j, column in enumerate(panels):
            ax = axes[i * len(panels) + j]
            lines = _panel_lines(selected, column, x, positions, per_run=column in finals)
            for k, (label, points) in enumerate(lines.items()):
                color = "black" if column in finals else palette(0.9 * k / max(len(lines) - 1, 1))
                ax.plot(*zip(*points), marker="o", markersize=3, color=color, label=label)
            ax.set_xscale(scale)
            ax.set_xticks(ticks, tick_labels, fontsize="x-small", rotation=45)
            ax.minorticks_off()
            ax.grid(alpha=0.3)
            ax.set_title(f"{column}\n{subtitle}" if subtitle else column, fontsize="small")
            if i == 0 and column not in finals and len(lines) > 1:
                if len(lines) <= 12:
                    ax.legend(fontsize="xx-small")
                else:
                    handles = [Line2D([], [], color=palette(0.0)), Line2D([], [], color=palette(0.9))]
                    ax.legend(handles, [next(iter(lines)), list(lines)[-1]], fontsize="xx-small")
    zero_note = " (log scale; 0 drawn one decade below the smallest positive value)"
    figure.supxlabel(x + (zero_note if scale == "log" and "0" in tick_labels else ""))
    figure.suptitle(f"per layer, at the last monitored {last_point(rows)} of every run")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    return path


def aggregate(
    out: str | Path,
    *,
    x: str | None = None,
    table_metrics: Sequence[str] = DEFAULT_TABLE_METRICS,
    figure_metrics: Sequence[str] = DEFAULT_FIGURE_METRICS,
    final_metrics: Sequence[str] = DEFAULT_FINAL_METRICS,
    echo: Callable[[str], None] = print,
) -> tuple[Path, Path, Path]:
    """Tabulate and draw the finished runs of a sweep folder.

    Runs are chosen by :func:`find_sweep_runs`, tabulated by :func:`sweep_table` and drawn by :func:`write_figure`.

    Args:
        out: the sweep folder.
        x: grid key (or its column name) on the figure's x axis; default: the weight decay when swept, else the first
            key.
        table_metrics: patterns of the table's metric columns (the figure's are added).
        figure_metrics: patterns of the figure's metric panels.
        final_metrics: run-level metrics of table and figure.
        echo: receives a line per point without a finished run, and per pattern (other than the defaults) of
            ``table_metrics`` or ``figure_metrics`` that matches no metric of the runs.

    Returns:
        The paths of ``OUT/sweep.csv``, ``OUT/sweep.md`` and ``OUT/sweep.png``.

    Raises:
        FileNotFoundError: no finished run in ``out``.
        ValueError: no run logged rank metrics, or an unknown ``x``.
    """
    runs, skipped = find_sweep_runs(out)
    for run in skipped:
        echo(f"skipped {run.label}: it has not finished well (exit status {run.returncode}, see {run.log_path})")
    if not runs:
        raise FileNotFoundError(f"no finished run in {str(out)!r}")
    columns, rows = sweep_table(runs, metrics=("*",), final_metrics=final_metrics)
    if not rows:
        raise ValueError(
            f"the runs in {str(out)!r} logged no {' or '.join(f'{ns}/...' for ns in DEFAULT_NAMESPACES)} metrics: "
            "the configs need WeightRankMonitor or ActivationRankMonitor, and the runs a monitored epoch"
        )
    metric_columns = _metric_columns(columns)
    given = {"table": table_metrics, "figure": figure_metrics}
    for what, patterns in given.items():
        defaults = DEFAULT_TABLE_METRICS if what == "table" else DEFAULT_FIGURE_METRICS
        for pattern in patterns:
            if pattern not in defaults and not any(fnmatch(c, pattern) for c in metric_columns):
                echo(
                    f"--{what}-metrics pattern {pattern!r} matches no metric of these runs; they have: "
                    f"{', '.join(metric_columns)}"
                )
    keys = _union([run.point.values for run in runs])
    names = short_names(keys, reserved=_TABLE_COLUMNS)
    if x is None:
        x = WEIGHT_DECAY_KEY if WEIGHT_DECAY_KEY in keys else keys[0]
    figure = write_figure(
        columns, rows, Path(out) / "sweep.png", x=names.get(x, x), metrics=figure_metrics, final_metrics=final_metrics
    )
    table_columns = [c for c in columns if c not in metric_columns or _matches(c, [*table_metrics, *figure_metrics])]
    csv_path, md_path = write_table(table_columns, rows, out)
    return csv_path, md_path, figure


def _split_extra(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    argv = list(argv)
    if "--" in argv:
        index = argv.index("--")
        return argv[:index], argv[index + 1 :]
    return argv, []


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m rank_lightning.analysis.sweep`` (see the module docstring)."""
    own, extra = _split_extra(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="python -m rank_lightning.analysis.sweep",
        description="Run train.py fit over a grid of LightningCLI arguments and tabulate the per-layer ranks.",
        epilog="Arguments after -- are passed to every run, e.g. -- --trainer.max_epochs=50.",
    )
    parser.add_argument("--config", action="append", default=[], metavar="YAML", help="config file (repeatable)")
    parser.add_argument(
        "--grid", action="append", default=[], metavar="KEY=V1,V2,...", help="swept LightningCLI argument (repeatable)"
    )
    parser.add_argument("--weight-decays", nargs="+", metavar="WD", help=f"short for --grid {WEIGHT_DECAY_KEY}=...")
    parser.add_argument(
        "--out",
        required=True,
        metavar="OUT_DIR",
        help="sweep folder (created; runs are never overwritten, sweep.csv/.md/.png are written anew from them)",
    )
    parser.add_argument("--processes", type=int, default=1, help="runs at the same time (default: %(default)s)")
    parser.add_argument(
        "--threads",
        type=int,
        metavar="N",
        help="CPU threads of every run, whatever --processes is (default: OMP_NUM_THREADS when set, else 1)",
    )
    parser.add_argument("--aggregate-only", action="store_true", help="only tabulate and draw the runs in OUT_DIR")
    parser.add_argument("--x", metavar="KEY", help="grid key on the figure's x axis (default: the weight decay)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar (none is drawn outside a terminal)")
    parser.add_argument(
        "--table-metrics",
        nargs="+",
        default=list(DEFAULT_TABLE_METRICS),
        metavar="PATTERN",
        help="<namespace>/<metric> patterns of the table's columns, besides the figure's (default: %(default)s)",
    )
    parser.add_argument(
        "--figure-metrics",
        nargs="+",
        default=list(DEFAULT_FIGURE_METRICS),
        metavar="PATTERN",
        help="<namespace>/<metric> patterns of the figure's panels (default: %(default)s)",
    )
    parser.add_argument(
        "--final-metrics",
        nargs="*",
        default=list(DEFAULT_FINAL_METRICS),
        metavar="KEY",
        help="run-level keys of table and figure (default: %(default)s)",
    )
    args = parser.parse_args(own)
    failed: list[SweepRun] = []
    if not args.aggregate_only:
        if not args.config:
            parser.error("--config is required unless --aggregate-only")
        if args.processes < 1:
            parser.error(f"--processes must be a positive integer, got {args.processes}")
        if args.threads is not None and args.threads < 1:
            parser.error(f"--threads must be a positive integer, got {args.threads}")
        try:
            grid = parse_grid(args.grid, args.weight_decays)
            points = grid_points(grid)
            print(f"checking the grid's command lines ({len(points)} point(s)) ...")
            check_arguments(args.config, grid, extra)
        except ValueError as error:
            parser.error(str(error))
        runs = _run_with_progress(args, points, extra)
        failed = [run for run in runs if run.returncode != 0]
    try:
        csv_path, md_path, figure = aggregate(
            args.out,
            x=args.x,
            table_metrics=args.table_metrics,
            figure_metrics=args.figure_metrics,
            final_metrics=args.final_metrics,
        )
    except (FileNotFoundError, ValueError) as error:
        parser.error(str(error))
    chosen, _ = find_sweep_runs(args.out)
    groups = {"tables": [csv_path, md_path], "figures": [figure], "run folders": [run.directory for run in chosen]}
    print_written(Path(args.out).absolute(), groups, requested=Path(args.out).absolute())
    if failed:
        print(f"{len(failed)} run(s) failed: {', '.join(run.label for run in failed)} (see their .log files)")
    return 1 if failed else 0


def _run_with_progress(args: argparse.Namespace, points: Sequence[GridPoint], extra: Sequence[str]) -> list[SweepRun]:
    """:func:`run_sweep` under a progress bar of finished runs (on a terminal, unless ``--quiet``); the start and end
    of each run are printed above it, and a line at the end says how many finished and in how long."""
    start = time.monotonic()
    with progress_bar(show_progress(args.quiet)) as progress:
        task = progress.add_task(f"training runs ({args.processes} at a time)", total=len(points))
        runs = run_sweep(
            args.config,
            points,
            args.out,
            processes=args.processes,
            threads=args.threads,
            extra_args=extra,
            # Printed above the bar as written: never wrapped (a log keeps each line, and its path, whole) and never
            # read as console markup or emoji codes (a folder named "[bold]" stays in the line).
            echo=lambda line: progress.console.print(line, markup=False, emoji=False, soft_wrap=True),
            on_done=lambda run: progress.advance(task),
        )
    finished = sum(run.returncode == 0 for run in runs)
    print(f"{finished} of {len(runs)} run(s) finished in {time.monotonic() - start:.0f} s")
    return runs


if __name__ == "__main__":
    run_command(main)
