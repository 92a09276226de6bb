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
    if batch is None:
        return []
    if isinstance(loaders, Mapping):
        return [part for key, inner in loaders.items() for part in combined_parts(inner, batch[key])]
    if isinstance(loaders, (list, tuple)):
        return [part for inner, value in zip(loaders, batch) for part in combined_parts(inner, value)]
    return [batch]
