"""Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, Switch Transformers) in the activation monitor.

Tiny models from ``transformers`` configs with random weights, inside a LightningModule fed dict batches with
padding, on 5.x and on 4.x (the minimum), whose Mixtral and Qwen2-MoE blocks hold one module per expert. The blocks
and the sparse MoE block give ``(B, T, D)`` tokens; a router's logits and fused experts give the batch's positions
flattened, ``(B * T, d)``, and a routed expert the ``(n_routed, d)`` tokens routed to it: such rows are never read
as inputs or views of the batch, and ``unbatched=True`` measures them as they come.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
import transformers
from torch import Tensor, nn
from torch.utils.data import DataLoader

from rank_lightning.callbacks import ActivationRankMonitor
from rank_lightning.callbacks.curves import LayerCurves
from rank_lightning.functional import effective_rank
from rank_lightning.layers import default_layers, expert_layers
from rank_lightning.tracker import RankTracker
from tests.callbacks.trainer_helpers import quiet_trainer

VOCAB, LENGTH, BATCH = 64, 8, 4
ATTENTION = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
FAMILIES = {
    "mixtral": lambda: transformers.MixtralForCausalLM(
        transformers.MixtralConfig(**ATTENTION, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2)
    ),
    "qwen2_moe": lambda: transformers.Qwen2MoeForCausalLM(
        transformers.Qwen2MoeConfig(
            **ATTENTION,
            moe_intermediate_size=12,
            shared_expert_intermediate_size=20,
            num_experts=4,
            num_experts_per_tok=2,
        )
    ),
    "qwen3_moe": lambda: transformers.Qwen3MoeForCausalLM(
        transformers.Qwen3MoeConfig(
            **ATTENTION, moe_intermediate_size=12, num_experts=4, num_experts_per_tok=2, head_dim=4
        )
    ),
    "olmoe": lambda: transformers.OlmoeForCausalLM(
        transformers.OlmoeConfig(**ATTENTION, intermediate_size=24, num_experts=4, num_experts_per_tok=2)
    ),
}
SWITCH_FFN = "model.encoder.block.0.layer.1.mlp"


@pytest.fixture(autouse=True)
def _quick_runs(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(LayerCurves, "write_figures", lambda self, *args, **kwargs: [])


class MoEModule(pl.LightningModule):
    def __init__(self, model: nn.Module, **options: Any) -> None:
        super().__init__()
        self.model, self.options = model, options

    def forward(self, **batch: Tensor) -> Any:
        return self.model(**batch)

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self.model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"), **self.options)


def _model(family: str) -> nn.Module:
    torch.manual_seed(0)
    if family == "switch":
        config = transformers.SwitchTransformersConfig(
            vocab_size=VOCAB, d_model=16, d_kv=4, d_ff=24, num_layers=2, num_decoder_layers=1, num_heads=4,
            num_experts=4, expert_capacity=64, encoder_sparse_step=1, decoder_start_token_id=0, pad_token_id=0,
        )  # fmt: skip
        model = transformers.SwitchTransformersEncoderModel(config)
        # Weights of one generator, not of transformers' initialisation, which differs between versions: every
        # version routes the same tokens to each expert.
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=generator) * p.shape[-1] ** -0.5) if p.ndim > 1 else p.fill_(1)
        return model
    return FAMILIES[family]()


def _batches(*, padded: bool = True, mask: bool = True, labels: bool = False) -> list[dict[str, Tensor]]:
    """Two right-padded batches of ``BATCH`` sequences of ``LENGTH`` positions (sample 0 full)."""
    generator, batches = torch.Generator().manual_seed(1), []
    for _ in range(2):
        lengths = torch.randint(2, LENGTH + 1, (BATCH,), generator=generator) if padded else torch.full((BATCH,), 8)
        lengths[0] = LENGTH
        real = torch.arange(LENGTH)[None] < lengths[:, None]
        batch = {"input_ids": torch.randint(3, VOCAB, (BATCH, LENGTH), generator=generator).masked_fill(~real, 1)}
        if mask:
            batch["attention_mask"] = real.long()
        if labels:
            batch["labels"] = torch.arange(BATCH) % 3
        batches.append(batch)
    return batches


def _validate(model: nn.Module, monitor: ActivationRankMonitor, batches: list[Any]) -> tuple[dict, list[str]]:
    trainer = quiet_trainer([monitor])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.validate(MoEModule(model), DataLoader(batches, batch_size=None), verbose=False)
    messages = [str(w.message) for w in caught if "rank_lightning" in w.filename]
    return {key: float(value) for key, value in trainer.callback_metrics.items()}, messages


def _outputs(model: nn.Module, path: str, batches: list[dict[str, Tensor]], pick: Any = lambda out: out) -> list:
    """What the module at ``path`` returns in each forward pass of the batches (eval mode, no gradient)."""
    seen: list[Tensor] = []
    handle = model.get_submodule(path).register_forward_hook(lambda m, i, out: seen.append(pick(out).detach()))
    model.eval()
    with torch.no_grad():
        for batch in batches:
            model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"))
    handle.remove()
    return seen


def _routed(model: nn.Module, batches: list[dict[str, Tensor]]) -> Tensor:
    """``(batches, experts)``: how many tokens of each batch Switch's first router sends to each expert."""
    router = SWITCH_FFN.removeprefix("model.") + ".router"
    return torch.stack([index.sum((0, 1)) for index in _outputs(model, router, batches, pick=lambda out: out[0])])


def _real(batch: dict[str, Tensor]) -> Tensor:
    return batch["attention_mask"].bool()


def _family(family: str) -> str:
    """``family``, skipped where the installed ``transformers`` lacks its model (added in 4.45 and 4.51)."""
    missing = {"olmoe": "OlmoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}.get(family)
    if missing and not hasattr(transformers, missing):
        pytest.skip(f"transformers {transformers.__version__} has no {missing}")
    return family


def _moe_block(model: nn.Module, layer: int = 0) -> str:
    """The path of decoder layer ``layer``'s sparse MoE block, found by what it holds (a ``gate`` and ``experts``):
    ``mlp`` in ``transformers`` 5.x, Mixtral's ``block_sparse_moe`` in 4.x."""
    decoder = model.get_submodule(f"model.layers.{layer}")
    names = [name for name, child in decoder.named_children() if hasattr(child, "gate") and hasattr(child, "experts")]
    assert len(names) == 1, names
    return f"model.layers.{layer}.{names[0]}"


def _first(out: Any) -> Tensor:
    """The first tensor of a tuple: a ``transformers`` 4.x sparse MoE block's hidden states (it returns
    ``(hidden_states, router_logits)``), a 5.x router's logits (Mixtral's returns ``(logits, ...)``)."""
    return out[0] if isinstance(out, tuple) else out


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_default_layers_are_the_decoder_layers_and_fused_experts_are_no_routed_experts(family):
    module = MoEModule(_model(_family(family)))
    assert default_layers(module) == {f"model.model.layers.{i}": f"model.model.layers.{i}" for i in range(2)}
    block = f"model.{_moe_block(module.model)}"
    moe = {name: name for name in (block, f"{block}.gate", f"{block}.experts")}
    experts = module.get_submodule(f"{block}.experts")
    if isinstance(experts, nn.ModuleList):  # transformers 4.x: one module per expert, called on its routed tokens
        inside = [f"{block}.experts.3", *(f"{block}.experts.0.{name}" for name, _ in experts[0].named_children())]
        assert expert_layers(module, {**moe, **{name: name for name in inside}}) == inside
    else:
        assert expert_layers(module, moe) == []  # one module for all experts: no expert's own rows to hook


def test_switch_experts_and_their_linears_are_routed_experts():
    module = MoEModule(_model("switch"))
    names = [f"{SWITCH_FFN}.experts.expert_0", f"{SWITCH_FFN}.experts.expert_1.wi", f"{SWITCH_FFN}.router"]
    assert expert_layers(module, {name: name for name in [*names, f"{SWITCH_FFN}.experts"]}) == names[:2]


@pytest.mark.parametrize("reduction", ["token", "mean", "last"])
def test_the_sparse_moe_block_gives_the_real_tokens_of_each_sequence(reduction):
    model, batches = _model("mixtral"), _batches()
    block = _moe_block(model)
    monitor = ActivationRankMonitor(layers=[f"model.{block}"], token_reduction=reduction, verbose=False)
    values, _ = _validate(model, monitor, batches)
    rows = []
    for out, batch in zip(_outputs(model, block, batches, pick=_first), batches):
        real, out = _real(batch), out.double()
        assert out.shape == (BATCH, LENGTH, 16)
        if reduction == "token":
            rows.append(out[real])
        elif reduction == "mean":
            rows.append((out * real[..., None]).sum(1) / real.sum(1, keepdim=True))
        else:
            rows.append(out[torch.arange(BATCH), real.sum(1) - 1])  # right padding: the last real position
    rows = torch.cat(rows)
    key = f"rank/model.{block}/{reduction}"
    real_tokens = sum(int(_real(batch).sum()) for batch in batches)
    assert values[f"{key}/spectrum_rows"] == rows.shape[0] == (real_tokens if reduction == "token" else 2 * BATCH)
    assert values[f"{key}/effective_rank"] == pytest.approx(float(effective_rank(rows)), rel=1e-9)


@pytest.mark.parametrize(("family", "block"), [("mixtral", "model.layers.1"), ("switch", "encoder.block.0")])
def test_with_router_logits_returned_the_blocks_give_their_hidden_states(family, block):
    # Switch's blocks return (hidden_states, position_bias, cross_position_bias); with output_router_logits=True the
    # models return the router logits of every layer (for the load-balancing loss), recorded by the models' hooks.
    model, batches = _model(family), _batches()
    module = MoEModule(model, output_router_logits=True)
    trainer = quiet_trainer([ActivationRankMonitor(verbose=False)])
    trainer.validate(module, DataLoader(batches, batch_size=None), verbose=False)
    out = _outputs(model, block, batches, pick=lambda out: out[0] if isinstance(out, tuple) else out)
    rows = torch.cat([states[_real(batch)] for states, batch in zip(out, batches)]).double()
    assert rows.shape[1] == 16
    assert float(trainer.callback_metrics[f"rank/model.{block}/token/spectrum_rows"]) == rows.shape[0]
    expected = float(effective_rank(rows))
    assert float(trainer.callback_metrics[f"rank/model.{block}/token/effective_rank"]) == pytest.approx(expected, 1e-9)


@pytest.mark.parametrize("mask", [False, True])
def test_router_logits_and_fused_experts_are_never_read_as_views_of_the_batch(mask):
    # (B * T, d) rows of a batch with per-sequence labels and no mask were read as T views of every sequence, each
    # row labelled as sequence i % B: a TCV of rows paired with other sequences' classes.
    model = _model("mixtral")
    block = f"model.{_moe_block(model)}"
    layers = [f"{block}.gate", f"{block}.experts"]
    if isinstance(model.get_submodule(layers[1].removeprefix("model.")), nn.ModuleList):
        del layers[1]  # transformers 4.x: no fused experts, one module per expert (a routed expert: see below)
    monitor = ActivationRankMonitor(layers=layers, num_classes=3, verbose=False)
    values, messages = _validate(model, monitor, _batches(padded=mask, mask=mask, labels=True))
    assert not [key for key in values if f"{block}." in key]
    for layer, width in zip(layers, (4, 16)):
        expected = (
            f"layer {layer!r} gives ({BATCH * LENGTH}, {width}) from a batch of {BATCH} sequences of {LENGTH} tokens: "
            f"the batch's {BATCH * LENGTH} token positions flattened into rows"
        )
        assert [m for m in messages if expected in m and "unbatched=True" in m], messages


def test_unbatched_measures_the_router_logits_of_every_position():
    model, batches = _model("mixtral"), _batches()
    gate = f"{_moe_block(model)}.gate"  # transformers 5.x: a router returning (logits, ...); 4.x: a Linear
    monitor = ActivationRankMonitor(layers=[f"model.{gate}"], unbatched=True, num_classes=3, verbose=False)
    values, messages = _validate(model, monitor, _batches(labels=True))
    logits = torch.cat(_outputs(model, gate, batches, pick=_first)).double()
    assert logits.shape == (2 * BATCH * LENGTH, 4)  # padded positions too: the router runs on them
    assert values[f"rank/model.{gate}/spectrum_rows"] == 2 * BATCH * LENGTH
    assert values[f"rank/model.{gate}/effective_rank"] == pytest.approx(float(effective_rank(logits)), rel=1e-9)
    assert not [key for key in values if "tcv" in key or "classwise" in key]
    assert sum("its rows belong to no input of the batch" in m for m in messages) == 1


def test_a_routed_expert_is_skipped_unless_unbatched_measures_its_rows():
    # Expert 3 gets 4 tokens of the first batch of 4 sequences: they were measured as one row per sequence, the
    # other batches skipped.
    model, batches = _model("switch"), _batches(padded=False, mask=False)
    routed = _routed(model, batches)
    assert routed[0, 3] == BATCH
    experts = [f"{SWITCH_FFN}.experts.expert_{e}" for e in range(4)]
    values, messages = _validate(model, ActivationRankMonitor(layers=experts, verbose=False), batches)
    assert not [key for key in values if "expert_" in key]
    for layer in experts:
        assert [m for m in messages if f"layer {layer!r} gives (" in m and "expert of a mixture-of-experts" in m]
    values, _ = _validate(model, ActivationRankMonitor(layers=experts, unbatched=True, verbose=False), batches)
    counts = []
    for layer in experts:
        rows = torch.cat(_outputs(model, layer.removeprefix("model."), batches)).double()
        counts.append(rows.shape[0])
        assert values[f"rank/{layer}/spectrum_rows"] == rows.shape[0]
        assert values[f"rank/{layer}/effective_rank"] == pytest.approx(float(effective_rank(rows)), rel=1e-9)
    assert counts == routed.sum(0).tolist() == [28, 7, 18, 11]  # every position routed to one expert: 2 x 4 x 8


def test_the_tracker_measures_routed_experts_as_the_monitor_does():
    model, batches = _model("switch"), _batches()
    layer = f"{SWITCH_FFN}.experts.expert_0".removeprefix("model.")
    tracker = RankTracker(model, layers=[layer], unbatched=True)
    model.eval()
    with torch.no_grad(), tracker:
        for batch in batches:
            model(**batch)
    values, rows = tracker.compute()[layer], torch.cat(_outputs(model, layer, batches)).double()
    assert values["spectrum_rows"] == rows.shape[0] == _routed(model, batches)[:, 0].sum() == 27
    assert values["effective_rank"] == pytest.approx(float(effective_rank(rows)), rel=1e-9)


def test_the_router_s_chosen_experts_are_no_hidden_state_and_output_selector_picks_its_logits():
    # Switch's router returns (expert_index, router_probs, router_logits): the one-hot int64 expert_index, the first
    # tensor, was measured as the router's hidden state.
    model, batches, router = _model("switch"), _batches(), f"{SWITCH_FFN}.router"
    values, messages = _validate(model, ActivationRankMonitor(layers=[router], verbose=False), batches)
    assert not [key for key in values if "router" in key]
    expected = f"layer {router!r} gives a int64 tensor of shape ({BATCH}, {LENGTH}, 4): indices or a mask"
    assert [m for m in messages if expected in m and "output_selector=2" in m], messages
    monitor = ActivationRankMonitor(layers=[router], output_selector=2, verbose=False)
    values, _ = _validate(model, monitor, batches)
    logits = _outputs(model, router.removeprefix("model."), batches, pick=lambda out: out[2])
    rows = torch.cat([out[_real(batch)] for out, batch in zip(logits, batches)]).double()
    assert values[f"rank/{router}/token/spectrum_rows"] == rows.shape[0]
    assert values[f"rank/{router}/token/effective_rank"] == pytest.approx(float(effective_rank(rows)), rel=1e-9)


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_unbatched_must_be_a_bool(value):
    message = f"unknown unbatched {value!r}; valid choices are: False, True"
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        ActivationRankMonitor(unbatched=value)
    with pytest.raises(ValueError, match=message):
        RankTracker(nn.Linear(2, 2), unbatched=value)
