import csv
import math
from pathlib import Path

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from pytorch_lightning.loggers import CSVLogger, Logger
from torch import nn

from rank_lightning.callbacks import ClassificationDimension, JacobianRankMonitor
from rank_lightning.callbacks.curves import FIGURE_DIR, wait_for_figures
from rank_lightning.callbacks.feng import CLSDIM_DIR
from rank_lightning.cli import main
from rank_lightning.functional import classification_dimension, independence_deficit, partial_jacobian_ranks
from rank_lightning.functional.jacobian import Patch
from rank_lightning.modules import ImageClassifier

ROOT = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SHAPE = (3, 8, 8)
BLOCKS = {"conv1": "features.2", "conv2": "features.4", "low": "features.8"}


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _network() -> tuple[nn.Sequential, nn.Linear]:
    torch.manual_seed(0)
    features = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Conv2d(4, 4, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(2),
        nn.Flatten(),
        nn.Dropout(0.3),
        nn.Linear(16, 12, bias=False),
    )
    head = nn.Linear(12, 5)
    return features, head


def _make_module(base: type) -> type:
    class TinyNet(base):
        """Conv + BN + dropout, then a Linear whose weight has rank 3 (frozen), then the head."""

        def __init__(self) -> None:
            super().__init__()
            self.features, self.head = _network()
            low = self.features[8]
            with torch.no_grad():
                low.weight.copy_(torch.randn(12, 3) @ torch.randn(3, 16))
            low.weight.requires_grad_(False)

        def forward(self, x):
            return self.head(self.features(x))

        def blocks(self):
            return dict(BLOCKS)

        def training_step(self, batch, batch_idx):
            return F.cross_entropy(self(batch[0]), batch[1])

        def validation_step(self, batch, batch_idx):
            self.log("val/loss", F.cross_entropy(self(batch[0]), batch[1]))

        def configure_optimizers(self):
            return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.05)

    return TinyNet


TinyNet = _make_module(pl.LightningModule)


def _data(n: int = 40, seed: int = 1) -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, *SHAPE, generator=generator)
    y = torch.randint(0, 5, (n,), generator=generator)
    return torch.utils.data.TensorDataset(x, y)


def _loader(dataset, shuffle: bool = False) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(dataset, batch_size=16, shuffle=shuffle)


def _trainer(tmp_path: Path, callbacks: list, trainer_cls=pl.Trainer, **kwargs):
    options = dict(
        max_epochs=1,
        accelerator="cpu",
        devices=1,
        logger=False,
        default_root_dir=tmp_path,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        callbacks=callbacks,
    )
    options.update(kwargs)
    return trainer_cls(**options)


def _reference_ranks(model: nn.Module, inputs: torch.Tensor, patch: Patch) -> dict[str, torch.Tensor]:
    return {name: r.ranks for name, r in partial_jacobian_ranks(model, inputs, BLOCKS, patch).items()}


def _numpy_rank(model: nn.Module, path: str, x: torch.Tensor, patch: Patch) -> int:
    """Reverse-mode Jacobian of one block restricted to the patch columns, ranked by NumPy (Feng eq. 4 tolerance)."""
    module = model.get_submodule(path)
    model.eval()

    def block_output(image: torch.Tensor) -> torch.Tensor:
        out = {}
        handle = module.register_forward_hook(lambda m, a, o: out.setdefault("y", o))
        try:
            model(image.unsqueeze(0))
        finally:
            handle.remove()
        return out["y"].flatten()

    jacobian = torch.autograd.functional.jacobian(block_output, x).reshape(-1, x.numel())
    columns = jacobian[:, patch.mask(x.shape).flatten()].double().numpy()
    tol = np.linalg.svd(columns, compute_uv=False)[0] * np.finfo(np.float32).eps * min(columns.shape)
    return int(np.linalg.matrix_rank(columns, tol=tol))


# -- JacobianRankMonitor ---------------------------------------------------------------------------------------


def test_logged_jacobian_ranks_equal_reference_and_inputs_are_fixed(tmp_path):
    model, train, val = TinyNet(), _data(), _data(24, seed=2)
    monitor = JacobianRankMonitor(num_inputs=3, patch_size=4, log_per_input=True, verbose=False)
    _trainer(tmp_path, [monitor], max_epochs=2).fit(model, _loader(train, True), _loader(val, shuffle=True))

    # The first samples of the dataset, whatever the (shuffling) sampler.
    torch.testing.assert_close(monitor.inputs, val.tensors[0][:3], rtol=0, atol=0)
    patch = Patch.central(SHAPE, 4)
    reference = _reference_ranks(model, val.tensors[0][:3], patch)
    history = monitor.curves.history
    assert sorted(history) == [0, 1]
    for name, ranks in reference.items():
        assert history[1][name]["rank"] == pytest.approx(float(ranks.double().mean()))
        assert [history[1][name][f"rank_input_{i}"] for i in range(3)] == ranks.tolist()
    assert history[1]["conv1"]["rank_max"] == 48  # min(4 * 8 * 8 outputs, K = 4 * 4 * 3)
    # A Linear map of rank 3 caps the Jacobian rank at 3 (known-rank matrix); NumPy agrees on every block.
    assert history[1]["low"]["rank"] == 3
    for name, path in BLOCKS.items():
        assert _numpy_rank(model, path, val.tensors[0][0], patch) == history[1][name]["rank_input_0"]

    for metric in ("rank", "rank_max"):
        wait_for_figures()
        figure = tmp_path / FIGURE_DIR / f"jacobian_{metric}.png"
        assert figure.read_bytes()[:8] == PNG_MAGIC
    assert (tmp_path / FIGURE_DIR / "jacobian_curves.json").exists()


@pytest.mark.parametrize("inference_mode", [True, False])
def test_jacobian_under_validate_matches_reference(tmp_path, inference_mode):
    model, val = TinyNet(), _data(24, seed=3)
    model.eval()
    monitor = JacobianRankMonitor(num_inputs=2, verbose=False)
    _trainer(tmp_path, [monitor], inference_mode=inference_mode).validate(model, _loader(val))
    # Default patch on 8 x 8 images: the central 2 x 2 over 3 channels (K = 12).
    reference = _reference_ranks(model, val.tensors[0][:2], Patch.central(SHAPE))
    for name, ranks in reference.items():
        logged = float(monitor.curves.history[0][name]["rank"])
        assert logged == pytest.approx(float(ranks.double().mean()))
    assert monitor.curves.history[0]["conv1"]["rank"] == 12
    wait_for_figures()
    assert (tmp_path / FIGURE_DIR / "jacobian_rank.png").exists()


def test_measure_restores_modes_and_keeps_batchnorm_statistics():
    model, val = TinyNet(), _data(8)
    monitor = JacobianRankMonitor(num_inputs=2, verbose=False)
    monitor.select(model)
    model.train()
    model.features[7].eval()  # mixed flags must come back as they were
    flags = [m.training for m in model.modules()]
    running = model.features[1].running_mean.clone()
    result = monitor.measure(model, val.tensors[0][:2])
    assert [m.training for m in model.modules()] == flags
    torch.testing.assert_close(model.features[1].running_mean, running, rtol=0, atol=0)
    assert set(result) == set(BLOCKS)


def test_resumed_monitor_keeps_its_inputs(tmp_path):
    model, first, second = TinyNet(), _data(24, seed=4), _data(24, seed=5)
    monitor = JacobianRankMonitor(num_inputs=2, verbose=False)
    _trainer(tmp_path, [monitor]).fit(model, _loader(first), _loader(first))
    state = monitor.state_dict()
    torch.testing.assert_close(state["inputs"], first.tensors[0][:2], rtol=0, atol=0)

    resumed = JacobianRankMonitor(num_inputs=2, verbose=False)
    resumed.load_state_dict(state)
    assert resumed.curves.epochs == [0]
    model.eval()
    _trainer(tmp_path, [resumed]).validate(model, _loader(second))
    reference = _reference_ranks(model, first.tensors[0][:2], Patch.central(SHAPE))
    for name, ranks in reference.items():
        assert resumed.curves.history[0][name]["rank"] == pytest.approx(float(ranks.double().mean()))


def test_jacobian_with_lightning_pytorch_trainer(tmp_path):
    lightning_pytorch = pytest.importorskip("lightning.pytorch")
    model, val = _make_module(lightning_pytorch.LightningModule)(), _data(16)
    monitor = JacobianRankMonitor(num_inputs=1, verbose=False)
    trainer = _trainer(tmp_path, [monitor], trainer_cls=lightning_pytorch.Trainer)
    trainer.validate(model, _loader(val))
    assert trainer.callback_metrics["jacobian/low/rank"] == 3


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"every_n_epochs": 0}, "every_n_epochs"),
        ({"num_inputs": -1}, "num_inputs"),
        ({"size": "mean"}, "valid choices"),
        ({"rank_eps": 0.0}, "rank_eps"),
        ({"patch_size": 2, "patch": Patch(0, 0, 2, 2)}, "not both"),
        ({"layers": []}, "layers"),
    ],
)
def test_jacobian_monitor_rejects_bad_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        JacobianRankMonitor(**kwargs)


def test_unknown_layer_lists_valid_names():
    with pytest.raises(ValueError, match="conv1"):
        JacobianRankMonitor(layers=["nope"]).select(TinyNet())


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
    model, train, val = TinyNet(), _data(), _data(30, seed=6)
    callback = ClassificationDimension(independence_deficit=True, deficit_eta=0.1, verbose=False)
    before, after = _ModeProbe(), _ModeProbe()
    logger = CSVLogger(tmp_path, name="run")
    trainer = _trainer(tmp_path, [before, callback, after], max_epochs=2, logger=logger)
    trainer.fit(model, _loader(train, True), _loader(val))
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
    model, val = TinyNet(), _data(30, seed=7)
    callback = ClassificationDimension(center=center, max_samples=20, threshold=0.9, verbose=False)
    trainer = _trainer(tmp_path, [callback])
    trainer.validate(model, _loader(val))
    features = _reference_features(model, val.tensors[0][:20])
    expected = classification_dimension(features, val.tensors[1][:20], model.head, threshold=0.9, center=center)
    assert trainer.callback_metrics["clsdim/cls_dim"] == expected.cls_dim
    assert trainer.callback_metrics["clsdim/num_samples"] == 20
    assert callback.result.centered is center
    assert (tmp_path / CLSDIM_DIR / "accuracy_vs_k.png").exists()


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
    model, val = TinyNet(), _data(20, seed=8)
    logger = WandbLogger()
    callback = ClassificationDimension(independence_deficit=True, deficit_eta=0.1, verbose=False)
    _trainer(tmp_path, [callback], logger=logger).validate(model, _loader(val))
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


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"threshold": 1.5}, "threshold"),
        ({"ks": [0, 3]}, "ks"),
        ({"max_samples": 0}, "max_samples"),
        ({"deficit_eta": 0.0}, "deficit_eta"),
        ({"deficit_fit_on": "some"}, "valid choices"),
    ],
)
def test_cls_dim_rejects_bad_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ClassificationDimension(**kwargs)


# -- the digits config, end to end -----------------------------------------------------------------------------


@pytest.mark.slow
def test_feng_digits_config_fit_then_validate(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = str(ROOT / "configs" / "feng_digits.yaml")
    main(["fit", "--config", config, "--trainer.max_epochs=5", "--trainer.enable_model_summary=false"])
    [run] = (tmp_path / "runs" / "feng_digits").iterdir()
    wait_for_figures()
    assert (run / FIGURE_DIR / "jacobian_rank.png").exists()
    assert (run / CLSDIM_DIR / "independence_deficit.md").exists()
    cli = main(["validate", "--config", config, "--ckpt_path", str(run / "checkpoints" / "last.ckpt")])
    metrics = cli.trainer.callback_metrics
    assert 1 <= metrics["clsdim/cls_dim"] <= metrics["clsdim/ambient_dim"] == 128
    assert not math.isnan(float(metrics["jacobian/layer1/rank"]))
    assert metrics["jacobian/backbone.head/rank"] <= 10
