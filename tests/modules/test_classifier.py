import re

import pytest
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from rank_lightning.layers import select_layers
from rank_lightning.modules import AutoEncoder, ImageClassifier


def _loader(shape, num_classes=3, n=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, *shape, generator=g)
    y = torch.randint(0, num_classes, (n,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=16)


def _trainer(tmp_path, epochs=1):
    return pl.Trainer(
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )


@pytest.mark.parametrize(
    ("backbone", "kwargs", "shape"),
    [
        ("mlp", {"depth": 2, "width": 16}, (1, 8, 8)),
        ("resnet18", {}, (3, 8, 8)),
        ("vgg11", {"classifier_width": 16}, (1, 8, 8)),
        ("vit_tiny", {"num_layers": 1, "hidden_dim": 24, "num_heads": 2, "mlp_dim": 32}, (3, 8, 8)),
    ],
)
def test_classifier_builds_any_backbone_from_the_input_shape(backbone, kwargs, shape, tmp_path):
    model = ImageClassifier(backbone=backbone, backbone_kwargs=kwargs, num_classes=3, input_shape=shape)
    assert model(torch.randn(2, *shape)).shape == (2, 3)
    blocks = model.blocks()
    assert blocks and all(path.startswith("backbone.") for path in blocks.values())
    for path in blocks.values():
        model.get_submodule(path)
    trainer = _trainer(tmp_path)
    trainer.fit(model, _loader(shape), _loader(shape, seed=1))
    assert {"train/loss", "train/acc", "val/loss", "val/acc"} <= set(trainer.callback_metrics)


def test_classifier_rejects_non_image_shapes_for_conv_nets():
    with pytest.raises(ValueError, match=r"resnet18.*\(C, H, W\)"):
        ImageClassifier(backbone="resnet18", num_classes=3, input_shape=(64,))


@pytest.mark.parametrize(
    ("backbone", "kwargs", "message"),
    [
        (
            "vit_tiny",
            {"image_size": 8},
            r"backbone_kwargs sets 'image_size'=8, which the classifier derives from "
            r"input_shape=\(3, 32, 32\); set input_shape instead",
        ),
        ("mlp", {"num_classes": 3}, r"backbone_kwargs sets 'num_classes'=3, .* set num_classes instead"),
    ],
)
def test_backbone_kwargs_that_the_classifier_derives_are_a_clear_error(backbone, kwargs, message):
    shape = (3, 32, 32) if backbone == "vit_tiny" else (1, 8, 8)
    with pytest.raises(ValueError, match=message):
        ImageClassifier(backbone=backbone, backbone_kwargs=kwargs, input_shape=shape)


def test_classifier_learns_and_lowers_the_loss(tmp_path):
    torch.manual_seed(0)
    x = torch.randn(96, 8)
    y = (x[:, 0] > 0).long()
    loader = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)
    model = ImageClassifier(backbone="mlp", backbone_kwargs={"depth": 1, "width": 32}, num_classes=2, input_shape=(8,))
    trainer = _trainer(tmp_path, epochs=15)
    trainer.fit(model, loader, DataLoader(TensorDataset(x, y), batch_size=96))
    assert trainer.callback_metrics["val/acc"] > 0.9


def test_autoencoder_reconstructs_and_exposes_hidden_blocks(tmp_path):
    torch.manual_seed(0)
    model = AutoEncoder(input_shape=(6,), hidden_dims=(8, 3, 8), lr=0.05)
    assert list(model.blocks()) == ["layer1", "layer2", "layer3"]
    x = torch.randn(64, 6)
    loader = DataLoader(TensorDataset(x, torch.zeros(64, dtype=torch.long)), batch_size=16)
    initial = torch.nn.functional.mse_loss(model(x), x).item()
    trainer = _trainer(tmp_path, epochs=20)
    trainer.fit(model, loader, loader)
    assert trainer.callback_metrics["val/loss"] < 0.8 * initial


def test_autoencoder_rejects_unknown_activation():
    with pytest.raises(ValueError, match=r"unknown activation 'swish'.*tanh"):
        AutoEncoder(activation="swish")


def test_lr_layer_inserted_before_the_head_with_measured_width(tmp_path):
    from rank_lightning.nn import LRLayer, lr_layers

    model = ImageClassifier(
        backbone="mlp",
        backbone_kwargs={"depth": 2, "width": 12},
        num_classes=3,
        input_shape=(1, 4, 4),
        lr_layers=[{"before": "head", "rank": 2, "lambda_1": 0.5}],
    )
    [(_, layer)] = lr_layers(model)
    assert isinstance(layer, LRLayer) and layer.num_features == 12 and layer.rank == 2
    x = torch.randn(5, 1, 4, 4)
    model.eval()
    logits = model(x)
    # The LR-Layer is an identity: removing it gives the same logits.
    head = model.backbone.get_submodule(model.backbone.head_path)
    torch.testing.assert_close(logits, head[1](model.backbone.forward_features(x)))
    layer.enabled = True
    model.train()
    trainer = _trainer(tmp_path)
    trainer.fit(model, _loader((1, 4, 4)), _loader((1, 4, 4), seed=1))
    assert trainer.callback_metrics["train/lr_layer_loss"] > 0


def test_lr_layer_without_flatten_measures_the_last_dimension():
    # flatten=False treats the last dimension as the features (tokens (B, T, D) -> (B*T, D)); the width was measured
    # as T*D, and the first forward pass after switch-on stopped with a width mismatch.
    from rank_lightning.nn import lr_layers

    model = ImageClassifier(
        backbone="vit_tiny",
        backbone_kwargs={"num_layers": 1, "hidden_dim": 12, "num_heads": 2, "mlp_dim": 16, "patch_size": 4},
        num_classes=3,
        input_shape=(3, 8, 8),
        lr_layers=[{"before": "encoder.layers.encoder_layer_0.mlp", "rank": 2, "flatten": False}],
    )
    [(_, layer)] = lr_layers(model)
    assert layer.num_features == 12
    layer.enabled = True
    model.train()
    model(torch.randn(4, 3, 8, 8))
    assert layer.last_losses["reconstruction"].isfinite()


def test_lr_layer_position_must_exist():
    with pytest.raises(ValueError, match=r"unknown lr_layers position 'layer9'.*head"):
        ImageClassifier(backbone="mlp", num_classes=3, input_shape=(4,), lr_layers=[{"before": "layer9", "rank": 2}])


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (
            {"before": "head", "rank": 2, "lambda1": 0.1},
            "unknown lr_layers key(s) 'lambda1'; valid keys are: before, rank, lambda_1, lambda_2, projection, "
            "num_runs, oversampling, flatten",
        ),
        ({"before": "head"}, "an lr_layers entry needs 'rank' (the rank k of the projection), got {'before': 'head'}"),
    ],
)
def test_lr_layer_entries_name_their_bad_keys(entry, message):
    # A typo reached the CLI user as a TypeError buried in a union-type report.
    with pytest.raises(ValueError, match=re.escape(message)):
        ImageClassifier(backbone="mlp", num_classes=3, input_shape=(4,), lr_layers=[entry])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_classes": 5}, r"ImageClassifier has num_classes=5 but DigitsDataModule gives num_classes=10"),
        ({"input_shape": (1, 28, 28)}, r"ImageClassifier has input_shape=\(1, 28, 28\) but DigitsDataModule gives"),
    ],
)
def test_a_module_that_does_not_fit_the_datamodule_is_named_at_setup(kwargs, match, tmp_path):
    # The fit stopped at the first batch with "Target 8 is out of bounds" or a matmul shape error.
    from rank_lightning.data import DigitsDataModule

    model = ImageClassifier(backbone="mlp", **({"num_classes": 10, "input_shape": (1, 8, 8)} | kwargs))
    with pytest.raises(ValueError, match=match):
        _trainer(tmp_path).fit(model, datamodule=DigitsDataModule(batch_size=64))


def test_a_flat_input_of_as_many_values_fits_the_datamodule(tmp_path):
    from rank_lightning.data import DigitsDataModule

    model = ImageClassifier(backbone="mlp", num_classes=10, input_shape=(64,))  # digits are (1, 8, 8)
    trainer = _trainer(tmp_path)
    trainer.fit(model, datamodule=DigitsDataModule(batch_size=256))
    assert trainer.state.finished


@pytest.mark.parametrize("value", [2.0, -0.1, "0.1"])
def test_label_smoothing_must_lie_in_the_unit_interval(value):
    with pytest.raises(ValueError, match=rf"label_smoothing must lie in \[0, 1\], got {value!r}"):
        ImageClassifier(backbone="mlp", num_classes=3, input_shape=(4,), label_smoothing=value)


def _accuracy(model, loader):
    with torch.no_grad():
        hits = sum(int((model(x).argmax(1) == y).sum()) for x, y in loader)
    return hits / len(loader.dataset)


def test_several_validation_and_test_loaders_log_each_loaders_own_accuracy(tmp_path):
    torch.manual_seed(0)
    model = ImageClassifier(backbone="mlp", backbone_kwargs={"depth": 1, "width": 8}, num_classes=3, input_shape=(6,))
    a, b = _loader((6,), n=48, seed=1), _loader((6,), n=32, seed=2)
    expected = [_accuracy(model, a), _accuracy(model, b)]
    assert expected[0] != expected[1]
    trainer = _trainer(tmp_path)
    for _ in range(2):  # the second run starts from reset metrics
        (val_a, val_b) = trainer.validate(model, [a, b], verbose=False)
        assert val_a["val/acc/dataloader_idx_0"] == pytest.approx(expected[0])
        assert val_b["val/acc/dataloader_idx_1"] == pytest.approx(expected[1])
        assert "val/loss/dataloader_idx_1" in val_b
    (test_a, test_b) = trainer.test(model, {"shift": b, "clean": a}, verbose=False)
    assert test_a["test/acc/dataloader_idx_0"] == pytest.approx(expected[1])
    assert test_b["test/acc/dataloader_idx_1"] == pytest.approx(expected[0])
    # One loader keeps the plain keys, and the accuracy of that loader alone.
    (single,) = trainer.validate(model, b, verbose=False)
    assert set(single) == {"val/loss", "val/acc"}
    assert single["val/acc"] == pytest.approx(expected[1])
    # The extra metrics hold no saved state (a checkpoint loads into a fresh module) and are no layers.
    ImageClassifier(**model.hparams).load_state_dict(model.state_dict())
    with pytest.raises(ValueError, match=r"unknown layer 'nope'; layers are: layer1, backbone, ") as error:
        select_layers(model, ["nope"])
    assert "acc" not in str(error.value)


def test_the_autoencoder_logs_the_loss_of_each_validation_loader(tmp_path):
    torch.manual_seed(0)
    model = AutoEncoder(input_shape=(6,), hidden_dims=(8, 3, 8))
    a, b = _loader((6,), n=32, seed=1), _loader((6,), n=32, seed=2)
    with torch.no_grad():
        inputs = [loader.dataset.tensors[0] for loader in (a, b)]
        expected = [float(torch.nn.functional.mse_loss(model(x), x)) for x in inputs]
    (val_a, val_b) = _trainer(tmp_path).validate(model, [a, b], verbose=False)
    assert val_a["val/loss/dataloader_idx_0"] == pytest.approx(expected[0], rel=1e-5)
    assert val_b["val/loss/dataloader_idx_1"] == pytest.approx(expected[1], rel=1e-5)


class _FirstLoss(pl.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.__dict__.setdefault("loss", float(outputs["loss"]))


@pytest.mark.parametrize("make", [lambda a, b: {"a": a, "b": b}, lambda a, b: [a, b]])
def test_several_training_loaders_train_on_the_rows_of_all(make, tmp_path):
    torch.manual_seed(0)
    model = ImageClassifier(backbone="mlp", backbone_kwargs={"depth": 1, "width": 8}, num_classes=3, input_shape=(6,))
    a, b = _loader((6,), n=32, seed=1), _loader((6,), n=16, seed=2)
    (xa, ya), (xb, yb) = a.dataset.tensors, b.dataset.tensors
    with torch.no_grad():
        logits = model(torch.cat([xa[:16], xb[:16]]))
    expected = float(torch.nn.functional.cross_entropy(logits, torch.cat([ya[:16], yb[:16]])))
    first = _FirstLoss()
    trainer = pl.Trainer(
        callbacks=[first],
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(model, make(a, b))
    assert first.loss == pytest.approx(expected, rel=1e-6)


def test_the_autoencoder_trains_on_several_loaders_of_inputs_alone(tmp_path):
    model = AutoEncoder(input_shape=(6,), hidden_dims=(8, 3, 8))
    loaders = [DataLoader(TensorDataset(torch.randn(8, 6)), batch_size=4) for _ in range(2)]
    trainer = _trainer(tmp_path)
    trainer.fit(model, {"a": loaders[0], "b": loaders[1]})
    assert trainer.global_step == 2 and torch.isfinite(trainer.callback_metrics["train/loss"])
