"""Rendezvous scenarios with real processes, run on each backend by ``test_rendezvous_native``
and ``test_rendezvous_etcd``: ``agents(min, max, **conf)`` makes an :class:`Agents` group."""

from __future__ import annotations

import time
from collections.abc import Callable

from rdzv_nodes import READY_WITHIN, Agents

Make = Callable[..., Agents]
NOTICE_WITHIN = 2.0  # s from SIGKILL to num_nodes_waiting() > 0 (etcd: plus the lease TTL)


def three_nodes_unique_deterministic_ranks(agents: Make) -> None:
    with agents(3, 3) as group:
        nodes = group.start_together([f"127.0.0.{i}" for i in (4, 2, 3)])
        rounds = [a.expect("round") for a in nodes]
        assert [r["rank"] for r in rounds] == [2, 0, 1]  # by address, not by arrival
        assert {r["world"] for r in rounds} == {3} and {r["round"] for r in rounds} == {1}
        assert len({r["boot"] for r in rounds}) == 1 and rounds[1]["boot"].startswith("127.0.0.2:")


def sigkill_gives_survivors_a_new_round(agents: Make) -> None:
    with agents(2, 3) as group:
        nodes = group.start_together([f"127.0.0.{i}" for i in (2, 3, 4)], rounds=2)
        first = [a.expect("round") for a in nodes]
        assert sorted(r["rank"] for r in first) == [0, 1, 2]
        killed_at = nodes[2].kill()
        waiting = [a.expect("waiting", 20) for a in nodes[:2]]
        second = [a.expect("round", 30) for a in nodes[:2]]
        assert [r["world"] for r in second] == [2, 2] and [r["rank"] for r in second] == [0, 1]
        assert not any(r["stale"] for r in second)  # a fresh worker store for round 2
        assert second[0]["boot"] != first[0]["boot"]
        noticed = max(w["t"] for w in waiting) - killed_at
        new_round = max(r["t"] for r in second) - killed_at
        print(f"SIGKILL -> num_nodes_waiting>0: {noticed:.3f}s; -> new round: {new_round:.3f}s")
        assert noticed < NOTICE_WITHIN + float(group.common["conf"].get("lease_ttl", 0))


def scale_up_one_two_three(agents: Make) -> None:
    with agents(1, 3) as group:
        a = group.start("127.0.0.2", rounds=3)
        a.expect("ready", READY_WITHIN)
        assert a.expect("round")["world"] == 1
        b = group.start("127.0.0.3", rounds=2)
        b.expect("ready", READY_WITHIN)
        a.expect("waiting")
        r2 = [a.expect("round"), b.expect("round")]
        assert [(r["round"], r["rank"], r["world"]) for r in r2] == [(2, 0, 2), (2, 1, 2)]
        c = group.start("127.0.0.4", rounds=1)
        c.expect("ready", READY_WITHIN)
        a.expect("waiting")
        b.expect("waiting")
        r3 = [a.expect("round"), b.expect("round"), c.expect("round")]
        assert [(r["round"], r["rank"], r["world"]) for r in r3] == [(3, 0, 3), (3, 1, 3), (3, 2, 3)]


def standby_replaces_a_dead_node(agents: Make) -> None:
    with agents(1, 2) as group:
        nodes = group.start_together([f"127.0.0.{i}" for i in (2, 3)], rounds=2)
        assert sorted(a.expect("round")["rank"] for a in nodes) == [0, 1]
        standby = group.start("127.0.0.4", rounds=1)
        standby.expect("ready", READY_WITHIN)  # torch imported: it joins next
        time.sleep(1.5)  # a full round is not disturbed by a standby
        assert all(a.events.empty() for a in nodes) and standby.events.empty()
        nodes[0].kill()
        nodes[1].expect("waiting", 20)
        got = [nodes[1].expect("round", 30), standby.expect("round", 30)]
        assert [(r["round"], r["rank"], r["world"]) for r in got] == [(2, 0, 2), (2, 1, 2)]


def interrupted_node_leaves_only_itself(agents: Make) -> None:
    with agents(1, 3) as group:
        *stays, leaves = group.start_together(
            [f"127.0.0.{i}" for i in (2, 3, 4)], rounds=2,
            per={"127.0.0.4": {"rounds": 1, "after": "shutdown"}},
        )
        for a in [*stays, leaves]:
            a.expect("round")
        assert leaves.expect("done")["closed"] is False
        for a in stays:
            a.expect("waiting", 20)
        got = [a.expect("round", 30) for a in stays]
        assert [(r["round"], r["world"]) for r in got] == [(2, 2), (2, 2)]


def join_timeout_names_who_joined(agents: Make) -> None:
    # join_timeout leaves both time to join on a loaded machine (1.5 s once did not: the second
    # was alive in the store and not yet joined when the first gave up)
    with agents(3, 3, join_timeout=3) as group:
        nodes = group.start_together([f"127.0.0.{i}" for i in (2, 3)], after="shutdown")
        errors = [a.expect("error", 30) for a in nodes]
        for addr, err in zip(("127.0.0.2", "127.0.0.3"), errors):
            assert err["type"] == "RendezvousTimeoutError"
            assert "join_timeout=3s" in err["msg"] and f"{addr}-" in err["msg"], err["msg"]
        # the first to give up saw both joined (the other may see it gone already)
        first = min(errors, key=lambda e: e["t"])["msg"]
        assert "127.0.0.2-" in first and "127.0.0.3-" in first, first
        assert "(2); missing: 1 more node(s) to reach min_nodes" in first, first


def closed_rendezvous_refuses_new_rounds(agents: Make) -> None:
    with agents(1, 2) as group:
        a = group.start("127.0.0.2", after="close")
        a.expect("ready", READY_WITHIN)
        a.expect("round")
        assert a.expect("done")["closed"] is True
        b = group.start("127.0.0.3")
        b.expect("ready", READY_WITHIN)
        assert b.expect("error")["type"] == "RendezvousClosedError"


def silent_node_dropped_within_the_lease_and_taken_back(agents: Make) -> None:
    """A node that goes silent without closing its sockets (SIGSTOP: as when partitioned or
    powered off) is dropped within the lease TTL (etcd: its lease expires; native: its
    heartbeat stops); when it comes back it enters the next round."""
    with agents(2, 3) as group:
        ttl = float(group.common["conf"]["lease_ttl"])
        a, b, c = group.start_together([f"127.0.0.{i}" for i in (2, 3, 4)], rounds=3,
                                       per={"127.0.0.4": {"rounds": 2}})
        assert [n.expect("round")["world"] for n in (a, b, c)] == [3, 3, 3]
        frozen_at = c.freeze()
        noticed = max(n.expect("waiting", 15)["t"] for n in (a, b)) - frozen_at
        second = [n.expect("round", 30) for n in (a, b)]
        assert [(r["round"], r["world"]) for r in second] == [(2, 2), (2, 2)]
        print(f"silent node (lease TTL {ttl:g}s) -> num_nodes_waiting>0: {noticed:.2f}s")
        assert noticed < 2 * ttl + 2
        c.thaw()
        for n in (a, b):
            n.expect("waiting", 15)
        third = [n.expect("round", 30) for n in (a, b, c)]
        assert [(r["round"], r["world"]) for r in third] == [(3, 3)] * 3
        assert [r["rank"] for r in third] == [0, 1, 2]


def failed_workers_rejoin_brings_the_others(agents: Make) -> None:
    """A node whose workers failed re-joins at once (torch's agent restarts them): the others
    are told (num_nodes_waiting > 0) and the same nodes form the next round with the same ranks.
    It re-joins once every node is in the first round (a round replaced before a node could use
    it is skipped by that node: see ``round_replaced_before_a_slow_node_connects``)."""
    with agents(1, 3) as group:
        nodes = group.start_together([f"127.0.0.{i}" for i in (2, 3, 4)], rounds=2,
                                     per={"127.0.0.3": {"rejoin_at_once": True}})
        first = [n.expect("round") for n in nodes]
        nodes[1].go()
        for n in (nodes[0], nodes[2]):
            n.expect("waiting", 20)
        second = [n.expect("round", 30) for n in nodes]
        assert [(r["round"], r["world"]) for r in second] == [(2, 3)] * 3
        assert [r["rank"] for r in second] == [r["rank"] for r in first] == [0, 1, 2]


SCENARIOS = [
    three_nodes_unique_deterministic_ranks,
    sigkill_gives_survivors_a_new_round,
    scale_up_one_two_three,
    standby_replaces_a_dead_node,
    interrupted_node_leaves_only_itself,
    join_timeout_names_who_joined,
    closed_rendezvous_refuses_new_rounds,
    silent_node_dropped_within_the_lease_and_taken_back,
    failed_workers_rejoin_brings_the_others,
]
