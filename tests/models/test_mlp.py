"""MLP: layer maths against NumPy, blocks, options and errors."""

import numpy as np
import pytest
import torch

from rank_lightning.models import MLP, create_model


def _numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().double().numpy()


def test_blocks_and_shapes():
    model = create_model("mlp", input_shape=(1, 28, 28), depth=4, width=32, num_classes=7)
    assert model.blocks() == {"layer1": "layers.0", "layer2": "layers.1", "layer3": "layers.2", "layer4": "layers.3"}
    assert (model.num_features, model.num_classes, model.input_shape) == (32, 7, (1, 28, 28))
    assert model.layers[0].linear.in_features == 784
    assert create_model("mlp", input_shape=20).input_shape == (20,)


def test_linear_network_is_the_product_of_its_weights():
    """With the identity activation, no bias and no BN the MLP is x -> x W_1^T ... W_L^T W_head^T."""
    torch.manual_seed(0)
    model = create_model("mlp", input_shape=6, depth=3, width=5, num_classes=4, activation="identity", bias=False)
    x = torch.randn(8, 6)
    expected = _numpy(x)
    for layer in model.layers:
        expected = expected @ _numpy(layer.linear.weight).T
    expected = expected @ _numpy(model.head.weight).T
    np.testing.assert_allclose(_numpy(model(x)), expected, rtol=1e-5, atol=1e-6)


def test_relu_batch_norm_layer_normalises_before_the_activation():
    torch.manual_seed(0)
    model = create_model("mlp", input_shape=6, depth=2, width=5, batch_norm=True, init="gaussian")
    block = model.layers[0]
    with torch.no_grad():  # a non-trivial affine part shows where BN sits
        block.norm.weight.uniform_(0.5, 2.0)
        block.norm.bias.uniform_(-1.0, 1.0)
        block.linear.bias.uniform_(-1.0, 1.0)
    x = torch.randn(16, 6)
    z = _numpy(x) @ _numpy(block.linear.weight).T + _numpy(block.linear.bias)
    z_hat = (z - z.mean(0)) / np.sqrt(z.var(0) + block.norm.eps)  # training mode: biased batch variance
    expected = np.maximum(z_hat * _numpy(block.norm.weight) + _numpy(block.norm.bias), 0.0)
    np.testing.assert_allclose(_numpy(block(x)), expected, rtol=1e-5, atol=1e-5)


def test_residual_linear_network_is_a_product_of_identity_plus_gamma_w():
    """Daneshmand et al. eq. 6: H_l = prod_k (I + gamma W_k) X for a linear residual network."""
    torch.manual_seed(0)
    gamma = 0.3
    model = create_model(
        "mlp", input_shape=5, depth=3, width=5, activation="identity", bias=False, residual_gamma=gamma
    )
    x = torch.randn(7, 5)
    expected = _numpy(x)
    for layer in model.layers:
        expected = expected @ (np.eye(5) + gamma * _numpy(layer.linear.weight)).T
    np.testing.assert_allclose(_numpy(model.forward_features(x)), expected, rtol=1e-5, atol=1e-6)


def test_residual_skips_the_first_layer_when_the_input_width_differs():
    torch.manual_seed(0)
    model = create_model("mlp", input_shape=3, depth=2, width=4, activation="tanh", residual_gamma=0.5)
    assert model.layers[0].residual_gamma is None
    assert model.layers[1].residual_gamma == 0.5
    x = torch.randn(5, 3)
    h1 = torch.tanh(model.layers[0].linear(x))
    expected = h1 + 0.5 * torch.tanh(model.layers[1].linear(h1))
    torch.testing.assert_close(model.forward_features(x), expected)


@pytest.mark.parametrize(
    ("activation", "reference"),
    [("relu", torch.relu), ("tanh", torch.tanh), ("gelu", torch.nn.functional.gelu), ("identity", lambda z: z)],
)
def test_activations(activation, reference):
    torch.manual_seed(0)
    model = create_model("mlp", input_shape=4, depth=1, width=6, activation=activation)
    x = torch.randn(3, 4)
    torch.testing.assert_close(model.layers[0](x), reference(model.layers[0].linear(x)))


def test_unknown_activation_lists_valid_ones():
    with pytest.raises(ValueError, match=r"unknown activation 'swish'; activations are: relu, tanh, gelu, identity"):
        create_model("mlp", activation="swish")


def test_bias_off_removes_every_bias():
    model = create_model("mlp", input_shape=4, depth=2, width=3, bias=False)
    assert all(not name.endswith("bias") for name, _ in model.named_parameters())


def test_depth_zero_is_a_linear_classifier_on_the_flattened_input():
    model = create_model("mlp", input_shape=(2, 3), depth=0, num_classes=4)
    assert model.blocks() == {"input": "flatten"}
    assert model.num_features == 6
    x = torch.randn(5, 2, 3)
    torch.testing.assert_close(model(x), x.flatten(1) @ model.head.weight.T + model.head.bias)


def test_invalid_sizes_are_rejected():
    with pytest.raises(ValueError, match="depth must be a non-negative integer, got -1"):
        MLP(depth=-1)
