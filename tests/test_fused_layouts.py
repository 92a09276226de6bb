"""Fused projections of real models (GPT-NeoX, Bloom, Falcon, Phi-3, GPT-BigCode, timm's ViT): the parts that
WeightRankMonitor reads are the queries, keys, values (gates, ups) that the model's own forward pass computes."""

import json
import socket
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from rank_lightning.callbacks import WeightRankMonitor
from rank_lightning.weight_matrices import matrices_of, parent_layer
from tests.fused_sharded_helpers import attention_layer

transformers = pytest.importorskip("transformers")

try:  # attention implementations registered by name: later transformers than the lowest supported (4.43)
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
except ImportError:
    AttentionInterface = ALL_ATTENTION_FUNCTIONS = None

QKV = ("q_proj", "k_proj", "v_proj")


def _capture_interface(captured: list, monkeypatch) -> str:
    """An attention implementation, registered for this test only, that records the query, key and value states it
    is given (per head, before any repetition of grouped keys), then computes as ``sdpa`` does."""

    def capture(module, query, key, value, *args, **kwargs):
        captured.append((query, key, value))
        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, *args, **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, "rank_lightning_capture", capture)
    return "rank_lightning_capture"


def _recorded(module: nn.Module, method: str, captured: list, monkeypatch) -> None:
    """Record what ``module.<method>`` (the model's own split of the fused output) returns."""
    original = getattr(module, method)
    monkeypatch.setattr(module, method, lambda *a, **k: captured.append(original(*a, **k)) or captured[-1])


def _inputs(layer: nn.Linear) -> list:
    inputs: list = []
    layer.register_forward_pre_hook(lambda _, args: inputs.append(args[0].detach()))
    return inputs


def _check(model: nn.Module, path: str, x: torch.Tensor, states: dict, parts=QKV) -> None:
    """Every part's ``x W^T + b`` equals the state the forward pass computed (heads flattened as the model's
    ``(..., heads * head_dim)``), the monitor names and measures exactly those parts, ``split_fused=False`` one."""
    modules = dict(model.named_modules())
    layer = modules[path]
    matrices = matrices_of(path, layer, parent=parent_layer(path, modules))
    assert [m.name for m in matrices] == [f"{path}.{part}" for part in parts]
    monitor = WeightRankMonitor(layers=[path], verbose=False)
    spectra = monitor.spectra(model)
    assert list(spectra) == [m.name for m in matrices]
    for matrix, part in zip(matrices, parts):
        weight = matrix.from_stored(layer.weight.detach())
        bias = 0 if layer.bias is None else matrix.from_stored(layer.bias.detach()[:, None])[:, 0]
        torch.testing.assert_close(x @ weight.T + bias, states[part], rtol=0, atol=1e-6)
        exact = torch.linalg.svdvals(weight.double())
        torch.testing.assert_close(spectra[matrix.name].singular_values, exact, rtol=1e-8, atol=1e-12)
    assert WeightRankMonitor(layers=[path], split_fused=False, verbose=False).select(model) == [path]


def _heads_last(state: torch.Tensor) -> torch.Tensor:
    """``(B, heads, T, head_dim)`` -> ``(B, T, heads * head_dim)``."""
    return state.transpose(1, 2).flatten(2)


@pytest.mark.skipif(
    AttentionInterface is None,
    reason=f"needs transformers' AttentionInterface, not in transformers {transformers.__version__}",
)
@pytest.mark.parametrize("family", ["GPTNeoX", "Phi3", "GPTBigCode-mha", "GPTBigCode-mqa"])
def test_fused_qkv_parts_are_the_states_the_attention_receives(family, monkeypatch):
    torch.manual_seed(0)
    captured: list = []
    attention = _capture_interface(captured, monkeypatch)
    common = dict(num_hidden_layers=1, vocab_size=11, attn_implementation=attention)
    if family == "GPTNeoX":  # per head: q | k | v, interleaved head by head
        config = transformers.GPTNeoXConfig(hidden_size=12, num_attention_heads=3, intermediate_size=8, **common)
        model, path = transformers.GPTNeoXModel(config), "layers.0.attention.query_key_value"
    elif family == "Phi3":  # q | k | v with 4 query heads and 2 key/value heads
        config = transformers.Phi3Config(
            hidden_size=16, num_attention_heads=4, num_key_value_heads=2, intermediate_size=6, pad_token_id=0, **common
        )
        model, path = transformers.Phi3Model(config), "layers.0.self_attn.qkv_proj"
    else:  # an nn.Linear named c_attn: per head q | k | v, or multi-query q | k | v of E, head_dim, head_dim
        multi_query = family.endswith("mqa")
        config = transformers.GPTBigCodeConfig(n_embd=12, n_head=3, n_inner=8, multi_query=multi_query, **common)
        model, path = transformers.GPTBigCodeModel(config), "h.0.attn.c_attn"
    model.eval()
    inputs = _inputs(model.get_submodule(path))
    ids = torch.randint(0, 11, (2, 5))
    with torch.no_grad():  # all positions 0: the rotary embeddings (GPT-NeoX, Phi-3) leave q and k as projected
        model(ids, position_ids=torch.zeros_like(ids))
    (states,) = captured
    _check(model, path, inputs[0], {part: _heads_last(state) for part, state in zip(QKV, states)})


@pytest.mark.parametrize("variant", ["bloom", "falcon-mha", "falcon-mqa", "falcon-gqa"])
def test_fused_qkv_parts_are_the_heads_the_model_splits(variant, monkeypatch):
    torch.manual_seed(0)
    captured: list = []
    if variant == "bloom":  # view(B, T, heads, 3, head_dim)
        config = transformers.BloomConfig(hidden_size=12, n_head=3, n_layer=1, vocab_size=11)
        model, path = transformers.BloomModel(config), "h.0.self_attention.query_key_value"
        # transformers 5's _reshape; 4.x's _split_heads gives (B, T, heads, head_dim) as Falcon's does.
        split = "_reshape" if hasattr(model.get_submodule(path.rsplit(".", 1)[0]), "_reshape") else "_split_heads"
    else:
        options = {
            "falcon-mha": dict(multi_query=False, new_decoder_architecture=False, num_kv_heads=3),
            "falcon-mqa": dict(multi_query=True, new_decoder_architecture=False),
            "falcon-gqa": dict(new_decoder_architecture=True, num_attention_heads=6, num_kv_heads=2),
        }[variant]
        options = {"num_attention_heads": 3, **options}
        config = transformers.FalconConfig(hidden_size=12, num_hidden_layers=1, vocab_size=11, bias=True, **options)
        model, path, split = transformers.FalconModel(config), "h.0.self_attention.query_key_value", "_split_heads"
    model.eval()
    attention = model.get_submodule(path.rsplit(".", 1)[0])
    _recorded(attention, split, captured, monkeypatch)
    inputs = _inputs(attention.query_key_value)
    with torch.no_grad():
        model(torch.randint(0, 11, (2, 5)))
    states = captured[0]
    if split == "_reshape":  # (B, heads, T, head_dim)
        states = [_heads_last(state) for state in states]
    elif variant == "falcon-gqa":  # (B, T, heads, head_dim), each group's key and value broadcast to its queries
        group = config.num_attention_heads // config.num_kv_heads
        states = [states[0].flatten(2)] + [state[:, :, ::group].flatten(2) for state in states[1:]]
    else:  # (B, T, heads, head_dim); multi-query: one key and one value head
        states = [state.flatten(2) for state in states]
    _check(model, path, inputs[0], dict(zip(QKV, states)))


def test_phi3_gate_up_proj_parts_are_the_chunks_of_its_mlp():
    torch.manual_seed(0)
    config = transformers.Phi3Config(
        hidden_size=8, num_attention_heads=2, intermediate_size=6, num_hidden_layers=1, vocab_size=11, pad_token_id=0
    )
    model = transformers.Phi3Model(config).eval()
    path = "layers.0.mlp.gate_up_proj"
    mlp = model.layers[0].mlp
    inputs, outputs = _inputs(mlp.gate_up_proj), _inputs(mlp.down_proj)
    with torch.no_grad():
        model(torch.randint(0, 11, (2, 5)))
    gate = matrices_of(path, mlp.gate_up_proj, parent=mlp)[0].from_stored(mlp.gate_up_proj.weight.detach())
    up = mlp.gate_up_proj.weight.detach()[6:]
    # The down projection's input is up * act(gate): the gate rows are the first half, the up rows the second.
    torch.testing.assert_close(outputs[0], (inputs[0] @ up.T) * mlp.activation_fn(inputs[0] @ gate.T))
    _check(
        model,
        path,
        inputs[0],
        dict(zip(("gate_proj", "up_proj"), (inputs[0] @ gate.T, inputs[0] @ up.T))),
        parts=("gate_proj", "up_proj"),
    )


def test_timm_vit_qkv_parts_are_the_states_of_its_attention(monkeypatch):
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.models.vision_transformer.VisionTransformer(
        img_size=16, patch_size=8, embed_dim=12, depth=1, num_heads=3, num_classes=0, qkv_bias=True
    ).eval()
    path = "blocks.0.attn.qkv"
    attention = model.blocks[0].attn
    attention.fused_attn = True
    captured: list = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(
        torch.nn.functional,
        "scaled_dot_product_attention",
        lambda q, k, v, **kw: captured.append((q, k, v)) or sdpa(q, k, v, **kw),
    )
    inputs = _inputs(attention.qkv)
    with torch.no_grad():
        model(torch.randn(2, 3, 16, 16))
    _check(model, path, inputs[0], {part: _heads_last(state) for part, state in zip(QKV, captured[0])})


@pytest.mark.slow
def test_timm_vit_attention_of_earlier_timm_releases_is_split_as_well():
    # timm 1.0.3 (the lowest supported) defines its ViT's Attention in timm.models.vision_transformer, not
    # timm.layers.attention: its qkv was read as one (3E, E) matrix, with no warning.
    attention = type("Attention", (nn.Module,), {"__module__": "timm.models.vision_transformer"})()
    attention.num_heads, attention.head_dim, attention.qkv = 3, 4, nn.Linear(12, 36)
    matrices = matrices_of("blocks.0.attn.qkv", attention.qkv, parent=attention)
    assert [m.name for m in matrices] == [f"blocks.0.attn.qkv.{part}" for part in QKV]
    weight = attention.qkv.weight.detach()
    for matrix, rows in zip(matrices, weight.chunk(3)):
        torch.testing.assert_close(matrix.from_stored(weight), rows, rtol=0, atol=0)


@pytest.mark.parametrize("family", ["GPTNeoX", "Phi3", "GPTBigCode"])
@pytest.mark.parametrize("implementation", ["SdpaAttention", "FlashAttention2"])
def test_the_attention_subclasses_of_transformers_4_are_split_as_their_base(family, implementation):
    # transformers 4.x builds GPTNeoXSdpaAttention (its default attn_implementation) or ...FlashAttention2, not
    # GPTNeoXAttention: their fused projections were read as one (3E, E) matrix, with no warning.
    module = {"GPTNeoX": "gpt_neox", "Phi3": "phi3", "GPTBigCode": "gpt_bigcode"}[family]
    child = {"GPTNeoX": "query_key_value", "Phi3": "qkv_proj", "GPTBigCode": "c_attn"}[family]
    cls = type(
        f"{family}{implementation}", (nn.Module,), {"__module__": f"transformers.models.{module}.modeling_{module}"}
    )
    attention = cls()  # 3 heads of 4, as many keys and values: the settings each forward pass reads
    attention.head_size = attention.head_dim = 4
    attention.num_heads = attention.num_key_value_heads = 3
    attention.config = SimpleNamespace(num_attention_heads=3)
    attention.is_cross_attention = attention.multi_query = False
    setattr(attention, child, nn.Linear(12, 36))
    layer = getattr(attention, child)
    matrices = matrices_of(f"attn.{child}", layer, parent=attention)
    assert [m.name for m in matrices] == [f"attn.{child}.{part}" for part in QKV]
    weight = layer.weight.detach()
    # Phi-3: all queries, keys, values; the others per head q | k | v, (heads, part, head_dim, in).
    parts = weight.chunk(3) if family == "Phi3" else weight.view(3, 3, 4, 12).unbind(1)
    for matrix, rows in zip(matrices, parts):
        torch.testing.assert_close(matrix.from_stored(weight), rows.reshape(12, 12), rtol=0, atol=0)


@pytest.mark.slow
def test_fused_parts_of_dtensor_shards_equal_those_of_the_whole_weights(tmp_path):
    from tests.fused_sharded_helpers import worker

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(worker, args=(port, str(tmp_path / "out.json")), nprocs=2)
    results = json.loads((tmp_path / "out.json").read_text())
    expected = {f"{layer}.query_key_value.{part}" for layer in ("neox", "neox_cols", "falcon") for part in QKV}
    assert expected | {f"phi3.qkv_proj.{part}" for part in QKV} <= set(results["plain"])
    for sharding in ("gram", "gather"):  # rows cut through heads, parts and Falcon's groups; columns split
        assert list(results[sharding]) == list(results["plain"])
        for name, values in results["plain"].items():
            # The Gram route leaves an absolute error of about sqrt(eps64) * s_1 on the smallest values.
            sharded = torch.tensor(results[sharding][name])
            torch.testing.assert_close(sharded, torch.tensor(values), rtol=0, atol=1e-7 * max(values))


def _neox_attention() -> nn.Module:
    from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXAttention

    torch.manual_seed(0)
    return attention_layer(GPTNeoXAttention, transformers.GPTNeoXConfig(hidden_size=12, num_attention_heads=3))


def test_fused_parts_of_fsdp1_slices_and_zero3_placeholders_are_found_from_the_full_shape():
    names = [f"attention.query_key_value.{part}" for part in QKV]
    for held in ("fsdp1", "fsdp1-unrecorded", "zero3"):
        attention = _neox_attention()
        layer, full = attention.query_key_value, attention.query_key_value.weight.detach().clone()
        expected = [m.from_stored(full) for m in matrices_of("attention.query_key_value", layer, parent=attention)]
        if held == "zero3":  # an empty placeholder carrying the full shape
            layer.weight = nn.Parameter(torch.empty(0))
            layer.weight.ds_shape = full.shape
        else:  # FSDP1 with use_orig_params=True between forward passes: a 1-D slice of this process's shard
            layer.weight = nn.Parameter(full.flatten()[:100].clone())
            layer.weight._fsdp_flattened = True
        shapes = {(id(layer), "weight"): tuple(full.shape)} if held == "fsdp1" else None
        # Without the flat parameter's record, the rows come from the Linear's out_features and in_features.
        matrices = matrices_of("attention._fsdp_wrapped_module.query_key_value", layer, shapes=shapes, parent=attention)
        assert [m.name for m in matrices] == names
        assert [m.shape(tuple(full.shape)) for m in matrices] == [(12, 12)] * 3
        for matrix, rows in zip(matrices, expected):  # read from the gathered weight, as the gather route does
            torch.testing.assert_close(matrix.from_stored(full), rows, rtol=0, atol=0)


def test_a_fused_layout_whose_rows_do_not_match_the_layer_is_one_matrix():
    attention = _neox_attention()
    attention.query_key_value = nn.Linear(12, 30)  # not 3 * heads * head_size rows: no layout is known
    message = (
        r"attention.query_key_value: its GPTNeoXAttention cuts its output into q_proj \(4\) \| k_proj \(4\) \| "
        r"v_proj \(4\) rows in every block of 12 rows, which its weight of shape \(30, 12\) does not hold; it is "
        r"read as one matrix, not as its parts"
    )
    with pytest.warns(UserWarning, match=message):
        (matrix,) = matrices_of("attention.query_key_value", attention.query_key_value, parent=attention)
    assert matrix.name == "attention.query_key_value" and not matrix.is_part
    del attention.head_size  # a version of the class that keeps its head size elsewhere
    unread = (
        r"a.query_key_value: its settings \(head size, head counts\) are not found .* GPTNeoXAttention, so its parts"
    )
    with pytest.warns(UserWarning, match=unread):
        assert len(matrices_of("a.query_key_value", nn.Linear(12, 36), parent=attention)) == 1
    # A subclass may cut the output another way, and a Linear of that name elsewhere holds no known parts.
    subclass = attention_layer(type("MyAttention", (type(_neox_attention()),), {}), attention.config)
    assert len(matrices_of("a.query_key_value", subclass.query_key_value, parent=subclass)) == 1
    assert len(matrices_of("a.query_key_value", subclass.query_key_value, parent=nn.Module())) == 1


def test_a_lora_layer_on_a_fused_projection_is_split_as_its_base_layer():
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    config = transformers.GPTNeoXConfig(hidden_size=12, num_attention_heads=3, num_hidden_layers=1, vocab_size=11)
    settings = peft.LoraConfig(r=2, target_modules=["query_key_value"], init_lora_weights=False)
    model = peft.get_peft_model(transformers.GPTNeoXModel(config), settings)
    path = "base_model.model.layers.0.attention.query_key_value"
    names = [f"{path}.{part}" for part in QKV]
    monitor = WeightRankMonitor(layers=[path], decomposition="svd", verbose=False)
    spectra = monitor.spectra(model)
    assert list(spectra) == names + [f"{name}.lora_update" for name in names]
    layer = model.get_submodule(path)
    merged = layer.base_layer.weight.detach() + layer.get_delta_weight("default")
    for i, name in enumerate(names):  # rows of head h's q, k or v: [12 h + 4 i, 12 h + 4 i + 4)
        rows = merged.reshape(3, 12, 12)[:, 4 * i : 4 * i + 4].reshape(12, 12).double()
        torch.testing.assert_close(spectra[name].singular_values, torch.linalg.svdvals(rows), rtol=1e-10, atol=0)


def test_the_parent_layer_skips_the_wrappers_of_compile_fsdp_and_checkpointing():
    attention = _neox_attention()
    wrapped = nn.Module()  # FSDP1 around the attention, a checkpoint wrapper around its projection
    wrapped._fsdp_wrapped_module = attention
    projection = attention.query_key_value
    attention.query_key_value = nn.Module()
    attention.query_key_value._checkpoint_wrapped_module = projection
    model = nn.Module()
    model._orig_mod = nn.Sequential(wrapped)
    modules = dict(model.named_modules())
    path = "_orig_mod.0._fsdp_wrapped_module.query_key_value._checkpoint_wrapped_module"
    assert parent_layer(path, modules) is attention
    assert parent_layer("_orig_mod.0._fsdp_wrapped_module", modules) is None  # a layer at the top of the model
    assert [m.name for m in matrices_of(path, projection, parent=attention)] == [f"0.query_key_value.{p}" for p in QKV]
