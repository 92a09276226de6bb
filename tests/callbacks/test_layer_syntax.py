"""Every callback that hooks or reads a model takes the same layer syntax (rank_lightning.layers)."""

import pytest
import pytorch_lightning as pl
import torch
from torch import nn

from rank_lightning.callbacks import (
    ActivationRankMonitor,
    AdversarialValidation,
    ClassificationDimension,
    JacobianRankMonitor,
    LowDimensionalEvaluation,
    RankPretraining,
    WeightRankMonitor,
)


class _Blocks(pl.LightningModule):
    """Two blocks named by ``blocks()`` (``block1`` -> ``layer1``, ``block2`` -> ``layer2``) and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.layer1 = nn.Sequential(nn.Linear(6, 8), nn.ReLU())
        self.layer2 = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
        self.head = nn.Linear(8, 3)

    def blocks(self) -> dict[str, str]:
        return {"block1": "layer1", "block2": "layer2"}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer2(self.layer1(x)))


# The same layer, layer2, named four ways: its block name, its module path, a glob over blocks, a glob over modules.
SPELLINGS = ["block2", "layer2", "b*2", "layer[2]"]


def _setup(callback: pl.Callback, model: pl.LightningModule) -> None:
    callback.setup(pl.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False), model, "fit")


@pytest.mark.parametrize("spelling", SPELLINGS)
@pytest.mark.parametrize("monitor", [ActivationRankMonitor, JacobianRankMonitor])
def test_monitors_of_outputs_resolve_every_spelling_to_the_same_block(monitor, spelling):
    assert list(monitor(layers=[spelling], verbose=False).select(_Blocks()).values()) == ["layer2"]


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_the_weight_monitor_resolves_every_spelling_to_the_weights_inside_the_block(spelling):
    assert WeightRankMonitor(layers=[spelling], verbose=False).select(_Blocks()) == ["layer2.0"]


@pytest.mark.parametrize("monitor", [ActivationRankMonitor, JacobianRankMonitor])
def test_monitors_take_layer_types(monitor):
    selected = monitor(layer_types=["Tanh"], verbose=False).select(_Blocks())
    assert list(selected.values()) == ["layer2.1"]
    assert WeightRankMonitor(layer_types=[nn.Linear], verbose=False).select(_Blocks()) == [
        "layer1.0",
        "layer2.0",
        "head",
    ]


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_single_layer_callbacks_resolve_every_spelling_to_the_same_module(spelling):
    model = _Blocks()
    adversarial = AdversarialValidation(layer=spelling, verbose=False)
    _setup(adversarial, model)
    assert adversarial.feature_layer.path == "layer2"
    for callback in (LowDimensionalEvaluation(layer=spelling), RankPretraining(layer=spelling)):
        _setup(callback, model)  # validates the name at setup
    with pytest.raises(ValueError, match="unknown layer 'layer3'; layers are: block1, block2, layer1"):
        _setup(LowDimensionalEvaluation(layer="layer3"), model)
    with pytest.raises(ValueError, match="unknown layer 'layer3'; layers are: block1, block2, layer1"):
        _setup(RankPretraining(layer="layer3"), model)


@pytest.mark.parametrize("spelling", ["head", "h*d"])
def test_the_classification_head_takes_the_same_syntax(spelling):
    assert ClassificationDimension(head=spelling, verbose=False).find_head(_Blocks()) == "head"


@pytest.mark.parametrize(
    "make",
    [
        lambda: ActivationRankMonitor(layers=["nope"], verbose=False).select(_Blocks()),
        lambda: JacobianRankMonitor(layers=["nope"], verbose=False).select(_Blocks()),
        lambda: _setup(AdversarialValidation(layer="nope", verbose=False), _Blocks()),
    ],
    ids=["activation", "jacobian", "adversarial"],
)
def test_an_unknown_name_gets_one_message_listing_blocks_then_modules(make):
    with pytest.raises(ValueError, match=r"unknown layer 'nope'; layers are: block1, block2, layer1, layer1\.0"):
        make()
