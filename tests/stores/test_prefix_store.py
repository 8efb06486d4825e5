"""elasticstore.PrefixStore: queues and list_keys under a prefix, which torch's PrefixStore cannot
forward to a store written in Python."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch.distributed as dist

import elasticstore
from elasticstore import Store, StoreServer

SHORT = timedelta(seconds=10)


@pytest.fixture
def store() -> Iterator[Store]:
    with StoreServer() as server, Store(server.host, server.port, timeout=SHORT) as st:
        yield st


def test_torch_prefix_store_cannot_forward_queues_ours_can(store: Store) -> None:
    theirs = dist.PrefixStore("job", store)
    with pytest.raises(NotImplementedError):  # torch's PythonStore trampoline lacks queues
        theirs.queue_push("q", "a")
    ours = elasticstore.PrefixStore("job", store)
    ours.queue_push("q", "a")
    ours.queue_push("q", "b")
    assert ours.queue_len("q") == 2 and store.queue_len("job/q") == 2
    assert ours.check(["q"])
    assert ours.queue_pop("q") == b"a"
    assert ours.queue_pop("q", block=False) == b"b"
    with pytest.raises(dist.QueueEmptyError):
        ours.queue_pop("q", block=False)


def test_same_keys_as_torch_prefix_store(store: Store) -> None:
    theirs = dist.PrefixStore("job", store)
    ours = elasticstore.PrefixStore("job", store)
    theirs.set("a", "1")
    assert ours.get("a") == b"1" and store.get("job/a") == b"1"
    ours.set("b", "2")
    assert theirs.get("b") == b"2"
    assert ours.add("n", 3) == 3 and theirs.add("n", 1) == 4
    assert ours.list_keys() == ["a", "b", "n"]
    nested = elasticstore.PrefixStore("inner", ours)
    nested.set("c", "3")
    assert store.get("job/inner/c") == b"3"
    assert ours.list_keys("inner/") == ["inner/c"]


def test_init_process_group_over_it(store: Store) -> None:
    ours = elasticstore.PrefixStore("pg", store)
    dist.init_process_group("gloo", store=ours, rank=0, world_size=1, timeout=SHORT)
    try:
        dist.barrier()
    finally:
        dist.destroy_process_group()
    assert any(k.startswith("pg/") for k in store.list_keys())
