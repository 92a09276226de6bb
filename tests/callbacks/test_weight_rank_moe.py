"""WeightRankMonitor on a tiny Mixtral (``transformers`` 5.x config, random weights): every expert of the fused 3-D
stacks measured on its own, gate and up split, chosen by name, pattern or type; a stack in no known layout named."""

import math
import warnings

import pytest
import pytorch_lightning as pl
import torch
import transformers
from torch import nn
from transformers import MixtralConfig, MixtralForCausalLM
from transformers.models.mixtral import modeling_mixtral

from rank_lightning.callbacks import WeightRankMonitor

# transformers 4.x holds Mixtral's experts as one MLP module per expert, not MixtralExperts' 3-D stacks.
needs_mixtral_experts = pytest.mark.skipif(
    not hasattr(modeling_mixtral, "MixtralExperts"),
    reason=f"needs transformers' MixtralExperts, not in transformers {transformers.__version__}",
)

HIDDEN, INTERMEDIATE, EXPERTS, LAYERS = 16, 24, 4, 2
PARTS = ("gate_proj", "up_proj", "down_proj")


class MoELanguageModel(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        config = MixtralConfig(
            vocab_size=40,
            hidden_size=HIDDEN,
            intermediate_size=INTERMEDIATE,
            num_hidden_layers=LAYERS,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=EXPERTS,
            num_experts_per_tok=2,
        )
        self.model = MixtralForCausalLM(config)


@pytest.fixture(scope="module")
def module():
    return MoELanguageModel()


def _expert_names(layer: int) -> list[str]:
    return [f"model.model.layers.{layer}.mlp.experts.{e}.{part}" for e in range(EXPERTS) for part in PARTS]


def _expected_matrices(module: MoELanguageModel) -> dict[str, torch.Tensor]:
    """Every expert's matrices sliced from the stored stacks as Mixtral's forward pass uses them (F.linear of
    ``gate_up_proj[e]``, chunked into gate and up, then of ``down_proj[e]``), in float64."""
    matrices = {}
    for layer in range(LAYERS):
        experts = module.model.model.layers[layer].mlp.experts
        for e in range(EXPERTS):
            gate, up = experts.gate_up_proj[e].detach().double().chunk(2)
            down = experts.down_proj[e].detach().double()
            for part, matrix in zip(PARTS, (gate, up, down)):
                matrices[f"model.model.layers.{layer}.mlp.experts.{e}.{part}"] = matrix
    return matrices


@needs_mixtral_experts
def test_the_default_choice_reads_every_expert_of_every_layer(module):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing in Mixtral is left unread
        names = WeightRankMonitor(verbose=False).select(module)
    for layer in range(LAYERS):
        experts = _expert_names(layer)
        assert [name for name in names if ".mlp.experts." in name and f"layers.{layer}." in name] == experts
        for projection in ("q_proj", "k_proj", "v_proj", "o_proj"):
            assert f"model.model.layers.{layer}.self_attn.{projection}" in names
    assert "model.lm_head" in names
    assert len(names) == LAYERS * (EXPERTS * len(PARTS) + 4) + 1


@needs_mixtral_experts
def test_expert_metrics_equal_float64_svdvals_of_each_experts_slice(module):
    monitor = WeightRankMonitor(decomposition="svd", tail_ranks=(1, 5), verbose=False)
    spectra, measured = monitor.spectra(module), monitor.measure(module)
    for name, matrix in _expected_matrices(module).items():
        s = torch.linalg.svdvals(matrix)
        spectrum = spectra[name]
        assert (spectrum.num_samples, spectrum.num_features) == tuple(matrix.shape)
        torch.testing.assert_close(spectrum.singular_values, s, rtol=1e-12, atol=0)
        p = s / s.sum()
        expected = {
            "numerical_rank": float((s >= torch.finfo(torch.float32).eps * min(matrix.shape) * s[0]).sum()),
            "stable_rank": float(s.square().sum() / s[0] ** 2),
            "effective_rank": math.exp(-float((p * p.log()).sum())),
            "spectral_norm": float(s[0]),
            "tail_error_k1": math.sqrt(float(s[1:].square().sum() / s.square().sum())),
            "tail_error_k5": math.sqrt(float(s[5:].square().sum() / s.square().sum())),
        }
        assert measured[name] == pytest.approx(expected, rel=1e-12), name
    assert measured[f"model.model.layers.0.mlp.experts.0.{PARTS[0]}"]["numerical_rank"] == min(HIDDEN, INTERMEDIATE)


@needs_mixtral_experts
def test_experts_are_chosen_by_name_pattern_and_type(module):
    exact = WeightRankMonitor(layers=["model.model.layers.0.mlp.experts"], verbose=False).select(module)
    assert exact == _expert_names(0)
    pattern = WeightRankMonitor(layers=["model.model.layers.*.mlp.*"], verbose=False).select(module)
    assert pattern == _expert_names(0) + _expert_names(1)
    by_type = WeightRankMonitor(layer_types=["MixtralExperts"], verbose=False).select(module)
    assert by_type == pattern
    fused = WeightRankMonitor(layers=["*.layers.1.mlp.experts"], split_fused=False, verbose=False)
    names = fused.select(module)
    assert names == [
        f"model.model.layers.1.mlp.experts.{e}.{part}" for e in range(EXPERTS) for part in ("gate_up_proj", "down_proj")
    ]
    spectrum = fused.spectra(module)["model.model.layers.1.mlp.experts.3.gate_up_proj"]
    assert (spectrum.num_samples, spectrum.num_features) == (2 * INTERMEDIATE, HIDDEN)


@needs_mixtral_experts
def test_all_experts_of_a_shape_are_decomposed_in_one_batch(module, monkeypatch):
    import rank_lightning.functional.weights as weights

    batches: list[tuple[int, ...]] = []
    svdvals = weights._svdvals

    def recording(batch: torch.Tensor) -> torch.Tensor:
        batches.append(tuple(batch.shape))
        return svdvals(batch)

    monkeypatch.setattr(weights, "_svdvals", recording)
    WeightRankMonitor(layers=["*.mlp.experts"], decomposition="svd", verbose=False).measure(module)
    # Gate and up (I, H) of every expert of both layers in one call, down (H, I) in another.
    assert sorted(batches) == sorted(
        [(LAYERS * EXPERTS * 2, INTERMEDIATE, HIDDEN), (LAYERS * EXPERTS, HIDDEN, INTERMEDIATE)]
    )


class _Stacked(pl.LightningModule):
    """A Linear beside a stack of four matrices whose layout nothing declares (rows first or columns first)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(5, 6)
        self.moe = nn.Module()
        self.moe.experts = nn.Parameter(torch.randn(4, 6, 5))


def test_a_3d_parameter_in_no_known_layout_is_named_once_and_the_rest_measured():
    model = _Stacked()
    monitor = WeightRankMonitor(verbose=False)
    with pytest.warns(UserWarning, match=r"parameter 'moe.experts' \(Module, shape \(4, 6, 5\)\) is 3-D in no layout"):
        assert monitor.select(model) == ["proj"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        monitor.select(model)  # once
        assert list(monitor.measure(model)) == ["proj"]
    with pytest.warns(UserWarning, match="'moe.experts'"), pytest.raises(ValueError, match="hold no weight matrix"):
        WeightRankMonitor(layers=["moe"], verbose=False).select(model)
