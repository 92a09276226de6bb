"""Per-layer spectral metrics of weight matrices, logged every few epochs by :class:`WeightRankMonitor`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import pytorch_lightning as pl
import torch
from torch import Tensor, nn
from typing_extensions import override

from rank_lightning.callbacks.curves import LayerCurves, wandb_loggers
from rank_lightning.callbacks.layers import check_layer_types, match_layer_names, match_layer_types, module_blocks
from rank_lightning.functional import (
    Spectrum,
    effective_rank,
    numerical_rank,
    singular_values,
    spectra_from_grams,
    stable_rank,
    tail_error,
    weight_as_matrix,
)

__all__ = ["DECOMPOSITIONS", "WEIGHT_METRICS", "WeightRankMonitor"]

WEIGHT_METRICS: tuple[str, ...] = ("numerical_rank", "stable_rank", "effective_rank", "spectral_norm", "tail_error")
DECOMPOSITIONS: tuple[str, ...] = ("auto", "svd", "gram")
# With s_min >= 1e-3 s_1 (condition number <= 1e3) the Gram route's relative error eps64 * (s_1 / s_i)^2 / 2 stays
# below 1e-10 for every singular value.
_AUTO_CONDITION = 1e-3
_TOLERANCE_SIZES = ("min", "max")
_MONITORED_TYPES: tuple[type[nn.Module], ...] = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.MultiheadAttention)


@dataclass(frozen=True)
class _WeightMatrix:
    """One monitored matrix: its logged name and how to read it from the live module."""

    name: str
    read: Callable[[], Tensor]


def _svdvals(batch: Tensor, wide: bool) -> list[Tensor]:
    # Same singular values, but LAPACK's SVD of a wide matrix is several times slower than of its transpose (conv
    # kernels are wide: out < in * kh * kw).
    return list(torch.linalg.svdvals(batch.mT if wide else batch))


def _attention_matrices(name: str, attention: nn.MultiheadAttention) -> list[_WeightMatrix]:
    if attention.in_proj_weight is not None:
        # Packed projections: rows [0, E) are the queries, [E, 2E) the keys, [2E, 3E) the values.
        blocks = [
            _WeightMatrix(f"{name}.{part}_proj", lambda i=i: attention.in_proj_weight.chunk(3)[i])
            for i, part in enumerate("qkv")
        ]
    else:
        blocks = [
            _WeightMatrix(f"{name}.{part}_proj", lambda part=part: getattr(attention, f"{part}_proj_weight"))
            for part in "qkv"
        ]
    return [*blocks, _WeightMatrix(f"{name}.out_proj", lambda: attention.out_proj.weight)]


def _matrices_of(name: str, module: nn.Module) -> list[_WeightMatrix]:
    if isinstance(module, nn.MultiheadAttention):
        return _attention_matrices(name, module)
    return [_WeightMatrix(name, lambda: module.weight)]


class WeightRankMonitor(pl.Callback):
    """Log the numerical, stable and effective rank, spectral norm and tail errors of every layer's weight matrix.

    Works with any LightningModule (nothing to inherit) and with both ``pytorch_lightning`` and
    ``lightning.pytorch`` trainers. Monitored by default: every ``nn.Linear``, ``nn.Conv1d/2d/3d`` and
    ``nn.MultiheadAttention``. Matrices:

    * Linear: the ``(out, in)`` weight.
    * Conv: the ``(out, in / groups, *kernel)`` weight reshaped to ``out x (in / groups * prod(kernel))`` (every kernel
      offset of an output channel in its row; WeightWatcher splits per offset instead).
    * Attention: the query, key and value blocks of the input projection (``<name>.q_proj``, ``<name>.k_proj``,
      ``<name>.v_proj``, each ``(embed_dim, in)``) and the output projection ``<name>.out_proj``.

    Spectra are computed in float64 with one batched decomposition per distinct matrix shape (see
    ``decomposition``); the metrics come from :mod:`rank_lightning.functional`. Values are computed identically on
    every rank and logged on every rank, so ``ModelCheckpoint`` and ``EarlyStopping`` can monitor them.

    Timing: during ``fit``, after validation in every ``every_n_epochs``-th epoch (``(epoch + 1) % every_n_epochs ==
    0``), or at the end of that training epoch when no validation ran. Sanity checks, ``validate`` and ``test`` are
    not monitored. At the end of fit the figures of
    :class:`~rank_lightning.callbacks.curves.LayerCurves` are written to ``<run dir>/rank_curves/``.

    Args:
        layers: the layers to monitor (syntax of :mod:`rank_lightning.callbacks.layers`): exact names as in
            ``pl_module.named_modules()``, where a container such as ``"backbone.layer1"`` selects every monitorable
            layer inside it; block names of ``pl_module.blocks()`` (the package's modules: ``"layer4"``), likewise
            expanded; glob patterns matched with ``fnmatch`` (``"backbone.layer4.*"``). ``None``: every monitorable
            layer.
        layer_types: keep only layers of these types: classes (``nn.Conv2d``), class names (``"Conv2d"``, matched
            against the class and its bases) or dotted import paths (``"torch.nn.Linear"``). ``None``: all types.
        metrics: metrics to log, among ``WEIGHT_METRICS``.
        tail_ranks: the ``k`` of each logged tail error (Zangrando et al. eq. 22).
        every_n_epochs: monitor every this many epochs.
        rank_tolerance: relative tolerance ``eps`` of the numerical rank; ``None`` is ``finfo(float32).eps * K``
            (Feng et al. eq. 4).
        tolerance_size: ``K`` of the default tolerance: ``"min"`` (``min(out, in)``, Feng) or ``"max"`` (NumPy,
            WeightWatcher).
        decomposition: how spectra are computed, in float64 either way. ``"svd"``: ``torch.linalg.svdvals``,
            exact to rounding. ``"gram"``: eigenvalues of the smaller Gram matrix, ``W W^T`` or ``W^T W``
            (:func:`~rank_lightning.functional.spectra_from_grams`), 1.5-1.8x faster on a CPU. Squaring the matrix
            leaves an absolute error of at most about ``sqrt(eps_float64) * s_1 = 1.5e-8 * s_1`` on any singular
            value (relative error about ``eps_float64 * (s_1 / s_i)^2``): values above ``1e-4 * s_1`` keep 8 digits,
            values below ``1e-7 * s_1`` lose their relative accuracy. That is far below the default numerical-rank
            tolerance ``finfo(float32).eps * K * s_1``, but not below a tiny ``rank_tolerance``, and tail errors
            under about ``1e-6`` lose digits. ``"auto"`` (default): for weights stored in float32 or narrower the
            Gram route, with an exact SVD for every matrix whose ``s_min < 1e-3 * s_1`` (where the Gram route's
            relative error would exceed ``1e-10``), so that every singular value is accurate to about ``1e-10``
            relative; ``"svd"`` for float64 weights.
        save_singular_values: also keep every monitored spectrum: one ``.npz`` per monitored epoch in
            ``<run dir>/rank_curves/weight_singular_values/epoch_XXXX.npz`` (one array per layer) and, with a
            ``WandbLogger``, one histogram per layer.
        figures_every_epoch: rewrite the PNG figures after every monitored epoch, not only at the end of fit.
        background_figures: draw the figures on a background thread, so that ``fit`` does not wait for them
            (:func:`~rank_lightning.callbacks.curves.wait_for_figures` waits); ``False`` draws them in ``on_fit_end``.
        verbose: print the monitored layers (rank zero) at setup.

    Raises:
        ValueError: at construction for an invalid setting, at setup for a layer or layer type that does not match
            the model (the message lists the valid names).

    Example::

        import pytorch_lightning as pl
        from rank_lightning.callbacks import WeightRankMonitor

        monitor = WeightRankMonitor(layers=["backbone.layer*"], tail_ranks=(1, 10), every_n_epochs=5)
        trainer = pl.Trainer(max_epochs=50, callbacks=[monitor])
        trainer.fit(model, datamodule=datamodule)  # any LightningModule

    Logged metrics:
        For every monitored matrix ``<layer>`` (module name, or ``<attention>.q_proj`` / ``.k_proj`` / ``.v_proj``
        / ``.out_proj``) and the selected metrics:

        * ``weight/<layer>/numerical_rank``: ``#{i : s_i >= eps * s_1}`` (Feng et al. eq. 4).
        * ``weight/<layer>/stable_rank``: ``sum_i s_i^2 / s_1^2``.
        * ``weight/<layer>/effective_rank``: ``exp(H(p))``, ``p = s / sum s`` (Roy & Vetterli).
        * ``weight/<layer>/spectral_norm``: ``s_1``.
        * ``weight/<layer>/tail_error_k<k>``: ``sqrt(sum_{i>k} s_i^2 / sum_i s_i^2)`` for every ``k`` in
          ``tail_ranks`` (Zangrando et al. eq. 22).

        With a ``WandbLogger``, also the charts ``weight_curves/<metric>_vs_epoch``,
        ``weight_curves/<metric>_vs_depth``, the table ``weight_curves/layers`` and, with
        ``save_singular_values=True``, the histograms ``weight_spectra/<layer>``; the charts hold the whole history
        and are sent after the first monitored epoch, every fifth one and at the end of fit.
    """

    def __init__(
        self,
        *,
        layers: Sequence[str] | None = None,
        layer_types: Sequence[type[nn.Module] | str] | None = None,
        metrics: Sequence[str] = WEIGHT_METRICS,
        tail_ranks: Sequence[int] = (1, 10, 50),
        every_n_epochs: int = 1,
        rank_tolerance: float | None = None,
        tolerance_size: Literal["min", "max"] = "min",
        decomposition: Literal["auto", "svd", "gram"] = "auto",
        save_singular_values: bool = False,
        figures_every_epoch: bool = False,
        background_figures: bool = True,
        verbose: bool = True,
    ) -> None:
        super().__init__()
        if layers is not None:
            layers = [layers] if isinstance(layers, str) else list(layers)
            if not layers or not all(isinstance(name, str) and name for name in layers):
                raise ValueError(f"layers must be None or a non-empty list of non-empty strings, got {layers!r}")
        self.layers = layers
        self.layer_types = None if layer_types is None else check_layer_types(layer_types)
        metrics = [metrics] if isinstance(metrics, str) else list(metrics)
        unknown = [m for m in metrics if m not in WEIGHT_METRICS]
        if unknown or not metrics:
            raise ValueError(f"unknown metrics {unknown or metrics!r}; valid choices are {WEIGHT_METRICS}")
        self.metrics = tuple(metrics)
        tail_ranks = tuple(tail_ranks)
        if not all(isinstance(k, int) and not isinstance(k, bool) and k >= 1 for k in tail_ranks):
            raise ValueError(f"tail_ranks must be positive integers, got {tail_ranks!r}")
        if "tail_error" in self.metrics and not tail_ranks:
            raise ValueError("metric 'tail_error' needs at least one k in tail_ranks")
        self.tail_ranks = tuple(sorted(set(tail_ranks)))
        if isinstance(every_n_epochs, bool) or not isinstance(every_n_epochs, int) or every_n_epochs < 1:
            raise ValueError(f"every_n_epochs must be a positive integer, got {every_n_epochs!r}")
        self.every_n_epochs = every_n_epochs
        if rank_tolerance is not None and not rank_tolerance > 0:
            raise ValueError(f"rank_tolerance must be positive or None, got {rank_tolerance!r}")
        self.rank_tolerance = rank_tolerance
        if tolerance_size not in _TOLERANCE_SIZES:
            raise ValueError(f"unknown tolerance_size {tolerance_size!r}; valid choices are {_TOLERANCE_SIZES}")
        self.tolerance_size = tolerance_size
        if decomposition not in DECOMPOSITIONS:
            raise ValueError(f"unknown decomposition {decomposition!r}; valid choices are {DECOMPOSITIONS}")
        self.decomposition = decomposition
        self.save_singular_values = save_singular_values
        self.verbose = verbose
        self.curves = LayerCurves(
            "weight", figures_every_epoch=figures_every_epoch, background_figures=background_figures
        )
        self._matrices: list[_WeightMatrix] = []
        self._resolved_for: int | None = None
        self._last_monitored_epoch: int | None = None

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(layers=self.layers, layer_types=self._type_names())

    def _type_names(self) -> list[str] | None:
        if self.layer_types is None:
            return None
        return [t if isinstance(t, str) else t.__name__ for t in self.layer_types]

    @property
    def monitored(self) -> list[str]:
        """Names of the monitored matrices in depth order (empty before setup)."""
        return [matrix.name for matrix in self._matrices]

    def select(self, module: nn.Module) -> list[str]:
        """Resolve ``layers`` and ``layer_types`` against ``module`` and return the monitored matrix names.

        Raises:
            ValueError: a name, pattern or type that matches no monitorable layer; the message lists the valid ones.
        """
        modules = dict(module.named_modules())
        candidates = {name: m for name, m in modules.items() if name and isinstance(m, _MONITORED_TYPES)}
        if not candidates:
            raise ValueError(f"{type(module).__name__} has no Linear, Conv or MultiheadAttention layer to monitor")
        chosen = list(candidates)
        if self.layers is not None:
            chosen = match_layer_names(module, self.layers, candidates, blocks=module_blocks(module))
            chosen = self._expand(chosen, candidates)
        if self.layer_types is not None:
            chosen = match_layer_types(chosen, modules, self.layer_types)
        matrices: dict[str, _WeightMatrix] = {}
        for name in chosen:
            for matrix in _matrices_of(name, candidates[name]):
                # An attention's out_proj is also a Linear of its own; keep it once.
                matrices.setdefault(matrix.name, matrix)
        self._matrices = list(matrices.values())
        self._resolved_for = id(module)
        return self.monitored

    def _expand(self, names: list[str], candidates: dict[str, nn.Module]) -> list[str]:
        # A block name resolves to its container path; its weights are the monitorable layers inside it.
        selected: set[str] = set()
        for name in names:
            inside = [name] if name in candidates else [c for c in candidates if c.startswith(name + ".")]
            if not inside:
                raise ValueError(
                    f"layer {name!r} holds no Linear, Conv or MultiheadAttention layer; layers are: "
                    f"{', '.join(candidates)}"
                )
            selected.update(inside)
        return [name for name in candidates if name in selected]

    def spectra(self, module: nn.Module) -> dict[str, Spectrum]:
        """Float64 spectra of the monitored matrices of ``module``, one batched SVD per distinct shape.

        Args:
            module: the model; layers are resolved against it first if they were not yet.

        Returns:
            ``name -> Spectrum`` in depth order, on the CPU; rows of the matrix are its ``num_samples``. A matrix
            holding NaN or Inf gets an all-NaN spectrum.
        """
        if self._resolved_for != id(module):
            self.select(module)
        groups: dict[tuple[tuple[int, ...], torch.device], list[tuple[str, Tensor]]] = {}
        with torch.no_grad():
            for matrix in self._matrices:
                weight = weight_as_matrix(matrix.read().detach())
                # MPS has no float64; every other device decomposes where the weights live.
                device = torch.device("cpu") if weight.device.type == "mps" else weight.device
                groups.setdefault((tuple(weight.shape), device), []).append((matrix.name, weight))
            result: dict[str, Spectrum] = {}
            for (shape, device), members in groups.items():
                exact = self.decomposition == "svd" or (
                    self.decomposition == "auto" and any(w.dtype == torch.float64 for _, w in members)
                )
                batch = torch.stack([w.to(device=device, dtype=torch.float64) for _, w in members])
                finite = torch.isfinite(batch).flatten(1).all(dim=1)
                # LAPACK fails on non-finite input; decompose zeros there and mark the result NaN.
                batch = torch.where(finite[:, None, None], batch, 0.0)
                rows, cols = shape
                wide = rows < cols
                if exact:
                    values = _svdvals(batch, wide)
                else:
                    # W W^T is the feature Gram of W^T: the smaller Gram gives the same singular values.
                    grams = batch @ batch.mT if wide else batch.mT @ batch
                    values = [spec.singular_values for spec in spectra_from_grams(grams, [max(shape)] * len(members))]
                    if self.decomposition == "auto":
                        # Where s_min < 1e-3 s_1 the Gram route is no longer accurate to 1e-10 relative: exact SVD.
                        ill = [i for i, v in enumerate(values) if v[-1] < _AUTO_CONDITION * v[0]]
                        if ill:
                            redone = _svdvals(batch.index_select(0, torch.tensor(ill, device=batch.device)), wide)
                            for i, v in zip(ill, redone):
                                values[i] = v
                    values = [v.cpu() for v in values]
                for (name, _), row, ok in zip(members, values, finite.tolist()):
                    result[name] = Spectrum(row if ok else torch.full_like(row, torch.nan), rows, cols)
        return {name: result[name] for name in self.monitored}

    def measure(self, module: nn.Module) -> dict[str, dict[str, float]]:
        """Compute the configured metrics of every monitored matrix of ``module``.

        Returns:
            ``layer -> metric -> value`` in depth order (tail errors as ``tail_error_k<k>``).
        """
        return {name: self._metrics_of(spec) for name, spec in self.spectra(module).items()}

    def _metrics_of(self, spec: Spectrum) -> dict[str, float]:
        values: dict[str, float] = {}
        for metric in self.metrics:
            if metric == "numerical_rank":
                values[metric] = float(numerical_rank(spec, eps=self.rank_tolerance, size=self.tolerance_size))
            elif metric == "stable_rank":
                values[metric] = float(stable_rank(spec))
            elif metric == "effective_rank":
                values[metric] = float(effective_rank(spec))
            elif metric == "spectral_norm":
                values[metric] = float(singular_values(spec)[0])
            else:
                for k in self.tail_ranks:
                    values[f"tail_error_k{k}"] = float(tail_error(spec, k))
        return values

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        names = self.select(pl_module)
        if self.verbose and trainer.is_global_zero:
            print(f"WeightRankMonitor: monitoring {len(names)} weight matrices: {', '.join(names)}")

    def _due(self, trainer: pl.Trainer) -> bool:
        return (
            not trainer.sanity_checking
            and getattr(trainer.state, "fn", None) == "fit"
            and (trainer.current_epoch + 1) % self.every_n_epochs == 0
        )

    def _monitor(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        spectra = self.spectra(pl_module)
        self.curves.record_and_log(trainer, pl_module, {name: self._metrics_of(s) for name, s in spectra.items()})
        self._last_monitored_epoch = trainer.current_epoch
        if self.save_singular_values and trainer.is_global_zero:
            self._save_singular_values(trainer, spectra)

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._due(trainer):
            self._monitor(trainer, pl_module)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Validation runs before the training epoch ends; monitor here only when it did not run this epoch.
        if self._due(trainer) and self._last_monitored_epoch != trainer.current_epoch:
            self._monitor(trainer, pl_module)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.curves.finish(trainer)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"curves": self.curves.state_dict()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.curves.load_state_dict(state_dict["curves"])

    def _save_singular_values(self, trainer: pl.Trainer, spectra: dict[str, Spectrum]) -> None:
        arrays = {name: spec.singular_values.numpy() for name, spec in spectra.items()}
        directory = self.curves.figure_dir(trainer) / "weight_singular_values"
        directory.mkdir(parents=True, exist_ok=True)
        np.savez_compressed(directory / f"epoch_{trainer.current_epoch:04d}.npz", **arrays)
        loggers = wandb_loggers(trainer)
        if loggers:
            import wandb

            histograms = {
                f"weight_spectra/{name}": wandb.Histogram(values[np.isfinite(values)])
                for name, values in arrays.items()
            }
            for logger in loggers:
                logger.log_metrics(histograms, step=trainer.global_step)
