"""Image (or vector) classification with any registered backbone."""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torchmetrics.classification import MulticlassAccuracy

from rank_lightning.layers import FeatureLayer, eval_mode, forward_hooks
from rank_lightning.models import create_model, get_model_factory
from rank_lightning.modules.base import RankModule
from rank_lightning.nn import LRLayer, collect_auxiliary_losses, insert_lr_layer
from rank_lightning.validation import check_fraction, check_non_negative_int, check_positive_ints


def _input_kwargs(backbone: str, input_shape: tuple[int, ...]) -> dict[str, Any]:
    """The factory arguments that describe the input: ``input_shape`` for MLPs, channels and size for images."""
    accepted = inspect.signature(get_model_factory(backbone)).parameters
    if "input_shape" in accepted:
        return {"input_shape": input_shape}
    if len(input_shape) != 3:
        raise ValueError(f"backbone {backbone!r} needs (C, H, W) image inputs, got input_shape={input_shape}")
    channels, height, width = input_shape
    if height != width:
        raise ValueError(f"backbone {backbone!r} needs square images, got input_shape={input_shape}")
    return {"in_channels": channels, "image_size": height}


class ImageClassifier(RankModule):
    """Cross-entropy classification of ``(x, y)`` batches with a backbone from the registry.

    Args:
        backbone: registered model name (see ``rank_lightning.models.list_models()``).
        backbone_kwargs: keyword arguments of the backbone factory (depth, width, init, ...).
        num_classes: number of classes; linked from the datamodule by the CLI.
        input_shape: shape of one input, ``(C, H, W)`` or ``(d,)``; linked from the datamodule by the CLI.
        label_smoothing: label smoothing of the cross-entropy, in ``[0, 1]``.
        lr_layers: LR-Layers (Sanyal et al. Sec. 3) to insert, each a dict with ``before`` (a module path inside the
            backbone, such as ``"layer4"``, or ``"head"`` for the classification head) and the keyword arguments of
            :class:`~rank_lightning.nn.LRLayer` except ``num_features``, which is measured (``rank``, ``lambda_1``,
            ``lambda_2``, ``projection``, ``num_runs``). Their auxiliary loss is added to the training loss; the
            projection and switch-on are done by :class:`~rank_lightning.callbacks.LowRankProjection`.
        **optim: optimiser and schedule settings of :class:`~rank_lightning.modules.base.RankModule`.

    Logged metrics:
        ``train/loss``, ``train/acc``, ``val/loss``, ``val/acc``, ``test/loss``, ``test/acc``; with LR-Layers also
        ``train/lr_layer_loss`` (their summed auxiliary loss, zero before switch-on). With several validation (or
        test) dataloaders, each loader's loss and accuracy are logged apart, under Lightning's
        ``val/acc/dataloader_idx_<i>`` keys (the accuracy of each loader counts its own samples only). Several
        training loaders train on the rows of all of them (:meth:`~RankModule.training_batch`).
    """

    def __init__(
        self,
        backbone: str = "mlp",
        backbone_kwargs: dict[str, Any] | None = None,
        num_classes: int = 10,
        input_shape: tuple[int, ...] = (1, 8, 8),
        label_smoothing: float = 0.0,
        lr_layers: list[dict[str, Any]] | None = None,
        optimizer: str = "sgd",
        lr: float = 0.1,
        weight_decay: float = 0.0,
        momentum: float = 0.9,
        decay_norm_and_bias: bool = False,
        scheduler: str = "none",
        step_size: int = 30,
        milestones: tuple[int, ...] = (),
        gamma: float = 0.1,
    ) -> None:
        super().__init__(
            optimizer=optimizer,
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            decay_norm_and_bias=decay_norm_and_bias,
            scheduler=scheduler,
            step_size=step_size,
            milestones=milestones,
            gamma=gamma,
        )
        # Saved in one form, given as a list (YAML) or a tuple (the datamodule's).
        input_shape = check_positive_ints("input_shape", input_shape)
        check_non_negative_int("num_classes", num_classes)
        if backbone_kwargs is not None and not isinstance(backbone_kwargs, Mapping):
            raise ValueError(f"backbone_kwargs must be None or a mapping of backbone settings, got {backbone_kwargs!r}")
        if lr_layers is not None and (
            isinstance(lr_layers, (str, Mapping))
            or not isinstance(lr_layers, Sequence)
            or not all(isinstance(spec, Mapping) for spec in lr_layers)
        ):
            raise ValueError(
                f"lr_layers must be None or a list of mappings such as {{'before': 'head', 'rank': 8}}, "
                f"got {lr_layers!r}"
            )
        self.save_hyperparameters()
        self.num_classes = num_classes
        self.input_shape = tuple(input_shape)
        check_fraction("label_smoothing", label_smoothing, closed_low=True)
        self.label_smoothing = label_smoothing
        described = {"num_classes": num_classes, **_input_kwargs(backbone, self.input_shape)}
        for key in described.keys() & (backbone_kwargs or {}).keys():
            setting, value = ("num_classes", num_classes) if key == "num_classes" else ("input_shape", self.input_shape)
            raise ValueError(
                f"backbone_kwargs sets {key!r}={backbone_kwargs[key]!r}, which the classifier derives from "
                f"{setting}={value}; set {setting} instead (the CLI links it from the datamodule)"
            )
        self.backbone = create_model(backbone, **described, **(backbone_kwargs or {}))
        for spec in lr_layers or []:
            self._insert_lr_layer(dict(spec))
        self.train_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")
        self.val_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")
        self.test_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")

    def _insert_lr_layer(self, spec: dict[str, Any]) -> None:
        if "before" not in spec:
            raise ValueError(f"an lr_layers entry needs 'before' (a backbone module path or 'head'), got {spec}")
        before = spec.pop("before")
        # The LR-Layer's own settings; its width comes from the position. A typo is a ValueError naming the valid
        # keys (a TypeError from the constructor reaches the CLI user buried in a union-type report).
        valid = [name for name in inspect.signature(LRLayer).parameters if name != "num_features"]
        unknown = sorted(set(spec) - set(valid))
        if unknown:
            raise ValueError(
                f"unknown lr_layers key(s) {', '.join(map(repr, unknown))}; valid keys are: before, {', '.join(valid)}"
            )
        if "rank" not in spec:
            raise ValueError(
                f"an lr_layers entry needs 'rank' (the rank k of the projection), got { ({'before': before} | spec) }"
            )
        path = self.backbone.head_path if before == "head" else before
        names = [name for name, _ in self.backbone.named_modules() if name]
        if path not in names:
            raise ValueError(f"unknown lr_layers position {before!r}; positions are: head, {', '.join(names)}")
        widths: list[int] = []
        layer = FeatureLayer(path, path, "input")
        # The width LRLayer reads: all of one sample's values when flattening, else the last dimension (tokens).
        flatten = spec.get("flatten", True)
        with (
            torch.no_grad(),
            eval_mode(self.backbone),
            forward_hooks(self.backbone, [layer], lambda _, x: widths.append(x[0].numel() if flatten else x.shape[-1])),
        ):
            self.backbone(torch.zeros(2, *self.input_shape))
        insert_lr_layer(self.backbone, path, LRLayer(widths[0], **spec))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backbone(x)

    def _accuracy(self, stage: str, dataloader_idx: int) -> tuple[MulticlassAccuracy, str]:
        """The accuracy metric of ``stage`` for its dataloader ``dataloader_idx`` and its attribute name:
        ``<stage>_acc`` for the first loader; for a later one ``<stage>_acc_<i>``, made at its first batch (one metric
        per loader, so that no loader's samples count in another's accuracy; it holds no saved state)."""
        name = f"{stage}_acc" if dataloader_idx == 0 else f"{stage}_acc_{dataloader_idx}"
        if not hasattr(self, name):
            self.add_module(name, MulticlassAccuracy(num_classes=self.num_classes, average="micro").to(self.device))
        return getattr(self, name), name

    def _shared_step(self, batch: Any, stage: str, dataloader_idx: int = 0) -> torch.Tensor:
        batch = self.training_batch(batch) if stage == "train" else batch
        x, y = batch[0], batch[1]
        logits = self(x)
        loss = F.cross_entropy(logits, y, label_smoothing=self.label_smoothing)
        accuracy, attribute = self._accuracy(stage, dataloader_idx)
        accuracy(logits, y)
        on_step = stage == "train"
        # Reduced over processes in every stage: the epoch value is then the mean over all samples, not rank 0's.
        self.log(f"{stage}/loss", loss, on_step=on_step, on_epoch=True, prog_bar=True, sync_dist=True)
        self.log(f"{stage}/acc", accuracy, on_step=False, on_epoch=True, prog_bar=True, metric_attribute=attribute)
        return loss

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self._shared_step(batch, "train")
        if self.hparams.lr_layers:
            # Sanyal et al. eq. 4: the LR-Layers' reconstruction and norm losses join the task loss.
            aux = collect_auxiliary_losses(self.backbone)
            self.log("train/lr_layer_loss", aux, on_step=False, on_epoch=True, sync_dist=True)
            loss = loss + aux
        return loss

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._shared_step(batch, "val", dataloader_idx)

    def test_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._shared_step(batch, "test", dataloader_idx)
