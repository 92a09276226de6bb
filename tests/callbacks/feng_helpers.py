"""A tiny convolutional classifier with a known-rank block, and its data, for the tests of Feng et al.'s callbacks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn

from tests.callbacks.trainer_helpers import quiet_trainer

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SHAPE = (3, 8, 8)
BLOCKS = {"conv1": "features.2", "conv2": "features.4", "low": "features.8"}


def _network() -> tuple[nn.Sequential, nn.Linear]:
    torch.manual_seed(0)
    features = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Conv2d(4, 4, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(2),
        nn.Flatten(),
        nn.Dropout(0.3),
        nn.Linear(16, 12, bias=False),
    )
    head = nn.Linear(12, 5)
    return features, head


def make_module(base: type) -> type:
    """``TinyNet`` on the LightningModule class ``base`` (of ``pytorch_lightning`` or ``lightning.pytorch``)."""

    class TinyNet(base):
        """Conv + BN + dropout, then a Linear whose weight has rank 3 (frozen), then the head."""

        def __init__(self) -> None:
            super().__init__()
            self.features, self.head = _network()
            low = self.features[8]
            with torch.no_grad():
                low.weight.copy_(torch.randn(12, 3) @ torch.randn(3, 16))
            low.weight.requires_grad_(False)

        def forward(self, x):
            return self.head(self.features(x))

        def blocks(self):
            return dict(BLOCKS)

        def training_step(self, batch, batch_idx):
            return F.cross_entropy(self(batch[0]), batch[1])

        def validation_step(self, batch, batch_idx):
            self.log("val/loss", F.cross_entropy(self(batch[0]), batch[1]))

        def configure_optimizers(self):
            return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.05)

    return TinyNet


TinyNet = make_module(pl.LightningModule)


def make_data(n: int = 40, seed: int = 1) -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, *SHAPE, generator=generator)
    y = torch.randint(0, 5, (n,), generator=generator)
    return torch.utils.data.TensorDataset(x, y)


def make_loader(dataset, shuffle: bool = False) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(dataset, batch_size=16, shuffle=shuffle)


def make_trainer(tmp_path: Path, callbacks: list, trainer_cls: type = pl.Trainer, **kwargs: Any) -> Any:
    """A quiet one-epoch trainer writing under ``tmp_path``, without the sanity check."""
    options = {"max_epochs": 1, "default_root_dir": tmp_path, "num_sanity_val_steps": 0}
    return quiet_trainer(callbacks, trainer_cls, **(options | kwargs))


class DictBatches(torch.utils.data.Dataset):
    """The samples of a ``TensorDataset`` of ``(x, y)`` as dicts ``{"pixels": x, "digit": y}``.

    Neither key is one the batch reader tries by default, so callbacks need ``input_key`` / ``label_key``.
    """

    def __init__(self, dataset: torch.utils.data.TensorDataset) -> None:
        self.x, self.y = dataset.tensors

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"pixels": self.x[index], "digit": self.y[index]}


class DictTinyNet(TinyNet):
    """``TinyNet`` trained and validated on :class:`DictBatches`."""

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self(batch["pixels"]), batch["digit"])

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", F.cross_entropy(self(batch["pixels"]), batch["digit"]))
