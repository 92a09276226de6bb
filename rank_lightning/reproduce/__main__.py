"""``python -m rank_lightning.reproduce``: see :mod:`rank_lightning.reproduce.cli`."""

import os

# OpenMP threads that spin while waiting make every small CPU op many times slower as soon as another process holds a
# core (rank_lightning/cli.py says more); set before torch is imported, an explicit setting is kept.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from rank_lightning.analysis.output import run_command
from rank_lightning.reproduce.cli import main

if __name__ == "__main__":
    run_command(main)
