"""Edges of a monitor's life around ``fit``: an evaluation of other data after the fit, a block whose Jacobian is
non-finite at some inputs only, a head that classifies no sample correctly."""

import math
import warnings

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from rank_lightning.callbacks import (
    ActivationRankMonitor,
    ClassificationDimension,
    JacobianRankMonitor,
    NeuralCollapseMonitor,
)
from rank_lightning.callbacks.curves import read_curve_file
from rank_lightning.functional import classification_dimension
from tests.callbacks.trainer_helpers import SmallClassifier, quiet_trainer, small_loader


@pytest.mark.parametrize(
    ("make", "namespace"),
    [
        (lambda: ActivationRankMonitor(layers=["net.1"], metrics=["participation_ratio"], verbose=False), "rank"),
        (lambda: NeuralCollapseMonitor(metrics=["nc1"], verbose=False), "neural_collapse"),
    ],
)
def test_validating_other_data_after_fit_keeps_the_fits_last_point(tmp_path, make, namespace):
    loader, other = small_loader(48), small_loader(40, seed=7)
    monitor = make()
    trainer = quiet_trainer([monitor], max_epochs=2, default_root_dir=tmp_path)
    model = SmallClassifier(widths=(5, 12, 6, 3), lr=0.2, seed=0)
    trainer.fit(model, loader, loader)
    fitted = {epoch: {k: dict(v) for k, v in values.items()} for epoch, values in monitor.curves.history.items()}
    assert sorted(fitted)[-2:] == [0, 1]
    (layer,) = fitted[1]
    with pytest.warns(UserWarning, match=r"this trainer.validate measures the weights the curves hold at epoch 1, but"):
        (results,) = trainer.validate(model, other, verbose=False)
    stored = read_curve_file(tmp_path / "rank_curves" / f"{namespace}_curves.json")
    for history in (monitor.curves.history, stored["history"]):
        assert history == fitted  # the fit's points, its last one included
    # The other data's values are returned by trainer.validate, as a validation of that data alone gives them.
    (alone,) = quiet_trainer([make()], default_root_dir=tmp_path / "alone").validate(model, other, verbose=False)
    keys = [key for key in alone if key.startswith(f"{namespace}/{layer}/")]
    assert keys and {key: results[key] for key in keys} == pytest.approx({key: alone[key] for key in keys}, rel=1e-9)
    assert any(results[key] != fitted[1][layer][key.split("/")[-1]] for key in keys)
    # The same data again: the same measurement, recorded without a warning.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.validate(model, loader, verbose=False)
    assert not [w for w in caught if "measures the weights the curves hold" in str(w.message)]
    assert monitor.curves.history[1][layer] == pytest.approx(fitted[1][layer], rel=1e-6)


def test_a_jacobian_non_finite_at_one_input_of_several_logs_nan_and_names_the_inputs(tmp_path):
    x = torch.randn(12, 5, generator=torch.Generator().manual_seed(0))
    x[1, 0] = 1000.0  # net.0 gives NaN in eval mode at this input only
    loader = DataLoader(TensorDataset(x, torch.zeros(12, dtype=torch.long)), batch_size=4)
    model = SmallClassifier(seed=0)

    def nan_at_the_large_input(module, args, output):
        return output if module.training else output * torch.where(args[0][:, :1] > 100, math.nan, 1.0)

    model.net[0].register_forward_hook(nan_at_the_large_input)
    monitor = JacobianRankMonitor(layers=["net.0", "net.2"], num_inputs=3, log_per_input=True, verbose=False)
    with pytest.warns(RuntimeWarning) as record:
        quiet_trainer([monitor], max_epochs=1, default_root_dir=tmp_path).fit(model, loader, loader)
    messages = [str(w.message) for w in record if "partial Jacobian" in str(w.message)]
    assert messages == [
        f"JacobianRankMonitor: the partial Jacobian of block {name!r} holds NaN or Inf values at 1 of the 3 inputs "
        "(input 1); its rank, the mean over the inputs, is logged as NaN while any input's is (log_per_input=True "
        "logs the rank at each input)"
        for name in ("net.0", "net.2")
    ]
    values = monitor.curves.history[0]["net.0"]
    assert math.isnan(values["rank"]) and math.isnan(values["rank_input_1"])
    assert values["rank_input_0"] == values["rank_input_2"] == 5  # the finite inputs keep their ranks


def test_a_head_that_classifies_no_sample_correctly_has_no_classification_dimension(tmp_path):
    model = SmallClassifier(seed=0)
    x = torch.randn(30, 5, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        features = model.net[:2](x)  # the input of the head, net.2
        wrong = (model.net[2](features).argmax(dim=1) + 1) % 3  # every prediction is wrong: full accuracy 0
    with pytest.warns(RuntimeWarning, match=r"none of the 30 samples correctly \(full accuracy 0\)"):
        result = classification_dimension(features, wrong, model.net[2])
    assert math.isnan(result.cls_dim) and not result.defined and result.full_accuracy == 0
    callback = ClassificationDimension(verbose=False)
    loader = DataLoader(TensorDataset(x, wrong), batch_size=8)
    with pytest.warns(RuntimeWarning) as record:
        (results,) = quiet_trainer([callback], default_root_dir=tmp_path).validate(model, loader, verbose=False)
    assert [str(w.message) for w in record if "classifies none" in str(w.message)] == [
        "ClassificationDimension: the head 'net.2' classifies none of the 30 evaluated samples correctly (full "
        "accuracy 0): every k keeps 0.95 of it, so the classification dimension is undefined; clsdim/cls_dim and "
        "clsdim/acc_at_cls_dim are logged as NaN and the figure is not drawn"
    ]
    assert math.isnan(results["clsdim/cls_dim"]) and math.isnan(results["clsdim/acc_at_cls_dim"])
    assert results["clsdim/full_acc"] == 0.0
    assert not (tmp_path / "clsdim" / "accuracy_vs_k.png").exists()
