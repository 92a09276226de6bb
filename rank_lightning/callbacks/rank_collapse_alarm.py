"""An alarm that warns, stops the fit or raises when logged rank metrics collapse: :class:`RankCollapseAlarm`."""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import pytorch_lightning as pl
import torch
from pytorch_lightning.utilities import rank_zero_warn
from torch import nn
from typing_extensions import override

from rank_lightning.callbacks.base import RankCallback, trainer_fn, validations_per_epoch
from rank_lightning.callbacks.weight_rank import WeightRankMonitor
from rank_lightning.layers import module_blocks
from rank_lightning.validation import (
    check_bool,
    check_choice,
    check_finite,
    check_names,
    check_non_negative_int,
    check_positive,
)
from rank_lightning.weight_matrices import is_conv1d, is_weight_layer, logged_name, matrices_of, parent_layer

__all__ = ["ACTIONS", "RankCollapseAlarm"]

ACTIONS = ("warn", "stop", "raise")
"""What :class:`RankCollapseAlarm` does when a rule fires."""

# Collapsed keys named in one warning or error; the rest are counted (all are kept in RankCollapseAlarm.alarms).
_NAMED_ALARMS = 3

_WEIGHT_NAMESPACES = ("weight",)


class RankCollapseAlarm(RankCallback):
    """Warn, stop the fit (like ``EarlyStopping``) or raise when chosen rank metrics collapse.

    The alarm reads the values that the monitors logged (``trainer.callback_metrics``) for every key matching one of
    ``keys`` (``fnmatch`` globs over the full key, where ``*`` also crosses ``/``: ``"rank/*/effective_rank"`` matches
    ``rank/layer3/effective_rank`` and ``rank/layer3/channel/effective_rank``), and fires when a value

    * is below ``min_value`` (absolute threshold);
    * is below ``min_width_fraction`` times the layer's width (relative threshold; width below);
    * fell by more than ``max_drop`` (a fraction) since the previous monitored value of the same key;
    * is NaN or infinite (with ``nan_is_collapse``, the default: activations or weights that blew up).

    Each rule is off when its argument is ``None``; at least one must be set. ``min_steps`` is a warm-up: a value
    measured before that optimizer step (the step of a step-cadence measurement, else ``trainer.global_step``) fires
    only when it is NaN or infinite; it is still the previous value that ``max_drop`` compares the next one with.
    The first measurements of a fresh network often fall fast (a language model's token rank can lose a third in its
    first steps) without anything going wrong: set ``min_steps`` past them rather than loosening ``max_drop``. The
    untrained model's point (``log_at_init``) never reaches ``trainer.callback_metrics`` and is not judged.

    The message names the key, the layer (the key's second part), the metric (the rest), the value, the threshold and
    the step or epoch.

    Width of a layer (for ``min_width_fraction``): ``widths`` (``{glob over keys: width}``, the first matching
    pattern wins) when given; otherwise read from the model: the layer is the key's second part, a module path or a
    block name of ``blocks()`` (:func:`~rank_lightning.layers.module_blocks`); ``<layer>@<k>``, the k-th call of a
    layer, has the layer's width. For weight keys (``weight/...``, or ``<namespace>/...`` of a ``WeightRankMonitor``
    of the trainer under another namespace) the width is ``min(rows, columns)`` of the matrix
    that ``WeightRankMonitor`` logs under that name (``out`` and ``in * prod(kernel)``; each ``q_proj`` / ``k_proj`` /
    ``v_proj`` part of a fused projection such as GPT-2's ``c_attn`` on its own), the most its rank can be; for
    activation keys, the output width of the last submodule (in ``named_modules()`` order, the layer included) that
    holds a weight: the ``out_features`` of a Linear or of ``transformers``' ``Conv1D`` (whose weight is stored
    ``(in, out)``), the channels of a conv (the width of the ``channel`` and ``mean`` reductions), the width of a
    block's last linear or norm layer (a GPT-2 block's ``n_embd``). A key whose width is
    not known this way (a ``flatten`` reduction, a layer without weights) gets a warning once and no width rule:
    pass ``widths``. The activation rank is also capped by the number of samples measured, so a width-relative
    threshold fires spuriously when fewer samples than features are monitored.

    Timing and callback order: values are read at the end of validation (``on_validation_end``, after every
    ``on_validation_epoch_end`` hook has logged, so the order of the callbacks does not matter for monitors that log
    after validation, which is what the package's monitors do) and at the end of every training epoch
    (``on_train_epoch_end``, where callbacks run in list order: put the alarm after a monitor that logs there, e.g.
    ``WeightRankMonitor`` in a fit without validation). Each key is judged once per validation run (every one of a
    fit that validates several times per epoch, ``val_check_interval`` below an epoch, whose messages then name the
    step too) or, in an epoch without validation, once at its end; keys are compared only with their own previous
    value. The keys of monitors with a step cadence (``every_n_train_steps``) are also read
    at the end of every training batch, where a measurement is present for one batch: each one is judged once, at
    its step. Only ``fit`` is watched, never the sanity check. ``"stop"`` sets
    ``trainer.should_stop`` (agreed across DDP processes, which all stop at the same step), and Lightning ends the
    fit where it fired, as with ``EarlyStopping``: at the step of a step measurement or of a validation within an
    epoch, else at the end of the epoch; ``"raise"`` raises a ``RuntimeError`` on every process; ``"warn"`` warns on
    rank zero. A pattern that matched no key during the whole fit gets a warning at the end.

    Args:
        keys: glob patterns of the logged keys to watch.
        min_value: fire when a value is below it.
        min_width_fraction: fire when a value is below this fraction of the layer's width (in ``(0, 1]``).
        max_drop: fire when a value fell by more than this fraction of the previous value (in ``(0, 1]``).
        action: ``"warn"``, ``"stop"`` or ``"raise"``.
        widths: ``{glob over keys: width}``, overriding the widths read from the model.
        nan_is_collapse: fire on NaN and infinite values.
        min_steps: judge the other rules from this optimizer step on (a warm-up; see above).
        verbose: print the widths used (rank zero).

    Attributes:
        alarms: every message so far, in order.
        stopped_epoch: the epoch in which ``"stop"`` fired (``None`` before).

    Raises:
        ValueError: at construction, for no rule, an unknown action, a fraction outside ``(0, 1]``, a non-positive
            width, a negative ``min_steps`` or an empty pattern list.

    Example::

        from rank_lightning.callbacks import ActivationRankMonitor, RankCollapseAlarm

        alarm = RankCollapseAlarm(keys="rank/*/effective_rank", min_width_fraction=0.05, action="stop")
        trainer = pl.Trainer(callbacks=[ActivationRankMonitor(), alarm])

    Logged metrics:
        None; the alarm only reads what the monitors log.
    """

    def __init__(
        self,
        *,
        keys: str | Sequence[str] = ("rank/*/effective_rank",),
        min_value: float | None = None,
        min_width_fraction: float | None = None,
        max_drop: float | None = None,
        action: Literal["warn", "stop", "raise"] = "warn",
        widths: Mapping[str, int] | None = None,
        nan_is_collapse: bool = True,
        min_steps: int = 0,
        verbose: bool = True,
    ) -> None:
        super().__init__(verbose=verbose)
        self.keys = check_names("keys", keys)
        if self.keys is None:
            raise ValueError("keys must name at least one glob pattern of logged keys, got None")
        if min_value is None and min_width_fraction is None and max_drop is None:
            raise ValueError("RankCollapseAlarm needs a rule: set min_value, min_width_fraction or max_drop")
        check_finite("min_value", min_value, allow_none=True)
        for name, fraction in (("min_width_fraction", min_width_fraction), ("max_drop", max_drop)):
            # bool is an int: min_width_fraction=True would be a fraction of 1.
            valid = isinstance(fraction, (int, float)) and not isinstance(fraction, bool) and 0 < fraction <= 1
            if fraction is not None and not valid:
                raise ValueError(f"{name} must be a fraction in (0, 1], got {fraction!r}")
        if widths is not None and not isinstance(widths, Mapping):
            raise ValueError(f"widths must be a mapping {{glob over keys: width}} or None, got {widths!r}")
        for pattern, width in (widths or {}).items():
            check_positive(f"widths[{pattern!r}]", width)
        self.min_value, self.min_width_fraction, self.max_drop = min_value, min_width_fraction, max_drop
        self.action = check_choice("action", action, ACTIONS)
        self.widths = dict(widths or {})
        self.nan_is_collapse = check_bool("nan_is_collapse", nan_is_collapse)
        self.min_steps = check_non_negative_int("min_steps", min_steps)
        self.alarms: list[str] = []
        self.stopped_epoch: int | None = None
        self._previous: dict[str, float] = {}
        self._judged: dict[str, tuple[int, int]] = {}  # key -> (epoch, validation runs by then) last judged
        self._validations = 0
        self._width_of: dict[str, float | None] = {}
        self._matched: set[str] = set()
        self._seen: dict[str, Any] = {}  # the value object last judged per key: one measurement is judged once
        self._weight_namespaces: set[str] = set(_WEIGHT_NAMESPACES)

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._validations += 1  # a fit that validates several times per epoch measures at each of them
        self._check(trainer, pl_module)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # Step-cadence measurements stay in callback_metrics for one batch only: judged here, each once.
        keys = _step_cadence_keys(trainer)
        if keys:
            self._check(trainer, pl_module, only=keys)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._check(trainer, pl_module)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        unmatched = [pattern for pattern in self.keys if pattern not in self._matched]
        if unmatched:
            rank_zero_warn(
                f"RankCollapseAlarm: the patterns {unmatched} matched no logged key during the fit; keys logged at "
                f"the end: {sorted(trainer.callback_metrics)}"
            )

    def watched(self, metrics: Mapping[str, Any]) -> dict[str, float]:
        """The values among ``metrics`` whose key matches one of the patterns, as floats."""
        out = {}
        for key, value in metrics.items():
            patterns = [pattern for pattern in self.keys if fnmatch.fnmatchcase(key, pattern)]
            if patterns:
                self._matched.update(patterns)
                out[key] = float(value.detach().cpu()) if isinstance(value, torch.Tensor) else float(value)
        return out

    def _check(self, trainer: pl.Trainer, pl_module: pl.LightningModule, only: dict[str, int] | None = None) -> None:
        """Judge the watched values (``only`` these keys, each value object once, for step measurements, named with
        the step they were measured at; else each key once per validation run, or per epoch end after none)."""
        if trainer.sanity_checking or trainer_fn(trainer) != "fit":
            return
        epoch, messages, judged = trainer.current_epoch, [], False
        for callback in getattr(trainer, "callbacks", None) or []:
            if isinstance(callback, WeightRankMonitor):  # its keys are weight keys under any namespace
                self._weight_namespaces.add(callback.curves.namespace)
        point = (epoch, self._validations)
        metrics = trainer.callback_metrics
        if only is not None:
            metrics = {key: metrics[key] for key in only if key in metrics}
        for key, value in self.watched(metrics).items():
            current = trainer.callback_metrics.get(key)
            if current is not None and current is self._seen.get(key):
                continue  # this measurement was judged already
            if only is None and self._judged.get(key) == point:
                continue
            self._judged[key], self._seen[key], judged = point, current, True
            step = only[key] if only is not None else trainer.global_step
            warming_up = step < self.min_steps and math.isfinite(value)  # a warm-up judges NaN and inf only
            reason = None if warming_up else self.judge(key, value, pl_module)
            if reason is not None:
                when = f"step {only[key]}" if only is not None else f"epoch {epoch}"
                if only is None and validations_per_epoch(trainer) > 1:
                    when += f", step {trainer.global_step}"  # which of the epoch's validations
                messages.append(f"{self._describe(key, value)} at {when} {reason}")
            if math.isfinite(value):
                self._previous[key] = value
        if only is not None and not judged:
            return  # no measurement at this batch (on any process: they measure at the same steps); no collective
        self._act(trainer, messages)

    def judge(self, key: str, value: float, module: nn.Module | None = None) -> str | None:
        """Why ``value`` of ``key`` is a collapse (a phrase for the message), or ``None``; updates nothing.

        Args:
            key: the logged key.
            value: its value now.
            module: the model, for the width of the layer (``None``: only ``widths``).
        """
        if math.isnan(value):
            return "is NaN" if self.nan_is_collapse else None
        if math.isinf(value) and self.nan_is_collapse:
            return f"is {value}"  # inf or -inf: blew up like a NaN
        if self.min_value is not None and value < self.min_value:
            return f"is below the threshold min_value={self.min_value}"
        if self.min_width_fraction is not None:
            width = self.width(key, module)
            if width is not None and value < self.min_width_fraction * width:
                threshold = self.min_width_fraction * width
                return f"is below {self.min_width_fraction} x width {width:g} = {threshold:g}"
        previous = self._previous.get(key)
        if self.max_drop is not None and previous is not None and previous > 0:
            drop = (previous - value) / previous
            if drop > self.max_drop:
                since = f"since the previous monitored value (max_drop={self.max_drop})"
                return f"fell by {drop:.1%} from {previous:.6g} {since}"
        return None

    def width(self, key: str, module: nn.Module | None = None) -> float | None:
        """The width of the layer of ``key``: from ``widths``, else from ``module`` (see the class docstring)."""
        for pattern, width in self.widths.items():
            if fnmatch.fnmatchcase(key, pattern):
                return float(width)
        if key not in self._width_of:
            found = None if module is None else _width_from_model(key, module, self._weight_namespaces)
            if found is None:
                self.warn_once(("width", key), f"no width known for {key!r}; pass widths={{pattern: width}}")
            else:
                self.info(f"width of {key!r}: {found:g}")
            self._width_of[key] = found
        return self._width_of[key]

    @staticmethod
    def _describe(key: str, value: float) -> str:
        parts = key.split("/")
        layer = parts[1] if len(parts) > 1 else key
        metric = "/".join(parts[2:]) or parts[-1]
        return f"{key} = {value:.6g} (layer {layer!r}, metric {metric!r})"

    def _act(self, trainer: pl.Trainer, messages: list[str]) -> None:
        self.alarms.extend(messages)
        text = "; ".join(messages[:_NAMED_ALARMS])
        if len(messages) > _NAMED_ALARMS:
            # A collapsed 24-layer network gave one warning of 3,000 characters; every message is in `alarms`.
            text += f"; and {len(messages) - _NAMED_ALARMS} more keys (RankCollapseAlarm.alarms lists every one)"
        if self.action == "stop":
            # Every process judged the same values; the reduction keeps the processes in step all the same.
            should_stop = trainer.strategy.reduce_boolean_decision(bool(messages), all=False)
            if should_stop:
                trainer.should_stop = True
                self.stopped_epoch = trainer.current_epoch
                rank_zero_warn(f"RankCollapseAlarm: stopping the fit: {text or 'another process saw a collapse'}")
        elif messages and self.action == "raise":
            raise RuntimeError(f"RankCollapseAlarm: {text}")
        elif messages:
            rank_zero_warn(f"RankCollapseAlarm: {text}")

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"previous": dict(self._previous), "alarms": list(self.alarms), "stopped_epoch": self.stopped_epoch}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._previous = dict(state_dict.get("previous", {}))
        self.alarms = list(state_dict.get("alarms", []))
        self.stopped_epoch = state_dict.get("stopped_epoch")


def _width_from_model(key: str, module: nn.Module, weight_namespaces: set[str]) -> float | None:
    """Width of the layer named by ``key``'s second part (see :class:`RankCollapseAlarm`), or ``None``."""
    parts = key.split("/")
    if len(parts) < 3 or "flatten" in parts[2:-1]:
        return None
    layer, _, call = parts[1].rpartition("@")
    layer = layer if layer and call.isdigit() else parts[1]  # ``<layer>@<k>``: the k-th call of the layer
    if parts[0] in weight_namespaces:
        return _matrix_width(layer, module)
    path = (module_blocks(module) or {}).get(layer, layer)
    try:
        target = module.get_submodule(path)
    except AttributeError:
        return None
    holders = [m for m in target.modules() if isinstance(getattr(m, "weight", None), torch.Tensor)]
    if not holders:
        return None
    last = holders[-1]
    # transformers' Conv1D (GPT-2's projections) stores its weight (in, out).
    return float(last.weight.shape[1] if is_conv1d(last) and last.weight.ndim == 2 else last.weight.shape[0])


def _matrix_width(name: str, module: nn.Module) -> float | None:
    """``min(rows, columns)`` of the weight matrix that a weight monitor logs as ``name`` (a layer, or a part of a fused
    projection such as GPT-2's ``<c_attn>.q_proj``), or ``None`` when ``module`` holds no such matrix."""
    modules = dict(module.named_modules())
    for path, layer in modules.items():
        prefix = logged_name(path)
        if not (name == prefix or name.startswith(prefix + ".")) or not is_weight_layer(layer):
            continue
        try:
            matrices = matrices_of(path, layer, parent=parent_layer(path, modules))
        except ValueError:
            continue
        for matrix in matrices:
            if matrix.name == name:
                rows, columns = matrix.shape(tuple(getattr(matrix.module, matrix.attribute).shape))
                # A grouped conv's matrix is the block-diagonal out x (in * prod(kernel)) one (WeightRankMonitor).
                return float(min(rows, columns * matrix.groups))
    return None


def _step_cadence_keys(trainer: pl.Trainer) -> dict[str, int]:
    """The keys of the trainer's monitors that measure by step (``every_n_train_steps``) and hold a measurement in
    ``callback_metrics`` now, each with the step of that measurement (empty at most batches: cheap to ask)."""
    keys: dict[str, int] = {}
    for callback in getattr(trainer, "callbacks", None) or []:
        cadence, curves = getattr(callback, "cadence", None), getattr(callback, "curves", None)
        if getattr(cadence, "by_step", False) and curves is not None and curves.holds_values and curves.epochs:
            keys.update(dict.fromkeys(curves.logged_keys, curves.epochs[-1]))
    return keys
