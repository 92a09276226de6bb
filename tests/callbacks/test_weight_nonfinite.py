"""A weight matrix holding NaN during a fit: its metrics are NaN, a warning names it once, the others are measured."""

import math
import warnings

import torch
from torch import nn

from rank_lightning.callbacks import WeightRankMonitor
from tests.callbacks.trainer_helpers import SmallClassifier, quiet_trainer, small_loader


class _WithBrokenSpare(SmallClassifier):
    def __init__(self) -> None:
        super().__init__(widths=(5, 6, 3))
        self.spare = nn.Linear(4, 4)  # not in the forward pass: stays NaN while the rest trains
        with torch.no_grad():
            self.spare.weight[0, 1] = math.nan

    def configure_optimizers(self):
        return torch.optim.SGD(self.net.parameters(), lr=0.1)


def test_nan_weights_are_named_once_and_leave_the_other_layers_measured(tmp_path):
    monitor = WeightRankMonitor(verbose=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_trainer([monitor], max_epochs=3, default_root_dir=tmp_path).fit(_WithBrokenSpare(), small_loader())
    named = [str(w.message) for w in caught if "NaN or Inf weights" in str(w.message)]
    assert named == [
        "WeightRankMonitor: layer 'spare' has NaN or Inf weights (before training): its metrics are NaN "
        "while it does; the other layers are measured as usual."
    ]
    history = monitor.curves.history
    assert sorted(history) == [-1, 0, 1, 2]
    for values in history.values():
        assert all(math.isnan(v) for v in values["spare"].values())
        assert all(math.isfinite(v) for layer in ("net.0", "net.2") for v in values[layer].values())
