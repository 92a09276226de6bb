import re

import pytest
import torch
from torch import nn

from rank_lightning.layers import (
    BatchReader,
    FeatureLayer,
    capture_features,
    check_layer_types,
    eval_mode,
    feature_layer,
    forward_hooks,
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
        ({"x": torch.ones(2, 3)}, r"cannot find integer class labels at index 1 or one of \['y'.* \(found nothing\)"),
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
        ({"x": torch.ones(2), "y": torch.ones(2).long()}, BatchReader(label_key="t"), r"at 't' in a dict batch"),
        ((torch.ones(2, 3),), BatchReader(label_fn=lambda b: None), r"at label_fn in a tuple batch of length 1"),
        ((torch.ones(2, 3),), BatchReader(label_key=1), r"at 1 in a tuple batch of length 1 \(found nothing\)"),
        (torch.ones(2, 3), BatchReader(label_key="y"), r"at 'y' in a batch of type Tensor \(found nothing\)"),
    ],
    ids=["missing_key", "label_fn", "index_out_of_range", "tensor_batch"],
)
def test_labels_named_explicitly_must_be_found_even_when_not_required(batch, reader, message):
    """An explicit ``label_key`` or ``label_fn`` that finds nothing is a setup error, raised at the first batch."""
    with pytest.raises(ValueError, match=message + r".*; set label_key \(an index for tuples, a key for dicts\)"):
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
        (torch.tensor([[1], [1]]), f"a Tensor torch.int64 of shape (2, 1): {NOT_ONE_HOT}"),
        (torch.tensor([0.5, 1.5]), "a Tensor torch.float32 of shape (2,): float values, not class indices"),
        (torch.tensor([0.0, 1.0]), "a Tensor torch.float32 of shape (2,): float values, not class indices"),
        (torch.tensor([True, False]), "a Tensor torch.bool of shape (2,): boolean values, not class indices"),
        (torch.zeros(2, 4, 4).long(), "a Tensor torch.int64 of shape (2, 4, 4): 3 dimensions, not one label per row"),
    ],
    ids=["soft", "mixup", "two_hot", "column", "regression", "integral_floats", "bool", "mask"],
)
def test_labels_that_are_not_class_labels_are_refused(labels, found):
    batch = {"x": torch.ones(2, 3), "y": labels}
    default = "index 1 or one of ['y', 'label', 'labels', 'target', 'targets']"
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
            "index 1 or one of ['y', 'label', 'labels', 'target', 'targets'] in a dict batch with keys ['x', 'w'] "
            "(found nothing)",
        ),
        (
            BatchReader(),
            (torch.ones(2, 3), torch.ones(2), torch.tensor([0, 1])),
            "index 1 or one of ['y', 'label', 'labels', 'target', 'targets'] in a tuple batch of length 3 "
            "(found a Tensor torch.float32 of shape (2,): float values, not class indices)",
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
