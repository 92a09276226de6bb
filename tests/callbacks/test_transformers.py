"""Transformer models as users have them, monitored by ActivationRankMonitor with its default layers.

Hugging Face models are built from ``transformers`` configs with random weights (nothing is downloaded) and trained
a few steps on CPU inside a LightningModule with dict batches (``input_ids``, ``attention_mask`` with padding,
``labels``). Every logged value is checked against a direct computation on the real tokens only.
"""

from __future__ import annotations

import ast
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader
from transformers import (
    BartConfig,
    BartForConditionalGeneration,
    BertConfig,
    BertForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
    T5Config,
    T5ForConditionalGeneration,
)

from rank_lightning.callbacks import ActivationRankMonitor
from rank_lightning.callbacks.curves import LayerCurves
from rank_lightning.functional import effective_rank, participation_ratio, total_cluster_variation
from rank_lightning.layers import check_layer_types, hidden_state, select_layers
from rank_lightning.models import create_model
from tests.callbacks.trainer_helpers import quiet_trainer

VOCAB, LENGTH, BATCH, CLASSES = 50, 8, 4, 3


@pytest.fixture(autouse=True)
def _quick_runs(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """Runs write their curve files under ``tmp_path`` and draw no figures (not what these tests are about)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(LayerCurves, "write_figures", lambda self, *args, **kwargs: [])


def _padded_batches(count: int, seed: int, *, pad_mask_key: str | None = None) -> list[dict[str, Tensor]]:
    """Dict batches of token ids with right padding: sample 0 is full length, the others 2 .. LENGTH tokens.

    Padded positions hold token 0, a real embedding: they give hidden states as real as any token's.
    """
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        lengths = torch.randint(2, LENGTH + 1, (BATCH,), generator=generator)
        lengths[0] = LENGTH
        mask = (torch.arange(LENGTH)[None] < lengths[:, None]).long()
        ids = torch.randint(1, VOCAB, (BATCH, LENGTH), generator=generator) * mask
        batch = {"input_ids": ids, "attention_mask": mask, "labels": torch.randint(0, CLASSES, (BATCH,))}
        if pad_mask_key is not None:
            batch[pad_mask_key] = mask == 0  # PyTorch's convention: true at padding
            del batch["attention_mask"]
        batches.append(batch)
    return batches


class HuggingFaceModule(pl.LightningModule):
    """A user's LightningModule: the Hugging Face model in ``self.model``, called with the whole dict batch."""

    def __init__(self, model: nn.Module, num_classes: int | None = None) -> None:
        super().__init__()
        self.model = model
        self.num_classes = num_classes

    def forward(self, batch: dict[str, Tensor]) -> Any:
        return self.model(**batch)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return self(batch).loss

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self.log("val_loss", self(batch).loss)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _gpt2() -> HuggingFaceModule:
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=3, n_head=2, bos_token_id=0, eos_token_id=0
    )
    model = GPT2LMHeadModel(config)
    return HuggingFaceModule(model)


def _bert() -> HuggingFaceModule:
    config = BertConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=3, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=16, num_labels=CLASSES,
    )  # fmt: skip
    return HuggingFaceModule(BertForSequenceClassification(config), num_classes=CLASSES)


def _causal_lm_batches(count: int, seed: int) -> list[dict[str, Tensor]]:
    batches = _padded_batches(count, seed)
    for batch in batches:
        batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    return batches


def _fit(
    module: pl.LightningModule,
    monitor: ActivationRankMonitor,
    train: list[Any],
    val: list[Any],
    **trainer_options: Any,
) -> pl.Trainer:
    trainer = quiet_trainer([monitor], max_epochs=1, **trainer_options)
    trainer.fit(module, DataLoader(train, batch_size=None), DataLoader(val, batch_size=None))
    return trainer


def _logged(trainer: pl.Trainer, layer: str, reduction: str, metric: str) -> float:
    return float(trainer.callback_metrics[f"rank/{layer}/{reduction}/{metric}"])


def _block_outputs(module: nn.Module, paths: list[str], batches: list[Any], call: Callable[[Any], Any]) -> dict:
    """``{path: [hidden state of each batch]}`` of an eval, no-grad pass, read with plain forward hooks."""
    outputs: dict[str, list[Tensor]] = {path: [] for path in paths}
    handles = [
        module.get_submodule(path).register_forward_hook(
            lambda _m, _a, out, path=path: outputs[path].append((out[0] if isinstance(out, tuple) else out).detach())
        )
        for path in paths
    ]
    module.eval()
    try:
        with torch.no_grad():
            for batch in batches:
                call(batch)
    finally:
        for handle in handles:
            handle.remove()
    return outputs


def _assert_matches(trainer: pl.Trainer, layer: str, reduction: str, rows: Tensor) -> None:
    """The logged metrics of ``layer`` are those of ``rows`` computed directly."""
    rows = rows.double()
    assert _logged(trainer, layer, reduction, "spectrum_rows") == rows.shape[0]
    assert _logged(trainer, layer, reduction, "effective_rank") == pytest.approx(float(effective_rank(rows)), rel=1e-9)
    expected_pr = float(participation_ratio(rows))
    assert _logged(trainer, layer, reduction, "participation_ratio") == pytest.approx(expected_pr, rel=1e-9)


GPT2_BLOCKS = ["model.transformer.h.0", "model.transformer.h.1", "model.transformer.h.2"]


def test_gpt2_blocks_are_measured_on_their_real_tokens_only():
    torch.manual_seed(0)
    module, val = _gpt2(), _causal_lm_batches(2, seed=1)
    trainer = _fit(module, ActivationRankMonitor(log_at_init=False), _causal_lm_batches(3, seed=0), val)
    outputs = _block_outputs(module, GPT2_BLOCKS, val, module)
    masks = [batch["attention_mask"].bool() for batch in val]
    real_tokens = int(sum(mask.sum() for mask in masks))
    assert real_tokens < len(val) * BATCH * LENGTH  # the batches are padded
    for path in GPT2_BLOCKS:
        real = torch.cat([hidden[mask] for hidden, mask in zip(outputs[path], masks, strict=True)])
        every = torch.cat([hidden.reshape(-1, hidden.shape[-1]) for hidden in outputs[path]])
        _assert_matches(trainer, path, "token", real)
        # Padded positions change the spectrum: measuring them would have given another value.
        assert _logged(trainer, path, "token", "effective_rank") != pytest.approx(float(effective_rank(every.double())))


def test_gpt2_blocks_are_batch_first_also_with_as_many_sequences_as_tokens():
    """B == T leaves a block's layout ambiguous from its shape; a Hugging Face model's blocks are always batch-first."""
    torch.manual_seed(0)
    square = [_causal_lm_batches(1, seed=seed)[0] for seed in (3, 4)]
    for batch in square:  # LENGTH sequences of LENGTH tokens
        for key, value in batch.items():
            batch[key] = torch.cat([value, value.roll(1, dims=-1)])
        assert batch["input_ids"].shape == (LENGTH, LENGTH)
    module = _gpt2()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = _fit(module, ActivationRankMonitor(log_at_init=False), square, square)
    assert not [w for w in caught if "layout" in str(w.message)]  # no "token layout cannot be told"
    outputs = _block_outputs(module, GPT2_BLOCKS, square, module)
    masks = [batch["attention_mask"].bool() for batch in square]
    for path in GPT2_BLOCKS:
        _assert_matches(trainer, path, "token", torch.cat([h[m] for h, m in zip(outputs[path], masks, strict=True)]))


def test_bert_blocks_take_the_masked_mean_and_the_class_labels():
    torch.manual_seed(0)
    module, val = _bert(), _padded_batches(2, seed=1)
    monitor = ActivationRankMonitor(log_at_init=False, token_reduction="mean")
    trainer = _fit(module, monitor, _padded_batches(3, seed=0), val)
    paths = [f"model.bert.encoder.layer.{i}" for i in range(3)]
    outputs = _block_outputs(module, paths, val, module)
    labels = torch.cat([batch["labels"] for batch in val])
    for path in paths:
        means = []
        for hidden, batch in zip(outputs[path], val, strict=True):
            for sample, length in zip(hidden, batch["attention_mask"].sum(1), strict=True):
                means.append(sample[:length].double().mean(0))
        rows = torch.stack(means)
        _assert_matches(trainer, path, "mean", rows)
        tcv = float(total_cluster_variation(rows, labels, num_classes=CLASSES))
        assert _logged(trainer, path, "mean", "tcv") == pytest.approx(tcv, rel=1e-9)


def test_a_layer_whose_hook_never_fires_is_named_in_a_warning():
    """GPT-2's ``h`` is a ModuleList: its blocks are called, never the list itself."""
    torch.manual_seed(0)
    monitor = ActivationRankMonitor(layers=["model.transformer.h.0", "model.transformer.h"], log_at_init=False)
    with pytest.warns(UserWarning, match=r"layer 'model.transformer.h' \(model.transformer.h\) was not called"):
        trainer = _fit(_gpt2(), monitor, _causal_lm_batches(1, seed=0), _causal_lm_batches(1, seed=1))
    assert "rank/model.transformer.h.0/token/effective_rank" in trainer.callback_metrics
    assert not any(key.startswith("rank/model.transformer.h/") for key in trainer.callback_metrics)


def test_model_outputs_give_their_last_hidden_state():
    """Hooking GPT-2's whole ``transformer`` (a ``ModelOutput`` with ``last_hidden_state`` and a cache) measures the
    hidden states after the final LayerNorm."""
    torch.manual_seed(0)
    module, val = _gpt2(), _causal_lm_batches(2, seed=1)
    monitor = ActivationRankMonitor(layers=["model.transformer"], log_at_init=False)
    trainer = _fit(module, monitor, _causal_lm_batches(2, seed=0), val)
    module.eval()
    rows = []
    with torch.no_grad():
        for batch in val:
            output = module.model.transformer(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
            rows.append(output.last_hidden_state[batch["attention_mask"].bool()])
    _assert_matches(trainer, "model.transformer", "token", torch.cat(rows))


def test_the_rule_on_real_model_outputs():
    torch.manual_seed(0)
    model = _gpt2().model.eval()
    batch = _causal_lm_batches(1, seed=0)[0]
    with torch.no_grad():
        lm_output = model(**batch)  # loss (0-dimensional), logits, past_key_values
        base_output = model.transformer(input_ids=batch["input_ids"], output_hidden_states=True)
    assert hidden_state(lm_output) is lm_output.logits
    assert hidden_state(base_output) is base_output.last_hidden_state
    assert hidden_state(base_output, 0) is base_output.last_hidden_state  # ModelOutput[0]
    assert hidden_state(base_output, lambda out: out.hidden_states[1]) is base_output.hidden_states[1]
    with pytest.raises(ValueError, match=r"output_selector='hidden_states' picks a tuple, not a tensor"):
        hidden_state(base_output, "hidden_states")  # one tensor per layer: pick one
    # A selector function that fails on the output says which output it was given.
    with pytest.raises(ValueError, match=r"output_selector <lambda> raised AttributeError: .*'hidden_sates'.*, given "):
        hidden_state(base_output, lambda out: out.hidden_sates[1])


def test_a_failing_output_selector_names_the_layer():
    torch.manual_seed(0)
    monitor = ActivationRankMonitor(
        layers=["model.transformer.h.0"], output_selector=lambda out: out.hidden, verbose=False
    )
    with pytest.raises(
        ValueError, match=r"layer 'model.transformer.h.0': output_selector <lambda> raised AttributeError"
    ):
        _fit(_gpt2(), monitor, _causal_lm_batches(1, seed=0), _causal_lm_batches(1, seed=1))


class _SharedBlock(nn.Module):
    """A block run twice per forward pass (encoder and decoder sharing weights), telling its calls apart."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 6)

    def forward(self, x: Tensor, decoding: bool) -> tuple[Tensor, bool]:
        return torch.tanh(self.linear(x)), decoding


class _SharedBlockModule(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.block = _SharedBlock()

    def forward(self, x: Tensor) -> Tensor:
        encoded, _ = self.block(x, False)
        return self.block(2 * encoded + 1, True)[0]

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self(batch[0])


def test_a_selector_that_returns_none_skips_that_call_and_measures_the_other_call_of_the_layer():
    torch.manual_seed(0)
    module, inputs = _SharedBlockModule(), torch.randn(16, 6)
    selector = lambda out: out[0] if out[1] else None  # noqa: E731 - the decoder's call only
    monitor = ActivationRankMonitor(layers=["block"], output_selector=selector, verbose=False)
    trainer = quiet_trainer([monitor])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.validate(module, DataLoader(list(zip(inputs, torch.zeros(16))), batch_size=8), verbose=False)
    assert [str(w.message) for w in caught if "rank_lightning" in w.filename] == []
    with torch.no_grad():
        decoded = torch.tanh(module.block.linear(2 * torch.tanh(module.block.linear(inputs)) + 1))
    assert float(trainer.callback_metrics["rank/block/spectrum_rows"]) == 16
    expected = float(effective_rank(decoded.double()))
    assert float(trainer.callback_metrics["rank/block/effective_rank"]) == pytest.approx(expected, rel=1e-9)


def test_a_mask_key_that_finds_nothing_stops_the_first_monitored_batch():
    torch.manual_seed(0)
    monitor = ActivationRankMonitor(mask_key="padding_mask", log_at_init=False)
    message = r"cannot find the attention mask at 'padding_mask' in a dict batch with keys \['input_ids', "
    with pytest.raises(ValueError, match=message):
        _fit(_gpt2(), monitor, _causal_lm_batches(1, seed=0), _causal_lm_batches(1, seed=1))


# -- blocks that return tuples or dicts (transformers 4.x, custom models) ---------------------------------------------


class TupleBlock(nn.Module):
    """Returns ``(hidden_states, attention_weights)`` as transformers 4.x blocks do, or the reverse order."""

    def __init__(self, width: int, hidden_first: bool) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(width, 2, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
        self.hidden_first = hidden_first

    def forward(self, x: Tensor, padding: Tensor) -> tuple[Tensor, Tensor]:
        attended, weights = self.attn(x, x, x, key_padding_mask=padding)
        hidden = x + self.mlp(x + attended)
        return (hidden, weights) if self.hidden_first else (weights, hidden)


class TupleBlockModel(pl.LightningModule):
    def __init__(self, hidden_first: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.blocks = nn.ModuleList([TupleBlock(16, hidden_first) for _ in range(2)])
        self.head = nn.Linear(16, CLASSES)
        self.hidden_first = hidden_first

    def forward(self, batch: dict[str, Tensor]) -> Tensor:
        x, padding = self.embed(batch["input_ids"]), batch["attention_mask"] == 0
        for block in self.blocks:
            x = block(x, padding)[0 if self.hidden_first else 1]
        return self.head(x[:, 0])

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return nn.functional.cross_entropy(self(batch), batch["labels"])

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


@pytest.mark.parametrize("hidden_first", [True, False])
def test_tuple_outputs_give_their_hidden_states_first_or_by_output_selector(hidden_first):
    torch.manual_seed(0)
    module, val = TupleBlockModel(hidden_first), _padded_batches(2, seed=1)
    monitor = ActivationRankMonitor(log_at_init=False, output_selector=None if hidden_first else 1)
    trainer = _fit(module, monitor, _padded_batches(2, seed=0), val)
    paths = ["blocks.0", "blocks.1"]
    outputs: dict[str, list[Tensor]] = {path: [] for path in paths}
    handles = [
        module.get_submodule(path).register_forward_hook(
            lambda _m, _a, out, path=path: outputs[path].append(out[0 if hidden_first else 1])
        )
        for path in paths
    ]
    module.eval()
    with torch.no_grad():
        for batch in val:
            module(batch)
    for handle in handles:
        handle.remove()
    for path in paths:
        rows = torch.cat([h[b["attention_mask"].bool()] for h, b in zip(outputs[path], val, strict=True)])
        _assert_matches(trainer, path, "token", rows)


# -- torch.nn.TransformerEncoder, both layouts ------------------------------------------------------------------------


class EncoderClassifier(pl.LightningModule):
    """Embedding, ``nn.TransformerEncoder`` (sequence-first or batch-first) and a mean-pooled linear head.

    Batches carry PyTorch's padding mask (true at padding) under ``"padding"``; with ``batch_first`` and in eval mode
    the encoder takes its nested-tensor fast path, where its layers hand each other nested tensors.
    """

    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        self.batch_first = batch_first
        self.embed = nn.Embedding(VOCAB, 16)
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=batch_first)
        self.encoder = nn.TransformerEncoder(layer, 2)
        self.head = nn.Linear(16, CLASSES)
        self.num_classes = CLASSES

    def forward(self, batch: dict[str, Tensor]) -> Tensor:
        x = self.embed(batch["input_ids"])
        x = self.encoder(x if self.batch_first else x.transpose(0, 1), src_key_padding_mask=batch["padding"])
        x = x if self.batch_first else x.transpose(0, 1)
        keep = (~batch["padding"]).unsqueeze(2).float()
        return self.head((x * keep).sum(1) / keep.sum(1))

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return nn.functional.cross_entropy(self(batch), batch["labels"])

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


@pytest.mark.parametrize("batch_first", [False, True])
def test_transformer_encoder_layers_in_either_layout_exclude_padding(batch_first):
    torch.manual_seed(0)
    module = EncoderClassifier(batch_first)
    train, val = _padded_batches(2, seed=0, pad_mask_key="padding"), _padded_batches(2, seed=1, pad_mask_key="padding")
    monitor = ActivationRankMonitor(log_at_init=False, mask_key=lambda batch: ~batch["padding"])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*nested tensors is in prototype stage.*")
        trainer = _fit(module, monitor, train, val)
        paths = ["encoder.layers.0", "encoder.layers.1"]
        outputs = _block_outputs(module, paths, val, module)
    for path in paths:
        rows = []
        for hidden, batch in zip(outputs[path], val, strict=True):
            hidden = hidden.to_padded_tensor(0.0) if hidden.is_nested else hidden
            rows.append((hidden if batch_first else hidden.transpose(0, 1))[~batch["padding"]])
        _assert_matches(trainer, path, "token", torch.cat(rows))


# -- the package's ViT -------------------------------------------------------------------------------------------------


class ImageModule(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = create_model("vit_tiny", num_classes=CLASSES, in_channels=1, image_size=8, num_layers=2,
                                hidden_dim=16, mlp_dim=32, num_heads=2)  # fmt: skip
        self.num_classes = CLASSES

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return nn.functional.cross_entropy(self(batch[0]), batch[1])

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_the_package_vit_logs_its_blocks_tokens_and_class_token():
    torch.manual_seed(0)
    images = [(torch.randn(BATCH, 1, 8, 8), torch.randint(0, CLASSES, (BATCH,))) for _ in range(4)]
    module = ImageModule()
    trainer = _fit(module, ActivationRankMonitor(log_at_init=False), images[:2], images[2:])
    tokens = 2 * BATCH * (4 + 1)  # 2 batches, 2 x 2 patches and the class token per image
    for block in ("block0", "block1"):
        assert _logged(trainer, block, "token", "spectrum_rows") == tokens
    assert float(trainer.callback_metrics["rank/cls/spectrum_rows"]) == 2 * BATCH


class _XLNetModule(HuggingFaceModule):
    """XLNet runs its layers sequence-first: each block returns ``(T, B, D)`` hidden states."""

    def forward(self, batch: dict[str, Tensor]) -> Any:
        return self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self(batch)


def test_a_hugging_face_model_with_sequence_first_layers_is_read_by_shape_and_never_guessed():
    from transformers import XLNetConfig, XLNetModel

    torch.manual_seed(0)
    module = _XLNetModule(XLNetModel(XLNetConfig(vocab_size=VOCAB, d_model=16, n_layer=2, n_head=2, d_inner=32)))
    blocks = ["model.layer.0", "model.layer.1"]
    batches = _padded_batches(2, seed=5)  # 4 sequences of 8 tokens: the (8, 4, 16) outputs tell their layout
    monitor = ActivationRankMonitor(layers=blocks, token_reduction="mean", log_at_init=False)
    trainer = quiet_trainer([monitor], max_epochs=1)
    trainer.validate(module, DataLoader(batches, batch_size=None), verbose=False)
    outputs = _block_outputs(module, blocks, batches, module)
    for path in blocks:
        # Each sequence's mean over its real tokens, from the (T, B, D) outputs turned batch-first.
        means = [
            torch.stack([h.transpose(0, 1)[b][m[b]].double().mean(0) for b in range(BATCH)])
            for h, m in zip(outputs[path], [batch["attention_mask"].bool() for batch in batches], strict=True)
        ]
        _assert_matches(trainer, path, "mean", torch.cat(means))

    # As many sequences as tokens: an XLNet layer's layout is not guessed (batch-first would be wrong).
    square = [{k: torch.cat([v, v]) for k, v in batch.items()} for batch in _padded_batches(1, seed=6)]
    assert square[0]["input_ids"].shape == (LENGTH, LENGTH)
    monitor = ActivationRankMonitor(layers=blocks, token_reduction="mean", log_at_init=False)
    with pytest.warns(UserWarning, match="token layout cannot be told"):
        quiet_trainer([monitor], max_epochs=1).validate(module, DataLoader(square, batch_size=None), verbose=False)


def test_attention_elsewhere_in_a_wrapped_hugging_face_model_declares_nothing_about_its_blocks():
    """A sequence-first ``nn.MultiheadAttention`` somewhere in a Hugging Face model (Mask2Former's decoder beside its
    Swin backbone) says nothing about the model's other layers: the search for a declared layout stops at the model."""
    from rank_lightning.layers import token_layouts

    torch.manual_seed(0)
    module = _gpt2()
    module.model.transformer.decoder_attention = nn.MultiheadAttention(16, 2)  # batch_first=False, never called
    blocks = {path: path for path in GPT2_BLOCKS}
    layouts, ambiguous = token_layouts(module, blocks)
    assert layouts == {} and ambiguous == dict.fromkeys(GPT2_BLOCKS, True)  # the shapes decide; B == T batch-first
    val = _causal_lm_batches(2, seed=1)
    trainer = _fit(module, ActivationRankMonitor(log_at_init=False), _causal_lm_batches(2, seed=0), val)
    outputs = _block_outputs(module, GPT2_BLOCKS, val, module)
    masks = [batch["attention_mask"].bool() for batch in val]
    for path in GPT2_BLOCKS:
        _assert_matches(trainer, path, "token", torch.cat([h[m] for h, m in zip(outputs[path], masks, strict=True)]))


# -- encoder-decoder models: each stack leaves out its own padding -----------------------------------------------------


def _t5(encoder_layers: int = 2) -> HuggingFaceModule:
    config = T5Config(
        vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=encoder_layers, num_decoder_layers=2, num_heads=2,
        decoder_start_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return HuggingFaceModule(T5ForConditionalGeneration(config))


def _bart() -> HuggingFaceModule:
    config = BartConfig(
        vocab_size=VOCAB, d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=16,
    )  # fmt: skip
    return HuggingFaceModule(BartForConditionalGeneration(config))


class TorchSeq2Seq(nn.Module):
    """``nn.Transformer`` fed a Hugging Face style batch: source ``input_ids`` and ``attention_mask``, target
    ``labels`` (-100 at padding, also its inputs here) and ``decoder_attention_mask``."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.transformer = nn.Transformer(16, 2, 2, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.transformer.encoder.use_nested_tensor = False  # padded (B, T, D) outputs, read by the test's own hooks
        self.head = nn.Linear(16, VOCAB)

    def forward(self, input_ids: Tensor, attention_mask: Tensor, labels: Tensor, **batch: Tensor) -> Any:
        target = labels.clamp(min=0)
        mask = nn.Transformer.generate_square_subsequent_mask(target.shape[1], dtype=torch.bool)
        hidden = self.transformer(
            self.embed(input_ids), self.embed(target), tgt_mask=mask, src_key_padding_mask=attention_mask == 0,
            tgt_key_padding_mask=labels == -100, memory_key_padding_mask=attention_mask == 0,
        )  # fmt: skip
        logits = self.head(hidden)
        return type("Output", (), {"loss": nn.functional.cross_entropy(logits.transpose(1, 2), labels)})


SEQ2SEQ = {
    "t5": (_t5, "model.encoder.block", "model.decoder.block"),
    "bart": (_bart, "model.model.encoder.layers", "model.model.decoder.layers"),
    "nn.Transformer": (
        lambda: HuggingFaceModule(TorchSeq2Seq()),
        "model.transformer.encoder.layers",
        "model.transformer.decoder.layers",
    ),
}


def _seq2seq_batches(count: int, seed: int, *, decoder_mask: bool = True) -> list[dict[str, Tensor]]:
    """Source and target both padded to ``LENGTH`` (``padding="max_length"``), each of its own length: the encoder's
    ``attention_mask`` has the decoder's ``(B, T)`` shape and marks other positions. Labels are padded with -100."""
    batches = _padded_batches(count, seed)
    generator = torch.Generator().manual_seed(seed + 100)
    for batch in batches:
        lengths = torch.randint(2, LENGTH, (BATCH,), generator=generator)
        target = torch.arange(LENGTH)[None] < lengths[:, None]
        batch["labels"] = torch.randint(3, VOCAB, (BATCH, LENGTH), generator=generator).masked_fill(~target, -100)
        if decoder_mask:
            batch["decoder_attention_mask"] = target.long()
    return batches


def _assert_spectrum_of(trainer: pl.Trainer, layer: str, rows: Tensor) -> None:
    """The logged metrics of ``layer`` are those of the singular values of ``rows``, computed directly in float64."""
    s = torch.linalg.svdvals(rows.double())
    squares, shares = s**2, s / s.sum()
    expected = {
        "participation_ratio": float(squares.sum() ** 2 / (squares**2).sum()),
        "stable_rank": float(squares.sum() / squares[0]),
        "variance_ratio_1": float(squares[0] / squares.sum()),
        "effective_rank": float(torch.exp(-(shares * shares.log()).sum())),
    }
    assert float(trainer.callback_metrics[f"rank/{layer}/token/spectrum_rows"]) == rows.shape[0]
    for metric, value in expected.items():
        # A post-LayerNorm output (BART's layers) has a null direction, the ones vector, whose singular value is
        # float32 rounding (~1e-7 s_1): the float64 Gram resolves its eigenvalue (~1e-14 of the largest) to a few
        # digits only, and the effective rank, which weighs every singular value, to about 1e-8.
        tolerance = 1e-8 if metric == "effective_rank" and float(s[-1] / s[0]) < 1e-6 else 1e-12
        assert float(trainer.callback_metrics[f"rank/{layer}/token/{metric}"]) == pytest.approx(value, rel=tolerance)


def _validate(module: pl.LightningModule, monitors: list[ActivationRankMonitor], batches: list[Any]) -> pl.Trainer:
    trainer = quiet_trainer(monitors, max_epochs=1)
    trainer.validate(module, DataLoader(batches, batch_size=None), verbose=False)
    return trainer


def _stack_rows(outputs: dict, paths: list[str], masks: list[Tensor]) -> dict[str, Tensor]:
    return {path: torch.cat([h[m] for h, m in zip(outputs[path], masks, strict=True)]) for path in paths}


@pytest.mark.parametrize("mask_key", [None, "attention_mask"])
@pytest.mark.parametrize("name", list(SEQ2SEQ))
def test_each_stack_of_an_encoder_decoder_leaves_out_its_own_padding(name, mask_key):
    """The decoder's layers read ``decoder_attention_mask``, not the encoder's mask of the same shape; by default and
    when the encoder's mask is named by Hugging Face's name. Both stacks are monitored by default."""
    make, encoder, decoder = SEQ2SEQ[name]
    torch.manual_seed(0)
    module, batches = make(), _seq2seq_batches(2, seed=1)
    sources = [batch["attention_mask"].bool() for batch in batches]
    targets = [batch["decoder_attention_mask"].bool() for batch in batches]
    assert sum(int(m.sum()) for m in sources) != sum(int(m.sum()) for m in targets)
    monitor = ActivationRankMonitor(mask_key=mask_key, verbose=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = _validate(module, [monitor], batches)
    assert not [w for w in caught if "mask" in str(w.message)]
    encoder_paths, decoder_paths = [f"{encoder}.{i}" for i in range(2)], [f"{decoder}.{i}" for i in range(2)]
    assert list(monitor.monitored) == encoder_paths + decoder_paths
    outputs = _block_outputs(module, encoder_paths + decoder_paths, batches, module)
    rows = {**_stack_rows(outputs, encoder_paths, sources), **_stack_rows(outputs, decoder_paths, targets)}
    for path, real in rows.items():
        _assert_spectrum_of(trainer, path, real)


def test_a_decoder_without_its_mask_is_measured_whole_with_a_warning_per_layer():
    torch.manual_seed(0)
    module, batches = _t5(), _seq2seq_batches(2, seed=1, decoder_mask=False)
    decoder_paths = ["model.decoder.block.0", "model.decoder.block.1"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = _validate(module, [ActivationRankMonitor(verbose=False)], batches)
    named = [str(w.message) for w in caught if "decoder_attention_mask" in str(w.message)]
    assert len(named) == 2  # once per decoder layer, although two batches lacked the mask
    for path, message in zip(decoder_paths, named, strict=True):
        assert f"layer {path!r} is in the decoder of an encoder-decoder model" in message
        assert "its padded target positions are measured too" in message and "labels != -100" in message
    encoder = "model.encoder.block.1"  # still leaves out the source's padding
    outputs = _block_outputs(module, [encoder, *decoder_paths], batches, module)
    sources = [batch["attention_mask"].bool() for batch in batches]
    _assert_spectrum_of(trainer, encoder, _stack_rows(outputs, [encoder], sources)[encoder])
    for path in decoder_paths:
        _assert_spectrum_of(trainer, path, torch.cat([h.reshape(-1, h.shape[-1]) for h in outputs[path]]))


def test_a_mask_key_of_ones_own_is_the_mask_of_every_layer():
    """Any other ``mask_key`` is every layer's mask, as documented: here the target's mask for the encoder too."""
    torch.manual_seed(0)
    module, batches = _t5(), _seq2seq_batches(2, seed=1)
    monitor = ActivationRankMonitor(mask_key="decoder_attention_mask", verbose=False)
    trainer = _validate(module, [monitor], batches)
    targets = [batch["decoder_attention_mask"].bool() for batch in batches]
    outputs = _block_outputs(module, list(monitor.monitored.values()), batches, module)
    for path, rows in _stack_rows(outputs, list(monitor.monitored.values()), targets).items():
        _assert_spectrum_of(trainer, path, rows)


def test_the_documented_patterns_select_the_blocks_of_one_stack_and_nothing_inside_them():
    """``*`` crosses dots (``fnmatch``): the patterns docs/transformers.md gives for T5 must select the blocks alone."""
    module = _t5(encoder_layers=11)  # two-digit indices
    stacks = [[f"model.encoder.block.{i}" for i in range(11)], ["model.decoder.block.0", "model.decoder.block.1"]]
    docs = (Path(__file__).parents[2] / "docs" / "transformers.md").read_text()
    checked = 0
    for layers, types in re.findall(r"layers=(\[[^\]]*\])(?:, layer_types=(\[[^\]]*\]))?", docs):
        patterns = ast.literal_eval(layers)
        if not all(str(pattern).startswith(("model.encoder.", "model.decoder.")) for pattern in patterns):
            continue
        layer_types = check_layer_types(ast.literal_eval(types)) if types else None
        chosen = list(select_layers(module, patterns, layer_types).values())
        if patterns == ["model.encoder.block.?"]:  # documented as blocks 0 to 9, "??" added for 10 to 99
            assert chosen == stacks[0][:10]
            chosen = list(select_layers(module, [*patterns, "model.encoder.block.??"]).values())
        assert chosen in stacks, (patterns, layer_types)
        checked += 1
    assert checked >= 3
    assert len(select_layers(module, ["model.encoder.block.*"])) > 11  # the blocks and the modules inside them


def test_the_classes_of_a_hugging_face_classifier_come_from_its_config():
    torch.manual_seed(0)
    classifier = _bert()
    classifier.num_classes = None  # as a user's module has it: the classes are the model config's num_labels
    val = _padded_batches(2, seed=1)
    trainer = _fit(
        classifier, ActivationRankMonitor(log_at_init=False, token_reduction="mean"), _padded_batches(1, 0), val
    )
    path = "model.bert.encoder.layer.2"
    hidden = _block_outputs(classifier, [path], val, classifier)[path]
    rows = torch.stack(
        [
            s[:n].double().mean(0)
            for h, b in zip(hidden, val, strict=True)
            for s, n in zip(h, b["attention_mask"].sum(1))
        ]
    )
    labels = torch.cat([batch["labels"] for batch in val])
    expected = float(total_cluster_variation(rows, labels, num_classes=CLASSES))
    assert _logged(trainer, path, "mean", "tcv") == pytest.approx(expected, rel=1e-9)
    # A language model's config has num_labels too (2 by default), but no classes of whole inputs: none are read.
    language_model = ActivationRankMonitor(log_at_init=False)
    _fit(_gpt2(), language_model, _causal_lm_batches(1, 0), _causal_lm_batches(1, 1))
    assert language_model._num_classes is None


# -- gradient checkpointing ------------------------------------------------------------------------------------------


class CheckpointedBlocks(pl.LightningModule):
    """Token embeddings through residual MLP blocks, each run under ``torch.utils.checkpoint`` around its ``__call__``
    (its forward hooks inside the checkpoint, as ``transformers`` 4.x ran its blocks): the backward pass runs every
    block a second time to recompute its activations."""

    def __init__(self, use_reentrant: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(2))
        self.head = nn.Linear(16, CLASSES)
        self.use_reentrant = use_reentrant

    def forward(self, batch: dict[str, Tensor]) -> Tensor:
        x = self.embed(batch["input_ids"])
        with torch.utils.checkpoint.set_checkpoint_early_stop(False):  # the recomputation runs the whole block
            for block in self.blocks:
                x = x + torch.utils.checkpoint.checkpoint(block, x, use_reentrant=self.use_reentrant)
        return self.head(x[:, 0])

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return nn.functional.cross_entropy(self(batch), batch["labels"])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_blocks_recomputed_by_gradient_checkpointing_are_measured_once_without_a_warning(use_reentrant):
    torch.manual_seed(0)
    module, train = CheckpointedBlocks(use_reentrant), _padded_batches(2, seed=0)
    paths = ["blocks.0", "blocks.1"]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="None of the inputs have requires_grad")  # no grad, no backward
        outputs = _block_outputs(module, paths, train[:1], module)  # the weights of the first step's forward pass
    monitor = ActivationRankMonitor(every_n_train_steps=1, window_batches=1, log_at_init=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = quiet_trainer([monitor], max_steps=1, limit_val_batches=0)
        trainer.fit(module, DataLoader(train, batch_size=None))
    assert not [w for w in caught if "more than once" in str(w.message)]
    mask = train[0]["attention_mask"].bool()
    for path in paths:
        rows = outputs[path][0][mask].double()
        logged = monitor.curves.history[1][path]
        assert logged["token/spectrum_rows"] == int(mask.sum())
        assert logged["token/effective_rank"] == pytest.approx(float(effective_rank(rows)), rel=1e-9)
