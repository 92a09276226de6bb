"""ActivationRankMonitor with labels per token (a causal language model's next tokens): the class metrics of the token
layers take each token's own class; a layer whose rows are inputs is named and logs no class metric."""

from __future__ import annotations

import warnings

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader

import rank_lightning.streams as streams_module
from rank_lightning.callbacks import ActivationRankMonitor
from rank_lightning.callbacks.curves import LayerCurves
from rank_lightning.functional.streaming import ClassGrouping
from rank_lightning.layers import BatchReader
from rank_lightning.metrics import activation_spectrum
from rank_lightning.streams import ActivationStream
from tests import test_host_synchronisations as host
from tests.callbacks import test_transformers as hf
from tests.callbacks.trainer_helpers import quiet_trainer
from tests.test_host_synchronisations import NUM_CLASSES, _token_batches, _Tokens, _Waits

VOCAB, WIDTH, LENGTH = 7, 6, 5
fake_cuda = host.fake_cuda  # a fake-tensor mode with CUDA tensors (a GPU's code paths, checked without one)


class _TinyLM(pl.LightningModule):
    """Embeddings, a token layer ``block`` (B, T, WIDTH) and a layer ``pooled`` of one row per sequence."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.block = nn.Linear(WIDTH, WIDTH)
        self.pooled = nn.Linear(WIDTH, 3)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.block(self.embed(input_ids))
        self.pooled(hidden.mean(1))
        return hidden

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self(batch["input_ids"])


def _batches(count: int) -> list[dict[str, torch.Tensor]]:
    """Right-padded sequences with next-token labels: shifted ``input_ids``, -100 at padding and at the last token."""
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(count):
        ids = torch.randint(0, VOCAB, (4, LENGTH), generator=g)
        mask = torch.arange(LENGTH)[None] < torch.tensor([[5], [3], [4], [2]])
        labels = torch.cat([ids[:, 1:], torch.full((4, 1), -100)], 1).masked_fill(~mask, -100)
        labels[:, :-1].masked_fill_(~mask[:, 1:], -100)  # a real token whose next position is padding has no class
        batches.append({"input_ids": ids, "attention_mask": mask.long(), "labels": labels})
    return batches


@pytest.mark.parametrize("in_place", [False, True], ids=["selected", "kept_in_place"])
def test_token_layers_take_the_class_of_each_token_and_others_are_named(monkeypatch, tmp_path, in_place) -> None:
    # kept_in_place: the rows of a GPU, the padded and -100 ones kept in place under the row mask.
    monkeypatch.setattr(activation_spectrum, "_keeps_padded_rows", lambda device: in_place)
    monkeypatch.chdir(tmp_path)
    model, batches = _TinyLM(), _batches(3)
    monitor = ActivationRankMonitor(layers=["block", "pooled"], num_classes=VOCAB, verbose=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        (results,) = quiet_trainer([monitor]).validate(model, DataLoader(batches, batch_size=None), verbose=False)
    with torch.no_grad():
        hidden = [model(b["input_ids"]) for b in batches]
    kept = [(b["attention_mask"].bool() & (b["labels"] != -100)) for b in batches]
    x = torch.cat([h[k] for h, k in zip(hidden, kept, strict=True)]).double()
    y = torch.cat([b["labels"][k] for b, k in zip(batches, kept, strict=True)])
    present = [c for c in range(VOCAB) if (y == c).any()]
    tcv = sum(float((x[y == c] - x[y == c].mean(0)).square().sum()) for c in present)
    vr1 = [float(torch.linalg.svdvals(x[y == c])[0] ** 2 / x[y == c].square().sum()) for c in present]
    assert results["rank/block/token/spectrum_rows"] == x.shape[0] == 3 * 10
    assert results["rank/block/token/tcv"] == pytest.approx(tcv, rel=1e-12)
    total = float((x - x.mean(0)).square().sum())
    assert results["rank/block/token/tcv_normalized"] == pytest.approx(tcv / total, rel=1e-12)
    assert results["rank/block/token/classwise_variance_ratio_1_mean"] == pytest.approx(sum(vr1) / len(vr1), rel=1e-12)
    # The layer whose rows are sequences logs its spectrum, no class metric, and is named once.
    assert "rank/pooled/numerical_rank" in results
    assert not [key for key in results if key.startswith("rank/pooled/") and ("tcv" in key or "classwise" in key)]
    assert not [w for w in caught if "input_ids" in str(w.message)]  # shifted labels: no warning about them
    named = [str(w.message) for w in caught if "'pooled'" in str(w.message) and "per token" in str(w.message)]
    assert named == [
        "ActivationRankMonitor: layer 'pooled' gives (4, 3), one row per input ((B, d) features), but the batch's "
        "labels are per token, of shape (4, 5): its class metrics (TCV, class-wise VR) are not logged. Labels per "
        "token need token outputs (B, T, D) of as many positions and token_reduction='token'; a layer whose rows are "
        "inputs needs one label per input."
    ]


def test_token_layers_of_one_row_per_sequence_refuse_labels_per_token(monkeypatch, tmp_path) -> None:
    """Under token_reduction='mean' a token layer gives a row per sequence: labels per token are no class of it."""
    monkeypatch.chdir(tmp_path)
    monitor = ActivationRankMonitor(layers=["block"], num_classes=VOCAB, token_reduction="mean", verbose=False)
    with pytest.warns(UserWarning) as caught:
        (results,) = quiet_trainer([monitor]).validate(_TinyLM(), DataLoader(_batches(2), batch_size=None))
    assert [str(w.message) for w in caught if "per token" in str(w.message)] == [
        "ActivationRankMonitor: layer 'block' gives (4, 5, 6), one row per input (reduction='mean'), but the batch's "
        "labels are per token, of shape (4, 5): its class metrics (TCV, class-wise VR) are not logged. Labels per "
        "token need token outputs (B, T, D) of as many positions and token_reduction='token'; a layer whose rows are "
        "inputs needs one label per input."
    ]
    assert results["rank/block/mean/spectrum_rows"] == 8
    assert not [key for key in results if "tcv" in key or "classwise" in key]


def test_the_reader_gives_labels_per_token_only_when_asked() -> None:
    batch = _batches(1)[0]
    assert BatchReader().labels(batch) is None  # one label per input: (B, T) is no class label of an input
    assert BatchReader().labels(batch, per_token=True) is batch["labels"]
    found = "found a Tensor torch.int64 of shape (4, 5): a class label per token"
    assert BatchReader().label_source(batch, per_token=True).endswith(f"({found})")


@pytest.mark.parametrize("budget", [1.0, 0.005], ids=["class_grams", "no_class_grams"])
def test_labels_per_token_wait_once_per_batch_on_a_gpu(monkeypatch, fake_cuda, budget) -> None:
    """On a (simulated) GPU the token labels are read and grouped once per batch for every layer; the rows of padded
    and -100 positions stay in place (sorted by class for the class Grams), never read back."""
    batches = _token_batches(3)
    for batch in batches:
        next_ids = torch.cat([batch["inputs"][:, 1:] % NUM_CLASSES, torch.full((8, 1), -100)], 1)
        batch["labels"] = next_ids.masked_fill(batch["attention_mask"] == 0, -100)
    counts = [torch.bincount(b["labels"].clamp_min(0).reshape(-1), minlength=NUM_CLASSES).tolist() for b in batches]
    current, calls = [], []

    def grouping(labels: torch.Tensor, classes: int) -> ClassGrouping:  # group_token_labels, counts from the test
        calls.append(classes)
        labelled = labels != -100
        flat = labels.masked_fill(~labelled, 0).reshape(-1)
        order = torch.argsort(flat, stable=True)
        return ClassGrouping(flat, order, flat.index_select(0, order), tuple(current[0]), None, labelled)

    monkeypatch.setattr(streams_module, "group_token_labels", grouping)
    waits = _Waits()
    with fake_cuda:
        with torch.device("cuda"):
            model = _Tokens()
        on_device = [{k: fake_cuda.from_tensor(v).to("cuda") for k, v in b.items()} for b in batches]
        stream = ActivationStream(
            {"block": "block", "head": "head"},
            num_classes=NUM_CLASSES,
            reductions={3: "token"},
            spectrum_options={"memory_budget_mb": budget},
            batch_reader=BatchReader(label_key="labels", input_key="inputs"),
        )
        stream.start(model, num_batches=len(batches))
        for index, batch in enumerate(on_device):
            current[:], waits.batch = [counts[index]], index
            with waits, torch.no_grad():
                stream.batch_start(batch)
                model(batch["inputs"])
                stream.batch_end()
        metrics = stream.metrics.values()
        assert stream.metrics["block"].uses_class_grams == (budget == 1.0)
        assert all(m.update_count == 3 and m.class_sums.device.type == "cuda" for m in metrics)
        stream.stop()
    assert len(calls) == 3  # once per batch, for both layers
    # Per batch, for every layer at once: one read of what the labels are (per token, not one-hot rows) and the
    # grouping; at the first batch also the mask's values.
    reads = [(batch, where.split(":")[0]) for batch, _, where in waits.found]
    assert reads == [(0, "/layers.py"), (0, "/functional/reductions.py"), (1, "/layers.py"), (2, "/layers.py")]


def test_unshifted_labels_of_a_hugging_face_causal_lm_are_named(monkeypatch, tmp_path) -> None:
    """A causal LM's ``labels`` equal its ``input_ids`` (the model shifts them): taken as they are, each token's class
    would be the token itself; a warning at the pass's first batch says so and how to shift them."""
    monkeypatch.chdir(tmp_path)
    batches = _batches(2)
    for batch in batches:
        batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    monitor = ActivationRankMonitor(layers=["block"], num_classes=VOCAB, verbose=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # also: TCV 0 up to rounding, each token's embedding being its class's
        quiet_trainer([monitor]).validate(_TinyLM(), DataLoader(batches, batch_size=None), verbose=False)
    assert [str(w.message) for w in caught if "input_ids" in str(w.message)] == [
        "ActivationRankMonitor: the labels per token equal the batch's 'input_ids' wherever they are not -100: the "
        "labels of a Hugging Face causal LM, which the model shifts inside its loss. Taken as they are, each token's "
        "class is the token itself, not the next one; shift them for next-token classes, e.g. label_fn=lambda b: "
        "torch.cat([b['labels'][:, 1:], torch.full_like(b['labels'][:, :1], -100)], 1)."
    ]


def _next_tokens(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Hugging Face's causal LM labels shifted: the class of position t is the token at t + 1."""
    return torch.cat([batch["labels"][:, 1:], torch.full_like(batch["labels"][:, :1], -100)], 1)


def test_gpt2_blocks_take_the_next_token_of_each_real_token(monkeypatch, tmp_path) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(LayerCurves, "write_figures", lambda self, *args, **kwargs: [])
    torch.manual_seed(0)
    module, val = hf._gpt2(), hf._causal_lm_batches(2, seed=1)
    monitor = ActivationRankMonitor(log_at_init=False, num_classes=hf.VOCAB, label_fn=_next_tokens)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = hf._fit(module, monitor, hf._causal_lm_batches(2, seed=0), val)
    assert not [w for w in caught if "input_ids" in str(w.message) or "per token" in str(w.message)]
    outputs = hf._block_outputs(module, hf.GPT2_BLOCKS, val, module)
    kept = [b["attention_mask"].bool() & (_next_tokens(b) != -100) for b in val]
    y = torch.cat([_next_tokens(b)[k] for b, k in zip(val, kept, strict=True)])
    for path in hf.GPT2_BLOCKS:
        x = torch.cat([h[k] for h, k in zip(outputs[path], kept, strict=True)]).double()
        tcv = sum(float((x[y == c] - x[y == c].mean(0)).square().sum()) for c in y.unique().tolist())
        assert hf._logged(trainer, path, "token", "spectrum_rows") == x.shape[0] == int(sum(k.sum() for k in kept))
        assert hf._logged(trainer, path, "token", "tcv") == pytest.approx(tcv, rel=1e-9)
