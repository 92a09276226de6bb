"""RankCollapseAlarm: a deep vanilla MLP whose rank collapses is stopped, a healthy run is left alone."""

from __future__ import annotations

import functools
import math
import warnings
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from rank_lightning.callbacks import ActivationRankMonitor, RankCollapseAlarm
from rank_lightning.data import GaussianMixtureDataModule
from rank_lightning.modules import ImageClassifier
from tests.callbacks.trainer_helpers import quiet_trainer


def _mlp_run(
    depth: int, alarm: RankCollapseAlarm, max_epochs: int, root: Path
) -> tuple[pl.Trainer, ActivationRankMonitor]:
    torch.manual_seed(0)
    datamodule = GaussianMixtureDataModule(num_classes=4, dim=16, sigma=0.5, samples_per_class=60, batch_size=40)
    model = ImageClassifier(
        backbone="mlp", backbone_kwargs={"depth": depth, "width": 32}, num_classes=4, input_shape=(16,), lr=0.05
    )
    monitor = ActivationRankMonitor(layers=[f"layer{depth}"], metrics=("effective_rank",), verbose=False)
    trainer = quiet_trainer([monitor, alarm], max_epochs=max_epochs, default_root_dir=root)
    trainer.fit(model, datamodule=datamodule)
    return trainer, monitor


def test_a_deep_vanilla_mlp_whose_rank_collapses_is_stopped(tmp_path: Path) -> None:
    # Daneshmand et al.: without BatchNorm, 24 ReLU layers map the inputs to about one direction.
    alarm = RankCollapseAlarm(keys="rank/*/effective_rank", min_width_fraction=0.25, action="stop", verbose=False)
    with pytest.warns(UserWarning, match="stopping the fit"):
        trainer, _ = _mlp_run(depth=24, alarm=alarm, max_epochs=5, root=tmp_path)
    assert alarm.stopped_epoch == 0 and trainer.current_epoch == 1
    (message,) = alarm.alarms
    assert "rank/layer24/effective_rank = 1" in message
    assert "layer 'layer24'" in message and "metric 'effective_rank'" in message
    assert "below 0.25 x width 32 = 8" in message


def test_a_healthy_run_is_left_alone(tmp_path: Path) -> None:
    alarm = RankCollapseAlarm(
        keys="rank/*/effective_rank", min_width_fraction=0.1, max_drop=0.5, action="stop", verbose=False
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="RankCollapseAlarm")
        trainer, monitor = _mlp_run(depth=2, alarm=alarm, max_epochs=3, root=tmp_path)
    assert alarm.alarms == [] and alarm.stopped_epoch is None
    assert trainer.current_epoch == 3 and not trainer.should_stop
    assert len(monitor.curves.curve("layer2", "effective_rank")[0]) == 4  # the initial point and three epochs


class _LogSteps:
    """Logs one given value per epoch under ``key`` at the end of validation, as a monitor would (shared by the
    pytorch_lightning and lightning.pytorch modules)."""

    def build(self, values: list[float], key: str) -> None:
        self.values, self.key = values, key
        self.layer = nn.Linear(4, 6)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).square().mean()

    def validation_step(self, batch, batch_idx):
        return None

    def on_validation_epoch_end(self) -> None:
        if not self.trainer.sanity_checking:
            self.log(self.key, self.values[self.current_epoch])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


class _Logs(_LogSteps, pl.LightningModule):
    def __init__(self, values: list[float], key: str = "rank/layer/effective_rank") -> None:
        super().__init__()
        self.build(values, key)


def _fit(
    alarm: RankCollapseAlarm, values: list[float], module: type = _Logs, trainer_cls: type = pl.Trainer
) -> pl.Trainer:
    loader = DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=4)
    trainer = quiet_trainer([alarm], trainer_cls, max_epochs=len(values), num_sanity_val_steps=0)
    trainer.fit(module(values), train_dataloaders=loader, val_dataloaders=loader)
    return trainer


def test_stops_a_lightning_pytorch_fit() -> None:
    lightning = pytest.importorskip("lightning.pytorch")

    class LightningLogs(_LogSteps, lightning.LightningModule):
        def __init__(self, values: list[float]) -> None:
            super().__init__()
            self.build(values, "rank/layer/effective_rank")

    alarm = RankCollapseAlarm(min_value=2.0, action="stop", verbose=False)
    with pytest.warns(UserWarning, match="stopping the fit"):
        trainer = _fit(alarm, [4.0, 1.0, 1.0, 1.0], LightningLogs, lightning.Trainer)
    assert alarm.stopped_epoch == 1 and trainer.current_epoch == 2


def test_a_drop_between_monitored_points_raises_with_the_numbers() -> None:
    alarm = RankCollapseAlarm(keys="rank/*", max_drop=0.5, action="raise", verbose=False)
    with pytest.raises(RuntimeError, match=r"fell by 66\.7% from 9 since the previous monitored value"):
        _fit(alarm, [10.0, 9.0, 3.0, 3.0])
    assert len(alarm.alarms) == 1 and "at epoch 2" in alarm.alarms[0]


def test_absolute_threshold_nan_and_explicit_widths_warn() -> None:
    alarm = RankCollapseAlarm(keys="rank/*", min_value=2.0, action="warn", verbose=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = _fit(alarm, [5.0, 1.5, math.nan])
    said = [str(w.message) for w in caught if "RankCollapseAlarm" in str(w.message)]
    assert len(said) == 2 and "min_value=2.0" in said[0] and said[1].endswith("is NaN")
    assert trainer.current_epoch == 3  # warn never stops
    assert [m.split(" at epoch ")[1] for m in alarm.alarms] == ["1 is below the threshold min_value=2.0", "2 is NaN"]
    alarm = RankCollapseAlarm(keys="rank/*", min_width_fraction=0.5, widths={"rank/layer/*": 100}, verbose=False)
    assert alarm.judge("rank/layer/effective_rank", 49.0) == "is below 0.5 x width 100 = 50"
    assert alarm.judge("rank/layer/effective_rank", 51.0) is None
    assert RankCollapseAlarm(min_value=1, nan_is_collapse=False).judge("rank/a/b", math.nan) is None


class _ManyLayers(_Logs):
    """Five layers' keys collapsing at once, as the blocks of a deep vanilla network do."""

    def on_validation_epoch_end(self) -> None:
        if not self.trainer.sanity_checking:
            for layer in range(5):
                self.log(f"rank/layer{layer}/effective_rank", self.values[self.current_epoch])


def test_one_warning_names_three_collapsed_keys_and_counts_the_rest() -> None:
    # A collapsed 24-layer network gave a single warning of about 3,000 characters.
    alarm = RankCollapseAlarm(keys="rank/*", min_value=2.0, action="warn", verbose=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit(alarm, [1.0], _ManyLayers)
    (said,) = [str(w.message) for w in caught if "RankCollapseAlarm" in str(w.message)]
    assert said.count(" is below the threshold") == 3
    assert said.endswith("; and 2 more keys (RankCollapseAlarm.alarms lists every one)")
    assert len(alarm.alarms) == 5


def test_widths_come_from_the_model() -> None:
    model = nn.Sequential(nn.Linear(8, 5), nn.Conv2d(3, 16, 3), nn.Sequential(nn.Linear(5, 7), nn.LayerNorm(7)))
    alarm = RankCollapseAlarm(min_width_fraction=0.5, verbose=False)
    assert alarm.width("weight/0/numerical_rank", model) == 5
    assert alarm.width("weight/1/numerical_rank", model) == 16  # min(16, 3 * 3 * 3)
    assert alarm.width("rank/1/channel/effective_rank", model) == 16
    assert alarm.width("rank/2/effective_rank", model) == 7
    with pytest.warns(UserWarning, match="no width known for 'rank/1/flatten/effective_rank'"):
        assert alarm.width("rank/1/flatten/effective_rank", model) is None
    assert alarm.judge("rank/1/flatten/effective_rank", 0.5, model) is None


def test_a_pattern_that_never_matches_is_reported() -> None:
    alarm = RankCollapseAlarm(keys=("rank/*", "weigth/*"), min_value=0.1, verbose=False)
    with pytest.warns(UserWarning, match=r"the patterns \['weigth/\*'\] matched no logged key"):
        _fit(alarm, [1.0])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({}, "needs a rule"),
        ({"min_value": 1, "action": "explode"}, "action"),
        ({"min_width_fraction": 1.5}, r"min_width_fraction must be a fraction in \(0, 1\]"),
        ({"max_drop": 0}, r"max_drop must be a fraction in \(0, 1\]"),
        ({"min_value": math.inf}, "min_value must be a finite number"),
        ({"min_value": 1, "widths": {"rank/*": 0}}, "widths"),
        ({"min_value": 1, "keys": []}, "keys"),
        ({"min_value": "1"}, "min_value must be a finite number or None, got '1'"),
        ({"min_width_fraction": True}, r"min_width_fraction must be a fraction in \(0, 1\], got True"),
        ({"min_value": 1, "widths": [("rank/*", 8)]}, r"widths must be a mapping \{glob over keys: width\} or None"),
    ],
)
def test_bad_arguments_raise_clear_errors(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RankCollapseAlarm(**kwargs)


@pytest.mark.parametrize("alarm_first", [False, True])
def test_step_measurements_are_each_judged_once_whatever_the_callback_order(tmp_path, alarm_first):
    # A step measurement stays in callback_metrics for one batch; the alarm read only validation and epoch ends, so
    # under a step cadence it judged (at most) the epoch's last window.
    from rank_lightning.callbacks import WeightRankMonitor
    from tests.callbacks.trainer_helpers import SmallClassifier

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(80, 6, generator=g), torch.randint(0, 4, (80,), generator=g))
    monitor = WeightRankMonitor(layers=["net.0"], every_n_train_steps=3, log_at_init=False, verbose=False)
    alarm = RankCollapseAlarm(keys=["weight/*/spectral_norm"], min_value=1e9, verbose=False)
    model = SmallClassifier((6, 12, 4), lr=0.1, activation=nn.Tanh, seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = quiet_trainer(
            [alarm, monitor] if alarm_first else [monitor, alarm], max_epochs=2, default_root_dir=tmp_path
        )
        trainer.fit(model, DataLoader(data, batch_size=8))

    # 10 batches per epoch, 2 epochs: measured at steps 3, 6, ..., 18; each value judged once (at the end of its
    # batch, or of the next when the alarm comes first) and named with its step.
    assert monitor.curves.epochs == [3, 6, 9, 12, 15, 18]
    values = [monitor.curves.history[step]["net.0"]["spectral_norm"] for step in monitor.curves.epochs]
    assert [float(message.split(" = ")[1].split(" ")[0]) for message in alarm.alarms] == pytest.approx(values, rel=1e-5)
    steps = [int(message.split(" at step ")[1].split(" ")[0]) for message in alarm.alarms]
    assert steps == monitor.curves.epochs


def test_every_validation_of_an_epoch_that_validates_twice_is_judged(tmp_path):
    # val_check_interval=0.5: the monitor keys its curves by step so that no validation replaces the one before it;
    # the alarm judged the first validation of each epoch only, never the one at the epoch's end.
    from tests.callbacks.trainer_helpers import SmallClassifier, small_loader

    monitor = ActivationRankMonitor(layers=["net.0"], metrics=["numerical_rank"], log_at_init=False, verbose=False)
    alarm = RankCollapseAlarm(keys="rank/*/numerical_rank", min_value=100, verbose=False)
    trainer = quiet_trainer(
        [monitor, alarm], max_epochs=2, val_check_interval=0.5, num_sanity_val_steps=0, default_root_dir=tmp_path
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(SmallClassifier(seed=0), small_loader(48), small_loader(16, seed=1))

    assert monitor.curves.epochs == [3, 6, 9, 12]  # 6 batches per epoch, validated after the 3rd and the 6th
    assert [message.split(" at ")[1].split(" is ")[0] for message in alarm.alarms] == [
        "epoch 0, step 3",
        "epoch 0, step 6",
        "epoch 1, step 9",
        "epoch 1, step 12",
    ]


def test_widths_of_a_gpt2_block_its_fused_attention_parts_and_a_repeated_call() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, n_inner=128, vocab_size=50, n_positions=16)
    model = transformers.GPT2LMHeadModel(config)
    alarm = RankCollapseAlarm(min_width_fraction=0.5, verbose=False)
    # A block's output is n_embd wide; its last weight, the MLP's Conv1D c_proj, stores (n_inner, n_embd).
    assert alarm.width("rank_train/transformer.h.0/token/effective_rank", model) == 32
    assert alarm.width("rank/transformer.h.1@2/token/effective_rank", model) == 32
    assert alarm.width("rank/transformer.h.0.mlp.c_fc/token/effective_rank", model) == 128
    # The q, k and v parts of the fused c_attn that WeightRankMonitor logs, each an n_embd x n_embd matrix.
    assert alarm.width("weight/transformer.h.0.attn.c_attn.q_proj/effective_rank", model) == 32
    assert alarm.width("weight/transformer.h.1.attn.c_attn.v_proj/effective_rank", model) == 32
    assert alarm.width("weight/transformer.h.0.mlp.c_fc/effective_rank", model) == 32
    grouped = nn.Sequential(nn.Conv2d(4, 8, 3, groups=2))
    assert alarm.width("weight/0/effective_rank", grouped) == 8  # min(8, 2 * 2 * 3 * 3)
    # A rank of 20 of a 32-wide block is not below half its width.
    assert alarm.judge("rank_train/transformer.h.0/token/effective_rank", 20.0, model) is None


def test_an_infinite_value_is_a_blow_up_like_nan_and_is_no_previous_value() -> None:
    alarm = RankCollapseAlarm(keys="weight/*", max_drop=0.5, verbose=False)
    assert alarm.judge("weight/fc/spectral_norm", math.inf) == "is inf"
    assert alarm.judge("weight/fc/condition_number", -math.inf) == "is -inf"
    assert RankCollapseAlarm(max_drop=0.5, nan_is_collapse=False).judge("rank/a/b", math.inf) is None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit(alarm, [4.0, math.inf, 1.0], functools.partial(_Logs, key="weight/fc/spectral_norm"))
    # The drop after the inf is measured from the last finite value, 4.
    assert [m.split(" at epoch ")[1] for m in alarm.alarms] == [
        "1 is inf",
        "2 fell by 75.0% from 4 since the previous monitored value (max_drop=0.5)",
    ]
    assert sum("RankCollapseAlarm" in str(w.message) for w in caught) == 2


def test_min_steps_is_a_warm_up_that_still_fires_on_nan() -> None:
    # 2 optimizer steps per epoch: judged at steps 2, 4, 6 and 8; the rules other than NaN start at step 7.
    alarm = RankCollapseAlarm(keys="rank/*", min_value=2.0, max_drop=0.5, min_steps=7, verbose=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _fit(alarm, [5.0, math.nan, 1.0, 0.4])
    assert [m.split(" at epoch ")[1] for m in alarm.alarms] == ["1 is NaN", "3 is below the threshold min_value=2.0"]
    alarm = RankCollapseAlarm(keys="rank/*", max_drop=0.5, min_steps=5, verbose=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _fit(alarm, [5.0, 1.0, 0.4, 0.1])  # a drop in the warm-up is no alarm; the next is compared with its value
    assert [m.split(" at epoch ")[1] for m in alarm.alarms] == [
        "2 fell by 60.0% from 1 since the previous monitored value (max_drop=0.5)",
        "3 fell by 75.0% from 0.4 since the previous monitored value (max_drop=0.5)",
    ]
    with pytest.raises(ValueError, match="min_steps must be a non-negative integer, got -1"):
        RankCollapseAlarm(min_value=1.0, min_steps=-1)


def test_weight_keys_under_another_namespace_get_the_matrix_width(tmp_path):
    # The keys of WeightRankMonitor(namespace="ema") were read as activation keys: the width of a Linear(6, 40) was
    # its 40 outputs instead of min(40, 6), and every healthy value fell below half of it.
    from rank_lightning.callbacks import WeightRankMonitor
    from tests.callbacks.trainer_helpers import SmallClassifier, small_loader

    monitor = WeightRankMonitor(layers=["net.0"], namespace="ema", every_n_train_steps=2, verbose=False)
    alarm = RankCollapseAlarm(keys="ema/*/effective_rank", min_width_fraction=0.5, verbose=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = quiet_trainer([monitor, alarm], max_epochs=1, default_root_dir=tmp_path)
        trainer.fit(SmallClassifier((6, 40, 3), seed=0), small_loader(48, 6))
    assert monitor.curves.epochs[-1] == 6 and alarm.width("ema/net.0/effective_rank") == 6
    assert alarm.alarms == []


@pytest.mark.parametrize("action", ["stop", "raise"])
def test_a_step_measurement_stops_or_raises_at_its_step_mid_epoch(tmp_path, action):
    from rank_lightning.callbacks import WeightRankMonitor
    from tests.callbacks.trainer_helpers import SmallClassifier, small_loader

    monitor = WeightRankMonitor(layers=["net.0"], every_n_train_steps=3, log_at_init=False, verbose=False)
    alarm = RankCollapseAlarm(keys="weight/*/spectral_norm", min_value=1e9, action=action, verbose=False)
    trainer = quiet_trainer([monitor, alarm], max_epochs=2, default_root_dir=tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if action == "raise":
            with pytest.raises(RuntimeError, match=r"weight/net\.0/spectral_norm = .* at step 3 is below"):
                trainer.fit(SmallClassifier(seed=0), small_loader(80))
        else:
            trainer.fit(SmallClassifier(seed=0), small_loader(80))  # 10 batches per epoch
    assert trainer.global_step == 3 and len(alarm.alarms) == 1
    assert alarm.stopped_epoch == (0 if action == "stop" else None)
