"""Every class-aware part of the package takes the same label forms (``layers.LABEL_FORMS``) and refuses the same.

Taken: integer labels ``(B,)`` of any integer dtype, a ``(B, 1)`` column, booleans (classes 0 and 1) and one-hot rows
``(B, C)`` (their argmax), each giving what ``(B,)`` int64 labels give, checked against float64 computations of our
own. Refused, with a message naming what was found and what to pass: float values (also whole numbers), soft targets
(mixup, label smoothing) and labels of another number of rows than the batch.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from rank_lightning.attacks import accuracy_under_attack, fgsm
from rank_lightning.callbacks import (
    ActivationRankMonitor,
    AdversarialValidation,
    ClassificationDimension,
    LowDimensionalEvaluation,
    NeuralCollapseMonitor,
)
from rank_lightning.functional import classification_dimension, neural_collapse, total_cluster_variation
from rank_lightning.metrics import ActivationSpectrum, NeuralCollapseStatistics
from rank_lightning.tracker import RankTracker
from tests.callbacks.trainer_helpers import SmallClassifier, quiet_trainer

X = torch.rand(24, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
Y3 = torch.tensor([0, 1, 2, 2, 1, 0, 0, 0, 1, 2, 2, 2, 0, 1, 1, 0, 2, 0, 1, 2, 0, 0, 1, 2])
Y2 = Y3 % 2

FORMS = {  # label form -> (labels, the int64 labels they stand for)
    "int64": (Y3, Y3),
    "column": (Y3.unsqueeze(1), Y3),
    "uint8": (Y3.to(torch.uint8), Y3),
    "int8_column": (Y3.to(torch.int8).unsqueeze(1), Y3),
    "one_hot_float": (nn.functional.one_hot(Y3, 3).float(), Y3),
    "bool": (Y2.bool(), Y2),
    "bool_column": (Y2.bool().unsqueeze(1), Y2),
}


def _tcv(x: torch.Tensor, y: torch.Tensor) -> float:
    """``sum_c sum_{i in c} ||x_i - mu_c||^2`` in float64 numpy."""
    x, y = x.double().numpy(), y.numpy()
    return float(sum(((x[y == c] - x[y == c].mean(0)) ** 2).sum() for c in np.unique(y)))


def _nc1(x: torch.Tensor, y: torch.Tensor) -> float:
    """``Tr(Sigma_W Sigma_B^+) / C`` in float64 numpy."""
    x, y = x.double().numpy(), y.numpy()
    classes = np.unique(y)
    means = np.stack([x[y == c].mean(0) for c in classes])
    within = sum((x[y == c] - means[i]).T @ (x[y == c] - means[i]) for i, c in enumerate(classes)) / len(x)
    centred = means - x.mean(0)
    between = centred.T @ centred / len(classes)
    return float(np.trace(within @ np.linalg.pinv(between)) / len(classes))


def _spectrum(x, labels, classes):
    metric = ActivationSpectrum(num_classes=classes)
    metric.update(x, labels)
    return float(metric.compute().total_cluster_variation)


def _tracker(x, labels, classes, *, as_batch=False):
    model = nn.Sequential(nn.Identity())
    tracker = RankTracker(model, layers=["0"], num_classes=classes)
    with torch.no_grad(), tracker:
        with tracker.batch(batch=(x, labels)) if as_batch else tracker.batch(labels=labels):
            model(x)
    return tracker.compute()["0"]["tcv"]


def _nc_statistics(x, labels, classes):
    metric = NeuralCollapseStatistics(classes, x.shape[1])
    metric.update(x, labels)
    metric.start_second_pass()
    metric.update(x, labels)
    return metric.compute().nc1


CONSUMERS = {  # name -> (labels, classes -> value, what int64 labels give by our own computation)
    "ActivationSpectrum": (lambda y, c: _spectrum(X, y, c), _tcv),
    "RankTracker_labels": (lambda y, c: _tracker(X, y, c), _tcv),
    "RankTracker_batch": (lambda y, c: _tracker(X, y, c, as_batch=True), _tcv),
    "total_cluster_variation": (lambda y, c: float(total_cluster_variation(X, y, num_classes=c)), _tcv),
    "NeuralCollapseStatistics": (lambda y, c: _nc_statistics(X, y, c), _nc1),
    "neural_collapse": (lambda y, c: neural_collapse(X, y, num_classes=c).nc1, _nc1),
    "classification_dimension": (
        lambda y, c: classification_dimension(X, y, lambda f: f[:, :c]).full_accuracy,
        lambda x, y: float((x[:, : int(y.max()) + 1].argmax(1) == y).double().mean()),
    ),
    "accuracy_under_attack": (
        lambda y, c: float(accuracy_under_attack(X[:, :c], y)),
        lambda x, y: float((x[:, : int(y.max()) + 1].argmax(1) == y).double().mean()),
    ),
}


@pytest.mark.parametrize("consumer", list(CONSUMERS))
@pytest.mark.parametrize("form", list(FORMS))
def test_every_label_form_gives_what_its_integer_labels_give(consumer, form):
    labels, meant = FORMS[form]
    run, expected = CONSUMERS[consumer]
    assert run(labels, int(meant.max()) + 1) == pytest.approx(expected(X, meant), rel=1e-6)


class _AnyLabels(SmallClassifier):
    """Trains on a loss that does not read the labels, so that its steps run with every label form."""

    def training_step(self, batch, batch_idx):
        return self.net(batch[0]).square().mean()


def _model(classes: int) -> SmallClassifier:
    return _AnyLabels((4, 6, classes), seed=0).double()


def _logged(callback, labels, classes: int, tmp_path) -> dict[str, float]:
    """What ``callback`` logs on a validation run (a fit for LowDimensionalEvaluation) of a seeded classifier."""
    loader = DataLoader(TensorDataset(X, labels), batch_size=8)
    options = dict(max_epochs=1, num_sanity_val_steps=0, default_root_dir=tmp_path, inference_mode=False)
    trainer = quiet_trainer([callback], **options)
    if isinstance(callback, LowDimensionalEvaluation):
        trainer.fit(_model(classes), loader, loader)
        return {f"acc@{dim}": value for dim, value in callback.results.items()}
    trainer.validate(_model(classes), loader, verbose=False)
    return {key: float(value) for key, value in trainer.callback_metrics.items()}


def _tcv_of_first_layer(y):
    return {"rank/net.0/tcv": _tcv(_model(int(y.max()) + 1).net[0](X).detach(), y)}


def _nc1_of_head_input(y):
    return {"neural_collapse/net.2/nc1": _nc1(_model(int(y.max()) + 1).net[:2](X).detach(), y)}


def _accuracy(y):
    return float((_model(int(y.max()) + 1)(X).argmax(1) == y).double().mean())


CALLBACKS = {  # name -> (callback for the classes and settings, what int64 labels give by our own computation)
    "ActivationRankMonitor": (
        lambda c, **kw: ActivationRankMonitor(num_classes=c, layers=["net.0"], **kw),
        _tcv_of_first_layer,
    ),
    "NeuralCollapseMonitor": (lambda c, **kw: NeuralCollapseMonitor(**kw), _nc1_of_head_input),
    "ClassificationDimension": (
        lambda c, **kw: ClassificationDimension(**kw),
        lambda y: {"clsdim/full_acc": _accuracy(y)},
    ),
    "AdversarialValidation": (
        lambda c, **kw: AdversarialValidation(eps=["8/255"], attacks=["fgsm"], mean=[0], std=[1], **kw),
        lambda y: {"adv/clean_acc": _accuracy(y)},
    ),
    "LowDimensionalEvaluation": (lambda c, **kw: LowDimensionalEvaluation(layer="net.0", dims=[2], **kw), None),
}


@pytest.mark.parametrize("callback", list(CALLBACKS))
@pytest.mark.parametrize("form", ["column", "one_hot_float", "bool"])
def test_every_callback_takes_every_label_form_as_its_integer_labels(callback, form, tmp_path):
    labels, meant = FORMS[form]
    make, expected = CALLBACKS[callback]
    classes = int(meant.max()) + 1
    logged = _logged(make(classes), labels, classes, tmp_path / "form")
    reference = _logged(make(classes), meant, classes, tmp_path / "int64")
    assert logged == reference and logged
    if expected is not None:
        for key, value in expected(meant).items():
            assert logged[key] == pytest.approx(value, rel=1e-6), key


def test_an_attack_takes_a_label_column_as_its_labels():
    model = _model(3)
    with torch.no_grad():
        expected = fgsm(model, X, Y3, eps=8 / 255)
    assert torch.equal(fgsm(model, X, Y3.unsqueeze(1), eps=8 / 255), expected)
    assert torch.equal(fgsm(model, X, Y3.to(torch.uint8), eps=8 / 255), expected)


SMOOTHED = nn.functional.one_hot(Y3, 3).double() * 0.9 + 0.1 / 3  # label smoothing; row 0: [0.9333, 0.0333, 0.0333]
SOFT_ADVICE = "row 0 is [0.9333, 0.0333, 0.0333]: soft targets (mixup, CutMix, label smoothing) have no class"
WHOLE_FLOATS = "these hold whole numbers stored as floats ([0.0, 1.0, 2.0, 2.0, ...]): pass them as integers"


@pytest.mark.parametrize("consumer", list(CONSUMERS))
@pytest.mark.parametrize(
    ("labels", "found", "advice"),
    [
        (SMOOTHED, "torch.float64 of shape (24, 3): rows that are not one-hot", SOFT_ADVICE),
        (
            Y3.double(),
            "torch.float64 of shape (24,): float values, not class indices",
            WHOLE_FLOATS + ", labels.long()",
        ),
    ],
    ids=["soft", "whole_floats"],
)
def test_soft_targets_and_float_labels_are_refused_everywhere_saying_what_to_pass(consumer, labels, found, advice):
    if consumer == "RankTracker_batch":
        # Labels looked for in a batch at the default places are optional: a warning names them, and what to pass.
        with pytest.warns(UserWarning) as record:
            with pytest.raises(KeyError, match="tcv"):
                CONSUMERS[consumer][0](labels, 3)
        message = str(record[0].message)
        assert f"(found a Tensor {found}" in message and f"The labels found are refused: {advice[:60]}" in message
        return
    with pytest.raises(ValueError) as error:
        CONSUMERS[consumer][0](labels, 3)
    message = str(error.value)
    assert "must be integer labels of shape (B,) or one-hot rows of shape (B, C)" in message
    assert f"got a Tensor {found}" in message and advice in message


@pytest.mark.parametrize("callback", [name for name in CALLBACKS if name != "ActivationRankMonitor"])
@pytest.mark.parametrize(("labels", "advice"), [(SMOOTHED, SOFT_ADVICE), (Y3.double(), WHOLE_FLOATS)])
def test_callbacks_refuse_soft_targets_and_float_labels_saying_what_to_pass(callback, labels, advice, tmp_path):
    with pytest.raises(ValueError) as error:
        _logged(CALLBACKS[callback][0](3), labels, 3, tmp_path)
    assert f"(found a Tensor torch.float64 of shape {(8, *labels.shape[1:])}" in str(error.value)
    assert advice in str(error.value) and "label_fn" in str(error.value)


ROWS = "the batch's labels have 22 rows (shape (22,)) but"


@pytest.mark.parametrize(
    ("consumer", "message"),
    [
        ("ActivationSpectrum", "labels must have shape (24,) to match the activations, got (22,)"),
        ("RankTracker_batch", f"{ROWS} its inputs have 24"),
        ("total_cluster_variation", "labels must have shape (24,), one class label per row, got a Tensor"),
        ("NeuralCollapseStatistics", "labels must have shape (24,), one class label per row, got a Tensor"),
        ("neural_collapse", "labels must have shape (24,), one class label per row, got a Tensor"),
        ("classification_dimension", "labels must have shape (24,), one class label per row, got a Tensor"),
        ("accuracy_under_attack", "expected logits (B, num_classes) and targets (B,); got (24, 3) and (22,)"),
    ],
)
def test_labels_of_another_number_of_rows_are_refused(consumer, message):
    with pytest.raises(ValueError) as error:
        CONSUMERS[consumer][0](Y3[:22], 3)
    assert message in str(error.value)


@pytest.mark.parametrize("callback", list(CALLBACKS))
@pytest.mark.parametrize(
    ("label_fn", "rows"),
    [(lambda batch: batch[1][:-2], 6), (lambda batch: torch.cat([batch[1], batch[1][:2]]), 10)],
    ids=["cut", "padded"],
)
def test_callbacks_refuse_labels_of_another_number_of_rows(callback, label_fn, rows, tmp_path):
    """Labels cut or padded to the rows of a layer paired rows with other classes (the monitor took the first rows
    of padded labels, the evaluations the first features of cut ones)."""
    callback = CALLBACKS[callback][0](3, label_fn=label_fn)
    message = rf"the batch's labels have {rows} rows \(shape \({rows},\)\) but .* have 8: one class label per sample"
    with pytest.raises(ValueError, match=message):
        _logged(callback, Y3, 3, tmp_path)


def test_labels_given_by_hand_for_other_rows_are_named_as_what_told_the_batch_size():
    """Labels given with no batch tell its size: a layer of other rows is skipped with a warning that says so."""
    with pytest.warns(UserWarning, match=r"no leading dimension of the batch size 22 \(told by its labels\)"):
        with pytest.raises(KeyError, match="'0'"):
            CONSUMERS["RankTracker_labels"][0](Y3[:22], 3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_labels_on_the_cpu_go_with_features_on_a_gpu():
    x, column = X.cuda(), Y3.unsqueeze(1)
    assert _spectrum(x, column, 3) == pytest.approx(_tcv(X, Y3), rel=1e-6)
    assert float(total_cluster_variation(x, column)) == pytest.approx(_tcv(X, Y3), rel=1e-9)
    assert neural_collapse(x, column).nc1 == pytest.approx(_nc1(X, Y3), rel=1e-6)
    expected = CONSUMERS["accuracy_under_attack"][1](X, Y3)
    assert float(accuracy_under_attack(x[:, :3], column)) == pytest.approx(expected, rel=1e-6)
