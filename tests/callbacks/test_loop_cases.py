"""The monitors under Lightning loops beyond one plain fit: several validation or test dataloaders, the same monitors
on a second Trainer, a fit continued with more epochs."""

from __future__ import annotations

from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch

from rank_lightning.attacks import fgsm, l2_dissimilarity
from rank_lightning.callbacks import (
    ActivationRankMonitor,
    AdversarialValidation,
    ClassificationDimension,
    JacobianRankMonitor,
    LowDimensionalEvaluation,
    NeuralCollapseMonitor,
    WeightRankMonitor,
)
from rank_lightning.callbacks.base import RowQuota
from rank_lightning.callbacks.curves import read_curve_file
from rank_lightning.functional import classification_dimension, participation_ratio, stable_rank
from rank_lightning.functional.embedding import low_dimensional_accuracy
from rank_lightning.functional.neural_collapse import neural_collapse
from tests.callbacks.trainer_helpers import SmallClassifier, quiet_trainer, small_loader


class _LoaderRows(pl.Callback):
    """The ``net.0`` outputs of the last validation or test run, by dataloader, from a forward hook of our own."""

    def __init__(self) -> None:
        self.rows: dict[int, list[torch.Tensor]] = {}
        self._loader = 0
        self._handle = None

    def _start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.rows = {}

        def hook(_module: torch.nn.Module, _args: object, output: torch.Tensor) -> None:
            self.rows.setdefault(self._loader, []).append(output.detach().double())

        self._handle = pl_module.net[0].register_forward_hook(hook)

    def _batch(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: object, idx: int, loader: int = 0):
        self._loader = loader

    def _end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._handle.remove()

    on_validation_epoch_start = on_test_epoch_start = _start
    on_validation_batch_start = on_test_batch_start = _batch
    on_validation_epoch_end = on_test_epoch_end = _end


class _Tested(SmallClassifier):
    def test_step(self, batch: object, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.net(batch[0])


def test_two_validation_loaders_are_pooled_with_a_warning(tmp_path: Path) -> None:
    rows = _LoaderRows()
    monitor = ActivationRankMonitor(layers=["net.0"], log_at_init=False, max_samples=None, verbose=False)
    trainer = quiet_trainer([monitor, rows], max_epochs=1, num_sanity_val_steps=0, default_root_dir=tmp_path)
    loaders = [small_loader(16, seed=1), small_loader(24, seed=2)]
    with pytest.warns(UserWarning, match=r"2 validation dataloaders: their activations are pooled"):
        trainer.fit(SmallClassifier(seed=0), small_loader(32), loaders)
    first, second = torch.cat(rows.rows[0]), torch.cat(rows.rows[1])
    logged = float(trainer.callback_metrics["rank/net.0/participation_ratio"])
    assert logged == pytest.approx(float(participation_ratio(torch.cat([first, second]))), rel=1e-12)
    # The two data sets alone differ from their pool (2.91 and 2.70 against 2.93): pooling is not a detail.
    assert abs(float(participation_ratio(first)) - logged) > 1e-3
    assert abs(float(participation_ratio(second)) - logged) > 1e-1
    assert float(trainer.callback_metrics["rank/net.0/spectrum_rows"]) == 40


def test_two_test_loaders_are_pooled_with_a_warning(tmp_path: Path) -> None:
    rows = _LoaderRows()
    monitor = ActivationRankMonitor(layers=["net.0"], on_test=True, max_samples=None, verbose=False)
    trainer = quiet_trainer([monitor, rows], default_root_dir=tmp_path)
    with pytest.warns(UserWarning, match=r"2 test dataloaders: their activations are pooled"):
        results = trainer.test(_Tested(seed=0), [small_loader(16, seed=1), small_loader(24, seed=2)])
    pooled = torch.cat(rows.rows[0] + rows.rows[1])
    assert results[0]["rank_test/net.0/participation_ratio"] == pytest.approx(
        float(participation_ratio(pooled)), rel=1e-6
    )


def _reference(model: SmallClassifier) -> tuple[float, float]:
    """Our own participation ratio of ``net.0``'s outputs on the validation rows and stable rank of its weight."""
    with torch.no_grad():
        rows = model.net[0](small_loader(16, seed=1).dataset.tensors[0]).double()
        return float(participation_ratio(rows)), float(stable_rank(model.net[0].weight.double()))


def _fit(monitors: list, model: SmallClassifier, root: Path, trainer: pl.Trainer | None = None, epochs: int = 2):
    trainer = trainer or quiet_trainer(monitors, max_epochs=epochs, num_sanity_val_steps=0, default_root_dir=root)
    trainer.fit_loop.max_epochs = epochs
    trainer.fit(model, small_loader(32), small_loader(16, seed=1))
    return trainer


def _points(activations: ActivationRankMonitor, weights: WeightRankMonitor) -> dict[int, tuple[float, float]]:
    history, weight_history = activations.curves.history, weights.curves.history
    return {p: (history[p]["net.0"]["participation_ratio"], weight_history[p]["net.0"]["stable_rank"]) for p in history}


def test_the_same_monitors_on_a_second_trainer_start_new_curves(tmp_path: Path) -> None:
    activations = ActivationRankMonitor(layers=["net.0"], log_at_init=True, verbose=False)
    weights = WeightRankMonitor(layers=["net.0"], log_at_init=True, verbose=False)
    _fit([activations, weights], SmallClassifier(seed=0), tmp_path / "first")
    second = SmallClassifier(seed=1)
    initial = _reference(second)
    trainer = _fit([activations, weights], second, tmp_path / "second")
    points = _points(activations, weights)
    assert sorted(points) == [-1, 0, 1]
    # The initial point is the second model's (participation ratio 3.32), not the first one's (2.93).
    assert points[-1] == pytest.approx(initial, rel=1e-12)
    assert points[1] == pytest.approx(_reference(second), rel=1e-12)
    saved = read_curve_file(activations.curves.figure_dir(trainer) / "rank_curves.json")
    assert saved["history"][-1]["net.0"]["participation_ratio"] == pytest.approx(initial[0], rel=1e-12)


def test_a_fit_continued_with_more_epochs_keeps_its_curves(tmp_path: Path) -> None:
    activations = ActivationRankMonitor(layers=["net.0"], log_at_init=True, verbose=False)
    weights = WeightRankMonitor(layers=["net.0"], log_at_init=True, verbose=False)
    model = SmallClassifier(seed=0)
    initial = _reference(model)
    trainer = _fit([activations, weights], model, tmp_path)
    after_two = _points(activations, weights)
    _fit([], model, tmp_path, trainer=trainer, epochs=4)
    points = _points(activations, weights)
    assert sorted(points) == [-1, 0, 1, 2, 3]
    assert points[-1] == pytest.approx(initial, rel=1e-12)
    assert all(points[p] == after_two[p] for p in (-1, 0, 1))
    assert points[3] == pytest.approx(_reference(model), rel=1e-12)


def test_trainer_predict_says_that_it_is_not_monitored(tmp_path: Path, callback_messages: list[str]) -> None:
    activations = ActivationRankMonitor(layers=["net.0"])
    weights = WeightRankMonitor(layers=["net.0"])
    model = SmallClassifier(seed=0)
    model.predict_step = lambda batch, batch_idx, dataloader_idx=0: model.net(batch[0])
    predictions = quiet_trainer([activations, weights], default_root_dir=tmp_path).predict(model, small_loader(16))
    assert len(predictions) == 2
    assert callback_messages == [
        "ActivationRankMonitor: trainer.predict is not monitored (validation, training or test batches are)",
        "WeightRankMonitor: trainer.predict is not monitored (weights are measured during fit)",
    ]
    assert activations.curves.epochs == weights.curves.epochs == []


class _Evaluated(_Tested):
    """Inputs in [0, 1] (pixels, as the attacks need) and steps that log per dataloader."""

    def validation_step(self, batch: object, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.log("val_loss", torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1]))


def _pixel_loader(rows: int, seed: int) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(seed)
    data = torch.utils.data.TensorDataset(torch.rand(rows, 5, generator=g), torch.randint(0, 3, (rows,), generator=g))
    return torch.utils.data.DataLoader(data, batch_size=8)


def _pooled(loaders: list, count: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The inputs and labels of ``loaders`` in loader order (the first ``count``)."""
    x = torch.cat([loader.dataset.tensors[0] for loader in loaders])
    y = torch.cat([loader.dataset.tensors[1] for loader in loaders])
    return x[:count], y[:count]


@pytest.mark.parametrize("run", ["fit", "validate"])
def test_neural_collapse_pools_the_validation_loaders_with_a_warning(tmp_path: Path, run: str) -> None:
    monitor = NeuralCollapseMonitor(verbose=False)
    trainer = quiet_trainer([monitor], max_epochs=1, num_sanity_val_steps=0, default_root_dir=tmp_path)
    model, loaders = _Evaluated(seed=0), [_pixel_loader(16, seed=1), _pixel_loader(24, seed=2)]
    with pytest.warns(UserWarning, match=r"NeuralCollapseMonitor: 2 validation dataloaders: their samples are pooled"):
        if run == "fit":
            trainer.fit(model, _pixel_loader(32, seed=0), loaders)
        else:
            trainer.validate(model, loaders, verbose=False)
    x, y = _pooled(loaders)
    with torch.no_grad():
        features, logits = model.net[:2](x), model.net(x)
    expected = neural_collapse(
        features, y, num_classes=3, head_weight=model.net[2].weight, predictions=logits.argmax(1)
    ).as_dict()
    assert monitor.result.num_samples == 40
    for key, value in expected.items():
        assert float(trainer.callback_metrics[f"neural_collapse/net.2/{key}"]) == pytest.approx(value, rel=1e-9), key


@pytest.mark.parametrize("max_samples", [None, 20])
def test_classification_dimension_pools_the_validation_loaders_with_a_warning(tmp_path: Path, max_samples) -> None:
    callback = ClassificationDimension(max_samples=max_samples, verbose=False)
    trainer = quiet_trainer([callback], default_root_dir=tmp_path)
    model, loaders = _Evaluated(seed=0), [_pixel_loader(16, seed=1), _pixel_loader(24, seed=2)]
    with pytest.warns(UserWarning, match=r"ClassificationDimension: 2 validation dataloaders: their samples are"):
        results = trainer.validate(model, loaders, verbose=False)
    # max_samples=20 takes the 16 samples of the first loader and the first 4 of the second.
    x, y = _pooled(loaders, max_samples)
    with torch.no_grad():
        expected = classification_dimension(model.net[:2](x), y, model.net[2])
    for result in results:  # an epoch-level value: Lightning returns it with every loader's results
        assert result["clsdim/num_samples"] == len(y)
        assert result["clsdim/cls_dim"] == expected.cls_dim
        assert result["clsdim/full_acc"] == pytest.approx(expected.full_accuracy, rel=1e-12)
    assert callback.result.accuracies.tolist() == pytest.approx(expected.accuracies.tolist(), rel=1e-12)


@pytest.mark.parametrize("run", ["validate", "test"])
def test_adversarial_validation_pools_the_loaders_with_a_warning(tmp_path: Path, run: str) -> None:
    callback = AdversarialValidation(eps=["8/255"], attacks=["fgsm"], max_samples=None, verbose=False)
    trainer = quiet_trainer([callback], inference_mode=False, default_root_dir=tmp_path)
    model, loaders = _Evaluated(seed=0), [_pixel_loader(16, seed=1), _pixel_loader(24, seed=2)]
    with pytest.warns(UserWarning, match=rf"AdversarialValidation: 2 {'test' if run == 'test' else 'validation'} "):
        getattr(trainer, run)(model, loaders, verbose=False)
    x, y = _pooled(loaders)
    adversarial = fgsm(model, x, y, 8 / 255)
    with torch.no_grad():
        clean, attacked = model(x).argmax(1), model(adversarial).argmax(1)
    values = callback.history["test" if run == "test" else "validate"][-1]
    assert values["num_samples"] == 40
    assert values["clean_acc"] == (clean == y).double().mean().item()
    assert values["fgsm/acc@8"] == (attacked == y).double().mean().item()
    assert values["fgsm/l2@8"] == pytest.approx(l2_dissimilarity(adversarial, x).double().mean().item(), rel=1e-6)


@pytest.mark.parametrize(("limit", "expected"), [(None, [1, 3, 11]), (3, [1, 3, 11]), (2, [1, 3])])
def test_a_pooled_pass_takes_each_loaders_own_samples_in_loader_order(limit, expected) -> None:
    # Process 1 of 2 reads samples 1, 3 and the repeat of 0 of the first loader, 11 and the repeat of 10 of the second.
    loaders = [
        torch.utils.data.DataLoader(
            list(range(start, start + size)),
            batch_size=2,
            sampler=torch.utils.data.DistributedSampler(range(size), num_replicas=2, rank=1, shuffle=False),
        )
        for start, size in ((0, 5), (10, 3))
    ]
    quota, taken = RowQuota(limit), []
    for batch, room in quota.batches(loaders):
        rows = batch[: len(batch) if room is None else room].tolist()
        taken += rows
        quota.took(len(rows))
    assert taken == expected


def test_low_dimensional_evaluation_pools_the_validation_loaders_with_a_warning(tmp_path: Path) -> None:
    callback = LowDimensionalEvaluation(dims=(1, 2), verbose=False)
    trainer = quiet_trainer([callback], max_epochs=1, num_sanity_val_steps=0, default_root_dir=tmp_path)
    model, loaders = _Evaluated(seed=0), [_pixel_loader(16, seed=1), _pixel_loader(24, seed=2)]
    train = _pixel_loader(32, seed=0)
    with pytest.warns(UserWarning, match=r"LowDimensionalEvaluation: 2 validation dataloaders: their samples are"):
        trainer.fit(model, train, loaders)
    (train_x, train_y), (x, y) = _pooled([train]), _pooled(loaders)
    with torch.no_grad():
        expected = low_dimensional_accuracy(model.net[:2](train_x), train_y, model.net[:2](x), y, (1, 2))
    assert callback.results == expected
    # 40 validation samples: every accuracy is a multiple of 1/40, and at least one is not one of 1/16.
    assert all(round(value * 40) == value * 40 for value in expected.values())
    assert any(round(value * 16) != value * 16 for value in expected.values())


def test_a_dict_of_validation_loaders_is_pooled_as_a_list_is(tmp_path: Path) -> None:
    activations = ActivationRankMonitor(layers=["net.0"], log_at_init=True, max_samples=None, verbose=False)
    collapse = NeuralCollapseMonitor(verbose=False)
    attacks = AdversarialValidation(eps=["8/255"], attacks=["fgsm"], max_samples=None, verbose=False)
    jacobian = JacobianRankMonitor(layers=["net.0"], num_inputs=2, verbose=False)
    callbacks = [activations, collapse, attacks, jacobian]
    trainer = quiet_trainer(callbacks, max_epochs=1, num_sanity_val_steps=0, default_root_dir=tmp_path)
    loaders = {"a": _pixel_loader(16, seed=1), "b": _pixel_loader(24, seed=2)}
    with pytest.warns(UserWarning, match="2 validation dataloaders") as record:
        trainer.fit(_Evaluated(seed=0), _pixel_loader(32, seed=0), loaders)
    warned = sorted(str(w.message).split(":")[0] for w in record if "2 validation dataloaders" in str(w.message))
    assert warned == ["ActivationRankMonitor", "AdversarialValidation", "NeuralCollapseMonitor"]
    # Every sample of both loaders, also in the initial point (epoch -1) before training.
    assert activations.curves.history[-1]["net.0"]["spectrum_rows"] == 40
    assert trainer.callback_metrics["rank/net.0/spectrum_rows"] == 40
    assert collapse.result.num_samples == 40
    assert attacks.history["validate"][0]["num_samples"] == 40
    assert torch.equal(jacobian.inputs, loaders["a"].dataset.tensors[0][:2])  # the first loader's first inputs
