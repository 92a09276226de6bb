"""Robustness to the fast gradient sign attacks, measured during validation (Sanyal et al. Sec. 5, Fig. 5)."""

from __future__ import annotations

import json
import math
import weakref
from collections.abc import Callable, Mapping, Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from torch import Tensor
from typing_extensions import override

from rank_lightning.attacks import (
    ATTACKS,
    accuracy_under_attack,
    adversarial_feature_distance,
    attack,
    kurakin_steps,
    l2_dissimilarity,
)
from rank_lightning.attacks.gradient_sign import model_logits
from rank_lightning.callbacks.base import (
    Cadence,
    RankCallback,
    RowQuota,
    fresh_fit,
    loader_list,
    repeated_layer_warner,
    trainer_fn,
    validations_per_epoch,
)
from rank_lightning.callbacks.curves import (
    FIGURE_DIR,
    INITIAL_EPOCH,
    evaluated_point,
    log_rank_equal,
    run_directory,
    wandb_loggers,
)
from rank_lightning.files import RunFiles, writes_files
from rank_lightning.layers import BatchReader, FeatureLayer, capture_features, check_label_rows, feature_layer
from rank_lightning.plotting import adversarial_figure
from rank_lightning.sampling import process_share
from rank_lightning.validation import check_choices, check_positive, check_positive_int, count_of

__all__ = ["AdversarialValidation", "grey_levels"]

DEFAULT_EPS: tuple[float, ...] = (1 / 255, 2 / 255, 4 / 255, 8 / 255, 16 / 255)
_NAMESPACES = {"validate": "adv", "test": "adv_test"}
_INFERENCE_MODE_HELP = (
    "build the Trainer with Trainer(inference_mode=False) (on the command line: --trainer.inference_mode=false)"
)


def grey_levels(eps: float) -> str:
    """A budget in pixel units written in grey levels of an 8-bit image, as in the logged keys: ``8/255 -> "8"``.

    Whole numbers of grey levels are written without decimals; others with four significant digits (``"0.5"``).
    """
    levels = eps * 255
    if abs(levels - round(levels)) < 1e-6:
        return str(round(levels))
    return f"{levels:.4g}"


def _parse_eps(value: float | str) -> float:
    try:
        if isinstance(value, str):
            # "8/255", and "0.5/255" for half a grey level, which Fraction does not read.
            numerator, slash, denominator = value.partition("/")
            eps = float(Fraction(numerator.strip())) / (float(Fraction(denominator.strip())) if slash else 1.0)
        else:
            eps = float(value)
    except (TypeError, ValueError, ZeroDivisionError) as error:
        raise ValueError(f"eps entries must be numbers or fractions such as '8/255'; got {value!r}") from error
    if not (math.isfinite(eps) and 0 <= eps <= 1):
        raise ValueError(
            f"eps must lie in [0, 1] in pixel units (8/255 for 8 grey levels); got {value!r}"
            + (f", did you mean {value}/255?" if math.isfinite(eps) and eps > 1 else "")
        )
    return eps


def _parse_budgets(eps: Sequence[float | str] | float | str) -> tuple[float, ...]:
    """The budgets in pixel units, ascending (the curves are drawn in that order), each given once."""
    values = [_parse_eps(value) for value in ([eps] if isinstance(eps, (str, float, int)) else eps)]
    if not values:
        raise ValueError("eps must name at least one budget, e.g. [1/255, 2/255, 4/255, 8/255, 16/255]")
    labels = [grey_levels(value) for value in values]
    repeated = sorted({label for label in labels if labels.count(label) > 1})
    if repeated:
        raise ValueError(f"eps values {repeated} (grey levels) appear more than once; give each budget once")
    return tuple(sorted(values))


def _check_idle_iterations(attacks: Sequence[str], budgets: Sequence[float], steps: int | None) -> None:
    """Kurakin's default number of iterations is 0 below 0.8 grey levels: the iterative attacks would return the
    clean inputs, and their accuracy, L2 dissimilarity and ``D_Adv`` would read as perfect robustness."""
    iterative = [name for name in attacks if name != "fgsm"]
    idle = [eps for eps in budgets if eps > 0 and kurakin_steps(eps) == 0]
    if steps is None and iterative and idle:
        levels = ", ".join(grey_levels(eps) for eps in idle)
        raise ValueError(
            f"{', '.join(iterative)} would not move the inputs at eps {levels} (grey levels): Kurakin's default number "
            "of iterations, int(min(255 eps + 4, 1.25 * 255 eps)), is 0 below 0.8 grey levels; give steps "
            "(e.g. steps=1) or budgets of at least 0.8/255"
        )


def _check_pixel_stats(mean: Sequence[float] | None, std: Sequence[float] | None) -> None:
    if (mean is None) != (std is None):
        raise ValueError(f"give both mean and std or neither; got mean={mean!r}, std={std!r}")
    if std is not None and any(value <= 0 for value in std):
        raise ValueError(f"std must be positive, got {std!r}")


class AdversarialValidation(RankCallback):
    """Attack a sample of the validation set with FGSM, Iter-FGSM and Iter-LL-FGSM and log what the attacks did.

    Sanyal et al. (Sec. 5.1, Fig. 5) compare models by their misclassification rate under attack against the size of
    the perturbation, measured by the normalised L2 dissimilarity (their eq. 10), and by ``D_Adv``, the mean squared
    displacement of a layer's features (Sec. 5.1.1). This callback measures all three during validation, so that the
    curves can be followed over training and compared between runs (e.g. with and without LR-Layers).

    When (:class:`~rank_lightning.callbacks.base.Cadence`): in the validation of every ``every_n_epochs``-th epoch of
    ``fit`` (``(epoch + 1) % every_n_epochs == 0``, among the epochs that validate; sanity checks are skipped), in
    every ``trainer.validate`` run and, with keys under ``adv_test/``, in every ``trainer.test`` run. The validation
    (test) batches are collected in ``on_validation_batch_end`` (inputs and labels, detached, on the module's device)
    until ``max_samples`` are held by all processes together (process ``r`` of ``W`` keeps at most
    ``max_samples // W``, plus one if ``r < max_samples % W``); the attacks run in ``on_validation_epoch_end``, in
    chunks of ``batch_size``. Several dataloaders are pooled: their samples, in loader order, make one attacked set,
    with a warning (with ``max_samples``, a first loader that holds as many fills it alone). A fit with
    ``limit_val_batches=0`` runs no validation, so nothing is attacked in it: a warning says so when it starts.

    Budgets are in pixel units: the attacks un-normalise the inputs with the per-channel ``mean`` and ``std``,
    perturb pixels in [0, 1] and normalise again (see :mod:`rank_lightning.attacks`). Every forward pass calls
    ``pl_module(inputs)``, which must return logits (a tensor, or a dict or ``ModelOutput`` holding them under
    ``"logits"``); the inputs must be floating point (token ids cannot be attacked: a ``ValueError`` says so). The
    attacks run the model in eval mode and afterwards restore every submodule's train/eval flag, and no parameter's
    ``.grad`` is touched (gradients are taken with respect to the inputs only). The clean and adversarial forward
    passes run in the mode Lightning validates in (eval). Forward hooks that other callbacks still hold see these
    passes: list this callback after those that hook layers during validation
    (:class:`~rank_lightning.callbacks.ActivationRankMonitor` removes its hooks in its own ``on_validation_epoch_end``,
    which then runs first).

    Gradients and inference mode: inside ``fit``, validation runs under ``torch.no_grad``, which the attacks lift with
    ``torch.enable_grad``. ``trainer.validate`` and ``trainer.test`` run under ``torch.inference_mode`` unless the
    Trainer is built with ``inference_mode=False``; no gradient can be taken there, so :meth:`setup` raises a
    ``ValueError`` saying so before any data is loaded. It does so under every backend, although under gloo
    (CPU DDP) Lightning falls back to ``no_grad``: a configuration that runs on CPUs then also runs on GPUs.

    DDP: every process attacks its own samples; sums and counts are all-reduced (``trainer.strategy.reduce``) before
    logging, so every process logs the same values, equal to one process attacking all the samples (up to the
    samples Lightning's ``DistributedSampler`` duplicates to pad the last batch).

    Files: after every evaluation, rank zero writes ``<run dir>/rank_curves/adversarial.png`` (``adversarial_test.png``
    for ``trainer.test``): misclassification rate against mean L2 dissimilarity, one line per attack, points at each
    eps and at the clean inputs (Sanyal et al. Fig. 5), beside ``D_Adv`` against eps; and ``adversarial.json`` with
    the logged values of every evaluation (``{point: {"epoch": e, "step": s, key: value, ...}}``). The run directory
    is that of :func:`~rank_lightning.callbacks.curves.run_directory`.

    Where an evaluation is recorded (the rules of the rank monitors' curves,
    :func:`~rank_lightning.callbacks.curves.evaluated_point`): at its epoch during ``fit``, or at its optimizer step
    when validation runs several times per epoch (``val_check_interval`` below an epoch; keyed by epoch, each
    evaluation would replace the one before it in the same epoch); ``trainer.validate`` / ``trainer.test`` of the
    weights a fit left at the last epoch that fit trained, of a checkpoint at its epoch, of an untrained model at
    epoch ``-1``; one of other weights than the fit evaluated at that epoch (the fit validated inside it and took more
    steps after it) is logged but kept out of the history, with a warning. A fresh ``fit`` (the same instance given to
    a new Trainer) starts a new history.

    Its clean and adversarial passes run in the parameters' own dtype, outside the autocast that a mixed-precision fit
    (``bf16-mixed``, ``16-mixed``) puts around its steps, so their accuracies can differ slightly from the
    validation steps'.

    Args:
        eps: L-infinity budgets in pixel units, numbers or fractions such as ``"8/255"``, each in [0, 1]; ``0``
            gives the clean accuracy.
        attacks: names among ``fgsm``, ``iter_fgsm``, ``iter_ll_fgsm``.
        every_n_epochs: attack in every this many epochs of ``fit``.
        max_samples: inputs attacked per evaluation, all processes together (the first, in loader order); ``None``
            for the whole validation set.
        batch_size: inputs attacked at once.
        layer: layer of ``D_Adv`` (its output is read), in the syntax every callback accepts
            (:func:`~rank_lightning.layers.select_layers`): a block name of ``pl_module.blocks()``, a module name of
            ``named_modules()`` or a glob pattern, matching exactly one module; ``None`` takes the last block (the
            features feeding the head) when the module has ``blocks()``, and skips ``D_Adv`` otherwise.
        alpha: step of the iterative attacks in pixel units (Kurakin et al.: one grey level).
        steps: iterations of the iterative attacks; ``None`` takes ``min(eps + 4, 1.25 eps)`` (eps in grey levels;
            :func:`~rank_lightning.attacks.kurakin_steps`), which is 0 below 0.8 grey levels: such budgets need
            ``steps`` with an iterative attack.
        mean: per-channel mean of the normalisation of the inputs; with ``std``. When both are ``None`` they are read
            from ``trainer.datamodule.mean`` / ``.std``, and without such a datamodule the inputs are taken to be
            pixels in [0, 1] already (give ``mean=[0]``, ``std=[1]`` to say so explicitly).
        std: per-channel standard deviation of that normalisation.
        input_key: where the inputs are in a batch: an index for tuples and lists, a key for mappings; ``None`` for
            ``batch[0]`` or the usual keys of a dict batch (:class:`~rank_lightning.layers.BatchReader`).
        label_key: where the integer labels are in a batch; ``None`` for ``batch[1]`` or the usual keys of a dict.
        label_fn: ``batch -> labels``, overriding ``label_key`` (e.g. the hard labels kept beside mixup's soft targets).
        verbose: report the settings resolved at setup (rank zero, at INFO level).

    Raises:
        ValueError: at construction for an invalid setting (the message lists the valid choices); at setup for a
            ``layer`` that does not exist or names several modules.
        ValueError: at setup of ``trainer.validate`` / ``trainer.test`` in inference mode.
        RuntimeError: whenever the attacks would run under ``torch.inference_mode`` all the same.

    Example::

        import pytorch_lightning as pl
        from rank_lightning.callbacks import AdversarialValidation

        callback = AdversarialValidation(eps=["2/255", "8/255"], attacks=["fgsm", "iter_fgsm"], max_samples=512)
        trainer = pl.Trainer(max_epochs=20, callbacks=[callback])
        trainer.fit(model, datamodule=datamodule)
        # Afterwards, or on a checkpoint: gradients need the Trainer out of inference mode.
        pl.Trainer(inference_mode=False, callbacks=[callback]).validate(model, datamodule=datamodule)

    Logged metrics:
        With ``<eps>`` the budget in grey levels (``eps * 255``: ``acc@8`` for ``eps = 8/255``, ``acc@0.5`` for
        ``0.5/255``), for every ``<attack>`` in ``attacks``, under ``adv/`` (``adv_test/`` in ``trainer.test``):

        * ``adv/num_samples``: number of attacked samples, all processes together.
        * ``adv/clean_acc``: accuracy on the attacked samples before the attack.
        * ``adv/feature_sq_norm``: ``mean ||f_l(x_d)||_2^2`` at ``layer`` over the samples classified correctly, the
          scale against which to read ``D_Adv`` (an LR-Layer's norm constraint changes it); only with a layer.
        * ``adv/<attack>/acc@<eps>``: accuracy under attack, over all attacked samples (one minus the
          misclassification rate of Sanyal et al. Fig. 5).
        * ``adv/<attack>/l2@<eps>``: mean over all attacked samples of ``||x_a - x_d||_2 / ||x_d||_2`` in pixel
          space (Sanyal et al. eq. 10).
        * ``adv/<attack>/d_adv@<eps>``: ``D_Adv = mean ||f_l(x_a) - f_l(x_d)||_2^2`` at ``layer``, over the samples
          classified correctly before the attack (Sanyal et al. Sec. 5.1.1); only when a layer is chosen, ``nan``
          when no sample was classified correctly.

        With a ``WandbLogger``, rank zero also logs the figure as ``adv_curves/figure`` and the table
        ``adv_curves/table`` (one row per attack and eps) at every evaluation (``adv_test_curves/...`` in test).
    """

    def __init__(
        self,
        *,
        eps: Sequence[float | str] = DEFAULT_EPS,
        attacks: Sequence[str] = ATTACKS,
        every_n_epochs: int = 1,
        max_samples: int | None = 512,
        batch_size: int = 256,
        layer: str | None = None,
        alpha: float = 1 / 255,
        steps: int | None = None,
        mean: Sequence[float] | None = None,
        std: Sequence[float] | None = None,
        input_key: int | str | None = None,
        label_key: int | str | None = None,
        label_fn: Callable[[Any], Any] | None = None,
        verbose: bool = True,
    ) -> None:
        super().__init__(verbose=verbose)
        self.eps = _parse_budgets(eps)
        self.attacks = check_choices("attacks", attacks, ATTACKS)
        check_positive_int("every_n_epochs", every_n_epochs)
        check_positive_int("max_samples", max_samples, allow_none=True)
        check_positive_int("batch_size", batch_size)
        check_positive("alpha", alpha)
        check_positive_int("steps", steps, allow_none=True)
        _check_idle_iterations(self.attacks, self.eps, steps)
        _check_pixel_stats(mean, std)
        # One module, not a list: check_names would accept several.
        if layer is not None and (not isinstance(layer, str) or not layer):
            raise ValueError(f"layer must be None or a non-empty block or module name, got {layer!r}")
        self.every_n_epochs = every_n_epochs
        self.cadence = Cadence(every_n_epochs, on_validate=True, on_test=True)
        self.max_samples = max_samples
        self.batch_size = batch_size
        self.layer = layer
        self.alpha, self.steps = alpha, steps
        self.mean = None if mean is None else tuple(float(v) for v in mean)
        self.std = None if std is None else tuple(float(v) for v in std)
        self.reader = BatchReader(input_key, label_key, label_fn)
        self._restart_history()
        self._checkpoint_point: tuple[int, int] | None = None  # (epoch, global_step) of the checkpoint loaded
        self._feature_layer: FeatureLayer | None = None
        self._pixel_stats: tuple[tuple[float, ...], tuple[float, ...]] | None = None
        self._active: str | None = None
        self._loaders: list[Any] = []  # the evaluation's loaders, in dataloader_idx order
        self._quota = RowQuota(0)  # the samples still to collect, of each loader without DistributedSampler repeats
        self._loader_idx: int | None = None  # the loader the quota reads
        self._inputs: list[Tensor] = []
        self._labels: list[Tensor] = []

    @property
    def feature_layer(self) -> FeatureLayer | None:
        """The layer of ``D_Adv`` resolved at setup (``None`` before setup or without one)."""
        return self._feature_layer

    @property
    def pixel_stats(self) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
        """``(mean, std)`` used to un-normalise the inputs, resolved at setup; ``None`` for pixels in [0, 1]."""
        return self._pixel_stats

    # -- setup -----------------------------------------------------------------------------------------------------

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """A fresh ``fit`` (no optimizer step taken, no checkpoint to resume) of a callback whose history holds
        evaluations of an earlier fit's model (the same instance given to a new Trainer) starts a new history, as the
        rank monitors start new curves."""
        fresh = fresh_fit(trainer, stage)
        trained = [point for points in self.history.values() for point in points if point != self._initial_point]
        if fresh and trained:
            self._restart_history()
            evaluations = count_of(len(trained), "evaluation")
            self.info(f"a fresh fit: a new history, without the {evaluations} of the earlier model")
        super().setup(trainer, pl_module, stage)

    def _restart_history(self) -> None:
        self.history: dict[str, dict[int, dict[str, float]]] = {"validate": {}, "test": {}}
        self._when: dict[str, dict[int, dict[str, int]]] = {"validate": {}, "test": {}}  # epoch and step of each point
        self._fit_steps: dict[int, int] = {}  # the optimizer step of each evaluation a fit recorded on an epoch axis
        self.x_axis = "epoch"  # what the history is keyed by: "step" when validation runs several times per epoch
        self._run_files = RunFiles(type(self).__name__)  # an earlier run's JSON in the same folder is kept aside
        # The trainer that recorded the history (its run's); whether the state being loaded (a validate / test of a
        # checkpoint by that trainer) adds to it; the checkpoint such an evaluation loaded, its module and the
        # trainer's step then: what a later evaluation of that module measures until an optimizer step.
        self._recorded_by: weakref.ref[pl.Trainer] | None = None
        self._adds_to_held = False
        self._held_checkpoint: tuple[weakref.ref[Any], tuple[int, int], int] | None = None

    @property
    def _initial_point(self) -> int:
        return INITIAL_EPOCH if self.x_axis == "epoch" else 0

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Key the history by optimizer step when validation runs several times per epoch."""
        per_epoch = validations_per_epoch(trainer)
        if per_epoch <= 1 or self.x_axis == "step":
            return
        interval = getattr(trainer, "val_check_interval", None)
        several = "more than once" if math.isinf(per_epoch) else f"{per_epoch:g} times"
        if any(point != self._initial_point for point in self.history["validate"]):
            self.warn_once(
                ("several validations per epoch",),
                f"validation runs {several} per training epoch (val_check_interval={interval!r}) but the history "
                "loaded from the checkpoint is keyed by epoch: in adversarial.json and the figure each evaluation "
                "replaces the one before it in the same epoch (the loggers keep every one, at its step). Start a new "
                "fit to key it by step.",
            )
            return
        self.x_axis = "step"
        for kept in (self.history["validate"], self._when["validate"]):  # an initial evaluation moves to step 0
            if INITIAL_EPOCH in kept:
                kept[0] = kept.pop(INITIAL_EPOCH)
        self.info(
            f"validation runs {several} per training epoch (val_check_interval={interval!r}): the evaluations are "
            "keyed by optimizer step, not by epoch"
        )

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_fit_start(trainer, pl_module)
        self.warn_without_validation(
            trainer, "no input is attacked in it; allow some validation batches (limit_val_batches > 0)."
        )

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if self.tuner_restores(trainer, checkpoint):
            return
        # trainer.validate(ckpt_path=...) starts at step 0: the checkpoint says which point its weights are.
        epoch, step = checkpoint.get("epoch"), checkpoint.get("global_step")
        self._checkpoint_point = None if epoch is None or step is None else (int(epoch), int(step))
        evaluating = trainer_fn(trainer) in ("validate", "test")
        self._adds_to_held = evaluating and self._recorded_by is not None and self._recorded_by() is trainer
        self._held_checkpoint = None
        if evaluating and self._checkpoint_point is not None:
            self._held_checkpoint = (weakref.ref(pl_module), self._checkpoint_point, int(trainer.global_step))

    @override
    def prepare(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        stage = str(getattr(stage, "value", stage))
        loop = {"validate": "validate_loop", "test": "test_loop"}.get(stage)
        if loop is not None and getattr(getattr(trainer, loop, None), "inference_mode", False):
            # A setting of the Trainer that this callback cannot work with: a ValueError, which the CLI prints as one
            # line.
            raise ValueError(
                f"AdversarialValidation needs input gradients, but trainer.{stage}() runs under "
                f"torch.inference_mode, where none can be taken; {_INFERENCE_MODE_HELP}"
            )
        self._feature_layer = feature_layer(pl_module, self.layer, required=False)
        self._pixel_stats = self._resolve_pixel_stats(trainer)
        layer = self._feature_layer
        where = "not measured" if layer is None else f"at {layer.name!r} ({layer.path})"
        stats = "pixels in [0, 1]" if self._pixel_stats is None else f"mean/std {self._pixel_stats}"
        samples = "all samples" if self.max_samples is None else f"at most {self.max_samples} samples"
        self.info(
            f"{', '.join(self.attacks)} at eps {', '.join(grey_levels(e) for e in self.eps)} (grey levels) "
            f"on {samples}; D_Adv {where}; {stats}"
        )

    def _resolve_pixel_stats(self, trainer: pl.Trainer) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
        if self.mean is not None and self.std is not None:
            return self.mean, self.std
        datamodule = getattr(trainer, "datamodule", None)
        mean, std = getattr(datamodule, "mean", None), getattr(datamodule, "std", None)
        if mean is None or std is None:
            return None
        return tuple(float(v) for v in mean), tuple(float(v) for v in std)

    # -- when ------------------------------------------------------------------------------------------------------

    def _start(self, trainer: pl.Trainer) -> None:
        self._active = None
        if self.cadence.due(trainer):
            self._active = "test" if trainer_fn(trainer) == "test" else "validate"
        self._inputs, self._labels = [], []
        world, rank = max(trainer.world_size, 1), trainer.global_rank
        # The samples a DistributedSampler repeats at the end of a process's pass over a loader are attacked once.
        self._quota, self._loader_idx = RowQuota(process_share(self.max_samples, world, rank)), None
        loaders = loader_list(trainer.test_dataloaders if self._active == "test" else trainer.val_dataloaders)
        self._loaders = loaders
        if self._active is not None:
            kind = "test" if self._active == "test" else "validation"
            pooled = "their samples are pooled into one attacked set (max_samples takes the first in loader order)"
            self.warn_pooled_loaders(len(loaders), kind, pooled)

    def _collect(self, batch: Any, dataloader_idx: int) -> None:
        if self._active is None or dataloader_idx >= len(self._loaders):
            return
        if dataloader_idx != self._loader_idx:  # Lightning evaluates the loaders one after the other
            self._quota.enter(self._loaders[dataloader_idx])
            self._loader_idx = dataloader_idx
        room = self._quota.room()
        if room == 0:
            return
        inputs, labels = self.reader.split(batch)
        check_label_rows(labels, inputs.shape[0], "its inputs")
        take = inputs.shape[0] if room is None else min(inputs.shape[0], room)
        self._inputs.append(inputs[:take].detach().clone())
        self._labels.append(labels[:take].detach().to(inputs.device, copy=True))  # a label_fn may give CPU labels
        self._quota.took(take)

    @override
    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start(trainer)

    @override
    def on_validation_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._collect(batch, dataloader_idx)

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._finish(trainer, pl_module)

    # trainer.test() is measured exactly like validation, under the keys of its own stage.
    on_test_epoch_start = on_validation_epoch_start
    on_test_batch_end = on_validation_batch_end
    on_test_epoch_end = on_validation_epoch_end

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "history": {stage: dict(epochs) for stage, epochs in self.history.items()},
            "when": {stage: dict(points) for stage, points in self._when.items()},
            "x_axis": self.x_axis,
            "fit_steps": dict(self._fit_steps),
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the history; that of a checkpoint a ``validate`` / ``test`` of the trainer that recorded the history
        held loads only adds the points it lacks (keyed by the same axis): an older checkpoint's takes none away."""
        adds, self._adds_to_held = self._adds_to_held, False
        if adds and any(self.history.values()):
            if state_dict.get("x_axis", "epoch") == self.x_axis:
                for stage, epochs in state_dict["history"].items():
                    for epoch, values in epochs.items():
                        self.history.setdefault(stage, {}).setdefault(int(epoch), dict(values))
                for stage, points in state_dict.get("when", {}).items():
                    for point, when in points.items():
                        self._when.setdefault(stage, {}).setdefault(int(point), dict(when))
            return
        for stage, epochs in state_dict["history"].items():
            self.history[stage] = {int(epoch): dict(values) for epoch, values in epochs.items()}
        for stage, points in state_dict.get("when", {}).items():
            self._when[stage] = {int(point): dict(when) for point, when in points.items()}
        self.x_axis = state_dict.get("x_axis", "epoch")  # checkpoints of earlier versions are keyed by epoch
        self._fit_steps = {int(point): int(step) for point, step in state_dict.get("fit_steps", {}).items()}
        self._run_files.continues = True  # the JSON files found are this run's

    # -- what ------------------------------------------------------------------------------------------------------

    def _finish(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        stage, self._active = self._active, None
        if stage is None:
            return
        inputs = torch.cat(self._inputs) if self._inputs else None
        labels = torch.cat(self._labels) if self._labels else None
        self._inputs, self._labels = [], []
        if torch.is_inference_mode_enabled() or (inputs is not None and inputs.is_inference()):
            raise RuntimeError(
                "AdversarialValidation needs input gradients, but this evaluation runs under torch.inference_mode, "
                f"where none can be taken; {_INFERENCE_MODE_HELP}"
            )
        totals = self._attack_sums(pl_module, inputs, labels)
        totals = trainer.strategy.reduce(totals, reduce_op="sum")
        values = self._values(totals.tolist())
        if values is None:
            return
        # Every process holds the reduced values already: logging them unsynchronised lets every process monitor them.
        log_rank_equal(pl_module, self._namespaced(stage, values))
        at = trainer.global_step if self.x_axis == "step" else trainer.current_epoch
        held = None
        if self._held_checkpoint is not None:  # an earlier evaluation's checkpoint, still the module's weights
            module, loaded, step = self._held_checkpoint
            held = loaded if module() is pl_module and int(trainer.global_step) == step else None
        point = evaluated_point(trainer, at, self.x_axis, self._checkpoint_point, held)
        if trainer_fn(trainer) == "fit":
            if self.x_axis == "epoch":
                self._fit_steps[point] = int(trainer.global_step)
        elif stage == "validate" and self._holds_other_weights(trainer, point, held):
            return
        self._recorded_by = weakref.ref(trainer)
        self.history[stage][point] = values
        self._when[stage][point] = {"epoch": int(trainer.current_epoch), "step": int(trainer.global_step)}
        if trainer.is_global_zero and writes_files(trainer):  # none in a debug run (fast_dev_run)
            self._write(trainer, stage)

    def _holds_other_weights(self, trainer: pl.Trainer, point: int, held: tuple[int, int] | None) -> bool:
        """Whether a ``trainer.validate`` would replace, at the epoch ``point``, the fit's evaluation of other weights
        (the fit validated inside that epoch and took more optimizer steps after it): its values are then logged (and
        returned) but kept out of the history, with a warning. ``held``: the checkpoint an earlier evaluation loaded
        into the module, whose weights it still holds."""
        recorded = self._fit_steps.get(point)
        if self.x_axis != "epoch" or recorded is None or point not in self.history["validate"]:
            return False
        loaded = self._checkpoint_point if getattr(trainer, "ckpt_path", None) else held
        now = loaded[1] if loaded is not None and loaded[1] > 0 else int(trainer.global_step)
        if now == recorded:
            return False
        message = (
            f"this evaluation attacks the weights of optimizer step {now}, but epoch {point}, where the history (keyed "
            f"by epoch) puts it, holds the fit's evaluation at step {recorded}: its values are logged (and returned "
            "by trainer.validate) but kept out of adversarial.json and the figure, which keep the fit's."
        )
        self.warn_once(("other weights", str(point), str(now)), message)
        return True

    def _attack_sums(self, pl_module: pl.LightningModule, inputs: Tensor | None, labels: Tensor | None) -> Tensor:
        """Sums of this process, float64: ``[n, correct, ||f(x_d)||^2 of the correct ones, then per attack and eps:
        correct, L2 dissimilarity, ||f(x_a) - f(x_d)||^2 of the samples correct before the attack]``."""
        sums = torch.zeros(3 + 3 * len(self.attacks) * len(self.eps), dtype=torch.float64, device=pl_module.device)
        if inputs is None or labels is None:
            return sums
        mean, std = self._pixel_stats if self._pixel_stats is not None else (None, None)
        for start in range(0, inputs.shape[0], self.batch_size):
            x, y = inputs[start : start + self.batch_size], labels[start : start + self.batch_size]
            clean_logits, clean_features = self._forward(pl_module, x)
            correct = clean_logits.argmax(dim=1) == y
            sums[0] += y.numel()
            sums[1] += accuracy_under_attack(clean_logits, y).double() * y.numel()
            if clean_features is not None:
                sums[2] += clean_features[correct].flatten(1).double().square().sum()
            index = 3
            for name in self.attacks:
                for eps in self.eps:
                    adversarial = attack(
                        name, pl_module, x, y, eps, alpha=self.alpha, steps=self.steps, mean=mean, std=std
                    )
                    logits, features = self._forward(pl_module, adversarial)
                    sums[index] += accuracy_under_attack(logits, y).double() * y.numel()
                    sums[index + 1] += l2_dissimilarity(adversarial, x, mean=mean, std=std).double().sum()
                    if features is not None:
                        sums[index + 2] += adversarial_feature_distance(
                            features, clean_features, correct, reduction="sum"
                        ).double()
                    index += 3
        return sums

    def _forward(self, pl_module: pl.LightningModule, x: Tensor) -> tuple[Tensor, Tensor | None]:
        layers = [] if self._feature_layer is None else [self._feature_layer]
        with torch.no_grad(), capture_features(pl_module, layers, on_repeat=repeated_layer_warner(self)) as captured:
            logits = model_logits(pl_module(x))
        return logits, (captured[layers[0].name] if layers else None)

    def _values(self, totals: list[float]) -> dict[str, float] | None:
        count, correct = totals[0], totals[1]
        if count == 0:
            return None
        # The correct count is a sum of float accuracies times batch sizes: round it back to the integer it is.
        correct = round(correct)
        values = {"num_samples": count, "clean_acc": correct / count}
        if self._feature_layer is not None:
            values["feature_sq_norm"] = totals[2] / correct if correct else math.nan
        index = 3
        for name in self.attacks:
            for eps in self.eps:
                level = grey_levels(eps)
                values[f"{name}/acc@{level}"] = round(totals[index]) / count
                values[f"{name}/l2@{level}"] = totals[index + 1] / count
                if self._feature_layer is not None:
                    values[f"{name}/d_adv@{level}"] = totals[index + 2] / correct if correct else math.nan
                index += 3
        return values

    def _namespaced(self, stage: str, values: Mapping[str, float]) -> dict[str, float]:
        return {f"{_NAMESPACES[stage]}/{key}": value for key, value in values.items()}

    # -- files and W&B ---------------------------------------------------------------------------------------------

    def _write(self, trainer: pl.Trainer, stage: str) -> None:
        """The stage's history as JSON and the last evaluation's figure, each replaced in one step; one that cannot be
        written or drawn is a warning naming it (the values are in the loggers and in checkpoints). A JSON file of
        another run there is kept as ``<stem>-v<n>.json`` (its figure as ``<stem>-v<n>.png``,
        :class:`~rank_lightning.files.RunFiles`)."""
        directory = run_directory(trainer) / FIGURE_DIR
        stem = "adversarial" if stage == "validate" else "adversarial_test"
        history = self.history[stage]
        when = self._when[stage]
        text = json.dumps(
            {
                str(point): {**when.get(point, {}), **self._namespaced(stage, values)}
                for point, values in sorted(history.items())
            }
        )
        kept = "the values are in the loggers and in checkpoints"
        path = directory / f"{stem}.json"
        if self._run_files.claim(path, "adversarial evaluations") and self.write_file(
            path, lambda file: file.write(text.encode()), kept
        ):
            self._run_files.wrote(path)
        point = max(history)
        last = history[point]
        if self.x_axis == "step" or point == INITIAL_EPOCH:  # an untrained (or externally trained) model: step 0
            title = f"{_NAMESPACES[stage]}, step {when.get(point, {}).get('step', max(point, 0))}"
        else:
            title = f"{_NAMESPACES[stage]}, epoch {point}"
        figure_path = None
        if self._run_files.claim(directory / f"{stem}.png", "adversarial figures"):  # another run's is kept aside
            figure_path = self.draw_file(
                directory / f"{stem}.png",
                lambda: adversarial_figure(
                    self._curves(last),
                    [float(grey_levels(eps)) for eps in self.eps],
                    last["clean_acc"],
                    title,
                    feature_layer=None if self._feature_layer is None else self._feature_layer.name,
                ),
                kept,
            )
        if figure_path is not None:
            self._run_files.wrote(figure_path)
        loggers = wandb_loggers(trainer)
        if loggers:
            self._log_wandb(loggers, trainer, stage, last, figure_path)

    def _curves(self, values: Mapping[str, float]) -> dict[str, dict[str, list[float]]]:
        """``attack -> {metric: [value per budget]}`` of one evaluation, as :func:`adversarial_figure` draws them."""
        return {
            name: {
                metric: [values.get(f"{name}/{metric}@{grey_levels(eps)}", math.nan) for eps in self.eps]
                for metric in ("acc", "l2", "d_adv")
            }
            for name in self.attacks
        }

    def _log_wandb(
        self,
        loggers: list[Any],
        trainer: pl.Trainer,
        stage: str,
        values: Mapping[str, float],
        figure_path: Path | None,
    ) -> None:
        import wandb

        rows = []
        for name in self.attacks:
            for eps in self.eps:
                level = grey_levels(eps)
                accuracy = values[f"{name}/acc@{level}"]
                distance = values[f"{name}/l2@{level}"]
                rows.append([name, float(level), distance, 1 - accuracy, accuracy, values.get(f"{name}/d_adv@{level}")])
        columns = ["attack", "eps_grey_levels", "l2_dissimilarity", "misclassification", "accuracy", "d_adv"]
        prefix = f"{_NAMESPACES[stage]}_curves"
        payload: dict[str, Any] = {} if figure_path is None else {f"{prefix}/figure": wandb.Image(str(figure_path))}
        payload[f"{prefix}/table"] = wandb.Table(columns=columns, data=rows)
        for logger in loggers:
            logger.log_metrics(payload, step=trainer.global_step)
