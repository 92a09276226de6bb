"""Per-layer metric curves shared by the rank callbacks: log them, remember them, chart them, draw them.

A rank callback computes, once per epoch, a value per layer and per metric. :class:`LayerCurves` does everything that
follows with those numbers, identically for every callback:

1. logs each value as the scalar ``"{namespace}/{layer}/{metric}"`` through ``pl_module.log(on_epoch=True,
   sync_dist=False)``: the values are already equal on every DDP rank, so every rank logs them and
   ``ModelCheckpoint`` / ``EarlyStopping`` can monitor them;
2. keeps the history ``epoch -> layer -> metric -> value`` and saves it in checkpoints through
   :meth:`LayerCurves.state_dict` / :meth:`LayerCurves.load_state_dict`, so a resumed run continues its curves;
3. when a ``WandbLogger`` (of ``pytorch_lightning`` or ``lightning.pytorch``) is attached, logs on rank zero two
   line-series charts per metric: ``"{namespace}_curves/{metric}_vs_epoch"`` (one line per layer) and
   ``"{namespace}_curves/{metric}_vs_depth"`` (x is the layer's depth index, one line per epoch, at most
   ``max_depth_curves`` epochs), plus once the table ``"{namespace}_curves/layers"`` mapping depth index to layer.
   Each chart carries the whole history, so they are sent after the first recorded epoch, after every
   ``wandb_charts_every_n_epochs``-th, and by :meth:`LayerCurves.finish` at the end of fit (not after every epoch,
   which would upload a quadratically growing amount); the scalars themselves go to W&B every epoch;
4. writes, on rank zero, into ``<run dir>/rank_curves/``: ``{namespace}_curves.json`` (layers in depth order and the
   whole history, rewritten at every epoch so that runs without a CSV logger can be reported on) and, when
   :meth:`LayerCurves.write_figures` is called (by :meth:`LayerCurves.finish`, which the owning callback calls in
   ``on_fit_end``; every epoch with ``figures_every_epoch=True``), one PNG figure per metric,
   ``{namespace}_{metric}.png`` (characters other than letters, digits and ``_.=-`` become ``_``), with two panels:
   the metric against epoch, one line per layer, and the metric against depth, one line per epoch (at most
   ``max_depth_curves`` epochs).

Drawing a figure takes matplotlib 0.1-0.3 s, a few seconds for all metrics of a network: by default
(``background_figures=True``) the figures are drawn from a copy of the history on a background thread, so that neither
the training loop nor the return of ``Trainer.fit`` waits for them. The thread is not a daemon: the interpreter
finishes it before exiting. :func:`wait_for_figures` blocks until every figure being drawn is written (for code that
reads the PNG files right after ``fit``).

The run directory (:func:`run_directory`) is the folder that holds Lightning's ``checkpoints/``: the first logger's
``log_dir`` (CSV, TensorBoard), ``<save_dir>/<project>/<run id>`` for W&B, ``trainer.default_root_dir`` without a
logger; it is resolved without collectives, so rank zero alone may ask.

Usage inside a callback::

    class MyMonitor(pl.Callback):
        def __init__(self) -> None:
            self.curves = LayerCurves("mine")

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

import json
import math
import re
import threading
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from matplotlib import colormaps
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

__all__ = ["FIGURE_DIR", "LayerCurves", "run_directory", "wait_for_figures", "wandb_loggers"]

FIGURE_DIR = "rank_curves"
"""Name of the folder inside the run directory that receives figures and curve files."""

_UNSAFE_FILENAME = re.compile(r"[^A-Za-z0-9_.=-]+")
# matplotlib is not thread-safe: figures of all instances are drawn one at a time.
_DRAW_LOCK = threading.Lock()
_THREADS_LOCK = threading.Lock()
_FIGURE_THREADS: set[threading.Thread] = set()


def wait_for_figures(timeout: float | None = None) -> bool:
    """Block until every figure being drawn in the background has been written.

    Args:
        timeout: give up after this many seconds in all; ``None`` waits as long as it takes.

    Returns:
        Whether no drawing is left running.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    with _THREADS_LOCK:
        threads = list(_FIGURE_THREADS)
    for thread in threads:
        thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
    with _THREADS_LOCK:
        return not any(thread.is_alive() for thread in _FIGURE_THREADS)


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


def _to_float(value: Any) -> float:
    if isinstance(value, torch.Tensor):
        return float(value.detach().to("cpu", torch.float64))
    return float(value)


def _check_name(kind: str, name: str) -> None:
    if not isinstance(name, str) or not name or "/" in name:
        raise ValueError(f"{kind} must be a non-empty string without '/', got {name!r}")


def _evenly_spaced(items: list[int], count: int) -> list[int]:
    if len(items) <= count:
        return items
    picks = {round(i * (len(items) - 1) / (count - 1)) for i in range(count)}
    return [items[i] for i in sorted(picks)]


class LayerCurves:
    """History, logging, W&B charts and figures of per-layer metrics for one namespace.

    Args:
        namespace: first part of every key, e.g. ``"rank"`` for activations or ``"weight"`` for weights.
        figures_every_epoch: also rewrite the PNG figures after every recorded epoch (by default only when
            :meth:`write_figures` is called, normally at the end of fit).
        background_figures: draw the figures on a background thread (see the module docstring); ``False`` draws
            them before :meth:`write_figures` returns.
        wandb_charts: log the line-series charts to W&B when a ``WandbLogger`` is attached.
        wandb_charts_every_n_epochs: send the charts after every this many recorded epochs (and after the first, and
            at :meth:`finish`).
        max_depth_curves: at most this many epochs (evenly spaced, first and last included) are drawn in the
            metric-vs-depth figures and charts.

    Raises:
        ValueError: a namespace containing ``"/"`` or a ``max_depth_curves`` below 2.
    """

    def __init__(
        self,
        namespace: str,
        *,
        figures_every_epoch: bool = False,
        background_figures: bool = True,
        wandb_charts: bool = True,
        wandb_charts_every_n_epochs: int = 5,
        max_depth_curves: int = 8,
    ) -> None:
        _check_name("namespace", namespace)
        if (
            isinstance(wandb_charts_every_n_epochs, bool)
            or not isinstance(wandb_charts_every_n_epochs, int)
            or wandb_charts_every_n_epochs < 1
        ):
            raise ValueError(
                f"wandb_charts_every_n_epochs must be a positive integer, got {wandb_charts_every_n_epochs!r}"
            )
        if isinstance(max_depth_curves, bool) or not isinstance(max_depth_curves, int) or max_depth_curves < 2:
            raise ValueError(f"max_depth_curves must be an integer >= 2, got {max_depth_curves!r}")
        self.namespace = namespace
        self.figures_every_epoch = figures_every_epoch
        self.background_figures = background_figures
        self.wandb_charts = wandb_charts
        self.wandb_charts_every_n_epochs = wandb_charts_every_n_epochs
        self.max_depth_curves = max_depth_curves
        self._history: dict[int, dict[str, dict[str, float]]] = {}
        self._layers: list[str] = []
        self._metrics: list[str] = []
        self._wandb_layer_table_logged = False
        self._charted_epochs: list[int] | None = None
        self._figure_thread: threading.Thread | None = None

    @property
    def layers(self) -> list[str]:
        """Every layer recorded so far, in depth order (the order of the first epoch that named it)."""
        return list(self._layers)

    @property
    def metrics(self) -> list[str]:
        """Every metric recorded so far, in first-seen order."""
        return list(self._metrics)

    @property
    def epochs(self) -> list[int]:
        """Recorded epochs, ascending."""
        return sorted(self._history)

    @property
    def history(self) -> dict[int, dict[str, dict[str, float]]]:
        """A copy of the history ``epoch -> layer -> metric -> value``."""
        return {epoch: {layer: dict(m) for layer, m in layers.items()} for epoch, layers in self._history.items()}

    def key(self, layer: str, metric: str) -> str:
        """The logged scalar key ``"{namespace}/{layer}/{metric}"``."""
        return f"{self.namespace}/{layer}/{metric}"

    def curve(self, layer: str, metric: str) -> tuple[list[int], list[float]]:
        """Epochs and values of one layer's metric (epochs where it is missing are left out)."""
        epochs = [e for e in self.epochs if metric in self._history[e].get(layer, {})]
        return epochs, [self._history[e][layer][metric] for e in epochs]

    def record(self, epoch: int, values: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, float]]:
        """Store one epoch's values (replacing what that epoch held) without logging anything.

        Args:
            epoch: the epoch the values belong to.
            values: ``layer -> metric -> value``, layers ordered by depth; values are numbers or one-element tensors.

        Returns:
            The stored values as floats.
        """
        stored: dict[str, dict[str, float]] = {}
        for layer, metrics in values.items():
            _check_name("layer name", layer)
            stored[layer] = {metric: _to_float(value) for metric, value in metrics.items()}
            if layer not in self._layers:
                self._layers.append(layer)
            for metric in stored[layer]:
                if metric not in self._metrics:
                    self._metrics.append(metric)
        self._history[int(epoch)] = stored
        return stored

    def record_and_log(self, trainer: Any, pl_module: Any, values: Mapping[str, Mapping[str, Any]]) -> None:
        """Record ``values`` at ``trainer.current_epoch`` and log them everywhere (see the module docstring).

        Call it on every rank from an epoch-end hook (``on_validation_epoch_end``, ``on_train_epoch_end``), where
        ``pl_module.log`` accepts epoch-level values. Calls during the sanity check are ignored: Lightning discards
        what is logged there, and an untrained model would leave an epoch in the history that never happened.

        Args:
            trainer: the Trainer (either Lightning package).
            pl_module: the LightningModule being fitted.
            values: ``layer -> metric -> value``, layers ordered by depth.
        """
        if getattr(trainer, "sanity_checking", False):
            return
        stored = self.record(trainer.current_epoch, values)
        scalars = {
            self.key(layer, metric): value for layer, metrics in stored.items() for metric, value in metrics.items()
        }
        if scalars:
            pl_module.log_dict(scalars, on_step=False, on_epoch=True, sync_dist=False)
        if not trainer.is_global_zero:
            return
        self._write_curve_file(trainer)
        recorded = len(self._history)
        if self.wandb_charts and (recorded == 1 or recorded % self.wandb_charts_every_n_epochs == 0):
            self._log_wandb_charts(trainer)
        if self.figures_every_epoch:
            self.write_figures(trainer)

    def finish(self, trainer: Any) -> None:
        """End of fit: send the W&B charts if they miss recorded epochs, and write the figures (rank zero only)."""
        if not trainer.is_global_zero:
            return
        if self.wandb_charts and self._history and self._charted_epochs != self.epochs:
            self._log_wandb_charts(trainer)
        self.write_figures(trainer)

    def figure_dir(self, trainer: Any) -> Path:
        """``<run dir>/rank_curves``, where figures and curve files go."""
        return run_directory(trainer) / FIGURE_DIR

    def write_figures(self, trainer: Any) -> list[Path]:
        """Draw, on rank zero, one PNG per metric: metric vs epoch (line per layer) beside metric vs depth.

        With ``background_figures`` the files are drawn from a copy of the current history on a background thread and
        may not exist yet when this returns (:func:`wait_for_figures`); a drawing still running from an earlier call
        is finished first, so files are never written out of order.

        Args:
            trainer: the Trainer, used to find the run directory and the rank.

        Returns:
            Paths of the files (empty on other ranks or before anything was recorded).
        """
        if not trainer.is_global_zero or not self._history:
            return []
        # Absolute: the working directory may change before a background drawing is done.
        directory = self.figure_dir(trainer).absolute()
        directory.mkdir(parents=True, exist_ok=True)
        paths = {
            metric: directory / (_UNSAFE_FILENAME.sub("_", f"{self.namespace}_{metric}") + ".png")
            for metric in self._metrics
        }
        if not self.background_figures:
            self._draw_all(paths)
            return list(paths.values())
        if self._figure_thread is not None:
            self._figure_thread.join()
        snapshot = LayerCurves(self.namespace, max_depth_curves=self.max_depth_curves)
        snapshot.load_state_dict(self.state_dict())
        thread = threading.Thread(
            target=snapshot._draw_all_or_warn, args=(paths,), name=f"rank-curves-{self.namespace}", daemon=False
        )
        with _THREADS_LOCK:
            _FIGURE_THREADS.add(thread)
        self._figure_thread = thread
        thread.start()
        return list(paths.values())

    def _draw_all(self, paths: Mapping[str, Path]) -> None:
        for metric, path in paths.items():
            with _DRAW_LOCK:
                self._draw(metric).savefig(path, dpi=100)

    def _draw_all_or_warn(self, paths: Mapping[str, Path]) -> None:
        try:
            self._draw_all(paths)
        except Exception as error:  # a figure must never take the run down; the curve file keeps the data
            warnings.warn(
                f"LayerCurves: drawing the {self.namespace!r} figures failed ({error!r}); the curves are in "
                f"{self.namespace}_curves.json and python -m rank_lightning.analysis.report can draw them",
                RuntimeWarning,
                stacklevel=1,
            )
        finally:
            with _THREADS_LOCK:
                _FIGURE_THREADS.discard(threading.current_thread())

    def state_dict(self) -> dict[str, Any]:
        """Namespace, layer order and history, for checkpoints."""
        return {"namespace": self.namespace, "layers": self.layers, "metrics": self.metrics, "history": self.history}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned, so a resumed run continues its curves.

        Raises:
            ValueError: the state belongs to another namespace.
        """
        if state_dict["namespace"] != self.namespace:
            raise ValueError(
                f"cannot load curves of namespace {state_dict['namespace']!r} into namespace {self.namespace!r}"
            )
        self._history = {
            int(epoch): {layer: dict(m) for layer, m in layers.items()}
            for epoch, layers in state_dict["history"].items()
        }
        self._layers = list(state_dict["layers"])
        self._metrics = list(state_dict["metrics"])

    def _write_curve_file(self, trainer: Any) -> None:
        directory = self.figure_dir(trainer)
        directory.mkdir(parents=True, exist_ok=True)
        content = {"namespace": self.namespace, "layers": self._layers, "metrics": self._metrics}
        content["history"] = {str(epoch): self._history[epoch] for epoch in self.epochs}
        # json writes NaN and Infinity literals, which Python's json reads back.
        (directory / f"{self.namespace}_curves.json").write_text(json.dumps(content))

    def _value(self, epoch: int, layer: str, metric: str) -> float:
        return self._history[epoch].get(layer, {}).get(metric, math.nan)

    def _depth_epochs(self) -> list[int]:
        return _evenly_spaced(self.epochs, self.max_depth_curves)

    def _log_wandb_charts(self, trainer: Any) -> None:
        loggers = wandb_loggers(trainer)
        if not loggers:
            return
        import wandb

        self._charted_epochs = self.epochs

        epochs = self.epochs
        depth_epochs = self._depth_epochs()
        payload: dict[str, Any] = {}
        for metric in self._metrics:
            payload[f"{self.namespace}_curves/{metric}_vs_epoch"] = wandb.plot.line_series(
                xs=epochs,
                ys=[[self._value(e, layer, metric) for e in epochs] for layer in self._layers],
                keys=self._layers,
                title=f"{self.namespace} {metric} vs epoch",
                xname="epoch",
            )
            payload[f"{self.namespace}_curves/{metric}_vs_depth"] = wandb.plot.line_series(
                xs=list(range(len(self._layers))),
                ys=[[self._value(e, layer, metric) for layer in self._layers] for e in depth_epochs],
                keys=[f"epoch {e}" for e in depth_epochs],
                title=f"{self.namespace} {metric} vs depth",
                xname="depth index",
            )
        if not self._wandb_layer_table_logged:
            payload[f"{self.namespace}_curves/layers"] = wandb.Table(
                columns=["depth index", "layer"], data=[[i, layer] for i, layer in enumerate(self._layers)]
            )
            self._wandb_layer_table_logged = True
        for logger in loggers:
            logger.log_metrics(payload, step=trainer.global_step)

    def _draw(self, metric: str) -> Figure:
        depth_width = max(7.0, 0.3 * len(self._layers))
        height = 4.8
        figure = Figure(figsize=(7 + depth_width, height))
        # Fixed margins instead of a layout engine, which measures every text twice and doubles the drawing time;
        # the bottom margin leaves room for the rotated layer names (about 0.045 inch per character).
        longest = max((len(layer) for layer in self._layers), default=0)
        bottom = min(0.6, (0.5 + 0.045 * longest) / height)
        figure.subplots_adjust(left=0.06, right=0.98, top=0.88, bottom=bottom, wspace=0.18)
        by_epoch, by_depth = figure.subplots(1, 2, width_ratios=[7, depth_width])
        figure.suptitle(f"{self.namespace}: {metric}")

        colors = colormaps["viridis"]
        count = max(len(self._layers) - 1, 1)
        for depth, layer in enumerate(self._layers):
            epochs, values = self.curve(layer, metric)
            if epochs:
                by_epoch.plot(epochs, values, marker=".", color=colors(depth / count), label=layer)
        by_epoch.set_xlabel("epoch")
        by_epoch.xaxis.set_major_locator(MaxNLocator(integer=True))
        by_epoch.set_ylabel(metric)
        by_epoch.set_title("per layer (dark = shallow, yellow = deep)", fontsize="medium")
        if len(self._layers) <= 16:
            by_epoch.legend(fontsize="x-small", ncol=2)
        by_epoch.grid(alpha=0.3)

        depth_epochs = self._depth_epochs()
        blues = colormaps["Blues"]
        count = max(len(depth_epochs) - 1, 1)
        depth = list(range(len(self._layers)))
        for i, epoch in enumerate(depth_epochs):
            values = [self._value(epoch, layer, metric) for layer in self._layers]
            by_depth.plot(depth, values, marker=".", color=blues(0.3 + 0.7 * i / count), label=f"epoch {epoch}")
        by_depth.set_xticks(depth)
        by_depth.set_xticklabels(self._layers, rotation=90, fontsize="x-small")
        by_depth.set_xlabel("layer (by depth)")
        by_depth.set_title("vs depth (darker = later epoch)", fontsize="medium")
        by_depth.legend(fontsize="x-small")
        by_depth.grid(alpha=0.3)
        return figure
