"""Stand-alone experiments and reports, each run as ``python -m rank_lightning.analysis.<module>``.

* ``structural_impetus``: rank before and after common network components on Gaussian inputs (Feng et al. Fig. 3).
* ``theorem5``: rank decay of a deep linear Gaussian MLP against Feng et al. Theorem 5 (Fig. 1 d-f).
* ``report``: figures and a summary table of the per-layer rank curves of finished runs.

The modules are not imported here, so that running one with ``-m`` does not import it twice.
"""
