"""Bad arguments of the public constructors and functions: a ValueError at the call, naming the argument and the
value as given (a string for a flag, a float for a count, NaN, a number for a list), never a truthy stand-in taken
as True or a TypeError from deep inside torch."""

import math
import re

import pytest
import torch
from torch import nn

from rank_lightning import attacks, callbacks, data, functional, metrics, models, modules
from rank_lightning import nn as nn_

_IMAGE = torch.zeros(1, 1, 2, 2, dtype=torch.uint8)
_FLAGS = [
    (callbacks.Cadence, "on_test"),
    (lambda **kw: callbacks.CurveMonitor("curves", **kw), "log_at_init"),
    (callbacks.ActivationRankMonitor, "log_at_init"),
    (callbacks.ActivationRankMonitor, "on_test"),
    (callbacks.ActivationRankMonitor, "log_per_class"),
    (callbacks.WeightRankMonitor, "save_singular_values"),
    (callbacks.WeightRankMonitor, "split_fused"),
    (callbacks.WeightRankMonitor, "lora_update"),
    (callbacks.NeuralCollapseMonitor, "on_validate"),
    (callbacks.JacobianRankMonitor, "log_per_input"),
    (lambda **kw: callbacks.LayerCurves("curves", **kw), "wandb_charts"),
    (callbacks.LowRankProjection, "log_losses"),
    (lambda **kw: callbacks.RankCollapseAlarm(min_value=1.0, **kw), "nan_is_collapse"),
    (callbacks.RankPretraining, "normalize_gradient"),
    (callbacks.ClassificationDimension, "independence_deficit"),
    (callbacks.AdversarialValidation, "verbose"),
    (metrics.ActivationSpectrum, "classwise"),
    (data.DigitsDataModule, "flatten"),
    (data.DigitsDataModule, "drop_last"),
    (data.GaussianNoiseDataModule, "pin_memory"),
    (data.MNISTDataModule, "download"),
    (data.CIFAR10DataModule, "augment"),
    (data.ImageFolderDataModule, "augment"),
    (lambda **kw: data.PixelDataset(_IMAGE, torch.zeros(1), (0.0,), (1.0,), **kw), "flatten"),
    (modules.RankModule, "decay_norm_and_bias"),
    (modules.AutoEncoder, "bias"),
    (models.MLP, "batch_norm"),
    (models.ResNet, "cifar_stem"),
    (lambda **kw: functional.total_cluster_variation(torch.ones(4, 2), torch.arange(4) % 2, **kw), "normalized"),
    (lambda **kw: functional.nystrom_projection(torch.eye(4), 2, **kw), "truncate"),
]


@pytest.mark.parametrize("value", ["no", 1])
@pytest.mark.parametrize(("build", "name"), _FLAGS)
def test_a_flag_takes_true_or_false_only(build, name, value):
    # "no" was taken as True and 1 passed unnoticed: both now name the flag and the value.
    with pytest.raises(ValueError, match=re.escape(f"{name} must be True or False") + ".*" + re.escape(repr(value))):
        build(**{name: value})


_x, _y = torch.randn(12, 4), torch.arange(12) % 3
_model = nn.Sequential(nn.Flatten(), nn.Linear(4, 3))
_pixels, _targets = torch.rand(2, 1, 2, 2), torch.tensor([0, 1])

_BAD = [
    (lambda: modules.RankModule(lr="0.1"), "lr", "'0.1'"),
    (lambda: modules.RankModule(lr=math.nan), "lr", "nan"),
    (lambda: modules.RankModule(weight_decay=-1.0), "weight_decay", "-1.0"),
    (lambda: modules.RankModule(momentum=math.inf), "momentum", "inf"),
    (lambda: modules.RankModule(scheduler="step", step_size=0), "step_size", "0"),
    (lambda: modules.RankModule(milestones="abc"), "milestones", "'abc'"),
    (lambda: modules.RankModule(gamma=0.0), "gamma", "0.0"),
    (lambda: modules.ImageClassifier(input_shape=()), "input_shape", "()"),
    (lambda: modules.ImageClassifier(num_classes=2.5), "num_classes", "2.5"),
    (lambda: modules.ImageClassifier(backbone_kwargs=3), "backbone_kwargs", "3"),
    (lambda: modules.ImageClassifier(lr_layers=3), "lr_layers", "3"),
    (lambda: modules.AutoEncoder(hidden_dims="abc"), "hidden_dims", "'abc'"),
    (lambda: modules.AutoEncoder(num_classes=0), "num_classes", "0"),
    (lambda: models.MLP(width=2.5), "width", "2.5"),
    (lambda: models.MLP(depth="3"), "depth", "'3'"),
    (lambda: models.MLP(input_shape=()), "input_shape", "()"),
    (lambda: models.VGG(arch="vgg11", pool_size=0), "pool_size", "0"),
    (lambda: models.VGG(arch="vgg11", dropout=math.nan), "dropout", "nan"),
    (lambda: models.ViT(num_layers=1, patch_size=0), "patch_size", "0"),
    (lambda: models.ViT(num_layers=1, mlp_dim=2.5), "mlp_dim", "2.5"),
    (lambda: models.ViT(num_layers=1, attention_dropout="0.1"), "attention_dropout", "'0.1'"),
    (lambda: data.GaussianMixtureDataModule(sigma=math.nan), "sigma", "nan"),
    (lambda: data.GaussianMixtureDataModule(samples_per_class=2.5), "samples_per_class", "2.5"),
    (lambda: data.GaussianNoiseDataModule(input_shape="abc"), "input_shape", "'abc'"),
    (lambda: data.GaussianNoiseDataModule(num_samples=2.5), "num_samples", "2.5"),
    (lambda: data.DigitsDataModule(val_fraction="0.1"), "val_fraction", "'0.1'"),
    (lambda: data.MNISTDataModule(val_fraction="0.1"), "val_fraction", "'0.1'"),
    (lambda: data.ImageFolderDataModule(image_size=2.5), "image_size", "2.5"),
    (lambda: data.ImageFolderDataModule(num_classes=3, std=(0.2, 0.0, 0.2)), "std[1]", "0.0"),
    (lambda: data.CIFAR10DataModule(data_dir=3), "data_dir", "3"),
    (lambda: callbacks.ActivationRankMonitor(layers=3), "layers", "3"),
    (lambda: callbacks.ActivationRankMonitor(metrics=3), "metrics", "3"),
    (lambda: callbacks.ActivationRankMonitor(variance_ratio_ks=2.5), "variance_ratio_ks", "2.5"),
    (lambda: callbacks.WeightRankMonitor(layer_types=3), "layer_types", "3"),
    (lambda: callbacks.AdversarialValidation(attacks=3), "attacks", "3"),
    (lambda: callbacks.ClassificationDimension(class_names=[]), "class_names", "[]"),
    (lambda: callbacks.ClassificationDimension(ks=2.5), "ks", "2.5"),
    (lambda: callbacks.LowDimensionalEvaluation(layer=3), "layer", "3"),
    (lambda: data.stratified_split(_y.numpy(), ("0.1",), 0), "fractions[0]", "'0.1'"),
    (lambda: nn_.insert_lr_layer(_model, "1", 3), "layer", "3"),
    (lambda: functional.Patch(0, 0, 0, 2), "height", "0"),
    (lambda: functional.Patch("1", 0, 2, 2), "top", "'1'"),
    (lambda: functional.partial_jacobian(torch.sin, _pixels[0], chunk_size=2.5), "chunk_size", "2.5"),
    (lambda: functional.alpha_req(_x, first_index="2"), "first_index", "'2'"),
    (lambda: functional.alpha_req(_x, last_index=2.5), "last_index", "2.5"),
    (lambda: functional.classwise_variance_ratio(_x, _y, num_classes="3"), "num_classes", "'3'"),
    (lambda: functional.neural_collapse(_x, _y, num_classes=2.5), "num_classes", "2.5"),
    (lambda: functional.nystrom_projection(torch.eye(4), 2, jitter=math.inf), "jitter", "inf"),
    (lambda: functional.default_patch_size(8, 2.5), "width", "2.5"),
    (lambda: functional.gaussian_product_singular_ratio(8, depth=math.nan), "depth", "nan"),
    (lambda: functional.gaussian_product_numerical_rank("8", 2.0), "n", "'8'"),
    (lambda: functional.classification_dimension(_x, _y, _model[1], threshold="0.9"), "threshold", "'0.9'"),
    (lambda: functional.classification_dimension(_x, _y, _model[1], batch_size=2.5), "batch_size", "2.5"),
    (lambda: functional.independence_deficit(_x, _y, classes=1.0), "classes", "1.0"),
    (lambda: functional.independence_deficit(_x, _y, eta="1"), "eta", "'1'"),
    (lambda: functional.independence_deficit(_x, _y, tol=True), "tol", "True"),
    (lambda: functional.independence_deficit(_x, _y, max_iter=True), "max_iter", "True"),
    (lambda: functional.low_dimensional_accuracy(_x, _y, _x, _y, [2], c=0.0), "c", "0.0"),
    (lambda: functional.low_dimensional_accuracy(_x, _y, _x, _y, [2], c=True), "c", "True"),
    (lambda: functional.spectral_metric_keys(["variance_ratio"], variance_ratio_ks=2.5), "variance_ratio_ks", "2.5"),
    (lambda: attacks.attack("fgsm", _model, _pixels, _targets, 0.1, alpha="0.1"), "alpha", "'0.1'"),
    (lambda: attacks.attack("fgsm", _model, _pixels, _targets, 0.1, steps=2.5), "steps", "2.5"),
    (lambda: attacks.fgsm(_model, _pixels, _targets, True), "eps", "True"),
    (lambda: attacks.kurakin_steps("0.03"), "eps", "'0.03'"),
]


@pytest.mark.parametrize(("call", "name", "value"), _BAD, ids=[f"{i}-{case[1]}" for i, case in enumerate(_BAD)])
def test_a_bad_value_is_named_at_the_call(call, name, value):
    with pytest.raises(ValueError, match=rf"(?<!\w){re.escape(name)}(?!\w).*{re.escape(value)}") as error:
        call()
    assert re.search(r"must|valid|unknown", str(error.value))


def test_variance_ratio_needs_a_k():
    # Before, the monitor took variance_ratio_ks=[] and logged no VR_k although 'variance_ratio' was asked for.
    with pytest.raises(ValueError, match="metric 'variance_ratio' needs at least one k in variance_ratio_ks"):
        callbacks.ActivationRankMonitor(variance_ratio_ks=[])
    monitor = callbacks.ActivationRankMonitor(variance_ratio_ks=[], metrics=["numerical_rank"])
    assert monitor.spectrum_options["variance_ratio_ks"] == ()
