"""Edges of a monitor's life around ``fit``: an evaluation of other data after the fit, a tuner that fails, a layer
whose measurement is non-finite at some inputs only, a classifier that never reaches its threshold."""

import pytest

from rank_lightning.callbacks import ActivationRankMonitor, NeuralCollapseMonitor
from rank_lightning.callbacks.curves import read_curve_file
from tests.callbacks.trainer_helpers import SmallClassifier, quiet_trainer, small_loader


@pytest.mark.parametrize(
    ("make", "namespace"),
    [
        (lambda: ActivationRankMonitor(layers=["net.1"], verbose=False), "rank"),
        (lambda: NeuralCollapseMonitor(verbose=False), "neural_collapse"),
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
    returned = {key.split("/")[-1]: value for key, value in results.items() if key.startswith(f"{namespace}/{layer}/")}
    assert returned and returned != fitted[1][layer]  # the other data's values, returned by trainer.validate
    # The same data again: the same measurement, recorded without a warning.
    trainer.validate(model, loader, verbose=False)
    assert monitor.curves.history[1][layer] == pytest.approx(fitted[1][layer], rel=1e-9)
