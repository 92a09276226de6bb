import csv
import json
import math
import warnings
from pathlib import Path

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import CSVLogger, WandbLogger
from torch import nn

from rank_lightning.callbacks import WeightRankMonitor
from rank_lightning.callbacks.curves import FIGURE_DIR
from tests.callbacks.recording_logger import RecordingLogger
from tests.callbacks.trainer_helpers import quiet_trainer
from tests.callbacks.wandb_helpers import offline_run_history, offline_run_rows

TAIL_RANKS = (1, 2, 5)


def _reference(matrix: np.ndarray, eps: float | None = None) -> dict[str, float]:
    """The logged metrics from NumPy's SVD of the (out, fan_in) matrix, written out from their definitions."""
    matrix = matrix.reshape(matrix.shape[0], -1).astype(np.float64)
    s = np.linalg.svd(matrix, compute_uv=False)
    if eps is None:
        eps = np.finfo(np.float32).eps * min(matrix.shape)
    p = s / s.sum()
    values = {
        "numerical_rank": float(np.sum(s >= eps * s[0])),
        "stable_rank": float(np.sum(s**2) / s[0] ** 2),
        "effective_rank": float(np.exp(-np.sum(p[p > 0] * np.log(p[p > 0])))),
        "spectral_norm": float(s[0]),
    }
    for k in TAIL_RANKS:
        values[f"tail_error_k{k}"] = float(np.sqrt(np.sum(s[k:] ** 2) / np.sum(s**2)))
    return values


class _Steps:
    """Layers and steps shared by the pytorch_lightning and lightning.pytorch test modules (no package base class)."""

    def build(self) -> None:
        self.conv = nn.Conv2d(3, 6, 3)
        self.attn = nn.MultiheadAttention(6, 2, batch_first=True)
        self.hidden = nn.Linear(6, 12)
        self.low_rank = nn.Linear(12, 12, bias=False)
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            self.low_rank.weight.copy_(
                torch.randn(12, 3, generator=generator) @ torch.randn(3, 12, generator=generator)
            )
        self.low_rank.weight.requires_grad_(False)
        self.head = nn.Linear(12, 3)

    def forward(self, x):
        tokens = self.conv(x).flatten(2).transpose(1, 2)  # (B, 9, 6)
        tokens, _ = self.attn(tokens, tokens, tokens)
        return self.head(self.low_rank(torch.relu(self.hidden(tokens.mean(1)))))

    def training_step(self, batch, batch_idx):
        return nn.functional.cross_entropy(self(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", nn.functional.cross_entropy(self(batch[0]), batch[1]))

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.05)


class _Model(_Steps, pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.build()


def _expected_matrices(model: nn.Module) -> dict[str, np.ndarray]:
    q, k, v = model.attn.in_proj_weight.detach().numpy().reshape(3, 6, 6)
    return {
        "conv": model.conv.weight.detach().numpy(),
        "attn.q_proj": q,
        "attn.k_proj": k,
        "attn.v_proj": v,
        "attn.out_proj": model.attn.out_proj.weight.detach().numpy(),
        "hidden": model.hidden.weight.detach().numpy(),
        "low_rank": model.low_rank.weight.detach().numpy(),
        "head": model.head.weight.detach().numpy(),
    }


def _loader(n: int = 32) -> torch.utils.data.DataLoader:
    generator = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(n, 3, 5, 5, generator=generator), torch.randint(0, 3, (n,)))
    return torch.utils.data.DataLoader(data, batch_size=8)


def _fit(trainer_cls, model, monitor, **kwargs):
    trainer = quiet_trainer([monitor], trainer_cls, **({"max_epochs": 1} | kwargs))
    trainer.fit(model, _loader(), _loader(16))
    return trainer


def test_logged_values_equal_numpy_svd_of_the_trained_weights(tmp_path):
    torch.manual_seed(0)
    model = _Model()
    monitor = WeightRankMonitor(tail_ranks=TAIL_RANKS, save_singular_values=True, verbose=False)
    logger = CSVLogger(tmp_path)
    _fit(pl.Trainer, model, monitor, logger=logger)

    with (Path(logger.log_dir) / "metrics.csv").open(newline="") as file:
        rows = [row for row in csv.DictReader(file) if row.get("weight/head/stable_rank")]
    # The untrained weights (epoch -1, sent at step 0), then the one trained epoch.
    assert [row["epoch"] for row in rows] == ["-1", "0"]
    logged = {key: float(value) for key, value in rows[1].items() if key.startswith("weight/")}
    matrices = _expected_matrices(model)
    expected = {f"weight/{name}/{m}": v for name, w in matrices.items() for m, v in _reference(w).items()}
    assert logged.keys() == expected.keys()
    for key, value in expected.items():
        assert logged[key] == pytest.approx(value, rel=1e-6), key
    assert logged["weight/low_rank/numerical_rank"] == 3
    assert logged["weight/hidden/numerical_rank"] == 6

    directory = Path(logger.log_dir) / FIGURE_DIR
    assert json.loads((directory / "weight_curves.json").read_text())["layers"] == list(matrices)
    assert (directory / "weight_tail_error_k5.png").is_file()
    spectra = np.load(directory / "weight_singular_values" / "epoch_0000.npz")
    for name, w in matrices.items():
        np.testing.assert_allclose(spectra[name], np.linalg.svd(w.reshape(w.shape[0], -1), compute_uv=False), rtol=1e-5)


def test_works_with_a_lightning_pytorch_trainer(tmp_path):
    lightning = pytest.importorskip("lightning.pytorch")

    class LightningModel(_Steps, lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.build()

    torch.manual_seed(0)
    model = LightningModel()
    monitor = WeightRankMonitor(tail_ranks=TAIL_RANKS, verbose=False)
    trainer = _fit(lightning.Trainer, model, monitor, default_root_dir=tmp_path)
    for name, w in _expected_matrices(model).items():
        for metric, value in _reference(w).items():
            assert float(trainer.callback_metrics[f"weight/{name}/{metric}"]) == pytest.approx(value, rel=1e-6)
    assert (tmp_path / FIGURE_DIR / "weight_stable_rank.png").is_file()


def test_gram_decomposition_gives_the_same_metrics_as_svd():
    torch.manual_seed(0)
    model = _Model()
    exact = WeightRankMonitor(tail_ranks=TAIL_RANKS).measure(model)
    fast = WeightRankMonitor(tail_ranks=TAIL_RANKS, decomposition="gram").measure(model)
    assert fast.keys() == exact.keys()
    for name, metrics in exact.items():
        assert fast[name] == pytest.approx(metrics, rel=1e-9, abs=1e-7), name


def test_auto_decomposition_squares_well_conditioned_float32_weights_only():
    torch.manual_seed(0)
    model = _Model()
    by_gram = WeightRankMonitor(decomposition="gram").spectra(model)
    by_svd = WeightRankMonitor(decomposition="svd").spectra(model)
    routes = {}
    for name, spectrum in WeightRankMonitor().spectra(model).items():
        s = by_svd[name].singular_values
        routes[name] = "svd" if s[-1] < 1e-3 * s[0] else "gram"
        expected = by_svd[name] if routes[name] == "svd" else by_gram[name]
        assert torch.equal(spectrum.singular_values, expected.singular_values), name
        # Either way every singular value matches the SVD to 1e-10 relative (or 1e-12 of s_1 for a zero one).
        np.testing.assert_allclose(spectrum.singular_values, s, rtol=1e-10, atol=1e-12 * float(s[0]))
    assert routes["low_rank"] == "svd" and "gram" in routes.values()

    model = model.double()
    by_svd = WeightRankMonitor(decomposition="svd").spectra(model)
    for name, spectrum in WeightRankMonitor().spectra(model).items():
        assert torch.equal(spectrum.singular_values, by_svd[name].singular_values), name


def test_measure_uses_the_configured_tolerance_and_metrics():
    torch.manual_seed(0)
    model = _Model()
    monitor = WeightRankMonitor(
        metrics=["numerical_rank", "tail_error"], tail_ranks=[2], rank_tolerance=0.5, tolerance_size="max"
    )
    values = monitor.measure(model)
    for name, w in _expected_matrices(model).items():
        s = np.linalg.svd(w.reshape(w.shape[0], -1).astype(np.float64), compute_uv=False)
        assert values[name] == {
            "numerical_rank": float(np.sum(s >= 0.5 * s[0])),
            "tail_error_k2": pytest.approx(np.sqrt(np.sum(s[2:] ** 2) / np.sum(s**2)), rel=1e-12),
        }


@pytest.mark.parametrize(
    "layer",
    [nn.Conv1d(3, 4, 5), nn.Conv2d(4, 8, 3, groups=2), nn.Conv3d(3, 2, (1, 2, 2)), nn.Linear(7, 5)],
    ids=["conv1d", "conv2d_groups", "conv3d", "linear"],
)
@pytest.mark.parametrize("decomposition", ["svd", "gram"])
def test_conv_kernels_are_reshaped_to_out_by_fan_in(layer, decomposition):
    net = nn.Sequential(layer)
    spectrum = WeightRankMonitor(decomposition=decomposition).spectra(net)["0"]
    weight = layer.weight.detach().numpy()
    fan_in = int(np.prod(weight.shape[1:]))
    groups = getattr(layer, "groups", 1)
    assert (spectrum.num_samples, spectrum.num_features) == (weight.shape[0], fan_in * groups)
    assert spectrum.singular_values.dtype == torch.float64
    # groups > 1: the layer's map is block-diagonal over the groups' (out / groups, fan_in) blocks.
    blocks = torch.from_numpy(weight.reshape(weight.shape[0], fan_in).astype(np.float64)).chunk(groups)
    expected = torch.linalg.svdvals(torch.block_diag(*blocks)).numpy()
    np.testing.assert_allclose(
        spectrum.singular_values.numpy(), expected, rtol=1e-10 if decomposition == "svd" else 1e-7
    )


def test_attention_with_separate_projections_is_split_per_projection():
    attention = nn.MultiheadAttention(8, 2, kdim=5, vdim=3)
    spectra = WeightRankMonitor().spectra(nn.Sequential(attention))
    assert list(spectra) == ["0.q_proj", "0.k_proj", "0.v_proj", "0.out_proj"]
    for part, width in zip("qkv", (8, 5, 3)):
        weight = getattr(attention, f"{part}_proj_weight").detach().double().numpy()
        assert spectra[f"0.{part}_proj"].num_features == width
        np.testing.assert_allclose(spectra[f"0.{part}_proj"].singular_values.numpy(), np.linalg.svd(weight)[1])


@pytest.mark.parametrize("decomposition", ["svd", "gram"])
def test_non_finite_weights_give_nan_without_touching_other_layers(decomposition):
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with torch.no_grad():
        net[0].weight[1, 2] = math.nan
    values = WeightRankMonitor(tail_ranks=[1], decomposition=decomposition).measure(net)
    assert all(math.isnan(v) for v in values["0"].values())
    assert values["1"]["spectral_norm"] == pytest.approx(np.linalg.norm(net[1].weight.detach().numpy(), 2))


def _network() -> nn.Module:
    net = nn.Module()
    net.stem = nn.Conv2d(3, 4, 3)
    net.block = nn.Sequential(nn.Conv2d(4, 4, 3), nn.BatchNorm2d(4), nn.Linear(4, 4))
    net.attn = nn.MultiheadAttention(4, 2)
    net.head = nn.Linear(4, 2)
    return net


ATTENTION = ["attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.out_proj"]


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({}, ["stem", "block.0", "block.2", *ATTENTION, "head"]),
        ({"layers": ["block.*"]}, ["block.0", "block.2"]),
        ({"layers": ["block"]}, ["block.0", "block.2"]),
        ({"layers": ["head", "stem"]}, ["stem", "head"]),
        ({"layers": ["attn"]}, ATTENTION),
        ({"layer_types": [nn.Conv2d]}, ["stem", "block.0"]),
        ({"layer_types": ["Linear"]}, ["block.2", "attn.out_proj", "head"]),
        ({"layer_types": ["torch.nn.MultiheadAttention"]}, ATTENTION),
        ({"layers": ["block.*", "h*"], "layer_types": [nn.Linear]}, ["block.2", "head"]),
    ],
)
def test_layer_selection_by_name_glob_and_type(options, expected):
    assert WeightRankMonitor(**options).select(_network()) == expected


def test_block_names_of_the_module_select_the_weights_inside():
    net = _network()
    net.blocks = lambda: {"features": "block", "attention": "attn"}
    assert WeightRankMonitor(layers=["features"]).select(net) == ["block.0", "block.2"]
    with pytest.raises(ValueError, match="unknown layer 'nope'; layers are: features, attention, stem"):
        WeightRankMonitor(layers=["nope"]).select(net)
    net.blocks = lambda: {"norm": "block.1"}
    with pytest.raises(ValueError, match=r"layer 'block\.1' holds nothing that can be monitored; layers are: stem, "):
        WeightRankMonitor(layers=["norm"]).select(net)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"layers": ["blokc"]}, "unknown layer 'blokc'; layers are: stem, block.0, block.2, attn, attn.out_proj, head"),
        ({"layers": ["layer9.*"]}, "layer 'layer9.*' matches nothing that can be monitored; layers are: stem, "),
        ({"layers": ["block.1"]}, "layer 'block.1' matches nothing that can be monitored"),
        ({"layer_types": [nn.Conv3d]}, "match none of the selected layers; their types are: Conv2d, Linear"),
    ],
)
def test_selection_errors_list_the_valid_choices(options, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.").replace("*", r"\*")):
        WeightRankMonitor(**options).select(_network())


def test_unknown_layer_fails_at_setup_before_training(tmp_path):
    monitor = WeightRankMonitor(layers=["nonexistent"])
    with pytest.raises(ValueError, match="unknown layer 'nonexistent'; layers are: conv, attn"):
        _fit(pl.Trainer, _Model(), monitor, default_root_dir=tmp_path)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"metrics": ["rank"]}, r"unknown metrics \['rank'\]; valid choices are: numerical_rank, stable_rank"),
        ({"every_n_epochs": 0}, "every_n_epochs must be a positive integer"),
        ({"tolerance_size": "mid"}, "unknown tolerance_size 'mid'; valid choices are: min, max"),
        ({"tail_ranks": [0]}, "tail_ranks must be positive integers"),
        ({"tail_ranks": []}, "needs at least one k"),
        ({"rank_tolerance": -1.0}, "rank_tolerance must be a positive number or None, got -1.0"),
        ({"decomposition": "qr"}, "unknown decomposition 'qr'; valid choices are: auto, svd, gram"),
        ({"layers": []}, "layers must be None or a non-empty list"),
        ({"layer_types": ["torch.nn.Nope"]}, "layer type 'torch.nn.Nope' cannot be imported"),
        ({"layer_types": [int]}, "layer_types entries must be nn.Module classes"),
    ],
)
def test_constructor_validates_settings(options, message):
    with pytest.raises(ValueError, match=message):
        WeightRankMonitor(**options)


@pytest.mark.filterwarnings("ignore:You defined a `validation_step` but have no `val_dataloader`")
def test_every_n_epochs_without_validation_monitors_at_train_epoch_end(tmp_path):
    monitor = WeightRankMonitor(layers=["head"], metrics=["stable_rank"], every_n_epochs=2, verbose=False)
    trainer = quiet_trainer([monitor], max_epochs=4, default_root_dir=tmp_path)
    trainer.fit(_Model(), _loader(16))
    assert monitor.curves.epochs == [-1, 1, 3]
    assert monitor.curves.layers == ["head"]


def test_every_epoch_reaches_the_loggers_at_its_last_step_whether_validated_or_not(tmp_path):
    class WandbLogger(RecordingLogger):
        """Records what is sent; wandb_loggers() recognises loggers by this class name."""

    monitor = WeightRankMonitor(layers=["head"], metrics=["stable_rank"], save_singular_values=True, verbose=False)
    logger = WandbLogger()
    trainer = quiet_trainer(
        [monitor], max_epochs=4, check_val_every_n_epoch=2, default_root_dir=tmp_path, logger=logger
    )
    trainer.fit(_Model(), _loader(32), _loader(16))  # 4 batches per epoch; validation in epochs 1 and 3

    # Each epoch at the step of its last batch, where Lightning logs the epoch's own metrics (val/loss included).
    steps = {int(m["epoch"]): step for step, m in logger.calls if "weight/head/stable_rank" in m}
    assert steps == {-1: 0, 0: 3, 1: 7, 2: 11, 3: 15}
    assert [step for step, m in logger.calls if "val/loss" in m] == [7, 15]
    # The spectra go beside the scalars of their epoch (the untrained weights' too).
    assert [step for step, m in logger.calls if "weight_spectra/head" in m] == [0, 3, 7, 11, 15]


@pytest.mark.parametrize("val_check_interval", [1.0, 0.5])
def test_every_recorded_point_keeps_its_own_spectra(tmp_path, val_check_interval):
    monitor = WeightRankMonitor(layers=["head"], metrics=["stable_rank"], save_singular_values=True, verbose=False)
    trainer = quiet_trainer([monitor], max_epochs=2, val_check_interval=val_check_interval, default_root_dir=tmp_path)
    trainer.fit(_Model(), _loader(32), _loader(16))  # 4 batches per epoch

    directory = tmp_path / FIGURE_DIR / "weight_singular_values"
    # One file per point of the curves, the untrained weights included, named by the curves' axis: two validations
    # of one epoch (keyed by step) must not write the same file.
    if val_check_interval == 1.0:
        assert monitor.curves.epochs == [-1, 0, 1]
        names = ["epoch_-001.npz", "epoch_0000.npz", "epoch_0001.npz"]
    else:
        assert monitor.curves.epochs == [0, 2, 4, 6, 8]
        names = [f"step_{step:08d}.npz" for step in monitor.curves.epochs]
    assert sorted(p.name for p in directory.iterdir()) == names
    for point, name in zip(monitor.curves.epochs, names):
        singular_values = np.load(directory / name)["head"]
        stable_rank = float((singular_values**2).sum() / singular_values[0] ** 2)
        assert monitor.curves.history[point]["head"]["stable_rank"] == pytest.approx(stable_rank, rel=1e-9), name


@pytest.mark.slow
def test_offline_wandb_run_holds_the_weight_keys_and_charts(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    torch.manual_seed(0)
    model = _Model()
    metrics = ["numerical_rank", "spectral_norm", "tail_error"]
    monitor = WeightRankMonitor(layers=["hidden", "head"], metrics=metrics, tail_ranks=[5], save_singular_values=True)
    logger = WandbLogger(mode="offline", save_dir=tmp_path, project="rank")
    try:
        _fit(pl.Trainer, model, monitor, logger=logger, max_epochs=2)
        run_id = logger.experiment.id
    finally:
        wandb.finish()

    # The last value of every key (offline_run_history waits for the service to close the log).
    history = {key: values[-1] for key, values in offline_run_history(tmp_path).items()}
    matrices = _expected_matrices(model)
    for name in ("hidden", "head"):
        reference = _reference(matrices[name])
        for metric in ("numerical_rank", "spectral_norm", "tail_error_k5"):
            assert float(history[f"weight/{name}/{metric}"]) == pytest.approx(reference[metric], rel=1e-6)
        assert json.loads(history[f"weight_spectra/{name}/_type"]) == "histogram"
    for metric in ("numerical_rank", "tail_error_k5"):
        for chart in ("vs_epoch", "vs_depth"):
            assert json.loads(history[f"weight_curves/{metric}_{chart}_table/_type"]) == "table-file"
    assert (tmp_path / "rank" / run_id / FIGURE_DIR / "weight_spectral_norm.png").is_file()


@pytest.mark.slow
def test_an_epoch_and_a_step_weight_monitor_keep_their_spectra_apart_in_wandb_and_on_disk(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    torch.manual_seed(0)
    options = dict(layers=["head"], metrics=["stable_rank"], save_singular_values=True, verbose=False)
    by_epoch = WeightRankMonitor(**options)
    by_step = WeightRankMonitor(**options, every_n_train_steps=2, namespace="weight_step")
    logger = WandbLogger(mode="offline", save_dir=tmp_path, project="rank")
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*another run")
            trainer = quiet_trainer([by_epoch, by_step], logger=logger, max_epochs=2, log_every_n_steps=1)
            trainer.fit(_Model(), _loader(), _loader(16))
        directory = tmp_path / "rank" / logger.experiment.id / FIGURE_DIR
    finally:
        wandb.finish()

    rows = offline_run_rows(tmp_path)
    val_steps = [int(row["trainer/global_step"]) for row in rows if "val/loss" in row]
    assert val_steps == [3, 7]  # 4 batches an epoch
    for monitor, steps, files in (
        (by_epoch, [0, *val_steps], ["epoch_-001", "epoch_0000", "epoch_0001"]),
        (by_step, [0, 2, 4, 6, 8], [f"step_{step:08d}" for step in (0, 2, 4, 6, 8)]),
    ):
        namespace = monitor.curves.namespace
        scalars = [row for row in rows if f"{namespace}/head/stable_rank" in row]
        assert [int(row["trainer/global_step"]) for row in scalars] == steps
        assert [float(row[f"{namespace}/head/stable_rank"]) for row in scalars] == [
            monitor.curves.history[point]["head"]["stable_rank"] for point in monitor.curves.epochs
        ]
        spectra = [row for row in rows if f"{namespace}_spectra/head/bins" in row]
        assert [int(row["trainer/global_step"]) for row in spectra] == steps
        folder = directory / f"{namespace}_singular_values"
        assert sorted(path.stem for path in folder.iterdir()) == sorted(files)
        for row, name in zip(spectra, files):
            singular_values = np.load(folder / f"{name}.npz")["head"]
            bins = json.loads(row[f"{namespace}_spectra/head/bins"])
            assert (bins[0], bins[-1]) == pytest.approx((singular_values.min(), singular_values.max()), rel=1e-12)


@pytest.mark.slow
def test_wandb_charts_go_to_the_step_of_the_measurement_that_sends_them(tmp_path, monkeypatch):
    # No validation: the epochs are measured in on_train_epoch_end, which Lightning logs at the epoch's last step.
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    torch.manual_seed(0)
    monitor = WeightRankMonitor(layers=["head"], metrics=["stable_rank"], log_at_init=False, verbose=False)
    logger = WandbLogger(mode="offline", save_dir=tmp_path, project="rank")
    try:
        trainer = quiet_trainer([monitor], logger=logger, max_epochs=2, limit_val_batches=0, log_every_n_steps=1)
        trainer.fit(_Model(), _loader())
    finally:
        wandb.finish()

    rows = offline_run_rows(tmp_path)
    scalars = [int(row["trainer/global_step"]) for row in rows if "weight/head/stable_rank" in row]
    chart = "weight_curves/stable_rank_vs_epoch_table/_type"
    charts = [int(row["trainer/global_step"]) for row in rows if chart in row]
    assert scalars == [3, 7]  # 4 batches an epoch
    # After the first measured epoch, beside its scalars; then once more at the end of fit, after every step.
    assert charts == [3, 8]


class _BlockNet(nn.Module):
    """A small network offering ``blocks()``, as the package's modules do."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()),
            nn.Sequential(nn.Conv2d(4, 6, 3), nn.ReLU(), nn.Conv2d(6, 8, 1)),
            nn.Flatten(),
            nn.Linear(8, 2),
        )

    def blocks(self) -> dict[str, str]:
        return {"stem": "net.0", "body": "net.1"}


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"layers": ["body"]}, ["net.1.0", "net.1.2"]),
        ({"layers": "stem"}, ["net.0.0"]),
        ({"layers": ["net.1.2"]}, ["net.1.2"]),
        ({"layers": ["net.1"]}, ["net.1.0", "net.1.2"]),
        ({"layers": ["net.*.0"]}, ["net.0.0", "net.1.0"]),
        ({"layers": ["s*"]}, ["net.0.0"]),
        ({"layer_types": ["Linear"]}, ["net.3"]),
        ({"layer_types": [nn.Conv2d]}, ["net.0.0", "net.1.0", "net.1.2"]),
        ({"layers": ["body", "net.3"], "layer_types": ["torch.nn.Linear"]}, ["net.3"]),
    ],
    ids=["block", "block_string", "path", "container_path", "glob", "block_glob", "type_name", "type", "mixed"],
)
def test_weight_monitor_accepts_the_shared_layer_syntax(options, expected):
    torch.manual_seed(0)
    model = _BlockNet()
    monitor = WeightRankMonitor(**options)
    assert monitor.select(model) == expected
    spectra = monitor.spectra(model)
    assert list(spectra) == expected
    for name, spec in spectra.items():
        weight = model.get_submodule(name).weight.detach().double().numpy()
        reference = np.linalg.svd(weight.reshape(weight.shape[0], -1), compute_uv=False)
        np.testing.assert_allclose(spec.singular_values.numpy(), reference, rtol=1e-10)


@pytest.mark.parametrize("verbose", [True, False])
def test_setup_reports_the_monitored_matrices_on_rank_zero(tmp_path, callback_messages, verbose):
    monitor = WeightRankMonitor(layers=["attn", "head"], metrics=["stable_rank"], verbose=verbose)
    _fit(pl.Trainer, _Model(), monitor, default_root_dir=tmp_path)
    expected = [f"WeightRankMonitor: monitoring 5 weight matrices: {', '.join([*ATTENTION, 'head'])}"]
    assert callback_messages == (expected if verbose else [])


WIDE, NARROW, LOW_RANK = 256, 64, 8


class _HalfPrecisionWeights(pl.LightningModule):
    """``low``: a (256, 64) weight of rank 8, which bf16 rounding makes numerically full rank under float32's
    tolerance; the optimizer does not move it (lr 0)."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.low = nn.Linear(NARROW, WIDE, bias=False)
        with torch.no_grad():
            self.low.weight.copy_(
                torch.randn(WIDE, LOW_RANK, generator=generator) @ torch.randn(LOW_RANK, NARROW, generator=generator)
            )

    def training_step(self, batch, batch_idx):
        return self.low(batch[0]).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _half_precision_loader() -> torch.utils.data.DataLoader:
    generator = torch.Generator().manual_seed(1)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, NARROW, generator=generator)))


def _bf16_reference(weight: torch.Tensor, eps: float) -> dict[str, float]:
    """The metrics from float64 ``torch.linalg.svdvals`` of the stored bf16 weight, relative tolerance ``eps``."""
    s = torch.linalg.svdvals(weight.detach().double())
    p = s / s.sum()
    return {
        "numerical_rank": float((s >= eps * s[0]).sum()),
        "stable_rank": float(s.square().sum() / s[0] ** 2),
        "effective_rank": math.exp(-float((p * p.log()).sum())),
        "spectral_norm": float(s[0]),
        "tail_error_k10": math.sqrt(float(s[10:].square().sum() / s.square().sum())),
    }


@pytest.mark.parametrize(
    ("tolerance_dtype", "eps", "advice"),
    [
        (None, torch.finfo(torch.float32).eps * NARROW, True),
        ("input", torch.finfo(torch.bfloat16).eps, False),
        (torch.bfloat16, torch.finfo(torch.bfloat16).eps, False),
        ("float32", torch.finfo(torch.float32).eps * NARROW, False),
    ],
)
def test_bf16_true_weights_take_the_tolerance_of_tolerance_dtype(tmp_path, tolerance_dtype, eps, advice):
    model = _HalfPrecisionWeights()
    monitor = WeightRankMonitor(
        tail_ranks=(10,), tolerance_dtype=tolerance_dtype, decomposition="svd", every_n_train_steps=1, verbose=False
    )
    trainer = quiet_trainer([monitor], max_steps=1, precision="bf16-true", default_root_dir=tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, _half_precision_loader())
    assert model.low.weight.dtype == torch.bfloat16
    named = [str(w.message) for w in caught if "float32 tolerance" in str(w.message)]
    # The initial point and the step both measured bf16 weights: the layer is named once, with its dtype and the fix.
    assert named == (
        [
            "WeightRankMonitor: layer 'low' stores its weights in bfloat16, but numerical_rank takes the float32 "
            "tolerance, under which their rounding noise counts as rank. Set tolerance_dtype='input' for the "
            "tolerance of each weight's dtype (or tolerance_dtype=torch.bfloat16; tolerance_dtype=torch.float32 "
            "keeps the float32 rule without this warning)."
        ]
        if advice
        else []
    )
    expected = _bf16_reference(model.low.weight, eps)
    logged = {metric: float(trainer.callback_metrics[f"weight/low/{metric}"]) for metric in expected}
    assert logged == pytest.approx(expected, rel=1e-12)
    # Feng's float32 rule counts bf16 rounding noise (about 1e-3 s_1) as rank; bf16's own eps (7.8e-3) does not.
    assert logged["numerical_rank"] == (NARROW if tolerance_dtype in (None, "float32") else LOW_RANK)


def test_float16_weights_measured_directly_follow_their_dtype():
    model = _HalfPrecisionWeights().half()
    values = WeightRankMonitor(tolerance_dtype="input", decomposition="svd", verbose=False).measure(model)
    expected = _bf16_reference(model.low.weight, torch.finfo(torch.float16).eps)
    assert values["low"]["numerical_rank"] == expected["numerical_rank"] == LOW_RANK
    # float32 and float64 weights keep Feng's eps * K in their own precision.
    double = WeightRankMonitor(tolerance_dtype="input", decomposition="svd", verbose=False).measure(model.double())
    s = torch.linalg.svdvals(model.low.weight.detach())
    assert double["low"]["numerical_rank"] == float((s >= torch.finfo(torch.float64).eps * NARROW * s[0]).sum())


@pytest.mark.parametrize(
    ("tolerance_dtype", "caption"),
    [
        (None, "rank tolerance: float32 eps \u00d7 min(rows, columns) (default)"),
        ("input", "rank tolerance: eps of the weights' dtype (\u00d7 min(rows, columns) for float32)"),
        (torch.bfloat16, "rank tolerance: bfloat16 eps"),
    ],
)
def test_the_caption_states_the_tolerance_and_its_dtype(tmp_path, tolerance_dtype, caption):
    monitor = WeightRankMonitor(tolerance_dtype=tolerance_dtype, verbose=False)
    trainer = quiet_trainer([monitor], max_epochs=1, limit_train_batches=1, default_root_dir=tmp_path)
    trainer.fit(_HalfPrecisionWeights(), _half_precision_loader())
    assert monitor.curves.caption() == caption


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"tolerance_dtype": "int8"},
            "unknown tolerance_dtype 'int8'; valid choices are: None, a floating torch.dtype",
        ),
        ({"tolerance_dtype": "input", "rank_tolerance": 1e-3}, "rank_tolerance=0.001 and tolerance_dtype='input'"),
    ],
)
def test_tolerance_dtype_is_validated(options, message):
    with pytest.raises(ValueError, match=message):
        WeightRankMonitor(**options)


def test_an_evaluation_run_says_that_weights_are_not_measured_there(tmp_path, callback_messages):
    monitor = WeightRankMonitor(layers=["attn", "head"], metrics=["stable_rank"])
    trainer = quiet_trainer([monitor], default_root_dir=tmp_path)
    model = _Model()
    model.test_step = model.validation_step
    trainer.validate(model, _loader(16), verbose=False)
    trainer.test(model, _loader(16), verbose=False)
    assert callback_messages == [
        "WeightRankMonitor: trainer.validate is not monitored (weights are measured during fit)",
        "WeightRankMonitor: trainer.test is not monitored (weights are measured during fit)",
    ]
    assert monitor.curves.epochs == []


def test_a_failed_spectrum_write_keeps_the_earlier_file_and_the_fit_goes_on(tmp_path, monkeypatch):
    def fit() -> pl.Trainer:
        monitor = WeightRankMonitor(layers=["head"], metrics=["stable_rank"], save_singular_values=True, verbose=False)
        trainer = quiet_trainer([monitor], max_epochs=1, default_root_dir=tmp_path, logger=False)
        trainer.fit(_Model(), _loader(32), _loader(16))
        return trainer

    fit()
    saved = tmp_path / FIGURE_DIR / "weight_singular_values" / "epoch_-001.npz"
    before = np.load(saved)["head"]
    before_epoch_0 = np.load(saved.with_name("epoch_0000.npz"))["head"]

    def half_written(file, **arrays):  # a disk that fills up in the middle of the write
        (open(file, "wb") if isinstance(file, (str, Path)) else file).write(b"PK\x03\x04 truncated")
        raise OSError("No space left on device")

    monkeypatch.setattr(np, "savez_compressed", half_written)
    with pytest.warns(RuntimeWarning, match=r"could not write \S*epoch_0000\.npz \(OSError\('No space left") as caught:
        trainer = fit()  # the second run into the same folder cannot write its spectra
    assert trainer.state.finished and trainer.current_epoch == 1
    assert sum("could not write" in str(w.message) for w in caught) == 2  # epoch -1 and epoch 0, each named
    kept = saved.parent.with_name("weight_singular_values-v1")  # the first run's, set aside whole
    np.testing.assert_array_equal(np.load(kept / saved.name)["head"], before)
    np.testing.assert_array_equal(np.load(kept / "epoch_0000.npz")["head"], before_epoch_0)
    assert sorted(p.name for p in kept.iterdir()) == ["epoch_-001.npz", "epoch_0000.npz"]
    assert list(saved.parent.iterdir()) == []  # no partial file of the second run
