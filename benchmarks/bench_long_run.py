"""What one recorded point costs in a long step-cadence run, after 10, 100, 1,000 and 3,000 points.

A run of 100,000 optimizer steps with ``ActivationRankMonitor(every_n_train_steps=50)`` records 2,000 points of about
12 layers x 25 metrics. This drives :class:`~rank_lightning.callbacks.curves.LayerCurves` with a stand-in trainer
(rank zero, a CSV and a TensorBoard logger) and prints, at each size:

* ``record``: mean and largest cost of ``record_and_log`` over the points since the previous size (the loggers, the
  curve file and its occasional whole rewrite included);
* ``rewrite``: the cost of one whole rewrite of the curve file (what every record paid before the points were
  appended);
* ``read``: ``read_curve_file`` of the run's curve file;
* ``state``: ``state_dict()`` (taken at every checkpoint), and the bytes ``torch.save`` writes for it;
* with ``--wandb``, ``charts``: one send of the W&B charts (``WandbLogger(mode="disabled")``: W&B builds its tables
  all the same), and how many sends the run has made by then: each time the history doubles (before: every 5th
  point).

    python benchmarks/bench_long_run.py [--wandb] [--layers 12] [--metrics 25]

Measured on 2 shared CPU cores (12 layers x 25 metrics; ``record`` includes about 9 ms of TensorBoard's own
``add_scalar`` calls, the same at any size)::

    points  record mean / max   rewrite   read     state              charts a send, sends so far (before)
    10      15 / 44 ms          1 ms      1 ms     0.0 ms (0.0 MB)    0.4 s, 3 (3)
    100     11 / 21 ms          12 ms     7 ms     0.4 ms (0.3 MB)    0.6 s, 6 (21)
    1000    11 / 63 ms          113 ms    83 ms    5 ms (3.4 MB)      5.3 s, 9 (201)
    3000    11 / 234 ms         353 ms    409 ms   20 ms (10.3 MB)    7.4 s, 11 (601)

The largest record is the one that rewrites the curve file whole (each time the history doubles). Before, every
record rewrote it: 235 ms a record at 1,000 points without loggers, growing linearly (hours in all for 2,000 points of
two monitors); the W&B charts, 7 s a send once capped at ``wandb.Table.MAX_ROWS`` rows, were sent every 5th point
(1.5 s a record on average, 600 sends in 3,000 points); and a checkpoint pickled every layer and metric name once per
point (26 MB at 3,000 points instead of 10 MB).
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from rank_lightning.callbacks import curves as curves_module
from rank_lightning.callbacks.curves import LayerCurves, read_curve_file, write_curve_file

SIZES = (10, 100, 1000, 3000)


def _values(point: int, layers: int, metrics: int) -> dict[str, dict[str, float]]:
    return {f"blocks.{i}": {f"metric_{j}": point * 1e-3 + i + j / 10 for j in range(metrics)} for i in range(layers)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--wandb", action="store_true", help="also time the W&B charts (mode='disabled')")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--metrics", type=int, default=25)
    args = parser.parse_args()
    os.environ.setdefault("RANK_LIGHTNING_FIGURE_WORKERS", "0")
    from pytorch_lightning.loggers import CSVLogger, TensorBoardLogger

    directory = Path(tempfile.mkdtemp())
    loggers = [CSVLogger(directory / "csv"), TensorBoardLogger(directory / "tb")]
    trainer = SimpleNamespace(
        is_global_zero=True,
        loggers=loggers,
        default_root_dir=str(directory),
        sanity_checking=False,
        global_step=0,
        current_epoch=0,
        callback_metrics={},
        state=SimpleNamespace(fn="fit"),
        callbacks=[],
    )
    module = SimpleNamespace(log_dict=lambda *a, **k: None)
    curves = LayerCurves("rank", x_axis="step", wandb_charts=False)
    charts = None
    if args.wandb:
        from pytorch_lightning.loggers import WandbLogger

        charts = LayerCurves("rank", x_axis="step")
        wandb_trainer = SimpleNamespace(**{**vars(trainer), "loggers": [WandbLogger(mode="disabled")]})
    print(f"{args.layers} layers x {args.metrics} metrics, step axis; times in ms")
    point = 0
    for size in SIZES:
        costs = []
        while point < size:
            point += 1
            trainer.global_step = 50 * point
            started = time.perf_counter()
            curves.record_and_log(trainer, module, _values(point, args.layers, args.metrics))
            costs.append(time.perf_counter() - started)
        path = curves.curve_path(trainer)
        started = time.perf_counter()
        write_curve_file(directory / "rewrite.json", "rank", curves.layers, curves.metrics, curves.history)
        rewrite = time.perf_counter() - started
        started = time.perf_counter()
        read = read_curve_file(path)
        read_time = time.perf_counter() - started
        assert len(read["history"]) == size, (len(read["history"]), size)
        started = time.perf_counter()
        state = curves.state_dict()
        state_time = time.perf_counter() - started
        buffer = io.BytesIO()
        torch.save(state, buffer)
        line = (
            f"{size:>5} points: record mean {1e3 * statistics.mean(costs):7.2f} max {1e3 * max(costs):7.1f} | "
            f"rewrite {1e3 * rewrite:7.1f} | read {1e3 * read_time:7.1f} | state {1e3 * state_time:6.1f} "
            f"({len(buffer.getvalue()) / 1e6:.1f} MB)"
        )
        if charts is not None:
            for p in range(len(charts.epochs) + 1, size + 1):
                charts.record(50 * p, _values(p, args.layers, args.metrics))
            started = time.perf_counter()
            charts._log_wandb_charts(wandb_trainer)
            sends = sum(curves_module._charts_due(t, charts.wandb_charts_every_n_epochs) for t in range(1, size + 1))
            line += f" | charts {1e3 * (time.perf_counter() - started):7.0f} per send, {sends} sends (before: "
            line += f"{1 + size // charts.wandb_charts_every_n_epochs})"
        print(line, flush=True)
    shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
