"""The head of an encoder-decoder model (T5's and BART's ``lm_head``, outside the decoder module) reads the target's
tokens: its rows are those of ``decoder_attention_mask`` (or of the labels' -100 alone), never the encoder's mask."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader
from transformers import BartConfig, BartForConditionalGeneration, T5Config, T5ForConditionalGeneration

from rank_lightning.callbacks import ActivationRankMonitor, NeuralCollapseMonitor
from rank_lightning.functional.neural_collapse import most_frequent_classes, neural_collapse
from tests.callbacks.trainer_helpers import quiet_trainer

VOCAB, LENGTH, BATCH = 12, 6, 4


class Seq2Seq(pl.LightningModule):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: dict[str, Tensor]) -> Any:
        return self.model(**batch)

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self(batch)


def _model(name: str) -> Seq2Seq:
    torch.manual_seed(0)
    if name == "t5":
        config = T5Config(
            vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1, num_heads=2,
            decoder_start_token_id=0, pad_token_id=0,
        )  # fmt: skip
        return Seq2Seq(T5ForConditionalGeneration(config))
    config = BartConfig(
        vocab_size=VOCAB, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=16,
    )  # fmt: skip
    return Seq2Seq(BartForConditionalGeneration(config))


def _batches(*, decoder_mask: bool) -> list[dict[str, Tensor]]:
    """Source and target padded to one length: the source's mask fits the decoder's shape and marks other tokens."""
    g = torch.Generator().manual_seed(3)
    source = torch.arange(LENGTH)[None] < torch.tensor([[4], [6], [5], [3]])
    target = torch.arange(LENGTH)[None] < torch.tensor([[6], [3], [4], [2]])
    batches = []
    for _ in range(2):
        labels = torch.randint(3, 6, (BATCH, LENGTH), generator=g).masked_fill(~target, -100)
        ids = torch.randint(3, VOCAB, (BATCH, LENGTH), generator=g) * source
        batch = {"input_ids": ids, "attention_mask": source.long(), "labels": labels}
        if decoder_mask:
            batch["decoder_attention_mask"] = target.long()
        batches.append(batch)
    return batches


def _head_inputs(module: Seq2Seq, batches: list[dict[str, Tensor]]) -> list[Tensor]:
    seen: list[Tensor] = []
    hook = module.model.lm_head.register_forward_hook(lambda m, args, out: seen.append(args[0].detach()))
    with torch.no_grad():
        module.eval()
        for batch in batches:
            module(batch)
    hook.remove()
    return seen


def _validate(module: Seq2Seq, monitor: Any, batches: list[dict[str, Tensor]]) -> tuple[pl.Trainer, list[str]]:
    trainer = quiet_trainer([monitor])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.validate(module, DataLoader(batches, batch_size=None), verbose=False)
    return trainer, [str(w.message) for w in caught if "decoder_attention_mask" in str(w.message)]


@pytest.mark.parametrize("name", ["t5", "bart"])
@pytest.mark.parametrize("decoder_mask", [True, False])
def test_neural_collapse_of_an_encoder_decoder_head_counts_the_target_tokens(name: str, decoder_mask: bool) -> None:
    module, batches = _model(name), _batches(decoder_mask=decoder_mask)
    monitor = NeuralCollapseMonitor(head="model.lm_head", label_key="labels", top_classes=3, verbose=False)
    _, named = _validate(module, monitor, batches)
    kept = [b["labels"] != -100 for b in batches]  # the target's real tokens, whatever the source's mask
    x = torch.cat([h[k] for h, k in zip(_head_inputs(module, batches), kept, strict=True)])
    y = torch.cat([b["labels"][k] for b, k in zip(batches, kept, strict=True)])
    chosen = most_frequent_classes(torch.bincount(y, minlength=VOCAB), 3)
    with torch.no_grad():
        predictions = chosen[module.model.lm_head(x)[:, chosen].argmax(1)]
    weight = module.model.lm_head.weight
    want = neural_collapse(x, y, num_classes=VOCAB, head_weight=weight, predictions=predictions, classes=chosen)
    assert monitor.result.num_samples == want.num_samples == 30
    assert monitor.result.nc1 == pytest.approx(want.nc1, rel=1e-9)
    assert len(named) == (0 if decoder_mask else 1)
    if named:
        assert "'model.lm_head' reads the decoder's tokens" in named[0] and "labels != -100" in named[0]


@pytest.mark.parametrize("name", ["t5", "bart"])
def test_an_encoder_decoder_head_under_the_activation_monitor_reads_the_decoder_mask(name: str) -> None:
    module, batches = _model(name), _batches(decoder_mask=True)
    monitor = ActivationRankMonitor(layers=["model.lm_head"], verbose=False)
    trainer, named = _validate(module, monitor, batches)
    rows = sum(int(b["decoder_attention_mask"].sum()) for b in batches)
    assert rows == 30 and not named
    assert float(trainer.callback_metrics["rank/model.lm_head/token/spectrum_rows"]) == rows
    # Without the decoder's mask the head's target tokens are measured whole, with the decoder layers' warning.
    trainer, named = _validate(_model(name), ActivationRankMonitor(layers=["model.lm_head"], verbose=False),
                               _batches(decoder_mask=False))  # fmt: skip
    assert float(trainer.callback_metrics["rank/model.lm_head/token/spectrum_rows"]) == 2 * BATCH * LENGTH
    assert len(named) == 1 and "layer 'model.lm_head' is in the decoder of an encoder-decoder model" in named[0]


@pytest.mark.parametrize("theirs", [3, None])
@pytest.mark.parametrize("as_state", [False, True])
def test_merging_statistics_of_another_top_classes_is_refused_naming_both(theirs: int | None, as_state: bool) -> None:
    from rank_lightning.metrics import NeuralCollapseStatistics

    g = torch.Generator().manual_seed(0)
    mine, other = NeuralCollapseStatistics(5, 3, top_classes=2), NeuralCollapseStatistics(5, 3, top_classes=theirs)
    for metric in (mine, other):
        metric.update(torch.randn(8, 3, generator=g), torch.arange(8) % 5)
    incoming = other.metric_state if as_state else other
    with pytest.raises(ValueError, match=rf"top_classes={theirs}: this one has top_classes=2"):
        mine.merge_state(incoming)
    assert int(mine.class_selection) == 2 and int(mine.class_counts.sum()) == 8  # nothing merged
    same = NeuralCollapseStatistics(5, 3, top_classes=2)
    same.update(torch.randn(8, 3, generator=g), torch.arange(8) % 5)
    mine.merge_state(same.metric_state if as_state else same)
    assert int(mine.class_counts.sum()) == 16


@pytest.mark.parametrize(
    ("labels", "mask", "message"),
    [
        (
            torch.full((2, 3), -5),
            torch.ones(2, 3, dtype=torch.long),
            r"labels must lie in \[0, 5\), got -5\.\.-5; per-token labels may also be -100",
        ),
        (
            torch.zeros(2, 3, dtype=torch.long),
            torch.full((2, 3), 2),
            r"dtype torch.int64 holds values other than 0 and 1",
        ),
        (torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 4), r"attention mask of shape \(2, 4\) does not match"),
    ],
)
def test_token_batches_keep_their_label_and_mask_checks(labels: Tensor, mask: Tensor, message: str) -> None:
    """The label range and the mask's values are read together: neither check is lost."""
    from rank_lightning.metrics import NeuralCollapseStatistics

    metric = NeuralCollapseStatistics(5, 4)
    for second in (False, True):
        if second:
            metric.update(torch.randn(5, 4), torch.arange(5))
            metric.start_second_pass()
        with pytest.raises(ValueError, match=message):
            metric.update(torch.randn(2, 3, 4), labels, torch.zeros(2, 3, 5), mask=mask)


def test_a_mask_of_other_values_in_a_later_batch_is_still_refused_by_the_monitor() -> None:
    """The monitor checks a mask's values at a pass's first batch; the metric checks the later ones in its one read."""
    module, batches = _model("t5"), _batches(decoder_mask=True)
    batches[1]["decoder_attention_mask"] = batches[1]["decoder_attention_mask"] * 2
    monitor = NeuralCollapseMonitor(head="model.lm_head", label_key="labels", top_classes=3, verbose=False)
    with pytest.raises(ValueError, match=r"dtype torch.int64 holds values other than 0 and 1"):
        quiet_trainer([monitor]).validate(module, DataLoader(batches, batch_size=None), verbose=False)
