"""The float64 temporaries of ActivationSpectrum.update stay within update_chunk_mb, whatever the batch, and the
chunked update gives the sums of one pass over the batch."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from rank_lightning.metrics import ActivationSpectrum

CHUNK_MB = 1 / 64  # 16 KiB: 32 float64 rows of 64 features
STATES = ("num_samples", "feature_sum", "sum_squares", "gram", "class_counts", "class_sums", "class_grams", "sketch")


class _Largest(TorchDispatchMode):
    """The bytes of the largest new tensor of each dtype made inside the block (views and in-place results are not
    new: they share an input's storage)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest: dict[torch.dtype, int] = {}
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                size = t.untyped_storage().nbytes()
                self.sizes.append(size)
                self.largest[t.dtype] = max(self.largest.get(t.dtype, 0), size)
        return out


def _updated(chunk_mb: float, activations, labels=None, mask=None, **options) -> tuple[ActivationSpectrum, _Largest]:
    metric = ActivationSpectrum(update_chunk_mb=chunk_mb, **options)
    metric.update(activations[:2], None if labels is None else labels[:2])  # sets the reference point
    largest = _Largest()
    with largest:
        metric.update(activations, labels, mask=mask)
    return metric, largest


def _batch(shape, dtype=torch.float32):
    generator = torch.Generator().manual_seed(0)
    return (torch.randn(shape, generator=generator) * 0.5 + 2).to(dtype)


def _assert_same_sums(chunked: ActivationSpectrum, whole: ActivationSpectrum, rtol: float) -> None:
    for name in STATES:
        a, b = getattr(chunked, name), getattr(whole, name)
        if b.numel() == 0:
            continue
        if name.endswith("grams") or name == "gram":
            a, b = a.tril(), b.tril()
        scale = b.abs().max().clamp_min(1e-300)
        # One norm over the whole batch is itself up to 6e-14 from the exact sum of squares (the chunks' is exact).
        tolerance = max(rtol, 1e-13) if name == "sum_squares" else rtol
        assert (a - b).abs().max() <= tolerance * scale, (name, ((a - b).abs().max() / scale).item())


@pytest.mark.parametrize("precision", ["float64", "float32"])
@pytest.mark.parametrize("labels", [None, "inputs", "tokens"])
def test_token_rows_are_added_a_chunk_at_a_time(precision, labels):
    x = _batch((8, 128, 64), torch.bfloat16)  # 1024 rows: 512 KiB of float64
    y = None
    if labels == "inputs":
        y = torch.tensor([3, 0, 1, 3, 2, 0, 1, 1])
    elif labels == "tokens":
        y = torch.randint(0, 4, (8, 128), generator=torch.Generator().manual_seed(1))
        y[:, -1] = -100
    options = {"reduction": "token", "gram_precision": precision, "num_classes": 4 if y is not None else None}
    chunked, largest = _updated(CHUNK_MB, x, y, **options)
    whole, whole_largest = _updated(1024, x, y, **options)
    rows = 8 * 127 if labels == "tokens" else 8 * 128  # on a CPU the labelled tokens' rows are selected first
    assert whole_largest.largest[torch.float64] == rows * 64 * 8  # one pass: the batch's float64 rows
    assert largest.largest[torch.float64] <= CHUNK_MB * 2**20
    # float32 products: a chunk's rows in float32, and the (64, 64) product of the rows before it is added.
    assert largest.largest.get(torch.float32, 0) <= max(CHUNK_MB * 2**20 / 2, 64 * 64 * 4)
    assert chunked.largest_update_bytes == CHUNK_MB * 2**20 and whole.largest_update_bytes == rows * 64 * 8
    # Float64 products: the order of the additions changes. Float32 products: each chunk's product is rounded to
    # float32 (then added in float64) instead of the batch's, which agree to float32's rounding.
    _assert_same_sums(chunked, whole, 1e-15 if precision == "float64" else 1e-5)


def test_the_chunks_of_a_batch_add_into_one_set_of_class_sums():
    """Next-token classes: the (V, d) class sums, as large as the states, are made once per batch, not per chunk."""
    x = _batch((8, 128, 64))
    y = torch.randint(0, 2000, (8, 128), generator=torch.Generator().manual_seed(1))
    options = {"reduction": "token", "num_classes": 2000, "classwise": False}
    chunked, largest = _updated(CHUNK_MB, x, y, **options)  # 32 chunks of 32 rows
    whole, _ = _updated(1024, x, y, **options)
    assert largest.sizes.count(2000 * 64 * 8) == 1
    assert torch.equal(chunked.class_sums, whole.class_sums)  # added row by row in the same order
    assert torch.equal(chunked.class_counts, whole.class_counts)


@pytest.mark.parametrize(("shape", "masked"), [((16, 64, 32), False), ((16, 64, 32), True), ((16, 32, 8, 8), False)])
def test_float64_means_are_taken_a_chunk_of_inputs_at_a_time(shape, masked):
    x = _batch(shape, torch.bfloat16)  # 16 inputs of 2048 values: 256 KiB as float64, 16 KiB each
    mask = (torch.arange(64) < torch.arange(4, 68, 4).unsqueeze(1)) if masked else None
    chunked, largest = _updated(CHUNK_MB * 2, x, mask=mask, reduction="mean")  # two inputs per chunk
    whole, whole_largest = _updated(1024, x, mask=mask, reduction="mean")
    assert whole_largest.largest[torch.float64] == 16 * 2048 * 8
    assert largest.largest[torch.float64] == 2 * 2048 * 8
    assert chunked.largest_update_bytes == 2 * 2048 * 8
    for name in STATES[:4]:  # each input's mean is taken as in one pass: equal sums
        assert torch.equal(getattr(chunked, name), getattr(whole, name)), name


def test_sketch_rows_are_signed_and_added_a_chunk_at_a_time():
    x = _batch((8, 128, 64))
    options = {"reduction": "token", "max_gram_features": 32, "fallback": "sketch", "max_samples": 50}
    chunked, largest = _updated(CHUNK_MB, x, **options)
    whole, whole_largest = _updated(1024, x, **options)
    assert whole_largest.largest[torch.float64] == 1024 * 64 * 8
    assert largest.largest[torch.float64] == CHUNK_MB * 2**20
    for name in ("sketch", "sketch_signs", "sketch_rows", "feature_sum"):  # the same draws, added in the same order
        assert torch.equal(getattr(chunked, name), getattr(whole, name)), name


def test_channel_blocks_are_what_the_update_reports():
    x = _batch((16, 64, 32, 32))  # CPU blocks of 2^18 values: 4 inputs of 64 x 32 x 32
    metric, largest = _updated(CHUNK_MB, x, reduction="channel")
    assert largest.largest[torch.float64] == metric.largest_update_bytes == 4 * 64 * 1024 * 8


def test_update_chunk_mb_must_be_positive():
    with pytest.raises(ValueError, match=r"update_chunk_mb must be a positive number, got 0"):
        ActivationSpectrum(update_chunk_mb=0)


@pytest.mark.parametrize("labels", ["inputs", "tokens"])
def test_padded_rows_kept_in_place_are_added_a_chunk_at_a_time(monkeypatch, labels):
    """The GPU's layout on a CPU: padded token rows stay in place (a row mask), class Grams by padded products."""
    from rank_lightning.functional import streaming
    from rank_lightning.metrics import activation_spectrum

    monkeypatch.setattr(activation_spectrum, "_keeps_padded_rows", lambda device: True)
    monkeypatch.setattr(streaming, "_batched_class_products", lambda device: True)
    x = _batch((8, 128, 64))
    mask = torch.arange(128) < torch.arange(16, 144, 16).unsqueeze(1)
    y = torch.tensor([3, 0, 1, 3, 2, 0, 1, 1])
    if labels == "tokens":
        y = torch.randint(0, 4, (8, 128), generator=torch.Generator().manual_seed(1))
    chunked, largest = _updated(CHUNK_MB, x, y, mask=mask, reduction="token", num_classes=4)
    whole, whole_largest = _updated(1024, x, y, mask=mask, reduction="token", num_classes=4)
    # Every row (the padded ones zeroed) and, for the class Grams, the rows in zero-padded class blocks.
    assert whole_largest.largest[torch.float64] == {"inputs": 4 * 3 * 128 * 64 * 8, "tokens": 550912}[labels]
    assert whole.largest_update_bytes == 2 * 1024 * 64 * 8  # at most twice the rows
    assert largest.largest[torch.float64] <= chunked.largest_update_bytes == CHUNK_MB * 2**20
    assert (
        int(chunked.num_samples) == int(whole.num_samples) == 16 * 36 + 2 * 128
    )  # the real rows only (and the first 2 inputs)
    _assert_same_sums(chunked, whole, 1e-15)


@pytest.mark.parametrize(("chunk_mb", "said"), [(1024, "0.5 MiB ('proj')"), (CHUNK_MB, "0.0156 MiB ('proj')")])
def test_the_memory_plan_names_the_largest_per_batch_temporary(chunk_mb, said):
    from torch import nn

    from rank_lightning.layers import BatchReader
    from rank_lightning.streams import ActivationStream

    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8))
    messages: list[str] = []
    stream = ActivationStream(
        {"proj": "0", "head": "1"},
        num_classes=None,
        reductions={3: "token"},
        spectrum_options={"update_chunk_mb": chunk_mb},
        batch_reader=BatchReader(label_key=None, input_key="inputs"),
        info=messages.append,
    )
    stream.start(model, num_batches=1)
    with torch.no_grad():
        stream.batch_start({"inputs": _batch((8, 128, 64))})
        model(_batch((8, 128, 64)))  # 1024 rows of 64 features: 0.5 MiB of float64
        stream.batch_end()
    stream.stop()
    assert messages[0] == (
        f"state of 2 layers: 0.0329 MiB on cpu (largest 'proj': 0.0323 MiB); per-batch temporary up to {said}"
    )


def test_the_subsample_takes_a_batch_a_chunk_of_rows_at_a_time():
    x = _batch((8, 128, 64), torch.bfloat16)
    options = {"reduction": "token", "max_gram_features": 32, "max_samples": 100}
    chunked, largest = _updated(CHUNK_MB, x, **options)  # 32 chunks of 32 rows
    whole, whole_largest = _updated(1024, x, **options)
    assert whole_largest.largest[torch.float32] == 1024 * 64 * 4  # the batch's rows in float32
    assert largest.largest[torch.float32] <= (100 + 32) * 64 * 4  # the subsample and one chunk
    by_key = [torch.sort(m.sample_keys[0]) for m in (chunked, whole)]
    assert torch.equal(by_key[0].values, by_key[1].values)  # the same rows, kept in another order
    assert torch.equal(chunked.sample_rows[0][by_key[0].indices], whole.sample_rows[0][by_key[1].indices])
