import pytest
import torch

from rank_lightning.functional import reduce_activations, weight_as_matrix


def test_matrix_input_is_returned_unchanged() -> None:
    x = torch.randn(5, 7)
    for reduction in ("flatten", "channel", "token", "cls", "mean"):
        assert reduce_activations(x, reduction) is x


def test_conv_reductions() -> None:
    x = torch.randn(2, 3, 4, 5)
    flat = reduce_activations(x, "flatten")
    assert flat.shape == (2, 60)
    assert torch.equal(flat[1], x[1].reshape(-1))
    channel = reduce_activations(x, "channel")
    assert channel.shape == (2 * 4 * 5, 3)
    # Row order: input by input, then position by position; each row holds one position's channel vector.
    expected = torch.stack([x[b, :, i, j] for b in range(2) for i in range(4) for j in range(5)])
    assert torch.equal(channel, expected)
    mean = reduce_activations(x, "mean")
    assert torch.allclose(mean, torch.stack([x[b].reshape(3, -1).mean(1) for b in range(2)]))


def test_token_reductions() -> None:
    x = torch.randn(2, 6, 4)
    assert torch.equal(reduce_activations(x, "flatten"), x.reshape(2, 24))
    tokens = reduce_activations(x, "token")
    assert tokens.shape == (12, 4)
    assert torch.equal(tokens[7], x[1, 1])
    assert torch.equal(reduce_activations(x, "cls"), x[:, 0, :])
    assert torch.allclose(reduce_activations(x, "mean"), x.sum(1) / 6)


def test_invalid_reductions_list_valid_choices() -> None:
    with pytest.raises(ValueError, match=r"unknown reduction 'pool'.*valid choices"):
        reduce_activations(torch.randn(2, 3), "pool")
    with pytest.raises(ValueError, match=r"'token' is not defined for conv.*'channel'"):
        reduce_activations(torch.randn(2, 3, 4, 4), "token")
    with pytest.raises(ValueError, match=r"'channel' is not defined for token.*'cls'"):
        reduce_activations(torch.randn(2, 3, 4), "channel")
    with pytest.raises(ValueError, match="not supported"):
        reduce_activations(torch.randn(2), "flatten")


def test_weight_as_matrix() -> None:
    linear = torch.randn(4, 9)
    assert weight_as_matrix(linear) is linear
    conv = torch.randn(8, 3, 3, 3)
    m = weight_as_matrix(conv)
    assert m.shape == (8, 27)
    assert torch.equal(m[2], conv[2].reshape(-1))
    assert weight_as_matrix(torch.randn(5, 2, 7)).shape == (5, 14)
    with pytest.raises(ValueError, match="at least 2"):
        weight_as_matrix(torch.randn(4))
