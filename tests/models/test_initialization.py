"""init_weights: each scheme has its stated distribution, on every layer type and on whole backbones."""

import math

import numpy as np
import pytest
import torch
from scipy import stats
from torch import nn

from rank_lightning.models import INIT_SCHEMES, create_model, init_weights

FAN_IN = 400


def _weights(scheme: str) -> np.ndarray:
    torch.manual_seed(0)
    layer = init_weights(nn.Linear(FAN_IN, 300), scheme)
    assert torch.count_nonzero(layer.bias) == 0
    return layer.weight.detach().double().numpy()


def test_schemes():
    assert INIT_SCHEMES == ("default", "gaussian", "kaiming", "orthogonal", "asymmetric")


def test_gaussian_is_normal_with_variance_one_over_fan_in():
    w = _weights("gaussian").ravel()
    assert stats.kstest(w, stats.norm(scale=1 / math.sqrt(FAN_IN)).cdf).pvalue > 1e-3
    assert stats.kstest(w, stats.norm(scale=1.2 / math.sqrt(FAN_IN)).cdf).pvalue < 1e-6


def test_kaiming_is_normal_with_variance_two_over_fan_in():
    w = _weights("kaiming").ravel()
    assert stats.kstest(w, stats.norm(scale=math.sqrt(2 / FAN_IN)).cdf).pvalue > 1e-3
    assert stats.kstest(w, stats.norm(scale=1 / math.sqrt(FAN_IN)).cdf).pvalue < 1e-6


def test_asymmetric_is_uniform_between_zero_and_two_over_sqrt_fan_in():
    """Daneshmand et al. Sec. 4: U[0, 2/sqrt(d_l)] instead of U[-1/sqrt(d_l), 1/sqrt(d_l)]."""
    w = _weights("asymmetric").ravel()
    high = 2 / math.sqrt(FAN_IN)
    assert w.min() >= 0 and w.max() <= high
    assert w.mean() == pytest.approx(1 / math.sqrt(FAN_IN), rel=0.01)
    assert stats.kstest(w, stats.uniform(loc=0, scale=high).cdf).pvalue > 1e-3


def test_orthogonal_has_unit_singular_values():
    w = _weights("orthogonal")
    np.testing.assert_allclose(np.linalg.svd(w, compute_uv=False), np.ones(300), atol=1e-5)
    np.testing.assert_allclose(w @ w.T, np.eye(300), atol=1e-5)


def test_default_is_pytorch_construction():
    torch.manual_seed(1)
    reference = nn.Linear(30, 20)
    layer = init_weights(nn.Linear(30, 20), "gaussian")
    torch.manual_seed(1)
    init_weights(layer, "default")
    torch.testing.assert_close(layer.state_dict(), reference.state_dict(), rtol=0, atol=0)


def test_default_attention_is_pytorch_construction():
    torch.manual_seed(2)
    reference = nn.MultiheadAttention(12, 3)
    attention = init_weights(nn.MultiheadAttention(12, 3), "asymmetric")
    torch.manual_seed(2)
    init_weights(attention, "default")
    torch.testing.assert_close(attention.state_dict(), reference.state_dict(), rtol=0, atol=0)


def test_convolution_fan_in_is_input_channels_times_kernel():
    torch.manual_seed(0)
    conv = init_weights(nn.Conv2d(16, 64, kernel_size=3, groups=2), "asymmetric")
    fan_in = 8 * 3 * 3
    w = conv.weight.detach()
    assert w.min() >= 0 and w.max() <= 2 / math.sqrt(fan_in)
    assert w.mean().item() == pytest.approx(1 / math.sqrt(fan_in), rel=0.03)
    assert torch.count_nonzero(conv.bias) == 0

    init_weights(conv, "orthogonal")
    matrix = conv.weight.detach().double().reshape(64, -1).numpy()  # out x (in / groups * kh * kw)
    np.testing.assert_allclose(np.linalg.svd(matrix, compute_uv=False), np.ones(64), atol=1e-6)


def test_attention_projections_are_initialised_per_query_key_value_block():
    torch.manual_seed(0)
    attention = init_weights(nn.MultiheadAttention(24, 4), "orthogonal")
    for block in attention.in_proj_weight.detach().double().chunk(3):
        np.testing.assert_allclose(block.numpy() @ block.numpy().T, np.eye(24), atol=1e-6)
    assert torch.count_nonzero(attention.in_proj_bias) == 0
    assert torch.count_nonzero(attention.out_proj.bias) == 0

    separate = init_weights(nn.MultiheadAttention(24, 4, kdim=10, vdim=6), "gaussian")
    assert separate.k_proj_weight.std().item() == pytest.approx(1 / math.sqrt(10), rel=0.1)
    assert separate.v_proj_weight.std().item() == pytest.approx(1 / math.sqrt(6), rel=0.15)


def test_normalisation_layers_are_left_alone():
    model = create_model("vgg11_bn", in_channels=1, image_size=8, init="asymmetric")
    norms = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    assert norms and all(torch.all(m.weight == 1) and torch.all(m.bias == 0) for m in norms)
    convs = [m for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    assert all(m.weight.min() >= 0 for m in convs)


@pytest.mark.parametrize("name", ["resnet18", "vit_tiny"])
def test_schemes_reach_every_weight_matrix_of_a_backbone(name, make_small):
    model = make_small(name, init="asymmetric")
    matrices = [
        p for n, p in model.named_parameters() if p.dim() >= 2 and "pos_embedding" not in n and "token" not in n
    ]
    assert matrices and all(p.min() >= 0 for p in matrices)


def test_unknown_scheme_lists_valid_ones():
    with pytest.raises(
        ValueError, match=r"unknown init scheme 'he'; schemes are: default, gaussian, kaiming, orthogonal, asym"
    ):
        init_weights(nn.Linear(2, 2), "he")
