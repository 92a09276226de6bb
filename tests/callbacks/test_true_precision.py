"""The monitors under the Trainer's and torch's precision settings: true half precision (``"bf16-true"``,
``"16-true"``), ``torch.set_float32_matmul_precision`` and torch's newer ``fp32_precision`` flags."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from rank_lightning.callbacks import ActivationRankMonitor
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
