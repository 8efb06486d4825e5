"""Handlers in one process (threads): distinct nodes; the plugin registry; the static backend."""

from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters, RendezvousStoreInfo
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

import elasticstore


def params(backend: str, endpoint: str, lo: int, hi: int, addr: str, **conf: Any) -> RendezvousParameters:
    return RendezvousParameters(backend, endpoint, "job", lo, hi, addr, **conf)


def test_handlers_in_one_process_are_distinct_nodes() -> None:
    with elasticstore.StoreServer("127.0.0.1", 0) as server:
        handlers = [
            get_rendezvous_handler(params("elasticstore", server.address, 3, 3, "127.0.0.1",
                                          timeout=900, last_call_timeout=0.2))
            for _ in range(3)
        ]
        try:
            assert all(h.get_backend() == "elasticstore" for h in handlers)
            with ThreadPoolExecutor(3) as pool:
                infos = list(pool.map(lambda h: h.next_rendezvous(), handlers))
            assert sorted(i.rank for i in infos) == [0, 1, 2]  # same address, distinct nodes
            assert [i.rank for i in infos] == [0, 1, 2]  # local ids order them
            assert {i.world_size for i in infos} == {3}
            assert all(h.use_agent_store and h.get_run_id() == "job" for h in handlers)
            assert all(h.num_nodes_waiting() == 0 and not h.is_closed() for h in handlers)
            boot = infos[0].bootstrap_store_info
            assert isinstance(boot, RendezvousStoreInfo) and boot.master_addr == "127.0.0.1"
        finally:
            for h in handlers:
                h.shutdown()


def test_unknown_conf_key_is_refused_at_creation() -> None:
    with pytest.raises(ValueError, match="unknown key.*last_cal_timeout"):
        get_rendezvous_handler(params("elasticstore", "127.0.0.1:1", 1, 2, "127.0.0.1",
                                      last_cal_timeout=1))


def test_static_backend_fixed_ranks() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.2", 0))
        port = sock.getsockname()[1]
    endpoint = f"127.0.0.2:{port}"
    handlers = [get_rendezvous_handler(params("elasticstore-static", endpoint, 2, 2, None,
                                              rank=r, join_timeout=30)) for r in (0, 1)]
    try:
        results: list[Any] = [None, None]

        def run(r: int) -> None:
            results[r] = handlers[r].next_rendezvous()

        threads = [threading.Thread(target=run, args=(r,)) for r in (1, 0)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert [(i.rank, i.world_size) for i in results] == [(0, 2), (1, 2)]
        assert results[1].bootstrap_store_info == RendezvousStoreInfo("127.0.0.2", port)
        results[0].store.set("k", "v")
        assert results[1].store.get("k") == b"v"
        assert handlers[0].get_backend() == "elasticstore-static"
    finally:
        for h in reversed(handlers):
            h.shutdown()
    with pytest.raises(ValueError, match="nnodes must be fixed"):
        get_rendezvous_handler(params("elasticstore-static", endpoint, 1, 2, None, rank=0))


def test_localhost_endpoint_is_hosted_by_the_first_agent() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    handlers = [get_rendezvous_handler(params("elasticstore", f"localhost:{port}", 2, 2, None,
                                              last_call_timeout=0.2)) for _ in range(2)]
    try:
        with ThreadPoolExecutor(2) as pool:
            infos = list(pool.map(lambda h: h.next_rendezvous(), handlers))
        assert [i.rank for i in infos] == [0, 1]
    finally:
        for h in reversed(handlers):
            h.shutdown()


def test_many_handlers_waiting_in_the_rendezvous_shut_down_at_once() -> None:
    """Handlers of one process wait in ``next_rendezvous`` for a round that cannot form (one
    node short, the join timeout far off); shutting them all down at once ends every wait within
    seconds, with the error naming the shutdown, and leaves none of their keys behind."""
    from torch.distributed.elastic.rendezvous import RendezvousConnectionError

    n = 256
    with elasticstore.StoreServer("127.0.0.1", 0) as server, \
            elasticstore.Store("127.0.0.1", server.port) as store:
        handlers = [
            get_rendezvous_handler(params("elasticstore", server.address, n + 1, n + 1,
                                          "127.0.0.1", join_timeout=60, last_call_timeout=1,
                                          lease_ttl=40))
            for _ in range(n)
        ]
        errors: list[BaseException] = []

        def join(h: Any) -> None:
            try:
                h.next_rendezvous()
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=join, args=(h,), daemon=True) for h in handlers]
        try:
            for t in threads:
                t.start()
            deadline = time.monotonic() + 120
            while len(store.list_keys("rdzv/job/join/1/")) < n:
                assert time.monotonic() < deadline, "the handlers did not all join round 1"
                time.sleep(0.05)
            start = time.monotonic()
            with ThreadPoolExecutor(n) as pool:
                assert all(pool.map(lambda h: h.shutdown(), handlers))
            for t in threads:
                t.join(timeout=max(0.0, start + 30 - time.monotonic()))
            took = time.monotonic() - start
            print(f"{n} handlers waiting in the rendezvous -> all shut down: {took:.2f}s")
            assert not any(t.is_alive() for t in threads), f"waits still running after {took:.1f}s"
            assert took < 5, f"{took:.2f}s"
            assert len(errors) == n
            assert all(isinstance(e, RendezvousConnectionError) and "shut down" in str(e)
                       for e in errors), errors[:3]
            assert store.list_keys("rdzv/job/") == []
        finally:
            for h in handlers:
                h.shutdown()
