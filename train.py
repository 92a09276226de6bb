"""Train, validate or test a model from a config: ``python train.py fit --config configs/quickstart.yaml``."""

from rank_lightning.cli import main

if __name__ == "__main__":
    main()
