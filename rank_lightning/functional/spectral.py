"""Spectral rank metrics of a samples x features matrix ``X`` (N x d).

Every metric is a function of the singular values ``s_1 >= s_2 >= ... >= s_K`` of ``X``, ``K = min(N, d)``. Each
function accepts either the data matrix or a precomputed :class:`Spectrum`, so one decomposition serves all metrics of a
layer. Spectra are always computed in float64, whatever the dtype of the input.

Conventions for inputs without a meaningful answer:

* Non-finite input (NaN or Inf anywhere): the spectrum is all NaN, a warning names the problem, and every metric derived
  from it is NaN. Nothing raises, so a monitor never stops training.
* All-zero input: every rank-like metric (numerical, soft, participation ratio, stable, effective) is 0; ratios that are
  0/0 (variance ratio, tail error, normalised total cluster variation) are NaN.

:func:`summarize` computes every metric of one spectrum at once into a :class:`SpectralSummary`, whose
:meth:`SpectralSummary.as_dict` is the one place where metric families become logged key names
(``variance_ratio_<k>``, ``tail_error_k<k>``): the activation monitor, the weight monitor and the run report all go
through it.
"""

from __future__ import annotations

import math
import numbers
import threading
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

from rank_lightning.functional.power_law import PowerLawFit, power_law_alpha, spectral_decay_alpha
from rank_lightning.functional.reductions import weight_as_matrix
from rank_lightning.layers import class_labels
from rank_lightning.validation import (
    check_bool,
    check_choice,
    check_positive,
    check_positive_int,
    check_positive_ints,
    check_real,
)

__all__ = [
    "SPECTRAL_METRICS",
    "SpectralSummary",
    "Spectrum",
    "alpha_req",
    "classwise_variance_ratio",
    "default_rank_tolerance",
    "effective_rank",
    "gram_variance_ratios",
    "numerical_rank",
    "participation_ratio",
    "singular_values",
    "soft_rank",
    "spectra_from_grams",
    "spectral_metric_keys",
    "spectrum",
    "spectrum_from_gram",
    "stable_rank",
    "summarize",
    "tail_error",
    "total_cluster_variation",
    "total_cluster_variation_from_moments",
    "variance_ratio",
]

_SIZE_CHOICES = ("min", "max")
_EPS64 = float(torch.finfo(torch.float64).eps)
_CENTER_CHOICES = (False, True)
_GRAM_SIDES = ("feature", "sample")


@dataclass(frozen=True)
class Spectrum:
    """Singular values of a samples x features matrix, with the shape they came from.

    Attributes:
        singular_values: float64, 1-D, descending, non-negative, of length ``min(num_samples, num_features)``
            (all NaN when the input was not finite).
        num_samples: N, the number of rows of ``X``.
        num_features: d, the number of columns of ``X``.
        centered: whether the column means were subtracted before the decomposition.
    """

    singular_values: Tensor
    num_samples: int
    num_features: int
    centered: bool = False

    @property
    def is_finite(self) -> bool:
        """Whether the spectrum holds numbers (False after non-finite input)."""
        return bool(torch.isfinite(self.singular_values).all())


def _check_matrix(x: Tensor, name: str = "x") -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or a Spectrum, got {type(x).__name__}")
    if x.ndim != 2:
        raise ValueError(
            f"{name} must be a 2-D samples x features matrix, got shape {tuple(x.shape)}; "
            "reduce activations first with rank_lightning.functional.reduce_activations"
        )
    if x.shape[0] == 0 or x.shape[1] == 0:
        raise ValueError(f"{name} must have at least one sample and one feature, got shape {tuple(x.shape)}")
    check_real(name, x)


def _check_center(center: Any, *, allow_none: bool = False) -> None:
    check_choice("center", center, _CENTER_CHOICES + ((None,) if allow_none else ()))


def _warn_non_finite(what: str) -> None:
    warnings.warn(
        f"{what} contains NaN or Inf values; the spectrum and every metric derived from it are NaN",
        RuntimeWarning,
        stacklevel=3,
    )


def _nan_spectrum(num_samples: int, num_features: int, centered: bool, device: torch.device) -> Spectrum:
    values = torch.full((min(num_samples, num_features),), math.nan, dtype=torch.float64, device=device)
    return Spectrum(values, num_samples, num_features, centered)


def spectrum(x: Tensor, *, center: bool = False) -> Spectrum:
    """Singular values of ``X`` computed in float64.

    Args:
        x: (N, d) samples x features matrix of any floating dtype (bf16 and fp16 are upcast before any arithmetic).
        center: subtract the column means first (the PCA convention).

    Returns:
        The :class:`Spectrum` of ``X``; all NaN, with a ``RuntimeWarning``, if ``x`` holds NaN or Inf.
    """
    _check_matrix(x)
    _check_center(center)
    num_samples, num_features = x.shape
    x64 = x.detach().to(torch.float64)
    if not torch.isfinite(x64).all():
        _warn_non_finite("input matrix")
        return _nan_spectrum(num_samples, num_features, center, x.device)
    if center:
        x64 = x64 - x64.mean(dim=0, keepdim=True)
    with serial_if_small(x64, min(num_samples, num_features), SERIAL_SVD_BELOW):
        values = torch.linalg.svdvals(x64)
    return Spectrum(values, num_samples, num_features, center)


def spectrum_from_gram(
    gram: Tensor,
    num_samples: int,
    *,
    feature_sum: Tensor | None = None,
    center: bool = False,
    side: Literal["feature", "sample"] = "feature",
    num_features: int | None = None,
) -> Spectrum:
    """Spectrum of ``X`` from a Gram matrix: ``s_i^2`` are the eigenvalues of ``X^T X`` (or of ``X X^T``).

    The non-zero eigenvalues of the feature Gram ``X^T X`` (d x d) and of the sample Gram ``X X^T`` (N x N) coincide,
    so either gives the spectrum; the result is truncated to ``min(N, d)`` values.

    Args:
        gram: float64 Gram matrix, ``X^T X`` (``side="feature"``) or ``X X^T`` (``side="sample"``).
        num_samples: N, the number of rows of ``X`` (the count the Gram was summed over).
        feature_sum: ``X^T 1 = N mu`` (length d); required to centre a feature Gram.
        center: return the spectrum of the centred matrix ``X - 1 mu^T``: the feature Gram becomes
            ``X^T X - N mu mu^T``, the sample Gram ``H X X^T H`` with ``H = I - 11^T / N``.
        side: which Gram ``gram`` is.
        num_features: d; defaults to ``gram.shape[0]`` for a feature Gram and is required for a sample Gram.

    Returns:
        The :class:`Spectrum`; all NaN, with a ``RuntimeWarning``, if the Gram is not finite.
    """
    if side not in _GRAM_SIDES:
        raise ValueError(f"unknown side {side!r}; valid choices are {_GRAM_SIDES}")
    if gram.ndim != 2 or gram.shape[0] != gram.shape[1]:
        raise ValueError(f"gram must be a square matrix, got shape {tuple(gram.shape)}")
    if num_samples < 1:
        raise ValueError(f"num_samples must be at least 1, got {num_samples}")
    _check_center(center)
    if side == "feature":
        if num_features is None:
            num_features = gram.shape[0]
        elif num_features != gram.shape[0]:
            raise ValueError(
                f"num_features={num_features} does not match the feature Gram of shape {tuple(gram.shape)}"
            )
    else:
        if num_features is None:
            raise ValueError("num_features is required for a sample Gram (side='sample')")
        if gram.shape[0] != num_samples:
            raise ValueError(f"num_samples={num_samples} does not match the sample Gram of shape {tuple(gram.shape)}")
    g = gram.detach().to(torch.float64)
    if center and side == "feature":
        if feature_sum is None:
            raise ValueError("center=True on a feature Gram needs feature_sum (X^T 1)")
        s = feature_sum.detach().to(device=g.device, dtype=torch.float64).reshape(-1)
        if s.shape[0] != g.shape[0]:
            raise ValueError(f"feature_sum has length {s.shape[0]}, expected {g.shape[0]}")
        g = _center_feature_gram(g, s, num_samples)
    elif center:
        row_mean = g.mean(dim=1, keepdim=True)
        g = g - row_mean - row_mean.T + g.mean()
    if not torch.isfinite(g).all():
        _warn_non_finite("Gram matrix")
        return _nan_spectrum(num_samples, num_features, center, gram.device)
    values = _gram_singular_values(g)[: min(num_samples, num_features)]
    return Spectrum(values.contiguous(), num_samples, num_features, center)


def spectra_from_grams(
    grams: Tensor,
    num_samples: Sequence[int],
    *,
    feature_sums: Tensor | None = None,
    center: bool = False,
) -> list[Spectrum]:
    """Spectra of several matrices ``X_b`` with the same d from their feature Grams, in one batched eigendecomposition.

    The same computation as :func:`spectrum_from_gram` (``side="feature"``) for each ``grams[b]``; one batched call
    replaces a Python loop of small decompositions (the per-class Grams of a layer, Sanyal et al. Sec. 4.3).

    Args:
        grams: ``(B, d, d)`` float Grams ``X_b^T X_b``.
        num_samples: the row count ``N_b`` of each ``X_b`` (at least 1).
        feature_sums: ``(B, d)`` column sums ``X_b^T 1``; required with ``center=True``.
        center: spectra of the centred matrices ``X_b - 1 mu_b^T`` (Grams ``X_b^T X_b - N_b mu_b mu_b^T``).

    Returns:
        One :class:`Spectrum` per Gram, of length ``min(N_b, d)``; an all-NaN spectrum, with a ``RuntimeWarning``,
        for a Gram that is not finite.
    """
    if grams.ndim != 3 or grams.shape[1] != grams.shape[2]:
        raise ValueError(f"grams must have shape (B, d, d), got {tuple(grams.shape)}")
    counts = [int(n) for n in num_samples]
    if len(counts) != grams.shape[0]:
        raise ValueError(f"num_samples has {len(counts)} entries for {grams.shape[0]} Grams")
    if any(n < 1 for n in counts):
        raise ValueError(f"every num_samples must be at least 1, got {counts}")
    _check_center(center)
    num_features = grams.shape[1]
    g = grams.detach().to(torch.float64)
    if center:
        if feature_sums is None:
            raise ValueError("center=True needs feature_sums (X_b^T 1 for every Gram)")
        sums = feature_sums.detach().to(device=g.device, dtype=torch.float64)
        if tuple(sums.shape) != (grams.shape[0], num_features):
            raise ValueError(f"feature_sums must have shape {(grams.shape[0], num_features)}, got {tuple(sums.shape)}")
        n = torch.tensor(counts, dtype=torch.float64, device=g.device).view(-1, 1, 1)
        g = _center_feature_gram(g, sums, n)
    # A NaN or Inf anywhere makes its Gram's sum non-finite: one cheap reduction instead of a full-size mask.
    finite = torch.isfinite(g.sum(dim=(1, 2))).tolist()
    if not all(finite):
        # Non-finite Grams are decomposed as zeros, so that one bad Gram does not stop the batched call.
        g = torch.where(torch.tensor(finite, device=g.device).view(-1, 1, 1), g, torch.zeros_like(g))
    values = _gram_singular_values(g)
    spectra = []
    for b, (n_b, ok) in enumerate(zip(counts, finite)):
        if ok:
            spectra.append(Spectrum(values[b, : min(n_b, num_features)].contiguous(), n_b, num_features, center))
        else:
            _warn_non_finite(f"Gram matrix {b}")
            spectra.append(_nan_spectrum(n_b, num_features, center, g.device))
    return spectra


def _center_feature_gram(gram: Tensor, feature_sum: Tensor, num_samples: Tensor | int) -> Tensor:
    """``X^T X - N mu mu^T = X^T X - s s^T / N`` for ``s = X^T 1``; broadcasts over leading batch dimensions."""
    return gram - feature_sum.unsqueeze(-1) * feature_sum.unsqueeze(-2) / num_samples


# Below these sizes a CPU decomposition runs on one thread (:func:`serial_if_small`).
SERIAL_EIGH_BELOW = 1024
SERIAL_SVD_BELOW = 512


@contextmanager
def serial_if_small(tensor: Tensor, size: int, serial_below: int = SERIAL_EIGH_BELOW) -> Iterator[None]:
    """Run the CPU operations inside on one thread when ``size < serial_below`` (``size``: the problem's measure).

    Small CPU operations (LAPACK's symmetric eigensolver and SVD, which are chains of level-2 BLAS calls, a Gram
    product of a few rows, ``index_add_``) are parallel regions too small to share: with OpenMP threads that sleep
    between regions (``OMP_WAIT_POLICY=PASSIVE``, which ``train.py`` sets so that a busy machine is not slowed
    further), waking them costs more than the work. Measured on 2 cores with that policy, 2 threads against one:
    ``eigvalsh`` of a float64 128 x 128 Gram 10.0 ms and 0.9 ms, of ten stacked 128 x 128 Grams 89 ms and 5.8 ms, of
    512 x 512 109 ms and 29 ms; ``index_add_`` of 64 rows of 128 into 10 class sums 0.8 ms and 0.01 ms. Without the
    policy the two are within 10% for these sizes. CUDA tensors and large problems keep torch's thread count.
    """
    threads = torch.get_num_threads()
    if tensor.device.type != "cpu" or size >= serial_below or threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class ScipyBlas:
    """SciPy's own OpenBLAS, run on one thread, where torch too runs on one thread.

    SciPy's OpenBLAS keeps a thread pool of its own, whose threads spin after every call (on a 2-core machine they
    took a core from the training loop, half of it in ``sched_yield``). The package therefore calls it on one thread
    only (:meth:`single_threaded`), and only where torch runs on at most :data:`SCIPY_MAX_TORCH_THREADS` thread
    (:meth:`usable`): the small work of :func:`serial_if_small` and one-thread runs. There one thread of ``dsyrk`` was
    1.2-1.9x faster than torch's Gram product, while torch's product on two threads beat it by 1.05-1.5x for 256 and
    more features (``benchmarks/bench_gram_update.py``, two cores). The library is found once through
    ``threadpoolctl`` among the BLAS libraries loaded from SciPy's own folder; where SciPy's BLAS is not such a library
    (a system or conda BLAS shared with other code), ``available`` is false and the work stays torch's.
    """

    def __init__(self) -> None:
        self.libraries: list[Any] | None = None
        self._depth = threading.local()  # single_threaded() blocks entered on this thread

    @property
    def available(self) -> bool:
        """Whether SciPy's own OpenBLAS was found (looked up on first use)."""
        if self.libraries is None:
            self.libraries = self._find()
        return bool(self.libraries)

    def usable(self) -> bool:
        """Available, and torch runs on at most :data:`SCIPY_MAX_TORCH_THREADS` threads here and now."""
        return torch.get_num_threads() <= SCIPY_MAX_TORCH_THREADS and self.available

    @staticmethod
    def _find() -> list[Any]:
        try:
            import scipy
            import scipy.linalg.blas  # loads SciPy's BLAS, so that threadpoolctl lists it
            from threadpoolctl import ThreadpoolController
        except ImportError:
            return []
        root = Path(scipy.__file__).resolve().parent
        folders = (root, root.parent / "scipy.libs")
        libraries = [
            library
            for library in ThreadpoolController().select(internal_api="openblas").lib_controllers
            if any(folder in Path(library.filepath).resolve().parents for folder in folders)
        ]
        return libraries

    @contextmanager
    def single_threaded(self) -> Iterator[None]:
        """Inside, SciPy's OpenBLAS runs on one thread; its own count is restored after. Blocks nested on one thread
        cost nothing: the outermost sets and restores the count (a loop of small calls enters one block around it)."""
        depth = getattr(self._depth, "value", 0)
        if depth:
            self._depth.value = depth + 1
            try:
                yield
            finally:
                self._depth.value = depth
            return
        libraries = (self.libraries or []) if self.available else []  # looked up here, not inside a nested block
        before = [library.num_threads for library in libraries]
        for library, count in zip(libraries, before):
            if count != 1:
                library.set_num_threads(1)
        self._depth.value = 1
        try:
            yield
        finally:
            self._depth.value = 0
            for library, count in zip(libraries, before):
                if count != 1:
                    library.set_num_threads(count)


SCIPY_MAX_TORCH_THREADS = 1
"""SciPy's one-thread kernels replace torch's only where torch runs on at most this many threads (see
:class:`ScipyBlas`)."""

# Below this size the leading eigenvalues gain little on every eigenvalue by torch (1.5-2.0x from d = 128 on, one or
# two threads: benchmarks/bench_gram_update.py).
_LEADING_EIGEN_MIN = 128

SCIPY_BLAS = ScipyBlas()
"""The one instance: the package's SciPy BLAS and LAPACK calls run inside ``SCIPY_BLAS.single_threaded()``."""


def gram_variance_ratios(
    grams: Tensor,
    k: int,
    *,
    num_samples: Sequence[int],
    feature_sums: Tensor | None = None,
) -> Tensor | None:
    """``VR_k`` of each Gram: the sum of its ``k`` largest eigenvalues over its trace, by LAPACK's selected-eigenvalue
    solver (Sanyal et al. eq. 7 with ``s_i^2`` the eigenvalues of ``X^T X``); ``None`` where it does not apply.

    The variance ratio needs the ``k`` leading eigenvalues and the total ``sum_i s_i^2 = trace(X^T X)``, not the whole
    spectrum. LAPACK's ``dsyevr`` with an index range (through SciPy: the same tridiagonal reduction, then only the
    wanted eigenvalues, each to full accuracy) on one thread took 0.5-0.7x the time of torch's ``eigvalsh`` of every
    eigenvalue for d = 128-512 (``benchmarks/bench_gram_update.py``); below d = 128 it gains little and ``None`` is
    returned; from d = 1024 on, where torch's eigensolver runs on all of its threads, only if those are one
    (:meth:`ScipyBlas.usable`). The trace is the exact sum the eigenvalues would add up to, without their rounding.

    Args:
        grams: ``(B, d, d)`` symmetric float64 Grams (both triangles set).
        k: number of leading eigenvalues.
        num_samples: the rows ``N_b`` behind each Gram.
        feature_sums: ``(B, d)`` ``X_b^T 1``: centre each Gram first (``X^T X - s s^T / N``).

    Returns:
        float64 ``(B,)`` on the Grams' device, or ``None`` (nothing computed) for a non-CPU or non-float64 batch, a
        non-finite Gram, ``k`` not below ``min(N_b, d)`` for some Gram, the sizes above, or without SciPy's own BLAS
        (:class:`ScipyBlas`): then the whole spectra are needed.
    """
    d = grams.shape[-1]
    if (
        grams.device.type != "cpu"
        or grams.dtype != torch.float64
        or any(k >= min(int(n), d) for n in num_samples)
        or d < _LEADING_EIGEN_MIN
        or not SCIPY_BLAS.available
        or (d >= SERIAL_EIGH_BELOW and not SCIPY_BLAS.usable())
    ):
        return None
    g = grams.detach()
    if feature_sums is not None:
        n = torch.tensor([float(n) for n in num_samples], dtype=torch.float64).view(-1, 1, 1)
        g = _center_feature_gram(g, feature_sums.detach().to(torch.float64), n)
    if not bool(torch.isfinite(g.sum(dim=(1, 2))).all()):
        return None
    from scipy.linalg.lapack import dsyevr

    totals = g.diagonal(dim1=1, dim2=2).sum(-1)
    leading = torch.empty_like(totals)
    with SCIPY_BLAS.single_threaded():
        for b, matrix in enumerate(g.numpy()):
            # LAPACK's own call (the eigh wrapper's checks and workspace query cost 10-20% at d = 128); indices 1-based.
            values, _, found, _, info = dsyevr(matrix, compute_v=0, range="I", il=d - k + 1, iu=d)
            if info != 0 or found != k:
                return None
            leading[b] = float(np.clip(values[:k], 0.0, None).sum())
    return leading / totals


def _gram_singular_values(gram: Tensor) -> Tensor:
    """Descending ``sqrt`` of the eigenvalues of (a batch of) symmetric PSD Grams."""
    # eigvalsh reads one triangle only, so rounding asymmetry needs no symmetrising copy of a possibly large Gram;
    # rounding can leave the smallest eigenvalues slightly negative.
    with serial_if_small(gram, gram.shape[-1]):
        values = torch.linalg.eigvalsh(gram)
    return values.flip(-1).clamp_min(0).sqrt()


def default_rank_tolerance(
    num_samples: int,
    num_features: int,
    *,
    tolerance_size: Literal["min", "max"] = "min",
    dtype_eps: float | None = None,
) -> float:
    """Relative tolerance of the numerical rank: ``finfo(float32).eps * K`` (Feng et al. eq. 4, Sec. 4.3).

    Feng et al. take ``K = min(N, d)``, the number of singular values (the default); NumPy's ``matrix_rank`` and
    WeightWatcher take ``K = max(N, d)`` (``tolerance_size="max"``). The float32 epsilon is used whatever dtype the
    data had, so the rank does not depend on the precision the decomposition ran in.

    ``dtype_eps`` ties the tolerance to the precision the data were computed in (``finfo(dtype).eps``):

    * as fine as float32's or finer (float32, float64): ``dtype_eps * K``, Feng's rule in that precision;
    * coarser (bfloat16 ``2^-7``, float16 ``2^-10``): ``max(finfo(float32).eps * K, dtype_eps)``. The rule
      ``dtype_eps * K`` would reach 1 at ``K = 128`` in bfloat16, where no singular value is counted. Rounding each
      entry of an N x d matrix to a dtype of unit roundoff ``u = eps / 2`` moves its singular values by the spectral
      norm of independent errors, about ``u / sqrt(3) * (sqrt(N) + sqrt(d)) * rms(x)``, which is at most
      ``1.15 u s_1`` since ``s_1 >= ||X||_F / sqrt(min(N, d))``, whatever ``K``. Measured on low-rank matrices
      (N x d from 256 x 256 to 8192 x 1024, rounded to bfloat16 or computed by a bfloat16 product), the largest noise
      singular value was 0.14 ``eps * s_1``.

    Args:
        num_samples: N.
        num_features: d.
        tolerance_size: ``"min"`` or ``"max"``, which dimension is ``K``.
        dtype_eps: the epsilon of the data's dtype; ``None`` for Feng's float32 rule.

    Returns:
        The tolerance ``eps``; a singular value counts when ``s_i >= eps * s_1``.
    """
    check_choice("tolerance_size", tolerance_size, _SIZE_CHOICES)
    k = min(num_samples, num_features) if tolerance_size == "min" else max(num_samples, num_features)
    float32_eps = float(torch.finfo(torch.float32).eps)
    if dtype_eps is None:
        return float32_eps * k
    if dtype_eps <= float32_eps:
        return float(dtype_eps) * k
    return max(float32_eps * k, float(dtype_eps))


def _as_spectrum(x: Tensor | Spectrum, center: bool | None = None) -> Spectrum:
    _check_center(center, allow_none=True)
    if isinstance(x, Spectrum):
        if center is not None and center != x.centered:
            raise ValueError(
                f"center={center} requested but the precomputed spectrum has centered={x.centered}; "
                "pass center=None to use the spectrum as it is"
            )
        return x
    _check_matrix(x)
    return spectrum(x, center=bool(center))


def _nan_scalar(device: torch.device) -> Tensor:
    return torch.tensor(math.nan, dtype=torch.float64, device=device)


def _relative_squares(s: Tensor) -> Tensor:
    """``(s_i / s_1)^2``: the squares of the singular values in units of the largest, which the scale-free ratios
    (participation ratio, stable rank, variance ratios, tail errors) are computed from. Squared in absolute units,
    ``s^2`` and ``s^4`` overflow from ``s_1 ~ 1e77`` and underflow below ``1e-77`` (``s^4``; ``s^2`` from 1e-154),
    giving 0 or NaN where the ratio is well defined. Zeros for the zero matrix (``s_1 = 0``)."""
    top = s[:1]
    return (s / torch.where(top == 0, torch.ones_like(top), top)).square()


def singular_values(x: Tensor | Spectrum, *, center: bool | None = None) -> Tensor:
    """Singular values of ``X`` in float64, descending, length ``min(N, d)``.

    Args:
        x: (N, d) matrix or precomputed spectrum.
        center: subtract column means first (only for a matrix; ``None`` means no).

    Returns:
        1-D float64 tensor.
    """
    return _as_spectrum(x, center).singular_values


def numerical_rank(
    x: Tensor | Spectrum,
    *,
    rank_tolerance: float | None = None,
    tolerance_size: Literal["min", "max"] = "min",
    center: bool | None = None,
) -> Tensor:
    """Numerical rank ``#{i : s_i >= eps * s_1}`` (Feng et al. eq. 4), ``eps`` being the rank tolerance.

    Args:
        x: (N, d) matrix or precomputed spectrum.
        rank_tolerance: relative tolerance ``eps``; ``None`` uses :func:`default_rank_tolerance` with
            ``tolerance_size``.
        tolerance_size: ``K`` of the default tolerance, ``min(N, d)`` (Feng) or ``max(N, d)`` (NumPy).
        center: subtract column means first (only for a matrix; ``None`` means no).

    Returns:
        int64 scalar; 0 for an all-zero matrix. A float64 NaN scalar if the spectrum is not finite (an integer
        tensor cannot hold NaN).
    """
    check_choice("tolerance_size", tolerance_size, _SIZE_CHOICES)
    check_positive("rank_tolerance", rank_tolerance, allow_none=True)
    spec = _as_spectrum(x, center)
    s = spec.singular_values
    if not spec.is_finite:
        return _nan_scalar(s.device)
    if rank_tolerance is None:
        eps = default_rank_tolerance(spec.num_samples, spec.num_features, tolerance_size=tolerance_size)
    else:
        eps = rank_tolerance
    # "> 0" keeps the rank of the zero matrix at 0 (with s_1 = 0 every s_i >= eps * s_1).
    return ((s >= eps * s[0]) & (s > 0)).sum()


def soft_rank(x: Tensor | Spectrum, *, tau: float = 0.5, center: bool | None = None) -> Tensor:
    """Soft rank ``rank_tau(X) = #{i : s_i^2 / N >= tau}`` (Daneshmand et al. eq. 3).

    ``s_i^2 / N`` are the eigenvalues of the second-moment matrix ``X^T X / N``; the paper uses ``tau = 0.5`` on
    batch-normalised features, whose second moments are of order one. Values below the resolution of a float64 Gram,
    ``s_i^2 < d * eps64 * s_1^2`` (README, "What it computes"), are not counted: ``tau`` is absolute, and for
    activations far from the origin (``s_1^2 / N`` above ``tau / (d * eps64)``, rows of norm about ``1e7``) the Gram's
    rounding noise would pass it.

    Args:
        x: (N, d) matrix or precomputed spectrum.
        tau: absolute threshold on the eigenvalues of ``X^T X / N``; must be positive.
        center: subtract column means first (only for a matrix; ``None`` means no).

    Returns:
        int64 scalar; a float64 NaN scalar if the spectrum is not finite.
    """
    check_positive("tau", tau)
    spec = _as_spectrum(x, center)
    s = spec.singular_values
    if not spec.is_finite:
        return _nan_scalar(s.device)
    # tau is absolute: far from the origin (s_1^2 / N above tau / (d eps64)) a Gram's rounding noise would pass it.
    resolved = _relative_squares(s) >= spec.num_features * _EPS64
    return ((s.square() / spec.num_samples >= tau) & resolved).sum()


def participation_ratio(x: Tensor | Spectrum, *, center: bool | None = None) -> Tensor:
    """Participation ratio ``r(H) = (sum_i s_i^2)^2 / sum_i s_i^4 = Tr(M)^2 / ||M||_F^2``, ``M = X^T X / N``.

    Daneshmand et al. eq. 4; by their Lemma 1 it lower-bounds the rank. On a matrix it is computed from the smaller of
    ``X^T X`` and ``X X^T`` (the scale ``1/N`` cancels) and is differentiable with respect to ``x``, so it can be
    maximised by gradient ascent (rank-increasing pre-training, Daneshmand et al. App. G).

    Args:
        x: (N, d) matrix or precomputed spectrum.
        center: subtract column means first (only for a matrix; ``None`` means no).

    Returns:
        float64 scalar in ``[1, min(N, d)]``; 0 for an all-zero matrix; NaN for non-finite input.
    """
    if isinstance(x, Spectrum):
        spec = _as_spectrum(x, center)
        s2 = _relative_squares(spec.singular_values)
        trace = s2.sum()
        frob_sq = s2.square().sum()
    else:
        _check_matrix(x)
        _check_center(center, allow_none=True)
        x64 = x.to(torch.float64)
        if not torch.isfinite(x64.detach()).all():
            _warn_non_finite("input matrix")
            return _nan_scalar(x.device)
        if center:
            x64 = x64 - x64.mean(dim=0, keepdim=True)
        # In units of the largest entry (the ratio is scale-free): s^4 neither overflows nor underflows. The scale is
        # a constant of the gradient, which a scale-free function's gradient does not depend on.
        largest = x64.detach().abs().max()
        x64 = x64 / torch.where(largest == 0, torch.ones_like(largest), largest)
        m = x64.T @ x64 if x64.shape[1] <= x64.shape[0] else x64 @ x64.T
        trace = x64.square().sum()
        frob_sq = m.square().sum()
    # The where keeps gradients finite at the zero matrix, where the ratio is 0/0 and is defined as 0.
    is_zero = frob_sq == 0
    safe = torch.where(is_zero, torch.ones_like(frob_sq), frob_sq)
    return torch.where(is_zero, torch.zeros_like(frob_sq), trace.square() / safe)


def stable_rank(x: Tensor | Spectrum, *, center: bool | None = None) -> Tensor:
    """Stable rank ``sum_i s_i^2 / s_1^2`` (``||X||_F^2 / ||X||_2^2``, WeightWatcher's ``stable_rank``).

    Args:
        x: (N, d) matrix or precomputed spectrum.
        center: subtract column means first (only for a matrix; ``None`` means no).

    Returns:
        float64 scalar in ``[1, min(N, d)]``; 0 for an all-zero matrix; NaN for non-finite input.
    """
    s = _as_spectrum(x, center).singular_values
    return _relative_squares(s).sum()


def effective_rank(x: Tensor | Spectrum, *, center: bool | None = None) -> Tensor:
    """Effective rank ``exp(H(p))`` with ``p_i = s_i / sum_j s_j`` (Roy & Vetterli 2007; RankMe, Garrido et al. 2023).

    Conventions, which implementations in the wild mix: the distribution is over the singular values ``s_i`` of
    ``X``, not over ``s_i^2`` (the eigenvalues of ``X^T X``; an entropy over ``s^2`` gives a smaller number); ``X`` is
    uncentred unless ``center=True`` (RankMe uses the raw embeddings); no ``eps`` is added to ``p`` (RankMe's code
    adds ``1e-7``, which puts a floor of about ``exp(-K * 1e-7 log 1e-7)`` under the result); zero singular values
    contribute nothing. The result is capped by ``K = min(N, d)``: with fewer samples than features it cannot exceed N.

    Args:
        x: (N, d) matrix or precomputed spectrum.
        center: subtract column means first (only for a matrix; ``None`` means no).

    Returns:
        float64 scalar in ``[1, min(N, d)]``; 0 for an all-zero matrix; NaN for non-finite input.
    """
    s = _as_spectrum(x, center).singular_values
    total = s.sum()
    if not torch.isfinite(total):
        return _nan_scalar(s.device)
    if total == 0:
        return torch.zeros((), dtype=torch.float64, device=s.device)
    p = s / total
    # 0 * log 0 = 0 by continuity.
    entropy = -torch.xlogy(p, p).sum()
    return entropy.exp()


def alpha_req(
    x: Tensor | Spectrum, *, first_index: int = 1, last_index: int | None = None, center: bool | None = None
) -> Tensor:
    """alpha-ReQ: the exponent of the power-law decay ``lambda_i ~ i^-alpha`` of the eigenvalues ``lambda_i = s_i^2 /
    N`` of the second-moment matrix (Agrawal et al. 2022, Sec. 3; least squares in log-log,
    :func:`~rank_lightning.functional.power_law.spectral_decay_alpha`).

    Fitted over the ranks ``first_index..last_index`` among the numerically non-zero eigenvalues, ``s_i >= eps *
    s_1`` with the numerical rank's default tolerance (:func:`default_rank_tolerance`): rounding noise below it
    (``s_i ~ 1e-16 s_1`` in a rank-deficient spectrum) would otherwise dominate the fit in log scale. Agrawal et al.
    use the covariance of the representations, i.e. the centred spectrum (``center=True``, or a centred
    :class:`Spectrum`); on an uncentred spectrum the mean direction is the first eigenvalue. Larger ``alpha`` means a
    faster decay, fewer effective dimensions.

    Args:
        x: (N, d) matrix or precomputed spectrum.
        first_index: first rank of the fit (1-based).
        last_index: last rank of the fit (inclusive); ``None`` for the last numerically non-zero one.
        center: subtract column means first (only for a matrix; ``None`` means no).

    Returns:
        float64 scalar; NaN when fewer than two ranks remain in the range or for non-finite input.
    """
    check_positive_int("first_index", first_index)
    check_positive_int("last_index", last_index, allow_none=True)
    spec = _as_spectrum(x, center)
    s = spec.singular_values
    if not spec.is_finite:
        return _nan_scalar(s.device)
    rank = int(numerical_rank(spec))
    last = rank if last_index is None else min(last_index, rank)
    if last < 2 or first_index > last - 1:
        return _nan_scalar(s.device)
    # The slope in log-log is scale-free: the eigenvalues in units of the largest cannot underflow or overflow.
    fit = spectral_decay_alpha(_relative_squares(s[:last]), first_index=first_index, last_index=last)
    return torch.tensor(fit.alpha, dtype=torch.float64, device=s.device)


def _check_k(k: int | None) -> None:
    if k is not None and (isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1):
        raise ValueError(f"k must be a positive integer or None (the whole curve), got {k!r}")


def variance_ratio(x: Tensor | Spectrum, k: int | None = None, *, center: bool | None = None) -> Tensor:
    """Variance ratio ``VR_k = sum_{i<=k} s_i^2 / sum_i s_i^2`` (Sanyal et al. eq. 7); leakage is ``1 - VR_k``.

    Sanyal et al. take the singular values of the activation matrix itself (uncentred, the default for a matrix).
    With ``center=True`` the curve equals scikit-learn's ``PCA().explained_variance_ratio_.cumsum()``.

    Args:
        x: (N, d) matrix or precomputed spectrum.
        k: number of leading singular values; ``None`` returns the whole curve ``[VR_1, ..., VR_K]``. ``k > K`` gives 1.
        center: subtract column means first (only for a matrix; ``None`` means no).

    Returns:
        float64 scalar (or 1-D curve of length ``K``); NaN for an all-zero or non-finite input.
    """
    _check_k(k)
    s2 = _relative_squares(_as_spectrum(x, center).singular_values)
    total = s2.sum()
    if k is None:
        return s2.cumsum(0) / total
    return s2[:k].sum() / total


def classwise_variance_ratio(
    x: Tensor,
    labels: Tensor,
    *,
    k: int = 1,
    num_classes: int | None = None,
    center: bool = False,
) -> Tensor:
    """Variance ratio ``VR_k`` of the rows of each class separately (Sanyal et al. Sec. 4.3 plots ``VR_1``).

    Args:
        x: (N, d) matrix.
        labels: (N,) integer class labels in ``[0, num_classes)``.
        k: number of leading singular values.
        num_classes: number of classes; defaults to ``labels.max() + 1``.
        center: subtract each class's mean first (Sanyal et al. do not).

    Returns:
        float64 tensor of shape ``(num_classes,)``; NaN for a class without samples.
    """
    _check_k(k)
    _check_matrix(x)
    _check_center(center)
    labels = _check_labels(labels, x.shape[0], num_classes, x.device)
    if num_classes is None:
        num_classes = int(labels.max()) + 1
    out = torch.full((num_classes,), math.nan, dtype=torch.float64, device=x.device)
    for c in range(num_classes):
        rows = x[labels == c]
        if rows.shape[0] > 0:
            out[c] = variance_ratio(spectrum(rows, center=center), k)
    return out


def _check_labels(labels: Tensor, num_samples: int, num_classes: int | None, device: torch.device) -> Tensor:
    check_positive_int("num_classes", num_classes, allow_none=True)
    # The forms every class-aware part takes: a (B, 1) column, booleans, one-hot rows as their argmax.
    labels = class_labels(labels, num_samples).to(device)
    if labels.numel() and int(labels.min()) < 0:
        raise ValueError(f"labels must be non-negative, got {int(labels.min())}")
    if num_classes is not None and labels.numel() and int(labels.max()) >= num_classes:
        raise ValueError(f"label {int(labels.max())} is out of range for num_classes={num_classes}")
    return labels.long()


def total_cluster_variation(
    x: Tensor, labels: Tensor, *, normalized: bool = False, num_classes: int | None = None
) -> Tensor:
    """Total cluster variation ``TCV = sum_c sum_{i in c} ||x_i - mu_c||^2`` (Zangrando et al. Def. 3.2, eq. 6).

    The class labels are the partition (Zangrando et al.'s own approximation of the best clustering, Sec. 6.3).

    Args:
        x: (N, d) matrix.
        labels: (N,) integer class labels.
        normalized: divide by the total sum of squares around the global mean, ``sum_i ||x_i - mu||^2``, giving the
            fraction of the variance left inside the classes (in ``[0, 1]``; NaN when all rows are equal).
        num_classes: number of classes; defaults to ``labels.max() + 1``.

    Returns:
        float64 scalar; NaN for non-finite input (with a ``RuntimeWarning``).
    """
    check_bool("normalized", normalized)
    _check_matrix(x)
    labels = _check_labels(labels, x.shape[0], num_classes, x.device)
    x64 = x.detach().to(torch.float64)
    if not torch.isfinite(x64).all():
        _warn_non_finite("input matrix")
        return _nan_scalar(x.device)
    if num_classes is None:
        num_classes = int(labels.max()) + 1
    counts = torch.bincount(labels, minlength=num_classes).to(torch.float64)
    sums = torch.zeros(num_classes, x64.shape[1], dtype=torch.float64, device=x.device).index_add_(0, labels, x64)
    means = sums / counts.clamp_min(1).unsqueeze(1)
    # Subtracting the means before squaring avoids the cancellation of the moment formula.
    tcv = (x64 - means[labels]).square().sum()
    if not normalized:
        return tcv
    return tcv / (x64 - x64.mean(dim=0)).square().sum()


MOMENT_ROUNDING_WARN_RELATIVE = 1e-6
"""A statistic taken as a difference of float64 moment sums warns when its rounding can exceed this relative error."""


def moment_difference_error(sum_squares: float | Tensor) -> float | Tensor:
    """The rounding of ``Q - B`` for float64 sums ``0 <= B <= Q = sum ||x_i - r||^2``: about ``eps_float64 * Q``.

    What is left after the difference (a total cluster variation, a within-class scatter) carries this absolute error
    whatever its own size, so it has no digit left when the classes are ``1e-8`` as wide as their distance from ``r``.
    """
    return _EPS64 * sum_squares


def warn_moment_rounding(statistic: str, value: float, error: float, *, how: str, why: str, stacklevel: int) -> bool:
    """Warn (``RuntimeWarning``) when ``error`` exceeds :data:`MOMENT_ROUNDING_WARN_RELATIVE` of a finite ``value``.

    The message reads ``"<statistic> (<value>)<how>, and may be off by about <error> (<relative> relative)<why>"``.
    Returns whether it warned.
    """
    if not (math.isfinite(value) and math.isfinite(error) and error > MOMENT_ROUNDING_WARN_RELATIVE * abs(value)):
        return False
    relative = f"{error / abs(value):.1e}" if value else "inf"
    warnings.warn(
        f"{statistic} ({value:.3e}){how}, and may be off by about {error:.1e} ({relative} relative){why}",
        RuntimeWarning,
        stacklevel=stacklevel + 1,
    )
    return True


def total_cluster_variation_from_moments(
    sum_squares: Tensor,
    class_sums: Tensor,
    class_counts: Tensor,
    *,
    normalized: bool = False,
) -> Tensor:
    """Total cluster variation from streamed moments (Zangrando et al. Def. 3.2, eq. 6).

    Uses ``TCV = sum_i ||x_i||^2 - sum_c ||S_c||^2 / n_c`` and, for the normalised variant, the total sum of squares
    ``sum_i ||x_i||^2 - ||sum_c S_c||^2 / N``; exact in float64 unless the within-class spread is tiny compared with
    the distance of the data from the origin.

    Args:
        sum_squares: scalar ``sum_i ||x_i||^2``.
        class_sums: (C, d) per-class sums ``S_c = sum_{i in c} x_i``.
        class_counts: (C,) per-class sample counts ``n_c``.
        normalized: divide by the total sum of squares around the global mean.

    Returns:
        float64 scalar, clamped at 0 against rounding; NaN if any moment is not finite.
    """
    check_bool("normalized", normalized)
    sums = class_sums.to(torch.float64)
    counts = class_counts.to(torch.float64)
    total_sq = sum_squares.to(torch.float64)
    between = (sums.square().sum(dim=1) / counts.clamp_min(1)).sum()
    tcv = (total_sq - between).clamp_min(0)
    if not normalized:
        return tcv
    n = counts.sum()
    total_var = (total_sq - sums.sum(dim=0).square().sum() / n.clamp_min(1)).clamp_min(0)
    return tcv / total_var


def tail_error(w: Tensor | Spectrum, k: int | None = None) -> Tensor:
    """Singular-value tail error ``sqrt(sum_{i>k} s_i^2) / sqrt(sum_i s_i^2)`` (Zangrando et al. eq. 22, Sec. 6.1).

    It is the relative Frobenius distance of ``W`` from its best rank-``k`` approximation (Eckart-Young).

    Args:
        w: weight matrix (conv kernels ``(out, in, kh, kw)`` are reshaped to ``out x (in*kh*kw)``), any 2-D matrix, or
            a precomputed spectrum.
        k: rank of the approximation; ``None`` returns the curve for ``k = 1, ..., K`` (its last entry is 0).

    Returns:
        float64 scalar (or 1-D curve of length ``K``); NaN for an all-zero or non-finite input.
    """
    _check_k(k)
    if isinstance(w, Tensor) and w.ndim != 2:
        w = weight_as_matrix(w)
    s2 = _relative_squares(_as_spectrum(w).singular_values)
    # The reverse cumulative sum keeps the small tails accurate instead of computing 1 - VR_k.
    tails = s2.flip(0).cumsum(0).flip(0)
    total = tails[0]
    if k is None:
        return (torch.cat([tails[1:], tails.new_zeros(1)]) / total).sqrt()
    return (tails[k] / total).sqrt() if k < tails.shape[0] else (tails.new_zeros(()) / total).sqrt()


# -- every metric of one spectrum, and their logged names -----------------------------------------------------------

SPECTRAL_METRICS: tuple[str, ...] = (
    "numerical_rank",
    "soft_rank",
    "participation_ratio",
    "stable_rank",
    "effective_rank",
    "variance_ratio",
    "spectral_norm",
    "tail_error",
    "alpha_req",
    "alpha",
)
"""Metric families of :class:`SpectralSummary`; ``variance_ratio`` and ``tail_error`` expand to one key per ``k``,
``alpha`` (the power-law fit of the eigenvalues, computed only when asked for) to ``alpha`` and
``alpha_ks_distance``."""


def spectral_metric_keys(
    metrics: Sequence[str], *, variance_ratio_ks: Sequence[int] = (), tail_ranks: Sequence[int] = ()
) -> list[str]:
    """The logged key names of the metric families ``metrics``, in that order.

    ``variance_ratio`` expands to ``variance_ratio_<k>`` for every ``k`` in ``variance_ratio_ks``, ``tail_error`` to
    ``tail_error_k<k>`` for every ``k`` in ``tail_ranks``, ``alpha`` to ``alpha`` and ``alpha_ks_distance``; the other
    families are their own key.
    """
    variance_ratio_ks = check_positive_ints("variance_ratio_ks", variance_ratio_ks, allow_empty=True)
    tail_ranks = check_positive_ints("tail_ranks", tail_ranks, allow_empty=True)
    keys: list[str] = []
    for metric in metrics:
        if metric == "variance_ratio":
            keys.extend(f"variance_ratio_{k}" for k in variance_ratio_ks)
        elif metric == "tail_error":
            keys.extend(f"tail_error_k{k}" for k in tail_ranks)
        elif metric == "alpha":
            keys.extend(_ALPHA_KEYS)
        else:
            keys.append(metric)
    return keys


_ALPHA_KEYS = ("alpha", "alpha_ks_distance")


@dataclass
class SpectralSummary:
    """Every scalar spectral metric of one spectrum (one decomposition).

    Attributes:
        spectrum: the singular values and the shape they came from.
        numerical_rank: ``#{s_i >= eps * s_1}`` (Feng et al. eq. 4).
        soft_rank: ``#{s_i^2 / N >= tau}`` (Daneshmand et al. eq. 3).
        participation_ratio: ``r(H) = (sum s^2)^2 / sum s^4`` (Daneshmand et al. eq. 4).
        stable_rank: ``sum s^2 / s_1^2``.
        effective_rank: ``exp(H(s / sum s))`` (Roy & Vetterli).
        spectral_norm: ``s_1``.
        variance_ratio: ``{k: VR_k}`` at the configured ``k`` (Sanyal et al. eq. 7).
        variance_ratio_curve: ``[VR_1, ..., VR_K]``.
        tail_error: ``{k: sqrt(sum_{i>k} s_i^2 / sum_i s_i^2)}`` at the configured ``k`` (Zangrando et al. eq. 22).
        alpha_req: decay exponent of ``s_i^2 / N ~ i^-alpha`` (Agrawal et al. 2022, :func:`alpha_req`).
        power_law: the power-law fit of the eigenvalues ``s_i^2`` (:func:`~rank_lightning.functional.power_law_alpha`,
            WeightWatcher's ``alpha``); computed on first use by :meth:`power_law_fit` (``None`` before), since it
            scores every eigenvalue as a candidate ``x_min`` (O(K^2) work).
    """

    spectrum: Spectrum
    numerical_rank: Tensor
    soft_rank: Tensor
    participation_ratio: Tensor
    stable_rank: Tensor
    effective_rank: Tensor
    spectral_norm: Tensor
    variance_ratio: dict[int, Tensor] = field(default_factory=dict)
    variance_ratio_curve: Tensor | None = None
    tail_error: dict[int, Tensor] = field(default_factory=dict)
    alpha_req: Tensor = field(default_factory=lambda: torch.tensor(math.nan, dtype=torch.float64))
    power_law: PowerLawFit | None = None

    def power_law_fit(self) -> PowerLawFit:
        """The power-law fit of the eigenvalues ``s_i^2`` (:func:`~rank_lightning.functional.power_law_alpha`), computed
        once and kept in :attr:`power_law`."""
        if self.power_law is None:
            self.power_law = power_law_alpha(self.spectrum.singular_values.square())
        return self.power_law

    def as_dict(self, metrics: Sequence[str] | None = None, prefix: str = "") -> dict[str, float]:
        """Scalars as Python floats, keyed as :func:`spectral_metric_keys` names them.

        Args:
            metrics: metric families to include, in this order; ``None`` for every family but ``spectral_norm`` and
                ``tail_error`` (the activation metrics).
            prefix: prepended to every key (``"centered_"``).

        Raises:
            ValueError: an unknown family; the message lists the valid ones.
        """
        metrics = SPECTRAL_METRICS[:6] if metrics is None else metrics
        out: dict[str, float] = {}
        for metric in metrics:
            if metric == "variance_ratio":
                out.update({f"{prefix}variance_ratio_{k}": float(v) for k, v in self.variance_ratio.items()})
            elif metric == "tail_error":
                out.update({f"{prefix}tail_error_k{k}": float(v) for k, v in self.tail_error.items()})
            elif metric == "alpha":
                fit = self.power_law_fit()
                values = (fit.alpha, fit.ks_distance)
                out.update({f"{prefix}{key}": float(v) for key, v in zip(_ALPHA_KEYS, values)})
            else:
                name = check_choice("metric", metric, SPECTRAL_METRICS)
                out[f"{prefix}{name}"] = float(getattr(self, name))
        return out


def summarize(
    spec: Spectrum,
    *,
    rank_tolerance: float | None = None,
    tolerance_size: Literal["min", "max"] = "min",
    soft_rank_tau: float = 0.5,
    variance_ratio_ks: Sequence[int] = (1, 10),
    tail_ranks: Sequence[int] = (),
    alpha_req_range: tuple[int, int | None] = (1, None),
) -> SpectralSummary:
    """Every metric of :data:`SPECTRAL_METRICS` of one spectrum (``alpha`` when first asked for,
    :meth:`SpectralSummary.power_law_fit`).

    Args:
        spec: the spectrum (a NaN spectrum gives NaN metrics).
        rank_tolerance: relative tolerance ``eps`` of the numerical rank; ``None`` for
            :func:`~rank_lightning.functional.default_rank_tolerance` (``finfo(float32).eps * K``, Feng et al. eq. 4).
        tolerance_size: ``K`` of the default tolerance: ``"min"`` (Feng) or ``"max"`` (NumPy, WeightWatcher) of the
            matrix's two sizes.
        soft_rank_tau: threshold of the soft rank.
        variance_ratio_ks: the ``k`` of the ``VR_k`` scalars.
        tail_ranks: the ``k`` of the tail errors.
        alpha_req_range: ``(first_index, last_index)`` of the alpha-ReQ fit (1-based ranks, ``None``: the last
            numerically non-zero one).
    """
    check_positive("rank_tolerance", rank_tolerance, allow_none=True)
    check_choice("tolerance_size", tolerance_size, ("min", "max"))
    check_positive("soft_rank_tau", soft_rank_tau)
    variance_ratio_ks = check_positive_ints("variance_ratio_ks", variance_ratio_ks, allow_empty=True)
    tail_ranks = check_positive_ints("tail_ranks", tail_ranks, allow_empty=True)
    first_index, last_index = check_alpha_req_range(alpha_req_range)
    return SpectralSummary(
        spectrum=spec,
        numerical_rank=numerical_rank(spec, rank_tolerance=rank_tolerance, tolerance_size=tolerance_size),
        soft_rank=soft_rank(spec, tau=soft_rank_tau),
        participation_ratio=participation_ratio(spec),
        stable_rank=stable_rank(spec),
        effective_rank=effective_rank(spec),
        spectral_norm=singular_values(spec)[0],
        variance_ratio={k: variance_ratio(spec, k) for k in variance_ratio_ks},
        variance_ratio_curve=variance_ratio(spec),
        tail_error={k: tail_error(spec, k) for k in tail_ranks},
        alpha_req=alpha_req(spec, first_index=first_index, last_index=last_index),
    )


def check_alpha_req_range(index_range: tuple[int, int | None]) -> tuple[int, int | None]:
    """``(first_index, last_index)`` of an alpha-ReQ fit, checked: a pair of 1-based ranks with ``last_index >
    first_index``, or ``last_index=None`` (the last numerically non-zero rank).

    Raises:
        ValueError: anything else, naming the value.
    """
    if not isinstance(index_range, (tuple, list)) or len(index_range) != 2:
        raise ValueError(f"alpha_req_range must be a pair (first_index, last_index), got {index_range!r}")
    first, last = index_range
    check_positive_int("alpha_req_range first_index", first)
    check_positive_int("alpha_req_range last_index", last, allow_none=True)
    if last is not None and last <= first:
        raise ValueError(f"alpha_req_range must have last_index > first_index, got {index_range!r}")
    return int(first), None if last is None else int(last)
