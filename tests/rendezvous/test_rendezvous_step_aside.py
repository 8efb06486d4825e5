"""``step_aside()`` (a node whose health check failed): its liveness key goes, so the others'
next round forms without it at once (they would otherwise wait for a participant of the last
round to come back), and its next ``next_rendezvous`` brings it back. Handlers in one process,
on the native store and on etcd (where the liveness key rides on a heartbeat's session)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

import elasticstore

pytestmark = pytest.mark.slow


def _alive(h: Any) -> list[str]:
    return [k.rsplit("/", 1)[-1] for k in h._backend.list(h._keys.alive_prefix)]


@contextmanager
def _native() -> Iterator[tuple[str, str, dict[str, Any]]]:
    with elasticstore.StoreServer("127.0.0.1", 0) as server:
        yield "elasticstore", server.address, {}


def _scenario(backend: str, endpoint: str, conf: dict[str, Any]) -> None:
    params = RendezvousParameters(backend, endpoint, f"job{time.monotonic_ns()}", 1, 2, "127.0.0.1",
                                  last_call_timeout=30, join_timeout=60, **conf)
    a, b = (get_rendezvous_handler(params) for _ in range(2))
    try:
        with ThreadPoolExecutor(2) as pool:
            infos = list(pool.map(lambda h: h.next_rendezvous(), (a, b)))
            assert [i.world_size for i in infos] == [2, 2]
            b.end_round("a worker failed on b")  # b's workers failed; its check then fails
            joined = pool.submit(a.next_rendezvous)
            time.sleep(0.5)
            assert not joined.done()  # a waits for b, a live participant of the last round
            t0 = time.monotonic()
            b.step_aside()
            info = joined.result(30)
            took = time.monotonic() - t0
            assert info.world_size == 1 and a.round is not None and a.round.round == 2
            assert b.node_id not in _alive(a) and b.round is None
            print(f"{backend}: step_aside -> the other's round formed alone in {took:.3f}s")
            assert took < 5.0  # not the last call (30 s) nor the join timeout (60 s)
            # b healthy again: it joins, a's round is replaced and both meet in the next one
            rejoin = pool.submit(b.next_rendezvous)
            time.sleep(0.5)
            assert a.num_nodes_waiting() > 0
            infos = [pool.submit(a.next_rendezvous).result(30), rejoin.result(30)]
            assert [i.world_size for i in infos] == [2, 2] and b.node_id in _alive(a)
    finally:
        for h in (a, b):
            h.shutdown()


def test_step_aside_native() -> None:
    with _native() as (backend, endpoint, conf):
        _scenario(backend, endpoint, conf)


def test_step_aside_etcd(etcd: Any) -> None:
    _scenario("elasticstore-etcd", ",".join(etcd.endpoints), {"lease_ttl": 1})


def test_step_aside_is_a_no_op_for_a_foreign_handler() -> None:
    from elasticstore.rendezvous.api import BasicRendezvous

    class Foreign:
        pass

    step: Callable[[], None] = BasicRendezvous(Foreign(), 0.1).step_aside  # type: ignore[arg-type]
    assert step() is None
