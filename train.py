"""Train, validate or test a model from a config: ``python train.py fit --config configs/quickstart.yaml``."""

import os

# OpenMP threads that spin while waiting make every small CPU op tens of times slower as soon as another process
# holds a core (measured: 5 digits epochs 0.3 s idle-waiting vs 15.6 s spinning). Must be set before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from rank_lightning.cli import main

if __name__ == "__main__":
    main()
