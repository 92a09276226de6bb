"""The files and points a user already has survive evaluation calls and debug runs: an older checkpoint evaluated after
a fit, a second fit into the same folder, a ``fast_dev_run``."""

import json

import pytest
import torch
from pytorch_lightning.callbacks import ModelCheckpoint

from rank_lightning.callbacks import (
    ActivationRankMonitor,
    AdversarialValidation,
    ClassificationDimension,
    WeightRankMonitor,
)
from rank_lightning.callbacks.curves import read_curve_file
from rank_lightning.data import DigitsDataModule
from rank_lightning.modules import ImageClassifier
from tests.callbacks.trainer_helpers import SmallClassifier, quiet_trainer, small_loader


@pytest.mark.parametrize("evaluation", ["validate", "test"])
def test_evaluating_an_older_checkpoint_keeps_the_fits_points(tmp_path, evaluation):
    loader = small_loader(48)
    monitor = ActivationRankMonitor(layers=["net.1"], verbose=False)
    saved = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1)
    trainer = quiet_trainer([monitor, saved], max_epochs=3, enable_checkpointing=True, default_root_dir=tmp_path)
    model = SmallClassifier(lr=0.2)
    model.test_step = model.validation_step
    trainer.fit(model, loader, loader)
    fitted = monitor.curves.history
    assert sorted(fitted) == [-1, 0, 1, 2] and fitted[0] != fitted[2]
    getattr(trainer, evaluation)(model, loader, ckpt_path=tmp_path / "ckpt" / "epoch=0-step=6.ckpt", verbose=False)
    assert sorted(monitor.curves.history) == [-1, 0, 1, 2]  # the checkpoint's saved curves drop none of them
    trainer.validate(model, loader, verbose=False)  # the module holds the epoch-0 weights still
    stored = read_curve_file(tmp_path / "rank_curves" / "rank_curves.json")
    for history in (monitor.curves.history, stored["history"]):
        assert sorted(history) == [-1, 0, 1, 2]
        assert {e: history[e] for e in (-1, 1, 2)} == {e: fitted[e] for e in (-1, 1, 2)}
        for metric, value in fitted[0]["net.1"].items():  # measured again, at the checkpoint's epoch
            assert history[0]["net.1"][metric] == pytest.approx(value, rel=1e-12, abs=1e-12), metric
    assert stored["superseded"] == []


def test_a_fresh_fit_keeps_the_figures_of_another_run(tmp_path):
    loader = small_loader(48)
    first = ActivationRankMonitor(layers=["net.1"], verbose=False)
    quiet_trainer([first], max_epochs=1, default_root_dir=tmp_path).fit(SmallClassifier(lr=0.2), loader, loader)
    figure = tmp_path / "rank_curves" / "rank_numerical_rank.png"
    earlier = figure.read_bytes()
    second = ActivationRankMonitor(layers=["net.1"], verbose=False)
    with pytest.warns(UserWarning) as caught:
        quiet_trainer([second], max_epochs=2, default_root_dir=tmp_path).fit(SmallClassifier(lr=0.2), loader, loader)
    about_figures = [str(w.message) for w in caught if "figures of another run" in str(w.message)]
    figures = sorted(p.name for p in (tmp_path / "rank_curves").glob("*-v1.png"))
    assert len(figures) == len(first.curves.drawn_metrics) > 1
    assert len(about_figures) == 1  # one warning for every figure kept
    head = f"LayerCurves('rank'): {len(figures)} files in {tmp_path / 'rank_curves'} held the figures of another run; "
    start, end = head + "they are kept (", ") and this run writes its own"
    assert about_figures[0].startswith(start) and about_figures[0].endswith(end)
    kept = about_figures[0][len(start) : -len(end)].split(", ")
    assert sorted(kept) == [f"{name.replace('-v1', '')} as {name}" for name in figures]
    assert (tmp_path / "rank_curves" / "rank_numerical_rank-v1.png").read_bytes() == earlier
    assert figure.read_bytes() != earlier  # this run's own figure, of two epochs
    assert sorted(read_curve_file(tmp_path / "rank_curves" / "rank_curves-v1.json")["history"]) == [-1, 0]


def test_fast_dev_run_measures_but_writes_no_files(tmp_path):
    loader = small_loader(48)
    (tmp_path / "rank_curves").mkdir()
    (tmp_path / "rank_curves" / "rank_curves.json").write_text("a real run's curves")
    activations = ActivationRankMonitor(layers=["net.1"], verbose=False)
    weights = WeightRankMonitor(save_singular_values=True, verbose=False)
    clsdim = ClassificationDimension(verbose=False)
    trainer = quiet_trainer([activations, weights, clsdim], fast_dev_run=True, default_root_dir=tmp_path)
    trainer.fit(SmallClassifier(lr=0.2), loader, loader)
    assert sorted(activations.curves.history) == [-1, 0]
    assert sorted(weights.curves.history) == [-1, 0]
    assert clsdim.result is not None and clsdim.result.ambient_dim == 12
    assert "rank/net.1/numerical_rank" in trainer.callback_metrics
    assert sorted(path.name for path in tmp_path.rglob("*")) == ["rank_curves", "rank_curves.json"]
    assert (tmp_path / "rank_curves" / "rank_curves.json").read_text() == "a real run's curves"


def test_validating_an_older_checkpoint_anew_keeps_the_later_epochs_of_the_curve_file(tmp_path):
    loader = small_loader(48)
    fitted = ActivationRankMonitor(layers=["net.1"], verbose=False)
    saved = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1)
    trainer = quiet_trainer([fitted, saved], max_epochs=3, enable_checkpointing=True, default_root_dir=tmp_path)
    trainer.fit(SmallClassifier(lr=0.2), loader, loader)
    checkpoint = tmp_path / "ckpt" / "epoch=0-step=6.ckpt"
    # A new process validates the epoch-0 checkpoint in the fit's folder: the file's later epochs are this run's.
    monitor = ActivationRankMonitor(layers=["net.1"], verbose=False)
    quiet_trainer([monitor], default_root_dir=tmp_path).validate(SmallClassifier(), loader, ckpt_path=checkpoint)
    stored = read_curve_file(tmp_path / "rank_curves" / "rank_curves.json")["history"]
    assert sorted(stored) == sorted(monitor.curves.history) == [-1, 0, 1, 2]
    assert {e: stored[e] for e in (-1, 1, 2)} == {e: fitted.curves.history[e] for e in (-1, 1, 2)}
    # In a folder holding another run's curves, those (and their figures) are kept under another name.
    other = tmp_path / "other"
    quiet_trainer([ActivationRankMonitor(layers=["net.1"], verbose=False)], max_epochs=1, default_root_dir=other).fit(
        SmallClassifier(lr=0.2, seed=3), loader, loader
    )
    earlier = read_curve_file(other / "rank_curves" / "rank_curves.json")["history"]
    monitor = ActivationRankMonitor(layers=["net.1"], verbose=False)
    with pytest.warns(UserWarning, match=r"rank_curves\.json held the curves of another run; they are kept as "):
        quiet_trainer([monitor], default_root_dir=other).validate(SmallClassifier(), loader, ckpt_path=checkpoint)
    assert read_curve_file(other / "rank_curves" / "rank_curves-v1.json")["history"] == earlier
    assert (other / "rank_curves" / "rank_numerical_rank-v1.png").is_file()
    assert sorted(read_curve_file(other / "rank_curves" / "rank_curves.json")["history"]) == [-1, 0]


def test_a_checkpoint_saved_inside_an_epoch_is_not_recorded_over_that_epochs_measurement(tmp_path):
    loader = small_loader(48)  # 6 batches per epoch: step 3 is inside epoch 0
    monitor = ActivationRankMonitor(layers=["net.1"], verbose=False)
    saved = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
    trainer = quiet_trainer([monitor, saved], max_epochs=2, enable_checkpointing=True, default_root_dir=tmp_path)
    model = SmallClassifier(lr=0.2)
    trainer.fit(model, loader, loader)
    fitted = monitor.curves.history
    with pytest.warns(UserWarning, match=r"\(epoch 0, step 3\) was saved before its epoch's measurement"):
        (results,) = trainer.validate(model, loader, ckpt_path=tmp_path / "ckpt" / "epoch=0-step=3.ckpt")
    assert results["rank/net.1/numerical_rank"] >= 1  # logged and returned
    assert monitor.curves.history == fitted == read_curve_file(tmp_path / "rank_curves" / "rank_curves.json")["history"]


def test_adversarial_evaluations_of_an_older_checkpoint_keep_the_fits_points(tmp_path):
    torch.manual_seed(0)
    model = ImageClassifier(backbone="mlp", backbone_kwargs={"depth": 1, "width": 16}, input_shape=(1, 8, 8))
    callback = AdversarialValidation(eps=[2 / 255], attacks=["fgsm"], max_samples=32, verbose=False)
    saved = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1)
    options = dict(limit_train_batches=2, limit_val_batches=1, inference_mode=False, default_root_dir=tmp_path)
    trainer = quiet_trainer([callback, saved], max_epochs=3, enable_checkpointing=True, **options)
    data = DigitsDataModule(batch_size=64)
    trainer.fit(model, datamodule=data)
    fitted = {point: dict(values) for point, values in callback.history["validate"].items()}
    assert sorted(fitted)[-3:] == [0, 1, 2]
    trainer.validate(model, datamodule=data, ckpt_path=tmp_path / "ckpt" / "epoch=0-step=2.ckpt", verbose=False)
    trainer.validate(model, datamodule=data, verbose=False)  # the module holds the epoch-0 weights still
    history = callback.history["validate"]
    assert sorted(history) == sorted(fitted) and history[1] == fitted[1] and history[2] == fitted[2]
    assert history[0]["clean_acc"] == pytest.approx(fitted[0]["clean_acc"], abs=1e-12)
    stored = json.loads((tmp_path / "rank_curves" / "adversarial.json").read_text())
    assert sorted(int(point) for point in stored) == sorted(fitted)
