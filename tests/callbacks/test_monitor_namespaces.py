"""Two monitors of one kind in one Trainer: distinct namespaces keep their keys, curve files and figures apart; the
same namespace is an error at setup instead of files overwritten without a word."""

import pytest
import torch
from pytorch_lightning.loggers import CSVLogger

from rank_lightning.callbacks import ActivationRankMonitor, WeightRankMonitor
from rank_lightning.callbacks.curves import FIGURE_DIR, read_curve_file
from tests.callbacks.trainer_helpers import SmallClassifier, quiet_trainer, small_loader


def _fit(root, callbacks) -> None:
    logger = CSVLogger(root, name="run", version=0)
    quiet_trainer(callbacks, max_epochs=2, logger=logger).fit(
        SmallClassifier(widths=(5, 12, 8, 3)), small_loader(), small_loader()
    )


@pytest.mark.parametrize(
    "make",
    [
        lambda ns, layer: ActivationRankMonitor(layers=[("net.1", "net.3")[layer]], namespace=ns, verbose=False),
        lambda ns, layer: WeightRankMonitor(layers=[("net.0", "net.2")[layer]], namespace=ns, verbose=False),
    ],
    ids=["activation", "weight"],
)
def test_two_monitors_of_a_kind_need_two_namespaces(tmp_path, make):
    # Other layers: Lightning accepts both states, but every key and file would be written twice.
    with pytest.raises(ValueError, match=r"both log under namespace '(rank|weight)'.*namespace='\.\.\.'"):
        _fit(tmp_path / "same", [make(None, 0), make(None, 1)])
    first, second = make(None, 0), make("second", 1)
    _fit(tmp_path / "apart", [first, second])
    directory = tmp_path / "apart" / "run" / "version_0" / FIGURE_DIR
    default = first.curves.namespace
    files = {path.name for path in directory.glob("*_curves.json")}
    assert files == {f"{default}_curves.json", "second_curves.json"}
    assert read_curve_file(directory / "second_curves.json")["history"] == second.curves.history
    assert read_curve_file(directory / f"{default}_curves.json")["layers"] == first.curves.layers
    assert first.curves.layers != second.curves.layers
    assert len(list(directory.glob("second_*.png"))) == len(second.curves.drawn_metrics)
    header = (tmp_path / "apart" / "run" / "version_0" / "metrics.csv").read_text().splitlines()[0].split(",")
    assert any(key.startswith(f"{default}/") for key in header) and any(key.startswith("second/") for key in header)
    # The same layers apart by namespace: Lightning keeps both states in checkpoints.
    assert make(None, 0).state_key != make("second", 0).state_key


@pytest.mark.parametrize("bad", ["", "a/b", "_rank", "rank train"])
def test_a_namespace_that_cannot_name_keys_is_named(bad):
    with pytest.raises(ValueError, match=rf"namespace={bad!r} cannot name logged keys and files"):
        ActivationRankMonitor(namespace=bad)
    with pytest.raises(ValueError, match=rf"namespace={bad!r} cannot name logged keys and files"):
        WeightRankMonitor(namespace=bad)


def _monitors(layers):
    return [
        ActivationRankMonitor(layers=layers, verbose=False),
        WeightRankMonitor(layers=layers, verbose=False),
        ActivationRankMonitor(stage="train", layers=layers, verbose=False),
    ]


def _fit_to(tmp_path, callbacks, epochs, ckpt_path=None):
    trainer = quiet_trainer(callbacks, max_epochs=epochs, default_root_dir=tmp_path)
    trainer.fit(SmallClassifier(widths=(5, 12, 8, 3), seed=0), small_loader(), small_loader(), ckpt_path=ckpt_path)
    return trainer


def test_a_resumed_fit_continues_the_curves_whatever_its_layers_argument(tmp_path):
    first = _monitors(None)
    checkpoint = str(tmp_path / "first.ckpt")
    _fit_to(tmp_path, first, 1).save_checkpoint(checkpoint)
    # The layers the defaults chose, now named: other state keys, the same namespaces.
    resumed = _monitors(["net.0", "net.2", "net.4"])
    _fit_to(tmp_path, resumed, 2, checkpoint)
    for before, after in zip(first, resumed, strict=True):
        assert after.state_key != before.state_key
        assert after.curves.epochs == [*before.curves.epochs, 1]
        assert {e: after.curves.history[e] for e in before.curves.epochs} == before.curves.history


def test_curves_saved_under_another_key_of_their_class_are_found(tmp_path):
    first = _monitors(None)
    checkpoint = tmp_path / "first.ckpt"
    _fit_to(tmp_path, first, 1).save_checkpoint(checkpoint)
    saved = torch.load(checkpoint, weights_only=False)
    # Keys of other settings (a key with a namespace that is not the curves' own is a state of another monitor).
    old_keys = [
        "ActivationRankMonitor{'layers': ['net.4'], 'stage': 'val'}",
        "WeightRankMonitor",
        "ActivationRankMonitor{'layers': ['net.0'], 'stage': 'train'}",
    ]
    saved["callbacks"] = {old: saved["callbacks"][m.state_key] for old, m in zip(old_keys, first, strict=True)}
    torch.save(saved, checkpoint)
    resumed = _monitors(None)
    _fit_to(tmp_path, resumed, 2, str(checkpoint))
    for before, after in zip(first, resumed, strict=True):
        assert after.curves.epochs == [*before.curves.epochs, 1]
        assert {e: after.curves.history[e] for e in before.curves.epochs} == before.curves.history


def test_a_namespace_that_is_another_monitors_test_keys_is_refused(tmp_path):
    # ActivationRankMonitor logs trainer.test values under "<namespace>_test/": a monitor named so would share them.
    monitors = [ActivationRankMonitor(verbose=False), WeightRankMonitor(namespace="rank_test", verbose=False)]
    with pytest.raises(ValueError, match=r"namespaces 'rank' and 'rank_test': the values of trainer.test runs"):
        _fit(tmp_path, monitors)
    _fit(tmp_path, [ActivationRankMonitor(verbose=False), WeightRankMonitor(namespace="rank_tested", verbose=False)])
