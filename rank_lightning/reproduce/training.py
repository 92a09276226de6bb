"""Data and a plain training loop for the reproductions: small in-memory datasets, mini-batch SGD epochs.

The reproductions train hundreds of small networks on two CPU cores; a bare loop over in-memory tensors costs a
fraction of a Lightning fit per network, so the experiments use it and keep the package's models, data modules,
metrics and attacks for everything else.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rank_lightning.data.digits import DigitsDataModule

__all__ = [
    "Dataset",
    "Diverged",
    "accuracy",
    "check_data_dir",
    "features_of",
    "load_classification",
    "train_epochs",
]


class Diverged(RuntimeError):
    """Training produced a non-finite loss or weight; the experiment reports the model as diverged."""


@dataclass(frozen=True)
class Dataset:
    """A classification data set in memory: normalised inputs, int64 labels, and the pixel statistics."""

    name: str
    x_train: Tensor
    y_train: Tensor
    x_test: Tensor
    y_test: Tensor
    mean: tuple[float, ...]
    std: tuple[float, ...]
    image_shape: tuple[int, ...]

    @property
    def num_features(self) -> int:
        """Features of one input (its pixels)."""
        return self.x_train[0].numel()

    def to(self, device: torch.device) -> Dataset:
        """The same data with every tensor on ``device``."""
        return Dataset(
            self.name,
            self.x_train.to(device),
            self.y_train.to(device),
            self.x_test.to(device),
            self.y_test.to(device),
            self.mean,
            self.std,
            self.image_shape,
        )


def check_data_dir(data_dir: str | Path | None) -> Path | None:
    """``data_dir`` as a path, after checking that it holds torchvision's ``FashionMNIST/raw`` folder.

    Raises:
        FileNotFoundError: ``data_dir`` is given but ``data_dir/FashionMNIST/raw`` is not a folder (a mistyped
            path would otherwise run every experiment on the digits instead).
    """
    if data_dir is None:
        return None
    raw = Path(data_dir) / "FashionMNIST" / "raw"
    if not raw.is_dir():
        raise FileNotFoundError(
            f"data folder {str(data_dir)!r} holds no Fashion-MNIST files: {str(raw)!r} is not a folder (torchvision's "
            "layout: DIR/FashionMNIST/raw/*-ubyte[.gz]); leave the data folder out to use the bundled digits"
        )
    return Path(data_dir)


def load_classification(data_dir: Path | None = None, *, max_train: int | None = None) -> Dataset:
    """Fashion-MNIST from ``data_dir`` (flattened 784-pixel vectors), or the bundled digits when it is ``None``.

    The digits come from :class:`~rank_lightning.data.DigitsDataModule` without a validation split (1,438 training
    and 359 test images of 64 pixels, normalised by the training pixels' mean and std).

    Args:
        data_dir: folder holding ``FashionMNIST/raw`` (torchvision's layout), or ``None``.
        max_train: keep at most this many training samples, drawn at random (seed 0).

    Raises:
        FileNotFoundError: ``data_dir`` is given but holds no ``FashionMNIST/raw`` folder (:func:`check_data_dir`).
    """
    if check_data_dir(data_dir) is not None:
        from rank_lightning.data.vision import FashionMNISTDataModule

        module = FashionMNISTDataModule(data_dir=data_dir, download=False, flatten=True, val_fraction=0.0)
        module.setup("fit")
        module.setup("test")
        train, test = _stack(module.train_set), _stack(module.test_set)
        name, shape = "Fashion-MNIST", (1, 28, 28)
    else:
        module = DigitsDataModule(flatten=True, val_fraction=0.0, test_fraction=0.2)
        module.setup()
        train, test = module.train_set.tensors, module.test_set.tensors
        name, shape = "digits", (1, 8, 8)
    x_train, y_train = train
    if max_train is not None:
        keep = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(0))[:max_train]
        x_train, y_train = x_train[keep], y_train[keep]
    return Dataset(name, x_train, y_train, test[0], test[1], module.mean, module.std, shape)


def _stack(dataset: torch.utils.data.Dataset) -> tuple[Tensor, Tensor]:
    loader = torch.utils.data.DataLoader(dataset, batch_size=4096)
    xs, ys = zip(*loader)
    return torch.cat(xs), torch.cat(ys)


def train_epochs(
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    *,
    epochs: int,
    lr: float,
    batch_size: int = 128,
    weight_decay: float = 0.0,
    momentum: float = 0.0,
    seed: int = 0,
    loss_fn: Callable[[Tensor, Tensor], Tensor] | None = None,
    extra_loss: Callable[[], Tensor] | None = None,
    after_step: Callable[[], None] | None = None,
    after_epoch: Callable[[int], None] | None = None,
) -> None:
    """Plain SGD over shuffled mini-batches of the in-memory ``(x, y)``.

    Args:
        model: trained in place (training mode during the epochs, eval mode afterwards).
        x, y: inputs and targets (labels for cross-entropy, or anything ``loss_fn`` takes).
        epochs: passes over the data.
        lr, batch_size, weight_decay, momentum: SGD settings (weight decay is the L2 penalty of ``torch.optim.SGD``,
            applied to every parameter).
        seed: seeds the shuffling.
        loss_fn: ``(output, target) -> loss``; cross-entropy by default.
        extra_loss: added to every step's loss (e.g. the LR-Layer's auxiliary loss).
        after_step: called after every optimizer step (e.g. the LR-Layer's projection).
        after_epoch: called with the epoch index (0-based) after every epoch, the model in eval mode.

    Raises:
        Diverged: a step's loss is not finite (the step is not taken).
    """
    loss_fn = F.cross_entropy if loss_fn is None else loss_fn
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
    generator = torch.Generator().manual_seed(seed)
    for epoch in range(epochs):
        model.train()
        order = torch.randperm(len(x), generator=generator).to(x.device)
        for start in range(0, len(x), batch_size):
            index = order[start : start + batch_size]
            loss = loss_fn(model(x[index]), y[index])
            if extra_loss is not None:
                loss = loss + extra_loss()
            if not torch.isfinite(loss):
                raise Diverged(f"non-finite loss {loss.item()} in epoch {epoch}")
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if after_step is not None:
                after_step()
        model.eval()
        if after_epoch is not None:
            after_epoch(epoch)
    model.eval()


@torch.no_grad()
def accuracy(model: nn.Module, x: Tensor, y: Tensor) -> float:
    """Top-1 accuracy of ``model`` (in its current mode) on ``(x, y)``."""
    return float((model(x).argmax(dim=1) == y).float().mean())


@torch.no_grad()
def features_of(module: nn.Module, x: Tensor, batch_size: int = 2048) -> Tensor:
    """``module(x)`` in batches, without gradients."""
    return torch.cat([module(x[start : start + batch_size]) for start in range(0, len(x), batch_size)])
