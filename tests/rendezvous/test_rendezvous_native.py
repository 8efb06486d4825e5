"""The rendezvous on the native store, with real processes: each simulated node on its own
loopback address (127.0.0.2, ...); the rendezvous server is hosted by this test process."""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest


from rdzv_nodes import READY_WITHIN, Agents  # noqa: E402
from rdzv_scenarios import SCENARIOS  # noqa: E402

import elasticstore  # noqa: E402

pytestmark = pytest.mark.slow

FAST = {"last_call_timeout": 0.3, "join_timeout": 30, "lease_ttl": 2}


@pytest.fixture
def agents() -> Iterator[Callable[..., Agents]]:
    with elasticstore.StoreServer("127.0.0.1", 0) as server:

        def make(lo: int, hi: int, **conf: Any) -> Agents:
            return Agents(backend="elasticstore", endpoint=server.address, run_id="job",
                          min=lo, max=hi, conf={**FAST, **conf})

        yield make


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.__name__ for s in SCENARIOS])
def test_native(agents: Callable[..., Agents], scenario: Callable[..., None]) -> None:
    scenario(agents)


def test_lost_rendezvous_server_fails_every_agent_naming_it() -> None:
    server = elasticstore.StoreServer("127.0.0.1", 0)
    try:
        with Agents(backend="elasticstore", endpoint=server.address, run_id="job", min=2, max=2,
                    conf=FAST) as group:
            nodes = group.start_together(["127.0.0.2", "127.0.0.3"], rounds=2)
            for a in nodes:
                a.expect("round")
            lost_at = time.time()
            server.close()
            for a in nodes:
                err = a.expect("error", 15)
                assert err["type"] == "RendezvousConnectionError", err
                assert server.address in err["msg"]
                print(f"rendezvous server lost -> agent error: {err['t'] - lost_at:.2f}s")
                assert err["t"] - lost_at < 10
    finally:
        server.close()


def test_silent_decider_is_replaced_within_the_lease(agents: Callable[..., Agents]) -> None:
    """The node holding ``ctl/decider/1`` goes silent (SIGSTOP: no FIN, its sessions stay open
    on the server): the waiting nodes take its place within about ``lease_ttl`` (its heartbeat
    stopped), not at ``join_timeout``; when it comes back it waits for a later round."""
    with agents(2, 2) as group:
        ttl = float(group.common["conf"]["lease_ttl"])
        host, port = group.common["endpoint"].rsplit(":", 1)
        with elasticstore.Store(host, int(port)) as store:
            first = group.start("127.0.0.2")  # alone: it decides round 1 and waits for a second
            first.expect("ready", READY_WITHIN)
            deadline = time.monotonic() + 30
            while store.try_get("rdzv/job/ctl/decider/1") is None:
                assert time.monotonic() < deadline, "the first node did not become the decider"
                time.sleep(0.05)
            assert store.try_get("rdzv/job/ctl/decider/1").decode().startswith("127.0.0.2-")
            first.freeze()
            b, c = group.start_together(["127.0.0.3", "127.0.0.4"])
            go = time.time()
            rounds = [n.expect("round", 25) for n in (b, c)]
            took = max(r["t"] for r in rounds) - go
            assert [(r["round"], r["world"]) for r in rounds] == [(1, 2), (1, 2)]
            assert sorted(r["rank"] for r in rounds) == [0, 1]
            print(f"silent decider (lease_ttl {ttl:g}s) -> round without it: {took:.2f}s")
            assert took < 1.5 * ttl + 1.5, f"{took:.2f}s"
            first.thaw()  # back: the round is full (max 2), it waits as a standby
            time.sleep(0.5)
            assert first.proc.poll() is None


def _hold_the_gil(seconds: float) -> float:
    """Keep this process's Python threads from running for ``seconds`` in one stretch, and return
    how long that took: a foreign call through ``ctypes.PyDLL`` keeps the GIL, so libc's
    ``usleep`` holds it for as long as asked (a calibrated regular expression would depend on the
    machine's load, and overshot the round's join timeout on a slower one)."""
    libc = ctypes.PyDLL(None)
    libc.usleep.argtypes = [ctypes.c_uint]
    t0 = time.monotonic()
    libc.usleep(round(seconds * 1e6))
    return time.monotonic() - t0


def test_busy_decider_is_not_replaced(agents: Callable[..., Agents]) -> None:
    """The decider's process is busy but alive (its Python threads get no time for 3 lease
    TTLs, as with a thousand agents in one interpreter): the waiting node does not take its
    place, and the round forms as soon as the decider gets the time back."""
    from elasticstore.rendezvous.handler import ElasticRendezvousHandler
    from elasticstore.rendezvous.native import create_native_backend
    from elasticstore.rendezvous.settings import RendezvousSettings

    with agents(2, 2) as group:
        ttl = float(group.common["conf"]["lease_ttl"])
        host, port = group.common["endpoint"].rsplit(":", 1)
        settings = RendezvousSettings(run_id="job", host=host, port=int(port), min_nodes=2,
                                      max_nodes=2, local_addr="127.0.0.5", join_timeout=60,
                                      last_call_timeout=0.3, lease_ttl=ttl)
        handler = ElasticRendezvousHandler(create_native_backend(settings), settings)
        result: dict[str, Any] = {}

        def join() -> None:
            try:
                result["info"] = handler.next_rendezvous()
            except Exception as exc:
                result["error"] = exc

        thread = threading.Thread(target=join, daemon=True)
        try:
            with elasticstore.Store(host, int(port)) as store:
                thread.start()
                deadline = time.monotonic() + 30
                while store.try_get("rdzv/job/ctl/decider/1") != handler.node_id.encode():
                    assert time.monotonic() < deadline, "this process's node did not decide"
                    time.sleep(0.05)
                (other,) = group.start_together(["127.0.0.3"])  # joins while we are busy
                held = _hold_the_gil(3 * ttl)
                back = time.time()
                rnd = other.expect("round", 15)
                assert held > 1.5 * ttl and rnd["t"] > back - 0.5, (held, rnd["t"] - back)
                thread.join(15)
                print(f"decider busy {held:.1f}s (lease_ttl {ttl:g}s) -> round "
                      f"{time.time() - back:.2f}s after")
                assert "taking over" not in "".join(other.stderr), "".join(other.stderr)
                assert (rnd["round"], rnd["world"]) == (1, 2), rnd
                assert "info" in result, result
                assert result["info"].world_size == 2
        finally:
            handler.shutdown()
            thread.join(10)
            assert not thread.is_alive()


def test_round_replaced_before_a_slow_node_connects(agents: Callable[..., Agents]) -> None:
    """A participant that reaches its round only after the round's worker store host was lost
    (here: frozen while the round formed, the host SIGKILLed meanwhile) learns that the round was
    replaced and takes the next one, within seconds: not after retrying the dead worker store
    for store_timeout (60 s), past its join_timeout."""
    with agents(2, 3, last_call_timeout=2) as group:
        host, port = group.common["endpoint"].rsplit(":", 1)
        with elasticstore.Store(host, int(port)) as store:
            slow = group.start("127.0.0.3", rounds=2, gate=True)  # rank 1: not the store host
            third = group.start("127.0.0.4", gate=True)  # for round 2 (min 2)
            slow.expect("ready", READY_WITHIN)
            third.expect("ready", READY_WITHIN)
            fast = group.start("127.0.0.2", rounds=2)  # decides round 1
            fast.expect("ready", READY_WITHIN)
            deadline = time.monotonic() + 60
            while not (store.try_get("rdzv/job/ctl/decider/1") or b"").startswith(b"127.0.0.2-"):
                assert time.monotonic() < deadline, "127.0.0.2 did not become the decider"
                time.sleep(0.01)
            slow.go()
            while len(store.list_keys("rdzv/job/join/1/")) < 2:  # the last call (2 s) runs
                assert time.monotonic() < deadline, "127.0.0.3 did not join round 1"
                time.sleep(0.01)
            slow.freeze()
            try:
                first = fast.expect("round", 30)
                assert (first["round"], first["world"]) == (1, 2)
                fast.kill()  # the round's worker store goes with it
            finally:
                slow.thaw()
            thawed = time.monotonic()
            third.go()
            got = slow.expect("round", 25)  # its first round event: round 1 was replaced
            print(f"slow node -> next round {time.monotonic() - thawed:.2f}s after it went on")
            assert (got["round"], got["world"], got["rank"]) == (2, 2, 0)
            assert third.expect("round", 25)["round"] == 2


def test_a_node_whose_store_goes_silent_as_it_starts_looks_it_up_again() -> None:
    """A node that starts among several endpoints connects to the store of the first entry's
    node, which is then stopped (SIGSTOP: a frozen container, a supervisor's pause) before the
    node's handler made its first calls on it (its liveness key): those fail. The node is in no
    round yet, so its start does not fail: its first join looks the store up again among the
    endpoints and joins it once the host runs again (the nemesis found a node restarted while the
    host was stopped exiting 1 at its start)."""
    import socket

    from elasticstore.rendezvous.handler import ElasticRendezvousHandler
    from elasticstore.rendezvous.native import create_native_backend
    from elasticstore.rendezvous.registry import backend as backend_row

    with socket.socket() as sock:
        sock.bind(("127.0.0.2", 0))
        port = sock.getsockname()[1]
    endpoint = f"127.0.0.2:{port},127.0.0.3:{port}"
    conf = {**FAST, "store_timeout": 1}
    with Agents(backend="elasticstore", endpoint=endpoint, run_id="silent", min=1, max=2,
                conf=conf) as group:
        host = group.start("127.0.0.2", rounds=2)  # the first entry's node: it hosts
        assert host.expect("round", READY_WITHIN + 30)["round"] == 1  # alone (min 1)
        settings = backend_row("elasticstore").settings(
            run_id="silent", endpoint=endpoint, min_nodes=1, max_nodes=2, local_addr="127.0.0.3",
            config=conf)
        backend = create_native_backend(settings)  # connected to the host's store
        handler: ElasticRendezvousHandler | None = None
        host.freeze()
        thaw = threading.Timer(5.0, host.thaw)  # after the handler's first calls failed (1-3 s)
        thaw.start()
        try:
            began = time.monotonic()
            handler = ElasticRendezvousHandler(backend, settings)
            assert thaw.is_alive(), "the handler's first calls ended after the host ran again"
            info = handler.next_rendezvous()
            thawed = time.monotonic() - began - 5.0
            assert handler.round is not None and (handler.round.round, info.world_size) == (2, 2)
            other = host.expect("round", 30)
            assert (other["round"], other["world"]) == (2, 2), other
            print(f"store stopped as a node started -> that node in round 2 {thawed:.2f}s "
                  f"after the host ran again")
        finally:
            thaw.cancel()
            host.thaw()
            if handler is not None:
                handler.shutdown()
