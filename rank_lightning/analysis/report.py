"""Figures and a summary table of the per-layer rank curves of finished runs, to compare runs side by side.

Command::

    python -m rank_lightning.analysis.report RUN_DIR [RUN_DIR ...] --out OUT_DIR
        [--namespaces rank rank_train weight] [--final-metrics val/acc] [--quiet]

``RUN_DIR`` is a run directory (a ``CSVLogger`` version folder holding ``metrics.csv``) or any folder above runs
(``lightning_logs/`` with its ``version_*`` folders, a sweep folder): every folder below it that holds a
``metrics.csv`` or a ``rank_curves/<namespace>_curves.json`` (written by the rank callbacks with any logger, W&B and
TensorBoard included) is one run. Runs are labelled by their path relative to the deepest folder all runs share.

Logged keys ``<namespace>/<layer>/<metric>`` (``rank/...`` and ``rank_train/...`` from ``ActivationRankMonitor``,
``weight/...`` from ``WeightRankMonitor``; ``--namespaces jacobian`` for ``JacobianRankMonitor``) are read from the
run's curve file ``rank_curves/<namespace>_curves.json`` where it has one, else from ``metrics.csv``. The curve file
holds the run's whole history: a run resumed from a checkpoint carries the epochs before the resume in it, while its
``metrics.csv`` (a new version folder, or the same one rewritten by ``CSVLogger``) starts at the resume. Where a
resumed fit trained epochs again, the figures and the table show the values of the fit that went on to the end (the
history the final weights come from); the values they replaced stay under ``"superseded"`` in the curve file, and
the report names those epochs. Curves are keyed by epoch, or by optimizer step where the callback keyed them so (the
step cadence, several validations per epoch: a curve file that says so, or CSV values logged at more than one step of
an epoch), and drawn against that axis. The layers' depth order comes from the curve file (CSV columns are sorted by
name), else from a natural sort of the names. A run without any key of the requested namespaces is skipped, with
the namespaces it does have; a ``--namespaces`` or ``--final-metrics`` value (other than the defaults) that no run
holds is named, with those the runs have. Curve files of an earlier run that a new run found in its folder (kept
as ``rank_curves/<namespace>_curves-v<n>.json``) are not read, and named.

Written to ``OUT_DIR`` (created when missing), or, when it already holds files, to a new ``OUT_DIR/run_<n>``: the
second report into ``run_2``, the third into ``run_3`` (nothing is overwritten):

* ``<namespace>_<metric>_vs_epoch.png``: one panel per layer, metric against epoch, one line per run keyed by epoch;
* ``<namespace>_<metric>_vs_step.png``: the same against optimizer step, for the runs keyed by step;
* ``<namespace>_<metric>_vs_depth.png``: metric at each run's last epoch (or step) against layer depth, one line per
  run;
* ``summary.csv`` and ``summary.md``: one row per run, namespace and layer with the last epoch's (or step's: a
  ``step`` column joins the table then) value of every metric, plus the run's final value of each
  ``--final-metrics`` key (``val/acc`` by default) when it was logged.

On a terminal a progress bar follows the runs being read and the figures being drawn (``--quiet``, or output to a
file or pipe, turns it off); a short summary of what was written, and where, closes the run.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import math
import os
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rank_lightning.analysis.output import fresh_directory, print_written, progress_bar, run_command, show_progress
from rank_lightning.callbacks.curves import FIGURE_DIR, epoch_ranges, read_curve_file
from rank_lightning.figure_workers import FigureJob, draw_figures
from rank_lightning.plotting import figure_filename, runs_vs_depth_figure, runs_vs_epoch_figure

__all__ = [
    "RunCurves",
    "UnreadableCurveFile",
    "available_namespaces",
    "find_runs",
    "load_run",
    "main",
    "summary_rows",
    "write_figures",
    "write_summary",
]

DEFAULT_NAMESPACES: tuple[str, ...] = ("rank", "rank_train", "weight")
DEFAULT_FINAL_METRICS: tuple[str, ...] = ("val/acc",)


@dataclass
class RunCurves:
    """The per-layer curves of one run.

    Attributes:
        label: the run's name in figures and tables.
        directory: the run directory.
        curves: ``namespace -> layer -> metric -> {epoch: value}``.
        layers: ``namespace -> layers in depth order``.
        final: last logged value of each requested final metric found in the run (e.g. ``val/acc``).
        metric_order: ``namespace -> metrics`` in the order the callback computed them, when a curves file says so.
        superseded: ``namespace -> epochs`` (or steps) that a resumed fit trained again: their earlier values, kept
            under ``"superseded"`` in the curve file, are not in :attr:`curves`.
        x_axes: ``namespace -> "step"`` for the namespaces whose curves are keyed by optimizer step (step cadence, or
            several validations per epoch); the others are keyed by epoch (:meth:`x_axis`).
    """

    label: str
    directory: Path
    curves: dict[str, dict[str, dict[str, dict[int, float]]]] = field(default_factory=dict)
    layers: dict[str, list[str]] = field(default_factory=dict)
    final: dict[str, float] = field(default_factory=dict)
    metric_order: dict[str, list[str]] = field(default_factory=dict)
    superseded: dict[str, list[int]] = field(default_factory=dict)
    x_axes: dict[str, str] = field(default_factory=dict)

    def x_axis(self, namespace: str) -> str:
        """What the curves of ``namespace`` are keyed by: ``"epoch"`` or ``"step"``."""
        return self.x_axes.get(namespace, "epoch")

    def metrics(self, namespace: str) -> list[str]:
        """Metrics of ``namespace``: in the callback's order when known, else in first-seen order over the layers."""
        seen: dict[str, None] = dict.fromkeys(self.metric_order.get(namespace, []))
        for layer in self.layers.get(namespace, []):
            seen.update(dict.fromkeys(self.curves[namespace].get(layer, {})))
        present = {m for curves in self.curves.get(namespace, {}).values() for m in curves}
        return [metric for metric in seen if metric in present]

    def last_point(self, namespace: str) -> int | None:
        """The last epoch (or step, see :meth:`x_axis`) with any value in ``namespace``."""
        epochs = [e for layer in self.curves.get(namespace, {}).values() for curve in layer.values() for e in curve]
        return max(epochs) if epochs else None


def _natural_key(name: str) -> list[int | str]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _is_run(directory: Path) -> bool:
    return (directory / "metrics.csv").is_file() or any((directory / FIGURE_DIR).glob("*_curves.json"))


def find_runs(paths: Iterable[str | Path]) -> list[tuple[str, Path]]:
    """Run directories at or below each path, with their labels.

    Args:
        paths: run directories or folders above runs.

    Returns:
        ``(label, directory)`` pairs in argument order, naturally sorted below each argument. A label is the run's
        path relative to the deepest folder shared by all runs (the folder name for a single run).

    Raises:
        FileNotFoundError: a path that does not exist, is a file, or holds no run.
    """
    found: list[Path] = []
    for path in map(Path, paths):
        if path.is_file():
            run = path.parent.parent if path.parent.name == FIGURE_DIR else path.parent
            this_run = f" ({str(run)!r} for this file)" if path.name == "metrics.csv" or run != path.parent else ""
            raise FileNotFoundError(
                f"run directory {str(path)!r} is a file, not a folder: give a run's folder{this_run}, one holding "
                f"metrics.csv or {FIGURE_DIR}/<namespace>_curves.json, or a folder above runs"
            )
        if not path.is_dir():
            raise FileNotFoundError(f"run directory {str(path)!r} does not exist")
        if _is_run(path):
            below = [path]
        else:
            candidates = {p.parent for p in path.rglob("metrics.csv")}
            candidates |= {p.parent.parent for p in path.rglob(f"{FIGURE_DIR}/*_curves.json")}
            below = sorted(candidates, key=lambda p: _natural_key(str(p)))
        if not below:
            raise FileNotFoundError(
                f"no run found in {str(path)!r}: expected a metrics.csv or {FIGURE_DIR}/<namespace>_curves.json in it "
                "or in a folder below it"
            )
        found.extend(run.resolve() for run in below if run.resolve() not in found)
    if len(found) == 1:
        return [(found[0].name, found[0])]
    shared = Path(os.path.commonpath(found))
    return [(str(run.relative_to(shared)), run) for run in found]


def _to_float(text: str | None) -> float | None:
    if text is None or text == "":
        return None
    try:
        return float(text)
    except ValueError:
        return None


def _read_metrics_csv(run: RunCurves, path: Path, namespaces: Sequence[str], final_metrics: Sequence[str]) -> None:
    """Curves of ``namespaces`` from a CSVLogger file: keyed by epoch, or by the ``step`` column for a namespace
    logged at more than one step of some epoch (step cadence, several validations per epoch), whose values one key
    per epoch would overwrite."""
    with path.open(newline="") as file:
        rows = list(csv.DictReader(file))
    if not rows:
        return
    columns = list(rows[0])
    found: dict[str, list[tuple[str, str, list[tuple[int | None, int, float]]]]] = {}
    for column in columns:
        namespace, _, rest = column.partition("/")
        layer, _, metric = rest.partition("/")
        if namespace not in namespaces or not layer or not metric:
            continue
        points = []
        for row in rows:
            value, epoch, step = _to_float(row[column]), _to_float(row.get("epoch")), _to_float(row.get("step"))
            if value is not None and epoch is not None:
                points.append((None if step is None else int(step), int(epoch), value))
        found.setdefault(namespace, []).append((layer, metric, points))
    for namespace, keys in found.items():
        steps_of: dict[int, set[int | None]] = {}
        for _, _, points in keys:
            for step, epoch, _ in points:
                steps_of.setdefault(epoch, set()).add(step)
        by_step = all(step is not None for steps in steps_of.values() for step in steps) and any(
            len(steps) > 1 for steps in steps_of.values()
        )
        if by_step:
            run.x_axes[namespace] = "step"
        for layer, metric, points in keys:
            curve = run.curves.setdefault(namespace, {}).setdefault(layer, {}).setdefault(metric, {})
            for step, epoch, value in points:
                curve[step if by_step else epoch] = value
    for key in final_metrics:
        if key in columns:
            values = [v for v in (_to_float(row[key]) for row in rows) if v is not None]
            if values:
                run.final[key] = values[-1]


class UnreadableCurveFile(ValueError):
    """A curve file that is not the JSON a rank callback writes (truncated, edited, another program's file)."""


def _read_curve_file(run: RunCurves, path: Path) -> None:
    try:
        content = read_curve_file(path)
        missing = [key for key in ("namespace", "layers", "metrics") if key not in content]
        if missing:
            raise KeyError(", ".join(missing))
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise UnreadableCurveFile(
            f"cannot read the curve file {str(path)!r} ({type(error).__name__}: {error}); move it out of the run "
            "folder, or restore it, to report the run"
        ) from error
    namespace = content["namespace"]
    run.layers[namespace] = list(content["layers"])
    run.metric_order[namespace] = list(content["metrics"])
    if not content["history"]:
        return
    # The whole history, which a resumed run's metrics.csv lacks (it starts at the resume): the curve file wins over
    # the CSV, keyed as the callback keyed it.
    if content["facts"].get("x_axis") == "step":
        run.x_axes[namespace] = "step"
    else:
        run.x_axes.pop(namespace, None)
    curves: dict[str, dict[str, dict[int, float]]] = {}
    for epoch, layers in content["history"].items():
        for layer, metrics in layers.items():
            for metric, value in metrics.items():
                curves.setdefault(layer, {}).setdefault(metric, {})[epoch] = value
    run.curves[namespace] = curves
    superseded = {epoch for block in content["superseded"] for epoch in block["history"]}
    if superseded:
        run.superseded[namespace] = sorted(superseded)


def available_namespaces(directory: str | Path) -> list[str]:
    """The namespaces of per-layer keys a run holds: those of its curve files, then the other ``<namespace>`` of
    ``metrics.csv`` columns ``<namespace>/<layer>/<metric>``.

    Args:
        directory: the run directory.

    Returns:
        The namespaces, curve files' first (sorted), then the CSV's in column order.
    """
    directory = Path(directory)
    found = dict.fromkeys(
        sorted(p.name.removesuffix("_curves.json") for p in (directory / FIGURE_DIR).glob("*_curves.json"))
    )
    csv_path = directory / "metrics.csv"
    if csv_path.is_file():
        with csv_path.open(newline="") as file:
            header = next(csv.reader(file), [])
        found.update(dict.fromkeys(column.split("/", 1)[0] for column in header if column.count("/") >= 2))
    return list(found)


def load_run(
    directory: str | Path,
    *,
    label: str | None = None,
    namespaces: Sequence[str] = DEFAULT_NAMESPACES,
    final_metrics: Sequence[str] = DEFAULT_FINAL_METRICS,
) -> RunCurves:
    """Read one run's curves from its ``rank_curves/<namespace>_curves.json`` files and ``metrics.csv``.

    A namespace's curves come from its curve file, which holds the run's whole history (also the epochs before a
    resume), else from ``metrics.csv``; keyed by epoch, or by optimizer step where they were measured by step
    (``RunCurves.x_axes``). Values a resumed fit replaced are left out (``RunCurves.superseded`` names their epochs).

    Args:
        directory: the run directory.
        label: the run's name; defaults to the directory name.
        namespaces: key prefixes to read.
        final_metrics: keys whose last logged value is kept (from ``metrics.csv``).

    Returns:
        The run's curves; namespaces without values are left out.

    Raises:
        UnreadableCurveFile: a curve file of ``namespaces`` that is not one a rank callback writes (its message names
            the file and the error).
    """
    directory = Path(directory)
    run = RunCurves(label=label or directory.name, directory=directory)
    csv_path = directory / "metrics.csv"
    if csv_path.is_file():
        _read_metrics_csv(run, csv_path, namespaces, final_metrics)
    for namespace in namespaces:
        curve_file = directory / FIGURE_DIR / f"{namespace}_curves.json"
        if curve_file.is_file():
            _read_curve_file(run, curve_file)
    for namespace, layers in run.curves.items():
        known = [layer for layer in run.layers.get(namespace, []) if layer in layers]
        extra = sorted((layer for layer in layers if layer not in known), key=_natural_key)
        run.layers[namespace] = known + extra
    run.layers = {ns: layers for ns, layers in run.layers.items() if ns in run.curves}
    return run


def _union(lists: Iterable[Sequence[str]]) -> list[str]:
    merged: dict[str, None] = {}
    for items in lists:
        merged.update(dict.fromkeys(items))
    return list(merged)


def _depth_order(orders: Iterable[Sequence[str]]) -> list[str]:
    """The layers of several runs in one depth order: every run's order is kept, so a layer that only some runs
    measured sits between its neighbours in those runs (a run measuring ``layer3`` alone does not move it before
    ``layer1``); layers no run orders against each other keep the order they were first seen in, as do the layers of
    runs that order them differently."""
    orders = [list(order) for order in orders]
    seen = _union(orders)
    before: dict[str, set[str]] = {layer: set() for layer in seen}
    for order in orders:
        for first, second in itertools.pairwise(order):
            before[second].add(first)
    merged: list[str] = []
    while len(merged) < len(seen):
        left = [layer for layer in seen if layer not in merged]
        ready = [layer for layer in left if before[layer] <= set(merged)]
        merged.append((ready or left)[0])
    return merged


def summary_rows(runs: Sequence[RunCurves]) -> tuple[list[str], list[dict[str, object]]]:
    """The summary table: one row per run, namespace and layer, with the last epoch's value of each metric (the last
    step's for curves keyed by step: their ``step`` column holds it, their ``epoch`` is empty; the ``step`` column is
    there only when some curves are keyed by step).

    Returns:
        ``(columns, rows)``; a missing value is ``None``.
    """
    namespaces = _union(run.layers for run in runs)
    metric_columns = _union([f"{ns}/{m}" for m in run.metrics(ns)] for run in runs for ns in namespaces)
    final_columns = _union(run.final for run in runs)
    steps = ["step"] if any(run.x_axes for run in runs) else []
    columns = ["run", "namespace", "layer", "depth", "epoch", *steps, *metric_columns, *final_columns]
    rows: list[dict[str, object]] = []
    for run in runs:
        for namespace in namespaces:
            last = run.last_point(namespace)
            for depth, layer in enumerate(run.layers.get(namespace, [])):
                row: dict[str, object] = dict.fromkeys(columns)
                row.update(run=run.label, namespace=namespace, layer=layer, depth=depth)
                row[run.x_axis(namespace)] = last
                for metric, curve in run.curves[namespace][layer].items():
                    row[f"{namespace}/{metric}"] = curve.get(last)
                row.update(run.final)
                rows.append(row)
    return columns, rows


def _format(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.4g}"
    return str(value)


def write_summary(runs: Sequence[RunCurves], out_dir: str | Path) -> tuple[Path, Path]:
    """Write ``summary.csv`` and ``summary.md`` (see :func:`summary_rows`) into ``out_dir``.

    Returns:
        The paths of the CSV and Markdown files.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    columns, rows = summary_rows(runs)
    csv_path, md_path = out_dir / "summary.csv", out_dir / "summary.md"
    with csv_path.open("w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=columns)
        writer.writeheader()
        writer.writerows({k: ("" if v is None else v) for k, v in row.items()} for row in rows)
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_format(row[c]) for c in columns) + " |" for row in rows]
    md_path.write_text("\n".join(lines) + "\n")
    return csv_path, md_path


def _metric_curves(run: RunCurves, namespace: str, metric: str) -> dict[str, dict[int, float]]:
    return {layer: metrics.get(metric, {}) for layer, metrics in run.curves.get(namespace, {}).items()}


def _x_axes(runs: Sequence[RunCurves], namespace: str) -> list[str]:
    """The axes (``"epoch"``, ``"step"``) that the runs holding ``namespace`` key its curves by."""
    holding = [run for run in runs if namespace in run.curves]
    return [axis for axis in ("epoch", "step") if any(run.x_axis(namespace) == axis for run in holding)]


def figure_count(runs: Sequence[RunCurves]) -> int:
    """The number of figures :func:`write_figures` writes for ``runs``: per namespace and metric, one against each
    axis its runs are keyed by and one against depth."""
    namespaces = _union(run.layers for run in runs)
    return sum(
        (len(_x_axes(runs, namespace)) + 1) * len(_union(run.metrics(namespace) for run in runs))
        for namespace in namespaces
    )


def write_figures(
    runs: Sequence[RunCurves], out_dir: str | Path, *, on_figure: Callable[[Path], None] | None = None
) -> list[Path]:
    """Write, per namespace and metric, the metric-vs-epoch and metric-vs-step (panel per layer; each with the runs
    keyed by that axis, written where there are any) and metric-vs-depth figures.

    The figures are shared between this process and worker processes where the machine has idle cores
    (:func:`~rank_lightning.figure_workers.draw_figures`).

    Args:
        runs: the runs, drawn together.
        out_dir: the folder of the PNG files.
        on_figure: called with each file's path once it is written (progress).

    Returns:
        Paths of the written PNG files.

    Raises:
        Exception: the error of the first figure that could not be drawn (after the others are written).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    jobs = []
    for namespace in _union(run.layers for run in runs):
        layers = _depth_order(run.layers.get(namespace, []) for run in runs)
        # The runs that hold the namespace: another run is no line of its figures (nor an empty legend entry).
        holding = [run for run in runs if namespace in run.curves]
        for metric in _union(run.metrics(namespace) for run in runs):
            stem = figure_filename(namespace, metric)
            curves = {run.label: _metric_curves(run, namespace, metric) for run in holding}
            for axis in _x_axes(runs, namespace):
                keyed = {run.label: curves[run.label] for run in holding if run.x_axis(namespace) == axis}
                along = (namespace, metric, layers, keyed)
                jobs.append(
                    FigureJob(
                        out_dir / f"{stem}_vs_{axis}.png", runs_vs_epoch_figure, along, {"x_label": axis}, dpi=110
                    )
                )
            last = {run.label: (run.last_point(namespace), curves[run.label]) for run in holding}
            axes = {run.label: run.x_axis(namespace) for run in holding}
            by_depth = (namespace, metric, layers, last)
            jobs.append(
                FigureJob(out_dir / f"{stem}_vs_depth.png", runs_vs_depth_figure, by_depth, {"x_labels": axes}, dpi=110)
            )

    def report(index: int, result: Path | Exception) -> None:
        if on_figure is not None and not isinstance(result, Exception):
            on_figure(result)

    written = draw_figures(jobs, on_figure=report)
    for result in written:
        if isinstance(result, Exception):
            raise result
    return [path for path in written if isinstance(path, Path)]


def _labels(runs: Sequence[str], shown: int = 6) -> str:
    if len(runs) <= shown:
        return ", ".join(runs)
    return f"{', '.join(runs[: shown - 1])}, ... ({len(runs) - shown} more), {runs[-1]}"


def _skipped(runs: Sequence[RunCurves], namespaces: Sequence[str], *, keep: bool) -> list[str]:
    """Runs without keys of ``namespaces``, grouped by the other namespaces they have, each group with the
    ``--namespaces`` that reports it (``keep``: together with ``namespaces``)."""
    groups: dict[tuple[str, ...], list[str]] = {}
    for run in runs:
        others = tuple(ns for ns in available_namespaces(run.directory) if ns not in namespaces)
        groups.setdefault(others, []).append(run.label)
    lines = []
    for others, labels in groups.items():
        if others:
            option = " ".join([*namespaces, *others] if keep else others)
            have = "it has" if len(labels) == 1 else "they have"
            lines.append(f"{_labels(labels)} ({have} {', '.join(others)}: --namespaces {option})")
        else:
            lines.append(f"{_labels(labels)} (no <namespace>/<layer>/<metric> keys at all)")
    return lines


def _unmatched(runs: Sequence[RunCurves], namespaces: Sequence[str], final_metrics: Sequence[str]) -> list[str]:
    """A line per requested namespace and final metric (other than the defaults, which a run may lack) that none of
    the reported ``runs`` holds: a misspelled one would otherwise leave the report silently without it."""
    have = _union(available_namespaces(run.directory) for run in runs)
    lines = [
        f"--namespaces {namespace}: no run has keys {namespace}/<layer>/<metric>; the runs have: {', '.join(have)}"
        for namespace in namespaces
        if namespace not in DEFAULT_NAMESPACES and all(namespace not in run.curves for run in runs)
    ]
    missing = [
        key for key in final_metrics if key not in DEFAULT_FINAL_METRICS and all(key not in r.final for r in runs)
    ]
    if missing:
        logged = _union(_run_level_keys(run.directory) for run in runs)
        others = f"the runs logged: {', '.join(logged)}" if logged else "the runs logged no run-level key"
        lines += [f"--final-metrics {key}: no run logged it; {others}" for key in missing]
    return lines


def _run_level_keys(directory: Path) -> list[str]:
    """The ``metrics.csv`` columns of a run other than ``epoch``, ``step`` and per-layer keys."""
    path = directory / "metrics.csv"
    if not path.is_file():
        return []
    with path.open(newline="") as file:
        header = next(csv.reader(file), [])
    return [column for column in header if column not in ("epoch", "step") and column.count("/") < 2]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m rank_lightning.analysis.report`` (see the module docstring)."""
    parser = argparse.ArgumentParser(
        prog="python -m rank_lightning.analysis.report",
        description="Figures and summary table of the per-layer rank curves of finished runs.",
    )
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories or folders above runs")
    parser.add_argument(
        "--out",
        required=True,
        metavar="OUT_DIR",
        help="folder for the figures and tables (a new OUT_DIR/run_<n> when it already holds files)",
    )
    parser.add_argument(
        "--namespaces",
        nargs="+",
        default=list(DEFAULT_NAMESPACES),
        help="key prefixes to report (default: %(default)s)",
    )
    parser.add_argument(
        "--final-metrics",
        nargs="*",
        default=list(DEFAULT_FINAL_METRICS),
        help="keys whose final value joins the summary (default: %(default)s)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar (none is drawn outside a terminal)")
    args = parser.parse_args(argv)
    try:
        found = find_runs(args.runs)
    except FileNotFoundError as error:
        parser.error(str(error))
    show = show_progress(args.quiet)
    try:
        with progress_bar(show) as progress:
            runs = [
                load_run(directory, label=label, namespaces=args.namespaces, final_metrics=args.final_metrics)
                for label, directory in progress.track(found, description="reading runs")
            ]
    except UnreadableCurveFile as error:
        parser.error(str(error))
    empty = [run for run in runs if not run.curves]
    requested = " ".join(args.namespaces)
    if len(empty) == len(runs):
        parser.error(
            f"no keys of the namespaces {requested} in {'; '.join(_skipped(empty, args.namespaces, keep=False))}"
        )
    runs = [run for run in runs if run.curves]
    try:
        out_dir = fresh_directory(args.out)
    except NotADirectoryError as error:
        parser.error(str(error))
    with progress_bar(show) as progress:
        drawing = progress.add_task("drawing figures", total=figure_count(runs))
        figures = write_figures(runs, out_dir, on_figure=lambda _: progress.advance(drawing))
    tables = write_summary(runs, out_dir)
    print(f"{len(runs)} run(s): {_labels([run.label for run in runs])}")
    for line in _skipped(empty, args.namespaces, keep=True):
        print(f"skipped, no keys of {requested}: {line}")
    for line in _unmatched(runs, args.namespaces, args.final_metrics):
        print(line)
    for run in runs:
        if kept := sorted(p.name for p in (run.directory / FIGURE_DIR).glob("*_curves-v*.json")):
            print(
                f"{run.label}: the curves of an earlier run in its folder, kept as {FIGURE_DIR}/{', '.join(kept)}, are "
                f"not reported (copied into a folder of their own as {FIGURE_DIR}/<namespace>_curves.json, they are)"
            )
    replaced = [
        f"{run.label} {ns} {run.x_axis(ns)}s {epoch_ranges(points)}"
        for run in runs
        for ns, points in run.superseded.items()
    ]
    if replaced:
        print(
            f"values replaced by a resumed fit, not drawn: {'; '.join(replaced)} "
            f"(kept under 'superseded' in the run's {FIGURE_DIR}/<namespace>_curves.json)"
        )
    print_written(out_dir, {"figures": figures, "tables": tables}, requested=args.out)
    return 0


if __name__ == "__main__":
    run_command(main)
