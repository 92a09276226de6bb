"""Default layers of a weight-tied model: ALBERT's encoder applies one shared ``AlbertLayer`` ``num_hidden_layers``
times, and that layer is the default choice (measured at every application with ``repeated_calls="each"``)."""

from __future__ import annotations

import warnings

import pytest
import pytorch_lightning as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader
from transformers import AlbertConfig, AlbertForSequenceClassification, GPT2Config, GPT2LMHeadModel

from rank_lightning.callbacks import ActivationRankMonitor
from rank_lightning.layers import default_layers
from tests.callbacks.trainer_helpers import quiet_trainer

SHARED = "albert.encoder.albert_layer_groups.0.albert_layers.0"


def _albert(**options: int) -> AlbertForSequenceClassification:
    torch.manual_seed(0)
    config = AlbertConfig(
        vocab_size=30, embedding_size=16, hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=16, num_labels=3, **options,
    )  # fmt: skip
    return AlbertForSequenceClassification(config)


class Module(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = _albert()

    def forward(self, batch: dict[str, Tensor]) -> object:
        return self.model(**batch)

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self(batch)


def test_the_default_of_an_albert_model_is_its_shared_layer_and_groups_stay_repeated_blocks() -> None:
    assert list(default_layers(_albert())) == [SHARED]
    groups = ["albert.encoder.albert_layer_groups.0", "albert.encoder.albert_layer_groups.1"]
    assert list(default_layers(_albert(num_hidden_groups=2))) == groups  # two blocks, each applied twice
    # A one-block model whose config declares one layer applies it once: its weight layers, as before.
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=20, n_positions=8, n_embd=8, n_layer=1, n_head=2))
    assert "transformer.h.0" not in default_layers(gpt2) and "transformer.h.0.attn.c_attn" in default_layers(gpt2)


@pytest.mark.parametrize("repeated_calls", ["first", "each"])
def test_the_default_albert_layer_is_measured_at_its_applications(repeated_calls: str) -> None:
    g = torch.Generator().manual_seed(1)
    mask = (torch.arange(6)[None] < torch.tensor([[6], [4], [3], [5]])).long()
    batch = {"input_ids": torch.randint(1, 30, (4, 6), generator=g) * mask, "attention_mask": mask}
    monitor = ActivationRankMonitor(repeated_calls=repeated_calls, verbose=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = quiet_trainer([monitor])
        trainer.validate(Module(), DataLoader([batch], batch_size=None), verbose=False)
    layer = f"model.{SHARED}"
    assert list(monitor.monitored) == [layer]
    names = [f"{layer}@{k}" for k in range(1, 5)] if repeated_calls == "each" else [layer]
    assert monitor.curves.layers == names
    for name in names:
        assert float(trainer.callback_metrics[f"rank/{name}/token/spectrum_rows"]) == 18  # the real tokens
    named = [str(w.message) for w in caught if "runs more than once per batch" in str(w.message)]
    assert len(named) == (repeated_calls == "first") and all("repeated_calls='each'" in m for m in named)
