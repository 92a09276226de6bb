"""NeuralCollapseMonitor on a language model's head with next-token classes: every real token with a label is a
sample, top_classes measures the most frequent classes, and a vocabulary that does not fit is refused at setup."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader

from rank_lightning.callbacks import NeuralCollapseMonitor
from rank_lightning.functional.neural_collapse import NC_METRICS, most_frequent_classes, neural_collapse
from tests.callbacks.trainer_helpers import quiet_trainer

VOCAB, WIDTH, LENGTH = 7, 6, 5


class _TinyLM(pl.LightningModule):
    """Embeddings, a token layer and ``lm_head``, applied to every token: ``(B, T, WIDTH) -> (B, T, vocab)``."""

    def __init__(self, vocab: int = VOCAB) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, WIDTH)
        self.block = nn.Linear(WIDTH, WIDTH)
        self.lm_head = nn.Linear(WIDTH, vocab)
        self.steps = 0

    def forward(self, input_ids: torch.Tensor, attention_mask=None, labels=None) -> torch.Tensor:
        return self.lm_head(torch.tanh(self.block(self.embed(input_ids))))

    def training_step(self, batch, batch_idx):
        self.steps += 1
        return self(batch["input_ids"]).sum()

    def validation_step(self, batch, batch_idx) -> None:
        self(batch["input_ids"])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _batches(count: int, vocab: int = VOCAB) -> list[dict[str, torch.Tensor]]:
    """Right-padded sequences whose labels are the next tokens: -100 at padding and at each sequence's last token."""
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(count):
        ids = torch.randint(0, vocab, (4, LENGTH), generator=g)
        mask = torch.arange(LENGTH)[None] < torch.tensor([[5], [3], [4], [2]])
        labels = torch.cat([ids[:, 1:], torch.full((4, 1), -100)], 1).masked_fill(~mask, -100)
        labels[:, :-1].masked_fill_(~mask[:, 1:], -100)
        batches.append({"input_ids": ids, "attention_mask": mask.long(), "labels": labels})
    return batches


def test_a_language_models_head_measures_the_most_frequent_next_token_classes(tmp_path: Path) -> None:
    model, batches = _TinyLM(), _batches(3)
    monitor = NeuralCollapseMonitor(head="lm_head", label_key="labels", top_classes=3, verbose=False)
    trainer = quiet_trainer([monitor], default_root_dir=tmp_path)
    trainer.validate(model, DataLoader(batches, batch_size=None), verbose=False)
    kept = [b["attention_mask"].bool() & (b["labels"] != -100) for b in batches]
    with torch.no_grad():
        hidden = [torch.tanh(model.block(model.embed(b["input_ids"])))[k] for b, k in zip(batches, kept, strict=True)]
    x, y = torch.cat(hidden), torch.cat([b["labels"][k] for b, k in zip(batches, kept, strict=True)])
    chosen = most_frequent_classes(torch.bincount(y, minlength=VOCAB), 3)
    with torch.no_grad():
        predictions = chosen[model.lm_head(x)[:, chosen].argmax(1)]
    want = neural_collapse(
        x, y, num_classes=VOCAB, head_weight=model.lm_head.weight, predictions=predictions, classes=chosen
    )
    assert monitor.result.num_samples == int(torch.isin(y, chosen).sum()) and monitor.result.num_classes == 3
    for key in NC_METRICS:
        assert monitor.result.as_dict()[key] == pytest.approx(want.as_dict()[key], rel=1e-9), key
        logged = float(trainer.callback_metrics[f"neural_collapse/lm_head/{key}"])
        assert logged == pytest.approx(want.as_dict()[key], rel=1e-6), key


def test_a_vocabulary_that_does_not_fit_is_refused_at_setup_naming_top_classes(tmp_path: Path) -> None:
    model = _TinyLM(vocab=50257)
    monitor = NeuralCollapseMonitor(head="lm_head", label_key="labels", verbose=False)
    trainer = quiet_trainer([monitor], max_epochs=1, default_root_dir=tmp_path)
    loader = DataLoader(_batches(1, vocab=50257), batch_size=None)
    with pytest.raises(MemoryError, match=r"50257 x 50257 class pairs.*memory_budget_mb=4096; set top_classes"):
        trainer.fit(model, loader, loader)
    assert model.steps == 0


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ({"top_classes": 0}, "top_classes must be a positive integer or None, got 0"),
        ({"memory_budget_mb": -1.0}, "memory_budget_mb must be a positive number or None, got -1.0"),
    ],
)
def test_bad_class_selection_or_budget_is_refused_at_construction(option, message) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        NeuralCollapseMonitor(**option)
