"""Workers of the sharded-weight tests: two CPU processes (gloo) holding FSDP2 / tensor-parallel DTensor shards,
FSDP1 flat parameters or DeepSpeed ZeRO-3 partitions.

Kept apart from the test modules so that spawned workers import only torch, transformers' layers and rank_lightning.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn
from transformers import GPT2Config, GPT2Model, MixtralConfig
from transformers.models.gpt2.modeling_gpt2 import GPT2Block
from transformers.pytorch_utils import Conv1D

from rank_lightning.callbacks import WeightRankMonitor
from rank_lightning.distributed import shard_layout, weight_matrix_spectra
from rank_lightning.weight_matrices import matrices_of
from tests.spawned import leave

try:  # transformers >= 5: Mixtral's experts as stacked weights; 4.x holds one MLP module per expert instead.
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts
except ImportError:
    MixtralExperts = None

WORLD_SIZE = 2
LAYERS = ("tall", "wide", "conv", "attn.c_attn", "mha", "one_row", "row_parallel", "experts", "expert_rows")
CASES = [
    (sharding, decomposition) for sharding in ("auto", "gram", "gather") for decomposition in ("auto", "svd", "gram")
]


class Attention(nn.Module):
    """GPT-2's fused projection: a Conv1D named c_attn with q, k, v side by side."""

    def __init__(self, embed: int) -> None:
        super().__init__()
        self.c_attn = Conv1D(3 * embed, embed)


def _experts() -> nn.Module:
    """Mixtral's expert stacks, (3, 12, 5) gate/up and (3, 5, 6) down, with seeded Gaussian values."""
    layer = MixtralExperts(MixtralConfig(hidden_size=5, intermediate_size=6, num_local_experts=3))
    with torch.no_grad():
        for param in layer.parameters():
            param.normal_()
    return layer


class Layouts(nn.Module):
    """Layers whose shards exercise every route: tall and wide Linear, Conv2d, Conv1D, fused q/k/v split over
    processes, a one-row Linear (one process holds nothing), a column-split (row-parallel) Linear, and expert stacks
    split by expert (FSDP2) or by each expert's rows (gate and up on different processes)."""

    def __init__(self) -> None:
        super().__init__()
        self.tall = nn.Linear(8, 20)
        self.wide = nn.Linear(20, 6)
        self.conv = nn.Conv2d(3, 5, 3)
        self.attn = Attention(6)
        self.mha = nn.MultiheadAttention(5, 1)
        self.one_row = nn.Linear(8, 1)
        self.row_parallel = nn.Linear(12, 7)
        self.experts = _experts()
        self.expert_rows = _experts()


FUSED_EMBED = 6


def fused_model() -> nn.Module:
    """Layers whose matrices depend on the full weight's shape: ``nn.MultiheadAttention`` (q, k, v rows of
    ``in_proj_weight``), a one-block GPT-2 with random weights and cross-attention (``attn.c_attn`` holds q, k and v,
    ``crossattention.c_attn`` k and v, side by side in the columns of the stored ``(E, nE)`` weight) and Mixtral's
    expert stacks (3 experts, gate and up rows of ``gate_up_proj``)."""
    model = nn.Module()
    model.mha = nn.MultiheadAttention(FUSED_EMBED, 2)
    config = GPT2Config(
        n_layer=1,
        n_embd=FUSED_EMBED,
        n_head=2,
        vocab_size=11,
        n_positions=8,
        add_cross_attention=True,
        bos_token_id=0,
        eos_token_id=0,
    )
    model.gpt2 = GPT2Model(config)
    model.experts = _experts()
    return model


def fused_expected(model: nn.Module) -> dict[str, list[float]]:
    """Float64 singular values (``torch.linalg.svdvals``) of every weight matrix of the unsharded :func:`fused_model`,
    each cut from the full weight here, by hand."""
    embed = FUSED_EMBED
    matrices = {}
    in_proj = model.mha.in_proj_weight.detach().double()
    for i, part in enumerate(("q_proj", "k_proj", "v_proj")):
        matrices[f"mha.{part}"] = in_proj[i * embed : (i + 1) * embed]
    matrices["mha.out_proj"] = model.mha.out_proj.weight.detach().double()
    for name, layer in model.gpt2.named_modules():
        if not isinstance(layer, Conv1D):
            continue
        weight = layer.weight.detach().double()  # (in, out): y = x W, the (out, in) matrix is W^T
        if name.endswith("c_attn"):
            parts = ("q_proj", "k_proj", "v_proj")[3 - weight.shape[1] // embed :]
            for i, part in enumerate(parts):
                matrices[f"gpt2.{name}.{part}"] = weight[:, i * embed : (i + 1) * embed].T
        else:
            matrices[f"gpt2.{name}"] = weight.T
    for e in range(model.experts.gate_up_proj.shape[0]):
        gate, up = model.experts.gate_up_proj[e].detach().double().chunk(2)  # Mixtral's forward chunks gate, up
        matrices[f"experts.{e}.gate_proj"], matrices[f"experts.{e}.up_proj"] = gate, up
        matrices[f"experts.{e}.down_proj"] = model.experts.down_proj[e].detach().double()
    return {name: torch.linalg.svdvals(matrix).tolist() for name, matrix in matrices.items()}


def _singular_values(spectra: dict) -> dict[str, list[float]]:
    return {name: spectrum.singular_values.tolist() for name, spectrum in spectra.items()}


def _init(rank: int, port: int) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)


def _shard(model: Layouts) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    for name in ("tall", "wide", "conv", "attn", "mha", "one_row", "experts"):
        fully_shard(getattr(model, name), mesh=mesh)
    # Tensor parallelism's row-wise layer: every process holds some input columns of the weight.
    weight = model.row_parallel.weight
    model.row_parallel.weight = nn.Parameter(distribute_tensor(weight.detach(), mesh, [Shard(1)]))
    # Every expert's rows split: one process holds the gate rows of gate_up_proj, the other the up rows.
    for name in ("gate_up_proj", "down_proj"):
        stack = getattr(model.expert_rows, name)
        setattr(model.expert_rows, name, nn.Parameter(distribute_tensor(stack.detach(), mesh, [Shard(1)])))


def _matrices(model: nn.Module) -> list:
    return [matrix for name in LAYERS for matrix in matrices_of(name, model.get_submodule(name))]


def layouts_worker(rank: int, port: int, out: str) -> None:
    """Spectra and monitor values of the sharded model next to those of an unsharded copy, written by rank 0."""
    _init(rank, port)
    torch.manual_seed(0)
    model = Layouts()
    reference = copy.deepcopy(model)
    _shard(model)
    results: dict = {"placements": {}, "cases": {}}
    for name, param in model.named_parameters():
        if name.endswith(("weight", "_proj")):
            results["placements"][name] = [p.dim if p.is_shard() else str(p) for p in getattr(param, "placements", ())]
    sharded_matrices, plain_matrices = _matrices(model), _matrices(reference)
    for sharding, decomposition in CASES:
        sharded = weight_matrix_spectra(sharded_matrices, decomposition=decomposition, sharding=sharding)
        plain = weight_matrix_spectra(plain_matrices, decomposition=decomposition)
        results["cases"][f"{sharding}/{decomposition}"] = {
            m.name: [s.singular_values.tolist(), p.singular_values.tolist()]
            for m, s, p in zip(sharded_matrices, sharded, plain)
        }
    monitor = WeightRankMonitor(verbose=False)
    results["monitor"] = [monitor.measure(model), WeightRankMonitor(verbose=False).measure(reference)]
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    leave()


class _Stack(nn.Module):
    """An embedding tied to the output projection, between them two blocks that FSDP1 wraps as nested units."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 6)) for _ in range(2))
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def fsdp1_worker(rank: int, port: int, out: str, use_orig_params: bool) -> None:
    """WeightRankMonitor's values of an FSDP1-wrapped model before any forward pass (the initial point, when a
    nested unit is gathered before the root has initialised) and after one, next to the unsharded model's."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    _init(rank, port)
    torch.manual_seed(0)
    model = _Stack()
    reference = copy.deepcopy(model)
    monitor = WeightRankMonitor(layers=["blocks.*", "head"], verbose=False)
    monitor.select(model)  # as under Lightning: the callbacks' setup runs before the strategy wraps the model
    wrapped = FullyShardedDataParallel(
        model,
        device_id=torch.device("cpu"),
        auto_wrap_policy=ModuleWrapPolicy({nn.Sequential}),
        use_orig_params=use_orig_params,
    )
    nested = [m for m in wrapped.modules() if isinstance(m, FullyShardedDataParallel)]
    expected = WeightRankMonitor(layers=["blocks.*", "head"], verbose=False).measure(reference)

    def measured() -> dict:
        spectra = weight_matrix_spectra(monitor._matrices, root=wrapped)
        return monitor._values(dict(zip(monitor.monitored, spectra)))

    before = measured()
    wrapped(torch.arange(8).view(2, 4)).sum().backward()
    after = measured()
    results = {"units": len(nested), "before": before, "after": after, "plain": expected}
    # fused_model() holds MixtralExperts; without it (transformers < 5) the tests of this part are skipped.
    results["after_wrap"] = None if MixtralExperts is None else _fsdp1_selected_after_wrapping(use_orig_params)
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    leave()


def _fsdp1_selected_after_wrapping(use_orig_params: bool) -> dict:
    """Singular values of :func:`fused_model` wrapped by FSDP1 (the GPT-2 block a nested unit) with the layers
    selected after wrapping, as a plain loop or a second fit does, when ``use_orig_params=True`` leaves each process a
    1-D slice of every weight: on the wrapped model, on the inner model attached to a trainer whose ``model`` is the
    wrapped one (Lightning), and on the inner model alone (fused q/k/v, whose parts need no shape, and the error for
    the expert stacks, whose count does)."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    torch.manual_seed(1)
    model = fused_model()
    results: dict = {"expected": fused_expected(model)}
    wrapped = FullyShardedDataParallel(
        model,
        device_id=torch.device("cpu"),
        auto_wrap_policy=ModuleWrapPolicy({GPT2Block}),
        use_orig_params=use_orig_params,
    )
    results["stored"] = list(model.mha.in_proj_weight.shape)
    monitor = WeightRankMonitor(decomposition="svd", verbose=False)
    monitor.select(wrapped)
    results["wrapped"] = _singular_values(monitor.spectra(wrapped))
    model._trainer = SimpleNamespace(model=wrapped)  # what _strategy_root finds under Lightning
    monitor = WeightRankMonitor(decomposition="svd", verbose=False)
    monitor.select(model)
    results["trainer"] = _singular_values(monitor.spectra(model))
    del model._trainer
    monitor = WeightRankMonitor(layers=["mha", "gpt2"], decomposition="svd", verbose=False)
    monitor.select(model)
    spectra = weight_matrix_spectra(monitor._matrices, decomposition="svd", root=wrapped)
    results["alone"] = _singular_values(dict(zip(monitor.monitored, spectra)))
    try:
        WeightRankMonitor(layers=["experts"], verbose=False).select(model)
        results["alone_experts"] = None
    except ValueError as error:
        results["alone_experts"] = str(error)
    return results


def zero3_worker(rank: int, port: int, out: str) -> None:
    """WeightRankMonitor's values of a model partitioned by DeepSpeed ZeRO stage 3 (``deepspeed.zero.Init``), before
    a DeepSpeed training step and after it, next to those of the same weights held in full; written by rank 0."""
    import deepspeed

    # DeepSpeed compiles a shared-memory collective for CPU processes at its first collective (1-2 minutes); gloo's
    # own collectives do the same work, so the compiled kernel is left out. (The package's attribute ``torch`` is
    # torch itself, hence the module table.)
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    os.environ["LOCAL_RANK"] = str(rank)  # set by the launcher (Lightning, torchrun, deepspeed) in real runs
    _init(rank, port)
    torch.manual_seed(0)
    reference = _Stack()
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": 3},
        "zero_allow_untested_optimizer": True,
    }
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = _Stack()
    for param, full in zip(model.parameters(), reference.parameters()):
        with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
            if rank == 0:
                param.data.copy_(full.data)
    layers = ["blocks.*", "head"]
    monitor = WeightRankMonitor(layers=layers, verbose=False)
    results: dict = {
        "layouts": sorted({shard_layout(param) for param in model.parameters()}),
        "stored": {name: list(param.shape) for name, param in model.named_parameters()},
        "before": monitor.measure(model),
        "plain_before": WeightRankMonitor(layers=layers, verbose=False).measure(reference),
        # Before any engine exists: a second zero.Init beside a live engine could abort the process at its exit.
        "fused": None if MixtralExperts is None else _zero3_fused(rank, config),
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5), config=config)
    engine.backward(engine(torch.arange(8).view(2, 4)).square().mean())
    engine.step()
    results["after"] = monitor.measure(model)
    full = copy.deepcopy(reference)
    for param, copied in zip(model.parameters(), full.parameters()):
        with deepspeed.zero.GatheredParameters([param]):
            copied.data.copy_(param.data)
    results["plain_after"] = WeightRankMonitor(layers=layers, verbose=False).measure(full)
    results["moved"] = results["plain_after"]["head"] != results["plain_before"]["head"]
    results["released"] = [param.numel() for param in model.parameters()]
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    leave()


def _zero3_fused(rank: int, config: dict) -> dict:
    """Singular values of :func:`fused_model` partitioned by ``deepspeed.zero.Init`` (every weight an empty
    placeholder, its shape in ``ds_shape``), next to the unsharded model's, cut by hand."""
    import deepspeed

    torch.manual_seed(1)
    reference = fused_model()
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = fused_model()
    for param, full in zip(model.parameters(), reference.parameters()):
        with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
            if rank == 0:
                param.data.copy_(full.data)
    monitor = WeightRankMonitor(decomposition="svd", verbose=False)
    return {
        "stored": [list(model.mha.in_proj_weight.shape), list(model.experts.gate_up_proj.shape)],
        "measured": _singular_values(monitor.spectra(model)),
        "expected": fused_expected(reference),
        "released": all(param.numel() == 0 for param in model.parameters()),
    }
