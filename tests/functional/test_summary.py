import math

import numpy as np
import pytest
import torch

import rank_lightning.functional as F
from rank_lightning.functional.spectral import SPECTRAL_METRICS, SpectralSummary, spectral_metric_keys, summarize


def _matrix(n: int = 80, d: int = 12, seed: int = 0) -> torch.Tensor:
    # A spectrum falling by decades, so that rank tolerances and soft-rank thresholds cut in different places.
    rng = np.random.default_rng(seed)
    u, _ = np.linalg.qr(rng.standard_normal((n, d)))
    v, _ = np.linalg.qr(rng.standard_normal((d, d)))
    s = np.array([30, 10, 3, 1, 0.3, 0.1, 1e-2, 1e-3, 1e-4, 1e-5, 1e-7, 0.0])
    return torch.from_numpy(u @ np.diag(s) @ v.T)


def _reference(x: torch.Tensor, ks: tuple[int, ...], tails: tuple[int, ...], tau: float, eps: float) -> dict:
    s = np.linalg.svd(x.numpy(), compute_uv=False)
    n = x.shape[0]
    s2 = s**2
    p = s / s.sum()
    p = p[p > 0]
    return {
        "numerical_rank": float((s >= eps * s[0]).sum()),
        "soft_rank": float((s2 / n >= tau).sum()),
        "participation_ratio": s2.sum() ** 2 / (s2**2).sum(),
        "stable_rank": s2.sum() / s2[0],
        "effective_rank": math.exp(-(p * np.log(p)).sum()),
        "spectral_norm": s[0],
        "variance_ratio": {k: s2[:k].sum() / s2.sum() for k in ks},
        "tail_error": {k: math.sqrt(s2[k:].sum() / s2.sum()) for k in tails},
        "curve": np.cumsum(s2) / s2.sum(),
    }


@pytest.mark.parametrize(
    ("kwargs", "eps"),
    [
        ({}, np.finfo(np.float32).eps * 12),
        ({"tolerance_size": "max"}, np.finfo(np.float32).eps * 80),
        ({"rank_tolerance": 1e-3}, 1e-3),
    ],
)
def test_summarize_matches_numpy(kwargs: dict, eps: float) -> None:
    x = _matrix()
    summary = summarize(F.spectrum(x), soft_rank_tau=0.01, variance_ratio_ks=(1, 3, 20), tail_ranks=(2, 5), **kwargs)
    ref = _reference(x, (1, 3, 20), (2, 5), tau=0.01, eps=eps)
    assert isinstance(summary, SpectralSummary)
    assert int(summary.numerical_rank) == ref["numerical_rank"]
    assert int(summary.soft_rank) == ref["soft_rank"]
    for name in ("participation_ratio", "stable_rank", "effective_rank", "spectral_norm"):
        assert float(getattr(summary, name)) == pytest.approx(ref[name], rel=1e-10), name
    assert summary.variance_ratio.keys() == {1, 3, 20} and summary.tail_error.keys() == {2, 5}
    for k, value in ref["variance_ratio"].items():
        assert float(summary.variance_ratio[k]) == pytest.approx(value, rel=1e-12)
    for k, value in ref["tail_error"].items():
        assert float(summary.tail_error[k]) == pytest.approx(value, rel=1e-9)
    np.testing.assert_allclose(summary.variance_ratio_curve.numpy(), ref["curve"], rtol=1e-12)


def test_the_tolerances_give_different_ranks() -> None:
    # eps32 * 12 * 30 = 4.3e-5 keeps down to 1e-4; 1e-3 * 30 keeps down to 0.1; eps32 * 2000 * 30 = 7e-3 down to 1e-2.
    tall = F.spectrum(_matrix(n=2000))
    assert int(summarize(tall).numerical_rank) == 9
    assert int(summarize(tall, rank_tolerance=1e-3).numerical_rank) == 6
    assert int(summarize(tall, tolerance_size="max").numerical_rank) == 7
    assert int(summarize(F.spectrum(_matrix(n=12)), tolerance_size="max").numerical_rank) == 9


def test_as_dict_keys_and_values() -> None:
    summary = summarize(F.spectrum(_matrix()), variance_ratio_ks=(1, 10), tail_ranks=(3,))
    default = summary.as_dict()
    assert list(default) == [
        "numerical_rank",
        "soft_rank",
        "participation_ratio",
        "stable_rank",
        "effective_rank",
        "variance_ratio_1",
        "variance_ratio_10",
    ]
    assert all(isinstance(v, float) for v in default.values())
    assert default["numerical_rank"] == float(summary.numerical_rank)
    assert default["variance_ratio_10"] == float(summary.variance_ratio[10])
    chosen = summary.as_dict(["tail_error", "spectral_norm", "stable_rank"], prefix="centered_")
    assert chosen == {
        "centered_tail_error_k3": float(summary.tail_error[3]),
        "centered_spectral_norm": float(summary.spectrum.singular_values[0]),
        "centered_stable_rank": float(summary.stable_rank),
    }
    assert list(chosen) == ["centered_tail_error_k3", "centered_spectral_norm", "centered_stable_rank"]
    with pytest.raises(ValueError, match="unknown metric 'rank'; valid choices are: numerical_rank, soft_rank"):
        summary.as_dict(["rank"])


def test_spectral_metric_keys_name_what_as_dict_gives() -> None:
    summary = summarize(F.spectrum(_matrix()), variance_ratio_ks=(2, 4), tail_ranks=(1, 6))
    for metrics in (SPECTRAL_METRICS, ("tail_error", "numerical_rank", "variance_ratio"), ("spectral_norm",)):
        keys = spectral_metric_keys(metrics, variance_ratio_ks=(2, 4), tail_ranks=(1, 6))
        assert keys == list(summary.as_dict(metrics))
    assert spectral_metric_keys(("variance_ratio", "tail_error", "soft_rank")) == ["soft_rank"]
    assert spectral_metric_keys(("tail_error",), tail_ranks=(8,)) == ["tail_error_k8"]


def test_non_finite_spectrum_gives_nan_scalars() -> None:
    x = _matrix()
    x[3, 4] = math.nan
    with pytest.warns(RuntimeWarning, match="NaN or Inf"):
        spec = F.spectrum(x)
    values = summarize(spec, tail_ranks=(2,)).as_dict(SPECTRAL_METRICS)
    assert values and all(math.isnan(v) for v in values.values())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"rank_tolerance": 0.0}, "rank_tolerance must be a positive number or None, got 0.0"),
        ({"tolerance_size": "mid"}, "unknown tolerance_size 'mid'; valid choices are: min, max"),
        ({"soft_rank_tau": -1.0}, "soft_rank_tau must be a positive number, got -1.0"),
        ({"variance_ratio_ks": (0, 2)}, r"variance_ratio_ks must be positive integers, got \(0, 2\)"),
        ({"tail_ranks": (1.5,)}, r"tail_ranks must be positive integers, got \(1.5,\)"),
    ],
)
def test_summarize_rejects_bad_arguments(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        summarize(F.spectrum(_matrix()), **kwargs)
