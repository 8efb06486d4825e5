"""How long an agent retries a lost connection to the rendezvous store: 1 s
(``FAILOVER_RECONNECT``) where a survivor takes the store over when its host is lost (an
agent-hosted store, once a round is carried), ``RECONNECT`` (3 s) where no one can (an external
server at the only endpoint: no host record; any store at one endpoint before the first round),
where a loss ends the run and a busy server or a starved agent thread must not be taken for one."""

from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest

from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

import elasticstore
from elasticstore.errors import StoreNetworkError
from elasticstore.rendezvous.executor import DeciderCheck
from elasticstore.rendezvous.failover import Carried, HostRecord, survivor_may_take_over
from elasticstore.rendezvous.native import FAILOVER_RECONNECT, RECONNECT, NativeBackend
from elasticstore.rendezvous.settings import RendezvousSettings
from elasticstore.rendezvous.state import Keys, RoundState

CONF = {"last_call_timeout": 0.1, "join_timeout": 30, "lease_ttl": 2}


def handler(endpoint: str, addr: str) -> RendezvousHandler:
    return get_rendezvous_handler(RendezvousParameters(
        "elasticstore", endpoint, "budget", 2, 2, addr, **CONF))


def budgets(h: RendezvousHandler) -> tuple[object, object]:
    """The connect timeouts of the handler's store and of its ring watcher's (made before the
    round, as its spare connection)."""
    ring = h._ring  # type: ignore[attr-defined]
    return (h._backend.store.connect_timeout,  # type: ignore[attr-defined]
            None if ring is None else ring._b.store.connect_timeout)


def form(handlers: list[RendezvousHandler]) -> None:
    with ThreadPoolExecutor(len(handlers)) as pool:
        infos = list(pool.map(lambda h: h.next_rendezvous(), handlers))
    assert sorted(i.world_size for i in infos) == [2, 2]


def test_an_external_store_is_retried_for_longer() -> None:
    with elasticstore.StoreServer("127.0.0.1", 0) as server:
        handlers = [handler(server.address, a) for a in ("127.0.0.2", "127.0.0.3")]
        try:
            assert [budgets(h) for h in handlers] == [(RECONNECT, None)] * 2  # no round yet
            form(handlers)
            assert [budgets(h) for h in handlers] == [(RECONNECT, RECONNECT)] * 2
        finally:
            for h in handlers:
                h.shutdown()


def test_an_agent_hosted_store_keeps_the_failover_bound() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.2", 0))
        port = sock.getsockname()[1]
    endpoint = f"127.0.0.2:{port}"
    host = handler(endpoint, "127.0.0.2")  # hosts the store: first, alone
    other = handler(endpoint, "127.0.0.3")
    try:
        assert budgets(other) == (RECONNECT, None)  # no round yet: no one could take over
        form([host, other])
        assert host._backend.server is not None  # type: ignore[attr-defined]
        assert budgets(other) == (FAILOVER_RECONNECT, FAILOVER_RECONNECT)
    finally:
        other.shutdown()
        host.shutdown()


def settings(endpoint: str, failover: bool) -> RendezvousSettings:
    return RendezvousSettings.from_config(
        run_id="budget", endpoint=endpoint, min_nodes=2, max_nodes=2, local_addr="127.0.0.2",
        config={"failover": failover}, several=True)


def test_who_may_take_over_is_decided_once_for_the_connect_the_round_and_a_loss() -> None:
    """``survivor_may_take_over`` decides for ``connect_native_backend`` (nothing carried),
    ``takeover.after_round`` and a loss: several endpoints, or one with a round and a host
    record carried, and never without ``failover``."""
    state = RoundState(1, ("127.0.0.2-1-0", "127.0.0.3-1-0"))
    host = HostRecord(1, "127.0.0.2-1-0", "127.0.0.2:29400")
    one, two = "127.0.0.2:29400", "127.0.0.2:29400,127.0.0.3:29400"
    assert survivor_may_take_over(settings(two, True), None)
    assert not survivor_may_take_over(settings(two, False), Carried(state, host))
    assert not survivor_may_take_over(settings(one, True), None)
    assert not survivor_may_take_over(settings(one, True), Carried(state))  # an external server
    assert not survivor_may_take_over(settings(one, True), Carried(None, host))
    assert survivor_may_take_over(settings(one, True), Carried(state, host))
    assert not survivor_may_take_over(settings(one, False), Carried(state, host))


def test_the_decider_checks_key_is_left_quietly_with_a_lost_connection() -> None:
    """The waiting node that checks the decider leaves its session-bound key when its wait ends:
    deleted on a live store; with the store gone (the reconnect fails) the key went with the
    session, and the cleanup raises nothing (the node's next call says the store is lost)."""
    keys = Keys("check")
    with elasticstore.StoreServer("127.0.0.1", 0) as server:
        other = elasticstore.Store(server.host, server.port)
        backend = NativeBackend(elasticstore.Store(
            server.host, server.port, connect_timeout=timedelta(seconds=0.3)),
            server.address, None)
        check = DeciderCheck(backend, keys, 1, 5.0, "127.0.0.2-1-0")
        assert other.get(keys.check(1)) == b"127.0.0.2-1-0"
        check.release()
        assert other.try_get(keys.check(1)) is None
        check.claim()
        assert other.get(keys.check(1)) == b"127.0.0.2-1-0"
        other.close()
    check.release()  # the server is gone: nothing raised
    assert check.due() is None  # no longer this node's check
    with pytest.raises(StoreNetworkError):
        backend.get(keys.round)
    backend.store.close()
