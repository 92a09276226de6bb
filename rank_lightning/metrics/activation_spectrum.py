"""Streaming spectra of layer activations: float64 sums in, every spectral rank metric out."""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor
from torchmetrics import Metric
from torchmetrics.utilities.data import dim_zero_cat

from rank_lightning.functional.reductions import REDUCTIONS, reduce_activations
from rank_lightning.functional.spectral import (
    Spectrum,
    effective_rank,
    numerical_rank,
    participation_ratio,
    soft_rank,
    spectra_from_grams,
    spectrum,
    spectrum_from_gram,
    stable_rank,
    total_cluster_variation_from_moments,
    variance_ratio,
)

__all__ = ["ActivationSpectrum", "ActivationSpectrumResult", "SpectralSummary"]

PATHS = ("gram", "sample_gram", "sketch")
FALLBACKS = ("sample_gram", "sketch")
_CENTER_CHOICES = (False, True, "both")
_FLOAT64_BYTES = 8


@dataclass
class SpectralSummary:
    """Every scalar spectral metric of one spectrum (one eigendecomposition).

    Attributes:
        spectrum: the singular values and the shape they came from.
        numerical_rank: ``#{s_i >= eps * s_1}`` (Feng et al. eq. 4).
        soft_rank: ``#{s_i^2 / N >= tau}`` (Daneshmand et al. eq. 3).
        participation_ratio: ``r(H) = (sum s^2)^2 / sum s^4`` (Daneshmand et al. eq. 4).
        stable_rank: ``sum s^2 / s_1^2``.
        effective_rank: ``exp(H(s / sum s))`` (Roy & Vetterli).
        variance_ratio: ``{k: VR_k}`` at the configured ``k`` (Sanyal et al. eq. 7).
        variance_ratio_curve: ``[VR_1, ..., VR_K]``.
    """

    spectrum: Spectrum
    numerical_rank: Tensor
    soft_rank: Tensor
    participation_ratio: Tensor
    stable_rank: Tensor
    effective_rank: Tensor
    variance_ratio: dict[int, Tensor] = field(default_factory=dict)
    variance_ratio_curve: Tensor | None = None

    def as_dict(self, prefix: str = "") -> dict[str, float]:
        """Scalars keyed ``{prefix}numerical_rank``, ..., ``{prefix}variance_ratio_{k}``, as Python floats."""
        out = {
            f"{prefix}numerical_rank": float(self.numerical_rank),
            f"{prefix}soft_rank": float(self.soft_rank),
            f"{prefix}participation_ratio": float(self.participation_ratio),
            f"{prefix}stable_rank": float(self.stable_rank),
            f"{prefix}effective_rank": float(self.effective_rank),
        }
        out.update({f"{prefix}variance_ratio_{k}": float(v) for k, v in self.variance_ratio.items()})
        return out


class ActivationSpectrumResult:
    """What :meth:`ActivationSpectrum.compute` returns.

    A plain class rather than a dataclass: torchmetrics maps ``clone`` and device moves over dataclasses in a metric's
    output, which the frozen :class:`Spectrum` inside does not allow.

    Attributes:
        uncentered: metrics of ``X`` (``None`` if only the centred variant was requested).
        centered: metrics of ``X - 1 mu^T`` (``None`` unless requested).
        total_cluster_variation: ``sum_c sum_{i in c} ||x_i - mu_c||^2`` over all streamed rows (Zangrando et al.
            Def. 3.2); ``None`` without ``num_classes``.
        total_cluster_variation_normalized: the same divided by ``sum_i ||x_i - mu||^2``; ``None`` without classes.
        classwise_variance_ratio: ``(num_classes,)`` tensor of ``VR_k`` per class (Sanyal et al. Sec. 4.3), NaN for a
            class without samples; ``None`` when unavailable (see ``classwise_source``).
        classwise_k: the ``k`` of ``classwise_variance_ratio``.
        classwise_source: ``"class_gram"`` (exact, per-class Grams), ``"sample"`` (from the subsample of the
            ``sample_gram`` path), or ``None`` (no classes, disabled, or the per-class Grams exceed the memory
            budget).
        path: how the spectra were obtained: ``"gram"`` (exact d x d Gram), ``"sample_gram"`` (sample Gram of a
            uniform subsample, exact when every row fitted), or ``"sketch"`` (CountSketch of the rows).
        num_samples: rows streamed (after the reduction).
        num_features: d.
        num_spectrum_samples: rows behind the spectra: ``num_samples`` for ``gram`` and ``sketch``, the subsample size
            for ``sample_gram``.
        num_nonfinite_batches: batches that held NaN or Inf; when positive, every metric is NaN.
    """

    def __init__(
        self,
        *,
        uncentered: SpectralSummary | None,
        centered: SpectralSummary | None,
        total_cluster_variation: Tensor | None,
        total_cluster_variation_normalized: Tensor | None,
        classwise_variance_ratio: Tensor | None,
        classwise_k: int,
        classwise_source: str | None,
        path: str,
        num_samples: int,
        num_features: int,
        num_spectrum_samples: int,
        num_nonfinite_batches: int,
    ) -> None:
        self.uncentered = uncentered
        self.centered = centered
        self.total_cluster_variation = total_cluster_variation
        self.total_cluster_variation_normalized = total_cluster_variation_normalized
        self.classwise_variance_ratio = classwise_variance_ratio
        self.classwise_k = classwise_k
        self.classwise_source = classwise_source
        self.path = path
        self.num_samples = num_samples
        self.num_features = num_features
        self.num_spectrum_samples = num_spectrum_samples
        self.num_nonfinite_batches = num_nonfinite_batches

    def as_dict(self) -> dict[str, float]:
        """Every scalar, keyed for logging.

        Keys: ``numerical_rank``, ``soft_rank``, ``participation_ratio``, ``stable_rank``, ``effective_rank``,
        ``variance_ratio_{k}`` (uncentred), the same with a ``centered_`` prefix (centred), ``tcv``,
        ``tcv_normalized``, ``classwise_variance_ratio_{k}_class_{c}``; only those that were computed.
        """
        out: dict[str, float] = {}
        if self.uncentered is not None:
            out.update(self.uncentered.as_dict())
        if self.centered is not None:
            out.update(self.centered.as_dict("centered_"))
        if self.total_cluster_variation is not None:
            out["tcv"] = float(self.total_cluster_variation)
        if self.total_cluster_variation_normalized is not None:
            out["tcv_normalized"] = float(self.total_cluster_variation_normalized)
        if self.classwise_variance_ratio is not None:
            k = self.classwise_k
            out.update(
                {
                    f"classwise_variance_ratio_{k}_class_{c}": float(v)
                    for c, v in enumerate(self.classwise_variance_ratio)
                }
            )
        return out

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(path={self.path!r}, num_samples={self.num_samples}, "
            f"num_features={self.num_features}, num_nonfinite_batches={self.num_nonfinite_batches}, "
            f"scalars={self.as_dict()})"
        )


class ActivationSpectrum(Metric):
    """Stream layer activations into float64 sums; compute every spectral rank metric from one eigendecomposition.

    Each :meth:`update` reduces the raw layer output to an ``(N, d)`` matrix (see
    :func:`~rank_lightning.functional.reduce_activations`) and adds its rows to sums declared with ``"sum"`` reduction:
    the sample count, ``sum ||x||^2``, the feature sum ``X^T 1``, and, on the default path, the Gram ``X^T X``. Sums
    add across batches and DDP ranks, so the result is exact for any N at O(d^2) memory and DDP sync is one all-reduce.
    With ``num_classes``, per-class counts and sums give the total cluster variation exactly, and per-class Grams
    (C x d x d) give the class-wise variance ratio when they fit in ``memory_budget_mb``; labelled rows then go into
    their class Gram only, and :meth:`compute` adds the class Grams up, so the O(N d^2) work is not done twice.

    When ``d > max_gram_features`` (or the d x d Gram exceeds the budget) the metric falls back to:

    * ``"sample_gram"`` (default): a uniform subsample of at most ``max_samples`` rows (bottom-k random keys, which
      merge exactly across ranks), decomposed through its N x N sample Gram. Exact while every row fits; otherwise an
      estimate from the subsample, whose spectrum describes ``num_spectrum_samples`` rows. Class-wise variance ratios
      come from the subsampled rows of each class.
    * ``"sketch"``: a CountSketch ``Y = S X`` with ``max_samples`` rows (each row added with a random sign to a random
      bucket; ``E[Y^T Y] = X^T X``), a sum state like the Gram. Leading singular values are estimated well; the
      tail and the numerical rank are capped by the sketch size. No class-wise variance ratio.

    Non-finite activations never raise: batches holding NaN or Inf are counted, and :meth:`compute` then warns and
    returns NaN for every metric. Labels are ignored when ``num_classes`` is ``None``.

    Args:
        num_classes: number of classes of the labels passed to :meth:`update`; enables the total cluster variation
            and the class-wise variance ratio.
        reduction: how conv ``(B, C, H, W)`` and token ``(B, T, D)`` activations become a matrix; one of
            ``"flatten"``, ``"channel"``, ``"token"``, ``"cls"``, ``"mean"``. With ``"channel"`` and ``"token"``
            every position inherits its input's label.
        center: ``False`` (the papers' convention), ``True`` (PCA convention), or ``"both"`` (one extra
            eigendecomposition from the same sums).
        variance_ratio_ks: the ``k`` of the reported ``VR_k`` scalars.
        soft_rank_tau: threshold of the soft rank.
        rank_eps: relative tolerance of the numerical rank; ``None`` uses ``finfo(float32).eps * K``.
        rank_tolerance_size: ``K`` of the default tolerance, ``"min"`` (Feng) or ``"max"`` (NumPy) of ``(N, d)``.
        classwise: compute the class-wise variance ratio (needs ``num_classes``).
        classwise_k: the ``k`` of the class-wise ``VR_k`` (Sanyal et al. plot ``VR_1``).
        classwise_center: subtract each class's mean first (Sanyal et al. do not).
        max_gram_features: largest d for the exact d x d Gram; bounds the eigendecomposition size (an eigh of
            4096 x 4096 takes seconds on a CPU, of 16,384 x 16,384 minutes).
        max_samples: rows kept by the fallback (subsample or sketch size); ``None`` picks the largest count whose
            rows and sample Gram fit in the budget, at most ``max_gram_features``.
        fallback: ``"sample_gram"`` or ``"sketch"``, used when d is too large for the Gram.
        memory_budget_mb: memory the states may use (Grams, per-class Grams, subsample), in MiB.
        num_features: d, if known; allocates the states at construction (otherwise at the first update), which
            keeps DDP sync valid even for a rank that never sees a batch.
        seed: seed of the subsample keys and sketch buckets (offset by the DDP rank).
        kwargs: passed to :class:`torchmetrics.Metric`.

    Example::

        metric = ActivationSpectrum(num_classes=10, reduction="mean", center="both")
        for x, y in loader:
            metric.update(model.layer3(x), y)
        result = metric.compute()
        result.uncentered.numerical_rank, result.total_cluster_variation, result.path
    """

    is_differentiable = False
    higher_is_better = None
    # forward() on lazily shaped states needs the two-update implementation.
    full_state_update = True

    def __init__(
        self,
        num_classes: int | None = None,
        *,
        reduction: str = "flatten",
        center: bool | Literal["both"] = False,
        variance_ratio_ks: Sequence[int] = (1, 10, 20),
        soft_rank_tau: float = 0.5,
        rank_eps: float | None = None,
        rank_tolerance_size: Literal["min", "max"] = "min",
        classwise: bool = True,
        classwise_k: int = 1,
        classwise_center: bool = False,
        max_gram_features: int = 4096,
        max_samples: int | None = None,
        fallback: Literal["sample_gram", "sketch"] = "sample_gram",
        memory_budget_mb: float = 1024.0,
        num_features: int | None = None,
        seed: int = 0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if num_classes is not None and (isinstance(num_classes, bool) or num_classes < 1):
            raise ValueError(f"num_classes must be a positive integer or None, got {num_classes!r}")
        if reduction not in REDUCTIONS:
            raise ValueError(f"unknown reduction {reduction!r}; valid choices are {REDUCTIONS}")
        if center not in _CENTER_CHOICES or not isinstance(center, (bool, str)):
            raise ValueError(f"unknown center {center!r}; valid choices are {_CENTER_CHOICES}")
        if fallback not in FALLBACKS:
            raise ValueError(f"unknown fallback {fallback!r}; valid choices are {FALLBACKS}")
        if rank_tolerance_size not in ("min", "max"):
            raise ValueError(f"unknown rank_tolerance_size {rank_tolerance_size!r}; valid choices are ('min', 'max')")
        for name, value in (("max_gram_features", max_gram_features), ("classwise_k", classwise_k)):
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if max_samples is not None and max_samples < 1:
            raise ValueError(f"max_samples must be at least 1 or None, got {max_samples}")
        if memory_budget_mb <= 0:
            raise ValueError(f"memory_budget_mb must be positive, got {memory_budget_mb}")
        if rank_eps is not None and not rank_eps > 0:
            raise ValueError(f"rank_eps must be positive or None, got {rank_eps!r}")
        if soft_rank_tau <= 0:
            raise ValueError(f"soft_rank_tau must be positive, got {soft_rank_tau}")
        ks = tuple(variance_ratio_ks)
        if any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in ks):
            raise ValueError(f"variance_ratio_ks must be positive integers, got {ks}")

        self.num_classes = num_classes
        self.reduction = reduction
        self.center = center
        self.variance_ratio_ks = ks
        self.soft_rank_tau = soft_rank_tau
        self.rank_eps = rank_eps
        self.rank_tolerance_size = rank_tolerance_size
        self.classwise = classwise
        self.classwise_k = classwise_k
        self.classwise_center = classwise_center
        self.max_gram_features = max_gram_features
        self.max_samples = max_samples
        self.fallback = fallback
        self.memory_budget_bytes = int(memory_budget_mb * 2**20)
        self.seed = seed
        self._num_features: int | None = None
        self._generator: torch.Generator | None = None

        f64 = torch.float64
        self.add_state("num_samples", torch.zeros((), dtype=torch.int64), dist_reduce_fx="sum")
        self.add_state("num_nonfinite_batches", torch.zeros((), dtype=torch.int64), dist_reduce_fx="sum")
        # sum ||x_i||^2 for the total cluster variation; on the gram path it is the Gram's trace instead.
        self.add_state("sum_squares", torch.zeros((), dtype=f64), dist_reduce_fx="sum")
        # Shaped states start empty and get their size from the first batch unless num_features is given.
        for name in ("feature_sum", "gram", "class_counts", "class_sums", "class_grams", "sketch", "sketch_signs"):
            self.add_state(name, torch.zeros(0, dtype=f64), dist_reduce_fx="sum")
        # The subsample merges by concatenation; the smallest keys overall form a uniform subsample of the union.
        self.add_state("sample_rows", [], dist_reduce_fx="cat")
        self.add_state("sample_keys", [], dist_reduce_fx="cat")
        self.add_state("sample_labels", [], dist_reduce_fx="cat")
        if num_features is not None:
            self._configure(num_features)
            for name, shape in self._state_shapes().items():
                dtype = torch.int64 if name == "class_counts" else f64
                setattr(self, name, torch.zeros(shape, dtype=dtype))
                self._defaults[name] = torch.zeros(shape, dtype=dtype)

    @property
    def path(self) -> str | None:
        """``"gram"``, ``"sample_gram"`` or ``"sketch"``; ``None`` until d is known."""
        if self._num_features is None:
            return None
        d = self._num_features
        if d <= self.max_gram_features and d * d * _FLOAT64_BYTES <= self.memory_budget_bytes:
            return "gram"
        return self.fallback

    @property
    def fallback_size(self) -> int:
        """Rows kept by the fallback path: ``max_samples``, or the largest count that fits the budget."""
        if self.max_samples is not None:
            return self.max_samples
        d = self._num_features or 1
        # Rows (n x d) plus the sample Gram (n x n) within the budget: n^2 + n d <= budget / 8.
        budget = self.memory_budget_bytes / _FLOAT64_BYTES
        n = int((math.sqrt(d * d + 4 * budget) - d) / 2)
        return max(1, min(n, self.max_gram_features))

    @property
    def uses_class_grams(self) -> bool:
        """Whether per-class Grams are accumulated (gram path, classes, and within the memory budget)."""
        if self.path != "gram" or not self.classwise or self.num_classes is None:
            return False
        d = self._num_features or 0
        return (self.num_classes + 1) * d * d * _FLOAT64_BYTES <= self.memory_budget_bytes

    def _configure(self, num_features: int) -> None:
        if num_features < 1:
            raise ValueError(f"num_features must be at least 1, got {num_features}")
        self._num_features = num_features

    def _state_shapes(self) -> dict[str, tuple[int, ...]]:
        d = self._num_features
        c = self.num_classes or 0
        path = self.path
        m = self.fallback_size
        return {
            "feature_sum": (d,),
            "gram": (d, d) if path == "gram" else (0,),
            "class_counts": (c,),
            "class_sums": (c, d) if c else (0,),
            "class_grams": (c, d, d) if self.uses_class_grams else (0,),
            "sketch": (m, d) if path == "sketch" else (0,),
            "sketch_signs": (m,) if path == "sketch" else (0,),
        }

    def _ensure_states(self, device: torch.device, fresh: bool) -> None:
        for name, shape in self._state_shapes().items():
            state = getattr(self, name)
            if tuple(state.shape) != shape:
                dtype = torch.int64 if name == "class_counts" else torch.float64
                setattr(self, name, torch.zeros(shape, dtype=dtype, device=device))
            elif fresh and state.device != device:
                setattr(self, name, state.to(device))
        if fresh:
            for name in ("num_samples", "num_nonfinite_batches", "sum_squares"):
                setattr(self, name, getattr(self, name).to(device))

    def _rng(self) -> torch.Generator:
        if self._generator is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
            # Ranks need independent keys and buckets, or their sketches would correlate.
            self._generator = torch.Generator().manual_seed(self.seed + 1_000_003 * rank)
        return self._generator

    def update(self, activations: Tensor, labels: Tensor | None = None) -> None:
        """Add a batch of raw layer outputs.

        Args:
            activations: ``(B, d)``, ``(B, T, D)`` or ``(B, C, H, W)``; any floating dtype.
            labels: ``(B,)`` integer class labels in ``[0, num_classes)``; ignored when ``num_classes`` is ``None``.
        """
        activations = activations.detach()
        batch = activations.shape[0]
        # One input's reduction gives d (and validates the reduction) without touching the batch.
        num_features = reduce_activations(activations[:1], self.reduction).shape[1]
        if self._num_features is None:
            self._configure(num_features)
        elif num_features != self._num_features:
            raise ValueError(
                f"activations reduce to {num_features} features with reduction={self.reduction!r}, but earlier "
                f"batches had {self._num_features}"
            )
        y = None
        if self.num_classes is not None and labels is not None:
            y = self._input_labels(labels, batch)

        # Before anything is accumulated the states follow the activations' device; afterwards the batch follows them.
        fresh = self._update_count <= 1
        device = activations.device if fresh else self.feature_sum.device
        self._ensure_states(device, fresh)
        if batch == 0:
            return
        activations = activations.to(device)
        path = self.path
        grouped = y is not None and path == "gram" and self.uses_class_grams
        if y is not None:
            y = y.to(device)
        if path == "gram" and self.reduction == "channel" and activations.ndim == 4:
            height, width = activations.shape[2:]
            # Per-input Grams pay off unless the maps are much smaller than C x C (ResNet-18: not for 512 x 4 x 4).
            if 4 * height * width >= activations.shape[1]:
                self._update_channel_gram(activations, y)
                return
        if grouped:
            # Inputs sorted by class make each class's rows one contiguous block: a slice per class Gram, no masks.
            y, order = torch.sort(y, stable=True)
            activations = activations.index_select(0, order)
        x = reduce_activations(activations, self.reduction) if path == "sample_gram" else None
        if x is None:
            x64 = reduce_activations(activations, self.reduction, dtype=torch.float64)
        else:
            x64 = x.to(torch.float64)
        rows_per_input = x64.shape[0] // batch
        y_rows = y if y is None or rows_per_input == 1 else y.repeat_interleave(rows_per_input)

        batch_sum = x64.sum(dim=0)
        # A NaN or Inf anywhere in the batch shows in its column sums (float64 sums of float32 values cannot
        # overflow). Testing them costs no extra pass and no device sync; the poisoned sums are never used, since
        # compute() reports NaN as soon as one batch was bad.
        self.num_nonfinite_batches += (~torch.isfinite(batch_sum).all()).long()
        self.num_samples += x64.shape[0]
        self.feature_sum += batch_sum
        if grouped:
            # The Gram of every row is the sum of the class Grams: compute() adds them up instead of paying twice.
            start = 0
            for c, count in enumerate((torch.bincount(y, minlength=self.num_classes) * rows_per_input).tolist()):
                if count:
                    block = x64[start : start + count]
                    self.class_grams[c].addmm_(block.T, block)
                    start += count
        elif path == "gram":
            self.gram.addmm_(x64.T, x64)
        else:
            self.sum_squares += x64.square().sum()
            if path == "sketch":
                self._update_sketch(x64)
            else:
                self._update_sample(x, y_rows)
        if y_rows is not None:
            self.class_counts += torch.bincount(y_rows, minlength=self.num_classes)
            self.class_sums.index_add_(0, y_rows, x64)

    def _update_channel_gram(self, maps: Tensor, y: Tensor | None) -> None:
        """Gram and sums of the ``channel`` reduction without reordering the maps into rows.

        Input b contributes ``X_b X_b^T`` with ``X_b = maps[b]`` viewed as C x HW: the same ``X^T X`` as the rows of
        :func:`~rank_lightning.functional.reduce_activations`, without its transposing copy (which costs more than the
        Gram when the maps are large). Per-input Grams reach their class Gram by ``index_add_``.
        """
        batch, channels, height, width = maps.shape
        flat = maps.reshape(batch, channels, height * width)
        by_class = y is not None and self.uses_class_grams
        # Float64 blocks (maps and per-input Grams) of about 2^18 values (2 MiB), which stay in cache between the
        # conversion and the product: 40% faster than 16 MiB blocks for 64 x 32 x 32 maps.
        step = max(1, (1 << 18) // (channels * max(channels, height * width)))
        batch_sum = torch.zeros(channels, dtype=torch.float64, device=maps.device)
        for start in range(0, batch, step):
            block = flat[start : start + step].to(torch.float64)
            grams = torch.bmm(block, block.transpose(1, 2))
            sums = block.sum(dim=2)
            batch_sum += sums.sum(dim=0)
            if y is not None:
                self.class_sums.index_add_(0, y[start : start + step], sums)
            if by_class:
                self.class_grams.index_add_(0, y[start : start + step], grams)
            else:
                self.gram += grams.sum(dim=0)
        self.num_nonfinite_batches += (~torch.isfinite(batch_sum).all()).long()
        self.num_samples += batch * height * width
        self.feature_sum += batch_sum
        if y is not None:
            self.class_counts += torch.bincount(y, minlength=self.num_classes) * (height * width)

    def _input_labels(self, labels: Tensor, batch: int) -> Tensor:
        if labels.ndim != 1 or labels.shape[0] != batch:
            raise ValueError(f"labels must have shape ({batch},) to match the activations, got {tuple(labels.shape)}")
        if labels.dtype.is_floating_point or labels.dtype == torch.bool:
            raise ValueError(f"labels must be integer class indices, got dtype {labels.dtype}")
        if batch and (int(labels.min()) < 0 or int(labels.max()) >= self.num_classes):
            raise ValueError(
                f"labels must lie in [0, {self.num_classes}), got values in [{int(labels.min())}, {int(labels.max())}]"
            )
        return labels.long()

    def _update_sketch(self, x64: Tensor) -> None:
        rng = self._rng()
        m = self.sketch.shape[0]
        buckets = torch.randint(m, (x64.shape[0],), generator=rng).to(x64.device)
        signs = (torch.randint(2, (x64.shape[0],), generator=rng, dtype=torch.float64) * 2 - 1).to(x64.device)
        self.sketch.index_add_(0, buckets, x64 * signs.unsqueeze(1))
        self.sketch_signs.index_add_(0, buckets, signs)

    def _update_sample(self, x: Tensor, y: Tensor | None) -> None:
        cap = self.fallback_size
        keys = torch.rand(x.shape[0], generator=self._rng(), dtype=torch.float64).to(x.device)
        rows = x.to(torch.promote_types(x.dtype, torch.float32))
        if y is None:
            y = torch.full((x.shape[0],), -1, dtype=torch.int64, device=x.device)
        if not self.sample_rows:
            self.sample_rows.append(rows[:0])
            self.sample_keys.append(keys[:0])
            self.sample_labels.append(y[:0])
        kept_rows, kept_keys, kept_labels = self.sample_rows[0], self.sample_keys[0], self.sample_labels[0]
        rows = rows.to(torch.promote_types(rows.dtype, kept_rows.dtype))
        num_kept = kept_keys.shape[0]
        if num_kept + keys.shape[0] <= cap:
            self.sample_rows[0] = torch.cat([kept_rows.to(rows.dtype), rows])
            self.sample_keys[0] = torch.cat([kept_keys, keys])
            self.sample_labels[0] = torch.cat([kept_labels, y])
            return
        chosen = torch.zeros(num_kept + keys.shape[0], dtype=torch.bool, device=x.device)
        chosen[torch.topk(torch.cat([kept_keys, keys]), cap, largest=False).indices] = True
        entering = chosen[num_kept:].nonzero().squeeze(1)
        if num_kept < cap:
            # Still filling: keep every old row, append the newcomers that made the cut.
            leaving = torch.arange(num_kept, cap, device=x.device)
            kept_rows = torch.cat([kept_rows.to(rows.dtype), rows.new_empty(cap - num_kept, rows.shape[1])])
            kept_keys = torch.cat([kept_keys, keys.new_empty(cap - num_kept)])
            kept_labels = torch.cat([kept_labels, y.new_empty(cap - num_kept)])
            leaving = torch.cat([(~chosen[:num_kept]).nonzero().squeeze(1), leaving])
        else:
            # Full: overwrite the evicted rows in place instead of copying the whole subsample.
            leaving = (~chosen[:num_kept]).nonzero().squeeze(1)
            kept_rows = kept_rows.to(rows.dtype)
        kept_rows[leaving] = rows[entering]
        kept_keys[leaving] = keys[entering]
        kept_labels[leaving] = y[entering]
        self.sample_rows[0], self.sample_keys[0], self.sample_labels[0] = kept_rows, kept_keys, kept_labels

    def _subsample(self) -> tuple[Tensor, Tensor]:
        rows, keys, labels = (
            dim_zero_cat(s) if isinstance(s, list) else s
            for s in (self.sample_rows, self.sample_keys, self.sample_labels)
        )
        cap = self.fallback_size
        if keys.shape[0] > cap:
            # After a DDP gather every rank contributed up to cap rows; the smallest keys overall are uniform.
            idx = torch.topk(keys, cap, largest=False).indices
            rows, labels = rows[idx], labels[idx]
        return rows.to(torch.float64), labels.long()

    def compute(self) -> ActivationSpectrumResult:
        """Spectra and every metric; see :class:`ActivationSpectrumResult`."""
        n = int(self.num_samples)
        bad = int(self.num_nonfinite_batches)
        d = self._num_features or 0
        path = self.path or "gram"
        variants = [c for c in (False, True) if self.center == "both" or self.center == c]
        classes = self.num_classes

        if bad or n == 0:
            problem = f"{bad} batch(es) of activations contained NaN or Inf" if bad else "no activations were streamed"
            warnings.warn(f"ActivationSpectrum: {problem}; every metric is NaN", RuntimeWarning, stacklevel=2)
            nan_spec = {
                c: Spectrum(torch.full((max(1, min(n, d)),), math.nan, dtype=torch.float64), max(n, 1), max(d, 1), c)
                for c in variants
            }
            nan = torch.tensor(math.nan, dtype=torch.float64)
            return self._result(
                spectra=nan_spec,
                tcv=(nan, nan) if classes else None,
                classwise=torch.full((classes,), math.nan, dtype=torch.float64) if classes and self.classwise else None,
                classwise_source=None,
                path=path,
                n=n,
                n_spec=n,
            )

        classwise, classwise_source = None, None
        gram = self._gram() if path == "gram" else None
        if gram is not None:
            spectra = {
                c: spectrum_from_gram(gram, n, feature_sum=self.feature_sum, center=c, num_features=d) for c in variants
            }
            n_spec = n
            if self.uses_class_grams:
                classwise, classwise_source = self._classwise_from_grams(), "class_gram"
        elif path == "sketch":
            spectra = {c: self._sketch_spectrum(n, c) for c in variants}
            n_spec = n
        else:
            rows, labels = self._subsample()
            n_spec = rows.shape[0]
            mean = self.feature_sum / n
            spectra = {}
            for c in variants:
                # The exact streamed mean centres the subsample better than the subsample's own mean.
                centred = rows - mean if c else rows
                spec = spectrum_from_gram(centred @ centred.T, n_spec, side="sample", num_features=d)
                spectra[c] = replace(spec, centered=c)
            if classes and self.classwise and bool((labels >= 0).any()):
                classwise, classwise_source = self._classwise_from_rows(rows, labels), "sample"

        tcv = None
        sum_squares = gram.diagonal().sum() if gram is not None else self.sum_squares
        labelled = int(self.class_counts.sum()) if classes else 0
        if labelled and labelled != n:
            # The sums of squares cover every row, the class sums only the labelled ones: TCV would be wrong.
            warnings.warn(
                f"ActivationSpectrum: {n - labelled} of {n} rows came without labels; the total cluster variation "
                "needs labels for every row and is not reported",
                RuntimeWarning,
                stacklevel=2,
            )
        elif labelled:
            tcv = tuple(
                total_cluster_variation_from_moments(
                    sum_squares, self.class_sums, self.class_counts, normalized=normalized
                )
                for normalized in (False, True)
            )
        return self._result(
            spectra=spectra,
            tcv=tcv,
            classwise=classwise,
            classwise_source=classwise_source,
            path=path,
            n=n,
            n_spec=n_spec,
        )

    def _sketch_spectrum(self, n: int, center: bool) -> Spectrum:
        y = self.sketch
        if center:
            # S (X - 1 mu^T) = S X - (S 1) mu^T
            y = y - torch.outer(self.sketch_signs, self.feature_sum / n)
        spec = spectrum_from_gram(y @ y.T, y.shape[0], side="sample", num_features=y.shape[1])
        length = min(n, y.shape[1])
        values = spec.singular_values[:length]
        values = torch.cat([values, values.new_zeros(length - values.shape[0])])
        return Spectrum(values, n, y.shape[1], center)

    def _gram(self) -> Tensor:
        """``X^T X`` over every streamed row: rows with labels went into the class Grams, the others into ``gram``."""
        return self.gram + self.class_grams.sum(dim=0) if self.uses_class_grams else self.gram

    def _classwise_from_grams(self) -> Tensor:
        out = torch.full((self.num_classes,), math.nan, dtype=torch.float64, device=self.class_grams.device)
        counts = self.class_counts.tolist()
        present = [c for c, count in enumerate(counts) if count]
        if present:
            grams, sums = self.class_grams, self.class_sums
            if len(present) < len(counts):
                index = torch.tensor(present, device=grams.device)
                grams, sums = grams.index_select(0, index), sums.index_select(0, index)
            spectra = spectra_from_grams(
                grams, [counts[c] for c in present], feature_sums=sums, center=self.classwise_center
            )
            for c, spec in zip(present, spectra):
                out[c] = variance_ratio(spec, self.classwise_k)
        return out

    def _classwise_from_rows(self, rows: Tensor, labels: Tensor) -> Tensor:
        out = torch.full((self.num_classes,), math.nan, dtype=torch.float64, device=rows.device)
        for c in range(self.num_classes):
            members = rows[labels == c]
            if members.shape[0]:
                out[c] = variance_ratio(spectrum(members, center=self.classwise_center), self.classwise_k)
        return out

    def _summarize(self, spec: Spectrum) -> SpectralSummary:
        return SpectralSummary(
            spectrum=spec,
            numerical_rank=numerical_rank(spec, eps=self.rank_eps, size=self.rank_tolerance_size),
            soft_rank=soft_rank(spec, tau=self.soft_rank_tau),
            participation_ratio=participation_ratio(spec),
            stable_rank=stable_rank(spec),
            effective_rank=effective_rank(spec),
            variance_ratio={k: variance_ratio(spec, k) for k in self.variance_ratio_ks},
            variance_ratio_curve=variance_ratio(spec),
        )

    def _result(
        self,
        *,
        spectra: dict[bool, Spectrum],
        tcv: tuple[Tensor, Tensor] | None,
        classwise: Tensor | None,
        classwise_source: str | None,
        path: str,
        n: int,
        n_spec: int,
    ) -> ActivationSpectrumResult:
        summaries = {c: self._summarize(s) for c, s in spectra.items()}
        return ActivationSpectrumResult(
            uncentered=summaries.get(False),
            centered=summaries.get(True),
            total_cluster_variation=tcv[0] if tcv else None,
            total_cluster_variation_normalized=tcv[1] if tcv else None,
            classwise_variance_ratio=classwise,
            classwise_k=self.classwise_k,
            classwise_source=classwise_source,
            path=path,
            num_samples=n,
            num_features=self._num_features or 0,
            num_spectrum_samples=n_spec,
            num_nonfinite_batches=int(self.num_nonfinite_batches),
        )
