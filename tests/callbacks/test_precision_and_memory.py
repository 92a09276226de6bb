"""Mixed-precision fits (bf16 activations, float64 sums, the tolerance of the activations' dtype) and the total memory
budget of ActivationRankMonitor."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from torch import nn

from rank_lightning.callbacks import ActivationRankMonitor
from rank_lightning.functional.streaming import reduced_float32_format
from rank_lightning.streams import reduced_precision
from tests.callbacks.trainer_helpers import quiet_trainer

WIDTH, RANK, INPUTS = 32, 4, 16


class _LowRank(pl.LightningModule):
    """``low``: a bias-free layer whose weight has rank 4, equal singular values; ``wide_a``, ``wide_b``: 256 wide."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        left = torch.linalg.qr(torch.randn(WIDTH, RANK, generator=g)).Q
        right = torch.linalg.qr(torch.randn(INPUTS, RANK, generator=g)).Q
        self.low = nn.Linear(INPUTS, WIDTH, bias=False)
        self.wide_a = nn.Linear(WIDTH, 256)
        self.wide_b = nn.Linear(256, 256)
        with torch.no_grad():
            self.low.weight.copy_(left @ right.T)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wide_b(torch.relu(self.wide_a(self.low(x))))

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self(batch[0])


def _loader(n: int = 256) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(n, INPUTS, generator=g), torch.zeros(n, dtype=torch.int64))
    return torch.utils.data.DataLoader(data, batch_size=64)


def _validate(tmp_path: Path, monitor: ActivationRankMonitor, **options: Any) -> dict[str, float]:
    trainer = quiet_trainer([monitor], default_root_dir=tmp_path, **options)
    (results,) = trainer.validate(_LowRank(), _loader(), verbose=False)
    return {key: float(value) for key, value in results.items()}


@pytest.mark.parametrize(("tolerance_dtype", "expected"), [(None, WIDTH), ("input", RANK)])
def test_a_bf16_mixed_fit_counts_rounding_noise_only_with_a_float32_tolerance(tmp_path, tolerance_dtype, expected):
    monitor = ActivationRankMonitor(
        layers=["low"], metrics=["numerical_rank"], tolerance_dtype=tolerance_dtype, verbose=False
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = _validate(tmp_path, monitor, precision="bf16-mixed")
    advice = [str(w.message) for w in caught if "tolerance_dtype='input'" in str(w.message)]
    # The float32 tolerance on bf16 activations is named, once, with what to set; the bf16 one needs no advice.
    assert len(advice) == (1 if tolerance_dtype is None else 0), advice
    assert not advice or "computed in bfloat16" in advice[0]

    # Under autocast the layer computes in bf16: its rank-4 output carries rounding noise of about 4e-3 s_1, which
    # the float32 tolerance (about 4e-6 s_1) counts as rank and the bf16 one (eps_bf16 = 7.8e-3) does not.
    assert results["rank/low/numerical_rank"] == expected
    metric = monitor._stream.metrics["low"]
    assert metric.gram.dtype == torch.float64 and metric.feature_sum.dtype == torch.float64
    float32 = ActivationRankMonitor(layers=["low"], metrics=["numerical_rank"], verbose=False)
    assert _validate(tmp_path / "float32", float32)["rank/low/numerical_rank"] == RANK  # no noise in float32


def test_layers_beyond_the_memory_budget_take_the_fallback_and_the_plan_is_printed(tmp_path, callback_messages):
    # wide_a's 256 x 256 float64 Gram is 0.5 MiB; wide_b finds 0.1 MiB left and keeps a subsample within it.
    monitor = ActivationRankMonitor(layers=["wide_a", "wide_b"], memory_budget_mb=0.6, num_classes=None)
    # 256 features are within max_gram_features: the budget is the reason, and the warning says so.
    with pytest.warns(
        UserWarning,
        match=r"layer 'wide_b' has 256 features, whose 256 x 256 Gram does not fit in its "
        r"share of memory_budget_mb; its spectrum comes from the 'sample_gram' path",
    ):
        results = _validate(tmp_path, monitor)

    # The metrics are reset after the pass (their width is learnt again from the next one): ask for d = 256.
    paths = {name: metric.path_for(256) for name, metric in monitor._stream.metrics.items()}
    assert paths == {"wide_a": "gram", "wide_b": "sample_gram"}
    planned = sum(metric.planned_bytes(256) for metric in monitor._stream.metrics.values())
    assert planned <= 0.6 * 2**20
    assert results["rank/wide_a/spectrum_rows"] == 256
    assert results["rank/wide_b/spectrum_rows"] < 256
    assert any(message.startswith("ActivationRankMonitor: state of 2 layers:") for message in callback_messages)


def test_a_layer_that_cannot_fit_the_budget_is_named_before_anything_is_allocated(tmp_path):
    monitor = ActivationRankMonitor(layers=["wide_a", "wide_b"], memory_budget_mb=0.001, verbose=False)
    with pytest.raises(MemoryError, match=r"layer 'wide_a' \(256 features\) needs .* memory_budget_mb=0.001"):
        _validate(tmp_path, monitor)


class _Trained(_LowRank):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.steps = getattr(self, "steps", 0) + 1
        return self(batch[0]).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class _Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(INPUTS, INPUTS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.inner(x)  # float32 + bf16 under autocast: a float32 output carrying bf16 rounding


class _ResidualNet(_LowRank):
    def __init__(self) -> None:
        super().__init__()
        self.block = _Residual()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(self.block(x))


@pytest.mark.parametrize(
    ("options", "advice"),
    [
        ({}, "tolerance_dtype=torch.bfloat16"),
        ({"tolerance_dtype": "input"}, "so tolerance_dtype='input' found float32 outputs, but"),
        ({"tolerance_dtype": torch.float32}, None),
        ({"rank_tolerance": 1e-3}, None),
    ],
)
def test_float32_outputs_of_a_layer_run_under_bf16_autocast_name_the_bf16_tolerance(tmp_path, options, advice):
    monitor = ActivationRankMonitor(layers=["block"], metrics=["numerical_rank"], verbose=False, **options)
    trainer = quiet_trainer([monitor], default_root_dir=tmp_path, precision="bf16-mixed")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.validate(_ResidualNet(), _loader(), verbose=False)
    named = [str(w.message) for w in caught if "float32 tolerance" in str(w.message)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert _Residual()(torch.randn(2, INPUTS)).dtype == torch.float32  # "input" would find float32's tolerance
    if advice is None:
        assert named == []  # an explicit tolerance is the user's choice
    else:
        assert len(named) == 1 and "ran under bfloat16 autocast" in named[0] and advice in named[0], named


class _Frozen(_Trained):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true", "64-true"])
@pytest.mark.parametrize("cadence", [{}, {"every_n_train_steps": 2, "window_batches": 1}])
def test_the_initial_point_is_measured_in_the_precision_the_steps_run_in(tmp_path, cadence, precision):
    """The untrained model's point is comparable with the later ones: measured as the steps run (bf16 autocast, inputs
    cast to bf16 or float64 weights), not in float32, and not dropped for inputs of another dtype than the weights.

    With a learning rate of 0 nothing changes between the points; bf16's rounding noise is counted as rank by the
    float32 tolerance (``WIDTH``) wherever the layer computed in bf16, and a float64 pass shows the true ``RANK``.
    """
    monitor = ActivationRankMonitor(layers=["low"], metrics=["numerical_rank"], verbose=False, **cadence)
    trainer = quiet_trainer([monitor], default_root_dir=tmp_path, max_epochs=1, precision=precision)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(_Frozen(), _loader(), _loader())
    assert not [w for w in caught if "no initial point" in str(w.message)]
    history = monitor.curves.history
    assert len(history) == (3 if cadence else 2)  # the initial point, then the windows or the epoch
    expected = RANK if precision == "64-true" else WIDTH
    assert [values["low"]["numerical_rank"] for values in history.values()] == [expected] * len(history)


@pytest.mark.parametrize("cadence", [{"every_n_epochs": 2}, {"every_n_train_steps": 3}])
def test_a_budget_too_small_fails_before_training_without_an_initial_point(tmp_path, cadence):
    # With log_at_init=False the first monitored batch planned the states: a whole epoch (or window) of training
    # came first.
    monitor = ActivationRankMonitor(layers=["wide_b"], memory_budget_mb=0.001, log_at_init=False, **cadence)
    model = _Trained()
    trainer = quiet_trainer([monitor], default_root_dir=tmp_path, max_epochs=2)
    with pytest.raises(MemoryError, match=r"layer 'wide_b' \(256 features\) needs .* more than all of the memory_bud"):
        trainer.fit(model, _loader(), _loader(64))
    assert getattr(model, "steps", 0) == 0


def test_without_an_initial_point_a_layer_only_the_steps_run_is_not_named_before_training(tmp_path):
    class _Side(_Trained):
        def __init__(self) -> None:
            super().__init__()
            self.side = nn.Linear(INPUTS, 3)

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.side(batch[0])
            self(batch[0])

    monitor = ActivationRankMonitor(layers=["wide_a", "side"], log_at_init=False, num_classes=None, verbose=False)
    trainer = quiet_trainer([monitor], default_root_dir=tmp_path, max_epochs=1)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*was not called")
        trainer.fit(_Side(), _loader(), _loader(64))
    assert set(monitor.curves.history[0]) == {"wide_a", "side"}


class _Stack(pl.LightningModule):
    """``layers.0`` .. ``layers.5``: six 64 x 64 layers with tanh between them."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self(batch[0])


@pytest.mark.filterwarnings("ignore:.*does not fit in its share of memory_budget_mb")
def test_fallback_layers_share_the_budget_evenly_and_a_larger_budget_never_gives_fewer_rows(tmp_path):
    # 64 features > max_gram_features: every layer keeps a subsample, sized to its budget. A subsample fills what it is
    # given, so the first layers once took all that was left: later layers got fewer rows (a rank drop with depth
    # made by the budget) or none (MemoryError at 0.23 MiB, where 0.15 MiB ran).
    g = torch.Generator().manual_seed(2)
    data = torch.utils.data.TensorDataset(torch.randn(256, 64, generator=g), torch.zeros(256, dtype=torch.int64))
    rows = {}
    for budget in (0.26, 0.25, 0.23, 0.15):
        monitor = ActivationRankMonitor(
            layers=["layers.*"], max_gram_features=48, memory_budget_mb=budget, num_classes=None, verbose=False
        )
        trainer = quiet_trainer([monitor], default_root_dir=tmp_path / str(budget))
        (results,) = trainer.validate(_Stack(), torch.utils.data.DataLoader(data, batch_size=64), verbose=False)
        rows[budget] = [int(results[f"rank/layers.{i}/spectrum_rows"]) for i in range(6)]
        assert max(rows[budget]) - min(rows[budget]) <= 1, rows
        planned = sum(metric.planned_bytes(64) for metric in monitor._stream.metrics.values())
        assert planned <= budget * 2**20
    assert rows[0.26] == [48] * 6
    assert min(rows[0.26]) >= max(rows[0.25]) and min(rows[0.25]) >= max(rows[0.23]) >= max(rows[0.15]) > 0


@pytest.fixture
def float32_flags():
    """Torch's float32 precision flags, restored after the test."""
    matmul, conv = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    yield
    torch.set_float32_matmul_precision(matmul)
    torch.backends.cudnn.allow_tf32 = conv


def test_the_reduced_float32_products_torchs_flags_allow_are_read(float32_flags):
    torch.set_float32_matmul_precision("highest")
    assert reduced_float32_format("cuda", conv=True) == "tf32"  # cuDNN's default
    assert reduced_float32_format("cuda", conv=False) is None and reduced_float32_format("cpu", conv=False) is None
    torch.backends.cudnn.allow_tf32 = False
    assert reduced_float32_format("cuda", conv=True) is None
    torch.set_float32_matmul_precision("high")  # what Lightning advises on GPUs with tensor cores
    assert reduced_float32_format("cuda", conv=False) == "tf32" and reduced_float32_format("cpu", conv=False) is None
    torch.set_float32_matmul_precision("medium")
    assert reduced_float32_format("cpu", conv=False) == "bf16"
    assert reduced_precision(torch.zeros(2, 3, dtype=torch.float64), conv=False) is None  # float64 products
    dtype, how = reduced_precision(torch.zeros(2, 3), conv=False)
    assert dtype == torch.bfloat16 and "BF16 products" in how and "mkldnn.matmul" in how


@pytest.mark.parametrize(("precision", "advice"), [("medium", "tolerance_dtype=torch.bfloat16"), ("highest", None)])
def test_float32_outputs_of_reduced_precision_products_name_the_half_precision_tolerance(
    tmp_path, float32_flags, precision, advice
):
    torch.set_float32_matmul_precision(precision)
    monitor = ActivationRankMonitor(layers=["low"], metrics=["numerical_rank"], verbose=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _validate(tmp_path, monitor)
    named = [str(w.message) for w in caught if "float32 tolerance" in str(w.message)]
    if advice is None:
        assert named == []
    else:
        assert len(named) == 1 and "were computed with BF16 products in float32" in named[0] and advice in named[0]
