"""Rank-increasing pre-training (Daneshmand et al. App. G) on deep vanilla ReLU MLPs, and the layer selection."""

from __future__ import annotations

import copy
import math
from typing import Any

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from rank_lightning.callbacks import RankPretraining
from rank_lightning.layers import FeatureLayer, feature_layer
from rank_lightning.models import create_model
from rank_lightning.nn import LRLayer, insert_lr_layer
from tests.callbacks.recording_logger import RecordingLogger
from tests.callbacks.trainer_helpers import quiet_trainer


def _classifier_class(base: type) -> type:
    """``_Classifier`` on the LightningModule class ``base`` (of ``pytorch_lightning`` or ``lightning.pytorch``)."""

    class _Classifier(base):
        """A backbone with ``blocks()`` (prefixed like the package's modules), trained at a learning rate of 0."""

        def __init__(self, backbone: nn.Module) -> None:
            super().__init__()
            self.backbone = backbone

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.backbone(x)

        def blocks(self) -> dict[str, str]:
            return {name: f"backbone.{path}" for name, path in self.backbone.blocks().items()}

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return F.cross_entropy(self(batch[0]), batch[1])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            # lr = 0: the single training step leaves the pre-trained weights as they are.
            return torch.optim.SGD(self.parameters(), lr=0.0)

    return _Classifier


_Classifier = _classifier_class(pl.LightningModule)


def _gaussian_loader(num_batches: int = 5, batch_size: int = 128, dim: int = 64, classes: int = 10) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(num_batches * batch_size, dim, generator=generator)
    y = torch.randint(0, classes, (len(x),), generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


def _fit(module: pl.LightningModule, callbacks: list[pl.Callback], loader: DataLoader, **kwargs: Any) -> pl.Trainer:
    trainer = quiet_trainer(callbacks, **({"max_steps": 1} | kwargs))
    trainer.fit(module, loader)
    return trainer


def _r_of_features(backbone: nn.Module, x: torch.Tensor) -> float:
    # Independent reference for Daneshmand eq. 4: squared singular values from NumPy.
    with torch.no_grad():
        features = backbone.forward_features(x).double().numpy()
    s2 = np.linalg.svd(features, compute_uv=False) ** 2
    return float(s2.sum() ** 2 / (s2**2).sum())


@pytest.mark.slow
def test_pretraining_lifts_the_collapsed_rank_of_a_deep_relu_mlp() -> None:
    # Vanilla ReLU MLP of depth 32 and width 128 (no biases, weights N(0, 1/fan_in)), Gaussian inputs: r(H_L) collapses
    # to about 1.04 (Daneshmand et al. Fig. 1, 6). 5 minibatches x 15 normalised ascent steps lift it on held-out
    # inputs by a factor above 5 (observed 7.6-23 over seeds 0-3; 16 for seed 0).
    torch.manual_seed(0)
    backbone = create_model("mlp", input_shape=(64,), num_classes=10, depth=32, width=128, bias=False, init="gaussian")
    module = _Classifier(backbone)
    held_out = torch.randn(256, 64, generator=torch.Generator().manual_seed(1))
    untouched = copy.deepcopy(backbone)
    recorder = RecordingLogger()
    callback = RankPretraining(num_batches=5, steps=15, lr=0.01)
    _fit(module, [callback], _gaussian_loader(), logger=recorder)

    before, after = _r_of_features(untouched, held_out), _r_of_features(backbone, held_out)
    assert before < 1.2
    assert after / before > 5
    results = callback.results
    assert list(results) == [f"layer{i}" for i in range(1, 33)]
    assert results["layer32"]["r_after"] / results["layer32"]["r_before"] > 5
    assert results["layer32"]["r_before"] == pytest.approx(
        np.mean([_r_of_features(untouched, x) for x, _ in _gaussian_loader()]), rel=1e-6
    )
    assert recorder.latest["pretrain/layer32/r_before"] == results["layer32"]["r_before"]
    assert recorder.latest["pretrain/layer1/r_after"] == results["layer1"]["r_after"]


def test_pretraining_leaves_the_module_optimizer_alone_and_runs_once() -> None:
    torch.manual_seed(0)
    module = _Classifier(create_model("mlp", input_shape=(16,), num_classes=3, depth=3, width=16))

    class _Probe(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            self.optimizer_state = dict(trainer.optimizers[0].state)
            self.weights = copy.deepcopy(pl_module.state_dict())

    callback, probe = RankPretraining(num_batches=2, steps=2), _Probe()
    _fit(module, [callback, probe], _gaussian_loader(2, 32, 16, 3))
    assert callback.done
    assert probe.optimizer_state == {}
    initial = copy.deepcopy(module.state_dict())

    # A resumed run (state restored) does not pre-train again.
    again = RankPretraining(num_batches=2, steps=2)
    again.load_state_dict(callback.state_dict())
    probe_again = _Probe()
    _fit(module, [again, probe_again], _gaussian_loader(2, 32, 16, 3))
    for key, value in initial.items():
        torch.testing.assert_close(probe_again.weights[key], value)


class _NoBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU())
        self.fc = nn.Linear(8, 2)


def test_layer_selection() -> None:
    assert feature_layer(_NoBlocks()) == FeatureLayer("fc_input", "fc", "input")
    assert feature_layer(_NoBlocks(), "body.2") == FeatureLayer("body.2", "body.2", "output")
    module = _Classifier(create_model("mlp", input_shape=(4,), num_classes=2, depth=2, width=8))
    assert feature_layer(module) == FeatureLayer("layer2", "backbone.layers.1", "output")
    assert feature_layer(module, "layer1") == FeatureLayer("layer1", "backbone.layers.0", "output")
    message = "unknown layer 'layer9'; layers are: layer1, layer2, backbone, backbone.flatten, backbone.layers,"
    with pytest.raises(ValueError, match=message):
        feature_layer(module, "layer9")


class _Modes(pl.Callback):
    """Records every submodule's training flag in ``on_train_start``; with ``freeze``, first freezes a BatchNorm."""

    def __init__(self, freeze: bool = False) -> None:
        self.freeze = freeze
        self.modes: dict[str, bool] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.freeze:
            pl_module.backbone.layers[0].norm.eval()
        self.modes = {name: module.training for name, module in pl_module.named_modules()}


def test_pretraining_leaves_every_submodule_mode_as_it_was() -> None:
    torch.manual_seed(0)
    backbone = create_model("mlp", input_shape=(16,), num_classes=3, depth=2, width=16, batch_norm=True)
    before, after = _Modes(freeze=True), _Modes()
    callback = RankPretraining(num_batches=2, steps=2)
    _fit(_Classifier(backbone), [before, callback, after], _gaussian_loader(2, 32, 16, 3))
    assert callback.done
    assert before.modes[""] and not before.modes["backbone.layers.0.norm"]
    assert after.modes == before.modes


def test_pretraining_without_blocks_uses_the_input_of_the_last_linear_layer() -> None:
    class _Module(_Classifier):
        def __init__(self) -> None:
            pl.LightningModule.__init__(self)
            self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        blocks = None

    callback = RankPretraining(num_batches=2, steps=3)
    _fit(_Module(), [callback], _gaussian_loader(2, 32, 16, 3))
    assert list(callback.results) == ["net.2_input"]
    assert callback.results["net.2_input"]["r_after"] > callback.results["net.2_input"]["r_before"]


def test_bad_arguments_raise() -> None:
    with pytest.raises(ValueError, match="num_batches must be a positive integer"):
        RankPretraining(num_batches=0)
    with pytest.raises(ValueError, match="unknown reduction 'pool'"):
        RankPretraining(reduction="pool")
    with pytest.raises(ValueError, match=r"momentum must be in \[0, 1\), got '0.9'"):
        RankPretraining(momentum="0.9")
    with pytest.raises(ValueError, match=r"layer must be None or a layer name, path or glob pattern .*, got 3"):
        RankPretraining(layer=3)


def test_pretraining_under_the_lightning_pytorch_trainer() -> None:
    lightning_pytorch = pytest.importorskip("lightning.pytorch")

    torch.manual_seed(0)
    callback = RankPretraining(num_batches=2, steps=5)
    backbone = create_model("mlp", input_shape=(16,), num_classes=3, depth=4, width=16, bias=False)
    module = _classifier_class(lightning_pytorch.LightningModule)(backbone)
    trainer = quiet_trainer([callback], lightning_pytorch.Trainer, max_steps=1)
    trainer.fit(module, _gaussian_loader(2, 32, 16, 3))
    assert list(callback.results) == ["layer1", "layer2", "layer3", "layer4"]
    assert callback.results["layer4"]["r_after"] > callback.results["layer4"]["r_before"]


def test_a_nan_before_the_pretrained_layer_skips_the_ascent_with_a_warning() -> None:
    torch.manual_seed(0)
    backbone = create_model("mlp", input_shape=(16,), num_classes=3, depth=4, width=16, bias=False)
    module = _Classifier(backbone)
    with torch.no_grad():
        backbone.layers[2].linear.weight[0, 0] = float("nan")
    before = backbone.layers[0].linear.weight.detach().clone()
    after: list[torch.Tensor] = []

    class _Probe(pl.Callback):  # the weights after the pre-training, before the first training step
        def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, idx: int) -> None:
            after.append(backbone.layers[0].linear.weight.detach().clone())

    callback = RankPretraining(num_batches=2, steps=3)
    with pytest.warns(UserWarning, match=r"r\(H\) of 'layer4' or its gradient was NaN or Inf at 6 of 6 ascent steps"):
        quiet_trainer([callback, _Probe()], max_steps=1).fit(module, _gaussian_loader(2, 32, 16, 3))
    assert callback.results["layer1"]["r_after"] == callback.results["layer1"]["r_before"]
    assert math.isnan(callback.results["layer4"]["r_after"])
    assert torch.equal(after[0], before)


def test_the_ascent_collects_the_lr_layer_loss_of_every_step() -> None:
    # An LR-Layer switched on (weights saved after its switch-on) computes its loss in every ascent step. Left pending,
    # each step's loss was merged into the next, keeping every step's graph, (n, m) activations included, alive until
    # the ascent ended.
    class _Plain(_Classifier):
        def blocks(self) -> dict[str, str]:
            return {}

    torch.manual_seed(0)
    module = _Plain(nn.Sequential(nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 10)))
    layer = insert_lr_layer(module.backbone, "2", LRLayer(16, 2))
    layer.enabled = True
    pending: list[int] = []
    layer.register_forward_pre_hook(
        lambda m, args: (
            pending.append(m._pending_rows if m.aux_loss is not None else 0) if torch.is_grad_enabled() else None
        )
    )
    _fit(module, [RankPretraining(num_batches=2, steps=3, verbose=False)], _gaussian_loader(batch_size=16))
    assert pending[:6] == [0] * 6  # the six ascent steps, then the training step


def test_a_generator_of_training_batches_is_refused_before_it_loses_a_batch() -> None:
    torch.manual_seed(0)
    module = _Classifier(create_model("mlp", input_shape=(16,), num_classes=3, depth=3, width=16))
    batches = iter(_gaussian_loader(4, 32, 16, 3))
    with pytest.raises(ValueError, match=r"RankPretraining reads 2 training batches before the fit, .* one-pass"):
        _fit(module, [RankPretraining(num_batches=2, steps=1)], batches)
    assert len(list(batches)) == 4  # the callback took none


class _MaskedTokens(pl.LightningModule):
    """Hugging Face style: ``forward(input_ids, attention_mask)`` averages the embeddings of the real tokens only."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.hidden, self.head = nn.Embedding(20, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        weights = mask.unsqueeze(-1).float()
        pooled = (self.embed(input_ids) * weights).sum(1) / weights.sum(1)
        return self.head(torch.relu(self.hidden(pooled)))

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        logits = self(batch["input_ids"], batch["attention_mask"])
        return F.cross_entropy(logits, batch["labels"])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_dict_batches_reach_forward_with_their_attention_mask() -> None:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 20, (16, 6), generator=generator)
    mask = (torch.arange(6) < torch.randint(2, 7, (16, 1), generator=generator)).long()
    rows = [{"input_ids": ids[i], "attention_mask": mask[i], "labels": torch.tensor(i % 3)} for i in range(16)]
    module = _MaskedTokens()
    features: list[torch.Tensor] = []
    handle = module.head.register_forward_pre_hook(lambda m, args: features.append(args[0]))
    with torch.no_grad():
        module(ids, mask)
    handle.remove()
    expected = _participation(features[0])
    callback = RankPretraining(num_batches=1, steps=1, lr=1e-12, momentum=0.0, verbose=False)
    _fit(module, [callback], DataLoader(rows, batch_size=16), max_steps=1)
    assert callback.results["head_input"]["r_before"] == pytest.approx(expected, rel=1e-6)


def _participation(features: torch.Tensor) -> float:
    gram = features.double().T @ features.double()
    return float(torch.trace(gram) ** 2 / gram.square().sum())
