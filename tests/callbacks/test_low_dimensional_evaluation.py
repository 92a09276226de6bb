"""LowDimensionalEvaluation: accuracy per embedding dimension, layer choice, and the model's modes left as they were."""

from __future__ import annotations

from typing import Any

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from rank_lightning.callbacks import LowDimensionalEvaluation, LowRankProjection
from rank_lightning.nn import LRLayer, collect_auxiliary_losses, insert_lr_layer
from tests.callbacks.recording_logger import RecordingLogger
from tests.callbacks.trainer_helpers import quiet_trainer


class _Digits(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Linear(64, 64), nn.ReLU())
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return F.cross_entropy(self(batch[0]), batch[1])

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val/loss", F.cross_entropy(self(batch[0]), batch[1]))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _digits_loaders() -> tuple[DataLoader, DataLoader]:
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32) / 16.0
    y = torch.tensor(y)
    train = DataLoader(TensorDataset(x[:1200], y[:1200]), batch_size=100, shuffle=True)
    val = DataLoader(TensorDataset(x[1200:], y[1200:]), batch_size=200)
    return train, val


def test_low_dimensional_evaluation_logs_accuracy_per_dimension() -> None:
    torch.manual_seed(0)
    recorder = RecordingLogger()
    callback = LowDimensionalEvaluation(dims=(1, 10, 500), every_n_epochs=2)
    trainer = quiet_trainer([callback], max_epochs=4, logger=recorder)
    train, val = _digits_loaders()
    with pytest.warns(UserWarning, match=r"dims \[500\] exceed min\(N, d\) = 64"):
        trainer.fit(_Digits(), train, val)
    assert set(callback.results) == {1, 10}
    # Ten digit classes: one PCA direction separates a few, ten separate most.
    assert 0.1 < callback.results[1] < 0.6
    assert callback.results[10] > 0.85
    assert "lowdim/acc@10" in trainer.callback_metrics  # from the validation epochs
    final = [metrics for _, metrics in recorder.calls if "lowdim/acc@1" in metrics and "epoch" not in metrics]
    assert final[-1] == {"lowdim/acc@1": callback.results[1], "lowdim/acc@10": callback.results[10]}


def test_low_dimensional_evaluation_reads_the_named_layer() -> None:
    torch.manual_seed(0)
    callback = LowDimensionalEvaluation(dims=(3,), layer="features.0", max_batches=2)
    train, val = _digits_loaders()
    quiet_trainer([callback], max_epochs=1).fit(_Digits(), train, val)
    assert set(callback.results) == {3}
    with pytest.raises(ValueError, match=r"unknown layer 'fc'; layers are: features, features\.0, features\.1, head$"):
        quiet_trainer([LowDimensionalEvaluation(layer="fc")], max_epochs=1).fit(_Digits(), train, val)


class _FrozenNorm(_Digits):
    """A training model whose BatchNorm is frozen in eval mode at the start of every training epoch."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64), nn.ReLU())

    def on_train_epoch_start(self) -> None:
        self.features[1].eval()


class _Modes(pl.Callback):
    """Records every submodule's training flag in the hooks in which the evaluation runs."""

    def __init__(self) -> None:
        self.modes: list[dict[str, bool]] = []

    def _record(self, pl_module: pl.LightningModule) -> None:
        self.modes.append({name: module.training for name, module in pl_module.named_modules()})

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._record(pl_module)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._record(pl_module)


def test_low_dimensional_evaluation_leaves_every_submodule_mode_as_it_was() -> None:
    torch.manual_seed(0)
    module = _FrozenNorm()
    before, after = _Modes(), _Modes()
    callback = LowDimensionalEvaluation(dims=(2,), every_n_epochs=1, max_batches=2)
    train, val = _digits_loaders()
    quiet_trainer([before, callback, after], max_epochs=2).fit(module, train, val)
    assert set(callback.results) == {2}
    # The sanity check, two validation epochs and the end of fit, where the model trains but its BatchNorm does not.
    assert len(before.modes) == 4
    assert before.modes[-1][""] and not before.modes[-1]["features.1"]
    assert after.modes == before.modes
    assert module.training and not module.features[1].training


def test_callbacks_work_under_the_lightning_pytorch_trainer() -> None:
    lightning_pytorch = pytest.importorskip("lightning.pytorch")

    class _Module(lightning_pytorch.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
            insert_lr_layer(self.net, "2", LRLayer(32, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.log("train/acc", 0.9, on_step=False, on_epoch=True)
            return F.cross_entropy(self(batch[0]), batch[1]) + collect_auxiliary_losses(self)

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.log("val/loss", F.cross_entropy(self(batch[0]), batch[1]))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05)

    torch.manual_seed(0)
    module = _Module()
    projection = LowRankProjection(threshold=0.65)
    evaluation = LowDimensionalEvaluation(dims=(2,), max_batches=3)
    trainer = quiet_trainer([projection, evaluation], lightning_pytorch.Trainer, max_epochs=2)
    train, val = _digits_loaders()
    trainer.fit(module, train, val)
    assert projection.switched_on_epoch == 0
    assert torch.linalg.matrix_rank(module.net[2][0].weight.detach(), hermitian=True).item() <= 4
    assert trainer.callback_metrics["lr_layer/enabled"].item() == 1.0
    assert set(evaluation.results) == {2}


@pytest.mark.parametrize("reduction", ["channel", "token"])
def test_reductions_with_several_rows_per_input_are_refused(reduction: str) -> None:
    # With "channel" the first rows of a batch's (B*H*W, C) features were paired with the batch's B labels: the
    # classifier was trained on positions of the first samples under other samples' labels (accuracy 0.10 on the
    # digits, chance level), without an error.
    with pytest.raises(ValueError, match=rf"reduction '{reduction}' gives one row per position.*flatten, cls, mean"):
        LowDimensionalEvaluation(reduction=reduction)
    assert LowDimensionalEvaluation(reduction="mean").reduction == "mean"


def test_an_unknown_reduction_lists_only_the_reductions_taken() -> None:
    with pytest.raises(ValueError, match=r"^unknown reduction 'lasst'; valid choices are: flatten, cls, mean, last$"):
        LowDimensionalEvaluation(reduction="lasst")


class _DictBatches(_Digits):
    """Dict batches whose entries ``forward`` takes by name, as a Hugging Face model in a LightningModule does."""

    def forward(self, pixels: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        return super().forward(pixels)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return F.cross_entropy(self(**batch), batch["labels"])

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self(**batch)


def test_dict_batches_reach_forward_as_the_steps_pass_them() -> None:
    torch.manual_seed(0)
    train, val = _digits_loaders()
    as_dicts = [DataLoader([{"pixels": x, "labels": y} for x, y in d], batch_size=None) for d in (train, val)]
    as_tuples = [DataLoader([(b["pixels"], b["labels"]) for b in d], batch_size=None) for d in as_dicts]
    results = []
    for module_cls, loaders in ((_Digits, as_tuples), (_DictBatches, as_dicts)):
        torch.manual_seed(0)
        module = module_cls()
        callback = LowDimensionalEvaluation(dims=(3, 10), layer="features", max_batches=4, verbose=False)
        quiet_trainer([callback], max_epochs=1).fit(module, *loaders)
        results.append(callback.results)
    assert results[1] == results[0] and set(results[0]) == {3, 10}


class _Tokens(pl.LightningModule):
    """Token features ``(B, T, D)`` of dict batches with right padding, classified from their masked mean (a learning
    rate of 0: the features are those of the initial weights)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.mix = nn.Embedding(20, 8), nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: Any = None) -> torch.Tensor:
        tokens = self.mix(self.embed(input_ids))
        mask = attention_mask[..., None].float()
        return self.head((tokens * mask).sum(1) / mask.sum(1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return F.cross_entropy(self(**batch), batch["labels"])

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self(**batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _token_loader(padding: int) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(4):
        mask = (torch.arange(6)[None] < torch.randint(2, 7, (16, 1), generator=generator)).long()
        ids = torch.randint(1, 20, (16, 6), generator=generator).masked_fill(mask == 0, padding)
        batches.append(
            {"input_ids": ids, "attention_mask": mask, "labels": torch.randint(0, 2, (16,), generator=generator)}
        )
    return DataLoader(batches, batch_size=None)


@pytest.mark.parametrize("reduction", ["mean", "flatten", "last"])
def test_token_features_leave_out_the_padding_of_the_attention_mask(reduction: str) -> None:
    """Batches whose real tokens are the same but whose padded positions hold other tokens give the same results."""
    results = []
    for padding in (0, 7):
        torch.manual_seed(0)
        callback = LowDimensionalEvaluation(dims=(2, 4), layer="mix", reduction=reduction, verbose=False)
        quiet_trainer([callback], max_epochs=1).fit(_Tokens(), _token_loader(padding), _token_loader(padding))
        results.append(callback.results)
    assert set(results[0]) == {2, 4} and results[1] == results[0]


def test_last_token_features_drop_an_input_without_real_tokens_with_its_label() -> None:
    callback = LowDimensionalEvaluation(layer="mix", reduction="last", verbose=False)
    tokens = torch.arange(24.0).view(3, 4, 2)
    mask = torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0], [0, 1, 1, 1]])
    rows, targets = callback._rows(tokens, {"attention_mask": mask}, torch.tensor([5, 6, 7]))
    assert rows.tolist() == [[2.0, 3.0], [22.0, 23.0]] and targets.tolist() == [5, 7]
