"""ElasticDistributedSampler: the permutation contract (hypothesis), resuming at another world
size, and the state's correctness behind a prefetching DataLoader and torchdata's
StatefulDataLoader."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, DistributedSampler

from elasticstore.train import ElasticDistributedSampler


def expected_union(order: list[int], start: int, world: int, drop_last: bool) -> list[int]:
    """order[start:], padded or cut to a multiple of ``world`` as DistributedSampler does."""
    rest = order[start:]
    if drop_last:
        return rest[: len(rest) // world * world]
    total = math.ceil(len(rest) / world) * world
    while len(rest) < total:
        rest = rest + rest[: total - len(rest)]
    return rest


def interleave(outputs: list[list[int]]) -> list[int]:
    """Step j of rank r at global position j * W + r."""
    return [out[j] for j in range(len(outputs[0])) for out in outputs]


def run_ranks(size: int, world: int, **kwargs: Any) -> list[list[int]]:
    return [list(ElasticDistributedSampler(range(size), world, r, **kwargs)) for r in range(world)]


# (size, W, W', s, drop_last, shuffle, seed, epoch)
Case = tuple[int, int, int, int, bool, bool, int, int]
cases = st.integers(min_value=1, max_value=120).flatmap(
    lambda size: st.tuples(
        st.just(size),
        st.integers(min_value=1, max_value=9),  # W
        st.integers(min_value=1, max_value=9),  # W'
        st.integers(min_value=0, max_value=size),  # s
        st.booleans(),  # drop_last
        st.booleans(),  # shuffle
        st.integers(min_value=0, max_value=2**31),  # seed
        st.integers(min_value=0, max_value=5),  # epoch
    )
)


@settings(max_examples=300, deadline=None)
@given(cases)
def test_rank_r_of_w_yields_order_from_start(case: Case) -> None:
    size, world, _, start, drop_last, shuffle, seed, epoch = case
    samplers = [
        ElasticDistributedSampler(range(size), world, r, shuffle=shuffle, seed=seed,
                                  drop_last=drop_last, start_index=start)
        for r in range(world)
    ]
    for s in samplers:
        s.set_epoch(epoch)
    outputs = [list(s) for s in samplers]
    order = samplers[0].global_order()
    assert sorted(order) == list(range(size))
    if not shuffle:
        assert order == list(range(size))
    assert {len(out) for out in outputs} == {len(samplers[0])}
    for r, out in enumerate(outputs):
        assert out == expected_union(order, start, world, drop_last)[r::world]
    assert interleave(outputs) == expected_union(order, start, world, drop_last)


@settings(max_examples=300, deadline=None)
@given(cases, st.integers(min_value=1, max_value=7))
def test_resume_at_another_world_size_is_exact(case: Case, batch: int) -> None:
    """W ranks run some steps and save; W' ranks resume from that state: every sample of the
    epoch is seen exactly once, beyond the padding DistributedSampler adds at the end."""
    size, world, world2, _, drop_last, shuffle, seed, epoch = case
    first = [ElasticDistributedSampler(range(size), world, r, shuffle=shuffle, seed=seed,
                                       drop_last=drop_last) for r in range(world)]
    per_rank = len(first[0])
    steps = (min(per_rank, size // world)) // batch  # stay clear of the padding
    seen: list[int] = []
    for s in first:
        s.set_epoch(epoch)
        it = iter(s)
        for _ in range(steps):
            seen += [next(it) for _ in range(batch)]
            s.advance(batch)
    states = [s.state_dict() for s in first]
    assert all(state == states[0] for state in states)
    assert states[0]["samples_consumed"] == world * steps * batch
    assert states[0]["epoch"] == epoch

    second = [ElasticDistributedSampler(range(size), world2, r, shuffle=shuffle, seed=seed,
                                        drop_last=drop_last) for r in range(world2)]
    for s in second:
        s.load_state_dict(states[0])
        assert s.epoch == epoch
    rest = interleave([list(s) for s in second])
    order = first[0].global_order(epoch)
    consumed = states[0]["samples_consumed"]
    assert rest == expected_union(order, consumed, world2, drop_last)
    counts = Counter(seen) + Counter(order[consumed:])
    assert sorted(seen) == sorted(order[:consumed])
    if not drop_last:
        assert counts == Counter(range(size))  # each exactly once (padding aside)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 60), st.integers(1, 6), st.booleans(), st.booleans(), st.integers(0, 99))
def test_start_zero_is_distributed_sampler(size: int, world: int, drop_last: bool,
                                           shuffle: bool, epoch: int) -> None:
    for r in range(world):
        ours = ElasticDistributedSampler(range(size), world, r, shuffle=shuffle, seed=7,
                                         drop_last=drop_last)
        theirs: DistributedSampler[int] = DistributedSampler(
            range(size), world, r,  # type: ignore[arg-type]
            shuffle=shuffle, seed=7, drop_last=drop_last,
        )
        ours.set_epoch(epoch)
        theirs.set_epoch(epoch)
        assert list(ours) == list(theirs)
        assert len(ours) == len(theirs)


def test_start_index_applies_to_its_epoch_only() -> None:
    s = ElasticDistributedSampler(range(20), 2, 0, start_index=10)
    s.set_epoch(3)
    assert list(s) == s.global_order(3)[10::2]
    assert s.state_dict()["epoch"] == 3 and s.state_dict()["samples_consumed"] == 10
    s.set_epoch(4)  # the epoch only: the next epoch starts at 0
    assert len(s) == 10
    assert list(s) == s.global_order(4)[0::2]
    assert s.global_order(3) != s.global_order(4)


def test_state_counts_what_the_loop_finished() -> None:
    s = ElasticDistributedSampler(range(30), 3, 1, seed=1)
    s.set_epoch(2)
    it = iter(s)
    [next(it) for _ in range(6)]  # handed out 6, the loop finished 4
    s.advance(4)
    assert s.state_dict() == {"epoch": 2, "samples_consumed": 12, "dataset_size": 30, "seed": 1,
                              "shuffle": True}
    s.advance(100)  # capped at the dataset size
    assert s.state_dict()["samples_consumed"] == 30


def test_arguments_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="rank"):
        ElasticDistributedSampler(range(5), 2, 2)
    with pytest.raises(ValueError, match="num_replicas"):
        ElasticDistributedSampler(range(5), 0, 0)
    with pytest.raises(ValueError, match="start_index"):
        ElasticDistributedSampler(range(5), 2, 0, start_index=6)
    s = ElasticDistributedSampler(range(5), 2, 0, seed=1)
    with pytest.raises(ValueError, match="seed"):
        s.load_state_dict(dict(ElasticDistributedSampler(range(5), 2, 0, seed=2).state_dict()))
    with pytest.raises(ValueError, match="dataset_size"):
        s.load_state_dict(dict(ElasticDistributedSampler(range(6), 2, 0, seed=1).state_dict()))
    with pytest.raises(ValueError, match="missing"):
        s.load_state_dict({"epoch": 1})
    with pytest.raises(ValueError, match="n must be"):
        iter(s)
        s.advance(-1)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(RuntimeError, match="RANK / WORLD_SIZE"):
        ElasticDistributedSampler(range(5))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    s = ElasticDistributedSampler(range(5))
    assert (s.rank, s.num_replicas) == (1, 3)


class Indexed(torch.utils.data.Dataset[int]):
    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> int:
        return i


def test_prefetching_dataloader_resumes_exactly_at_another_world_size() -> None:
    """num_workers=2 pulls batches ahead of the loop; advance() keeps the state at what the loop
    finished, and two ranks resuming from three ranks' state see the rest exactly once."""
    size, batch, world = 96, 4, 3
    seen: list[int] = []
    states = []
    for r in range(world):
        sampler = ElasticDistributedSampler(Indexed(size), world, r, seed=5)
        sampler.set_epoch(1)
        loader = DataLoader(Indexed(size), batch_size=batch, sampler=sampler, num_workers=2,
                            prefetch_factor=2)
        for step, got in enumerate(loader):
            seen += got.tolist()
            sampler.advance(len(got))
            if step == 2:
                break
        states.append(sampler.state_dict())
        del loader
    assert all(state == states[0] for state in states)
    assert states[0]["samples_consumed"] == world * 3 * batch
    rest: list[int] = []
    for r in range(2):
        sampler = ElasticDistributedSampler(Indexed(size), 2, r, seed=5)
        sampler.load_state_dict(states[0])
        rest += [i for got in DataLoader(Indexed(size), batch_size=batch, sampler=sampler,
                                         num_workers=2) for i in got.tolist()]
    assert Counter(seen + rest) == Counter(range(size))


def test_stateful_dataloader_resumes_exactly_at_another_world_size() -> None:
    """torchdata's StatefulDataLoader snapshots the sampler's iterator at the batch the loop
    received (no advance() needed); its state resumes at another world size too."""
    tdl = pytest.importorskip("torchdata.stateful_dataloader")
    size, batch, world = 90, 3, 2
    seen: list[int] = []
    loader_states = []
    for r in range(world):
        sampler = ElasticDistributedSampler(Indexed(size), world, r, seed=9)
        sampler.set_epoch(4)
        loader = tdl.StatefulDataLoader(Indexed(size), batch_size=batch, sampler=sampler,
                                        num_workers=2)
        for step, got in enumerate(loader):
            seen += got.tolist()
            if step == 4:
                break
        loader_states.append(loader.state_dict())
        del loader
    rest: list[int] = []
    for r in range(3):
        sampler = ElasticDistributedSampler(Indexed(size), 3, r, seed=9)
        loader = tdl.StatefulDataLoader(Indexed(size), batch_size=batch, sampler=sampler,
                                        num_workers=2)
        loader.load_state_dict(loader_states[0])
        rest += [i for got in loader for i in got.tolist()]
        assert sampler.epoch == 4
    assert len(seen) == world * 5 * batch
    assert Counter(seen + rest) == Counter(range(size))


def test_stateful_dataloader_without_workers_across_epochs() -> None:
    """In-process loading: the loader's state taken mid-way through the second epoch resumes
    there, and the epoch after starts from 0."""
    tdl = pytest.importorskip("torchdata.stateful_dataloader")
    size, batch = 40, 4

    def make() -> tuple[ElasticDistributedSampler, Any]:
        sampler = ElasticDistributedSampler(Indexed(size), 2, 0, seed=2)
        return sampler, tdl.StatefulDataLoader(Indexed(size), batch_size=batch, sampler=sampler)

    sampler, loader = make()
    sampler.set_epoch(0)
    assert sum(len(got) for got in loader) == size // 2
    sampler.set_epoch(1)
    it = iter(loader)
    head = [next(it).tolist() for _ in range(2)]
    state = loader.state_dict()
    tail = [got.tolist() for got in it]
    assert [i for b in head + tail for i in b] == sampler.global_order(1)[0::2]

    sampler2, loader2 = make()
    loader2.load_state_dict(state)
    assert [got.tolist() for got in loader2] == tail
    assert sampler2.epoch == 1
    sampler2.set_epoch(2)
    assert [i for got in loader2 for i in got.tolist()] == sampler2.global_order(2)[0::2]


def test_world_from_the_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "5")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        s = ElasticDistributedSampler(range(7))  # the group wins over the environment
        assert (s.rank, s.num_replicas) == (0, 1)
        assert list(s) == s.global_order()
    finally:
        dist.destroy_process_group()
