import pytest
from torch import nn

from rank_lightning.callbacks.layers import check_layer_types, match_layer_names, match_layer_types, module_blocks


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
