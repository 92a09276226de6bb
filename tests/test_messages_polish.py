"""The wording of counts, sizes and batch places in the package's messages: one count reads "1 layer", not "1 layers";
a size in MiB is printed as the memory plan prints it; a tuple batch is told of its index, a dict batch of its keys."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from rank_lightning.callbacks import (
    ActivationRankMonitor,
    JacobianRankMonitor,
    NeuralCollapseMonitor,
    WeightRankMonitor,
)
from rank_lightning.callbacks.curves import LayerCurves
from rank_lightning.functional.streaming import group_by_class
from rank_lightning.layers import BatchReader
from rank_lightning.metrics import ActivationSpectrum
from rank_lightning.metrics.neural_collapse import check_neural_collapse_memory
from rank_lightning.validation import count_of, mib_text
from tests.callbacks.trainer_helpers import SmallClassifier, quiet_trainer


def test_counts_and_sizes_are_printed_by_one_helper_each() -> None:
    assert [count_of(n, "layer") for n in (0, 1, 2)] == ["0 layers", "1 layer", "2 layers"]
    assert count_of(1, "weight matrix", "weight matrices") == "1 weight matrix"
    assert count_of(5, "weight matrix", "weight matrices") == "5 weight matrices"
    assert count_of(1, "class", "classes") == "1 class" and count_of(3, "class", "classes") == "3 classes"
    assert [mib_text(size * 2**20) for size in (0.000694, 42.71, 99.94, 2002, 98410.24)] == [
        "0.000694",
        "42.7",
        "99.9",
        "2002.0",
        "98410.2",
    ]


def test_setup_messages_of_one_layer_say_one_layer(tmp_path, callback_messages) -> None:
    torch.manual_seed(0)
    x, y = torch.randn(16, 5), torch.randint(0, 3, (16,))
    loader = DataLoader(TensorDataset(x, y), batch_size=8)
    monitors = [
        ActivationRankMonitor(layers=["net.0"], num_classes=3, memory_budget_mb=1),
        WeightRankMonitor(layers=["net.0"]),
        JacobianRankMonitor(layers=["net.0"], num_inputs=1),
    ]
    quiet_trainer(monitors, max_epochs=1, default_root_dir=tmp_path).fit(SmallClassifier((5, 4, 3)), loader, loader)
    assert callback_messages == [
        "ActivationRankMonitor: monitoring 1 layer, 3 classes: net.0",
        "WeightRankMonitor: monitoring 1 weight matrix: net.0",
        "JacobianRankMonitor: 1 block, 1 input, patch central, default size: net.0",
        # One layer: its size is the total, no "largest" to name.
        "ActivationRankMonitor: state of 1 layer: 0.000694 MiB of a 1 MiB budget on cpu; per-batch temporary up to "
        "0.000244 MiB ('net.0'); class Grams (class-wise VR) of 'net.0'",
    ]
    mask = JacobianRankMonitor(layers=["net.0"], patch=torch.tensor([True, False, False]))
    assert mask._patch_text() == "a mask of 1 coordinate"
    assert JacobianRankMonitor(layers=["net.0"], patch=torch.tensor([2]))._patch_text() == "1 flat index"


def test_a_count_of_one_in_errors_and_warnings_is_singular() -> None:
    curves = LayerCurves("rank")
    curves.record(0, {"a": {"m": 1.0}})
    with pytest.raises(RuntimeError, match=re.escape("LayerCurves('rank') holds 1 trained point keyed by epoch;")):
        curves.key_by_step()
    with pytest.raises(ValueError, match="labels are grouped into 1 class, not 4"):
        ActivationSpectrum(num_classes=4).update(torch.randn(8, 5), group_by_class(torch.zeros(8, dtype=torch.long), 1))


def test_a_batch_is_told_where_its_own_type_is_looked_in() -> None:
    x, soft = torch.ones(2, 3), torch.ones(2)
    keys = "one of ['y', 'label', 'labels', 'target', 'targets']"
    found = "(found a Tensor torch.float32 of shape (2,): float values, not class indices)"
    assert BatchReader().label_source((x, soft)) == f"index 1 in a tuple batch of length 2 {found}"
    assert BatchReader().label_source({"x": x, "y": soft}) == f"{keys} in a dict batch with keys ['x', 'y'] {found}"
    with pytest.raises(ValueError, match=re.escape("cannot find the inputs at index 0 in a list batch of length 1;")):
        BatchReader().inputs([None])
    keys = "one of ['x', 'input', 'inputs', 'image', 'images', 'pixel_values', 'input_ids']"
    with pytest.raises(ValueError, match=re.escape(f"the inputs at {keys} in a dict batch with keys ['a'];")):
        BatchReader().inputs({"a": None})


def test_memory_errors_print_sizes_as_the_memory_plan_does() -> None:
    message = (
        "neural collapse of 50257 classes of 16 features with top_classes=None plans 96393.3 MiB (96350.3 MiB of it "
        "for the 50257 x 50257 class pairs of NC2 and the CDNV), more than memory_budget_mb=4096; set top_classes to "
        "measure the K most frequent classes only (top_classes=8192 plans 2587.5 MiB), or raise memory_budget_mb"
    )
    with pytest.raises(MemoryError, match=f"^{re.escape(message)}$"):
        check_neural_collapse_memory(50257, 16, None, 4096)
    with pytest.raises(MemoryError, match=re.escape("neural collapse of 3 classes of 1 feature with top_classes=None")):
        check_neural_collapse_memory(3, 1, None, 1e-9)


def test_top_classes_says_in_which_pass_the_classes_are_counted() -> None:
    doc = " ".join(NeuralCollapseMonitor.__doc__.split())
    assert "their samples counted in the first of each measurement's two passes" in doc


def _fit_warnings(tmp_path, monitor, loader, part: str, model: pl.LightningModule | None = None) -> list[str]:
    """The warnings holding ``part`` of a one-epoch fit of ``model`` (a small classifier by default) with ``monitor``,
    trained and validated on ``loader``."""
    model = SmallClassifier((5, 4, 3)) if model is None else model
    with pytest.warns(UserWarning) as caught:
        quiet_trainer([monitor], max_epochs=1, default_root_dir=tmp_path).fit(model, loader, loader)
    return [str(warning.message) for warning in caught if part in str(warning.message)]


def test_one_batch_and_one_row_are_singular(tmp_path) -> None:
    monitor = ActivationRankMonitor(layers=["net.0"], every_n_train_steps=1, window_batches=2)
    with pytest.raises(ValueError, match=re.escape("window_batches=2 exceeds the 1 training batch between two")):
        monitor.cadence.check_window(SimpleNamespace(accumulate_grad_batches=1), True)
    torch.manual_seed(0)
    loader = DataLoader(TensorDataset(torch.randn(16, 5), torch.randint(0, 3, (16,))), batch_size=8)
    monitor = ActivationRankMonitor(layers=["net.0"], max_samples=1, verbose=False)
    assert _fit_warnings(tmp_path, monitor, loader, "fewer than its") == [
        "ActivationRankMonitor: layer 'net.0' was measured on 1 row, fewer than its 4 features: its ranks are at most "
        "1 (raise max_samples to measure more rows)."
    ]


class _Unlabelled(SmallClassifier):
    """Trained on batches of inputs alone."""

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.net(batch[0]).sum()


def test_the_advice_for_missing_labels_fits_the_batch_type(tmp_path) -> None:
    with pytest.raises(ValueError, match=re.escape("(found nothing); set label_key (an index of the list batch) or")):
        BatchReader(label_key=1).labels([torch.ones(2, 3)])
    torch.manual_seed(0)
    loader = DataLoader(TensorDataset(torch.randn(8, 5)), batch_size=8)
    model = _Unlabelled((5, 4, 3))
    monitor = ActivationRankMonitor(layers=["net.0"], num_classes=3, verbose=False)
    assert _fit_warnings(tmp_path, monitor, loader, "no class labels", model) == [
        "ActivationRankMonitor: num_classes=3 but no class labels at index 1 in a list batch of length 1 (found "
        "nothing); the class metrics (TCV, class-wise VR) are not logged; set label_key (an index of the list batch) "
        "or label_fn."
    ]


def test_fewer_jacobian_inputs_than_num_inputs_are_named(tmp_path) -> None:
    torch.manual_seed(0)
    loader = DataLoader(TensorDataset(torch.randn(3, 5), torch.randint(0, 3, (3,))), batch_size=3)
    monitor = JacobianRankMonitor(layers=["net.0"], num_inputs=8, verbose=False)
    assert _fit_warnings(tmp_path, monitor, loader, "num_inputs") == [
        "JacobianRankMonitor: num_inputs=8, but the validation data holds 3 inputs only: the ranks are averaged over "
        "those"
    ]
    assert monitor.inputs.shape == (3, 5)
