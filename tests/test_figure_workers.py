"""Figures drawn by worker processes: the same bytes as drawn in place, errors reported, nothing lost."""

import os
import random
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
from matplotlib import rc_context
from pytorch_lightning.loggers import CSVLogger

import rank_lightning.callbacks.curves as curves_module
from rank_lightning import figure_workers
from rank_lightning.callbacks import ActivationRankMonitor, WeightRankMonitor
from rank_lightning.figure_workers import (
    MAX_WORKERS,
    MIN_PARALLEL_FIGURES,
    WORKERS_ENV,
    FigureJob,
    draw_figures,
    shutdown_figure_workers,
    start_figure_workers,
)
from rank_lightning.figure_workers import (
    figure_workers as workers_for,
)
from rank_lightning.plotting import layer_curves_figure
from tests.callbacks.trainer_helpers import SmallClassifier, quiet_trainer, small_loader

LAYERS = ["blocks.0", "blocks.1", "blocks.2", "head"]


def _history(seed: int) -> dict:
    generator = random.Random(seed)
    return {epoch: {layer: {"m": generator.uniform(0, 50)} for layer in LAYERS} for epoch in range(-1, 6)}


def _jobs(directory, count: int = 5) -> list[FigureJob]:
    return [
        FigureJob(
            directory / f"figure_{i}.png",
            layer_curves_figure,
            ("rank", "m", LAYERS, _history(i)),
            {"caption": f"validation split, {100 + i} samples"},
        )
        for i in range(count)
    ]


@pytest.fixture(autouse=True)
def no_setting(monkeypatch):
    monkeypatch.delenv(WORKERS_ENV, raising=False)


def _noting_its_process(*args, pids: str, **kwargs):
    """``layer_curves_figure``, leaving a file named after the process that drew it in ``pids``."""
    (Path(pids) / str(os.getpid())).touch()
    return layer_curves_figure(*args, **kwargs)


def test_workers_draw_the_same_bytes_as_the_caller_in_job_order(tmp_path):
    here = draw_figures(_jobs(tmp_path / "here", count=8), workers=0)
    progress = []
    pids = tmp_path / "pids"
    pids.mkdir()
    jobs = [
        job._replace(draw=_noting_its_process, kwargs={**job.kwargs, "pids": str(pids)})
        for job in _jobs(tmp_path / "shared", count=8)
    ]
    shared = draw_figures(jobs, workers=2, on_figure=lambda i, result: progress.append(i))
    assert here == [tmp_path / "here" / f"figure_{i}.png" for i in range(8)]
    assert shared == [tmp_path / "shared" / f"figure_{i}.png" for i in range(8)]
    assert sorted(progress) == list(range(8))
    assert [path.read_bytes() for path in shared] == [path.read_bytes() for path in here]
    assert len({path.read_bytes() for path in here}) == 8  # eight different figures, not one drawn eight times
    drawers = {int(path.name) for path in pids.iterdir()}
    assert os.getpid() in drawers and len(drawers) >= 2  # the caller and at least one worker drew


def test_workers_draw_with_the_callers_matplotlib_settings(tmp_path):
    plain = draw_figures(_jobs(tmp_path / "plain"), workers=0)
    with rc_context({"lines.linewidth": 4.0, "axes.facecolor": "#eeeeee"}):
        here = draw_figures(_jobs(tmp_path / "here"), workers=0)
        shared = draw_figures(_jobs(tmp_path / "shared"), workers=2)
    assert [path.read_bytes() for path in shared] == [path.read_bytes() for path in here]
    assert all(a.read_bytes() != b.read_bytes() for a, b in zip(here, plain))


def _fails_in_a_worker(*args, **kwargs):
    """``layer_curves_figure`` in the calling process; an error in a worker (``python -c``)."""
    if sys.argv[0] == "-c":
        raise ValueError("no figure in a worker")
    return layer_curves_figure(*args, **kwargs)


def test_an_error_raised_in_a_worker_is_returned_for_its_figure(tmp_path):
    jobs = [job._replace(draw=_fails_in_a_worker) for job in _jobs(tmp_path, count=8)]
    results = draw_figures(jobs, workers=2)
    failed = [i for i, result in enumerate(results) if isinstance(result, Exception)]
    assert failed  # the workers drew (and failed) some
    assert all(str(results[i]) == "no figure in a worker" and isinstance(results[i], ValueError) for i in failed)
    assert all(results[i] == tmp_path / f"figure_{i}.png" for i in range(8) if i not in failed)
    assert all(not (tmp_path / f"figure_{i}.png").exists() for i in failed)


def _sleeps_in_a_worker(*args, **kwargs):
    """``layer_curves_figure`` in the calling process; a worker (``python -c``) never answers."""
    if sys.argv[0] == "-c":
        time.sleep(3600)
    return layer_curves_figure(*args, **kwargs)


def test_a_worker_that_never_answers_is_killed_and_its_figure_drawn_by_the_caller(tmp_path, monkeypatch):
    monkeypatch.setattr(figure_workers, "STALL_SECONDS", 1.0)
    jobs = [job._replace(draw=_sleeps_in_a_worker) for job in _jobs(tmp_path / "shared", count=6)]
    with pytest.warns(RuntimeWarning, match="figure worker process failed"):
        results = draw_figures(jobs, workers=2)
    here = draw_figures(_jobs(tmp_path / "here", count=6), workers=0)
    assert [path.read_bytes() for path in results] == [path.read_bytes() for path in here]


def test_a_function_of_the_callers_main_module_is_drawn_by_the_caller(tmp_path, monkeypatch):
    def main_figure(*args, **kwargs):
        return layer_curves_figure(*args, **kwargs)

    main_figure.__module__, main_figure.__qualname__ = "__main__", "main_figure"
    monkeypatch.setattr(sys.modules["__main__"], "main_figure", main_figure, raising=False)
    jobs = [job._replace(draw=main_figure) for job in _jobs(tmp_path / "main", count=6)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a worker cannot load it: not a failure, the caller draws it
        results = draw_figures(jobs, workers=2)
    here = draw_figures(_jobs(tmp_path / "here", count=6), workers=0)
    assert [path.read_bytes() for path in results] == [path.read_bytes() for path in here]
    assert all(worker.alive for worker in figure_workers._POOL.get(2))  # the workers lived on


def test_garbage_on_a_pipe_is_not_read_as_a_message():
    import io

    with pytest.raises(EOFError, match="not a message of the figure workers"):
        figure_workers._read_message(io.BytesIO(b"Loading plugin...\n" + b"x" * 40))
    stream = io.BytesIO()
    figure_workers._write_message(stream, b"payload")
    stream.seek(0)
    assert figure_workers._read_message(stream) == b"payload"


def test_a_failing_figure_is_returned_with_its_error_and_the_others_are_written(tmp_path):
    jobs = _jobs(tmp_path)
    jobs[2] = jobs[2]._replace(args=("rank", "m", LAYERS, None))  # no history: fails inside the drawing
    results = draw_figures(jobs, workers=2)
    assert isinstance(results[2], (TypeError, AttributeError, RuntimeError))
    assert not (tmp_path / "figure_2.png").exists()
    assert [results[i] for i in (0, 1, 3, 4)] == [tmp_path / f"figure_{i}.png" for i in (0, 1, 3, 4)]


def test_a_job_a_worker_cannot_load_is_drawn_by_the_caller(tmp_path):
    def local_figure(*args, **kwargs):  # a local function cannot be sent to another process
        return layer_curves_figure(*args, **kwargs)

    jobs = [job._replace(draw=local_figure) for job in _jobs(tmp_path / "local")]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning: nothing failed
        results = draw_figures(jobs, workers=2)
    here = draw_figures(_jobs(tmp_path / "here"), workers=0)
    assert [path.read_bytes() for path in results] == [path.read_bytes() for path in here]


def _exits_in_a_worker(*args, **kwargs):
    """``layer_curves_figure``, except in a worker process (``python -c``), which it ends at once."""
    if sys.argv[0] == "-c":
        os._exit(3)
    return layer_curves_figure(*args, **kwargs)


def test_figures_of_a_worker_that_dies_are_drawn_by_the_caller_with_a_warning(tmp_path):
    shutdown_figure_workers()
    assert start_figure_workers() == workers_for(2 * MAX_WORKERS)
    jobs = [job._replace(draw=_exits_in_a_worker) for job in _jobs(tmp_path / "shared", count=8)]
    with pytest.warns(RuntimeWarning, match=rf"figure worker process failed.*EOFError.*{WORKERS_ENV}=0"):
        results = draw_figures(jobs, workers=2)
    here = draw_figures(_jobs(tmp_path / "here", count=8), workers=0)
    assert [path.read_bytes() for path in results] == [path.read_bytes() for path in here]
    # The next call starts new workers in place of the dead ones.
    assert all(worker.alive for worker in figure_workers._POOL.get(2))
    shutdown_figure_workers()
    assert figure_workers._POOL.get(0) == []


def test_dead_workers_are_replaced_before_drawing(tmp_path):
    for worker in figure_workers._POOL.get(2):
        worker.process.kill()
        worker.process.wait()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        results = draw_figures(_jobs(tmp_path), workers=2)
    assert results == [tmp_path / f"figure_{i}.png" for i in range(5)]


def test_how_many_workers(monkeypatch):
    monkeypatch.setattr(figure_workers, "_available_cores", lambda: 16)
    assert workers_for(MIN_PARALLEL_FIGURES - 1) == 0  # too few figures to share
    assert workers_for(MIN_PARALLEL_FIGURES) == MIN_PARALLEL_FIGURES - 1  # the caller draws one of them
    assert workers_for(40) == MAX_WORKERS
    assert workers_for(40, workers=3) == 3
    assert workers_for(2, workers=5) == 1
    monkeypatch.setattr(figure_workers, "_available_cores", lambda: 1)
    assert workers_for(40) == 0  # one core: the caller draws alone
    monkeypatch.setenv(WORKERS_ENV, "0")
    monkeypatch.setattr(figure_workers, "_available_cores", lambda: 16)
    assert workers_for(40) == 0
    monkeypatch.setenv(WORKERS_ENV, "2")
    assert workers_for(40) == 2
    assert workers_for(40, workers=4) == 4  # the argument wins over the environment


@pytest.mark.parametrize("value", ["-1", "two", "1.5"])
def test_a_bad_worker_setting_is_named(monkeypatch, value):
    monkeypatch.setenv(WORKERS_ENV, value)
    with pytest.raises(ValueError, match=rf"{WORKERS_ENV}='{value}' is not a number of worker processes"):
        workers_for(10)
    with pytest.raises(ValueError, match="workers=-2 is not a number of worker processes"):
        workers_for(10, workers=-2)


def test_workers_that_cannot_start_leave_every_figure_to_the_caller(tmp_path, monkeypatch):
    shutdown_figure_workers()
    monkeypatch.setattr(figure_workers.sys, "executable", "")  # an embedded interpreter: nothing to start
    assert start_figure_workers() == 0
    with pytest.warns(RuntimeWarning, match="figure worker process failed"):
        results = draw_figures(_jobs(tmp_path), workers=2)
    assert results == [tmp_path / f"figure_{i}.png" for i in range(5)]


def test_handing_the_settings_over_imports_no_pyplot():
    code = (
        "import sys; from rank_lightning.figure_workers import _caller_rc; rc = _caller_rc(); "
        "print('matplotlib.pyplot' in sys.modules, 'lines.linewidth' in rc, 'backend' in rc)"
    )
    output = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert output.split() == ["False", "True", "False"]


def _tiny_fit(directory: Path, callbacks: list) -> None:
    trainer = quiet_trainer(callbacks, max_epochs=2, logger=CSVLogger(directory))
    trainer.fit(SmallClassifier(widths=(4, 6, 3)), small_loader(features=4), small_loader(features=4))


def test_a_fit_starts_workers_at_its_first_record_only_for_enough_figures(tmp_path, monkeypatch):
    counts: list[int] = []
    start = curves_module.start_figure_workers
    monkeypatch.setattr(curves_module, "start_figure_workers", lambda count: counts.append(count) or start(count))
    monkeypatch.setattr(figure_workers, "_available_cores", lambda: 2)
    shutdown_figure_workers()
    few = WeightRankMonitor(metrics=("stable_rank",), verbose=False)
    _tiny_fit(tmp_path / "few", [few])
    assert counts == [1] * len(few.curves.epochs) and len(counts) >= 2  # one figure, at every record: no worker
    assert figure_workers._POOL.get(0) == [] and not figure_workers._POOL._workers
    counts.clear()
    monitors = [ActivationRankMonitor(log_at_init=True, verbose=False), WeightRankMonitor(verbose=False)]
    _tiny_fit(tmp_path / "many", monitors)
    drawn = sum(len(monitor.curves.drawn_metrics) for monitor in monitors)
    assert drawn >= MIN_PARALLEL_FIGURES
    # The initial point of the first monitor already asks for its own figures; later records for the run's.
    assert counts[0] == len(monitors[0].curves.drawn_metrics) and counts[-1] == drawn
    assert len(figure_workers._POOL._workers) == 1  # two cores: one worker beside the caller
    assert len(list((tmp_path / "many").rglob("*.png"))) == drawn
    shutdown_figure_workers()


def test_a_bad_worker_setting_stops_a_fit_at_its_start(tmp_path, monkeypatch):
    monkeypatch.setenv(WORKERS_ENV, "many")
    monitor = WeightRankMonitor(verbose=False)
    with pytest.raises(ValueError, match=rf"{WORKERS_ENV}='many' is not a number of worker processes"):
        _tiny_fit(tmp_path, [monitor])
    assert not monitor.curves.epochs  # nothing was measured
