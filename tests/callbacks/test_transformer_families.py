"""Hugging Face model families beyond GPT-2, BERT, T5 and BART, monitored with the default settings.

Each model is built from a tiny ``transformers`` config with random weights and fitted a few steps inside a
LightningModule on dict batches with padding. The logged values are checked against the model's own
``output_hidden_states=True``: the float64 spectrum of the real-token rows of each block's hidden states.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
import transformers
from torch import Tensor, nn
from torch.utils.data import DataLoader

from rank_lightning.callbacks import ActivationRankMonitor
from rank_lightning.callbacks.curves import LayerCurves
from rank_lightning.functional import effective_rank
from rank_lightning.layers import default_layers, unmasked_layers
from tests.callbacks.trainer_helpers import quiet_trainer

VOCAB, LENGTH, BATCH, CLASSES = 64, 8, 4, 3
SMALL = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2)


@pytest.fixture(autouse=True)
def _quick_runs(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """Runs write their curve files under ``tmp_path`` and draw no figures (not what these tests are about)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(LayerCurves, "write_figures", lambda self, *args, **kwargs: [])


class FamilyModule(pl.LightningModule):
    """A user's LightningModule: the Hugging Face model in ``self.model``, called with the dict batch's entries."""

    def __init__(self, model: nn.Module, **loss_options: Any) -> None:
        super().__init__()
        self.model, self.loss_options = model, loss_options

    def forward(self, **batch: Tensor) -> Any:
        return self.model(**batch)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return self.model(**batch, **self.loss_options).loss

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self.log("val_loss", self.model(**batch, **self.loss_options).loss)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _token_batches(count: int, seed: int, *, left: bool, labels: str, length: int = LENGTH) -> list[dict[str, Tensor]]:
    """Padded ``input_ids`` / ``attention_mask`` (sample 0 full, the others 2 .. ``length`` tokens) with next-token
    ``labels`` (-100 at padding) or one class per sample."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        lengths = torch.randint(2, length + 1, (BATCH,), generator=generator)
        lengths[0] = length
        positions = torch.arange(length)[None]
        mask = (positions >= length - lengths[:, None]) if left else (positions < lengths[:, None])
        ids = torch.randint(3, VOCAB, (BATCH, length), generator=generator).masked_fill(~mask, 1)
        target = ids.masked_fill(~mask, -100) if labels == "tokens" else torch.randint(0, CLASSES, (BATCH,))
        batches.append({"input_ids": ids, "attention_mask": mask.long(), "labels": target})
    return batches


def _fit(module: pl.LightningModule, train: list[Any], val: list[Any]) -> tuple[pl.Trainer, list[str]]:
    """Fit one epoch with ``ActivationRankMonitor(log_at_init=False)``; also the package's warnings."""
    trainer = quiet_trainer([ActivationRankMonitor(log_at_init=False)], max_epochs=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, DataLoader(train, batch_size=None), DataLoader(val, batch_size=None))
    return trainer, [str(w.message) for w in caught if "rank_lightning" in w.filename]


def _assert_rows(trainer: pl.Trainer, layer: str, rows: Tensor) -> None:
    """The logged row count and effective rank of ``layer`` are those of ``rows``, computed in float64."""
    assert float(trainer.callback_metrics[f"rank/{layer}/token/spectrum_rows"]) == rows.shape[0]
    expected = float(effective_rank(rows.double()))
    assert float(trainer.callback_metrics[f"rank/{layer}/token/effective_rank"]) == pytest.approx(expected, rel=1e-9)


def _hidden_states(module: FamilyModule, val: list[dict[str, Tensor]], pick: Callable[[Any], Any]) -> list[Any]:
    module.eval()
    with torch.no_grad():
        return [pick(module.model(**batch, output_hidden_states=True)) for batch in val]


# -- decoder-only language models (left padded) and encoder classifiers (right padded) --------------------------------

_KV = dict(num_key_value_heads=1)
OPT_SMALL = dict(
    vocab_size=VOCAB, hidden_size=16, ffn_dim=32, num_hidden_layers=2, num_attention_heads=2, word_embed_proj_dim=8
)
FAMILIES: dict[str, tuple[Callable[[], nn.Module], str, bool]] = {
    "llama": (lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL, **_KV)), "model.layers", True),
    "mistral": (
        lambda: transformers.MistralForCausalLM(transformers.MistralConfig(**SMALL, **_KV)),
        "model.layers",
        True,
    ),
    "qwen2": (lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SMALL, **_KV)), "model.layers", True),
    "gemma2": (
        lambda: transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**SMALL, **_KV, head_dim=8)),
        "model.layers",
        True,
    ),
    "phi3": (
        lambda: transformers.Phi3ForCausalLM(
            transformers.Phi3Config(**SMALL, **_KV, pad_token_id=0, bos_token_id=1, eos_token_id=2)
        ),
        "model.layers",
        True,
    ),
    "gpt_neox": (lambda: transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(**SMALL)), "gpt_neox.layers", True),
    "opt": (  # word_embed_proj_dim < hidden_size: project_in and project_out around the blocks
        lambda: transformers.OPTForCausalLM(transformers.OPTConfig(**OPT_SMALL)),
        "model.decoder.layers",
        True,
    ),
    "bloom": (
        lambda: transformers.BloomForCausalLM(transformers.BloomConfig(vocab_size=VOCAB, hidden_size=16, n_layer=2)),
        "transformer.h",
        True,
    ),
    "falcon": (
        lambda: transformers.FalconForCausalLM(
            transformers.FalconConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2)
        ),
        "transformer.h",
        True,
    ),
    "distilbert": (
        lambda: transformers.DistilBertForSequenceClassification(
            transformers.DistilBertConfig(
                vocab_size=VOCAB, dim=16, hidden_dim=32, n_layers=2, n_heads=2, num_labels=CLASSES
            )
        ),
        "distilbert.transformer.layer",
        False,
    ),
    "roberta": (
        lambda: transformers.RobertaForSequenceClassification(
            transformers.RobertaConfig(**SMALL, max_position_embeddings=40, num_labels=CLASSES, pad_token_id=1)
        ),
        "roberta.encoder.layer",
        False,
    ),
    "deberta_v2": (
        lambda: transformers.DebertaV2ForSequenceClassification(transformers.DebertaV2Config(**SMALL, num_labels=3)),
        "deberta.encoder.layer",
        False,
    ),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_blocks_of_each_family_are_measured_on_their_real_tokens(family):
    """Decoder-only models are left padded (as at inference), classifiers right padded: every block's rows are its
    real tokens, the first block's equal to the model's own ``hidden_states[1]`` there."""
    build, blocks, causal = FAMILIES[family]
    torch.manual_seed(0)
    module = FamilyModule(build())
    paths = [f"model.{blocks}.0", f"model.{blocks}.1"]
    assert list(default_layers(module).values()) == paths
    labels = "tokens" if causal else "classes"
    val = _token_batches(2, seed=1, left=causal, labels=labels)
    trainer, caught = _fit(module, _token_batches(2, seed=0, left=causal, labels=labels), val)
    assert caught == []
    first = _hidden_states(module, val, lambda output: output.hidden_states[1])
    masks = [batch["attention_mask"].bool() for batch in val]
    _assert_rows(trainer, paths[0], torch.cat([hidden[mask] for hidden, mask in zip(first, masks, strict=True)]))
    assert float(trainer.callback_metrics[f"rank/{paths[1]}/token/spectrum_rows"]) == sum(m.sum() for m in masks)


# -- CLIP: a text tower and an image tower side by side ---------------------------------------------------------------

PATCHES = 5  # an 8 x 8 image in 4 x 4 patches, and the class token


def _clip() -> FamilyModule:
    tower = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2)
    config = transformers.CLIPConfig(
        text_config=dict(vocab_size=VOCAB, max_position_embeddings=16, bos_token_id=1, eos_token_id=2, **tower),
        vision_config=dict(image_size=8, patch_size=4, **tower),
        projection_dim=8,
    )
    return FamilyModule(transformers.CLIPModel(config), return_loss=True)


def _clip_batches(count: int, seed: int, length: int) -> list[dict[str, Tensor]]:
    batches = _token_batches(count, seed, left=False, labels="tokens", length=length)
    generator = torch.Generator().manual_seed(seed)
    for batch in batches:
        del batch["labels"]
        batch["pixel_values"] = torch.randn(BATCH, 3, 8, 8, generator=generator)
    return batches


@pytest.mark.parametrize("text_length", [PATCHES, LENGTH])
def test_clip_image_tower_measures_every_patch_and_the_text_tower_its_real_tokens(text_length):
    """The batch's attention mask is the text's: the image tower takes none, and its patches are never padding, also
    when the text is padded to as many tokens as the image has patches (where the mask would fit its shape)."""
    torch.manual_seed(0)
    module, val = _clip(), _clip_batches(2, seed=1, length=text_length)
    vision = ["model.vision_model.encoder.layers.0", "model.vision_model.encoder.layers.1"]
    assert unmasked_layers(module, default_layers(module)) == vision
    trainer, caught = _fit(module, _clip_batches(2, seed=0, length=text_length), val)
    assert caught == []  # no "cannot use the batch's attention mask" for the image tower
    outputs = _hidden_states(module, val, lambda out: (out.text_model_output, out.vision_model_output))
    masks = [batch["attention_mask"].bool() for batch in val]
    text = [text.hidden_states[1][mask] for (text, _), mask in zip(outputs, masks, strict=True)]
    _assert_rows(trainer, "model.text_model.encoder.layers.0", torch.cat(text))
    patches = torch.cat([image.hidden_states[1].reshape(-1, 16) for _, image in outputs])
    assert patches.shape[0] == 2 * BATCH * PATCHES
    _assert_rows(trainer, vision[0], patches)


# -- Whisper: an encoder fed input_features, without attention mask ----------------------------------------------------


def _whisper() -> FamilyModule:
    config = transformers.WhisperConfig(
        vocab_size=VOCAB, d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, num_mel_bins=8, max_source_positions=8,
        max_target_positions=16, decoder_start_token_id=1, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    return FamilyModule(transformers.WhisperForConditionalGeneration(config))


def _whisper_batches(count: int, seed: int, *, decoder_mask: bool, padded: bool = True) -> list[dict[str, Tensor]]:
    """``input_features`` (8 mel bins, 16 frames: 8 encoder positions) and ``labels``, -100 at padding."""
    batches = _token_batches(count, seed, left=False, labels="tokens")
    generator = torch.Generator().manual_seed(seed)
    for batch in batches:
        mask = batch.pop("attention_mask")
        del batch["input_ids"]
        if not padded:
            batch["labels"] = batch["labels"].clamp(min=3)
        elif decoder_mask:
            batch["decoder_attention_mask"] = mask
        batch["input_features"] = torch.randn(BATCH, 8, 16, generator=generator)
    return batches


def test_whisper_encoder_measures_every_position_and_the_decoder_the_targets_mask():
    torch.manual_seed(0)
    module, val = _whisper(), _whisper_batches(2, seed=1, decoder_mask=True)
    trainer, caught = _fit(module, _whisper_batches(2, seed=0, decoder_mask=True), val)
    assert caught == []
    outputs = _hidden_states(module, val, lambda out: (out.encoder_hidden_states[1], out.decoder_hidden_states[1]))
    encoder = torch.cat([states.reshape(-1, 16) for states, _ in outputs])
    assert encoder.shape[0] == 2 * BATCH * 8
    _assert_rows(trainer, "model.model.encoder.layers.0", encoder)
    masks = [batch["decoder_attention_mask"].bool() for batch in val]
    decoder = torch.cat([states[mask] for (_, states), mask in zip(outputs, masks, strict=True)])
    _assert_rows(trainer, "model.model.decoder.layers.0", decoder)


def test_whisper_decoder_without_target_mask_is_named_when_the_labels_are_padded(monkeypatch, tmp_path):
    """A batch without any attention mask: padded labels (-100) say the decoder's positions hold padding."""
    torch.manual_seed(0)
    trainer, caught = _fit(
        _whisper(), _whisper_batches(2, seed=0, decoder_mask=False), _whisper_batches(2, seed=1, decoder_mask=False)
    )
    assert float(trainer.callback_metrics["rank/model.model.decoder.layers.0/token/spectrum_rows"]) == 2 * BATCH * 8
    expected = [
        f"ActivationRankMonitor: layer 'model.model.decoder.layers.{i}' is in the decoder of an encoder-decoder "
        "model, but the batch has no 'decoder_attention_mask' while its 'labels' hold -100 (padded targets) in 2 "
        "batch(es): its padded target positions are measured too."
        for i in range(2)
    ]
    assert [message[: len(expected[0])] for message in caught] == expected
    (tmp_path / "unpadded").mkdir()
    monkeypatch.chdir(tmp_path / "unpadded")  # a run of its own
    torch.manual_seed(0)
    _, caught = _fit(_whisper(), *(_whisper_batches(2, seed, decoder_mask=False, padded=False) for seed in (0, 1)))
    assert caught == []  # unpadded targets: nothing to say
