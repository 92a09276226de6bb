"""What every rank callback shares: when it runs (:class:`Cadence`), how it speaks, and, for the monitors that log
per-layer curves, the curves themselves (:class:`CurveMonitor`).

A monitor subclass only says *what* it measures; the base decides *when*, keeps the history in checkpoints, and draws
the figures at the end of fit.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import pytorch_lightning as pl
from pytorch_lightning.utilities import rank_zero_info
from typing_extensions import override

from rank_lightning.callbacks.curves import LayerCurves
from rank_lightning.validation import check_positive_int

__all__ = ["Cadence", "CurveMonitor", "RankCallback", "first_val_loader", "trainer_fn"]


def trainer_fn(trainer: pl.Trainer) -> str | None:
    """What the trainer is running: ``"fit"``, ``"validate"``, ``"test"``, ``"predict"`` or ``None``."""
    fn = getattr(trainer.state, "fn", None)
    if fn is None:
        return None
    return str(getattr(fn, "value", fn))


def first_val_loader(trainer: pl.Trainer) -> Any:
    """The trainer's first validation dataloader, or ``None`` when there is none."""
    loaders = trainer.val_dataloaders
    if isinstance(loaders, (list, tuple)):
        return loaders[0] if loaders else None
    return loaders


@dataclass(frozen=True)
class Cadence:
    """When a measurement is due: the one rule every rank callback follows.

    Never during the sanity check. During ``fit``: in every ``every_n_epochs``-th epoch, counting from one
    (``(epoch + 1) % every_n_epochs == 0``); never with ``every_n_epochs=None``. Under ``trainer.validate`` and
    ``trainer.test``: in every run when ``on_validate`` / ``on_test`` says so.

    Attributes:
        every_n_epochs: epochs between measurements during ``fit``; ``None`` for none.
        on_validate: measure in every ``trainer.validate`` run.
        on_test: measure in every ``trainer.test`` run.
    """

    every_n_epochs: int | None = 1
    on_validate: bool = True
    on_test: bool = False

    def __post_init__(self) -> None:
        check_positive_int("every_n_epochs", self.every_n_epochs, allow_none=True)

    def due(self, trainer: pl.Trainer) -> bool:
        """Whether the current epoch (or evaluation run) is to be measured."""
        if trainer.sanity_checking:
            return False
        fn = trainer_fn(trainer)
        if fn == "fit":
            return self.every_n_epochs is not None and (trainer.current_epoch + 1) % self.every_n_epochs == 0
        return (fn == "validate" and self.on_validate) or (fn == "test" and self.on_test)


class RankCallback(pl.Callback):
    """Base of the package's callbacks: messages on rank zero, each warning once.

    Args:
        verbose: print what the callback does at setup and its results (rank zero).
    """

    def __init__(self, *, verbose: bool = True) -> None:
        super().__init__()
        self.verbose = verbose
        self._warned: set[tuple[str, ...]] = set()

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


class CurveMonitor(RankCallback):
    """Base of the monitors that log per-layer curves: cadence, curves, figures, checkpointed history.

    Subclasses measure and call ``self.curves.record_and_log(trainer, pl_module, values)``; the base sends the last
    W&B charts and draws the figures at the end of fit (and of ``trainer.validate`` when it is monitored), and saves
    the history in checkpoints so a resumed run continues its curves.

    Args:
        namespace: first part of every logged key (``"rank"``, ``"weight"``, ``"jacobian"``).
        every_n_epochs: monitor every this many epochs of ``fit`` (:class:`Cadence`).
        on_validate: also monitor ``trainer.validate`` runs.
        figures_every_n_epochs: also draw the figures after every this many monitored epochs; ``None`` draws them
            at the end of fit only.
        log_at_init: also measure once before the first training step of a fresh ``fit``, recorded as epoch ``-1``
            (:meth:`initial_point_due`).
        verbose: print the monitored layers at setup (rank zero).
    """

    def __init__(
        self,
        namespace: str,
        *,
        every_n_epochs: int = 1,
        on_validate: bool = True,
        figures_every_n_epochs: int | None = None,
        log_at_init: bool = False,
        verbose: bool = True,
    ) -> None:
        super().__init__(verbose=verbose)
        check_positive_int("every_n_epochs", every_n_epochs)
        self.every_n_epochs = every_n_epochs
        self.log_at_init = log_at_init
        self.cadence = Cadence(every_n_epochs, on_validate=on_validate)
        self.curves = LayerCurves(namespace, figures_every_n_epochs=figures_every_n_epochs)

    def due(self, trainer: pl.Trainer) -> bool:
        """Whether this epoch (or evaluation run) is monitored (:meth:`Cadence.due`)."""
        return self.cadence.due(trainer)

    def initial_point_due(self, trainer: pl.Trainer) -> bool:
        """Whether to measure the untrained model now: ``log_at_init``, a ``fit`` before its first optimizer step
        (not one resumed from a checkpoint), and no initial point recorded yet."""
        return (
            self.log_at_init
            and trainer_fn(trainer) == "fit"
            and trainer.global_step == 0
            and -1 not in self.curves.epochs
        )

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Unmeasured epochs must not show the previous measurement to EarlyStopping and ModelCheckpoint.
        self.curves.clear_stale_metrics(trainer)

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer_fn(trainer) == "validate" and self.cadence.on_validate:
            self.curves.finish(trainer)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.curves.finish(trainer)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"curves": self.curves.state_dict()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.curves.load_state_dict(state_dict["curves"])
