"""Rank monitors on models fine-tuned with ``peft``'s LoRA (tiny ``transformers`` models from configs, random weights):
a LoRA layer is measured as the weight it applies, ``W + (alpha / r) B A``, under its own name, with the update
``(alpha / r) B A`` beside it, and its factors are no layers of their own."""

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from transformers import BertConfig, BertForSequenceClassification, GPT2Config, GPT2LMHeadModel

from rank_lightning.callbacks import ActivationRankMonitor, WeightRankMonitor
from tests.callbacks.recording_logger import RecordingLogger

peft = pytest.importorskip("peft")

EMBED, RANK = 16, 4
BLOCK = "model.base_model.model.transformer.h.0"


class LanguageModel(pl.LightningModule):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, **batch):
        return self.model(**batch)

    def training_step(self, batch, batch_idx):
        return self(**batch).loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self(**batch).loss)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def gpt2(**lora) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=EMBED, n_head=2, vocab_size=40, n_positions=8, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    settings = {"r": RANK, "lora_alpha": 8, "target_modules": ["c_attn", "c_proj"], "fan_in_fan_out": True, **lora}
    return peft.get_peft_model(model, peft.LoraConfig(**settings))


def test_a_lora_layer_is_its_effective_weight_under_its_own_name():
    module = LanguageModel(gpt2(init_lora_weights=False))  # B random: an update of rank r
    monitor = WeightRankMonitor(decomposition="svd", verbose=False)
    names = monitor.select(module)
    assert not [name for name in names if "lora_A" in name or "lora_B" in name or "base_layer" in name]
    parts = [f"{BLOCK}.attn.c_attn.{part}" for part in ("q_proj", "k_proj", "v_proj")]
    assert [name for name in names if name.startswith(f"{BLOCK}.attn.c_attn")] == parts + [
        f"{part}.lora_update" for part in parts
    ]
    assert f"{BLOCK}.mlp.c_fc" in names and f"{BLOCK}.mlp.c_proj.lora_update" in names and len(names) == 2 * 11 + 1
    layer = module.model.base_model.model.transformer.h[0].attn.c_attn
    update = (layer.lora_B.default.weight @ layer.lora_A.default.weight).detach().double() * 2.0  # alpha / r = 2
    effective = layer.base_layer.weight.detach().double().T + update  # (3E, E), as a Linear
    spectra, values = monitor.spectra(module), monitor.measure(module)
    for i, name in enumerate(parts):
        rows = slice(i * EMBED, (i + 1) * EMBED)
        torch.testing.assert_close(spectra[name].singular_values, torch.linalg.svdvals(effective[rows]))
        torch.testing.assert_close(spectra[f"{name}.lora_update"].singular_values, torch.linalg.svdvals(update[rows]))
        assert values[name]["numerical_rank"] == EMBED and values[f"{name}.lora_update"]["numerical_rank"] == RANK
    assert "model.base_model.model.transformer.h.0.attn.c_attn" in WeightRankMonitor(split_fused=False).select(module)
    assert f"{parts[0]}.lora_update" not in WeightRankMonitor(lora_update=False).select(module)


def test_the_spectra_are_those_of_the_merged_model():
    peft_model = gpt2(init_lora_weights=False)
    monitor = WeightRankMonitor(verbose=False)
    before = monitor.spectra(LanguageModel(peft_model))
    peft_model.merge_adapter()  # merged in place: the layer applies its base weight, which now holds the update
    merged = monitor.spectra(LanguageModel(peft_model))
    plain = WeightRankMonitor(verbose=False).spectra(LanguageModel(peft_model.merge_and_unload()))
    assert len(plain) == 2 * 6 + 1 and len(before) == 2 * 11 + 1
    for name, spectrum in plain.items():
        lora_name = name.replace("model.", "model.base_model.model.", 1)
        assert torch.allclose(before[lora_name].singular_values, spectrum.singular_values, rtol=1e-12, atol=0)
        assert torch.allclose(merged[lora_name].singular_values, spectrum.singular_values, rtol=1e-12, atol=0)
    update = f"{BLOCK}.attn.c_proj.lora_update"
    assert torch.equal(before[update].singular_values, merged[update].singular_values)


def bert(**lora) -> nn.Module:
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=40, hidden_size=EMBED, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32
    )
    model = BertForSequenceClassification(config)
    return peft.get_peft_model(model, peft.LoraConfig(r=RANK, target_modules=["query", "value"], **lora))


def test_layer_types_and_names_select_lora_layers_by_their_base_layer():
    module = LanguageModel(bert(init_lora_weights=False))
    query = "model.base_model.model.bert.encoder.layer.0.attention.self.query"
    linears = WeightRankMonitor(layer_types=[nn.Linear]).select(module)
    assert query in linears and f"{query}.lora_update" in linears
    assert WeightRankMonitor(layer_types=["Linear"]).select(module) == linears
    chosen = WeightRankMonitor(layers=["*.layer.0.attention.self"]).select(module)
    self_attention = ["query", "query.lora_update", "key", "value", "value.lora_update"]
    assert chosen == [f"{query.removesuffix('query')}{name}" for name in self_attention]
    message = r"query.lora_A.default' matches nothing that can be monitored; layers are: .*self.query, "
    with pytest.raises(ValueError, match=message):
        WeightRankMonitor(layers=[f"{query}.lora_A.default"]).select(module)


def test_a_lora_variant_is_measured_as_its_parts_with_a_warning():
    module = LanguageModel(bert(use_dora=True))
    query = "model.base_model.model.bert.encoder.layer.0.attention.self.query"
    message = rf"LoRA layers '{query}', .* are measured as their parts, since adapter 'default' is a LoRA variant"
    with pytest.warns(UserWarning, match=message):
        names = WeightRankMonitor().select(module)
    assert f"{query}.base_layer" in names and f"{query}.lora_B.default" in names and query not in names


def test_a_lora_fit_logs_the_rank_of_the_update_from_zero_to_r(tmp_path):
    torch.manual_seed(1)
    ids = torch.randint(1, 40, (16, 8))
    mask = (torch.arange(8) < torch.randint(4, 9, (16, 1))).long()  # padded sequences
    batches = [
        {"input_ids": ids[i : i + 8], "attention_mask": mask[i : i + 8], "labels": ids[i : i + 8]} for i in (0, 8)
    ]
    weights, activations, logger = WeightRankMonitor(), ActivationRankMonitor(), RecordingLogger()
    trainer = pl.Trainer(
        max_epochs=2,
        callbacks=[weights, activations],
        logger=logger,
        default_root_dir=tmp_path,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    loader = torch.utils.data.DataLoader(batches, batch_size=None)
    trainer.fit(LanguageModel(gpt2()), train_dataloaders=loader, val_dataloaders=loader)
    assert list(activations.monitored) == [BLOCK, BLOCK.replace("h.0", "h.1")]
    update, applied = f"weight/{BLOCK}.attn.c_attn.v_proj.lora_update/", f"weight/{BLOCK}.attn.c_attn.v_proj/"
    initial = logger.calls[0][1]
    assert initial[f"{update}numerical_rank"] == 0 and initial[f"{applied}numerical_rank"] == EMBED
    assert logger.latest[f"{update}numerical_rank"] == RANK and logger.latest[f"{applied}numerical_rank"] == EMBED
    assert not [key for key in logger.latest if "lora_A" in key or "base_layer" in key]
    assert f"rank/{BLOCK}/token/numerical_rank" in logger.latest


def test_activation_layers_chosen_by_type_are_the_lora_layers_not_their_parts():
    module = LanguageModel(bert())
    layer = "model.base_model.model.bert.encoder.layer.0"
    linears = list(ActivationRankMonitor(layer_types=[nn.Linear]).select(module))
    assert linears[:6] == [
        f"{layer}.attention.self.query",
        f"{layer}.attention.self.key",
        f"{layer}.attention.self.value",
        f"{layer}.attention.output.dense",
        f"{layer}.intermediate.dense",
        f"{layer}.output.dense",
    ]
    assert not [name for name in linears if "lora_" in name or "base_layer" in name]
    explicit = [f"{layer}.attention.self.query.base_layer", f"{layer}.attention.self.query.lora_A.default"]
    assert list(ActivationRankMonitor(layers=explicit).select(module)) == explicit


def test_a_lora_layer_is_computed_once_per_measurement_a_bounded_amount_at_a_time(monkeypatch):
    module = LanguageModel(gpt2(init_lora_weights=False))
    monitor = WeightRankMonitor(verbose=False)
    expected = monitor.measure(module)
    calls = []
    lora_linear = peft.tuners.lora.layer.Linear
    delta = lora_linear.get_delta_weight
    monkeypatch.setattr(lora_linear, "get_delta_weight", lambda layer, name: calls.append(name) or delta(layer, name))
    monkeypatch.setattr("rank_lightning.distributed._LORA_BYTES", 1, raising=False)  # one computed weight at a time
    assert monitor.measure(module) == expected
    assert len(calls) == 2 * 6  # 6 LoRA layers (c_attn, attn.c_proj, mlp.c_proj of 2 blocks): weight, update


def test_a_sharded_base_weight_is_an_error_naming_the_lora_layer():
    model = gpt2()
    model.base_model.model.transformer.h[0].attn.c_proj.base_layer.weight.ds_shape = (EMBED, EMBED)  # a ZeRO-3 mark
    with pytest.raises(RuntimeError, match=rf"base weight of LoRA layer '{BLOCK}.attn.c_proj' is held as a Parameter"):
        WeightRankMonitor(verbose=False).spectra(LanguageModel(model))


def test_the_trained_copy_of_a_module_to_save_is_measured_not_its_frozen_original():
    module = LanguageModel(bert(task_type="SEQ_CLS"))  # peft trains a copy of the classifier head, beside the original
    head = "model.base_model.model.classifier"
    copy = module.model.base_model.model.classifier.modules_to_save.default
    with torch.no_grad():
        copy.weight.copy_(torch.outer(torch.ones(2), torch.arange(1.0, EMBED + 1)))  # rank 1; the original has rank 2
    monitor = WeightRankMonitor(verbose=False)
    assert [name for name in monitor.select(module) if name.startswith(head)] == [f"{head}.modules_to_save.default"]
    assert monitor.measure(module)[f"{head}.modules_to_save.default"]["numerical_rank"] == 1
    typed = ActivationRankMonitor(layer_types=[nn.Linear], verbose=False).select(module)
    assert [name for name in typed if name.startswith(head)] == [f"{head}.modules_to_save.default"]
    with module.model.disable_adapter():  # the original is what the forward pass applies now
        assert [name for name in monitor.select(module) if name.startswith(head)] == [f"{head}.original_module"]


def test_a_wrapper_that_names_one_active_adapter_gives_its_unapplied_copies_too():
    # peft 0.14 (the lowest supported) names a ModulesToSaveWrapper's adapter in active_adapter only: the wrapper was
    # passed over, so its frozen original was chosen beside the copy that the forward pass applies.
    from rank_lightning.layers import unapplied_copies

    wrapper = type("ModulesToSaveWrapper", (nn.Module,), {"__module__": "peft.utils.other"})()
    wrapper.original_module, wrapper.modules_to_save = nn.Linear(4, 2), nn.ModuleDict({"default": nn.Linear(4, 2)})
    wrapper.active_adapter, wrapper.disable_adapters = "default", False
    model = nn.Sequential(wrapper)
    assert unapplied_copies(model) == {"0.original_module"}
    wrapper.disable_adapters = True
    assert unapplied_copies(model) == {"0.modules_to_save.default"}
    wrapper.disable_adapters, wrapper.active_adapter = False, "other"  # no copy of its own here: the original
    assert unapplied_copies(model) == {"0.modules_to_save.default"}
