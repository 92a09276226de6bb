"""What the activation monitor tells a user: settings that do not fit stop the fit at the initial pass, warnings
give the real reason, the memory plan is printed once, captions name the tolerance's dtype."""

import logging
import math
import warnings
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader

from rank_lightning.callbacks import (
    ActivationRankMonitor,
    JacobianRankMonitor,
    NeuralCollapseMonitor,
    WeightRankMonitor,
)
from rank_lightning.functional import participation_ratio
from rank_lightning.plotting import caption_text, layer_curves_figure
from tests.callbacks.trainer_helpers import SmallClassifier, quiet_trainer, small_loader


class _NoForward(SmallClassifier):
    forward = nn.Module.forward  # nn.Module's unimplemented forward: the steps call self.net


def _fit(root, monitor, model=None, epochs: int = 2, rows: int = 32) -> None:
    trainer = quiet_trainer([monitor], max_epochs=epochs, default_root_dir=root)
    trainer.fit(model or SmallClassifier(), small_loader(rows), small_loader(rows))


def test_a_setting_that_does_not_fit_stops_the_fit_at_the_initial_pass(tmp_path):
    monitor = ActivationRankMonitor(layers=["net.1"], memory_budget_mb=1e-5, verbose=False)
    with pytest.raises(MemoryError, match=r"layer 'net.1' \(12 features\) needs"):
        _fit(tmp_path, monitor)
    assert not monitor.curves.epochs


def test_a_module_without_forward_is_told_to_define_one(tmp_path):
    monitor = ActivationRankMonitor(layers=["net.1"], verbose=False)
    with pytest.warns(UserWarning, match=r"no initial point.*defines no forward\(\): define one"):
        _fit(tmp_path, monitor, _NoForward())
    assert sorted(monitor.curves.epochs) == [0, 1]  # the epochs are measured from validation_step's passes


def test_the_row_cap_warning_names_what_limits_the_rows(tmp_path):
    capped = ActivationRankMonitor(layers=["net.1"], max_samples=6, verbose=False)
    with pytest.warns(UserWarning, match=r"fewer than its 12 features.*raise max_samples to measure more rows"):
        _fit(tmp_path / "a", capped, epochs=1)
    few = ActivationRankMonitor(layers=["net.1"], max_samples=None, verbose=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit(tmp_path / "b", few, epochs=1, rows=8)  # every row there is: 8
    rows = [str(w.message) for w in caught if "fewer than its 12 features" in str(w.message)]
    assert rows and all("measure more batches to measure more rows" in m for m in rows)


def test_the_fallback_warning_names_the_memory_budget_when_it_is_the_reason(tmp_path):
    model = SmallClassifier()
    model.num_classes = None  # no class states: the 12 x 12 Gram alone is over the budget
    monitor = ActivationRankMonitor(layers=["net.1"], memory_budget_mb=0.001, verbose=False)
    with pytest.warns(UserWarning, match=r"12 x 12 Gram does not fit in its share of memory_budget_mb"):
        _fit(tmp_path, monitor, model, epochs=1)


def test_the_memory_plan_is_printed_once(tmp_path, caplog):
    monitor = ActivationRankMonitor(layers=["net.1", "net.2"], verbose=True)
    with caplog.at_level(logging.INFO):
        _fit(tmp_path, monitor, epochs=3)
    assert len(monitor.curves.epochs) == 4  # four passes (the initial one and three epochs)
    assert sum("state of 2 layers" in record.getMessage() for record in caplog.records) == 1


def test_window_batches_without_a_step_cadence_is_an_error():
    with pytest.raises(ValueError, match=r"window_batches=4 .* every_n_train_steps is not set"):
        ActivationRankMonitor(window_batches=4)


def test_captions_and_titles_follow_the_settings():
    assert caption_text({"rank_tolerance": None, "tolerance_size": "min"}).endswith(
        "float32 eps \u00d7 min(rows, columns) (default)"
    )
    text = caption_text({"rank_tolerance": None, "tolerance_size": "min", "tolerance_dtype": "bfloat16"})
    assert text == "rank tolerance: bfloat16 eps"  # no K: eps_bf16 * K would reach 1 at K = 128
    text = caption_text({"rank_tolerance": None, "tolerance_size": "min", "tolerance_dtype": "torch.float16"})
    assert text == "rank tolerance: float16 eps"  # a dtype written as torch prints it
    text = caption_text({"rank_tolerance": None, "tolerance_size": "max", "tolerance_dtype": "float64"})
    assert text == "rank tolerance: float64 eps \u00d7 max(rows, columns)"
    text = caption_text({"rank_tolerance": None, "tolerance_size": "min", "tolerance_dtype": "input"})
    assert text == "rank tolerance: eps of the activations' dtype (\u00d7 min(rows, columns) for float32)"
    text = caption_text({"rank_tolerance": None, "tolerance_dtype": "input", "measured": "weights"})
    assert text == "rank tolerance: eps of the weights' dtype"  # "measured" is no caption part of its own
    history = {step: {"a": {"numerical_rank": float(step)}} for step in (0, 50, 100)}
    figure = layer_curves_figure("rank", "numerical_rank", ["a"], history, x_label="step")
    titles = [axes.get_title() for axes in figure.axes]
    assert any(title.startswith("against step, one line per layer") for title in titles), titles


def test_a_cadence_that_meets_validation_seldom_is_named(tmp_path):
    monitor = ActivationRankMonitor(layers=["net.1"], every_n_epochs=3, log_at_init=False, verbose=False)
    trainer = quiet_trainer([monitor], max_epochs=6, check_val_every_n_epoch=2, default_root_dir=tmp_path)
    message = r"every_n_epochs=3 with check_val_every_n_epoch=2: .* this monitor measures once in 6 epochs"
    with pytest.warns(UserWarning, match=message):
        trainer.fit(SmallClassifier(), small_loader(), small_loader())
    assert monitor.curves.epochs == [5]  # (epoch + 1) divisible by 3 and by 2
    aligned = ActivationRankMonitor(layers=["net.1"], every_n_epochs=4, log_at_init=False, verbose=False)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*check_val_every_n_epoch.*")
        quiet_trainer([aligned], max_epochs=4, check_val_every_n_epoch=2, default_root_dir=tmp_path / "b").fit(
            SmallClassifier(), small_loader(), small_loader()
        )
    assert aligned.curves.epochs == [3]


@pytest.mark.parametrize("limit", [0, 0.0])
@pytest.mark.parametrize(
    "make",
    [
        lambda: ActivationRankMonitor(layers=["net.1"], log_at_init=False, verbose=False),
        lambda: NeuralCollapseMonitor(log_at_init=False, verbose=False),
        lambda: JacobianRankMonitor(verbose=False),
    ],
    ids=["activation", "neural_collapse", "jacobian"],
)
def test_a_fit_without_validation_is_named_by_every_validation_monitor(tmp_path, make, limit):
    monitor = make()
    trainer = quiet_trainer([monitor], max_epochs=2, limit_val_batches=limit, default_root_dir=tmp_path)
    message = rf"{type(monitor).__name__}: limit_val_batches={limit!r}: this fit runs no validation"
    with pytest.warns(UserWarning, match=message):
        trainer.fit(SmallClassifier(), small_loader(), small_loader())
    assert not monitor.curves.epochs


def test_a_fit_without_validation_warns_no_monitor_that_measures_elsewhere(tmp_path):
    monitors = [
        ActivationRankMonitor(layers=["net.1"], stage="train", log_at_init=False, verbose=False),
        WeightRankMonitor(log_at_init=False, verbose=False),
    ]
    trainer = quiet_trainer(monitors, max_epochs=2, limit_val_batches=0, default_root_dir=tmp_path)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*runs no validation.*")
        trainer.fit(SmallClassifier(), small_loader(), small_loader())
    assert [m.curves.epochs for m in monitors] == [[0, 1], [0, 1]]


def test_a_dead_layer_is_named_with_what_it_logs(tmp_path):
    model = SmallClassifier(lr=0.0)
    with torch.no_grad():
        model.net[0].weight.zero_()
        model.net[0].bias.fill_(-1.0)  # every input of the ReLU net.1 is -1: its outputs are all zero
    monitor = ActivationRankMonitor(layers=["net.0", "net.1"], log_at_init=False, verbose=False, num_classes=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit(tmp_path, monitor, model, epochs=1)
    dead = [str(w.message) for w in caught if "gave only zeros" in str(w.message)]
    assert len(dead) == 1 and dead[0].startswith("ActivationRankMonitor: layer 'net.1' gave only zeros at epoch 0")
    values = monitor.curves.history[0]["net.1"]
    assert values["numerical_rank"] == 0 and values["effective_rank"] == 0
    assert math.isnan(values["variance_ratio_1"]) and math.isnan(values["tcv_normalized"])
    assert monitor.curves.history[0]["net.0"]["numerical_rank"] == 1  # the constant rows -1 before the ReLU


def test_a_constant_layer_measured_centred_is_named_with_what_it_logs(tmp_path):
    model = SmallClassifier(lr=0.0)
    with torch.no_grad():
        model.net[0].weight.zero_()  # net.0 gives its bias for every input
    monitor = ActivationRankMonitor(layers=["net.0"], center=True, log_at_init=False, verbose=False)
    message = r"layer 'net.0' gave the same output for every input at epoch 0 \(a constant layer; centred, it is zero\)"
    with pytest.warns(UserWarning, match=message):
        _fit(tmp_path, monitor, model, epochs=1)
    values = monitor.curves.history[0]["net.0"]
    assert values["numerical_rank"] == 0 and math.isnan(values["variance_ratio_1"])


class _RefusesLoaderBatches(SmallClassifier):
    def forward(self, x):
        raise ValueError("this model takes its inputs through its steps only")


@pytest.mark.parametrize("make", [NeuralCollapseMonitor, JacobianRankMonitor], ids=lambda c: c.__name__)
def test_every_validation_monitor_names_a_cadence_that_meets_validation_seldom(tmp_path, make):
    monitor = make(every_n_epochs=3, verbose=False)
    trainer = quiet_trainer([monitor], max_epochs=2, check_val_every_n_epoch=2, default_root_dir=tmp_path)
    message = rf"{make.__name__}: every_n_epochs=3 with check_val_every_n_epoch=2: .* once in 6 epochs"
    with pytest.warns(UserWarning, match=message):
        trainer.fit(SmallClassifier(), small_loader(), small_loader())


def test_the_weight_monitor_measures_unvalidated_epochs_without_a_cadence_warning(tmp_path):
    monitor = WeightRankMonitor(every_n_epochs=3, log_at_init=False, verbose=False)
    trainer = quiet_trainer([monitor], max_epochs=3, check_val_every_n_epoch=2, default_root_dir=tmp_path)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*check_val_every_n_epoch.*")
        trainer.fit(SmallClassifier(), small_loader(), small_loader())
    assert monitor.curves.epochs == [2]


def test_an_error_of_the_models_own_forward_only_costs_the_initial_point(tmp_path):
    monitor = ActivationRankMonitor(layers=["net.1"], verbose=False)
    with pytest.warns(UserWarning, match=r"no initial point: .*ValueError: this model takes its inputs"):
        _fit(tmp_path, monitor, _RefusesLoaderBatches())
    assert monitor.curves.epochs == [0, 1]


class _Tokens(pl.LightningModule):
    """``proj``: a Linear on ``(B, T, 4)`` token batches whose length T varies from batch to batch."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self(batch)


def test_a_batch_that_changes_a_flatten_layers_features_is_skipped_with_the_reason(tmp_path):
    # Batches padded to their own longest sequence: T = 3, 3, 2. 'flatten' gives T * 4 features, 12 then 8.
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(6, t, 4, generator=g) for t in (3, 3, 2)]
    monitor = ActivationRankMonitor(layers=["proj"], token_reduction="flatten", num_classes=None, verbose=False)
    trainer = quiet_trainer([monitor], default_root_dir=tmp_path)
    with pytest.warns(
        UserWarning,
        match=r"layer 'proj' gives \(6, 2, 4\), 8 features with reduction='flatten' where "
        r"earlier batches gave 12; such batches are skipped .* token_reduction='token', 'mean' or 'last'",
    ):
        (results,) = trainer.validate(_Tokens(), DataLoader(batches, batch_size=None), verbose=False)
    assert results["rank/proj/flatten/spectrum_rows"] == 12  # the two batches of 12 features
    rows = torch.cat([_Tokens()(b).reshape(6, -1) for b in batches[:2]]).detach().double()
    expected = float(torch.linalg.matrix_rank(rows))
    assert results["rank/proj/flatten/numerical_rank"] == expected


def test_a_layer_run_twice_per_batch_is_measured_on_its_first_call_with_a_warning_saying_why(tmp_path):
    class _TwoPasses(SmallClassifier):
        def validation_step(self, batch, batch_idx, dataloader_idx=0):
            self.net(batch[0])
            self.net(2 * batch[0] + 1)  # a second forward pass in the step (as generate() makes)

    model = _TwoPasses(seed=0)
    monitor = ActivationRankMonitor(layers=["net.0"], verbose=False)
    with pytest.warns(UserWarning, match=r"'net.0' runs more than once per batch: .*generate\(\)") as caught:
        quiet_trainer([monitor], max_epochs=1, default_root_dir=tmp_path).fit(
            model, small_loader(), small_loader(seed=1)
        )
    assert sum("runs more than once" in str(w.message) for w in caught) == 1
    with torch.no_grad():
        rows = torch.cat([model.net[0](x) for x, _ in small_loader(seed=1)]).double()
    assert monitor.curves.history[0]["net.0"]["participation_ratio"] == pytest.approx(
        float(participation_ratio(rows)), rel=1e-9
    )
