"""Worker of the sharded fused-projection test (tests/test_fused_layouts.py): two CPU processes (gloo) holding
DTensor rows or columns of fused projections whose parts interleave or differ in size.

Kept apart from the test module so that spawned workers import only torch, transformers' layers and rank_lightning's
weight reading.
"""

from __future__ import annotations

import inspect
import json
import os

import torch
import torch.distributed as dist
from torch import nn
from transformers import FalconConfig, GPTNeoXConfig, Phi3Config
from transformers.models.falcon.modeling_falcon import FalconAttention
from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXAttention
from transformers.models.phi3.modeling_phi3 import Phi3Attention

from rank_lightning.distributed import weight_matrix_spectra
from rank_lightning.weight_matrices import is_weight_layer, matrices_of, parent_layer
from tests.spawned import leave

SHARDED = {"neox": 0, "neox_cols": 1, "falcon": 0, "phi3": 0}
"""Layer -> dimension of its fused weight that the processes split (0: rows, 1: columns)."""


def attention_layer(cls: type[nn.Module], config) -> nn.Module:
    """``cls(config, 0)`` (layer index 0), or ``cls(config)`` where this transformers takes no layer index there
    (4.x's GPT-NeoX and Falcon attentions)."""
    return cls(config, 0) if len(inspect.signature(cls).parameters) > 1 else cls(config)


def attentions() -> nn.Module:
    """GPT-NeoX's (heads interleaved), Falcon's grouped-query (groups interleaved) and Phi-3's (parts of unequal size)
    attention layers, whose rows a two-way split cuts inside a part: row 18 of 36 (the second head's keys), 15 of 30
    (the second group's queries), 10 of 20 (the queries)."""
    torch.manual_seed(0)
    model = nn.Module()
    neox = GPTNeoXConfig(hidden_size=12, num_attention_heads=3)
    model.neox, model.neox_cols = attention_layer(GPTNeoXAttention, neox), attention_layer(GPTNeoXAttention, neox)
    model.falcon = attention_layer(
        FalconAttention,
        FalconConfig(hidden_size=18, num_attention_heads=9, num_kv_heads=3, new_decoder_architecture=True),
    )
    phi3 = Phi3Config(hidden_size=12, num_attention_heads=6, num_key_value_heads=2)
    model.phi3 = attention_layer(Phi3Attention, phi3)
    return model


def spectra(model: nn.Module, **options) -> dict[str, list[float]]:
    modules = dict(model.named_modules())
    matrices = [
        matrix
        for path, layer in modules.items()
        if path and is_weight_layer(layer)
        for matrix in matrices_of(path, layer, parent=parent_layer(path, modules))
    ]
    read = weight_matrix_spectra(matrices, **options)
    return {matrix.name: spectrum.singular_values.tolist() for matrix, spectrum in zip(matrices, read)}


def worker(rank: int, port: int, out: str) -> None:
    """Spectra of the sharded layers by the Gram sum and by gathering, beside those of the unsharded layers."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    model, mesh = attentions(), init_device_mesh("cpu", (2,))
    results = {"plain": spectra(attentions(), decomposition="svd")}
    for name, dim in SHARDED.items():
        layer = getattr(model, name).get_submodule("qkv_proj" if name == "phi3" else "query_key_value")
        layer.weight = nn.Parameter(distribute_tensor(layer.weight.detach(), mesh, [Shard(dim)]))
    results["gram"] = spectra(model, decomposition="gram", sharding="gram")
    results["gather"] = spectra(model, decomposition="svd", sharding="gather")
    if rank == 0:
        with open(out, "w") as file:
            json.dump(results, file)
    leave()
