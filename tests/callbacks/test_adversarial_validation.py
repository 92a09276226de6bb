"""AdversarialValidation: logged values against a direct computation, inference mode, DDP, files and settings."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from rank_lightning.attacks import fgsm, iterative_fgsm, iterative_ll_fgsm
from rank_lightning.callbacks import AdversarialValidation
from rank_lightning.callbacks.adversarial_validation import grey_levels
from rank_lightning.data import DigitsDataModule
from rank_lightning.modules import ImageClassifier
from tests.callbacks.trainer_helpers import quiet_trainer, torch_threads
from tests.callbacks.wandb_helpers import offline_run_history
from tests.spawned import SpawnedDDP

EPS = (0.0, 2 / 255, 8 / 255, 16 / 255)


@pytest.fixture(autouse=True)
def one_thread():
    # Tiny models: with several busy processes on two cores, one thread avoids oversubscription stalls.
    with torch_threads(1):
        yield


def _datamodule() -> DigitsDataModule:
    datamodule = DigitsDataModule(batch_size=64)
    datamodule.setup("fit")
    return datamodule


def _train(model: nn.Module, datamodule: DigitsDataModule, steps: int = 150) -> None:
    inputs, labels = datamodule.train_set.tensors
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        optimizer.zero_grad()
        F.cross_entropy(model(inputs), labels).backward()
        optimizer.step()
    model.zero_grad(set_to_none=True)


@pytest.fixture(scope="module")
def trained() -> ImageClassifier:
    """A one-hidden-layer MLP trained on the digits to about 95% validation accuracy."""
    torch.manual_seed(0)
    datamodule = _datamodule()
    model = ImageClassifier(backbone="mlp", backbone_kwargs={"depth": 1, "width": 32}, input_shape=(1, 8, 8))
    _train(model, datamodule)
    return model


@pytest.fixture
def model(trained: ImageClassifier) -> ImageClassifier:
    return copy.deepcopy(trained)


def _trainer(tmp_path: Path, callbacks: list[pl.Callback], trainer_cls: type = pl.Trainer, **kwargs: Any) -> Any:
    return quiet_trainer(callbacks, trainer_cls, default_root_dir=tmp_path, **kwargs)


def _validate(tmp_path: Path, model: nn.Module, callback: AdversarialValidation, **kwargs: Any) -> dict[str, float]:
    _trainer(tmp_path, [callback], inference_mode=False, **kwargs).validate(model, datamodule=_datamodule())
    return callback.history["validate"][-1]


def _reference(model: ImageClassifier, count: int, eps_values: tuple[float, ...]) -> dict[str, float]:
    """The callback's numbers computed directly: the attack functions on the first ``count`` validation samples."""
    datamodule = _datamodule()
    inputs, labels = (t[:count] for t in datamodule.val_set.tensors)
    mean, std = datamodule.mean[0], datamodule.std[0]
    features: list[torch.Tensor] = []
    handle = model.backbone.layers[0].register_forward_hook(lambda m, a, out: features.append(out))
    model.eval()

    def run(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features.clear()
        with torch.no_grad():
            logits = model(x)
        return logits.argmax(dim=1), features[0]

    clean_predictions, clean_features = run(inputs)
    correct = clean_predictions == labels
    clean_pixels = (inputs * std + mean).flatten(1)
    reference = {
        "num_samples": float(count),
        "clean_acc": correct.double().mean().item(),
        "feature_sq_norm": clean_features[correct].double().square().sum(dim=1).mean().item(),
    }
    attacks = {
        "fgsm": lambda eps: fgsm(model, inputs, labels, eps, mean=[mean], std=[std]),
        "iter_fgsm": lambda eps: iterative_fgsm(model, inputs, labels, eps, mean=[mean], std=[std]),
        "iter_ll_fgsm": lambda eps: iterative_ll_fgsm(model, inputs, eps, mean=[mean], std=[std]),
    }
    for name, run_attack in attacks.items():
        for eps in eps_values:
            adversarial = run_attack(eps)
            predictions, adversarial_features = run(adversarial)
            level = grey_levels(eps)
            reference[f"{name}/acc@{level}"] = (predictions == labels).double().mean().item()
            pixels = (adversarial * std + mean).flatten(1)
            ratio = (pixels - clean_pixels).double().norm(dim=1) / clean_pixels.double().norm(dim=1)
            reference[f"{name}/l2@{level}"] = ratio.mean().item()
            squared = (adversarial_features - clean_features).double().square().sum(dim=1)
            reference[f"{name}/d_adv@{level}"] = squared[correct].mean().item()
    handle.remove()
    return reference


@pytest.fixture(scope="module")
def logged(trained: ImageClassifier, tmp_path_factory: pytest.TempPathFactory) -> dict[str, float]:
    """One validate run of all attacks on 150 samples, attacked in chunks of 64 (not the loader's batches)."""
    callback = AdversarialValidation(eps=EPS, max_samples=150, batch_size=64, verbose=False)
    return _validate(tmp_path_factory.mktemp("logged"), copy.deepcopy(trained), callback)


def test_logged_values_equal_the_attack_functions_on_the_same_samples(trained, logged):
    reference = _reference(copy.deepcopy(trained), 150, EPS)
    assert set(logged) == set(reference)
    for key, value in reference.items():
        assert logged[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key


def test_keys_write_eps_in_grey_levels(logged):
    assert {"fgsm/acc@0", "fgsm/acc@2", "iter_fgsm/l2@8", "iter_ll_fgsm/d_adv@16"} <= set(logged)
    assert grey_levels(8 / 255) == "8"
    assert grey_levels(0.5 / 255) == "0.5"


def test_zero_budget_is_the_clean_model(logged):
    assert 0.8 < logged["clean_acc"] < 1
    for name in ("fgsm", "iter_fgsm", "iter_ll_fgsm"):
        assert logged[f"{name}/acc@0"] == logged["clean_acc"]
        assert logged[f"{name}/l2@0"] == 0
        assert logged[f"{name}/d_adv@0"] == 0


def test_accuracy_falls_and_distances_grow_with_eps(logged):
    for name in ("fgsm", "iter_fgsm", "iter_ll_fgsm"):
        accuracies = [logged[f"{name}/acc@{grey_levels(eps)}"] for eps in EPS]
        distances = [logged[f"{name}/l2@{grey_levels(eps)}"] for eps in EPS]
        displacements = [logged[f"{name}/d_adv@{grey_levels(eps)}"] for eps in EPS]
        if name == "iter_ll_fgsm":
            # Pushing towards the least-likely class can carry a misclassified input onto its true class, so the
            # targeted attack's accuracy need not fall monotonically; it must still fall overall.
            assert accuracies[-1] < accuracies[0]
        else:
            assert accuracies == sorted(accuracies, reverse=True), name
        assert distances == sorted(distances) and distances[-1] > 0, name
        assert displacements == sorted(displacements) and displacements[-1] > 0, name
    # The untargeted attacks must actually hurt at 16 grey levels on this small MLP.
    assert logged["iter_fgsm/acc@16"] < logged["clean_acc"] - 0.1


def test_validate_in_inference_mode_raises_a_clear_error(tmp_path, model):
    callback = AdversarialValidation(eps=[8 / 255], verbose=False)
    for run in ("validate", "test"):
        trainer = _trainer(tmp_path, [callback])
        with pytest.raises(ValueError, match=r"inference_mode=False\).*--trainer\.inference_mode=false"):
            getattr(trainer, run)(model, datamodule=_datamodule())
    assert callback.history == {"validate": {}, "test": {}}


class _InferenceModeAfterSetup(pl.Callback):
    """Switches the evaluation loop back to inference mode once every callback's setup has passed."""

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        trainer.validate_loop.inference_mode = True


def test_attacking_under_inference_mode_raises_instead_of_logging_zeros(tmp_path, model):
    callback = AdversarialValidation(eps=[8 / 255], verbose=False)
    trainer = _trainer(tmp_path, [callback, _InferenceModeAfterSetup()], inference_mode=False)
    with pytest.raises(RuntimeError, match=r"runs under torch\.inference_mode"):
        trainer.validate(model, datamodule=_datamodule())
    assert callback.history["validate"] == {}


def test_test_stage_logs_under_adv_test(tmp_path, model):
    callback = AdversarialValidation(eps=[4 / 255], attacks=["fgsm"], max_samples=64, verbose=False)
    results = _trainer(tmp_path, [callback], inference_mode=False).test(model, datamodule=_datamodule())
    assert {"adv_test/clean_acc", "adv_test/fgsm/acc@4", "adv_test/fgsm/l2@4", "adv_test/fgsm/d_adv@4"} <= set(
        results[0]
    )
    assert (tmp_path / "rank_curves" / "adversarial_test.png").is_file()


class _StateProbe(pl.Callback):
    """Sets gradients before the attack callback's epoch-end hook; records modes and gradients after it.

    Placed after the attack callback: its ``on_validation_epoch_start`` runs after the attack callback's, its
    ``on_validation_epoch_end`` after the attacks.
    """

    def __init__(self) -> None:
        self.before: list[bool] = []
        self.after: list[bool] = []
        self.gradients: list[torch.Tensor | None] = []

    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.before = [module.training for module in pl_module.modules()]
        for parameter in pl_module.parameters():
            parameter.grad = torch.full_like(parameter, 0.5)

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.after = [module.training for module in pl_module.modules()]
        self.gradients = [parameter.grad for parameter in pl_module.parameters()]


def test_model_modes_and_gradients_are_untouched(tmp_path, model):
    model.backbone.head.train()  # a mixed-mode model: Lightning's eval() then our attacks must both restore it
    modes = [module.training for module in model.modules()]
    probe = _StateProbe()
    callback = AdversarialValidation(eps=[8 / 255], max_samples=64, verbose=False)
    _trainer(tmp_path, [callback, probe], inference_mode=False).validate(model, datamodule=_datamodule())
    assert callback.history["validate"]
    assert probe.after == probe.before
    assert [module.training for module in model.modules()] == modes
    assert len(probe.gradients) == len(list(model.parameters()))
    for parameter, gradient in zip(model.parameters(), probe.gradients):
        assert gradient is not None and torch.equal(gradient, torch.full_like(parameter, 0.5))


def test_fit_attacks_every_n_epochs_and_writes_the_figure(tmp_path, model):
    callback = AdversarialValidation(eps=[2 / 255, 8 / 255], every_n_epochs=2, max_samples=64, verbose=False)
    logger = pl.loggers.CSVLogger(tmp_path, name="run")
    trainer = _trainer(tmp_path, [callback], max_epochs=3, logger=logger, limit_train_batches=2)
    trainer.fit(model, datamodule=_datamodule())
    assert list(callback.history["validate"]) == [1]
    run_dir = Path(logger.log_dir) / "rank_curves"
    assert (run_dir / "adversarial.png").stat().st_size > 10_000
    saved = json.loads((run_dir / "adversarial.json").read_text())
    assert list(saved) == ["1"]
    assert saved["1"]["adv/iter_fgsm/acc@8"] == pytest.approx(callback.history["validate"][1]["iter_fgsm/acc@8"])
    header = (Path(logger.log_dir) / "metrics.csv").read_text().splitlines()[0].split(",")
    assert {"adv/clean_acc", "adv/fgsm/acc@8", "adv/iter_ll_fgsm/d_adv@2"} <= set(header)


@pytest.mark.slow
def test_offline_wandb_run_holds_the_keys_figure_and_table(tmp_path, model, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    callback = AdversarialValidation(eps=[8 / 255], attacks=["fgsm"], max_samples=64, verbose=False)
    logger = pl.loggers.WandbLogger(mode="offline", save_dir=tmp_path, project="adv")
    try:
        _trainer(tmp_path, [callback], logger=logger, inference_mode=False).validate(model, datamodule=_datamodule())
        run_id = logger.experiment.id
    finally:
        wandb.finish()
    history = offline_run_history(tmp_path)
    assert float(history["adv/fgsm/acc@8"][0]) == pytest.approx(callback.history["validate"][-1]["fgsm/acc@8"])
    assert json.loads(history["adv_curves/figure/_type"][0]) == "image-file"
    assert json.loads(history["adv_curves/table/_type"][0]) == "table-file"
    assert (tmp_path / "adv" / run_id / "rank_curves" / "adversarial.png").is_file()


@pytest.mark.parametrize(("max_samples", "expected"), [(50, 50), (130, 130), (None, 359), (1000, 359)])
def test_sample_cap(tmp_path, model, max_samples, expected):
    callback = AdversarialValidation(eps=[1 / 255], attacks=["fgsm"], max_samples=max_samples, verbose=False)
    assert _validate(tmp_path, model, callback)["num_samples"] == expected


def test_explicit_pixel_stats_equal_the_datamodule_ones(tmp_path, model):
    datamodule = _datamodule()
    loader = DataLoader(datamodule.val_set, batch_size=64)
    implicit = AdversarialValidation(eps=[8 / 255], max_samples=64, verbose=False)
    explicit = AdversarialValidation(
        eps=["8/255"], max_samples=64, mean=datamodule.mean, std=datamodule.std, verbose=False
    )
    first = _validate(tmp_path, model, implicit)
    _trainer(tmp_path, [explicit], inference_mode=False).validate(model, dataloaders=loader)
    assert implicit.pixel_stats == explicit.pixel_stats == (datamodule.mean, datamodule.std)
    assert explicit.history["validate"][-1] == first
    # Without any statistics the normalised inputs are not pixels in [0, 1], which the attacks refuse.
    unknown = AdversarialValidation(eps=[8 / 255], max_samples=64, verbose=False)
    with pytest.raises(ValueError, match="pass the datamodule's mean and std"):
        _trainer(tmp_path, [unknown], inference_mode=False).validate(model, dataloaders=loader)


def test_layer_selection(tmp_path, model):
    callback = AdversarialValidation(verbose=False)
    callback.setup(_trainer(tmp_path, []), model, "fit")
    assert (callback.feature_layer.name, callback.feature_layer.path) == ("layer1", "backbone.layers.0")
    callback = AdversarialValidation(layer="backbone.flatten", verbose=False)
    callback.setup(_trainer(tmp_path, []), model, "fit")
    assert callback.feature_layer.path == "backbone.flatten"
    with pytest.raises(ValueError, match="unknown layer 'layer7'; layers are: layer1"):
        AdversarialValidation(layer="layer7", verbose=False).setup(_trainer(tmp_path, []), model, "fit")
    with pytest.raises(ValueError, match="matches 2 modules"):
        AdversarialValidation(layer="backbone.layers.0.[ln]*", verbose=False).setup(
            _trainer(tmp_path, []), model, "fit"
        )


@pytest.mark.parametrize(
    ("layer", "name", "path"),
    [
        ("layer1", "layer1", "backbone.layers.0"),  # a block name
        ("backbone.layers.0.linear", "backbone.layers.0.linear", "backbone.layers.0.linear"),  # a module path
        ("*.act", "backbone.layers.0.act", "backbone.layers.0.act"),  # a glob matching one module
        ("layer?", "backbone.layers.0", "backbone.layers.0"),  # a glob matching one block: named by its path
    ],
)
def test_layer_accepts_the_shared_syntax(tmp_path, model, layer, name, path):
    callback = AdversarialValidation(layer=layer, verbose=False)
    callback.setup(_trainer(tmp_path, []), model, "fit")
    assert (callback.feature_layer.name, callback.feature_layer.path) == (name, path)


def test_block_name_and_its_module_path_measure_the_same_layer(tmp_path, model):
    settings = dict(eps=[8 / 255], attacks=["fgsm"], max_samples=64, verbose=False)
    by_block = _validate(tmp_path, model, AdversarialValidation(layer="layer?", **settings))
    by_path = _validate(tmp_path, model, AdversarialValidation(layer="backbone.layers.0", **settings))
    assert by_block["fgsm/d_adv@8"] > 0
    assert by_block == by_path


def _backbone_class(base: type) -> type:
    """``_Backbone`` on the LightningModule class ``base`` (of ``pytorch_lightning`` or ``lightning.pytorch``)."""

    class _Backbone(base):
        """The classifier's backbone in a module whose validation step reads no batch (any layout is accepted)."""

        def __init__(self, backbone: nn.Module) -> None:
            super().__init__()
            self.backbone = backbone

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.backbone(x)

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            pass

    return _Backbone


_Backbone = _backbone_class(pl.LightningModule)


def test_dict_batches_and_explicit_keys(tmp_path, model):
    datamodule = _datamodule()
    inputs, labels = datamodule.val_set.tensors
    # batch_size=None: the loader yields the prepared batches as they are.
    as_dicts = DataLoader(
        [{"image": inputs[i : i + 32], "label": labels[i : i + 32]} for i in (0, 32)], batch_size=None
    )
    as_tuples = DataLoader([(labels[i : i + 32], inputs[i : i + 32]) for i in (0, 32)], batch_size=None)
    settings = dict(eps=[8 / 255], attacks=["fgsm"], max_samples=64, layer="backbone.layers.0", verbose=False)
    reference = _validate(tmp_path, model, AdversarialValidation(**settings))
    stats = dict(mean=datamodule.mean, std=datamodule.std)
    dicts = AdversarialValidation(**settings, **stats)
    _trainer(tmp_path, [dicts], inference_mode=False).validate(_Backbone(model.backbone), dataloaders=as_dicts)
    swapped = AdversarialValidation(**settings, **stats, input_key=1, label_key=0)
    _trainer(tmp_path, [swapped], inference_mode=False).validate(_Backbone(model.backbone), dataloaders=as_tuples)
    assert dicts.history["validate"][-1] == swapped.history["validate"][-1] == reference
    with pytest.raises(ValueError, match=r"cannot find integer class labels at 'y' in a dict batch"):
        wrong = AdversarialValidation(**settings, **stats, label_key="y")
        _trainer(tmp_path, [wrong], inference_mode=False).validate(_Backbone(model.backbone), dataloaders=as_dicts)


def test_setup_reports_the_resolved_settings(tmp_path, model, callback_messages):
    AdversarialValidation(eps=["8/255", "2/255"], attacks=["fgsm"], max_samples=64).setup(
        _trainer(tmp_path, []), model, "fit"
    )
    assert callback_messages == [
        "AdversarialValidation: fgsm at eps 2, 8 (grey levels) on at most 64 samples; "
        "D_Adv at 'layer1' (backbone.layers.0); pixels in [0, 1]"
    ]
    AdversarialValidation(verbose=False).setup(_trainer(tmp_path, []), model, "fit")
    assert len(callback_messages) == 1


class _Plain(pl.LightningModule):
    """A module without ``blocks()`` on pixels in [0, 1]."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        pass


def test_module_without_blocks_skips_d_adv_unless_a_layer_is_named(tmp_path):
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.rand(32, 4, generator=generator), torch.randint(0, 3, (32,), generator=generator))
    loader = DataLoader(data, batch_size=16)
    plain = AdversarialValidation(eps=[8 / 255], verbose=False)
    _trainer(tmp_path, [plain], inference_mode=False).validate(_Plain(), dataloaders=loader)
    assert plain.pixel_stats is None
    assert not any("d_adv" in key for key in plain.history["validate"][-1])
    named = AdversarialValidation(eps=[8 / 255], layer="net.1", verbose=False)
    _trainer(tmp_path, [named], inference_mode=False).validate(_Plain(), dataloaders=loader)
    assert named.history["validate"][-1]["fgsm/d_adv@8"] > 0


def test_works_with_a_lightning_pytorch_trainer(tmp_path, model):
    lightning = pytest.importorskip("lightning.pytorch")

    model = _backbone_class(lightning.LightningModule)(model.backbone)
    datamodule = _datamodule()
    # A pytorch_lightning datamodule is foreign to a lightning.pytorch Trainer: plain loaders and explicit statistics.
    loader = DataLoader(datamodule.val_set, batch_size=64)
    callback = AdversarialValidation(
        eps=[8 / 255],
        attacks=["iter_fgsm"],
        max_samples=150,
        layer="backbone.layers.0",
        mean=datamodule.mean,
        std=datamodule.std,
        verbose=False,
    )
    trainer = _trainer(tmp_path, [callback], lightning.Trainer, inference_mode=False)
    trainer.validate(model, dataloaders=loader)
    reference = _reference(model, 150, (8 / 255,))
    for key in ("clean_acc", "feature_sq_norm", "iter_fgsm/acc@8", "iter_fgsm/l2@8", "iter_fgsm/d_adv@8"):
        assert callback.history["validate"][-1][key] == pytest.approx(reference[key], rel=1e-5), key
    with pytest.raises(ValueError, match="inference_mode=False"):
        lightning.Trainer(logger=False, enable_progress_bar=False, callbacks=[callback]).validate(
            model, dataloaders=loader
        )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"attacks": ["pgd"]}, "unknown attacks \\['pgd'\\]; valid choices are: fgsm, iter_fgsm, iter_ll_fgsm"),
        ({"attacks": ["fgsm", "fgsm"]}, "attacks names \\['fgsm'\\] more than once"),
        ({"attacks": []}, "attacks must name at least one of: fgsm, iter_fgsm, iter_ll_fgsm$"),
        ({"eps": [8]}, "did you mean 8/255"),
        ({"eps": [-0.01]}, "in \\[0, 1\\]"),
        ({"eps": ["8/255", 8 / 255]}, "\\['8'\\] .* more than once"),
        ({"eps": ["eight"]}, "fractions such as '8/255'"),
        ({"eps": []}, "at least one budget"),
        ({"every_n_epochs": 0}, "every_n_epochs must be a positive integer"),
        ({"max_samples": 0}, "max_samples must be a positive integer or None"),
        ({"batch_size": 2.5}, "batch_size must be a positive integer"),
        ({"alpha": 0.0}, "alpha must be a positive number, got 0.0"),
        ({"steps": 0}, "steps must be a positive integer or None"),
        ({"mean": [0.5]}, "give both mean and std"),
        ({"mean": [0.5], "std": [0.0]}, "std must be positive"),
        ({"layer": ""}, "layer must be None or a non-empty"),
        # Kurakin's default takes int(min(4.5, 0.625)) = 0 iterations at half a grey level: the iterative attacks
        # returned the clean inputs, logged as acc@0.5 = clean accuracy and l2@0.5 = d_adv@0.5 = 0.
        (
            {"eps": ["0.5/255", "8/255"], "attacks": ["fgsm", "iter_ll_fgsm"]},
            r"iter_ll_fgsm would not move the inputs at eps 0.5 \(grey levels\).*give steps",
        ),
    ],
)
def test_invalid_settings_fail_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AdversarialValidation(**kwargs)


def test_budgets_below_one_grey_level(tmp_path, model):
    # "0.5/255" was refused as not a fraction; with explicit steps the iterative attacks move the inputs.
    callback = AdversarialValidation(eps=["0.5/255"], attacks=["fgsm", "iter_fgsm"], steps=1, max_samples=64)
    assert callback.eps == (0.5 / 255,)
    assert AdversarialValidation(eps=["0.5/255"], attacks=["fgsm"]).eps == (0.5 / 255,)
    values = _validate(tmp_path, model, callback)
    assert values["iter_fgsm/l2@0.5"] == pytest.approx(values["fgsm/l2@0.5"]) and values["iter_fgsm/l2@0.5"] > 0


def test_state_dict_round_trip(logged):
    callback = AdversarialValidation()
    callback.history["validate"][3] = dict(logged)
    restored = AdversarialValidation()
    restored.load_state_dict(callback.state_dict())
    assert restored.history == {"validate": {3: logged}, "test": {}}
    assert all(not math.isnan(value) for value in logged.values())


class _SaveMetrics(pl.Callback):
    """Writes the metrics every process holds after validation, so that the parent can compare ranks."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        metrics = {key: float(value) for key, value in trainer.callback_metrics.items() if key.startswith("adv/")}
        Path(self.directory, f"rank{trainer.global_rank}.json").write_text(json.dumps(metrics))


def _single_and_two_processes(tmp_path: Path, model: nn.Module, settings: dict[str, Any]) -> tuple[dict, dict]:
    """The values one process logs and those both of two DDP processes hold (checked equal), under ``adv/``."""
    single = _validate(tmp_path / "single", model, AdversarialValidation(**settings))
    callback = AdversarialValidation(**settings)
    trainer = _trainer(
        tmp_path, [callback, _SaveMetrics(str(tmp_path))], inference_mode=False, strategy=SpawnedDDP(), devices=2
    )
    trainer.validate(model, datamodule=_datamodule())
    per_rank = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert per_rank[0] == per_rank[1]
    return single, per_rank[0]


@pytest.mark.slow
def test_two_process_ddp_equals_one_process(tmp_path, model):
    # 101 samples: 51 on rank 0 (indices 0, 2, ..., 100), 50 on rank 1 (1, ..., 99), together the first 101.
    settings = dict(eps=[2 / 255, 8 / 255], max_samples=101, batch_size=32, verbose=False)
    single, ddp = _single_and_two_processes(tmp_path, model, settings)
    assert ddp["adv/num_samples"] == 101
    for key, value in single.items():
        assert ddp[f"adv/{key}"] == pytest.approx(value, rel=1e-5, abs=1e-6), key


@pytest.mark.slow
def test_two_processes_attack_the_sample_the_distributed_sampler_repeats_once(tmp_path, model):
    # 359 validation samples: Lightning's sampler gives each process 180, the second process's last a repeat of the
    # first sample, which was attacked and counted twice.
    settings = dict(eps=[8 / 255], attacks=["fgsm"], max_samples=None, verbose=False)
    single, ddp = _single_and_two_processes(tmp_path, model, settings)
    assert single["num_samples"] == ddp["adv/num_samples"] == 359
    for key, value in single.items():
        assert ddp[f"adv/{key}"] == pytest.approx(value, rel=1e-5, abs=1e-6), key


def test_files_that_cannot_be_written_are_warnings_and_the_earlier_ones_stay_whole(tmp_path, model, monkeypatch):
    directory = tmp_path / "rank_curves"
    directory.mkdir()
    (directory / "adversarial.json").write_text('{"0": "an earlier run"}')

    def read_only(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    def broken_figure(*args, **kwargs):
        raise ValueError("no finite value to draw")

    monkeypatch.setattr("rank_lightning.files.os.replace", read_only)
    monkeypatch.setattr("rank_lightning.callbacks.adversarial_validation.adversarial_figure", broken_figure)
    callback = AdversarialValidation(eps=[2 / 255], attacks=["fgsm"], max_samples=32, verbose=False)
    with pytest.warns(RuntimeWarning) as caught:
        values = _validate(tmp_path, model, callback)
    assert values["num_samples"] == 32
    assert sorted(str(w.message) for w in caught if "could not" in str(w.message)) == [
        f"AdversarialValidation: {directory / 'adversarial.json'} holds the adversarial evaluations of another run "
        "and could not be renamed to adversarial-v1.json (PermissionError(13, 'Permission denied')); it is left as "
        "it is and this run's adversarial evaluations are not written there",
        f"AdversarialValidation: could not write {directory / 'adversarial.png'} (ValueError('no finite value to "
        "draw')); the run goes on, the values are in the loggers and in checkpoints",
    ]
    assert (directory / "adversarial.json").read_text() == '{"0": "an earlier run"}'
    assert sorted(p.name for p in directory.iterdir()) == ["adversarial.json"]


def test_the_json_of_another_run_in_the_same_folder_is_kept_under_another_name(tmp_path, model):
    directory = tmp_path / "rank_curves"
    directory.mkdir()
    (directory / "adversarial.json").write_text('{"0": "an earlier run"}')
    callback = AdversarialValidation(eps=[2 / 255], attacks=["fgsm"], max_samples=32, verbose=False)
    with pytest.warns(UserWarning, match=r"adversarial\.json held the adversarial evaluations of another run; they"):
        _validate(tmp_path, model, callback)
    assert (directory / "adversarial-v1.json").read_text() == '{"0": "an earlier run"}'
    assert json.loads((directory / "adversarial.json").read_text())["-1"]["adv/num_samples"] == 32
    _validate(tmp_path, model, callback)  # the same callback again: its own file, rewritten
    assert sorted(p.name for p in directory.iterdir()) == ["adversarial-v1.json", "adversarial.json", "adversarial.png"]


def test_evaluations_are_recorded_where_the_rank_curves_record_them(tmp_path, model):
    # Two validations per epoch: keyed by epoch, the second of an epoch replaced the first (4 evaluations, 2 kept).
    callback = AdversarialValidation(eps=[2 / 255], attacks=["fgsm"], max_samples=32, verbose=False)
    logger = pl.loggers.CSVLogger(tmp_path, name="run")
    trainer = _trainer(
        tmp_path,
        [callback],
        max_epochs=2,
        logger=logger,
        limit_train_batches=4,
        val_check_interval=2,
        inference_mode=False,
    )
    trainer.fit(model, datamodule=_datamodule())
    assert callback.x_axis == "step" and list(callback.history["validate"]) == [2, 4, 6, 8]
    saved = json.loads((Path(logger.log_dir) / "rank_curves" / "adversarial.json").read_text())
    assert [(saved[k]["epoch"], saved[k]["step"]) for k in saved] == [(0, 2), (0, 4), (1, 6), (1, 8)]
    # The weights the fit left, validated after it: the fit's last point (the same values), not a point of its own.
    last = dict(callback.history["validate"][8])
    trainer.validate(model, datamodule=_datamodule(), verbose=False)
    assert list(callback.history["validate"]) == [2, 4, 6, 8] and callback.history["validate"][8] == last
    # A checkpoint of epoch 0 is recorded at its step; the same instance in a fresh fit starts a new history.
    checkpoint = tmp_path / "first.ckpt"
    trainer.save_checkpoint(checkpoint)
    fresh = _trainer(tmp_path, [callback], max_epochs=1, limit_train_batches=2, logger=False, inference_mode=False)
    fresh.fit(model, datamodule=_datamodule())
    assert callback.x_axis == "epoch" and list(callback.history["validate"]) == [0]
    again = _trainer(tmp_path, [callback], logger=False, inference_mode=False)
    again.validate(model, datamodule=_datamodule(), ckpt_path=checkpoint, verbose=False)
    assert callback.history["validate"][8] == last  # the checkpoint's x axis (step) and point came with it


class _ModelOutputClassifier(pl.LightningModule):
    """A user's module: ``forward`` returns a Hugging Face ``ModelOutput``, batches are ``(x, y, meta)``."""

    def __init__(self, wrapped: ImageClassifier) -> None:
        super().__init__()
        self.wrapped = wrapped

    def forward(self, x: torch.Tensor) -> Any:
        from transformers.modeling_outputs import SequenceClassifierOutput

        return SequenceClassifierOutput(logits=self.wrapped(x))

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y, _meta = batch
        self.log("val_loss", F.cross_entropy(self(x).logits, y))


def test_forward_returning_a_model_output_with_tuple_batches_with_meta(tmp_path, model):
    datamodule = _datamodule()
    inputs, labels = (t[:64] for t in datamodule.val_set.tensors)
    batches = DataLoader([(inputs[i : i + 32], labels[i : i + 32], torch.arange(i, i + 32)) for i in (0, 32)], None)
    settings = dict(eps=[8 / 255], max_samples=64, layer="wrapped.backbone.layers.0", verbose=False)
    reference = _reference(copy.deepcopy(model), 64, (8 / 255,))
    callback = AdversarialValidation(**settings, mean=datamodule.mean, std=datamodule.std)
    _trainer(tmp_path, [callback], inference_mode=False).validate(_ModelOutputClassifier(model), dataloaders=batches)
    logged = callback.history["validate"][-1]
    assert set(logged) == set(reference)
    for key, value in reference.items():
        assert logged[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
