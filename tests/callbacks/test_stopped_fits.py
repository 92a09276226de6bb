"""A fit stopped by an exception or Ctrl-C keeps what it recorded: the figures are drawn, and a curve file is never
left half written."""

from __future__ import annotations

import io
import json
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from rank_lightning import files
from rank_lightning.callbacks import ActivationRankMonitor, WeightRankMonitor
from rank_lightning.callbacks import curves as curves_module
from rank_lightning.callbacks.curves import FIGURE_DIR, read_curve_file, write_curve_file
from tests.callbacks.trainer_helpers import SmallClassifier, quiet_trainer, small_loader


class _StopsInEpoch(SmallClassifier):
    """Raises ``error`` in the first training step of epoch ``epoch``."""

    def __init__(self, error: BaseException, epoch: int) -> None:
        super().__init__(widths=(5, 12, 3), seed=0)
        self.error, self.stop_epoch = error, epoch

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.current_epoch == self.stop_epoch:
            raise self.error
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize(
    ("error", "raised"), [(RuntimeError("diverged"), RuntimeError), (KeyboardInterrupt(), SystemExit)]
)
def test_a_stopped_fit_draws_the_figures_of_what_it_recorded(tmp_path: Path, error, raised) -> None:
    monitors = [ActivationRankMonitor(verbose=False), WeightRankMonitor(verbose=False)]
    trainer = quiet_trainer(monitors, max_epochs=5, default_root_dir=tmp_path)
    with pytest.raises(raised):
        trainer.fit(_StopsInEpoch(error, epoch=2), small_loader(), small_loader())
    directory = tmp_path / FIGURE_DIR
    for monitor in monitors:
        assert monitor.curves.epochs == [-1, 0, 1]
        drawn = sorted(path.name for path in directory.glob(f"{monitor.curves.namespace}_*.png"))
        assert len(drawn) == len(monitor.curves.drawn_metrics) > 0


def test_a_curve_file_is_replaced_whole_or_not_at_all(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "rank_curves.json"
    first = {0: {"fc": {"numerical_rank": 3.0}}}
    write_curve_file(path, "rank", ["fc"], ["numerical_rank"], first)

    class KilledWhileWriting(io.FileIO):
        def write(self, data: Any) -> int:
            super().write(bytes(data)[: len(data) // 2])
            raise KeyboardInterrupt

    monkeypatch.setattr(files, "open", lambda fd, mode: KilledWhileWriting(fd, mode), raising=False)
    with pytest.raises(KeyboardInterrupt):
        write_curve_file(path, "rank", ["fc"], ["numerical_rank"], {**first, 1: {"fc": {"numerical_rank": 2.0}}})
    monkeypatch.undo()
    assert read_curve_file(path)["history"] == first
    assert [p.name for p in tmp_path.iterdir()] == ["rank_curves.json"]
    json.loads(path.read_text())


def test_ctrl_c_while_the_figures_are_drawn_at_the_end_of_fit_stops_the_drawing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RANK_LIGHTNING_FIGURE_WORKERS", "0")
    drawn: list[str] = []
    draw = curves_module.layer_curves_figure

    def interrupted_at_the_second(namespace: str, metric: str, *args: Any, **kwargs: Any) -> Any:
        drawn.append(f"{namespace}_{metric}")
        if len(drawn) == 2:
            raise KeyboardInterrupt
        return draw(namespace, metric, *args, **kwargs)

    monkeypatch.setattr(curves_module, "layer_curves_figure", interrupted_at_the_second)
    monitors = [WeightRankMonitor(metrics=["stable_rank", "numerical_rank"], verbose=False), ActivationRankMonitor()]
    trainer = quiet_trainer(monitors, max_epochs=2, default_root_dir=tmp_path)
    handler = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(SystemExit), pytest.warns(RuntimeWarning) as caught:
            trainer.fit(SmallClassifier(seed=0), small_loader(), small_loader())
    finally:
        signal.signal(signal.SIGINT, handler)  # Lightning ignores Ctrl-C once it has seen one
    assert drawn == ["weight_stable_rank", "weight_numerical_rank"]  # nothing drawn again, nothing more drawn
    directory = tmp_path / FIGURE_DIR
    messages = [str(w.message) for w in caught if "Ctrl-C" in str(w.message)]
    assert messages == [
        f"{type(m).__name__}: Ctrl-C at the end of fit stopped the figures: those not written yet are not drawn; the "
        f"curves are in {directory / f'{m.curves.namespace}_curves.json'}: python -m rank_lightning.analysis.report "
        "draws them"
        for m in monitors
    ]
    assert sorted(p.name for p in directory.iterdir()) == [
        "rank_curves.json",
        "weight_curves.json",
        "weight_stable_rank.png",
    ]
    assert sorted(read_curve_file(directory / "weight_curves.json")["history"]) == [-1, 0, 1]
