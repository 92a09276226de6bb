"""``token_reduction="last"`` on a causal language model (a tiny random GPT-2) in a LightningModule fed dict batches,
left and right padded: every logged value against a float64 computation on the hidden states taken by hand from
``output_hidden_states`` at each sequence's last real token."""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader
from transformers import GPT2Config, GPT2LMHeadModel

from rank_lightning.callbacks import ActivationRankMonitor
from rank_lightning.callbacks.curves import LayerCurves
from rank_lightning.tracker import RankTracker
from tests.callbacks.trainer_helpers import quiet_trainer

BATCH, LENGTH, CLASSES = 16, 10, 3
# ln_f's output is output_hidden_states[-1]; h.0's is output_hidden_states[1].
LAYERS = {"model.transformer.h.0": 1, "model.transformer.ln_f": 2}


@pytest.fixture(autouse=True)
def _quick_runs(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(LayerCurves, "write_figures", lambda self, *args, **kwargs: [])


class CausalLM(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, bos_token_id=0, eos_token_id=0)
        self.model = GPT2LMHeadModel(config)

    def forward(self, batch: dict[str, Tensor], **options: Any) -> Any:
        return self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], **options)

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self(batch)


def _batches(left: bool) -> list[dict[str, Tensor]]:
    """Three batches of sequences of 1 .. LENGTH tokens, padded on one side; the first has a sequence without any."""
    generator = torch.Generator().manual_seed(1)
    batches = []
    for index in range(3):
        lengths = torch.randint(1, LENGTH + 1, (BATCH,), generator=generator)
        lengths[0] = 0 if index == 0 else LENGTH
        mask = (torch.arange(LENGTH)[None] < lengths[:, None]).long()
        mask = mask.flip(1) if left else mask
        ids = torch.randint(1, 100, (BATCH, LENGTH), generator=generator) * mask
        batches.append({"input_ids": ids, "attention_mask": mask, "labels": torch.randint(0, CLASSES, (BATCH,))})
    return batches


def _by_hand(module: CausalLM, batches: list[dict[str, Tensor]], index: int) -> tuple[Tensor, Tensor]:
    """The float64 hidden states at each sequence's last real token, and their labels, read in a plain loop."""
    rows, labels = [], []
    with torch.no_grad():
        for batch in batches:
            states = module.eval()(batch, output_hidden_states=True).hidden_states[index].double()
            for b, mask in enumerate(batch["attention_mask"].tolist()):
                if any(mask):
                    rows.append(states[b, max(t for t, real in enumerate(mask) if real)])
                    labels.append(int(batch["labels"][b]))
    return torch.stack(rows), torch.tensor(labels)


def _expected(rows: Tensor, labels: Tensor) -> dict[str, float]:
    s = torch.linalg.svdvals(rows)
    p = s / s.sum()
    tcv = sum(float(((rows[labels == c] - rows[labels == c].mean(0)) ** 2).sum()) for c in labels.unique())
    return {
        "numerical_rank": float((s > torch.finfo(torch.float32).eps * min(rows.shape) * s[0]).sum()),
        "effective_rank": math.exp(-float((p[p > 0] * p[p > 0].log()).sum())),
        "tcv": tcv,
        "spectrum_rows": float(rows.shape[0]),
    }


@pytest.mark.parametrize("left", [False, True], ids=["right_padding", "left_padding"])
def test_logged_ranks_are_those_of_the_last_real_tokens(left):
    torch.manual_seed(0)
    module, batches = CausalLM(), _batches(left)
    monitor = ActivationRankMonitor(layers=list(LAYERS), token_reduction="last", num_classes=CLASSES)
    trainer = quiet_trainer([monitor])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.validate(module, DataLoader(batches, batch_size=None), verbose=False)
    assert not [w for w in caught if "padding" in str(w.message)]
    for layer, index in LAYERS.items():
        rows, labels = _by_hand(module, batches, index)
        assert rows.shape[0] == 3 * BATCH - 1  # the sequence without a real token is dropped, with its label
        for metric, value in _expected(rows, labels).items():
            logged = float(trainer.callback_metrics[f"rank/{layer}/last/{metric}"])
            # ln_f's rows sum to 0 (a null direction): its Gram's near-zero eigenvalue carries 1e-8 s_1 of rounding.
            assert logged == pytest.approx(value, rel=1e-7), (layer, metric)


def test_cls_on_left_padded_batches_names_the_layer_and_last():
    monitor = ActivationRankMonitor(layers=["model.transformer.h.0"], token_reduction="cls")
    message = r"layer 'model.transformer.h.0' uses token_reduction='cls'.*left padding.*use token_reduction='last'"
    with pytest.warns(UserWarning, match=message):
        quiet_trainer([monitor]).validate(CausalLM(), DataLoader(_batches(True), batch_size=None), verbose=False)


def test_rank_tracker_takes_the_last_real_tokens():
    torch.manual_seed(0)
    module, batches = CausalLM().eval(), _batches(True)
    tracker = RankTracker(module, layers=["model.transformer.ln_f"], token_reduction="last", num_classes=CLASSES)
    with torch.no_grad(), tracker:
        for batch in batches:
            with tracker.batch(batch=batch):
                module(batch)
    values = tracker.compute()["model.transformer.ln_f"]
    expected = _expected(*_by_hand(module, batches, 2))
    assert values["last/effective_rank"] == pytest.approx(expected["effective_rank"], rel=1e-7)
    assert values["last/tcv"] == pytest.approx(expected["tcv"], rel=1e-9)
    assert values["last/numerical_rank"] == expected["numerical_rank"]


def test_an_unknown_token_reduction_lists_last_among_the_choices():
    choices = r"valid choices are: flatten, token, cls, mean, last"
    with pytest.raises(ValueError, match=rf"unknown token_reduction 'end'; {choices}"):
        ActivationRankMonitor(token_reduction="end")
    with pytest.raises(ValueError, match=rf"unknown token_reduction 'end'; {choices}"):
        RankTracker(CausalLM(), layers=["model.transformer.ln_f"], token_reduction="end")
