"""RankTracker: the activation monitor's numbers in a plain PyTorch loop."""

from __future__ import annotations

import inspect
import math
import warnings
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from torch import nn

from rank_lightning.callbacks import ActivationRankMonitor
from rank_lightning.functional import alpha_req
from rank_lightning.tracker import RankTracker
from tests.callbacks.trainer_helpers import quiet_trainer

CLASSES = 4


class _ConvNet(pl.LightningModule):
    """A conv layer (channel-reduced maps) and two dense layers: both kinds of output the monitor reads."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.fc1 = nn.Linear(8 * 6 * 6, 32)
        self.fc2 = nn.Linear(32, 24)
        self.head = nn.Linear(24, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv(x)).flatten(1)
        return self.head(torch.tanh(self.fc2(torch.relu(self.fc1(h)))))

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", nn.functional.cross_entropy(self(batch[0]), batch[1]))


def _batches(count: int = 3, size: int = 16, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(size, 3, 6, 6, generator=generator), torch.randint(0, CLASSES, (size,), generator=generator))
        for _ in range(count)
    ]


def _model() -> _ConvNet:
    torch.manual_seed(0)
    return _ConvNet().eval()


def _monitor_values(model: _ConvNet, batches, root: Path, **options) -> dict[str, dict[str, float]]:
    monitor = ActivationRankMonitor(verbose=False, **options)
    monitor.curves.write_figures = lambda trainer: []  # the figures drawn after validate are not compared here
    loader = torch.utils.data.DataLoader(batches, batch_size=None)  # the batches as they are, in order
    quiet_trainer([monitor], default_root_dir=root).validate(model, loader, verbose=False)
    (values,) = monitor.curves.history.values()
    return values


def _tracker_values(model: _ConvNet, batches, **options) -> dict[str, dict[str, float]]:
    tracker = RankTracker(model, **options)
    with torch.no_grad(), tracker:
        for x, y in batches:
            with tracker.batch(labels=y):
                model(x)
    return tracker.compute()


def _assert_equal(actual: dict[str, dict[str, float]], expected: dict[str, dict[str, float]]) -> None:
    assert list(actual) == list(expected)
    for layer, values in expected.items():
        assert sorted(actual[layer]) == sorted(values), layer
        for key, value in values.items():
            got = actual[layer][key]
            assert (math.isnan(got) and math.isnan(value)) or got == pytest.approx(value, rel=1e-12, abs=1e-12), (
                layer,
                key,
                got,
                value,
            )


@pytest.mark.parametrize("max_samples", [None, 40])
def test_tracker_gives_the_monitors_numbers_on_the_same_batches(max_samples, tmp_path):
    batches = _batches()
    options = dict(layers=["conv", "fc1", "fc2"], num_classes=CLASSES, max_samples=max_samples)
    expected = _monitor_values(_model(), batches, tmp_path, **options)
    actual = _tracker_values(_model(), batches, num_batches=len(batches), **options)
    assert set(expected) == {"conv", "fc1", "fc2"}
    assert "channel/numerical_rank" in actual["conv"] and "tcv" in actual["fc1"]
    _assert_equal(actual, expected)


def test_forward_passes_outside_batch_are_unlabelled_batches():
    batches = _batches()
    model = _model()
    tracker = RankTracker(model, layers=["fc1"])
    with torch.no_grad(), tracker:
        for x, _ in batches:
            model(x)
    implicit = tracker.compute()
    assert tracker.inputs_measured == 0  # compute ended the pass
    explicit = _tracker_values(_model(), [(x, None) for x, _ in batches], layers=["fc1"])
    _assert_equal(implicit, explicit)
    assert "tcv" not in implicit["fc1"] and implicit["fc1"]["numerical_rank"] > 0


def test_labels_are_read_from_the_batch_as_the_callbacks_read_them():
    batches = _batches()
    model = _model()
    tracker = RankTracker(model, layers=["fc2"], num_classes=CLASSES)
    with torch.no_grad(), tracker:
        for batch in batches:
            with tracker.batch(batch=batch):
                model(batch[0])
    _assert_equal(tracker.compute(), _tracker_values(_model(), batches, layers=["fc2"], num_classes=CLASSES))


def test_compute_inside_the_block_starts_a_new_pass_and_the_hooks_go_with_the_block():
    first, second = _batches(seed=1), _batches(seed=2)
    model = _model()
    tracker = RankTracker(model, layers=["fc1"], num_classes=CLASSES)
    with torch.no_grad(), tracker:
        for x, y in first:
            with tracker.batch(labels=y):
                model(x)
        tracker.compute()
        assert model.fc1._forward_hooks
        for x, y in second:
            with tracker.batch(labels=y):
                model(x)
        values = tracker.compute()
    assert not model.fc1._forward_hooks and not model._forward_hooks and not model._forward_pre_hooks
    _assert_equal(values, _tracker_values(_model(), second, layers=["fc1"], num_classes=CLASSES))
    with torch.no_grad():
        model(first[0][0])  # no longer hooked: nothing is measured
    assert tracker.inputs_measured == 0


def test_bad_settings_name_the_value_and_the_choices():
    model = _model()
    with pytest.raises(ValueError, match=r"'fc9'.*fc1"):
        RankTracker(model, layers=["fc9"])
    with pytest.raises(ValueError, match=r"conv_reduction.*'pool'.*channel"):
        RankTracker(model, layers=["conv"], conv_reduction="pool")
    with pytest.raises(RuntimeError, match="with tracker"), RankTracker(model, layers=["fc1"]).batch():
        pass
    # center="both" was accepted and returned the centred values alone, under the plain keys.
    with pytest.raises(ValueError, match=r"unknown center 'both'; valid choices are: False, True"):
        RankTracker(model, layers=["fc1"], center="both")
    with pytest.raises(ValueError, match=r"alpha_req_range must be a pair"):
        RankTracker(model, layers=["fc1"], alpha_req_range=11)


def test_variance_ratio_needs_a_k_as_in_the_monitor():
    # Before, the tracker took variance_ratio_ks=[] and returned no VR_k although 'variance_ratio' was asked for.
    model = _model()
    with pytest.raises(ValueError, match=r"^metric 'variance_ratio' needs at least one k in variance_ratio_ks$"):
        RankTracker(model, layers=["fc1"], metrics=["numerical_rank", "variance_ratio"], variance_ratio_ks=[])
    tracker = RankTracker(model, layers=["fc1"], metrics=["numerical_rank"], variance_ratio_ks=[])
    assert tracker.stream.spectrum_options["variance_ratio_ks"] == ()
    assert RankTracker(model, layers=["fc1"], variance_ratio_ks=5).stream.spectrum_options["variance_ratio_ks"] == (5,)


def test_mask_key_takes_what_the_monitor_takes():
    # The hint said int | str | None although a function batch -> mask and False (no mask) are accepted.
    hint = inspect.signature(RankTracker).parameters["mask_key"].annotation
    assert hint == "Literal[False] | int | str | Callable[[Any], Tensor | None] | None"
    assert hint == inspect.signature(ActivationRankMonitor).parameters["mask_key"].annotation
    model = _model()
    assert RankTracker(model, layers=["fc1"], mask_key=False).stream.batch_reader.mask_key is False
    assert RankTracker(model, layers=["fc1"], mask_key=len).stream.batch_reader.mask_key is len


def test_alpha_req_over_a_chosen_range():
    model = _model()
    tracker = RankTracker(model, layers=["fc1"], metrics=("alpha_req",), alpha_req_range=(2, 9), center=True)
    rows = []
    model.fc1.register_forward_hook(lambda module, inputs, output: rows.append(output.detach()))
    with tracker, torch.no_grad():
        for x, _ in _batches():
            model(x)
    expected = alpha_req(torch.cat(rows).double(), first_index=2, last_index=9, center=True)
    assert tracker.compute()["fc1"]["alpha_req"] == pytest.approx(float(expected), rel=1e-9)


class _TokenNet(pl.LightningModule):
    """Two token-wise layers on ``(B, T, D)`` inputs, fed dict batches with padding (an attention mask)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 12)
        self.mix = nn.Linear(12, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mix(torch.relu(self.proj(x)))

    def validation_step(self, batch, batch_idx):
        self.log("val/mean", self(batch["x"]).mean())


def _token_batches(count: int = 3, size: int = 5, tokens: int = 7) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(3)
    batches = []
    for _ in range(count):
        lengths = torch.randint(2, tokens + 1, (size,), generator=generator)
        batches.append(
            {
                "x": torch.randn(size, tokens, 6, generator=generator),
                "attention_mask": torch.arange(tokens)[None, :] < lengths[:, None],
                "labels": torch.randint(0, CLASSES, (size,), generator=generator),
            }
        )
    return batches


def test_token_layers_with_padding_give_the_monitors_numbers(tmp_path):
    batches = _token_batches()
    torch.manual_seed(0)
    model = _TokenNet().eval()
    options = dict(layers=["proj", "mix"], num_classes=CLASSES, max_samples=None)
    monitor = ActivationRankMonitor(verbose=False, **options)
    monitor.curves.write_figures = lambda trainer: []
    loader = torch.utils.data.DataLoader(batches, batch_size=None)
    quiet_trainer([monitor], default_root_dir=tmp_path).validate(model, loader, verbose=False)
    (expected,) = monitor.curves.history.values()

    tracker = RankTracker(model, **options)
    with torch.no_grad(), tracker:
        for batch in batches:
            with tracker.batch(batch=batch):
                model(batch["x"])
    actual = tracker.compute()
    _assert_equal(actual, expected)
    assert actual["proj"]["token/numerical_rank"] == 7  # an affine map of 6 features
    with torch.no_grad(), tracker:  # the same batches with their padded positions measured too
        for batch in batches:
            with tracker.batch(labels=batch["labels"]):
                model(batch["x"])
    padded = tracker.compute()
    assert padded["mix"]["token/participation_ratio"] != pytest.approx(actual["mix"]["token/participation_ratio"])


@pytest.mark.parametrize("left", [True, False])
def test_cls_reduction_names_left_padding(left):
    batches = _token_batches()
    if left:
        for batch in batches:
            batch["attention_mask"] = batch["attention_mask"].flip(1)  # the padding first
    model = _TokenNet().eval()
    tracker = RankTracker(model, layers=["proj"], num_classes=CLASSES, token_reduction="cls")
    with warnings.catch_warnings(record=True) as caught, torch.no_grad(), tracker:
        warnings.simplefilter("always")
        for batch in batches:
            with tracker.batch(batch=batch):
                model(batch["x"])
    named = [w for w in caught if "left padding" in str(w.message)]
    assert len(named) == (1 if left else 0)
    if left:
        assert "'proj'" in str(named[0].message) and "token_reduction='token'" in str(named[0].message)


def test_cls_reduction_names_left_padding_that_only_later_batches_have():
    """A tokenizer that pads on the left leaves a batch of sequences of one length unpadded: a pass whose first batch
    is such a batch still names the left padding of the later ones, at its end."""
    batches = _token_batches()
    batches[0]["attention_mask"] = torch.ones_like(batches[0]["attention_mask"])
    for batch in batches[1:]:
        batch["attention_mask"] = batch["attention_mask"].flip(1)  # the padding first
    model = _TokenNet().eval()
    tracker = RankTracker(model, layers=["proj"], num_classes=CLASSES, token_reduction="cls")
    with warnings.catch_warnings(record=True) as caught, torch.no_grad(), tracker:
        warnings.simplefilter("always")
        for batch in batches:
            with tracker.batch(batch=batch):
                model(batch["x"])
        assert not [w for w in caught if "left padding" in str(w.message)]
        tracker.compute()
    named = [str(w.message) for w in caught if "left padding" in str(w.message)]
    assert len(named) == 1 and "'proj'" in named[0] and "token_reduction='token'" in named[0]


def test_a_pass_over_a_distributed_sampler_leaves_its_repeated_samples_out():
    # 61 samples on 2 processes: the second process reads 31, its last a repeat of sample 0. Emulated on one process
    # by the sampler's rank argument; the two processes' sums are what one process measures on all 61.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, CLASSES)).eval()
    g = torch.Generator().manual_seed(5)
    data = torch.utils.data.TensorDataset(
        torch.randn(61, 6, generator=g), torch.randint(0, CLASSES, (61,), generator=g)
    )
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=2, rank=1, shuffle=False)
    second = torch.utils.data.DataLoader(data, batch_size=8, sampler=sampler)
    own = torch.utils.data.DataLoader(torch.utils.data.Subset(data, list(range(1, 61, 2))), batch_size=8)

    def measure(loader, tracker: RankTracker) -> tuple[dict, int]:
        with torch.no_grad(), tracker:
            for x, y in loader:
                with tracker.batch(labels=y):
                    model(x)
            return tracker.inputs_measured, tracker.compute()

    options = dict(layers=["1"], num_classes=CLASSES)
    count, values = measure(second, RankTracker(model, **options).over(second))
    assert count == 30  # samples 1, 3, ..., 59; not 31
    assert measure(second, RankTracker(model, **options))[0] == 31  # without over(): the repeat is measured
    expected_count, expected = measure(own, RankTracker(model, **options))
    assert expected_count == 30
    _assert_equal(values, expected)


@pytest.mark.parametrize("labelled", [True, False])
def test_over_counts_batches_without_class_labels_and_ends_with_its_block(labelled):
    # Without num_classes the batch size came from the labels only when they were used: with explicit labels or
    # none, the repeat at the end of the pass was measured. And over() stayed on for later passes.
    model = nn.Sequential(nn.Linear(6, 4)).eval()
    g = torch.Generator().manual_seed(5)
    data = torch.utils.data.TensorDataset(
        torch.randn(61, 6, generator=g), torch.randint(0, CLASSES, (61,), generator=g)
    )
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=2, rank=1, shuffle=False)
    second = torch.utils.data.DataLoader(data, batch_size=8, sampler=sampler)
    tracker = RankTracker(model, layers=["0"])
    with torch.no_grad(), tracker.over(second):
        for x, y in second:
            with tracker.batch(labels=y) if labelled else tracker.batch():
                model(x)
        assert tracker.inputs_measured == 30
    with torch.no_grad(), tracker:
        for x, _ in torch.utils.data.DataLoader(data, batch_size=8):
            model(x)
        assert tracker.inputs_measured == 61


def test_a_layer_problem_is_warned_once_not_at_every_pass():
    (x, y), model = _batches(count=1)[0], _model()
    tracker = RankTracker(model, layers=["fc1"], num_classes=CLASSES)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            with torch.no_grad(), tracker:
                with tracker.batch(labels=y):
                    model(x)
                tracker.compute()
    capped = [str(w.message) for w in caught if "fewer than its 32 features" in str(w.message)]
    assert len(capped) == 1 and capped[0].startswith("layer 'fc1'"), capped


def _seq2seq_batches(count: int = 2, size: int = 4, length: int = 8) -> list[dict[str, torch.Tensor]]:
    """Source and target padded to one length, each of its own: the encoder's mask fits the decoder's shape."""
    generator = torch.Generator().manual_seed(5)
    batches = []
    for _ in range(count):
        source = torch.arange(length)[None] < torch.randint(2, length + 1, (size, 1), generator=generator)
        target = torch.arange(length)[None] < torch.randint(2, length, (size, 1), generator=generator)
        batches.append(
            {
                "input_ids": torch.randint(1, 40, (size, length), generator=generator) * source,
                "attention_mask": source.long(),
                "labels": torch.randint(1, 40, (size, length), generator=generator).masked_fill(~target, -100),
                "decoder_attention_mask": target.long(),
            }
        )
    return batches


def test_the_decoder_of_an_encoder_decoder_is_measured_on_the_target_tokens():
    """A T5 model called with keyword inputs, or given both masks by hand: each stack's own real tokens."""
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    config = T5Config(vocab_size=40, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2, decoder_start_token_id=0)
    model = T5ForConditionalGeneration(config).eval()
    batches = _seq2seq_batches()
    tracker = RankTracker(model)
    assert list(tracker.layers) == ["encoder.block.0", "encoder.block.1", "decoder.block.0", "decoder.block.1"]
    outputs: dict[str, list[torch.Tensor]] = {path: [] for path in tracker.layers}
    with torch.no_grad(), tracker:
        handles = [
            model.get_submodule(path).register_forward_hook(
                lambda _m, _a, out, path=path: outputs[path].append(out[0] if isinstance(out, tuple) else out)
            )
            for path in tracker.layers
        ]
        for batch in batches:
            model(**batch)  # keyword inputs: both masks read from them
        for handle in handles:
            handle.remove()
        implicit = tracker.compute()
        for batch in batches:
            with tracker.batch(mask=batch["attention_mask"], decoder_mask=batch["decoder_attention_mask"]):
                model(**batch)
        explicit = tracker.compute()
    _assert_equal(explicit, implicit)
    for path, states in outputs.items():
        key = "attention_mask" if path.startswith("encoder") else "decoder_attention_mask"
        rows = torch.cat([h[batch[key].bool()] for h, batch in zip(states, batches, strict=True)]).double()
        s = torch.linalg.svdvals(rows)
        assert implicit[path]["token/spectrum_rows"] == rows.shape[0]
        expected = float((s**2).sum() ** 2 / (s**4).sum())
        assert implicit[path]["token/participation_ratio"] == pytest.approx(expected, rel=1e-12)
        shares = s / s.sum()
        expected = float(torch.exp(-(shares * shares.log()).sum()))
        assert implicit[path]["token/effective_rank"] == pytest.approx(expected, rel=1e-12)


def test_a_layer_whose_output_changes_dimensions_skips_those_batches_with_a_warning():
    # The metric reduces the outputs of the layer's first kind: a (B, T, d) batch after (B, d) ones reduced to T * d
    # 'flatten' features and raised out of the user's forward pass.
    model = nn.Sequential(nn.Linear(5, 4)).eval()  # (B, 4) outputs of (B, 5) inputs, (B, T, 4) of tokens
    generator = torch.Generator().manual_seed(2)
    flat = [torch.randn(12, 5, generator=generator) for _ in range(2)]
    tokens = torch.randn(12, 3, 5, generator=generator)
    tracker = RankTracker(model, layers=["0"])
    with warnings.catch_warnings(record=True) as caught, torch.no_grad(), tracker:
        warnings.simplefilter("always")
        for x in (flat[0], tokens, flat[1]):
            model(x)
        values = tracker.compute()["0"]
    with torch.no_grad():
        s = torch.linalg.svdvals(torch.cat([model(x) for x in flat]).double())
    assert values["spectrum_rows"] == 24.0
    assert values["participation_ratio"] == pytest.approx(float((s**2).sum() ** 2 / (s**4).sum()), rel=1e-12)
    message = "layer '0' gives (12, 3, 4), a 3-d output where its first batch gave a 2-d one; such batches are skipped"
    assert next(str(w.message) for w in caught if "3-d output" in str(w.message)).startswith(message)


def test_a_new_block_before_compute_warns_that_it_drops_the_inputs_measured():
    # A `with tracker:` around each forward pass of a loop started a new pass each time: compute() then gave the
    # last batch's values alone, without a word.
    model = nn.Sequential(nn.Linear(6, 10)).eval()
    generator = torch.Generator().manual_seed(3)
    xs = [torch.randn(16, 6, generator=generator) for _ in range(3)]
    tracker = RankTracker(model, layers=["0"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x in xs:
            with torch.no_grad(), tracker:
                model(x)
        values = tracker.compute()["0"]
        with torch.no_grad(), tracker:  # computed: a new pass drops nothing
            model(xs[0])
    dropped = [str(w.message) for w in caught if "drops" in str(w.message)]
    assert dropped == [
        "RankTracker: a new pass starts and drops the 16 input(s) measured since the last compute(); each `with "
        "tracker:` block (or start()) is a pass of its own: call compute() before the next one, or keep one block "
        "around every forward pass of the pass"
    ]
    with torch.no_grad():
        s = torch.linalg.svdvals(model(xs[2]).double())
    assert values["spectrum_rows"] == 16.0
    assert values["participation_ratio"] == pytest.approx(float((s**2).sum() ** 2 / (s**4).sum()), rel=1e-12)


class _Branching(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk, self.branch = nn.Linear(6, 5), nn.Linear(5, 4)

    def forward(self, x: torch.Tensor, branch: bool) -> torch.Tensor:
        h = self.trunk(x)
        return self.branch(h) if branch else h


def test_a_layer_the_first_batch_does_not_call_is_measured_in_the_batches_that_do():
    # The warning after the first batch said such a layer was not logged, and it was logged.
    model = _Branching().eval()
    generator = torch.Generator().manual_seed(4)
    xs = [torch.randn(16, 6, generator=generator) for _ in range(3)]
    tracker = RankTracker(model, layers=["trunk", "branch"])
    with warnings.catch_warnings(record=True) as caught, torch.no_grad(), tracker:
        warnings.simplefilter("always")
        outputs = [model(x, branch=i > 0) for i, x in enumerate(xs)]
    values = tracker.compute()
    message = (
        "layer 'branch' (branch) was not called in the forward pass of the pass's first monitored batch; it is "
        "measured in the batches that call it only, and not logged if none does. Name a module that runs "
        "(layers=[...])."
    )
    assert [str(w.message) for w in caught if "not called" in str(w.message)] == [message]
    s = torch.linalg.svdvals(torch.cat(outputs[1:]).double())
    assert values["branch"]["spectrum_rows"] == 32.0 and values["trunk"]["spectrum_rows"] == 48.0
    assert values["branch"]["participation_ratio"] == pytest.approx(float((s**2).sum() ** 2 / (s**4).sum()), rel=1e-12)


def test_the_metrics_rounding_warnings_name_the_layer():
    # Classes of spread 1e-9: the streamed TCV cancels its digits; the metric's warning said "ActivationSpectrum".
    generator = torch.Generator().manual_seed(3)
    labels = torch.randint(0, CLASSES, (64,), generator=generator)
    x = torch.randn(CLASSES, 6, generator=generator, dtype=torch.float64)[labels]
    x = x + 1e-9 * torch.randn(64, 6, generator=generator, dtype=torch.float64)
    model = nn.Sequential(nn.Identity())
    tracker = RankTracker(model, layers=["0"], num_classes=CLASSES)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad(), tracker:
            with tracker.batch(labels=labels):
                model(x)
            tracker.compute()
    messages = [str(w.message) for w in caught if "total cluster variation" in str(w.message)]
    assert len(messages) == 1 and messages[0].startswith("layer '0': the total cluster variation"), messages


class _Residual(nn.Module):
    """A float32 residual stream that adds a Linear's output: bf16 under autocast, float32 in the sum."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.linear(x)


def test_the_end_of_pass_warnings_survive_the_block_that_computes_after_it():
    """The documented loop computes after its ``with tracker:`` block: what the pass noted for the warnings of its end
    (float32 outputs of layers run under autocast, mask values other than 0 and 1) is still there."""
    model = nn.Sequential(_Residual(), nn.Linear(16, 4))
    tracker = RankTracker(model, layers=["0"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad(), tracker, torch.autocast("cpu", dtype=torch.bfloat16):
            model(torch.randn(64, 16))
        tracker.compute()
    named = [str(w.message) for w in caught if "numerical_rank takes the float32 tolerance" in str(w.message)]
    assert len(named) == 1 and "ran under bfloat16 autocast" in named[0], [str(w.message) for w in caught]
    assert "tolerance_dtype=torch.bfloat16" in named[0]

    batches = _token_batches()
    batches[1]["attention_mask"] = batches[1]["attention_mask"].long() * 2  # values other than 0 and 1
    token_model = _TokenNet().eval()
    tracker = RankTracker(token_model, layers=["proj"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad(), tracker:
            for batch in batches:
                with tracker.batch(batch=batch):
                    token_model(batch["x"])
        tracker.compute()
    named = [str(w.message) for w in caught if "held values other than 0 and 1" in str(w.message)]
    assert len(named) == 1 and "1 batch(es)" in named[0], [str(w.message) for w in caught]
