"""Which samples of a process's pass are its own: the repeats a distributed sampler adds are left out.

With ``drop_last=False`` (Lightning's choice for the loaders it gives each DDP process) PyTorch's
``DistributedSampler`` gives every process ``ceil(n / world_size)`` samples: the index list is padded to
``world_size * ceil(n / world_size)`` entries by repeating its first ones, and process ``r`` reads entries
``r, r + world_size, ...``. Summed over the processes, a pass would count the repeated samples twice, and a metric
of an uneven validation set would differ from one process's. The repeats are the last entries of the padded list, so
they are the last samples of the processes that read them: each process measures its first
:func:`own_samples` samples and leaves the rest out, and the processes together measure every sample exactly once.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

__all__ = [
    "READABLE_ADVICE",
    "UNREADABLE_LOADER",
    "CombinedOwnRows",
    "combined_parts",
    "limit_to_own_samples",
    "own_samples",
    "process_share",
    "readable_beside",
    "repeated_samples",
    "side_loader",
]


def _padding_sampler(loader: Any) -> DistributedSampler | None:
    """The loader's ``DistributedSampler`` when it is one whose padding rule is known (PyTorch's own, or Lightning's
    wrapper of a custom sampler, which pads the same way); ``None`` otherwise."""
    sampler = getattr(loader, "sampler", None)
    if not isinstance(sampler, DistributedSampler):
        sampler = getattr(getattr(loader, "batch_sampler", None), "sampler", None)
    if not isinstance(sampler, DistributedSampler) or getattr(sampler, "drop_last", True):
        return None
    known = {"DistributedSampler", "DistributedSamplerWrapper"}
    if type(sampler).__name__ not in known or not type(sampler).__module__.startswith(("torch.", "lightning")):
        return None  # a subclass of the user's, or Lightning's unrepeated sampler for prediction: no padding known
    return sampler


def repeated_samples(loader: Any) -> int:
    """How many samples at the end of this process's pass over ``loader`` repeat samples that a process reads earlier
    (the padding of a ``DistributedSampler`` with ``drop_last=False``); 0 for any other loader.

    Process ``r`` of ``R`` reads entries ``r + k R`` (``k < ceil(n / R)``) of the padded index list, of which the
    entries at ``n`` and beyond are repeats.
    """
    sampler = _padding_sampler(loader)
    if sampler is None:
        return 0
    size, replicas, rank, per_process = len(sampler.dataset), sampler.num_replicas, sampler.rank, sampler.num_samples
    own = math.ceil((size - rank) / replicas) if size > rank else 0
    return max(per_process - own, 0)


def own_samples(loader: Any) -> int | None:
    """Samples of this process's pass over ``loader`` that are not repeats, when the loader repeats any (see
    :func:`repeated_samples`); ``None`` when every sample it gives is its own."""
    repeated = repeated_samples(loader)
    if not repeated:
        return None
    sampler = _padding_sampler(loader)
    return len(sampler) - repeated


def limit_to_own_samples(limit: int | None, loader: Any) -> int | None:
    """``limit`` (samples this process measures, ``None`` for all) lowered to its :func:`own_samples` of ``loader``."""
    own = own_samples(loader)
    if own is None:
        return limit
    return own if limit is None else min(limit, own)


def process_share(total: int | None, world_size: int, rank: int) -> int | None:
    """This process's share of ``total`` samples measured over ``world_size`` processes: ``total // world_size``,
    one more on the first ``total % world_size`` processes, so the shares add up to ``total`` (``None``: all)."""
    if total is None:
        return None
    world_size = max(world_size, 1)
    return total // world_size + int(rank < total % world_size)


def side_loader(loader: Any) -> Any:
    """A loader to iterate beside a loop that is iterating ``loader`` itself: ``loader`` when a pass of its own leaves
    the loop's iterator alone, else a plain ``DataLoader`` over the same dataset, batches and collation.

    A ``DataLoader`` with ``persistent_workers=True`` keeps one iterator and ``iter()`` resets it, and a resumable
    loader (one with ``state_dict``, such as torchdata's ``StatefulDataLoader``) saves the position of its last iterator
    in checkpoints: a monitor's pass over the training loader would make the fit skip batches, or resume at the
    monitor's position. The copy shares the batch sampler (so a ``DistributedSampler``'s share and padding stay those of
    the loop) and starts workers of its own for the pass, if the loader has workers. Collections of loaders (a list,
    tuple or mapping, as Lightning accepts them) are copied loader by loader.
    """
    if isinstance(loader, dict):
        return {key: side_loader(inner) for key, inner in loader.items()}
    if isinstance(loader, (list, tuple)):
        return type(loader)(side_loader(inner) for inner in loader)
    if not isinstance(loader, DataLoader):
        return loader
    persistent = loader.persistent_workers and loader.num_workers > 0
    if not persistent and not callable(getattr(loader, "state_dict", None)):
        return loader
    workers = {
        "num_workers": loader.num_workers,
        "collate_fn": loader.collate_fn,
        "pin_memory": loader.pin_memory,
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        "multiprocessing_context": loader.multiprocessing_context if loader.num_workers else None,
        "generator": loader.generator,
        "prefetch_factor": loader.prefetch_factor if loader.num_workers else None,
    }
    if isinstance(loader.dataset, IterableDataset):
        return DataLoader(loader.dataset, batch_size=loader.batch_size, drop_last=loader.drop_last, **workers)
    if loader.batch_sampler is None:  # batching off: one sample at a time
        return DataLoader(loader.dataset, batch_size=None, sampler=loader.sampler, **workers)
    return DataLoader(loader.dataset, batch_sampler=loader.batch_sampler, **workers)


UNREADABLE_LOADER = "a one-pass iterator (a generator) or a resumable iterable that is not a DataLoader"
"""What :func:`readable_beside` refuses, in words, for the messages of the callbacks that would read such a loader."""

READABLE_ADVICE = "Pass a DataLoader (of an IterableDataset for a stream)"
"""What to pass instead of such a loader."""


def readable_beside(loader: Any) -> bool:
    """Whether a pass over :func:`side_loader` of ``loader`` leaves the batches of a loop iterating ``loader`` alone:
    true for a ``DataLoader`` and for iterables that give a fresh iterator each time (a list of batches); false for a
    one-pass iterator (a generator, ``iter(loader)``), whose batches a pass would take from the loop, and for a
    resumable iterable that is not a ``DataLoader`` (one with ``state_dict``), which cannot be copied and whose next
    iterator starts where a checkpoint left it. Collections of loaders are readable when each of them is."""
    if isinstance(loader, Mapping):
        return all(readable_beside(inner) for inner in loader.values())
    if isinstance(loader, (list, tuple)):
        return all(readable_beside(inner) for inner in loader)
    if isinstance(loader, DataLoader):
        return True
    return not isinstance(loader, Iterator) and not callable(getattr(loader, "state_dict", None))


def combined_parts(loaders: Any, batch: Any) -> list[Any]:
    """The per-loader batches of a ``batch`` that Lightning's ``CombinedLoader`` made of the collection ``loaders`` (a
    list, tuple or dict, possibly nested), in the order of their flattening (a dict's values in order), without the
    loaders a ``"max_size"`` batch has none of; ``[batch]`` when ``loaders`` is one loader."""
    return [part for _, part in _loader_parts(loaders, batch) if part is not None]


def _loader_parts(loaders: Any, batch: Any) -> list[tuple[Any, Any]]:
    """``(loader, per-loader batch)`` for every loader of the collection ``loaders`` in :func:`combined_parts` order,
    the batch ``None`` where a ``"max_size"`` batch has none of that loader."""
    if isinstance(loaders, Mapping):
        return [pair for key, inner in loaders.items() for pair in _loader_parts(inner, _part(batch, key))]
    if isinstance(loaders, (list, tuple)):
        return [pair for index, inner in enumerate(loaders) for pair in _loader_parts(inner, _part(batch, index))]
    return [(loaders, batch)]


def _part(batch: Any, key: Any) -> Any:
    if batch is None:
        return None
    if isinstance(batch, Mapping):
        return batch.get(key)
    return batch[key] if key < len(batch) else None


class CombinedOwnRows:
    """Which rows of a process's combined batches (Lightning's ``CombinedLoader`` of several loaders, whose per-loader
    batches a step's forward pass takes concatenated in loader order) are its own, not the samples a
    ``DistributedSampler`` repeats at the end of the process's pass over one of the loaders (:func:`own_samples`).

    A loader's rows are counted from the start of the process's pass over it; a loader read again within the pass
    (``"max_size_cycle"``) starts a new pass over its samples, with its repeats at its end again.

    Args:
        loaders: the collection of loaders (a list, tuple or dict, possibly nested) the batches are combined from.

    Attributes:
        read: the rows read so far from each loader, in :func:`combined_parts` order (saved with a pass in a
            checkpoint, so that a resumed pass counts on from them).
    """

    def __init__(self, loaders: Any) -> None:
        self.loaders = loaders
        leaves = [loader for loader, _ in _loader_parts(loaders, None)]
        self._own = [own_samples(loader) for loader in leaves]
        self._pass = [_samples_per_pass(loader) for loader in leaves]
        self.read = [0] * len(leaves)

    @property
    def repeats(self) -> bool:
        """Whether some loader repeats samples at the end of this process's pass over it."""
        return any(own is not None for own in self._own)

    def rows(self, batch: Any, batch_size: Any) -> tuple[int, list[int] | None]:
        """``(rows, own)`` of the combined ``batch``: its rows in all (each per-loader batch's size by ``batch_size``)
        and the indices of its rows that are this process's own, ``None`` when all are."""
        total, kept = 0, []
        for index, (_, part) in enumerate(_loader_parts(self.loaders, batch)):
            size = (batch_size(part) or 0) if part is not None else 0
            start, own, per_pass = self.read[index], self._own[index], self._pass[index]
            self.read[index] += size
            kept += [total + row for row in range(size) if own is None or (start + row) % per_pass < own]
            total += size
        return total, kept if len(kept) < total else None


def _samples_per_pass(loader: Any) -> int | None:
    """The samples one pass of this process over ``loader`` gives, when its sampler repeats any."""
    sampler = _padding_sampler(loader)
    if sampler is None:
        return None
    samples, batch_size = len(sampler), getattr(loader, "batch_size", None)
    if getattr(loader, "drop_last", False) and batch_size:
        samples -= samples % batch_size
    return samples
