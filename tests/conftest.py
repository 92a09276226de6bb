"""Suite-wide settings."""

import os
from collections.abc import Iterator

import pytest
import torch


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
def restore_environment() -> Iterator[None]:
    """Give every test the environment it started with.

    An in-process DDP fit sets ``LOCAL_RANK``, ``MASTER_PORT`` and friends in ``os.environ``; a training subprocess
    started later with a copy of that environment would then believe its processes are launched externally and wait
    for a second process that never comes.
    """
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture
def callback_messages(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The messages the package's callbacks send through Lightning's ``rank_zero_info``, in order.

    Lightning's logger does not propagate to the root logger (so ``caplog`` does not see it) and its stream handler
    keeps the ``stderr`` of import time (so ``capsys`` does not either); the callbacks' one message function is
    recorded instead.
    """
    messages: list[str] = []
    monkeypatch.setattr(
        "rank_lightning.callbacks.base.rank_zero_info", lambda message, *a, **k: messages.append(message)
    )
    return messages
