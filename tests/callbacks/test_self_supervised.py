"""Self-supervised learning: two views of a batch, momentum (EMA) target networks, the figure workers' pipes."""

import gc
import io
import os
import signal
import sys
import warnings
from types import SimpleNamespace

from rank_lightning import figure_workers


def test_a_figure_worker_closes_its_answer_pipe_when_it_exits(monkeypatch):
    # A worker's answers go to a duplicate of its standard output; left open at exit, the interpreter printed
    # "ResourceWarning: unclosed file <_io.BufferedWriter name=3>" at the end of a fit (PYTHONWARNINGS=default).
    read, write = os.pipe()
    exit_message = figure_workers._TAG + (0).to_bytes(8, "little")
    monkeypatch.setattr(sys, "stdin", SimpleNamespace(buffer=io.BytesIO(exit_message)))
    handler = signal.getsignal(signal.SIGINT)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            figure_workers._serve(write)
            gc.collect()
    finally:
        signal.signal(signal.SIGINT, handler)
    assert [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)] == []
    assert os.read(read, 1) == b""  # the write end is closed: the reader sees the end of the pipe
    os.close(read)
