import dataclasses
import re
from typing import NamedTuple

import pytest
import torch
from torch import nn

from rank_lightning.layers import (
    BatchReader,
    FeatureLayer,
    capture_features,
    check_layer_types,
    check_output_selector,
    classifier_head,
    compiled_modules,
    decoder_layers,
    default_layers,
    eval_mode,
    feature_layer,
    forward_hooks,
    hidden_state,
    match_layer_names,
    match_layer_types,
    module_blocks,
    select_layers,
    train_mode,
)


class _Net(nn.Module):
    """stem conv, two residual-like blocks, a head; ``blocks()`` names them as the package's modules do."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3)
        self.layer1 = nn.Sequential(nn.Conv2d(4, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
        self.layer2 = nn.Sequential(nn.Conv2d(4, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
        self.head = nn.Linear(4, 2)

    def blocks(self) -> dict[str, str]:
        return {"block1": "layer1", "block2": "layer2", "features": "layer2.2"}


def _all(module: nn.Module) -> dict[str, nn.Module]:
    return {name: m for name, m in module.named_modules() if name}


def _linear_and_conv(module: nn.Module) -> dict[str, nn.Module]:
    return {name: m for name, m in module.named_modules() if isinstance(m, (nn.Linear, nn.Conv2d))}


def test_module_blocks_reads_a_blocks_method():
    assert module_blocks(_Net()) == {"block1": "layer1", "block2": "layer2", "features": "layer2.2"}


@pytest.mark.parametrize(
    "blocks",
    [
        nn.Sequential(nn.Linear(2, 2)),  # timm-style attribute: never called
        nn.ModuleList([nn.Linear(2, 2)]),
        lambda: ["layer1", "layer2"],  # not a mapping
        lambda: {"block": "missing.path"},  # a path that does not resolve
        lambda: {},
        "layer1",
    ],
    ids=["sequential", "module_list", "list", "bad_path", "empty", "string"],
)
def test_module_blocks_ignores_what_is_not_a_block_map(blocks):
    net = nn.Module()
    net.layer1 = nn.Linear(2, 2)
    net.blocks = blocks
    assert module_blocks(net) is None


def test_a_blocks_attribute_that_is_a_module_is_never_run():
    class Exploding(nn.Module):
        def forward(self):
            raise AssertionError("blocks() was called")

    net = nn.Module()
    net.blocks = Exploding()
    assert module_blocks(net) is None


@pytest.mark.parametrize(
    ("patterns", "expected"),
    [
        (["block2"], ["layer2"]),
        (["features", "block1"], ["layer1", "layer2.2"]),
        (["layer1.0", "head"], ["layer1.0", "head"]),
        (["layer*.0"], ["layer1.0", "layer2.0"]),
        (["block*"], ["layer1", "layer2"]),
        (["*.2", "stem"], ["stem", "layer1.2", "layer2.2"]),
        (["layer2", "layer2.2", "features"], ["layer2", "layer2.2"]),
    ],
)
def test_names_blocks_and_globs_resolve_in_depth_order(patterns, expected):
    net = _Net()
    assert match_layer_names(net, patterns, _all(net), blocks=module_blocks(net), expand_containers=False) == expected


def test_a_container_name_expands_to_the_candidates_inside_it():
    net = _Net()
    candidates = _linear_and_conv(net)
    assert match_layer_names(net, ["layer2"], candidates) == ["layer2.0"]
    assert match_layer_names(net, ["layer?"], candidates) == ["layer1.0", "layer2.0"]
    with pytest.raises(ValueError, match=r"unknown layer 'layer2'; layers are: stem, layer1\.0, layer2\.0, head"):
        match_layer_names(net, ["layer2"], candidates, expand_containers=False)


@pytest.mark.parametrize(
    ("patterns", "message"),
    [
        (["layer3"], r"unknown layer 'layer3'; layers are: block1, block2, features, stem, layer1, layer1\.0"),
        (["*.conv"], r"layer '\*\.conv' matches nothing that can be monitored; layers are: block1, block2"),
    ],
)
def test_errors_name_the_pattern_and_list_blocks_then_modules(patterns, message):
    net = _Net()
    with pytest.raises(ValueError, match=message):
        match_layer_names(net, patterns, _all(net), blocks=module_blocks(net), expand_containers=False)


def test_a_container_without_candidates_inside_is_an_error():
    net = _Net()
    candidates = {name: m for name, m in net.named_modules() if isinstance(m, nn.Linear)}
    with pytest.raises(ValueError, match="weight layer 'layer1' matches nothing that can be monitored; weight layers"):
        match_layer_names(net, ["layer1"], candidates, kind="weight layer")


def test_layer_types_accept_classes_names_of_bases_and_import_paths():
    net = _Net()
    modules = dict(net.named_modules())
    names = [n for n in modules if n]
    types = check_layer_types([nn.Linear, "_BatchNorm", "torch.nn.ReLU"])
    assert types == [nn.Linear, "_BatchNorm", nn.ReLU]
    assert match_layer_types(names, modules, types) == ["layer1.1", "layer1.2", "layer2.1", "layer2.2", "head"]
    assert check_layer_types("Conv2d") == ["Conv2d"]


@pytest.mark.parametrize(
    ("layer_types", "message"),
    [
        (["torch.nn.Nope"], "layer type 'torch.nn.Nope' cannot be imported"),
        (["torch.nn.functional.relu"], "layer type 'torch.nn.functional.relu' is not a torch.nn.Module subclass"),
        ([int], "layer_types entries must be nn.Module classes or class names, got <class 'int'>"),
        ([""], "layer_types entries must be nn.Module classes or class names, got ''"),
        ([], "layer_types must be None or a non-empty list"),
    ],
)
def test_bad_layer_types_are_rejected(layer_types, message):
    with pytest.raises(ValueError, match=message):
        check_layer_types(layer_types)


def test_layer_types_that_match_nothing_list_the_types_present():
    net = _Net()
    modules = dict(net.named_modules())
    with pytest.raises(ValueError, match=r"layer_types \['Conv3d'\] match none .*; their types are: Conv2d, Linear"):
        match_layer_types(["stem", "head"], modules, [nn.Conv3d])


# -- select_layers and feature_layer -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("layers", "layer_types", "expected"),
    [
        (["block2"], None, {"block2": "layer2"}),
        (["layer1.0"], None, {"layer1.0": "layer1.0"}),
        (["layer*.2"], None, {"layer1.2": "layer1.2", "features": "layer2.2"}),
        (None, ["Conv2d"], {"stem": "stem", "layer1.0": "layer1.0", "layer2.0": "layer2.0"}),
        (["block*"], [nn.Sequential], {"block1": "layer1", "block2": "layer2"}),
    ],
    ids=["block", "path", "glob", "type_alone", "glob_and_type"],
)
def test_select_layers_speaks_one_syntax(layers, layer_types, expected):
    assert select_layers(_Net(), layers, layer_types) == expected


def test_glob_characters_match_dots_too_as_fnmatch_does():
    """``*`` is the block and everything inside it; the blocks alone match their index or keep their class."""
    net = _Net()
    assert list(select_layers(net, ["layer1*"]).values()) == ["layer1", "layer1.0", "layer1.1", "layer1.2"]
    assert list(select_layers(net, ["layer?"]).values()) == ["layer1", "layer2"]
    assert list(select_layers(net, ["layer*"], [nn.Sequential]).values()) == ["layer1", "layer2"]


def test_select_layers_expands_containers_to_leaf_candidates_named_by_path():
    net = _Net()
    candidates = _linear_and_conv(net)
    assert select_layers(net, ["block2", "head"], candidates=candidates, leaves=True) == {
        "layer2.0": "layer2.0",
        "head": "head",
    }
    assert select_layers(net, None, candidates=candidates, default=lambda m: {"head": "head"}) == {"head": "head"}
    with pytest.raises(ValueError, match="unknown weight layer 'nope'; weight layers are: block1, block2"):
        select_layers(net, ["nope"], candidates=candidates, leaves=True, kind="weight layer")


def test_select_layers_rejects_names_that_would_break_logged_keys():
    net = nn.Module()
    net.add_module("a/b", nn.Linear(2, 2))
    with pytest.raises(ValueError, match="layer name 'a/b' contains '/'"):
        select_layers(net, ["a/b"])


def test_feature_layer_defaults_to_the_last_block_or_the_input_of_the_last_linear():
    assert feature_layer(_Net()) == FeatureLayer("features", "layer2.2")
    plain = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    assert feature_layer(plain) == FeatureLayer("2_input", "2", "input")
    assert feature_layer(nn.Sequential(nn.ReLU()), required=False) is None
    with pytest.raises(ValueError, match=r"has no blocks\(\) and no nn\.Linear layer"):
        feature_layer(nn.Sequential(nn.ReLU()))


@pytest.mark.parametrize(
    ("layer", "expected"),
    [("block1", FeatureLayer("block1", "layer1")), ("layer1.0", FeatureLayer("layer1.0", "layer1.0"))],
)
def test_feature_layer_takes_the_shared_syntax(layer, expected):
    assert feature_layer(_Net(), layer) == expected


def test_feature_layer_needs_exactly_one_match():
    with pytest.raises(ValueError, match=r"layer 'layer\*\.0' matches 2 modules \(layer1\.0, layer2\.0\); name one"):
        feature_layer(_Net(), "layer*.0")


# -- hooks and modes -------------------------------------------------------------------------------------------------


def test_forward_hooks_see_outputs_and_inputs_and_are_always_removed():
    net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    seen: list[tuple[str, tuple[int, ...]]] = []
    layers = [FeatureLayer("hidden", "1"), FeatureLayer("head_input", "2", "input")]
    x = torch.randn(5, 3)
    with forward_hooks(net, layers, lambda layer, value: seen.append((layer.name, tuple(value.shape)))):
        net(x)
    assert seen == [("hidden", (5, 4)), ("head_input", (5, 4))]
    with pytest.raises(RuntimeError, match="boom"), forward_hooks(net, layers, lambda layer, value: None):
        raise RuntimeError("boom")
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in net.modules())
    net(x)
    assert len(seen) == 2


def test_capture_features_keeps_the_latest_tensor_with_its_graph():
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    with capture_features(net, [FeatureLayer("hidden", "1")]) as captured:
        net(torch.randn(2, 3))
        first = captured["hidden"]
        net(torch.randn(6, 3))
    assert captured["hidden"].shape == (6, 4) and first.shape == (2, 4)
    captured["hidden"].sum().backward()
    assert net[0].weight.grad is not None


def _mixed_flags() -> nn.Module:
    net = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2), nn.Dropout(0.5), nn.Sequential(nn.BatchNorm1d(2)))
    net.train()
    net[1].eval()  # a frozen BatchNorm inside a training model
    net[3].eval()
    return net


@pytest.mark.parametrize(("switch", "inside"), [(eval_mode, False), (train_mode, True)])
def test_mode_contexts_restore_every_submodules_own_flag(switch, inside):
    net = _mixed_flags()
    before = [m.training for m in net.modules()]
    assert before == [True, True, False, True, False, False]
    with switch(net) as same:
        assert same is net
        assert all(m.training is inside for m in net.modules())
    assert [m.training for m in net.modules()] == before
    with pytest.raises(KeyError), switch(net):
        raise KeyError("error inside")
    assert [m.training for m in net.modules()] == before


# -- batches ---------------------------------------------------------------------------------------------------------


def test_batch_reader_reads_tuples_dicts_and_tensors():
    x, y = torch.randn(4, 3), torch.tensor([0, 1, 2, 1])
    reader = BatchReader()
    assert reader.split((x, y))[0] is x and reader.split([x, y])[1] is y
    assert reader.split({"pixel_values": x, "labels": y}) == (x, y)
    assert reader.inputs(x) is x and reader.labels(x) is None
    assert BatchReader(input_key="a", label_key="b").split({"a": x, "b": y, "labels": y + 1}) == (x, y)
    assert BatchReader(label_key=2).labels((x, y.float(), y)) is y
    assert BatchReader(label_fn=lambda batch: batch["meta"][0]).labels({"x": x, "meta": [y]}) is y
    assert BatchReader.batch_size({"input_ids": x, "labels": y}) == 4 and BatchReader.batch_size([1, 2]) is None


@pytest.mark.parametrize(
    ("batch", "message"),
    [
        ({"x": torch.ones(2, 3)}, r"cannot find integer class labels at one of \['y'.* \(found nothing\)"),
        (
            (torch.ones(2, 3), torch.ones(2)),
            r"found a Tensor torch.float32 of shape \(2,\): float values, not class indices\); class metrics need",
        ),
    ],
    ids=["dict_without_labels", "float_labels"],
)
def test_batch_reader_says_where_it_looked_for_labels(batch, message):
    reader = BatchReader()
    assert reader.labels(batch) is None
    with pytest.raises(ValueError, match=message):
        reader.labels(batch, required=True)


@pytest.mark.parametrize(
    ("batch", "reader", "message"),
    [
        (
            {"x": torch.ones(2), "y": torch.ones(2).long()},
            BatchReader(label_key="t"),
            r"at 't' in a dict batch.*; set label_key \(a key of the dict batch\) or label_fn",
        ),
        (
            (torch.ones(2, 3),),
            BatchReader(label_fn=lambda b: None),
            r"at label_fn in a tuple batch of length 1.*; set label_key \(an index of the tuple batch\) or label_fn",
        ),
        (
            (torch.ones(2, 3),),
            BatchReader(label_key=1),
            r"at 1 in a tuple batch of length 1 \(found nothing\); set label_key \(an index of the tuple batch\)",
        ),
        (
            torch.ones(2, 3),
            BatchReader(label_key="y"),
            r"at 'y' in a batch of type Tensor \(found nothing\); set label_fn \(a batch of type Tensor has no index "
            r"or key for label_key\)",
        ),
    ],
    ids=["missing_key", "label_fn", "index_out_of_range", "tensor_batch"],
)
def test_labels_named_explicitly_must_be_found_even_when_not_required(batch, reader, message):
    """An explicit ``label_key`` or ``label_fn`` that finds nothing is a setup error, raised at the first batch."""
    with pytest.raises(ValueError, match=message):
        reader.labels(batch)


@pytest.mark.parametrize("dtype", [torch.int64, torch.uint8, torch.float32, torch.float16, torch.bool])
def test_one_hot_labels_are_read_as_their_argmax(dtype):
    y = torch.tensor([2, 0, 1, 2])
    one_hot = torch.nn.functional.one_hot(y, 3).to(dtype)
    x = torch.randn(4, 5)
    for reader, batch in [
        (BatchReader(), (x, one_hot)),
        (BatchReader(), {"pixel_values": x, "labels": one_hot}),
        (BatchReader(label_key="target"), {"x": x, "target": one_hot}),
        (BatchReader(label_fn=lambda b: b[1]), (x, one_hot)),
    ]:
        labels = reader.labels(batch, required=True)
        assert labels.dtype == torch.int64 and labels.tolist() == [2, 0, 1, 2]
    assert BatchReader().split((x, one_hot))[1].tolist() == [2, 0, 1, 2]


SOFT = torch.tensor([[0.9, 0.05, 0.05], [0.05, 0.9, 0.05]])
MIXUP = torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.3, 0.7]])
TWO_HOT = torch.tensor([[1, 1, 0], [0, 0, 1]])
NOT_ONE_HOT = "rows that are not one-hot: soft labels, mixup or regression targets are not class labels"


@pytest.mark.parametrize(
    ("labels", "found"),
    [
        (SOFT, f"a Tensor torch.float32 of shape (2, 3): {NOT_ONE_HOT}"),
        (MIXUP, f"a Tensor torch.float32 of shape (2, 3): {NOT_ONE_HOT}"),
        (TWO_HOT, f"a Tensor torch.int64 of shape (2, 3): {NOT_ONE_HOT}"),
        (torch.tensor([[0.5], [1.5]]), "a Tensor torch.float32 of shape (2, 1): float values, not class indices"),
        (torch.tensor([0.5, 1.5]), "a Tensor torch.float32 of shape (2,): float values, not class indices"),
        (torch.tensor([0.0, 1.0]), "a Tensor torch.float32 of shape (2,): float values, not class indices"),
        (torch.zeros(2, 4, 4).long(), "a Tensor torch.int64 of shape (2, 4, 4): 3 dimensions, not one label per row"),
        (
            torch.tensor([[5, 17, -100], [3, 9, 2]]),
            "a Tensor torch.int64 of shape (2, 3): a class label per token or position, not one per sample (per-token "
            "labels are not supported)",
        ),
    ],
    ids=["soft", "mixup", "two_hot", "float_column", "regression", "integral_floats", "mask", "per_token"],
)
def test_labels_that_are_not_class_labels_are_refused(labels, found):
    batch = {"x": torch.ones(2, 3), "y": labels}
    default = "one of ['y', 'label', 'labels', 'target', 'targets']"
    assert BatchReader().labels(batch) is None
    assert BatchReader().label_source(batch) == f"{default} in a dict batch with keys ['x', 'y'] (found {found})"
    why = re.escape(f"(found {found}); class metrics need integer labels of shape (B,) or one-hot rows of shape (B, C)")
    with pytest.raises(
        ValueError, match=re.escape("cannot find integer class labels at 'y' in a dict batch") + ".*" + why
    ):
        BatchReader(label_key="y").labels(batch)
    with pytest.raises(ValueError, match=re.escape(f"at {default} in") + ".*" + why):
        BatchReader().labels(batch, required=True)


@pytest.mark.parametrize(
    ("reader", "batch", "source"),
    [
        (
            BatchReader(),
            {"x": torch.ones(2, 3), "w": torch.ones(2)},
            "one of ['y', 'label', 'labels', 'target', 'targets'] in a dict batch with keys ['x', 'w'] (found nothing)",
        ),
        (
            BatchReader(),
            (torch.ones(2, 3), torch.ones(2), torch.tensor([0, 1])),
            "index 1 in a tuple batch of length 3 (found a Tensor torch.float32 of shape (2,): float values, not class "
            "indices)",
        ),
        (
            BatchReader(label_key=2),
            [torch.ones(2, 3), torch.ones(2), torch.tensor([0, 1])],
            "2 in a list batch of length 3 (found a Tensor torch.int64 of shape (2,))",
        ),
        (
            BatchReader(label_key="y"),
            {"y": torch.eye(3)},
            "'y' in a dict batch with keys ['y'] (found a Tensor torch.float32 of shape (3, 3), one-hot: read as its "
            "argmax)",
        ),
        (
            BatchReader(label_fn=lambda b: b["meta"]),
            {"meta": [1, 2]},
            "label_fn in a dict batch with keys ['meta'] (found a list)",
        ),
        (
            BatchReader(),
            torch.ones(2, 3),
            "index 1 or one of ['y', 'label', 'labels', 'target', 'targets'] in a batch of type Tensor (found nothing)",
        ),
    ],
    ids=["dict_other_keys", "x_w_y_tuple", "explicit_index", "one_hot", "label_fn", "tensor"],
)
def test_label_source_says_where_labels_were_looked_for_and_what_was_found(reader, batch, source):
    assert reader.label_source(batch) == source


def test_batch_reader_errors_on_missing_inputs_and_bad_keys():
    with pytest.raises(ValueError, match=r"cannot find the inputs at 'img' in a dict batch with keys \['x'\]"):
        BatchReader(input_key="img").inputs({"x": torch.ones(1)})
    with pytest.raises(ValueError, match=r"label_key must be None, an index or a key, got 1\.5"):
        BatchReader(label_key=1.5)


def test_module_blocks_look_through_a_wrapper_holding_every_parameter():
    wrapper = nn.Module()  # a user's LightningModule with the network in ``self.net``
    wrapper.net = _Net()
    wrapper.loss = nn.CrossEntropyLoss()
    expected = {"block1": "net.layer1", "block2": "net.layer2", "features": "net.layer2.2"}
    assert module_blocks(wrapper) == expected
    assert select_layers(wrapper, ["block*"]) == {"block1": "net.layer1", "block2": "net.layer2"}
    assert feature_layer(wrapper) == FeatureLayer("features", "net.layer2.2")
    wrapper.extra_head = nn.Linear(2, 2)  # parameters outside the network: not a wrapper any more
    assert module_blocks(wrapper) is None


# -- hidden states of block outputs ------------------------------------------------------------------------------------

_STATE = torch.randn(2, 3, 4)
_PRESENT = torch.randn(2, 2, 3, 2)


@dataclasses.dataclass
class _BlockOutput:
    loss: torch.Tensor | None = None
    attentions: tuple[torch.Tensor, ...] | None = None
    hidden: torch.Tensor | None = None


class _Pair(NamedTuple):
    attn: torch.Tensor
    state: torch.Tensor


@pytest.mark.parametrize(
    ("output", "expected"),
    [
        (_STATE, _STATE),  # transformers 5.x blocks, nn.TransformerEncoderLayer
        ((_STATE, (_PRESENT, _PRESENT)), _STATE),  # transformers 4.x blocks: hidden states first
        ([None, _STATE, _PRESENT], _STATE),  # the first tensor of a list
        ((torch.tensor(0.5), _STATE), _STATE),  # a 0-dimensional loss is never a hidden state
        ({"hidden_states": (_PRESENT,), "last_hidden_state": _STATE}, _STATE),  # last_hidden_state wins
        ({"attentions": _PRESENT, "hidden_states": _STATE}, _STATE),  # then hidden_states when it is a tensor
        ({"hidden_states": (_STATE,), "logits": _PRESENT}, _PRESENT),  # else the first tensor field
        (_BlockOutput(loss=torch.tensor(1.0), attentions=(_PRESENT,), hidden=_STATE), _STATE),  # dataclass
        (_Pair(_PRESENT, _STATE), _PRESENT),  # a named tuple is a tuple
        ((None, "text"), None),
        ({"loss": torch.tensor(1.0)}, None),
        ("text", None),
    ],
)
def test_hidden_state_follows_the_documented_rule(output, expected):
    picked = hidden_state(output)
    assert picked is expected


@pytest.mark.parametrize(
    ("output", "selector", "expected"),
    [
        ((_PRESENT, _STATE), 1, _STATE),
        ((_PRESENT, _STATE), -1, _STATE),
        ({"a": _PRESENT, "b": None, "c": _STATE}, 1, _STATE),  # the set fields in order, as ModelOutput[i]
        (_BlockOutput(hidden=_STATE), 0, _STATE),
        ({"a": _PRESENT, "b": _STATE}, "b", _STATE),
        (_BlockOutput(attentions=(_PRESENT,), hidden=_STATE), "hidden", _STATE),
        (_Pair(_PRESENT, _STATE), "state", _STATE),
        ((_PRESENT, (_STATE,)), lambda output: output[1][0], _STATE),
        ({"hidden": _STATE}, lambda output: output["hidden"], _STATE),
        (_STATE, lambda output: None, None),  # nothing to measure from this call
    ],
)
def test_an_output_selector_overrides_the_rule(output, selector, expected):
    assert hidden_state(output, selector) is expected


@pytest.mark.parametrize(
    ("output", "selector", "message"),
    [
        (_STATE, 0, r"output_selector=0 indexes a tuple, list or ModelOutput, but the layer returned a Tensor of shape "
                    r"\(2, 3, 4\); use output_selector=None"),
        ((_STATE,), 3, r"output_selector=3 is out of range for a tuple of length 1"),
        ({"a": _STATE}, "b", r"output_selector='b' is not a key or attribute of a dict with fields \['a'\]"),
        (_STATE, "hidden", r"output_selector='hidden' is not a key or attribute of a Tensor"),
        ((_STATE, None), 1, r"output_selector=1 picks a NoneType, not a tensor, from a tuple of length 2"),
        (_BlockOutput(), "attentions", r"output_selector='attentions' picks a NoneType, not a tensor, from a "
                                       r"_BlockOutput with fields \['loss', 'attentions', 'hidden'\]"),
        (_STATE, lambda output: output.shape, r"output_selector <lambda> picks a Size, not a tensor"),
        (_STATE, 1.5, r"output_selector must be None \(the documented rule\), an index, a key"),
        (_STATE, True, r"output_selector must be None"),
        (_STATE, "", r"output_selector must be None"),
    ],
)  # fmt: skip
def test_a_selector_that_does_not_fit_the_output_says_what_the_output_is(output, selector, message):
    with pytest.raises(ValueError, match=message):
        hidden_state(output, selector)


def test_output_selectors_are_checked_up_front():
    for selector in (None, 0, -1, "last_hidden_state", len):
        assert check_output_selector(selector) is selector
    with pytest.raises(ValueError, match=r"got \[0\]"):
        check_output_selector([0])


# -- attention masks of batches ----------------------------------------------------------------------------------------

_IDS = torch.randint(0, 9, (2, 4))
_MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])


@pytest.mark.parametrize(
    ("reader", "batch", "expected"),
    [
        (BatchReader(), {"input_ids": _IDS, "attention_mask": _MASK}, _MASK.bool()),
        (BatchReader(), {"input_ids": _IDS, "attention_mask": _MASK.bool()}, _MASK.bool()),
        (BatchReader(), {"input_ids": _IDS, "attention_mask": _MASK.float()}, _MASK.bool()),
        (BatchReader(), {"input_ids": _IDS}, None),  # no padding in this batch
        (BatchReader(), (_IDS, torch.tensor([0, 1]), _MASK), None),  # tuples name no mask by default
        (BatchReader(), _IDS, None),
        (BatchReader(mask_key=2), (_IDS, torch.tensor([0, 1]), _MASK), _MASK.bool()),
        (BatchReader(mask_key="mask"), {"input_ids": _IDS, "mask": _MASK}, _MASK.bool()),
        (BatchReader(mask_key=lambda b: ~b["pad"]), {"x": _IDS, "pad": _MASK == 0}, _MASK.bool()),
        (BatchReader(mask_key=lambda b: None), {"x": _IDS}, None),
        (BatchReader(mask_key=False), {"input_ids": _IDS, "attention_mask": _MASK}, None),
    ],
)
def test_batch_reader_reads_the_attention_mask(reader, batch, expected):
    mask = reader.mask(batch)
    if expected is None:
        assert mask is None
    else:
        assert mask.dtype == torch.bool
        assert torch.equal(mask, expected)


@pytest.mark.parametrize(
    ("reader", "batch", "message"),
    [
        (BatchReader(mask_key="mask"), {"input_ids": _IDS, "attention_mask": _MASK},
         r"cannot find the attention mask at 'mask' in a dict batch with keys \['input_ids', 'attention_mask'\]; "
         r"set mask_key"),
        (BatchReader(mask_key=2), (_IDS, _MASK), r"cannot find the attention mask at 2 in a tuple batch of length 2"),
        (BatchReader(mask_key="mask"), _IDS, r"cannot find the attention mask at 'mask' in a batch of type Tensor"),
        (BatchReader(), {"attention_mask": _MASK[None]},
         r"the attention mask at 'attention_mask' in a dict batch .* must be a \(B, T\) tensor, found a Tensor of "
         r"shape \(1, 2, 4\)"),
        (BatchReader(mask_key=lambda b: [1, 0]), {"x": _IDS}, r"the attention mask at mask_key .* found a list"),
        (BatchReader(), {"attention_mask": _MASK.float().log()},
         r"the attention mask at 'attention_mask' .* values other than 0 and 1"),
    ],
)  # fmt: skip
def test_a_mask_that_is_not_there_or_not_a_mask_is_an_error_saying_where_it_looked(reader, batch, message):
    with pytest.raises(ValueError, match=message):
        reader.mask(batch)


_TARGET_MASK = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0]])
_SEQ2SEQ = {"input_ids": _IDS, "attention_mask": _MASK, "decoder_attention_mask": _TARGET_MASK}


@pytest.mark.parametrize(
    ("reader", "batch", "default", "expected"),
    [
        (BatchReader(), _SEQ2SEQ, True, _TARGET_MASK.bool()),
        (BatchReader(mask_key="attention_mask"), _SEQ2SEQ, True, _TARGET_MASK.bool()),  # Hugging Face's name
        (BatchReader(), {**_SEQ2SEQ, "decoder_attention_mask": _TARGET_MASK.bool()}, True, _TARGET_MASK.bool()),
        (BatchReader(), {"input_ids": _IDS, "attention_mask": _MASK}, True, None),  # no target mask in this batch
        (BatchReader(), (_IDS, _MASK, _TARGET_MASK), True, None),
        (BatchReader(mask_key="source_mask"), {**_SEQ2SEQ, "source_mask": _MASK}, False, None),  # every layer's
        (BatchReader(mask_key=lambda b: b["attention_mask"]), _SEQ2SEQ, False, None),
        (BatchReader(mask_key=2), (_IDS, _MASK, _TARGET_MASK), False, None),
        (BatchReader(mask_key=False), _SEQ2SEQ, False, None),
    ],
    ids=["default", "named_default", "bool", "absent", "tuple", "own_key", "function", "index", "none"],
)
def test_the_decoder_mask_is_read_under_hugging_faces_names_only(reader, batch, default, expected):
    assert reader.default_mask_lookup is default
    mask = reader.decoder_mask(batch)
    if expected is None:
        assert mask is None
    else:
        assert mask.dtype == torch.bool
        assert torch.equal(mask, expected)


def test_a_decoder_mask_that_is_not_a_mask_is_an_error_saying_where_it_looked():
    with pytest.raises(
        ValueError, match=r"the attention mask at 'decoder_attention_mask' .* values other than 0 and 1"
    ):
        BatchReader().decoder_mask({**_SEQ2SEQ, "decoder_attention_mask": _TARGET_MASK * 2})
    with pytest.raises(ValueError, match=r"at 'decoder_attention_mask' .* must be a \(B, T\) tensor, found a list"):
        BatchReader().decoder_mask({**_SEQ2SEQ, "decoder_attention_mask": [1, 0]})


def test_decoder_layers_are_those_inside_the_decoder_of_a_hugging_face_encoder_decoder():
    from transformers import (
        BartConfig,
        BartForConditionalGeneration,
        GPT2Config,
        GPT2LMHeadModel,
        T5Config,
        T5ForConditionalGeneration,
    )

    net = nn.Module()
    net.t5 = T5ForConditionalGeneration(T5Config(vocab_size=20, d_model=8, d_kv=4, d_ff=16, num_layers=2, num_heads=2))
    net.bart = BartForConditionalGeneration(
        BartConfig(vocab_size=20, d_model=8, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                   decoder_attention_heads=2, encoder_ffn_dim=16, decoder_ffn_dim=16, max_position_embeddings=8)
    )  # fmt: skip
    net.gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=20, n_positions=8, n_embd=8, n_layer=1, n_head=2))
    paths = [
        "t5.encoder.block.0",  # T5's stacks carry their model's is_encoder_decoder: the model's decoder decides
        "t5.encoder",
        "t5.decoder.block.1",
        "t5.decoder.block.1.layer.0.SelfAttention.q",
        "t5.decoder",
        "t5",  # holds both stacks
        "t5.lm_head",  # applied to the decoder's hidden states: the target's tokens
        "bart.model.encoder.layers.0",
        "bart.model.decoder.layers.0",
        "gpt2.transformer.h.0",  # a decoder-only model has no encoder's mask to mistake
        "",
    ]
    expected = ["t5.decoder.block.1", "t5.decoder.block.1.layer.0.SelfAttention.q", "t5.decoder", "t5.lm_head"]
    assert decoder_layers(net, {path or "net": path for path in paths}) == [*expected, "bart.model.decoder.layers.0"]
    assert decoder_layers(net.t5, {"block": "decoder.block.0", "encoder": "encoder.block.0"}) == ["block"]


@pytest.mark.parametrize("mask_key", [True, 1.5, b"mask"])
def test_bad_mask_keys_are_rejected(mask_key):
    with pytest.raises(ValueError, match=r"mask_key must be None \(the 'attention_mask' of a dict batch\), False"):
        BatchReader(mask_key=mask_key)


def test_a_nested_tensor_is_padded_with_zeros():
    """nn.TransformerEncoder's fast path (eval, no grad, padding mask) gives its layers nested tensors."""
    nested = torch.nested.nested_tensor([torch.ones(3, 4), 2 * torch.ones(1, 4)])
    padded = hidden_state(nested)
    assert padded.shape == (2, 3, 4)
    assert torch.equal(padded[1], torch.tensor([[2.0] * 4, [0.0] * 4, [0.0] * 4]))
    assert torch.equal(hidden_state((nested, None)), padded)
    assert torch.equal(hidden_state({"h": nested}, "h"), padded)


# -- torch.compile -----------------------------------------------------------------------------------------------------


class _CountingBackend:
    """A ``torch.compile`` backend counting compilations and calls of compiled code (TorchDynamo's capture and
    guards, which decide whether hooks run, without Inductor's code generation: tens of seconds per model on a CPU)."""

    def __init__(self) -> None:
        self.compiled = self.calls = 0

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: list) -> object:
        self.compiled += 1

        def run(*args: torch.Tensor) -> object:
            self.calls += 1
            return graph.forward(*args)

        return run


def _compiled_mlp() -> tuple[nn.Module, nn.Module, _CountingBackend]:
    torch.compiler.reset()  # TorchDynamo's caches are keyed by code object, which every nn.Sequential shares
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    backend = _CountingBackend()
    return net, torch.compile(net, backend=backend), backend


def test_forward_hooks_fire_in_a_compiled_model_which_is_not_recompiled():
    net, compiled, backend = _compiled_mlp()
    x = torch.randn(4, 6)
    compiled(x)
    assert (backend.compiled, backend.calls) == (1, 1)
    seen: dict[str, torch.Tensor] = {}
    layers = [FeatureLayer("1", "_orig_mod.1"), FeatureLayer("3", "_orig_mod.3")]
    with forward_hooks(compiled, layers, lambda layer, value: seen.setdefault(layer.name, value)):
        compiled(x)
    assert torch.equal(seen["1"], net[1](net[0](x)))
    assert torch.equal(seen["3"], net[3](net[2](seen["1"])))
    assert backend.calls == 1  # the hooked pass ran eagerly
    compiled(x)
    assert (backend.compiled, backend.calls) == (1, 2)  # then the compiled code again, as it was


def test_hooks_added_after_compiling_are_what_torch_compile_never_calls():
    """Why forward_hooks runs compiled code eagerly: TorchDynamo does not guard on hooks absent when it compiled."""
    net, compiled, backend = _compiled_mlp()
    x = torch.randn(4, 6)
    compiled(x)
    calls: list[int] = []
    handle = net[1].register_forward_hook(lambda *_: calls.append(1))
    compiled(x)
    handle.remove()
    assert (calls, backend.calls) == ([], 2)


def test_compiled_code_runs_again_only_when_the_last_hooks_block_closes_in_any_order():
    _, compiled, backend = _compiled_mlp()
    x = torch.randn(4, 6)
    compiled(x)
    seen: list[str] = []
    first = forward_hooks(compiled, [FeatureLayer("1", "_orig_mod.1")], lambda layer, _: seen.append(layer.name))
    second = forward_hooks(compiled, [FeatureLayer("3", "_orig_mod.3")], lambda layer, _: seen.append(layer.name))
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)  # closed before the block opened after it
    compiled(x)
    assert (seen, backend.calls) == (["3"], 1)
    second.__exit__(None, None, None)
    compiled(x)
    assert (seen, backend.calls) == (["3"], 2)


def test_compiled_networks_are_found_and_their_layers_keep_their_eager_names():
    net, compiled, _ = _compiled_mlp()
    wrapper = nn.Sequential(nn.Linear(6, 6), compiled)
    assert compiled_modules(compiled) == [""]
    assert compiled_modules(wrapper) == ["1"]
    assert compiled_modules(net) == []
    in_place = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    in_place[0].compile(backend="eager")
    assert compiled_modules(in_place) == ["0"]
    assert default_layers(compiled) == {"1": "_orig_mod.1", "3": "_orig_mod.3"}
    assert default_layers(wrapper) == {"0": "0", "1.0": "1._orig_mod.0", "1.2": "1._orig_mod.2"}


def test_random_state_kept_restores_every_stream_a_pass_draws_from():
    import random

    import numpy as np

    from rank_lightning.layers import random_state_kept

    data = torch.utils.data.TensorDataset(torch.arange(10))
    loader = torch.utils.data.DataLoader(data, batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(1))
    nested = {"a": [loader]}

    def draws() -> tuple:
        order = [int(i) for batch in loader for i in batch[0]]
        return order, torch.rand(2).tolist(), random.random(), np.random.rand()  # noqa: NPY002

    module = nn.Linear(2, 2)
    torch.manual_seed(0), random.seed(0), np.random.seed(0)  # noqa: NPY002
    expected = draws()
    torch.manual_seed(0), random.seed(0), np.random.seed(0)  # noqa: NPY002
    loader.generator.manual_seed(1)
    with random_state_kept(module, [nested]):
        draws(), draws()
    assert draws() == expected


def test_metrics_of_the_module_are_no_layers():
    import pytorch_lightning as pl
    import torchmetrics

    class _WithMetrics(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(3, 4), nn.ReLU())
            self.val_acc = torchmetrics.classification.MulticlassAccuracy(3)
            self.metrics = torchmetrics.MetricCollection({"f1": torchmetrics.classification.MulticlassF1Score(3)})

    with pytest.raises(ValueError, match=r"unknown layer 'val_acc'; layers are: net, net\.0, net\.1$"):
        select_layers(_WithMetrics(), ["val_acc"])
    with pytest.raises(ValueError, match=r"their types are: Linear, ReLU, Sequential$"):
        select_layers(_WithMetrics(), None, ["MulticlassAccuracy"])
    assert select_layers(_WithMetrics(), ["*"]) == {"net": "net", "net.0": "net.0", "net.1": "net.1"}


class _GPTBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(4), nn.LayerNorm(4)
        self.attn = nn.Sequential(nn.Linear(4, 12), nn.Linear(4, 4))
        self.mlp = nn.Sequential(nn.Linear(4, 16), nn.GELU(), nn.Linear(16, 4))


class _GPT48(nn.Module):
    """GPT-2-shaped: 48 blocks, 484 module names."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(10, 4)
        self.h = nn.ModuleList(_GPTBlock() for _ in range(48))
        self.ln_f = nn.LayerNorm(4)
        self.lm_head = nn.Linear(4, 10)


@pytest.mark.parametrize(
    ("pattern", "start"),
    [
        ("h.48.mlp", "unknown layer 'h.48.mlp'; the closest layers are: h.8.mlp, h.4.mlp, h.47.mlp,"),
        ("h.4?.mpl*", "layer 'h.4?.mpl*' matches nothing that can be monitored; the closest layers are: h.4.mlp,"),
    ],
)
def test_a_bad_pattern_on_a_large_model_gives_a_bounded_message(pattern, start):
    with pytest.raises(ValueError) as error:
        select_layers(_GPT48(), [pattern])
    message = str(error.value)
    assert message.startswith(start)
    top = ", ".join(["wte", "h", *(f"h.{i}" for i in range(36)), "ln_f", "lm_head"])
    assert message.endswith(f"; layers at the top levels are: {top} ... and 444 more")
    assert len(message) < 500


class _Conv48(nn.Module):
    """48 conv blocks and no nn.Linear: no default feature layer and no default head."""

    def __init__(self) -> None:
        super().__init__()
        self.h = nn.ModuleList(nn.Sequential(nn.Conv2d(2, 2, 1), nn.ReLU()) for _ in range(48))


def test_no_default_layer_or_head_of_a_large_model_gives_a_bounded_message() -> None:
    with pytest.raises(ValueError, match=r"name the layer explicitly, submodules at the top levels are: h, h\.0,") as e:
        feature_layer(_Conv48())
    assert str(e.value).endswith("... and 105 more") and len(str(e.value)) < 500
    with pytest.raises(ValueError, match=r"name the head with head=\.\.\. \(module names at the top levels are: h,"):
        classifier_head(_Conv48())
    with pytest.raises(ValueError, match=r"submodules are: 0, 1$"):
        feature_layer(nn.Sequential(nn.Conv2d(2, 2, 1), nn.ReLU()))


class _Blocks(nn.Module):
    """Three blocks applied in a loop, then a head: the blocks are the default layers."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.ReLU()) for _ in range(3))
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@pytest.mark.parametrize("wrap", ["compile", "compile_in_place", "checkpoint_wrapper"])
def test_a_block_wrapped_alone_is_still_one_of_the_blocks(wrap):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = _Blocks()
    if wrap == "compile":  # the wrapper torch.compile returns replaces the block
        model.blocks[0] = torch.compile(model.blocks[0], backend="eager")
    elif wrap == "compile_in_place":
        model.blocks[0].compile(backend="eager")
    else:  # activation checkpointing of some blocks only
        model.blocks[1] = checkpoint_wrapper(model.blocks[1])
    chosen = default_layers(model)
    assert list(chosen) == ["blocks.0", "blocks.1", "blocks.2"] == list(default_layers(_Blocks()))
    hooked = {"compile": "blocks.0", "compile_in_place": "", "checkpoint_wrapper": "blocks.1"}[wrap]
    assert all(path == name for name, path in chosen.items() if name != hooked)
    seen: list[str] = []
    layers = [FeatureLayer(name, path) for name, path in chosen.items()]
    with forward_hooks(model, layers, lambda layer, _: seen.append(layer.name)):
        model(torch.randn(2, 4))
    assert seen == ["blocks.0", "blocks.1", "blocks.2"]  # the wrapped block's hook fires too


def test_the_feature_layer_of_a_compiled_network_has_its_eager_name():
    from rank_lightning.layers import feature_layer

    _, compiled, _ = _compiled_mlp()
    assert feature_layer(compiled) == FeatureLayer("4_input", "_orig_mod.4", "input")  # the input of the last Linear
    assert feature_layer(compiled, "*3") == FeatureLayer("3", "_orig_mod.3")  # a glob: named by the module's name
    assert feature_layer(compiled, "3") == FeatureLayer("3", "_orig_mod.3")
