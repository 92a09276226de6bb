"""A monitored batch on a GPU makes the host wait at most once (to group the labels), checked without a GPU.

A CUDA device is simulated with PyTorch's fake tensors (``FakeTensorMode``): tensors carry a device, a shape and a
dtype but no values, and every operation runs through the GPU code paths of the package (class blocks padded into one
product, token rows kept in place, the fallback's subsample gathered anew) as it would on a device. An operation that
makes the host wait for a GPU shows as it runs:

* a value read back to the host (``.item()``, ``bool()``, ``int()``, ``.tolist()``): ``aten._local_scalar_dense``,
  recorded here (and answered with 0, so the code goes on);
* an output whose size depends on values (``nonzero``, boolean indexing, ``repeat_interleave`` by a tensor): fake
  tensors raise ``DynamicOutputShapeException``, which fails the test;
* a copy between the host and the device (a pageable copy waits for the GPU): recorded here.

The one documented synchronisation of a labelled batch, ``group_by_class`` (it reads the class counts, which cut each
class's rows out of the batch), is replaced by a stand-in that takes the counts from the test and counts its calls.
"""

from __future__ import annotations

import copy
import traceback
import warnings
from collections.abc import Callable

import pytest
import torch
import torchmetrics.metric
from packaging.version import Version
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import GPT2Config, GPT2Model, T5Config, T5Model

import rank_lightning.streams as streams_module
from rank_lightning.functional import streaming
from rank_lightning.layers import BatchReader
from rank_lightning.metrics import ActivationSpectrum
from rank_lightning.metrics import activation_spectrum as spectrum_module
from rank_lightning.streams import ActivationStream

NUM_CLASSES = 5
_COPIES = {"aten::_to_copy", "aten::copy_", "aten::_copy_from"}
# torchmetrics < 1.9 records a Metric's device as the CPU at construction (1.9 takes the default device, where the
# package makes its states), so ``Metric.to(device)`` in ``ActivationStream._metric_for`` moves a one-element probe
# (``_dummy_tensor``) from the host to the GPU, once per layer at its first batch: "no copy at all" does not hold there.
# Those probe copies, and only those, are counted apart on those versions; on 1.9 and later they fail as any copy.
_PROBE_COPIES = Version(torchmetrics.__version__) < Version("1.9")


def _source() -> str:
    """The innermost frames of the package that led here."""
    frames = [f for f in traceback.extract_stack() if "/rank_lightning/" in f.filename.replace("\\", "/")]
    return " <- ".join(f"{f.filename.rsplit('rank_lightning', 1)[-1]}:{f.lineno}" for f in frames[::-1][:3])


def _torchmetrics_probe() -> bool:
    """Whether torchmetrics' ``Metric._apply`` is moving its one-element device probe (``_dummy_tensor``) here."""
    frames = traceback.extract_stack()
    metric_py = [f for f in frames if f.filename.replace("\\", "/").endswith("torchmetrics/metric.py")]
    return any(f.name == "_apply" and "_dummy_tensor" in (f.line or "") for f in metric_py)


class _Waits(TorchDispatchMode):
    """Records every operation that would make the host wait for the device, by batch."""

    def __init__(self) -> None:
        super().__init__()
        self.batch = 0
        self.found: list[tuple[int, str, str]] = []
        self.probes: list[tuple[int, str]] = []  # torchmetrics < 1.9's device probe (_PROBE_COPIES)
        self._in_list = 0

    def __enter__(self):
        # ``.tolist()`` reads a fake tensor element by element (a GPU's in one copy): one read per call.
        self._tolist = FakeTensor.tolist

        def tolist(tensor: torch.Tensor):
            self._record("value read back")
            self._in_list += 1
            try:
                return self._tolist(tensor)
            finally:
                self._in_list -= 1

        FakeTensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *args):
        FakeTensor.tolist = self._tolist
        return super().__exit__(*args)

    def _record(self, what: str) -> None:
        # Only the package's own: a model may wait in its forward (transformers copies small tensors from the host).
        source = _source()
        if source and _PROBE_COPIES and what.startswith("copy") and _torchmetrics_probe():
            self.probes.append((self.batch, what))
        elif source:
            self.found.append((self.batch, what, source))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:
            if not self._in_list:
                self._record("value read back")
            return 0
        out = func(*args, **kwargs)
        if func.name() in _COPIES:
            devices = {t.device.type for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)}
            if len(devices) > 1:
                self._record(f"copy {sorted(devices)}")
        return out

    def at(self, batch: int) -> list[tuple[str, str]]:
        return [(what, where) for b, what, where in self.found if b == batch]


@pytest.fixture
def fake_cuda(monkeypatch):
    """A fake-tensor mode with CUDA tensors, in which torchmetrics keeps its default states in the same mode."""
    # torchmetrics deep-copies each state's default; a deep copy of a fake tensor would start a fake mode of its own.
    monkeypatch.setattr(
        torchmetrics.metric, "deepcopy", lambda v: v.clone() if isinstance(v, FakeTensor) else copy.deepcopy(v)
    )
    return FakeTensorMode()


def _stream_on_fake_cuda(
    monkeypatch,
    mode: FakeTensorMode,
    make_model: Callable[[], nn.Module],
    layers: dict[str, str],
    batches: list[dict[str, torch.Tensor]],
    *,
    num_classes: int | None = NUM_CLASSES,
    reductions: dict[int, str] | None = None,
    options: dict | None = None,
    call_with_batch: bool = False,
) -> tuple[_Waits, int]:
    """Stream ``batches`` (dicts of CPU tensors, read by a ``BatchReader``) through ``make_model()`` on a fake GPU,
    called with the batch's inputs (or the whole batch); the waits recorded per batch and the number of
    ``group_by_class`` calls."""
    counts = [torch.bincount(b["labels"], minlength=num_classes).tolist() if "labels" in b else None for b in batches]
    current: list[list[int]] = []
    calls = []

    def grouping(labels: torch.Tensor, classes: int) -> streaming.ClassGrouping:
        calls.append(classes)
        order = torch.argsort(labels, stable=True)
        sorted_labels = labels.index_select(0, order)
        slots = streaming._slots(sorted_labels, order, streaming.class_counts(labels, classes))
        return streaming.ClassGrouping(labels, order, sorted_labels, tuple(current[0]), slots)

    monkeypatch.setattr(streams_module, "group_by_class", grouping)
    waits = _Waits()
    with mode:
        with torch.device("cuda"):
            model = make_model()
        on_device = [{k: mode.from_tensor(v).to("cuda") for k, v in b.items()} for b in batches]
        stream = ActivationStream(
            layers,
            num_classes=num_classes,
            reductions=reductions or {4: "channel", 3: "token"},
            spectrum_options=options or {},
            batch_reader=BatchReader(label_key="labels" if num_classes else None, input_key="inputs"),
        )
        stream.start(model, num_batches=len(batches))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for index, (batch, batch_counts) in enumerate(zip(on_device, counts)):
                current[:] = [batch_counts]
                waits.batch = index
                with waits, torch.no_grad():
                    stream.batch_start(batch)
                    model(batch if call_with_batch else batch["inputs"])
                    stream.batch_end()
        assert stream.metrics.keys() == layers.keys()
        assert all(m.update_count == len(batches) and m.gram.device.type == "cuda" for m in stream.metrics.values())
        stream.stop()
    # Where the probe moves (torchmetrics < 1.9): an empty tensor and the element, once per layer, at the first batch.
    assert waits.probes == ([(0, "copy ['cpu', 'cuda']")] * 2 * len(layers) if _PROBE_COPIES else []), waits.probes
    return waits, len(calls)


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(12, 24), nn.ReLU(), nn.Linear(24, 16), nn.ReLU(), nn.Linear(16, NUM_CLASSES))


def _convnet() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 6, 3, padding=1), nn.Flatten(), nn.Linear(6 * 36, 5)
    )


class _Tokens(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(40, 16)
        self.block = nn.Linear(16, 16)
        self.head = nn.Linear(16, NUM_CLASSES)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.block(self.embed(ids))))


def _labelled(inputs: torch.Tensor, generator: torch.Generator) -> dict[str, torch.Tensor]:
    return {"inputs": inputs, "labels": torch.randint(0, NUM_CLASSES, (inputs.shape[0],), generator=generator)}


def _token_batches(count: int, *, left_padding: bool = False) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(count):
        batch = _labelled(torch.randint(0, 40, (8, 10), generator=generator), generator)
        lengths = torch.randint(3, 11, (8, 1), generator=generator)
        mask = (torch.arange(10) < lengths).long()  # Hugging Face's 0 / 1 integers, right padding
        batch["attention_mask"] = mask.flip(1) if left_padding else mask
        batches.append(batch)
    return batches


@pytest.mark.parametrize("precision", ["float64", "float32", "tf32", "auto"])
def test_feature_layers_wait_only_to_group_the_labels(monkeypatch, fake_cuda, precision):
    generator = torch.Generator().manual_seed(0)
    batches = [_labelled(torch.randn(32, 12, generator=generator), generator) for _ in range(3)]
    waits, groupings = _stream_on_fake_cuda(
        monkeypatch, fake_cuda, _mlp, {"a": "1", "b": "3"}, batches, options={"gram_precision": precision}
    )
    assert groupings == 3  # once per batch, for both layers
    assert waits.found == []  # the states were even made on the device: no copies at the first batch


@pytest.mark.parametrize("reduction", ["channel", "mean", "flatten"])
@pytest.mark.parametrize("num_classes", [NUM_CLASSES, None])
def test_conv_layers_wait_only_to_group_the_labels(monkeypatch, fake_cuda, reduction, num_classes):
    generator = torch.Generator().manual_seed(0)
    batches = [_labelled(torch.randn(16, 3, 6, 6, generator=generator), generator) for _ in range(3)]
    if num_classes is None:
        batches = [{"inputs": b["inputs"]} for b in batches]
    waits, groupings = _stream_on_fake_cuda(
        monkeypatch,
        fake_cuda,
        _convnet,
        {"conv1": "0", "conv2": "2"},
        batches,
        num_classes=num_classes,
        reductions={4: reduction},
    )
    assert groupings == (3 if num_classes else 0)
    assert waits.found == []


@pytest.mark.parametrize("reduction", ["token", "mean", "flatten", "cls", "last"])
def test_masked_token_layers_read_the_mask_at_the_first_batch_only(monkeypatch, fake_cuda, reduction):
    """The padded batches of a transformer: the real tokens are counted on the device, never read back."""
    batches = _token_batches(4)
    waits, groupings = _stream_on_fake_cuda(
        monkeypatch, fake_cuda, _Tokens, {"block": "block", "head": "head"}, batches, reductions={3: reduction}
    )
    assert groupings == 4
    # The pass's first batch checks that the mask holds 0 and 1 (and, for "cls", that its first column is real),
    # once for all layers; the later batches count wrong values on the device instead.
    first = [what for what, _ in waits.at(0)]
    assert first == ["value read back"] * (2 if reduction == "cls" else 1), waits.at(0)
    assert [entry for entry in waits.found if entry[0] > 0] == []


def test_gpt2_blocks_read_the_mask_at_the_first_batch_only(monkeypatch, fake_cuda):
    """Hugging Face blocks (tuples in transformers 4.x, tensors in 5.x) fed a padded dict batch, as users have them."""

    class Causal(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            config = GPT2Config(n_layer=2, n_embd=16, n_head=2, n_positions=10, vocab_size=40)
            self.model = GPT2Model(config)

        def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
            return self.model(input_ids=batch["inputs"], attention_mask=batch["attention_mask"]).last_hidden_state

    batches = _token_batches(3)
    waits, groupings = _stream_on_fake_cuda(
        monkeypatch, fake_cuda, Causal, {"h0": "model.h.0", "h1": "model.h.1"}, batches, call_with_batch=True
    )
    assert groupings == 3
    assert [what for what, _ in waits.at(0)] == ["value read back"]  # the mask's values, once for both blocks
    assert [entry for entry in waits.found if entry[0] > 0] == []


@pytest.mark.parametrize("reduction", ["token", "cls"])
def test_an_encoder_decoder_reads_each_of_its_masks_at_the_first_batch_only(monkeypatch, fake_cuda, reduction):
    """T5 fed source and target masks of one shape: the decoder's layers take the decoder's mask, whose values are
    checked at the first batch, as the encoder's are (and, for "cls", its first column); later batches never wait."""

    class Seq2Seq(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = T5Model(T5Config(vocab_size=40, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2))

        def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
            return self.model(
                input_ids=batch["inputs"],
                attention_mask=batch["attention_mask"],
                decoder_input_ids=batch["inputs"],
                decoder_attention_mask=batch["decoder_attention_mask"],
            ).last_hidden_state

    batches = _token_batches(3)
    for batch in batches:
        batch["decoder_attention_mask"] = batch["attention_mask"].roll(1, 0)  # the targets' own lengths
    layers = {"encoder": "model.encoder.block.1", "decoder": "model.decoder.block.1"}
    waits, groupings = _stream_on_fake_cuda(
        monkeypatch, fake_cuda, Seq2Seq, layers, batches, reductions={3: reduction}, call_with_batch=True
    )
    assert groupings == 3
    # One read per mask (two for "cls", whose first columns are read once per mask too), at the first batch only.
    first = [what for what, _ in waits.at(0)]
    assert first == ["value read back"] * (4 if reduction == "cls" else 2), waits.at(0)
    assert [entry for entry in waits.found if entry[0] > 0] == []


@pytest.mark.parametrize("fallback", ["sample_gram", "sketch"])
@pytest.mark.parametrize("layers", ["features", "padded tokens"])
def test_fallback_paths_wait_only_to_group_the_labels(monkeypatch, fake_cuda, fallback, layers):
    # The generator of keys and buckets lives on the rows' device; the fake CUDA draws from a CPU one in its stead.
    drawn = []
    monkeypatch.setattr(ActivationSpectrum, "_rng", lambda self, device: drawn.append(device) or torch.Generator())
    options = {"max_gram_features": 8, "fallback": fallback, "max_samples": 40}
    if layers == "features":
        generator = torch.Generator().manual_seed(0)
        batches = [_labelled(torch.randn(32, 12, generator=generator), generator) for _ in range(3)]
        waits, groupings = _stream_on_fake_cuda(
            monkeypatch, fake_cuda, _mlp, {"a": "1", "b": "3"}, batches, options=options
        )
        assert waits.found == []
    else:
        batches = _token_batches(3)
        waits, groupings = _stream_on_fake_cuda(
            monkeypatch, fake_cuda, _Tokens, {"block": "block", "head": "head"}, batches, options=options
        )
        assert [what for what, _ in waits.at(0)] == ["value read back"]  # the mask's values
        assert [entry for entry in waits.found if entry[0] > 0] == []
    assert groupings == 3
    assert drawn and {device.type for device in drawn} == {"cuda"}  # keys and buckets drawn on the device


@pytest.mark.parametrize("num_classes", [NUM_CLASSES, None])
def test_padded_rows_kept_in_place_never_enter_the_fallbacks(monkeypatch, num_classes):
    """The subsample of the real rows (all of them: exact) and a sketch that counts only them, on the GPU's layout."""
    monkeypatch.setattr(spectrum_module, "_keeps_padded_rows", lambda device: True)
    batches = _token_batches(3)
    generator = torch.Generator().manual_seed(2)
    tokens = [5 + torch.randn(8, 10, 16, generator=generator, dtype=torch.float64) for _ in batches]
    for t, b in zip(tokens, batches):
        t.masked_fill_(~b["attention_mask"].bool().unsqueeze(2), float("nan"))
    rows = torch.cat([t[b["attention_mask"].bool()] for t, b in zip(tokens, batches)])

    def run(fallback: str, capacity: int) -> ActivationSpectrum:
        metric = ActivationSpectrum(
            num_classes, reduction="token", max_gram_features=8, fallback=fallback, max_samples=capacity
        )
        for t, b in zip(tokens, batches):
            metric.update(t, b["labels"] if num_classes else None, mask=b["attention_mask"].bool())
        return metric

    every_row = run("sample_gram", capacity=240)  # room for all 240 positions: the padded ones must still stay out
    result = every_row.compute()
    assert result.spectrum_rows == result.num_samples == rows.shape[0] < 240
    expected = torch.linalg.svdvals(rows)
    streamed = result.uncentered.spectrum.singular_values[: expected.shape[0]]
    assert float((streamed - expected).abs().max()) <= 1e-12 * float(expected[0])

    sketched = run("sketch", capacity=32)
    assert float(sketched.sketch_rows.sum()) == rows.shape[0]  # every real row in one bucket, no padded one
    assert torch.isfinite(sketched.sketch).all()  # the padded positions' NaN never reached it
    assert torch.isfinite(torch.tensor(list(sketched.compute().scalars().values()))).all()


@pytest.mark.parametrize("reduction", ["token", "mean"])
@pytest.mark.parametrize("num_classes", [NUM_CLASSES, None])
@pytest.mark.parametrize("precision", ["float64", "float32"])
def test_token_rows_kept_in_place_give_the_spectra_of_the_real_rows(monkeypatch, reduction, num_classes, precision):
    """The GPU's layout (padded rows in place, counted out), forced on a CPU, against the CPU's (real rows selected)
    and against the SVD of the real rows gathered one by one.

    The tokens lie far from the origin and the first batch is all padding: the sums must still be taken around a point
    near the data (a point at the origin loses the centred spectrum's digits to cancellation, float32 products all).
    """
    batches = _token_batches(4)
    batches[0]["attention_mask"].zero_()
    generator = torch.Generator().manual_seed(1)
    scales = torch.logspace(0, -2, 16)
    tokens = [300 + torch.randn(8, 10, 16, generator=generator) * scales for _ in batches]
    for t, b in zip(tokens, batches):
        t.masked_fill_(~b["attention_mask"].bool().unsqueeze(2), float("nan"))  # padding may hold anything
    real_rows = []
    for t, b in zip(tokens, batches):
        for sample, keep in zip(t.double(), b["attention_mask"].bool()):
            if keep.any():
                real_rows += list(sample[keep]) if reduction == "token" else [sample[keep].mean(dim=0)]
    rows = torch.stack(real_rows)
    expected = {
        "uncentered": torch.linalg.svdvals(rows),
        "centered": torch.linalg.svdvals(rows - rows.mean(dim=0)),
    }

    def run() -> tuple[dict[str, float], object]:
        metric = ActivationSpectrum(num_classes, reduction=reduction, center="both", gram_precision=precision)
        for t, b in zip(tokens, batches):
            metric.update(t, b["labels"] if num_classes else None, mask=b["attention_mask"].bool())
        result = metric.compute()
        return result.scalars(per_class=True), result

    selected, _ = run()
    monkeypatch.setattr(spectrum_module, "_keeps_padded_rows", lambda device: True)
    kept, result = run()
    assert result.num_samples == rows.shape[0]
    assert kept.keys() == selected.keys()
    # float32 products of values near 300: a few float32 roundings of the largest value squared, relative to the
    # spectrum's own largest value; float64 ones: the Gram's resolution.
    tolerance = 1e-9 if precision == "float64" else 3e-5
    for side, values in expected.items():
        streamed = getattr(result, side).spectrum.singular_values[: values.shape[0]]
        assert float((streamed - values).abs().max()) <= tolerance * float(values[0]), side
    for key, value in selected.items():
        assert kept[key] == pytest.approx(value, rel=tolerance, abs=tolerance), key


def test_a_mask_of_other_values_after_the_first_batch_is_named_at_the_end_of_the_pass():
    batches = _token_batches(3)
    batches[2]["attention_mask"] = batches[2]["attention_mask"] * 2  # 0 / 2: not a 0 / 1 mask
    model = _Tokens()
    warned: list[tuple[str, str, str]] = []
    stream = ActivationStream(
        {"block": "block"},
        num_classes=None,
        reductions={3: "token"},
        spectrum_options={},
        batch_reader=BatchReader(input_key="inputs"),
        warn=lambda *args: warned.append(args),
    )
    stream.start(model, num_batches=3)
    with torch.no_grad():
        for batch in batches:
            stream.batch_start(batch)
            model(batch["inputs"])
            stream.batch_end()
    values, _ = stream.compute("cpu", metrics=("numerical_rank",), centered=False, per_class=False, when="at epoch 0")
    assert "token/numerical_rank" in values["block"]
    assert [(layer, kind) for layer, kind, _ in warned] == [("", "mask values")]
    assert "1 batch(es) at epoch 0 held values other than 0 and 1" in warned[0][2]

    # At a pass's first batch the same mask is refused at once, naming where it was found.
    stream.start(model, num_batches=1)
    with pytest.raises(ValueError, match=r"attention mask at 'attention_mask'.*values other than 0 and 1"):
        stream.batch_start(batches[2])


def test_neural_collapse_first_pass_reads_the_label_range_once_per_batch(fake_cuda):
    from rank_lightning.metrics import NeuralCollapseStatistics

    generator = torch.Generator().manual_seed(0)
    waits = _Waits()
    with fake_cuda:
        with torch.device("cuda"):
            metric = NeuralCollapseStatistics(NUM_CLASSES, 12)
        for index in range(3):
            features = fake_cuda.from_tensor(torch.randn(32, 12, generator=generator)).to("cuda")
            labels = fake_cuda.from_tensor(torch.randint(0, NUM_CLASSES, (32,), generator=generator)).to("cuda")
            waits.batch = index
            with waits:
                metric.update(features, labels)
    # The smallest and largest label in one read (two before); the class counts and sums stay on the device.
    assert [(batch, what) for batch, what, _ in waits.found] == [(i, "value read back") for i in range(3)], waits.found


def test_neural_collapse_second_pass_reads_once_per_batch(fake_cuda):
    """The label range and whether every label's class has a mean, in one read."""
    from rank_lightning.metrics import NeuralCollapseStatistics

    generator = torch.Generator().manual_seed(0)
    features, labels = torch.randn(64, 12, generator=generator), torch.arange(64) % NUM_CLASSES
    metric = NeuralCollapseStatistics(NUM_CLASSES, 12)
    metric.update(features, labels)
    metric.start_second_pass()  # on the CPU: the fake tensors have no values to find the means with
    waits = _Waits()
    with fake_cuda:
        for name in [*metric._defaults, "_means", "_present", "_row_of", "_directions"]:
            setattr(metric, name, fake_cuda.from_tensor(getattr(metric, name)).to("cuda"))
        for index in range(3):
            batch = [fake_cuda.from_tensor(t).to("cuda") for t in (features, labels, torch.randn(64, NUM_CLASSES))]
            waits.batch = index
            with waits:
                metric.update(*batch)
    assert [(batch, what) for batch, what, _ in waits.found] == [(i, "value read back") for i in range(3)], waits.found


@pytest.mark.parametrize("second", [False, True])
def test_neural_collapse_of_token_rows_reads_once_per_batch(fake_cuda, second):
    """Next-token classes: the label range (-100 aside), the 0 / 1 values of the integer attention mask and, in the
    second pass, whether every label's class has a mean, in one read (three before: the token labels grouped, then
    the mask's values, then the range)."""
    from rank_lightning.metrics import NeuralCollapseStatistics

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(4, 6, 12, generator=generator)
    labels = (torch.arange(24) % NUM_CLASSES).reshape(4, 6)
    labels[:, -1] = -100
    mask = (torch.arange(6) < torch.tensor([[6], [4], [5], [3]])).long()
    metric = NeuralCollapseStatistics(NUM_CLASSES, 12)
    if second:
        metric.update(x, labels, mask=mask)
        metric.start_second_pass()  # on the CPU: the fake tensors have no values to find the means with
    waits = _Waits()
    with fake_cuda:
        for name in [*metric._defaults, *(["_means", "_present", "_row_of", "_directions"] if second else [])]:
            setattr(metric, name, fake_cuda.from_tensor(getattr(metric, name)).to("cuda"))
        for index in range(3):
            batch = [fake_cuda.from_tensor(t).to("cuda") for t in (x, labels, torch.randn(4, 6, NUM_CLASSES), mask)]
            waits.batch = index
            with waits:
                metric.update(*batch[:3], mask=batch[3])
    assert [(batch, what) for batch, what, _ in waits.found] == [(i, "value read back") for i in range(3)], waits.found


@pytest.mark.parametrize("reduction", ["token", "mean"])
@pytest.mark.parametrize("fallback", [None, "sketch"])
def test_updates_in_chunks_wait_no_more(monkeypatch, fake_cuda, reduction, fallback):
    """Batches past ``update_chunk_mb`` go a chunk of rows (or of inputs, for float64 means) at a time: the chunks
    are cut from the shapes alone, and the class counts of each chunk from the batch's, on the host."""
    monkeypatch.setattr(ActivationSpectrum, "_rng", lambda self, device: torch.Generator())
    chunked = []
    cut = streaming._chunked_row_moments
    monkeypatch.setattr(streaming, "_chunked_row_moments", lambda *args: chunked.append(args[2]) or cut(*args))
    options = {"update_chunk_mb": 16 * 16 * 8 / 2**20}  # 16 rows of 16 features: 5 chunks of a batch's 80 tokens
    if fallback:
        options.update(max_gram_features=8, fallback=fallback, max_samples=40)
    waits, groupings = _stream_on_fake_cuda(
        monkeypatch,
        fake_cuda,
        _Tokens,
        {"block": "block", "head": "head"},
        _token_batches(3),
        reductions={3: reduction},
        options=options,
    )
    # Token rows in chunks of 2048 bytes of float64 rows, halved where class Grams by padded products may double
    # them: 8 rows of the block's 16 features (16 on the sketch, which has no Grams), 25 of the head's 5, every batch.
    assert chunked == ([8 if fallback is None else 16, 25] * 3 if reduction == "token" else [])
    assert groupings == 3
    assert [what for what, _ in waits.at(0)] == ["value read back"]  # the mask's values
    assert [entry for entry in waits.found if entry[0] > 0] == []
