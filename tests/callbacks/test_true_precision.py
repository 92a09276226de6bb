"""The monitors under the Trainer's and torch's precision settings: true half precision (``"bf16-true"``,
``"16-true"``), ``torch.set_float32_matmul_precision`` and torch's newer ``fp32_precision`` flags."""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader
from transformers import GPT2Config, GPT2LMHeadModel

from rank_lightning.callbacks import ActivationRankMonitor, RankPretraining, WeightRankMonitor
from rank_lightning.functional.streaming import gram_product_dtype
from tests.callbacks.trainer_helpers import SmallClassifier, quiet_trainer, small_loader

NEW_FLAGS = hasattr(torch.backends.cuda.matmul, "fp32_precision")  # torch >= 2.9


@pytest.fixture
def matmul_flags() -> Iterator[None]:
    """Restores torch's float32 product settings (global state) after the test: ``set_float32_matmul_precision`` sets
    every backend's flag, so that the older ``allow_tf32`` flag can be read again."""
    saved = torch.get_float32_matmul_precision()
    yield
    torch.set_float32_matmul_precision(saved)


def _validate(tmp_path, gram_precision: str) -> dict[str, float]:
    monitor = ActivationRankMonitor(layers=["net.0"], gram_precision=gram_precision, num_classes=None, verbose=False)
    trainer = quiet_trainer([monitor], default_root_dir=tmp_path / gram_precision)
    (results,) = trainer.validate(SmallClassifier((5, 12, 3), seed=0), small_loader(64), verbose=False)
    return {key: float(value) for key, value in results.items()}


@pytest.mark.skipif(not NEW_FLAGS, reason="torch before 2.9 has no fp32_precision flags")
def test_tf32_gram_products_run_where_the_program_set_the_newer_fp32_precision_flag(tmp_path, matmul_flags):
    # torch raises on reading the older allow_tf32 flag once a program has set the newer one (as torch advises).
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    results = _validate(tmp_path, "tf32")
    assert torch.backends.cuda.matmul.fp32_precision == "tf32"  # the program's setting, restored
    # On a CPU "tf32" is "float32".
    assert results == _validate(tmp_path, "float32")
    assert results["rank/net.0/spectrum_rows"] == 64


def test_float32_gram_products_are_ieee_float32_whatever_the_matmul_precision(tmp_path, matmul_flags):
    exact = _validate(tmp_path / "highest", "float32")
    torch.set_float32_matmul_precision("medium")  # TF32 on CUDA, bfloat16-based oneDNN products on a CPU
    with gram_product_dtype("float32") as dtype:
        assert dtype == torch.float32
        if NEW_FLAGS:
            assert torch.backends.cuda.matmul.fp32_precision == "ieee"
            assert torch.backends.mkldnn.matmul.fp32_precision == "ieee"
        else:
            assert torch.backends.cuda.matmul.allow_tf32 is False
    assert torch.get_float32_matmul_precision() == "medium"  # the model's own products keep the program's setting
    assert _validate(tmp_path / "medium", "float32") == exact


class _LanguageModel(pl.LightningModule):
    """A 2-block GPT-2 of width 32 with random weights, trained by SGD on its own tokens."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        config = GPT2Config(
            n_layer=2, n_embd=32, n_head=2, vocab_size=50, n_positions=16, bos_token_id=0, eos_token_id=0
        )
        self.model = GPT2LMHeadModel(config)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return self.model(**batch, labels=batch["input_ids"]).loss

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self.model(**batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _Record(pl.Callback):
    """The training losses, and the outputs of block 0 in the last validation pass."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.outputs: list[Tensor] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))

    def on_validation_start(self, trainer, pl_module) -> None:
        self.outputs.clear()

        def hook(module: nn.Module, args: Any, out: Any) -> None:
            self.outputs.append((out[0] if isinstance(out, tuple) else out).detach())  # 4.x tuples, 5.x tensors

        self._handle = pl_module.model.transformer.h[0].register_forward_hook(hook)

    def on_validation_end(self, trainer, pl_module) -> None:
        self._handle.remove()


def _gpt2_fit(tmp_path, monitors: list) -> tuple[_Record, dict[str, float]]:
    ids = torch.randint(0, 50, (16, 16), generator=torch.Generator().manual_seed(0))
    loader = DataLoader([{"input_ids": row, "attention_mask": torch.ones(16, dtype=torch.int64)} for row in ids], 8)
    record = _Record()
    trainer = quiet_trainer([*monitors, record], max_epochs=1, precision="bf16-true", default_root_dir=tmp_path)
    trainer.fit(_LanguageModel(), loader, loader)
    return record, {key: float(value) for key, value in trainer.callback_metrics.items()}


@pytest.mark.parametrize("tolerance_dtype", [None, "input"])
def test_a_bf16_true_gpt2_is_measured_from_float64_sums_of_its_bf16_outputs_and_trains_as_unmonitored(
    tmp_path, tolerance_dtype
):
    block = "model.transformer.h.0"
    monitors = [
        ActivationRankMonitor(layers=[block], tolerance_dtype=tolerance_dtype, verbose=False),
        WeightRankMonitor(layers=[f"{block}.mlp.c_fc"], tolerance_dtype=tolerance_dtype, verbose=False),
    ]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        record, logged = _gpt2_fit(tmp_path / "monitored", monitors)
    advice = [str(w.message) for w in caught if "tolerance_dtype='input'" in str(w.message)]
    # The float32 rule on bf16 outputs and bf16 weights is named, once each, with what to set.
    assert len(advice) == (2 if tolerance_dtype is None else 0), advice
    assert record.losses == _gpt2_fit(tmp_path / "plain", [])[0].losses  # the fit is the unmonitored one

    rows = torch.cat(record.outputs).reshape(-1, 32)
    assert rows.dtype == torch.bfloat16 and rows.shape == (256, 32)
    squares = torch.linalg.svdvals(rows.double()).square()  # an independent float64 spectrum of the bf16 outputs
    assert logged[f"rank/{block}/token/stable_rank"] == pytest.approx(float(squares.sum() / squares[0]), rel=1e-12)
    assert logged[f"rank/{block}/token/variance_ratio_1"] == pytest.approx(float(squares[0] / squares.sum()), rel=1e-12)
    # The block's outputs are full rank above both rules; the weights of c_fc (64 x 32) likewise.
    assert logged[f"rank/{block}/token/numerical_rank"] == 32
    assert logged[f"weight/{block}.mlp.c_fc/numerical_rank"] == 32


class _Overflowing(SmallClassifier):
    """Under ``"16-true"`` the first layer's outputs (about 1e5) pass float16's 65504: Inf, which the Tanh after it
    takes back to +-1."""

    def __init__(self) -> None:
        super().__init__((5, 12, 3), lr=0.0, activation=nn.Tanh, seed=0)
        with torch.no_grad():
            self.net[0].weight.mul_(3e4)  # entries up to 1.3e4: finite float16 weights

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.net(batch[0] * 10)


def test_float16_activations_beyond_its_range_log_nan_for_their_layer_alone(tmp_path):
    monitor = ActivationRankMonitor(
        layers=["net.0", "net.2"], metrics=["numerical_rank"], tolerance_dtype="input", verbose=False
    )
    trainer = quiet_trainer([monitor], precision="16-true", default_root_dir=tmp_path)
    with pytest.warns(RuntimeWarning, match=r"layer 'net.0' gave NaN or Inf activations in 8 batch\(es\)"):
        (results,) = trainer.validate(_Overflowing(), small_loader(64), verbose=False)
    assert math.isnan(results["rank/net.0/numerical_rank"])
    assert results["rank/net.2/numerical_rank"] == 3
    module = trainer.lightning_module
    assert module.net[0].weight.dtype == torch.float16
    weights = WeightRankMonitor(metrics=["numerical_rank"], tolerance_dtype="input", verbose=False)
    assert weights.measure(module)["net.0"]["numerical_rank"] == 5  # large finite float16 weights, measured as they are


@pytest.mark.parametrize(("precision", "dtype"), [("bf16-true", torch.bfloat16), ("16-true", torch.float16)])
def test_rank_pretraining_feeds_its_batches_in_the_weights_dtype(tmp_path, precision, dtype):
    # Its passes over the training batches take them as the steps do (the precision plugin casts the inputs), not as
    # the loader gives them: float32 inputs to bf16 / fp16 weights stopped the fit before its first step.
    callback = RankPretraining(num_batches=2, steps=2, verbose=False)
    trainer = quiet_trainer([callback], max_steps=1, precision=precision, default_root_dir=tmp_path)
    module = SmallClassifier((5, 12, 12, 3), seed=0)
    trainer.fit(module, small_loader(32))
    assert module.net[0].weight.dtype == dtype
    assert set(callback.results) == {"net.4_input"}  # the input of the last Linear
    before, after = callback.results["net.4_input"]["r_before"], callback.results["net.4_input"]["r_after"]
    assert 1 <= before < after <= 8  # r(H) of 8 rows, raised by the ascent
