"""Per-layer metric curves shared by the rank callbacks: log them, remember them, chart them, draw them.

A rank callback computes, once per epoch, a value per layer and per metric. :class:`LayerCurves` does everything that
follows with those numbers, identically for every callback:

1. logs each value as the scalar ``"{namespace}/{layer}/{metric}"`` in one batched write (:func:`publish_scalars`):
   straight to every logger on rank zero (as Lightning's ``LearningRateMonitor`` does, without the per-key cost of
   ``LightningModule.log``; an ``MLFlowLogger`` under names MLflow takes, :func:`logger_row`) and into
   ``trainer.callback_metrics`` on every rank, where ``ModelCheckpoint`` / ``EarlyStopping`` monitor them; the
   values are equal on every DDP rank by construction, so no synchronisation is needed. Under ``trainer.validate``
   / ``trainer.test`` they go through ``pl_module.log_dict`` instead (:func:`log_rank_equal`), so that the results
   those calls return include them. A value exists only in the epochs that measured it:
   :meth:`LayerCurves.start_epoch`, called at the start of every training epoch, removes the previous
   measurement from ``trainer.callback_metrics``, so that
   ``EarlyStopping(strict=False)`` skips the epochs in between instead of counting a repeated value;
2. keeps the history ``epoch -> layer -> metric -> value`` and saves it in checkpoints through
   :meth:`LayerCurves.state_dict` / :meth:`LayerCurves.load_state_dict`, so a resumed run continues its curves. A
   fit resumed from a checkpoint older than the curves it finds (in memory or in the run directory's curve file)
   trains those epochs again: when it starts training (:meth:`LayerCurves.settle_resume`, or at the latest at its
   first training epoch, :meth:`LayerCurves.start_epoch`) a warning names them, their values move under
   ``"superseded"`` (with every earlier superseded block the file or memory holds: never lost) and the curve file is
   rewritten. Values found there that were measured after the checkpoint was saved, of its weights (a save at the
   end of a batch, before the validation that follows), stay in the history. Rank zero alone reads the curve file:
   under DDP the other processes' histories lack the points found there (the history of rank zero is the one that
   checkpoints, files and figures take; the values logged are the same on every process). A checkpoint loaded
   outside a fit (``trainer.validate`` / ``trainer.test`` with ``ckpt_path``) takes nothing away: the curves of the
   run that recorded them (the same trainer) keep every point and only gain the checkpoint's points they lack; curves
   that hold none (a new process) take the checkpoint's, and the run directory's curve file's later points when the
   file agrees with them (a file that does not is another run's, kept under another name). Its measurement is
   recorded at the checkpoint's epoch (or step), as is that of a later ``trainer.validate(model)`` of the module it
   was loaded into, no optimizer step taken since; one of a checkpoint saved inside an epoch that the curves hold
   measured at its end (later weights) is logged and returned, with a warning, but not recorded over that epoch;
3. when a ``WandbLogger`` (of ``pytorch_lightning`` or ``lightning.pytorch``) is attached, logs on rank zero two
   line-series charts per metric: ``"{namespace}_curves/{metric}_vs_epoch"`` (one line per layer) and
   ``"{namespace}_curves/{metric}_vs_depth"`` (x is the layer's depth index, one line per epoch, at most
   ``max_depth_curves`` epochs), plus once the table ``"{namespace}_curves/layers"`` mapping depth index to layer.
   Each chart carries the whole history, so they are sent after the first recorded epoch, after the ``n``-th,
   ``2n``-th, ``4n``-th, ``8n``-th... (``n`` is ``wandb_charts_every_n_epochs``: each time the history has doubled),
   and by :meth:`LayerCurves.finish` at the end of fit (not after every epoch or every ``n``-th, which would upload a
   quadratically growing amount: a chart of 10,000 rows takes W&B about 0.3 s to build); the scalars themselves go to
   W&B every epoch. A chart is a W&B table of one row per line and point, which W&B cuts at ``wandb.Table.MAX_ROWS``
   rows (10,000): a longer history is charted on fewer points (epochs), evenly spaced, first and last included;
4. writes, on rank zero, into ``<run dir>/rank_curves/``: ``{namespace}_curves.json`` (layers in depth order and the
   whole history, kept up to date at every recorded epoch so that runs without a CSV logger can be reported on; read
   back by :func:`read_curve_file`: each point is appended, as one JSON line, to a file that the curve file names
   under ``"appended"`` (``.{namespace}_curves.json.<random>.jsonl``), and the curve file is rewritten whole, with
   every point, once as many points were appended as it holds, when a resume changes the history, and when the
   figures are drawn (:meth:`LayerCurves.write_figures`, by :meth:`LayerCurves.finish` at the end of fit); so a
   record costs the same at the 10th point and at the 3,000th, and a run killed at any moment leaves files that
   :func:`read_curve_file` reads whole) and, when
   :meth:`LayerCurves.write_figures` is called (by :meth:`LayerCurves.finish`, which the owning callback calls in
   ``on_fit_end``; also after every ``figures_every_n_epochs``-th recorded epoch when set), one PNG figure per
   metric, ``{namespace}_{metric}.png`` (characters other than letters, digits and ``_.=-`` become ``_``;
   :func:`~rank_lightning.plotting.layer_curves_figure`): the metric against epoch, one line per layer, beside the
   metric against depth, one line per epoch (at most ``max_depth_curves`` epochs), titled in words, with a caption
   line built from what :meth:`LayerCurves.describe` was told (split, N, reduction, tolerance). Each file is replaced
   in one step (the appended points aside); one that cannot be written (a full disk, a read-only folder) or drawn is
   a warning naming the path and the error, and the fit goes on. A curve file or figure of another run found where a
   fresh history writes its first is kept under another name (:meth:`LayerCurves.claim`). A debug run
   (``Trainer(fast_dev_run=...)``) writes no files (:func:`~rank_lightning.files.writes_files`): it measures and logs.

A value measured before the first training step is recorded at epoch ``-1`` (:data:`INITIAL_EPOCH`) by
:meth:`LayerCurves.record_initial`, which sends it straight to the loggers (``pl_module.log`` is not allowed in
``on_train_start``); figures draw it as ``init``.

Figures are drawn synchronously, once at the end of fit by default: a figure takes matplotlib 0.1-0.5 s, and nothing
is left running after ``fit`` returns.

The run directory (:func:`run_directory`) is the folder that holds Lightning's ``checkpoints/``: the first logger's
``log_dir`` (CSV, TensorBoard), ``<save_dir>/<project>/<run id>`` for W&B, ``trainer.default_root_dir`` without a
logger; it is resolved without collectives, so rank zero alone may ask.

Usage inside a callback::

    class MyMonitor(pl.Callback):
        def __init__(self) -> None:
            self.curves = LayerCurves("mine")

        def setup(self, trainer, pl_module, stage) -> None:
            self.curves.describe(split="val", samples=1024)  # the figures' caption

        def on_train_start(self, trainer, pl_module) -> None:
            self.curves.settle_resume(trainer)  # a resumed fit's rewound epochs

        def on_train_epoch_start(self, trainer, pl_module) -> None:
            self.curves.start_epoch(trainer)  # no stale value for EarlyStopping (and the rewind, if not settled yet)

        def on_validation_epoch_end(self, trainer, pl_module) -> None:
            values = {"encoder.0": {"stable_rank": 3.1}, "encoder.2": {"stable_rank": 2.4}}  # ordered by depth
            self.curves.record_and_log(trainer, pl_module, values)

        def on_fit_end(self, trainer, pl_module) -> None:
            self.curves.finish(trainer)  # last W&B charts and the figures

        def state_dict(self) -> dict:
            return {"curves": self.curves.state_dict()}

        def load_state_dict(self, state_dict: dict) -> None:
            self.curves.load_state_dict(state_dict["curves"])

Names: the namespace and layer names must not contain ``"/"`` (the report splits keys on it); metric names may
(``"flatten/numerical_rank"``). Values may be Python numbers or one-element tensors; NaN and Inf are logged as they
are and never raise.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import math
import re
import secrets
import sys
import warnings
import weakref
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from rank_lightning.figure_workers import FigureJob, draw_figures, start_figure_workers
from rank_lightning.files import RunFiles, file_stamp, replace_file, unwritten_warning, writes_files
from rank_lightning.plotting import (
    INITIAL_EPOCH,
    Reference,
    caption_text,
    epoch_label,
    evenly_spaced,
    figure_filename,
    layer_curves_figure,
)
from rank_lightning.validation import check_bool, check_choice, check_positive_int, count_of

__all__ = [
    "FIGURE_DIR",
    "INITIAL_EPOCH",
    "TEST_SUFFIX",
    "X_AXES",
    "LayerCurves",
    "append_curve_point",
    "check_distinct_namespaces",
    "check_namespace",
    "epoch_ranges",
    "evaluated_point",
    "log_rank_equal",
    "log_step",
    "logger_row",
    "publish_scalars",
    "read_curve_file",
    "run_directory",
    "wandb_loggers",
    "write_curve_file",
]

X_AXES = ("epoch", "step")
"""What a history may be keyed by (:class:`LayerCurves`' ``x_axis``)."""

UNDRAWN_METRICS = frozenset({"spectrum_rows", "alpha_ks_distance"})
"""Bookkeeping values logged beside the metrics (rows behind a spectrum, a fit's KS distance): no figure of their own;
they are in the curve file and the logs."""

FIGURE_DIR = "rank_curves"
"""Name of the folder inside the run directory that receives figures and curve files."""

History = dict[int, dict[str, dict[str, float]]]


def run_directory(trainer: Any) -> Path:
    """Directory of the current run, the one that holds Lightning's ``checkpoints/`` folder.

    The first logger's ``log_dir`` when it has one (CSV, TensorBoard); otherwise ``<save_dir>/<name>/<version>``, as
    ``ModelCheckpoint`` builds it (W&B: ``<save_dir>/<project>/<run id>``), with ``trainer.default_root_dir`` standing
    in for a missing ``save_dir``; without any logger, ``trainer.default_root_dir``. Unlike ``trainer.log_dir`` it does
    not broadcast, so rank zero alone may call it, and it does not ``isinstance``-check logger classes, so it works
    with loggers of either Lightning package.

    Args:
        trainer: a ``pytorch_lightning`` or ``lightning.pytorch`` Trainer.

    Returns:
        The directory (not created).
    """
    loggers = getattr(trainer, "loggers", None) or []
    if not loggers:
        return Path(trainer.default_root_dir)
    logger = loggers[0]
    log_dir = getattr(logger, "log_dir", None)
    if log_dir:
        return Path(log_dir)
    save_dir = getattr(logger, "save_dir", None) or trainer.default_root_dir
    version = logger.version
    return Path(save_dir, str(logger.name), version if isinstance(version, str) else f"version_{version}")


def wandb_loggers(trainer: Any) -> list[Any]:
    """The trainer's ``WandbLogger`` instances, of ``pytorch_lightning`` or ``lightning.pytorch``.

    Both packages define a ``WandbLogger`` and neither is a subclass of the other; the class name is what they share.
    """
    return [
        logger
        for logger in getattr(trainer, "loggers", None) or []
        if any(cls.__name__ == "WandbLogger" for cls in type(logger).__mro__)
    ]


def log_rank_equal(pl_module: Any, scalars: Mapping[str, Any]) -> None:
    """Log epoch-level scalars that are equal on every process, through ``pl_module.log_dict``.

    Every process logs them, so ``ModelCheckpoint`` and ``EarlyStopping`` can monitor them on any rank. They are
    synchronised with the maximum over processes: the values are equal by construction (reduced or broadcast before
    logging), so the maximum returns each one bit for bit, and Lightning has no reason to advise ``sync_dist=True``.
    Call it on every process from an epoch-end hook, with the same keys.

    The values are logged as float64 tensors (float32 where the device has no float64: MPS), so the results of
    ``trainer.validate`` and the loggers keep the digits the curve file has; ``LightningModule.log`` would turn a
    Python float into a float32 tensor.

    Args:
        pl_module: the LightningModule (either Lightning package).
        scalars: ``key -> value`` (numbers or one-element tensors); nothing is logged when empty.
    """
    if not scalars:
        return
    device = getattr(pl_module, "device", torch.device("cpu"))
    dtype = torch.float32 if torch.device(device).type == "mps" else torch.float64
    values = {key: torch.as_tensor(value, dtype=dtype, device=device).reshape(()) for key, value in scalars.items()}
    pl_module.log_dict(values, on_step=False, on_epoch=True, sync_dist=True, reduce_fx="max")


def publish_scalars(
    trainer: Any, scalars: Mapping[str, float], *, epoch: int | None = None, step: int | None = None
) -> None:
    """Write scalars that are equal on every process in one batch: to the loggers and to ``callback_metrics``.

    On rank zero every logger receives ``{**scalars, "epoch": epoch}`` at ``step`` (by default the step Lightning
    logs at, the count of optimizer steps taken) and is saved, as Lightning's own logger connector does; on every
    rank the values enter ``trainer.callback_metrics`` as float64 tensors, so ``ModelCheckpoint(monitor=...)`` and
    ``EarlyStopping`` read them like logged metrics. One write replaces one ``LightningModule.log`` call per key
    (about 0.25 ms each).

    Args:
        trainer: the Trainer (either Lightning package).
        scalars: ``key -> value``; nothing is written when empty.
        epoch: the ``"epoch"`` value sent along; ``None`` sends ``trainer.current_epoch``.
        step: the loggers' step; ``None`` for Lightning's (:func:`log_step`).
    """
    if not scalars:
        return
    metrics = getattr(trainer, "callback_metrics", None)
    if metrics is not None:
        metrics.update({key: torch.tensor(value, dtype=torch.float64) for key, value in scalars.items()})
    if not getattr(trainer, "is_global_zero", True):
        return
    step = log_step(trainer) if step is None else step
    row = {**scalars, "epoch": trainer.current_epoch if epoch is None else epoch}
    for logger in getattr(trainer, "loggers", None) or []:
        logger.log_metrics(logger_row(logger, row), step=step)
        logger.save()


MLFLOW_REFUSED = re.compile(r"[^a-zA-Z0-9_/. -]+")
"""The characters MLflow refuses in a metric name (it takes letters, digits and ``_/. -``), as Lightning's
``MLFlowLogger`` finds them to drop them."""

_logger_names: weakref.WeakKeyDictionary[Any, dict[str, str]] = weakref.WeakKeyDictionary()


def logger_row(logger: Any, row: Mapping[str, Any]) -> dict[str, Any]:
    """``row`` (``key -> value``) with the keys ``logger`` takes: the same keys, but for an ``MLFlowLogger`` (of
    ``pytorch_lightning`` or ``lightning.pytorch``), to which a key is sent without the characters MLflow refuses,
    as Lightning's ``MLFlowLogger`` names it (``rank/blocks.0@2/effective_rank`` -> ``rank/blocks.02/effective_rank``),
    so that a value logged through ``LightningModule.log`` lands on the same name. Where that name is already another
    key's (``rank/blocks.1@1/...`` and the layer ``blocks.11``), the characters become ``_`` instead
    (``rank/blocks.1_1/...``; then ``_2``, ``_3``... are appended), so that no two curves meet under one name. Each
    key keeps its name for the logger's whole run; one warning names the keys renamed, instead of Lightning's warning
    for every key at every write."""
    if not any(cls.__name__ == "MLFlowLogger" for cls in type(logger).__mro__):
        return dict(row)
    try:
        names = _logger_names.setdefault(logger, {})
    except TypeError:  # a logger that cannot be referenced weakly: names within this row only
        names = {}
    taken = set(names.values())
    renamed: list[str] = []
    # The keys MLflow takes as they are keep their names first; a renamed one may not take theirs.
    for key in sorted((k for k in row if k not in names), key=lambda k: MLFLOW_REFUSED.search(k) is not None):
        name = MLFLOW_REFUSED.sub("", key)
        if name in taken or not name:
            base = MLFLOW_REFUSED.sub("_", key)
            name = next(n for n in (base, *(f"{base}_{i}" for i in range(2, len(taken) + 3))) if n not in taken)
        names[key] = name
        taken.add(name)
        if name != key:
            renamed.append(key)
    if renamed:
        shown = ", ".join(f"{key!r} -> {names[key]!r}" for key in renamed[:3])
        more = f" and {count_of(len(renamed) - 3, 'more key')}" if len(renamed) > 3 else ""
        warnings.warn(
            f"MLflow takes letters, digits and '_', '/', '.', '-', ' ' in metric names: {type(logger).__name__} "
            f"receives {count_of(len(renamed), 'key')} renamed ({shown}{more}); the other loggers and "
            "trainer.callback_metrics keep the keys.",
            UserWarning,
            stacklevel=3,
        )
    return {names[key]: value for key, value in row.items()}


def log_step(trainer: Any) -> int:
    """The step Lightning's own logging uses now: the batches that took an optimizer step in this fit
    (``global_step`` as a fallback), less one at the end of a training epoch (``on_train_epoch_end``), where Lightning
    logs the epoch's metrics at the step of its last batch, as it logs a validation run at the end of the epoch.
    Without it a measurement of the epoch would land on the first step of the next epoch."""
    fit_loop = getattr(trainer, "fit_loop", None)
    stepped = getattr(getattr(fit_loop, "epoch_loop", None), "_batches_that_stepped", None)
    if not isinstance(stepped, int):
        return int(getattr(trainer, "global_step", 0))
    # Lightning marks an epoch processed before its on_train_epoch_end hooks and completed after logging its metrics.
    progress = getattr(getattr(fit_loop, "epoch_progress", None), "current", None)
    processed, completed = getattr(progress, "processed", None), getattr(progress, "completed", None)
    at_epoch_end = isinstance(processed, int) and isinstance(completed, int) and processed > completed
    return max(stepped - 1, 0) if at_epoch_end and _trainer_fn(trainer) == "fit" else stepped


_NAMESPACE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def check_namespace(namespace: str) -> str:
    """``namespace`` if it can name keys, curve files and figures: letters, digits and ``_.-``, a letter or digit first.

    Raises:
        ValueError: another value, named.
    """
    if not isinstance(namespace, str) or not _NAMESPACE.fullmatch(namespace):
        raise ValueError(
            f"namespace={namespace!r} cannot name logged keys and files; use letters, digits and '_', '.', '-' "
            "(a letter or digit first), e.g. 'rank_channel'"
        )
    return namespace


TEST_SUFFIX = "_test"
"""What a monitor's namespace takes for the values of ``trainer.test`` runs (``rank_test/<layer>/<metric>``)."""


def check_distinct_namespaces(trainer: Any, callback: Any) -> None:
    """Raise if a callback before ``callback`` among the trainer's logs under its namespace, or under the namespace
    of its test values (``<namespace>_test``, :data:`TEST_SUFFIX`), or takes this one's: their keys, curve files and
    figures would overwrite each other's. (The later of the two raises, at its setup, once its own settings are
    checked.)

    Raises:
        ValueError: naming both callbacks and the namespace.
    """
    namespace = callback.curves.namespace
    for other in getattr(trainer, "callbacks", None) or []:
        if other is callback:
            return
        curves = getattr(other, "curves", None)
        if not isinstance(curves, LayerCurves):
            continue
        if namespace == curves.namespace + TEST_SUFFIX or curves.namespace == namespace + TEST_SUFFIX:
            base, derived = sorted((namespace, curves.namespace), key=len)
            raise ValueError(
                f"{type(callback).__name__} and {type(other).__name__} log under namespaces {base!r} and {derived!r}: "
                f"the values of trainer.test runs of the monitor under {base!r} go to {derived}/..., the keys of the "
                f"other; choose a namespace that does not end in {TEST_SUFFIX!r}"
            )
        if curves.namespace != namespace:
            continue
        takes = [type(c).__name__ for c in (callback, other) if "namespace" in inspect.signature(type(c)).parameters]
        remedy = f"pass namespace='...' to one {' or '.join(dict.fromkeys(takes))}" if takes else "keep one of them"
        raise ValueError(
            f"{type(callback).__name__} and {type(other).__name__} both log under namespace {namespace!r}: their keys, "
            f"{namespace}_curves.json and figures would overwrite each other; {remedy}"
        )


def _start_figure_workers(trainer: Any, curves: LayerCurves) -> None:
    """Start the processes that help draw the run's figures, once their number is known: the metrics recorded so far
    by ``curves`` and by the curves of the trainer's other callbacks (:func:`~rank_lightning.figure_workers.
    start_figure_workers`; none for a run of few figures, or one that writes no files). Called on rank zero after each
    record: workers that run already are kept, so matplotlib's import is done in them while the model trains."""
    if not writes_files(trainer):
        return
    others = (getattr(callback, "curves", None) for callback in getattr(trainer, "callbacks", None) or [])
    run = {id(c): c for c in (curves, *others) if isinstance(c, LayerCurves)}
    start_figure_workers(sum(len(c.drawn_metrics) * len(c.figure_layer_groups()) for c in run.values()))


def _to_float(value: Any) -> float:
    if isinstance(value, torch.Tensor):
        return float(value.detach().to("cpu", torch.float64))
    return float(value)


def _shared(name: Any) -> Any:
    """``name`` as the one string object every equal name of the history is (:func:`sys.intern`)."""
    return sys.intern(name) if type(name) is str else name


def _check_name(kind: str, name: str) -> None:
    if not isinstance(name, str) or not name or "/" in name:
        raise ValueError(f"{kind} must be a non-empty string without '/', got {name!r}")


def _trainer_fn(trainer: Any) -> str:
    fn = getattr(getattr(trainer, "state", None), "fn", None)
    return str(getattr(fn, "value", fn))


def _last_trained_epoch(trainer: Any) -> int:
    """The epoch whose training left the weights an evaluation after ``fit`` measures: the last epoch the fit
    started. ``trainer.current_epoch`` counts the epochs run by then, one more once the last of them has ended."""
    progress = getattr(getattr(getattr(trainer, "fit_loop", None), "epoch_progress", None), "current", None)
    started = getattr(progress, "started", None)
    return started - 1 if isinstance(started, int) and started > 0 else int(trainer.current_epoch)


def evaluated_point(
    trainer: Any,
    at: int,
    x_axis: str,
    checkpoint_point: tuple[int, int] | None = None,
    held_checkpoint: tuple[int, int] | None = None,
) -> int:
    """Where values measured now are recorded in a history keyed by ``x_axis`` (``"epoch"`` or ``"step"``): ``at``
    during ``fit``; for ``validate`` / ``test``, the epoch or step of the checkpoint loaded (``checkpoint_point``,
    ``(epoch, global_step)`` as its ``on_load_checkpoint`` read them), or of the one an earlier ``validate`` / ``test``
    loaded into the module measured now, no optimizer step taken since (``held_checkpoint``: its weights are the
    module's still), else the initial point (epoch ``-1``, step ``0``) for a model no optimizer step has touched (a
    later fit must not overwrite it with its epoch 0), else the last epoch the fit trained (the step on a step axis),
    where that fit recorded the same weights."""
    if _trainer_fn(trainer) not in ("validate", "test"):
        return at
    loaded = checkpoint_point if getattr(trainer, "ckpt_path", None) else held_checkpoint
    if loaded is not None and loaded[1] > 0:
        return loaded[1] if x_axis == "step" else loaded[0]
    if trainer.global_step == 0:
        return INITIAL_EPOCH if x_axis == "epoch" else 0
    return at if x_axis == "step" else _last_trained_epoch(trainer)


def _fitting(trainer: Any) -> bool:
    return _trainer_fn(trainer) == "fit"


def _json_ready(value: Any) -> Any:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return str(value)
    return value


def epoch_ranges(epochs: Iterable[int]) -> str:
    """``"2-5, 8"`` for epochs 2, 3, 4, 5, 8 (steps alike)."""
    ranges: list[list[int]] = []
    for epoch in sorted(epochs):
        if ranges and epoch == ranges[-1][1] + 1:
            ranges[-1][1] = epoch
        else:
            ranges.append([epoch, epoch])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges)


def _block_text(block: Mapping[str, Any]) -> str:
    """A superseded block as canonical JSON text: equal blocks give equal texts (NaN included)."""
    history = {str(e): block["history"][e] for e in sorted(block["history"], key=int)}
    return json.dumps({"resumed_at": block["resumed_at"], "history": history}, sort_keys=True)


def _point_text(values: Mapping[str, Any]) -> str:
    """One point's values as canonical JSON text: equal values give equal texts (NaN included)."""
    return json.dumps(values, sort_keys=True)


def _weak(value: Any) -> weakref.ref[Any] | None:
    """A weak reference to ``value``; ``None`` for one that cannot be referenced weakly (a stand-in trainer)."""
    try:
        return weakref.ref(value)
    except TypeError:
        return None


def _epochs_as_text(history: Mapping[int, Any]) -> dict[str, Any]:
    return {str(epoch): history[epoch] for epoch in sorted(history)}


def _epochs_as_int(history: Mapping[Any, Any]) -> dict[int, Any]:
    return {int(epoch): {layer: dict(m) for layer, m in layers.items()} for epoch, layers in history.items()}


def write_curve_file(
    path: Path,
    namespace: str,
    layers: list[str],
    metrics: list[str],
    history: Mapping,
    *,
    facts: Mapping[str, Any] | None = None,
    superseded: list[Mapping[str, Any]] | None = None,
    appended: str | None = None,
) -> None:
    """Write curves as JSON: ``{"namespace", "layers", "metrics", "history": {epoch: {layer: {metric: value}}}}``.

    Three keys are added only when there is something to say: ``"facts"`` (how the values were measured,
    :meth:`LayerCurves.describe`), ``"superseded"`` (``[{"resumed_at": epoch, "history": {...}}, ...]``: the
    values of epochs that a resumed fit trained again) and ``"appended"`` (the name of a file beside it that later
    points are appended to, one JSON line each: :func:`append_curve_point`). NaN and Inf are written as JSON's
    ``NaN`` / ``Infinity`` literals, which :func:`read_curve_file` reads back. The file is replaced in one step
    (written beside it, then renamed: :func:`~rank_lightning.files.replace_file`), so that a run killed while writing
    leaves the previous version whole.

    Raises:
        OSError: the file could not be written (the previous version is then whole).
    """
    content: dict[str, Any] = {"namespace": namespace, "layers": layers, "metrics": metrics}
    content["history"] = _epochs_as_text(history)
    if facts:
        content["facts"] = dict(facts)
    if superseded:
        content["superseded"] = [
            {"resumed_at": block["resumed_at"], "history": _epochs_as_text(block["history"])} for block in superseded
        ]
    if appended:
        content["appended"] = appended
    text = json.dumps(content).encode()
    replace_file(path, lambda file: file.write(text))


def append_curve_point(
    path: Path, point: int, values: Mapping[str, Mapping[str, float]], facts: Mapping[str, Any] | None = None
) -> None:
    """Append one point's values to ``path``, the file a curve file names under ``"appended"``: one JSON line
    ``{"point": point, "values": {layer: {metric: value}}}`` (with ``"facts"`` when they changed), written after a
    newline, so that a line cut short by a killed run stands alone and is skipped by :func:`read_curve_file`.

    Raises:
        OSError: the file could not be written.
    """
    line: dict[str, Any] = {"point": int(point), "values": values}
    if facts:
        line["facts"] = dict(facts)
    with open(path, "ab") as file:
        file.write(b"\n" + json.dumps(line).encode())


def read_curve_file(path: str | Path) -> dict[str, Any]:
    """Read what :func:`write_curve_file` wrote, with the points appended since (:func:`append_curve_point`; a line
    cut short by a killed run is skipped); epochs come back as ``int``.

    Returns:
        A dict with the keys ``namespace`` (str), ``layers`` and ``metrics`` (lists), ``history``
        (``epoch -> layer -> metric -> value``), ``facts`` (a dict) and ``superseded`` (a list of
        ``{"resumed_at": epoch, "history": ...}``); the last two are empty when the file has none.
    """
    path = Path(path)
    content = json.loads(path.read_text())
    appended = content.pop("appended", None)
    if isinstance(appended, str) and Path(appended).name == appended:
        _apply_appended(content, path.with_name(appended))
    content["history"] = _epochs_as_int(content["history"])
    content.setdefault("facts", {})
    content["superseded"] = [
        {"resumed_at": block["resumed_at"], "history": _epochs_as_int(block["history"])}
        for block in content.get("superseded", [])
    ]
    return content


def _apply_appended(content: dict[str, Any], path: Path) -> None:
    """Add to ``content`` (a curve file read) the points appended to ``path`` since it was written (none when the file
    is missing): each replaces what its point held; new layers and metrics join the orders in first-seen order."""
    try:
        lines = path.read_bytes().split(b"\n")
    except FileNotFoundError:
        return
    layers, metrics = content.setdefault("layers", []), content.setdefault("metrics", [])
    for text in lines:
        try:
            line = json.loads(text) if text.strip() else None
        except ValueError:  # cut short by a run killed while appending it
            continue
        if not isinstance(line, dict) or "point" not in line or not isinstance(line.get("values"), dict):
            continue
        content.setdefault("history", {})[str(line["point"])] = line["values"]
        for layer, values in line["values"].items():
            if layer not in layers:
                layers.append(layer)
            metrics.extend(metric for metric in dict.fromkeys(values) if metric not in metrics)
        if isinstance(line.get("facts"), dict):
            content["facts"] = {**content.get("facts", {}), **line["facts"]}


def _charts_due(trained: int, every: int) -> bool:
    """Whether the W&B charts are sent after the ``trained``-th recorded point: the first, then the ``every``-th,
    ``2 * every``-th, ``4 * every``-th... (each chart carries the whole history: a constant cadence would send a
    quadratically growing amount, tens of seconds per send for long step-cadence runs)."""
    if trained == 1:
        return True
    times, rest = divmod(trained, every)
    return rest == 0 and times & (times - 1) == 0


def _appended_path(path: Path) -> Path | None:
    """The file of appended points that the curve file ``path`` names (``None`` when it names none, or is no curve
    file)."""
    try:
        with open(path, "rb") as file:
            name = json.loads(file.read()).get("appended")
    except (OSError, ValueError, AttributeError):
        return None
    return path.with_name(name) if isinstance(name, str) and Path(name).name == name else None


class _CurveTail:
    """Where the points recorded since the curve file was last rewritten are appended (rank zero)."""

    def __init__(self, path: Path, points: int, facts: Mapping[str, Any]) -> None:
        self.name = f".{path.name}.{secrets.token_hex(4)}.jsonl"
        self.path = path.with_name(self.name)
        self.base_points = points  # points the curve file holds: rewritten once as many are appended (amortized O(1))
        self.appended = 0
        self.facts = dict(facts)
        self.stamp: tuple[int, int, int] | None = None  # the curve file as written: changed by another, rewrite


class LayerCurves:
    """History, logging, W&B charts and figures of per-layer metrics for one namespace.

    Args:
        namespace: first part of every key, e.g. ``"rank"`` for activations or ``"weight"`` for weights.
        figures_every_n_epochs: also redraw the PNG figures after every this many recorded epochs; ``None`` draws
            them only when :meth:`write_figures` is called (by :meth:`finish`, at the end of fit).
        wandb_charts: log the line-series charts to W&B when a ``WandbLogger`` is attached.
        wandb_charts_every_n_epochs: send the charts after this many recorded epochs, then each time the history has
            doubled (``2n``, ``4n``, ...; and after the first, and at :meth:`finish`).
        max_depth_curves: at most this many epochs (evenly spaced, first and last included) are drawn in the
            metric-vs-depth figures and charts.
        x_axis: what the history is keyed by: ``"epoch"`` (``trainer.current_epoch``, the initial point at ``-1``)
            or ``"step"`` (``trainer.global_step``, optimizer steps; the initial point at step ``0``), for monitors
            with a step cadence (and, by :meth:`key_by_step`, for epoch-cadence monitors of fits that validate
            several times per epoch). Figures, charts and the curve file name it; a loaded state keyed by step keeps
            the history keyed by step.

    Raises:
        ValueError: a namespace containing ``"/"``, a ``max_depth_curves`` below 2, or a cadence that is not a
            positive integer.
    """

    def __init__(
        self,
        namespace: str,
        *,
        figures_every_n_epochs: int | None = None,
        wandb_charts: bool = True,
        wandb_charts_every_n_epochs: int = 5,
        max_depth_curves: int = 8,
        x_axis: str = "epoch",
    ) -> None:
        _check_name("namespace", namespace)
        self.x_axis = check_choice("x_axis", x_axis, X_AXES)
        check_positive_int("figures_every_n_epochs", figures_every_n_epochs, allow_none=True)
        check_positive_int("wandb_charts_every_n_epochs", wandb_charts_every_n_epochs)
        check_bool("wandb_charts", wandb_charts)
        if isinstance(max_depth_curves, bool) or not isinstance(max_depth_curves, int) or max_depth_curves < 2:
            raise ValueError(f"max_depth_curves must be an integer >= 2, got {max_depth_curves!r}")
        self.namespace = namespace
        self.figures_every_n_epochs = figures_every_n_epochs
        self.wandb_charts = wandb_charts
        self.wandb_charts_every_n_epochs = wandb_charts_every_n_epochs
        self.max_depth_curves = max_depth_curves
        self.separate_suffixes: tuple[str, ...] = ()
        """Layer-name endings whose layers get figures of their own (see :meth:`figure_layer_groups`): matrices of
        another kind than their neighbours in depth, such as ``WeightRankMonitor``'s LoRA updates, whose values would
        zig-zag through the depth panel."""
        self._x_axis_at_start = self.x_axis
        self._logged_keys: set[str] = set()
        self._published = False  # whether callback_metrics may hold keys of this object (clear_stale_metrics)
        self._references: dict[str, Reference] = {}
        self._unwritten: set[tuple[str, str]] = set()  # (path, error) of the curve files warned about
        self._warned_other_weights: set[tuple[int, int]] = set()  # (epoch, step) of the evaluations kept out
        self.restart()

    def restart(self) -> None:
        """Forget the history, as a new object would hold none: for a fresh ``fit`` (another Trainer, or another
        model) of a monitor whose curves hold an earlier fit's points, which would otherwise mix with the new ones
        (the initial point of the earlier model kept, its epochs overwritten one by one). The curve file written so
        far stays on disk: a fit into the same folder keeps it under another name (:meth:`claim`)."""
        self.x_axis = self._x_axis_at_start
        self._history: History = {}
        self._layers: list[str] = []
        self._metrics: list[str] = []
        self._checkpoint_point: tuple[int, int] | None = None
        # The optimizer step of each point a fit recorded on an epoch axis: an evaluation after it of other weights
        # (a validation inside the last epoch, then more steps) must not replace the fit's measurement.
        self._steps: dict[int, int] = {}
        # The checkpoint a validate / test loaded (its point, the module it went into, the trainer's step then): what a
        # later evaluation of that module measures until an optimizer step; whether the state being loaded is one's
        # of the run that recorded the points held (adds to them); and the trainer of that run.
        self._held_checkpoint: tuple[weakref.ref[Any], tuple[int, int], int] | None = None
        self._adds_to_held = False
        self._recorded_by: weakref.ref[Any] | None = None
        self._evaluated_by: weakref.ref[Any] | None = None  # the validate / test whose checkpoint is being loaded
        self._checkpoint_unmeasured = False  # whether the saved curves of the checkpoint loaded lack its epoch
        self._facts: dict[str, Any] = {} if self.x_axis == "epoch" else {"x_axis": self.x_axis}
        self._superseded: list[dict[str, Any]] = []
        self._wandb_layer_table_logged = False
        self._charted_epochs: list[int] | None = None
        # Set by load_state_dict: the epochs that held values before loading, and whether the first recorded epoch of
        # the fit that follows is still to be checked for a rewind.
        self._before_loading: History = {}
        self._superseded_before_loading: list[dict[str, Any]] = []
        self._rewind_check = False
        # The files and folders of the run directory this history has made its own (claim); a history loaded from a
        # checkpoint continues a saved run, whose files are its own already.
        self._run_files = RunFiles(f"LayerCurves({self.namespace!r})")
        self._tail: _CurveTail | None = None  # where the next points are appended to the curve file (rank zero)
        # Files of appended points that the next whole rewrite of the curve file replaces (then removes), and whether
        # the curve file found before the first rewrite (its own: a resumed run's) was asked for the one it names.
        self._retired: list[Path] = []
        self._looked_for_appended = False

    def claim(self, path: Path, what: str) -> bool:
        """Make ``path`` (a file or folder of the run directory that this history writes) this run's, before its first
        write (:meth:`~rank_lightning.files.RunFiles.claim`): one left there by another run is kept as
        ``<stem>-v<n><suffix>``, with a warning; the files of a run this history continues (loaded from a checkpoint, or
        written by it) are its own. Whether ``path`` may be written.

        Args:
            path: the file or folder.
            what: what it holds, in words (``"curves"``, ``"singular values"``), for the warning.
        """
        return self._run_files.claim(path, what)

    @property
    def layers(self) -> list[str]:
        """Every layer recorded so far, in depth order (the order of the first epoch that named it)."""
        return list(self._layers)

    @property
    def metrics(self) -> list[str]:
        """Every metric recorded so far, in first-seen order."""
        return list(self._metrics)

    @property
    def drawn_metrics(self) -> list[str]:
        """The recorded metrics that get a figure: all but :data:`UNDRAWN_METRICS`."""
        return [metric for metric in self._metrics if metric.rsplit("/", 1)[-1] not in UNDRAWN_METRICS]

    @property
    def epochs(self) -> list[int]:
        """Recorded epochs, ascending (:data:`INITIAL_EPOCH`, -1, first when the untrained model was measured)."""
        return sorted(self._history)

    @property
    def history(self) -> History:
        """A copy of the history ``epoch -> layer -> metric -> value``."""
        return _epochs_as_int(self._history)

    @property
    def facts(self) -> dict[str, Any]:
        """What :meth:`describe` was told."""
        return dict(self._facts)

    @property
    def superseded(self) -> list[dict[str, Any]]:
        """Values replaced by resumed fits: ``[{"resumed_at": epoch, "history": {epoch: {layer: {...}}}}, ...]``."""
        return [{"resumed_at": b["resumed_at"], "history": _epochs_as_int(b["history"])} for b in self._superseded]

    def key(self, layer: str, metric: str) -> str:
        """The logged scalar key ``"{namespace}/{layer}/{metric}"``."""
        return f"{self.namespace}/{layer}/{metric}"

    def curve(self, layer: str, metric: str) -> tuple[list[int], list[float]]:
        """Epochs and values of one layer's metric (epochs where it is missing are left out)."""
        epochs = [e for e in self.epochs if metric in self._history[e].get(layer, {})]
        return epochs, [self._history[e][layer][metric] for e in epochs]

    def add_reference(self, metric: str, reference: Reference) -> None:
        """Draw a theory's prediction beside the measured curves of ``metric`` in the figures (an option).

        Example: ``monitor.curves.add_reference("flatten/numerical_rank", theorem5_reference(layers, width=128))``
        draws Feng et al. Theorem 5's rank per layer over the depth panel (see :class:`~rank_lightning.plotting.
        Reference`, :func:`~rank_lightning.plotting.theorem5_reference`,
        :func:`~rank_lightning.plotting.sqrt_width_reference`).
        """
        if not isinstance(reference, Reference):
            raise ValueError(f"reference must be a rank_lightning.plotting.Reference, got {type(reference).__name__}")
        self._references[metric] = reference

    def describe(self, **facts: Any) -> None:
        """Say how the values are measured; the figures' caption line and the curve file state it.

        Facts are merged with earlier ones (a later call may update ``samples``, for one). Known facts, formatted by
        :func:`~rank_lightning.plotting.caption_text`: ``split`` (``"val"``, ``"train"``), ``samples`` (N, the number
        of samples measured), ``reduction`` (a string or ``{kind of activations: reduction}``), ``rank_tolerance``
        (a float, or ``None`` for the default), ``tolerance_size`` (``"min"`` / ``"max"``), ``tolerance_dtype`` and
        ``measured`` (``"activations"`` or ``"weights"``); any other fact is shown as ``"<name>: <value>"``. Values
        that JSON cannot hold are stored as text.

        Example: ``curves.describe(split="val", samples=4096, reduction={"conv maps": "channel"},
        rank_tolerance=None, tolerance_size="min")``.
        """
        self._facts.update({name: _json_ready(value) for name, value in facts.items()})

    def caption(self) -> str:
        """The caption line of the figures, from :meth:`describe`'s facts (empty when none were given)."""
        return caption_text(self._facts)

    @staticmethod
    def _as_floats(values: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, float]]:
        return {
            layer: {metric: _to_float(value) for metric, value in metrics.items()} for layer, metrics in values.items()
        }

    def record(self, epoch: int, values: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, float]]:
        """Store one epoch's values (replacing what that epoch held) without logging anything.

        Args:
            epoch: the epoch the values belong to (:data:`INITIAL_EPOCH` for the untrained model).
            values: ``layer -> metric -> value``, layers ordered by depth; values are numbers or one-element tensors.

        Returns:
            The stored values as floats.
        """
        stored: dict[str, dict[str, float]] = {}
        for layer, metrics in values.items():
            _check_name("layer name", layer)
            # One string object per name in the whole history (interned), not one per point: a checkpoint pickles
            # each object once, so a history of 2,000 points saves in 10 MB instead of 26 MB.
            layer = _shared(layer)
            stored[layer] = {_shared(metric): _to_float(value) for metric, value in metrics.items()}
            if layer not in self._layers:
                self._layers.append(layer)
            for metric in stored[layer]:
                if metric not in self._metrics:
                    self._metrics.append(metric)
        self._history[int(epoch)] = stored
        return stored

    def key_by_step(self) -> None:
        """Key the history by optimizer step from now on (``x_axis="step"``), for an epoch-cadence monitor whose fit
        validates several times per epoch: keyed by epoch, each measurement would replace the one before it in the
        same epoch. An untrained model's point (epoch ``-1``, recorded by a ``trainer.validate`` before the fit) moves
        to step ``0``, the initial point of a step axis.

        Raises:
            RuntimeError: the history already holds values of trained epochs.
        """
        if self.x_axis == "step":
            return
        trained = [epoch for epoch in self._history if epoch != INITIAL_EPOCH]
        if trained:
            raise RuntimeError(
                f"LayerCurves({self.namespace!r}) holds {count_of(len(trained), 'trained point')} keyed by epoch; it "
                "cannot be keyed by step from now on"
            )
        self.x_axis = "step"
        self._facts["x_axis"] = "step"
        if INITIAL_EPOCH in self._history:
            self._history[0] = self._history.pop(INITIAL_EPOCH)

    @property
    def initial_point(self) -> int:
        """Where the untrained model's values are recorded: epoch ``-1``, or step ``0`` for a step axis."""
        return INITIAL_EPOCH if self.x_axis == "epoch" else 0

    def record_and_log(self, trainer: Any, pl_module: Any, values: Mapping[str, Mapping[str, Any]]) -> None:
        """Record ``values`` at ``trainer.current_epoch`` (``trainer.global_step`` for a step axis) and log them
        everywhere (see the module docstring).

        Outside ``fit``, an evaluation of a model that took no optimizer step (``trainer.validate`` before training)
        is recorded at epoch ``-1``, the initial point, so that the ``fit`` that follows does not overwrite it; an
        evaluation of a checkpoint (``trainer.validate(ckpt_path=...)``) is recorded at the checkpoint's epoch (or
        step), where its ``fit`` recorded the same weights (:meth:`note_checkpoint`); one of the weights a ``fit``
        left (``trainer.validate(model)`` after it) at the last epoch that fit trained (or its step), not at
        ``trainer.current_epoch``, which by then counts one epoch more. On an epoch axis, where the fit measured that
        epoch at another optimizer step (a validation inside the epoch, then more steps), the evaluation is of other
        weights: its values are logged (``trainer.validate`` returns them) but kept out of the history, which keeps
        the fit's, with a warning naming both steps. So are those of an evaluation of the weights of a point the
        history holds whose values differ from that point's (other data: ``trainer.validate(model, other_loader)``
        after the fit), with a warning naming the point.

        Call it on every rank, with the same values (they are written without synchronisation). Calls during the
        sanity check are ignored: Lightning discards what is logged there, and an untrained model would leave an epoch
        in the history that never happened. The first call of a ``fit`` resumed by :meth:`load_state_dict` checks for
        a rewind (the module docstring).

        Args:
            trainer: the Trainer (either Lightning package).
            pl_module: the LightningModule being fitted.
            values: ``layer -> metric -> value``, layers ordered by depth.
        """
        if getattr(trainer, "sanity_checking", False):
            return
        at = trainer.global_step if self.x_axis == "step" else trainer.current_epoch
        if self._rewind_check and _fitting(trainer):
            self._rewind_check = False
            self._supersede_rewound(trainer, at)
        point = self._evaluated_point(trainer, at, pl_module)
        if self._kept_out(trainer, pl_module, point, values):
            return
        scalars = self._scalars(self.record(point, values))
        self._note_recorder(trainer)
        if _fitting(trainer):
            if self.x_axis == "epoch":
                self._steps[point] = int(getattr(trainer, "global_step", 0))
            publish_scalars(trainer, scalars, step=self.logger_step(trainer))
        else:
            # One evaluation run: the per-key cost does not matter, and values logged through the module are also in
            # the results trainer.validate() / trainer.test() return.
            log_rank_equal(pl_module, scalars)
        self._logged_keys.update(scalars)
        self._published = self._published or bool(scalars)
        if trainer.is_global_zero:
            self._write_recorded(trainer, point)

    def _write_recorded(self, trainer: Any, point: int) -> None:
        """On rank zero, after a point is recorded: the curve file, the figure workers, the W&B charts and the figures
        when due."""
        self._write_curve_file(trainer, point)
        _start_figure_workers(trainer, self)
        trained = len([epoch for epoch in self._history if epoch != self.initial_point])
        if self.wandb_charts and _charts_due(trained, self.wandb_charts_every_n_epochs):
            self._log_wandb_charts(trainer)
        if self.figures_every_n_epochs is not None and trained % self.figures_every_n_epochs == 0:
            self.write_figures(trainer)

    def logger_step(self, trainer: Any) -> int:
        """The loggers' step of a value recorded now during ``fit``: on a step axis the step the curve file and the
        figures show (``trainer.global_step``, the initial point being step 0), else the step Lightning logs at
        (:func:`log_step`). What is sent beside the scalars (the W&B charts, a monitor's W&B histograms) goes there
        too."""
        return int(trainer.global_step) if self.x_axis == "step" else log_step(trainer)

    def note_checkpoint(
        self, epoch: int | None, global_step: int | None, *, trainer: Any = None, pl_module: Any = None
    ) -> None:
        """Note the epoch and step of the checkpoint being loaded (the monitors call it from ``on_load_checkpoint``):
        an evaluation of it is recorded there.

        Given the ``trainer``, a checkpoint loaded by ``trainer.validate`` / ``trainer.test`` (an evaluation) is
        noted as such: its weights stay those of ``pl_module``, so a later evaluation of that module without
        ``ckpt_path`` (no optimizer step taken since) is recorded at the checkpoint's point too; and, when that trainer
        recorded the points held (its run's, in its curve file), they are kept when the checkpoint's saved state is
        loaded (:meth:`load_state_dict`)."""
        self._checkpoint_point = None if epoch is None or global_step is None else (int(epoch), int(global_step))
        evaluating = trainer is not None and _trainer_fn(trainer) in ("validate", "test")
        self._adds_to_held = evaluating and self._recorded_by is not None and self._recorded_by() is trainer
        self._evaluated_by = _weak(trainer) if evaluating else None
        self._held_checkpoint = None
        self._checkpoint_unmeasured = False  # set when its saved curves are loaded
        if evaluating and self._checkpoint_point is not None and pl_module is not None:
            self._held_checkpoint = (weakref.ref(pl_module), self._checkpoint_point, int(trainer.global_step))

    def _note_recorder(self, trainer: Any) -> None:
        """Remember the trainer whose run the points held belong to (:meth:`note_checkpoint`)."""
        self._recorded_by = _weak(trainer)

    def _loaded_checkpoint(self, trainer: Any, pl_module: Any) -> tuple[int, int] | None:
        """The checkpoint whose weights an evaluation measures now: the one it loaded (``ckpt_path``), or the one an
        earlier evaluation loaded into ``pl_module``, no optimizer step taken since."""
        if getattr(trainer, "ckpt_path", None):
            return self._checkpoint_point
        if self._held_checkpoint is not None:
            module, point, step = self._held_checkpoint
            if pl_module is not None and module() is pl_module and int(trainer.global_step) == step:
                return point
        return None

    def _evaluated_point(self, trainer: Any, at: int, pl_module: Any = None) -> int:
        loaded = self._loaded_checkpoint(trainer, pl_module)
        return evaluated_point(trainer, at, self.x_axis, loaded, loaded)

    def _kept_out(self, trainer: Any, pl_module: Any, point: int, values: Mapping[str, Mapping[str, Any]]) -> bool:
        """Whether an evaluation's values are logged but kept out of the history (each check logs them and warns):
        :meth:`_measured_later`, :meth:`_holds_other_weights`, :meth:`_measured_otherwise`."""
        return (
            self._measured_later(trainer, pl_module, point, values)
            or self._holds_other_weights(trainer, pl_module, point, values)
            or self._measured_otherwise(trainer, pl_module, point, values)
        )

    def _measured_later(
        self, trainer: Any, pl_module: Any, point: int, values: Mapping[str, Mapping[str, Any]]
    ) -> bool:
        """Whether an evaluation of a checkpoint would write over the measurement of later weights: a checkpoint saved
        inside an epoch (``ModelCheckpoint(every_n_train_steps=...)``), before that epoch was measured (its saved
        curves lack the epoch), whose epoch the curves hold (measured at its end). Its values are then logged through
        the module (``trainer.validate`` / ``trainer.test`` return them) but not recorded, with a warning."""
        later = (
            not _fitting(trainer)
            and self._checkpoint_unmeasured
            and self.x_axis == "epoch"
            and point in self._history
            and self._loaded_checkpoint(trainer, pl_module) is not None
            and point == self._checkpoint_point[0]
        )
        if later:
            log_rank_equal(pl_module, self._scalars(self._as_floats(values)))
            message = (
                f"LayerCurves({self.namespace!r}): the checkpoint evaluated (epoch {point}, step "
                f"{self._checkpoint_point[1]}) was saved before its epoch's measurement, which the curves hold, of "
                f"later weights; its values are logged and returned, not recorded at epoch {point}"
            )
            warnings.warn(message, UserWarning, stacklevel=3)
        return later

    def _holds_other_weights(
        self, trainer: Any, pl_module: Any, point: int, values: Mapping[str, Mapping[str, Any]]
    ) -> bool:
        """Whether an evaluation outside ``fit`` would replace, at the epoch ``point``, the fit's measurement of other
        weights (the fit validated inside that epoch and took more optimizer steps after it). Its values are then
        logged through the module (``trainer.validate`` returns them) but kept out of the history, with a warning."""
        recorded = self._steps.get(point)
        if _fitting(trainer) or self.x_axis != "epoch" or recorded is None or point not in self._history:
            return False
        loaded = self._loaded_checkpoint(trainer, pl_module)
        now = loaded[1] if loaded is not None and loaded[1] > 0 else int(getattr(trainer, "global_step", 0))
        if now == recorded:
            return False
        log_rank_equal(pl_module, self._scalars(self._as_floats(values)))
        if getattr(trainer, "is_global_zero", True) and (point, now) not in self._warned_other_weights:
            self._warned_other_weights.add((point, now))
            warnings.warn(
                f"LayerCurves({self.namespace!r}): this evaluation measures the weights of optimizer step {now}, but "
                f"epoch {point}, where the curves (keyed by epoch) put it, holds the fit's measurement at step "
                f"{recorded}: its values are logged (and returned by trainer.validate) but kept out of the curves, "
                "which keep the fit's.",
                UserWarning,
                stacklevel=4,
            )
        return True

    def _measured_otherwise(
        self, trainer: Any, pl_module: Any, point: int, values: Mapping[str, Mapping[str, Any]]
    ) -> bool:
        """Whether an evaluation outside ``fit`` would replace the point ``point`` the history holds with other values:
        the same weights measured on other data (``trainer.validate(model, other_loader)`` after the fit: a test split,
        an out-of-distribution set) or other rows. The history keeps its point (the curve file, the figures); the
        evaluation's values are logged through the module (``trainer.validate`` returns them), with a warning naming
        the point. Values equal to the held ones within ``1e-6``, relative (the rounding of kernels that add in
        another order, as GPU ones may), are the same measurement, recorded as such."""
        held = self._history.get(point)
        if _fitting(trainer) or held is None:
            return False
        measured = self._as_floats(values)
        if all(
            layer in held
            and all(
                metric in held[layer]
                and (
                    math.isclose(value, held[layer][metric], rel_tol=1e-6, abs_tol=1e-9)
                    or (math.isnan(value) and math.isnan(held[layer][metric]))
                )
                for metric, value in metrics.items()
            )
            for layer, metrics in measured.items()
        ):
            return False
        log_rank_equal(pl_module, self._scalars(measured))
        if getattr(trainer, "is_global_zero", True):
            where = f"step {point}" if self.x_axis == "step" else f"epoch {point}"
            warnings.warn(
                f"LayerCurves({self.namespace!r}): this trainer.{_trainer_fn(trainer)} measures the weights the "
                f"curves hold at {where}, but its values differ from those recorded there (other data, or other "
                f"rows): they are logged (and returned by trainer.{_trainer_fn(trainer)}) but kept out of the curves, "
                "the curve file and the figures, which keep the point recorded first.",
                UserWarning,
                stacklevel=4,
            )
        return True

    def record_initial(self, trainer: Any, values: Mapping[str, Mapping[str, Any]]) -> None:
        """Record the untrained model's ``values`` at epoch ``-1`` (step ``0`` for a step axis) and send them to the
        loggers at once.

        For hooks that run before the first training step (``on_train_start``), where ``pl_module.log`` is not
        allowed: on rank zero every logger receives ``{"<namespace>/<layer>/<metric>": value, ..., "epoch": -1}`` at
        ``step=trainer.global_step``, and the curve file is written. Figures draw the point as ``init``; it is not
        counted by the chart and figure cadences, and never reaches ``trainer.callback_metrics``. Call it on every
        rank (each keeps the same history); calls during the sanity check are ignored.

        Args:
            trainer: the Trainer (either Lightning package).
            values: ``layer -> metric -> value``, layers ordered by depth.
        """
        if getattr(trainer, "sanity_checking", False):
            return
        scalars = self._scalars(self.record(self.initial_point, values))
        self._note_recorder(trainer)
        if not trainer.is_global_zero:
            return
        if scalars:
            for logger in getattr(trainer, "loggers", None) or []:
                logger.log_metrics(logger_row(logger, {**scalars, "epoch": INITIAL_EPOCH}), step=trainer.global_step)
        self._write_curve_file(trainer, self.initial_point)
        _start_figure_workers(trainer, self)

    def start_epoch(self, trainer: Any) -> None:
        """Call at the start of every training epoch: settles the rewound epochs of a fit resumed from a checkpoint
        (:meth:`settle_resume`, once, unless called before) and removes the previous measurement from
        ``trainer.callback_metrics`` (:meth:`clear_stale_metrics`)."""
        self.settle_resume(trainer)
        self.clear_stale_metrics(trainer)

    def settle_resume(self, trainer: Any) -> None:
        """Settle the rewound epochs of a fit resumed from a checkpoint, once (module docstring); call it when the fit
        starts training (``on_train_start``, as the package's monitors do: Lightning does not call
        ``on_train_epoch_start`` for an epoch it resumes at the end of a checkpoint's batch) or at the latest by
        :meth:`start_epoch`.

        A fit resumed at epoch ``e`` (``trainer.current_epoch``) trains epochs ``e`` on again; one resumed at optimizer
        step ``g`` (a step axis) measures steps after ``g`` again; values found between the checkpoint's last one and
        that point were measured after the checkpoint was saved, of its weights, and stay. A callback that calls
        neither settles them at its first record instead, naming the first recorded epoch.
        """
        if self._rewind_check and _fitting(trainer) and not getattr(trainer, "sanity_checking", False):
            self._rewind_check = False
            resumed_at = trainer.global_step + 1 if self.x_axis == "step" else trainer.current_epoch
            if self._supersede_rewound(trainer, resumed_at, resumed_at=True) and trainer.is_global_zero:
                self._write_curve_file(trainer)

    def clear_stale_metrics(self, trainer: Any) -> None:
        """Remove the values this object logged from ``trainer.callback_metrics`` (:meth:`start_epoch` calls it, and
        the step-cadence monitors at the end of every training batch, before they measure: a step's values stay
        from the end of its batch to the end of the next, so every callback's batch end sees them once).

        Lightning keeps the last value of every key in ``trainer.callback_metrics`` for the rest of the fit, so in the
        epochs (or steps) between two measurements ``EarlyStopping`` and ``ModelCheckpoint`` would read the previous
        measurement again (``EarlyStopping`` counting it as an epoch without improvement). Without it they find no
        value: ``EarlyStopping(strict=False)`` skips the epoch, ``ModelCheckpoint(every_n_epochs=...)`` (or
        ``every_n_train_steps=...``) with the monitor's cadence saves at measurements only.
        """
        metrics = getattr(trainer, "callback_metrics", None)
        if metrics is None or not self._published:
            return
        self._published = False
        for key in self._logged_keys:
            metrics.pop(key, None)

    @property
    def holds_values(self) -> bool:
        """Whether ``trainer.callback_metrics`` may hold values this object logged (not cleared since)."""
        return self._published

    @property
    def logged_keys(self) -> frozenset[str]:
        """Every key this object has logged so far."""
        return frozenset(self._logged_keys)

    def finish(self, trainer: Any) -> None:
        """End of fit: send the W&B charts if they miss recorded epochs, and write the figures (rank zero only), which
        rewrites the curve file whole (:meth:`write_figures`)."""
        if not trainer.is_global_zero:
            return
        if self.wandb_charts and self._history and self._charted_epochs != self.epochs:
            self._log_wandb_charts(trainer)
        self.write_figures(trainer)

    def figure_dir(self, trainer: Any) -> Path:
        """``<run dir>/rank_curves``, where figures and curve files go."""
        return run_directory(trainer) / FIGURE_DIR

    def write_figures(self, trainer: Any) -> list[Path]:
        """Draw, on rank zero, one PNG per metric: metric vs epoch (line per layer) beside metric vs depth; and
        rewrite the curve file whole first, the points appended since its last rewrite in it (module docstring).

        The figures are shared between this process and worker processes where the machine has idle cores
        (:func:`~rank_lightning.figure_workers.draw_figures`); the files are written when this returns. A figure of
        another run found where this one draws its first is kept as ``<name>-v<n>.png``, as the curve file is, with one
        warning naming every figure kept (:meth:`~rank_lightning.files.RunFiles.claim_all`). A debug run
        (``fast_dev_run``) draws none (:func:`~rank_lightning.files.writes_files`).

        Args:
            trainer: the Trainer, used to find the run directory and the rank.

        Returns:
            Paths of the files (empty on other ranks, in a debug run or before anything was recorded).
        """
        if not trainer.is_global_zero or not self._history or not writes_files(trainer):
            return []
        if (self._tail is not None and self._tail.appended) or self._retired:  # one JSON file again, every point in it
            self._write_curve_file(trainer, compact=True)
        jobs, drawn = self._figure_jobs(self.figure_dir(trainer), self.drawn_metrics)
        claimed = self._run_files.claim_all([job.path for job in jobs], "figures")
        jobs, drawn = [j for j, c in zip(jobs, claimed) if c], [m for m, c in zip(drawn, claimed) if c]
        try:
            results = draw_figures(jobs)
        except Exception as error:  # the workers' setting or machinery: draw here instead, never fail the run
            warnings.warn(
                f"LayerCurves: figure workers failed ({error!r}); drawing the figures in this process",
                RuntimeWarning,
                stacklevel=2,
            )
            results = draw_figures(jobs, workers=0)
        paths = []
        for job, metric, result in zip(jobs, drawn, results):
            if isinstance(result, Exception):  # a figure must never take the run down; the curve file keeps the data
                warnings.warn(
                    f"LayerCurves: drawing {self.namespace!r} {metric!r} failed ({result!r}), so {job.path} is not "
                    f"written; the curves are in {self.namespace}_curves.json and python -m "
                    "rank_lightning.analysis.report can draw them",
                    RuntimeWarning,
                    stacklevel=2,
                )
            else:
                self._run_files.wrote(result)
                paths.append(result)
        return paths

    def figure_layer_groups(self) -> list[tuple[str, list[str]]]:
        """The layers drawn together, ``(suffix, layers)`` in depth order: every layer whose name ends in none of
        :attr:`separate_suffixes` (suffix ``""``), then, for each of those suffixes, the layers ending in it."""
        groups = {suffix: [] for suffix in ("", *self.separate_suffixes)}
        for layer in self._layers:
            groups[next((s for s in self.separate_suffixes if layer.endswith(s)), "")].append(layer)
        return [(suffix, layers) for suffix, layers in groups.items() if layers]

    def _figure_jobs(self, directory: Path, metrics: Sequence[str]) -> tuple[list[FigureJob], list[str]]:
        """One :func:`~rank_lightning.plotting.layer_curves_figure` per metric and group of
        :meth:`figure_layer_groups` (``{namespace}_{metric}{suffix}.png``), into ``directory``; and each one's
        metric."""
        options = {"max_depth_curves": self.max_depth_curves, "x_label": self.x_axis, "caption": self.caption()}
        jobs, drawn = [], []
        for metric in metrics:
            for suffix, layers in self.figure_layer_groups():
                jobs.append(
                    FigureJob(
                        directory / f"{figure_filename(self.namespace, metric + suffix)}.png",
                        layer_curves_figure,
                        (self.namespace, metric, layers, self._history),
                        {**options, "reference": self._references.get(metric)},
                    )
                )
                drawn.append(metric)
        return jobs, drawn

    def state_dict(self) -> dict[str, Any]:
        """Namespace, layer order, history, facts, superseded values and the optimizer step of each point a fit
        recorded on an epoch axis, for checkpoints."""
        return {
            "namespace": self.namespace,
            "layers": self.layers,
            "metrics": self.metrics,
            "history": self.history,
            "facts": self.facts,
            "superseded": self.superseded,
            "steps": dict(self._steps),
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned, so a resumed run continues its curves.

        Facts given to :meth:`describe` before loading win over the loaded ones. The ``fit`` that follows is checked
        for a rewind at its first training epoch (:meth:`start_epoch`; module docstring); values held before loading
        that the loaded state lacks are superseded then, not lost.

        The state of a checkpoint that ``trainer.validate`` / ``trainer.test`` loads (:meth:`note_checkpoint`) into
        curves holding points that the same trainer recorded (its run's, in its curve file) adds to them and takes
        nothing away: the points held stay as they are, the state's points they lack and its superseded blocks are
        added; nothing else changes (what a later ``fit`` resumes or rewinds). Other curves take the state whole, as
        for a resume.

        Raises:
            ValueError: the state belongs to another namespace.
        """
        if state_dict["namespace"] != self.namespace:
            raise ValueError(
                f"cannot load curves of namespace {state_dict['namespace']!r} into namespace {self.namespace!r}"
            )
        adds, self._adds_to_held = self._adds_to_held, False
        evaluation, self._evaluated_by = self._evaluated_by, None
        saved = self._checkpoint_point
        self._checkpoint_unmeasured = saved is not None and saved[0] not in _epochs_as_int(state_dict["history"])
        if adds and (self._history or self._superseded):
            self._add_saved_state(state_dict)
            self._retire_tail()  # the history changed: the curve file is rewritten whole at its next write
            return
        self._before_loading = self._history
        self._superseded_before_loading = self._superseded
        self._history = _epochs_as_int(state_dict["history"])
        self._layers = list(state_dict["layers"])
        self._metrics = list(state_dict["metrics"])
        self._facts = {**state_dict.get("facts", {}), **self._facts}
        if self._facts.get("x_axis") == "step":  # a fit keyed by step (key_by_step) goes on keyed by step
            self.x_axis = "step"
        self._superseded = [
            {"resumed_at": b["resumed_at"], "history": _epochs_as_int(b["history"])}
            for b in state_dict.get("superseded", [])
        ]
        self._steps = {int(point): int(step) for point, step in state_dict.get("steps", {}).items()}
        self._rewind_check = True
        self._run_files.continues = True
        trainer = None if evaluation is None else evaluation()
        if trainer is not None:
            self._take_curve_file(trainer)
        self._retire_tail()

    def _take_curve_file(self, trainer: Any) -> None:
        """For the state a ``validate`` / ``test`` loaded whole (into curves of another trainer: a fresh process), on
        rank zero: the run directory's curve file continues the same run when every point both hold has the same
        values; its points the state lacks (the epochs after the checkpoint) and its superseded blocks are then taken
        in, so that rewriting it loses none of them. A file that disagrees (or shares no point) is another run's: it and
        its figures are kept under another name at the first write (:meth:`claim`)."""
        if not getattr(trainer, "is_global_zero", True) or not writes_files(trainer):
            return
        try:
            content = read_curve_file(self.curve_path(trainer))
            found, blocks = content["history"], content["superseded"]
            same_axis = content["facts"].get("x_axis", "epoch") == self.x_axis
        except (OSError, ValueError, KeyError, TypeError, AttributeError):  # no file, or not one this module wrote
            return
        shared = set(found) & set(self._history)
        if not same_axis or not shared or any(_point_text(found[p]) != _point_text(self._history[p]) for p in shared):
            self._run_files.continues = False
            return
        self._add_points(found, content["layers"], content["metrics"], blocks)

    def _add_saved_state(self, state_dict: Mapping[str, Any]) -> None:
        """Add to the curves held the points of a loaded state that they lack (in the state's layer and metric order
        after theirs) and its superseded blocks; states keyed by another axis add nothing."""
        saved_axis = state_dict.get("facts", {}).get("x_axis", "epoch")
        if saved_axis != self.x_axis:
            return
        for point, step in state_dict.get("steps", {}).items():  # the fit's step of each point the state adds
            self._steps.setdefault(int(point), int(step))
        blocks = [
            {"resumed_at": block["resumed_at"], "history": _epochs_as_int(block["history"])}
            for block in state_dict.get("superseded", [])
        ]
        self._add_points(_epochs_as_int(state_dict["history"]), state_dict["layers"], state_dict["metrics"], blocks)

    def _add_points(
        self, history: History, layers: Sequence[str], metrics: Sequence[str], blocks: Sequence[dict[str, Any]]
    ) -> None:
        """Add to the curves held the points of ``history`` they lack, the ``layers`` and ``metrics`` they lack (after
        theirs, in the given order) and the superseded ``blocks`` they do not hold yet."""
        for point, values in sorted(history.items()):
            self._history.setdefault(point, values)
        self._layers += [layer for layer in layers if layer not in self._layers]
        self._metrics += [metric for metric in metrics if metric not in self._metrics]
        known = {_block_text(block) for block in self._superseded}
        for block in blocks:
            if _block_text(block) not in known:
                known.add(_block_text(block))
                self._superseded.append(block)

    def _scalars(self, stored: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
        return {
            self.key(layer, metric): value for layer, metrics in stored.items() for metric, value in metrics.items()
        }

    def _supersede_rewound(self, trainer: Any, epoch: int, *, resumed_at: bool = False) -> bool:
        """Move the values of the epochs a resumed fit trains again into :attr:`superseded`, and say so; whether the
        history changed.

        Rewound are: loaded epochs from ``epoch`` on, and epochs held before loading or found in the run directory's
        curve file (rank zero) that the loaded state lacks, from its last epoch on. Superseded blocks held before
        loading or found in the curve file that the loaded state lacks (those of an earlier resume) are kept too.

        With ``resumed_at``, ``epoch`` is where the resumed fit starts measuring again (:meth:`start_epoch`), and the
        epochs found between the loaded state's last one and ``epoch`` are not rewound but taken into the history:
        measured after the checkpoint was saved, of the weights it holds (a ``ModelCheckpoint(every_n_train_steps=...)``
        saves at the end of a batch, before the validation that follows measures the same weights), they are never
        measured again, and would otherwise be lost.
        """
        loaded_last = max((e for e in self._history if e != self.initial_point), default=None)
        cut = epoch if loaded_last is None or resumed_at else min(epoch, loaded_last + 1)
        rewound = {e: self._history.pop(e) for e in [e for e in self._history if e >= epoch]}
        self._retire_tail()  # the history changes here: the curve file is rewritten at its next write
        found, found_blocks = self._found_elsewhere(trainer)
        after_loaded = self.initial_point if loaded_last is None else loaded_last
        kept: History = {}
        for earlier in found:
            rewound.update({e: v for e, v in earlier.items() if e >= cut and e not in rewound})
            if resumed_at:
                kept.update({e: v for e, v in earlier.items() if after_loaded < e < epoch and e not in kept})
        for point, values in sorted(kept.items()):
            self.record(point, values)
        known = {_block_text(b) for b in self._superseded}
        for block in (b for blocks in found_blocks for b in blocks):
            if _block_text(block) not in known:
                known.add(_block_text(block))
                self._superseded.append(block)
        self._before_loading, self._superseded_before_loading = {}, []
        if not rewound:
            return bool(kept)
        self._superseded.append({"resumed_at": epoch, "history": dict(sorted(rewound.items()))})
        if trainer.is_global_zero:
            self._warn_superseded(trainer, epoch, rewound)
        return True

    def _warn_superseded(self, trainer: Any, epoch: int, rewound: History) -> None:
        # ``epoch`` is where measuring restarts, not the checkpoint's epoch or step.
        one = len(rewound) == 1
        which = f"{self.x_axis} {epoch_ranges(rewound)} is" if one else f"{self.x_axis}s {epoch_ranges(rewound)} are"
        warnings.warn(
            f"LayerCurves({self.namespace!r}): this fit resumed from a checkpoint older than the recorded curves "
            f"and measures again from {self.x_axis} {epoch} on; {which} trained again and {'its' if one else 'their'} "
            f"values are replaced. The previous values are kept under 'superseded' in {self.curve_path(trainer)} and "
            "in checkpoints.",
            UserWarning,
            stacklevel=4,
        )

    def _found_elsewhere(self, trainer: Any) -> tuple[list[History], list[list[dict[str, Any]]]]:
        """The histories and superseded blocks held before loading and, on rank zero, in the run's curve file."""
        found, found_blocks = [self._before_loading], [self._superseded_before_loading]
        if trainer.is_global_zero:
            try:
                content = read_curve_file(self.curve_path(trainer))
                found.append(content["history"])
                found_blocks.append(content["superseded"])
            except (OSError, ValueError, KeyError):  # no file, or not one this module wrote: nothing to keep
                pass
        return found, found_blocks

    def curve_path(self, trainer: Any) -> Path:
        """``<run dir>/rank_curves/<namespace>_curves.json``, the curve file."""
        return self.figure_dir(trainer) / f"{self.namespace}_curves.json"

    def _write_curve_file(self, trainer: Any, point: int | None = None, *, compact: bool = False) -> None:
        """Write the curve file: append ``point``'s values to the file it names under ``"appended"``
        (:func:`append_curve_point`), a cost that does not grow with the history; or rewrite it whole (the history
        with every point), when there is no such file yet in this process, the history changed otherwise (a resume),
        the curve file was changed by another, as many points were appended as it holds (so that the rewrites cost
        O(1) per point on average), or at ``compact`` (:meth:`finish`: one JSON file again). A file that cannot be
        written (a full disk, a read-only folder) is a warning, once per path and error, and the fit goes on: the
        history stays in memory and in checkpoints. A debug run (``fast_dev_run``) writes none
        (:func:`~rank_lightning.files.writes_files`)."""
        if not writes_files(trainer):
            return
        path = self.curve_path(trainer)
        if not self.claim(path, "curves"):
            return
        try:
            if not compact and point is not None and self._append_point(path, point):
                return
            self._retire_tail()
            if not self._looked_for_appended:  # a resumed run's file, its points read into the history by now
                self._looked_for_appended = True
                self._retired.extend(p for p in [_appended_path(path)] if p is not None)
            fresh = None if compact else _CurveTail(path, len(self._history), self._facts)
            write_curve_file(
                path,
                self.namespace,
                self._layers,
                self._metrics,
                self._history,
                facts=self._facts,
                superseded=self._superseded,
                appended=None if fresh is None else fresh.name,
            )
            self._run_files.wrote(path)
            if fresh is not None:
                fresh.stamp = file_stamp(path)
                self._tail = fresh
            for retired in self._retired:  # their points are in the file just written (not those of another folder's)
                if retired.parent == path.parent and retired.name.startswith(f".{path.name}."):
                    with contextlib.suppress(OSError):
                        retired.unlink(missing_ok=True)
            self._retired = []
        except OSError as error:
            self._retire_tail()  # a point not written (or cut short): the next write rewrites the file whole
            if (str(path), repr(error)) not in self._unwritten:
                self._unwritten.add((str(path), repr(error)))
                kept = "the curves are kept in memory, in checkpoints and in the loggers"
                warnings.warn(f"LayerCurves: {unwritten_warning(path, error, kept)}", RuntimeWarning, stacklevel=3)

    def _append_point(self, path: Path, point: int) -> bool:
        """Append ``point``'s values to the file the curve file ``path`` names, when it may be: whether it was.

        Raises:
            OSError: the file could not be written.
        """
        tail = self._tail
        if tail is None or tail.appended >= tail.base_points or file_stamp(path) != tail.stamp:
            return False
        append_curve_point(tail.path, point, self._history[point], self._facts if self._facts != tail.facts else None)
        tail.appended += 1
        tail.facts = dict(self._facts)
        return True

    def _retire_tail(self) -> None:
        """Append no more to the current file of appended points: the next write rewrites the curve file whole."""
        if self._tail is not None:
            self._retired.append(self._tail.path)
            self._tail = None

    def _value(self, epoch: int, layer: str, metric: str) -> float:
        return self._history[epoch].get(layer, {}).get(metric, math.nan)

    def _log_wandb_charts(self, trainer: Any) -> None:
        loggers = wandb_loggers(trainer)
        if not loggers:
            return
        import wandb

        self._charted_epochs = self.epochs

        # A chart is a table of one row per line and point, which W&B truncates past wandb.Table.MAX_ROWS rows,
        # cutting the last lines short or off: past it, fewer points (or epoch lines) are sent, evenly spaced, first
        # and last kept. The scalars and the curve file keep every point.
        fits = max(wandb.Table.MAX_ROWS // max(len(self._layers), 1), 2)
        epochs = evenly_spaced(self.epochs, fits)
        depth_epochs = evenly_spaced(self.epochs, min(self.max_depth_curves, fits))
        payload: dict[str, Any] = {}
        for metric in self._metrics:
            payload[f"{self.namespace}_curves/{metric}_vs_{self.x_axis}"] = wandb.plot.line_series(
                xs=epochs,
                ys=[[self._value(e, layer, metric) for e in epochs] for layer in self._layers],
                keys=self._layers,
                title=f"{self.namespace} {metric} vs {self.x_axis}",
                xname=self.x_axis,
            )
            payload[f"{self.namespace}_curves/{metric}_vs_depth"] = wandb.plot.line_series(
                xs=list(range(len(self._layers))),
                ys=[[self._value(e, layer, metric) for layer in self._layers] for e in depth_epochs],
                keys=[epoch_label(e) if self.x_axis == "epoch" else f"step {e}" for e in depth_epochs],
                title=f"{self.namespace} {metric} vs depth",
                xname="depth index",
            )
        if not self._wandb_layer_table_logged:
            payload[f"{self.namespace}_curves/layers"] = wandb.Table(
                columns=["depth index", "layer"], data=[[i, layer] for i, layer in enumerate(self._layers)]
            )
            self._wandb_layer_table_logged = True
        step = self.logger_step(trainer) if _fitting(trainer) else trainer.global_step  # beside the scalars
        for logger in loggers:
            logger.log_metrics(payload, step=step)
