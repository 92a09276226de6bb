"""ActivationRankMonitor on ``torch.compile``d models: the hooks fire and the values are those of the eager model.

TorchDynamo never calls forward hooks registered after it compiled (it does not guard on them), so the monitored
passes run eagerly (see :func:`rank_lightning.layers.forward_hooks`); the others keep running the compiled code.
The models are compiled with the ``"eager"`` backend: TorchDynamo's capture and guards, which decide whether hooks
run, without Inductor's code generation, which takes tens of seconds per model on a CPU.
"""

from __future__ import annotations

from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

from rank_lightning.callbacks import ActivationRankMonitor
from rank_lightning.callbacks.curves import LayerCurves
from tests.callbacks.trainer_helpers import quiet_trainer

CLASSES = 3


@pytest.fixture(autouse=True)
def _quick_runs(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """Runs write their curve files under ``tmp_path`` and draw no figures (not what these tests are about); every
    test starts with empty compile caches (TorchDynamo keys them by code object, which the tests' models share)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(LayerCurves, "write_figures", lambda self, *args, **kwargs: [])
    torch.compiler.reset()


class CountingBackend:
    """The ``"eager"`` backend, counting how often compiled code runs."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: list) -> Any:
        def run(*args: Tensor) -> Any:
            self.calls += 1
            return graph.forward(*args)

        return run


class MLPClassifier(pl.LightningModule):
    """A tiny MLP; ``compile_net`` compiles it where users do: the network in ``__init__``, or in place."""

    def __init__(self, compile_net: str | None = None, backend: Any = "eager") -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, CLASSES))
        if compile_net == "wrapped":
            self.net = torch.compile(self.net, backend=backend)
        elif compile_net == "in_place":
            self.net.compile(backend=backend)
        self.num_classes = CLASSES

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return nn.functional.cross_entropy(self(batch[0]), batch[1])

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _batches(count: int, seed: int) -> list[tuple[Tensor, Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 6, generator=generator), torch.randint(0, CLASSES, (8,), generator=generator))] * count


def _rank_values(module: Any, monitor: ActivationRankMonitor, train_batches: int = 4) -> dict[str, float]:
    trainer = quiet_trainer([monitor], max_epochs=1)
    trainer.fit(
        module, DataLoader(_batches(train_batches, 0), batch_size=None), DataLoader(_batches(2, 1), batch_size=None)
    )
    return {key: float(value) for key, value in trainer.callback_metrics.items() if key.startswith("rank")}


def _monitor(cadence: str) -> ActivationRankMonitor:
    if cadence == "epoch":
        return ActivationRankMonitor(log_at_init=False)
    return ActivationRankMonitor(every_n_train_steps=2, window_batches=1, log_at_init=False)


@pytest.mark.parametrize("cadence", ["epoch", "step"])
@pytest.mark.parametrize("how", ["wrapped", "in_place", "lightning_module"])
def test_a_compiled_model_logs_the_values_of_the_eager_one(how, cadence):
    torch.manual_seed(0)
    eager = _rank_values(MLPClassifier(), _monitor(cadence))
    torch.manual_seed(0)
    backend = CountingBackend()
    if how == "lightning_module":
        module: Any = torch.compile(MLPClassifier(), backend=backend)  # Lightning compiles forward and the steps
    else:
        module = MLPClassifier(compile_net=how, backend=backend)
    compiled = _rank_values(module, _monitor(cadence))
    layer_keys = {key.split("/")[1] for key in eager}
    assert layer_keys == {"net.1", "net.3"}  # a compiled network's layers keep their eager names
    assert compiled.keys() == eager.keys()
    assert compiled == pytest.approx(eager, rel=1e-9)
    assert backend.calls > 0  # the passes that were not monitored ran the compiled code


def test_the_compiled_code_runs_again_after_a_monitored_pass():
    """Step cadence: the steps outside the monitored windows run compiled, the windows' steps eagerly."""
    torch.manual_seed(0)
    backend = CountingBackend()
    module = MLPClassifier(compile_net="wrapped", backend=backend)
    monitor = ActivationRankMonitor(every_n_train_steps=3, window_batches=1, stage="train", log_at_init=False)
    trainer = quiet_trainer([monitor], max_epochs=1, limit_val_batches=0)
    trainer.fit(module, DataLoader(_batches(6, 0), batch_size=None))
    assert "rank_train/net.1/numerical_rank" in trainer.callback_metrics
    # 6 training steps, of which steps 3 and 6 are monitored: 4 forward passes ran the compiled graph.
    assert backend.calls == 4


@pytest.mark.parametrize("how", ["wrapped", "in_place"])
def test_compiled_layers_are_chosen_and_logged_by_their_eager_names(how):
    from rank_lightning.callbacks import WeightRankMonitor

    def keys(callbacks: list[Any]) -> dict[str, set[str]]:
        torch.manual_seed(0)
        trainer = quiet_trainer(callbacks, max_epochs=1)
        trainer.fit(
            MLPClassifier(compile_net=how),
            DataLoader(_batches(2, 0), batch_size=None),
            DataLoader(_batches(2, 1), batch_size=None),
        )
        found: dict[str, set[str]] = {}
        for key in trainer.callback_metrics:
            namespace, layer, *_ = key.split("/")
            found.setdefault(namespace, set()).add(layer)
        return found

    # The weight monitor names a compiled network's layers as the eager model does (no "_orig_mod")...
    assert keys([WeightRankMonitor(log_at_init=False)])["weight"] == {"net.0", "net.2", "net.4"}
    # ... and both monitors take those names, exact or as a glob (which leaves the wrapper itself out).
    named = keys([ActivationRankMonitor(layers=["net.2"], log_at_init=False), WeightRankMonitor(layers=["net.2"])])
    assert named == {"rank": {"net.2"}, "weight": {"net.2"}}
    globbed = keys([ActivationRankMonitor(layers=["net.*"], log_at_init=False), WeightRankMonitor(layers=["net.*"])])
    assert globbed == {"rank": {f"net.{i}" for i in range(5)}, "weight": {"net.0", "net.2", "net.4"}}
    if how == "wrapped":  # a name with the wrapper's segment still works, and is logged by the eager name
        assert keys([ActivationRankMonitor(layers=["net._orig_mod.2"], log_at_init=False)]) == {"rank": {"net.2"}}
    with pytest.raises(ValueError, match=r"unknown layer 'net\.9'; layers are: net, net\.0, net\.1,"):
        keys([ActivationRankMonitor(layers=["net.9"])])


def test_the_head_of_a_compiled_network_is_logged_by_its_eager_name(monkeypatch, tmp_path):
    """NeuralCollapseMonitor (the head's input) and RankPretraining (the input of the last Linear) log the keys and
    values of the uncompiled model, not ``net._orig_mod.4``."""
    from rank_lightning.callbacks import NeuralCollapseMonitor, RankPretraining
    from tests.callbacks.recording_logger import RecordingLogger

    def logged(compile_net: str | None) -> dict[str, float]:
        (tmp_path / str(compile_net)).mkdir()
        monkeypatch.chdir(tmp_path / str(compile_net))  # each run writes its own curve files
        torch.manual_seed(0)
        logger = RecordingLogger()
        callbacks = [NeuralCollapseMonitor(metrics=["nc1"]), RankPretraining(num_batches=1, steps=1)]
        trainer = quiet_trainer(callbacks, max_epochs=1, logger=logger)
        module = MLPClassifier(compile_net=compile_net)
        trainer.fit(module, DataLoader(_batches(2, 0), batch_size=None), DataLoader(_batches(2, 1), batch_size=None))
        return {key: float(value) for key, value in (logger.latest | dict(trainer.callback_metrics)).items()}

    eager, compiled = logged(None), logged("wrapped")
    expected = {"neural_collapse/net.4/nc1", "pretrain/net.4_input/r_before", "pretrain/net.4_input/r_after"}
    assert expected <= compiled.keys()
    assert compiled.keys() == eager.keys()
    assert compiled == pytest.approx(eager, rel=1e-6)


@pytest.mark.parametrize("how", ["wrapped", "lightning_module"])
def test_monitoring_whole_training_epochs_of_a_compiled_model_says_they_run_eagerly(how):
    """stage='train' at epoch cadence hooks every batch of the epoch: the whole epoch runs eagerly, which is said."""
    backend = CountingBackend()
    module: Any = MLPClassifier(compile_net="wrapped" if how == "wrapped" else None, backend=backend)
    module = torch.compile(module, backend=backend) if how == "lightning_module" else module
    trainer = quiet_trainer([ActivationRankMonitor(stage="train", log_at_init=False)], max_epochs=1)
    compiled = "'net'" if how == "wrapped" else "the LightningModule"
    message = (
        r"ActivationRankMonitor: stage='train' at epoch cadence measures every batch of the monitored training epochs "
        rf"\(every_n_epochs=1\), and compiled code never calls the hooks that read them: those epochs run eagerly, "
        rf"without the speed-up of torch.compile \(compiled: {compiled}\). Measure windows of training steps instead "
        r"\(every_n_train_steps=..., window_batches=...\): the other steps run compiled"
    )
    with pytest.warns(UserWarning, match=message):
        trainer.fit(module, DataLoader(_batches(4, 0), batch_size=None), DataLoader(_batches(1, 1), batch_size=None))
    assert backend.calls == 1  # no training step ran the compiled code; the one validation batch did


def test_monitoring_step_windows_of_a_compiled_model_needs_no_warning(recwarn):
    module = MLPClassifier(compile_net="wrapped")
    monitor = ActivationRankMonitor(stage="train", every_n_train_steps=2, log_at_init=False)
    trainer = quiet_trainer([monitor], max_epochs=1, limit_val_batches=0)
    trainer.fit(module, DataLoader(_batches(4, 0), batch_size=None))
    assert not [w for w in recwarn if "run eagerly" in str(w.message)]


@pytest.mark.parametrize("fullgraph", [False, True])
def test_jacobian_ranks_of_a_compiled_model_leave_its_compiled_code_running(fullgraph, monkeypatch, tmp_path):
    """torch.func.jvp cannot run compiled code: TorchDynamo, asked to, gives up on the network's forward for the rest
    of the process, so every later step ran eagerly (with ``fullgraph=True`` it raised, ending the fit). The
    Jacobians are computed eagerly, the steps stay compiled."""
    from torch.utils.data import TensorDataset

    from rank_lightning.callbacks import JacobianRankMonitor

    def fit(compile_net: str | None, backend: Any = "eager") -> dict[str, float]:
        (tmp_path / str(compile_net)).mkdir()
        monkeypatch.chdir(tmp_path / str(compile_net))  # each run writes its own curve files
        torch.manual_seed(0)
        data = TensorDataset(torch.randn(8, 6), torch.randint(0, CLASSES, (8,)))
        trainer = quiet_trainer([JacobianRankMonitor(num_inputs=2)], max_epochs=2, num_sanity_val_steps=0)
        module = MLPClassifier()
        if compile_net == "wrapped":
            module.net = torch.compile(module.net, backend=backend, fullgraph=fullgraph)
        trainer.fit(module, DataLoader(data, batch_size=4), DataLoader(data, batch_size=8))
        return {key: float(value) for key, value in trainer.callback_metrics.items()}

    eager = fit(None)
    backend = CountingBackend()
    compiled = fit("wrapped", backend)
    assert backend.calls == 6  # 2 epochs of 2 training steps and 1 validation batch, all compiled
    assert {key for key in compiled if key.startswith("jacobian/")} == {
        f"jacobian/net.{i}/rank{s}" for i in (1, 3) for s in ("", "_max")
    }
    assert compiled == pytest.approx(eager, rel=1e-6)


def test_the_lr_layer_of_a_compiled_network_is_logged_by_its_eager_name(monkeypatch, tmp_path):
    from rank_lightning.callbacks import LowRankProjection
    from rank_lightning.nn import LRLayer, collect_auxiliary_losses, insert_lr_layer

    class WithLRLayer(MLPClassifier):
        def __init__(self, compile_net: str | None) -> None:
            super().__init__()
            insert_lr_layer(self.net, "4", LRLayer(16, rank=2))  # before the head, then compiled with it
            if compile_net == "wrapped":
                self.net = torch.compile(self.net, backend="eager")

        def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
            return super().training_step(batch, batch_idx) + collect_auxiliary_losses(self)

    def logged(compile_net: str | None) -> dict[str, float]:
        (tmp_path / str(compile_net)).mkdir()
        monkeypatch.chdir(tmp_path / str(compile_net))
        torch.manual_seed(0)
        trainer = quiet_trainer([LowRankProjection(threshold=None, switch_on_epoch=0)], max_epochs=1)
        val = DataLoader(_batches(1, 1), batch_size=None)
        trainer.fit(WithLRLayer(compile_net), DataLoader(_batches(2, 0), batch_size=None), val)
        return {key: float(value) for key, value in trainer.callback_metrics.items()}

    eager, compiled = logged(None), logged("wrapped")
    assert {"lr_layer/net.4.0/reconstruction", "lr_layer/net.4.0/norm"} <= compiled.keys()
    assert compiled.keys() == eager.keys()
    assert compiled == pytest.approx(eager, rel=1e-6)


def test_monitored_windows_neither_recompile_nor_change_the_values_under_aot_autograd(monkeypatch, tmp_path):
    """``"aot_eager"`` traces the backward pass too (AOTAutograd, as Inductor does): four monitored windows leave one
    compiled graph, the one the first step compiled, and the values are the eager model's."""
    from torch._dynamo.utils import counters

    def values(compile_net: str | None) -> dict[str, float]:
        (tmp_path / str(compile_net)).mkdir()
        monkeypatch.chdir(tmp_path / str(compile_net))  # each run writes its own curve files
        torch.manual_seed(0)
        monitor = ActivationRankMonitor(every_n_train_steps=2, window_batches=1, stage="train", log_at_init=False)
        trainer = quiet_trainer([monitor], max_epochs=1, limit_val_batches=0)
        trainer.fit(MLPClassifier(compile_net, backend="aot_eager"), DataLoader(_batches(8, 0), batch_size=None))
        return {key: float(value) for key, value in trainer.callback_metrics.items()}

    eager = values(None)
    counters.clear()
    compiled = values("wrapped")
    assert (counters["stats"]["unique_graphs"], dict(counters["recompiles"])) == (1, {})
    assert compiled.keys() == eager.keys() and "rank_train/net.1/numerical_rank" in compiled
    assert compiled == pytest.approx(eager, rel=1e-6)


@pytest.mark.parametrize("how", ["wrapped", "blocks"])
def test_a_compiled_gpt2_logs_the_values_of_the_eager_one(how, monkeypatch, tmp_path):
    """A Hugging Face model (dict batches, padded tokens, tuple outputs, a graph break in its logging): compiled whole
    (``self.model = torch.compile(model)``), or block by block (``h[i] = torch.compile(h[i])``)."""
    pytest.importorskip("transformers")
    from tests.callbacks.test_transformers import _causal_lm_batches, _gpt2

    def values(compiled: str | None) -> dict[str, float]:
        (tmp_path / str(compiled)).mkdir()
        monkeypatch.chdir(tmp_path / str(compiled))  # each run writes its own curve files
        torch.manual_seed(0)
        module = _gpt2()
        if compiled == "wrapped":
            module.model = torch.compile(module.model, backend="eager")
        elif compiled == "blocks":
            blocks = module.model.transformer.h
            for index, block in enumerate(blocks):
                blocks[index] = torch.compile(block, backend="eager")
        monitor = ActivationRankMonitor(every_n_train_steps=2, stage="train", log_at_init=False)
        trainer = quiet_trainer([monitor], max_epochs=1)
        train, val = _causal_lm_batches(2, 0), _causal_lm_batches(1, 1)
        trainer.fit(module, DataLoader(train, batch_size=None), DataLoader(val, batch_size=None))
        return {key: float(value) for key, value in trainer.callback_metrics.items()}

    eager, compiled = values(None), values(how)
    layers = {key.split("/")[1] for key in compiled if key.startswith("rank_train/")}
    assert layers == {f"model.transformer.h.{i}" for i in range(3)}
    assert compiled.keys() == eager.keys()
    assert compiled == pytest.approx(eager, rel=1e-6)
