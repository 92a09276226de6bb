"""Command line: ``python train.py {fit,validate,test} --config configs/<name>.yaml``.

The datamodule's ``num_classes`` and ``input_shape`` are linked into the model, so a config names a
dataset once. Without a logger in the config, runs are logged to CSV and TensorBoard under ``runs/``,
which needs no account and no network; ``configs/loggers/wandb.yaml`` switches to Weights & Biases.
"""

from __future__ import annotations

import pytorch_lightning as pl
from pytorch_lightning.cli import LightningArgumentParser, LightningCLI

from rank_lightning.modules.base import RankModule


class RankCLI(LightningCLI):
    """LightningCLI over the package's modules and datamodules, with account-free default loggers."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("data.num_classes", "model.init_args.num_classes", apply_on="instantiate")
        parser.link_arguments("data.input_shape", "model.init_args.input_shape", apply_on="instantiate")
        # Each logger versions its own directory (runs/default/version_<n>/ and
        # runs/default/tensorboard/version_<n>/), so no run overwrites another.
        parser.set_defaults(
            {
                "trainer.logger": [
                    {
                        "class_path": "pytorch_lightning.loggers.CSVLogger",
                        "init_args": {"save_dir": "runs", "name": "default"},
                    },
                    {
                        "class_path": "pytorch_lightning.loggers.TensorBoardLogger",
                        "init_args": {"save_dir": "runs/default", "name": "tensorboard"},
                    },
                ]
            }
        )


def main(args: list[str] | None = None, *, run: bool = True) -> RankCLI:
    """Run the command line with ``args`` (``sys.argv[1:]`` when ``None``)."""
    return RankCLI(
        model_class=RankModule,
        datamodule_class=pl.LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        args=args,
        run=run,
    )
