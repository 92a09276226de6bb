"""Pretrained weights: local state_dict files, torchvision checkpoints and named torchvision weights (no network)."""

import urllib.error

import pytest
import torch
import torchvision

from rank_lightning.models import create_model, list_models, load_pretrained


def _save(tmp_path, state_dict, name="weights.pt"):
    path = tmp_path / name
    torch.save(state_dict, path)
    return str(path)


@pytest.mark.parametrize("name", list_models())
def test_round_trip_through_a_file(name, make_small, tmp_path):
    torch.manual_seed(0)
    source = make_small(name, init="gaussian")  # unlike a fresh model's initialisation, including the head
    path = _save(tmp_path, source.state_dict())
    torch.manual_seed(1)
    loaded = make_small(name, pretrained=path).eval()
    torch.testing.assert_close(loaded.state_dict(), source.state_dict(), rtol=0, atol=0)
    x = torch.randn(2, *source.input_shape)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), source.eval()(x), rtol=0, atol=0)


def test_head_of_another_size_is_dropped_with_a_warning(make_small, tmp_path):
    torch.manual_seed(0)
    source = make_small("vgg11", num_classes=10, init="gaussian")
    path = _save(tmp_path, source.state_dict())
    with pytest.warns(UserWarning, match=r"head .*classifier\.6\.weight \(10, 32\).*num_classes=4"):
        model = make_small("vgg11", num_classes=4, init="asymmetric", pretrained=path)
    state, reference = model.state_dict(), source.state_dict()
    for key in reference:
        if key.startswith("classifier.6."):
            assert state[key].shape[0] == 4
        else:
            torch.testing.assert_close(state[key], reference[key], rtol=0, atol=0)
    assert model.classifier[6].weight.min() >= 0  # the head kept the requested initialisation
    with pytest.warns(UserWarning, match="head"):
        headless = make_small("vgg11", num_classes=0, pretrained=path)
    torch.testing.assert_close(headless.classifier[3].weight, source.classifier[3].weight)


def test_missing_and_unexpected_keys_fail_unless_not_strict(tmp_path):
    torch.manual_seed(0)
    source = create_model("mlp", input_shape=4, depth=2, width=3)
    state = source.state_dict()
    state.pop("layers.1.linear.bias")
    state["layers.2.linear.weight"] = torch.zeros(3, 3)
    path = _save(tmp_path, state)
    with pytest.raises(RuntimeError, match=r"missing: layers\.1\.linear\.bias; unexpected: layers\.2\.linear\.weight"):
        create_model("mlp", input_shape=4, depth=2, width=3, pretrained=path)
    with pytest.warns(UserWarning, match="strict=False skipped"):
        model = create_model("mlp", input_shape=4, depth=2, width=3, pretrained=path, strict=False)
    torch.testing.assert_close(model.layers[1].linear.weight, source.layers[1].linear.weight)


def test_torchvision_checkpoint_file_loads_into_the_imagenet_resnet(tmp_path):
    torch.manual_seed(0)
    reference = torchvision.models.resnet18().eval()
    path = _save(tmp_path, reference.state_dict())
    model = create_model("resnet18", num_classes=1000, image_size=224, pretrained=path).eval()
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x))


def test_imagenet_weights_in_a_cifar_stem_need_strict_false(tmp_path):
    reference = torchvision.models.resnet18()
    path = _save(tmp_path, reference.state_dict())
    with pytest.raises(RuntimeError, match=r"conv1\.weight \(64, 3, 7, 7\) vs \(64, 3, 3, 3\).*strict=False"):
        create_model("resnet18", pretrained=path)
    with pytest.warns(UserWarning) as record:
        model = create_model("resnet18", pretrained=path, strict=False)
    messages = " ".join(str(w.message) for w in record)
    assert "head" in messages and "conv1.weight" in messages
    torch.testing.assert_close(model.layer4[1].conv2.weight, reference.layer4[1].conv2.weight)


def test_lightning_checkpoint_with_backbone_prefix(tmp_path):
    torch.manual_seed(0)
    source = create_model("mlp", input_shape=4, depth=1, width=3)
    state = {f"backbone.{k}": v for k, v in source.state_dict().items()}
    path = _save(tmp_path, {"state_dict": {**state, "criterion.weight": torch.ones(2)}, "epoch": 3}, "last.ckpt")
    model = create_model("mlp", input_shape=4, depth=1, width=3, pretrained=path)
    torch.testing.assert_close(model.state_dict(), source.state_dict())


def test_file_without_a_state_dict_is_rejected(tmp_path):
    path = _save(tmp_path, [torch.zeros(2)])
    with pytest.raises(ValueError, match="does not hold a state_dict"):
        create_model("mlp", pretrained=path)


def test_unknown_source_lists_torchvision_weights():
    with pytest.raises(FileNotFoundError, match=r"'IMAGENET' is neither .* IMAGENET1K_V1, DEFAULT"):
        create_model("resnet18", pretrained="IMAGENET")
    with pytest.raises(FileNotFoundError, match="none for this model"):
        create_model("vit_tiny", pretrained="IMAGENET1K_V1")


@pytest.mark.parametrize("name", ["IMAGENET1K_V1", "DEFAULT", "ResNet18_Weights.IMAGENET1K_V1"])
def test_torchvision_weights_name(name, monkeypatch):
    torch.manual_seed(0)
    reference = torchvision.models.resnet18()
    requested = []

    def fetch(weights, **kwargs):
        requested.append(weights)
        return reference.state_dict()

    monkeypatch.setattr(torchvision.models.ResNet18_Weights, "get_state_dict", fetch)
    model = create_model("resnet18", num_classes=1000, image_size=224, pretrained=name)
    assert requested == [torchvision.models.ResNet18_Weights.IMAGENET1K_V1]
    torch.testing.assert_close(model.state_dict(), reference.state_dict())


def test_download_failure_says_which_file_to_fetch(monkeypatch):
    def offline(weights, **kwargs):
        raise urllib.error.URLError("no network")

    monkeypatch.setattr(torchvision.models.VGG11_Weights, "get_state_dict", offline)
    with pytest.raises(RuntimeError, match=r"could not download .*pretrained='/path/to/vgg11-8a719046\.pth'"):
        load_pretrained(create_model("vgg11"), "IMAGENET1K_V1", torchvision_arch="vgg11")
