"""Fused projections of more model families (CodeGen, DBRX, ModernBERT, Persimmon, MPT, GPT-NeoX-Japanese, Qwen2-VL's
and SAM's vision encoders; timm's attentions beyond its ViT: BEiT, EVA, Swin, XCiT, Twins, PVT v2, MViT v2, CaiT,
Hiera, TinyViT, EfficientFormer, LeViT, MaxViT, GC ViT, ...): the parts read are the queries, keys and values that the
layer's own forward pass computes, taken where it hands them to SDPA or multiplies them."""

import re

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from rank_lightning.callbacks import WeightRankMonitor
from rank_lightning.weight_matrices import matrices_of
from tests.test_fused_layouts import QKV, _capture_interface, _check, _heads_last, _inputs

transformers = pytest.importorskip("transformers")


def _version(module: object) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", getattr(module, "__version__", "0"))[:3])


# The layouts pinned here are those of the classes as transformers 5 and timm 1.0.31 define them; earlier releases
# (the minimum versions of `make test-min`) lack some of these classes and modules, or build them with other
# arguments, and their layouts are not what these tests check.
_NEEDS_TRANSFORMERS_5 = pytest.mark.skipif(
    _version(transformers) < (5,), reason=f"builds transformers 5 classes, not those of {transformers.__version__}"
)
try:
    import timm as _timm
except ImportError:
    _timm = None
_NEEDS_TIMM_1_0_31 = pytest.mark.skipif(
    _timm is not None and _version(_timm) < (1, 0, 31),
    reason=f"builds timm 1.0.31 classes, not those of {getattr(_timm, '__version__', None)}",
)


class _Matmuls(TorchFunctionMode):
    """Records the operands of every matrix product (``q @ k^T`` and ``attn @ v`` of an attention without SDPA)."""

    def __init__(self) -> None:
        super().__init__()
        self.operands: list = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", None) in ("matmul", "__matmul__"):
            self.operands.append(args[:2])
        return func(*args, **(kwargs or {}))


@_NEEDS_TRANSFORMERS_5
@pytest.mark.parametrize("family", ["CodeGen", "DBRX", "ModernBERT", "Persimmon"])
def test_fused_qkv_parts_of_more_transformers_are_the_states_the_attention_receives(family, monkeypatch):
    torch.manual_seed(0)
    captured: list = []
    attention = _capture_interface(captured, monkeypatch)
    common = dict(vocab_size=11, attn_implementation=attention)
    if family == "CodeGen":  # 4 blocks, each q | v | k: 8 heads of 2
        config = transformers.CodeGenConfig(n_embd=16, n_head=8, n_layer=1, rotary_dim=2, **common)
        model, path = transformers.CodeGenModel(config), "h.0.attn.qkv_proj"
    elif family == "DBRX":  # q (E) | k (G D) | v (G D), 4 query heads, 2 key/value heads
        attn_config = dict(kv_n_heads=2, clip_qkv=100.0, rope_theta=10000.0)
        ffn_config = dict(ffn_hidden_size=8, moe_num_experts=2, moe_top_k=1)
        config = transformers.DbrxConfig(
            d_model=16, n_heads=4, n_layers=1, attn_config=attn_config, ffn_config=ffn_config, **common
        )
        model, path = transformers.DbrxModel(config), "blocks.0.norm_attn_norm.attn.Wqkv"
    elif family == "ModernBERT":  # view(..., 3, heads, head_dim)
        config = transformers.ModernBertConfig(
            hidden_size=12, num_attention_heads=3, intermediate_size=8, num_hidden_layers=1, pad_token_id=0, **common
        )
        model, path = transformers.ModernBertModel(config), "layers.0.attn.Wqkv"
    else:  # per head q | k | v
        config = transformers.PersimmonConfig(
            hidden_size=12,
            num_attention_heads=3,
            intermediate_size=8,
            num_hidden_layers=1,
            qk_layernorm=False,
            **common,
        )
        model, path = transformers.PersimmonModel(config), "layers.0.self_attn.query_key_value"
    model.eval()
    inputs = _inputs(model.get_submodule(path))
    ids = torch.randint(1, 11, (2, 5))
    with torch.no_grad():  # all positions 0: the rotary embeddings leave q and k as projected
        model(ids, position_ids=torch.zeros_like(ids))
    (states,) = captured
    _check(model, path, inputs[0], {part: _heads_last(state) for part, state in zip(QKV, states)})


def _sdpa_states(monkeypatch) -> list:
    """The query, key and value tensors of every ``scaled_dot_product_attention`` call, as the layer passes them."""
    captured: list = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(
        torch.nn.functional,
        "scaled_dot_product_attention",
        lambda q, k, v, *a, **kw: captured.append((q, k, v)) or sdpa(q, k, v, *a, **kw),
    )
    return captured


def _random_biases(layer: nn.Module) -> tuple:
    """Random ``q_bias`` and ``v_bias`` for a layer that holds them apart from its fused projection (BEiT, EVA, Swin
    v2; no key bias); the bias of each of q, k, v."""
    with torch.no_grad():
        layer.q_bias.normal_()
        layer.v_bias.normal_()
    return tuple(torch.cat([layer.q_bias, torch.zeros_like(layer.q_bias), layer.v_bias]).detach().chunk(3))


def _timm_states(case: str, monkeypatch) -> tuple:
    """``(layer, fused child, its input, {part: state})`` of one timm attention: the states that the forward pass
    hands to the attention kernel (or product), laid out ``(..., part width)``, less any bias held apart."""
    timm = pytest.importorskip("timm")
    m, x = timm.models, torch.randn(2, 4, 12)
    sdpa, products = _sdpa_states(monkeypatch), _Matmuls()
    heads = lambda s: s.transpose(-3, -2).flatten(-2)  # noqa: E731  (B, H, N, D) -> (B, N, H * D)
    if case in ("beit", "eva"):  # q | k | v thirds; the biases are parameters of their own, added by F.linear
        if case == "beit":
            layer = m.beit.Attention(12, 3, qkv_bias=True)
        else:
            layer = m.eva.EvaAttention(12, 3, qkv_bias=True, scale_norm=False)
        layer.fused_attn = True
        bias = _random_biases(layer)
        layer(x)
        return layer, "qkv", x, {p: heads(s) - c for p, s, c in zip(QKV, sdpa[0], bias)}
    if case in ("swin-v2", "swin-v2-cr"):  # cosine attention: normalize(q) @ normalize(k)^T, then attn @ v
        if case == "swin-v2":  # q and v biases held apart (none for k)
            layer = m.swin_transformer_v2.WindowAttention(12, (2, 2), 3)
            apart = _random_biases(layer)
        else:
            layer = m.swin_transformer_v2_cr.WindowMultiHeadAttention(12, 3, (2, 2))
            apart = (0, 0, 0)
        with products:
            layer(x)
        (q, kt), (_, v) = products.operands[-2:]
        bias = layer.qkv.bias.detach().chunk(3) if layer.qkv.bias is not None else apart
        q, k, _ = (x @ w.T + c for w, c in zip(layer.qkv.weight.detach().chunk(3), bias))
        normed = lambda s: torch.nn.functional.normalize(s.unflatten(-1, (3, 4)), dim=-1).flatten(-2)  # noqa: E731
        torch.testing.assert_close(heads(products.operands[-2][0]), normed(q), rtol=0, atol=1e-6)  # rows of q, normed
        torch.testing.assert_close(heads(kt.mT), normed(k), rtol=0, atol=1e-6)
        return layer, "qkv", x, {"q_proj": q - apart[0], "k_proj": k, "v_proj": heads(v) - apart[2]}
    if case == "twins":  # one window of 2 x 2 tokens: (B, windows, heads, tokens, D)
        layer = m.twins.LocallyGroupedAttn(12, 3, ws=2)
        layer.fused_attn = True
        layer(x, (2, 2))
        return layer, "qkv", x, {p: heads(s[:, 0]) for p, s in zip(QKV, sdpa[0])}
    if case in ("xcit", "edgenext"):  # q, k: (B, H, D, N), normalized over the tokens; v unchanged
        if case == "xcit":
            layer = m.xcit.XCA(12, 3)
            layer.fused_attn = True
            layer(x)
            (q_seen, k_seen, v_seen), temperature = sdpa[0], layer.temperature
        else:  # (normalize(q) @ normalize(k)^T) * temperature, then attn @ v
            layer = m.edgenext.CrossCovarianceAttn(12, 3)
            with products:
                layer(x)
            (q_seen, kt), (_, v_seen) = products.operands
            k_seen, temperature = kt.mT, 1
        q, k, v = (x @ w.T for w in layer.qkv.weight.detach().split(12))
        tokens_last = lambda s: s.unflatten(-1, (3, 4)).permute(0, 2, 3, 1)  # noqa: E731
        normed = lambda s: torch.nn.functional.normalize(tokens_last(s), dim=-1)  # noqa: E731
        torch.testing.assert_close(q_seen, normed(q) * temperature, rtol=0, atol=1e-6)
        torch.testing.assert_close(k_seen, normed(k), rtol=0, atol=1e-6)
        torch.testing.assert_close(v_seen, tokens_last(v), rtol=0, atol=1e-6)
        return layer, "qkv", x, {"q_proj": q, "k_proj": k, "v_proj": v_seen.permute(0, 3, 1, 2).flatten(2)}
    if case == "diff":  # q, k: 2 H heads of D, cut in two SDPA calls; v: H heads of 2 D
        layer = timm.layers.diff_attention.DiffAttention(12, 3)
        layer.fused_attn = True
        layer(x)
        (q1, k1, v), (q2, k2, _) = sdpa
        q, k = (torch.stack(pair, dim=2).flatten(1, 2) for pair in ((q1, q2), (k1, k2)))
        return layer, "qkv", x, dict(zip(QKV, map(heads, (q, k, v))))
    raise AssertionError(case)


def _timm_product_states(case: str) -> tuple:
    """As :func:`_timm_states`, for timm attentions that multiply their q, k, v without SDPA."""
    timm = pytest.importorskip("timm")
    m, x, products = timm.models, torch.randn(2, 4, 12), _Matmuls()
    heads = lambda s: s.transpose(-3, -2).flatten(-2)  # noqa: E731  (B, H, N, D) -> (B, N, H * D)
    if case in ("convit", "davit-channel", "davit-channel-v2"):
        if case == "convit":  # (q @ k^T) * scale, then attn @ v
            layer = m.convit.MHSA(12, 3)
        elif case == "davit-channel":  # (k * scale)^T @ v, then attn @ q^T
            layer = m.davit.ChannelAttention(12, 3)
        else:  # (q * N^-1/2)^T @ k, then attn @ v^T
            layer = m.davit.ChannelAttentionV2(12, 3)
        with products:
            layer(x)
        (a, c), (_, d) = products.operands
        if case == "convit":
            states = (a, c.mT, d)
        elif case == "davit-channel":
            states = (d.mT, a.mT / layer.scale, c)
        else:
            states = (a.mT * 4**0.5, c, d.mT)
        return layer, "qkv", x, dict(zip(QKV, map(heads, states)))
    if case in ("tiny-vit", "efficientformer"):  # per head q (2) | k (2) | v (4): not thirds
        if case == "tiny-vit":
            layer = m.tiny_vit.Attention(12, key_dim=2, num_heads=3, attn_ratio=2, resolution=(2, 2))
        else:
            layer = m.efficientformer.Attention(12, key_dim=2, num_heads=3, attn_ratio=2, resolution=2)
        layer.fused_attn = False
        layer.eval()  # returns None here
        inputs = _inputs(layer.qkv)
        with products:
            layer(x)
        (q, kt), (_, v) = products.operands[-2:]  # q @ k^T (TinyViT scales q before), then attn @ v
        q = q / layer.scale if case == "tiny-vit" else q
        return layer, "qkv", inputs[0], dict(zip(QKV, map(heads, (q, kt.mT, v))))
    if case in ("mvit-v2", "cait"):  # (q * scale) @ k^T, then attn @ v
        if case == "mvit-v2":
            layer = m.mvitv2.MultiScaleAttention(12, 12, (2, 2), 3, has_cls_token=False, rel_pos_type="", mode="avg")
        else:
            layer = m.cait.TalkingHeadAttn(12, 3, qkv_bias=True)
        with products:
            layer(x, [2, 2]) if case == "mvit-v2" else layer(x)
        (q, kt), (_, v) = products.operands[0], products.operands[-1]
        return layer, "qkv", x, dict(zip(QKV, map(heads, (q / layer.scale, kt.mT, v))))
    if case == "volo-class-kv":  # the class token's query @ k^T, then attn @ v
        layer = m.volo.ClassAttention(12, 3)
        with products:
            layer(x)
        (_, kt), (_, v) = products.operands
        return layer, "kv", x, dict(zip(QKV[1:], map(heads, (kt.mT, v))))
    if case.startswith("gcvit"):  # with use_global: k | v halves, the queries those of the stage
        layer = m.gcvit.WindowAttentionGlobal(12, 3, (2, 2), use_global=case == "gcvit-kv")
        with products:
            layer(x, torch.randn(2, 2, 2, 12)) if case == "gcvit-kv" else layer(x)
        (q, kt), (_, v) = products.operands  # (q * scale) @ k^T, then attn @ v
        states = dict(zip(QKV, map(heads, (q / layer.scale, kt.mT, v))))
        return layer, "qkv", x, states if case == "gcvit" else {p: states[p] for p in QKV[1:]}
    raise AssertionError(case)


TIMM_CASES = ["beit", "eva", "swin-v2", "swin-v2-cr", "twins", "xcit", "edgenext", "diff"]
PRODUCT_CASES = ["convit", "davit-channel", "davit-channel-v2", "tiny-vit", "efficientformer", "mvit-v2", "cait"]
PRODUCT_CASES += ["volo-class-kv", "gcvit", "gcvit-kv"]


@_NEEDS_TIMM_1_0_31
@pytest.mark.parametrize("case", TIMM_CASES + PRODUCT_CASES)
def test_fused_qkv_parts_of_timm_attentions_are_the_states_of_their_forward_pass(case, monkeypatch):
    torch.manual_seed(0)
    layer, child, x, states = _timm_states(case, monkeypatch) if case in TIMM_CASES else _timm_product_states(case)
    model = nn.Module()
    model.attn = layer
    _check(model, f"attn.{child}", x, states, parts=tuple(states))


def _sdpa_layers(case: str) -> tuple:
    """``(layer, fused child, arguments of its forward pass)`` of timm attentions that hand their q, k, v to SDPA
    heads first, tokens in the order of the fused projection's input (``(B, heads, ..., tokens, head_dim)``)."""
    timm = pytest.importorskip("timm")
    m, x, image = timm.models, torch.randn(2, 4, 12), torch.randn(2, 2, 2, 12)
    channels_first = image.permute(0, 3, 1, 2)
    layers = {
        "attention-rope": lambda: (timm.layers.attention.AttentionRope(12, 3), "qkv", (x,)),
        "attention-pool-2d": lambda: (timm.layers.AttentionPool2d(12, 2, head_dim=4), "qkv", (channels_first,)),
        "attention-pool-latent-kv": lambda: (timm.layers.AttentionPoolLatent(12, num_heads=3), "kv", (x,)),
        "davit-window": lambda: (m.davit.WindowAttention(12, (2, 2), 3), "qkv", (x,)),
        "hiera": lambda: (m.hiera.MaskUnitAttention(12, 12, 3), "qkv", (x,)),
        "maxvit": lambda: (m.maxxvit.AttentionCl(12, dim_head=4, head_first=True), "qkv", (x,)),
        "maxvit-thirds": lambda: (m.maxxvit.AttentionCl(12, dim_head=4, head_first=False), "qkv", (x,)),
        "pvt-v2-kv": lambda: (m.pvt_v2.Attention(12, 3, sr_ratio=1), "kv", (x, (2, 2))),
        "swin": lambda: (m.swin_transformer.WindowAttention(12, 3, window_size=(2, 2)), "qkv", (x,)),
        "twins-kv": lambda: (m.twins.GlobalSubSampleAttn(12, 3, sr_ratio=1), "kv", (x, (2, 2))),
        "fastvit": lambda: (m.fastvit.Attention(12, head_dim=4), "qkv", (channels_first,)),
        "hieradet-sam2": lambda: (m.hieradet_sam2.MultiScaleAttention(12, 12, 3), "qkv", (image,)),
        "metaformer": lambda: (m.metaformer.Attention(12, head_dim=4), "qkv", (x,)),
        "nest": lambda: (m.nest.Attention(12, 3), "qkv", (x[:, None],)),
        "vit-relpos": lambda: (m.vision_transformer_relpos.RelPosAttention(12, 3), "qkv", (x,)),
        "vit-sam": lambda: (m.vision_transformer_sam.Attention(12, 3), "qkv", (image,)),
        "volo": lambda: (m.volo.Attention(12, 3), "qkv", (image,)),
    }
    return layers[case]()


SDPA_CASES = ["attention-rope", "attention-pool-2d", "attention-pool-latent-kv", "davit-window", "fastvit", "hiera"]
SDPA_CASES += ["hieradet-sam2", "maxvit", "maxvit-thirds", "metaformer", "nest", "pvt-v2-kv", "swin", "twins-kv"]
SDPA_CASES += ["vit-relpos", "vit-sam", "volo"]


@_NEEDS_TIMM_1_0_31
@pytest.mark.parametrize("case", SDPA_CASES)
def test_fused_parts_of_timm_attentions_are_the_states_they_hand_to_sdpa(case, monkeypatch):
    torch.manual_seed(0)
    layer, child, args = _sdpa_layers(case)
    layer.fused_attn = True
    captured, inputs = _sdpa_states(monkeypatch), _inputs(getattr(layer, child))
    with torch.no_grad():
        layer(*args)
    parts = QKV if child == "qkv" else QKV[1:]  # the queries of a kv layer are a Linear of their own
    states = [state.movedim(1, -2).flatten(-2) for state in captured[0][3 - len(parts) :]]
    if case == "vit-sam":  # (B * heads, tokens, head_dim)
        states = [state.unflatten(0, (2, 3)).movedim(1, -2).flatten(-2) for state in captured[0]]
    model = nn.Module()
    model.attn = layer
    x = inputs[0].reshape(*states[0].shape[:-1], -1)
    _check(model, f"attn.{child}", x, dict(zip(parts, states)), parts=parts)


SAM_LIKE = {  # the attentions of SAM's image encoder, and of the models that took it over
    "SAM": lambda: transformers.models.sam.modeling_sam.SamVisionAttention(
        transformers.SamVisionConfig(hidden_size=12, num_attention_heads=3, use_rel_pos=False), window_size=2
    ),
    "SAM-HQ": lambda: transformers.models.sam_hq.modeling_sam_hq.SamHQVisionAttention(
        transformers.SamHQVisionConfig(hidden_size=12, num_attention_heads=3, use_rel_pos=False), window_size=2
    ),
    "GOT-OCR2": lambda: transformers.models.got_ocr2.modeling_got_ocr2.GotOcr2VisionAttention(
        transformers.GotOcr2VisionConfig(hidden_size=12, num_attention_heads=3, use_rel_pos=False), window_size=2
    ),
    "VitDet": lambda: transformers.models.vitdet.modeling_vitdet.VitDetAttention(
        transformers.VitDetConfig(hidden_size=12, num_attention_heads=3, use_relative_position_embeddings=False)
    ),
    "SegGPT": lambda: transformers.models.seggpt.modeling_seggpt.SegGptAttention(
        transformers.SegGptConfig(hidden_size=12, num_attention_heads=3, use_relative_position_embeddings=False)
    ),
}


@_NEEDS_TRANSFORMERS_5
@pytest.mark.parametrize("family", ["MPT", *SAM_LIKE, "SAM-sdpa", "SAM-HQ-sdpa", "GPTNeoXJapanese"])
def test_fused_qkv_parts_of_attention_layers_of_transformers_are_their_states(family, monkeypatch):
    torch.manual_seed(0)
    x, products = torch.randn(2, 4, 12), _Matmuls()
    if family == "MPT":  # chunk(3); q @ k^T, then attn @ v
        config = transformers.MptConfig(d_model=12, n_heads=3, n_layers=1, vocab_size=11)
        layer = transformers.models.mpt.modeling_mpt.MptAttention(config, 0)
        with products:
            layer(x, position_bias=None)
        (q, kt), (_, v) = products.operands
        states = (q, kt.mT, v)
    elif family in SAM_LIKE:  # view(B, HW, 3, heads, D); (q * scale) @ k^T, then attn @ v, heads in the batch
        layer = SAM_LIKE[family]()
        with products:
            layer(x.unflatten(1, (2, 2)))
        (q, kt), (_, v) = products.operands
        states = [s.unflatten(0, (2, 3)) for s in (q / layer.scale, kt.mT, v)]
    elif family.endswith("-sdpa"):  # the same reshape, then SDPA
        models = transformers.models
        if family == "SAM-sdpa":
            config = transformers.SamVisionConfig(hidden_size=12, num_attention_heads=3, use_rel_pos=False)
            layer = models.sam.modeling_sam.SamVisionSdpaAttention(config, window_size=2)
        else:
            config = transformers.SamHQVisionConfig(hidden_size=12, num_attention_heads=3, use_rel_pos=False)
            layer = models.sam_hq.modeling_sam_hq.SamHQVisionSdpaAttention(config, window_size=2)
        captured = []
        sdpa = torch.nn.functional.scaled_dot_product_attention
        monkeypatch.setattr(
            torch.nn.functional, "scaled_dot_product_attention", lambda *a, **k: captured.append(a) or sdpa(*a, **k)
        )
        layer(x.unflatten(1, (2, 2)))
        states = captured[0]
    else:  # per head q | k | v; positions 0 leave q and k as projected
        config = transformers.GPTNeoXJapaneseConfig(hidden_size=12, num_attention_heads=3, num_hidden_layers=1)
        model = transformers.GPTNeoXJapaneseModel(config).eval()
        layer, captured = model.layers[0].attention, []
        attn = layer._attn
        monkeypatch.setattr(layer, "_attn", lambda q, k, v, *a: captured.append((q, k, v)) or attn(q, k, v, *a))
        ids, inputs = torch.randint(0, 11, (2, 4)), _inputs(layer.query_key_value)
        with torch.no_grad():
            model(ids, position_ids=torch.zeros_like(ids))
        x, states = inputs[0], captured[0]
    model = nn.Module()
    model.attn = layer
    child = "query_key_value" if family == "GPTNeoXJapanese" else ("Wqkv" if family == "MPT" else "qkv")
    _check(model, f"attn.{child}", x, {p: _heads_last(s) for p, s in zip(QKV, states)})


@_NEEDS_TIMM_1_0_31
def test_a_layer_of_these_classes_whose_weight_or_settings_do_not_fit_is_one_matrix_with_a_warning():
    timm = pytest.importorskip("timm")
    beit = timm.models.beit.Attention(12, 3)
    beit.qkv = nn.Linear(12, 35, bias=False)  # not three equal parts
    message = (
        r"attn.qkv: its Attention cuts its output into 3 blocks of equal rows, q_proj \| k_proj \| v_proj, which its "
        r"weight of shape \(35, 12\) does not hold; it is read as one matrix, not as its parts"
    )
    with pytest.warns(UserWarning, match=message):
        (matrix,) = matrices_of("attn.qkv", beit.qkv, parent=beit)
    assert matrix.name == "attn.qkv" and not matrix.is_part
    tiny = timm.models.tiny_vit.Attention(12, key_dim=2, num_heads=3, attn_ratio=2, resolution=(2, 2))
    del tiny.val_dim  # a version of the class that keeps its value width elsewhere
    with pytest.warns(UserWarning, match=r"attn.qkv: its settings \(head size, head counts\) are not found"):
        assert len(matrices_of("attn.qkv", tiny.qkv, parent=tiny)) == 1
    config = transformers.CodeGenConfig(n_embd=16, n_head=8, n_layer=1, rotary_dim=2, vocab_size=11)
    codegen = transformers.models.codegen.modeling_codegen.CodeGenAttention(config, 0)
    codegen.mp_num = 3  # 16 columns do not cut into 3 blocks
    with pytest.warns(UserWarning, match=r"attn.qkv_proj: its settings .* CodeGenAttention"):
        assert len(matrices_of("attn.qkv_proj", codegen.qkv_proj, parent=codegen)) == 1
    # A subclass may cut the output another way: one matrix, as for every fused Linear of no layout named.
    subclass = type("MyAttention", (timm.models.beit.Attention,), {})(12, 3)
    assert len(matrices_of("attn.qkv", subclass.qkv, parent=subclass)) == 1


@_NEEDS_TIMM_1_0_31
def test_levit_fused_projections_are_split_per_head_with_keys_narrower_than_values():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    levit, x, products = timm.models.levit, torch.randn(2, 4, 12), _Matmuls()
    model = nn.Module()  # per head q (2) | k (2) | v (4), and k (2) | v (4) for the downsampling attention
    model.attn = levit.Attention(12, key_dim=2, num_heads=3, attn_ratio=2, resolution=2)
    model.down = levit.AttentionDownsample(12, 16, key_dim=2, num_heads=3, resolution=2)
    model.eval()
    for layer in (model.attn.qkv, model.down.kv):  # the batch norm after the Linear scales its rows: left out
        layer.bn = nn.Identity()
    with products, torch.no_grad():
        model.attn(x)
        model.down(x)
    (q, k), (_, v), (_, k_down), (_, v_down) = products.operands  # q @ k (k: heads, D, tokens), attn @ v
    states = dict(zip(QKV, (q, k.mT, v)))
    _check(model, "attn.qkv.linear", x, {p: _heads_last(s) for p, s in states.items()})
    states = dict(zip(QKV[1:], (k_down.mT, v_down)))
    _check(model, "down.kv.linear", x, {p: _heads_last(s) for p, s in states.items()}, parts=QKV[1:])
    assert [m.name for m in matrices_of("attn.qkv.linear", model.attn.qkv.linear)] == ["attn.qkv.linear"]


@_NEEDS_TRANSFORMERS_5
@pytest.mark.parametrize("family", ["Qwen2-VL", "Qwen2.5-VL", "Qwen3-VL", "GLM-4V", "BLIP-2", "InstructBLIP"])
def test_fused_qkv_parts_of_vision_attentions_of_transformers_are_the_states_they_attend_with(family, monkeypatch):
    torch.manual_seed(0)
    captured: list = []
    implementation, models, x = _capture_interface(captured, monkeypatch), transformers.models, torch.randn(1, 4, 12)
    vision = {  # (tokens, 3, heads, D), rotated by cos 1, sin 0: as projected
        "Qwen2-VL": (transformers.Qwen2VLVisionConfig, models.qwen2_vl.modeling_qwen2_vl.VisionAttention),
        "Qwen2.5-VL": (
            transformers.Qwen2_5_VLVisionConfig,
            models.qwen2_5_vl.modeling_qwen2_5_vl.Qwen2_5_VLVisionAttention,
        ),
        "Qwen3-VL": (transformers.Qwen3VLVisionConfig, models.qwen3_vl.modeling_qwen3_vl.Qwen3VLVisionAttention),
        "GLM-4V": (transformers.Glm4vVisionConfig, models.glm4v.modeling_glm4v.Glm4vVisionAttention),
    }
    if family in vision:
        config_class, layer_class = vision[family]
        config = config_class(embed_dim=12, hidden_size=12, num_heads=3)
        config._attn_implementation = implementation
        layer = layer_class(config)
        layer(x[0], torch.tensor([0, 4]), (torch.ones(4, 4), torch.zeros(4, 4)))
    else:  # BLIP-2's and InstructBLIP's vision encoders: (B, N, 3, heads, D)
        module = models.blip_2.modeling_blip_2 if family == "BLIP-2" else models.instructblip.modeling_instructblip
        config_class = transformers.Blip2VisionConfig if family == "BLIP-2" else transformers.InstructBlipVisionConfig
        config = config_class(hidden_size=12, num_attention_heads=3, qkv_bias=True)
        config._attn_implementation = implementation
        layer = (module.Blip2Attention if family == "BLIP-2" else module.InstructBlipAttention)(config)
        with torch.no_grad():  # random biases (zeros as built)
            layer.qkv.bias.normal_()
        layer(x)
    model = nn.Module()
    model.attn = layer
    _check(model, "attn.qkv", x, {p: _heads_last(s) for p, s in zip(QKV, captured[0])})


@_NEEDS_TRANSFORMERS_5
@pytest.mark.parametrize("family", ["BLIP", "Bark", "DeBERTa"])
def test_fused_qkv_parts_of_eager_attentions_of_transformers_are_the_states_they_multiply(family):
    torch.manual_seed(0)
    x, products, models = torch.randn(2, 4, 12), _Matmuls(), transformers.models
    if family == "BLIP":  # (B, N, 3, heads, D); q @ k^T, then attn @ v
        config = transformers.BlipVisionConfig(hidden_size=12, num_attention_heads=3)
        layer, child = models.blip.modeling_blip.BlipAttention(config), "qkv"
        with products:
            layer(x)
        (q, kt), (_, v) = products.operands
    elif family == "Bark":  # split(E) in three
        config = transformers.BarkSemanticConfig(hidden_size=12, num_heads=3, num_layers=1, bias=True)
        layer, child = models.bark.modeling_bark.BarkSelfAttention(config), "att_proj"
        with products:
            layer(x)
        (q, kt), (_, v) = products.operands
    else:  # per head q | k | v; (q + q_bias) / sqrt(D) @ k^T, then attn @ (v + v_bias)
        config = transformers.DebertaConfig(hidden_size=12, num_attention_heads=3, relative_attention=False)
        layer, child = models.deberta.modeling_deberta.DisentangledSelfAttention(config), "in_proj"
        with torch.no_grad():
            layer.q_bias.normal_()
            layer.v_bias.normal_()
        with products:
            layer(x, torch.ones(2, 1, 4, 4))
        (q, kt), (_, v) = products.operands[:2]
        q, v = q * 2 - layer.q_bias.detach().view(3, 1, 4), v - layer.v_bias.detach().view(3, 1, 4)
    model = nn.Module()
    model.attn = layer
    _check(model, f"attn.{child}", x, {p: _heads_last(s) for p, s in zip(QKV, (q, kt.mT, v))})


def test_the_attention_of_a_torch_transformer_layer_is_split_into_the_states_it_attends_with(monkeypatch):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=12, nhead=3, dim_feedforward=8, dropout=0.0, batch_first=True)
    captured, x = _sdpa_states(monkeypatch), torch.randn(2, 4, 12)
    layer(x)  # with gradients: not the fused fast path, the (B * heads, N, D) states go to SDPA
    monitor = WeightRankMonitor(verbose=False)
    names = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj", "linear1", "linear2"]
    assert monitor.select(layer) == names  # out_proj once, as a part of its attention
    attention = layer.self_attn
    for matrix, state in zip(matrices_of("self_attn", attention)[:3], captured[0]):
        weight, rows = matrix.from_stored(attention.in_proj_weight.detach()), matrix.row_range((36, 12))
        expected = x @ weight.T + attention.in_proj_bias.detach()[rows[0] : rows[1]]
        torch.testing.assert_close(state.detach(), expected.unflatten(-1, (3, 4)).transpose(1, 2), rtol=0, atol=1e-6)
