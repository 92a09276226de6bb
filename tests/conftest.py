"""Suite-wide settings."""

from collections.abc import Iterator

import pytest
import torch

from rank_lightning.callbacks.curves import wait_for_figures


@pytest.fixture(autouse=True, scope="session")
def single_thread() -> Iterator[None]:
    """Run every test on one intra-op thread.

    The test tensors are small: threads only add synchronisation, and on a busy 2-core machine the threads of a
    parallel region wait for each other (a ResNet-50 step measured 0.6 s on one thread and 6 s on two). DDP tests
    start one process per core instead.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def finish_background_figures() -> Iterator[None]:
    """Let figures drawn in the background after a fit finish before the test's temporary directory goes away."""
    yield
    assert wait_for_figures(timeout=120), "figures still being drawn 120 s after the test"
