"""How ActivationRankMonitor gives out its memory budget: every layer's exact spectrum first, then the optional class
Grams of the class-wise variance ratio, the smallest first within an even share, and a plan that says which layers
have them and why the others have none."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from torch import nn

from rank_lightning.callbacks import ActivationRankMonitor
from rank_lightning.metrics import ActivationSpectrum
from tests.callbacks import activation_rank_ddp_helpers as ddp_helpers
from tests.callbacks.trainer_helpers import quiet_trainer

CLASSES, INPUTS, ROWS = 10, 8, 512


class _Layers(pl.LightningModule):
    """Linear layers of the given widths, one after the other, named ``a``, ``b``, ...; ``inplace`` puts an in-place
    ReLU after each, which overwrites the layer's output once its hook has run."""

    def __init__(self, *widths: int, inplace: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        fan_in = [INPUTS, *widths[:-1]]
        self.names = [chr(ord("a") + i) for i in range(len(widths))]
        for name, n_in, n_out in zip(self.names, fan_in, widths):
            setattr(self, name, nn.Linear(n_in, n_out))
        self.inplace, self.num_classes = inplace, CLASSES

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for name in self.names:
            x = getattr(self, name)(x)
            x = torch.relu_(x) if self.inplace else torch.tanh(x)
        return x

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self(batch[0])


def _loader() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(ROWS, INPUTS, generator=g), torch.arange(ROWS) % CLASSES)
    return torch.utils.data.DataLoader(data, batch_size=128)


def _validate(tmp_path: Path, model: _Layers, budget_bytes: int) -> tuple[ActivationRankMonitor, dict, list[str]]:
    """Validate with a monitor of every layer of ``model``; its results and the warnings it gave."""
    monitor = ActivationRankMonitor(layers=model.names, memory_budget_mb=budget_bytes / 2**20)
    trainer = quiet_trainer([monitor], default_root_dir=tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        (results,) = trainer.validate(model, _loader(), verbose=False)
    return monitor, {key: float(value) for key, value in results.items()}, [str(w.message) for w in caught]


def _exact_bytes(d: int) -> int:
    """Planned bytes of a layer of ``d`` features on the exact path, with the class sums but no class Grams."""
    return 8 * (2 * d + d * d + CLASSES + CLASSES * d + 4)


def _class_gram_bytes(d: int) -> int:
    return 8 * CLASSES * d * d


def test_a_wide_layer_keeps_its_exact_gram_before_a_narrow_layer_gets_class_grams(tmp_path, callback_messages):
    # The budget was given out in layer order: 'a' took its class Grams (80 KiB), and 'b', whose 256 x 256 Gram then
    # no longer fitted, measured a 154-row subsample of its 512 rows. Both exact Grams fit; the class Grams do not.
    budget = _exact_bytes(32) + _exact_bytes(256) + 68794
    monitor, results, caught = _validate(tmp_path, _Layers(32, 256), budget)
    assert results["rank/a/spectrum_rows"] == results["rank/b/spectrum_rows"] == ROWS
    metrics = monitor._stream.metrics
    assert (metrics["a"].path_for(32), metrics["b"].path_for(256)) == ("gram", "gram")
    assert metrics["a"].planned_bytes(32) + metrics["b"].planned_bytes(256) == _exact_bytes(32) + _exact_bytes(256)
    assert not any("classwise" in key for key in results)
    assert not any("'sample_gram' path" in message for message in caught)
    # The plan names each layer without class Grams and why; its total is the sum of planned_bytes.
    assert callback_messages[-1] == (
        "ActivationRankMonitor: state of 2 layers: 0.534 MiB of a 0.6 MiB budget on cpu (largest 'b': 0.524 MiB); "
        "per-batch temporary up to 0.25 MiB ('b'); class Grams (class-wise VR) of no layer; not of 'a' (its 10 class "
        "Grams of 32 x 32, 0.0781 MiB, are more "
        "than an even share, 0.0656 MiB, of the 0.0656 MiB that the spectra leave); 'b' (its 10 class Grams of 256 x "
        "256, 5 MiB, are more than the 0.0656 MiB that its spectrum and those of the layers planned before it leave)"
    )
    assert f"{(_exact_bytes(32) + _exact_bytes(256)) / 2**20:.3g}" == "0.534"
    (warned,) = [message for message in caught if "layer 'a' has no class Grams" in message]
    assert warned.startswith(
        "ActivationRankMonitor: layer 'a' has no class Grams, so its class-wise variance ratio is not computed: its 10 "
        "class Grams of 32 x 32, 0.0781 MiB, are more than an even share, 0.0656 MiB, of the 0.0656 MiB that the "
        "spectra leave. The spectrum of every layer comes first, then the class Grams, the smallest first"
    )


def _reference(model: _Layers, name: str, **options: Any) -> Any:
    """The result of one ActivationSpectrum over every validation row of layer ``name`` of ``model``."""
    x, y = _loader().dataset.tensors
    outputs = {}
    handle = getattr(model, name).register_forward_hook(lambda _m, _a, out: outputs.update({name: out.clone()}))
    with torch.no_grad():
        model(x)
    handle.remove()
    metric = ActivationSpectrum(num_classes=CLASSES, variance_ratio_ks=(1, 10), **options)
    metric.update(outputs[name], y)
    return metric.compute()


def test_class_grams_go_to_the_smallest_first_not_to_the_first_layer(tmp_path, callback_messages):
    # 'a' (16 features) came first and took its class Grams (160 KiB); 'b' (8 features, 40 KiB) found too little left.
    # The class Grams now go the smallest first, each within an even share of what the spectra leave.
    model = _Layers(16, 8)
    monitor, results, caught = _validate(tmp_path, model, _exact_bytes(16) + _exact_bytes(8) + 24000)
    assert "rank/a/classwise_variance_ratio_1_mean" not in results
    expected = _reference(model, "b").scalars(("classwise_variance_ratio",))["classwise_variance_ratio_1_mean"]
    assert results["rank/b/classwise_variance_ratio_1_mean"] == expected  # every row, the first batch's too
    metrics = monitor._stream.metrics
    assert metrics["a"].planned_bytes(16) == _exact_bytes(16)
    assert metrics["b"].planned_bytes(8) == _exact_bytes(8) + _class_gram_bytes(8)
    assert callback_messages[-1] == (
        "ActivationRankMonitor: state of 2 layers: 0.00974 MiB of a 0.0277405 MiB budget on cpu (largest 'b': "
        "0.00621 MiB); per-batch temporary up to 0.0156 MiB ('a'); class Grams (class-wise VR) of 'b'; not of 'a' "
        "(its 10 class Grams of 16 x 16, 0.0195 MiB, "
        "are more than an even share, 0.018 MiB, of the 0.018 MiB that the spectra leave)"
    )
    assert sum(1 for message in caught if "layer 'a' has no class Grams" in message) == 1


def test_layers_of_one_width_all_have_class_grams_or_none_has(tmp_path, callback_messages):
    # Room for the class Grams of one of the two: the first one took them, the second had none.
    monitor, results, caught = _validate(tmp_path, _Layers(16, 16), 2 * _exact_bytes(16) + 30000)
    assert not any("classwise" in key for key in results)
    assert callback_messages[-1].endswith(
        "class Grams (class-wise VR) of no layer; not of 'a' (its 10 class Grams of 16 x 16, 0.0195 MiB, are more "
        "than an even share, 0.0143 MiB, of the 0.0286 MiB that the spectra leave); 'b' (its 10 class Grams of 16 x "
        "16, 0.0195 MiB, are no smaller than those of 'a', which exceed their even share)"
    )
    assert [m.planned_bytes(16) for m in monitor._stream.metrics.values()] == [_exact_bytes(16)] * 2
    assert sum(1 for message in caught if "has no class Grams" in message) == 2
    # Room for both: both have them.
    _, results, _ = _validate(tmp_path / "both", _Layers(16, 16), 2 * _exact_bytes(16) + 2 * _class_gram_bytes(16))
    assert {"rank/a/classwise_variance_ratio_1_mean", "rank/b/classwise_variance_ratio_1_mean"} <= set(results)
    assert callback_messages[-1].endswith("class Grams (class-wise VR) of 'a', 'b'")


def test_rows_held_for_the_class_gram_plan_are_those_the_layer_gave(tmp_path):
    # The first batch's rows wait for the end of the batch, when the class Grams are planned; an in-place ReLU after
    # the layer overwrites its output before then: the rows held are a copy, so every metric is that of the outputs.
    model = _Layers(16, 8, inplace=True)
    monitor, results, _ = _validate(tmp_path, model, 2**30)
    for name, d in (("a", 16), ("b", 8)):
        assert monitor._stream.metrics[name].planned_bytes(d) == _exact_bytes(d) + _class_gram_bytes(d)
        expected = _reference(model, name).scalars(("variance_ratio", "classwise_variance_ratio"))
        for key in ("variance_ratio_1", "variance_ratio_10", "classwise_variance_ratio_1_mean"):
            assert abs(results[f"rank/{name}/{key}"] - expected[key]) <= 1e-12 * abs(expected[key]), key


@pytest.mark.slow
def test_class_grams_that_fit_on_some_processes_only_are_dropped_on_all(tmp_path):
    # 'side' runs on the second process only and takes memory there: 'act's class Grams fitted on the first process
    # and not on the second, whose sums of another shape broke the collective of the sync (gloo aborted). Both now go
    # without them; 'conv' keeps its class Grams, and every value is that of one process.
    budget = (248 + 2744 + 6900) / 2**20  # the exact Grams of 'conv' and 'act', and room for one process's classes
    results = {}
    for devices in (1, 2):
        torch.manual_seed(0)
        monitor = ActivationRankMonitor(layers=["conv", "act", "side"], max_samples=None, memory_budget_mb=budget)
        trainer = ddp_helpers._validating_trainer(devices, monitor, logger=False, default_root_dir=tmp_path)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the warnings of the second run are the spawned processes'
            (values,) = trainer.validate(ddp_helpers.ConvNet(), ddp_helpers.loader(), verbose=False)
        results[devices] = {key: float(value) for key, value in values.items()}
    assert "rank/act/classwise_variance_ratio_1_mean" in results[1]
    single = {key: value for key, value in results[1].items() if key != "rank/act/classwise_variance_ratio_1_mean"}
    assert results[2] == pytest.approx(single, rel=1e-6)
    assert "rank/conv/channel/classwise_variance_ratio_1_mean" in results[2]
