"""Weight matrices as layers store them: Conv1D read as its transpose, fused q/k/v split, wrapper names removed,
expert stacks read expert by expert as transformers' forward passes use them."""

import importlib

import numpy as np
import pytest
import torch
import transformers
from torch import nn
from transformers.pytorch_utils import Conv1D

from rank_lightning.weight_matrices import (
    FUSED_PARTS,
    GATE_UP_PARTS,
    is_conv1d,
    is_weight_layer,
    logged_name,
    matrices_of,
    parameter_shape,
    unread_stacks,
)


def _experts_class(model: str, name: str) -> type | None:
    """``transformers.models.<model>.modeling_<model>.<name>``, or None where this transformers has none: the stacked
    experts layers exist from transformers 5 on (4.x holds one MLP module per expert)."""
    try:
        return getattr(importlib.import_module(f"transformers.models.{model}.modeling_{model}"), name)
    except (ImportError, AttributeError):
        return None


AriaExperts = _experts_class("aria", "AriaExperts")
GptOssExperts = _experts_class("gpt_oss", "GptOssExperts")
MixtralExperts = _experts_class("mixtral", "MixtralExperts")
NemotronHExperts = _experts_class("nemotron_h", "NemotronHExperts")


def _needs(**classes: type | None) -> pytest.MarkDecorator:
    missing = [name for name, cls in classes.items() if cls is None]
    reason = f"needs transformers' {', '.join(missing)}, not in transformers {transformers.__version__}"
    return pytest.mark.skipif(bool(missing), reason=reason)


def _read(matrices):
    return {m.name: m.from_stored(m.stored()).detach() for m in matrices}


def test_conv1d_is_read_as_the_transpose_of_its_stored_weight():
    torch.manual_seed(0)
    layer = Conv1D(7, 5)  # 5 inputs, 7 outputs: weight (5, 7), y = x W + b
    assert is_conv1d(layer) and is_weight_layer(layer) and not is_conv1d(nn.Linear(5, 7))
    (matrix,) = matrices_of("proj", layer)
    read = matrix.from_stored(matrix.stored())
    assert read.shape == (7, 5) == matrix.shape(tuple(layer.weight.shape))
    # The equivalent nn.Linear computes the same map and has the same (out, in) matrix.
    linear = nn.Linear(5, 7)
    linear.weight.data = read.clone()
    linear.bias.data = layer.bias.data.clone()
    x = torch.randn(3, 5)
    torch.testing.assert_close(linear(x), layer(x))


def test_gpt2_c_attn_splits_into_queries_keys_and_values_side_by_side():
    torch.manual_seed(0)
    embed = 4
    c_attn = Conv1D(3 * embed, embed)
    matrices = matrices_of("h.0.attn.c_attn", c_attn)
    assert [m.name for m in matrices] == [f"h.0.attn.c_attn.{part}" for part in FUSED_PARTS]
    x = torch.randn(2, embed)
    # GPT-2 splits the output of c_attn into q, k, v along the last dimension.
    q, k, v = c_attn(x).split(embed, dim=1)
    for matrix, part, bias in zip(matrices, (q, k, v), c_attn.bias.split(embed)):
        torch.testing.assert_close(x @ matrix.from_stored(matrix.stored()).T + bias, part)
    (whole,) = matrices_of("h.0.attn.c_attn", c_attn, split_fused=False)
    assert whole.name == "h.0.attn.c_attn" and whole.from_stored(whole.stored()).shape == (3 * embed, embed)
    # Cross-attention c_attn holds keys and values only; other Conv1D layers are never split.
    assert [m.name for m in matrices_of("x.c_attn", Conv1D(2 * embed, embed))] == ["x.c_attn.k_proj", "x.c_attn.v_proj"]
    assert [m.name for m in matrices_of("x.c_fc", Conv1D(3 * embed, embed))] == ["x.c_fc"]


@pytest.mark.parametrize("same_width", [True, False])
def test_multihead_attention_projections_match_the_module(same_width):
    torch.manual_seed(0)
    extra = {} if same_width else {"kdim": 3, "vdim": 5}
    attention = nn.MultiheadAttention(6, 2, **extra)
    read = _read(matrices_of("attn", attention))
    assert list(read) == ["attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.out_proj"]
    if same_width:
        expected = attention.in_proj_weight.detach().chunk(3)
        whole = _read(matrices_of("attn", attention, split_fused=False))
        assert list(whole) == ["attn.in_proj", "attn.out_proj"]
        torch.testing.assert_close(whole["attn.in_proj"], attention.in_proj_weight.detach())
    else:
        expected = [getattr(attention, f"{p}_proj_weight").detach() for p in "qkv"]
    for name, block in zip(["attn.q_proj", "attn.k_proj", "attn.v_proj"], expected):
        torch.testing.assert_close(read[name], block)
    torch.testing.assert_close(read["attn.out_proj"], attention.out_proj.weight.detach())


def test_conv_weights_are_reshaped_and_wrapper_segments_leave_the_name():
    conv = nn.Conv2d(3, 4, 3, groups=1)
    (matrix,) = matrices_of("net._fsdp_wrapped_module.0._checkpoint_wrapped_module", conv)
    assert matrix.name == "net.0"
    np.testing.assert_array_equal(matrix.from_stored(conv.weight).detach().numpy(), conv.weight.detach().reshape(4, 27))
    assert matrix.shape((4, 3, 3, 3)) == (4, 27)
    assert logged_name("a._fsdp_wrapped_module.b") == "a.b"
    with pytest.raises(ValueError, match="BatchNorm1d"):
        matrices_of("norm", nn.BatchNorm1d(3))


def _experts(cls, config):
    """A transformers experts layer with its uninitialised stacks filled with seeded Gaussian values."""
    torch.manual_seed(0)
    layer = cls(config)
    with torch.no_grad():
        for param in layer.parameters():
            param.normal_()
    return layer


def _route_all_to(layer, x, expert):
    """The experts layer's own forward pass with every token sent to ``expert`` with weight 1."""
    index = torch.full((x.shape[0], 1), expert)
    return layer(x, index, torch.ones(x.shape[0], 1))


@_needs(AriaExperts=AriaExperts, MixtralExperts=MixtralExperts)
@pytest.mark.parametrize("transposed", [False, True])
def test_concatenated_expert_stacks_split_into_gate_and_up_that_reproduce_the_forward_pass(transposed):
    # Mixtral stores (E, 2I, H) and (E, H, I) for F.linear; Aria stores (E, H, 2I) and (E, I, H) (is_transposed).
    options = dict(hidden_size=8, intermediate_size=6, num_hidden_layers=1, num_attention_heads=2)
    if transposed:
        layer = _experts(AriaExperts, transformers.AriaTextConfig(moe_num_experts=3, **options))
    else:
        layer = _experts(MixtralExperts, transformers.MixtralConfig(num_local_experts=3, **options))
    assert layer.is_transposed is transposed and is_weight_layer(layer) and unread_stacks(layer) == []
    matrices = matrices_of("mlp.experts", layer)
    parts = [*GATE_UP_PARTS, "down_proj"]
    assert [m.name for m in matrices] == [f"mlp.experts.{e}.{part}" for e in range(3) for part in parts]
    read = _read(matrices)
    x = torch.randn(5, 8)
    for e in range(3):
        gate, up, down = (read[f"mlp.experts.{e}.{part}"] for part in parts)
        assert gate.shape == up.shape == (6, 8) and down.shape == (8, 6)
        expected = (nn.functional.silu(x @ gate.T) * (x @ up.T)) @ down.T
        torch.testing.assert_close(_route_all_to(layer, x, e), expected)
    whole = _read(matrices_of("mlp.experts", layer, split_fused=False))
    assert list(whole) == [f"mlp.experts.{e}.{part}" for e in range(3) for part in ("gate_up_proj", "down_proj")]
    torch.testing.assert_close(
        whole["mlp.experts.2.gate_up_proj"], torch.cat([read["mlp.experts.2.gate_proj"], read["mlp.experts.2.up_proj"]])
    )


@_needs(GptOssExperts=GptOssExperts, NemotronHExperts=NemotronHExperts)
def test_interleaved_and_gateless_expert_stacks_are_read_whole():
    # GPT-OSS: (E, H, 2I) with gate and up columns alternating (is_concatenated=False): one matrix per expert.
    config = transformers.GptOssConfig(
        hidden_size=8, intermediate_size=6, num_local_experts=3, num_hidden_layers=1, num_attention_heads=2, head_dim=4
    )
    layer = _experts(GptOssExperts, config)
    read = _read(matrices_of("experts", layer))
    assert list(read) == [f"experts.{e}.{part}" for e in range(3) for part in ("gate_up_proj", "down_proj")]
    assert unread_stacks(layer) == []  # the biases are 2-D
    x = torch.randn(5, 8)
    for e in range(3):
        # The forward pass computes x @ W[e] (+ bias): the (out, in) matrix is W[e]^T.
        torch.testing.assert_close(x @ read[f"experts.{e}.gate_up_proj"].T, x @ layer.gate_up_proj[e].detach())
        torch.testing.assert_close(read[f"experts.{e}.down_proj"], layer.down_proj[e].detach().T)
    # Nemotron-H's experts have no gate (has_gate=False): up_proj (E, I, H) and down_proj (E, H, I).
    gateless = _experts(
        NemotronHExperts, transformers.NemotronHConfig(hidden_size=8, moe_intermediate_size=6, n_routed_experts=3)
    )
    read = _read(matrices_of("experts", gateless))
    assert list(read) == [f"experts.{e}.{part}" for e in range(3) for part in ("up_proj", "down_proj")]
    x = torch.randn(5, 8)
    for e in range(3):
        expected = gateless.act_fn(x @ read[f"experts.{e}.up_proj"].T) @ read[f"experts.{e}.down_proj"].T
        torch.testing.assert_close(_route_all_to(gateless, x, e), expected)


class _UndeclaredStack(nn.Module):
    """Experts in a layout that nothing declares: (E, ?, ?) could be (E, out, in) or (E, in, out)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 6, 5))
        self.cls_token = nn.Parameter(torch.zeros(1, 1, 5))  # a (1, T, D) token is no stack of matrices


@_needs(MixtralExperts=MixtralExperts)
def test_3d_parameters_in_no_declared_layout_are_named_not_read():
    stack = _UndeclaredStack()
    assert is_weight_layer(stack) and matrices_of("moe", stack) == [] and unread_stacks(stack) == ["w"]
    tokens = nn.Module()
    tokens.cls_token = nn.Parameter(torch.zeros(1, 1, 5))
    assert not is_weight_layer(tokens) and not is_weight_layer(nn.Embedding(4, 5))
    # A declared experts layer with a stack it does not declare: the known ones are read, the other is named.
    layer = _experts(
        MixtralExperts, transformers.MixtralConfig(hidden_size=8, intermediate_size=6, num_local_experts=2)
    )
    layer.scales = nn.Parameter(torch.ones(2, 6, 8))
    assert unread_stacks(layer) == ["scales"] and len(matrices_of("experts", layer)) == 2 * 3


def _held_as(layer: nn.Module, attributes, piece) -> dict[str, torch.Tensor]:
    """Replace ``layer.<attribute>`` by what a sharding strategy leaves on a process (``piece(full)``); returns the
    full tensors."""
    full = {}
    for attribute in attributes:
        full[attribute] = getattr(layer, attribute).detach().clone()
        setattr(layer, attribute, piece(full[attribute]))
    return full


def _zero3_placeholder(full: torch.Tensor) -> nn.Parameter:
    # DeepSpeed ZeRO-3 between forward passes: an empty tensor, the full shape in ds_shape.
    param = nn.Parameter(torch.empty(0))
    param.ds_tensor, param.ds_shape = full.flatten()[:3].clone(), full.shape
    return param


def _fsdp1_slice(full: torch.Tensor) -> nn.Parameter:
    # FSDP1 with use_orig_params=True between forward passes: a 1-D slice of the process's shard, marked flattened.
    param = nn.Parameter(full.flatten()[: full.numel() // 2 + 1].clone())
    param._fsdp_flattened = True
    return param


def _fused_layers() -> dict[str, nn.Module]:
    torch.manual_seed(0)
    config = transformers.MixtralConfig(hidden_size=8, intermediate_size=6, num_local_experts=3)
    return {
        "mha": nn.MultiheadAttention(6, 2),
        "h.0.attn.c_attn": Conv1D(18, 6),
        "h.0.crossattention.c_attn": Conv1D(12, 6),
        "experts": _experts(MixtralExperts, config),
    }


def _stored_tensors(layer: nn.Module) -> list[str]:
    if isinstance(layer, nn.MultiheadAttention):
        return ["in_proj_weight"]
    return ["weight"] if isinstance(layer, Conv1D) else ["gate_up_proj", "down_proj"]


@_needs(MixtralExperts=MixtralExperts)
def test_zero3_placeholders_are_split_by_their_full_shape():
    # The q/k/v rows were sized from the empty placeholder ((0, 0), then an empty matrix), c_attn's parts failed to
    # unpack its 1-D shape, and the expert stacks were not seen as 3-D.
    for name, layer in _fused_layers().items():
        expected = _read(matrices_of(name, layer))
        full = _held_as(layer, _stored_tensors(layer), _zero3_placeholder)
        assert parameter_shape(layer, _stored_tensors(layer)[0]) == tuple(full[_stored_tensors(layer)[0]].shape)
        assert is_weight_layer(layer)
        matrices = matrices_of(name, layer)
        assert [m.name for m in matrices] == list(expected)
        for matrix in matrices:  # read from the gathered tensor, as the gather route does
            whole = full[matrix.attribute] if matrix.module is layer else matrix.stored()  # out_proj: held in full
            torch.testing.assert_close(matrix.from_stored(whole), expected[matrix.name])


@_needs(MixtralExperts=MixtralExperts)
def test_fsdp1_flat_slices_take_the_shapes_the_flat_parameter_records():
    for name, layer in _fused_layers().items():
        expected = _read(matrices_of(name, layer))
        full = _held_as(layer, _stored_tensors(layer), _fsdp1_slice)
        shapes = {(id(layer), attribute): tuple(tensor.shape) for attribute, tensor in full.items()}
        matrices = matrices_of(name, layer, shapes=shapes)
        assert [m.name for m in matrices] == list(expected) and is_weight_layer(layer, shapes=shapes)
        for matrix in matrices:
            whole = full[matrix.attribute] if matrix.module is layer else matrix.stored()
            torch.testing.assert_close(matrix.from_stored(whole), expected[matrix.name])
        # Without the records: q/k/v need no shape (MultiheadAttention always holds three parts, c_attn's are read
        # from the nx and nf Conv1D records); the number of experts cannot be known, and the error says what to do.
        assert parameter_shape(layer, _stored_tensors(layer)[0]) is None
        if name == "experts":
            assert is_weight_layer(layer)  # chosen by the default selection, so that the error is seen
            with pytest.raises(ValueError, match=r"MixtralExperts\.gate_up_proj.*FSDP1.*use_orig_params=True.*before"):
                matrices_of(name, layer)
        else:
            assert [m.name for m in matrices_of(name, layer)] == list(expected)
