"""The four papers' claims, each reproduced by one command: ``python -m rank_lightning.reproduce NAME``.

``python -m rank_lightning.reproduce --list`` names the experiments; each writes a figure drawn like the paper's, a
CSV of every number the figure shows, and rows of the summary table (claim, the paper's number, ours, verdict). The
default sizes fit a 2-core CPU (each experiment at most about ten minutes); ``--quick`` runs each in well under a
minute. See ``docs/reproductions.md`` for the results.

Modules: :mod:`~rank_lightning.reproduce.core` (registry, run context, summary), :mod:`.training` (data, training
loop), and one module per paper: :mod:`.daneshmand`, :mod:`.feng`, :mod:`.zangrando`, :mod:`.sanyal`.
"""

from rank_lightning.reproduce import daneshmand, feng, sanyal, zangrando
from rank_lightning.reproduce.core import EXPERIMENTS, Claim, Context, Experiment, run_experiments

__all__ = [
    "EXPERIMENTS",
    "Claim",
    "Context",
    "Experiment",
    "daneshmand",
    "feng",
    "run_experiments",
    "sanyal",
    "zangrando",
]
