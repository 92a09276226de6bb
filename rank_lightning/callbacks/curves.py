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
   whole history, rewritten at every recorded epoch so that runs without a CSV logger can be reported on; read back
   by :func:`read_curve_file`) and, when :meth:`LayerCurves.write_figures` is called (by :meth:`LayerCurves.finish`,
   which the owning callback calls in ``on_fit_end``; also after every ``figures_every_n_epochs``-th recorded epoch
   when set), one PNG figure per metric, ``{namespace}_{metric}.png`` (characters other than letters, digits and
   ``_.=-`` become ``_``; :func:`~rank_lightning.plotting.layer_curves_figure`): the metric against epoch, one line
   per layer, beside the metric against depth, one line per epoch (at most ``max_depth_curves`` epochs).

Figures are drawn synchronously, once at the end of fit by default: a figure takes matplotlib 0.1-0.3 s, and nothing
is left running after ``fit`` returns.

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
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from rank_lightning.plotting import evenly_spaced, figure_filename, layer_curves_figure, save_figure
from rank_lightning.validation import check_positive_int

__all__ = ["FIGURE_DIR", "LayerCurves", "read_curve_file", "run_directory", "wandb_loggers", "write_curve_file"]

FIGURE_DIR = "rank_curves"
"""Name of the folder inside the run directory that receives figures and curve files."""


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


def write_curve_file(path: Path, namespace: str, layers: list[str], metrics: list[str], history: Mapping) -> None:
    """Write curves as JSON: ``{"namespace", "layers", "metrics", "history": {epoch: {layer: {metric: value}}}}``.

    NaN and Inf are written as JSON's ``NaN`` / ``Infinity`` literals, which :func:`read_curve_file` reads back.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    content = {"namespace": namespace, "layers": layers, "metrics": metrics}
    content["history"] = {str(epoch): history[epoch] for epoch in sorted(history)}
    path.write_text(json.dumps(content))


def read_curve_file(path: str | Path) -> dict[str, Any]:
    """Read what :func:`write_curve_file` wrote; epochs come back as ``int``.

    Returns:
        ``{"namespace": str, "layers": [...], "metrics": [...], "history": {epoch: {layer: {metric: value}}}}``.
    """
    content = json.loads(Path(path).read_text())
    content["history"] = {int(epoch): layers for epoch, layers in content["history"].items()}
    return content


class LayerCurves:
    """History, logging, W&B charts and figures of per-layer metrics for one namespace.

    Args:
        namespace: first part of every key, e.g. ``"rank"`` for activations or ``"weight"`` for weights.
        figures_every_n_epochs: also redraw the PNG figures after every this many recorded epochs; ``None`` draws
            them only when :meth:`write_figures` is called (by :meth:`finish`, at the end of fit).
        wandb_charts: log the line-series charts to W&B when a ``WandbLogger`` is attached.
        wandb_charts_every_n_epochs: send the charts after every this many recorded epochs (and after the first, and
            at :meth:`finish`).
        max_depth_curves: at most this many epochs (evenly spaced, first and last included) are drawn in the
            metric-vs-depth figures and charts.

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
    ) -> None:
        _check_name("namespace", namespace)
        check_positive_int("figures_every_n_epochs", figures_every_n_epochs, allow_none=True)
        check_positive_int("wandb_charts_every_n_epochs", wandb_charts_every_n_epochs)
        if isinstance(max_depth_curves, bool) or not isinstance(max_depth_curves, int) or max_depth_curves < 2:
            raise ValueError(f"max_depth_curves must be an integer >= 2, got {max_depth_curves!r}")
        self.namespace = namespace
        self.figures_every_n_epochs = figures_every_n_epochs
        self.wandb_charts = wandb_charts
        self.wandb_charts_every_n_epochs = wandb_charts_every_n_epochs
        self.max_depth_curves = max_depth_curves
        self._history: dict[int, dict[str, dict[str, float]]] = {}
        self._layers: list[str] = []
        self._metrics: list[str] = []
        self._wandb_layer_table_logged = False
        self._charted_epochs: list[int] | None = None

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
        if self.figures_every_n_epochs is not None and recorded % self.figures_every_n_epochs == 0:
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

        Args:
            trainer: the Trainer, used to find the run directory and the rank.

        Returns:
            Paths of the files (empty on other ranks or before anything was recorded).
        """
        if not trainer.is_global_zero or not self._history:
            return []
        directory = self.figure_dir(trainer)
        paths = []
        for metric in self._metrics:
            try:
                figure = layer_curves_figure(
                    self.namespace, metric, self._layers, self._history, max_depth_curves=self.max_depth_curves
                )
                paths.append(save_figure(figure, directory / f"{figure_filename(self.namespace, metric)}.png"))
            except Exception as error:  # a figure must never take the run down; the curve file keeps the data
                warnings.warn(
                    f"LayerCurves: drawing {self.namespace!r} {metric!r} failed ({error!r}); the curves are in "
                    f"{self.namespace}_curves.json and python -m rank_lightning.analysis.report can draw them",
                    RuntimeWarning,
                    stacklevel=2,
                )
        return paths

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
        path = self.figure_dir(trainer) / f"{self.namespace}_curves.json"
        write_curve_file(path, self.namespace, self._layers, self._metrics, self._history)

    def _value(self, epoch: int, layer: str, metric: str) -> float:
        return self._history[epoch].get(layer, {}).get(metric, math.nan)

    def _depth_epochs(self) -> list[int]:
        return evenly_spaced(self.epochs, self.max_depth_curves)

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
