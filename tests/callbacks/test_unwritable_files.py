"""A run directory that cannot be written (a full disk, a read-only folder) costs the files, never the fit or the
files written before."""

import errno
import math
import os
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
from torch.utils.data import DataLoader

from rank_lightning import files
from rank_lightning.callbacks import ActivationRankMonitor, WeightRankMonitor
from rank_lightning.callbacks import curves as curves_module
from rank_lightning.callbacks.curves import FIGURE_DIR, LayerCurves, read_curve_file, write_curve_file
from rank_lightning.plotting import layer_curves_figure, save_figure
from tests.callbacks.trainer_helpers import SmallClassifier, quiet_trainer, small_data


def _no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def _interrupt(*args, **kwargs):
    raise KeyboardInterrupt


def _record(curves: LayerCurves, trainer: SimpleNamespace, epoch: int) -> None:
    trainer.current_epoch = epoch
    curves.record_and_log(trainer, SimpleNamespace(log_dict=lambda *a, **k: None), {"a": {"m": float(epoch)}})


def test_a_curve_file_that_cannot_be_written_is_a_warning_once_and_the_last_one_written_stays_whole(
    tmp_path, monkeypatch
):
    curves = LayerCurves("test", wandb_charts=False)
    trainer = SimpleNamespace(
        is_global_zero=True, loggers=[], default_root_dir=str(tmp_path), sanity_checking=False, current_epoch=0
    )
    _record(curves, trainer, 0)
    path = tmp_path / FIGURE_DIR / "test_curves.json"
    monkeypatch.setattr(files.os, "replace", _no_space)
    monkeypatch.setattr(curves_module, "append_curve_point", _no_space)  # the full disk takes appended points too
    with pytest.warns(RuntimeWarning, match=r"could not write \S*test_curves\.json \(OSError\(28, 'No space") as caught:
        _record(curves, trainer, 1)
        _record(curves, trainer, 2)  # the same error again: no second warning
    assert len(caught) == 1
    assert read_curve_file(path)["history"] == {0: {"a": {"m": 0.0}}}
    assert os.listdir(path.parent) == ["test_curves.json"]  # no partial file left
    monkeypatch.undo()
    _record(curves, trainer, 3)
    assert sorted(read_curve_file(path)["history"]) == [0, 1, 2, 3]


def test_a_fit_into_an_unwritable_run_directory_ends_normally_and_names_every_file_it_could_not_write(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("RANK_LIGHTNING_FIGURE_WORKERS", "0")
    monkeypatch.setattr(files.os, "replace", _no_space)
    monitor = ActivationRankMonitor(metrics=["numerical_rank", "stable_rank"], verbose=False)
    trainer = quiet_trainer([monitor], max_epochs=2, default_root_dir=tmp_path)
    loader = DataLoader(small_data(32), batch_size=8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(SmallClassifier(seed=0), loader, loader)
    assert trainer.state.finished and trainer.current_epoch == 2
    assert monitor.curves.epochs == [-1, 0, 1]
    messages = [str(w.message) for w in caught if "No space left" in str(w.message)]
    directory = tmp_path / FIGURE_DIR
    assert [m for m in messages if "could not write" in m] == [
        f"LayerCurves: could not write {directory / 'rank_curves.json'} (OSError(28, 'No space left on device')); "
        "the run goes on, the curves are kept in memory, in checkpoints and in the loggers"
    ]
    for metric in ("numerical_rank", "stable_rank"):
        assert sum(f"so {directory / f'rank_{metric}.png'} is not written" in m for m in messages) == 1
    assert os.listdir(directory) == []


def test_a_figure_that_fails_to_write_leaves_the_earlier_file_whole(tmp_path, monkeypatch):
    history = {0: {"a": {"m": 1.0}}, 1: {"a": {"m": math.nan}}}
    path = save_figure(layer_curves_figure("ns", "m", ["a"], history), tmp_path / "ns_m.png")
    before = path.read_bytes()
    original = files.os.replace

    def full_disk_after_half(source, target):  # the disk fills up half way through the file
        with open(source, "r+b") as handle:
            handle.truncate(len(before) // 2)
        _no_space()

    monkeypatch.setattr(files.os, "replace", full_disk_after_half)
    for name in ("ns_m.png", "ns_m.pdf"):
        with pytest.raises(OSError, match="No space left"):
            save_figure(layer_curves_figure("ns", "m", ["a"], {0: {"a": {"m": 2.0}}}), tmp_path / name)
    monkeypatch.setattr(files.os, "replace", original)
    monkeypatch.setattr("rank_lightning.plotting.zlib.compress", _interrupt)  # Ctrl-C while the pixels are packed
    with pytest.raises(KeyboardInterrupt):
        save_figure(layer_curves_figure("ns", "m", ["a"], {0: {"a": {"m": 2.0}}}), path)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["ns_m.png"]


def test_a_second_fit_into_the_same_folder_keeps_the_files_of_the_first_under_another_name(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK_LIGHTNING_FIGURE_WORKERS", "0")

    def fit(seed: int) -> WeightRankMonitor:
        monitor = WeightRankMonitor(metrics=["stable_rank"], save_singular_values=True, verbose=False)
        trainer = quiet_trainer([monitor], max_epochs=2, default_root_dir=tmp_path)  # logger=False: one folder
        trainer.fit(SmallClassifier(seed=seed), DataLoader(small_data(32), batch_size=8))
        return monitor

    first = fit(seed=0)
    directory = tmp_path / FIGURE_DIR
    spectra = (directory / "weight_singular_values" / "epoch_0001.npz").read_bytes()
    figure = (directory / "weight_stable_rank.png").read_bytes()
    with pytest.warns(UserWarning) as caught:
        second = fit(seed=1)
    assert sorted(str(w.message) for w in caught if "another run" in str(w.message)) == [
        f"LayerCurves('weight'): {directory / 'weight_curves.json'} held the curves of another run; they are kept as "
        "weight_curves-v1.json and this run writes its own",
        f"LayerCurves('weight'): {directory / 'weight_singular_values'} held the singular values of another run; they "
        "are kept as weight_singular_values-v1 and this run writes its own",
        f"LayerCurves('weight'): {directory / 'weight_stable_rank.png'} held the figures of another run; they are "
        "kept as weight_stable_rank-v1.png and this run writes its own",
    ]
    assert (directory / "weight_stable_rank-v1.png").read_bytes() == figure
    assert read_curve_file(directory / "weight_curves-v1.json")["history"] == first.curves.history
    assert read_curve_file(directory / "weight_curves.json")["history"] == second.curves.history
    assert first.curves.history != second.curves.history
    assert (directory / "weight_singular_values-v1" / "epoch_0001.npz").read_bytes() == spectra
    assert sorted(p.name for p in (directory / "weight_singular_values").iterdir()) == [
        "epoch_-001.npz",
        "epoch_0000.npz",
        "epoch_0001.npz",
    ]


def test_a_curve_file_written_meanwhile_by_another_run_is_set_aside_before_the_next_write(tmp_path):
    curves = LayerCurves("test", wandb_charts=False)
    trainer = SimpleNamespace(
        is_global_zero=True, loggers=[], default_root_dir=str(tmp_path), sanity_checking=False, current_epoch=0
    )
    _record(curves, trainer, 0)
    path = tmp_path / FIGURE_DIR / "test_curves.json"
    write_curve_file(path, "test", ["a"], ["m"], {0: {"a": {"m": 7.0}}})  # another run writing the same folder
    with pytest.warns(UserWarning, match=r"test_curves\.json held the curves of another run; they are kept as "):
        _record(curves, trainer, 1)
    _record(curves, trainer, 2)  # its own file again: written over without a word
    assert read_curve_file(path.with_name("test_curves-v1.json"))["history"] == {0: {"a": {"m": 7.0}}}
    assert read_curve_file(path)["history"] == {e: {"a": {"m": float(e)}} for e in range(3)}


def test_a_figure_that_matplotlib_cannot_draw_is_named_and_the_others_are_drawn(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK_LIGHTNING_FIGURE_WORKERS", "0")
    draw = layer_curves_figure

    def fails_on_inf(namespace, metric, layers, history, **kwargs):
        if any(math.isinf(m.get(metric, 0.0)) for values in history.values() for m in values.values()):
            raise ValueError("Axis limits cannot be NaN or Inf")
        return draw(namespace, metric, layers, history, **kwargs)

    monkeypatch.setattr("rank_lightning.callbacks.curves.layer_curves_figure", fails_on_inf)
    curves = LayerCurves("test")
    for epoch in range(2):
        curves.record(epoch, {"a": {"good": 1.0 + epoch, "bad": math.inf, "also_good": 2.0}})
    with pytest.warns(RuntimeWarning) as caught:
        paths = curves.write_figures(SimpleNamespace(is_global_zero=True, loggers=[], default_root_dir=str(tmp_path)))
    directory = tmp_path / FIGURE_DIR
    assert paths == [directory / "test_good.png", directory / "test_also_good.png"]
    assert [str(w.message) for w in caught] == [
        "LayerCurves: drawing 'test' 'bad' failed (ValueError('Axis limits cannot be NaN or Inf')), so "
        f"{directory / 'test_bad.png'} is not written; the curves are in test_curves.json and python -m "
        "rank_lightning.analysis.report can draw them"
    ]


def test_a_run_directory_that_cannot_be_searched_is_a_warning_too(tmp_path, monkeypatch):
    (tmp_path / FIGURE_DIR).mkdir()
    stat = Path.stat

    def denied(self, *args, **kwargs):  # a folder without search permission (as root, chmod would not deny it)
        if FIGURE_DIR in self.parts:
            raise PermissionError(errno.EACCES, "Permission denied")
        return stat(self, *args, **kwargs)

    monkeypatch.setattr(Path, "stat", denied)
    curves = LayerCurves("test", wandb_charts=False)
    trainer = SimpleNamespace(
        is_global_zero=True, loggers=[], default_root_dir=str(tmp_path), sanity_checking=False, current_epoch=0
    )
    with pytest.warns(RuntimeWarning, match=r"could not write \S*test_curves\.json \(PermissionError\(13"):
        _record(curves, trainer, 0)
    assert curves.epochs == [0]
