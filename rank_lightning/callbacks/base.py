"""What every rank callback shares: when it runs (:class:`Cadence`), how it speaks, and, for the monitors that log
per-layer curves, the curves themselves (:class:`CurveMonitor`).

A monitor subclass only says *what* it measures; the base decides *when*, keeps the history in checkpoints, and draws
the figures at the end of fit.
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import pytorch_lightning as pl
import torch
from matplotlib.figure import Figure
from pytorch_lightning.utilities import CombinedLoader, rank_zero_info
from torch import Tensor
from typing_extensions import override

from rank_lightning.callbacks.curves import LayerCurves
from rank_lightning.figure_workers import figure_workers
from rank_lightning.files import replace_file, unwritten_warning
from rank_lightning.plotting import save_figure
from rank_lightning.sampling import combined_parts, own_samples, side_loader
from rank_lightning.validation import check_bool, check_positive_int, count_of

__all__ = [
    "Cadence",
    "CurveMonitor",
    "RankCallback",
    "RowQuota",
    "at_last_batch",
    "first_val_loader",
    "fresh_fit",
    "gather_rows",
    "loader_list",
    "repeating_steps",
    "trainer_fn",
    "tuner_checkpoint",
    "val_loaders",
    "validations_per_epoch",
]


def trainer_fn(trainer: pl.Trainer) -> str | None:
    """What the trainer is running: ``"fit"``, ``"validate"``, ``"test"``, ``"predict"`` or ``None``."""
    fn = getattr(trainer.state, "fn", None)
    if fn is None:
        return None
    return str(getattr(fn, "value", fn))


def loader_list(loaders: Any) -> list[Any]:
    """The trainer's evaluation loaders (``trainer.val_dataloaders``, ``test_dataloaders``) as a list, in the order of
    their ``dataloader_idx``: Lightning gives one loader bare, several in the collection they were given in (a list,
    tuple or dict, possibly nested), which it flattens in that order, and none as ``None``."""
    if loaders is None:
        return []
    if isinstance(loaders, Mapping):
        loaders = list(loaders.values())
    if isinstance(loaders, (list, tuple)):
        return [loader for inner in loaders for loader in loader_list(inner)]
    return [loaders]


def step_precision(trainer: pl.Trainer, stage: str) -> AbstractContextManager[Any]:
    """The precision context Lightning runs a ``"train"`` or ``"val"`` step in (``torch.autocast`` under
    ``bf16-mixed`` and ``16-mixed``): an extra pass made in it measures the activations the steps produce."""
    plugin = trainer.strategy.precision_plugin
    return plugin.train_step_context() if stage == "train" else plugin.val_step_context()


def step_inputs(trainer: pl.Trainer, batch: Any) -> Any:
    """``batch`` as Lightning's steps receive it: on the module's device, and converted by the precision plugin
    (``bf16-true`` and ``64-true`` cast floating inputs to the weights' dtype), for an extra forward pass."""
    return trainer.strategy.precision_plugin.convert_input(trainer.strategy.batch_to_device(batch))


def repeated_head_warning(path: str) -> str:
    """The warning of a callback reading a classifier head that runs more than once in one forward pass."""
    return (
        f"the head {path!r} runs more than once per forward pass (a classifier shared by several inputs or views): "
        "only its first call of each batch is measured. Name a head that runs once per forward pass (head=...)."
    )


def repeated_layer_warner(callback: RankCallback) -> Callable[[Any], None]:
    """An ``on_repeat`` of :func:`~rank_lightning.layers.capture_features`: a warning (once) that the callback's layer
    runs more than once per forward pass and that its first call is the one read."""

    def warn(layer: Any) -> None:
        message = (
            f"the layer {layer.path!r} runs more than once per forward pass (a shared module, a second view of the "
            "batch): only its first call of each forward pass is read. Name a layer that runs once per forward pass "
            "(layer=...)."
        )
        callback.warn_once(("repeated layer",), message)

    return warn


def first_call_keeper(callback: RankCallback, path: str, captured: dict[str, Tensor]) -> Callable[[Any, Tensor], None]:
    """A forward-hook handler (:func:`~rank_lightning.layers.forward_hooks`) that keeps, in ``captured[layer.name]``,
    each watched value of the head ``path`` from its first call of a forward pass (clear ``captured`` before each);
    a later call in the same pass is left out, with a warning (:func:`repeated_head_warning`, once)."""

    def keep(layer: Any, value: Tensor) -> None:
        if layer.name in captured:
            callback.warn_once(("repeated head",), repeated_head_warning(path))
        else:
            captured[layer.name] = value

    return keep


def first_val_loader(trainer: pl.Trainer) -> Any:
    """The trainer's first validation dataloader, or ``None`` when there is none, for a callback's own pass: a copy
    where iterating the loader itself would move the state of its persistent workers or of its resumable position
    (:func:`~rank_lightning.sampling.side_loader`)."""
    return side_loader(next(iter(loader_list(trainer.val_dataloaders)), None))


def val_loaders(trainer: pl.Trainer) -> list[Any]:
    """Every validation dataloader of the trainer, in order, each as :func:`first_val_loader` gives the first one (a
    copy where a pass of its own would move the loop's iterator), for a callback's own pass over their pooled rows."""
    return [side_loader(loader) for loader in loader_list(trainer.val_dataloaders)]


def several_training_loaders(trainer: pl.Trainer) -> bool:
    """Whether the trainer's training loaders are several (a list or dict), whose batches Lightning combines."""
    return isinstance(trainer.train_dataloader, (Mapping, list, tuple))


class TrainingBatches:
    """The training batches of the trainer, as its training step receives them, for a callback's own pass.

    One training loader gives its batches. Several (a list or a dict, possibly nested) are combined in the fit's
    ``CombinedLoader`` mode (``"max_size_cycle"``, ``"min_size"``, ``"max_size"``) into the list or dict of per-loader
    batches the step receives; :meth:`parts` gives these per-loader batches. The loaders are
    :func:`~rank_lightning.sampling.side_loader` copies, so the training loop's iterators are left alone.

    Attributes:
        loaders: the training loader, or the collection of them as the trainer holds it (copies).
        combined: whether there are several training loaders, whose batches are combined.
    """

    def __init__(self, trainer: pl.Trainer) -> None:
        self.combined = several_training_loaders(trainer)
        self.loaders = side_loader(trainer.train_dataloader)
        fit_loop = getattr(trainer, "fit_loop", None)
        self.mode = getattr(getattr(fit_loop, "_combined_loader", None), "_mode", "max_size_cycle")

    def __iter__(self) -> Iterator[Any]:
        if not self.combined:
            yield from self.loaders
            return
        for batch, _, _ in CombinedLoader(self.loaders, self.mode):
            yield batch

    def parts(self, batch: Any) -> list[Any]:
        """The per-loader batches of a combined ``batch`` in :func:`loader_list` order, without the loaders a
        ``"max_size"`` batch has none of; ``[batch]`` for one training loader."""
        return combined_parts(self.loaders, batch)


class RowQuota:
    """The rows a process takes in one pass over several loaders in turn, whose rows are pooled: the first ``limit``
    rows in loader order (``None``: all), and of each loader at most its own samples (without the samples that a
    ``DistributedSampler`` repeats at the end of the process's pass over it:
    :func:`~rank_lightning.sampling.own_samples`).

    Iterate :meth:`batches` and report the rows taken from each batch with :meth:`took`.

    Args:
        limit: rows this process takes in all; ``None`` for every row.
        started: whether the pass may stop before reading a batch; by default a process with nothing to take still
            reads one batch (to join the collectives of the others with its empty share).
    """

    def __init__(self, limit: int | None, *, started: bool = False) -> None:
        self.limit = limit
        self.taken = 0
        self._started = started
        self._own: int | None = None
        self._taken_from_loader = 0

    def room(self) -> int | None:
        """The rows that may still be taken from the current loader (``None``: all)."""
        left = [
            bound - taken
            for bound, taken in ((self.limit, self.taken), (self._own, self._taken_from_loader))
            if bound is not None
        ]
        return max(min(left), 0) if left else None

    def enter(self, loader: Any) -> None:
        """Take the next rows from ``loader``, the next loader of the pass (:meth:`batches` calls it; a callback fed
        by batch hooks calls it when ``dataloader_idx`` changes)."""
        self._own, self._taken_from_loader = own_samples(loader), 0

    def took(self, rows: int) -> None:
        """Count ``rows`` taken from the last batch (``0`` for none)."""
        self.taken += rows
        self._taken_from_loader += rows
        self._started = True

    def batches(self, loaders: Sequence[Any]) -> Iterator[tuple[Any, int | None]]:
        """``(batch, room)`` for every batch to read, in loader order: at most ``room`` rows (``None``: all) may be
        taken from the batch's start. A loader is left once its rows are taken, the pass once ``limit`` is reached."""
        self.taken = 0
        for loader in loaders:
            self.enter(loader)
            for batch in loader:
                if self.room() == 0 and self._started:
                    break
                yield batch, self.room()
            if self.limit is not None and self.taken >= self.limit and self._started:
                return


def gather_rows(pl_module: pl.LightningModule, trainer: pl.Trainer, x: Tensor) -> Tensor:
    """The processes' ``x`` concatenated along the first dimension, in process order; their lengths may differ (each
    is padded to the longest for ``all_gather``). A collective under DDP: every process must call it."""
    if trainer.world_size <= 1:
        return x
    count = torch.tensor([x.shape[0]], device=pl_module.device)
    counts = pl_module.all_gather(count).reshape(-1).tolist()
    padded = x.new_zeros((int(max(counts)), *x.shape[1:]))
    padded[: x.shape[0]] = x
    gathered = pl_module.all_gather(padded)
    return torch.cat([gathered[rank, : int(n)] for rank, n in enumerate(counts)])


def at_last_batch(trainer: pl.Trainer) -> bool:
    """Whether the training batch being run is the last of its epoch, as Lightning knows it: a loader of unknown length
    (an ``IterableDataset`` without ``__len__``) is fetched one batch ahead, so that its epoch's last batch is known
    from that batch's start (``on_train_batch_start``) to its end."""
    fit_loop = getattr(trainer, "fit_loop", None)
    progress = getattr(getattr(fit_loop, "epoch_loop", None), "batch_progress", None)
    return getattr(progress, "is_last_batch", False) is True


def _steps_before(batches: int, num_batches: float, accumulate: int, step_on_last: bool) -> int:
    """The optimizer steps taken within the first ``batches`` training batches counted from the start of an epoch,
    over epochs of ``num_batches`` batches (``inf`` when unknown): one after every ``accumulate``-th batch of an
    epoch and, when ``step_on_last``, one after an epoch's last batch that ends a shorter accumulation."""
    if math.isinf(num_batches) or num_batches < 1:
        return batches // accumulate
    per_epoch = int(num_batches)
    epochs, rest = divmod(batches, per_epoch)
    partial = 1 if step_on_last and per_epoch % accumulate else 0
    return epochs * (per_epoch // accumulate + partial) + rest // accumulate


STEP_HISTORY = 256
"""Batches whose optimizer steps :func:`repeating_steps` reads under manual optimization."""


def repeating_steps(history: Sequence[int], evidence: int = 32) -> list[int] | None:
    """The optimizer steps the training batches to come will take under manual optimization, one entry per batch,
    repeating, from the steps ``history`` of the batches seen (oldest first): the shortest pattern of ``p`` batches
    holding a step that the last ``max(2p, evidence)`` batches repeat, so that an optimizer stepped every k-th batch
    gives ``[0, ..., 0, 1]`` in the phase of the batches to come and two optimizers stepped every batch ``[2]``. Where
    a batch within the last ``evidence`` broke every such pattern (a step skipped, an epoch's end), the shortest one
    the last ``2p`` batches repeat; without one (too few batches seen), every batch takes the steps of the last batch
    that took any. ``None`` when no batch took a step (the steps are not known yet)."""
    history = list(history)
    n = len(history)
    last = next((steps for steps in reversed(history) if steps), None)
    if last is None:
        return None
    for needed in (evidence, 0):
        for p in range(1, n // 2 + 1):
            recent = history[n - min(n, max(2 * p, needed)) :]
            if any(recent[-p:]) and recent[p:] == recent[:-p]:
                return recent[-p:]
    return [last]


@dataclass(frozen=True)
class Cadence:
    """When a measurement is due: the one rule every rank callback follows.

    Never during the sanity check. During ``fit``: in every ``every_n_epochs``-th epoch, counting from one
    (``(epoch + 1) % every_n_epochs == 0``); never with ``every_n_epochs=None``. Under ``trainer.validate`` and
    ``trainer.test``: in every run when ``on_validate`` / ``on_test`` says so.

    With ``every_n_train_steps=N`` a measurement is due instead at every N-th optimizer step of ``fit``
    (``trainer.global_step`` reaching a multiple of N), over a window of the last ``window_batches`` training
    batches before that step: :meth:`window_opens` says at which batch to start streaming, :meth:`window_closes`
    when the step is reached. Steps count optimizer steps, so with gradient accumulation over k batches a window of
    W batches covers the last W micro-batches before the step, whichever accumulations they belong to. Lightning
    takes a step after every k-th batch of an epoch and after the epoch's last batch, so when an epoch's batches
    (after ``limit_train_batches``) are not a multiple of k its last step takes fewer; N steps are then fewer than
    N * k batches (:meth:`steps_taken_within`). ``batch_idx``, ``num_training_batches`` and ``global_step`` are equal
    on every DDP process, so every process opens and closes the same windows.

    Attributes:
        every_n_epochs: epochs between measurements during ``fit``; ``None`` for none.
        on_validate: measure in every ``trainer.validate`` run.
        on_test: measure in every ``trainer.test`` run.
        every_n_train_steps: optimizer steps between measurements during ``fit``; ``None`` for the epoch cadence.
        window_batches: training batches streamed per step measurement (at most ``every_n_train_steps`` times the
            batches per optimizer step).
    """

    every_n_epochs: int | None = 1
    on_validate: bool = True
    on_test: bool = False
    every_n_train_steps: int | None = None
    window_batches: int = 1

    def __post_init__(self) -> None:
        check_bool("on_validate", self.on_validate)
        check_bool("on_test", self.on_test)
        check_positive_int("every_n_epochs", self.every_n_epochs, allow_none=True)
        check_positive_int("every_n_train_steps", self.every_n_train_steps, allow_none=True)
        check_positive_int("window_batches", self.window_batches)

    @property
    def by_step(self) -> bool:
        """Whether measurements follow optimizer steps rather than epochs."""
        return self.every_n_train_steps is not None

    def due(self, trainer: pl.Trainer) -> bool:
        """Whether the current epoch (or evaluation run) is to be measured."""
        if trainer.sanity_checking:
            return False
        fn = trainer_fn(trainer)
        if fn == "fit":
            return self.every_n_epochs is not None and (trainer.current_epoch + 1) % self.every_n_epochs == 0
        return (fn == "validate" and self.on_validate) or (fn == "test" and self.on_test)

    def check_window(self, trainer: pl.Trainer, automatic_optimization: bool = True) -> None:
        """Raise when ``window_batches`` exceeds the batches between two step measurements with full
        accumulations: ``every_n_train_steps * accumulate_grad_batches``. (An epoch's shorter last accumulation can
        bring two measurements closer; then the later window opens once the earlier has closed, and streams fewer
        batches.) Nothing is checked under manual optimization, where the module steps its optimizers itself (every
        k-th batch, or several per batch), so that the batches between two measurements are known only once seen: a
        longer window is cut to them, with a warning.

        Raises:
            ValueError: naming both numbers and ``accumulate_grad_batches``.
        """
        if not self.by_step or not automatic_optimization:
            return
        accumulate = max(int(getattr(trainer, "accumulate_grad_batches", 1) or 1), 1)
        period = self.every_n_train_steps * accumulate
        if self.window_batches > period:
            batches = count_of(period, "training batch", "training batches")
            raise ValueError(
                f"window_batches={self.window_batches} exceeds the {batches} between two "
                f"measurements (every_n_train_steps={self.every_n_train_steps} x accumulate_grad_batches="
                f"{accumulate}); choose window_batches <= {period}"
            )

    def next_step(self, trainer: pl.Trainer) -> int:
        """The optimizer step of the next step measurement: the next multiple of ``every_n_train_steps``."""
        n = self.every_n_train_steps or 1
        return (trainer.global_step // n + 1) * n

    def window_opens(
        self, trainer: pl.Trainer, batch_idx: int, steps_per_batch: int | Sequence[int] | None = None
    ) -> bool:
        """Whether training batch ``batch_idx`` is among the last ``window_batches`` before :meth:`next_step`: whether
        the optimizer steps taken within the ``window_batches`` batches from it on reach that step
        (``steps_per_batch``: see :meth:`steps_taken_within`)."""
        if not self.by_step or trainer.sanity_checking or trainer_fn(trainer) != "fit":
            return False
        steps_needed = self.next_step(trainer) - trainer.global_step
        return self.steps_taken_within(trainer, batch_idx, self.window_batches, steps_per_batch) >= steps_needed

    @staticmethod
    def steps_taken_within(
        trainer: pl.Trainer, batch_idx: int, count: int, steps_per_batch: int | Sequence[int] | None = None
    ) -> int:
        """The optimizer steps Lightning takes within the ``count`` training batches from ``batch_idx`` (of the current
        epoch) on, continuing into the next epochs: each right after the batch that ends its accumulation.

        As Lightning's training epoch loop decides (``_should_accumulate``): a step after every
        ``accumulate_grad_batches``-th batch of an epoch, and after the epoch's last batch (the
        ``num_training_batches``-th) unless the strategy accumulates gradients itself. With
        ``num_training_batches`` unknown (``inf``, a loader of an ``IterableDataset`` without ``__len__``) the epoch's
        end is known only at its last batch, which Lightning fetches one batch ahead (:func:`at_last_batch`): until
        then every step is taken as full; from ``batch_idx``, that last batch, on, the epoch is taken to end there.
        Under manual optimization ``trainer.global_step`` counts every ``optimizer.step()`` the module calls (two per
        batch for a module with two optimizers, none in a batch that accumulates gradients): there ``steps_per_batch``
        gives the steps of each batch from ``batch_idx`` on, repeating (:func:`repeating_steps`; an int for every
        batch alike).
        """
        if isinstance(steps_per_batch, int):
            steps_per_batch = [steps_per_batch]
        if steps_per_batch is not None:
            rounds, rest = divmod(count, len(steps_per_batch))
            return rounds * sum(steps_per_batch) + sum(steps_per_batch[:rest])
        accumulate = max(int(getattr(trainer, "accumulate_grad_batches", 1) or 1), 1)
        num_batches = float(getattr(trainer, "num_training_batches", math.inf))
        if math.isinf(num_batches) and at_last_batch(trainer):
            # The step of the shorter accumulation that ends an epoch of unknown length: a window of the steps after
            # full accumulations only would never open for it, and its measurement would be lost.
            num_batches = batch_idx + 1
        step_on_last = not getattr(getattr(trainer, "strategy", None), "handles_gradient_accumulation", False)
        before_window = _steps_before(batch_idx, num_batches, accumulate, step_on_last)
        return _steps_before(batch_idx + count, num_batches, accumulate, step_on_last) - before_window

    @staticmethod
    def window_closes(trainer: pl.Trainer, target_step: int) -> bool:
        """Whether the optimizer step a window measures for has been taken."""
        return trainer.global_step >= target_step


def validations_per_epoch(trainer: pl.Trainer) -> float:
    """How many validation runs a training epoch of ``trainer.fit`` holds (``inf`` for an epoch of unknown length that
    validates every ``val_check_interval`` batches; ``1`` when validation runs at epoch ends or not at all), from
    what Lightning sets up when training starts (``val_check_batch``, ``num_training_batches``).

    With ``check_val_every_n_epoch=None`` Lightning counts the ``val_check_interval`` batches across epochs, so an
    epoch of ``n`` batches with an interval ``k`` that does not divide it holds up to ``(n + k - gcd(n, k)) // k``
    validation runs (``n=6``, ``k=4``: one in the first epoch, two in the second), not ``n // k``."""
    every = getattr(trainer, "val_check_batch", None)
    batches = getattr(trainer, "num_training_batches", None)
    if not getattr(trainer, "enable_validation", False) or not isinstance(every, (int, float)) or math.isinf(every):
        return 1.0
    if not isinstance(batches, (int, float)) or every <= 0:
        return 1.0
    if math.isinf(batches):
        return math.inf
    n, k = int(batches), int(every)
    if getattr(trainer, "check_val_every_n_epoch", 1) is None and n > 0 and k == every:
        return float(max(1, (n + k - math.gcd(n, k)) // k))
    return float(max(1, n // k))


_TUNER_CHECKPOINT = re.compile(r"\.(lr_find|scale_batch_size)_[0-9a-f]{8}-([0-9a-f]{4}-){3}[0-9a-f]{12}\.ckpt")


def tuner_checkpoint(path: Any) -> bool:
    """Whether ``path`` is the checkpoint that Lightning's learning-rate or batch-size finder (``Tuner.lr_find``,
    ``Tuner.scale_batch_size`` and their callbacks, in either Lightning package) saves before its trial fits and
    restores after them: ``.lr_find_<uuid>.ckpt`` or ``.scale_batch_size_<uuid>.ckpt``, deleted once restored. The
    trials run without the user's callbacks, so what it holds of them is what they hold still; its path stays in
    ``trainer.ckpt_path`` until the next run restores (or not) a checkpoint of its own."""
    return bool(path) and _TUNER_CHECKPOINT.fullmatch(Path(str(path)).name) is not None


def fresh_fit(trainer: pl.Trainer, stage: str) -> bool:
    """Whether ``stage`` starts a fresh ``fit``: no optimizer step taken and no checkpoint to resume (a callback whose
    history holds an earlier fit's points then starts a new one). The checkpoint a tuner restored after its trials
    (:func:`tuner_checkpoint`) is none to resume."""
    ckpt_path = getattr(trainer, "ckpt_path", None)
    return (
        str(getattr(stage, "value", stage)) == "fit"
        and getattr(trainer, "global_step", 0) == 0
        and (not ckpt_path or tuner_checkpoint(ckpt_path))
    )


def builds_layers_later(pl_module: Any) -> bool:
    """Whether ``pl_module`` overrides ``configure_model``, where Lightning's sharded strategies have the layers built
    after the callbacks' ``setup`` (either Lightning package)."""
    for cls in type(pl_module).__mro__:
        if cls.__name__ == "LightningModule" and cls.__module__.startswith(("pytorch_lightning.", "lightning.")):
            return getattr(type(pl_module), "configure_model", None) is not getattr(cls, "configure_model", None)
    return False


try:
    # lightning.pytorch's own copy of the Callback class, when the ``lightning`` package is installed: its trainer
    # runs the package's callbacks as it runs its own, but a lightning.pytorch LightningCLI takes in
    # ``trainer.callbacks`` only subclasses of its Callback, and would refuse every callback of the package named in
    # a config.
    from lightning.pytorch import Callback as _LightningCallback

    _CALLBACK_BASES: tuple[type, ...] = (pl.Callback, _LightningCallback)
except ImportError:
    _CALLBACK_BASES = (pl.Callback,)


class RankCallback(*_CALLBACK_BASES):
    """Base of the package's callbacks: messages on rank zero, each warning once.

    Args:
        verbose: print what the callback does at setup and its results (rank zero).
    """

    def __init__(self, *, verbose: bool = True) -> None:
        super().__init__()
        self.verbose = check_bool("verbose", verbose)
        self._warned: set[tuple[str, ...]] = set()
        self._stage_to_prepare: str | None = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """:meth:`prepare` for ``stage``; for a module that builds its layers in ``configure_model`` (Lightning's way
        for sharded models, called after the callbacks' ``setup``), when the stage starts instead (``on_fit_start``,
        ``on_validation_start``, ``on_test_start``, ``on_predict_start``), where the layers exist."""
        if builds_layers_later(pl_module):
            self._stage_to_prepare = str(getattr(stage, "value", stage))
            return
        self.prepare(trainer, pl_module, stage)

    def prepare(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Check the settings against the module and the trainer, and choose the layers (nothing by default)."""

    def _prepare_if_waiting(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        stage, self._stage_to_prepare = self._stage_to_prepare, None
        if stage is not None:
            self.prepare(trainer, pl_module, stage)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._prepare_if_waiting(trainer, pl_module)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._prepare_if_waiting(trainer, pl_module)

    @override
    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._prepare_if_waiting(trainer, pl_module)

    @override
    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._prepare_if_waiting(trainer, pl_module)

    def tuner_restores(self, trainer: pl.Trainer, checkpoint: dict[str, Any]) -> bool:
        """Whether ``checkpoint``, being loaded, is the one a tuner restores after its trial fits
        (:func:`tuner_checkpoint`); then this callback's state is taken out of it (from ``on_load_checkpoint``, before
        Lightning hands it to ``load_state_dict``): the state this callback holds still, as the trials ran without it,
        whose loading would make the fit that follows a resumed one (a rewind to look for, the files of an earlier run
        in the run directory taken for its own and overwritten)."""
        if not tuner_checkpoint(getattr(trainer, "ckpt_path", None)):
            return False
        states = checkpoint.get("callbacks")
        if isinstance(states, dict):
            states.pop(self.state_key, None)
        return True

    def warn_pooled_loaders(self, count: int, kind: str, pooled: str) -> None:
        """Say once that the ``count`` validation (or test: ``kind``) dataloaders are measured together, not per loader;
        ``pooled`` says what their rows make."""
        if count <= 1:
            return
        run = "trainer.test" if kind == "test" else "trainer.validate"
        message = (
            f"{count} {kind} dataloaders: {pooled}, not measured per loader; {run} returns these values with the "
            f"results of every loader. To measure one data set, give the Trainer that loader alone, or run {run} "
            "once per loader."
        )
        self.warn_once(("pooled loaders", kind), message)

    def warn_without_validation(self, trainer: pl.Trainer, consequence: str) -> None:
        """Warn once, for a callback that measures in validation runs, when ``limit_val_batches=0`` turns validation
        off: ``"limit_val_batches=0: this fit runs no validation, so <consequence>"``."""
        limit = getattr(trainer, "limit_val_batches", None)
        if isinstance(limit, (int, float)) and not isinstance(limit, bool) and limit == 0:
            message = f"limit_val_batches={limit!r}: this fit runs no validation, so {consequence}"
            self.warn_once(("no validation",), message)

    def info(self, message: str) -> None:
        """Print ``"<ClassName>: <message>"`` on rank zero when ``verbose``."""
        if self.verbose:
            rank_zero_info(f"{type(self).__name__}: {message}")

    def warn_once(self, key: tuple[str, ...], message: str, category: type[Warning] = UserWarning) -> None:
        """Warn ``"<ClassName>: <message>"`` the first time ``key`` is seen (on every process that sees it)."""
        if key in self._warned:
            return
        self._warned.add(key)
        warnings.warn(f"{type(self).__name__}: {message}", category, stacklevel=3)

    def write_file(self, path: Path, write: Callable[[IO[bytes]], object], kept: str) -> bool:
        """Write ``path`` in one step (:func:`~rank_lightning.files.replace_file`); whether it was written. One that
        cannot be (a full disk, a read-only folder) is a warning naming the path, the error and where the values are
        ``kept`` (once per path and error), never the end of the fit; the earlier file stays whole."""
        try:
            replace_file(path, write)
        except OSError as error:
            self.warn_once(("unwritten", str(path), repr(error)), unwritten_warning(path, error, kept), RuntimeWarning)
            return False
        return True

    def draw_file(self, path: Path, draw: Callable[[], Figure], kept: str) -> Path | None:
        """Draw the figure ``draw`` returns into ``path`` (:func:`~rank_lightning.plotting.save_figure`); ``None``,
        with a warning naming the path, the error and where the values are ``kept``, when drawing or writing fails."""
        try:
            return save_figure(draw(), path)
        except Exception as error:  # a figure must never take the run down
            self.warn_once(("unwritten", str(path), repr(error)), unwritten_warning(path, error, kept), RuntimeWarning)
            return None


class CurveMonitor(RankCallback):
    """Base of the monitors that log per-layer curves: cadence, curves, figures, checkpointed history.

    Subclasses measure and call ``self.curves.record_and_log(trainer, pl_module, values)``; the base sends the last
    W&B charts and draws the figures at the end of fit (and of ``trainer.validate`` when it is monitored), and saves
    the history in checkpoints so a resumed run continues its curves. The processes that help draw the figures are
    started at the first record, on global rank zero, when the run has enough figures
    (:func:`~rank_lightning.figure_workers.start_figure_workers`).

    Args:
        namespace: first part of every logged key (``"rank"``, ``"weight"``, ``"jacobian"``).
        every_n_epochs: monitor every this many epochs of ``fit`` (:class:`Cadence`); ``None`` is ``1`` without
            ``every_n_train_steps``. Setting both is an error.
        every_n_train_steps: monitor every this many optimizer steps of ``fit`` instead (:class:`Cadence`); the curves
            are then keyed by step.
        window_batches: training batches per step measurement (monitors that stream batches).
        on_validate: also monitor ``trainer.validate`` runs.
        on_test: also monitor ``trainer.test`` runs (monitors that measure data).
        figures_every_n_epochs: also draw the figures after every this many monitored epochs; ``None`` draws them
            at the end of fit only.
        log_at_init: also measure once before the first training step of a fresh ``fit``, recorded as epoch ``-1``
            (:meth:`initial_point_due`).
        verbose: print the monitored layers at setup (rank zero).
    """

    # The optimizer step of the fit's first step measurement (step cadence), set when training starts.
    _first_step_due: int | None = None

    def __init__(
        self,
        namespace: str,
        *,
        every_n_epochs: int | None = None,
        every_n_train_steps: int | None = None,
        window_batches: int = 1,
        on_validate: bool = True,
        on_test: bool = False,
        figures_every_n_epochs: int | None = None,
        log_at_init: bool = False,
        verbose: bool = True,
    ) -> None:
        super().__init__(verbose=verbose)
        check_positive_int("every_n_epochs", every_n_epochs, allow_none=True)
        check_positive_int("every_n_train_steps", every_n_train_steps, allow_none=True)
        check_bool("log_at_init", log_at_init)
        if every_n_epochs is not None and every_n_train_steps is not None:
            raise ValueError(
                f"every_n_epochs={every_n_epochs} and every_n_train_steps={every_n_train_steps} are both set; choose "
                "one cadence: epochs (measured on the stage's epoch) or optimizer steps (measured on training batches)"
            )
        if every_n_train_steps is None and window_batches != 1:
            raise ValueError(
                f"window_batches={window_batches} sets the training batches of a step measurement, but "
                "every_n_train_steps is not set; set every_n_train_steps=N for the step cadence, or leave "
                "window_batches at 1 (epoch cadence)"
            )
        if every_n_train_steps is None and every_n_epochs is None:
            every_n_epochs = 1
        self.every_n_epochs, self.every_n_train_steps = every_n_epochs, every_n_train_steps
        self.log_at_init = log_at_init
        self.cadence = Cadence(
            every_n_epochs,
            on_validate=on_validate,
            on_test=on_test,
            every_n_train_steps=every_n_train_steps,
            window_batches=window_batches,
        )
        x_axis = "epoch" if every_n_train_steps is None else "step"
        self.curves = LayerCurves(namespace, figures_every_n_epochs=figures_every_n_epochs, x_axis=x_axis)
        self._training_ended = False  # set at on_train_end: what follows is the end of fit, its figures drawn

    def due(self, trainer: pl.Trainer) -> bool:
        """Whether this epoch (or evaluation run) is monitored (:meth:`Cadence.due`)."""
        return self.cadence.due(trainer)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """A fresh ``fit`` (no optimizer step taken, no checkpoint to resume) of a monitor whose curves hold trained
        points of an earlier fit (the same instance given to a second Trainer) starts new curves, with an initial
        point of its own; a ``fit`` that continues (``max_epochs`` raised on the same Trainer) keeps them."""
        fresh = fresh_fit(trainer, stage)
        trained = [point for point in self.curves.epochs if point != self.curves.initial_point]
        if fresh and trained:
            self.curves.restart()
            points = count_of(len(trained), "point")
            self.info(f"a fresh fit: the curves start anew, without the {points} of the earlier fit")
        super().setup(trainer, pl_module, stage)

    def initial_point_due(self, trainer: pl.Trainer) -> bool:
        """Whether to measure the untrained model now: ``log_at_init``, a ``fit`` before its first optimizer step
        (not one resumed from a checkpoint), and no initial point (epoch ``-1`` or step ``0``) recorded yet."""
        return (
            self.log_at_init
            and trainer_fn(trainer) == "fit"
            and trainer.global_step == 0
            and self.curves.initial_point not in self.curves.epochs
        )

    def measures_each_validation(self) -> bool:
        """Whether this monitor measures at the end of every validation run of a ``fit`` (its epoch cadence permitting):
        true for the epoch cadence, which subclasses that measure other data narrow."""
        return not self.cadence.by_step

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Key the curves by optimizer step when validation runs several times per epoch (``val_check_interval``
        below an epoch, as in ``max_steps`` runs of one long epoch): keyed by epoch, each measurement would replace
        the one before it in the curve file and the figures; then settle a resumed fit's rewound epochs
        (:meth:`LayerCurves.settle_resume`). Subclasses call it before their initial point."""
        self._key_curves_by_step(trainer)
        self._check_validation_between_steps(trainer)
        self._first_step_due = self.cadence.next_step(trainer) if self.cadence.by_step else None
        # A resumed fit's rewound epochs, now: an epoch Lightning resumes at the end of a checkpoint's batch starts
        # without on_train_epoch_start.
        self.curves.settle_resume(trainer)

    def _key_curves_by_step(self, trainer: pl.Trainer) -> None:
        per_epoch = validations_per_epoch(trainer)
        if not self.measures_each_validation() or per_epoch <= 1 or self.curves.x_axis == "step":
            return
        interval = getattr(trainer, "val_check_interval", None)
        several = "more than once" if math.isinf(per_epoch) else f"{per_epoch:g} times"
        if any(point != self.curves.initial_point for point in self.curves.epochs):
            # Resumed from a checkpoint whose curves are keyed by epoch. (An untrained model's point alone, which a
            # trainer.validate before the fit records, moves to step 0.)
            message = (
                f"validation runs {several} per training epoch (val_check_interval={interval!r}) but the curves "
                "loaded from the checkpoint are keyed by epoch: in the curve file and the figures each measurement "
                "replaces the one before it in the same epoch (the loggers keep every one, at its step). Start a new "
                "fit to key the curves by step."
            )
            self.warn_once(("several validations per epoch",), message)
            return
        self.curves.key_by_step()
        self.info(
            f"validation runs {several} per training epoch (val_check_interval={interval!r}): the curves are keyed "
            "by optimizer step, not by epoch"
        )

    def _check_validation_between_steps(self, trainer: pl.Trainer) -> None:
        """Warn when, on a step axis, validation runs every k training batches with k below ``accumulate_grad_batches``:
        the validations between two optimizer steps are recorded at the same step, each replacing the one before."""
        every = getattr(trainer, "val_check_batch", None)
        accumulate = max(int(getattr(trainer, "accumulate_grad_batches", 1) or 1), 1)
        if not self.measures_each_validation() or self.curves.x_axis != "step" or not isinstance(every, int):
            return
        if every >= accumulate:
            return
        message = (
            f"validation runs every {every} training batches, fewer than the accumulate_grad_batches={accumulate} "
            "of one optimizer step: the validations between two optimizer steps measure the weights of the same step, "
            "and in the curve file and the figures each replaces the one before it (the loggers keep every one, at "
            f"that step). Validate every multiple of {accumulate} training batches (val_check_interval)."
        )
        self.warn_once(("validation between steps",), message)

    def measures_validation_only(self) -> bool:
        """Whether this monitor measures only in the epochs of a ``fit`` that run validation, so that its
        ``every_n_epochs`` meets ``check_val_every_n_epoch``: :meth:`measures_each_validation` by default; a monitor
        that also measures unvalidated epochs says no."""
        return self.measures_each_validation()

    def _check_validation_cadence(self, trainer: pl.Trainer) -> None:
        """Warn when validation epochs and ``every_n_epochs`` meet less often than ``every_n_epochs`` says. The default,
        ``every_n_epochs=1``, measures every validation, whatever epochs validate: no warning."""
        every, val_every = self.cadence.every_n_epochs, getattr(trainer, "check_val_every_n_epoch", None)
        if not self.measures_validation_only() or not every or every == 1 or not isinstance(val_every, int):
            return
        if every % val_every == 0:
            return
        both = every * val_every // math.gcd(every, val_every)
        message = (
            f"every_n_epochs={every} with check_val_every_n_epoch={val_every}: validation runs in one epoch of "
            f"{val_every} only, so this monitor measures once in {both} epochs; use a multiple of {val_every} for "
            "every_n_epochs."
        )
        self.warn_once(("cadence",), message)

    def _check_validation_runs(self, trainer: pl.Trainer) -> None:
        """Warn when the fit runs no validation (``limit_val_batches=0``, no validation data, or a module without
        ``validation_step``), so that a monitor measuring there never measures."""
        if not self.measures_validation_only():
            return
        advice = "allow some validation batches, or measure the training batches (stage='train') where offered."
        self.warn_without_validation(trainer, f"this monitor measures nothing in it; {advice}")
        if getattr(trainer, "enable_validation", True) is False:
            message = (
                "this fit runs no validation (no validation dataloader, or a module without validation_step), so "
                "this monitor, which measures in validation runs, measures nothing in it; pass validation data to "
                "fit, or measure the training batches (stage='train', or every_n_train_steps) where offered."
            )
            self.warn_once(("no validation",), message)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_fit_start(trainer, pl_module)
        self._check_validation_cadence(trainer)
        self._check_validation_runs(trainer)
        # RANK_LIGHTNING_FIGURE_WORKERS is read now: a bad value is an error when the fit starts, not at its end. The
        # workers themselves are started at the first record (LayerCurves), when the number of figures is known.
        if trainer.is_global_zero:
            figure_workers(0)
        self._training_ended = False

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._training_ended = True
        due = self._first_step_due
        if due is not None and trainer.global_step < due and not getattr(trainer, "fast_dev_run", False):
            message = (
                f"the fit ended at optimizer step {trainer.global_step}, before step {due}, the first it measures at "
                f"(every_n_train_steps={self.cadence.every_n_train_steps}): no step of this fit was measured. Lower "
                "every_n_train_steps, or train for more steps."
            )
            self.warn_once(("no step measured",), message)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # A resumed fit's rewound epochs; unmeasured epochs must not show the previous measurement to EarlyStopping
        # and ModelCheckpoint.
        self.curves.start_epoch(trainer)

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer_fn(trainer) == "validate" and self.cadence.on_validate:
            self.curves.finish(trainer)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.curves.finish(trainer)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """A fit stopped by an exception (Ctrl-C included) still gets the figures of what it recorded; a failure to
        draw them is a warning, never a second exception over the first. A Ctrl-C once training has ended stops the
        drawing of the figures at the end of fit: they are not drawn again (Lightning ignores Ctrl-C from here on, so
        that drawing could not be stopped), with a warning naming the curve file, which holds every value."""
        if trainer_fn(trainer) != "fit" or not trainer.is_global_zero or not self.curves.epochs:
            return
        if isinstance(exception, KeyboardInterrupt) and self._training_ended:
            message = (
                "Ctrl-C at the end of fit stopped the figures: those not written yet are not drawn; the curves are "
                f"in {self.curves.curve_path(trainer)}: python -m rank_lightning.analysis.report draws them"
            )
            self.warn_once(("figures interrupted",), message, RuntimeWarning)
            return
        try:
            self.curves.finish(trainer)
        except Exception as error:  # the run's own exception is the one to see
            self.warn_once(("figures after exception",), f"could not draw the figures of the stopped fit: {error!r}")

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if self.tuner_restores(trainer, checkpoint):
            return
        # trainer.validate(ckpt_path=...) starts at step 0: the checkpoint says which point its weights are.
        self.curves.note_checkpoint(
            checkpoint.get("epoch"), checkpoint.get("global_step"), trainer=trainer, pl_module=pl_module
        )
        self._adopt_saved_state(checkpoint)

    def _adopt_saved_state(self, checkpoint: dict[str, Any]) -> None:
        """Find this monitor's curves in a checkpoint that keyed them otherwise: the key holds settings such as
        ``layers``, which a resumed fit may name differently (the layers the defaults chose, now listed). The state of
        the same class whose curves have this namespace (unique among the monitors of a Trainer) is filed under
        :attr:`state_key`, where Lightning's ``load_state_dict`` looks next."""
        states = checkpoint.get("callbacks")
        if not isinstance(states, dict) or self.state_key in states:
            return
        prefix = type(self).__qualname__
        for key, state in list(states.items()):
            curves = state.get("curves") if isinstance(state, dict) else None
            if (
                isinstance(key, str)
                and (key == prefix or key.startswith(prefix + "{"))
                and isinstance(curves, dict)
                and curves.get("namespace") == self.curves.namespace
            ):
                states[self.state_key] = state
                self.info(f"continuing the curves of namespace {self.curves.namespace!r} saved as {key}")
                return

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"curves": self.curves.state_dict()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.curves.load_state_dict(state_dict["curves"])
