"""WeightRankMonitor's step cadence in a fit resumed at a monitored step with gradient accumulation: the step is
not measured again by the micro-batches that take no optimizer step."""

import warnings

from pytorch_lightning.callbacks import ModelCheckpoint

from rank_lightning.callbacks import WeightRankMonitor
from tests.callbacks.trainer_helpers import SmallClassifier, quiet_trainer, small_loader


def _fit(root, monitor, epochs: int, *extra, **options) -> None:
    trainer = quiet_trainer(
        [monitor, *extra],
        max_epochs=epochs,
        accumulate_grad_batches=2,
        enable_checkpointing=bool(extra),
        default_root_dir=root,
    )
    trainer.fit(SmallClassifier(widths=(5, 6, 3)), small_loader(), **options)  # 4 batches: 2 steps an epoch


def test_a_fit_resumed_at_a_monitored_step_measures_it_once(tmp_path):
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_epochs=1, save_top_k=-1)
    first = WeightRankMonitor(every_n_train_steps=2, verbose=False)
    _fit(tmp_path / "a", first, 1, checkpoint)
    assert sorted(first.curves.history) == [0, 2]
    [saved] = (tmp_path / "ckpt").glob("*.ckpt")  # at step 2, a monitored step
    resumed = WeightRankMonitor(every_n_train_steps=2, verbose=False)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*trained again.*")
        _fit(tmp_path / "b", resumed, 3, ckpt_path=saved)
    assert sorted(resumed.curves.history) == [0, 2, 4, 6]
    assert resumed.curves.superseded == []
    assert resumed.curves.history[2] == first.curves.history[2]  # the loaded value, not measured again
