"""A layer applied several times per forward pass (ALBERT's shared layer, a block looped N times) measured at each
application with ``repeated_calls="each"``: ``<layer>@<k>`` is the layer's ``k``-th call of each batch."""

from __future__ import annotations

import json
import socket
import warnings
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
import torch.multiprocessing as mp
from pytorch_lightning.callbacks import ModelCheckpoint
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, TensorDataset
from transformers import AlbertConfig, AlbertForSequenceClassification

from rank_lightning.callbacks import ActivationRankMonitor
from rank_lightning.callbacks.curves import LayerCurves
from rank_lightning.functional import effective_rank, numerical_rank, participation_ratio
from rank_lightning.layers import BatchReader
from rank_lightning.streams import ActivationStream
from rank_lightning.tracker import RankTracker
from tests.callbacks.repeated_calls_ddp_helpers import LoopedBlock, ddp_worker, halves
from tests.callbacks.test_transformers import HuggingFaceModule
from tests.callbacks.trainer_helpers import KillAtStep, ResumableBatches, quiet_trainer

VOCAB, LENGTH, BATCH, CLASSES, FEATURES = 50, 8, 4, 3, 6
ALBERT_LAYER = "model.albert.encoder.albert_layer_groups.0.albert_layers.0"


@pytest.fixture(autouse=True)
def _quick_runs(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """Runs write their curve files under ``tmp_path`` and draw no figures (not what these tests are about)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(LayerCurves, "write_figures", lambda self, *args, **kwargs: [])


class Albert(HuggingFaceModule):
    """A tiny random ALBERT classifier (one AlbertLayer applied 4 times), called with the whole dict batch."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        config = AlbertConfig(
            vocab_size=VOCAB, embedding_size=16, hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
            intermediate_size=64, max_position_embeddings=16, num_labels=CLASSES,
        )  # fmt: skip
        super().__init__(AlbertForSequenceClassification(config))


def _padded_batches(count: int, seed: int) -> list[dict[str, Tensor]]:
    """Dict batches of right-padded token ids: sample 0 is full length, the others 2 .. LENGTH tokens."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        lengths = torch.randint(2, LENGTH + 1, (BATCH,), generator=generator)
        lengths[0] = LENGTH
        mask = (torch.arange(LENGTH)[None] < lengths[:, None]).long()
        ids = torch.randint(1, VOCAB, (BATCH, LENGTH), generator=generator) * mask
        batches.append({"input_ids": ids, "attention_mask": mask, "labels": torch.randint(0, CLASSES, (BATCH,))})
    return batches


def test_each_albert_application_is_measured_as_its_hidden_state_on_real_tokens():
    module, val = Albert(), _padded_batches(2, seed=1)
    monitor = ActivationRankMonitor(layers=[ALBERT_LAYER], repeated_calls="each", max_samples=None)
    trainer = quiet_trainer([monitor], max_epochs=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, DataLoader(_padded_batches(2, seed=0), batch_size=None), DataLoader(val, batch_size=None))
    assert not [w for w in caught if "more than once" in str(w.message) or "called" in str(w.message)]
    applications = [f"{ALBERT_LAYER}@{k}" for k in range(1, 5)]
    assert monitor.curves.layers == applications  # depth order: one curve per application
    module.eval()
    with torch.no_grad():
        hidden = [module.model(**batch, output_hidden_states=True).hidden_states for batch in val]
    masks = [batch["attention_mask"].bool() for batch in val]
    for k, name in enumerate(applications, start=1):
        rows = torch.cat([states[k][mask] for states, mask in zip(hidden, masks, strict=True)]).double()
        logged = {key: float(trainer.callback_metrics[f"rank/{name}/token/{key}"]) for key in ("spectrum_rows",)}
        assert logged["spectrum_rows"] == int(sum(mask.sum() for mask in masks)) < 2 * BATCH * LENGTH
        for metric, expected in (
            ("numerical_rank", numerical_rank(rows)),
            ("effective_rank", effective_rank(rows)),
            ("participation_ratio", participation_ratio(rows)),
        ):
            value = float(trainer.callback_metrics[f"rank/{name}/token/{metric}"])
            assert value == pytest.approx(float(expected), rel=1e-9), (name, metric)
    # The applications differ: one curve of the first call would not have shown them.
    ranks = [float(trainer.callback_metrics[f"rank/{name}/token/effective_rank"]) for name in applications]
    assert len(set(ranks)) == 4


def test_the_default_measures_the_first_application_and_names_the_option():
    module, val = Albert(), _padded_batches(1, seed=1)
    monitor = ActivationRankMonitor(layers=[ALBERT_LAYER], max_samples=None)
    with pytest.warns(UserWarning, match=r"runs more than once per batch: .*repeated_calls='each'") as caught:
        quiet_trainer([monitor], max_epochs=1, limit_train_batches=1).fit(
            module, DataLoader(_padded_batches(1, seed=0), batch_size=None), DataLoader(val, batch_size=None)
        )
    assert sum("runs more than once" in str(w.message) for w in caught) == 1
    assert monitor.curves.layers == [ALBERT_LAYER]


class Looped(pl.LightningModule):
    """``embed``, then one residual block applied ``loops`` times (under ``torch.utils.checkpoint`` unless
    ``use_reentrant`` is ``None``), then ``head``; ``adaptive``: one loop fewer in batches of other than 8 rows."""

    def __init__(self, loops: int = 3, use_reentrant: bool | None = None, adaptive: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(FEATURES, FEATURES)
        self.block = nn.Sequential(nn.Linear(FEATURES, FEATURES), nn.Tanh())
        self.head = nn.Linear(FEATURES, CLASSES)
        self.loops, self.use_reentrant, self.adaptive = loops, use_reentrant, adaptive

    def forward(self, x: Tensor) -> Tensor:
        x = self.embed(x)
        for _ in range(self.loops - (self.adaptive and x.shape[0] != 8)):
            plain = self.use_reentrant is None
            x = x + (self.block(x) if plain else checkpoint(self.block, x, use_reentrant=self.use_reentrant))
        return self.head(x)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return nn.functional.cross_entropy(self(batch[0]), batch[1])

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _loader(rows: int = 48, batch_size: int = 8) -> DataLoader:
    generator = torch.Generator().manual_seed(1)
    x, y = torch.rand(rows, FEATURES, generator=generator), torch.randint(0, CLASSES, (rows,), generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


def _block_calls(module: Looped, loader: DataLoader) -> list[Tensor]:
    """The float64 outputs of each call of ``module.block`` over the loader, the k-th calls of every batch in row k."""
    calls: list[list[Tensor]] = [[] for _ in range(module.loops)]
    seen: list[Tensor] = []
    handle = module.block.register_forward_hook(lambda _m, _a, out: seen.append(out.double()))
    module.eval()
    try:
        with torch.no_grad():
            for x, _ in loader:
                seen.clear()
                module(x)
                for k, out in enumerate(seen):
                    calls[k].append(out)
    finally:
        handle.remove()
    return [torch.cat(rows) for rows in calls]


def _fit(module: Looped, *, val: DataLoader | None = None, **options: Any) -> tuple[ActivationRankMonitor, list[str]]:
    """The monitor of a one-epoch fit of ``module`` (``options`` for the monitor) and its warnings' messages."""
    monitor = ActivationRankMonitor(layers=["embed", "block", "head"], repeated_calls="each", **options)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_trainer([monitor], max_epochs=1).fit(module, _loader(), val)
    return monitor, [str(warning.message) for warning in caught]


def test_a_block_looped_three_times_gives_a_curve_per_application_in_depth_order():
    module, val = Looped(), _loader(rows=24)
    monitor, messages = _fit(module, val=val, max_samples=None)
    assert not [message for message in messages if "more than once" in message or "called" in message]
    assert monitor.curves.layers == ["embed", "block@1", "block@2", "block@3", "head"]
    assert monitor.curves.epochs == [-1, 0]
    last = monitor.curves.history[0]
    for k, rows in enumerate(_block_calls(module, val), start=1):
        assert last[f"block@{k}"]["spectrum_rows"] == 24
        assert last[f"block@{k}"]["effective_rank"] == pytest.approx(float(effective_rank(rows)), rel=1e-9)
        assert last[f"block@{k}"]["participation_ratio"] == pytest.approx(float(participation_ratio(rows)), rel=1e-9)


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_checkpointed_applications_run_again_by_the_backward_pass_are_not_calls(use_reentrant):
    options = dict(every_n_train_steps=2, window_batches=2, max_samples=None)
    plain, _ = _fit(Looped(), **options)
    checkpointed, messages = _fit(Looped(use_reentrant=use_reentrant), **options)
    assert not [message for message in messages if "called" in message or "more than once" in message]
    assert checkpointed.curves.layers == ["embed", "block@1", "block@2", "block@3", "head"]
    assert checkpointed.curves.epochs == [0, 2, 4, 6]
    assert checkpointed.curves.history == plain.curves.history
    assert checkpointed.curves.history[2]["block@3"]["spectrum_rows"] == 16  # the window's two batches, once each


def test_a_batch_with_fewer_applications_is_named_and_each_application_sums_its_own_batches():
    # Validation batches of 8, 8 and 4 rows: the last one loops the block twice, the others three times.
    module, val = Looped(adaptive=True), _loader(rows=20)
    monitor, messages = _fit(module, val=val, max_samples=None)
    called = [message for message in messages if "time(s) in the pass's first batch" in message]
    assert called == [
        "ActivationRankMonitor: layer 'block' was called 3 time(s) in the pass's first batch and 2 in a later one "
        "(adaptive computation): its k-th application (block@k) sums the rows of the batches that called it at least "
        "k times, so its applications stand on different rows (their spectrum_rows counts them)."
    ]
    last = monitor.curves.history[0]
    rows = _block_calls(module, val)
    assert [last[f"block@{k}"]["spectrum_rows"] for k in (1, 2, 3)] == [20, 20, 16] == [len(r) for r in rows]
    assert last["block@3"]["effective_rank"] == pytest.approx(float(effective_rank(rows[2])), rel=1e-9)


def _window_fit(root: Path, *, kill: bool = False, ckpt: Path | None = None) -> ActivationRankMonitor:
    settings = dict(every_n_train_steps=4, window_batches=3, log_at_init=False, verbose=False)
    monitor = ActivationRankMonitor(layers=["block"], repeated_calls="each", **settings)
    saving = ModelCheckpoint(dirpath=root, every_n_train_steps=1, save_top_k=-1, filename="{step}")
    callbacks = [monitor, saving, KillAtStep(6 if kill else None)]
    trainer = quiet_trainer(callbacks, max_steps=8, default_root_dir=root, enable_checkpointing=True)
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, FEATURES, generator=generator), torch.randint(0, CLASSES, (64,), generator=generator)
    data = TensorDataset(x, y)
    trainer.fit(Looped(), ResumableBatches(data), ckpt_path=ckpt)
    return monitor


def test_a_fit_resumed_inside_a_window_continues_the_sums_of_every_application(tmp_path: Path):
    whole = _window_fit(tmp_path / "whole")
    with pytest.raises(RuntimeError, match="killed"):
        _window_fit(tmp_path / "cut", kill=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = _window_fit(tmp_path / "cut", ckpt=tmp_path / "cut" / "step=6.ckpt")
    assert not [str(w.message) for w in caught if "window" in str(w.message)]  # continued, not short
    assert resumed.curves.layers == whole.curves.layers == ["block@1", "block@2", "block@3"]
    assert resumed.curves.history == whole.curves.history
    assert whole.curves.history[8]["block@3"]["spectrum_rows"] == 12


@pytest.mark.slow
def test_applications_that_ran_on_some_processes_only_are_named_and_not_logged(tmp_path: Path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(ddp_worker, args=(port, str(tmp_path)), nprocs=2)
    results = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in (0, 1)]
    model, calls = LoopedBlock(loops=2), []
    model.block.register_forward_hook(lambda _m, _a, out: calls.append(out.double()))
    with torch.no_grad():
        for part in (part for parts in halves() for part in parts):
            model(part)
    rows = [torch.cat(calls[k::2]) for k in (0, 1)]  # the first and the second calls of every half
    for result in results:
        assert list(result["values"]) == ["block@1", "block@2"]  # block@3 ran on the first process only
        for k in (1, 2):
            expected = float(effective_rank(rows[k - 1]))
            assert result["values"][f"block@{k}"]["effective_rank"] == pytest.approx(expected, rel=1e-9)
        assert result["warned"] == [
            "block: was called at most 2 time(s) per batch on some processes and 3 on others in a monitored pass: "
            "the applications that ran on some processes only are not logged then.",
            "block@3: ran on some processes only in a monitored pass; it is not logged then.",
        ]


def test_a_plain_loop_tracks_each_application_too():
    model, calls = LoopedBlock(loops=3), []
    model.block.register_forward_hook(lambda _m, _a, out: calls.append(out.double()))
    tracker = RankTracker(model, layers=["block"], repeated_calls="each")
    with torch.no_grad(), tracker:
        for parts in halves():
            with tracker.batch():
                model(torch.cat(parts))
    values = tracker.compute()
    assert list(values) == ["block@1", "block@2", "block@3"]
    for k in (1, 2, 3):
        expected = float(effective_rank(torch.cat(calls[k - 1 :: 3])))
        assert values[f"block@{k}"]["effective_rank"] == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("build", [ActivationRankMonitor, lambda **options: RankTracker(LoopedBlock(2), **options)])
def test_an_unknown_repeated_calls_is_named_with_the_choices(build):
    with pytest.raises(ValueError, match="unknown repeated_calls 'every'; valid choices are: first, each"):
        build(repeated_calls="every")


def _stream_pass(memory_budget_mb: float, info: Any = None) -> ActivationStream:
    """A pass of ``LoopedBlock(3)`` streamed with ``repeated_calls="each"`` within ``memory_budget_mb``."""
    stream = ActivationStream(
        {"block": "block"}, num_classes=None, reductions={}, spectrum_options={}, batch_reader=BatchReader(),
        repeated_calls="each", memory_budget_mb=memory_budget_mb, info=info,
    )  # fmt: skip
    model = LoopedBlock(loops=3)
    stream.start(model)
    try:
        with torch.no_grad():
            for parts in halves():
                stream.batch_start(torch.cat(parts))
                model(torch.cat(parts))
                stream.batch_end()
    finally:
        stream.stop()
    return stream


def test_the_memory_plan_names_the_applications_as_they_are_logged():
    said: list[str] = []
    stream = ActivationStream(
        {"block": "block"}, num_classes=2, reductions={}, spectrum_options={}, batch_reader=BatchReader(),
        repeated_calls="each", memory_budget_mb=4096, info=said.append,
    )  # fmt: skip
    model = LoopedBlock(loops=3)
    stream.start(model)
    with torch.no_grad():
        for parts in halves():
            stream.batch_start(labels=torch.arange(8) % 2)
            model(torch.cat(parts))
            stream.batch_end()
    stream.stop()
    assert said[0].endswith(
        "(largest 'block@1': 0.00105 MiB); per-batch temporary up to 0.000366 MiB ('block@1'); class Grams "
        "(class-wise VR) of 'block@1', 'block@2', 'block@3'"
    )


def test_each_application_takes_a_layers_worth_of_the_memory_budget():
    # An exact 6 x 6 Gram and its sums plan 416 bytes: three of them fit in 0.0012 MiB (1258 bytes).
    said: list[str] = []
    stream = _stream_pass(0.0012, info=said.append)
    assert said == [
        "state of 3 layers: 0.00119 MiB of a 0.0012 MiB budget on cpu (largest 'block@1': 0.000397 MiB); per-batch "
        "temporary up to 0.000366 MiB ('block@1')"
    ]
    assert {name: metric.path_for(6) for name, metric in stream.metrics.items()} == dict.fromkeys(
        ["block", "block@2", "block@3"], "gram"
    )
    # In 0.0009 MiB (943 bytes) the third application has not even room for its fallback: named before any sum.
    message = r"layer 'block@3' \(6 features\) needs 0.000191 MiB of state even on its fallback path"
    with pytest.raises(MemoryError, match=message):
        _stream_pass(0.0009)
