import math
import warnings
from pathlib import Path

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from torch import nn

from rank_lightning.callbacks import JacobianRankMonitor
from rank_lightning.callbacks.classification_dimension import CLSDIM_DIR
from rank_lightning.callbacks.curves import FIGURE_DIR
from rank_lightning.cli import main
from rank_lightning.functional import partial_jacobian_ranks
from rank_lightning.functional.jacobian import Patch
from tests.callbacks.feng_helpers import (
    BLOCKS,
    PNG_MAGIC,
    SHAPE,
    DictBatches,
    DictTinyNet,
    TinyNet,
    make_data,
    make_loader,
    make_module,
    make_trainer,
)

ROOT = Path(__file__).resolve().parents[2]


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
    model, train, val = TinyNet(), make_data(), make_data(24, seed=2)
    monitor = JacobianRankMonitor(num_inputs=3, patch_size=4, log_per_input=True, verbose=False)
    make_trainer(tmp_path, [monitor], max_epochs=2).fit(model, make_loader(train, True), make_loader(val, shuffle=True))

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
        figure = tmp_path / FIGURE_DIR / f"jacobian_{metric}.png"
        assert figure.read_bytes()[:8] == PNG_MAGIC
    assert (tmp_path / FIGURE_DIR / "jacobian_curves.json").exists()


@pytest.mark.parametrize("inference_mode", [True, False])
def test_jacobian_under_validate_matches_reference(tmp_path, inference_mode):
    model, val = TinyNet(), make_data(24, seed=3)
    model.eval()
    monitor = JacobianRankMonitor(num_inputs=2, verbose=False)
    make_trainer(tmp_path, [monitor], inference_mode=inference_mode).validate(model, make_loader(val))
    # validate() of a model no optimizer step has touched is recorded as the initial point, epoch -1.
    # Default patch on 8 x 8 images: the central 2 x 2 over 3 channels (K = 12).
    reference = _reference_ranks(model, val.tensors[0][:2], Patch.central(SHAPE))
    for name, ranks in reference.items():
        logged = float(monitor.curves.history[-1][name]["rank"])
        assert logged == pytest.approx(float(ranks.double().mean()))
    assert monitor.curves.history[-1]["conv1"]["rank"] == 12
    assert (tmp_path / FIGURE_DIR / "jacobian_rank.png").exists()


def test_measure_restores_modes_and_keeps_batchnorm_statistics():
    model, val = TinyNet(), make_data(8)
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
    model, first, second = TinyNet(), make_data(24, seed=4), make_data(24, seed=5)
    monitor = JacobianRankMonitor(num_inputs=2, verbose=False)
    make_trainer(tmp_path, [monitor]).fit(model, make_loader(first), make_loader(first))
    state = monitor.state_dict()
    torch.testing.assert_close(state["inputs"], first.tensors[0][:2], rtol=0, atol=0)

    resumed = JacobianRankMonitor(num_inputs=2, verbose=False)
    resumed.load_state_dict(state)
    assert resumed.curves.epochs == [0]
    model.eval()
    make_trainer(tmp_path, [resumed]).validate(model, make_loader(second))
    reference = _reference_ranks(model, first.tensors[0][:2], Patch.central(SHAPE))
    for name, ranks in reference.items():
        assert resumed.curves.history[0][name]["rank"] == pytest.approx(float(ranks.double().mean()))


def test_jacobian_with_lightning_pytorch_trainer(tmp_path):
    lightning_pytorch = pytest.importorskip("lightning.pytorch")
    model, val = make_module(lightning_pytorch.LightningModule)(), make_data(16)
    monitor = JacobianRankMonitor(num_inputs=1, verbose=False)
    trainer = make_trainer(tmp_path, [monitor], trainer_cls=lightning_pytorch.Trainer)
    trainer.validate(model, make_loader(val))
    assert trainer.callback_metrics["jacobian/low/rank"] == 3


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"every_n_epochs": 0}, "every_n_epochs"),
        ({"num_inputs": -1}, "num_inputs"),
        ({"tolerance_size": "mean"}, "unknown tolerance_size 'mean'; valid choices are: min, max"),
        ({"rank_tolerance": 0.0}, "rank_tolerance"),
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


@pytest.mark.parametrize(
    ("layers", "layer_types", "expected"),
    [
        (["conv1"], None, {"conv1": "features.2"}),  # a block name
        (["features.4", "features.0"], None, {"features.0": "features.0", "conv2": "features.4"}),  # module paths
        (["conv*"], None, {"conv1": "features.2", "conv2": "features.4"}),  # a glob over block names
        (["features.[01]"], None, {"features.0": "features.0", "features.1": "features.1"}),  # a glob over modules
        (None, ["Linear"], {"features.8": "features.8", "head": "head"}),  # a module type
        (["features.*"], [nn.Conv2d], {"features.0": "features.0", "features.3": "features.3"}),  # glob and type
    ],
)
def test_monitor_accepts_the_shared_layer_syntax(layers, layer_types, expected):
    model, x = TinyNet(), make_data(4, seed=10).tensors[0][:2]
    monitor = JacobianRankMonitor(layers=layers, layer_types=layer_types, verbose=False)
    assert monitor.select(model) == expected
    assert list(monitor.monitored) == list(expected)  # depth order
    result = monitor.measure(model, x)
    reference = partial_jacobian_ranks(model, x, expected, Patch.central(SHAPE))
    assert list(result) == list(expected)
    for name in expected:
        assert result[name].ranks.tolist() == reference[name].ranks.tolist()


def test_foreign_model_default_layers_and_glob():
    torch.manual_seed(11)
    model = nn.Sequential(nn.Linear(12, 6), nn.ReLU(), nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 3))
    x = torch.randn(3, 12)
    monitor = JacobianRankMonitor(verbose=False)
    assert monitor.select(model) == {"1": "1", "3": "3"}  # the activations of a plain Sequential
    result = monitor.measure(model, x)
    # d relu(W x + b) / dx = diag(W x + b > 0) W: with a generic 6 x 12 W, the rank is the number of active units.
    with torch.no_grad():
        active = (model[0](x) > 0).sum(dim=1)
    assert result["1"].ranks.tolist() == active.tolist()
    assert JacobianRankMonitor(layers=["[13]"], verbose=False).select(model) == {"1": "1", "3": "3"}
    with pytest.raises(ValueError, match="unknown layer 'relu'; layers are: 0, 1, 2, 3, 4"):
        JacobianRankMonitor(layers=["relu"]).select(model)


def test_inputs_are_read_from_dict_batches_with_input_key(tmp_path):
    model, val = DictTinyNet(), make_data(24, seed=9)
    model.eval()
    monitor = JacobianRankMonitor(num_inputs=2, input_key="pixels", verbose=False)
    make_trainer(tmp_path, [monitor]).validate(model, make_loader(DictBatches(val)))
    torch.testing.assert_close(monitor.inputs, val.tensors[0][:2], rtol=0, atol=0)
    reference = _reference_ranks(model, val.tensors[0][:2], Patch.central(SHAPE))
    for name, ranks in reference.items():
        assert monitor.curves.history[-1][name]["rank"] == pytest.approx(float(ranks.double().mean()))


def test_dict_batches_without_input_key_raise_naming_the_keys(tmp_path):
    model, val = DictTinyNet(), make_data(8, seed=9)
    model.eval()
    monitor = JacobianRankMonitor(num_inputs=2, verbose=False)
    with pytest.raises(ValueError, match=r"cannot find the inputs .* keys \['pixels', 'digit'\]; set input_key"):
        make_trainer(tmp_path, [monitor]).validate(model, make_loader(DictBatches(val)))


class _TokenIds(pl.LightningModule):
    """A sequence model on integer token ids: an embedding, then a Linear block."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.block = nn.Linear(4, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.block(self.embed(ids)).mean(1)

    def validation_step(self, batch, batch_idx):
        self(batch[0])


def test_integer_token_ids_raise_naming_the_dtype(tmp_path):
    # torch.func.jvp's own "Expected primal to be floating point" named neither the inputs nor the way out.
    module = _TokenIds()
    ids = torch.randint(0, 10, (8, 5))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids, torch.zeros(8, dtype=torch.long)), 4)
    monitor = JacobianRankMonitor(layers=["block"], num_inputs=2, verbose=False)
    with pytest.raises(ValueError, match="the inputs are int64, not floating point: a Jacobian with respect to them"):
        make_trainer(tmp_path, [monitor]).validate(module, loader)


def test_setup_message_names_the_blocks_and_the_patch(callback_messages):
    JacobianRankMonitor(num_inputs=2, patch_size=4).setup(None, TinyNet(), "fit")
    assert callback_messages == [
        "JacobianRankMonitor: 3 blocks, 2 inputs, patch central 4x4: conv1 (features.2), conv2 (features.4), "
        "low (features.8)"
    ]
    JacobianRankMonitor(verbose=False).setup(None, TinyNet(), "fit")
    assert len(callback_messages) == 1


# -- the digits config, end to end -----------------------------------------------------------------------------


@pytest.mark.slow
def test_feng_digits_config_fit_then_validate(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = str(ROOT / "configs" / "feng_digits.yaml")
    main(["fit", "--config", config, "--trainer.max_epochs=5", "--trainer.enable_model_summary=false"])
    [run] = (tmp_path / "runs" / "feng_digits").iterdir()
    assert (run / FIGURE_DIR / "jacobian_rank.png").exists()
    assert (run / CLSDIM_DIR / "independence_deficit.md").exists()
    cli = main(["validate", "--config", config, "--ckpt_path", str(run / "checkpoints" / "last.ckpt")])
    metrics = cli.trainer.callback_metrics
    assert 1 <= metrics["clsdim/cls_dim"] <= metrics["clsdim/ambient_dim"] == 128
    assert not math.isnan(float(metrics["jacobian/layer1/rank"]))
    assert metrics["jacobian/backbone.head/rank"] <= 10


def test_nan_block_logs_nan_with_a_warning_naming_it_and_other_blocks_unaffected(tmp_path):
    model, train, val = TinyNet(), make_data(), make_data(8, seed=2)
    # conv2 gives NaN in eval mode only (training is unaffected); "low" comes after it and inherits the NaN.
    conv2 = model.get_submodule(BLOCKS["conv2"])
    conv2.register_forward_hook(lambda module, args, output: output if module.training else output * math.nan)
    monitor = JacobianRankMonitor(num_inputs=2, verbose=False)
    with pytest.warns(RuntimeWarning) as record:
        make_trainer(tmp_path, [monitor], max_epochs=2).fit(model, make_loader(train), make_loader(val))
    messages = [str(w.message) for w in record if "Jacobian" in str(w.message)]
    assert messages == [
        f"JacobianRankMonitor: the partial Jacobian of block {name!r} holds NaN or Inf values at 2 of the 2 inputs "
        "(inputs 0, 1); its rank, the mean over the inputs, is logged as NaN while any input's is (log_per_input=True "
        "logs the rank at each input)"
        for name in ("conv2", "low")
    ]
    assert not any("input matrix contains NaN" in str(w.message) for w in record)
    for epoch in (0, 1):
        assert math.isnan(monitor.curves.history[epoch]["conv2"]["rank"])
        assert math.isnan(monitor.curves.history[epoch]["low"]["rank"])
        assert monitor.curves.history[epoch]["conv1"]["rank"] == 12


def test_bf16_true_model_keeps_the_rank_of_the_known_rank_block(tmp_path):
    # Weights in bfloat16: the Jacobian is too; its rounding noise must not lift the rank-3 block to full rank.
    model = TinyNet()
    monitor = JacobianRankMonitor(num_inputs=2, verbose=False)
    trainer = make_trainer(tmp_path, [monitor], precision="bf16-true")
    trainer.fit(model, make_loader(make_data()), make_loader(make_data(8, seed=2)))
    assert monitor.curves.history[0]["low"] == {"rank": 3.0, "rank_max": 12.0}
    assert monitor.curves.history[0]["conv1"]["rank"] == 12.0


@pytest.mark.parametrize(
    ("precision", "options", "named"),
    [("medium", {}, True), ("highest", {}, False), ("medium", {"rank_tolerance": 1e-2}, False)],
)
def test_float32_jacobians_of_reduced_precision_products_are_named(tmp_path, precision, options, named):
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)  # "medium": oneDNN's bf16 products on a CPU
    try:
        monitor = JacobianRankMonitor(num_inputs=2, verbose=False, **options)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            make_trainer(tmp_path, [monitor]).validate(TinyNet(), make_loader(make_data(24, seed=3)))
    finally:
        torch.set_float32_matmul_precision(previous)
    found = [str(w.message) for w in caught if "BF16 products" in str(w.message)]
    assert len(found) == (1 if named else 0), found
    if named:
        assert "Set rank_tolerance (at least 0.00781" in found[0] and "highest" in found[0]


class _Video(pl.LightningModule):
    """Two Conv3d blocks over (C, T, H, W) clips."""

    def __init__(self) -> None:
        super().__init__()
        self.block1 = nn.Sequential(nn.Conv3d(3, 4, 3, padding=1), nn.ReLU())
        self.block2 = nn.Conv3d(4, 2, 1)
        self.head = nn.Linear(2, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block2(self.block1(x)).mean((2, 3, 4)))

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", nn.functional.cross_entropy(self(batch[0]), batch[1]))


def test_a_video_takes_a_mask_patch_and_every_coordinate_is_refused_before_training(tmp_path):
    generator = torch.Generator().manual_seed(0)
    clips = torch.utils.data.TensorDataset(torch.randn(4, 3, 16, 48, 48, generator=generator), torch.arange(4))
    model = _Video()
    layers = {"block1": "block1", "block2": "block2"}
    patch = torch.zeros(3, 16, 48, 48, dtype=torch.bool)
    patch[:, 8, 20:22, 20:22] = True  # 2 x 2 pixels of frame 8, all channels: K = 12
    monitor = JacobianRankMonitor(layers=list(layers), num_inputs=2, patch=patch, verbose=False)
    make_trainer(tmp_path, [monitor]).validate(model, make_loader(clips))
    reference = partial_jacobian_ranks(model.eval(), clips.tensors[0][:2], layers, patch)
    for name, result in reference.items():
        assert monitor.curves.history[-1][name]["rank"] == pytest.approx(float(result.ranks.double().mean()))
    assert monitor.curves.history[-1]["block2"]["rank_max"] == 12
    # Every one of the 110,592 coordinates of a clip: refused, naming the patch, before any training step.
    every = JacobianRankMonitor(layers=list(layers), num_inputs=1, verbose=False)
    with pytest.raises(ValueError, match=r"K = 110,592 coordinates of inputs of shape \(3, 16, 48, 48\).*patch"):
        make_trainer(tmp_path / "every", [every]).validate(model, make_loader(clips))
    with pytest.raises(ValueError, match="a boolean mask of one input's shape"):
        JacobianRankMonitor(patch=[1, 2])
