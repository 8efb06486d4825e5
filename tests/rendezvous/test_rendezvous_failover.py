"""The native rendezvous survives the loss of the agent hosting its store (``failover.py``,
``takeover.py``): real servers, real handlers.

In one process (threads), each handler on its own loopback address 127.0.0.2.., every one naming
all of them in its endpoint list (the first hosts the store). Losing the host is simulated as the
agent's death looks to the others: its rendezvous server closes (its clients see the connection
end), its heartbeat stops and its round's worker store goes. Then a partition, the case the
quorum rules are for: the old host in a network namespace (``netfaults.py``), cut off silently
from the other two, which take over; the old host must never form a round on its own.

Each test prints its figures (run with ``-s``); every wait is bounded, and every handler, thread,
process and namespace is ended in ``finally``/``with`` blocks.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import netfaults
import pytest
from agent_nodes import free_port
from rdzv_nodes import READY_WITHIN, Agent, Agents
from torch.distributed.elastic.rendezvous import (RendezvousConnectionError, RendezvousInfo,
                                                 RendezvousTimeoutError)

import elasticstore
from elasticstore.rendezvous.failover import FAILOVER_WAIT, HostRecord, find_standing
from elasticstore.rendezvous import native, takeover
from elasticstore.rendezvous.follower import start_follower
from elasticstore.rendezvous.handler import ElasticRendezvousHandler
from elasticstore.rendezvous.hostprobe import YIELD_PERIOD
from elasticstore.rendezvous.registry import backend as backend_row
from elasticstore.rendezvous.state import Keys, RoundState

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

RUN = "fo"
KEYS = Keys(RUN)


def until(cond: Callable[[], bool], timeout: float, what: str) -> float:
    """Polls ``cond`` every 10 ms (as an agent polls ``num_nodes_waiting``); the time it took."""
    start = time.monotonic()
    while not cond():
        assert time.monotonic() - start < timeout, f"{what}: not within {timeout}s"
        time.sleep(0.01)
    return time.monotonic() - start


def next_round(h: ElasticRendezvousHandler) -> RendezvousInfo:
    """What an agent does once its round ended: waits for ``num_nodes_waiting() > 0`` (polled
    every 10 ms, at most 60 s), then joins the next round."""
    until(lambda: h.num_nodes_waiting() > 0, 60, f"{h.node_id}: num_nodes_waiting > 0")
    return h.next_rendezvous()


class Joins:
    """``next_rendezvous`` (or ``join``) of some handlers, each in a thread of its own (daemon:
    a wait that outlives the test is ended by the handler's shutdown in ``Group.close``)."""

    def __init__(self, handlers: dict[int, ElasticRendezvousHandler],
                 join: Callable[[ElasticRendezvousHandler], RendezvousInfo] | None = None) -> None:
        self.results: dict[int, RendezvousInfo | BaseException] = {}
        self.at: dict[int, float] = {}
        self._join = join or (lambda h: h.next_rendezvous())
        self._threads = [threading.Thread(target=self._run, args=(i, h), daemon=True)
                         for i, h in handlers.items()]
        for thread in self._threads:
            thread.start()

    def _run(self, i: int, h: ElasticRendezvousHandler) -> None:
        try:
            self.results[i] = self._join(h)
        except BaseException as exc:  # reported to the test
            self.results[i] = exc
        self.at[i] = time.monotonic()

    def wait(self, timeout: float) -> dict[int, RendezvousInfo | BaseException]:
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        alive = [t for t in self._threads if t.is_alive()]
        assert not alive, f"{len(alive)} join(s) still waiting after {timeout}s: {self.results}"
        return self.results

    def join(self, timeout: float) -> None:
        for thread in self._threads:
            thread.join(timeout)


class Group:
    """Handlers of run ``fo``, one on each of ``addrs``, nnodes 1:``max_nodes``;
    ``--rdzv-endpoint`` lists ``members`` (default: ``addrs``) at one port, so the first
    member hosts the store."""

    def __init__(self, addrs: list[str], max_nodes: int, members: list[str] | None = None,
                 port: int | None = None, **conf: Any) -> None:
        self.port = port or free_port(addrs[0])
        self.addrs = addrs
        endpoint = ",".join(f"{a}:{self.port}" for a in members or addrs)
        row = backend_row("elasticstore")
        config = {"last_call_timeout": 2, "join_timeout": 60, **conf}
        self.handlers: list[ElasticRendezvousHandler] = []
        self._joins: list[Joins] = []
        try:
            for addr in self.addrs:
                settings = row.settings(run_id=RUN, endpoint=endpoint, min_nodes=1,
                                        max_nodes=max_nodes, local_addr=addr, config=config)
                self.handlers.append(row.create_handler(settings))
        except BaseException:
            self.close()
            raise

    def endpoint(self, i: int) -> str:
        return f"{self.addrs[i]}:{self.port}"

    def start(self, *idx: int, join: Callable[[ElasticRendezvousHandler], RendezvousInfo] |
              None = None) -> Joins:
        joins = Joins({i: self.handlers[i] for i in idx}, join)
        self._joins.append(joins)
        return joins

    def round(self, *idx: int, timeout: float = 30) -> dict[int, RendezvousInfo]:
        """Every handler in ``idx`` joins at once; each must get a round."""
        results = self.start(*idx).wait(timeout)
        errors = {i: r for i, r in results.items() if isinstance(r, BaseException)}
        assert not errors, errors
        return results  # type: ignore[return-value]

    def full_round_and_a_fourth_waiting(self) -> Joins:
        """Nodes 0-2 form round 1 (nnodes 1:3: full); node 3 joins round 2 and waits."""
        self.round(0, 1, 2)
        waiting = self.start(3)
        with self.store(0) as st:
            until(lambda: len(st.list_keys(KEYS.join_prefix(2))) == 1, 10, "the fourth waits")
        return waiting

    def lose(self, i: int) -> float:
        """Node ``i`` is lost as its death looks to the others: its rendezvous server closes,
        its heartbeat stops, its round's worker store goes. Returns the monotonic time."""
        h = self.handlers[i]
        assert h._backend.server is not None, f"node {i} does not host the store"
        at = time.monotonic()
        h._backend.server.close()
        assert h._heartbeat is not None
        h._heartbeat.stop()
        h._leave_round(withdraw=False)
        return at

    def store(self, i: int) -> elasticstore.Store:
        """A client of the rendezvous store hosted at node ``i``'s address."""
        return elasticstore.Store(self.addrs[i], self.port, timeout=timedelta(seconds=10),
                                  connect_timeout=timedelta(seconds=2))

    def close(self) -> None:
        """Shuts every handler down, those hosting a server last (the others delete their keys
        there first); then every join thread ends (a shutdown ends a join in progress)."""
        for h in sorted(self.handlers, key=lambda h: h._backend.server is not None):
            h.shutdown()
        for joins in self._joins:
            joins.join(10)


@contextmanager
def group(n: int, max_nodes: int, **conf: Any) -> Iterator[Group]:
    """``n`` nodes on 127.0.0.2.., the first hosting the store."""
    made = Group([f"127.0.0.{2 + i}" for i in range(n)], max_nodes, **conf)
    try:
        yield made
    finally:
        made.close()


def moves(h: ElasticRendezvousHandler) -> list[tuple[str, int]]:
    return [(m.endpoint, m.epoch) for m in h.store_moves]


def round_record(st: elasticstore.Store) -> RoundState:
    return RoundState.from_json(st.get(KEYS.round))


def test_store_host_lost_two_survivors_form_the_next_round_on_the_next_host() -> None:
    """Three nodes; the host (127.0.0.2) is lost after round 1. Both survivors see
    ``num_nodes_waiting() > 0``, the first of round 1's survivors (127.0.0.3) hosts the store
    (epoch 2), and round 2 forms there with the two of them: the round number goes on, and the
    last failure, published by the other survivor during round 1, is in the new store."""
    with group(3, 3) as g:
        a, b, c = g.handlers
        infos = g.round(0, 1, 2)
        assert [(infos[i].rank, infos[i].world_size) for i in range(3)] == [(0, 3), (1, 3), (2, 3)]
        assert moves(b) == moves(c) == []
        c.publish_status({"state": "failed"}, failure={"rank": 5, "message": "boom"})

        lost = g.lose(0)
        noticed = max(until(lambda h=h: h.num_nodes_waiting() > 0, 10, "num_nodes_waiting > 0")
                      for h in (b, c))
        joins = g.start(1, 2)
        results = joins.wait(30)
        assert not any(isinstance(r, BaseException) for r in results.values()), results
        took = max(joins.at.values()) - lost
        print(f"\nstore host lost -> num_nodes_waiting > 0 within {noticed:.2f}s; -> round 2 on "
              f"the next host {took:.2f}s")

        assert [(results[i].rank, results[i].world_size) for i in (1, 2)] == [(0, 2), (1, 2)]
        assert b.round == c.round == RoundState(2, (b.node_id, c.node_id))
        assert moves(b) == moves(c) == [(g.endpoint(1), 2)]
        record = b.store_moves[0]
        assert (record.node, record.previous) == (b.node_id, g.endpoint(0))
        assert b._backend.server is not None and c._backend.server is None
        with g.store(1) as st:
            assert HostRecord.from_json(st.get(KEYS.host)) == record
            assert round_record(st) == RoundState(2, (b.node_id, c.node_id))
            failure = json.loads(st.try_get(KEYS.failure) or b"null")
            assert failure == {"rank": 5, "message": "boom", "node": c.node_id}
        assert took < 10, f"{took:.2f}s"


def test_a_loss_reported_late_on_the_store_left_behind_moves_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Three nodes; the host is lost. Round 1's ring watcher on the lost store (C's, watching A)
    reports its failure late, as its thread may: once while C already switches (it took the
    loss; the next host not yet attached) and once after round 2 formed on the next host. Both
    reports are stale: C stays on the next host, and the next round forms there with both
    survivors. (Taken for a loss of the next host, such a report once made C take the store
    over a second time, at its own address: two stores of one run.)"""
    with group(3, 3) as g:
        a, b, c = g.handlers
        g.round(0, 1, 2)
        assert c._ring is not None and c._ring._on_error is not None
        stale = c._ring._on_error  # round 1's ring watcher, on A's store

        def report() -> None:
            stale(elasticstore.StoreNetworkError(
                f"watch prefix \"{KEYS.alive(a.node_id)}\": {g.endpoint(0)}: the server closed "
                "the connection while WATCH was waiting for its reply"))

        switch = takeover.take_over

        def reported_while_switching(h: ElasticRendezvousHandler, cause: BaseException) -> None:
            if h is c:
                report()
            switch(h, cause)

        monkeypatch.setattr(takeover, "take_over", reported_while_switching)
        g.lose(0)
        for h in (b, c):
            until(lambda h=h: h.num_nodes_waiting() > 0, 10, "num_nodes_waiting > 0")
        results = g.start(1, 2).wait(30)
        assert not any(isinstance(r, BaseException) for r in results.values()), results
        assert b.round == c.round == RoundState(2, (b.node_id, c.node_id))

        report()  # after round 2 formed
        assert c._lost is None and c.num_nodes_waiting() == 0
        b.end_round("a worker failed")
        results = g.start(1, 2, join=next_round).wait(30)
        assert not any(isinstance(r, BaseException) for r in results.values()), results
        assert b.round == c.round == RoundState(3, (b.node_id, c.node_id))
        assert moves(b) == moves(c) == [(g.endpoint(1), 2)]  # one switch: to B, and no other
        assert c._backend.server is None and c._early_backend is None


def test_store_host_lost_a_standby_enters_the_next_round() -> None:
    """Four nodes, nnodes 1:3. Round 1 has three; the fourth waits (the round is full). The
    host's workers fail: it publishes the failure and the three re-join, so round 2 has the
    three and the fourth as a standby, which waits in ``next_rendezvous`` for round 3. Then the
    host is lost: the standby follows the store to its next host too, and round 3 has the two
    survivors and the standby (ranks kept, the standby last); the failure record survives."""
    with group(4, 3) as g:
        a, b, c, d = g.handlers
        waiting = g.full_round_and_a_fourth_waiting()
        a.publish_status({"state": "failed"}, failure={"rank": 0, "message": "worker failed"})
        infos = g.round(0, 1, 2)
        assert [(infos[i].rank, infos[i].world_size) for i in range(3)] == [(0, 3), (1, 3), (2, 3)]
        assert a.round == RoundState(2, (a.node_id, b.node_id, c.node_id), (d.node_id,))
        assert not waiting.results  # the standby waits for round 3

        lost = g.lose(0)
        for h in (b, c):
            until(lambda h=h: h.num_nodes_waiting() > 0, 10, "num_nodes_waiting > 0")
        results = g.start(1, 2).wait(30)
        assert not any(isinstance(r, BaseException) for r in results.values()), results
        standby = waiting.wait(10)[3]
        assert not isinstance(standby, BaseException), repr(standby)
        took = max(waiting.at[3], *(g._joins[-1].at.values())) - lost
        print(f"\nstore host lost -> round 3 with the standby: {took:.2f}s")
        assert (standby.rank, standby.world_size) == (2, 3)
        assert [(results[i].rank, results[i].world_size) for i in (1, 2)] == [(0, 3), (1, 3)]
        assert b.round == c.round == d.round == RoundState(3, (b.node_id, c.node_id, d.node_id))
        assert moves(b) == moves(c) == moves(d) == [(g.endpoint(1), 2)]
        with g.store(1) as st:
            failure = json.loads(st.try_get(KEYS.failure) or b"null")
            assert failure == {"rank": 0, "message": "worker failed", "node": a.node_id}
        assert took < 10, f"{took:.2f}s"


def test_store_host_and_the_next_candidate_lost_the_one_after_hosts() -> None:
    """Five nodes; the host is lost, and the first candidate (127.0.0.3) too, before it can
    serve. The other three wait ``FAILOVER_WAIT`` for it, pass it over and the next one
    (127.0.0.4) hosts the store (epoch 2: one switch); the three (a majority of round 1's five)
    form round 2 there."""
    with group(5, 5) as g:
        h = g.handlers
        g.round(0, 1, 2, 3, 4)
        # Gone just before the host (a candidate notices the loss at once and serves from the
        # thread that noticed it, so it must be gone first never to serve).
        h[1].shutdown()
        lost = g.lose(0)
        for i in (2, 3, 4):
            until(lambda i=i: h[i].num_nodes_waiting() > 0, 10, "num_nodes_waiting > 0")
        joins = g.start(2, 3, 4)
        results = joins.wait(FAILOVER_WAIT + 20)
        assert not any(isinstance(r, BaseException) for r in results.values()), results
        took = max(joins.at.values()) - lost
        print(f"\nstore host and the first candidate lost -> round 2 on the second candidate: "
              f"{took:.2f}s (FAILOVER_WAIT {FAILOVER_WAIT:g}s)")
        assert [(results[i].rank, results[i].world_size) for i in (2, 3, 4)] == [
            (0, 3), (1, 3), (2, 3)]
        assert all(h[i].round == RoundState(2, (h[2].node_id, h[3].node_id, h[4].node_id))
                   for i in (2, 3, 4))
        assert moves(h[2]) == moves(h[3]) == moves(h[4]) == [(g.endpoint(2), 2)]
        assert h[2].store_moves[0].previous == g.endpoint(0)
        with g.store(2) as st:
            assert HostRecord.from_json(st.get(KEYS.host)) == h[2].store_moves[0]
        assert took < FAILOVER_WAIT + 5, f"{took:.2f}s"


def test_a_single_survivor_of_three_is_fenced() -> None:
    """Three nodes; the host and a second node are lost at once. The one survivor takes the
    store over (after ``FAILOVER_WAIT`` for the other) but forms no round alone although
    nnodes is 1:3: one of three is no majority (the other two may be the other side of a
    partition, still training). Its ``next_rendezvous`` ends at ``join_timeout`` with an error
    that names the quorum."""
    join_timeout = 15
    with group(3, 3, join_timeout=join_timeout) as g:
        a, b, c = g.handlers
        g.round(0, 1, 2)
        lost = g.lose(0)
        b.shutdown()
        until(lambda: c.num_nodes_waiting() > 0, 10, "num_nodes_waiting > 0")
        joins = g.start(2)
        error = joins.wait(FAILOVER_WAIT + join_timeout + 20)[2]
        took = joins.at[2] - lost
        print(f"\nstore host and one more of three lost -> the survivor's next_rendezvous "
              f"failed after {took:.2f}s: {error}")
        assert isinstance(error, RendezvousTimeoutError), repr(error)
        assert f"round 2 did not form within join_timeout={join_timeout}s" in str(error)
        assert "only 1 of round 1's 3 participants joined and the round needs 2" in str(error)
        assert c.round is None
        assert moves(c) == [(g.endpoint(2), 2)]  # it took the store over, and stayed fenced
        with g.store(2) as st:
            assert round_record(st).round == 1
        assert took < FAILOVER_WAIT + join_timeout + 5


def test_partitioned_store_host_is_fenced_while_the_others_take_over(net: None) -> None:
    """The store's host A runs in a network namespace (a process of its own), B and C in the
    root namespace on two of its root-side addresses; nnodes 1:3, so nothing but the quorum
    rules keeps the two sides of a partition from both forming rounds. After round 1 (A, B,
    C), A's link is cut (silently: no FIN, no RST). B and C take the store over (B, the first
    of round 1's survivors, hosts it: epoch 2) and form round 2. A times B out (lease_ttl) and
    its server C's silent session (TCP keepalive), and is left alone with its own store: it
    forms no round (one of three is less than half), and its ``next_rendezvous`` ends at
    ``join_timeout`` naming the quorum."""
    join_timeout = 30
    # store_timeout bounds a call to the silent host (its reply never comes; no keepalive
    # applies while a request is unanswered): the root side's detection of the cut.
    conf = {"last_call_timeout": 3, "join_timeout": join_timeout, "lease_ttl": 2,
            "store_timeout": 5}
    with netfaults.node(7, root_aliases=2) as n:
        port = free_port(n.root_aliases[0])
        members = [n.addr, *n.root_aliases]  # A first: it hosts the store
        with Agents(backend="elasticstore", endpoint=",".join(f"{m}:{port}" for m in members),
                    run_id=RUN, min=1, max=3, conf=conf) as agents:
            a = Agent({**agents.common, "addr": n.addr, "rounds": 2, "gate": True}, n.prefix())
            agents.agents.append(a)
            a.expect("ready", READY_WITHIN)  # its server is up
            g = Group(list(n.root_aliases), 3, members=members, port=port, **conf)
            try:
                b, c = g.handlers
                joins = g.start(0, 1)
                a.go()
                first = a.expect("round", 30)
                infos = joins.wait(30)
                assert (first["round"], first["rank"], first["world"]) == (1, 2, 3)
                assert [(infos[i].rank, infos[i].world_size) for i in (0, 1)] == [(0, 3), (1, 3)]
                assert b.round == RoundState(1, (b.node_id, c.node_id, first["node"]))

                cut = n.partition()
                cut_at = time.monotonic()
                second = g.start(0, 1, join=next_round)
                noticed = a.expect("waiting", 10)["t"] - cut  # B timed out: its ring watcher
                assert noticed < 2 * conf["lease_ttl"] + 2
                results = second.wait(FAILOVER_WAIT + 30)
                assert not any(isinstance(r, BaseException) for r in results.values()), results
                formed = max(second.at.values()) - cut_at
                assert [(results[i].rank, results[i].world_size) for i in (0, 1)] == [(0, 2),
                                                                                    (1, 2)]
                assert b.round == c.round == RoundState(2, (b.node_id, c.node_id))
                assert moves(b) == moves(c) == [(g.endpoint(0), 2)]
                assert b.store_moves[0].previous == f"{n.addr}:{port}"

                # A, alone with its store: no round, ever; its join ends at join_timeout.
                event = a.events.get(timeout=join_timeout + 20)
                ended = event["t"] - cut
                print(f"\npartition of the store's host (lease_ttl {conf['lease_ttl']}s, "
                      f"store_timeout {conf['store_timeout']}s): the root side's round 2 on the "
                      f"new host {formed:.2f}s after the cut; the cut-off host: "
                      f"num_nodes_waiting > 0 after {noticed:.2f}s, fenced, its join failed "
                      f"{ended:.2f}s after the cut: {event.get('msg')}")
                assert event["ev"] == "error", event  # not a round
                assert event["type"] == "RendezvousTimeoutError", event
                assert "only 1 of round 1's 3 participants joined and the round needs 2" in \
                    event["msg"], event
                assert f"live nodes: {first['node']}" in event["msg"], event  # B, C timed out
                assert formed < conf["store_timeout"] + 5, f"{formed:.2f}s"
            finally:
                g.close()


def test_a_node_named_in_no_round_follows_the_store_through_its_endpoint_list() -> None:
    """Four nodes, nnodes 1:3: round 1 is full with three, and the fourth waits unnamed in any
    round record (it has no candidates of its own). The host is lost: the two survivors switch
    to 127.0.0.3; the fourth finds the store there among its ``--rdzv-endpoint`` entries (the
    newest host record) and enters the next round as a member."""
    with group(4, 3) as g:
        a, b, c, d = g.handlers
        waiting = g.full_round_and_a_fourth_waiting()
        assert d.round is None and d._carried.round is None
        lost = g.lose(0)
        for h in (b, c):
            until(lambda h=h: h.num_nodes_waiting() > 0, 10, "num_nodes_waiting > 0")
        results = g.start(1, 2).wait(60)
        assert not any(isinstance(r, BaseException) for r in results.values()), results
        assert b.round == c.round == RoundState(2, (b.node_id, c.node_id))
        # The fourth reaches the moved store and waits there: round 2 is replaced for it (a
        # scale-up round, after the last call), and the survivors come back.
        results = g.start(1, 2, join=next_round).wait(3 * FAILOVER_WAIT + 30)
        assert not any(isinstance(r, BaseException) for r in results.values()), results
        fourth = waiting.wait(30)[3]
        assert not isinstance(fourth, BaseException), repr(fourth)
        print(f"\nstore host lost -> the unnamed node in a round on the new host: "
              f"{waiting.at[3] - lost:.2f}s")
        assert moves(d) == [(g.endpoint(1), 2)]
        assert d.round == RoundState(3, (b.node_id, c.node_id, d.node_id))
        assert d._backend.server is None


def test_a_node_back_from_a_stop_joins_the_newer_round_not_a_store_of_its_own() -> None:
    """Three nodes, A hosting. B goes silent (its heartbeat stops, as when it is SIGSTOPped): A
    and C form round 2 without it. B then takes A for lost (as a node back from a stop does when
    a call's deadline passed meanwhile). First candidate of round 1, the last it knew, it would
    serve epoch 2 seeded with round 1; but A's store holds round 2, newer though of an older
    epoch: B joins it, and the three form round 3. Stores are ordered by their round, then their
    epoch (``failover.find_standing``): by epoch alone, A would give its round 2 up for a stale
    store of B's seeded with round 1, whose next round would be 2 again (seen in the nemesis:
    the job's rounds went backwards)."""
    with group(3, 3, lease_ttl=2, last_call_timeout=1) as g:
        a, b, c = g.handlers
        g.round(0, 1, 2)
        assert b._heartbeat is not None
        b._heartbeat.stop()  # B silent: its liveness key lapses
        g.start(0, 2, join=next_round).wait(40)
        assert a.round is not None and c.round is not None
        assert (a.round.round, c.round.round, len(a.round.participants)) == (2, 2, 2)
        # A, hosting round 2 at epoch 1, keeps its store for a newer epoch seeded from round 1,
        # and gives it up for one at round 2 (the others moved on from its last round).
        other = HostRecord(2, b.node_id, g.endpoint(1))
        assert (a._outranked(other, 1), a._outranked(other, 2)) == (False, True)
        b._saw_loss(elasticstore.StoreNetworkError("no reply within 6 s (the node was stopped)"),
                    b._backend)
        joins = g.start(1)  # B joins: A's store, never one of its own
        waiting = g.start(0, 2, join=next_round)
        results = {**joins.wait(FAILOVER_WAIT + 40), **waiting.wait(FAILOVER_WAIT + 40)}
        errors = {i: r for i, r in results.items() if isinstance(r, BaseException)}
        assert not errors, errors
        assert [h.round.round if h.round else None for h in (a, b, c)] == [3, 3, 3]
        assert moves(a) == [] and moves(c) == []  # A kept its store; C never left it
        assert moves(b) == [], moves(b)  # the store never moved
        # B served no store of the run (its follower's copy there holds no host record)
        assert find_standing([(g.addrs[1], g.port)], KEYS, None) is None
        with g.store(0) as st:
            assert round_record(st).round == 3


def test_a_node_whose_store_gives_way_to_a_host_gone_since_says_why_it_cannot_go_on() -> None:
    """A node hosting the store learns that another node serves a newer store of the run (as a
    node back from a stop does: the others took it for lost and went on) and gives its own up;
    that host has exited since (the job finished without this node). The next join fails
    within ``FAILOVER_WAIT`` with a connection error that names the newer host and says why
    this node cannot go on (its store is given up), not a bare connect failure."""
    with group(1, 3) as g:
        (a,) = g.handlers
        g.round(0)
        gone = f"127.0.0.3:{free_port('127.0.0.3')}"  # nothing listens there
        a._yield_to(HostRecord(2, "127.0.0.3-1-1", gone), a._backend)
        started = time.monotonic()
        result = g.start(0).wait(FAILOVER_WAIT + 20)[0]
        took = time.monotonic() - started
        assert isinstance(result, RendezvousConnectionError), repr(result)
        assert f"{gone} serves a newer store of the run (epoch 2)" in str(result), str(result)
        assert "no longer serves it" in str(result), str(result)
        assert took < FAILOVER_WAIT + 10, f"{took:.1f}s"


def test_a_host_waiting_alone_in_its_join_gives_way_to_a_newer_store_within_seconds() -> None:
    """A hosts the store (endpoints: A and X); round 1 is A and B. A joins round 2 and, as its
    decider, waits in a watch for B (alive, not joining) up to ``join_timeout``. Meanwhile a
    newer store of the run appears at X (epoch 2, round 3: the others went on while A was
    stopped). A must give its store up and move to X within a few looks (``YIELD_PERIOD``,
    2 s), not once its watch ends: the look read A's own round on the client that the watch
    held (one call at a time per client), so A sat out ``join_timeout`` alone on its store
    (the nemesis: a node exiting 1 at the end, its round not formed, right after giving way)."""
    port = free_port("127.0.0.2")
    g = Group(["127.0.0.2", "127.0.0.3"], 2, members=["127.0.0.2", "127.0.0.4"], port=port,
              join_timeout=30)
    server: elasticstore.StoreServer | None = None
    try:
        a, b = g.handlers
        g.round(0, 1)
        g.start(0)  # A waits for B, a live participant of round 1, in a watch
        with g.store(0) as st:
            until(lambda: len(st.list_keys(KEYS.join_prefix(2))) == 1, 10, "A waits in round 2")
        time.sleep(1.0)  # A's watch is in progress
        server = elasticstore.StoreServer("127.0.0.4", port)
        with elasticstore.Store("127.0.0.4", port, timeout=timedelta(seconds=5)) as st:
            st.set(KEYS.round, RoundState(3, (b.node_id,)).to_json())
            newer = HostRecord(2, b.node_id, f"127.0.0.4:{port}", g.endpoint(0), time.time())
            st.set(KEYS.host, newer.to_json())
        # Before: not within 25 s (the watch ends at join_timeout, 30 s).
        took = until(lambda: moves(a) == [(f"127.0.0.4:{port}", 2)], 25,
                     "A moved to the newer store")
        print(f"\na newer store shown -> the host waiting in its join moved to it: {took:.2f}s")
        assert a._backend.server is None
        assert took < 3 * YIELD_PERIOD + 6, f"{took:.1f}s after the newer store appeared"
    finally:
        g.close()  # A's join, on the newer store now, ends before that store closes
        if server is not None:
            server.close()


def test_a_follower_left_where_a_store_was_found_is_not_joined_as_the_runs_store() -> None:
    """A node looks the store up (a host record at 127.0.0.3, epoch 4); before it connects,
    that host gives its store up and a follower takes its address (``follower.py``: an empty
    store but for its own record). Joining it would start the run afresh there (round 1 under
    a live run id: the nemesis saw it). The connection shows no host record of that epoch: it
    is refused as the run's store (``StoreNetworkError``, which the look-ups retry), while the
    store itself, host record shown, is joined."""
    port = free_port("127.0.0.3")
    settings = backend_row("elasticstore").settings(
        run_id=RUN, endpoint=f"127.0.0.2:{port},127.0.0.3:{port}", min_nodes=1, max_nodes=2,
        local_addr="127.0.0.4", config={"store_timeout": 5})
    found = HostRecord(4, "127.0.0.3-1-1", f"127.0.0.3:{port}")
    with elasticstore.StoreServer("127.0.0.3", port) as server:
        with elasticstore.Store("127.0.0.3", port, timeout=timedelta(seconds=5)) as st:
            st.set(KEYS.host, found.to_json())
        joined = native.connect_native_backend(settings, "127.0.0.3", port, first_wait=2,
                                               expect=found)
        joined.close()
    follower = start_follower("127.0.0.3", port, KEYS, "127.0.0.3-1-1", None)
    assert follower is not None
    try:
        with pytest.raises(elasticstore.StoreNetworkError, match="no longer serves the run's"):
            native.connect_native_backend(settings, "127.0.0.3", port, first_wait=2,
                                          expect=found)
    finally:
        follower.close()


def test_a_member_whose_process_died_is_seen_lost_at_once_by_the_others() -> None:
    """``member_lost`` (what an agent checks when a worker fails, before it counts a failure of
    its own): False in a healthy round; True as soon as a participant's liveness key is gone
    (its process dead: its session closed), without waiting for the round's watcher to end the
    round. A worker whose collective broke because a peer node died must not spend a restart
    (seen under load: the worker's error reached its agent before the round was ended)."""
    with group(2, 2) as g:
        a, b = g.handlers
        g.round(0, 1)
        assert not a.member_lost() and not b.member_lost()
        assert b._heartbeat is not None
        b._heartbeat.stop()  # its session ends: as when its process dies
        took = until(a.member_lost, 5, "A sees B lost")
        print(f"\na member's session closed -> another sees it lost: {took:.3f}s")
