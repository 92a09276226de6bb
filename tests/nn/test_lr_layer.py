"""The LR-Layer (Sanyal et al. Sec. 3, Alg. 1): identity forward, auxiliary loss, projection, placement."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from rank_lightning.functional import exact_projection, variance_ratio
from rank_lightning.nn import LRLayer, collect_auxiliary_losses, insert_lr_layer, lr_layers


def _random_layer(m: int, rank: int, seed: int = 0, **kwargs) -> LRLayer:
    torch.manual_seed(seed)
    layer = LRLayer(m, rank, **kwargs).double()
    with torch.no_grad():
        layer.weight.copy_(torch.randn(m, m, dtype=torch.float64) / m**0.5)
        layer.bias.copy_(torch.randn(m, dtype=torch.float64))
    layer.enabled = True
    return layer


def _numpy_loss(a: np.ndarray, w_s: np.ndarray, b: np.ndarray, lambda_1: float, lambda_2: float) -> float:
    w = (w_s + w_s.T) / 2
    n = a.shape[0]
    reconstruction = sum(np.sum((w.T @ (a_i + b) - (a_i + b)) ** 2) for a_i in a) / n
    norm = sum(abs(1 - np.linalg.norm(a_i)) for a_i in a) / n
    return lambda_1 * reconstruction + lambda_2 * norm


@pytest.mark.parametrize("enabled", [False, True])
@pytest.mark.parametrize("training", [False, True])
def test_forward_is_identity(enabled: bool, training: bool) -> None:
    layer = _random_layer(12, 3)
    layer.enabled = enabled
    layer.train(training)
    x = torch.randn(5, 3, 2, 2, dtype=torch.float64)
    assert layer(x) is x
    assert (layer.aux_loss is not None) == training
    if training and not enabled:
        # Before switch-on the loss is a zero that still reaches the parameters (for DDP).
        layer.pop_auxiliary_loss().backward()
        assert layer.aux_loss is None
        assert layer.weight.grad is not None and torch.count_nonzero(layer.weight.grad) == 0
    with torch.no_grad():
        layer.aux_loss = None
        assert layer(x) is x
        assert layer.aux_loss is None


def test_loss_matches_the_formula_for_flattened_conv_input() -> None:
    layer = _random_layer(12, 3, lambda_1=0.7, lambda_2=1.3)
    x = torch.randn(6, 3, 2, 2, dtype=torch.float64)
    layer(x)
    a = x.reshape(6, 12).numpy()
    expected = _numpy_loss(a, layer.weight.detach().numpy(), layer.bias.detach().numpy(), 0.7, 1.3)
    assert layer.aux_loss.item() == pytest.approx(expected, rel=1e-12)
    reconstruction = expected - 1.3 * np.mean([abs(1 - np.linalg.norm(r)) for r in a])
    assert layer.last_losses["reconstruction"].item() == pytest.approx(reconstruction / 0.7, rel=1e-10)


def test_loss_treats_the_last_dimension_as_features_without_flatten() -> None:
    layer = _random_layer(8, 2, flatten=False)
    x = torch.randn(3, 5, 8, dtype=torch.float64)  # tokens: 15 samples of 8 features
    layer(x)
    expected = _numpy_loss(x.reshape(15, 8).numpy(), layer.weight.detach().numpy(), layer.bias.detach().numpy(), 1, 1)
    assert layer.aux_loss.item() == pytest.approx(expected, rel=1e-12)


def test_wrong_width_names_both_widths() -> None:
    layer = _random_layer(12, 3)
    with pytest.raises(ValueError, match=r"num_features=12 .* has 10 features"):
        layer(torch.randn(4, 10, dtype=torch.float64))


def test_gradients_reach_the_input_and_match_autograd_of_the_formula() -> None:
    layer = _random_layer(10, 2, lambda_1=0.5, lambda_2=2.0)
    x = torch.randn(7, 10, dtype=torch.float64, requires_grad=True)
    layer(x)
    (grad,) = torch.autograd.grad(layer.pop_auxiliary_loss(), x)
    w = layer.effective_weight.detach()
    b = layer.bias.detach()
    x_ref = x.detach().clone().requires_grad_(True)
    z = x_ref + b
    reference = 0.5 * ((z @ w.T - z) ** 2).sum(1).mean() + 2.0 * (1 - x_ref.norm(dim=1)).abs().mean()
    (expected,) = torch.autograd.grad(reference, x_ref)
    assert grad.abs().max() > 0
    torch.testing.assert_close(grad, expected)


def test_collect_sums_pending_losses_and_clears_them() -> None:
    model = nn.Sequential(_random_layer(6, 2, seed=1), nn.Linear(6, 6).double(), _random_layer(6, 2, seed=2))
    model(torch.randn(4, 6, dtype=torch.float64))
    expected = model[0].aux_loss + model[2].aux_loss
    torch.testing.assert_close(collect_auxiliary_losses(model), expected)
    assert model[0].aux_loss is None and model[2].aux_loss is None
    assert collect_auxiliary_losses(model).item() == 0.0
    assert [name for name, _ in lr_layers(model)] == ["0", "2"]


@pytest.mark.parametrize("projection", ["exact", "nystrom"])
def test_project_sets_a_symmetric_psd_weight_of_rank_k(projection: str) -> None:
    layer = _random_layer(20, 4, projection=projection)
    before = layer.effective_weight.detach().clone()
    layer.project_(torch.Generator().manual_seed(0))
    w = layer.weight.detach()
    torch.testing.assert_close(w, w.T, rtol=0, atol=1e-12)
    assert torch.linalg.eigvalsh(w).min() > -1e-10
    assert torch.linalg.matrix_rank(w, hermitian=True).item() <= 4
    if projection == "exact":
        torch.testing.assert_close(w, exact_projection(before, 4))


def test_bad_arguments_raise() -> None:
    for name in ("lambda_1", "lambda_2"):
        for value in (math.nan, -0.5, math.inf):
            with pytest.raises(ValueError, match=rf"{name} must be a finite number >= 0, got {value!r}"):
                LRLayer(8, 2, **{name: value})
    with pytest.raises(ValueError, match="unknown projection 'svd'; valid projections are: exact, nystrom"):
        LRLayer(8, 2, projection="svd")
    with pytest.raises(ValueError, match=r"rank must be an integer in \[1, num_features=8\]"):
        LRLayer(8, 9)
    # A string such as "false" (a quoted YAML value) is truthy and flattened silently.
    with pytest.raises(ValueError, match="flatten must be True or False, got 'false'"):
        LRLayer(8, 2, flatten="false")
    # The exact projection has no runs to average nor columns to sample: such settings would be ignored.
    with pytest.raises(ValueError, match="num_runs=3 and oversampling=2 set the Nystrom projection; the exact"):
        LRLayer(8, 2, projection="exact", num_runs=3)
    with pytest.raises(ValueError, match="num_runs=1 and oversampling=4 set the Nystrom projection"):
        LRLayer(8, 2, projection="exact", oversampling=4)
    assert LRLayer(8, 2, projection="exact").projection == "exact"


def _backbone() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Sequential(nn.Linear(16, 16), nn.ReLU()), nn.Linear(16, 3))


def test_insert_keeps_the_forward_and_places_the_layer_before_the_submodule() -> None:
    torch.manual_seed(0)
    model = _backbone()
    x = torch.randn(5, 8)
    reference = model(x)
    layer = insert_lr_layer(model, "2.0", LRLayer(16, 4))
    layer.enabled = True
    seen = {}
    model[2][0][1].register_forward_pre_hook(lambda _m, args: seen.setdefault("input", args[0]))
    torch.testing.assert_close(model(x), reference)
    assert layer.aux_loss is not None
    torch.testing.assert_close(seen["input"], torch.relu(model[0](x)))
    message = "unknown submodule 'head'; submodules are: 0, 1, 2, 2.0, 2.0.0, 2.0.1, 2.1, 3"
    with pytest.raises(ValueError, match=re.escape(message)):
        insert_lr_layer(model, "head", LRLayer(16, 4))


def test_insert_in_front_of_a_module_called_with_further_arguments() -> None:
    # A transformer block takes its attention mask (GPT-2's blocks, keyword arguments too); the nn.Sequential put in
    # front of it took one input and raised a TypeError.
    class _Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, mask: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
            return self.linear(x) * mask * scale

    class _Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = _Block()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.block(x, (x > 0).float(), scale=2.0)

    torch.manual_seed(0)
    model, x = _Model(), torch.randn(3, 5, 4)
    reference = model(x)
    layer = insert_lr_layer(model, "block", LRLayer(4, 2, flatten=False))
    layer.enabled = True
    torch.testing.assert_close(model(x), reference)
    assert layer.aux_loss is not None and layer._pending_rows == 15
    assert set(model.state_dict()) == {
        "block.0.weight",
        "block.0.bias",
        "block.0._extra_state",
        "block.1.linear.weight",
        "block.1.linear.bias",
    }


def test_state_dict_round_trip() -> None:
    torch.manual_seed(0)
    model = _backbone()
    layer = insert_lr_layer(model, "3", LRLayer(16, 4, projection="exact"))
    with torch.no_grad():
        layer.weight.copy_(torch.randn(16, 16))
        layer.bias.copy_(torch.randn(16))
    layer.project_()
    layer.enabled = True
    state = model.state_dict()
    assert {"3.0.weight", "3.0.bias", "3.0._extra_state", "3.1.weight", "3.1.bias"} <= set(state)

    torch.manual_seed(1)
    restored = _backbone()
    restored_layer = insert_lr_layer(restored, "3", LRLayer(16, 4, projection="exact"))
    restored.load_state_dict(state)
    assert restored_layer.enabled
    for key, value in restored.state_dict().items():
        if key.endswith("_extra_state"):
            continue
        torch.testing.assert_close(value, state[key])
    x = torch.randn(4, 8)
    torch.testing.assert_close(restored(x), model(x))
    assert collect_auxiliary_losses(restored).item() == pytest.approx(collect_auxiliary_losses(model).item())


def _train_digits(lr_layer: LRLayer | None, seed: int = 0) -> float:
    """Train a 64-128-128-10 ReLU MLP on scikit-learn's digits; return VR_k of the head's input (Sanyal eq. 7)."""
    from sklearn.datasets import load_digits

    x_np, y_np = load_digits(return_X_y=True)
    x = torch.tensor(x_np, dtype=torch.float32) / 16.0
    y = torch.tensor(y_np)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
    if lr_layer is not None:
        insert_lr_layer(model, "4", lr_layer)
        lr_layer.enabled = True
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    order = torch.Generator().manual_seed(seed)
    step = 0
    for _ in range(20):
        for batch in torch.randperm(len(x), generator=order).split(128):
            loss = F.cross_entropy(model(x[batch]), y[batch]) + collect_auxiliary_losses(model)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            for _, layer in lr_layers(model):
                layer.project_(torch.Generator().manual_seed(step))
    with torch.no_grad():
        features = model[:4](x)
    return float(variance_ratio(features, 5))


@pytest.mark.slow
def test_lr_layer_raises_the_variance_ratio_of_its_input() -> None:
    # k = 5 is below the number of classes, so the plain network keeps about 2.2% of its (uncentred) energy outside the
    # top 5 directions. With an LR-Layer of rank 5 the leakage 1 - VR_5 roughly halves (observed over seeds 0-3:
    # ratio 0.53-0.77). The norm constraint alone (lambda_1 = 0) raises the leakage to about 24%, so the reduction
    # comes from the reconstruction loss.
    plain = _train_digits(None)
    for projection in ("nystrom", "exact"):
        with_layer = _train_digits(LRLayer(128, 5, lambda_1=1.0, lambda_2=1.0, projection=projection))
        assert with_layer > plain, projection
        assert 1 - with_layer < 0.8 * (1 - plain), projection


def test_forward_passes_of_one_step_count_every_row_once() -> None:
    # A step that runs each of several training loaders apart gives the loss of one pass over their rows together.
    layer = _random_layer(12, 3, lambda_1=0.7, lambda_2=1.3)
    xa, xb = torch.randn(6, 3, 2, 2, dtype=torch.float64), torch.randn(2, 3, 2, 2, dtype=torch.float64)
    layer(xb)
    alone = layer.pop_auxiliary_loss()
    layer(torch.cat([xa, xb]))
    together, last = layer.pop_auxiliary_loss(), dict(layer.last_losses)
    layer(xa)
    layer(xb)
    torch.testing.assert_close(layer.pop_auxiliary_loss(), together)
    torch.testing.assert_close(layer.last_losses, last)
    a = torch.cat([xa, xb]).reshape(8, 12).numpy()
    expected = _numpy_loss(a, layer.weight.detach().numpy(), layer.bias.detach().numpy(), 0.7, 1.3)
    assert together.item() == pytest.approx(expected, rel=1e-12)
    layer(xb)  # the pending loss was collected: a new step starts
    torch.testing.assert_close(layer.pop_auxiliary_loss(), alone)


@pytest.mark.parametrize("shape", [(0, 3, 2, 2), (0, 12)])
def test_an_empty_batch_adds_nothing_to_the_loss(shape: tuple[int, ...]) -> None:
    # reshape(0, -1) could not size the empty batch, and a mean over no rows was NaN, which reached the weight.
    layer = _random_layer(12, 3, lambda_1=0.7, lambda_2=1.3)
    empty = torch.zeros(shape, dtype=torch.float64)
    assert layer(empty) is empty
    assert layer.pop_auxiliary_loss().item() == 0.0
    x = torch.randn(4, 12, dtype=torch.float64)
    layer(x)
    alone = layer.aux_loss.detach().clone()
    layer(empty)  # a second pass of the same step with no rows leaves the pending loss as it was
    loss = layer.pop_auxiliary_loss()
    assert loss.item() == pytest.approx(alone.item(), rel=1e-15)
    loss.backward()
    assert torch.isfinite(layer.weight.grad).all() and layer.weight.grad.abs().max() > 0


def test_tokens_of_an_empty_sequence_add_nothing_to_the_loss() -> None:
    layer = _random_layer(8, 2, flatten=False)
    layer(torch.zeros(3, 0, 8, dtype=torch.float64))
    loss = layer.pop_auxiliary_loss()
    loss.backward()
    assert loss.item() == 0.0
    assert torch.count_nonzero(layer.weight.grad) == 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_sums_over_the_features_do_not_overflow(dtype: torch.dtype) -> None:
    # 64 features of size about 40: the sum of squares, about 1e5, passes float16's largest value 65504.
    layer = _random_layer(64, 3).to(dtype)
    torch.manual_seed(1)
    x = (40 + torch.randn(5, 64)).to(dtype).requires_grad_(True)
    layer(x)
    loss = layer.pop_auxiliary_loss()
    expected = _numpy_loss(
        x.detach().double().numpy(), layer.weight.detach().double().numpy(), layer.bias.detach().double().numpy(), 1, 1
    )
    assert expected > 65504
    assert loss.item() == pytest.approx(expected, rel=2e-2)  # float16 summed to inf
    assert loss.dtype == torch.float32
    loss.backward()
    assert torch.isfinite(x.grad).all() and torch.isfinite(layer.weight.grad).all()
