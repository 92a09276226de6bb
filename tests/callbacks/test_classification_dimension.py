import csv
import re
from pathlib import Path

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import CSVLogger, Logger
from torch import nn

from rank_lightning.callbacks import ClassificationDimension
from rank_lightning.callbacks.classification_dimension import CLSDIM_DIR
from rank_lightning.functional import classification_dimension, independence_deficit
from rank_lightning.modules import ImageClassifier
from tests.callbacks.feng_helpers import (
    PNG_MAGIC,
    DictBatches,
    DictTinyNet,
    TinyNet,
    make_data,
    make_loader,
    make_trainer,
)

# -- ClassificationDimension -----------------------------------------------------------------------------------


def _reference_features(model: TinyNet, x: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model.features(x)


class _ModeProbe(pl.Callback):
    def __init__(self) -> None:
        self.flags: list[list[bool]] = []

    def on_train_end(self, trainer, pl_module) -> None:
        self.flags.append([m.training for m in pl_module.modules()])


def test_cls_dim_after_fit_equals_functional_and_writes_files(tmp_path):
    model, train, val = TinyNet(), make_data(), make_data(30, seed=6)
    callback = ClassificationDimension(independence_deficit=True, deficit_eta=0.1, verbose=False)
    before, after = _ModeProbe(), _ModeProbe()
    logger = CSVLogger(tmp_path, name="run")
    trainer = make_trainer(tmp_path, [before, callback, after], max_epochs=2, logger=logger)
    trainer.fit(model, make_loader(train, True), make_loader(val))
    assert before.flags == after.flags and any(before.flags[0])

    labels = val.tensors[1]
    features = _reference_features(model, val.tensors[0])
    expected = classification_dimension(features, labels, model.head)
    assert callback.result.cls_dim == expected.cls_dim
    torch.testing.assert_close(callback.result.accuracies, expected.accuracies)

    with open(Path(logger.log_dir) / "metrics.csv") as f:
        logged = {k: float(v) for row in csv.DictReader(f) for k, v in row.items() if v}
    assert logged["clsdim/cls_dim"] == expected.cls_dim
    assert logged["clsdim/ambient_dim"] == 12
    assert logged["clsdim/full_acc"] == pytest.approx(expected.full_accuracy)
    assert logged["clsdim/num_samples"] == 30
    with torch.no_grad():
        rows = independence_deficit(model.head(features), labels, eta=0.1)
    drop = np.mean([r["accuracy"] - r["accuracy_fit"] for r in rows])
    assert logged["clsdim/deficit_acc_drop"] == pytest.approx(drop)
    assert logged["clsdim/deficit_num_terms"] == pytest.approx(np.mean([r["num_terms"] for r in rows]))

    directory = Path(logger.log_dir) / CLSDIM_DIR
    with open(directory / "accuracy_vs_k.csv") as f:
        table = list(csv.DictReader(f))
    assert [int(r["k"]) for r in table] == list(range(1, 13))
    np.testing.assert_allclose([float(r["accuracy"]) for r in table], expected.accuracies.numpy())
    assert (directory / "accuracy_vs_k.png").read_bytes()[:8] == PNG_MAGIC
    assert (directory / "independence_deficit.md").read_text().startswith("| class |")
    with open(directory / "independence_deficit.csv") as f:
        assert len(list(csv.DictReader(f))) == 5


@pytest.mark.parametrize("center", [False, True])
def test_cls_dim_under_validate_in_inference_mode(tmp_path, center):
    model, val = TinyNet(), make_data(30, seed=7)
    callback = ClassificationDimension(center=center, max_samples=20, threshold=0.9, verbose=False)
    trainer = make_trainer(tmp_path, [callback])
    trainer.validate(model, make_loader(val))
    features = _reference_features(model, val.tensors[0][:20])
    expected = classification_dimension(features, val.tensors[1][:20], model.head, threshold=0.9, center=center)
    assert trainer.callback_metrics["clsdim/cls_dim"] == expected.cls_dim
    assert trainer.callback_metrics["clsdim/num_samples"] == 20
    assert callback.result.centered is center
    assert (tmp_path / CLSDIM_DIR / "accuracy_vs_k.png").exists()


class _TwoViews(TinyNet):
    """The head runs twice per forward pass: on the features and on their mirror image's."""

    def forward(self, x):
        return self.head(self.features(x)) + self.head(self.features(x.flip(-1)))


def test_a_head_called_twice_per_forward_is_read_at_its_first_call_with_a_warning(tmp_path):
    model, val = _TwoViews(), make_data(30, seed=7)
    callback = ClassificationDimension(verbose=False)
    with pytest.warns(UserWarning, match=r"the head 'head' runs more than once per forward pass .* first call"):
        make_trainer(tmp_path, [callback]).validate(model, make_loader(val))
    expected = classification_dimension(_reference_features(model, val.tensors[0]), val.tensors[1], model.head)
    assert callback.result.cls_dim == expected.cls_dim
    assert callback.result.full_accuracy == expected.full_accuracy


class WandbLogger(Logger):
    """Stands in for W&B: the callbacks recognise W&B loggers by this class name."""

    def __init__(self) -> None:
        super().__init__()
        self.logged: list[dict] = []

    @property
    def name(self) -> str:
        return "fake"

    @property
    def version(self) -> str:
        return "run"

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics, step=None) -> None:
        self.logged.append(dict(metrics))


def test_cls_dim_tables_go_to_wandb(tmp_path):
    wandb = pytest.importorskip("wandb")
    model, val = TinyNet(), make_data(20, seed=8)
    logger = WandbLogger()
    callback = ClassificationDimension(independence_deficit=True, deficit_eta=0.1, verbose=False)
    make_trainer(tmp_path, [callback], logger=logger).validate(model, make_loader(val))
    payload = {k: v for entry in logger.logged for k, v in entry.items()}
    assert isinstance(payload["clsdim/accuracy_vs_k"], wandb.Table)
    assert len(payload["clsdim/accuracy_vs_k"].data) == 12
    assert isinstance(payload["clsdim/independence_deficit"], wandb.Table)
    assert isinstance(payload["clsdim/figure"], wandb.Image)


def test_head_is_found_for_package_and_foreign_models():
    assert ClassificationDimension().find_head(ImageClassifier(backbone="mlp")) == "backbone.head"
    assert ClassificationDimension().find_head(TinyNet()) == "head"
    with pytest.raises(ValueError, match="unknown head 'nope'"):
        ClassificationDimension(head="nope").find_head(TinyNet())


def test_head_accepts_the_shared_layer_syntax():
    model = TinyNet()
    assert ClassificationDimension(head="features.8").find_head(model) == "features.8"  # a module path
    assert ClassificationDimension(head="low").find_head(model) == "features.8"  # a block name
    assert ClassificationDimension(head="hea?").find_head(model) == "head"  # a glob matching one module
    with pytest.raises(ValueError, match=re.escape("head 'features.*' matches 9 modules (features.0, features.1")):
        ClassificationDimension(head="features.*").find_head(model)
    with pytest.raises(ValueError, match=r"is nn\.Identity"):
        ClassificationDimension(head="0").find_head(nn.Sequential(nn.Identity(), nn.Linear(2, 2)))


@pytest.mark.parametrize(
    "reading",
    [{"label_key": "digit"}, {"label_fn": lambda batch: batch["digit"]}],
    ids=["label_key", "label_fn"],
)
def test_cls_dim_reads_dict_batches(tmp_path, reading):
    model, val = DictTinyNet(), make_data(30, seed=12)
    callback = ClassificationDimension(input_key="pixels", verbose=False, **reading)
    trainer = make_trainer(tmp_path, [callback])
    trainer.validate(model, make_loader(DictBatches(val)))
    features = _reference_features(model, val.tensors[0])
    expected = classification_dimension(features, val.tensors[1], model.head)
    assert trainer.callback_metrics["clsdim/cls_dim"] == expected.cls_dim
    assert trainer.callback_metrics["clsdim/num_samples"] == 30
    torch.testing.assert_close(callback.result.accuracies, expected.accuracies)


class _WholeBatch(DictTinyNet):
    """``forward`` takes the whole dict batch, as a Hugging Face-style module does."""

    def forward(self, batch):
        return self.head(self.features(batch["pixels"]))

    def validation_step(self, batch, batch_idx):
        self(batch)


def test_cls_dim_calls_a_forward_that_takes_the_dict_batch_with_the_batch(tmp_path):
    model, val = _WholeBatch(), make_data(30, seed=12)
    callback = ClassificationDimension(label_key="digit", verbose=False)
    make_trainer(tmp_path, [callback]).validate(model, make_loader(DictBatches(val)))
    expected = classification_dimension(_reference_features(model, val.tensors[0]), val.tensors[1], model.head)
    assert callback.result.cls_dim == expected.cls_dim
    torch.testing.assert_close(callback.result.accuracies, expected.accuracies)


class _WholeBatchTrained(_WholeBatch):
    def training_step(self, batch, batch_idx):
        return nn.functional.cross_entropy(self(batch), batch["digit"])


def test_the_early_check_of_ks_runs_a_forward_that_takes_the_dict_batch(tmp_path):
    model, data = _WholeBatchTrained(), make_data(30, seed=12)
    callback = ClassificationDimension(label_key="digit", ks=[1, 2], verbose=False)
    make_trainer(tmp_path, [callback]).fit(model, make_loader(DictBatches(data)), make_loader(DictBatches(data)))
    assert callback.result.ks.tolist() == [1, 2, 12]  # the full width d too
    with pytest.raises(ValueError, match=r"ks must lie in \[1, 12\] \(the feature width\), got \[13\]"):
        callback = ClassificationDimension(label_key="digit", ks=[13], verbose=False)
        make_trainer(tmp_path, [callback]).fit(model, make_loader(DictBatches(data)), make_loader(DictBatches(data)))


class _HeadOnEveryToken(TinyNet):
    """A head applied to every position of ``(B, T, d)`` features (as a causal LM's sequence classifier scores every
    token, then keeps the last real one): its outputs are not one row of logits per sample."""

    def forward(self, x):
        tokens = self.features(x)[:, None].expand(-1, 3, -1)
        return self.head(tokens)[:, -1]


def test_a_head_without_one_row_of_logits_per_sample_is_named_and_nothing_is_logged(tmp_path):
    callback = ClassificationDimension(verbose=False)
    trainer = make_trainer(tmp_path, [callback])
    with pytest.warns(UserWarning, match=r"outputs of 'head' have shape \(16, 3, 5\), not \(B, C\) logits"):
        trainer.validate(_HeadOnEveryToken(), make_loader(make_data(20, seed=12)))
    assert callback.result is None and not any(key.startswith("clsdim/") for key in trainer.callback_metrics)


def test_cls_dim_without_labels_names_where_it_looked(tmp_path):
    model, val = DictTinyNet(), make_data(8, seed=12)
    callback = ClassificationDimension(input_key="pixels", verbose=False)
    with pytest.raises(ValueError, match=r"cannot find integer class labels .* keys \['pixels', 'digit'\]"):
        make_trainer(tmp_path, [callback]).validate(model, make_loader(DictBatches(val)))


def test_cls_dim_messages_go_through_rank_zero_info(tmp_path, callback_messages):
    model, val = TinyNet(), make_data(20, seed=13)
    callback = ClassificationDimension(independence_deficit=True, deficit_eta=0.1)
    make_trainer(tmp_path, [callback]).validate(model, make_loader(val))
    result = callback.result
    assert callback_messages[0].startswith(
        f"ClassificationDimension: cls_dim = {result.cls_dim} of 12 (PCA projection through the origin, 20 samples, "
        f"full accuracy {result.full_accuracy:.4f}, threshold 0.95); files in "
    )
    assert callback_messages[1].startswith("ClassificationDimension: independence deficit:\n| class |")
    assert len(callback_messages) == 2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"threshold": 1.5}, "threshold"),
        ({"ks": [0, 3]}, "ks"),
        ({"max_samples": 0}, "max_samples"),
        ({"deficit_eta": 0.0}, "deficit_eta"),
        ({"deficit_fit_on": "some"}, "unknown deficit_fit_on 'some'; valid choices are: all, class"),
        ({"deficit_classes": [-1]}, r"deficit_classes must be None or non-negative class indices, got \[-1\]"),
        ({"deficit_classes": [1, "2"]}, "deficit_classes must be None or non-negative class indices"),
        ({"deficit_classes": [True]}, "deficit_classes must be None or non-negative class indices"),
        ({"center": "yes"}, "unknown center 'yes'; valid choices are: False, True"),
    ],
)
def test_cls_dim_rejects_bad_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ClassificationDimension(**kwargs)


class _TrainingBatches(pl.Callback):
    def __init__(self) -> None:
        self.count = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.count += 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"ks": [4, 100]}, r"ks must lie in \[1, 12\] \(the feature width\), got \[100\]"),
        (
            {"independence_deficit": True, "deficit_classes": [1, 5]},
            r"deficit_classes \[5\] are out of range; valid classes are 0..4 \(the outputs of the head 'head'\)",
        ),
    ],
)
def test_settings_beyond_the_model_fail_before_training(tmp_path, kwargs, message):
    batches = _TrainingBatches()
    trainer = make_trainer(tmp_path, [batches, ClassificationDimension(verbose=False, **kwargs)], max_epochs=3)
    with pytest.raises(ValueError, match=message):
        trainer.fit(TinyNet(), make_loader(make_data()), make_loader(make_data(20, seed=2)))
    assert batches.count == 0


def test_settings_within_the_model_pass_the_early_check(tmp_path):
    callback = ClassificationDimension(ks=[2, 12], independence_deficit=True, deficit_classes=[4], verbose=False)
    make_trainer(tmp_path, [callback]).fit(TinyNet(), make_loader(make_data()), make_loader(make_data(20, seed=2)))
    assert callback.result.ks.tolist() == [2, 12] and [row["class"] for row in callback.deficit] == [4]


class _FirstDraw(pl.Callback):
    """The global generator's first draw of the fit's first training batch, as dropout would make it."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == 0 and trainer.current_epoch == 0:
            self.draw = torch.rand(1).item()


def test_the_early_check_leaves_the_fits_random_stream_alone(tmp_path):
    # The check's validation batch iterated a loader, whose iterator draws its base seed from the global generator:
    # ks=[...] changed the dropout masks and shuffles of the fit it only measures at the end.
    draws = []
    for options in ({}, {"ks": [2, 12]}):
        probe = _FirstDraw()
        torch.manual_seed(0)
        trainer = make_trainer(tmp_path / str(len(draws)), [probe, ClassificationDimension(verbose=False, **options)])
        trainer.fit(TinyNet(), make_loader(make_data()), make_loader(make_data(20, seed=2)))
        draws.append(probe.draw)
    assert draws[0] == draws[1]


class _DeadNet(TinyNet):
    """The head's input is 0 for every sample: the Linear before it has a zero (frozen) weight and no bias."""

    def __init__(self) -> None:
        super().__init__()
        with torch.no_grad():
            self.features[8].weight.zero_()


class _NaNNet(TinyNet):
    """Trains normally; in eval mode the head's input is NaN."""

    def forward(self, x):
        features = self.features(x)
        return self.head(features if self.training else features * float("nan"))


@pytest.mark.parametrize(("model_cls", "cause"), [(_DeadNet, "constant"), (_NaNNet, r"not finite \(NaN or Inf\)")])
def test_features_without_principal_directions_are_logged_as_nan(tmp_path, model_cls, cause):
    logger = CSVLogger(tmp_path, name="run")
    directory = Path(logger.log_dir) / CLSDIM_DIR
    callback = ClassificationDimension(independence_deficit=True, deficit_eta=0.1, verbose=False)
    trainer = make_trainer(tmp_path, [callback], logger=logger)
    trainer.validate(TinyNet(), make_loader(make_data(20, seed=2)))  # an earlier evaluation of the run, drawn
    assert (directory / "accuracy_vs_k.png").read_bytes()[:8] == PNG_MAGIC
    with pytest.warns(RuntimeWarning) as record:
        trainer.fit(model_cls(), make_loader(make_data()), make_loader(make_data(20, seed=2)))
    messages = [str(w.message) for w in record]
    assert any(re.search(f"the input of the head 'head' is {cause} over the 20 evaluated samples", m) for m in messages)
    assert any("the logits of the head 'head' hold NaN" in m for m in messages) == (model_cls is _NaNNet)
    with open(Path(logger.log_dir) / "metrics.csv") as f:
        logged = {k: float(v) for row in csv.DictReader(f) for k, v in row.items() if v}
    assert np.isnan(logged["clsdim/cls_dim"]) and np.isnan(logged["clsdim/acc_at_cls_dim"])
    assert logged["clsdim/ambient_dim"] == 12 and logged["clsdim/num_samples"] == 20
    assert np.isnan(logged["clsdim/full_acc"]) == (model_cls is _NaNNet)
    if model_cls is _NaNNet:  # NaN logits: no Lasso fit, its numbers NaN
        assert callback.deficit is None and np.isnan(logged["clsdim/deficit_acc_drop"])
    else:
        assert len(callback.deficit) == 5 and not np.isnan(logged["clsdim/deficit_num_terms"])
    assert not callback.result.defined
    # The table is written (with NaN accuracies); no figure is drawn, and the old one is gone.
    with open(directory / "accuracy_vs_k.csv") as f:
        assert all(np.isnan(float(r["accuracy"])) for r in csv.DictReader(f))
    assert not (directory / "accuracy_vs_k.png").exists()


class _ShiftedInputs(TinyNet):
    """A module whose batch-transfer hook takes the whole ``(x, y)`` batch, as Lightning's steps pass it."""

    def on_after_batch_transfer(self, batch, dataloader_idx):
        x, y = batch
        return x + 1.0, y


def test_its_own_pass_gives_the_batch_transfer_hook_the_whole_batch(tmp_path):
    model, val = _ShiftedInputs(), make_data(30, seed=7)
    callback = ClassificationDimension(max_samples=20, threshold=0.9, verbose=False)
    make_trainer(tmp_path, [callback]).validate(model, make_loader(val))
    features = _reference_features(model, val.tensors[0][:20] + 1.0)  # the inputs the steps see
    expected = classification_dimension(features, val.tensors[1][:20], model.head, threshold=0.9)
    assert callback.result.cls_dim == expected.cls_dim
    assert callback.result.accuracies == pytest.approx(expected.accuracies)


def test_class_names_given_as_one_string_is_refused() -> None:
    message = "class_names must be a sequence of names, one per class, got the string 'cat'"
    with pytest.raises(ValueError, match=message):
        ClassificationDimension(class_names="cat")
    assert ClassificationDimension(class_names=("cat", "dog")).class_names == ["cat", "dog"]


def test_files_that_cannot_be_written_are_warnings_and_the_fit_ends_normally(tmp_path, monkeypatch):
    directory = tmp_path / CLSDIM_DIR
    callback = ClassificationDimension(independence_deficit=True, verbose=False)
    trainer = make_trainer(tmp_path, [callback], max_epochs=1)
    model, val = TinyNet(), make_loader(make_data(30, seed=6))
    trainer.validate(model, val)  # the run's first files
    earlier = {p.name: p.read_bytes() for p in directory.iterdir()}

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("rank_lightning.files.os.replace", full_disk)
    with pytest.warns(RuntimeWarning) as caught:
        trainer.fit(model, make_loader(make_data(), True), val)
    assert trainer.state.finished and callback.result.ambient_dim == 12
    unwritten = sorted(path for w in caught for path in re.findall(r"could not write (\S+) \(OSError", str(w.message)))
    names = ["accuracy_vs_k.csv", "accuracy_vs_k.png", "independence_deficit.csv", "independence_deficit.md"]
    assert unwritten == [str(directory / name) for name in names]
    assert {p.name: p.read_bytes() for p in directory.iterdir()} == earlier and sorted(earlier) == names


def test_another_runs_files_in_the_same_folder_are_kept(tmp_path):
    train, val = make_loader(make_data(), True), make_loader(make_data(30, seed=6))
    callback = ClassificationDimension(verbose=False)
    make_trainer(tmp_path, [callback], max_epochs=1, logger=False).fit(TinyNet(), train, val)
    first = (tmp_path / CLSDIM_DIR / "accuracy_vs_k.csv").read_bytes()
    for trainer in (make_trainer(tmp_path, [callback], logger=False), make_trainer(tmp_path, [callback], logger=False)):
        with pytest.warns(UserWarning, match="clsdim held the classification-dimension files of another run"):
            torch.manual_seed(1)
            trainer.validate(TinyNet(), val)  # another model, another table
    assert (tmp_path / f"{CLSDIM_DIR}-v1" / "accuracy_vs_k.csv").read_bytes() == first
    assert (tmp_path / f"{CLSDIM_DIR}-v2" / "accuracy_vs_k.csv").read_bytes() != first
    assert (tmp_path / CLSDIM_DIR / "accuracy_vs_k.png").exists()
