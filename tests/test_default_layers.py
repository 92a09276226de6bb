"""The default layer choice on a zoo of user models: the exact choice, and every chosen layer runs once per forward."""

import itertools
from collections.abc import Callable

import pytest
import pytorch_lightning as pl
import torch
import torchvision
from torch import nn

from rank_lightning.layers import FeatureLayer, default_layers, forward_hooks
from rank_lightning.models import create_model

# -- the zoo ---------------------------------------------------------------------------------------------------------


class ModuleDictCNN(nn.Module):
    """Conv blocks kept in an ``nn.ModuleDict`` (never called itself), pooled, then a linear head."""

    def __init__(self) -> None:
        super().__init__()
        widths = (1, 4, 8, 8)
        self.blocks = nn.ModuleDict(
            {
                f"conv{i + 1}": nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1), nn.BatchNorm2d(c_out), nn.ReLU())
                for i, (c_in, c_out) in enumerate(itertools.pairwise(widths))
            }
        )
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 1, 8, 8) -> (B, 10)
        for block in self.blocks.values():
            x = block(x)
        return self.fc(self.pool(x).flatten(1))


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(width, 3 * width)
        self.c_proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, D) -> (B, T, D)
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in self.c_attn(x).split(d, dim=2))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(width, 4 * width)
        self.act = nn.GELU()
        self.c_proj = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class GPTBlock(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = MLP(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPTModel(nn.Module):
    """Hugging Face's layout: token and position embeddings, blocks in ``h`` (a ModuleList), a final LayerNorm."""

    def __init__(self, vocab: int = 50, context: int = 8, width: int = 16, heads: int = 2, layers: int = 3) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(context, width)
        self.drop = nn.Dropout(0.0)
        self.h = nn.ModuleList([GPTBlock(width, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(width)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, D)
        x = self.drop(self.wte(ids) + self.wpe(torch.arange(ids.shape[1])))
        for block in self.h:
            x = block(x)
        return self.ln_f(x)


class GPTLMHeadModel(nn.Module):
    """The language-model wrapper: ``transformer`` beside an untied ``lm_head``."""

    def __init__(self) -> None:
        super().__init__()
        self.transformer = GPTModel()
        self.lm_head = nn.Linear(16, 50, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, vocab)
        return self.lm_head(self.transformer(ids))


class SparseMoE(nn.Module):
    """A router and top-1 routed experts held as ``experts``, an ``nn.ModuleList`` (``transformers`` 4.x Mixtral's
    and Qwen2-MoE's layout): each expert is called on the tokens routed to it."""

    def __init__(self, width: int, experts: int = 4) -> None:
        super().__init__()
        self.gate = nn.Linear(width, experts, bias=False)
        self.experts = nn.ModuleList([MLP(width) for _ in range(experts)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, D) -> (B, T, D)
        flat = x.reshape(-1, x.shape[-1])
        chosen, out = self.gate(flat).argmax(-1), torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            out[chosen == e] = expert(flat[chosen == e])
        return out.view_as(x)


class MoEModel(GPTModel):
    """A decoder whose blocks' MLP is a :class:`SparseMoE`: the experts hold most weight layers of each block."""

    def __init__(self) -> None:
        super().__init__(layers=2)
        for block in self.h:
            block.mlp = SparseMoE(16)


class SharedActivationMLP(nn.Module):
    """One ``self.act`` applied after both hidden layers: choosing it would hook one module that runs twice."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(self.act(self.fc2(self.act(self.fc1(x)))))


class LinearListMLP(nn.Module):
    """Hidden layers in a ModuleList run by a loop with a shared functional-style activation, head outside."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 8)])
        self.act = nn.Tanh()
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = self.act(layer(x))
        return self.out(x)


class PlainCNN(nn.Module):
    """VGG-like: convolutions in ``features``, a two-layer classifier; no repeated blocks, only layers."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(4, 8, 3, padding=1), nn.ReLU()
        )
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(8 * 4 * 4, 16), nn.ReLU(), nn.Linear(16, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 1, 8, 8) -> (B, 10)
        return self.classifier(self.features(x))


class FunctionalLeNet(nn.Module):
    """Activations applied with ``torch.relu``: the weight layers except the head are the hidden layers."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(1, 4, 3, padding=1), nn.Conv2d(4, 8, 3, padding=1)
        self.fc1, self.fc2 = nn.Linear(8 * 8 * 8, 16), nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 1, 8, 8) -> (B, 10)
        x = torch.relu(self.conv2(torch.relu(self.conv1(x))))
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


class AttentionPool(nn.Module):
    """An ``nn.MultiheadAttention`` between linear layers: its ``out_proj`` is never called as a module."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.fc = nn.Linear(8, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # (B, T, 4) -> (B, 3)
        x = self.embed(tokens)
        return self.fc(self.attn(x, x, x)[0].mean(1))


class ConvUnit(nn.Module):
    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(c_in, c_out, 3, padding=1), nn.BatchNorm2d(c_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.conv(x)))


class WideBlock(nn.Module):
    """Two parallel branches, concatenated."""

    def __init__(self, c_in: int) -> None:
        super().__init__()
        self.left, self.right = ConvUnit(c_in, 2), ConvUnit(c_in, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.left(x), self.right(x)], dim=1)


class DeepBlock(WideBlock):
    """The same branches one after the other (another class, as Inception's blocks are)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x[:, :2], self.right(self.left(x)[:, :4].repeat(1, 2, 1, 1))], dim=1)


class InceptionLike(nn.Module):
    """Stem units, then blocks of two classes: no single run holds half of the weight layers, all runs together do."""

    def __init__(self) -> None:
        super().__init__()
        self.stem1, self.stem2 = ConvUnit(1, 4), ConvUnit(4, 4)
        self.wide1, self.wide2 = WideBlock(4), WideBlock(4)
        self.reduce = nn.MaxPool2d(2)
        self.deep1, self.deep2 = DeepBlock(4), DeepBlock(4)
        self.fc = nn.Linear(4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 1, 8, 8) -> (B, 10)
        x = self.wide2(self.wide1(self.stem2(self.stem1(x))))
        x = self.deep2(self.deep1(self.reduce(x)))
        return self.fc(x.mean((2, 3)))


class DenseStage(nn.ModuleDict):
    """A ModuleDict with a forward of its own (torchvision's DenseNet blocks): called, so it can be a block."""

    def __init__(self, channels: int) -> None:
        super().__init__({"unit1": ConvUnit(channels, channels), "unit2": ConvUnit(channels, channels)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for unit in self.values():
            x = x + unit(x)
        return x


class DenseNetLike(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(1, 4, 3, padding=1)
        self.stages = nn.Sequential(DenseStage(4), DenseStage(4), DenseStage(4))
        self.fc = nn.Linear(4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 1, 8, 8) -> (B, 10)
        return self.fc(self.stages(self.stem(x)).mean((2, 3)))


class Classifier(pl.LightningModule):
    """A user's LightningModule: the network in ``self.net``, a loss module and no ``blocks()``."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net
        self.criterion = nn.CrossEntropyLoss()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _resnet_trunk() -> nn.Module:
    model = torchvision.models.resnet18(num_classes=10)
    model.fc = nn.Identity()  # a feature extractor: layer4 is now the last module with parameters
    return model


def _torchvision_vit() -> nn.Module:
    return torchvision.models.VisionTransformer(8, 4, num_layers=2, num_heads=2, hidden_dim=16, mlp_dim=32)


def _transformer_encoder() -> nn.Module:
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 3, enable_nested_tensor=False)


def _sequence_first_encoder() -> nn.Module:
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0)  # (T, B, D), PyTorch's default layout
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


# Hugging Face models from configs with random weights (nothing downloaded); transformers is imported when built.


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=3, n_head=2, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def _bert() -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=3, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=16, num_labels=3,
    )  # fmt: skip
    return BertForSequenceClassification(config)


def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=16, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def _roberta() -> nn.Module:
    from transformers import RobertaConfig, RobertaForSequenceClassification

    config = RobertaConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=16, num_labels=3,
    )  # fmt: skip
    return RobertaForSequenceClassification(config)


def _distilbert() -> nn.Module:
    from transformers import DistilBertConfig, DistilBertForSequenceClassification

    config = DistilBertConfig(vocab_size=50, dim=16, n_layers=2, n_heads=2, hidden_dim=32, max_position_embeddings=16)
    return DistilBertForSequenceClassification(config)


def _decoder_only(name: str) -> Callable[[], nn.Module]:
    """Llama-style causal language models of one family (``"Mistral"``, ``"Qwen2"``, ``"GPTNeoX"``)."""

    def make() -> nn.Module:
        import transformers

        config = getattr(transformers, f"{name}Config")(
            vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=16, bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
        return getattr(transformers, f"{name}ForCausalLM")(config)

    return make


def _hugging_face_vit() -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(
        hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32, image_size=8, patch_size=4,
        num_labels=3,
    )  # fmt: skip
    return ViTForImageClassification(config)


def _vit_blocks(model: nn.Module) -> list[str]:
    """The paths of the ViT's two ``ViTLayer`` blocks, as this transformers names them: ``vit.layers.<i>`` from
    transformers 5 on, ``vit.encoder.layer.<i>`` before."""
    blocks = [path for path, module in model.named_modules() if type(module).__name__ == "ViTLayer"]
    assert blocks in (["vit.layers.0", "vit.layers.1"], ["vit.encoder.layer.0", "vit.encoder.layer.1"])
    return blocks


def _tokens() -> torch.Tensor:
    return torch.randint(0, 50, (2, 8))


IMAGE = (2, 1, 8, 8)
RESNET_LAYERS = ["layer1", "layer2", "layer3", "layer4"]

# name: (model factory, input factory, expected default choice (module paths, in order, or read from the model))
ZOO: dict[
    str,
    tuple[Callable[[], nn.Module], Callable[[], torch.Tensor], list[str] | Callable[[nn.Module], list[str]]],
] = {
    "module_dict_cnn": (ModuleDictCNN, lambda: torch.randn(IMAGE), ["blocks.conv1", "blocks.conv2", "blocks.conv3"]),
    "hugging_face_gpt": (
        GPTLMHeadModel,
        lambda: torch.randint(0, 50, (2, 8)),
        ["transformer.h.0", "transformer.h.1", "transformer.h.2"],
    ),
    "transformer_encoder": (_transformer_encoder, lambda: torch.randn(2, 5, 16), ["layers.0", "layers.1", "layers.2"]),
    "transformer_encoder_sequence_first": (
        _sequence_first_encoder,
        lambda: torch.randn(5, 2, 16),
        ["layers.0", "layers.1"],
    ),
    "transformers_gpt2": (_gpt2, _tokens, ["transformer.h.0", "transformer.h.1", "transformer.h.2"]),
    "transformers_bert": (_bert, _tokens, ["bert.encoder.layer.0", "bert.encoder.layer.1", "bert.encoder.layer.2"]),
    "routed_experts": (MoEModel, _tokens, ["h.0", "h.1"]),  # not the experts, which see only their tokens
    "transformers_llama": (_llama, _tokens, ["model.layers.0", "model.layers.1"]),
    "transformers_roberta": (_roberta, _tokens, ["roberta.encoder.layer.0", "roberta.encoder.layer.1"]),
    "transformers_distilbert": (
        _distilbert,
        _tokens,
        ["distilbert.transformer.layer.0", "distilbert.transformer.layer.1"],
    ),
    "transformers_mistral": (_decoder_only("Mistral"), _tokens, ["model.layers.0", "model.layers.1"]),
    "transformers_qwen2": (_decoder_only("Qwen2"), _tokens, ["model.layers.0", "model.layers.1"]),
    "transformers_gpt_neox": (_decoder_only("GPTNeoX"), _tokens, ["gpt_neox.layers.0", "gpt_neox.layers.1"]),
    "transformers_vit": (_hugging_face_vit, lambda: torch.randn(2, 3, 8, 8), _vit_blocks),
    "torchvision_vit": (
        _torchvision_vit,
        lambda: torch.randn(2, 3, 8, 8),
        ["encoder.layers.encoder_layer_0", "encoder.layers.encoder_layer_1"],
    ),
    "torchvision_resnet": (
        lambda: torchvision.models.resnet18(num_classes=10),
        lambda: torch.randn(2, 3, 32, 32),
        RESNET_LAYERS,
    ),
    "torchvision_resnet_trunk": (_resnet_trunk, lambda: torch.randn(2, 3, 32, 32), RESNET_LAYERS),
    "inception_like": (
        InceptionLike,
        lambda: torch.randn(IMAGE),
        ["stem1", "stem2", "wide1", "wide2", "deep1", "deep2"],
    ),
    "dense_net_like": (DenseNetLike, lambda: torch.randn(IMAGE), ["stages.0", "stages.1", "stages.2"]),
    "sequential_mlp": (
        lambda: nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3)),
        lambda: torch.randn(2, 6),
        ["1", "3"],
    ),
    "shared_activation": (SharedActivationMLP, lambda: torch.randn(2, 6), ["fc1", "fc2"]),
    "linear_list": (LinearListMLP, lambda: torch.randn(2, 6), ["layers.0", "layers.1", "layers.2"]),
    "plain_cnn": (PlainCNN, lambda: torch.randn(IMAGE), ["features.1", "features.4", "classifier.2"]),
    "functional_lenet": (FunctionalLeNet, lambda: torch.randn(IMAGE), ["conv1", "conv2", "fc1"]),
    "attention_pool": (AttentionPool, lambda: torch.randn(2, 5, 4), ["embed", "attn"]),
    "lightning_module": (
        lambda: Classifier(ModuleDictCNN()),
        lambda: torch.randn(IMAGE),
        ["net.blocks.conv1", "net.blocks.conv2", "net.blocks.conv3"],
    ),
    "lightning_module_mlp": (
        lambda: Classifier(nn.Sequential(nn.Flatten(), nn.Linear(64, 8), nn.GELU(), nn.Linear(8, 10))),
        lambda: torch.randn(IMAGE),
        ["net.2"],
    ),
}


def _calls(model: nn.Module, paths: list[str], x: torch.Tensor) -> dict[str, int]:
    calls = dict.fromkeys(paths, 0)

    def count(layer: FeatureLayer, _: object) -> None:
        calls[layer.path] += 1

    with torch.no_grad(), forward_hooks(model, [FeatureLayer(path, path) for path in paths], count):
        model.eval()(x)
    return calls


@pytest.mark.parametrize("name", list(ZOO))
def test_the_default_is_the_repeated_blocks_and_each_runs_once(name):
    torch.manual_seed(0)
    make_model, make_input, expected = ZOO[name]
    model = make_model()
    if callable(expected):
        expected = expected(model)
    chosen = default_layers(model)
    assert list(chosen.values()) == expected
    assert list(chosen) == expected  # a foreign model's layers are named by their module path
    assert _calls(model, expected, make_input()) == dict.fromkeys(expected, 1)


# -- the package's backbones inside a user's LightningModule -----------------------------------------------------------

BACKBONES = {
    "mlp": {"input_shape": (1, 8, 8), "depth": 3, "width": 16},
    "resnet18": {"in_channels": 1, "image_size": 8},
    "vgg11": {"in_channels": 1, "image_size": 8, "classifier_width": 16},
    "vit_tiny": {"in_channels": 1, "image_size": 8, "num_layers": 3, "hidden_dim": 24, "mlp_dim": 48},
}


@pytest.mark.parametrize("name", list(BACKBONES))
def test_a_wrapped_backbone_brings_its_blocks(name):
    backbone = create_model(name, **BACKBONES[name])
    model = Classifier(backbone)
    expected = {block: f"net.{path}" for block, path in backbone.blocks().items()}
    assert default_layers(model) == expected
    assert default_layers(backbone) == backbone.blocks()
    assert len(expected) >= 3  # rank against depth has several points
    assert _calls(model, list(expected.values()), torch.randn(IMAGE)) == dict.fromkeys(expected.values(), 1)


def test_blocks_of_the_module_itself_win():
    class WithBlocks(ModuleDictCNN):
        def blocks(self) -> dict[str, str]:
            return {"last": "blocks.conv3"}

    assert default_layers(WithBlocks()) == {"last": "blocks.conv3"}
    assert default_layers(Classifier(WithBlocks())) == {"last": "net.blocks.conv3"}


def test_a_small_repeated_part_does_not_hide_the_layers_of_the_network():
    """Two tiny blocks in a projector hold few of the weight layers: the network's activations are chosen."""
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3), nn.ReLU(), nn.Flatten(),
        nn.Sequential(nn.Linear(16, 8), nn.ReLU()), nn.Sequential(nn.Linear(8, 8), nn.ReLU()), nn.Linear(8, 2),
    )  # fmt: skip
    assert list(default_layers(model)) == ["1", "3", "5", "7.1", "8.1"]


def test_a_model_without_layers_to_choose_gets_an_empty_choice():
    assert default_layers(nn.Linear(3, 2)) == {}
    assert default_layers(nn.Sequential(nn.Linear(3, 2))) == {"0": "0"}


def test_an_encoder_decoder_gets_the_layers_of_both_stacks():
    """T5's encoder and decoder are two blocks of one kind; their layers give depth more than two points."""
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(vocab_size=50, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=3, num_heads=2)
    model = T5ForConditionalGeneration(config)
    expected = ["encoder.block.0", "encoder.block.1", "decoder.block.0", "decoder.block.1", "decoder.block.2"]
    assert list(default_layers(model)) == expected
    calls = dict.fromkeys(expected, 0)

    def count(layer: FeatureLayer, _: object) -> None:
        calls[layer.path] += 1

    with torch.no_grad(), forward_hooks(model, [FeatureLayer(path, path) for path in expected], count):
        model.eval()(input_ids=_tokens(), decoder_input_ids=_tokens()[:, :5])
    assert calls == dict.fromkeys(expected, 1)


def _bart() -> nn.Module:
    from transformers import BartConfig, BartForConditionalGeneration

    config = BartConfig(
        vocab_size=50, d_model=16, encoder_layers=2, decoder_layers=3, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=16,
    )  # fmt: skip
    return BartForConditionalGeneration(config)


def _marian() -> nn.Module:
    from transformers import MarianConfig, MarianMTModel

    config = MarianConfig(
        vocab_size=50, d_model=16, encoder_layers=2, decoder_layers=3, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=16,
        pad_token_id=0, decoder_start_token_id=0,
    )  # fmt: skip
    return MarianMTModel(config)


def _torch_transformer() -> nn.Module:
    return nn.Transformer(16, 2, num_encoder_layers=2, num_decoder_layers=3, dim_feedforward=32, batch_first=True)


def _run_seq2seq(model: nn.Module) -> None:
    if isinstance(model, nn.Transformer):
        model(torch.randn(2, 6, 16), torch.randn(2, 5, 16))
    else:
        model(input_ids=_tokens(), decoder_input_ids=_tokens()[:, :5])


@pytest.mark.parametrize(
    ("make_model", "encoder", "decoder"),
    [
        (_bart, "model.encoder.layers", "model.decoder.layers"),
        (_marian, "model.encoder.layers", "model.decoder.layers"),
        (_torch_transformer, "encoder.layers", "decoder.layers"),
    ],
    ids=["bart", "marian", "nn_transformer"],
)
def test_an_encoder_and_a_decoder_of_two_classes_are_both_chosen(make_model, encoder, decoder):
    """BART's, Marian's and ``nn.Transformer``'s encoder and decoder layers are of two classes: as stacks side by side
    they are blocks of one kind, so the encoder is not left out for the decoder, whose layers hold more weights."""
    torch.manual_seed(0)
    model = make_model()
    expected = [f"{encoder}.{i}" for i in range(2)] + [f"{decoder}.{i}" for i in range(3)]
    assert list(default_layers(model)) == expected
    assert list(default_layers(Classifier(model))) == [f"net.{path}" for path in expected]
    calls = dict.fromkeys(expected, 0)

    def count(layer: FeatureLayer, _: object) -> None:
        calls[layer.path] += 1

    with torch.no_grad(), forward_hooks(model, [FeatureLayer(path, path) for path in expected], count):
        _run_seq2seq(model.eval())
    assert calls == dict.fromkeys(expected, 1)


def test_the_two_towers_of_a_dual_encoder_are_both_chosen():
    """CLIP's text and vision towers are stacks side by side: neither holds half of the weight layers, so each
    alone was no choice and the default fell back to every weight layer."""
    from transformers import CLIPConfig, CLIPModel

    tower = {"hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 32}
    config = CLIPConfig(
        text_config={**tower, "vocab_size": 50, "max_position_embeddings": 16},
        vision_config={**tower, "image_size": 8, "patch_size": 4},
        projection_dim=8,
    )
    model = CLIPModel(config)
    expected = [f"{tower}_model.encoder.layers.{i}" for tower in ("text", "vision") for i in range(2)]
    assert list(default_layers(model)) == expected
    calls = dict.fromkeys(expected, 0)

    def count(layer: FeatureLayer, _: object) -> None:
        calls[layer.path] += 1

    with torch.no_grad(), forward_hooks(model, [FeatureLayer(path, path) for path in expected], count):
        model.eval()(input_ids=_tokens(), pixel_values=torch.randn(2, 3, 8, 8))
    assert calls == dict.fromkeys(expected, 1)


def test_the_package_vit_brings_its_transformer_blocks():
    vit = create_model("vit_tiny", **BACKBONES["vit_tiny"])
    chosen = default_layers(vit)
    assert list(chosen.values())[:3] == [f"encoder.layers.encoder_layer_{i}" for i in range(3)]
    assert _calls(vit, list(chosen.values()), torch.randn(IMAGE)) == dict.fromkeys(chosen.values(), 1)
