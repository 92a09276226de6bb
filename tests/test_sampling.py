from collections import Counter

import pytest
import torch
from lightning_fabric.utilities.distributed import DistributedSamplerWrapper
from torch.utils.data import DataLoader, DistributedSampler, SequentialSampler, TensorDataset

from rank_lightning.sampling import limit_to_own_samples, own_samples, repeated_samples


def _loader(size: int, replicas: int, rank: int, **options) -> DataLoader:
    dataset = TensorDataset(torch.arange(size))
    sampler = DistributedSampler(dataset, num_replicas=replicas, rank=rank, **options)
    return DataLoader(dataset, batch_size=3, sampler=sampler)


@pytest.mark.parametrize("size", [1, 2, 5, 7, 12, 13, 61])
@pytest.mark.parametrize("replicas", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("shuffle", [False, True])
def test_the_processes_own_samples_cover_the_dataset_once(size, replicas, shuffle):
    counts = Counter()
    for rank in range(replicas):
        loader = _loader(size, replicas, rank, shuffle=shuffle, seed=3)
        indices = list(loader.sampler)
        own = own_samples(loader)
        kept = indices if own is None else indices[:own]
        assert repeated_samples(loader) == len(indices) - len(kept)
        counts.update(kept)
    assert counts == Counter(range(size))


def test_lightnings_wrapper_of_a_custom_sampler_pads_alike():
    dataset = TensorDataset(torch.arange(7))
    counts = Counter()
    for rank in range(3):
        sampler = DistributedSamplerWrapper(SequentialSampler(dataset), num_replicas=3, rank=rank, shuffle=False)
        loader = DataLoader(dataset, batch_size=2, sampler=sampler)
        indices = list(sampler)
        own = own_samples(loader)
        counts.update(indices if own is None else indices[:own])
    assert counts == Counter(range(7))
    assert [
        repeated_samples(
            DataLoader(
                dataset,
                sampler=DistributedSamplerWrapper(SequentialSampler(dataset), num_replicas=3, rank=r, shuffle=False),
            )
        )
        for r in range(3)
    ] == [0, 1, 1]


def test_loaders_without_repeats():
    dataset = TensorDataset(torch.arange(7))
    assert repeated_samples(DataLoader(dataset, batch_size=2)) == 0
    assert own_samples(DataLoader(dataset, batch_size=2)) is None
    # drop_last=True drops samples instead of repeating them.
    assert repeated_samples(_loader(7, 2, 1, drop_last=True)) == 0
    assert repeated_samples(_loader(8, 2, 1)) == 0

    class Custom(DistributedSampler):
        pass

    # A subclass may deal samples out its own way: its repeats are unknown, so none are left out.
    custom = DataLoader(dataset, sampler=Custom(dataset, num_replicas=2, rank=1, shuffle=False))
    assert repeated_samples(custom) == 0
    assert repeated_samples(object()) == 0


def test_limit_to_own_samples():
    loader = _loader(7, 2, 1)  # 4 samples, the last a repeat
    assert limit_to_own_samples(None, loader) == 3
    assert limit_to_own_samples(2, loader) == 2
    assert limit_to_own_samples(10, loader) == 3
    assert limit_to_own_samples(10, _loader(8, 2, 1)) == 10
    assert limit_to_own_samples(None, _loader(8, 2, 1)) is None


def test_combined_parts_follow_the_loaders_collection_and_leave_out_exhausted_ones():
    from rank_lightning.sampling import combined_parts

    loaders = {"a": "la", "b": ["lb", {"c": "lc"}]}
    batch = {"a": (1, 2), "b": [(3, 4), {"c": (5, 6)}]}
    assert combined_parts(loaders, batch) == [(1, 2), (3, 4), (5, 6)]
    # A "max_size" batch holds None for the loaders it has no batch of, nested ones too.
    assert combined_parts(loaders, {"a": None, "b": [(3, 4), None]}) == [(3, 4)]
    assert combined_parts("one loader", (1, 2)) == [(1, 2)]


@pytest.mark.parametrize(("mode", "passes_of_b"), [("max_size_cycle", 2), ("max_size", 1)])
def test_the_own_rows_of_combined_batches_cover_each_loader_once_per_pass(mode, passes_of_b):
    from pytorch_lightning.utilities import CombinedLoader

    from rank_lightning.sampling import CombinedOwnRows

    counts = Counter()
    for rank in range(2):
        # 7 and 3 samples (b's values from 100 on): the second process's last sample of each loader is a repeat.
        b = _loader(3, 2, rank)
        b.dataset.tensors = (torch.arange(100, 103),)
        loaders = {"a": _loader(7, 2, rank), "b": [b]}
        own = CombinedOwnRows(loaders)
        assert own.repeats == (rank == 1)
        for batch, _, _ in CombinedLoader(loaders, mode):
            rows = torch.cat([part[0] for part in (batch["a"], batch["b"][0]) if part is not None])
            total, kept = own.rows(batch, lambda part: part[0].shape[0])
            assert total == len(rows)
            counts.update(rows.tolist() if kept is None else rows[kept].tolist())
    # Every sample once per pass over its loader: b, the shorter, is read again under max_size_cycle.
    assert counts == Counter(list(range(7)) + passes_of_b * list(range(100, 103)))
