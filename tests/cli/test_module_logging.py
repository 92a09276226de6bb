"""The package's LightningModules log epoch values reduced over processes: no ``sync_dist=True`` warning under DDP.

DDP over one process stands in for DDP: Lightning warns about an unreduced epoch-level tensor whenever the strategy
is distributed and ``torch.distributed`` is initialised, whatever the world size, so the check needs no second process.
"""

import warnings
from collections.abc import Iterator

import pytest
import pytorch_lightning as pl
import torch
import torch.distributed as dist
from pytorch_lightning.trainer.connectors.logger_connector.result import warning_cache
from torch.utils.data import DataLoader, TensorDataset

from rank_lightning.modules import AutoEncoder, ImageClassifier


@pytest.fixture
def process_group(tmp_path) -> Iterator[None]:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _loader() -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 6, generator=generator), torch.randint(0, 3, (32,), generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=8)


@pytest.mark.parametrize(
    "make_module",
    [
        lambda: ImageClassifier(
            backbone="mlp",
            backbone_kwargs={"depth": 2, "width": 8},
            num_classes=3,
            input_shape=(6,),
            lr_layers=[{"before": "head", "rank": 2}],
        ),
        lambda: AutoEncoder(input_shape=(6,), hidden_dims=(8, 3, 8)),
    ],
    ids=["classifier_with_lr_layer", "autoencoder"],
)
def test_epoch_values_are_logged_with_sync_dist(make_module, process_group):
    trainer = pl.Trainer(
        accelerator="cpu",
        strategy="ddp",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    warning_cache.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(make_module(), _loader(), _loader())
    assert {"train/loss_epoch", "val/loss"} <= set(trainer.logged_metrics)
    assert [str(w.message) for w in caught if "sync_dist=True" in str(w.message)] == []
