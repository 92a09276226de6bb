"""The classification dimension of the final features at the end of fit (Feng et al. eq. 6, Table 2)."""

from __future__ import annotations

import csv
import io
import math
import operator
import warnings
import weakref
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, cast

import pytorch_lightning as pl
import torch
from matplotlib.figure import Figure
from torch import Tensor, nn
from typing_extensions import override

from rank_lightning.callbacks.base import (
    Cadence,
    RankCallback,
    RowQuota,
    first_call_keeper,
    first_val_loader,
    gather_rows,
    step_inputs,
    val_loaders,
)
from rank_lightning.callbacks.curves import log_rank_equal, run_directory, wandb_loggers
from rank_lightning.files import RunFiles, writes_files
from rank_lightning.functional.classification import (
    ClassificationDimension as ClassificationDimensionResult,
)
from rank_lightning.functional.classification import (
    classification_dimension,
    independence_deficit,
    independence_deficit_markdown,
)
from rank_lightning.layers import (
    BatchReader,
    FeatureLayer,
    check_label_rows,
    classifier_head,
    eval_mode,
    forward_batch,
    forward_hooks,
    random_state_kept,
)
from rank_lightning.plotting import classification_dimension_figure
from rank_lightning.sampling import process_share
from rank_lightning.validation import (
    check_bool,
    check_choice,
    check_fraction,
    check_positive,
    check_positive_int,
    check_positive_ints,
)

__all__ = ["CLSDIM_DIR", "ClassificationDimension"]

CLSDIM_DIR = "clsdim"
"""Folder inside the run directory that receives the classification-dimension files."""

_FIT_ON = ("all", "class")
_CENTER = (False, True)
_DEFICIT_COLUMNS = (
    "class",
    "terms",
    "weights",
    "num_terms",
    "r2",
    "relative_residual",
    "accuracy",
    "accuracy_fit",
    "class_accuracy",
    "class_accuracy_fit",
)

Deficit = list[dict[str, Any]]


def _deficit_cells(row: Mapping[str, Any]) -> list[Any]:
    cells = []
    for column in _DEFICIT_COLUMNS:
        value = row[column]
        cells.append(" ".join(str(v) for v in value) if isinstance(value, list) else value)
    return cells


def _mean(values: Sequence[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return sum(finite) / len(finite) if finite else math.nan


def _csv_bytes(rows: Sequence[Sequence[Any]]) -> bytes:
    """``rows`` as the bytes of a CSV file (``csv`` module defaults)."""
    buffer = io.StringIO(newline="")
    csv.writer(buffer).writerows(rows)
    return buffer.getvalue().encode()


def _accuracy_table(result: ClassificationDimensionResult) -> bytes:
    full = result.full_accuracy
    rows: list[list[Any]] = [["k", "accuracy", "relative_accuracy", "eigenvalue"]]
    for k, accuracy in zip(result.ks.tolist(), result.accuracies.tolist()):
        relative = accuracy / full if full > 0 else math.nan
        rows.append([k, repr(accuracy), repr(relative), repr(float(result.eigenvalues[k - 1]))])
    return _csv_bytes(rows)


def _deficit_table(deficit: Deficit) -> bytes:
    return _csv_bytes([list(_DEFICIT_COLUMNS), *(_deficit_cells(row) for row in deficit)])


def _drawable(result: ClassificationDimensionResult) -> bool:
    """Whether the figure can be drawn: its spectrum panel has a log axis, which needs a positive eigenvalue."""
    return result.defined and bool(((result.eigenvalues > 0) & torch.isfinite(result.eigenvalues)).any())


def _figure(result: ClassificationDimensionResult) -> Figure:
    return classification_dimension_figure(
        result.ks.tolist(),
        result.accuracies.tolist(),
        result.eigenvalues.tolist(),
        cls_dim=result.cls_dim,
        ambient_dim=result.ambient_dim,
        full_accuracy=result.full_accuracy,
        threshold=result.threshold,
        centered=result.centered,
    )


def _scalars(
    result: ClassificationDimensionResult, deficit: Deficit | None, num_samples: int, with_deficit: bool
) -> dict[str, float]:
    """The logged numbers; the deficit's are NaN when it was asked for (``with_deficit``) but not computed."""
    if result.defined:
        at_cls_dim = float(result.accuracies[int((result.ks == result.cls_dim).nonzero()[0])])
    else:
        at_cls_dim = math.nan
    scalars = {
        "clsdim/cls_dim": float(result.cls_dim),
        "clsdim/ambient_dim": float(result.ambient_dim),
        "clsdim/full_acc": result.full_accuracy,
        "clsdim/acc_at_cls_dim": at_cls_dim,
        "clsdim/num_samples": float(num_samples),
    }
    if deficit:
        scalars["clsdim/deficit_acc_drop"] = _mean([r["accuracy"] - r["accuracy_fit"] for r in deficit])
        scalars["clsdim/deficit_class_acc_drop"] = _mean(
            [r["class_accuracy"] - r["class_accuracy_fit"] for r in deficit]
        )
        scalars["clsdim/deficit_num_terms"] = _mean([float(r["num_terms"]) for r in deficit])
    elif with_deficit:
        for key in ("deficit_acc_drop", "deficit_class_acc_drop", "deficit_num_terms"):
            scalars[f"clsdim/{key}"] = math.nan
    return scalars


def _class_indices(values: Sequence[int] | None) -> list[int] | None:
    """``deficit_classes`` as a list of class indices; raises unless ``None`` or non-negative integers."""
    if values is None:
        return None
    try:
        selected = [values] if isinstance(values, int) else list(values)
        indices = [operator.index(value) for value in selected if not isinstance(value, bool)]
    except TypeError:
        indices, selected = [], [None]
    if not selected or len(indices) != len(selected) or any(index < 0 for index in indices):
        raise ValueError(f"deficit_classes must be None or non-negative class indices, got {values!r}")
    return indices


class ClassificationDimension(RankCallback):
    """Log the classification dimension of the final features (Feng et al. eq. 6, Table 2) at the end of fit.

    The final features are the input of the model's head, read by a forward pre-hook on it
    (:func:`~rank_lightning.layers.forward_hooks`; the head of the package's modules is ``backbone.<head_path>``; for
    other modules, the ``head`` given or the last ``nn.Linear``), together with the labels of each batch
    (:class:`~rank_lightning.layers.BatchReader`: ``input_key``, ``label_key``, ``label_fn``), on the validation data,
    in eval mode and without gradients (every submodule's training flag is restored afterwards); several validation
    dataloaders are pooled (their samples are evaluated together, in loader order), with a warning. The
    features are projected onto their top-k principal directions and fed to that same head;
    :func:`~rank_lightning.functional.classification_dimension` returns the smallest ``k`` keeping ``threshold``
    (0.95) of the full accuracy. The default projection is Feng et al.'s (their released code and Table 2): linear
    through the origin on uncentred features, ``F Q_k Q_k^T``; ``center=True`` projects through the mean instead.

    With ``independence_deficit=True`` each chosen class's logit is also fitted, by the Lasso, as a sparse combination
    of the other logits (:func:`~rank_lightning.functional.independence_deficit`, Feng et al. eq. 11-12, Fig. 4).
    Feng et al.'s ``eta = 20`` is for ImageNet logits; the penalty is not scale-free, so small models may need a
    smaller one.

    Timing: once at the end of ``fit`` (``on_train_end``), and at the end of every ``trainer.validate`` run
    (:class:`~rank_lightning.callbacks.base.Cadence` with ``every_n_epochs=None``; the validation loop is not changed,
    the features are read in a pass of their own). Under DDP every process reads its share of the data
    (``max_samples`` shared out exactly: ``max_samples // world_size``, one more on the first
    ``max_samples % world_size`` processes) and the features are gathered; rank zero computes and broadcasts the
    numbers, so every process logs the same values. The samples Lightning's distributed sampler repeats to pad the
    processes to one length are left out (:func:`~rank_lightning.sampling.own_samples`): each sample counts once.

    Files, written by rank zero into ``<run dir>/clsdim/``:
    ``accuracy_vs_k.csv`` (columns ``k``, ``accuracy``, ``relative_accuracy`` = accuracy / full accuracy,
    ``eigenvalue`` = the k-th PCA eigenvalue), ``accuracy_vs_k.png``
    (:func:`~rank_lightning.plotting.classification_dimension_figure`: accuracy against k with the threshold and the
    classification dimension marked, beside the PCA spectrum), and with the independence deficit
    ``independence_deficit.md`` (:func:`~rank_lightning.functional.independence_deficit_markdown`) and
    ``independence_deficit.csv``. A later evaluation of the same run (the same trainer) overwrites them; a
    ``clsdim/`` folder that another run left in the run directory (a second trainer writing to the same folder, as
    without a logger) is first renamed to ``clsdim-v<n>``, with a warning, so that nothing of it is lost. With a
    ``WandbLogger``, the tables ``clsdim/accuracy_vs_k`` (and its line plot ``clsdim/accuracy_vs_k_plot``),
    ``clsdim/independence_deficit`` and the image ``clsdim/figure`` (when the figure is drawn) are logged too. The
    latest result is kept in :attr:`result` and :attr:`deficit` on rank zero.

    Features without principal directions (the head's input constant over the evaluated samples, as behind a layer of
    dead ReLUs, or holding NaN or Inf values) have no classification dimension: a warning names the head and the
    cause, ``clsdim/cls_dim`` and ``clsdim/acc_at_cls_dim`` are logged as NaN (``clsdim/full_acc`` too for
    non-finite features), the accuracy table holds NaN, and the figure is not drawn (a previous one is removed).
    Nor does a head that classifies no evaluated sample correctly (``clsdim/full_acc`` 0, which every ``k`` keeps): a
    warning names the head, ``clsdim/cls_dim`` and ``clsdim/acc_at_cls_dim`` are logged as NaN and the figure is not
    drawn, the accuracy table holding the accuracies measured.
    Logits with NaN or Inf values likewise skip the independence deficit, whose numbers are then logged as NaN. Such
    data never stops the run, nor does a head whose outputs are not one row of logits per sample ``(B, C)`` (one that
    scores every token of ``(B, T, d)`` features): a warning names it, and nothing is evaluated.

    Its pass over the validation data runs in the parameters' own dtype, outside the autocast that a mixed-precision
    fit (``bf16-mixed``, ``16-mixed``) puts around its steps, so its full accuracy can differ slightly from the
    validation steps'.

    Args:
        threshold: fraction of the full accuracy to keep (Feng et al.: 0.95).
        center: project through the mean (True) or through the origin (False, Feng et al.'s choice).
        ks: the numbers of directions evaluated; ``None`` for every ``k`` in ``1..d`` (one head evaluation each).
            Each must be at most d, the width of the head's input.
        max_samples: at most this many validation samples (the first, in loader order); ``None`` for all.
        head: the head on the LightningModule, in the syntax of :func:`~rank_lightning.layers.select_layers` (module
            path, block name or glob matching exactly one module); ``None`` finds it (see above).
        input_key: where the inputs are in a batch; ``None`` for the ``x`` of ``(x, y)`` batches, and for dict
            batches the rule of :func:`~rank_lightning.layers.forward_batch` (``forward(**entries)``,
            ``forward(batch)``, else the dict's ``x`` / ``image`` / ``input_ids`` ...).
        label_key: where the integer labels are in a batch; ``None`` for the ``y`` of ``(x, y)`` batches.
        label_fn: ``batch -> labels``, overriding ``label_key``.
        independence_deficit: also compute and log the Lasso independence deficit of the logits.
        deficit_eta: the Lasso penalty ``eta`` of Feng et al. eq. 11.
        deficit_classes: the classes whose logit is explained (indices below the head's output width C);
            ``None`` for all.
        deficit_fit_on: ``"all"`` samples (eq. 11) or only those of the ``"class"`` (Feng et al.'s code).
        class_names: names of the classes for the deficit table; indices otherwise.
        verbose: print the result (rank zero).

    Logged metrics:
        ``clsdim/cls_dim``: the classification dimension k (NaN when undefined, see above).
        ``clsdim/ambient_dim``: d, the width of the features.
        ``clsdim/full_acc``: accuracy of the head on the unprojected features (NaN for non-finite features).
        ``clsdim/acc_at_cls_dim``: accuracy on the projection onto the top ``cls_dim`` directions (NaN when
        ``cls_dim`` is).
        ``clsdim/num_samples``: the number of samples evaluated.
        ``clsdim/deficit_acc_drop`` (with ``independence_deficit``): mean over the chosen classes of the accuracy
        lost when ``logit_i`` is replaced by its fit (all samples).
        ``clsdim/deficit_class_acc_drop``: the same over the samples of class ``i``.
        ``clsdim/deficit_num_terms``: mean number of classes with a non-zero Lasso weight.

    Raises:
        ValueError: at construction for an invalid setting (``center`` not a bool, a ``k`` below 1, a negative
            class); at setup when no head can be found; when ``fit`` starts, before the first training step, when
            ``ks`` exceed the width d of the head's input or ``deficit_classes`` its output width C (read from one
            batch of the first validation dataloader; under ``trainer.validate`` the same messages come at the
            evaluation); at the evaluation when a batch holds no inputs or labels where they are looked for.

    Example::

        import pytorch_lightning as pl
        from rank_lightning.callbacks import ClassificationDimension

        trainer = pl.Trainer(callbacks=[ClassificationDimension(independence_deficit=True, deficit_eta=1.0)])
        trainer.fit(model, datamodule=datamodule)
        # or on a checkpoint
        pl.Trainer(callbacks=[ClassificationDimension()]).validate(model, datamodule=datamodule, ckpt_path="last.ckpt")
    """

    def __init__(
        self,
        *,
        threshold: float = 0.95,
        center: bool = False,
        ks: Sequence[int] | None = None,
        max_samples: int | None = None,
        head: str | None = None,
        input_key: int | str | None = None,
        label_key: int | str | None = None,
        label_fn: Callable[[Any], Any] | None = None,
        independence_deficit: bool = False,
        deficit_eta: float = 20.0,
        deficit_classes: Sequence[int] | None = None,
        deficit_fit_on: Literal["all", "class"] = "all",
        class_names: Sequence[str] | None = None,
        verbose: bool = True,
    ) -> None:
        super().__init__(verbose=verbose)
        check_fraction("threshold", threshold)
        check_positive_int("max_samples", max_samples, allow_none=True)
        check_positive("deficit_eta", deficit_eta)
        if head is not None and (not isinstance(head, str) or not head):
            raise ValueError(f"head must be None or a module path, got {head!r}")
        self.threshold = float(threshold)
        self.center = check_choice("center", center, _CENTER)
        self.ks = None if ks is None else list(check_positive_ints("ks", ks))
        self.max_samples = max_samples
        self.head = head
        self.reader = BatchReader(input_key=input_key, label_key=label_key, label_fn=label_fn)
        self._call: str | None = None  # how forward() takes a dict batch (layers.forward_batch)
        self.cadence = Cadence(every_n_epochs=None, on_validate=True)
        self.independence_deficit = check_bool("independence_deficit", independence_deficit)
        self.deficit_eta = deficit_eta
        self.deficit_classes = _class_indices(deficit_classes)
        self.deficit_fit_on = check_choice("deficit_fit_on", deficit_fit_on, _FIT_ON)
        if isinstance(class_names, str):  # list("cat") would name the classes "c", "a", "t"
            raise ValueError(f"class_names must be a sequence of names, one per class, got the string {class_names!r}")
        if class_names is not None and (not isinstance(class_names, Collection) or not class_names):
            raise ValueError(
                f"class_names must be None or a non-empty sequence of names, one per class, got {class_names!r}"
            )
        self.class_names = None if class_names is None else list(class_names)
        self.result: ClassificationDimensionResult | None = None
        self.deficit: Deficit | None = None
        self._head_path: str | None = None
        self._run_files = RunFiles(type(self).__name__)
        self._trainer: weakref.ref[pl.Trainer] | None = None  # the run the files belong to

    @property
    def head_path(self) -> str | None:
        """Module path of the head on the LightningModule (resolved at setup)."""
        return self._head_path

    def find_head(self, module: nn.Module) -> str:
        """Module path of the head: ``head``, else ``backbone.<head_path>``, else ``<head_path>``, else the last Linear.

        Raises:
            ValueError: a ``head`` that matches no module or several (the message lists the module names), an
                ``nn.Identity`` head, or no head at all.
        """
        return classifier_head(module, self.head)

    @override
    def prepare(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._head_path = self.find_head(pl_module)
        if self._trainer is None or self._trainer() is not trainer:
            # Another trainer is another run: a clsdim/ folder it finds was written by an earlier one, and is kept.
            self._run_files = RunFiles(type(self).__name__)
            resumed = str(getattr(stage, "value", stage)) == "fit" and bool(getattr(trainer, "ckpt_path", None))
            self._run_files.continues = resumed  # a resumed fit continues its own run
            self._trainer = weakref.ref(trainer)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._check_widths(trainer, pl_module)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        scalars = self._evaluate(trainer, pl_module)
        if scalars:
            for logger in trainer.loggers:
                logger.log_metrics(scalars, step=trainer.global_step)

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.cadence.due(trainer):
            return
        scalars = self._evaluate(trainer, pl_module)
        if scalars:
            # Every process holds the same broadcast values: no reduction needed.
            log_rank_equal(pl_module, scalars)

    # -- collection ---------------------------------------------------------------------------------------------

    def _check_widths(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Check ``ks`` against d and ``deficit_classes`` against C on one validation batch, before training.

        Raises:
            ValueError: a ``k`` above the width of the head's input, or a class at or above the head's output width.
        """
        classes = self.deficit_classes if self.independence_deficit else None
        loader = first_val_loader(trainer)
        if (self.ks is None and classes is None) or loader is None:
            return
        path = self._head_path or self.find_head(pl_module)
        captured: dict[str, Tensor] = {}
        layers = [FeatureLayer("features", path, "input"), FeatureLayer("logits", path, "output")]
        # The loader's iterator draws its base seed from the global generator: kept, so that the fit's own random
        # stream (shuffling, dropout, augmentation) is the one it would be without this check.
        with forward_hooks(pl_module, layers, lambda layer, value: captured.setdefault(layer.name, value)):
            with eval_mode(pl_module), torch.no_grad(), random_state_kept(pl_module, [loader]):
                for batch in loader:
                    # As the evaluation runs it (a dict batch by its entries, Hugging Face style).
                    forward_batch(pl_module, step_inputs(pl_module.trainer, batch), self.reader, ran=lambda: captured)
                    break
        features, logits = captured.get("features"), captured.get("logits")
        if self.ks is not None and isinstance(features, Tensor) and features.ndim >= 2:
            width = math.prod(features.shape[1:])
            bad = sorted({k for k in self.ks if k > width})
            if bad:
                raise ValueError(f"ks must lie in [1, {width}] (the feature width), got {bad}")
        if classes is not None and isinstance(logits, Tensor) and logits.ndim == 2:
            num_classes = logits.shape[1]
            bad = sorted({c for c in classes if c >= num_classes})
            if bad:
                raise ValueError(
                    f"deficit_classes {bad} are out of range; valid classes are 0..{num_classes - 1} "
                    f"(the outputs of the head {path!r})"
                )

    def _collect(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loaders: list[Any]) -> tuple[Tensor, Tensor]:
        """This process's head inputs and labels on ``loaders``, in turn (at most its share of ``max_samples``; the
        samples a ``DistributedSampler`` repeats are read once: :class:`~rank_lightning.callbacks.base.RowQuota`)."""
        path = self._head_path or self.find_head(pl_module)
        limit = process_share(self.max_samples, trainer.world_size, trainer.global_rank)
        layers = [FeatureLayer("head", path, "input"), FeatureLayer("logits", path, "output")]
        captured: dict[str, Tensor] = {}
        features: list[Tensor] = []
        labels: list[Tensor] = []
        quota = RowQuota(limit)
        self._call = None  # learnt again for this module and loader
        hooks = forward_hooks(pl_module, layers, first_call_keeper(self, path, captured))
        with hooks, eval_mode(pl_module), torch.no_grad():
            # A process with nothing to take still runs one batch: its (0, d) features join the gather.
            for batch, room in quota.batches(loaders):
                batch = step_inputs(pl_module.trainer, batch)
                y = cast(Tensor, self.reader.labels(batch, required=True))
                captured.clear()
                self._call = forward_batch(pl_module, batch, self.reader, self._call, ran=lambda: captured)
                if not captured:
                    raise RuntimeError(f"the head {path!r} was not called in the forward pass")
                if isinstance(captured.get("head"), Tensor) and captured["head"].ndim:
                    check_label_rows(y, captured["head"].shape[0], f"the inputs of the head {path!r}")
                if not self._per_sample_logits(path, captured, y.shape[0]):
                    return torch.empty(0), torch.empty(0, dtype=torch.long)
                take = y.shape[0] if room is None else min(y.shape[0], room)
                features.append(captured["head"][:take].detach())
                labels.append(y[:take].to(pl_module.device))
                quota.took(take)
        if not features:
            return torch.empty(0), torch.empty(0, dtype=torch.long)
        return torch.cat(features), torch.cat(labels).long()

    def _per_sample_logits(self, path: str, captured: dict[str, Tensor], rows: int) -> bool:
        """Whether the head gave one row of logits per sample, ``(B, C)``, which its accuracy is read from; a warning
        names the head when not (a head applied to every token of ``(B, T, d)`` features gives ``(B, T, C)``)."""
        logits = captured.get("logits")
        if isinstance(logits, Tensor) and logits.ndim == 2 and logits.shape[0] == rows:
            return True
        shape = tuple(logits.shape) if isinstance(logits, Tensor) else type(logits).__name__
        self.warn_once(
            ("logits",),
            f"the outputs of {path!r} have shape {shape}, not (B, C) logits of the batch's {rows} samples: the "
            "classification dimension needs a head that gives one prediction per sample, so nothing is evaluated. "
            "Name such a head with head=...; a model whose head scores every token and keeps one afterwards (as "
            "GPT2ForSequenceClassification does) has none.",
        )
        return False

    # -- evaluation ---------------------------------------------------------------------------------------------

    def _evaluate(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, float]:
        """Collect, gather, compute on rank zero and broadcast; the scalars to log (empty without data)."""
        loaders = val_loaders(trainer)
        if not loaders:
            self.warn_once(("no validation data",), "needs validation data; nothing evaluated")
            return {}
        pooled = "their samples are pooled into one evaluation (the features of every loader together; max_samples "
        pooled += "takes the first samples in loader order)"
        self.warn_pooled_loaders(len(loaders), "validation", pooled)
        with random_state_kept(pl_module, loaders):  # the loaders draw a seed (and an order, if shuffled)
            features, labels = self._collect(trainer, pl_module, loaders)
        shape = features.shape[1:]
        features = gather_rows(pl_module, trainer, features.flatten(1) if features.ndim > 2 else features)
        labels = gather_rows(pl_module, trainer, labels)
        if self.max_samples is not None:
            features, labels = features[: self.max_samples], labels[: self.max_samples]
        scalars: dict[str, float] | None = None
        if trainer.is_global_zero and features.shape[0] > 0:
            scalars = self._compute(trainer, pl_module, features, labels, shape)
        scalars = trainer.strategy.broadcast(scalars, src=0)
        return scalars or {}

    def _compute(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, features: Tensor, labels: Tensor, shape: torch.Size
    ) -> dict[str, float]:
        """Classification dimension (and deficit) on rank zero; writes the files and returns the scalars."""
        head_module = pl_module.get_submodule(self._head_path or self.find_head(pl_module))

        def head(f: Tensor) -> Tensor:
            # Heads that take conv maps or tokens see the projected features in their own shape.
            return head_module(f.reshape(f.shape[0], *shape))

        path = self._head_path or self.find_head(pl_module)
        with eval_mode(pl_module), warnings.catch_warnings():
            # The undefined cases are reported below, naming the head.
            warnings.filterwarnings("ignore", r"the features (contain NaN|are constant)", RuntimeWarning)
            warnings.filterwarnings("ignore", r"the head classifies none of the", RuntimeWarning)
            result = classification_dimension(
                features, labels, head, threshold=self.threshold, center=self.center, ks=self.ks
            )
            deficit = self._deficit(head, features, labels, path) if self.independence_deficit else None
        if not result.defined and result.full_accuracy == 0:
            self.warn_once(
                ("undefined", "no correct prediction"),
                f"the head {path!r} classifies none of the {features.shape[0]} evaluated samples correctly (full "
                f"accuracy 0): every k keeps {self.threshold} of it, so the classification dimension is undefined; "
                "clsdim/cls_dim and clsdim/acc_at_cls_dim are logged as NaN and the figure is not drawn",
                RuntimeWarning,
            )
        elif not result.defined:
            cause = "constant" if bool((result.eigenvalues == 0).all()) else "not finite (NaN or Inf)"
            self.warn_once(
                ("undefined", cause),
                f"the input of the head {path!r} is {cause} over the {features.shape[0]} evaluated samples: it has "
                "no principal directions, so clsdim/cls_dim and clsdim/acc_at_cls_dim are logged as NaN and the "
                "figure is not drawn",
                RuntimeWarning,
            )
        self.result, self.deficit = result, deficit
        directory = run_directory(trainer) / CLSDIM_DIR
        figure = self._write_files(directory, result, deficit) if writes_files(trainer) else None
        self._log_wandb(trainer, result, deficit, figure)
        # The directions are the covariance's either way; center chooses the point the projection goes through.
        how = "the mean" if self.center else "the origin"
        self.info(
            f"cls_dim = {result.cls_dim} of {result.ambient_dim} (PCA projection through {how}, {features.shape[0]} "
            "samples, "
            f"full accuracy {result.full_accuracy:.4f}, threshold {self.threshold}); files in {directory}"
        )
        if deficit:
            self.info("independence deficit:\n" + independence_deficit_markdown(deficit, self.class_names))
        return _scalars(result, deficit, features.shape[0], self.independence_deficit)

    def _deficit(self, head: Callable[[Tensor], Tensor], features: Tensor, labels: Tensor, path: str) -> Deficit | None:
        with torch.no_grad():
            logits = torch.cat([head(chunk) for chunk in features.split(4096)])
        if not bool(torch.isfinite(logits).all()):
            self.warn_once(
                ("deficit not finite",),
                f"the logits of the head {path!r} hold NaN or Inf values; the independence deficit is not computed "
                "and its numbers are logged as NaN",
                RuntimeWarning,
            )
            return None
        return independence_deficit(
            logits, labels, self.deficit_classes, eta=self.deficit_eta, fit_on=self.deficit_fit_on
        )

    def _write_files(
        self, directory: Path, result: ClassificationDimensionResult, deficit: Deficit | None
    ) -> Path | None:
        """Write the accuracy table, the figure and the deficit files, each replaced in one step; returns the figure's
        path (``None`` when the result has nothing to draw, an older figure then being removed so that none describes
        other data, or when it could not be written). A file that cannot be written or drawn is a warning naming it."""
        kept = "the numbers are in the loggers and in the callback's result"
        if not self._run_files.claim(directory, "classification-dimension files"):
            return None  # another run's folder that could not be set aside: left as it is, with a warning
        self.write_file(directory / "accuracy_vs_k.csv", lambda file: file.write(_accuracy_table(result)), kept)
        if deficit is not None:
            markdown = (independence_deficit_markdown(deficit, self.class_names) + "\n").encode()
            table = _deficit_table(deficit)
            self.write_file(directory / "independence_deficit.md", lambda file: file.write(markdown), kept)
            self.write_file(directory / "independence_deficit.csv", lambda file: file.write(table), kept)
        path = directory / "accuracy_vs_k.png"
        if not _drawable(result):
            try:
                path.unlink(missing_ok=True)
            except OSError as error:
                self.warn_once(("unremoved", str(path)), f"could not remove {path} ({error!r})", RuntimeWarning)
            return None
        return self.draw_file(path, lambda: _figure(result), kept)

    @staticmethod
    def _log_wandb(
        trainer: pl.Trainer, result: ClassificationDimensionResult, deficit: Deficit | None, figure: Path | None
    ) -> None:
        loggers = wandb_loggers(trainer)
        if not loggers:
            return
        import wandb

        table = wandb.Table(
            columns=["k", "accuracy"], data=[[k, a] for k, a in zip(result.ks.tolist(), result.accuracies.tolist())]
        )
        payload: dict[str, Any] = {
            "clsdim/accuracy_vs_k": table,
            "clsdim/accuracy_vs_k_plot": wandb.plot.line(table, "k", "accuracy", title="accuracy vs k"),
        }
        if figure is not None:
            payload["clsdim/figure"] = wandb.Image(str(figure))
        if deficit is not None:
            payload["clsdim/independence_deficit"] = wandb.Table(
                columns=list(_DEFICIT_COLUMNS), data=[_deficit_cells(row) for row in deficit]
            )
        for logger in loggers:
            logger.log_metrics(payload, step=trainer.global_step)
