import re

import numpy as np
import pytest
import torch
from torch import nn

from rank_lightning.functional.jacobian import (
    Patch,
    capture_block_outputs,
    default_patch_size,
    partial_jacobian,
    partial_jacobian_rank,
    partial_jacobian_ranks,
)

FLOAT32_EPS = float(np.finfo(np.float32).eps)


def _numpy_rank(matrix: torch.Tensor) -> int:
    s = np.linalg.svd(matrix.detach().double().numpy(), compute_uv=False)
    return int((s >= FLOAT32_EPS * min(matrix.shape) * s[0]).sum())


def _reverse_mode(fn, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sub-Jacobian by reverse mode: the Jacobian of v -> fn(x with the masked entries set to v) at v = x[mask]."""
    flat_index = mask.flatten().nonzero().squeeze(1)

    def g(v: torch.Tensor) -> torch.Tensor:
        image = x.flatten().index_put((flat_index,), v).view(1, *x.shape)
        return fn(image).flatten()

    return torch.autograd.functional.jacobian(g, x.flatten()[flat_index], vectorize=True)


def _small_cnn() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(inplace=True),
        nn.Conv2d(8, 8, 3, padding=1, stride=2),
        nn.BatchNorm2d(8),
        nn.ReLU(inplace=True),
        nn.Flatten(),
        nn.Linear(8 * 6 * 6, 10),
    )
    # Non-trivial running statistics, so that eval-mode BatchNorm is not the identity.
    model.train()
    with torch.no_grad():
        model(torch.randn(64, 3, 12, 12) * 2 + 0.5)
    return model


def test_default_patch_size_scales_with_the_image():
    assert default_patch_size(32, 32) == 8
    assert default_patch_size(224, 224) == 16
    assert default_patch_size(28, 28) == 7
    assert default_patch_size(8, 8) == 2
    assert default_patch_size(1, 1) == 1


def test_central_patch_is_centred_and_covers_all_channels():
    patch = Patch.central((3, 32, 32))
    assert (patch.top, patch.left, patch.height, patch.width) == (12, 12, 8, 8)
    mask = patch.mask((3, 32, 32))
    assert int(mask.sum()) == 192
    assert mask[:, 12:20, 12:20].all()
    assert int(Patch(0, 0, 2, 3, channels=(1,)).mask((3, 4, 4)).sum()) == 6


def test_partial_jacobian_of_a_linear_map_is_the_column_sub_matrix():
    torch.manual_seed(0)
    layer = nn.Linear(20, 7)
    x = torch.randn(20)
    jacobian = partial_jacobian(layer, x, torch.tensor([9, 1, 3]))
    torch.testing.assert_close(jacobian, layer.weight.detach()[:, [1, 3, 9]], rtol=0, atol=0)


def test_partial_jacobian_of_a_linear_image_map_with_a_patch():
    torch.manual_seed(1)
    weight = torch.randn(30, 3 * 8 * 8)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 30))
    with torch.no_grad():
        model[1].weight.copy_(weight)
    patch = Patch(top=2, left=3, height=3, width=2)
    mask = patch.mask((3, 8, 8))
    jacobian = partial_jacobian(model, torch.randn(3, 8, 8), patch)
    torch.testing.assert_close(jacobian, weight[:, mask.flatten()])


def test_partial_rank_of_a_known_low_rank_linear_map():
    torch.manual_seed(2)
    weight = torch.randn(40, 5) @ torch.randn(5, 3 * 8 * 8)  # rank 5
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 40, bias=False))
    with torch.no_grad():
        model[1].weight.copy_(weight)
    result = partial_jacobian_rank(model, torch.randn(3, 3, 8, 8))
    assert result.ranks.tolist() == [5, 5, 5]
    assert result.mean == 5.0
    assert (result.num_outputs, result.num_directions) == (40, 12)  # default patch on 8 x 8: 2 x 2 x 3
    # A patch of 2 coordinates sees at most 2 of the 5 dimensions.
    assert partial_jacobian_rank(model, torch.randn(1, 3, 8, 8), torch.tensor([0, 7])).ranks.tolist() == [2]


def test_forward_mode_matches_reverse_mode_on_a_cnn_with_batchnorm():
    model = _small_cnn().eval()
    x = torch.randn(3, 12, 12)
    patch = Patch.central(x.shape, size=4)
    forward = partial_jacobian(model, x, patch)
    reverse = _reverse_mode(model, x, patch.mask(x.shape))
    assert forward.shape == (10, 48)
    torch.testing.assert_close(forward, reverse, rtol=1e-4, atol=1e-5)
    assert partial_jacobian_rank(model, x[None], patch).ranks.item() == _numpy_rank(reverse) == 10


def test_block_ranks_from_one_pass_match_reverse_mode_per_block():
    model = _small_cnn()
    model.train()
    inputs = torch.randn(2, 3, 12, 12)
    patch = Patch.central((3, 12, 12), size=3)
    layers = {"bn1": "1", "block2": "5"}
    result = partial_jacobian_ranks(model, inputs, layers, patch)
    # The model was switched to eval mode for the computation and its training flags restored.
    assert all(m.training for m in model.modules())
    model.eval()
    fn = capture_block_outputs(model, layers)
    mask = patch.mask((3, 12, 12))
    for name in layers:
        expected = [_numpy_rank(_reverse_mode(lambda b, name=name: fn(b)[name], x, mask)) for x in inputs]
        assert result[name].ranks.tolist() == expected
        assert result[name].num_directions == 27
    assert result["bn1"].num_outputs == 8 * 12 * 12
    assert result["block2"].num_outputs == 8 * 6 * 6
    # The block captured before an in-place ReLU is the BatchNorm output itself, not the rectified one.
    bn_jacobian = partial_jacobian(fn, inputs[0], patch)["bn1"]
    torch.testing.assert_close(bn_jacobian, partial_jacobian(model[:2], inputs[0], patch))
    assert (bn_jacobian < 0).any()


def test_eval_switch_restores_mixed_training_flags_and_keeps_running_statistics():
    model = _small_cnn().train()
    model[4].eval()  # a frozen BatchNorm inside a training model must stay frozen
    flags = [m.training for m in model.modules()]
    running = model[1].running_mean.clone()
    inputs = torch.randn(2, 3, 12, 12)
    switched = partial_jacobian_ranks(model, inputs, ["5"])
    assert [m.training for m in model.modules()] == flags
    torch.testing.assert_close(model[1].running_mean, running, rtol=0, atol=0)
    # Without the switch, a training model whose BatchNorms all use their statistics is measured as it is.
    model[1].eval()
    flags = [m.training for m in model.modules()]
    kept = partial_jacobian_ranks(model, inputs, ["5"], eval_mode=False)
    assert [m.training for m in model.modules()] == flags
    assert kept["5"].ranks.tolist() == switched["5"].ranks.tolist()


def test_chunked_directions_give_the_same_jacobian():
    model = _small_cnn().eval()
    x = torch.randn(3, 12, 12)
    torch.testing.assert_close(partial_jacobian(model, x, chunk_size=5), partial_jacobian(model, x))


def test_forward_pass_stops_after_the_last_monitored_block():
    class Forbidden(nn.Module):
        def forward(self, x):
            raise AssertionError("the forward pass went past the last monitored block")

    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), Forbidden())
    result = partial_jacobian_ranks(model, torch.randn(1, 3, 8, 8), ["0", "1"])
    assert list(result) == ["0", "1"]


def test_attention_block_with_tuple_output():
    torch.manual_seed(3)
    attention = nn.MultiheadAttention(8, 2, batch_first=True)

    class Tokens(nn.Module):
        def __init__(self):
            super().__init__()
            self.attention = attention

        def forward(self, x):
            return self.attention(x, x, x)[0]

    model = Tokens()
    x = torch.randn(5, 8)
    jacobian = partial_jacobian_ranks(model, x[None], ["attention"], torch.arange(16))["attention"]
    reverse = torch.autograd.functional.jacobian(lambda v: model(v[None]).flatten(), x).reshape(40, 40)[:, :16]
    assert jacobian.ranks.item() == _numpy_rank(reverse)


def test_bad_arguments_are_rejected():
    model = _small_cnn()
    with pytest.raises(ValueError, match="unknown layer '9'; layers are: 0, 1"):
        partial_jacobian_ranks(model, torch.randn(1, 3, 12, 12), ["9"])
    with pytest.raises(ValueError, match=r"BatchNorm layers \['1', '4'\] are in training mode"):
        partial_jacobian_ranks(model.train(), torch.randn(1, 3, 12, 12), ["0"], eval_mode=False)
    with pytest.raises(ValueError, match="has no blocks"):
        partial_jacobian_ranks(model, torch.randn(1, 3, 12, 12))
    with pytest.raises(ValueError, match="does not fit"):
        Patch(10, 10, 4, 4).mask((3, 12, 12))
    with pytest.raises(ValueError, match="expected"):
        partial_jacobian(model.eval(), torch.randn(3, 12, 12), torch.ones(3, 4, 4, dtype=torch.bool))


def test_a_single_layer_name_string_is_one_layer_not_its_characters():
    # "10" must mean the module "10", not the modules "1" and "0".
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(10)], nn.Linear(4, 2))
    inputs = torch.randn(2, 4)
    ranks = partial_jacobian_ranks(model, inputs, "10")
    assert list(ranks) == ["10"]
    assert ranks["10"].ranks.tolist() == [2, 2]
    assert list(capture_block_outputs(model, "10")(inputs[:1])) == ["10"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, None])
def test_half_precision_jacobian_keeps_the_rank_of_a_known_rank_block(dtype):
    # A rank-3 Linear caps the Jacobian rank at 3; bfloat16/float16 rounding must not be counted as rank.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 24, bias=False), nn.Tanh(), nn.Linear(24, 24))
    with torch.no_grad():
        model[2].weight.copy_(torch.randn(24, 3) @ torch.randn(3, 32))
    inputs = torch.randn(2, 16)
    if dtype is None:  # float32 weights under bfloat16 autocast
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ranks = partial_jacobian_ranks(model, inputs, ["0", "2", "4"])
    else:
        ranks = partial_jacobian_ranks(model.to(dtype), inputs.to(dtype), ["0", "2", "4"])
    assert {name: result.ranks.tolist() for name, result in ranks.items()} == {"0": [16, 16], "2": [3, 3], "4": [3, 3]}


def test_training_dropout_without_eval_switch_is_named():
    model = nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.5), nn.Linear(8, 3), nn.Dropout(0.0)).train()
    inputs = torch.randn(2, 6)
    with pytest.raises(ValueError, match=r"dropout layers \['1'\] are in training mode: .* pass eval_mode=True"):
        partial_jacobian_ranks(model, inputs, ["2"], eval_mode=False)
    # With the switch (the default) dropout is off and the rank is that of the Linear maps.
    assert partial_jacobian_ranks(model, inputs, ["2"])["2"].ranks.tolist() == [3, 3]
    assert model.training and model[1].training


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tolerance_size": "mid"}, "unknown tolerance_size 'mid'; valid choices are: min, max"),
        ({"rank_tolerance": -1.0}, "rank_tolerance must be a positive number or None, got -1.0"),
        ({"chunk_size": 0}, "chunk_size must be a positive integer or None, got 0"),
    ],
)
def test_bad_settings_are_refused_before_any_forward_pass(kwargs, message):
    class Forbidden(nn.Module):
        def forward(self, x):
            raise AssertionError("the model ran before the settings were checked")

    with pytest.raises(ValueError, match=re.escape(message)):
        partial_jacobian_ranks(Forbidden(), torch.randn(1, 4), [""], **kwargs)


def test_every_coordinate_of_a_video_is_refused_before_anything_is_allocated():
    calls = []

    def fn(batch: torch.Tensor) -> torch.Tensor:
        calls.append(batch.shape)
        return batch.flatten(1)

    video = torch.zeros(3, 16, 112, 112)  # (C, T, H, W): K = 602,112 coordinates, a K x K identity of 1.3 TiB
    message = r"K = 602,112 coordinates of inputs of shape \(3, 16, 112, 112\).*1,350.6 GiB"
    with pytest.raises(ValueError, match=message):
        partial_jacobian(fn, video)
    assert calls == []
    # A patch of some pixels of one frame is taken: its Jacobian is the identity's columns at those coordinates.
    patch = torch.zeros(3, 16, 112, 112, dtype=torch.bool)
    patch[:, 8, 50:52, 50:52] = True
    jacobian = partial_jacobian(fn, video, patch)
    assert jacobian.shape == (video.numel(), 12)
    assert torch.equal(jacobian[patch.flatten()], torch.eye(12))
    with pytest.raises(ValueError, match=r"K = 16,385 coordinates.*at most 16,384"):
        partial_jacobian(fn, torch.zeros(16_385))
